//! Tests of the cuda module. Three groups:
//! - pure tests (types, parsing, errors, the no-driver path) that run everywhere;
//! - mock tests: a stand-in libcuda (mock_cuda.c, built with the system C compiler) loaded
//!   through NIXL_FABRIC_CUDA_LIB in a child test process, so the whole API runs on a host
//!   without a GPU; skipped when no C compiler is found;
//! - GPU tests (`gpu_*`): run against the real driver, return early with
//!   "skipped: no CUDA driver" where it is absent.
use super::pointer::{info_from_slots, lo_u32};
use super::sys::*;
use super::*;
use std::ffi::{c_long, c_void};
use std::mem::size_of;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------
// Pure tests.

#[test]
fn ffi_types_have_the_c_sizes() {
    assert_eq!(size_of::<CUresult>(), 4);
    assert_eq!(size_of::<CUdevice>(), 4);
    assert_eq!(size_of::<CUdeviceptr>(), 8);
    assert_eq!(size_of::<CUpointer_attribute>(), 4);
    assert_eq!(size_of::<CUcontext>(), size_of::<usize>());
    assert_eq!(size_of::<CUstream>(), size_of::<usize>());
    assert_eq!(size_of::<CUevent>(), size_of::<usize>());
    // Function pointers are one machine word, and Option of one uses the null niche, so
    // the Fns table holds exactly what dlsym returned.
    assert_eq!(size_of::<FnInit>(), size_of::<usize>());
    assert_eq!(size_of::<Option<FnPointerGetAttributes>>(), size_of::<usize>());
    assert_eq!(size_of::<Option<FnMemsetD8>>(), size_of::<usize>());
    assert_eq!(size_of::<Context>(), size_of::<usize>());
    // The two pointer-sized handles we return from the attribute slots.
    assert!(size_of::<usize>() <= size_of::<u64>());
}

#[test]
fn memory_types_and_attribute_slots_parse() {
    assert_eq!(MemoryType::from_raw(0), MemoryType::Unregistered);
    assert_eq!(MemoryType::from_raw(1), MemoryType::Host);
    assert_eq!(MemoryType::from_raw(2), MemoryType::Device);
    assert_eq!(MemoryType::from_raw(3), MemoryType::Array);
    assert_eq!(MemoryType::from_raw(4), MemoryType::Unified);
    assert_eq!(MemoryType::from_raw(77), MemoryType::Other(77));

    // A 4-byte value written at the start of a zeroed 8-byte slot.
    let mut slot = 0u64;
    // SAFETY: writes 4 bytes into an 8-byte local.
    unsafe { *(&mut slot as *mut u64 as *mut i32) = -2 };
    assert_eq!(lo_u32(slot) as i32, -2);

    // Unregistered memory: every other slot is ignored (the driver's "NULL defaults" may
    // include an ordinal that looks like device 0 or -2).
    let info = info_from_slots(&[0, 0xdead, 0, 0x1000, 0x1000, 1]);
    assert_eq!(info.memory_type, MemoryType::Unregistered);
    assert_eq!((info.context, info.device_ordinal, info.range_start, info.range_size), (None, None, 0, 0));
    assert!(!info.is_device() && !info.is_managed);

    let info = info_from_slots(&[2, 0x5000, 1, 0x7000_0000, 1 << 20, 0]);
    assert!(info.is_device());
    assert_eq!(info.context.map(|c| c.id()), Some(0x5000));
    assert_eq!(info.device_ordinal, Some(1));
    assert!(info.contains(0x7000_0000, 1 << 20));
    assert!(info.contains(0x7000_0010, 16));
    assert!(!info.contains(0x7000_0010, 1 << 20));
    assert!(!info.contains(0x6fff_ffff, 2));
    assert!(!info.contains(u64::MAX, 2));

    // Device memory without a context (pools, VMM), a negative ordinal, and a boolean
    // written as one byte.
    let info = info_from_slots(&[2, 0, u32::MAX as u64, 0, 0, 1]);
    assert_eq!((info.context, info.device_ordinal), (None, None));
    assert!(info.is_managed);
    assert!(!info.contains(0, 0));
}

#[test]
fn errors_name_the_call_and_map_to_statuses() {
    use crate::error::{Error, Status};
    let e = CudaError::Driver { func: "cuMemAlloc_v2", code: 2, name: "CUDA_ERROR_OUT_OF_MEMORY".into() };
    assert_eq!(e.to_string(), "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2)");
    assert_eq!((e.func(), e.code()), (Some("cuMemAlloc_v2"), Some(2)));
    assert_eq!(Error::from(e).status(), Status::NF_ERR_BACKEND);

    let e = CudaError::Unavailable { lib: "libcuda.so.1".into(), reason: "no such file".into() };
    assert!(e.to_string().contains("libcuda.so.1") && e.to_string().contains("no such file"));
    assert_eq!(Error::from(e).status(), Status::NF_ERR_NOT_SUPPORTED);
    assert_eq!(Error::from(CudaError::Missing { func: "cuMemsetD8_v2" }).status(), Status::NF_ERR_NOT_SUPPORTED);
    assert_eq!(Error::from(CudaError::Invalid("x".into())).status(), Status::NF_ERR_INVALID_PARAM);

    assert_eq!(super::error::fallback_name(600), "CUDA_ERROR_NOT_READY");
    assert_eq!(super::error::fallback_name(123456), "unknown CUresult 123456");
    assert!(super::memory::check_range("b", 10, 4, 6).is_ok());
    assert!(super::memory::check_range("b", 10, 4, 7).is_err());
    assert!(super::memory::check_range("b", 10, usize::MAX, 2).is_err());
}

