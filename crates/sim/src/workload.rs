//! The simulated clients' key distributions, as probabilities per key and
//! per cachelet. The sim does not draw requests one by one: each epoch it
//! draws each cachelet's request count from a Poisson law whose mean is the
//! offered rate x the cachelet's share of the keys' probability mass
//! (`crate` docs say why). The masses are exactly those of `mbal bench`'s
//! generators (`mbal_bench::workload::KeyGen`: rand_distr's Zipf over
//! ranks, ranks scrambled onto keys by the same permutation, the same
//! hotspot and hot-partition rules), and the keys are the bench's keys
//! (`k` + zero-padded index) routed by the real key hash and key space.

use anyhow::{bail, Result};
use mbal_bench::workload::{scramble_permutation, write_key};
use mbal_cluster::{ClusterMap, KeySpace};

/// The key distribution (`--workload`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dist {
    /// Zipf(`--zipf`) over ranks, scrambled over the keys (YCSB A's keys).
    Zipf,
    /// `--hot-ops` of requests on `--hot-fraction` of the keys (YCSB B's keys).
    Hotspot,
    /// `--hot-ops` of requests on the keys of `--hot-cachelets` cachelets of one worker.
    Hotpart,
    /// `--hot-ops` of requests on the keys of every cachelet of one server (every worker of it
    /// hot alike: Phase 2 has nowhere to go, only Phase 3 helps).
    Hotserver,
    /// Every key alike.
    Uniform,
}

/// What a distribution needs.
#[derive(Clone, Debug)]
pub struct Params {
    pub dist: Dist,
    pub keys: u32,
    pub zipf: f64,
    pub hot_fraction: f64,
    pub hot_ops: f64,
    pub hot_cachelets: u32,
}

/// The permutation of hot set `h`: the bench's (`NAME@h` in `--phases`).
pub fn perm_of(keys: u32, hot_set: u32) -> Vec<u32> {
    scramble_permutation(keys, 0x6d62_616c + u64::from(hot_set))
}

/// Each key's cachelet (keys formatted as the bench does).
pub fn key_cachelets(space: &KeySpace, keys: u32) -> Vec<u32> {
    let size = mbal_bench::workload::min_key_size(keys).max(10);
    let mut buf = Vec::with_capacity(size);
    (0..keys)
        .map(|i| {
            buf.clear();
            write_key(&mut buf, i, size);
            space.cachelet_of_key(&buf)
        })
        .collect()
}

/// The hot partition's cachelets for hot set `h`: the first `k` of the
/// `h`-th worker (servers in order, then workers) of the initial map; hot
/// set 0 is the worker owning cachelet 0, as in `mbal bench`.
pub fn hot_cachelets(map: &ClusterMap, k: u32, hot_set: u32) -> Result<Vec<u32>> {
    let workers: Vec<(u16, u16)> = map
        .servers()
        .iter()
        .enumerate()
        .flat_map(|(s, i)| (0..i.workers.len()).map(move |w| (s as u16, w as u16)))
        .collect();
    let first = workers.iter().position(|&o| o == map.owner(0)).unwrap_or(0);
    let (s, w) = workers[(first + hot_set as usize) % workers.len()];
    let mine = map.cachelets_of(s, w);
    if k == 0 || k as usize > mine.len() {
        bail!("--hot-cachelets must be between 1 and {} (a worker's cachelets)", mine.len());
    }
    Ok(mine[..k as usize].to_vec())
}

/// The hot server's cachelets for hot set `h`: every cachelet of the `h`-th server after the
/// one owning cachelet 0 in the initial map.
pub fn hot_server_cachelets(map: &ClusterMap, hot_set: u32) -> Vec<u32> {
    let n = map.servers().len().max(1);
    let s = ((usize::from(map.owner(0).0) + hot_set as usize) % n) as u16;
    (0..map.cachelet_count()).filter(|&c| map.owner(c).0 == s).collect()
}

