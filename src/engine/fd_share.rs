//! Passing the file descriptors of VMM chunks (GPU memory from cuMemCreate) to same-host
//! peers over a Unix domain socket with SCM_RIGHTS.
//!
//! Why a socket and not pidfd_getfd(2): taking an fd out of another process with
//! pidfd_getfd needs PTRACE_MODE_ATTACH over it, which Yama's ptrace_scope=1 (the default
//! on Ubuntu, and on our GPU host) refuses between unrelated processes, exactly like CMA.
//! A socket needs no such permission: the owner decides what it hands out, to whom.
//!
//! The owner engine listens on an abstract-namespace socket (no file to clean up, gone
//! with the process) named after its engine id and a random part, published in the IPC
//! block of each VMM registration's memory descriptor. A peer connects and asks, one
//! request per chunk, for (registration id, chunk index); the owner answers with a status
//! and, on success, the chunk's fd (cuMemExportToShareableHandle, exported on demand and
//! closed once sent, so an owner does not hold an fd per chunk of every registration).
//! Only a peer of our own uid (SO_PEERCRED) is served, and only chunks of registrations
//! that are registered now.
//!
//! Served by a small dedicated thread, not by the progress pass: a target engine that only
//! receives (progress thread off, the application not calling into it while the initiator
//! opens its memory) must still answer, and the progress pass stays free of socket calls.
//! The thread blocks only in poll (100 ms, then it checks for shutdown) and on a
//! connection with per-call timeouts and an overall deadline (DESIGN rule 2); it touches
//! CUDA only to export an fd, under the registration's context, pushed for the call.
//! The peer side ([`fetch`]) is bounded the same way.
use crate::cuda;
use crate::error::{Error, Result};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::sockopt::socket_peercred;
use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use rustix::process::geteuid;
use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"NFFD";
const VERSION: u8 = 1;
const OP_GET_CHUNK: u8 = 1;
/// Request: magic, version, op, 2 spare bytes, u64 registration id, u32 chunk index.
const REQ_LEN: usize = 20;
/// Reply: magic, version, status, 2 spare bytes, u64 chunk length; the fd rides along.
const REP_LEN: usize = 16;

/// Reply status codes.
const ST_OK: u8 = 0;
const ST_UNKNOWN_REG: u8 = 1;
const ST_BAD_CHUNK: u8 = 2;
const ST_EXPORT_FAILED: u8 = 3;
const ST_DENIED: u8 = 4;
const ST_MALFORMED: u8 = 5;

fn status_text(s: u8) -> &'static str {
    match s {
        ST_UNKNOWN_REG => "the registration is not registered there (any more)",
        ST_BAD_CHUNK => "no such chunk in the registration",
        ST_EXPORT_FAILED => "the owner could not export the chunk",
        ST_DENIED => "the owner refuses a process of another user",
        ST_MALFORMED => "the owner did not understand the request",
        _ => "unknown status",
    }
}

/// How long the server gives one connection, and each read or write on it.
const SERVE_DEADLINE: Duration = Duration::from_secs(5);
const SERVE_IO_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the server thread looks at its stop flag.
const POLL_MS: u64 = 100;
const POLL_TIMEOUT: Timespec = Timespec { tv_sec: 0, tv_nsec: POLL_MS as i64 * 1_000_000 };

/// One exported registration: the context its chunks are exported under and the address
/// of each chunk's mapping in this process.
struct Exported {
    ctx: cuda::Context,
    chunks: Vec<(u64, u64)>,
}

/// The owner's side: the socket, its thread (started at the first VMM registration) and
/// the registrations whose chunks may be handed out.
pub struct FdServer {
    engine_id: u64,
    regs: Arc<Mutex<HashMap<u64, Exported>>>,
    stop: Arc<AtomicBool>,
    running: Mutex<Option<(Vec<u8>, JoinHandle<()>)>>,
}

impl FdServer {
    pub fn new(engine_id: u64) -> FdServer {
        FdServer { engine_id, regs: Arc::default(), stop: Arc::default(), running: Mutex::new(None) }
    }

    /// The socket's name (abstract namespace, without the leading NUL), starting the
    /// server on first use.
    pub fn name(&self, name_hint: &str) -> Result<Vec<u8>> {
        let mut g = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((n, _)) = g.as_ref() {
            return Ok(n.clone());
        }
        if self.stop.load(Ordering::Acquire) {
            return Err(Error::NotAllowed("engine is shut down".into()));
        }
        let name = format!("nixl-fabric-fd-{:016x}-{:016x}", self.engine_id, super::ids::random_u64()).into_bytes();
        let addr = SocketAddr::from_abstract_name(&name).map_err(|e| Error::Backend(format!("socket name: {e}")))?;
        let l = UnixListener::bind_addr(&addr).map_err(|e| Error::Backend(format!("bind of the fd socket: {e}")))?;
        l.set_nonblocking(true).map_err(|e| Error::Backend(format!("fd socket: {e}")))?;
        let (regs, stop) = (self.regs.clone(), self.stop.clone());
        let who = name_hint.to_string();
        let t = std::thread::Builder::new()
            .name("nixl-fabric-fd".into())
            .spawn(move || serve_loop(l, regs, stop, who))
            .map_err(|e| Error::Backend(format!("cannot start the fd thread: {e}")))?;
        *g = Some((name.clone(), t));
        Ok(name)
    }

