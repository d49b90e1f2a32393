//! Staged chunks evened out over the rails (config staging_balance). Chunks of the
//! configured size go round-robin over the route's rail pairs, so a request of 16 of them
//! over five rails puts four on one: that rail carries 1.25x the mean and the request
//! ends when it does. Cut to 20 chunks of 832 KiB every rail carries four. Host memory
//! does not meet this: its many descriptors spread one by one.
use super::types::{Inputs, Plan};
use crate::engine::request::{Route, Target};
use crate::error::Result;
use std::sync::atomic::{AtomicBool, Ordering};

/// Smallest chunk evening out cuts to: below it a chunk's control round trip and device
/// copies weigh more than the rail time it saves.
const MIN_CHUNK: u64 = 256 << 10;
/// Evened chunks are a multiple of this, so that KV blocks of up to 64 KiB stay whole.
const ALIGN: u64 = 64 << 10;
/// A plan whose busiest rail carries at most this many percent of the mean is kept as it is.
const SLACK_PCT: u64 = 105;

/// Staged bytes in all and on the busiest rail pair.
fn load(plan: &Plan) -> (u64, u64) {
    let mut per: Vec<((u16, u16), u64)> = Vec::new();
    let mut total = 0;
    for s in plan.segs.iter().filter(|s| s.kind.route() == Route::Staging) {
        total += s.len;
        match per.iter_mut().find(|(k, _)| *k == (s.rail, s.rrail)) {
            Some((_, b)) => *b += s.len,
            None => per.push(((s.rail, s.rrail), s.len)),
        }
    }
    (total, per.iter().map(|p| p.1).max().unwrap_or(0))
}

/// The chunk size that gives each of `pairs` rail pairs as many chunks of `total` bytes,
/// where it is smaller than `chunk` (None: no smaller size evens them out better).
fn even_chunk(total: u64, chunk: u64, pairs: u64) -> Option<u64> {
    if pairs < 2 || chunk == 0 {
        return None;
    }
    let per_pair = total.div_ceil(chunk).div_ceil(pairs);
    let even = total.div_ceil(pairs * per_pair).next_multiple_of(ALIGN).max(MIN_CHUNK);
    // As many chunks as before are dealt as before: planning again would change nothing.
    (even < chunk && total.div_ceil(even) > total.div_ceil(chunk)).then_some(even)
}

/// `plan`, or the request planned again (`again`, with the chunk size it is given) where
/// that carries less on its busiest rail.
pub(super) fn even_out(inp: &Inputs, target: &Target, plan: Plan, again: impl FnOnce(&Inputs) -> Result<Plan>) -> Plan {
    let Target::Peer(peer) = target else { return plan };
    if !inp.cfg.staging_balance || !plan.sum.staged {
        return plan;
    }
    let pairs = peer.bulk_route(inp.cfg.staging_rail0).len() as u64;
    let (total, busiest) = load(&plan);
    if busiest * 100 * pairs <= total * SLACK_PCT {
        return plan;
    }
    let Some(chunk) = even_chunk(total, inp.chunk(), pairs) else { return plan };
    let evened = match again(&Inputs { staged_chunk: chunk, ..*inp }) {
        Ok(p) => p,
        Err(e) => {
            // The first plan stands: it was good, and this one was only a better spread.
            log::debug!("planning a staged request again with chunks of {chunk} bytes failed ({e}); keeping the first plan");
            return plan;
        }
    };
    let (_, after) = load(&evened);
    // Once a process at INFO, so that a benchmark's log shows the setting took effect; at
    // DEBUG after that (one line a staged request would flood it).
    let level = if TOLD.swap(true, Ordering::Relaxed) { log::Level::Debug } else { log::Level::Info };
    log::log!(level, "staged request of {total} bytes over {pairs} rail pairs: busiest rail {busiest} bytes in chunks of {}, {after} in chunks of {chunk}",
              inp.chunk());
    if after < busiest { evened } else { plan }
}

/// A request was planned again in this process (its line went out at INFO).
static TOLD: AtomicBool = AtomicBool::new(false);

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn sixteen_chunks_over_five_rails_become_twenty() {
        let c = even_chunk(16 * MIB, MIB, 5).unwrap();
        assert_eq!(c, 832 << 10);
        assert_eq!((16 * MIB).div_ceil(c), 20);
    }

    #[test]
    fn sizes_that_already_even_out_or_would_cut_too_small_stay() {
        // Ten chunks over five rails: two each already.
        assert_eq!(even_chunk(10 * MIB, MIB, 5), None);
        // One rail pair: nothing to even.
        assert_eq!(even_chunk(16 * MIB, MIB, 1), None);
        // A small request is not cut below MIN_CHUNK: 512 KiB over five rails becomes two
        // chunks of 256 KiB; 256 KiB or less stays one chunk, so it is not planned again.
        assert_eq!(even_chunk(512 << 10, MIB, 5), Some(MIN_CHUNK));
        assert_eq!(even_chunk(MIN_CHUNK, MIB, 5), None);
        assert_eq!(even_chunk(100 << 10, MIB, 5), None);
        // 2.5 MiB: three chunks on three of five pairs become five of 512 KiB.
        assert_eq!(even_chunk(5 * MIB / 2, MIB, 5), Some(512 << 10));
        // 64 chunks over five rails: 13 each of 1008 KiB (rounded up to 1024 KiB: no gain).
        assert_eq!(even_chunk(64 * MIB, MIB, 5), None);
    }
}
