//! Our binary wire formats: connection info, public memory descriptors and control
//! messages. Every blob from a peer is untrusted: parsed with bounds checks, versioned, and
//! refused with an error that says what was wrong. Layouts are documented in the README.
use crate::error::{Error, Result};

pub const CONN_MAGIC: &[u8; 4] = b"NFCI";
pub const MEM_MAGIC: &[u8; 4] = b"NFMD";
pub const CTRL_MAGIC: &[u8; 2] = b"NF";
pub const CONN_VERSION: u16 = 1;
pub const MEM_VERSION: u16 = 1;
pub const CTRL_VERSION: u8 = 1;

pub const MAX_RAILS: usize = 64;
pub const MAX_ADDR_LEN: usize = 1024;
pub const MAX_NAME_LEN: usize = 4096;
/// Largest connection info a Put carries (a u16 length on the wire).
pub const MAX_CONN_INFO: usize = u16::MAX as usize;

/// Little-endian writer for length-prefixed fields.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);
impl Writer {
    fn u8(&mut self, v: u8) -> &mut Self { self.0.push(v); self }
    fn u16(&mut self, v: u16) -> &mut Self { self.0.extend_from_slice(&v.to_le_bytes()); self }
    fn u32(&mut self, v: u32) -> &mut Self { self.0.extend_from_slice(&v.to_le_bytes()); self }
    fn u64(&mut self, v: u64) -> &mut Self { self.0.extend_from_slice(&v.to_le_bytes()); self }
    fn bytes(&mut self, v: &[u8]) -> &mut Self { self.0.extend_from_slice(v); self }
    fn short(&mut self, v: &[u8]) -> &mut Self { self.u16(v.len() as u16).bytes(v) }
}

/// Bounds-checked reader; every failure names the blob and the field.
pub struct Reader<'a> { buf: &'a [u8], pos: usize, what: &'static str }
impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self { Reader { buf, pos: 0, what } }
    fn err(&self, why: String) -> Error { Error::Malformed { what: self.what, why } }
    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            self.err(format!("truncated at {field} (offset {}, need {n} of {} bytes)", self.pos, self.buf.len()))
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self, f: &str) -> Result<u8> { Ok(self.take(1, f)?[0]) }
    fn u16(&mut self, f: &str) -> Result<u16> { Ok(u16::from_le_bytes(self.take(2, f)?.try_into().expect("2"))) }
    fn u32(&mut self, f: &str) -> Result<u32> { Ok(u32::from_le_bytes(self.take(4, f)?.try_into().expect("4"))) }
    fn u64(&mut self, f: &str) -> Result<u64> { Ok(u64::from_le_bytes(self.take(8, f)?.try_into().expect("8"))) }
    fn short(&mut self, f: &str, max: usize) -> Result<&'a [u8]> {
        let n = self.u16(f)? as usize;
        if n > max {
            return Err(self.err(format!("{f} length {n} exceeds {max}")));
        }
        self.take(n, f)
    }
    fn magic(&mut self, m: &[u8]) -> Result<()> {
        let got = self.take(m.len(), "magic")?;
        if got != m {
            return Err(self.err(format!("bad magic {:02x?}", got)));
        }
        Ok(())
    }
    fn finish(&self) -> Result<()> {
        if self.pos != self.buf.len() {
            return Err(self.err(format!("{} trailing bytes", self.buf.len() - self.pos)));
        }
        Ok(())
    }
}

/// One rail of a peer: its provider and endpoint address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RailAddr {
    pub provider: String,
    pub addr: Vec<u8>,
}

/// Where a same-host peer can check that it may reach this process's memory directly
/// (cross-memory attach): the process id and the address of a random token to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessInfo {
    pub pid: u32,
    pub token_addr: u64,
    pub token: [u8; 16],
}

/// Connection-info flag: a ProcessInfo block follows the rails.
const CONN_FLAG_PROCESS: u16 = 1;
/// Connection-info flag: the first rail processes a received send only after the writes
/// that came before it (its provider granted FI_ORDER_SAW on the receive side). No field.
const CONN_FLAG_RAIL0_SAW: u16 = 2;
/// Connection-info flag: GPU staging speaks stage requests of STAGE_FORMAT (packed chunks).
/// Builds before packed staging (format 1) do not set it. No field.
const CONN_FLAG_PACKED_STAGING: u16 = 4;
/// Connection-info flag: takes PUT control messages (small writes carried in the message).
/// No field.
const CONN_FLAG_EAGER_WRITE: u16 = 8;
/// Connection-info flag: serves stage requests of direction LEND (it packs a chunk of its
/// GPU memory into a slot of its own for the requester to RMA-read). No field.
const CONN_FLAG_LENDS: u16 = 16;
/// The flags a decoder keeps (others are ignored: a newer peer's).
pub const CONN_FLAGS_KNOWN: u16 = CONN_FLAG_PROCESS | CONN_FLAG_RAIL0_SAW | CONN_FLAG_PACKED_STAGING | CONN_FLAG_EAGER_WRITE | CONN_FLAG_LENDS;

/// Everything a peer needs to reach an engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    pub engine_id: u64,
    pub host_id: [u8; 16],
    pub agent: String,
    pub rails: Vec<RailAddr>,
    pub process: Option<ProcessInfo>,
    /// Rail 0 orders a send after earlier writes (flags bit 1): a notification may follow
    /// its data there without a flush read first. Peers of older versions do not say so.
    pub rail0_saw: bool,
    /// Its GPU staging speaks our stage format (flags bit 2); false: an older build whose
    /// stage requests ours cannot read, nor it ours.
    pub packed_staging: bool,
    /// It takes PUT messages (flags bit 3); builds before them do not say so.
    pub eager_write: bool,
    /// It lends packed slots for staged READs (flags bit 4; stage direction LEND).
    pub lends: bool,
}

