//! Peers that need no network to reach their memory: engines of this same process, whose
//! registrations are addressable here as they are, and processes of this host, whose
//! liveness a pidfd tells (pidfd_open needs no ptrace permission, unlike CMA, which
//! Ubuntu's Yama ptrace_scope=1 refuses between unrelated processes).
use super::registry::{LocalMem, MemKind};
use super::wire::ConnInfo;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::{pidfd_open, Pid, PidfdFlags};
use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant};

/// What this process knows of one of its engines: the token it publishes (so a peer that
/// claims to be in this process is checked) and every live registration.
pub struct ProcessView {
    engine_id: u64,
    token: [u8; 16],
    regions: Mutex<BTreeMap<(u64, u64), Weak<LocalMem>>>,
    seq: AtomicU64,
}

/// The engines alive in this process, by engine id.
static VIEWS: LazyLock<Mutex<HashMap<u64, Weak<ProcessView>>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

impl ProcessView {
    /// Publishes an engine; withdrawn when the returned view is dropped.
    pub fn publish(engine_id: u64, token: [u8; 16]) -> Arc<ProcessView> {
        let v = Arc::new(ProcessView { engine_id, token, regions: Mutex::new(BTreeMap::new()), seq: AtomicU64::new(0) });
        VIEWS.lock().unwrap_or_else(|p| p.into_inner()).insert(engine_id, Arc::downgrade(&v));
        v
    }

    pub fn add(&self, m: &Arc<LocalMem>) {
        let mut r = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        r.retain(|_, w| w.strong_count() > 0);
        r.insert((m.base, self.seq.fetch_add(1, Ordering::Relaxed)), Arc::downgrade(m));
    }

    /// The live registration of `kind` holding all of `[addr, addr+len)`, if any. Looks at
    /// the few registrations that start at or below `addr`, nearest first.
    pub fn find(&self, addr: u64, len: u64, kind: MemKind) -> Option<Arc<LocalMem>> {
        let r = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        r.range(..=(addr, u64::MAX))
            .rev()
            .take(16)
            .filter_map(|(_, w)| w.upgrade())
            .find(|m| m.kind == kind && m.check(addr, len, "").is_ok())
    }
}

impl Drop for ProcessView {
    fn drop(&mut self) {
        let mut v = VIEWS.lock().unwrap_or_else(|p| p.into_inner());
        if v.get(&self.engine_id).is_some_and(|w| w.strong_count() == 0) {
            v.remove(&self.engine_id);
        }
    }
}

/// The view of the engine `info` describes, when it lives in this process and publishes the
/// token its connection info names.
pub fn same_process(info: &ConnInfo) -> Option<Weak<ProcessView>> {
    let p = info.process.as_ref()?;
    if p.pid != std::process::id() {
        return None;
    }
    let views = VIEWS.lock().unwrap_or_else(|p| p.into_inner());
    let v = views.get(&info.engine_id)?.upgrade()?;
    (v.token == p.token).then(|| Arc::downgrade(&v))
}

/// A process of this host watched through a pidfd: readable once the process has exited.
/// Also remembers when a poll last found it alive (ns since `SINCE`, 0 = never, EXITED).
pub struct PidFd(OwnedFd, AtomicU64);

/// Clock origin of PidFd's last-seen-alive stamps.
static SINCE: LazyLock<Instant> = LazyLock::new(Instant::now);
/// PidFd's stamp once a poll has seen the exit.
const EXITED: u64 = u64::MAX;

impl PidFd {
    pub fn open(pid: u32) -> Option<PidFd> {
        // A pid that is not positive names no process (pidfd_open would refuse it too).
        let pid = Pid::from_raw(i32::try_from(pid).ok()?)?;
        let fd = pidfd_open(pid, PidfdFlags::empty()).ok()?;
        Some(PidFd(fd, AtomicU64::new(0)))
    }

