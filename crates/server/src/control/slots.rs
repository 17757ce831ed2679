//! The controller's side of the REPL_high slots lent between servers
//! (Phase 1; `mbal_balance::SlotLedger` has the rules, docs/design-notes.md
//! "REPL_high shared across the cluster"): the tick that gives back and
//! renews, asks, lending, and a starting server's question to the others.

use super::*;
use mbal_balance::hot::{cedable, entitlements, repl_high_total};
use mbal_balance::SlotHeat;

/// REPL_high slots lent between servers (`SlotLedger`): a grant lasts this
/// many epochs, and a borrower renews what it still needs every epoch.
pub(super) const SLOT_LEASE_EPOCHS: u64 = 4;
/// A borrower counts a grant only while it lasts past two more epochs (its
/// next tick, late by up to an epoch), so it gives back what it no longer
/// holds before the grant ends at the lender.
pub(super) const SLOT_HORIZON_EPOCHS: u64 = 2;
/// The lease of a grant: `SLOT_LEASE_EPOCHS` epochs, at most a minute.
pub(super) fn slot_lease_ms(epoch: Duration) -> u64 {
    (epoch.as_millis() as u64 * SLOT_LEASE_EPOCHS).clamp(1, 60_000)
}

/// Slots a lender keeps free beyond its own needs.
pub(super) const SLOT_MARGIN: usize = 1;
/// An alarm that leaves keys waiting asks for slots at once, but at most
/// this often (ms).
pub(super) const SLOT_ASK_EVERY_MS: u64 = 250;

/// A lender's claim and margin for `demand` ([`Controller::keeps`]).
fn keeps(claim: usize, demand: usize) -> (usize, usize) {
    (claim, if claim < demand { 0 } else { SLOT_MARGIN })
}

impl Controller {
    /// The controller's tick: give back what is no longer held (the policy
    /// retires its coolest keys beyond the cap at once) and renew what is
    /// still needed. At every tick, not only when an epoch's samples are
    /// in, so that a stalled worker cannot delay either past a lease.
    pub(super) fn slot_tick(&mut self) {
        if self.ledger.is_none() {
            return;
        }
        self.ask_held();
        let now = self.now_ns();
        self.apply_cap(now);
        if self.hot.is_none() {
            return;
        }
        self.ask_slots(self.demand(), now);
    }

    /// Peers' epoch records count when heard since this: the last three
    /// epochs (for the cluster's mean load, slots to spare and heat).
    pub(super) fn heard_since(&self) -> Instant {
        Instant::now().checked_sub(self.epoch_len * 3).unwrap_or_else(Instant::now)
    }

    /// What this server needs of REPL_high now: its keys with copies that
    /// count against it (pinned ones do not) and its keys waiting for a
    /// slot; a demand made for tests (`mbal debug slots`) when larger.
    pub(super) fn demand(&self) -> usize {
        self.hot.as_ref().map_or(0, |h| h.counted() + h.waiting()).max(self.debug_demand)
    }

    /// What a lender keeps of its share for `demand`: its claim
    /// ([`Controller::claimed`]) and the slots it keeps free beyond it:
    /// `SLOT_MARGIN` for its next hot key, or none when its keys are
    /// cooler than the cluster's hottest (its claim below its demand), as
    /// the margin would keep from a hotter key a slot its own are not
    /// entitled to.
    pub(super) fn keeps(&self, demand: usize) -> (usize, usize) {
        keeps(self.claimed(demand).0, demand)
    }

    /// A server that started asks the others how many of its slots they
    /// still hold (until all have said, or its first lease has passed).
    pub(super) fn ask_held(&mut self) {
        if self.now_ns() >= self.start_until {
            self.starting = None;
        }
        if let (Some(pending), Some(tx)) = (&self.starting, &self.slot_asks) {
            for (peer, _) in pending.iter().enumerate().filter(|(_, h)| h.is_none()) {
                let _ = tx.send(crate::slots::Ask::Held { peer: peer as u16 });
            }
        }
    }

