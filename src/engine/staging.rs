//! GPU memory without FI_HMEM: pipelined chunks through pinned, registered bounce slots.
//! The side that owns device memory does the device copy, on its progress loop, under the
//! context captured at registration (DESIGN rule 4). Remote device memory takes part
//! through control messages: the requester asks the owner to PULL (RMA-read from the
//! requester, then copy in) or PUSH (copy out, then RMA-write to the requester), and the
//! chunk is done when the owner answers.
use super::driver::{CtrlOut, Driver};
use super::ops::OpKind;
use super::registry::LocalMem;
use super::request::{Op, Phase, Request, SegKind};
use super::wire::{self, CtrlType, Stage, StageAck, StageDir};
use crate::cuda;
use crate::error::{Error, Result, Status};
use crate::fabric::{FiAddr, MemoryRegion, Posted, Rail};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

/// The bounce pool: one pinned allocation cut into `chunk`-sized slots, registered on
/// every rail. Requests we start may hold at most half the slots, so serving peers' stage
/// requests always has room and two engines staging into each other cannot deadlock.
pub struct Stager {
    // Field order is drop order: MRs close before the memory is freed.
    mrs: Vec<MemoryRegion>,
    buf: cuda::PinnedBuffer,
    pub chunk: usize,
    free: Vec<u32>,
    own_cap: usize,
    own_held: usize,
    streams: HashMap<usize, cuda::Stream>,
}

impl Stager {
    pub fn new(owner: &str, ctx: &cuda::Context, rails: &[Arc<Rail>], size: usize, chunk: usize, next_key: &mut u64) -> Result<Stager> {
        let chunk = chunk.clamp(4096, size.max(4096));
        let n = (size / chunk).max(2);
        let buf = cuda::PinnedBuffer::new(ctx, n * chunk)?;
        let mut mrs = Vec::with_capacity(rails.len());
        for r in rails {
            *next_key += 1;
            // SAFETY: the pinned pool is owned by the Stager, which drops its MRs with it.
            mrs.push(unsafe { r.register(buf.ptr(), buf.len(), *next_key, None) }?);
        }
        log::info!("{owner}: staging pool: {n} slots of {chunk} bytes ({} MiB pinned)", (n * chunk) >> 20);
        Ok(Stager { mrs, buf, chunk, free: (0..n as u32).rev().collect(), own_cap: (n / 2).max(1), own_held: 0, streams: HashMap::new() })
    }

    pub fn slot_ptr(&self, i: u32) -> *mut u8 {
        // SAFETY: i < slot count, so the offset stays inside the allocation.
        unsafe { self.buf.ptr().add(i as usize * self.chunk) }
    }

    /// Slot `i` as a peer's RMA on rail `rail` must address it.
    fn rma_addr(&self, i: u32, virt: bool) -> u64 {
        if virt { self.slot_ptr(i) as u64 } else { i as u64 * self.chunk as u64 }
    }

    fn take(&mut self, own: bool) -> Option<u32> {
        if own && self.own_held >= self.own_cap {
            return None;
        }
        let s = self.free.pop()?;
        self.own_held += own as usize;
        Some(s)
    }

    fn give(&mut self, slot: u32, own: bool) {
        self.own_held -= own as usize;
        self.free.push(slot);
    }

    fn stream(&mut self, ctx: cuda::Context) -> Result<&cuda::Stream> {
        if !self.streams.contains_key(&ctx.id()) {
            self.streams.insert(ctx.id(), cuda::Stream::new(&ctx)?);
        }
        Ok(&self.streams[&ctx.id()])
    }
}

pub enum JobPhase {
    CopyOut(cuda::Event),
    Rma,
    WaitAck,
    CopyIn(cuda::Event),
}

/// One staged chunk of one of our requests.
pub struct Job {
    req: Arc<Request>,
    epoch: u64,
    seg: usize,
    slot: Option<u32>,
    phase: JobPhase,
    ctrl_dest: FiAddr,
    peer_id: u64,
}

pub enum ServePhase {
    Rma,
    CopyIn(cuda::Event),
    CopyOut(cuda::Event),
}

/// A peer's stage request we are serving.
pub struct Serve {
    stage: Stage,
    dest: FiAddr,
    ctx: cuda::Context,
    slot: u32,
    phase: ServePhase,
    _mem: Arc<LocalMem>,
}

