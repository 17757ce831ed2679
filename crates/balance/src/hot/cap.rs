//! REPL_high on one server: the cap it is set to (its share, or what the
//! slots lent between servers make it, [`SlotLedger`]), the keys waiting
//! for a slot, and making room under it: retiring at once, displacement,
//! and giving back a lent slot (MBal §3.2; docs/design-notes.md "REPL_high
//! and escalation", "REPL_high shared across the cluster").

use super::*;

impl HotKeys {
    /// REPL_high for this server from now on, when slots are lent between
    /// servers ([`SlotLedger::cap`]); `None`: its even share. An explicit
    /// [`HotConfig::repl_high`] wins. When the cap falls below the keys
    /// with copies, the next epoch retires the coolest at once.
    pub fn set_repl_high(&mut self, cap: Option<usize>) {
        self.cap = cap;
    }

    /// Keys that wanted copies at the last epoch (or an alarm since) and
    /// found no slot under REPL_high.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// What competes for REPL_high slots here ([`SlotHeat`]): the rate of
    /// each key with copies that counts (a key already retiring at 0, a
    /// HOT key quiet long enough to be displaced at its rate as measured,
    /// as displacement judges it; pinned keys are not counted) and of each
    /// key waiting for a slot, hottest first.
    /// No more waiting keys are reported than the whole cluster has
    /// slots ([`repl_high_total`]): no server could be lent more.
    pub fn slot_heat(&self) -> SlotHeat {
        let mut held: Vec<f64> =
            self.keys.values().filter(|e| e.replicas > 0 && !e.pinned).map(|e| self.slot_score(e)).collect();
        held.sort_by(|a, b| b.total_cmp(a));
        let most = self.last.map_or(usize::MAX, |(view, _, _)| repl_high_total(view.n()));
        let waiting = self.waiting_heat.iter().take(most).map(|(f, _)| *f).collect();
        SlotHeat { held, waiting }
    }

    /// A key's claim to the REPL_high slot it holds, the one rule lending
    /// ([`HotKeys::slot_heat`]) and giving a slot back ([`HotKeys::trim`])
    /// judge by: 0 for a key already retiring; a HOT key quiet for
    /// `displace_quiet` epochs at its rate as measured this epoch (as
    /// displacement judges it); else its smoothed rate.
    fn slot_score(&self, e: &Entry) -> f64 {
        match e.state {
            KeyState::ColdPending => 0.0,
            KeyState::Hot if e.quiet >= self.cfg.displace_quiet.max(1) => e.recent.min(e.reads + e.writes),
            _ => e.reads + e.writes,
        }
    }

    /// Retire `key` now (HOT → COLD_PENDING → COLD, or COLD_PENDING →
    /// COLD): its copies are deleted at once instead of after the leases
    /// it gave, to make room under REPL_high for a hotter key. A client
    /// still holding a lease on one of them is answered `RD` there and
    /// reads at home (docs/protocol.md): no error, one redirect.
    pub(super) fn retire_now(&mut self, key: &[u8], log: &mut Vec<(Vec<u8>, KeyTransition)>) -> Option<Retire> {
        if self.state(key) == KeyState::Hot {
            self.apply(key, KeyEvent::Cooled, log);
        }
        if !self.apply(key, KeyEvent::LeasesEnded, log) {
            return None;
        }
        let e = self.keys.get_mut(key).expect("present");
        let r = Retire { key: key.to_vec(), worker: e.worker, replicas: e.replicas };
        (e.replicas, e.broken, e.quiet) = (0, false, 0);
        Some(r)
    }

    /// With `displace`, make room under REPL_high for keys waiting at
    /// `heat` (hottest first) beyond `room`: retire at once the keys
    /// already retiring (COLD_PENDING, coolest first), then the coolest
    /// HOT keys in `coolest` (rate, key; coolest first), each for a waiting
    /// key at least twice as hot (and than `floor`). Returns the room made.
    pub(super) fn make_room(
        &mut self,
        heat: &[(f64, Vec<u8>)],
        room: usize,
        coolest: &[(f64, Vec<u8>)],
        floor: f64,
        log: &mut Vec<(Vec<u8>, KeyTransition)>,
        retire: &mut Vec<Retire>,
    ) -> usize {
        let mut need = heat.len().saturating_sub(room);
        let mut freed = 0;
        let mut pending: Vec<(f64, Vec<u8>)> = self
            .keys
            .iter()
            .filter(|(_, e)| e.state == KeyState::ColdPending && e.replicas > 0)
            .map(|(k, e)| (e.reads + e.writes, k.clone()))
            .collect();
        pending.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
        for (_, k) in pending.into_iter().take(need) {
            retire.extend(self.retire_now(&k, log));
            freed += 1;
        }
        need -= freed;
        for ((f, _), (g, k)) in heat.iter().skip(room + freed).take(need).zip(coolest) {
            if *f < 2.0 * g.max(floor) {
                break;
            }
            retire.extend(self.retire_now(k, log));
            freed += 1;
        }
        freed
    }

    pub(super) fn repl_high(&self, view: &ClusterView) -> usize {
        self.cfg.repl_high.or(self.cap).unwrap_or_else(|| repl_high_share(view))
    }

    /// Retire at once the keys with copies beyond `cap` (a lent slot given
    /// back): keys already retiring first, then the coolest of the HOT keys
    /// and of the keys whose copies are being made or written (HOT_PENDING:
    /// their copies are deleted like the others'; a copy the replicator
    /// finishes after that lives unrenewed until its time to live and
    /// grants no lease). Pinned keys (an operator's override, made whatever
    /// REPL_high) are neither counted nor retired.
    pub(super) fn trim(&mut self, cap: usize, log: &mut Vec<(Vec<u8>, KeyTransition)>, retire: &mut Vec<Retire>) {
        let over = self.counted().saturating_sub(cap);
        if over == 0 {
            return;
        }
        let order = |s: KeyState| u8::from(s != KeyState::ColdPending);
        let mut keys: Vec<(u8, f64, Vec<u8>)> = self
            .keys
            .iter()
            .filter(|(_, e)| e.replicas > 0 && !e.pinned)
            .filter(|(_, e)| matches!(e.state, KeyState::ColdPending | KeyState::Hot | KeyState::HotPending))
            .map(|(k, e)| (order(e.state), self.slot_score(e), k.clone()))
            .collect();
        keys.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then_with(|| a.2.cmp(&b.2)));
        for (_, _, k) in keys.into_iter().take(over) {
            if self.state(&k) == KeyState::HotPending {
                self.apply(&k, KeyEvent::Failed, log);
            }
            retire.extend(self.retire_now(&k, log));
        }
    }

    /// Between epochs: retire at once, coolest first, the keys with copies
    /// beyond the REPL_high last set ([`HotKeys::set_repl_high`]), as the
    /// next epoch would (a borrower calls it at every tick, so it has given
    /// a lent slot back before the lender counts it free again).
    pub fn enforce_cap(&mut self) -> Vec<Retire> {
        let Some(cap) = self.cfg.repl_high.or(self.cap) else { return Vec::new() };
        let (mut log, mut retire) = (Vec::new(), Vec::new());
        self.trim(cap, &mut log, &mut retire);
        retire
    }

    /// Keys with copies that REPL_high counts: all but pinned ones.
    pub fn counted(&self) -> usize {
        self.keys.values().filter(|e| e.replicas > 0 && !e.pinned).count()
    }
}