    /// Tell the policy its REPL_high from the slots lent and held: held
    /// grants count while they last past the next tick, late by up to half
    /// an epoch.
    pub(super) fn set_cap(&mut self, now: u64) {
        let (Some(l), Some(h)) = (&self.ledger, &mut self.hot) else { return };
        let until = now + self.epoch_len.as_nanos() as u64 * SLOT_HORIZON_EPOCHS;
        let cap = l.cap(now, until);
        h.set_repl_high(Some(cap));
        let st = &mut self.hot_status;
        (st.repl_high, st.slots_lent, st.slots_held) = (cap, l.lent(now), l.held(until));
    }

    /// Lending by heat: how many slots the hottest keys of the whole
    /// cluster entitle this server to (its keys now, the others' from their
    /// epoch records heard lately: `mbal_balance::entitlements`), and each
    /// other server's keys with copies within its share beyond what it is
    /// entitled to (slots it would give up to hotter keys here when asked).
    /// `None` with Phase 1 off.
    fn claims(&self) -> Option<(usize, Vec<(u16, usize)>)> {
        let hot = self.hot.as_ref()?;
        let me = usize::from(self.shared.server_id);
        let mut heats = self.shared.peer_loads.heats(me, self.heard_since());
        if let Some(h) = heats.get_mut(me) {
            *h = Some(hot.slot_heat());
        }
        let view = view_of(&self.shared, self.core.map(), None);
        let refs: Vec<Option<&SlotHeat>> = heats.iter().map(Option::as_ref).collect();
        let entitled = entitlements(&refs, repl_high_total(view.n()));
        let shares: Vec<usize> =
            (0..heats.len()).map(|s| repl_high_share(&ClusterView { server: s as u16, ..view })).collect();
        let over = cedable(&refs, &shares, &entitled)
            .into_iter()
            .enumerate()
            .filter(|&(s, n)| s != me && n > 0)
            .map(|(s, n)| (s as u16, n))
            .collect();
        Some((entitled.get(me).copied().unwrap_or(0), over))
    }

    /// What this server claims of `demand` (keys with copies and keys
    /// waiting): no more than its keys' heat entitles it to, so that when
    /// every slot is in use a borrower whose keys are cooler than others'
    /// lets its loans end, and a lender lends to hotter keys than its own.
    /// A demand made for tests (`mbal debug slots`) is taken whole.
    /// With it, the servers whose keys with copies are cooler than this
    /// server's ([`Controller::claims`]).
    fn claimed(&self, demand: usize) -> (usize, Vec<(u16, usize)>) {
        match self.claims() {
            Some((entitled, over)) if self.debug_demand == 0 => (demand.min(entitled), over),
            _ => (demand, Vec::new()),
        }
    }

    /// Ask the servers with slots to spare for what `demand` (keys with
    /// copies and keys waiting) needs beyond this server's share, renewing
    /// what it holds first: those that said they would lend, and those
    /// whose keys with copies are cooler than this server's waiting ones.
    pub(super) fn ask_slots(&mut self, demand: usize, now: u64) {
        let lease_ms = slot_lease_ms(self.epoch_len);
        let (demand, over) = self.claimed(demand);
        let since = self.heard_since();
        let (Some(l), Some(tx)) = (&mut self.ledger, &self.slot_asks) else { return };
        let need = demand.saturating_sub(l.base());
        let mut spare = self.shared.peer_loads.spare(usize::from(self.shared.server_id), since);
        for (s, n) in over {
            match spare.iter_mut().find(|(p, _)| *p == s) {
                Some(e) => e.1 = e.1.max(n),
                None => spare.push((s, n)),
            }
        }
        let asks = l.asks(need, &spare, now);
        for &(lender, slots) in &asks {
            let _ = tx.send(crate::slots::Ask::Lend { lender, slots, lease_ms });
        }
        if !asks.is_empty() {
            tracing::trace!(server = self.shared.server_id, demand, need, ?asks, "slots asked");
        }
    }

