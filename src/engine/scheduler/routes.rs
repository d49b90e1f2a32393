//! Which transport a registration pair's descriptors take (RMA, staging, loopback, a
//! same-host copy), and what a request of few descriptors may take.
use super::types::{push_new, Inputs, Pair, Reach};
use crate::config::Config;
use crate::cuda;
use crate::engine::gpu::DeviceMem;
use crate::engine::ipc_cache::{IpcEntry, Keep};
use crate::engine::local_peers::Locality;
use crate::engine::peer::Peer;
use crate::engine::registry::{LocalMem, MemKind};
use crate::engine::remote::RemoteMem;
use crate::engine::request::{Op, SegKind, Target};
use crate::engine::wire::MemDesc;
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex};

/// Largest IPC block a copy request carries (a VMM block of up to ~40 chunks); beyond it
/// our GPU memory with a peer's host memory is staged.
const COPY_MAX_IPC_BYTES: usize = 1024;

/// How every descriptor pair between one local and one remote registration moves. Decided
/// once per registration pair: descriptor lists name a few registrations in long runs, so
/// the per-descriptor work is a bounds check and an append (issue: 10k-100k descriptors).
#[derive(Clone, Copy)]
pub(super) enum Way {
    Loopback { local: Option<DeviceMem>, remote: Option<DeviceMem> },
    /// Same-host copy of `kind`; remote addresses move by `shift` (an IPC mapping's offset
    /// from the peer's address to ours, 0 where the address is usable as it is).
    SameHost { kind: SegKind, shift: u64 },
    Staged(Option<DeviceMem>),
    Rma,
}

/// Checks one registration pair against the request's target and decides how its
/// descriptors move; what a same-host way keeps alive is added to `keeps` once.
pub(super) fn resolve(inp: &Inputs, reach: &dyn Reach, target: &Target, mems: (&Arc<LocalMem>, &Arc<RemoteMem>), i: usize,
                      keeps: &mut Vec<Keep>) -> Result<Way> {
    let (lm, rm) = mems;
    if lm.engine_id != inp.engine_id {
        return Err(Error::InvalidParam(format!("local descriptor {i} is registered with another engine")));
    }
    let peer_name = match target {
        Target::Peer(p) => p.name.as_str(),
        Target::Local => "",
    };
    match (target, &**rm) {
        (Target::Local, RemoteMem::Local(m)) => {
            if m.engine_id != inp.engine_id {
                return Err(Error::InvalidParam(format!("remote descriptor {i} is not ours")));
            }
            Ok(Way::Loopback { local: lm.dev, remote: m.dev })
        }
        (Target::Peer(peer), RemoteMem::Peer { peer: owner, desc, opened }) => {
            if owner.id != peer.id {
                return Err(Error::InvalidParam(format!("remote descriptor {i} belongs to agent '{}', not '{peer_name}'", owner.name)));
            }
            let route = &peer.route;
            if route.is_empty() || route.iter().any(|p| p.rrail as usize >= desc.keys.len()) {
                return Err(Error::InvalidParam(format!("no rail reaches agent '{peer_name}' for descriptor {i}")));
            }
            let same_host = cma_route(inp.cfg, peer, lm, desc).map(|kind| (0, kind, Keep::Process))
                .or_else(|| direct_route(inp.cfg, reach, peer, lm, (desc, opened)));
            if let Some((shift, kind, keep)) = same_host {
                push_new(keeps, keep, Keep::same);
                return Ok(Way::SameHost { kind, shift });
            }
            let lstaged = lm.dev.filter(|d| d.staged);
            let staged = lstaged.is_some() || desc.staged || owner_rma(inp, peer, lm, desc);
            if staged && !peer.info.packed_staging {
                // Its stage requests and ours would not parse at the other end: say so now
                // instead of letting every chunk wait for an answer until the timeout.
                return Err(Error::Mismatch(format!(
                    "agent '{peer_name}' runs an older nixl-fabric whose GPU staging format (1) is not ours ({}): descriptor {i} cannot be staged; update both sides",
                    crate::engine::wire::STAGE_FORMAT)));
            }
            Ok(if staged { Way::Staged(lstaged) } else { Way::Rma })
        }
        (Target::Local, RemoteMem::Peer { peer, .. }) => {
            Err(Error::InvalidParam(format!("loopback request, but remote descriptor {i} belongs to agent '{}'", peer.name)))
        }
        (Target::Peer(_), RemoteMem::Local(_)) => {
            Err(Error::InvalidParam(format!("remote descriptor {i} is our own memory, but the request targets agent '{peer_name}'")))
        }
    }
}

/// Whether our host memory with a peer's provider-registered device memory goes as stage
/// requests that the peer serves with RMA from its device memory (config hmem_owner_rma):
/// the route's rails would move it through the provider's host bounce buffers from our side
/// (RailShape::hmem_host_bounce), and the peer takes stage requests of our format.
fn owner_rma(inp: &Inputs, peer: &Peer, lm: &LocalMem, desc: &MemDesc) -> bool {
    inp.cfg.hmem_owner_rma && lm.dev.is_none() && desc.mem_type == MemKind::Vram as u8 && !desc.staged
        && peer.info.packed_staging
        && peer.route.first().and_then(|p| inp.shapes.get(p.rail as usize)).is_some_and(|s| s.hmem_host_bounce)
}

/// Most descriptors a request that rail0_request or eager_write can pick has (64 KiB in
/// blocks of 256 B).
pub(super) const RAIL0_MAX_DESCS: usize = 256;

