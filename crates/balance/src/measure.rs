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
        if loads.is_empty() {
            return Imbalance { max_over_avg: 1.0, ..Imbalance::default() };
        }
        let n = loads.len() as f64;
        let avg = loads.iter().sum::<f64>() / n;
        let max = loads.iter().copied().fold(0.0, f64::max);
        let dev = loads.iter().map(|l| (l - avg).abs()).sum::<f64>() / n;
        if avg <= 0.0 {
            return Imbalance { avg: 0.0, max, dev: 0.0, max_over_avg: 1.0, factor: 0.0 };
        }
        Imbalance { avg, max, dev, max_over_avg: max / avg, factor: dev / avg }
    }
}

/// The load a cachelet puts on its worker: reads per second plus
/// `cfg.write_weight` × writes per second.
pub fn load_of(c: &CacheletLoad, cfg: &Config) -> f64 {
    c.reads_per_sec + cfg.write_weight * c.writes_per_sec
}

/// Each worker's load, in the snapshot's worker order, as the sum of its
/// cachelets' [`load_of`] plus the reads it served from Phase 1 copies.
pub fn worker_loads(snap: &EpochSnapshot, cfg: &Config) -> Vec<f64> {
    snap.workers
        .iter()
        .map(|w| {
            let copies = if w.secs > 0.0 { w.replica_reads as f64 / w.secs } else { 0.0 };
            w.cachelets.iter().map(|c| load_of(c, cfg)).sum::<f64>() + copies
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::WorkerLoad;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn balanced_loads_measure_zero() {
        let m = Imbalance::of(&[100.0, 100.0, 100.0, 100.0]);
        assert!(close(m.avg, 100.0) && close(m.dev, 0.0) && close(m.factor, 0.0));
        assert!(close(m.max_over_avg, 1.0));
    }

    #[test]
    fn skewed_loads_by_hand() {
        // avg 100; |deviations| 200, 0, 100, 100 -> dev 100, factor 1.0.
        let m = Imbalance::of(&[300.0, 100.0, 0.0, 0.0]);
        assert!(close(m.avg, 100.0));
        assert!(close(m.max, 300.0));
        assert!(close(m.dev, 100.0), "{m:?}");
        assert!(close(m.max_over_avg, 3.0));
        assert!(close(m.factor, 1.0));
        // NetKV eq. 6 written out: sum |r - avg| / (avg * n).
        let rates = [130.0, 70.0, 100.0, 100.0];
        let netkv = rates.iter().map(|r: &f64| (r - 100.0).abs()).sum::<f64>() / (100.0 * 4.0);
        assert!(close(Imbalance::of(&rates).factor, netkv));
        assert!(close(netkv, 0.15));
    }

    #[test]
    fn idle_and_empty_servers_are_balanced() {
        for loads in [&[][..], &[0.0, 0.0][..]] {
            let m = Imbalance::of(loads);
            assert!(close(m.max_over_avg, 1.0) && close(m.factor, 0.0) && close(m.dev, 0.0), "{m:?}");
        }
    }

    #[test]
    fn measures_do_not_depend_on_scale_except_dev() {
        let a = Imbalance::of(&[10.0, 30.0, 20.0]);
        let b = Imbalance::of(&[1000.0, 3000.0, 2000.0]);
        assert!(close(a.factor, b.factor) && close(a.max_over_avg, b.max_over_avg));
        assert!(close(a.dev * 100.0, b.dev));
    }

    #[test]
    fn worker_load_weights_writes() {
        let c = |id, r, w| CacheletLoad { id, reads_per_sec: r, writes_per_sec: w, ..CacheletLoad::default() };
        let snap = EpochSnapshot {
            seq: 1,
            end_ns: 0,
            workers: vec![
                WorkerLoad { worker: 0, cachelets: vec![c(0, 100.0, 10.0), c(1, 5.0, 5.0)], ..WorkerLoad::default() },
                WorkerLoad { worker: 1, cachelets: vec![], ..WorkerLoad::default() },
            ],
        };
        let cfg = Config::default();
        assert_eq!(worker_loads(&snap, &cfg), vec![120.0, 0.0]);
        let heavy = Config { write_weight: 3.0, ..Config::default() };
        assert_eq!(worker_loads(&snap, &heavy), vec![150.0, 0.0]);
    }
}
