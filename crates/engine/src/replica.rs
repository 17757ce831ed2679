//! Phase 1's state on a worker (DESIGN.md §6; SPORE §3, MBal §3.2): two
//! small tables, owned by the worker, touched only by it.
//!
//! * [`HotTable`]: the keys homed here that have replicas on other servers.
//!   For each: how many copies exist (writes are copied to all of them), the
//!   lease the controller lets this worker grant (γ and until when the
//!   copies are known to live), and the writes still being copied. A read of
//!   the key on a routed connection gets an `RH hot` hint
//!   (docs/protocol.md): γ and a lease while every copy holds the newest
//!   value, `0 0` while a write is being copied or no lease may be granted.
//! * [`ShadowTable`]: copies of other servers' hot keys, with a time to live
//!   that the home renews. It is separate from the store: it never evicts a
//!   primary item and is never itself replicated; past its memory cap it
//!   refuses new copies (the home then counts the replication as failed).

use std::collections::HashMap;

/// A hot key homed on this worker.
#[derive(Debug)]
pub struct HotEntry {
    pub key: Box<[u8]>,
    pub cachelet: u32,
    /// Copies 1..=`replicas` exist (or are being made): writes go to all.
    pub replicas: u32,
    /// What reads may be told: γ and the time (server clock, ns) until
    /// which the copies are known to live. `None`: home only.
    pub grant: Option<(u32, u64)>,
    /// Writes being copied to the replicas (no lease meanwhile).
    pub pending: u32,
    /// Routed reads of it served here (each asks for its hint) since the
    /// last epoch sample: counted exactly, not sampled, so that the policy
    /// sees within the epoch when a HOT key's readers left
    /// ([`HotTable::take_home_reads`]).
    pub home_reads: u64,
}

/// The hint a read of a key gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hint {
    pub replicas: u32,
    pub lease_ms: u64,
}

#[derive(Debug, Default)]
pub struct HotTable {
    by_hash: HashMap<u64, HotEntry>,
    /// The longest lease a client gets (`lease_epochs` × the epoch).
    pub lease_cap_ms: u64,
}

impl HotTable {
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    pub fn get_mut(&mut self, hash: u64) -> Option<&mut HotEntry> {
        self.by_hash.get_mut(&hash)
    }

    /// Start (or widen) replication of a key: returns whether it is new.
    pub fn replicate(&mut self, hash: u64, key: &[u8], cachelet: u32, replicas: u32) -> bool {
        match self.by_hash.get_mut(&hash) {
            Some(e) if *e.key == *key => {
                e.replicas = e.replicas.max(replicas);
                false
            }
            _ => {
                let e = HotEntry { key: key.into(), cachelet, replicas, grant: None, pending: 0, home_reads: 0 };
                self.by_hash.insert(hash, e);
                true
            }
        }
    }

    pub fn remove(&mut self, hash: u64) -> Option<HotEntry> {
        self.by_hash.remove(&hash)
    }

    /// Entries of one cachelet (it is leaving this worker).
    pub fn of_cachelet(&self, c: u32) -> Vec<u64> {
        self.by_hash.iter().filter(|(_, e)| e.cachelet == c).map(|(h, _)| *h).collect()
    }

    pub fn hashes(&self) -> Vec<u64> {
        self.by_hash.keys().copied().collect()
    }

    /// Each replicated key's reads served here since the last
    /// [`HotTable::take_home_reads`], counting on (for an alarm).
    pub fn home_reads_so_far(&self) -> Vec<(Box<[u8]>, u64)> {
        self.by_hash.values().map(|e| (e.key.clone(), e.home_reads)).collect()
    }

    /// Each replicated key's reads served here since the last call (its
    /// epoch's), and the count starts again.
    pub fn take_home_reads(&mut self) -> Vec<(Box<[u8]>, u64)> {
        self.by_hash.values_mut().map(|e| (e.key.clone(), std::mem::take(&mut e.home_reads))).collect()
    }

