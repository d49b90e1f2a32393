//! State shared by an engine's callers, its driver and its transports: identity,
//! configuration, counters, received notifications, the wake-up fd of the progress thread,
//! and the registries of device memory and opened IPC allocations.
use super::counters::{Counters, RailCounters};
use super::fd_share::FdServer;
use super::ipc_cache::IpcCache;
use super::local_peers::ProcessView;
use super::registry::{GpuRegistry, SharedCloseQueue};
use crate::config::Config;
use crate::hinted::Hinted;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long rail threads keep spinning after their rails' last traffic. A busy initiator
/// kicks its targets every 5 ms (driver::KICK_INTERVAL), which renews it there.
const RAIL_TRAFFIC_WINDOW: Duration = Duration::from_millis(20);

pub struct Core {
    pub name: String,
    pub engine_id: u64,
    /// This host's boot id, as our connection info gives it to peers.
    pub host_id: [u8; 16],
    pub cfg: Config,
    pub conn_info: Vec<u8>,
    pub counters: Arc<Counters>,
    pub rail_counters: Vec<RailCounters>,
    pub closeq: SharedCloseQueue,
    pub gpu: Arc<GpuRegistry>,
    /// Hands the fds of our VMM registrations' chunks to same-host peers (started at the
    /// first such registration).
    pub fds: Arc<FdServer>,
    /// Peers' GPU allocations opened here by IPC.
    pub ipc: IpcCache,
    /// Every live registration, as engines of this process (and copy requests) see them.
    pub view: Arc<ProcessView>,
    /// Debug only (regression test of the seed bug): never apply captured contexts.
    pub skip_ctx_apply: bool,
    notifs: Hinted<Vec<(String, Vec<u8>)>>,
    /// The progress thread is (about to be) asleep and needs a write to `wake_fd`.
    sleeping: AtomicBool,
    pub wake_fd: i32,
    /// Rail threads wait here while the progress thread sleeps (see rail_threads).
    rail_gate: (Mutex<()>, std::sync::Condvar),
    rail_threads: AtomicBool,
    /// When the threaded rails last had traffic (ns since `born`; 0 = never): rail threads
    /// spin only within RAIL_TRAFFIC_WINDOW of it.
    rail_traffic_ns: AtomicU64,
    /// When a caller last made a progress pass itself (ns since `born`; 0 = never), and
    /// the gap to the pass before it.
    caller_pass_ns: AtomicU64,
    caller_gap_ns: AtomicU64,
    born: Instant,
}

impl Core {
    #[allow(clippy::too_many_arguments)]
    pub fn new(name: &str, engine_id: u64, host_id: [u8; 16], cfg: Config, conn_info: Vec<u8>, rails: usize, closeq: SharedCloseQueue,
               view: Arc<ProcessView>) -> Core {
        // SAFETY: eventfd takes no pointers; a failure returns -1, which we tolerate (the
        // thread then wakes on its timeout).
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        let counters = Arc::new(Counters::default());
        let gpu = Arc::new(GpuRegistry::default());
        let ipc = IpcCache::new(name, counters.clone(), gpu.clone(), cfg.timeout());
        Core {
            name: name.to_string(),
            engine_id,
            host_id,
            cfg,
            conn_info,
            counters,
            rail_counters: (0..rails).map(|_| RailCounters::default()).collect(),
            closeq,
            gpu,
            fds: Arc::new(FdServer::new(engine_id)),
            ipc,
            view,
            skip_ctx_apply: std::env::var("NIXL_FABRIC_DEBUG_SKIP_CTX_APPLY").is_ok_and(|v| v == "1"),
            notifs: Hinted::default(),
            sleeping: AtomicBool::new(false),
            wake_fd,
            rail_gate: (Mutex::new(()), std::sync::Condvar::new()),
            rail_threads: AtomicBool::new(false),
            rail_traffic_ns: AtomicU64::new(0),
            caller_pass_ns: AtomicU64::new(0),
            caller_gap_ns: AtomicU64::new(u64::MAX),
            born: Instant::now(),
        }
    }

    pub fn note_caller_pass(&self) {
        let ns = self.born.elapsed().as_nanos() as u64;
        let prev = self.caller_pass_ns.swap(ns.max(1), Ordering::Relaxed);
        let gap = if prev == 0 { u64::MAX } else { ns.saturating_sub(prev) };
        self.caller_gap_ns.store(gap, Ordering::Relaxed);
    }

