//! The bounce pool of staging: one pinned allocation cut into chunk-sized slots, registered
//! on every rail, with two CUDA streams per context (gathers out of device memory on one,
//! scatters into it on the other, so chunks going both ways overlap) and the gather-copy
//! kernel per context that packs a chunk's many device ranges with one launch.
use crate::cuda;
use super::copies::{Copies, Queued, StreamKey};
use super::super::Cx;
use crate::engine::core::Core;
use crate::engine::counters::add;
use crate::engine::ops::{OpKind, OpPool};
use crate::engine::port::{Mr, Port};
use crate::error::{Error, Result};
use crate::fabric::{FiAddr, Posted, RmaSeg};
use std::collections::HashMap;
use std::sync::Arc;

/// Chunks whose ranges average at least this many bytes go to the copy engines, one copy
/// per range; chunks of smaller ranges take one gather-kernel launch. A copy costs ~2 us
/// plus its bytes, the kernel ~22-25 us for a 1 MiB chunk of any shape (H200: 4 x 256 KiB
/// 25-29 us by copies; 64 x 16 KiB 138-179 against 22-25), so big ranges cost the same
/// either way; but a kernel shares the SMs with the peer's kernels where both engines use
/// one GPU, and there READs of 256 KiB blocks waited 450-700 us for their gathers.
const COPY_ENGINE_MIN_AVG: usize = 128 << 10;

/// One RMA piece of a chunk: (offset in the slot, peer's address, length); for a lent
/// chunk read into our host memory, (our address, the owner's address, length).
pub type Piece = (usize, u64, usize);

