//! Device memory of the virtual memory management API (cuMemCreate, cuMemAddressReserve,
//! cuMemMap, cuMemSetAccess: PyTorch's expandable segments), shared with same-host peers
//! through POSIX file descriptors: the owner finds the physical chunks mapped under a
//! registration and exports each one (cuMemExportToShareableHandle); a peer imports them
//! (cuMemImportFromShareableHandle) and maps them, in order, into one address range of its
//! own. Such memory has no legacy IPC handle (cuIpcGetMemHandle refuses it).
//!
//! Every entry point is optional: a driver without one answers [`super::CudaError::Missing`]
//! and the caller keeps to staging. How the fds travel between processes is the engine's
//! business; here they are only `OwnedFd`s.
use super::context::{Context, Pushed};
use super::driver::Driver;
use super::error::{CudaError, Result};
use super::sys::*;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// One physical allocation mapped under a registration: where its mapping starts in the
/// owner's address space, its length, and the allocation granularity it was created with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmmChunk {
    pub base: u64,
    pub len: u64,
    pub granularity: u64,
}

impl Driver {
    /// Whether the driver can export VMM chunks (find, check and export them).
    pub fn has_vmm_export(&self) -> bool {
        let v = &self.f.vmm;
        v.address_range.is_some() && v.retain_handle.is_some() && v.props_from_handle.is_some()
            && v.export.is_some() && v.mem_release.is_some() && v.granularity.is_some()
    }

    /// Whether the driver can import and map exported VMM chunks.
    pub fn has_vmm_import(&self) -> bool {
        let v = &self.f.vmm;
        v.import.is_some() && v.address_reserve.is_some() && v.address_free.is_some() && v.map.is_some()
            && v.unmap.is_some() && v.set_access.is_some() && v.mem_release.is_some() && self.f.ctx_get_device.is_some()
    }

    /// CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE of `addr`; None where the driver
    /// cannot tell.
    pub fn legacy_ipc_capable(&self, addr: u64) -> Option<bool> {
        let mut v: u64 = 0;
        // SAFETY: v is a live zeroed 8-byte slot; the attribute is an int (4 bytes).
        let r = unsafe { (self.f.pointer_get_attribute)(&mut v as *mut u64 as *mut c_void, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, addr) };
        (r == CUDA_SUCCESS).then_some(super::pointer::lo_u32(v) != 0)
    }

    /// The range of the allocation holding `addr` (cuMemGetAddressRange_v2, `ctx` pushed):
    /// for VMM memory, the one mapping (physical chunk) that contains it.
    pub fn address_range(&self, ctx: &Context, addr: u64) -> Result<(u64, u64)> {
        let get = self.opt(self.f.vmm.address_range, "cuMemGetAddressRange_v2")?;
        let _g = Pushed::new(self, *ctx)?;
        let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
        // SAFETY: both out-pointers are live for the call; addr is only looked up.
        self.check("cuMemGetAddressRange_v2", unsafe { get(&mut base, &mut size, addr) })?;
        Ok((base, size as u64))
    }

