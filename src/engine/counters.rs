//! Monotonic counters, readable through the C ABI while the engine runs.
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

macro_rules! counters {
    ($name:ident => $out:ident { $($f:ident),* $(,)? }) => {
        #[derive(Default)]
        pub struct $name { $(pub $f: AtomicU64,)* }
        /// A copy of the counters at one moment (the C ABI converts it to its struct).
        #[derive(Default, Clone, Copy, Debug)]
        pub struct $out { $(pub $f: u64,)* }
        impl $name {
            pub fn snapshot(&self) -> $out { $out { $($f: self.$f.load(Relaxed),)* } }
        }
    };
}

counters!(Counters => CounterSnapshot {
    bytes_written, bytes_read, ops_posted, ops_completed, ops_failed, retries,
    requests_posted, requests_completed, requests_failed, notifs_sent, notifs_received,
    // Notifications sent right behind their data (FI_ORDER_SAW; not in the C struct).
    notifs_ordered,
    // Passes that read no rail (Driver::pass_local; not in the C struct).
    local_passes,
    progress_passes, cuda_ctx_applies,
    gpu_direct_bytes, gpu_ipc_opens, gpu_ipc_closes, gpu_batch_calls, gpu_copy_calls,
    gpu_kernel_launches, cma_bytes, stage_requests, stage_served,
});
counters!(RailCounters => RailCounterSnapshot { bytes, ops, retries, errors });

#[inline]
pub fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Relaxed);
}
