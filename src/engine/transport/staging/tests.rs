use super::*;
use crate::engine::conns::Initiator;
use crate::engine::local_peers::Locality;
use crate::engine::registry::{LocalMem, MemKind, SharedCloseQueue};
use crate::engine::request::Seg;
use crate::engine::transport::fake::{in_mock_cuda, mock_child, request, Answer, Bench};
use crate::engine::wire::encode_ctrl;
use std::sync::Mutex;
use crate::error::Error;

const CHUNK: usize = 64 << 10;

fn bench() -> Bench {
    let mut cfg = crate::config::Config::defaults();
    cfg.staging_chunk_size = CHUNK as u64;
    cfg.staging_buffer_size = 8 * CHUNK as u64;
    Bench::with_config(1, false, cfg)
}

/// Device memory of `len` bytes registered (staged) with the bench's engine.
fn device(b: &Bench, len: usize) -> (cuda::DeviceBuffer, Arc<LocalMem>, DeviceMem, cuda::PrimaryContext) {
    let p = cuda::Context::primary(0).expect("mock device 0");
    let buf = cuda::DeviceBuffer::new(&p.context(), len).expect("device memory");
    let dev = DeviceMem { ctx: p.context(), ordinal: 0, staged: true, managed: false };
    let closeq = SharedCloseQueue::default();
    let m = Arc::new(LocalMem::new(b.core.engine_id, buf.addr(), len as u64, MemKind::Vram, 0, b.rails.len(), Vec::new(), closeq, Some(dev), Some(b.core.gpu.clone())));
    b.core.gpu.add(&m, dev.ctx);
    (buf, m, dev, p)
}

fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n).map(|i| ((i + seed) * 131 % 251) as u8).collect()
}

