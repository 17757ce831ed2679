//! The balancer of one server: MBal's Figure 4 state machine over epochs,
//! persistence, Phase 2 plans and leases. No I/O, no clock: the caller
//! feeds one [`EpochSnapshot`] per epoch to [`Balancer::on_epoch`], carries
//! out the [`Move`]s of the [`Decision`] and reports each back with
//! [`Balancer::applied`].

use crate::config::Config;
use crate::measure::Imbalance;
use crate::plan::Plan;
use crate::snapshot::EpochSnapshot;
use serde::{Deserialize, Serialize};

/// The balancer's state (MBal Figure 4, for the phases this server runs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum State {
    /// Balanced and every cachelet at its home worker.
    Normal,
    /// Imbalanced for `epochs` consecutive epochs, fewer than the
    /// persistence: watching before acting.
    Imbalanced { epochs: u32 },
    /// Phase 2, server-local cachelet migration: planning and moving
    /// cachelets between this server's workers each epoch while imbalanced.
    LocalMigration,
    /// Balanced, with cachelets away from home under leases; each goes home
    /// when its lease ends and its home can take it back.
    Leased,
    /// Phase 3 wanted: the server has no local headroom (more than
    /// SERVER_LOAD_thresh of its workers saturated) or Phase 2 found no
    /// plan that helps. Reported as an [`Escalation`]; acted on by the
    /// coordinator (a later issue).
    Coordinated,
}

/// A named edge of the state machine, reported when one is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Transition {
    /// Normal/Leased → Imbalanced{1}.
    ImbalanceSeen,
    /// Imbalanced{k} → Imbalanced{k+1}.
    ImbalancePersists,
    /// Imbalanced → Normal/Leased: it did not last.
    ImbalanceFaded,
    /// Imbalanced{persistence} → LocalMigration (or Coordinated → Local
    /// migration when headroom came back and a plan helps).
    StartPhase2,
    /// Imbalanced/LocalMigration/Leased → Coordinated.
    EscalatePhase3,
    /// LocalMigration/Coordinated → Leased/Normal: balanced again.
    Balanced,
    /// Leased → Normal: the last leased cachelet went home.
    AllHome,
}

/// Why a cachelet moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Why {
    /// Phase 2 plan.
    Balance,
    /// Its lease ended and its home can take it back: going home.
    LeaseExpired,
}

/// A cachelet ownership transfer between two workers of this server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    pub cachelet: u32,
    pub from: u16,
    pub to: u16,
    pub why: Why,
    /// Epochs the new owner is leased for (0 when going home).
    pub lease_epochs: u32,
}

/// Why Phase 3 is wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EscalateWhy {
    /// More than SERVER_LOAD_thresh of the workers are saturated.
    ServerOverloaded { saturated: u16, workers: u16 },
    /// Imbalanced and Phase 2 found no move that helps (e.g. one cachelet
    /// alone is hotter than T_j).
    NoLocalPlan,
}

/// A request for Phase 3 (coordinated, cross-server migration).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Escalation {
    pub why: EscalateWhy,
    /// The overloaded workers, most loaded first.
    pub sources: Vec<u16>,
}

/// What to do after one epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// The snapshot's `seq`.
    pub epoch: u64,
    pub state: State,
    /// The edge taken this epoch, if the state changed (or a plan restarted).
    pub transition: Option<Transition>,
    pub imbalance: Imbalance,
    /// Each worker's load (requests per second, weighted).
    pub loads: Vec<(u16, f64)>,
    /// T_j this epoch.
    pub limit: f64,
    /// Workers above T_j, most loaded first.
    pub overloaded: Vec<u16>,
    /// Moves to carry out now: lease returns first, then the plan's.
    pub moves: Vec<Move>,
    /// The Phase 2 plan, when one was made this epoch.
    pub plan: Option<Plan>,
    /// Phase 3 wanted (reported when entering Coordinated).
    pub escalate: Option<Escalation>,
    /// Cachelets away from home under a lease, after this decision.
    pub leases: usize,
}

/// A cachelet away from its home worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub cachelet: u32,
    pub home: u16,
    /// The worker holding it now.
    pub holder: u16,
    /// The balancer epoch (count of `on_epoch` calls) when it ends.
    pub until: u64,
}

/// One server's balancer: the state machine, the homes and the leases.
#[derive(Clone, Debug)]
pub struct Balancer {
    cfg: Config,
}

impl Balancer {
    /// A balancer for cachelets with these home workers (the cluster map's
    /// owners). A cachelet seen in a snapshot but not listed here takes the
    /// worker it is first seen on as its home.
    pub fn new(cfg: Config, home: &[(u32, u16)]) -> Balancer {
        todo!("{cfg:?} {home:?}")
    }

    /// One epoch: what to do now.
    pub fn on_epoch(&mut self, snap: &EpochSnapshot) -> Decision {
        todo!("{snap:?}")
    }

    /// The caller carried out `m` (ok) or could not (not ok).
    pub fn applied(&mut self, m: &Move, ok: bool) {
        todo!("{m:?} {ok}")
    }

    /// The state now.
    pub fn state(&self) -> State {
        todo!()
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Cachelets away from home, in cachelet order.
    pub fn leases(&self) -> Vec<Lease> {
        todo!()
    }

    /// The cluster map changed a cachelet's home (Phase 3, `mbal move` of a
    /// home): it is home wherever it is now, and any lease on it ends.
    pub fn set_home(&mut self, cachelet: u32, worker: u16) {
        todo!("{cachelet} {worker}")
    }
}
