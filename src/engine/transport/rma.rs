//! RMA over the rails between registered memories: host memory, or device memory the
//! provider registered (FI_HMEM). Consecutive segments to the same remote rail ride in one
//! operation; a rail with its own thread gets its RMA through the rail's outbox.
//!
//! Done means delivered (rule 6), per rail and peer, the cheapest of: the provider copies
//! inside the post (shm fast RMA to a CMA-reachable peer), FI_DELIVERY_COMPLETE, or
//! transmit-complete plus one flush read per rail the post wrote on (providers that order
//! a read after writes, FI_ORDER_RAW), posted right behind the writes where the rail's
//! writes are posted by the driver itself, else once the post's data is otherwise done.
//!
//! Notifications follow data (rule 5). Where a post's writes all went on the control
//! endpoint pair (our rail 0 to the peer's rail 0) and both ends order a send after writes
//! (FI_ORDER_SAW), its notification is sent right behind them (`notif_behind`); elsewhere
//! only after the flush reads (or delivery-complete writes) completed.
use super::{Cx, Post, Start, Transport};
use crate::engine::counters::add;
use crate::engine::ops::{OpKind, TOp};
use crate::engine::port::{Mr, Port};
use crate::engine::request::{Marks, Op, Phase, Request, Route, Seg, SegKind};
use crate::error::{Error, Result};
use crate::fabric::{Posted, RailCaps, RmaSeg, MAX_RMA_BATCH};
use std::collections::VecDeque;
use std::sync::Arc;

/// Largest operation a batch of segments grows to: beyond this, batching saves nothing.
const MAX_BATCH_BYTES: u64 = 1 << 20;

/// Whether a post's notification may be sent right behind its data instead of after the
/// flush reads: a WRITE whose every segment is RMA from our rail 0 to the peer's rail 0,
/// the endpoint pair the control channel uses, where our rail 0 orders a send after
/// writes on both sides (`rail0`), the peer says its rail 0 does (`peer_saw`, from its
/// connection info), our rail 0 posts its writes itself (a rail thread's outbox could still
/// hold them when the send goes), and the peer is not reached by shm's copy-in-the-post.
///
/// Why this keeps the rules. Notification after data (5): the send is posted only once
/// every write of the post was accepted by the provider on that endpoint, and with SAW
/// the target processes it only after those writes, so its receive completion (and
/// getNotifs) comes after the bytes are in its memory. A write whose post is refused or
/// fails keeps the notification from going at all. Done means delivered (6): the post still
/// ends only when every write completed, its notification's send completed, and the
/// rail's flush read completed; that read is posted right behind the writes on the same
/// endpoint (`finish_early`), and with FI_ORDER_RAW the target serves it only after them,
/// so its completion shows they are visible (a rail without RAW writes delivery-complete:
/// their own completions show it). What the order cannot undo: a write that fails after it
/// was accepted (an error completion) fails the post while its notification may already be
/// on its way. Over tcp that happens when the connection breaks, which loses the send
/// behind it on the same stream too, or when the target rejects the key because its memory
/// was deregistered under the transfer (a caller error).
pub fn notif_behind(rail0: &RailCaps, rail0_threaded: bool, peer_saw: bool, peer_sync: bool, op: Op, segs: &[Seg]) -> bool {
    op == Op::Write
        && rail0.order_saw
        && peer_saw
        && !rail0_threaded
        && !peer_sync
        && !segs.is_empty()
        && segs.iter().all(|s| matches!(s.kind, SegKind::Rma) && s.rail == 0 && s.rrail == 0)
}

/// How writes on rail `index` come to count as delivered and when a notification of data
/// there is sent, as the engine logs it once per rail.
pub fn delivery_mode(caps: &RailCaps, index: usize, threaded: bool) -> &'static str {
    let behind = index == 0 && caps.order_saw && !threaded;
    match (caps.sync_rma, behind, caps.order_raw) {
        (true, _, _) => "writes complete inside the post to peers reachable by CMA (others: delivery-complete writes); notification after data",
        (false, true, true) => "notification ordered behind data (FI_ORDER_SAW), flush read right behind it (FI_ORDER_RAW)",
        (false, true, false) => "notification ordered behind data (FI_ORDER_SAW), writes delivery-complete",
        (false, false, true) => "flush read before notification",
        (false, false, false) => "delivery-complete writes before notification",
    }
}

