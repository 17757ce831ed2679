//! End-to-end tests against the in-process stub server, plus report helpers.

use super::*;
use crate::stub::StubServer;

fn args_for(servers: &[&StubServer]) -> BenchArgs {
    BenchArgs {
        server: servers.iter().map(|s| s.addr.to_string()).collect(),
        quiet: true,
        duration: Some(60.0),
        keys: 1000,
        conns: 2,
        pipeline: 4,
        ..BenchArgs::default()
    }
}

fn timeline_ops(r: &BenchReport) -> u64 {
    r.timeline.iter().map(|s| s.ops).sum()
}

#[test]
fn bounded_closed_loop_run_counts() {
    let s = StubServer::start().unwrap();
    let a = BenchArgs { load: true, max_ops: Some(1000), workload: WorkloadKind::C, ..args_for(&[&s]) };
    let r = run(a).unwrap();
    let load = r.load.clone().unwrap();
    assert_eq!(load.sets, 1000);
    assert_eq!(load.errors, 0);
    assert_eq!(r.totals.ops, 1000);
    assert_eq!(r.totals.gets + r.totals.sets, 1000);
    assert!(r.totals.gets > 300 && r.totals.sets > 300, "50/50 mix: {:?}", r.totals);
    assert_eq!(r.totals.get_keys, r.totals.gets);
    // every key was loaded, so every get hits
    assert_eq!(r.totals.hits, r.totals.gets);
    assert_eq!(r.totals.misses, 0);
    assert_eq!(r.totals.unfinished, 0);
    assert_eq!(timeline_ops(&r), 1000);
    assert_eq!(r.latency["get"].count, r.totals.gets);
    assert_eq!(r.latency["set"].count, r.totals.sets);
    assert_eq!(r.latency["all"].count, 1000);
    // the server saw exactly the load sets plus the run's requests
    assert_eq!(s.stats.requests.load(Ordering::Relaxed), 2000);
    assert_eq!(s.stats.sets.load(Ordering::Relaxed), 1000 + r.totals.sets);
    assert_eq!(r.balance.targets.len(), 1);
    assert_eq!(r.balance.targets[0].requests, 1000);
    assert_eq!(r.balance.imbalance_factor, 0.0);
}

#[test]
fn multiget_counts_keys_and_requests_separately() {
    let s = StubServer::start().unwrap();
    let a = BenchArgs { multiget: 10, max_ops: Some(200), threads: 2, ..args_for(&[&s]) };
    let r = run(a).unwrap();
    assert_eq!(r.totals.ops, 200);
    assert_eq!(r.totals.gets, 200);
    assert_eq!(r.totals.get_keys, 2000);
    assert_eq!(r.totals.requests, 200);
    // nothing loaded: all misses
    assert_eq!(r.totals.hits, 0);
    assert_eq!(r.totals.misses, 2000);
    assert_eq!(s.stats.gets.load(Ordering::Relaxed), 200);
}

#[test]
fn keys_spread_over_servers_and_balance_is_reported() {
    let s1 = StubServer::start().unwrap();
    let s2 = StubServer::start().unwrap();
    let a = BenchArgs {
        load: true,
        max_ops: Some(2000),
        workload: WorkloadKind::Uniform,
        read_ratio: 1.0,
        multiget: 4,
        ..args_for(&[&s1, &s2])
    };
    let r = run(a).unwrap();
    let n1 = s1.stats.gets.load(Ordering::Relaxed);
    let n2 = s2.stats.gets.load(Ordering::Relaxed);
    assert!(n1 > 0 && n2 > 0);
    assert_eq!(r.balance.targets[0].requests, n1);
    assert_eq!(r.balance.targets[1].requests, n2);
    assert_eq!(r.totals.requests, n1 + n2);
    // a multiget split over two servers is one op but up to two requests
    assert!(n1 + n2 > 2000 && n1 + n2 <= 4000);
    assert_eq!(r.totals.hits, 8000, "every loaded key found on the server it hashes to");
    let (a1, a2) = (n1 as f64, n2 as f64);
    let want = imbalance_factor(&[a1, a2]);
    assert!((r.balance.imbalance_factor - want).abs() < 1e-12);
    // the load spread keys too: each server got about half of the 1000 sets
    let (l1, l2) = (s1.stats.sets.load(Ordering::Relaxed), s2.stats.sets.load(Ordering::Relaxed));
    assert_eq!(l1 + l2, 1000);
    assert!(l1 > 350 && l2 > 350, "{l1} / {l2}");
}

