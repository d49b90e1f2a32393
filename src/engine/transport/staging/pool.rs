//! The bounce pool of staging: one pinned allocation cut into chunk-sized slots, registered
//! on every rail, with a CUDA stream per context for the copies in and out of it; and the
//! generation-tagged slab that names chunks in flight.
use crate::cuda;
use super::super::Cx;
use crate::engine::core::Core;
use crate::engine::ops::{OpKind, OpPool};
use crate::engine::port::{Mr, Port};
use crate::error::{Error, Result};
use crate::fabric::{FiAddr, Posted, RmaSeg};
use std::collections::HashMap;
use std::sync::Arc;

/// Requests we start may hold at most half the slots, so serving peers' stage requests
/// always has room and two engines staging into each other cannot deadlock.
pub struct Stager {
    // Field order is drop order: MRs close before the memory is freed.
    mrs: Vec<Mr>,
    buf: cuda::PinnedBuffer,
    pub chunk: usize,
    free: Vec<u32>,
    own_cap: usize,
    own_held: usize,
    streams: HashMap<usize, cuda::Stream>,
}

impl Stager {
    pub fn new(owner: &str, ctx: &cuda::Context, rails: &[Arc<dyn Port>], size: usize, chunk: usize, next_key: &mut u64) -> Result<Stager> {
        let chunk = chunk.clamp(4096, size.max(4096));
        let n = (size / chunk).max(2);
        let buf = cuda::PinnedBuffer::new(ctx, n * chunk)?;
        let mut mrs = Vec::with_capacity(rails.len());
        for r in rails {
            *next_key += 1;
            // SAFETY: the pinned buffer is owned by the pool, whose MRs drop before it.
            mrs.push(unsafe { r.register(buf.ptr(), buf.len(), *next_key, None) }?);
        }
        log::info!("{owner}: staging pool: {n} slots of {chunk} bytes ({} MiB pinned)", (n * chunk) >> 20);
        Ok(Stager { mrs, buf, chunk, free: (0..n as u32).rev().collect(), own_cap: (n / 2).max(1), own_held: 0, streams: HashMap::new() })
    }

    pub fn slot_ptr(&self, i: u32) -> *mut u8 {
        // SAFETY: i < slot count, so the offset stays inside the allocation.
        unsafe { self.buf.ptr().add(i as usize * self.chunk) }
    }

    /// Slot `i` as a peer's RMA on rail 0 must address it, and the key it names it by.
    pub fn rma_target(&self, i: u32, virt: bool) -> (u64, u64) {
        let addr = if virt { self.slot_ptr(i) as u64 } else { i as u64 * self.chunk as u64 };
        (addr, self.mrs.first().map_or(0, |m| m.key))
    }

    /// A free slot: for one of our chunks (`own`, at most half the pool) or a serve.
    pub fn take(&mut self, own: bool) -> Option<u32> {
        if own && self.own_held >= self.own_cap {
            return None;
        }
        let s = self.free.pop()?;
        self.own_held += own as usize;
        Some(s)
    }

    pub fn give(&mut self, slot: u32, own: bool) {
        self.own_held -= own as usize;
        self.free.push(slot);
    }

    fn stream(&mut self, ctx: cuda::Context) -> Result<&cuda::Stream> {
        Ok(match self.streams.entry(ctx.id()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(cuda::Stream::new(&ctx)?),
        })
    }

    /// Queues a device copy between `dev` and slot `slot` on the context's stream (`out`:
    /// device to host), under the context (rule 4). Returns the event that completes after it.
    pub fn copy(&mut self, core: &Core, ctx: cuda::Context, slot: u32, dev: u64, len: usize, out: bool) -> Result<cuda::Event> {
        core.apply_ctx(&ctx)?;
        let host = self.slot_ptr(slot);
        let stream = self.stream(ctx)?;
        // SAFETY: the slot is held by this chunk until its event completes; `dev` was
        // bounds-checked against a live device registration that the request or serve
        // entry keeps alive.
        unsafe {
            if out {
                stream.copy_dtoh_async(host, dev, len)?;
            } else {
                stream.copy_htod_async(dev, host, len)?;
            }
        }
        Ok(stream.record()?)
    }

    /// Posts one RMA between slot `slot` and the peer's `[raddr, +len)` on `rail`, once: on
    /// FI_EAGAIN the caller keeps the chunk where it is and posts the same operation again.
    #[allow(clippy::too_many_arguments)]
    pub fn post(&self, rail: &dyn Port, ops: &mut OpPool, op: OpKind, slot: u32, write: bool, dest: FiAddr, raddr: u64, rkey: u64, len: usize) -> Result<Posted> {
        let mr = self.mrs.get(rail.index()).ok_or_else(|| Error::Backend(format!("no staging MR on rail {}", rail.index())))?;
        let seg = RmaSeg { local: self.slot_ptr(slot), len, desc: mr.desc, raddr, rkey };
        let ctx = ops.alloc(op);
        // SAFETY: the slot is registered on this rail (its MR) and held by the chunk until
        // this operation completes (the pool outlives the rails' users); ctx is a live slot.
        let r = unsafe { rail.rma(write, &[seg], dest, ctx, false, write) };
        if !matches!(r, Ok(Posted::Ok)) {
            ops.release(ctx);
        }
        r
    }
}

/// The pool, created on first use under the context of the memory that needs it.
pub fn ensure<'a>(pool: &'a mut Option<Stager>, cx: &Cx, ctx: &cuda::Context, next_key: &mut u64) -> Result<&'a mut Stager> {
    if pool.is_none() {
        let cfg = &cx.core.cfg;
        let (size, chunk) = (cfg.staging_buffer_size as usize, cfg.staging_chunk_size as usize);
        *pool = Some(Stager::new(&cx.core.name, ctx, cx.rails, size, chunk, next_key)?);
    }
    pool.as_mut().ok_or_else(|| Error::Backend("no staging pool".into()))
}
