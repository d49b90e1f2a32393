//! Device copies for the direct transport: per context, a few streams, the gather-copy
//! kernel where it runs, and the driver's batch copy where it has one. Queues copies and
//! returns the events that complete after them.
use crate::cuda;
use crate::engine::core::Core;
use crate::engine::counters::add;
use crate::error::Result;
use std::collections::HashMap;

/// Streams per context that single copies are spread over where the driver has no batch
/// copy: small copies of one descriptor each then overlap on the copy engines.
const FALLBACK_STREAMS: usize = 4;
/// Device ranges longer than this go to the copy engines even in a many-range request: one
/// long range copies as fast there, and would leave most of a shared launch's CTAs idle.
const KERNEL_MAX_RANGE: usize = 4 << 20;
/// Fewest ranges worth a launch of their own when a request is spread over the streams.
const KERNEL_MIN_GROUP: usize = 64;

/// One copy: (destination, source, length).
pub type Copy = (u64, u64, usize);

#[derive(Default)]
pub struct Copier {
    streams: HashMap<usize, Vec<cuda::Stream>>,
    /// The gather-copy kernel per context (None: it cannot run there; not tried again).
    kernels: HashMap<usize, Option<cuda::CopyKernel>>,
    /// The driver refused a batch copy once: not asked again.
    batch_off: bool,
    logged: bool,
}

/// Merges copies whose source and destination both continue where the previous ended (KV
/// blocks laid out back to back on both sides).
///
/// In place: a post of the vLLM pattern coalesces 65,536 ranges, and a second list of them
/// was one more allocation and pass on the progress thread before the first launch.
pub fn coalesce(copies: &mut Vec<Copy>) {
    let mut kept = 0;
    for i in 0..copies.len() {
        let (d, s, n) = copies[i];
        if kept > 0 {
            let last = &mut copies[kept - 1];
            if continues(last, &(d, s, n)) {
                last.2 += n;
                continue;
            }
        }
        copies[kept] = (d, s, n);
        kept += 1;
    }
    copies.truncate(kept);
}

/// Whether `next` starts where `last` ends, on both sides.
fn continues(last: &Copy, next: &Copy) -> bool {
    last.0 + last.2 as u64 == next.0 && last.1 + last.2 as u64 == next.1
}

impl Copier {
    fn ensure_streams(&mut self, ctx: cuda::Context) -> Result<()> {
        if let std::collections::hash_map::Entry::Vacant(e) = self.streams.entry(ctx.id()) {
            let mut v = Vec::with_capacity(FALLBACK_STREAMS);
            for _ in 0..FALLBACK_STREAMS {
                v.push(cuda::Stream::new(&ctx)?);
            }
            e.insert(v);
        }
        Ok(())
    }

    /// Makes `ctx`'s streams and, where enabled, loads its gather kernel now.
    pub fn warm(&mut self, core: &Core, ctx: cuda::Context) -> Result<()> {
        self.ensure_streams(ctx)?;
        if core.cfg.gpu_copy_kernel {
            self.kernel(core, ctx);
        }
        Ok(())
    }

    /// The gather kernel of `ctx`, loaded on first use (None: it cannot run there; not tried
    /// again).
    fn kernel(&mut self, core: &Core, ctx: cuda::Context) -> Option<&cuda::CopyKernel> {
        super::super::copy_kernel(&mut self.kernels, ctx, &core.name, "direct GPU copies of many device ranges: one gather-kernel launch",
                                  "device ranges go to the copy engines")
    }

