//! GPU memory without FI_HMEM: packed chunks through pinned, registered bounce slots
//! (pool.rs). A chunk is a run of a request's staged segments on one rail pair, up to a
//! slot's bytes and `staging_ranges` blocks: many small GPU blocks are gathered into one
//! slot by one kernel launch, moved by one RMA operation per contiguous run (one for a
//! peer's bounce slot), and scattered by one launch at the other end. The side that owns
//! device memory does the device copies, on its progress loop, under the context captured
//! at registration (DESIGN rule 4). Remote device memory takes part through one control
//! message per chunk: we ask the owner to PULL (RMA-read the chunk's ranges from us, then
//! scatter) or PUSH (gather, then RMA-write them to us), on the chunk's rail pair, and the
//! chunk is done when the owner answers; serving those requests for peers is serve.rs.
//! Chunks go round-robin over the rails (the scheduler picks each chunk's pair), so every
//! rail carries several at once: the gather of one overlaps the wire of the one before.
//!
//! Back-pressure: a chunk whose RMA the provider refuses for now (FI_EAGAIN) stays in the
//! step it was in and posts the same operation on a later pass; nothing waits inside a
//! pass for the provider. A chunk ends only when none of its operations is with the
//! provider any more, so its slot never goes back under a live RMA.
mod copies;
mod pool;
mod serve;
mod timing;

use super::{Cx, Post, Start, Transport};
use crate::cuda;
use crate::engine::counters::add;
use crate::engine::gpu::DeviceMem;
use crate::engine::ops::{OpKind, TOp};
use crate::engine::request::{Op, Request, Route, Seg, SegKind};
use crate::engine::wire::{Ctrl, CtrlType, Stage, StageAck, StageDir, StageLent};
use crate::error::{Error, Result, Status};
use crate::fabric::Posted;
use super::slab::Slab;
use copies::Queued;
use pool::{copied, ensure, lent_to_host_ops, rma_ops, Piece, Stager};
use serve::{Serves, SERVE_RMA};
use std::sync::Arc;
use std::time::Instant;
use timing::{Step, Times};

/// TOp::tag of the RMA of one of our chunks.
const JOB_RMA: u8 = 1;
/// MR keys of the bounce pool (where the provider does not choose keys): a range of
/// their own, apart from the driver's registrations.
const POOL_KEYS: u64 = 1 << 40;

enum Phase {
    /// The gather into the slot is queued.
    CopyOut(Queued),
    /// The chunk's RMA operations are being posted (`Job::next_op` is the next; FI_EAGAIN
    /// leaves it there) or are with the provider.
    Rma,
    WaitAck,
    /// The scatter out of the slot is queued.
    CopyIn(Queued),
}

/// One staged chunk of one of our requests: segments `first .. first + n`.
struct Job {
    req: Arc<Request>,
    epoch: u64,
    first: usize,
    n: usize,
    slot: Option<u32>,
    phase: Phase,
    peer_id: u64,
    /// The chunk's RMA operations, how many are posted, how many are with the provider.
    rma: Vec<Vec<Piece>>,
    next_op: usize,
    left: usize,
    /// An operation of the chunk failed: it ends with this once the others are back.
    failed: Option<Error>,
    /// The owner's slot lent to this chunk (LEND; lease, address, key), until released.
    lease: Option<(u64, u64, u64)>,
    /// What the chunk's stage request asked of the owner, once sent.
    asked: Option<StageDir>,
    /// When the chunk started, and when its current step began (timing.rs).
    born: Instant,
    stamp: Instant,
}

impl Job {
    fn segs(&self) -> &[Seg] {
        &self.req.segs[self.first..self.first + self.n]
    }
    fn bytes(&self) -> u64 {
        self.segs().iter().map(|s| s.len).sum()
    }
    /// The chunk's device ranges on our side (address, length), in slot order.
    fn local_ranges(&self) -> Vec<(u64, usize)> {
        self.segs().iter().map(|s| (s.local, s.len as usize)).collect()
    }
}

