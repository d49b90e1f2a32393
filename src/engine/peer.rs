//! Peers known to an engine: their connection info and whether they were disconnected.
use super::local_peers::Locality;
use super::wire::ConnInfo;
use std::sync::atomic::{AtomicBool, Ordering};

/// One (our rail, their rail) pair that carries data to a peer. `virt` is the address form
/// the pair's provider expects, when it is known from our own rail of that provider (shm);
/// None means: as the peer's descriptor says (its network rails).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoutePair {
    pub rail: u16,
    pub rrail: u16,
    pub virt: Option<bool>,
}

pub struct Peer {
    /// Our id for this incarnation of the peer (a restarted peer gets a new one).
    pub id: u64,
    pub name: String,
    pub info: ConnInfo,
    pub raw: Vec<u8>,
    /// The rail pairs data to this peer uses (the shm pair alone for a same-host peer).
    pub route: Vec<RoutePair>,
    pub same_host: bool,
    /// This process may read and write the peer's memory directly (cma::reachable).
    pub cma: bool,
    /// Whether its memory is reachable without the rails (same process, or same host for
    /// GPU memory through IPC), and how we learn that it died.
    pub local: Locality,
    disconnected: AtomicBool,
}

impl Peer {
    #[allow(clippy::too_many_arguments)]
    pub fn new(id: u64, name: &str, info: ConnInfo, raw: Vec<u8>, route: Vec<RoutePair>, same_host: bool, cma: bool, local: Locality) -> Peer {
        Peer { id, name: name.to_string(), info, raw, route, same_host, cma, local, disconnected: AtomicBool::new(false) }
    }
    pub fn is_disconnected(&self) -> bool {
        self.disconnected.load(Ordering::Acquire)
    }
    pub fn mark_disconnected(&self) {
        self.disconnected.store(true, Ordering::Release)
    }
}
