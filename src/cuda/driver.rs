//! Loading libcuda at run time and resolving the entry points this module calls.
use super::error::{fallback_name, CudaError, Result};
use super::sys::*;
use libloading::Library;
use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

/// Environment variable that replaces the driver library path (default `libcuda.so.1`,
/// found by the dynamic loader's usual search). Set it to load a driver from an unusual
/// location, or a stand-in for tests. It is read once, by the first [`Driver::get`].
pub const LIB_ENV: &str = "NIXL_FABRIC_CUDA_LIB";
/// The driver library's soname.
pub const DEFAULT_LIB: &str = "libcuda.so.1";

/// The library path [`Driver::get`] loads: `$NIXL_FABRIC_CUDA_LIB` when set and not empty,
/// else `libcuda.so.1`.
pub fn library_path() -> String {
    match std::env::var(LIB_ENV) {
        Ok(p) if !p.is_empty() => p,
        _ => DEFAULT_LIB.to_string(),
    }
}

/// Resolved entry points. Those without `Option` are essential: a library that lacks one
/// is refused at load. Optional ones answer [`CudaError::Missing`] when called.
pub(super) struct Fns {
    pub init: FnInit,
    pub driver_get_version: FnDriverGetVersion,
    pub get_error_name: FnGetErrorName,
    pub device_get_count: FnDeviceGetCount,
    pub device_get: FnDeviceGet,
    pub ctx_get_current: FnCtxGetCurrent,
    pub ctx_set_current: FnCtxSetCurrent,
    pub ctx_push_current: FnCtxPushCurrent,
    pub ctx_pop_current: FnCtxPopCurrent,
    pub pointer_get_attribute: FnPointerGetAttribute,
    pub memcpy_htod: FnMemcpyHtoD,
    pub memcpy_dtoh: FnMemcpyDtoH,
    pub memcpy_htod_async: FnMemcpyHtoDAsync,
    pub memcpy_dtoh_async: FnMemcpyDtoHAsync,
    pub stream_create: FnStreamCreate,
    pub stream_synchronize: FnStreamOp,
    pub stream_query: FnStreamOp,
    pub stream_destroy: FnStreamOp,
    pub event_create: FnEventCreate,
    pub event_record: FnEventRecord,
    pub event_query: FnEventOp,
    pub event_destroy: FnEventOp,
    pub mem_host_alloc: FnMemHostAlloc,
    pub mem_free_host: FnMemFreeHost,

