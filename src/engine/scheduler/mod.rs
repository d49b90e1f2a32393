//! The scheduler: which transport moves each descriptor pair of a request, and how it is cut
//! into segments (rail striping, contiguous runs per rail, staging chunks, provider message
//! limits). A function of the descriptors, the registrations, the peer and the rails'
//! shapes; what it needs to know about same-host memory (another engine's registration in
//! this process, a peer's GPU allocation opened by IPC) it asks through `Reach`, so tests
//! run it with none of that.
mod balance;
mod part;
mod parts;
mod pool;
mod routes;
mod segs;
#[cfg(test)]
mod tests;
mod types;

pub use types::{Inputs, Pair, PairSource, Plan, RailShape, Reach};

use crate::engine::request::Target;
use crate::error::{Error, Result};
use part::{plan_part, Span};
use parts::{part_count, plan_in_parts};
use routes::{Small, RAIL0_MAX_DESCS};

/// Checks every pair and cuts it into segments, once; posts reuse them. `pairs` is read as
/// it is needed, by several threads in parts where the request is long (`part_count`).
pub fn plan<'a, S: PairSource<'a> + ?Sized>(inp: &Inputs, target: &Target, pairs: &S, reach: &dyn Reach) -> Result<Plan> {
    let first = plan_once(inp, target, pairs, reach)?;
    Ok(balance::even_out(inp, target, first, |evened| plan_once(evened, target, pairs, reach)))
}

/// One plan of the request with `inp`'s chunk size.
fn plan_once<'a, S: PairSource<'a> + ?Sized>(inp: &Inputs, target: &Target, pairs: &S, reach: &dyn Reach) -> Result<Plan> {
    let count = pairs.count();
    if count == 0 {
        return Err(Error::InvalidParam("request has no descriptors".into()));
    }
    let whole = Span { start: 0, end: count, count };
    // A request small enough to stay on rail 0 has few descriptors: those are read ahead
    // to sum their bytes (Small::of); longer lists are read as they go, by a loop
    // made for the caller's own iterator (a boxed one cost a call per descriptor).
    if count <= RAIL0_MAX_DESCS {
        let v = pairs.range(0, count).collect::<Result<Vec<Pair>>>()?;
        let small = Small::of(inp, target, &v);
        return plan_part(inp, target, whole, v.into_iter().map(Ok), small, reach).map(|(p, pool)| p.settled(inp.cfg, pool));
    }
    let parts = part_count(inp.plan_threads, count);
    if parts <= 1 {
        return plan_part(inp, target, whole, pairs.range(0, count), Small::default(), reach).map(|(p, pool)| p.settled(inp.cfg, pool));
    }
    plan_in_parts(inp, target, pairs, parts, reach)
}

/// Most threads that plan one request: config `plan_threads`, 0 = half of `cores`, at most
/// eight.
pub fn plan_threads(cfg: u64, cores: usize) -> usize {
    match cfg {
        0 => (cores / 2).clamp(1, 8),
        n => n.min(64) as usize,
    }
}
