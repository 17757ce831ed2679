use super::*;
use crate::policy::EscalateWhy;

const MB: u64 = 1 << 20;

/// Server `s`'s report: per worker, its cachelets' loads (ids
/// `s * 1000 + worker * 100 + i`, half reads, half writes, 64 MB each).
fn report(s: u16, workers: &[&[f64]], mem_limit: u64) -> ServerReport {
    let mut cachelets = Vec::new();
    let mut ws = Vec::new();
    for (w, loads) in workers.iter().enumerate() {
        for (i, &l) in loads.iter().enumerate() {
            cachelets.push(CacheletReport {
                id: u32::from(s) * 1000 + w as u32 * 100 + i as u32,
                worker: w as u16,
                load: l,
                reads_per_sec: l / 2.0,
                writes_per_sec: l / 2.0,
                bytes: 64 * MB,
            });
        }
        ws.push(WorkerReport { worker: w as u16, load: loads.iter().sum(), capacity: None });
    }
    let mem_used = cachelets.iter().map(|c| c.bytes).sum();
    ServerReport { server: s, workers: ws, cachelets, mem_limit, mem_used }
}

/// Four servers x 2 workers: server 0 hot (8 x 150 per worker), 1 and 2
/// warm (4 x 50), 3 the coldest (4 x 25). Mean 275 per worker, T = 605.
fn cluster(mem_limit: u64) -> Vec<ServerReport> {
    let hot: &[f64] = &[150.0; 4];
    let warm: &[f64] = &[50.0; 4];
    let cold: &[f64] = &[25.0; 4];
    vec![
        report(0, &[hot, hot], mem_limit),
        report(1, &[warm, warm], mem_limit),
        report(2, &[warm, warm], mem_limit),
        report(3, &[cold, cold], mem_limit),
    ]
}

/// Every report, then an epoch; the migrations started.
fn epoch(p: &mut Phase3, reports: &[ServerReport]) -> Vec<Migrate> {
    let mut out = Vec::new();
    for r in reports {
        out.extend(p.step(Phase3Event::Report(r.clone())));
    }
    out.extend(p.step(Phase3Event::Epoch));
    out
}

/// Each destination's load and bytes received over the plan.
fn received(plan: &Plan3) -> BTreeMap<u16, (f64, u64)> {
    let mut m: BTreeMap<u16, (f64, u64)> = BTreeMap::new();
    for mv in &plan.moves {
        let e = m.entry(mv.to.0).or_default();
        e.0 += mv.load;
        e.1 += mv.bytes;
    }
    m
}

#[test]
fn a_hot_server_drains_to_the_coldest_first() {
    let mut p = Phase3::new(Phase3Config::default());
    let reports = cluster(0);
    // Persistence 3: nothing before the third report over T.
    assert!(epoch(&mut p, &reports).is_empty());
    assert!(epoch(&mut p, &reports).is_empty());
    let started = epoch(&mut p, &reports);
    assert_eq!(started.len(), 1, "one per source at a time: {started:?}");
    let plan = p.last_plan().unwrap().clone();
    assert_eq!(plan.sources, vec![Source::Server(0)]);
    assert_eq!(plan.iterations[0].destination, 3, "the coldest first: {plan:?}");
    assert!(plan.moves.iter().all(|m| m.from.0 == 0 && m.to.0 != 0));
    // The plan brings the source under T and fills no destination past it.
    let t = 1.1 * plan.mean * 2.0;
    let out: f64 = plan.moves.iter().map(|m| m.load).sum();
    assert!(1200.0 - out <= t + 1e-9, "{plan:?}");
    for (d, (load, _)) in received(&plan) {
        assert!(reports[usize::from(d)].load() + load <= t + 1e-9, "server {d}: {plan:?}");
    }
    // Issued biggest first, one after another as each finishes.
    let mut done = vec![started[0]];
    let mut next = started[0];
    for _ in 0..plan.moves.len() {
        let more = p.step(Phase3Event::Finished { cachelet: next.cachelet, bytes: next.bytes });
        if more.is_empty() {
            break;
        }
        assert_eq!(more.len(), 1);
        assert!(more[0].load <= next.load);
        next = more[0];
        done.push(next);
    }
    assert_eq!(done.len(), plan.moves.len());
    assert_eq!(p.inflight().count(), 0);
    let st = p.stats();
    assert_eq!((st.started, st.finished), (done.len() as u64, done.len() as u64));
    assert_eq!(st.bytes_moved, 64 * MB * done.len() as u64);
    // Each went to the destination's least loaded worker: spread over both.
    let to3: BTreeSet<u16> = done.iter().filter(|m| m.to.0 == 3).map(|m| m.to.1).collect();
    assert_eq!(to3.len(), 2, "{done:?}");
}