    /// Starts a job's device-to-device ranges as they are read from `dev` (at most `n` of
    /// them; the context is current): adjacent ones coalesce (as `coalesce` joins them), and
    /// every launch's worth of ranges of at most KERNEL_MAX_RANGE goes to the gather kernel at
    /// once, round robin over the streams, so the GPU starts on the first blocks while the
    /// rest are read (the vLLM pattern's 65,536 ranges were listed, coalesced and split into
    /// lists before the first launch). Returns the events that complete after the launches, and the ranges left for
    /// the copy engines (`queue`): long ones, and every one where the kernel cannot run here
    /// (not loadable, off by config, a single range, or a launch refused).
    ///
    /// # Safety
    /// As for `queue`; both ends of every range are device memory.
    pub unsafe fn launch_streamed(&mut self, core: &Core, ctx: cuda::Context, n: usize, dev: impl Iterator<Item = Copy>) -> Result<(Vec<cuda::Event>, Vec<Copy>)> {
        let mut spill = Vec::new();
        self.ensure_streams(ctx)?;
        if n <= 1 || !core.cfg.gpu_copy_kernel || self.kernel(core, ctx).is_none() {
            spill.extend(dev);
            return Ok((Vec::new(), spill));
        }
        let (Some(Some(k)), Some(streams)) = (self.kernels.get(&ctx.id()), self.streams.get(&ctx.id())) else {
            spill.extend(dev);
            return Ok((Vec::new(), spill));
        };
        let per = k.ranges_per_launch().max(1);
        // (As many launches as the ranges need, and at least one per stream where the
        // ranges are enough to share: a few hundred blocks still use every stream.)
        let groups = n.div_ceil(per).max(n.div_ceil(KERNEL_MIN_GROUP).min(FALLBACK_STREAMS));
        let chunk = n.div_ceil(groups).clamp(1, per);
        let mut group: Vec<Copy> = Vec::with_capacity(chunk);
        let (mut launches, mut used, mut refused) = (0usize, 0usize, None);
        let mut pending: Option<Copy> = None;
        // Launches the group on the next stream; a refusal leaves the group for the copy engines.
        let mut launch = |group: &mut Vec<Copy>, spill: &mut Vec<Copy>, refused: &mut Option<crate::error::Error>| {
            if refused.is_none() && !group.is_empty() {
                let i = launches % streams.len();
                // SAFETY: forwarded from the caller; both ends of every range are device memory.
                match unsafe { k.launch(&streams[i], group) } {
                    Ok(made) => {
                        // (A group of empty ranges makes no launch.)
                        if made > 0 {
                            launches += made;
                            used = used.max(i + 1);
                        }
                        group.clear();
                        return;
                    }
                    Err(e) => *refused = Some(e.into()),
                }
            }
            spill.append(group);
        };
        for c in dev {
            if let Some(p) = &mut pending {
                if continues(p, &c) {
                    p.2 += c.2;
                    continue;
                }
            }
            let Some(p) = pending.replace(c) else { continue };
            if p.2 > KERNEL_MAX_RANGE {
                spill.push(p);
                continue;
            }
            group.push(p);
            if group.len() == chunk {
                launch(&mut group, &mut spill, &mut refused);
            }
        }
        if let Some(p) = pending {
            if p.2 > KERNEL_MAX_RANGE { spill.push(p) } else { group.push(p) }
        }
        launch(&mut group, &mut spill, &mut refused);
        add(&core.counters.gpu_kernel_launches, launches as u64);
        if let Some(e) = refused {
            log::info!("{}: the gather-copy kernel failed to launch ({e}); device ranges go to the copy engines", core.name);
            // The module goes with the kernel: every launch from it, this request's and the
            // earlier jobs' still running on any of the streams, ends first.
            settle(streams)?;
            self.kernels.insert(ctx.id(), None);
            return Ok((Vec::new(), spill));
        }
        Ok((record_all(&streams[..used])?, spill))
    }

    /// Queues copies on `ctx`'s streams (the context is current): in one batch call where
    /// the driver has it, else one copy per coalesced range spread over the streams. Returns
    /// the events that complete after them.
    ///
    /// # Safety
    /// Every range lies in a live registration of ours or in a peer's allocation mapped
    /// here, held until the returned events complete.
    pub unsafe fn queue(&mut self, core: &Core, ctx: cuda::Context, mut copies: Vec<Copy>) -> Result<Vec<cuda::Event>> {
        self.ensure_streams(ctx)?;
        let mut events = Vec::with_capacity(FALLBACK_STREAMS);
        coalesce(&mut copies);
        if copies.is_empty() {
            return Ok(events);
        }
        let Some(streams) = self.streams.get(&ctx.id()) else { return Ok(events) };
        let has_batch = cuda::Driver::get().is_ok_and(|d| d.has_batch_copy());
        let batch = copies.len() > 1 && !self.batch_off && has_batch;
        let mut copy_events = Vec::with_capacity(FALLBACK_STREAMS);
        if batch {
            let mut dsts: Vec<u64> = copies.iter().map(|c| c.0).collect();
            let mut srcs: Vec<u64> = copies.iter().map(|c| c.1).collect();
            let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
            // SAFETY: forwarded from the caller.
            match unsafe { streams[0].copy_batch(&mut dsts, &mut srcs, &mut sizes) } {
                Ok(()) => {
                    copy_events.extend(record_all(&streams[..1])?);
                    add(&core.counters.gpu_batch_calls, 1);
                }
                Err(e) if cuda::batch_unsupported(&e) => {
                    log::info!("{}: the CUDA driver cannot batch copies ({e}); one copy per descriptor from now on", core.name);
                    self.batch_off = true;
                }
                Err(e) => {
                    // (Whatever the call queued before it failed ends before the request does.)
                    let _ = settle(&streams[..1]);
                    return Err(e.into());
                }
            }
        }
        if copy_events.is_empty() {
            if !self.logged {
                self.logged = true;
                log::info!("{}: direct GPU copies: {}", core.name, if !self.batch_off && has_batch {
                    "cuMemcpyBatchAsync for many descriptors"
                } else {
                    "one cuMemcpyAsync per (coalesced) descriptor over 4 streams"
                });
            }
            let used = copies.len().min(streams.len());
            for (i, (d, s, n)) in copies.iter().enumerate() {
                // SAFETY: forwarded from the caller.
                if let Err(e) = unsafe { streams[i % used].copy_async(*d, *s, *n) } {
                    // Copies queued before the failure end before the request does.
                    let _ = settle(&streams[..used]);
                    return Err(e.into());
                }
            }
            copy_events.extend(record_all(&streams[..used])?);
            add(&core.counters.gpu_copy_calls, copies.len() as u64);
        }
        events.extend(copy_events);
        Ok(events)
    }
}

