//! Work handed to whoever owns the rails: posts, and closures that must run there. Callers
//! push from any thread; the driver takes everything at the start of a pass. Generic over
//! the owner so that this leaf names no driver type.
use super::request::Request;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A post, or any closure that must run where the rails are owned.
pub enum Submit<D> {
    Post(Arc<Request>),
    Task(Box<dyn FnOnce(&mut D) + Send>),
}

pub struct Inbox<D> {
    items: Mutex<Vec<Submit<D>>>,
    /// Set with every push: the progress thread checks it before sleeping, lock-free.
    pending: AtomicBool,
}

impl<D> Default for Inbox<D> {
    fn default() -> Self {
        Inbox { items: Mutex::new(Vec::new()), pending: AtomicBool::new(false) }
    }
}

impl<D> Inbox<D> {
    /// Queues `s`; the caller wakes the owner (Core::wake).
    pub fn push(&self, s: Submit<D>) {
        self.items.lock().unwrap_or_else(|p| p.into_inner()).push(s);
        self.pending.store(true, Ordering::SeqCst);
    }

    pub fn has_items(&self) -> bool {
        self.pending.load(Ordering::SeqCst)
    }

    pub fn take(&self) -> Vec<Submit<D>> {
        // A plain load first: the pass that finds nothing (most of them) then writes nothing
        // to the flag's cache line.
        if !self.pending.load(Ordering::Acquire) || !self.pending.swap(false, Ordering::SeqCst) {
            return Vec::new();
        }
        std::mem::take(&mut *self.items.lock().unwrap_or_else(|p| p.into_inner()))
    }
}
