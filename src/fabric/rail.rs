//! A rail: one fabric/domain/endpoint/CQ/AV, with the settings negotiated for it and the
//! data-path calls the engine makes on it.
use super::domain_lock::DomainLock;
use super::resources::{Av, Cq, Domain, Endpoint, Fabric};
use super::{fab_err, library_major, strerror, sys, FiAddr, RailSpec};
use crate::config::parse_bool;
use crate::error::{Error, Result};
use crate::hinted::Hinted;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

mod fault;
mod outbox;
#[cfg(test)]
mod dmabuf_tests;
pub use fault::{FaultCounts, FaultSpec};
pub use outbox::Posting;

/// What the provider granted for this rail (from the fi_info it returned).
#[derive(Clone, Debug)]
pub struct RailCaps {
    pub prov_name: String,
    pub domain_name: String,
    /// Local buffers need an MR descriptor (FI_MR_LOCAL).
    pub mr_local: bool,
    /// Remote addresses are virtual addresses (else offsets into the region).
    pub virt_addr: bool,
    /// The provider chooses MR keys (else we do).
    pub prov_key: bool,
    /// Entries of departed peers stay in the AV until it closes: libfabric 2.x's shm
    /// unmaps the peer's region in fi_av_remove while its progress may still reach it
    /// (our C harness crashed in smr_ep_progress in ~1 of 4 runs after a peer exited).
    pub keep_av_entries: bool,
    pub mr_key_size: usize,
    pub inject_size: usize,
    pub max_msg_size: u64,
    pub tx_size: usize,
    pub rx_size: usize,
    pub delivery_complete: bool,
    /// The provider orders a read after earlier writes to the same peer (FI_ORDER_RAW), so
    /// a small read can stand in for delivery-complete writes.
    pub order_raw: bool,
    /// The provider orders a send after earlier writes to the same peer, on both our
    /// transmit and our receive side (FI_ORDER_SAW): a notification sent on this endpoint
    /// behind its data is processed by the target only after that data.
    pub order_saw: bool,
    /// The granted msg_order of the transmit and receive sides, as libfabric reports them.
    pub msg_order: (u64, u64),
    /// RMA on this rail completes only once the data has moved, provided the kernel lets
    /// this process reach the peer's memory directly (cross-memory attach, CMA): the shm
    /// provider of libfabric 1.x then copies in the posting call itself ("fast RMA",
    /// chosen for a domain without RMA ordering whose keys are virtual addresses, and for
    /// an endpoint without FI_HMEM). Where CMA does not reach a peer the provider queues
    /// small writes and completes them at once, so writes to that peer ask for
    /// delivery-complete per operation (shm honours the flag per call).
    pub sync_rma: bool,
    /// Most (local, remote) segment pairs one RMA operation may carry: the provider's
    /// iov and rma_iov limits (1 where shm's fast RMA needs a single remote segment).
    pub rma_batch: usize,
    pub cq_data_size: usize,
    pub needs_context: bool,
    pub hmem: bool,
    /// Device memory can be registered by dma-buf (FI_MR_DMABUF): an FI_HMEM rail of a
    /// fabric opened with API 1.20 or later (fi_mr(3)).
    pub dmabuf: bool,
    /// An FI_HMEM rail that moves host memory into or out of a peer's device memory
    /// through host bounce buffers when the host memory is the posting side's (shm: its
    /// CUDA IPC path copies only from or into device memory of the poster), so such RMA is
    /// better posted by the device memory's owner (config hmem_owner_rma).
    pub hmem_host_bounce: bool,
    pub threading: u32,
}

impl RailCaps {
    /// Why `dmabuf` is false (for log lines).
    pub fn no_dmabuf_reason(&self) -> String {
        if !self.hmem {
            format!("{} offers no FI_HMEM", self.prov_name)
        } else if super::runtime_version() < super::API_VERSION_DMABUF {
            format!("dma-buf registration needs libfabric API 1.20 (library {})", super::library_version())
        } else if !self.virt_addr {
            format!("{} addresses regions by offset, which libfabric's MR map gets wrong for a dma-buf", self.prov_name)
        } else {
            "dma-buf registration is available".into()
        }
    }
}

/// One completion entry: the context we posted with, its flags, and the received length.
#[derive(Clone, Copy)]
pub struct Completion {
    pub ctx: *mut c_void,
    pub flags: u64,
    pub len: usize,
}

