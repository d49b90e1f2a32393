//! Quick engine-level benchmark of the KV pattern (N descriptors per request), two engines
//! in one process. usage: kvbench [provider] [blocks] [block_size] [thread on/off]
use nixl_fabric::config::Config;
use nixl_fabric::engine::{Engine, MemKind, Op, Pair};
use nixl_fabric::error::Status;
use std::time::{Duration, Instant};

fn main() {
    nixl_fabric::logging::init();
    let a: Vec<String> = std::env::args().collect();
    let prov = a.get(1).map_or("tcp", |s| s.as_str());
    let blocks: usize = a.get(2).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let bs: usize = a.get(3).and_then(|s| s.parse().ok()).unwrap_or(16384);
    let thread = a.get(4).is_none_or(|s| s != "off");
    let mut c = Config::from_env().unwrap();
    c.set("provider", prov).unwrap();
    if prov != "shm" { c.set("iface", "lo").unwrap(); }
    c.progress_thread = thread;
    let x = Engine::new("x", c.clone()).unwrap();
    let y = Engine::new("y", c).unwrap();
    x.load_conn_info("y", y.conn_info()).unwrap();
    let n = blocks * bs;
    let src = vec![7u8; n];
    let dst = vec![0u8; n];
    let ms = x.register(src.as_ptr() as u64, n as u64, MemKind::Dram, 0).unwrap();
    let md = y.register(dst.as_ptr() as u64, n as u64, MemKind::Dram, 0).unwrap();
    let rd = x.load_remote("y", &y.public_data(&md).unwrap()).unwrap();
    let pairs: Vec<Pair> = (0..blocks).map(|i| Pair {
        local: (src.as_ptr() as u64 + (i * bs) as u64, bs as u64, &ms),
        remote: (dst.as_ptr() as u64 + (i * bs) as u64, bs as u64, &rd),
    }).collect();
    for op in [Op::Write, Op::Read] {
        let req = x.prepare(op, &pairs, "y").unwrap();
        let iters = 20;
        let t0 = Instant::now();
        let mut post_ns = 0u128;
        for _ in 0..iters {
            let tp = Instant::now();
            let mut s = x.post(&req, None).unwrap();
            post_ns += tp.elapsed().as_nanos();
            let dl = Instant::now() + Duration::from_secs(30);
            while s == Status::NF_IN_PROG {
                if !thread { y.progress(); } else { std::thread::sleep(Duration::from_micros(5)); }
                s = x.check(&req);
                assert!(Instant::now() < dl);
            }
            assert_eq!(s, Status::NF_SUCCESS);
        }
        let dt = t0.elapsed().as_secs_f64();
        println!("{prov} {op:?} {blocks} x {bs}: {:.3} GB/s, {:.1} ms/request, post {:.0} ns/desc", (n * iters) as f64 / dt / 1e9, dt * 1e3 / iters as f64, post_ns as f64 / (iters * blocks) as f64);
    }
    // 8-byte WRITE latency, post -> delivered.
    let pairs1 = [Pair { local: (src.as_ptr() as u64, 8, &ms), remote: (dst.as_ptr() as u64, 8, &rd) }];
    let req = x.prepare(Op::Write, &pairs1, "y").unwrap();
    let mut lat = Vec::new();
    for _ in 0..2000 {
        let t = Instant::now();
        let mut s = x.post(&req, None).unwrap();
        while s == Status::NF_IN_PROG {
            if !thread { y.progress(); }
            s = x.check(&req);
        }
        lat.push(t.elapsed().as_nanos() as u64);
    }
    lat.sort();
    println!("8 B WRITE latency: median {:.1} us, p99 {:.1} us", lat[1000] as f64 / 1e3, lat[1980] as f64 / 1e3);
    let c = x.counters();
    println!("retries {} ops {} passes {}", c.retries, c.ops_posted, c.progress_passes);
}
