//! The control channel on rail 0: pre-posted receive buffers, a pool of send buffers, and
//! the queue of messages waiting for one. Control messages carry handshakes, kicks,
//! notifications and the transports' requests to peers (stage, copy) and their answers.
use super::ops::{OpKind, OpPool};
use super::port::{Mr, Port};
use super::request::Request;
use crate::error::{Error, Result};
use crate::fabric::{FiAddr, Posted};
use std::collections::VecDeque;
use std::sync::Arc;

/// A control message waiting to be sent: to `dest` (peer `peer_id`, 0 for an initiator
/// that is no peer of ours), completing the notification phase of `req` where given.
pub struct CtrlOut {
    pub peer_id: u64,
    pub dest: FiAddr,
    pub bytes: Vec<u8>,
    pub req: Option<(Arc<Request>, u64)>,
}

/// Send buffers: enough for a burst of notifications and transport requests; more wait in
/// the queue.
const SEND_BUFFERS: usize = 32;

/// What a send that finished or failed was for: a request's notification phase to complete.
pub type SendDone = Option<(Arc<Request>, u64)>;

pub struct CtrlChannel {
    // Field order is drop order: the MRs close before the buffers they register go.
    recv_mr: Mr,
    send_mr: Mr,
    recv: Box<[u8]>,
    send: Box<[u8]>,
    pub size: usize,
    send_free: Vec<u32>,
    pub queue: VecDeque<CtrlOut>,
}

impl CtrlChannel {
    /// Buffers of `size` bytes: `nrecv` receives, registered on `rail0`.
    pub fn new(rail0: &dyn Port, size: usize, nrecv: usize) -> Result<CtrlChannel> {
        let recv = vec![0u8; size * nrecv].into_boxed_slice();
        let send = vec![0u8; size * SEND_BUFFERS].into_boxed_slice();
        // SAFETY: both buffers are owned by the channel, whose MRs are dropped before them.
        let recv_mr = unsafe { rail0.register(recv.as_ptr(), recv.len(), 1, None) }?;
        // SAFETY: as above.
        let send_mr = unsafe { rail0.register(send.as_ptr(), send.len(), 2, None) }?;
        Ok(CtrlChannel {
            size,
            recv,
            send,
            send_free: (0..SEND_BUFFERS as u32).rev().collect(),
            queue: VecDeque::new(),
            recv_mr,
            send_mr,
        })
    }

    /// Posts receive buffer `buf` once. Again: the queue is full now (the caller retries
    /// after reading completions).
    pub fn post_recv(&mut self, rail0: &dyn Port, ops: &mut OpPool, buf: u32) -> Result<Posted> {
        // SAFETY: buf < nrecv, so the offset stays inside the receive buffers.
        let ptr = unsafe { self.recv.as_mut_ptr().add(buf as usize * self.size) };
        let ctx = ops.alloc(OpKind::Recv { buf });
        // SAFETY: the buffer belongs to the channel, which lives as long as the rail's
        // endpoint is open (the driver drops the rails' users first); ctx is a live slot.
        let r = unsafe { rail0.recv(ptr, self.size, self.recv_mr.desc, ctx) };
        if !matches!(r, Ok(Posted::Ok)) {
            ops.release(ctx);
        }
        r
    }

    /// The bytes a completed receive left in buffer `buf`.
    pub fn received(&self, buf: u32, len: usize) -> &[u8] {
        let start = (buf as usize * self.size).min(self.recv.len());
        let end = (start + len.min(self.size)).min(self.recv.len());
        &self.recv[start..end]
    }

    pub fn queue(&mut self, m: CtrlOut) -> Result<()> {
        if m.bytes.len() > self.size {
            return Err(Error::InvalidParam(format!("control message of {} bytes exceeds {}", m.bytes.len(), self.size)));
        }
        self.queue.push_back(m);
        Ok(())
    }

    /// Sends queued messages while send buffers are free. Returns the requests whose
    /// notification failed to post (to fail), and whether the provider pushed back.
    pub fn flush(&mut self, rail0: &dyn Port, ops: &mut OpPool, notif_type: u8, type_offset: usize) -> (Vec<(SendDone, Error)>, bool) {
        let mut failed = Vec::new();
        let mut again = false;
        while let Some(m) = self.queue.front() {
            let Some(buf) = self.send_free.pop() else { break };
            let len = m.bytes.len();
            // SAFETY: buf < SEND_BUFFERS and len <= size (checked when queued).
            let ptr = unsafe { self.send.as_mut_ptr().add(buf as usize * self.size) };
            // SAFETY: as above; the message and the buffer do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(m.bytes.as_ptr(), ptr, len) };
            let notif = m.bytes.get(type_offset) == Some(&notif_type);
            let ctx = ops.alloc(OpKind::Send { buf, req: m.req.clone(), notif });
            // SAFETY: the send buffer is held (not in send_free) until the send completes;
            // ctx is a live slot.
            match unsafe { rail0.send(ptr, len, self.send_mr.desc, m.dest, ctx) } {
                Ok(Posted::Ok) => {
                    self.queue.pop_front();
                }
                Ok(Posted::Again) => {
                    ops.release(ctx);
                    self.send_free.push(buf);
                    again = true;
                    break;
                }
                Err(e) => {
                    ops.release(ctx);
                    self.send_free.push(buf);
                    if let Some(m) = self.queue.pop_front() {
                        failed.push((m.req, e));
                    }
                }
            }
        }
        (failed, again)
    }

    /// A send completed: its buffer is free again.
    pub fn sent(&mut self, buf: u32) {
        self.send_free.push(buf);
    }

    /// Room for a control message's payload (the buffers' size less header and our name).
    pub fn payload_room(&self, header: usize, name_len: usize) -> usize {
        self.size.saturating_sub(header + name_len)
    }
}
