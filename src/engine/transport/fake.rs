//! A rail that is no provider, for unit tests of the transports and the driver's loop: it
//! answers posts from a script (FI_EAGAIN storms, failed posts), moves the bytes of
//! accepted RMA itself (remote addresses are addresses of this process), and hands out
//! completions late, out of order, or as errors, as the test asks. `Bench` is what a
//! transport needs around it (core, ops pool, peers, rail slots, outcomes).
use super::{Cx, Outcome, Piece, RailSlots, Transport};
use crate::config::Config;
use crate::engine::conns::{Conn, Conns};
use crate::engine::core::Core;
use crate::engine::local_peers::{Locality, ProcessView};
use crate::engine::ops::{OpKind, OpPool};
use crate::engine::peer::{Peer, RoutePair};
use crate::engine::port::{Mr, Port};
use crate::engine::registry::SharedCloseQueue;
use crate::engine::wire::{ConnInfo, RailAddr};
use crate::error::{Error, Result};
use crate::fabric::{Completion, CqError, DmaBufRange, FiAddr, Hmem, Posted, RailCaps, RmaSeg};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How the fake answers one post.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    Accept,
    Again,
    Fail,
}

/// An RMA the fake accepted: direction, (local, len, remote, key) per segment, destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Accepted {
    pub write: bool,
    pub segs: Vec<(u64, usize, u64, u64)>,
    pub dest: FiAddr,
}

#[derive(Default)]
struct State {
    /// Answers for the next posts, in order; Accept once it runs out.
    script: VecDeque<Answer>,
    /// After every Again of the script, this many more (an EAGAIN storm).
    refused: usize,
    /// Every post is refused (a queue that never drains).
    refuse_all: bool,
    accepted: Vec<Accepted>,
    /// Completions the next accepted posts get as errors.
    fail_completions: usize,
    ready: VecDeque<std::result::Result<Completion, CqError>>,
    /// Hand completions out newest first.
    reverse: bool,
    /// Polls that return nothing before completions are handed out (late completions).
    hold: usize,
    held_polls: usize,
    /// Reads of the completion queue so far.
    polls: usize,
    /// Posts tried so far (sends and RMA), refused ones included.
    tries: usize,
    recvs: VecDeque<(*mut u8, usize, *mut c_void)>,
    sends: Vec<Vec<u8>>,
    /// Every accepted post in order: W write, R read, N notification send, C other send.
    order: String,
    next_addr: FiAddr,
    /// Device registrations refused, by kind ("dmabuf", "hmem"), as a provider would.
    refuse_reg: Vec<&'static str>,
    /// The rail has a thread that posts its RMA (`posts_on_thread`), and that thread never
    /// gets to them: queued RMA waits in `outbox` until the driver takes it back.
    outbox: Option<Vec<*mut c_void>>,
    /// Device registrations made: kind, range, and the CUDA context that owns the memory
    /// (None where no driver says), which a post touching the range needs current.
    regions: Vec<(&'static str, u64, u64, Option<usize>)>,
}

pub struct FakePort {
    index: usize,
    caps: RailCaps,
    st: Mutex<State>,
}

// SAFETY: the raw pointers in the state are test buffers and op slots that the tests keep
// alive; every access goes through the mutex.
unsafe impl Send for FakePort {}
unsafe impl Sync for FakePort {}

pub fn caps(order_raw: bool) -> RailCaps {
    caps_ordered(order_raw, false)
}

/// `caps`, with sends ordered after writes (FI_ORDER_SAW) where `order_saw`.
pub fn caps_ordered(order_raw: bool, order_saw: bool) -> RailCaps {
    RailCaps {
        prov_name: "fake".into(),
        domain_name: "fake0".into(),
        mr_local: false,
        virt_addr: true,
        prov_key: false,
        keep_av_entries: false,
        mr_key_size: 8,
        inject_size: 64,
        max_msg_size: 1 << 30,
        tx_size: 256,
        rx_size: 256,
        delivery_complete: !order_raw,
        order_raw,
        order_saw,
        msg_order: (0, 0),
        sync_rma: false,
        rma_batch: 4,
        cq_data_size: 0,
        needs_context: true,
        hmem: false,
        dmabuf: false,
        hmem_host_bounce: false,
        threading: 0,
    }
}

impl FakePort {
    pub fn with_caps(index: usize, caps: RailCaps) -> Arc<FakePort> {
        Arc::new(FakePort { index, caps, st: Mutex::new(State { next_addr: 100, ..State::default() }) })
    }

