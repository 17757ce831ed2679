//! Sampled hot-key trackers (Phase 1, DESIGN.md §6; SPORE §3.3/§3.5,
//! NetKV §IV-A).
//!
//! The caller samples its requests at a rate it chooses and feeds each
//! sampled key with its kind ([`Access`]) and the worker that served it to
//! [`Tracker::observe`]; once per balancer epoch it calls
//! [`Tracker::end_epoch`], which returns the tracked keys with their
//! estimated *sampled* reads and writes per epoch, hottest first, and ages
//! the tracker for the next epoch. Turning samples into requests per second
//! (÷ sampling rate ÷ epoch length) is the caller's business
//! ([`crate::hot::HotKeys`] does it).
//!
//! Three bounded candidates, measured against an exact count in
//! `tests/hot_trackers.rs` (docs/benchmarks.md §11, docs/design-notes.md):
//!
//! * [`SporeEwma`]: SPORE's server-side metadata cache: per key an
//!   exponentially weighted moving average of per-epoch reads and writes,
//!   a bounded table, and eviction of a *cold* entry only (least recently
//!   used among a few sampled ones; the hottest entries of the last epoch
//!   are never evicted).
//! * [`SpaceSaving`]: Metwally et al.'s Space-Saving over a min-heap of
//!   `capacity` counters (a new key replaces the smallest counter and
//!   inherits its count as its error), with every counter multiplied by
//!   `decay` at each epoch end so that the hot set can change.
//! * [`LossyCounter`]: Manku and Motwani's lossy counting (NetKV §IV-A),
//!   one window per epoch: error `epsilon`, pruning at every bucket of
//!   `1/epsilon` samples, reset at each epoch end.
//!
//! All three keep, per key, the reads and writes apart, so the policy can
//! both rank keys by load and refuse write-heavy ones (SPORE's
//! read-up/write-down counter folds the two into one number; here the
//! weighting is applied by the policy, see [`crate::hot`]).

use std::collections::HashMap;

/// What a sampled request did to its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Access {
    Read,
    Write,
}

/// A tracked key's estimate over one epoch, in sampled requests.
#[derive(Clone, Debug, PartialEq)]
pub struct Counted {
    pub key: Vec<u8>,
    /// The worker that served its latest sampled request.
    pub worker: u16,
    /// Estimated sampled reads and writes per epoch.
    pub reads: f64,
    pub writes: f64,
    /// How much of `reads + writes` may be overcount (Space-Saving's
    /// inherited count; 0 for the others).
    pub error: f64,
}

impl Counted {
    /// Estimated sampled requests per epoch (reads + writes + the
    /// overcount, an upper estimate for Space-Saving).
    pub fn total(&self) -> f64 {
        self.reads + self.writes + self.error
    }
}

/// A bounded hot-key tracker.
pub trait Tracker {
    /// One sampled request.
    fn observe(&mut self, key: &[u8], kind: Access, worker: u16);
    /// The epoch ended: the tracked keys, hottest first, with per-epoch
    /// estimates; then the tracker ages for the next epoch.
    fn end_epoch(&mut self) -> Vec<Counted>;
    /// Keys tracked now.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Approximate heap bytes held (tables, entries and key bytes).
    fn memory_bytes(&self) -> usize;
    /// A short name for tables.
    fn name(&self) -> &'static str;
}

fn sort_hottest_first(v: &mut [Counted]) {
    v.sort_by(|a, b| b.total().total_cmp(&a.total()).then_with(|| a.key.cmp(&b.key)));
}

fn map_bytes<V>(m: &HashMap<Box<[u8]>, V>) -> usize {
    // One control byte per bucket plus the (key pointer, value) pair.
    m.capacity() * (std::mem::size_of::<(Box<[u8]>, V)>() + 1)
}

/// SPORE's metadata cache: EWMA counters, evicting only cold entries.
#[derive(Clone, Debug)]
pub struct SporeEwma {
    capacity: usize,
    alpha: f64,
    /// Entries ranked in the top `protect` at the last epoch end are not
    /// evicted (SPORE: only cold entries are).
    protect: usize,
    index: HashMap<Box<[u8]>, usize>,
    slots: Vec<EwmaSlot>,
    /// Logical time (samples seen), for recency.
    tick: u64,
    rng: u64,
}

#[derive(Clone, Debug)]
struct EwmaSlot {
    key: Box<[u8]>,
    worker: u16,
    epoch_reads: u32,
    epoch_writes: u32,
    reads: f64,
    writes: f64,
    last: u64,
    protected: bool,
}