#[test]
fn missing_library_is_reported_with_the_dlopen_text() {
    let path = "/nonexistent/nixl-fabric-test/libcuda.so.1";
    let e = Driver::load(path).unwrap_err();
    let msg = e.to_string();
    match &e {
        CudaError::Unavailable { lib, reason } => {
            assert_eq!(lib, path);
            assert!(reason.contains("No such file") || reason.contains(path), "{reason}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(msg.contains(path), "{msg}");
}

#[test]
fn library_without_the_driver_api_is_refused() {
    // libc loads but has none of the entry points.
    let e = Driver::load("libc.so.6").unwrap_err();
    assert!(matches!(e, CudaError::Unavailable { .. }), "{e:?}");
    assert!(e.to_string().contains("cuInit"), "{e}");
}

#[test]
fn without_a_driver_everything_fails_cleanly() {
    let d = match Driver::get() {
        Ok(d) => {
            println!("driver present ({}); the no-driver path is covered by the load tests", d.path());
            return;
        }
        Err(e) => e,
    };
    let msg = d.to_string();
    assert!(msg.contains(&library_path()), "{msg}");
    assert!(!available());
    assert_eq!(device_count(), 0);
    assert_eq!(unavailable_reason(), Some(msg));
    assert!(pointer_info(0x1000).is_err());
    assert!(Context::current().is_err());
    assert!(Context::primary(0).is_err());
    assert!(Context::create(0).is_err());
    // SAFETY: not a real context, but no call below reaches the driver: each fails at
    // Driver::get first.
    let fake = unsafe { Context::from_raw(0x1000 as *mut c_void) }.unwrap();
    assert!(fake.make_current().is_err());
    assert!(fake.make_current_cached().is_err());
    assert!(fake.device_ordinal().is_err());
    assert!(Stream::new(&fake).is_err());
    assert!(Event::new(&fake).is_err());
    assert!(PinnedBuffer::new(&fake, 4096).is_err());
    assert!(DeviceBuffer::new(&fake, 4096).is_err());
    let mut v = vec![0u8; 64];
    // SAFETY: v outlives the (failing) registration attempt.
    assert!(unsafe { HostRegistration::new(&fake, v.as_mut_ptr(), v.len()) }.is_err());
    // SAFETY: the calls fail before any memory is touched.
    unsafe {
        assert!(fake.copy_htod(0x1000, &[1, 2, 3]).is_err());
        assert!(fake.copy_dtoh(&mut v, 0x1000).is_err());
        assert!(fake.copy_dtod(0x1000, 0x2000, 8).is_err());
    }
    let e: crate::error::Error = Context::current().unwrap_err().into();
    assert_eq!(e.status(), crate::error::Status::NF_ERR_NOT_SUPPORTED);
    assert_eq!(Context::from_driver(std::ptr::null_mut()), None);
}

// ---------------------------------------------------------------------------------------
// Mock driver tests.

/// Builds mock_cuda.c into a shared library in a directory of the calling test (`who`:
/// tests run in parallel, and each removes its directory at the end); None (skip) when
/// there is no C compiler.
pub(crate) fn build_mock(who: &str) -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("nf-cuda-mock-{}-{who}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("mock_cuda.c");
    std::fs::write(&src, include_str!("mock_cuda.c")).unwrap();
    let lib = dir.join("libmockcuda.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = match Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-lpthread")
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            println!("skipped: no C compiler ({cc}: {e})");
            return None;
        }
    };
    assert!(out.status.success(), "mock build failed:\n{}", String::from_utf8_lossy(&out.stderr));
    Some(lib)
}

/// Runs one ignored test of this module in a child process with the mock as the driver.
fn run_child(lib: &PathBuf, test: &str, env: &[(&str, &str)]) -> String {
    let module = module_path!().split_once("::").map(|(_, m)| m).unwrap_or(module_path!());
    let name = format!("{module}::{test}");
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", &name, "--ignored", "--nocapture", "--test-threads=1"])
        .env(LIB_ENV, lib)
        .env("NF_CUDA_MOCK_CHILD", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "child {name} failed:\n{text}");
    text
}

#[test]
fn mock_driver_end_to_end() {
    let Some(lib) = build_mock("e2e") else { return };
    let out = run_child(&lib, "mock_child", &[]);
    assert!(out.contains("mock child ok: cuPointerGetAttributes"), "{out}");
    // The one-attribute-at-a-time path (cuPointerGetAttributes refusing the request).
    let out = run_child(&lib, "mock_child", &[("MOCK_CUDA_NO_GETATTRIBUTES", "1")]);
    assert!(out.contains("mock child ok: cuPointerGetAttribute fallback"), "{out}");
    // A driver that loads but has no device: cuInit fails, nothing panics.
    run_child(&lib, "mock_no_device_child", &[("MOCK_CUDA_NO_DEVICE", "1")]);
    let _ = std::fs::remove_dir_all(lib.parent().unwrap());
}

fn in_mock_child() -> bool {
    std::env::var("NF_CUDA_MOCK_CHILD").is_ok()
}

type MockCounters = unsafe extern "C" fn(*mut c_long, *mut c_long, *mut c_long, *mut c_long);

/// (cuCtxGetCurrent, cuCtxSetCurrent, push, pop) calls so far.
fn mock_counts(f: MockCounters) -> (c_long, c_long, c_long, c_long) {
    let (mut a, mut b, mut c, mut d) = (0, 0, 0, 0);
    // SAFETY: four valid out-pointers.
    unsafe { f(&mut a, &mut b, &mut c, &mut d) };
    (a, b, c, d)
}

/// The stand-in driver's test hook `name` (NUL-terminated), from the driver this process
/// already loaded. The pointer stays valid after the handle taken here closes: the driver
/// keeps its own for the life of the process.
///
/// # Safety
/// `T` is the hook's C signature.
pub unsafe fn mock_hook<T: Copy>(name: &[u8]) -> T {
    let d = Driver::get().expect("the stand-in driver is loaded");
    // SAFETY: the library is already loaded (this only adds a reference to it).
    let lib = unsafe { libloading::Library::new(d.path()) }.expect("the stand-in driver opens");
    // SAFETY: the caller names the hook's signature.
    unsafe { *lib.get::<T>(name).expect("the stand-in driver has the hook") }
}

#[test]
#[ignore = "run by mock_driver_end_to_end in a child process"]
fn mock_no_device_child() {
    if !in_mock_child() {
        return;
    }
    let e = Driver::get().unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("cuInit") && msg.contains("CUDA_ERROR_NO_DEVICE"), "{msg}");
    assert!(!available());
    assert_eq!(device_count(), 0);
}

