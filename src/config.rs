//! The one table of every tunable. Each entry gives the backend-parameter key, the
//! environment variable that overrides the default, the default, and what it does. The
//! parameter parser, `get_backend_options`, the env overrides and the README table all come
//! from this table (a test keeps the README in step).
use crate::error::{Error, Result};

/// How a value in the table is parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Str,
    U64,
    Bool,
    Size,
}

/// One row of the table.
pub struct Tunable {
    pub key: &'static str,
    pub env: &'static str,
    pub default: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    set: fn(&mut Config, &str) -> Result<()>,
    get: fn(&Config) -> String,
}

macro_rules! tunables {
    ($( $field:ident : $ty:ty = $kind:ident, $default:expr, $env:expr, $help:expr; )*) => {
        /// Engine configuration; build with [`Config::from_env`], then [`Config::set`].
        #[derive(Clone, Debug)]
        pub struct Config { $( pub $field: $ty, )* }

        pub static TUNABLES: &[Tunable] = &[ $( Tunable {
            key: stringify!($field),
            env: $env,
            default: $default,
            kind: Kind::$kind,
            help: $help,
            set: |c, v| { c.$field = parse::<$ty>(Kind::$kind, stringify!($field), v)?; Ok(()) },
            get: |c| show(&c.$field),
        }, )* ];
    };
}