/// How many slots an eviction looks at (approximate LRU, as Redis does).
const EVICT_SAMPLES: usize = 8;

impl SporeEwma {
    /// At most `capacity` keys; `alpha` is the weight of the epoch just
    /// ended in the average (0 < alpha ≤ 1).
    pub fn new(capacity: usize, alpha: f64) -> SporeEwma {
        let capacity = capacity.max(2);
        SporeEwma {
            capacity,
            alpha: alpha.clamp(f64::MIN_POSITIVE, 1.0),
            protect: capacity / 4,
            index: HashMap::with_capacity(capacity),
            slots: Vec::with_capacity(capacity),
            tick: 0,
            rng: 0x9E37_79B9_7F4A_7C15,
        }
    }

    fn next_rand(&mut self) -> u64 {
        // xorshift64*: a deterministic choice of eviction candidates.
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// The least recently used of a few sampled unprotected slots, if any.
    fn victim(&mut self) -> Option<usize> {
        let n = self.slots.len();
        let mut best: Option<usize> = None;
        for _ in 0..EVICT_SAMPLES {
            let i = (self.next_rand() % n as u64) as usize;
            let s = &self.slots[i];
            if s.protected {
                continue;
            }
            if best.is_none_or(|b| self.slots[b].last > s.last) {
                best = Some(i);
            }
        }
        best
    }

    fn remove_slot(&mut self, i: usize) {
        let gone = self.slots.swap_remove(i);
        self.index.remove(&gone.key);
        if i < self.slots.len() {
            let moved = self.slots[i].key.clone();
            self.index.insert(moved, i);
        }
    }
}

impl Tracker for SporeEwma {
    fn observe(&mut self, key: &[u8], kind: Access, worker: u16) {
        self.tick += 1;
        let i = match self.index.get(key) {
            Some(&i) => i,
            None => {
                if self.slots.len() >= self.capacity {
                    match self.victim() {
                        Some(v) => self.remove_slot(v),
                        // Only hot entries seen: the newcomer is not tracked.
                        None => return,
                    }
                }
                self.slots.push(EwmaSlot {
                    key: key.into(),
                    worker,
                    epoch_reads: 0,
                    epoch_writes: 0,
                    reads: 0.0,
                    writes: 0.0,
                    last: 0,
                    protected: false,
                });
                let i = self.slots.len() - 1;
                self.index.insert(key.into(), i);
                i
            }
        };
        let s = &mut self.slots[i];
        s.last = self.tick;
        s.worker = worker;
        match kind {
            Access::Read => s.epoch_reads = s.epoch_reads.saturating_add(1),
            Access::Write => s.epoch_writes = s.epoch_writes.saturating_add(1),
        }
    }

    fn end_epoch(&mut self) -> Vec<Counted> {
        let a = self.alpha;
        for s in &mut self.slots {
            s.reads = a * f64::from(s.epoch_reads) + (1.0 - a) * s.reads;
            s.writes = a * f64::from(s.epoch_writes) + (1.0 - a) * s.writes;
            s.epoch_reads = 0;
            s.epoch_writes = 0;
        }
        // Entries that decayed below a tenth of a sample are forgotten.
        let mut i = 0;
        while i < self.slots.len() {
            if self.slots[i].reads + self.slots[i].writes < 0.1 {
                self.remove_slot(i);
            } else {
                i += 1;
            }
        }
        let mut out: Vec<Counted> = self
            .slots
            .iter()
            .map(|s| Counted { key: s.key.to_vec(), worker: s.worker, reads: s.reads, writes: s.writes, error: 0.0 })
            .collect();
        sort_hottest_first(&mut out);
        let hot: std::collections::HashSet<&[u8]> = out.iter().take(self.protect).map(|c| &c.key[..]).collect();
        for s in &mut self.slots {
            s.protected = hot.contains(&s.key[..]);
        }
        out
    }

    fn len(&self) -> usize {
        self.slots.len()
    }

    fn memory_bytes(&self) -> usize {
        let keys: usize = self.slots.iter().map(|s| 2 * s.key.len()).sum();
        map_bytes(&self.index) + self.slots.capacity() * std::mem::size_of::<EwmaSlot>() + keys
    }

    fn name(&self) -> &'static str {
        "spore-ewma"
    }
}

