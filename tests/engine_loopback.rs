//! Two engines in one process over real providers: the engine's core paths end to end.
use nixl_fabric::config::Config;
use nixl_fabric::engine::{Engine, MemKind, Op, Pair};
use nixl_fabric::error::Status;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn cfg(provider: &str, thread: bool) -> Config {
    let mut c = Config::defaults();
    c.set("provider", provider).unwrap();
    if provider != "shm" {
        c.set("iface", "lo").unwrap();
    }
    c.set("progress_thread", if thread { "true" } else { "false" }).unwrap();
    c.set("same_host_shm", "false").unwrap();
    c
}

fn wait(e: &[&Arc<Engine>], req: &Arc<nixl_fabric::engine::Request>) -> Status {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = e[0].check(req);
        if s != Status::NF_IN_PROG {
            return s;
        }
        for x in &e[1..] {
            x.progress();
        }
        assert!(Instant::now() < deadline, "transfer did not finish");
    }
}

/// Two engines of this process, each knowing the other.
fn connected_pair(c: nixl_fabric::config::Config) -> (Arc<Engine>, Arc<Engine>) {
    let a = Engine::new("a", c.clone()).unwrap();
    let b = Engine::new("b", c).unwrap();
    a.load_conn_info("b", b.conn_info()).unwrap();
    b.load_conn_info("a", a.conn_info()).unwrap();
    (a, b)
}

fn round_trip(provider: &str, thread: bool, size: usize) {
    nixl_fabric::logging::init();
    let a = Engine::new("a", cfg(provider, thread)).unwrap();
    let b = Engine::new("b", cfg(provider, thread)).unwrap();
    a.load_conn_info("b", b.conn_info()).unwrap();
    b.load_conn_info("a", a.conn_info()).unwrap();
    let src: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
    let mut dst = vec![0u8; size];
    let ms = a.register(src.as_ptr() as u64, size as u64, MemKind::Dram, 0).unwrap();
    let md = b.register(dst.as_mut_ptr() as u64, size as u64, MemKind::Dram, 0).unwrap();
    let rd = a.load_remote("b", &b.public_data(&md).unwrap()).unwrap();
    let pairs = [Pair { local: (src.as_ptr() as u64, size as u64, &ms), remote: (dst.as_ptr() as u64, size as u64, &rd) }];
    let req = a.prepare(Op::Write, &pairs, "b").unwrap();
    let s = a.post(&req, Some(b"done".to_vec())).unwrap();
    let s = if s == Status::NF_IN_PROG { wait(&[&a, &b], &req) } else { s };
    assert_eq!(s, Status::NF_SUCCESS);
    assert!(src == dst, "bytes differ after WRITE ({provider})");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.is_empty() {
        got = b.take_notifs();
        assert!(Instant::now() < deadline, "no notification");
    }
    assert_eq!(got, vec![("a".to_string(), b"done".to_vec())]);
    // READ back into a cleared source.
    let mut back = vec![0u8; size];
    let mb = a.register(back.as_mut_ptr() as u64, size as u64, MemKind::Dram, 0).unwrap();
    let pairs = [Pair { local: (back.as_ptr() as u64, size as u64, &mb), remote: (dst.as_ptr() as u64, size as u64, &rd) }];
    let req = a.prepare(Op::Read, &pairs, "b").unwrap();
    let s = a.post(&req, None).unwrap();
    let s = if s == Status::NF_IN_PROG { wait(&[&a, &b], &req) } else { s };
    assert_eq!(s, Status::NF_SUCCESS);
    assert!(back == src, "bytes differ after READ ({provider})");
    drop((req, rd, ms, md, mb));
    a.shutdown();
    b.shutdown();
}

#[test]
fn tcp_threaded() {
    round_trip("tcp", true, 1 << 20);
}

#[test]
fn tcp_unthreaded() {
    round_trip("tcp", false, 4096);
}

