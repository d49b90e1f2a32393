//! Raw CUDA driver API declarations: the C types, constants and function-pointer shapes
//! this module resolves from libcuda at run time. Written by hand from NVIDIA's public
//! driver API reference (cuda.h semantics, LP64 Linux); private to `cuda/`.
#![allow(non_camel_case_types, dead_code)]
use std::ffi::{c_char, c_int, c_uint, c_void};

/// `CUresult`: a C enum, passed and returned as `int`.
pub type CUresult = c_int;
/// `CUdevice`: a device handle, an `int` ordinal.
pub type CUdevice = c_int;
/// `CUdeviceptr` (`_v2`): `unsigned long long`, a unified virtual address.
pub type CUdeviceptr = u64;
/// `CUcontext`, `CUstream`, `CUevent`: opaque pointers to driver objects.
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
/// `CUpointer_attribute`: a C enum, passed as `unsigned int`.
pub type CUpointer_attribute = c_uint;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
pub const CUDA_ERROR_STUB_LIBRARY: CUresult = 34;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_ALREADY_MAPPED: CUresult = 208;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;

pub const CU_POINTER_ATTRIBUTE_CONTEXT: CUpointer_attribute = 1;
pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: CUpointer_attribute = 2;
pub const CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: CUpointer_attribute = 6;
pub const CU_POINTER_ATTRIBUTE_IS_MANAGED: CUpointer_attribute = 8;
pub const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: CUpointer_attribute = 9;
pub const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: CUpointer_attribute = 11;
pub const CU_POINTER_ATTRIBUTE_RANGE_SIZE: CUpointer_attribute = 12;

/// `CUmemorytype` values (0 is what cuPointerGetAttributes reports for unknown memory).
pub const CU_MEMORYTYPE_HOST: c_uint = 1;
pub const CU_MEMORYTYPE_DEVICE: c_uint = 2;
pub const CU_MEMORYTYPE_ARRAY: c_uint = 3;
pub const CU_MEMORYTYPE_UNIFIED: c_uint = 4;

pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 0x01;
pub const CU_MEMHOSTALLOC_DEVICEMAP: c_uint = 0x02;
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 0x01;
pub const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 0x02;
/// Stream that does not synchronize with the legacy default (NULL) stream.
pub const CU_STREAM_NON_BLOCKING: c_uint = 0x1;
/// Event without timing data (cheaper to record and query).
pub const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;

/// `CUdevice_attribute` CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: the device can export its
/// memory as a dma-buf (cuMemGetHandleForAddressRange).
pub const CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;
/// `CUmemRangeHandleType` CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: the handle is a dma-buf fd.
pub const CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;

