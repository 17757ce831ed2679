//! The client side of Phase 1 (hot-key replicas, docs/protocol.md "Hot-key
//! hints"), with no I/O and no clock: one [`Leases`] cache used by the
//! routing client, the bench's routed driver and the proxy, next to their
//! [`Router`](crate::Router).
//!
//! * **A hint grants a lease.** [`Leases::record`] takes a hint
//!   `RH hot <key> <replicas> <lease-ms>` received from the key's home at
//!   time `now` (the caller's clock). If the key has no live lease, a new
//!   one starts: it runs for `lease-ms` from `now`, and the copy to read is
//!   picked once, uniformly from `0..=replicas` (0 is the home), by a hash of
//!   (this cache's seed, the key's hash, the lease's number), so two clients
//!   (two seeds) spread over the copies and one client sticks to one copy for
//!   the whole lease (monotonic reads). Copy `i` lives at
//!   [`replica_location`]`(hash, i, home, servers, workers)`.
//! * **A live lease is not changed by a hint with the same home and replica
//!   count** (neither extended nor re-drawn): a client that drew the home
//!   reads there and sees a hint on every read; extending its lease would
//!   keep it at home for as long as the key stays hot while the others come
//!   back to draw again, and the copies would carry less than their share.
//!   A hint with another replica count or home starts a new lease; one with
//!   `replicas` 0 or `lease-ms` 0 ends the lease.
//! * **[`Leases::read_target`]`(hash, now)`**: the copy a read goes to, or
//!   `None` to read at home (no lease, an expired lease, which is dropped,
//!   or a lease that drew the home).
//! * **What ends a lease early**: a write by this client ([`Leases::end`]:
//!   it reads its writes at home until the home grants a new lease), and an
//!   `RD`, an I/O error or a refused connection at the copy ([`Leases::end`]
//!   for the key, or [`Leases::copy_failed`] for every key read at that
//!   copy: its leases end, and until a given time leases that draw it read
//!   at home instead, so a dead server costs one failed connection per
//!   retry period, not one per key).
//! * **Bounded memory**: at most `cap` keys; granting a lease beyond that
//!   drops the oldest granted one. Keys are held by their 64-bit hash (two
//!   keys with the same hash would share a lease: the wrong one's read at a
//!   copy gets `RD` and falls back home).

use crate::replica::mix;
use crate::{replica_location, ClusterMap, Owner};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Default cap on the keys a [`Leases`] holds.
pub const DEFAULT_MAX_LEASES: usize = 65_536;
/// How long a copy whose connection failed is not read (see
/// [`Leases::copy_failed`]) by the client, the bench and the proxy.
pub const COPY_RETRY: Duration = Duration::from_secs(1);
/// Most copies remembered as failed at once.
const MAX_DOWN: usize = 1024;

/// One key's lease. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The worker that granted it (the key's home).
    pub home: Owner,
    /// γ: copies besides the home.
    pub replicas: u32,
    /// The copy read during the lease: 0 = the home, `i` = replica `i`.
    pub copy: u32,
    /// Where that copy lives.
    pub at: Owner,
    /// The lease ends at this instant (reads from then on go home).
    pub until: Instant,
    /// This cache's number of the lease (grants counted from 0).
    pub number: u64,
}

/// The lease cache of one client. See the module docs.
#[derive(Clone, Debug)]
pub struct Leases {
    seed: u64,
    cap: usize,
    granted: u64,
    live: HashMap<u64, Lease>,
    /// (key hash, lease number) in grant order; entries whose lease was
    /// replaced or ended are skipped when met (and compacted away).
    order: VecDeque<(u64, u64)>,
    /// Copies not to read until the instant given (their connection failed).
    down: Vec<(Owner, Instant)>,
}

impl Leases {
    /// An empty cache. `seed` should differ between clients (it spreads
    /// them over the copies); `cap` bounds the keys held (at least 1).
    pub fn new(seed: u64, cap: usize) -> Leases {
        Leases { seed, cap: cap.max(1), granted: 0, live: HashMap::new(), order: VecDeque::new(), down: Vec::new() }
    }