    /// Every accepted post so far, in order: W write, R read, N notification, C other send.
    pub fn order(&self) -> String {
        self.st().order.clone()
    }

    /// Device registrations of `kind` ("dmabuf", "hmem"; "device-only": FI_HMEM ones that
    /// carry FI_HMEM_DEVICE_ONLY) are refused from now on.
    pub fn refuse_registration(&self, kind: &'static str) {
        self.st().refuse_reg.push(kind);
    }

    /// Device registrations made so far: (kind, address, length).
    pub fn device_registrations(&self) -> Vec<(&'static str, u64, u64)> {
        self.st().regions.iter().map(|r| (r.0, r.1, r.2)).collect()
    }

    /// A device registration of `kind`, as a CUDA-enabled provider makes it: refused when
    /// the test says so, else remembered with the context owning the memory.
    fn register_device(&self, kind: &'static str, addr: u64, len: u64, key: u64) -> Result<Mr> {
        let mut s = self.st();
        if s.refuse_reg.contains(&kind) {
            return Err(Error::Fabric { op: "fi_mr_regattr", rail: Some(self.index), code: -libc::ENOSYS, detail: format!("injected: no {kind} registration") });
        }
        let owner = crate::cuda::pointer_info(addr).ok().and_then(|i| match i.context {
            Some(c) => Some(c.id()),
            None => i.device_ordinal.and_then(|o| crate::cuda::Context::primary(o).ok()).map(|p| p.context().id()),
        });
        s.regions.push((kind, addr, len, owner));
        Ok(Mr::detached(key, std::ptr::null_mut()))
    }

    /// A CUDA-enabled provider copies device memory with the CUDA context current on the
    /// calling thread (libfabric's shm does, in the post and in progress): a post touching a
    /// device registration without its owner's context current fails, as such a copy would.
    fn check_context(s: &State, index: usize, segs: &[RmaSeg]) -> Result<()> {
        for g in segs {
            let at = g.local as u64;
            let Some(r) = s.regions.iter().find(|r| at >= r.1 && at < r.1 + r.2) else { continue };
            let Some(owner) = r.3 else { continue };
            let current = crate::cuda::Context::current().ok().flatten().map(|c| c.id());
            if current != Some(owner) {
                return Err(Error::Fabric { op: "fi_writemsg", rail: Some(index), code: -libc::EFAULT,
                    detail: format!("{} device memory at {at:#x} touched without its CUDA context current", r.0) });
            }
        }
        Ok(())
    }

    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next posts are answered by `answers`, in order.
    pub fn script(&self, answers: &[Answer]) {
        self.st().script.extend(answers.iter().copied());
    }

    /// Every post is refused from now on (`true`), or answered by the script again.
    pub fn refuse_all(&self, on: bool) {
        self.st().refuse_all = on;
    }

    /// Queued RMA (a rail thread's outbox) stays queued from now on, unposted.
    pub fn hold_outbox(&self) {
        self.st().outbox = Some(Vec::new());
    }

    /// RMA waiting in the outbox.
    pub fn outbox_len(&self) -> usize {
        self.st().outbox.as_ref().map_or(0, |o| o.len())
    }

    /// Every scripted Again is followed by `n` more.
    pub fn storm(&self, n: usize) {
        self.st().refused = n;
    }

    pub fn fail_completions(&self, n: usize) {
        self.st().fail_completions = n;
    }

    /// Completions come newest first, after `hold` empty polls.
    pub fn disorder(&self, reverse: bool, hold: usize) {
        let mut s = self.st();
        s.reverse = reverse;
        s.hold = hold;
    }

    pub fn accepted(&self) -> Vec<Accepted> {
        self.st().accepted.clone()
    }

    /// Posts tried so far, refused ones included.
    pub fn tries(&self) -> usize {
        self.st().tries
    }

    /// How often the completion queue was read.
    pub fn polls(&self) -> usize {
        self.st().polls
    }

    pub fn sends(&self) -> Vec<Vec<u8>> {
        self.st().sends.clone()
    }

    pub fn pending_completions(&self) -> usize {
        self.st().ready.len()
    }