/// Requests we start may hold at most half the slots, so serving peers' stage requests
/// always has room and two engines staging into each other cannot deadlock.
pub struct Stager {
    // Field order is drop order: kernels unload and MRs close before the memory is freed.
    kernels: HashMap<usize, Option<cuda::CopyKernel>>,
    mrs: Vec<Mr>,
    buf: cuda::PinnedBuffer,
    pub chunk: usize,
    free: Vec<u32>,
    own_cap: usize,
    own_held: usize,
    /// (context id, out) -> stream, one for the pool's life (copies.rs numbers the copies
    /// queued on each).
    streams: HashMap<StreamKey, cuda::Stream>,
    /// The copies queued on those streams, in order (copies.rs).
    copies: Copies,
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
        log::info!("{owner}: staging pool: {n} slots of {chunk} bytes ({} MiB pinned, {} rails)", (n * chunk) >> 20, rails.len());
        Ok(Stager { kernels: HashMap::new(), mrs, buf, chunk, free: (0..n as u32).rev().collect(), own_cap: (n / 2).max(1), own_held: 0, streams: HashMap::new(), copies: Copies::default() })
    }

    pub fn slot_ptr(&self, i: u32) -> *mut u8 {
        // SAFETY: i < slot count, so the offset stays inside the allocation.
        unsafe { self.buf.ptr().add(i as usize * self.chunk) }
    }

    /// Slot `i` as a peer's RMA toward our rail `rail` must address it, and the key it
    /// names it by there.
    pub fn rma_target(&self, i: u32, rail: usize, virt: bool) -> Result<(u64, u64)> {
        let mr = self.mrs.get(rail).ok_or_else(|| Error::Backend(format!("no staging MR on rail {rail}")))?;
        let addr = if virt { self.slot_ptr(i) as u64 } else { i as u64 * self.chunk as u64 };
        Ok((addr, mr.key))
    }

    /// Free slots now.
    #[cfg(test)]
    pub fn free_slots(&self) -> usize {
        self.free.len()
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

    /// A new progress pass (copies.rs: what was pending may be done now).
    pub fn new_pass(&mut self) {
        self.copies.new_pass();
    }

    fn stream(&mut self, ctx: cuda::Context, out: bool) -> Result<&cuda::Stream> {
        Ok(match self.streams.entry((ctx.id(), out)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(cuda::Stream::new(&ctx)?),
        })
    }

    fn kernel(&mut self, core: &Core, ctx: cuda::Context) -> Option<&cuda::CopyKernel> {
        if !core.cfg.gpu_copy_kernel {
            return None;
        }
        super::super::copy_kernel(&mut self.kernels, ctx, &core.name, "staging packs GPU blocks with one gather/scatter launch per chunk",
                                  "staged blocks are copied one by one")
    }

    /// Queues the device copies of one chunk between device `ranges` (address, length) and
    /// slot `slot`, packed back to back in range order (`out`: device to slot, a gather;
    /// else a scatter), on the context's stream of that direction, under the context (rule
    /// 4): one copy per range for large ranges, one gather-kernel launch for many small
    /// ones (pinned memory is addressable by kernels under unified addressing), one copy
    /// per range where the kernel cannot run. Returns the copy, which `copied` says is done
    /// once all of them are.
    pub fn copy(&mut self, core: &Core, ctx: cuda::Context, slot: u32, ranges: &[(u64, usize)], out: bool) -> Result<Queued> {
        let reuse = self.copies.reusable((ctx.id(), out));
        let ev = self.queue_copy(core, ctx, slot, ranges, out, reuse)?;
        Ok(self.copies.queued((ctx.id(), out), ev))
    }

    /// `copy`'s copies on the stream, and the event recorded after them (`reuse`, where a
    /// done copy's is free, else a new one).
    fn queue_copy(&mut self, core: &Core, ctx: cuda::Context, slot: u32, ranges: &[(u64, usize)], out: bool, reuse: Option<cuda::Event>) -> Result<cuda::Event> {
        let total: usize = ranges.iter().map(|r| r.1).sum();
        if total > self.chunk || ranges.is_empty() {
            return Err(Error::Backend(format!("a staged chunk of {total} bytes in {} ranges does not fit a {}-byte slot", ranges.len(), self.chunk)));
        }
        core.apply_ctx(&ctx)?;
        let host = self.slot_ptr(slot) as u64;
        self.stream(ctx, out)?;
        if ranges.len() > 1 && total / ranges.len() < COPY_ENGINE_MIN_AVG && self.kernel(core, ctx).is_some() {
            let mut copies = Vec::with_capacity(ranges.len());
            let mut off = 0u64;
            for &(dev, len) in ranges {
                copies.push(if out { (host + off, dev, len) } else { (dev, host + off, len) });
                off += len as u64;
            }
            let (Some(Some(k)), Some(stream)) = (self.kernels.get(&ctx.id()), self.streams.get(&(ctx.id(), out))) else {
                return Err(Error::Backend("staging stream vanished".into()));
            };
            // SAFETY: the slot is held by this chunk until the event completes; every
            // device range was bounds-checked against a live device registration that the
            // request or serve keeps alive until then.
            match unsafe { k.launch(stream, &copies) } {
                Ok(n) => {
                    add(&core.counters.gpu_kernel_launches, n as u64);
                    return record(stream, reuse);
                }
                Err(e) => {
                    // Nothing of this group was queued past the failed launch; earlier
                    // launches of it (a driver with the small parameter block) are on the
                    // stream, and the copies below repeat their bytes after them.
                    log::info!("{}: the gather-copy kernel failed to launch ({e}); staged blocks are copied one by one", core.name);
                    self.kernels.insert(ctx.id(), None);
                }
            }
        }
        let stream = self.stream(ctx, out)?;
        let mut off = 0usize;
        for &(dev, len) in ranges {
            // SAFETY: as above; `off + len` stays inside the slot (total <= chunk).
            unsafe {
                let at = (host as *mut u8).add(off);
                if out {
                    stream.copy_dtoh_async(at, dev, len)?;
                } else {
                    stream.copy_htod_async(dev, at, len)?;
                }
            }
            off += len;
        }
        add(&core.counters.gpu_copy_calls, ranges.len() as u64);
        record(stream, reuse)
    }

    /// Posts one RMA operation between slot `slot` and the peer on `rail`: `pieces` (at most
    /// the rail's batch) of (slot offset, peer address, length), all under `rkey`. On a rail
    /// with its own thread it goes through the thread's outbox. FI_EAGAIN: the caller keeps
    /// the chunk where it is and posts the same operation again.
    #[allow(clippy::too_many_arguments)]
    pub fn post(&self, rail: &dyn Port, core: &Core, ops: &mut OpPool, op: OpKind, slot: u32, write: bool, dest: FiAddr, pieces: &[Piece], rkey: u64) -> Result<Posted> {
        let mr = self.mrs.get(rail.index()).ok_or_else(|| Error::Backend(format!("no staging MR on rail {}", rail.index())))?;
        if pieces.is_empty() || pieces.len() > crate::fabric::MAX_RMA_BATCH || pieces.iter().any(|p| p.0 + p.2 > self.chunk) {
            return Err(Error::Backend("a staged RMA outside its slot".into()));
        }
        let base = self.slot_ptr(slot);
        let mut segs = [RmaSeg { local: base, len: 0, desc: mr.desc, raddr: 0, rkey }; crate::fabric::MAX_RMA_BATCH];
        for (s, &(off, raddr, len)) in segs.iter_mut().zip(pieces) {
            // SAFETY: off + len <= chunk (checked above): inside the slot.
            s.local = unsafe { base.add(off) };
            s.len = len;
            s.raddr = raddr;
        }
        // SAFETY: the slot is registered on this rail (its MR) and held by the chunk until
        // this operation completes or is taken back unposted (the pool outlives the rails'
        // users).
        unsafe { post_segs(rail, core, ops, op, write, dest, &segs[..pieces.len()]) }
    }
}