#[test]
fn a_plan_never_overfills_a_destination() {
    // Room for one more 64 MB cachelet on each server.
    let reports = cluster(9 * 64 * MB);
    let mut p = Phase3::new(Phase3Config { persistence: 1, ..Phase3Config::default() });
    epoch(&mut p, &reports);
    let plan = p.last_plan().unwrap();
    assert!(!plan.moves.is_empty());
    for (d, (_, bytes)) in received(plan) {
        assert!(bytes <= 64 * MB, "server {d} got {bytes} bytes: {plan:?}");
    }
    // Random clusters, memory tight or not, ILP or greedy.
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
    for round in 0..60 {
        let servers = rng.gen_range(2..6u16);
        let reports: Vec<ServerReport> = (0..servers)
            .map(|s| {
                let heat = if s == 0 { 5.0 } else { 1.0 };
                let w: Vec<Vec<f64>> = (0..2)
                    .map(|_| (0..rng.gen_range(1..6)).map(|_| heat * rng.gen_range(5.0..100.0)).collect())
                    .collect();
                let refs: Vec<&[f64]> = w.iter().map(|v| v.as_slice()).collect();
                let mut r = report(s, &refs, 0);
                for c in r.cachelets.iter_mut() {
                    c.bytes = rng.gen_range(1..200) * MB;
                }
                r.mem_used = r.cachelets.iter().map(|c| c.bytes).sum();
                r.mem_limit = if rng.gen_bool(0.8) { r.mem_used + rng.gen_range(0..300) * MB } else { 0 };
                r
            })
            .collect();
        let planner = if round % 3 == 0 { Planner::Greedy } else { Planner::Ilp };
        let mut p = Phase3::new(Phase3Config { persistence: 1, planner, ..Phase3Config::default() });
        epoch(&mut p, &reports);
        let plan = p.last_plan().unwrap();
        let t = |r: &ServerReport| 1.1 * plan.mean * r.workers.len() as f64;
        let mut ids = BTreeSet::new();
        for m in &plan.moves {
            assert!(ids.insert(m.cachelet), "moved twice: {plan:?}");
            let src = &reports[usize::from(m.from.0)];
            assert!(src.cachelets.iter().any(|c| c.id == m.cachelet && c.worker == m.from.1));
        }
        for (d, (load, bytes)) in received(plan) {
            let r = &reports[usize::from(d)];
            if r.mem_limit > 0 {
                assert!(r.mem_used + bytes <= r.mem_limit, "round {round}: server {d} over its memory: {plan:?}");
            }
            assert!(r.load() + load <= t(r) + 1e-6, "round {round}: server {d} over T: {plan:?}");
        }
    }
}

#[test]
fn the_same_input_gives_the_same_plan() {
    let run = |cfg: Phase3Config| {
        let mut p = Phase3::new(cfg);
        let mut out = Vec::new();
        for _ in 0..4 {
            out.push(epoch(&mut p, &cluster(20 * 64 * MB)));
            let first = p.inflight().next().copied();
            if let Some(m) = first {
                out.push(p.step(Phase3Event::Finished { cachelet: m.cachelet, bytes: m.bytes }));
            }
        }
        (out, p.last_plan().cloned(), p.stats())
    };
    for budget in [0, 8, 2_000] {
        let cfg = Phase3Config { ilp_node_limit: budget, ..Phase3Config::default() };
        let first = run(cfg.clone());
        assert!(first.2.started > 0);
        for _ in 0..3 {
            assert_eq!(run(cfg.clone()), first, "budget {budget}");
        }
    }
}

