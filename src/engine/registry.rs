//! Local registrations, with the bounds checks every descriptor goes through, and the
//! engine's registry of device regions and their captured contexts (DESIGN rule 4).
use super::gpu::DeviceMem;
use super::port::Mr;
use super::wire::{IpcDesc, MemDesc};
use crate::cuda;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Weak;
use crate::error::{Error, Result};
use crate::hinted::{Emptiness, Hinted};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Memory types we know (NIXL's numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemKind {
    Dram = 0,
    Vram = 1,
}

impl MemKind {
    pub fn from_raw(v: u32) -> Result<MemKind> {
        match v {
            0 => Ok(MemKind::Dram),
            1 => Ok(MemKind::Vram),
            x => Err(Error::NotSupported(format!("memory type {x} (only DRAM 0 and VRAM 1)"))),
        }
    }
}

/// MRs whose owner went away, waiting to be closed by whoever owns the rails (closing an
/// MR touches the domain, which rule 3 gives to one owner). Once the rails are gone the
/// queue is `closed` and late MRs are dropped on the spot.
#[derive(Default)]
pub struct CloseQueue {
    closed: bool,
    items: Vec<Mr>,
}

pub type SharedCloseQueue = Arc<Hinted<CloseQueue>>;

impl Emptiness for CloseQueue {
    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl CloseQueue {
    pub fn push(q: &SharedCloseQueue, mrs: Vec<Mr>) {
        let mut g = q.lock();
        if g.closed {
            drop(g);
            drop(mrs);
        } else {
            g.items.extend(mrs);
        }
    }
    pub fn drain(q: &SharedCloseQueue) -> Vec<Mr> {
        q.lock_if_any().map(|mut g| std::mem::take(&mut g.items)).unwrap_or_default()
    }
    pub fn close(q: &SharedCloseQueue) -> Vec<Mr> {
        let mut g = q.lock();
        g.closed = true;
        std::mem::take(&mut g.items)
    }
}

/// One local registration: the region and its MR on every rail.
pub struct LocalMem {
    pub engine_id: u64,
    pub base: u64,
    pub len: u64,
    pub kind: MemKind,
    pub dev_id: u64,
    /// Per rail: MR key and local descriptor (NULL where the provider needs none).
    pub keys: Vec<u64>,
    pub descs: Vec<usize>,
    /// Device memory: its captured context, and whether it is staged (no MRs).
    pub dev: Option<DeviceMem>,
    /// Device memory exported for same-host peers (set once, before the registration is shared).
    pub ipc: Option<IpcDesc>,
    /// VMM memory: the device's primary context, retained while registered (the memory
    /// belongs to no context of its own), and where its chunks are handed out (set once).
    pub primary: Option<crate::cuda::PrimaryContext>,
    pub vmm_export: Option<(Arc<super::fd_share::FdServer>, u64)>,
    /// Host memory page-locked for direct GPU copies, on first such use (None inside: it
    /// could not be, e.g. it was pinned already).
    pinned: std::sync::OnceLock<Option<crate::cuda::HostRegistration>>,
    mrs: Vec<Mr>,
    closeq: SharedCloseQueue,
    gpu: Option<Arc<GpuRegistry>>,
}

impl LocalMem {
    #[allow(clippy::too_many_arguments)]
    pub fn new(engine_id: u64, base: u64, len: u64, kind: MemKind, dev_id: u64, rails: usize, mrs: Vec<Mr>,
               closeq: SharedCloseQueue, dev: Option<DeviceMem>, gpu: Option<Arc<GpuRegistry>>) -> LocalMem {
        // Staged device memory has no MRs; its key slots stay 0 so descriptors keep their shape.
        let keys = if mrs.is_empty() { vec![0; rails] } else { mrs.iter().map(|m| m.key).collect() };
        let descs = if mrs.is_empty() { vec![0; rails] } else { mrs.iter().map(|m| m.desc as usize).collect() };
        LocalMem { engine_id, base, len, kind, dev_id, keys, descs, dev, ipc: None, primary: None, vmm_export: None, pinned: std::sync::OnceLock::new(), mrs, closeq, gpu: dev.and(gpu) }
    }

    pub fn desc(&self, rail: usize) -> *mut c_void {
        self.descs[rail] as *mut c_void
    }

    pub fn public(&self, virt_addr: bool) -> MemDesc {
        MemDesc {
            mem_type: self.kind as u8,
            virt_addr,
            staged: self.dev.is_some_and(|d| d.staged),
            engine_id: self.engine_id,
            base: self.base,
            len: self.len,
            dev_id: self.dev_id,
            keys: self.keys.clone(),
            ipc: self.ipc.clone(),
        }
    }

    pub fn check(&self, addr: u64, len: u64, what: &str) -> Result<()> {
        check_range(self.base, self.len, addr, len, what)
    }