    /// The hint for a read of `key` at `now_ns`, if it is replicated (the
    /// read is counted in its `home_reads`).
    #[inline]
    pub fn hint(&mut self, hash: u64, key: &[u8], now_ns: u64) -> Option<Hint> {
        let e = self.by_hash.get_mut(&hash).filter(|e| *e.key == *key)?;
        e.home_reads += 1;
        let none = Hint { replicas: 0, lease_ms: 0 };
        let Some((g, until)) = e.grant else { return Some(none) };
        if e.pending > 0 || g == 0 || until <= now_ns {
            return Some(none);
        }
        let lease_ms = ((until - now_ns) / 1_000_000).min(self.lease_cap_ms);
        Some(if lease_ms == 0 { none } else { Hint { replicas: g, lease_ms } })
    }
}

/// A copy of another server's hot key.
#[derive(Debug)]
pub struct Copy {
    pub flags: u32,
    pub value: Box<[u8]>,
    /// Dropped at this time (server clock, ns) unless renewed.
    pub until_ns: u64,
    /// The item's own expiry (server clock, ns), if it has one.
    pub expires_ns: Option<u64>,
    /// Reads served since it was made or last renewed (reported to the home with the
    /// renewal, `mbal rttl`).
    pub reads: u64,
}

/// Counters of the shadow table (`stats`).
#[derive(Clone, Copy, Debug, Default)]
pub struct ShadowStats {
    pub items: u64,
    pub bytes: u64,
    pub reads: u64,
    pub stored: u64,
    pub refused: u64,
    pub expired: u64,
}

#[derive(Debug, Default)]
pub struct ShadowTable {
    copies: HashMap<Box<[u8]>, Copy>,
    bytes: usize,
    /// Most bytes (keys and values) it holds.
    pub cap: usize,
    pub st: ShadowStats,
}

fn cost(key: &[u8], value: &[u8]) -> usize {
    key.len() + value.len() + 64
}

impl ShadowTable {
    pub fn with_cap(cap: usize) -> ShadowTable {
        ShadowTable { cap, ..ShadowTable::default() }
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.copies.is_empty()
    }

    /// Store or replace a copy; false (and nothing kept) past the cap.
    pub fn put(
        &mut self,
        key: &[u8],
        flags: u32,
        value: &[u8],
        ttl_ms: u64,
        expires_ns: Option<u64>,
        now_ns: u64,
    ) -> bool {
        self.del(key);
        let c = cost(key, value);
        if self.bytes + c > self.cap {
            self.st.refused += 1;
            return false;
        }
        self.bytes += c;
        let until_ns = now_ns + ttl_ms * 1_000_000;
        self.copies.insert(key.into(), Copy { flags, value: value.into(), until_ns, expires_ns, reads: 0 });
        self.st.stored += 1;
        true
    }

    pub fn del(&mut self, key: &[u8]) -> bool {
        match self.copies.remove(key) {
            Some(c) => {
                self.bytes -= cost(key, &c.value);
                true
            }
            None => false,
        }
    }

    /// Extend a copy's life; false if there is none.
    /// Extend a live copy's life; returns the reads it served since it was made or last
    /// renewed (and starts counting again), `None` if there is no live copy.
    pub fn renew(&mut self, key: &[u8], ttl_ms: u64, now_ns: u64) -> Option<u64> {
        match self.copies.get_mut(key) {
            Some(c) if c.until_ns > now_ns => {
                c.until_ns = now_ns + ttl_ms * 1_000_000;
                Some(std::mem::take(&mut c.reads))
            }
            _ => None,
        }
    }

    /// A live copy (dropping it if its time is up).
    pub fn get(&mut self, key: &[u8], now_ns: u64) -> Option<&Copy> {
        let live = self.copies.get(key).map(|c| c.until_ns > now_ns && c.expires_ns.is_none_or(|e| e > now_ns))?;
        if !live {
            self.del(key);
            self.st.expired += 1;
            return None;
        }
        self.st.reads += 1;
        let c = self.copies.get_mut(key)?;
        c.reads += 1;
        Some(c)
    }