/// Space-Saving over a min-heap, with a per-epoch decay.
#[derive(Clone, Debug)]
pub struct SpaceSaving {
    capacity: usize,
    decay: f64,
    /// Min-heap on `count`.
    heap: Vec<SsSlot>,
    /// Key → position in `heap`.
    index: HashMap<Box<[u8]>, usize>,
}

#[derive(Clone, Debug)]
struct SsSlot {
    key: Box<[u8]>,
    worker: u16,
    /// reads + writes + error: the Space-Saving counter.
    count: f64,
    reads: f64,
    writes: f64,
    error: f64,
}

impl SpaceSaving {
    /// At most `capacity` counters; each is multiplied by `decay`
    /// (0 ≤ decay < 1) at each epoch end.
    pub fn new(capacity: usize, decay: f64) -> SpaceSaving {
        let capacity = capacity.max(1);
        SpaceSaving {
            capacity,
            decay: decay.clamp(0.0, 0.999),
            heap: Vec::with_capacity(capacity),
            index: HashMap::with_capacity(capacity),
        }
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        *self.index.get_mut(&self.heap[a].key).expect("indexed") = a;
        *self.index.get_mut(&self.heap[b].key).expect("indexed") = b;
    }

    fn sift_up(&mut self, mut i: usize) {
        while i > 0 {
            let p = (i - 1) / 2;
            if self.heap[p].count <= self.heap[i].count {
                break;
            }
            self.swap(p, i);
            i = p;
        }
    }

    fn sift_down(&mut self, mut i: usize) {
        let n = self.heap.len();
        loop {
            let (l, r) = (2 * i + 1, 2 * i + 2);
            let mut m = i;
            if l < n && self.heap[l].count < self.heap[m].count {
                m = l;
            }
            if r < n && self.heap[r].count < self.heap[m].count {
                m = r;
            }
            if m == i {
                return;
            }
            self.swap(i, m);
            i = m;
        }
    }
}

impl Tracker for SpaceSaving {
    fn observe(&mut self, key: &[u8], kind: Access, worker: u16) {
        let i = match self.index.get(key) {
            Some(&i) => i,
            None if self.heap.len() < self.capacity => {
                let slot = SsSlot { key: key.into(), worker, count: 0.0, reads: 0.0, writes: 0.0, error: 0.0 };
                self.heap.push(slot);
                let i = self.heap.len() - 1;
                self.index.insert(key.into(), i);
                self.sift_up(i);
                self.index[key]
            }
            None => {
                // Replace the smallest counter; the newcomer inherits it.
                let old = std::mem::replace(&mut self.heap[0].key, key.into());
                self.index.remove(&old);
                self.index.insert(key.into(), 0);
                let s = &mut self.heap[0];
                s.error = s.count;
                s.reads = 0.0;
                s.writes = 0.0;
                0
            }
        };
        let s = &mut self.heap[i];
        s.worker = worker;
        s.count += 1.0;
        match kind {
            Access::Read => s.reads += 1.0,
            Access::Write => s.writes += 1.0,
        }
        self.sift_down(i);
    }

    fn end_epoch(&mut self) -> Vec<Counted> {
        // A counter that has been decayed at every epoch end holds
        // c / (1 - decay) for a steady c per epoch: scale back.
        let scale = 1.0 - self.decay;
        let mut out: Vec<Counted> = self
            .heap
            .iter()
            .map(|s| Counted {
                key: s.key.to_vec(),
                worker: s.worker,
                reads: s.reads * scale,
                writes: s.writes * scale,
                error: s.error * scale,
            })
            .collect();
        sort_hottest_first(&mut out);
        // Multiplying every count by one factor keeps the heap order.
        for s in &mut self.heap {
            s.count *= self.decay;
            s.reads *= self.decay;
            s.writes *= self.decay;
            s.error *= self.decay;
        }
        out
    }

    fn len(&self) -> usize {
        self.heap.len()
    }

    fn memory_bytes(&self) -> usize {
        let keys: usize = self.heap.iter().map(|s| 2 * s.key.len()).sum();
        map_bytes(&self.index) + self.heap.capacity() * std::mem::size_of::<SsSlot>() + keys
    }

    fn name(&self) -> &'static str {
        "space-saving"
    }
}

/// Lossy counting, one window per epoch (NetKV §IV-A).
#[derive(Clone, Debug)]
pub struct LossyCounter {
    /// Bucket width, ceil(1/epsilon).
    width: u64,
    /// Samples this epoch.
    n: u64,
    entries: HashMap<Box<[u8]>, LossySlot>,
}