/// Each key's probability under `p` with hot set `hot_set` (they sum to 1).
pub fn key_masses(p: &Params, map: &ClusterMap, cachelet_of: &[u32], hot_set: u32) -> Result<Vec<f64>> {
    let n = p.keys;
    if n == 0 {
        bail!("--keys must be > 0");
    }
    let mut mass = vec![0.0; n as usize];
    match p.dist {
        Dist::Uniform => mass.iter_mut().for_each(|m| *m = 1.0 / f64::from(n)),
        Dist::Zipf => {
            if !(p.zipf.is_finite() && p.zipf >= 0.0) {
                bail!("--zipf must be >= 0");
            }
            // rand_distr's Zipf(n, s): rank r in 1..=n with probability r^-s / H(n, s).
            let perm = perm_of(n, hot_set);
            let w: Vec<f64> = (1..=n).map(|r| f64::from(r).powf(-p.zipf)).collect();
            let h: f64 = w.iter().sum();
            for (r, x) in w.iter().enumerate() {
                mass[perm[r] as usize] = x / h;
            }
        }
        Dist::Hotspot => {
            if !(0.0..=1.0).contains(&p.hot_fraction) || !(0.0..=1.0).contains(&p.hot_ops) {
                bail!("--hot-fraction and --hot-ops must be in [0, 1]");
            }
            let perm = perm_of(n, hot_set);
            let hot_n = ((f64::from(n) * p.hot_fraction).round() as u32).clamp(1, n);
            let (hot, cold) = if hot_n >= n {
                (1.0 / f64::from(n), 0.0)
            } else {
                (p.hot_ops / f64::from(hot_n), (1.0 - p.hot_ops) / f64::from(n - hot_n))
            };
            for (i, &k) in perm.iter().enumerate() {
                mass[k as usize] = if (i as u32) < hot_n { hot } else { cold };
            }
        }
        Dist::Hotpart | Dist::Hotserver => {
            if !(0.0..=1.0).contains(&p.hot_ops) {
                bail!("--hot-ops must be in [0, 1]");
            }
            let hot_c = if p.dist == Dist::Hotserver {
                hot_server_cachelets(map, hot_set)
            } else {
                hot_cachelets(map, p.hot_cachelets, hot_set)?
            };
            let is_hot: Vec<bool> = cachelet_of.iter().map(|c| hot_c.contains(c)).collect();
            let nh = is_hot.iter().filter(|&&h| h).count();
            let nc = n as usize - nh;
            if nh == 0 {
                bail!("no key of the {n} falls in a hot cachelet: use more --keys");
            }
            let (hot, cold) =
                if nc == 0 { (1.0 / nh as f64, 0.0) } else { (p.hot_ops / nh as f64, (1.0 - p.hot_ops) / nc as f64) };
            for (m, h) in mass.iter_mut().zip(&is_hot) {
                *m = if *h { hot } else { cold };
            }
        }
    }
    Ok(mass)
}