    /// Drop every copy whose time is up.
    pub fn sweep(&mut self, now_ns: u64) {
        let dead: Vec<Box<[u8]>> = self
            .copies
            .iter()
            .filter(|(_, c)| c.until_ns <= now_ns || c.expires_ns.is_some_and(|e| e <= now_ns))
            .map(|(k, _)| k.clone())
            .collect();
        for k in dead {
            self.del(&k);
            self.st.expired += 1;
        }
    }

    pub fn stats(&self) -> ShadowStats {
        ShadowStats { items: self.copies.len() as u64, bytes: self.bytes as u64, ..self.st }
    }
}

/// A worker's Phase 1 state.
#[derive(Debug, Default)]
pub struct Replicas {
    pub hot: HotTable,
    pub shadow: ShadowTable,
    pub alarm: Alarm,
    /// When the home reads were last taken (the epoch sample; server
    /// clock, ns).
    pub sampled_ns: u64,
}

/// How long a worker measures its load before it may raise an alarm.
pub const ALARM_WINDOW_NS: u64 = 250_000_000;
/// How far above the limit a window must be to raise an alarm, in standard
/// deviations of a Poisson count at the limit.
pub const ALARM_SIGMAS: f64 = 3.0;

/// A worker's hotspot alarm (Phase 1's trigger within an epoch): over
/// windows of at least [`ALARM_WINDOW_NS`], the requests it served against
/// the limit the controller sets each epoch (`HotCmd::AlarmLimit`, the load
/// above which a worker is hot). A window clearly above it (by more than
/// three standard deviations of a Poisson count at the limit, so that
/// noise at a load near it raises none) raises an alarm with the keys
/// sampled in that window; the controller's policy replicates the hottest
/// of them at once instead of at the epoch's end.
#[derive(Debug, Default)]
pub struct Alarm {
    /// Requests/s above which this worker is hot; `None`: no alarms.
    pub limit: Option<f64>,
    start_ns: u64,
    start_count: u64,
    start_samples: usize,
}

impl Alarm {
    /// A new window from `now_ns`, with `count` requests served so far and
    /// `samples` keys sampled so far.
    pub fn restart(&mut self, now_ns: u64, count: u64, samples: usize) {
        (self.start_ns, self.start_count, self.start_samples) = (now_ns, count, samples);
    }

