//! Transfer requests: descriptor pairs turned into rail segments once at preparation, then
//! posted any number of times. The status is an atomic the caller polls; everything the
//! driver tracks while a post is in flight sits in `ReqState`.
use super::ipc_cache::Keep;
use super::peer::Peer;
use super::registry::LocalMem;
use super::remote::RemoteMem;
use super::counters::{add, Counters};
use crate::error::{Error, Status};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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

// A request is planned by writing one segment per descriptor, mostly into memory the last
// transfer left cold (vLLM pattern on the CPU VM: 80 -> 72 bytes made the plan ~9 % faster).
const _: () = assert!(std::mem::size_of::<Seg>() <= 72);

/// How a segment's bytes move (DESIGN, "GPU memory without FI_HMEM").
#[derive(Clone, Copy, Debug)]
pub enum SegKind {
    /// Plain RMA between registered memories (host, or device with FI_HMEM).
    Rma,
    /// Our staged device memory <-> the peer's RMA-reachable memory, through one of our
    /// bounce slots (device copy under `ctx`, then RMA; or RMA, then device copy).
    DevToHost { ctx: crate::cuda::Context },
    /// Our host memory <-> the peer's staged device memory: the peer pulls or pushes;
    /// `self_addr`/`self_key` address our memory as the peer's RMA must name it. `owner_rma`:
    /// the peer's device memory is registered with the provider, whose RMA from our host
    /// memory would bounce (config hmem_owner_rma): the peer posts it from its device memory,
    /// so a READ asks it to push, never to lend a slot.
    HostToDev { self_addr: u64, self_key: u64, owner_rma: bool },
    /// Staged device memory on both sides: our bounce slot, and the peer pulls or pushes it.
    DevToDev { ctx: crate::cuda::Context },
    /// Loopback: both sides are our own memory (copied here; through the CUDA driver where
    /// either side is device memory).
    /// `local`/`remote`: the context of that side's device memory (None: host memory).
    Loopback { local: Option<crate::cuda::Context>, remote: Option<crate::cuda::Context> },
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
    /// Our host memory written to a peer's host memory inside a control message (module
    /// eager): `raddr` is the peer's address, `rkey` its registration's key on rail 0.
    Put,
}

/// What a request's segments add up to: their bytes, and the facts about their kinds that
/// the post path reads (see `Request`'s fields of the same names).
#[derive(Clone, Copy, Debug)]
pub struct SegSummary {
    pub bytes: u64,
    pub on_rails: bool,
    pub local_copies: bool,
    pub device_rma: bool,
    /// Some segment is staged (the scheduler may even the chunks out over the rails).
    pub staged: bool,
}

impl Default for SegSummary {
    fn default() -> Self {
        SegSummary { bytes: 0, on_rails: false, local_copies: true, device_rma: false, staged: false }
    }
}

impl SegSummary {
    pub fn add(&mut self, kind: &SegKind, len: u64) {
        self.bytes += len;
        self.note(kind);
    }

    /// The kind's facts without its bytes (segments of one kind in a row need it once).
    pub fn note(&mut self, kind: &SegKind) {
        self.on_rails |= matches!(kind.route(), Route::Rma | Route::Staging | Route::Eager);
        self.staged |= kind.route() == Route::Staging;
        self.local_copies &= matches!(kind, SegKind::Cma { .. } | SegKind::Direct { .. } | SegKind::Loopback { .. });
    }

    /// Adds the summary of the request's next segments (a planning part's).
    pub fn join(&mut self, next: &SegSummary) {
        self.bytes += next.bytes;
        self.on_rails |= next.on_rails;
        self.local_copies &= next.local_copies;
        self.device_rma |= next.device_rma;
        self.staged |= next.staged;
    }
}

/// Which transport moves a segment. The scheduler picks it (through the segment's kind);
/// the driver looks the transport up by it and never names one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Rma,
    Staging,
    Direct,
    Cma,
    Loopback,
    Eager,
}

