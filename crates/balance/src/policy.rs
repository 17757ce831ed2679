//! The balancer of one server: MBal's Figure 4 state machine over epochs,
//! persistence, Phase 2 plans and leases. No I/O, no clock: the caller
//! feeds one [`EpochSnapshot`] per epoch to [`Balancer::on_epoch`], carries
//! out the [`Move`]s of the [`Decision`] and reports each back with
//! [`Balancer::applied`].

use crate::config::Config;
use crate::measure::{load_of, Imbalance};
use crate::plan::{self, Piece, Plan, Problem};
use crate::snapshot::EpochSnapshot;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

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
    state: State,
    /// Epochs seen (`on_epoch` calls); leases are counted in these.
    now: u64,
    /// The epoch Coordinated was entered.
    coordinated_at: u64,
    home: HashMap<u32, u16>,
    leases: BTreeMap<u32, Lease>,
    /// Moves decided and not yet reported by `applied`, with the epoch
    /// they were decided in.
    pending: Vec<(Move, u64)>,
}

/// What one epoch's snapshot says, as the state machine needs it.
struct Seen {
    loads: Vec<(u16, f64)>,
    cachelets: HashMap<u32, (u16, f64)>,
    imbalance: Imbalance,
    limit: f64,
    overloaded: Vec<u16>,
    imbalanced: bool,
    saturated: u16,
    server_overloaded: bool,
}

/// What the planning step of an epoch came to.
enum Acted {
    Planned(Plan),
    Escalated(Escalation),
}

impl Balancer {
    /// A balancer for cachelets with these home workers (the cluster map's
    /// owners). A cachelet seen in a snapshot but not listed here takes the
    /// worker it is first seen on as its home.
    pub fn new(cfg: Config, home: &[(u32, u16)]) -> Balancer {
        Balancer {
            cfg,
            state: State::Normal,
            now: 0,
            coordinated_at: 0,
            home: home.iter().copied().collect(),
            leases: BTreeMap::new(),
            pending: Vec::new(),
        }
    }

    fn see(&self, snap: &EpochSnapshot) -> Seen {
        let cfg = &self.cfg;
        let mut loads = Vec::with_capacity(snap.workers.len());
        let mut cachelets = HashMap::new();
        let mut saturated = 0u16;
        for w in &snap.workers {
            let mut sum = 0.0;
            for c in &w.cachelets {
                let l = load_of(c, cfg);
                sum += l;
                cachelets.insert(c.id, (w.worker, l));
            }
            let util = match cfg.worker_capacity {
                Some(cap) if cap > 0.0 => sum / cap,
                _ => w.busy,
            };
            if util >= cfg.saturated_util {
                saturated += 1;
            }
            loads.push((w.worker, sum));
        }
        let imbalance = Imbalance::of(&loads.iter().map(|w| w.1).collect::<Vec<_>>());
        let mut limit = cfg.target_max_over_avg * imbalance.avg;
        if let Some(cap) = cfg.worker_capacity.filter(|c| *c > 0.0) {
            limit = limit.min(cap * cfg.saturated_util);
        }
        let probe = Problem { workers: loads.clone(), pieces: Vec::new(), limit };
        let overloaded = probe.overloaded();
        let imbalanced = imbalance.avg >= cfg.min_load && imbalance.max_over_avg > cfg.trigger_max_over_avg;
        let n = loads.len();
        let server_overloaded = n > 0 && saturated as f64 / n as f64 > cfg.server_load_thresh;
        Seen { loads, cachelets, imbalance, limit, overloaded, imbalanced, saturated, server_overloaded }
    }

