//! REPL_high shared across the cluster: slots lent between servers.
//!
//! REPL_high bounds the keys with copies in the whole cluster at
//! floor(2·n·ln n) (MBal §3.2). Each server starts with an even share (its
//! *base*, [`super::repl_high_share`]), but a shifted hot set does not fall
//! evenly on the servers: some have more keys waiting for a slot than their
//! share while others leave theirs unused (docs/benchmarks-journal.md §15, round 7).
//! So a server with keys waiting borrows slots from one with slots to
//! spare, for a short *lease* it renews while it needs them.
//!
//! The total stays within the cluster's REPL_high at every instant, however
//! late peers hear of each other, because every slot in use is counted
//! once:
//! * a lender counts a slot as lent from the moment it grants it until the
//!   grant's lease ends on its own clock ([`SlotLedger::lend`]); of several
//!   grants to one borrower that have not ended, the largest;
//! * a borrower counts a grant only from when it is answered until its
//!   lease ends measured from when it *asked* (earlier than the grant), less
//!   a margin (the time to its next check), by which it has given back
//!   what it no longer holds: [`super::HotKeys`] retires its coolest keys
//!   at once when its cap falls below its keys with copies.
//!
//! A server's cap is its base, less what it has lent, plus what it holds.
//! A server never lends while it holds a loan, and keeps `margin` slots of
//! its own free for keys of its own that may come. Pure bookkeeping: the
//! caller passes the clock (nanoseconds on its own monotonic clock) and
//! carries the asks and answers (`mbal slots`, docs/protocol.md).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One server's loans of REPL_high slots, given and held.
#[derive(Clone, Debug, Default)]
pub struct SlotLedger {
    base: usize,
    /// Grants to each borrower not yet ended: (slots, end), oldest first.
    lent: BTreeMap<u16, Vec<(usize, u64)>>,
    /// Grants held from each lender: (slots, end as the borrower counts it).
    held: BTreeMap<u16, (usize, u64)>,
    /// When this server last told each lender what it holds of its slots
    /// ([`SlotLedger::tell_held`]): an answer to an ask sent before then
    /// comes from before the lender's restart and is not taken.
    told: BTreeMap<u16, u64>,
}

impl SlotLedger {
    pub fn new(base: usize) -> SlotLedger {
        SlotLedger { base, ..SlotLedger::default() }
    }

    /// A server that starts counts its whole base as lent until `until`
    /// (a lease from its start): had it lent slots before a restart, its
    /// borrowers may hold them that long, and it does not know.
    pub fn starting(base: usize, until: u64) -> SlotLedger {
        let mut l = SlotLedger::new(base);
        l.lent.insert(u16::MAX, vec![(base, until)]);
        l
    }

    /// This server's share when nothing is lent (the cluster's size may
    /// change it).
    pub fn set_base(&mut self, base: usize) {
        self.base = base;
    }

    pub fn base(&self) -> usize {
        self.base
    }

    fn forget(&mut self, now: u64) {
        for g in self.lent.values_mut() {
            g.retain(|&(_, end)| end > now);
        }
        self.lent.retain(|_, g| !g.is_empty());
        self.held.retain(|_, &mut (n, end)| n > 0 && end > now);
    }

    /// Slots lent and not yet ended at `now`: per borrower the largest
    /// grant still running (it may be using any of them).
    pub fn lent(&self, now: u64) -> usize {
        self.lent_except(None, now)
    }

    fn lent_except(&self, skip: Option<u16>, now: u64) -> usize {
        self.lent
            .iter()
            .filter(|(b, _)| Some(**b) != skip)
            .map(|(_, g)| g.iter().filter(|(_, end)| *end > now).map(|(n, _)| *n).max().unwrap_or(0))
            .sum()
    }

    /// Slots held from other servers that may still be used at `at` (the
    /// caller passes its next check, so a grant ending before then is not
    /// counted now).
    pub fn held(&self, at: u64) -> usize {
        self.held.values().filter(|(_, end)| *end > at).map(|(n, _)| *n).sum()
    }