#[test]
fn sockets_threaded() {
    round_trip("sockets", true, 1 << 20);
}

#[test]
fn shm_threaded() {
    round_trip("shm", true, 1 << 20);
}

/// Engines of one process with the same-host paths on copy directly (no rail carries the
/// bytes: the peer's registration is addressable here); with them off, over tcp. (The shm
/// rail between processes is exercised by the two-process suites.)
#[test]
fn same_host_peers_use_the_shm_rail() {
    for shm in [true, false] {
        let mut c = cfg("tcp", true);
        c.set("same_host_shm", if shm { "true" } else { "false" }).unwrap();
        c.set("rails", "1").unwrap();
        let a = Engine::new("a", c.clone()).unwrap();
        let b = Engine::new("b", c).unwrap();
        assert_eq!(a.rail_count(), if shm { 2 } else { 1 });
        a.load_conn_info("b", b.conn_info()).unwrap();
        // 4 MiB: over the copy threads (cma_copy's pool) when same-host paths are on
        let size = 4 << 20;
        let src: Vec<u8> = (0..size).map(|i| (i * 131 % 251) as u8).collect();
        let dst = vec![0u8; size];
        let ms = a.register(src.as_ptr() as u64, size as u64, MemKind::Dram, 0).unwrap();
        let md = b.register(dst.as_ptr() as u64, size as u64, MemKind::Dram, 0).unwrap();
        let rd = a.load_remote("b", &b.public_data(&md).unwrap()).unwrap();
        let pairs = [Pair { local: (src.as_ptr() as u64, size as u64, &ms), remote: (dst.as_ptr() as u64, size as u64, &rd) }];
        let req = a.prepare(Op::Write, &pairs, "b").unwrap();
        let s = a.post(&req, None).unwrap();
        let s = if s == Status::NF_IN_PROG { wait(&[&a, &b], &req) } else { s };
        assert_eq!(s, Status::NF_SUCCESS);
        assert!(dst == src, "bytes differ after the WRITE");
        // and READ back, with the halves swapped (two descriptors)
        let back = vec![0u8; size];
        let mb = a.register(back.as_ptr() as u64, size as u64, MemKind::Dram, 0).unwrap();
        let (h, d0, b0) = (size as u64 / 2, dst.as_ptr() as u64, back.as_ptr() as u64);
        let pairs = [Pair { local: (b0, h, &mb), remote: (d0 + h, h, &rd) }, Pair { local: (b0 + h, h, &mb), remote: (d0, h, &rd) }];
        let rq = a.prepare(Op::Read, &pairs, "b").unwrap();
        let s = a.post(&rq, None).unwrap();
        let s = if s == Status::NF_IN_PROG { wait(&[&a, &b], &rq) } else { s };
        assert_eq!(s, Status::NF_SUCCESS);
        assert!(back[..size / 2] == src[size / 2..] && back[size / 2..] == src[..size / 2], "bytes differ after the READ");
        let net = a.rail_counters(0).unwrap().bytes;
        if shm {
            assert_eq!(net, 0, "network rail carried data for a same-process peer");
            assert_eq!(a.rail_counters(1).unwrap().bytes, 0, "shm rail carried data for a same-process peer");
            assert_eq!(a.counters().bytes_written, size as u64);
            assert_eq!(a.counters().bytes_read, size as u64);
        } else {
            assert_eq!(net, 2 * size as u64);
        }
    }
}