tunables! {
    provider: String = Str, "auto", "NIXL_FABRIC_PROVIDER",
        "libfabric provider: auto, tcp (tcp;ofi_rxm), sockets, shm, udp (udp;ofi_rxd), verbs, efa, or a full provider name";
    iface: String = Str, "", "NIXL_FABRIC_IFACE",
        "comma-separated libfabric domain names (for tcp/sockets: interface names such as lo or eth0) to open rails on; empty picks them automatically";
    rails: u64 = U64, "0", "NIXL_FABRIC_RAILS",
        "number of rails (endpoints); 0 = one per matching domain, but tcp/sockets stay on one interface unless `iface` lists several, and open several connections on larger hosts (six with 16 or more cores, four with 8 or more; a single interface then carries them all); more than the domains cycles over them";
    progress_thread: bool = Bool, "true", "NIXL_FABRIC_PROGRESS_THREAD",
        "run a progress thread; off means progress happens in check/notification calls";
    caller_progress: bool = Bool, "true", "NIXL_FABRIC_CALLER_PROGRESS",
        "with the progress thread on, a status check of a running request, and a notification poll (getNotifs), also make a progress pass on the caller's thread when the rails are free (not while CUDA contexts are registered); the thread naps while callers do this";
    progress_delay_us: u64 = U64, "0", "NIXL_FABRIC_PROGRESS_DELAY_US",
        "longest sleep of an idle progress thread between passes (the agent's pthrDelay); 0 = 1000";
    striping_threshold: u64 = Size, "1048576", "NIXL_FABRIC_STRIPING_THRESHOLD",
        "descriptors of at least this many bytes are split across all rails";
    notif_rail0_bytes: u64 = Size, "65536", "NIXL_FABRIC_NOTIF_RAIL0_BYTES",
        "requests to a peer over the network rails of at most this many bytes (all descriptors together) go on rail 0, the control endpoint, where a provider that orders a send after writes (FI_ORDER_SAW: tcp, sockets) lets their notification follow the data at once instead of after a flush read's round trip; larger ones, and every one with 0, are spread over the rails";
    rma_rail0: bool = Bool, "false", "NIXL_FABRIC_RMA_RAIL0",
        "where rail 0 is one of several connections over one interface (tcp's automatic rails), false keeps the RMA of requests larger than notif_rail0_bytes off rail 0 (and the peer's rail 0) wherever the route has at least two other pairs, as staging_rail0 does for staged chunks: rail 0, which the progress thread drives, then carries control messages, notifications and small requests only, and bulk data goes over the rails that have threads of their own (H100, six tcp rails: 4096 x 4 KiB and 256 x 256 KiB WRITEs 1.6x, 64 MiB 1.15x); true stripes bulk data over every rail. Rails on interfaces of their own (an iface list, verbs, efa) always all carry data";
    notif_behind_data: bool = Bool, "true", "NIXL_FABRIC_NOTIF_BEHIND_DATA",
        "where rail 0 orders a send after writes at both ends (FI_ORDER_SAW: tcp, sockets), a notification whose data all went on rail 0 is sent right behind it, and flush reads right behind the writes on rails the progress thread posts to; off: a notification waits for the flush reads (or delivery-complete writes), and a flush read for its writes' completions";
    eager_write_bytes: u64 = Size, "8192", "NIXL_FABRIC_EAGER_WRITE_BYTES",
        "a WRITE of host memory to a peer's host memory over the network rails of at most this many bytes (all descriptors together, and no more than max_notif_size) goes as one control message carrying its data and its notification, which the target copies in and acknowledges once the bytes are in place: one message each way instead of the writes, the notification and a flush read; 0 turns it off";
    timeout_ms: u64 = U64, "5000", "NIXL_FABRIC_TIMEOUT_MS",
        "a request with no completion for this long fails with NIXL_ERR_REMOTE_DISCONNECT; also bounds every internal wait";
    plan_at_post: bool = Bool, "true", "NIXL_FABRIC_PLAN_AT_POST",
        "NIXL adapter: a request's descriptors are checked and planned at its first postXfer (where NIXL's UCX plugin does its per-descriptor work; reposts reuse the plan), so make_prepped_xfer/initialize_xfer cost what the agent's own part costs; false plans in prepXfer, so that a request made ahead of time posts with no per-descriptor work and a bad descriptor fails its creation rather than its first post";
    plan_threads: u64 = U64, "0", "NIXL_FABRIC_PLAN_THREADS",
        "threads that check and plan one request of many descriptors (at least 32768: a part of at least 4096 each, the posting thread taking the first) at its first post or creation; 0 = half the cores this process may run on, at most 8; 1 plans on the posting thread alone";
    max_notif_size: u64 = Size, "65536", "NIXL_FABRIC_MAX_NOTIF_SIZE",
        "largest notification message in bytes";
    ctrl_recv_count: u64 = U64, "64", "NIXL_FABRIC_CTRL_RECV_COUNT",
        "receive buffers pre-posted on rail 0 for control messages";
    max_inflight: u64 = U64, "1024", "NIXL_FABRIC_MAX_INFLIGHT",
        "most RMA operations outstanding per rail (also capped by the provider's queue size)";
    rma_batch: u64 = U64, "4", "NIXL_FABRIC_RMA_BATCH",
        "most descriptors one RMA operation carries where the provider's iov limits allow (up to 8); 1 posts one operation per descriptor";
    same_host_shm: bool = Bool, "true", "NIXL_FABRIC_SAME_HOST_SHM",
        "peers on the same host (same boot id) exchange data over an extra shm rail instead of the network rails; off also turns off every other same-host path (GPU IPC, direct copies between engines of one process)";
    gpu_ipc: bool = Bool, "true", "NIXL_FABRIC_GPU_IPC",
        "GPU memory of same-host peers is opened by CUDA IPC and copied by the GPU (needs same_host_shm too); off stages it through host memory";
    gpu_copy_kernel: bool = Bool, "true", "NIXL_FABRIC_GPU_COPY_KERNEL",
        "direct copies of many small device-to-device ranges (KV blocks) run as one kernel launch per up to 1364 ranges instead of one copy-engine operation each; off uses cuMemcpyBatchAsync, else one cuMemcpyAsync per range";
    pin_host_memory: bool = Bool, "true", "NIXL_FABRIC_PIN_HOST_MEMORY",
        "host memory that takes part in direct GPU copies (IPC or between engines of one process) is page-locked on first use (cuMemHostRegister), so the copies run at full bus speed; memory that is already pinned is used as it is";
    rail_threads: bool = Bool, "true", "NIXL_FABRIC_RAIL_THREADS",
        "with two or more tcp/sockets rails and the progress thread on, every rail after the first gets a thread that posts its RMA and drives the provider's progress on it, so striped transfers move over the connections at once; off: the progress thread posts to and drives every rail";
    cma_copy: bool = Bool, "true", "NIXL_FABRIC_CMA_COPY",
        "host memory of a same-host peer process that this process may access (cross-memory attach; needs same_host_shm) is written and read directly with process_vm_writev/readv, many descriptors per call and large requests split over copy threads, instead of through the shm rail; also spreads host-to-host copies of 2 MiB and more between engines of one process over the copy threads";
    cma_threads: u64 = U64, "0", "NIXL_FABRIC_CMA_THREADS",
        "copy threads per engine for cma_copy and large same-process host copies (started at first use); 0 = half the cores this process may run on, at most 7";
    cma_spin_us: u64 = U64, "0", "NIXL_FABRIC_CMA_SPIN_US",
        "how long a copy thread that ran out of pieces keeps looking for the next (yielding its core) before it sleeps; 0 = sleep at once (the H200 host's 1 MiB same-host WRITE was slower with 50: 137-143 us against 118-122)";
    cma_min_piece: u64 = Size, "131072", "NIXL_FABRIC_CMA_MIN_PIECE",
        "the smallest piece of a same-host copy handed to a copy thread: a request smaller than this times (copy threads + 1) is one process_vm_writev/readv on the posting thread (1 MiB with seven threads; with fewer than three threads at least 1 MiB), a larger one is cut into a piece per thread and one for the posting thread, which also copies what no thread has taken yet (4 KiB .. 64 MiB)";
    vram_registration: String = Str, "auto", "NIXL_FABRIC_VRAM_REGISTRATION",
        "how GPU memory is registered with a provider that offers FI_HMEM: auto tries a dma-buf registration (libfabric >= 1.20 and a driver that exports dma-bufs), then plain FI_HMEM, then falls back to packed staging; dmabuf or hmem take only that kind (a registration the provider refuses fails: to pin a path in tests); staged always stages";
    hmem_owner_rma: bool = Bool, "true", "NIXL_FABRIC_HMEM_OWNER_RMA",
        "where the provider moves host memory into or out of a peer's provider-registered GPU memory (FI_HMEM) through host bounce buffers (shm: its CUDA IPC path needs device memory on the posting side), our host memory with a peer's such GPU memory goes as stage requests that the GPU memory's owner serves with its own RMA, its device memory the local side and no bounce slot (libfabric 2.1's shm, 64 MiB DRAM->VRAM on the H100: 5.06 W / 8.10 R GB/s this way, 1.44 / 1.49 posted from the host side); false: plain RMA from our side as for any registered memory";
    staging_buffer_size: u64 = Size, "0", "NIXL_FABRIC_STAGING_BUFFER_SIZE",
        "pinned host bounce memory per engine for GPU memory the provider cannot register (no FI_HMEM); 0 = sized from the rails: staging_depth chunks in flight on every rail for our requests and as many for serving peers' (at most 512 MiB)";
    staging_chunk_size: u64 = Size, "0", "NIXL_FABRIC_STAGING_CHUNK_SIZE",
        "size of one staging chunk: many small GPU blocks are packed into one chunk by one gather launch, moved as one RMA and unpacked by one scatter launch; 0 = the bandwidth-delay product of one rail (its provider's bandwidth over about 400 us, 1 MiB over tcp, 4 MiB over verbs/efa)";
    staging_depth: u64 = U64, "4", "NIXL_FABRIC_STAGING_DEPTH",
        "staging chunks in flight per rail (the device copy of one overlaps the wire of the one before and the device copy at the far end of the one before that); sizes the automatic staging pool";
    staging_balance: bool = Bool, "false", "NIXL_FABRIC_STAGING_BALANCE",
        "even a staged request's bytes out over the rails it takes: where fixed-size chunks dealt round-robin leave one rail more than 5 % over the mean (16 chunks of 1 MiB over five rails: four on one, 1.25x the mean), the request is planned again with chunks cut to the size that gives every rail as many (20 of 832 KiB), not below 256 KiB; the plan whose busiest rail carries less is kept. Off until measured on a GPU host (staged WRITE 1024 x 16 KiB reached 0.67-0.74x of host memory there, whose many small RMAs spread evenly)";
    staging_rail0: bool = Bool, "false", "NIXL_FABRIC_STAGING_RAIL0",
        "false keeps staged chunks off rail 0 (and the peer's rail 0) wherever the route has at least two other pairs, so the stage requests and answers that rail 0 carries never queue behind a chunk's bytes on its connection (and the progress thread, which drives rail 0, never moves a chunk's bytes); true lets them take rail 0 in their turn like every other rail";
    staging_lend_reads: bool = Bool, "true", "NIXL_FABRIC_STAGING_LEND_READS",
        "a staged READ of a peer's GPU memory: where the peer lends slots, the owner packs each chunk of at least staging_lend_min_blocks blocks into a slot of its own and we RMA-read it, into our slot (then scatter) or straight into our host memory (H100, tcp: 4-16 KiB blocks 12-17 % faster than PUSH); smaller chunks, and every chunk with false, the owner RMA-writes to us (PUSH)";
    staging_lend_min_blocks: u64 = U64, "2", "NIXL_FABRIC_STAGING_LEND_MIN_BLOCKS",
        "with staging_lend_reads, the fewest blocks a chunk must pack to be lent (1 = every chunk, also one range of a large block; such chunks otherwise go PUSH); READs into our host memory read the lent slot straight into it";
    staging_ranges: u64 = U64, "1024", "NIXL_FABRIC_STAGING_RANGES",
        "most GPU blocks packed into one staging chunk (its stage request carries 24 bytes per block and must fit a control message; also capped by the gather kernel's ranges per launch)";
    fault_inject: String = Str, "", "NIXL_FABRIC_FAULT_INJECT",
        "tests only: provider faults injected at every rail, e.g. `eagain=0.3,eagain_burst=8,reorder=0.5,delay=4,cq_error=0.001,post_fail=0.001,seed=7` (FI_EAGAIN on posts, failed posts, error completions, late and reordered completions; see Fault injection); empty = off";
}

