//! Workloads: key distributions (scrambled Zipfian, hotspot, uniform), read/update mixes
//! (MBal Table 4) and the phase timeline (`--phases "a:10,b:10"`).

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use mbal_cluster::KeySpace;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde::{Deserialize, Serialize};

/// A named workload (the `--workload` flag and the names in `--phases`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    /// MBal A: 100% read, Zipfian keys.
    A,
    /// MBal B: 95% read / 5% update, hotspot keys (`--hot-ops` of ops on `--hot-fraction` of keys).
    B,
    /// MBal C: 50% read / 50% update, Zipfian keys.
    C,
    /// Uniform keys, `--read-ratio` reads.
    Uniform,
    /// `--dist` keys, `--read-ratio` reads.
    Custom,
    /// Hot partition: 95% read / 5% update, `--hot-ops` of ops on the keys of `--hot-cachelets`
    /// chosen cachelets (a sustained hot shard), the rest on all other keys; uniform within each.
    Hotpart,
}

impl WorkloadKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::A => "a",
            WorkloadKind::B => "b",
            WorkloadKind::C => "c",
            WorkloadKind::Uniform => "uniform",
            WorkloadKind::Custom => "custom",
            WorkloadKind::Hotpart => "hotpart",
        }
    }

    pub fn parse(s: &str) -> Result<WorkloadKind> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "a" => WorkloadKind::A,
            "b" => WorkloadKind::B,
            "c" => WorkloadKind::C,
            "uniform" | "u" => WorkloadKind::Uniform,
            "custom" => WorkloadKind::Custom,
            "hotpart" => WorkloadKind::Hotpart,
            other => bail!("unknown workload {other:?} (expected a, b, c, uniform, custom or hotpart)"),
        })
    }
}

/// Key distribution (`--dist`, used by `--workload custom`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DistKind {
    Zipf,
    Hotspot,
    Uniform,
    /// Keys of chosen cachelets are hot (`--hot-cachelets`, `--hot-ops`).
    Hotpart,
}

/// The parameters every workload needs, taken from the flags.
#[derive(Clone, Debug)]
pub struct WorkloadParams {
    pub keys: u32,
    pub zipf: f64,
    pub hot_fraction: f64,
    pub hot_ops: f64,
    pub read_ratio: f64,
    pub dist: DistKind,
    /// Hot partition: key index -> is it in a hot cachelet (None unless a workload needs it).
    pub hot_keys: Option<Arc<Vec<bool>>>,
}

/// A concrete mix: read ratio and key distribution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mix {
    pub read_ratio: f64,
    pub dist: DistKind,
}

pub fn mix_of(kind: WorkloadKind, p: &WorkloadParams) -> Mix {
    match kind {
        WorkloadKind::A => Mix { read_ratio: 1.0, dist: DistKind::Zipf },
        WorkloadKind::B => Mix { read_ratio: 0.95, dist: DistKind::Hotspot },
        WorkloadKind::C => Mix { read_ratio: 0.5, dist: DistKind::Zipf },
        WorkloadKind::Uniform => Mix { read_ratio: p.read_ratio, dist: DistKind::Uniform },
        WorkloadKind::Custom => Mix { read_ratio: p.read_ratio, dist: p.dist },
        WorkloadKind::Hotpart => Mix { read_ratio: 0.95, dist: DistKind::Hotpart },
    }
}

/// One phase of a timeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    pub workload: WorkloadKind,
    pub secs: f64,
    /// Which hot set: skewed distributions map rank r to key `perm[r]` with a
    /// permutation seeded by this (`NAME@K:SECONDS`), so a later phase with
    /// another K makes other keys hot (a shifting hot set).
    #[serde(default)]
    pub hot_set: u32,
}

/// Parse `"a:10,b:10,c:5.5"` into phases. Every phase needs a positive duration.
/// `"c:10,c@1:10"`: the same workload, another hot set from t = 10 s.
pub fn parse_phases(s: &str) -> Result<Vec<Phase>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, secs) =
            part.split_once(':').with_context(|| format!("phase {part:?} must look like NAME:SECONDS"))?;
        let (name, hot_set) = match name.split_once('@') {
            Some((n, k)) => (n, k.trim().parse().with_context(|| format!("phase {part:?}: bad hot set {k:?}"))?),
            None => (name, 0),
        };
        let workload = WorkloadKind::parse(name)?;
        let secs: f64 = secs.trim().parse().with_context(|| format!("phase {part:?}: bad seconds {secs:?}"))?;
        if !(secs.is_finite() && secs > 0.0) {
            bail!("phase {part:?}: seconds must be > 0");
        }
        out.push(Phase { workload, secs, hot_set });
    }
    if out.is_empty() {
        bail!("--phases is empty");
    }
    Ok(out)
}

