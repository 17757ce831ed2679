//! Which hot-key tracker Phase 1 uses: accuracy (precision and recall of
//! the true top-k) and cost (ns per sampled request, memory) of each
//! candidate against an exact count of the whole (unsampled) stream, on
//! Zipf 0.99, on a hot partition and on a Zipf hot set that shifts half
//! way. A measurement, not a test of speed: it prints the table of
//! docs/benchmarks-journal.md §11 and asserts only what must hold whatever the
//! machine. Run it in release:
//!
//! ```text
//! cargo test -p mbal-balance --release --test hot_trackers -- --ignored --nocapture
//! ```

use mbal_balance::tracker::{Access, Counted, LossyCounter, SpaceSaving, SporeEwma, Tracker};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use std::collections::HashMap;
use std::time::Instant;

const KEYS: u64 = 1_000_000;
const EPOCHS: usize = 10;
const OPS_PER_EPOCH: usize = 1_000_000;
const SAMPLE: f64 = 0.03;
const K: usize = 32;
const SHIFT_AT: usize = EPOCHS / 2;

#[derive(Clone, Copy, Debug)]
enum Workload {
    /// Zipf 0.99 over 1M keys (YCSB's request distribution, MBal's A).
    Zipf,
    /// 90% of requests uniform over a 1,000-key partition, 10% over all.
    HotPartition,
    /// Zipf 0.99 whose ranks move to other keys at the middle epoch.
    Shift,
}

/// The exact count of the sampled stream, unbounded: the cost reference.
struct ExactSampled(HashMap<Box<[u8]>, (u16, f64, f64)>);

impl Tracker for ExactSampled {
    fn observe(&mut self, key: &[u8], kind: Access, worker: u16) {
        let e = match self.0.get_mut(key) {
            Some(e) => e,
            None => self.0.entry(key.into()).or_insert((worker, 0.0, 0.0)),
        };
        match kind {
            Access::Read => e.1 += 1.0,
            Access::Write => e.2 += 1.0,
        }
    }
    fn end_epoch(&mut self) -> Vec<Counted> {
        let mut v: Vec<Counted> = self
            .0
            .drain()
            .map(|(k, e)| Counted { key: k.to_vec(), worker: e.0, reads: e.1, writes: e.2, error: 0.0 })
            .collect();
        v.sort_by(|a, b| b.total().total_cmp(&a.total()));
        v
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn memory_bytes(&self) -> usize {
        self.0.capacity() * (std::mem::size_of::<(Box<[u8]>, (u16, f64, f64))>() + 1)
            + self.0.keys().map(|k| k.len()).sum::<usize>()
    }
    fn name(&self) -> &'static str {
        "exact (sampled)"
    }
}

fn key_of(id: u64) -> Vec<u8> {
    format!("key:{id}").into_bytes()
}

fn id_of(key: &[u8]) -> u64 {
    std::str::from_utf8(&key[4..]).unwrap().parse().unwrap()
}

/// One epoch's requests (key ids).
fn epoch_ops(w: Workload, epoch: usize, rng: &mut SmallRng, zipf: &Zipf<f64>) -> Vec<u64> {
    (0..OPS_PER_EPOCH)
        .map(|_| match w {
            Workload::Zipf => zipf.sample(rng) as u64 - 1,
            Workload::Shift => {
                let rank = zipf.sample(rng) as u64 - 1;
                if epoch >= SHIFT_AT {
                    (rank + KEYS / 2) % KEYS
                } else {
                    rank
                }
            }
            Workload::HotPartition => {
                if rng.gen::<f64>() < 0.9 {
                    rng.gen_range(0..1000)
                } else {
                    rng.gen_range(0..KEYS)
                }
            }
        })
        .collect()
}

