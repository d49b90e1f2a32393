//! Rail threads (issue 13): with several tcp or sockets rails, each rail after the first
//! gets a thread that drives the provider's progress on it, so a large transfer striped
//! over the rails moves over their connections at once. Those providers make progress only
//! inside our calls (manual progress): with one progress thread every socket read and write
//! of every rail ran on one core, and on the 16-core H200 host four rails moved 64 MiB at
//! 4.2 GB/s where four raw TCP streams moved 8.8.
//!
//! The driver still owns the rails' requests; a rail thread posts the RMA the driver queued
//! for its rail (over tcp a post is already the socket write: fabric's rail outbox) and
//! reads the rail's CQ, which is what runs the provider's progress, leaving the completions
//! in the rail's stash for the driver (fabric::Rail::progress_for_driver). The first rail
//! carries the control messages and stays the driver's alone, so their order is the
//! provider's. Rail threads spin while the progress thread is awake and their rails had
//! traffic in the last 20 ms (posts, completions, a network peer's kick), and wait otherwise:
//! same-host traffic, which goes around these rails, does not make them spin.
use super::core::Core;
use super::counters::add;
use crate::fabric::Rail;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Longest pause of a rail thread while the engine sleeps (it is woken with the progress
/// thread, so this only bounds a missed wake-up).
const IDLE_WAIT: Duration = Duration::from_millis(50);

pub struct RailThreads {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// The rails whose RMA the threads post (given back to the driver on stop).
    posting: Vec<Arc<Rail>>,
}

impl RailThreads {
    /// Starts a thread for each rail in `rails` (none where it cannot be started: the
    /// progress thread then drives that rail alone, as without rail threads).
    pub fn start(core: &Arc<Core>, rails: &[Arc<Rail>]) -> RailThreads {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let mut posting = Vec::new();
        for rail in rails {
            let (c, rail, stop) = (core.clone(), rail.clone(), stop.clone());
            let name = format!("nf-rail{}-{}", rail.index, core.name.chars().take(4).collect::<String>());
            let r = rail.clone();
            match std::thread::Builder::new().name(name).spawn(move || run(&c, &rail, &stop)) {
                Ok(h) => {
                    r.set_posts_on_thread(true);
                    posting.push(r);
                    threads.push(h)
                }
                Err(e) => log::warn!("{}: no thread for a rail ({e}); the progress thread drives it", core.name),
            }
        }
        if !threads.is_empty() {
            core.note_rail_threads();
            log::info!("{}: {} rail thread(s) drive rails {:?}", core.name, threads.len(), rails.iter().map(|r| r.index).collect::<Vec<_>>());
        }
        RailThreads { stop, threads, posting }
    }

    /// Stops and joins the threads (before the rails close).
    pub fn stop(&mut self, core: &Core) {
        // Later posts go straight to the provider; what is still queued is taken back when
        // the peers are disconnected.
        for r in self.posting.drain(..) {
            r.set_posts_on_thread(false);
        }
        self.stop.store(true, Ordering::Release);
        core.set_sleeping(false);
        for h in self.threads.drain(..) {
            if h.join().is_err() {
                log::error!("{}: a rail thread panicked", core.name);
            }
        }
    }
}

fn run(core: &Core, rail: &Rail, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        if !core.rails_wanted() {
            core.wait_for_rail_traffic(IDLE_WAIT, stop);
            continue;
        }
        let posting = rail.post_queued();
        if posting.failed > 0 {
            core.wake();
        }
        if posting.blocked {
            add(&core.rail_counters[rail.index].retries, 1);
        }
        if rail.progress_for_driver() > 0 {
            core.note_rail_traffic();
            core.wake();
        }
        std::thread::yield_now();
    }
}
