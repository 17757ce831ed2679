//! Phase 1 in the sim: the keys drawn one by one (the head of the key law),
//! the copies the servers' cores ask for, the leases the clients read them
//! under, and the keys a home worker samples.
//!
//! The policy sees keys only through the samples a home worker takes of the
//! requests it serves (`KeyWatch` in the store), the exact reads a home
//! counts of its replicated keys, and the copies' reads a renewal brings
//! back. So the sim draws requests per key only for the keys whose share of
//! the requests could matter to a worker (the head: a mass of at least
//! `--head-share` of one worker's share of the requests, at most
//! `--head-keys` keys); every other key's requests stay aggregated in its
//! cachelet's tail, and the tail's samples name keys drawn uniformly from
//! the cachelet's other keys (a tail key's own rate is under the head's
//! floor, so which tail key a sample names only feeds the tracker's noise).

use crate::{ns, Asker, Pending};
use mbal_balance::control::SampledKey;
use mbal_balance::{Event, HotCommand};
use mbal_bench::workload::write_key;
use rand::rngs::SmallRng;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

/// The keys drawn one by one for a hot set, hottest first.
#[derive(Clone, Debug, Default)]
pub struct Head {
    pub key: Vec<u32>,
    pub mass: Vec<f64>,
    pub cachelet: Vec<u32>,
    /// Key index -> position in the head.
    pub pos: HashMap<u32, u32>,
}

impl Head {
    /// The keys of mass at least `min_mass`, hottest first (ties by key), at most `max_keys`.
    pub fn of(mass: &[f64], cachelet_of: &[u32], min_mass: f64, max_keys: usize) -> Head {
        let mut keys: Vec<u32> = (0..mass.len() as u32).filter(|&k| mass[k as usize] >= min_mass).collect();
        keys.sort_by(|&a, &b| mass[b as usize].total_cmp(&mass[a as usize]).then(a.cmp(&b)));
        keys.truncate(max_keys);
        let pos = keys.iter().enumerate().map(|(i, &k)| (k, i as u32)).collect();
        Head {
            mass: keys.iter().map(|&k| mass[k as usize]).collect(),
            cachelet: keys.iter().map(|&k| cachelet_of[k as usize]).collect(),
            key: keys,
            pos,
        }
    }

    pub fn len(&self) -> usize {
        self.key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.key.is_empty()
    }

    /// Each cachelet's mass less its head keys'.
    pub fn tail_masses(&self, cachelet_mass: &[f64]) -> Vec<f64> {
        let mut t = cachelet_mass.to_vec();
        for (i, &c) in self.cachelet.iter().enumerate() {
            t[c as usize] -= self.mass[i];
        }
        t.iter_mut().for_each(|m| *m = m.max(0.0));
        t
    }
}

/// Every cachelet's keys, for naming the tail's samples (compressed rows).
#[derive(Clone, Debug, Default)]
pub struct KeysOf {
    start: Vec<u32>,
    keys: Vec<u32>,
}

impl KeysOf {
    pub fn new(cachelet_of: &[u32], cachelets: u32) -> KeysOf {
        let mut start = vec![0u32; cachelets as usize + 1];
        for &c in cachelet_of {
            start[c as usize + 1] += 1;
        }
        for i in 1..start.len() {
            start[i] += start[i - 1];
        }
        let mut fill = start.clone();
        let mut keys = vec![0u32; cachelet_of.len()];
        for (k, &c) in cachelet_of.iter().enumerate() {
            keys[fill[c as usize] as usize] = k as u32;
            fill[c as usize] += 1;
        }
        KeysOf { start, keys }
    }

    pub fn of(&self, c: u32) -> &[u32] {
        &self.keys[self.start[c as usize] as usize..self.start[c as usize + 1] as usize]
    }
}

/// A key's name, as the bench writes it (`k` + the index, zero-padded to `size`).
pub fn name(key: u32, size: usize) -> Box<[u8]> {
    let mut b = Vec::with_capacity(size);
    write_key(&mut b, key, size);
    b.into()
}

