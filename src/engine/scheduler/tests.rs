use super::*;
use crate::config::Config;
use crate::cuda;
use crate::engine::ipc_cache::IpcEntry;
use crate::engine::local_peers::{Locality, PidFd};
use crate::engine::peer::{Peer, RoutePair};
use crate::engine::registry::{LocalMem, MemKind, SharedCloseQueue};
use crate::engine::remote::RemoteMem;
use crate::engine::request::{Op, Route, SegKind};
use crate::engine::transport::cma::THIS_PROCESS;
use crate::engine::wire::{ConnInfo, IpcDesc, MemDesc, ProcessInfo, RailAddr};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

const ME: u64 = 0xabc;

/// Answers nothing, except a same-process registration where one is given.
struct Nothing(Option<Arc<LocalMem>>);

impl Reach for Nothing {
    fn same_process(&self, _: &Peer, _: u64, _: u64, _: MemKind) -> Option<Arc<LocalMem>> {
        self.0.clone()
    }
    fn ipc_open(&self, _: &Peer, _: &IpcDesc, _: Option<cuda::Context>) -> Option<Arc<IpcEntry>> {
        None
    }
    fn peer_copy_refused(&self, _: u64) -> bool {
        false
    }
    fn pin(&self, _: &LocalMem, _: &cuda::Context) {}
}

fn shapes(n: usize) -> Vec<RailShape> {
    (0..n).map(|_| RailShape { max_msg: 1 << 20, virt_addr: true, provider: "tcp".into(), order_saw: false, nic_shared: true, hmem_host_bounce: false }).collect()
}

fn mem(engine: u64, base: u64, len: u64, rails: usize) -> Arc<LocalMem> {
    let q = SharedCloseQueue::default();
    Arc::new(LocalMem::new(engine, base, len, MemKind::Dram, 0, rails, Vec::new(), q, None, None))
}

/// Device memory of ours at `base` (`staged`: the provider cannot register it), under a
/// context value the scheduler only carries along.
fn device_mem(base: u64, len: u64, rails: usize, staged: bool) -> Arc<LocalMem> {
    // SAFETY: a dangling handle that no CUDA call sees in these tests.
    let ctx = unsafe { cuda::Context::from_raw(0x1000 as *mut std::ffi::c_void) }.unwrap();
    let dev = crate::engine::gpu::DeviceMem { ctx, ordinal: 0, staged, managed: false };
    Arc::new(LocalMem::new(ME, base, len, MemKind::Vram, 0, rails, Vec::new(), SharedCloseQueue::default(), Some(dev), None))
}

fn peer(id: u64, rails: usize, local: Locality, cma: bool) -> Arc<Peer> {
    peer_of(id, rails, local, cma, false)
}

/// `peer`, of a build that takes eager writes or not.
fn peer_of(id: u64, rails: usize, local: Locality, cma: bool, eager_write: bool) -> Arc<Peer> {
    let info = ConnInfo {
        engine_id: 7000 + id,
        host_id: [1; 16],
        agent: format!("p{id}"),
        rails: (0..rails).map(|_| RailAddr { provider: "tcp".into(), addr: vec![0] }).collect(),
        process: Some(ProcessInfo { pid: std::process::id(), token_addr: 0, token: [0; 16] }),
        rail0_saw: true,
        packed_staging: true,
        eager_write,
        lends: true,
    };
    let route = (0..rails).map(|i| RoutePair { rail: i as u16, rrail: i as u16, virt: None }).collect();
    Arc::new(Peer::new(id, &format!("p{id}"), info, Vec::new(), route, true, cma, local))
}

fn remote(p: &Arc<Peer>, base: u64, len: u64, rails: usize) -> Arc<RemoteMem> {
    let desc = MemDesc { mem_type: 0, virt_addr: true, staged: false, engine_id: p.info.engine_id, base, len, dev_id: 0, keys: (0..rails as u64).map(|k| 100 + k).collect(), ipc: None };
    Arc::new(RemoteMem::Peer { peer: p.clone(), desc, opened: Mutex::new(Vec::new()) })
}

/// Our host registration at 0x1000_0000 and a same-process peer's at 0x9000_0000 (its
/// engine's registration, our view of it), both `len` bytes, and the peer as a target.
fn same_process_pair(len: u64) -> (Arc<LocalMem>, Arc<LocalMem>, Arc<RemoteMem>, Target) {
    let sp = peer(2, 1, Locality::SameProcess(std::sync::Weak::new()), false);
    let r = remote(&sp, 0x9000_0000, len, 1);
    (mem(ME, 0x1000_0000, len, 1), mem(7002, 0x9000_0000, len, 1), r, Target::Peer(sp))
}

