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
use super::wire::IpcDesc;
use crate::cuda;
use crate::error::{Error, Result};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};

/// Streams per context that single copies are spread over where the driver has no batch
/// copy: small copies of one descriptor each then overlap on the copy engines.
const FALLBACK_STREAMS: usize = 4;

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
    mapping: Mutex<Option<cuda::IpcMapping>>,
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

/// The engine's open IPC mappings, by (peer, remote allocation base, context), and the
/// allocations whose handle could not be opened (not tried again: they use staging).
#[derive(Default)]
pub struct IpcCache {
    open: Mutex<HashMap<(u64, u64, usize), Weak<IpcEntry>>>,
    failed: Mutex<HashSet<(u64, u64)>>,
}

impl IpcCache {
    /// Closes every mapping of `peer_id` now (the peer disconnected). The caller made sure no
    /// copy on them is still running.
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
    /// The IPC route is on: config gpu_ipc, and same_host_shm (the switch of every
    /// same-host path).
    pub fn ipc_enabled(&self) -> bool {
        self.cfg.gpu_ipc && self.cfg.same_host_shm
    }

    /// Opens (or finds open) peer `peer_id`'s allocation described by `ipc`, for copies
    /// with our memory `local` (VRAM: its context; DRAM: the primary context of the device
    /// holding the peer's allocation). None, with one INFO line per allocation, where the
    /// handle cannot be opened: the caller then stages.
    pub fn ipc_open(self: &Arc<Self>, peer_id: u64, peer_name: &str, ipc: &IpcDesc, local: &LocalMem) -> Option<Arc<IpcEntry>> {
        let key = (peer_id, ipc.alloc_base);
        if self.ipc.failed.lock().unwrap_or_else(|p| p.into_inner()).contains(&key) {
            return None;
        }
        let fail = |why: String| {
            log::info!("{}: GPU memory of agent '{peer_name}' at {:#x} cannot be opened by IPC ({why}); it is staged through host memory", self.name, ipc.alloc_base);
            self.ipc.failed.lock().unwrap_or_else(|p| p.into_inner()).insert(key);
            None
        };
        let (ctx, primary) = match local.dev {
            Some(d) => (d.ctx, None),
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
        if let Some(e) = open.get(&(peer_id, ipc.alloc_base, ctx.id())).and_then(Weak::upgrade) {
            if e.is_open() {
                return Some(e);
            }
        }
        let mapping = match cuda::IpcMapping::open(&ctx, &cuda::IpcHandle(ipc.handle)) {
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
        open.insert((peer_id, ipc.alloc_base, ctx.id()), Arc::downgrade(&e));
        Some(e)
    }
}

/// The direct route for one descriptor pair, if there is one: the segment (addresses both
/// in this process) and what the request must keep. `raddr`/`rlen` were checked against the
/// descriptor already.
pub fn plan(core: &Arc<Core>, peer: &super::peer::Peer, local: (u64, u64, &LocalMem), remote: (u64, &super::wire::MemDesc)) -> Option<(u64, SegKind, Keep)> {
    let (_la, ll, lm) = local;
    let (ra, desc) = remote;
    match &peer.local {
        Locality::SameProcess(view) if core.cfg.same_host_shm => {
            let kind = super::registry::MemKind::from_raw(desc.mem_type as u32).ok()?;
            let rm = view.upgrade()?.find(ra, ll, kind)?;
            let ctx = lm.dev.map(|d| d.ctx).or(rm.dev.map(|d| d.ctx));
            Some((ra, SegKind::Direct { ctx }, Keep::Local(Arc::downgrade(&rm))))
        }
        Locality::SameHost(_) if core.ipc_enabled() => {
            let ipc = desc.ipc.as_ref()?;
            let e = core.ipc_open(peer.id, &peer.name, ipc, lm)?;
            let mapped = e.base + (ra - e.remote_base);
            Some((mapped, SegKind::Direct { ctx: Some(e.ctx) }, Keep::Ipc(e)))
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
    batch_off: bool,
    logged: bool,
}

impl Direct {
    pub fn idle(&self) -> bool {
        self.jobs.is_empty()
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
                SegKind::Direct { ctx: c } if c == ctx => end += 1,
                _ => break,
            }
        }
        let write = req.op == Op::Write;
        let mut copies: Vec<(u64, u64, usize)> = req.segs[first..end]
            .iter()
            .map(|s| if write { (s.raddr, s.local, s.len as usize) } else { (s.local, s.raddr, s.len as usize) })
            .collect();
        let bytes: u64 = copies.iter().map(|c| c.2 as u64).sum();
        st.next = end;
        let Some(ctx) = ctx else {
            for (d, s, n) in copies {
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
        coalesce(&mut copies);
        let batch = copies.len() > 1 && !self.direct.batch_off && cuda::Driver::get().is_ok_and(|d| d.has_batch_copy());
        let mut events = Vec::with_capacity(FALLBACK_STREAMS);
        if batch {
            let mut dsts: Vec<u64> = copies.iter().map(|c| c.0).collect();
            let mut srcs: Vec<u64> = copies.iter().map(|c| c.1).collect();
            let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
            let stream = &self.direct.streams(ctx)?[0];
            // SAFETY: every range lies in a live registration of ours or in a peer's
            // allocation mapped here, held by the request until the job's event completes.
            match unsafe { stream.copy_batch(&mut dsts, &mut srcs, &mut sizes) } {
                Ok(()) => {
                    events.push(stream.record()?);
                    super::counters::add(&self.core.counters.gpu_batch_calls, 1);
                }
                Err(e) if cuda::batch_unsupported(&e) => {
                    log::info!("{}: the CUDA driver cannot batch copies ({e}); one copy per descriptor from now on", self.core.name);
                    self.direct.batch_off = true;
                }
                Err(e) => return Err(e.into()),
            }
        }
        if events.is_empty() {
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
                events.push(s.record()?);
            }
            super::counters::add(&self.core.counters.gpu_copy_calls, copies.len() as u64);
        }
        st.outstanding += 1;
        st.inflight_total += 1;
        super::counters::add(&self.core.counters.ops_posted, 1);
        self.direct.jobs.push(DirectJob { req: req.clone(), epoch: st.epoch, bytes, ctx, events });
        Ok(())
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
        let req = job.req;
        let mut st = req.state();
        st.inflight_total = st.inflight_total.saturating_sub(1);
        if st.epoch != job.epoch || st.phase != Phase::Data {
            return;
        }
        st.outstanding -= 1;
        // The copy into a peer's memory succeeds even when the peer died meanwhile: only
        // its liveness tells that nobody will see the bytes.
        let res = res.and_then(|_| match req.peer() {
            Some(p) if !p.local.alive() => Err(Error::Disconnected(format!("agent '{}' exited", p.name))),
            _ => Ok(()),
        });
        match res {
            Ok(()) => {
                let c = &self.core.counters;
                super::counters::add(if req.op == Op::Write { &c.bytes_written } else { &c.bytes_read }, job.bytes);
                super::counters::add(&c.gpu_direct_bytes, job.bytes);
                super::counters::add(&c.ops_completed, 1);
            }
            Err(e) => {
                super::counters::add(&self.core.counters.ops_failed, 1);
                st.error.get_or_insert(e);
                st.next = req.segs.len();
            }
        }
        if st.outstanding == 0 && st.next >= req.segs.len() {
            self.data_done(&req, &mut st);
        }
    }

    /// Waits for the device copies toward `peer_id` to end (they finish on their own; the GPU
    /// does not wait for the peer), so its mappings can be closed under no running copy.
    pub(super) fn drain_direct(&mut self, peer_id: u64) {
        for job in &self.direct.jobs {
            if job.req.peer().is_some_and(|p| p.id == peer_id) {
                for ev in &job.events {
                    if let Err(e) = ev.synchronize() {
                        log::warn!("{}: waiting for a copy to a disconnected peer: {e}", self.core.name);
                    }
                }
            }
        }
        self.core.ipc.close_peer(peer_id);
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