impl ConnInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        let flags = if self.process.is_some() { CONN_FLAG_PROCESS } else { 0 }
            | if self.rail0_saw { CONN_FLAG_RAIL0_SAW } else { 0 }
            | if self.packed_staging { CONN_FLAG_PACKED_STAGING } else { 0 }
            | if self.eager_write { CONN_FLAG_EAGER_WRITE } else { 0 }
            | if self.lends { CONN_FLAG_LENDS } else { 0 };
        w.bytes(CONN_MAGIC).u16(CONN_VERSION).u16(flags).u64(self.engine_id).bytes(&self.host_id);
        w.short(self.agent.as_bytes()).u16(self.rails.len() as u16);
        for r in &self.rails {
            w.short(r.provider.as_bytes()).short(&r.addr);
        }
        if let Some(p) = &self.process {
            w.u32(p.pid).u64(p.token_addr).bytes(&p.token);
        }
        w.0
    }

    pub fn decode(buf: &[u8]) -> Result<ConnInfo> {
        let mut r = Reader::new(buf, "connection info");
        r.magic(CONN_MAGIC)?;
        let v = r.u16("version")?;
        if v != CONN_VERSION {
            return Err(Error::Version { what: "connection info", ours: CONN_VERSION, theirs: v });
        }
        // Bits we do not know are ignored (a newer peer's optional fields come last).
        let flags = r.u16("flags")?;
        let engine_id = r.u64("engine id")?;
        let host_id: [u8; 16] = r.take(16, "host id")?.try_into().expect("16");
        let agent = utf8(r.short("agent name", MAX_NAME_LEN)?, "connection info", "agent name")?;
        let n = r.u16("rail count")? as usize;
        if n == 0 || n > MAX_RAILS {
            return Err(Error::Malformed { what: "connection info", why: format!("rail count {n} not in 1..={MAX_RAILS}") });
        }
        let mut rails = Vec::with_capacity(n);
        for _ in 0..n {
            let provider = utf8(r.short("provider", 64)?, "connection info", "provider")?;
            let addr = r.short("address", MAX_ADDR_LEN)?.to_vec();
            if addr.is_empty() {
                return Err(Error::Malformed { what: "connection info", why: "empty rail address".into() });
            }
            rails.push(RailAddr { provider, addr });
        }
        let process = if flags & CONN_FLAG_PROCESS != 0 {
            let pid = r.u32("process id")?;
            let token_addr = r.u64("token address")?;
            let token: [u8; 16] = r.take(16, "token")?.try_into().expect("16");
            Some(ProcessInfo { pid, token_addr, token })
        } else {
            None
        };
        r.finish()?;
        Ok(ConnInfo { engine_id, host_id, agent, rails, process, rail0_saw: flags & CONN_FLAG_RAIL0_SAW != 0,
                      packed_staging: flags & CONN_FLAG_PACKED_STAGING != 0, eager_write: flags & CONN_FLAG_EAGER_WRITE != 0,
                      lends: flags & CONN_FLAG_LENDS != 0 })
    }
}

fn utf8(b: &[u8], what: &'static str, field: &str) -> Result<String> {
    String::from_utf8(b.to_vec()).map_err(|_| Error::Malformed { what, why: format!("{field} is not UTF-8") })
}

/// The public description of one registration: what a peer needs to address it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemDesc {
    pub mem_type: u8,
    /// Remote addresses are virtual addresses (else offsets from `base`).
    pub virt_addr: bool,
    /// Device memory without an MR: peers reach it through the owner's staging (PULL/PUSH).
    pub staged: bool,
    pub engine_id: u64,
    pub base: u64,
    pub len: u64,
    pub dev_id: u64,
    pub keys: Vec<u64>,
    /// Device memory that same-host peers may open directly (flags bit 2).
    pub ipc: Option<IpcDesc>,
}

/// Memory-descriptor flag: an [`IpcDesc`] block follows the keys.
const MEM_FLAG_IPC: u8 = 4;
const MEM_FLAGS_KNOWN: u8 = 1 | 2 | MEM_FLAG_IPC;
/// Kind of handle in an [`IpcDesc`]: the driver's legacy IPC handle (cuIpcGetMemHandle).
pub const IPC_KIND_LEGACY: u8 = 1;
/// Kind of handle in an [`IpcDesc`]: VMM memory (cuMemCreate/cuMemMap) whose physical
/// chunks the owner hands out as POSIX fds over a Unix socket ([`VmmDesc`]).
pub const IPC_KIND_VMM_FD: u8 = 2;
pub const IPC_HANDLE_LEN: usize = 64;
/// Most physical chunks one VMM registration may span.
pub const VMM_MAX_CHUNKS: usize = 4096;
/// Longest socket name (an abstract Unix socket name is at most 107 bytes).
pub const VMM_MAX_SOCKET_NAME: usize = 100;

/// How a same-host peer opens the device allocation holding a registration: the device's
/// UUID (ordinals differ between processes), the allocation's range in the owner's address
/// space (the handle maps the whole allocation), and the handle: a legacy IPC handle, or
/// for VMM memory where to fetch each chunk's fd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpcDesc {
    pub kind: u8,
    pub device_uuid: [u8; 16],
    pub alloc_base: u64,
    pub alloc_len: u64,
    /// Kind 1: the driver's handle. Kind 2: zeros (not sent).
    pub handle: [u8; IPC_HANDLE_LEN],
    /// Kind 2 only.
    pub vmm: Option<VmmDesc>,
}

