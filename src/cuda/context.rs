//! CUDA contexts: the opaque handle captured from a pointer's attributes, making it current
//! on the calling thread (DESIGN rule 4), and owned primary/created contexts for tests.
use super::driver::Driver;
use super::error::{CudaError, Result};
use super::sys::*;
use std::cell::Cell;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// A CUDA context handle (`CUcontext`). Copy, comparable (by handle) and hashable, so a
/// registration can store it and a set of them can be de-duplicated. It does not own the
/// context: it stays usable while the context exists, which holds while memory allocated
/// in it is alive (a registration keeps its memory, hence its context). Never NULL, so that
/// an `Option<Context>` is one word (every segment of a request carries one).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Context(NonNull<c_void>);

// SAFETY: a CUcontext is an opaque handle; the driver API accepts it from any thread.
unsafe impl Send for Context {}
// SAFETY: as above; the handle is never dereferenced on our side.
unsafe impl Sync for Context {}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context({:#x})", self.0.as_ptr() as usize)
    }
}

/// Bumped whenever this module destroys (or may destroy) a context, so a thread's record
/// of "the context I last set" can never vouch for a handle that was freed and reused.
static EPOCH: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// (handle, epoch) of the context this module last made current on this thread. Const
    /// initialised with no destructor, so it is safe in a dlclose'd plugin.
    static LAST_SET: Cell<(usize, u64)> = const { Cell::new((0, u64::MAX)) };
}

pub(super) fn bump_epoch() {
    EPOCH.fetch_add(1, Ordering::Relaxed);
}

fn remember(ctx: CUcontext) {
    let e = EPOCH.load(Ordering::Relaxed);
    LAST_SET.with(|c| c.set((ctx as usize, e)));
}

impl Context {
    /// Wraps a handle; None for NULL.
    ///
    /// # Safety
    /// `raw` must be a live CUcontext (for example one obtained from the driver by code
    /// outside this crate), and stay live while the returned value is used.
    pub unsafe fn from_raw(raw: *mut c_void) -> Option<Context> {
        NonNull::new(raw).map(Context)
    }

    pub(super) fn from_driver(raw: CUcontext) -> Option<Context> {
        NonNull::new(raw).map(Context)
    }

    /// The raw handle, for logs or for passing to other CUDA-aware code.
    pub fn as_raw(&self) -> *mut c_void {
        self.0.as_ptr()
    }

    /// The handle as a number (logs, keys).
    pub fn id(&self) -> usize {
        self.0.as_ptr() as usize
    }

    /// The context current on the calling thread (cuCtxGetCurrent), None when there is none.
    pub fn current() -> Result<Option<Context>> {
        let d = Driver::get()?;
        let mut cur: CUcontext = std::ptr::null_mut();
        // SAFETY: cur is a valid out-pointer for the call's duration.
        d.check("cuCtxGetCurrent", unsafe { (d.f.ctx_get_current)(&mut cur) })?;
        Ok(Context::from_driver(cur))
    }

    /// Makes this context current on the calling thread, and leaves it current. Always
    /// truthful: asks the driver what is current (cuCtxGetCurrent, a thread-local read in
    /// the driver) and calls cuCtxSetCurrent only when it differs. Returns whether it
    /// switched. cuCtxSetCurrent replaces the top of the thread's context stack.
    pub fn make_current(&self) -> Result<bool> {
        let d = Driver::get()?;
        let mut cur: CUcontext = std::ptr::null_mut();
        // SAFETY: cur is a valid out-pointer for the call's duration.
        d.check("cuCtxGetCurrent", unsafe { (d.f.ctx_get_current)(&mut cur) })?;
        if cur == self.0.as_ptr() {
            remember(self.0.as_ptr());
            return Ok(false);
        }
        // SAFETY: self.0 is a context handle the driver gave us (see the type's contract).
        d.check("cuCtxSetCurrent", unsafe { (d.f.ctx_set_current)(self.0.as_ptr()) })?;
        remember(self.0.as_ptr());
        Ok(true)
    }

