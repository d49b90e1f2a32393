//! Notifications sent right behind their data (FI_ORDER_SAW on rail 0, transport/rma.rs
//! `notif_behind`), over real providers on lo between two engines of this process, with
//! provider faults injected on both (FI_EAGAIN storms, late and reordered completions,
//! failed posts):
//! - the target sees a WRITE's notification only when every byte of it is in its memory:
//!   a thread of the target's side polls its notifications and compares the buffer the
//!   moment one shows, while the initiator may not even have its completion yet;
//! - a WRITE's success means its bytes are visible: compared right after the first success;
//! - a failed WRITE (a failed post) delivers no notification, except a small one carried in
//!   a control message (transport/eager.rs) whose answer the target failed to send: its
//!   notification came, with every byte of it in place (checked as any other);
//! - the path really ran: the initiator's `notifs_ordered` counter.
//!
//! `NF_FAULT_SEED` replaces the seed.
use nixl_fabric::config::Config;
use nixl_fabric::engine::{Engine, MemKind, Op, Pair};
use nixl_fabric::error::Status;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One run at a time (engines of two runs on two cores would miss their deadlines).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const SPAN: usize = 256 << 10;

/// Writes of at most this many bytes go in a control message (config eager_write_bytes).
const EAGER_BYTES: usize = 8 << 10;

fn cfg(provider: &str, rails: u32, spec: &str) -> Config {
    let mut c = Config::defaults();
    c.set("provider", provider).unwrap();
    c.set("iface", "lo").unwrap();
    c.set("progress_thread", "true").unwrap();
    c.set("same_host_shm", "false").unwrap();
    c.set("rails", &rails.to_string()).unwrap();
    c.set("timeout_ms", "10000").unwrap();
    c.set("fault_inject", spec).unwrap();
    c
}

