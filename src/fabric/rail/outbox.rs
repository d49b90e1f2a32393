//! A rail's outbox (issue 13): RMA operations the driver hands to the rail's own thread to
//! post. Over tcp, posting a write already sends it: the provider writes into the socket
//! inside fi_writemsg until the socket is full (over loopback, which also runs the
//! receiver's side of the stack in that call). With every post on the driver's thread, the
//! sends of all rails ran on one core, and on the 16-core H200 host eight rails moved a
//! 64 MiB WRITE at 0.30x of eight raw TCP streams while READs, whose sends run on the
//! target's rail threads, reached 1.21x. A rail with a thread therefore posts its own RMA.
//!
//! Rules: the driver queues (never blocks on the provider); the rail thread posts under the
//! domain lock, oldest first, and keeps an operation the provider refused for now (FI_EAGAIN)
//! at the front; an operation the provider rejects comes back to the driver as an error
//! completion with its context, through the stash, in order with the rail's other
//! completions. Before a peer's address leaves the AV the driver takes back what is still
//! queued for it.
use super::{CqError, Posted, Rail, RmaSeg, MAX_RMA_BATCH};
use std::ffi::c_void;
use std::sync::atomic::Ordering;

/// One RMA operation waiting in a rail's outbox.
pub(crate) struct QueuedRma {
    write: bool,
    segs: [RmaSeg; MAX_RMA_BATCH],
    n: usize,
    dest: super::FiAddr,
    ctx: *mut c_void,
    dc: bool,
}

/// What a rail thread's turn at the outbox did.
#[derive(Default, Debug, PartialEq, Eq)]
pub struct Posting {
    pub posted: usize,
    /// The provider's queue was full (FI_EAGAIN): the rest waits for progress.
    pub blocked: bool,
    /// Operations rejected by the provider, handed to the driver as error completions.
    pub failed: usize,
}

/// Most operations one turn posts before the thread reads the CQ again (sends over tcp
/// also advance inside the CQ read; a long run of posts would starve it).
const POSTS_PER_TURN: usize = 32;

impl Rail {
    /// Whether the rail's thread posts this rail's RMA from now on (see `queue_rma`).
    pub fn set_posts_on_thread(&self, on: bool) {
        self.posts_on_thread.store(on, Ordering::Release);
    }

    /// Whether RMA for this rail goes through its outbox.
    pub fn posts_on_thread(&self) -> bool {
        self.posts_on_thread.load(Ordering::Acquire)
    }

    /// Queues an RMA operation for the rail thread (the driver's side of `rma_batch`): its
    /// completion, or its rejection, arrives through `poll` like any other.
    ///
    /// # Safety
    /// Every local buffer of the operation lies inside memory registered on this rail's
    /// domain (its `desc` from that registration, or null where the provider needs none),
    /// and stays valid, and for a read is not accessed by anyone else, until the
    /// operation's completion or error completion has been read from this rail (or, for
    /// `queue_rma`, the operation was taken back unposted). `ctx` is a live operation slot
    /// of the caller that stays allocated, and is not used for another outstanding
    /// operation, until then. `dest` came from this rail's `av_insert` and stays in the AV
    /// until then; `raddr`/`rkey` name memory the peer registered for remote access.
    pub unsafe fn queue_rma(&self, write: bool, segs: &[RmaSeg], dest: super::FiAddr, ctx: *mut c_void, dc: bool) -> crate::error::Result<Posted> {
        let n = segs.len();
        self.check_batch(n)?;
        let mut q = QueuedRma { write, segs: [segs[0]; MAX_RMA_BATCH], n, dest, ctx, dc };
        q.segs[..n].copy_from_slice(segs);
        self.outbox.lock().unwrap_or_else(|p| p.into_inner()).push_back(q);
        Ok(Posted::Ok)
    }

