//! dma-buf registrations (FI_MR_DMABUF) against the real shm provider. On libfabric 1.17
//! the rail says it has none and refuses one; on 2.x (API 1.20) host memory given as a
//! memfd "dma-buf" (shm reaches it by base_addr + offset, fi_mr(3)) is written and read
//! back through the registration, which checks our fi_mr_dmabuf layout, the flag, and the
//! larger attribute and error-entry structs of API 1.20. A libfabric without CUDA refuses
//! the CUDA interface both ways, which is what sends the engine on to staging. The test
//! runs once on the library the binary loads, and once more on libfabric 2.x in a child
//! process where one is built (build/lf2, or NF_LF2_LIB names its lib directory).
use super::{Completion, DmaBufRange, Rail, RmaSeg};
use crate::config::Config;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "NF_DMABUF_LF_CHILD";

/// Two shm endpoints of this process (2.x's shm does not move RMA to its own address):
/// the first initiates, the second owns the target memory; `peer` is the second's address
/// in the first's AV.
fn shm_rails() -> (Rail, Rail, u64) {
    let mut c = Config::defaults();
    c.set("provider", "shm").unwrap();
    let specs = crate::fabric::discover(&c, true).expect("shm");
    let a = Rail::open("dmabuf-test-a", &specs[0], 0, false).expect("shm rail");
    let b = Rail::open("dmabuf-test-b", &specs[0], 1, false).expect("shm rail");
    let peer = a.av_insert(&b.name.clone()).expect("peer address");
    b.av_insert(&a.name.clone()).expect("initiator address");
    (a, b, peer)
}

/// `len` bytes of a memfd mapped shared: the memfd plays the dma-buf of the mapping.
struct Memfd {
    fd: OwnedFd,
    map: *mut u8,
    len: usize,
}

impl Memfd {
    fn new(len: usize) -> Memfd {
        // SAFETY: literal name; the fd is ours.
        let raw = unsafe { libc::memfd_create(c"nf-dmabuf-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0, "memfd_create");
        // SAFETY: a fresh fd.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sizing and mapping our own memfd.
        let map = unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as i64), 0);
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        assert_ne!(map, libc::MAP_FAILED);
        Memfd { fd, map: map as *mut u8, len }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is live for self's lifetime; nothing writes it meanwhile
        // (the tests read only after the operation's completion).
        unsafe { std::slice::from_raw_parts(self.map, self.len) }
    }
    /// Copies `data` in at `off` (within the mapping), or zeroes all with None.
    fn set(&self, off: usize, data: Option<&[u8]>) {
        // SAFETY: the ranges lie inside the live mapping; no operation is in flight.
        unsafe {
            match data {
                Some(d) => std::ptr::copy_nonoverlapping(d.as_ptr(), self.map.add(off), d.len().min(self.len - off)),
                None => std::ptr::write_bytes(self.map, 0, self.len),
            }
        }
    }
}

impl Drop for Memfd {
    fn drop(&mut self) {
        // SAFETY: unmapping what new() mapped.
        unsafe { libc::munmap(self.map as *mut libc::c_void, self.len) };
    }
}

/// Posts until the provider takes it (2.x's shm answers FI_EAGAIN until the peer's
/// region is mapped, which takes progress on both sides).
fn post(a: &Rail, b: &Rail, write: bool, seg: RmaSeg, peer: u64, ctx: usize, dc: bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; 16];
    // SAFETY: the caller registered both ranges on these rails and keeps them alive until
    // the completion.
    while unsafe { a.rma_batch(write, &[seg], peer, ctx as *mut _, false, dc) }.unwrap() == super::Posted::Again {
        assert!(Instant::now() < deadline, "post {ctx}");
        let _ = b.poll(&mut buf);
        let _ = a.poll(&mut buf);
    }
}

/// Polls both rails (the target's progress may move the bytes) until `ctx` completes on `a`.
fn wait_for(a: &Rail, b: &Rail, ctx: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut buf = [Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; 16];
    loop {
        assert!(Instant::now() < deadline, "completion {ctx}");
        let _ = b.poll(&mut buf);
        let n = a.poll(&mut buf).map_err(|e| e.detail).unwrap();
        if buf[..n].iter().any(|c| c.ctx as usize == ctx) {
            return;
        }
    }
}

