//! Cutting descriptors into segments: bounds checks over a run of one registration pair, RMA
//! segments over the rails, packed staging chunks, and joining adjacent blocks.
use super::types::{Inputs, Pair};
use crate::engine::gpu::DeviceMem;
use crate::engine::peer::RoutePair;
use crate::engine::registry::LocalMem;
use crate::engine::remote::RemoteMem;
use crate::engine::request::{Route, Seg, SegKind};
use crate::engine::wire::MemDesc;
use crate::error::{Error, Result};
use std::sync::Arc;

/// The current registration pair's ranges, [start, end] on each side (end = last byte + 1,
/// with no overflow: a registration ending at the top of the address space is refused by
/// `check` as well), so that a descriptor's bounds check is four comparisons.
pub(super) struct Bounds {
    local: (u64, u64),
    remote: (u64, u64),
}

impl Bounds {
    pub(super) fn of(lm: &LocalMem, rm: &RemoteMem) -> Bounds {
        let (rb, rl) = rm.range();
        let end = |b: u64, l: u64| b.checked_add(l).unwrap_or(0);
        Bounds { local: (lm.base, end(lm.base, lm.len)), remote: (rb, end(rb, rl)) }
    }

    #[inline(always)]
    fn hold(&self, la: u64, ra: u64, len: u64) -> bool {
        let inside = |(b, e): (u64, u64), a: u64| a >= b && a <= e && len <= e - a;
        inside(self.local, la) && inside(self.remote, ra)
    }
}

/// A run of descriptors that name one registration pair.
pub(super) struct Run {
    pub(super) bounds: Bounds,
    pub(super) key: (usize, usize),
}

impl Run {
    /// Checks the run's descriptors from `first` on (lengths equal, inside both
    /// registrations), hands each one with bytes to `seg` (its index, local and remote
    /// (address, length, registration), and whether a segment of this run came before it),
    /// and returns the first descriptor of the next run. `count.0` counts descriptors read,
    /// `count.1` their bytes.
    #[inline(always)]
    pub(super) fn each<'a>(&self, pairs: &mut impl Iterator<Item = Result<Pair<'a>>>, first: Pair<'a>, count: (&mut usize, &mut u64),
                           mut seg: impl FnMut(usize, (u64, u64, &'a Arc<LocalMem>), (u64, u64, &'a Arc<RemoteMem>), bool)) -> Result<Option<Pair<'a>>> {
        let (i, bytes) = count;
        let mut p = first;
        let mut join = false;
        loop {
            let (la, ll, lm) = p.local;
            let (ra, rl, rm) = p.remote;
            if ll != rl {
                return Err(Error::InvalidParam(format!("descriptor {i}: local length {ll} != remote length {rl}")));
            }
            if !self.bounds.hold(la, ra, ll) {
                // (The checks that say why run only for a refusal.)
                lm.check(la, ll, &format!("local descriptor {i}"))?;
                rm.check(ra, rl).map_err(|e| Error::InvalidParam(format!("descriptor {i}: {e}")))?;
            }
            if ll != 0 {
                *bytes += ll;
                // (Segments join only within one registration pair: a device copy must not
                // span two allocations that merely happen to be adjacent.)
                seg(*i, p.local, p.remote, join);
                join = true;
            }
            *i += 1;
            match pairs.next() {
                None => return Ok(None),
                Some(q) => {
                    let q = q?;
                    if q.key() != self.key {
                        return Ok(Some(q));
                    }
                    p = q;
                }
            }
        }
    }
}

/// How a request's RMA descriptors spread over the peer's route.
pub(super) struct Spread<'r> {
    pub(super) count: usize,
    pub(super) small: bool,
    pub(super) route: &'r [RoutePair],
}

/// Cuts descriptor `i` between registered memories into RMA segments. Descriptors below the
/// striping threshold go to the rails in contiguous runs (the first 1/n of them on one rail,
/// the next on the next, starting where the previous request left off): consecutive segments
/// on one rail ride in one RMA operation, and alternating rails per descriptor broke that
/// (H200 host, tcp, 4096 x 4 KiB WRITE: 1.37 GB/s on one rail, 0.55 on two). Larger ones
/// stripe over every rail.
pub(super) fn rma_segs(inp: &Inputs, segs: &mut Vec<Seg>, spread: &Spread, i: usize, local: (u64, u64, &Arc<LocalMem>), remote: (u64, &MemDesc),
                       join: bool) {
    let ((la, ll, lm), (ra, desc)) = (local, remote);
    let route = spread.route;
    let n = route.len();
    let pieces = if ll >= inp.cfg.striping_threshold.max(1) && n > 1 && !spread.small { n as u64 } else { 1 };
    let first = if spread.small || pieces > 1 { 0 } else { (inp.rr_base + i * n / spread.count) % n };
    let piece = ll.div_ceil(pieces).next_multiple_of(4096);
    let (mut off, mut j) = (0, 0);
    while off < ll {
        let hop = route[(first + j) % n];
        let (rail, rrail) = (hop.rail as usize, hop.rrail as usize);
        let virt = hop.virt.unwrap_or(desc.virt_addr);
        let max = inp.shapes[rail].max_msg;
        let pend = (off + piece).min(ll);
        while off < pend {
            let plen = (pend - off).min(max);
            let raddr = if virt { ra + off } else { ra - desc.base + off };
            push(segs, Seg { local: la + off, len: plen, raddr, rkey: desc.keys[rrail], desc: lm.descs[rail], rail: rail as u16, rrail: rrail as u16, kind: SegKind::Rma }, max, join);
            off += plen;
        }
        j += 1;
    }
}

