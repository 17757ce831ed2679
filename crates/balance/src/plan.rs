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
//!   workers involved, every one at or under T (eqs. 4–5), otherwise,
//! both with binary decisions and each cachelet moved at most once
//! (eqs. 6–7), as an ILP through a MILP solver with a time limit; when the
//! ILP has no solution (infeasible, or none found in time) Algorithm 1's
//! greedy fallback lowers the deviation as far as single moves can.

use crate::config::Config;
use serde::{Deserialize, Serialize};

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
    /// The MILP solver's optimum.
    Ilp,
    /// The solver's best solution when its time limit ran out (feasible,
    /// maybe not optimal).
    IlpTimeLimited,
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
        todo!()
    }

    /// Workers above T, most loaded first.
    pub fn overloaded(&self) -> Vec<u16> {
        todo!()
    }
}

/// Plans Phase 2 for one server (see the module's documentation).
pub fn plan(p: &Problem, cfg: &Config) -> Plan {
    todo!("{p:?} {cfg:?}")
}

/// Solves one iteration's ILP over the workers `sources ∪ destinations`.
/// `Err` when it has no feasible solution or the solver found none within
/// `time_limit_ms`.
pub fn solve_ilp(
    p: &Problem,
    objective: Objective,
    sources: &[u16],
    destinations: &[u16],
    time_limit_ms: u64,
) -> Result<(Vec<Step>, Method), IlpError> {
    todo!("{p:?} {objective:?} {sources:?} {destinations:?} {time_limit_ms}")
}

/// Algorithm 1's fallback: repeatedly move the cachelet that most lowers
/// the larger of the most loaded source's and the least loaded
/// destination's loads, while that lowers the source by at least
/// `min_gain` (requests per second).
pub fn greedy(p: &Problem, sources: &[u16], destinations: &[u16], min_gain: f64) -> Vec<Step> {
    todo!("{p:?} {sources:?} {destinations:?} {min_gain}")
}

/// Why the ILP gave no plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum IlpError {
    /// No assignment meets the constraints.
    Infeasible,
    /// The time limit ran out before any feasible solution was found.
    TimedOut,
    /// Anything else the solver reported.
    Solver(String),
}
