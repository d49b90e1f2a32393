//! The owner's side of staging: peers ask us (control message STAGE) to move a chunk in or
//! out of our device memory. PULL: RMA-read the chunk from the requester into a bounce
//! slot, then copy it into our memory. PUSH: copy out into a slot, then RMA-write it to the
//! requester. Every step that the provider refuses for now (FI_EAGAIN) is retried as the
//! same step: a PULL's read stays a read.
use super::super::slab::Slab;
use super::pool::{ensure, Stager};
use super::super::Cx;
use crate::cuda;
use crate::engine::ops::{OpKind, TOp};
use crate::engine::registry::LocalMem;
use crate::engine::wire::{CtrlType, Stage, StageAck, StageDir};
use crate::error::{Error, Result, Status};
use crate::fabric::{FiAddr, Posted};
use std::collections::VecDeque;
use std::sync::Arc;

/// TOp::tag of a serve's RMA.
pub const SERVE_RMA: u8 = 2;

enum Phase {
    /// The slot's RMA is with the provider.
    Rma,
    /// The slot's RMA is to be posted (first try, or again after FI_EAGAIN).
    PostRma { write: bool },
    CopyIn(cuda::Event),
    CopyOut(cuda::Event),
}

/// A peer's stage request we are serving.
struct Serve {
    stage: Stage,
    /// The requester: its engine id (to answer) and its rail-0 address (RMA target).
    sender: u64,
    dest: FiAddr,
    ctx: cuda::Context,
    slot: u32,
    phase: Phase,
    _mem: Arc<LocalMem>,
}

#[derive(Default)]
pub struct Serves {
    items: Slab<Serve>,
    /// Stage requests waiting for a free slot: (sender engine id, request).
    waiting: VecDeque<(u64, Stage)>,
}

impl Serves {
    pub fn idle(&self) -> bool {
        self.items.is_empty() && self.waiting.is_empty()
    }

    /// A peer asks us to move a chunk in or out of our device memory.
    pub fn request(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, next_key: &mut u64, owner: u8, sender: u64, st: Stage) {
        self.waiting.push_back((sender, st));
        self.start(cx, pool, next_key, owner);
    }

    fn answer(cx: &mut Cx, sender: u64, token: u64, status: Status) {
        let Some(dest) = cx.initiator_addr(sender) else {
            log::warn!("{}: cannot answer a stage request of an engine that never introduced itself", cx.core.name);
            return;
        };
        cx.ctrl(0, dest, CtrlType::StageAck, &StageAck { token, status: status.code() }.encode());
    }

    fn start(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, next_key: &mut u64, owner: u8) {
        while let Some(&(sender, st)) = self.waiting.front() {
            let Some(mem) = cx.core.gpu.find(st.dev_addr, st.len) else {
                self.waiting.pop_front();
                log::error!("{}: refusing a stage request for [{:#x}, +{}): not inside a registered device region", cx.core.name, st.dev_addr, st.len);
                Self::answer(cx, sender, st.token, Status::NF_ERR_INVALID_PARAM);
                continue;
            };
            let Some(dev) = mem.dev else {
                self.waiting.pop_front();
                Self::answer(cx, sender, st.token, Status::NF_ERR_INVALID_PARAM);
                continue;
            };
            let p = match ensure(pool, cx, &dev.ctx, next_key) {
                Ok(p) => p,
                Err(e) => {
                    self.waiting.pop_front();
                    log::error!("{}: staging pool: {e}", cx.core.name);
                    Self::answer(cx, sender, st.token, e.status());
                    continue;
                }
            };
            if st.len as usize > p.chunk {
                self.waiting.pop_front();
                Self::answer(cx, sender, st.token, Status::NF_ERR_INVALID_PARAM);
                continue;
            }
            let Some(slot) = p.take(false) else { return };
            self.waiting.pop_front();
            let Some(dest) = cx.initiator_addr(sender) else {
                p.give(slot, false);
                log::warn!("{}: stage request from an engine that never introduced itself", cx.core.name);
                continue;
            };
            let phase = match st.dir {
                StageDir::Pull => Ok(Phase::PostRma { write: false }),
                StageDir::Push => p.copy(cx.core, dev.ctx, slot, st.dev_addr, st.len as usize, true).map(Phase::CopyOut),
            };
            match phase {
                Ok(phase) => {
                    let id = self.items.insert(Serve { stage: st, sender, dest, ctx: dev.ctx, slot, phase, _mem: mem });
                    self.post_if_due(cx, pool, owner, id);
                }
                Err(e) => {
                    p.give(slot, false);
                    log::error!("{}: serving a staged chunk for a peer failed: {e}", cx.core.name);
                    Self::answer(cx, sender, st.token, e.status());
                }
            }
        }
    }

