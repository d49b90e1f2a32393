//! Device memory shared between processes of one host (the driver's legacy IPC handles)
//! and batched copies: what same-host peers need to move GPU memory with the GPU's own
//! copy engines instead of through host bounce buffers.
use super::context::{Context, Pushed};
use super::driver::{BatchFn, Driver};
use super::error::Result;
use super::stream::Stream;
use super::sys::*;
use std::ffi::c_void;

/// Size of a driver IPC handle.
pub const IPC_HANDLE_LEN: usize = 64;

/// An exported handle naming one device allocation (cuIpcGetMemHandle). Opaque bytes that a
/// peer process on the same host opens with [`IpcMapping::open`]; untrusted when they come
/// from a peer (the driver validates them and answers an error for garbage).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; IPC_HANDLE_LEN]);

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcHandle({:02x?}..)", &self.0[..8])
    }
}

impl Driver {
    /// Whether the driver has the IPC entry points (export, open, close).
    pub fn has_ipc(&self) -> bool {
        self.f.ipc_get_mem_handle.is_some() && self.f.ipc_open_mem_handle.is_some() && self.f.ipc_close_mem_handle.is_some()
    }

    /// Whether cuMemcpyBatchAsync exists (drivers of CUDA 12.8 and later).
    pub fn has_batch_copy(&self) -> bool {
        self.f.memcpy_batch.is_some()
    }

    /// Exports the allocation that starts at `alloc_base` (cuIpcGetMemHandle, with `ctx`
    /// pushed). Fails for memory the legacy IPC cannot share, such as allocations made with
    /// the virtual memory management API (cuMemCreate/cuMemMap).
    pub fn ipc_export(&self, ctx: &Context, alloc_base: u64) -> Result<IpcHandle> {
        let get = self.opt(self.f.ipc_get_mem_handle, "cuIpcGetMemHandle")?;
        let _g = Pushed::new(self, *ctx)?;
        let mut h = CUipcMemHandle { reserved: [0; IPC_HANDLE_LEN] };
        // SAFETY: h is a valid out-pointer for the call's duration; the driver validates
        // the address.
        self.check("cuIpcGetMemHandle", unsafe { get(&mut h, alloc_base) })?;
        Ok(IpcHandle(h.reserved))
    }

    /// The device's UUID (cuDeviceGetUuid), the same in every process: it tells a peer
    /// which of its devices holds an allocation, whatever the ordinals there.
    pub fn device_uuid(&self, ordinal: i32) -> Result<[u8; 16]> {
        let get = self.opt(self.f.device_get_uuid, "cuDeviceGetUuid")?;
        let mut dev: CUdevice = 0;
        // SAFETY: dev is a valid out-pointer for the call's duration.
        self.check("cuDeviceGet", unsafe { (self.f.device_get)(&mut dev, ordinal) })?;
        let mut u = CUuuid::default();
        // SAFETY: u is a valid out-pointer for the call's duration.
        self.check("cuDeviceGetUuid", unsafe { get(&mut u, dev) })?;
        Ok(u.bytes)
    }

    /// The ordinal of the device whose UUID is `uuid`, if this process sees it.
    pub fn device_by_uuid(&self, uuid: &[u8; 16]) -> Option<i32> {
        let n = self.device_count().ok()?;
        (0..n as i32).find(|&i| self.device_uuid(i).is_ok_and(|u| &u == uuid))
    }
}

/// A peer's allocation opened in this process (cuIpcOpenMemHandle), closed on drop under
/// the context it was opened in.
pub struct IpcMapping {
    base: u64,
    ctx: Context,
}

