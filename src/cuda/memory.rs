//! Memory: synchronous copies under a context, pinned host bounce buffers, host
//! registration, and device buffers (test helpers).
use super::context::{Context, Pushed};
use super::driver::Driver;
use super::error::{CudaError, Result};
use super::sys::*;
use std::ffi::c_void;
use std::ptr::NonNull;

/// Checks that [offset, offset + n) fits in `len`.
pub(super) fn check_range(what: &str, len: usize, offset: usize, n: usize) -> Result<()> {
    match offset.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        _ => Err(CudaError::Invalid(format!("{what}: {n} bytes at offset {offset} exceed its {len} bytes"))),
    }
}

/// Waits for the legacy default stream, where the synchronous cuMemcpy calls run.
fn sync_legacy_stream(d: &Driver) -> Result<()> {
    // SAFETY: the NULL stream is the context's legacy default stream; a context is current.
    d.check("cuStreamSynchronize", unsafe { (d.f.stream_synchronize)(std::ptr::null_mut()) })
}

/// Synchronous copies. Each makes `self` current on the calling thread (and leaves it
/// current, as rule 4 wants) and returns once the copy is complete. They run on the
/// context's legacy default stream, so they also wait for work other code queued there
/// (and on blocking streams): fine for cold paths and tests; the staging pipeline uses a
/// [`Stream`](super::Stream) of its own.
impl Context {
    /// Host to device.
    ///
    /// # Safety
    /// [dst, dst + src.len()) must be memory the driver can write (device memory, or host
    /// memory known to CUDA) that nothing else reads or writes during the call and that no
    /// Rust reference covers.
    pub unsafe fn copy_htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let d = Driver::get()?;
        self.make_current()?;
        // SAFETY: src is a live slice of src.len() bytes; the caller vouches for dst.
        d.check("cuMemcpyHtoD_v2", unsafe { (d.f.memcpy_htod)(dst, src.as_ptr() as *const c_void, src.len()) })?;
        // From pageable memory the call may return before the DMA lands.
        sync_legacy_stream(d)
    }

    /// Device to host.
    ///
    /// # Safety
    /// [src, src + dst.len()) must be memory the driver can read that nothing writes during
    /// the call.
    pub unsafe fn copy_dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let d = Driver::get()?;
        self.make_current()?;
        // SAFETY: dst is a live exclusive slice of dst.len() bytes; the caller vouches for src.
        d.check("cuMemcpyDtoH_v2", unsafe { (d.f.memcpy_dtoh)(dst.as_mut_ptr() as *mut c_void, src, dst.len()) })
    }

    /// Device to device.
    ///
    /// # Safety
    /// [src, src + len) must be readable and [dst, dst + len) writable by the driver, not
    /// overlapping, not touched by anyone else during the call, and not covered by a Rust
    /// reference.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let d = Driver::get()?;
        let copy = d.opt(d.f.memcpy_dtod, "cuMemcpyDtoD_v2")?;
        self.make_current()?;
        // SAFETY: the caller vouches for both ranges.
        d.check("cuMemcpyDtoD_v2", unsafe { copy(dst, src, len) })?;
        // Device-to-device copies are asynchronous to the host even in this form.
        sync_legacy_stream(d)
    }

    /// Sets `len` bytes at `dst` to `value` and waits for it.
    ///
    /// # Safety
    /// As for [`copy_dtod`](Self::copy_dtod)'s destination.
    pub unsafe fn memset(&self, dst: u64, value: u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let d = Driver::get()?;
        let set = d.opt(d.f.memset_d8, "cuMemsetD8_v2")?;
        self.make_current()?;
        // SAFETY: the caller vouches for the destination range.
        d.check("cuMemsetD8_v2", unsafe { set(dst, value, len) })?;
        sync_legacy_stream(d)
    }
}

/// Page-locked host memory from cuMemHostAlloc (PORTABLE: usable from every context), for
/// staging bounce buffers. Zeroed at allocation; freed on drop. Free it only when no copy
/// into or out of it is pending.
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    ctx: Context,
}

// SAFETY: the buffer is plain host memory owned by this value; the driver frees it from
// any thread.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only reads (as_slice) or hands out the raw pointer.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` (> 0) bytes with `ctx` pushed for the call (the thread's current
    /// context is unchanged).
    pub fn new(ctx: &Context, len: usize) -> Result<PinnedBuffer> {
        if len == 0 {
            return Err(CudaError::Invalid("pinned buffer of 0 bytes".into()));
        }
        let d = Driver::get()?;
        let _g = Pushed::new(d, *ctx)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: p is a valid out-pointer; a context is current (pushed).
        d.check("cuMemHostAlloc", unsafe { (d.f.mem_host_alloc)(&mut p, len, CU_MEMHOSTALLOC_PORTABLE) })?;
        let Some(ptr) = NonNull::new(p as *mut u8) else {
            return Err(d.err("cuMemHostAlloc", CUDA_ERROR_OUT_OF_MEMORY));
        };
        // SAFETY: the driver returned len writable bytes at ptr; zeroing makes them
        // initialised for as_slice.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedBuffer { ptr, len, ctx: *ctx })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The context it was allocated under.
    pub fn context(&self) -> Context {
        self.ctx
    }
    /// The bytes. Do not call while an async copy into the buffer is pending (the async
    /// copy functions are `unsafe` for that reason).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr/len describe our initialised allocation, alive as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        let g = Pushed::new(d, self.ctx);
        if let Err(e) = &g {
            log::warn!("freeing pinned buffer without its context: {e}");
        }
        // SAFETY: ptr came from cuMemHostAlloc and is freed exactly once.
        if let Err(e) = d.check("cuMemFreeHost", unsafe { (d.f.mem_free_host)(self.ptr.as_ptr() as *mut c_void) }) {
            log::warn!("{e}");
        }
        drop(g);
    }
}

