//! The CUDA contexts a progress pass makes current (DESIGN rule 4).
use super::core::Core;
use super::counters::add;
use crate::cuda;

/// The captured contexts a progress thread applies, refreshed from the engine's registry
/// when its version changes.
#[derive(Default)]
pub struct AppliedContexts {
    ctxs: Vec<cuda::Context>,
    version: u64,
}

impl AppliedContexts {
    /// Rule 4: before a pass touches the provider or device memory, the context captured at
    /// VRAM registration is made current on this thread — every pass, since the thread may
    /// have started before any VRAM existed, and user code on a thread-off caller may have
    /// switched contexts since. Further contexts are applied where their memory is touched
    /// (transports' device copies).
    pub fn apply(&mut self, core: &Core) {
        let v = core.gpu.version();
        if v != self.version {
            self.ctxs = core.gpu.contexts();
            self.version = v;
        }
        if core.skip_ctx_apply {
            return;
        }
        if let Some(c) = self.ctxs.first() {
            match c.make_current() {
                Ok(_) => add(&core.counters.cuda_ctx_applies, 1),
                Err(e) => log::error!("{}: making the captured CUDA context current: {e}", core.name),
            }
        }
    }
}
