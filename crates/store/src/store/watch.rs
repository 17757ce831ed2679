//! What Phase 1 (hot-key replication, DESIGN.md §6) needs to see of a
//! worker's traffic, noted where the store counts reads and writes so that
//! every protocol and every path (local or forwarded) is covered once:
//!
//! * a **sample** of the keys read and written (one access in `period` on
//!   average, at random gaps so that a pipeline's rhythm cannot hide a key),
//!   which the worker hands to the controller's hot-key tracker each epoch;
//! * the **writes to replicated keys**: a key whose hash is in the watched
//!   set is noted as dirty when it is written, and the worker copies it to
//!   its replicas after the request.
//!
//! With sampling off and nothing watched, each access costs two branches.

use std::collections::HashSet;

/// The sampler and the watched keys of one worker's store.
#[derive(Debug)]
pub struct KeyWatch {
    /// Mean accesses between two samples; 0: sampling off.
    period: u32,
    countdown: u32,
    rng: u64,
    samples: Vec<(Box<[u8]>, bool)>,
    max_samples: usize,
    watched: HashSet<u64>,
    dirty: Vec<(u64, Box<[u8]>)>,
    /// Accesses seen while sampling is on (reads and writes), for a
    /// worker's load between two epochs.
    accesses: u64,
}

impl Default for KeyWatch {
    fn default() -> Self {
        KeyWatch {
            period: 0,
            countdown: 0,
            rng: 0x9E37_79B9_7F4A_7C15,
            samples: Vec::new(),
            max_samples: 0,
            watched: HashSet::new(),
            dirty: Vec::new(),
            accesses: 0,
        }
    }
}

impl KeyWatch {
    /// Sample about `rate` of all accesses (0 turns sampling off), keeping
    /// at most `max_samples` until they are taken.
    pub fn set_sampling(&mut self, rate: f64, max_samples: usize, seed: u64) {
        self.period = if rate > 0.0 { (1.0 / rate.min(1.0)).round().max(1.0) as u32 } else { 0 };
        self.max_samples = max_samples;
        self.rng ^= seed.wrapping_mul(0xBF58_476D_1CE4_E5B9) | 1;
        self.countdown = self.gap();
    }

    /// Sample about `rate` of all accesses from now on (0 turns sampling
    /// off), keeping the bound and the random sequence.
    pub fn set_rate(&mut self, rate: f64) {
        let period = if rate > 0.0 { (1.0 / rate.min(1.0)).round().max(1.0) as u32 } else { 0 };
        if period != self.period {
            self.period = period;
            self.countdown = self.gap();
        }
    }

    /// A gap drawn uniformly from 1..=2·period−1 (mean `period`).
    fn gap(&mut self) -> u32 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let span = u64::from(self.period.max(1)) * 2 - 1;
        1 + (r % span) as u32
    }

    #[inline]
    fn tick(&mut self, key: &[u8], write: bool) {
        self.accesses = self.accesses.wrapping_add(1);
        self.countdown -= 1;
        if self.countdown == 0 {
            self.countdown = self.gap();
            if self.samples.len() < self.max_samples {
                self.samples.push((key.into(), write));
            }
        }
    }

    /// A read of `key` (counted where the store counts a read).
    #[inline]
    pub(crate) fn read(&mut self, key: &[u8]) {
        if self.period != 0 {
            self.tick(key, false);
        }
    }

    /// A write of `key` (counted where the store counts a write).
    #[inline]
    pub(crate) fn write(&mut self, hash: u64, key: &[u8]) {
        if self.period != 0 {
            self.tick(key, true);
        }
        if !self.watched.is_empty() && self.watched.contains(&hash) {
            self.dirty.push((hash, key.into()));
        }
    }

    /// The samples since the last call, `true` for a write.
    pub fn take_samples(&mut self) -> Vec<(Box<[u8]>, bool)> {
        std::mem::take(&mut self.samples)
    }

    /// The samples taken since there were `from` (a copy: they are still
    /// taken by [`take_samples`](Self::take_samples)).
    pub fn samples_since(&self, from: usize) -> Vec<(Box<[u8]>, bool)> {
        self.samples.get(from..).map(<[_]>::to_vec).unwrap_or_default()
    }

    /// Samples held now.
    pub fn sample_count(&self) -> usize {
        self.samples.len()
    }

    /// Reads and writes seen while sampling was on, since the start
    /// (wrapping): the difference of two readings is the accesses between.
    pub fn accesses(&self) -> u64 {
        self.accesses
    }

    /// Note writes to the key with this hash from now on.
    pub fn watch(&mut self, hash: u64) {
        self.watched.insert(hash);
    }

    pub fn unwatch(&mut self, hash: u64) {
        self.watched.remove(&hash);
    }

    pub fn is_watched(&self, hash: u64) -> bool {
        self.watched.contains(&hash)
    }

    /// Whether a watched key was written since the last [`take_dirty`](Self::take_dirty).
    #[inline]
    pub fn has_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// The keys of `take_dirty`, without taking them.
    pub fn dirty_keys(&self) -> impl Iterator<Item = &[u8]> {
        self.dirty.iter().map(|(_, k)| &k[..])
    }

    /// The watched keys written since the last call, in write order (a key
    /// written twice appears twice).
    pub fn take_dirty(&mut self) -> Vec<(u64, Box<[u8]>)> {
        std::mem::take(&mut self.dirty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_about_the_rate_and_respects_the_cap() {
        let mut w = KeyWatch::default();
        w.set_sampling(0.05, 100_000, 7);
        for i in 0..100_000u32 {
            w.read(&i.to_le_bytes());
        }
        let n = w.take_samples().len();
        assert!((4_000..6_000).contains(&n), "{n} samples of 100000 at 5%");
        w.set_sampling(1.0, 10, 1);
        for i in 0..100u32 {
            w.read(&i.to_le_bytes());
        }
        assert_eq!(w.take_samples().len(), 10);
    }

    #[test]
    fn counts_accesses_and_shows_the_samples_since_a_mark() {
        let mut w = KeyWatch::default();
        w.set_sampling(1.0, 100, 3);
        w.read(b"a");
        let mark = w.sample_count();
        w.read(b"b");
        w.write(1, b"c");
        assert_eq!(w.accesses(), 3);
        let since: Vec<(Box<[u8]>, bool)> = vec![(b"b"[..].into(), false), (b"c"[..].into(), true)];
        assert_eq!(w.samples_since(mark), since);
        assert_eq!(w.take_samples().len(), 3, "still all taken at the epoch's end");
        assert!(w.samples_since(mark).is_empty());
    }

    #[test]
    fn off_means_nothing_sampled_and_only_watched_writes_are_dirty() {
        let mut w = KeyWatch::default();
        w.read(b"a");
        w.write(1, b"a");
        assert!(w.take_samples().is_empty());
        assert!(!w.has_dirty());
        w.watch(2);
        w.write(1, b"a");
        w.write(2, b"b");
        w.write(2, b"b");
        assert_eq!(w.take_dirty(), vec![(2, b"b"[..].into()), (2, b"b"[..].into())]);
        w.unwatch(2);
        w.write(2, b"b");
        assert!(!w.has_dirty());
    }
}