impl Route {
    pub const COUNT: usize = 6;
}

impl SegKind {
    pub fn route(&self) -> Route {
        match self {
            SegKind::Rma => Route::Rma,
            SegKind::DevToHost { .. } | SegKind::HostToDev { .. } | SegKind::DevToDev { .. } => Route::Staging,
            SegKind::Direct { .. } | SegKind::PeerCopy { .. } => Route::Direct,
            SegKind::Cma { .. } => Route::Cma,
            SegKind::Loopback { .. } => Route::Loopback,
            SegKind::Put => Route::Eager,
        }
    }
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
    /// The transports' finishing steps (flush reads) are out, or were not needed.
    pub flushing: bool,
    /// What transports note about the current post (see `Marks`).
    pub marks: Marks,
}

/// What the transports note about a post while starting it, for the steps after its data.
#[derive(Default, Clone, Copy, Debug)]
pub struct Marks {
    /// Rails this post wrote on without delivery-complete (bit per rail): each gets a
    /// flush read before the data counts as delivered.
    pub unflushed: u64,
    /// Batches of this request's host copies still running on the copy threads (any
    /// epoch): they write into registered memory with no provider in between, so a
    /// release or repost waits for them even when the peer is gone.
    pub local_copies: usize,
    /// The post's notification went out right behind its data (Transport::notif_follows):
    /// its send is one more outstanding piece of the data phase.
    pub notif_ahead: bool,
    /// Messages carrying this post's data (eager writes) whose send failed: never answered,
    /// their transport ends them as failed pieces.
    pub lost_sends: usize,
}

pub struct Request {
    pub op: Op,
    pub target: Target,
    pub segs: Vec<Seg>,
    pub bytes: u64,
    /// Some segment moves over a rail (RMA or staging): the peer's progress matters, so a
    /// post reminds it (driver's kick). Same-host copies need nothing of the peer.
    pub on_rails: bool,
    /// Every segment is a copy this process makes itself (CMA, direct, loopback): nothing
    /// of it waits for a message from the peer (a peer copy does: PeerCopy).
    pub local_copies: bool,
    /// Some RMA segment's local memory is device memory registered with the provider
    /// (FI_HMEM): such segments go one per operation, since providers take their
    /// device-to-device paths per contiguous buffer (libfabric's shm its CUDA IPC protocol
    /// only for an operation of one iovec: 1024 x 16 KiB VRAM moved 0.28 GB/s batched through
    /// its host bounce buffers, H100).
    pub device_rma: bool,
    /// The last post moves by local copies only (local_copies, no notification): the
    /// caller's passes for it need read no rail (Driver::pass_local).
    local_post: AtomicBool,
    status: AtomicI32,
    st: Mutex<ReqState>,
    _local: Vec<Arc<LocalMem>>,
    _remote: Vec<Arc<RemoteMem>>,
    /// Peers' memory the direct segments use (IPC mappings, same-process registrations).
    pub keeps: Vec<Keep>,
}

impl Drop for Request {
    fn drop(&mut self) {
        keep_seg_list(std::mem::take(&mut self.segs));
    }
}

/// Segment lists of dropped requests, kept for the next ones: a list for 16k descriptors is
/// ~1.6 MB, and a fresh one cost a create ~400 page faults, a quarter of its time (CPU
/// machine, 16384 x 4 KiB).
static SEG_LISTS: Mutex<Vec<Vec<Seg>>> = Mutex::new(Vec::new());
/// At most this many lists, each of at most this many segments, are kept (~64 MB at most).
const KEPT_LISTS: usize = 6;
const KEPT_MAX_SEGS: usize = 1 << 17;
/// Lists this small are cheap to allocate and not worth a lock.
const KEPT_MIN_SEGS: usize = 1024;

