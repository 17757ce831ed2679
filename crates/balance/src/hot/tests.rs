use super::*;
use crate::snapshot::{CacheletLoad, WorkerLoad};
use KeyEvent as E;
use KeyState as S;
use KeyTransition as T;

const STATES: [KeyState; 5] = [S::Invalid, S::Cold, S::HotPending, S::Hot, S::ColdPending];
const EVENTS: [KeyEvent; 9] =
    [E::Tracked, E::Dropped, E::Heated, E::Grew, E::Ready, E::Failed, E::WriteStarted, E::Cooled, E::LeasesEnded];

/// Every (state, event) pair: the edges of SPORE Fig. 5 (with the
/// growth and failure edges) and nothing else.
#[test]
fn state_table() {
    let table: &[(KeyState, KeyEvent, KeyState, KeyTransition)] = &[
        (S::Invalid, E::Tracked, S::Cold, T::Track),
        (S::Cold, E::Dropped, S::Invalid, T::Evict),
        (S::Cold, E::Heated, S::HotPending, T::Replicate),
        (S::HotPending, E::Ready, S::Hot, T::ReplicasReady),
        (S::HotPending, E::Failed, S::ColdPending, T::ReplicationFailed),
        (S::Hot, E::Grew, S::HotPending, T::AddReplicas),
        (S::Hot, E::WriteStarted, S::HotPending, T::PropagateWrite),
        (S::Hot, E::Cooled, S::ColdPending, T::Cool),
        (S::ColdPending, E::Heated, S::Hot, T::Reheat),
        (S::ColdPending, E::LeasesEnded, S::Cold, T::Retire),
    ];
    let mut named = std::collections::HashSet::new();
    for s in STATES {
        for e in EVENTS {
            let want = table.iter().find(|r| r.0 == s && r.1 == e).map(|r| (r.2, r.3));
            assert_eq!(step(s, e), want, "{s:?} on {e:?}");
            if let Some((_, t)) = want {
                named.insert(t);
            }
        }
    }
    assert_eq!(named.len(), table.len(), "every transition has its own name");
    // Only COLD entries are ever evicted.
    for s in STATES {
        assert_eq!(step(s, E::Dropped).is_some(), s == S::Cold);
    }
}

#[test]
fn expected_maximum_of_normals() {
    // Tabulated values: E[max of 2] = 1/√π, of 16 ≈ 1.766, of 100 ≈ 2.508.
    assert!((expected_max_normal(2) - 1.0 / std::f64::consts::PI.sqrt()).abs() < 1e-4);
    assert!((expected_max_normal(16) - 1.766).abs() < 2e-3);
    assert!((expected_max_normal(100) - 2.508).abs() < 2e-3);
    assert_eq!(expected_max_normal(1), 0.0);
}

#[test]
fn replica_count_rule() {
    assert_eq!(copies(100.0, 100.0, 16), 1, "at T: not hot");
    assert_eq!(copies(100.1, 100.0, 16), 2);
    assert_eq!(copies(250.0, 100.0, 16), 3);
    assert_eq!(copies(10_000.0, 100.0, 16), 16, "capped at the copies the cluster has");
    assert_eq!(copies(5.0, 0.0, 16), 1);
    assert_eq!(copies(500.0, 100.0, 1), 1, "one server: no shadows");
}

proptest::proptest! {
    #[test]
    fn copies_follow_ceil_f_over_t(f in 0.0f64..1e6, t in 1.0f64..1e5, max in 1u32..64) {
        let r = copies(f, t, max);
        proptest::prop_assert!(r >= 1 && r <= max);
        if r < max && r > 1 {
            proptest::prop_assert!(f / f64::from(r) <= t + 1e-9 && f / f64::from(r - 1) > t - 1e-9);
        }
    }

    #[test]
    fn placement_is_never_home_and_deterministic(
        hash in proptest::num::u64::ANY,
        servers in 2u16..40,
        workers in 1u16..8,
        home_s in 0u16..40,
        home_w in 0u16..8,
    ) {
        let home = (home_s % servers, home_w % workers);
        let most = u32::from(servers - 1) * u32::from(workers);
        let mut seen = std::collections::HashSet::new();
        for i in 1..=most {
            let at = replica_location(hash, i, home, servers, |_| workers).expect("in range");
            proptest::prop_assert_ne!(at.0, home.0, "replica {} on the home server", i);
            proptest::prop_assert!(at.0 < servers && at.1 < workers);
            proptest::prop_assert_eq!(Some(at), replica_location(hash, i, home, servers, |_| workers));
            proptest::prop_assert!(seen.insert(at), "replica {} repeats {:?}", i, at);
            if i < u32::from(servers) {
                proptest::prop_assert!(seen.iter().filter(|s| s.0 == at.0).count() == 1);
            }
        }
        proptest::prop_assert_eq!(replica_location(hash, 0, home, servers, |_| workers), None);
        proptest::prop_assert_eq!(replica_location(hash, most + 1, home, servers, |_| workers), None);
    }

    /// Servers of different sizes (a server that joined with more or fewer workers): every
    /// replica is on another server, at a worker that server has, no two at one worker, and
    /// as many places as the other servers have workers.
    #[test]
    fn placement_fits_servers_of_different_sizes(
        hash in proptest::num::u64::ANY,
        sizes in proptest::collection::vec(1u16..6, 2..12),
        home_s in 0u16..12,
    ) {
        let servers = sizes.len() as u16;
        let workers_of = |s: u16| sizes[usize::from(s)];
        let home = (home_s % servers, 0);
        let most = mbal_cluster::most_replicas(home.0, servers, workers_of);
        let max = u32::from(*sizes.iter().max().unwrap()) * u32::from(servers - 1);
        let mut seen = std::collections::HashSet::new();
        for i in 1..=max {
            let Some(at) = replica_location(hash, i, home, servers, workers_of) else { continue };
            proptest::prop_assert_ne!(at.0, home.0);
            proptest::prop_assert!(at.1 < workers_of(at.0), "replica {} at {:?}: no such worker", i, at);
            proptest::prop_assert!(seen.insert(at), "replica {} repeats {:?}", i, at);
        }
        proptest::prop_assert_eq!(seen.len() as u32, most, "every worker of the other servers, once");
    }
}

#[test]
fn no_placement_without_another_server() {
    assert_eq!(replica_location(42, 1, (0, 0), 1, |_| 4), None);
}

#[test]
fn placement_spreads_over_servers() {
    // Replica 1 of many keys homed on server 0 lands evenly on 1..8.
    let mut counts = [0u32; 8];
    for k in 0..8000u64 {
        let (s, _) = replica_location(k.wrapping_mul(0x9E37_79B9), 1, (0, 0), 8, |_| 2).unwrap();
        counts[usize::from(s)] += 1;
    }
    assert_eq!(counts[0], 0);
    for c in &counts[1..] {
        assert!((900..1400).contains(c), "{counts:?}");
    }
}

#[test]
fn estimate_is_one_when_nothing_is_skewed_and_falls_with_copies() {
    assert!((estimate_max_over_avg(&[], 100.0, 16, 1.0) - 1.0).abs() < 1e-12);
    let one = estimate_max_over_avg(&[(1000.0, 1)], 100.0, 16, 1.0);
    let two = estimate_max_over_avg(&[(1000.0, 2)], 100.0, 16, 1.0);
    let all = estimate_max_over_avg(&[(1000.0, 16)], 100.0, 16, 1.0);
    assert!(one > two && two > all, "{one} {two} {all}");
    assert!((all - 1.0).abs() < 1e-12, "a key on every worker adds no imbalance");
    // One key carrying 10 workers' worth of load, unreplicated, is at
    // least that much above the mean on its worker.
    assert!(one >= 1.0 + (1000.0 - 1000.0 / 16.0) / 100.0 - 1e-9);
}

#[test]
fn threshold_meets_the_target_on_zipf() {
    // 16 workers, mean 1000 req/s: Zipf 0.99 over 100k keys, the top
    // 256 tracked.
    let n = 16usize;
    let avg = 1000.0;
    let h: f64 = (1..=100_000).map(|i| 1.0 / f64::from(i).powf(0.99)).sum();
    let keys: Vec<(f64, bool)> = (1..=256).map(|i| (avg * n as f64 / f64::from(i).powf(0.99) / h, true)).collect();
    let (t, est) = choose_threshold(&keys, avg, n, 1.0, 16, 1.1);
    let replicated = keys.iter().filter(|k| copies(k.0, t, 16) > 1).count();
    eprintln!("T {t} est {est} replicated {replicated}");
    assert!(est <= 1.1, "T {t} est {est}");
    let bound = 2.0 * n as f64 * (n as f64).ln();
    assert!((replicated as f64) <= bound, "{replicated} keys > 2 n ln n = {bound}");
    // The largest such T: 10% more would not do.
    let more: Vec<(f64, u32)> = keys.iter().map(|k| (k.0, copies(k.0, t / 0.9, 16))).collect();
    assert!(estimate_max_over_avg(&more, avg, n, 1.0) > 1.1);
}