/// VMM memory of a registration: the owner's registration id and socket name (abstract
/// namespace) to ask for chunk fds, and the chunks mapped back to back from `alloc_base`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmmDesc {
    pub reg_id: u64,
    pub socket: Vec<u8>,
    pub chunks: Vec<VmmChunkDesc>,
}

/// One physical chunk: its offset from the allocation base, length, and granularity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmmChunkDesc {
    pub offset: u64,
    pub len: u64,
    pub granularity: u64,
}

impl IpcDesc {
    fn write(&self, w: &mut Writer) {
        w.u8(self.kind).bytes(&self.device_uuid).u64(self.alloc_base).u64(self.alloc_len);
        match &self.vmm {
            Some(v) if self.kind == IPC_KIND_VMM_FD => {
                w.u64(v.reg_id).short(&v.socket).u16(v.chunks.len() as u16);
                for c in &v.chunks {
                    w.u64(c.offset).u64(c.len).u64(c.granularity);
                }
            }
            _ => {
                w.bytes(&self.handle);
            }
        }
    }

    fn read(r: &mut Reader) -> Result<IpcDesc> {
        let kind = r.u8("IPC handle kind")?;
        if kind != IPC_KIND_LEGACY && kind != IPC_KIND_VMM_FD {
            return Err(r.err(format!("unknown IPC handle kind {kind}")));
        }
        let device_uuid: [u8; 16] = r.take(16, "device UUID")?.try_into().expect("16");
        let alloc_base = r.u64("allocation base")?;
        let alloc_len = r.u64("allocation length")?;
        if alloc_base.checked_add(alloc_len).is_none() {
            return Err(r.err("allocation base + length overflows".into()));
        }
        if kind == IPC_KIND_LEGACY {
            let handle: [u8; IPC_HANDLE_LEN] = r.take(IPC_HANDLE_LEN, "IPC handle")?.try_into().expect("64");
            return Ok(IpcDesc { kind, device_uuid, alloc_base, alloc_len, handle, vmm: None });
        }
        let reg_id = r.u64("VMM registration id")?;
        let socket = r.short("VMM socket name", VMM_MAX_SOCKET_NAME)?.to_vec();
        if socket.is_empty() || !socket.iter().all(|b| b.is_ascii_graphic()) {
            return Err(r.err("VMM socket name is empty or not printable ASCII".into()));
        }
        let n = r.u16("VMM chunk count")? as usize;
        if n == 0 || n > VMM_MAX_CHUNKS {
            return Err(r.err(format!("VMM chunk count {n} not in 1..={VMM_MAX_CHUNKS}")));
        }
        let mut chunks = Vec::with_capacity(n);
        let mut next = 0u64;
        for i in 0..n {
            let c = VmmChunkDesc { offset: r.u64("chunk offset")?, len: r.u64("chunk length")?, granularity: r.u64("chunk granularity")? };
            if c.offset != next || c.len == 0 || !c.granularity.is_power_of_two() || !c.offset.is_multiple_of(c.granularity) || !c.len.is_multiple_of(c.granularity) {
                return Err(r.err(format!(
                    "VMM chunk {i} (offset {:#x}, length {:#x}, granularity {:#x}) is not contiguous, empty or not aligned", c.offset, c.len, c.granularity
                )));
            }
            next = c.offset.checked_add(c.len).ok_or_else(|| r.err("VMM chunks overflow".into()))?;
            chunks.push(c);
        }
        if next != alloc_len {
            return Err(r.err(format!("VMM chunks cover {next:#x} bytes, the allocation {alloc_len:#x}")));
        }
        Ok(IpcDesc { kind, device_uuid, alloc_base, alloc_len, handle: [0; IPC_HANDLE_LEN], vmm: Some(VmmDesc { reg_id, socket, chunks }) })
    }

    /// Bytes of the encoded block.
    pub fn encoded_len(&self) -> usize {
        let mut w = Writer::default();
        self.write(&mut w);
        w.0.len()
    }

    /// Whether [addr, addr+len) lies inside the allocation.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.alloc_base && addr.checked_add(len).is_some_and(|e| e <= self.alloc_base + self.alloc_len)
    }
}

impl MemDesc {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        let flags = self.virt_addr as u8 | (self.staged as u8) << 1 | if self.ipc.is_some() { MEM_FLAG_IPC } else { 0 };
        w.bytes(MEM_MAGIC).u16(MEM_VERSION).u8(self.mem_type).u8(flags);
        w.u64(self.engine_id).u64(self.base).u64(self.len).u64(self.dev_id).u16(self.keys.len() as u16);
        for k in &self.keys {
            w.u64(*k);
        }
        if let Some(i) = &self.ipc {
            i.write(&mut w);
        }
        w.0
    }

    pub fn decode(buf: &[u8]) -> Result<MemDesc> {
        let mut r = Reader::new(buf, "memory descriptor");
        r.magic(MEM_MAGIC)?;
        let v = r.u16("version")?;
        if v != MEM_VERSION {
            return Err(Error::Version { what: "memory descriptor", ours: MEM_VERSION, theirs: v });
        }
        let mem_type = r.u8("memory type")?;
        let flags = r.u8("flags")?;
        if flags & !MEM_FLAGS_KNOWN != 0 {
            return Err(Error::Malformed { what: "memory descriptor", why: format!("unknown flags {flags:#x}") });
        }
        let engine_id = r.u64("engine id")?;
        let base = r.u64("base")?;
        let len = r.u64("length")?;
        let dev_id = r.u64("device id")?;
        if base.checked_add(len).is_none() {
            return Err(Error::Malformed { what: "memory descriptor", why: "base + length overflows".into() });
        }
        let n = r.u16("key count")? as usize;
        if n == 0 || n > MAX_RAILS {
            return Err(Error::Malformed { what: "memory descriptor", why: format!("key count {n} not in 1..={MAX_RAILS}") });
        }
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            keys.push(r.u64("key")?);
        }
        let ipc = if flags & MEM_FLAG_IPC != 0 {
            if mem_type != 1 {
                return Err(Error::Malformed { what: "memory descriptor", why: format!("IPC handle on memory type {mem_type} (only VRAM has one)") });
            }
            let i = IpcDesc::read(&mut r)?;
            if !i.contains(base, len) {
                return Err(Error::Malformed { what: "memory descriptor", why: format!(
                    "registration [{base:#x}, +{len}) is not inside its allocation [{:#x}, +{})", i.alloc_base, i.alloc_len
                ) });
            }
            Some(i)
        } else {
            None
        };
        r.finish()?;
        Ok(MemDesc { mem_type, virt_addr: flags & 1 != 0, staged: flags & 2 != 0, engine_id, base, len, dev_id, keys, ipc })
    }
}