    /// The grants held at `at`: (lender, slots).
    pub fn holdings(&self, at: u64) -> Vec<(u16, usize)> {
        self.held.iter().filter(|(_, (n, end))| *n > 0 && *end > at).map(|(l, (n, _))| (*l, *n)).collect()
    }

    /// REPL_high for this server from `now` until `until` (its next check):
    /// its base, less what it has lent, plus what it holds until then.
    pub fn cap(&self, now: u64, until: u64) -> usize {
        (self.base + self.held(until)).saturating_sub(self.lent(now))
    }

    /// A server that started has heard from every other server how many
    /// of its slots it still holds (`held`: server, slots): it counts those
    /// as lent to each, until the lease from its start ends, in place of
    /// its whole share (so each may renew what it holds).
    pub fn started(&mut self, held: &[(u16, usize)]) {
        let Some(g) = self.lent.remove(&u16::MAX) else { return };
        let until = g.iter().map(|(_, end)| *end).max().unwrap_or(0);
        for &(peer, n) in held.iter().filter(|(p, n)| *n > 0 && *p != u16::MAX) {
            self.lent.entry(peer).or_default().push((n, until));
        }
    }

    /// `lender` (which started) asks what this server holds of its slots:
    /// the slots held from it not ended at `now`. From now on an answer to
    /// an ask sent before is not taken (it may come from before the
    /// restart, and the lender counts only what was told).
    pub fn tell_held(&mut self, lender: u16, now: u64) -> usize {
        self.told.insert(lender, now);
        self.held.get(&lender).filter(|(_, end)| *end > now).map_or(0, |(n, _)| *n)
    }

    /// What [`SlotLedger::lend`] would grant a new borrower now: what this
    /// server reports to the others as its slots to spare.
    pub fn spare(&self, now: u64, demand: usize, margin: usize) -> usize {
        if self.held(now) > 0 {
            return 0;
        }
        self.base.saturating_sub(demand + margin + self.lent(now))
    }

    /// A borrower asks for `asked` slots (replacing what it holds from this
    /// server) for `lease_ns`. `demand` is what this server needs now (its
    /// keys with copies and keys waiting for a slot); it keeps `margin`
    /// slots beyond that free, lends nothing while it holds a loan itself,
    /// and grants at most what is left once its other grants are counted.
    /// Returns the slots granted, counted as lent until `now + lease_ns`.
    pub fn lend(
        &mut self,
        borrower: u16,
        asked: usize,
        lease_ns: u64,
        now: u64,
        demand: usize,
        margin: usize,
    ) -> usize {
        self.forget(now);
        let spare = if self.held(now) > 0 || borrower == u16::MAX {
            0
        } else {
            self.base.saturating_sub(demand + margin + self.lent_except(Some(borrower), now))
        };
        let give = asked.min(spare);
        if give > 0 || self.lent.contains_key(&borrower) {
            self.lent.entry(borrower).or_default().push((give, now.saturating_add(lease_ns)));
        }
        give
    }

    /// A lender answered: `slots` granted for `lease_ns` to an ask sent at
    /// `asked_at`. Held (replacing what was held from it) until
    /// `asked_at + lease_ns`, the earliest the grant can end at the lender.
    pub fn granted(&mut self, lender: u16, slots: usize, asked_at: u64, lease_ns: u64) {
        if self.told.get(&lender).is_some_and(|t| asked_at < *t) {
            return;
        }
        self.held.insert(lender, (slots, asked_at.saturating_add(lease_ns)));
    }