fn run(cfg: &Config, rails: usize, target: &Target, pairs: &[Pair], reach: &dyn Reach) -> Result<Plan> {
    run_on(1, cfg, rails, target, pairs, reach)
}

/// `run` with up to `threads` planning threads.
fn run_on(threads: usize, cfg: &Config, rails: usize, target: &Target, pairs: &[Pair], reach: &dyn Reach) -> Result<Plan> {
    let sh = shapes(rails);
    let rr = AtomicUsize::new(0);
    plan(&Inputs { engine_id: ME, op: Op::Write, cfg, shapes: &sh, rr_base: 0, rr_chunks: &rr, timed: false, plan_threads: threads, staged_chunk: 0 }, target, pairs, reach)
}

#[test]
fn large_descriptors_stripe_over_every_rail_and_small_ones_run_contiguously() {
    let mut cfg = Config::defaults();
    cfg.striping_threshold = 1 << 20;
    let p = peer(1, 2, Locality::Remote, false);
    let l = mem(ME, 0x10_0000, 64 << 20, 2);
    let r = remote(&p, 0x900_0000, 64 << 20, 2);
    let big = [Pair { local: (0x10_0000, 4 << 20, &l), remote: (0x900_0000, 4 << 20, &r) }];
    let plan = run(&cfg, 2, &Target::Peer(p.clone()), &big, &Nothing(None)).unwrap();
    // 4 MiB over two rails: 2 MiB each, cut at the 1 MiB message limit.
    assert_eq!(plan.segs.len(), 4);
    assert_eq!(plan.segs.iter().map(|s| s.rail).collect::<Vec<_>>(), vec![0, 0, 1, 1]);
    assert_eq!(plan.segs.iter().map(|s| s.len).sum::<u64>(), 4 << 20);
    assert!(plan.segs.iter().all(|s| matches!(s.kind, SegKind::Rma) && s.rkey == 100 + s.rrail as u64));
    assert_eq!(plan.segs[2].local, 0x10_0000 + (2 << 20));
    assert_eq!(plan.segs[2].raddr, 0x900_0000 + (2 << 20));
    // Reversed on the remote side, so that no two descriptors continue each other.
    let small: Vec<Pair> = (0..8u64).map(|i| Pair { local: (0x10_0000 + i * 4096, 4096, &l), remote: (0x900_0000 + (7 - i) * 4096, 4096, &r) }).collect();
    let plan = run(&cfg, 2, &Target::Peer(p), &small, &Nothing(None)).unwrap();
    assert_eq!(plan.segs.iter().map(|s| s.rail).collect::<Vec<_>>(), vec![0, 0, 0, 0, 1, 1, 1, 1]);
}

#[test]
fn rma_rail0_off_keeps_bulk_data_off_the_control_pair_but_not_small_requests() {
    let mut cfg = Config::defaults();
    cfg.striping_threshold = 1 << 20;
    cfg.rma_rail0 = false;
    let p = peer(1, 3, Locality::Remote, false);
    let l = mem(ME, 0x10_0000, 64 << 20, 3);
    let r = remote(&p, 0x900_0000, 64 << 20, 3);
    let big = [Pair { local: (0x10_0000, 4 << 20, &l), remote: (0x900_0000, 4 << 20, &r) }];
    let plan = run(&cfg, 3, &Target::Peer(p.clone()), &big, &Nothing(None)).unwrap();
    assert_eq!(plan.segs.iter().map(|s| (s.rail, s.rrail)).collect::<Vec<_>>(), vec![(1, 1), (1, 1), (2, 2), (2, 2)]);
    assert!(plan.segs.iter().all(|s| s.rkey == 100 + s.rrail as u64));
    // Runs of small descriptors take the two bulk pairs in turn too.
    let many: Vec<Pair> = (0..64u64).map(|i| Pair { local: (0x10_0000 + i * 8192, 4096, &l), remote: (0x900_0000 + (63 - i) * 8192, 4096, &r) }).collect();
    let plan = run(&cfg, 3, &Target::Peer(p.clone()), &many, &Nothing(None)).unwrap();
    assert!(plan.segs.iter().all(|s| s.rail != 0 && s.rrail != 0));
    assert!(plan.segs.iter().any(|s| s.rail == 1) && plan.segs.iter().any(|s| s.rail == 2));
    // Rails on interfaces of their own (verbs, efa, an iface list): rail 0's interface
    // would idle, so every rail carries data.
    let mut own = shapes(3);
    own.iter_mut().for_each(|s| s.nic_shared = false);
    let rr = AtomicUsize::new(0);
    let plan = super::plan(&Inputs { engine_id: ME, op: Op::Write, cfg: &cfg, shapes: &own, rr_base: 0, rr_chunks: &rr, timed: false, plan_threads: 1, staged_chunk: 0 }, &Target::Peer(p.clone()), &big[..], &Nothing(None)).unwrap();
    assert!(plan.segs.iter().any(|s| s.rail == 0) && plan.segs.iter().any(|s| s.rail == 2));
    // Two rails: one pair off rail 0 would halve the bandwidth, so both carry data.
    let p2 = peer(2, 2, Locality::Remote, false);
    let r2 = remote(&p2, 0x900_0000, 64 << 20, 2);
    let big2 = [Pair { local: (0x10_0000, 4 << 20, &l), remote: (0x900_0000, 4 << 20, &r2) }];
    let plan = run(&cfg, 2, &Target::Peer(p2), &big2, &Nothing(None)).unwrap();
    assert_eq!(plan.segs.iter().map(|s| s.rail).collect::<Vec<_>>(), vec![0, 0, 1, 1]);
}