    /// Whether operations wait in the outbox.
    pub fn has_queued(&self) -> bool {
        !self.outbox.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    /// The rail thread's turn: posts what is queued, oldest first, while the provider takes
    /// it. Steps aside while a driver call waits for the domain.
    pub fn post_queued(&self) -> Posting {
        let mut out = Posting::default();
        if !self.has_queued() {
            return out;
        }
        let Some(_domain) = self.calls.try_lock_yielding() else { return out };
        while out.posted + out.failed < POSTS_PER_TURN {
            // Taken under the domain lock: `take_queued_for` (same lock) sees every
            // operation either still queued or already with the provider.
            let (q, more) = {
                let mut ob = self.outbox.lock().unwrap_or_else(|p| p.into_inner());
                let Some(q) = ob.pop_front() else { break };
                let more = !ob.is_empty();
                (q, more)
            };
            match self.post_rma_locked(q.write, &q.segs[..q.n], q.dest, q.ctx, more, q.dc) {
                Ok(Posted::Ok) => out.posted += 1,
                Ok(Posted::Again) => {
                    self.outbox.lock().unwrap_or_else(|p| p.into_inner()).push_front(q);
                    out.blocked = true;
                    break;
                }
                Err(e) => {
                    log::error!("rail {}: {e}", self.index);
                    let errno = match e {
                        crate::error::Error::Fabric { code, .. } => code.abs(),
                        _ => libc::EIO,
                    };
                    self.stash.lock().push_back(Err(CqError { ctx: q.ctx, errno, detail: e.to_string() }));
                    out.failed += 1;
                }
            }
        }
        out
    }

    /// Takes back the operations still queued for `dest` (the peer is leaving the AV): their
    /// contexts, for the driver to fail.
    pub fn take_queued_for(&self, dest: super::FiAddr) -> Vec<*mut c_void> {
        self.take_queued_where(|q| q.dest == dest)
    }

    /// Takes back the queued operations whose context `pick` names (a request that failed
    /// or was cancelled: its memory may be freed once it is released).
    pub fn take_queued_with(&self, pick: impl Fn(*mut c_void) -> bool) -> Vec<*mut c_void> {
        self.take_queued_where(|q| pick(q.ctx))
    }

    fn take_queued_where(&self, pick: impl Fn(&QueuedRma) -> bool) -> Vec<*mut c_void> {
        // Under the domain lock: a rail thread pops and posts under it, so every operation
        // is either still here or already with the provider.
        let _domain = self.calls.lock();
        let mut ob = self.outbox.lock().unwrap_or_else(|p| p.into_inner());
        let mut taken = Vec::new();
        ob.retain(|q| {
            if pick(q) {
                taken.push(q.ctx);
                false
            } else {
                true
            }
        });
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Completion, Rail, RmaSeg};
    use crate::config::Config;
    use std::time::{Duration, Instant};

    /// A tcp rail on lo with its own address in its AV (RMA to itself).
    fn tcp_rail() -> (Rail, u64) {
        let mut c = Config::defaults();
        c.set("provider", "tcp").unwrap();
        c.set("iface", "lo").unwrap();
        let specs = crate::fabric::discover(&c, false).expect("tcp on lo");
        let rail = Rail::open("outbox-test", &specs[0], 0, false).expect("rail");
        let me = rail.av_insert(&rail.name.clone()).expect("own address");
        (rail, me)
    }

    fn seg(local: &mut [u8], desc: *mut std::ffi::c_void, raddr: u64, rkey: u64) -> RmaSeg {
        RmaSeg { local: local.as_mut_ptr(), len: local.len(), desc, raddr, rkey }
    }

    /// Over the real tcp provider: queued writes are posted by `post_queued` and complete
    /// with their contexts, bytes in place; what `take_queued_with`/`_for` take back (by
    /// context, by peer) is never posted.
    #[test]
    fn queued_writes_are_posted_in_order_and_taken_back_unposted() {
        let (rail, me) = tcp_rail();
        const N: usize = 16;
        const BS: usize = 64 << 10;
        let mut src: Vec<u8> = (0..N * BS).map(|i| (i * 7 + 1) as u8).collect();
        let dst = vec![0u8; N * BS];
        // SAFETY: src and dst are declared before the regions, so they outlive them; every
        // operation queued below completes or is taken back before the test ends, and the
        // contexts are plain tags.
        let (ms, md) = unsafe { (rail.register(src.as_ptr(), src.len(), 1, None).unwrap(), rail.register(dst.as_ptr(), dst.len(), 2, None).unwrap()) };
        let raddr = |i: usize| if rail.caps.virt_addr { dst.as_ptr() as u64 + (i * BS) as u64 } else { (i * BS) as u64 };
        // Taken back before any post: nothing reaches the peer.
        for i in 0..N {
            let s = seg(&mut src[i * BS..(i + 1) * BS], ms.desc, raddr(i), md.key);
            // SAFETY: see the registrations above.
            unsafe { rail.queue_rma(true, &[s], me, (1000 + i) as *mut _, false) }.unwrap();
        }
        let even = rail.take_queued_with(|ctx| (ctx as usize).is_multiple_of(2));
        assert_eq!(even, (0..N).step_by(2).map(|i| (1000 + i) as *mut std::ffi::c_void).collect::<Vec<_>>());
        let taken = rail.take_queued_for(me);
        assert_eq!(taken, (1..N).step_by(2).map(|i| (1000 + i) as *mut std::ffi::c_void).collect::<Vec<_>>());
        assert!(!rail.has_queued() && rail.post_queued() == super::Posting::default());
        // Queued and posted: every context completes once.
        for i in 0..N {
            let s = seg(&mut src[i * BS..(i + 1) * BS], ms.desc, raddr(i), md.key);
            // SAFETY: see the registrations above.
            unsafe { rail.queue_rma(true, &[s], me, (1 + i) as *mut _, false) }.unwrap();
        }
        let mut done = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut buf = [Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; 64];
        while done.len() < N {
            assert!(Instant::now() < deadline, "{} of {N} completions", done.len());
            let p = rail.post_queued();
            assert_eq!(p.failed, 0);
            let n = rail.poll(&mut buf).map_err(|e| e.detail).unwrap();
            done.extend(buf[..n].iter().filter(|c| !c.is_remote_write()).map(|c| c.ctx as usize));
        }
        done.sort_unstable();
        assert_eq!(done, (1..=N).collect::<Vec<_>>());
        assert!(!rail.has_queued());
        // A write completion over tcp means the data left, not that it landed: read it back
        // (tcp orders RMA on one connection).
        let mut back = vec![0u8; N * BS];
        // SAFETY: `back` outlives `mb`, and the read completes before `back` is compared.
        let mb = unsafe { rail.register(back.as_ptr(), back.len(), 3, None) }.unwrap();
        let s = seg(&mut back[..], mb.desc, raddr(0), md.key);
        // SAFETY: as above.
        unsafe { rail.queue_rma(false, &[s], me, 99 as *mut _, false) }.unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert!(Instant::now() < deadline, "read back");
            rail.post_queued();
            let n = rail.poll(&mut buf).map_err(|e| e.detail).unwrap();
            if buf[..n].iter().any(|c| c.ctx as usize == 99) {
                break;
            }
        }
        assert!(back == src, "bytes differ");
        drop((ms, md, mb));
    }
}