pub struct Rma {
    owner: u8,
    /// Per rail: whether writes there are transmit-complete plus a flush read (the rail
    /// orders reads after writes) instead of delivery-complete, which tcp;ofi_rxm answers
    /// only after the target's next progress (milliseconds).
    flush_writes: Vec<bool>,
    /// Most segments per RMA operation (config rma_batch; the rail's limit applies too).
    batch_max: usize,
    // Field order is drop order: the MRs close before the buffer they register goes.
    flush_mrs: Vec<Mr>,
    /// Landing place of flush reads, registered on every rail.
    flush_buf: Box<[u8; 64]>,
    /// Flush reads to post: (request, post number, our rail, the peer's rail).
    flushes: VecDeque<(Arc<Request>, u64, usize, u16)>,
}

impl Rma {
    pub fn new(owner: u8, rails: &[Arc<dyn Port>], rma_batch: u64) -> Result<Rma> {
        let flush_buf = Box::new([0u8; 64]);
        let mut flush_mrs = Vec::with_capacity(rails.len());
        for r in rails {
            // SAFETY: flush_buf is owned by this transport, whose MRs drop before it.
            flush_mrs.push(unsafe { r.register(flush_buf.as_ptr(), flush_buf.len(), 3, None) }?);
        }
        Ok(Rma {
            owner,
            flush_writes: rails.iter().map(|r| r.caps().order_raw).collect(),
            batch_max: (rma_batch as usize).clamp(1, MAX_RMA_BATCH),
            flush_mrs,
            flush_buf,
            flushes: VecDeque::new(),
        })
    }

    fn op(&self, rail: usize, req: &Arc<Request>, epoch: u64, len: u64, inline: bool) -> OpKind {
        OpKind::Transport(TOp { owner: self.owner, tag: 0, rail: rail as u16, slot: true, inline, req: Some(req.clone()), epoch, token: 0, len })
    }

    /// Queues the flush reads of the writes `req` made on our `rail`: one per peer rail they
    /// went to. Where we have fewer rails than the peer, one rail of ours reaches several of
    /// its rails, each its own connection (tcp), and a read on one shows nothing about the
    /// writes on another. Returns how many were queued.
    fn queue_flushes(&mut self, req: &Arc<Request>, epoch: u64, rail: usize) -> usize {
        // The scan stops once every peer rail behind ours was seen: at the first write in the
        // usual case of one.
        let hops = req.peer().map_or(0, |p| p.route.iter().filter(|h| h.rail as usize == rail).count()).max(1);
        let mut rrails: Vec<u16> = Vec::new();
        for s in req.segs.iter().filter(|s| s.rail as usize == rail && matches!(s.kind, SegKind::Rma)) {
            if !rrails.contains(&s.rrail) {
                rrails.push(s.rrail);
                if rrails.len() == hops {
                    break;
                }
            }
        }
        if rrails.is_empty() {
            // Nothing to read behind: post_flushes fails the piece with its message.
            rrails.push(u16::MAX);
        }
        for &r in &rrails {
            self.flushes.push_back((req.clone(), epoch, rail, r));
        }
        rrails.len()
    }

