//! The policy's knobs, each with a default from the MBal paper or from
//! measurement (docs/design-notes.md says which).

use serde::{Deserialize, Serialize};

/// Which planner Phase 2 uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Planner {
    /// The ILP of MBal §3.3 (objective 1 or 2) through a MILP solver, with
    /// Algorithm 1's greedy as the fallback when it finds no plan in time.
    Ilp,
    /// Algorithm 1's greedy only.
    Greedy,
}

/// The balancer's configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Consecutive imbalanced epochs before acting (MBal §3.1: 4).
    pub persistence: u32,
    /// A server is imbalanced when its most loaded worker carries more than
    /// this times the mean load (default 1.20). (Not the deviation: one
    /// hot worker among 64 moves dev/avg by 1/64 only.)
    pub trigger_max_over_avg: f64,
    /// Below this mean load per worker (requests per second) the server is
    /// never imbalanced: too little traffic to matter or to measure.
    pub min_load: f64,
    /// T_j, the permissible load on a worker after a plan, as a multiple of
    /// the mean load (default 1.10, under the trigger so that a balanced
    /// result does not trigger again). Workers above it are "overloaded"
    /// (sources) for the planner.
    pub target_max_over_avg: f64,
    /// A worker's capacity in requests per second when known (the emulated
    /// `--worker-capacity`): then T_j is also at most
    /// `saturated_util × capacity`, and utilisation is load / capacity.
    /// When unknown, utilisation is the worker's measured busy fraction.
    pub worker_capacity: Option<f64>,
    /// A worker whose utilisation is at or above this is saturated
    /// (default 0.90).
    pub saturated_util: f64,
    /// SERVER_LOAD_thresh of Algorithm 1: when more than this fraction of
    /// the workers is saturated, the server has no local headroom and
    /// Phase 3 is wanted instead of Phase 2 (default 0.75, the paper's).
    pub server_load_thresh: f64,
    /// At most this many sources and destinations per planner iteration
    /// (MBal §3.3: 2 and 2).
    pub max_sources: usize,
    pub max_destinations: usize,
    /// Planner iterations per epoch (MAX_ITER of Algorithm 1): each picks
    /// its sources and destinations afresh over the loads the earlier
    /// iterations' moves would leave.
    pub max_iter: u32,
    /// The MILP solver's budget over one plan, in branch-and-bound nodes
    /// (work, not time, so a plan does not depend on how busy the machine
    /// is); each of the `max_iter` solves gets an equal share. The default
    /// (2,000) keeps a plan at 16 workers within ~20 ms in a release
    /// build (`tests/solve_time.rs`).
    pub ilp_node_limit: u64,
    pub planner: Planner,
    /// A plan is carried out only if it lowers the most loaded worker's
    /// load by at least this fraction of the mean load (default 0.05):
    /// hysteresis against moves that buy nothing.
    pub min_gain: f64,
    /// Epochs a moved cachelet stays away from home before its return is
    /// considered (default 10); renewed while going home would overload it.
    pub lease_epochs: u32,
    /// Weight of a write relative to a read in a cachelet's load
    /// (default 1.0).
    pub write_weight: f64,
    /// Epochs a decided move may stay unconfirmed by
    /// [`crate::Balancer::applied`] before it is taken as failed.
    pub move_timeout_epochs: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            persistence: 4,
            trigger_max_over_avg: 1.20,
            min_load: 100.0,
            target_max_over_avg: 1.10,
            worker_capacity: None,
            saturated_util: 0.90,
            server_load_thresh: 0.75,
            max_sources: 2,
            max_destinations: 2,
            max_iter: 4,
            ilp_node_limit: 2_000,
            planner: Planner::Ilp,
            min_gain: 0.05,
            lease_epochs: 10,
            write_weight: 1.0,
            move_timeout_epochs: 3,
        }
    }
}

/// Phase 3's knobs (MBal §3.4, Algorithm 2): the coordinator's policy,
/// [`crate::Phase3`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Phase3Config {
    /// T = (1 + margin) × the cluster's mean load per worker, times a
    /// server's workers: above it a server is overloaded (a source), and no
    /// destination is filled past it (default 0.10, as Phase 2's 1.10).
    pub margin: f64,
    /// Consecutive coordinator epochs a server must stay over T before
    /// Phase 3 acts on its own view (default 3); an escalation from the
    /// server's Phase 2 needs none.
    pub persistence: u32,
    /// Coordinator epochs a cachelet that just moved (or failed to) stays
    /// where it is (default 5).
    pub cooldown_epochs: u32,
    /// Migrations in flight at once, cluster-wide (default 2); at most one
    /// per source server in any case.
    pub max_inflight: usize,
    /// Algorithm 2's MAX_ITER: destinations tried per source per plan
    /// (default 4).
    pub max_iter: u32,
    /// The ILP's budget per plan in branch-and-bound nodes (work, not
    /// time), shared equally by its solves; 0: greedy only (default 2,000).
    pub ilp_node_limit: u64,
    pub planner: Planner,
    /// Below this mean load per worker (requests per second) Phase 3 does
    /// nothing (default 100, Phase 2's `min_load`).
    pub min_load: f64,
    /// With known worker capacities, a destination is also not filled past
    /// this fraction of its summed capacity (default 0.90, Phase 2's
    /// `saturated_util`).
    pub saturated_util: f64,
    /// Coordinator epochs after the one in which a server reported local
    /// (Phase 2) moves during which Phase 3 leaves that server alone, as a
    /// source or a destination (default 1: that epoch and the next).
    pub after_local_epochs: u32,
    /// A migration with no end (finished or failed) heard for this many
    /// coordinator epochs is taken as failed, so that a lost answer does
    /// not hold its source forever (default 20; 0: never).
    pub migrate_timeout_epochs: u32,
}

impl Default for Phase3Config {
    fn default() -> Self {
        Phase3Config {
            margin: 0.10,
            persistence: 3,
            cooldown_epochs: 5,
            max_inflight: 2,
            max_iter: 4,
            ilp_node_limit: 2_000,
            planner: Planner::Ilp,
            min_load: 100.0,
            saturated_util: 0.90,
            after_local_epochs: 1,
            migrate_timeout_epochs: 20,
        }
    }
}