/// Whether `t` may join a chunk that starts with `s` (same kind and context or key, same
/// rail pair, same remote key).
fn same_chunk(s: &Seg, t: &Seg) -> bool {
    let kind = match (s.kind, t.kind) {
        (SegKind::DevToHost { ctx: a }, SegKind::DevToHost { ctx: b }) | (SegKind::DevToDev { ctx: a }, SegKind::DevToDev { ctx: b }) => a.id() == b.id(),
        (SegKind::HostToDev { self_key: a, owner_rma: x, .. }, SegKind::HostToDev { self_key: b, owner_rma: y, .. }) => a == b && x == y,
        _ => false,
    };
    kind && s.rail == t.rail && s.rrail == t.rrail && s.rkey == t.rkey
}

pub struct Staging {
    owner: u8,
    pool: Option<Stager>,
    jobs: Slab<Job>,
    serves: Serves,
    next_key: u64,
    times: Times,
    /// The engine's name, for the timing line.
    name: String,
    /// Which way staged READs of peers' GPU memory go was logged (once an engine).
    told_read_way: bool,
    /// The INFO line of the first chunk the owner moves by its RMA (HostToDev owner_rma).
    told_owner_rma: bool,
}

impl Staging {
    pub fn new(owner: u8, name: &str) -> Staging {
        Staging { owner, pool: None, jobs: Slab::default(), serves: Serves::default(), next_key: POOL_KEYS, times: Times::default(), name: name.to_string(), told_read_way: false, told_owner_rma: false }
    }

    /// Most bytes and blocks of one chunk: a slot (ours, or the owner's, which is sized by
    /// the same rule), and what a stage request fits in a control message.
    fn limits(&self, cx: &Cx) -> (u64, usize) {
        let provider = cx.rails.first().map_or("", |r| r.caps().prov_name.as_str());
        let mut bytes = cx.core.cfg.staging_chunk(provider);
        if let Some(p) = &self.pool {
            bytes = bytes.min(p.chunk as u64);
        }
        let room = cx.ctrl_room.saturating_sub(Stage::encoded_len(0)) / 24;
        (bytes, (cx.core.cfg.staging_ranges as usize).min(room).max(1))
    }

    /// Segments of the chunk starting at `at`: the run that shares its kind and rail pair,
    /// within a slot's bytes and the block limit.
    fn chunk_len(&self, cx: &Cx, req: &Request, at: usize) -> usize {
        let (max_bytes, max_ranges) = self.limits(cx);
        let s = &req.segs[at];
        let (mut n, mut bytes) = (1, s.len);
        while let Some(t) = req.segs.get(at + n) {
            if n >= max_ranges || bytes + t.len > max_bytes || !same_chunk(s, t) {
                break;
            }
            bytes += t.len;
            n += 1;
        }
        n
    }

    /// Starts the chunk of segments `first .. first + n`. Ok(false): no free slot now.
    fn start_chunk(&mut self, cx: &mut Cx, req: &Arc<Request>, epoch: u64, first: usize, n: usize) -> Result<bool> {
        let s = req.segs[first];
        let slot = match s.kind {
            SegKind::DevToHost { ctx } | SegKind::DevToDev { ctx } => {
                let p = ensure(&mut self.pool, cx, &ctx, &mut self.next_key)?;
                match p.take(true) {
                    Some(slot) => Some(slot),
                    None => {
                        self.times.no_slot += 1;
                        return Ok(false);
                    }
                }
            }
            _ => None,
        };
        let now = Instant::now();
        let job = Job { req: req.clone(), epoch, first, n, slot, phase: Phase::WaitAck, peer_id: req.peer_id(), rma: Vec::new(), next_op: 0, left: 0, failed: None, lease: None, asked: None, born: now, stamp: now };
        let token = self.jobs.insert(job);
        if let Err(e) = self.first_step(cx, token) {
            self.finish(cx, token, Err(e));
        }
        Ok(true)
    }

