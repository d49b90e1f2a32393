//! Safe wrappers over libfabric: the only module that calls it. Each fid type has an owning
//! wrapper that closes it on drop and holds its parent alive, so teardown order follows
//! ownership.
mod sys;
mod info;
mod resources;
mod rail;
mod domain_lock;

pub use info::{discover, provider_list, ProviderSummary, RailSpec};
pub use rail::{Completion, CqError, DmaBufRange, FaultCounts, FaultSpec, Hmem, MemoryRegion, Posted, Posting, Rail, RailCaps, RmaSeg, MAX_RMA_BATCH};

/// libfabric's address handle of a peer endpoint in one rail's address vector.
pub type FiAddr = u64;

/// The API version we ask for: 1.17 is the oldest we build against; 2.x accepts it.
pub(crate) const API_VERSION: u32 = (1 << 16) | 17;

/// The API version that has dma-buf registrations (FI_MR_DMABUF, struct fi_mr_dmabuf): a
/// fabric opened with an older one reads the registration's dma-buf as an iovec.
pub(crate) const API_VERSION_DMABUF: u32 = (1 << 16) | 20;

/// The API version to open rails with: 1.20 for FI_HMEM rails where the library has it
/// (so device memory can be registered by dma-buf), else 1.17, which every path was
/// built and tested on. Rails without FI_HMEM never register device memory.
pub(crate) fn api_version(hmem: bool) -> u32 {
    if hmem && runtime_version() >= API_VERSION_DMABUF { API_VERSION_DMABUF } else { API_VERSION }
}

/// The runtime library's version, e.g. "1.17".
pub fn library_version() -> String {
    let v = runtime_version();
    format!("{}.{}", v >> 16, v & 0xffff)
}

/// The runtime library's major version (provider behaviour differs between 1.x and 2.x).
pub(crate) fn library_major() -> u32 {
    runtime_version() >> 16
}

pub(crate) fn runtime_version() -> u32 {
    // SAFETY: fi_version takes no arguments and only reads constants.
    unsafe { sys::fi_version() }
}

/// libfabric's text for a (positive) error number.
pub(crate) fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static string for any value.
    unsafe {
        let p = sys::fi_strerror(code.abs());
        if p.is_null() {
            return format!("error {code}");
        }
        std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// Builds the error value for a failed libfabric call.
pub(crate) fn fab_err(op: &'static str, rail: Option<usize>, ret: i64) -> crate::error::Error {
    let code = ret as i32;
    crate::error::Error::Fabric { op, rail, code, detail: strerror(code) }
}