#[test]
#[ignore = "run by mock_driver_end_to_end in a child process"]
fn mock_child() {
    if !in_mock_child() {
        return;
    }
    let d = Driver::get().expect("mock driver loads");
    assert_eq!(d.version(), 13000);
    assert!(available());
    assert_eq!(device_count(), 2);
    // SAFETY: these are the hooks' signatures.
    let counters: MockCounters = unsafe { mock_hook(b"mock_counters\0") };
    // SAFETY: as above.
    let depth: unsafe extern "C" fn() -> i32 = unsafe { mock_hook(b"mock_depth\0") };
    let counts = || mock_counts(counters);

    // Errors carry the function, the code and the driver's name for it.
    let e = Context::primary(5).unwrap_err();
    assert_eq!((e.func(), e.code()), (Some("cuDeviceGet"), Some(CUDA_ERROR_INVALID_DEVICE)));
    assert!(e.to_string().contains("CUDA_ERROR_INVALID_DEVICE"), "{e}");
    assert_eq!(d.error_name(424242), "unknown CUresult 424242");

    // Retaining, creating and querying leave this thread's (empty) context stack alone.
    assert_eq!(Context::current().unwrap(), None);
    let p0 = Context::primary(0).unwrap();
    let p1 = Context::primary(1).unwrap();
    let owned = Context::create(0).unwrap();
    assert_eq!(p1.device_ordinal().unwrap(), 1);
    assert_eq!(owned.device_ordinal().unwrap(), 0);
    assert_eq!(Context::current().unwrap(), None);
    // SAFETY: mock hook without arguments.
    assert_eq!(unsafe { depth() }, 0);
    assert_ne!(owned.context(), p0.context());

    // make_current: one cuCtxSetCurrent when it differs, none when it is current already.
    let c0 = counts();
    assert!(p0.make_current().unwrap());
    assert!(!p0.make_current().unwrap());
    let c1 = counts();
    assert_eq!((c1.0 - c0.0, c1.1 - c0.1), (2, 1));
    assert_eq!(Context::current().unwrap(), Some(p0.context()));
    // The cached form makes no driver call at all on a hit...
    let c1 = counts();
    assert!(!p0.make_current_cached().unwrap());
    assert_eq!(counts(), c1);
    // ...and switches on a miss.
    assert!(owned.make_current_cached().unwrap());
    assert!(p1.make_current_cached().unwrap());
    assert!(p0.make_current_cached().unwrap());
    assert_eq!(Context::current().unwrap(), Some(p0.context()));
    // Forgetting the record sends the next call to the driver.
    Context::forget_thread_cache();
    let c2 = counts();
    assert!(!p0.make_current_cached().unwrap());
    assert_eq!(counts().0, c2.0 + 1);
    // Another thread's record is its own: a thread that never set a context has none,
    // even though this one has p0 current (the stock plugin's bug is a thread like that).
    std::thread::scope(|s| {
        s.spawn(|| {
            assert_eq!(Context::current().unwrap(), None);
            assert!(p0.make_current_cached().unwrap());
            assert_eq!(Context::current().unwrap(), Some(p0.context()));
        });
    });

    // Pointer attributes.
    let which = if std::env::var("MOCK_CUDA_NO_GETATTRIBUTES").is_ok() {
        "cuPointerGetAttribute fallback"
    } else {
        "cuPointerGetAttributes"
    };
    let host = vec![0u8; 4096];
    let info = d.pointer_info(host.as_ptr() as u64).unwrap();
    assert_eq!(info.memory_type, MemoryType::Unregistered);
    assert_eq!((info.context, info.device_ordinal), (None, None));
    let len = 1usize << 16;
    let buf = DeviceBuffer::new(&owned, len).unwrap();
    let info = pointer_info(buf.addr() + 100).unwrap();
    assert!(info.is_device());
    assert_eq!(info.context, Some(owned.context()));
    assert_eq!(info.device_ordinal, Some(0));
    assert_eq!((info.range_start, info.range_size), (buf.addr(), len as u64));
    assert!(info.contains(buf.addr() + 100, 10) && !info.contains(buf.addr(), len as u64 + 1));
    assert!(!info.is_managed);
    let buf1 = DeviceBuffer::new(&p1, 4096).unwrap();
    let info1 = pointer_info(buf1.addr()).unwrap();
    assert_eq!((info1.context, info1.device_ordinal), (Some(p1.context()), Some(1)));
    let mut pin = PinnedBuffer::new(&p0, 8192).unwrap();
    assert!(pin.as_slice().iter().all(|&b| b == 0), "pinned memory is zeroed");
    let info = pointer_info(pin.ptr() as u64).unwrap();
    assert_eq!((info.memory_type, info.context), (MemoryType::Host, Some(p0.context())));
    let mut v = vec![7u8; 4096];
    // SAFETY: v outlives the registration.
    let reg = unsafe { HostRegistration::new(&p0, v.as_mut_ptr(), v.len()) }.unwrap();
    assert_eq!(pointer_info(v.as_ptr() as u64).unwrap().memory_type, MemoryType::Host);
    drop(reg);
    assert_eq!(pointer_info(v.as_ptr() as u64).unwrap().memory_type, MemoryType::Unregistered);
    d.set_sync_memops(buf.addr()).unwrap();
    let e = d.set_sync_memops(host.as_ptr() as u64).unwrap_err();
    assert_eq!((e.func(), e.code()), (Some("cuPointerSetAttribute"), Some(CUDA_ERROR_INVALID_VALUE)));

    // Device buffer helpers, from a thread whose current context is another one.
    p1.make_current().unwrap();
    buf.fill(0xab).unwrap();
    assert!(buf.to_vec().unwrap().iter().all(|&b| b == 0xab));
    buf.write(10, b"hello").unwrap();
    let mut five = [0u8; 5];
    buf.read(10, &mut five).unwrap();
    assert_eq!(&five, b"hello");
    assert!(matches!(buf.write(len - 2, b"abc"), Err(CudaError::Invalid(_))));
    assert_eq!(Context::current().unwrap(), Some(p1.context()), "helpers push/pop");

    // Synchronous copies make their context current and leave it so.
    let other = DeviceBuffer::new(&owned, len).unwrap();
    // SAFETY: buf and other are live device allocations of len bytes.
    unsafe {
        owned.copy_htod(buf.addr(), &[1, 2, 3, 4]).unwrap();
        assert_eq!(Context::current().unwrap(), Some(owned.context()));
        owned.copy_dtod(other.addr(), buf.addr(), len).unwrap();
        owned.memset(other.addr() + 4, 9, 4).unwrap();
        let mut out = [0u8; 8];
        owned.copy_dtoh(&mut out, other.addr()).unwrap();
        assert_eq!(out, [1, 2, 3, 4, 9, 9, 9, 9]);
    }

    // The seed bug: a thread that only receives has no context; touching the memory there
    // fails until the captured context is made current.
    std::thread::scope(|s| {
        s.spawn(|| {
            let ctx = pointer_info(buf.addr()).unwrap().context.unwrap();
            let mut tmp = [0u8; 4];
            // SAFETY: tmp is a live 4-byte buffer; buf holds at least 4 bytes.
            let r = unsafe { (d.f.memcpy_dtoh)(tmp.as_mut_ptr() as *mut c_void, buf.addr(), 4) };
            assert_eq!(r, CUDA_ERROR_INVALID_CONTEXT);
            assert!(ctx.make_current().unwrap());
            // SAFETY: as above.
            unsafe { ctx.copy_dtoh(&mut tmp, buf.addr()).unwrap() };
            assert_eq!(tmp, [1, 2, 3, 4]);
        });
    });

    // A staging pipeline: pinned -> device -> pinned on a stream, completion polled.
    p1.make_current().unwrap();
    let stream = Stream::new(&owned).unwrap();
    assert_eq!(Context::current().unwrap(), Some(p1.context()), "Stream::new pushes/pops");
    for (i, b) in pin.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let back = PinnedBuffer::new(&p0, 8192).unwrap();
    // Stream work needs its context current; the engine makes it current itself.
    owned.make_current().unwrap();
    // SAFETY: pin, back and buf stay alive and untouched until the events report ready.
    unsafe { stream.copy_htod_async(buf.addr(), pin.ptr(), 8192).unwrap() };
    let ev = stream.record().unwrap();
    assert!(!ev.query().unwrap(), "mock events are not ready on the first query");
    assert!(poll(&ev));
    // SAFETY: as above.
    unsafe { stream.copy_dtoh_async(back.ptr(), buf.addr(), 8192).unwrap() };
    stream.record_event(&ev).unwrap();
    assert!(poll(&ev));
    assert_eq!(pin.as_slice(), back.as_slice());
    // SAFETY: buf and other are live device allocations of len bytes.
    unsafe {
        stream.copy_dtod_async(other.addr(), buf.addr(), 64).unwrap();
        stream.copy_async(other.addr() + 64, buf.addr(), 64).unwrap();
    }
    assert!(stream.query().unwrap());
    stream.synchronize().unwrap();
    ev.synchronize().unwrap();
    // From a thread with no context the stream refuses work until its context is made
    // current there (the seed bug, and its fix).
    std::thread::scope(|s| {
        s.spawn(|| {
            assert!(stream.record_event(&ev).is_err(), "no context on a fresh thread");
            owned.make_current().unwrap();
            stream.record_event(&ev).unwrap();
            assert!(poll(&ev));
        });
    });
    let mut head = [0u8; 128];
    other.read(0, &mut head).unwrap();
    assert_eq!(&head[..64], &pin.as_slice()[..64]);
    assert_eq!(&head[64..], &pin.as_slice()[..64]);

    // Teardown in any order leaves the thread's context stack balanced; destroying a
    // context invalidates every thread's cached record.
    drop((ev, stream, pin, back, buf, other, buf1));
    p0.make_current().unwrap();
    let before = counts();
    drop(owned);
    assert!(!p0.make_current_cached().unwrap());
    let after = counts();
    assert_eq!(after.0, before.0 + 1, "a destroyed context forces a driver check");
    assert_eq!(after.3 - after.2, 1, "every push was popped (plus the pop after cuCtxCreate)");
    // SAFETY: mock hook without arguments.
    assert_eq!(unsafe { depth() }, 1);
    drop((p0, p1));
    println!("mock child ok: {which}");
}