    pub pointer_get_attributes: Option<FnPointerGetAttributes>,
    pub pointer_set_attribute: Option<FnPointerSetAttribute>,
    pub primary_ctx_retain: Option<FnDevicePrimaryCtxRetain>,
    pub primary_ctx_release: Option<(&'static str, FnDevicePrimaryCtxRelease)>,
    pub ctx_create_v2: Option<FnCtxCreateV2>,
    pub ctx_create_v4: Option<FnCtxCreateV4>,
    pub ctx_destroy: Option<FnCtxDestroy>,
    pub ctx_get_device: Option<FnCtxGetDevice>,
    pub mem_alloc: Option<FnMemAlloc>,
    pub mem_free: Option<FnMemFree>,
    pub memcpy_dtod: Option<FnMemcpyDtoD>,
    pub memcpy_async: Option<FnMemcpyAsync>,
    pub memcpy_dtod_async: Option<FnMemcpyDtoDAsync>,
    pub memset_d8: Option<FnMemsetD8>,
    pub event_synchronize: Option<FnEventOp>,
    pub mem_host_register: Option<FnMemHostRegister>,
    pub mem_host_unregister: Option<FnMemHostUnregister>,
    pub ipc_get_mem_handle: Option<FnIpcGetMemHandle>,
    pub ipc_open_mem_handle: Option<FnIpcOpenMemHandle>,
    pub ipc_close_mem_handle: Option<FnIpcCloseMemHandle>,
    pub device_get_uuid: Option<FnDeviceGetUuid>,
    /// The batch copy in whichever form the driver has (CUDA >= 12.8).
    pub memcpy_batch: Option<BatchFn>,
    pub module_load_data: Option<FnModuleLoadData>,
    pub module_unload: Option<FnModuleUnload>,
    pub module_get_function: Option<FnModuleGetFunction>,
    pub launch_kernel: Option<FnLaunchKernel>,
    /// dma-buf export of device memory (CUDA >= 11.7).
    pub device_get_attribute: Option<FnDeviceGetAttribute>,
    pub mem_get_handle_for_address_range: Option<FnMemGetHandleForAddressRange>,
    /// The virtual memory management API (CUDA >= 10.2); any may be absent.
    pub vmm: VmmFns,
}

/// Entry points of the virtual memory management API, each optional.
#[derive(Default)]
pub(super) struct VmmFns {
    pub mem_create: Option<FnMemCreate>,
    pub mem_release: Option<FnMemRelease>,
    pub address_reserve: Option<FnMemAddressReserve>,
    pub address_free: Option<FnMemAddressFree>,
    pub map: Option<FnMemMap>,
    pub unmap: Option<FnMemUnmap>,
    pub set_access: Option<FnMemSetAccess>,
    pub retain_handle: Option<FnMemRetainAllocationHandle>,
    pub props_from_handle: Option<FnMemGetAllocationPropertiesFromHandle>,
    pub export: Option<FnMemExportToShareableHandle>,
    pub import: Option<FnMemImportFromShareableHandle>,
    pub address_range: Option<FnMemGetAddressRange>,
    pub granularity: Option<FnMemGetAllocationGranularity>,
}

/// cuMemcpyBatchAsync changed shape in CUDA 13 (the failure index went away); the symbol
/// name says which one a driver has.
#[derive(Clone, Copy)]
pub(super) enum BatchFn {
    V2(FnMemcpyBatchAsyncV2),
    V1(FnMemcpyBatchAsyncV1),
}

/// The loaded CUDA driver. One per process, created by the first [`Driver::get`] and kept
/// for the life of the process (the library is never unloaded, so handles and the error
/// strings it returns stay valid).
pub struct Driver {
    pub(super) f: Fns,
    path: String,
    version: i32,
    _lib: Library,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Driver({}, version {})", self.path, self.version)
    }
}

/// Looks up `name` (NUL-terminated) as a `T`.
///
/// # Safety
/// `T` must be the function-pointer type that the driver API documents for `name`.
unsafe fn sym<T: Copy>(lib: &Library, name: &'static [u8]) -> Option<T> {
    // SAFETY: the caller guarantees T matches the symbol; we copy the pointer out while
    // `lib` is alive, and Driver keeps `lib` loaded for as long as the pointer is used.
    unsafe { lib.get::<T>(name).ok().map(|s| *s) }
}

