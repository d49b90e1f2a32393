//! Requests under injected provider faults (config `fault_inject`, see the README's "Fault
//! injection"), two engines of this process over real providers on lo:
//! - transparent faults (FI_EAGAIN storms, late and reordered completions): every request
//!   succeeds with its bytes exact;
//! - error faults (error completions, failed posts): an affected request fails with a NIXL
//!   error status, never succeeds with wrong bytes; nothing hangs (every wait is bounded,
//!   every release drains); requests after a failure still succeed.
//!
//! `NF_FAULT_SEED` replaces the seeds below (to explore; a failure names its seed).
use nixl_fabric::config::Config;
use nixl_fabric::engine::{Engine, MemKind, Op, Pair};
use nixl_fabric::error::Status;
use std::time::{Duration, Instant};

const BLOCKS: usize = 8;
const BS: usize = 32 << 10;

/// One run at a time: four engines of two runs on two cores would miss `timeout_ms`.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn cfg(provider: &str, thread: bool, rails: u32, spec: &str) -> Config {
    let mut c = Config::defaults();
    c.set("provider", provider).unwrap();
    c.set("iface", "lo").unwrap();
    c.set("progress_thread", if thread { "true" } else { "false" }).unwrap();
    c.set("same_host_shm", "false").unwrap();
    c.set("rails", &rails.to_string()).unwrap();
    // Long enough for a loaded 2-core host; a failure below is a fault, not a slow peer.
    c.set("timeout_ms", "10000").unwrap();
    c.set("fault_inject", spec).unwrap();
    c
}

