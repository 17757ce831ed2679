//! `mbal bench --routed` and `--value-size-max` end to end, against real mbal servers started
//! in-process on loopback ephemeral ports.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use mbal_bench::routed::{fetch_map, RoutedFactory, MAX_REDIRECTS};
use mbal_bench::workload::WorkloadKind;
use mbal_bench::{run, run_with, BenchArgs, BenchReport, ServerLoadMode};
use mbal_cluster::{ClusterMap, ServerInfo};
use mbal_member::{ClusterSpec, ServerSpec};
use mbal_server::config::Settings;
use mbal_server::ServerHandle;

/// `threads` workers, each on a thread of its own (no thread policy: a routed bench then
/// sends each worker its own keys, which these tests count).
fn settings(threads: usize) -> Settings {
    Settings { port: 0, threads, worker_threads: threads, memory_limit: 32 << 20, ..Settings::default() }
}

fn start(s: Settings) -> ServerHandle {
    mbal_server::start(s).expect("server starts")
}

struct Conn {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Conn {
    fn open(addr: SocketAddr) -> Conn {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Conn { r: BufReader::new(s.try_clone().unwrap()), w: s }
    }
    fn cmd(&mut self, c: &str) -> String {
        self.w.write_all(c.as_bytes()).unwrap();
        let mut l = String::new();
        self.r.read_line(&mut l).unwrap();
        l
    }
    fn stat(&mut self, name: &str) -> u64 {
        self.w.write_all(b"stats\r\n").unwrap();
        let mut found = None;
        loop {
            let mut l = String::new();
            self.r.read_line(&mut l).unwrap();
            assert!(!l.is_empty(), "connection closed in stats");
            if l == "END\r\n" {
                break;
            }
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() == 3 && f[1] == name {
                found = Some(f[2].parse().unwrap());
            }
        }
        found.unwrap_or_else(|| panic!("no stat {name}"))
    }
    /// Length of the value of `key`, if present.
    fn value_len(&mut self, key: &str) -> Option<usize> {
        let l = self.cmd(&format!("get {key}\r\n"));
        if l == "END\r\n" {
            return None;
        }
        let n: usize = l.split_whitespace().nth(3).unwrap().parse().unwrap();
        let mut v = vec![0; n + 2];
        self.r.read_exact(&mut v).unwrap();
        assert_eq!(self.cmd(""), "END\r\n");
        Some(n)
    }
}

fn routed_args(server: SocketAddr) -> BenchArgs {
    BenchArgs {
        server: vec![server.to_string()],
        routed: true,
        quiet: true,
        keys: 2000,
        load: true,
        duration: Some(30.0),
        max_ops: Some(20_000),
        conns: 4,
        threads: 2,
        pipeline: 8,
        workload: WorkloadKind::C,
        ..BenchArgs::default()
    }
}

/// Everything answered, nothing failed, every worker served.
fn check_clean(r: &BenchReport, workers: usize) {
    let t = &r.totals;
    assert_eq!(r.driver, "routed");
    assert_eq!(t.errors, 0, "{t:?}");
    assert_eq!(t.unfinished, 0, "{t:?}");
    assert_eq!(t.ops, 20_000);
    assert_eq!(t.hits, t.get_keys, "every key was loaded: {t:?}");
    assert_eq!(r.balance.targets.len(), workers);
    for tg in &r.balance.targets {
        assert!(tg.requests > 0, "{} got no requests: {:?}", tg.name, r.balance.targets);
    }
    let load = r.load.as_ref().expect("load phase");
    assert_eq!((load.sets, load.errors), (2000, 0));
}

#[test]
fn routed_single_server_never_crosses_workers() {
    let srv = start(settings(2));
    let mut admin = Conn::open(srv.main_addr);
    let r = run(routed_args(srv.main_addr)).unwrap();
    check_clean(&r, 2);
    assert_eq!(r.totals.redirects, 0);
    let names: Vec<&str> = r.balance.targets.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["s0/w0", "s0/w1"]);
    // multigets split per worker: one op, up to two requests
    let mg =
        run(BenchArgs { multiget: 10, load: false, workload: WorkloadKind::A, ..routed_args(srv.main_addr) }).unwrap();
    assert_eq!((mg.totals.errors, mg.totals.unfinished, mg.totals.ops), (0, 0, 20_000));
    assert_eq!(mg.totals.hits, mg.totals.get_keys);
    assert_eq!(mg.totals.get_keys, 200_000);
    assert!(mg.totals.requests > mg.totals.ops && mg.totals.requests <= 2 * mg.totals.ops, "{:?}", mg.totals);
    assert_eq!(admin.stat("cross_worker_requests"), 0, "routed requests never cross workers");
    // the same load through the main port does cross workers (the counter can move)
    let plain = run(BenchArgs { routed: false, load: false, ..routed_args(srv.main_addr) }).unwrap();
    assert_eq!(plain.totals.errors, 0);
    assert!(admin.stat("cross_worker_requests") > 0);
    srv.shutdown();
}