    /// The physical chunks mapped under `[addr, addr+len)`, in address order, each checked
    /// to be exportable as a POSIX fd (created with that handle type requested). At most
    /// `max` chunks; the chunks must follow each other without a gap. `ctx` is pushed
    /// around the calls (the device's primary context for VMM memory).
    pub fn vmm_chunks(&self, ctx: &Context, addr: u64, len: u64, max: usize) -> Result<Vec<VmmChunk>> {
        let v = &self.f.vmm;
        let retain = self.opt(v.retain_handle, "cuMemRetainAllocationHandle")?;
        let props = self.opt(v.props_from_handle, "cuMemGetAllocationPropertiesFromHandle")?;
        let release = self.opt(v.mem_release, "cuMemRelease")?;
        let gran = self.opt(v.granularity, "cuMemGetAllocationGranularity")?;
        let end = addr.checked_add(len).ok_or_else(|| CudaError::Invalid("range overflows".into()))?;
        let _g = Pushed::new(self, *ctx)?;
        let mut out: Vec<VmmChunk> = Vec::new();
        let mut at = addr;
        while at < end {
            let (base, size) = self.address_range(ctx, at)?;
            if size == 0 || base > at || base.checked_add(size).is_none_or(|e| e <= at) {
                return Err(CudaError::Invalid(format!("{at:#x} is not inside the range the driver reports [{base:#x}, +{size})")));
            }
            if out.len() == max {
                return Err(CudaError::Invalid(format!("more than {max} physical chunks under [{addr:#x}, +{len})")));
            }
            let mut h: CUmemGenericAllocationHandle = 0;
            // SAFETY: h is a live out-pointer; the address is only looked up.
            self.check("cuMemRetainAllocationHandle", unsafe { retain(&mut h, base as usize as *mut c_void) })?;
            let mut p = CUmemAllocationProp::default();
            // SAFETY: p is a live out-struct of the declared layout; h is a live handle.
            let r = unsafe { props(&mut p, h) };
            // SAFETY: h came from cuMemRetainAllocationHandle above and is released once.
            let rel = unsafe { release(h) };
            self.check("cuMemGetAllocationPropertiesFromHandle", r)?;
            self.check("cuMemRelease", rel)?;
            if p.requested_handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 0 {
                return Err(CudaError::Invalid(format!(
                    "the physical allocation mapped at {base:#x} was created without the POSIX fd handle type (requestedHandleTypes {:#x})",
                    p.requested_handle_types
                )));
            }
            let mut g: usize = 0;
            // SAFETY: g is a live out-pointer; p is the allocation's own property block.
            self.check("cuMemGetAllocationGranularity", unsafe { gran(&mut g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM) })?;
            if let Some(last) = out.last() {
                if last.base + last.len != base {
                    return Err(CudaError::Invalid(format!("chunks at {:#x} and {base:#x} are not contiguous", last.base)));
                }
            }
            out.push(VmmChunk { base, len: size, granularity: (g as u64).max(1) });
            at = base + size;
        }
        Ok(out)
    }

    /// Exports the physical allocation mapped at `addr` as a POSIX fd
    /// (cuMemExportToShareableHandle, `ctx` pushed). The fd is ours to close.
    pub fn vmm_export_fd(&self, ctx: &Context, addr: u64) -> Result<OwnedFd> {
        let v = &self.f.vmm;
        let retain = self.opt(v.retain_handle, "cuMemRetainAllocationHandle")?;
        let export = self.opt(v.export, "cuMemExportToShareableHandle")?;
        let release = self.opt(v.mem_release, "cuMemRelease")?;
        let _g = Pushed::new(self, *ctx)?;
        let mut h: CUmemGenericAllocationHandle = 0;
        // SAFETY: h is a live out-pointer; the address is only looked up.
        self.check("cuMemRetainAllocationHandle", unsafe { retain(&mut h, addr as usize as *mut c_void) })?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver writes an int
        // through the pointer; h is a live handle.
        let r = unsafe { export(&mut fd as *mut std::ffi::c_int as *mut c_void, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) };
        // SAFETY: h came from cuMemRetainAllocationHandle above and is released once.
        let rel = unsafe { release(h) };
        self.check("cuMemExportToShareableHandle", r)?;
        if fd < 0 {
            return Err(CudaError::Invalid("cuMemExportToShareableHandle gave no fd".into()));
        }
        // SAFETY: the driver handed us a fresh fd that nothing else owns.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        self.check("cuMemRelease", rel)?;
        Ok(owned)
    }
}

/// A peer's VMM chunks imported and mapped, in order, into one address range reserved in
/// this process, readable and writable by the device of the context it was made in.
/// Unmapped, released and freed on drop under that context.
pub struct VmmMapping {
    base: u64,
    len: u64,
    ctx: Context,
    /// (offset, length) of each mapped chunk, and the imported handles (released on drop).
    mapped: Vec<(u64, u64)>,
    handles: Vec<CUmemGenericAllocationHandle>,
}

// SAFETY: addresses, sizes and handles; the driver accepts them from any thread.
unsafe impl Send for VmmMapping {}
// SAFETY: as above; nothing is mutated after creation.
unsafe impl Sync for VmmMapping {}