/// A byte that names its offset and round, never 0.
fn pattern(i: usize, round: usize) -> u8 {
    let x = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (round as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03);
    ((x ^ (x >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 56) as u8 | 1
}

/// The shape of round `round`: (descriptors, bytes each). Small ones stay on rail 0
/// (notif_rail0_bytes); the 8 x 32 KiB one goes round-robin when there are two rails.
fn shape(round: usize) -> (usize, usize) {
    [(1, 4 << 10), (1, 64 << 10), (16, 4 << 10), (8, 32 << 10)][round % 4]
}

#[derive(Debug, Default)]
struct Tally {
    ok: usize,
    failed: usize,
    seen: usize,
    /// Successful rounds whose data all went on rail 0 (so their notification went behind it).
    ok_on_rail0: usize,
    ordered: u64,
    /// Failed eager writes whose notification came anyway (their answer was lost).
    answer_lost: usize,
}

fn run(provider: &str, rails: u32, spec: &str, rounds: usize) -> Tally {
    nixl_fabric::logging::init();
    let c = cfg(provider, rails, spec);
    let a = Engine::new("a", c.clone()).unwrap();
    let b = Engine::new("b", c).unwrap();
    a.load_conn_info("b", b.conn_info()).unwrap();
    b.load_conn_info("a", a.conn_info()).unwrap();
    let mut local = vec![0u8; SPAN];
    let remote = vec![0u8; SPAN];
    let ml = a.register(local.as_ptr() as u64, SPAN as u64, MemKind::Dram, 0).unwrap();
    let mr = b.register(remote.as_ptr() as u64, SPAN as u64, MemKind::Dram, 0).unwrap();
    let rd = a.load_remote("b", &b.public_data(&mr).unwrap()).unwrap();
    let name = format!("{provider} rails={rails} [{spec}]");

    // The target's watcher: checks round r's bytes the moment "round r" shows, then says
    // what it found. The buffer is written only by the provider (under b's progress) and
    // read here after the notification, which b hands over under a lock.
    let (tx, rx) = mpsc::channel::<(usize, Result<(), String>)>();
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (b, stop, at) = (b.clone(), stop.clone(), remote.as_ptr() as usize);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                for (_, msg) in b.take_notifs() {
                    let text = String::from_utf8_lossy(&msg).into_owned();
                    let round: usize = text.strip_prefix("round ").and_then(|r| r.parse().ok()).expect("a notification of ours");
                    let (n, bs) = shape(round);
                    // SAFETY: the buffer outlives the watcher (joined below) and holds SPAN bytes.
                    let dst = unsafe { std::slice::from_raw_parts(at as *const u8, SPAN) };
                    let res = (0..n).find_map(|k| {
                        let (src, d) = (k * bs, (n - 1 - k) * bs);
                        (0..bs).find(|&j| dst[d + j] != pattern(src + j, round)).map(|j| format!("block {k} byte {j}: {} != {}", dst[d + j], pattern(src + j, round)))
                    });
                    tx.send((round, res.map_or(Ok(()), Err))).unwrap();
                }
                std::hint::spin_loop();
            }
        })
    };

    let mut t = Tally::default();
    for round in 0..rounds {
        let (n, bs) = shape(round);
        for (i, x) in local[..n * bs].iter_mut().enumerate() {
            *x = pattern(i, round);
        }
        // Blocks land in reverse order, so a misplaced block shows.
        let pairs: Vec<Pair> = (0..n)
            .map(|k| Pair { local: (local.as_ptr() as u64 + (k * bs) as u64, bs as u64, &ml), remote: (remote.as_ptr() as u64 + ((n - 1 - k) * bs) as u64, bs as u64, &rd) })
            .collect();
        let req = a.prepare(Op::Write, &pairs, "b").unwrap();
        let mut s = a.post(&req, Some(format!("round {round}").into_bytes())).unwrap_or_else(|e| e.status());
        let deadline = Instant::now() + Duration::from_secs(30);
        while s == Status::NF_IN_PROG {
            assert!(Instant::now() < deadline, "{name} round {round}: never ended");
            s = a.check(&req);
        }
        assert!(a.release(&req), "{name} round {round}: release did not drain");
        if s == Status::NF_SUCCESS {
            // Done means delivered: the bytes are there now, before anything else runs.
            // SAFETY: the buffer lives to the end of the run; the provider wrote it before the
            // completion this thread read (under the engine's locks).
            let remote = unsafe { std::slice::from_raw_parts(remote.as_ptr(), SPAN) };
            for k in 0..n {
                let d = (n - 1 - k) * bs;
                if let Some(j) = (0..bs).find(|&j| remote[d + j] != pattern(k * bs + j, round)) {
                    panic!("{name} round {round}: NIXL_SUCCESS, but block {k} byte {j} is not there yet");
                }
            }
            t.ok += 1;
            if rails == 1 || n * bs <= 64 << 10 {
                t.ok_on_rail0 += 1;
            }
            let (r, res) = rx.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|_| panic!("{name} round {round}: WRITE succeeded, its notification never arrived"));
            assert_eq!(r, round, "{name}: a notification of another round");
            if let Err(e) = res {
                panic!("{name} round {round}: the target saw the notification before the data: {e}");
            }
            t.seen += 1;
        } else {
            t.failed += 1;
            // A failed post sends no notification (the test injects no error completions),
            // but an eager write's answer may be the post the fault layer refused.
            if let Ok((r, res)) = rx.recv_timeout(Duration::from_millis(100)) {
                let eager = n * bs <= EAGER_BYTES && r == round;
                if !eager {
                    panic!("{name} round {round} failed ({}), yet notification of round {r} arrived", s.name());
                }
                if let Err(e) = res {
                    panic!("{name} round {round}: a lost answer's notification came before its data: {e}");
                }
                t.answer_lost += 1;
            }
        }
    }
    stop.store(true, Ordering::Release);
    watcher.join().unwrap();
    t.ordered = a.counters().notifs_ordered;
    drop((ml, mr, rd));
    a.shutdown();
    b.shutdown();
    t
}

