//! Transports: the ways bytes move (DESIGN rule 11). Each is a module behind the one
//! `Transport` trait; the driver's loop drives them through it and acts on the outcomes they
//! emit (a piece of a post done or failed, a control message to send), never naming one.
//! A transport reaches the rails, the operation pool, the peers' addresses and the counters
//! through the small context `Cx` it is handed, and owns everything else it needs.
//!
//! - `rma`: RMA over the rails between registered memories (host, or device with FI_HMEM),
//!   with the flush reads that make "done" mean "delivered" (rule 6).
//! - `staging`: device memory without FI_HMEM, through pinned bounce slots.
//! - `direct`: same-host device memory by CUDA IPC, and engines of this process.
//! - `cma`: same-host host memory by cross-memory attach, on copy threads.
//! - `loopback`: requests whose remote side is our own memory.
//! - `eager`: small writes of host memory carried in a control message with their
//!   notification, acknowledged once in place.
pub mod cma;
pub mod direct;
pub mod eager;
pub mod loopback;
pub mod rma;
pub mod slab;
pub mod staging;
#[cfg(test)]
pub mod fake;

use super::conns::Conns;
use super::core::Core;
use super::ctrl::CtrlOut;
use super::ops::{OpPool, TOp};
use super::port::Port;
use super::request::{Marks, Request, Route};
use super::wire::Ctrl as CtrlMsg;
use crate::error::{Error, Result};
use std::sync::Arc;

/// Per rail: operations the provider holds for the transports, and how many it may.
pub struct RailSlots {
    pub inflight: Vec<usize>,
    pub cap: Vec<usize>,
}

impl RailSlots {
    pub fn full(&self, rail: usize) -> bool {
        self.inflight[rail] >= self.cap[rail]
    }
    pub fn take(&mut self, rail: usize) {
        self.inflight[rail] += 1;
    }
    pub fn give(&mut self, rail: usize) {
        self.inflight[rail] = self.inflight[rail].saturating_sub(1);
    }
}

/// One piece of a post ended: `bytes` moved, or the error that fails the post. `local_copy`:
/// the piece was a batch of host copies (Marks::local_copies).
pub struct Piece {
    pub req: Arc<Request>,
    pub epoch: u64,
    pub bytes: u64,
    pub res: Result<()>,
    pub local_copy: bool,
}

/// What a transport tells the loop.
pub enum Outcome {
    Piece(Piece),
    Ctrl(CtrlOut),
}

/// What a transport works with during one call.
pub struct Cx<'a> {
    pub core: &'a Arc<Core>,
    pub rails: &'a [Arc<dyn Port>],
    pub ops: &'a mut OpPool,
    pub conns: &'a mut Conns,
    pub slots: &'a mut RailSlots,
    pub out: &'a mut Vec<Outcome>,
    /// Room for a control message's payload.
    pub ctrl_room: usize,
    /// When the pass began (Driver::now).
    pub now: std::time::Instant,
}

impl Cx<'_> {
    pub fn piece(&mut self, req: Arc<Request>, epoch: u64, bytes: u64, res: Result<()>) {
        self.out.push(Outcome::Piece(Piece { req, epoch, bytes, res, local_copy: false }));
    }

    /// Queues control message `kind` with `payload` to `dest` (peer `peer_id`, 0 for none).
    pub fn ctrl(&mut self, peer_id: u64, dest: crate::fabric::FiAddr, kind: super::wire::CtrlType, payload: &[u8]) {
        self.queue_ctrl(peer_id, dest, kind, payload, None);
    }

    /// As `ctrl`, a message that carries data of post `epoch` of `req`: a failed send fails
    /// the post.
    pub fn ctrl_of(&mut self, peer_id: u64, dest: crate::fabric::FiAddr, kind: super::wire::CtrlType, payload: &[u8], post: (Arc<Request>, u64)) {
        self.queue_ctrl(peer_id, dest, kind, payload, Some(post));
    }

    fn queue_ctrl(&mut self, peer_id: u64, dest: crate::fabric::FiAddr, kind: super::wire::CtrlType, payload: &[u8], req: Option<(Arc<Request>, u64)>) {
        let bytes = super::wire::encode_ctrl(kind, self.core.engine_id, &self.core.name, payload);
        self.out.push(Outcome::Ctrl(CtrlOut { peer_id, dest, bytes, req }));
    }

    /// Answers request `token` of engine `to` with `status` (a stage, copy or put answer:
    /// `kind`); `what` names the request for the log line when `to` never introduced itself.
    pub fn answer(&mut self, to: u64, kind: super::wire::CtrlType, token: u64, status: crate::error::Status, what: &str) {
        let Some(dest) = self.initiator_addr(to) else {
            log::warn!("{}: cannot answer a {what} of engine {to:016x}: it never introduced itself", self.core.name);
            return;
        };
        self.ctrl(0, dest, kind, &super::wire::StageAck { token, status: status.code() }.encode());
    }

    /// Our control address of an engine that introduced itself.
    pub fn initiator_addr(&mut self, engine_id: u64) -> Option<crate::fabric::FiAddr> {
        let rail0 = self.rails.first()?;
        self.conns.initiator_addr(engine_id, &**rail0, &self.core.name)
    }
}

