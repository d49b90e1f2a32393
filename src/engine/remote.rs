//! Transfer targets: a peer's registration as its public descriptor describes it, or one of
//! our own registrations (loopback).
use super::ipc_cache::IpcEntry;
use super::peer::Peer;
use super::registry::{check_range, LocalMem, MemKind};
use super::wire::MemDesc;
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex};

/// Where a transfer's remote side lives.
// One per loaded descriptor, behind an Arc: the size of the larger variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum RemoteMem {
    /// A peer's registration, as described by its public descriptor. `opened`: its GPU
    /// allocation opened here by IPC, kept while the descriptor is loaded so that every
    /// request to it shares one mapping.
    Peer { peer: Arc<Peer>, desc: MemDesc, opened: Mutex<Vec<Arc<IpcEntry>>> },
    /// One of our own registrations (loopback); keeps it alive.
    Local(Arc<LocalMem>),
}

impl RemoteMem {
    /// Whether this target is [addr, addr+len) of `kind`, as a caller believes.
    pub fn matches(&self, addr: u64, len: u64, kind: MemKind) -> Result<()> {
        let (base, size, k) = match self {
            RemoteMem::Peer { desc, .. } => (desc.base, desc.len, desc.mem_type as u32),
            RemoteMem::Local(m) => (m.base, m.len, m.kind as u32),
        };
        if base != addr || size != len || k != kind as u32 {
            return Err(Error::Mismatch(format!(
                "descriptor is [{base:#x}, +{size}) type {k}, expected [{addr:#x}, +{len}) type {}", kind as u32
            )));
        }
        Ok(())
    }

    /// The registration's first byte and length.
    pub fn range(&self) -> (u64, u64) {
        match self {
            RemoteMem::Peer { desc, .. } => (desc.base, desc.len),
            RemoteMem::Local(m) => (m.base, m.len),
        }
    }

    pub fn check(&self, addr: u64, len: u64) -> Result<()> {
        match self {
            RemoteMem::Peer { desc, .. } => check_range(desc.base, desc.len, addr, len, "remote descriptor"),
            RemoteMem::Local(m) => m.check(addr, len, "remote (loopback) descriptor"),
        }
    }
}