/// An event recorded on `stream` after what is queued there: `reuse` recorded again, or a new
/// one.
fn record(stream: &cuda::Stream, reuse: Option<cuda::Event>) -> Result<cuda::Event> {
    match reuse {
        Some(ev) => {
            stream.record_event(&ev)?;
            Ok(ev)
        }
        None => Ok(stream.record()?),
    }
}

/// Posts one RMA operation of `segs` on `rail`, through the rail thread's outbox where it
/// has one. FI_EAGAIN: the caller posts the same operation again later.
///
/// # Safety
/// Every segment's local memory is registered on this rail as its `desc` says and stays
/// valid, and untouched by anyone else, until the operation completes or is taken back
/// unposted.
#[allow(clippy::too_many_arguments)]
pub unsafe fn post_segs(rail: &dyn Port, core: &Core, ops: &mut OpPool, op: OpKind, write: bool, dest: FiAddr, segs: &[RmaSeg]) -> Result<Posted> {
    let ctx = ops.alloc(op);
    // SAFETY: the caller's contract covers the memory; ctx is a live slot of the op pool
    // until its completion (or the rejection below) releases it.
    let r = unsafe {
        if rail.posts_on_thread() {
            core.note_rail_traffic();
            rail.queue_rma(write, segs, dest, ctx, write)
        } else {
            rail.rma(write, segs, dest, ctx, false, write)
        }
    };
    if !matches!(r, Ok(Posted::Ok)) {
        ops.release(ctx);
    }
    r
}

/// Posts one RMA operation of `pieces` that name our own addresses rather than slot
/// offsets: (our address, peer address, length), all under `rkey`, each with the MR
/// descriptor `desc` gives for its memory on `rail` (an Err there fails the post).
///
/// # Safety
/// As [`post_segs`]: every piece's memory is registered on this rail as `desc` says and
/// stays valid, and untouched by anyone else, until the operation completes or is taken
/// back unposted.
#[allow(clippy::too_many_arguments)]
pub unsafe fn post_local(rail: &dyn Port, core: &Core, ops: &mut OpPool, op: OpKind, write: bool, dest: FiAddr, pieces: &[Piece], rkey: u64,
                         mut desc: impl FnMut(usize, usize) -> Result<*mut std::ffi::c_void>) -> Result<Posted> {
    if pieces.is_empty() || pieces.len() > crate::fabric::MAX_RMA_BATCH {
        return Err(Error::Backend(format!("an RMA of {} pieces (1 to {})", pieces.len(), crate::fabric::MAX_RMA_BATCH)));
    }
    let mut segs = [RmaSeg { local: std::ptr::null_mut(), len: 0, desc: std::ptr::null_mut(), raddr: 0, rkey }; crate::fabric::MAX_RMA_BATCH];
    for (s, &(local, raddr, len)) in segs.iter_mut().zip(pieces) {
        *s = RmaSeg { local: local as *mut u8, len, desc: desc(local, len)?, raddr, rkey };
    }
    // SAFETY: the caller's contract, with each segment's descriptor from `desc`.
    unsafe { post_segs(rail, core, ops, op, write, dest, &segs[..pieces.len()]) }
}

