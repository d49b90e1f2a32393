//! The driver owns the rails (DESIGN rule 3): only whoever holds it (the progress thread,
//! or with the thread off the caller that locked it) touches endpoints, CQs, AVs and MRs.
//! One `pass` drains handed-over work, posts what the queues accept, reads completions
//! and enforces deadlines.
use super::core::{Core, Submit};
use super::counters::add;
use super::ops::{OpKind, OpPool};
use super::peer::Peer;
use super::request::{Op, Phase, ReqState, Request, SegKind, Target};
use super::staging::{Staging, Start};
use super::wire::{self, CtrlType};
use crate::error::{Error, Result, Status};
use crate::fabric::{Completion, FiAddr, MemoryRegion, Posted, Rail, RmaSeg, MAX_RMA_BATCH};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Control-message buffers: pre-posted receives and a pool of send buffers, registered on
/// rail 0 (providers with FI_MR_LOCAL need descriptors for them).
struct CtrlBuffers {
    size: usize,
    recv: Box<[u8]>,
    send: Box<[u8]>,
    send_free: Vec<u32>,
    recv_mr: Option<MemoryRegion>,
    send_mr: Option<MemoryRegion>,
}

impl CtrlBuffers {
    fn recv_ptr(&mut self, i: u32) -> *mut u8 {
        // SAFETY: i < recv count; the slice holds count * size bytes.
        unsafe { self.recv.as_mut_ptr().add(i as usize * self.size) }
    }
    fn send_ptr(&mut self, i: u32) -> *mut u8 {
        // SAFETY: i < send count; the slice holds count * size bytes.
        unsafe { self.send.as_mut_ptr().add(i as usize * self.size) }
    }
    fn desc(mr: &Option<MemoryRegion>) -> *mut std::ffi::c_void {
        mr.as_ref().map_or(std::ptr::null_mut(), |m| m.desc)
    }
}

/// Maps keyed by our peer ids and engine ids, looked up once per operation and completion:
/// a multiplicative hash instead of SipHash (callgrind: SipHash was ~190 instructions per
/// operation). The keys come from us (sequential ids) or are random engine ids, so
/// flooding the table is not a concern.
type IdMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;

#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

/// Our addresses of one peer: `addrs[local rail][remote rail]`.
struct Conn {
    peer: Arc<Peer>,
    addrs: Arc<Vec<Vec<Option<FiAddr>>>>,
    /// Bit r: a completed write on our rail r has reached this peer's memory (RailCaps::
    /// sync_rma and the peer is reachable by CMA), so it needs neither flush nor
    /// delivery-complete.
    sync_rails: u64,
    last_completion: Instant,
    last_kick: Option<Instant>,
}

/// How often a busy initiator reminds a peer that traffic is flowing. Manual-progress
/// providers need the *target* to progress for RMA to land (or be read), yet RMA gives the
/// target no completion to notice; the kick's receive completion does, and keeps the
/// target's progress thread spinning instead of napping (see progress.rs).
const KICK_INTERVAL: Duration = Duration::from_millis(5);

/// Largest operation a batch of segments grows to: beyond this, batching saves nothing.
const MAX_BATCH_BYTES: u64 = 1 << 20;

pub(super) struct CtrlOut {
    pub peer_id: u64,
    pub dest: FiAddr,
    pub bytes: Vec<u8>,
    pub req: Option<(Arc<Request>, u64)>,
}

/// An engine that sent us HELLO: what we need to answer it (stage requests).
struct Initiator {
    name: String,
    info: Option<wire::ConnInfo>,
    addr: Option<FiAddr>,
    /// Watches its process when it is on this host (copy requests open its GPU memory).
    pidfd: Option<super::local_peers::PidFd>,
}

const SEND_BUFFERS: usize = 32;
const POLL_BATCH: usize = 64;

/// A provider flushes operations it can no longer complete (the connection died) as
/// canceled; only the owner cancels on purpose, so any other cancel is a lost peer.
fn flushed_as_disconnect(e: Error, cancelled_by_owner: bool) -> Error {
    match e {
        Error::Completion { errno, .. } if errno == libc::ECANCELED && !cancelled_by_owner => {
            Error::Disconnected(format!("{e} (flushed by the provider: connection lost)"))
        }
        e => e,
    }
}

/// What one pass did.
#[derive(Clone, Copy, Debug)]
pub struct Pass {
    /// Something happened: work taken, operations posted, completions read.
    pub did: bool,
    /// Requests, control messages or staging chunks are still in flight.
    pub pending: bool,
}

/// What an idle progress thread may wait on.
pub enum Idle {
    /// Some CQ has no wait fd: sleep on a timer only.
    NoFds,
    /// fi_trywait says events are pending: pass again instead of sleeping.
    Busy,
    Fds(Vec<i32>),
}

pub struct Driver {
    // Field order is drop order: endpoints close before the buffers they may write into.
    pub(super) rails: Vec<Arc<Rail>>,
    pub(super) ops: OpPool,
    pub(super) staging: Staging,
    pub(super) direct: super::direct::Direct,
    pub(super) cma: super::cma_copy::Cma,
    ctrl: CtrlBuffers,
    pub(super) core: Arc<Core>,
    conns: IdMap<Conn>,
    /// Engines that introduced themselves (engine id -> who they are).
    initiators: IdMap<Initiator>,
    to_post: VecDeque<Arc<Request>>,
    active: Vec<Arc<Request>>,
    pub(super) ctrl_out: VecDeque<CtrlOut>,
    inflight: Vec<usize>,
    cap: Vec<usize>,
    /// Per rail: whether writes there are transmit-complete plus a flush read (the rail
    /// orders reads after writes) instead of delivery-complete, which tcp;ofi_rxm answers
    /// only after the target's next progress (milliseconds).
    flush_writes: Vec<bool>,
    /// Most segments per RMA operation (config rma_batch; the rail's limit applies too).
    batch_max: usize,
    /// An error completion without a context on a sync_rma rail: shm's fast RMA reports a
    /// failed copy (a dead peer process) that way, so the next sweep probes same-host
    /// peers at once.
    probe_now: bool,
    /// Landing place of flush reads, registered on every rail.
    flush_buf: Box<[u8; 64]>,
    flush_mrs: Vec<MemoryRegion>,
    flushes: VecDeque<(Arc<Request>, u64, usize)>,
    last_sweep: Instant,
    pub(super) next_key: u64,
    /// The captured contexts (copy of the engine's registry) and its version.
    ctxs: Vec<crate::cuda::Context>,
    ctx_version: u64,
}

