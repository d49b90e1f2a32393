//! Streams and events: asynchronous copies whose completion the progress loop polls, so
//! staging chunks pipeline without blocking.
use super::context::{Context, Pushed};
use super::driver::Driver;
use super::error::Result;
use super::sys::*;
use std::ffi::c_void;

/// A non-blocking stream (CU_STREAM_NON_BLOCKING: it does not wait for the application's
/// work on the legacy default stream) owned by this value and destroyed on drop under its
/// context. Its methods need the stream's context current on the calling thread: the engine makes
/// it current itself, once per pass and before each chunk (rule 4).
///
/// Dropping it does not wait for queued work (the driver releases the stream once that
/// work is done); buffers that pending copies use must outlive them: call
/// [`synchronize`](Self::synchronize) first when in doubt.
pub struct Stream {
    raw: CUstream,
    ctx: Context,
}

// SAFETY: a CUstream is an opaque handle; the driver API is thread-safe and accepts it
// from any thread.
unsafe impl Send for Stream {}
// SAFETY: as above; all methods only pass the handle to the driver.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream in `ctx` (pushed for the call; the thread's current context is
    /// unchanged).
    pub fn new(ctx: &Context) -> Result<Stream> {
        let d = Driver::get()?;
        let _g = Pushed::new(d, *ctx)?;
        let mut raw: CUstream = std::ptr::null_mut();
        // SAFETY: raw is a valid out-pointer; a context is current (pushed).
        d.check("cuStreamCreate", unsafe { (d.f.stream_create)(&mut raw, CU_STREAM_NON_BLOCKING) })?;
        Ok(Stream { raw, ctx: *ctx })
    }

    pub fn context(&self) -> Context {
        self.ctx
    }

    pub(super) fn raw(&self) -> CUstream {
        self.raw
    }

    /// Stream work needs the stream's context current on the calling thread. The engine
    /// makes it current itself (once per pass and before each chunk, rule 4), so this does
    /// not switch contexts behind its back: a thread without the context fails loudly with
    /// CUDA_ERROR_INVALID_CONTEXT instead of being silently repaired.
    fn enter(&self) -> Result<&'static Driver> {
        Driver::get()
    }

    /// Queues a copy of `len` bytes from host `src` to device `dst`. Asynchronous to the
    /// host only when `src` is pinned (a [`PinnedBuffer`](super::PinnedBuffer)).
    ///
    /// # Safety
    /// [src, src + len) must stay allocated and unmodified, and [dst, dst + len) must be
    /// device-writable memory nobody else touches, until the copy completes (an event
    /// recorded after it reports ready, or the stream is synchronized).
    pub unsafe fn copy_htod_async(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let d = self.enter()?;
        // SAFETY: the caller keeps both ranges valid until completion; the handle is ours.
        let r = unsafe { (d.f.memcpy_htod_async)(dst, src as *const c_void, len, self.raw) };
        d.check("cuMemcpyHtoDAsync_v2", r)
    }

    /// Queues a copy of `len` bytes from device `src` to host `dst` (pinned for true
    /// asynchrony).
    ///
    /// # Safety
    /// [dst, dst + len) must stay allocated and must not be read or written by anyone, and
    /// [src, src + len) must stay valid and unmodified, until the copy completes.
    pub unsafe fn copy_dtoh_async(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let d = self.enter()?;
        // SAFETY: the caller keeps both ranges valid until completion; the handle is ours.
        let r = unsafe { (d.f.memcpy_dtoh_async)(dst as *mut c_void, src, len, self.raw) };
        d.check("cuMemcpyDtoHAsync_v2", r)
    }

    /// Queues a device-to-device copy.
    ///
    /// # Safety
    /// As for the other copies, for both device ranges.
    pub unsafe fn copy_dtod_async(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let d = self.enter()?;
        let copy = d.opt(d.f.memcpy_dtod_async, "cuMemcpyDtoDAsync_v2")?;
        // SAFETY: the caller keeps both ranges valid until completion; the handle is ours.
        d.check("cuMemcpyDtoDAsync_v2", unsafe { copy(dst, src, len, self.raw) })
    }

    /// Queues a copy between any two unified addresses (cuMemcpyAsync infers the
    /// direction).
    ///
    /// # Safety
    /// As for the other copies.
    pub unsafe fn copy_async(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let d = self.enter()?;
        let copy = d.opt(d.f.memcpy_async, "cuMemcpyAsync")?;
        // SAFETY: the caller keeps both ranges valid until completion; the handle is ours.
        d.check("cuMemcpyAsync", unsafe { copy(dst, src, len, self.raw) })
    }

    /// Records a new event after everything queued so far. The event is created in the
    /// thread's current context, which must be the stream's: the staging pipeline relies on
    /// the progress loop having made it current (rule 4), and a thread without it fails here
    /// with CUDA_ERROR_INVALID_CONTEXT rather than later.
    pub fn record(&self) -> Result<Event> {
        let d = Driver::get()?;
        let mut raw: CUevent = std::ptr::null_mut();
        // SAFETY: raw is a valid out-pointer; cuEventCreate uses the current context.
        d.check("cuEventCreate", unsafe { (d.f.event_create)(&mut raw, CU_EVENT_DISABLE_TIMING) })?;
        let ev = Event { raw, ctx: self.ctx };
        self.record_event(&ev)?;
        Ok(ev)
    }

    /// Re-records `ev` (created in the same context) after everything queued so far, so a
    /// pipeline can reuse events instead of creating one per chunk.
    pub fn record_event(&self, ev: &Event) -> Result<()> {
        let d = self.enter()?;
        // SAFETY: both handles are live and ours.
        d.check("cuEventRecord", unsafe { (d.f.event_record)(ev.raw, self.raw) })
    }

    /// Whether all queued work is done (cuStreamQuery; never blocks).
    pub fn query(&self) -> Result<bool> {
        let d = self.enter()?;
        // SAFETY: the handle is live and ours.
        ready(d, "cuStreamQuery", unsafe { (d.f.stream_query)(self.raw) })
    }

    /// Blocks until all queued work is done (cuStreamSynchronize).
    pub fn synchronize(&self) -> Result<()> {
        let d = self.enter()?;
        // SAFETY: the handle is live and ours.
        d.check("cuStreamSynchronize", unsafe { (d.f.stream_synchronize)(self.raw) })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        let g = Pushed::new(d, self.ctx);
        // SAFETY: we own the stream; the handle is not used after this.
        if let Err(e) = d.check("cuStreamDestroy_v2", unsafe { (d.f.stream_destroy)(self.raw) }) {
            log::warn!("{e}");
        }
        drop(g);
    }
}