/// Host memory page-locked in place (cuMemHostRegister_v2), unregistered on drop.
pub struct HostRegistration {
    ptr: *mut u8,
    len: usize,
    ctx: Context,
}

// SAFETY: holds only an address and a context handle; unregistering works from any thread.
unsafe impl Send for HostRegistration {}
// SAFETY: no shared-access methods touch the memory.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers [ptr, ptr + len) (PORTABLE) with `ctx` pushed for the call.
    ///
    /// # Safety
    /// The memory must stay allocated until this value is dropped.
    pub unsafe fn new(ctx: &Context, ptr: *mut u8, len: usize) -> Result<HostRegistration> {
        if len == 0 || ptr.is_null() {
            return Err(CudaError::Invalid("host registration of a null or empty range".into()));
        }
        let d = Driver::get()?;
        let reg = d.opt(d.f.mem_host_register, "cuMemHostRegister_v2")?;
        d.opt(d.f.mem_host_unregister, "cuMemHostUnregister")?;
        let _g = Pushed::new(d, *ctx)?;
        // SAFETY: the caller keeps the range allocated while registered.
        d.check("cuMemHostRegister_v2", unsafe { reg(ptr as *mut c_void, len, CU_MEMHOSTREGISTER_PORTABLE) })?;
        Ok(HostRegistration { ptr, len, ctx: *ctx })
    }
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        let Some(unreg) = d.f.mem_host_unregister else { return };
        let g = Pushed::new(d, self.ctx);
        // SAFETY: ptr was registered by new() and is unregistered exactly once.
        if let Err(e) = d.check("cuMemHostUnregister", unsafe { unreg(self.ptr as *mut c_void) }) {
            log::warn!("{e}");
        }
        drop(g);
    }
}

/// Device memory from cuMemAlloc_v2 in a given context, freed on drop (test helper; the
/// engine never allocates device memory). All its methods push the context for the call
/// and return only when the device is done.
pub struct DeviceBuffer {
    addr: u64,
    len: usize,
    ctx: Context,
}

// SAFETY: holds only a device address and a context handle; the driver accepts both from
// any thread.
unsafe impl Send for DeviceBuffer {}
// SAFETY: methods taking &self only issue driver calls on device memory, which the driver
// serialises.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `len` (> 0) bytes in `ctx`.
    pub fn new(ctx: &Context, len: usize) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(CudaError::Invalid("device buffer of 0 bytes".into()));
        }
        let d = Driver::get()?;
        let alloc = d.opt(d.f.mem_alloc, "cuMemAlloc_v2")?;
        d.opt(d.f.mem_free, "cuMemFree_v2")?;
        let _g = Pushed::new(d, *ctx)?;
        let mut addr: CUdeviceptr = 0;
        // SAFETY: addr is a valid out-pointer; a context is current (pushed).
        d.check("cuMemAlloc_v2", unsafe { alloc(&mut addr, len) })?;
        Ok(DeviceBuffer { addr, len, ctx: *ctx })
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn context(&self) -> Context {
        self.ctx
    }

    /// Writes `src` at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        check_range("device buffer", self.len, offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let d = Driver::get()?;
        let _g = Pushed::new(d, self.ctx)?;
        // SAFETY: the destination lies inside our allocation (checked); src is a live slice.
        let r = unsafe { (d.f.memcpy_htod)(self.addr + offset as u64, src.as_ptr() as *const c_void, src.len()) };
        d.check("cuMemcpyHtoD_v2", r)?;
        sync_legacy_stream(d)
    }

    /// Reads `dst.len()` bytes from `offset`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range("device buffer", self.len, offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let d = Driver::get()?;
        let _g = Pushed::new(d, self.ctx)?;
        // SAFETY: the source lies inside our allocation (checked); dst is a live exclusive slice.
        let r = unsafe { (d.f.memcpy_dtoh)(dst.as_mut_ptr() as *mut c_void, self.addr + offset as u64, dst.len()) };
        d.check("cuMemcpyDtoH_v2", r)
    }

    /// The whole buffer, read back.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len];
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// Sets every byte to `value`.
    pub fn fill(&self, value: u8) -> Result<()> {
        let d = Driver::get()?;
        let set = d.opt(d.f.memset_d8, "cuMemsetD8_v2")?;
        let _g = Pushed::new(d, self.ctx)?;
        // SAFETY: the range is exactly our allocation.
        d.check("cuMemsetD8_v2", unsafe { set(self.addr, value, self.len) })?;
        sync_legacy_stream(d)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        let Some(free) = d.f.mem_free else { return };
        let g = Pushed::new(d, self.ctx);
        // SAFETY: addr came from cuMemAlloc_v2 and is freed exactly once.
        if let Err(e) = d.check("cuMemFree_v2", unsafe { free(self.addr) }) {
            log::warn!("{e}");
        }
        drop(g);
    }
}