fn snapshot(seq: u64, loads: &[f64]) -> EpochSnapshot {
    EpochSnapshot {
        seq,
        end_ns: seq * 1_000_000_000,
        workers: loads
            .iter()
            .enumerate()
            .map(|(i, &l)| WorkerLoad {
                worker: i as u16,
                secs: 1.0,
                reads: l as u64,
                cachelets: vec![CacheletLoad { id: i as u32, reads_per_sec: l, ..CacheletLoad::default() }],
                ..WorkerLoad::default()
            })
            .collect(),
    }
}

const VIEW: ClusterView = ClusterView::uniform(0, 8, 2, Some(1000.0));

/// Feeds one epoch of samples: `hot` gets `rate` sampled reads/s
/// (already sampled: sample_rate 1), plus 200 one-off keys.
fn feed(h: &mut HotKeys, epoch: u64, hot: &[(&[u8], f64, f64)]) {
    for (k, reads, writes) in hot {
        for _ in 0..(*reads as u64) {
            h.observe(k, Access::Read, 0);
        }
        for _ in 0..(*writes as u64) {
            h.observe(k, Access::Write, 0);
        }
    }
    for j in 0..200 {
        h.observe(format!("cold{epoch}-{j}").as_bytes(), Access::Read, 1);
    }
}

fn policy() -> HotKeys {
    let cfg = HotConfig { sample_rate: 1.0, sample_target: 0.0, decay: 0.0, ..HotConfig::default() };
    HotKeys::new(cfg, Config::default())
}

#[test]
fn a_hot_read_key_on_a_hot_worker_is_replicated_then_retired() {
    let mut h = policy();
    // Worker 0 at 2.5× the cluster mean, carried by one key.
    feed(&mut h, 1, &[(b"hot", 1600.0, 0.0)]);
    let d = h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &VIEW);
    assert_eq!(d.hot_workers, vec![0]);
    assert_eq!(d.replicate.len(), 1, "{d:?}");
    let r = &d.replicate[0];
    assert_eq!((r.key.as_slice(), r.worker), (&b"hot"[..], 0));
    // Its worker is hot: T for its keys is pressed down (`HotKeys::press`).
    assert_eq!(h.press_of(0), PRESS_STEP);
    assert_eq!(h.press_of(1), 1.0, "worker 1 is under the mean");
    assert_eq!(r.replicas + 1, copies(1600.0, d.threshold * PRESS_STEP, VIEW.max_copies()));
    assert!(r.replicas >= 1);
    assert_eq!(h.state(b"hot"), S::HotPending);
    assert_eq!(h.hint(b"hot"), 0, "no lease while pending");
    assert!(d.transitions.contains(&(b"hot".to_vec(), T::Replicate)));
    assert_eq!(h.replicas_ready(b"hot"), Some(T::ReplicasReady));
    assert_eq!(h.hint(b"hot"), r.replicas);
    // A write: leases revoked until propagated.
    assert_eq!(h.write_propagating(b"hot"), Some(T::PropagateWrite));
    assert_eq!(h.hint(b"hot"), 0);
    assert_eq!(h.replicas_ready(b"hot"), Some(T::ReplicasReady));

    // It cools: after cool_epochs, COLD_PENDING; after the lease, retired.
    let mut states = Vec::new();
    let mut retired = None;
    for e in 2..20 {
        feed(&mut h, e, &[(b"hot", 2.0, 0.0)]);
        let d = h.on_epoch(&snapshot(e, &[1000.0, 1000.0]), &VIEW);
        states.push(h.state(b"hot"));
        if let Some(r) = d.retire.first() {
            retired = Some((e, r.clone()));
            break;
        }
    }
    let (e, r) = retired.expect("retired");
    assert_eq!(r.key, b"hot");
    assert!(r.replicas >= 1);
    assert_eq!(h.state(b"hot"), S::Cold);
    assert_eq!(states[..2], [S::Hot, S::Hot], "hysteresis: {states:?}");
    assert!(states.contains(&S::ColdPending));
    assert!(e >= 2 + u64::from(h.config().cool_epochs + h.config().lease_epochs));
}

#[test]
fn a_cool_worker_does_not_replicate() {
    let mut h = policy();
    feed(&mut h, 1, &[(b"warm", 90.0, 0.0), (b"warm2", 80.0, 0.0)]);
    // Every worker at the mean: no hotspot, nothing replicated (each key
    // alone is under (target − 1) × the mean, 100/s).
    let d = h.on_epoch(&snapshot(1, &[1000.0, 1000.0]), &VIEW);
    assert!(d.hot_workers.is_empty());
    assert!(d.replicate.is_empty(), "{d:?}");
    assert_eq!(h.state(b"warm"), S::Cold);
}

/// A key that alone would put any worker past the target (f − f/n above
/// (target − 1) × the mean) is replicated even while its worker is not hot
/// yet (after a shift, the worker's load does not yet hold the copies of
/// other servers' new keys it is about to serve).
#[test]
fn a_key_too_hot_for_any_worker_is_replicated_before_its_worker_looks_hot() {
    let mut h = policy();
    // Mean 1,000/s: (1.1 − 1) × 1,000 = 100; 150 × (1 − 1/16) = 140 is above.
    feed(&mut h, 1, &[(b"big", 150.0, 0.0), (b"warm", 90.0, 0.0)]);
    let d = h.on_epoch(&snapshot(1, &[1050.0, 1000.0]), &VIEW);
    assert!(d.hot_workers.is_empty(), "{d:?}");
    let keys: Vec<&[u8]> = d.replicate.iter().map(|r| &r.key[..]).collect();
    assert_eq!(keys, [&b"big"[..]], "{d:?}");
    assert_eq!(h.state(b"warm"), S::Cold);
}

#[test]
fn a_write_heavy_hotspot_escalates() {
    let mut h = policy();
    feed(&mut h, 1, &[(b"counter", 800.0, 800.0)]);
    let d = h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &VIEW);
    assert!(d.replicate.is_empty(), "{d:?}");
    assert_eq!(d.escalate.map(|e| e.why), Some(HotEscalateWhy::WriteHeavy));
}

#[test]
fn a_hot_partition_escalates_with_no_hot_keys() {
    let mut h = policy();
    let keys: Vec<Vec<u8>> = (0..100).map(|i| format!("p{i}").into_bytes()).collect();
    let hot: Vec<(&[u8], f64, f64)> = keys.iter().map(|k| (&k[..], 3.0, 0.0)).collect();
    feed(&mut h, 1, &hot);
    let d = h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &VIEW);
    assert!(d.replicate.is_empty(), "{d:?}");
    assert_eq!(d.escalate.map(|e| e.why), Some(HotEscalateWhy::NoHotKeys));
}

#[test]
fn repl_high_caps_and_escalates() {
    let cfg =
        HotConfig { sample_rate: 1.0, sample_target: 0.0, decay: 0.0, repl_high: Some(2), ..HotConfig::default() };
    let mut h = HotKeys::new(cfg, Config::default());
    feed(&mut h, 1, &[(b"a", 900.0, 0.0), (b"b", 800.0, 0.0), (b"c", 700.0, 0.0)]);
    let d = h.on_epoch(&snapshot(1, &[3000.0, 900.0]), &VIEW);
    let keys: Vec<&[u8]> = d.replicate.iter().map(|r| &r.key[..]).collect();
    assert_eq!(keys, [&b"a"[..], b"b"], "hottest first");
    assert_eq!(d.replicated, 2);
    assert_eq!(d.escalate.map(|e| e.why), Some(HotEscalateWhy::ReplHigh { wanted: 3, cap: 2 }));
}

