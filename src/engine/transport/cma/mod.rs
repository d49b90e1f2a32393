//! Host memory of a same-host peer process, moved by cross-memory attach: the initiator
//! writes or reads the peer's registered DRAM with process_vm_writev/readv, with no rail
//! and no provider in between (issue 13).
//!
//! Why not the shm rail: libfabric's shm makes the same system call, but one per
//! operation, from our one progress thread, behind the provider's command queue. One call
//! here carries up to IOV_MAX descriptor pairs (a batch of 4 KiB KV blocks is a handful of
//! calls), and a large request is cut into pieces that a few copy threads move at once:
//! one kernel copy runs at one core's memory bandwidth (on the 16-core H200 host a 64 MiB
//! process_vm_writev moved 4.1 GB/s on one thread and 12.7 GB/s split over four).
//!
//! The same pool moves large host-to-host copies between two engines of this process
//! (the scheduler routes them here, pid THIS_PROCESS): one memcpy thread reaches about a third of
//! what a 16-core host's memory does.
//!
//! Done means delivered (rule 6): the call returns once the bytes are in the peer's pages.
//! A post checks first that the peer process is the one we connected to (its pidfd; a
//! reused pid is never written to), and the end of a copy checks again.
mod copy;

pub use copy::{POOL_MIN_BYTES, THIS_PROCESS};

use super::{Cx, Piece, Post, Outcome, Start, Transport};
use crate::engine::counters::add;
use crate::engine::local_peers::RECENTLY_ALIVE;
use crate::engine::request::{Op, Request, Route, SegKind};
use crate::error::{Error, Result};
use copy::{copy, copy_ranges, cut, one_piece, whole_up_to, Batch, Iovecs, Pool, Range, AUTO_MAX_THREADS};
use std::sync::Arc;
use std::time::Duration;

/// Copy threads for this engine: the count `cma_threads` asks for (0: half the cores this
/// process may run on, at most AUTO_MAX_THREADS, at least one).
pub fn thread_count(cfg: u64) -> usize {
    if cfg > 0 {
        return cfg.min(64) as usize;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / 2).clamp(1, AUTO_MAX_THREADS)
}

/// A post whose pieces copy threads are moving.
struct Track {
    req: Arc<Request>,
    epoch: u64,
    bytes: u64,
    batch: Arc<Batch>,
    /// Moved by CMA (not between engines of this process): counted in cma_bytes.
    cma: bool,
}

/// The pool and the posts in flight on it.
pub struct Cma {
    pool: Pool,
    tracks: Vec<Track>,
    /// The lists of the copies made on this thread.
    iov: Iovecs,
    /// Config `cma_min_piece`.
    min_piece: u64,
}

impl Cma {
    pub fn new(name: &str, threads: usize) -> Cma {
        Cma { pool: Pool::new(name, threads), tracks: Vec::new(), iov: Iovecs::default(), min_piece: copy::MIN_PIECE }
    }

    /// The smallest piece handed to a copy thread (config `cma_min_piece`).
    pub fn with_min_piece(mut self, bytes: u64) -> Cma {
        self.min_piece = bytes;
        self
    }

    /// How long an idle copy thread keeps looking for work before it blocks.
    pub fn with_spin(self, spin: Duration) -> Cma {
        self.pool.set_spin(spin);
        self
    }

