//! Same-process host copies: copied where posted, or by the CMA transport's pool, as the
//! request's host bytes decide.
use super::types::Plan;
use crate::config::Config;
use crate::engine::request::{Seg, SegKind};
use crate::engine::transport::cma::{POOL_MIN_BYTES, THIS_PROCESS};

impl Plan {
    /// The plan with its same-process host copies of the kind `pool` (whose bytes are the
    /// whole request's) settles on.
    pub(super) fn settled(mut self, cfg: &Config, pool: HostPool) -> Plan {
        pool.settle(cfg, &mut self.segs);
        self
    }
}

/// Same-process host copies go to the CMA transport's pool when the request's host bytes
/// reach POOL_MIN_BYTES. That total is known only at the end, so the kind is guessed when
/// the first such descriptor appears (its length times the descriptor count: KV blocks are
/// one size) and corrected by a pass over the segments only where the guess was wrong.
#[derive(Default)]
pub(super) struct HostPool {
    pub(super) guess: Option<bool>,
    pub(super) bytes: u64,
}

impl HostPool {
    pub(super) fn kind(&mut self, cfg: &Config, first_len: u64, count: usize) -> SegKind {
        host_kind(*self.guess.get_or_insert(cfg.cma_copy && first_len.saturating_mul(count as u64) >= POOL_MIN_BYTES))
    }

    pub(super) fn settle(&self, cfg: &Config, segs: &mut [Seg]) {
        let Some(guess) = self.guess else { return };
        let pooled = cfg.cma_copy && self.bytes >= POOL_MIN_BYTES;
        if pooled == guess {
            return;
        }
        let kind = host_kind(pooled);
        for s in segs.iter_mut().filter(|s| same_process_host(&s.kind)) {
            s.kind = kind;
        }
    }
}

/// Host memory of two engines of this process, copied where it is posted.
const HOST_DIRECT: SegKind = SegKind::Direct { ctx: None, dev: false };

/// The kind of a same-process host copy: pooled by CMA's copy threads, or copied where posted.
fn host_kind(pooled: bool) -> SegKind {
    if pooled { SegKind::Cma { pid: THIS_PROCESS } } else { HOST_DIRECT }
}

/// Host memory of two engines of this process, copied where it is posted (HOST_DIRECT) or
/// by the CMA pool (only HostPool makes that kind with THIS_PROCESS).
pub(super) fn same_process_host(kind: &SegKind) -> bool {
    matches!(kind, SegKind::Direct { ctx: None, dev: false } | SegKind::Cma { pid: THIS_PROCESS })
}
