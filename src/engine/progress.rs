//! The progress thread: the driver's only owner while it runs (rule 3). It passes without
//! pause while work is outstanding, and when idle sleeps on the CQ wait fds (where the
//! provider offers them) and the engine's wake-up eventfd, bounded by the idle delay.
use super::core::Core;
use super::driver::{Driver, Idle};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the thread keeps polling after the last pass that did something: traffic comes
/// in bursts, and a napping target delays every step of a peer's RMA by its nap.
const SPIN_WINDOW: Duration = Duration::from_millis(20);
/// First sleep of an idle thread, in µs; sleeps double from here.
const MIN_NAP_US: u64 = 20;
/// Longest sleep of an idle thread when the agent gives no pthrDelay.
const DEFAULT_IDLE_US: u64 = 1000;

pub fn spawn(core: Arc<Core>, driver: Arc<Mutex<Driver>>, stop: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("nf-progress-{}", core.name.chars().take(4).collect::<String>()))
        .spawn(move || run(&core, &driver, &stop))
}

fn run(core: &Core, driver: &Mutex<Driver>, stop: &AtomicBool) {
    let idle_us = match core.cfg.progress_delay_us {
        0 => DEFAULT_IDLE_US,
        us => us.max(MIN_NAP_US),
    };
    let mut last_busy = Instant::now();
    let mut nap = MIN_NAP_US / 2;
    while !stop.load(Ordering::Acquire) {
        let busy = {
            let mut d = driver.lock().unwrap_or_else(|p| p.into_inner());
            // A panic in a pass must not kill progress for every later request.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.pass())) {
                Ok(b) => b,
                Err(_) => {
                    log::error!("{}: progress pass panicked; continuing", core.name);
                    true
                }
            }
        };
        if busy {
            last_busy = Instant::now();
            nap = MIN_NAP_US / 2;
            continue;
        }
        if last_busy.elapsed() < SPIN_WINDOW {
            std::thread::yield_now();
            continue;
        }
        core.set_sleeping(true);
        if core.has_submitted() || stop.load(Ordering::Acquire) {
            core.set_sleeping(false);
            continue;
        }
        let fds = driver.lock().unwrap_or_else(|p| p.into_inner()).idle_fds();
        let mut pfds = vec![libc::pollfd { fd: core.wake_fd, events: libc::POLLIN, revents: 0 }];
        match &fds {
            Idle::Fds(f) => pfds.extend(f.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })),
            Idle::NoFds => {}
            Idle::Busy => {
                core.set_sleeping(false);
                continue;
            }
        }
        // Inbound RMA on manual-progress providers raises no fd event until a completion
        // exists, so sleeps start short and double up to the idle cap.
        nap = (nap * 2).clamp(MIN_NAP_US, idle_us);
        let ts = libc::timespec { tv_sec: (nap / 1_000_000) as libc::time_t, tv_nsec: ((nap % 1_000_000) * 1000) as libc::c_long };
        // SAFETY: pfds is a valid array of pollfd and ts a valid timespec for the call.
        unsafe { libc::ppoll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, &ts, std::ptr::null()) };
        core.clear_wake();
        core.set_sleeping(false);
    }
}
