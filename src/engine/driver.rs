//! The driver owns the rails (DESIGN rule 3): only whoever holds it (the progress thread,
//! or with the thread off the caller that locked it) touches endpoints, CQs, AVs and MRs.
//! One `pass` takes handed-over work, starts what the transports accept, reads
//! completions, and enforces deadlines. The loop knows requests, peers, the control
//! channel and the transports' trait; it never names a transport: a segment's route picks
//! one, and what a transport reports back comes as outcomes (transport/mod.rs).
use super::conns::Conns;
use super::core::Core;
use super::counters::add;
use super::ctrl::{CtrlChannel, CtrlOut};
use super::contexts::AppliedContexts;
use super::gpu::DeviceMem;
use super::inbox::{Inbox, Submit};
use super::ops::{OpKind, OpPool};
use super::peer::Peer;
use super::port::{Mr, Port};
use crate::fabric::Hmem;
use super::request::{PieceEnd, Phase, ReqState, Request, Route};
use super::transport::{Cx, Outcome, Piece, Post, RailSlots, Stop, Transport};
use super::wire::{self, CtrlType};
use crate::error::{Error, Result};
use crate::fabric::{Completion, Posted};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a busy initiator reminds a peer that traffic is flowing. Manual-progress
/// providers need the *target* to progress for RMA to land (or be read), yet RMA gives the
/// target no completion to notice; the kick's receive completion does, and keeps the
/// target's progress thread spinning instead of napping (see progress.rs).
pub const KICK_INTERVAL: Duration = Duration::from_millis(5);
const POLL_BATCH: usize = 64;
/// Longest a run of local passes (Driver::pass_local) goes without a full one.
const LOCAL_PASS_MAX_GAP: Duration = Duration::from_micros(500);

/// Which completion queues a pass made on a caller's thread reads.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PassKind {
    /// Every rail's (Driver::pass).
    Full,
    /// Only those of rails that complete inside the post call (Driver::pass_post).
    Post,
    /// None: local copies only (Driver::pass_local).
    Local,
}

impl PassKind {
    /// The pass for posting a request (`local`: it moves by local copies only).
    pub fn posting(local: bool) -> PassKind {
        if local { PassKind::Local } else { PassKind::Post }
    }

    /// The pass for polling a request or the engine.
    pub fn polling(local: bool) -> PassKind {
        if local { PassKind::Local } else { PassKind::Full }
    }
}

/// The completion entries of one poll, kept between polls.
#[derive(Default)]
struct CqBuf(Box<[Completion]>);

// SAFETY: the entries are copies whose context pointers are only values here; the driver
// that owns the buffer turns them back into its own operation slots on its own thread.
unsafe impl Send for CqBuf {}

/// What one pass did.
#[derive(Clone, Copy, Debug)]
pub struct Pass {
    /// Something happened: work taken, operations posted, completions read.
    pub did: bool,
    /// Requests, control messages or transport work are still in flight.
    pub pending: bool,
}

/// A transport's context from the driver's fields, borrowed apart from `transports`.
macro_rules! cx {
    ($d:expr) => {
        Cx {
            ctrl_room: $d.ctrl.payload_room(wire::CTRL_HEADER, $d.core.name.len()),
            core: &$d.core,
            rails: &$d.rails,
            ops: &mut $d.ops,
            conns: &mut $d.conns,
            slots: &mut $d.slots,
            out: &mut $d.out,
            now: $d.now,
        }
    };
}

pub struct Driver {
    // Field order is drop order: endpoints close before the buffers they may write into.
    rails: Vec<Arc<dyn Port>>,
    transports: Vec<Box<dyn Transport>>,
    /// Route -> the transport's place in `transports`.
    route: [usize; Route::COUNT],
    ctrl: CtrlChannel,
    ops: OpPool,
    core: Arc<Core>,
    inbox: Arc<Inbox<Driver>>,
    conns: Conns,
    to_post: VecDeque<Arc<Request>>,
    active: Vec<Arc<Request>>,
    slots: RailSlots,
    out: Vec<Outcome>,
    /// Operations of ended requests taken back from rail outboxes whose transport keeps
    /// state per operation (`Transport::hears_taken_back`): told at the next pass, once no
    /// request's state is held.
    taken_back: Vec<super::ops::TOp>,
    /// Control receive buffers the provider refused for now: posted again next pass.
    recv_retry: Vec<u32>,
    /// An error completion without a context on a sync_rma rail: shm's fast RMA reports a
    /// failed copy (a dead peer process) that way, so the next sweep probes same-host
    /// peers at once.
    probe_now: bool,
    last_sweep: Instant,
    /// When the last full pass (one that read the rails' queues) began.
    last_full: Instant,
    /// When this pass began: the one clock reading its steps share (a 4 KiB same-host WRITE
    /// read the clock three times, 9 % of its postXfer on the H100 host).
    now: Instant,
    /// Whether this pass reads every rail's queue (a full pass).
    full_now: bool,
    /// The provider pushed back (FI_EAGAIN) the last time the control queue was sent.
    /// Only full passes try again: a send that rxm refuses while its connection is being
    /// set up runs its connection progress (an epoll_wait) on every try, and a caller
    /// posting same-host copies with the progress thread off made a light pass, and with
    /// it one such try, per 4 KiB WRITE for the ~20 ms the set-up took (2.3 instead of
    /// 1.9 us each, CPU VM: bench.py's 1000-post small points fell inside that window).
    ctrl_pushed_back: bool,
    /// Room for the completions one poll reads (Driver::poll_rail).
    cq_buf: CqBuf,
    /// A post handed over directly by the caller holding the driver (Driver::post_now),
    /// begun after the inbox's work.
    handed: Option<Arc<Request>>,
    next_key: u64,
    /// The captured CUDA contexts this thread applies every pass (rule 4).
    ctxs: AppliedContexts,
}