#[test]
fn no_move_right_after_local_moves() {
    let cfg = Phase3Config { persistence: 1, ..Phase3Config::default() };
    let mut p = Phase3::new(cfg.clone());
    let reports = cluster(0);
    // The hot server made local moves: left alone this epoch and the next.
    p.step(Phase3Event::LocalMoves { server: 0 });
    assert!(epoch(&mut p, &reports).is_empty());
    assert!(p.last_plan().unwrap().sources.is_empty());
    // Its escalation in the next epoch is not acted on either.
    let esc = Escalation { why: EscalateWhy::NoLocalPlan, sources: vec![0] };
    p.step(Phase3Event::Escalated { server: 0, escalation: esc });
    assert!(epoch(&mut p, &reports).is_empty());
    assert_eq!(epoch(&mut p, &reports).len(), 1, "then it acts");
    // A destination that just moved locally is not used: the coldest (3) is skipped.
    let mut p = Phase3::new(cfg);
    p.step(Phase3Event::LocalMoves { server: 3 });
    let started = epoch(&mut p, &reports);
    assert_eq!(started.len(), 1);
    let plan = p.last_plan().unwrap();
    assert!(plan.moves.iter().all(|m| m.to.0 != 3), "{plan:?}");
}

#[test]
fn a_cachelet_that_just_moved_stays_for_the_cooldown() {
    let mut p = Phase3::new(Phase3Config { persistence: 1, ..Phase3Config::default() });
    let reports = cluster(0);
    // Every migration fails: each cachelet stays at the source, as hot as before.
    let fail_all = |p: &mut Phase3, mut started: Vec<Migrate>| {
        while let Some(m) = started.pop() {
            started.extend(p.step(Phase3Event::Failed { cachelet: m.cachelet }));
        }
    };
    let started = epoch(&mut p, &reports);
    let first = started[0];
    fail_all(&mut p, started);
    let in_plan = |p: &Phase3| p.last_plan().unwrap().moves.iter().any(|m| m.cachelet == first.cachelet);
    for e in 0..5 {
        let started = epoch(&mut p, &reports);
        assert!(!in_plan(&p), "epoch {e}: {:?}", p.last_plan());
        fail_all(&mut p, started);
    }
    let mut p2 = p.clone();
    epoch(&mut p2, &reports);
    assert!(in_plan(&p2), "after the cooldown: {:?}", p2.last_plan());
    assert_eq!(p.stats().failed, p.stats().started);
}

#[test]
fn migrations_in_flight_are_bounded() {
    // Four hot servers and four cold ones.
    let hot: &[f64] = &[150.0; 4];
    let cold: &[f64] = &[10.0; 4];
    let reports: Vec<ServerReport> =
        (0..8).map(|s| if s < 4 { report(s, &[hot, hot], 0) } else { report(s, &[cold, cold], 0) }).collect();
    let mut p = Phase3::new(Phase3Config { persistence: 1, ..Phase3Config::default() });
    let started = epoch(&mut p, &reports);
    assert_eq!(started.len(), 2, "max_inflight 2: {started:?}");
    assert_ne!(started[0].from.0, started[1].from.0, "one per source server");
    assert!(p.last_plan().unwrap().moves.len() > 2);
    // Nothing ends: later epochs start nothing.
    for _ in 0..3 {
        assert!(epoch(&mut p, &reports).is_empty());
        assert_eq!(p.inflight().count(), 2);
    }
    // One ends: one more starts, from a source with nothing in flight.
    let more = p.step(Phase3Event::Finished { cachelet: started[0].cachelet, bytes: started[0].bytes });
    assert_eq!(more.len(), 1);
    assert_ne!(more[0].from.0, started[1].from.0);
    assert_eq!(p.inflight().count(), 2);
    let mut p = Phase3::new(Phase3Config { persistence: 1, max_inflight: 3, ..Phase3Config::default() });
    assert_eq!(epoch(&mut p, &reports).len(), 3);
}

#[test]
fn the_greedy_fallback_plans_when_the_ilp_budget_is_zero() {
    let reports = cluster(0);
    let mut ilp = Phase3::new(Phase3Config { persistence: 1, ..Phase3Config::default() });
    epoch(&mut ilp, &reports);
    let plan = ilp.last_plan().unwrap();
    assert!(plan.iterations.iter().all(|it| it.method != Method3::Greedy), "{plan:?}");
    let mut g = Phase3::new(Phase3Config { persistence: 1, ilp_node_limit: 0, ..Phase3Config::default() });
    epoch(&mut g, &reports);
    let plan = g.last_plan().unwrap();
    assert!(!plan.moves.is_empty());
    assert!(plan.iterations.iter().all(|it| it.method == Method3::Greedy), "{plan:?}");
    let t = 1.1 * plan.mean * 2.0;
    let out: f64 = plan.moves.iter().map(|m| m.load).sum();
    assert!(1200.0 - out <= t + 1e-9, "greedy relieves the source too: {plan:?}");
}

