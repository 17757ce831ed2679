//! Tests of the lease cache: grants, expiry, the copy drawn once per lease,
//! what ends a lease, the bound, the spread over copies, and a property
//! test against a model of the protocol's rules.

use super::*;
use crate::{key_hash, ServerInfo};
use proptest::prelude::*;
use std::net::SocketAddr;

/// `servers` servers x `workers` workers.
fn map(servers: u16, workers: u16) -> ClusterMap {
    let info = (0..servers)
        .map(|s| ServerInfo {
            main: SocketAddr::from(([127, 0, 0, 1], 1000 + s * 10)),
            workers: (0..workers).map(|w| SocketAddr::from(([127, 0, 0, 1], 1001 + s * 10 + w))).collect(),
        })
        .collect();
    ClusterMap::even(info, 2, 64)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A key whose first lease in a cache seeded `seed`, with γ replicas and
/// home (0, 0) of `map(4, 2)`, draws a copy other than the home.
fn key_drawing_a_copy(seed: u64, replicas: u32) -> u64 {
    let (m, t0) = (map(4, 2), Instant::now());
    (0u32..)
        .map(|i| key_hash(format!("hot{i}").as_bytes()))
        .find(|&h| Leases::new(seed, 1).record(&m, h, (0, 0), replicas, 1, t0).unwrap().copy != 0)
        .unwrap()
}

/// Per key of the property test: (home, γ, end of the lease, the read
/// target seen during it).
type ModelLease = Option<(Owner, u32, Instant, Option<Option<Owner>>)>;

#[test]
fn a_hint_grants_a_lease_to_one_copy_until_it_ends() {
    let m = map(4, 2);
    let t0 = Instant::now();
    let mut l = Leases::new(7, 100);
    let h = key_drawing_a_copy(7, 3);
    let home = (0, 0);
    assert_eq!(l.read_target(h, t0), None, "no lease: home");
    let lease = l.record(&m, h, home, 3, 100, t0).unwrap();
    assert!((1..=3).contains(&lease.copy));
    assert_eq!(Some(lease.at), replica_location(h, lease.copy, home, 4, |_| 2));
    assert_ne!(lease.at.0, home.0, "a copy lives on another server");
    assert_eq!((lease.until, lease.number, lease.home, lease.replicas), (t0 + ms(100), 0, home, 3));
    for dt in [0, 1, 50, 99] {
        assert_eq!(l.read_target(h, t0 + ms(dt)), Some(lease.at), "at {dt} ms");
    }
    assert_eq!(l.read_target(h, t0 + ms(100)), None, "the lease ended");
    assert!(l.is_empty(), "an expired lease is dropped");
    assert_eq!(l.read_target(h, t0 + ms(50)), None, "and does not come back");
}

#[test]
fn a_live_lease_keeps_its_copy_and_its_end_whatever_hints_say_the_same() {
    let m = map(4, 2);
    let t0 = Instant::now();
    let mut l = Leases::new(1, 100);
    let h = key_hash(b"k");
    let home = (1, 0);
    let first = l.record(&m, h, home, 5, 100, t0).unwrap();
    for i in 1..50 {
        let again = l.record(&m, h, home, 5, 100, t0 + ms(i)).unwrap();
        assert_eq!(again, first, "neither re-drawn nor extended");
    }
    assert_eq!(l.granted(), 1);
    // another replica count (or home) is a new lease
    let other = l.record(&m, h, home, 2, 100, t0 + ms(60)).unwrap();
    assert_eq!((other.number, other.replicas, other.until), (1, 2, t0 + ms(160)));
    let moved = l.record(&m, h, (2, 1), 2, 100, t0 + ms(61)).unwrap();
    assert_eq!((moved.number, moved.home), (2, (2, 1)));
    // after the end, the next hint draws again
    let next = l.record(&m, h, (2, 1), 2, 100, t0 + ms(161)).unwrap();
    assert_eq!(next.number, 3);
}

#[test]
fn writes_failures_and_zero_hints_end_leases() {
    let m = map(3, 2);
    let t0 = Instant::now();
    let mut l = Leases::new(3, 100);
    let h = key_drawing_a_copy(3, 4);
    let lease = l.record(&m, h, (0, 0), 4, 1000, t0).unwrap();
    assert_ne!(lease.copy, 0);
    assert!(l.read_target(h, t0).is_some());
    assert!(l.end(h), "a write by this client");
    assert_eq!(l.read_target(h, t0 + ms(1)), None, "it reads its write at home");
    assert!(!l.end(h));
    // a zero hint ends the lease (the home is copying a write, or the key cooled)
    l.record(&m, h, (0, 0), 4, 1000, t0);
    assert_eq!(l.record(&m, h, (0, 0), 0, 1000, t0 + ms(2)), None);
    assert_eq!(l.read_target(h, t0 + ms(3)), None);
    l.record(&m, h, (0, 0), 4, 1000, t0);
    assert_eq!(l.record(&m, h, (0, 0), 4, 0, t0 + ms(2)), None);
    assert!(l.is_empty());
    // end_at: every lease reading at the failed copy, and only those
    let mut l = Leases::new(3, 1000);
    let keys: Vec<u64> = (0..200u32).map(|i| key_hash(&i.to_le_bytes())).collect();
    for &k in &keys {
        l.record(&m, k, (0, 0), 4, 1000, t0);
    }
    let at = lease.at;
    let n = keys.iter().filter(|&&k| l.lease(k).is_some_and(|x| x.copy != 0 && x.at == at)).count();
    assert!(n > 0);
    assert_eq!(l.end_at(at), n);
    assert_eq!(l.len(), 200 - n);
    assert!(keys.iter().all(|&k| l.read_target(k, t0) != Some(at)));
}

#[test]
fn a_failed_copy_is_not_read_until_its_retry_time() {
    let m = map(2, 1);
    let t0 = Instant::now();
    let mut l = Leases::new(4, 100);
    let keys: Vec<u64> = (0..100u32).map(|i| key_hash(&i.to_le_bytes())).collect();
    for &k in &keys {
        l.record(&m, k, (0, 0), 1, 10_000, t0);
    }
    let at_copy = keys.iter().filter(|&&k| l.read_target(k, t0) == Some((1, 0))).count();
    assert!(at_copy > 20);
    assert_eq!(l.copy_failed((1, 0), t0, ms(500)), at_copy);
    // new leases may draw the failed copy: they read at home until the retry time
    for &k in &keys {
        l.record(&m, k, (0, 0), 1, 10_000, t0 + ms(1));
    }
    let drawn: Vec<u64> = keys.iter().copied().filter(|&k| l.lease(k).unwrap().copy == 1).collect();
    assert!(!drawn.is_empty());
    for &k in &drawn {
        assert_eq!(l.read_target(k, t0 + ms(499)), None, "the copy is not tried yet");
        assert_eq!(l.read_target(k, t0 + ms(500)), Some((1, 0)), "then it is, with the lease unchanged");
    }
}

#[test]
fn hints_the_map_cannot_place_are_ignored_or_cut() {
    let t0 = Instant::now();
    let mut l = Leases::new(0, 10);
    let h = key_hash(b"k");
    assert_eq!(l.record(&map(2, 2), h, (5, 0), 1, 100, t0), None, "home not in the map");
    assert_eq!(l.record(&map(1, 4), h, (0, 0), 3, 100, t0), None, "one server: nowhere to place a copy");
    let lease = l.record(&map(2, 2), h, (0, 1), 99, 100, t0).unwrap();
    assert_eq!(lease.replicas, 2, "at most (servers - 1) x workers copies");
    let lease = l.record(&map(2, 2), key_hash(b"j"), (0, 1), 1, u64::MAX, t0).unwrap();
    assert!(lease.until > t0 + Duration::from_secs(1 << 30), "a huge lease does not overflow");
}

#[test]
fn the_cache_is_bounded_and_drops_the_oldest() {
    let m = map(2, 2);
    let t0 = Instant::now();
    let mut l = Leases::new(9, 8);
    let keys: Vec<u64> = (0..1000u32).map(|i| key_hash(&i.to_le_bytes())).collect();
    for (i, &k) in keys.iter().enumerate() {
        l.record(&m, k, (0, 0), 2, 1000, t0);
        assert!(l.len() <= 8);
        assert!(l.order.len() <= 2 * 8 + 16 + 1, "the grant order is compacted");
        if i >= 8 {
            assert!(l.lease(keys[i - 8]).is_none(), "the oldest went first");
            assert!(l.lease(keys[i - 7]).is_some());
        }
    }
    // re-granting the same keys keeps the bound too
    for _ in 0..100 {
        for &k in &keys[..3] {
            l.end(k);
            l.record(&m, k, (0, 0), 2, 1000, t0);
        }
    }
    assert!(l.len() <= 8 && l.order.len() <= 2 * 8 + 16 + 1);
}

#[test]
fn draws_spread_evenly_over_home_and_copies_and_differ_between_clients() {
    let m = map(8, 2);
    let t0 = Instant::now();
    let (gamma, n) = (3u32, 40_000u32);
    let mut count = vec![0u32; gamma as usize + 1];
    let mut a = Leases::new(11, n as usize);
    let mut b = Leases::new(12, n as usize);
    let mut same = 0;
    for i in 0..n {
        let h = key_hash(format!("key{i}").as_bytes());
        let la = a.record(&m, h, (0, 0), gamma, 1000, t0).unwrap();
        let lb = b.record(&m, h, (0, 0), gamma, 1000, t0).unwrap();
        count[la.copy as usize] += 1;
        same += u32::from(la.copy == lb.copy);
    }
    let want = n / (gamma + 1);
    for (c, &k) in count.iter().enumerate() {
        assert!(k.abs_diff(want) < want / 20, "copy {c} drawn {k} times of {n}, want about {want}");
    }
    // two clients agree about as often as chance says (1 in γ+1)
    assert!(same.abs_diff(want) < want / 10, "{same}");
    // one client, one hot key, lease after lease: every copy in turn gets drawn
    let mut l = Leases::new(5, 4);
    let h = key_hash(b"hot");
    let mut seen = [0u32; 4];
    for i in 0..4000u64 {
        let lease = l.record(&m, h, (3, 1), gamma, 10, t0 + ms(10 * i)).unwrap();
        assert_eq!(lease.number, i, "each hint after the end is a new lease");
        seen[lease.copy as usize] += 1;
    }
    assert!(seen.iter().all(|&k| k.abs_diff(1000) < 150), "{seen:?}");
}

/// One step of the property test.
#[derive(Clone, Debug)]
enum Op {
    /// Time passes (ms).
    Wait(u64),
    /// A hint for key `k` from home `h` (of 2) with γ and lease-ms.
    Hint {
        k: usize,
        h: u16,
        replicas: u32,
        lease_ms: u64,
    },
    Read(usize),
    Write(usize),
    /// The read at key `k`'s copy failed.
    Fail(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..60).prop_map(Op::Wait),
        (0usize..4, 0u16..2, 0u32..6, 0u64..100).prop_map(|(k, h, replicas, lease_ms)| Op::Hint {
            k,
            h,
            replicas,
            lease_ms
        }),
        (0usize..4).prop_map(Op::Read),
        (0usize..4).prop_map(Op::Read),
        (0usize..4).prop_map(Op::Write),
        (0usize..4).prop_map(Op::Fail),
    ]
}