/// Slab with generation-tagged tokens, so an answer for a finished chunk is ignored.
pub struct Slab<T> {
    items: Vec<Option<T>>,
    gens: Vec<u32>,
    free: Vec<u32>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { items: Vec::new(), gens: Vec::new(), free: Vec::new() }
    }
}

impl<T> Slab<T> {
    pub fn insert(&mut self, v: T) -> u64 {
        let i = match self.free.pop() {
            Some(i) => i as usize,
            None => {
                self.items.push(None);
                self.gens.push(0);
                self.items.len() - 1
            }
        };
        self.items[i] = Some(v);
        (self.gens[i] as u64) << 32 | i as u64
    }
    pub fn get_mut(&mut self, token: u64) -> Option<&mut T> {
        let i = (token & 0xffff_ffff) as usize;
        if *self.gens.get(i)? != (token >> 32) as u32 {
            return None;
        }
        self.items[i].as_mut()
    }
    pub fn remove(&mut self, token: u64) -> Option<T> {
        self.get_mut(token)?;
        let i = (token & 0xffff_ffff) as usize;
        self.gens[i] = self.gens[i].wrapping_add(1);
        self.free.push(i as u32);
        self.items[i].take()
    }
    pub fn is_empty(&self) -> bool {
        self.free.len() == self.items.len()
    }
    pub fn tokens(&self) -> Vec<u64> {
        self.items.iter().enumerate().filter(|(_, v)| v.is_some()).map(|(i, _)| (self.gens[i] as u64) << 32 | i as u64).collect()
    }
}

/// Everything staging keeps in the driver.
#[derive(Default)]
pub struct Staging {
    pub pool: Option<Stager>,
    pub jobs: Slab<Job>,
    pub serves: Slab<Serve>,
    /// Stage requests waiting for a free slot: (sender engine id, request).
    pub waiting: VecDeque<(u64, Stage)>,
}

/// Makes `ctx` current unless the debug switch says to reproduce the seed bug.
fn apply(skip: bool, ctx: &cuda::Context) -> Result<()> {
    if !skip {
        ctx.make_current()?;
    }
    Ok(())
}

impl Staging {
    /// Nothing staged is in flight or waiting (the common case: a cheap check per pass).
    pub fn idle(&self) -> bool {
        self.jobs.is_empty() && self.serves.is_empty() && self.waiting.is_empty()
    }
}

pub enum Start {
    Started,
    Blocked,
}

impl Driver {
    pub(super) fn apply_ctx(&self, ctx: &cuda::Context) -> Result<()> {
        apply(self.core.skip_ctx_apply, ctx)
    }

    /// Creates the bounce pool on first use, under the context of the memory that needs it.
    pub fn ensure_pool(&mut self, ctx: &cuda::Context) -> Result<()> {
        if self.staging.pool.is_none() {
            let cfg = &self.core.cfg;
            let (size, chunk) = (cfg.staging_buffer_size as usize, cfg.staging_chunk_size as usize);
            self.staging.pool = Some(Stager::new(&self.core.name, ctx, &self.rails, size, chunk, &mut self.next_key)?);
        }
        Ok(())
    }

    /// Starts staged segment `idx` of `req` (post number `epoch`).
    pub fn start_staged(&mut self, req: &Arc<Request>, epoch: u64, idx: usize, dest: FiAddr, ctrl_dest: FiAddr) -> Result<Start> {
        let s = req.segs[idx];
        let peer_id = req.peer().map_or(0, |p| p.id);
        let needs_slot = matches!(s.kind, SegKind::DevToHost { .. } | SegKind::DevToDev { .. });
        let slot = if needs_slot {
            let ctx = match s.kind {
                SegKind::DevToHost { ctx } | SegKind::DevToDev { ctx } => ctx,
                _ => unreachable!("checked above"),
            };
            self.ensure_pool(&ctx)?;
            match self.staging.pool.as_mut().and_then(|p| p.take(true)) {
                Some(slot) => Some(slot),
                None => return Ok(Start::Blocked),
            }
        } else {
            None
        };
        let job = Job { req: req.clone(), epoch, seg: idx, slot, phase: JobPhase::WaitAck, ctrl_dest, peer_id };
        let token = self.staging.jobs.insert(job);
        let res = self.first_step(token, dest);
        if let Err(e) = res {
            self.finish_job(token, Err(e));
        }
        Ok(Start::Started)
    }