/// Index of the phase active at `t` seconds (the last one stays active past the end).
pub fn phase_at(phases: &[Phase], t: f64) -> usize {
    let mut acc = 0.0;
    for (i, p) in phases.iter().enumerate() {
        acc += p.secs;
        if t < acc {
            return i;
        }
    }
    phases.len().saturating_sub(1)
}

/// A fixed pseudo-random permutation of `0..n` (seeded, identical for every run and thread):
/// rank r of a skewed distribution maps to key `perm[r]`, so hot keys are scattered over the
/// key space instead of being lexicographically adjacent (YCSB's "scrambled zipfian").
pub fn scramble_permutation(n: u32, seed: u64) -> Vec<u32> {
    let mut perm: Vec<u32> = (0..n).collect();
    let mut rng = SmallRng::seed_from_u64(seed);
    // Fisher-Yates
    for i in (1..perm.len()).rev() {
        let j = rng.gen_range(0..=i);
        perm.swap(i, j);
    }
    perm
}

/// Draws key indices from one distribution.
pub enum KeyGen {
    Zipf {
        zipf: Zipf<f64>,
        perm: Arc<Vec<u32>>,
    },
    Hotspot {
        hot_n: u32,
        n: u32,
        hot_ops: f64,
        perm: Arc<Vec<u32>>,
    },
    Uniform {
        n: u32,
    },
    /// Key indices of the hot cachelets and of all others.
    Hotpart {
        hot: Arc<Vec<u32>>,
        cold: Arc<Vec<u32>>,
        hot_ops: f64,
    },
}

impl KeyGen {
    pub fn new(dist: DistKind, p: &WorkloadParams, perm: Arc<Vec<u32>>) -> Result<KeyGen> {
        let n = p.keys;
        if n == 0 {
            bail!("--keys must be > 0");
        }
        Ok(match dist {
            DistKind::Zipf => {
                let zipf = Zipf::new(n as u64, p.zipf).map_err(|e| anyhow::anyhow!("bad --zipf {}: {e:?}", p.zipf))?;
                KeyGen::Zipf { zipf, perm }
            }
            DistKind::Hotspot => {
                if !(0.0..=1.0).contains(&p.hot_fraction) || !(0.0..=1.0).contains(&p.hot_ops) {
                    bail!("--hot-fraction and --hot-ops must be in [0, 1]");
                }
                let hot_n = ((n as f64 * p.hot_fraction).round() as u32).clamp(1, n);
                KeyGen::Hotspot { hot_n, n, hot_ops: p.hot_ops, perm }
            }
            DistKind::Uniform => KeyGen::Uniform { n },
            DistKind::Hotpart => {
                if !(0.0..=1.0).contains(&p.hot_ops) {
                    bail!("--hot-ops must be in [0, 1]");
                }
                let marks = p.hot_keys.as_ref().context("the hot-partition workload needs its hot cachelets")?;
                let (hot, cold): (Vec<u32>, Vec<u32>) = (0..n).partition(|&i| marks[i as usize]);
                if hot.is_empty() {
                    bail!("no key of the {n} falls in a hot cachelet: use more --keys or other --hot-cachelets");
                }
                KeyGen::Hotpart { hot: Arc::new(hot), cold: Arc::new(cold), hot_ops: p.hot_ops }
            }
        })
    }

    #[inline]
    pub fn next<R: Rng>(&self, rng: &mut R) -> u32 {
        match self {
            KeyGen::Zipf { zipf, perm } => {
                let rank = zipf.sample(rng) as usize; // 1..=n
                perm[(rank.max(1) - 1).min(perm.len() - 1)]
            }
            KeyGen::Hotspot { hot_n, n, hot_ops, perm } => {
                let i = if *hot_n >= *n || rng.gen::<f64>() < *hot_ops {
                    rng.gen_range(0..*hot_n)
                } else {
                    rng.gen_range(*hot_n..*n)
                };
                perm[i as usize]
            }
            KeyGen::Uniform { n } => rng.gen_range(0..*n),
            KeyGen::Hotpart { hot, cold, hot_ops } => {
                let set = if cold.is_empty() || rng.gen::<f64>() < *hot_ops { hot } else { cold };
                set[rng.gen_range(0..set.len())]
            }
        }
    }
}

/// Key lengths: `min` bytes, or when `max > min`, a length in `min..=max` fixed per key index
/// (a hash of the index: the same key always has the same length; `--key-size-max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySize {
    pub min: usize,
    pub max: usize,
}

impl KeySize {
    pub fn fixed(n: usize) -> KeySize {
        KeySize { min: n, max: n }
    }