/// Control message types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum CtrlType {
    /// First message to a peer: payload is the sender's connection info.
    Hello = 1,
    /// A notification: payload is the user's message.
    Notif = 2,
    /// Stage request: the owner of device memory moves a chunk in or out of it (payload:
    /// [`Stage`]).
    Stage = 3,
    /// The owner's answer to a Stage request (payload: [`StageAck`]).
    StageAck = 4,
    /// "Traffic is coming": keeps the receiver's progress thread polling (no payload).
    Kick = 5,
    /// Copy request: the receiver copies between its host memory and the sender's GPU
    /// allocation, which it opens by IPC (payload: [`CopyReq`]).
    Copy = 6,
    /// The answer to a Copy request (payload: [`StageAck`]'s layout: token and status).
    CopyAck = 7,
    /// A small write carried in the message: the receiver copies its bytes into its host
    /// memory, then takes the notification it may carry (payload: [`Put`]).
    Put = 8,
    /// The answer to a Put once its bytes are in place (payload: [`StageAck`]'s layout).
    PutAck = 9,
    /// The owner's answer to a LEND stage request: the chunk is packed in one of its slots,
    /// which it names for the requester's RMA read (payload: [`StageLent`]).
    StageLent = 10,
    /// The requester read a lent slot (or gave up on it): the owner takes it back (payload:
    /// [`StageLent`]'s lease alone, 8 bytes).
    StageRelease = 11,
}

/// A write carried in a control message: `ranges` of (receiver's address, the key of its
/// registration on rail 0, length), whose bytes follow in order in `data`; the notification
/// the receiver takes once they are in place, if any; and the sender's connection info, so
/// that a receiver whose HELLO from it was lost can still answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Put<'a> {
    pub token: u64,
    pub notif: Option<&'a [u8]>,
    pub intro: &'a [u8],
    pub ranges: Vec<(u64, u64, u32)>,
    pub data: &'a [u8],
}

/// Most ranges a Put carries.
pub const PUT_MAX_RANGES: usize = 4096;

impl<'a> Put<'a> {
    /// Bytes of a Put with `ranges` ranges, `data` bytes, a notification of `notif` bytes
    /// and connection info of `intro` bytes.
    pub const fn encoded_len(ranges: usize, data: usize, notif: usize, intro: usize) -> usize {
        8 + 1 + 4 + notif + 2 + intro + 2 + 20 * ranges + data
    }

    /// Encodes the message, the data read by `fill` into its place (`fill` gets a buffer of
    /// exactly the ranges' bytes).
    pub fn encode_with(token: u64, notif: Option<&[u8]>, intro: &[u8], ranges: &[(u64, u64, u32)], fill: impl FnOnce(&mut [u8])) -> Vec<u8> {
        let data: usize = ranges.iter().map(|r| r.2 as usize).sum();
        let mut w = Writer(Vec::with_capacity(Self::encoded_len(ranges.len(), data, notif.map_or(0, |n| n.len()), intro.len())));
        w.u64(token);
        match notif {
            Some(n) => w.u8(1).u32(n.len() as u32).bytes(n),
            None => w.u8(0),
        };
        w.short(intro);
        w.u16(ranges.len() as u16);
        for &(a, k, n) in ranges {
            w.u64(a).u64(k).u32(n);
        }
        let at = w.0.len();
        w.0.resize(at + data, 0);
        fill(&mut w.0[at..]);
        w.0
    }

    pub fn decode(b: &'a [u8]) -> Result<Put<'a>> {
        let mut r = Reader::new(b, "put");
        let token = r.u64("token")?;
        let notif = match r.u8("notification flag")? {
            0 => None,
            1 => {
                let n = r.u32("notification length")? as usize;
                Some(r.take(n, "notification")?)
            }
            f => return Err(r.err(format!("unknown notification flag {f}"))),
        };
        let intro = r.short("connection info", MAX_CONN_INFO)?;
        let n = r.u16("range count")? as usize;
        if n == 0 || n > PUT_MAX_RANGES {
            return Err(r.err(format!("range count {n} not in 1..={PUT_MAX_RANGES}")));
        }
        let mut ranges = Vec::with_capacity(n);
        let mut total = 0usize;
        for _ in 0..n {
            let (a, k, len) = (r.u64("address")?, r.u64("key")?, r.u32("length")?);
            if a.checked_add(len as u64).is_none() {
                return Err(r.err(format!("range [{a:#x}, +{len}) overflows")));
            }
            total += len as usize;
            ranges.push((a, k, len));
        }
        let data = r.take(total, "data")?;
        r.finish()?;
        Ok(Put { token, notif, intro, ranges, data })
    }
}

/// A copy request to a same-host peer: `ranges` of (sender's address in its allocation,
/// receiver's host address, length); `to_receiver` says which way the bytes go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyReq {
    pub token: u64,
    pub to_receiver: bool,
    pub ipc: IpcDesc,
    pub ranges: Vec<(u64, u64, u64)>,
}