    /// Posts the serve's RMA if it is due; FI_EAGAIN leaves it due (the same operation).
    fn post_if_due(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, owner: u8, id: u64) {
        let Some(s) = self.items.get_mut(id) else { return };
        let Phase::PostRma { write } = s.phase else { return };
        let Some(p) = pool.as_ref() else { return self.end(cx, pool, id, Err(Error::Backend("no staging pool".into()))) };
        let op = OpKind::Transport(TOp { owner, tag: SERVE_RMA, rail: 0, slot: false, inline: false, req: None, epoch: 0, token: id, len: s.stage.len });
        let Some(rail0) = cx.rails.first() else { return };
        match p.post(&**rail0, cx.ops, op, s.slot, write, s.dest, s.stage.peer_addr, s.stage.peer_key, s.stage.len as usize) {
            Ok(Posted::Ok) => s.phase = Phase::Rma,
            Ok(Posted::Again) => crate::engine::counters::add(&cx.core.counters.retries, 1),
            Err(e) => self.end(cx, pool, id, Err(e)),
        }
    }

    /// Completion of a serve's RMA.
    pub fn on_rma(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, id: u64, err: Option<Error>) {
        if let Some(e) = err {
            return self.end(cx, pool, id, Err(e));
        }
        let Some(s) = self.items.get_mut(id) else { return };
        let (st, ctx, slot) = (s.stage, s.ctx, s.slot);
        match st.dir {
            StageDir::Push => self.end(cx, pool, id, Ok(())),
            StageDir::Pull => match pool.as_mut().map(|p| p.copy(cx.core, ctx, slot, st.dev_addr, st.len as usize, false)) {
                Some(Ok(ev)) => {
                    if let Some(s) = self.items.get_mut(id) {
                        s.phase = Phase::CopyIn(ev);
                    }
                }
                Some(Err(e)) => self.end(cx, pool, id, Err(e)),
                None => self.end(cx, pool, id, Err(Error::Backend("no staging pool".into()))),
            },
        }
    }

    /// Polls the serves' device copies, retries their refused RMA, starts waiting requests.
    /// Returns whether any serve is in flight or waiting.
    pub fn advance(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, next_key: &mut u64, owner: u8) -> bool {
        let work = !self.idle();
        for id in self.items.tokens() {
            let Some(s) = self.items.get_mut(id) else { continue };
            let (ev, copy_in) = match &s.phase {
                Phase::CopyIn(ev) => (ev, true),
                Phase::CopyOut(ev) => (ev, false),
                Phase::PostRma { .. } => {
                    self.post_if_due(cx, pool, owner, id);
                    continue;
                }
                Phase::Rma => continue,
            };
            let ready = match cx.core.apply_ctx(&s.ctx).and_then(|_| ev.query().map_err(Error::from)) {
                Ok(r) => r,
                Err(e) => {
                    self.end(cx, pool, id, Err(e));
                    continue;
                }
            };
            if !ready {
                continue;
            }
            if copy_in {
                self.end(cx, pool, id, Ok(()));
            } else {
                s.phase = Phase::PostRma { write: true };
                self.post_if_due(cx, pool, owner, id);
            }
        }
        self.start(cx, pool, next_key, owner);
        work
    }

    fn end(&mut self, cx: &mut Cx, pool: &mut Option<Stager>, id: u64, res: Result<()>) {
        let Some(s) = self.items.remove(id) else { return };
        if let Some(p) = pool.as_mut() {
            p.give(s.slot, false);
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
