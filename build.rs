//! Build steps: libfabric bindings (bindgen over the system headers found by pkg-config),
//! the static-inline shim and the NIXL C++ adapter (cc), and the C header (cbindgen).
use std::env;
use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let lib = pkg_config::Config::new()
        .atleast_version("1.17")
        .probe("libfabric")
        .expect("libfabric >= 1.17 not found by pkg-config (apt-get install libfabric-dev)");

    println!("cargo:rerun-if-changed=src/fabric/shim.c");
    println!("cargo:rerun-if-changed=src/fabric/shim.h");
    let mut shim = cc::Build::new();
    shim.file("src/fabric/shim.c").warnings(true).flag_if_supported("-Wno-unused-parameter");
    for p in &lib.include_paths {
        shim.include(p);
    }
    shim.compile("nf_fabric_shim");

    let mut bg = bindgen::Builder::default()
        .header("src/fabric/shim.h")
        .allowlist_function("nf_fi_.*")
        .allowlist_function("fi_getinfo|fi_freeinfo|fi_dupinfo|fi_fabric|fi_strerror|fi_version|fi_tostr")
        .allowlist_type("fi_.*|fid_.*")
        .allowlist_var("FI_.*")
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for p in &lib.include_paths {
        bg = bg.clang_arg(format!("-I{}", p.display()));
    }
    bg.generate()
        .expect("bindgen over libfabric headers")
        .write_to_file(out.join("fabric_sys.rs"))
        .expect("write fabric_sys.rs");

    // The adapter includes the header, so generate it first.
    generate_header();
    build_adapter();
}

/// The NIXL adapter is C++ (the agent calls virtual methods), compiled with hidden
/// visibility; the two plugin entry points are re-exported from Rust (src/plugin.rs).
fn build_adapter() {
    let files: Vec<PathBuf> = std::fs::read_dir("src/adapter")
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
                .collect()
        })
        .unwrap_or_default();
    println!("cargo:rerun-if-changed=src/adapter");
    if files.is_empty() {
        return;
    }
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++20")
        .include("include")
        .include("src/adapter")
        .flag("-fvisibility=hidden")
        .flag("-fvisibility-inlines-hidden")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .warnings(true)
        .flag_if_supported("-Wno-unused-parameter");
    if env::var("CARGO_FEATURE_ASAN").is_ok() || env::var("NF_ASAN").is_ok() {
        b.flag("-fsanitize=address");
    }
    for f in &files {
        b.file(f);
    }
    b.compile("nf_adapter");
    println!("cargo:rustc-link-lib=dylib=stdc++");
}

/// Regenerates include/nixl_fabric.h; `make check-header` fails when the committed copy
/// differs, so a stale header cannot land.
fn generate_header() {
    println!("cargo:rerun-if-changed=src/capi");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let crate_dir = env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR");
    let cfg = cbindgen::Config::from_file(PathBuf::from(&crate_dir).join("cbindgen.toml"))
        .expect("cbindgen.toml");
    match cbindgen::Builder::new().with_crate(&crate_dir).with_config(cfg).generate() {
        Ok(h) => {
            let mut text = Vec::new();
            h.write(&mut text);
            let path = PathBuf::from(&crate_dir).join("include/nixl_fabric.h");
            if std::fs::read(&path).ok().as_deref() != Some(&text[..]) {
                std::fs::write(&path, &text).expect("write include/nixl_fabric.h");
            }
        }
        Err(e) => println!("cargo:warning=cbindgen failed: {e}"),
    }
}