#[test]
fn adjacent_blocks_of_one_registration_pair_join_into_one_range_per_rail() {
    let mut cfg = Config::defaults();
    cfg.striping_threshold = 1 << 20;
    let p = peer(1, 1, Locality::Remote, false);
    let p2 = peer(2, 2, Locality::Remote, false);
    let l = mem(ME, 0x10_0000, 64 << 20, 2);
    let r = remote(&p, 0x900_0000, 64 << 20, 1);
    let rr = remote(&p2, 0x900_0000, 64 << 20, 2);
    // 8 adjacent blocks, then a gap on the remote side, then 2 more adjacent ones.
    let mut pairs: Vec<Pair> = (0..8u64).map(|i| Pair { local: (0x10_0000 + i * 4096, 4096, &l), remote: (0x900_0000 + i * 4096, 4096, &r) }).collect();
    pairs.extend((8..10u64).map(|i| Pair { local: (0x10_0000 + i * 4096, 4096, &l), remote: (0x900_0000 + (i + 1) * 4096, 4096, &r) }));
    let plan = run(&cfg, 1, &Target::Peer(p.clone()), &pairs, &Nothing(None)).unwrap();
    assert_eq!(plan.segs.iter().map(|s| (s.local, s.len, s.raddr)).collect::<Vec<_>>(),
               vec![(0x10_0000, 8 * 4096, 0x900_0000), (0x10_0000 + 8 * 4096, 2 * 4096, 0x900_0000 + 9 * 4096)]);
    // Over two rails each rail's run is one range; never past the provider's message limit.
    let two: Vec<Pair> = (0..8u64).map(|i| Pair { local: (0x10_0000 + i * 4096, 4096, &l), remote: (0x900_0000 + i * 4096, 4096, &rr) }).collect();
    let plan = run(&cfg, 2, &Target::Peer(p2), &two, &Nothing(None)).unwrap();
    assert_eq!(plan.segs.iter().map(|s| (s.rail, s.len)).collect::<Vec<_>>(), vec![(0, 4 * 4096), (1, 4 * 4096)]);
    let many: Vec<Pair> = (0..512u64).map(|i| Pair { local: (0x10_0000 + i * 4096, 4096, &l), remote: (0x900_0000 + i * 4096, 4096, &r) }).collect();
    let plan = run(&cfg, 1, &Target::Peer(p.clone()), &many, &Nothing(None)).unwrap();
    assert_eq!(plan.segs.iter().map(|s| s.len).collect::<Vec<_>>(), vec![1 << 20, 1 << 20], "cut at max_msg (1 MiB here)");
    // Two registrations that happen to be adjacent stay two ranges.
    let l2 = mem(ME, 0x10_0000 + (64 << 20), 1 << 20, 2);
    let r2 = remote(&p, 0x900_0000 + (64 << 20), 1 << 20, 1);
    let edge = [Pair { local: (0x10_0000 + (64 << 20) - 4096, 4096, &l), remote: (0x900_0000 + (64 << 20) - 4096, 4096, &r) },
                Pair { local: (0x10_0000 + (64 << 20), 4096, &l2), remote: (0x900_0000 + (64 << 20), 4096, &r2) }];
    assert_eq!(run(&cfg, 1, &Target::Peer(p.clone()), &edge, &Nothing(None)).unwrap().segs.len(), 2);
    // ... also where an empty descriptor of the second pair comes between them.
    let empty = Pair { local: (0x10_0000 + (64 << 20), 0, &l2), remote: (0x900_0000 + (64 << 20), 0, &r2) };
    let gap = [edge[0], empty, edge[1]];
    assert_eq!(run(&cfg, 1, &Target::Peer(p), &gap, &Nothing(None)).unwrap().segs.len(), 2);
}