    /// Takes the snapshot's ownership as the truth: a cachelet at home has
    /// no lease; one away from home without a lease (moved by someone
    /// else) gets one, so that it goes home in time.
    fn reconcile(&mut self, seen: &Seen) {
        let timeout = u64::from(self.cfg.move_timeout_epochs.max(1));
        let now = self.now;
        self.pending.retain(|(_, at)| now - at < timeout);
        let mut ids: Vec<u32> = seen.cachelets.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let (owner, _) = seen.cachelets[&id];
            if self.pending.iter().any(|(m, _)| m.cachelet == id) {
                continue;
            }
            let home = *self.home.entry(id).or_insert(owner);
            if owner == home {
                self.leases.remove(&id);
            } else {
                let until = now + u64::from(self.cfg.lease_epochs);
                self.leases.entry(id).or_insert(Lease { cachelet: id, home, holder: owner, until }).holder = owner;
            }
        }
    }

    /// Expired leases go home when their homes can take them back: all of
    /// them at once if that leaves every worker at or under T (cachelets
    /// swapped by one plan come back together), else each one whose home
    /// stays at or under T; any when the server is nearly idle. The others
    /// are renewed.
    fn returns(&mut self, seen: &Seen) -> Vec<Move> {
        let idle = seen.imbalance.avg < self.cfg.min_load;
        let now = self.now;
        let due: Vec<Lease> = self
            .leases
            .values()
            .filter(|l| l.until <= now && !self.pending.iter().any(|(m, _)| m.cachelet == l.cachelet))
            .copied()
            .collect();
        if due.is_empty() {
            return Vec::new();
        }
        let base: HashMap<u16, f64> = seen.loads.iter().copied().collect();
        let load = |id: u32| seen.cachelets.get(&id).map_or(0.0, |c| c.1);
        let shift = |loads: &mut HashMap<u16, f64>, l: &Lease| {
            let x = load(l.cachelet);
            *loads.entry(l.home).or_default() += x;
            *loads.entry(l.holder).or_default() -= x;
        };
        let mut all = base.clone();
        due.iter().for_each(|l| shift(&mut all, l));
        let together = idle || all.values().all(|&x| x <= seen.limit);
        let mut loads = base;
        let mut back = Vec::new();
        for l in &due {
            let fits = match loads.get(&l.home) {
                Some(&h) => together || h + load(l.cachelet) <= seen.limit,
                None => false,
            };
            if fits {
                shift(&mut loads, l);
                back.push(Move { cachelet: l.cachelet, from: l.holder, to: l.home, why: Why::LeaseExpired, lease_epochs: 0 });
            } else if let Some(lease) = self.leases.get_mut(&l.cachelet) {
                lease.until = now + u64::from(self.cfg.lease_epochs);
            }
        }
        back
    }

    /// Phase 2, or the escalation when the server has no headroom or no
    /// plan helps.
    fn act(&self, seen: &Seen) -> Acted {
        let sources = seen.overloaded.clone();
        if seen.server_overloaded {
            let workers = seen.loads.len() as u16;
            return Acted::Escalated(Escalation { why: EscalateWhy::ServerOverloaded { saturated: seen.saturated, workers }, sources });
        }
        let pieces = seen
            .cachelets
            .iter()
            .filter(|(id, _)| !self.pending.iter().any(|(m, _)| m.cachelet == **id))
            .map(|(&id, &(worker, load))| Piece { id, worker, load });
        let mut pieces: Vec<Piece> = pieces.collect();
        pieces.sort_by_key(|p| p.id);
        let problem = Problem { workers: seen.loads.clone(), pieces, limit: seen.limit };
        let plan = plan::plan(&problem, &self.cfg);
        if plan.steps.is_empty() {
            Acted::Escalated(Escalation { why: EscalateWhy::NoLocalPlan, sources })
        } else {
            Acted::Planned(plan)
        }
    }

    /// One epoch: what to do now.
    pub fn on_epoch(&mut self, snap: &EpochSnapshot) -> Decision {
        self.now += 1;
        let seen = self.see(snap);
        self.reconcile(&seen);
        let mut moves = Vec::new();
        let mut plan = None;
        let mut escalate = None;
        let persistence = self.cfg.persistence.max(1);
        let settle = |b: &Balancer| if b.leases.is_empty() && b.pending.is_empty() { State::Normal } else { State::Leased };
        let (next, transition) = if !seen.imbalanced {
            moves = self.returns(&seen);
            let base = settle(self);
            let t = match self.state {
                State::Normal => None,
                State::Leased if base == State::Normal && moves.is_empty() => Some(Transition::AllHome),
                State::Leased => None,
                State::Imbalanced { .. } => Some(Transition::ImbalanceFaded),
                State::LocalMigration | State::Coordinated => Some(Transition::Balanced),
            };
            // Leased stays Leased until the last return is confirmed.
            let next = if moves.is_empty() { base } else { State::Leased };
            (next, t)
        } else {
            let start = |k: u32| k >= persistence;
            match self.state {
                State::Normal | State::Leased if !start(1) => (State::Imbalanced { epochs: 1 }, Some(Transition::ImbalanceSeen)),
                State::Imbalanced { epochs } if !start(epochs + 1) => {
                    (State::Imbalanced { epochs: epochs + 1 }, Some(Transition::ImbalancePersists))
                }
                State::Normal | State::Leased | State::Imbalanced { .. } => match self.act(&seen) {
                    Acted::Planned(p) => {
                        plan = Some(p);
                        (State::LocalMigration, Some(Transition::StartPhase2))
                    }
                    Acted::Escalated(e) => {
                        escalate = Some(e);
                        (State::Coordinated, Some(Transition::EscalatePhase3))
                    }
                },
                // Phase 2 goes on, an iteration per epoch, once the last
                // epoch's moves are confirmed.
                State::LocalMigration if !self.pending.is_empty() => (State::LocalMigration, None),
                State::LocalMigration => match self.act(&seen) {
                    Acted::Planned(p) => {
                        plan = Some(p);
                        (State::LocalMigration, None)
                    }
                    Acted::Escalated(e) => {
                        escalate = Some(e);
                        (State::Coordinated, Some(Transition::EscalatePhase3))
                    }
                },
                // Every `persistence` epochs, try Phase 2 again: headroom
                // may have come back.
                State::Coordinated => {
                    let due = (self.now - self.coordinated_at) % u64::from(persistence) == 0;
                    match (due && self.pending.is_empty()).then(|| self.act(&seen)) {
                        Some(Acted::Planned(p)) => {
                            plan = Some(p);
                            (State::LocalMigration, Some(Transition::StartPhase2))
                        }
                        _ => (State::Coordinated, None),
                    }
                }
            }
        };
        if let Some(p) = &plan {
            for s in &p.steps {
                let home = self.home.get(&s.cachelet).copied();
                let lease_epochs = if home == Some(s.to) { 0 } else { self.cfg.lease_epochs };
                moves.push(Move { cachelet: s.cachelet, from: s.from, to: s.to, why: Why::Balance, lease_epochs });
            }
        }
        for m in &moves {
            self.pending.push((*m, self.now));
        }
        if next == State::Coordinated && self.state != State::Coordinated {
            self.coordinated_at = self.now;
        }
        self.state = next;
        Decision {
            epoch: snap.seq,
            state: next,
            transition,
            imbalance: seen.imbalance,
            loads: seen.loads,
            limit: seen.limit,
            overloaded: seen.overloaded,
            moves,
            plan,
            escalate,
            leases: self.leases.len(),
        }
    }

    /// The caller carried out `m` (ok) or could not (not ok). A cachelet
    /// that arrived away from home is leased for `lease_epochs` from now;
    /// one that arrived home has no lease. A failed return keeps its
    /// (expired) lease and is tried again at the next balanced epoch.
    pub fn applied(&mut self, m: &Move, ok: bool) {
        if let Some(i) = self.pending.iter().position(|(p, _)| p.cachelet == m.cachelet && p.to == m.to) {
            self.pending.remove(i);
        }
        if !ok {
            return;
        }
        let home = *self.home.entry(m.cachelet).or_insert(m.from);
        if m.to == home {
            self.leases.remove(&m.cachelet);
        } else {
            let until = self.now + u64::from(self.cfg.lease_epochs);
            self.leases.insert(m.cachelet, Lease { cachelet: m.cachelet, home, holder: m.to, until });
        }
    }

    /// The state now.
    pub fn state(&self) -> State {
        self.state
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Cachelets away from home, in cachelet order.
    pub fn leases(&self) -> Vec<Lease> {
        self.leases.values().copied().collect()
    }

    /// Moves decided and not yet reported by [`Balancer::applied`].
    pub fn pending(&self) -> Vec<Move> {
        self.pending.iter().map(|p| p.0).collect()
    }

    /// The cluster map changed a cachelet's home (Phase 3, an operator's
    /// permanent move): any lease on it ends, and if it is elsewhere now it
    /// gets a lease at the next epoch to go home to `worker`.
    pub fn set_home(&mut self, cachelet: u32, worker: u16) {
        self.home.insert(cachelet, worker);
        self.leases.remove(&cachelet);
    }
}
