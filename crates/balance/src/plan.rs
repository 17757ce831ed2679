//! The Phase 2 planner (MBal §3.3, Algorithm 1, equations 1–7): which
//! cachelets to move between the workers of one server.
//!
//! A [`Problem`] is the server's workers with their loads, the cachelets
//! that may move with theirs, and T_j, the permissible load after the plan
//! (one value for every worker, as in the paper's footnote). [`plan`] runs
//! up to `max_iter` iterations; each picks at most two overloaded workers
//! as sources and the two least loaded as destinations, and solves
//! * objective (1), fewest moves such that the source and every
//!   destination end at or under T (eqs. 1–3), when one worker is
//!   overloaded, or
//! * objective (2), least absolute deviation from the mean over the
//!   workers involved, every one at or under T (eqs. 4–5), otherwise.
//!
//! Both have binary decisions and move each cachelet at most once
//! (eqs. 6–7). Each is solved as an ILP through a MILP solver (`good_lp`
//! with `microlp`) within a budget of branch-and-bound nodes (work, not
//! wall-clock: the same problem gives the same plan however busy the
//! machine is) and a 1% gap; when the ILP has no solution (infeasible, or
//! none found within the budget) Algorithm 1's greedy
//! fallback lowers the peak as far as single moves can. An iteration that
//! lowers the peak by less than `min_gain` of the mean ends the plan.

use crate::config::{Config, Planner};
use good_lp::{constraint, variable, variables, Expression, SolverModel, Variable};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};

/// One cachelet as the planner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Piece {
    pub id: u32,
    /// The worker that owns it now.
    pub worker: u16,
    /// Its load (requests per second, weighted as [`crate::load_of`]).
    pub load: f64,
}

/// A Phase 2 planning problem on one server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// Every worker and its load. The mean is taken over all of them.
    pub workers: Vec<(u16, f64)>,
    /// The cachelets that may move. A worker's load may include cachelets
    /// not listed here (pinned ones).
    pub pieces: Vec<Piece>,
    /// T_j: the permissible load on any worker after the plan.
    pub limit: f64,
}

/// Which ILP objective an iteration used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Objective {
    /// MBal eq. 1: fewest moves relieving the one overloaded `source`.
    MinMoves { source: u16 },
    /// MBal eq. 4: least absolute deviation from the mean.
    MinDeviation,
}

/// How an iteration's moves were found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Method {
    /// The MILP solver's optimum (within the MIP gap).
    Ilp,
    /// The solver's best solution when its node budget ran out (feasible,
    /// maybe not optimal).
    IlpBudgetSpent,
    /// Algorithm 1's greedy, after the ILP found no feasible solution.
    Greedy,
}

/// One cachelet changing worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Step {
    pub cachelet: u32,
    pub from: u16,
    pub to: u16,
}

/// One planner iteration: the workers it involved and the moves it chose.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Iteration {
    pub objective: Objective,
    pub method: Method,
    pub sources: Vec<u16>,
    pub destinations: Vec<u16>,
    pub steps: Vec<Step>,
}

/// A Phase 2 plan: every move of every iteration, in order, and the loads
/// they would leave.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub steps: Vec<Step>,
    pub iterations: Vec<Iteration>,
    /// Each worker's load once the steps are carried out.
    pub loads_after: Vec<(u16, f64)>,
}

impl Problem {
    /// Mean load over every worker.
    pub fn avg(&self) -> f64 {
        if self.workers.is_empty() {
            0.0
        } else {
            self.workers.iter().map(|w| w.1).sum::<f64>() / self.workers.len() as f64
        }
    }

    /// Workers above T, most loaded first (ties by worker id).
    pub fn overloaded(&self) -> Vec<u16> {
        let mut over: Vec<(u16, f64)> = self.workers.iter().copied().filter(|w| w.1 > self.limit).collect();
        sort_desc(&mut over);
        over.into_iter().map(|w| w.0).collect()
    }