#[test]
fn small_host_writes_to_a_peer_that_takes_puts_go_in_a_control_message() {
    let cfg = Config::defaults();
    let p = peer_of(1, 2, Locality::Remote, false, true);
    let old = peer(2, 2, Locality::Remote, false);
    let l = mem(ME, 0x10_0000, 1 << 20, 2);
    let (r, r_old) = (remote(&p, 0x900_0000, 1 << 20, 2), remote(&old, 0x900_0000, 1 << 20, 2));
    // n blocks of bs bytes, landing in reverse order (no two join).
    let plan_of = |op: Op, target: &Arc<Peer>, r: &Arc<RemoteMem>, n: u64, bs: u64| {
        let ps: Vec<Pair> = (0..n).map(|i| Pair { local: (0x10_0000 + i * bs, bs, &l), remote: (0x900_0000 + (n - i) * bs, bs, r) }).collect();
        let sh = shapes(2);
        let rr = AtomicUsize::new(0);
        plan(&Inputs { engine_id: ME, op, cfg: &cfg, shapes: &sh, rr_base: 0, rr_chunks: &rr, timed: false, plan_threads: 1, staged_chunk: 0 }, &Target::Peer(target.clone()), &ps[..], &Nothing(None)).unwrap()
    };
    let kinds = |pl: &Plan| pl.segs.iter().map(|s| s.kind.route()).collect::<Vec<_>>();
    // Two 4 KiB blocks: Puts naming the peer's address and its rail-0 key.
    let pl = plan_of(Op::Write, &p, &r, 2, 4096);
    assert_eq!(kinds(&pl), vec![Route::Eager, Route::Eager]);
    assert_eq!(pl.segs.iter().map(|s| (s.raddr, s.rkey)).collect::<Vec<_>>(), vec![(0x900_0000 + 2 * 4096, 100), (0x900_0000 + 4096, 100)]);
    assert!(pl.sum.on_rails, "the peer's progress matters: it is kicked");
    // Past eager_write_bytes, a READ, or a peer of an older build: RMA.
    assert!(kinds(&plan_of(Op::Write, &p, &r, 3, 4096)).iter().all(|k| *k == Route::Rma));
    assert!(kinds(&plan_of(Op::Read, &p, &r, 2, 4096)).iter().all(|k| *k == Route::Rma));
    assert!(kinds(&plan_of(Op::Write, &old, &r_old, 2, 4096)).iter().all(|k| *k == Route::Rma));
}

#[test]
fn small_requests_stay_on_rail_0_where_it_orders_a_notification_behind_data() {
    // Bulk requests take every rail here (the rule's other half is below).
    let mut cfg = Config::defaults();
    cfg.rma_rail0 = true;
    let p = peer(1, 4, Locality::Remote, false);
    let l = mem(ME, 0x10_0000, 64 << 20, 4);
    let r = remote(&p, 0x900_0000, 64 << 20, 4);
    let blocks = |n: u64, len: u64| -> Vec<Pair> { (0..n).map(|i| Pair { local: (0x10_0000 + i * len, len, &l), remote: (0x900_0000 + i * len, len, &r) }).collect() };
    let rails_of = |plan: &Plan| plan.segs.iter().map(|s| (s.rail, s.rrail)).collect::<Vec<_>>();
    let plan_at = |sh: &[RailShape], rr: usize, pairs: &[Pair]| {
        let chunks = AtomicUsize::new(0);
        plan(&Inputs { engine_id: ME, op: Op::Write, cfg: &cfg, shapes: sh, rr_base: rr, rr_chunks: &chunks, timed: false, plan_threads: 1, staged_chunk: 0 }, &Target::Peer(p.clone()), pairs, &Nothing(None)).unwrap()
    };
    let mut ordered = shapes(4);
    ordered[0].order_saw = true;
    // 4 KiB and 16 x 4 KiB (64 KiB, notif_rail0_bytes) whatever the round-robin turn.
    for rr in 0..4 {
        assert_eq!(rails_of(&plan_at(&ordered, rr, &blocks(1, 4096))), vec![(0, 0)], "turn {rr}");
        assert!(rails_of(&plan_at(&ordered, rr, &blocks(16, 4096))).iter().all(|&x| x == (0, 0)), "turn {rr}");
    }
    // One byte more, or rail 0 without the order, or the key at 0: round-robin.
    assert_eq!(rails_of(&plan_at(&ordered, 1, &blocks(1, (64 << 10) + 1))), vec![(1, 1)]);
    assert_eq!(rails_of(&plan_at(&shapes(4), 1, &blocks(1, 4096))), vec![(1, 1)]);
    let mut off = cfg.clone();
    off.notif_rail0_bytes = 0;
    let chunks = AtomicUsize::new(0);
    let plan = plan(&Inputs { engine_id: ME, op: Op::Write, cfg: &off, shapes: &ordered, rr_base: 2, rr_chunks: &chunks, timed: false, plan_threads: 1, staged_chunk: 0 }, &Target::Peer(p.clone()), &blocks(1, 4096)[..], &Nothing(None)).unwrap();
    assert_eq!(rails_of(&plan), vec![(2, 2)]);
    // rma_rail0 off: the small ones still stay on rail 0; the larger ones skip it.
    let mut bulk_off = cfg.clone();
    bulk_off.rma_rail0 = false;
    for rr in 0..4 {
        let at = |pairs: &[Pair]| {
            let chunks = AtomicUsize::new(0);
            rails_of(&super::plan(&Inputs { engine_id: ME, op: Op::Write, cfg: &bulk_off, shapes: &ordered, rr_base: rr, rr_chunks: &chunks, timed: false, plan_threads: 1, staged_chunk: 0 }, &Target::Peer(p.clone()), pairs, &Nothing(None)).unwrap())
        };
        assert_eq!(at(&blocks(1, 4096)), vec![(0, 0)], "turn {rr}");
        assert!(at(&blocks(32, 4096)).iter().all(|&(a, b)| a != 0 && b != 0), "turn {rr}");
    }
}