    /// At `now_ns`, with `count` requests served and `samples` sampled so
    /// far: once the window is long enough, whether it ran hot (then the
    /// index of its first sample and its length in seconds); either way a
    /// new window starts.
    pub fn check(&mut self, now_ns: u64, count: u64, samples: usize) -> Option<(usize, f64)> {
        let ns = now_ns.saturating_sub(self.start_ns);
        if ns < ALARM_WINDOW_NS {
            return None;
        }
        let (served, from) = (count.wrapping_sub(self.start_count), self.start_samples.min(samples));
        self.restart(now_ns, count, samples);
        let secs = ns as f64 * 1e-9;
        let expected = self.limit? * secs;
        (served as f64 > expected + ALARM_SIGMAS * expected.sqrt()).then_some((from, secs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn an_alarm_needs_a_whole_window_clearly_above_the_limit() {
        let mut a = Alarm { limit: Some(1000.0), ..Alarm::default() };
        a.restart(0, 0, 0);
        // 250 ms at 1,000/s: at the limit, no alarm (noise).
        assert_eq!(a.check(ALARM_WINDOW_NS, 250, 5), None);
        // Not a whole window yet, however busy.
        assert_eq!(a.check(ALARM_WINDOW_NS + 100 * MS, 10_000, 9), None);
        // 300 ms at 1,400/s: an alarm with the samples of that window.
        let now = 2 * ALARM_WINDOW_NS + 50 * MS;
        let (from, secs) = a.check(now, 250 + 420, 12).expect("an alarm");
        assert_eq!(from, 5);
        assert!((secs - 0.3).abs() < 1e-9, "{secs}");
        // No limit (an idle cluster, or before the first epoch): none.
        a.limit = None;
        assert_eq!(a.check(now + ALARM_WINDOW_NS, 670 + 10_000, 20), None);
    }

    #[test]
    fn hints_follow_grants_writes_and_time() {
        let mut t = HotTable { lease_cap_ms: 2000, ..Default::default() };
        assert_eq!(t.hint(1, b"k", 0), None);
        assert!(t.replicate(1, b"k", 3, 2));
        assert_eq!(t.hint(1, b"k", 0), Some(Hint { replicas: 0, lease_ms: 0 }), "no lease before the copies exist");
        assert_eq!(t.hint(1, b"other", 0), None, "a hash collision is not the key");
        t.get_mut(1).unwrap().grant = Some((2, 5000 * MS));
        assert_eq!(t.hint(1, b"k", 1000 * MS), Some(Hint { replicas: 2, lease_ms: 2000 }), "capped");
        assert_eq!(t.hint(1, b"k", 4000 * MS), Some(Hint { replicas: 2, lease_ms: 1000 }), "until the copies' end");
        assert_eq!(t.hint(1, b"k", 5000 * MS), Some(Hint { replicas: 0, lease_ms: 0 }), "past it");
        t.get_mut(1).unwrap().pending = 1;
        assert_eq!(t.hint(1, b"k", 0), Some(Hint { replicas: 0, lease_ms: 0 }), "a write being copied");
        assert!(!t.replicate(1, b"k", 3, 4));
        assert_eq!(t.get_mut(1).unwrap().replicas, 4);
        assert!(!t.replicate(1, b"k", 3, 1), "never narrows while copies exist");
        assert_eq!(t.get_mut(1).unwrap().replicas, 4);
        // Every read that asked for its hint here was counted, exactly.
        assert_eq!(t.home_reads_so_far(), vec![(b"k"[..].into(), 5)]);
        assert_eq!(t.take_home_reads(), vec![(b"k"[..].into(), 5)]);
        assert_eq!(t.take_home_reads(), vec![(b"k"[..].into(), 0)], "counted again from 0");
        assert_eq!(t.of_cachelet(3), vec![1]);
        assert!(t.remove(1).is_some());
        assert!(t.is_empty());
    }

    #[test]
    fn shadow_copies_live_until_their_time_and_respect_the_cap() {
        let mut s = ShadowTable::with_cap(1000);
        assert!(s.put(b"k", 7, b"v1", 100, None, 0));
        assert_eq!(s.get(b"k", 50 * MS).map(|c| (c.flags, &c.value[..])), Some((7, &b"v1"[..])));
        assert_eq!(s.renew(b"k", 100, 90 * MS), Some(1), "renewed, with the one read it served");
        assert!(s.get(b"k", 150 * MS).is_some(), "renewed");
        assert_eq!(s.renew(b"k", 30, 160 * MS), Some(1), "the reads since the last renewal");
        assert!(s.get(b"k", 190 * MS).is_none(), "expired");
        assert_eq!(s.renew(b"k", 100, 200 * MS), None, "gone");
        assert!(!s.put(b"big", 0, &[0u8; 2000], 100, None, 0), "over the cap");
        assert_eq!(s.stats().refused, 1);
        assert!(s.put(b"a", 0, b"x", 100, Some(10 * MS), 0));
        assert!(s.get(b"a", 20 * MS).is_none(), "the item's own expiry");
        assert!(s.put(b"b", 0, b"x", 100, None, 0));
        s.sweep(500 * MS);
        assert_eq!(s.stats().items, 0);
        assert_eq!(s.stats().bytes, 0);
    }
}
