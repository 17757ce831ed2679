//! Phase 2 planner solve times at 4, 8, 16 and 64 workers × 16 cachelets
//! each. A measurement, not a test of speed: it prints a table and asserts
//! only that the plans are sound. Run it in release:
//!
//! ```text
//! cargo test -p mbal-balance --release --test solve_time -- --ignored --nocapture
//! ```

use mbal_balance::plan::{self, greedy, solve_ilp, Objective, Piece, Problem};
use mbal_balance::{Config, Imbalance, Planner};
use std::time::{Duration, Instant};

const PER_WORKER: usize = 16;
const RUNS: usize = 20;

/// A deterministic generator (64-bit LCG), so every run plans the same
/// problems.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The two kinds of skew measured.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// Cachelet rates uniform in 500..1500 req/s, and the `hot` first
    /// workers' cachelets three times hotter: a hot partition (YCSB's
    /// hotspot, MBal's workload B), which whole-cachelet moves can fix.
    HotPartition,
    /// Zipf-like cachelet rates (exponent 0.99 over the cachelets' ranks,
    /// placed at random) on top of the hot workers: the hottest cachelet
    /// alone outweighs a worker's share at 16+ workers, which no move of
    /// whole cachelets fixes (only Phase 1 copies would).
    Zipf,
}

/// `workers` × 16 cachelets of the given kind.
fn problem(kind: Kind, workers: usize, hot: usize, seed: u64) -> Problem {
    let mut rng = Lcg(seed);
    let n = workers * PER_WORKER;
    let mut ranks: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next() * (i + 1) as f64) as usize;
        ranks.swap(i, j);
    }
    let mut pieces = Vec::with_capacity(n);
    let mut loads = vec![0.0; workers];
    for (id, &rank) in ranks.iter().enumerate() {
        let w = id / PER_WORKER;
        let mut load = match kind {
            Kind::HotPartition => 500.0 + 1000.0 * rng.next(),
            Kind::Zipf => 100_000.0 / ((rank + 1) as f64).powf(0.99) + 1_000.0,
        };
        if w < hot {
            load *= 3.0;
        }
        loads[w] += load;
        pieces.push(Piece { id: id as u32, worker: w as u16, load });
    }
    let avg = loads.iter().sum::<f64>() / workers as f64;
    Problem { workers: loads.iter().enumerate().map(|(w, &l)| (w as u16, l)).collect(), pieces, limit: 1.1 * avg }
}

fn stats(mut t: Vec<Duration>) -> (f64, f64) {
    t.sort();
    (t[t.len() / 2].as_secs_f64() * 1e3, t[t.len() - 1].as_secs_f64() * 1e3)
}

#[test]
#[ignore = "a measurement: run in release with --ignored --nocapture"]
fn phase2_solve_times() {
    println!(
        "plan(): up to {} iterations of 2 sources + 2 destinations, {RUNS} random problems per row",
        Config::default().max_iter
    );
    println!();
    println!("| skew | workers | hot | planner | median ms | max ms | first ILP max ms | max/avg before | after | moves | methods |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for kind in [Kind::HotPartition, Kind::Zipf] {
        for workers in [4usize, 8, 16, 64] {
            for hot in [1usize, 2] {
                for planner in [Planner::Ilp, Planner::Greedy] {
                    let cfg = Config { planner, ..Config::default() };
                    let mut times = Vec::new();
                    let mut first = Vec::new();
                    let (mut before, mut after, mut moves) = (0.0, 0.0, 0);
                    let mut methods = std::collections::BTreeSet::new();
                    for run in 0..RUNS {
                        let p = problem(kind, workers, hot, 1 + run as u64);
                        let start = Instant::now();
                        let plan = plan::plan(&p, &cfg);
                        times.push(start.elapsed());
                        if planner == Planner::Ilp {
                            if let Some(it) = plan.iterations.first() {
                                let start = Instant::now();
                                let _ = solve_ilp(
                                    &p,
                                    it.objective,
                                    &it.sources,
                                    &it.destinations,
                                    cfg.ilp_node_limit / u64::from(cfg.max_iter),
                                );
                                first.push(start.elapsed());
                            }
                        }
                        let l =
                            |v: &[(u16, f64)]| Imbalance::of(&v.iter().map(|w| w.1).collect::<Vec<_>>()).max_over_avg;
                        before += l(&p.workers) / RUNS as f64;
                        after += l(&plan.loads_after) / RUNS as f64;
                        moves += plan.steps.len();
                        methods.extend(plan.iterations.iter().map(|i| format!("{:?}", i.method)));
                        let peak = |v: &[(u16, f64)]| v.iter().map(|w| w.1).fold(0.0, f64::max);
                        assert!(peak(&plan.loads_after) <= peak(&p.workers) + 1e-6);
                    }
                    let (med, max) = stats(times);
                    let first = if first.is_empty() { "-".to_string() } else { format!("{:.2}", stats(first).1) };
                    let m: Vec<String> = methods.into_iter().collect();
                    println!(
                        "| {kind:?} | {workers} | {hot} | {planner:?} | {med:.2} | {max:.2} | {first} | {before:.2} | {after:.2} | {:.1} | {} |",
                        moves as f64 / RUNS as f64,
                        m.join(" ")
                    );
                }
            }
        }
    }
    // One ILP over every worker of the server instead of 2 sources + 2
    // destinations: why the paper restricts each iteration.
    println!();
    println!("| workers | one ILP over all workers (objective 2, 20,000 nodes): median ms | max ms | optimal within the budget |");
    println!("|---|---|---|---|");
    for workers in [4usize, 8, 16] {
        let mut times = Vec::new();
        let mut optimal = 0;
        for run in 0..5 {
            let p = problem(Kind::HotPartition, workers, 2, 1 + run as u64);
            let all: Vec<u16> = p.workers.iter().map(|w| w.0).collect();
            let (src, dst) = all.split_at(2);
            let start = Instant::now();
            let r = solve_ilp(&p, Objective::MinDeviation, src, dst, 20_000);
            times.push(start.elapsed());
            optimal += usize::from(matches!(r, Ok((_, mbal_balance::Method::Ilp))));
            let _ = greedy(&p, src, dst, 0.0);
        }
        let (med, max) = stats(times);
        println!("| {workers} | {med:.1} | {max:.1} | {optimal}/5 |");
    }
}