    fn first_step(&mut self, cx: &mut Cx, token: u64) -> Result<()> {
        let j = self.jobs.get_mut(token).ok_or_else(|| Error::Backend("job vanished".into()))?;
        let (op, kind, slot) = (j.req.op, j.segs()[0].kind, j.slot);
        if matches!(kind, SegKind::HostToDev { owner_rma: true, .. }) && !std::mem::replace(&mut self.told_owner_rma, true) {
            log::info!("{}: our host memory with a peer's provider-registered GPU memory: this provider would bounce it through host buffers from our side, so the peer moves it with RMA from its GPU memory (one stage request per chunk; hmem_owner_rma)", cx.core.name);
        }
        match (kind, op, slot) {
            (SegKind::DevToHost { ctx }, Op::Write, Some(slot)) | (SegKind::DevToDev { ctx }, Op::Write, Some(slot)) => {
                let ranges = j.local_ranges();
                let p = self.pool.as_mut().ok_or_else(|| Error::Backend("no staging pool".into()))?;
                let ev = p.copy(cx.core, ctx, slot, &ranges, true)?;
                self.set_phase(token, Phase::CopyOut(ev));
            }
            (SegKind::DevToHost { .. }, Op::Read, Some(_)) => self.post_rma(cx, token),
            (SegKind::HostToDev { owner_rma: true, .. }, Op::Read, None) => self.ask(cx, token, StageDir::Push)?,
            (SegKind::DevToDev { .. }, Op::Read, Some(_)) | (SegKind::HostToDev { .. }, Op::Read, None) => {
                let dir = self.read_way(cx, token);
                self.ask(cx, token, dir)?
            }
            (SegKind::HostToDev { .. }, Op::Write, None) => self.ask(cx, token, StageDir::Pull)?,
            _ => return Err(Error::Backend(format!("segment {} cannot be staged as {kind:?}", j.first))),
        }
        Ok(())
    }

    /// How a staged READ of a peer's GPU memory crosses the rails: by our RMA read of a
    /// slot the owner lends (LEND), or by its RMA write into our slot or host memory (PUSH).
    /// Chunks of at least `staging_lend_min_blocks` blocks are lent where the owner lends.
    /// (H100, tcp, five rails, 2026-12-07, four A/B pairs, into GPU memory: lent slots moved
    /// 1024 x 16 KiB and 4096 x 4 KiB READs 12-17 % faster and 256 x 256 KiB as fast, but
    /// 64 MiB, one range a chunk, 10 % slower: the owner holds its slot one message longer.)
    fn read_way(&mut self, cx: &Cx, token: u64) -> StageDir {
        let Some(j) = self.jobs.get_mut(token) else { return StageDir::Push };
        let (lends, n) = (j.req.peer().is_some_and(|p| p.info.lends), j.n as u64);
        let way = cx.core.cfg.staging_lend_reads && lends;
        let min = cx.core.cfg.staging_lend_min_blocks.max(1);
        if !std::mem::replace(&mut self.told_read_way, true) {
            log::info!("{}: staged READs of a peer's GPU memory: {}", cx.core.name, match (way, lends) {
                (true, _) => format!("the owner lends the slot of each chunk of at least {min} blocks and we RMA-read it (into our slot, or straight into our host memory); smaller chunks it RMA-writes to us"),
                (false, true) => "the owner RMA-writes each packed chunk to us (staging_lend_reads=false)".into(),
                (false, false) => "the owner RMA-writes each packed chunk to us (the peer lends no slots: an older build)".into(),
            });
        }
        if way && n >= min { StageDir::Lend } else { StageDir::Push }
    }

    fn set_phase(&mut self, token: u64, phase: Phase) {
        if let Some(j) = self.jobs.get_mut(token) {
            j.phase = phase;
        }
    }

    /// Sends the owner of the remote device memory one stage request for the whole chunk:
    /// it moves the bytes between its memory and our bounce slot (DevToDev), or our own
    /// RMA-reachable memory (HostToDev), over the chunk's rail pair.
    fn ask(&mut self, cx: &mut Cx, token: u64, dir: StageDir) -> Result<()> {
        let j = self.jobs.get_mut(token).ok_or_else(|| Error::Backend("job vanished".into()))?;
        let first = j.segs()[0];
        let rail = first.rail as usize;
        let (ranges, peer_key) = match (j.slot, first.kind) {
            (Some(slot), _) => {
                let virt = cx.rails.get(rail).is_some_and(|r| r.caps().virt_addr);
                let p = self.pool.as_ref().ok_or_else(|| Error::Backend("no staging pool".into()))?;
                let (base, key) = p.rma_target(slot, rail, virt)?;
                let mut off = 0;
                let ranges = j.segs().iter().map(|s| {
                    let r = (s.raddr, base + off, s.len);
                    off += s.len;
                    r
                }).collect();
                (ranges, key)
            }
            (None, SegKind::HostToDev { self_key, .. }) => {
                let ranges = j.segs().iter().map(|s| match s.kind {
                    SegKind::HostToDev { self_addr, .. } => (s.raddr, self_addr, s.len),
                    _ => (s.raddr, 0, 0),
                }).collect();
                (ranges, self_key)
            }
            _ => return Err(Error::Backend("a stage request without memory to stage through".into())),
        };
        j.phase = Phase::WaitAck;
        j.stamp = Instant::now();
        j.asked = Some(dir);
        let dest = cx.conns.ctrl_addr(j.peer_id)?;
        let st = Stage { token, dir, rail: first.rail, rrail: first.rrail, peer_key, ranges };
        add(&cx.core.counters.stage_requests, 1);
        cx.ctrl(j.peer_id, dest, CtrlType::Stage, &st.encode());
        // The owner answers with RMA on this chunk's rail pair (a PULL reads our memory, a
        // PUSH writes into our slot), which nothing we post there announces: keep our rail
        // threads driving their rails (a tcp target's progress answers a read and lands a
        // write). `sweep` keeps this up while chunks are in flight.
        cx.core.note_rail_traffic();
        Ok(())
    }