    /// Keys with a lease (live or expired but not yet dropped).
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Leases granted so far.
    pub fn granted(&self) -> u64 {
        self.granted
    }

    /// The lease held for a key hash, if any (live or expired).
    pub fn lease(&self, hash: u64) -> Option<&Lease> {
        self.live.get(&hash)
    }

    /// Record a hint for the key with hash `hash`, sent by its home `home`
    /// and read at `now`; `map` gives the cluster's shape. Returns the lease
    /// in force afterwards. A hint from a worker the map does not have is
    /// ignored; a replica count beyond what the cluster can place is cut to
    /// it.
    pub fn record(
        &mut self,
        map: &ClusterMap,
        hash: u64,
        home: Owner,
        replicas: u32,
        lease_ms: u64,
        now: Instant,
    ) -> Option<Lease> {
        if !map.has_worker(home) {
            return self.live.get(&hash).copied();
        }
        let servers = map.servers().len() as u16;
        let workers_of = |s: u16| map.servers()[usize::from(s)].workers.len() as u16;
        let most = crate::most_replicas(home.0, servers, workers_of);
        let replicas = replicas.min(most);
        if replicas == 0 || lease_ms == 0 {
            self.end(hash);
            return None;
        }
        if let Some(l) = self.live.get(&hash) {
            if now < l.until && l.home == home && l.replicas == replicas {
                return Some(*l);
            }
        }
        let number = self.granted;
        self.granted += 1;
        let copy = (mix(self.seed ^ mix(hash ^ mix(number))) % (u64::from(replicas) + 1)) as u32;
        let at = replica_location(hash, copy, home, servers, workers_of).unwrap_or(home);
        let until = now.checked_add(Duration::from_millis(lease_ms)).unwrap_or(now + Duration::from_secs(1 << 32));
        let lease = Lease { home, replicas, copy, at, until, number };
        self.live.insert(hash, lease);
        self.order.push_back((hash, number));
        while self.live.len() > self.cap {
            let Some((h, n)) = self.order.pop_front() else { break };
            if self.live.get(&h).is_some_and(|l| l.number == n) {
                self.live.remove(&h);
            }
        }
        if self.order.len() > 2 * self.cap + 16 {
            let live = &self.live;
            self.order.retain(|(h, n)| live.get(h).is_some_and(|l| l.number == *n));
        }
        Some(lease)
    }

    /// Where a read of the key with hash `hash` goes at `now`: `Some(copy)`
    /// while a live lease drew a copy other than the home, `None` to read at
    /// home. An expired lease is dropped. A lease whose copy failed (see
    /// [`Leases::copy_failed`]) reads at home until the copy may be tried
    /// again.
    pub fn read_target(&mut self, hash: u64, now: Instant) -> Option<Owner> {
        let l = self.live.get(&hash)?;
        if now >= l.until {
            self.live.remove(&hash);
            return None;
        }
        if l.copy == 0 || self.down.iter().any(|&(o, until)| o == l.at && now < until) {
            return None;
        }
        Some(l.at)
    }

    /// A connection to `copy` failed at `now`: every lease reading there
    /// ends, and leases drawn to it until `now + retry` read at home.
    /// Returns how many leases ended.
    pub fn copy_failed(&mut self, copy: Owner, now: Instant, retry: Duration) -> usize {
        self.down.retain(|&(o, until)| o != copy && now < until);
        if self.down.len() < MAX_DOWN {
            self.down.push((copy, now + retry));
        }
        self.end_at(copy)
    }

    /// End the key's lease (a write by this client, or a failed read at its
    /// copy). Returns whether there was one.
    pub fn end(&mut self, hash: u64) -> bool {
        // every write of a connection lands here, nearly always with no lease:
        // skip hashing the key then
        !self.live.is_empty() && self.live.remove(&hash).is_some()
    }

    /// End every lease that reads at `copy` (its connection failed).
    /// Returns how many ended.
    pub fn end_at(&mut self, copy: Owner) -> usize {
        let before = self.live.len();
        self.live.retain(|_, l| l.copy == 0 || l.at != copy);
        before - self.live.len()
    }
}

#[cfg(test)]
mod tests;