    fn first_step(&mut self, token: u64, dest: FiAddr) -> Result<()> {
        let (req, idx, slot) = {
            let j = self.staging.jobs.get_mut(token).ok_or_else(|| Error::Backend("job vanished".into()))?;
            (j.req.clone(), j.seg, j.slot)
        };
        let s = req.segs[idx];
        match (s.kind, req.op, slot) {
            (SegKind::DevToHost { ctx }, Op::Write, Some(slot)) | (SegKind::DevToDev { ctx }, Op::Write, Some(slot)) => {
                let ev = self.copy_async(ctx, slot, s.local, s.len as usize, true)?;
                self.set_phase(token, JobPhase::CopyOut(ev));
            }
            (SegKind::DevToHost { .. }, Op::Read, Some(slot)) => {
                self.post_slot_rma(token, slot, false, s.rail as usize, dest, s.raddr, s.rkey, s.len as usize)?;
                self.set_phase(token, JobPhase::Rma);
            }
            (SegKind::DevToDev { .. }, Op::Read, Some(slot)) => {
                let pool = self.staging.pool.as_ref().ok_or_else(|| Error::Backend("no staging pool".into()))?;
                let st = Stage { token, dir: StageDir::Push, dev_addr: s.raddr, len: s.len, peer_addr: pool.rma_addr(slot, self.rails[0].caps.virt_addr), peer_key: pool.mrs[0].key };
                self.send_stage(token, st);
            }
            (SegKind::HostToDev { self_addr, self_key }, op, None) => {
                let dir = if op == Op::Write { StageDir::Pull } else { StageDir::Push };
                let st = Stage { token, dir, dev_addr: s.raddr, len: s.len, peer_addr: self_addr, peer_key: self_key };
                self.send_stage(token, st);
            }
            _ => return Err(Error::Backend(format!("segment {idx} cannot be staged as {:?}", s.kind))),
        }
        Ok(())
    }

    fn set_phase(&mut self, token: u64, phase: JobPhase) {
        if let Some(j) = self.staging.jobs.get_mut(token) {
            j.phase = phase;
        }
    }

    fn send_stage(&mut self, token: u64, st: Stage) {
        let Some(j) = self.staging.jobs.get_mut(token) else { return };
        j.phase = JobPhase::WaitAck;
        let (dest, peer_id) = (j.ctrl_dest, j.peer_id);
        let bytes = wire::encode_ctrl(CtrlType::Stage, self.core.engine_id, &self.core.name, &st.encode());
        self.ctrl_out.push_back(CtrlOut { peer_id, dest, bytes, req: None });
    }

    /// Queues a device copy between `dev` and bounce slot `slot` on the context's stream;
    /// `out` = device to host.
    fn copy_async(&mut self, ctx: cuda::Context, slot: u32, dev: u64, len: usize, out: bool) -> Result<cuda::Event> {
        self.apply_ctx(&ctx)?;
        let pool = self.staging.pool.as_mut().ok_or_else(|| Error::Backend("no staging pool".into()))?;
        let host = pool.slot_ptr(slot);
        let stream = pool.stream(ctx)?;
        // SAFETY: the slot is held by this chunk until its event completes; `dev` was
        // bounds-checked against a live device registration that the request or serve
        // entry keeps alive.
        unsafe {
            if out {
                stream.copy_dtoh_async(host, dev, len)?;
            } else {
                stream.copy_htod_async(dev, host, len)?;
            }
        }
        Ok(stream.record()?)
    }

