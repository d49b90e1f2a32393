//! Planning one part of a request (the whole of a short one): its descriptors run by run,
//! each registration pair's way decided once.
use super::pool::{same_process_host, HostPool};
use super::routes::{resolve, Small, Way};
use super::segs::{push, rma_segs, staged_segs, Bounds, ChunkFill, Run, Spread};
use super::types::{push_new, Inputs, Pair, Plan, Reach};
use crate::engine::ipc_cache::Keep;
use crate::engine::registry::{LocalMem, MemKind};
use crate::engine::remote::RemoteMem;
use crate::engine::request::{seg_list, Seg, SegKind, SegSummary, Target};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// How each registration pair of a request moves, decided when the pair first appears and
/// looked up once per run of descriptors that name it (descriptor lists run long on one pair).
#[derive(Default)]
struct Ways {
    seen: HashMap<(usize, usize), Way>,
    locals: Vec<Arc<LocalMem>>,
    remotes: Vec<Arc<RemoteMem>>,
    /// What the same-host ways keep alive, each once.
    keeps: Vec<Keep>,
}

/// Descriptors `[start, end)` of a request of `count`.
#[derive(Clone, Copy)]
pub(super) struct Span {
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) count: usize,
}

/// Plans descriptors `span` of a request, read from `pairs`; the host pool's guess is
/// settled by the caller, who knows the whole request's bytes.
pub(super) fn plan_part<'a>(inp: &Inputs, target: &Target, span: Span, mut pairs: impl Iterator<Item = Result<Pair<'a>>>, small: Small,
                            reach: &dyn Reach) -> Result<(Plan, HostPool)> {
    let count = span.count;
    // The first part's list is made for the whole request: the other parts join it.
    let mut segs = seg_list(if span.start == 0 { count } else { span.end - span.start });
    let mut fill = ChunkFill::default();
    let mut ways = Ways::default();
    let mut sum = SegSummary::default();
    let mut pool = HostPool::default();
    let mut resolve_ns = 0u64;
    let mut i = span.start;
    // One registration pair's run of descriptors at a time: its way is looked up once, and
    // the run goes through a loop made for that way (one loop for every way cost a branch
    // table and register spills per descriptor: 12-14 ns of it on the CPU machine).
    let mut next = pairs.next().transpose()?;
    while let Some(first) = next {
        let (lm, rm) = (first.local.2, first.remote.2);
        let way = match ways.seen.get(&first.key()) {
            Some(w) => *w,
            None => {
                let t0 = inp.timed.then(std::time::Instant::now);
                let w = ways.decide(inp, reach, target, &first, (i, count), &mut pool)?;
                resolve_ns += t0.map_or(0, |t| t.elapsed().as_nanos() as u64);
                w
            }
        };
        let run = Run { bounds: Bounds::of(lm, rm), key: first.key() };
        let before = segs.len();
        next = match (way, target, &**rm) {
            (Way::Loopback { local, remote }, _, _) => {
                let kind = SegKind::Loopback { local: local.map(|d| d.ctx), remote: remote.map(|d| d.ctx) };
                run.each(&mut pairs, first, (&mut i, &mut sum.bytes), |_, (la, ll, _), (ra, _, _), join| {
                    push(&mut segs, Seg { local: la, len: ll, raddr: ra, rkey: 0, desc: 0, rail: 0, rrail: 0, kind }, u64::MAX, join);
                })?
            }
            (Way::SameHost { kind, shift }, _, _) => {
                let host = same_process_host(&kind);
                run.each(&mut pairs, first, (&mut i, &mut sum.bytes), |_, (la, ll, _), (ra, _, _), join| {
                    if host {
                        pool.bytes += ll;
                    }
                    push(&mut segs, Seg { local: la, len: ll, raddr: ra.wrapping_add(shift), rkey: 0, desc: 0, rail: 0, rrail: 0, kind }, u64::MAX, join);
                })?
            }
            (Way::Staged(lstaged), Target::Peer(peer), RemoteMem::Peer { desc, .. }) => {
                run.each(&mut pairs, first, (&mut i, &mut sum.bytes), |_, local, (ra, _, _), _| {
                    staged_segs(inp, &mut segs, &mut fill, local, (ra, desc), lstaged, peer.bulk_route(inp.cfg.staging_rail0));
                })?
            }
            (Way::Rma, Target::Peer(_), RemoteMem::Peer { desc, .. }) if small.eager && lm.kind == MemKind::Dram && lm.dev.is_none() && desc.mem_type == 0 => {
                let rkey = desc.keys.first().copied().unwrap_or(0);
                run.each(&mut pairs, first, (&mut i, &mut sum.bytes), |_, (la, ll, _), (ra, _, _), join| {
                    push(&mut segs, Seg { local: la, len: ll, raddr: ra, rkey, desc: 0, rail: 0, rrail: 0, kind: SegKind::Put }, u64::MAX, join);
                })?
            }
            (Way::Rma, Target::Peer(peer), RemoteMem::Peer { desc, .. }) => {
                sum.device_rma |= lm.dev.is_some();
                // A request kept on rail 0 needs the route's first pair (rail 0 to rail 0).
                let rail0 = inp.cfg.rma_rail0 || !inp.shapes.first().is_some_and(|s| s.nic_shared);
                let route = if small.rail0 { &peer.route[..] } else { peer.bulk_route(rail0) };
                let spread = Spread { count, small: small.rail0, route };
                run.each(&mut pairs, first, (&mut i, &mut sum.bytes), |at, local, (ra, _, _), join| {
                    rma_segs(inp, &mut segs, &spread, at, local, (ra, desc), join);
                })?
            }
            // resolve() gives Staged and Rma only for a peer's descriptor with a peer target.
            _ => return Err(Error::InvalidParam(format!("descriptor {i} has no route"))),
        };
        // Every segment of one way has the same facts (staging's kinds all ride rails).
        if segs.len() > before {
            if let Some(s) = segs.last() {
                sum.note(&s.kind);
            }
        }
    }
    let n = ways.seen.len();
    Ok((Plan { segs, keeps: ways.keeps, locals: ways.locals, remotes: ways.remotes, sum, ways: n, resolve_ns, parts: 1 }, pool))
}

impl Ways {
    /// Decides the way of a registration pair that first appears at descriptor `at.0` (of
    /// `at.1`), and remembers it and the registrations the request then holds.
    fn decide(&mut self, inp: &Inputs, reach: &dyn Reach, target: &Target, p: &Pair, at: (usize, usize), pool: &mut HostPool) -> Result<Way> {
        let (lm, rm) = (p.local.2, p.remote.2);
        let mut w = resolve(inp, reach, target, (lm, rm), at.0, &mut self.keeps)?;
        if let Way::SameHost { kind, shift } = w {
            if same_process_host(&kind) {
                w = Way::SameHost { kind: pool.kind(inp.cfg, p.local.1, at.1), shift };
            }
        }
        self.seen.insert(p.key(), w);
        push_new(&mut self.locals, lm.clone(), Arc::ptr_eq);
        push_new(&mut self.remotes, rm.clone(), Arc::ptr_eq);
        Ok(w)
    }
}