impl Driver {
    pub fn new(core: Arc<Core>, rails: Vec<Arc<Rail>>) -> Result<Driver> {
        let cfg = &core.cfg;
        let size = cfg.max_notif_size as usize + wire::CTRL_HEADER + wire::MAX_NAME_LEN + 4096;
        let nrecv = (cfg.ctrl_recv_count as usize).min(rails[0].caps.rx_size.max(1));
        let mut ctrl = CtrlBuffers {
            size,
            recv: vec![0u8; size * nrecv].into_boxed_slice(),
            send: vec![0u8; size * SEND_BUFFERS].into_boxed_slice(),
            send_free: (0..SEND_BUFFERS as u32).rev().collect(),
            recv_mr: None,
            send_mr: None,
        };
        // SAFETY: the control buffers are owned by the driver, which drops their MRs with them.
        ctrl.recv_mr = Some(unsafe { rails[0].register(ctrl.recv.as_ptr(), ctrl.recv.len(), 1, None) }?);
        // SAFETY: as above.
        ctrl.send_mr = Some(unsafe { rails[0].register(ctrl.send.as_ptr(), ctrl.send.len(), 2, None) }?);
        let cap = rails.iter().map(|r| (cfg.max_inflight as usize).min(r.caps.tx_size).max(1)).collect();
        let n = rails.len();
        let flush_writes: Vec<bool> = rails.iter().map(|r| r.caps.order_raw).collect();
        let batch_max = (cfg.rma_batch as usize).clamp(1, MAX_RMA_BATCH);
        let flush_buf = Box::new([0u8; 64]);
        let mut flush_mrs = Vec::with_capacity(n);
        for r in &rails {
            // SAFETY: flush_buf is boxed in the driver, which drops flush_mrs with it.
            flush_mrs.push(unsafe { r.register(flush_buf.as_ptr(), flush_buf.len(), 3, None) }?);
        }
        let mut d = Driver {
            ops: OpPool::with_capacity(1024),
            staging: Staging::default(),
            direct: super::direct::Direct::default(),
            cma: super::cma_copy::Cma::new(&core.name, super::cma_copy::thread_count(cfg.cma_threads)),
            ctrl,
            core,
            conns: IdMap::default(),
            initiators: IdMap::default(),
            to_post: VecDeque::new(),
            active: Vec::new(),
            ctrl_out: VecDeque::new(),
            inflight: vec![0; n],
            cap,
            flush_writes,
            batch_max,
            probe_now: false,
            flush_buf,
            flush_mrs,
            flushes: VecDeque::new(),
            last_sweep: Instant::now(),
            next_key: 16,
            ctxs: Vec::new(),
            ctx_version: 0,
            rails,
        };
        for i in 0..nrecv as u32 {
            d.post_recv(i)?;
        }
        Ok(d)
    }

    fn post_recv(&mut self, buf: u32) -> Result<()> {
        let ptr = self.ctrl.recv_ptr(buf);
        let desc = CtrlBuffers::desc(&self.ctrl.recv_mr);
        let deadline = Instant::now() + self.core.cfg.timeout();
        loop {
            let ctx = self.ops.alloc(OpKind::Recv { buf });
            // SAFETY: a receive slot of the driver's registered control buffer, posted once at a
            // time; ctx is a fresh op slot released on its completion.
            match unsafe { self.rails[0].recv(ptr, self.ctrl.size, desc, ctx) } {
                Ok(Posted::Ok) => return Ok(()),
                Ok(Posted::Again) => {
                    self.ops.release(ctx);
                    if Instant::now() > deadline {
                        return Err(Error::Timeout("re-posting a control receive buffer".into()));
                    }
                    self.poll_rail(0);
                }
                Err(e) => {
                    self.ops.release(ctx);
                    return Err(e);
                }
            }
        }
    }

    /// Registers a region on every rail. Keys are ours to choose where the provider does
    /// not choose them; they only need to be unique per domain.
    pub fn register(&mut self, addr: u64, len: u64, hmem: Option<(u32, i32)>) -> Result<Vec<MemoryRegion>> {
        let mut mrs = Vec::with_capacity(self.rails.len());
        for r in &self.rails {
            self.next_key += 1;
            // SAFETY: the caller's registration; LocalMem keeps the MRs, and the memory must
            // outlive them (NIXL's registerMem contract).
            mrs.push(unsafe { r.register(addr as *const u8, len as usize, self.next_key, hmem) }?);
        }
        Ok(mrs)
    }

    /// One pass of the progress loop. Says whether it did anything and whether work is
    /// still outstanding, so the progress thread can pick between passing again, a short
    /// nap, and a long one.
    pub fn pass(&mut self) -> Pass {
        add(&self.core.counters.progress_passes, 1);
        self.apply_contexts();
        for mr in super::registry::CloseQueue::drain(&self.core.closeq) {
            drop(mr);
        }
        let posted0 = self.core.counters.ops_posted.load(std::sync::atomic::Ordering::Relaxed);
        let took = self.drain_submit();
        self.post_pending();
        self.post_flushes();
        self.flush_ctrl();
        let mut got = 0;
        for r in 0..self.rails.len() {
            got += self.poll_rail(r);
        }
        // Completions may have freed queue slots: post again in the same pass.
        if got > 0 {
            self.post_pending();
            self.post_flushes();
            self.flush_ctrl();
        }
        let staging = self.advance_staging() | self.advance_direct() | self.advance_serves_direct() | self.advance_cma();
        if staging {
            self.flush_ctrl();
        }
        self.sweep();
        // Let go of requests that finished in this pass now, not at the next sweep: what a
        // request keeps alive (registrations, their page-locking) must be gone by the time
        // its owner has released it (Engine::release waits for that) and frees the memory.
        self.active.retain(|r| matches!(r.state().phase, Phase::Data | Phase::Notif));
        let posted = self.core.counters.ops_posted.load(std::sync::atomic::Ordering::Relaxed) != posted0;
        Pass {
            did: took || got > 0 || posted,
            pending: staging || !self.to_post.is_empty() || !self.active.is_empty() || !self.ctrl_out.is_empty() || !self.flushes.is_empty(),
        }
    }