#[test]
fn provider_registered_device_memory_marks_the_plan_one_segment_per_operation() {
    let cfg = Config::defaults();
    let p = peer(1, 2, Locality::Remote, false);
    let r = remote(&p, 0x900_0000, 8 << 20, 2);
    let vram = device_mem(0x10_0000, 8 << 20, 2, false);
    let dram = Arc::new(LocalMem::new(ME, 0x10_0000, 8 << 20, MemKind::Dram, 0, 2, Vec::new(), SharedCloseQueue::default(), None, None));
    for (l, device) in [(&vram, true), (&dram, false)] {
        let pairs: Vec<Pair> = (0..4).map(|i| Pair { local: (0x10_0000 + i * 8192, 4096, l), remote: (0x900_0000 + i * 8192, 4096, &r) }).collect();
        let plan = run(&cfg, 2, &Target::Peer(p.clone()), &pairs, &Nothing(None)).unwrap();
        assert!(plan.segs.iter().all(|s| matches!(s.kind, SegKind::Rma)));
        assert_eq!(plan.sum.device_rma, device, "device memory {device}");
    }
}

#[test]
fn staged_device_memory_is_cut_into_chunks_over_the_route() {
    let mut cfg = Config::defaults();
    cfg.staging_chunk_size = 1 << 20;
    let p = peer(1, 2, Locality::Remote, false);
    let r = remote(&p, 0x900_0000, 8 << 20, 2);
    let l = device_mem(0x10_0000, 8 << 20, 2, true);
    let pairs = [Pair { local: (0x10_0000, 3 << 20, &l), remote: (0x900_0000, 3 << 20, &r) }];
    let mut on = cfg.clone();
    on.staging_rail0 = true;
    let plan = run(&on, 2, &Target::Peer(p.clone()), &pairs, &Nothing(None)).unwrap();
    assert_eq!(plan.segs.len(), 3);
    assert!(plan.segs.iter().all(|s| matches!(s.kind, SegKind::DevToHost { .. }) && s.len == 1 << 20));
    assert_eq!(plan.segs.iter().map(|s| s.rail).collect::<Vec<_>>(), vec![0, 1, 0], "chunks round-robin over the rail pairs");
    // staging_rail0 off: rail 0 keeps only control traffic where another pair exists.
    let mut off = cfg.clone();
    off.staging_rail0 = false;
    let p3 = peer(1, 3, Locality::Remote, false);
    let r3 = remote(&p3, 0x900_0000, 8 << 20, 3);
    let l3 = device_mem(0x10_0000, 8 << 20, 3, true);
    let pairs3 = [Pair { local: (0x10_0000, 4 << 20, &l3), remote: (0x900_0000, 4 << 20, &r3) }];
    let plan = run(&off, 3, &Target::Peer(p3), &pairs3, &Nothing(None)).unwrap();
    assert_eq!(plan.segs.iter().map(|s| (s.rail, s.rrail)).collect::<Vec<_>>(), vec![(1, 1), (2, 2), (1, 1), (2, 2)]);
    let plan = run(&off, 2, &Target::Peer(p.clone()), &pairs, &Nothing(None)).unwrap();
    assert_eq!(plan.segs.iter().map(|s| s.rail).collect::<Vec<_>>(), vec![0, 1, 0], "two rails: rail 0 carries chunks too");
    // A peer of a build before packed staging reads none of our stage requests: refused
    // at once with the reason, not left to time out chunk by chunk.
    let mut info = p.info.clone();
    info.packed_staging = false;
    let old = Arc::new(Peer::new(1, "p1", info, Vec::new(), p.route.clone(), false, false, Locality::Remote));
    let r = remote(&old, 0x900_0000, 8 << 20, 2);
    let pairs = [Pair { local: (0x10_0000, 3 << 20, &l), remote: (0x900_0000, 3 << 20, &r) }];
    match run(&cfg, 2, &Target::Peer(old), &pairs, &Nothing(None)) {
        Err(Error::Mismatch(m)) => assert!(m.contains("older nixl-fabric"), "{m}"),
        other => panic!("expected a mismatch, got {:?}", other.map(|p| p.segs.len())),
    }
}