/// Most ranges one copy request carries (its bytes must fit a control buffer).
pub const COPY_MAX_RANGES: usize = 2048;

impl CopyReq {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.token).u8(self.to_receiver as u8);
        self.ipc.write(&mut w);
        w.u16(self.ranges.len() as u16);
        for &(s, r, n) in &self.ranges {
            w.u64(s).u64(r).u64(n);
        }
        w.0
    }

    pub fn decode(b: &[u8]) -> Result<CopyReq> {
        let mut r = Reader::new(b, "copy request");
        let token = r.u64("token")?;
        let to_receiver = match r.u8("direction")? {
            0 => false,
            1 => true,
            d => return Err(r.err(format!("unknown direction {d}"))),
        };
        let ipc = IpcDesc::read(&mut r)?;
        let n = r.u16("range count")? as usize;
        if n == 0 || n > COPY_MAX_RANGES {
            return Err(r.err(format!("range count {n} not in 1..={COPY_MAX_RANGES}")));
        }
        let mut ranges = Vec::with_capacity(n);
        for _ in 0..n {
            let (s, h, len) = (r.u64("sender address")?, r.u64("receiver address")?, r.u64("length")?);
            if !ipc.contains(s, len) || h.checked_add(len).is_none() {
                return Err(r.err(format!("range [{s:#x}, +{len}) is outside the sender's allocation or overflows")));
            }
            ranges.push((s, h, len));
        }
        r.finish()?;
        Ok(CopyReq { token, to_receiver, ipc, ranges })
    }
}

/// Direction of a stage request, seen from the device memory's owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum StageDir {
    /// RMA-read every range from the requester's memory (`peer_addr`, `peer_key`) into one
    /// bounce slot, then scatter it into device memory (one launch).
    Pull = 1,
    /// Gather every range of device memory into one bounce slot (one launch), then
    /// RMA-write each range to the requester's memory.
    Push = 2,
    /// Gather every range into one bounce slot of the owner's (one launch) and lend it: the
    /// answer ([`StageLent`]) names the slot on the chunk's rail pair, the requester
    /// RMA-reads it and then releases it (StageRelease). The ranges' requester addresses
    /// and `peer_key` are not used. Only to peers whose connection info says `lends`.
    Lend = 3,
}

/// Format of a stage request's payload (its first byte). 1 was one range per request,
/// over rail 0; a peer that still speaks it is refused with both versions named.
pub const STAGE_FORMAT: u8 = 2;
/// Most ranges one stage request carries (24 bytes each; the sender also keeps a request
/// within its control buffer).
pub const STAGE_MAX_RANGES: usize = 4096;

/// A packed stage request: one staging chunk of many ranges. Each range is (device address
/// at the owner, the requester's address as its rail `rail` expects it (virtual address or
/// offset), length); the owner posts its RMA on its rail `rrail` toward the requester's
/// rail `rail`, with `peer_key` (the requester's key on that rail).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    pub token: u64,
    pub dir: StageDir,
    pub rail: u16,
    pub rrail: u16,
    pub peer_key: u64,
    pub ranges: Vec<(u64, u64, u64)>,
}

/// The answer to a stage request: its token and a NIXL status code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageAck {
    pub token: u64,
    pub status: i32,
}

impl Stage {
    /// Bytes of a request with `n` ranges.
    pub const fn encoded_len(n: usize) -> usize {
        1 + 8 + 1 + 2 + 2 + 8 + 4 + 24 * n
    }

    /// Bytes the chunk moves.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.2).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(Self::encoded_len(self.ranges.len())));
        w.u8(STAGE_FORMAT).u64(self.token).u8(self.dir as u8).u16(self.rail).u16(self.rrail).u64(self.peer_key);
        w.u32(self.ranges.len() as u32);
        for &(d, p, n) in &self.ranges {
            w.u64(d).u64(p).u64(n);
        }
        w.0
    }

    pub fn decode(b: &[u8]) -> Result<Stage> {
        let mut r = Reader::new(b, "stage request");
        let v = r.u8("format")?;
        if v != STAGE_FORMAT {
            return Err(Error::Version { what: "stage request", ours: STAGE_FORMAT as u16, theirs: v as u16 });
        }
        let token = r.u64("token")?;
        let dir = match r.u8("direction")? {
            1 => StageDir::Pull,
            2 => StageDir::Push,
            3 => StageDir::Lend,
            d => return Err(r.err(format!("unknown direction {d}"))),
        };
        let (rail, rrail, peer_key) = (r.u16("rail")?, r.u16("remote rail")?, r.u64("peer key")?);
        let n = r.u32("range count")? as usize;
        if n == 0 || n > STAGE_MAX_RANGES {
            return Err(r.err(format!("range count {n} not in 1..={STAGE_MAX_RANGES}")));
        }
        let mut ranges = Vec::with_capacity(n);
        let mut total = 0u64;
        for _ in 0..n {
            let (d, p, len) = (r.u64("device address")?, r.u64("peer address")?, r.u64("length")?);
            total = total.checked_add(len).ok_or_else(|| r.err("total length overflows".into()))?;
            if len == 0 || d.checked_add(len).is_none() || p.checked_add(len).is_none() {
                return Err(r.err(format!("range [{d:#x}, +{len}) is empty or address + length overflows")));
            }
            ranges.push((d, p, len));
        }
        r.finish()?;
        Ok(Stage { token, dir, rail, rrail, peer_key, ranges })
    }
}