    /// Rule 4: before this pass touches the provider or device memory, the context
    /// captured at VRAM registration is made current on this thread — every pass, since
    /// the thread may have started before any VRAM existed, and user code on a
    /// thread-off caller may have switched contexts since. Further contexts are applied
    /// where their memory is touched (staging copies).
    fn apply_contexts(&mut self) {
        let v = self.core.gpu.version();
        if v != self.ctx_version {
            self.ctxs = self.core.gpu.contexts();
            self.ctx_version = v;
        }
        if self.core.skip_ctx_apply {
            return;
        }
        if let Some(c) = self.ctxs.first() {
            match c.make_current() {
                Ok(_) => add(&self.core.counters.cuda_ctx_applies, 1),
                Err(e) => log::error!("{}: making the captured CUDA context current: {e}", self.core.name),
            }
        }
    }

    /// Our address of peer `peer_id`'s rail `rrail` on our rail `rail`.
    pub(super) fn conn_addr(&self, peer_id: u64, rail: usize, rrail: usize) -> Result<FiAddr> {
        self.conns
            .get(&peer_id)
            .and_then(|c| c.addrs.get(rail)?.get(rrail).copied().flatten())
            .ok_or_else(|| Error::Disconnected("peer was disconnected".into()))
    }

    /// Our rail-0 address of an engine that introduced itself (inserted on first use).
    pub(super) fn initiator_addr(&mut self, engine_id: u64) -> Option<FiAddr> {
        let ini = self.initiators.get_mut(&engine_id)?;
        if ini.addr.is_none() {
            let info = ini.info.as_ref()?;
            let ra = info.rails.first()?;
            if ra.provider != self.rails[0].caps.prov_name {
                return None;
            }
            match self.rails[0].av_insert(&ra.addr) {
                Ok(a) => ini.addr = Some(a),
                Err(e) => {
                    log::error!("{}: cannot reach agent '{}': {e}", self.core.name, ini.name);
                    return None;
                }
            }
        }
        ini.addr
    }

    /// False once an initiator on this host is known to have exited.
    pub(super) fn initiator_alive(&self, engine_id: u64) -> bool {
        self.initiators.get(&engine_id).is_some_and(|i| !i.pidfd.as_ref().is_some_and(|f| f.exited()))
    }

    /// Room for a control message's payload (the buffers' size less header and our name).
    pub(super) fn ctrl_payload_room(&self) -> usize {
        self.ctrl.size.saturating_sub(wire::CTRL_HEADER + self.core.name.len())
    }

    pub(super) fn initiator_id_by_addr(&self, addr: FiAddr) -> Option<u64> {
        self.initiators.iter().find(|(_, i)| i.addr == Some(addr)).map(|(id, _)| *id)
    }

    fn drain_submit(&mut self) -> bool {
        let work = self.core.take_submitted();
        let any = !work.is_empty();
        for s in work {
            match s {
                Submit::Post(req) => self.begin(req),
                Submit::Task(f) => f(self),
            }
        }
        any
    }