/// Small descriptors over two rails: contiguous runs per rail (half the batch on each), so
/// neighbouring descriptors still share one RMA operation; every byte arrives.
#[test]
fn kv_batch_over_two_rails_goes_in_runs() {
    nixl_fabric::logging::init();
    let mut c = cfg("tcp", true);
    c.set("rails", "2").unwrap();
    let (a, b) = connected_pair(c);
    assert_eq!(a.rail_count(), 2);
    const N: usize = 64;
    const BS: usize = 4096;
    let src: Vec<u8> = (0..N * BS).map(|i| (i * 13 + 1) as u8).collect();
    let dst = vec![0u8; N * BS];
    let ms = a.register(src.as_ptr() as u64, src.len() as u64, MemKind::Dram, 0).unwrap();
    let md = b.register(dst.as_ptr() as u64, dst.len() as u64, MemKind::Dram, 0).unwrap();
    let rd = a.load_remote("b", &b.public_data(&md).unwrap()).unwrap();
    // block i of the source to block N-1-i of the destination: no two neighbours coalesce
    let pairs: Vec<Pair> = (0..N)
        .map(|i| Pair { local: (src.as_ptr() as u64 + (i * BS) as u64, BS as u64, &ms), remote: (dst.as_ptr() as u64 + ((N - 1 - i) * BS) as u64, BS as u64, &rd) })
        .collect();
    let before = a.counters().ops_posted;
    let req = a.prepare(Op::Write, &pairs, "b").unwrap();
    let s = a.post(&req, None).unwrap();
    let s = if s == Status::NF_IN_PROG { wait(&[&a, &b], &req) } else { s };
    assert_eq!(s, Status::NF_SUCCESS);
    for i in 0..N {
        assert!(dst[(N - 1 - i) * BS..(N - i) * BS] == src[i * BS..(i + 1) * BS], "block {i}");
    }
    let (r0, r1) = (a.rail_counters(0).unwrap().bytes, a.rail_counters(1).unwrap().bytes);
    assert_eq!((r0, r1), ((N / 2 * BS) as u64, (N / 2 * BS) as u64), "each rail carries half the batch");
    // 4 segments per operation (rma_batch) on each rail's run, plus at most a flush per rail
    let ops = a.counters().ops_posted - before;
    assert!(ops <= (N / 4 + 2) as u64, "{ops} operations for {N} descriptors");
    drop((req, rd, ms, md));
    a.shutdown();
    b.shutdown();
}

/// A request of 40000 descriptors over two tcp rails, planned by four threads: every block
/// lands in its slot both ways, the rails share the runs as a plan of one thread shares them,
/// and a bad descriptor in a later part fails the request with its place in the list.
#[test]
fn long_requests_planned_in_parts_move_every_block() {
    nixl_fabric::logging::init();
    let mut c = cfg("tcp", true);
    c.set("rails", "2").unwrap();
    c.set("plan_threads", "4").unwrap();
    let (a, b) = connected_pair(c);
    const N: usize = 40_000;
    const BS: usize = 128;
    let src: Vec<u8> = (0..N * BS).map(|i| (i * 31 + 7) as u8).collect();
    let mut dst = vec![0u8; N * BS];
    let ms = a.register(src.as_ptr() as u64, src.len() as u64, MemKind::Dram, 0).unwrap();
    let md = b.register(dst.as_ptr() as u64, dst.len() as u64, MemKind::Dram, 0).unwrap();
    let rd = a.load_remote("b", &b.public_data(&md).unwrap()).unwrap();
    let slot = |i: usize| i * 7919 % N;
    let pairs: Vec<Pair> = (0..N)
        .map(|i| Pair { local: (src.as_ptr() as u64 + (i * BS) as u64, BS as u64, &ms), remote: (dst.as_ptr() as u64 + (slot(i) * BS) as u64, BS as u64, &rd) })
        .collect();
    for op in [Op::Write, Op::Read] {
        if op == Op::Read {
            dst.iter_mut().enumerate().for_each(|(i, x)| *x = (i * 17 + 5) as u8);
        }
        let req = a.prepare(op, &pairs, "b").unwrap();
        let s = a.post(&req, None).unwrap();
        let s = if s == Status::NF_IN_PROG { wait(&[&a, &b], &req) } else { s };
        assert_eq!(s, Status::NF_SUCCESS);
        for i in 0..N {
            assert!(dst[slot(i) * BS..(slot(i) + 1) * BS] == src[i * BS..(i + 1) * BS], "{op:?}: block {i}");
        }
        if op == Op::Write {
            let (r0, r1) = (a.rail_counters(0).unwrap().bytes, a.rail_counters(1).unwrap().bytes);
            assert_eq!(r0 + r1, (N * BS) as u64);
            assert!(r0 > 0 && r1 > 0, "both rails carry runs: {r0} / {r1}");
        }
        drop(req);
    }
    let mut bad = pairs.clone();
    bad[35_001].remote.0 = dst.as_ptr() as u64 + (N * BS) as u64;
    let e = a.prepare(Op::Write, &bad, "b").err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("descriptor 35001"), "{e}");
    drop((pairs, bad));
    drop((rd, ms, md));
    a.shutdown();
    b.shutdown();
}

