//! What a request is planned from (its descriptor pairs, the rails' shapes, what same-host
//! memory is reachable) and what planning gives back.
use crate::config::Config;
use crate::cuda;
use crate::engine::ipc_cache::{IpcEntry, Keep};
use crate::engine::peer::Peer;
use crate::engine::registry::{LocalMem, MemKind};
use crate::engine::remote::RemoteMem;
use crate::engine::request::{Op, Seg, SegSummary};
use crate::engine::wire::IpcDesc;
use crate::error::Result;
use std::sync::Arc;

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
    /// RMA between our host memory and a peer's FI_HMEM device memory bounces through the
    /// provider's host buffers (RailCaps::hmem_host_bounce): the owner had better post it.
    pub hmem_host_bounce: bool,
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
#[derive(Clone, Copy)]
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
    /// Bytes of a staging chunk for this plan (balance.rs evens a request's chunks out over
    /// the rails with it); 0 = the configured size.
    pub staged_chunk: u64,
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

/// Appends `x` unless `v` holds the same already (a request's few registrations and keeps).
pub(super) fn push_new<T>(v: &mut Vec<T>, x: T, same: impl Fn(&T, &T) -> bool) {
    if !v.iter().any(|y| same(y, &x)) {
        v.push(x);
    }
}

impl Pair<'_> {
    /// The registration pair a descriptor pair names.
    pub(super) fn key(&self) -> (usize, usize) {
        (Arc::as_ptr(self.local.2) as usize, Arc::as_ptr(self.remote.2) as usize)
    }
}

impl Inputs<'_> {
    /// Bytes of one staging chunk in this plan.
    pub(super) fn chunk(&self) -> u64 {
        match self.staged_chunk {
            0 => self.cfg.staging_chunk(self.shapes.first().map_or("", |s| s.provider.as_str())),
            c => c,
        }
    }
}
