//! Who we talk to on the rails: the peers we connected to (their addresses in our AVs per
//! rail pair) and the engines that introduced themselves to us (initiators, whose requests
//! we answer). Owned by the driver; transports look addresses up here.
use super::core::Core;
use super::ctrl::CtrlOut;
use super::local_peers::PidFd;
use super::peer::Peer;
use super::port::Port;
use super::wire::{self, ConnInfo, Ctrl, CtrlType};
use crate::error::{Error, Result};
use crate::fabric::FiAddr;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Maps keyed by our peer ids and engine ids, looked up once per operation and completion:
/// a multiplicative hash instead of SipHash (callgrind: SipHash was ~190 instructions per
/// operation). The keys come from us (sequential ids) or are random engine ids, so
/// flooding the table is not a concern.
pub type IdMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;

#[derive(Default)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

/// Our addresses of one peer: `addrs[local rail][remote rail]`.
pub struct Conn {
    pub peer: Arc<Peer>,
    pub addrs: Vec<Vec<Option<FiAddr>>>,
    /// Bit r: a completed write on our rail r has reached this peer's memory (RailCaps::
    /// sync_rma and the peer is reachable by CMA), so it needs neither flush nor
    /// delivery-complete.
    pub sync_rails: u64,
    pub last_completion: Instant,
    pub last_kick: Option<Instant>,
}

/// An engine that sent us HELLO: what we need to answer it (stage and copy requests).
pub struct Initiator {
    pub name: String,
    pub info: Option<ConnInfo>,
    pub addr: Option<FiAddr>,
    /// Our addresses of its other rails: (our rail, its rail, address), inserted on first
    /// use (staged chunks are served on the rail pair the initiator chose).
    pub rail_addrs: Vec<(u16, u16, FiAddr)>,
    /// Watches its process when it is on this host (copy requests open its GPU memory).
    pub pidfd: Option<PidFd>,
}

#[derive(Default)]
pub struct Conns {
    pub peers: IdMap<Conn>,
    pub initiators: IdMap<Initiator>,
}

impl Conns {
    /// Our address of peer `peer_id`'s rail `rrail` on our rail `rail`.
    pub fn addr(&self, peer_id: u64, rail: usize, rrail: usize) -> Result<FiAddr> {
        self.peers
            .get(&peer_id)
            .and_then(|c| c.addrs.get(rail)?.get(rrail).copied().flatten())
            .ok_or_else(|| Error::Disconnected("peer was disconnected".into()))
    }

    /// Where control messages to `peer_id` go (rail 0 to its rail 0).
    pub fn ctrl_addr(&self, peer_id: u64) -> Result<FiAddr> {
        self.addr(peer_id, 0, 0)
    }

    /// Something of ours toward `peer_id` completed: it is alive (deadlines, rule 2).
    pub fn touch(&mut self, peer_id: u64) {
        if let Some(c) = self.peers.get_mut(&peer_id) {
            c.last_completion = Instant::now();
        }
    }

    /// Our rail-0 address of an engine that introduced itself (inserted on first use).
    pub fn initiator_addr(&mut self, engine_id: u64, rail0: &dyn Port, owner: &str) -> Option<FiAddr> {
        let ini = self.initiators.get_mut(&engine_id)?;
        if ini.addr.is_none() {
            let ra = ini.info.as_ref()?.rails.first()?;
            if ra.provider != rail0.caps().prov_name {
                return None;
            }
            match rail0.av_insert(&ra.addr) {
                Ok(a) => ini.addr = Some(a),
                Err(e) => {
                    log::error!("{owner}: cannot reach agent '{}': {e}", ini.name);
                    return None;
                }
            }
        }
        ini.addr
    }

    /// Our address on `rail` of an initiator's rail `rrail` (inserted on first use); rail 0
    /// to its rail 0 is its control address.
    pub fn initiator_rail_addr(&mut self, engine_id: u64, rail: &dyn Port, rrail: usize, owner: &str) -> Option<FiAddr> {
        if rail.index() == 0 && rrail == 0 {
            return self.initiator_addr(engine_id, rail, owner);
        }
        let ini = self.initiators.get_mut(&engine_id)?;
        let key = (rail.index() as u16, rrail as u16);
        if let Some(&(_, _, a)) = ini.rail_addrs.iter().find(|x| (x.0, x.1) == key) {
            return Some(a);
        }
        let ra = ini.info.as_ref()?.rails.get(rrail)?;
        if ra.provider != rail.caps().prov_name {
            return None;
        }
        match rail.av_insert(&ra.addr) {
            Ok(a) => {
                ini.rail_addrs.push((key.0, key.1, a));
                Some(a)
            }
            Err(e) => {
                log::error!("{owner}: cannot reach rail {rrail} of agent '{}': {e}", ini.name);
                None
            }
        }
    }

    /// False once an initiator on this host is known to have exited.
    pub fn initiator_alive(&self, engine_id: u64) -> bool {
        self.initiators.get(&engine_id).is_some_and(|i| !i.pidfd.as_ref().is_some_and(|f| f.exited()))
    }

