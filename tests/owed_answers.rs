//! Answers owed to eager writes (transport/eager.rs, config `owe_put_answers`), between two
//! engines of this process over tcp on lo with the progress thread off: each side makes a
//! pass only when the test calls it, so every step is ordered by the test.
//! - the target's call that takes a notification sends no answer; the initiator's write is
//!   not done until the target calls again;
//! - a target that writes back carries the answer in its own eager write (`acks_carried`),
//!   and the initiator's write is done in the pass that takes the target's notification;
//! - a target that only polls answers in its next call; one that disconnects the initiator
//!   or shuts down answers before it goes;
//! - to a peer that does not read answers in Puts (an older build's connection info), and
//!   with the key off, they go as PUT_ACK messages;
//! - under injected faults (FI_EAGAIN storms, late and reordered completions) every
//!   ping-pong round is byte-exact and every write ends in success.
use nixl_fabric::config::Config;
use nixl_fabric::engine::wire::ConnInfo;
use nixl_fabric::engine::{Engine, LocalMem, MemKind, Op, Pair, RemoteMem, Request};
use nixl_fabric::error::Status;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One pair of engines at a time (two cores).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const SPAN: usize = 64 << 10;
const N: usize = 4096;

fn cfg(spec: &str, owe: bool) -> Config {
    let mut c = Config::defaults();
    c.set("provider", "tcp").unwrap();
    c.set("iface", "lo").unwrap();
    c.set("progress_thread", "false").unwrap();
    c.set("same_host_shm", "false").unwrap();
    c.set("rails", "1").unwrap();
    c.set("timeout_ms", "10000").unwrap();
    c.set("owe_put_answers", if owe { "true" } else { "false" }).unwrap();
    c.set("fault_inject", spec).unwrap();
    c
}

/// One side: its engine, its buffer (first half written by the peer, second half the
/// source of its own writes), and a prepared write of N bytes into the peer's first half.
struct Side {
    e: Arc<Engine>,
    buf: Vec<u8>,
    mem: Option<Arc<LocalMem>>,
    peer_mem: Option<Arc<RemoteMem>>,
}

impl Side {
    fn write(&self, peer: &str) -> Arc<Request> {
        let (ml, rd) = (self.mem.as_ref().unwrap(), self.peer_mem.as_ref().unwrap());
        let pair = Pair { local: (self.buf.as_ptr() as u64 + (SPAN / 2) as u64, N as u64, ml), remote: (rd.range().0, N as u64, rd) };
        self.e.prepare(Op::Write, &[pair], peer).unwrap()
    }

    fn fill(&mut self, round: usize) {
        for (i, x) in self.buf[SPAN / 2..SPAN / 2 + N].iter_mut().enumerate() {
            *x = (i * 7 + round * 13) as u8 | 1;
        }
    }

    /// Polls until a notification shows (one pass per call, as an application's loop),
    /// with passes of `other` between (in two processes it polls meanwhile: tcp moves a
    /// message only while both ends progress).
    fn await_notif(&self, other: &Side, what: &str) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert!(Instant::now() < deadline, "{what}: no notification");
            other.e.progress();
            if let Some((_, m)) = self.e.take_notifs().pop() {
                return m;
            }
        }
    }
}

/// Two engines `a` and `b` that know each other (`b` told that `a` reads no answers in Puts
/// where `a_old`), each with a registration the other has loaded.
fn pair(spec: &str, owe: bool, a_old: bool) -> (Side, Side) {
    nixl_fabric::logging::init();
    let a = Engine::new("a", cfg(spec, owe)).unwrap();
    let b = Engine::new("b", cfg(spec, owe)).unwrap();
    a.load_conn_info("b", b.conn_info()).unwrap();
    let a_info = if a_old {
        let mut info = ConnInfo::decode(a.conn_info()).unwrap();
        info.put_acks = false;
        info.encode()
    } else {
        a.conn_info().to_vec()
    };
    b.load_conn_info("a", &a_info).unwrap();
    let mut sa = Side { e: a, buf: vec![0u8; SPAN], mem: None, peer_mem: None };
    let mut sb = Side { e: b, buf: vec![0u8; SPAN], mem: None, peer_mem: None };
    sa.mem = Some(sa.e.register(sa.buf.as_ptr() as u64, SPAN as u64, MemKind::Dram, 0).unwrap());
    sb.mem = Some(sb.e.register(sb.buf.as_ptr() as u64, SPAN as u64, MemKind::Dram, 0).unwrap());
    sa.peer_mem = Some(sa.e.load_remote("b", &sb.e.public_data(sb.mem.as_ref().unwrap()).unwrap()).unwrap());
    sb.peer_mem = Some(sb.e.load_remote("a", &sa.e.public_data(sa.mem.as_ref().unwrap()).unwrap()).unwrap());
    (sa, sb)
}

/// Polls `req` of `s` to its end, with passes of `other` between (as await_notif).
fn finish(s: &Side, other: &Side, req: &Request, what: &str) -> Status {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        other.e.progress();
        let st = s.e.check(req);
        if st != Status::NF_IN_PROG {
            return st;
        }
        assert!(Instant::now() < deadline, "{what}: never ended");
    }
}

/// A few passes of `s` alone (its peer makes none meanwhile).
fn spin(s: &Side, req: &Request, passes: usize) -> Status {
    for _ in 0..passes {
        std::thread::sleep(Duration::from_micros(200));
        let st = s.e.check(req);
        if st != Status::NF_IN_PROG {
            return st;
        }
    }
    Status::NF_IN_PROG
}

