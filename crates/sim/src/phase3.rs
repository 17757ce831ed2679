//! Phase 3 in the sim: the migrations the coordinator's core (`mbal_balance::Phase3`) asks
//! for, each taking its bytes / `--migrate-gbps`, and their ends told back to the core and,
//! as the coordinator's new map, to both servers' cores.

use crate::{Pending, Sim};
use mbal_balance::{Event, Migrate, Phase3Event};
use std::cmp::Reverse;
use std::collections::VecDeque;

impl Sim<'_> {
    /// Give Phase 3 an event at `t` and start the migrations it asks for (a migration that
    /// cannot start, its cachelet not at its source or moving already, fails at once).
    pub(crate) fn phase3_step(&mut self, ev: Phase3Event, t: u64) {
        let Some(p3) = self.phase3.as_mut() else { return };
        let mut todo: VecDeque<Migrate> = p3.step(ev).into();
        while let Some(m) = todo.pop_front() {
            let c = m.cachelet as usize;
            let moving = self.pending.iter().any(|p| p.0.moves(m.cachelet));
            if c >= self.owner.len() || self.owner[c] != m.from || moving || m.to.0 == m.from.0 {
                self.migrations_failed += 1;
                if let Some(p3) = self.phase3.as_mut() {
                    todo.extend(p3.step(Phase3Event::Failed { cachelet: m.cachelet }));
                }
                continue;
            }
            let secs = m.bytes as f64 / (self.a.migrate_gbps * 1e9);
            self.next_seq += 1;
            self.pending.push(Reverse(Pending {
                at_ns: t + (secs * 1e9).round() as u64,
                seq: self.next_seq,
                server: m.from.0,
                token: 0,
                cachelet: m.cachelet,
                to: m.to.1,
                to_server: m.to.0,
                bytes: m.bytes,
                copies: false,
                key: 0,
            }));
            self.migrations_started += 1;
        }
    }

    /// A migration's data has arrived: the destination owns the cachelet (the coordinator's
    /// map says so, both servers' cores are given it), unless the source's workers were moving
    /// it meanwhile (then it failed).
    pub(crate) fn migration_ends(&mut self, p: Pending, t: u64) {
        let c = p.cachelet as usize;
        let local = self.pending.iter().any(|q| q.0.moves(p.cachelet));
        let ev = if self.owner[c].0 != p.server || local {
            self.migrations_failed += 1;
            Phase3Event::Failed { cachelet: p.cachelet }
        } else {
            self.owner[c] = (p.to_server, p.to);
            // An imported cachelet's counters start from zero.
            self.reads[c] = 0.0;
            self.writes[c] = 0.0;
            self.cmap.move_cachelet(p.cachelet, (p.to_server, p.to));
            let mut events = self.drop_hot_of(p.cachelet);
            for s in [p.server, p.to_server] {
                events.push_back((s, Event::Map { map: self.cmap.clone(), reset: false }));
            }
            self.deliver(t, events, &[]);
            self.migrations_done += 1;
            self.migrated_bytes += p.bytes;
            self.total_migrations += 1;
            self.total_migrated += p.bytes;
            Phase3Event::Finished { cachelet: p.cachelet, bytes: p.bytes }
        };
        self.phase3_step(ev, t);
    }
}
