//! Phase 1 on a worker: making a hot key's copies when the controller asks,
//! copying every write of it to them, the leases its reads are told about,
//! and deleting the copies when the key cools (`replica` has the tables,
//! `replicate` the thread that talks to the shadows).

use super::*;
use crate::msg::replica::{Done, Job, Loc, Op};
use crate::msg::HotCmd;
use crate::replica::HotTable;

impl Worker {
    /// Requests served so far (wrapping), as the policy weighs a worker's
    /// load: the store's reads and writes plus the reads of copies.
    fn served(&mut self) -> u64 {
        self.shard.store.watch().accesses().wrapping_add(self.shard.counters.replica_reads)
    }

    /// A new alarm window (each epoch's samples are taken: their count
    /// starts again).
    pub(super) fn restart_alarm(&mut self) {
        let (now, served) = (self.shared.clock_ns(), self.served());
        let samples = self.shard.store.watch().sample_count();
        self.shard.replicas.alarm.restart(now, served, samples);
    }

    /// Phase 1's trigger within an epoch: a window clearly above the hot
    /// limit sends the controller the keys sampled in it.
    pub(super) fn check_alarm(&mut self) {
        if self.shard.replicas.alarm.limit.is_none() {
            return;
        }
        let (now, served) = (self.shared.clock_ns(), self.served());
        let samples = self.shard.store.watch().sample_count();
        if let Some((from, secs)) = self.shard.replicas.alarm.check(now, served, samples) {
            let keys = self.shard.store.watch().samples_since(from);
            let home = self.shard.replicas.hot.home_reads_so_far();
            let home_secs = now.saturating_sub(self.shard.replicas.sampled_ns) as f64 * 1e-9;
            self.shared.tell_controller(CtlMsg::HotAlarm { worker: self.id as u16, keys, secs, home, home_secs });
        }
    }

    pub(super) fn hot(&mut self, cmd: HotCmd) {
        match cmd {
            HotCmd::Replicate { key, replicas } => self.replicate_key(key, replicas),
            HotCmd::Grants(list) => {
                for (key, grant) in list {
                    let hash = mbal_cluster::key_hash(&key);
                    if let Some(e) = self.shard.replicas.hot.get_mut(hash).filter(|e| e.key == key) {
                        e.grant = grant;
                    }
                }
            }
            HotCmd::Retire { key } => {
                let hash = mbal_cluster::key_hash(&key);
                if self.shard.replicas.hot.get_mut(hash).is_some_and(|e| e.key == key) {
                    self.drop_hot(hash);
                }
            }
            HotCmd::AlarmLimit(limit) => self.shard.replicas.alarm.limit = limit,
            HotCmd::SampleRate(rate) => self.shard.store.watch().set_rate(rate),
            HotCmd::Written { hash, ok } => {
                let Some(e) = self.shard.replicas.hot.get_mut(hash) else { return };
                e.pending = e.pending.saturating_sub(1);
                if !ok {
                    // Some copy may hold an older value: no more leases; the
                    // policy retires the key once the leases it gave end.
                    e.grant = None;
                    let key = e.key.clone();
                    self.shared.tell_controller(CtlMsg::HotFailed { key });
                }
            }
        }
    }

    /// Make copies 1..=`replicas` of a key homed here with its current value.
    fn replicate_key(&mut self, key: Box<[u8]>, replicas: u32) {
        let at = locate(&self.shared.layout, &key);
        let Some(jobs) = self.shared.replicator.as_ref() else { return };
        let op = self
            .shard
            .store
            .owns(at.cachelet)
            .then(|| copy_of(&mut self.shard.store, &self.shared, at, &key, self.now))
            .flatten();
        let Some(op) = op else {
            // Not here any more (moved, or the item is gone): nothing to copy.
            self.shared.tell_controller(CtlMsg::HotFailed { key });
            return;
        };
        self.shard.replicas.hot.replicate(at.hash, &key, at.cachelet, replicas);
        self.shard.store.watch().watch(at.hash);
        let to = copies(&self.shared, at.hash, self.id, replicas);
        let done = Done::Controller { created: true, at_ns: self.shared.clock_ns() };
        let _ = jobs.send(Job { key, to, op, done });
        self.shard.counters.hot_replications += 1;
    }

    /// Stop replicating a key: delete its copies.
    pub(super) fn drop_hot(&mut self, hash: u64) {
        drop_hot(&self.shared, self.id, &mut self.shard.store, &mut self.shard.replicas.hot, hash);
    }

