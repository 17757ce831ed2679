use super::*;

fn hotpart_1x4() -> SimArgs {
    SimArgs {
        servers: 1,
        workers: 4,
        workload: Dist::Hotpart,
        load: 0.7,
        epochs: 50,
        settle: Some(10.0),
        ..SimArgs::defaults()
    }
}

fn json_of(a: &SimArgs) -> Vec<u8> {
    let mut buf = Vec::new();
    simulate(a, Some(&mut buf)).unwrap();
    buf
}

#[test]
fn the_same_seed_gives_the_same_output_byte_for_byte() {
    let a = SimArgs { epochs: 16, seed: 7, shift_at: vec![4.0], ..hotpart_1x4() };
    let x = json_of(&a);
    assert_eq!(x, json_of(&a));
    assert!(x.len() > 1000);
    let other = json_of(&SimArgs { seed: 8, ..a.clone() });
    assert_ne!(x, other, "another seed, other draws");
}

#[test]
fn phase_2_brings_a_hot_partition_down_and_off_stays_skewed() {
    let runs = simulate(&hotpart_1x4(), None).unwrap();
    let (off, on) = (&runs[0].summary, &runs[1].summary);
    assert_eq!((off.run, on.run), ("off", "on"));
    // The testbed's figure: 2.40 off, 1.05 on (docs/benchmarks.md §10).
    assert!(off.max_over_avg > 2.0, "off: {off:?}");
    assert_eq!(off.moves, 0);
    assert!(on.max_over_avg < 1.15, "on: {on:?}");
    assert!(on.moves > 0 && on.moves < 10, "{on:?}");
    assert!(on.settle_time.is_some_and(|t| t < 10.0), "{on:?}");
    assert!(on.p99_us < off.p99_us / 10.0, "{on:?} {off:?}");
    // Every epoch decided by Phase 2 (once per second) on the on run only.
    let decided = |r: &RunResult| r.epochs.iter().map(|e| e.states.values().sum::<u64>()).sum::<u64>();
    assert_eq!(decided(&runs[0]), 0);
    assert_eq!(decided(&runs[1]), 25);
}

#[test]
fn requests_are_conserved_and_loads_follow_the_moves() {
    let a = SimArgs { balancer: Runs::On, epochs: 20, ..hotpart_1x4() };
    let load_cap = 4.0 * a.worker_capacity * 0.5;
    let r = &simulate(&a, None).unwrap()[0];
    for e in &r.epochs {
        assert_eq!(e.loads.len(), 4);
        let sum: u64 = e.loads.iter().sum();
        assert!((sum as f64 - e.served).abs() <= 4.0, "{e:?}");
        assert!(e.loads.iter().all(|&l| l as f64 <= 2_000.0 + 1.0), "capped at the capacity: {e:?}");
    }
    // Offered 5,600/s on average.
    let offered: f64 = r.epochs.iter().map(|e| e.offered).sum::<f64>() / r.epochs.len() as f64;
    assert!((offered - 5_600.0).abs() < 100.0, "{offered}");
    assert!(r.epochs.last().unwrap().served > load_cap, "served once balanced");
}

#[test]
fn a_shift_moves_the_hot_partition_and_the_balancer_follows() {
    let a = SimArgs { balancer: Runs::On, epochs: 60, shift_at: vec![15.0], ..hotpart_1x4() };
    let r = &simulate(&a, None).unwrap()[0];
    let at = |t: f64| r.epochs.iter().find(|e| (e.t - t).abs() < 1e-9).unwrap();
    assert_eq!(at(15.0).hot_set, 0);
    assert_eq!(at(15.5).hot_set, 1);
    assert!(at(14.5).max_over_avg < 1.15, "{:?}", at(14.5));
    assert!(at(16.0).max_over_avg > 1.5, "the new hot worker: {:?}", at(16.0));
    let later: Vec<f64> = r.epochs.iter().filter(|e| e.t > 25.0 && e.t <= 30.0).map(|e| e.max_over_avg).collect();
    let mean = later.iter().sum::<f64>() / later.len() as f64;
    assert!(mean < 1.12, "settled again: {later:?}");
}

