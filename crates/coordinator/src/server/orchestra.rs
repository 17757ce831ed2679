//! The moves the coordinator orders (docs/design-notes.md, "Cross-server migration"): a warm
//! join's share, a drained server's cachelets (`mbal drain`, `mbal cluster remove-server`), a
//! rebalance (`mbal rebalance`). Each is one `mbal migrate` to the source server, which runs
//! it and answers when it ends (the source's mover asks this coordinator to begin and commit
//! it: the map changes only there). At most `MAX_RUNNING` at once; the detector's tick starts
//! the next ones while this coordinator leads. A drained server is made Left once it owns
//! nothing and no move runs.

use super::*;
use mbal_cluster::{CacheletId, Owner};
use std::collections::VecDeque;

/// Moves the coordinator runs at once.
pub(crate) const MAX_RUNNING: usize = 2;
/// Tries of one move (a source busy with another move, a destination not known yet).
const TRIES: u8 = 3;
/// How long one move may take before its source is given up on.
const MOVE_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Default)]
pub(crate) struct Orchestra {
    /// Moves to start, with the tries they had.
    queue: VecDeque<(CacheletId, Owner, u8)>,
    /// Moves running, with their source server.
    running: Vec<(CacheletId, Owner, u16)>,
    /// Servers to make Left once they own nothing.
    draining: Vec<u16>,
    pub done: u64,
    pub failed: u64,
    /// Moves that ended (for Phase 3): the cachelet, and the bytes moved (None: failed).
    ended: Vec<(CacheletId, Option<u64>)>,
    /// Cachelets whose move is not tried again when it fails (Phase 3's: the policy decides).
    once: Vec<CacheletId>,
}

impl Orchestra {
    /// Queue `plan`: the moves queued or taking a new destination. Plans are made with the
    /// pending moves counted as done (`Coord::with_pending`), so a later plan is the newer
    /// intent: a cachelet still queued takes the later plan's destination (a second server
    /// that joins while the first one's share is queued takes part of that share: each then
    /// gets its own), and one whose move runs is moved again from where that move takes it
    /// (a follow-up, queued; it starts once the running move ended: its source is busy until
    /// then). So a server drained while another drain's moves run towards it gives those
    /// cachelets on as well.
    /// Callers hold `Shared::plans` from reading [`Orchestra::pending`] for the plan to this
    /// call, so that two plans are not both made against the same pending moves.
    pub fn add(&mut self, plan: Vec<(CacheletId, Owner)>) -> usize {
        self.add_with(plan, true)
    }

    fn add_with(&mut self, plan: Vec<(CacheletId, Owner)>, retarget: bool) -> usize {
        let mut n = 0;
        for m in plan {
            match self.running.iter().find(|r| r.0 == m.0) {
                Some(r) if !retarget || r.1 == m.1 => continue,
                _ => {}
            }
            match self.queue.iter_mut().find(|q| q.0 == m.0) {
                Some(q) if q.1 == m.1 || !retarget => {}
                Some(q) => {
                    *q = (m.0, m.1, 0);
                    n += 1;
                }
                None => {
                    self.queue.push_back((m.0, m.1, 0));
                    n += 1;
                }
            }
        }
        n
    }

    /// Queue moves that are tried once (Phase 3's). Made from load reports, not against the
    /// pending moves: a cachelet already queued (a join's or a drain's share) keeps its
    /// destination.
    pub fn add_once(&mut self, plan: Vec<(CacheletId, Owner)>) {
        let plan: Vec<_> = plan
            .into_iter()
            .filter(|m| !self.queue.iter().any(|q| q.0 == m.0) && !self.running.iter().any(|r| r.0 == m.0))
            .collect();
        for m in &plan {
            if !self.once.contains(&m.0) {
                self.once.push(m.0);
            }
        }
        self.add_with(plan, false);
    }

    /// The moves that ended since the last call.
    pub fn take_ended(&mut self) -> Vec<(CacheletId, Option<u64>)> {
        std::mem::take(&mut self.ended)
    }

    pub fn drain(&mut self, id: u16) {
        if !self.draining.contains(&id) {
            self.draining.push(id);
        }
    }

    /// The moves queued or running, as (cachelet, destination).
    pub fn pending(&self) -> Vec<(CacheletId, Owner)> {
        self.running.iter().map(|r| (r.0, r.1)).chain(self.queue.iter().map(|q| (q.0, q.1))).collect()
    }

    /// The servers being drained.
    pub fn draining(&self) -> Vec<u16> {
        self.draining.clone()
    }

    /// `QUEUED`/`RUNNING <cachelet> <server>:<worker>` lines.
    pub fn rows(&self) -> Vec<String> {
        let row = |w: &str, c: CacheletId, (s, k): Owner| format!("{w} {c} {s}:{k}");
        let running = self.running.iter().map(|m| row("RUNNING", m.0, m.1));
        running.chain(self.queue.iter().map(|m| row("QUEUED", m.0, m.1))).collect()
    }
}