/// With slots lent between servers the caller sets REPL_high: keys that
/// found no slot are reported waiting (what a borrower asks for), a larger
/// cap lets them in, and when a loan ends the coolest keys beyond the cap
/// are retired at once.
#[test]
fn a_lent_cap_lets_waiting_keys_in_and_an_ended_loan_retires_the_coolest() {
    let cfg = HotConfig { sample_rate: 1.0, sample_target: 0.0, decay: 0.0, ..HotConfig::default() };
    let mut h = HotKeys::new(cfg, Config::default());
    h.set_repl_high(Some(2));
    let rates: [(&[u8], f64, f64); 4] =
        [(b"a", 900.0, 0.0), (b"b", 800.0, 0.0), (b"c", 700.0, 0.0), (b"d", 650.0, 0.0)];
    feed(&mut h, 1, &rates);
    let d = h.on_epoch(&snapshot(1, &[3000.0, 900.0]), &VIEW);
    assert_eq!((d.replicated, d.cap, d.waiting), (2, 2, 2));
    assert_eq!(h.waiting(), 2);
    for r in &d.replicate {
        h.replicas_ready(&r.key);
    }
    // Two slots lent to this server: c and d get copies.
    h.set_repl_high(Some(4));
    feed(&mut h, 2, &rates);
    let d = h.on_epoch(&snapshot(2, &[3000.0, 900.0]), &VIEW);
    let keys: Vec<&[u8]> = d.replicate.iter().map(|r| &r.key[..]).collect();
    assert!(keys.contains(&&b"c"[..]) && keys.contains(&&b"d"[..]), "{keys:?}");
    assert_eq!((d.replicated, d.waiting), (4, 0));
    for r in &d.replicate {
        h.replicas_ready(&r.key);
    }
    // The loan ended: back to 2, the two coolest retired at once.
    h.set_repl_high(Some(2));
    feed(&mut h, 3, &rates);
    let d = h.on_epoch(&snapshot(3, &[3000.0, 900.0]), &VIEW);
    let mut gone: Vec<&[u8]> = d.retire.iter().map(|r| &r.key[..]).collect();
    gone.sort();
    assert_eq!(gone, [&b"c"[..], b"d"]);
    assert_eq!(d.replicated, 2);
    assert_eq!((h.state(b"c"), h.state(b"d")), (S::Cold, S::Cold));
    assert_eq!((h.state(b"a"), h.state(b"b")), (S::Hot, S::Hot));
    // An explicit REPL_high wins over the lent cap.
    let cfg = HotConfig { repl_high: Some(3), ..HotConfig::default() };
    let mut h = HotKeys::new(cfg, Config::default());
    h.set_repl_high(Some(9));
    assert_eq!(h.repl_high(&VIEW), 3);
}

/// Between epochs (a borrower's tick), a cap that fell is enforced at
/// once, keys whose copies are still being made included; pinned keys are
/// an operator's and stay.
#[test]
fn enforce_cap_retires_keys_being_copied_too_but_not_pinned_ones() {
    let mut h = policy();
    h.set_repl_high(Some(3));
    feed(&mut h, 1, &[(b"a", 900.0, 0.0), (b"b", 800.0, 0.0), (b"c", 700.0, 0.0)]);
    let d = h.on_epoch(&snapshot(1, &[3000.0, 900.0]), &VIEW);
    assert_eq!(d.replicated, 3);
    assert!(h.pin(b"p", 0, 2).is_some());
    assert_eq!((h.state(b"a"), h.state(b"c")), (S::HotPending, S::HotPending), "copies not made yet");
    h.replicas_ready(b"a");
    h.set_repl_high(Some(1));
    let gone = h.enforce_cap();
    let mut keys: Vec<&[u8]> = gone.iter().map(|r| &r.key[..]).collect();
    keys.sort();
    assert_eq!(keys, [&b"b"[..], b"c"], "keys retiring first, then the coolest, copies made or not");
    assert_eq!((h.state(b"b"), h.state(b"c")), (S::Cold, S::Cold));
    assert_eq!(h.state(b"a"), S::Hot);
    assert_eq!(h.state(b"p"), S::HotPending, "pinned");
    assert!(h.enforce_cap().is_empty(), "within the cap now");
}

#[test]
fn default_repl_high_is_the_share_of_2_n_ln_n() {
    let h = HotKeys::new(HotConfig::default(), Config::default());
    // 8 servers × 2 workers: floor(2·16·ln 16) = floor(88.7) = 88 over 8 servers, 11 each.
    assert_eq!(repl_high_total(16), 88);
    assert_eq!(h.repl_high(&VIEW), 11);
    // Shares add up to the total whatever the split: 3 servers × 2 workers, floor(2·6·ln 6) = 21.
    let share = |server| h.repl_high(&ClusterView::uniform(server, 3, 2, None));
    assert_eq!(repl_high_total(6), 21);
    assert_eq!((share(0), share(1), share(2)), (7, 7, 7));
    // 5 servers × 2 workers: floor(2·10·ln 10) = 46: 10, 9, 9, 9, 9.
    let share = |server| h.repl_high(&ClusterView::uniform(server, 5, 2, None));
    assert_eq!((0..5).map(share).collect::<Vec<_>>(), [10, 9, 9, 9, 9]);
}

/// Epochs of a balanced server where a much hotter cold key `big` sets T
/// and the HOT key `hot` (γ = `g`) runs at `frac` × the last epoch's T
/// (its home sees 1/(γ+1) of that); returns the states after each epoch.
fn run_hot(h: &mut HotKeys, epochs: std::ops::Range<u64>, frac: f64, g: u32, t: &mut f64) -> Vec<KeyState> {
    epochs
        .map(|e| {
            let home = (frac * *t / f64::from(g + 1)).round().max(1.0);
            feed(h, e, &[(b"hot", home, 0.0), (b"big", 100_000.0, 0.0)]);
            let view = ClusterView { avg_load: Some(100_000.0), ..VIEW };
            let d = h.on_epoch(&snapshot(e, &[1000.0, 1000.0]), &view);
            *t = d.threshold;
            h.state(b"hot")
        })
        .collect()
}

/// Make `hot` HOT (with `replicas` copies) on a hot worker; returns T.
fn make_hot(h: &mut HotKeys) -> (f64, u32) {
    feed(h, 1, &[(b"hot", 1600.0, 0.0)]);
    let d = h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &VIEW);
    assert_eq!(h.replicas_ready(b"hot"), Some(T::ReplicasReady));
    (d.threshold, d.replicate[0].replicas)
}

#[test]
fn a_rate_falls_by_at_most_half_per_epoch() {
    let mut h = policy();
    let (_, g) = make_hot(&mut h);
    let at = |h: &HotKeys| h.top(1).first().map(|s| s.reads_per_sec).unwrap_or(0.0);
    assert!((at(&h) - 1600.0).abs() < 1.0, "{}", at(&h));
    // The home then sees almost nothing (say its copies took every read):
    // the estimate halves per epoch instead of dropping to ~0.
    feed(&mut h, 2, &[(b"hot", 1.0, 0.0)]);
    h.on_epoch(&snapshot(2, &[1000.0, 1000.0]), &VIEW);
    assert!((at(&h) - 800.0).abs() < 1.0, "{}", at(&h));
    feed(&mut h, 3, &[]);
    h.on_epoch(&snapshot(3, &[1000.0, 1000.0]), &VIEW);
    assert!((at(&h) - 400.0).abs() < 1.0, "untracked this epoch: halved too, {}", at(&h));
    // A rise is taken at once (a HOT key's home sees 1/(γ+1) of its reads).
    feed(&mut h, 4, &[(b"hot", 1000.0, 0.0)]);
    h.on_epoch(&snapshot(4, &[1000.0, 1000.0]), &VIEW);
    assert!((at(&h) - 1000.0 * f64::from(g + 1)).abs() < 1.0, "{}", at(&h));
}

#[test]
fn a_hot_key_cools_only_after_three_epochs_at_half_the_threshold() {
    let cfg = HotConfig { sample_rate: 1.0, sample_target: 0.0, decay: 0.0, max_fall: 1.0, ..HotConfig::default() };
    let mut h = HotKeys::new(cfg.clone(), Config::default());
    let (_, g) = make_hot(&mut h);
    let mut t = 0.0;
    // One epoch to learn T with `big` there (hot at ~0 meanwhile, within one epoch).
    run_hot(&mut h, 2..3, 0.0, g, &mut t);
    assert!(t.is_finite() && t > 2000.0, "{t}");
    // At 0.7 T (below T: it would not be replicated now, but above 0.5 T): stays HOT.
    let states = run_hot(&mut h, 3..12, 0.7, g, &mut t);
    assert!(states.iter().all(|s| *s == S::Hot), "{states:?}");
    // At 0.3 T: cools on the third epoch, not before.
    let states = run_hot(&mut h, 12..15, 0.3, g, &mut t);
    assert_eq!(states, [S::Hot, S::Hot, S::ColdPending]);
    // An epoch above 0.5 T resets the count.
    let mut h = HotKeys::new(cfg, Config::default());
    let (_, g) = make_hot(&mut h);
    let mut t = 0.0;
    run_hot(&mut h, 2..3, 0.0, g, &mut t);
    let mut states = run_hot(&mut h, 3..4, 0.7, g, &mut t);
    states.extend(run_hot(&mut h, 4..6, 0.3, g, &mut t));
    states.extend(run_hot(&mut h, 6..7, 0.8, g, &mut t));
    states.extend(run_hot(&mut h, 7..10, 0.3, g, &mut t));
    assert_eq!(states, [S::Hot, S::Hot, S::Hot, S::Hot, S::Hot, S::Hot, S::ColdPending]);
}