#[derive(Default)]
struct Score {
    precision: Vec<f64>,
    recall: Vec<f64>,
    rate_err: Vec<f64>,
    ns: Vec<f64>,
    mem: usize,
    entries: usize,
    /// Recall per epoch (for the shift).
    by_epoch: Vec<f64>,
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn trackers(capacity: usize) -> Vec<Box<dyn Tracker>> {
    vec![
        Box::new(SporeEwma::new(capacity, 0.5)),
        Box::new(SpaceSaving::new(capacity, 0.5)),
        Box::new(LossyCounter::new(1.0 / capacity as f64)),
    ]
}

fn run(w: Workload, capacity: usize, with_exact: bool) -> Vec<(String, Score)> {
    let mut rng = SmallRng::seed_from_u64(42);
    let zipf = Zipf::new(KEYS, 0.99).unwrap();
    let mut ts = trackers(capacity);
    if with_exact {
        ts.push(Box::new(ExactSampled(HashMap::new())));
    }
    let mut scores: Vec<Score> = ts.iter().map(|_| Score::default()).collect();
    for epoch in 0..EPOCHS {
        let ops = epoch_ops(w, epoch, &mut rng, &zipf);
        let mut exact: HashMap<u64, u64> = HashMap::new();
        for &id in &ops {
            *exact.entry(id).or_default() += 1;
        }
        let mut by_count: Vec<(u64, u64)> = exact.iter().map(|(&k, &c)| (k, c)).collect();
        by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        // Ties: every key as hot as the k-th counts as a true top-k key.
        let kth = by_count[K - 1].1;
        let samples: Vec<Vec<u8>> = ops.iter().filter(|_| rng.gen::<f64>() < SAMPLE).map(|&id| key_of(id)).collect();
        for (t, s) in ts.iter_mut().zip(scores.iter_mut()) {
            let start = Instant::now();
            for k in &samples {
                t.observe(k, Access::Read, 0);
            }
            s.ns.push(start.elapsed().as_nanos() as f64 / samples.len() as f64);
            s.mem = s.mem.max(t.memory_bytes());
            s.entries = s.entries.max(t.len());
            let out = t.end_epoch();
            let reported: Vec<u64> = out.iter().take(K).map(|c| id_of(&c.key)).collect();
            let hits = reported.iter().filter(|id| exact.get(id).copied().unwrap_or(0) >= kth).count();
            let precision = hits as f64 / reported.len().max(1) as f64;
            let recall = (hits as f64 / K as f64).min(1.0);
            // Rate error of the true 10 hottest: estimated requests per
            // epoch (samples / rate) against the exact count.
            let est: HashMap<u64, f64> = out.iter().map(|c| (id_of(&c.key), c.total() / SAMPLE)).collect();
            let err = mean(
                &by_count[..10]
                    .iter()
                    .map(|(id, c)| (est.get(id).copied().unwrap_or(0.0) - *c as f64).abs() / *c as f64)
                    .collect::<Vec<_>>(),
            );
            s.by_epoch.push(recall);
            if epoch > 0 {
                s.precision.push(precision);
                s.recall.push(recall);
                s.rate_err.push(err);
            }
        }
    }
    ts.iter().map(|t| t.name().to_string()).zip(scores).collect()
}

#[test]
#[ignore = "a measurement: run in release with --ignored --nocapture"]
fn tracker_accuracy_and_cost() {
    println!(
        "{} keys, {} epochs x {} requests, {:.0}% sampled, top-{}; epoch 0 (warm-up) not scored",
        KEYS,
        EPOCHS,
        OPS_PER_EPOCH,
        SAMPLE * 100.0,
        K
    );
    println!("| workload | tracker | capacity | precision | recall | top-10 rate error | ns / sampled op | memory KiB | entries | recall by epoch |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for w in [Workload::Zipf, Workload::HotPartition, Workload::Shift] {
        for (i, capacity) in [256usize, 1024].into_iter().enumerate() {
            for (name, s) in run(w, capacity, i == 0) {
                let cap = if name.starts_with("exact") { "-".to_string() } else { capacity.to_string() };
                let by: Vec<String> = s.by_epoch.iter().map(|r| format!("{r:.2}")).collect();
                println!(
                    "| {w:?} | {name} | {cap} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} | {} | {} |",
                    mean(&s.precision),
                    mean(&s.recall),
                    mean(&s.rate_err),
                    median(&s.ns),
                    s.mem as f64 / 1024.0,
                    s.entries,
                    by.join(" ")
                );
                // What holds whatever the machine: bounded trackers stay
                // bounded; on Zipf every tracker finds most of the top-k.
                if name == "space-saving" || name == "spore-ewma" {
                    assert!(s.entries <= capacity);
                }
                if matches!(w, Workload::Zipf) && name == "space-saving" {
                    assert!(mean(&s.recall) > 0.5, "{name}: {}", mean(&s.recall));
                }
            }
        }
    }
}