#[test]
fn greedy_prefers_write_heavy_cachelets_on_a_tie() {
    let pair =
        Pair { src_load: 400.0, src_n: 1.0, dst_load: 0.0, dst_n: 1.0, dst_limit: 220.0, dst_free: None, mean: 200.0 };
    let c = |id: u32, writes: f64| CacheletReport {
        id,
        worker: 0,
        load: 100.0,
        reads_per_sec: 100.0 - writes,
        writes_per_sec: writes,
        bytes: 64 * MB,
    };
    let cands = [c(1, 0.0), c(2, 90.0), c(3, 10.0), c(4, 50.0)];
    assert_eq!(greedy(&pair, &cands), vec![2, 4]);
    // The ILP's penalty prefers them too.
    let (chosen, _) = solve(&pair, &cands, 1_000).unwrap();
    let mut chosen = chosen;
    chosen.sort();
    assert_eq!(chosen, vec![2, 4]);
}

#[test]
fn an_escalation_acts_at_once_and_on_its_hot_workers() {
    let reports = cluster(0);
    let mut p = Phase3::new(Phase3Config::default());
    let esc = Escalation { why: EscalateWhy::ServerOverloaded { saturated: 2, workers: 2 }, sources: vec![0, 1] };
    p.step(Phase3Event::Escalated { server: 0, escalation: esc });
    assert_eq!(epoch(&mut p, &reports).len(), 1, "no persistence needed");
    // A server under T whose Phase 2 found no plan: its hot worker is the source.
    let lop: &[f64] = &[300.0, 20.0];
    let idle: &[f64] = &[10.0];
    let warm: &[f64] = &[150.0];
    let reports = vec![report(0, &[lop, idle], 0), report(1, &[warm, warm], 0), report(2, &[warm, warm], 0)];
    let mut p = Phase3::new(Phase3Config::default());
    let esc = Escalation { why: EscalateWhy::NoLocalPlan, sources: vec![0] };
    p.step(Phase3Event::Escalated { server: 0, escalation: esc });
    epoch(&mut p, &reports);
    let plan = p.last_plan().unwrap();
    assert_eq!(plan.sources, vec![Source::Worker(0, 0)]);
    assert!(plan.moves.iter().all(|m| m.from == (0, 0)), "{plan:?}");
    // Only the one that fits: the 300 would overload any other server.
    assert_eq!(plan.moves.iter().map(|m| m.cachelet).collect::<Vec<_>>(), vec![1]);
}

#[test]
fn a_balanced_cluster_or_an_idle_one_gets_no_plan() {
    let warm: &[f64] = &[50.0; 4];
    let reports: Vec<ServerReport> = (0..4).map(|s| report(s, &[warm, warm], 0)).collect();
    let mut p = Phase3::new(Phase3Config { persistence: 1, ..Phase3Config::default() });
    assert!(epoch(&mut p, &reports).is_empty());
    assert!(p.last_plan().unwrap().sources.is_empty());
    let tiny: &[f64] = &[1.0];
    let zero: &[f64] = &[0.0];
    let reports = vec![report(0, &[tiny, tiny], 0), report(1, &[zero, zero], 0)];
    assert!(epoch(&mut p, &reports).is_empty(), "under min_load");
}

#[test]
fn a_destinations_first_report_after_an_arrival_counts_the_cachelets_whole_load() {
    let mut p = Phase3::new(Phase3Config { persistence: 1, ..Phase3Config::default() });
    let mut reports = cluster(0);
    let m = epoch(&mut p, &reports)[0];
    p.step(Phase3Event::Finished { cachelet: m.cachelet, bytes: m.bytes });
    // The destination's next report: the cachelet counted only since it arrived (a tenth).
    let d = usize::from(m.to.0);
    let mut c = reports[0].cachelets.iter().find(|c| c.id == m.cachelet).copied().unwrap();
    c.load /= 10.0;
    reports[d].put(c, m.to.1);
    reports[0].take(m.cachelet);
    let before = reports[d].load();
    p.step(Phase3Event::Report(reports[d].clone()));
    let kept = &p.reports[&m.to.0];
    assert!((kept.load() - (before + 0.9 * m.load)).abs() < 1e-9, "{} {}", kept.load(), before);
    // Only the first: the next report is taken as it is.
    p.step(Phase3Event::Report(reports[d].clone()));
    assert!((p.reports[&m.to.0].load() - before).abs() < 1e-9);
}