pub type FnInit = unsafe extern "C" fn(flags: c_uint) -> CUresult;
pub type FnDriverGetVersion = unsafe extern "C" fn(version: *mut c_int) -> CUresult;
pub type FnGetErrorName = unsafe extern "C" fn(error: CUresult, p_str: *mut *const c_char) -> CUresult;
pub type FnDeviceGetCount = unsafe extern "C" fn(count: *mut c_int) -> CUresult;
pub type FnDeviceGet = unsafe extern "C" fn(device: *mut CUdevice, ordinal: c_int) -> CUresult;
pub type FnDevicePrimaryCtxRetain = unsafe extern "C" fn(pctx: *mut CUcontext, dev: CUdevice) -> CUresult;
pub type FnDevicePrimaryCtxRelease = unsafe extern "C" fn(dev: CUdevice) -> CUresult;
/// `cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)`.
pub type FnCtxCreateV2 = unsafe extern "C" fn(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult;
/// `cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev)`
/// (what `cuCtxCreate` means in CUDA 13 headers); we pass a zeroed parameter block.
pub type FnCtxCreateV4 =
    unsafe extern "C" fn(pctx: *mut CUcontext, params: *mut c_void, flags: c_uint, dev: CUdevice) -> CUresult;
pub type FnCtxDestroy = unsafe extern "C" fn(ctx: CUcontext) -> CUresult;
pub type FnCtxGetCurrent = unsafe extern "C" fn(pctx: *mut CUcontext) -> CUresult;
pub type FnCtxSetCurrent = unsafe extern "C" fn(ctx: CUcontext) -> CUresult;
pub type FnCtxPushCurrent = unsafe extern "C" fn(ctx: CUcontext) -> CUresult;
pub type FnCtxPopCurrent = unsafe extern "C" fn(pctx: *mut CUcontext) -> CUresult;
pub type FnCtxGetDevice = unsafe extern "C" fn(device: *mut CUdevice) -> CUresult;
pub type FnPointerGetAttribute =
    unsafe extern "C" fn(data: *mut c_void, attribute: CUpointer_attribute, ptr: CUdeviceptr) -> CUresult;
pub type FnPointerGetAttributes = unsafe extern "C" fn(
    num_attributes: c_uint,
    attributes: *mut CUpointer_attribute,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> CUresult;
pub type FnPointerSetAttribute =
    unsafe extern "C" fn(value: *const c_void, attribute: CUpointer_attribute, ptr: CUdeviceptr) -> CUresult;
pub type FnMemAlloc = unsafe extern "C" fn(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult;
pub type FnMemFree = unsafe extern "C" fn(dptr: CUdeviceptr) -> CUresult;
pub type FnMemcpyHtoD = unsafe extern "C" fn(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> CUresult;
pub type FnMemcpyDtoH = unsafe extern "C" fn(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> CUresult;
pub type FnMemcpyDtoD = unsafe extern "C" fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult;
pub type FnMemcpyAsync =
    unsafe extern "C" fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult;
pub type FnMemcpyHtoDAsync =
    unsafe extern "C" fn(dst: CUdeviceptr, src: *const c_void, bytes: usize, stream: CUstream) -> CUresult;
pub type FnMemcpyDtoHAsync =
    unsafe extern "C" fn(dst: *mut c_void, src: CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult;
pub type FnMemcpyDtoDAsync =
    unsafe extern "C" fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult;
/// `cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n)`.
pub type FnMemsetD8 = unsafe extern "C" fn(dst: CUdeviceptr, uc: u8, n: usize) -> CUresult;
pub type FnStreamCreate = unsafe extern "C" fn(stream: *mut CUstream, flags: c_uint) -> CUresult;
/// cuStreamSynchronize, cuStreamQuery, cuStreamDestroy_v2.
pub type FnStreamOp = unsafe extern "C" fn(stream: CUstream) -> CUresult;
pub type FnEventCreate = unsafe extern "C" fn(event: *mut CUevent, flags: c_uint) -> CUresult;
pub type FnEventRecord = unsafe extern "C" fn(event: CUevent, stream: CUstream) -> CUresult;
/// cuEventQuery, cuEventSynchronize, cuEventDestroy_v2.
pub type FnEventOp = unsafe extern "C" fn(event: CUevent) -> CUresult;
/// `cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)`.
pub type FnDeviceGetAttribute = unsafe extern "C" fn(pi: *mut c_int, attrib: c_int, dev: CUdevice) -> CUresult;
/// `cuMemGetHandleForAddressRange(void *handle, CUdeviceptr dptr, size_t size,
/// CUmemRangeHandleType handleType, unsigned long long flags)`; for a dma-buf the driver
/// writes an `int` fd through `handle`.
pub type FnMemGetHandleForAddressRange =
    unsafe extern "C" fn(handle: *mut c_void, dptr: CUdeviceptr, size: usize, handle_type: c_int, flags: u64) -> CUresult;
pub type FnMemHostAlloc = unsafe extern "C" fn(pp: *mut *mut c_void, bytesize: usize, flags: c_uint) -> CUresult;
pub type FnMemFreeHost = unsafe extern "C" fn(p: *mut c_void) -> CUresult;
pub type FnMemHostRegister = unsafe extern "C" fn(p: *mut c_void, bytesize: usize, flags: c_uint) -> CUresult;
pub type FnMemHostUnregister = unsafe extern "C" fn(p: *mut c_void) -> CUresult;

/// `CUipcMemHandle`: an opaque 64-byte block that names an allocation across processes;
/// passed to cuIpcOpenMemHandle by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUipcMemHandle {
    pub reserved: [u8; 64],
}
/// `CUuuid`: 16 bytes naming a device, the same in every process of the host.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}
/// `CUmemLocation`: a location type and its id (0/0 = no hint).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CUmemLocation {
    pub kind: c_int,
    pub id: c_int,
}
/// `CUmemcpyAttributes` (CUDA 12.8+): how the batch copies may access their sources.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CUmemcpyAttributes {
    pub src_access_order: c_int,
    pub src_loc_hint: CUmemLocation,
    pub dst_loc_hint: CUmemLocation,
    pub flags: c_uint,
}
/// Sources are read in stream order (after earlier work of the stream).
pub const CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: c_int = 1;
/// cuIpcOpenMemHandle: enable peer access lazily when the allocation is on another device.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

pub type FnIpcGetMemHandle = unsafe extern "C" fn(handle: *mut CUipcMemHandle, dptr: CUdeviceptr) -> CUresult;
pub type FnIpcOpenMemHandle = unsafe extern "C" fn(dptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) -> CUresult;
pub type FnIpcCloseMemHandle = unsafe extern "C" fn(dptr: CUdeviceptr) -> CUresult;
pub type FnDeviceGetUuid = unsafe extern "C" fn(uuid: *mut CUuuid, dev: CUdevice) -> CUresult;
/// `cuMemcpyBatchAsync_v2` (CUDA 13: what `cuMemcpyBatchAsync` means in its headers).
pub type FnMemcpyBatchAsyncV2 = unsafe extern "C" fn(
    dsts: *mut CUdeviceptr,
    srcs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut CUmemcpyAttributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    stream: CUstream,
) -> CUresult;
/// `cuMemcpyBatchAsync` as CUDA 12.8/12.9 declared it (with a failure-index out-parameter).
pub type FnMemcpyBatchAsyncV1 = unsafe extern "C" fn(
    dsts: *mut CUdeviceptr,
    srcs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut CUmemcpyAttributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    stream: CUstream,
) -> CUresult;

/// `CUmodule` / `CUfunction`: opaque handles of a loaded module and one of its kernels.
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type FnModuleLoadData = unsafe extern "C" fn(module: *mut CUmodule, image: *const c_void) -> CUresult;
pub type FnModuleUnload = unsafe extern "C" fn(module: CUmodule) -> CUresult;
pub type FnModuleGetFunction = unsafe extern "C" fn(f: *mut CUfunction, module: CUmodule, name: *const c_char) -> CUresult;
#[allow(clippy::type_complexity)]
pub type FnLaunchKernel = unsafe extern "C" fn(
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_bytes: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult;

// ---- virtual memory management (cuMemCreate/cuMemMap and shareable handles) ----

/// `CUmemGenericAllocationHandle`: `unsigned long long` naming a physical allocation.
pub type CUmemGenericAllocationHandle = u64;
/// `CUmemAllocationType`: pinned device memory.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CUmemAllocationHandleType`: a POSIX file descriptor (a bit in `requestedHandleTypes`).
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
/// `CUmemLocationType`: a device, `id` its ordinal.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CUmemAccess_flags`: read and write.
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
/// `CUmemAllocationGranularity_flags`: the minimum.
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
pub const CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: CUpointer_attribute = 10;

/// `CUmemAllocationProp` (LP64: 32 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemAllocationProp {
    pub kind: c_int,
    pub requested_handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    /// allocFlags: compressionType, gpuDirectRDMACapable, usage (u16), reserved[4].
    pub alloc_flags: [u8; 8],
}
impl Default for CUmemAllocationProp {
    fn default() -> Self {
        CUmemAllocationProp {
            kind: 0,
            requested_handle_types: 0,
            location: CUmemLocation::default(),
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        }
    }
}
/// `CUmemAccessDesc`: a location and its access flags (12 bytes).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_int,
}

pub type FnMemCreate = unsafe extern "C" fn(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult;
pub type FnMemRelease = unsafe extern "C" fn(handle: CUmemGenericAllocationHandle) -> CUresult;
pub type FnMemAddressReserve =
    unsafe extern "C" fn(ptr: *mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr, flags: u64) -> CUresult;
pub type FnMemAddressFree = unsafe extern "C" fn(ptr: CUdeviceptr, size: usize) -> CUresult;
pub type FnMemMap = unsafe extern "C" fn(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult;
pub type FnMemUnmap = unsafe extern "C" fn(ptr: CUdeviceptr, size: usize) -> CUresult;
pub type FnMemSetAccess =
    unsafe extern "C" fn(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) -> CUresult;
pub type FnMemRetainAllocationHandle =
    unsafe extern "C" fn(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) -> CUresult;
pub type FnMemGetAllocationPropertiesFromHandle =
    unsafe extern "C" fn(prop: *mut CUmemAllocationProp, handle: CUmemGenericAllocationHandle) -> CUresult;
/// `cuMemExportToShareableHandle(void *shareableHandle, handle, handleType, flags)`: for a
/// POSIX fd, `shareableHandle` points to an `int`.
pub type FnMemExportToShareableHandle =
    unsafe extern "C" fn(shareable: *mut c_void, handle: CUmemGenericAllocationHandle, kind: c_int, flags: u64) -> CUresult;
/// `cuMemImportFromShareableHandle(handle*, void *osHandle, type)`: for a POSIX fd,
/// `osHandle` is the fd's value cast to a pointer.
pub type FnMemImportFromShareableHandle =
    unsafe extern "C" fn(handle: *mut CUmemGenericAllocationHandle, os_handle: *mut c_void, kind: c_int) -> CUresult;
/// `cuMemGetAddressRange_v2`: for VMM memory, the range of the mapping holding `dptr`.
pub type FnMemGetAddressRange = unsafe extern "C" fn(base: *mut CUdeviceptr, size: *mut usize, dptr: CUdeviceptr) -> CUresult;
pub type FnMemGetAllocationGranularity =
    unsafe extern "C" fn(granularity: *mut usize, prop: *const CUmemAllocationProp, option: c_int) -> CUresult;