#[test]
fn staging_balance_evens_a_requests_chunks_out_over_the_rails() {
    // Six rails, chunks off rail 0: five pairs. 1024 blocks of 16 KiB (16 MiB) in 1 MiB
    // chunks are 16 chunks, four on one pair; evened out, 20 chunks of 832 KiB, four a pair.
    let mut cfg = Config::defaults();
    cfg.staging_chunk_size = 1 << 20;
    cfg.staging_rail0 = false;
    let p = peer(1, 6, Locality::Remote, false);
    let r = remote(&p, 0x4000_0000, 64 << 20, 6);
    let l = device_mem(0x1000_0000, 64 << 20, 6, true);
    // Every other slot on each side (no two blocks continue each other).
    let pairs: Vec<Pair> = (0..1024u64).map(|i| Pair { local: (0x1000_0000 + i * 32768, 16384, &l), remote: (0x4000_0000 + i * 32768, 16384, &r) }).collect();
    let per_pair = |plan: &Plan| {
        let mut bytes = std::collections::BTreeMap::new();
        let mut chunks = std::collections::BTreeMap::new();
        let mut last = None;
        for s in &plan.segs {
            *bytes.entry((s.rail, s.rrail)).or_insert(0u64) += s.len;
            if last != Some((s.rail, s.rrail)) {
                *chunks.entry((s.rail, s.rrail)).or_insert(0u32) += 1;
            }
            last = Some((s.rail, s.rrail));
        }
        (bytes, chunks)
    };
    let fixed = run(&cfg, 6, &Target::Peer(p.clone()), &pairs, &Nothing(None)).unwrap();
    let (bytes, chunks) = per_pair(&fixed);
    assert_eq!(bytes.len(), 5, "five pairs, none on rail 0: {bytes:?}");
    assert_eq!(bytes.values().max(), Some(&(4 << 20)));
    assert_eq!(chunks.values().sum::<u32>(), 16);
    cfg.staging_balance = true;
    let even = run(&cfg, 6, &Target::Peer(p.clone()), &pairs, &Nothing(None)).unwrap();
    let (bytes, chunks) = per_pair(&even);
    assert_eq!(bytes.values().sum::<u64>(), 16 << 20);
    assert_eq!(bytes.values().max(), Some(&(4 * (832 << 10))), "{bytes:?}");
    assert!(chunks.values().all(|&n| n == 4), "{chunks:?}");
    // Every block once, in order, whole or cut at a chunk's end.
    let mut at = 0x1000_0000u64;
    let mut left = 16384u64;
    for s in &even.segs {
        assert_eq!(s.local, at);
        assert!(s.len <= left);
        left -= s.len;
        at += s.len;
        if left == 0 {
            at += 16384;
            left = 16384;
        }
    }
    assert_eq!(at, 0x1000_0000 + 1024 * 32768);
    // 64 chunks over five pairs are 13 at most on one, within 5 % of the mean: kept.
    let big: Vec<Pair> = (0..256u64).map(|i| Pair { local: (0x1000_0000 + i * 262144, 262144, &l), remote: (0x4000_0000 + i * 262144, 262144, &r) }).collect();
    let plan = run(&cfg, 6, &Target::Peer(p), &big, &Nothing(None)).unwrap();
    assert!(plan.segs.iter().all(|s| s.len == 262144));
}