impl Driver {
    /// The process's driver, loaded (and cuInit'ed) on first use. Fails, every time and
    /// without panicking, on a host where the library cannot be loaded, lacks an essential
    /// entry point, or cuInit fails (e.g. CUDA_ERROR_NO_DEVICE). The first call runs
    /// cuInit: call it only once VRAM is actually in play.
    pub fn get() -> Result<&'static Driver> {
        static DRIVER: OnceLock<Result<Driver>> = OnceLock::new();
        DRIVER.get_or_init(|| Driver::load(&library_path())).as_ref().map_err(Clone::clone)
    }

    /// Loads the library at `path`, resolves the entry points and runs cuInit(0).
    pub(crate) fn load(path: &str) -> Result<Driver> {
        let unavailable = |reason: String| CudaError::Unavailable { lib: path.to_string(), reason };
        // SAFETY: loading runs the library's initializers; the CUDA driver is built to be
        // dlopen'ed by any process (the CUDA runtime does the same).
        let lib = unsafe { Library::new(path) }.map_err(|e| unavailable(e.to_string()))?;

        macro_rules! need {
            ($name:literal) => {{
                const N: &[u8] = concat!($name, "\0").as_bytes();
                // SAFETY: the field this fills has the type sys.rs declares for $name.
                match unsafe { sym(&lib, N) } {
                    Some(p) => p,
                    None => return Err(unavailable(format!("library lacks the essential entry point {}", $name))),
                }
            }};
        }
        macro_rules! opt {
            ($name:literal) => {{
                const N: &[u8] = concat!($name, "\0").as_bytes();
                // SAFETY: the field this fills has the type sys.rs declares for $name.
                unsafe { sym(&lib, N) }
            }};
        }
        let release_v2: Option<FnDevicePrimaryCtxRelease> = opt!("cuDevicePrimaryCtxRelease_v2");
        let release_v1: Option<FnDevicePrimaryCtxRelease> = opt!("cuDevicePrimaryCtxRelease");
        let f = Fns {
            init: need!("cuInit"),
            driver_get_version: need!("cuDriverGetVersion"),
            get_error_name: need!("cuGetErrorName"),
            device_get_count: need!("cuDeviceGetCount"),
            device_get: need!("cuDeviceGet"),
            ctx_get_current: need!("cuCtxGetCurrent"),
            ctx_set_current: need!("cuCtxSetCurrent"),
            ctx_push_current: need!("cuCtxPushCurrent_v2"),
            ctx_pop_current: need!("cuCtxPopCurrent_v2"),
            pointer_get_attribute: need!("cuPointerGetAttribute"),
            memcpy_htod: need!("cuMemcpyHtoD_v2"),
            memcpy_dtoh: need!("cuMemcpyDtoH_v2"),
            memcpy_htod_async: need!("cuMemcpyHtoDAsync_v2"),
            memcpy_dtoh_async: need!("cuMemcpyDtoHAsync_v2"),
            stream_create: need!("cuStreamCreate"),
            stream_synchronize: need!("cuStreamSynchronize"),
            stream_query: need!("cuStreamQuery"),
            stream_destroy: need!("cuStreamDestroy_v2"),
            event_create: need!("cuEventCreate"),
            event_record: need!("cuEventRecord"),
            event_query: need!("cuEventQuery"),
            event_destroy: need!("cuEventDestroy_v2"),
            mem_host_alloc: need!("cuMemHostAlloc"),
            mem_free_host: need!("cuMemFreeHost"),
            pointer_get_attributes: opt!("cuPointerGetAttributes"),
            pointer_set_attribute: opt!("cuPointerSetAttribute"),
            primary_ctx_retain: opt!("cuDevicePrimaryCtxRetain"),
            primary_ctx_release: release_v2
                .map(|p| ("cuDevicePrimaryCtxRelease_v2", p))
                .or(release_v1.map(|p| ("cuDevicePrimaryCtxRelease", p))),
            ctx_create_v2: opt!("cuCtxCreate_v2"),
            ctx_create_v4: opt!("cuCtxCreate_v4"),
            ctx_destroy: opt!("cuCtxDestroy_v2"),
            ctx_get_device: opt!("cuCtxGetDevice"),
            mem_alloc: opt!("cuMemAlloc_v2"),
            mem_free: opt!("cuMemFree_v2"),
            memcpy_dtod: opt!("cuMemcpyDtoD_v2"),
            memcpy_async: opt!("cuMemcpyAsync"),
            memcpy_dtod_async: opt!("cuMemcpyDtoDAsync_v2"),
            memset_d8: opt!("cuMemsetD8_v2"),
            event_synchronize: opt!("cuEventSynchronize"),
            mem_host_register: opt!("cuMemHostRegister_v2"),
            mem_host_unregister: opt!("cuMemHostUnregister"),
            ipc_get_mem_handle: opt!("cuIpcGetMemHandle"),
            ipc_open_mem_handle: opt!("cuIpcOpenMemHandle_v2").or(opt!("cuIpcOpenMemHandle")),
            ipc_close_mem_handle: opt!("cuIpcCloseMemHandle"),
            device_get_uuid: opt!("cuDeviceGetUuid_v2").or(opt!("cuDeviceGetUuid")),
            memcpy_batch: opt!("cuMemcpyBatchAsync_v2")
                .map(BatchFn::V2)
                .or_else(|| opt!("cuMemcpyBatchAsync").map(BatchFn::V1)),
            module_load_data: opt!("cuModuleLoadData"),
            module_unload: opt!("cuModuleUnload"),
            module_get_function: opt!("cuModuleGetFunction"),
            launch_kernel: opt!("cuLaunchKernel"),
            device_get_attribute: opt!("cuDeviceGetAttribute"),
            mem_get_handle_for_address_range: opt!("cuMemGetHandleForAddressRange"),
            vmm: VmmFns {
                mem_create: opt!("cuMemCreate"),
                mem_release: opt!("cuMemRelease"),
                address_reserve: opt!("cuMemAddressReserve"),
                address_free: opt!("cuMemAddressFree"),
                map: opt!("cuMemMap"),
                unmap: opt!("cuMemUnmap"),
                set_access: opt!("cuMemSetAccess"),
                retain_handle: opt!("cuMemRetainAllocationHandle"),
                props_from_handle: opt!("cuMemGetAllocationPropertiesFromHandle"),
                export: opt!("cuMemExportToShareableHandle"),
                import: opt!("cuMemImportFromShareableHandle"),
                address_range: opt!("cuMemGetAddressRange_v2"),
                granularity: opt!("cuMemGetAllocationGranularity"),
            },
        };
        let mut d = Driver { f, path: path.to_string(), version: 0, _lib: lib };
        // SAFETY: cuInit takes a flags word (must be 0) and touches no memory of ours.
        let r = unsafe { (d.f.init)(0) };
        if r != CUDA_SUCCESS {
            return Err(unavailable(format!("cuInit failed: {} ({r})", d.error_name(r))));
        }
        let mut v = 0;
        // SAFETY: v is a valid out-pointer for the call's duration.
        let r = unsafe { (d.f.driver_get_version)(&mut v) };
        d.check("cuDriverGetVersion", r)?;
        d.version = v;
        log::debug!("CUDA driver {} loaded, version {}.{}", d.path, v / 1000, (v % 1000) / 10);
        Ok(d)
    }

    /// The path the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// cuDriverGetVersion: 1000 * major + 10 * minor (13000 for CUDA 13.0).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// cuDeviceGetCount.
    pub fn device_count(&self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: n is a valid out-pointer for the call's duration.
        self.check("cuDeviceGetCount", unsafe { (self.f.device_get_count)(&mut n) })?;
        Ok(n.max(0) as usize)
    }

    /// The driver's name for a `CUresult` (cuGetErrorName), e.g. "CUDA_ERROR_INVALID_VALUE".
    pub fn error_name(&self, code: i32) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: p is a valid out-pointer; on success the driver stores a pointer to a
        // static NUL-terminated string, which stays valid while the library is loaded.
        let r = unsafe { (self.f.get_error_name)(code, &mut p) };
        if r == CUDA_SUCCESS && !p.is_null() {
            // SAFETY: see above; the string is read before this function returns.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            fallback_name(code)
        }
    }

    /// Ok for CUDA_SUCCESS, else the error naming `func`.
    pub(super) fn check(&self, func: &'static str, r: CUresult) -> Result<()> {
        if r == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.err(func, r))
        }
    }

    pub(super) fn err(&self, func: &'static str, code: CUresult) -> CudaError {
        CudaError::Driver { func, code, name: self.error_name(code) }
    }

    /// An optional entry point, or the error that names it.
    pub(super) fn opt<T: Copy>(&self, p: Option<T>, func: &'static str) -> Result<T> {
        p.ok_or(CudaError::Missing { func })
    }

    /// cuPointerSetAttribute(SYNC_MEMOPS = 1) on the allocation holding `addr`: synchronous
    /// copies that touch it then complete before they return, which a NIC reading the
    /// memory directly (GPUDirect RDMA) relies on.
    pub fn set_sync_memops(&self, addr: u64) -> Result<()> {
        let set = self.opt(self.f.pointer_set_attribute, "cuPointerSetAttribute")?;
        let one: std::ffi::c_uint = 1;
        // SAFETY: the value pointer refers to a live unsigned int for the call's duration;
        // the call only changes driver state of the allocation, no memory of ours.
        let r = unsafe { set(&one as *const _ as *const c_void, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, addr) };
        self.check("cuPointerSetAttribute", r)
    }
}
