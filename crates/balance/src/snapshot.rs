//! Epoch snapshots: what the policy sees of one server over one epoch
//! (DESIGN.md §6, MBal §3.1 "statistics per cachelet").
//!
//! A server's workers report [`WorkerSample`]s: cumulative counters read at
//! one instant, plus a few gauges. The policy never sees those directly; it
//! sees an [`EpochSnapshot`], the difference of two samples of every worker
//! ([`EpochSnapshot::between`], or from a [`Baseline`]), with counts over
//! the time between and rates per second: consecutive samples for Phase 1's
//! epoch, samples a Phase 2 epoch apart for Phase 2 (the counters are
//! cumulative, so several epochs merge exactly; the gauges, such as
//! `queue_wait_max_us`, are the last epoch's).
//!
//! A cachelet's counters travel with it when it changes worker (they live
//! in the cachelet), so its reads over an epoch are found by its id, whoever
//! held it at either end; a cachelet that moved during the epoch counts
//! wholly at its new owner. A counter smaller than before (a `stats reset`)
//! counts from zero. Workers are sampled one after another, so a cachelet
//! that moves while a round is taken can be reported by both ends (or by
//! neither): it counts once, at the later of the two (the one with more
//! requests counted), and one that is missing counts in the next epoch
//! ([`Baseline`] keeps its last counts).
//!
//! These are plain types: no store internals, nothing that needs the server
//! to build or read them.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// One cachelet's counters as its owner read them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheletSample {
    pub id: u32,
    /// Cumulative read requests (get, gets, gat, meta get, ...).
    pub reads: u64,
    /// Cumulative write requests (set, add, delete, incr, touch, ...).
    pub writes: u64,
    /// Live items now.
    pub items: u64,
    /// Live item bytes now (item footprints).
    pub bytes: u64,
    /// Memory pages held now.
    pub pages: u64,
}

/// One worker's counters at one instant.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSample {
    pub worker: u16,
    /// When the sample was taken, in nanoseconds on the server's one clock.
    pub at_ns: u64,
    /// Cumulative nanoseconds the worker spent working (not waiting in its
    /// poll for something to do).
    pub busy_ns: u64,
    /// Cumulative batches of messages from other workers it took in, and
    /// the nanoseconds they waited between being sent and being taken in.
    pub inbox_batches: u64,
    pub inbox_wait_ns: u64,
    /// The longest such wait since the previous sample.
    pub inbox_wait_max_ns: u64,
    /// Cumulative requests passed to other workers / executed for them.
    pub forwarded_out: u64,
    pub forwarded_in: u64,
    /// Queue lengths at the instant: messages waiting in the inbox, and
    /// connections with input read but not yet served.
    pub inbox_len: u64,
    pub ready_conns: u64,
    /// Open connections.
    pub connections: u64,
    /// The cachelets the worker owns.
    pub cachelets: Vec<CacheletSample>,
    /// Cumulative reads it served from copies of other servers' hot keys
    /// (Phase 1's shadow table): load on the worker outside its cachelets.
    #[serde(default)]
    pub replica_reads: u64,
}

/// One cachelet over an epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheletLoad {
    pub id: u32,
    pub reads: u64,
    pub writes: u64,
    pub reads_per_sec: f64,
    pub writes_per_sec: f64,
    /// Gauges at the end of the epoch.
    pub items: u64,
    pub bytes: u64,
    pub pages: u64,
}

impl CacheletLoad {
    /// Requests per second (reads and writes).
    pub fn ops_per_sec(&self) -> f64 {
        self.reads_per_sec + self.writes_per_sec
    }
}

/// One worker over an epoch.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerLoad {
    pub worker: u16,
    /// The epoch's length as this worker measured it (between its samples).
    pub secs: f64,
    /// Requests executed on the worker's cachelets.
    pub reads: u64,
    pub writes: u64,
    /// Fraction of the epoch the worker was busy (0..=1).
    pub busy: f64,
    /// Mean and longest time a message from another worker waited in this
    /// worker's inbox, in microseconds (0 when none came).
    pub queue_wait_mean_us: f64,
    pub queue_wait_max_us: f64,
    pub forwarded_in: u64,
    pub forwarded_out: u64,
    /// Queue lengths and connections at the end of the epoch.
    pub inbox_len: u64,
    pub ready_conns: u64,
    pub connections: u64,
    pub cachelets: Vec<CacheletLoad>,
    /// Reads served from copies of other servers' hot keys (Phase 1), not
    /// counted in any cachelet.
    #[serde(default)]
    pub replica_reads: u64,
}

impl WorkerLoad {
    /// Requests per second executed on this worker: on its cachelets, and
    /// reads of the copies it holds for other servers.
    pub fn ops_per_sec(&self) -> f64 {
        if self.secs > 0.0 {
            (self.reads + self.writes + self.replica_reads) as f64 / self.secs
        } else {
            0.0
        }
    }