#[test]
fn loopback_same_process_and_cma_routes() {
    let cfg = Config::defaults();
    let l = mem(ME, 0x10_0000, 16 << 20, 1);
    let own = Arc::new(RemoteMem::Local(mem(ME, 0x800_0000, 16 << 20, 1)));
    let pairs = [Pair { local: (0x10_0000, 4096, &l), remote: (0x800_0000, 4096, &own) }];
    let plan = run(&cfg, 1, &Target::Local, &pairs, &Nothing(None)).unwrap();
    assert!(matches!(plan.segs[0].kind, SegKind::Loopback { local: None, remote: None }));
    // An engine of this process: small host copies are direct, a large request goes
    // to the copy threads.
    let sp = peer(2, 1, Locality::SameProcess(std::sync::Weak::new()), false);
    let theirs = mem(7002, 0x900_0000, 16 << 20, 1);
    let r = remote(&sp, 0x900_0000, 16 << 20, 1);
    let small = [Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000, 4096, &r) }];
    let plan = run(&cfg, 1, &Target::Peer(sp.clone()), &small, &Nothing(Some(theirs.clone()))).unwrap();
    assert!(matches!(plan.segs[0].kind, SegKind::Direct { ctx: None, dev: false }));
    assert_eq!(plan.keeps.len(), 1);
    let large = [Pair { local: (0x10_0000, 4 << 20, &l), remote: (0x900_0000, 4 << 20, &r) }];
    let plan = run(&cfg, 1, &Target::Peer(sp), &large, &Nothing(Some(theirs))).unwrap();
    assert!(matches!(plan.segs[0].kind, SegKind::Cma { pid: THIS_PROCESS }));
    // A process of this host reachable by CMA, watched by its pidfd.
    let hp = peer(3, 1, Locality::SameHost(PidFd::open(std::process::id())), true);
    let r = remote(&hp, 0x900_0000, 16 << 20, 1);
    let pairs = [Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000, 4096, &r) }];
    let plan = run(&cfg, 1, &Target::Peer(hp), &pairs, &Nothing(None)).unwrap();
    assert!(matches!(plan.segs[0].kind, SegKind::Cma { pid } if pid == std::process::id()));
}

#[test]
fn same_process_host_copies_pool_by_the_request_total_whatever_the_first_block_guessed() {
    let cfg = Config::defaults();
    let (l, theirs, r, t) = same_process_pair(64 << 20);
    // (offset, length) per descriptor, both sides at the same offsets, 512 of them
    let plan_of = |lens: &dyn Fn(u64) -> u64| {
        let mut off = 0;
        let pairs: Vec<Pair> = (0..512).map(|i| {
            let n = lens(i);
            let p = Pair { local: (0x1000_0000 + off, n, &l), remote: (0x9000_0000 + off, n, &r) };
            off += n + 64; // gaps: no two blocks join
            p
        }).collect();
        run(&cfg, 1, &t, &pairs, &Nothing(Some(theirs.clone()))).unwrap()
    };
    let pooled = |p: &Plan| p.segs.iter().all(|s| matches!(s.kind, SegKind::Cma { pid: THIS_PROCESS }));
    let direct = |p: &Plan| p.segs.iter().all(|s| matches!(s.kind, SegKind::Direct { ctx: None, dev: false }));
    // Right guesses: 512 x 8 KiB (4 MiB) pooled, 512 x 1 KiB (512 KiB) copied where posted.
    assert!(pooled(&plan_of(&|_| 8192)));
    assert!(direct(&plan_of(&|_| 1024)));
    // Wrong guesses, corrected: a small first block before large ones, a large first one
    // before small ones.
    let p = plan_of(&|i| if i == 0 { 16 } else { 8192 });
    assert!(pooled(&p) && p.sum.bytes == 16 + 511 * 8192);
    let p = plan_of(&|i| if i == 0 { 8192 } else { 16 });
    assert!(direct(&p) && p.sum.bytes == 8192 + 511 * 16);
    assert!(p.sum.local_copies && !p.sum.on_rails);
    // A peer over the rails: the summary says so.
    let rp = peer(3, 1, Locality::Remote, false);
    let rr = remote(&rp, 0x9000_0000, 64 << 20, 1);
    let pairs = [Pair { local: (0x1000_0000, 4096, &l), remote: (0x9000_0000, 4096, &rr) }];
    let p = run(&cfg, 1, &Target::Peer(rp), &pairs, &Nothing(None)).unwrap();
    assert!(p.sum.on_rails && !p.sum.local_copies && p.sum.bytes == 4096);
}