/// An empty segment list with room for `count` segments, a kept one where one fits.
pub fn seg_list(count: usize) -> Vec<Seg> {
    if (KEPT_MIN_SEGS..=KEPT_MAX_SEGS).contains(&count) {
        let mut lists = SEG_LISTS.lock().unwrap_or_else(|p| p.into_inner());
        let fit = lists.iter().enumerate().filter(|(_, v)| v.capacity() >= count).min_by_key(|(_, v)| v.capacity()).map(|(i, _)| i);
        if let Some(i) = fit {
            return lists.swap_remove(i);
        }
    }
    Vec::with_capacity(count)
}

/// Keeps an emptied segment list for the next request (see SEG_LISTS).
pub fn keep_seg_list(mut v: Vec<Seg>) {
    if !(KEPT_MIN_SEGS..=KEPT_MAX_SEGS).contains(&v.capacity()) {
        return;
    }
    v.clear();
    let mut lists = SEG_LISTS.lock().unwrap_or_else(|p| p.into_inner());
    if lists.len() < KEPT_LISTS {
        lists.push(v);
    } else if let Some(small) = lists.iter_mut().min_by_key(|x| x.capacity()).filter(|x| x.capacity() < v.capacity()) {
        *small = v;
    }
}

/// A provider flushes operations it can no longer complete (the connection died) as
/// canceled; only the owner cancels on purpose, so any other cancel is a lost peer.
pub fn flushed_as_disconnect(e: Error, cancelled_by_owner: bool) -> Error {
    match e {
        Error::Completion { errno, .. } if errno == libc::ECANCELED && !cancelled_by_owner => {
            Error::Disconnected(format!("{e} (flushed by the provider: connection lost)"))
        }
        e => e,
    }
}

/// What ended: a piece of post `epoch` that moved `bytes` or failed; `local_copy`: a batch
/// of host copies (Marks::local_copies).
pub struct PieceEnd {
    pub epoch: u64,
    pub bytes: u64,
    pub res: Result<(), Error>,
    pub local_copy: bool,
}

impl ReqState {
    /// One outstanding piece of a post ended: counts its bytes or its failure (which stops
    /// the post's remaining segments). Returns whether the post's data phase is over.
    pub fn piece_ended(&mut self, req: &Request, p: PieceEnd, c: &Counters) -> bool {
        self.inflight_total = self.inflight_total.saturating_sub(1);
        if p.local_copy {
            self.marks.local_copies = self.marks.local_copies.saturating_sub(1);
        }
        if p.epoch != self.epoch || self.phase != Phase::Data {
            return false;
        }
        self.last_progress = Instant::now();
        self.outstanding = self.outstanding.saturating_sub(1);
        match p.res {
            Ok(()) => {
                add(if req.op == Op::Write { &c.bytes_written } else { &c.bytes_read }, p.bytes);
                add(&c.ops_completed, 1);
            }
            Err(e) => {
                add(&c.ops_failed, 1);
                let e = flushed_as_disconnect(e, self.cancelled);
                self.error.get_or_insert(e);
                self.next = req.segs.len();
            }
        }
        self.outstanding == 0 && self.next >= req.segs.len()
    }

    /// The post ends with `res`: its status is published. Returns whether it succeeded.
    pub fn end(&mut self, req: &Request, res: Result<(), Error>, core: &super::core::Core) -> bool {
        self.phase = Phase::Done;
        let c = &core.counters;
        match res {
            Ok(()) => {
                add(&c.requests_completed, 1);
                req.set_status(Status::NF_SUCCESS);
                true
            }
            Err(e) => {
                add(&c.requests_failed, 1);
                let s = e.status();
                if !matches!(e, Error::Canceled) {
                    log::error!("{}: transfer to agent '{}' failed: {e} -> {}", core.name, req.peer_name(), s.name());
                }
                req.set_status(s);
                false
            }
        }
    }
}

impl Request {
    pub fn new(op: Op, target: Target, segs: Vec<Seg>, local: Vec<Arc<LocalMem>>, remote: Vec<Arc<RemoteMem>>, keeps: Vec<Keep>) -> Request {
        let mut sum = SegSummary::default();
        for s in &segs {
            sum.add(&s.kind, s.len);
        }
        Request::summed(op, target, segs, sum, local, remote, keeps)
    }

