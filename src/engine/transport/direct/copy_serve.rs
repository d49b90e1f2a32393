//! Copies a peer asks of us (control message COPY): between our host memory and the
//! peer's GPU allocation, which we open from the IPC block the request carries. Only we can
//! address our host memory, so we copy; the peer's request completes with our answer.
use super::copier::{all_done, Copier};
use super::super::Cx;
use crate::cuda;
use crate::engine::ipc_cache::IpcEntry;
use crate::engine::registry::{LocalMem, MemKind};
use crate::engine::wire::{CopyReq, CtrlType};
use crate::error::{Error, Result, Status};
use std::collections::HashMap;
use std::sync::Arc;

/// A peer's copy request being served: its device copies, then the answer.
struct Serve {
    from: u64,
    token: u64,
    ctx: cuda::Context,
    events: Vec<cuda::Event>,
}

#[derive(Default)]
pub struct CopyServes {
    serves: Vec<Serve>,
    /// Allocations of initiators opened to serve them, kept open between their requests
    /// (by initiator engine id) until the initiator exits or the engine shuts down.
    served: HashMap<u64, Vec<Arc<IpcEntry>>>,
}

impl CopyServes {
    pub fn idle(&self) -> bool {
        self.serves.is_empty()
    }

    /// A peer asks us to copy between our host memory and its GPU allocation.
    pub fn request(&mut self, cx: &mut Cx, copier: &mut Copier, sender_id: u64, sender: &str, c: CopyReq) {
        let status = match self.serve(cx, copier, sender_id, sender, &c) {
            Ok(()) => return,
            Err(e) => {
                log::error!("{}: copy request from agent '{sender}': {e}", cx.core.name);
                match e {
                    Error::NotSupported(_) => Status::NF_ERR_NOT_SUPPORTED,
                    e => e.status(),
                }
            }
        };
        answer(cx, sender_id, c.token, status);
    }

    fn serve(&mut self, cx: &mut Cx, copier: &mut Copier, sender_id: u64, sender: &str, c: &CopyReq) -> Result<()> {
        if !cx.core.ipc_enabled() {
            return Err(Error::NotSupported("GPU IPC is off here".into()));
        }
        // Every host range must lie in one of our DRAM registrations: the request is untrusted.
        let mut mems: Vec<Arc<LocalMem>> = Vec::new();
        for &(_, h, n) in &c.ranges {
            let m = cx.core.view.find(h, n, MemKind::Dram)
                .ok_or_else(|| Error::InvalidParam(format!("[{h:#x}, +{n}) is not registered host memory of ours")))?;
            if !mems.iter().any(|x| Arc::ptr_eq(x, &m)) {
                mems.push(m);
            }
        }
        let entry = cx.core.ipc.open(sender_id, sender, &c.ipc, None)
            .ok_or_else(|| Error::NotSupported("its GPU memory cannot be opened here".into()))?;
        if cx.core.cfg.pin_host_memory {
            for m in &mems {
                m.pin_for_gpu(&entry.ctx);
            }
        }
        let mut copies = Vec::with_capacity(c.ranges.len());
        for &(s, h, n) in &c.ranges {
            let mapped = entry.base + (s - entry.remote_base);
            copies.push(if c.to_receiver { (h, mapped, n as usize) } else { (mapped, h, n as usize) });
        }
        let ctx = entry.ctx;
        let held = self.served.entry(sender_id).or_default();
        if !held.iter().any(|e| Arc::ptr_eq(e, &entry)) {
            held.push(entry);
        }
        cx.core.apply_ctx(&ctx)?;
        // SAFETY: the host ranges lie in our live DRAM registrations (checked above); the
        // device ranges in the peer's allocation mapped here, held in `served` until the
        // initiator exits (after its copies end).
        let events = unsafe { copier.queue(cx.core, ctx, copies) }?;
        self.serves.push(Serve { from: sender_id, token: c.token, ctx, events });
        Ok(())
    }

    /// Polls the copies we serve; answers the finished ones. Returns whether any ran.
    pub fn advance(&mut self, cx: &mut Cx) -> bool {
        if self.serves.is_empty() {
            return false;
        }
        let serves = std::mem::take(&mut self.serves);
        for s in serves {
            match cx.core.apply_ctx(&s.ctx).and_then(|_| all_done(&s.events)) {
                Ok(false) => self.serves.push(s),
                Ok(true) => answer(cx, s.from, s.token, Status::NF_SUCCESS),
                Err(e) => {
                    log::error!("{}: serving a copy request: {e}", cx.core.name);
                    answer(cx, s.from, s.token, e.status());
                }
            }
        }
        true
    }

    /// Closes what we opened for initiators that have exited (after their copies ended).
    pub fn forget_exited(&mut self, cx: &mut Cx) {
        let gone: Vec<u64> = self.served.keys().copied().filter(|&id| !cx.conns.initiator_alive(id)).collect();
        for id in gone {
            for s in self.serves.iter().filter(|s| s.from == id) {
                for ev in &s.events {
                    let _ = ev.synchronize();
                }
            }
            self.serves.retain(|s| s.from != id);
            self.served.remove(&id);
            cx.core.ipc.close_peer(id);
            log::info!("{}: an initiator that had its GPU memory opened here exited; closed its mappings", cx.core.name);
        }
    }
}

fn answer(cx: &mut Cx, to: u64, token: u64, status: Status) {
    cx.answer(to, CtrlType::CopyAck, token, status, "copy request");
}