    /// Allows chunks `chunks` ((address, length) of each mapping) of registration `reg_id`
    /// to be handed out, exported under `ctx`.
    pub fn add(&self, reg_id: u64, ctx: cuda::Context, chunks: Vec<(u64, u64)>) {
        self.regs.lock().unwrap_or_else(|p| p.into_inner()).insert(reg_id, Exported { ctx, chunks });
    }

    /// The registration is gone: its chunks are not handed out any more.
    pub fn remove(&self, reg_id: u64) {
        self.regs.lock().unwrap_or_else(|p| p.into_inner()).remove(&reg_id);
    }

    /// Stops the thread (within its poll interval, or a connection's deadline).
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some((_, t)) = self.running.lock().unwrap_or_else(|p| p.into_inner()).take() {
            if t.join().is_err() {
                log::error!("the fd socket thread panicked");
            }
        }
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn serve_loop(l: UnixListener, regs: Arc<Mutex<HashMap<u64, Exported>>>, stop: Arc<AtomicBool>, who: String) {
    while !stop.load(Ordering::Acquire) {
        let mut p = [PollFd::new(&l, PollFlags::IN)];
        if !matches!(poll(&mut p, Some(&POLL_TIMEOUT)), Ok(n) if n > 0) {
            continue;
        }
        match l.accept() {
            Ok((s, _)) => {
                if let Err(e) = serve_one(s, &regs, &stop) {
                    log::debug!("{who}: fd socket: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => {
                log::warn!("{who}: fd socket accept: {e}");
                std::thread::sleep(Duration::from_millis(POLL_MS));
            }
        }
    }
}

/// The uid of the process at the other end of `s` (SO_PEERCRED).
fn peer_uid(s: &UnixStream) -> std::io::Result<u32> {
    Ok(socket_peercred(s)?.uid.as_raw())
}

fn my_uid() -> u32 {
    geteuid().as_raw()
}

fn reply(status: u8, len: u64) -> [u8; REP_LEN] {
    let mut r = [0u8; REP_LEN];
    r[..4].copy_from_slice(MAGIC);
    r[4] = VERSION;
    r[5] = status;
    r[8..16].copy_from_slice(&len.to_le_bytes());
    r
}

fn serve_one(mut s: UnixStream, regs: &Mutex<HashMap<u64, Exported>>, stop: &AtomicBool) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(SERVE_IO_TIMEOUT))?;
    s.set_write_timeout(Some(SERVE_IO_TIMEOUT))?;
    if peer_uid(&s)? != my_uid() {
        return s.write_all(&reply(ST_DENIED, 0));
    }
    let end = Instant::now() + SERVE_DEADLINE;
    let mut req = [0u8; REQ_LEN];
    while Instant::now() < end && !stop.load(Ordering::Acquire) {
        match s.read_exact(&mut req) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        if &req[..4] != MAGIC || req[4] != VERSION || req[5] != OP_GET_CHUNK {
            return s.write_all(&reply(ST_MALFORMED, 0));
        }
        let reg = u64::from_le_bytes(req[8..16].try_into().unwrap_or([0; 8]));
        let idx = u32::from_le_bytes(req[16..20].try_into().unwrap_or([0; 4])) as usize;
        // The lock is held while exporting, so a deregistration waits for (and is not
        // overtaken by) an export in progress.
        let out = {
            let g = regs.lock().unwrap_or_else(|p| p.into_inner());
            match g.get(&reg) {
                None => Err(ST_UNKNOWN_REG),
                Some(x) => match x.chunks.get(idx) {
                    None => Err(ST_BAD_CHUNK),
                    Some(&(addr, len)) => cuda::Driver::get()
                        .and_then(|d| d.vmm_export_fd(&x.ctx, addr))
                        .map(|fd| (fd, len))
                        .map_err(|e| {
                            log::info!("exporting the VMM chunk at {addr:#x} for a peer: {e}");
                            ST_EXPORT_FAILED
                        }),
                },
            }
        };
        match out {
            Ok((fd, len)) => send_with_fd(&s, &reply(ST_OK, len), fd.as_fd())?,
            Err(st) => s.write_all(&reply(st, 0))?,
        }
    }
    Ok(())
}

/// Sends `bytes` with `fd` attached (SCM_RIGHTS); the kernel gives the peer its own copy.
fn send_with_fd(s: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !cmsg.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for the fd in the control buffer"));
    }
    let n = sendmsg(s, &[IoSlice::new(bytes)], &mut cmsg, SendFlags::NOSIGNAL)?;
    if n < bytes.len() {
        (&*s).write_all(&bytes[n..])?;
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes and at most one fd sent with them.
fn recv_with_fd(s: &UnixStream, buf: &mut [u8]) -> std::io::Result<Option<OwnedFd>> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    // MSG_CMSG_CLOEXEC marks a received fd close-on-exec.
    let r = recvmsg(s, &mut [IoSliceMut::new(buf)], &mut cmsg, RecvFlags::CMSG_CLOEXEC)?;
    if r.bytes == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    // Every fd received is owned as it comes out of the buffer, so none leaks even if more
    // than one came (the rest are closed when dropped).
    let mut fd = None;
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for owned in fds {
                if fd.is_none() {
                    fd = Some(owned);
                }
            }
        }
    }
    if r.flags.contains(ReturnFlags::CTRUNC) {
        return Err(std::io::Error::other("file descriptor truncated (too many fds open?)"));
    }
    if r.bytes < buf.len() {
        (&*s).read_exact(&mut buf[r.bytes..])?;
    }
    Ok(fd)
}

