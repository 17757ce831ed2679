//! The REPL_high slots lent between servers, in the core (Phase 1;
//! `SlotLedger` has the rules, docs/design-notes.md "REPL_high shared
//! across the cluster"): the tick that gives back and renews, asks,
//! lending, and a starting server's question to the others.

use super::{Command, ControlCore};
use crate::hot::{cedable, entitlements, repl_high_share, repl_high_total, ClusterView, SlotHeat, SlotLedger};

/// REPL_high slots lent between servers (`SlotLedger`): a grant lasts this
/// many epochs, and a borrower renews what it still needs every epoch.
pub const SLOT_LEASE_EPOCHS: u64 = 4;
/// A borrower counts a grant only while it lasts past two more epochs (its
/// next tick, late by up to an epoch), so it gives back what it no longer
/// holds before the grant ends at the lender.
pub const SLOT_HORIZON_EPOCHS: u64 = 2;
/// Slots a lender keeps free beyond its own needs.
pub const SLOT_MARGIN: usize = 1;
/// An alarm that leaves keys waiting asks for slots at once, but at most
/// this often (ms).
pub const SLOT_ASK_EVERY_MS: u64 = 250;

/// The lease of a grant: `SLOT_LEASE_EPOCHS` epochs, at most a minute.
pub fn slot_lease_ms(epoch_ms: u64) -> u64 {
    (epoch_ms * SLOT_LEASE_EPOCHS).clamp(1, 60_000)
}

/// A lender's claim and margin for `demand` ([`ControlCore::keeps`]).
fn keeps(claim: usize, demand: usize) -> (usize, usize) {
    (claim, if claim < demand { 0 } else { SLOT_MARGIN })
}

type Out<R> = Vec<Command<R>>;

impl<R: Clone> ControlCore<R> {
    fn epoch_ns(&self) -> u64 {
        self.settings.epoch_ms.max(1) * 1_000_000
    }

    /// At the start: slots are lent only under the default REPL_high (the
    /// cluster's floor(2·n·ln n)); an explicit REPL_high is per server. A
    /// server that starts counts its share as lent for a lease (its
    /// borrowers may hold slots it lent before a restart), until the
    /// others say how many they still hold (a fresh cluster: none).
    pub(super) fn start_slots(&mut self, now: u64) {
        let lease_ns = slot_lease_ms(self.settings.epoch_ms) * 1_000_000;
        self.start_until = now + lease_ns;
        let lends = self.hot.is_some() && self.settings.hot.as_ref().is_some_and(|h| h.lend_slots);
        if !lends {
            return;
        }
        self.ledger = Some(SlotLedger::starting(repl_high_share(&self.view(None)), now + lease_ns));
        let mut said = vec![None; self.map.servers().len()];
        if let Some(me) = said.get_mut(usize::from(self.settings.server)) {
            *me = Some(0);
        }
        self.starting = Some(said);
    }

    /// The tick: give back what is no longer held (the policy retires its
    /// coolest keys beyond the cap at once) and renew what is still
    /// needed. At every tick, not only when an epoch's samples are in, so
    /// that a stalled worker cannot delay either past a lease.
    pub(super) fn slot_tick(&mut self, now: u64, out: &mut Out<R>) {
        if self.ledger.is_none() {
            return;
        }
        self.ask_held(now, out);
        self.apply_cap(now, out);
        if self.hot.is_none() {
            return;
        }
        self.ask_slots(self.demand(), now, out);
    }

    /// Peers' epoch records count when heard since this: the last three
    /// epochs (for the cluster's mean load, slots to spare and heat).
    pub(super) fn heard_since(&self, now: u64) -> u64 {
        now.saturating_sub(self.epoch_ns() * 3)
    }

    /// What this server needs of REPL_high now: its keys with copies that
    /// count against it (pinned ones do not) and its keys waiting for a
    /// slot; a demand made for tests (`mbal debug slots`) when larger.
    pub(super) fn demand(&self) -> usize {
        self.hot.as_ref().map_or(0, |h| h.counted() + h.waiting()).max(self.debug_demand)
    }

    /// What a lender keeps of its share for `demand`: its claim
    /// ([`ControlCore::claimed`]) and the slots it keeps free beyond it:
    /// `SLOT_MARGIN` for its next hot key, or none when its keys are
    /// cooler than the cluster's hottest (its claim below its demand), as
    /// the margin would keep from a hotter key a slot its own are not
    /// entitled to.
    pub(super) fn keeps(&self, demand: usize, now: u64) -> (usize, usize) {
        keeps(self.claimed(demand, now).0, demand)
    }