impl Completion {
    /// A target-side event of a peer's write (remote CQ data): no context of ours.
    pub fn is_remote_write(&self) -> bool {
        self.flags & sys::FI_REMOTE_CQ_DATA as u64 != 0
    }
}

/// A completion that reported an error.
pub struct CqError {
    pub ctx: *mut c_void,
    pub errno: i32,
    pub detail: String,
}

/// Outcome of posting: accepted, or the queue is full right now (FI_EAGAIN).
#[derive(Debug, PartialEq, Eq)]
pub enum Posted {
    Ok,
    Again,
}

/// A registered memory region on one rail's domain. Closing it touches the domain, so the
/// engine drops these only where it owns the rail (see engine::registry).
pub struct MemoryRegion {
    raw: *mut sys::fid_mr,
    pub desc: *mut c_void,
    pub key: u64,
    /// A dma-buf registration keeps its own handle of the buffer until the MR is closed
    /// (declared after `raw`'s close in Drop: fields drop after the body runs).
    _dmabuf: Option<OwnedFd>,
    _domain: Arc<Domain>,
    calls: Arc<DomainLock>,
}

/// Device memory as a registration names it: libfabric's FI_HMEM interface and device, and
/// whether it is memory of a device allocation call (not managed memory), which is
/// registered with FI_HMEM_DEVICE_ONLY.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hmem {
    pub iface: u32,
    pub device: i32,
    pub device_only: bool,
}

/// Device memory as a dma-buf range for [`Rail::register_dmabuf`]: bytes
/// `[offset, offset + len)` of the buffer `fd`, whose byte 0 is at device address `base`
/// (so the region's address is `base + offset`, as fi_mr(3) defines it).
#[derive(Clone, Copy, Debug)]
pub struct DmaBufRange<'a> {
    pub fd: BorrowedFd<'a>,
    pub base: u64,
    pub offset: u64,
    pub len: usize,
}
// SAFETY: desc and key are plain values readable anywhere; close happens on drop by the
// rail's owner.
unsafe impl Send for MemoryRegion {}
unsafe impl Sync for MemoryRegion {}
impl Drop for MemoryRegion {
    fn drop(&mut self) {
        let _domain = self.calls.lock();
        // SAFETY: raw is a live MR closed exactly once.
        let ret = unsafe { sys::nf_fi_close(&mut (*self.raw).fid) };
        if ret != 0 {
            log::warn!("fi_close(mr) failed: {}", strerror(ret));
        }
    }
}

pub struct Rail {
    pub index: usize,
    pub caps: RailCaps,
    /// This endpoint's address, as peers insert it into their AV.
    pub name: Vec<u8>,
    ep: Endpoint,
    cq: Arc<Cq>,
    av: Arc<Av>,
    domain: Arc<Domain>,
    fabric: Arc<Fabric>,
    wait_fd: Option<i32>,
    /// Held for every call into the provider on this rail's objects (and its MRs').
    calls: Arc<DomainLock>,
    /// Completions a rail thread read, waiting for the driver (oldest first).
    stash: Hinted<VecDeque<std::result::Result<Completion, CqError>>>,
    /// RMA operations waiting for the rail thread to post them (see outbox.rs).
    outbox: Mutex<VecDeque<outbox::QueuedRma>>,
    posts_on_thread: AtomicBool,
    /// Injected provider faults (config `fault_inject`); None on every normal run.
    fault: Option<Box<fault::Fault>>,
    _spec: RailSpec,
}

// SAFETY: every provider call on the rail's objects holds `calls`, so the domain sees one
// thread at a time (FI_THREAD_DOMAIN) whichever thread the driver or a rail thread runs on;
// the raw contexts and buffers in the stash and the outbox are only dereferenced by the
// driver and the provider. The provider objects themselves may move between threads.
unsafe impl Send for Rail {}
unsafe impl Sync for Rail {}

fn flag(v: u64, f: u64) -> bool {
    v & f != 0
}

/// Most completions a rail thread keeps waiting for the driver.
const STASH_MAX: usize = 4096;

/// Most segments one RMA operation carries (the arrays below are on the stack).
pub const MAX_RMA_BATCH: usize = 8;

/// One segment of a batched RMA: our buffer and MR descriptor, and the peer's range.
#[derive(Clone, Copy)]
pub struct RmaSeg {
    pub local: *mut u8,
    pub len: usize,
    pub desc: *mut c_void,
    pub raddr: u64,
    pub rkey: u64,
}