/// SUCCESS means ready, NOT_READY means not yet, anything else is the error.
fn ready(d: &Driver, func: &'static str, r: CUresult) -> Result<bool> {
    match r {
        CUDA_SUCCESS => Ok(true),
        CUDA_ERROR_NOT_READY => Ok(false),
        _ => Err(d.err(func, r)),
    }
}

/// An event (CU_EVENT_DISABLE_TIMING) owned by this value, destroyed on drop. A fresh,
/// never-recorded event reports ready.
pub struct Event {
    raw: CUevent,
    ctx: Context,
}

// SAFETY: a CUevent is an opaque handle; the driver API accepts it from any thread.
unsafe impl Send for Event {}
// SAFETY: as above; all methods only pass the handle to the driver.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event in `ctx` (pushed for the call).
    pub fn new(ctx: &Context) -> Result<Event> {
        let d = Driver::get()?;
        let _g = Pushed::new(d, *ctx)?;
        let mut raw: CUevent = std::ptr::null_mut();
        // SAFETY: raw is a valid out-pointer; a context is current (pushed).
        d.check("cuEventCreate", unsafe { (d.f.event_create)(&mut raw, CU_EVENT_DISABLE_TIMING) })?;
        Ok(Event { raw, ctx: *ctx })
    }

    pub fn context(&self) -> Context {
        self.ctx
    }

    /// Whether the work before the last record is done (cuEventQuery; never blocks).
    /// Needs the event's context current on the calling thread (see `Stream::enter`).
    pub fn query(&self) -> Result<bool> {
        let d = Driver::get()?;
        // SAFETY: the handle is live and ours.
        ready(d, "cuEventQuery", unsafe { (d.f.event_query)(self.raw) })
    }

    /// Blocks until the work before the last record is done (cuEventSynchronize).
    pub fn synchronize(&self) -> Result<()> {
        let d = Driver::get()?;
        let sync = d.opt(d.f.event_synchronize, "cuEventSynchronize")?;
        self.ctx.make_current()?;
        // SAFETY: the handle is live and ours.
        d.check("cuEventSynchronize", unsafe { sync(self.raw) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        let g = Pushed::new(d, self.ctx);
        // SAFETY: we own the event; the handle is not used after this.
        if let Err(e) = d.check("cuEventDestroy_v2", unsafe { (d.f.event_destroy)(self.raw) }) {
            log::warn!("{e}");
        }
        drop(g);
    }
}
