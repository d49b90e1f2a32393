//! Small writes of our host memory to a peer's host memory over the network rails, carried
//! in a control message (PUT) together with the post's notification: the target checks
//! every range against its own host registrations, copies the bytes in, takes the
//! notification and answers (PUT_ACK); the post ends with that answer. One message each
//! way, where RMA takes the writes, the notification and a flush read with its answer
//! (4 KiB WRITE until notified over tcp: four socket writes a side per round, the stock
//! plugin's two; issue #23).
//!
//! The rules hold by construction. Notification after data (5): it is taken only after
//! every byte of its message is in place, and a message that is refused delivers neither.
//! Done means delivered (6): the answer is sent once the bytes are in the target's memory.
//! A notification not carried by a Put waits for the Puts' answers (the trait's default
//! `notif_follows`: a request with segments of this route does not send it ahead).
//! The scheduler picks this route (SegKind::Put) for a WRITE whose descriptors together are
//! at most `eager_write_bytes`, between host memories, to a peer that takes PUT messages.
use super::slab::Slab;
use super::{Cx, Post, Start, Transport};
use crate::engine::counters::add;
use crate::engine::registry::{LocalMem, MemKind};
use crate::engine::request::{Phase, Request, Route, SegKind};
use crate::engine::wire::{Ctrl, CtrlType, Put, StageAck};
use crate::error::{Error, Result, Status};
use std::sync::Arc;

/// A Put of ours waiting for its answer.
struct Asked {
    req: Arc<Request>,
    epoch: u64,
    bytes: u64,
    peer_id: u64,
    notif: bool,
}

#[derive(Default)]
pub struct Eager {
    asked: Slab<Asked>,
}

impl Eager {
    /// Sends the run of Put segments `at..end` of `req`: one message with the post's
    /// notification where the run is the whole request and one control buffer holds both,
    /// else as many messages as the buffers need, without it (the driver sends it after
    /// their answers). Returns the pieces started.
    fn send(&mut self, cx: &mut Cx, post: &mut Post, end: usize) -> Result<usize> {
        let req = post.req;
        let peer = req.peer().cloned().ok_or_else(|| Error::Backend("eager write without a peer".into()))?;
        let dest = cx.conns.ctrl_addr(peer.id)?;
        let segs = &req.segs[post.at..end];
        let room = cx.ctrl_room;
        let largest = segs.iter().map(|s| s.len as usize).max().unwrap_or(0);
        // Our introduction rides along where a message of the largest segment still fits
        // with it (a connection info of many rails may not; the peer then needs our HELLO).
        let intro: &[u8] = if Put::encoded_len(1, largest, 0, cx.core.conn_info.len()) <= room { &cx.core.conn_info } else { &[] };
        if Put::encoded_len(1, largest, 0, intro.len()) > room {
            return Err(Error::InvalidParam(format!(
                "a {largest}-byte block does not fit a control message ({room} bytes): lower eager_write_bytes or raise max_notif_size")));
        }
        let bytes: usize = segs.iter().map(|s| s.len as usize).sum();
        let whole = post.at == 0 && end == req.segs.len();
        let notif = match post.notif.as_ref() {
            Some(n) if whole && Put::encoded_len(segs.len(), bytes, n.len(), intro.len()) <= room => post.notif.take(),
            _ => None,
        };
        let mut pieces = 0;
        let mut rest = segs;
        while !rest.is_empty() {
            // As many segments as one message holds (all of them, with the defaults).
            let mut take = 0;
            let mut n = 0usize;
            while take < rest.len() && Put::encoded_len(take + 1, n + rest[take].len as usize, notif.as_ref().map_or(0, |m| m.len()), intro.len()) <= room {
                n += rest[take].len as usize;
                take += 1;
            }
            let take = take.max(1);
            let (part, later) = rest.split_at(take);
            rest = later;
            let carried = notif.is_some();
            let ranges: Vec<(u64, u64, u32)> = part.iter().map(|s| (s.raddr, s.rkey, s.len as u32)).collect();
            let n: u64 = part.iter().map(|s| s.len).sum();
            let token = self.asked.insert(Asked { req: req.clone(), epoch: post.epoch, bytes: n, peer_id: peer.id, notif: carried });
            let msg = Put::encode_with(token, notif.as_deref(), intro, &ranges, |out| {
                let mut off = 0;
                for s in part {
                    let len = s.len as usize;
                    // SAFETY: the segment lies in our live host registration, bounds-checked
                    // when the request was prepared and held by it.
                    unsafe { std::ptr::copy_nonoverlapping(s.local as *const u8, out[off..off + len].as_mut_ptr(), len) };
                    off += len;
                }
            });
            cx.ctrl_of(peer.id, dest, CtrlType::Put, &msg, (req.clone(), post.epoch));
            add(&cx.core.counters.ops_posted, 1);
            if carried {
                add(&cx.core.counters.notifs_ordered, 1);
            }
            pieces += 1;
        }
        Ok(pieces)
    }