    /// A server that started asks the others how many of its slots they
    /// still hold (until all have said, or its first lease has passed).
    pub(super) fn ask_held(&mut self, now: u64, out: &mut Out<R>) {
        if now >= self.start_until {
            self.starting = None;
        }
        if let Some(pending) = &self.starting {
            for (peer, _) in pending.iter().enumerate().filter(|(_, h)| h.is_none()) {
                out.push(Command::AskHeld { peer: peer as u16 });
            }
        }
    }

    /// Tell the policy its REPL_high from the slots lent and held: held
    /// grants count while they last past the next tick, late by up to half
    /// an epoch.
    pub(super) fn set_cap(&mut self, now: u64) {
        let (Some(l), Some(h)) = (&self.ledger, &mut self.hot) else { return };
        let until = now + self.settings.epoch_ms.max(1) * 1_000_000 * SLOT_HORIZON_EPOCHS;
        let cap = l.cap(now, until);
        h.set_repl_high(Some(cap));
        let st = &mut self.hot_status;
        (st.repl_high, st.slots_lent, st.slots_held) = (cap, l.lent(now), l.held(until));
    }

    /// Lending by heat: how many slots the hottest keys of the whole
    /// cluster entitle this server to (its keys now, the others' from their
    /// epoch records heard lately: `entitlements`), and each other server's
    /// keys with copies within its share beyond what it is entitled to
    /// (slots it would give up to hotter keys here when asked). `None`
    /// with Phase 1 off.
    fn claims(&self, now: u64) -> Option<(usize, Vec<(u16, usize)>)> {
        let hot = self.hot.as_ref()?;
        let me = usize::from(self.settings.server);
        let mut heats = self.peers.heats(me, self.heard_since(now));
        if let Some(h) = heats.get_mut(me) {
            *h = Some(hot.slot_heat());
        }
        let view = self.view(None);
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
    /// server's ([`ControlCore::claims`]).
    fn claimed(&self, demand: usize, now: u64) -> (usize, Vec<(u16, usize)>) {
        match self.claims(now) {
            Some((entitled, over)) if self.debug_demand == 0 => (demand.min(entitled), over),
            _ => (demand, Vec::new()),
        }
    }

    /// Ask the servers with slots to spare for what `demand` (keys with
    /// copies and keys waiting) needs beyond this server's share, renewing
    /// what it holds first: those that said they would lend, and those
    /// whose keys with copies are cooler than this server's waiting ones.
    pub(super) fn ask_slots(&mut self, demand: usize, now: u64, out: &mut Out<R>) {
        let lease_ms = slot_lease_ms(self.settings.epoch_ms);
        let (demand, over) = self.claimed(demand, now);
        let since = self.heard_since(now);
        let Some(l) = &mut self.ledger else { return };
        let need = demand.saturating_sub(l.base());
        let mut spare = self.peers.spare(usize::from(self.settings.server), since);
        for (s, n) in over {
            match spare.iter_mut().find(|(p, _)| *p == s) {
                Some(e) => e.1 = e.1.max(n),
                None => spare.push((s, n)),
            }
        }
        for (lender, slots) in l.asks(need, &spare, now) {
            out.push(Command::AskLend { lender, slots, lease_ms });
        }
    }

    /// Another server asks for slots: grant what this one can spare, for
    /// the lease asked but at most this server's own (both sides count the
    /// lease the answer names).
    pub(super) fn lend(
        &mut self,
        now: u64,
        borrower: u16,
        slots: usize,
        lease_ms: u64,
        out: &mut Out<R>,
    ) -> (usize, u64) {
        let lease_ms = lease_ms.min(slot_lease_ms(self.settings.epoch_ms));
        let servers = self.map.servers().len();
        if self.hot.is_none() {
            return (0, lease_ms);
        }
        let (claim, margin) = self.keeps(self.demand(), now);
        let Some(l) = &mut self.ledger else { return (0, lease_ms) };
        if borrower == self.settings.server || usize::from(borrower) >= servers {
            return (0, lease_ms);
        }
        let granted = l.lend(borrower, slots, lease_ms.saturating_mul(1_000_000), now, claim, margin);
        self.apply_cap(now, out);
        (granted, lease_ms)
    }

    /// A starting server heard from `peer` how many of its slots it holds:
    /// once every other server has said, only those count as lent.
    pub(super) fn peer_holds(&mut self, now: u64, peer: u16, held: Option<usize>, out: &mut Out<R>) {
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
            self.set_cap(now);
            self.publish_hot(out);
        }
    }

    /// Set the policy's cap and retire at once what is beyond it.
    pub(super) fn apply_cap(&mut self, now: u64, out: &mut Out<R>) {
        self.set_cap(now);
        let retire = self.hot.as_mut().map(|h| h.enforce_cap()).unwrap_or_default();
        if !retire.is_empty() {
            self.retire_copies(&retire, out);
            self.send_grants(None, out);
        }
        self.publish_hot(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
