//! Monotonic counters, readable through the C ABI while the engine runs.
use crate::capi::{nf_counters, nf_rail_counters};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

macro_rules! counters {
    ($name:ident => $out:ident { $($f:ident),* $(,)? }) => {
        #[derive(Default)]
        pub struct $name { $(pub $f: AtomicU64,)* }
        impl $name {
            pub fn snapshot(&self) -> $out { $out { $($f: self.$f.load(Relaxed),)* } }
        }
    };
}

counters!(Counters => nf_counters {
    bytes_written, bytes_read, ops_posted, ops_completed, ops_failed, retries,
    requests_posted, requests_completed, requests_failed, notifs_sent, notifs_received,
    progress_passes, cuda_ctx_applies,
});
counters!(RailCounters => nf_rail_counters { bytes, ops, retries, errors });

#[inline]
pub fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Relaxed);
}