#[test]
fn every_cores_map_agrees_with_where_the_sim_serves_its_cachelets() {
    let a = SimArgs { servers: 8, workers: 2, epochs: 30, balancer: Runs::On, ..SimArgs::defaults() };
    let cachelets = 8 * 2 * a.cachelets_per_worker;
    let map0 = even_map(8, 2, a.cachelets_per_worker, mbal_cluster::DEFAULT_VN_COUNT);
    let load = Load::of(&a, &map0, false).unwrap();
    let mut sim = Sim::new(&a, &load, &map0, "on", Phases { p1: false, p2: true, p3: false }).unwrap();
    let recs = sim.run(|_| Ok(())).unwrap();
    let moved = (0..cachelets).filter(|&c| sim.owner[c as usize] != map0.owner(c)).count();
    assert!(moved > 0, "Phase 2 moved cachelets");
    assert!(sim.pending.is_empty() || recs.last().unwrap().moves_started > 0);
    for (s, core) in sim.cores.iter().enumerate() {
        for c in 0..cachelets {
            if map0.owner(c).0 == s as u16 && sim.pending.iter().all(|p| p.0.cachelet != c) {
                assert_eq!(core.map().owner(c), sim.owner[c as usize], "server {s} cachelet {c}");
            }
        }
    }
    // Phase 2 evens each server's own workers (not the servers: that is Phase 1's or 3's).
    let first = &recs[1];
    let last = recs.iter().rev().take(10).map(|r| r.server_max_over_avg).sum::<f64>() / 10.0;
    assert!(last < first.server_max_over_avg, "{last} against {}", first.server_max_over_avg);
}

/// 8 x 2, half the requests on the cachelets of one server, 50/50: only Phase 3 can help
/// (Phase 1 off: these are Phase 3's tests).
fn hot_server_8x2() -> SimArgs {
    SimArgs {
        phase1: Runs::Off,
        servers: 8,
        workers: 2,
        workload: Dist::Hotserver,
        read_ratio: Some(0.5),
        epochs: 60,
        settle: Some(20.0),
        ..SimArgs::defaults()
    }
}

#[test]
fn phase_3_drains_a_hot_server_where_phase_2_cannot() {
    let runs = simulate(&SimArgs { phase3: Runs::Both, ..hot_server_8x2() }, None).unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r.summary.run).collect();
    assert_eq!(names, ["off", "phase2", "on"]);
    let (off, p2, on) = (&runs[0].summary, &runs[1].summary, &runs[2].summary);
    assert!(off.max_over_avg > 3.0, "{off:?}");
    assert!(
        p2.max_over_avg > 3.0 && p2.moves == 0 && p2.migrations == 0,
        "every worker of the hot server alike: {p2:?}"
    );
    assert!(on.max_over_avg < 1.2, "{on:?}");
    assert!(on.p99_us < off.p99_us / 100.0, "{on:?} {off:?}");
    assert!(on.served > 1.5 * off.served, "{on:?} {off:?}");
    // The hot server has 32 cachelets: a few more than the 24 that must go, not hundreds.
    assert!(on.migrations >= 20 && on.migrations <= 64, "{on:?}");
    assert_eq!(on.migrated_bytes, on.migrations * 64_000_000);
    let e = &runs[2].epochs;
    let started: u64 = e.iter().map(|r| r.migrations_started).sum();
    let ended: u64 = e.iter().map(|r| r.migrations_done + r.migrations_failed).sum();
    assert!(started >= ended && started <= ended + 2, "at most max_inflight still under way");
    assert_eq!(e.iter().map(|r| r.migrated_bytes).sum::<u64>(), on.migrated_bytes);
    // Nothing before Phase 3's persistence (3 reports over T).
    assert!(e.iter().take(2).all(|r| r.migrations_started == 0), "{:?}", &e[..3]);
}

#[test]
fn phase_3_runs_are_the_same_byte_for_byte_and_its_maps_agree() {
    let a = SimArgs { epochs: 24, balancer: Runs::On, ..hot_server_8x2() };
    let x = json_of(&a);
    assert_eq!(x, json_of(&a));
    assert!(String::from_utf8_lossy(&x).contains("\"migrations_done\":"));
    let map0 = even_map(8, 2, a.cachelets_per_worker, mbal_cluster::DEFAULT_VN_COUNT);
    let load = Load::of(&a, &map0, false).unwrap();
    let mut sim = Sim::new(&a, &load, &map0, "on", Phases { p1: false, p2: true, p3: true }).unwrap();
    sim.run(|_| Ok(())).unwrap();
    let away = (0..map0.cachelet_count()).filter(|&c| sim.owner[c as usize].0 != map0.owner(c).0).count();
    assert!(away >= 10, "cachelets changed server: {away}");
    for c in 0..map0.cachelet_count() {
        if sim.pending.iter().any(|p| p.0.cachelet == c) {
            continue;
        }
        let o = sim.owner[c as usize];
        assert_eq!(sim.cmap.owner(c), o, "the coordinator's map, cachelet {c}");
        assert_eq!(sim.cores[usize::from(o.0)].map().owner(c), o, "its server's map, cachelet {c}");
    }
    // No server's Phase 2 still holds a lease on a cachelet that left it.
    for (s, core) in sim.cores.iter().enumerate() {
        for l in core.balancer().unwrap().leases() {
            assert_eq!(sim.owner[l.cachelet as usize].0, s as u16, "{l:?}");
        }
    }
}