    /// Posts the queued flush reads the provider takes now; a flush that cannot be posted
    /// fails its post. Returns whether any is still queued.
    fn post_flushes(&mut self, cx: &mut Cx) -> bool {
        let mut budget = self.flushes.len();
        while let Some((req, epoch, rail, rrail)) = self.flushes.front().cloned() {
            if budget == 0 {
                break;
            }
            budget -= 1;
            {
                let st = req.state();
                if st.epoch != epoch || st.phase != Phase::Data {
                    self.flushes.pop_front();
                    continue;
                }
            }
            let target = req.segs.iter().find(|s| s.rail as usize == rail && s.rrail == rrail && matches!(s.kind, SegKind::Rma)).copied();
            let res = match target {
                Some(s) => cx.conns.addr(req.peer_id(), rail, s.rrail as usize).and_then(|dest| {
                    let ctx = cx.ops.alloc(self.op(rail, &req, epoch, 0, false));
                    let seg = RmaSeg { local: self.flush_buf.as_mut_ptr(), len: 1, desc: self.flush_mrs[rail].desc, raddr: s.raddr, rkey: s.rkey };
                    // SAFETY: the flush buffer is registered on this rail (its MR) and
                    // lives as long as this transport, which outlives the rails' users;
                    // ctx is a live slot.
                    let r = unsafe { cx.rails[rail].rma(false, &[seg], dest, ctx, false, false) };
                    if !matches!(r, Ok(Posted::Ok)) {
                        cx.ops.release(ctx);
                    }
                    r
                }),
                None => Err(Error::Backend("flush read without a segment on its rail".into())),
            };
            match res {
                Ok(Posted::Ok) => {
                    self.flushes.pop_front();
                    cx.slots.take(rail);
                    let mut st = req.state();
                    st.inflight_total += 1;
                    add(&cx.core.counters.ops_posted, 1);
                }
                // The same read, again next pass; the others first (a full queue toward one
                // peer must not hold up the rest). A post the provider rejected is retried
                // too, until the post's deadline: without the read nothing shows that the
                // post's earlier writes landed, and a post that ended could still see them
                // land over its owner's next request.
                Ok(Posted::Again) | Err(Error::Fabric { .. }) => {
                    add(&cx.core.counters.retries, 1);
                    if let Some(f) = self.flushes.pop_front() {
                        self.flushes.push_back(f);
                    }
                }
                Err(e) => {
                    self.flushes.pop_front();
                    // The flush was counted as a piece of the post (finishing): it ends.
                    req.state().inflight_total += 1;
                    cx.piece(req, epoch, 0, Err(e));
                }
            }
        }
        !self.flushes.is_empty()
    }
}