/// Each cachelet's share of the requests.
pub fn cachelet_masses(key_mass: &[f64], cachelet_of: &[u32], cachelets: u32) -> Vec<f64> {
    let mut m = vec![0.0; cachelets as usize];
    for (k, &c) in cachelet_of.iter().enumerate() {
        m[c as usize] += key_mass[k];
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use mbal_bench::workload::{DistKind, KeyGen, WorkloadParams};
    use rand::rngs::SmallRng;
    use rand::SeedableRng;
    use std::sync::Arc;

    fn map() -> ClusterMap {
        crate::even_map(2, 2, 4, 1024)
    }

    fn params(dist: Dist) -> Params {
        Params { dist, keys: 2_000, zipf: 0.99, hot_fraction: 0.05, hot_ops: 0.9, hot_cachelets: 2 }
    }

    /// The bench's generator, drawn 400,000 times, against the masses: every
    /// cachelet's observed share within 4 standard deviations (and 0.002).
    fn agrees_with_the_bench(dist: Dist, kind: DistKind) {
        let m = map();
        let p = params(dist);
        let cof = key_cachelets(m.keyspace(), p.keys);
        let mass = key_masses(&p, &m, &cof, 1).unwrap();
        assert!((mass.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        let want = cachelet_masses(&mass, &cof, m.cachelet_count());
        let hot = hot_cachelets(&m, p.hot_cachelets, 1).unwrap();
        let marks: Vec<bool> = cof.iter().map(|c| hot.contains(c)).collect();
        let wp = WorkloadParams {
            keys: p.keys,
            zipf: p.zipf,
            hot_fraction: p.hot_fraction,
            hot_ops: p.hot_ops,
            read_ratio: 1.0,
            dist: kind,
            hot_keys: Some(Arc::new(marks)),
        };
        let gen = KeyGen::new(kind, &wp, Arc::new(perm_of(p.keys, 1))).unwrap();
        let mut rng = SmallRng::seed_from_u64(9);
        let draws = 400_000;
        let mut seen = vec![0u64; want.len()];
        for _ in 0..draws {
            seen[cof[gen.next(&mut rng) as usize] as usize] += 1;
        }
        for (c, (&s, &w)) in seen.iter().zip(&want).enumerate() {
            let got = s as f64 / f64::from(draws);
            let sd = (w * (1.0 - w) / f64::from(draws)).sqrt();
            assert!((got - w).abs() <= (4.0 * sd).max(0.002), "{dist:?} cachelet {c}: {got} against {w}");
        }
    }

    #[test]
    fn zipf_masses_are_the_bench_generators() {
        agrees_with_the_bench(Dist::Zipf, DistKind::Zipf);
    }

    #[test]
    fn hotspot_masses_are_the_bench_generators() {
        agrees_with_the_bench(Dist::Hotspot, DistKind::Hotspot);
    }

    #[test]
    fn hot_partition_masses_are_the_bench_generators_and_sit_on_one_worker() {
        agrees_with_the_bench(Dist::Hotpart, DistKind::Hotpart);
        let m = map();
        let p = params(Dist::Hotpart);
        let cof = key_cachelets(m.keyspace(), p.keys);
        let hot = hot_cachelets(&m, 2, 0).unwrap();
        assert!(hot.iter().all(|&c| m.owner(c) == m.owner(0)), "hot set 0: the worker of cachelet 0");
        let cm = cachelet_masses(&key_masses(&p, &m, &cof, 0).unwrap(), &cof, m.cachelet_count());
        let on_hot: f64 = hot.iter().map(|&c| cm[c as usize]).sum();
        assert!((on_hot - 0.9).abs() < 1e-9, "{on_hot}");
        // Another hot set is another worker's.
        let other = hot_cachelets(&m, 2, 1).unwrap();
        assert_ne!(m.owner(other[0]), m.owner(hot[0]));
    }

    #[test]
    fn the_hot_server_is_every_cachelet_of_one_server() {
        let m = map();
        let p = Params { dist: Dist::Hotserver, ..params(Dist::Hotserver) };
        let cof = key_cachelets(m.keyspace(), p.keys);
        let hot = hot_server_cachelets(&m, 0);
        assert_eq!(hot.len(), 8, "2 workers x 4 cachelets");
        assert!(hot.iter().all(|&c| m.owner(c).0 == m.owner(0).0));
        let cm = cachelet_masses(&key_masses(&p, &m, &cof, 0).unwrap(), &cof, m.cachelet_count());
        let on_hot: f64 = hot.iter().map(|&c| cm[c as usize]).sum();
        assert!((on_hot - 0.9).abs() < 1e-9, "{on_hot}");
        assert_ne!(m.owner(hot_server_cachelets(&m, 1)[0]).0, m.owner(0).0, "hot set 1: the next server");
    }

    #[test]
    fn a_shift_moves_the_zipf_hot_keys() {
        let m = map();
        let p = params(Dist::Zipf);
        let cof = key_cachelets(m.keyspace(), p.keys);
        let a = key_masses(&p, &m, &cof, 0).unwrap();
        let b = key_masses(&p, &m, &cof, 1).unwrap();
        let top = |v: &[f64]| (0..v.len()).max_by(|&i, &j| v[i].total_cmp(&v[j])).unwrap();
        assert_ne!(top(&a), top(&b));
        assert!((a[top(&a)] - b[top(&b)]).abs() < 1e-12, "the same law, other keys");
    }
}