#[test]
fn load_only_sets_every_key_once() {
    let s = StubServer::start().unwrap();
    let a = BenchArgs { load_only: true, keys: 777, threads: 2, conns: 3, ..args_for(&[&s]) };
    let r = run(a).unwrap();
    assert_eq!(r.load.unwrap().sets, 777);
    assert_eq!(r.totals.ops, 0);
    assert_eq!(s.stats.sets.load(Ordering::Relaxed), 777);
}

#[test]
fn open_loop_is_bounded_by_max_ops() {
    let s = StubServer::start().unwrap();
    let a = BenchArgs { rate: Some(50_000.0), max_ops: Some(300), ..args_for(&[&s]) };
    let r = run(a).unwrap();
    assert_eq!(r.totals.ops, 300);
    assert_eq!(r.totals.target_rate, Some(50_000.0));
    assert_eq!(s.stats.requests.load(Ordering::Relaxed), 300);
}

#[test]
fn open_loop_client_sleeps_between_sends() {
    // 2,000 ops/s for a second: the ops are 500 µs apart, so a client that sleeps until each
    // is due (a timer, not a busy-poll) uses a small part of its core; one that busy-polls uses
    // all the CPU it gets. CPU time, not a wall-clock speed: a loaded machine only lowers it.
    let s = StubServer::start().unwrap();
    let a = BenchArgs { rate: Some(2_000.0), duration: Some(1.0), max_ops: Some(4_000), ..args_for(&[&s]) };
    let r = run(a).unwrap();
    assert!(r.totals.ops >= 1_900 && r.totals.ops <= 2_100, "{:?}", r.totals);
    assert!(
        r.client.cpu_secs < 0.5 * r.totals.elapsed_s,
        "the client used {:.2} s of CPU in {:.2} s",
        r.client.cpu_secs,
        r.totals.elapsed_s
    );
    // every second of the run lines up with the clock: t = 0 is when the run began
    assert!(r.run_started_unix_ms >= r.started_unix_ms);
    assert_eq!(r.timeline.iter().map(|s| s.late_ops).sum::<u64>(), r.totals.late_ops);
}

#[test]
fn phases_are_recorded() {
    let s = StubServer::start().unwrap();
    let a = BenchArgs { phases: Some("a:30,c:30".into()), max_ops: Some(100), ..args_for(&[&s]) };
    let r = run(a).unwrap();
    assert_eq!(r.phases.len(), 2);
    assert_eq!(r.totals.ops, 100);
    // all 100 ops happen well inside phase a (100% reads)
    assert_eq!(r.totals.sets, 0);
    assert!(r.timeline.iter().all(|s| s.phase == "a"));
}

#[test]
fn refuses_non_loopback_targets() {
    let a = BenchArgs { server: vec!["10.1.2.3:11211".into()], quiet: true, ..BenchArgs::default() };
    let e = run(a).unwrap_err().to_string();
    assert!(e.contains("not a loopback address"), "{e}");
}

#[test]
fn rejects_bad_settings() {
    let s = StubServer::start().unwrap();
    for a in [
        BenchArgs { key_size: 3, ..args_for(&[&s]) },
        BenchArgs { conns: 1, threads: 2, ..args_for(&[&s]) },
        BenchArgs { phases: Some("zz:1".into()), ..args_for(&[&s]) },
        BenchArgs { read_ratio: 1.5, ..args_for(&[&s]) },
    ] {
        assert!(run(a).is_err());
    }
    assert_eq!(s.stats.requests.load(Ordering::Relaxed), 0);
}

#[test]
fn imbalance_factor_eq6() {
    assert_eq!(imbalance_factor(&[5.0, 5.0, 5.0]), 0.0);
    // avg 2, deviations 2+2 over (2*2)
    assert!((imbalance_factor(&[4.0, 0.0]) - 1.0).abs() < 1e-12);
    // avg 10: |30-10| + 3*|3.33..-10| ... use exact numbers: [20, 0, 10, 10] avg 10 -> (10+10)/(40) = 0.5
    assert!((imbalance_factor(&[20.0, 0.0, 10.0, 10.0]) - 0.5).abs() < 1e-12);
    assert_eq!(imbalance_factor(&[]), 0.0);
}