impl Driver {
    /// `transports` in any order: each says which route it serves; every route needs one.
    pub fn new(core: Arc<Core>, inbox: Arc<Inbox<Driver>>, rails: Vec<Arc<dyn Port>>,
               transports: impl FnOnce(&[Arc<dyn Port>]) -> Result<Vec<Box<dyn Transport>>>) -> Result<Driver> {
        let cfg = &core.cfg;
        let rail0 = rails.first().ok_or_else(|| Error::Backend("an engine needs a rail".into()))?;
        let size = cfg.max_notif_size as usize + wire::CTRL_HEADER + wire::MAX_NAME_LEN + 4096;
        let nrecv = (cfg.ctrl_recv_count as usize).min(rail0.caps().rx_size.max(1));
        let ctrl = CtrlChannel::new(&**rail0, size, nrecv)?;
        let cap = rails.iter().map(|r| (cfg.max_inflight as usize).min(r.caps().tx_size).max(1)).collect();
        let transports = transports(&rails)?;
        let mut route = [usize::MAX; Route::COUNT];
        for (i, t) in transports.iter().enumerate() {
            route[t.route() as usize] = i;
        }
        if route.contains(&usize::MAX) {
            return Err(Error::Backend("a route has no transport".into()));
        }
        let n = rails.len();
        let mut d = Driver {
            ops: OpPool::with_capacity(1024),
            transports,
            route,
            ctrl,
            core,
            inbox,
            conns: Conns::default(),
            to_post: VecDeque::new(),
            active: Vec::new(),
            slots: RailSlots { inflight: vec![0; n], cap },
            out: Vec::new(),
            taken_back: Vec::new(),
            recv_retry: (0..nrecv as u32).collect(),
            probe_now: false,
            last_sweep: Instant::now(),
            last_full: Instant::now(),
            full_now: true,
            ctrl_pushed_back: false,
            cq_buf: CqBuf::default(),
            now: Instant::now(),
            handed: None,
            next_key: 16,
            ctxs: AppliedContexts::default(),
            rails,
        };
        d.post_recvs()?;
        Ok(d)
    }

    /// Posts the control receive buffers waiting for it; one the provider refuses for now
    /// waits for the next pass.
    fn post_recvs(&mut self) -> Result<()> {
        while let Some(&buf) = self.recv_retry.last() {
            match self.ctrl.post_recv(&*self.rails[0], &mut self.ops, buf)? {
                Posted::Ok => {
                    self.recv_retry.pop();
                }
                Posted::Again => {
                    add(&self.core.counters.retries, 1);
                    break;
                }
            }
        }
        Ok(())
    }

    /// Registers a region on every rail. Keys are ours to choose where the provider does
    /// not choose them; they only need to be unique per domain.
    ///
    /// # Safety
    /// The memory stays allocated while the returned registrations live (NIXL's contract:
    /// memory is deregistered before it is freed).
    pub unsafe fn register(&mut self, addr: u64, len: u64, hmem: Option<Hmem>) -> Result<Vec<Mr>> {
        let mut mrs = Vec::with_capacity(self.rails.len());
        for r in &self.rails {
            self.next_key += 1;
            // SAFETY: forwarded from the caller.
            mrs.push(unsafe { r.register(addr as *const u8, len as usize, self.next_key, hmem) }?);
        }
        Ok(mrs)
    }

    /// Registers device memory with the provider by the first kind `policy` allows and
    /// every rail takes (gpu_reg.rs), keys as for `register`.
    ///
    /// # Safety
    /// As for `register`.
    pub unsafe fn register_vram(&mut self, addr: u64, len: u64, dev: &DeviceMem, policy: crate::config::VramPolicy,
                                export: &dyn Fn() -> crate::cuda::Result<Option<crate::cuda::DmaBuf>>,
                                apply_ctx: &dyn Fn() -> Result<()>) -> Result<super::gpu_reg::Registered> {
        // SAFETY: forwarded from the caller.
        unsafe { super::gpu_reg::register(&self.rails, &mut self.next_key, policy, addr, len, dev, export, apply_ctx) }
    }