/// Keys of the stock LIBFABRIC plugin and of other backends that callers pass through
/// (TRT-LLM hands every backend the same map). Mapped ones become our key; the rest are
/// accepted and ignored with a log line.
pub static ALIASES: &[(&str, Option<&str>)] = &[
    ("num_threads", None),
    ("split_batch_size", None),
    ("num_workers", None),
    ("batch_size", None),
    ("fabric_provider", Some("provider")),
    ("num_rails", Some("rails")),
];

fn show<T: std::fmt::Display>(v: &T) -> String {
    v.to_string()
}

trait FromTable: Sized {
    fn from_table(kind: Kind, v: &str) -> Option<Self>;
}
impl FromTable for String {
    fn from_table(_: Kind, v: &str) -> Option<Self> {
        Some(v.trim().to_string())
    }
}
impl FromTable for bool {
    fn from_table(_: Kind, v: &str) -> Option<Self> {
        parse_bool(v)
    }
}

/// Booleans as our tunables and libfabric's parameters spell them.
pub fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}
impl FromTable for u64 {
    fn from_table(kind: Kind, v: &str) -> Option<Self> {
        let v = v.trim();
        if kind == Kind::Size {
            return parse_size(v);
        }
        v.parse().ok()
    }
}

/// Sizes accept plain bytes or a K/M/G suffix (powers of two), as users write them.
pub fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, mul) = match v.chars().last()?.to_ascii_uppercase() {
        'K' => (&v[..v.len() - 1], 1u64 << 10),
        'M' => (&v[..v.len() - 1], 1 << 20),
        'G' => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mul)
}

