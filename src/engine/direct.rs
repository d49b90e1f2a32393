//! Direct copies: memory of a same-host peer that this process can address itself, so the
//! bytes move with one copy and no rail. Two cases (issue 12):
//! - a peer process's GPU memory, opened here from the IPC handle its descriptor carries
//!   (cuIpcOpenMemHandle, once per remote allocation, under the context we copy with), and
//!   copied by the GPU's copy engines (cuMemcpyBatchAsync where the driver has it);
//! - an engine of this same process, whose registrations are plain addresses here: device
//!   copies through the driver when either side is VRAM, memcpy for DRAM on both sides.
//!
//! The initiator does every copy, on its progress loop, under the copy's context (rule 4;
//! the debug switch that skips applying contexts skips it here too). A copy is done when
//! its event completes; the notification is sent after that (rule 5).
use super::core::Core;
use super::driver::Driver;
use super::local_peers::Locality;
use super::registry::LocalMem;
use super::request::{Op, Phase, ReqState, Request, SegKind};
use super::staging::Slab;
use super::wire::{self, CopyReq, CtrlType, IpcDesc, StageAck};
use crate::error::Status;
use crate::cuda;
use crate::error::{Error, Result};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};

/// Streams per context that single copies are spread over where the driver has no batch
/// copy: small copies of one descriptor each then overlap on the copy engines.
const FALLBACK_STREAMS: usize = 4;
/// Device ranges longer than this go to the copy engines even in a many-range request: one
/// long range copies as fast there, and would leave most of a shared launch's CTAs idle.
const KERNEL_MAX_RANGE: usize = 4 << 20;
/// Fewest ranges worth a launch of their own when a request is spread over the streams.
const KERNEL_MIN_GROUP: usize = 64;
/// Largest IPC block a copy request carries (a VMM block of up to ~40 chunks); beyond it
/// our GPU memory with a peer's host memory is staged.
const COPY_MAX_IPC_BYTES: usize = 1024;

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
    core: Arc<Core>,
}