    fn begin(&mut self, req: Arc<Request>) {
        let mut st = req.state();
        if st.cancelled {
            self.complete(&req, &mut st, Err(Error::Canceled));
            return;
        }
        let Some(peer) = req.peer().cloned() else {
            self.copy_local(&req, &mut st);
            return;
        };
        if let Err(e) = self.ensure_conn(&peer) {
            self.complete(&req, &mut st, Err(e));
            return;
        }
        if !req.keeps.is_empty() {
            // A direct copy into a dead peer's memory would succeed: ask first.
            if !peer.local.alive() {
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
            if let Err(e) = super::direct::check_keeps(&req.keeps) {
                self.complete(&req, &mut st, Err(e));
                return;
            }
        }
        st.phase = Phase::Data;
        st.last_progress = Instant::now();
        self.kick(peer.id);
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

    /// Loopback: the remote side is our own memory, so the bytes are copied here, once.
    fn copy_local(&mut self, req: &Arc<Request>, st: &mut ReqState) {
        debug_assert!(matches!(req.target, Target::Local));
        for s in req.segs.iter() {
            let (src, dst) = match req.op {
                Op::Write => (s.local, s.raddr),
                Op::Read => (s.raddr, s.local),
            };
            if let SegKind::LocalDev { local, remote } = s.kind {
                let (sdev, ddev) = if req.op == Op::Write { (local, remote) } else { (remote, local) };
                // SAFETY: both ranges were bounds-checked against live registrations that
                // the request keeps alive.
                if let Err(e) = unsafe { super::gpu::copy(dst, ddev.as_ref(), src, sdev.as_ref(), s.len as usize) } {
                    self.complete(req, st, Err(e));
                    return;
                }
                continue;
            }
            // SAFETY: both ranges were bounds-checked against live registrations that the
            // request keeps alive; `copy` tolerates overlap.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, s.len as usize) };
        }
        let c = &self.core.counters;
        add(if req.op == Op::Write { &c.bytes_written } else { &c.bytes_read }, req.bytes);
        if let Some(msg) = st.notif.take() {
            self.core.push_notif(self.core.name.clone(), msg);
        }
        self.complete(req, st, Ok(()));
    }

    /// Inserts a peer's rail addresses into our AVs and introduces ourselves.
    pub fn ensure_conn(&mut self, peer: &Arc<Peer>) -> Result<()> {
        if peer.is_disconnected() {
            return Err(Error::Disconnected(format!("agent '{}' was disconnected", peer.name)));
        }
        if self.conns.contains_key(&peer.id) {
            return Ok(());
        }
        // Only the pairs the route uses, plus rail 0 <-> rail 0 for control messages: a
        // remote host's shm address must never reach our shm AV.
        let mut addrs: Vec<Vec<Option<FiAddr>>> = vec![vec![None; peer.info.rails.len()]; self.rails.len()];
        let wanted = peer.route.iter().map(|p| (p.rail as usize, p.rrail as usize)).chain(std::iter::once((0, 0)));
        for (l, r) in wanted {
            let (Some(rail), Some(ra)) = (self.rails.get(l), peer.info.rails.get(r)) else { continue };
            if addrs[l][r].is_none() && ra.provider == rail.caps.prov_name {
                addrs[l][r] = Some(rail.av_insert(&ra.addr)?);
            }
        }
        let Some(ctrl) = addrs[0][0] else {
            return Err(Error::NotSupported(format!(
                "agent '{}' uses provider {} on its first rail, we use {}",
                peer.name, peer.info.rails[0].provider, self.rails[0].caps.prov_name
            )));
        };
        log::info!("{}: connected to agent '{}' ({} local x {} remote rails)", self.core.name, peer.name, self.rails.len(), peer.info.rails.len());
        let sync_rails = if peer.cma {
            self.rails.iter().enumerate().filter(|(_, r)| r.caps.sync_rma).fold(0u64, |m, (i, _)| m | 1 << i)
        } else {
            0
        };
        self.conns.insert(peer.id, Conn { peer: peer.clone(), addrs: Arc::new(addrs), sync_rails, last_completion: Instant::now(), last_kick: None });
        let hello = wire::encode_ctrl(CtrlType::Hello, self.core.engine_id, &self.core.name, &self.core.conn_info);
        self.ctrl_out.push_back(CtrlOut { peer_id: peer.id, dest: ctrl, bytes: hello, req: None });
        Ok(())
    }

    /// Sends a Kick to a peer unless one went out within KICK_INTERVAL.
    fn kick(&mut self, peer_id: u64) {
        let now = Instant::now();
        let Some(c) = self.conns.get_mut(&peer_id) else { return };
        if c.last_kick.is_some_and(|t| now.duration_since(t) < KICK_INTERVAL) {
            return;
        }
        c.last_kick = Some(now);
        let Some(dest) = c.addrs[0][0] else { return };
        let bytes = wire::encode_ctrl(CtrlType::Kick, self.core.engine_id, &self.core.name, &[]);
        self.ctrl_out.push_back(CtrlOut { peer_id, dest, bytes, req: None });
    }

    /// Operations to `peer_id` that shm's fast RMA finished inside the post call: their
    /// completion is in the CQ already (read here first), or the copy failed and none will
    /// ever come. Without this, every failed one would hold an in-flight slot of the rail
    /// for good, and enough of them would stall the rail for every other peer.
    fn reclaim_inline_ops(&mut self, peer_id: u64) {
        for r in 0..self.rails.len() {
            if self.rails[r].caps.sync_rma {
                self.poll_rail(r);
            }
        }
        for kind in self.ops.take_where(|k| matches!(k, OpKind::Rma { req, inline: true, .. } if req.peer().is_some_and(|p| p.id == peer_id))) {
            if let OpKind::Rma { req, rail, .. } = kind {
                self.inflight[rail as usize] = self.inflight[rail as usize].saturating_sub(1);
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
        let dead: Vec<(u64, String)> = self
            .conns
            .iter()
            .filter(|(id, c)| (c.peer.cma || c.peer.local.watched()) && (all || busy.contains(id)))
            .filter(|(_, c)| !c.peer.local.alive() || c.peer.cma && !c.peer.info.process.as_ref().is_some_and(super::cma::reachable))
            .map(|(id, c)| (*id, c.peer.name.clone()))
            .collect();
        for (id, name) in dead {
            log::error!("{}: agent '{name}' on this host is gone (its process can no longer be read); disconnecting", self.core.name);
            if let Some(c) = self.conns.get(&id) {
                c.peer.mark_disconnected();
            }
            self.disconnect(id);
        }
    }

    pub fn disconnect(&mut self, peer_id: u64) {
        let engine_id = self.conns.get(&peer_id).map(|c| c.peer.info.engine_id);
        // Drain shm's completions while the peer is still in the AV: libfabric's shm unmaps
        // a peer's region in fi_av_remove, and a CQ read after that could still reach it
        // (the C harness crashed in pthread_spin_trylock under fi_cq_read at engine destroy
        // on 1.17, after a child peer had exited).
        self.reclaim_inline_ops(peer_id);
        if let Some(c) = self.conns.remove(&peer_id) {
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
        self.ctrl_out.retain(|m| m.peer_id != peer_id);
        if let Some(id) = engine_id {
            self.drain_direct(peer_id, id);
        }
        let active = std::mem::take(&mut self.active);
        for req in &active {
            if req.peer().is_some_and(|p| p.id == peer_id) {
                let mut st = req.state();
                if matches!(st.phase, Phase::Data | Phase::Notif) {
                    self.complete(req, &mut st, Err(Error::Disconnected("peer was disconnected".into())));
                }
            }
        }
        self.active = active;
    }

    /// Queues a control message to a peer (a notification, optionally completing `req`).
    pub fn send_ctrl(&mut self, peer: &Arc<Peer>, kind: CtrlType, payload: &[u8], req: Option<(Arc<Request>, u64)>) -> Result<()> {
        self.ensure_conn(peer)?;
        let dest = self.conns[&peer.id].addrs[0][0].ok_or_else(|| Error::Backend("no control address".into()))?;
        let bytes = wire::encode_ctrl(kind, self.core.engine_id, &self.core.name, payload);
        if bytes.len() > self.ctrl.size {
            return Err(Error::InvalidParam(format!("control message of {} bytes exceeds {}", bytes.len(), self.ctrl.size)));
        }
        self.ctrl_out.push_back(CtrlOut { peer_id: peer.id, dest, bytes, req });
        Ok(())
    }

    fn post_pending(&mut self) {
        // A queue that stays full toward one peer (a dead one keeps answering FI_EAGAIN)
        // must not hold up the others: a blocked request goes to the back, and each
        // request is looked at once per pass.
        let mut budget = self.to_post.len();
        while let Some(req) = self.to_post.front().cloned() {
            if budget == 0 {
                break;
            }
            budget -= 1;
            let peer_id = req.peer().map_or(0, |p| p.id);
            let mut st = req.state();
            if st.phase != Phase::Data {
                self.to_post.pop_front();
                continue;
            }
            let Some((addrs, sync_rails)) = self.conns.get(&peer_id).map(|c| (c.addrs.clone(), c.sync_rails)) else {
                self.to_post.pop_front();
                self.fail_data(&req, &mut st, Error::Disconnected("peer was disconnected".into()));
                continue;
            };
            if st.cancelled || st.error.is_some() {
                st.next = req.segs.len();
            }
            let mut blocked = false;
            let epoch = st.epoch;
            while st.next < req.segs.len() {
                let s = req.segs[st.next];
                let direct = match s.kind {
                    SegKind::Direct { ctx, .. } => Some(self.start_direct(&req, &mut st, ctx)),
                    SegKind::PeerCopy { alloc } => Some(self.start_peer_copy(&req, &mut st, alloc)),
                    SegKind::Cma { pid } => Some(self.start_cma(&req, &mut st, pid)),
                    _ => None,
                };
                if let Some(res) = direct {
                    if let Err(e) = res {
                        log::error!("{}: direct copy for agent '{}': {e}", self.core.name, req.peer().map_or("", |p| p.name.as_str()));
                        st.error.get_or_insert(e);
                        st.next = req.segs.len();
                    }
                    continue;
                }
                let rail = s.rail as usize;
                if self.inflight[rail] >= self.cap[rail] {
                    blocked = true;
                    break;
                }
                let Some(dest) = addrs[rail][s.rrail as usize] else {
                    st.error = Some(Error::NotSupported(format!("rail {rail} cannot reach remote rail {}", s.rrail)));
                    st.next = req.segs.len();
                    break;
                };
                if !matches!(s.kind, SegKind::Rma) {
                    let ctrl_dest = addrs[0][0].unwrap_or(dest);
                    match self.start_staged(&req, epoch, st.next, dest, ctrl_dest) {
                        Ok(Start::Started) => {
                            st.next += 1;
                            st.outstanding += 1;
                            st.inflight_total += 1;
                            add(&self.core.counters.ops_posted, 1);
                            continue;
                        }
                        Ok(Start::Blocked) => {
                            blocked = true;
                            break;
                        }
                        Err(e) => {
                            st.error.get_or_insert(e);
                            st.next = req.segs.len();
                            break;
                        }
                    }
                }
                let r = &self.rails[rail];
                // The following segments to the same remote rail ride in the same operation,
                // up to the provider's iov limits: one provider message instead of several
                // (over tcp one header and socket write per operation).
                let mut batch = [RmaSeg { local: s.local as *mut u8, len: s.len as usize, desc: s.desc as *mut _, raddr: s.raddr, rkey: s.rkey }; MAX_RMA_BATCH];
                let (mut n, mut bytes) = (1usize, s.len);
                let limit = r.caps.rma_batch.min(self.batch_max);
                while n < limit {
                    let Some(t) = req.segs.get(st.next + n) else { break };
                    if t.rail != s.rail || t.rrail != s.rrail || !matches!(t.kind, SegKind::Rma) || bytes + t.len > MAX_BATCH_BYTES {
                        break;
                    }
                    batch[n] = RmaSeg { local: t.local as *mut u8, len: t.len as usize, desc: t.desc as *mut _, raddr: t.raddr, rkey: t.rkey };
                    bytes += t.len;
                    n += 1;
                }
                let write = req.op == Op::Write;
                let dc = write && !self.flush_writes[rail] && sync_rails & (1 << rail) == 0;
                let inline = sync_rails & (1 << rail) != 0 && !dc;
                let ctx = self.ops.alloc(OpKind::Rma { req: req.clone(), epoch, rail: s.rail, len: bytes, inline });
                let more = st.next + n < req.segs.len();
                // A rail with its own thread posts there (over tcp a post is the socket write).
                let res = if r.posts_on_thread() && !inline {
                    self.core.note_rail_traffic();
                    // SAFETY: segments of a prepared request inside its registrations, which the
                    // request keeps alive until its ops drain; ctx is this op's fresh slot.
                    unsafe { r.queue_rma(write, &batch[..n], dest, ctx, dc) }
                } else {
                    // SAFETY: as above.
                    unsafe { r.rma_batch(write, &batch[..n], dest, ctx, more, dc) }
                };
                match res {
                    Ok(Posted::Ok) => {
                        st.next += n;
                        st.outstanding += 1;
                        st.inflight_total += 1;
                        self.inflight[rail] += 1;
                        if req.op == Op::Write && self.flush_writes[rail] {
                            st.unflushed |= 1 << rail;
                        }
                        add(&self.core.counters.ops_posted, 1);
                    }
                    Ok(Posted::Again) => {
                        self.ops.release(ctx);
                        add(&self.core.counters.retries, 1);
                        add(&self.core.rail_counters[rail].retries, 1);
                        blocked = true;
                        break;
                    }
                    Err(e) => {
                        self.ops.release(ctx);
                        log::error!("{}: {e} (agent '{}')", self.core.name, req.peer().map_or("", |p| p.name.as_str()));
                        add(&self.core.rail_counters[rail].errors, 1);
                        st.error.get_or_insert(e);
                        st.next = req.segs.len();
                    }
                }
            }
            if st.next >= req.segs.len() {
                self.to_post.pop_front();
                if st.outstanding == 0 {
                    self.data_done(&req, &mut st);
                }
            } else if blocked {
                drop(st);
                if let Some(r) = self.to_post.pop_front() {
                    self.to_post.push_back(r);
                }
            }
        }
    }

    fn fail_data(&mut self, req: &Arc<Request>, st: &mut ReqState, e: Error) {
        st.error.get_or_insert(e);
        st.next = req.segs.len();
        if st.outstanding == 0 {
            self.data_done(req, st);
        }
    }

    /// Every byte of the post is delivered (or it failed): send the notification, or finish.
    /// One outstanding piece (staging chunk, direct copy job) of the current post of `req`
    /// ended: counts its bytes or its failure (which stops the post's remaining segments),
    /// and ends the data phase when it was the last.
    pub(super) fn piece_done(&mut self, req: &Arc<Request>, st: &mut ReqState, bytes: u64, res: Result<()>) {
        st.outstanding -= 1;
        let c = &self.core.counters;
        match res {
            Ok(()) => {
                super::counters::add(if req.op == Op::Write { &c.bytes_written } else { &c.bytes_read }, bytes);
                super::counters::add(&c.ops_completed, 1);
            }
            Err(e) => {
                super::counters::add(&c.ops_failed, 1);
                st.error.get_or_insert(e);
                st.next = req.segs.len();
            }
        }
        if st.outstanding == 0 && st.next >= req.segs.len() {
            self.data_done(req, st);
        }
    }

    pub(super) fn data_done(&mut self, req: &Arc<Request>, st: &mut ReqState) {
        if st.phase != Phase::Data {
            return;
        }
        if st.error.is_none() && !st.cancelled && !st.flushing && st.unflushed != 0 {
            st.flushing = true;
            if self.queue_flushes(req, st) {
                return; // data_done runs again when the flush reads complete
            }
        }
        if let Some(e) = st.error.take() {
            self.complete(req, st, Err(e));
        } else if st.cancelled {
            self.complete(req, st, Err(Error::Canceled));
        } else if let Some(msg) = st.notif.take() {
            let Some(peer) = req.peer().cloned() else {
                self.complete(req, st, Ok(()));
                return;
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

    /// Done means delivered (rule 6): on rails that order a read after writes, one 1-byte
    /// read of the destination per rail the post wrote on; its completion shows every
    /// earlier write to that peer landed. The reads are queued (posted by `post_flushes`)
    /// and counted as outstanding now, so the post cannot finish before them. Returns
    /// whether any was queued.
    fn queue_flushes(&mut self, req: &Arc<Request>, st: &mut ReqState) -> bool {
        let mut queued = false;
        for rail in 0..self.rails.len() {
            if st.unflushed & (1 << rail) != 0 {
                st.outstanding += 1;
                self.flushes.push_back((req.clone(), st.epoch, rail));
                queued = true;
            }
        }
        st.unflushed = 0;
        queued
    }

    fn post_flushes(&mut self) {
        let mut budget = self.flushes.len();
        while let Some((req, epoch, rail)) = self.flushes.front().cloned() {
            if budget == 0 {
                break;
            }
            budget -= 1;
            let mut st = req.state();
            if st.epoch != epoch || st.phase != Phase::Data {
                self.flushes.pop_front();
                continue;
            }
            let target = req.peer().map(|p| p.id).zip(req.segs.iter().find(|s| s.rail as usize == rail && matches!(s.kind, SegKind::Rma)).copied());
            let res = match target {
                Some((peer_id, s)) => self.conn_addr(peer_id, rail, s.rrail as usize).and_then(|dest| {
                    let ctx = self.ops.alloc(OpKind::Rma { req: req.clone(), epoch, rail: rail as u16, len: 0, inline: false });
                    // SAFETY: the driver's registered flush buffer; ctx is this flush's fresh slot.
                    let r = unsafe { self.rails[rail].read(self.flush_buf.as_mut_ptr(), 1, self.flush_mrs[rail].desc, dest, s.raddr, s.rkey, ctx, false) };
                    if !matches!(r, Ok(Posted::Ok)) {
                        self.ops.release(ctx);
                    }
                    r
                }),
                None => Err(Error::Backend("flush read without a segment on its rail".into())),
            };
            match res {
                Ok(Posted::Ok) => {
                    self.flushes.pop_front();
                    st.inflight_total += 1;
                    self.inflight[rail] += 1;
                    add(&self.core.counters.ops_posted, 1);
                }
                Ok(Posted::Again) => {
                    // Try the others first (see post_pending).
                    add(&self.core.counters.retries, 1);
                    if let Some(f) = self.flushes.pop_front() {
                        self.flushes.push_back(f);
                    }
                }
                Err(e) => {
                    self.flushes.pop_front();
                    st.outstanding -= 1;
                    st.error.get_or_insert(e);
                    if st.outstanding == 0 {
                        self.data_done(&req, &mut st);
                    }
                }
            }
        }
    }

    fn complete(&mut self, req: &Arc<Request>, st: &mut ReqState, res: Result<()>) {
        st.phase = Phase::Done;
        let c = &self.core.counters;
        match res {
            Ok(()) => {
                add(&c.requests_completed, 1);
                req.set_status(Status::NF_SUCCESS);
            }
            Err(e) => {
                add(&c.requests_failed, 1);
                let s = e.status();
                if !matches!(e, Error::Canceled) {
                    log::error!("{}: transfer to agent '{}' failed: {e} -> {}", self.core.name, req.peer().map_or("", |p| p.name.as_str()), s.name());
                }
                req.set_status(s);
                self.unqueue_ops_of(req, st);
            }
        }
    }

    /// A failed or cancelled request's RMA still waiting in rail outboxes is never posted:
    /// once the request has ended its owner may release it and free the memory.
    fn unqueue_ops_of(&mut self, req: &Arc<Request>, st: &mut ReqState) {
        for r in 0..self.rails.len() {
            if !self.rails[r].has_queued() {
                continue;
            }
            let ops = &self.ops;
            let taken = self.rails[r].take_queued_with(|ctx| {
                matches!(ops.kind_of(ctx), Some(OpKind::Rma { req: q, .. }) if Arc::ptr_eq(q, req))
            });
            for ctx in taken {
                self.ops.release(ctx);
                self.inflight[r] = self.inflight[r].saturating_sub(1);
                st.inflight_total = st.inflight_total.saturating_sub(1);
                st.outstanding = st.outstanding.saturating_sub(1);
            }
        }
    }

    fn flush_ctrl(&mut self) {
        while let Some(m) = self.ctrl_out.front() {
            let Some(buf) = self.ctrl.send_free.pop() else { break };
            let ptr = self.ctrl.send_ptr(buf);
            let len = m.bytes.len();
            // SAFETY: the send buffer has ctrl.size >= len bytes (checked when queued).
            unsafe { std::ptr::copy_nonoverlapping(m.bytes.as_ptr(), ptr, len) };
            let dest = m.dest;
            let notif = m.bytes.get(wire::CTRL_TYPE_OFFSET) == Some(&(CtrlType::Notif as u8));
            let ctx = self.ops.alloc(OpKind::Send { buf, req: m.req.clone(), notif });
            let desc = CtrlBuffers::desc(&self.ctrl.send_mr);
            // SAFETY: a send slot of the registered control buffer, free until this send's
            // completion returns it; ctx is a fresh op slot.
            match unsafe { self.rails[0].send(ptr, len, desc, dest, ctx) } {
                Ok(Posted::Ok) => {
                    self.ctrl_out.pop_front();
                }
                Ok(Posted::Again) => {
                    self.ops.release(ctx);
                    self.ctrl.send_free.push(buf);
                    add(&self.core.counters.retries, 1);
                    break;
                }
                Err(e) => {
                    self.ops.release(ctx);
                    self.ctrl.send_free.push(buf);
                    let m = self.ctrl_out.pop_front().expect("front exists");
                    log::error!("{}: sending a control message failed: {e}", self.core.name);
                    if let Some((req, epoch)) = m.req {
                        let mut st = req.state();
                        if st.epoch == epoch && st.phase == Phase::Notif {
                            self.complete(&req, &mut st, Err(e));
                        }
                    }
                }
            }
        }
    }

    pub(super) fn poll_rail(&mut self, rail: usize) -> usize {
        let mut buf = [Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; POLL_BATCH];
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
                        if c.is_remote_write() {
                            continue;
                        }
                        self.on_completion(rail, c.ctx, c.len, None);
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
                        if self.rails[rail].caps.sync_rma {
                            self.probe_now = true;
                        }
                    } else {
                        self.on_completion(rail, ctx, 0, Some(err));
                    }
                }
            }
        }
        total
    }

    fn on_completion(&mut self, rail: usize, ctx: *mut std::ffi::c_void, len: usize, err: Option<Error>) {
        let Some(kind) = self.ops.release(ctx) else {
            log::warn!("{}: rail {rail}: completion for an unknown context", self.core.name);
            return;
        };
        match kind {
            OpKind::Free => {}
            OpKind::Rma { req, epoch, rail: r, len, .. } => {
                let r = r as usize;
                self.inflight[r] = self.inflight[r].saturating_sub(1);
                let mut st = req.state();
                st.inflight_total = st.inflight_total.saturating_sub(1);
                if let Some(conn) = req.peer().and_then(|p| self.conns.get_mut(&p.id)) {
                    conn.last_completion = Instant::now();
                }
                if epoch != st.epoch || st.phase != Phase::Data {
                    return;
                }
                st.outstanding -= 1;
                st.last_progress = Instant::now();
                match err {
                    None => {
                        let c = &self.core.counters;
                        add(if req.op == Op::Write { &c.bytes_written } else { &c.bytes_read }, len);
                        add(&c.ops_completed, 1);
                        add(&self.core.rail_counters[r].bytes, len);
                        add(&self.core.rail_counters[r].ops, 1);
                    }
                    Some(e) => {
                        add(&self.core.counters.ops_failed, 1);
                        let e = flushed_as_disconnect(e, st.cancelled);
                        st.error.get_or_insert(e);
                        st.next = req.segs.len();
                    }
                }
                if st.outstanding == 0 && st.next >= req.segs.len() {
                    self.data_done(&req, &mut st);
                }
            }
            OpKind::Send { buf, req, notif } => {
                self.ctrl.send_free.push(buf);
                if err.is_none() && notif {
                    add(&self.core.counters.notifs_sent, 1);
                }
                if let Some((req, epoch)) = req {
                    let mut st = req.state();
                    if st.epoch == epoch && st.phase == Phase::Notif {
                        let res = match err {
                            None => Ok(()),
                            Some(e) => Err(flushed_as_disconnect(e, st.cancelled)),
                        };
                        self.complete(&req, &mut st, res);
                    }
                } else if let Some(e) = err {
                    log::error!("{}: control message failed: {e}", self.core.name);
                }
            }
            OpKind::StageRma { token, serve } => self.on_stage_rma(token, serve, err),
            OpKind::Recv { buf } => {
                match err {
                    None => self.on_ctrl(buf, len),
                    Some(Error::Completion { errno, .. }) if errno == libc::ECANCELED => return,
                    Some(e) => log::warn!("{}: control receive failed: {e}", self.core.name),
                }
                if let Err(e) = self.post_recv(buf) {
                    log::error!("{}: cannot re-post a control receive: {e}", self.core.name);
                }
            }
        }
    }

    fn on_ctrl(&mut self, buf: u32, len: usize) {
        let len = len.min(self.ctrl.size);
        let ptr = self.ctrl.recv_ptr(buf);
        // SAFETY: the provider wrote `len` bytes into this receive buffer.
        let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
        let msg = match wire::decode_ctrl(bytes) {
            Ok(m) => m,
            Err(e) => {
                log::warn!("{}: dropping a control message: {e}", self.core.name);
                return;
            }
        };
        match msg.kind {
            CtrlType::Hello => {
                if !self.initiators.contains_key(&msg.sender_id) {
                    log::info!("{}: agent '{}' introduced itself (engine {:016x})", self.core.name, msg.sender, msg.sender_id);
                    let info = match wire::ConnInfo::decode(msg.payload) {
                        Ok(i) if i.engine_id == msg.sender_id => Some(i),
                        Ok(_) => None,
                        Err(e) => {
                            log::warn!("{}: HELLO from '{}' carries bad connection info: {e}", self.core.name, msg.sender);
                            None
                        }
                    };
                    let our_host = self.our_host_id();
                    let pidfd = info.as_ref()
                        .filter(|i| Some(i.host_id) == our_host && i.host_id != [0; 16])
                        .and_then(|i| i.process.as_ref())
                        .filter(|p| p.pid != std::process::id())
                        .and_then(|p| super::local_peers::PidFd::open(p.pid));
                    self.initiators.insert(msg.sender_id, Initiator { name: msg.sender.to_string(), info, addr: None, pidfd });
                }
            }
            CtrlType::Stage => match wire::Stage::decode(msg.payload) {
                Ok(st) => self.on_stage_request(msg.sender_id, st),
                Err(e) => log::warn!("{}: dropping a stage request from '{}': {e}", self.core.name, msg.sender),
            },
            CtrlType::StageAck => match wire::StageAck::decode(msg.payload) {
                Ok(a) => self.on_stage_ack(a),
                Err(e) => log::warn!("{}: dropping a stage answer from '{}': {e}", self.core.name, msg.sender),
            },
            // Its receive completion already made this pass busy; a peer whose data comes
            // over the network rails also needs their threads driving them here.
            CtrlType::Kick => {
                if self.data_over_network_rails(msg.sender_id) {
                    self.core.note_rail_traffic();
                }
            }
            CtrlType::Copy => match wire::CopyReq::decode(msg.payload) {
                Ok(c) => {
                    let sender = msg.sender.to_string();
                    self.on_copy_request(msg.sender_id, &sender, c)
                }
                Err(e) => log::warn!("{}: dropping a copy request from '{}': {e}", self.core.name, msg.sender),
            },
            CtrlType::CopyAck => match wire::StageAck::decode(msg.payload) {
                Ok(a) => {
                    let sender = msg.sender.to_string();
                    self.on_copy_ack(msg.sender_id, &sender, a)
                }
                Err(e) => log::warn!("{}: dropping a copy answer from '{}': {e}", self.core.name, msg.sender),
            },
            CtrlType::Notif => {
                add(&self.core.counters.notifs_received, 1);
                self.core.push_notif(msg.sender.to_string(), msg.payload.to_vec());
            }
        }
    }

    /// Whether an initiator's RMA reaches us over the network rails: not when it is on this
    /// host and same-host peers go around them (shm rail, CMA, IPC). Unknown: assume so.
    fn data_over_network_rails(&self, initiator: u64) -> bool {
        let Some(info) = self.initiators.get(&initiator).and_then(|i| i.info.as_ref()) else { return true };
        !(self.core.cfg.same_host_shm && info.host_id != [0; 16] && Some(info.host_id) == self.our_host_id())
    }

    /// This host's id, as our connection info gives it to peers.
    fn our_host_id(&self) -> Option<[u8; 16]> {
        wire::ConnInfo::decode(&self.core.conn_info).map(|c| c.host_id).ok()
    }

    /// Deadlines (rule 2): a post whose peer completed nothing for `timeout_ms` fails with
    /// REMOTE_DISCONNECT; finished requests leave the active list.
    fn sweep(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < Duration::from_millis(5) {
            return;
        }
        self.last_sweep = now;
        let all = std::mem::take(&mut self.probe_now);
        self.probe_same_host(all);
        self.forget_exited_initiators();
        let timeout = self.core.cfg.timeout();
        let active = std::mem::take(&mut self.active);
        let mut keep = Vec::with_capacity(active.len());
        // Peers with work in flight get a kick (rate-limited), so a long request keeps
        // the target polling to its end.
        let mut kick: Vec<u64> = active.iter().filter_map(|r| r.peer().map(|p| p.id)).collect();
        kick.sort_unstable();
        kick.dedup();
        for id in kick {
            self.kick(id);
        }
        // A long operation on a threaded rail may go 20 ms without a completion.
        if (0..self.rails.len()).any(|r| self.inflight[r] > 0 && self.rails[r].posts_on_thread()) {
            self.core.note_rail_traffic();
        }
        for req in active {
            let mut st = req.state();
            if !matches!(st.phase, Phase::Data | Phase::Notif) {
                continue;
            }
            let peer_alive = req.peer().and_then(|p| self.conns.get(&p.id)).map(|c| c.last_completion);
            let last = peer_alive.map_or(st.last_progress, |t| t.max(st.last_progress));
            // Host copies on the copy threads are system calls that always end (a dead peer
            // fails them): a long one is progress, not a silent peer.
            if now.duration_since(last) > timeout && st.local_copies == 0 {
                let who = req.peer().map_or(String::new(), |p| p.name.clone());
                self.complete(&req, &mut st, Err(Error::Timeout(format!(
                    "agent '{who}' completed nothing for {} ms", timeout.as_millis()
                ))));
                continue;
            }
            drop(st);
            keep.push(req);
        }
        self.active = keep;
    }

    /// Requests, control messages, flush reads or staging chunks are still queued or in flight.
    pub fn has_pending(&self) -> bool {
        !self.to_post.is_empty() || !self.active.is_empty() || !self.ctrl_out.is_empty() || !self.flushes.is_empty() || !self.staging.idle() || !self.direct.idle() || !self.cma.idle()
    }

    /// Whether the thread may sleep now, and on which CQ fds.
    pub fn idle_fds(&self) -> Idle {
        let mut fds = Vec::with_capacity(self.rails.len());
        for r in &self.rails {
            if !r.has_wait_fd() {
                // shm in fast-RMA mode (no fd) needs us only to recycle its command slots,
                // which the timed naps do; the other rails' fds still wake us for messages.
                if r.caps.sync_rma {
                    continue;
                }
                return Idle::NoFds;
            }
            match r.wait_fd_if_idle() {
                Some(fd) => fds.push(fd),
                None => return Idle::Busy,
            }
        }
        Idle::Fds(fds)
    }

    /// Fails everything still queued or in flight and forgets every peer's addresses
    /// (engine teardown: closing an endpoint with peers still in its AV has crashed shm).
    pub fn cancel_all(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.disconnect(id);
        }
        let active = std::mem::take(&mut self.active);
        for req in &active {
            let mut st = req.state();
            if matches!(st.phase, Phase::Data | Phase::Notif) {
                self.complete(req, &mut st, Err(Error::Canceled));
            }
        }
        self.to_post.clear();
        self.flushes.clear();
        self.ctrl_out.clear();
        for (_, s) in self.core.take_submitted().into_iter().enumerate() {
            if let Submit::Post(req) = s {
                let mut st = req.state();
                self.complete(&req, &mut st, Err(Error::Canceled));
            }
        }
        // Host copies still running write into memory the owners free once the engine is
        // gone: wait for them (system calls that always end) and account them.
        while !self.cma.idle() {
            self.advance_cma();
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
}