#[test]
fn routed_sends_the_keys_of_workers_sharing_a_thread_to_its_first_worker() {
    // 4 workers on one thread: one busy connection, no redirect, every key served
    let srv = start(Settings { worker_threads: 1, ..settings(4) });
    let mut admin = Conn::open(srv.main_addr);
    let r = run(routed_args(srv.main_addr)).unwrap();
    assert_eq!((r.totals.errors, r.totals.unfinished, r.totals.redirects), (0, 0, 0), "{:?}", r.totals);
    assert_eq!(r.totals.hits, r.totals.get_keys);
    let sent: Vec<u64> = r.balance.targets.iter().map(|t| t.requests).collect();
    assert!(sent[0] > 0 && sent[1..].iter().all(|&n| n == 0), "{sent:?}");
    let mg =
        run(BenchArgs { multiget: 10, load: false, workload: WorkloadKind::A, ..routed_args(srv.main_addr) }).unwrap();
    assert_eq!((mg.totals.errors, mg.totals.unfinished, mg.totals.redirects), (0, 0, 0));
    assert_eq!(mg.totals.hits, mg.totals.get_keys);
    assert_eq!(mg.totals.requests, mg.totals.ops, "a multi-get is one request to the thread");
    assert!(admin.stat("cross_worker_direct") > 0, "the neighbours' keys ran on their stores");
    srv.shutdown();
}