    /// What to ask for at `now` to cover `need` slots beyond the base:
    /// first the lenders already held (renewed, up to what is needed;
    /// one no longer needed is not asked, and its grant ends), then the
    /// others by `spare` (server, slots it reported it would lend), most
    /// first, never asking one for more than it reported; what is still
    /// short is asked of a held lender too (its spare may have grown).
    /// Returns (lender, slots) asks.
    pub fn asks(&mut self, need: usize, spare: &[(u16, usize)], now: u64) -> Vec<(u16, usize)> {
        self.forget(now);
        let mut left = need;
        let mut out = Vec::new();
        let mut held: Vec<(u16, usize)> = self.held.iter().map(|(l, (n, _))| (*l, *n)).collect();
        held.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        for (l, n) in held {
            let keep = n.min(left);
            left -= keep;
            // Held but no longer needed: let it end (no ask); still needed: renew.
            if keep > 0 {
                out.push((l, keep));
            }
        }
        let mut others: Vec<(u16, usize)> =
            spare.iter().filter(|(s, n)| *n > 0 && !self.held.contains_key(s)).copied().collect();
        others.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        for (s, n) in others {
            if left == 0 {
                break;
            }
            let ask = n.min(left);
            left -= ask;
            out.push((s, ask));
        }
        if left > 0 {
            if let Some(first) = out.iter_mut().find(|(l, _)| self.held.contains_key(l)) {
                first.1 += left;
            }
        }
        out
    }
}

/// What one server's epoch record says of the keys that compete for
/// REPL_high slots: the rates (requests/s, hottest first) of its keys with
/// copies and of its keys waiting for a slot ([`HotKeys::slot_heat`]).
/// The servers lend by it ([`entitlements`]): when every slot is in use,
/// a slot goes to the hotter key wherever it is, not to whoever asked
/// first (docs/design-notes.md "REPL_high shared across the cluster").
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SlotHeat {
    #[serde(default)]
    pub held: Vec<f64>,
    #[serde(default)]
    pub waiting: Vec<f64>,
}

/// A waiting key outranks a key with copies only when this many times as
/// hot: the rule displacement follows within a server, here across
/// servers, so two keys of about the same rate do not take a slot from
/// each other in turn.
pub const CLAIM_FACTOR: f64 = 2.0;

/// How many of the cluster's `total` REPL_high slots each server's keys
/// would hold if the slots went to the hottest keys wherever they are: the
/// `total` best of every server's keys with copies (at their rate) and
/// keys waiting (at their rate over [`CLAIM_FACTOR`]), ties to the key
/// with copies, then to the lower server. A server not heard from lately
/// (`None`) claims nothing. Pure; each server computes it from the epoch
/// records it has, so two servers may briefly disagree: the ledger, not
/// this, keeps the total within REPL_high.
pub fn entitlements(heat: &[Option<&SlotHeat>], total: usize) -> Vec<usize> {
    // (score, waiting?, server)
    let mut keys: Vec<(f64, bool, usize)> = Vec::new();
    for (s, h) in heat.iter().enumerate() {
        let Some(h) = h else { continue };
        keys.extend(h.held.iter().map(|&r| (r, false, s)));
        keys.extend(h.waiting.iter().map(|&r| (r / CLAIM_FACTOR, true, s)));
    }
    keys.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut out = vec![0; heat.len()];
    for (_, _, s) in keys.into_iter().take(total) {
        out[s] += 1;
    }
    out
}

