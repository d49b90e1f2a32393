//! Planning a long request in parts on several threads, and moving the parts' segments into
//! one list.
use super::part::{plan_part, Span};
use super::pool::HostPool;
use super::routes::Small;
use super::types::{push_new, Inputs, PairSource, Plan, Reach};
use crate::config::Config;
use crate::engine::ipc_cache::Keep;
use crate::engine::request::{keep_seg_list, Seg, Target};
use crate::error::{Error, Result};
use std::sync::{mpsc, Arc};

/// Fewest descriptors a request planned in parts has: its plan takes about half a
/// millisecond on one thread of the GPU hosts (15-20 ns a descriptor), well above what a
/// thread that starts on an idle core there takes to run (~140 us, docs/MEASUREMENTS.md,
/// "DRAM on the host users run on"); shorter ones are planned on the posting thread alone.
const PARTS_MIN_DESCS: usize = 32_768;
/// Fewest descriptors a planning part takes.
const PART_MIN_DESCS: usize = 4096;

/// How many parts (threads) plan a request of `count` descriptors.
pub(super) fn part_count(threads: usize, count: usize) -> usize {
    if count < PARTS_MIN_DESCS {
        return 1;
    }
    (count / PART_MIN_DESCS).clamp(1, threads.max(1))
}

/// A planning part's result: its plan, and its guess at the pooling of host copies.
type Part = Result<(Plan, HostPool)>;

/// A planned part's segment count and same-process host bytes.
fn sizes_of(r: &Part) -> Option<(usize, u64)> {
    r.as_ref().ok().map(|(plan, pool)| (plan.segs.len(), pool.bytes))
}

/// Where a planning part's segments go in the request's list, and the same-process host
/// bytes of the whole request (which settle the kind of the part's host copies).
#[derive(Clone, Copy)]
struct Place {
    at: *mut Seg,
    host_bytes: u64,
}

// SAFETY: every part is given its own range of the first part's spare capacity, reserved
// before any part is given one; the list is not touched until every part has been joined.
unsafe impl Send for Place {}

impl Place {
    /// Settles the part's host copies and moves its segments to their place.
    fn fill(self, cfg: &Config, part: &mut (Plan, HostPool)) {
        let (plan, pool) = part;
        HostPool { guess: pool.guess, bytes: self.host_bytes }.settle(cfg, &mut plan.segs);
        // SAFETY: `at` has room for this part's segments, and no other part writes there
        // (see the type); Seg is Copy, so the part's list may be emptied after.
        unsafe { std::ptr::copy_nonoverlapping(plan.segs.as_ptr(), self.at, plan.segs.len()) };
        keep_seg_list(std::mem::take(&mut plan.segs));
    }
}