impl VmmMapping {
    /// Imports `chunks` (offset from the start of the range, length, the peer's exported
    /// fd) into one reservation of `total` bytes aligned to `align` (the largest chunk
    /// granularity), under `ctx` (pushed). The fds are closed once imported (the imported
    /// handles keep the memory). The chunks must cover `[0, total)` in order.
    pub fn import(ctx: &Context, chunks: Vec<(u64, u64, OwnedFd)>, total: u64, align: u64) -> Result<VmmMapping> {
        let d = Driver::get()?;
        let v = &d.f.vmm;
        let import = d.opt(v.import, "cuMemImportFromShareableHandle")?;
        let reserve = d.opt(v.address_reserve, "cuMemAddressReserve")?;
        let map = d.opt(v.map, "cuMemMap")?;
        require_access_and_teardown(d)?;
        let get_dev = d.opt(d.f.ctx_get_device, "cuCtxGetDevice")?;
        let mut next = 0u64;
        for (off, len, _) in &chunks {
            if *off != next || *len == 0 {
                return Err(CudaError::Invalid(format!("chunk at offset {off:#x} does not follow the previous one (expected {next:#x})")));
            }
            next = off.saturating_add(*len);
        }
        if next != total || total == 0 {
            return Err(CudaError::Invalid(format!("chunks cover {next} bytes, the range is {total}")));
        }
        let _g = Pushed::new(d, *ctx)?;
        let mut dev: CUdevice = 0;
        // SAFETY: dev is a live out-pointer; ctx is current (pushed).
        d.check("cuCtxGetDevice", unsafe { get_dev(&mut dev) })?;
        let mut base: CUdeviceptr = 0;
        // SAFETY: base is a live out-pointer; no fixed address is asked for.
        d.check("cuMemAddressReserve", unsafe { reserve(&mut base, total as usize, align as usize, 0, 0) })?;
        // From here on Drop undoes what was done, whatever fails.
        let mut m = VmmMapping { base, len: total, ctx: *ctx, mapped: Vec::with_capacity(chunks.len()), handles: Vec::with_capacity(chunks.len()) };
        for (off, len, fd) in chunks {
            let mut h: CUmemGenericAllocationHandle = 0;
            // SAFETY: h is a live out-pointer; for a POSIX fd the driver takes the fd's
            // value in the pointer argument and does not take ownership of it.
            d.check("cuMemImportFromShareableHandle", unsafe {
                import(&mut h, fd.as_raw_fd() as isize as *mut c_void, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            })?;
            drop(fd);
            m.handles.push(h);
            // SAFETY: [base+off, +len) lies inside our reservation (checked above) and is
            // not mapped yet; h is a live handle of at least len bytes (the driver checks).
            d.check("cuMemMap", unsafe { map(base + off, len as usize, 0, h, 0) })?;
            m.mapped.push((off, len));
        }
        // the whole range is mapped (every chunk above)
        grant_read_write(d, base, total, dev)?;
        Ok(m)
    }

    /// Where the peer's range starts in this process.
    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn context(&self) -> Context {
        self.ctx
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        let v = &d.f.vmm;
        let g = Pushed::new(d, self.ctx);
        if let Some(unmap) = v.unmap {
            for &(off, len) in &self.mapped {
                // SAFETY: this chunk was mapped by us at base+off and is unmapped once.
                if let Err(e) = d.check("cuMemUnmap", unsafe { unmap(self.base + off, len as usize) }) {
                    log::warn!("{e}");
                }
            }
        }
        if let Some(release) = v.mem_release {
            for &h in &self.handles {
                // SAFETY: h came from cuMemImportFromShareableHandle and is released once.
                if let Err(e) = d.check("cuMemRelease", unsafe { release(h) }) {
                    log::warn!("{e}");
                }
            }
        }
        if let Some(free) = v.address_free {
            // SAFETY: the reservation is ours and nothing is mapped in it any more.
            if let Err(e) = d.check("cuMemAddressFree", unsafe { free(self.base, self.len as usize) }) {
                log::warn!("{e}");
            }
        }
        drop(g);
    }
}

/// Device memory allocated with the VMM API as `chunks` physical allocations of
/// `chunk_len` bytes each, mapped back to back into one reserved range (the way PyTorch's
/// expandable segments grow): for tests. With `posix_fd` the allocations may be exported.
pub struct VmmBuffer {
    base: u64,
    len: u64,
    ctx: Context,
    handles: Vec<CUmemGenericAllocationHandle>,
}

impl VmmBuffer {
    /// The allocation granularity of device `ordinal` (minimum).
    pub fn granularity(ordinal: i32, posix_fd: bool) -> Result<u64> {
        let d = Driver::get()?;
        let gran = d.opt(d.f.vmm.granularity, "cuMemGetAllocationGranularity")?;
        let p = prop(ordinal, posix_fd);
        let mut g: usize = 0;
        // SAFETY: g is a live out-pointer; p is a live property block.
        d.check("cuMemGetAllocationGranularity", unsafe { gran(&mut g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM) })?;
        Ok(g as u64)
    }