    #[allow(clippy::too_many_arguments)]
    fn post_slot_rma(&mut self, token: u64, slot: u32, write: bool, rail: usize, dest: FiAddr, raddr: u64, rkey: u64, len: usize) -> Result<()> {
        let pool = self.staging.pool.as_ref().ok_or_else(|| Error::Backend("no staging pool".into()))?;
        let (ptr, desc) = (pool.slot_ptr(slot), pool.mrs[rail].desc);
        let deadline = Instant::now() + self.core.cfg.timeout();
        loop {
            let ctx = self.ops.alloc(OpKind::StageRma { token, serve: false });
            // SAFETY: a registered bounce slot held by this chunk until its op completes; ctx is
            // a fresh op slot.
            let r = if write { unsafe { self.rails[rail].write(ptr, len, desc, dest, raddr, rkey, ctx, false, true) } } else { unsafe { self.rails[rail].read(ptr, len, desc, dest, raddr, rkey, ctx, false) } };
            match r {
                Ok(Posted::Ok) => return Ok(()),
                Ok(Posted::Again) => {
                    self.ops.release(ctx);
                    if Instant::now() > deadline {
                        return Err(Error::Timeout("staging RMA: queue stayed full".into()));
                    }
                    self.poll_rail(rail);
                }
                Err(e) => {
                    self.ops.release(ctx);
                    return Err(e);
                }
            }
        }
    }

    /// A chunk ended: free its slot, account it to its request, finish the request's data
    /// phase when it was the last.
    fn finish_job(&mut self, token: u64, res: Result<()>) {
        let Some(job) = self.staging.jobs.remove(token) else { return };
        if let (Some(slot), Some(pool)) = (job.slot, self.staging.pool.as_mut()) {
            pool.give(slot, true);
        }
        let req = job.req;
        let mut st = req.state();
        st.inflight_total = st.inflight_total.saturating_sub(1);
        if job.epoch != st.epoch || st.phase != Phase::Data {
            return;
        }
        st.last_progress = Instant::now();
        let len = req.segs[job.seg].len;
        self.piece_done(&req, &mut st, len, res);
    }

    /// Completion of a staging RMA (ours or a serve).
    pub fn on_stage_rma(&mut self, token: u64, serve: bool, err: Option<Error>) {
        if serve {
            return self.on_serve_rma(token, err);
        }
        if let Some(e) = err {
            return self.finish_job(token, Err(e));
        }
        let Some(j) = self.staging.jobs.get_mut(token) else { return };
        let (req, idx, slot) = (j.req.clone(), j.seg, j.slot);
        let s = req.segs[idx];
        match (req.op, s.kind, slot) {
            (Op::Write, _, _) => self.finish_job(token, Ok(())),
            (Op::Read, SegKind::DevToHost { ctx }, Some(slot)) => match self.copy_async(ctx, slot, s.local, s.len as usize, false) {
                Ok(ev) => self.set_phase(token, JobPhase::CopyIn(ev)),
                Err(e) => self.finish_job(token, Err(e)),
            },
            _ => self.finish_job(token, Err(Error::Backend("unexpected staging RMA completion".into()))),
        }
    }

    /// The owner answered one of our stage requests.
    pub fn on_stage_ack(&mut self, ack: StageAck) {
        let Some(j) = self.staging.jobs.get_mut(ack.token) else {
            log::debug!("{}: stale stage answer {:#x}", self.core.name, ack.token);
            return;
        };
        if !matches!(j.phase, JobPhase::WaitAck) {
            return;
        }
        if ack.status != 0 {
            let e = Error::Backend(format!("peer failed a staged chunk: {}", Status::from_code(ack.status).name()));
            return self.finish_job(ack.token, Err(e));
        }
        let (req, idx, slot) = (j.req.clone(), j.seg, j.slot);
        let s = req.segs[idx];
        match (req.op, s.kind, slot) {
            (Op::Read, SegKind::DevToDev { ctx }, Some(slot)) => match self.copy_async(ctx, slot, s.local, s.len as usize, false) {
                Ok(ev) => self.set_phase(ack.token, JobPhase::CopyIn(ev)),
                Err(e) => self.finish_job(ack.token, Err(e)),
            },
            _ => self.finish_job(ack.token, Ok(())),
        }
    }