/// Polls an event until ready, for at most 5 seconds.
fn poll(ev: &Event) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if ev.query().unwrap() {
            return true;
        }
        std::thread::yield_now();
    }
    false
}

// ---------------------------------------------------------------------------------------
// GPU tests: the real driver. Run on the GPU machine with
//   cargo test --release --lib cuda:: -- --nocapture --test-threads=1

fn gpu() -> Option<&'static Driver> {
    match Driver::get() {
        Ok(d) => Some(d),
        Err(e) => {
            println!("skipped: no CUDA driver ({e})");
            None
        }
    }
}

#[test]
fn gpu_pointer_info_classifies_memory() {
    let Some(d) = gpu() else { return };
    println!("driver {} version {}, {} device(s)", d.path(), d.version(), device_count());
    let p0 = Context::primary(0).unwrap();
    let host = vec![1u8; 1 << 20];
    let info = d.pointer_info(host.as_ptr() as u64).unwrap();
    assert_eq!(info.memory_type, MemoryType::Unregistered, "{info:?}");
    assert_eq!(info.context, None);
    let len = 4usize << 20;
    let buf = DeviceBuffer::new(&p0, len).unwrap();
    let info = d.pointer_info(buf.addr() + 4096).unwrap();
    println!("device buffer: {info:?}");
    assert!(info.is_device());
    assert_eq!(info.context, Some(p0.context()));
    assert_eq!(info.device_ordinal, Some(0));
    assert_eq!(info.range_start, buf.addr());
    assert!(info.range_size >= len as u64);
    assert!(!info.is_managed);
    let pin = PinnedBuffer::new(&p0, 1 << 20).unwrap();
    let info = d.pointer_info(pin.ptr() as u64).unwrap();
    println!("pinned buffer: {info:?}");
    assert_eq!(info.memory_type, MemoryType::Host);
    // Page-aligned host memory, registered in place.
    let layout = std::alloc::Layout::from_size_align(1 << 20, 4096).unwrap();
    // SAFETY: non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!p.is_null());
    // SAFETY: p stays allocated until after the registration is dropped.
    let reg = unsafe { HostRegistration::new(&p0, p, layout.size()) }.unwrap();
    let info = d.pointer_info(p as u64 + 100).unwrap();
    println!("registered host memory: {info:?}");
    assert_eq!(info.memory_type, MemoryType::Host);
    drop(reg);
    assert_eq!(d.pointer_info(p as u64).unwrap().memory_type, MemoryType::Unregistered);
    // SAFETY: allocated above with this layout, no longer registered.
    unsafe { std::alloc::dealloc(p, layout) };
    d.set_sync_memops(buf.addr()).unwrap();
    assert!(d.pointer_info(0).is_ok());
}