    /// Device memory is being registered: every transport sets up what it needs for it.
    pub fn prepare(&mut self, dev: &DeviceMem) -> Result<()> {
        for t in self.transports.iter_mut() {
            t.prepare(&mut cx!(self), dev)?;
        }
        Ok(())
    }

    /// One pass of the progress loop. Says whether it did anything and whether work is
    /// still outstanding, so the progress thread can pick between passing again, a short
    /// nap, and a long one.
    pub fn pass(&mut self) -> Pass {
        self.pass_reading(Instant::now(), |_| true)
    }

    /// The pass a post makes on the caller's thread: starts what was handed over and reads
    /// only the completion queues of rails that complete inside the post call (shm's fast
    /// RMA; the request may then be done when the post returns). Reading a tcp rail's
    /// queue right after posting runs the provider's progress (a poll of its sockets) that
    /// finds nothing yet: a quarter of a 4 KiB READ's transfer() (tcp, progress off, CPU
    /// VM, perf); the first poll of the request reads it. As with pass_local, a full pass
    /// runs instead when the last one is older than LOCAL_PASS_MAX_GAP.
    pub fn pass_post(&mut self) -> Pass {
        let now = Instant::now();
        if self.full_pass_due(now) {
            return self.pass_reading(now, |_| true);
        }
        self.pass_reading(now, |p| p.caps().sync_rma)
    }