    /// A worker's load.
    pub fn load(&self, worker: u16) -> f64 {
        self.workers.iter().find(|w| w.0 == worker).map_or(0.0, |w| w.1)
    }

    /// Every worker's load once `steps` are carried out (in `workers`
    /// order). A step naming a cachelet not in `pieces` is ignored.
    pub fn loads_after(&self, steps: &[Step]) -> Vec<(u16, f64)> {
        let mut loads = self.workers.clone();
        for s in steps {
            let Some(piece) = self.pieces.iter().find(|c| c.id == s.cachelet) else { continue };
            for w in loads.iter_mut() {
                if w.0 == s.from {
                    w.1 -= piece.load;
                }
                if w.0 == s.to {
                    w.1 += piece.load;
                }
            }
        }
        loads
    }
}

fn sort_desc(v: &mut [(u16, f64)]) {
    v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
}

/// The penalty objective (2) adds per move, as a fraction of the mean
/// load: among plans of equal deviation the one with fewer moves wins, and
/// a move that lowers the summed deviation by less than this is not made.
pub const MOVE_PENALTY: f64 = 1e-4;

/// The relative gap at which the solver stops with a solution known to be
/// within it of the optimum: plans differing by less are equally good to
/// the balancer (its hysteresis, `min_gain`, is 5%).
pub const MIP_GAP: f32 = 0.01;

/// The value of `objective` for `steps` over the workers `involved`:
/// objective (1) counts the moves; objective (2) is MBal eq. 4, the mean
/// over the server's N workers of |L_i − L_avg| summed over the involved
/// workers, plus [`MOVE_PENALTY`] × L_avg per move.
pub fn objective_value(p: &Problem, objective: Objective, involved: &[u16], steps: &[Step]) -> f64 {
    match objective {
        Objective::MinMoves { .. } => steps.len() as f64,
        Objective::MinDeviation => {
            let avg = p.avg();
            let after = p.loads_after(steps);
            let sum: f64 = after.iter().filter(|w| involved.contains(&w.0)).map(|w| (w.1 - avg).abs()).sum();
            sum / p.workers.len().max(1) as f64 + MOVE_PENALTY * avg * steps.len() as f64
        }
    }
}

/// Whether `steps` meet the ILP's constraints for `objective` over the
/// workers `sources ∪ destinations`: every step is between two of them
/// (objective 1: to or from the source), moves a listed cachelet from its
/// owner, each cachelet at most once (eqs. 6–7), and the involved workers'
/// loads end at or under T (eqs. 2–3 / 5; `slack` absorbs rounding).
pub fn feasible(
    p: &Problem,
    objective: Objective,
    sources: &[u16],
    destinations: &[u16],
    steps: &[Step],
    slack: f64,
) -> bool {
    let involved: Vec<u16> = sources.iter().chain(destinations).copied().collect();
    let mut seen = HashSet::new();
    for s in steps {
        let Some(piece) = p.pieces.iter().find(|c| c.id == s.cachelet) else { return false };
        if piece.worker != s.from || s.from == s.to || !seen.insert(s.cachelet) {
            return false;
        }
        if !involved.contains(&s.from) || !involved.contains(&s.to) {
            return false;
        }
        if let Objective::MinMoves { source } = objective {
            if s.from != source && s.to != source {
                return false;
            }
        }
    }
    let after = p.loads_after(steps);
    after.iter().filter(|w| involved.contains(&w.0)).all(|w| w.1 <= p.limit + slack)
}

