//! Direct copies: memory of a same-host peer that this process can address itself, so the
//! bytes move with one copy and no rail:
//! - a peer process's GPU memory, opened here from the IPC handle its descriptor carries
//!   (ipc_cache.rs), and copied by the GPU (copier.rs);
//! - an engine of this same process, whose registrations are plain addresses here: device
//!   copies through the driver when either side is VRAM, memcpy for DRAM on both sides;
//! - our GPU memory with a same-host peer's host memory: the peer copies, since only it can
//!   address its host memory (PeerCopy segments: we send COPY requests, it answers;
//!   serving them is copy_serve.rs).
//!
//! The initiator does every copy, on its progress loop, under the copy's context (rule 4;
//! the debug switch that skips applying contexts skips it here too). A copy is done when
//! its event completes; the notification is sent after that (rule 5).
mod copier;
mod copy_serve;

use super::slab::Slab;
use super::{Cx, Post, Start, Transport};
use crate::cuda;
use crate::engine::counters::add;
use crate::engine::ipc_cache::Keep;
use crate::engine::request::{Op, Request, Route, SegKind};
use crate::engine::wire::{self, CopyReq, Ctrl, CtrlType, StageAck};
use crate::error::{Error, Result, Status};
use copier::{all_done, Copier};
use copy_serve::CopyServes;
use std::sync::Arc;

/// Device copies of one post that are in flight: done when every event completes.
struct Job {
    req: Arc<Request>,
    epoch: u64,
    bytes: u64,
    ctx: cuda::Context,
    events: Vec<cuda::Event>,
}

/// One copy request we sent: the post it belongs to and the bytes it moves.
struct Asked {
    req: Arc<Request>,
    epoch: u64,
    bytes: u64,
    peer_id: u64,
}

#[derive(Default)]
pub struct Direct {
    copier: Copier,
    jobs: Vec<Job>,
    /// Copy requests we sent, waiting for the peer's answer.
    asked: Slab<Asked>,
    serves: CopyServes,
}

impl Direct {
    /// Starts the run of Direct segments from `at` that share one context: host copies
    /// finish here; device copies are queued and tracked as one job. Returns the segments
    /// taken and the pieces outstanding.
    fn start_copies(&mut self, cx: &mut Cx, req: &Arc<Request>, epoch: u64, at: usize, ctx: Option<cuda::Context>) -> Result<(usize, usize)> {
        let end = req.run_end(at, |k| matches!(k, SegKind::Direct { ctx: c, .. } if *c == ctx));
        let write = req.op == Op::Write;
        let segs = &req.segs[at..end];
        let pick = |s: &crate::engine::request::Seg| if write { (s.raddr, s.local, s.len as usize) } else { (s.local, s.raddr, s.len as usize) };
        let Some(ctx) = ctx else {
            let mut bytes = 0;
            for (d, s, n) in segs.iter().map(pick) {
                // SAFETY: both ranges lie in live registrations of engines of this process
                // (bounds-checked at preparation, the peer's checked to exist at post);
                // `copy` tolerates overlap.
                unsafe { std::ptr::copy(s as *const u8, d as *mut u8, n) };
                bytes += n as u64;
            }
            let c = &cx.core.counters;
            add(if write { &c.bytes_written } else { &c.bytes_read }, bytes);
            add(&c.ops_completed, 1);
            return Ok((end - at, 0));
        };
        cx.core.apply_ctx(&ctx)?;
        // Device ranges go to the GPU as they are read; those with host memory at one end
        // (few beside them) are listed for the copy engines.
        let (mut host, mut bytes) = (Vec::new(), 0u64);
        let dev = segs.iter().filter_map(|s| {
            bytes += s.len;
            let c = pick(s);
            if matches!(s.kind, SegKind::Direct { dev: true, .. }) {
                return Some(c);
            }
            host.push(c);
            None
        });
        // SAFETY: every range lies in a live registration of ours or in a peer's allocation
        // mapped here; the request keeps both (its keeps) until the job's events complete.
        let (mut events, spill) = unsafe { self.copier.launch_streamed(cx.core, ctx, end - at, dev) }?;
        host.extend(spill);
        if !host.is_empty() {
            // SAFETY: as above.
            match unsafe { self.copier.queue(cx.core, ctx, host) } {
                Ok(evs) => events.extend(evs),
                Err(e) => {
                    // The launches above still run: the request fails once they ended, so
                    // that its memory is the caller's again when it learns of the failure.
                    events.iter().for_each(|ev| { let _ = ev.synchronize(); });
                    return Err(e);
                }
            }
        }
        add(&cx.core.counters.ops_posted, 1);
        self.jobs.push(Job { req: req.clone(), epoch, bytes, ctx, events });
        Ok((end - at, 1))
    }