    /// Moves `ranges` of `req` (`bytes` in all) with process `pid` (THIS_PROCESS: between
    /// engines here): one piece on this thread, the others on the pool, the post tracked
    /// until they are done. Returns the pieces outstanding (0: all copied here).
    fn spread(&mut self, cx: &mut Cx, req: &Arc<Request>, epoch: u64, pid: u32, ranges: Vec<Range>, bytes: u64) -> Result<usize> {
        let write = req.op == Op::Write;
        let mut pieces = cut(&ranges, self.pool.wanted(), self.min_piece);
        let c = &cx.core.counters;
        if pieces.len() > 1 && self.pool.workers() > 0 {
            let mine = pieces.swap_remove(0);
            let mine_bytes: u64 = mine.iter().map(|r| r.2 as u64).sum();
            let batch = Batch::new(pieces.len() + 1);
            self.pool.submit(pid, write, pieces, &batch);
            batch.finish(copy(pid, write, &mine));
            // What the threads have not taken yet is copied here, up to MAX_PIECE in all:
            // the pass that collects the batch (advance) follows in this same pass.
            self.pool.help(&batch, copy::MAX_PIECE.saturating_sub(mine_bytes));
            add(&c.ops_posted, 1);
            self.tracks.push(Track { req: req.clone(), epoch, bytes, batch, cma: pid != THIS_PROCESS });
            return Ok(1);
        }
        for p in &pieces {
            copy(pid, write, p)?;
        }
        Self::copied_here(cx, req, pid, bytes, false)
    }

    /// Ends a run copied on this thread: the peer's liveness (unless `seen_alive`: the
    /// check that started the run covers it), then the counters.
    fn copied_here(cx: &mut Cx, req: &Arc<Request>, pid: u32, bytes: u64, seen_alive: bool) -> Result<usize> {
        let write = req.op == Op::Write;
        let c = &cx.core.counters;
        // As for pooled copies: a process that died meanwhile may have "taken" the bytes.
        // A small copy takes microseconds, so a peer seen alive within RECENTLY_ALIVE (the
        // check before it, as a rule) was alive when it ended, give or take that window,
        // in which its death is no different from one right after delivery. Polling again
        // here was one system call per small transfer (~0.3 us of a 4 KiB WRITE, CPU VM);
        // after a run of one piece (about 1 MiB at most, tens of microseconds) even the clock
        // read of the check is one of the four a 4 KiB WRITE made, and tells nothing new.
        if pid != THIS_PROCESS && !seen_alive {
            req.peer_alive_within(RECENTLY_ALIVE)?;
        }
        add(if write { &c.bytes_written } else { &c.bytes_read }, bytes);
        if pid != THIS_PROCESS {
            add(&c.cma_bytes, bytes);
        }
        add(&c.ops_completed, 1);
        Ok(0)
    }
}