fn parse<T: FromTable>(kind: Kind, key: &str, v: &str) -> Result<T> {
    T::from_table(kind, v).ok_or_else(|| {
        Error::InvalidParam(format!("value '{v}' for backend parameter '{key}' is not a valid {kind:?}"))
    })
}

/// Which registrations of GPU memory with the provider an engine may make (config
/// `vram_registration`): every kind in order of preference, or one kind only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VramPolicy {
    Auto,
    DmaBuf,
    Hmem,
    Staged,
}

/// What [`Config::set`] did with a key.
#[derive(Debug, PartialEq, Eq)]
pub enum SetOutcome {
    Applied,
    /// A known foreign key (another backend's or the stock plugin's) that has no meaning here.
    Ignored,
}

impl Config {
    /// The table's defaults.
    pub fn defaults() -> Config {
        let mut c = Config::empty();
        for t in TUNABLES {
            // The defaults in the table are valid by construction (a unit test checks it).
            let _ = (t.set)(&mut c, t.default);
        }
        c
    }

    fn empty() -> Config {
        Config {
            provider: String::new(),
            iface: String::new(),
            rails: 0,
            progress_thread: true,
            caller_progress: true,
            progress_delay_us: 0,
            striping_threshold: 0,
            notif_rail0_bytes: 0,
            notif_behind_data: true,
            eager_write_bytes: 0,
            timeout_ms: 0,
            plan_at_post: true,
            plan_threads: 0,
            max_notif_size: 0,
            ctrl_recv_count: 0,
            max_inflight: 0,
            rma_batch: 0,
            same_host_shm: true,
            gpu_ipc: true,
            gpu_copy_kernel: true,
            pin_host_memory: true,
            rail_threads: true,
            cma_copy: true,
            cma_threads: 0,
            cma_spin_us: 0,
            cma_min_piece: 0,
            vram_registration: String::new(),
            hmem_owner_rma: true,
            staging_buffer_size: 0,
            staging_chunk_size: 0,
            staging_depth: 0,
            staging_ranges: 0,
            staging_balance: false,
            staging_rail0: true,
            rma_rail0: true,
            staging_lend_reads: true,
            staging_lend_min_blocks: 2,
            fault_inject: String::new(),
        }
    }

