//! GPU memory in the engine: classifying registrations (capturing their context, DESIGN
//! rule 4) and copies for loopback. The registry of device regions is in registry.rs.
use crate::cuda;
use crate::error::{Error, Result};

/// What a VRAM registration captured: its owning context and device, and whether peers
/// reach it through staging (no FI_HMEM MR) or directly. For VMM memory, which belongs to
/// no context, the context is the device's primary context (retained by the registration).
#[derive(Clone, Copy, Debug)]
pub struct DeviceMem {
    pub ctx: cuda::Context,
    pub ordinal: i32,
    pub staged: bool,
    /// Managed (unified) memory: registered with FI_HMEM but not as device-only.
    pub managed: bool,
}

/// Checks that `[addr, addr+len)` is what it claims to be: device memory of one
/// allocation for VRAM (capturing its context), and not device memory for DRAM.
pub fn classify(addr: u64, len: u64, vram: bool) -> Result<Option<cuda::PointerInfo>> {
    if !vram {
        // Without a driver nothing can be device memory.
        if let Ok(d) = cuda::Driver::get() {
            if let Ok(info) = d.pointer_info(addr) {
                if info.is_device() {
                    return Err(Error::InvalidParam(format!("{addr:#x} is device memory (GPU {}) but was registered as DRAM", info.device_ordinal.unwrap_or(-1))));
                }
            }
        }
        return Ok(None);
    }
    let d = cuda::Driver::get().map_err(|e| Error::NotSupported(format!("VRAM registration needs the CUDA driver: {e}")))?;
    let info = d.pointer_info(addr).map_err(|e| Error::InvalidParam(format!("{addr:#x} is not device memory: {e}")))?;
    if !info.is_device() {
        return Err(Error::InvalidParam(format!("{addr:#x} is host memory ({:?}) but was registered as VRAM", info.memory_type)));
    }
    if info.context.is_none() && info.device_ordinal.is_none() {
        return Err(Error::NotSupported(format!("device memory at {addr:#x} belongs to no context and no device")));
    }
    if !info.contains(addr, len) {
        // VMM memory (no context of its own): the range reported is one mapped chunk; a
        // registration may span several chunks mapped back to back in one reservation.
        let spans = info.context.is_none() && vmm_span_ok(d, info.device_ordinal.unwrap_or(0), addr, len);
        if !spans {
            return Err(Error::InvalidParam(format!(
                "[{addr:#x}, +{len}) is not inside one device allocation [{:#x}, +{})", info.range_start, info.range_size
            )));
        }
    }
    Ok(Some(info))
}

/// Whether `[addr, addr+len)` is covered by VMM mappings of device `ordinal` that follow
/// each other without a gap (cuMemGetAddressRange per chunk, under the primary context).
fn vmm_span_ok(d: &cuda::Driver, ordinal: i32, addr: u64, len: u64) -> bool {
    let Ok(p) = cuda::Context::primary(ordinal) else { return false };
    let end = addr.saturating_add(len);
    let mut at = addr;
    while at < end {
        if !d.pointer_info(at).is_ok_and(|i| i.is_device() && i.context.is_none() && i.device_ordinal == Some(ordinal)) {
            return false;
        }
        let Ok((base, size)) = d.address_range(&p, at) else { return false };
        if size == 0 || base > at || base.saturating_add(size) <= at {
            return false;
        }
        at = base + size;
    }
    true
}

/// Loopback copy where either side may be device memory (of the context given for it).
///
/// # Safety
/// Both ranges must be valid for `len` bytes and not touched by anyone else meanwhile.
pub unsafe fn copy(dst: u64, dst_dev: Option<cuda::Context>, src: u64, src_dev: Option<cuda::Context>, len: usize) -> Result<()> {
    // SAFETY: forwarded from the caller for every branch.
    unsafe {
        match (dst_dev, src_dev) {
            (None, None) => std::ptr::copy(src as *const u8, dst as *mut u8, len),
            (Some(d), None) => d.copy_htod(dst, std::slice::from_raw_parts(src as *const u8, len))?,
            (None, Some(s)) => s.copy_dtoh(std::slice::from_raw_parts_mut(dst as *mut u8, len), src)?,
            (Some(d), Some(_)) => d.copy_dtod(dst, src, len)?,
        }
    }
    Ok(())
}
