//! The transfer engine: rails, registrations, peers, requests, notifications and the
//! progress loop. Callers use [`Engine`] (engine.rs); everything that touches the rails
//! runs in the driver (driver.rs), which moves bytes through the transports
//! (transport/) along the routes the scheduler (scheduler/) picked. This file only
//! names the modules: nothing below imports from it.
mod cma;
mod conns;
mod contexts;
mod core;
mod counters;
mod ctrl;
mod driver;
#[cfg(test)]
mod driver_tests;
#[allow(clippy::module_inception)]
mod engine;
mod fd_share;
mod gpu;
mod gpu_reg;
mod ids;
mod inbox;
mod ipc_cache;
mod ipc_export;
mod local_peers;
mod ops;
mod peer;
mod port;
mod progress;
mod rail_threads;
mod registry;
mod remote;
mod request;
mod scheduler;
mod transport;
pub mod wire;

pub use counters::{CounterSnapshot, RailCounterSnapshot};
pub use engine::{cuda_summary, Engine};
pub use registry::{LocalMem, MemKind};
pub use remote::RemoteMem;
pub use request::{Op, Request};
pub use scheduler::{Pair, PairSource};