    /// Defaults overridden by the table's environment variables. A malformed variable is an
    /// error, so a typo does not silently fall back.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::defaults();
        for t in TUNABLES {
            if let Ok(v) = std::env::var(t.env) {
                (t.set)(&mut c, &v).map_err(|_| Error::InvalidParam(format!("environment variable {}='{v}' is not a valid {:?}", t.env, t.kind)))?;
            }
        }
        Ok(c)
    }

    /// Applies one key. Unknown keys are `NotFound`; malformed values of known keys are
    /// `InvalidParam`.
    pub fn set(&mut self, key: &str, value: &str) -> Result<SetOutcome> {
        if let Some(t) = TUNABLES.iter().find(|t| t.key == key) {
            (t.set)(self, value)?;
            return Ok(SetOutcome::Applied);
        }
        match ALIASES.iter().find(|(k, _)| *k == key) {
            Some((_, Some(ours))) => self.set(ours, value),
            Some((_, None)) => Ok(SetOutcome::Ignored),
            None => Err(Error::NotFound(format!("backend parameter '{key}'"))),
        }
    }

    pub fn get(&self, key: &str) -> Option<String> {
        TUNABLES.iter().find(|t| t.key == key).map(|t| (t.get)(self))
    }

    /// `vram_registration`, parsed.
    pub fn vram_policy(&self) -> Result<VramPolicy> {
        match self.vram_registration.to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(VramPolicy::Auto),
            "dmabuf" | "dma-buf" => Ok(VramPolicy::DmaBuf),
            "hmem" | "fi_hmem" => Ok(VramPolicy::Hmem),
            "staged" | "staging" => Ok(VramPolicy::Staged),
            v => Err(Error::InvalidParam(format!("vram_registration '{v}' is not one of auto, dmabuf, hmem, staged"))),
        }
    }

    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.timeout_ms.max(1))
    }

    /// Bytes of one staging chunk over `rails` rails of `provider`: the configured size, or
    /// one rail's bandwidth-delay product (its provider's bandwidth over about 400 us: a
    /// chunk long enough that the control round trip and device copies around it stay a
    /// small part of its time on the wire), a power of two in 256 KiB ..= 8 MiB.
    pub fn staging_chunk(&self, provider: &str) -> u64 {
        if self.staging_chunk_size != 0 {
            return self.staging_chunk_size;
        }
        // Bytes per microsecond one connection of the provider moves (measured: one tcp
        // stream ~2.4 GB/s on the H200 host; verbs/efa links 12-25 GB/s).
        let per_us: u64 = if ["verbs", "efa", "cxi", "opx", "psm3"].iter().any(|p| provider.contains(p)) { 12_500 } else { 2_500 };
        let bdp = per_us * 400;
        let up = bdp.next_power_of_two();
        let nearest = if up - bdp > bdp - up / 2 { up / 2 } else { up };
        nearest.clamp(256 << 10, 8 << 20)
    }

    /// Bytes of the staging pool: the configured size, or `staging_depth` chunks in flight
    /// on every rail for our requests and as many for peers' (at most 512 MiB).
    pub fn staging_pool(&self, rails: usize, chunk: u64) -> u64 {
        if self.staging_buffer_size != 0 {
            return self.staging_buffer_size.max(2 * chunk);
        }
        (2 * self.staging_depth.max(1) * rails.max(1) as u64 * chunk).clamp(4 * chunk, (512 << 20).max(4 * chunk))
    }

    pub fn validate(&self) -> Result<()> {
        if self.max_notif_size == 0 || self.max_notif_size > (16 << 20) {
            return Err(Error::InvalidParam("max_notif_size must be 1 B .. 16 MiB".into()));
        }
        if self.eager_write_bytes > 65536 {
            // (Its message must fit a control buffer beside a notification, and providers
            // send larger messages by rendezvous: a round trip more than the writes.)
            return Err(Error::InvalidParam("eager_write_bytes must be 0 .. 64 KiB".into()));
        }
        if self.ctrl_recv_count == 0 || self.ctrl_recv_count > 4096 {
            return Err(Error::InvalidParam("ctrl_recv_count must be 1 .. 4096".into()));
        }
        if self.max_inflight == 0 {
            return Err(Error::InvalidParam("max_inflight must be at least 1".into()));
        }
        if self.staging_chunk_size != 0 && self.staging_chunk_size < 4096 {
            return Err(Error::InvalidParam("staging_chunk_size must be 0 (automatic) or at least 4 KiB".into()));
        }
        if self.staging_buffer_size != 0 && self.staging_buffer_size < 2 * self.staging_chunk_size.max(4096) {
            return Err(Error::InvalidParam("staging_buffer_size must be 0 (automatic) or hold at least two staging_chunk_size chunks".into()));
        }
        if !(4096..=64 << 20).contains(&self.cma_min_piece) {
            return Err(Error::InvalidParam("cma_min_piece must be 4 KiB .. 64 MiB".into()));
        }
        if self.cma_spin_us > 10_000 {
            return Err(Error::InvalidParam("cma_spin_us must be 0 .. 10000".into()));
        }
        if self.staging_depth == 0 || self.staging_depth > 64 {
            return Err(Error::InvalidParam("staging_depth must be 1 .. 64".into()));
        }
        if self.staging_ranges == 0 || self.staging_ranges > crate::engine::wire::STAGE_MAX_RANGES as u64 {
            return Err(Error::InvalidParam(format!("staging_ranges must be 1 .. {}", crate::engine::wire::STAGE_MAX_RANGES)));
        }
        if self.rails > 64 {
            return Err(Error::InvalidParam("rails must be at most 64".into()));
        }
        crate::fabric::FaultSpec::parse(&self.fault_inject)?;
        self.vram_policy()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_and_validate() {
        let c = Config::defaults();
        for t in TUNABLES {
            assert_eq!(c.get(t.key).as_deref(), Some(t.default.trim()), "{}", t.key);
        }
        c.validate().unwrap();
    }

    #[test]
    fn set_rejects_malformed_and_unknown() {
        let mut c = Config::defaults();
        assert!(matches!(c.set("timeout_ms", "soon"), Err(Error::InvalidParam(_))));
        assert!(matches!(c.set("no_such_key", "1"), Err(Error::NotFound(_))));
        assert_eq!(c.set("num_workers", "4").unwrap(), SetOutcome::Ignored);
        assert_eq!(c.set("striping_threshold", "2M").unwrap(), SetOutcome::Applied);
        assert_eq!(c.striping_threshold, 2 << 20);
        assert_eq!(c.set("progress_thread", "off").unwrap(), SetOutcome::Applied);
        assert!(!c.progress_thread);
    }

    #[test]
    fn readme_lists_every_tunable() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
            .unwrap_or_default();
        for t in TUNABLES {
            let row = format!("| `{}` | `{}` | `{}` |", t.key, t.env, t.default);
            assert!(readme.contains(&row), "README configuration table lacks the row: {row}");
        }
    }
}