/// Every ordering bit that involves RMA: asking for any of them turns shm's fast RMA off.
const RMA_ORDER_BITS: u64 = (sys::FI_ORDER_RAR | sys::FI_ORDER_RAW | sys::FI_ORDER_RAS | sys::FI_ORDER_WAR
    | sys::FI_ORDER_WAW | sys::FI_ORDER_WAS | sys::FI_ORDER_SAR | sys::FI_ORDER_SAW) as u64
    | sys::FI_ORDER_RMA_RAR | sys::FI_ORDER_RMA_RAW | sys::FI_ORDER_RMA_WAR | sys::FI_ORDER_RMA_WAW
    | sys::FI_ORDER_ATOMIC_RAR | sys::FI_ORDER_ATOMIC_RAW | sys::FI_ORDER_ATOMIC_WAR | sys::FI_ORDER_ATOMIC_WAW;

/// The ordering bits of a msg_order value by their libfabric names (RAW for FI_ORDER_RAW).
fn order_names(order: u64) -> String {
    const NAMES: [(u32, &str); 9] = [
        (sys::FI_ORDER_RAR, "RAR"), (sys::FI_ORDER_RAW, "RAW"), (sys::FI_ORDER_RAS, "RAS"),
        (sys::FI_ORDER_WAR, "WAR"), (sys::FI_ORDER_WAW, "WAW"), (sys::FI_ORDER_WAS, "WAS"),
        (sys::FI_ORDER_SAR, "SAR"), (sys::FI_ORDER_SAW, "SAW"), (sys::FI_ORDER_SAS, "SAS"),
    ];
    NAMES.iter().filter(|(b, _)| flag(order, *b as u64)).map(|(_, n)| *n).collect::<Vec<_>>().join(" ")
}

/// Whether this entry is the shm provider's fast-RMA mode (see RailCaps::sync_rma). The
/// rules are those of libfabric 1.x's shm; 2.x changed that provider, so it is not assumed.
fn shm_fast_rma(prov: &str, mr_mode: u64, msg_order: u64, caps: u64, op_flags: u64) -> bool {
    prov == "shm"
        && library_major() == 1
        && flag(mr_mode, sys::FI_MR_VIRT_ADDR as u64)
        && msg_order & RMA_ORDER_BITS == 0
        && !flag(caps, sys::FI_HMEM)
        && !flag(op_flags, sys::FI_DELIVERY_COMPLETE as u64)
        && !std::env::var("FI_SHM_DISABLE_CMA").is_ok_and(|v| parse_bool(&v) == Some(true))
}