#[test]
fn a_long_request_planned_in_parts_is_the_plan_of_one_thread() {
    let cfg = Config::defaults();
    let n = 40_000u64;
    let p = peer(1, 2, Locality::Remote, false);
    let ls = [mem(ME, 0x1000_0000, 256 << 20, 2), mem(ME, 0x2000_0000, 256 << 20, 2)];
    let rs = [remote(&p, 0x9000_0000, 256 << 20, 2), remote(&p, 0xa000_0000, 256 << 20, 2)];
    // Runs of 3000 descriptors over the registration pairs in turn; remote blocks in a
    // fixed shuffled order, so that none join and both plans must be equal segment by
    // segment.
    let pairs: Vec<Pair> = (0..n).map(|i| {
        let (l, r) = (&ls[(i / 3000 % 2) as usize], &rs[(i / 7000 % 2) as usize]);
        Pair { local: (l.base + i * 4096, 4096, l), remote: (r.range().0 + (i * 7919 % n) * 4096, 4096, r) }
    }).collect();
    let t = Target::Peer(p.clone());
    let one = run_on(1, &cfg, 2, &t, &pairs, &Nothing(None)).unwrap();
    let four = run_on(4, &cfg, 2, &t, &pairs, &Nothing(None)).unwrap();
    let key = |pl: &Plan| pl.segs.iter().map(|s| (s.local, s.len, s.raddr, s.rkey, s.rail, s.rrail)).collect::<Vec<_>>();
    assert_eq!(one.segs.len(), n as usize);
    assert_eq!(key(&one), key(&four));
    assert_eq!((one.sum.bytes, one.sum.on_rails, one.sum.local_copies), (four.sum.bytes, four.sum.on_rails, four.sum.local_copies));
    assert_eq!((four.locals.len(), four.remotes.len()), (2, 2), "each registration held once");
    assert_eq!((one.parts, four.parts), (1, 4));
    assert!(four.ways >= one.ways);
    // A bad descriptor is named by its place in the whole list, in the first part and in
    // a later one (the first failing part names the error).
    for at in [3, 35_001] {
        let mut bad = pairs.clone();
        bad[at].local.1 = 8192;
        let e = run_on(4, &cfg, 2, &t, &bad, &Nothing(None)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(&format!("descriptor {at}:")), "{e}");
    }
    let mut bad = pairs.clone();
    bad[39_000].local.1 = 8192;
    bad[16_000].local.1 = 8192;
    let e = run_on(4, &cfg, 2, &t, &bad, &Nothing(None)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("descriptor 16000:"), "{e}");
    // Adjacent blocks join within a part, not across its edge.
    let adj: Vec<Pair> = (0..32_768u64).map(|i| Pair { local: (0x1000_0000 + i * 4096, 4096, &ls[0]), remote: (0x9000_0000 + i * 4096, 4096, &rs[0]) }).collect();
    let one = run_on(1, &cfg, 2, &t, &adj, &Nothing(None)).unwrap();
    let four = run_on(4, &cfg, 2, &t, &adj, &Nothing(None)).unwrap();
    assert_eq!(four.sum.bytes, 32_768 * 4096);
    assert!(four.segs.len() >= one.segs.len() && four.segs.len() <= one.segs.len() + 3, "{} vs {}", four.segs.len(), one.segs.len());
    assert_eq!(four.segs.iter().map(|s| s.len).sum::<u64>(), 32_768 * 4096);
}

#[test]
fn parts_settle_same_process_host_copies_by_the_whole_request() {
    let cfg = Config::defaults();
    let (l, theirs, r, t) = same_process_pair(512 << 20);
    // Each part's first block guesses small (16 B x count < 2 MiB would stay direct), the
    // whole request is 32768 x ~8 KiB: every part's copies go to the pool.
    let mut off = 0;
    let pairs: Vec<Pair> = (0..32_768u64).map(|i| {
        let len = if i % 8192 == 0 { 16 } else { 8192 };
        let p = Pair { local: (0x1000_0000 + off, len, &l), remote: (0x9000_0000 + off, len, &r) };
        off += len + 64;
        p
    }).collect();
    let four = run_on(4, &cfg, 1, &t, &pairs, &Nothing(Some(theirs.clone()))).unwrap();
    assert!(four.segs.iter().all(|s| matches!(s.kind, SegKind::Cma { pid: THIS_PROCESS })));
    assert_eq!(four.keeps.len(), 1, "the peer's registration kept once");
    assert!(four.sum.local_copies && !four.sum.on_rails);
}

#[test]
fn bad_descriptors_are_refused_with_what_is_wrong() {
    let cfg = Config::defaults();
    let p = peer(1, 1, Locality::Remote, false);
    let other = peer(2, 1, Locality::Remote, false);
    let l = mem(ME, 0x10_0000, 1 << 20, 1);
    let foreign = mem(ME + 1, 0x10_0000, 1 << 20, 1);
    let r = remote(&p, 0x900_0000, 1 << 20, 1);
    let r2 = remote(&other, 0x900_0000, 1 << 20, 1);
    let t = Target::Peer(p.clone());
    let err = |pairs: &[Pair], t: &Target| run(&cfg, 1, t, pairs, &Nothing(None)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(&[], &t).contains("no descriptors"));
    assert!(err(&[Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000, 8192, &r) }], &t).contains("length"));
    assert!(err(&[Pair { local: (0x10_0000 + (1 << 20), 1, &l), remote: (0x900_0000, 1, &r) }], &t).contains("outside"));
    assert!(err(&[Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000 + (1 << 20) - 1, 4096, &r) }], &t).contains("outside"));
    assert!(err(&[Pair { local: (0x10_0000, 4096, &foreign), remote: (0x900_0000, 4096, &r) }], &t).contains("another engine"));
    assert!(err(&[Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000, 4096, &r2) }], &t).contains("belongs to agent 'p2'"));
    assert!(err(&[Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000, 4096, &r) }], &Target::Local).contains("loopback"));
}