#[test]
fn a_failed_replication_retires_before_it_is_replicated_again() {
    let mut h = policy();
    feed(&mut h, 1, &[(b"hot", 1600.0, 0.0)]);
    h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &VIEW);
    assert_eq!(h.replication_failed(b"hot"), Some(T::ReplicationFailed));
    assert_eq!(h.state(b"hot"), S::ColdPending);
    // Still hot on a hot worker: not re-heated (no leases to copies in an
    // unknown state); retired after the leases, then replicated afresh.
    let mut seen = Vec::new();
    for e in 2..10 {
        feed(&mut h, e, &[(b"hot", 1600.0, 0.0)]);
        let d = h.on_epoch(&snapshot(e, &[2500.0, 900.0]), &VIEW);
        seen.extend(d.transitions.iter().filter(|t| t.0 == b"hot").map(|t| t.1));
        if d.replicate.iter().any(|r| r.key == b"hot") {
            break;
        }
    }
    assert_eq!(seen, [T::Retire, T::Replicate], "{seen:?}");
    // The same for a replication that times out.
    let mut h = policy();
    feed(&mut h, 1, &[(b"hot", 1600.0, 0.0)]);
    h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &VIEW);
    let mut seen = Vec::new();
    for e in 2..14 {
        feed(&mut h, e, &[(b"hot", 1600.0, 0.0)]);
        let d = h.on_epoch(&snapshot(e, &[2500.0, 900.0]), &VIEW);
        seen.extend(d.transitions.iter().filter(|t| t.0 == b"hot").map(|t| t.1));
        if d.replicate.iter().any(|r| r.key == b"hot") {
            break;
        }
    }
    assert_eq!(seen, [T::ReplicationFailed, T::Retire, T::Replicate], "{seen:?}");
}

#[test]
fn displacement_cools_the_coolest_hot_key_for_a_much_hotter_one() {
    for displace in [false, true] {
        let cfg = HotConfig {
            sample_rate: 1.0,
            sample_target: 0.0,
            decay: 0.0,
            repl_high: Some(2),
            displace,
            // Without the homes' exact counts (judged by the samples).
            displace_quiet: 2,
            ..HotConfig::default()
        };
        let mut h = HotKeys::new(cfg, Config::default());
        feed(&mut h, 1, &[(b"a", 900.0, 0.0), (b"b", 800.0, 0.0)]);
        let d = h.on_epoch(&snapshot(1, &[3000.0, 900.0]), &VIEW);
        assert_eq!(d.replicated, 2);
        h.replicas_ready(b"a");
        h.replicas_ready(b"b");
        // The hot set shifts: b's readers leave and "c" turns up much
        // hotter than b ever was (the home sees 1/(γ+1) of a HOT key's reads).
        let ga = h.hint(b"a");
        let mut states = Vec::new();
        for e in 2..10 {
            feed(&mut h, e, &[(b"a", 900.0 / f64::from(ga + 1), 0.0), (b"b", 1.0, 0.0), (b"c", 2000.0, 0.0)]);
            let d = h.on_epoch(&snapshot(e, &[3000.0, 900.0]), &VIEW);
            let leased =
                [b"a", b"b", b"c"].iter().filter(|k| matches!(h.state(&k[..]), S::Hot | S::HotPending)).count();
            assert!(leased <= 2, "the keys granted leases stay within the cap: {d:?}");
            assert!(d.replicated <= 2, "the keys with copies stay within the cap too: {d:?}");
            if h.state(b"c") == S::HotPending {
                h.replicas_ready(b"c");
            }
            states.push((h.state(b"b"), h.state(b"c")));
            if e == 6 {
                break;
            }
        }
        assert_eq!(h.state(b"a"), S::Hot, "the hotter one stays");
        if displace {
            // b's measured rate is quiet for displace_quiet (2) epochs: it
            // gives way to c then, while its smoothed rate is still high.
            assert_eq!(states[0], (S::Hot, S::Cold), "not after one quiet epoch: {states:?}");
            assert_eq!(states[1], (S::Cold, S::Hot), "b gives way to c, its copies deleted at once: {states:?}");
            assert_eq!(states.last().unwrap(), &(S::Invalid, S::Hot), "b, retired and unread, is evicted: {states:?}");
        } else {
            assert!(states.iter().all(|s| s.1 == S::Cold), "{states:?}");
        }
    }
}

#[test]
fn pending_that_is_never_confirmed_fails_and_retires() {
    let mut h = policy();
    feed(&mut h, 1, &[(b"hot", 1600.0, 0.0)]);
    h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &VIEW);
    assert_eq!(h.state(b"hot"), S::HotPending);
    let mut failed = false;
    for e in 2..12 {
        feed(&mut h, e, &[(b"hot", 5.0, 0.0)]);
        let d = h.on_epoch(&snapshot(e, &[1000.0, 1000.0]), &VIEW);
        failed |= d.transitions.contains(&(b"hot".to_vec(), T::ReplicationFailed));
        if !d.retire.is_empty() {
            break;
        }
    }
    assert!(failed);
    assert_eq!(h.state(b"hot"), S::Cold);
    assert_eq!(h.replicated(), 0);
}

#[test]
fn a_key_that_heats_again_while_cold_pending_is_reheated() {
    let mut h = policy();
    feed(&mut h, 1, &[(b"hot", 1600.0, 0.0)]);
    h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &VIEW);
    h.replicas_ready(b"hot");
    let mut e = 2;
    while h.state(b"hot") != S::ColdPending {
        feed(&mut h, e, &[(b"hot", 2.0, 0.0)]);
        h.on_epoch(&snapshot(e, &[1000.0, 1000.0]), &VIEW);
        e += 1;
        assert!(e < 16);
    }
    feed(&mut h, e, &[(b"hot", 1600.0, 0.0)]);
    let d = h.on_epoch(&snapshot(e, &[2000.0, 1000.0]), &VIEW);
    assert!(d.transitions.contains(&(b"hot".to_vec(), T::Reheat)), "{d:?}");
    assert_eq!(h.state(b"hot"), S::Hot);
    assert!(d.retire.is_empty());
}

#[test]
fn untracked_cold_keys_are_evicted() {
    let mut h = policy();
    feed(&mut h, 1, &[]);
    let d = h.on_epoch(&snapshot(1, &[1000.0, 1000.0]), &VIEW);
    assert!(d.transitions.iter().any(|t| t.1 == T::Track));
    feed(&mut h, 2, &[]);
    let d = h.on_epoch(&snapshot(2, &[1000.0, 1000.0]), &VIEW);
    assert!(d.transitions.iter().any(|t| t.1 == T::Evict));
    assert_eq!(h.state(b"cold1-0"), S::Invalid);
}

#[test]
fn one_server_escalates_no_shadows() {
    let mut h = policy();
    feed(&mut h, 1, &[(b"hot", 1600.0, 0.0)]);
    let view = ClusterView::uniform(0, 1, 2, None);
    let d = h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &view);
    assert!(d.replicate.is_empty());
    assert_eq!(d.escalate.map(|e| e.why), Some(HotEscalateWhy::NoShadows));
}

#[test]
fn a_pinned_key_stays_replicated_without_traffic_until_unpinned() {
    let mut h = policy();
    let r = h.pin(b"op", 1, 3).expect("replicated at once");
    assert_eq!((r.key.as_slice(), r.worker, r.replicas), (&b"op"[..], 1, 3));
    assert_eq!(h.state(b"op"), S::HotPending);
    assert_eq!(h.pin(b"op", 1, 3), None, "already replicated");
    assert_eq!(h.replicas_ready(b"op"), Some(T::ReplicasReady));
    for e in 1..8 {
        feed(&mut h, e, &[]);
        let d = h.on_epoch(&snapshot(e, &[1000.0, 1000.0]), &VIEW);
        assert!(d.retire.is_empty());
        assert_eq!(h.state(b"op"), S::Hot, "epoch {e}");
        assert_eq!(h.hint(b"op"), 3);
    }
    h.unpin(b"op");
    let mut retired = false;
    for e in 8..20 {
        feed(&mut h, e, &[]);
        let d = h.on_epoch(&snapshot(e, &[1000.0, 1000.0]), &VIEW);
        if d.retire.iter().any(|r| r.key == b"op") {
            retired = true;
            break;
        }
    }
    assert!(retired, "cools and retires once unpinned");
    assert_eq!(h.pin(b"x", 0, 0), None);
}

