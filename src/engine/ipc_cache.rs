//! Peers' GPU allocations opened in this process by IPC (legacy handles, or VMM chunks
//! imported from fds), shared by every descriptor and request that uses them, and what a
//! request with same-host segments keeps alive and checks before each post.
use super::counters::{add, Counters};
use super::registry::{GpuRegistry, LocalMem};
use super::wire::{self, IpcDesc};
use crate::cuda;
use crate::error::{Error, Result};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};

/// A peer's device allocation opened in this process. Shared by every descriptor and
/// request that uses it; closed when the last of them is gone, or at once when the peer
/// disconnects (after the copies still running on it have finished).
pub struct IpcEntry {
    pub peer_id: u64,
    /// Where the peer's allocation starts here, and where it starts in the peer.
    pub base: u64,
    pub remote_base: u64,
    pub len: u64,
    pub ctx: cuda::Context,
    mapping: Mutex<Option<Mapping>>,
    /// The primary context retained for a copy that has no device memory of ours to take a
    /// context from (our DRAM with the peer's VRAM); released after the mapping closes.
    primary: Mutex<Option<cuda::PrimaryContext>>,
    counters: Arc<Counters>,
    gpu: Arc<GpuRegistry>,
}

impl IpcEntry {
    pub fn is_open(&self) -> bool {
        self.mapping.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    fn close(&self) {
        if self.mapping.lock().unwrap_or_else(|p| p.into_inner()).take().is_some() {
            add(&self.counters.gpu_ipc_closes, 1);
            self.gpu.remove_context(self.ctx);
        }
        self.primary.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

impl Drop for IpcEntry {
    fn drop(&mut self) {
        self.close();
    }
}

/// How a peer's allocation is mapped here: its legacy IPC handle opened, or its VMM chunks
/// imported from fds and mapped into one range of ours. Dropping it closes the mapping.
pub enum Mapping {
    Legacy(cuda::IpcMapping),
    Vmm(cuda::VmmMapping),
}

impl Mapping {
    pub fn base(&self) -> u64 {
        match self {
            Mapping::Legacy(m) => m.base(),
            Mapping::Vmm(m) => m.base(),
        }
    }
}

/// Imports a peer's VMM allocation: fetches each chunk's fd from the owner's fd socket,
/// then imports and maps them, in order, into one reservation under `ctx`.
fn open_vmm(ctx: &cuda::Context, ipc: &IpcDesc, timeout: std::time::Duration) -> Result<Mapping> {
    let v = ipc.vmm.as_ref().ok_or_else(|| Error::InvalidParam("VMM IPC block without its chunk list".into()))?;
    let d = cuda::Driver::get()?;
    if !d.has_vmm_import() {
        return Err(Error::NotSupported("the driver lacks the VMM import entry points".into()));
    }
    let lens: Vec<u64> = v.chunks.iter().map(|c| c.len).collect();
    let fds = super::fd_share::fetch(&v.socket, v.reg_id, &lens, timeout)?;
    let align = v.chunks.iter().map(|c| c.granularity).max().unwrap_or(1);
    let chunks = v.chunks.iter().zip(fds).map(|(c, fd)| (c.offset, c.len, fd)).collect();
    Ok(Mapping::Vmm(cuda::VmmMapping::import(ctx, chunks, ipc.alloc_len, align)?))
}

/// (peer, remote allocation base, remote length, context id).
type OpenKey = (u64, u64, u64, usize);

/// The engine's open IPC mappings, by (peer, remote allocation base, context), and the
/// allocations whose handle could not be opened (not tried again: they use staging).
pub struct IpcCache {
    /// The engine's name (log lines), counters and device registry (contexts in use).
    owner: String,
    counters: Arc<Counters>,
    gpu: Arc<GpuRegistry>,
    timeout: std::time::Duration,
    /// Keyed by (peer, remote base, remote length, context): two VMM registrations of one
    /// reservation may start at the same chunk and cover different chunk counts.
    open: Mutex<HashMap<OpenKey, Weak<IpcEntry>>>,
    failed: Mutex<HashSet<(u64, u64, u64)>>,
    /// Peers (engine ids) that could not open our memory: copies with them are staged.
    refused: Mutex<HashSet<u64>>,
}

impl IpcCache {
    pub fn new(owner: &str, counters: Arc<Counters>, gpu: Arc<GpuRegistry>, timeout: std::time::Duration) -> IpcCache {
        IpcCache {
            owner: owner.to_string(),
            counters,
            gpu,
            timeout,
            open: Mutex::default(),
            failed: Mutex::default(),
            refused: Mutex::default(),
        }
    }

    pub fn refused(&self, engine_id: u64) -> bool {
        self.refused.lock().unwrap_or_else(|p| p.into_inner()).contains(&engine_id)
    }

    /// Closes every mapping of `peer_id` now (the peer disconnected). The caller made sure no
    /// copy on them is still running.
    pub fn refuse(&self, engine_id: u64) {
        self.refused.lock().unwrap_or_else(|p| p.into_inner()).insert(engine_id);
    }

    pub fn close_peer(&self, peer_id: u64) {
        let entries: Vec<Arc<IpcEntry>> = {
            let mut m = self.open.lock().unwrap_or_else(|p| p.into_inner());
            let v = m.iter().filter(|(k, _)| k.0 == peer_id).filter_map(|(_, w)| w.upgrade()).collect();
            m.retain(|k, w| k.0 != peer_id && w.strong_count() > 0);
            v
        };
        for e in entries {
            e.close();
        }
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).retain(|k| k.0 != peer_id);
    }

    /// Opens (or finds open) peer `peer_id`'s allocation described by `ipc`, for copies
    /// with our memory `local` (VRAM: its context; DRAM: the primary context of the device
    /// holding the peer's allocation). None, with one INFO line per allocation, where the
    /// handle cannot be opened: the caller then stages.
    pub fn open(&self, peer_id: u64, peer_name: &str, ipc: &IpcDesc, local_ctx: Option<cuda::Context>) -> Option<Arc<IpcEntry>> {
        let key = (peer_id, ipc.alloc_base, ipc.alloc_len);
        if self.failed.lock().unwrap_or_else(|p| p.into_inner()).contains(&key) {
            return None;
        }
        let fail = |why: String| {
            log::info!("{}: GPU memory of agent '{peer_name}' at {:#x} cannot be opened by IPC ({why}); it is staged through host memory", self.owner, ipc.alloc_base);
            self.failed.lock().unwrap_or_else(|p| p.into_inner()).insert(key);
            None
        };
        let (ctx, primary) = match local_ctx {
            Some(c) => (c, None),
            None => {
                let d = match cuda::Driver::get() {
                    Ok(d) => d,
                    Err(e) => return fail(e.to_string()),
                };
                let Some(ordinal) = d.device_by_uuid(&ipc.device_uuid) else {
                    return fail("its device is not visible to this process".into());
                };
                match cuda::Context::primary(ordinal) {
                    Ok(p) => (p.context(), Some(p)),
                    Err(e) => return fail(e.to_string()),
                }
            }
        };
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = open.get(&(peer_id, ipc.alloc_base, ipc.alloc_len, ctx.id())).and_then(Weak::upgrade) {
            if e.is_open() {
                return Some(e);
            }
        }
        let opened = if ipc.kind == wire::IPC_KIND_VMM_FD {
            open_vmm(&ctx, ipc, self.timeout.min(std::time::Duration::from_secs(5)))
        } else {
            cuda::IpcMapping::open(&ctx, &cuda::IpcHandle(ipc.handle)).map(Mapping::Legacy).map_err(Error::from)
        };
        let mapping = match opened {
            Ok(m) => m,
            Err(e) => {
                drop(open);
                return fail(e.to_string());
            }
        };
        add(&self.counters.gpu_ipc_opens, 1);
        self.gpu.add_context(ctx);
        log::debug!("{}: opened agent '{peer_name}''s GPU allocation [{:#x}, +{}) at {:#x}", self.owner, ipc.alloc_base, ipc.alloc_len, mapping.base());
        let e = Arc::new(IpcEntry {
            peer_id,
            base: mapping.base(),
            remote_base: ipc.alloc_base,
            len: ipc.alloc_len,
            ctx,
            mapping: Mutex::new(Some(mapping)),
            primary: Mutex::new(primary),
            counters: self.counters.clone(),
            gpu: self.gpu.clone(),
        });
        open.retain(|_, w| w.strong_count() > 0);
        open.insert((peer_id, ipc.alloc_base, ipc.alloc_len, ctx.id()), Arc::downgrade(&e));
        Some(e)
    }
}

/// What a request with direct segments keeps alive, and checks before each post.
pub enum Keep {
    Ipc(Arc<IpcEntry>),
    /// A same-process peer's registration: not kept alive by us (its owner decides), only
    /// checked to still exist when a post starts.
    Local(Weak<LocalMem>),
    /// Our own exported allocation that PeerCopy segments name.
    Export(IpcDesc),
    /// A same-host peer process written by CMA: nothing to keep, but every post first checks
    /// that the process is still the one we connected to.
    Process,
}

impl Keep {
    /// Whether two keeps name the same thing (a request keeps each once).
    pub fn same(&self, other: &Keep) -> bool {
        match (self, other) {
            (Keep::Ipc(a), Keep::Ipc(b)) => Arc::ptr_eq(a, b),
            (Keep::Local(a), Keep::Local(b)) => a.ptr_eq(b),
            (Keep::Process, Keep::Process) => true,
            _ => false,
        }
    }
}

/// Whether every direct target of `keeps` is still there; the error otherwise.
pub fn check_keeps(keeps: &[Keep]) -> Result<()> {
    for k in keeps {
        match k {
            Keep::Ipc(e) if !e.is_open() => return Err(Error::Disconnected("the peer's GPU memory was closed (peer disconnected)".into())),
            Keep::Local(w) if w.strong_count() == 0 => {
                return Err(Error::InvalidParam("the remote registration was deregistered by its engine".into()))
            }
            _ => {}
        }
    }
    Ok(())
}

