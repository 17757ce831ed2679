//! The mbal coordinator (docs/protocol.md, "Coordinator"): one process that
//! owns the cluster map and its single epoch. Servers register with it and
//! keep a heartbeat; a server whose heartbeats stop for longer than the
//! failure timeout is declared down and its cachelets are reassigned (empty)
//! to the live servers under one epoch bump. The map and the members' states
//! live in a crash-safe file ([`store`]), written before any reply reveals
//! a new epoch; or in etcd ([`etcd`]), where several coordinators share
//! the state and one of them leads through an etcd lease.
//!
//! * [`state`]: every decision, no sockets, time passed in;
//! * [`store`]: the file store;
//! * [`server`]: the text protocol over blocking TCP (or TLS), the failure
//!   detector thread, and [`start`].

pub mod etcd;
pub mod server;
pub mod state;
pub mod store;

pub use etcd::EtcdSettings;
pub use server::{start, Handle, Settings};
pub use state::{Coord, MemberState, Stored, Timing};