#[test]
fn lost_copies_end_the_leases_and_block_a_reheat_until_retired() {
    let mut h = policy();
    h.pin(b"k", 0, 2).unwrap();
    assert_eq!(h.copies_lost(b"k"), Some(T::ReplicationFailed), "pending: failed");
    assert_eq!(h.state(b"k"), S::ColdPending);
    h.pin(b"j", 0, 2).unwrap();
    h.replicas_ready(b"j");
    assert_eq!(h.copies_lost(b"j"), Some(T::Cool), "hot: no more leases");
    assert_eq!(h.hint(b"j"), 0);
    assert_eq!(h.copies_lost(b"nope"), None);
    // Still hot by its rate on a hot worker: not re-heated, retired after the lease.
    let mut retired = Vec::new();
    for e in 1..10 {
        feed(&mut h, e, &[(b"j", 1600.0, 0.0)]);
        let d = h.on_epoch(&snapshot(e, &[2500.0, 900.0]), &VIEW);
        if d.retire.iter().any(|r| r.key == b"j") {
            retired.push(e);
            break;
        }
        assert_ne!(h.state(b"j"), S::Hot, "epoch {e}: re-heated with lost copies");
    }
    assert!(!retired.is_empty(), "retired");
}

#[test]
fn sampling_noise_is_never_replicated_and_does_not_drag_t_down() {
    let mut h = policy();
    // Worker 0 is hot, carried by "hot"; 50 keys of it seen twice each (below 3 samples: noise).
    let noise: Vec<Vec<u8>> = (0..50).map(|i| format!("n{i}").into_bytes()).collect();
    let mut hot: Vec<(&[u8], f64, f64)> = noise.iter().map(|k| (&k[..], 2.0, 0.0)).collect();
    hot.push((b"hot", 1600.0, 0.0));
    feed(&mut h, 1, &hot);
    let d = h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &VIEW);
    let keys: Vec<&[u8]> = d.replicate.iter().map(|r| &r.key[..]).collect();
    assert_eq!(keys, [&b"hot"[..]], "{d:?}");
    assert!(d.threshold > 10.0, "T from the significant keys only: {}", d.threshold);
    assert_eq!(h.state(b"n0"), S::Cold, "tracked, not replicated");
}

#[test]
fn a_growing_key_keeps_its_leases_on_the_copies_that_exist() {
    let mut h = policy();
    feed(&mut h, 1, &[(b"hot", 300.0, 0.0)]);
    let d = h.on_epoch(&snapshot(1, &[2500.0, 900.0]), &VIEW);
    let g = d.replicate[0].replicas;
    assert_eq!(h.hint(b"hot"), 0, "no lease before the first copies exist");
    h.replicas_ready(b"hot");
    assert_eq!(h.hint(b"hot"), g);
    // Much hotter now (its home sees 1/(γ+1) of it): more copies.
    let mut grown = None;
    for e in 2..6 {
        feed(&mut h, e, &[(b"hot", 3000.0, 0.0)]);
        let d = h.on_epoch(&snapshot(e, &[2500.0, 900.0]), &VIEW);
        if let Some(r) = d.replicate.iter().find(|r| r.key == b"hot") {
            grown = Some(r.replicas);
            break;
        }
    }
    let more = grown.expect("grew");
    assert!(more > g);
    assert_eq!(h.state(b"hot"), S::HotPending);
    assert_eq!(h.hint(b"hot"), g, "the leases go on over the copies that exist");
    h.replicas_ready(b"hot");
    assert_eq!(h.hint(b"hot"), more);
}

/// `n` sampled reads of `key`.
fn sampled(out: &mut Vec<(Box<[u8]>, bool)>, key: &[u8], n: usize, write: bool) {
    out.extend(std::iter::repeat_with(|| (Box::<[u8]>::from(key), write)).take(n));
}

#[test]
fn no_alarm_before_the_first_epoch_nor_when_idle() {
    let mut h = policy();
    assert_eq!(h.alarm_limit(), None, "no epoch yet");
    let mut s = Vec::new();
    sampled(&mut s, b"new", 500, false);
    assert!(h.on_alarm(0, &s, 0.25, &[], 0.0).is_empty());
    // The cluster under the balancer's minimum load: nothing is hot.
    h.on_epoch(&snapshot(1, &[10.0, 10.0]), &ClusterView { avg_load: Some(10.0), ..VIEW });
    assert_eq!(h.alarm_limit(), None);
    assert!(h.on_alarm(0, &s, 0.25, &[], 0.0).is_empty());
    assert_eq!(h.state(b"new"), S::Invalid);
    // One server: no shadows, no alarm.
    h.on_epoch(&snapshot(2, &[1000.0, 1000.0]), &ClusterView::uniform(0, 1, 2, VIEW.avg_load));
    assert_eq!(h.alarm_limit(), None);
}

#[test]
fn an_alarm_replicates_a_new_hot_key_within_the_epoch() {
    let mut h = policy();
    // A balanced epoch: the alarm limit is target × the cluster's mean.
    feed(&mut h, 1, &[]);
    h.on_epoch(&snapshot(1, &[1000.0, 1000.0]), &VIEW);
    assert_eq!(h.alarm_limit(), Some(1100.0));
    // A quarter of an epoch later worker 0 runs hot: a new key carries
    // 200 of its sampled reads (800/s), noise keys a sample or two.
    let mut s = Vec::new();
    sampled(&mut s, b"new", 200, false);
    sampled(&mut s, b"warm", 2, false);
    for j in 0..50 {
        sampled(&mut s, format!("noise{j}").as_bytes(), 1, false);
    }
    let r = h.on_alarm(0, &s, 0.25, &[], 0.0).replicate;
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!((r[0].key.as_slice(), r[0].worker), (&b"new"[..], 0));
    assert!(r[0].replicas >= 1);
    assert_eq!(h.state(b"new"), S::HotPending);
    assert_eq!(h.hint(b"new"), 0, "no lease before the copies exist");
    assert_eq!(h.state(b"warm"), S::Invalid, "under min_samples: noise, not even tracked");
    assert_eq!(h.top(1)[0].reads_per_sec, 800.0, "its rate in the window");
    // Then the usual edges: copies made, leases granted, and the epoch's
    // end carries on from there (it is not replicated twice).
    assert_eq!(h.replicas_ready(b"new"), Some(T::ReplicasReady));
    assert_eq!(h.hint(b"new"), r[0].replicas);
    feed(&mut h, 2, &[(b"new", 800.0 / f64::from(r[0].replicas + 1), 0.0)]);
    let d = h.on_epoch(&snapshot(2, &[2000.0, 1000.0]), &VIEW);
    // (Its worker is still hot, so its copies may grow, never start over.)
    assert!(d.replicate.iter().filter(|x| x.key == b"new").all(|x| x.replicas > r[0].replicas), "{d:?}");
    assert!(!d.transitions.contains(&(b"new".to_vec(), T::Replicate)), "{d:?}");
    assert!(matches!(h.state(b"new"), S::Hot | S::HotPending), "HOT, or growing");
}

#[test]
fn an_alarm_leaves_replicated_and_write_heavy_keys_alone_and_keeps_repl_high() {
    let cfg =
        HotConfig { sample_rate: 1.0, sample_target: 0.0, decay: 0.0, repl_high: Some(2), ..HotConfig::default() };
    let mut h = HotKeys::new(cfg, Config::default());
    let (_, g) = make_hot(&mut h);
    assert_eq!(h.state(b"hot"), S::Hot);
    let mut s = Vec::new();
    // The HOT key is hotter than ever: growth is the epoch's business.
    sampled(&mut s, b"hot", 400, false);
    sampled(&mut s, b"a", 300, false);
    sampled(&mut s, b"b", 200, false);
    sampled(&mut s, b"counter", 100, false);
    sampled(&mut s, b"counter", 100, true);
    let r = h.on_alarm(0, &s, 0.25, &[], 0.0);
    assert!(r.retire.is_empty(), "{r:?}");
    let keys: Vec<&[u8]> = r.replicate.iter().map(|x| &x.key[..]).collect();
    assert_eq!(keys, [&b"a"[..]], "one slot left under REPL_high 2, hottest first: {r:?}");
    assert_eq!(h.hint(b"hot"), g, "the HOT key keeps its copies and leases");
    assert_eq!(h.state(b"b"), S::Invalid);
    assert_eq!(h.state(b"counter"), S::Invalid, "write-heavy: never copied");
    assert_eq!(h.replicated(), 2);
}

