//! nixl-fabric: a NIXL backend plugin over libfabric. Layers, from NIXL down: the C++
//! adapter (src/adapter), the C ABI (capi), the engine, and the fabric and cuda wrappers.
pub mod capi;
pub mod config;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod fabric;
pub mod hinted;
pub mod logging;
mod plugin;
