//! The owner's side of staging: peers ask us (control message STAGE, one per packed
//! chunk) to move a chunk's ranges in or out of our device memory. PULL: RMA-read the
//! ranges from the requester into one bounce slot, back to back, then scatter the slot into
//! our memory with one launch. PUSH: gather the ranges into a slot with one launch, then
//! RMA-write them to the requester. LEND: gather them into a slot as for PUSH, then lend the
//! slot (answer StageLent naming it) until the requester, which RMA-reads it, releases it:
//! a READ's bytes then cross the rails by RMA read, as a READ of host memory does (the
//! requester asks it for chunks of several blocks: 12-17 % faster than PUSH for 4-16 KiB
//! blocks on the H100's tcp rails). Device memory registered with the provider (FI_HMEM)
//! needs no slot: a PULL or PUSH of it is our RMA straight between it and the requester's
//! memory, no device copy (see `direct`: asked where the provider's RMA from the requester's
//! host memory would bounce). The RMA goes over the rail pair the requester chose for
//! the chunk, so a request's chunks use every rail. Every step that the provider refuses
//! for now (FI_EAGAIN) is retried as the same step: a PULL's read stays a read. A serve
//! ends (and answers) only when none of its operations is with the provider any more.
use super::super::slab::Slab;
use super::copies::Queued;
use super::pool::{copied, ensure, post_local, rma_ops, Piece, Stager};
use super::timing::{Step, Times};
use super::super::Cx;
use crate::cuda;
use crate::engine::counters::add;
use crate::engine::ops::{OpKind, TOp};
use crate::engine::registry::LocalMem;
use crate::engine::wire::{CtrlType, Stage, StageDir, StageLent};
use crate::error::{Error, Result, Status};
use crate::fabric::{FiAddr, Posted, MAX_RMA_BATCH};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// TOp::tag of a serve's RMA.
pub const SERVE_RMA: u8 = 2;
/// A lent slot that its requester has not released after this many request timeouts is
/// taken back. Its release can be lost for good: a requester that disconnects from us drops
/// its route to us first, and across hosts we may never learn that it went. Far past any
/// request's timeout, so that no read of it can still be running.
const LEASE_TIMEOUTS: u32 = 4;

enum Phase {
    /// The RMA operations are being posted (`next_op`; FI_EAGAIN leaves it there) or are
    /// with the provider.
    Rma,
    CopyIn(Queued),
    CopyOut(Queued),
    /// LEND: the slot holds the chunk for the requester's RMA read; ends at its release.
    Lent,
}

/// A peer's stage request we are serving.
struct Serve {
    stage: Stage,
    /// The requester: its engine id (to answer); our rail and its address there.
    sender: u64,
    rail: usize,
    dest: FiAddr,
    ctx: cuda::Context,
    /// Our bounce slot; None for a direct serve, whose pieces name our device addresses
    /// where a slot's name offsets into the slot.
    slot: Option<u32>,
    phase: Phase,
    rma: Vec<Vec<Piece>>,
    next_op: usize,
    left: usize,
    failed: Option<Error>,
    /// The requester was disconnected: nothing more is posted for it and nobody is answered.
    gone: bool,
    /// The registrations of the device ranges, kept until the serve ends; a direct serve
    /// posts with their descriptors.
    mems: Vec<Arc<LocalMem>>,
    /// When the slot was taken, and when the current step began (timing.rs).
    born: Instant,
    stamp: Instant,
}

impl Serve {
    fn dev_ranges(&self) -> Vec<(u64, usize)> {
        self.stage.ranges.iter().map(|r| (r.0, r.2 as usize)).collect()
    }
}

#[derive(Default)]
pub struct Serves {
    items: Slab<Serve>,
    /// Stage requests waiting for a free slot: (sender engine id, request, arrival).
    pub(super) waiting: VecDeque<(u64, Stage, Instant)>,
    pub(super) times: Times,
    /// The INFO line of the first direct serve went out.
    told_direct: bool,
}

/// Whether the chunk moves by our RMA straight between its device ranges and the
/// requester's memory: a PULL or PUSH whose every registration the provider holds (FI_HMEM).
fn direct(st: &Stage, mems: &[Arc<LocalMem>]) -> bool {
    matches!(st.dir, StageDir::Pull | StageDir::Push) && mems.iter().all(|m| m.dev.is_some_and(|d| !d.staged))
}

