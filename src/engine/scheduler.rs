//! The scheduler: which transport moves each descriptor pair of a request, and how it is cut
//! into segments (rail striping, contiguous runs per rail, staging chunks, provider message
//! limits). A function of the descriptors, the registrations, the peer and the rails'
//! shapes; what it needs to know about same-host memory (another engine's registration in
//! this process, a peer's GPU allocation opened by IPC) it asks through `Reach`, so tests
//! run it with none of that.
use super::gpu::DeviceMem;
use super::ipc_cache::{IpcEntry, Keep};
use super::local_peers::Locality;
use super::peer::{Peer, RoutePair};
use super::registry::{LocalMem, MemKind};
use super::remote::RemoteMem;
use super::request::{keep_seg_list, seg_list, Op, Route, Seg, SegKind, SegSummary, Target};
use super::transport::cma::{POOL_MIN_BYTES, THIS_PROCESS};
use super::wire::{IpcDesc, MemDesc};
use crate::config::Config;
use crate::cuda;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex};

/// Largest IPC block a copy request carries (a VMM block of up to ~40 chunks); beyond it
/// our GPU memory with a peer's host memory is staged.
const COPY_MAX_IPC_BYTES: usize = 1024;

/// One descriptor pair of a request: (address, length, registration) on each side.
#[derive(Clone, Copy)]
pub struct Pair<'a> {
    pub local: (u64, u64, &'a Arc<LocalMem>),
    pub remote: (u64, u64, &'a Arc<RemoteMem>),
}

/// What every rail of this engine looks like, for segmenting requests without the driver.
pub struct RailShape {
    pub max_msg: u64,
    pub virt_addr: bool,
    pub provider: String,
    /// The rail orders a send after writes (RailCaps::order_saw): on rail 0, a notification
    /// can follow its data at once.
    pub order_saw: bool,
    /// Another rail of ours goes over this rail's interface (several connections on one NIC,
    /// as tcp's automatic rails): on rail 0, bulk data may then keep off it (config
    /// rma_rail0) and the interface still carries its share through the others.
    pub nic_shared: bool,
}

/// What the scheduler may learn about same-host memory, and the one side effect a route
/// has (page-locking host memory that a GPU copies). Planning threads ask it at once.
pub trait Reach: Sync {
    /// The registration of an engine of this process holding `[addr, +len)` of `kind`.
    fn same_process(&self, peer: &Peer, addr: u64, len: u64, kind: MemKind) -> Option<Arc<LocalMem>>;
    /// The peer's allocation described by `ipc`, opened here for copies under `local_ctx`.
    fn ipc_open(&self, peer: &Peer, ipc: &IpcDesc, local_ctx: Option<cuda::Context>) -> Option<Arc<IpcEntry>>;
    /// The peer said it cannot open our GPU memory (copies with its host memory are staged).
    fn peer_copy_refused(&self, engine_id: u64) -> bool;
    /// Host memory about to be copied by a GPU under `ctx`.
    fn pin(&self, m: &LocalMem, ctx: &cuda::Context);
}

/// What a request is planned against.
pub struct Inputs<'a> {
    pub engine_id: u64,
    pub op: Op,
    pub cfg: &'a Config,
    pub shapes: &'a [RailShape],
    /// Where this request's contiguous runs start (the engine's round-robin counter).
    pub rr_base: usize,
    /// Round-robin counter of staging chunks over the route's rail pairs.
    pub rr_chunks: &'a std::sync::atomic::AtomicUsize,
    /// Time the per-registration-pair work (`Plan::resolve_ns`): only for the create-time
    /// debug line, since a clock read per pair is not free.
    pub timed: bool,
    /// Most threads that plan one request in parts (config plan_threads, resolved; 1: the
    /// caller's thread alone).
    pub plan_threads: usize,
}

/// A request's descriptor pairs, which planning threads read in parts at the same time.
pub trait PairSource<'a>: Sync {
    fn count(&self) -> usize;
    /// Pairs `[start, end)` in order, read as they are needed (a failed read is the
    /// request's error).
    fn range(&self, start: usize, end: usize) -> impl Iterator<Item = Result<Pair<'a>>>;
}

impl<'a> PairSource<'a> for [Pair<'a>] {
    fn count(&self) -> usize {
        self.len()
    }
    fn range(&self, start: usize, end: usize) -> impl Iterator<Item = Result<Pair<'a>>> {
        self[start..end].iter().map(|p| Ok(*p))
    }
}

/// The segments of a request, what its same-host segments keep alive, and the distinct
/// registrations its descriptors name (held while the request lives).
pub struct Plan {
    pub segs: Vec<Seg>,
    pub keeps: Vec<Keep>,
    pub locals: Vec<Arc<LocalMem>>,
    pub remotes: Vec<Arc<RemoteMem>>,
    pub sum: SegSummary,
    /// Ways decided (one per registration pair the request named, per planning part that
    /// met it), and the time spent deciding them (with `Inputs::timed`; else 0; summed over
    /// the planning threads).
    pub ways: usize,
    pub resolve_ns: u64,
    /// Threads that planned it (plan_in_parts).
    pub parts: usize,
}

/// How every descriptor pair between one local and one remote registration moves. Decided
/// once per registration pair: descriptor lists name a few registrations in long runs, so
/// the per-descriptor work is a bounds check and an append (issue: 10k-100k descriptors).
#[derive(Clone, Copy)]
enum Way {
    Loopback { local: Option<DeviceMem>, remote: Option<DeviceMem> },
    /// Same-host copy of `kind`; remote addresses move by `shift` (an IPC mapping's offset
    /// from the peer's address to ours, 0 where the address is usable as it is).
    SameHost { kind: SegKind, shift: u64 },
    Staged(Option<DeviceMem>),
    Rma,
}

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