fn seed(default: u64) -> u64 {
    std::env::var("NF_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// A byte that names its offset and round (no two (offset, round) pairs of a run share
/// their 8-byte run), so misplaced or stale bytes can be traced to where they came from.
fn pattern(i: usize, round: usize) -> u8 {
    let x = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (round as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03);
    ((x ^ (x >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 56) as u8 | 1
}

/// Where block k of one side starts.
type BlockAt = fn(usize) -> usize;

#[derive(Default, Debug)]
struct Tally {
    ok: usize,
    failed: usize,
    ok_after_failure: usize,
    last_failed: Option<usize>,
    statuses: Vec<Status>,
    /// (round, offset, last failed round): bytes of an ended request that landed later.
    late: Vec<(usize, usize, Option<usize>)>,
    /// Failed WRITEs whose notification reached the target anyway.
    notified_failures: Vec<usize>,
}

/// `rounds` requests alternating WRITE and READ of BLOCKS descriptors between two engines
/// with `spec` injected on both. Panics on a success with wrong bytes, on a hang, on a
/// release that does not drain. `settle`: after a failed request, let both engines
/// progress for a while before the next round rewrites the buffers (a known engine bug
/// lets a failed WRITE's bytes land later; see `no_bytes_land_after_a_failed_request_ended`).
/// `strict`: every request must succeed (transparent faults).
fn run(provider: &str, thread: bool, rails: u32, spec: &str, rounds: usize, settle: bool, strict: bool) -> Tally {
    nixl_fabric::logging::init();
    let c = cfg(provider, thread, rails, spec);
    let a = Engine::new("a", c.clone()).unwrap();
    let b = Engine::new("b", c).unwrap();
    a.load_conn_info("b", b.conn_info()).unwrap();
    b.load_conn_info("a", a.conn_info()).unwrap();
    let size = BLOCKS * BS;
    let mut local = vec![0u8; size];
    let mut remote = vec![0u8; size];
    let ml = a.register(local.as_ptr() as u64, size as u64, MemKind::Dram, 0).unwrap();
    let mr = b.register(remote.as_ptr() as u64, size as u64, MemKind::Dram, 0).unwrap();
    let rd = a.load_remote("b", &b.public_data(&mr).unwrap()).unwrap();
    let mut t = Tally::default();
    let mut notifs: Vec<Vec<u8>> = Vec::new();
    for round in 0..rounds {
        let op = if round % 2 == 0 { Op::Write } else { Op::Read };
        // The side the bytes come from holds this round's pattern, the other zeros.
        let (from, to) = if op == Op::Write { (&mut local, &mut remote) } else { (&mut remote, &mut local) };
        for (i, x) in from.iter_mut().enumerate() {
            *x = pattern(i, round);
        }
        to.fill(0);
        // Blocks in reverse order on the remote side, so a misplaced block shows.
        let pairs: Vec<Pair> = (0..BLOCKS)
            .map(|k| Pair {
                local: (local.as_ptr() as u64 + (k * BS) as u64, BS as u64, &ml),
                remote: (remote.as_ptr() as u64 + ((BLOCKS - 1 - k) * BS) as u64, BS as u64, &rd),
            })
            .collect();
        let req = a.prepare(op, &pairs, "b").unwrap();
        // WRITEs carry a notification naming their round (rule 5: only after every byte).
        let notif = (op == Op::Write).then(|| format!("round {round}").into_bytes());
        let mut s = match a.post(&req, notif.clone()) {
            Ok(s) => s,
            Err(e) => e.status(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while s == Status::NF_IN_PROG {
            assert!(Instant::now() < deadline, "{provider} thread={thread} rails={rails} [{spec}] round {round}: request never ended");
            b.progress();
            s = a.check(&req);
        }
        assert!(a.release(&req), "{provider} [{spec}] round {round}: release did not drain");
        drop(req);
        // Where the bytes of local block k come from / go to: remote block BLOCKS-1-k.
        let (src, dst, src_base, dst_base): (&[u8], &[u8], BlockAt, BlockAt) = if op == Op::Write {
            (&local, &remote, |k| k * BS, |k| (BLOCKS - 1 - k) * BS)
        } else {
            (&remote, &local, |k| (BLOCKS - 1 - k) * BS, |k| k * BS)
        };
        // Notifications seen by the target so far (it polls its own in the loop below).
        let mut seen = |b: &Engine, want: &[u8], wait: Duration| {
            let until = Instant::now() + wait;
            loop {
                notifs.extend(b.take_notifs().into_iter().map(|(_, m)| m));
                if notifs.iter().any(|m| m == want) || Instant::now() >= until {
                    return notifs.iter().any(|m| m == want);
                }
                a.progress();
            }
        };
        if let Some(n) = &notif {
            if s == Status::NF_SUCCESS {
                assert!(seen(&b, n, Duration::from_secs(10)), "{provider} [{spec}] round {round}: WRITE succeeded, its notification never arrived");
            } else if settle && seen(&b, n, Duration::from_millis(100)) {
                // (Looking pumps both engines: without `settle` the next round starts at once.)
                t.notified_failures.push(round);
            }
        }
        if s == Status::NF_SUCCESS {
            // The destination holds exactly this round's bytes, each block in its place.
            for k in 0..BLOCKS {
                let (sb, db) = (src_base(k), dst_base(k));
                if let Some(j) = (0..BS).find(|&j| dst[db + j] != pattern(sb + j, round)) {
                    // An earlier round's bytes from the same source place, or (a failed WRITE's
                    // bytes landing late, then read back) from the place they now occupy.
                    let whose = (0..round).rev().find(|&q| (j..(j + 8).min(BS)).all(|x| dst[db + x] == pattern(sb + x, q) || dst[db + x] == pattern(db + x, q)));
                    let wrong = (0..BS).filter(|&x| dst[db + x] != pattern(sb + x, round)).count();
                    let zeros = (0..BS).filter(|&x| dst[db + x] == 0).count();
                    // Late rather than lost? Give the provider a moment, then look again.
                    for _ in 0..1000 {
                        a.progress();
                        b.progress();
                    }
                    std::thread::sleep(Duration::from_millis(200));
                    let wrong_later = (0..BS).filter(|&x| dst[db + x] != pattern(sb + x, round)).count();
                    let origin = (0..=round).rev().find_map(|q| (0..size / BS).find(|&o| (0..BS).all(|x| dst[db + x] == pattern(o * BS + x, q))).map(|o| (q, o)));
                    eprintln!("block {k}: {wrong} wrong bytes ({zeros} zero), {wrong_later} wrong 200 ms later; holds (round, source block) {origin:?}");
                    panic!("{provider} thread={thread} rails={rails} [{spec}] round {round} ({op:?}): NIXL_SUCCESS with wrong bytes in block {k} \
                            at byte {j} (round {whose:?}'s bytes?; {} requests failed before, the last at round {:?})", t.failed, t.last_failed);
                }
            }
            t.ok += 1;
            if t.failed > 0 {
                t.ok_after_failure += 1;
            }
        } else {
            assert!(!strict, "{provider} thread={thread} rails={rails} [{spec}] round {round} ({op:?}): {} under faults that must be invisible", s.name());
            t.failed += 1;
            t.last_failed = Some(round);
            t.statuses.push(s);
            if settle {
                let until = Instant::now() + Duration::from_millis(50);
                while Instant::now() < until {
                    a.progress();
                    b.progress();
                }
            }
        }
        // The source must still hold this round's bytes: anything else landed there after
        // an earlier request had ended (failed and released), while this one ran.
        if let Some(i) = (0..size).find(|&i| src[i] != pattern(i, round)) {
            t.late.push((round, i, t.last_failed));
        }
    }
    drop((ml, mr, rd));
    a.shutdown();
    b.shutdown();
    t
}

#[test]
fn transparent_faults_are_invisible() {
    let _one = serial();
    let s = seed(7);
    // Three tcp rails over lo: bulk data keeps off rail 0 (rma_rail0), the flush reads and the
    // notification then cross rails.
    for (prov, thread, rails) in [("tcp", true, 1), ("tcp", false, 1), ("tcp", true, 2), ("tcp", true, 3), ("sockets", true, 1)] {
        let spec = format!("eagain=0.3,eagain_burst=8,reorder=0.5,delay=4,hold=16,seed={s}");
        let t = run(prov, thread, rails, &spec, 40, false, true);
        assert_eq!(t.failed, 0, "{prov} thread={thread} rails={rails} [{spec}]: {t:?}");
    }
}

const ERROR_SPEC: &str = "cq_error=0.02,post_fail=0.01,eagain=0.1,eagain_burst=3,reorder=0.3";
const CASES: [(&str, bool, u32); 5] = [("tcp", true, 1), ("tcp", false, 1), ("tcp", true, 2), ("tcp", true, 3), ("sockets", true, 1)];

/// `NF_FAULT_SPEC` replaces the error spec (the seed is added), `NF_FAULT_CASE`
/// (`provider/thread/rails`, e.g. `tcp/true/2`) picks one case.
fn error_runs(default_seed: u64, rounds: usize, settle: bool) -> Vec<(String, Tally)> {
    error_runs_of(ERROR_SPEC, default_seed, rounds, settle)
}

fn error_runs_of(default_spec: &str, default_seed: u64, rounds: usize, settle: bool) -> Vec<(String, Tally)> {
    let s = seed(default_seed);
    let mut out = Vec::new();
    for (prov, thread, rails) in CASES {
        if std::env::var("NF_FAULT_CASE").is_ok_and(|c| c != format!("{prov}/{thread}/{rails}")) {
            continue;
        }
        let spec = format!("{},seed={s}", std::env::var("NF_FAULT_SPEC").unwrap_or_else(|_| default_spec.into()));
        let t = run(prov, thread, rails, &spec, rounds, settle, false);
        let name = format!("{prov} thread={thread} rails={rails} [{spec}]");
        eprintln!("{name}: {} ok, {} failed ({} ok after a failure), late landings {:?}, failed WRITEs notified {:?}", t.ok, t.failed, t.ok_after_failure, t.late, t.notified_failures);
        out.push((name, t));
    }
    out
}

#[test]
fn error_faults_fail_requests_and_later_ones_work() {
    let _one = serial();
    for (name, t) in error_runs(11, 120, true) {
        assert!(t.failed > 0, "{name}: no request was hit; raise the rates");
        assert!(t.ok_after_failure > 0, "{name}: nothing succeeded after the first failure: {t:?}");
        assert!(t.statuses.iter().all(|s| s.code() < 0), "{name}: {t:?}");
    }
}

/// A WRITE that fails (here: one of its posts fails, so nothing reports a send that may
/// have been delivered) never delivers its notification (rules 5 and 8). With `cq_error`
/// on, a notification whose send completed and was then reported as an error does arrive
/// while its request fails: the provider said it failed after it was delivered, which the
/// engine cannot tell apart; so this runs without it.
#[test]
fn failed_writes_deliver_no_notification() {
    let _one = serial();
    for (name, t) in error_runs_of("post_fail=0.06,eagain=0.1,reorder=0.3", 13, 60, true) {
        assert!(t.failed > 0, "{name}: no request was hit; raise the rates");
        assert!(t.notified_failures.is_empty(), "{name}: failed WRITEs whose notification arrived: rounds {:?}", t.notified_failures);
    }
}

/// Regression (found by this layer): a WRITE that failed (an error completion or a failed
/// post on one of its operations) used to end, and its release to drain, while bytes of
/// its other operations, completed only at transmit over tcp, were still on their way to
/// the target: they landed after the request ended, over the next round's bytes (with the
/// progress thread off the next READ even returned them: NIXL_SUCCESS with the failed
/// WRITE's bytes). A failed post now runs its flush reads before it ends. Run alone:
/// `cargo test --release --test faults -- --ignored --nocapture` (NF_FAULT_SEED=4, 7, 11 or
/// 12 show it within 120 rounds, on one tcp rail with or without the progress thread and
/// on two).
#[test]
fn no_bytes_land_after_a_failed_request_ended() {
    let _one = serial();
    for (name, t) in error_runs(11, 120, false) {
        assert!(t.late.is_empty(), "{name}: bytes landed after their request ended (round, offset, last failed round): {:?}", t.late);
    }
}