/// A direct serve's RMA operations: (our device address, the requester's address, bytes),
/// a range merged into the one before where both sides continue it inside the same one of
/// `mems` (a piece is posted with one registration's descriptor), `batch` a operation.
fn direct_ops(ranges: &[(u64, u64, u64)], mems: &[Arc<LocalMem>], batch: usize) -> Vec<Vec<Piece>> {
    let reg = |a: u64| mems.iter().position(|m| a >= m.base && a - m.base < m.len);
    let mut pieces: Vec<Piece> = Vec::new();
    for &(dev, raddr, len) in ranges {
        match pieces.last_mut() {
            Some(last) if last.0 as u64 + last.2 as u64 == dev && last.1 + last.2 as u64 == raddr && reg(last.0 as u64) == reg(dev) => last.2 += len as usize,
            _ => pieces.push((dev as usize, raddr, len as usize)),
        }
    }
    pieces.chunks(batch.clamp(1, MAX_RMA_BATCH)).map(|c| c.to_vec()).collect()
}

/// The registrations holding every device range of a request, and their one context; Err
/// with what is wrong.
fn owners(cx: &Cx, st: &Stage) -> std::result::Result<(Vec<Arc<LocalMem>>, cuda::Context), String> {
    let mut mems: Vec<Arc<LocalMem>> = Vec::new();
    let mut ctx: Option<cuda::Context> = None;
    for &(d, _, len) in &st.ranges {
        // KV blocks of one chunk are nearly always in one registration: try the last one.
        let m = match mems.last() {
            Some(m) if m.check(d, len, "").is_ok() => m.clone(),
            _ => {
                let m = cx.core.gpu.find(d, len).ok_or_else(|| format!("[{d:#x}, +{len}) is not inside a registered device region"))?;
                mems.push(m.clone());
                m
            }
        };
        let dev = m.dev.ok_or_else(|| format!("[{d:#x}, +{len}) is not device memory"))?;
        match ctx {
            Some(c) if c.id() != dev.ctx.id() => return Err("the ranges belong to more than one CUDA context".into()),
            _ => ctx = Some(dev.ctx),
        }
    }
    Ok((mems, ctx.ok_or("no ranges")?))
}

impl Serves {
    pub fn idle(&self) -> bool {
        self.items.is_empty() && self.waiting.is_empty()
    }

    /// A peer asks us to move a chunk in or out of our device memory.
    pub fn request(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, next_key: &mut u64, owner: u8, sender: u64, st: Stage) {
        self.waiting.push_back((sender, st, Instant::now()));
        let before = self.waiting.len();
        self.start(cx, pool, next_key, owner);
        if self.waiting.len() == before {
            self.times.serve_queued += 1;
        }
    }

    fn answer(cx: &mut Cx, sender: u64, token: u64, status: Status) {
        cx.answer(sender, CtrlType::StageAck, token, status, "stage request");
    }

    fn refuse(cx: &mut Cx, sender: u64, token: u64, why: &str) {
        log::error!("{}: refusing a stage request: {why}", cx.core.name);
        Self::answer(cx, sender, token, Status::NF_ERR_INVALID_PARAM);
    }

    fn start(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, next_key: &mut u64, owner: u8) {
        while let Some((sender, st, _)) = self.waiting.front() {
            let (sender, token) = (*sender, st.token);
            let (mems, ctx) = match owners(cx, st) {
                Ok(x) => x,
                Err(why) => {
                    self.waiting.pop_front();
                    Self::refuse(cx, sender, token, &why);
                    continue;
                }
            };
            if direct(st, &mems) {
                let Some((_, st, arrived)) = self.waiting.pop_front() else { return };
                self.times.add(Step::ServeWait, arrived);
                self.start_direct(cx, pool, owner, sender, st, mems, ctx);
                continue;
            }
            let p = match ensure(pool, cx, &ctx, next_key) {
                Ok(p) => p,
                Err(e) => {
                    self.waiting.pop_front();
                    log::error!("{}: staging pool: {e}", cx.core.name);
                    Self::answer(cx, sender, token, e.status());
                    continue;
                }
            };
            let (len, rail) = (st.bytes(), st.rrail as usize);
            if len as usize > p.chunk || rail >= cx.rails.len() {
                self.waiting.pop_front();
                Self::refuse(cx, sender, token, &format!("a chunk of {len} bytes on rail {rail} (our slots hold {} bytes, we have {} rails)", p.chunk, cx.rails.len()));
                continue;
            }
            let Some(slot) = p.take(false) else { return };
            let Some((_, st, arrived)) = self.waiting.pop_front() else { return };
            self.times.add(Step::ServeWait, arrived);
            let Some(dest) = cx.conns.initiator_rail_addr(sender, &*cx.rails[rail], st.rail as usize, &cx.core.name) else {
                p.give(slot, false);
                Self::refuse(cx, sender, token, &format!("its sender's rail {} cannot be reached from our rail {rail}", st.rail));
                continue;
            };
            add(&cx.core.counters.stage_served, 1);
            let batch = cx.rails[rail].caps().rma_batch.min(cx.core.cfg.rma_batch.max(1) as usize);
            // (A LEND makes no RMA of ours: the requester reads the slot.)
            let rma = if st.dir == StageDir::Lend { Vec::new() } else { rma_ops(st.ranges.iter().map(|r| (r.1, r.2 as usize)), batch) };
            let now = Instant::now();
            let mut s = Serve { stage: st, sender, rail, dest, ctx, slot: Some(slot), phase: Phase::Rma, rma, next_op: 0, left: 0, failed: None, gone: false, mems, born: now, stamp: now };
            let phase = match s.stage.dir {
                StageDir::Pull => Ok(Phase::Rma),
                StageDir::Push | StageDir::Lend => p.copy(cx.core, ctx, slot, &s.dev_ranges(), true).map(Phase::CopyOut),
            };
            match phase {
                Ok(phase) => {
                    s.phase = phase;
                    let id = self.items.insert(s);
                    self.post_due(cx, pool, owner, id);
                }
                Err(e) => {
                    p.give(slot, false);
                    log::error!("{}: serving a staged chunk for a peer failed: {e}", cx.core.name);
                    Self::answer(cx, sender, token, e.status());
                }
            }
        }
    }