/// Waits until everything queued on `streams` has ended: before a failed request gives its
/// memory back, and before a kernel's module is unloaded.
pub fn settle(streams: &[cuda::Stream]) -> std::result::Result<(), cuda::CudaError> {
    streams.iter().try_for_each(|s| s.synchronize())
}

/// An event on each of `streams` that completes after what is queued there. Where one
/// cannot be recorded the caller cannot wait for that work, so it is waited for here before
/// the error returns (a request fails only once its memory is the caller's again).
fn record_all(streams: &[cuda::Stream]) -> std::result::Result<Vec<cuda::Event>, cuda::CudaError> {
    streams.iter().map(|s| s.record()).collect::<std::result::Result<Vec<_>, _>>().inspect_err(|_| {
        let _ = settle(streams);
    })
}

/// Whether every event has completed (under its context, which the caller made current).
pub fn all_done(events: &[cuda::Event]) -> Result<bool> {
    let mut done = true;
    for ev in events {
        done &= ev.query()?;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::{coalesce, Copier, Copy};
    use crate::cuda;
    use crate::engine::transport::fake::{in_mock_cuda, mock_child, Bench};

    #[test]
    fn coalescing_merges_only_runs_adjacent_on_both_sides() {
        let mut v = vec![(100, 1000, 10), (110, 1010, 5), (120, 1015, 5), (125, 1020, 1)];
        coalesce(&mut v);
        assert_eq!(v, vec![(100, 1000, 15), (120, 1015, 6)]);
        let mut one = vec![(0, 0, 4)];
        coalesce(&mut one);
        assert_eq!(one, vec![(0, 0, 4)]);
        let mut none: Vec<super::Copy> = Vec::new();
        coalesce(&mut none);
        assert!(none.is_empty());
        // runs at the start, the middle and the end, with lone ranges between them
        let mut v = vec![(0, 0, 4), (4, 4, 4), (100, 50, 1), (200, 300, 2), (202, 302, 2), (204, 304, 2), (9, 9, 1), (10, 10, 1)];
        coalesce(&mut v);
        assert_eq!(v, vec![(0, 0, 8), (100, 50, 1), (200, 300, 6), (9, 9, 2)]);
    }

    #[test]
    fn streamed_launches_coalesce_spill_and_move_each_range_once() {
        for child in ["streamed_child", "streamed_refused_child"] {
            if !in_mock_cuda("copier-streamed", &format!("engine::transport::direct::copier::tests::{child}")) {
                return;
            }
        }
    }

    const BLOCK: usize = 64 << 10;
    const RUNS: usize = 44;

    /// (dst offset, src offset, len) of a request's ranges, in order: one run of 80 adjacent
    /// blocks (5 MiB once joined: past KERNEL_MAX_RANGE, so the copy engines'), RUNS runs of
    /// four adjacent blocks whose destinations go in reverse run order (each run one 256 KiB
    /// range), and lone 4 KiB ranges between the runs.
    fn pattern() -> Vec<(usize, usize, usize)> {
        let mut v: Vec<(usize, usize, usize)> = (0..80).map(|i| (i * BLOCK, i * BLOCK, BLOCK)).collect();
        let base = 80 * BLOCK;
        for r in 0..RUNS {
            for b in 0..4 {
                v.push((base + (RUNS - 1 - r) * 4 * BLOCK + b * BLOCK, base + r * 4 * BLOCK + b * BLOCK, BLOCK));
            }
            let lone = base + RUNS * 4 * BLOCK + r * 8192;
            v.push((lone, lone + 4096, 4096));
        }
        v
    }

    /// Runs the pattern through launch_streamed and queue; checks every byte, that the
    /// driver moved each byte once, and the launch count. Returns (launches, spilled).
    fn streamed(limit: Option<&str>) -> (u64, Vec<Copy>) {
        const LEN: usize = 24 << 20;
        let b = Bench::new(1, false);
        let p = cuda::Context::primary(0).expect("stand-in device");
        let ctx: cuda::Context = *p;
        ctx.make_current().unwrap();
        let src = cuda::DeviceBuffer::new(&ctx, LEN).unwrap();
        let dst = cuda::DeviceBuffer::new(&ctx, LEN).unwrap();
        let bytes: Vec<u8> = (0..LEN).map(|i| (i * 131 % 251) as u8).collect();
        src.write(0, &bytes).unwrap();
        dst.write(0, &vec![0u8; LEN]).unwrap();
        let ranges = pattern();
        // SAFETY: mock_copied_bytes has this signature.
        let moved: unsafe extern "C" fn() -> std::ffi::c_long = unsafe { cuda::tests::mock_hook(b"mock_copied_bytes\0") };
        if let Some(l) = limit {
            std::env::set_var("MOCK_CUDA_LAUNCH_LIMIT", l);
        }
        // SAFETY: the stand-in driver's counter takes nothing.
        let before = unsafe { moved() };
        let mut c = Copier::default();
        let it = ranges.iter().map(|&(dd, ss, n)| (dst.addr() + dd as u64, src.addr() + ss as u64, n));
        // SAFETY: every range lies inside src/dst, which outlive the waits below.
        let (events, spill) = unsafe { c.launch_streamed(&b.core, ctx, ranges.len(), it) }.unwrap();
        // SAFETY: as above.
        let more = unsafe { c.queue(&b.core, ctx, spill.clone()) }.unwrap();
        for ev in events.iter().chain(&more) {
            ev.synchronize().unwrap();
        }
        // SAFETY: as above.
        let after = unsafe { moved() };
        std::env::remove_var("MOCK_CUDA_LAUNCH_LIMIT");
        let total: usize = ranges.iter().map(|r| r.2).sum();
        assert_eq!((after - before) as usize, total, "each byte moved once");
        let mut want = vec![0u8; LEN];
        for &(dd, ss, n) in &ranges {
            want[dd..dd + n].copy_from_slice(&bytes[ss..ss + n]);
        }
        let mut got = vec![0u8; LEN];
        dst.read(0, &mut got).unwrap();
        if let Some(at) = (0..LEN).find(|&i| got[i] != want[i]) {
            panic!("byte {at} differs: got {} want {}", got[at], want[at]);
        }
        let launches = b.core.counters.gpu_kernel_launches.load(std::sync::atomic::Ordering::Relaxed);
        (launches, spill.iter().map(|&(dd, ss, n)| ((dd - dst.addr()), (ss - src.addr()), n)).collect())
    }

    #[test]
    #[ignore = "run by streamed_launches_coalesce_spill_and_move_each_range_once in a child process"]
    fn streamed_child() {
        if !mock_child() {
            return;
        }
        let (launches, spill) = streamed(None);
        // The 80 blocks joined into one range over KERNEL_MAX_RANGE: the copy engines'.
        assert_eq!(spill, vec![(0, 0, 80 * BLOCK)]);
        // 88 ranges (44 joined runs, 44 lone ones) spread over the streams.
        assert!((1..=super::FALLBACK_STREAMS as u64).contains(&launches), "{launches} launches");
    }

    #[test]
    #[ignore = "run by streamed_launches_coalesce_spill_and_move_each_range_once in a child process"]
    fn streamed_refused_child() {
        if !mock_child() {
            return;
        }
        // The second launch is refused: its group and every later range go to the copy engines.
        let (launches, spill) = streamed(Some("1"));
        assert_eq!(launches, 1);
        assert!(spill.len() > 1 && spill[0] == (0, 0, 80 * BLOCK), "{spill:?}");
        // The joined runs reach the copy engines joined.
        assert!(spill.iter().any(|s| s.2 == 4 * BLOCK), "{spill:?}");
    }
}