/// Appends a segment, or (`join`: the previous descriptor named the same registrations)
/// extends the previous one when this one continues it on both sides on the same rail
/// (adjacent KV blocks), up to `max` bytes: later per-segment work (ops, copy ranges, kernel
/// parameters) then counts ranges, not descriptors.
pub(super) fn push(segs: &mut Vec<Seg>, s: Seg, max: u64, join: bool) {
    if let (true, Some(last)) = (join, segs.last_mut()) {
        if last.local.wrapping_add(last.len) == s.local && last.raddr.wrapping_add(last.len) == s.raddr
            && last.rail == s.rail && last.rrail == s.rrail && last.len.saturating_add(s.len) <= max
            && last.kind.route() != Route::Staging {
            last.len += s.len;
            return;
        }
    }
    segs.push(s);
}

/// The staging chunk being filled while a request is planned: its rail pair, bytes and
/// blocks so far, and what its blocks share (kind, context or key, remote key).
#[derive(Default)]
pub(super) struct ChunkFill {
    hop: Option<RoutePair>,
    bytes: u64,
    blocks: u64,
    shared: (u8, usize, u64),
}

/// The rail pair of the next staging chunk: the pairs of `route` (the peer's bulk route) in
/// turn.
fn next_chunk_pair(inp: &Inputs, route: &[RoutePair]) -> RoutePair {
    route[inp.rr_chunks.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % route.len()]
}

/// Cuts a pair with staged device memory on either side into segments of packed staging
/// chunks: consecutive blocks fill one chunk (one rail pair) up to its bytes and block
/// count, a block that does not fit is cut at the chunk's end, and each new chunk takes the
/// next rail pair of the route, so a request's chunks go over every rail.
pub(super) fn staged_segs(inp: &Inputs, segs: &mut Vec<Seg>, fill: &mut ChunkFill, local: (u64, u64, &Arc<LocalMem>), remote: (u64, &MemDesc),
                          lstaged: Option<DeviceMem>, route: &[RoutePair]) {
    let (la, ll, lm) = local;
    let (ra, desc) = remote;
    let chunk = inp.chunk().max(1);
    let max_blocks = inp.cfg.staging_ranges.max(1);
    let mut off = 0;
    while off < ll {
        let shared = match lstaged {
            Some(d) => (if desc.staged { 2 } else { 1 }, d.ctx.id(), 0),
            None => (3, 0, lm.base),
        };
        let hop = match fill.hop {
            Some(h) if fill.bytes < chunk && fill.blocks < max_blocks && fill.shared == shared => h,
            _ => {
                let h = next_chunk_pair(inp, route);
                *fill = ChunkFill { hop: Some(h), bytes: 0, blocks: 0, shared };
                h
            }
        };
        let len = (chunk - fill.bytes).min(ll - off);
        let (rail, rrail) = (hop.rail as usize, hop.rrail as usize);
        let (kind, raddr, rkey) = match (lstaged, desc.staged) {
            (Some(d), false) => {
                let raddr = if hop.virt.unwrap_or(desc.virt_addr) { ra + off } else { ra - desc.base + off };
                (SegKind::DevToHost { ctx: d.ctx }, raddr, desc.keys[rrail])
            }
            (None, _) => {
                let self_addr = if inp.shapes[rail].virt_addr { la + off } else { la - lm.base + off };
                (SegKind::HostToDev { self_addr, self_key: lm.keys[rail], owner_rma: !desc.staged }, ra + off, 0)
            }
            (Some(d), true) => (SegKind::DevToDev { ctx: d.ctx }, ra + off, 0),
        };
        if fill.blocks > 0 && rkey != 0 && segs.last().is_some_and(|s| s.rkey != rkey) {
            // Another remote registration: a chunk's RMA names one key.
            fill.hop = None;
            continue;
        }
        segs.push(Seg { local: la + off, len, raddr, rkey, desc: lm.descs[rail], rail: rail as u16, rrail: rrail as u16, kind });
        fill.bytes += len;
        fill.blocks += 1;
        off += len;
    }
}