    /// Polls the device copies of our chunks and of the serves, and starts waiting serves.
    pub fn advance_staging(&mut self) -> bool {
        if self.staging.idle() {
            return false;
        }
        let mut work = false;
        let skip = self.core.skip_ctx_apply;
        for token in self.staging.jobs.tokens() {
            let Some(j) = self.staging.jobs.get_mut(token) else { continue };
            let ev = match &j.phase {
                JobPhase::CopyOut(ev) | JobPhase::CopyIn(ev) => ev,
                _ => continue,
            };
            work = true;
            let ready = match apply(skip, &ev.context()).and_then(|_| ev.query().map_err(Error::from)) {
                Ok(r) => r,
                Err(e) => {
                    self.finish_job(token, Err(e));
                    continue;
                }
            };
            if !ready {
                continue;
            }
            let (req, idx, slot, copy_out, peer_id) = {
                let j = self.staging.jobs.get_mut(token).expect("present");
                (j.req.clone(), j.seg, j.slot, matches!(j.phase, JobPhase::CopyOut(_)), j.peer_id)
            };
            if !copy_out {
                self.finish_job(token, Ok(()));
                continue;
            }
            let s = req.segs[idx];
            let Some(slot) = slot else { continue };
            let res = match s.kind {
                SegKind::DevToHost { .. } => {
                    let dest = self.conn_addr(peer_id, s.rail as usize, s.rrail as usize);
                    dest.and_then(|d| self.post_slot_rma(token, slot, true, s.rail as usize, d, s.raddr, s.rkey, s.len as usize))
                        .map(|_| self.set_phase(token, JobPhase::Rma))
                }
                SegKind::DevToDev { .. } => {
                    let pool = self.staging.pool.as_ref().expect("pool exists while a slot is held");
                    let st = Stage { token, dir: StageDir::Pull, dev_addr: s.raddr, len: s.len, peer_addr: pool.rma_addr(slot, self.rails[0].caps.virt_addr), peer_key: pool.mrs[0].key };
                    self.send_stage(token, st);
                    Ok(())
                }
                _ => Err(Error::Backend("copy-out for a segment without device memory".into())),
            };
            if let Err(e) = res {
                self.finish_job(token, Err(e));
            }
        }
        work |= self.advance_serves();
        work
    }

    // ---- the owner's side: serving peers' stage requests ----

    /// A peer asks us to move a chunk in or out of our device memory.
    pub fn on_stage_request(&mut self, sender_id: u64, st: Stage) {
        self.staging.waiting.push_back((sender_id, st));
        self.start_serves();
    }

    fn answer(&mut self, sender_id: u64, token: u64, status: Status) {
        let Some(dest) = self.initiator_addr(sender_id) else {
            log::warn!("{}: cannot answer a stage request of an engine that never introduced itself", self.core.name);
            return;
        };
        let ack = StageAck { token, status: status.code() };
        let bytes = wire::encode_ctrl(CtrlType::StageAck, self.core.engine_id, &self.core.name, &ack.encode());
        self.ctrl_out.push_back(CtrlOut { peer_id: 0, dest, bytes, req: None });
    }

    fn start_serves(&mut self) {
        while let Some(&(sender, st)) = self.staging.waiting.front() {
            let Some(mem) = self.core.gpu.find(st.dev_addr, st.len) else {
                self.staging.waiting.pop_front();
                log::error!("{}: refusing a stage request for [{:#x}, +{}): not inside a registered device region", self.core.name, st.dev_addr, st.len);
                self.answer(sender, st.token, Status::NF_ERR_INVALID_PARAM);
                continue;
            };
            let Some(dev) = mem.dev else { continue };
            let chunk = self.staging.pool.as_ref().map_or(0, |p| p.chunk);
            if st.len as usize > chunk && chunk > 0 {
                self.staging.waiting.pop_front();
                self.answer(sender, st.token, Status::NF_ERR_INVALID_PARAM);
                continue;
            }
            if let Err(e) = self.ensure_pool(&dev.ctx) {
                self.staging.waiting.pop_front();
                log::error!("{}: staging pool: {e}", self.core.name);
                self.answer(sender, st.token, e.status());
                continue;
            }
            let Some(slot) = self.staging.pool.as_mut().and_then(|p| p.take(false)) else { return };
            self.staging.waiting.pop_front();
            let Some(dest) = self.initiator_addr(sender) else {
                self.staging.pool.as_mut().expect("pool").give(slot, false);
                log::warn!("{}: stage request from an engine that never introduced itself", self.core.name);
                continue;
            };
            let serve = Serve { stage: st, dest, ctx: dev.ctx, slot, phase: ServePhase::Rma, _mem: mem };
            let id = self.staging.serves.insert(serve);
            let res = match st.dir {
                StageDir::Pull => self.post_serve_rma(id, false),
                StageDir::Push => self.copy_async(dev.ctx, slot, st.dev_addr, st.len as usize, true).map(|ev| {
                    if let Some(s) = self.staging.serves.get_mut(id) {
                        s.phase = ServePhase::CopyOut(ev);
                    }
                }),
            };
            if let Err(e) = res {
                self.end_serve(id, Err(e));
            }
        }
    }