/// Checks every pair and cuts it into segments, once; posts reuse them. `pairs` is read as
/// it is needed, by several threads in parts where the request is long (`part_count`).
pub fn plan<'a, S: PairSource<'a> + ?Sized>(inp: &Inputs, target: &Target, pairs: &S, reach: &dyn Reach) -> Result<Plan> {
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

/// Fewest descriptors a request planned in parts has: its plan takes about half a
/// millisecond on one thread of the GPU hosts (15-20 ns a descriptor), well above what a
/// thread that starts on an idle core there takes to run (~140 us, docs/MEASUREMENTS.md,
/// "DRAM on the host users run on"); shorter ones are planned on the posting thread alone.
const PARTS_MIN_DESCS: usize = 32_768;
/// Fewest descriptors a planning part takes.
const PART_MIN_DESCS: usize = 4096;

/// Most threads that plan one request: config `plan_threads`, 0 = half of `cores`, at most
/// eight.
pub fn plan_threads(cfg: u64, cores: usize) -> usize {
    match cfg {
        0 => (cores / 2).clamp(1, 8),
        n => n.min(64) as usize,
    }
}

/// How many parts (threads) plan a request of `count` descriptors.
fn part_count(threads: usize, count: usize) -> usize {
    if count < PARTS_MIN_DESCS {
        return 1;
    }
    (count / PART_MIN_DESCS).clamp(1, threads.max(1))
}

/// Descriptors `[start, end)` of a request of `count`.
#[derive(Clone, Copy)]
struct Span {
    start: usize,
    end: usize,
    count: usize,
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
fn plan_in_parts<'a, S: PairSource<'a> + ?Sized>(inp: &Inputs, target: &Target, pairs: &S, parts: usize, reach: &dyn Reach) -> Result<Plan> {
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

impl Plan {
    /// The plan with its same-process host copies of the kind `pool` (whose bytes are the
    /// whole request's) settles on.
    fn settled(mut self, cfg: &Config, pool: HostPool) -> Plan {
        pool.settle(cfg, &mut self.segs);
        self
    }
}

/// Same-process host copies go to the CMA transport's pool when the request's host bytes
/// reach POOL_MIN_BYTES. That total is known only at the end, so the kind is guessed when
/// the first such descriptor appears (its length times the descriptor count: KV blocks are
/// one size) and corrected by a pass over the segments only where the guess was wrong.
#[derive(Default)]
struct HostPool {
    guess: Option<bool>,
    bytes: u64,
}

impl HostPool {
    fn kind(&mut self, cfg: &Config, first_len: u64, count: usize) -> SegKind {
        host_kind(*self.guess.get_or_insert(cfg.cma_copy && first_len.saturating_mul(count as u64) >= POOL_MIN_BYTES))
    }

    fn settle(&self, cfg: &Config, segs: &mut [Seg]) {
        let Some(guess) = self.guess else { return };
        let pooled = cfg.cma_copy && self.bytes >= POOL_MIN_BYTES;
        if pooled == guess {
            return;
        }
        let kind = host_kind(pooled);
        for s in segs.iter_mut().filter(|s| same_process_host(&s.kind)) {
            s.kind = kind;
        }
    }
}

/// The current registration pair's ranges, [start, end] on each side (end = last byte + 1,
/// with no overflow: a registration ending at the top of the address space is refused by
/// `check` as well), so that a descriptor's bounds check is four comparisons.
struct Bounds {
    local: (u64, u64),
    remote: (u64, u64),
}

impl Bounds {
    fn of(lm: &LocalMem, rm: &RemoteMem) -> Bounds {
        let (rb, rl) = rm.range();
        let end = |b: u64, l: u64| b.checked_add(l).unwrap_or(0);
        Bounds { local: (lm.base, end(lm.base, lm.len)), remote: (rb, end(rb, rl)) }
    }

    #[inline(always)]
    fn hold(&self, la: u64, ra: u64, len: u64) -> bool {
        let inside = |(b, e): (u64, u64), a: u64| a >= b && a <= e && len <= e - a;
        inside(self.local, la) && inside(self.remote, ra)
    }
}

/// Host memory of two engines of this process, copied where it is posted.
const HOST_DIRECT: SegKind = SegKind::Direct { ctx: None, dev: false };

/// The kind of a same-process host copy: pooled by CMA's copy threads, or copied where posted.
fn host_kind(pooled: bool) -> SegKind {
    if pooled { SegKind::Cma { pid: THIS_PROCESS } } else { HOST_DIRECT }
}

/// Host memory of two engines of this process, copied where it is posted (HOST_DIRECT) or
/// by the CMA pool (only HostPool makes that kind with THIS_PROCESS).
fn same_process_host(kind: &SegKind) -> bool {
    matches!(kind, SegKind::Direct { ctx: None, dev: false } | SegKind::Cma { pid: THIS_PROCESS })
}

/// Plans descriptors `span` of a request, read from `pairs`; the host pool's guess is
/// settled by the caller, who knows the whole request's bytes.
fn plan_part<'a>(inp: &Inputs, target: &Target, span: Span, mut pairs: impl Iterator<Item = Result<Pair<'a>>>, small: Small,
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

/// Appends `x` unless `v` holds the same already (a request's few registrations and keeps).
fn push_new<T>(v: &mut Vec<T>, x: T, same: impl Fn(&T, &T) -> bool) {
    if !v.iter().any(|y| same(y, &x)) {
        v.push(x);
    }
}

impl Pair<'_> {
    /// The registration pair a descriptor pair names.
    fn key(&self) -> (usize, usize) {
        (Arc::as_ptr(self.local.2) as usize, Arc::as_ptr(self.remote.2) as usize)
    }
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

/// A run of descriptors that name one registration pair.
struct Run {
    bounds: Bounds,
    key: (usize, usize),
}

impl Run {
    /// Checks the run's descriptors from `first` on (lengths equal, inside both
    /// registrations), hands each one with bytes to `seg` (its index, local and remote
    /// (address, length, registration), and whether a segment of this run came before it),
    /// and returns the first descriptor of the next run. `count.0` counts descriptors read,
    /// `count.1` their bytes.
    #[inline(always)]
    fn each<'a>(&self, pairs: &mut impl Iterator<Item = Result<Pair<'a>>>, first: Pair<'a>, count: (&mut usize, &mut u64),
                mut seg: impl FnMut(usize, (u64, u64, &'a Arc<LocalMem>), (u64, u64, &'a Arc<RemoteMem>), bool)) -> Result<Option<Pair<'a>>> {
        let (i, bytes) = count;
        let mut p = first;
        let mut join = false;
        loop {
            let (la, ll, lm) = p.local;
            let (ra, rl, rm) = p.remote;
            if ll != rl {
                return Err(Error::InvalidParam(format!("descriptor {i}: local length {ll} != remote length {rl}")));
            }
            if !self.bounds.hold(la, ra, ll) {
                // (The checks that say why run only for a refusal.)
                lm.check(la, ll, &format!("local descriptor {i}"))?;
                rm.check(ra, rl).map_err(|e| Error::InvalidParam(format!("descriptor {i}: {e}")))?;
            }
            if ll != 0 {
                *bytes += ll;
                // (Segments join only within one registration pair: a device copy must not
                // span two allocations that merely happen to be adjacent.)
                seg(*i, p.local, p.remote, join);
                join = true;
            }
            *i += 1;
            match pairs.next() {
                None => return Ok(None),
                Some(q) => {
                    let q = q?;
                    if q.key() != self.key {
                        return Ok(Some(q));
                    }
                    p = q;
                }
            }
        }
    }
}

/// How a request's RMA descriptors spread over the peer's route.
struct Spread<'r> {
    count: usize,
    small: bool,
    route: &'r [RoutePair],
}

