//! The progress thread: the driver's only owner while it runs (rule 3). It passes without
//! pause while work is outstanding, and when idle sleeps on the CQ wait fds (where the
//! provider offers them) and the engine's wake-up eventfd, bounded by the idle delay.
use super::core::Core;
use super::driver::{Driver, Pass};
use super::port::Port;
use super::inbox::Inbox;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// After the last pass that did something the thread keeps polling this long: traffic
/// comes in bursts, and a nap delays every step of a peer's RMA.
const SPIN_WINDOW: Duration = Duration::from_millis(20);
/// Passes right after activity that only yield the core instead of sleeping.
const YIELD_PASSES: u32 = 32;

/// First sleep of an idle thread, in µs; sleeps double from here.
const MIN_NAP_US: u64 = 10;
/// Longest sleep of an idle thread when the agent gives no pthrDelay.
const DEFAULT_IDLE_US: u64 = 1000;
/// Without a pthrDelay, after this long with nothing to do the sleeps grow to DEEP_IDLE_US:
/// a wake-up costs ~30 us here, so 1 ms naps kept an idle engine at 3 % of a core (bench,
/// 10 s). A peer's first message still wakes the thread through the CQ fds where the rails
/// have them, and the first RMA of a busy initiator comes with a KICK message.
const DEEP_IDLE_AFTER: Duration = Duration::from_secs(1);
const DEEP_IDLE_US: u64 = 20_000;
/// While a caller spins and makes the passes itself (Engine::check), the thread stays off
/// the cores: on a small host a third spinning thread is what delays the peer's progress
/// thread, and with it every manual-progress RMA, by a scheduler tick.
const CALLER_WINDOW: Duration = Duration::from_millis(1);
/// Passes this close together mean the caller spins (a Python check loop: 1-3 us).
const CALLER_GAP: Duration = Duration::from_micros(20);
const CALLER_NAP: Duration = Duration::from_micros(200);

pub fn spawn(core: Arc<Core>, driver: Arc<Mutex<Driver>>, inbox: Arc<Inbox<Driver>>, stop: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("nf-progress-{}", core.name.chars().take(4).collect::<String>()))
        .spawn(move || run(&core, &driver, &inbox, &stop))
}

fn run(core: &Core, driver: &Mutex<Driver>, inbox: &Inbox<Driver>, stop: &AtomicBool) {
    // Naps are short; without this the kernel stretches each by its default 50 µs slack.
    // SAFETY: prctl with PR_SET_TIMERSLACK takes an integer and touches no memory.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong, 0, 0, 0) };
    let idle_us = match core.cfg.progress_delay_us {
        0 => DEFAULT_IDLE_US,
        us => us.max(MIN_NAP_US),
    };
    let mut last_work = Instant::now();
    let mut quiet = 0u32;
    let mut nap = MIN_NAP_US;
    while !stop.load(Ordering::Acquire) {
        // (Not while a task waits for this thread: its caller stopped polling to wait for
        // it, and the window would keep the thread napping for a millisecond more.)
        if core.caller_spinning(CALLER_WINDOW, CALLER_GAP) && !inbox.has_items() {
            std::thread::sleep(CALLER_NAP);
            last_work = Instant::now();
            continue;
        }
        let pass = {
            let mut d = driver.lock().unwrap_or_else(|p| p.into_inner());
            // A panic in a pass must not kill progress for every later request.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.pass())) {
                Ok(p) => p,
                Err(_) => {
                    log::error!("{}: progress pass panicked; continuing", core.name);
                    Pass { did: true, pending: true }
                }
            }
        };
        if pass.did {
            last_work = Instant::now();
            quiet = 0;
            nap = MIN_NAP_US;
            continue;
        }
        quiet += 1;
        // With work in flight, or right after it, the next event is a peer's and usually
        // microseconds away: keep polling, yielding the core each pass. Manual-progress
        // providers also need this on a target, since inbound RMA raises no fd event.
        let recent = pass.pending || last_work.elapsed() < SPIN_WINDOW;
        if quiet < YIELD_PASSES || recent {
            std::thread::yield_now();
            continue;
        }
        // Idle: sleep in doubling naps on the wake eventfd (and CQ fds where they exist).
        let cap = if core.cfg.progress_delay_us == 0 && last_work.elapsed() > DEEP_IDLE_AFTER { DEEP_IDLE_US } else { idle_us };
        nap = (nap * 2).clamp(MIN_NAP_US, cap);
        core.set_sleeping(true);
        if inbox.has_items() || stop.load(Ordering::Acquire) {
            core.set_sleeping(false);
            continue;
        }
        let fds = idle_fds(driver.lock().unwrap_or_else(|p| p.into_inner()).rails());
        let mut pfds = vec![libc::pollfd { fd: core.wake_fd, events: libc::POLLIN, revents: 0 }];
        match &fds {
            Idle::Fds(f) => pfds.extend(f.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })),
            Idle::NoFds => {}
            Idle::Busy => {
                core.set_sleeping(false);
                continue;
            }
        }
        let ts = libc::timespec { tv_sec: (nap / 1_000_000) as libc::time_t, tv_nsec: ((nap % 1_000_000) * 1000) as libc::c_long };
        // SAFETY: pfds is a valid array of pollfd and ts a valid timespec for the call.
        unsafe { libc::ppoll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, &ts, std::ptr::null()) };
        core.clear_wake();
        core.set_sleeping(false);
    }
}

/// What an idle progress thread may wait on.
enum Idle {
    /// Some CQ has no wait fd: sleep on a timer only.
    NoFds,
    /// fi_trywait says events are pending: pass again instead of sleeping.
    Busy,
    Fds(Vec<i32>),
}

/// Whether the thread may sleep now, and on which CQ fds.
fn idle_fds(rails: &[Arc<dyn Port>]) -> Idle {
    let mut fds = Vec::with_capacity(rails.len());
    for r in rails {
        if !r.has_wait_fd() {
            // shm in fast-RMA mode (no fd) needs us only to recycle its command slots,
            // which the timed naps do; the other rails' fds still wake us for messages.
            if r.caps().sync_rma {
                continue;
            }
            return Idle::NoFds;
        }
        match r.wait_fd_if_idle() {
            Some(fd) => fds.push(fd),
            None => return Idle::Busy,
        }
    }
    Idle::Fds(fds)
}