    /// Posts the chunk's RMA operations that are due, on its rail; FI_EAGAIN leaves the
    /// rest due, to post the same operations again on a later pass.
    fn post_rma(&mut self, cx: &mut Cx, token: u64) {
        let Some(j) = self.jobs.get_mut(token) else { return };
        let s = j.segs()[0];
        let rail = s.rail as usize;
        if j.rma.is_empty() && j.next_op == 0 {
            j.stamp = Instant::now();
            let batch = cx.rails.get(rail).map_or(1, |r| r.caps().rma_batch).min(cx.core.cfg.rma_batch.max(1) as usize);
            j.rma = match (j.lease, j.slot) {
                // (The owner's slot holds the chunk back to back: one read into our slot.)
                (Some((_, addr, _)), Some(_)) => rma_ops(std::iter::once((addr, j.bytes() as usize)), batch),
                (Some((_, addr, _)), None) => lent_to_host_ops(j.segs().iter().map(|s| (s.local, s.len as usize)), addr, batch),
                (None, _) => rma_ops(j.segs().iter().map(|s| (s.raddr, s.len as usize)), batch),
            };
        }
        let rkey = j.lease.map_or(s.rkey, |l| l.2);
        j.phase = Phase::Rma;
        let res = (|| -> Result<()> {
            let dest = cx.conns.addr(j.peer_id, rail, s.rrail as usize)?;
            let port = cx.rails.get(rail).ok_or_else(|| Error::Backend(format!("no rail {rail}")))?;
            let write = j.req.op == Op::Write;
            while j.next_op < j.rma.len() {
                let pieces = &j.rma[j.next_op];
                let len: usize = pieces.iter().map(|p| p.2).sum();
                let op = OpKind::Transport(TOp { owner: self.owner, tag: JOB_RMA, rail: rail as u16, slot: false, inline: false, req: Some(j.req.clone()), epoch: j.epoch, token, len: len as u64 });
                let posted = match j.slot {
                    Some(slot) => {
                        let p = self.pool.as_ref().ok_or_else(|| Error::Backend("no staging pool".into()))?;
                        p.post(&**port, cx.core, cx.ops, op, slot, write, dest, pieces, rkey)?
                    }
                    None => {
                        // A lent chunk read into our host memory (HostToDev): the pieces
                        // name our addresses, all in the one registration of the chunk.
                        // SAFETY: the pieces are the chunk's segments, bounds-checked against
                        // our host registration (registered on this rail as `desc`) when the
                        // request was planned; the request keeps that registration alive and
                        // the caller does not touch its memory until the request completes,
                        // which waits for this operation (or its taking back unposted).
                        unsafe { pool::post_local(&**port, cx.core, cx.ops, op, write, dest, pieces, rkey, |_, _| Ok(s.desc as *mut _)) }?
                    }
                };
                match posted {
                    Posted::Ok => {
                        j.next_op += 1;
                        j.left += 1;
                    }
                    Posted::Again => {
                        add(&cx.core.counters.retries, 1);
                        add(&cx.core.rail_counters[rail].retries, 1);
                        break;
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = res {
            j.next_op = j.rma.len();
            j.failed.get_or_insert(e);
            if j.left == 0 {
                let e = j.failed.take().unwrap_or(Error::Canceled);
                self.finish(cx, token, Err(e));
            }
        }
    }

    /// A chunk ended: its slot goes back, its post learns the outcome.
    fn finish(&mut self, cx: &mut Cx, token: u64, res: Result<()>) {
        Self::release(cx, self.jobs.get_mut(token));
        let Some(job) = self.jobs.remove(token) else { return };
        if let (Some(slot), Some(pool)) = (job.slot, self.pool.as_mut()) {
            pool.give(slot, true);
        }
        if res.is_ok() {
            self.times.add(Step::Total, job.born);
        }
        let len = job.bytes();
        cx.piece(job.req, job.epoch, len, res);
    }

    /// Gives the owner back the slot it lent the job, if it holds one (once: the lease is
    /// taken). A peer that is gone needs no release (it dropped our leases).
    fn release(cx: &mut Cx, job: Option<&mut Job>) {
        let Some(j) = job else { return };
        let Some((lease, _, _)) = j.lease.take() else { return };
        Self::send_release(cx, j.peer_id, lease);
    }

    /// Tells peer `peer_id` that its slot `lease` is free again, where we still reach it.
    fn send_release(cx: &mut Cx, peer_id: u64, lease: u64) {
        if let Ok(dest) = cx.conns.ctrl_addr(peer_id) {
            cx.ctrl(peer_id, dest, CtrlType::StageRelease, &StageLent::encode_release(lease));
        }
    }

    /// The owner packed a LEND chunk in its slot: read it from there. The message is
    /// untrusted: only the chunk's own owner, answering the LEND it was asked, is read.
    fn on_lent(&mut self, cx: &mut Cx, sender_id: u64, sender: &str, lent: StageLent) {
        let ours = |j: &Job| {
            matches!(j.phase, Phase::WaitAck) && j.lease.is_none() && j.asked == Some(StageDir::Lend)
                && j.req.peer().is_some_and(|p| p.info.engine_id == sender_id)
        };
        let Some(j) = self.jobs.get_mut(lent.token).filter(|j| ours(j)) else {
            // No chunk of ours waits for it (it ended, or the message is not genuine): the
            // slot goes back to its sender where we still reach it; else its lease runs out.
            log::warn!("{}: a lent slot from '{sender}' for no chunk waiting for one ({:#x})", cx.core.name, lent.token);
            if let Some(pid) = cx.conns.peers.iter().find(|(_, c)| c.peer.info.engine_id == sender_id).map(|(&id, _)| id) {
                Self::send_release(cx, pid, lent.lease);
            }
            return;
        };
        self.times.add(Step::Owner, j.stamp);
        j.lease = Some((lent.lease, lent.addr, lent.key));
        self.post_rma(cx, lent.token);
    }

    /// Scatters a chunk that arrived in its slot into our device memory.
    fn copy_in(&mut self, cx: &mut Cx, token: u64, ctx: cuda::Context) {
        let Some(j) = self.jobs.get_mut(token) else { return };
        let ranges = j.local_ranges();
        let res = match (self.pool.as_mut(), j.slot) {
            (Some(p), Some(slot)) => p.copy(cx.core, ctx, slot, &ranges, false),
            _ => Err(Error::Backend("copy-in without a slot".into())),
        };
        match res {
            Ok(ev) => {
                j.phase = Phase::CopyIn(ev);
                j.stamp = Instant::now();
            }
            Err(e) => self.finish(cx, token, Err(e)),
        }
    }

    fn on_ack(&mut self, cx: &mut Cx, ack: StageAck) {
        let Some(j) = self.jobs.get_mut(ack.token) else {
            log::debug!("{}: stale stage answer {:#x}", cx.core.name, ack.token);
            return;
        };
        if !matches!(j.phase, Phase::WaitAck) {
            return;
        }
        if ack.status != 0 {
            let e = Error::Backend(format!("peer failed a staged chunk: {}", Status::from_code(ack.status).name()));
            return self.finish(cx, ack.token, Err(e));
        }
        self.times.add(Step::Owner, j.stamp);
        match (j.req.op, j.segs()[0].kind) {
            (Op::Read, SegKind::DevToDev { ctx }) => self.copy_in(cx, ack.token, ctx),
            _ => self.finish(cx, ack.token, Ok(())),
        }
    }

    /// Polls our chunks' device copies and posts what is due. Returns whether any chunk is
    /// in flight.
    fn advance_jobs(&mut self, cx: &mut Cx) -> bool {
        if self.jobs.is_empty() {
            return false;
        }
        for token in self.jobs.tokens() {
            let Some(j) = self.jobs.get_mut(token) else { continue };
            let (q, out) = match &j.phase {
                Phase::CopyOut(q) => (q, true),
                Phase::CopyIn(q) => (q, false),
                Phase::Rma => {
                    if j.next_op < j.rma.len() {
                        self.post_rma(cx, token);
                    }
                    continue;
                }
                Phase::WaitAck => continue,
            };
            let ready = match copied(&mut self.pool, cx.core, q) {
                Ok(r) => r,
                Err(e) => {
                    self.finish(cx, token, Err(e));
                    continue;
                }
            };
            if !ready {
                continue;
            }
            self.times.add(if out { Step::Gather } else { Step::Scatter }, j.stamp);
            if !out {
                self.finish(cx, token, Ok(()));
                continue;
            }
            match j.segs()[0].kind {
                SegKind::DevToHost { .. } => self.post_rma(cx, token),
                SegKind::DevToDev { .. } => {
                    if let Err(e) = self.ask(cx, token, StageDir::Pull) {
                        self.finish(cx, token, Err(e));
                    }
                }
                _ => self.finish(cx, token, Err(Error::Backend("copy-out for a segment without device memory".into()))),
            }
        }
        true
    }

    /// One of a chunk's RMA operations completed.
    fn on_job_rma(&mut self, cx: &mut Cx, op: &TOp, err: Option<Error>) {
        let Some(j) = self.jobs.get_mut(op.token) else { return };
        j.left = j.left.saturating_sub(1);
        match err {
            Some(e) => {
                j.next_op = j.rma.len();
                j.failed.get_or_insert(e);
            }
            None => {
                if let Some(c) = cx.core.rail_counters.get(op.rail as usize) {
                    add(&c.bytes, op.len);
                    add(&c.ops, 1);
                }
            }
        }
        if j.left > 0 || j.next_op < j.rma.len() {
            return;
        }
        if let Some(e) = j.failed.take() {
            return self.finish(cx, op.token, Err(e));
        }
        self.times.add(Step::Rma, j.stamp);
        match (j.req.op, j.segs()[0].kind) {
            (Op::Write, _) => self.finish(cx, op.token, Ok(())),
            (Op::Read, SegKind::DevToHost { ctx }) => self.copy_in(cx, op.token, ctx),
            (Op::Read, SegKind::DevToDev { ctx }) if j.lease.is_some() => {
                // The bytes are in our slot: the owner's goes back before the scatter.
                Self::release(cx, Some(j));
                self.copy_in(cx, op.token, ctx)
            }
            // A lent chunk read straight into our host memory: done once the read is.
            (Op::Read, SegKind::HostToDev { .. }) if j.lease.is_some() => self.finish(cx, op.token, Ok(())),
            _ => self.finish(cx, op.token, Err(Error::Backend("unexpected staging RMA completion".into()))),
        }
    }
}

/// Chunks and serves after which falling idle logs where their time went.
const TIMES_BURST: u64 = 256;

impl Staging {
    /// Logs the timing sums and starts new ones.
    fn log_times(&mut self) {
        self.times.merge(&std::mem::take(&mut self.serves.times));
        if let Some(line) = std::mem::take(&mut self.times).summary() {
            log::info!("{}: {line}", self.name);
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.log_times();
    }
}

impl Transport for Staging {
    fn name(&self) -> &'static str {
        "staging"
    }

    fn route(&self) -> Route {
        Route::Staging
    }

    fn start(&mut self, cx: &mut Cx, post: Post) -> Start {
        let Post { req, epoch, at, .. } = post;
        let (mut i, mut pieces) = (at, 0);
        while let Some(s) = req.segs.get(i) {
            if s.kind.route() != Route::Staging {
                break;
            }
            if cx.slots.full(s.rail as usize) {
                return Start::blocked(i - at, pieces);
            }
            let n = self.chunk_len(cx, req, i);
            match self.start_chunk(cx, req, epoch, i, n) {
                Ok(true) => {
                    i += n;
                    pieces += 1;
                }
                Ok(false) => return Start::blocked(i - at, pieces),
                Err(e) => return Start::failed(i - at, pieces, e),
            }
            add(&cx.core.counters.ops_posted, 1);
        }
        Start::went(i - at, pieces)
    }

    fn on_completion(&mut self, cx: &mut Cx, op: TOp, _len: usize, err: Option<Error>) {
        if op.tag == SERVE_RMA {
            return self.serves.on_rma(cx, &mut self.pool, op.token, err);
        }
        self.on_job_rma(cx, &op, err);
    }

    fn on_control(&mut self, cx: &mut Cx, msg: &Ctrl<'_>) -> bool {
        match msg.kind {
            CtrlType::Stage => match Stage::decode(msg.payload) {
                Ok(st) => self.serves.request(cx, &mut self.pool, &mut self.next_key, self.owner, msg.sender_id, st),
                Err(e) => log::warn!("{}: dropping a stage request from '{}': {e}", cx.core.name, msg.sender),
            },
            CtrlType::StageAck => match StageAck::decode(msg.payload) {
                Ok(a) => self.on_ack(cx, a),
                Err(e) => log::warn!("{}: dropping a stage answer from '{}': {e}", cx.core.name, msg.sender),
            },
            CtrlType::StageLent => match StageLent::decode(msg.payload) {
                Ok(l) => self.on_lent(cx, msg.sender_id, msg.sender, l),
                Err(e) => log::warn!("{}: dropping a lent slot from '{}': {e}", cx.core.name, msg.sender),
            },
            CtrlType::StageRelease => match StageLent::decode_release(msg.payload) {
                Ok(lease) => self.serves.release(cx, &mut self.pool, msg.sender_id, lease),
                Err(e) => log::warn!("{}: dropping a slot release from '{}': {e}", cx.core.name, msg.sender),
            },
            _ => return false,
        }
        true
    }

    fn advance(&mut self, cx: &mut Cx) -> bool {
        if self.jobs.is_empty() && self.serves.idle() {
            if self.times.count() + self.serves.times.count() >= TIMES_BURST {
                self.log_times();
            }
            return false;
        }
        if let Some(p) = self.pool.as_mut() {
            p.new_pass();
        }
        let jobs = self.advance_jobs(cx);
        self.serves.advance(cx, &mut self.pool, &mut self.next_key, self.owner) | jobs
    }

    /// Device memory is being registered: the bounce pool is made now, under its context,
    /// so the first transfer does not pay for it.
    fn prepare(&mut self, cx: &mut Cx, dev: &DeviceMem) -> Result<()> {
        if dev.staged {
            ensure(&mut self.pool, cx, &dev.ctx, &mut self.next_key)?;
        }
        Ok(())
    }

    /// A peer that is gone answers no stage request: chunks waiting for its answer end with
    /// the disconnect, and their slots come back; chunks with RMA still out end when the
    /// provider hands those back (the driver takes back what a rail thread still holds).
    fn drop_peer(&mut self, cx: &mut Cx, peer_id: u64, engine_id: u64) {
        self.serves.drop_sender(cx, &mut self.pool, engine_id);
        for token in self.jobs.tokens() {
            let Some(j) = self.jobs.get_mut(token) else { continue };
            if j.peer_id != peer_id {
                continue;
            }
            let gone = || Error::Disconnected("peer was disconnected".into());
            match j.phase {
                Phase::WaitAck => self.finish(cx, token, Err(gone())),
                Phase::Rma => {
                    j.next_op = j.rma.len();
                    j.failed.get_or_insert_with(gone);
                    if j.left == 0 {
                        self.finish(cx, token, Err(gone()));
                    }
                }
                Phase::CopyOut(_) | Phase::CopyIn(_) => {}
            }
        }
    }

    fn idle(&self) -> bool {
        self.jobs.is_empty() && self.serves.idle()
    }

    /// A chunk counts its operations: one taken back unposted must end it, slot and all.
    fn hears_taken_back(&self) -> bool {
        true
    }

    /// Chunks waiting for the owner's RMA longer than the rail threads' traffic window
    /// (one that is slow, or queued behind others) keep them driving the rails (see `ask`).
    fn sweep(&mut self, cx: &mut Cx) {
        if !self.jobs.is_empty() {
            cx.core.note_rail_traffic();
        }
    }
}

#[cfg(test)]
mod tests;