    /// Another server asks for slots: grant what this one can spare, for
    /// the lease asked but at most this server's own (both sides count the
    /// lease the answer names).
    pub(super) fn lend(&mut self, borrower: u16, slots: usize, lease_ms: u64) -> (usize, u64) {
        let now = self.now_ns();
        let lease_ms = lease_ms.min(slot_lease_ms(self.epoch_len));
        let servers = self.core.map().servers().len();
        if self.hot.is_none() {
            return (0, lease_ms);
        }
        let (claim, margin) = self.keeps(self.demand());
        let Some(l) = &mut self.ledger else { return (0, lease_ms) };
        if borrower == self.shared.server_id || usize::from(borrower) >= servers {
            return (0, lease_ms);
        }
        let granted = l.lend(borrower, slots, lease_ms.saturating_mul(1_000_000), now, claim, margin);
        self.apply_cap(now);
        (granted, lease_ms)
    }

    /// A starting server heard from `peer` how many of its slots it holds:
    /// once every other server has said, only those count as lent.
    pub(super) fn peer_holds(&mut self, peer: u16, held: Option<usize>) {
        let Some(pending) = &mut self.starting else { return };
        if let Some(slot) = pending.get_mut(usize::from(peer)) {
            *slot = slot.or(held);
        }
        if pending.iter().all(Option::is_some) {
            let held: Vec<(u16, usize)> = pending.iter().enumerate().map(|(p, n)| (p as u16, n.unwrap_or(0))).collect();
            self.starting = None;
            if let Some(l) = &mut self.ledger {
                l.started(&held);
            }
            tracing::debug!(server = self.shared.server_id, ?held, "slots: every server said what it holds");
            self.set_cap(self.now_ns());
            self.publish_hot();
        }
    }

    pub(super) fn slots_granted(&mut self, lender: u16, slots: usize, asked_at: u64, lease_ns: u64) {
        let Some(l) = &mut self.ledger else { return };
        l.granted(lender, slots, asked_at, lease_ns);
        tracing::debug!(server = self.shared.server_id, lender, slots, "slots granted");
        // A smaller grant lowers the cap: what is beyond it goes at once, so
        // the keys with copies are within the cap between any two messages.
        self.apply_cap(self.now_ns());
    }

    /// Set the policy's cap and retire at once what is beyond it.
    pub(super) fn apply_cap(&mut self, now: u64) {
        self.set_cap(now);
        let retire = self.hot.as_mut().map(HotKeys::enforce_cap).unwrap_or_default();
        if !retire.is_empty() {
            tracing::debug!(server = self.shared.server_id, retired = retire.len(), "slots given back");
            self.retire_copies(&retire);
            self.send_grants(None);
        }
        self.publish_hot();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mbal_balance::SlotLedger;

    /// A lender whose keys are cooler than the cluster's hottest (entitled
    /// to one slot less than its share, below what it holds and waits for)
    /// lends that slot; with the margin on top it would lend none. A lender
    /// entitled to all it needs keeps the margin.
    #[test]
    fn a_lender_cooler_than_the_cluster_keeps_no_margin() {
        let base = 6;
        let (claim, margin) = keeps(base - 1, base + 2);
        assert_eq!(margin, 0);
        let mut l = SlotLedger::new(base);
        assert_eq!(l.lend(1, 3, 1_000, 0, claim, margin), 1);
        assert_eq!(SlotLedger::new(base).lend(1, 3, 1_000, 0, base - 1, SLOT_MARGIN), 0, "the margin kept it");

        let (claim, margin) = keeps(3, 3);
        assert_eq!(margin, SLOT_MARGIN);
        assert_eq!(SlotLedger::new(base).lend(1, 5, 1_000, 0, claim, margin), base - 3 - SLOT_MARGIN);
    }
}