/// A lent slot: the answer to a LEND stage request `token`. `lease` names it to the owner
/// (StageRelease); the requester reads the chunk's bytes, back to back in range order,
/// from `addr` (as the requester's rail of the chunk expects it: virtual address or offset)
/// with `key` (the owner's key on its rail of the chunk).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageLent {
    pub token: u64,
    pub lease: u64,
    pub addr: u64,
    pub key: u64,
}

impl StageLent {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.token).u64(self.lease).u64(self.addr).u64(self.key);
        w.0
    }
    pub fn decode(b: &[u8]) -> Result<StageLent> {
        let mut r = Reader::new(b, "lent slot");
        let a = StageLent { token: r.u64("token")?, lease: r.u64("lease")?, addr: r.u64("address")?, key: r.u64("key")? };
        r.finish()?;
        Ok(a)
    }
    pub fn encode_release(lease: u64) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(lease);
        w.0
    }
    pub fn decode_release(b: &[u8]) -> Result<u64> {
        let mut r = Reader::new(b, "slot release");
        let lease = r.u64("lease")?;
        r.finish()?;
        Ok(lease)
    }
}

impl StageAck {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.token).u32(self.status as u32);
        w.0
    }
    pub fn decode(b: &[u8]) -> Result<StageAck> {
        let mut r = Reader::new(b, "stage answer");
        let a = StageAck { token: r.u64("token")?, status: r.u32("status")? as i32 };
        r.finish()?;
        Ok(a)
    }
}

/// A decoded control message (borrowing the receive buffer).
#[derive(Debug)]
pub struct Ctrl<'a> {
    pub kind: CtrlType,
    pub sender_id: u64,
    pub sender: &'a str,
    pub payload: &'a [u8],
}

pub const CTRL_HEADER: usize = 2 + 1 + 1 + 8 + 2 + 4;
/// Offset of the type byte in an encoded control message.
pub const CTRL_TYPE_OFFSET: usize = 3;

pub fn encode_ctrl(kind: CtrlType, sender_id: u64, sender: &str, payload: &[u8]) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(CTRL_HEADER + sender.len() + payload.len()));
    w.bytes(CTRL_MAGIC).u8(CTRL_VERSION).u8(kind as u8).u64(sender_id);
    w.u16(sender.len() as u16).u32(payload.len() as u32).bytes(sender.as_bytes()).bytes(payload);
    w.0
}

