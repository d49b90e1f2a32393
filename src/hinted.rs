//! A collection behind a mutex with a lock-free hint of whether it holds anything: for the
//! queues a progress pass looks at every time and almost always finds empty (the rail's
//! stash of completions a rail thread read, MRs waiting to be closed, notifications that
//! came). Locking and unlocking them for nothing was a tenth of an idle pass with the
//! progress thread off (perf, tcp 4 KiB READ, CPU VM), and every pass of a caller waiting on
//! a small transfer is one.
use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// What the hint tracks: whether the collection is empty.
pub trait Emptiness {
    fn is_empty(&self) -> bool;
}

impl<T> Emptiness for Vec<T> {
    fn is_empty(&self) -> bool {
        Vec::is_empty(self)
    }
}

impl<T> Emptiness for VecDeque<T> {
    fn is_empty(&self) -> bool {
        VecDeque::is_empty(self)
    }
}

#[derive(Default)]
pub struct Hinted<T: Emptiness> {
    items: Mutex<T>,
    /// Set, under the lock, whenever a guard goes away: true iff the items were not empty.
    any: AtomicBool,
}

/// The items, locked; the hint is brought up to date when the guard goes away (before the
/// lock is released).
pub struct HintedGuard<'a, T: Emptiness> {
    guard: MutexGuard<'a, T>,
    any: &'a AtomicBool,
}

impl<T: Emptiness> Hinted<T> {
    pub fn new(items: T) -> Hinted<T> {
        let any = AtomicBool::new(!items.is_empty());
        Hinted { items: Mutex::new(items), any }
    }

    /// The items, locked (a poisoned lock is taken over: the items stay consistent, every
    /// change is one call on them).
    pub fn lock(&self) -> HintedGuard<'_, T> {
        HintedGuard { guard: self.items.lock().unwrap_or_else(|p| p.into_inner()), any: &self.any }
    }

    /// The items, locked, unless the hint says there are none. A push racing with this
    /// look may be missed; callers look again on their next pass, or (the rail's stash)
    /// look again under the lock that every push holds.
    pub fn lock_if_any(&self) -> Option<HintedGuard<'_, T>> {
        self.maybe_any().then(|| self.lock())
    }

    /// Whether the last guard left anything behind.
    pub fn maybe_any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }
}

impl<T: Emptiness> Deref for HintedGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T: Emptiness> DerefMut for HintedGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T: Emptiness> Drop for HintedGuard<'_, T> {
    fn drop(&mut self) {
        // Still under the lock: `guard` is dropped after this.
        self.any.store(!self.guard.is_empty(), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hint_follows_every_change_made_through_a_guard() {
        let h: Hinted<Vec<u32>> = Hinted::default();
        assert!(!h.maybe_any() && h.lock_if_any().is_none());
        h.lock().push(7);
        assert!(h.maybe_any());
        let got = std::mem::take(&mut *h.lock_if_any().expect("one item"));
        assert_eq!(got, vec![7]);
        assert!(!h.maybe_any(), "emptied through the guard");
        assert!(Hinted::new(vec![1]).maybe_any());
    }

    #[test]
    fn a_push_from_another_thread_is_seen_once_its_guard_is_gone() {
        let h: std::sync::Arc<Hinted<VecDeque<u32>>> = std::sync::Arc::default();
        let h2 = h.clone();
        std::thread::spawn(move || h2.lock().push_back(3)).join().expect("pusher");
        assert_eq!(h.lock_if_any().map(|mut g| g.pop_front()), Some(Some(3)));
    }
}
