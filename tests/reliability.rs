//! Reliability on real providers and real processes: a peer killed mid-stream, teardown
//! with work in flight, and many threads posting at once. Every wait is bounded.
use nixl_fabric::config::Config;
use nixl_fabric::engine::{Engine, LocalMem, MemKind, Op, Pair, RemoteMem, Request};
use nixl_fabric::error::Status;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn cfg(thread: bool, timeout_ms: u64) -> Config {
    // These tests are about the network provider; same-host shm would route around it.
    cfg_with(thread, timeout_ms, false)
}

/// `shm`: the default configuration's same-host shm rail beside tcp.
fn cfg_with(thread: bool, timeout_ms: u64, shm: bool) -> Config {
    let mut c = Config::defaults();
    c.set("provider", "tcp").unwrap();
    c.set("iface", "lo").unwrap();
    c.progress_thread = thread;
    c.timeout_ms = timeout_ms;
    c.same_host_shm = shm;
    c
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

/// The target process: registers a region, prints its conn info, descriptor and address,
/// then serves until killed (or stdin closes).
#[test]
fn child_target() {
    let Ok(size) = std::env::var("NF_CHILD_TARGET") else { return };
    let size: usize = size.parse().unwrap();
    let shm = std::env::var("NF_CHILD_SHM").is_ok_and(|v| v == "1");
    let mut c = cfg_with(true, 5000, shm);
    if let Ok(r) = std::env::var("NF_CHILD_RAILS") {
        c.set("rails", &r).unwrap();
    }
    let e = Engine::new("victim", c).unwrap();
    let buf = vec![0u8; size];
    let m = e.register(buf.as_ptr() as u64, size as u64, MemKind::Dram, 0).unwrap();
    let out = format!("READY {} {} {}\n", hex(e.conn_info()), hex(&e.public_data(&m).unwrap()), buf.as_ptr() as u64);
    std::io::stdout().write_all(out.as_bytes()).unwrap();
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(m);
}

struct Victim {
    child: Child,
    conn: Vec<u8>,
    desc: Vec<u8>,
    addr: u64,
}

fn spawn_victim(size: usize, shm: bool) -> Victim {
    spawn_victim_with(size, shm, 0)
}

/// `rails`: the victim's rail count (0: the default).
fn spawn_victim_with(size: usize, shm: bool, rails: u32) -> Victim {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_target", "--nocapture", "--test-threads=1"])
        .env("NF_CHILD_TARGET", size.to_string())
        .env("NF_CHILD_SHM", if shm { "1" } else { "0" })
        .env("NF_CHILD_RAILS", rails.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let ready = child.stdout.take().and_then(|out| ready_line(BufReader::new(out), Instant::now() + Duration::from_secs(30)));
    let Some(rest) = ready else {
        // Reap it before failing, so no zombie outlives the test.
        let _ = child.kill();
        let _ = child.wait();
        panic!("victim exited or never got ready");
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    Victim { child, conn: unhex(f[0]), desc: unhex(f[1]), addr: f[2].parse().unwrap() }
}

/// What follows "READY " in the victim's output (libtest prints "test child_target ... "
/// before the test's own output), or None once it exits or the deadline passes.
fn ready_line(mut r: impl BufRead, deadline: Instant) -> Option<String> {
    let mut line = String::new();
    loop {
        line.clear();
        if !r.read_line(&mut line).is_ok_and(|n| n > 0) {
            return None;
        }
        if let Some((_, rest)) = line.split_once("READY ") {
            return Some(rest.to_string());
        }
        if Instant::now() >= deadline {
            return None;
        }
    }
}

fn wait(e: &Engine, r: &Request, limit: Duration) -> (Status, Duration) {
    let t0 = Instant::now();
    loop {
        let s = e.check(r);
        if s != Status::NF_IN_PROG || t0.elapsed() > limit {
            return (s, t0.elapsed());
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Posts and waits (bounded); a small request may already be done when post returns.
fn post_wait(e: &Engine, r: &Arc<Request>, limit: Duration) -> Status {
    match e.post(r, None).unwrap() {
        Status::NF_IN_PROG => wait(e, r, limit).0,
        s => s,
    }
}

/// A WRITE of `len` bytes at offset `off` of `local` (buffer, registration) to the same
/// offset of `remote` (address, target).
fn write_req(e: &Engine, peer: &str, local: (&[u8], &Arc<LocalMem>), remote: (u64, &Arc<RemoteMem>), len: usize, off: usize) -> Arc<Request> {
    let ((src, lm), (raddr, rm)) = (local, remote);
    let pairs = [Pair { local: (src.as_ptr() as u64 + off as u64, len as u64, lm), remote: (raddr + off as u64, len as u64, rm) }];
    e.prepare(Op::Write, &pairs, peer).unwrap()
}

#[test]
fn dead_peer_fails_in_flight_and_later_requests_then_a_restart_works() {
    dead_peer(false);
}

/// The same over the default configuration's same-host shm rail (shm's fast RMA: the
/// copies are ours, so a dead process leaves nothing to complete them; see
/// Driver::probe_same_host). The bystander is on this host too, on the same shm rail.
#[test]
fn dead_same_host_peer_over_shm_fails_fast_and_spares_the_others() {
    dead_peer(true);
}

/// Over three tcp rails on both sides, the second and third driven by rail threads: their
/// completions (the errors of the dead connection among them) reach the driver.
#[test]
fn dead_peer_over_three_tcp_rails_with_rail_threads() {
    dead_peer_with(false, 3);
}

fn dead_peer(shm: bool) {
    dead_peer_with(shm, 0)
}

fn dead_peer_with(shm: bool, rails: u32) {
    const SIZE: usize = 256 << 20;
    const PIECE: usize = 32 << 20;
    nixl_fabric::logging::init();
    let timeout_ms = 2000;
    let cfg = |t| {
        let mut c = cfg_with(true, t, shm);
        if rails > 0 {
            c.set("rails", &rails.to_string()).unwrap();
        }
        c
    };
    let e = Engine::new("survivor", cfg(timeout_ms)).unwrap();
    let src = vec![5u8; SIZE];
    let lm = e.register(src.as_ptr() as u64, SIZE as u64, MemKind::Dram, 0).unwrap();
    // A second, healthy peer in this process.
    let other = Engine::new("bystander", cfg(timeout_ms)).unwrap();
    let obuf = vec![0u8; 1 << 20];
    let om = other.register(obuf.as_ptr() as u64, obuf.len() as u64, MemKind::Dram, 0).unwrap();
    e.load_conn_info("bystander", other.conn_info()).unwrap();
    let orm = e.load_remote("bystander", &other.public_data(&om).unwrap()).unwrap();

    let mut v = spawn_victim_with(SIZE, shm, rails);
    e.load_conn_info("victim", &v.conn).unwrap();
    let rm = e.load_remote("victim", &v.desc).unwrap();
    let reqs: Vec<_> = (0..SIZE / PIECE).map(|i| write_req(&e, "victim", (&src, &lm), (v.addr, &rm), PIECE, i * PIECE)).collect();
    // Warm up the connection, then put everything in flight and kill the peer.
    assert_eq!(post_wait(&e, &reqs[0], Duration::from_secs(20)), Status::NF_SUCCESS);
    for r in &reqs {
        let s = e.post(r, None).unwrap();
        assert!(s == Status::NF_IN_PROG || s == Status::NF_SUCCESS);
    }
    v.child.kill().unwrap();
    let _ = v.child.wait();
    let killed = Instant::now();
    let limit = Duration::from_millis(timeout_ms) + Duration::from_secs(3);
    for r in &reqs {
        let (s, _) = wait(&e, r, limit);
        assert!(s == Status::NF_SUCCESS || s == Status::NF_ERR_REMOTE_DISCONNECT, "in-flight request ended with {}", s.name());
    }
    assert!(killed.elapsed() <= limit, "in-flight requests took {:?} to fail", killed.elapsed());
    // A request posted after the death fails too, within the timeout.
    // (A same-host victim may already be known dead, so that preparing fails.)
    let t0 = Instant::now();
    let pairs = [Pair { local: (src.as_ptr() as u64, 1 << 20, &lm), remote: (v.addr, 1 << 20, &rm) }];
    let late = e.prepare(Op::Write, &pairs, "victim");
    let s = match &late {
        Err(err) => err.status(),
        Ok(late) => {
            let s = e.post(late, None).unwrap();
            if s == Status::NF_IN_PROG { wait(&e, late, limit).0 } else { s }
        }
    };
    assert_eq!(s, Status::NF_ERR_REMOTE_DISCONNECT, "late request after the kill");
    assert!(t0.elapsed() <= limit, "late request took {:?}", t0.elapsed());
    // So does a small one with a notification, which over the network rails is an eager write
    // (one PUT message, ended by the target's answer that never comes).
    let t0 = Instant::now();
    let small = [Pair { local: (src.as_ptr() as u64, 4096, &lm), remote: (v.addr, 4096, &rm) }];
    let s = match e.prepare(Op::Write, &small, "victim") {
        Err(err) => err.status(),
        Ok(r) => match e.post(&r, Some(b"late".to_vec())) {
            Err(err) => err.status(),
            Ok(Status::NF_IN_PROG) => wait(&e, &r, limit).0,
            Ok(s) => s,
        },
    };
    assert_eq!(s, Status::NF_ERR_REMOTE_DISCONNECT, "late small write after the kill");
    assert!(t0.elapsed() <= limit, "late small write took {:?}", t0.elapsed());
    // The engine keeps serving the healthy peer.
    let ok = write_req(&e, "bystander", (&src, &lm), (obuf.as_ptr() as u64, &orm), 1 << 20, 0);
    assert_eq!(post_wait(&e, &ok, Duration::from_secs(10)), Status::NF_SUCCESS);
    assert!(obuf.iter().all(|&b| b == 5));
    for r in reqs {
        assert!(e.release(&r));
    }
    drop((late, rm));
    // A restarted peer under the same name is loaded again and used.
    let mut v2 = spawn_victim_with(SIZE, shm, rails);
    e.load_conn_info("victim", &v2.conn).unwrap();
    let rm2 = e.load_remote("victim", &v2.desc).unwrap();
    let again = write_req(&e, "victim", (&src, &lm), (v2.addr, &rm2), PIECE, 0);
    assert_eq!(post_wait(&e, &again, Duration::from_secs(20)), Status::NF_SUCCESS, "restarted peer");
    drop(v2.child.stdin.take());
    let _ = v2.child.wait();
}

/// Same-host DRAM between two processes goes by cross-memory attach (issue 13): a large
/// WRITE cut over the copy threads, a batch of scattered 4 KiB blocks, READs back, every
/// byte compared, and none of it through a rail.
#[test]
fn same_host_dram_between_processes_moves_by_cma_byte_exact() {
    const SIZE: usize = 64 << 20;
    nixl_fabric::logging::init();
    let mut c = cfg_with(true, 5000, true);
    c.set("cma_threads", "3").unwrap();
    let e = Engine::new("cma-initiator", c).unwrap();
    let src: Vec<u8> = (0..SIZE).map(|i| (i * 131 % 251) as u8).collect();
    let mut back = vec![0u8; SIZE];
    let lm = e.register(src.as_ptr() as u64, SIZE as u64, MemKind::Dram, 0).unwrap();
    let bm = e.register(back.as_mut_ptr() as u64, SIZE as u64, MemKind::Dram, 0).unwrap();
    let mut v = spawn_victim(SIZE, true);
    e.load_conn_info("victim", &v.conn).unwrap();
    let rm = e.load_remote("victim", &v.desc).unwrap();
    let before = e.counters();
    let rails_before: u64 = (0..4).filter_map(|i| e.rail_counters(i).ok()).map(|r| r.bytes).sum();

    // One large WRITE, then scattered 4 KiB blocks written shifted by one block, then the
    // whole region READ back in one request.
    let w = write_req(&e, "victim", (&src, &lm), (v.addr, &rm), SIZE, 0);
    assert_eq!(post_wait(&e, &w, Duration::from_secs(30)), Status::NF_SUCCESS);
    let blocks: Vec<usize> = (0..2048).map(|i| (i * 7919) % (SIZE / 4096 - 1)).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    let pairs: Vec<Pair> = blocks
        .iter()
        .map(|&b| Pair { local: (src.as_ptr() as u64 + (b as u64 + 1) * 4096, 4096, &lm), remote: (v.addr + b as u64 * 4096, 4096, &rm) })
        .collect();
    let kv = e.prepare(Op::Write, &pairs, "victim").unwrap();
    assert_eq!(post_wait(&e, &kv, Duration::from_secs(30)), Status::NF_SUCCESS);
    let rd = e.prepare(Op::Read, &[Pair { local: (back.as_ptr() as u64, SIZE as u64, &bm), remote: (v.addr, SIZE as u64, &rm) }], "victim").unwrap();
    assert_eq!(post_wait(&e, &rd, Duration::from_secs(30)), Status::NF_SUCCESS);

    let mut want = src.clone();
    for &b in &blocks {
        want.copy_within((b + 1) * 4096..(b + 2) * 4096, b * 4096);
    }
    assert!(back == want, "bytes read back differ from what was written");
    let after = e.counters();
    assert_eq!(after.cma_bytes - before.cma_bytes, 2 * SIZE as u64 + blocks.len() as u64 * 4096);
    let rails_after: u64 = (0..4).filter_map(|i| e.rail_counters(i).ok()).map(|r| r.bytes).sum();
    assert_eq!(rails_after, rails_before, "data went through a rail");

    // Switched off, the same WRITE still works (over the shm rail) and CMA carries nothing.
    let mut c = cfg_with(true, 5000, true);
    c.set("cma_copy", "false").unwrap();
    let off = Engine::new("cma-off", c).unwrap();
    let lm2 = off.register(src.as_ptr() as u64, SIZE as u64, MemKind::Dram, 0).unwrap();
    off.load_conn_info("victim", &v.conn).unwrap();
    let rm2 = off.load_remote("victim", &v.desc).unwrap();
    let w2 = write_req(&off, "victim", (&src, &lm2), (v.addr, &rm2), 1 << 20, 0);
    assert_eq!(post_wait(&off, &w2, Duration::from_secs(30)), Status::NF_SUCCESS);
    assert_eq!(off.counters().cma_bytes, 0);
    for r in [w, kv, rd] {
        assert!(e.release(&r));
    }
    assert!(off.release(&w2));
    drop(v.child.stdin.take());
    let _ = v.child.wait();
}

/// `rails` > 1: writes queued in rail outboxes and rail threads posting them while the
/// requests are released and the engines shut down.
fn teardown_under_load(threads: usize, rails: u32) {
    const N: usize = 64;
    const LEN: usize = 1 << 20;
    let mut c = cfg(true, 3000);
    c.set("rails", &rails.to_string()).unwrap();
    for iter in 0..10 {
        let a = Engine::new("a", c.clone()).unwrap();
        let b = Engine::new("b", c.clone()).unwrap();
        a.load_conn_info("b", b.conn_info()).unwrap();
        let src = vec![iter as u8; N * LEN];
        let dst = vec![0u8; N * LEN];
        let lm = a.register(src.as_ptr() as u64, src.len() as u64, MemKind::Dram, 0).unwrap();
        let dm = b.register(dst.as_ptr() as u64, dst.len() as u64, MemKind::Dram, 0).unwrap();
        let rm = a.load_remote("b", &b.public_data(&dm).unwrap()).unwrap();
        let reqs: Vec<_> = (0..N).map(|i| write_req(&a, "b", (&src, &lm), (dst.as_ptr() as u64, &rm), LEN, i * LEN)).collect();
        std::thread::scope(|s| {
            for chunk in reqs.chunks(N / threads) {
                let a = &a;
                s.spawn(move || {
                    for r in chunk {
                        a.post(r, None).unwrap();
                    }
                    for r in chunk {
                        a.release(r);
                    }
                });
            }
        });
        drop(reqs);
        drop((rm, lm, dm));
        let t0 = Instant::now();
        a.shutdown();
        b.shutdown();
        assert!(t0.elapsed() < Duration::from_secs(5), "teardown took {:?}", t0.elapsed());
    }
}

#[test]
fn teardown_with_64_requests_in_flight_one_thread() {
    teardown_under_load(1, 1);
}

#[test]
fn teardown_with_64_requests_in_flight_four_threads() {
    teardown_under_load(4, 1);
}

#[test]
fn teardown_with_64_requests_in_flight_over_four_rails_with_rail_threads() {
    teardown_under_load(4, 4);
}

fn many_threads(thread: bool) {
    const THREADS: usize = 8;
    const PER: usize = 10_000;
    const LEN: usize = 4096;
    let e = Engine::new("hub", cfg(thread, 10_000)).unwrap();
    let peers: Vec<_> = (0..2).map(|i| Engine::new(&format!("p{i}"), cfg(thread, 10_000)).unwrap()).collect();
    let dsts: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; THREADS * LEN]).collect();
    let mut rms = Vec::new();
    let mut keep = Vec::new();
    for (i, p) in peers.iter().enumerate() {
        e.load_conn_info(&format!("p{i}"), p.conn_info()).unwrap();
        let m = p.register(dsts[i].as_ptr() as u64, dsts[i].len() as u64, MemKind::Dram, 0).unwrap();
        rms.push(e.load_remote(&format!("p{i}"), &p.public_data(&m).unwrap()).unwrap());
        keep.push(m);
    }
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (e, rms, dsts, peers) = (&e, &rms, &dsts, &peers);
            s.spawn(move || {
                let mut src = vec![0u8; LEN];
                let lm = e.register(src.as_ptr() as u64, LEN as u64, MemKind::Dram, 0).unwrap();
                let reqs: Vec<_> = (0..2).map(|p| {
                    let pairs = [Pair { local: (src.as_ptr() as u64, LEN as u64, &lm), remote: (dsts[p].as_ptr() as u64 + (t * LEN) as u64, LEN as u64, &rms[p]) }];
                    e.prepare(Op::Write, &pairs, &format!("p{p}")).unwrap()
                }).collect();
                for i in 0..PER {
                    let p = i % 2;
                    let tag = (i as u32).wrapping_mul(2654435761) ^ t as u32;
                    src[..4].copy_from_slice(&tag.to_le_bytes());
                    src[LEN - 4..].copy_from_slice(&tag.to_le_bytes());
                    let mut st = e.post(&reqs[p], None).unwrap();
                    let deadline = Instant::now() + Duration::from_secs(20);
                    while st == Status::NF_IN_PROG {
                        if !thread {
                            peers[p].progress();
                        } else {
                            // Eight spinning callers would starve the progress threads.
                            std::thread::yield_now();
                        }
                        st = e.check(&reqs[p]);
                        assert!(Instant::now() < deadline, "request stuck");
                    }
                    assert_eq!(st, Status::NF_SUCCESS);
                    let d = &dsts[p][t * LEN..(t + 1) * LEN];
                    assert_eq!(&d[..4], &tag.to_le_bytes(), "thread {t} request {i}: head");
                    assert_eq!(&d[LEN - 4..], &tag.to_le_bytes(), "thread {t} request {i}: tail");
                }
            });
        }
    });
    assert_eq!(e.counters().requests_completed, (THREADS * PER) as u64);
}

#[test]
fn eight_threads_two_peers_progress_thread() {
    many_threads(true);
}

#[test]
fn eight_threads_two_peers_no_progress_thread() {
    many_threads(false);
}

/// A process killed with its shm endpoint open leaves its region in /dev/shm, named after
/// its pid on libfabric 2.x; a later process with the same pid must still open its shm rail.
/// The child plays the later process: it plants a region under its own pid's name first.
#[test]
fn child_with_a_stale_shm_region() {
    if std::env::var("NF_CHILD_STALE_SHM").is_err() {
        return;
    }
    let pid = std::process::id();
    for ep in 0..2 {
        let _ = std::fs::write(format!("/dev/shm/{pid}:0:{ep}"), b"left by a killed process");
    }
    let mut c = Config::defaults();
    c.set("provider", "shm").unwrap();
    c.same_host_shm = false;
    match Engine::new("stale", c) {
        Ok(_) => println!("STALE-OK"),
        Err(e) => println!("STALE-ERR {e}"),
    }
    for ep in 0..2 {
        let _ = std::fs::remove_file(format!("/dev/shm/{pid}:0:{ep}"));
    }
}

#[test]
fn shm_rail_opens_over_a_region_left_by_a_dead_process_with_the_same_pid() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_with_a_stale_shm_region", "--nocapture", "--test-threads=1"])
        .env("NF_CHILD_STALE_SHM", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("STALE-OK"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
}
