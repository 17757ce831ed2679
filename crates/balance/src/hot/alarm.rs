//! Phase 1 between epochs: a worker past its load limit raises an alarm, and its hottest
//! keys get copies (or displace a key nobody reads) at once (SPORE §3.5).

use super::*;

/// What an alarm decided: keys to replicate now, and the copies to delete
/// now of the keys that made room for them under REPL_high.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AlarmDecision {
    pub replicate: Vec<Replicate>,
    pub retire: Vec<Retire>,
    /// Keys that wanted copies and found no slot under REPL_high.
    pub waiting: usize,
}

impl AlarmDecision {
    pub fn is_empty(&self) -> bool {
        self.replicate.is_empty() && self.retire.is_empty()
    }
}

impl HotKeys {
    /// The hotspot trigger between epochs: the load (requests/s) above
    /// which a worker should raise an alarm ([`HotKeys::on_alarm`]) at
    /// once rather than wait for the epoch's end, from the last epoch's
    /// cluster mean; `None` before the first epoch, under the balancer's
    /// minimum load, or with no other server to hold copies.
    pub fn alarm_limit(&self) -> Option<f64> {
        let (view, avg, _) = self.last?;
        (avg >= self.balance.min_load && view.max_copies() > 1).then(|| self.hot_limit(avg))
    }

    /// Hotspot triggering within an epoch (SPORE §3.5, without waiting
    /// for the epoch's end): `worker` has run above [`HotKeys::alarm_limit`]
    /// for the last `secs` seconds, and `samples` are the keys it sampled
    /// meanwhile (`true` for a write). Each COLD (or untracked) key of that
    /// worker seen at least `min_samples` times, read-mostly, and hot
    /// enough for a copy at the threshold T the epoch rule would choose now
    /// (the tracked keys at their last rates, these at their rates in the
    /// window) is replicated at once, hottest first, within REPL_high: a
    /// shifted hot set's hottest keys get copies within a fraction of an
    /// epoch instead of at the epoch's end, before the worker's backlog
    /// grows. HOT keys are left to the epoch (growth and cooling need a
    /// whole epoch's rates), but for displacement: `home` are the reads
    /// each of this worker's replicated keys got at home in the last
    /// `home_secs` (since the epoch began, exact); with `displace`, when
    /// REPL_high is full, a HOT key of this worker whose reads so far
    /// × (γ+1) are at most `cool_fraction` × T or under the noise floor (its
    /// readers left: a shifted hot set) gives its slot to a waiting key at
    /// least twice as hot (and than the noise floor), as at an epoch's end.
    /// The samples still count at the epoch's end.
    pub fn on_alarm(
        &mut self,
        worker: u16,
        samples: &[(Box<[u8]>, bool)],
        secs: f64,
        home: &[(Box<[u8]>, u64)],
        home_secs: f64,
    ) -> AlarmDecision {
        let none = AlarmDecision::default();
        let Some((view, avg, min_rate)) = self.last else { return none };
        let max_copies = view.max_copies();
        if secs <= 0.0 || max_copies <= 1 || avg < self.balance.min_load {
            return none;
        }
        let mut counts: BTreeMap<&[u8], (f64, f64)> = BTreeMap::new();
        for (k, write) in samples {
            let c = counts.entry(&k[..]).or_default();
            if *write {
                c.1 += 1.0;
            } else {
                c.0 += 1.0;
            }
        }
        let scale = 1.0 / (self.rate * secs);
        let (up, down) = (self.cfg.read_up, self.cfg.write_down);
        // Keys seen often enough in the window, at their window rates.
        let seen: BTreeMap<&[u8], (f64, f64)> = counts
            .into_iter()
            .filter(|(_, (r, w))| r + w >= self.cfg.min_samples)
            .map(|(k, (r, w))| (k, (r * scale, w * scale)))
            .collect();
        if seen.is_empty() {
            return none;
        }
        // T as the epoch computes it, with these keys' window rates.
        let mut rates: Vec<(f64, bool)> = self
            .keys
            .iter()
            .filter(|(k, e)| !seen.contains_key(&k[..]) && e.reads + e.writes >= min_rate)
            .map(|(_, e)| (e.reads + e.writes, up * e.reads - down * e.writes > 0.0))
            .collect();
        rates.extend(seen.values().map(|&(r, w)| (r + w, up * r - down * w > 0.0)));
        let spread = f64::from(view.servers.max(1));
        let (t, _) = choose_threshold(&rates, avg, view.n(), spread, max_copies, self.cfg.target_imbalance);
        // This worker's T, pressed down if it has stayed hot, as the epoch's.
        let tw = self.t_of(worker, t, avg);
        let pressed_share = self.pressed_share(worker, tw, avg, f64::INFINITY);

        let mut heat: Vec<(f64, Vec<u8>)> = seen
            .iter()
            .filter(|(k, &(r, w))| {
                let cold = self.keys.get(**k).is_none_or(|e| e.state == KeyState::Cold && !e.broken);
                cold && up * r - down * w > 0.0 && copies(r + w, tw, max_copies) > 1
            })
            .map(|(k, &(r, w))| (r + w, k.to_vec()))
            .collect();
        heat.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        let mut room = self.repl_high(&view).saturating_sub(self.counted());
        let mut log = Vec::new();
        let mut retire = Vec::new();
        if self.cfg.displace && heat.len() > room && home_secs > 0.0 {
            // Displacement within the epoch, judged by the home's exact
            // reads so far: only this worker's HOT keys are known here
            // (the keys already retiring, any worker's, go first).
            let quiet_below = self.last_cool_below.max(min_rate);
            let home: BTreeMap<&[u8], u64> = home.iter().map(|(k, n)| (&k[..], *n)).collect();
            let mut coolest: Vec<(f64, Vec<u8>)> = self
                .keys
                .iter()
                .filter(|(_, e)| e.state == KeyState::Hot && !e.pinned && e.worker == worker)
                .filter_map(|(k, e)| {
                    let r = *home.get(&k[..])? as f64 / home_secs * f64::from(e.replicas + 1);
                    (r <= quiet_below).then(|| (r, k.clone()))
                })
                .collect();
            coolest.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
            room += self.make_room(&heat, room, &coolest, min_rate, &mut log, &mut retire);
        }
        let mut out = Vec::new();
        let waiting = heat.len().saturating_sub(room);
        if waiting > self.waiting {
            self.waiting_heat = heat.iter().skip(room).cloned().collect();
        }
        self.waiting = self.waiting.max(waiting);
        for (f, k) in heat.into_iter().take(room) {
            let (reads, writes) = seen[&k[..]];
            self.track(&k, worker, reads, writes, &mut log);
            let want = copies(f, tw, max_copies) - 1;
            // Admitted: no longer waiting for a slot.
            self.waiting_heat.retain(|(_, w)| *w != k);
            let e = self.keys.get_mut(&k).expect("tracked");
            (e.worker, e.replicas, e.pressed_share) = (worker, want, pressed_share);
            (e.reads, e.writes) = (e.reads.max(reads), e.writes.max(writes));
            self.apply(&k, KeyEvent::Heated, &mut log);
            out.push(Replicate { key: k, worker, replicas: want, lease_epochs: self.cfg.lease_epochs });
        }
        AlarmDecision { replicate: out, retire, waiting }
    }
}
