//! The engine as its callers see it: an agent's rails, registrations, peers and requests.
//! Everything that touches the rails runs in the driver, owned by the progress thread or,
//! with the thread off, by the caller that locks it; callers hand it work through the inbox.
use super::core::Core;
use super::counters::{self, CounterSnapshot, RailCounterSnapshot};
use super::driver::{Driver, PassKind};
use super::ids::{host_id, random_u64};
use super::inbox::{Inbox, Submit};
use super::ipc_cache::IpcEntry;
use super::peer::{Peer, RoutePair};
use super::port::Port;
use super::registry::{CloseQueue, LocalMem, MemKind, SharedCloseQueue};
use super::remote::RemoteMem;
use super::request::{Op, Phase, Request, Target};
use super::scheduler::{self, Pair, RailShape, Reach};
use super::transport::{self, Transport};
use super::wire::{self, ConnInfo, MemDesc, RailAddr};
use super::{cma, gpu, gpu_reg, ipc_export, local_peers, progress, rail_threads};
use crate::config::Config;
use crate::cuda;
use crate::error::{Error, Result, Status};
use crate::fabric::{self, Rail};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub struct Engine {
    core: Arc<Core>,
    driver: Arc<Mutex<Driver>>,
    inbox: Arc<Inbox<Driver>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    rail_threads: Mutex<rail_threads::RailThreads>,
    stop: Arc<AtomicBool>,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    shapes: Vec<RailShape>,
    next_peer_id: AtomicU64,
    rr: AtomicUsize,
    rr_chunks: AtomicUsize,
    /// Most threads that plan one long request (config plan_threads, resolved).
    plan_threads: usize,
    threaded: bool,
    shut: AtomicBool,
    /// Read by same-host peers through CMA; published in our connection info.
    _token: cma::Token,
}

/// One line about the CUDA driver, for diagnostics.
pub fn cuda_summary() -> String {
    match crate::cuda::Driver::get() {
        Ok(d) => format!("driver API {} from {}, {} device(s)", d.version(), d.path(), d.device_count().unwrap_or(0)),
        Err(e) => format!("not available ({e})"),
    }
}

/// Requests of at most this many segments and bytes start on the caller's thread
/// (Engine::post); shm's fast RMA copies inside that pass, so the bytes bound its time.
const INLINE_POST_SEGS: usize = 4;
const INLINE_POST_BYTES: u64 = 256 << 10;

/// rails=0 with tcp or sockets and no interface list: several connections over the one
/// interface, by core count. Each rail after the first has a thread (posting and progress)
/// in each of the two processes of a same-host pair, so the count stays at a third to a
/// half of the cores. On the 16-core H200 host, with rail threads posting their own writes, 64 MiB
/// over tcp moved 2.9 GB/s on one rail, 4.4 on two, 10.0 on four and 14.8 on eight (raw TCP
/// streams: 2.4 / 4.6 / 9.3 / 17.8; docs/MEASUREMENTS.md, DRAM on the host users run on), and four rails beat two at every KV
/// batch; eight rails cost single small transfers ~1.5x in latency (16 spinning threads on
/// 16 cores). Six on 16 cores: rail 0 carries the control messages and small requests, and
/// bulk data keeps off it (configs staging_rail0, rma_rail0), leaving five rails with threads
/// of their own for GPU chunks and host memory alike (H100 host, 2026-12-07, alternating
/// runs against five rails with host memory on all five: every VRAM pattern 1.04-1.23x,
/// host KV WRITEs 1.6x, 64 MiB 1.15x; README, GPU section). Four on 8-15 cores: with every
/// process of a run on eight cores of the H100 host (2026-12-07, alternating runs), four
/// rails (three for bulk data) moved host memory 1.1-1.9x (64 MiB: 1.5 / 1.7x READ / WRITE)
/// and every staged GPU pattern 1.2-1.5x faster than two, and a single 4 KiB WRITE until
/// notified took the same time (19.0 / 20.1 us against 20.2 / 20.9, progress threads off /
/// on); three rails with bulk data off rail 0 carry it on two, no faster than two rails
/// (bench/results/rails8core-2026-12-07u-h100/).
/// On a 2-core host a second connection only competes for the cores.
const AUTO_SOCKET_RAILS: [(usize, usize); 2] = [(16, 6), (8, 4)];

/// The rail count rails=0 gives tcp/sockets on a host with `cores` cores (None: another
/// provider, which has its own rule).
fn auto_socket_rails(prov: &str, cores: usize) -> Option<usize> {
    if !(prov.starts_with("tcp") || prov.starts_with("sockets")) {
        return None;
    }
    Some(AUTO_SOCKET_RAILS.iter().find(|(min, _)| cores >= *min).map_or(1, |(_, n)| *n))
}