/// The RMA operations of a lent chunk read straight into our registered host memory:
/// (our address, the owner's address in its slot, length) per piece, the chunk's ranges
/// packed back to back from `slot_addr` in range order, ranges that continue each other on
/// both sides merged, in operations of at most `batch` pieces.
pub fn lent_to_host_ops(ranges: impl Iterator<Item = (u64, usize)>, slot_addr: u64, batch: usize) -> Vec<Vec<Piece>> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut off = 0u64;
    for (local, len) in ranges {
        match pieces.last_mut() {
            Some(last) if last.0 as u64 + last.2 as u64 == local => last.2 += len,
            _ => pieces.push((local as usize, slot_addr + off, len)),
        }
        off += len as u64;
    }
    pieces.chunks(batch.clamp(1, crate::fabric::MAX_RMA_BATCH)).map(|c| c.to_vec()).collect()
}

/// The RMA operations of a chunk: its ranges (peer address, length) packed back to back in
/// the slot, those that continue each other on both sides merged, in operations of at most
/// `batch` pieces.
pub fn rma_ops(ranges: impl Iterator<Item = (u64, usize)>, batch: usize) -> Vec<Vec<Piece>> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut off = 0;
    for (raddr, len) in ranges {
        match pieces.last_mut() {
            Some(last) if last.1 + last.2 as u64 == raddr => last.2 += len,
            _ => pieces.push((off, raddr, len)),
        }
        off += len;
    }
    pieces.chunks(batch.clamp(1, crate::fabric::MAX_RMA_BATCH)).map(|c| c.to_vec()).collect()
}

/// Whether copy `q`, queued by `pool`, is done (copies.rs).
pub fn copied(pool: &mut Option<Stager>, core: &Core, q: &Queued) -> Result<bool> {
    pool.as_mut().ok_or_else(|| Error::Backend("no staging pool".into()))?.copies.done(core, q)
}

/// The pool, created on first use under the context of the memory that needs it, sized
/// from the rails (config staging_chunk / staging_pool).
pub fn ensure<'a>(pool: &'a mut Option<Stager>, cx: &Cx, ctx: &cuda::Context, next_key: &mut u64) -> Result<&'a mut Stager> {
    if pool.is_none() {
        let cfg = &cx.core.cfg;
        let provider = cx.rails.first().map_or("", |r| r.caps().prov_name.as_str());
        let chunk = cfg.staging_chunk(provider);
        let size = cfg.staging_pool(cx.rails.len(), chunk);
        *pool = Some(Stager::new(&cx.core.name, ctx, cx.rails, size as usize, chunk as usize, next_key)?);
    }
    pool.as_mut().ok_or_else(|| Error::Backend("no staging pool".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rma_ops_merge_what_continues_and_respect_the_batch() {
        // Three blocks back to back at the peer, then a gap, then two more.
        let r = [(0x1000, 16), (0x1010, 16), (0x1020, 16), (0x5000, 8), (0x9000, 8)];
        let ops = rma_ops(r.iter().copied(), 2);
        assert_eq!(ops, vec![vec![(0, 0x1000, 48), (48, 0x5000, 8)], vec![(56, 0x9000, 8)]]);
        // A contiguous slot window (the peer's bounce slot): one piece.
        let ops = rma_ops((0..64u64).map(|i| (0x10_0000 + i * 4096, 4096)), 4);
        assert_eq!(ops, vec![vec![(0, 0x10_0000, 64 * 4096)]]);
    }

    #[test]
    fn a_lent_chunk_into_host_memory_merges_what_continues_here() {
        // Two blocks back to back in our memory, then one elsewhere: the owner's slot holds
        // all three back to back.
        let r = [(0x1000u64, 16usize), (0x1010, 16), (0x8000, 32)];
        let ops = lent_to_host_ops(r.iter().copied(), 0x70_0000, 8);
        assert_eq!(ops, vec![vec![(0x1000, 0x70_0000, 32), (0x8000, 0x70_0020, 32)]]);
        let ops = lent_to_host_ops(r.iter().copied(), 0x70_0000, 1);
        assert_eq!(ops.len(), 2);
    }
}