#[test]
fn gpu_fresh_thread_has_no_context_until_made_current() {
    let Some(_) = gpu() else { return };
    let p0 = Context::primary(0).unwrap();
    let buf = DeviceBuffer::new(&p0, 1 << 20).unwrap();
    buf.fill(0x5a).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            assert_eq!(Context::current().unwrap(), None, "a new thread starts without a context");
            let ctx = pointer_info(buf.addr()).unwrap().context.unwrap();
            assert!(ctx.make_current().unwrap());
            assert!(!ctx.make_current().unwrap());
            assert!(!ctx.make_current_cached().unwrap());
            assert_eq!(Context::current().unwrap(), Some(ctx));
            let mut out = vec![0u8; 1 << 20];
            // SAFETY: buf is a live device allocation of 1 MiB.
            unsafe { ctx.copy_dtoh(&mut out, buf.addr()).unwrap() };
            assert!(out.iter().all(|&b| b == 0x5a));
        });
    });
}

#[test]
fn gpu_two_contexts_on_one_device() {
    let Some(_) = gpu() else { return };
    let p0 = Context::primary(0).unwrap();
    let owned = Context::create(0).unwrap();
    assert_ne!(owned.context(), p0.context());
    let a = DeviceBuffer::new(&p0, 1 << 20).unwrap();
    let b = DeviceBuffer::new(&owned, 1 << 20).unwrap();
    assert_eq!(pointer_info(a.addr()).unwrap().context, Some(p0.context()));
    assert_eq!(pointer_info(b.addr()).unwrap().context, Some(owned.context()));
    assert_eq!(owned.device_ordinal().unwrap(), 0);
    // Switch back and forth on one thread; each copy runs under its own context.
    for i in 0..4u8 {
        // SAFETY: a and b are live device allocations of 1 MiB.
        unsafe {
            p0.copy_htod(a.addr(), &[i; 4096]).unwrap();
            assert_eq!(Context::current().unwrap(), Some(p0.context()));
            owned.copy_htod(b.addr(), &[i + 100; 4096]).unwrap();
            assert_eq!(Context::current().unwrap(), Some(owned.context()));
        }
        let mut x = [0u8; 4096];
        a.read(0, &mut x).unwrap();
        assert!(x.iter().all(|&v| v == i));
        b.read(0, &mut x).unwrap();
        assert!(x.iter().all(|&v| v == i + 100));
    }
    drop((a, b));
    drop(owned);
    Context::forget_thread_cache();
}

#[test]
fn gpu_pipelined_staging_copies() {
    let Some(_) = gpu() else { return };
    let owned = Context::create(0).unwrap();
    const TOTAL: usize = 16 << 20;
    const CHUNK: usize = 1 << 20;
    let src = DeviceBuffer::new(&owned, TOTAL).unwrap();
    let dst = DeviceBuffer::new(&owned, TOTAL).unwrap();
    let pattern: Vec<u8> = (0..TOTAL).map(|i| (i * 7 % 253) as u8).collect();
    src.write(0, &pattern).unwrap();
    dst.fill(0).unwrap();
    // Device -> two pinned chunks -> device, double-buffered, completions polled, from a
    // thread that starts without a context (as a receiving progress thread does).
    std::thread::scope(|s| {
        s.spawn(|| {
            let down = Stream::new(&owned).unwrap();
            let up = Stream::new(&owned).unwrap();
            owned.make_current().unwrap();
            let bufs = [PinnedBuffer::new(&owned, CHUNK).unwrap(), PinnedBuffer::new(&owned, CHUNK).unwrap()];
            let mut up_done: [Option<Event>; 2] = [None, None];
            let t = Instant::now();
            for (n, off) in (0..TOTAL).step_by(CHUNK).enumerate() {
                let slot = n % 2;
                if let Some(ev) = &up_done[slot] {
                    assert!(poll(ev), "upload of chunk {} did not finish", n - 2);
                }
                let b = &bufs[slot];
                // SAFETY: b is not in use (its previous upload finished); src/dst are live.
                unsafe { down.copy_dtoh_async(b.ptr(), src.addr() + off as u64, CHUNK).unwrap() };
                let ev = down.record().unwrap();
                assert!(poll(&ev));
                // SAFETY: as above; the download into b is complete.
                unsafe { up.copy_htod_async(dst.addr() + off as u64, b.ptr(), CHUNK).unwrap() };
                up_done[slot] = Some(up.record().unwrap());
            }
            up.synchronize().unwrap();
            let secs = t.elapsed().as_secs_f64();
            println!("staged {} MiB through pinned chunks in {:.2} ms ({:.1} GB/s)", TOTAL >> 20, secs * 1e3, TOTAL as f64 / secs / 1e9);
        });
    });
    assert_eq!(dst.to_vec().unwrap(), pattern);
}

#[test]
fn gpu_multi_device_contexts() {
    let Some(_) = gpu() else { return };
    let n = device_count();
    if n < 2 {
        println!("skipped: {n} device(s)");
        return;
    }
    let ctxs: Vec<_> = (0..n as i32).map(|i| Context::primary(i).unwrap()).collect();
    let bufs: Vec<_> = ctxs.iter().map(|c| DeviceBuffer::new(c, 1 << 20).unwrap()).collect();
    for (i, b) in bufs.iter().enumerate() {
        let info = pointer_info(b.addr()).unwrap();
        assert_eq!(info.device_ordinal, Some(i as i32));
        assert_eq!(info.context, Some(ctxs[i].context()));
        assert_eq!(ctxs[i].device_ordinal().unwrap(), i as i32);
    }
}

/// The cost of applying a context per progress pass. Timings are printed, not asserted;
/// run with --release for meaningful numbers.
#[test]
fn gpu_make_current_cost() {
    let Some(d) = gpu() else { return };
    let p0 = Context::primary(0).unwrap();
    let owned = Context::create(0).unwrap();
    let buf = DeviceBuffer::new(&p0, 4096).unwrap();
    const N: u32 = 200_000;
    let time = |name: &str, f: &mut dyn FnMut()| {
        for _ in 0..1000 {
            f();
        }
        let t = Instant::now();
        for _ in 0..N {
            f();
        }
        let ns = t.elapsed().as_nanos() as f64 / N as f64;
        println!("{name:<48} {ns:8.1} ns/call");
        ns
    };
    p0.make_current().unwrap();
    time("cuCtxGetCurrent (raw)", &mut || {
        let mut c: CUcontext = std::ptr::null_mut();
        // SAFETY: c is a valid out-pointer.
        unsafe { (d.f.ctx_get_current)(&mut c) };
    });
    time("cuCtxSetCurrent, same context (raw)", &mut || {
        // SAFETY: p0 is a live retained context.
        unsafe { (d.f.ctx_set_current)(p0.as_raw()) };
    });
    let hit = time("make_current, already current", &mut || {
        p0.make_current().unwrap();
    });
    let cached = time("make_current_cached, already current", &mut || {
        p0.make_current_cached().unwrap();
    });
    time("make_current, alternating two contexts", &mut || {
        p0.make_current().unwrap();
        owned.make_current().unwrap();
    });
    time("pointer_info (registration path)", &mut || {
        d.pointer_info(buf.addr()).unwrap();
    });
    println!("per-pass cost for one context: truthful {hit:.1} ns, cached {cached:.1} ns (target <= 50 ns)");
    drop(buf);
    drop(owned);
    Context::forget_thread_cache();
}