/// With REPL_high full, an alarm displaces a HOT key of the alarming
/// worker whose home has served none of its reads so far in the epoch
/// (exact counts: its readers left) for a new key twice as hot; a key of
/// that worker still read, and a key of another worker (whose counts the
/// alarm does not carry), keep their slots.
#[test]
fn an_alarm_displaces_a_key_whose_readers_left() {
    let cfg =
        HotConfig { sample_rate: 1.0, sample_target: 0.0, decay: 0.0, repl_high: Some(3), ..HotConfig::default() };
    let mut h = HotKeys::new(cfg, Config::default());
    feed(&mut h, 1, &[(b"a", 900.0, 0.0), (b"b", 800.0, 0.0)]);
    for _ in 0..400 {
        h.observe(b"c", Access::Read, 1);
    }
    h.on_epoch(&snapshot(1, &[3000.0, 1500.0]), &VIEW);
    for k in [&b"a"[..], b"b", b"c"] {
        assert_eq!(h.state(k), S::HotPending, "{}", String::from_utf8_lossy(k));
        h.replicas_ready(k);
    }
    let (ga, gb) = (h.hint(b"a"), h.hint(b"b"));
    // A quarter into the next epoch worker 0 runs hot with a new key at
    // 1,200/s; a's home served its share, b's none; c is worker 1's.
    let mut s = Vec::new();
    sampled(&mut s, b"new", 300, false);
    let home: Vec<(Box<[u8]>, u64)> =
        vec![(b"a"[..].into(), (900.0 / f64::from(ga + 1) * 0.25) as u64), (b"b"[..].into(), 0)];
    // Without the home's counts nothing can be displaced: REPL_high is full.
    assert!(h.on_alarm(0, &s, 0.25, &[], 0.0).is_empty());
    let r = h.on_alarm(0, &s, 0.25, &home, 0.25);
    let keys: Vec<&[u8]> = r.replicate.iter().map(|x| &x.key[..]).collect();
    assert_eq!(keys, [&b"new"[..]], "{r:?}");
    assert_eq!(h.state(b"b"), S::Cold, "b gave way, its copies deleted at once");
    assert_eq!(r.retire, [Retire { key: b"b".to_vec(), worker: 0, replicas: gb }], "{r:?}");
    assert_eq!(h.replicated(), 3, "REPL_high holds for the keys with copies");
    assert_eq!((h.state(b"a"), h.hint(b"a")), (S::Hot, ga), "a, still read, keeps its slot");
    assert_eq!(h.state(b"c"), S::Hot, "another worker's key is not judged");
    assert!(gb >= 1);
}

#[test]
fn the_sampling_rate_follows_a_target_count_per_worker_within_bounds() {
    // 100 samples per worker and epoch: 1/7 at the testbed's 700
    // requests/s, the floor at a real worker's 1M, the ceiling when idle
    // or nearly.
    let r = |per_worker| sample_rate_for(100.0, per_worker, 0.0001, 0.25);
    assert!((r(700.0) - 100.0 / 700.0).abs() < 1e-12);
    assert_eq!(r(1e6), 0.0001);
    assert_eq!(r(1e9), 0.0001);
    assert_eq!(r(100.0), 0.25);
    assert_eq!(r(0.0), 0.25);
    // Bounds out of order or out of range cannot give a rate above 1 or
    // at 0.
    assert_eq!(sample_rate_for(100.0, 10.0, 0.5, 2.0), 1.0);
    assert!(sample_rate_for(0.0, 10.0, 0.0, 0.1) > 0.0);
}

#[test]
fn with_a_sample_target_each_epoch_is_read_at_the_rate_in_force_during_it() {
    let cfg = HotConfig { decay: 0.0, ..HotConfig::default() };
    assert_eq!(cfg.sample_target, 100.0, "the default");
    let mut h = HotKeys::new(cfg, Config::default());
    assert_eq!(h.sample_rate(), 0.03, "until the first epoch's loads are known");
    // Epoch 1 sampled at 3%: 30 samples of a key are 1,000 requests/s.
    for _ in 0..30 {
        h.observe(b"k", Access::Read, 0);
    }
    h.on_epoch(&snapshot(1, &[1000.0, 1000.0]), &VIEW);
    assert!((h.top(1)[0].reads_per_sec - 1000.0).abs() < 1e-9);
    // From now on 100 / 1,000 = 10%: the same 30 samples are 300/s.
    assert!((h.sample_rate() - 0.1).abs() < 1e-12);
    for _ in 0..30 {
        h.observe(b"k", Access::Read, 0);
    }
    h.on_epoch(&snapshot(2, &[4000.0, 4000.0]), &VIEW);
    // (Its rate falls by at most half an epoch: max(300, 500).)
    assert!((h.top(1)[0].reads_per_sec - 500.0).abs() < 1e-9, "{:?}", h.top(1));
    assert!((h.sample_rate() - 0.025).abs() < 1e-12);
    // The noise floor moves with the rate: at 2.5%, 3 samples are 120/s.
    for _ in 0..3 {
        h.observe(b"three", Access::Read, 0);
    }
    h.on_epoch(&snapshot(3, &[4000.0, 4000.0]), &VIEW);
    let three = h.top(8).into_iter().find(|k| k.key == b"three").expect("tracked");
    assert!((three.reads_per_sec - 120.0).abs() < 1e-9);
    // An alarm's window is read at the rate in force too.
    let mut s = Vec::new();
    sampled(&mut s, b"new", 10, false);
    let r = h.on_alarm(0, &s, 0.25, &[], 0.0);
    let new = h.top(8).into_iter().find(|k| k.key == b"new");
    assert!(r.is_empty() || (new.expect("tracked").reads_per_sec - 1600.0).abs() < 1e-9);
}

#[test]
fn a_fixed_sampling_rate_stays_fixed() {
    let cfg = HotConfig { sample_rate: 0.05, sample_target: 0.0, decay: 0.0, ..HotConfig::default() };
    let mut h = HotKeys::new(cfg, Config::default());
    for e in 1..4 {
        h.on_epoch(&snapshot(e, &[100.0 * e as f64, 5000.0]), &VIEW);
        assert_eq!(h.sample_rate(), 0.05);
    }
}

#[test]
fn displacement_spares_a_hot_key_with_one_quiet_epoch_at_a_time() {
    let cfg = HotConfig {
        sample_rate: 1.0,
        sample_target: 0.0,
        decay: 0.0,
        repl_high: Some(2),
        displace: true,
        // Without the homes' exact counts (judged by the samples).
        displace_quiet: 2,
        ..HotConfig::default()
    };
    let mut h = HotKeys::new(cfg, Config::default());
    feed(&mut h, 1, &[(b"a", 900.0, 0.0), (b"b", 800.0, 0.0)]);
    h.on_epoch(&snapshot(1, &[3000.0, 900.0]), &VIEW);
    h.replicas_ready(b"a");
    h.replicas_ready(b"b");
    let (ga, gb) = (h.hint(b"a"), h.hint(b"b"));
    // b's home sees none of its reads every other epoch (sampling noise:
    // the home sees 1/(γ+1) of them); c waits, much hotter.
    for e in 2..10 {
        let b = if e % 2 == 0 { 1.0 } else { 800.0 / f64::from(gb + 1) };
        feed(&mut h, e, &[(b"a", 900.0 / f64::from(ga + 1), 0.0), (b"b", b, 0.0), (b"c", 2000.0, 0.0)]);
        let d = h.on_epoch(&snapshot(e, &[3000.0, 900.0]), &VIEW);
        assert_eq!((h.state(b"a"), h.state(b"b"), h.state(b"c")), (S::Hot, S::Hot, S::Cold), "epoch {e}: {d:?}");
    }
}

/// Two slots (REPL_high 2), every access sampled, and keys a (900/s) and b (800/s)
/// replicated after epoch 1.
fn a_and_b_replicated() -> HotKeys {
    let cfg =
        HotConfig { sample_rate: 1.0, sample_target: 0.0, decay: 0.0, repl_high: Some(2), ..HotConfig::default() };
    let mut h = HotKeys::new(cfg, Config::default());
    feed(&mut h, 1, &[(b"a", 900.0, 0.0), (b"b", 800.0, 0.0)]);
    h.on_epoch(&snapshot(1, &[3000.0, 900.0]), &VIEW);
    h.replicas_ready(b"a");
    h.replicas_ready(b"b");
    h
}

