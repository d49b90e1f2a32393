//! Provider faults at the rail boundary (config `fault_inject`, DESIGN rule 10): what a
//! provider under load does now and then, made to happen often and reproducibly so that
//! every retry and error path above the rail runs in tests. Owned by its `Rail`; absent
//! (None) unless configured, so the data path pays one branch on an Option.
//!
//! - Posts answer FI_EAGAIN (in bursts) or fail with a provider error, before reaching
//!   the provider: a refused post is not made, as the provider's own refusal.
//! - Completions read from the CQ are turned into error completions (the operation did
//!   complete: what is tested is that its request fails and nothing else does), or held
//!   back for a few further polls and released in shuffled order, so completions arrive
//!   late and out of order. While any are held the rail reports itself busy, so the
//!   progress thread does not sleep on a CQ fd that will not fire for them.
mod rng;
mod spec;

pub use spec::FaultSpec;

use super::{Completion, CqError, Posted};
use crate::error::{Error, Result};
use rng::Rng;
use std::collections::VecDeque;
use std::sync::Mutex;

/// Faults injected on one rail so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub eagain: u64,
    pub failed_posts: u64,
    pub cq_errors: u64,
    pub held: u64,
}

/// Which post the hook is asked about (receives have their own failure probability).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum PostKind {
    Data,
    Recv,
}

type Entry = std::result::Result<Completion, CqError>;

struct State {
    rng: Rng,
    burst_left: u32,
    /// Completions held back, each with the polls it still waits.
    held: Vec<(Entry, u32)>,
    /// Completions due for the caller, in the order they are handed out.
    ready: VecDeque<Entry>,
    counts: FaultCounts,
}

pub(super) struct Fault {
    spec: FaultSpec,
    rail: usize,
    /// The agent, for the log lines.
    owner: String,
    state: Mutex<State>,
}

const INJECTED_POST: &str = "injected post failure (fault_inject)";
const INJECTED_CQ: &str = "injected error completion (fault_inject)";

impl Fault {
    pub(super) fn new(owner: &str, spec: FaultSpec, rail: usize) -> Fault {
        let rng = Rng::new(spec.seed, rail);
        log::info!("{owner}: rail {rail}: fault injection on: {spec:?}");
        Fault { spec, rail, owner: owner.to_string(), state: Mutex::new(State { rng, burst_left: 0, held: Vec::new(), ready: VecDeque::new(), counts: FaultCounts::default() }) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Before a post reaches the provider: `Some` is what the post answers instead.
    pub(super) fn on_post(&self, op: &'static str, kind: PostKind) -> Option<Result<Posted>> {
        let mut st = self.state();
        if st.burst_left > 0 {
            st.burst_left -= 1;
            st.counts.eagain += 1;
            return Some(Ok(Posted::Again));
        }
        if st.rng.chance(self.spec.eagain) {
            st.burst_left = self.spec.eagain_burst;
            st.counts.eagain += 1;
            return Some(Ok(Posted::Again));
        }
        let p = if kind == PostKind::Recv { self.spec.post_fail_recv } else { self.spec.post_fail };
        if st.rng.chance(p) {
            st.counts.failed_posts += 1;
            return Some(Err(Error::Fabric { op, rail: Some(self.rail), code: -libc::EIO, detail: INJECTED_POST.into() }));
        }
        None
    }

    /// One CQ poll through the layer: releases held completions that are due, reads the
    /// CQ with `read` where there is room, injects into what it read, and hands out what
    /// is ready like the CQ would (completions, or one error entry alone).
    pub(super) fn poll(&self, out: &mut [Completion], read: impl FnOnce(&mut [Completion]) -> std::result::Result<usize, CqError>) -> std::result::Result<usize, CqError> {
        let mut st = self.state();
        self.release_due(&mut st);
        let room = out.len().saturating_sub(st.ready.len());
        if room > 0 {
            let mut buf = [Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; 64];
            let n = room.min(buf.len());
            match read(&mut buf[..n]) {
                Ok(k) => {
                    for c in &buf[..k] {
                        self.admit(&mut st, *c);
                    }
                }
                // The provider's own errors pass at once.
                Err(e) => st.ready.push_back(Err(e)),
            }
        }
        hand_out(&mut st.ready, out)
    }

    /// Completions are held or waiting to be handed out: the rail is not idle.
    pub(super) fn busy(&self) -> bool {
        let st = self.state();
        !st.held.is_empty() || !st.ready.is_empty()
    }

    pub(super) fn counts(&self) -> FaultCounts {
        self.state().counts
    }

    fn admit(&self, st: &mut State, c: Completion) {
        // A peer's write event names no operation of ours: nothing to fail or reorder.
        if c.is_remote_write() {
            st.ready.push_back(Ok(c));
            return;
        }
        let recv = c.flags & super::sys::FI_RECV as u64 != 0;
        let p = if recv { self.spec.cq_error_recv } else { self.spec.cq_error };
        let e: Entry = if st.rng.chance(p) {
            st.counts.cq_errors += 1;
            Err(CqError { ctx: c.ctx, errno: libc::EIO, detail: INJECTED_CQ.into() })
        } else {
            Ok(c)
        };
        let p = if recv { self.spec.reorder_recv } else { self.spec.reorder };
        if st.held.len() < self.spec.hold && st.rng.chance(p) {
            let wait = st.rng.between_1_and(self.spec.delay);
            st.counts.held += 1;
            st.held.push((e, wait));
        } else {
            st.ready.push_back(e);
        }
    }

    /// One more poll for every held completion; those whose wait is over join the ready
    /// queue together in shuffled order.
    fn release_due(&self, st: &mut State) {
        if st.held.is_empty() {
            return;
        }
        let mut due = Vec::new();
        let mut i = 0;
        while i < st.held.len() {
            st.held[i].1 -= 1;
            if st.held[i].1 == 0 {
                due.push(st.held.swap_remove(i).0);
            } else {
                i += 1;
            }
        }
        st.rng.shuffle(&mut due);
        st.ready.extend(due);
    }
}

/// As the CQ hands out entries: completions up to the first error; an error alone. (The
/// rail's stash of a rail thread's reads hands them out the same way.)
pub(super) fn hand_out(ready: &mut VecDeque<Entry>, out: &mut [Completion]) -> std::result::Result<usize, CqError> {
    let mut n = 0;
    while n < out.len() {
        match ready.front() {
            Some(Ok(c)) => {
                out[n] = *c;
                n += 1;
                ready.pop_front();
            }
            Some(Err(_)) if n == 0 => {
                if let Some(Err(e)) = ready.pop_front() {
                    return Err(e);
                }
            }
            _ => break,
        }
    }
    Ok(n)
}

impl Drop for Fault {
    fn drop(&mut self) {
        let st = self.state();
        let c = st.counts;
        log::info!(
            "{}: rail {}: injected {} EAGAIN, {} failed posts, {} error completions, {} held completions ({} still held at close)",
            self.owner, self.rail, c.eagain, c.failed_posts, c.cq_errors, c.held, st.held.len() + st.ready.len()
        );
    }
}

#[cfg(test)]
mod tests;