/// How many network rails to open, and over how many of the `domains` matching ones they
/// cycle (rail i on domain i % the second). An interface list means a rail on each (and the
/// automatic connection count over them); without one, tcp/sockets stay on the first
/// interface with their automatic count of connections there: other interfaces are often
/// unrelated networks, or a container bridge whose address every host has, and a rail pair
/// between two of those would connect nowhere or to the wrong process. Other providers open
/// one rail per domain (NICs), single-rail ones (shm, udp) one. An explicit count cycles
/// over every domain.
fn rail_layout(rails: u64, listed: usize, auto: Option<usize>, single: bool, domains: usize) -> (usize, usize) {
    let domains = domains.max(1);
    match (rails, auto) {
        (0, Some(n)) if listed > 0 => (n.max(domains), domains),
        (0, Some(n)) => (n.max(1), 1),
        (0, _) if listed > 0 => (domains, domains),
        (0, None) if single => (1, 1),
        (0, None) => (domains, domains),
        (n, _) => (n as usize, domains),
    }
}

/// Whether network rail `i` of `count` shares its interface with another of them: rails
/// cycle over the `domains` matching interfaces (rail i on i % domains), and a rail past
/// `count` is the shm rail, which has its own.
fn nic_shared(i: usize, count: usize, domains: usize) -> bool {
    let d = domains.max(1);
    i < count && (0..count).any(|j| j != i && j % d == i % d)
}

fn is_single_rail_provider(p: &str) -> bool {
    ["tcp", "sockets", "shm", "udp"].iter().any(|x| p.starts_with(x))
}

impl Engine {
    pub fn new(name: &str, cfg: Config) -> Result<Arc<Engine>> {
        cfg.validate()?;
        if name.is_empty() || name.len() > wire::MAX_NAME_LEN {
            return Err(Error::InvalidParam(format!("agent name must be 1..={} bytes", wire::MAX_NAME_LEN)));
        }
        // Ask for FI_HMEM only where a CUDA driver exists (it is what lets VRAM go zero-copy).
        let specs = fabric::discover(&cfg, crate::cuda::available())?;
        let listed = cfg.iface.split(',').filter(|s| !s.trim().is_empty()).count();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let auto = auto_socket_rails(&specs[0].prov_name, cores);
        let (count, domains) = rail_layout(cfg.rails, listed, auto, is_single_rail_provider(&specs[0].prov_name), specs.len());
        if domains < specs.len() {
            log::info!("{name}: {count} rail(s) on {} only; set iface to spread them over {}", specs[0].domain_name,
                       specs.iter().map(|s| s.domain_name.as_str()).collect::<Vec<_>>().join(","));
        }
        let mut rails: Vec<Rail> = Vec::with_capacity(count + 1);
        for i in 0..count {
            rails.push(Rail::open(name, &specs[i % domains], i, cfg.progress_thread)?);
        }
        // A shm rail beside the network rails, for peers on this host.
        if cfg.same_host_shm && !specs[0].prov_name.starts_with("shm") {
            let mut shm_cfg = cfg.clone();
            shm_cfg.provider = "shm".into();
            shm_cfg.iface = String::new();
            match fabric::discover(&shm_cfg, crate::cuda::available()).and_then(|s| Rail::open(name, &s[0], count, cfg.progress_thread)) {
                Ok(r) => rails.push(r),
                Err(e) => log::info!("{name}: no shm rail for same-host peers ({e}); they use the network rails"),
            }
        }
        let engine_id = random_u64();
        let token = cma::Token::new([random_u64(), random_u64()]);
        let host = host_id();
        let view = local_peers::ProcessView::publish(engine_id, token.info().token);
        let conn = ConnInfo {
            engine_id,
            host_id: host,
            agent: name.to_string(),
            rails: rails.iter().map(|r| RailAddr { provider: r.caps.prov_name.clone(), addr: r.name.clone() }).collect(),
            process: Some(token.info()),
            rail0_saw: rails[0].caps.order_saw,
            packed_staging: true,
            eager_write: true, lends: true,
        };
        let shapes = rails.iter().enumerate().map(|(i, r)| RailShape {
            max_msg: r.caps.max_msg_size.max(4096),
            virt_addr: r.caps.virt_addr,
            provider: r.caps.prov_name.clone(),
            order_saw: r.caps.order_saw,
            nic_shared: nic_shared(i, count, domains),
            hmem_host_bounce: r.caps.hmem_host_bounce,
        }).collect();
        let closeq = SharedCloseQueue::default();
        let threaded = cfg.progress_thread;
        let core = Arc::new(Core::new(name, engine_id, host, cfg, conn.encode(), rails.len(), closeq, view));
        let rails: Vec<Arc<Rail>> = rails.into_iter().map(Arc::new).collect();
        // Rail threads: tcp/sockets rails after the first, with the progress thread on.
        let threaded_rails: Vec<Arc<Rail>> = if threaded && core.cfg.rail_threads && auto_socket_rails(&specs[0].prov_name, 1).is_some() {
            rails.iter().take(count).skip(1).cloned().collect()
        } else {
            Vec::new()
        };
        let inbox: Arc<Inbox<Driver>> = Arc::default();
        let ports: Vec<Arc<dyn Port>> = rails.iter().map(|r| r.clone() as Arc<dyn Port>).collect();
        let cma_threads = transport::cma::thread_count(core.cfg.cma_threads);
        let cma_spin = Duration::from_micros(core.cfg.cma_spin_us);
        let cma_min_piece = core.cfg.cma_min_piece;
        let rma_batch = core.cfg.rma_batch;
        let plan_threads = scheduler::plan_threads(core.cfg.plan_threads, cores);
        let driver = Driver::new(core.clone(), inbox.clone(), ports, |rails| {
            Ok(vec![
                Box::new(transport::rma::Rma::new(0, rails, rma_batch)?) as Box<dyn Transport>,
                Box::new(transport::staging::Staging::new(1, name)),
                Box::new(transport::direct::Direct::default()),
                Box::new(transport::cma::Cma::new(name, cma_threads).with_spin(cma_spin).with_min_piece(cma_min_piece)),
                Box::new(transport::loopback::Loopback),
                Box::new(transport::eager::Eager::default()),
            ])
        })?;
        let driver = Arc::new(Mutex::new(driver));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = if threaded {
            Some(progress::spawn(core.clone(), driver.clone(), inbox.clone(), stop.clone()).map_err(|e| Error::Backend(format!("spawning the progress thread: {e}")))?)
        } else {
            None
        };
        let rail_threads = rail_threads::RailThreads::start(&core, &threaded_rails);
        for (i, r) in rails.iter().enumerate() {
            // (With notif_behind_data off every rail behaves as one with a thread.)
            let threaded = threaded_rails.iter().any(|t| t.index == i) || !core.cfg.notif_behind_data;
            log::info!("{name}: rail {i}: {}", transport::rma::delivery_mode(&r.caps, i, threaded));
        }
        drop(threaded_rails);
        log::info!(
            "{name}: engine {engine_id:016x} up with {count} rail(s) on {} (libfabric {}); progress thread {}",
            specs[0].prov_name,
            crate::fabric::library_version(),
            if threaded { "on" } else { "off" }
        );
        Ok(Arc::new(Engine {
            core,
            driver,
            inbox,
            thread: Mutex::new(thread),
            rail_threads: Mutex::new(rail_threads),
            stop,
            peers: Mutex::new(HashMap::new()),
            shapes,
            next_peer_id: AtomicU64::new(1),
            rr: AtomicUsize::new(0),
            rr_chunks: AtomicUsize::new(0),
            plan_threads,
            threaded,
            shut: AtomicBool::new(false),
            _token: token,
        }))
    }

