//! nixl-fabric-info: what the plugin would see and do on this host. Lists the libfabric
//! providers and their capabilities, the rails an engine would open with the given
//! parameters, whether a CUDA driver is present, the NIXL installations found (their plugin
//! folders, and the engine layout the plugin would choose for each), and optionally runs a
//! loopback self-test.
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
    nixl::report();
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

/// The NIXL installations this host has, found the way the agent looks for its plugins
/// (NIXL_PLUGIN_DIR, else the `plugins` folder next to the libnixl.so it loads: for pip
/// wheels site-packages/.nixl_cu12.mesonpy.libs/plugins), what their plugin folders hold, and
/// the engine layout our plugin would choose for each (the adapter's detector,
/// src/adapter/host_nixl.h, run after loading that libnixl.so here).
mod nixl {
    use std::ffi::{c_char, CStr};
    use std::path::{Path, PathBuf};
    use std::process::Command;

    extern "C" {
        /// src/adapter/plugin_entry.h: the detector over the libraries mapped now; writes
        /// one NUL-terminated line and returns the layout (0 = refused).
        fn nf_adapter_host_report(buf: *mut c_char, len: usize) -> i32;
    }

    /// Where source builds and NVIDIA's containers put libnixl.so.
    const PREFIXES: &[&str] = &[
        "/opt/nvidia/nvda_nixl/lib/x86_64-linux-gnu",
        "/opt/nvidia/nvda_nixl/lib64",
        "/usr/local/nixl/lib/x86_64-linux-gnu",
        "/usr/local/nixl/lib64",
        "/usr/local/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
    ];

    /// Finds the NIXL wheels importable by NIXL_PYTHON (default python3) without importing
    /// them (releases up to 1.3.2 import torch): one "package folder" line each.
    const PY_FIND: &str = "import importlib.util as u, os\n\
        for p in ('nixl_cu13', 'nixl_cu12', 'nixl'):\n\
        \x20   try:\n\
        \x20       s = u.find_spec(p)\n\
        \x20   except Exception:\n\
        \x20       continue\n\
        \x20   if s and s.submodule_search_locations:\n\
        \x20       site = os.path.dirname(os.path.abspath(list(s.submodule_search_locations)[0]))\n\
        \x20       d = os.path.join(site, '.' + p + '.mesonpy.libs', 'plugins')\n\
        \x20       if os.path.isdir(d):\n\
        \x20           print(p, d)\n";

    struct Folder {
        dir: PathBuf,
        how: String,
    }

    fn python_folders() -> Vec<Folder> {
        let py = std::env::var("NIXL_PYTHON").unwrap_or_else(|_| "python3".into());
        let Ok(out) = Command::new(&py).args(["-c", PY_FIND]).output() else {
            return Vec::new();
        };
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(pkg, dir)| Folder { dir: dir.into(), how: format!("Python package {pkg} ({py})") })
            .collect()
    }

    fn libnixl_folders() -> Vec<Folder> {
        let ld = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        ld.split(':')
            .filter(|d| !d.is_empty())
            .chain(PREFIXES.iter().copied())
            .map(PathBuf::from)
            .filter(|d| d.join("libnixl.so").is_file() && d.join("plugins").is_dir())
            .map(|d| Folder { how: format!("libnixl.so in {}", d.display()), dir: d.join("plugins") })
            .collect()
    }

    /// In the agent's order: the first is the folder a NIXL started now would use.
    fn folders() -> Vec<Folder> {
        let mut all = Vec::new();
        if let Some(dir) = std::env::var_os("NIXL_PLUGIN_DIR") {
            all.push(Folder { dir: dir.into(), how: "NIXL_PLUGIN_DIR (replaces the default folder)".into() });
        }
        all.extend(python_folders());
        all.extend(libnixl_folders());
        let mut seen = Vec::new();
        all.retain(|f| {
            let key = std::fs::canonicalize(&f.dir).unwrap_or_else(|_| f.dir.clone());
            let new = !seen.contains(&key);
            seen.push(key);
            new
        });
        all
    }

    fn is_ours(path: &Path) -> bool {
        std::fs::read(path).map(|d| d.windows(16).any(|w| w == b"nf_engine_create")).unwrap_or(false)
    }

    /// "libplugin_UCX.so", "libplugin_LIBFABRIC.so (nixl-fabric)", "libplugin_X.so (symlink:
    /// a stock plugin does not load from another folder)".
    fn plugins_in(dir: &Path) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return vec!["(cannot list)".into()];
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                if !(name.starts_with("libplugin_") && name.ends_with(".so")) {
                    return None;
                }
                let path = e.path();
                let link = std::fs::symlink_metadata(&path).map(|m| m.file_type().is_symlink()).unwrap_or(false);
                Some(if is_ours(&path) {
                    format!("{name} (nixl-fabric)")
                } else if link {
                    format!("{name} (symlink: a stock plugin only loads from its own folder)")
                } else {
                    name
                })
            })
            .collect();
        names.sort();
        names
    }

    /// Loads that NIXL's libnixl.so into this process and asks the adapter's detector.
    fn layout_of(libnixl: &Path) -> String {
        // SAFETY: loading the agent's library runs its static constructors, as any program
        // using NIXL does; RTLD_LOCAL keeps its symbols from interposing on ours. The handle
        // is never closed (its libraries start threads and registries of their own).
        let lib = unsafe { libloading::os::unix::Library::open(Some(libnixl), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        match lib {
            Err(e) => format!("not loaded here ({e})"),
            Ok(lib) => {
                std::mem::forget(lib);
                let mut buf = vec![0u8; 2048];
                // SAFETY: the buffer is writable for its length; the callee NUL-terminates
                // within it and catches every exception.
                let layout = unsafe { nf_adapter_host_report(buf.as_mut_ptr().cast(), buf.len()) };
                let line = CStr::from_bytes_until_nul(&buf).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
                format!("{line}{}", if layout == 0 { " -> backend creation would be REFUSED" } else { " -> served" })
            }
        }
    }

    pub fn report() {
        println!("\nNIXL plugin folders (the agent uses the first; install there to keep stock UCX beside ours):");
        let found = folders();
        if found.is_empty() {
            println!("  none found (no nixl_cu12/nixl_cu13 package for NIXL_PYTHON, no libnixl.so with a plugins folder, NIXL_PLUGIN_DIR unset)");
            return;
        }
        for (i, f) in found.iter().enumerate() {
            println!("  {} {} ({})", if i == 0 { "active" } else { "other " }, f.dir.display(), f.how);
            println!("         plugins: {}", plugins_in(&f.dir).join(", "));
        }
        // The detector sees every NIXL loaded in the process, so only the active one is loaded.
        if let Some(lib) = found.iter().map(|f| f.dir.join("../libnixl.so")).find(|p| p.is_file()) {
            println!("  layout: {}", layout_of(&lib));
        }
    }
}
