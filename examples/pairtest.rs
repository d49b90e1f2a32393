//! Two-process transfer check used by the multi-rail network-namespace test.
//!   pairtest target DIR [key=value ...]     serve a 64 MiB region until DIR/quit appears
//!   pairtest initiator DIR [key=value ...]  WRITE then READ it back, verify, print rail bytes
use nixl_fabric::config::Config;
use nixl_fabric::engine::{Engine, MemKind, Op, Pair};
use nixl_fabric::error::Status;
use std::path::Path;
use std::time::{Duration, Instant};

const SIZE: usize = 64 << 20;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex")).collect()
}

fn wait(e: &Engine, r: &nixl_fabric::engine::Request) -> Status {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = e.check(r);
        if s != Status::NF_IN_PROG || Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn main() {
    nixl_fabric::logging::init();
    let args: Vec<String> = std::env::args().collect();
    let (role, dir) = (args[1].as_str(), Path::new(&args[2]));
    let mut cfg = Config::from_env().expect("config");
    for kv in &args[3..] {
        let (k, v) = kv.split_once('=').expect("key=value");
        cfg.set(k, v).expect("parameter");
    }
    let e = Engine::new(role, cfg).expect("engine");
    let buf = vec![0u8; SIZE];
    let m = e.register(buf.as_ptr() as u64, SIZE as u64, MemKind::Dram, 0).expect("register");
    if role == "target" {
        let info = format!("{} {} {}\n", hex(e.conn_info()), hex(&e.public_data(&m).unwrap()), buf.as_ptr() as u64);
        std::fs::write(dir.join("target.tmp"), info).unwrap();
        std::fs::rename(dir.join("target.tmp"), dir.join("target.info")).unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while !dir.join("quit").exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let info = loop {
        if let Ok(s) = std::fs::read_to_string(dir.join("target.info")) {
            break s;
        }
        assert!(Instant::now() < deadline, "no target.info");
        std::thread::sleep(Duration::from_millis(20));
    };
    let f: Vec<&str> = info.split_whitespace().collect();
    e.load_conn_info("target", &unhex(f[0])).expect("conn info");
    let rm = e.load_remote("target", &unhex(f[1])).expect("descriptor");
    let raddr: u64 = f[2].parse().unwrap();
    let src: Vec<u8> = (0..SIZE).map(|i| (i % 251) as u8 ^ 0x5a).collect();
    let sm = e.register(src.as_ptr() as u64, SIZE as u64, MemKind::Dram, 0).unwrap();
    // One large descriptor (striped over the rails) and 64 small ones (spread round-robin).
    let mut pairs = vec![Pair { local: (src.as_ptr() as u64, (SIZE / 2) as u64, &sm), remote: (raddr, (SIZE / 2) as u64, &rm) }];
    let small = SIZE / 2 / 64;
    for i in 0..64 {
        let off = (SIZE / 2 + i * small) as u64;
        pairs.push(Pair { local: (src.as_ptr() as u64 + off, small as u64, &sm), remote: (raddr + off, small as u64, &rm) });
    }
    let w = e.prepare(Op::Write, &pairs, "target").unwrap();
    let s = e.post(&w, None).unwrap();
    let s = if s == Status::NF_IN_PROG { wait(&e, &w) } else { s };
    assert_eq!(s, Status::NF_SUCCESS, "WRITE");
    let back = [Pair { local: (buf.as_ptr() as u64, SIZE as u64, &m), remote: (raddr, SIZE as u64, &rm) }];
    let r = e.prepare(Op::Read, &back, "target").unwrap();
    let s = e.post(&r, None).unwrap();
    let s = if s == Status::NF_IN_PROG { wait(&e, &r) } else { s };
    assert_eq!(s, Status::NF_SUCCESS, "READ");
    assert!(buf == src, "bytes differ after WRITE + READ");
    println!("pairtest: {} local rail(s), 64 MiB WRITE + READ byte-exact", e.rail_count());
    for i in 0..e.rail_count() {
        println!("rail {i} bytes {}", e.rail_counters(i).unwrap().bytes);
    }
    std::fs::write(dir.join("quit"), b"").unwrap();
}