/// The homes count a HOT key's reads exactly and report them each epoch:
/// a key whose readers left gives its slot to a waiting, much hotter key
/// at the end of the first epoch after the shift (by default), though its
/// copies' counts, which come an epoch late, still say it is hot; a key
/// still read keeps its slot, epoch after epoch, without sampling noise.
#[test]
fn exact_home_reads_free_a_shifted_keys_slot_in_the_first_epoch() {
    let mut h = a_and_b_replicated();
    let (ga, gb) = (f64::from(h.hint(b"a")), f64::from(h.hint(b"b")));
    assert!(ga >= 1.0 && gb >= 1.0);
    let (home_a, home_b) = ((900.0 / (ga + 1.0)).round(), (800.0 / (gb + 1.0)).round());
    // Settled: both read, c not yet there; the copies report last epoch's reads.
    for e in 2..4 {
        feed(&mut h, e, &[(b"a", home_a, 0.0), (b"b", home_b, 0.0)]);
        h.home_reads(b"a", home_a as u64);
        h.home_reads(b"b", home_b as u64);
        h.copy_reads(b"a", (900.0 - home_a) as u64);
        h.copy_reads(b"b", (800.0 - home_b) as u64);
        h.on_epoch(&snapshot(e, &[3000.0, 900.0]), &VIEW);
        assert_eq!((h.state(b"a"), h.state(b"b")), (S::Hot, S::Hot));
    }
    // The shift: b's readers leave, c turns up at 2,000/s. b's home saw none
    // of its reads (exact), its copies still report the epoch before's.
    feed(&mut h, 4, &[(b"a", home_a, 0.0), (b"c", 2000.0, 0.0)]);
    h.home_reads(b"a", home_a as u64);
    h.home_reads(b"b", 0);
    h.copy_reads(b"a", (900.0 - home_a) as u64);
    h.copy_reads(b"b", (800.0 - home_b) as u64);
    let d = h.on_epoch(&snapshot(4, &[3000.0, 900.0]), &VIEW);
    assert_eq!(h.state(b"b"), S::Cold, "b gives way at once, its copies deleted now: {d:?}");
    assert!(d.retire.iter().any(|r| r.key == b"b"), "{d:?}");
    assert_eq!(d.replicated, 2, "{d:?}");
    assert_eq!(h.state(b"c"), S::HotPending, "c is replicated in the same epoch: {d:?}");
    assert_eq!(h.state(b"a"), S::Hot, "a, still read, stays: {d:?}");
    assert!(d.replicate.iter().any(|r| r.key == b"c"), "{d:?}");
    // The same shift judged by the samples only (no exact counts): b's
    // copies' late count keeps it for another epoch.
    let mut h = a_and_b_replicated();
    feed(&mut h, 2, &[(b"a", home_a, 0.0), (b"c", 2000.0, 0.0)]);
    h.copy_reads(b"a", (900.0 - home_a) as u64);
    h.copy_reads(b"b", (800.0 - home_b) as u64);
    h.on_epoch(&snapshot(2, &[3000.0, 900.0]), &VIEW);
    assert_eq!((h.state(b"b"), h.state(b"c")), (S::Hot, S::Cold));
}

#[test]
fn a_hot_keys_rate_is_measured_from_its_copies_reads_when_they_report() {
    let cfg = HotConfig { sample_rate: 1.0, sample_target: 0.0, decay: 0.0, max_fall: 1.0, ..HotConfig::default() };
    let mut h = HotKeys::new(cfg, Config::default());
    feed(&mut h, 1, &[(b"a", 900.0, 0.0)]);
    h.on_epoch(&snapshot(1, &[1800.0, 200.0]), &VIEW);
    h.replicas_ready(b"a");
    assert_eq!(h.state(b"a"), S::Hot);
    let g = f64::from(h.hint(b"a"));
    assert!(g >= 1.0);
    let rate = |h: &HotKeys| h.top(1000).into_iter().find(|s| s.key == b"a").map(|s| s.reads_per_sec);
    // The home sees its share; the copies report theirs: 900 in all.
    let home = (900.0 / (g + 1.0)).round();
    feed(&mut h, 2, &[(b"a", home, 0.0)]);
    h.copy_reads(b"a", (900.0 - home) as u64);
    h.on_epoch(&snapshot(2, &[1800.0, 200.0]), &VIEW);
    assert!((rate(&h).unwrap() - 900.0).abs() < 1.0, "{:?}", rate(&h));
    // The copies' readers left: measured, not the home's share x (γ + 1).
    feed(&mut h, 3, &[(b"a", home, 0.0)]);
    h.copy_reads(b"a", 0);
    h.on_epoch(&snapshot(3, &[1800.0, 200.0]), &VIEW);
    assert!((rate(&h).unwrap() - home).abs() < 1.0, "{:?} (home {home})", rate(&h));
    // Without a report the rate is inferred as before.
    feed(&mut h, 4, &[(b"a", home, 0.0)]);
    h.on_epoch(&snapshot(4, &[1800.0, 200.0]), &VIEW);
    if h.state(b"a") == S::Hot {
        let g = f64::from(h.hint(b"a"));
        assert!((rate(&h).unwrap() - home * (g + 1.0)).abs() < 1.0, "{:?}", rate(&h));
    }
    // Read only from its copies this epoch: still measured.
    if h.state(b"a") == S::Hot {
        feed(&mut h, 5, &[]);
        h.copy_reads(b"a", 700);
        h.on_epoch(&snapshot(5, &[1800.0, 200.0]), &VIEW);
        assert!((rate(&h).unwrap() - 700.0).abs() < 1.0, "{:?}", rate(&h));
    }
}

/// With REPL_high full, a key already retiring (COLD_PENDING: here its
/// copies were lost) gives its slot to a waiting key at once, its copies
/// deleted now rather than after its leases: the keys with copies stay
/// within REPL_high. Without displacement the waiting key waits for the
/// retirement after the leases.
#[test]
fn a_retiring_key_makes_room_at_once_and_the_keys_with_copies_stay_within_the_cap() {
    for displace in [true, false] {
        let cfg = HotConfig {
            sample_rate: 1.0,
            sample_target: 0.0,
            decay: 0.0,
            repl_high: Some(2),
            displace,
            ..HotConfig::default()
        };
        let mut h = HotKeys::new(cfg, Config::default());
        feed(&mut h, 1, &[(b"a", 900.0, 0.0), (b"b", 800.0, 0.0)]);
        h.on_epoch(&snapshot(1, &[3000.0, 900.0]), &VIEW);
        h.replicas_ready(b"a");
        h.replicas_ready(b"b");
        let (ga, gb) = (f64::from(h.hint(b"a")), f64::from(h.hint(b"b")));
        assert_eq!(h.copies_lost(b"b"), Some(T::Cool));
        assert_eq!(h.state(b"b"), S::ColdPending);
        let mut c_at = None;
        for e in 2..8 {
            feed(&mut h, e, &[(b"a", 900.0 / (ga + 1.0), 0.0), (b"b", 800.0 / (gb + 1.0), 0.0), (b"c", 2000.0, 0.0)]);
            let d = h.on_epoch(&snapshot(e, &[3000.0, 900.0]), &VIEW);
            assert!(d.replicated <= 2, "epoch {e}: {d:?}");
            assert_eq!(d.replicated, h.replicated());
            if d.replicate.iter().any(|r| r.key == b"c") {
                assert!(d.retire.iter().any(|r| r.key == b"b"), "b's copies go in the same epoch: {d:?}");
                c_at.get_or_insert(e);
                h.replicas_ready(b"c");
            }
        }
        assert_eq!(h.state(b"a"), S::Hot);
        assert_eq!(h.state(b"c"), S::Hot);
        let lease = u64::from(HotConfig::default().lease_epochs);
        assert_eq!(c_at, Some(if displace { 2 } else { 2 + lease }), "displace {displace}");
    }
}

/// A hot set that shifts every few epochs, with alarms between the
/// epochs: after every epoch and every alarm the keys with copies (HOT,
/// HOT_PENDING, COLD_PENDING) are within REPL_high, and every key the
/// policy retired at once is COLD with no copies.
#[test]
fn the_keys_with_copies_never_pass_repl_high_while_the_hot_set_shifts() {
    let cap = 3;
    let cfg =
        HotConfig { sample_rate: 1.0, sample_target: 0.0, decay: 0.0, repl_high: Some(cap), ..HotConfig::default() };
    let mut h = HotKeys::new(cfg, Config::default());
    let mut displaced = 0;
    for e in 1..40u64 {
        // Sets of 4 keys (one more than the cap), the set changing every 4 epochs.
        let set = e / 4;
        let keys: Vec<Vec<u8>> = (0..4).map(|i| format!("k{set}-{i}").into_bytes()).collect();
        let rates = [2400.0, 1800.0, 1500.0, 1200.0];
        let mut hot: Vec<(&[u8], f64, f64)> = Vec::new();
        for (k, f) in keys.iter().zip(rates) {
            // The home sees 1/(γ+1) of a HOT key's reads, and counts them exactly.
            let g = f64::from(h.hint(k));
            hot.push((k, (f / (g + 1.0)).round(), 0.0));
            if h.state(k) == S::Hot {
                h.home_reads(k, (f / (g + 1.0)).round() as u64);
            }
        }
        let left: Vec<Vec<u8>> =
            h.keys.iter().filter(|(k, e)| e.state == S::Hot && !keys.contains(k)).map(|(k, _)| k.clone()).collect();
        for k in left {
            // The old set's readers left: their homes serve none of their reads.
            h.home_reads(&k, 0);
        }
        // An alarm a quarter into the epoch, with the new set's samples.
        let mut s = Vec::new();
        for (k, f) in keys.iter().zip(rates) {
            if h.state(k) != S::Hot {
                sampled(&mut s, k, (f / 4.0) as usize, false);
            }
        }
        let home: Vec<(Box<[u8]>, u64)> = h
            .keys
            .iter()
            .filter(|(_, e)| e.state == S::Hot)
            .map(|(k, e)| {
                let f = keys.iter().zip(rates).find(|(x, _)| *x == k).map_or(0.0, |(_, f)| f);
                (k.as_slice().into(), (f / f64::from(e.replicas + 1) / 4.0) as u64)
            })
            .collect();
        let a = h.on_alarm(0, &s, 0.25, &home, 0.25);
        assert!(h.replicated() <= cap, "after the alarm of epoch {e}: {a:?}");
        for r in &a.replicate {
            h.replicas_ready(&r.key);
        }
        for r in &a.retire {
            assert_eq!(h.state(&r.key), S::Cold, "{r:?}");
            displaced += 1;
        }
        feed(&mut h, e, &hot);
        let d = h.on_epoch(&snapshot(e, &[6000.0, 900.0]), &VIEW);
        assert!(d.replicated <= cap, "epoch {e}: {d:?}");
        for r in &d.replicate {
            h.replicas_ready(&r.key);
        }
        for r in &d.retire {
            assert_eq!(h.state(&r.key), S::Cold, "{r:?}");
            displaced += 1;
        }
    }
    assert!(displaced >= 10, "the shifts retired old keys: {displaced}");
}