    /// Allocates on the device of `ctx` (pushed); `chunk_len` must be a multiple of the
    /// granularity.
    pub fn new(ctx: &Context, ordinal: i32, chunks: usize, chunk_len: u64, posix_fd: bool) -> Result<VmmBuffer> {
        let d = Driver::get()?;
        let v = &d.f.vmm;
        let create = d.opt(v.mem_create, "cuMemCreate")?;
        let reserve = d.opt(v.address_reserve, "cuMemAddressReserve")?;
        let map = d.opt(v.map, "cuMemMap")?;
        require_access_and_teardown(d)?;
        let g = Self::granularity(ordinal, posix_fd)?;
        let len = chunk_len * chunks as u64;
        let _p = Pushed::new(d, *ctx)?;
        let mut base: CUdeviceptr = 0;
        // SAFETY: base is a live out-pointer.
        d.check("cuMemAddressReserve", unsafe { reserve(&mut base, len as usize, g as usize, 0, 0) })?;
        let mut b = VmmBuffer { base, len, ctx: *ctx, handles: Vec::new() };
        let p = prop(ordinal, posix_fd);
        for i in 0..chunks as u64 {
            let mut h: CUmemGenericAllocationHandle = 0;
            // SAFETY: h is a live out-pointer; p a live property block.
            d.check("cuMemCreate", unsafe { create(&mut h, chunk_len as usize, &p, 0) })?;
            b.handles.push(h);
            // SAFETY: the chunk's place lies inside our reservation and is not mapped.
            d.check("cuMemMap", unsafe { map(base + i * chunk_len, chunk_len as usize, 0, h, 0) })?;
        }
        grant_read_write(d, base, len, ordinal)?;
        Ok(b)
    }

    pub fn addr(&self) -> u64 {
        self.base
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

fn prop(ordinal: i32, posix_fd: bool) -> CUmemAllocationProp {
    CUmemAllocationProp {
        kind: CU_MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: if posix_fd { CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR } else { 0 },
        location: CUmemLocation { kind: CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
        ..Default::default()
    }
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        let v = &d.f.vmm;
        let g = Pushed::new(d, self.ctx);
        let chunk = if self.handles.is_empty() { 0 } else { self.len / self.handles.len() as u64 };
        for (i, &h) in self.handles.iter().enumerate() {
            if let Some(unmap) = v.unmap {
                // SAFETY: chunk i was mapped here by new() (or its map failed: the driver
                // then refuses the unmap, which is only logged).
                let _ = unsafe { unmap(self.base + i as u64 * chunk, chunk as usize) };
            }
            if let Some(release) = v.mem_release {
                // SAFETY: h came from cuMemCreate and is released once.
                let _ = unsafe { release(h) };
            }
        }
        if let Some(free) = v.address_free {
            // SAFETY: the reservation is ours and nothing is mapped in it any more.
            let _ = unsafe { free(self.base, self.len as usize) };
        }
        drop(g);
    }
}

#[allow(dead_code)]
fn _assert_layouts() {
    const _: () = assert!(std::mem::size_of::<CUmemAllocationProp>() == 32);
    const _: () = assert!(std::mem::size_of::<CUmemAccessDesc>() == 12);
}

/// Lets device `dev` read and write `[base, +len)`, every byte of which is mapped.
fn grant_read_write(d: &Driver, base: u64, len: u64, dev: i32) -> Result<()> {
    let set_access = d.opt(d.f.vmm.set_access, "cuMemSetAccess")?;
    let desc = CUmemAccessDesc {
        location: CUmemLocation { kind: CU_MEM_LOCATION_TYPE_DEVICE, id: dev },
        flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the caller mapped the whole range; desc is one live entry.
    d.check("cuMemSetAccess", unsafe { set_access(base, len as usize, &desc, 1) })
}

/// The entry points a mapping needs after it is made (access, and unmapping it again), checked
/// before anything is reserved so that a partial driver fails cleanly up front.
fn require_access_and_teardown(d: &Driver) -> Result<()> {
    let v = &d.f.vmm;
    d.opt(v.set_access, "cuMemSetAccess")?;
    d.opt(v.unmap, "cuMemUnmap")?;
    d.opt(v.mem_release, "cuMemRelease")?;
    d.opt(v.address_free, "cuMemAddressFree")?;
    Ok(())
}
