//! The load balancer's policy (DESIGN.md §6), pure: it takes snapshots and
//! returns decisions, so the server, a coordinator and a simulator run the
//! same code. No I/O, no threads, no clocks of its own: time comes in with
//! the samples.
//!
//! * [`snapshot`]: what a server looks like over one balancer epoch: per
//!   worker and per cachelet reads, writes, items, memory, and how long
//!   work waited (queueing), built from two consecutive counter samples.

pub mod snapshot;

pub use snapshot::{CacheletLoad, CacheletSample, EpochSnapshot, WorkerLoad, WorkerSample};
