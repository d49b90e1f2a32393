//! The seam between the engine and a rail: everything the driver and the transports ask of
//! one, as a trait. The engine runs on `fabric::Rail`; unit tests run the driver and every
//! transport against a fake rail that answers FI_EAGAIN, fails posts, and delivers error,
//! late and out-of-order completions (transport/fake.rs).
use crate::error::Result;
use crate::fabric::{Completion, CqError, DmaBufRange, FiAddr, Hmem, MemoryRegion, Posted, Rail, RailCaps, RmaSeg};
use std::ffi::c_void;

/// One registration on one rail: the key peers name it by, our local descriptor, and the
/// provider's MR, closed when this drops (a fake rail has none).
pub struct Mr {
    pub key: u64,
    pub desc: *mut c_void,
    _mr: Option<MemoryRegion>,
}

// SAFETY: key and desc are plain values the provider reads; the MR itself closes on drop,
// which the engine lets happen only where it owns the rail (registry::CloseQueue).
unsafe impl Send for Mr {}
unsafe impl Sync for Mr {}

impl Mr {
    /// A registration without a provider MR (fake rails in tests).
    pub fn detached(key: u64, desc: *mut c_void) -> Mr {
        Mr { key, desc, _mr: None }
    }
}

/// What a rail does for the engine. The posting calls hand raw buffers and contexts to the
/// provider, which uses them after the call returns: they are `unsafe fn`, and every caller
/// states why the memory outlives the operation.
pub trait Port: Send + Sync {
    fn index(&self) -> usize;
    fn caps(&self) -> &RailCaps;

    /// Registers `len` bytes at `addr` (device memory where `hmem` names it).
    ///
    /// # Safety
    /// The memory must stay allocated while the returned `Mr` lives: peers may read and
    /// write it through its key until then.
    unsafe fn register(&self, addr: *const u8, len: usize, key: u64, hmem: Option<Hmem>) -> Result<Mr>;

