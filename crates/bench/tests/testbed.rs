//! What a balancer experiment needs from `mbal bench`, end to end against real mbal servers
//! started in-process on loopback ephemeral ports: the hot-partition workload, the servers'
//! per-worker load timeline (`mbal load`) with moves read off it or taken from the balancer's
//! decisions, `--settle`, and the open-loop rate sweep against a worker with an emulated
//! capacity.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use mbal_bench::routed::fetch_map;
use mbal_bench::workload::WorkloadKind;
use mbal_bench::{run, BenchArgs};
use mbal_server::config::Settings;

fn settings(threads: usize) -> Settings {
    Settings { port: 0, threads, memory_limit: 32 << 20, epoch_ms: 200, balance_epoch_ms: 200, ..Settings::default() }
}

#[test]
fn hot_partition_load_lands_on_the_hot_cachelets_worker_and_the_servers_counters_show_it() {
    // A capacity far above the offered rate: it throttles nothing, and each worker then takes
    // its own routed requests. Without one, a routed connection serves every worker of its
    // thread and the client routes by thread: when the server folded its 4 workers onto fewer
    // threads (a loaded 2-core CI machine), the hot worker's target also got its thread-mates'
    // keys (a share of 0.97 once).
    let srv = mbal_server::start(Settings { worker_capacity: 1_000_000, ..settings(4) }).unwrap();
    let a = BenchArgs {
        server: vec![srv.main_addr.to_string()],
        routed: true,
        workload: WorkloadKind::Hotpart,
        hot_cachelets: 2,
        hot_ops: 0.9,
        keys: 20_000,
        conns: 2,
        pipeline: 8,
        // Open loop: the run lasts its 1.5 s (several 200 ms epochs) however fast the build;
        // closed loop, a release build was through its 40,000 requests before an epoch ended.
        rate: Some(10_000.0),
        duration: Some(1.5),
        max_ops: Some(40_000),
        quiet: true,
        ..BenchArgs::default()
    };
    let r = run(a).unwrap();
    // The hot cachelets are the first two of the worker that owns cachelet 0.
    let map = fetch_map(srv.main_addr).unwrap();
    let (s0, w0) = map.owner(0);
    assert_eq!(r.hot_cachelets, map.cachelets_of(s0, w0)[..2].to_vec());
    // 90% of requests (plus a quarter of the rest) go to that worker: the client's counts.
    let hot_name = format!("s{s0}/w{w0}");
    let total: u64 = r.balance.targets.iter().map(|t| t.requests).sum();
    let hot = r.balance.targets.iter().find(|t| t.name == hot_name).unwrap().requests;
    let share = hot as f64 / total as f64;
    assert!((0.88..0.96).contains(&share), "hot worker share {share}");
    // Per second, per target, adding up to the totals.
    let per_target: Vec<u64> = (0..r.balance.targets.len())
        .map(|j| r.timeline.iter().map(|s| s.targets.get(j).copied().unwrap_or(0)).sum())
        .collect();
    assert_eq!(per_target, r.balance.targets.iter().map(|t| t.requests).collect::<Vec<_>>());
    // The servers' own counters: epochs of the run, the hot worker the busiest by far.
    let load = r.server_load.expect("an mbal server answers mbal load");
    assert!(!load.epochs.is_empty(), "no epoch ended during the run");
    assert!(load.epochs.iter().all(|e| e.t_end >= 0.0 && e.workers.len() == 4));
    let (name, _) = load.workers.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
    assert_eq!(*name, hot_name);
    assert!(load.max_over_avg > 2.5, "server max/avg {}", load.max_over_avg);
    // Nothing moved cachelets during the run.
    assert!(load.events.is_empty(), "{:?}", load.events);
    srv.shutdown();
}

#[test]
fn a_move_during_the_run_is_seen_in_the_servers_epochs() {
    let srv = mbal_server::start(settings(2)).unwrap();
    let addr = srv.main_addr;
    // Move cachelet 0 to worker 1 while the bench runs (after its first epochs).
    let mover = std::thread::spawn(move || {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut w = s;
        // `mbal load` blocks until the next epoch ends: let six go by (the bench has caught up
        // with the server's epochs and is running by then), then move.
        let mut after = 0u64;
        for _ in 0..6 {
            w.write_all(format!("mbal load {after}\r\n").as_bytes()).unwrap();
            let mut l = String::new();
            r.read_line(&mut l).unwrap();
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f[0], "LOAD", "{l:?}");
            after = f[1].parse().unwrap();
            let mut body = vec![0u8; f[2].parse::<usize>().unwrap() + 2];
            std::io::Read::read_exact(&mut r, &mut body).unwrap();
        }
        w.write_all(b"mbal move 0 1\r\n").unwrap();
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        assert!(l.starts_with("MOVED "), "{l:?}");
    });
    let a = BenchArgs {
        server: vec![addr.to_string()],
        routed: true,
        workload: WorkloadKind::Uniform,
        keys: 5_000,
        conns: 2,
        pipeline: 4,
        rate: Some(5_000.0),
        duration: Some(2.5),
        max_ops: Some(20_000),
        quiet: true,
        ..BenchArgs::default()
    };
    let r = run(a).unwrap();
    mover.join().unwrap();
    let load = r.server_load.unwrap();
    let moves: Vec<_> = load.events.iter().filter(|e| e.kind == "move").collect();
    assert_eq!(moves.len(), 1, "{:?}", load.events);
    let m = moves[0];
    assert_eq!((m.cachelet, m.from_worker, m.to_worker, m.source.as_str()), (0, 0, 1, "epoch-snapshots"));
    assert!(m.t > 0.0 && m.t <= r.totals.elapsed_s + 1.0, "move at {}", m.t);
    srv.shutdown();
}