    /// As [`make_current`](Self::make_current), but returns at once, with no driver call,
    /// when this module itself last made this context current on this thread and no
    /// context has been destroyed through this module since. Only correct on threads where
    /// nothing else changes the current context between calls (cudaSetDevice,
    /// cuCtxSetCurrent/Push/Pop by other code): the engine's own progress thread, not a
    /// user thread. Call [`forget_thread_cache`](Self::forget_thread_cache) after running
    /// code that might switch contexts. On a miss it takes the truthful path.
    pub fn make_current_cached(&self) -> Result<bool> {
        let e = EPOCH.load(Ordering::Relaxed);
        if LAST_SET.with(|c| c.get()) == (self.0.as_ptr() as usize, e) {
            return Ok(false);
        }
        self.make_current()
    }

    /// Drops this thread's record, so the next [`make_current_cached`] asks the driver.
    pub fn forget_thread_cache() {
        LAST_SET.with(|c| c.set((0, u64::MAX)));
    }

    /// The device ordinal of this context (cuCtxGetDevice under a push/pop, so the
    /// thread's current context is unchanged).
    pub fn device_ordinal(&self) -> Result<i32> {
        let d = Driver::get()?;
        let get = d.opt(d.f.ctx_get_device, "cuCtxGetDevice")?;
        let _g = Pushed::new(d, *self)?;
        let mut dev: CUdevice = 0;
        // SAFETY: dev is a valid out-pointer; a context is current (pushed above).
        d.check("cuCtxGetDevice", unsafe { get(&mut dev) })?;
        Ok(dev)
    }

    /// Retains the primary context of device `ordinal` (cuDevicePrimaryCtxRetain), the one
    /// the CUDA runtime uses; released when the guard drops. Does not make it current.
    pub fn primary(ordinal: i32) -> Result<PrimaryContext> {
        let d = Driver::get()?;
        let retain = d.opt(d.f.primary_ctx_retain, "cuDevicePrimaryCtxRetain")?;
        d.opt(d.f.primary_ctx_release, "cuDevicePrimaryCtxRelease_v2")?;
        let dev = device(d, ordinal)?;
        let mut raw: CUcontext = std::ptr::null_mut();
        // SAFETY: raw is a valid out-pointer; dev came from cuDeviceGet.
        d.check("cuDevicePrimaryCtxRetain", unsafe { retain(&mut raw, dev) })?;
        match Context::from_driver(raw) {
            Some(ctx) => Ok(PrimaryContext { ctx, dev }),
            None => Err(d.err("cuDevicePrimaryCtxRetain", CUDA_ERROR_INVALID_CONTEXT)),
        }
    }

    /// Creates a new (non-primary) context on device `ordinal` (cuCtxCreate_v2, or _v4 with
    /// default parameters), destroyed when the guard drops. The calling thread's current
    /// context is left as it was (the new context is popped right after creation).
    pub fn create(ordinal: i32) -> Result<OwnedContext> {
        let d = Driver::get()?;
        let destroy = d.opt(d.f.ctx_destroy, "cuCtxDestroy_v2")?;
        let dev = device(d, ordinal)?;
        let mut raw: CUcontext = std::ptr::null_mut();
        let (func, r) = if let Some(create) = d.f.ctx_create_v2 {
            // SAFETY: raw is a valid out-pointer; flags 0 = default scheduling.
            ("cuCtxCreate_v2", unsafe { create(&mut raw, 0, dev) })
        } else if let Some(create) = d.f.ctx_create_v4 {
            // A zeroed parameter block larger than any CUctxCreateParams: no execution
            // affinity, no CIG.
            let mut params = [0u64; 16];
            // SAFETY: raw is a valid out-pointer; params is a live zeroed block that the
            // driver only reads during the call.
            ("cuCtxCreate_v4", unsafe { create(&mut raw, params.as_mut_ptr() as *mut c_void, 0, dev) })
        } else {
            return Err(CudaError::Missing { func: "cuCtxCreate_v2" });
        };
        d.check(func, r)?;
        let ctx = match Context::from_driver(raw) {
            Some(c) => c,
            None => return Err(d.err(func, CUDA_ERROR_INVALID_CONTEXT)),
        };
        // cuCtxCreate pushed the new context; pop it to restore the thread's state.
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: popped is a valid out-pointer; the stack is non-empty (just pushed).
        let r = unsafe { (d.f.ctx_pop_current)(&mut popped) };
        if let Err(e) = d.check("cuCtxPopCurrent_v2", r) {
            // SAFETY: ctx was created above and is not used after this.
            unsafe { destroy(ctx.0.as_ptr()) };
            bump_epoch();
            return Err(e);
        }
        Ok(OwnedContext { ctx })
    }
}