#[test]
fn routed_keeps_going_while_the_servers_threads_fold_and_spread() {
    // 4 workers on 2 threads; the bench meets them folded (one thread), then an operator
    // spreads and folds them under it: redirects to owners that left the thread, `mbal hello`
    // again, every op answered.
    let srv = start(Settings { worker_threads: 2, ..settings(4) });
    let mut admin = Conn::open(srv.main_addr);
    assert!(admin.cmd("mbal threads 1\r\n").starts_with("THREADS 1 2"));
    let addr = srv.main_addr;
    let bench = std::thread::spawn(move || {
        run(BenchArgs { max_ops: Some(60_000), multiget: 4, workload: WorkloadKind::A, ..routed_args(addr) })
    });
    // A change every 5 ms (pacing, not waiting for anything), for as long as the run lasts.
    let mut changes = 0;
    while !bench.is_finished() && changes < 4_000 {
        let n = 2 - changes % 2;
        assert!(admin.cmd(&format!("mbal threads {n}\r\n")).starts_with(&format!("THREADS {n} 2")));
        changes += 1;
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let r = bench.join().unwrap().unwrap();
    let t = &r.totals;
    assert_eq!((t.errors, t.unfinished, t.ops), (0, 0, 60_000), "{t:?}");
    assert_eq!(t.hits, t.get_keys, "{t:?}");
    assert!(changes >= 2, "{changes}");
    eprintln!("{changes} changes of the threads, {} redirects", t.redirects);
    srv.shutdown();
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn routed_three_server_cluster() {
    let spec = ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 1024,
        cachelets_per_worker: 4,
        workers: 2,
        servers: (0..3)
            .map(|_| {
                // two consecutive free worker ports
                let base = loop {
                    let b = free_port();
                    if b < 65000 && TcpListener::bind(("127.0.0.1", b + 1)).is_ok() {
                        break b;
                    }
                };
                ServerSpec { addr: format!("127.0.0.1:{}", free_port()).parse().unwrap(), worker_port_base: Some(base) }
            })
            .collect(),
        secret: None,
        secret_file: None,
        tls: None,
    };
    let servers: Vec<ServerHandle> = (0..3)
        .map(|id| {
            let mut s = settings(2);
            s.apply_cluster(spec.clone(), id).unwrap();
            start(s)
        })
        .collect();
    let r = run(routed_args(servers[1].main_addr)).unwrap();
    check_clean(&r, 6);
    assert_eq!(r.totals.redirects, 0);
    assert_eq!(r.balance.targets[5].name, "s2/w1");
    for s in &servers {
        assert_eq!(Conn::open(s.main_addr).stat("cross_worker_requests"), 0);
    }
    for s in servers {
        s.shutdown();
    }
}

#[test]
fn routed_follows_redirects_from_an_old_map() {
    let srv = start(settings(2));
    let mut admin = Conn::open(srv.main_addr);
    let old = fetch_map(srv.main_addr).unwrap();
    // move a quarter of the cachelets to the other worker
    let n = old.cachelet_count();
    for c in (0..n).step_by(4) {
        let to = 1 - old.owner(c).1;
        let l = admin.cmd(&format!("mbal move {c} {to}\r\n"));
        assert!(l.starts_with("MOVED "), "{l}");
    }
    assert!(fetch_map(srv.main_addr).unwrap().epoch() > old.epoch());
    let f = RoutedFactory::with_map(old);
    let r = run_with(routed_args(srv.main_addr), &f).unwrap();
    check_clean(&r, 2);
    assert!(r.totals.redirects > 0, "{:?}", r.totals);
    // a redirect is learned: far fewer redirects than ops that touched moved cachelets
    assert!(r.totals.redirects < 2_000, "{:?}", r.totals);
    // multigets answered with RD are resent per the learned routing
    let mid = fetch_map(srv.main_addr).unwrap();
    for c in (0..n).step_by(3) {
        let to = 1 - mid.owner(c).1;
        assert!(admin.cmd(&format!("mbal move {c} {to}\r\n")).starts_with("MOVED "));
    }
    let f = RoutedFactory::with_map(mid);
    let mg =
        run_with(BenchArgs { multiget: 20, load: false, workload: WorkloadKind::A, ..routed_args(srv.main_addr) }, &f)
            .unwrap();
    assert_eq!((mg.totals.errors, mg.totals.unfinished), (0, 0), "{:?}", mg.totals);
    assert_eq!(mg.totals.hits, mg.totals.get_keys);
    assert!(mg.totals.redirects > 0);
    assert_eq!(admin.stat("cross_worker_requests"), 0);
    srv.shutdown();
}

/// A fake worker that opts connections in and redirects every request to itself forever:
/// each op must give up after MAX_REDIRECTS and count an error.
#[test]
fn redirect_loops_are_bounded() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let conns = 2;
    // Logical clients share one connection per worker (per client thread).
    let accepts = 1;
    let t = std::thread::spawn(move || {
        let mut hs = Vec::new();
        for _ in 0..accepts {
            let (s, _) = l.accept().unwrap();
            hs.push(std::thread::spawn(move || {
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let mut w = s.try_clone().unwrap();
                for line in BufReader::new(s).lines() {
                    let Ok(line) = line else { break };
                    let reply: &[u8] = if line.starts_with("mbal hello") { b"MBAL 0 0 1\r\n" } else { b"RD 1 0 0\r\n" };
                    if w.write_all(reply).is_err() {
                        break;
                    }
                }
            }));
        }
        for h in hs {
            h.join().unwrap();
        }
    });
    let map = ClusterMap::even(vec![ServerInfo { main: addr, workers: vec![addr] }], 1, 16);
    let args = BenchArgs {
        server: vec![addr.to_string()],
        routed: true,
        quiet: true,
        keys: 100,
        duration: Some(30.0),
        max_ops: Some(50),
        conns,
        pipeline: 4,
        workload: WorkloadKind::A,
        // The fake serves one connection and no `mbal load`.
        server_load: ServerLoadMode::Off,
        ..BenchArgs::default()
    };
    let r = run_with(args, &RoutedFactory::with_map(map)).unwrap();
    assert_eq!(r.totals.ops, 50);
    assert_eq!(r.totals.errors, 50);
    assert_eq!(r.totals.redirects, 50 * MAX_REDIRECTS as u64);
    assert_eq!(r.totals.requests, 50 * (MAX_REDIRECTS as u64 + 1));
    t.join().unwrap();
}