    /// Sends copy requests for the run of PeerCopy segments from `at` that name allocation
    /// `alloc`, as many as the control buffers need.
    fn start_peer_copy(&mut self, cx: &mut Cx, req: &Arc<Request>, epoch: u64, at: usize, alloc: u64) -> Result<(usize, usize)> {
        let peer = req.peer().cloned().ok_or_else(|| Error::Backend("copy request without a peer".into()))?;
        let ipc = req.keeps.iter().find_map(|k| match k {
            Keep::Export(i) if i.alloc_base == alloc => Some(i.clone()),
            _ => None,
        }).ok_or_else(|| Error::Backend("copy request for an allocation the request does not export".into()))?;
        let per_msg = cx.ctrl_room.saturating_sub(64 + ipc.encoded_len()) / 24;
        let per_msg = per_msg.clamp(1, wire::COPY_MAX_RANGES);
        let end = req.run_end(at, |k| matches!(k, SegKind::PeerCopy { alloc: a } if *a == alloc));
        let dest = cx.conns.ctrl_addr(peer.id)?;
        let to_receiver = req.op == Op::Write;
        let mut pieces = 0;
        for chunk in req.segs[at..end].chunks(per_msg) {
            let bytes = chunk.iter().map(|s| s.len).sum();
            let token = self.asked.insert(Asked { req: req.clone(), epoch, bytes, peer_id: peer.id });
            let msg = CopyReq { token, to_receiver, ipc: ipc.clone(), ranges: chunk.iter().map(|s| (s.local, s.raddr, s.len)).collect() };
            cx.ctrl(peer.id, dest, CtrlType::Copy, &msg.encode());
            pieces += 1;
            add(&cx.core.counters.ops_posted, 1);
        }
        Ok((end - at, pieces))
    }

    fn finish(cx: &mut Cx, req: Arc<Request>, epoch: u64, bytes: u64, res: Result<()>) {
        let res = res.and_then(|_| req.peer_alive());
        if res.is_ok() {
            add(&cx.core.counters.gpu_direct_bytes, bytes);
        }
        cx.piece(req, epoch, bytes, res);
    }

    /// The peer's answer to one of our copy requests.
    fn on_copy_ack(&mut self, cx: &mut Cx, sender_id: u64, sender: &str, a: StageAck) {
        let Some(asked) = self.asked.remove(a.token) else { return };
        let status = Status::from_code(a.status);
        let res = if status == Status::NF_SUCCESS {
            Ok(())
        } else {
            if status == Status::NF_ERR_NOT_SUPPORTED {
                log::info!("{}: agent '{sender}' cannot open our GPU memory by IPC; copies with its host memory are staged from now on", cx.core.name);
                cx.core.ipc.refuse(sender_id);
            }
            Err(Error::Backend(format!("agent '{sender}' could not copy: {}", status.name())))
        };
        Self::finish(cx, asked.req, asked.epoch, asked.bytes, res);
    }
}

