//! Imbalance measures over per-worker loads (issue 9 §1).
//!
//! * `dev`: MBal's absolute deviation, the mean of |L_i − L_avg| over the
//!   workers, in the load's unit (requests per second). It is the quantity
//!   objective (2) of Phase 2 minimises (MBal eq. 4).
//! * `max_over_avg`: the most loaded worker over the mean; 1.0 is perfect.
//! * `factor`: NetKV's imbalance factor (NetKV eq. 6),
//!   Σ |Rate_i − AvgRate| / (AvgRate · n), i.e. `dev / avg`: a scale-free
//!   deviation, 0 when balanced.
//!
//! With no load at all every measure is 0 (and `max_over_avg` 1.0): an idle
//! server is balanced.

use crate::config::Config;
use crate::snapshot::{CacheletLoad, EpochSnapshot};
use serde::{Deserialize, Serialize};

/// How unevenly a server's workers are loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Imbalance {
    /// Mean load per worker (requests per second, weighted; see [`load_of`]).
    pub avg: f64,
    /// The most loaded worker's load.
    pub max: f64,
    /// MBal's absolute deviation: mean |L_i − avg|.
    pub dev: f64,
    /// max / avg (1.0 when idle).
    pub max_over_avg: f64,
    /// NetKV eq. 6: dev / avg (0 when idle).
    pub factor: f64,
}

impl Imbalance {
    /// The measures over a list of worker loads.
    pub fn of(loads: &[f64]) -> Imbalance {
        todo!("{loads:?}")
    }
}

/// The load a cachelet puts on its worker: reads per second plus
/// `cfg.write_weight` × writes per second.
pub fn load_of(c: &CacheletLoad, cfg: &Config) -> f64 {
    todo!("{c:?} {cfg:?}")
}

/// Each worker's load, in the snapshot's worker order, as the sum of its
/// cachelets' [`load_of`].
pub fn worker_loads(snap: &EpochSnapshot, cfg: &Config) -> Vec<f64> {
    todo!("{snap:?} {cfg:?}")
}