/// Cuts descriptor `i` between registered memories into RMA segments. Descriptors below the
/// striping threshold go to the rails in contiguous runs (the first 1/n of them on one rail,
/// the next on the next, starting where the previous request left off): consecutive segments
/// on one rail ride in one RMA operation, and alternating rails per descriptor broke that
/// (H200 host, tcp, 4096 x 4 KiB WRITE: 1.37 GB/s on one rail, 0.55 on two). Larger ones
/// stripe over every rail.
fn rma_segs(inp: &Inputs, segs: &mut Vec<Seg>, spread: &Spread, i: usize, local: (u64, u64, &Arc<LocalMem>), remote: (u64, &MemDesc),
            join: bool) {
    let ((la, ll, lm), (ra, desc)) = (local, remote);
    let route = spread.route;
    let n = route.len();
    let pieces = if ll >= inp.cfg.striping_threshold.max(1) && n > 1 && !spread.small { n as u64 } else { 1 };
    let first = if spread.small || pieces > 1 { 0 } else { (inp.rr_base + i * n / spread.count) % n };
    let piece = ll.div_ceil(pieces).next_multiple_of(4096);
    let (mut off, mut j) = (0, 0);
    while off < ll {
        let hop = route[(first + j) % n];
        let (rail, rrail) = (hop.rail as usize, hop.rrail as usize);
        let virt = hop.virt.unwrap_or(desc.virt_addr);
        let max = inp.shapes[rail].max_msg;
        let pend = (off + piece).min(ll);
        while off < pend {
            let plen = (pend - off).min(max);
            let raddr = if virt { ra + off } else { ra - desc.base + off };
            push(segs, Seg { local: la + off, len: plen, raddr, rkey: desc.keys[rrail], desc: lm.descs[rail], rail: rail as u16, rrail: rrail as u16, kind: SegKind::Rma }, max, join);
            off += plen;
        }
        j += 1;
    }
}

/// Appends a segment, or (`join`: the previous descriptor named the same registrations)
/// extends the previous one when this one continues it on both sides on the same rail
/// (adjacent KV blocks), up to `max` bytes: later per-segment work (ops, copy ranges, kernel
/// parameters) then counts ranges, not descriptors.
fn push(segs: &mut Vec<Seg>, s: Seg, max: u64, join: bool) {
    if let (true, Some(last)) = (join, segs.last_mut()) {
        if last.local.wrapping_add(last.len) == s.local && last.raddr.wrapping_add(last.len) == s.raddr
            && last.rail == s.rail && last.rrail == s.rrail && last.len.saturating_add(s.len) <= max
            && last.kind.route() != Route::Staging {
            last.len += s.len;
            return;
        }
    }
    segs.push(s);
}