/// Plans Phase 2 for one server (see the module's documentation).
pub fn plan(p: &Problem, cfg: &Config) -> Plan {
    let avg = p.avg();
    let min_gain = cfg.min_gain * avg;
    let mut cur = p.clone();
    let mut out = Plan::default();
    let mut moved: HashSet<u32> = HashSet::new();
    // The node budget is for the whole plan: each iteration's solve gets
    // an equal share.
    let per_solve = (cfg.ilp_node_limit / u64::from(cfg.max_iter.max(1))).max(1);
    for _ in 0..cfg.max_iter {
        let over = cur.overloaded();
        if over.is_empty() {
            break;
        }
        let sources: Vec<u16> = over.iter().copied().take(cfg.max_sources.max(1)).collect();
        let mut rest: Vec<(u16, f64)> = cur.workers.iter().copied().filter(|w| !sources.contains(&w.0)).collect();
        rest.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        let destinations: Vec<u16> = rest.iter().take(cfg.max_destinations.max(1)).map(|w| w.0).collect();
        if destinations.is_empty() {
            break;
        }
        let objective =
            if over.len() == 1 { Objective::MinMoves { source: sources[0] } } else { Objective::MinDeviation };
        let involved: Vec<u16> = sources.iter().chain(&destinations).copied().collect();
        // The iteration's problem: the cachelets on the involved workers
        // that have not moved yet this epoch.
        let sub = Problem {
            workers: cur.workers.clone(),
            pieces: cur
                .pieces
                .iter()
                .copied()
                .filter(|c| involved.contains(&c.worker) && !moved.contains(&c.id))
                .collect(),
            limit: cur.limit,
        };
        let (steps, method) = match cfg.planner {
            Planner::Ilp => match solve_ilp(&sub, objective, &sources, &destinations, per_solve) {
                Ok(found) => found,
                Err(_) => (greedy(&sub, &sources, &destinations, min_gain), Method::Greedy),
            },
            Planner::Greedy => (greedy(&sub, &sources, &destinations, min_gain), Method::Greedy),
        };
        let peak = |loads: &[(u16, f64)]| {
            loads.iter().filter(|w| involved.contains(&w.0)).map(|w| w.1).fold(f64::MIN, f64::max)
        };
        let after = sub.loads_after(&steps);
        if steps.is_empty() || peak(&cur.workers) - peak(&after) < min_gain {
            break;
        }
        for s in &steps {
            moved.insert(s.cachelet);
            if let Some(c) = cur.pieces.iter_mut().find(|c| c.id == s.cachelet) {
                c.worker = s.to;
            }
        }
        cur.workers = after;
        out.steps.extend(steps.iter().copied());
        out.iterations.push(Iteration { objective, method, sources, destinations, steps });
    }
    out.loads_after = cur.workers;
    out
}

/// Solves one iteration's ILP over the workers `sources ∪ destinations`.
/// `Err` when it has no feasible solution or the solver found none within
/// `node_limit` branch-and-bound nodes (the root relaxation is free).
pub fn solve_ilp(
    p: &Problem,
    objective: Objective,
    sources: &[u16],
    destinations: &[u16],
    node_limit: u64,
) -> Result<(Vec<Step>, Method), IlpError> {
    solve_ilp_with_gap(p, objective, sources, destinations, node_limit, MIP_GAP)
}

