//! CUDA through the driver API (libcuda), loaded at run time: the only module that
//! touches CUDA.
//!
//! Why at run time: the plugin must load, and serve DRAM, on hosts without a CUDA driver
//! (CPU-only machines, CI, containers without the NVIDIA runtime) — DESIGN rule 9. The
//! stock NIXL plugin links libcuda and libcudart, so the dynamic loader refuses it there
//! before any code runs. Here nothing CUDA is needed at build time or in the `.so`'s
//! NEEDED list: [`Driver::get`] dlopens `libcuda.so.1` (or `$NIXL_FABRIC_CUDA_LIB`, see
//! [`LIB_ENV`]) on first use, and on a host without it every call returns
//! [`CudaError::Unavailable`] carrying the dlopen error text (NOT_SUPPORTED for NIXL)
//! instead of panicking. Only the driver API is used (no runtime), so the contexts are
//! the application's own: the pointer's context is captured from its attributes and made
//! current where its memory is touched (rule 4).
//!
//! Pieces: [`Driver`] (loading, [`Driver::pointer_info`]), [`Context`] (capture and
//! `make_current`), synchronous copies on `Context`, [`Stream`]/[`Event`] for pipelined
//! staging copies, [`PinnedBuffer`] bounce buffers, [`IpcHandle`]/[`IpcMapping`] for
//! device memory shared with same-host peers and batched copies, [`VmmMapping`] for
//! peers' VMM memory imported from POSIX fds, [`DmaBuf`] for device memory registered
//! with a provider by dma-buf, [`CopyKernel`] for many
//! small device-to-device copies in one launch, and the test helpers
//! [`DeviceBuffer`], [`Context::primary`], [`Context::create`].
mod context;
mod dmabuf;
mod driver;
mod error;
mod gather;
mod ipc;
mod memory;
mod pointer;
mod stream;
mod sys;
mod vmm;

pub use context::{Context, OwnedContext, PrimaryContext};
pub use dmabuf::DmaBuf;
pub use driver::{library_path, Driver, DEFAULT_LIB, LIB_ENV};
pub use error::{CudaError, Result};
pub use gather::CopyKernel;
pub use ipc::{batch_unsupported, IpcHandle, IpcMapping, IPC_HANDLE_LEN};
pub use memory::{DeviceBuffer, HostRegistration, PinnedBuffer};
pub use pointer::{MemoryType, PointerInfo};
pub use stream::{Event, Stream};
pub use vmm::{VmmBuffer, VmmChunk, VmmMapping};

/// Whether the CUDA driver loaded and initialised (loads it on first call).
pub fn available() -> bool {
    Driver::get().is_ok()
}

/// Why the driver is not usable, None when it is (loads it on first call).
pub fn unavailable_reason() -> Option<String> {
    Driver::get().err().map(|e| e.to_string())
}

/// Number of CUDA devices; 0 when the driver is not available.
pub fn device_count() -> usize {
    Driver::get().and_then(|d| d.device_count()).unwrap_or(0)
}

/// The attributes of `addr` (see [`Driver::pointer_info`]).
pub fn pointer_info(addr: u64) -> Result<PointerInfo> {
    Driver::get()?.pointer_info(addr)
}

#[cfg(test)]
pub(crate) mod tests;