/// Four tcp rails with rail threads (each rail after the first progressed by its own
/// thread): large striped WRITEs and READs and a KV batch, repeated, byte-exact, and the
/// same with the threads off, and with bulk data kept off rail 0 (rma_rail0=false).
#[test]
fn striped_transfers_over_four_rails_with_rail_threads() {
    nixl_fabric::logging::init();
    for (threads, rail0) in [("true", "true"), ("false", "true"), ("true", "false")] {
        let mut c = cfg("tcp", true);
        c.set("rails", "4").unwrap();
        c.set("rail_threads", threads).unwrap();
        c.set("rma_rail0", rail0).unwrap();
        let (a, b) = connected_pair(c);
        const SIZE: usize = 32 << 20;
        let src: Vec<u8> = (0..SIZE).map(|i| (i * 29 + 7) as u8).collect();
        let dst = vec![0u8; SIZE];
        let back = vec![0u8; SIZE];
        let ms = a.register(src.as_ptr() as u64, SIZE as u64, MemKind::Dram, 0).unwrap();
        let mb = a.register(back.as_ptr() as u64, SIZE as u64, MemKind::Dram, 0).unwrap();
        let md = b.register(dst.as_ptr() as u64, SIZE as u64, MemKind::Dram, 0).unwrap();
        let rd = a.load_remote("b", &b.public_data(&md).unwrap()).unwrap();
        let w = a.prepare(Op::Write, &[Pair { local: (src.as_ptr() as u64, SIZE as u64, &ms), remote: (dst.as_ptr() as u64, SIZE as u64, &rd) }], "b").unwrap();
        let r = a.prepare(Op::Read, &[Pair { local: (back.as_ptr() as u64, SIZE as u64, &mb), remote: (dst.as_ptr() as u64, SIZE as u64, &rd) }], "b").unwrap();
        let kv_pairs: Vec<Pair> = (0..1024)
            .map(|i| Pair { local: (back.as_ptr() as u64 + i * 16384, 16384, &mb), remote: (dst.as_ptr() as u64 + (1023 - i) * 16384, 16384, &rd) })
            .collect();
        let kv = a.prepare(Op::Read, &kv_pairs, "b").unwrap();
        for round in 0..3 {
            for req in [&w, &r] {
                let s = a.post(req, None).unwrap();
                let s = if s == Status::NF_IN_PROG { wait(&[&a, &b], req) } else { s };
                assert_eq!(s, Status::NF_SUCCESS, "rail_threads={threads} rma_rail0={rail0} round {round}");
            }
            assert!(dst == src && back == src, "rail_threads={threads} round {round}: bytes differ");
            let s = a.post(&kv, None).unwrap();
            let s = if s == Status::NF_IN_PROG { wait(&[&a, &b], &kv) } else { s };
            assert_eq!(s, Status::NF_SUCCESS);
            for i in 0..1024usize {
                assert!(back[i * 16384..(i + 1) * 16384] == src[(1023 - i) * 16384..(1024 - i) * 16384], "kv block {i}");
            }
        }
        let bytes: Vec<u64> = (0..4).map(|i| a.rail_counters(i).unwrap().bytes).collect();
        if rail0 == "true" {
            assert!(bytes.iter().all(|&b| b > 0), "every rail carried data: {bytes:?}");
        } else {
            assert!(bytes[0] == 0 && bytes[1..].iter().all(|&b| b > 0), "rails 1-3 carried the data, rail 0 none: {bytes:?}");
        }
        drop((w, r, kv, rd, ms, mb, md));
        a.shutdown();
        b.shutdown();
    }
}