    /// Delivers `bytes` into the oldest posted receive, as a peer's message would arrive.
    pub fn deliver(&self, bytes: &[u8]) -> bool {
        let mut s = self.st();
        let Some((buf, len, ctx)) = s.recvs.pop_front() else { return false };
        let n = bytes.len().min(len);
        // SAFETY: the receive buffer was posted with room for `len` bytes and is still the
        // channel's (its receive is outstanding).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, n) };
        s.ready.push_back(Ok(Completion { ctx, flags: 0, len: n }));
        true
    }

    /// The answer to the next post.
    fn answer(s: &mut State) -> Answer {
        s.tries += 1;
        if s.refuse_all {
            return Answer::Again;
        }
        let a = s.script.pop_front().unwrap_or(Answer::Accept);
        if a == Answer::Again {
            for _ in 0..std::mem::take(&mut s.refused) {
                s.script.push_front(Answer::Again);
            }
        }
        a
    }

    fn complete(s: &mut State, ctx: *mut c_void, len: usize) {
        if s.fail_completions > 0 {
            s.fail_completions -= 1;
            s.ready.push_back(Err(CqError { ctx, errno: libc::EIO, detail: "injected error completion".into() }));
        } else {
            s.ready.push_back(Ok(Completion { ctx, flags: 0, len }));
        }
    }
}

impl Port for FakePort {
    fn index(&self) -> usize {
        self.index
    }
    fn caps(&self) -> &RailCaps {
        &self.caps
    }
    unsafe fn register(&self, addr: *const u8, len: usize, key: u64, hmem: Option<Hmem>) -> Result<Mr> {
        match hmem {
            Some(h) if h.device_only && self.st().refuse_reg.contains(&"device-only") => {
                Err(Error::Fabric { op: "fi_mr_regattr", rail: Some(self.index), code: -libc::EINVAL, detail: "injected: FI_HMEM_DEVICE_ONLY unknown".into() })
            }
            Some(_) => self.register_device("hmem", addr as u64, len as u64, key),
            None => Ok(Mr::detached(key, std::ptr::null_mut())),
        }
    }
    unsafe fn register_dmabuf(&self, buf: &DmaBufRange<'_>, key: u64, _hmem: (u32, i32)) -> Result<Mr> {
        self.register_device("dmabuf", buf.base + buf.offset, buf.len as u64, key)
    }
    fn av_insert(&self, _addr: &[u8]) -> Result<FiAddr> {
        let mut s = self.st();
        s.next_addr += 1;
        Ok(s.next_addr)
    }
    fn av_remove(&self, _a: FiAddr) {}
    unsafe fn rma(&self, write: bool, segs: &[RmaSeg], dest: FiAddr, ctx: *mut c_void, _more: bool, _dc: bool) -> Result<Posted> {
        let mut s = self.st();
        match Self::answer(&mut s) {
            Answer::Again => return Ok(Posted::Again),
            Answer::Fail => return Err(Error::Fabric { op: "fi_writemsg", rail: Some(self.index), code: -libc::EIO, detail: "injected post failure".into() }),
            Answer::Accept => {}
        }
        Self::check_context(&s, self.index, segs)?;
        let mut len = 0;
        for g in segs {
            let (src, dst) = if write { (g.local as *const u8, g.raddr as *mut u8) } else { (g.raddr as *const u8, g.local) };
            // SAFETY: tests name buffers of this process on both sides, alive until the
            // completion (Port::rma's contract).
            unsafe { std::ptr::copy(src, dst, g.len) };
            len += g.len;
        }
        s.accepted.push(Accepted { write, segs: segs.iter().map(|g| (g.local as u64, g.len, g.raddr, g.rkey)).collect(), dest });
        s.order.push(if write { 'W' } else { 'R' });
        Self::complete(&mut s, ctx, len);
        Ok(Posted::Ok)
    }
    unsafe fn queue_rma(&self, write: bool, segs: &[RmaSeg], dest: FiAddr, ctx: *mut c_void, dc: bool) -> Result<Posted> {
        if let Some(o) = self.st().outbox.as_mut() {
            o.push(ctx);
            return Ok(Posted::Ok);
        }
        // SAFETY: forwarded.
        unsafe { self.rma(write, segs, dest, ctx, false, dc) }
    }
    fn posts_on_thread(&self) -> bool {
        self.st().outbox.is_some()
    }
    unsafe fn send(&self, buf: *const u8, len: usize, _desc: *mut c_void, _dest: FiAddr, ctx: *mut c_void) -> Result<Posted> {
        let mut s = self.st();
        match Self::answer(&mut s) {
            Answer::Again => return Ok(Posted::Again),
            Answer::Fail => return Err(Error::Fabric { op: "fi_send", rail: Some(self.index), code: -libc::EIO, detail: "injected post failure".into() }),
            Answer::Accept => {}
        }
        // SAFETY: the caller's buffer holds `len` bytes (Port::send's contract).
        let bytes = unsafe { std::slice::from_raw_parts(buf, len) }.to_vec();
        let notif = crate::engine::wire::decode_ctrl(&bytes).is_ok_and(|c| c.kind == crate::engine::wire::CtrlType::Notif);
        s.order.push(if notif { 'N' } else { 'C' });
        s.sends.push(bytes);
        s.ready.push_back(Ok(Completion { ctx, flags: 0, len }));
        Ok(Posted::Ok)
    }
    unsafe fn recv(&self, buf: *mut u8, len: usize, _desc: *mut c_void, ctx: *mut c_void) -> Result<Posted> {
        self.st().recvs.push_back((buf, len, ctx));
        Ok(Posted::Ok)
    }
    fn poll(&self, out: &mut [Completion]) -> std::result::Result<usize, CqError> {
        let mut s = self.st();
        s.polls += 1;
        if s.ready.is_empty() {
            return Ok(0);
        }
        if s.held_polls < s.hold {
            s.held_polls += 1;
            return Ok(0);
        }
        s.held_polls = 0;
        let mut n = 0;
        while n < out.len() {
            let next = if s.reverse { s.ready.pop_back() } else { s.ready.pop_front() };
            match next {
                Some(Ok(c)) => {
                    out[n] = c;
                    n += 1;
                }
                Some(Err(e)) if n == 0 => return Err(e),
                Some(Err(e)) => {
                    if s.reverse { s.ready.push_back(Err(e)) } else { s.ready.push_front(Err(e)) }
                    break;
                }
                None => break,
            }
        }
        Ok(n)
    }
    fn has_queued(&self) -> bool {
        self.st().outbox.as_ref().is_some_and(|o| !o.is_empty())
    }
    fn take_queued_for(&self, _dest: FiAddr) -> Vec<*mut c_void> {
        self.st().outbox.as_mut().map(std::mem::take).unwrap_or_default()
    }
    fn take_queued_with(&self, pick: &dyn Fn(*mut c_void) -> bool) -> Vec<*mut c_void> {
        let mut s = self.st();
        let Some(o) = s.outbox.as_mut() else { return Vec::new() };
        let (taken, kept): (Vec<_>, Vec<_>) = o.drain(..).partition(|&c| pick(c));
        *o = kept;
        taken
    }
    fn wait_fd_if_idle(&self) -> Option<i32> {
        None
    }
    fn has_wait_fd(&self) -> bool {
        false
    }
}

/// What a transport works with, around fake rails.
pub struct Bench {
    pub core: Arc<Core>,
    pub fakes: Vec<Arc<FakePort>>,
    pub rails: Vec<Arc<dyn Port>>,
    pub ops: OpPool,
    pub conns: Conns,
    pub slots: RailSlots,
    pub out: Vec<Outcome>,
    _view: Arc<ProcessView>,
}

impl Bench {
    pub fn new(rails: usize, order_raw: bool) -> Bench {
        Self::with_config(rails, order_raw, Config::defaults())
    }