impl Transport for Rma {
    fn name(&self) -> &'static str {
        "rma"
    }

    fn route(&self) -> Route {
        Route::Rma
    }

    fn start(&mut self, cx: &mut Cx, post: Post) -> Start {
        let Post { req, epoch, at, marks, .. } = post;
        let peer_id = req.peer_id();
        let Some(conn) = cx.conns.peers.get(&peer_id) else {
            return Start::failed(0, 0, Error::Disconnected("peer was disconnected".into()));
        };
        let sync_rails = conn.sync_rails;
        let write = req.op == Op::Write;
        let (mut i, mut pieces) = (at, 0);
        while let Some(s) = req.segs.get(i).copied() {
            if !matches!(s.kind, SegKind::Rma) {
                break;
            }
            let rail = s.rail as usize;
            if cx.slots.full(rail) {
                return Start::blocked(i - at, pieces);
            }
            let Ok(dest) = cx.conns.addr(peer_id, rail, s.rrail as usize) else {
                return Start::failed(i - at, pieces, Error::NotSupported(format!("rail {rail} cannot reach remote rail {}", s.rrail)));
            };
            let port = &cx.rails[rail];
            // The following segments to the same remote rail ride in the same operation,
            // up to the provider's iov limits: one provider message instead of several
            // (over tcp one header and socket write per operation).
            let seg = |t: &crate::engine::request::Seg| RmaSeg { local: t.local as *mut u8, len: t.len as usize, desc: t.desc as *mut _, raddr: t.raddr, rkey: t.rkey };
            let mut batch = [seg(&s); MAX_RMA_BATCH];
            let (mut n, mut bytes) = (1usize, s.len);
            let limit = if req.device_rma { 1 } else { port.caps().rma_batch.min(self.batch_max) };
            while n < limit {
                let Some(t) = req.segs.get(i + n) else { break };
                if t.rail != s.rail || t.rrail != s.rrail || !matches!(t.kind, SegKind::Rma) || bytes + t.len > MAX_BATCH_BYTES {
                    break;
                }
                batch[n] = seg(t);
                bytes += t.len;
                n += 1;
            }
            let dc = write && !self.flush_writes[rail] && sync_rails & (1 << rail) == 0;
            let inline = sync_rails & (1 << rail) != 0 && !dc;
            let ctx = cx.ops.alloc(self.op(rail, req, epoch, bytes, inline));
            let more = i + n < req.segs.len();
            // SAFETY: every segment lies in registrations the request keeps alive (checked
            // at preparation) whose MR descriptors it carries; the owner releases the
            // request only after its operations completed or were taken back (rule 7);
            // ctx is a live slot.
            let res = unsafe {
                if port.posts_on_thread() && !inline {
                    // A rail with its own thread posts there (over tcp a post is the
                    // socket write).
                    cx.core.note_rail_traffic();
                    port.queue_rma(write, &batch[..n], dest, ctx, dc)
                } else {
                    port.rma(write, &batch[..n], dest, ctx, more, dc)
                }
            };
            match res {
                Ok(Posted::Ok) => {
                    i += n;
                    pieces += 1;
                    cx.slots.take(rail);
                    if write && self.flush_writes[rail] {
                        marks.unflushed |= 1 << rail;
                    }
                    add(&cx.core.counters.ops_posted, 1);
                }
                Ok(Posted::Again) => {
                    cx.ops.release(ctx);
                    add(&cx.core.counters.retries, 1);
                    add(&cx.core.rail_counters[rail].retries, 1);
                    return Start::blocked(i - at, pieces);
                }
                Err(e) => {
                    cx.ops.release(ctx);
                    log::error!("{}: {e} (agent '{}')", cx.core.name, req.peer_name());
                    add(&cx.core.rail_counters[rail].errors, 1);
                    return Start::failed(i - at, pieces, e);
                }
            }
        }
        Start::went(i - at, pieces)
    }

    fn on_completion(&mut self, cx: &mut Cx, op: TOp, _len: usize, err: Option<Error>) {
        if op.slot {
            cx.slots.give(op.rail as usize);
        }
        let Some(req) = op.req else { return };
        let r = op.rail as usize;
        let res = match err {
            None => {
                if let Some(c) = cx.core.rail_counters.get(r) {
                    add(&c.bytes, op.len);
                    add(&c.ops, 1);
                }
                Ok(())
            }
            Some(e) => Err(e),
        };
        cx.piece(req, op.epoch, op.len, res);
    }

    fn advance(&mut self, cx: &mut Cx) -> bool {
        !self.flushes.is_empty() && self.post_flushes(cx)
    }

    fn notif_follows(&self, cx: &Cx, req: &Request) -> bool {
        let Some((rail0, peer)) = cx.rails.first().zip(req.peer()) else { return false };
        let sync = cx.conns.peers.get(&peer.id).is_none_or(|c| c.sync_rails & 1 != 0);
        notif_behind(rail0.caps(), rail0.posts_on_thread(), peer.info.rail0_saw, sync, req.op, &req.segs)
    }

    /// With every write of the post handed to the provider, a rail that orders reads after
    /// writes gets its flush read now, behind them on the same endpoint, instead of after
    /// their completions: one round trip less before the post ends. Not on a rail whose
    /// thread posts its writes (they may still be in its outbox).
    fn finish_early(&mut self, cx: &mut Cx, req: &Arc<Request>, epoch: u64, marks: &mut Marks) -> usize {
        let mut n = 0;
        for (rail, port) in cx.rails.iter().enumerate().take(self.flush_writes.len()) {
            if marks.unflushed & (1 << rail) != 0 && !port.posts_on_thread() {
                n += self.queue_flushes(req, epoch, rail);
                marks.unflushed &= !(1 << rail);
            }
        }
        n
    }

    /// Done means delivered (rule 6): on rails that order a read after writes, one 1-byte
    /// read of the destination per rail the post wrote on; its completion shows every
    /// earlier write to that peer landed.
    fn finishing(&mut self, _cx: &mut Cx, req: &Arc<Request>, epoch: u64, marks: &mut Marks) -> usize {
        let mut n = 0;
        for rail in 0..self.flush_writes.len() {
            if marks.unflushed & (1 << rail) != 0 {
                n += self.queue_flushes(req, epoch, rail);
            }
        }
        marks.unflushed = 0;
        n
    }

    fn idle(&self) -> bool {
        self.flushes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::local_peers::Locality;
    use crate::engine::request::Seg;
    use crate::engine::transport::fake::{request, Accepted, Answer, Bench};

    /// `n` segments of `len` bytes from `src` to `dst` over `rails` rails, in contiguous runs.
    fn segs(src: &[u8], dst: &mut [u8], n: usize, len: usize, rails: usize) -> Vec<Seg> {
        (0..n).map(|i| {
            let rail = (i * rails / n) as u16;
            Seg { local: src.as_ptr() as u64 + (i * len) as u64, len: len as u64, raddr: dst.as_mut_ptr() as u64 + (i * len) as u64, rkey: 7, desc: 0, rail, rrail: rail, kind: SegKind::Rma }
        }).collect()
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn the_notification_goes_behind_the_data_only_where_every_write_is_ordered_before_it() {
        use crate::engine::transport::fake::caps_ordered;
        // Only looked at, never moved: any addresses do.
        let on = |rail: u16, rrail: u16| Seg { local: 0x1000, len: 64, raddr: 0x2000, rkey: 7, desc: 0, rail, rrail, kind: SegKind::Rma };
        let (tcp, unordered, dc_only) = (caps_ordered(true, true), caps_ordered(true, false), caps_ordered(false, true));
        let rail0 = [on(0, 0), on(0, 0)];
        assert!(notif_behind(&tcp, false, true, false, Op::Write, &rail0));
        assert!(notif_behind(&dc_only, false, true, false, Op::Write, &rail0), "delivery-complete writes, ordered send");
        // Each condition alone keeps the flush read before the notification.
        assert!(!notif_behind(&unordered, false, true, false, Op::Write, &rail0), "provider without SAW");
        assert!(!notif_behind(&tcp, false, false, false, Op::Write, &rail0), "peer does not say its rail 0 orders sends");
        assert!(!notif_behind(&tcp, true, true, false, Op::Write, &rail0), "rail 0 posts through a thread");
        assert!(!notif_behind(&tcp, false, true, true, Op::Write, &rail0), "shm copy-in-the-post peer");
        assert!(!notif_behind(&tcp, false, true, false, Op::Read, &rail0), "a READ");
        assert!(!notif_behind(&tcp, false, true, false, Op::Write, &[on(0, 0), on(1, 1)]), "data on another rail");
        assert!(!notif_behind(&tcp, false, true, false, Op::Write, &[on(0, 1)]), "data to another remote rail");
        assert!(!notif_behind(&tcp, false, true, false, Op::Write, &[]), "no data");
        let staged = Seg { kind: SegKind::Cma { pid: 1 }, ..on(0, 0) };
        assert!(!notif_behind(&tcp, false, true, false, Op::Write, &[on(0, 0), staged]), "data of another transport");
        // What each rail logs.
        assert!(delivery_mode(&tcp, 0, false).starts_with("notification ordered behind data (FI_ORDER_SAW)"));
        assert_eq!(delivery_mode(&tcp, 1, false), "flush read before notification", "the notification rides rail 0");
        assert_eq!(delivery_mode(&tcp, 0, true), "flush read before notification");
        assert_eq!(delivery_mode(&unordered, 0, false), "flush read before notification");
        assert_eq!(delivery_mode(&caps_ordered(false, false), 0, false), "delivery-complete writes before notification");
        let shm_fast = RailCaps { sync_rma: true, ..caps_ordered(false, false) };
        assert!(delivery_mode(&shm_fast, 0, false).starts_with("writes complete inside the post"));
    }

    #[test]
    fn eagain_storms_retry_the_same_operations_in_order() {
        let mut b = Bench::new(2, false);
        let peer = b.peer(1, Locality::Remote);
        let src = pattern(64 * 1024);
        let mut dst = vec![0u8; src.len()];
        let req = request(Op::Write, &peer, segs(&src, &mut dst, 16, 4096, 2));
        b.fakes[0].script(&[Answer::Again, Answer::Accept, Answer::Again]);
        b.fakes[0].storm(5);
        b.fakes[1].script(&[Answer::Accept, Answer::Again, Answer::Again, Answer::Again]);
        let mut t = Rma::new(0, &b.rails, 4).unwrap();
        let run = b.run(&mut t, &req, 200);
        assert!(run.failed.is_none() && run.blocked >= 3, "blocked {} times", run.blocked);
        assert!(run.pieces.iter().all(|p| p.res.is_ok()));
        assert_eq!(run.pieces.iter().map(|p| p.bytes).sum::<u64>(), src.len() as u64);
        // Each rail got its segments in order, each exactly once, in batches of 4.
        for (r, fake) in b.fakes.iter().enumerate() {
            let got: Vec<u64> = fake.accepted().iter().flat_map(|a| a.segs.iter().map(|s| s.0)).collect();
            let want: Vec<u64> = req.segs.iter().filter(|s| s.rail as usize == r).map(|s| s.local).collect();
            assert_eq!(got, want, "rail {r}");
            assert!(fake.accepted().iter().all(|a| a.write && a.segs.len() == 4));
        }
        assert_eq!(dst, src);
        assert_eq!(b.slots.inflight, vec![0, 0], "every slot back");
    }

    #[test]
    fn device_memory_segments_go_one_per_operation() {
        let mut b = Bench::new(1, false);
        let peer = b.peer(1, Locality::Remote);
        let src = pattern(32 * 1024);
        let mut dst = vec![0u8; src.len()];
        let segs = segs(&src, &mut dst, 8, 4096, 1);
        let sum = crate::engine::request::SegSummary { bytes: src.len() as u64, on_rails: true, local_copies: false, device_rma: true, staged: false };
        let target = crate::engine::request::Target::Peer(peer.clone());
        let req = Arc::new(Request::summed(Op::Write, target, segs, sum, Vec::new(), Vec::new(), Vec::new()));
        // Under FI_EAGAIN too: a refused operation is retried as the same single segment.
        b.fakes[0].script(&[Answer::Again, Answer::Accept, Answer::Again, Answer::Again]);
        let mut t = Rma::new(0, &b.rails, 4).unwrap();
        let run = b.run(&mut t, &req, 50);
        assert!(run.failed.is_none() && run.blocked >= 3 && run.pieces.iter().all(|p| p.res.is_ok()));
        let ops = b.fakes[0].accepted();
        assert_eq!(ops.len(), 8, "one operation per segment");
        assert!(ops.iter().all(|a| a.segs.len() == 1));
        let got: Vec<u64> = ops.iter().map(|a| a.segs[0].0).collect();
        assert_eq!(got, req.segs.iter().map(|s| s.local).collect::<Vec<_>>(), "each segment once, in order");
        assert_eq!(dst, src);
    }

    #[test]
    fn error_completions_fail_their_piece_only() {
        let mut b = Bench::new(1, false);
        let peer = b.peer(1, Locality::Remote);
        let src = pattern(32 * 1024);
        let mut dst = vec![0u8; src.len()];
        let req = request(Op::Write, &peer, segs(&src, &mut dst, 8, 4096, 1));
        b.fakes[0].fail_completions(1);
        let mut t = Rma::new(0, &b.rails, 4).unwrap();
        let run = b.run(&mut t, &req, 50);
        assert_eq!(run.pieces.len(), 2);
        assert!(run.pieces[0].res.is_err(), "the first operation's error completion fails its piece");
        assert!(run.pieces[1].res.is_ok());
        assert_eq!(b.slots.inflight, vec![0]);
    }

    #[test]
    fn out_of_order_and_late_completions_end_every_piece_once() {
        let mut b = Bench::new(2, false);
        let peer = b.peer(1, Locality::Remote);
        let src = pattern(256 * 1024);
        let mut dst = vec![0u8; src.len()];
        let shape = segs(&src, &mut dst, 64, 4096, 2);
        // Read into `got` from `src`: local is the landing buffer, remote the source.
        let mut got = vec![0u8; src.len()];
        let segs: Vec<Seg> = shape.iter().enumerate().map(|(i, s)| Seg { local: got.as_mut_ptr() as u64 + (i * 4096) as u64, raddr: src.as_ptr() as u64 + (i * 4096) as u64, ..*s }).collect();
        let req = request(Op::Read, &peer, segs);
        for f in &b.fakes {
            f.disorder(true, 3);
        }
        let mut t = Rma::new(0, &b.rails, 2).unwrap();
        let run = b.run(&mut t, &req, 500);
        assert_eq!(run.pieces.len(), 32, "64 segments in pairs");
        assert!(run.pieces.iter().all(|p| p.res.is_ok()));
        assert_eq!(got, src);
        assert!(b.fakes.iter().all(|f| f.pending_completions() == 0));
    }

    #[test]
    fn a_failed_post_stops_the_post_and_a_gone_peer_fails_it() {
        let mut b = Bench::new(1, false);
        let peer = b.peer(1, Locality::Remote);
        let src = pattern(16 * 1024);
        let mut dst = vec![0u8; src.len()];
        let req = request(Op::Write, &peer, segs(&src, &mut dst, 4, 4096, 1));
        b.fakes[0].script(&[Answer::Fail]);
        let mut t = Rma::new(0, &b.rails, 1).unwrap();
        let run = b.run(&mut t, &req, 10);
        assert!(matches!(run.failed, Some(Error::Fabric { .. })), "{:?}", run.failed);
        assert!(run.pieces.is_empty() && b.fakes[0].accepted().is_empty());
        b.conns.peers.clear();
        let run = b.run(&mut t, &req, 10);
        assert!(matches!(run.failed, Some(Error::Disconnected(_))), "{:?}", run.failed);
    }

    /// Posts the queued flush reads of post 1 of `req` and completes them: the pieces that ended.
    fn run_flushes(b: &mut Bench, t: &mut Rma, req: &Arc<Request>) -> Vec<crate::engine::transport::Piece> {
        // The state of the post must say Data for the flushes to go out.
        {
            let mut st = req.state();
            st.epoch = 1;
            st.phase = Phase::Data;
        }
        let mut flushed = Vec::new();
        for _ in 0..10 {
            t.advance(&mut b.cx());
            b.complete(t);
            flushed.extend(b.pieces());
        }
        flushed
    }

    #[test]
    fn writes_on_ordered_rails_end_with_one_flush_read_each_retried_as_a_read_until_posted() {
        let mut b = Bench::new(2, true);
        let peer = b.peer(1, Locality::Remote);
        let src = pattern(32 * 1024);
        let mut dst = vec![0u8; src.len()];
        let req = request(Op::Write, &peer, segs(&src, &mut dst, 8, 4096, 2));
        let mut t = Rma::new(0, &b.rails, 4).unwrap();
        let mut run = b.run(&mut t, &req, 50);
        assert_eq!(run.marks.unflushed, 0b11, "both rails wrote transmit-complete");
        let n = t.finishing(&mut b.cx(), &req, 1, &mut run.marks);
        assert_eq!((n, run.marks.unflushed), (2, 0));
        // Refused, then rejected, then refused: still one read, and the post's last piece.
        b.fakes[1].script(&[Answer::Again, Answer::Fail, Answer::Again]);
        let flushed = run_flushes(&mut b, &mut t, &req);
        assert_eq!(flushed.len(), 2);
        assert!(flushed.iter().all(|p| p.res.is_ok() && p.bytes == 0));
        for f in &b.fakes {
            let last = f.accepted().last().cloned().unwrap();
            assert!(matches!(last, Accepted { write: false, .. }), "the flush is a read, also after FI_EAGAIN");
            assert_eq!(last.segs[0].1, 1);
        }
        assert!(t.idle());
    }

    #[test]
    fn a_rail_that_reaches_several_peer_rails_reads_behind_the_writes_on_each() {
        // One rail of ours, three of the peer's: three connections from our one endpoint.
        let mut b = Bench::new(1, true);
        let peer = b.peer_over(1, Locality::Remote, 3);
        let src = pattern(24 * 1024);
        let mut dst = vec![0u8; src.len()];
        let mut ss = segs(&src, &mut dst, 6, 4096, 1);
        for (i, s) in ss.iter_mut().enumerate() {
            s.rrail = (i / 2) as u16;
        }
        let req = request(Op::Write, &peer, ss);
        let mut t = Rma::new(0, &b.rails, 4).unwrap();
        let mut run = b.run(&mut t, &req, 50);
        assert_eq!(run.marks.unflushed, 0b1);
        let n = t.finishing(&mut b.cx(), &req, 1, &mut run.marks);
        assert_eq!(n, 3, "one flush read per peer rail the writes went to");
        let flushed = run_flushes(&mut b, &mut t, &req);
        assert_eq!(flushed.len(), 3);
        assert!(flushed.iter().all(|p| p.res.is_ok()));
        let mut reads: Vec<_> = b.fakes[0].accepted().iter().filter(|a| !a.write).map(|a| a.dest).collect();
        reads.sort_unstable();
        reads.dedup();
        assert_eq!(reads.len(), 3, "a read toward every peer rail written: {reads:?}");
        assert!(t.idle());
    }
}