/// Not a check: a load for profiling the tcp data path (issue 13). 64 MiB WRITEs (or READs,
/// NF_PROFILE_OP=read) striped over NF_PROFILE_RAILS tcp rails (default 4) for
/// NF_PROFILE_SECS (default 5) seconds, between two engines of this process; the waiting
/// thread only sleeps (caller_progress off), so every provider call runs on the engines'
/// own threads. Run: `perf record -g target/release/deps/engine_loopback-* --ignored
/// tcp_transfer_loop_for_profiling`, then `perf report --sort comm,dso,sym`.
#[test]
#[ignore = "a profiling load, not a test"]
fn tcp_transfer_loop_for_profiling() {
    let env = |k: &str, d: u64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let rails = env("NF_PROFILE_RAILS", 4);
    let secs = env("NF_PROFILE_SECS", 5);
    let op = if std::env::var("NF_PROFILE_OP").is_ok_and(|v| v == "read") { Op::Read } else { Op::Write };
    let mut c = cfg("tcp", true);
    c.set("rails", &rails.to_string()).unwrap();
    c.set("caller_progress", "false").unwrap();
    let (a, b) = connected_pair(c);
    const SIZE: usize = 64 << 20;
    let src = vec![1u8; SIZE];
    let dst = vec![0u8; SIZE];
    let ms = a.register(src.as_ptr() as u64, SIZE as u64, MemKind::Dram, 0).unwrap();
    let md = b.register(dst.as_ptr() as u64, SIZE as u64, MemKind::Dram, 0).unwrap();
    let rd = a.load_remote("b", &b.public_data(&md).unwrap()).unwrap();
    let req = a.prepare(op, &[Pair { local: (src.as_ptr() as u64, SIZE as u64, &ms), remote: (dst.as_ptr() as u64, SIZE as u64, &rd) }], "b").unwrap();
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed() < Duration::from_secs(secs) {
        assert_ne!(a.post(&req, None).unwrap(), Status::NF_ERR_REPOST_ACTIVE);
        while a.check(&req) == Status::NF_IN_PROG {
            std::thread::sleep(Duration::from_micros(50));
        }
        assert_eq!(a.check(&req), Status::NF_SUCCESS);
        n += 1;
    }
    println!("{n} x 64 MiB {op:?} over {rails} rail(s): {:.2} GB/s", (n * SIZE as u64) as f64 / t0.elapsed().as_secs_f64() / 1e9);
    drop((req, rd, ms, md));
}

fn pool_cfg(timeout_ms: u64) -> nixl_fabric::config::Config {
    let mut c = cfg("tcp", true);
    c.set("same_host_shm", "true").unwrap();
    c.set("rails", "1").unwrap();
    c.set("cma_threads", "1").unwrap();
    c.set("timeout_ms", &timeout_ms.to_string()).unwrap();
    c
}

/// Block i of `local` with block n-1-i of `remote`: no two ranges coalesce.
fn reversed_blocks<'a>(local: &[u8], lm: &'a Arc<nixl_fabric::engine::LocalMem>, remote: &[u8], rm: &'a Arc<nixl_fabric::engine::RemoteMem>, n: usize, bs: usize) -> Vec<Pair<'a>> {
    (0..n)
        .map(|i| Pair { local: (local.as_ptr() as u64 + (i * bs) as u64, bs as u64, lm), remote: (remote.as_ptr() as u64 + ((n - 1 - i) * bs) as u64, bs as u64, rm) })
        .collect()
}