fn device(d: &Driver, ordinal: i32) -> Result<CUdevice> {
    let mut dev: CUdevice = 0;
    // SAFETY: dev is a valid out-pointer for the call's duration.
    d.check("cuDeviceGet", unsafe { (d.f.device_get)(&mut dev, ordinal) })?;
    Ok(dev)
}

/// A retained primary context; derefs to its [`Context`].
#[derive(Debug)]
pub struct PrimaryContext {
    ctx: Context,
    dev: CUdevice,
}

impl PrimaryContext {
    pub fn context(&self) -> Context {
        self.ctx
    }
    pub fn ordinal(&self) -> i32 {
        self.dev
    }
}

impl std::ops::Deref for PrimaryContext {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.ctx
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        if let Some((name, release)) = d.f.primary_ctx_release {
            // SAFETY: we hold one retain on this device's primary context.
            let r = unsafe { release(self.dev) };
            // The last release destroys the context; no cached record may vouch for it.
            bump_epoch();
            if let Err(e) = d.check(name, r) {
                log::warn!("{e}");
            }
        }
    }
}

/// A context created by [`Context::create`], destroyed (cuCtxDestroy_v2) on drop. Derefs
/// to its [`Context`]. Destroy it only after everything allocated in it is gone.
#[derive(Debug)]
pub struct OwnedContext {
    ctx: Context,
}

impl OwnedContext {
    pub fn context(&self) -> Context {
        self.ctx
    }
}

impl std::ops::Deref for OwnedContext {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.ctx
    }
}

impl Drop for OwnedContext {
    fn drop(&mut self) {
        let Ok(d) = Driver::get() else { return };
        if let Some(destroy) = d.f.ctx_destroy {
            // SAFETY: we created this context and own it; the handle is not used again.
            let r = unsafe { destroy(self.ctx.0.as_ptr()) };
            bump_epoch();
            if let Err(e) = d.check("cuCtxDestroy_v2", r) {
                log::warn!("{e}");
            }
        }
    }
}

/// Pushes a context for the guard's lifetime (cuCtxPushCurrent_v2 / cuCtxPopCurrent_v2),
/// for creating and destroying resources without changing the thread's current context.
pub(super) struct Pushed<'d> {
    d: &'d Driver,
}

impl<'d> Pushed<'d> {
    pub(super) fn new(d: &'d Driver, ctx: Context) -> Result<Pushed<'d>> {
        // SAFETY: ctx is a context handle the driver gave us.
        d.check("cuCtxPushCurrent_v2", unsafe { (d.f.ctx_push_current)(ctx.0.as_ptr()) })?;
        Ok(Pushed { d })
    }
}

impl Drop for Pushed<'_> {
    fn drop(&mut self) {
        let mut out: CUcontext = std::ptr::null_mut();
        // SAFETY: out is a valid out-pointer; we pushed one context in new().
        let r = unsafe { (self.d.f.ctx_pop_current)(&mut out) };
        if let Err(e) = self.d.check("cuCtxPopCurrent_v2", r) {
            log::warn!("{e}");
        }
    }
}