    /// Whether a caller is polling in a tight loop: its last pass within `window`, and less
    /// than `gap` after the one before. (A caller that sleeps between checks makes too few
    /// passes to carry the engine alone.)
    pub fn caller_spinning(&self, window: Duration, gap: Duration) -> bool {
        let at = self.caller_pass_ns.load(Ordering::Relaxed);
        at != 0
            && self.born.elapsed().as_nanos() as u64 <= at + window.as_nanos() as u64
            && self.caller_gap_ns.load(Ordering::Relaxed) <= gap.as_nanos() as u64
    }

    pub fn push_notif(&self, sender: String, msg: Vec<u8>) {
        self.notifs.lock().push((sender, msg));
    }

    pub fn take_notifs(&self) -> Vec<(String, Vec<u8>)> {
        self.notifs.lock_if_any().map(|mut n| std::mem::take(&mut *n)).unwrap_or_default()
    }

    /// The IPC route is on: config gpu_ipc, and same_host_shm (the switch of every
    /// same-host path).
    pub fn ipc_enabled(&self) -> bool {
        self.cfg.gpu_ipc && self.cfg.same_host_shm
    }

    /// Makes `ctx` current unless the debug switch says to reproduce the seed bug.
    pub fn apply_ctx(&self, ctx: &crate::cuda::Context) -> crate::error::Result<()> {
        if !self.skip_ctx_apply {
            ctx.make_current()?;
        }
        Ok(())
    }

    pub fn wake(&self) {
        if self.sleeping.load(Ordering::SeqCst) && self.wake_fd >= 0 {
            let one: u64 = 1;
            // SAFETY: writing 8 bytes from a valid u64 to our eventfd.
            unsafe { libc::write(self.wake_fd, &one as *const u64 as *const libc::c_void, 8) };
        }
    }

    pub fn set_sleeping(&self, v: bool) {
        if !v && self.rail_threads.load(Ordering::Relaxed) {
            // under the gate's lock, so a rail thread between its look and its wait
            // cannot miss the wake-up
            let _g = self.rail_gate.0.lock().unwrap_or_else(|p| p.into_inner());
            self.sleeping.store(false, Ordering::SeqCst);
            self.rail_gate.1.notify_all();
            return;
        }
        self.sleeping.store(v, Ordering::SeqCst);
    }

    /// Rail threads exist: waking the progress thread wakes them too.
    pub fn note_rail_threads(&self) {
        self.rail_threads.store(true, Ordering::Relaxed);
    }

    /// The threaded rails carry traffic now (a post, a completion, a peer's kick for data
    /// over them). Rail threads that had stopped spinning are woken.
    pub fn note_rail_traffic(&self) {
        let ns = self.born.elapsed().as_nanos() as u64;
        let prev = self.rail_traffic_ns.swap(ns.max(1), Ordering::SeqCst);
        if self.rail_threads.load(Ordering::Relaxed) && ns.saturating_sub(prev) >= RAIL_TRAFFIC_WINDOW.as_nanos() as u64 {
            // under the gate's lock: a rail thread between its look and its wait cannot
            // miss this
            let _g = self.rail_gate.0.lock().unwrap_or_else(|p| p.into_inner());
            self.rail_gate.1.notify_all();
        }
    }

    fn rail_traffic_recent(&self) -> bool {
        let at = self.rail_traffic_ns.load(Ordering::SeqCst);
        at != 0 && self.born.elapsed().as_nanos() as u64 <= at + RAIL_TRAFFIC_WINDOW.as_nanos() as u64
    }

    /// Whether rail threads should drive their rails now: the progress thread is awake and
    /// the rails had traffic lately. (Spinning for same-host traffic, which never touches
    /// them, cost small same-host transfers up to 2x on the 16-core host with four rails.)
    pub fn rails_wanted(&self) -> bool {
        !self.is_sleeping() && self.rail_traffic_recent()
    }

    /// A rail thread's pause while it is not wanted (see `rails_wanted`): until traffic,
    /// `stop`, or at most `max`.
    pub fn wait_for_rail_traffic(&self, max: std::time::Duration, stop: &AtomicBool) {
        let g = self.rail_gate.0.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self.rail_gate.1.wait_timeout_while(g, max, |_| !self.rails_wanted() && !stop.load(Ordering::Acquire));
    }

    pub fn is_sleeping(&self) -> bool {
        self.sleeping.load(Ordering::SeqCst)
    }

    pub fn clear_wake(&self) {
        let mut v: u64 = 0;
        // SAFETY: reading 8 bytes into a valid u64 from our non-blocking eventfd.
        unsafe { libc::read(self.wake_fd, &mut v as *mut u64 as *mut libc::c_void, 8) };
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        if self.wake_fd >= 0 {
            // SAFETY: closing the eventfd we opened, once.
            unsafe { libc::close(self.wake_fd) };
        }
    }
}
