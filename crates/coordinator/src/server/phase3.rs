//! Phase 3 at the coordinator (docs/design-notes.md, "Phase 3 at the coordinator"): the
//! servers' epoch reports (`mbal phase3 <id> <bytes>` and a JSON `Phase3Report`) feed
//! `mbal_balance::Phase3`, the policy core the simulator runs too; once per coordinator epoch
//! (`--phase3-epoch-ms`) the leader asks it for migrations and hands them to the ordered moves
//! (`orchestra`), whose ends go back to it.

use super::*;
use mbal_balance::{Phase3, Phase3Event, Phase3Report};

/// The core and when it last planned.
pub(crate) struct Driver {
    core: Phase3,
    epoch: Duration,
    last: Instant,
    /// Migrations the core issued, as the orchestra runs them (by cachelet).
    issued: Vec<u32>,
    pub reports: u64,
    pub issued_total: u64,
}

impl Driver {
    pub fn new(epoch: Duration) -> Driver {
        Driver {
            core: Phase3::new(Default::default()),
            epoch,
            last: Instant::now(),
            issued: Vec::new(),
            reports: 0,
            issued_total: 0,
        }
    }
}

/// `mbal phase3 <id> <bytes>` and its block: a server's epoch report.
pub(super) fn report(sh: &Shared, id: u16, block: &[u8], out: &mut Vec<u8>) {
    let Some(d) = &sh.phase3 else {
        // Phase 3 is off here: the report is not needed.
        out.extend_from_slice(b"OK\r\n");
        return;
    };
    let r: Phase3Report = match serde_json::from_slice(block) {
        Ok(r) => r,
        Err(e) => {
            sh.lock().counters.bad_commands += 1;
            let _ = write!(out, "CLIENT_ERROR bad phase 3 report: {e}\r\n");
            return;
        }
    };
    if r.report.server != id {
        let _ = write!(out, "CLIENT_ERROR the report is server {}'s\r\n", r.report.server);
        return;
    }
    let mut d = d.lock().unwrap_or_else(|e| e.into_inner());
    d.reports += 1;
    // Every step may start migrations (one that waited for its source to be free).
    let mut migrations = Vec::new();
    for ev in r.events() {
        migrations.extend(d.core.step(ev));
    }
    issue(sh, &mut d, migrations);
    out.extend_from_slice(b"OK\r\n");
}

/// Hand the core's migrations to the ordered moves, and remember them. One to or from a
/// server being drained (`mbal drain`, `mbal cluster remove-server`) is not run: the core
/// hears it failed (the cachelet cools down; the end may start another). Without this, an
/// emptied server still Up looked underloaded and Phase 3 gave it cachelets again while it
/// was being removed ("still owns cachelets").
fn issue(sh: &Shared, d: &mut Driver, mut migrations: Vec<mbal_balance::Migrate>) {
    let draining = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner()).draining();
    if !draining.is_empty() {
        let mut kept = Vec::new();
        // bounded: each refusal puts its cachelet in cooldown, so a cachelet comes back once
        while !migrations.is_empty() {
            let (refused, ok): (Vec<_>, Vec<_>) =
                migrations.into_iter().partition(|m| draining.contains(&m.to.0) || draining.contains(&m.from.0));
            kept.extend(ok);
            migrations = Vec::new();
            for m in refused {
                tracing::info!(cachelet = m.cachelet, from = ?m.from, to = ?m.to, "coordinator: Phase 3 move not run: a server being drained");
                migrations.extend(d.core.step(Phase3Event::Failed { cachelet: m.cachelet }));
            }
        }
        migrations = kept;
    }
    if migrations.is_empty() {
        return;
    }
    for m in &migrations {
        tracing::info!(cachelet = m.cachelet, from = ?m.from, to = ?m.to, bytes = m.bytes, load = m.load, "coordinator: Phase 3 moves a cachelet");
        d.issued.push(m.cachelet);
    }
    d.issued_total += migrations.len() as u64;
    let plan = migrations.iter().map(|m| (m.cachelet, m.to)).collect();
    sh.orchestra.lock().unwrap_or_else(|e| e.into_inner()).add_once(plan);
}

/// The leader's tick: the ends of the core's migrations go back to it; once per epoch it plans.
pub(super) fn tick(sh: &Arc<Shared>, now: Instant) {
    let Some(d) = &sh.phase3 else { return };
    // The members, read before the core's lock is taken (`stats` takes the state's lock, then
    // the core's: one order for both).
    let up: Vec<u16> = sh
        .lock()
        .members()
        .iter()
        .enumerate()
        .filter(|(_, m)| m.state == crate::state::MemberState::Up)
        .map(|(s, _)| s as u16)
        .collect();
    let mut d = d.lock().unwrap_or_else(|e| e.into_inner());
    let ended = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner()).take_ended();
    let mut migrations = Vec::new();
    for (cachelet, bytes) in ended {
        if let Some(i) = d.issued.iter().position(|&c| c == cachelet) {
            d.issued.swap_remove(i);
            let ev = match bytes {
                Some(bytes) => Phase3Event::Finished { cachelet, bytes },
                None => Phase3Event::Failed { cachelet },
            };
            // The end of one migration may start the next of its source.
            migrations.extend(d.core.step(ev));
        }
    }
    if now.duration_since(d.last) >= d.epoch {
        d.last = now;
        // Plan over the members only: a dead or departed server's last report is forgotten.
        migrations.extend(d.core.step(Phase3Event::Members { up }));
        migrations.extend(d.core.step(Phase3Event::Epoch));
    }
    issue(sh, &mut d, migrations);
}