#[derive(Clone, Copy, Debug)]
struct LossySlot {
    worker: u16,
    reads: u64,
    writes: u64,
    /// The most the key may have been undercounted (bucket at insertion − 1).
    delta: u64,
}

impl LossyCounter {
    /// Error bound `epsilon` (0 < epsilon < 1): a key with frequency above
    /// epsilon·N is never lost; at most (1/epsilon)·log(epsilon·N) entries.
    pub fn new(epsilon: f64) -> LossyCounter {
        let width = (1.0 / epsilon.clamp(1e-9, 1.0)).ceil() as u64;
        LossyCounter { width: width.max(1), n: 0, entries: HashMap::new() }
    }

    fn bucket(&self) -> u64 {
        self.n.div_ceil(self.width)
    }
}

impl Tracker for LossyCounter {
    fn observe(&mut self, key: &[u8], kind: Access, worker: u16) {
        self.n += 1;
        let b = self.bucket();
        let e = match self.entries.get_mut(key) {
            Some(e) => e,
            None => self.entries.entry(key.into()).or_insert(LossySlot { worker, reads: 0, writes: 0, delta: b - 1 }),
        };
        e.worker = worker;
        match kind {
            Access::Read => e.reads += 1,
            Access::Write => e.writes += 1,
        }
        if self.n.is_multiple_of(self.width) {
            self.entries.retain(|_, e| e.reads + e.writes + e.delta > b);
        }
    }

    fn end_epoch(&mut self) -> Vec<Counted> {
        let mut out: Vec<Counted> = self
            .entries
            .iter()
            .map(|(k, e)| Counted {
                key: k.to_vec(),
                worker: e.worker,
                reads: e.reads as f64,
                writes: e.writes as f64,
                error: 0.0,
            })
            .collect();
        sort_hottest_first(&mut out);
        self.entries.clear();
        self.n = 0;
        out
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    fn memory_bytes(&self) -> usize {
        map_bytes(&self.entries) + self.entries.keys().map(|k| k.len()).sum::<usize>()
    }

    fn name(&self) -> &'static str {
        "lossy"
    }
}

/// Which tracker [`crate::hot::HotKeys`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum TrackerKind {
    /// [`SporeEwma`] with `alpha` = 1 − `decay`.
    SporeEwma,
    /// [`SpaceSaving`] with `decay`.
    SpaceSaving,
    /// [`LossyCounter`] with epsilon = 1 / capacity.
    Lossy,
}

use serde::{Deserialize, Serialize};