#[test]
fn phase_3_never_fills_a_server_past_its_memory() {
    // Room for two more 64 MB cachelets on each server.
    let a = SimArgs { balancer: Runs::On, epochs: 40, server_memory_mb: 34.0 * 64.0, ..hot_server_8x2() };
    let map0 = even_map(8, 2, a.cachelets_per_worker, mbal_cluster::DEFAULT_VN_COUNT);
    let load = Load::of(&a, &map0, false).unwrap();
    let mut sim = Sim::new(&a, &load, &map0, "on", Phases { p1: false, p2: true, p3: true }).unwrap();
    let mut most = 0;
    sim.run(|_| Ok(())).unwrap();
    for s in 0..8u16 {
        let held = sim.owner.iter().filter(|o| o.0 == s).count()
            + sim.pending.iter().filter(|p| p.0.migration() && p.0.to_server == s).count();
        assert!(held <= 34, "server {s} holds {held} cachelets of 64 MB in 34 x 64 MB");
        most = most.max(held);
    }
    assert_eq!(most, 34, "the room was used");
    assert!(sim.total_migrations >= 10, "{}", sim.total_migrations);
}

/// 8 x 2, Zipf 0.99 over 50,000 keys at 60% of capacity (docs/benchmarks.md §15's workload).
fn zipf_8x2() -> SimArgs {
    SimArgs { servers: 8, workers: 2, epochs: 40, rate: Some(19_200.0), settle: Some(10.0), ..SimArgs::defaults() }
}

#[test]
fn phase_1_copies_even_a_zipf_cluster_within_repl_high_and_the_same_seed_gives_the_same_run() {
    let a = SimArgs { runs: vec!["off".into(), "phase1".into()], ..zipf_8x2() };
    let runs = simulate(&a, None).unwrap();
    let (off, p1) = (&runs[0].summary, &runs[1].summary);
    assert_eq!((off.run, p1.run), ("off", "phase1"));
    assert!(off.max_over_avg > 1.8 && off.hot_keys_max == 0, "{off:?}");
    // The testbed: 1.97 off, 1.05-1.10 on, 75-81 keys with copies (docs/benchmarks.md §15).
    assert!(p1.max_over_avg < 1.15, "{p1:?}");
    assert_eq!((p1.moves, p1.migrations), (0, 0), "Phase 1 alone");
    // REPL_high: floor(2 n ln n) keys for the cluster's n = 16 workers.
    let repl_high = (2.0 * 16.0 * 16f64.ln()).floor() as u64;
    assert!(p1.hot_keys_max > 10 && p1.hot_keys_max <= repl_high, "{p1:?}");
    assert!(p1.copy_share > 0.2, "the copies serve reads: {p1:?}");
    assert!(p1.p99_us < off.p99_us / 100.0, "{p1:?} {off:?}");
    let short = SimArgs { epochs: 12, ..a };
    assert_eq!(json_of(&short), json_of(&short), "deterministic with Phase 1");
}

#[test]
fn copies_live_where_replica_location_says_and_leave_with_their_cachelet() {
    let a = SimArgs { epochs: 30, ..zipf_8x2() };
    let map0 = even_map(8, 2, a.cachelets_per_worker, mbal_cluster::DEFAULT_VN_COUNT);
    let load = Load::of(&a, &map0, true).unwrap();
    let mut sim = Sim::new(&a, &load, &map0, "phase1+2", Phases { p1: true, p2: true, p3: false }).unwrap();
    let recs = sim.run(|_| Ok(())).unwrap();
    assert!(recs.iter().map(|r| r.replicated).sum::<u64>() > 20, "copies were made");
    assert!(!sim.repl.is_empty());
    for (&(s, w, k), r) in &sim.repl.by_home {
        let c = load.cachelet_of[k as usize];
        assert_eq!(r.cachelet, c);
        assert_eq!(sim.owner[c as usize], (s, w), "key {k}: replicated from its cachelet's worker");
        let hash = mbal_cluster::key_hash(&hot::name(k, load.key_size));
        for (i, &o) in r.copies.iter().enumerate() {
            assert_eq!(Some(o), mbal_cluster::replica_location(hash, i as u32 + 1, (s, w), 8, |_| 2));
            assert_ne!(o.0, s, "a copy on another server");
        }
        let mut at = r.copies.clone();
        at.sort();
        at.dedup();
        assert_eq!(at.len(), r.copies.len(), "no two copies share a worker");
        if let Some((g, _)) = r.grant {
            assert!(g as usize <= r.copies.len(), "a lease reads existing copies: {r:?}");
        }
    }
}