    /// Starts a direct serve (see `direct`): its RMA at once, no slot, no device copy.
    #[allow(clippy::too_many_arguments)]
    fn start_direct(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, owner: u8, sender: u64, st: Stage, mems: Vec<Arc<LocalMem>>, ctx: cuda::Context) {
        let (token, rail) = (st.token, st.rrail as usize);
        let Some(port) = cx.rails.get(rail) else {
            return Self::refuse(cx, sender, token, &format!("a chunk on rail {rail} (we have {} rails)", cx.rails.len()));
        };
        let batch = port.caps().rma_batch.min(cx.core.cfg.rma_batch.max(1) as usize);
        let Some(dest) = cx.conns.initiator_rail_addr(sender, &*cx.rails[rail], st.rail as usize, &cx.core.name) else {
            return Self::refuse(cx, sender, token, &format!("its sender's rail {} cannot be reached from our rail {rail}", st.rail));
        };
        add(&cx.core.counters.stage_served, 1);
        if !std::mem::replace(&mut self.told_direct, true) {
            log::info!("{}: a peer asks us to move its host memory into or out of our provider-registered GPU memory: our RMA goes straight between them (no bounce slot, no device copy)", cx.core.name);
        }
        let rma = direct_ops(&st.ranges, &mems, batch);
        let now = Instant::now();
        let s = Serve { stage: st, sender, rail, dest, ctx, slot: None, phase: Phase::Rma, rma, next_op: 0, left: 0, failed: None, gone: false, mems, born: now, stamp: now };
        let id = self.items.insert(s);
        self.post_due(cx, pool, owner, id);
    }

