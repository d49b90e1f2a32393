//! The live handles: every handle we hand out is recorded here (address -> kind) until it
//! is freed, and a pointer from the caller is looked up before it is dereferenced. Reading
//! a magic number through the pointer instead would read freed memory for a stale handle.
//! Sharded by address so threads working on different handles rarely meet on one lock.
use crate::error::Error;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard};

const SHARDS: usize = 16;

/// Hashes a handle's address with one multiplication: the keys are our own heap addresses,
/// not input an attacker picks, and the default SipHash was a visible part of every call's
/// handle check (two per post, perf on the CI VM).
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn finish(&self) -> u64 {
        // The multiplication leaves its best bits high; the table indexes by the low ones.
        self.0.rotate_left(32)
    }
}

type Live = HashMap<usize, u64, BuildHasherDefault<AddrHasher>>;

static LIVE: [Mutex<Option<Live>>; SHARDS] = [const { Mutex::new(None) }; SHARDS];

fn shard(addr: usize) -> MutexGuard<'static, Option<Live>> {
    // Boxes are at least 8-byte aligned: the low bits carry nothing.
    LIVE[(addr >> 4) % SHARDS].lock().unwrap_or_else(|p| p.into_inner())
}

/// Hands out a boxed handle of `kind`, recorded as live.
pub(super) fn publish<T>(b: Box<T>, kind: u64) -> *mut T {
    let p = Box::into_raw(b);
    shard(p as usize).get_or_insert_with(Live::default).insert(p as usize, kind);
    p
}

/// Whether `p` is a live handle of `kind` (NULL, freed, foreign and other kinds are not).
fn is_live<T>(p: *const T, kind: u64) -> bool {
    !p.is_null() && shard(p as usize).as_ref().and_then(|m| m.get(&(p as usize))) == Some(&kind)
}

fn refuse<T>(p: *const T, what: &str) -> Error {
    if p.is_null() {
        Error::InvalidParam(format!("{what} is NULL"))
    } else {
        Error::InvalidParam(format!("{what} is not a live handle"))
    }
}

/// The handle behind `p`, if it is a live one of `kind`.
pub(super) fn get<'a, T>(p: *const T, kind: u64, what: &str) -> Result<&'a T, Error> {
    if !is_live(p, kind) {
        return Err(refuse(p, what));
    }
    // SAFETY: p was returned by `publish` for this kind and has not been retired, so it
    // points at a live T; the C caller does not free it during the call (API contract).
    Ok(unsafe { &*p })
}

/// As `get`, mutable: the caller owns the handle exclusively for the call (API contract).
pub(super) fn get_mut<'a, T>(p: *mut T, kind: u64, what: &str) -> Result<&'a mut T, Error> {
    if !is_live(p, kind) {
        return Err(refuse(p, what));
    }
    // SAFETY: as in `get`; the C API gives the calling thread the handle alone.
    Ok(unsafe { &mut *p })
}

/// Takes a live handle of `kind` back (to be dropped); it is no longer live afterwards, so
/// a second free, or any later use, is refused.
pub(super) fn retire<T>(p: *mut T, kind: u64, what: &str) -> Result<Box<T>, Error> {
    let was = {
        let mut s = shard(p as usize);
        match s.as_mut() {
            Some(m) if !p.is_null() && m.get(&(p as usize)) == Some(&kind) => m.remove(&(p as usize)).is_some(),
            _ => false,
        }
    };
    if !was {
        return Err(refuse(p, what));
    }
    // SAFETY: p came from Box::into_raw in `publish` and was live until the removal above,
    // which happens once per handle.
    Ok(unsafe { Box::from_raw(p) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_foreign_and_null_handles_are_refused_without_a_read() {
        let p = publish(Box::new(7u64), 1);
        assert_eq!(*get(p, 1, "x").unwrap(), 7);
        assert!(get(p, 2, "x").is_err(), "another kind");
        assert!(get(std::ptr::null::<u64>(), 1, "x").is_err());
        let q = 0x10usize as *const u64; // never handed out: looked up, never read
        assert!(get(q, 1, "x").is_err());
        drop(retire(p, 1, "x").unwrap());
        assert!(get(p, 1, "x").is_err(), "freed");
        assert!(retire(p, 1, "x").is_err(), "double free");
    }
}
