//! Where staged chunks spend their time, summed per step and logged at INFO each time the
//! staging transport falls idle after a burst (and at shutdown). On a GPU host this tells
//! whether the device copies, our RMA, the owner's round trip or waiting for a slot holds a
//! chunk back, which is what chunk size and depth are tuned against (the stand-in driver's
//! copies are host memcpy, so only a real GPU's figures mean anything).
use std::time::Instant;

/// A step of one of our chunks (`Gather` .. `Total`) or of a serve (`Serve*`).
#[derive(Clone, Copy)]
pub enum Step {
    /// Our gather into the slot, queued until its event is seen complete.
    Gather,
    /// Our RMA operations of a chunk, first post until the last completion.
    Rma,
    /// Stage request sent until the owner's answer arrived.
    Owner,
    /// Our scatter out of the slot.
    Scatter,
    /// A chunk of ours, start to end.
    Total,
    /// A peer's stage request, arrived until it got a slot.
    ServeWait,
    /// A serve's RMA operations.
    ServeRma,
    /// A serve's gather or scatter.
    ServeCopy,
    /// A serve, slot taken until answered.
    ServeTotal,
}

const STEPS: usize = 9;
const NAMES: [&str; STEPS] = ["gather", "rma", "owner", "scatter", "chunk", "wait", "rma", "copy", "serve"];

#[derive(Default)]
pub struct Times {
    ns: [u64; STEPS],
    n: [u64; STEPS],
    /// Starts of our chunks put off because every slot we may hold was busy.
    pub no_slot: u64,
    /// Stage requests of peers that found no free slot at first.
    pub serve_queued: u64,
}

impl Times {
    pub fn add(&mut self, step: Step, since: Instant) {
        let i = step as usize;
        self.ns[i] += since.elapsed().as_nanos() as u64;
        self.n[i] += 1;
    }

    /// Adds another set's sums (the serves keep their own).
    pub fn merge(&mut self, other: &Times) {
        for i in 0..STEPS {
            self.ns[i] += other.ns[i];
            self.n[i] += other.n[i];
        }
        self.no_slot += other.no_slot;
        self.serve_queued += other.serve_queued;
    }

    fn mean_us(&self, i: usize) -> String {
        match self.n[i] {
            0 => "-".into(),
            n => format!("{:.0}", self.ns[i] as f64 / n as f64 / 1e3),
        }
    }

    /// Chunks and serves summed since the last reset.
    pub fn count(&self) -> u64 {
        self.n[Step::Total as usize] + self.n[Step::ServeTotal as usize]
    }

    /// One line for the log, or None when nothing was staged.
    pub fn summary(&self) -> Option<String> {
        let (ours, served) = (self.n[Step::Total as usize], self.n[Step::ServeTotal as usize]);
        if ours == 0 && served == 0 {
            return None;
        }
        let list = |r: std::ops::Range<usize>| r.map(|i| format!("{} {}", NAMES[i], self.mean_us(i))).collect::<Vec<_>>().join(", ");
        Some(format!(
            "staging times, mean us: {ours} chunks ({}; {} starts without a slot); {served} serves ({}; {} queued for a slot)",
            list(0..5),
            self.no_slot,
            list(5..STEPS),
            self.serve_queued
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_each_step_and_is_empty_without_chunks() {
        let mut t = Times::default();
        assert!(t.summary().is_none());
        let then = Instant::now();
        t.add(Step::Gather, then);
        t.add(Step::Total, then);
        t.no_slot = 3;
        let s = t.summary().unwrap_or_default();
        assert!(s.contains("1 chunks (gather "), "{s}");
        assert!(s.contains("owner -") && s.contains("3 starts without a slot") && s.contains("0 serves"), "{s}");
    }
}