#[test]
fn the_balancers_decisions_are_the_timelines_events_and_settled_figures_follow_the_settle_period() {
    // A server with its balancer on (200 ms epochs, persistence 4) under a hot partition: its
    // decisions in `mbal load` become the run's events (source "balancer"), the first moving
    // a hot cachelet off the hot worker; no move is also listed from the snapshots.
    let srv = mbal_server::start(Settings { balancer: true, ..settings(4) }).unwrap();
    let a = BenchArgs {
        server: vec![srv.main_addr.to_string()],
        routed: true,
        workload: WorkloadKind::Hotpart,
        hot_cachelets: 4,
        hot_ops: 0.9,
        keys: 20_000,
        conns: 2,
        pipeline: 8,
        rate: Some(4_000.0),
        duration: Some(3.0),
        settle: Some(2.0),
        max_ops: Some(40_000),
        quiet: true,
        ..BenchArgs::default()
    };
    let r = run(a).unwrap();
    let load = r.server_load.expect("an mbal server answers mbal load");
    assert!(!load.events.is_empty(), "the balancer moved nothing: {:?}", load.epochs);
    assert!(load.events.iter().all(|e| e.source == "balancer"), "{:?}", load.events);
    let first = &load.events[0];
    assert_eq!((first.kind.as_str(), first.why.as_str()), ("move", "Balance"), "{first:?}");
    let at_first: Vec<_> = load.events.iter().filter(|e| e.t == first.t).collect();
    assert!(at_first.iter().any(|e| r.hot_cachelets.contains(&e.cachelet)), "{at_first:?}");
    assert!(first.t > 0.0 && first.t <= r.totals.elapsed_s + 0.5, "move at {}", first.t);
    assert!(load.epochs.iter().any(|e| e.balancer_state.is_some()));
    // --settle 2: the ops completed from the third second on.
    let st = r.settled.expect("--settle reports settled figures");
    assert_eq!(st.from_s, 2.0);
    assert!(st.ops > 0 && st.ops < r.totals.ops, "{st:?} {:?} {:?}", r.totals, r.timeline);
    assert!(st.latency.p99_us > 0.0);
    srv.shutdown();
}

#[test]
fn a_rate_sweep_against_a_capped_worker_levels_off_at_the_cap() {
    // One worker serving at most 2,000 requests/s; offered 1,000 then 4,000 ops/s for 1 s
    // each. Above the cap, throughput stays under it (with generous slack) and requests queue:
    // op i of the second rate, meant to leave at i/4000 s, cannot be served before
    // (i - bucket)/3000 s even with 1.5x slack, so the last few percent wait over 300 ms. These
    // are bounds a slow machine cannot break (it only adds latency); nothing here needs the
    // machine to be fast.
    let cap = 2_000;
    let srv = mbal_server::start(Settings { worker_capacity: cap, ..settings(1) }).unwrap();
    let a = BenchArgs {
        server: vec![srv.main_addr.to_string()],
        routed: true,
        workload: WorkloadKind::Uniform,
        keys: 1_000,
        conns: 4,
        pipeline: 1024,
        rate_sweep: Some("1000:4000:3000".into()),
        p99_target_us: Some(50_000.0),
        duration: Some(1.0),
        drain: 10.0,
        quiet: true,
        ..BenchArgs::default()
    };
    let r = run(a).unwrap();
    let sw = r.sweep.expect("a sweep report");
    assert_eq!(sw.steps.len(), 2);
    let (low, high) = (&sw.steps[0], &sw.steps[1]);
    assert_eq!((low.offered_ops_per_sec, high.offered_ops_per_sec), (1_000.0, 4_000.0));
    // Above the cap: no more than the cap (1.5x slack plus the bucket, spread over the run).
    assert!(high.ops_per_sec <= cap as f64 * 1.5, "{} ops/s through a {cap}/s worker", high.ops_per_sec);
    // ... so requests waited.
    assert!(high.p99_us > 100_000.0, "p99 {} µs at 4000/s through a {cap}/s worker", high.p99_us);
    assert!(!high.meets_target);
    // The verdicts follow the target, and the best rate is the best that met it.
    for st in &sw.steps {
        assert_eq!(st.meets_target, st.p99_us <= 50_000.0 && st.unfinished == 0 && st.errors == 0, "{st:?}");
    }
    let best = sw.steps.iter().filter(|s| s.meets_target).map(|s| s.ops_per_sec).reduce(f64::max);
    assert_eq!(sw.max_ops_per_sec_at_target, best);
    // Timeline: both rates' seconds, labelled with the rate.
    assert!(r.timeline.iter().any(|s| s.phase.ends_with("@1000")));
    assert!(r.timeline.iter().any(|s| s.phase.ends_with("@4000")));
    srv.shutdown();
}

#[test]
fn sweep_and_hot_partition_arguments_are_checked() {
    assert_eq!(mbal_bench::parse_sweep("1000:3000:1000").unwrap(), vec![1000.0, 2000.0, 3000.0]);
    assert_eq!(mbal_bench::parse_sweep("5:5:1").unwrap(), vec![5.0]);
    for bad in ["1000:3000", "0:10:1", "10:5:1", "1:2:0", "a:b:c", "1:1000:1"] {
        assert!(mbal_bench::parse_sweep(bad).is_err(), "{bad}");
    }
    // The hot partition needs an mbal server's map: a stub memcached-text server has none.
    let stub = mbal_bench::stub::StubServer::start().unwrap();
    let a = BenchArgs {
        server: vec![stub.addr.to_string()],
        workload: WorkloadKind::Hotpart,
        max_ops: Some(10),
        quiet: true,
        ..BenchArgs::default()
    };
    let e = run(a).unwrap_err();
    assert!(format!("{e:#}").contains("hot-partition"), "{e:#}");
}
