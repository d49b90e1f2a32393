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
    /// The pairs of `route` that touch rail 0 on neither side, where at least two such exist
    /// (else `route`): bulk data kept off the control endpoint pair (config rma_rail0,
    /// staging_rail0), so that control messages and small requests never queue behind it.
    bulk: Vec<RoutePair>,
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
        let off0: Vec<RoutePair> = route.iter().copied().filter(|p| p.rail != 0 && p.rrail != 0).collect();
        let bulk = if off0.len() >= 2 { off0 } else { route.clone() };
        Peer { id, name: name.to_string(), info, raw, route, bulk, same_host, cma, local, disconnected: AtomicBool::new(false) }
    }
    /// The pairs bulk data takes: every pair of the route, or (`rail0` false) those off rail 0
    /// where at least two are (with one, rail 0's queue costs less than half the rails).
    pub fn bulk_route(&self, rail0: bool) -> &[RoutePair] {
        if rail0 { &self.route } else { &self.bulk }
    }
    pub fn is_disconnected(&self) -> bool {
        self.disconnected.load(Ordering::Acquire)
    }
    pub fn mark_disconnected(&self) {
        self.disconnected.store(true, Ordering::Release)
    }
}