/// [`solve_ilp`] with a chosen relative MIP gap (0: the exact optimum).
pub fn solve_ilp_with_gap(
    p: &Problem,
    objective: Objective,
    sources: &[u16],
    destinations: &[u16],
    node_limit: u64,
    mip_gap: f32,
) -> Result<(Vec<Step>, Method), IlpError> {
    let mut involved: Vec<u16> = sources.iter().chain(destinations).copied().collect();
    involved.dedup();
    let n = p.workers.len().max(1) as f64;
    // Loads are scaled by the mean so the solver sees numbers near 1.
    let scale = p.avg().max(1e-9);
    let load = |w: u16| p.load(w) / scale;
    let limit = p.limit / scale;
    let mut vars = variables!();
    // X_ij^k, one per cachelet k on an involved worker i and destination j.
    let mut x: Vec<(Step, f64, Variable)> = Vec::new();
    for c in p.pieces.iter().filter(|c| involved.contains(&c.worker)) {
        for &j in &involved {
            if j == c.worker {
                continue;
            }
            if let Objective::MinMoves { source } = objective {
                // Objective (1) only moves off the source (eq. 2's
                // X_ai) or onto it (the swaps of X_ia).
                if c.worker != source && j != source {
                    continue;
                }
            }
            let var = vars.add(variable().binary());
            x.push((Step { cachelet: c.id, from: c.worker, to: j }, c.load / scale, var));
        }
    }
    // L_*i after the moves, per involved worker.
    let after = |w: u16| -> Expression {
        let mut e = Expression::from(load(w));
        for (s, l, v) in &x {
            if s.to == w {
                e += *l * *v;
            }
            if s.from == w {
                e -= *l * *v;
            }
        }
        e
    };
    let moves: Expression = x.iter().map(|(_, _, v)| *v).sum();
    let mut devs: Vec<(u16, Variable)> = Vec::new();
    let obj: Expression = match objective {
        Objective::MinMoves { .. } => moves.clone(),
        Objective::MinDeviation => {
            for &w in &involved {
                devs.push((w, vars.add(variable().min(0.0))));
            }
            let dev: Expression = devs.iter().map(|(_, t)| *t).sum();
            dev / n + MOVE_PENALTY * moves.clone()
        }
    };
    let mut model = vars.minimise(obj).using(good_lp::microlp);
    // Eqs. 2, 3 and 5: every involved worker ends at or under T.
    for &w in &involved {
        model.add_constraint(constraint!(after(w) <= limit));
    }
    // Eq. 4's absolute values: t_i >= |L_i' - L_avg|.
    for (w, t) in &devs {
        model.add_constraint(constraint!(*t >= after(*w) - 1.0));
        model.add_constraint(constraint!(*t >= 1.0 - after(*w)));
    }
    // Eq. 7: each cachelet goes to at most one destination.
    // (In cachelet order: the constraints' order steers the solver.)
    let mut by_cachelet: BTreeMap<u32, Expression> = BTreeMap::new();
    for (s, _, v) in &x {
        *by_cachelet.entry(s.cachelet).or_default() += *v;
    }
    for e in by_cachelet.into_values() {
        model.add_constraint(constraint!(e <= 1.0));
    }
    // good_lp builds the model; microlp solves it with a node budget, which
    // good_lp's wrapper does not pass on (it has a wall-clock limit only).
    // Its variables are microlp's in the order they were added: the X's
    // first (x[i] is variable i), then the deviations.
    let mut opts = microlp::SolveOptions::default();
    opts.node_limit = Some(node_limit);
    opts.mip_gap = f64::from(mip_gap);
    let sol = match model.as_inner().solve_with(opts) {
        Ok(outcome) => outcome.into_solution().map_err(|_| IlpError::BudgetSpent)?,
        Err(microlp::Error::Infeasible) => return Err(IlpError::Infeasible),
        Err(e) => return Err(IlpError::Solver(e.to_string())),
    };
    let method = match sol.termination_reason() {
        microlp::TerminationReason::NodeLimit | microlp::TerminationReason::TimeLimit => Method::IlpBudgetSpent,
        _ => Method::Ilp,
    };
    let values: Vec<f64> = sol.iter().map(|(_, v)| v).collect();
    debug_assert_eq!(values.len(), x.len() + devs.len());
    let mut steps: Vec<Step> = x.iter().zip(&values).filter(|(_, v)| **v > 0.5).map(|((s, _, _), _)| *s).collect();
    steps.sort_by_key(|s| (s.from, s.cachelet));
    Ok((steps, method))
}