    pub fn with_config(rails: usize, order_raw: bool, cfg: Config) -> Bench {
        Self::with_caps(rails, caps(order_raw), cfg)
    }

    /// Rails that order reads and sends after writes (FI_ORDER_RAW and FI_ORDER_SAW), as
    /// tcp and sockets do.
    pub fn ordered(rails: usize) -> Bench {
        Self::with_caps(rails, caps_ordered(true, true), Config::defaults())
    }

    /// Rails that all grant `caps` (e.g. FI_HMEM, for device registrations).
    pub fn with_caps(rails: usize, caps: RailCaps, cfg: Config) -> Bench {
        let fakes: Vec<Arc<FakePort>> = (0..rails).map(|i| FakePort::with_caps(i, caps.clone())).collect();
        let ports = fakes.iter().map(|f| f.clone() as Arc<dyn Port>).collect();
        let id = crate::engine::ids::random_u64();
        let view = ProcessView::publish(id, [0; 16]);
        let closeq = SharedCloseQueue::default();
        let core = Arc::new(Core::new("bench", id, [7; 16], cfg, Vec::new(), rails, closeq, view.clone()));
        Bench {
            core,
            fakes,
            rails: ports,
            ops: OpPool::with_capacity(64),
            conns: Conns::default(),
            slots: RailSlots { inflight: vec![0; rails], cap: vec![64; rails] },
            out: Vec::new(),
            _view: view,
        }
    }