#[test]
fn variable_value_sizes_are_uniform_and_seeded() {
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    let load = |seed: u64| {
        let a = BenchArgs {
            server: vec![srv.main_addr.to_string()],
            quiet: true,
            keys: 400,
            load_only: true,
            value_size: 64,
            value_size_max: Some(1024),
            threads: 1,
            conns: 2,
            seed,
            ..BenchArgs::default()
        };
        let r = run(a).unwrap();
        assert_eq!((r.load.unwrap().sets, r.totals.errors), (400, 0));
    };
    let lens = |c: &mut Conn| -> Vec<usize> {
        (0..400).map(|i| c.value_len(&format!("k{i:09}")).expect("loaded key")).collect::<Vec<_>>()
    };
    load(7);
    let a = lens(&mut c);
    assert!(a.iter().all(|&n| (64..=1024).contains(&n)), "{a:?}");
    let (lo, hi) = (a.iter().filter(|&&n| n < 300).count(), a.iter().filter(|&&n| n > 800).count());
    assert!(lo > 60 && hi > 60, "roughly uniform: {lo} below 300, {hi} above 800");
    load(7);
    assert_eq!(lens(&mut c), a, "same seed, same sizes");
    load(8);
    assert_ne!(lens(&mut c), a, "another seed, other sizes");
    // --value-size-max below --value-size is refused
    let bad = BenchArgs { value_size: 100, value_size_max: Some(99), ..BenchArgs::default() };
    assert!(run(bad).is_err());
    srv.shutdown();
}

