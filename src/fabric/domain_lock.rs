//! Serialises the calls into one rail's domain. Domains are opened FI_THREAD_DOMAIN (no
//! locking inside the provider), so every call on a domain's objects must come from one
//! thread at a time: normally the engine's driver, and with rail threads (engine::
//! rail_threads) also the rail's own progress thread. The driver has priority: a rail
//! thread only takes the lock when no driver call is waiting for it, so a rail thread that
//! polls in a loop never holds up posting.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

#[derive(Default)]
pub(crate) struct DomainLock {
    m: Mutex<()>,
    waiting: AtomicUsize,
}

impl DomainLock {
    /// Waits for the domain (the driver's posts, registrations, closes).
    pub(crate) fn lock(&self) -> MutexGuard<'_, ()> {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let g = self.m.lock().unwrap_or_else(|p| p.into_inner());
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        g
    }

    /// The domain if it is free now (the driver's completion polling: if a rail thread is
    /// inside, it is reading the same CQ and keeps what it reads for the driver).
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, ()>> {
        match self.m.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// As `try_lock`, but also steps aside while a `lock` caller waits (rail threads).
    pub(crate) fn try_lock_yielding(&self) -> Option<MutexGuard<'_, ()>> {
        if self.waiting.load(Ordering::Acquire) > 0 {
            return None;
        }
        self.try_lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_yielding_taker_steps_aside_for_a_waiter() {
        let l = DomainLock::default();
        let g = l.lock();
        assert!(l.try_lock().is_none() && l.try_lock_yielding().is_none());
        drop(g);
        assert!(l.try_lock_yielding().is_some());
        l.waiting.fetch_add(1, Ordering::AcqRel);
        assert!(l.try_lock_yielding().is_none(), "a waiting driver call goes first");
        assert!(l.try_lock().is_some());
    }
}