/// What a request of few descriptors may take (decided from all of them before planning).
#[derive(Clone, Copy, Default)]
pub(super) struct Small {
    /// It stays on rail 0 (rail0_request).
    pub(super) rail0: bool,
    /// Its host-to-host writes go in a control message (eager_write).
    pub(super) eager: bool,
}

impl Small {
    /// What a request of these few descriptors may take (their bytes summed once for both).
    pub(super) fn of(inp: &Inputs, target: &Target, pairs: &[Pair]) -> Small {
        let Target::Peer(peer) = target else { return Small::default() };
        let bytes: u64 = pairs.iter().map(|p| p.local.1).sum();
        Small { rail0: rail0_request(inp, peer, bytes), eager: eager_write(inp, peer, bytes) }
    }
}

/// Whether a request's writes between host memories go as a control message carrying their
/// bytes (transport::eager): a WRITE to a peer that takes them, of at most
/// `eager_write_bytes` in all, and no more than a notification may be (a control buffer holds
/// a notification of max_notif_size and 8 KiB more, so any block of it fits one message).
fn eager_write(inp: &Inputs, peer: &Peer, bytes: u64) -> bool {
    inp.op == Op::Write && peer.info.eager_write && bytes <= inp.cfg.eager_write_bytes.min(inp.cfg.max_notif_size)
}

/// Whether a request stays on the control endpoint pair (our rail 0 to the peer's rail 0)
/// instead of taking its turn in the round-robin: it is small (config `notif_rail0_bytes`)
/// and rail 0 orders a send after writes, so its notification can follow the data at once
/// (transport::rma::notif_behind) instead of after a flush read's round trip.
fn rail0_request(inp: &Inputs, peer: &Peer, bytes: u64) -> bool {
    inp.cfg.notif_behind_data
        && bytes <= inp.cfg.notif_rail0_bytes
        && inp.shapes.first().is_some_and(|s| s.order_saw)
        && peer.route.first().is_some_and(|p| p.rail == 0 && p.rrail == 0)
}

/// The CMA route for a descriptor pair, if it has one: our host memory with a same-host peer
/// process's host memory, the peer reachable by CMA (probed at connect) and watched by a
/// pidfd (so a post can tell the process is still the same one).
fn cma_route(cfg: &Config, peer: &Peer, local: &LocalMem, desc: &MemDesc) -> Option<SegKind> {
    if !(cfg.same_host_shm && cfg.cma_copy && peer.cma) || local.dev.is_some() || desc.mem_type != 0 || desc.staged || desc.ipc.is_some() {
        return None;
    }
    match (&peer.local, &peer.info.process) {
        (Locality::SameHost(Some(_)), Some(p)) => Some(SegKind::Cma { pid: p.pid }),
        _ => None,
    }
}

/// The direct route between our registration and a peer's, if there is one: how remote
/// addresses shift to this process's, the segments' kind, and what the request must keep.
fn direct_route(cfg: &Config, reach: &dyn Reach, peer: &Peer, lm: &LocalMem,
                remote: (&MemDesc, &Mutex<Vec<Arc<IpcEntry>>>)) -> Option<(u64, SegKind, Keep)> {
    let (desc, opened) = remote;
    let pin = |m: &LocalMem, ctx: Option<cuda::Context>| {
        if let (Some(c), true) = (ctx, cfg.pin_host_memory) {
            reach.pin(m, &c);
        }
    };
    let ipc_on = cfg.gpu_ipc && cfg.same_host_shm;
    match &peer.local {
        Locality::SameProcess(_) if cfg.same_host_shm => {
            // The peer engine's registration that the descriptor names, as a whole: every
            // descriptor of it is then addressable here as it is.
            let kind = MemKind::from_raw(desc.mem_type as u32).ok()?;
            let rm = reach.same_process(peer, desc.base, desc.len, kind)?;
            let ctx = lm.dev.map(|d| d.ctx).or(rm.dev.map(|d| d.ctx));
            pin(lm, ctx);
            pin(&rm, ctx);
            // The gather kernel runs in one context and reaches the other side's memory
            // only there (another device's memory needs peer access it may not have): ranges
            // between two contexts go to the copy engines, which move them either way.
            let dev = matches!((lm.dev, rm.dev), (Some(a), Some(b)) if a.ctx.id() == b.ctx.id());
            Some((0, SegKind::Direct { ctx, dev }, Keep::Local(Arc::downgrade(&rm))))
        }
        Locality::SameHost(_) if ipc_on => {
            if let Some(ipc) = desc.ipc.as_ref() {
                let e = reach.ipc_open(peer, ipc, lm.dev.map(|d| d.ctx))?;
                push_new(&mut opened.lock().unwrap_or_else(|p| p.into_inner()), e.clone(), Arc::ptr_eq);
                pin(lm, Some(e.ctx));
                let shift = e.base.wrapping_sub(e.remote_base);
                let dev = lm.dev.is_some();
                return Some((shift, SegKind::Direct { ctx: Some(e.ctx), dev }, Keep::Ipc(e)));
            }
            // Our GPU memory with the peer's host memory: the peer copies, since only it can
            // address its host memory; it opens our allocation from the handle we send.
            // (A VMM block with many chunks would not fit a control message: staged.)
            let own = lm.ipc.as_ref().filter(|i| desc.mem_type == 0 && !reach.peer_copy_refused(peer.info.engine_id)
                && i.encoded_len() <= COPY_MAX_IPC_BYTES)?;
            Some((0, SegKind::PeerCopy { alloc: own.alloc_base }, Keep::Export(own.clone())))
        }
        _ => None,
    }
}
