//! The fence at the C boundary: panics become NF_ERR_UNKNOWN (with a log line), errors
//! become their status, and pointers are checked before use.
use crate::error::{Error, Status};
use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `f`, turning an error into its status (logged once, naming the call) and a panic
/// into NF_ERR_UNKNOWN.
pub fn guard(call: &'static str, f: impl FnOnce() -> Result<Status, Error>) -> Status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            let s = e.status();
            log::error!("{call}: {e} -> {}", s.name());
            s
        }
        Err(_) => {
            log::error!("{call}: internal panic caught at the C boundary");
            Status::NF_ERR_UNKNOWN
        }
    }
}

/// Like [`guard`] for calls that return no status.
pub fn guard_void(call: &'static str, f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        log::error!("{call}: internal panic caught at the C boundary");
    }
}

pub fn cstr<'a>(p: *const c_char, what: &str) -> Result<&'a str, Error> {
    if p.is_null() {
        return Err(Error::InvalidParam(format!("{what} is NULL")));
    }
    // SAFETY: the caller passes a NUL-terminated string that lives for the call.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Error::InvalidParam(format!("{what} is not UTF-8")))
}

pub fn bytes<'a>(p: *const u8, len: usize, what: &str) -> Result<&'a [u8], Error> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::InvalidParam(format!("{what} is NULL with length {len}")));
    }
    // SAFETY: the caller passes `len` readable bytes at `p` that live for the call.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// `count` elements at `p` (a list the caller passes with its length).
pub fn slice<'a, T>(p: *const T, count: usize, what: &str) -> Result<&'a [T], Error> {
    if p.is_null() {
        return Err(Error::InvalidParam(format!("{what} is NULL")));
    }
    // SAFETY: the caller passes `count` readable elements at `p` that live for the call.
    Ok(unsafe { std::slice::from_raw_parts(p, count) })
}

/// The handle pointer stored at byte `at` of the caller's object `owner`.
///
/// # Safety
/// `owner` points at a live object of the caller's with an aligned pointer at byte `at`.
pub unsafe fn handle_in(owner: *const c_void, at: usize) -> *const c_void {
    // SAFETY: the caller's promise above.
    unsafe { *(owner as *const u8).add(at).cast::<*const c_void>() }
}

/// Copies `v` NUL-terminated into the caller's `buf` of `cap` bytes, cut to fit (nothing
/// for a NULL or empty buffer).
pub fn copy_cstr(v: &str, buf: *mut c_char, cap: usize) {
    if buf.is_null() || cap == 0 {
        return;
    }
    let n = v.len().min(cap - 1);
    // SAFETY: buf has cap bytes of room (the caller's promise); n + 1 <= cap.
    unsafe {
        std::ptr::copy_nonoverlapping(v.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
}

/// Frees what `blob_out` put in a blob and empties it (NULL and empty blobs are ignored).
pub fn free_blob(blob: *mut crate::capi::nf_blob) {
    // SAFETY: a non-NULL blob points at the caller's nf_blob, which blob_out filled from a
    // boxed slice of `len` bytes (or left empty).
    unsafe {
        if let Some(b) = blob.as_mut() {
            if !b.data.is_null() {
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(b.data, b.len)));
            }
            b.data = std::ptr::null_mut();
            b.len = 0;
        }
    }
}

/// Hands one notification to the caller's callback.
pub fn call_notif(cb: unsafe extern "C" fn(*mut std::ffi::c_void, *const c_char, usize, *const u8, usize), ctx: *mut std::ffi::c_void, sender: &str, msg: &[u8]) {
    // SAFETY: cb is the caller's function and ctx its own pointer, passed back untouched;
    // sender and msg are valid for the call, as the header documents.
    unsafe { cb(ctx, sender.as_ptr() as *const c_char, sender.len(), msg.as_ptr(), msg.len()) };
}

pub fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Error> {
    // SAFETY: a non-NULL out pointer from the caller points at writable storage for a T.
    unsafe { p.as_mut() }.ok_or_else(|| Error::InvalidParam(format!("{what} is NULL")))
}

pub fn ok() -> Result<Status, Error> {
    Ok(Status::NF_SUCCESS)
}