    /// The length of key `idx`.
    #[inline]
    pub fn of(self, idx: u32) -> usize {
        if self.max <= self.min {
            return self.min;
        }
        let h = (u64::from(idx).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize;
        self.min + h % (self.max - self.min + 1)
    }
}

impl From<usize> for KeySize {
    fn from(n: usize) -> KeySize {
        KeySize::fixed(n)
    }
}

/// Format key `idx` into `out` as `k` + zero-padded decimal, exactly `key_size.of(idx)` bytes.
#[inline]
pub fn write_key(out: &mut Vec<u8>, idx: u32, key_size: impl Into<KeySize>) {
    let mut b = itoa::Buffer::new();
    let d = b.format(idx).as_bytes();
    out.push(b'k');
    let pad = key_size.into().of(idx).saturating_sub(1 + d.len());
    out.extend(std::iter::repeat_n(b'0', pad));
    out.extend_from_slice(d);
}

/// Which of keys `0..keys` (formatted as `write_key` does) fall in one of `hot` cachelets of
/// `space`: the hot partition's keys.
pub fn hot_partition_keys(space: &KeySpace, hot: &[u32], keys: u32, key_size: KeySize) -> Vec<bool> {
    let mut is_hot = vec![false; space.cachelet_count() as usize];
    for &c in hot {
        if let Some(h) = is_hot.get_mut(c as usize) {
            *h = true;
        }
    }
    let mut buf = Vec::with_capacity(key_size.max);
    (0..keys)
        .map(|i| {
            buf.clear();
            write_key(&mut buf, i, key_size);
            is_hot[space.cachelet_of_key(&buf) as usize]
        })
        .collect()
}

/// Smallest key size that can hold `keys` distinct keys.
pub fn min_key_size(keys: u32) -> usize {
    1 + itoa::Buffer::new().format(keys.saturating_sub(1)).len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(n: u32) -> WorkloadParams {
        WorkloadParams {
            keys: n,
            zipf: 0.99,
            hot_fraction: 0.05,
            hot_ops: 0.95,
            read_ratio: 0.95,
            dist: DistKind::Zipf,
            hot_keys: None,
        }
    }

    #[test]
    fn variable_key_sizes_are_fixed_per_key_and_cover_the_range() {
        let ks = KeySize { min: 10, max: 24 };
        let mut seen = [0u32; 25];
        let mut buf = Vec::new();
        for i in 0..100_000u32 {
            buf.clear();
            write_key(&mut buf, i, ks);
            assert_eq!(buf.len(), ks.of(i));
            assert!((10..=24).contains(&buf.len()));
            let again = {
                let mut b = Vec::new();
                write_key(&mut b, i, ks);
                b
            };
            assert_eq!(buf, again, "the same key every time");
            seen[buf.len()] += 1;
        }
        // Every length occurs, none far from its share (100,000 / 15).
        assert!(seen[10..=24].iter().all(|&n| (5_000..8_500).contains(&n)), "{seen:?}");
        assert_eq!(KeySize::fixed(10).of(7), 10);
    }

    #[test]
    fn hot_partition_keys_are_those_of_the_hot_cachelets() {
        let space = KeySpace::even(64, 16_384);
        let n = 50_000;
        let marks = hot_partition_keys(&space, &[3, 40], n, KeySize::fixed(10));
        let mut buf = Vec::new();
        for i in 0..n {
            buf.clear();
            write_key(&mut buf, i, 10);
            let c = space.cachelet_of_key(&buf);
            assert_eq!(marks[i as usize], c == 3 || c == 40, "key {i} of cachelet {c}");
        }
        // about 2/64 of the keys
        let hot = marks.iter().filter(|&&h| h).count();
        assert!((1_000..2_200).contains(&hot), "{hot} hot keys");

        let p = WorkloadParams { hot_keys: Some(Arc::new(marks.clone())), hot_ops: 0.9, ..params(n) };
        let g = KeyGen::new(DistKind::Hotpart, &p, Arc::new(Vec::new())).unwrap();
        let mut rng = SmallRng::seed_from_u64(4);
        let samples = 100_000;
        let on_hot = (0..samples).filter(|_| marks[g.next(&mut rng) as usize]).count();
        let frac = on_hot as f64 / samples as f64;
        assert!((frac - 0.9).abs() < 0.01, "{frac} of ops on the hot cachelets");
        // a hot partition that holds no key is an error, not an empty generator
        let none = WorkloadParams { hot_keys: Some(Arc::new(vec![false; n as usize])), ..params(n) };
        assert!(KeyGen::new(DistKind::Hotpart, &none, Arc::new(Vec::new())).is_err());
    }

    #[test]
    fn zipf_rank_frequencies_match_theory() {
        let n = 1000u32;
        let s = 0.99;
        let ident: Arc<Vec<u32>> = Arc::new((0..n).collect());
        let g = KeyGen::new(DistKind::Zipf, &params(n), ident).unwrap();
        let mut rng = SmallRng::seed_from_u64(7);
        let samples = 1_000_000;
        let mut counts = vec![0u64; n as usize];
        for _ in 0..samples {
            counts[g.next(&mut rng) as usize] += 1;
        }
        let h: f64 = (1..=n).map(|k| 1.0 / (k as f64).powf(s)).sum();
        for k in 1..=10u32 {
            let expect = (1.0 / (k as f64).powf(s)) / h;
            let got = counts[(k - 1) as usize] as f64 / samples as f64;
            let rel = (got - expect).abs() / expect;
            assert!(rel < 0.04, "rank {k}: got {got:.5}, expected {expect:.5} (rel err {rel:.3})");
        }
    }

    #[test]
    fn scrambled_zipf_hot_keys_are_spread() {
        let n = 100_000;
        let perm = Arc::new(scramble_permutation(n, 42));
        // a permutation
        let mut seen = vec![false; n as usize];
        for &k in perm.iter() {
            assert!(!seen[k as usize]);
            seen[k as usize] = true;
        }
        // the 10 hottest ranks are not adjacent keys
        let mut hot: Vec<u32> = perm[..10].to_vec();
        hot.sort();
        let adjacent = hot.windows(2).filter(|w| w[1] - w[0] == 1).count();
        assert!(adjacent <= 1, "hot keys adjacent: {hot:?}");
        // and the hottest key really is perm[0]
        let g = KeyGen::new(DistKind::Zipf, &params(n), perm.clone()).unwrap();
        let mut rng = SmallRng::seed_from_u64(1);
        let hits = (0..100_000).filter(|_| g.next(&mut rng) == perm[0]).count();
        assert!(hits > 5_000, "hottest key drawn {hits} times");
    }

    #[test]
    fn hotspot_distribution() {
        let n = 100_000;
        let perm = Arc::new(scramble_permutation(n, 3));
        let p = params(n);
        let g = KeyGen::new(DistKind::Hotspot, &p, perm.clone()).unwrap();
        let hot: std::collections::HashSet<u32> = perm[..5_000].iter().copied().collect();
        let mut rng = SmallRng::seed_from_u64(9);
        let samples = 200_000;
        let in_hot = (0..samples).filter(|_| hot.contains(&g.next(&mut rng))).count();
        let frac = in_hot as f64 / samples as f64;
        assert!((frac - 0.95).abs() < 0.005, "hot fraction of ops {frac}");
        // cold keys are drawn too, and never out of range
        for _ in 0..10_000 {
            assert!(g.next(&mut rng) < n);
        }
    }

    #[test]
    fn uniform_covers_range() {
        let p = params(10);
        let g = KeyGen::new(DistKind::Uniform, &p, Arc::new(vec![])).unwrap();
        let mut rng = SmallRng::seed_from_u64(5);
        let mut c = [0u32; 10];
        for _ in 0..10_000 {
            c[g.next(&mut rng) as usize] += 1;
        }
        assert!(c.iter().all(|&x| (800..1200).contains(&x)), "{c:?}");
    }

    #[test]
    fn phase_parser() {
        let p = parse_phases("a:10, b:2.5,C:1").unwrap();
        assert_eq!(
            p,
            vec![
                Phase { workload: WorkloadKind::A, secs: 10.0, hot_set: 0 },
                Phase { workload: WorkloadKind::B, secs: 2.5, hot_set: 0 },
                Phase { workload: WorkloadKind::C, secs: 1.0, hot_set: 0 },
            ]
        );
        assert_eq!(phase_at(&p, 0.0), 0);
        assert_eq!(phase_at(&p, 9.99), 0);
        let shift = parse_phases("a:5,a@1:5").unwrap();
        assert_eq!((shift[0].hot_set, shift[1].hot_set), (0, 1), "a shifting hot set");
        assert!(parse_phases("a@x:5").is_err());
        assert_eq!(phase_at(&p, 10.0), 1);
        assert_eq!(phase_at(&p, 12.6), 2);
        assert_eq!(phase_at(&p, 100.0), 2);
        assert!(parse_phases("a").is_err());
        assert!(parse_phases("x:1").is_err());
        assert!(parse_phases("a:0").is_err());
        assert!(parse_phases("a:-1").is_err());
        assert!(parse_phases("").is_err());
    }

    #[test]
    fn key_format() {
        let mut v = Vec::new();
        write_key(&mut v, 123, 10);
        assert_eq!(v, b"k000000123");
        assert_eq!(min_key_size(100_000), 6);
        assert_eq!(min_key_size(1), 2);
    }
}