// ---------------------------------------------------------------------------------------
// The gather-copy kernel: the same checks on the stand-in driver (child process) and on
// the real one.

/// Copies a mix of ranges in one `launch` (aligned, misaligned, crossing the 64 KiB slice,
/// empty, longer than one slice) and checks every byte of the destination, the untouched
/// gaps included. Returns the launch count.
fn gather_kernel_checks(ctx: &Context) -> usize {
    let k = CopyKernel::load(ctx).expect("the gather kernel loads");
    assert!(k.ranges_per_launch() >= 181);
    const LEN: usize = 4 << 20;
    let src = DeviceBuffer::new(ctx, LEN).unwrap();
    let dst = DeviceBuffer::new(ctx, LEN).unwrap();
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 131 % 251) as u8).collect();
    src.write(0, &pattern).unwrap();
    dst.fill(0).unwrap();
    // (dst offset, src offset, len)
    let mut ranges: Vec<(usize, usize, usize)> = vec![
        (0, 4096, 4096),
        (8192, 1, 100),              // misaligned source
        (3 << 20, 65536 - 16, 48),   // crosses a slice boundary of the source
        (70000, 200000, 0),          // empty
        (1 << 20, 2 << 20, 300_000), // several slices
        (524_288 + 3, 7, 65_541),    // misaligned both, odd length
    ];
    // Enough 4 KiB ranges that the classic form needs several launches.
    for i in 0..400 {
        ranges.push((1_600_000 + i * 4096, 3_000_000 + ((i * 7) % 200) * 4096, 4096));
    }
    let copies: Vec<(u64, u64, usize)> =
        ranges.iter().map(|&(d, s, n)| (dst.addr() + d as u64, src.addr() + s as u64, n)).collect();
    let stream = Stream::new(ctx).unwrap();
    ctx.make_current().unwrap();
    // SAFETY: every range lies inside src/dst, which outlive the synchronize below.
    let launches = unsafe { k.launch(&stream, &copies).unwrap() };
    stream.synchronize().unwrap();
    let mut want = vec![0u8; LEN];
    for &(d, s, n) in &ranges {
        want[d..d + n].copy_from_slice(&pattern[s..s + n]);
    }
    let got = dst.to_vec().unwrap();
    if let Some(at) = (0..LEN).find(|&i| got[i] != want[i]) {
        panic!("byte {at} differs: got {} want {}", got[at], want[at]);
    }
    assert_eq!(launches, copies.len().div_ceil(k.ranges_per_launch()));
    launches
}

#[test]
fn mock_gather_kernel() {
    let Some(lib) = build_mock("gather") else { return };
    let out = run_child(&lib, "mock_gather_child", &[]);
    assert!(out.contains("gather child ok: 1 launch"), "{out}");
    // An old driver: the 32 KiB parameter block is refused, the 4 KiB form serves.
    let out = run_child(&lib, "mock_gather_child", &[("MOCK_CUDA_SMALL_PARAMS", "1")]);
    assert!(out.contains("gather child ok: 3 launch"), "{out}");
    // A driver without the module API: an error, not a crash.
    let out = run_child(&lib, "mock_gather_child", &[("MOCK_CUDA_NO_KERNEL", "1")]);
    assert!(out.contains("gather child ok: refused"), "{out}");
    let _ = std::fs::remove_dir_all(lib.parent().unwrap());
}

#[test]
#[ignore = "run by mock_gather_kernel in a child process"]
fn mock_gather_child() {
    if !in_mock_child() {
        return;
    }
    let p = Context::primary(0).unwrap();
    if std::env::var("MOCK_CUDA_NO_KERNEL").is_ok() {
        let e = CopyKernel::load(&p).err().expect("refused");
        assert!(e.to_string().contains("cuModuleLoadData"), "{e}");
        println!("gather child ok: refused ({e})");
        return;
    }
    let n = gather_kernel_checks(&p);
    println!("gather child ok: {n} launch(es)");
}

/// Seconds per call of `f` back to back on `stream` (after one warm-up call), `n` calls.
fn per_call(stream: &Stream, n: u32, f: &dyn Fn()) -> f64 {
    f();
    stream.synchronize().unwrap();
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    stream.synchronize().unwrap();
    t.elapsed().as_secs_f64() / f64::from(n)
}

#[test]
fn gpu_gather_kernel() {
    let Some(_) = gpu() else { return };
    let owned = Context::create(0).unwrap();
    let n = gather_kernel_checks(&owned);
    // Speed next to the copy engines: 4096 x 4 KiB scattered, kernel vs cuMemcpyBatchAsync.
    const B: usize = 4096;
    const N: usize = 4096;
    let src = DeviceBuffer::new(&owned, 2 * N * B).unwrap();
    let dst = DeviceBuffer::new(&owned, 2 * N * B).unwrap();
    let copies: Vec<(u64, u64, usize)> =
        (0..N).map(|i| (dst.addr() + (2 * i * B) as u64, src.addr() + ((2 * (N - 1 - i) + 1) * B) as u64, B)).collect();
    let k = CopyKernel::load(&owned).unwrap();
    let stream = Stream::new(&owned).unwrap();
    owned.make_current().unwrap();
    let time = |f: &dyn Fn()| per_call(&stream, 20, f);
    // SAFETY: all ranges lie inside src/dst, alive until after the synchronizes.
    let tk = time(&|| unsafe { k.launch(&stream, &copies).map(|_| ()).unwrap() });
    let (mut d, mut s, mut z): (Vec<u64>, Vec<u64>, Vec<usize>) =
        (copies.iter().map(|c| c.0).collect(), copies.iter().map(|c| c.1).collect(), copies.iter().map(|c| c.2).collect());
    let _ = (&mut d, &mut s, &mut z);
    let tb = if Driver::get().unwrap().has_batch_copy() {
        let cell = std::cell::RefCell::new((d, s, z));
        // SAFETY: as above.
        time(&|| unsafe {
            let mut g = cell.borrow_mut();
            let (d, s, z) = &mut *g;
            stream.copy_batch(d, s, z).unwrap()
        })
    } else {
        f64::NAN
    };
    let gb = (N * B) as f64 / 1e9;
    println!("gather kernel ({n} launches in the checks): {N} x {B} B scattered: kernel {:.1} us ({:.1} GB/s), cuMemcpyBatchAsync {:.1} us ({:.1} GB/s)",
             tk * 1e6, gb / tk, tb * 1e6, gb / tb);
}