    /// Whether the process has exited (one non-blocking poll).
    pub fn exited(&self) -> bool {
        let mut p = [PollFd::new(&self.0, PollFlags::IN)];
        let n = poll(&mut p, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })).unwrap_or(0);
        let gone = n > 0 && p[0].revents().intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR);
        // An exit is final: remembered as EXITED, never answered from an older alive stamp.
        let stamp = if gone { EXITED } else { (SINCE.elapsed().as_nanos() as u64).clamp(1, EXITED - 1) };
        self.1.store(stamp, Ordering::Relaxed);
        gone
    }

    /// Whether the process was seen alive within `age`, polling only if not: for the check
    /// before a copy, which guards against writing into a reused pid (a pid is not reused
    /// within microseconds of its process's exit: the pid space has to wrap first).
    /// `now` is the caller's clock reading (a pass reads the clock once).
    pub fn exited_since(&self, age: Duration, now: Instant) -> bool {
        let seen = self.1.load(Ordering::Relaxed);
        if seen == EXITED {
            return true;
        }
        let now_ns = now.saturating_duration_since(*SINCE).as_nanos() as u64;
        if seen != 0 && now_ns.saturating_sub(seen) <= age.as_nanos() as u64 {
            return false;
        }
        self.exited()
    }
}

/// How recently a peer seen alive needs no new pidfd poll before a copy starts (pid reuse
/// needs the pid space to wrap, far longer than this); the check after a copy always polls.
pub const RECENTLY_ALIVE: Duration = Duration::from_micros(200);

/// How an engine reaches a peer's memory without the network, if it can.
pub enum Locality {
    /// Another host, or nothing known: only the rails.
    Remote,
    /// Another process of this host (watched when a pidfd could be opened).
    SameHost(Option<PidFd>),
    /// An engine of this process.
    SameProcess(Weak<ProcessView>),
}

impl Locality {
    pub fn of(info: &ConnInfo, same_host: bool) -> Locality {
        if !same_host {
            return Locality::Remote;
        }
        if let Some(v) = same_process(info) {
            return Locality::SameProcess(v);
        }
        Locality::SameHost(info.process.as_ref().and_then(|p| PidFd::open(p.pid)))
    }

    /// False once the peer is known to be gone (its process exited, or its engine in this
    /// process was destroyed).
    pub fn alive(&self) -> bool {
        match self {
            Locality::Remote | Locality::SameHost(None) => true,
            Locality::SameHost(Some(fd)) => !fd.exited(),
            Locality::SameProcess(v) => v.strong_count() > 0,
        }
    }

    /// As `alive`, but a same-host process seen alive within `age` is not polled again
    /// (see PidFd::exited_since).
    pub fn alive_within(&self, age: Duration) -> bool {
        self.alive_within_at(age, Instant::now())
    }

    /// As `alive_within`, with the time taken by the caller.
    pub fn alive_within_at(&self, age: Duration, now: Instant) -> bool {
        match self {
            Locality::SameHost(Some(fd)) => !fd.exited_since(age, now),
            _ => self.alive(),
        }
    }

    pub fn watched(&self) -> bool {
        matches!(self, Locality::SameHost(Some(_)) | Locality::SameProcess(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pidfd_sees_a_child_exit() {
        let mut child = std::process::Command::new("sleep").arg("5").spawn().expect("spawn sleep");
        let fd = PidFd::open(child.id()).expect("pidfd_open");
        assert!(!fd.exited());
        child.kill().expect("kill");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !fd.exited() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(fd.exited());
        let _ = child.wait();
    }

    /// A poll that found the process alive is reused only within the given age: a long age
    /// keeps answering from it after the exit, a zero age polls again and sees the exit.
    #[test]
    fn pidfd_reuses_a_recent_alive_poll_only_within_its_age() {
        let mut child = std::process::Command::new("sleep").arg("5").spawn().expect("spawn sleep");
        let fd = PidFd::open(child.id()).expect("pidfd_open");
        assert!(!fd.exited_since(Duration::ZERO, Instant::now()), "never polled: polls, alive");
        child.kill().expect("kill");
        let _ = child.wait();
        assert!(!fd.exited_since(Duration::from_secs(60), Instant::now()), "seen alive moments ago counts");
        assert!(fd.exited_since(Duration::ZERO, Instant::now()), "a fresh poll sees the exit");
        assert!(fd.exited_since(Duration::from_secs(60), Instant::now()), "an exit is never cached away");
    }
}
