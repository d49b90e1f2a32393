//! The caller's two descriptor lists read as descriptor pairs while the engine plans a
//! request: no copy of the lists, and a registration handle looked up in the registry only
//! where a descriptor names another one than the descriptor before it (lists name a few
//! registrations in long runs).
use super::{guard, handle, nf_mem, nf_meta_desc, nf_rmem, nf_xfer_desc, MEM_MAGIC, RMEM_MAGIC};
use crate::engine::{LocalMem, Pair, PairSource, RemoteMem};
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::Arc;

/// A descriptor of one of the C lists: its range, and the pointer that names its handle.
pub trait CDesc {
    fn range(&self) -> (u64, u64);
    /// What the descriptor names its registration by; equal keys, equal handles.
    fn key(&self) -> *const c_void;
    /// The handle behind `key` (NULL where there is none).
    ///
    /// # Safety
    /// `at` is the offset the list's contract gives (see `nf_request_create_meta`).
    unsafe fn handle_ptr(&self, at: usize) -> *const c_void;
}

impl CDesc for nf_xfer_desc {
    #[inline(always)]
    fn range(&self) -> (u64, u64) {
        (self.addr, self.len)
    }
    #[inline(always)]
    fn key(&self) -> *const c_void {
        self.mem
    }
    unsafe fn handle_ptr(&self, _: usize) -> *const c_void {
        self.mem
    }
}

impl CDesc for nf_meta_desc {
    #[inline(always)]
    fn range(&self) -> (u64, u64) {
        (self.addr, self.len)
    }
    #[inline(always)]
    fn key(&self) -> *const c_void {
        self.owner
    }
    unsafe fn handle_ptr(&self, at: usize) -> *const c_void {
        if self.owner.is_null() {
            return std::ptr::null();
        }
        // SAFETY: a non-NULL owner is a live object of the caller's with an aligned handle
        // pointer at `at` (nf_request_create_meta's contract, passed on by our caller).
        unsafe { guard::handle_in(self.owner, at) }
    }
}

/// The caller's two lists of equal length, read in parts by the planning threads.
pub struct DescLists<'a, D: CDesc> {
    local: &'a [D],
    remote: &'a [D],
    handle_at: usize,
}

// SAFETY: the lists and the owner objects their descriptors name are only read, and the
// create functions' contract (nf_request_create, nf_request_create_meta) holds them alive
// and unchanged until the call returns, while the planning threads, joined before it
// returns, read them; handles are looked up in the registry, which takes its own locks.
// Only the two descriptor types of that contract.
unsafe impl Sync for DescLists<'_, super::nf_xfer_desc> {}
// SAFETY: as above.
unsafe impl Sync for DescLists<'_, super::nf_meta_desc> {}

impl<'a, D: CDesc> DescLists<'a, D> {
    /// # Safety
    /// Every descriptor's `handle_ptr(handle_at)` may be called (see `CDesc::handle_ptr`),
    /// from any thread, while the lists live.
    pub unsafe fn new(local: &'a [D], remote: &'a [D], handle_at: usize) -> Self {
        DescLists { local, remote, handle_at }
    }
}

impl<'a, D: CDesc> PairSource<'a> for DescLists<'a, D>
where
    DescLists<'a, D>: Sync,
{
    fn count(&self) -> usize {
        self.local.len().min(self.remote.len())
    }
    fn range(&self, start: usize, end: usize) -> impl Iterator<Item = Result<Pair<'a>>> {
        // SAFETY: new's caller vouched for every descriptor's handle at handle_at.
        unsafe { DescPairs::new(&self.local[start..end], &self.remote[start..end], start, self.handle_at) }
    }
}

/// Pairs local[i] <-> remote[i] of two lists of equal length (descriptors `first`.. of
/// the caller's lists, as errors name them).
pub struct DescPairs<'a, D: CDesc> {
    local: &'a [D],
    remote: &'a [D],
    i: usize,
    first: usize,
    handle_at: usize,
    keys: (*const c_void, *const c_void),
    mems: Option<(&'a Arc<LocalMem>, &'a Arc<RemoteMem>)>,
}

impl<'a, D: CDesc> DescPairs<'a, D> {
    /// # Safety
    /// Every descriptor's `handle_ptr(handle_at)` may be called (see `CDesc::handle_ptr`).
    pub unsafe fn new(local: &'a [D], remote: &'a [D], first: usize, handle_at: usize) -> Self {
        DescPairs { local, remote, i: 0, first, handle_at, keys: (std::ptr::null(), std::ptr::null()), mems: None }
    }

    /// Looks descriptor `i`'s handles up. Kept out of `next`: inlined there, it made the
    /// iterator too large for the scheduler's loop to inline, and every descriptor's pair was
    /// then read back from memory (most of the scheduler's time on the CPU machine).
    #[cold]
    #[inline(never)]
    fn look_up(&mut self, i: usize) -> Result<(&'a Arc<LocalMem>, &'a Arc<RemoteMem>)> {
        let (a, b) = (&self.local[i], &self.remote[i]);
        // SAFETY: handle_at is the offset `new`'s caller vouched for.
        let (lh, rh) = unsafe { (a.handle_ptr(self.handle_at), b.handle_ptr(self.handle_at)) };
        let i = self.first + i;
        let lm = handle(lh as *const nf_mem, MEM_MAGIC, "local descriptor's mem")
            .map_err(|_| Error::InvalidParam(format!("local descriptor {i} has no valid registration")))?;
        let rm = handle(rh as *const nf_rmem, RMEM_MAGIC, "remote descriptor's rmem")
            .map_err(|_| Error::InvalidParam(format!("remote descriptor {i} has no valid target")))?;
        self.keys = (a.key(), b.key());
        let mems = (&lm.mem, &rm.rmem);
        self.mems = Some(mems);
        Ok(mems)
    }
}

impl<'a, D: CDesc> Iterator for DescPairs<'a, D> {
    type Item = Result<Pair<'a>>;

    #[inline(always)]
    fn next(&mut self) -> Option<Self::Item> {
        let i = self.i;
        let (a, b) = (self.local.get(i)?, self.remote.get(i)?);
        self.i += 1;
        let mems = match self.mems {
            Some(m) if (a.key(), b.key()) == self.keys => m,
            _ => match self.look_up(i) {
                Ok(m) => m,
                Err(e) => return Some(Err(e)),
            },
        };
        let ((la, ll), (ra, rl)) = (a.range(), b.range());
        Some(Ok(Pair { local: (la, ll, mems.0), remote: (ra, rl, mems.1) }))
    }
}