proptest! {
    /// Against a model of the rules: a copy is read only while the lease
    /// the protocol granted is live; within one lease every read goes to
    /// the same place; a write or a failure ends the lease until the next
    /// hint; every copy read is one the cluster places (never the home's
    /// server).
    #[test]
    fn leases_follow_the_protocol(ops in proptest::collection::vec(op(), 1..200), seed in any::<u64>()) {
        let m = map(3, 2);
        let t0 = Instant::now();
        let keys: Vec<u64> = (0..4u32).map(|i| key_hash(format!("k{i}").as_bytes())).collect();
        let homes = [(0u16, 1u16), (2, 0)];
        let mut l = Leases::new(seed, 3);
        let mut now = t0;
        // model per key: (home, γ, end of the lease, the target seen in it)
        let mut model: Vec<ModelLease> = vec![None; 4];
        for op in ops {
            match op {
                Op::Wait(d) => now += ms(d),
                Op::Hint { k, h, replicas, lease_ms } => {
                    let home = homes[h as usize];
                    let got = l.record(&m, keys[k], home, replicas, lease_ms, now);
                    let live = model[k].filter(|&(_, _, end, _)| now < end);
                    let replicas = replicas.min(4);
                    model[k] = if replicas == 0 || lease_ms == 0 {
                        None
                    } else {
                        match live {
                            Some(x) if x.0 == home && x.1 == replicas => Some(x),
                            _ => Some((home, replicas, now + ms(lease_ms), None)),
                        }
                    };
                    prop_assert_eq!(got.map(|g| g.until), model[k].map(|x| x.2));
                    for (j, x) in model.iter_mut().enumerate() {
                        if l.lease(keys[j]).is_none() {
                            // dropped by the bound (3 keys of 4): the model forgets it too
                            *x = None;
                        }
                    }
                }
                Op::Read(k) => {
                    let got = l.read_target(keys[k], now);
                    match &mut model[k] {
                        Some((home, replicas, end, seen)) if now < *end => {
                            if let Some(c) = got {
                                prop_assert_ne!(c.0, home.0, "a copy is on another server");
                                let placed = (1..=*replicas).any(|i| replica_location(keys[k], i, *home, 3, |_| 2) == Some(c));
                                prop_assert!(placed);
                            }
                            match seen {
                                None => *seen = Some(got),
                                Some(s) => prop_assert_eq!(*s, got, "one copy per lease"),
                            }
                        }
                        _ => prop_assert_eq!(got, None, "no copy outside a live lease"),
                    }
                    if model[k].is_some_and(|x| now >= x.2) {
                        model[k] = None;
                    }
                    if l.lease(keys[k]).is_none() {
                        model[k] = None;
                    }
                }
                Op::Write(k) | Op::Fail(k) => {
                    l.end(keys[k]);
                    model[k] = None;
                    prop_assert_eq!(l.read_target(keys[k], now), None);
                }
            }
            prop_assert!(l.len() <= 3);
        }
    }
}