    pub fn cx(&mut self) -> Cx<'_> {
        Cx { core: &self.core, rails: &self.rails, ops: &mut self.ops, conns: &mut self.conns, slots: &mut self.slots, out: &mut self.out, ctrl_room: 4096, now: std::time::Instant::now() }
    }

    /// A remote peer reached over every rail pair (rail i <-> its rail i), whose rail 0
    /// orders sends after writes as ours does.
    pub fn peer(&mut self, id: u64, locality: Locality) -> Arc<Peer> {
        let saw = self.fakes.first().is_some_and(|f| f.caps.order_saw);
        self.peer_with(id, locality, saw)
    }

    /// `peer`, saying in its connection info whether its rail 0 orders sends after writes.
    pub fn peer_with(&mut self, id: u64, locality: Locality, rail0_saw: bool) -> Arc<Peer> {
        self.peer_of(id, locality, rail0_saw, None)
    }

    /// `peer`, engine `engine_id` (its control messages' sender), whose connection info
    /// says it lends packed slots for staged READs.
    pub fn peer_lending(&mut self, id: u64, locality: Locality, engine_id: u64) -> Arc<Peer> {
        self.peer_of(id, locality, false, Some(engine_id))
    }

    /// (`lender`: the engine id of a peer that lends slots.)
    fn peer_of(&mut self, id: u64, locality: Locality, rail0_saw: bool, lender: Option<u64>) -> Arc<Peer> {
        let n = self.rails.len();
        let lends = lender.is_some();
        let info = ConnInfo { engine_id: lender.unwrap_or(1000 + id), host_id: [9; 16], agent: format!("peer{id}"), rails: (0..n).map(|_| RailAddr { provider: "fake".into(), addr: vec![1] }).collect(), process: None, rail0_saw, packed_staging: true, eager_write: false, lends };
        let route = (0..n).map(|i| RoutePair { rail: i as u16, rrail: i as u16, virt: None }).collect();
        let peer = Arc::new(Peer::new(id, &format!("peer{id}"), info, Vec::new(), route, false, false, locality));
        let addrs = (0..n).map(|l| (0..n).map(|r| Some((10 * l + r) as FiAddr + 1)).collect()).collect();
        self.conns.peers.insert(id, Conn { peer: peer.clone(), addrs, sync_rails: 0, last_completion: Instant::now(), last_kick: None });
        peer
    }

    /// A peer with `remote` rails of its own against our rails, paired as the engine pairs
    /// them (max(ours, theirs) pairs, each side cycling over its rails).
    pub fn peer_over(&mut self, id: u64, locality: Locality, remote: usize) -> Arc<Peer> {
        let n = self.rails.len();
        let info = ConnInfo { engine_id: 1000 + id, host_id: [9; 16], agent: format!("peer{id}"), rails: (0..remote).map(|_| RailAddr { provider: "fake".into(), addr: vec![1] }).collect(), process: None, rail0_saw: false, packed_staging: true, eager_write: false, lends: false };
        let route = (0..n.max(remote)).map(|j| RoutePair { rail: (j % n) as u16, rrail: (j % remote) as u16, virt: None }).collect();
        let peer = Arc::new(Peer::new(id, &format!("peer{id}"), info, Vec::new(), route, false, false, locality));
        let addrs = (0..n).map(|l| (0..remote).map(|r| Some((10 * l + r) as FiAddr + 1)).collect()).collect();
        self.conns.peers.insert(id, Conn { peer: peer.clone(), addrs, sync_rails: 0, last_completion: Instant::now(), last_kick: None });
        peer
    }