/// Algorithm 1's fallback: repeatedly move the cachelet that most lowers
/// the larger of the most loaded source's and the least loaded
/// destination's loads, while that lowers the source by at least
/// `min_gain` (requests per second).
pub fn greedy(p: &Problem, sources: &[u16], destinations: &[u16], min_gain: f64) -> Vec<Step> {
    let mut loads: HashMap<u16, f64> = p.workers.iter().copied().collect();
    let mut pieces: Vec<Piece> = p.pieces.clone();
    let mut moved: HashSet<u32> = HashSet::new();
    let mut steps = Vec::new();
    let pick = |ws: &[u16], loads: &HashMap<u16, f64>, hi: bool| -> Option<u16> {
        let mut best: Option<(u16, f64)> = None;
        for &w in ws {
            let l = loads.get(&w).copied().unwrap_or(0.0);
            let better = match best {
                None => true,
                Some((_, b)) => (hi && l > b) || (!hi && l < b),
            };
            if better {
                best = Some((w, l));
            }
        }
        best.map(|b| b.0)
    };
    while steps.len() < pieces.len() {
        let (Some(s), Some(d)) = (pick(sources, &loads, true), pick(destinations, &loads, false)) else { break };
        let (ls, ld) = (loads.get(&s).copied().unwrap_or(0.0), loads.get(&d).copied().unwrap_or(0.0));
        if s == d || ls <= ld {
            break;
        }
        let mut best: Option<(usize, f64)> = None;
        for (i, c) in pieces.iter().enumerate() {
            if c.worker != s || moved.contains(&c.id) {
                continue;
            }
            // Lowest peak; on a tie the lighter cachelet (less moved).
            let peak = (ls - c.load).max(ld + c.load);
            if best.is_none_or(|(b, bp)| peak < bp || (peak == bp && c.load < pieces[b].load)) {
                best = Some((i, peak));
            }
        }
        let Some((i, peak)) = best else { break };
        if ls - peak < min_gain.max(f64::EPSILON) {
            break;
        }
        let c = &mut pieces[i];
        steps.push(Step { cachelet: c.id, from: s, to: d });
        moved.insert(c.id);
        c.worker = d;
        loads.insert(s, ls - c.load);
        loads.insert(d, ld + c.load);
    }
    steps
}
/// Why the ILP gave no plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum IlpError {
    /// No assignment meets the constraints.
    Infeasible,
    /// The node budget ran out before any feasible solution was found.
    BudgetSpent,
    /// Anything else the solver reported.
    Solver(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A problem from per-worker lists of cachelet loads; T = ratio × mean.
    fn problem(workers: &[&[f64]], ratio: f64) -> Problem {
        let mut pieces = Vec::new();
        let mut loads = Vec::new();
        for (w, ls) in workers.iter().enumerate() {
            for &l in ls.iter() {
                pieces.push(Piece { id: pieces.len() as u32, worker: w as u16, load: l });
            }
            loads.push((w as u16, ls.iter().sum::<f64>()));
        }
        let avg = loads.iter().map(|w| w.1).sum::<f64>() / loads.len() as f64;
        Problem { workers: loads, pieces, limit: ratio * avg }
    }

    /// Every assignment of the involved workers' cachelets (stay, or go to
    /// another involved worker), the feasible ones' least objective.
    fn brute_force(p: &Problem, objective: Objective, sources: &[u16], destinations: &[u16]) -> Option<f64> {
        let involved: Vec<u16> = sources.iter().chain(destinations).copied().collect();
        let pieces: Vec<Piece> = p.pieces.iter().copied().filter(|c| involved.contains(&c.worker)).collect();
        let k = involved.len();
        let mut best: Option<f64> = None;
        let total = k.pow(pieces.len() as u32);
        for code in 0..total {
            let mut c = code;
            let mut steps = Vec::new();
            for piece in &pieces {
                let to = involved[c % k];
                c /= k;
                if to != piece.worker {
                    steps.push(Step { cachelet: piece.id, from: piece.worker, to });
                }
            }
            if feasible(p, objective, sources, destinations, &steps, 1e-9) {
                let v = objective_value(p, objective, &involved, &steps);
                if best.is_none_or(|b| v < b) {
                    best = Some(v);
                }
            }
        }
        best
    }

    fn all(p: &Problem) -> Vec<u16> {
        p.workers.iter().map(|w| w.0).collect()
    }

    #[test]
    fn objective_one_finds_the_fewest_moves_by_hand() {
        // Worker 0 carries 40+20+20 = 80, the others 20 each: mean 40,
        // T = 44. The 40 cannot go anywhere (60 > T) and one 20 leaves 60
        // on the source: the optimum is both 20s, one to each destination.
        let p = problem(&[&[40.0, 20.0, 20.0], &[10.0, 10.0], &[10.0, 10.0]], 1.1);
        let obj = Objective::MinMoves { source: 0 };
        let (steps, method) = solve_ilp_with_gap(&p, obj, &[0], &[1, 2], 100_000, 0.0).unwrap();
        assert_eq!(method, Method::Ilp);
        assert!(feasible(&p, obj, &[0], &[1, 2], &steps, 1e-9), "{steps:?}");
        assert_eq!(steps.len(), 2);
        assert!(steps.iter().all(|s| s.cachelet != 0));
        assert_eq!(Some(steps.len() as f64), brute_force(&p, obj, &[0], &[1, 2]));
        let after = p.loads_after(&steps);
        assert!(after.iter().all(|w| w.1 <= p.limit + 1e-9), "{after:?}");
    }

    #[test]
    fn objective_two_levels_two_hot_workers() {
        let p = problem(&[&[30.0, 30.0, 10.0], &[30.0, 20.0, 20.0], &[5.0], &[5.0]], 1.2);
        let (sources, dests) = ([0, 1], [2, 3]);
        let (steps, _) = solve_ilp_with_gap(&p, Objective::MinDeviation, &sources, &dests, 100_000, 0.0).unwrap();
        let v = objective_value(&p, Objective::MinDeviation, &all(&p), &steps);
        let best = brute_force(&p, Objective::MinDeviation, &sources, &dests).unwrap();
        assert!((v - best).abs() < 1e-6, "ilp {v} vs brute force {best}: {steps:?}");
        assert!(feasible(&p, Objective::MinDeviation, &sources, &dests, &steps, 1e-9));
    }

    #[test]
    fn an_impossible_limit_falls_back_to_greedy() {
        // One cachelet alone is hotter than T: no plan meets the ILP's
        // constraints, greedy moves the rest away from it.
        let p = problem(&[&[100.0, 10.0, 10.0], &[10.0], &[10.0], &[10.0]], 1.1);
        assert_eq!(solve_ilp(&p, Objective::MinMoves { source: 0 }, &[0], &[1, 2], 100_000), Err(IlpError::Infeasible));
        let cfg = Config::default();
        let plan = plan(&p, &cfg);
        assert_eq!(plan.iterations[0].method, Method::Greedy);
        let moved: Vec<u32> = plan.steps.iter().map(|s| s.cachelet).collect();
        assert!(!moved.contains(&0), "the hot cachelet stays: {plan:?}");
        assert!(plan.loads_after.iter().find(|w| w.0 == 0).unwrap().1 < 120.0);
    }

    /// The budget is work, not time: a problem the solver cannot finish
    /// within it gives the same plan every time, and a budget of no
    /// nodes at all stops at the same point too (the root relaxation is
    /// free).
    #[test]
    fn the_same_problem_gives_the_same_plan_every_time() {
        let hot: Vec<f64> = (0..16).map(|i| 300.0 + 37.0 * f64::from(i % 7)).collect();
        let cold: Vec<f64> = (0..16).map(|i| 90.0 + 11.0 * f64::from(i % 5)).collect();
        let p = problem(&[&hot, &hot, &cold, &cold, &cold, &cold, &cold, &cold], 1.05);
        for budget in [0, 8, Config::default().ilp_node_limit] {
            let cfg = Config { ilp_node_limit: budget, ..Config::default() };
            let first = plan(&p, &cfg);
            assert!(!first.steps.is_empty());
            for _ in 0..5 {
                assert_eq!(plan(&p, &cfg), first, "budget {budget}");
            }
        }
    }

    #[test]
    fn a_balanced_server_gets_no_plan() {
        let p = problem(&[&[10.0, 10.0], &[12.0, 8.0], &[20.0], &[19.0]], 1.1);
        assert!(p.overloaded().is_empty());
        assert_eq!(plan(&p, &Config::default()), Plan { loads_after: p.workers.clone(), ..Plan::default() });
    }

    #[test]
    fn at_most_two_sources_and_destinations_per_iteration() {
        let hot: &[f64] = &[30.0, 30.0, 30.0];
        let cold: &[f64] = &[5.0];
        let p = problem(&[hot, hot, hot, cold, cold, cold, cold, cold], 1.1);
        let plan = plan(&p, &Config::default());
        assert!(!plan.iterations.is_empty());
        for it in &plan.iterations {
            assert!(it.sources.len() <= 2 && it.destinations.len() <= 2, "{it:?}");
        }
        let before = Imbalance::of(&p.workers.iter().map(|w| w.1).collect::<Vec<_>>());
        let after = Imbalance::of(&plan.loads_after.iter().map(|w| w.1).collect::<Vec<_>>());
        assert!(after.dev < before.dev, "{before:?} -> {after:?}");
    }

    use crate::measure::Imbalance;

    /// Random small problems: 2..=5 workers with 0..=3 cachelets each,
    /// loads heavy-tailed, T between 1.0 and 1.5 times the mean.
    fn arb_problem() -> impl Strategy<Value = Problem> {
        (proptest::collection::vec(proptest::collection::vec(1u32..100, 0..=3), 2..=5), 100u32..150, 0u32..4).prop_map(
            |(ws, ratio, skew)| {
                let ws: Vec<Vec<f64>> = ws
                    .iter()
                    .enumerate()
                    .map(|(i, ls)| {
                        ls.iter().map(|&l| (l as f64) * if i == 0 { 1.0 + skew as f64 } else { 1.0 }).collect()
                    })
                    .collect();
                let refs: Vec<&[f64]> = ws.iter().map(|v| v.as_slice()).collect();
                problem(&refs, ratio as f64 / 100.0)
            },
        )
    }

    /// The sources and destinations `plan` would pick for a first iteration.
    fn pick(p: &Problem) -> Option<(Objective, Vec<u16>, Vec<u16>)> {
        let over = p.overloaded();
        if over.is_empty() {
            return None;
        }
        let sources: Vec<u16> = over.iter().copied().take(2).collect();
        let mut rest: Vec<(u16, f64)> = p.workers.iter().copied().filter(|w| !sources.contains(&w.0)).collect();
        rest.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        let dests: Vec<u16> = rest.iter().take(2).map(|w| w.0).collect();
        if dests.is_empty() {
            return None;
        }
        let obj = if over.len() == 1 { Objective::MinMoves { source: sources[0] } } else { Objective::MinDeviation };
        Some((obj, sources, dests))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// No plan breaks a constraint: each cachelet moves once at most,
        /// from its owner at that point; an iteration involves at most two
        /// sources and two destinations and moves only between them; an
        /// ILP iteration leaves its workers at or under T; the most loaded
        /// worker is never more loaded afterwards; the reported loads are
        /// the moves' result.
        #[test]
        fn no_plan_breaks_a_constraint(p in arb_problem(), greedy_only in any::<bool>()) {
            let cfg = Config { planner: if greedy_only { Planner::Greedy } else { Planner::Ilp }, ilp_node_limit: 100_000, ..Config::default() };
            let plan = plan(&p, &cfg);
            let mut owner: HashMap<u32, u16> = p.pieces.iter().map(|c| (c.id, c.worker)).collect();
            let mut seen = HashSet::new();
            for it in &plan.iterations {
                prop_assert!(it.sources.len() <= 2 && it.destinations.len() <= 2);
                prop_assert!(!it.steps.is_empty());
                for s in &it.steps {
                    prop_assert!(seen.insert(s.cachelet), "moved twice: {:?}", plan);
                    prop_assert_eq!(owner.get(&s.cachelet).copied(), Some(s.from));
                    prop_assert!(s.from != s.to);
                    prop_assert!(it.sources.contains(&s.from) || it.destinations.contains(&s.from));
                    prop_assert!(it.sources.contains(&s.to) || it.destinations.contains(&s.to));
                    if let Objective::MinMoves { source } = it.objective {
                        prop_assert!(s.from == source || s.to == source);
                    }
                    owner.insert(s.cachelet, s.to);
                }
            }
            let after = p.loads_after(&plan.steps);
            for (a, b) in after.iter().zip(&plan.loads_after) {
                prop_assert_eq!(a.0, b.0);
                prop_assert!((a.1 - b.1).abs() < 1e-6);
            }
            let peak = |l: &[(u16, f64)]| l.iter().map(|w| w.1).fold(0.0, f64::max);
            prop_assert!(peak(&after) <= peak(&p.workers) + 1e-9);
            // The first ILP iteration, re-checked against eqs. 2-7 directly.
            if let (Some(it), Some((obj, src, dst))) = (plan.iterations.first(), pick(&p)) {
                if matches!(it.method, Method::Ilp | Method::IlpBudgetSpent) {
                    prop_assert!(feasible(&p, obj, &src, &dst, &it.steps, 1e-6), "{:?}", it);
                }
            }
        }

        /// The ILP's objective is never worse than greedy's whenever
        /// greedy's plan meets the ILP's constraints, and equals the brute
        /// force optimum.
        #[test]
        fn ilp_is_optimal_and_never_worse_than_greedy(p in arb_problem()) {
            if let Some((obj, src, dst)) = pick(&p) {
                let involved: Vec<u16> = src.iter().chain(&dst).copied().collect();
                // Brute force is k^pieces: only on the smaller cases.
                let small = p.pieces.iter().filter(|c| involved.contains(&c.worker)).count() <= 7;
                let best = if small { brute_force(&p, obj, &src, &dst) } else { None };
                if let (Ok((steps, _)), Some(best)) = (solve_ilp(&p, obj, &src, &dst, 500_000), best) {
                    // With the default gap: within it of the optimum.
                    let v = objective_value(&p, obj, &involved, &steps);
                    prop_assert!(v <= best * (1.0 + f64::from(MIP_GAP)) + 1e-6, "{} vs {}", v, best);
                }
                match solve_ilp_with_gap(&p, obj, &src, &dst, 500_000, 0.0) {
                    Ok((steps, method)) => {
                        prop_assert_eq!(method, Method::Ilp);
                        prop_assert!(feasible(&p, obj, &src, &dst, &steps, 1e-6));
                        let v = objective_value(&p, obj, &involved, &steps);
                        if small {
                            let best = best.expect("the ILP found a plan brute force did not");
                            prop_assert!((v - best).abs() <= 1e-6 * best.abs().max(1.0), "ilp {} brute {} {:?}", v, best, steps);
                        }
                        let g = greedy(&p, &src, &dst, 0.0);
                        if feasible(&p, obj, &src, &dst, &g, 1e-9) {
                            prop_assert!(v <= objective_value(&p, obj, &involved, &g) + 1e-6);
                        }
                    }
                    Err(e) => {
                        prop_assert_eq!(e, IlpError::Infeasible);
                        prop_assert!(best.is_none(), "brute force found {:?}", best);
                        if !small {
                            // Infeasible: then no greedy plan meets the constraints either.
                            let g = greedy(&p, &src, &dst, 0.0);
                            prop_assert!(g.is_empty() || !feasible(&p, obj, &src, &dst, &g, 1e-9));
                        }
                    }
                }
            }
        }
    }
}