/// A tracker of `kind` with room for `capacity` keys and the per-epoch
/// `decay` of old counts (ignored by the lossy counter, which restarts
/// each epoch).
pub fn build(kind: TrackerKind, capacity: usize, decay: f64) -> Box<dyn Tracker + Send> {
    match kind {
        TrackerKind::SporeEwma => Box::new(SporeEwma::new(capacity, 1.0 - decay)),
        TrackerKind::SpaceSaving => Box::new(SpaceSaving::new(capacity, decay)),
        TrackerKind::Lossy => Box::new(LossyCounter::new(1.0 / capacity.max(1) as f64)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic skewed stream: key i (1-based) appears about
    /// 1000/i times, interleaved with `noise` distinct one-off keys.
    fn skewed(keys: u32, noise: u32) -> Vec<Vec<u8>> {
        let mut v = Vec::new();
        for i in 1..=keys {
            for _ in 0..(1000 / i) {
                v.push(format!("k{i}").into_bytes());
            }
        }
        for j in 0..noise {
            let at = (j as usize * 7919) % v.len();
            v.insert(at, format!("noise{j}").into_bytes());
        }
        // Interleave deterministically so no key comes in one run.
        let n = v.len();
        let mut out = vec![Vec::new(); n];
        let step = 7919 % n.max(1);
        let mut at = 0;
        for k in v {
            while !out[at].is_empty() {
                at = (at + 1) % n;
            }
            out[at] = k;
            at = (at + step) % n;
        }
        out
    }

    fn top_keys(c: &[Counted], k: usize) -> Vec<String> {
        c.iter().take(k).map(|c| String::from_utf8(c.key.clone()).unwrap()).collect()
    }

    fn all() -> Vec<Box<dyn Tracker + Send>> {
        vec![
            build(TrackerKind::SporeEwma, 64, 0.5),
            build(TrackerKind::SpaceSaving, 64, 0.5),
            build(TrackerKind::Lossy, 64, 0.5),
        ]
    }

    #[test]
    fn every_tracker_finds_the_top_keys_of_a_skewed_stream() {
        let stream = skewed(200, 2000);
        for mut t in all() {
            for k in &stream {
                t.observe(k, Access::Read, 3);
            }
            let out = t.end_epoch();
            let top = top_keys(&out, 5);
            if t.name() == "spore-ewma" {
                // Its LRU admission can evict a hot key before its first
                // epoch ends (measured in tests/hot_trackers.rs): only the
                // hottest is sure to be kept.
                assert_eq!(top[0], "k1");
                assert!(top.iter().filter(|k| ["k1", "k2", "k3", "k4", "k5"].contains(&k.as_str())).count() >= 3);
            } else {
                assert_eq!(top, ["k1", "k2", "k3", "k4", "k5"], "{}", t.name());
            }
            assert_eq!(out[0].worker, 3);
            assert!(t.len() <= 64 || t.name() == "lossy", "{} holds {}", t.name(), t.len());
            assert!(t.memory_bytes() > 0);
        }
    }

    #[test]
    fn estimates_are_close_for_the_hottest_key() {
        let stream = skewed(200, 2000);
        for mut t in all() {
            for k in &stream {
                t.observe(k, Access::Read, 0);
            }
            let out = t.end_epoch();
            // k1 appears 1000 times; the EWMA and decayed counts report
            // (1 − decay) of it after one epoch, the lossy counter all.
            let want = if t.name() == "lossy" { 1000.0 } else { 500.0 };
            let got = out[0].total();
            assert!((got - want).abs() <= want * 0.05, "{}: {got} vs {want}", t.name());
        }
    }

    #[test]
    fn reads_and_writes_are_kept_apart() {
        for mut t in all() {
            for i in 0..100 {
                t.observe(b"hot", if i % 4 == 0 { Access::Write } else { Access::Read }, 1);
            }
            let out = t.end_epoch();
            let c = &out[0];
            assert!((c.writes / (c.reads + c.writes) - 0.25).abs() < 1e-9, "{}: {c:?}", t.name());
        }
    }

    #[test]
    fn a_hot_set_that_moves_is_followed() {
        for mut t in all() {
            for _ in 0..3 {
                for i in 0..1000u32 {
                    let k = if i % 2 == 0 { b"old".to_vec() } else { format!("c{i}").into_bytes() };
                    t.observe(&k, Access::Read, 0);
                }
                t.end_epoch();
            }
            let mut last = Vec::new();
            for _ in 0..3 {
                for i in 0..1000u32 {
                    let k = if i % 2 == 0 { b"new".to_vec() } else { format!("d{i}").into_bytes() };
                    t.observe(&k, Access::Read, 0);
                }
                last = t.end_epoch();
            }
            assert_eq!(top_keys(&last, 1), ["new"], "{}", t.name());
            let old = last.iter().find(|c| c.key == b"old").map_or(0.0, |c| c.total());
            assert!(old < last[0].total() / 4.0, "{}: old still {old}", t.name());
        }
    }

    #[test]
    fn space_saving_overestimates_by_at_most_its_error() {
        let mut t = SpaceSaving::new(16, 0.0);
        let stream = skewed(100, 500);
        let mut exact: HashMap<Vec<u8>, f64> = HashMap::new();
        for k in &stream {
            t.observe(k, Access::Read, 0);
            *exact.entry(k.clone()).or_default() += 1.0;
        }
        for c in t.end_epoch() {
            let truth = exact[&c.key];
            assert!(c.total() >= truth - 1e-9, "{c:?} under {truth}");
            assert!(c.reads <= truth + 1e-9, "guaranteed part {} over {truth}", c.reads);
        }
    }

    #[test]
    fn lossy_counting_never_loses_a_key_above_epsilon_n() {
        let mut t = LossyCounter::new(0.01);
        let stream = skewed(300, 3000);
        let mut exact: HashMap<Vec<u8>, u64> = HashMap::new();
        for k in &stream {
            t.observe(k, Access::Read, 0);
            *exact.entry(k.clone()).or_default() += 1;
        }
        let n = stream.len() as f64;
        let out = t.end_epoch();
        for (k, &f) in &exact {
            if f as f64 > 0.01 * n {
                let c = out.iter().find(|c| &c.key == k).expect("kept");
                assert!(c.reads as u64 >= f - (0.01 * n) as u64 - 1 && c.reads as u64 <= f);
            }
        }
        assert!(t.is_empty(), "an epoch restarts the window");
    }
}