impl Transport for Cma {
    fn name(&self) -> &'static str {
        "cma"
    }

    fn route(&self) -> Route {
        Route::Cma
    }

    /// Starts the run of CMA segments from `at` toward one process: cut into pieces, all
    /// but one handed to the copy threads, one copied here. A run of one piece finishes here.
    fn start(&mut self, cx: &mut Cx, post: Post) -> Start {
        let Post { req, epoch, at, marks, .. } = post;
        let Some(SegKind::Cma { pid }) = req.segs.get(at).map(|s| s.kind) else { return Start::went(0, 0) };
        let end = req.run_end(at, |k| matches!(k, SegKind::Cma { pid: p } if *p == pid));
        // The peer must still be the process we connected to (its pidfd), also for a run
        // that starts passes after the request's first. Seen alive by the check after the
        // previous copy moments ago counts: one poll per small transfer instead of two (the
        // two polls were 11 % of a 4 KiB WRITE loop's samples, perf on the CI VM).
        if let Some(p) = req.peer().filter(|p| !p.local.alive_within_at(RECENTLY_ALIVE, cx.now)) {
            return Start::failed(0, 0, Error::Disconnected(format!("agent '{}' exited", p.name)));
        }
        let run = &req.segs[at..end];
        let bytes: u64 = run.iter().map(|s| s.len).sum();
        let ranges = run.iter().map(|s| (s.local, s.raddr, s.len as usize));
        // A run of one piece (small transfers) is copied from the segments as they lie: no
        // range or piece lists to build and free per post.
        let res = if one_piece(run.len(), bytes, whole_up_to(self.pool.wanted(), self.min_piece)) {
            copy_ranges(pid, req.op == Op::Write, ranges, &mut self.iov).and_then(|_| Self::copied_here(cx, req, pid, bytes, true))
        } else {
            self.spread(cx, req, epoch, pid, ranges.collect(), bytes)
        };
        match res {
            Ok(pieces) => {
                marks.local_copies += pieces;
                Start::went(end - at, pieces)
            }
            Err(e) => Start::failed(end - at, 0, e),
        }
    }

    /// Finishes the posts whose pieces have all been copied.
    fn advance(&mut self, cx: &mut Cx) -> bool {
        if self.tracks.is_empty() {
            return false;
        }
        for t in std::mem::take(&mut self.tracks) {
            if !t.batch.done() {
                self.tracks.push(t);
                continue;
            }
            // The copies into a process that died meanwhile may have "succeeded": only its
            // liveness tells that the bytes reached the peer we meant.
            let res = t.batch.result().and_then(|_| t.req.peer_alive());
            if res.is_ok() && t.cma {
                add(&cx.core.counters.cma_bytes, t.bytes);
            } else if let Err(e) = &res {
                log::error!("{}: copy with agent '{}': {e}", cx.core.name, t.req.peer_name());
            }
            cx.out.push(Outcome::Piece(Piece { req: t.req, epoch: t.epoch, bytes: t.bytes, res, local_copy: true }));
        }
        true
    }

    fn idle(&self) -> bool {
        self.tracks.is_empty()
    }

    /// Copies still running write into memory the owners free once the engine is gone:
    /// wait for them (system calls that always end).
    fn quiesce(&mut self, cx: &mut Cx) {
        while !self.tracks.is_empty() {
            self.advance(cx);
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::local_peers::{Locality, PidFd};
    use crate::engine::request::Seg;
    use crate::engine::transport::fake::{request, Bench};

    fn segs(src: &[u8], dst: &mut [u8], n: usize, pid: u32) -> Vec<Seg> {
        let len = src.len() / n;
        (0..n).map(|i| Seg { local: src.as_ptr() as u64 + (i * len) as u64, len: len as u64, raddr: dst.as_mut_ptr() as u64 + (i * len) as u64, rkey: 0, desc: 0, rail: 0, rrail: 0, kind: SegKind::Cma { pid } }).collect()
    }

    #[test]
    fn a_large_run_is_spread_over_the_copy_threads_and_ends_once() {
        let mut b = Bench::new(1, false);
        let me = std::process::id();
        let peer = b.peer(1, Locality::SameHost(PidFd::open(me)));
        let src: Vec<u8> = (0..(16 << 20)).map(|i| (i % 249) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let req = request(Op::Write, &peer, segs(&src, &mut dst, 4, me));
        let mut t = Cma::new("test", 3);
        let run = b.run(&mut t, &req, 10_000);
        assert!(run.failed.is_none());
        assert_eq!(run.pieces.len(), 1);
        assert!(run.pieces[0].local_copy && run.pieces[0].res.is_ok() && run.pieces[0].bytes == src.len() as u64);
        assert_eq!(run.marks.local_copies, 1, "counted while the threads copied");
        assert!(dst == src);
        assert!(t.idle());
        // A small run is copied in the start: no piece outstanding.
        let mut small = vec![0u8; 8192];
        let landing = vec![0u8; 8192];
        let req = request(Op::Read, &peer, segs(&landing, &mut small, 2, me));
        let run = b.run(&mut t, &req, 10);
        assert!(run.failed.is_none() && run.pieces.is_empty());
    }

    #[test]
    fn a_peer_process_that_exited_is_never_written() {
        let mut b = Bench::new(1, false);
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        let fd = PidFd::open(pid);
        child.wait().expect("child exits");
        let peer = b.peer(1, Locality::SameHost(fd));
        let src = vec![1u8; 4096];
        let mut dst = vec![0u8; 4096];
        let req = request(Op::Write, &peer, segs(&src, &mut dst, 1, pid));
        let mut t = Cma::new("test", 1);
        let run = b.run(&mut t, &req, 3);
        assert!(matches!(run.failed, Some(Error::Disconnected(_))), "{:?}", run.failed);
    }
}