impl Rail {
    /// Opens every object of the rail in dependency order.
    /// `owner` names the agent in log lines.
    pub fn open(owner: &str, spec: &RailSpec, index: usize, want_wait_fd: bool) -> Result<Rail> {
        let spec = spec.clone();
        let info = spec.info;
        // SAFETY: info is an owned, valid fi_info.
        let caps = unsafe {
            let i = &*info;
            let d = &*i.domain_attr;
            let tx = &*i.tx_attr;
            let rx = &*i.rx_attr;
            let ep = &*i.ep_attr;
            let mr = d.mr_mode as u64;
            let sync_rma = shm_fast_rma(&spec.prov_name, mr, tx.msg_order, i.caps, tx.op_flags);
            RailCaps {
                keep_av_entries: spec.prov_name == "shm" && super::library_major() >= 2,
                prov_name: spec.prov_name.clone(),
                domain_name: spec.domain_name.clone(),
                mr_local: flag(mr, sys::FI_MR_LOCAL as u64),
                virt_addr: flag(mr, sys::FI_MR_VIRT_ADDR as u64),
                prov_key: flag(mr, sys::FI_MR_PROV_KEY as u64),
                mr_key_size: d.mr_key_size,
                inject_size: tx.inject_size,
                max_msg_size: ep.max_msg_size as u64,
                tx_size: tx.size.max(1),
                rx_size: rx.size.max(1),
                delivery_complete: spec.delivery_complete,
                order_raw: flag(tx.msg_order, sys::FI_ORDER_RAW as u64),
                order_saw: flag(tx.msg_order, sys::FI_ORDER_SAW as u64) && flag(rx.msg_order, sys::FI_ORDER_SAW as u64),
                msg_order: (tx.msg_order, rx.msg_order),
                sync_rma,
                // shm's fast RMA takes a single remote range per operation.
                rma_batch: if sync_rma { 1 } else { tx.iov_limit.min(tx.rma_iov_limit).clamp(1, MAX_RMA_BATCH) },
                cq_data_size: d.cq_data_size,
                needs_context: flag(i.mode, sys::FI_CONTEXT | sys::FI_CONTEXT2),
                hmem: flag(i.caps, sys::FI_HMEM),
                // Only where peers address regions by virtual address: libfabric 2.1's
                // util MR map (shm, tcp) takes an offset-addressed region's base from the
                // attribute's iovec even when it holds a dma-buf, so the region lands at an
                // address made of the fd number (found here: shm's RMA into such a region
                // fails "out of registered range" on the target and never completes).
                dmabuf: flag(i.caps, sys::FI_HMEM) && spec.api_version >= super::API_VERSION_DMABUF
                    && flag(mr, sys::FI_MR_VIRT_ADDR as u64),
                hmem_host_bounce: spec.prov_name == "shm" && flag(i.caps, sys::FI_HMEM),
                threading: d.threading,
            }
        };
        let fabric = Fabric::open(info, index)?;
        let domain = Domain::open(&fabric, info, index)?;
        let cq_size = (caps.tx_size + caps.rx_size).max(256);
        let cq = match Cq::open(&domain, cq_size, want_wait_fd, index) {
            Ok(cq) => cq,
            Err(e) if want_wait_fd => {
                log::debug!("{owner}: rail {index}: no CQ wait fd ({e}); the progress thread will poll");
                Cq::open(&domain, cq_size, false, index)?
            }
            Err(e) => return Err(e),
        };
        let wait_fd = if want_wait_fd { cq.wait_fd() } else { None };
        let av = Av::open(&domain, index)?;
        let ep = Endpoint::open(&domain, info, &cq, &av, index)?;
        let name = ep.name(index)?;
        log::info!(
            "{owner}: rail {index}: provider {} domain {} fabric {} mr_local={} virt_addr={} prov_key={} \
             inject={} tx={} rx={} delivery_complete={} msg_order tx=[{}] rx=[{}] sync_rma={} rma_batch={} cq_data={} context={} hmem={} wait_fd={}",
            caps.prov_name, caps.domain_name, spec.fabric_name, caps.mr_local, caps.virt_addr,
            caps.prov_key, caps.inject_size, caps.tx_size, caps.rx_size, caps.delivery_complete,
            order_names(caps.msg_order.0), order_names(caps.msg_order.1), caps.sync_rma, caps.rma_batch,
            caps.cq_data_size, caps.needs_context, caps.hmem, wait_fd.is_some()
        );
        let fault = spec.fault.clone().map(|f| Box::new(fault::Fault::new(owner, f, index)));
        Ok(Rail { index, caps, name, ep, cq, av, domain, fabric, wait_fd, calls: Arc::default(), stash: Hinted::default(), outbox: Mutex::default(), posts_on_thread: AtomicBool::new(false), fault, _spec: spec })
    }

    /// Registers `len` bytes at `addr` for local and remote access. `key` is used when the
    /// provider does not choose keys. `hmem` names device memory.
    ///
    /// # Safety
    /// `addr..addr + len` is memory of this process (host memory, or memory of the device
    /// `hmem` names) that stays allocated and mapped until the returned region is dropped:
    /// until then the provider, and peers holding its key, may read and write it.
    pub unsafe fn register(&self, addr: *const u8, len: usize, key: u64, hmem: Option<Hmem>) -> Result<MemoryRegion> {
        let access = (sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE | sys::FI_SEND | sys::FI_RECV) as u64;
        let (iface, dev, only) = hmem.map_or((0, 0, 0), |h| (h.iface as i32, h.device, h.device_only as i32));
        let mut raw = std::ptr::null_mut();
        let _domain = self.calls.lock();
        // SAFETY: domain is live; the shim builds the attribute struct for this call only.
        let ret = unsafe { sys::nf_fi_mr_reg_buf(self.domain.raw, addr as *mut c_void, len, access, key, iface, dev, only, &mut raw) };
        if ret != 0 {
            return Err(fab_err("fi_mr_regattr", Some(self.index), ret as i64));
        }
        // SAFETY: raw is a live MR.
        let (desc, key) = unsafe { (sys::nf_fi_mr_desc(raw), sys::nf_fi_mr_key(raw)) };
        Ok(MemoryRegion { raw, desc, key, _dmabuf: None, _domain: self.domain.clone(), calls: self.calls.clone() })
    }