pub fn decode_ctrl(buf: &[u8]) -> Result<Ctrl<'_>> {
    let mut r = Reader::new(buf, "control message");
    r.magic(CTRL_MAGIC)?;
    let v = r.u8("version")?;
    if v != CTRL_VERSION {
        return Err(Error::Version { what: "control message", ours: CTRL_VERSION as u16, theirs: v as u16 });
    }
    let kind = match r.u8("type")? {
        1 => CtrlType::Hello,
        2 => CtrlType::Notif,
        3 => CtrlType::Stage,
        4 => CtrlType::StageAck,
        5 => CtrlType::Kick,
        6 => CtrlType::Copy,
        7 => CtrlType::CopyAck,
        8 => CtrlType::Put,
        9 => CtrlType::PutAck,
        10 => CtrlType::StageLent,
        11 => CtrlType::StageRelease,
        t => return Err(Error::Malformed { what: "control message", why: format!("unknown type {t}") }),
    };
    let sender_id = r.u64("sender id")?;
    let nlen = r.u16("sender length")? as usize;
    let plen = r.u32("payload length")? as usize;
    let name = r.take(nlen, "sender")?;
    let sender = std::str::from_utf8(name)
        .map_err(|_| Error::Malformed { what: "control message", why: "sender is not UTF-8".into() })?;
    let payload = r.take(plen, "payload")?;
    r.finish()?;
    Ok(Ctrl { kind, sender_id, sender, payload })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> ConnInfo {
        ConnInfo {
            engine_id: 7,
            host_id: [3; 16],
            agent: "a".into(),
            rails: vec![RailAddr { provider: "tcp;ofi_rxm".into(), addr: vec![1, 2, 3] }],
            process: Some(ProcessInfo { pid: 42, token_addr: 0x7f00_0000_1000, token: [9; 16] }),
            rail0_saw: true,
            packed_staging: true,
            eager_write: true, lends: true,
        }
    }

    #[test]
    fn conn_without_process_block_and_unknown_flags() {
        let mut c = conn();
        c.process = None;
        let b = c.encode();
        assert_eq!(ConnInfo::decode(&b).unwrap(), c);
        let mut other = b.clone();
        other[7] = 0x80; // flags, high byte: a bit we do not know
        assert_eq!(ConnInfo::decode(&other).unwrap(), c);
        let mut unordered = b.clone();
        unordered[6] &= !0x02; // flags bit 1: rail 0 orders a send after writes
        assert!(!ConnInfo::decode(&unordered).unwrap().rail0_saw, "an older peer's info says nothing of it");
        let mut unpacked = b.clone();
        unpacked[6] &= !0x04; // flags bit 2: packed staging
        assert!(!ConnInfo::decode(&unpacked).unwrap().packed_staging, "a build before packed staging says nothing of it");
        let mut claims = b.clone();
        claims[6] = 0x01; // says a process block follows, but none does
        assert!(ConnInfo::decode(&claims).is_err());
    }

    #[test]
    fn conn_round_trip_and_truncation() {
        let c = conn();
        let b = c.encode();
        assert_eq!(ConnInfo::decode(&b).unwrap(), c);
        for n in 0..b.len() {
            assert!(ConnInfo::decode(&b[..n]).is_err(), "prefix {n} accepted");
        }
        let mut extra = b.clone();
        extra.push(0);
        assert!(ConnInfo::decode(&extra).is_err());
    }

    #[test]
    fn version_mismatch_names_both() {
        let mut b = conn().encode();
        b[4] = 9;
        let e = ConnInfo::decode(&b).unwrap_err();
        assert!(matches!(e, Error::Version { ours: 1, theirs: 9, .. }));
        assert!(e.to_string().contains("version 9") && e.to_string().contains("version 1"));
    }

    #[test]
    fn mem_round_trip_and_overflow() {
        let m = MemDesc { mem_type: 0, virt_addr: true, staged: true, engine_id: 1, base: 4096, len: 100, dev_id: 0, keys: vec![5, 6], ipc: None };
        let b = m.encode();
        assert_eq!(MemDesc::decode(&b).unwrap(), m);
        for n in 0..b.len() {
            assert!(MemDesc::decode(&b[..n]).is_err());
        }
        let bad = MemDesc { base: u64::MAX, ..m }.encode();
        assert!(MemDesc::decode(&bad).is_err());
    }

    #[test]
    fn mem_ipc_block_round_trip_and_checks() {
        let ipc = IpcDesc { kind: IPC_KIND_LEGACY, device_uuid: [7; 16], alloc_base: 4096, alloc_len: 8192, handle: [9; IPC_HANDLE_LEN], vmm: None };
        let m = MemDesc { mem_type: 1, virt_addr: true, staged: true, engine_id: 1, base: 8192, len: 4096, dev_id: 0, keys: vec![0], ipc: Some(ipc.clone()) };
        let b = m.encode();
        assert_eq!(MemDesc::decode(&b).unwrap(), m);
        for n in 0..b.len() {
            assert!(MemDesc::decode(&b[..n]).is_err(), "truncated at {n}");
        }
        // Outside its allocation, on DRAM, an unknown handle kind, an overflowing range.
        for bad in [
            MemDesc { len: 4097, ..m.clone() },
            MemDesc { mem_type: 0, ..m.clone() },
            MemDesc { ipc: Some(IpcDesc { kind: 3, ..ipc.clone() }), ..m.clone() },
            MemDesc { ipc: Some(IpcDesc { alloc_len: u64::MAX, ..ipc.clone() }), ..m.clone() },
        ] {
            assert!(MemDesc::decode(&bad.encode()).is_err(), "{bad:?}");
        }
        let mut unknown = b.clone();
        unknown[7] |= 8;
        assert!(MemDesc::decode(&unknown).is_err());
    }

    fn vmm_ipc(chunks: &[(u64, u64, u64)]) -> IpcDesc {
        let chunks: Vec<VmmChunkDesc> = chunks.iter().map(|&(offset, len, granularity)| VmmChunkDesc { offset, len, granularity }).collect();
        let alloc_len = chunks.iter().map(|c| c.len).sum();
        IpcDesc {
            kind: IPC_KIND_VMM_FD,
            device_uuid: [5; 16],
            alloc_base: 1 << 30,
            alloc_len,
            handle: [0; IPC_HANDLE_LEN],
            vmm: Some(VmmDesc { reg_id: 77, socket: b"nixl-fabric-fd-1234-abcd".to_vec(), chunks }),
        }
    }

    #[test]
    fn mem_vmm_block_round_trip_and_checks() {
        let g = 2 << 20;
        let ipc = vmm_ipc(&[(0, g, g), (g, 2 * g, g), (3 * g, g, g)]);
        let m = MemDesc { mem_type: 1, virt_addr: true, staged: true, engine_id: 1, base: (1 << 30) + 4096, len: 3 * g, dev_id: 0, keys: vec![0], ipc: Some(ipc.clone()) };
        let b = m.encode();
        assert_eq!(MemDesc::decode(&b).unwrap(), m);
        assert_eq!(ipc.encoded_len(), 1 + 16 + 8 + 8 + 8 + 2 + 24 + 2 + 3 * 24);
        for n in 0..b.len() {
            assert!(MemDesc::decode(&b[..n]).is_err(), "truncated at {n}");
        }
        let with = |f: &dyn Fn(&mut VmmDesc)| {
            let mut i = ipc.clone();
            f(i.vmm.as_mut().unwrap());
            MemDesc { ipc: Some(i), ..m.clone() }
        };
        for bad in [
            with(&|v| v.chunks[1].offset += 4096),              // a gap
            with(&|v| v.chunks[2].len = 0),                     // empty chunk
            with(&|v| v.chunks[0].granularity = 3 << 20),       // not a power of two
            with(&|v| v.chunks[1].granularity = 4 << 20),       // offset not aligned to it
            with(&|v| v.chunks.truncate(2)),                    // do not cover the allocation
            with(&|v| v.socket.clear()),
            with(&|v| v.socket = b"bad name".to_vec()),
            with(&|v| v.socket = vec![b'a'; VMM_MAX_SOCKET_NAME + 1]),
            with(&|v| v.chunks.clear()),
            MemDesc { len: 4 * g, ..m.clone() },                // registration leaves the range
        ] {
            assert!(matches!(MemDesc::decode(&bad.encode()), Err(Error::Malformed { .. })), "{bad:?}");
        }
        // Too many chunks (the count is checked before the chunks are read).
        let many: Vec<(u64, u64, u64)> = (0..VMM_MAX_CHUNKS as u64 + 1).map(|i| (i * 4096, 4096, 4096)).collect();
        let big = MemDesc { base: 1 << 30, len: 4096, ipc: Some(vmm_ipc(&many)), ..m.clone() };
        assert!(MemDesc::decode(&big.encode()).is_err());
        let most: Vec<(u64, u64, u64)> = (0..VMM_MAX_CHUNKS as u64).map(|i| (i * 4096, 4096, 4096)).collect();
        let ok = MemDesc { base: 1 << 30, len: 4096, ipc: Some(vmm_ipc(&most)), ..m.clone() };
        assert_eq!(MemDesc::decode(&ok.encode()).unwrap(), ok);
        // In a copy request too.
        let c = CopyReq { token: 1, to_receiver: false, ipc: ipc.clone(), ranges: vec![((1 << 30) + 8, 99, 64)] };
        assert_eq!(CopyReq::decode(&c.encode()).unwrap(), c);
    }

    #[test]
    fn copy_request_round_trip_and_checks() {
        let ipc = IpcDesc { kind: IPC_KIND_LEGACY, device_uuid: [1; 16], alloc_base: 1 << 20, alloc_len: 1 << 20, handle: [3; IPC_HANDLE_LEN], vmm: None };
        let c = CopyReq { token: 5, to_receiver: true, ipc: ipc.clone(), ranges: vec![(1 << 20, 77, 4096), ((2 << 20) - 1, 9, 1)] };
        let b = c.encode();
        assert_eq!(CopyReq::decode(&b).unwrap(), c);
        for n in 0..b.len() {
            assert!(CopyReq::decode(&b[..n]).is_err());
        }
        for bad in [
            CopyReq { ranges: vec![((2 << 20) - 1, 9, 2)], ..c.clone() },
            CopyReq { ranges: vec![(0, 9, 2)], ..c.clone() },
            CopyReq { ranges: vec![(1 << 20, u64::MAX, 2)], ..c.clone() },
            CopyReq { ranges: vec![], ..c.clone() },
        ] {
            assert!(CopyReq::decode(&bad.encode()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn stage_round_trip() {
        let s = Stage { token: 1, dir: StageDir::Push, rail: 2, rrail: 3, peer_key: 5, ranges: vec![(2, 4, 3), (0x100, 0x200, 4096)] };
        let b = s.encode();
        assert_eq!(b.len(), Stage::encoded_len(2));
        assert_eq!(Stage::decode(&b).unwrap(), s);
        assert_eq!(s.bytes(), 4099);
        for n in 0..b.len() {
            assert!(Stage::decode(&b[..n]).is_err());
        }
        let a = StageAck { token: 9, status: -10 };
        assert_eq!(StageAck::decode(&a.encode()).unwrap(), a);
        let l = StageLent { token: 3, lease: 7, addr: 1 << 40, key: 0xabc };
        assert_eq!(StageLent::decode(&l.encode()).unwrap(), l);
        assert!(StageLent::decode(&l.encode()[..31]).is_err());
        assert_eq!(StageLent::decode_release(&StageLent::encode_release(7)).unwrap(), 7);
        assert!(StageLent::decode_release(&[0; 9]).is_err());
        let lend = Stage { dir: StageDir::Lend, ..s.clone() };
        assert_eq!(Stage::decode(&lend.encode()).unwrap(), lend);
        for bad in [
            Stage { ranges: vec![(u64::MAX, 0, 3)], ..s.clone() },
            Stage { ranges: vec![(0, u64::MAX, 3)], ..s.clone() },
            Stage { ranges: vec![(0, 0, 0)], ..s.clone() },
            Stage { ranges: vec![(0, 0, u64::MAX), (8, 8, 2)], ..s.clone() },
            Stage { ranges: vec![], ..s.clone() },
        ] {
            assert!(Stage::decode(&bad.encode()).is_err(), "{bad:?}");
        }
        let mut old = s.encode();
        old[0] = 1;
        assert!(matches!(Stage::decode(&old), Err(Error::Version { ours: 2, theirs: 1, .. })));
    }

    #[test]
    fn ctrl_round_trip() {
        let b = encode_ctrl(CtrlType::Notif, 9, "init", b"hello");
        let c = decode_ctrl(&b).unwrap();
        assert_eq!((c.kind, c.sender_id, c.sender, c.payload), (CtrlType::Notif, 9, "init", &b"hello"[..]));
        for n in 0..b.len() {
            assert!(decode_ctrl(&b[..n]).is_err());
        }
    }

    #[test]
    fn garbage_never_panics() {
        let mut x: u64 = 0x1234_5678;
        for len in 0..300 {
            let buf: Vec<u8> = (0..len).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 }).collect();
            let _ = ConnInfo::decode(&buf);
            let _ = MemDesc::decode(&buf);
            let _ = decode_ctrl(&buf);
            let _ = Stage::decode(&buf);
            let _ = StageAck::decode(&buf);
        }
    }

    #[test]
    fn a_put_carries_its_bytes_notification_and_introduction_and_refuses_bad_ones() {
        let ranges = [(0x1000, 7, 3), (0x2000, 7, 2)];
        let b = Put::encode_with(42, Some(b"done"), b"info", &ranges, |out| out.copy_from_slice(b"abcde"));
        assert_eq!(b.len(), Put::encoded_len(2, 5, 4, 4));
        let p = Put::decode(&b).unwrap();
        assert_eq!((p.token, p.notif, p.intro, p.ranges.as_slice(), p.data), (42, Some(&b"done"[..]), &b"info"[..], &ranges[..], &b"abcde"[..]));
        let quiet = Put::encode_with(1, None, b"", &ranges[..1], |out| out.copy_from_slice(b"xyz"));
        assert_eq!(Put::decode(&quiet).unwrap().notif, None);
        // Cut short, one byte too many, no ranges, a range past the address space.
        assert!(Put::decode(&b[..b.len() - 1]).is_err());
        assert!(Put::decode(&[b.as_slice(), &[0]].concat()).is_err());
        assert!(Put::decode(&Put::encode_with(1, None, b"", &[], |_| {})).is_err());
        assert!(Put::decode(&Put::encode_with(1, None, b"", &[(u64::MAX - 1, 0, 4)], |_| {})).is_err());
        let mut bad_flag = b.clone();
        bad_flag[8] = 9;
        assert!(Put::decode(&bad_flag).is_err());
    }
}