    /// Whether the last full pass is older than LOCAL_PASS_MAX_GAP: the lighter passes
    /// (post, local) then make a full one instead, so the rails are still served.
    fn full_pass_due(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last_full) >= LOCAL_PASS_MAX_GAP
    }

    /// One pass, begun at `now`, that reads the completion queues of the rails `read` picks
    /// (all of them: a full pass, which the progress thread's naps and LOCAL_PASS_MAX_GAP
    /// count on).
    fn pass_reading(&mut self, now: Instant, read: impl Fn(&dyn Port) -> bool) -> Pass {
        add(&self.core.counters.progress_passes, 1);
        self.now = now;
        let full = (0..self.rails.len()).all(|r| read(&*self.rails[r]));
        self.full_now = full;
        if full {
            self.last_full = self.now;
        }
        self.ctxs.apply(&self.core);
        for mr in super::registry::CloseQueue::drain(&self.core.closeq) {
            drop(mr);
        }
        let posted0 = self.core.counters.ops_posted.load(std::sync::atomic::Ordering::Relaxed);
        let took = self.drain_inbox();
        if !self.recv_retry.is_empty() {
            if let Err(e) = self.post_recvs() {
                log::error!("{}: cannot re-post a control receive: {e}", self.core.name);
            }
        }
        self.post_pending();
        self.flush_ctrl();
        let mut got = 0;
        for r in 0..self.rails.len() {
            if read(&*self.rails[r]) {
                got += self.poll_rail(r);
            }
        }
        // Completions may have freed queue slots: post again in the same pass.
        if got > 0 {
            self.post_pending();
        }
        let busy = self.advance_transports();
        self.sweep();
        self.let_go_of_finished();
        let posted = self.core.counters.ops_posted.load(std::sync::atomic::Ordering::Relaxed) != posted0;
        Pass { did: took || got > 0 || posted, pending: busy || self.has_pending() }
    }

    /// A pass for a request that moves by local copies only (CMA, direct, loopback; not a
    /// peer's copy, whose answer comes on rail 0), made on the caller's thread as it posts
    /// or polls: starts what was handed over and finishes what the copies completed,
    /// without reading the rails' completion queues. Reading a
    /// tcp rail's queue runs the provider's progress (socket polls): with the four automatic
    /// tcp rails and the shm rail of the 16-core host those reads were half of a 4 KiB
    /// same-host WRITE (9.2 us; 4.1 with the shm rail alone). A full pass runs instead when
    /// the last one is older than LOCAL_PASS_MAX_GAP, so that a caller moving only local
    /// copies with the progress thread off still serves the rails.
    pub fn pass_local(&mut self) -> Pass {
        let now = Instant::now();
        if self.full_pass_due(now) {
            return self.pass_reading(now, |_| true);
        }
        self.now = now;
        self.full_now = false;
        add(&self.core.counters.local_passes, 1);
        self.ctxs.apply(&self.core);
        let took = self.drain_inbox();
        self.post_pending();
        let busy = self.advance_transports();
        self.let_go_of_finished();
        Pass { did: took, pending: busy || self.has_pending() }
    }

    /// A post by the caller that holds the driver (progress thread off): started after
    /// whatever was handed over before it, without the trip through the inbox (two locks
    /// of a 4 KiB same-host WRITE's ~2 us), then a pass of `kind`.
    pub fn post_now(&mut self, req: Arc<Request>, kind: PassKind) -> Pass {
        self.handed = Some(req);
        self.pass_of(kind)
    }

    /// A pass of the kind asked for.
    pub fn pass_of(&mut self, kind: PassKind) -> Pass {
        match kind {
            PassKind::Full => self.pass(),
            PassKind::Post => self.pass_post(),
            PassKind::Local => self.pass_local(),
        }
    }

    /// Lets every transport move its work on, then applies what ended and sends the control
    /// messages that queued. Returns whether a transport has work in flight.
    fn advance_transports(&mut self) -> bool {
        for op in std::mem::take(&mut self.taken_back) {
            if let Some(t) = self.transports.get_mut(op.owner as usize) {
                t.on_completion(&mut cx!(self), op, 0, Some(Error::Canceled));
            }
        }
        let mut busy = false;
        for t in self.transports.iter_mut() {
            busy |= t.advance(&mut cx!(self));
        }
        self.apply_outcomes();
        self.flush_ctrl();
        busy
    }

    /// Lets go of requests that finished in this pass now, not at the next sweep: what a
    /// request keeps alive (registrations, their page-locking) must be gone by the time its
    /// owner has released it (Engine::release waits for that) and frees the memory.
    fn let_go_of_finished(&mut self) {
        self.active.retain(|r| matches!(r.state().phase, Phase::Data | Phase::Notif));
    }

    fn drain_inbox(&mut self) -> bool {
        let work = self.inbox.take();
        let mut any = !work.is_empty();
        for s in work {
            match s {
                Submit::Post(req) => self.begin(req),
                Submit::Task(f) => f(self),
            }
        }
        if let Some(req) = self.handed.take() {
            self.begin(req);
            any = true;
        }
        any
    }

    fn begin(&mut self, req: Arc<Request>) {
        let mut st = req.state();
        if st.cancelled {
            return self.complete(&req, &mut st, Err(Error::Canceled));
        }
        if let Some(peer) = req.peer().cloned() {
            if let Err(e) = self.ensure_conn(&peer) {
                return self.complete(&req, &mut st, Err(e));
            }
            if !req.keeps.is_empty() {
                // A direct copy into a dead peer's memory would succeed: ask first.
                if !peer.local.alive_within_at(super::local_peers::RECENTLY_ALIVE, self.now) {
                    log::error!("{}: agent '{}' on this host has exited; disconnecting", self.core.name, peer.name);
                    peer.mark_disconnected();
                    drop(st);
                    self.disconnect(peer.id);
                    let mut st = req.state();
                    if st.phase != Phase::Done {
                        self.complete(&req, &mut st, Err(Error::Disconnected(format!("agent '{}' exited", peer.name))));
                    }
                    return;
                }
                if let Err(e) = super::ipc_cache::check_keeps(&req.keeps) {
                    return self.complete(&req, &mut st, Err(e));
                }
            }
            // A notification's send completes only once the peer's provider has taken it
            // (delivery complete), so its progress thread must be spinning too.
            if req.on_rails || st.notif.is_some() {
                self.kick(peer.id);
            }
        }
        // Its timeout counts from here (the pass's clock reading, as the post had no other).
        st.last_progress = self.now;
        st.phase = Phase::Data;
        let empty = req.segs.is_empty();
        if empty {
            self.data_done(&req, &mut st);
        }
        drop(st);
        if !empty {
            self.to_post.push_back(req.clone());
        }
        self.active.push(req);
    }

    /// Inserts a peer's rail addresses into our AVs and introduces ourselves.
    pub fn ensure_conn(&mut self, peer: &Arc<Peer>) -> Result<()> {
        if let Some(hello) = self.conns.connect(peer, &self.rails, &self.core)? {
            self.ctrl.queue(hello)?;
        }
        Ok(())
    }

    /// Sends a Kick to a peer unless one went out within KICK_INTERVAL.
    fn kick(&mut self, peer_id: u64) {
        if let Some(m) = self.conns.kick(peer_id, KICK_INTERVAL, &self.core) {
            let _ = self.ctrl.queue(m);
        }
    }

    /// Operations to `peer_id` that shm's fast RMA finished inside the post call: their
    /// completion is in the CQ already (read here first), or the copy failed and none will
    /// ever come. Without this, every failed one would hold an in-flight slot of the rail
    /// for good, and enough of them would stall the rail for every other peer.
    fn reclaim_inline_ops(&mut self, peer_id: u64) {
        for r in 0..self.rails.len() {
            if self.rails[r].caps().sync_rma {
                self.poll_rail(r);
            }
        }
        for t in self.ops.take_inline_for(peer_id) {
            if t.slot {
                self.slots.give(t.rail as usize);
            }
            if let Some(req) = t.req {
                let mut st = req.state();
                st.inflight_total = st.inflight_total.saturating_sub(1);
            }
        }
    }

    /// A same-host peer reached by CMA is checked by reading its token (one system call)
    /// while we have work for it, or at once after a failed copy: a dead process leaves
    /// shm nothing to complete our operations with, and its pid may be reused. A peer
    /// that fails the check is disconnected, so its requests end with REMOTE_DISCONNECT
    /// now instead of at the timeout.
    fn probe_same_host(&mut self, all: bool) {
        let busy: Vec<u64> = self.active.iter().filter_map(|r| r.peer().map(|p| p.id)).collect();
        let dead = self.conns.dead_same_host(|id| all || busy.contains(&id));
        for (id, name) in dead {
            log::error!("{}: agent '{name}' on this host is gone (its process can no longer be read); disconnecting", self.core.name);
            if let Some(c) = self.conns.peers.get(&id) {
                c.peer.mark_disconnected();
            }
            self.disconnect(id);
        }
    }

    pub fn disconnect(&mut self, peer_id: u64) {
        let engine_id = self.conns.peers.get(&peer_id).map(|c| c.peer.info.engine_id);
        // Drain shm's completions while the peer is still in the AV: libfabric's shm unmaps
        // a peer's region in fi_av_remove, and a CQ read after that could still reach it
        // (the C harness crashed in pthread_spin_trylock under fi_cq_read at engine destroy
        // on 1.17, after a child peer had exited).
        self.reclaim_inline_ops(peer_id);
        if let Some(c) = self.conns.peers.remove(&peer_id) {
            for (l, row) in c.addrs.iter().enumerate() {
                for a in row.iter().flatten() {
                    // What a rail thread has not posted yet toward the peer never will be.
                    for ctx in self.rails[l].take_queued_for(*a) {
                        self.on_completion(l, ctx, 0, Some(Error::Disconnected("peer was disconnected".into())));
                    }
                    self.rails[l].av_remove(*a);
                }
            }
            log::info!("{}: disconnected from agent '{}'", self.core.name, c.peer.name);
        }
        self.ctrl.queue.retain(|m| m.peer_id != peer_id);
        if let Some(id) = engine_id {
            for t in self.transports.iter_mut() {
                t.drop_peer(&mut cx!(self), peer_id, id);
            }
            self.apply_outcomes();
        }
        for req in std::mem::take(&mut self.active) {
            if req.peer().is_some_and(|p| p.id == peer_id) {
                let mut st = req.state();
                if matches!(st.phase, Phase::Data | Phase::Notif) {
                    self.complete(&req, &mut st, Err(Error::Disconnected("peer was disconnected".into())));
                }
            }
            self.active.push(req);
        }
    }

    /// Queues a control message to a peer (a notification, optionally completing `req`).
    pub fn send_ctrl(&mut self, peer: &Arc<Peer>, kind: CtrlType, payload: &[u8], req: Option<(Arc<Request>, u64)>) -> Result<()> {
        self.ensure_conn(peer)?;
        let dest = self.conns.ctrl_addr(peer.id)?;
        let bytes = wire::encode_ctrl(kind, self.core.engine_id, &self.core.name, payload);
        self.ctrl.queue(CtrlOut { peer_id: peer.id, dest, bytes, req })
    }

    /// Starts what the transports take of the queued posts. A queue that stays full toward
    /// one peer (a dead one keeps answering FI_EAGAIN) must not hold up the others: a
    /// blocked post goes to the back, and each is looked at once per pass.
    fn post_pending(&mut self) {
        let mut budget = self.to_post.len();
        while let Some(req) = self.to_post.front().cloned() {
            if budget == 0 {
                break;
            }
            budget -= 1;
            let mut st = req.state();
            if st.phase != Phase::Data {
                self.to_post.pop_front();
                continue;
            }
            if st.cancelled || st.error.is_some() {
                st.next = req.segs.len();
            }
            let mut blocked = false;
            while st.next < req.segs.len() {
                let t = self.route[req.segs[st.next].kind.route() as usize];
                let (epoch, at) = (st.epoch, st.next);
                let s = &mut *st;
                let start = self.transports[t].start(&mut cx!(self), Post { req: &req, epoch, at, marks: &mut s.marks, notif: &mut s.notif });
                st.next += start.segs;
                st.outstanding += start.pieces;
                st.inflight_total += start.pieces;
                match start.stop {
                    None if start.segs == 0 => {
                        let e = Error::Backend(format!("transport {} took no segment", self.transports[t].name()));
                        st.error.get_or_insert(e);
                        st.next = req.segs.len();
                    }
                    None => {}
                    Some(Stop::Blocked) => {
                        blocked = true;
                        break;
                    }
                    Some(Stop::Failed(e)) => {
                        st.error.get_or_insert(e);
                        st.next = req.segs.len();
                    }
                }
            }
            if st.next >= req.segs.len() {
                self.to_post.pop_front();
                self.all_started(&req, &mut st);
                if st.outstanding == 0 {
                    self.data_done(&req, &mut st);
                }
            } else if blocked {
                if let Some(r) = self.to_post.pop_front() {
                    self.to_post.push_back(r);
                }
            }
            drop(st);
            self.apply_outcomes();
        }
    }

    /// Every segment of the post has started. Where every transport's data is ordered before
    /// a send on the control endpoint (Transport::notif_follows), the notification goes
    /// now, right behind the data, as one more piece of the data phase, instead of after
    /// the flush reads; and finishing steps that may start already do (flush reads posted
    /// behind the writes on the same endpoint).
    fn all_started(&mut self, req: &Arc<Request>, st: &mut ReqState) {
        if st.error.is_some() || st.cancelled || !self.core.cfg.notif_behind_data {
            return;
        }
        let epoch = st.epoch;
        if let (Some(peer), true) = (req.peer().cloned(), st.notif.is_some()) {
            let cx = cx!(self);
            if self.transports.iter().all(|t| t.notif_follows(&cx, req)) {
                let msg = st.notif.take().unwrap_or_default();
                match self.send_ctrl(&peer, CtrlType::Notif, &msg, Some((req.clone(), epoch))) {
                    Ok(()) => {
                        st.marks.notif_ahead = true;
                        st.outstanding += 1;
                        add(&self.core.counters.notifs_ordered, 1);
                    }
                    Err(e) => {
                        st.error.get_or_insert(e);
                        return;
                    }
                }
            }
        }
        let mut extra = 0;
        for t in self.transports.iter_mut() {
            extra += t.finish_early(&mut cx!(self), req, epoch, &mut st.marks);
        }
        st.outstanding += extra;
    }

    /// A notification's send of post `epoch` ended with `res`: in the notification phase
    /// that ends the post; sent behind its data (Marks::notif_ahead), it is a piece of the
    /// data phase.
    fn notif_ended(&mut self, req: &Arc<Request>, epoch: u64, res: Result<()>) {
        let mut st = req.state();
        if st.epoch != epoch {
            return;
        }
        match st.phase {
            Phase::Notif => self.complete(req, &mut st, res),
            Phase::Data if st.marks.notif_ahead => {
                st.marks.notif_ahead = false;
                st.outstanding = st.outstanding.saturating_sub(1);
                st.last_progress = Instant::now();
                if let Err(e) = res {
                    st.error.get_or_insert(e);
                }
                if st.outstanding == 0 && st.next >= req.segs.len() {
                    self.data_done(req, &mut st);
                }
            }
            // Another message of the post's data (an eager write): its piece ends with the
            // answer, or after this error (Marks::lost_sends) at its transport's next sweep.
            Phase::Data => {
                if let Err(e) = res {
                    st.error.get_or_insert(e);
                    st.marks.lost_sends += 1;
                }
            }
            _ => {}
        }
    }

    /// Acts on what the transports reported.
    fn apply_outcomes(&mut self) {
        while !self.out.is_empty() {
            for o in std::mem::take(&mut self.out) {
                match o {
                    Outcome::Piece(p) => self.on_piece(p),
                    Outcome::Ctrl(m) => {
                        if let Err(e) = self.ctrl.queue(m) {
                            log::error!("{}: {e}", self.core.name);
                        }
                    }
                }
            }
        }
    }

    /// One outstanding piece of a post ended: counts its bytes or its failure (which stops
    /// the post's remaining segments), and ends the data phase when it was the last.
    fn on_piece(&mut self, p: Piece) {
        if let Some(peer) = p.req.peer() {
            self.conns.touch(peer.id);
        }
        let req = p.req.clone();
        let mut st = req.state();
        let end = PieceEnd { epoch: p.epoch, bytes: p.bytes, res: p.res, local_copy: p.local_copy };
        if st.piece_ended(&req, end, &self.core.counters) {
            self.data_done(&req, &mut st);
        }
    }

    /// Every piece of the post ended: the transports' finishing steps (flush reads), then
    /// the notification, then done. The finishing steps run for a failed or cancelled post
    /// too: its other writes may have completed at transmit only, and their bytes must have
    /// landed before the post ends (its owner reuses the target memory next; a failed
    /// WRITE's bytes once landed over the next request's).
    fn data_done(&mut self, req: &Arc<Request>, st: &mut ReqState) {
        if st.phase != Phase::Data {
            return;
        }
        if !st.flushing {
            st.flushing = true;
            let epoch = st.epoch;
            let mut extra = 0;
            for t in self.transports.iter_mut() {
                extra += t.finishing(&mut cx!(self), req, epoch, &mut st.marks);
            }
            if extra > 0 {
                st.outstanding += extra;
                return; // data_done runs again when they complete
            }
        }
        if let Some(e) = st.error.take() {
            self.complete(req, st, Err(e));
        } else if st.cancelled {
            self.complete(req, st, Err(Error::Canceled));
        } else if let Some(msg) = st.notif.take() {
            let Some(peer) = req.peer().cloned() else {
                // Loopback: the notification is ours.
                self.core.push_notif(self.core.name.clone(), msg);
                return self.complete(req, st, Ok(()));
            };
            st.phase = Phase::Notif;
            st.last_progress = Instant::now();
            if let Err(e) = self.send_ctrl(&peer, CtrlType::Notif, &msg, Some((req.clone(), st.epoch))) {
                self.complete(req, st, Err(e));
            }
        } else {
            self.complete(req, st, Ok(()));
        }
    }

    fn complete(&mut self, req: &Arc<Request>, st: &mut ReqState, res: Result<()>) {
        if !st.end(req, res, &self.core) {
            self.unqueue_ops_of(req, st);
        }
    }

    /// A failed or cancelled request's operations still waiting in rail outboxes are never
    /// posted: once the request has ended its owner may release it and free the memory.
    fn unqueue_ops_of(&mut self, req: &Arc<Request>, st: &mut ReqState) {
        for t in self.ops.take_queued_of(&self.rails, req) {
            if t.slot {
                self.slots.give(t.rail as usize);
            }
            if self.transports.get(t.owner as usize).is_some_and(|x| x.hears_taken_back()) {
                // (Its transport ends the piece the operation belonged to, as for a failed
                // completion: a staged chunk's slot would stay held otherwise.)
                self.taken_back.push(t);
                continue;
            }
            st.inflight_total = st.inflight_total.saturating_sub(1);
            st.outstanding = st.outstanding.saturating_sub(1);
        }
    }

    fn flush_ctrl(&mut self) {
        if self.ctrl.queue.is_empty() || (self.ctrl_pushed_back && !self.full_now) {
            return;
        }
        let (failed, again) = self.ctrl.flush(&*self.rails[0], &mut self.ops, CtrlType::Notif as u8, wire::CTRL_TYPE_OFFSET);
        self.ctrl_pushed_back = again;
        if again {
            add(&self.core.counters.retries, 1);
        }
        for (done, e) in failed {
            log::error!("{}: sending a control message failed: {e}", self.core.name);
            if let Some((req, epoch)) = done {
                self.notif_ended(&req, epoch, Err(e));
            }
        }
    }

    fn poll_rail(&mut self, rail: usize) -> usize {
        // The driver's buffer, taken for this poll (a poll inside a completion's handling,
        // reclaim_inline_ops, finds it gone and makes its own): filling a fresh one was a
        // 1.5 KiB memset on every poll of every pass.
        let mut buf = std::mem::take(&mut self.cq_buf.0);
        if buf.len() < POLL_BATCH {
            buf = vec![Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; POLL_BATCH].into_boxed_slice();
        }
        let mut total = 0;
        for _ in 0..16 {
            match self.rails[rail].poll(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    total += n;
                    if self.rails[rail].posts_on_thread() {
                        self.core.note_rail_traffic();
                    }
                    for c in &buf[..n] {
                        if !c.is_remote_write() {
                            self.on_completion(rail, c.ctx, c.len, None);
                        }
                    }
                    if n < POLL_BATCH {
                        break;
                    }
                }
                Err(e) => {
                    total += 1;
                    add(&self.core.rail_counters[rail].errors, 1);
                    let ctx = e.ctx;
                    let err = e.into_error("completion", rail);
                    if ctx.is_null() {
                        log::warn!("{}: rail {rail}: {err}", self.core.name);
                        if self.rails[rail].caps().sync_rma {
                            self.probe_now = true;
                        }
                    } else {
                        self.on_completion(rail, ctx, 0, Some(err));
                    }
                }
            }
        }
        self.cq_buf.0 = buf;
        total
    }

    fn on_completion(&mut self, rail: usize, ctx: *mut std::ffi::c_void, len: usize, err: Option<Error>) {
        let Some(kind) = self.ops.release(ctx) else {
            log::warn!("{}: rail {rail}: completion for an unknown context", self.core.name);
            return;
        };
        match kind {
            OpKind::Free => {}
            OpKind::Transport(op) => {
                let t = op.owner as usize;
                if let Some(t) = self.transports.get_mut(t) {
                    t.on_completion(&mut cx!(self), op, len, err);
                }
                self.apply_outcomes();
            }
            OpKind::Send { buf, req, notif } => {
                self.ctrl.sent(buf);
                if err.is_none() && notif {
                    add(&self.core.counters.notifs_sent, 1);
                }
                if let Some((req, epoch)) = req {
                    let cancelled = req.state().cancelled;
                    let res = err.map_or(Ok(()), |e| Err(super::request::flushed_as_disconnect(e, cancelled)));
                    self.notif_ended(&req, epoch, res);
                } else if let Some(e) = err {
                    log::error!("{}: control message failed: {e}", self.core.name);
                }
            }
            OpKind::Recv { buf } => {
                match err {
                    None => self.on_ctrl(buf, len),
                    Some(Error::Completion { errno, .. }) if errno == libc::ECANCELED => return,
                    Some(e) => log::warn!("{}: control receive failed: {e}", self.core.name),
                }
                self.recv_retry.push(buf);
                if let Err(e) = self.post_recvs() {
                    log::error!("{}: cannot re-post a control receive: {e}", self.core.name);
                }
            }
        }
    }

    fn on_ctrl(&mut self, buf: u32, len: usize) {
        let msg = match wire::decode_ctrl(self.ctrl.received(buf, len)) {
            Ok(m) => m,
            Err(e) => {
                log::warn!("{}: dropping a control message: {e}", self.core.name);
                return;
            }
        };
        match msg.kind {
            CtrlType::Hello => self.conns.introduce(&msg, self.core.host_id, &self.core.name),
            // Its receive completion already made this pass busy; a peer whose data comes
            // over the network rails also needs their threads driving them here.
            CtrlType::Kick => {
                if self.conns.data_over_network_rails(msg.sender_id, self.core.host_id, self.core.cfg.same_host_shm) {
                    self.core.note_rail_traffic();
                }
            }
            CtrlType::Notif => {
                add(&self.core.counters.notifs_received, 1);
                self.core.push_notif(msg.sender.to_string(), msg.payload.to_vec());
            }
            _ => {
                let mut cx = cx!(self);
                if !self.transports.iter_mut().any(|t| t.on_control(&mut cx, &msg)) {
                    log::warn!("{}: no transport takes a {:?} message from '{}'", self.core.name, msg.kind, msg.sender);
                }
                self.apply_outcomes();
            }
        }
    }

    /// Deadlines (rule 2): a post whose peer completed nothing for `timeout_ms` fails with
    /// REMOTE_DISCONNECT; finished requests leave the active list.
    fn sweep(&mut self) {
        let now = self.now;
        if now.duration_since(self.last_sweep) < Duration::from_millis(5) {
            return;
        }
        self.last_sweep = now;
        let all = std::mem::take(&mut self.probe_now);
        self.probe_same_host(all);
        for t in self.transports.iter_mut() {
            t.sweep(&mut cx!(self));
        }
        self.apply_outcomes();
        let timeout = self.core.cfg.timeout();
        // Peers with work in flight get a kick (rate-limited), so a long request keeps
        // the target polling to its end.
        let mut kick: Vec<u64> = self.active.iter().filter_map(|r| r.peer().map(|p| p.id)).collect();
        kick.sort_unstable();
        kick.dedup();
        for id in kick {
            self.kick(id);
        }
        // A long operation on a threaded rail may go 20 ms without a completion.
        if (0..self.rails.len()).any(|r| self.slots.inflight[r] > 0 && self.rails[r].posts_on_thread()) {
            self.core.note_rail_traffic();
        }
        let (keep, overdue) = super::request::overdue(std::mem::take(&mut self.active), |id| self.conns.peers.get(&id).map(|c| c.last_completion), timeout, now);
        self.active = keep;
        for (req, e) in overdue {
            let mut st = req.state();
            self.complete(&req, &mut st, Err(e));
        }
    }

    /// Requests, control messages or transport work are still queued or in flight.
    pub fn has_pending(&self) -> bool {
        !self.to_post.is_empty() || !self.active.is_empty() || !self.ctrl.queue.is_empty() || !self.recv_retry.is_empty()
            || self.transports.iter().any(|t| !t.idle())
    }

    pub fn rails(&self) -> &[Arc<dyn Port>] {
        &self.rails
    }

    /// Fails everything still queued or in flight and forgets every peer's addresses
    /// (engine teardown: closing an endpoint with peers still in its AV has crashed shm).
    pub fn cancel_all(&mut self) {
        let ids: Vec<u64> = self.conns.peers.keys().copied().collect();
        for id in ids {
            self.disconnect(id);
        }
        for req in std::mem::take(&mut self.active) {
            let mut st = req.state();
            if matches!(st.phase, Phase::Data | Phase::Notif) {
                self.complete(&req, &mut st, Err(Error::Canceled));
            }
        }
        self.to_post.clear();
        self.ctrl.queue.clear();
        for s in self.inbox.take() {
            if let Submit::Post(req) = s {
                let mut st = req.state();
                self.complete(&req, &mut st, Err(Error::Canceled));
            }
        }
        for t in self.transports.iter_mut() {
            t.quiesce(&mut cx!(self));
        }
        self.out.clear();
    }
}