impl IpcEntry {
    pub fn is_open(&self) -> bool {
        self.mapping.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    fn close(&self) {
        if self.mapping.lock().unwrap_or_else(|p| p.into_inner()).take().is_some() {
            super::counters::add(&self.core.counters.gpu_ipc_closes, 1);
            self.core.gpu.remove_context(self.ctx);
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

/// The engine's open IPC mappings, by (peer, remote allocation base, context), and the
/// allocations whose handle could not be opened (not tried again: they use staging).
#[derive(Default)]
pub struct IpcCache {
    /// Keyed by (peer, remote base, remote length, context): two VMM registrations of one
    /// reservation may start at the same chunk and cover different chunk counts.
    open: Mutex<HashMap<(u64, u64, u64, usize), Weak<IpcEntry>>>,
    failed: Mutex<HashSet<(u64, u64, u64)>>,
    /// Peers (engine ids) that could not open our memory: copies with them are staged.
    refused: Mutex<HashSet<u64>>,
}

impl IpcCache {
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

impl Core {
    pub fn peer_copy_refused(&self, engine_id: u64) -> bool {
        self.ipc.refused.lock().unwrap_or_else(|p| p.into_inner()).contains(&engine_id)
    }

    /// The IPC route is on: config gpu_ipc, and same_host_shm (the switch of every
    /// same-host path).
    pub fn ipc_enabled(&self) -> bool {
        self.cfg.gpu_ipc && self.cfg.same_host_shm
    }

    /// Opens (or finds open) peer `peer_id`'s allocation described by `ipc`, for copies
    /// with our memory `local` (VRAM: its context; DRAM: the primary context of the device
    /// holding the peer's allocation). None, with one INFO line per allocation, where the
    /// handle cannot be opened: the caller then stages.
    pub fn ipc_open(self: &Arc<Self>, peer_id: u64, peer_name: &str, ipc: &IpcDesc, local_ctx: Option<cuda::Context>) -> Option<Arc<IpcEntry>> {
        let key = (peer_id, ipc.alloc_base, ipc.alloc_len);
        if self.ipc.failed.lock().unwrap_or_else(|p| p.into_inner()).contains(&key) {
            return None;
        }
        let fail = |why: String| {
            log::info!("{}: GPU memory of agent '{peer_name}' at {:#x} cannot be opened by IPC ({why}); it is staged through host memory", self.name, ipc.alloc_base);
            self.ipc.failed.lock().unwrap_or_else(|p| p.into_inner()).insert(key);
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
        let mut open = self.ipc.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = open.get(&(peer_id, ipc.alloc_base, ipc.alloc_len, ctx.id())).and_then(Weak::upgrade) {
            if e.is_open() {
                return Some(e);
            }
        }
        let opened = if ipc.kind == wire::IPC_KIND_VMM_FD {
            open_vmm(&ctx, ipc, self.cfg.timeout().min(std::time::Duration::from_secs(5)))
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
        super::counters::add(&self.counters.gpu_ipc_opens, 1);
        self.gpu.add_context(ctx);
        log::debug!("{}: opened agent '{peer_name}''s GPU allocation [{:#x}, +{}) at {:#x}", self.name, ipc.alloc_base, ipc.alloc_len, mapping.base());
        let e = Arc::new(IpcEntry {
            peer_id,
            base: mapping.base(),
            remote_base: ipc.alloc_base,
            len: ipc.alloc_len,
            ctx,
            mapping: Mutex::new(Some(mapping)),
            primary: Mutex::new(primary),
            core: self.clone(),
        });
        open.retain(|_, w| w.strong_count() > 0);
        open.insert((peer_id, ipc.alloc_base, ipc.alloc_len, ctx.id()), Arc::downgrade(&e));
        Some(e)
    }
}

/// The direct route for one descriptor pair, if there is one: the segment's remote address
/// and kind, and what the request must keep. The pair was bounds-checked already.
pub fn plan(core: &Arc<Core>, peer: &super::peer::Peer, local: (u64, u64, &LocalMem),
            remote: (u64, &super::wire::MemDesc, &Mutex<Vec<Arc<IpcEntry>>>)) -> Option<(u64, SegKind, Keep)> {
    let (_la, ll, lm) = local;
    let (ra, desc, opened) = remote;
    let pin = |m: &LocalMem, ctx: Option<cuda::Context>| {
        if let (Some(c), true) = (ctx, core.cfg.pin_host_memory) {
            m.pin_for_gpu(&c);
        }
    };
    match &peer.local {
        Locality::SameProcess(view) if core.cfg.same_host_shm => {
            let kind = super::registry::MemKind::from_raw(desc.mem_type as u32).ok()?;
            let rm = view.upgrade()?.find(ra, ll, kind)?;
            let ctx = lm.dev.map(|d| d.ctx).or(rm.dev.map(|d| d.ctx));
            pin(lm, ctx);
            pin(&rm, ctx);
            let dev = lm.dev.is_some() && rm.dev.is_some();
            Some((ra, SegKind::Direct { ctx, dev }, Keep::Local(Arc::downgrade(&rm))))
        }
        Locality::SameHost(_) if core.ipc_enabled() => {
            if let Some(ipc) = desc.ipc.as_ref() {
                let e = core.ipc_open(peer.info.engine_id, &peer.name, ipc, lm.dev.map(|d| d.ctx))?;
                let mut held = opened.lock().unwrap_or_else(|p| p.into_inner());
                if !held.iter().any(|x| Arc::ptr_eq(x, &e)) {
                    held.push(e.clone());
                }
                drop(held);
                pin(lm, Some(e.ctx));
                let mapped = e.base + (ra - e.remote_base);
                let dev = lm.dev.is_some();
                return Some((mapped, SegKind::Direct { ctx: Some(e.ctx), dev }, Keep::Ipc(e)));
            }
            // Our GPU memory with the peer's host memory: the peer copies, since only it can
            // address its host memory; it opens our allocation from the handle we send.
            // (A VMM block with many chunks would not fit a control message: staged.)
            let own = lm.ipc.as_ref().filter(|i| desc.mem_type == 0 && !core.peer_copy_refused(peer.info.engine_id)
                && i.encoded_len() <= COPY_MAX_IPC_BYTES)?;
            Some((ra, SegKind::PeerCopy { alloc: own.alloc_base }, Keep::Export(own.clone())))
        }
        _ => None,
    }
}

/// Device copies of one post that are in flight: done when every event completes.
pub struct DirectJob {
    req: Arc<Request>,
    epoch: u64,
    bytes: u64,
    ctx: cuda::Context,
    events: Vec<cuda::Event>,
}

/// The driver's side: streams per context, copies in flight, and whether the driver's
/// batch copy works (found at run time; a driver that refuses it once is not asked again).
#[derive(Default)]
pub struct Direct {
    streams: HashMap<usize, Vec<cuda::Stream>>,
    jobs: Vec<DirectJob>,
    /// The gather-copy kernel per context (None: it cannot run there; not tried again).
    kernels: HashMap<usize, Option<cuda::CopyKernel>>,
    batch_off: bool,
    logged: bool,
    /// Copy requests we sent, waiting for the peer's answer.
    asked: Slab<Asked>,
    /// Peers' copy requests whose device copies are running here.
    serves: Vec<Serve>,
    /// Allocations of initiators opened to serve them, kept open between their requests
    /// (by initiator engine id) until the initiator exits or the engine shuts down.
    served: HashMap<u64, Vec<Arc<IpcEntry>>>,
}

/// One copy request we sent: the post it belongs to and the bytes it moves.
pub struct Asked {
    req: Arc<Request>,
    epoch: u64,
    bytes: u64,
    peer_id: u64,
}

/// A peer's copy request being served: its device copies, then the answer.
struct Serve {
    from: u64,
    token: u64,
    ctx: cuda::Context,
    events: Vec<cuda::Event>,
}

impl Direct {
    pub fn idle(&self) -> bool {
        self.jobs.is_empty() && self.asked.is_empty() && self.serves.is_empty()
    }

    fn streams(&mut self, ctx: cuda::Context) -> Result<&[cuda::Stream]> {
        if !self.streams.contains_key(&ctx.id()) {
            let mut v = Vec::with_capacity(FALLBACK_STREAMS);
            for _ in 0..FALLBACK_STREAMS {
                v.push(cuda::Stream::new(&ctx)?);
            }
            self.streams.insert(ctx.id(), v);
        }
        Ok(&self.streams[&ctx.id()])
    }
}

/// Merges copies whose source and destination both continue where the previous ended (KV
/// blocks laid out back to back on both sides).
fn coalesce(copies: &mut Vec<(u64, u64, usize)>) {
    let mut out: Vec<(u64, u64, usize)> = Vec::with_capacity(copies.len());
    for &(d, s, n) in copies.iter() {
        if let Some(last) = out.last_mut() {
            if last.0 + last.2 as u64 == d && last.1 + last.2 as u64 == s {
                last.2 += n;
                continue;
            }
        }
        out.push((d, s, n));
    }
    *copies = out;
}

impl Driver {
    /// Starts the run of direct segments of `req` from `st.next` that share one context:
    /// host copies finish here; device copies are queued and tracked as one job.
    pub(super) fn start_direct(&mut self, req: &Arc<Request>, st: &mut ReqState, ctx: Option<cuda::Context>) -> Result<()> {
        let first = st.next;
        let mut end = first;
        while let Some(s) = req.segs.get(end) {
            match s.kind {
                SegKind::Direct { ctx: c, .. } if c == ctx => end += 1,
                _ => break,
            }
        }
        let write = req.op == Op::Write;
        let (mut dev, mut copies) = (Vec::new(), Vec::with_capacity(end - first));
        for s in &req.segs[first..end] {
            let c = if write { (s.raddr, s.local, s.len as usize) } else { (s.local, s.raddr, s.len as usize) };
            match s.kind {
                SegKind::Direct { dev: true, .. } => dev.push(c),
                _ => copies.push(c),
            }
        }
        let bytes: u64 = dev.iter().chain(&copies).map(|c| c.2 as u64).sum();
        st.next = end;
        let Some(ctx) = ctx else {
            // Host memory at both ends: a large run goes over the copy threads as well.
            if bytes >= super::cma_copy::POOL_MIN_BYTES && self.core.cfg.cma_copy {
                let ranges = req.segs[first..end].iter().map(|s| (s.local, s.raddr, s.len as usize)).collect();
                return self.spread_copies(req, st, super::cma_copy::THIS_PROCESS, ranges);
            }
            for (d, s, n) in copies.into_iter().chain(dev) {
                // SAFETY: both ranges lie in live registrations of engines of this process
                // (bounds-checked at preparation, the peer's checked to exist at post);
                // `copy` tolerates overlap.
                unsafe { std::ptr::copy(s as *const u8, d as *mut u8, n) };
            }
            let c = &self.core.counters;
            super::counters::add(if write { &c.bytes_written } else { &c.bytes_read }, bytes);
            super::counters::add(&c.ops_completed, 1);
            return Ok(());
        };
        self.apply_ctx(&ctx)?;
        let events = self.queue_copies(ctx, dev, copies)?;
        st.outstanding += 1;
        st.inflight_total += 1;
        super::counters::add(&self.core.counters.ops_posted, 1);
        self.direct.jobs.push(DirectJob { req: req.clone(), epoch: st.epoch, bytes, ctx, events });
        Ok(())
    }

    /// Queues copies (dst, src, len) on `ctx`'s streams (the context is current): `dev`
    /// (device memory at both ends) as gather-kernel launches where there are several
    /// ranges of at most KERNEL_MAX_RANGE; the rest in one batch call where the driver has
    /// it, else one copy per coalesced range spread over the streams. Returns the events
    /// that complete after them.
    fn queue_copies(&mut self, ctx: cuda::Context, mut dev: Vec<(u64, u64, usize)>, mut copies: Vec<(u64, u64, usize)>)
        -> Result<Vec<cuda::Event>> {
        coalesce(&mut dev);
        let mut events = Vec::with_capacity(FALLBACK_STREAMS * 2);
        if dev.len() > 1 && self.core.cfg.gpu_copy_kernel {
            let (small, large): (Vec<_>, Vec<_>) = dev.into_iter().partition(|c| c.2 <= KERNEL_MAX_RANGE);
            copies.extend(large);
            match self.launch_gather(ctx, &small)? {
                Some(evs) => events.extend(evs),
                None => copies.extend(small),
            }
        } else {
            copies.extend(dev);
        }
        coalesce(&mut copies);
        if copies.is_empty() {
            return Ok(events);
        }
        let mut copy_events = Vec::with_capacity(FALLBACK_STREAMS);
        let batch = copies.len() > 1 && !self.direct.batch_off && cuda::Driver::get().is_ok_and(|d| d.has_batch_copy());
        if batch {
            let mut dsts: Vec<u64> = copies.iter().map(|c| c.0).collect();
            let mut srcs: Vec<u64> = copies.iter().map(|c| c.1).collect();
            let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
            let stream = &self.direct.streams(ctx)?[0];
            // SAFETY: every range lies in a live registration of ours or in a peer's
            // allocation mapped here, held by the request until the job's event completes.
            match unsafe { stream.copy_batch(&mut dsts, &mut srcs, &mut sizes) } {
                Ok(()) => {
                    copy_events.push(stream.record()?);
                    super::counters::add(&self.core.counters.gpu_batch_calls, 1);
                }
                Err(e) if cuda::batch_unsupported(&e) => {
                    log::info!("{}: the CUDA driver cannot batch copies ({e}); one copy per descriptor from now on", self.core.name);
                    self.direct.batch_off = true;
                }
                Err(e) => return Err(e.into()),
            }
        }
        if copy_events.is_empty() {
            if !self.direct.logged {
                self.direct.logged = true;
                log::info!("{}: direct GPU copies: {}", self.core.name, if batch || !self.direct.batch_off && cuda::Driver::get().is_ok_and(|d| d.has_batch_copy()) {
                    "cuMemcpyBatchAsync for many descriptors"
                } else {
                    "one cuMemcpyAsync per (coalesced) descriptor over 4 streams"
                });
            }
            let streams = self.direct.streams(ctx)?;
            let used = copies.len().min(streams.len());
            for (i, (d, s, n)) in copies.iter().enumerate() {
                // SAFETY: as for the batch above.
                unsafe { streams[i % used].copy_async(*d, *s, *n)? };
            }
            for s in &streams[..used] {
                copy_events.push(s.record()?);
            }
            super::counters::add(&self.core.counters.gpu_copy_calls, copies.len() as u64);
        }
        events.extend(copy_events);
        Ok(events)
    }

    /// Launches the gather kernel of `ctx` for `copies` over the streams (one launch per
    /// up to 1364 ranges, round robin). None where the kernel cannot run here (not
    /// loadable, or a launch refused): the caller copies them another way.
    fn launch_gather(&mut self, ctx: cuda::Context, copies: &[(u64, u64, usize)]) -> Result<Option<Vec<cuda::Event>>> {
        if copies.is_empty() {
            return Ok(Some(Vec::new()));
        }
        if !self.direct.kernels.contains_key(&ctx.id()) {
            let k = match cuda::CopyKernel::load(&ctx) {
                Ok(k) => {
                    log::info!("{}: direct GPU copies of many device ranges: one gather-kernel launch per {} ranges",
                               self.core.name, k.ranges_per_launch());
                    Some(k)
                }
                Err(e) => {
                    log::info!("{}: the gather-copy kernel cannot run here ({e}); device ranges go to the copy engines", self.core.name);
                    None
                }
            };
            self.direct.kernels.insert(ctx.id(), k);
        }
        let per = match self.direct.kernels.get(&ctx.id()) {
            Some(Some(k)) => k.ranges_per_launch(),
            _ => return Ok(None),
        };
        // Enough groups to use every stream, each within one launch's parameter block.
        let groups = copies.len().div_ceil(per).max(copies.len().div_ceil(KERNEL_MIN_GROUP).min(FALLBACK_STREAMS));
        let chunk = copies.len().div_ceil(groups);
        self.direct.streams(ctx)?;
        let (Some(Some(k)), Some(streams)) = (self.direct.kernels.get(&ctx.id()), self.direct.streams.get(&ctx.id())) else {
            return Ok(None);
        };
        let mut used = 0;
        let mut launches = 0;
        for (i, group) in copies.chunks(chunk).enumerate() {
            // SAFETY: both ends of every range are device memory of a live registration or
            // a peer's allocation mapped here, held by the request until its events complete.
            match unsafe { k.launch(&streams[i % streams.len()], group) } {
                Ok(n) => launches += n,
                Err(e) => {
                    log::info!("{}: the gather-copy kernel failed to launch ({e}); device ranges go to the copy engines", self.core.name);
                    // Launches already queued must not outlive the request: wait for them
                    // (rare: the first launch on a context is where a driver refuses).
                    for s in &streams[..used] {
                        s.synchronize()?;
                    }
                    self.direct.kernels.insert(ctx.id(), None);
                    return Ok(None);
                }
            }
            used = used.max(i % streams.len() + 1);
        }
        let mut events = Vec::with_capacity(used);
        for s in &streams[..used] {
            events.push(s.record()?);
        }
        super::counters::add(&self.core.counters.gpu_kernel_launches, launches as u64);
        Ok(Some(events))
    }

    /// Polls the device copies in flight; finishes the requests whose copies are all done.
    /// Returns whether any were in flight.
    pub(super) fn advance_direct(&mut self) -> bool {
        if self.direct.jobs.is_empty() {
            return false;
        }
        let jobs = std::mem::take(&mut self.direct.jobs);
        let mut keep = Vec::with_capacity(jobs.len());
        for job in jobs {
            let res = self.apply_ctx(&job.ctx).and_then(|_| {
                let mut done = true;
                for ev in &job.events {
                    done &= ev.query()?;
                }
                Ok(done)
            });
            match res {
                Ok(false) => keep.push(job),
                Ok(true) => self.finish_direct(job, Ok(())),
                Err(e) => self.finish_direct(job, Err(e)),
            }
        }
        self.direct.jobs.extend(keep);
        true
    }

    fn finish_direct(&mut self, job: DirectJob, res: Result<()>) {
        self.finish_copy(job.req, job.epoch, job.bytes, res);
    }

    /// One direct job or answered copy request of post `epoch` of `req` ended.
    fn finish_copy(&mut self, req: Arc<Request>, epoch: u64, bytes: u64, res: Result<()>) {
        let mut st = req.state();
        st.inflight_total = st.inflight_total.saturating_sub(1);
        if st.epoch != epoch || st.phase != Phase::Data {
            return;
        }
        // The copy into a peer's memory succeeds even when the peer died meanwhile: only
        // its liveness tells that nobody will see the bytes.
        let res = res.and_then(|_| match req.peer() {
            Some(p) if !p.local.alive() => Err(Error::Disconnected(format!("agent '{}' exited", p.name))),
            _ => Ok(()),
        });
        if res.is_ok() {
            super::counters::add(&self.core.counters.gpu_direct_bytes, bytes);
        }
        self.piece_done(&req, &mut st, bytes, res);
    }

    /// Waits for the device copies toward `peer_id` (engine `engine_id`) to end (they finish
    /// on their own; the GPU does not wait for the peer), so its mappings can be closed under
    /// no running copy, and forgets the copy requests it will never answer.
    pub(super) fn drain_direct(&mut self, peer_id: u64, engine_id: u64) {
        for job in &self.direct.jobs {
            if job.req.peer().is_some_and(|p| p.id == peer_id) {
                for ev in &job.events {
                    if let Err(e) = ev.synchronize() {
                        log::warn!("{}: waiting for a copy to a disconnected peer: {e}", self.core.name);
                    }
                }
            }
        }
        self.core.ipc.close_peer(engine_id);
        for token in self.direct.asked.tokens() {
            if self.direct.asked.get_mut(token).is_some_and(|a| a.peer_id == peer_id) {
                if let Some(a) = self.direct.asked.remove(token) {
                    self.finish_copy(a.req, a.epoch, 0, Err(Error::Disconnected("peer was disconnected".into())));
                }
            }
        }
    }

    // ---- copies the peer makes: our GPU memory with its host memory ----

    /// Sends copy requests for the run of PeerCopy segments of `req` from `st.next` that
    /// name allocation `alloc`, as many as the control buffers need.
    pub(super) fn start_peer_copy(&mut self, req: &Arc<Request>, st: &mut ReqState, alloc: u64) -> Result<()> {
        let peer = req.peer().cloned().ok_or_else(|| Error::Backend("copy request without a peer".into()))?;
        let ipc = req.keeps.iter().find_map(|k| match k {
            Keep::Export(i) if i.alloc_base == alloc => Some(i.clone()),
            _ => None,
        }).ok_or_else(|| Error::Backend("copy request for an allocation the request does not export".into()))?;
        let per_msg = self.ctrl_payload_room().saturating_sub(64 + ipc.encoded_len()) / 24;
        let per_msg = per_msg.clamp(1, wire::COPY_MAX_RANGES);
        let first = st.next;
        let mut end = first;
        while let Some(s) = req.segs.get(end) {
            match s.kind {
                SegKind::PeerCopy { alloc: a } if a == alloc => end += 1,
                _ => break,
            }
        }
        st.next = end;
        let to_receiver = req.op == Op::Write;
        for chunk in req.segs[first..end].chunks(per_msg) {
            let bytes = chunk.iter().map(|s| s.len).sum();
            let token = self.direct.asked.insert(Asked { req: req.clone(), epoch: st.epoch, bytes, peer_id: peer.id });
            let msg = CopyReq { token, to_receiver, ipc: ipc.clone(), ranges: chunk.iter().map(|s| (s.local, s.raddr, s.len)).collect() };
            if let Err(e) = self.send_ctrl(&peer, CtrlType::Copy, &msg.encode(), None) {
                self.direct.asked.remove(token);
                return Err(e);
            }
            st.outstanding += 1;
            st.inflight_total += 1;
            super::counters::add(&self.core.counters.ops_posted, 1);
        }
        Ok(())
    }

    /// The peer's answer to one of our copy requests.
    pub(super) fn on_copy_ack(&mut self, sender_id: u64, sender: &str, a: StageAck) {
        let Some(asked) = self.direct.asked.remove(a.token) else { return };
        let status = Status::from_code(a.status);
        let res = if status == Status::NF_SUCCESS {
            Ok(())
        } else {
            if status == Status::NF_ERR_NOT_SUPPORTED {
                log::info!("{}: agent '{sender}' cannot open our GPU memory by IPC; copies with its host memory are staged from now on", self.core.name);
                self.core.ipc.refuse(sender_id);
            }
            Err(Error::Backend(format!("agent '{sender}' could not copy: {}", status.name())))
        };
        self.finish_copy(asked.req, asked.epoch, asked.bytes, res);
    }

    /// A peer asks us to copy between our host memory and its GPU allocation.
    pub(super) fn on_copy_request(&mut self, sender_id: u64, sender: &str, c: CopyReq) {
        let status = match self.serve_copy(sender_id, sender, &c) {
            Ok(()) => return,
            Err(e) => {
                log::error!("{}: copy request from agent '{sender}': {e}", self.core.name);
                match e {
                    Error::NotSupported(_) => Status::NF_ERR_NOT_SUPPORTED,
                    e => e.status(),
                }
            }
        };
        self.answer_copy(sender_id, c.token, status);
    }

    fn serve_copy(&mut self, sender_id: u64, sender: &str, c: &CopyReq) -> Result<()> {
        if !self.core.ipc_enabled() {
            return Err(Error::NotSupported("GPU IPC is off here".into()));
        }
        // Every host range must lie in one of our DRAM registrations: the request is untrusted.
        let mut copies = Vec::with_capacity(c.ranges.len());
        let mut mems: Vec<Arc<LocalMem>> = Vec::new();
        for &(_, h, n) in &c.ranges {
            let m = self.core.view.find(h, n, super::registry::MemKind::Dram)
                .ok_or_else(|| Error::InvalidParam(format!("[{h:#x}, +{n}) is not registered host memory of ours")))?;
            if !mems.iter().any(|x| Arc::ptr_eq(x, &m)) {
                mems.push(m);
            }
        }
        let entry = self.core.ipc_open(sender_id, sender, &c.ipc, None)
            .ok_or_else(|| Error::NotSupported("its GPU memory cannot be opened here".into()))?;
        if self.core.cfg.pin_host_memory {
            for m in &mems {
                m.pin_for_gpu(&entry.ctx);
            }
        }
        for &(s, h, n) in &c.ranges {
            let mapped = entry.base + (s - entry.remote_base);
            copies.push(if c.to_receiver { (h, mapped, n as usize) } else { (mapped, h, n as usize) });
        }
        let ctx = entry.ctx;
        let held = self.direct.served.entry(sender_id).or_default();
        if !held.iter().any(|e| Arc::ptr_eq(e, &entry)) {
            held.push(entry);
        }
        self.apply_ctx(&ctx)?;
        let events = self.queue_copies(ctx, Vec::new(), copies)?;
        self.direct.serves.push(Serve { from: sender_id, token: c.token, ctx, events });
        Ok(())
    }

    fn answer_copy(&mut self, to: u64, token: u64, status: Status) {
        let Some(dest) = self.initiator_addr(to) else {
            log::warn!("{}: cannot answer a copy request: its sender is unknown", self.core.name);
            return;
        };
        let ack = StageAck { token, status: status.code() };
        let bytes = wire::encode_ctrl(CtrlType::CopyAck, self.core.engine_id, &self.core.name, &ack.encode());
        self.ctrl_out.push_back(super::driver::CtrlOut { peer_id: 0, dest, bytes, req: None });
    }

    /// Polls the copies we serve; answers the finished ones.
    pub(super) fn advance_serves_direct(&mut self) -> bool {
        if self.direct.serves.is_empty() {
            return false;
        }
        let serves = std::mem::take(&mut self.direct.serves);
        let mut keep = Vec::with_capacity(serves.len());
        for s in serves {
            let res = self.apply_ctx(&s.ctx).and_then(|_| {
                let mut done = true;
                for ev in &s.events {
                    done &= ev.query()?;
                }
                Ok(done)
            });
            match res {
                Ok(false) => keep.push(s),
                Ok(true) => self.answer_copy(s.from, s.token, Status::NF_SUCCESS),
                Err(e) => {
                    log::error!("{}: serving a copy request: {e}", self.core.name);
                    self.answer_copy(s.from, s.token, e.status());
                }
            }
        }
        self.direct.serves.extend(keep);
        true
    }

    /// Closes what we opened for initiators that have exited (after their copies ended).
    pub(super) fn forget_exited_initiators(&mut self) {
        let gone: Vec<u64> = self.direct.served.keys().copied().filter(|&id| !self.initiator_alive(id)).collect();
        for id in gone {
            for s in self.direct.serves.iter().filter(|s| s.from == id) {
                for ev in &s.events {
                    let _ = ev.synchronize();
                }
            }
            self.direct.serves.retain(|s| s.from != id);
            self.direct.served.remove(&id);
            self.core.ipc.close_peer(id);
            log::info!("{}: an initiator that had its GPU memory opened here exited; closed its mappings", self.core.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::coalesce;

    #[test]
    fn coalescing_merges_only_runs_adjacent_on_both_sides() {
        let mut v = vec![(100, 1000, 10), (110, 1010, 5), (120, 1015, 5), (125, 1020, 1)];
        coalesce(&mut v);
        assert_eq!(v, vec![(100, 1000, 15), (120, 1015, 6)]);
        let mut one = vec![(0, 0, 4)];
        coalesce(&mut one);
        assert_eq!(one, vec![(0, 0, 4)]);
    }
}
