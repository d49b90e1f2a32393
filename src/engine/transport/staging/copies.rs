//! Which of the pool's queued device copies are done, with fewer driver calls. Every chunk's
//! gather or scatter ends in a stream event, and a progress pass used to query the event of
//! every chunk in a copy step, each query after a cuCtxGetCurrent: with two dozen chunks of
//! ours and as many serves in flight, some seventy driver calls a pass. Work on one stream
//! completes in the order it was queued, so one answer covers others: a done copy means that
//! every copy queued before it on its stream is done, and a pending one that every copy queued
//! after it is still pending (taken as such for the rest of the pass, which a later pass asks
//! again). What that saves: the queries of the pending tail of each stream, and of copies
//! below one already seen done; copies that finished since the last pass, asked oldest
//! first, are still asked one by one. The numbering relies on the pool keeping one stream
//! per key for its whole life (pool.rs `streams`); a pool that dropped or replaced a stream
//! would have to forget its `Order` too.
//!
//! The events live here, not with the copies: a copy at or below a stream's done mark is
//! never asked again, so its event is recorded anew for a later copy on that stream instead
//! of being destroyed (each chunk created and destroyed one before: two driver calls and a
//! context push and pop a chunk on each side).
use crate::cuda;
use crate::engine::core::Core;
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};

/// The stream a copy went on: (context id, out: a gather).
pub type StreamKey = (usize, bool);

/// A device copy queued on one of the pool's streams: its place in the stream's order.
pub struct Queued {
    stream: StreamKey,
    seq: u64,
}

struct Order<E> {
    /// Copies queued so far (the last one's number).
    queued: u64,
    /// Every copy up to this number is known done.
    done: u64,
    /// In pass `pass`, the lowest number seen pending.
    pending_from: Option<u64>,
    pass: u64,
    /// The events of copies `done + 1 ..= queued`, oldest first.
    events: VecDeque<E>,
    /// Events of done copies, to be recorded again.
    free: Vec<E>,
}

impl<E> Default for Order<E> {
    fn default() -> Self {
        Order { queued: 0, done: 0, pending_from: None, pass: 0, events: VecDeque::new(), free: Vec::new() }
    }
}

/// The pool's copies per stream (`E`: the event type; the tests use one without a driver).
pub struct Copies<E = cuda::Event> {
    streams: HashMap<StreamKey, Order<E>>,
    pass: u64,
}

impl<E> Default for Copies<E> {
    fn default() -> Self {
        Copies { streams: HashMap::new(), pass: 0 }
    }
}

impl<E> Copies<E> {
    /// An event of a done copy on `stream`, to record the next copy there with.
    pub fn reusable(&mut self, stream: StreamKey) -> Option<E> {
        self.streams.get_mut(&stream)?.free.pop()
    }

    /// The copy whose event `ev` was just recorded on `stream`, after everything queued there.
    pub fn queued(&mut self, stream: StreamKey, ev: E) -> Queued {
        let o = self.streams.entry(stream).or_default();
        o.queued += 1;
        o.events.push_back(ev);
        Queued { stream, seq: o.queued }
    }

    /// A new progress pass: what was pending may be done now.
    pub fn new_pass(&mut self) {
        self.pass += 1;
    }

    /// Whether copy `seq` of `stream` is done: from the stream's order where it tells, else
    /// by `query` of its event.
    fn done_by(&mut self, stream: StreamKey, seq: u64, query: impl FnOnce(&E) -> Result<bool>) -> Result<bool> {
        let pass = self.pass;
        let o = self.streams.entry(stream).or_default();
        if seq <= o.done {
            return Ok(true);
        }
        if o.pass != pass {
            o.pass = pass;
            o.pending_from = None;
        }
        if o.pending_from.is_some_and(|p| seq >= p) {
            return Ok(false);
        }
        let ev = o.events.get((seq - o.done - 1) as usize).ok_or_else(|| Error::Backend(format!("staged copy {seq} was never queued")))?;
        let ready = query(ev)?;
        if ready {
            for _ in o.done..seq {
                if let Some(e) = o.events.pop_front() {
                    o.free.push(e);
                }
            }
            o.done = seq;
        } else {
            o.pending_from = Some(o.pending_from.map_or(seq, |p| p.min(seq)));
        }
        Ok(ready)
    }
}