/// Drives the transport until `done` or `passes` run out: completions, then advance.
fn spin(b: &mut Bench, t: &mut Staging, passes: usize, done: impl Fn(&Bench) -> bool) {
    for _ in 0..passes {
        b.complete(t);
        t.advance(&mut b.cx());
        if done(b) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// The answers (StageAck) this engine sent, by token.
fn acks(b: &Bench) -> Vec<StageAck> {
    b.out.iter().filter_map(|o| match o {
        super::super::Outcome::Ctrl(m) => wire::decode_ctrl(&m.bytes).ok().filter(|c| c.kind == CtrlType::StageAck).and_then(|c| StageAck::decode(c.payload).ok()),
        _ => None,
    }).collect()
}
use crate::engine::wire;

/// Engine `id` ("init<id>") introduced itself to `b`: answers to it go to address 5.
fn requester(b: &mut Bench, id: u64) {
    b.conns.initiators.insert(id, Initiator { name: format!("init{id}"), info: None, addr: Some(5), rail_addrs: Vec::new(), pidfd: None });
}

/// Engine `from` asks `t` (request `token`, rail 0) to PULL the CHUNK bytes at its address
/// `theirs` into our device address `dev`.
fn ask_pull(b: &mut Bench, t: &mut Staging, from: u64, token: u64, dev: u64, theirs: u64) {
    let st = Stage { token, dir: StageDir::Pull, rail: 0, rrail: 0, peer_key: 9, ranges: vec![(dev, theirs, CHUNK as u64)] };
    let bytes = encode_ctrl(CtrlType::Stage, from, &format!("init{from}"), &st.encode());
    assert!(t.on_control(&mut b.cx(), &wire::decode_ctrl(&bytes).unwrap()));
}

#[test]
fn pull_serve_retried_after_eagain_reads_and_lands_the_peers_bytes() {
    in_mock_cuda("pull-serve", "engine::transport::staging::tests::pull_serve_child");
}

/// Regression (issue 21): a PULL serve whose READ the provider refused (FI_EAGAIN) was
/// parked as a copy-out with an unrecorded event, and its retry posted a WRITE of a
/// stale bounce slot into the initiator's buffer, then copied stale bytes into our GPU
/// memory and answered success.
#[test]
#[ignore = "run by pull_serve_retried_after_eagain_reads_and_lands_the_peers_bytes"]
fn pull_serve_child() {
    if !mock_child() {
        return;
    }
    let mut b = bench();
    let (buf, _m, _dev, _p) = device(&b, 2 * CHUNK);
    let theirs = pattern(CHUNK, 3);
    let untouched = theirs.clone();
    requester(&mut b, 77);
    let mut t = Staging::new(1, "test");
    b.fakes[0].script(&[Answer::Again, Answer::Again]);
    b.fakes[0].storm(3);
    ask_pull(&mut b, &mut t, 77, 42, buf.addr() + CHUNK as u64, theirs.as_ptr() as u64);
    spin(&mut b, &mut t, 200, |b| !acks(b).is_empty());
    let acks = acks(&b);
    assert_eq!(acks, vec![StageAck { token: 42, status: 0 }]);
    let posted = b.fakes[0].accepted();
    assert_eq!(posted.len(), 1, "one operation, retried until accepted");
    assert!(!posted[0].write, "a PULL serve reads the initiator's memory, also after FI_EAGAIN");
    assert_eq!((posted[0].segs[0].1, posted[0].segs[0].2, posted[0].segs[0].3), (CHUNK, theirs.as_ptr() as u64, 9));
    assert_eq!(theirs, untouched, "the initiator's memory is never written by a PULL");
    let mut landed = vec![0u8; CHUNK];
    buf.read(CHUNK, &mut landed).unwrap();
    assert!(landed == theirs, "the peer's bytes are in our device memory");
    assert!(t.idle());
}

#[test]
fn serves_of_a_disconnected_requester_end_unanswered_with_their_slots_back() {
    in_mock_cuda("serves-gone", "engine::transport::staging::tests::serves_gone_child");
}

/// A requester goes while we serve its chunks: the ones waiting for a slot are dropped,
/// the ones whose reads the provider keeps refusing end at once, none is answered, and
/// every slot is free again; another requester's serve is untouched.
#[test]
#[ignore = "run by serves_of_a_disconnected_requester_end_unanswered_with_their_slots_back"]
fn serves_gone_child() {
    if !mock_child() {
        return;
    }
    let mut b = bench();
    let (buf, _m, _dev, _p) = device(&b, 8 * CHUNK);
    let theirs = pattern(CHUNK, 5);
    requester(&mut b, 77);
    requester(&mut b, 78);
    let mut t = Staging::new(1, "test");
    b.fakes[0].refuse_all(true);
    // More requests from 77 than the pool has slots; one from 78.
    for k in 0..10u64 {
        ask_pull(&mut b, &mut t, if k == 0 { 78 } else { 77 }, 100 + k, buf.addr() + (k % 8) * CHUNK as u64, theirs.as_ptr() as u64);
    }
    t.advance(&mut b.cx());
    let total = 8;
    let free = t.pool.as_ref().expect("a pool").free_slots();
    assert!(free < total, "serves hold slots");
    assert!(!t.serves.waiting.is_empty(), "some requests wait for a slot");
    b.out.clear();
    t.drop_peer(&mut b.cx(), 2, 77);
    assert!(t.serves.waiting.is_empty(), "the gone requester's waiting requests are dropped");
    assert!(acks(&b).is_empty(), "nobody answers a gone requester");
    assert_eq!(t.pool.as_ref().expect("a pool").free_slots(), total - 1, "only 78's serve holds a slot");
    // 78's serve goes on once the provider takes its read.
    b.fakes[0].refuse_all(false);
    spin(&mut b, &mut t, 200, |b| !acks(b).is_empty());
    assert_eq!(acks(&b), vec![StageAck { token: 100, status: 0 }]);
    assert!(t.idle());
    assert_eq!(t.pool.as_ref().expect("a pool").free_slots(), total);
}

#[test]
fn staged_chunks_under_eagain_error_completions_and_a_gone_peer() {
    in_mock_cuda("staged-jobs", "engine::transport::staging::tests::staged_jobs_child");
}

#[test]
#[ignore = "run by staged_chunks_under_eagain_error_completions_and_a_gone_peer"]
fn staged_jobs_child() {
    if !mock_child() {
        return;
    }
    let mut b = bench();
    let peer = b.peer(1, Locality::Remote);
    let (buf, _m, dev, _p) = device(&b, 4 * CHUNK);
    let ours = pattern(4 * CHUNK, 5);
    buf.write(0, &ours).unwrap();
    let mut theirs = vec![0u8; 4 * CHUNK];
    let seg = |i: usize, theirs: &mut [u8]| Seg {
        local: buf.addr() + (i * CHUNK) as u64, len: CHUNK as u64, raddr: theirs.as_mut_ptr() as u64 + (i * CHUNK) as u64,
        rkey: 3, desc: 0, rail: 0, rrail: 0, kind: SegKind::DevToHost { ctx: dev.ctx },
    };
    // WRITE of four chunks, the provider refusing in storms: each chunk's RMA is the
    // same write when it is finally taken, and the peer gets our bytes.
    let segs = (0..4).map(|i| seg(i, &mut theirs)).collect();
    let req = request(Op::Write, &peer, segs);
    b.fakes[0].script(&[Answer::Again, Answer::Accept, Answer::Again]);
    b.fakes[0].storm(4);
    let mut t = Staging::new(1, "test");
    let run = b.run(&mut t, &req, 500);
    assert!(run.failed.is_none());
    assert_eq!(run.pieces.len(), 4);
    assert!(run.pieces.iter().all(|p| p.res.is_ok()));
    assert!(theirs == ours);
    let posted = b.fakes[0].accepted();
    assert_eq!(posted.len(), 4);
    assert!(posted.iter().all(|a| a.write && a.segs[0].1 == CHUNK));
    // READ back with an error completion on the first chunk: that piece fails, the
    // others land, and every slot comes back (a later post runs).
    let mut back = vec![0u8; 4 * CHUNK];
    let segs: Vec<Seg> = (0..4).map(|i| Seg { local: buf.addr() + (i * CHUNK) as u64, raddr: back.as_mut_ptr() as u64 + (i * CHUNK) as u64, ..seg(i, &mut theirs) }).collect();
    back.copy_from_slice(&pattern(4 * CHUNK, 9));
    let req = request(Op::Read, &peer, segs);
    b.fakes[0].fail_completions(1);
    let run = b.run(&mut t, &req, 500);
    assert_eq!(run.pieces.len(), 4);
    assert_eq!(run.pieces.iter().filter(|p| p.res.is_err()).count(), 1);
    let mut dev_now = vec![0u8; 4 * CHUNK];
    buf.read(0, &mut dev_now).unwrap();
    assert!(dev_now[CHUNK..] == back[CHUNK..], "the chunks that completed landed");
    assert!(t.idle());
    // A peer that never answers a stage request (HostToDev: the peer stages): its
    // chunks end when it is dropped, with their slots back.
    let host = pattern(2 * CHUNK, 1);
    let segs = (0..2).map(|i| Seg { local: host.as_ptr() as u64 + (i * CHUNK) as u64, len: CHUNK as u64, raddr: 0x1000 + (i * CHUNK) as u64, rkey: 0, desc: 0, rail: 0, rrail: 0, kind: SegKind::HostToDev { self_addr: host.as_ptr() as u64 + (i * CHUNK) as u64, self_key: 1, owner_rma: false } }).collect();
    let req = request(Op::Write, &peer, segs);
    let run = b.run(&mut t, &req, 5);
    assert!(run.pieces.is_empty(), "waiting for the peer");
    assert!(!t.idle());
    t.drop_peer(&mut b.cx(), 1, 1001);
    let pieces = b.pieces();
    assert_eq!(pieces.len(), 2);
    assert!(pieces.iter().all(|p| matches!(p.res, Err(Error::Disconnected(_)))));
    assert!(t.idle());
}

/// Two engines of staging in one process, each on its own fake rails: the initiator's
/// stage requests go to the owner and its answers back, as the driver's control channel
/// would carry them.
struct Pair {
    init: Bench,
    owner: Bench,
    ti: Staging,
    to: Staging,
    peer: Arc<crate::engine::peer::Peer>,
}

const RAILS: usize = 4;

fn pair() -> Pair {
    let cfg = || {
        let mut c = crate::config::Config::defaults();
        c.staging_chunk_size = CHUNK as u64;
        c.staging_buffer_size = 16 * CHUNK as u64;
        c.staging_ranges = 24;
        // (A lent slot's lease is four timeouts: 0.4 s here.)
        c.timeout_ms = 100;
        c
    };
    let mut init = Bench::with_config(RAILS, false, cfg());
    let mut owner = Bench::with_config(RAILS, false, cfg());
    let peer = init.peer(1, Locality::Remote);
    let info = crate::engine::wire::ConnInfo {
        engine_id: init.core.engine_id, host_id: [3; 16], agent: "init".into(),
        rails: (0..RAILS).map(|_| crate::engine::wire::RailAddr { provider: "fake".into(), addr: vec![2] }).collect(), process: None, rail0_saw: false, packed_staging: true, eager_write: false, lends: false,
    };
    owner.conns.initiators.insert(init.core.engine_id, Initiator { name: "init".into(), info: Some(info), addr: Some(5), rail_addrs: Vec::new(), pidfd: None });
    Pair { init, owner, ti: Staging::new(1, "test"), to: Staging::new(1, "test"), peer }
}

/// Hands the control messages in `from`'s outcomes to `t` (pieces stay).
fn deliver(from: &mut Bench, to: &mut Bench, t: &mut Staging) -> usize {
    let mut n = 0;
    for o in std::mem::take(&mut from.out) {
        match o {
            super::super::Outcome::Ctrl(m) => {
                let msg = wire::decode_ctrl(&m.bytes).expect("our control message decodes");
                assert!(t.on_control(&mut to.cx(), &msg));
                n += 1;
            }
            o => from.out.push(o),
        }
    }
    n
}

impl Pair {
    /// Starts the whole of `req` as one post (epoch 1), as the driver does for a request
    /// whose chunks all fit.
    fn start(&mut self, req: &Arc<Request>) -> super::super::Start {
        let mut marks = Default::default();
        self.ti.start(&mut self.init.cx(), Post { req, epoch: 1, at: 0, notif: &mut None, marks: &mut marks })
    }

    /// `passes` passes of our side alone, 50 us apart: nothing is carried to the owner.
    fn advance_alone(&mut self, passes: usize) {
        for _ in 0..passes {
            self.ti.advance(&mut self.init.cx());
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    /// Drives `req` to its end: started chunk by chunk as the driver would, stage
    /// requests and answers carried between the two. Returns the pieces.
    fn run(&mut self, req: &Arc<Request>) -> Vec<super::super::Piece> {
        let mut marks = Default::default();
        let (mut next, mut started, mut pieces) = (0, 0, Vec::new());
        for _ in 0..4000 {
            if next < req.segs.len() {
                let s = self.ti.start(&mut self.init.cx(), Post { req, epoch: 1, at: next, notif: &mut None, marks: &mut marks });
                next += s.segs;
                started += s.pieces;
                assert!(!matches!(s.stop, Some(super::super::Stop::Failed(_))), "{:?}", s.stop);
            }
            self.init.complete(&mut self.ti);
            self.ti.advance(&mut self.init.cx());
            deliver(&mut self.init, &mut self.owner, &mut self.to);
            self.owner.complete(&mut self.to);
            self.to.advance(&mut self.owner.cx());
            deliver(&mut self.owner, &mut self.init, &mut self.ti);
            pieces.extend(self.init.pieces());
            if next >= req.segs.len() && pieces.len() >= started {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        assert_eq!(pieces.len(), started, "every chunk ended");
        pieces
    }
}

/// Answers nothing about same-host memory: every pair is planned for the network.
struct Remote;
impl crate::engine::scheduler::Reach for Remote {
    fn same_process(&self, _: &crate::engine::peer::Peer, _: u64, _: u64, _: MemKind) -> Option<Arc<LocalMem>> {
        None
    }
    fn ipc_open(&self, _: &crate::engine::peer::Peer, _: &crate::engine::wire::IpcDesc, _: Option<cuda::Context>) -> Option<Arc<crate::engine::ipc_cache::IpcEntry>> {
        None
    }
    fn peer_copy_refused(&self, _: u64) -> bool {
        false
    }
    fn pin(&self, _: &LocalMem, _: &cuda::Context) {}
}

/// The scattered blocks of a KV-like batch: (local offset, remote offset, length), of
/// mixed sizes (some longer than a chunk, some a few bytes), the remote ones in reverse
/// order with gaps.
fn blocks(n: usize) -> (Vec<(u64, u64, u64)>, u64) {
    let sizes = [4096u64, 16384, 512, CHUNK as u64 + 4104, 3000, 8];
    let lens: Vec<u64> = (0..n).map(|i| sizes[i % sizes.len()]).collect();
    let span: u64 = lens.iter().map(|l| l + 256).sum();
    let mut out = Vec::new();
    let (mut lo, mut ro) = (0u64, span);
    for &len in &lens {
        ro -= len + 256;
        out.push((lo, ro + 64, len));
        lo += len + 128;
    }
    (out, span + 4096)
}

/// Every block of `bl` (local offset, remote offset, length) moved: from `src` at its local
/// offset to `dst` at its remote one, or back (`back`: a READ, remote to local). Panics
/// naming the first bad block, how many differ, and where its bytes went.
fn expect_blocks(bl: &[(u64, u64, u64)], dst: &[u8], src: &[u8], back: bool, what: &str) {
    for &(l, r, n) in bl {
        let (l, r, n) = (l as usize, r as usize, n as usize);
        let (got, want) = if back { (&dst[l..l + n], &src[r..r + n]) } else { (&dst[r..r + n], &src[l..l + n]) };
        if got != want {
            let bad = bl.iter().filter(|&&(l, r, n)| { let (l, r, n) = (l as usize, r as usize, n as usize); if back { dst[l..l + n] != src[r..r + n] } else { dst[r..r + n] != src[l..l + n] } }).count();
            let zero = got.iter().all(|&b| b == 0);
            let pos = (got.iter().zip(want).position(|(a, b)| a != b), src.windows(32).position(|w| w == &got[..32]), dst.windows(32).position(|w| w == &want[..32]));
            panic!("{what}: block at local {l:#x} / remote {r:#x} of {n} bytes; {bad} of {} blocks differ; all zero: {zero}; first difference at {pos:?}", bl.len());
        }
    }
}

/// Plans `op` over `blocks` between `local` and the peer's registration `remote` the
/// way the engine does (scheduler::plan), and returns the request.
fn planned(p: &Pair, op: Op, blocks: &[(u64, u64, u64)], local: &Arc<LocalMem>, remote: &Arc<crate::engine::remote::RemoteMem>) -> Arc<Request> {
    planned_on(p, op, blocks, local, remote, false, true)
}

/// As `planned`, on rails that do or do not bounce RMA from host memory into a peer's
/// FI_HMEM device memory (RailShape::hmem_host_bounce, shm's), with config hmem_owner_rma
/// `owner_rma`.
fn planned_on(p: &Pair, op: Op, blocks: &[(u64, u64, u64)], local: &Arc<LocalMem>, remote: &Arc<crate::engine::remote::RemoteMem>,
              hmem_host_bounce: bool, owner_rma: bool) -> Arc<Request> {
    use crate::engine::scheduler::{plan, Inputs, Pair as DescPair, RailShape};
    let shapes: Vec<RailShape> = (0..RAILS).map(|_| RailShape { max_msg: 1 << 30, virt_addr: true, provider: "fake".into(), order_saw: false, nic_shared: true, hmem_host_bounce }).collect();
    let rr = std::sync::atomic::AtomicUsize::new(0);
    let rbase = match &**remote {
        crate::engine::remote::RemoteMem::Peer { desc, .. } => desc.base,
        _ => unreachable!(),
    };
    let pairs: Vec<DescPair> = blocks.iter().map(|&(l, r, n)| DescPair { local: (local.base + l, n, local), remote: (rbase + r, n, remote) }).collect();
    let target = crate::engine::request::Target::Peer(p.peer.clone());
    let cfg = crate::config::Config { hmem_owner_rma: owner_rma, ..p.init.core.cfg.clone() };
    let inp = Inputs { engine_id: p.init.core.engine_id, op: crate::engine::request::Op::Write, cfg: &cfg, shapes: &shapes, rr_base: 0, rr_chunks: &rr, timed: false, plan_threads: 1, staged_chunk: 0 };
    let pl = plan(&inp, &target, &pairs[..], &Remote).expect("plans");
    Arc::new(Request::new(op, target, pl.segs, Vec::new(), Vec::new(), Vec::new()))
}

fn remote_desc(p: &Pair, base: u64, len: u64, staged: bool) -> Arc<crate::engine::remote::RemoteMem> {
    let desc = crate::engine::wire::MemDesc { mem_type: staged as u8, virt_addr: true, staged, engine_id: p.owner.core.engine_id, base, len, dev_id: 0, keys: (0..RAILS as u64).map(|k| 50 + k).collect(), ipc: None };
    Arc::new(crate::engine::remote::RemoteMem::Peer { peer: p.peer.clone(), desc, opened: Mutex::new(Vec::new()) })
}

/// The peer's device memory registered with the provider (FI_HMEM): not staged, a key on
/// every rail.
fn hmem_desc(p: &Pair, base: u64, len: u64) -> Arc<crate::engine::remote::RemoteMem> {
    let desc = crate::engine::wire::MemDesc { mem_type: MemKind::Vram as u8, virt_addr: true, staged: false, engine_id: p.owner.core.engine_id, base, len, dev_id: 0, keys: (0..RAILS as u64).map(|k| 60 + k).collect(), ipc: None };
    Arc::new(crate::engine::remote::RemoteMem::Peer { peer: p.peer.clone(), desc, opened: Mutex::new(Vec::new()) })
}

/// Device memory of `len` bytes registered with the bench's fake rails as FI_HMEM (the
/// fakes remember its context and fail a post that touches it without that context).
fn device_hmem(b: &Bench, len: usize) -> (cuda::DeviceBuffer, Arc<LocalMem>, cuda::PrimaryContext) {
    let p = cuda::Context::primary(0).expect("mock device 0");
    let buf = cuda::DeviceBuffer::new(&p.context(), len).expect("device memory");
    let dev = DeviceMem { ctx: p.context(), ordinal: 0, staged: false, managed: false };
    let hmem = crate::fabric::Hmem { iface: 1, device: 0, device_only: true };
    // SAFETY: buf outlives the registrations (the LocalMem is dropped first by the caller).
    let mrs = b.rails.iter().enumerate().map(|(i, r)| unsafe { r.register(buf.addr() as *const u8, len, 900 + i as u64, Some(hmem)) }.expect("fake FI_HMEM registration")).collect();
    let m = Arc::new(LocalMem::new(b.core.engine_id, buf.addr(), len as u64, MemKind::Vram, 0, b.rails.len(), mrs, SharedCloseQueue::default(), Some(dev), Some(b.core.gpu.clone())));
    b.core.gpu.add(&m, dev.ctx);
    (buf, m, p)
}

fn host_mem(b: &Bench, bytes: &mut [u8]) -> Arc<LocalMem> {
    let closeq = SharedCloseQueue::default();
    Arc::new(LocalMem::new(b.core.engine_id, bytes.as_mut_ptr() as u64, bytes.len() as u64, MemKind::Dram, 0, RAILS, Vec::new(), closeq, None, None))
}

/// The chunks of a planned request (runs of segments a start takes as one): their
/// segment counts.
fn chunk_lens(p: &Pair, req: &Request) -> Vec<usize> {
    let mut cx_bench = Bench::with_config(RAILS, false, p.init.core.cfg.clone());
    let t = Staging::new(1, "test");
    let mut at = 0;
    let mut lens = Vec::new();
    while at < req.segs.len() {
        lens.push(t.chunk_len(&cx_bench.cx(), req, at));
        at += lens[lens.len() - 1];
    }
    lens
}

fn chunk_count(p: &Pair, req: &Request) -> usize {
    chunk_lens(p, req).len()
}

#[test]
fn packed_chunks_move_scattered_blocks_over_four_rails_both_ways() {
    in_mock_cuda("packed", "engine::transport::staging::tests::packed_child");
}

/// Events the stand-in driver has created in this process.
fn mock_events_created() -> std::ffi::c_long {
    // SAFETY: mock_events_created has this signature.
    let created: unsafe extern "C" fn() -> std::ffi::c_long = unsafe { cuda::tests::mock_hook(b"mock_events_created\0") };
    // SAFETY: the counter takes nothing.
    unsafe { created() }
}

/// VRAM<->VRAM, VRAM->DRAM and DRAM->VRAM, WRITE and READ, of many blocks of mixed
/// sizes in reversed order, over four rails with FI_EAGAIN storms on every rail: byte
/// exact; one gather or scatter launch per chunk on each side (never one per block),
/// one stage request per chunk, every rail carrying chunks, every slot back.
#[test]
#[ignore = "run by packed_chunks_move_scattered_blocks_over_four_rails_both_ways"]
fn packed_child() {
    if !mock_child() {
        return;
    }
    let mut p = pair();
    let (bl, span) = blocks(60);
    let (ibuf, im, _idev, _ip) = device(&p.init, span as usize);
    let (obuf, om, _odev, _op) = device(&p.owner, span as usize);
    let total: u64 = bl.iter().map(|b| b.2).sum();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let src: Vec<u8> = (0..span).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 }).collect();
    ibuf.write(0, &src).unwrap();
    obuf.write(0, &vec![0u8; span as usize]).unwrap();
    for f in p.init.fakes.iter().chain(p.owner.fakes.iter()) {
        f.script(&[Answer::Accept, Answer::Again, Answer::Accept, Answer::Accept, Answer::Again]);
        f.storm(2);
    }
    let remote = remote_desc(&p, om.base, om.len, true);
    let counters = |b: &Bench| b.core.counters.snapshot();

    // VRAM -> VRAM WRITE: gather here, the owner pulls into its slot and scatters.
    let req = planned(&p, Op::Write, &bl, &im, &remote);
    assert!(req.segs.len() > bl.len(), "blocks longer than a chunk were cut");
    let chunks = chunk_count(&p, &req);
    assert!(chunks < bl.len(), "chunks ({chunks}) pack several blocks");
    let (i0, o0) = (counters(&p.init), counters(&p.owner));
    let pieces = p.run(&req);
    assert_eq!(pieces.len(), chunks);
    assert!(pieces.iter().all(|x| x.res.is_ok()), "{:?}", pieces.iter().find_map(|x| x.res.as_ref().err()));
    assert_eq!(pieces.iter().map(|x| x.bytes).sum::<u64>(), total);
    let mut landed = vec![0u8; span as usize];
    obuf.read(0, &mut landed).unwrap();
    expect_blocks(&bl, &landed, &src, false, "VRAM->VRAM WRITE");
    let (i1, o1) = (counters(&p.init), counters(&p.owner));
    assert_eq!(i1.stage_requests - i0.stage_requests, chunks as u64, "one stage request per chunk");
    assert_eq!(o1.stage_served - o0.stage_served, chunks as u64);
    let launches = |a: &crate::engine::counters::CounterSnapshot, b: &crate::engine::counters::CounterSnapshot| (b.gpu_kernel_launches - a.gpu_kernel_launches) + (b.gpu_copy_calls - a.gpu_copy_calls);
    assert_eq!(launches(&i0, &i1), chunks as u64, "one gather (or one copy) per chunk here");
    assert_eq!(launches(&o0, &o1), chunks as u64, "one scatter (or one copy) per chunk at the owner");
    assert!(i1.gpu_kernel_launches > i0.gpu_kernel_launches, "many-block chunks use the kernel");
    // staging_rail0 off (the default): rail 0 keeps the control messages to itself.
    assert!(p.owner.fakes[0].accepted().is_empty(), "no chunk's RMA on the owner's rail 0");
    for r in 1..RAILS {
        assert!(!p.owner.fakes[r].accepted().is_empty(), "the owner's RMA for chunks went over its rail {r} too");
    }

    // VRAM <- VRAM READ: the owner gathers and pushes into our slot, we scatter.
    ibuf.write(0, &vec![0u8; span as usize]).unwrap();
    let back = pattern(span as usize, 29);
    obuf.write(0, &back).unwrap();
    let req = planned(&p, Op::Read, &bl, &im, &remote);
    let (i0, o0) = (counters(&p.init), counters(&p.owner));
    let pieces = p.run(&req);
    assert!(pieces.iter().all(|x| x.res.is_ok()));
    let mut got = vec![0u8; span as usize];
    ibuf.read(0, &mut got).unwrap();
    expect_blocks(&bl, &got, &back, true, "VRAM<-VRAM READ");
    let (i1, o1) = (counters(&p.init), counters(&p.owner));
    assert_eq!(launches(&i0, &i1), chunks as u64);
    assert_eq!(launches(&o0, &o1), chunks as u64);
    assert_eq!(i1.stage_requests - i0.stage_requests, chunks as u64);
    assert!(p.owner.fakes.iter().any(|f| f.accepted().iter().any(|a| a.write)), "the owner pushed by RMA write");

    // VRAM <- VRAM READ from an owner that lends slots: it gathers into a slot of its
    // own, we RMA-read that into ours, give it back, and scatter.
    let lender = p.init.peer_lending(2, Locality::Remote, p.owner.core.engine_id);
    let push_peer = std::mem::replace(&mut p.peer, lender);
    let lremote = remote_desc(&p, om.base, om.len, true);
    ibuf.write(0, &vec![0u8; span as usize]).unwrap();
    let back = pattern(span as usize, 31);
    obuf.write(0, &back).unwrap();
    let req = planned(&p, Op::Read, &bl, &im, &lremote);
    let before: Vec<usize> = p.owner.fakes.iter().map(|f| f.accepted().len()).collect();
    let (i0, o0) = (counters(&p.init), counters(&p.owner));
    let events0 = mock_events_created();
    let pieces = p.run(&req);
    // Our scatters and the owner's gathers go on the streams the READ above used, whose
    // copies are all done: their events are recorded again, none is made.
    assert_eq!(mock_events_created(), events0, "events of done copies are reused");
    assert!(pieces.iter().all(|x| x.res.is_ok()), "{:?}", pieces.iter().find_map(|x| x.res.as_ref().err()));
    assert_eq!(pieces.iter().map(|x| x.bytes).sum::<u64>(), total);
    ibuf.read(0, &mut got).unwrap();
    expect_blocks(&bl, &got, &back, true, "VRAM<-VRAM READ of lent slots");
    let (i1, o1) = (counters(&p.init), counters(&p.owner));
    assert_eq!(launches(&i0, &i1), chunks as u64, "one scatter per chunk here");
    assert_eq!(launches(&o0, &o1), chunks as u64, "one gather per chunk at the owner");
    assert_eq!(i1.stage_requests - i0.stage_requests, chunks as u64, "one stage request per chunk");
    // Chunks of several blocks were lent and read by us; those of one range the owner
    // wrote into our slot.
    let several = chunk_lens(&p, &req).iter().filter(|&&k| k > 1).count();
    assert!(several > 0, "chunks of several blocks ({several} of {chunks})");
    let owner_writes: usize = p.owner.fakes.iter().zip(&before).map(|(f, &n)| f.accepted()[n..].iter().filter(|a| a.write).count()).sum();
    let reads: usize = p.init.fakes.iter().map(|f| f.accepted().iter().filter(|a| !a.write).count()).sum();
    assert!(reads >= several, "we read every lent chunk ({reads} reads, {several} chunks of several blocks)");
    assert!(owner_writes >= chunks - several && owner_writes <= 4 * (chunks - several), "the owner wrote only the chunks of one range ({owner_writes} writes)");
    assert!(p.to.idle(), "every lent slot came back");
    // The same with an error completion for one read on every rail: those chunks fail,
    // the others land, and every slot comes back on both sides (the failed reads'
    // leases are released too).
    ibuf.write(0, &vec![0u8; span as usize]).unwrap();
    p.init.fakes.iter().for_each(|f| f.fail_completions(1));
    let pieces = p.run(&req);
    let failed = pieces.iter().filter(|x| x.res.is_err()).count();
    assert!(failed > 0 && failed < pieces.len(), "{failed} of {} chunks failed", pieces.len());
    assert!(p.to.idle(), "the owner got every lent slot back, the failed reads' too");
    assert_eq!(p.to.pool.as_ref().expect("the owner's pool").free_slots(), 16);
    assert!(p.ti.idle());
    p.peer = push_peer;

    // DRAM -> VRAM WRITE and READ: only the owner stages; our host memory is RMA'd
    // directly, several blocks per operation.
    let mut host = pattern(span as usize, 41);
    let hm = host_mem(&p.init, &mut host);
    obuf.write(0, &vec![0u8; span as usize]).unwrap();
    let req = planned(&p, Op::Write, &bl, &hm, &remote);
    assert!(req.segs.iter().all(|s| matches!(s.kind, SegKind::HostToDev { .. })));
    let (i0, o0) = (counters(&p.init), counters(&p.owner));
    let pieces = p.run(&req);
    assert!(pieces.iter().all(|x| x.res.is_ok()));
    obuf.read(0, &mut landed).unwrap();
    expect_blocks(&bl, &landed, &host, false, "DRAM->VRAM WRITE");
    let (i1, o1) = (counters(&p.init), counters(&p.owner));
    let chunks = chunk_count(&p, &req);
    assert_eq!(i1.stage_requests - i0.stage_requests, chunks as u64);
    assert_eq!(launches(&o0, &o1), chunks as u64);
    assert_eq!(launches(&i0, &i1), 0, "no device copy on the host side");
    let mut hback = vec![0u8; span as usize];
    let hbm = host_mem(&p.init, &mut hback);
    let req = planned(&p, Op::Read, &bl, &hbm, &remote);
    let pieces = p.run(&req);
    assert!(pieces.iter().all(|x| x.res.is_ok()));
    obuf.read(0, &mut landed).unwrap();
    expect_blocks(&bl, &std::hint::black_box(&hback).clone(), &landed, true, "DRAM<-VRAM READ");

    // DRAM <- VRAM READ from an owner that lends slots: each lent chunk is read straight
    // into our host memory (no slot of ours, no device copy here), its slot given back.
    let lender = p.init.peer_lending(2, Locality::Remote, p.owner.core.engine_id);
    let push_peer = std::mem::replace(&mut p.peer, lender);
    let lremote = remote_desc(&p, om.base, om.len, true);
    std::hint::black_box(&mut hback).fill(0);
    let req = planned(&p, Op::Read, &bl, &hbm, &lremote);
    let several = chunk_lens(&p, &req).iter().filter(|&&k| k > 1).count();
    let reads = |b: &Bench| b.fakes.iter().map(|f| f.accepted().iter().filter(|a| !a.write).count()).sum::<usize>();
    let (r0, i0, o0) = (reads(&p.init), counters(&p.init), counters(&p.owner));
    let pieces = p.run(&req);
    assert!(pieces.iter().all(|x| x.res.is_ok()), "{:?}", pieces.iter().find_map(|x| x.res.as_ref().err()));
    assert_eq!(pieces.iter().map(|x| x.bytes).sum::<u64>(), total);
    expect_blocks(&bl, &std::hint::black_box(&hback).clone(), &landed, true, "DRAM<-VRAM READ of lent slots");
    let (i1, o1) = (counters(&p.init), counters(&p.owner));
    assert_eq!(launches(&i0, &i1), 0, "no device copy on the host side");
    assert_eq!(launches(&o0, &o1), chunk_count(&p, &req) as u64, "one gather per chunk at the owner");
    assert!(several > 0 && reads(&p.init) - r0 >= several, "we read every lent chunk ({} reads, {several} chunks of several blocks)", reads(&p.init) - r0);
    assert!(p.ti.pool.is_none() || p.ti.pool.as_ref().is_some_and(|x| x.free_slots() == 16), "no slot of ours was held");
    assert!(p.to.idle(), "every lent slot came back");
    // An error completion for one read on every rail: those chunks fail, the rest land,
    // and the owner gets every slot back.
    p.init.fakes.iter().for_each(|f| f.fail_completions(1));
    let pieces = p.run(&req);
    let failed = pieces.iter().filter(|x| x.res.is_err()).count();
    assert!(failed > 0 && failed < pieces.len(), "{failed} of {} chunks failed", pieces.len());
    assert!(p.to.idle() && p.ti.idle());
    assert_eq!(p.to.pool.as_ref().expect("the owner's pool").free_slots(), 16);
    p.peer = push_peer;

    // VRAM -> DRAM WRITE and READ: only we stage; the peer's host memory is RMA'd.
    let mut theirs = vec![0u8; span as usize];
    let tr = remote_desc(&p, theirs.as_mut_ptr() as u64, span, false);
    ibuf.write(0, &src).unwrap();
    let req = planned(&p, Op::Write, &bl, &im, &tr);
    assert!(req.segs.iter().all(|s| matches!(s.kind, SegKind::DevToHost { .. })));
    let (o0, i0) = (counters(&p.owner), counters(&p.init));
    let pieces = p.run(&req);
    assert!(pieces.iter().all(|x| x.res.is_ok()));
    expect_blocks(&bl, &std::hint::black_box(&theirs).clone(), &src, false, "VRAM->DRAM WRITE");
    let chunks = chunk_count(&p, &req);
    let i1 = counters(&p.init);
    assert_eq!(launches(&i0, &i1), chunks as u64);
    assert_eq!(counters(&p.owner).stage_served, o0.stage_served, "the owner of host memory serves nothing");
    ibuf.write(0, &vec![0u8; span as usize]).unwrap();
    let req = planned(&p, Op::Read, &bl, &im, &tr);
    let pieces = p.run(&req);
    assert!(pieces.iter().all(|x| x.res.is_ok()));
    ibuf.read(0, &mut got).unwrap();
    expect_blocks(&bl, &got, &theirs, true, "VRAM<-DRAM READ");

    assert!(p.ti.idle() && p.to.idle());
    for (t, b) in [(&p.ti, &p.init), (&p.to, &p.owner)] {
        let pool = t.pool.as_ref().expect("a pool");
        assert_eq!(pool.free_slots(), (b.core.cfg.staging_buffer_size / CHUNK as u64) as usize, "every slot is back");
    }
}

#[test]
fn packed_chunk_of_a_gone_peer_ends_disconnected_with_its_slots_back() {
    in_mock_cuda("packed-gone", "engine::transport::staging::tests::packed_gone_child");
}

/// The owner dies mid-chunk: chunks waiting for its answer, and chunks whose RMA is
/// still with the provider, end with a disconnect, and every slot comes back.
#[test]
#[ignore = "run by packed_chunk_of_a_gone_peer_ends_disconnected_with_its_slots_back"]
fn packed_gone_child() {
    if !mock_child() {
        return;
    }
    let mut p = pair();
    let (bl, span) = blocks(40);
    let (_ibuf, im, _idev, _ip) = device(&p.init, span as usize);
    let (_obuf, om, _odev, _op) = device(&p.owner, span as usize);
    let remote = remote_desc(&p, om.base, om.len, true);
    let req = planned(&p, Op::Write, &bl, &im, &remote);
    let s = p.start(&req);
    assert!(s.pieces > 1);
    p.advance_alone(50);
    // The stage requests went out; the owner never answers (it is gone).
    assert!(!p.init.out.is_empty());
    p.init.out.clear();
    p.ti.drop_peer(&mut p.init.cx(), 1, 1001);
    let pieces = p.init.pieces();
    assert_eq!(pieces.len(), s.pieces);
    assert!(pieces.iter().all(|x| matches!(x.res, Err(Error::Disconnected(_)))));
    assert!(p.ti.idle());
    let pool = p.ti.pool.as_ref().expect("a pool");
    assert_eq!(pool.free_slots(), 16, "every slot is back");
    // VRAM -> DRAM with the RMA still with the provider when the peer goes: the chunk
    // ends when the provider hands the operation back, not before.
    let mut theirs = vec![0u8; span as usize];
    let tr = remote_desc(&p, theirs.as_mut_ptr() as u64, span, false);
    let req = planned(&p, Op::Write, &bl[..3], &im, &tr);
    p.init.fakes.iter().for_each(|f| f.disorder(false, 1_000_000));
    let s = p.start(&req);
    p.advance_alone(50);
    p.ti.drop_peer(&mut p.init.cx(), 1, 1001);
    assert!(p.init.pieces().is_empty(), "no chunk ends while its RMA is with the provider");
    assert!(!p.ti.idle());
    p.init.fakes.iter().for_each(|f| f.disorder(false, 0));
    p.init.complete(&mut p.ti);
    let pieces = p.init.pieces();
    assert_eq!(pieces.len(), s.pieces);
    assert!(pieces.iter().all(|x| x.res.is_err()));
    assert!(p.ti.idle());
    assert_eq!(p.ti.pool.as_ref().expect("a pool").free_slots(), 16);
    drop(theirs);

    // A READ of lent slots whose requester goes once the owner lent them: our disconnect
    // does not mean it stopped reading, so the slots stay lent until released or until
    // their lease runs out; a release naming them from anyone else frees nothing.
    p.init.fakes.iter().for_each(|f| f.disorder(false, 0));
    p.peer = p.init.peer_lending(2, Locality::Remote, p.owner.core.engine_id);
    let lremote = remote_desc(&p, om.base, om.len, true);
    let req = planned(&p, Op::Read, &bl, &im, &lremote);
    let s = p.start(&req);
    assert!(s.pieces > 1);
    deliver(&mut p.init, &mut p.owner, &mut p.to);
    let mut lent = Vec::new();
    for _ in 0..200 {
        p.to.advance(&mut p.owner.cx());
        for o in std::mem::take(&mut p.owner.out) {
            if let super::super::Outcome::Ctrl(m) = o {
                let msg = wire::decode_ctrl(&m.bytes).expect("decodes");
                assert_eq!(msg.kind, CtrlType::StageLent, "the owner lends, it does not push");
                lent.push(StageLent::decode(msg.payload).expect("a lent slot"));
            }
        }
        if lent.len() == s.pieces {
            break;
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    assert_eq!(lent.len(), s.pieces, "every chunk was packed and lent");
    let owner_pool = |p: &Pair| p.to.pool.as_ref().expect("the owner's pool").free_slots();
    let held = owner_pool(&p);
    let stranger = StageLent::encode_release(lent[0].lease);
    let msg = encode_ctrl(CtrlType::StageRelease, 4242, "stranger", &stranger);
    assert!(p.to.on_control(&mut p.owner.cx(), &wire::decode_ctrl(&msg).unwrap()));
    assert_eq!(owner_pool(&p), held, "a release from another engine frees nothing");
    p.to.drop_peer(&mut p.owner.cx(), 99, p.init.core.engine_id);
    assert!(!p.to.idle() && owner_pool(&p) == held, "lent slots stay lent at our disconnect");
    let late = encode_ctrl(CtrlType::StageRelease, p.init.core.engine_id, "init", &stranger);
    assert!(p.to.on_control(&mut p.owner.cx(), &wire::decode_ctrl(&late).unwrap()));
    assert_eq!(owner_pool(&p), held + 1, "its release gives one back");
    // A forged lent slot (wrong sender) is not read, and the real ones are not either once
    // their chunks ended.
    let forged = StageLent { token: lent[1].token, lease: 1, addr: 0, key: 0 }.encode();
    let f = encode_ctrl(CtrlType::StageLent, 4242, "stranger", &forged);
    assert!(p.ti.on_control(&mut p.init.cx(), &wire::decode_ctrl(&f).unwrap()));
    assert!(p.init.fakes.iter().all(|f| f.accepted().iter().all(|a| a.write)), "nothing read for a forged slot");
    std::thread::sleep(p.owner.core.cfg.timeout() * 4 + std::time::Duration::from_millis(50));
    p.to.advance(&mut p.owner.cx());
    assert!(p.to.idle(), "the leases ran out");
    assert_eq!(owner_pool(&p), 16, "every slot of the owner is back");
    p.ti.drop_peer(&mut p.init.cx(), 2, p.owner.core.engine_id);
    assert!(p.ti.idle());
}

#[test]
fn packed_staging_fails_without_the_captured_context() {
    in_mock_cuda("packed-noctx", "engine::transport::staging::tests::packed_noctx_child");
}

/// Rule 4's debug switch (NIXL_FABRIC_DEBUG_SKIP_CTX_APPLY=1, the seed bug): the
/// packed path's gather on the progress loop has no context and must fail, here and at
/// the owner, instead of moving bytes by luck.
#[test]
#[ignore = "run by packed_staging_fails_without_the_captured_context"]
fn packed_noctx_child() {
    if !mock_child() {
        return;
    }
    std::env::set_var("NIXL_FABRIC_DEBUG_SKIP_CTX_APPLY", "1");
    let mut p = pair();
    assert!(p.init.core.skip_ctx_apply);
    let (bl, span) = blocks(12);
    let (_ibuf, im, _idev, _ip) = device(&p.init, span as usize);
    let (_obuf, om, _odev, _op) = device(&p.owner, span as usize);
    let remote = remote_desc(&p, om.base, om.len, true);
    let req = planned(&p, Op::Write, &bl, &im, &remote);
    let s = p.start(&req);
    let mut pieces = p.init.pieces();
    for _ in 0..50 {
        p.ti.advance(&mut p.init.cx());
        pieces.extend(p.init.pieces());
    }
    assert!(s.pieces > 0 && pieces.len() == s.pieces, "every chunk ended");
    assert!(pieces.iter().all(|x| x.res.is_err()), "a gather without the context fails");
    // The owner's scatter, asked for directly, fails too and answers an error.
    let hostside = pattern(4096, 1);
    let st = Stage { token: 7, dir: StageDir::Pull, rail: 1, rrail: 1, peer_key: 3, ranges: vec![(om.base, hostside.as_ptr() as u64, 2048), (om.base + 8192, hostside.as_ptr() as u64 + 2048, 2048)] };
    let bytes = encode_ctrl(CtrlType::Stage, p.init.core.engine_id, "init", &st.encode());
    assert!(p.to.on_control(&mut p.owner.cx(), &wire::decode_ctrl(&bytes).unwrap()));
    spin(&mut p.owner, &mut p.to, 200, |b| !acks(b).is_empty());
    let a = acks(&p.owner);
    assert_eq!(a.len(), 1);
    assert_ne!(a[0].status, 0, "the owner's scatter without the context fails");
    assert!(p.to.idle());
}

#[test]
fn host_memory_with_a_peers_hmem_gpu_memory_on_a_bouncing_provider_is_moved_by_the_owner() {
    in_mock_cuda("hmem-owner", "engine::transport::staging::tests::hmem_owner_child");
}

/// Our host memory with a peer's FI_HMEM device memory over rails whose RMA from host
/// memory would bounce (shm's): planned as stage requests, which the owner serves with RMA
/// straight between its device memory and ours (a READ of the owner's memory for our WRITE,
/// a WRITE from it for our READ, also where it lends slots), with no slot and no device
/// copy on either side, under FI_EAGAIN storms; byte exact for scattered blocks. Rails that
/// do not bounce, or hmem_owner_rma=false, keep plain RMA.
#[test]
#[ignore = "run by host_memory_with_a_peers_hmem_gpu_memory_on_a_bouncing_provider_is_moved_by_the_owner"]
fn hmem_owner_child() {
    if !mock_child() {
        return;
    }
    let mut p = pair();
    let (bl, span) = blocks(60);
    let total: u64 = bl.iter().map(|b| b.2).sum();
    let (obuf, om, op) = device_hmem(&p.owner, span as usize);
    obuf.write(0, &vec![0u8; span as usize]).unwrap();
    let remote = hmem_desc(&p, om.base, om.len);
    let mut host = pattern(span as usize, 43);
    let hm = host_mem(&p.init, &mut host);
    for f in p.init.fakes.iter().chain(p.owner.fakes.iter()) {
        f.script(&[Answer::Accept, Answer::Again, Answer::Accept, Answer::Again]);
        f.storm(2);
    }
    let counters = |b: &Bench| b.core.counters.snapshot();
    let launches = |b: &Bench| { let c = counters(b); c.gpu_kernel_launches + c.gpu_copy_calls };
    let in_device = |a: &crate::engine::transport::fake::Accepted| a.segs.iter().all(|g| g.0 >= om.base && g.0 + g.1 as u64 <= om.base + om.len);

    // Rails that do not bounce, or the key off: plain RMA, as for any registered memory.
    for (bounce, key) in [(false, true), (true, false)] {
        let req = planned_on(&p, Op::Write, &bl, &hm, &remote, bounce, key);
        assert!(req.segs.iter().all(|s| matches!(s.kind, SegKind::Rma)), "{:?}", req.segs[0].kind);
    }

    // WRITE: the owner reads our host memory into its device memory. Its posts touch that
    // memory, so they need its context current (the driver's pass applies it): without it
    // (the seed bug) every chunk fails and the owner is left with nothing.
    let req = planned_on(&p, Op::Write, &bl, &hm, &remote, true, true);
    assert!(req.segs.iter().all(|s| matches!(s.kind, SegKind::HostToDev { owner_rma: true, .. })));
    let pieces = p.run(&req);
    assert!(pieces.iter().all(|x| x.res.is_err()), "posts without the context current fail");
    assert!(p.to.idle() && p.ti.idle());
    op.context().make_current().expect("the owner's context current, as its pass makes it");
    let (l0, o0) = (launches(&p.init) + launches(&p.owner), counters(&p.owner));
    let pieces = p.run(&req);
    assert!(pieces.iter().all(|x| x.res.is_ok()), "{:?}", pieces.iter().find_map(|x| x.res.as_ref().err()));
    assert_eq!(pieces.iter().map(|x| x.bytes).sum::<u64>(), total);
    let mut landed = vec![0u8; span as usize];
    obuf.read(0, &mut landed).unwrap();
    expect_blocks(&bl, &landed, &host, false, "DRAM->HMEM VRAM WRITE");
    assert_eq!(counters(&p.owner).stage_served - o0.stage_served, chunk_count(&p, &req) as u64, "one serve per chunk");
    assert_eq!(launches(&p.init) + launches(&p.owner), l0, "no device copy on either side");
    let owner_ops: Vec<_> = p.owner.fakes.iter().flat_map(|f| f.accepted()).collect();
    assert!(!owner_ops.is_empty() && owner_ops.iter().all(|a| !a.write && in_device(a)), "the owner's RMA are reads into its device memory");
    assert!(p.to.pool.is_none() && p.ti.pool.is_none(), "no bounce pool on either side");

    // READ, from an owner that lends slots: it still writes from its device memory to us.
    let lender = p.init.peer_lending(2, Locality::Remote, p.owner.core.engine_id);
    p.peer = lender;
    let remote = hmem_desc(&p, om.base, om.len);
    let back = pattern(span as usize, 47);
    obuf.write(0, &back).unwrap();
    let mut hback = vec![0u8; span as usize];
    let hbm = host_mem(&p.init, &mut hback);
    let req = planned_on(&p, Op::Read, &bl, &hbm, &remote, true, true);
    let before: Vec<usize> = p.owner.fakes.iter().map(|f| f.accepted().len()).collect();
    let pieces = p.run(&req);
    assert!(pieces.iter().all(|x| x.res.is_ok()), "{:?}", pieces.iter().find_map(|x| x.res.as_ref().err()));
    expect_blocks(&bl, &std::hint::black_box(&hback).clone(), &back, true, "DRAM<-HMEM VRAM READ");
    let owner_ops: Vec<_> = p.owner.fakes.iter().zip(&before).flat_map(|(f, &n)| f.accepted()[n..].to_vec()).collect();
    assert!(!owner_ops.is_empty() && owner_ops.iter().all(|a| a.write && in_device(a)), "the owner's RMA are writes from its device memory");
    assert!(p.to.pool.is_none() && p.to.idle() && p.ti.idle(), "nothing lent, nothing left");
    // An error completion for one of the owner's operations on every rail, and completions
    // coming newest first: those chunks fail (the owner answers with the error), the rest
    // land, and neither side keeps anything.
    std::hint::black_box(&mut hback).fill(0);
    p.owner.fakes.iter().for_each(|f| { f.fail_completions(1); f.disorder(true, 1); });
    let pieces = p.run(&req);
    let failed = pieces.iter().filter(|x| x.res.is_err()).count();
    assert!(failed > 0 && failed < pieces.len(), "{failed} of {} chunks failed", pieces.len());
    assert!(p.to.idle() && p.ti.idle());
    drop(om);
}

#[test]
fn direct_serves_of_a_disconnected_requester_end_unanswered() {
    in_mock_cuda("direct-gone", "engine::transport::staging::tests::direct_gone_child");
}

/// A requester goes while we serve its chunks of our FI_HMEM memory directly (the provider
/// refusing every read meanwhile): they end at once, unanswered, with no pool ever made;
/// another requester's direct serve goes on once the provider takes its read.
#[test]
#[ignore = "run by direct_serves_of_a_disconnected_requester_end_unanswered"]
fn direct_gone_child() {
    if !mock_child() {
        return;
    }
    let mut b = bench();
    let (buf, _m, p) = device_hmem(&b, 4 * CHUNK);
    p.context().make_current().expect("the owner's context current, as its pass makes it");
    let theirs = pattern(CHUNK, 9);
    requester(&mut b, 77);
    requester(&mut b, 78);
    let mut t = Staging::new(1, "test");
    b.fakes[0].refuse_all(true);
    for k in 0..4u64 {
        ask_pull(&mut b, &mut t, if k == 0 { 78 } else { 77 }, 200 + k, buf.addr() + k * CHUNK as u64, theirs.as_ptr() as u64);
    }
    t.advance(&mut b.cx());
    assert!(!t.idle() && t.serves.waiting.is_empty(), "direct serves wait for no slot");
    b.out.clear();
    t.drop_peer(&mut b.cx(), 2, 77);
    assert!(acks(&b).is_empty(), "nobody answers a gone requester");
    b.fakes[0].refuse_all(false);
    spin(&mut b, &mut t, 200, |b| !acks(b).is_empty());
    assert_eq!(acks(&b), vec![StageAck { token: 200, status: 0 }]);
    let mut landed = vec![0u8; CHUNK];
    buf.read(0, &mut landed).unwrap();
    assert!(landed == theirs, "78's bytes are in our device memory");
    assert!(t.idle() && t.pool.is_none(), "nothing left, and no bounce pool");
}