    /// Live item bytes and pages held by its cachelets.
    pub fn bytes(&self) -> u64 {
        self.cachelets.iter().map(|c| c.bytes).sum()
    }

    pub fn pages(&self) -> u64 {
        self.cachelets.iter().map(|c| c.pages).sum()
    }
}

/// A server over one epoch.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochSnapshot {
    /// Epochs counted since the server started (the first snapshot is 1).
    pub seq: u64,
    /// When the epoch ended, in nanoseconds on the server's clock.
    pub end_ns: u64,
    /// Workers in worker order.
    pub workers: Vec<WorkerLoad>,
}

/// Each cachelet's counters in a round; of two reports of one cachelet
/// (a move while the round was taken), the later one, which has counted
/// more.
fn latest_by_id(round: &[WorkerSample]) -> HashMap<u32, (u64, u64)> {
    let mut m: HashMap<u32, (u64, u64)> = HashMap::new();
    for c in round.iter().flat_map(|w| w.cachelets.iter()) {
        let e = m.entry(c.id).or_insert((c.reads, c.writes));
        if c.reads + c.writes > e.0 + e.1 {
            *e = (c.reads, c.writes);
        }
    }
    m
}

fn delta(cur: u64, prev: u64) -> u64 {
    // A counter that went down was reset: it counts from zero.
    if cur >= prev {
        cur - prev
    } else {
        cur
    }
}