    /// A cachelet leaves this worker: its hot keys stop being replicated
    /// from here (their copies are placed relative to this home).
    pub(super) fn drop_hot_of(&mut self, cachelet: u32) {
        if self.shard.replicas.hot.is_empty() {
            return;
        }
        for hash in self.shard.replicas.hot.of_cachelet(cachelet) {
            if let Some(e) = self.shard.replicas.hot.get_mut(hash) {
                let key = e.key.clone();
                self.shared.tell_controller(CtlMsg::HotFailed { key });
            }
            self.drop_hot(hash);
        }
    }
}

/// Stop replicating a key homed on worker `me`: delete its copies.
fn drop_hot(shared: &Shared, me: usize, store: &mut WorkerStore, hot: &mut HotTable, hash: u64) {
    let Some(e) = hot.remove(hash) else { return };
    store.watch().unwatch(hash);
    if let Some(jobs) = &shared.replicator {
        let to = copies(shared, hash, me, e.replicas);
        let _ = jobs.send(Job { key: e.key, to, op: Op::Del, done: Done::Nobody });
    }
}

/// `flush_all`: every copy of worker `me`'s hot keys goes too, and the
/// policy forgets them (they are gone at home as well).
pub(crate) fn flush_hot(shared: &Shared, me: usize, store: &mut WorkerStore, hot: &mut HotTable) {
    for hash in hot.hashes() {
        if let Some(e) = hot.get_mut(hash) {
            let key = e.key.clone();
            shared.tell_controller(CtlMsg::HotFailed { key });
        }
        drop_hot(shared, me, store, hot, hash);
    }
}

/// Copy the writes of watched keys made since the last call to their
/// replicas. `hold`: in sync mode, the reply of the request that made the
/// (single) write, sent by the replicator once every copy has it.
pub(crate) fn copy_writes(
    shared: &Shared,
    me: usize,
    store: &mut WorkerStore,
    hot: &mut HotTable,
    now: u32,
    mut hold: Option<(ReplyTo, u32, Vec<u8>)>,
) {
    let Some(jobs) = shared.replicator.as_ref() else {
        store.watch().take_dirty();
        return;
    };
    let dirty = store.watch().take_dirty();
    let last = dirty.len().saturating_sub(1);
    for (i, (hash, key)) in dirty.into_iter().enumerate() {
        let Some(e) = hot.get_mut(hash).filter(|e| *e.key == *key) else { continue };
        let at = crate::exec::Loc { hash, cachelet: e.cachelet };
        let op = copy_of(store, shared, at, &key, now).unwrap_or(Op::Del);
        e.pending += 1;
        let to = copies(shared, hash, me, e.replicas);
        let reply = if i == last { hold.take() } else { None };
        let _ = jobs.send(Job { key, to, op, done: Done::Worker { worker: me, hash, reply } });
    }
    if let Some((to, cachelet, bytes)) = hold {
        // The write touched no watched key after all (a hash collision):
        // nothing to wait for.
        let mut batch = crate::msg::ReplyBatch::default();
        batch.push(to, cachelet, |d| d.extend_from_slice(&bytes));
        shared.peers().send_one(to.worker, Envelope::Replies(batch), shared.clock_ns());
    }
}

/// The current value of a key homed here as a copy job, if it exists.
fn copy_of(store: &mut WorkerStore, shared: &Shared, at: crate::exec::Loc, key: &[u8], now: u32) -> Option<Op> {
    let it = store.peek(at.cachelet, at.hash, key, now)?;
    // The copy expires with the item: its remaining seconds (0: never).
    let exptime = if it.exptime == 0 { 0 } else { it.exptime.saturating_sub(now).max(1) };
    Some(Op::Put { flags: it.flags, exptime, value: it.value.to_vec(), ttl_ms: shared.settings.hot.copy_ttl_ms() })
}

/// Where copies 1..=`replicas` of a key homed on worker `me` live: on the newest map's
/// servers with their sizes, as clients place them (a server that joined counts, and one of
/// another size has its own worker count).
pub(super) fn copies(shared: &Shared, hash: u64, me: usize, replicas: u32) -> Vec<Loc> {
    let members = shared.members.read().unwrap_or_else(|p| p.into_inner());
    let servers = members.len() as u16;
    let workers_of = |s: u16| members.get(usize::from(s)).map_or(0, |m| m.1);
    (1..=replicas)
        .filter_map(|i| mbal_cluster::replica_location(hash, i, (shared.server_id, me as u16), servers, workers_of))
        .collect()
}