/// Two fake one-worker servers for the Phase 1 client side: each answers a get of a key it is
/// home of with a hint (`RH hot <key> 1 60000`, one copy, on the other server) and the value,
/// and a get of a key it is not home of as that key's copy: the value, or `RD` naming the home
/// when `copies_redirect`. Returns the map and per server (home reads, copy reads).
fn hot_fakes(copies_redirect: bool) -> (ClusterMap, Vec<std::sync::Arc<[std::sync::atomic::AtomicU64; 2]>>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, OnceLock};
    let ls: Vec<TcpListener> = (0..2).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    let map = ClusterMap::even(addrs.iter().map(|&a| ServerInfo { main: a, workers: vec![a] }).collect(), 1, 64);
    let cell = Arc::new(OnceLock::new());
    cell.set(map.clone()).unwrap();
    let mut counts = Vec::new();
    for (me, l) in ls.into_iter().enumerate() {
        let (map, count) = (cell.clone(), Arc::new([AtomicU64::new(0), AtomicU64::new(0)]));
        counts.push(count.clone());
        std::thread::spawn(move || {
            // one connection per bench thread; the bench's threads end their connections
            for s in l.incoming().take(4) {
                let Ok(s) = s else { return };
                let (map, count) = (map.clone(), count.clone());
                std::thread::spawn(move || {
                    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                    s.set_nodelay(true).unwrap();
                    let mut w = s.try_clone().unwrap();
                    for line in BufReader::new(s).lines().take(1_000_000) {
                        let Ok(line) = line else { break };
                        let words: Vec<&str> = line.split(' ').collect();
                        let mut out = String::new();
                        if line.starts_with("mbal hello") {
                            out = format!("MBAL {me} 0 1\r\n");
                        } else if words[0] == "get" {
                            let m: &ClusterMap = map.get().unwrap();
                            for k in &words[1..] {
                                let home = m.route(mbal_cluster::key_hash(k.as_bytes())).1 as usize;
                                if home == me {
                                    count[0].fetch_add(1, Ordering::Relaxed);
                                    out += &format!("RH hot {k} 1 60000\r\nVALUE {k} 0 1\r\nh\r\n");
                                } else if copies_redirect {
                                    out = format!("RD 1 {home} 0\r\n");
                                    break;
                                } else {
                                    count[1].fetch_add(1, Ordering::Relaxed);
                                    out += &format!("VALUE {k} 0 1\r\nc\r\n");
                                }
                            }
                            if !out.starts_with("RD") {
                                out += "END\r\n";
                            }
                        } else {
                            out = "ERROR\r\n".into();
                        }
                        if w.write_all(out.as_bytes()).is_err() {
                            break;
                        }
                    }
                });
            }
        });
    }
    (map, counts)
}

fn hot_args(map: &ClusterMap, multiget: usize) -> BenchArgs {
    BenchArgs {
        server: vec![map.servers()[0].main.to_string()],
        routed: true,
        quiet: true,
        keys: 50,
        duration: Some(30.0),
        max_ops: Some(4000),
        conns: 2,
        threads: 1,
        pipeline: 4,
        multiget,
        workload: WorkloadKind::A,
        server_load: ServerLoadMode::Off,
        ..BenchArgs::default()
    }
}

#[test]
fn routed_reads_hot_keys_at_their_copies() {
    use std::sync::atomic::Ordering;
    for multiget in [1, 5] {
        let (map, counts) = hot_fakes(false);
        let r = run_with(hot_args(&map, multiget), &RoutedFactory::with_map(map)).unwrap();
        let t = &r.totals;
        assert_eq!((t.ops, t.errors, t.unfinished), (4000, 0, 0), "{t:?}");
        assert_eq!(t.hits, t.get_keys, "every read answered, at home or at a copy");
        let copy_reads: u64 = counts.iter().map(|c| c[1].load(Ordering::Relaxed)).sum();
        let home_reads: u64 = counts.iter().map(|c| c[0].load(Ordering::Relaxed)).sum();
        assert_eq!(t.replica_reads, copy_reads, "the copies served what the bench counts");
        assert_eq!(home_reads + copy_reads, t.get_keys);
        assert_eq!(t.replica_fallbacks, 0);
        // with one copy per key and long leases, about half the leases draw the copy
        assert!(t.replica_reads > t.get_keys / 5, "{t:?}");
        assert!(home_reads > t.get_keys / 5, "{t:?}");
    }
}

#[test]
fn routed_falls_back_home_when_a_copy_redirects() {
    use std::sync::atomic::Ordering;
    let (map, counts) = hot_fakes(true);
    let r = run_with(hot_args(&map, 1), &RoutedFactory::with_map(map)).unwrap();
    let t = &r.totals;
    assert_eq!((t.ops, t.errors, t.unfinished), (4000, 0, 0), "{t:?}");
    assert_eq!(t.hits, t.get_keys, "every read answered at home in the end");
    assert_eq!(t.replica_reads, 0);
    assert!(t.replica_fallbacks > 0, "{t:?}");
    assert_eq!(counts.iter().map(|c| c[0].load(Ordering::Relaxed)).sum::<u64>(), t.get_keys);
    assert_eq!(t.redirects, 0, "an RD from a copy teaches the router nothing");
}