    /// Registers device memory given as a dma-buf (FI_MR_DMABUF) with the FI_HMEM interface
    /// and device `hmem`, for local and remote access; `key` as for [`Rail::register`].
    /// Refused (NotSupported) on a rail without `caps.dmabuf`, where the flag would be
    /// unknown to the library or read under an older API's layout.
    ///
    /// # Safety
    /// `buf` names device memory of this process that stays allocated and mapped at
    /// `buf.base + buf.offset` for `buf.len` bytes until the returned region is dropped.
    pub unsafe fn register_dmabuf(&self, buf: &DmaBufRange<'_>, key: u64, hmem: (u32, i32)) -> Result<MemoryRegion> {
        if !self.caps.dmabuf {
            return Err(Error::NotSupported(format!("rail {}: {}", self.index, self.caps.no_dmabuf_reason())));
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.reg_dmabuf_unchecked(buf, key, hmem) }
    }

    /// `register_dmabuf` without the capability check (the tests use it to reach the
    /// provider where the engine would not).
    ///
    /// # Safety
    /// As for `register_dmabuf`.
    unsafe fn reg_dmabuf_unchecked(&self, buf: &DmaBufRange<'_>, key: u64, hmem: (u32, i32)) -> Result<MemoryRegion> {
        // The region holds a handle of its own: the caller's may close before the MR does.
        let own = buf.fd.try_clone_to_owned().map_err(|e| Error::Backend(format!("dup of a dma-buf fd: {e}")))?;
        let access = (sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE | sys::FI_SEND | sys::FI_RECV) as u64;
        let mut raw = std::ptr::null_mut();
        let _domain = self.calls.lock();
        // SAFETY: domain is live; the shim builds the attribute and dma-buf structs for this
        // call only; the caller keeps the memory mapped while the region lives.
        let ret = unsafe {
            sys::nf_fi_mr_reg_dmabuf(self.domain.raw, own.as_raw_fd(), buf.offset, buf.len, buf.base as *mut c_void,
                                     access, key, hmem.0 as i32, hmem.1, &mut raw)
        };
        if ret != 0 {
            return Err(fab_err("fi_mr_regattr(FI_MR_DMABUF)", Some(self.index), ret as i64));
        }
        // SAFETY: raw is a live MR.
        let (desc, key) = unsafe { (sys::nf_fi_mr_desc(raw), sys::nf_fi_mr_key(raw)) };
        Ok(MemoryRegion { raw, desc, key, _dmabuf: Some(own), _domain: self.domain.clone(), calls: self.calls.clone() })
    }

    pub fn av_insert(&self, addr: &[u8]) -> Result<FiAddr> {
        let mut out: FiAddr = u64::MAX;
        let _domain = self.calls.lock();
        // SAFETY: addr holds one provider address in the format of this rail.
        let ret = unsafe { sys::nf_fi_av_insert(self.av.raw, addr.as_ptr() as *const c_void, 1, &mut out, 0) };
        if ret != 1 {
            return Err(fab_err("fi_av_insert", Some(self.index), if ret < 0 { ret as i64 } else { -(libc::EINVAL as i64) }));
        }
        Ok(out)
    }