/// What a staged chunk's device copy costs (1 MiB between device memory and a pinned slot,
/// as staging/pool.rs queues it), by block size and method: one cuMemcpyAsync per block, or
/// the gather kernel with a CTA per 64 / 16 / 4 KiB slice. Per chunk, back to back (the
/// stream's rate) and one at a time (launch to event seen).
#[test]
fn gpu_staging_copy_rates() {
    let Some(_) = gpu() else { return };
    let owned = Context::create(0).unwrap();
    const CHUNK: usize = 1 << 20;
    let dev = DeviceBuffer::new(&owned, 4 * CHUNK).unwrap();
    let pin = PinnedBuffer::new(&owned, CHUNK).unwrap();
    let k = CopyKernel::load(&owned).unwrap();
    let stream = Stream::new(&owned).unwrap();
    owned.make_current().unwrap();
    for out in [true, false] {
        for bs in [CHUNK, 256 << 10, 16 << 10, 4 << 10] {
            let n = CHUNK / bs;
            // Blocks every other slot of device memory, reversed: scattered as KV blocks are.
            let copies: Vec<(u64, u64, usize)> = (0..n).map(|i| {
                let d = dev.addr() + (2 * (n - 1 - i) * bs) as u64;
                let h = pin.ptr() as u64 + (i * bs) as u64;
                if out { (h, d, bs) } else { (d, h, bs) }
            }).collect();
            let mut line = format!("staging copy {} {n:>4} x {:>4} KiB:", if out { "D2H" } else { "H2D" }, bs >> 10);
            // A CTA per 64 / 16 / 4 KiB slice, or (None) one copy per block.
            for (method, shift) in [("memcpy", None), ("k64K", Some(16)), ("k16K", Some(14)), ("k4K", Some(12))] {
                let one = || {
                    // SAFETY: every range lies inside dev or pin, alive past the synchronizes.
                    unsafe {
                        match shift {
                            None => {
                                for c in &copies {
                                    if out { stream.copy_dtoh_async(c.0 as *mut u8, c.1, c.2).unwrap() } else { stream.copy_htod_async(c.0, c.1 as *const u8, c.2).unwrap() }
                                }
                            }
                            Some(sh) => {
                                k.launch_sliced(&stream, &copies, sh).unwrap();
                            }
                        }
                    }
                };
                let rate = per_call(&stream, 50, &one);
                let t = Instant::now();
                for _ in 0..20 {
                    one();
                    let ev = stream.record().unwrap();
                    assert!(poll(&ev));
                }
                let lat = t.elapsed().as_secs_f64() / 20.0;
                line += &format!(" {method} {:.0}/{:.0} us", rate * 1e6, lat * 1e6);
            }
            println!("{line}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// VMM memory shared by POSIX fds, within one process: chunks found, exported, imported and
// mapped into a second range of our own; both ranges then show the same bytes.

fn vmm_checks(p: &PrimaryContext) -> String {
    let d = Driver::get().unwrap();
    assert!(d.has_vmm_export() && d.has_vmm_import(), "the driver lacks VMM entry points");
    let g = VmmBuffer::granularity(p.ordinal(), true).unwrap();
    let buf = VmmBuffer::new(p, p.ordinal(), 3, g, true).unwrap();
    let len = buf.len() as usize;
    // Attributes: device memory of no context, no legacy handle. The range attributes name
    // the chunk (the stand-in driver) or the whole mapped run of chunks around it (the real
    // driver, H200 with CUDA 13: all three); either way inside the reservation.
    let info = d.pointer_info(buf.addr() + g + 5).unwrap();
    assert!(info.is_device() && info.context.is_none(), "{info:?}");
    let range = (info.range_start, info.range_size);
    assert!(range == (buf.addr() + g, g) || range == (buf.addr(), buf.len()), "range attributes {range:?}");
    assert_eq!(d.legacy_ipc_capable(buf.addr()), Some(false));
    assert!(d.ipc_export(p, buf.addr()).is_err(), "cuIpcGetMemHandle must refuse VMM memory");
    // A registration starting inside the first chunk still covers all three.
    let chunks = d.vmm_chunks(p, buf.addr() + 4096, buf.len() - 4096, 16).unwrap();
    assert_eq!(chunks.len(), 3);
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!((c.base, c.len), (buf.addr() + i as u64 * g, g));
        assert!(c.granularity.is_power_of_two() && g.is_multiple_of(c.granularity));
    }
    assert!(d.vmm_chunks(p, buf.addr(), buf.len(), 2).is_err(), "the chunk bound holds");
    let want: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    // SAFETY: the buffer is len bytes of device memory of ours, idle.
    unsafe { p.copy_htod(buf.addr(), &want).unwrap() };
    let parts: Vec<(u64, u64, std::os::fd::OwnedFd)> =
        chunks.iter().map(|c| (c.base - buf.addr(), c.len, d.vmm_export_fd(p, c.base).unwrap())).collect();
    let m = VmmMapping::import(p, parts, buf.len(), g).unwrap();
    assert_ne!(m.base(), buf.addr());
    let mut got = vec![0u8; len];
    // SAFETY: the mapping is len bytes, mapped read-write for this device.
    unsafe { p.copy_dtoh(&mut got, m.base()).unwrap() };
    assert!(got == want, "the imported mapping shows other bytes");
    // Written through the mapping, seen in the original (across a chunk boundary).
    let patch = vec![0xa5u8; 8192];
    // SAFETY: [g - 4096, +8192) lies inside both ranges.
    unsafe { p.copy_htod(m.base() + g - 4096, &patch).unwrap() };
    let mut back = vec![0u8; 8192];
    // SAFETY: as above.
    unsafe { p.copy_dtoh(&mut back, buf.addr() + g - 4096).unwrap() };
    assert_eq!(back, patch);
    // Without the POSIX fd handle type: refused by name, before any fd exists.
    let nofd = VmmBuffer::new(p, p.ordinal(), 1, g, false).unwrap();
    let e = d.vmm_chunks(p, nofd.addr(), nofd.len(), 16).unwrap_err();
    assert!(e.to_string().contains("POSIX fd"), "{e}");
    drop(m);
    format!("{} chunks of {g} bytes", chunks.len())
}

#[test]
fn mock_vmm_export_import() {
    let Some(lib) = build_mock("vmm") else { return };
    let out = run_child(&lib, "mock_vmm_child", &[]);
    assert!(out.contains("vmm child ok: 3 chunks"), "{out}");
    let _ = std::fs::remove_dir_all(lib.parent().unwrap());
}

#[test]
#[ignore = "run by mock_vmm_export_import in a child process"]
fn mock_vmm_child() {
    if !in_mock_child() {
        return;
    }
    let p = Context::primary(0).unwrap();
    println!("vmm child ok: {}", vmm_checks(&p));
}

/// On the real driver (tests/gpu/run-gpu.sh runs the unit tests with --include-ignored).
#[test]
#[ignore = "needs a GPU whose driver has the VMM API; run with --include-ignored"]
fn gpu_vmm_export_import() {
    let Some(_) = gpu() else { return };
    let p = Context::primary(0).unwrap();
    println!("gpu vmm ok: {}", vmm_checks(&p));
}

// ---------------------------------------------------------------------------------------
// dma-buf export: the fd and offset a provider registers device memory by.

/// Reads `n` bytes of `fd` at `off` (the stand-in's dma-buf is a memfd; a real one cannot
/// be read, only imported by a device driver).
fn pread_fd(fd: std::os::fd::BorrowedFd<'_>, off: u64, n: usize) -> Vec<u8> {
    use std::os::fd::AsRawFd;
    let mut v = vec![0u8; n];
    // SAFETY: v has room for n bytes; fd is open for the call.
    let got = unsafe { libc::pread(fd.as_raw_fd(), v.as_mut_ptr() as *mut c_void, n, off as i64) };
    assert_eq!(got, n as isize, "pread of the dma-buf fd");
    v
}

/// What the driver exports: whole pages from the allocation's start, with the registered
/// range's offset kept; on the stand-in the fd's bytes are the device bytes. Returns a line
/// saying what a VMM range over two chunks got.
fn dmabuf_checks(p: &PrimaryContext, readable: bool) -> String {
    let d = Driver::get().unwrap();
    let page = dmabuf::page_size();
    let ctx = p.context();
    let before = Context::current().unwrap();
    let buf = DeviceBuffer::new(&ctx, 3 * page as usize).unwrap();
    let pattern: Vec<u8> = (0..buf.len()).map(|i| (i * 7 + 3) as u8).collect();
    buf.write(0, &pattern).unwrap();
    let whole = d.dmabuf(&ctx, p.ordinal(), buf.addr(), buf.len() as u64).unwrap().expect("device memory exports a dma-buf");
    assert_eq!((whole.base, whole.offset, whole.len), (buf.addr(), 0, buf.len() as u64));
    // A range that starts inside the first page: the same pages, the offset kept.
    let inner = d.dmabuf(&ctx, p.ordinal(), buf.addr() + 100, 50).unwrap().expect("inner range");
    assert_eq!((inner.base, inner.offset, inner.len), (buf.addr(), 100, 50));
    if readable {
        assert_eq!(pread_fd(whole.fd(), 0, buf.len()), pattern);
        assert_eq!(pread_fd(inner.fd(), inner.offset, 50), pattern[100..150].to_vec());
    }
    // The call pushes the memory's context and leaves the thread's own as it was.
    assert_eq!(Context::current().unwrap(), before);
    // VMM memory: one chunk, and a range over two.
    let g = VmmBuffer::granularity(p.ordinal(), false).unwrap();
    let v = VmmBuffer::new(p, p.ordinal(), 2, g, false).unwrap();
    let one = d.dmabuf(&ctx, p.ordinal(), v.addr(), g).unwrap().expect("one VMM chunk exports");
    assert_eq!((one.base, one.offset), (v.addr(), 0));
    match d.dmabuf(&ctx, p.ordinal(), v.addr(), v.len()) {
        Ok(Some(_)) => "a range over two VMM chunks exports as one dma-buf".into(),
        Ok(None) => "a range over two VMM chunks: not supported".into(),
        Err(e) => format!("a range over two VMM chunks is refused ({e})"),
    }
}

#[test]
fn mock_dmabuf() {
    let Some(lib) = build_mock("dmabuf") else { return };
    let out = run_child(&lib, "mock_dmabuf_child", &[]);
    assert!(out.contains("mock dmabuf ok: a range over two VMM chunks is refused"), "{out}");
    run_child(&lib, "mock_dmabuf_refused_child", &[("MOCK_CUDA_NO_DMABUF", "1")]);
    run_child(&lib, "mock_dmabuf_refused_child", &[("MOCK_CUDA_DMABUF_FAIL", "1")]);
    let _ = std::fs::remove_dir_all(lib.parent().unwrap());
}

#[test]
#[ignore = "run by mock_dmabuf in a child process"]
fn mock_dmabuf_child() {
    if !in_mock_child() {
        return;
    }
    let p = Context::primary(0).unwrap();
    assert!(Driver::get().unwrap().dmabuf_supported(0).unwrap());
    println!("mock dmabuf ok: {}", dmabuf_checks(&p, true));
}

/// A device without dma-buf support (attribute 0), or a driver that answers
/// CUDA_ERROR_NOT_SUPPORTED: no dma-buf, and no error.
#[test]
#[ignore = "run by mock_dmabuf in a child process"]
fn mock_dmabuf_refused_child() {
    if !in_mock_child() {
        return;
    }
    let d = Driver::get().unwrap();
    let p = Context::primary(0).unwrap();
    assert_eq!(d.dmabuf_supported(0).unwrap(), std::env::var("MOCK_CUDA_NO_DMABUF").is_err());
    let buf = DeviceBuffer::new(&p.context(), 4096).unwrap();
    assert!(d.dmabuf(&p.context(), 0, buf.addr(), 4096).unwrap().is_none());
}

#[test]
fn gpu_dmabuf_export() {
    let Some(d) = gpu() else { return };
    let p = Context::primary(0).unwrap();
    if !d.dmabuf_supported(0).unwrap_or(false) {
        println!("gpu dmabuf: device 0 does not export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0 or no entry point)");
        return;
    }
    println!("gpu dmabuf ok: {}", dmabuf_checks(&p, false));
}
