//! T pressed down on a worker that stays hot: each worker's multiplier
//! of the server's T, and what a key replicated under it remembers
//! (docs/design-notes.md "T pressed down on a worker that stays hot").

use super::*;

/// A hot worker's T falls by this factor each epoch it stays hot, and
/// rises back by it each epoch it is under the mean load.
pub const PRESS_STEP: f64 = 0.7;
/// Its T is never below this fraction of the server's...
pub const PRESS_FLOOR: f64 = 0.05;
/// ...nor, once lowered, below this fraction of the mean load per worker:
/// a key carrying less is not worth a copy (a worker hot with many such
/// keys is a hot partition, Phase 2's to move).
pub const PRESS_MIN_SHARE: f64 = 0.01;

impl HotKeys {
    /// Feedback on the measured load, worker by worker. T comes from an
    /// estimate that takes the keys below it as spread evenly; they are
    /// not (each key lives on one worker), so a worker can stay above the
    /// target with every key over T replicated. Each epoch a worker is hot
    /// (past `limit`) its T is multiplied by [`PRESS_STEP`] (down to
    /// [`PRESS_FLOOR`]): its replicated keys grow more copies (its own
    /// share of their reads falls) and more of its keys qualify. Each
    /// epoch it is at or under the mean `avg` the multiplier rises back by as
    /// much, up to 1 (one at or under the mean needs no help; between the
    /// mean and the limit the multiplier holds, so a worker just under
    /// the limit is not pushed back over it by its keys cooling).
    pub(super) fn press(&mut self, snap: &EpochSnapshot, loads: &[f64], avg: f64, limit: f64) {
        let busy = avg >= self.balance.min_load;
        for (w, &l) in snap.workers.iter().zip(loads) {
            let m = self.press.entry(w.worker).or_insert(1.0);
            if busy && l > limit {
                *m = (*m * PRESS_STEP).max(PRESS_FLOOR);
            } else if l <= avg || !busy {
                *m = (*m / PRESS_STEP).min(1.0);
            }
        }
    }

    /// `worker`'s multiplier of T ([`HotKeys::press`]; 1 for a worker of
    /// another server or never hot).
    pub fn press_of(&self, worker: u16) -> f64 {
        self.press.get(&worker).copied().unwrap_or(1.0)
    }

    /// T for `worker`'s keys: the server's `t` times its multiplier, but
    /// never below [`PRESS_MIN_SHARE`] of the mean load `avg` once lowered.
    pub(super) fn t_of(&self, worker: u16, t: f64, avg: f64) -> f64 {
        let m = self.press_of(worker);
        if m >= 1.0 || !t.is_finite() {
            t
        } else {
            (t * m).max(PRESS_MIN_SHARE * avg).min(t)
        }
    }

    /// What a key of `worker` replicated (or grown) now at `tw` records as
    /// its `pressed_share` (`was` until now) when the mean load is `avg`:
    /// `tw` ÷ `avg` when the worker's T is pressed down, else what it had.
    pub(super) fn pressed_share(&self, worker: u16, tw: f64, avg: f64, was: f64) -> f64 {
        if self.press_of(worker) < 1.0 && avg > 0.0 {
            was.min(tw / avg)
        } else {
            was
        }
    }
}