/// A worker that stays hot with its keys over T replicated (the keys under
/// T do not sit evenly, as the estimate takes them to): T for its keys is
/// pressed down epoch by epoch, so its replicated keys grow copies and
/// cooler keys qualify, never one under `PRESS_MIN_SHARE` of the mean;
/// at the mean the multiplier rises back.
#[test]
fn a_worker_that_stays_hot_presses_its_t_down_and_relaxes_at_the_mean() {
    let mut h = policy();
    let mut copies_a = Vec::new();
    let mut b_from = None;
    for e in 1..=8u64 {
        // Each key's reads as its home samples them: 1/(copies + 1) of a HOT key's.
        let home = |k: &[u8], f: f64| f / f64::from(h.hint(k) + 1);
        let keys: [(&[u8], f64, f64); 3] =
            [(b"a", home(b"a", 300.0), 0.0), (b"b", home(b"b", 25.0), 0.0), (b"c", 6.0, 0.0)];
        feed(&mut h, e, &keys);
        let d = h.on_epoch(&snapshot(e, &[1300.0, 1000.0]), &VIEW);
        for r in &d.replicate {
            h.replicas_ready(&r.key);
        }
        let m = PRESS_STEP.powi(e as i32).max(PRESS_FLOOR);
        assert!((h.press_of(0) - m).abs() < 1e-9, "epoch {e}: {}", h.press_of(0));
        assert_eq!(h.press_of(1), 1.0);
        copies_a.push(h.hint(b"a"));
        if b_from.is_none() && h.state(b"b") == S::Hot {
            b_from = Some(e);
        }
        assert_ne!(h.state(b"c"), S::Hot, "6/s is under 1% of the mean: never worth a copy");
        assert!(d.replicate.iter().all(|r| r.key != b"c"));
    }
    assert!(copies_a.windows(2).all(|w| w[0] <= w[1]), "{copies_a:?}");
    assert!(copies_a[7] > copies_a[0], "a's copies grew: {copies_a:?}");
    assert!(b_from.is_some_and(|e| e >= 2), "b qualified once T was pressed: {b_from:?}");
    // Between the mean and the limit the multiplier holds; at the mean it rises.
    let held = h.press_of(0);
    feed(&mut h, 9, &[]);
    h.on_epoch(&snapshot(9, &[1050.0, 1000.0]), &VIEW);
    assert_eq!(h.press_of(0), held);
    feed(&mut h, 10, &[]);
    h.on_epoch(&snapshot(10, &[1000.0, 1000.0]), &VIEW);
    assert!((h.press_of(0) - (held / PRESS_STEP).min(1.0)).abs() < 1e-9);
}

/// A key replicated because its worker stayed hot (its T pressed down)
/// cools at that pressed T: when the worker, relieved by its copies,
/// relaxes to the mean, the key (at 15/s, under half the server's T of
/// about 40/s) keeps them while its rate holds, and is retired (and starts
/// over at its worker's T) only once its rate falls.
#[test]
fn a_key_replicated_under_press_cools_at_the_pressed_t() {
    let mut h = policy();
    let mut epoch = 0;
    let run = |h: &mut HotKeys, epoch: &mut u64, b: f64, loads: &[f64]| {
        *epoch += 1;
        let home = |k: &[u8], f: f64| f / f64::from(h.hint(k) + 1);
        let keys: [(&[u8], f64, f64); 2] = [(b"a", home(b"a", 300.0), 0.0), (b"b", home(b"b", b), 0.0)];
        feed(h, *epoch, &keys);
        let d = h.on_epoch(&snapshot(*epoch, loads), &VIEW);
        for r in &d.replicate {
            h.replicas_ready(&r.key);
        }
    };
    while h.state(b"b") != S::Hot {
        run(&mut h, &mut epoch, 15.0, &[1300.0, 1000.0]);
        assert!(epoch < 10, "b was never replicated under press");
    }
    assert!(h.keys[&b"b"[..]].pressed_share.is_finite());
    // Relieved: the worker is at the mean, its multiplier back to 1.
    for _ in 0..12 {
        run(&mut h, &mut epoch, 15.0, &[1000.0, 1000.0]);
        assert_eq!(h.state(b"b"), S::Hot, "epoch {epoch}: b kept its copies while its rate held");
    }
    assert_eq!(h.press_of(0), 1.0);
    // Its readers leave: it cools, is retired, and forgets the press.
    for _ in 0..12 {
        run(&mut h, &mut epoch, 1.0, &[1000.0, 1000.0]);
    }
    assert!(matches!(h.state(b"b"), S::Cold | S::Invalid), "{:?}", h.state(b"b"));
    if let Some(e) = h.keys.get(&b"b"[..]) {
        assert_eq!(e.pressed_share, f64::INFINITY);
    }
}

/// When the keys left unreplicated already meet the target (the server's
/// cooling line infinite: no key needs a copy), a key replicated only
/// because its worker stayed hot is not retired at the next epoch and
/// replicated again at the one after: it keeps its copies while its worker
/// is hot and its rate holds.
#[test]
fn a_key_admitted_under_press_does_not_churn_when_no_key_needs_a_copy() {
    let mut h = policy();
    let mut heated = 0;
    let mut hot_from = None;
    for e in 1..=14u64 {
        // Forty keys of 12/s each on worker 0: a hot partition, no hot key.
        let names: Vec<Vec<u8>> = (0..40).map(|i| format!("p{i}").into_bytes()).collect();
        let keys: Vec<(&[u8], f64, f64)> =
            names.iter().map(|k| (&k[..], 12.0 / f64::from(h.hint(k) + 1), 0.0)).collect();
        feed(&mut h, e, &keys);
        let d = h.on_epoch(&snapshot(e, &[1300.0, 1000.0]), &VIEW);
        assert!(d.unreplicated_max_over_avg <= 1.1, "{}", d.unreplicated_max_over_avg);
        heated += d.transitions.iter().filter(|(_, t)| *t == KeyTransition::Replicate).count();
        for r in &d.replicate {
            h.replicas_ready(&r.key);
        }
        if hot_from.is_none() && h.state(b"p0") == S::Hot {
            hot_from = Some(e);
        }
        if let Some(from) = hot_from.filter(|f| e > *f) {
            assert_eq!(h.state(b"p0"), S::Hot, "epoch {e}: replicated at {from}, then retired");
        }
    }
    assert!(hot_from.is_some(), "the pressed T never reached the partition's keys");
    assert!(heated <= 40, "keys were replicated more than once: {heated}");
}

/// A key the epoch left waiting for a slot is reported as waiting (its
/// heat, for lending) until an alarm gives it a slot, and not after.
#[test]
fn a_key_an_alarm_admits_is_no_longer_reported_waiting() {
    let mut h = policy();
    h.set_repl_high(Some(0));
    feed(&mut h, 1, &[(b"w", 800.0, 0.0)]);
    let d = h.on_epoch(&snapshot(1, &[2000.0, 1000.0]), &VIEW);
    assert!(d.replicate.is_empty());
    assert_eq!(h.slot_heat().waiting, vec![800.0]);
    // A slot was lent; the worker is still hot, and the key still hot.
    h.set_repl_high(Some(1));
    let mut s = Vec::new();
    sampled(&mut s, b"w", 200, false);
    let r = h.on_alarm(0, &s, 0.25, &[], 0.0).replicate;
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(h.slot_heat().waiting.is_empty(), "{:?}", h.slot_heat());
    assert_eq!(h.slot_heat().held.len(), 1);
}