    /// Posts the serve's due RMA operations; FI_EAGAIN leaves them due (the same ones).
    fn post_due(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, owner: u8, id: u64) {
        let Some(s) = self.items.get_mut(id) else { return };
        if !matches!(s.phase, Phase::Rma) {
            return;
        }
        let write = s.stage.dir == StageDir::Push;
        let res = (|| -> Result<()> {
            let port = cx.rails.get(s.rail).ok_or_else(|| Error::Backend(format!("no rail {}", s.rail)))?;
            while s.next_op < s.rma.len() {
                let pieces = &s.rma[s.next_op];
                let len: usize = pieces.iter().map(|p| p.2).sum();
                let op = OpKind::Transport(TOp { owner, tag: SERVE_RMA, rail: s.rail as u16, slot: false, inline: false, req: None, epoch: 0, token: id, len: len as u64 });
                let posted = match s.slot {
                    Some(slot) => {
                        let p = pool.as_ref().ok_or_else(|| Error::Backend("no staging pool".into()))?;
                        p.post(&**port, cx.core, cx.ops, op, slot, write, s.dest, pieces, s.stage.peer_key)?
                    }
                    None => post_direct(&**port, cx.core, cx.ops, op, write, s.dest, pieces, s.stage.peer_key, &s.mems)?,
                };
                match posted {
                    Posted::Ok => {
                        s.next_op += 1;
                        s.left += 1;
                    }
                    Posted::Again => {
                        add(&cx.core.counters.retries, 1);
                        add(&cx.core.rail_counters[s.rail].retries, 1);
                        break;
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = res {
            s.next_op = s.rma.len();
            s.failed.get_or_insert(e);
            if s.left == 0 {
                let e = s.failed.take().unwrap_or(Error::Canceled);
                self.end(cx, pool, id, Err(e));
            }
        }
    }

    /// Completion of one of a serve's RMA operations.
    pub fn on_rma(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, id: u64, err: Option<Error>) {
        let Some(s) = self.items.get_mut(id) else { return };
        s.left = s.left.saturating_sub(1);
        if let Some(e) = err {
            s.next_op = s.rma.len();
            s.failed.get_or_insert(e);
        }
        if s.left > 0 || s.next_op < s.rma.len() {
            return;
        }
        if let Some(e) = s.failed.take() {
            return self.end(cx, pool, id, Err(e));
        }
        self.times.add(Step::ServeRma, s.stamp);
        s.stamp = Instant::now();
        let Some(slot) = s.slot else { return self.end(cx, pool, id, Ok(())) };
        match s.stage.dir {
            StageDir::Push | StageDir::Lend => self.end(cx, pool, id, Ok(())),
            StageDir::Pull => {
                let ranges = s.dev_ranges();
                match pool.as_mut().map(|p| p.copy(cx.core, s.ctx, slot, &ranges, false)) {
                    Some(Ok(ev)) => s.phase = Phase::CopyIn(ev),
                    Some(Err(e)) => self.end(cx, pool, id, Err(e)),
                    None => self.end(cx, pool, id, Err(Error::Backend("no staging pool".into()))),
                }
            }
        }
    }

    /// Polls the serves' device copies, retries their refused RMA, starts waiting requests.
    /// Returns whether any serve is in flight or waiting.
    pub fn advance(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, next_key: &mut u64, owner: u8) -> bool {
        let work = !self.idle();
        for id in self.items.tokens() {
            let Some(s) = self.items.get_mut(id) else { continue };
            let (q, copy_in) = match &s.phase {
                Phase::CopyIn(q) => (q, true),
                Phase::CopyOut(q) => (q, false),
                Phase::Rma => {
                    if s.next_op < s.rma.len() {
                        self.post_due(cx, pool, owner, id);
                    }
                    continue;
                }
                Phase::Lent => {
                    let limit = cx.core.cfg.timeout() * LEASE_TIMEOUTS;
                    if s.stamp.elapsed() > limit {
                        log::warn!("{}: a slot lent to engine {:016x} was not released in {limit:?}: taken back", cx.core.name, s.sender);
                        self.end(cx, pool, id, Ok(()));
                    }
                    continue;
                }
            };
            let ready = match copied(pool, cx.core, q) {
                Ok(r) => r,
                Err(e) => {
                    self.end(cx, pool, id, Err(e));
                    continue;
                }
            };
            if !ready {
                continue;
            }
            self.times.add(Step::ServeCopy, s.stamp);
            s.stamp = Instant::now();
            if let Some(e) = s.failed.take() {
                self.end(cx, pool, id, Err(e));
            } else if copy_in {
                self.end(cx, pool, id, Ok(()));
            } else if s.stage.dir == StageDir::Lend {
                self.lend(cx, pool, id);
            } else {
                s.phase = Phase::Rma;
                self.post_due(cx, pool, owner, id);
            }
        }
        self.start(cx, pool, next_key, owner);
        work
    }

    /// A LEND chunk is packed in its slot: the requester is told where to read it.
    fn lend(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, id: u64) {
        let Some(s) = self.items.get_mut(id) else { return };
        let virt = cx.rails.get(s.rail).is_some_and(|r| r.caps().virt_addr);
        let target = pool.as_ref().zip(s.slot).ok_or_else(|| Error::Backend("no staging slot".into())).and_then(|(p, slot)| p.rma_target(slot, s.rail, virt));
        match (target, cx.initiator_addr(s.sender)) {
            (Ok((addr, key)), Some(dest)) => {
                s.phase = Phase::Lent;
                s.stamp = Instant::now();
                let lent = StageLent { token: s.stage.token, lease: id, addr, key };
                cx.ctrl(0, dest, CtrlType::StageLent, &lent.encode());
            }
            (Err(e), _) => self.end(cx, pool, id, Err(e)),
            (_, None) => self.end(cx, pool, id, Err(Error::Backend("the requester never introduced itself".into()))),
        }
    }

    /// The requester `sender` read (or gave up on) the slot it was lent as `lease`.
    pub fn release(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, sender: u64, lease: u64) {
        match self.items.get_mut(lease) {
            Some(s) if s.sender == sender && matches!(s.phase, Phase::Lent) => self.end(cx, pool, lease, Ok(())),
            // (A release that names no slot lent to its sender changes nothing: the message
            // is untrusted.)
            _ => log::warn!("{}: a slot release from engine {sender:016x} names no slot lent to it ({lease:#x})", cx.core.name),
        }
    }

    /// The requester `engine_id` was disconnected: its requests still waiting for a slot are
    /// dropped, and its serves post nothing more. Each ends (its slot back, no answer) at
    /// once where the provider holds none of its operations, else when the last completes
    /// or its running device copy finishes. A slot lent to it stays lent until it is released
    /// or its lease runs out: our disconnect does not mean the requester stopped reading it.
    pub fn drop_sender(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, engine_id: u64) {
        self.waiting.retain(|(sender, _, _)| *sender != engine_id);
        for id in self.items.tokens() {
            let Some(s) = self.items.get_mut(id) else { continue };
            if s.sender != engine_id {
                continue;
            }
            s.gone = true;
            s.next_op = s.rma.len();
            s.failed.get_or_insert_with(|| Error::Disconnected("the requesting peer was disconnected".into()));
            if matches!(s.phase, Phase::Rma) && s.left == 0 {
                let e = s.failed.take().unwrap_or(Error::Canceled);
                self.end(cx, pool, id, Err(e));
            }
        }
    }

    fn end(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, id: u64, res: Result<()>) {
        let Some(s) = self.items.remove(id) else { return };
        if let (Some(p), Some(slot)) = (pool.as_mut(), s.slot) {
            p.give(slot, false);
        }
        self.times.add(Step::ServeTotal, s.born);
        // (A lent slot was answered when it was lent.)
        if matches!(s.phase, Phase::Lent) && !s.gone {
            return;
        }
        if s.gone {
            log::info!("{}: dropped a staged chunk of a disconnected peer (its slot is free again)", cx.core.name);
            return;
        }
        let status = match res {
            Ok(()) => Status::NF_SUCCESS,
            Err(e) => {
                log::error!("{}: serving a staged chunk for a peer failed: {e}", cx.core.name);
                e.status()
            }
        };
        Self::answer(cx, s.sender, s.stage.token, status);
    }
}

/// Posts one RMA operation of a direct serve: `pieces` name our device addresses, each
/// inside one of `mems` (the serve's registrations, which the provider holds on `rail`).
#[allow(clippy::too_many_arguments)]
fn post_direct(rail: &dyn crate::engine::port::Port, core: &crate::engine::core::Core, ops: &mut crate::engine::ops::OpPool, op: OpKind, write: bool,
               dest: FiAddr, pieces: &[Piece], rkey: u64, mems: &[Arc<LocalMem>]) -> Result<Posted> {
    let r = rail.index();
    let desc = |local: usize, len: usize| {
        mems.iter().find(|m| local as u64 >= m.base && (local + len) as u64 <= m.base + m.len && m.dev.is_some_and(|d| !d.staged) && r < m.descs.len())
            .map(|m| m.desc(r))
            .ok_or_else(|| Error::Backend(format!("[{local:#x}, +{len}) is in no registration the provider holds on rail {r}")))
    };
    // SAFETY: every piece lies inside a registration of ours that the provider holds on this
    // rail (`desc` finds it or fails the post, and gives its descriptor); the serve keeps
    // those registrations until its operations completed or were taken back unposted.
    unsafe { post_local(rail, core, ops, op, write, dest, pieces, rkey, desc) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::registry::{MemKind, SharedCloseQueue};

    fn reg(base: u64, len: u64) -> Arc<LocalMem> {
        Arc::new(LocalMem::new(1, base, len, MemKind::Vram, 0, 1, Vec::new(), SharedCloseQueue::default(), None, None))
    }

    #[test]
    fn direct_ops_merge_what_continues_on_both_sides_within_one_registration() {
        let mems = [reg(0x10000, 0x1000), reg(0x11000, 0x1000)];
        // Two ranges continuing on both sides in the first registration, then one that
        // continues both into the second registration (kept apart: another descriptor),
        // then a gap at the requester.
        let r = [(0x10000, 0x900000, 0x400), (0x10400, 0x900400, 0x400), (0x10800, 0x900800, 0x800), (0x11000, 0x901000, 0x100), (0x11100, 0x905000, 0x100)];
        let ops = direct_ops(&r, &mems, 2);
        assert_eq!(ops, vec![vec![(0x10000, 0x900000, 0x1000), (0x11000, 0x901000, 0x100)], vec![(0x11100, 0x905000, 0x100)]]);
    }
}