    /// A peer's Put: its bytes into our host memory, then its notification; answered.
    fn serve(&mut self, cx: &mut Cx, sender_id: u64, sender: &str, payload: &[u8]) {
        let put = match Put::decode(payload) {
            Ok(p) => p,
            Err(e) => {
                // Without a token there is no one to answer: the sender's request times out.
                log::warn!("{}: dropping a put from '{sender}': {e}", cx.core.name);
                return;
            }
        };
        let status = match place(cx, &put) {
            Ok(()) => {
                if let Some(m) = put.notif {
                    add(&cx.core.counters.notifs_received, 1);
                    cx.core.push_notif(sender.to_string(), m.to_vec());
                }
                Status::NF_SUCCESS
            }
            Err(e) => {
                log::error!("{}: put from agent '{sender}': {e}", cx.core.name);
                e.status()
            }
        };
        if !cx.conns.introduced(sender_id) {
            // Its HELLO never came (a send of it failed): the Put introduces it as well.
            let hello = Ctrl { kind: CtrlType::Hello, sender_id, sender, payload: put.intro };
            cx.conns.introduce(&hello, cx.core.host_id, &cx.core.name);
        }
        cx.answer(sender_id, CtrlType::PutAck, put.token, status, "put");
    }

    /// The peer's answer to one of our Puts.
    fn answered(&mut self, cx: &mut Cx, sender: &str, a: StageAck) {
        let Some(asked) = self.asked.remove(a.token) else { return };
        let status = Status::from_code(a.status);
        // (The piece's bytes and operation are counted where it ends, as every transport's.)
        let res = if status == Status::NF_SUCCESS {
            if asked.notif {
                add(&cx.core.counters.notifs_sent, 1);
            }
            Ok(())
        } else {
            Err(Error::Backend(format!("agent '{sender}' refused a write: {}", status.name())))
        };
        cx.piece(asked.req, asked.epoch, asked.bytes, res);
    }
}

/// Checks every range of `put` against our host registrations (the message is untrusted: each
/// must lie in one registration whose rail-0 key it names), then copies the bytes in.
fn place(cx: &Cx, put: &Put) -> Result<()> {
    let mut held: Vec<Arc<LocalMem>> = Vec::with_capacity(put.ranges.len().min(8));
    for &(addr, key, len) in &put.ranges {
        let m = cx.core.view.find(addr, len as u64, MemKind::Dram)
            .filter(|m| m.keys.first() == Some(&key))
            .ok_or_else(|| Error::InvalidParam(format!("[{addr:#x}, +{len}) is not in a host registration of ours with key {key:#x}")))?;
        if !held.iter().any(|x| Arc::ptr_eq(x, &m)) {
            held.push(m);
        }
    }
    let mut off = 0;
    for &(addr, _, len) in &put.ranges {
        let len = len as usize;
        // SAFETY: [addr, +len) lies in a live host registration of ours (checked above, held
        // in `held` until the copy ends); the data is the message's own buffer.
        unsafe { std::ptr::copy_nonoverlapping(put.data[off..off + len].as_ptr(), addr as *mut u8, len) };
        off += len;
    }
    Ok(())
}

impl Transport for Eager {
    fn name(&self) -> &'static str {
        "eager"
    }

    fn route(&self) -> Route {
        Route::Eager
    }

    fn start(&mut self, cx: &mut Cx, mut post: Post) -> Start {
        let end = post.req.run_end(post.at, |k| matches!(k, SegKind::Put));
        match self.send(cx, &mut post, end) {
            Ok(pieces) => Start::went(end - post.at, pieces),
            Err(e) => {
                log::error!("{}: eager write to agent '{}': {e}", cx.core.name, post.req.peer_name());
                Start::failed(0, 0, e)
            }
        }
    }

    fn on_control(&mut self, cx: &mut Cx, msg: &Ctrl<'_>) -> bool {
        match msg.kind {
            CtrlType::Put => self.serve(cx, msg.sender_id, msg.sender, msg.payload),
            CtrlType::PutAck => match StageAck::decode(msg.payload) {
                Ok(a) => self.answered(cx, msg.sender, a),
                Err(e) => log::warn!("{}: dropping a put answer from '{}': {e}", cx.core.name, msg.sender),
            },
            _ => return false,
        }
        true
    }

    /// Puts to a peer that is gone are never answered.
    fn drop_peer(&mut self, cx: &mut Cx, peer_id: u64, _engine_id: u64) {
        for token in self.asked.tokens() {
            if self.asked.get_mut(token).is_some_and(|a| a.peer_id == peer_id) {
                if let Some(a) = self.asked.remove(token) {
                    let e = Error::Disconnected(format!("agent '{}' was disconnected", a.req.peer_name()));
                    cx.piece(a.req, a.epoch, 0, Err(e));
                }
            }
        }
    }

    /// Forgets Puts whose post ended without their answer (it timed out, or was posted
    /// again): an answer that still comes finds nothing. Ends those of a post one of whose
    /// Puts could not be sent (Marks::lost_sends: never answered; which one is not known).
    fn sweep(&mut self, cx: &mut Cx) {
        if self.asked.is_empty() {
            return;
        }
        for token in self.asked.tokens() {
            let Some(a) = self.asked.get_mut(token) else { continue };
            let (stale, failed) = {
                let st = a.req.state();
                (st.epoch != a.epoch || !matches!(st.phase, Phase::Data), st.marks.lost_sends > 0)
            };
            if stale || failed {
                if let (Some(a), false) = (self.asked.remove(token), stale) {
                    cx.piece(a.req, a.epoch, 0, Err(Error::Backend("an eager write of the post could not be sent".into())));
                }
            }
        }
    }

    fn idle(&self) -> bool {
        self.asked.is_empty()
    }
}