// SAFETY: the mapping is a device address and a context handle; the driver accepts both
// from any thread.
unsafe impl Send for IpcMapping {}
// SAFETY: as above; nothing here is mutated after creation.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Opens `handle` in `ctx` (pushed for the call), with peer access enabled lazily when
    /// the allocation lives on another device. The driver refuses a handle exported by
    /// this same process, one it cannot reach (another driver instance, a container without
    /// the device nodes) and garbage; each is an error here.
    pub fn open(ctx: &Context, handle: &IpcHandle) -> Result<IpcMapping> {
        let d = Driver::get()?;
        let open = d.opt(d.f.ipc_open_mem_handle, "cuIpcOpenMemHandle")?;
        d.opt(d.f.ipc_close_mem_handle, "cuIpcCloseMemHandle")?;
        let _g = Pushed::new(d, *ctx)?;
        let mut base: CUdeviceptr = 0;
        let h = CUipcMemHandle { reserved: handle.0 };
        // SAFETY: base is a valid out-pointer; the handle is passed by value as the driver
        // API declares; the driver validates its contents.
        d.check("cuIpcOpenMemHandle", unsafe { open(&mut base, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) })?;
        Ok(IpcMapping { base, ctx: *ctx })
    }

    /// Where the peer's allocation starts in this process.
    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn context(&self) -> Context {
        self.ctx
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        let Some(close) = d.f.ipc_close_mem_handle else { return };
        let g = Pushed::new(d, self.ctx);
        // SAFETY: base came from cuIpcOpenMemHandle and is closed once, here.
        if let Err(e) = d.check("cuIpcCloseMemHandle", unsafe { close(self.base) }) {
            log::warn!("{e}");
        }
        drop(g);
    }
}

impl Stream {
    /// Queues `dsts.len()` copies between unified addresses in one driver call
    /// (cuMemcpyBatchAsync; sources read in stream order). All three slices must have the
    /// same length. Errors with [`super::CudaError::Missing`] where the driver lacks it.
    ///
    /// # Safety
    /// Every range must stay valid, and the destinations untouched by anyone else, until the
    /// copies complete (an event recorded after them reports ready).
    pub unsafe fn copy_batch(&self, dsts: &mut [u64], srcs: &mut [u64], sizes: &mut [usize]) -> Result<()> {
        let d = Driver::get()?;
        let batch = d.f.memcpy_batch.ok_or(super::CudaError::Missing { func: "cuMemcpyBatchAsync" })?;
        let n = dsts.len().min(srcs.len()).min(sizes.len());
        if n == 0 {
            return Ok(());
        }
        let mut attr = CUmemcpyAttributes { src_access_order: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, ..Default::default() };
        let mut idx: usize = 0;
        let (dp, sp, zp) = (dsts.as_mut_ptr(), srcs.as_mut_ptr(), sizes.as_mut_ptr());
        let raw = self.raw();
        // SAFETY: the arrays hold n entries each and live for the call; one attribute entry
        // applies to every copy (index 0); the caller keeps the ranges valid until done.
        let (name, r) = unsafe {
            match batch {
                BatchFn::V2(f) => ("cuMemcpyBatchAsync_v2", f(dp, sp, zp, n, &mut attr, &mut idx, 1, raw)),
                BatchFn::V1(f) => {
                    let mut fail: usize = usize::MAX;
                    ("cuMemcpyBatchAsync", f(dp, sp, zp, n, &mut attr, &mut idx, 1, &mut fail, raw))
                }
            }
        };
        d.check(name, r)
    }
}

/// Whether `e` says the driver cannot do batched copies at all (so callers stop trying).
pub fn batch_unsupported(e: &super::CudaError) -> bool {
    matches!(e, super::CudaError::Missing { .. }) || e.code() == Some(CUDA_ERROR_NOT_SUPPORTED)
}

#[allow(dead_code)]
fn _assert_layouts() {
    // The driver reads these by value / by pointer with these exact sizes.
    const _: () = assert!(std::mem::size_of::<CUipcMemHandle>() == 64);
    const _: () = assert!(std::mem::size_of::<CUmemcpyAttributes>() == 24);
    let _ = std::ptr::null::<c_void>();
}