fn seed(default: u64) -> u64 {
    std::env::var("NF_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

#[test]
fn notifications_behind_data_only_show_with_the_bytes_under_faults() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let s = seed(5);
    for (provider, rails) in [("tcp", 1), ("tcp", 2), ("sockets", 1)] {
        let spec = format!("eagain=0.2,eagain_burst=4,reorder=0.5,delay=4,post_fail=0.03,seed={s}");
        let t = run(provider, rails, &spec, 80);
        let name = format!("{provider} rails={rails} [{spec}]");
        eprintln!("{name}: {t:?}");
        assert!(t.failed > 0, "{name}: no request was hit; raise post_fail");
        assert!(t.ok > t.failed, "{name}: {t:?}");
        // Every round on one rail, and the small ones on two, go behind their data.
        assert!(t.ordered as usize >= t.ok_on_rail0, "{name}: only {} notifications went right behind their data: {t:?}", t.ordered);
    }
}

#[test]
fn without_faults_every_small_write_goes_behind_its_data() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for provider in ["tcp", "sockets"] {
        let t = run(provider, 2, "", 40);
        assert_eq!((t.ok, t.failed, t.seen), (40, 0, 40), "{provider}: {t:?}");
        assert_eq!(t.ordered, 30, "{provider}: the 30 small rounds (3 of 4 shapes) go behind their data: {t:?}");
    }
}

/// A small write whose notification does not fit one control message with its bytes (256
/// blocks of 16 B, a notification of 4000 B, control buffers sized for 4 KiB notifications):
/// its bytes go as an eager write and the notification after the answer, still only with
/// every byte in place.
#[test]
fn a_notification_too_large_for_the_put_follows_its_answer() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    nixl_fabric::logging::init();
    let mut c = cfg("tcp", 1, "");
    c.set("max_notif_size", "4096").unwrap();
    let a = Engine::new("a", c.clone()).unwrap();
    let b = Engine::new("b", c).unwrap();
    a.load_conn_info("b", b.conn_info()).unwrap();
    b.load_conn_info("a", a.conn_info()).unwrap();
    let local: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8 | 1).collect();
    let remote = vec![0u8; 8192];
    let ml = a.register(local.as_ptr() as u64, 8192, MemKind::Dram, 0).unwrap();
    let mr = b.register(remote.as_ptr() as u64, 8192, MemKind::Dram, 0).unwrap();
    let rd = a.load_remote("b", &b.public_data(&mr).unwrap()).unwrap();
    // Every other 16-byte block, so that none join.
    let pairs: Vec<Pair> = (0..256u64).map(|k| Pair { local: (local.as_ptr() as u64 + 32 * k, 16, &ml), remote: (remote.as_ptr() as u64 + 32 * k, 16, &rd) }).collect();
    let req = a.prepare(Op::Write, &pairs, "b").unwrap();
    let msg = vec![b'n'; 4000];
    let mut s = a.post(&req, Some(msg.clone())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while s == Status::NF_IN_PROG {
        assert!(Instant::now() < deadline, "never ended");
        s = a.check(&req);
    }
    assert_eq!(s, Status::NF_SUCCESS);
    let mut got = Vec::new();
    while got.is_empty() {
        assert!(Instant::now() < deadline, "no notification");
        b.progress();
        got = b.take_notifs();
    }
    assert_eq!(got, vec![("a".to_string(), msg)]);
    for k in 0..256usize {
        assert_eq!(&remote[32 * k..32 * k + 16], &local[32 * k..32 * k + 16], "block {k}");
        assert!(remote[32 * k + 16..32 * k + 32].iter().all(|&x| x == 0), "gap after block {k} written");
    }
    // One PUT carried the 256 blocks (RMA would have taken 64 operations and a flush read),
    // and the notification went on its own.
    let c = a.counters();
    assert_eq!((c.ops_completed, c.bytes_written, c.notifs_ordered), (1, 4096, 0), "{c:?}");
    assert!(a.release(&req));
    drop((ml, mr, rd));
    a.shutdown();
    b.shutdown();
}