    /// Reads every rail's completions (as the driver would) and hands them to `t`.
    pub fn complete(&mut self, t: &mut dyn Transport) -> usize {
        let mut n = 0;
        let mut buf = [Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; 16];
        for r in 0..self.fakes.len() {
            loop {
                let (ctx, len, err) = match self.fakes[r].poll(&mut buf) {
                    Ok(0) => break,
                    Ok(k) => {
                        for c in &buf[..k] {
                            n += 1;
                            self.deliver(t, c.ctx, c.len, None);
                        }
                        continue;
                    }
                    Err(e) => (e.ctx, 0, Some(Error::Completion { op: "completion", rail: r, errno: e.errno, detail: e.detail })),
                };
                n += 1;
                self.deliver(t, ctx, len, err);
            }
        }
        n
    }

    fn deliver(&mut self, t: &mut dyn Transport, ctx: *mut c_void, len: usize, err: Option<Error>) {
        match self.ops.release(ctx) {
            Some(OpKind::Transport(op)) => t.on_completion(&mut self.cx(), op, len, err),
            Some(_) => {}
            None => panic!("completion for a context that is not a live operation"),
        }
    }

    /// The pieces reported so far (other outcomes are kept).
    pub fn pieces(&mut self) -> Vec<Piece> {
        let mut pieces = Vec::new();
        for o in std::mem::take(&mut self.out) {
            match o {
                Outcome::Piece(p) => pieces.push(p),
                o => self.out.push(o),
            }
        }
        pieces
    }
}

/// How a post went when driven to its end the way the driver's loop drives it.
pub struct Run {
    pub pieces: Vec<Piece>,
    /// Starts that stopped on back-pressure.
    pub blocked: usize,
    pub failed: Option<Error>,
    pub marks: crate::engine::request::Marks,
}

impl Bench {
    /// Starts `req`'s segments with `t` from the first, again after every stop on
    /// back-pressure, feeding completions and advancing in between, until every segment is
    /// started and every piece ended (or `passes` run out).
    pub fn run(&mut self, t: &mut dyn Transport, req: &Arc<crate::engine::request::Request>, passes: usize) -> Run {
        let mut run = Run { pieces: Vec::new(), blocked: 0, failed: None, marks: Default::default() };
        let (mut next, mut started) = (0, 0);
        for _ in 0..passes {
            if next < req.segs.len() && run.failed.is_none() {
                let s = t.start(&mut self.cx(), super::Post { req, epoch: 1, at: next, notif: &mut None, marks: &mut run.marks });
                next += s.segs;
                started += s.pieces;
                match s.stop {
                    Some(super::Stop::Blocked) => run.blocked += 1,
                    Some(super::Stop::Failed(e)) => run.failed = Some(e),
                    None => {}
                }
            }
            self.complete(t);
            t.advance(&mut self.cx());
            run.pieces.extend(self.pieces());
            if (next >= req.segs.len() || run.failed.is_some()) && run.pieces.len() >= started {
                break;
            }
            // Device copies and copy threads take real time.
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        run
    }
}

/// A request of `op` to `peer` whose segments are `segs` (no registrations behind them:
/// the tests own the buffers).
pub fn request(op: crate::engine::request::Op, peer: &Arc<Peer>, segs: Vec<crate::engine::request::Seg>) -> Arc<crate::engine::request::Request> {
    let target = crate::engine::request::Target::Peer(peer.clone());
    Arc::new(crate::engine::request::Request::new(op, target, segs, Vec::new(), Vec::new(), Vec::new()))
}

/// Runs the ignored test `name` (its path inside the crate, e.g.
/// "engine::transport::staging::tests::x") in a child process of this test binary, with the
/// stand-in CUDA driver (src/cuda/mock_cuda.c) as the driver. False where no C compiler
/// builds the stand-in (the caller skips).
pub fn in_mock_cuda(who: &str, name: &str) -> bool {
    let Some(lib) = crate::cuda::tests::build_mock(who) else { return false };
    let exe = std::env::current_exe().expect("test binary");
    let out = std::process::Command::new(exe)
        .args(["--exact", name, "--ignored", "--nocapture", "--test-threads=1"])
        .env(crate::cuda::LIB_ENV, &lib)
        .env("NF_CUDA_MOCK_CHILD", "1")
        .output()
        .expect("child test runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(lib.parent().expect("mock dir"));
    assert!(out.status.success() && text.contains("1 passed"), "child {name} failed:\n{text}");
    true
}

/// Whether this process is such a child.
pub fn mock_child() -> bool {
    std::env::var("NF_CUDA_MOCK_CHILD").is_ok()
}