/// What each server could give up to hotter keys elsewhere, by
/// [`entitlements`] (`entitled`): its keys with copies beyond what it is
/// entitled to, when it holds no more than its share (`shares`; one
/// holding more borrows, and lends nothing). 0 for a server not heard.
pub fn cedable(heat: &[Option<&SlotHeat>], shares: &[usize], entitled: &[usize]) -> Vec<usize> {
    heat.iter()
        .enumerate()
        .map(|(s, h)| {
            let held = h.map_or(0, |h| h.held.len());
            if held > shares.get(s).copied().unwrap_or(0) {
                0
            } else {
                held.saturating_sub(entitled.get(s).copied().unwrap_or(0))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn the_slots_go_to_the_hottest_keys_wherever_they_are() {
        let a = SlotHeat { held: vec![900.0, 500.0, 40.0, 30.0], waiting: vec![] };
        let b = SlotHeat { held: vec![800.0], waiting: vec![600.0, 100.0, 70.0] };
        // 5 slots: 900, 800, 500 held; b's 600 waiting scores 300, ahead of
        // a's 40 held; b's 100 waiting (50) is ahead of a's 40 too.
        assert_eq!(entitlements(&[Some(&a), Some(&b)], 5), vec![2, 3]);
        // A waiting key must be twice as hot as a key with copies: b's 70
        // (35) is behind a's 40, so with 6 slots a keeps its 40.
        assert_eq!(entitlements(&[Some(&a), Some(&b)], 6), vec![3, 3]);
        // Enough slots for all: each is entitled to all it has and wants.
        assert_eq!(entitlements(&[Some(&a), Some(&b)], 88), vec![4, 4]);
        // A server not heard lately claims nothing.
        assert_eq!(entitlements(&[Some(&a), None], 3), vec![3, 0]);
        assert_eq!(entitlements(&[], 3), Vec::<usize>::new());
        // Ties: the key with copies, then the lower server.
        let c = SlotHeat { held: vec![], waiting: vec![200.0] };
        let d = SlotHeat { held: vec![100.0], waiting: vec![] };
        assert_eq!(entitlements(&[Some(&c), Some(&d)], 1), vec![0, 1]);
        assert_eq!(entitlements(&[Some(&d), Some(&d)], 1), vec![1, 0]);
        // What each could give up, of 5 slots: a its 4 keys with copies
        // less the 2 it is entitled to; b its 1, within its 3; e holds 3,
        // more than its share of 2 (it borrows, and lends nothing); an
        // unheard server nothing.
        let e = SlotHeat { held: vec![10.0, 9.0, 8.0], waiting: vec![] };
        let heat = [Some(&a), Some(&b), Some(&e), None];
        let entitled = entitlements(&heat, 5);
        assert_eq!(entitled, vec![2, 3, 0, 0]);
        assert_eq!(cedable(&heat, &[5, 2, 2, 5], &entitled), vec![2, 0, 0, 0]);
        assert_eq!(cedable(&heat, &[5, 2, 3, 5], &entitled), vec![2, 0, 3, 0], "within its share: all 3");
    }

    #[test]
    fn a_lender_grants_what_it_can_spare_and_counts_it_until_the_lease_ends() {
        let mut l = SlotLedger::new(11);
        // 3 keys with copies and 1 waiting, a margin of 1: 6 to spare.
        assert_eq!(l.lend(7, 10, 2 * S, 0, 4, 1), 6);
        assert_eq!(l.cap(0, S), 5);
        assert_eq!(l.lend(0, 3, 2 * S, S / 2, 4, 1), 0, "all lent to 7");
        // 7 renews for less: the larger grant still counts until it ends.
        assert_eq!(l.lend(7, 2, 2 * S, S, 4, 1), 2);
        assert_eq!(l.lent(S), 6);
        assert_eq!(l.lent(2 * S), 2, "the first grant ended");
        assert_eq!(l.lent(3 * S), 0);
        assert_eq!(l.cap(3 * S, 4 * S), 11);
    }

    #[test]
    fn a_borrower_counts_a_grant_from_when_it_asked_and_stops_before_it_ends() {
        let mut b = SlotLedger::new(11);
        b.granted(3, 5, 10 * S, 2 * S + S / 2);
        assert_eq!(b.cap(10 * S, 11 * S), 16);
        // At the next check, one epoch later, the grant would end before the one after.
        assert_eq!(b.cap(11 * S, 12 * S + S / 2), 11);
        // A server holding a loan lends nothing.
        assert_eq!(b.lend(4, 2, 2 * S, 10 * S, 0, 1), 0);
    }

    #[test]
    fn a_server_that_starts_lends_nothing_and_holds_no_slot_of_its_own_for_a_lease() {
        let mut l = SlotLedger::starting(11, 3 * S);
        assert_eq!(l.cap(0, S), 0);
        assert_eq!(l.spare(S, 0, 1), 0);
        assert_eq!(l.lend(2, 4, 3 * S, S, 0, 1), 0);
        assert_eq!(l.cap(3 * S, 4 * S), 11);
        assert_eq!(l.spare(3 * S, 2, 1), 8);
        assert_eq!(l.lend(2, 4, 3 * S, 3 * S, 2, 1), 4);
        // Told that server 2 holds 2 of its slots, it counts only those,
        // as lent to 2: 2 may renew them.
        let mut l = SlotLedger::starting(11, 3 * S);
        l.started(&[(2, 2), (4, 0)]);
        assert_eq!(l.cap(S, 2 * S), 9);
        assert_eq!(l.lend(2, 2, 3 * S, S, 0, 1), 2);
        assert_eq!(l.lend(5, 9, 3 * S, S, 0, 1), 8, "11 less the margin and 2's");
        let mut b = SlotLedger::new(11);
        b.granted(4, 3, 0, 3 * S);
        assert_eq!((b.tell_held(4, S), b.tell_held(5, S)), (3, 0));
        // An answer to an ask sent before it told 4 is not taken (4 restarted since).
        b.granted(4, 5, S / 2, 3 * S);
        assert_eq!(b.holdings(S), vec![(4, 3)]);
        b.granted(4, 1, 2 * S, 3 * S);
        assert_eq!(b.holdings(2 * S), vec![(4, 1)]);
    }

    #[test]
    fn asks_renew_what_is_held_first_then_take_the_most_spare() {
        let mut b = SlotLedger::new(11);
        b.granted(2, 3, 0, 10 * S);
        assert_eq!(b.asks(7, &[(1, 2), (5, 6), (2, 8)], S), vec![(2, 3), (5, 4)]);
        assert_eq!(b.asks(2, &[(1, 2), (5, 6)], S), vec![(2, 2)], "need fell: renew less");
        assert_eq!(b.asks(0, &[(1, 2)], S), vec![], "not needed: let it end");
        assert_eq!(b.asks(9, &[(1, 2)], S), vec![(2, 7), (1, 2)], "short: ask the held lender for the rest");
    }

    /// Servers lending to each other with every ask late by up to an epoch
    /// and every answer by up to one and a half, asks and grants crossing,
    /// ticks late by up to 0.95 of an epoch, and servers restarting (with
    /// nothing of their ledger, answers to their old asks still on the
    /// way): at every instant the slots in use (each server's keys with
    /// copies, never above its cap after any change of it) add up to at most
    /// the sum of the bases. As the controller does: at each tick a server
    /// takes its cap, retires what is beyond it and asks; a grant's answer
    /// sets the cap at once (alarms may use a raised one, and a lowered one
    /// is enforced at once); a server that starts asks every other what it
    /// holds of its slots.
    #[test]
    fn the_slots_in_use_never_pass_the_total_however_late_the_answers() {
        for seed in 0..8 {
            lending_run(seed);
        }
    }

    fn lending_run(seed: u64) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let servers = 5usize;
        let base = 6usize;
        let epoch = S;
        // The controller's lease (4 epochs) and horizon (its next tick,
        // up to two epochs away).
        let lease = 4 * S;
        let horizon = 2 * S;
        let mut led: Vec<SlotLedger> = (0..servers).map(|_| SlotLedger::new(base)).collect();
        let mut used = vec![0usize; servers];
        let mut demand = vec![0usize; servers];
        // A restarted server's question (who holds of its slots), answered
        // by each other server: None until then. Its incarnation, so that
        // answers to an earlier one are dropped.
        let mut starting: Vec<Option<Vec<Option<usize>>>> = vec![None; servers];
        let mut inc = vec![0u32; servers];
        // In flight: (deliver at, lender, borrower, asked, asked at) asks and
        // (deliver at, borrower, lender, slots, asked at) answers;
        // (deliver at, asker, asked, asker's incarnation) held questions and
        // (deliver at, asker, asked, held, asker's incarnation) their answers.
        let mut asks: Vec<(u64, usize, usize, usize, u64)> = Vec::new();
        let mut answers: Vec<(u64, usize, usize, usize, u64)> = Vec::new();
        let mut questions: Vec<(u64, usize, usize, u32)> = Vec::new();
        let mut told: Vec<(u64, usize, usize, usize, u32)> = Vec::new();
        let mut now = 0u64;
        let (mut borrowing, mut restarts) = (0usize, 0usize);
        let mut checks: Vec<u64> = (0..servers).map(|_| rng.gen_range(0..epoch)).collect();
        let fit = |l: &SlotLedger, now: u64, want: usize| want.min(l.cap(now, now + horizon));
        while now < 1000 * S {
            now += S / 20;
            // Deliver what is due.
            let (due, rest): (Vec<_>, Vec<_>) = asks.drain(..).partition(|a| a.0 <= now);
            asks = rest;
            for (_, lender, borrower, n, at) in due {
                let d = used[lender].max(demand[lender]);
                let g = led[lender].lend(borrower as u16, n, lease, now, d, 1);
                answers.push((now + rng.gen_range(0..epoch + epoch / 2), borrower, lender, g, at));
            }
            let (due, rest): (Vec<_>, Vec<_>) = answers.drain(..).partition(|a| a.0 <= now);
            answers = rest;
            for (_, b, lender, g, at) in due {
                led[b].granted(lender as u16, g, at, lease);
                used[b] = fit(&led[b], now, used[b].max(demand[b]));
            }
            let (due, rest): (Vec<_>, Vec<_>) = questions.drain(..).partition(|q| q.0 <= now);
            questions = rest;
            for (_, asker, asked, i) in due {
                let n = led[asked].tell_held(asker as u16, now);
                told.push((now + rng.gen_range(0..epoch), asker, asked, n, i));
            }
            let (due, rest): (Vec<_>, Vec<_>) = told.drain(..).partition(|t| t.0 <= now);
            told = rest;
            for (_, asker, asked, n, i) in due {
                let Some(pending) = starting[asker].as_mut().filter(|_| inc[asker] == i) else { continue };
                pending[asked] = pending[asked].or(Some(n));
                if pending.iter().all(Option::is_some) {
                    let held: Vec<(u16, usize)> =
                        pending.iter().enumerate().map(|(p, n)| (p as u16, n.unwrap_or(0))).collect();
                    led[asker].started(&held);
                    starting[asker] = None;
                }
            }
            // Each server's tick, about once per epoch at its own phase,
            // late by up to 0.95 of an epoch.
            for s in 0..servers {
                if now < checks[s] {
                    continue;
                }
                checks[s] = now + rng.gen_range(epoch * 6 / 10..=epoch * 195 / 100);
                if rng.gen_bool(0.02) {
                    // A restart: nothing kept.
                    restarts += 1;
                    inc[s] += 1;
                    led[s] = SlotLedger::starting(base, now + lease);
                    (used[s], demand[s]) = (0, 0);
                    let mut pending = vec![None; servers];
                    pending[s] = Some(0);
                    starting[s] = Some(pending);
                }
                if rng.gen_bool(0.5) {
                    demand[s] = rng.gen_range(0..2 * base);
                }
                used[s] = fit(&led[s], now, demand[s]);
                if let Some(pending) = &starting[s] {
                    for (o, _) in pending.iter().enumerate().filter(|(_, h)| h.is_none()) {
                        questions.push((now + rng.gen_range(0..epoch), s, o, inc[s]));
                    }
                }
                let need = demand[s].saturating_sub(led[s].base());
                let spare: Vec<(u16, usize)> = (0..servers)
                    .filter(|o| *o != s)
                    .map(|o| (o as u16, led[o].spare(now, used[o].max(demand[o]), 1)))
                    .collect();
                for (l, n) in led[s].asks(need, &spare, now) {
                    asks.push((now + rng.gen_range(0..epoch), l as usize, s, n, now));
                }
            }
            // What is in use now.
            let total: usize = used.iter().sum();
            assert!(total <= servers * base, "seed {seed}: {total} slots in use at {now}: {used:?}");
            borrowing += used.iter().filter(|u| **u > base).count();
        }
        assert!(borrowing > 1000, "servers did use borrowed slots: {borrowing}");
        assert!(restarts >= 20, "servers restarted: {restarts}");
    }
}
