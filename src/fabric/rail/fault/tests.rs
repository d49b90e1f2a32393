//! The fault layer over a real tcp rail on lo that writes into its own memory (RMA to its
//! own address), one test per fault kind.
//!
//! Posting is unsafe (fabric::Rail): here every buffer lives in a `Bufs` (or a local
//! registered before its post) that outlives the polls that collect its completions, the
//! contexts are plain tags (never dereferenced: the provider hands them back), and a test
//! ends only after everything it posted completed, or with the rail dropped first.
use super::super::{Completion, CqError, Posted, Rail, RmaSeg};
use crate::config::Config;
use crate::error::Error;
use std::ffi::c_void;
use std::time::{Duration, Instant};

const BS: usize = 4096;

fn tcp_rail(spec: &str, want_wait_fd: bool) -> (Rail, u64) {
    let mut c = Config::defaults();
    c.set("provider", "tcp").unwrap();
    c.set("iface", "lo").unwrap();
    c.set("fault_inject", spec).unwrap();
    let specs = crate::fabric::discover(&c, false).expect("tcp on lo");
    let rail = Rail::open("fault-test", &specs[0], 0, want_wait_fd).expect("rail");
    let me = rail.av_insert(&rail.name.clone()).expect("own address");
    (rail, me)
}

/// Source and destination buffers of `n` blocks, registered on the rail.
struct Bufs {
    // The regions are dropped (closed) before the memory they cover.
    ms: crate::fabric::MemoryRegion,
    md: crate::fabric::MemoryRegion,
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Bufs {
    fn new(rail: &Rail, n: usize) -> Bufs {
        let src: Vec<u8> = (0..n * BS).map(|i| (i * 13 + 5) as u8).collect();
        let dst = vec![0u8; n * BS];
        // SAFETY: the Vecs move into Bufs (their heap blocks do not move) and are freed after
        // the regions close (field order).
        let (ms, md) = unsafe { (rail.register(src.as_ptr(), src.len(), 11, None).unwrap(), rail.register(dst.as_ptr(), dst.len(), 12, None).unwrap()) };
        Bufs { ms, md, src, dst }
    }

    fn seg(&mut self, rail: &Rail, i: usize) -> RmaSeg {
        let raddr = if rail.caps.virt_addr { self.dst.as_ptr() as u64 + (i * BS) as u64 } else { (i * BS) as u64 };
        RmaSeg { local: self.src[i * BS..].as_mut_ptr(), len: BS, desc: self.ms.desc, raddr, rkey: self.md.key }
    }

    fn write(&mut self, rail: &Rail, me: u64, i: usize, ctx: usize) -> crate::error::Result<Posted> {
        let s = self.seg(rail, i);
        // SAFETY: both ends are in this Bufs' registrations (module comment).
        unsafe { rail.write(s.local, s.len, s.desc, me, s.raddr, s.rkey, ctx as *mut c_void, false, false) }
    }
}

fn ctx(v: usize) -> *mut c_void {
    v as *mut c_void
}

type Got = Vec<std::result::Result<usize, (usize, i32)>>;

/// One poll of the rail into `got` (completions of our operations, or error entries).
fn poll_once(rail: &Rail, got: &mut Got, thread_path: bool) {
    let mut buf = [Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; 64];
    if thread_path {
        rail.post_queued();
        rail.progress_for_driver();
    }
    match rail.poll(&mut buf) {
        Ok(n) => got.extend(buf[..n].iter().filter(|c| !c.is_remote_write()).map(|c| Ok(c.ctx as usize))),
        Err(CqError { ctx, errno, .. }) => got.push(Err((ctx as usize, errno))),
    }
}

/// Polls until `want` entries came back.
fn collect(rail: &Rail, want: usize, thread_path: bool) -> Got {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.len() < want {
        assert!(Instant::now() < deadline, "{} of {want} completions", got.len());
        poll_once(rail, &mut got, thread_path);
    }
    got
}

/// Posts until the provider takes it (its own FI_EAGAIN: the tx queue is full, or the
/// connection to ourselves is still being made), keeping what the polls in between read.
fn post_retry(rail: &Rail, got: &mut Got, mut post: impl FnMut() -> crate::error::Result<Posted>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while post().unwrap() == Posted::Again {
        assert!(Instant::now() < deadline, "the provider never took the post");
        poll_once(rail, got, false);
    }
}

#[test]
fn off_by_default() {
    let (rail, _) = tcp_rail("", false);
    assert!(rail.fault_counts().is_none());
}

/// eagain=1: every kind of post answers FI_EAGAIN and nothing reaches the provider.
#[test]
fn eagain_refuses_every_post() {
    let (rail, me) = tcp_rail("eagain=1", false);
    let mut b = Bufs::new(&rail, 4);
    for i in 0..4 {
        assert_eq!(b.write(&rail, me, i, 1 + i).unwrap(), Posted::Again);
    }
    let s = b.seg(&rail, 0);
    let segs = [b.seg(&rail, 0), b.seg(&rail, 1)];
    // SAFETY: registered buffers of `b`; nothing reaches the provider (eagain=1), and the
    // queued one is taken back below.
    unsafe {
        assert_eq!(rail.read(s.local, s.len, s.desc, me, s.raddr, s.rkey, ctx(9), false).unwrap(), Posted::Again);
        if rail.caps.rma_batch >= 2 {
            assert_eq!(rail.rma_batch(true, &segs, me, ctx(10), false, false).unwrap(), Posted::Again);
        }
        assert_eq!(rail.send(s.local, 16, s.desc, me, ctx(11)).unwrap(), Posted::Again);
        assert_eq!(rail.recv(s.local, 16, s.desc, ctx(12)).unwrap(), Posted::Again);
        // Queued for a rail thread: it keeps the operation at the front and reports blocked.
        rail.queue_rma(true, &[s], me, ctx(13), false).unwrap();
    }
    let p = rail.post_queued();
    assert!(p.blocked && p.posted == 0 && p.failed == 0 && rail.has_queued(), "{p:?}");
    let mut buf = [Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; 8];
    for _ in 0..100 {
        assert_eq!(rail.poll(&mut buf).map_err(|e| e.detail).unwrap(), 0, "nothing was posted");
    }
    let c = rail.fault_counts().unwrap();
    assert!(c.eagain >= 8 && c.failed_posts == 0, "{c:?}");
    assert!(b.dst.iter().all(|&x| x == 0));
    rail.take_queued_for(me);
}

/// After an injected FI_EAGAIN the next `eagain_burst` posts answer it too (a storm), and
/// the operations the provider took complete exactly once.
#[test]
fn eagain_comes_in_bursts() {
    let (rail, me) = tcp_rail("eagain=0.1,eagain_burst=6,seed=3", false);
    const N: usize = 64;
    let mut b = Bufs::new(&rail, N);
    // Whether each post was refused by the layer (the provider may refuse some itself).
    let mut injected = Vec::new();
    let mut got = Vec::new();
    for i in 0..N {
        post_retry(&rail, &mut got, || {
            let before = rail.fault_counts().unwrap().eagain;
            let a = b.write(&rail, me, i, 1 + i);
            injected.push(rail.fault_counts().unwrap().eagain > before);
            a
        });
    }
    let first = injected.iter().position(|&x| x).expect("p=0.1 over 64 posts hits");
    assert!(injected[first..first + 7].iter().all(|&x| x), "{injected:?}");
    let left = N - got.len();
    got.extend(collect(&rail, left, false));
    let mut got: Vec<usize> = got.into_iter().map(|r| r.unwrap()).collect();
    got.sort_unstable();
    assert_eq!(got, (1..=N).collect::<Vec<_>>(), "each retried write completes once");
}

/// post_fail=1: posts fail as the provider fails them (op, rail, code); a queued one comes
/// back as an error completion with its context.
#[test]
fn post_fail_fails_posts_with_a_provider_error() {
    let (rail, me) = tcp_rail("post_fail=1", false);
    let mut b = Bufs::new(&rail, 2);
    match b.write(&rail, me, 0, 1) {
        Err(Error::Fabric { op: "fi_writemsg", rail: Some(0), code, .. }) => assert_eq!(code, -libc::EIO),
        other => panic!("{other:?}"),
    }
    let s = b.seg(&rail, 1);
    // SAFETY: registered buffers of `b`; the failed posts reach nothing, and the receive
    // that is posted stays in `b` until the rail is dropped (first, below).
    unsafe {
        assert!(matches!(rail.read(s.local, s.len, s.desc, me, s.raddr, s.rkey, ctx(2), false), Err(Error::Fabric { op: "fi_readmsg", .. })));
        assert!(matches!(rail.send(s.local, 16, s.desc, me, ctx(3)), Err(Error::Fabric { op: "fi_send", .. })));
        // Receives fail only with post_fail_recv.
        assert_eq!(rail.recv(s.local, 16, s.desc, ctx(4)).unwrap(), Posted::Ok);
        rail.queue_rma(true, &[s], me, ctx(5), false).unwrap();
    }
    let p = rail.post_queued();
    assert_eq!((p.posted, p.failed), (0, 1));
    assert_eq!(collect(&rail, 1, false), vec![Err((5, libc::EIO))]);
    assert_eq!(rail.fault_counts().unwrap().failed_posts, 4);
    drop(rail);
    drop(b);
}

/// cq_error=1: each completed write comes back once, as an error completion with its
/// context; receive completions stay clean unless cq_error_recv asks.
#[test]
fn cq_error_turns_completions_into_errors() {
    let (rail, me) = tcp_rail("cq_error=1", false);
    const N: usize = 8;
    let mut b = Bufs::new(&rail, N + 1);
    let mut got = Vec::new();
    for i in 0..N {
        post_retry(&rail, &mut got, || b.write(&rail, me, i, 1 + i));
    }
    let left = N - got.len();
    got.extend(collect(&rail, left, false));
    got.sort_unstable();
    assert_eq!(got, (1..=N).map(|c| Err((c, libc::EIO))).collect::<Vec<_>>());
    // A message to ourselves: the send's completion is an error, the receive's is not.
    let s = b.seg(&rail, N);
    let rbuf = b.dst[N * BS..].as_mut_ptr();
    let mut got = Vec::new();
    // SAFETY: both buffers are in `b`'s registrations; both operations complete below.
    post_retry(&rail, &mut got, || unsafe { rail.recv(rbuf, 64, b.md.desc, ctx(100)) });
    // SAFETY: as above.
    post_retry(&rail, &mut got, || unsafe { rail.send(s.local, 64, s.desc, me, ctx(101)) });
    let left = 2 - got.len();
    got.extend(collect(&rail, left, false));
    got.sort_unstable();
    assert_eq!(got, vec![Ok(100), Err((101, libc::EIO))]);
    assert_eq!(rail.fault_counts().unwrap().cq_errors, N as u64 + 1);
}

/// reorder=1: every completion is held back 1..=delay polls and released shuffled: N writes
/// all complete exactly once, in another order than posted, with their bytes in place; the
/// rail reports itself busy (no idle wait fd) while it holds any. Both read paths: the
/// driver's `poll`, and a rail thread's `progress_for_driver` into the stash.
#[test]
fn reorder_delivers_every_completion_once_out_of_order() {
    for thread_path in [false, true] {
        let (rail, me) = tcp_rail("reorder=1,delay=6,hold=64,seed=7", true);
        const N: usize = 48;
        let mut b = Bufs::new(&rail, N);
        let mut early = Vec::new();
        for i in 0..N {
            if thread_path {
                let s = b.seg(&rail, i);
                // SAFETY: `b`'s registered buffers; every operation completes below.
                unsafe { rail.queue_rma(true, &[s], me, ctx(1 + i), false) }.unwrap();
            } else {
                post_retry(&rail, &mut early, || b.write(&rail, me, i, 1 + i));
            }
        }
        // Poll until something is held, then the rail must not look idle.
        let deadline = Instant::now() + Duration::from_secs(20);
        while rail.fault_counts().unwrap().held == 0 {
            assert!(Instant::now() < deadline, "nothing held");
            poll_once(&rail, &mut early, thread_path);
        }
        assert!(rail.has_stashed());
        if rail.has_wait_fd() {
            assert_eq!(rail.wait_fd_if_idle(), None, "a rail holding completions is not idle");
        }
        let left = N - early.len();
        early.extend(collect(&rail, left, thread_path));
        let got: Vec<usize> = early.into_iter().map(|r| r.unwrap()).collect();
        assert_ne!(got, (1..=N).collect::<Vec<_>>(), "completions came in posting order");
        let mut sorted = got.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (1..=N).collect::<Vec<_>>(), "each exactly once");
        assert_eq!(rail.fault_counts().unwrap().held, N as u64);
        // Nothing left behind: the rail is idle again.
        let mut more = [Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; 64];
        for _ in 0..16 {
            assert_eq!(rail.poll(&mut more).map_err(|e| e.detail).unwrap(), 0);
        }
        assert!(!rail.has_stashed());
        // Writes complete at transmit over tcp: read the target back (ordered on one
        // connection) before comparing.
        let mut back = vec![0u8; N * BS];
        // SAFETY: `back` outlives `mb` (declared before it, dropped after it).
        let mb = unsafe { rail.register(back.as_ptr(), back.len(), 13, None) }.unwrap();
        let raddr = if rail.caps.virt_addr { b.dst.as_ptr() as u64 } else { 0 };
        let mut got = Vec::new();
        // SAFETY: into `back`, registered as `mb`; the read completes before `back` is read.
        post_retry(&rail, &mut got, || unsafe { rail.read(back.as_mut_ptr(), back.len(), mb.desc, me, raddr, b.md.key, ctx(999), false) });
        let left = 1 - got.len();
        got.extend(collect(&rail, left, false));
        assert_eq!(got, vec![Ok(999)]);
        assert!(back == b.src, "bytes differ");
    }
}