    /// Registers device memory by dma-buf (FI_MR_DMABUF) with FI_HMEM interface and device
    /// `hmem`; refused where `caps().dmabuf` is false.
    ///
    /// # Safety
    /// As for `register`: the memory at `buf.base + buf.offset` stays allocated and mapped
    /// while the returned `Mr` lives.
    unsafe fn register_dmabuf(&self, buf: &DmaBufRange<'_>, key: u64, hmem: (u32, i32)) -> Result<Mr>;

    fn av_insert(&self, addr: &[u8]) -> Result<FiAddr>;
    fn av_remove(&self, a: FiAddr);

    /// One RMA operation over `segs` (1..=caps().rma_batch) toward `dest`; `dc` asks for
    /// delivery-complete on a write, `more` says another post follows at once.
    ///
    /// # Safety
    /// Every segment's local range lies in memory registered on this rail (its `desc`) that
    /// stays valid until the operation's completion, and `ctx` is a live operation slot
    /// (ops::OpPool) that stays allocated until then.
    unsafe fn rma(&self, write: bool, segs: &[RmaSeg], dest: FiAddr, ctx: *mut c_void, more: bool, dc: bool) -> Result<Posted>;

    /// `rma` through the rail thread's outbox (where `posts_on_thread`): its completion or
    /// rejection comes back through `poll`.
    ///
    /// # Safety
    /// As for `rma`, until the completion or until `take_queued_*` hands the context back.
    unsafe fn queue_rma(&self, write: bool, segs: &[RmaSeg], dest: FiAddr, ctx: *mut c_void, dc: bool) -> Result<Posted>;

    fn posts_on_thread(&self) -> bool;

    /// # Safety
    /// `buf` (registered as `desc`) holds `len` bytes that stay valid and unchanged until the
    /// send's completion; `ctx` as for `rma`.
    unsafe fn send(&self, buf: *const u8, len: usize, desc: *mut c_void, dest: FiAddr, ctx: *mut c_void) -> Result<Posted>;

    /// # Safety
    /// `buf` (registered as `desc`) has room for `len` bytes and stays valid until the
    /// receive's completion or the rail's close; `ctx` as for `rma`.
    unsafe fn recv(&self, buf: *mut u8, len: usize, desc: *mut c_void, ctx: *mut c_void) -> Result<Posted>;

    fn poll(&self, out: &mut [Completion]) -> std::result::Result<usize, CqError>;
    fn has_queued(&self) -> bool;
    fn take_queued_for(&self, dest: FiAddr) -> Vec<*mut c_void>;
    fn take_queued_with(&self, pick: &dyn Fn(*mut c_void) -> bool) -> Vec<*mut c_void>;
    fn wait_fd_if_idle(&self) -> Option<i32>;
    fn has_wait_fd(&self) -> bool;
}

impl Port for Rail {
    fn index(&self) -> usize {
        self.index
    }
    fn caps(&self) -> &RailCaps {
        &self.caps
    }
    unsafe fn register(&self, addr: *const u8, len: usize, key: u64, hmem: Option<Hmem>) -> Result<Mr> {
        // SAFETY: forwarded: the caller keeps the memory allocated while the Mr lives.
        let mr = unsafe { Rail::register(self, addr, len, key, hmem) }?;
        Ok(Mr { key: mr.key, desc: mr.desc, _mr: Some(mr) })
    }
    unsafe fn register_dmabuf(&self, buf: &DmaBufRange<'_>, key: u64, hmem: (u32, i32)) -> Result<Mr> {
        // SAFETY: forwarded: the caller keeps the memory mapped while the Mr lives.
        let mr = unsafe { Rail::register_dmabuf(self, buf, key, hmem) }?;
        Ok(Mr { key: mr.key, desc: mr.desc, _mr: Some(mr) })
    }
    fn av_insert(&self, addr: &[u8]) -> Result<FiAddr> {
        Rail::av_insert(self, addr)
    }
    fn av_remove(&self, a: FiAddr) {
        Rail::av_remove(self, a)
    }
    unsafe fn rma(&self, write: bool, segs: &[RmaSeg], dest: FiAddr, ctx: *mut c_void, more: bool, dc: bool) -> Result<Posted> {
        // SAFETY: forwarded from the caller (Port::rma's contract).
        unsafe { Rail::rma_batch(self, write, segs, dest, ctx, more, dc) }
    }
    unsafe fn queue_rma(&self, write: bool, segs: &[RmaSeg], dest: FiAddr, ctx: *mut c_void, dc: bool) -> Result<Posted> {
        // SAFETY: forwarded from the caller (Port::queue_rma's contract).
        unsafe { Rail::queue_rma(self, write, segs, dest, ctx, dc) }
    }
    fn posts_on_thread(&self) -> bool {
        Rail::posts_on_thread(self)
    }
    unsafe fn send(&self, buf: *const u8, len: usize, desc: *mut c_void, dest: FiAddr, ctx: *mut c_void) -> Result<Posted> {
        // SAFETY: forwarded from the caller (Port::send's contract).
        unsafe { Rail::send(self, buf, len, desc, dest, ctx) }
    }
    unsafe fn recv(&self, buf: *mut u8, len: usize, desc: *mut c_void, ctx: *mut c_void) -> Result<Posted> {
        // SAFETY: forwarded from the caller (Port::recv's contract).
        unsafe { Rail::recv(self, buf, len, desc, ctx) }
    }
    fn poll(&self, out: &mut [Completion]) -> std::result::Result<usize, CqError> {
        Rail::poll(self, out)
    }
    fn has_queued(&self) -> bool {
        Rail::has_queued(self)
    }
    fn take_queued_for(&self, dest: FiAddr) -> Vec<*mut c_void> {
        Rail::take_queued_for(self, dest)
    }
    fn take_queued_with(&self, pick: &dyn Fn(*mut c_void) -> bool) -> Vec<*mut c_void> {
        Rail::take_queued_with(self, pick)
    }
    fn wait_fd_if_idle(&self) -> Option<i32> {
        Rail::wait_fd_if_idle(self)
    }
    fn has_wait_fd(&self) -> bool {
        Rail::has_wait_fd(self)
    }
}