/// How far a start got: segments taken from the post (started, or finished at once),
/// pieces now outstanding (each ends with one `Outcome::Piece`), and why it stopped early.
#[derive(Debug, Default)]
pub struct Start {
    pub segs: usize,
    pub pieces: usize,
    pub stop: Option<Stop>,
}

#[derive(Debug)]
pub enum Stop {
    /// A queue or pool is full (FI_EAGAIN, rail slots, bounce slots): again next pass.
    Blocked,
    /// The post fails with this; nothing more of it starts.
    Failed(Error),
}

impl Start {
    pub fn went(segs: usize, pieces: usize) -> Start {
        Start { segs, pieces, stop: None }
    }
    pub fn blocked(segs: usize, pieces: usize) -> Start {
        Start { segs, pieces, stop: Some(Stop::Blocked) }
    }
    pub fn failed(segs: usize, pieces: usize, e: Error) -> Start {
        Start { segs, pieces, stop: Some(Stop::Failed(e)) }
    }
}

/// The post a start belongs to.
pub struct Post<'a> {
    pub req: &'a Arc<Request>,
    pub epoch: u64,
    /// The first segment to start (segments before it are started or done).
    pub at: usize,
    pub marks: &'a mut Marks,
    /// The post's notification, not yet sent: a transport that carries it with the post's
    /// data (after all of it) takes it.
    pub notif: &'a mut Option<Vec<u8>>,
}

pub trait Transport: Send {
    fn name(&self) -> &'static str;

    /// The segments this transport moves.
    fn route(&self) -> Route;

    /// Starts segments of `post` from `post.at` (at least that one, usually the run of
    /// consecutive segments of this route).
    fn start(&mut self, cx: &mut Cx, post: Post) -> Start;

    /// An operation this transport posted completed (`err`: with an error). The driver has
    /// already returned its operation slot to the pool.
    fn on_completion(&mut self, _cx: &mut Cx, _op: TOp, _len: usize, _err: Option<Error>) {}

    /// A control message from a peer; returns whether it was this transport's.
    fn on_control(&mut self, _cx: &mut Cx, _msg: &CtrlMsg<'_>) -> bool {
        false
    }

    /// Moves work along that waits on something other than a completion (device copies,
    /// copy threads, retries after back-pressure). Returns whether it has work in flight.
    fn advance(&mut self, _cx: &mut Cx) -> bool {
        false
    }

    /// Device memory is being registered: set up now what its transfers will need, so the
    /// first one does not pay for it.
    fn prepare(&mut self, _cx: &mut Cx, _dev: &super::gpu::DeviceMem) -> Result<()> {
        Ok(())
    }

    /// Every piece of a post is done without error: steps still owed before its data counts
    /// as delivered (flush reads). Returns how many pieces it started for that.
    fn finishing(&mut self, _cx: &mut Cx, _req: &Arc<Request>, _epoch: u64, _marks: &mut Marks) -> usize {
        0
    }

    /// Whether a notification sent now on the control endpoint (our rail 0 to the peer's
    /// rail 0) reaches the target only after every byte this transport moves for `req`'s
    /// post, all of whose segments have started. A transport without segments in `req` has
    /// nothing for it to wait for.
    fn notif_follows(&self, _cx: &Cx, req: &Request) -> bool {
        !req.segs.iter().any(|s| s.kind.route() == self.route())
    }

    /// Every segment of a post has started: finishing steps that may go out already
    /// (`finishing` does the rest once the pieces ended). Returns how many pieces it started.
    fn finish_early(&mut self, _cx: &mut Cx, _req: &Arc<Request>, _epoch: u64, _marks: &mut Marks) -> usize {
        0
    }

    /// Whether an operation of an ended request that the driver takes back unposted from a
    /// rail's outbox must still reach `on_completion` (as a failure): a transport that keeps
    /// state per operation (a staged chunk's slot). Else the driver settles the request's
    /// counts itself.
    fn hears_taken_back(&self) -> bool {
        false
    }

    /// Peer `peer_id` (engine `engine_id`) is gone: end what waits on it.
    fn drop_peer(&mut self, _cx: &mut Cx, _peer_id: u64, _engine_id: u64) {}

    /// Periodic housekeeping (every few ms).
    fn sweep(&mut self, _cx: &mut Cx) {}

    /// Nothing in flight or waiting.
    fn idle(&self) -> bool;

    /// Engine teardown: wait (bounded by the transport's own nature) for work that writes
    /// into memory its owners free once the engine is gone.
    fn quiesce(&mut self, _cx: &mut Cx) {}
}

/// The gather-copy kernel of `ctx` from a transport's per-context cache, loaded (a PTX JIT)
/// on first use; None where it cannot run there, not tried again. `ok` says what the
/// kernel does for the transport, `without` what it does instead (both logged once).
pub fn copy_kernel<'k>(kernels: &'k mut std::collections::HashMap<usize, Option<crate::cuda::CopyKernel>>, ctx: crate::cuda::Context,
                       engine: &str, ok: &str, without: &str) -> Option<&'k crate::cuda::CopyKernel> {
    kernels.entry(ctx.id()).or_insert_with(|| match crate::cuda::CopyKernel::load(&ctx) {
        Ok(k) => {
            log::info!("{engine}: {ok} ({} ranges per launch)", k.ranges_per_launch());
            Some(k)
        }
        Err(e) => {
            log::info!("{engine}: the gather-copy kernel cannot run here ({e}); {without}");
            None
        }
    }).as_ref()
}
