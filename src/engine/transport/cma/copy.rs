//! The copy threads of the CMA transport and what they run: cutting a run of ranges into
//! pieces, and moving one piece with process_vm_writev/readv (or memcpy between engines of
//! this process).
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Most iovecs one process_vm_* call takes (the kernel's UIO_MAXIOV).
const MAX_IOV: usize = 1024;
/// Smallest piece handed to a copy thread by default (config `cma_min_piece`); a post is
/// split only where every thread gets one (Cma::start). H100 host, 2026-12-06, 1 MiB between
/// two processes with 2 MiB-aligned buffers, the posting thread helping (Pool::help): eight
/// 128 KiB pieces 33 / 38 us WRITE / READ, four of 256 KiB 39 / 48, two of 512 KiB 80-104,
/// one piece 41-57, UCX 48-51. (Before the buffers were aligned and before the help, on the
/// H200 host 2026-12-05, the split lost to one piece, which is how 1 MiB became the limit.)
pub const MIN_PIECE: u64 = 128 << 10;
/// Where fewer than three copy threads run, the largest post copied whole (Cma::start).
pub const FEW_THREADS_SPLIT: u64 = 1 << 20;
/// Largest piece: bounds how long the driver's thread (or a caller making a pass) copies its
/// own share of a large request, during which no other peer is served.
pub const MAX_PIECE: u64 = 8 << 20;
/// Most copy threads an automatic count picks (memory bandwidth, not cores, is the limit).
pub const AUTO_MAX_THREADS: usize = 7;

/// The "peer process" of copies between engines of this process: plain memory copies.
/// (No process has pid 0, so it cannot name a real peer.)
pub const THIS_PROCESS: u32 = 0;
/// Same-process host copies at least this large go to the pool; smaller ones are copied
/// where they are posted.
pub const POOL_MIN_BYTES: u64 = 2 << 20;

/// One contiguous range pair: (local address, peer address, length).
pub type Range = (u64, u64, usize);


/// Cuts a run of ranges into pieces for `workers + 1` threads (the driver's own thread copies
/// one piece too): pieces of about total / (workers + 1) bytes, within min_piece..MAX_PIECE,
/// each at most MAX_IOV ranges. Small ranges share a piece; a large one is split.
pub fn cut(ranges: &[Range], workers: usize, min_piece: u64) -> Vec<Vec<Range>> {
    let total: u64 = ranges.iter().map(|r| r.2 as u64).sum();
    let target = total.div_ceil(workers as u64 + 1).clamp(min_piece.min(MAX_PIECE), MAX_PIECE).next_multiple_of(4096);
    let mut out: Vec<Vec<Range>> = Vec::new();
    let mut cur: Vec<Range> = Vec::new();
    let mut cur_bytes = 0u64;
    for &(l, r, n) in ranges {
        let mut off = 0usize;
        while off < n {
            let take = ((target - cur_bytes) as usize).min(n - off);
            cur.push((l + off as u64, r + off as u64, take));
            cur_bytes += take as u64;
            off += take;
            if cur_bytes >= target || cur.len() == MAX_IOV {
                out.push(std::mem::take(&mut cur));
                cur_bytes = 0;
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The largest post copied whole on the posting thread where `threads` copy threads run. A
/// post is split only where every thread gets a piece of at least `min_piece`: with fewer,
/// larger pieces a thread that wakes on a cold core holds the post up (1 MiB in two pieces
/// 80-160 us, in eight 33 us, one piece 41-57; H100). With fewer than three threads a split
/// is two or three pieces, which lost to one piece on the 2-core VM too (1 MiB READ 74-86
/// against 65-71 us): posts up to FEW_THREADS_SPLIT stay whole there.
pub fn whole_up_to(threads: usize, min_piece: u64) -> u64 {
    let every_thread_a_piece = min_piece.saturating_mul(threads as u64 + 1).saturating_sub(1);
    if threads < 3 {
        every_thread_a_piece.max(FEW_THREADS_SPLIT)
    } else {
        every_thread_a_piece
    }
}

/// Whether a run of `n` ranges and `bytes` bytes is one piece (at most `whole_up_to` bytes
/// and one system call's iovecs): it is copied where it is posted, straight from the
/// request's segments.
pub fn one_piece(n: usize, bytes: u64, whole_up_to: u64) -> bool {
    bytes <= whole_up_to && n <= MAX_IOV
}

/// The iovec lists of a process_vm_* call, kept between calls by whoever copies often (two
/// allocations per small transfer otherwise).
#[derive(Default)]
pub struct Iovecs {
    local: Vec<libc::iovec>,
    remote: Vec<libc::iovec>,
}

// SAFETY: the lists hold plain addresses, filled and used by one call at a time.
unsafe impl Send for Iovecs {}

/// Moves every range of `piece` between our memory and process `pid`'s (`write`: ours to
/// theirs). A short transfer (the peer's page went away mid-copy) is resumed once from
/// where it stopped, which then reports the kernel's error.
pub fn copy(pid: u32, write: bool, piece: &[Range]) -> Result<()> {
    copy_ranges(pid, write, piece.iter().copied(), &mut Iovecs::default())
}

/// `copy` over ranges from an iterator (at most MAX_IOV of them), with `iov` as the call's
/// lists.
pub fn copy_ranges(pid: u32, write: bool, ranges: impl Iterator<Item = Range>, iov: &mut Iovecs) -> Result<()> {
    if pid == THIS_PROCESS {
        for (l, r, n) in ranges {
            let (d, s) = if write { (r, l) } else { (l, r) };
            // SAFETY: THIS_PROCESS pieces come from the scheduler (same-process host memory): both ranges lie in live
            // registrations of engines of this process, bounds-checked at preparation;
            // `copy` tolerates overlap.
            unsafe { std::ptr::copy(s as *const u8, d as *mut u8, n) };
        }
        return Ok(());
    }
    let Iovecs { local, remote } = iov;
    local.clear();
    remote.clear();
    for (l, r, n) in ranges {
        local.push(libc::iovec { iov_base: l as *mut libc::c_void, iov_len: n });
        remote.push(libc::iovec { iov_base: r as *mut libc::c_void, iov_len: n });
    }
    let (mut li, mut ri) = (0usize, 0usize);
    while li < local.len() {
        // SAFETY: `local` describes registered memory of this process that the request
        // keeps alive (bounds-checked at preparation); the kernel checks `remote` against
        // the peer's mappings and permissions and fails the call for anything else, never
        // touching our memory outside `local`.
        let n = unsafe {
            let (lp, ln, rp, rn) = (local[li..].as_ptr(), (local.len() - li) as libc::c_ulong, remote[ri..].as_ptr(), (remote.len() - ri) as libc::c_ulong);
            if write {
                libc::process_vm_writev(pid as libc::pid_t, lp, ln, rp, rn, 0)
            } else {
                libc::process_vm_readv(pid as libc::pid_t, lp, ln, rp, rn, 0)
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(cma_error(write, e));
        }
        if n == 0 {
            return Err(cma_error(write, std::io::Error::from_raw_os_error(libc::EFAULT)));
        }
        advance(local, &mut li, n as usize);
        advance(remote, &mut ri, n as usize);
    }
    Ok(())
}

/// Drops `n` transferred bytes from the front of `v[*i..]`.
fn advance(v: &mut [libc::iovec], i: &mut usize, mut n: usize) {
    while n > 0 && *i < v.len() {
        let io = &mut v[*i];
        if n >= io.iov_len {
            n -= io.iov_len;
            *i += 1;
        } else {
            io.iov_base = (io.iov_base as usize + n) as *mut libc::c_void;
            io.iov_len -= n;
            n = 0;
        }
    }
    while *i < v.len() && v[*i].iov_len == 0 {
        *i += 1;
    }
}

fn cma_error(write: bool, e: std::io::Error) -> Error {
    let op = if write { "process_vm_writev" } else { "process_vm_readv" };
    match e.raw_os_error() {
        Some(libc::ESRCH) => Error::Disconnected(format!("{op}: the peer process exited")),
        Some(libc::EPERM) => Error::Disconnected(format!("{op}: the peer process may no longer be accessed ({e})")),
        Some(libc::EFAULT) => Error::InvalidParam(format!("{op}: the peer's memory is not mapped there any more ({e}); deregistered while in use?")),
        _ => Error::Backend(format!("{op}: {e}")),
    }
}

/// The pieces of one post that copy threads move; done when `left` reaches zero.
pub struct Batch {
    left: AtomicUsize,
    err: Mutex<Option<Error>>,
}

impl Batch {
    pub fn new(pieces: usize) -> Arc<Batch> {
        Arc::new(Batch { left: AtomicUsize::new(pieces), err: Mutex::new(None) })
    }

    pub fn finish(&self, res: Result<()>) {
        if let Err(e) = res {
            self.err.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
        }
        self.left.fetch_sub(1, Ordering::AcqRel);
    }

    pub fn done(&self) -> bool {
        self.left.load(Ordering::Acquire) == 0
    }

    pub fn result(&self) -> Result<()> {
        match self.err.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

struct Job {
    pid: u32,
    write: bool,
    piece: Vec<Range>,
    batch: Arc<Batch>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    stop: bool,
}

#[derive(Default)]
struct Shared {
    q: Mutex<Queue>,
    cv: Condvar,
    /// Pieces queued and not yet taken: what a spinning worker watches without the lock.
    queued: AtomicUsize,
    /// Workers blocked on `cv` (changed under the queue's lock): only they need a wake.
    sleepers: AtomicUsize,
    /// How long a worker that ran out of pieces keeps looking before it blocks, in µs.
    spin_us: AtomicUsize,
}

/// The engine's copy threads, started at the first request that needs them and joined when
/// the driver drops (before the plugin can be unloaded).
pub struct Pool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    want: usize,
    name: String,
}

impl Pool {
    pub fn new(name: &str, threads: usize) -> Pool {
        Pool { shared: Arc::default(), threads: Vec::new(), want: threads, name: name.to_string() }
    }

    /// Threads running (0 before the first use, or where none could be started: the driver
    /// then copies every piece itself).
    pub fn workers(&mut self) -> usize {
        while self.threads.len() < self.want {
            let shared = self.shared.clone();
            let spawned = std::thread::Builder::new().name(format!("nf-cma-{}", self.threads.len())).spawn(move || worker(&shared));
            match spawned {
                Ok(h) => self.threads.push(h),
                Err(e) => {
                    log::warn!("{}: could not start a copy thread ({e}); {} run", self.name, self.threads.len());
                    self.want = self.threads.len();
                }
            }
        }
        self.threads.len()
    }

    /// How long a copy thread that ran out of pieces keeps looking for the next before it
    /// blocks (config cma_spin_us).
    pub fn set_spin(&self, spin: Duration) {
        self.shared.spin_us.store(spin.as_micros() as usize, Ordering::Relaxed);
    }

    /// How many threads the pool is meant to have.
    pub fn wanted(&self) -> usize {
        self.want
    }

    /// Hands `pieces` to the threads; each finishes `batch` once when copied.
    pub fn submit(&self, pid: u32, write: bool, pieces: Vec<Vec<Range>>, batch: &Arc<Batch>) {
        self.push(pieces.into_iter().map(|piece| Job { pid, write, piece, batch: batch.clone() }).collect());
    }

    /// Copies on the calling thread the pieces of `batch` that no copy thread has taken yet,
    /// newest first, while fewer than `budget` bytes have been copied so. A copy thread asleep
    /// on an idle core took ~140 us to wake on the 16-core host (C-state exit), three times
    /// the whole 1 MiB copy: 1 MiB in two pieces took 160 us, in four 31-33 us only because
    /// one early thread took the others' pieces (H100, 2026-12-06). Helping bounds a post by
    /// what one thread copies; threads that are awake still share the work.
    pub fn help(&self, batch: &Arc<Batch>, budget: u64) {
        let mut copied = 0u64;
        while copied < budget {
            let job = {
                let mut q = self.shared.q.lock().unwrap_or_else(|p| p.into_inner());
                match q.jobs.back() {
                    Some(j) if Arc::ptr_eq(&j.batch, batch) => {
                        self.shared.queued.fetch_sub(1, Ordering::AcqRel);
                        q.jobs.pop_back()
                    }
                    _ => None,
                }
            };
            let Some(job) = job else { return };
            copied += job.piece.iter().map(|r| r.2 as u64).sum::<u64>();
            let res = copy(job.pid, job.write, &job.piece);
            job.batch.finish(res);
        }
    }

    fn push(&self, jobs: Vec<Job>) {
        let n = jobs.len();
        let sleepers = {
            let mut q = self.shared.q.lock().unwrap_or_else(|p| p.into_inner());
            q.jobs.extend(jobs);
            self.shared.queued.fetch_add(n, Ordering::AcqRel);
            self.shared.sleepers.load(Ordering::Acquire)
        };
        // One wake per piece, and only for blocked threads (spinning ones find the pieces
        // themselves): waking every thread for fewer pieces only has the rest contend for
        // the queue's lock and go back to sleep.
        for _ in 0..n.min(sleepers) {
            self.shared.cv.notify_one();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.q.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
        self.shared.cv.notify_all();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// A copy thread: takes pieces until the pool stops (queued pieces are still copied, so
/// no batch is left waiting).
fn worker(s: &Shared) {
    loop {
        spin_for_work(s);
        let job = {
            let mut q = s.q.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    s.queued.fetch_sub(1, Ordering::AcqRel);
                    break j;
                }
                if q.stop {
                    return;
                }
                // Counted under the lock that push takes too: a push after this sees us.
                s.sleepers.fetch_add(1, Ordering::AcqRel);
                q = s.cv.wait_timeout(q, Duration::from_millis(500)).map(|r| r.0).unwrap_or_else(|p| p.into_inner().0);
                s.sleepers.fetch_sub(1, Ordering::AcqRel);
            }
        };
        let res = copy(job.pid, job.write, &job.piece);
        job.batch.finish(res);
    }
}

/// Keeps looking for queued pieces for the configured spin, yielding the core between
/// looks, and returns once there are some or the time is up. A thread blocked on the
/// condition variable took one to tens of microseconds to wake on an idle host, about as
/// long as copying its share of a 1 MiB request takes.
fn spin_for_work(s: &Shared) {
    let spin = s.spin_us.load(Ordering::Relaxed);
    if spin == 0 {
        return;
    }
    let until = std::time::Instant::now() + Duration::from_micros(spin as u64);
    while s.queued.load(Ordering::Acquire) == 0 && std::time::Instant::now() < until {
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_splits_large_ranges_and_groups_small_ones() {
        // one 64 MiB range over 7 workers: 8 pieces of 8 MiB
        let p = cut(&[(0, 1 << 40, 64 << 20)], 7, MIN_PIECE);
        assert_eq!(p.len(), 8);
        assert!(p.iter().all(|x| x.len() == 1 && x[0].2 == 8 << 20));
        assert_eq!(p[3][0], (3 * (8 << 20), (1 << 40) + 3 * (8 << 20), 8 << 20));
        // 4096 x 4 KiB (16 MiB) over 3 workers: 4 MiB pieces of 1024 ranges
        let r: Vec<Range> = (0..4096u64).map(|i| (i * 8192, i * 4096, 4096)).collect();
        let p = cut(&r, 3, MIN_PIECE);
        assert_eq!(p.len(), 4);
        assert!(p.iter().all(|x| x.len() == 1024));
        // small totals stay one piece; the MAX_IOV cap holds with many tiny ranges
        assert_eq!(cut(&[(0, 0, 1000), (4096, 4096, 1000)], 7, MIN_PIECE).len(), 1);
        let tiny: Vec<Range> = (0..3000u64).map(|i| (i * 64, i * 64, 64)).collect();
        let p = cut(&tiny, 7, MIN_PIECE);
        assert_eq!(p.iter().map(|x| x.len()).collect::<Vec<_>>(), vec![1024, 1024, 952]);
        // every byte exactly once, in order
        let r = [(0u64, 100u64, 3 << 20), (10 << 20, 20 << 20, 100)];
        let p = cut(&r, 1, MIN_PIECE);
        let flat: Vec<Range> = p.concat();
        assert_eq!(flat.iter().map(|x| x.2).sum::<usize>(), (3 << 20) + 100);
        assert_eq!(flat.first().map(|x| (x.0, x.1)), Some((0, 100)));
    }

    #[test]
    fn copy_moves_bytes_within_this_process_and_reports_bad_addresses() {
        let src: Vec<u8> = (0..(3 << 20)).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; 3 << 20];
        let pieces = cut(&[(src.as_ptr() as u64, dst.as_mut_ptr() as u64, src.len())], 3, MIN_PIECE);
        for p in &pieces {
            copy(std::process::id(), true, p).expect("process_vm_writev to ourselves");
        }
        assert!(src == dst);
        let mut back = vec![0u8; 4096];
        copy(std::process::id(), false, &[(back.as_mut_ptr() as u64, src.as_ptr() as u64 + 4096, 4096)]).expect("readv");
        assert_eq!(&back[..], &src[4096..8192]);
        let e = copy(std::process::id(), true, &[(src.as_ptr() as u64, 8, 4096)]).expect_err("unmapped");
        assert!(matches!(e, Error::InvalidParam(_)), "{e:?}");
    }

    #[test]
    fn the_configured_default_is_this_modules_min_piece() {
        // Cma::new (the tests' engines) uses MIN_PIECE; engines built from a Config use the
        // table's default: the two must be one value.
        assert_eq!(crate::config::Config::defaults().cma_min_piece, MIN_PIECE);
    }

    #[test]
    fn a_post_is_split_only_where_every_thread_gets_a_piece() {
        assert_eq!(whole_up_to(7, MIN_PIECE), (1 << 20) - 1, "1 MiB: eight pieces of 128 KiB");
        assert_eq!(whole_up_to(7, 256 << 10), (2 << 20) - 1);
        assert_eq!(whole_up_to(1, MIN_PIECE), FEW_THREADS_SPLIT, "one thread: 1 MiB stays whole");
        assert_eq!(whole_up_to(2, 1 << 20), (3 << 20) - 1);
    }

    #[test]
    fn the_posting_thread_copies_what_no_thread_took_within_its_budget() {
        // No thread started: every queued piece waits for a helper.
        let pool = Pool::new("test", 3);
        let src: Vec<u8> = (0..(1 << 20)).map(|i| (i * 13 % 251) as u8).collect();
        let mut dst = vec![0u8; 1 << 20];
        let pieces = cut(&[(src.as_ptr() as u64, dst.as_mut_ptr() as u64, src.len())], 3, 256 << 10);
        assert_eq!(pieces.len(), 4);
        let batch = Batch::new(pieces.len());
        let other = Batch::new(1);
        let pid = std::process::id();
        // Another post's piece queued before ours stays for the threads.
        pool.push(vec![Job { pid, write: true, piece: vec![(src.as_ptr() as u64, dst.as_mut_ptr() as u64, 4096)], batch: other.clone() }]);
        pool.submit(pid, true, pieces[1..].to_vec(), &batch);
        batch.finish(copy(pid, true, &pieces[0]));
        pool.help(&batch, 256 << 10);
        assert_eq!(batch.left.load(Ordering::Acquire), 2, "one piece within the budget, then it stops");
        pool.help(&batch, MAX_PIECE);
        assert!(batch.done() && batch.result().is_ok());
        assert!(src == dst);
        assert!(!other.done(), "another post's piece is left to the threads");
        assert_eq!(pool.shared.queued.load(Ordering::Acquire), 1);
    }

    #[test]
    fn pool_threads_copy_every_piece_and_stop() {
        let mut pool = Pool::new("test", 2);
        assert_eq!(pool.workers(), 2);
        let src = vec![5u8; 8 << 20];
        let mut dst = vec![0u8; 8 << 20];
        let pieces = cut(&[(src.as_ptr() as u64, dst.as_mut_ptr() as u64, src.len())], 2, MIN_PIECE);
        let batch = Arc::new(Batch { left: AtomicUsize::new(pieces.len()), err: Mutex::new(None) });
        let pid = std::process::id();
        pool.push(pieces.into_iter().map(|piece| Job { pid, write: true, piece, batch: batch.clone() }).collect());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !batch.done() && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(batch.done());
        assert!(batch.result().is_ok());
        assert!(dst.iter().all(|&b| b == 5));
        // THIS_PROCESS pieces are plain copies, READ the other way round
        let mut again = vec![0u8; 1 << 20];
        copy(THIS_PROCESS, false, &[(again.as_mut_ptr() as u64, src.as_ptr() as u64, again.len())]).expect("memcpy");
        assert!(again.iter().all(|&b| b == 5));
        drop(pool);
    }

    /// Threads that spin between pieces take the next batches without a wake, and a pool
    /// dropped while they spin still stops.
    #[test]
    fn spinning_threads_take_back_to_back_batches_and_stop() {
        let mut pool = Pool::new("test", 2);
        pool.set_spin(Duration::from_micros(2000));
        assert_eq!(pool.workers(), 2);
        let src = vec![9u8; 4 << 20];
        let pid = std::process::id();
        for round in 0..20 {
            let mut dst = vec![0u8; 4 << 20];
            let pieces = cut(&[(src.as_ptr() as u64, dst.as_mut_ptr() as u64, src.len())], 2, MIN_PIECE);
            let batch = Batch::new(pieces.len());
            pool.submit(pid, true, pieces, &batch);
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !batch.done() && std::time::Instant::now() < deadline {
                std::thread::yield_now();
            }
            assert!(batch.done() && batch.result().is_ok(), "round {round}");
            assert!(dst.iter().all(|&b| b == 9), "round {round}");
        }
        assert_eq!(pool.shared.queued.load(Ordering::Acquire), 0);
        let t = std::time::Instant::now();
        drop(pool);
        assert!(t.elapsed() < Duration::from_secs(2), "stopped while spinning");
    }
}
