//! How a VRAM registration reaches the provider (issue #24): by dma-buf (FI_MR_DMABUF,
//! how verbs and EFA reach GPU memory on current kernels), by plain FI_HMEM (the CUDA
//! interface and device ordinal), or not at all (packed staging through host memory). The
//! kinds are tried in that order, as far as config `vram_registration` allows, on every
//! rail at once: a registration is zero-copy only when every rail took it.
use super::gpu::DeviceMem;
use super::port::{Mr, Port};
use super::registry::GpuRegistry;
use crate::config::VramPolicy;
use crate::cuda;
use crate::error::{Error, Result};
use crate::fabric::{DmaBufRange, Hmem};
use std::sync::Arc;

/// libfabric's FI_HMEM_CUDA interface number.
pub const FI_HMEM_CUDA: u32 = 1;

/// The kind a registration took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VramReg {
    DmaBuf,
    Hmem,
    Staged,
}

impl VramReg {
    pub fn describe(self) -> &'static str {
        match self {
            VramReg::DmaBuf => "is registered with the provider by dma-buf (FI_MR_DMABUF): zero-copy",
            VramReg::Hmem => "is registered with the provider by FI_HMEM (CUDA interface): zero-copy",
            VramReg::Staged => "is staged through host memory (not registered with the provider)",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            VramReg::DmaBuf => "dma-buf",
            VramReg::Hmem => "FI_HMEM",
            VramReg::Staged => "staged",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A registration's outcome: its MRs (one per rail; none when staged), the kind taken, and
/// why the kinds before it were not.
pub struct Registered {
    pub mrs: Vec<Mr>,
    pub kind: VramReg,
    pub why: String,
}

/// Registers `[addr, addr + len)` of `dev` on every rail, by the first kind that `policy`
/// allows and every rail takes. `export` makes the dma-buf (the CUDA driver's answer);
/// `apply_ctx` makes the memory's context current before the provider first sees the
/// memory (rule 4). A kind that only `policy` names and that is refused is an error
/// (NOT_SUPPORTED), so a test that pins a path cannot pass on another.
///
/// # Safety
/// The memory stays allocated and mapped while the returned MRs live.
#[allow(clippy::too_many_arguments)]
pub unsafe fn register(rails: &[Arc<dyn Port>], next_key: &mut u64, policy: VramPolicy, addr: u64, len: u64, dev: &DeviceMem,
                       export: &dyn Fn() -> cuda::Result<Option<cuda::DmaBuf>>, apply_ctx: &dyn Fn() -> Result<()>) -> Result<Registered> {
    let mut why: Vec<String> = Vec::new();
    let only = |k: VramReg| match policy {
        VramPolicy::DmaBuf => k == VramReg::DmaBuf,
        VramPolicy::Hmem => k == VramReg::Hmem,
        VramPolicy::Staged => k == VramReg::Staged,
        VramPolicy::Auto => false,
    };
    let allowed = |k: VramReg| policy == VramPolicy::Auto || only(k);
    let refuse = |k: VramReg, why: &[String]| {
        Err(Error::NotSupported(format!("vram_registration={policy:?} asks for a {} registration only, which was refused ({})", k.name(), why.join("; "))))
    };
    if policy == VramPolicy::Staged {
        return Ok(Registered { mrs: Vec::new(), kind: VramReg::Staged, why: "vram_registration=staged".into() });
    }
    let no_hmem: Vec<String> = rails.iter().filter(|r| !r.caps().hmem).map(|r| r.caps().prov_name.clone()).collect();
    if !no_hmem.is_empty() {
        why.push(format!("provider {} offers no FI_HMEM", dedup(no_hmem).join(", ")));
    } else {
        apply_ctx()?;
        if allowed(VramReg::DmaBuf) {
            match dmabuf_attempt(rails, next_key, addr, len, dev, export) {
                Ok(mrs) => return Ok(Registered { mrs, kind: VramReg::DmaBuf, why: "the provider took the driver's dma-buf".into() }),
                Err(e) => why.push(e),
            }
        }
        if allowed(VramReg::Hmem) {
            let mut mrs = Vec::with_capacity(rails.len());
            let mut failed = None;
            for r in rails {
                *next_key += 1;
                let hmem = Hmem { iface: FI_HMEM_CUDA, device: dev.ordinal, device_only: !dev.managed };
                // SAFETY: forwarded from the caller.
                let reg = unsafe { r.register(addr as *const u8, len as usize, *next_key, Some(hmem)) }.or_else(|e| {
                    if !hmem.device_only {
                        return Err(e);
                    }
                    // A provider that does not know the flag may refuse it: the region is
                    // the same without it (only shm's choice of protocol reads it).
                    log::debug!("rail {}: FI_HMEM registration with FI_HMEM_DEVICE_ONLY refused ({e}); again without it", r.index());
                    *next_key += 1;
                    // SAFETY: forwarded from the caller.
                    unsafe { r.register(addr as *const u8, len as usize, *next_key, Some(Hmem { device_only: false, ..hmem })) }
                });
                match reg {
                    Ok(m) => mrs.push(m),
                    Err(e) => {
                        failed = Some(format!("FI_HMEM registration refused by {}: {e}", r.caps().prov_name));
                        break;
                    }
                }
            }
            match failed {
                None => return Ok(Registered { mrs, kind: VramReg::Hmem, why: why.join("; ") }),
                Some(e) => why.push(e),
            }
        }
    }
    match policy {
        VramPolicy::DmaBuf => refuse(VramReg::DmaBuf, &why),
        VramPolicy::Hmem => refuse(VramReg::Hmem, &why),
        _ => Ok(Registered { mrs: Vec::new(), kind: VramReg::Staged, why: why.join("; ") }),
    }
}

/// A dma-buf registration on every rail, or why not.
fn dmabuf_attempt(rails: &[Arc<dyn Port>], next_key: &mut u64, addr: u64, len: u64, dev: &DeviceMem,
                  export: &dyn Fn() -> cuda::Result<Option<cuda::DmaBuf>>) -> std::result::Result<Vec<Mr>, String> {
    if let Some(r) = rails.iter().find(|r| !r.caps().dmabuf) {
        return Err(format!("no dma-buf registration: {}", r.caps().no_dmabuf_reason()));
    }
    let buf = match export() {
        Ok(Some(b)) => b,
        Ok(None) => return Err("the CUDA driver or device does not export dma-bufs".into()),
        Err(e) => return Err(format!("the CUDA driver gave no dma-buf of [{addr:#x}, +{len}): {e}")),
    };
    let range = DmaBufRange { fd: buf.fd(), base: buf.base, offset: buf.offset, len: buf.len as usize };
    let mut mrs = Vec::with_capacity(rails.len());
    for r in rails {
        *next_key += 1;
        // SAFETY: the dma-buf names the caller's memory, which stays mapped while the MRs
        // live (forwarded); each MR keeps its own handle of the buffer.
        match unsafe { r.register_dmabuf(&range, *next_key, (FI_HMEM_CUDA, dev.ordinal)) } {
            Ok(m) => mrs.push(m),
            Err(e) => return Err(format!("dma-buf registration refused by {}: {e}", r.caps().prov_name)),
        }
    }
    Ok(mrs)
}

fn dedup(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v.dedup();
    v
}

/// The INFO line that says which kind a registration took and why, once per engine and
/// kind (every registration would flood the log).
pub fn log_kind(owner: &str, gpu: &GpuRegistry, r: &Registered) {
    if gpu.first_of_kind(r.kind.bit()) {
        let why = if r.why.is_empty() { String::new() } else { format!(" ({})", r.why) };
        log::info!("{owner}: GPU memory {}{why}; further registrations of this kind are not logged", r.kind.describe());
    }
}

#[cfg(test)]
#[path = "gpu_reg_tests.rs"]
mod tests;