/// The index a key's name stands for.
pub fn parse(name: &[u8]) -> Option<u32> {
    let digits = name.strip_prefix(b"k")?;
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// A key the servers replicate: where its home put copies and what reads
/// of it are told.
#[derive(Clone, Debug, PartialEq)]
pub struct Repl {
    pub cachelet: u32,
    /// Copies 1..=replicas, where `replica_location` puts them.
    pub copies: Vec<(u16, u16)>,
    /// The lease reads are told: γ copies besides the home, until then (ns).
    pub grant: Option<(u32, u64)>,
    /// Reads the copies served since the last renewal, and the home since its last sample.
    pub copy_reads: f64,
    pub home_reads: f64,
}

/// The keys with copies, by home (server, worker, key), and by cachelet.
#[derive(Clone, Debug, Default)]
pub struct Replicas {
    pub by_home: BTreeMap<(u16, u16, u32), Repl>,
    by_cachelet: BTreeMap<u32, BTreeSet<(u16, u16, u32)>>,
}

impl Replicas {
    pub fn len(&self) -> usize {
        self.by_home.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_home.is_empty()
    }

    /// Make (or widen) the copies of `key` homed at `home`.
    pub fn replicate(&mut self, home: (u16, u16), key: u32, cachelet: u32, copies: Vec<(u16, u16)>) {
        let id = (home.0, home.1, key);
        let e = self.by_home.entry(id).or_insert(Repl {
            cachelet,
            copies: Vec::new(),
            grant: None,
            copy_reads: 0.0,
            home_reads: 0.0,
        });
        if copies.len() >= e.copies.len() {
            e.copies = copies;
        }
        self.by_cachelet.entry(cachelet).or_default().insert(id);
    }

    pub fn get_mut(&mut self, home: (u16, u16), key: u32) -> Option<&mut Repl> {
        self.by_home.get_mut(&(home.0, home.1, key))
    }

    pub fn remove(&mut self, home: (u16, u16), key: u32) -> Option<Repl> {
        let id = (home.0, home.1, key);
        let r = self.by_home.remove(&id)?;
        if let Some(set) = self.by_cachelet.get_mut(&r.cachelet) {
            set.remove(&id);
            if set.is_empty() {
                self.by_cachelet.remove(&r.cachelet);
            }
        }
        Some(r)
    }

    /// A cachelet left its worker: every key of it stops being replicated from there
    /// (`(server, key)` of each, for the home's core to be told).
    pub fn drop_cachelet(&mut self, c: u32) -> Vec<(u16, u32)> {
        let Some(ids) = self.by_cachelet.remove(&c) else { return Vec::new() };
        ids.into_iter()
            .map(|id| {
                self.by_home.remove(&id);
                (id.0, id.2)
            })
            .collect()
    }

    /// The keys homed at worker `w` of server `s`: their home reads since the last sample
    /// (taken), each made a whole count by `whole`.
    pub fn take_home_reads(
        &mut self,
        s: u16,
        w: u16,
        size: usize,
        mut whole: impl FnMut(f64) -> u64,
    ) -> Vec<(Box<[u8]>, u64)> {
        let mut out = Vec::new();
        for (&(_, _, k), r) in self.by_home.range_mut((s, w, 0)..=(s, w, u32::MAX)) {
            let n = whole(std::mem::take(&mut r.home_reads));
            out.push((name(k, size), n));
        }
        out
    }

    /// Copies that exist, summed over keys.
    pub fn copies(&self) -> usize {
        self.by_home.values().map(|r| r.copies.len()).sum()
    }
}

/// A worker's samples since its last epoch sample.
pub type Samples = Vec<SampledKey>;

/// Phase 1's mechanisms in the simulation: what the cores' Phase 1 commands do.
impl crate::Sim<'_> {
    /// Phase 1's command to home worker `worker` of server `s`.
    pub(crate) fn hot_command(&mut self, s: u16, worker: u16, cmd: HotCommand, t: u64) {
        let home = (s, worker);
        match cmd {
            HotCommand::Replicate { key, replicas } => {
                let at = parse(&key).and_then(|k| self.load.cachelet_of.get(k as usize).map(|&c| (k, c)));
                // The worker copies a key it holds (as `replicate_key`), or says it cannot.
                let Some((k, c)) = at.filter(|&(_, c)| self.owner[c as usize] == home) else {
                    self.hot_events.push_back((s, Event::HotFailed { key }));
                    return;
                };
                let hash = mbal_cluster::key_hash(&key);
                let workers = self.a.workers;
                let copies = (1..=replicas)
                    .filter_map(|i| mbal_cluster::replica_location(hash, i, home, self.a.servers, |_| workers))
                    .collect();
                self.repl.replicate(home, k, c, copies);
                self.replicated += 1;
                self.next_seq += 1;
                self.pending.push(Reverse(Pending {
                    at_ns: t + ns(self.a.copy_ms),
                    seq: self.next_seq,
                    server: s,
                    token: t,
                    cachelet: c,
                    to: worker,
                    to_server: s,
                    bytes: 0,
                    copies: true,
                    key: k,
                }));
            }
            HotCommand::Grants(list) => {
                for (key, g) in list {
                    if let Some(e) = parse(&key).and_then(|k| self.repl.get_mut(home, k)) {
                        e.grant = g;
                    }
                }
            }
            HotCommand::Retire { key } => {
                if parse(&key).and_then(|k| self.repl.remove(home, k)).is_some() {
                    self.retired += 1;
                }
            }
            HotCommand::SampleRate(r) => {
                let g = self.gw(home);
                self.sample_rate[g] = r;
            }
            // Alarms between epochs are not simulated.
            HotCommand::AlarmLimit(_) => {}
        }
    }

    /// A key's copies are made (the job that started at `p.token`): its core is told, unless
    /// the key left replication meanwhile.
    pub(crate) fn copies_made(&mut self, p: Pending, t: u64) {
        if self.repl.get_mut((p.server, p.to), p.key).is_none() {
            return;
        }
        let key = name(p.key, self.load.key_size);
        self.step(p.server, t, Event::HotDone { key, created: true, ok: true, at_ns: p.token, copy_reads: 0 }, &[]);
    }

    /// A cachelet left its worker: its keys stop being replicated (their homes' cores are
    /// told, as the server's worker tells its controller).
    pub(crate) fn drop_hot_of(&mut self, c: u32) -> VecDeque<(u16, Event<Asker>)> {
        let dropped = self.repl.drop_cachelet(c);
        self.retired += dropped.len() as u64;
        dropped.into_iter().map(|(s, k)| (s, Event::HotFailed { key: name(k, self.load.key_size) })).collect()
    }

    /// Every server's record of this epoch, as `PeerLoad` events to at most
    /// `--peer-reports` others each (chosen at random), every other when 0.
    pub(crate) fn peer_reports(&mut self, rng: &mut SmallRng) -> VecDeque<(u16, Event<Asker>)> {
        let servers = usize::from(self.a.servers);
        let k = self.a.peer_reports;
        let mut events = VecDeque::new();
        for (s, mean, hot) in std::mem::take(&mut self.records) {
            let others: Vec<usize> = if k == 0 || k >= servers - 1 {
                (0..servers - 1).collect()
            } else {
                rand::seq::index::sample(rng, servers - 1, k).into_vec()
            };
            for i in others {
                let r = if i >= usize::from(s) { i + 1 } else { i } as u16;
                events.push_back((r, Event::PeerLoad { server: s, mean, hot: hot.clone() }));
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        assert_eq!(parse(&name(42, 10)), Some(42));
        assert_eq!(&*name(42, 10), b"k000000042");
        assert_eq!(parse(b"x12"), None);
    }

    #[test]
    fn the_head_is_the_hottest_keys_and_the_tail_the_rest() {
        let mass = [0.5, 0.1, 0.3, 0.05, 0.05];
        let cof = [0, 1, 0, 1, 1];
        let h = Head::of(&mass, &cof, 0.08, 10);
        assert_eq!(h.key, [0, 2, 1]);
        let t = h.tail_masses(&[0.8, 0.2]);
        assert!(t[0].abs() < 1e-12 && (t[1] - 0.1).abs() < 1e-12, "{t:?}");
        assert_eq!(Head::of(&mass, &cof, 0.0, 2).key, [0, 2]);
        let k = KeysOf::new(&cof, 2);
        assert_eq!((k.of(0), k.of(1)), (&[0, 2][..], &[1, 3, 4][..]));
    }

    #[test]
    fn a_moved_cachelet_takes_its_keys_out_of_replication() {
        let mut r = Replicas::default();
        r.replicate((0, 1), 7, 3, vec![(1, 0)]);
        r.replicate((0, 1), 8, 4, vec![(1, 0), (2, 1)]);
        assert_eq!(r.copies(), 3);
        assert_eq!(r.drop_cachelet(3), vec![(0, 7)]);
        assert_eq!(r.len(), 1);
        r.get_mut((0, 1), 8).unwrap().home_reads = 5.0;
        let round = |x: f64| x.round() as u64;
        assert_eq!(r.take_home_reads(0, 1, 10, round), vec![(name(8, 10), 5)]);
        assert_eq!(r.take_home_reads(0, 1, 10, round), vec![(name(8, 10), 0)]);
        assert!(r.remove((0, 1), 8).is_some() && r.is_empty());
    }
}