fn bytes_at(s: &Side, round: usize) -> bool {
    s.buf[..N].iter().enumerate().all(|(i, &x)| x == (i * 7 + round * 13) as u8 | 1)
}

fn ping_pong(spec: &str, rounds: usize, a_old: bool) -> (Side, Side) {
    let (mut a, mut b) = pair(spec, true, a_old);
    let (ping, pong) = (a.write("b"), b.write("a"));
    for r in 0..rounds {
        a.fill(2 * r);
        assert_eq!(a.e.post(&ping, Some(format!("ping {r}").into_bytes())).unwrap_or_else(|e| e.status()), Status::NF_IN_PROG, "round {r}");
        assert_eq!(b.await_notif(&a, "ping"), format!("ping {r}").into_bytes());
        assert!(bytes_at(&b, 2 * r), "round {r}: the ping's notification came before its bytes");
        if r > 0 {
            // The ping carried the answer to the last pong: done in the pass that took it.
            assert_eq!(b.e.check(&pong), Status::NF_SUCCESS, "round {r}: the last pong");
        }
        b.fill(2 * r + 1);
        let st = b.e.post(&pong, Some(format!("pong {r}").into_bytes())).unwrap_or_else(|e| e.status());
        assert_eq!(st, Status::NF_IN_PROG, "round {r}: pong");
        assert_eq!(a.await_notif(&b, "pong"), format!("pong {r}").into_bytes());
        assert!(bytes_at(&a, 2 * r + 1), "round {r}: the pong's notification came before its bytes");
        assert_eq!(a.e.check(&ping), Status::NF_SUCCESS, "round {r}: the ping");
    }
    // The last pong's answer is owed until a's next call.
    assert_eq!(spin(&b, &pong, 10), Status::NF_IN_PROG, "answered before the initiator's next call");
    assert_eq!(finish(&b, &a, &pong, "the last pong"), Status::NF_SUCCESS);
    assert!(a.e.release(&ping) && b.e.release(&pong));
    (a, b)
}

#[test]
fn a_target_that_writes_back_carries_its_answer_and_a_poller_answers_on_its_next_call() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (a, b) = ping_pong("", 20, false);
    // Every pong carried the ping's answer; every ping after the first the last pong's.
    assert_eq!(b.e.counters().acks_carried, 20);
    assert_eq!(a.e.counters().acks_carried, 19);

    // One way: the call that takes the notification leaves the answer owed.
    let mut a = a;
    let w = a.write("b");
    a.fill(100);
    assert_eq!(a.e.post(&w, Some(b"one way".to_vec())).unwrap(), Status::NF_IN_PROG);
    assert_eq!(b.await_notif(&a, "one way"), b"one way");
    assert_eq!(spin(&a, &w, 20), Status::NF_IN_PROG, "answered before the target's next call");
    assert!(b.e.take_notifs().is_empty());
    assert_eq!(finish(&a, &b, &w, "one way"), Status::NF_SUCCESS);
    assert!(bytes_at(&b, 100));
    assert!(a.e.release(&w));

    // A target that disconnects the initiator right after the notification answers first.
    a.fill(101);
    assert_eq!(a.e.post(&w, Some(b"bye".to_vec())).unwrap(), Status::NF_IN_PROG);
    assert_eq!(b.await_notif(&a, "bye"), b"bye");
    b.e.disconnect("a").unwrap();
    assert_eq!(finish(&a, &b, &w, "before a disconnect"), Status::NF_SUCCESS);
    assert!(a.e.release(&w));
    b.e.load_conn_info("a", a.e.conn_info()).unwrap();

    // One that shuts down answers in its last passes.
    a.fill(102);
    assert_eq!(a.e.post(&w, Some(b"last".to_vec())).unwrap(), Status::NF_IN_PROG);
    assert_eq!(b.await_notif(&a, "last"), b"last");
    b.e.shutdown();
    assert_eq!(finish(&a, &b, &w, "before a shutdown"), Status::NF_SUCCESS);
    assert!(bytes_at(&b, 102));
    assert!(a.e.release(&w));
}

#[test]
fn answers_go_on_their_own_to_an_older_peer_and_with_the_key_off() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (a, b) = ping_pong("", 10, true);
    assert_eq!(b.e.counters().acks_carried, 0, "b carried answers to a peer that does not read them");
    assert_eq!(a.e.counters().acks_carried, 9);
    drop((a, b));

    let (mut a, b) = pair("", false, false);
    let w = a.write("b");
    a.fill(7);
    assert_eq!(a.e.post(&w, Some(b"now".to_vec())).unwrap(), Status::NF_IN_PROG);
    assert_eq!(b.await_notif(&a, "now"), b"now");
    // The target made its one pass: with the key off its answer went in it.
    assert_eq!(spin(&a, &w, 500), Status::NF_SUCCESS, "key off: no answer without the target's next call");
    assert!(a.e.release(&w));
}

#[test]
fn ping_pong_with_owed_answers_is_byte_exact_under_faults() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let s: u64 = std::env::var("NF_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(11);
    let spec = format!("eagain=0.3,eagain_burst=4,reorder=0.5,delay=4,seed={s}");
    let (a, b) = ping_pong(&spec, 60, false);
    assert!(b.e.counters().acks_carried >= 30, "{spec}: only {} answers carried", b.e.counters().acks_carried);
    assert!(a.e.counters().retries + b.e.counters().retries > 0, "{spec}: no FI_EAGAIN was injected");
}
