//! The load balancer's policy (DESIGN.md §6), pure: it takes snapshots and
//! returns decisions, so the server, a coordinator and a simulator run the
//! same code. No I/O, no threads, no clocks of its own: time comes in with
//! the samples.
//!
//! * [`snapshot`]: what a server looks like over one balancer epoch: per
//!   worker and per cachelet reads, writes, items, memory, and how long
//!   work waited (queueing), built from two consecutive counter samples.
//! * [`measure`]: imbalance measures (MBal's dev, max/avg, NetKV's factor).
//! * [`plan`]: the Phase 2 planner (ILP objectives 1 and 2, greedy fallback).
//! * [`policy`]: the [`Balancer`]: MBal's Figure 4 state machine,
//!   persistence, leases; one [`Decision`] per epoch.
//! * [`phase3`]: Phase 3, the coordinator's policy: [`Phase3`], Algorithm 2
//!   (ILP of eqs. 8–13, greedy fallback), events in, migrations out.
//! * [`config`]: every knob, with its default.
//! * [`control`]: the controller's core, [`ControlCore`]: events in,
//!   commands out (sampling rounds, Phase 2's cadence, moves, the map's
//!   owners); the server's controller is an adapter around it.
//! * [`tracker`]: sampled hot-key trackers (SPORE's EWMA cache,
//!   Space-Saving, lossy counting).
//! * [`hot`]: Phase 1, hot-key replication: [`HotKeys`], SPORE's key
//!   states, r = ceil(f/T) with T from a balls-and-bins estimate,
//!   REPL_high, and the RIKR-style [`replica_location`].

pub mod config;
pub mod control;
pub mod hot;
pub mod measure;
pub mod phase3;
pub mod plan;
pub mod policy;
pub mod snapshot;
pub mod tracker;

pub use config::{Config, Phase3Config, Planner};
pub use control::{
    Answer, BalancerStatus, Command, ControlCore, CoreSettings, Event, HotCommand, HotSettings, HotStatus, PeerHot,
};
pub use hot::{
    replica_location, sample_rate_for, AlarmDecision, ClusterView, HotConfig, HotEscalateWhy, HotEscalation,
    HotKeyStat, HotKeys, KeyState, KeyTransition, ReplicaDecision, Replicate, Retire, SlotHeat, SlotLedger,
};
pub use measure::{load_of, worker_loads, Imbalance};
pub use phase3::{
    CacheletReport, Method3, Migrate, Phase3, Phase3Event, Phase3Report, Phase3Stats, Plan3, ServerReport, Source,
    WorkerReport,
};
pub use plan::{Method, Objective, Plan, Problem};
pub use policy::{Balancer, Decision, EscalateWhy, Escalation, Lease, Move, State, Transition, Why};
pub use snapshot::{Baseline, CacheletLoad, CacheletSample, EpochSnapshot, WorkerLoad, WorkerSample};
pub use tracker::{Access, Tracker, TrackerKind};
