//! The pool of operation contexts handed to libfabric. Each posted operation carries a
//! pointer to one slot; the slot's first bytes are the provider's scratch space
//! (FI_CONTEXT/FI_CONTEXT2), the rest says what the completion belongs to. Slots are boxed
//! so their addresses stay put while the pool grows, and recycled, so posting allocates
//! nothing once the pool is warm.
use super::request::Request;
use std::ffi::c_void;
use std::sync::Arc;

pub enum OpKind {
    Free,
    /// An operation a transport posted; its completion goes back to that transport.
    Transport(TOp),
    /// A control message leaving from send buffer `buf`, possibly completing a request's
    /// notification phase.
    Send { buf: u32, req: Option<(Arc<Request>, u64)>, notif: bool },
    /// A pre-posted control receive into buffer `buf`.
    Recv { buf: u32 },
}

/// A transport's operation: `owner` is the transport's place in the driver's list, the
/// rest is the transport's own note of what the operation was for. `req`/`epoch` name the
/// post it belongs to, if any (the driver takes back a failed request's queued operations
/// by it); `rail` the rail whose in-flight slot it holds (`slot`); `inline`: shm's fast
/// RMA, which the provider finishes inside the post call.
pub struct TOp {
    pub owner: u8,
    /// The transport's own kind of operation (e.g. a chunk's RMA or one it serves).
    pub tag: u8,
    pub rail: u16,
    pub slot: bool,
    pub inline: bool,
    pub req: Option<Arc<Request>>,
    pub epoch: u64,
    pub token: u64,
    pub len: u64,
}

impl TOp {
    pub fn is_of(&self, req: &Arc<Request>) -> bool {
        self.req.as_ref().is_some_and(|r| Arc::ptr_eq(r, req))
    }

    pub fn peer_id(&self) -> Option<u64> {
        self.req.as_ref().and_then(|r| r.peer().map(|p| p.id))
    }
}

#[repr(C)]
pub struct OpCtx {
    /// Scratch the provider may use while it owns the operation (fi_context2 is 8 words).
    scratch: [*mut c_void; 8],
    index: u32,
    pub kind: OpKind,
}

#[derive(Default)]
pub struct OpPool {
    // Boxed: each slot's address is handed to the provider and must not move when the
    // vector grows.
    #[allow(clippy::vec_box)]
    slots: Vec<Box<OpCtx>>,
    free: Vec<u32>,
    in_use: usize,
}

// SAFETY: the pool is owned by the driver; the scratch pointers are only written by the
// provider while it owns a slot.
unsafe impl Send for OpPool {}

impl OpPool {
    pub fn with_capacity(n: usize) -> OpPool {
        let mut p = OpPool::default();
        p.grow(n);
        p
    }

    fn grow(&mut self, n: usize) {
        let start = self.slots.len() as u32;
        for i in 0..n as u32 {
            self.slots.push(Box::new(OpCtx { scratch: [std::ptr::null_mut(); 8], index: start + i, kind: OpKind::Free }));
        }
        self.free.extend((start..start + n as u32).rev());
    }

    /// A context pointer for a new operation of `kind`.
    pub fn alloc(&mut self, kind: OpKind) -> *mut c_void {
        if self.free.is_empty() {
            self.grow(self.slots.len().max(64));
        }
        let i = self.free.pop().expect("pool grew") as usize;
        let slot = &mut self.slots[i];
        slot.kind = kind;
        slot.scratch = [std::ptr::null_mut(); 8];
        self.in_use += 1;
        &mut **slot as *mut OpCtx as *mut c_void
    }

    /// Returns the slot of a context pointer to the pool and gives back what it was for.
    /// A pointer that is not one of ours yields None (and is logged by the caller).
    /// Frees every live operation `f` selects and returns what they were.
    pub fn take_where(&mut self, f: impl Fn(&OpKind) -> bool) -> Vec<OpKind> {
        let mut out = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if !matches!(slot.kind, OpKind::Free) && f(&slot.kind) {
                out.push(std::mem::replace(&mut slot.kind, OpKind::Free));
                self.free.push(i as u32);
                self.in_use -= 1;
            }
        }
        out
    }

    /// Frees the operations toward peer `peer_id` that shm's fast RMA finished inside the
    /// post call (their completion is read, or will never come) and returns them.
    pub fn take_inline_for(&mut self, peer_id: u64) -> Vec<TOp> {
        let inline = |k: &OpKind| matches!(k, OpKind::Transport(t) if t.inline && t.peer_id() == Some(peer_id));
        self.take_where(inline).into_iter().filter_map(|k| match k {
            OpKind::Transport(t) => Some(t),
            _ => None,
        }).collect()
    }

    /// Takes `req`'s operations still waiting in rail outboxes back (never posted now) and
    /// frees their slots.
    pub fn take_queued_of(&mut self, rails: &[Arc<dyn super::port::Port>], req: &Arc<Request>) -> Vec<TOp> {
        let mut out = Vec::new();
        for rail in rails.iter().filter(|r| r.has_queued()) {
            for ctx in rail.take_queued_with(&|ctx| matches!(self.kind_of(ctx), Some(OpKind::Transport(t)) if t.is_of(req))) {
                if let Some(OpKind::Transport(t)) = self.release(ctx) {
                    out.push(t);
                }
            }
        }
        out
    }

    /// The slot `ctx` points at, if it is exactly one of ours.
    fn slot_of(&self, ctx: *mut c_void) -> Option<usize> {
        if ctx.is_null() {
            return None;
        }
        // SAFETY: we only read the index after checking the pointer is exactly the address
        // of the slot with that index, so a foreign pointer is never dereferenced further
        // than the index field of something the provider handed back to us.
        let index = unsafe { (*(ctx as *const OpCtx)).index } as usize;
        let slot = self.slots.get(index)?;
        (&**slot as *const OpCtx as *mut c_void == ctx).then_some(index)
    }

    /// What an operation we allocated is for (None for anything else, or a free slot).
    pub fn kind_of(&self, ctx: *mut c_void) -> Option<&OpKind> {
        let kind = &self.slots[self.slot_of(ctx)?].kind;
        (!matches!(kind, OpKind::Free)).then_some(kind)
    }

    pub fn release(&mut self, ctx: *mut c_void) -> Option<OpKind> {
        let index = self.slot_of(ctx)?;
        let kind = std::mem::replace(&mut self.slots[index].kind, OpKind::Free);
        if matches!(kind, OpKind::Free) {
            return None;
        }
        self.free.push(index as u32);
        self.in_use -= 1;
        Some(kind)
    }

    /// Operations the provider currently owns.
    #[cfg(test)]
    pub fn in_use(&self) -> usize {
        self.in_use
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn slots_recycle_and_foreign_pointers_are_refused() {
        let mut p = OpPool::with_capacity(2);
        let a = p.alloc(OpKind::Recv { buf: 1 });
        let b = p.alloc(OpKind::Recv { buf: 2 });
        let c = p.alloc(OpKind::Recv { buf: 3 });
        assert_eq!(p.in_use(), 3);
        assert!(matches!(p.release(b), Some(OpKind::Recv { buf: 2 })));
        assert!(p.release(b).is_none(), "double release");
        assert!(p.release(std::ptr::null_mut()).is_none());
        let d = p.alloc(OpKind::Recv { buf: 4 });
        assert_eq!(d, b, "freed slot reused");
        for x in [a, c, d] {
            assert!(p.release(x).is_some());
        }
        assert_eq!(p.in_use(), 0);
    }
}