/// Checks one registration pair against the request's target and decides how its
/// descriptors move; what a same-host way keeps alive is added to `keeps` once.
fn resolve(inp: &Inputs, reach: &dyn Reach, target: &Target, mems: (&Arc<LocalMem>, &Arc<RemoteMem>), i: usize,
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
            let staged = lstaged.is_some() || desc.staged;
            if staged && !peer.info.packed_staging {
                // Its stage requests and ours would not parse at the other end: say so now
                // instead of letting every chunk wait for an answer until the timeout.
                return Err(Error::Mismatch(format!(
                    "agent '{peer_name}' runs an older nixl-fabric whose GPU staging format (1) is not ours ({}): descriptor {i} cannot be staged; update both sides",
                    super::wire::STAGE_FORMAT)));
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

/// Most descriptors a request that rail0_request or eager_write can pick has (64 KiB in
/// blocks of 256 B).
const RAIL0_MAX_DESCS: usize = 256;

/// What a request of few descriptors may take (decided from all of them before planning).
#[derive(Clone, Copy, Default)]
struct Small {
    /// It stays on rail 0 (rail0_request).
    rail0: bool,
    /// Its host-to-host writes go in a control message (eager_write).
    eager: bool,
}

impl Small {
    /// What a request of these few descriptors may take (their bytes summed once for both).
    fn of(inp: &Inputs, target: &Target, pairs: &[Pair]) -> Small {
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

/// The staging chunk being filled while a request is planned: its rail pair, bytes and
/// blocks so far, and what its blocks share (kind, context or key, remote key).
#[derive(Default)]
struct ChunkFill {
    hop: Option<RoutePair>,
    bytes: u64,
    blocks: u64,
    shared: (u8, usize, u64),
}

/// The rail pair of the next staging chunk: the pairs of `route` (the peer's bulk route) in
/// turn.
fn next_chunk_pair(inp: &Inputs, route: &[RoutePair]) -> RoutePair {
    route[inp.rr_chunks.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % route.len()]
}

/// Cuts a pair with staged device memory on either side into segments of packed staging
/// chunks: consecutive blocks fill one chunk (one rail pair) up to its bytes and block
/// count, a block that does not fit is cut at the chunk's end, and each new chunk takes the
/// next rail pair of the route, so a request's chunks go over every rail.
fn staged_segs(inp: &Inputs, segs: &mut Vec<Seg>, fill: &mut ChunkFill, local: (u64, u64, &Arc<LocalMem>), remote: (u64, &MemDesc),
               lstaged: Option<DeviceMem>, route: &[RoutePair]) {
    let (la, ll, lm) = local;
    let (ra, desc) = remote;
    let chunk = inp.cfg.staging_chunk(inp.shapes.first().map_or("", |s| s.provider.as_str())).max(1);
    let max_blocks = inp.cfg.staging_ranges.max(1);
    let mut off = 0;
    while off < ll {
        let shared = match lstaged {
            Some(d) => (if desc.staged { 2 } else { 1 }, d.ctx.id(), 0),
            None => (3, 0, lm.base),
        };
        let hop = match fill.hop {
            Some(h) if fill.bytes < chunk && fill.blocks < max_blocks && fill.shared == shared => h,
            _ => {
                let h = next_chunk_pair(inp, route);
                *fill = ChunkFill { hop: Some(h), bytes: 0, blocks: 0, shared };
                h
            }
        };
        let len = (chunk - fill.bytes).min(ll - off);
        let (rail, rrail) = (hop.rail as usize, hop.rrail as usize);
        let (kind, raddr, rkey) = match (lstaged, desc.staged) {
            (Some(d), false) => {
                let raddr = if hop.virt.unwrap_or(desc.virt_addr) { ra + off } else { ra - desc.base + off };
                (SegKind::DevToHost { ctx: d.ctx }, raddr, desc.keys[rrail])
            }
            (None, _) => {
                let self_addr = if inp.shapes[rail].virt_addr { la + off } else { la - lm.base + off };
                (SegKind::HostToDev { self_addr, self_key: lm.keys[rail] }, ra + off, 0)
            }
            (Some(d), true) => (SegKind::DevToDev { ctx: d.ctx }, ra + off, 0),
        };
        if fill.blocks > 0 && rkey != 0 && segs.last().is_some_and(|s| s.rkey != rkey) {
            // Another remote registration: a chunk's RMA names one key.
            fill.hop = None;
            continue;
        }
        segs.push(Seg { local: la + off, len, raddr, rkey, desc: lm.descs[rail], rail: rail as u16, rrail: rrail as u16, kind });
        fill.bytes += len;
        fill.blocks += 1;
        off += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::local_peers::PidFd;
    use crate::engine::registry::SharedCloseQueue;
    use crate::engine::wire::{ConnInfo, ProcessInfo, RailAddr};
    use std::sync::atomic::AtomicUsize;

    const ME: u64 = 0xabc;

    /// Answers nothing, except a same-process registration where one is given.
    struct Nothing(Option<Arc<LocalMem>>);

    impl Reach for Nothing {
        fn same_process(&self, _: &Peer, _: u64, _: u64, _: MemKind) -> Option<Arc<LocalMem>> {
            self.0.clone()
        }
        fn ipc_open(&self, _: &Peer, _: &IpcDesc, _: Option<cuda::Context>) -> Option<Arc<IpcEntry>> {
            None
        }
        fn peer_copy_refused(&self, _: u64) -> bool {
            false
        }
        fn pin(&self, _: &LocalMem, _: &cuda::Context) {}
    }

    fn shapes(n: usize) -> Vec<RailShape> {
        (0..n).map(|_| RailShape { max_msg: 1 << 20, virt_addr: true, provider: "tcp".into(), order_saw: false, nic_shared: true }).collect()
    }

    fn mem(engine: u64, base: u64, len: u64, rails: usize) -> Arc<LocalMem> {
        let q = SharedCloseQueue::default();
        Arc::new(LocalMem::new(engine, base, len, MemKind::Dram, 0, rails, Vec::new(), q, None, None))
    }

    fn peer(id: u64, rails: usize, local: Locality, cma: bool) -> Arc<Peer> {
        peer_of(id, rails, local, cma, false)
    }

    /// `peer`, of a build that takes eager writes or not.
    fn peer_of(id: u64, rails: usize, local: Locality, cma: bool, eager_write: bool) -> Arc<Peer> {
        let info = ConnInfo {
            engine_id: 7000 + id,
            host_id: [1; 16],
            agent: format!("p{id}"),
            rails: (0..rails).map(|_| RailAddr { provider: "tcp".into(), addr: vec![0] }).collect(),
            process: Some(ProcessInfo { pid: std::process::id(), token_addr: 0, token: [0; 16] }),
            rail0_saw: true,
            packed_staging: true,
            eager_write,
            lends: true,
        };
        let route = (0..rails).map(|i| RoutePair { rail: i as u16, rrail: i as u16, virt: None }).collect();
        Arc::new(Peer::new(id, &format!("p{id}"), info, Vec::new(), route, true, cma, local))
    }

    fn remote(p: &Arc<Peer>, base: u64, len: u64, rails: usize) -> Arc<RemoteMem> {
        let desc = MemDesc { mem_type: 0, virt_addr: true, staged: false, engine_id: p.info.engine_id, base, len, dev_id: 0, keys: (0..rails as u64).map(|k| 100 + k).collect(), ipc: None };
        Arc::new(RemoteMem::Peer { peer: p.clone(), desc, opened: Mutex::new(Vec::new()) })
    }

    /// Our host registration at 0x1000_0000 and a same-process peer's at 0x9000_0000 (its
    /// engine's registration, our view of it), both `len` bytes, and the peer as a target.
    fn same_process_pair(len: u64) -> (Arc<LocalMem>, Arc<LocalMem>, Arc<RemoteMem>, Target) {
        let sp = peer(2, 1, Locality::SameProcess(std::sync::Weak::new()), false);
        let r = remote(&sp, 0x9000_0000, len, 1);
        (mem(ME, 0x1000_0000, len, 1), mem(7002, 0x9000_0000, len, 1), r, Target::Peer(sp))
    }

    fn run(cfg: &Config, rails: usize, target: &Target, pairs: &[Pair], reach: &dyn Reach) -> Result<Plan> {
        run_on(1, cfg, rails, target, pairs, reach)
    }

    /// `run` with up to `threads` planning threads.
    fn run_on(threads: usize, cfg: &Config, rails: usize, target: &Target, pairs: &[Pair], reach: &dyn Reach) -> Result<Plan> {
        let sh = shapes(rails);
        let rr = AtomicUsize::new(0);
        plan(&Inputs { engine_id: ME, op: Op::Write, cfg, shapes: &sh, rr_base: 0, rr_chunks: &rr, timed: false, plan_threads: threads }, target, pairs, reach)
    }

    #[test]
    fn large_descriptors_stripe_over_every_rail_and_small_ones_run_contiguously() {
        let mut cfg = Config::defaults();
        cfg.striping_threshold = 1 << 20;
        let p = peer(1, 2, Locality::Remote, false);
        let l = mem(ME, 0x10_0000, 64 << 20, 2);
        let r = remote(&p, 0x900_0000, 64 << 20, 2);
        let big = [Pair { local: (0x10_0000, 4 << 20, &l), remote: (0x900_0000, 4 << 20, &r) }];
        let plan = run(&cfg, 2, &Target::Peer(p.clone()), &big, &Nothing(None)).unwrap();
        // 4 MiB over two rails: 2 MiB each, cut at the 1 MiB message limit.
        assert_eq!(plan.segs.len(), 4);
        assert_eq!(plan.segs.iter().map(|s| s.rail).collect::<Vec<_>>(), vec![0, 0, 1, 1]);
        assert_eq!(plan.segs.iter().map(|s| s.len).sum::<u64>(), 4 << 20);
        assert!(plan.segs.iter().all(|s| matches!(s.kind, SegKind::Rma) && s.rkey == 100 + s.rrail as u64));
        assert_eq!(plan.segs[2].local, 0x10_0000 + (2 << 20));
        assert_eq!(plan.segs[2].raddr, 0x900_0000 + (2 << 20));
        // Reversed on the remote side, so that no two descriptors continue each other.
        let small: Vec<Pair> = (0..8u64).map(|i| Pair { local: (0x10_0000 + i * 4096, 4096, &l), remote: (0x900_0000 + (7 - i) * 4096, 4096, &r) }).collect();
        let plan = run(&cfg, 2, &Target::Peer(p), &small, &Nothing(None)).unwrap();
        assert_eq!(plan.segs.iter().map(|s| s.rail).collect::<Vec<_>>(), vec![0, 0, 0, 0, 1, 1, 1, 1]);
    }

    #[test]
    fn rma_rail0_off_keeps_bulk_data_off_the_control_pair_but_not_small_requests() {
        let mut cfg = Config::defaults();
        cfg.striping_threshold = 1 << 20;
        cfg.rma_rail0 = false;
        let p = peer(1, 3, Locality::Remote, false);
        let l = mem(ME, 0x10_0000, 64 << 20, 3);
        let r = remote(&p, 0x900_0000, 64 << 20, 3);
        let big = [Pair { local: (0x10_0000, 4 << 20, &l), remote: (0x900_0000, 4 << 20, &r) }];
        let plan = run(&cfg, 3, &Target::Peer(p.clone()), &big, &Nothing(None)).unwrap();
        assert_eq!(plan.segs.iter().map(|s| (s.rail, s.rrail)).collect::<Vec<_>>(), vec![(1, 1), (1, 1), (2, 2), (2, 2)]);
        assert!(plan.segs.iter().all(|s| s.rkey == 100 + s.rrail as u64));
        // Runs of small descriptors take the two bulk pairs in turn too.
        let many: Vec<Pair> = (0..64u64).map(|i| Pair { local: (0x10_0000 + i * 8192, 4096, &l), remote: (0x900_0000 + (63 - i) * 8192, 4096, &r) }).collect();
        let plan = run(&cfg, 3, &Target::Peer(p.clone()), &many, &Nothing(None)).unwrap();
        assert!(plan.segs.iter().all(|s| s.rail != 0 && s.rrail != 0));
        assert!(plan.segs.iter().any(|s| s.rail == 1) && plan.segs.iter().any(|s| s.rail == 2));
        // Rails on interfaces of their own (verbs, efa, an iface list): rail 0's interface
        // would idle, so every rail carries data.
        let mut own = shapes(3);
        own.iter_mut().for_each(|s| s.nic_shared = false);
        let rr = AtomicUsize::new(0);
        let plan = super::plan(&Inputs { engine_id: ME, op: Op::Write, cfg: &cfg, shapes: &own, rr_base: 0, rr_chunks: &rr, timed: false, plan_threads: 1 }, &Target::Peer(p.clone()), &big[..], &Nothing(None)).unwrap();
        assert!(plan.segs.iter().any(|s| s.rail == 0) && plan.segs.iter().any(|s| s.rail == 2));
        // Two rails: one pair off rail 0 would halve the bandwidth, so both carry data.
        let p2 = peer(2, 2, Locality::Remote, false);
        let r2 = remote(&p2, 0x900_0000, 64 << 20, 2);
        let big2 = [Pair { local: (0x10_0000, 4 << 20, &l), remote: (0x900_0000, 4 << 20, &r2) }];
        let plan = run(&cfg, 2, &Target::Peer(p2), &big2, &Nothing(None)).unwrap();
        assert_eq!(plan.segs.iter().map(|s| s.rail).collect::<Vec<_>>(), vec![0, 0, 1, 1]);
    }

    #[test]
    fn adjacent_blocks_of_one_registration_pair_join_into_one_range_per_rail() {
        let mut cfg = Config::defaults();
        cfg.striping_threshold = 1 << 20;
        let p = peer(1, 1, Locality::Remote, false);
        let p2 = peer(2, 2, Locality::Remote, false);
        let l = mem(ME, 0x10_0000, 64 << 20, 2);
        let r = remote(&p, 0x900_0000, 64 << 20, 1);
        let rr = remote(&p2, 0x900_0000, 64 << 20, 2);
        // 8 adjacent blocks, then a gap on the remote side, then 2 more adjacent ones.
        let mut pairs: Vec<Pair> = (0..8u64).map(|i| Pair { local: (0x10_0000 + i * 4096, 4096, &l), remote: (0x900_0000 + i * 4096, 4096, &r) }).collect();
        pairs.extend((8..10u64).map(|i| Pair { local: (0x10_0000 + i * 4096, 4096, &l), remote: (0x900_0000 + (i + 1) * 4096, 4096, &r) }));
        let plan = run(&cfg, 1, &Target::Peer(p.clone()), &pairs, &Nothing(None)).unwrap();
        assert_eq!(plan.segs.iter().map(|s| (s.local, s.len, s.raddr)).collect::<Vec<_>>(),
                   vec![(0x10_0000, 8 * 4096, 0x900_0000), (0x10_0000 + 8 * 4096, 2 * 4096, 0x900_0000 + 9 * 4096)]);
        // Over two rails each rail's run is one range; never past the provider's message limit.
        let two: Vec<Pair> = (0..8u64).map(|i| Pair { local: (0x10_0000 + i * 4096, 4096, &l), remote: (0x900_0000 + i * 4096, 4096, &rr) }).collect();
        let plan = run(&cfg, 2, &Target::Peer(p2), &two, &Nothing(None)).unwrap();
        assert_eq!(plan.segs.iter().map(|s| (s.rail, s.len)).collect::<Vec<_>>(), vec![(0, 4 * 4096), (1, 4 * 4096)]);
        let many: Vec<Pair> = (0..512u64).map(|i| Pair { local: (0x10_0000 + i * 4096, 4096, &l), remote: (0x900_0000 + i * 4096, 4096, &r) }).collect();
        let plan = run(&cfg, 1, &Target::Peer(p.clone()), &many, &Nothing(None)).unwrap();
        assert_eq!(plan.segs.iter().map(|s| s.len).collect::<Vec<_>>(), vec![1 << 20, 1 << 20], "cut at max_msg (1 MiB here)");
        // Two registrations that happen to be adjacent stay two ranges.
        let l2 = mem(ME, 0x10_0000 + (64 << 20), 1 << 20, 2);
        let r2 = remote(&p, 0x900_0000 + (64 << 20), 1 << 20, 1);
        let edge = [Pair { local: (0x10_0000 + (64 << 20) - 4096, 4096, &l), remote: (0x900_0000 + (64 << 20) - 4096, 4096, &r) },
                    Pair { local: (0x10_0000 + (64 << 20), 4096, &l2), remote: (0x900_0000 + (64 << 20), 4096, &r2) }];
        assert_eq!(run(&cfg, 1, &Target::Peer(p.clone()), &edge, &Nothing(None)).unwrap().segs.len(), 2);
        // ... also where an empty descriptor of the second pair comes between them.
        let empty = Pair { local: (0x10_0000 + (64 << 20), 0, &l2), remote: (0x900_0000 + (64 << 20), 0, &r2) };
        let gap = [edge[0], empty, edge[1]];
        assert_eq!(run(&cfg, 1, &Target::Peer(p), &gap, &Nothing(None)).unwrap().segs.len(), 2);
    }

    #[test]
    fn small_host_writes_to_a_peer_that_takes_puts_go_in_a_control_message() {
        let cfg = Config::defaults();
        let p = peer_of(1, 2, Locality::Remote, false, true);
        let old = peer(2, 2, Locality::Remote, false);
        let l = mem(ME, 0x10_0000, 1 << 20, 2);
        let (r, r_old) = (remote(&p, 0x900_0000, 1 << 20, 2), remote(&old, 0x900_0000, 1 << 20, 2));
        // n blocks of bs bytes, landing in reverse order (no two join).
        let plan_of = |op: Op, target: &Arc<Peer>, r: &Arc<RemoteMem>, n: u64, bs: u64| {
            let ps: Vec<Pair> = (0..n).map(|i| Pair { local: (0x10_0000 + i * bs, bs, &l), remote: (0x900_0000 + (n - i) * bs, bs, r) }).collect();
            let sh = shapes(2);
            let rr = AtomicUsize::new(0);
            plan(&Inputs { engine_id: ME, op, cfg: &cfg, shapes: &sh, rr_base: 0, rr_chunks: &rr, timed: false, plan_threads: 1 }, &Target::Peer(target.clone()), &ps[..], &Nothing(None)).unwrap()
        };
        let kinds = |pl: &Plan| pl.segs.iter().map(|s| s.kind.route()).collect::<Vec<_>>();
        // Two 4 KiB blocks: Puts naming the peer's address and its rail-0 key.
        let pl = plan_of(Op::Write, &p, &r, 2, 4096);
        assert_eq!(kinds(&pl), vec![Route::Eager, Route::Eager]);
        assert_eq!(pl.segs.iter().map(|s| (s.raddr, s.rkey)).collect::<Vec<_>>(), vec![(0x900_0000 + 2 * 4096, 100), (0x900_0000 + 4096, 100)]);
        assert!(pl.sum.on_rails, "the peer's progress matters: it is kicked");
        // Past eager_write_bytes, a READ, or a peer of an older build: RMA.
        assert!(kinds(&plan_of(Op::Write, &p, &r, 3, 4096)).iter().all(|k| *k == Route::Rma));
        assert!(kinds(&plan_of(Op::Read, &p, &r, 2, 4096)).iter().all(|k| *k == Route::Rma));
        assert!(kinds(&plan_of(Op::Write, &old, &r_old, 2, 4096)).iter().all(|k| *k == Route::Rma));
    }

    #[test]
    fn small_requests_stay_on_rail_0_where_it_orders_a_notification_behind_data() {
        // Bulk requests take every rail here (the rule's other half is below).
        let mut cfg = Config::defaults();
        cfg.rma_rail0 = true;
        let p = peer(1, 4, Locality::Remote, false);
        let l = mem(ME, 0x10_0000, 64 << 20, 4);
        let r = remote(&p, 0x900_0000, 64 << 20, 4);
        let blocks = |n: u64, len: u64| -> Vec<Pair> { (0..n).map(|i| Pair { local: (0x10_0000 + i * len, len, &l), remote: (0x900_0000 + i * len, len, &r) }).collect() };
        let rails_of = |plan: &Plan| plan.segs.iter().map(|s| (s.rail, s.rrail)).collect::<Vec<_>>();
        let plan_at = |sh: &[RailShape], rr: usize, pairs: &[Pair]| {
            let chunks = AtomicUsize::new(0);
            plan(&Inputs { engine_id: ME, op: Op::Write, cfg: &cfg, shapes: sh, rr_base: rr, rr_chunks: &chunks, timed: false, plan_threads: 1 }, &Target::Peer(p.clone()), pairs, &Nothing(None)).unwrap()
        };
        let mut ordered = shapes(4);
        ordered[0].order_saw = true;
        // 4 KiB and 16 x 4 KiB (64 KiB, notif_rail0_bytes) whatever the round-robin turn.
        for rr in 0..4 {
            assert_eq!(rails_of(&plan_at(&ordered, rr, &blocks(1, 4096))), vec![(0, 0)], "turn {rr}");
            assert!(rails_of(&plan_at(&ordered, rr, &blocks(16, 4096))).iter().all(|&x| x == (0, 0)), "turn {rr}");
        }
        // One byte more, or rail 0 without the order, or the key at 0: round-robin.
        assert_eq!(rails_of(&plan_at(&ordered, 1, &blocks(1, (64 << 10) + 1))), vec![(1, 1)]);
        assert_eq!(rails_of(&plan_at(&shapes(4), 1, &blocks(1, 4096))), vec![(1, 1)]);
        let mut off = cfg.clone();
        off.notif_rail0_bytes = 0;
        let chunks = AtomicUsize::new(0);
        let plan = plan(&Inputs { engine_id: ME, op: Op::Write, cfg: &off, shapes: &ordered, rr_base: 2, rr_chunks: &chunks, timed: false, plan_threads: 1 }, &Target::Peer(p.clone()), &blocks(1, 4096)[..], &Nothing(None)).unwrap();
        assert_eq!(rails_of(&plan), vec![(2, 2)]);
        // rma_rail0 off: the small ones still stay on rail 0; the larger ones skip it.
        let mut bulk_off = cfg.clone();
        bulk_off.rma_rail0 = false;
        for rr in 0..4 {
            let at = |pairs: &[Pair]| {
                let chunks = AtomicUsize::new(0);
                rails_of(&super::plan(&Inputs { engine_id: ME, op: Op::Write, cfg: &bulk_off, shapes: &ordered, rr_base: rr, rr_chunks: &chunks, timed: false, plan_threads: 1 }, &Target::Peer(p.clone()), pairs, &Nothing(None)).unwrap())
            };
            assert_eq!(at(&blocks(1, 4096)), vec![(0, 0)], "turn {rr}");
            assert!(at(&blocks(32, 4096)).iter().all(|&(a, b)| a != 0 && b != 0), "turn {rr}");
        }
    }

    #[test]
    fn provider_registered_device_memory_marks_the_plan_one_segment_per_operation() {
        let cfg = Config::defaults();
        let p = peer(1, 2, Locality::Remote, false);
        let r = remote(&p, 0x900_0000, 8 << 20, 2);
        // SAFETY: a dangling handle that no CUDA call sees in this test.
        let ctx = unsafe { cuda::Context::from_raw(0x1000 as *mut std::ffi::c_void) }.unwrap();
        let dev = crate::engine::gpu::DeviceMem { ctx, ordinal: 0, staged: false, managed: false };
        let q = SharedCloseQueue::default();
        let vram = Arc::new(LocalMem::new(ME, 0x10_0000, 8 << 20, MemKind::Vram, 0, 2, Vec::new(), q.clone(), Some(dev), None));
        let dram = Arc::new(LocalMem::new(ME, 0x10_0000, 8 << 20, MemKind::Dram, 0, 2, Vec::new(), q, None, None));
        for (l, device) in [(&vram, true), (&dram, false)] {
            let pairs: Vec<Pair> = (0..4).map(|i| Pair { local: (0x10_0000 + i * 8192, 4096, l), remote: (0x900_0000 + i * 8192, 4096, &r) }).collect();
            let plan = run(&cfg, 2, &Target::Peer(p.clone()), &pairs, &Nothing(None)).unwrap();
            assert!(plan.segs.iter().all(|s| matches!(s.kind, SegKind::Rma)));
            assert_eq!(plan.sum.device_rma, device, "device memory {device}");
        }
    }

    #[test]
    fn staged_device_memory_is_cut_into_chunks_over_the_route() {
        let mut cfg = Config::defaults();
        cfg.staging_chunk_size = 1 << 20;
        let p = peer(1, 2, Locality::Remote, false);
        let r = remote(&p, 0x900_0000, 8 << 20, 2);
        let q = SharedCloseQueue::default();
        // A context value the scheduler only carries along (never used here).
        // SAFETY: a dangling handle that no CUDA call sees in this test.
        let ctx = unsafe { cuda::Context::from_raw(0x1000 as *mut std::ffi::c_void) }.unwrap();
        let dev = crate::engine::gpu::DeviceMem { ctx, ordinal: 0, staged: true, managed: false };
        let l = Arc::new(LocalMem::new(ME, 0x10_0000, 8 << 20, MemKind::Vram, 0, 2, Vec::new(), q, Some(dev), None));
        let pairs = [Pair { local: (0x10_0000, 3 << 20, &l), remote: (0x900_0000, 3 << 20, &r) }];
        let mut on = cfg.clone();
        on.staging_rail0 = true;
        let plan = run(&on, 2, &Target::Peer(p.clone()), &pairs, &Nothing(None)).unwrap();
        assert_eq!(plan.segs.len(), 3);
        assert!(plan.segs.iter().all(|s| matches!(s.kind, SegKind::DevToHost { .. }) && s.len == 1 << 20));
        assert_eq!(plan.segs.iter().map(|s| s.rail).collect::<Vec<_>>(), vec![0, 1, 0], "chunks round-robin over the rail pairs");
        // staging_rail0 off: rail 0 keeps only control traffic where another pair exists.
        let mut off = cfg.clone();
        off.staging_rail0 = false;
        let p3 = peer(1, 3, Locality::Remote, false);
        let r3 = remote(&p3, 0x900_0000, 8 << 20, 3);
        let l3 = Arc::new(LocalMem::new(ME, 0x10_0000, 8 << 20, MemKind::Vram, 0, 3, Vec::new(), SharedCloseQueue::default(), Some(dev), None));
        let pairs3 = [Pair { local: (0x10_0000, 4 << 20, &l3), remote: (0x900_0000, 4 << 20, &r3) }];
        let plan = run(&off, 3, &Target::Peer(p3), &pairs3, &Nothing(None)).unwrap();
        assert_eq!(plan.segs.iter().map(|s| (s.rail, s.rrail)).collect::<Vec<_>>(), vec![(1, 1), (2, 2), (1, 1), (2, 2)]);
        let plan = run(&off, 2, &Target::Peer(p.clone()), &pairs, &Nothing(None)).unwrap();
        assert_eq!(plan.segs.iter().map(|s| s.rail).collect::<Vec<_>>(), vec![0, 1, 0], "two rails: rail 0 carries chunks too");
        // A peer of a build before packed staging reads none of our stage requests: refused
        // at once with the reason, not left to time out chunk by chunk.
        let mut info = p.info.clone();
        info.packed_staging = false;
        let old = Arc::new(Peer::new(1, "p1", info, Vec::new(), p.route.clone(), false, false, Locality::Remote));
        let r = remote(&old, 0x900_0000, 8 << 20, 2);
        let pairs = [Pair { local: (0x10_0000, 3 << 20, &l), remote: (0x900_0000, 3 << 20, &r) }];
        match run(&cfg, 2, &Target::Peer(old), &pairs, &Nothing(None)) {
            Err(Error::Mismatch(m)) => assert!(m.contains("older nixl-fabric"), "{m}"),
            other => panic!("expected a mismatch, got {:?}", other.map(|p| p.segs.len())),
        }
    }

    #[test]
    fn loopback_same_process_and_cma_routes() {
        let cfg = Config::defaults();
        let l = mem(ME, 0x10_0000, 16 << 20, 1);
        let own = Arc::new(RemoteMem::Local(mem(ME, 0x800_0000, 16 << 20, 1)));
        let pairs = [Pair { local: (0x10_0000, 4096, &l), remote: (0x800_0000, 4096, &own) }];
        let plan = run(&cfg, 1, &Target::Local, &pairs, &Nothing(None)).unwrap();
        assert!(matches!(plan.segs[0].kind, SegKind::Loopback { local: None, remote: None }));
        // An engine of this process: small host copies are direct, a large request goes
        // to the copy threads.
        let sp = peer(2, 1, Locality::SameProcess(std::sync::Weak::new()), false);
        let theirs = mem(7002, 0x900_0000, 16 << 20, 1);
        let r = remote(&sp, 0x900_0000, 16 << 20, 1);
        let small = [Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000, 4096, &r) }];
        let plan = run(&cfg, 1, &Target::Peer(sp.clone()), &small, &Nothing(Some(theirs.clone()))).unwrap();
        assert!(matches!(plan.segs[0].kind, SegKind::Direct { ctx: None, dev: false }));
        assert_eq!(plan.keeps.len(), 1);
        let large = [Pair { local: (0x10_0000, 4 << 20, &l), remote: (0x900_0000, 4 << 20, &r) }];
        let plan = run(&cfg, 1, &Target::Peer(sp), &large, &Nothing(Some(theirs))).unwrap();
        assert!(matches!(plan.segs[0].kind, SegKind::Cma { pid: THIS_PROCESS }));
        // A process of this host reachable by CMA, watched by its pidfd.
        let hp = peer(3, 1, Locality::SameHost(PidFd::open(std::process::id())), true);
        let r = remote(&hp, 0x900_0000, 16 << 20, 1);
        let pairs = [Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000, 4096, &r) }];
        let plan = run(&cfg, 1, &Target::Peer(hp), &pairs, &Nothing(None)).unwrap();
        assert!(matches!(plan.segs[0].kind, SegKind::Cma { pid } if pid == std::process::id()));
    }

    #[test]
    fn same_process_host_copies_pool_by_the_request_total_whatever_the_first_block_guessed() {
        let cfg = Config::defaults();
        let (l, theirs, r, t) = same_process_pair(64 << 20);
        // (offset, length) per descriptor, both sides at the same offsets, 512 of them
        let plan_of = |lens: &dyn Fn(u64) -> u64| {
            let mut off = 0;
            let pairs: Vec<Pair> = (0..512).map(|i| {
                let n = lens(i);
                let p = Pair { local: (0x1000_0000 + off, n, &l), remote: (0x9000_0000 + off, n, &r) };
                off += n + 64; // gaps: no two blocks join
                p
            }).collect();
            run(&cfg, 1, &t, &pairs, &Nothing(Some(theirs.clone()))).unwrap()
        };
        let pooled = |p: &Plan| p.segs.iter().all(|s| matches!(s.kind, SegKind::Cma { pid: THIS_PROCESS }));
        let direct = |p: &Plan| p.segs.iter().all(|s| matches!(s.kind, SegKind::Direct { ctx: None, dev: false }));
        // Right guesses: 512 x 8 KiB (4 MiB) pooled, 512 x 1 KiB (512 KiB) copied where posted.
        assert!(pooled(&plan_of(&|_| 8192)));
        assert!(direct(&plan_of(&|_| 1024)));
        // Wrong guesses, corrected: a small first block before large ones, a large first one
        // before small ones.
        let p = plan_of(&|i| if i == 0 { 16 } else { 8192 });
        assert!(pooled(&p) && p.sum.bytes == 16 + 511 * 8192);
        let p = plan_of(&|i| if i == 0 { 8192 } else { 16 });
        assert!(direct(&p) && p.sum.bytes == 8192 + 511 * 16);
        assert!(p.sum.local_copies && !p.sum.on_rails);
        // A peer over the rails: the summary says so.
        let rp = peer(3, 1, Locality::Remote, false);
        let rr = remote(&rp, 0x9000_0000, 64 << 20, 1);
        let pairs = [Pair { local: (0x1000_0000, 4096, &l), remote: (0x9000_0000, 4096, &rr) }];
        let p = run(&cfg, 1, &Target::Peer(rp), &pairs, &Nothing(None)).unwrap();
        assert!(p.sum.on_rails && !p.sum.local_copies && p.sum.bytes == 4096);
    }

    #[test]
    fn a_long_request_planned_in_parts_is_the_plan_of_one_thread() {
        let cfg = Config::defaults();
        let n = 40_000u64;
        let p = peer(1, 2, Locality::Remote, false);
        let ls = [mem(ME, 0x1000_0000, 256 << 20, 2), mem(ME, 0x2000_0000, 256 << 20, 2)];
        let rs = [remote(&p, 0x9000_0000, 256 << 20, 2), remote(&p, 0xa000_0000, 256 << 20, 2)];
        // Runs of 3000 descriptors over the registration pairs in turn; remote blocks in a
        // fixed shuffled order, so that none join and both plans must be equal segment by
        // segment.
        let pairs: Vec<Pair> = (0..n).map(|i| {
            let (l, r) = (&ls[(i / 3000 % 2) as usize], &rs[(i / 7000 % 2) as usize]);
            Pair { local: (l.base + i * 4096, 4096, l), remote: (r.range().0 + (i * 7919 % n) * 4096, 4096, r) }
        }).collect();
        let t = Target::Peer(p.clone());
        let one = run_on(1, &cfg, 2, &t, &pairs, &Nothing(None)).unwrap();
        let four = run_on(4, &cfg, 2, &t, &pairs, &Nothing(None)).unwrap();
        let key = |pl: &Plan| pl.segs.iter().map(|s| (s.local, s.len, s.raddr, s.rkey, s.rail, s.rrail)).collect::<Vec<_>>();
        assert_eq!(one.segs.len(), n as usize);
        assert_eq!(key(&one), key(&four));
        assert_eq!((one.sum.bytes, one.sum.on_rails, one.sum.local_copies), (four.sum.bytes, four.sum.on_rails, four.sum.local_copies));
        assert_eq!((four.locals.len(), four.remotes.len()), (2, 2), "each registration held once");
        assert_eq!((one.parts, four.parts), (1, 4));
        assert!(four.ways >= one.ways);
        // A bad descriptor is named by its place in the whole list, in the first part and in
        // a later one (the first failing part names the error).
        for at in [3, 35_001] {
            let mut bad = pairs.clone();
            bad[at].local.1 = 8192;
            let e = run_on(4, &cfg, 2, &t, &bad, &Nothing(None)).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(&format!("descriptor {at}:")), "{e}");
        }
        let mut bad = pairs.clone();
        bad[39_000].local.1 = 8192;
        bad[16_000].local.1 = 8192;
        let e = run_on(4, &cfg, 2, &t, &bad, &Nothing(None)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("descriptor 16000:"), "{e}");
        // Adjacent blocks join within a part, not across its edge.
        let adj: Vec<Pair> = (0..32_768u64).map(|i| Pair { local: (0x1000_0000 + i * 4096, 4096, &ls[0]), remote: (0x9000_0000 + i * 4096, 4096, &rs[0]) }).collect();
        let one = run_on(1, &cfg, 2, &t, &adj, &Nothing(None)).unwrap();
        let four = run_on(4, &cfg, 2, &t, &adj, &Nothing(None)).unwrap();
        assert_eq!(four.sum.bytes, 32_768 * 4096);
        assert!(four.segs.len() >= one.segs.len() && four.segs.len() <= one.segs.len() + 3, "{} vs {}", four.segs.len(), one.segs.len());
        assert_eq!(four.segs.iter().map(|s| s.len).sum::<u64>(), 32_768 * 4096);
    }

    #[test]
    fn parts_settle_same_process_host_copies_by_the_whole_request() {
        let cfg = Config::defaults();
        let (l, theirs, r, t) = same_process_pair(512 << 20);
        // Each part's first block guesses small (16 B x count < 2 MiB would stay direct), the
        // whole request is 32768 x ~8 KiB: every part's copies go to the pool.
        let mut off = 0;
        let pairs: Vec<Pair> = (0..32_768u64).map(|i| {
            let len = if i % 8192 == 0 { 16 } else { 8192 };
            let p = Pair { local: (0x1000_0000 + off, len, &l), remote: (0x9000_0000 + off, len, &r) };
            off += len + 64;
            p
        }).collect();
        let four = run_on(4, &cfg, 1, &t, &pairs, &Nothing(Some(theirs.clone()))).unwrap();
        assert!(four.segs.iter().all(|s| matches!(s.kind, SegKind::Cma { pid: THIS_PROCESS })));
        assert_eq!(four.keeps.len(), 1, "the peer's registration kept once");
        assert!(four.sum.local_copies && !four.sum.on_rails);
    }

    #[test]
    fn bad_descriptors_are_refused_with_what_is_wrong() {
        let cfg = Config::defaults();
        let p = peer(1, 1, Locality::Remote, false);
        let other = peer(2, 1, Locality::Remote, false);
        let l = mem(ME, 0x10_0000, 1 << 20, 1);
        let foreign = mem(ME + 1, 0x10_0000, 1 << 20, 1);
        let r = remote(&p, 0x900_0000, 1 << 20, 1);
        let r2 = remote(&other, 0x900_0000, 1 << 20, 1);
        let t = Target::Peer(p.clone());
        let err = |pairs: &[Pair], t: &Target| run(&cfg, 1, t, pairs, &Nothing(None)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(&[], &t).contains("no descriptors"));
        assert!(err(&[Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000, 8192, &r) }], &t).contains("length"));
        assert!(err(&[Pair { local: (0x10_0000 + (1 << 20), 1, &l), remote: (0x900_0000, 1, &r) }], &t).contains("outside"));
        assert!(err(&[Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000 + (1 << 20) - 1, 4096, &r) }], &t).contains("outside"));
        assert!(err(&[Pair { local: (0x10_0000, 4096, &foreign), remote: (0x900_0000, 4096, &r) }], &t).contains("another engine"));
        assert!(err(&[Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000, 4096, &r2) }], &t).contains("belongs to agent 'p2'"));
        assert!(err(&[Pair { local: (0x10_0000, 4096, &l), remote: (0x900_0000, 4096, &r) }], &Target::Local).contains("loopback"));
    }
}