impl Copies<cuda::Event> {
    /// Whether copy `q` is done: from the stream's order where it tells, else by its event
    /// (queried under its context, rule 4). An error of the query is the copy's.
    pub fn done(&mut self, core: &Core, q: &Queued) -> Result<bool> {
        self.done_by(q.stream, q.seq, |ev| {
            core.apply_ctx(&ev.context())?;
            Ok(ev.query()?)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Copies 1..=6 on one stream and 1..=2 on another, queued.
    fn six_and_two() -> Copies<u64> {
        let mut c = Copies::default();
        for s in [A, A, A, A, A, A, B, B] {
            let next = c.streams.get(&s).map_or(1, |o| o.queued + 1);
            c.queued(s, next);
        }
        c
    }

    /// The device has finished copy `upto` of the first stream. Returns what `done` says for
    /// each (in the order asked) and the queries made.
    fn ask(c: &mut Copies<u64>, order: &[(StreamKey, u64)], upto: u64) -> (Vec<bool>, usize) {
        let n = Cell::new(0);
        let got = order.iter().map(|&(s, seq)| {
            c.done_by(s, seq, |&ev| {
                assert_eq!(ev, seq, "the copy's own event is asked");
                n.set(n.get() + 1);
                Ok(if s == A { seq <= upto } else { true })
            }).unwrap()
        }).collect();
        (got, n.get())
    }

    const A: StreamKey = (1, true);
    const B: StreamKey = (1, false);

    #[test]
    fn copies_are_numbered_in_order_on_each_stream() {
        let mut c = Copies::default();
        let seqs: Vec<u64> = [A, A, B, A, B].iter().map(|&s| c.queued(s, ()).seq).collect();
        assert_eq!(seqs, [1, 2, 1, 3, 2]);
    }

    #[test]
    fn events_of_done_copies_are_recorded_again_not_made_anew() {
        let mut c = six_and_two();
        assert_eq!(c.reusable(A), None);
        c.new_pass();
        // Copy 4 done: the events of 1 ..= 4 are free, the others still held.
        assert!(c.done_by(A, 4, |_| Ok(true)).unwrap());
        let mut free: Vec<u64> = std::iter::from_fn(|| c.reusable(A)).collect();
        free.sort();
        assert_eq!(free, [1, 2, 3, 4]);
        assert_eq!(c.reusable(B), None);
        // The next copy takes a freed event and is numbered 7; copy 5 is still asked by its own.
        let q = c.queued(A, 1);
        assert_eq!(q.seq, 7);
        assert!(!c.done_by(A, 5, |&ev| { assert_eq!(ev, 5); Ok(false) }).unwrap());
        c.new_pass();
        assert!(c.done_by(A, 7, |&ev| { assert_eq!(ev, 1); Ok(true) }).unwrap());
        // A copy never queued is an error, not a panic.
        assert!(c.done_by(A, 9, |_| Ok(true)).is_err());
    }

    #[test]
    fn one_answer_covers_the_copies_before_and_after_it_on_its_stream() {
        let mut c = six_and_two();
        // Asked newest first while the first three are done: 6, 5 and 4 need a query each
        // (each is below the last pending one), 3 is done, so 2 and 1 need none.
        c.new_pass();
        let (got, q) = ask(&mut c, &[(A, 6), (A, 5), (A, 4), (A, 3), (A, 2), (A, 1), (B, 2)], 3);
        assert_eq!(got, [false, false, false, true, true, true, true]);
        assert_eq!(q, 5);
        // Oldest first: 4 is pending, so 5 and 6 are not asked in this pass.
        c.new_pass();
        let (got, q) = ask(&mut c, &[(A, 4), (A, 5), (A, 6)], 3);
        assert_eq!((got, q), (vec![false, false, false], 1));
        // The next pass asks again: 6 done answers for 4 and 5.
        c.new_pass();
        let (got, q) = ask(&mut c, &[(A, 6), (A, 4), (A, 5)], 6);
        assert_eq!((got, q), (vec![true, true, true], 1));
    }

    #[test]
    fn a_failed_query_is_the_copys_and_teaches_nothing() {
        let mut c = six_and_two();
        c.new_pass();
        let e = c.done_by(A, 2, |_| Err(crate::error::Error::Backend("context not current".into())));
        assert!(e.is_err());
        // Neither done nor pending was learnt: copy 1 below it and copy 3 above it are asked
        // in the same pass.
        let n = Cell::new(0);
        assert!(!c.done_by(A, 3, |_| { n.set(n.get() + 1); Ok(false) }).unwrap());
        assert!(c.done_by(A, 1, |_| { n.set(n.get() + 1); Ok(true) }).unwrap());
        assert_eq!(n.get(), 2);
    }
}