impl Transport for Direct {
    fn name(&self) -> &'static str {
        "direct"
    }

    fn route(&self) -> Route {
        Route::Direct
    }

    fn start(&mut self, cx: &mut Cx, post: Post) -> Start {
        let Post { req, epoch, at, .. } = post;
        let (mut i, mut pieces) = (at, 0);
        while let Some(s) = req.segs.get(i) {
            let res = match s.kind {
                SegKind::Direct { ctx, .. } => self.start_copies(cx, req, epoch, i, ctx),
                SegKind::PeerCopy { alloc } => self.start_peer_copy(cx, req, epoch, i, alloc),
                _ => break,
            };
            match res {
                Ok((segs, p)) => {
                    i += segs;
                    pieces += p;
                }
                Err(e) => {
                    log::error!("{}: direct copy for agent '{}': {e}", cx.core.name, req.peer_name());
                    return Start::failed(i - at, pieces, e);
                }
            }
        }
        Start::went(i - at, pieces)
    }

    /// The streams and the gather kernel (a PTX JIT of tens of milliseconds) of a context are
    /// made when its first memory is registered, not by the first transfer (issue: the first
    /// request as fast as the rest).
    fn prepare(&mut self, cx: &mut Cx, dev: &crate::engine::gpu::DeviceMem) -> Result<()> {
        if !cx.core.cfg.same_host_shm {
            return Ok(());
        }
        if let Err(e) = self.copier.warm(cx.core, dev.ctx) {
            // Not fatal: the first copy tries again and reports what fails then.
            log::debug!("{}: direct copies not prepared for a new context: {e}", cx.core.name);
        }
        Ok(())
    }

    fn on_control(&mut self, cx: &mut Cx, msg: &Ctrl<'_>) -> bool {
        match msg.kind {
            CtrlType::Copy => match CopyReq::decode(msg.payload) {
                Ok(c) => self.serves.request(cx, &mut self.copier, msg.sender_id, msg.sender, c),
                Err(e) => log::warn!("{}: dropping a copy request from '{}': {e}", cx.core.name, msg.sender),
            },
            CtrlType::CopyAck => match StageAck::decode(msg.payload) {
                Ok(a) => self.on_copy_ack(cx, msg.sender_id, msg.sender, a),
                Err(e) => log::warn!("{}: dropping a copy answer from '{}': {e}", cx.core.name, msg.sender),
            },
            _ => return false,
        }
        true
    }

    /// Polls the device copies in flight and the copies served for peers.
    fn advance(&mut self, cx: &mut Cx) -> bool {
        let mut work = self.serves.advance(cx);
        if self.jobs.is_empty() {
            return work;
        }
        work = true;
        for job in std::mem::take(&mut self.jobs) {
            match cx.core.apply_ctx(&job.ctx).and_then(|_| all_done(&job.events)) {
                Ok(false) => self.jobs.push(job),
                Ok(true) => Self::finish(cx, job.req, job.epoch, job.bytes, Ok(())),
                Err(e) => Self::finish(cx, job.req, job.epoch, job.bytes, Err(e)),
            }
        }
        work
    }

    /// Waits for the device copies toward the peer to end (they finish on their own; the
    /// GPU does not wait for the peer), so its mappings can be closed under no running copy,
    /// and ends the copy requests it will never answer.
    fn drop_peer(&mut self, cx: &mut Cx, peer_id: u64, engine_id: u64) {
        for job in &self.jobs {
            if job.req.peer().is_some_and(|p| p.id == peer_id) {
                for ev in &job.events {
                    if let Err(e) = ev.synchronize() {
                        log::warn!("{}: waiting for a copy to a disconnected peer: {e}", cx.core.name);
                    }
                }
            }
        }
        cx.core.ipc.close_peer(engine_id);
        for token in self.asked.tokens() {
            if self.asked.get_mut(token).is_some_and(|a| a.peer_id == peer_id) {
                if let Some(a) = self.asked.remove(token) {
                    Self::finish(cx, a.req, a.epoch, 0, Err(Error::Disconnected("peer was disconnected".into())));
                }
            }
        }
    }

    fn sweep(&mut self, cx: &mut Cx) {
        self.serves.forget_exited(cx);
    }

    fn idle(&self) -> bool {
        self.jobs.is_empty() && self.asked.is_empty() && self.serves.idle()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::local_peers::Locality;
    use crate::engine::request::Seg;
    use crate::engine::transport::fake::{Bench, Run};
    use crate::engine::transport::Outcome;
    use crate::engine::wire::{decode_ctrl, encode_ctrl, IpcDesc, IPC_HANDLE_LEN, IPC_KIND_LEGACY};

    fn req_with(b: &mut Bench, op: Op, segs: Vec<Seg>, keeps: Vec<Keep>) -> Arc<Request> {
        let peer = b.conns.peers.get(&1).map(|c| c.peer.clone()).unwrap();
        let target = crate::engine::request::Target::Peer(peer);
        Arc::new(Request::new(op, target, segs, Vec::new(), Vec::new(), keeps))
    }

    #[test]
    fn host_copies_between_engines_of_this_process_finish_in_the_start() {
        let mut b = Bench::new(1, false);
        b.peer(1, Locality::Remote);
        let src: Vec<u8> = (0..16384).map(|i| (i % 253) as u8).collect();
        let mut dst = vec![0u8; 16384];
        let segs = (0..4u64).map(|i| Seg { local: src.as_ptr() as u64 + i * 4096, len: 4096, raddr: dst.as_mut_ptr() as u64 + i * 4096, rkey: 0, desc: 0, rail: 0, rrail: 0, kind: SegKind::Direct { ctx: None, dev: false } }).collect();
        let req = req_with(&mut b, Op::Write, segs, Vec::new());
        let mut t = Direct::default();
        let Run { pieces, failed, .. } = b.run(&mut t, &req, 3);
        assert!(failed.is_none() && pieces.is_empty(), "no piece outstanding: copied in the start");
        assert_eq!(dst, src);
        assert!(t.idle());
    }

    /// Copy requests we send for our GPU memory with a peer's host memory: answered, refused
    /// (the peer cannot open our memory), or never answered by a peer that is gone.
    #[test]
    fn peer_copies_end_with_the_answer_or_the_peers_departure() {
        let mut b = Bench::new(1, false);
        b.peer(1, Locality::Remote);
        let ipc = IpcDesc { kind: IPC_KIND_LEGACY, device_uuid: [3; 16], alloc_base: 0x7000_0000, alloc_len: 1 << 20, handle: [0; IPC_HANDLE_LEN], vmm: None };
        let segs: Vec<Seg> = (0..3u64).map(|i| Seg { local: 0x7000_0000 + i * 4096, len: 4096, raddr: 0x9000 + i * 4096, rkey: 0, desc: 0, rail: 0, rrail: 0, kind: SegKind::PeerCopy { alloc: 0x7000_0000 } }).collect();
        let req = req_with(&mut b, Op::Write, segs.clone(), vec![Keep::Export(ipc.clone())]);
        let mut t = Direct::default();
        let s = t.start(&mut b.cx(), Post { req: &req, epoch: 1, at: 0, notif: &mut None, marks: &mut Default::default() });
        assert_eq!((s.segs, s.pieces), (3, 1), "three ranges in one copy request");
        let sent: Vec<CopyReq> = b.out.drain(..).filter_map(|o| match o {
            Outcome::Ctrl(m) => decode_ctrl(&m.bytes).ok().and_then(|c| CopyReq::decode(c.payload).ok()),
            _ => None,
        }).collect();
        assert_eq!(sent.len(), 1);
        assert!(sent[0].to_receiver && sent[0].ranges.len() == 3);
        let ack = |token, status: Status| encode_ctrl(CtrlType::CopyAck, 1001, "peer1", &StageAck { token, status: status.code() }.encode());
        let bytes = ack(sent[0].token, Status::NF_SUCCESS);
        assert!(t.on_control(&mut b.cx(), &decode_ctrl(&bytes).unwrap()));
        let p = b.pieces();
        assert_eq!(p.len(), 1);
        assert!(p[0].res.is_ok() && p[0].bytes == 3 * 4096);
        // A stale answer (same token again) finds nothing.
        assert!(t.on_control(&mut b.cx(), &decode_ctrl(&bytes).unwrap()));
        assert!(b.pieces().is_empty());
        // Refused: the piece fails, and later copies with that peer are staged (refused).
        t.start(&mut b.cx(), Post { req: &req, epoch: 2, at: 0, notif: &mut None, marks: &mut Default::default() });
        let token = b.out.drain(..).find_map(|o| match o {
            Outcome::Ctrl(m) => decode_ctrl(&m.bytes).ok().and_then(|c| CopyReq::decode(c.payload).ok()).map(|c| c.token),
            _ => None,
        }).unwrap();
        t.on_control(&mut b.cx(), &decode_ctrl(&ack(token, Status::NF_ERR_NOT_SUPPORTED)).unwrap());
        assert!(b.pieces()[0].res.is_err());
        assert!(b.core.ipc.refused(1001));
        // Never answered: the peer leaves, the piece ends as a disconnect.
        t.start(&mut b.cx(), Post { req: &req, epoch: 3, at: 0, notif: &mut None, marks: &mut Default::default() });
        assert!(!t.idle());
        t.drop_peer(&mut b.cx(), 1, 1001);
        let p = b.pieces();
        assert_eq!(p.len(), 1);
        assert!(matches!(p[0].res, Err(Error::Disconnected(_))));
        assert!(t.idle());
    }
}