    pub fn av_remove(&self, mut a: FiAddr) {
        if self.caps.keep_av_entries {
            return;
        }
        let _domain = self.calls.lock();
        // SAFETY: a was returned by av_insert on this AV.
        let ret = unsafe { sys::nf_fi_av_remove(self.av.raw, &mut a, 1) };
        if ret != 0 {
            log::debug!("rail {}: fi_av_remove: {}", self.index, strerror(ret));
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn rma(&self, write: bool, local: *mut u8, len: usize, desc: *mut c_void, dest: FiAddr,
           raddr: u64, rkey: u64, ctx: *mut c_void, more: bool, dc: bool) -> Result<Posted> {
        let mut iov = libc::iovec { iov_base: local as *mut c_void, iov_len: len };
        let mut d = desc;
        let mut rma = sys::fi_rma_iov { addr: raddr, len, key: rkey };
        let msg = sys::fi_msg_rma {
            msg_iov: &mut iov as *mut libc::iovec as *const sys::iovec,
            desc: &mut d,
            iov_count: 1,
            addr: dest,
            rma_iov: &mut rma,
            rma_iov_count: 1,
            context: ctx,
            data: 0,
        };
        self.post_msg(write, &msg, more, dc)
    }

    /// One RMA operation over several segments: the provider moves the local iovs, in
    /// order, into the remote ranges, in order; pairwise equal lengths keep every byte at
    /// its own segment's address. `segs.len()` must be within 1..=caps.rma_batch.
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
    pub unsafe fn rma_batch(&self, write: bool, segs: &[RmaSeg], dest: FiAddr, ctx: *mut c_void, more: bool, dc: bool) -> Result<Posted> {
        self.check_batch(segs.len())?;
        let _domain = self.calls.lock();
        self.post_rma_locked(write, segs, dest, ctx, more, dc)
    }

    /// A batch of `n` segments is within 1..=caps.rma_batch (what one operation carries).
    fn check_batch(&self, n: usize) -> Result<()> {
        if n == 0 || n > self.caps.rma_batch {
            return Err(Error::Backend(format!("rail {}: batch of {n} segments (limit {})", self.index, self.caps.rma_batch)));
        }
        Ok(())
    }

    /// `rma_batch` for a caller that holds `calls` (the rail thread posting its outbox).
    fn post_rma_locked(&self, write: bool, segs: &[RmaSeg], dest: FiAddr, ctx: *mut c_void, more: bool, dc: bool) -> Result<Posted> {
        let n = segs.len().min(MAX_RMA_BATCH);
        let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; MAX_RMA_BATCH];
        let mut descs = [std::ptr::null_mut::<c_void>(); MAX_RMA_BATCH];
        let mut rma = [sys::fi_rma_iov { addr: 0, len: 0, key: 0 }; MAX_RMA_BATCH];
        for (i, s) in segs.iter().enumerate() {
            iov[i] = libc::iovec { iov_base: s.local as *mut c_void, iov_len: s.len };
            descs[i] = s.desc;
            rma[i] = sys::fi_rma_iov { addr: s.raddr, len: s.len, key: s.rkey };
        }
        let msg = sys::fi_msg_rma {
            msg_iov: iov.as_ptr() as *const sys::iovec,
            desc: descs.as_mut_ptr(),
            iov_count: n,
            addr: dest,
            rma_iov: rma.as_ptr(),
            rma_iov_count: n,
            context: ctx,
            data: 0,
        };
        self.post_msg_locked(write, &msg, more, dc)
    }

    /// Posts a prepared RMA message with our completion flags.
    fn post_msg(&self, write: bool, msg: &sys::fi_msg_rma, more: bool, dc: bool) -> Result<Posted> {
        let _domain = self.calls.lock();
        self.post_msg_locked(write, msg, more, dc)
    }

    /// `post_msg` for a caller that holds `calls`.
    fn post_msg_locked(&self, write: bool, msg: &sys::fi_msg_rma, more: bool, dc: bool) -> Result<Posted> {
        let op = if write { "fi_writemsg" } else { "fi_readmsg" };
        if let Some(f) = &self.fault {
            if let Some(r) = f.on_post(op, fault::PostKind::Data) {
                return r;
            }
        }
        let mut flags = sys::FI_COMPLETION as u64;
        // shm takes the flag per operation (see sync_rma); elsewhere only where granted.
        if write && dc && (self.caps.delivery_complete || self.caps.sync_rma) {
            flags |= sys::FI_DELIVERY_COMPLETE as u64;
        }
        if more {
            flags |= sys::FI_MORE as u64;
        }
        // SAFETY: the caller holds `calls`; msg and the arrays it points to live for the
        // call (the caller's stack, or the outbox entry being posted); the provider copies
        // them. Every buffer and ctx stay valid until the completion (engine invariant).
        let ret = unsafe {
            if write { sys::nf_fi_writemsg(self.ep.raw, msg, flags) } else { sys::nf_fi_readmsg(self.ep.raw, msg, flags) }
        };
        self.posted(ret, op)
    }

    fn posted(&self, ret: isize, op: &'static str) -> Result<Posted> {
        if ret == 0 {
            Ok(Posted::Ok)
        } else if ret == -(sys::FI_EAGAIN as isize) {
            Ok(Posted::Again)
        } else {
            Err(fab_err(op, Some(self.index), ret as i64))
        }
    }

    /// Writes `len` bytes at `local` to the peer's `raddr`. `dc`: ask for delivery-complete
    /// (else transmit-complete, and the caller flushes).
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
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn write(&self, local: *const u8, len: usize, desc: *mut c_void, dest: FiAddr, raddr: u64, rkey: u64, ctx: *mut c_void, more: bool, dc: bool) -> Result<Posted> {
        self.rma(true, local as *mut u8, len, desc, dest, raddr, rkey, ctx, more, dc)
    }

    /// Reads `len` bytes at the peer's `raddr` into `local`.
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
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn read(&self, local: *mut u8, len: usize, desc: *mut c_void, dest: FiAddr, raddr: u64, rkey: u64, ctx: *mut c_void, more: bool) -> Result<Posted> {
        self.rma(false, local, len, desc, dest, raddr, rkey, ctx, more, false)
    }

    /// Sends `len` bytes at `buf` to `dest` (a control message).
    ///
    /// # Safety
    /// `buf..buf + len` lies in memory registered on this rail's domain (`desc`, or null
    /// where the provider needs none) and stays valid and unchanged until the send's
    /// completion or error completion has been read from this rail; `ctx` is a live
    /// operation slot that stays allocated, for this send alone, until then; `dest` came
    /// from this rail's `av_insert` and stays in the AV until then.
    pub unsafe fn send(&self, buf: *const u8, len: usize, desc: *mut c_void, dest: FiAddr, ctx: *mut c_void) -> Result<Posted> {
        let _domain = self.calls.lock();
        if let Some(f) = &self.fault {
            if let Some(r) = f.on_post("fi_send", fault::PostKind::Data) {
                return r;
            }
        }
        // SAFETY: buf stays valid until the send completes (engine invariant).
        let ret = unsafe { sys::nf_fi_send(self.ep.raw, buf as *const c_void, len, desc, dest, ctx) };
        self.posted(ret, "fi_send")
    }

    /// Posts a receive buffer for one message from any peer.
    ///
    /// # Safety
    /// `buf..buf + len` lies in memory registered on this rail's domain (`desc`, or null
    /// where the provider needs none), stays valid and is not accessed by anyone else
    /// until the receive's completion has been read from this rail or the rail closes;
    /// `ctx` is a live operation slot that stays allocated, for this receive alone, until
    /// then.
    pub unsafe fn recv(&self, buf: *mut u8, len: usize, desc: *mut c_void, ctx: *mut c_void) -> Result<Posted> {
        let _domain = self.calls.lock();
        if let Some(f) = &self.fault {
            if let Some(r) = f.on_post("fi_recv", fault::PostKind::Recv) {
                return r;
            }
        }
        // SAFETY: buf stays valid until the receive completes or the rail closes.
        let ret = unsafe { sys::nf_fi_recv(self.ep.raw, buf as *mut c_void, len, desc, u64::MAX, ctx) };
        self.posted(ret, "fi_recv")
    }

    /// Reads up to `out.len()` completions; an error entry is returned as `Err`. What a
    /// rail thread read first comes first; while one is inside the provider, only that.
    pub fn poll(&self, out: &mut [Completion]) -> std::result::Result<usize, CqError> {
        let n = self.take_stashed(out)?;
        if n > 0 {
            return Ok(n);
        }
        let Some(_domain) = self.calls.try_lock() else { return Ok(0) };
        // A rail thread may have stashed more between the look above and the lock; those
        // are older than anything in the CQ now, and the stash only grows under the lock.
        let n = self.take_stashed(out)?;
        if n > 0 {
            return Ok(n);
        }
        self.read_cq_faulty(out)
    }

    /// Moves stashed completions into `out`; a stashed error comes back alone.
    fn take_stashed(&self, out: &mut [Completion]) -> std::result::Result<usize, CqError> {
        match self.stash.lock_if_any() {
            Some(mut stash) => fault::hand_out(&mut stash, out),
            None => Ok(0),
        }
    }

    /// A rail thread's turn: drives the provider's progress on this rail (over tcp: the
    /// socket reads and writes of its transfers) by reading its CQ, and keeps what it read
    /// for the driver. Steps aside while the driver waits for the domain. Returns how many
    /// entries it kept.
    pub fn progress_for_driver(&self) -> usize {
        // A CQ that keeps failing must not fill memory faster than the driver drains it.
        if self.stash.lock().len() >= STASH_MAX {
            return 0;
        }
        let Some(_domain) = self.calls.try_lock_yielding() else { return 0 };
        let mut buf = [Completion { ctx: std::ptr::null_mut(), flags: 0, len: 0 }; 64];
        let got = self.read_cq_faulty(&mut buf);
        let mut stash = self.stash.lock();
        match got {
            Ok(n) => {
                stash.extend(buf[..n].iter().map(|c| Ok(*c)));
                n
            }
            Err(e) => {
                stash.push_back(Err(e));
                1
            }
        }
    }

    /// Whether a rail thread left completions for the driver, or the fault layer holds
    /// some back: either way the next polls have work, so the rail is not idle.
    pub fn has_stashed(&self) -> bool {
        self.stash.maybe_any() || self.fault.as_ref().is_some_and(|f| f.busy())
    }

    /// Faults injected on this rail so far (None: injection is off).
    pub fn fault_counts(&self) -> Option<FaultCounts> {
        self.fault.as_ref().map(|f| f.counts())
    }

    /// `read_cq` through the fault layer where there is one (the caller holds `calls`).
    fn read_cq_faulty(&self, out: &mut [Completion]) -> std::result::Result<usize, CqError> {
        match &self.fault {
            None => self.read_cq(out),
            Some(f) => f.poll(out, |buf| self.read_cq(buf)),
        }
    }

    /// One fi_cq_read into `out` (the caller holds `calls`).
    fn read_cq(&self, out: &mut [Completion]) -> std::result::Result<usize, CqError> {
        const N: usize = 64;
        // Not zeroed: the provider writes the entries it returns, and only those are read
        // (zeroing 2 KiB was a memset on every poll, most of which find nothing).
        let mut raw = [const { std::mem::MaybeUninit::<sys::fi_cq_msg_entry>::uninit() }; N];
        let n = out.len().min(N);
        // SAFETY: raw has room for n entries of the CQ's format (FI_CQ_FORMAT_MSG).
        let ret = unsafe { sys::nf_fi_cq_read(self.cq.raw, raw.as_mut_ptr() as *mut c_void, n) };
        if ret > 0 {
            for (o, r) in out.iter_mut().zip(raw.iter()).take((ret as usize).min(n)) {
                // SAFETY: fi_cq_read filled the first `ret` (<= n) entries.
                let r = unsafe { r.assume_init_ref() };
                *o = Completion { ctx: r.op_context, flags: r.flags, len: r.len };
            }
            return Ok((ret as usize).min(n));
        }
        if ret == -(sys::FI_EAGAIN as isize) || ret == 0 {
            return Ok(0);
        }
        if ret == -(sys::FI_EAVAIL as isize) {
            // A fabric opened with API 1.20 or later gets the library's whole error entry,
            // longer than the 1.17 layout we build against (2.x added src_addr): room for it.
            #[repr(C)]
            #[derive(Default)]
            struct ErrEntry {
                e: sys::fi_cq_err_entry,
                _room: [u64; 16],
            }
            let mut buf_e = ErrEntry::default();
            // SAFETY: buf_e has room for any version's error entry.
            let r = unsafe { sys::nf_fi_cq_readerr(self.cq.raw, &mut buf_e.e, 0) };
            let e = buf_e.e;
            if r < 0 {
                return Ok(0);
            }
            let mut buf = [0 as std::os::raw::c_char; 256];
            // SAFETY: strerror writes at most buf.len() bytes and returns a C string.
            let detail = unsafe {
                let p = sys::nf_fi_cq_strerror(self.cq.raw, e.prov_errno, e.err_data, buf.as_mut_ptr(), buf.len());
                if p.is_null() { String::new() } else { std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned() }
            };
            return Err(CqError { ctx: e.op_context, errno: e.err, detail });
        }
        Err(CqError { ctx: std::ptr::null_mut(), errno: (-ret) as i32, detail: format!("fi_cq_read: {}", strerror(ret as i32)) })
    }

    /// The fd to wait on before sleeping, if the CQ has one and nothing is pending
    /// (fi_trywait succeeded).
    pub fn wait_fd_if_idle(&self) -> Option<i32> {
        let fd = self.wait_fd?;
        if self.has_stashed() {
            return None;
        }
        let _domain = self.calls.lock();
        // SAFETY: fabric and cq are live.
        let ret = unsafe { sys::nf_fi_trywait_cq(self.fabric.raw, self.cq.raw) };
        (ret == 0).then_some(fd)
    }

    pub fn has_wait_fd(&self) -> bool {
        self.wait_fd.is_some()
    }
}

impl CqError {
    pub fn into_error(self, op: &'static str, rail: usize) -> Error {
        Error::Completion { op, rail, errno: self.errno, detail: self.detail }
    }
}
