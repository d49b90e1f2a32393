//! Transfer requests: descriptor pairs turned into rail segments once at preparation, then
//! posted any number of times. The status is an atomic the caller polls; everything the
//! driver tracks while a post is in flight sits in `ReqState`.
use super::peer::Peer;
use super::registry::{LocalMem, RemoteMem};
use crate::error::{Error, Status};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

/// One RMA operation: `len` bytes between local `local` and remote `raddr` (virtual
/// address or offset, as the peer's descriptor says), on local rail `rail` toward remote
/// rail `rrail`. For loopback requests `raddr` is our own address and no rail is used.
#[derive(Clone, Copy, Debug)]
pub struct Seg {
    pub local: u64,
    pub len: u64,
    pub raddr: u64,
    pub rkey: u64,
    pub desc: usize,
    pub rail: u16,
    pub rrail: u16,
    pub kind: SegKind,
}

/// How a segment's bytes move (DESIGN, "GPU memory without FI_HMEM").
#[derive(Clone, Copy, Debug)]
pub enum SegKind {
    /// Plain RMA between registered memories (host, or device with FI_HMEM).
    Rma,
    /// Our staged device memory <-> the peer's RMA-reachable memory, through one of our
    /// bounce slots (device copy under `ctx`, then RMA; or RMA, then device copy).
    DevToHost { ctx: crate::cuda::Context },
    /// Our host memory <-> the peer's staged device memory: the peer pulls or pushes;
    /// `self_addr`/`self_key` address our memory as the peer's RMA must name it.
    HostToDev { self_addr: u64, self_key: u64 },
    /// Staged device memory on both sides: our bounce slot, and the peer pulls or pushes it.
    DevToDev { ctx: crate::cuda::Context },
    /// Loopback where either side is device memory (copy through the CUDA driver).
    LocalDev { local: Option<super::gpu::DeviceMem>, remote: Option<super::gpu::DeviceMem> },
    /// A same-host peer's memory addressable here (`raddr` is an address of this process):
    /// one copy by the initiator, on the GPU under `ctx`, or memcpy where both sides are
    /// host memory (module direct). `dev`: both ends are device memory, so a kernel may
    /// copy it.
    Direct { ctx: Option<crate::cuda::Context>, dev: bool },
    /// Our GPU memory <-> a same-host peer's host memory: the peer opens our allocation
    /// (starting at `alloc`, exported in the request's keeps) by IPC and copies.
    PeerCopy { alloc: u64 },
    /// A same-host peer process's host memory, reachable by cross-memory attach: copied by
    /// process_vm_writev/readv toward process `pid` (module cma_copy).
    Cma { pid: u32 },
}

pub enum Target {
    Peer(Arc<Peer>),
    /// Loopback: the request's remote side is our own memory.
    Local,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Idle,
    /// RMA operations are being posted or are outstanding.
    Data,
    /// All data is delivered; the notification is being sent.
    Notif,
    Done,
}

/// Driver-side state of the current post.
pub struct ReqState {
    /// Bumped on every post; completions of an older post are only counted as drained.
    pub epoch: u64,
    /// Next segment to post.
    pub next: usize,
    /// Operations of the current epoch not yet completed.
    pub outstanding: usize,
    /// Operations of any epoch still owned by the provider.
    pub inflight_total: usize,
    pub notif: Option<Vec<u8>>,
    pub error: Option<Error>,
    pub last_progress: Instant,
    pub phase: Phase,
    pub cancelled: bool,
    /// Rails this post wrote on without delivery-complete (bit per rail): each gets a
    /// flush read before the data counts as delivered.
    pub unflushed: u64,
    /// The flush reads are out (or were not needed).
    pub flushing: bool,
    /// Batches of this request's host copies still running on the copy threads (any
    /// epoch): they write into registered memory with no provider in between, so a
    /// release or repost waits for them even when the peer is gone.
    pub local_copies: usize,
}

pub struct Request {
    pub op: Op,
    pub target: Target,
    pub segs: Box<[Seg]>,
    pub bytes: u64,
    status: AtomicI32,
    st: Mutex<ReqState>,
    _local: Vec<Arc<LocalMem>>,
    _remote: Vec<Arc<RemoteMem>>,
    /// Peers' memory the direct segments use (IPC mappings, same-process registrations).
    pub keeps: Vec<super::direct::Keep>,
}

impl Request {
    pub fn new(op: Op, target: Target, segs: Vec<Seg>, local: Vec<Arc<LocalMem>>, remote: Vec<Arc<RemoteMem>>) -> Request {
        let bytes = segs.iter().map(|s| s.len).sum();
        Request {
            op,
            target,
            segs: segs.into_boxed_slice(),
            bytes,
            status: AtomicI32::new(Status::NF_SUCCESS.code()),
            st: Mutex::new(ReqState {
                epoch: 0,
                next: 0,
                outstanding: 0,
                inflight_total: 0,
                notif: None,
                error: None,
                last_progress: Instant::now(),
                phase: Phase::Idle,
                cancelled: false,
                unflushed: 0,
                flushing: false,
                local_copies: 0,
            }),
            _local: local,
            _remote: remote,
            keeps: Vec::new(),
        }
    }

    pub fn status(&self) -> Status {
        Status::from_code(self.status.load(Ordering::Acquire))
    }

    pub fn set_status(&self, s: Status) {
        self.status.store(s.code(), Ordering::Release)
    }

    pub fn state(&self) -> MutexGuard<'_, ReqState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn peer(&self) -> Option<&Arc<Peer>> {
        match &self.target {
            Target::Peer(p) => Some(p),
            Target::Local => None,
        }
    }
}

/// Keeps one Arc per distinct object (descriptor lists often repeat the same region).
pub fn dedup_arcs<T>(v: impl Iterator<Item = Arc<T>>) -> Vec<Arc<T>> {
    let mut seen = std::collections::HashSet::new();
    v.filter(|a| seen.insert(Arc::as_ptr(a) as usize)).collect()
}