#[test]
fn json_round_trip_and_plot_only() {
    let s = StubServer::start().unwrap();
    let dir = std::env::temp_dir().join(format!("mbal-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let j1 = dir.join("one.json");
    let svg1 = dir.join("one.svg");
    let a = BenchArgs { max_ops: Some(500), json: Some(j1.clone()), plot: Some(svg1.clone()), ..args_for(&[&s]) };
    let r = run(a).unwrap();
    let back = load_report(&j1).unwrap();
    assert_eq!((back.totals.ops, back.totals.gets, back.totals.misses), (r.totals.ops, 500, 500));
    assert!((back.totals.ops_per_sec - r.totals.ops_per_sec).abs() < 1e-6 * r.totals.ops_per_sec);
    assert_eq!(timeline_ops(&back), 500);
    assert_eq!(back.settings.max_ops, Some(500));
    assert!(std::fs::read_to_string(&svg1).unwrap().contains("<svg"));
    let out = dir.join("both.svg");
    let a = BenchArgs {
        plot_only: vec![j1.clone(), j1.clone()],
        output: Some(out.clone()),
        quiet: true,
        ..BenchArgs::default()
    };
    let first = run(a).unwrap();
    assert_eq!(first.totals.ops, r.totals.ops);
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.contains("<svg") && svg.contains("throughput"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn silent_server_run_is_bounded_by_duration_and_drain() {
    // accepts connections and never answers
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(l.accept().unwrap().0);
        }
        let _ = rx.recv();
    });
    let a = BenchArgs {
        server: vec![addr.to_string()],
        quiet: true,
        duration: Some(0.2),
        drain: 0.1,
        conns: 2,
        pipeline: 3,
        ..BenchArgs::default()
    };
    let r = run(a).unwrap();
    assert_eq!(r.totals.ops, 0);
    assert_eq!(r.totals.unfinished, 6, "2 conns x 3 in flight never answered");
    tx.send(()).unwrap();
    holder.join().unwrap();
}

/// A driver with no I/O: every op completes on the next poll; checks the engine's contract.
struct FakeDriver {
    slots: usize,
    pipeline: usize,
    in_flight: Vec<usize>,
    tokens: std::collections::HashSet<u32>,
    queued: Vec<Completion>,
    submitted: u64,
}

use crate::driver::{Completion, Request};

impl Driver for FakeDriver {
    fn target_names(&self) -> Vec<String> {
        vec!["fake".into()]
    }
    fn submit(&mut self, slot: usize, req: &Request<'_>) -> Result<()> {
        assert!(slot < self.slots);
        self.in_flight[slot] += 1;
        assert!(self.in_flight[slot] <= self.pipeline, "pipeline depth exceeded");
        assert!(self.tokens.insert(req.token), "token {} reused while in flight", req.token);
        self.queued.push(Completion { token: req.token, hits: req.keys.len() as u32, errors: 0 });
        self.submitted += 1;
        Ok(())
    }
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }
    fn poll(&mut self, _t: Duration, out: &mut Vec<Completion>) -> Result<()> {
        for c in self.queued.drain(..) {
            self.tokens.remove(&c.token);
            out.push(c);
        }
        self.in_flight.iter_mut().for_each(|x| *x = 0);
        Ok(())
    }
    fn target_requests(&self) -> Vec<u64> {
        vec![self.submitted]
    }
}

struct FakeFactory;
impl DriverFactory for FakeFactory {
    fn name(&self) -> String {
        "fake".into()
    }
    fn make(&self, spec: &DriverSpec<'_>) -> Result<Box<dyn Driver>> {
        Ok(Box::new(FakeDriver {
            slots: spec.slots,
            pipeline: spec.args.pipeline,
            in_flight: vec![0; spec.slots],
            tokens: Default::default(),
            queued: Vec::new(),
            submitted: 0,
        }))
    }
}

#[test]
fn engine_respects_quota_pipeline_and_tokens_with_any_driver() {
    let a = BenchArgs {
        quiet: true,
        duration: Some(60.0),
        max_ops: Some(10_007),
        threads: 3,
        conns: 5,
        pipeline: 7,
        multiget: 3,
        workload: WorkloadKind::B,
        ..BenchArgs::default()
    };
    let r = run_with(a, &FakeFactory).unwrap();
    assert_eq!(r.driver, "fake");
    assert_eq!(r.totals.ops, 10_007);
    assert_eq!(r.totals.requests, 10_007);
    assert_eq!(r.totals.get_keys, 3 * r.totals.gets);
    assert_eq!(r.totals.hits, r.totals.get_keys);
    // workload B: about 5% updates
    let upd = r.totals.sets as f64 / r.totals.ops as f64;
    assert!((0.03..0.07).contains(&upd), "update share {upd}");
    assert_eq!(r.client.threads, 3);
}