#[test]
fn a_migration_never_heard_of_again_times_out() {
    let cfg = Phase3Config { persistence: 1, migrate_timeout_epochs: 3, ..Phase3Config::default() };
    let mut p = Phase3::new(cfg);
    let reports = cluster(0);
    let m = epoch(&mut p, &reports);
    assert_eq!(m.len(), 1);
    assert!(epoch(&mut p, &reports).is_empty());
    assert!(epoch(&mut p, &reports).is_empty());
    // Three epochs on: taken as failed, the source free again (another cachelet: it cools).
    let next = epoch(&mut p, &reports);
    assert_eq!(next.len(), 1, "{next:?}");
    assert_ne!(next[0].cachelet, m[0].cachelet);
    assert_eq!((p.stats().failed, p.stats().timed_out), (1, 1));
    // Its late end is ignored.
    assert!(p.step(Phase3Event::Finished { cachelet: m[0].cachelet, bytes: m[0].bytes }).is_empty());
    assert_eq!(p.stats().finished, 0);
}

#[test]
fn a_report_from_a_snapshot_weighs_writes_and_sums_bytes() {
    use crate::snapshot::{CacheletLoad, WorkerLoad};
    let c = |id: u32, r: f64, w: f64, bytes: u64| CacheletLoad {
        id,
        reads_per_sec: r,
        writes_per_sec: w,
        bytes,
        ..CacheletLoad::default()
    };
    let snap = EpochSnapshot {
        seq: 3,
        end_ns: 0,
        workers: vec![
            WorkerLoad {
                worker: 0,
                secs: 1.0,
                cachelets: vec![c(4, 100.0, 50.0, 10), c(5, 0.0, 10.0, 20)],
                ..WorkerLoad::default()
            },
            WorkerLoad { worker: 1, secs: 1.0, cachelets: vec![c(6, 30.0, 0.0, 5)], ..WorkerLoad::default() },
        ],
    };
    let cfg = Config { write_weight: 2.0, worker_capacity: Some(500.0), ..Config::default() };
    let r = ServerReport::from_snapshot(7, &snap, &cfg, 1_000);
    assert_eq!(r.server, 7);
    assert_eq!((r.mem_limit, r.mem_used), (1_000, 35));
    assert_eq!(
        r.workers,
        vec![
            WorkerReport { worker: 0, load: 220.0, capacity: Some(500.0) },
            WorkerReport { worker: 1, load: 30.0, capacity: Some(500.0) },
        ]
    );
    let c4 = r.cachelets.iter().find(|c| c.id == 4).unwrap();
    assert_eq!((c4.worker, c4.load, c4.bytes), (0, 200.0, 10));
    assert!((c4.write_fraction() - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(r.capacity(), Some(1_000.0));
    assert_eq!(r.free_mem(), Some(965));
}

#[test]
fn a_server_that_is_no_longer_a_member_is_neither_a_source_nor_a_destination() {
    let mut p = Phase3::new(Phase3Config::default());
    let reports = cluster(0);
    for _ in 0..2 {
        assert!(epoch(&mut p, &reports).is_empty());
    }
    // Server 3, the coldest, dies before the epoch that would plan: its last report stays
    // behind, but it is not a member any more.
    for r in &reports {
        p.step(Phase3Event::Report(r.clone()));
    }
    p.step(Phase3Event::Members { up: vec![0, 1, 2] });
    let started = p.step(Phase3Event::Epoch);
    let plan = p.last_plan().unwrap().clone();
    assert!(!started.is_empty(), "server 0 is still hot: {plan:?}");
    assert!(plan.moves.iter().all(|m| m.to.0 != 3 && m.from.0 != 3), "{plan:?}");
    assert_eq!(plan.sources, vec![Source::Server(0)]);
    // The mean is the members': 0, 1 and 2 only (1200 + 400 + 400 over 6 workers).
    assert!((plan.mean - 2000.0 / 6.0).abs() < 1e-9, "{}", plan.mean);
}