/// One tick (the leader's detector thread): start what may start, finish drains.
pub(super) fn tick(sh: &Arc<Shared>) {
    let mut starts = Vec::new();
    let mut leaves = Vec::new();
    {
        let c = sh.lock();
        let mut o = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner());
        // One move per source server at a time (its worker moves one cachelet at a time).
        let mut i = 0;
        while o.running.len() < MAX_RUNNING && i < o.queue.len() {
            let (cl, to, tries) = o.queue[i];
            if cl >= c.map().cachelet_count() {
                o.queue.remove(i);
                continue;
            }
            let (from, _) = c.map().owner(cl);
            let up = |s: u16| c.members().get(s as usize).is_some_and(|m| m.state == MemberState::Up);
            if from == to.0 || !up(from) || !up(to.0) || !c.map().has_worker(to) {
                o.queue.remove(i); // done already, or no longer possible
                continue;
            }
            if o.running.iter().any(|r| r.2 == from) {
                i += 1;
                continue;
            }
            o.queue.remove(i);
            o.running.push((cl, to, from));
            starts.push((cl, to, tries, c.map().servers()[from as usize].main, c.map().worker_addr(to.0, to.1)));
        }
        if o.running.is_empty() && o.queue.is_empty() {
            let empty = |id: u16| (0..c.map().cachelet_count()).all(|cl| c.map().owner(cl).0 != id);
            leaves = o.draining.iter().copied().filter(|&id| empty(id)).collect();
            o.draining.retain(|id| !leaves.contains(id));
        }
    }
    for (cl, to, tries, addr, to_addr) in starts {
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new().name(format!("mbal-coord-move-{cl}")).spawn(move || {
            let sh = sh2;
            let r = order(&sh, addr, cl, to, to_addr);
            let mut o = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner());
            o.running.retain(|m| m.0 != cl);
            let once = o.once.contains(&cl);
            // (not when a newer plan queued the cachelet meanwhile: that one goes instead)
            let newer = o.queue.iter().any(|q| q.0 == cl);
            if r.is_err() && tries + 1 < TRIES && !once && !newer {
                // Again later (behind the others).
                o.queue.push_back((cl, to, tries + 1));
            } else {
                // Its end: the bytes moved (`MIGRATED <c> <items> <bytes> <ms>`), or a failure.
                let bytes =
                    r.as_ref().ok().map(|a| a.split_whitespace().nth(3).and_then(|b| b.parse().ok()).unwrap_or(0));
                o.ended.push((cl, bytes));
                if o.ended.len() > 4096 {
                    o.ended.remove(0);
                }
                o.once.retain(|&c| c != cl);
            }
            match r {
                Ok(answer) => {
                    o.done += 1;
                    tracing::info!(cachelet = cl, to = ?to, "coordinator: ordered move done: {answer}");
                }
                Err(e) => {
                    o.failed += 1;
                    tracing::warn!(cachelet = cl, to = ?to, "coordinator: ordered move failed: {e}");
                }
            }
        });
        if spawned.is_err() {
            sh.orchestra.lock().unwrap_or_else(|e| e.into_inner()).running.retain(|m| m.0 != cl);
        }
    }
    for id in leaves {
        match sh.mutate(|c| c.leave(id)) {
            Ok(Ok(epoch)) => tracing::info!(server = id, epoch, "coordinator: drained server left"),
            Ok(Err(e)) => tracing::warn!(server = id, "coordinator: drained server could not leave: {e:?}"),
            Err(e) => tracing::warn!(server = id, "coordinator: drained server could not leave: {e}"),
        }
    }
}

/// `mbal migrate <cachelet> <server> <worker> <address>` at the source `addr`; its answer line.
fn order(sh: &Shared, addr: SocketAddr, cl: CacheletId, (s, w): Owner, to: SocketAddr) -> Result<String, String> {
    let dialer = mbal_member::dial::Dialer {
        tls: sh.client_tls.clone(),
        secret: sh.secret.clone(),
        user: None,
        timeout: MOVE_TIMEOUT,
    };
    let mut conn = dialer.dial(addr, mbal_member::dial::Proto::Text).map_err(|e| format!("{addr}: {e}"))?;
    conn.write_all(format!("mbal migrate {cl} {s} {w} {to}\r\n").as_bytes()).map_err(|e| e.to_string())?;
    conn.flush().map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(conn).read_line(&mut line).map_err(|e| e.to_string())?;
    let line = line.trim_end().to_string();
    if line.starts_with("MIGRATED ") {
        Ok(line)
    } else {
        Err(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_plan_retargets_a_queued_move_and_follows_up_a_running_one() {
        let mut o = Orchestra::default();
        assert_eq!(o.add(vec![(1, (4, 0)), (2, (4, 1)), (3, (4, 0))]), 3);
        o.running.push((3, (4, 0), 0));
        o.queue.retain(|q| q.0 != 3);
        // cachelet 1 to another server, 2 to the same place, 3 is running (a follow-up from
        // where it goes), 5 is new
        assert_eq!(o.add(vec![(1, (5, 0)), (2, (4, 1)), (3, (5, 1)), (5, (5, 0))]), 3);
        assert_eq!(o.pending(), vec![(3, (4, 0)), (1, (5, 0)), (2, (4, 1)), (3, (5, 1)), (5, (5, 0))]);
        // the running move's own destination again: nothing
        assert_eq!(o.add(vec![(3, (4, 0))]), 0);
        // Phase 3's moves neither retarget nor follow up
        o.add_once(vec![(1, (6, 0)), (3, (6, 0)), (7, (6, 0))]);
        assert_eq!(o.pending().last(), Some(&(7, (6, 0))));
        assert!(o.pending().contains(&(1, (5, 0))) && !o.pending().contains(&(3, (6, 0))));
    }
}
