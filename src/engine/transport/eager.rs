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
//!
//! Answers owed (progress thread off). The target's answer used to go out in the pass that
//! took the notification, before getNotifs returned it: over tcp a socket write on the
//! target's way to its notification (on lo or a veth it runs the receive path too, ~4 us of
//! a 4 KiB ping-pong's 16-18). Without a progress thread an answer to a Put that carried a
//! notification is now owed instead: it rides in our next Put to that peer (CONN_FLAG_PUT_ACKS;
//! a target that writes back, as a ping-pong or a request/response does, sends one message
//! where it sent two), or goes on its own in the next pass of any later call. That keeps
//! done-means-delivered (6): the answer still follows the bytes. What it costs: the
//! initiator's DONE waits for the target's next call into the plugin, as its flush reads'
//! answers and every tcp transfer to a target without a progress thread already do; the
//! engine's teardown (its last passes) and our disconnect of the peer send what is owed. A
//! Put of ours that cannot be sent fails its own post and loses the answers it carried: the
//! peer's posts they answer fail at its timeout, as after a lost PUT_ACK.
use super::slab::Slab;
use super::{Cx, Post, Start, Transport};
use crate::engine::counters::add;
use crate::engine::registry::{LocalMem, MemKind};
use crate::engine::request::{Phase, Request, Route, SegKind};
use crate::engine::wire::{Ctrl, CtrlType, Put, StageAck, PUT_MAX_ACKS};
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

/// An answer to a peer's Put that waits for a message to carry it (module comment).
struct Owed {
    /// The peer's engine id.
    engine: u64,
    token: u64,
    status: Status,
    /// Owed since this pass: it may go on its own from the next one.
    fresh: bool,
}

#[derive(Default)]
pub struct Eager {
    asked: Slab<Asked>,
    owed: Vec<Owed>,
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
        let intro: &[u8] = if Put::encoded_len(1, largest, 0, cx.core.conn_info.len(), 0) <= room { &cx.core.conn_info } else { &[] };
        if Put::encoded_len(1, largest, 0, intro.len(), 0) > room {
            return Err(Error::InvalidParam(format!(
                "a {largest}-byte block does not fit a control message ({room} bytes): lower eager_write_bytes or raise max_notif_size")));
        }
        let bytes: usize = segs.iter().map(|s| s.len as usize).sum();
        let whole = post.at == 0 && end == req.segs.len();
        let notif = match post.notif.as_ref() {
            Some(n) if whole && Put::encoded_len(segs.len(), bytes, n.len(), intro.len(), 0) <= room => post.notif.take(),
            _ => None,
        };
        // Answers we owe the peer ride in the first message where they fit beside the whole run.
        let mut acks = if peer.info.put_acks { self.owed_to(peer.info.engine_id) } else { Vec::new() };
        let notif_len = notif.as_ref().map_or(0, |m| m.len());
        if !acks.is_empty() && Put::encoded_len(segs.len(), bytes, notif_len, intro.len(), acks.len()) > room {
            self.owe_again(peer.info.engine_id, std::mem::take(&mut acks));
        }
        let mut pieces = 0;
        let mut rest = segs;
        while !rest.is_empty() {
            // As many segments as one message holds (all of them, with the defaults).
            let mut take = 0;
            let mut n = 0usize;
            while take < rest.len() && Put::encoded_len(take + 1, n + rest[take].len as usize, notif_len, intro.len(), acks.len()) <= room {
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
            let carried_acks = std::mem::take(&mut acks);
            let msg = Put::encode_with(token, notif.as_deref(), &carried_acks, intro, &ranges, |out| {
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
            add(&cx.core.counters.acks_carried, carried_acks.len() as u64);
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
        // Its answers to our earlier Puts first: they name posts of ours, not this one.
        for &(token, status) in &put.acks {
            self.answered(cx, sender, StageAck { token, status });
        }
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
        if put.notif.is_some() && status == Status::NF_SUCCESS && !cx.core.cfg.progress_thread && cx.core.cfg.owe_put_answers {
            self.owed.push(Owed { engine: sender_id, token: put.token, status, fresh: true });
        } else {
            cx.answer(sender_id, CtrlType::PutAck, put.token, status, "put");
        }
    }

    /// Takes the answers owed to engine `engine`, at most PUT_MAX_ACKS.
    fn owed_to(&mut self, engine: u64) -> Vec<(u64, i32)> {
        let mut out = Vec::new();
        self.owed.retain(|o| {
            if o.engine != engine || out.len() >= PUT_MAX_ACKS {
                return true;
            }
            out.push((o.token, o.status.code()));
            false
        });
        out
    }

    fn owe_again(&mut self, engine: u64, acks: Vec<(u64, i32)>) {
        self.owed.extend(acks.into_iter().map(|(token, st)| Owed { engine, token, status: Status::from_code(st), fresh: false }));
    }

    /// Sends on their own the answers owed since an earlier pass.
    fn pay(&mut self, cx: &mut Cx) {
        for o in std::mem::take(&mut self.owed) {
            if o.fresh {
                self.owed.push(Owed { fresh: false, ..o });
            } else {
                cx.answer(o.engine, CtrlType::PutAck, o.token, o.status, "put");
            }
        }
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

    /// Answers owed since an earlier pass go on their own (module comment).
    fn advance(&mut self, cx: &mut Cx) -> bool {
        if !self.owed.is_empty() {
            self.pay(cx);
        }
        !self.owed.is_empty()
    }

    /// Answers owed to a peer that we disconnect go while its address is still known.
    fn peer_leaving(&mut self, cx: &mut Cx, engine_id: u64) {
        if self.owed.iter().any(|o| o.engine == engine_id) {
            let (now, later): (Vec<Owed>, Vec<Owed>) = std::mem::take(&mut self.owed).into_iter().partition(|o| o.engine == engine_id);
            self.owed = later;
            for o in now {
                cx.answer(o.engine, CtrlType::PutAck, o.token, o.status, "put");
            }
        }
    }

    /// Puts to a peer that is gone are never answered; nor are its own.
    fn drop_peer(&mut self, cx: &mut Cx, peer_id: u64, engine_id: u64) {
        self.owed.retain(|o| o.engine != engine_id);
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
        self.asked.is_empty() && self.owed.is_empty()
    }
}