    /// As `new`, with the segments' summary already tallied (the scheduler does it while
    /// it appends them: another pass over 16k segments costs more than the tally).
    pub fn summed(op: Op, target: Target, segs: Vec<Seg>, sum: SegSummary, local: Vec<Arc<LocalMem>>, remote: Vec<Arc<RemoteMem>>,
                  keeps: Vec<Keep>) -> Request {
        Request {
            op,
            target,
            segs,
            bytes: sum.bytes,
            on_rails: sum.on_rails,
            local_copies: sum.local_copies,
            device_rma: sum.device_rma,
            local_post: AtomicBool::new(false),
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
                flushing: false,
                marks: Marks::default(),
            }),
            _local: local,
            _remote: remote,
            keeps,
        }
    }

    pub fn local_post(&self) -> bool {
        self.local_post.load(Ordering::Relaxed)
    }

    pub fn set_local_post(&self, local: bool) {
        self.local_post.store(local, Ordering::Relaxed)
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

    /// Our id of the peer (0 for loopback, which has none).
    pub fn peer_id(&self) -> u64 {
        self.peer().map_or(0, |p| p.id)
    }

    /// The end of the run of segments from `at` whose kind `same` accepts (transports start
    /// runs of segments that share a target: a process, a context, an allocation).
    pub fn run_end(&self, at: usize, same: impl Fn(&SegKind) -> bool) -> usize {
        at + self.segs[at.min(self.segs.len())..].iter().take_while(|s| same(&s.kind)).count()
    }

    /// Err once the peer is known to be gone: a copy into a same-host peer's memory succeeds
    /// even when the peer died meanwhile, and only its liveness tells nobody saw the bytes.
    pub fn peer_alive(&self) -> Result<(), Error> {
        match self.peer() {
            Some(p) if !p.local.alive() => Err(Error::Disconnected(format!("agent '{}' exited", p.name))),
            _ => Ok(()),
        }
    }

    /// As `peer_alive`, but a same-host peer seen alive within `age` is not polled again.
    pub fn peer_alive_within(&self, age: Duration) -> Result<(), Error> {
        match self.peer() {
            Some(p) if !p.local.alive_within(age) => Err(Error::Disconnected(format!("agent '{}' exited", p.name))),
            _ => Ok(()),
        }
    }

    pub fn peer_name(&self) -> &str {
        self.peer().map_or("", |p| p.name.as_str())
    }

    pub fn peer(&self) -> Option<&Arc<Peer>> {
        match &self.target {
            Target::Peer(p) => Some(p),
            Target::Local => None,
        }
    }
}

/// Requests whose deadline passed, with the error that fails each.
pub type Overdue = Vec<(Arc<Request>, Error)>;

/// Deadlines (rule 2): of the requests `active`, those still running whose peer completed
/// nothing for `timeout` (and that have no host copies running: a long one is progress,
/// not a silent peer), with the error that fails them; the others stay.
/// `heard(peer id)`: when the peer last completed anything of ours.
pub fn overdue(active: Vec<Arc<Request>>, heard: impl Fn(u64) -> Option<Instant>, timeout: std::time::Duration, now: Instant)
    -> (Vec<Arc<Request>>, Overdue) {
    let mut keep = Vec::with_capacity(active.len());
    let mut late = Vec::new();
    for req in active {
        let st = req.state();
        if !matches!(st.phase, Phase::Data | Phase::Notif) {
            continue;
        }
        let last = req.peer().and_then(|p| heard(p.id)).map_or(st.last_progress, |t| t.max(st.last_progress));
        let expired = now.duration_since(last) > timeout && st.marks.local_copies == 0;
        drop(st);
        if expired {
            let e = Error::Timeout(format!("agent '{}' completed nothing for {} ms", req.peer_name(), timeout.as_millis()));
            late.push((req, e));
        } else {
            keep.push(req);
        }
    }
    (keep, late)
}