fn checks() -> String {
    let (rail, target, peer) = shm_rails();
    let lib = crate::fabric::library_version();
    let m = Memfd::new(3 << 16);
    // The registered range starts 4 KiB + 96 bytes into the buffer, as a VRAM range that
    // starts inside a page does.
    let offset = 4096 + 96;
    let len = (2 << 16) - 96;
    let range = DmaBufRange { fd: m.fd.as_fd(), base: m.map as u64, offset: offset as u64, len };
    assert!(rail.caps.hmem, "shm offers FI_HMEM on {lib}");
    if crate::fabric::library_major() < 2 {
        assert!(!rail.caps.dmabuf);
        // SAFETY: refused before the provider sees the memory.
        let e = unsafe { target.register_dmabuf(&range, 7, (0, 0)) }.err().expect("refused on 1.x");
        assert!(matches!(e, crate::error::Error::NotSupported(_)), "{e}");
        return format!("libfabric {lib}: no dma-buf registration (refused before the provider: {e})");
    }
    let pattern: Vec<u8> = (0..len).map(|i| (i * 13 + 5) as u8).collect();
    let mut other = vec![0u8; len];
    // SAFETY: `other` outlives `mo`.
    let mo = unsafe { rail.register(other.as_ptr(), len, 8, None) }.unwrap();
    let how = if target.caps.dmabuf {
        // The dma-buf region is the target: written into, then read out of, by its key.
        // SAFETY: m outlives the region (dropped below, before m).
        let md = unsafe { target.register_dmabuf(&range, 7, (0, 0)) }.expect("dma-buf registration of host memory");
        other.copy_from_slice(&pattern);
        let raddr = m.map as u64 + offset as u64;
        let seg = RmaSeg { local: other.as_mut_ptr(), len, desc: mo.desc, raddr, rkey: md.key };
        post(&rail, &target, true, seg, peer, 1, true);
        wait_for(&rail, &target, 1);
        assert!(m.bytes()[offset..offset + len] == pattern[..], "the write landed at base + offset");
        other.fill(0);
        let seg = RmaSeg { local: other.as_mut_ptr(), len, desc: mo.desc, raddr, rkey: md.key };
        post(&rail, &target, false, seg, peer, 2, false);
        wait_for(&rail, &target, 2);
        assert!(other == pattern, "read back through the dma-buf registration");
        drop(md);
        "as an RMA target"
    } else {
        // Offset-addressed (2.1's shm): the engine takes no dma-buf here (see RailCaps::dmabuf),
        // but the provider still takes one as the local side of an operation, which checks the
        // layout and flag we hand it: write out of the dma-buf range, then read into it.
        assert!(!target.caps.virt_addr && target.caps.no_dmabuf_reason().contains("by offset"), "{:?}", target.caps);
        // SAFETY: m outlives the region (dropped below, before m).
        let ml = unsafe { rail.reg_dmabuf_unchecked(&range, 7, (0, 0)) }.expect("dma-buf registration of host memory");
        let dst = vec![0u8; len];
        // SAFETY: `dst` outlives `md`.
        let md = unsafe { target.register(dst.as_ptr(), len, 9, None) }.unwrap();
        m.set(offset, Some(&pattern));
        let raddr = if target.caps.virt_addr { dst.as_ptr() as u64 } else { 0 };
        // SAFETY: inside the mapping.
        let local = unsafe { m.map.add(offset) };
        let seg = RmaSeg { local, len, desc: ml.desc, raddr, rkey: md.key };
        post(&rail, &target, true, seg, peer, 1, true);
        wait_for(&rail, &target, 1);
        assert!(dst == pattern, "written out of the dma-buf range");
        m.set(0, None);
        let seg = RmaSeg { local, len, desc: ml.desc, raddr, rkey: md.key };
        post(&rail, &target, false, seg, peer, 2, false);
        wait_for(&rail, &target, 2);
        assert!(m.bytes()[offset..offset + len] == pattern[..], "read into the dma-buf range at base + offset");
        assert!(m.bytes()[..offset].iter().all(|&b| b == 0), "nothing before the range");
        drop((ml, md));
        "as the local side (offset-addressed provider)"
    };
    // A libfabric without CUDA refuses the CUDA interface either way (the engine then stages).
    // SAFETY: m outlives any region these make (dropped at once).
    let cuda_dmabuf = unsafe { rail.reg_dmabuf_unchecked(&range, 10, (1, 0)) }.err().map(|e| e.to_string());
    // SAFETY: as above.
    let cuda_plain = unsafe { target.register(m.map, len, 11, Some(super::Hmem { iface: 1, device: 0, device_only: true })) }.err().map(|e| e.to_string());
    drop(mo);
    drop(target);
    format!("libfabric {lib}: {len} bytes written and read back through a dma-buf registration {how}; CUDA iface: dma-buf {}, plain {}",
            cuda_dmabuf.unwrap_or_else(|| "accepted".into()), cuda_plain.unwrap_or_else(|| "accepted".into()))
}

/// libfabric 2.x's lib directory, where one was built for `make test-lf2`.
fn lf2_lib() -> Option<std::path::PathBuf> {
    let p = std::env::var("NF_LF2_LIB").map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("build/lf2/prefix/lib"));
    p.join("libfabric.so.1").exists().then_some(p)
}

#[test]
fn dmabuf_registration_on_shm() {
    println!("{}", checks());
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let Some(lib) = lf2_lib() else {
        println!("libfabric 2.x not built (build/lf2): the 2.x run is skipped");
        return;
    };
    let ld = std::env::var("LD_LIBRARY_PATH").map(|v| format!("{}:{v}", lib.display())).unwrap_or_else(|_| lib.display().to_string());
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "fabric::rail::dmabuf_tests::dmabuf_registration_on_shm", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", ld)
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "the libfabric 2.x run failed:\n{text}");
    assert!(text.contains("written and read back through a dma-buf registration"), "{text}");
    println!("{}", text.lines().find(|l| l.starts_with("libfabric ")).unwrap_or_default());
}
