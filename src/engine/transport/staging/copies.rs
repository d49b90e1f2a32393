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
use crate::cuda;
use crate::engine::core::Core;
use crate::error::Result;
use std::collections::HashMap;

/// The stream a copy went on: (context id, out: a gather).
pub type StreamKey = (usize, bool);

/// A device copy queued on one of the pool's streams: its event and its place in the
/// stream's order.
pub struct Queued {
    ev: cuda::Event,
    stream: StreamKey,
    seq: u64,
}

#[derive(Default)]
struct Order {
    /// Copies queued so far (the last one's number).
    queued: u64,
    /// Every copy up to this number is known done.
    done: u64,
    /// In pass `pass`, the lowest number seen pending.
    pending_from: Option<u64>,
    pass: u64,
}

#[derive(Default)]
pub struct Copies {
    streams: HashMap<StreamKey, Order>,
    pass: u64,
}

impl Copies {
    /// The copy whose event `ev` was just recorded on `stream`, after everything queued there.
    pub fn queued(&mut self, stream: StreamKey, ev: cuda::Event) -> Queued {
        Queued { ev, stream, seq: self.next_seq(stream) }
    }

    /// The number of the next copy on `stream` (1, 2, ...).
    fn next_seq(&mut self, stream: StreamKey) -> u64 {
        let o = self.streams.entry(stream).or_default();
        o.queued += 1;
        o.queued
    }

    /// A new progress pass: what was pending may be done now.
    pub fn new_pass(&mut self) {
        self.pass += 1;
    }

    /// Whether copy `q` is done: from the stream's order where it tells, else by its event
    /// (queried under its context, rule 4). An error of the query is the copy's.
    pub fn done(&mut self, core: &Core, q: &Queued) -> Result<bool> {
        self.done_by(q.stream, q.seq, || {
            core.apply_ctx(&q.ev.context())?;
            Ok(q.ev.query()?)
        })
    }

    /// `done` with the event's query as `query`, called only where the order does not tell.
    fn done_by(&mut self, stream: StreamKey, seq: u64, query: impl FnOnce() -> Result<bool>) -> Result<bool> {
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
        let ready = query()?;
        if ready {
            o.done = seq;
        } else {
            o.pending_from = Some(o.pending_from.map_or(seq, |p| p.min(seq)));
        }
        Ok(ready)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Copies 1..=6 on one stream and 1..=2 on another; the device has finished copy `upto`
    /// of the first. Returns what `done` says for each (in the order asked) and the queries made.
    fn ask(c: &mut Copies, order: &[(StreamKey, u64)], upto: u64) -> (Vec<bool>, usize) {
        let n = Cell::new(0);
        let got = order.iter().map(|&(s, seq)| {
            c.done_by(s, seq, || {
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
        let seqs: Vec<u64> = [A, A, B, A, B].iter().map(|&s| c.next_seq(s)).collect();
        assert_eq!(seqs, [1, 2, 1, 3, 2]);
    }

    #[test]
    fn one_answer_covers_the_copies_before_and_after_it_on_its_stream() {
        let mut c = Copies::default();
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
        let mut c = Copies::default();
        c.new_pass();
        let e = c.done_by(A, 2, || Err(crate::error::Error::Backend("context not current".into())));
        assert!(e.is_err());
        // Neither done nor pending was learnt: copy 1 below it and copy 3 above it are asked
        // in the same pass.
        let n = Cell::new(0);
        assert!(!c.done_by(A, 3, || { n.set(n.get() + 1); Ok(false) }).unwrap());
        assert!(c.done_by(A, 1, || { n.set(n.get() + 1); Ok(true) }).unwrap());
        assert_eq!(n.get(), 2);
    }
}