/// Plans a long request in `parts` consecutive parts at once, the caller's thread taking the
/// first (the vLLM pattern's 65536 descriptors took 1.3 ms on one thread of the H200 host,
/// before the first copy could start); then each part moves its segments into their place
/// in the first part's list, also at once (one thread moving them all cost a third of what
/// planning them did, CPU machine). Segments do not join across a part's edge, and a part
/// starts its own staging chunk: a few more segments, no other change.
pub(super) fn plan_in_parts<'a, S: PairSource<'a> + ?Sized>(inp: &Inputs, target: &Target, pairs: &S, parts: usize, reach: &dyn Reach) -> Result<Plan> {
    let count = pairs.count();
    let part = |p: usize| {
        let (start, end) = (count * p / parts, count * (p + 1) / parts);
        plan_part(inp, target, Span { start, end, count }, pairs.range(start, end), Small::default(), reach)
    };
    let cfg = inp.cfg;
    // The first part's plan holds the list every part moves its segments into: it lives
    // outside the scope, so that it outlives every helper thread whatever happens inside.
    let mut first: Option<Part> = None;
    // Each later part's plan, and whether its segments were moved to their place.
    let (rest, total) = std::thread::scope(|scope| {
        let (sized, sizes) = mpsc::channel::<(usize, Option<(usize, u64)>)>();
        let mut helpers = Vec::with_capacity(parts - 1);
        for p in 1..parts {
            let (give, place) = mpsc::channel::<Option<Place>>();
            let sized = sized.clone();
            let job = move || {
                let mut r = part(p);
                let _ = sized.send((p, sizes_of(&r)));
                // (The caller reads sizes until every sender is gone.)
                drop(sized);
                let mut moved = false;
                if let (Ok(done), Ok(Some(at))) = (&mut r, place.recv()) {
                    at.fill(cfg, done);
                    moved = true;
                }
                (r, moved)
            };
            // (No thread to be had: this one plans the part, after its own.)
            helpers.push(std::thread::Builder::new().name("nf-plan".into()).spawn_scoped(scope, job).ok().map(|h| (give, h)));
        }
        drop(sized);
        let first = first.insert(part(0));
        let mut here: Vec<Option<Part>> = helpers.iter().enumerate().map(|(k, h)| h.is_none().then(|| part(k + 1))).collect();
        let mut lens = vec![None; parts];
        lens[0] = sizes_of(first);
        for (k, r) in here.iter().enumerate() {
            if let Some(r) = r {
                lens[k + 1] = sizes_of(r);
            }
        }
        // (Ends when every helper has sent, or ended without sending.)
        for (p, n) in sizes.iter() {
            lens[p] = n;
        }
        // Where each part's segments go, once every part has planned.
        let places = match (&mut *first, lens.iter().copied().collect::<Option<Vec<(usize, u64)>>>()) {
            (Ok((all, pool)), Some(lens)) => {
                let host_bytes = lens.iter().map(|l| l.1).sum();
                let total = lens.iter().map(|l| l.0).sum::<usize>();
                all.segs.reserve(total.saturating_sub(all.segs.len()));
                pool.bytes = host_bytes;
                let base = all.segs.as_mut_ptr();
                let mut at = 0;
                let places: Vec<Place> = lens.iter().map(|l| {
                    let p = Place { at: base.wrapping_add(at), host_bytes };
                    at += l.0;
                    p
                }).collect();
                Some((places, total))
            }
            _ => None,
        };
        let place = |p: usize| places.as_ref().map(|(v, _)| v[p]);
        // Every helper gets its place before any is joined, so that they move at once.
        for (k, h) in helpers.iter().enumerate() {
            if let Some((give, _)) = h {
                let _ = give.send(place(k + 1));
            }
        }
        let mut rest = Vec::with_capacity(parts - 1);
        for (k, h) in helpers.into_iter().enumerate() {
            let p = k + 1;
            rest.push(match h {
                Some((_, h)) => h.join().unwrap_or_else(|_| (Err(Error::Backend(format!("planning part {p} of a request panicked"))), false)),
                None => {
                    let mut r = here[k].take().unwrap_or_else(|| Err(Error::Backend(format!("planning part {p} was lost"))));
                    let mut moved = false;
                    if let (Ok(done), Some(at)) = (&mut r, place(p)) {
                        at.fill(cfg, done);
                        moved = true;
                    }
                    (r, moved)
                }
            });
        }
        (rest, places.map(|(_, total)| total))
    });
    let (mut all, pool) = first.unwrap_or_else(|| Err(Error::Backend("the first planning part did not run".into())))?;
    let mut done = Vec::with_capacity(rest.len());
    let mut moved = true;
    for (r, m) in rest {
        // The first failing part in descriptor order names the request's error.
        done.push(r?.0);
        moved &= m;
    }
    let (Some(total), true) = (total, moved) else {
        return Err(Error::Backend("a planning part ended without its segments in place".into()));
    };
    // (pool.bytes is the whole request's by now.)
    pool.settle(cfg, &mut all.segs);
    // SAFETY: every later part planned, moved its segments to its place (`moved`, checked
    // above) and was joined, so the `total` segments reserved after the first part's are
    // written.
    unsafe { all.segs.set_len(total) };
    for p in done {
        p.keeps.into_iter().for_each(|k| push_new(&mut all.keeps, k, Keep::same));
        p.locals.into_iter().for_each(|m| push_new(&mut all.locals, m, Arc::ptr_eq));
        p.remotes.into_iter().for_each(|m| push_new(&mut all.remotes, m, Arc::ptr_eq));
        all.sum.join(&p.sum);
        all.ways += p.ways;
        all.resolve_ns += p.resolve_ns;
        all.parts += 1;
    }
    Ok(all)
}
