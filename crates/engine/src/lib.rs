//! One shard (a worker) of an `mbal server` without its sockets or its thread (DESIGN.md
//! §3, `engine`): what the worker owns and what it executes.
//!
//! * [`Shard`]: one worker's state, the parts below together;
//! * [`exec`]: the one place that executes a request (text, meta, binary) against the
//!   worker's cachelets (`mbal_store::WorkerStore`, which also exports and imports a
//!   cachelet's items for a move to another process);
//! * [`replica`]: Phase 1's two tables on a worker (its keys with copies elsewhere, and the
//!   copies it holds of other servers' keys);
//! * [`tables`]: the worker's ownership tables (who owns each cachelet, the route its
//!   requests take, the requests parked while a route settles);
//! * [`capacity`]: the emulated per-worker capacity of the balancer's testbed;
//! * [`counters`]: the worker's counters and the snapshot it reports for `stats`.
//!
//! The server (`crates/server`) is the reactor around these: listeners, connections,
//! routing between workers, messages. Everything here is unit-tested alone.

pub mod capacity;
pub mod counters;
pub mod exec;
pub mod replica;
pub mod shard;
pub mod tables;

pub use shard::Shard;
