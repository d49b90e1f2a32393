//! Peers known to an engine: their connection info and whether they were disconnected.
use super::wire::ConnInfo;
use std::sync::atomic::{AtomicBool, Ordering};

pub struct Peer {
    /// Our id for this incarnation of the peer (a restarted peer gets a new one).
    pub id: u64,
    pub name: String,
    pub info: ConnInfo,
    pub raw: Vec<u8>,
    disconnected: AtomicBool,
}

impl Peer {
    pub fn new(id: u64, name: &str, info: ConnInfo, raw: Vec<u8>) -> Peer {
        Peer { id, name: name.to_string(), info, raw, disconnected: AtomicBool::new(false) }
    }
    pub fn is_disconnected(&self) -> bool {
        self.disconnected.load(Ordering::Acquire)
    }
    pub fn mark_disconnected(&self) {
        self.disconnected.store(true, Ordering::Release)
    }
}