/// A same-process READ of 2048 x 128 KiB (256 MiB, over the copy threads) whose peer is
/// disconnected while the copies run: release must not return before they stop, since the
/// caller frees the memory after it.
#[test]
fn release_after_a_disconnect_waits_for_running_host_copies() {
    nixl_fabric::logging::init();
    const N: usize = 2048;
    const BS: usize = 128 << 10;
    for round in 0..4 {
        let (a, b) = connected_pair(pool_cfg(5000));
        let src = vec![0x5au8; N * BS];
        let dst = vec![0u8; N * BS];
        let ms = b.register(src.as_ptr() as u64, src.len() as u64, MemKind::Dram, 0).unwrap();
        let md = a.register(dst.as_ptr() as u64, dst.len() as u64, MemKind::Dram, 0).unwrap();
        let rs = a.load_remote("b", &b.public_data(&ms).unwrap()).unwrap();
        let pairs = reversed_blocks(&dst, &md, &src, &rs, N, BS);
        let req = a.prepare(Op::Read, &pairs, "b").unwrap();
        let before = a.counters().ops_posted;
        a.post(&req, None).unwrap();
        let t0 = Instant::now();
        while a.counters().ops_posted == before && req.status() == Status::NF_IN_PROG {
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::hint::spin_loop();
        }
        a.disconnect("b").unwrap();
        assert!(a.release(&req), "round {round}: release did not drain");
        // SAFETY: dst is ours and, after release, no longer in use by the engine.
        unsafe { std::ptr::write_bytes(dst.as_ptr() as *mut u8, 0, dst.len()) };
        std::thread::sleep(Duration::from_millis(200));
        let dirty = dst.iter().filter(|&&x| x != 0).count();
        assert_eq!(dirty, 0, "round {round}: {dirty} bytes written after release returned");
        drop((req, rs, ms, md));
        a.shutdown();
        b.shutdown();
    }
}

/// A long same-process copy over the copy threads is progress, not a silent peer: it must
/// not time out at timeout_ms (100 ms here), and every byte arrives.
#[test]
fn long_host_copies_do_not_time_out_while_running() {
    nixl_fabric::logging::init();
    const N: usize = 2048;
    const BS: usize = 128 << 10;
    let (a, b) = connected_pair(pool_cfg(100));
    let src: Vec<u8> = (0..N * BS).map(|i| (i / BS) as u8).collect();
    let dst = vec![0u8; N * BS];
    let ms = b.register(src.as_ptr() as u64, src.len() as u64, MemKind::Dram, 0).unwrap();
    let md = a.register(dst.as_ptr() as u64, dst.len() as u64, MemKind::Dram, 0).unwrap();
    let rs = a.load_remote("b", &b.public_data(&ms).unwrap()).unwrap();
    let pairs = reversed_blocks(&dst, &md, &src, &rs, N, BS);
    let req = a.prepare(Op::Read, &pairs, "b").unwrap();
    let mut slowest = Duration::ZERO;
    for _ in 0..3 {
        let t0 = Instant::now();
        let s = a.post(&req, None).unwrap();
        let s = if s == Status::NF_IN_PROG { wait(&[&a, &b], &req) } else { s };
        slowest = slowest.max(t0.elapsed());
        assert_eq!(s, Status::NF_SUCCESS, "a healthy same-process copy failed after {:?}", t0.elapsed());
    }
    for i in 0..N {
        assert!(dst[i * BS..(i + 1) * BS].iter().all(|&x| x == (N - 1 - i) as u8), "block {i}");
    }
    eprintln!("slowest of 3 x 256 MiB: {slowest:?} (timeout 100 ms)");
    assert!(a.release(&req));
    drop((req, rs, ms, md));
}