    fn post_serve_rma(&mut self, id: u64, write: bool) -> Result<()> {
        let s = self.staging.serves.get_mut(id).ok_or_else(|| Error::Backend("serve vanished".into()))?;
        s.phase = ServePhase::Rma;
        let (slot, dest, st) = (s.slot, s.dest, s.stage);
        let pool = self.staging.pool.as_ref().ok_or_else(|| Error::Backend("no staging pool".into()))?;
        let (ptr, desc) = (pool.slot_ptr(slot), pool.mrs[0].desc);
        let ctx = self.ops.alloc(OpKind::StageRma { token: id, serve: true });
        let r = if write {
            // SAFETY: the serve's registered bounce slot, held until its op completes; ctx is a
            // fresh op slot.
            unsafe { self.rails[0].write(ptr, st.len as usize, desc, dest, st.peer_addr, st.peer_key, ctx, false, true) }
        } else {
            // SAFETY: as above.
            unsafe { self.rails[0].read(ptr, st.len as usize, desc, dest, st.peer_addr, st.peer_key, ctx, false) }
        };
        match r {
            Ok(Posted::Ok) => Ok(()),
            Ok(Posted::Again) => {
                self.ops.release(ctx);
                // Retried from advance_serves.
                if let Some(s) = self.staging.serves.get_mut(id) {
                    s.phase = ServePhase::CopyOut(cuda::Event::new(&s.ctx)?);
                }
                Ok(())
            }
            Err(e) => {
                self.ops.release(ctx);
                Err(e)
            }
        }
    }

    fn on_serve_rma(&mut self, id: u64, err: Option<Error>) {
        if let Some(e) = err {
            return self.end_serve(id, Err(e));
        }
        let Some(s) = self.staging.serves.get_mut(id) else { return };
        let (st, ctx, slot) = (s.stage, s.ctx, s.slot);
        match st.dir {
            StageDir::Push => self.end_serve(id, Ok(())),
            StageDir::Pull => match self.copy_async(ctx, slot, st.dev_addr, st.len as usize, false) {
                Ok(ev) => {
                    if let Some(s) = self.staging.serves.get_mut(id) {
                        s.phase = ServePhase::CopyIn(ev);
                    }
                }
                Err(e) => self.end_serve(id, Err(e)),
            },
        }
    }

    fn advance_serves(&mut self) -> bool {
        let mut work = !self.staging.waiting.is_empty();
        let skip = self.core.skip_ctx_apply;
        for id in self.staging.serves.tokens() {
            let Some(s) = self.staging.serves.get_mut(id) else { continue };
            work = true;
            let (ev, copy_in) = match &s.phase {
                ServePhase::CopyIn(ev) => (ev, true),
                ServePhase::CopyOut(ev) => (ev, false),
                ServePhase::Rma => continue,
            };
            let ready = match apply(skip, &s.ctx).and_then(|_| ev.query().map_err(Error::from)) {
                Ok(r) => r,
                Err(e) => {
                    self.end_serve(id, Err(e));
                    continue;
                }
            };
            if !ready {
                continue;
            }
            if copy_in {
                self.end_serve(id, Ok(()));
            } else if let Err(e) = self.post_serve_rma(id, true) {
                self.end_serve(id, Err(e));
            }
        }
        self.start_serves();
        work
    }

    fn end_serve(&mut self, id: u64, res: Result<()>) {
        let Some(s) = self.staging.serves.remove(id) else { return };
        if let Some(p) = self.staging.pool.as_mut() {
            p.give(s.slot, false);
        }
        let status = match res {
            Ok(()) => Status::NF_SUCCESS,
            Err(e) => {
                log::error!("{}: serving a staged chunk for a peer failed: {e}", self.core.name);
                e.status()
            }
        };
        let sender = self.initiator_id_by_addr(s.dest);
        if let Some(sender) = sender {
            self.answer(sender, s.stage.token, status);
        }
    }
}