/// The peer's side: fetches the fd of every chunk of registration `reg_id` from the owner's
/// socket `name`, in order; `lens` are the chunk lengths the descriptor announced (the
/// owner's answer must agree). Bounded by `timeout` as a whole.
pub fn fetch(name: &[u8], reg_id: u64, lens: &[u64], timeout: Duration) -> Result<Vec<OwnedFd>> {
    let err = |what: &str, e: std::io::Error| Error::Backend(format!("fd socket: {what}: {e}"));
    let addr = SocketAddr::from_abstract_name(name).map_err(|e| err("name", e))?;
    let s = UnixStream::connect_addr(&addr).map_err(|e| err("connect", e))?;
    let io = timeout.min(Duration::from_secs(5)).max(Duration::from_millis(100));
    s.set_read_timeout(Some(io)).map_err(|e| err("timeout", e))?;
    s.set_write_timeout(Some(io)).map_err(|e| err("timeout", e))?;
    let uid = peer_uid(&s).map_err(|e| err("SO_PEERCRED", e))?;
    if uid != my_uid() {
        return Err(Error::NotAllowed(format!("the fd socket belongs to uid {uid}, not ours ({})", my_uid())));
    }
    let end = Instant::now() + timeout;
    let mut out = Vec::with_capacity(lens.len());
    for (i, &want) in lens.iter().enumerate() {
        if Instant::now() > end {
            return Err(Error::Timeout(format!("fd socket: {} of {} chunk fds within {timeout:?}", out.len(), lens.len())));
        }
        let mut req = [0u8; REQ_LEN];
        req[..4].copy_from_slice(MAGIC);
        req[4] = VERSION;
        req[5] = OP_GET_CHUNK;
        req[8..16].copy_from_slice(&reg_id.to_le_bytes());
        req[16..20].copy_from_slice(&(i as u32).to_le_bytes());
        (&s).write_all(&req).map_err(|e| err("send", e))?;
        let mut rep = [0u8; REP_LEN];
        let fd = recv_with_fd(&s, &mut rep).map_err(|e| err("receive", e))?;
        if &rep[..4] != MAGIC || rep[4] != VERSION {
            return Err(Error::Malformed { what: "fd socket reply", why: "bad magic or version".into() });
        }
        if rep[5] != ST_OK {
            return Err(Error::Backend(format!("chunk {i}: {}", status_text(rep[5]))));
        }
        let len = u64::from_le_bytes(rep[8..16].try_into().unwrap_or([0; 8]));
        let fd = fd.ok_or_else(|| Error::Backend(format!("chunk {i}: the reply carried no fd")))?;
        if len != want {
            return Err(Error::Malformed { what: "fd socket reply", why: format!("chunk {i} is {len} bytes, the descriptor says {want}") });
        }
        out.push(fd);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn unknown_registration_and_chunk_are_refused_and_fds_pass() {
        let srv = FdServer::new(0x1234);
        let name = srv.name("test").unwrap();
        // Nothing registered: an error reply, not a hang.
        let e = fetch(&name, 9, &[4096], Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("not registered"), "{e}");
        // A registration without that chunk (no chunk is exported, so no CUDA call is
        // made with this stand-in context handle).
        // SAFETY: the handle is never passed to the driver here (the chunk list is empty).
        let fake = unsafe { cuda::Context::from_raw(8 as *mut std::ffi::c_void) }.unwrap();
        srv.add(9, fake, vec![]);
        let e = fetch(&name, 9, &[4096], Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("no such chunk"), "{e}");
        srv.remove(9);
        let e = fetch(&name, 9, &[4096], Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("not registered"), "{e}");
        // A socket nobody listens on: refused at once.
        assert!(fetch(b"nixl-fabric-fd-nobody-here", 1, &[1], Duration::from_secs(1)).is_err());
        // The fd passing itself.
        let (a, b) = UnixStream::pair().unwrap();
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        send_with_fd(&a, &reply(ST_OK, 7), f.as_fd()).unwrap();
        let mut rep = [0u8; REP_LEN];
        let got = recv_with_fd(&b, &mut rep).unwrap().expect("an fd");
        assert_ne!(got.as_raw_fd(), f.as_raw_fd());
        assert_eq!(rep[5], ST_OK);
        let t0 = Instant::now();
        srv.shutdown();
        assert!(t0.elapsed() < Duration::from_secs(2));
    }
}
