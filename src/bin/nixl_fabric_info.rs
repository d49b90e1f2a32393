//! nixl-fabric-info: what the plugin would see and do on this host. Lists the libfabric
//! providers and their capabilities, the rails an engine would open with the given
//! parameters, whether a CUDA driver is present, and optionally runs a loopback self-test.
//!
//! usage: nixl-fabric-info [--self-test] [--config-table] [key=value ...]
use nixl_fabric::config::{Config, TUNABLES};
use nixl_fabric::engine::{Engine, MemKind, Op, Pair};
use nixl_fabric::error::Status;
use std::process::ExitCode;
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    nixl_fabric::logging::init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    const USAGE: &str = "usage: nixl-fabric-info [--self-test] [--config-table] [key=value ...]";
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    if let Some(bad) = args.iter().find(|a| !a.contains('=') && !matches!(a.as_str(), "--self-test" | "--config-table")) {
        eprintln!("unknown option '{bad}'\n{USAGE}");
        return ExitCode::from(2);
    }
    if args.iter().any(|a| a == "--config-table") {
        println!("| key | environment variable | default | meaning |");
        println!("|---|---|---|---|");
        for t in TUNABLES {
            println!("| `{}` | `{}` | `{}` | {} |", t.key, t.env, t.default, t.help);
        }
        return ExitCode::SUCCESS;
    }
    let mut cfg = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    for kv in args.iter().filter(|a| a.contains('=')) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        if let Err(e) = cfg.set(k, v) {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    println!("nixl-fabric {}", env!("CARGO_PKG_VERSION"));
    println!("libfabric runtime: {}", nixl_fabric::fabric::library_version());
    println!("cuda: {}", nixl_fabric::engine::cuda_summary());
    println!("\nproviders (RDM endpoints with messages and RMA):");
    println!("  {:<16} {:<10} {:<22} {:>4} {:>6} {:>8}", "provider", "domain", "fabric", "rma", "hmem", "cq_data");
    for p in nixl_fabric::fabric::provider_list() {
        println!("  {:<16} {:<10} {:<22} {:>4} {:>6} {:>8}", p.prov_name, p.domain, p.fabric, yn(p.rma), yn(p.hmem), p.cq_data_size);
    }
    println!("\nrails for provider={} iface='{}' rails={}:", cfg.provider, cfg.iface, cfg.rails);
    match nixl_fabric::fabric::discover(&cfg, nixl_fabric::cuda::available()) {
        Ok(specs) => {
            for s in &specs {
                println!("  {} domain {} fabric {}{}", s.prov_name, s.domain_name, s.fabric_name,
                    if s.delivery_complete { "" } else { " (no delivery-complete)" });
            }
        }
        Err(e) => {
            println!("  none: {e}");
            return ExitCode::from(1);
        }
    }
    if args.iter().any(|a| a == "--self-test") {
        return match self_test(&cfg) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("self-test FAILED: {e}");
                ExitCode::from(1)
            }
        };
    }
    ExitCode::SUCCESS
}

fn yn(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// Two engines in this process move 1 MiB and 64 MiB both ways and compare bytes.
fn self_test(cfg: &Config) -> Result<(), String> {
    let e = |x: nixl_fabric::error::Error| x.to_string();
    let a = Engine::new("self-test-a", cfg.clone()).map_err(e)?;
    let b = Engine::new("self-test-b", cfg.clone()).map_err(e)?;
    a.load_conn_info("self-test-b", b.conn_info()).map_err(e)?;
    b.load_conn_info("self-test-a", a.conn_info()).map_err(e)?;
    println!("\nself-test (two engines in one process):");
    for size in [1usize << 20, 64 << 20] {
        let mut src: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; size];
        let ms = a.register(src.as_mut_ptr() as u64, size as u64, MemKind::Dram, 0).map_err(e)?;
        let md = b.register(dst.as_mut_ptr() as u64, size as u64, MemKind::Dram, 0).map_err(e)?;
        let rd = a.load_remote("self-test-b", &b.public_data(&md).map_err(e)?).map_err(e)?;
        for op in [Op::Write, Op::Read] {
            if op == Op::Read {
                // READ pulls b's buffer back into ours: give them different contents first,
                // so the comparison below proves bytes moved.
                for (i, x) in dst.iter_mut().enumerate() {
                    *x = (i % 241) as u8 ^ 0xa5;
                }
            }
            let want = if op == Op::Read { dst.clone() } else { src.clone() };
            let pairs = [Pair { local: (src.as_ptr() as u64, size as u64, &ms), remote: (dst.as_ptr() as u64, size as u64, &rd) }];
            let req = a.prepare(op, &pairs, "self-test-b").map_err(e)?;
            let iters = if size > (8 << 20) { 4 } else { 32 };
            let t0 = Instant::now();
            for _ in 0..iters {
                let mut s = a.post(&req, None).map_err(e)?;
                let deadline = Instant::now() + Duration::from_secs(30);
                while s == Status::NF_IN_PROG {
                    b.progress();
                    // Yield the core: on small hosts a spinning caller starves the progress threads.
                    std::thread::sleep(Duration::from_micros(20));
                    s = a.check(&req);
                    if Instant::now() > deadline {
                        return Err("transfer did not complete in 30 s".into());
                    }
                }
                if s != Status::NF_SUCCESS {
                    return Err(format!("transfer failed: {}", s.name()));
                }
            }
            let dt = t0.elapsed().as_secs_f64();
            let got = if op == Op::Read { &src } else { &dst };
            if *got != want {
                return Err(format!("{op:?} of {size} bytes: data mismatch"));
            }
            println!("  {:?} {:>5} KiB: {:.2} GB/s", op, size >> 10, (size * iters) as f64 / dt / 1e9);
        }
    }
    println!("self-test passed");
    Ok(())
}