    /// Inserts a peer's rail addresses into our AVs (only the pairs its route uses, plus
    /// rail 0 <-> rail 0 for control messages: a remote host's shm address must never reach
    /// our shm AV). Returns our HELLO to send it, None if it was connected already.
    pub fn connect(&mut self, peer: &Arc<Peer>, rails: &[Arc<dyn Port>], core: &Core) -> Result<Option<CtrlOut>> {
        if peer.is_disconnected() {
            return Err(Error::Disconnected(format!("agent '{}' was disconnected", peer.name)));
        }
        if self.peers.contains_key(&peer.id) {
            return Ok(None);
        }
        let mut addrs = vec![vec![None; peer.info.rails.len()]; rails.len()];
        let wanted = peer.route.iter().map(|p| (p.rail as usize, p.rrail as usize)).chain(std::iter::once((0, 0)));
        for (l, r) in wanted {
            let (Some(rail), Some(ra)) = (rails.get(l), peer.info.rails.get(r)) else { continue };
            if addrs[l][r].is_none() && ra.provider == rail.caps().prov_name {
                addrs[l][r] = Some(rail.av_insert(&ra.addr)?);
            }
        }
        let Some(dest) = addrs[0][0] else {
            return Err(Error::NotSupported(format!(
                "agent '{}' uses provider {} on its first rail, we use {}",
                peer.name, peer.info.rails[0].provider, rails.first().map_or("none", |r| r.caps().prov_name.as_str())
            )));
        };
        log::info!("{}: connected to agent '{}' ({} local x {} remote rails)", core.name, peer.name, rails.len(), peer.info.rails.len());
        let sync_rails = if peer.cma {
            rails.iter().enumerate().filter(|(_, r)| r.caps().sync_rma).fold(0u64, |m, (i, _)| m | 1 << i)
        } else {
            0
        };
        self.peers.insert(peer.id, Conn { peer: peer.clone(), addrs, sync_rails, last_completion: Instant::now(), last_kick: None });
        let bytes = wire::encode_ctrl(CtrlType::Hello, core.engine_id, &core.name, &core.conn_info);
        Ok(Some(CtrlOut { peer_id: peer.id, dest, bytes, req: None }))
    }

    /// A KICK for `peer_id`, unless one went out within `interval`.
    pub fn kick(&mut self, peer_id: u64, interval: Duration, core: &Core) -> Option<CtrlOut> {
        let now = Instant::now();
        let c = self.peers.get_mut(&peer_id)?;
        if c.last_kick.is_some_and(|t| now.duration_since(t) < interval) {
            return None;
        }
        c.last_kick = Some(now);
        let dest = c.addrs[0][0]?;
        Some(CtrlOut { peer_id, dest, bytes: wire::encode_ctrl(CtrlType::Kick, core.engine_id, &core.name, &[]), req: None })
    }

    /// Whether engine `engine_id` introduced itself (its HELLO came).
    pub fn introduced(&self, engine_id: u64) -> bool {
        self.initiators.contains_key(&engine_id)
    }

    /// An engine introduced itself (HELLO): remembered, with a pidfd on its process when it
    /// shares our host (`host`).
    pub fn introduce(&mut self, msg: &Ctrl<'_>, host: [u8; 16], owner: &str) {
        if self.initiators.contains_key(&msg.sender_id) {
            return;
        }
        log::info!("{owner}: agent '{}' introduced itself (engine {:016x})", msg.sender, msg.sender_id);
        let info = match ConnInfo::decode(msg.payload) {
            Ok(i) if i.engine_id == msg.sender_id => Some(i),
            Ok(_) => None,
            Err(e) => {
                log::warn!("{owner}: HELLO from '{}' carries bad connection info: {e}", msg.sender);
                None
            }
        };
        let pidfd = info.as_ref()
            .filter(|i| i.host_id == host && i.host_id != [0; 16])
            .and_then(|i| i.process.as_ref())
            .filter(|p| p.pid != std::process::id())
            .and_then(|p| PidFd::open(p.pid));
        self.initiators.insert(msg.sender_id, Initiator { name: msg.sender.to_string(), info, addr: None, rail_addrs: Vec::new(), pidfd });
    }

    /// Same-host peers (`asked` of them) that are gone: their process exited, or CMA no
    /// longer reaches it (its token cannot be read).
    pub fn dead_same_host(&self, asked: impl Fn(u64) -> bool) -> Vec<(u64, String)> {
        self.peers
            .iter()
            .filter(|(id, c)| (c.peer.cma || c.peer.local.watched()) && asked(**id))
            .filter(|(_, c)| !c.peer.local.alive() || c.peer.cma && !c.peer.info.process.as_ref().is_some_and(super::cma::reachable))
            .map(|(id, c)| (*id, c.peer.name.clone()))
            .collect()
    }

    /// Whether an initiator's RMA reaches us over the network rails: not when it is on this
    /// host (`host`) and same-host peers go around them (shm rail, CMA, IPC). Unknown: so.
    pub fn data_over_network_rails(&self, initiator: u64, host: [u8; 16], same_host_paths: bool) -> bool {
        let Some(info) = self.initiators.get(&initiator).and_then(|i| i.info.as_ref()) else { return true };
        !(same_host_paths && info.host_id != [0; 16] && info.host_id == host)
    }
}