    /// Page-locks this host memory for GPU copies under `ctx`, once; a failure (already
    /// pinned, or the driver refuses) leaves it pageable, which is slower but correct.
    pub fn pin_for_gpu(&self, ctx: &crate::cuda::Context) {
        if self.kind != MemKind::Dram {
            return;
        }
        self.pinned.get_or_init(|| {
            // SAFETY: the registration's memory stays allocated while it is registered
            // (NIXL's contract), and the page-lock is dropped with the registration.
            match unsafe { crate::cuda::HostRegistration::new(ctx, self.base as *mut u8, self.len as usize) } {
                Ok(r) => Some(r),
                Err(e) => {
                    log::debug!("host memory [{:#x}, +{}) stays as it is for GPU copies: {e}", self.base, self.len);
                    None
                }
            }
        });
    }
}

impl Drop for LocalMem {
    fn drop(&mut self) {
        if let Some((srv, reg)) = &self.vmm_export {
            srv.remove(*reg);
        }
        if let (Some(g), Some(d)) = (&self.gpu, &self.dev) {
            g.remove(self.base, d.ctx);
        }
        CloseQueue::push(&self.closeq, std::mem::take(&mut self.mrs));
    }
}

/// `[addr, addr+len)` must lie inside `[base, base+size)`; overflow is out of range too.
pub fn check_range(base: u64, size: u64, addr: u64, len: u64, what: &str) -> Result<()> {
    let end = addr.checked_add(len);
    let limit = base.checked_add(size);
    match (end, limit) {
        (Some(e), Some(l)) if addr >= base && e <= l => Ok(()),
        _ => Err(Error::InvalidParam(format!(
            "{what} [{addr:#x}, +{len}) is outside its registration [{base:#x}, +{size})"
        ))),
    }
}

/// The engine's device regions (for checking peers' stage requests) and the distinct
/// contexts they were captured from. `version` changes whenever the context list does, so
/// the driver refreshes its copy cheaply.
#[derive(Default)]
pub struct GpuRegistry {
    regions: Mutex<BTreeMap<u64, Weak<LocalMem>>>,
    contexts: Mutex<Vec<(cuda::Context, usize)>>,
    version: AtomicU64,
    /// Registration kinds (gpu_reg::VramReg bits) already named in the log.
    logged_kinds: std::sync::atomic::AtomicU8,
}

impl GpuRegistry {
    pub fn add(&self, mem: &Arc<LocalMem>, ctx: cuda::Context) {
        let mut r = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        r.retain(|_, w| w.strong_count() > 0);
        r.insert(mem.base, Arc::downgrade(mem));
        drop(r);
        self.add_context(ctx);
    }

    pub fn remove(&self, base: u64, ctx: cuda::Context) {
        self.regions.lock().unwrap_or_else(|p| p.into_inner()).remove(&base);
        self.remove_context(ctx);
    }

    /// Counts one more user of `ctx` (a registration, or a peer's allocation opened in it):
    /// the progress loop applies every context in use.
    pub fn add_context(&self, ctx: cuda::Context) {
        let mut c = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        match c.iter_mut().find(|(x, _)| x.id() == ctx.id()) {
            Some((_, n)) => *n += 1,
            None => {
                c.push((ctx, 1));
                self.version.fetch_add(1, Ordering::Release);
            }
        }
    }

    pub fn remove_context(&self, ctx: cuda::Context) {
        let mut c = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = c.iter().position(|(x, _)| x.id() == ctx.id()) {
            c[i].1 -= 1;
            if c[i].1 == 0 {
                c.remove(i);
                self.version.fetch_add(1, Ordering::Release);
            }
        }
    }

    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// True the first time a registration kind (its bit) is seen by this engine.
    pub fn first_of_kind(&self, bit: u8) -> bool {
        self.logged_kinds.fetch_or(bit, Ordering::Relaxed) & bit == 0
    }

    pub fn has_contexts(&self) -> bool {
        !self.contexts.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    pub fn contexts(&self) -> Vec<cuda::Context> {
        self.contexts.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(c, _)| *c).collect()
    }

    /// The distinct contexts of our live device registrations (not those of peers'
    /// allocations opened here).
    pub fn registered_contexts(&self) -> Vec<cuda::Context> {
        let r = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<cuda::Context> = Vec::new();
        for ctx in r.values().filter_map(Weak::upgrade).filter_map(|m| m.dev.map(|d| d.ctx)) {
            if !out.contains(&ctx) {
                out.push(ctx);
            }
        }
        out
    }

    /// The live device registration holding all of `[addr, addr+len)`, if any.
    pub fn find(&self, addr: u64, len: u64) -> Option<Arc<LocalMem>> {
        let r = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        let (_, w) = r.range(..=addr).next_back()?;
        let m = w.upgrade()?;
        m.check(addr, len, "stage request").ok()?;
        Some(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn ranges() {
        assert!(check_range(100, 10, 100, 10, "x").is_ok());
        assert!(check_range(100, 10, 105, 0, "x").is_ok());
        assert!(check_range(100, 10, 99, 1, "x").is_err());
        assert!(check_range(100, 10, 101, 10, "x").is_err());
        assert!(check_range(100, 10, u64::MAX, 2, "x").is_err());
    }
}
