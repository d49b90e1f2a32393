//! Loopback: a request whose remote side is our own memory (remote agent = this agent).
//! The bytes are copied here, once, through the CUDA driver where either side is device
//! memory (DESIGN rule 7: a self-transfer completes exactly once).
use super::{Cx, Post, Start, Transport};
use crate::engine::counters::add;
use crate::engine::request::{Op, Route, SegKind};

#[derive(Default)]
pub struct Loopback;

impl Transport for Loopback {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn route(&self) -> Route {
        Route::Loopback
    }

    fn start(&mut self, cx: &mut Cx, post: Post) -> Start {
        let Post { req, at, .. } = post;
        let mut i = at;
        let mut bytes = 0;
        while let Some(s) = req.segs.get(i) {
            let SegKind::Loopback { local, remote } = s.kind else { break };
            let (src, dst) = match req.op {
                Op::Write => (s.local, s.raddr),
                Op::Read => (s.raddr, s.local),
            };
            let (sdev, ddev) = if req.op == Op::Write { (local, remote) } else { (remote, local) };
            // SAFETY: both ranges were bounds-checked at preparation against live
            // registrations that the request keeps alive; `copy` tolerates overlap.
            if let Err(e) = unsafe { crate::engine::gpu::copy(dst, ddev, src, sdev, s.len as usize) } {
                return Start::failed(i - at, 0, e);
            }
            bytes += s.len;
            i += 1;
        }
        let c = &cx.core.counters;
        add(if req.op == Op::Write { &c.bytes_written } else { &c.bytes_read }, bytes);
        Start::went(i - at, 0)
    }

    fn idle(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::request::{Request, Seg, Target};
    use crate::engine::transport::fake::Bench;
    use std::sync::Arc;

    #[test]
    fn loopback_copies_once_in_the_start_and_stops_at_another_route() {
        let mut b = Bench::new(1, false);
        let src = vec![7u8; 8192];
        let mut dst = vec![0u8; 8192];
        let mut segs: Vec<Seg> = (0..2u64).map(|i| Seg { local: src.as_ptr() as u64 + i * 4096, len: 4096, raddr: dst.as_mut_ptr() as u64 + i * 4096, rkey: 0, desc: 0, rail: 0, rrail: 0, kind: SegKind::Loopback { local: None, remote: None } }).collect();
        segs.push(Seg { kind: SegKind::Rma, ..segs[0] });
        let req = Arc::new(Request::new(Op::Write, Target::Local, segs, Vec::new(), Vec::new(), Vec::new()));
        let s = Loopback.start(&mut b.cx(), super::super::Post { req: &req, epoch: 1, at: 0, notif: &mut None, marks: &mut Default::default() });
        assert_eq!((s.segs, s.pieces), (2, 0));
        assert!(s.stop.is_none());
        assert_eq!(dst, src);
    }
}