    fn submit(&self, s: Submit<Driver>) {
        self.inbox.push(s);
        self.core.wake();
    }

    pub fn name(&self) -> &str {
        &self.core.name
    }

    pub fn conn_info(&self) -> &[u8] {
        &self.core.conn_info
    }

    pub fn rail_count(&self) -> usize {
        self.shapes.len()
    }

    pub fn supported_mems(&self) -> u32 {
        let vram = if crate::cuda::available() { 1 << MemKind::Vram as u32 } else { 0 };
        1 << MemKind::Dram as u32 | vram
    }

    pub fn counters(&self) -> CounterSnapshot {
        self.core.counters.snapshot()
    }

    pub fn rail_counters(&self, rail: usize) -> Result<RailCounterSnapshot> {
        self.core.rail_counters.get(rail).map(|c| c.snapshot()).ok_or_else(|| Error::NotFound(format!("rail {rail}")))
    }

    fn lock_driver(&self) -> std::sync::MutexGuard<'_, Driver> {
        self.driver.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` where the rails are owned: on the progress thread (waiting at most the
    /// configured timeout), or here under the driver lock when there is no thread.
    fn on_driver<R: Send + 'static>(&self, what: &str, f: impl FnOnce(&mut Driver) -> R + Send + 'static) -> Result<R> {
        if self.shut.load(Ordering::Acquire) {
            return Err(Error::NotAllowed("engine is shut down".into()));
        }
        if !self.threaded {
            return Ok(f(&mut self.lock_driver()));
        }
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(Submit::Task(Box::new(move |d| {
            let _ = tx.send(f(d));
        })));
        rx.recv_timeout(self.core.cfg.timeout())
            .map_err(|_| Error::Timeout(format!("{what}: the progress thread did not answer")))
    }

    /// Runs one pass here when there is no progress thread; wakes the thread otherwise.
    pub fn progress(&self) {
        if self.threaded {
            self.core.wake();
        } else if !self.shut.load(Ordering::Acquire) {
            self.lock_driver().pass();
        }
    }

    pub fn register(&self, addr: u64, len: u64, kind: MemKind, dev_id: u64) -> Result<Arc<LocalMem>> {
        if addr == 0 || len == 0 {
            return Err(Error::InvalidParam(format!("cannot register address {addr:#x} with length {len}")));
        }
        if addr.checked_add(len).is_none() {
            return Err(Error::InvalidParam("registration wraps the address space".into()));
        }
        let info = gpu::classify(addr, len, kind == MemKind::Vram)?;
        // VMM memory belongs to no context: it is used under its device's primary context.
        let primary = match info {
            Some(i) if i.context.is_none() => Some(crate::cuda::Context::primary(i.device_ordinal.unwrap_or(0))?),
            _ => None,
        };
        let policy = self.core.cfg.vram_policy()?;
        let dev = match info {
            Some(i) => Some(gpu::DeviceMem {
                ctx: i.context.or(primary.as_ref().map(|p| p.context()))
                    .ok_or_else(|| Error::Backend("device memory without a context".into()))?,
                ordinal: i.device_ordinal.unwrap_or(0),
                // Decided by the registration below.
                staged: true,
                managed: i.is_managed,
            }),
            None => None,
        };
        let mut vram = None;
        let (mrs, dev) = match dev {
            // SAFETY (both): NIXL keeps registered memory allocated until it is
            // deregistered, which drops the LocalMem and with it these registrations.
            None => (self.on_driver("registering memory", move |d| unsafe { d.register(addr, len, None) })??, None),
            Some(dm) => {
                let core = self.core.clone();
                let r = self.on_driver("registering device memory", move |d| -> Result<(gpu_reg::Registered, gpu::DeviceMem)> {
                    let export = || crate::cuda::Driver::get()?.dmabuf(&dm.ctx, dm.ordinal, addr, len);
                    let apply = || core.apply_ctx(&dm.ctx);
                    // SAFETY: as above.
                    let r = unsafe { d.register_vram(addr, len, &dm, policy, &export, &apply) }?;
                    let dm = gpu::DeviceMem { staged: r.kind == gpu_reg::VramReg::Staged, ..dm };
                    d.prepare(&dm)?;
                    Ok((r, dm))
                })??;
                gpu_reg::log_kind(&self.core.name, &self.core.gpu, &r.0);
                vram = Some((r.1, r.0.kind));
                (r.0.mrs, Some(r.1))
            }
        };
        log::debug!("{}: registered {kind:?} [{addr:#x}, +{len}){}", self.core.name,
            vram.map_or(String::new(), |(d, k)| format!(" on GPU {} ({})", d.ordinal, k.name())));
        let mut m = LocalMem::new(self.core.engine_id, addr, len, kind, dev_id, self.shapes.len(), mrs,
            self.core.closeq.clone(), dev, Some(self.core.gpu.clone()));
        m.primary = primary;
        if let (Some(i), Some(d)) = (info, dev) {
            if let Some((ipc, reg)) = ipc_export::export(&self.core, &i, &d, addr, len) {
                m.ipc = Some(ipc);
                m.vmm_export = reg.map(|r| (self.core.fds.clone(), r));
            }
        }
        let m = Arc::new(m);
        if let Some(d) = dev {
            self.core.gpu.add(&m, d.ctx);
        }
        self.core.view.add(&m);
        Ok(m)
    }

    pub fn public_data(&self, mem: &LocalMem) -> Result<Vec<u8>> {
        if mem.engine_id != self.core.engine_id {
            return Err(Error::InvalidParam("registration belongs to another engine".into()));
        }
        Ok(mem.public(self.shapes[0].virt_addr).encode())
    }

    pub fn load_conn_info(&self, name: &str, blob: &[u8]) -> Result<()> {
        if name == self.core.name {
            if blob == self.conn_info() {
                return Ok(());
            }
            return Err(Error::InvalidParam(format!("connection info for our own name '{name}' is not ours")));
        }
        let info = ConnInfo::decode(blob)?;
        let our0 = self.shapes[0].provider.clone();
        if info.rails[0].provider != our0 {
            return Err(Error::NotSupported(format!(
                "agent '{name}' uses provider {}, this engine uses {our0}", info.rails[0].provider
            )));
        }
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = peers.get(name) {
            if old.raw == blob {
                return Ok(());
            }
            log::info!("{}: agent '{name}' has new connection info (restarted); replacing", self.core.name);
            old.mark_disconnected();
            let id = old.id;
            self.submit(Submit::Task(Box::new(move |d| d.disconnect(id))));
        }
        let id = self.next_peer_id.fetch_add(1, Ordering::Relaxed);
        let (route, same_host) = self.route_to(&info);
        // Only a peer on this host can be reached by CMA; the probe is one system call.
        let cma = same_host && info.process.as_ref().is_some_and(cma::reachable);
        log::info!("{}: agent '{name}' {} via rail pairs {:?}{}", self.core.name,
            if same_host { "is on this host" } else { "is remote" }, route.iter().map(|p| (p.rail, p.rrail)).collect::<Vec<_>>(),
            if same_host { if cma { ", its memory reachable by CMA" } else { ", its memory not reachable by CMA" } } else { "" });
        let local = local_peers::Locality::of(&info, same_host);
        if matches!(local, local_peers::Locality::SameProcess(_)) {
            log::info!("{}: agent '{name}' is an engine of this process: its memory is copied directly", self.core.name);
        }
        peers.insert(name.to_string(), Arc::new(Peer::new(id, name, info, blob.to_vec(), route, same_host, cma, local)));
        Ok(())
    }

    /// Which rail pairs carry data to a peer: the shm pair when both sides have one and
    /// share a host; otherwise every network rail of ours against every one of theirs
    /// (max(L, R) pairs, so neither side leaves a NIC idle).
    fn route_to(&self, info: &ConnInfo) -> (Vec<RoutePair>, bool) {
        let ours = self.own_info();
        let same_host = info.host_id == ours.host_id && info.host_id != [0u8; 16];
        let shm = |rails: &[RailAddr]| rails.iter().position(|r| r.provider == "shm");
        let net_prov = &self.shapes[0].provider;
        if same_host && net_prov != "shm" {
            if let (Some(l), Some(r)) = (self.shapes.iter().position(|s| s.provider == "shm"), shm(&info.rails)) {
                return (vec![RoutePair { rail: l as u16, rrail: r as u16, virt: Some(self.shapes[l].virt_addr) }], true);
            }
        }
        let local: Vec<usize> = (0..self.shapes.len()).filter(|&i| self.shapes[i].provider == *net_prov).collect();
        let remote: Vec<usize> = (0..info.rails.len()).filter(|&i| info.rails[i].provider == *net_prov).collect();
        let n = local.len().max(remote.len());
        let route = (0..n)
            .map(|j| RoutePair { rail: local[j % local.len()] as u16, rrail: remote[j % remote.len().max(1)] as u16, virt: None })
            .collect();
        (route, same_host)
    }

    fn own_info(&self) -> ConnInfo {
        // Our own blob always decodes (we encoded it).
        ConnInfo::decode(&self.core.conn_info).unwrap_or(ConnInfo { engine_id: 0, host_id: [0; 16], agent: String::new(), rails: Vec::new(), process: None, rail0_saw: false, packed_staging: true, eager_write: true, lends: true })
    }

    fn peer(&self, name: &str) -> Result<Arc<Peer>> {
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("unknown agent '{name}' (load its connection info first)")))
    }

    pub fn connect(&self, name: &str) -> Result<()> {
        if name == self.core.name {
            return Ok(());
        }
        let p = self.peer(name)?;
        self.submit(Submit::Task(Box::new(move |d| {
            if let Err(e) = d.ensure_conn(&p) {
                log::error!("connecting to agent '{}': {e}", p.name);
            }
        })));
        Ok(())
    }

    pub fn disconnect(&self, name: &str) -> Result<()> {
        if name == self.core.name {
            return Ok(());
        }
        let p = self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name)
            .ok_or_else(|| Error::NotFound(format!("unknown agent '{name}'")))?;
        p.mark_disconnected();
        let id = p.id;
        self.submit(Submit::Task(Box::new(move |d| d.disconnect(id))));
        self.progress();
        Ok(())
    }

    pub fn load_remote(&self, name: &str, blob: &[u8]) -> Result<Arc<RemoteMem>> {
        let peer = self.peer(name)?;
        let desc = MemDesc::decode(blob)?;
        if desc.engine_id != peer.info.engine_id {
            return Err(Error::InvalidParam(format!(
                "memory descriptor is from engine {:016x}, but agent '{name}' is engine {:016x}",
                desc.engine_id, peer.info.engine_id
            )));
        }
        if desc.keys.len() != peer.info.rails.len() {
            return Err(Error::InvalidParam(format!(
                "memory descriptor has {} rail keys, agent '{name}' has {} rails", desc.keys.len(), peer.info.rails.len()
            )));
        }
        let opened = Mutex::new(self.open_ahead(&peer, &desc));
        Ok(Arc::new(RemoteMem::Peer { peer, desc, opened }))
    }

    /// A same-host peer's GPU allocation is opened by IPC when its descriptor is loaded, under
    /// each context our own device memory was registered in, so that the first request with
    /// it does not pay for the opens (a few ms each; a KV cache is tens of registrations).
    /// Memory of ours registered later, or host memory, opens at the first request instead.
    fn open_ahead(&self, peer: &Peer, desc: &MemDesc) -> Vec<Arc<IpcEntry>> {
        let cfg = &self.core.cfg;
        let (Some(ipc), true) = (desc.ipc.as_ref(), cfg.gpu_ipc && cfg.same_host_shm) else { return Vec::new() };
        if !matches!(peer.local, local_peers::Locality::SameHost(_)) {
            return Vec::new();
        }
        let mut opened: Vec<Arc<IpcEntry>> = Vec::new();
        for ctx in self.core.gpu.registered_contexts() {
            if let Some(e) = self.core.ipc.open(peer.info.engine_id, &peer.name, ipc, Some(ctx)) {
                if !opened.iter().any(|x| Arc::ptr_eq(x, &e)) {
                    opened.push(e);
                }
            }
        }
        opened
    }

    pub fn self_target(&self, mem: &Arc<LocalMem>) -> Result<Arc<RemoteMem>> {
        if mem.engine_id != self.core.engine_id {
            return Err(Error::InvalidParam("registration belongs to another engine".into()));
        }
        Ok(Arc::new(RemoteMem::Local(mem.clone())))
    }

    /// Checks every pair and cuts it into segments (scheduler/), once; posts reuse them.
    pub fn prepare(&self, op: Op, pairs: &[Pair], peer_name: &str) -> Result<Arc<Request>> {
        self.prepare_from(op, pairs, peer_name)
    }

    /// `prepare` over pairs read as they are needed (the C ABI's descriptor lists).
    pub fn prepare_from<'a, S: scheduler::PairSource<'a> + ?Sized>(&self, op: Op, pairs: &S, peer_name: &str) -> Result<Arc<Request>> {
        // Where a create's time goes, on a host without a profiler (issue #23): one DEBUG
        // line per request, the clocks read only when that line is wanted.
        let t0 = log::log_enabled!(log::Level::Debug).then(Instant::now);
        let target = if peer_name == self.core.name { Target::Local } else { Target::Peer(self.peer(peer_name)?) };
        if let Target::Peer(p) = &target {
            if p.is_disconnected() {
                return Err(Error::Disconnected(format!("agent '{peer_name}' was disconnected")));
            }
        }
        let inputs = scheduler::Inputs {
            engine_id: self.core.engine_id,
            op,
            cfg: &self.core.cfg,
            shapes: &self.shapes,
            rr_base: self.rr.fetch_add(1, Ordering::Relaxed),
            rr_chunks: &self.rr_chunks,
            timed: t0.is_some(),
            plan_threads: self.plan_threads,
            staged_chunk: 0,
        };
        let t1 = t0.map(|_| Instant::now());
        let count = pairs.count();
        let plan = scheduler::plan(&inputs, &target, pairs, &Reached(&self.core))?;
        let t2 = t0.map(|_| Instant::now());
        let (ways, resolve_ns, nsegs, parts) = (plan.ways, plan.resolve_ns, plan.segs.len(), plan.parts);
        let req = Arc::new(Request::summed(op, target, plan.segs, plan.sum, plan.locals, plan.remotes, plan.keeps));
        if let (Some(t0), Some(t1), Some(t2)) = (t0, t1, t2) {
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            log::debug!("{}: created a request of {count} descriptors ({nsegs} segments) in {:.1} us: peer {:.1}, plan {:.1} \
                         (by {parts} thread(s); {ways} registration pairs decided in {:.1}), request {:.1}",
                        self.core.name, us(t0.elapsed()), us(t1 - t0), us(t2 - t1), resolve_ns as f64 / 1e3, us(t2.elapsed()));
        }
        Ok(req)
    }

    /// Posts a request without waiting for it. Returns IN_PROG, or SUCCESS/an error when
    /// it finished during the call (loopback, or inline progress with the thread off).
    pub fn post(&self, req: &Arc<Request>, notif: Option<Vec<u8>>) -> Result<Status> {
        if self.shut.load(Ordering::Acquire) {
            return Err(Error::NotAllowed("engine is shut down".into()));
        }
        if let Some(m) = &notif {
            if m.len() as u64 > self.core.cfg.max_notif_size {
                return Err(Error::InvalidParam(format!(
                    "notification of {} bytes exceeds max_notif_size {}", m.len(), self.core.cfg.max_notif_size
                )));
            }
        }
        if let Some(p) = req.peer() {
            if p.is_disconnected() {
                return Err(Error::Disconnected(format!("agent '{}' was disconnected", p.name)));
            }
        }
        let local = req.local_copies && notif.is_none();
        {
            let mut st = req.state();
            // (Copies of an earlier post that failed or timed out may still be writing the
            // same memory: a repost waits for them too.)
            if req.status() == Status::NF_IN_PROG || matches!(st.phase, Phase::Data | Phase::Notif) || st.marks.local_copies > 0 {
                return Ok(Status::NF_ERR_REPOST_ACTIVE);
            }
            st.epoch += 1;
            st.next = 0;
            st.outstanding = 0;
            st.notif = notif;
            st.error = None;
            st.cancelled = false;
            st.marks.unflushed = 0;
            st.marks.notif_ahead = false;
            st.marks.lost_sends = 0;
            st.flushing = false;
            st.phase = Phase::Data;
            req.set_status(Status::NF_IN_PROG);
            req.set_local_post(local);
        }
        counters::add(&self.core.counters.requests_posted, 1);
        let small = req.segs.len() <= INLINE_POST_SEGS && req.bytes <= INLINE_POST_BYTES;
        if !self.threaded {
            self.lock_driver().post_now(req.clone(), PassKind::posting(local));
            return Ok(req.status());
        }
        self.inbox.push(Submit::Post(req.clone()));
        if local && small && self.caller_pass(PassKind::Local) {
            // Copies this process makes, started (and as a rule finished) by the caller's
            // own pass: the progress thread has nothing to do for them, so a sleeping one is
            // left asleep. Waking it cost an eventfd write and a thread that then contends
            // for the driver (4 KiB WRITE between two processes, progress on, CPU VM).
        } else {
            self.core.wake();
            if small {
                // A small request starts on the caller's thread when the rails are free (as
                // in check()): its latency then does not wait for the progress thread's
                // turn. Large ones are left to the thread, so that posting stays cheap.
                self.caller_pass(PassKind::posting(local));
            }
        }
        Ok(req.status())
    }

    /// One progress pass of `kind` on the caller's thread, if allowed (config
    /// caller_progress; no CUDA contexts registered) and no other thread holds the rails.
    /// Returns whether it ran.
    fn caller_pass(&self, kind: PassKind) -> bool {
        // A pass makes the captured CUDA context current on the thread that runs it, and
        // the caller's thread is not ours to change.
        if !self.core.cfg.caller_progress || self.core.gpu.has_contexts() {
            return false;
        }
        let Ok(mut d) = self.driver.try_lock() else { return false };
        d.pass_of(kind);
        drop(d);
        // Only a full pass is a caller carrying the engine: after the others the progress
        // thread keeps reading the rails.
        if kind == PassKind::Full {
            self.core.note_caller_pass();
        }
        true
    }

    pub fn check(&self, req: &Request) -> Status {
        let s = req.status();
        if s != Status::NF_IN_PROG || self.shut.load(Ordering::Acquire) {
            return s;
        }
        let local = req.local_post();
        if !self.threaded {
            self.lock_driver().pass_of(PassKind::polling(local));
            return req.status();
        }
        // A caller polling for its request would otherwise wait for the progress thread to
        // be scheduled; where callers spin on the cores (2 here), that is a scheduler tick
        // (4 ms) per completion. So the poller makes the pass itself when the rails are
        // free (measured, 4-64 KiB WRITE between two processes: shm 7-8 -> 2.5-3.5 us, tcp
        // 35-43 -> 21-29 us).
        if self.caller_pass(PassKind::polling(local)) {
            return req.status();
        }
        s
    }

    /// Cancels a running request and waits (bounded) until the provider owns none of its
    /// operations. Returns whether it drained; the request is safe to drop either way.
    pub fn release(&self, req: &Arc<Request>) -> bool {
        {
            let mut st = req.state();
            if matches!(st.phase, Phase::Data | Phase::Notif) {
                st.cancelled = true;
            }
        }
        let deadline = Instant::now() + self.core.cfg.timeout();
        // Once finished, the driver drops its own reference within the pass that finished
        // it: wait for that briefly (another holder, e.g. a caller's clone, ends the wait at
        // LINGER), so the registrations the request kept alive go with this release.
        const LINGER: Duration = Duration::from_millis(20);
        let mut done_at: Option<Instant> = None;
        loop {
            {
                let st = req.state();
                let finished = !matches!(st.phase, Phase::Data | Phase::Notif);
                if finished && st.inflight_total == 0 {
                    let since = *done_at.get_or_insert_with(Instant::now);
                    if Arc::strong_count(req) <= 1 || since.elapsed() >= LINGER || self.shut.load(Ordering::Acquire) {
                        return true;
                    }
                }
                // A dead or forgotten peer will never complete what the provider still
                // holds, and can no longer write into our memory: nothing to wait for.
                let peer_gone = req.peer().is_some_and(|p| p.is_disconnected())
                    || req.status() == Status::NF_ERR_REMOTE_DISCONNECT;
                if finished && peer_gone && st.marks.local_copies == 0 {
                    return true;
                }
            }
            if Instant::now() > deadline || self.shut.load(Ordering::Acquire) {
                log::warn!("{}: releasing a request whose operations did not drain within the timeout", self.core.name);
                return false;
            }
            if self.threaded {
                self.core.wake();
                std::thread::sleep(Duration::from_micros(50));
            } else {
                self.lock_driver().pass();
            }
        }
    }

    pub fn take_notifs(&self) -> Vec<(String, Vec<u8>)> {
        if self.shut.load(Ordering::Acquire) {
            return self.core.take_notifs();
        }
        if !self.threaded {
            self.lock_driver().pass();
        } else {
            // A target spinning on getNotifs (the other half of a WRITE timed until its
            // notification is seen) receives it on its own thread, as a poller of its own
            // request does in check(): else the notification waits for the progress
            // thread's turn on the cores.
            self.caller_pass(PassKind::Full);
        }
        self.core.take_notifs()
    }

    pub fn send_notif(&self, name: &str, msg: &[u8]) -> Result<()> {
        if msg.len() as u64 > self.core.cfg.max_notif_size {
            return Err(Error::InvalidParam(format!(
                "notification of {} bytes exceeds max_notif_size {}", msg.len(), self.core.cfg.max_notif_size
            )));
        }
        if name == self.core.name {
            self.core.push_notif(name.to_string(), msg.to_vec());
            return Ok(());
        }
        let p = self.peer(name)?;
        if self.threaded && !self.shut.load(Ordering::Acquire) {
            // Queued on the caller's thread and sent by a pass of its own where it may, as a
            // small post is: a task for the progress thread waited for the thread's turn,
            // 1-4 ms while the caller had been polling before (the thread naps then; a
            // genNotif ping-pong over tcp went from ~2 ms to microseconds).
            if let Ok(mut d) = self.driver.try_lock() {
                d.send_ctrl(&p, wire::CtrlType::Notif, msg, None)?;
                drop(d);
                if !self.caller_pass(PassKind::Full) {
                    self.core.wake();
                }
                return Ok(());
            }
        }
        let msg = msg.to_vec();
        self.on_driver("sending a notification", move |d| d.send_ctrl(&p, wire::CtrlType::Notif, &msg, None))??;
        self.progress();
        Ok(())
    }

    /// Stops the progress thread, fails what is in flight and closes the rails' users.
    pub fn shutdown(&self) {
        if self.shut.swap(true, Ordering::AcqRel) {
            return;
        }
        self.stop.store(true, Ordering::Release);
        self.core.set_sleeping(true);
        self.core.wake();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            if t.join().is_err() {
                log::error!("{}: progress thread panicked", self.core.name);
            }
        }
        self.rail_threads.lock().unwrap_or_else(|p| p.into_inner()).stop(&self.core);
        let mut d = self.lock_driver();
        // Give queued control messages (a last notification) a brief, bounded chance.
        let deadline = Instant::now() + Duration::from_millis(200);
        // (Only while something is queued: a last CQ read after a same-process shm peer
        // was destroyed has crashed inside libfabric's shm provider.)
        while d.has_pending() && Instant::now() < deadline {
            d.pass();
        }
        d.cancel_all();
        drop(CloseQueue::close(&self.core.closeq));
        drop(d);
        self.core.fds.shutdown();
        log::info!("{}: engine shut down", self.core.name);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}


/// What the scheduler may learn about same-host memory, answered from the engine's core.
struct Reached<'a>(&'a Arc<Core>);

impl Reach for Reached<'_> {
    fn same_process(&self, peer: &Peer, addr: u64, len: u64, kind: MemKind) -> Option<Arc<LocalMem>> {
        match &peer.local {
            local_peers::Locality::SameProcess(view) => view.upgrade()?.find(addr, len, kind),
            _ => None,
        }
    }
    fn ipc_open(&self, peer: &Peer, ipc: &wire::IpcDesc, local_ctx: Option<cuda::Context>) -> Option<Arc<IpcEntry>> {
        self.0.ipc.open(peer.info.engine_id, &peer.name, ipc, local_ctx)
    }
    fn peer_copy_refused(&self, engine_id: u64) -> bool {
        self.0.ipc.refused(engine_id)
    }
    fn pin(&self, m: &LocalMem, ctx: &cuda::Context) {
        m.pin_for_gpu(ctx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_providers_without_an_interface_list_stay_on_the_first_interface() {
        // tcp on 16 cores, two interfaces, no list: six connections on the first.
        assert_eq!(rail_layout(0, 0, Some(6), true, 2), (6, 1));
        // Listed: six over both (three each); three listed on 8 cores: one each.
        assert_eq!(rail_layout(0, 2, Some(6), true, 2), (6, 2));
        assert_eq!(rail_layout(0, 3, Some(2), true, 3), (3, 3));
        // An explicit count cycles over every interface found.
        assert_eq!(rail_layout(4, 0, Some(6), true, 2), (4, 2));
        // verbs/efa: a rail per NIC; shm/udp: one.
        assert_eq!(rail_layout(0, 0, None, false, 4), (4, 4));
        assert_eq!(rail_layout(0, 0, None, true, 1), (1, 1));
    }

    #[test]
    fn rail_0_shares_its_interface_only_where_the_rails_outnumber_the_interfaces() {
        // tcp's automatic rails: six connections over one interface.
        assert!((0..6).all(|i| nic_shared(i, 6, 1)));
        // One rail per NIC (verbs, efa, an iface list): none shares.
        assert!((0..4).all(|i| !nic_shared(i, 4, 4)));
        // Eight rails over four NICs: rail 0 and rail 4 share NIC 0.
        assert!(nic_shared(0, 8, 4) && nic_shared(3, 8, 4));
        // Five rails over four NICs: only NIC 0 carries two.
        assert!(nic_shared(0, 5, 4) && nic_shared(4, 5, 4) && !nic_shared(1, 5, 4));
        // One rail, and the shm rail after the network rails.
        assert!(!nic_shared(0, 1, 1) && !nic_shared(6, 6, 1));
    }

    #[test]
    fn automatic_rail_count_for_socket_providers_follows_the_core_count() {
        assert_eq!(auto_socket_rails("tcp;ofi_rxm", 2), Some(1));
        assert_eq!(auto_socket_rails("tcp", 16), Some(6));
        assert_eq!(auto_socket_rails("tcp", 15), Some(4));
        assert_eq!(auto_socket_rails("sockets", 8), Some(4));
        assert_eq!(auto_socket_rails("sockets", 7), Some(1));
        assert_eq!(auto_socket_rails("efa", 64), None);
        assert_eq!(auto_socket_rails("shm", 64), None);
    }
}
