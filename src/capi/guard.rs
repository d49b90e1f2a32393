//! The fence at the C boundary: panics become NF_ERR_UNKNOWN (with a log line), errors
//! become their status, and pointers are checked before use.
use crate::error::{Error, Status};
use std::ffi::{c_char, CStr};
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

pub fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Error> {
    // SAFETY: a non-NULL out pointer from the caller points at writable storage for a T.
    unsafe { p.as_mut() }.ok_or_else(|| Error::InvalidParam(format!("{what} is NULL")))
}

pub fn ok() -> Result<Status, Error> {
    Ok(Status::NF_SUCCESS)
}