fn per_sec(n: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Where the next epoch is measured from: a round of samples, and each
/// cachelet's counters as last reported, in that round or, for one the round
/// missed (in transit between two workers when they were sampled), in an
/// earlier one. Without the earlier counts such a cachelet would count from
/// zero in the next epoch: every request of its life in one epoch.
#[derive(Clone, Debug, Default)]
pub struct Baseline {
    samples: Vec<WorkerSample>,
    counts: HashMap<u32, (u64, u64)>,
}

impl Baseline {
    /// Move on to `cur`: its samples, with the counts of the cachelets it
    /// missed kept from before.
    pub fn advance(&mut self, cur: Vec<WorkerSample>) {
        self.counts.extend(latest_by_id(&cur));
        self.samples = cur;
    }

    /// The epoch from this baseline to `cur`.
    pub fn epoch_to(&self, seq: u64, cur: &[WorkerSample]) -> EpochSnapshot {
        EpochSnapshot::measure(seq, &self.samples, &self.counts, cur)
    }
}

impl EpochSnapshot {
    /// The epoch between two samples of every worker. A worker or cachelet
    /// missing from `prev` counts from zero (a first sample: pass `&[]`);
    /// [`Baseline`] remembers the cachelets a round missed.
    pub fn between(seq: u64, prev: &[WorkerSample], cur: &[WorkerSample]) -> EpochSnapshot {
        EpochSnapshot::measure(seq, prev, &latest_by_id(prev), cur)
    }

    /// `between`, with each cachelet's counters at the start in `before`.
    fn measure(
        seq: u64,
        prev: &[WorkerSample],
        before: &HashMap<u32, (u64, u64)>,
        cur: &[WorkerSample],
    ) -> EpochSnapshot {
        let after = latest_by_id(cur);
        let mut workers: Vec<WorkerLoad> = cur
            .iter()
            .map(|w| {
                let p = prev.iter().find(|p| p.worker == w.worker);
                let zero = WorkerSample::default();
                let p = p.unwrap_or(&zero);
                let elapsed = delta(w.at_ns, p.at_ns);
                let secs = elapsed as f64 / 1e9;
                let cachelets: Vec<CacheletLoad> = w
                    .cachelets
                    .iter()
                    .filter(|c| after.get(&c.id) == Some(&(c.reads, c.writes)))
                    .map(|c| {
                        let (r0, w0) = before.get(&c.id).copied().unwrap_or((0, 0));
                        let (reads, writes) = (delta(c.reads, r0), delta(c.writes, w0));
                        CacheletLoad {
                            id: c.id,
                            reads,
                            writes,
                            reads_per_sec: per_sec(reads, secs),
                            writes_per_sec: per_sec(writes, secs),
                            items: c.items,
                            bytes: c.bytes,
                            pages: c.pages,
                        }
                    })
                    .collect();
                let batches = delta(w.inbox_batches, p.inbox_batches);
                let waited = delta(w.inbox_wait_ns, p.inbox_wait_ns);
                WorkerLoad {
                    worker: w.worker,
                    secs,
                    reads: cachelets.iter().map(|c| c.reads).sum(),
                    writes: cachelets.iter().map(|c| c.writes).sum(),
                    busy: if elapsed > 0 {
                        (delta(w.busy_ns, p.busy_ns) as f64 / elapsed as f64).min(1.0)
                    } else {
                        0.0
                    },
                    queue_wait_mean_us: if batches > 0 { waited as f64 / batches as f64 / 1e3 } else { 0.0 },
                    queue_wait_max_us: w.inbox_wait_max_ns as f64 / 1e3,
                    forwarded_in: delta(w.forwarded_in, p.forwarded_in),
                    forwarded_out: delta(w.forwarded_out, p.forwarded_out),
                    inbox_len: w.inbox_len,
                    ready_conns: w.ready_conns,
                    connections: w.connections,
                    cachelets,
                    replica_reads: delta(w.replica_reads, p.replica_reads),
                }
            })
            .collect();
        workers.sort_by_key(|w| w.worker);
        let end_ns = cur.iter().map(|w| w.at_ns).max().unwrap_or(0);
        EpochSnapshot { seq, end_ns, workers }
    }

    /// A cachelet's load over the epoch and the worker that held it at the end.
    pub fn cachelet(&self, id: u32) -> Option<(u16, &CacheletLoad)> {
        self.workers.iter().find_map(|w| w.cachelets.iter().find(|c| c.id == id).map(|c| (w.worker, c)))
    }

    /// Requests per second over every worker.
    pub fn ops_per_sec(&self) -> f64 {
        self.workers.iter().map(|w| w.ops_per_sec()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(id: u32, reads: u64, writes: u64) -> CacheletSample {
        CacheletSample { id, reads, writes, items: 1, bytes: 100, pages: 1 }
    }

    fn w(worker: u16, at_s: u64, cachelets: Vec<CacheletSample>) -> WorkerSample {
        WorkerSample { worker, at_ns: at_s * 1_000_000_000, cachelets, ..WorkerSample::default() }
    }

    #[test]
    fn counts_and_rates_over_the_epoch() {
        let prev = [w(0, 10, vec![c(0, 100, 10), c(2, 0, 0)]), w(1, 10, vec![c(1, 50, 5)])];
        let mut cur = [w(0, 12, vec![c(0, 300, 30), c(2, 20, 0)]), w(1, 12, vec![c(1, 50, 5)])];
        cur[0].busy_ns = 500_000_000;
        cur[0].inbox_batches = 4;
        cur[0].inbox_wait_ns = 8_000;
        cur[0].inbox_wait_max_ns = 5_000;
        let s = EpochSnapshot::between(7, &prev, &cur);
        assert_eq!(s.seq, 7);
        assert_eq!(s.end_ns, 12_000_000_000);
        let w0 = &s.workers[0];
        assert_eq!((w0.reads, w0.writes), (220, 20));
        assert!((w0.secs - 2.0).abs() < 1e-9);
        assert!((w0.ops_per_sec() - 120.0).abs() < 1e-9);
        assert!((w0.busy - 0.25).abs() < 1e-9);
        assert!((w0.queue_wait_mean_us - 2.0).abs() < 1e-9);
        assert!((w0.queue_wait_max_us - 5.0).abs() < 1e-9);
        let (owner, c0) = s.cachelet(0).unwrap();
        assert_eq!(owner, 0);
        assert!((c0.reads_per_sec - 100.0).abs() < 1e-9);
        assert!((c0.writes_per_sec - 10.0).abs() < 1e-9);
        assert_eq!(s.workers[1].reads, 0, "an idle worker");
        assert!((s.ops_per_sec() - 120.0).abs() < 1e-9);
    }

    #[test]
    fn reads_of_copies_are_load_outside_the_cachelets() {
        let mut prev = [w(0, 10, vec![c(0, 100, 0)])];
        let mut cur = [w(0, 12, vec![c(0, 300, 0)])];
        prev[0].replica_reads = 50;
        cur[0].replica_reads = 450;
        let s = EpochSnapshot::between(1, &prev, &cur);
        assert_eq!((s.workers[0].reads, s.workers[0].replica_reads), (200, 400));
        assert!((s.workers[0].ops_per_sec() - 300.0).abs() < 1e-9);
        let loads = crate::measure::worker_loads(&s, &crate::Config::default());
        assert!((loads[0] - 300.0).abs() < 1e-9, "{loads:?}");
    }

    #[test]
    fn a_moved_cachelet_counts_at_its_new_owner_by_id() {
        // Cachelet 5 went from worker 0 to worker 1 during the epoch; its
        // counters came along.
        let prev = [w(0, 1, vec![c(5, 1000, 0)]), w(1, 1, vec![])];
        let cur = [w(0, 2, vec![]), w(1, 2, vec![c(5, 1600, 0)])];
        let s = EpochSnapshot::between(1, &prev, &cur);
        assert_eq!(s.workers[0].reads, 0);
        assert_eq!(s.workers[1].reads, 600);
        assert_eq!(s.cachelet(5).map(|(w, c)| (w, c.reads)), Some((1, 600)));
    }

    #[test]
    fn a_cachelet_reported_by_both_ends_of_a_move_counts_once() {
        // Worker 0 was sampled before it released cachelet 5, worker 1
        // after it adopted it and served 50 more.
        let prev = [w(0, 1, vec![c(5, 100, 0)]), w(1, 1, vec![])];
        let cur = [w(0, 2, vec![c(5, 400, 0)]), w(1, 2, vec![c(5, 450, 0)])];
        let s = EpochSnapshot::between(1, &prev, &cur);
        assert_eq!(s.workers[0].reads, 0);
        assert_eq!(s.workers[1].reads, 350);
        assert_eq!(s.workers.iter().map(|w| w.cachelets.len()).sum::<usize>(), 1);
    }

    #[test]
    fn a_cachelet_neither_end_reported_counts_its_requests_since_the_last_report() {
        // Cachelet 5 was in transit from worker 0 to worker 1 when the
        // middle round was taken: neither reported it.
        let rounds = [
            vec![w(0, 1, vec![c(5, 1000, 10), c(6, 0, 0)]), w(1, 1, vec![])],
            vec![w(0, 2, vec![c(6, 40, 0)]), w(1, 2, vec![])],
            vec![w(0, 3, vec![c(6, 80, 0)]), w(1, 3, vec![c(5, 1300, 20)])],
        ];
        let mut b1 = Baseline::default();
        b1.advance(rounds[0].clone());
        let e1 = b1.epoch_to(1, &rounds[1]);
        assert_eq!(e1.cachelet(5), None);
        let mut b2 = b1.clone();
        b2.advance(rounds[1].clone());
        let e2 = b2.epoch_to(2, &rounds[2]);
        assert_eq!(e2.cachelet(5).map(|(w, c)| (w, c.reads, c.writes)), Some((1, 300, 10)));
        assert_eq!(e2.cachelet(6).map(|(_, c)| c.reads), Some(40));
        // Without the earlier counts it would count from zero.
        assert_eq!(EpochSnapshot::between(2, &rounds[1], &rounds[2]).cachelet(5).map(|(_, c)| c.reads), Some(1300));
        // Over both epochs at once (Phase 2's merged epoch) it is the same
        // as from a round that saw it.
        let both = b1.epoch_to(2, &rounds[2]);
        assert_eq!(both.cachelet(5).map(|(_, c)| c.reads), Some(300));
        assert_eq!(both, EpochSnapshot::between(2, &rounds[0], &rounds[2]));
    }

    #[test]
    fn a_reset_counter_counts_from_zero_and_a_first_sample_from_nothing() {
        let prev = [w(0, 1, vec![c(0, 1000, 1000)])];
        let cur = [w(0, 2, vec![c(0, 30, 4)])];
        let s = EpochSnapshot::between(2, &prev, &cur);
        assert_eq!((s.workers[0].reads, s.workers[0].writes), (30, 4));
        let first = EpochSnapshot::between(1, &[], &cur);
        assert_eq!(first.workers[0].reads, 30);
        assert!(first.workers[0].secs > 0.0);
    }

    #[test]
    fn snapshots_travel_as_json() {
        let cur = [w(0, 2, vec![c(0, 30, 4)])];
        let s = EpochSnapshot::between(2, &[], &cur);
        let back: EpochSnapshot = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    proptest::proptest! {
        /// Whatever the counters do, an epoch's counts are the sums of its
        /// cachelets', rates are never negative, and busy stays in 0..=1.
        #[test]
        fn sums_and_bounds_hold(
            reads in proptest::collection::vec((0u64..1_000_000, 0u64..1_000_000), 1..20),
            busy in 0u64..10_000_000_000,
        ) {
            let prev: Vec<WorkerSample> = vec![w(0, 1, reads.iter().enumerate().map(|(i, r)| c(i as u32, r.0, r.1)).collect())];
            let mut cur = vec![w(0, 3, reads.iter().enumerate().map(|(i, r)| c(i as u32, r.1, r.0)).collect())];
            cur[0].busy_ns = busy;
            let s = EpochSnapshot::between(1, &prev, &cur);
            let w0 = &s.workers[0];
            proptest::prop_assert_eq!(w0.reads, w0.cachelets.iter().map(|c| c.reads).sum::<u64>());
            proptest::prop_assert!(w0.cachelets.iter().all(|c| c.reads_per_sec >= 0.0 && c.writes_per_sec >= 0.0));
            proptest::prop_assert!((0.0..=1.0).contains(&w0.busy));
        }
    }
}
