//! Device memory exported as a dma-buf (cuMemGetHandleForAddressRange), which is how a NIC
//! reaches GPU memory through the kernel's dma-buf import (verbs, EFA) instead of a
//! vendor peer-memory module.
use super::context::{Context, Pushed};
use super::driver::Driver;
use super::error::{CudaError, Result};
use super::sys::*;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

/// A dma-buf of the host pages holding `[addr, addr + len)`: the driver exports whole
/// pages, so the buffer starts at `base` (the address rounded down to the host page size)
/// and the registered range starts `offset` bytes into it. The fd is ours and closes on
/// drop; a provider that imported it holds its own reference.
#[derive(Debug)]
pub struct DmaBuf {
    fd: OwnedFd,
    /// The page-aligned device address at the buffer's offset 0.
    pub base: u64,
    /// Where the registered range starts inside the buffer (`addr - base`).
    pub offset: u64,
    /// The registered range's length (not rounded).
    pub len: u64,
}

impl DmaBuf {
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A memfd of `len` bytes standing in for a driver's dma-buf (tests without a driver).
    #[cfg(test)]
    pub fn for_tests(len: u64) -> Result<DmaBuf> {
        // SAFETY: the name is a NUL-terminated literal; the fd returned is ours.
        let fd = unsafe { libc::memfd_create(c"nf-test-dmabuf".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(CudaError::Invalid(format!("memfd_create: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: a fresh fd nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: fd is open; ftruncate only sizes the memfd.
        if unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), len as i64) } != 0 {
            return Err(CudaError::Invalid(format!("ftruncate: {}", std::io::Error::last_os_error())));
        }
        Ok(DmaBuf { fd, base: 0, offset: 0, len })
    }
}

/// The host page size (the granularity dma-buf exports work in).
pub(super) fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the running system.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as u64 } else { 4096 }
}

/// `[addr, addr + len)` widened to whole pages of `page`: (aligned base, offset of `addr`
/// in it, aligned length). None where the end overflows.
pub(super) fn page_span(addr: u64, len: u64, page: u64) -> Option<(u64, u64, u64)> {
    let base = addr & !(page - 1);
    let end = addr.checked_add(len)?.checked_add(page - 1)? & !(page - 1);
    Some((base, addr - base, end - base))
}

impl Driver {
    /// Whether device `ordinal` can export its memory as a dma-buf
    /// (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, and the export entry point exists).
    pub fn dmabuf_supported(&self, ordinal: i32) -> Result<bool> {
        if self.f.mem_get_handle_for_address_range.is_none() {
            return Ok(false);
        }
        let get_attr = self.opt(self.f.device_get_attribute, "cuDeviceGetAttribute")?;
        let mut dev: CUdevice = 0;
        // SAFETY: dev is a live out-pointer for the call.
        self.check("cuDeviceGet", unsafe { (self.f.device_get)(&mut dev, ordinal) })?;
        let mut v = 0;
        // SAFETY: v is a live out-pointer; the attribute is an int.
        self.check("cuDeviceGetAttribute", unsafe { get_attr(&mut v, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) })?;
        Ok(v != 0)
    }

    /// Exports the pages holding `[addr, addr + len)` (device memory of `ctx`'s device, or
    /// VMM memory mapped for it) as a dma-buf, with `ctx` pushed for the call. `Ok(None)`:
    /// this driver or device does not export dma-bufs (no entry point, the device attribute
    /// says no, or CUDA_ERROR_NOT_SUPPORTED); other refusals (e.g. a range the driver will
    /// not export in one piece) are errors. Either way the caller registers another way.
    pub fn dmabuf(&self, ctx: &Context, ordinal: i32, addr: u64, len: u64) -> Result<Option<DmaBuf>> {
        let Some(export) = self.f.mem_get_handle_for_address_range else { return Ok(None) };
        if !self.dmabuf_supported(ordinal)? {
            return Ok(None);
        }
        let (base, offset, span) = page_span(addr, len, page_size())
            .ok_or_else(|| CudaError::Invalid(format!("[{addr:#x}, +{len}) overflows")))?;
        let _g = Pushed::new(self, *ctx)?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD the driver writes one int through
        // the handle pointer, which points at `fd` for the call's duration.
        let r = unsafe { export(&mut fd as *mut std::ffi::c_int as *mut std::ffi::c_void, base, span as usize, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) };
        if r == CUDA_ERROR_NOT_SUPPORTED {
            return Ok(None);
        }
        self.check("cuMemGetHandleForAddressRange", r)?;
        if fd < 0 {
            return Err(CudaError::Invalid("cuMemGetHandleForAddressRange gave no fd".into()));
        }
        // SAFETY: the driver handed us a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Some(DmaBuf { fd, base, offset, len }))
    }
}

#[cfg(test)]
mod tests {
    use super::page_span;

    #[test]
    fn spans_are_whole_pages() {
        assert_eq!(page_span(0x10000, 4096, 4096), Some((0x10000, 0, 4096)));
        assert_eq!(page_span(0x10010, 4096, 4096), Some((0x10000, 0x10, 8192)));
        assert_eq!(page_span(0x10fff, 1, 4096), Some((0x10000, 0xfff, 4096)));
        assert_eq!(page_span(0x10000, 1, 65536), Some((0x10000, 0, 65536)));
        assert_eq!(page_span(u64::MAX - 10, 20, 4096), None);
    }
}
