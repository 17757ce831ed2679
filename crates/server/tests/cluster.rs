//! Cluster mode, routed connections, redirects and cachelet moves between
//! workers, over real sockets.

mod common;
use common::*;
use mbal_cluster::{key_hash, ClusterMap};
use mbal_member::{ClusterSpec, ServerSpec};
use mbal_server::config::Settings;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A key whose cachelet is owned by `worker` on server `server` in `map`.
fn key_on(map: &ClusterMap, server: u16, worker: u16, salt: &str) -> String {
    (0..100_000)
        .map(|i| format!("{salt}{i}"))
        .find(|k| {
            let (_, s, w) = map.route(key_hash(k.as_bytes()));
            (s, w) == (server, worker)
        })
        .expect("some key lands on every worker")
}

fn fetch_map(c: &mut Conn) -> ClusterMap {
    c.send(b"mbal map\r\n");
    let l = c.line();
    let mut it = l.split_whitespace();
    assert_eq!(it.next(), Some("MAP"), "{l}");
    let _epoch: u64 = it.next().unwrap().parse().unwrap();
    let n: usize = it.next().unwrap().parse().unwrap();
    let body = c.exact(n + 2);
    ClusterMap::from_json(std::str::from_utf8(&body[..n]).unwrap()).unwrap()
}

#[test]
fn routed_connection_gets_redirects_plain_does_not() {
    let srv = start(settings(2));
    let mut plain = Conn::open(srv.main_addr);
    let map = fetch_map(&mut plain);
    assert_eq!(map.servers()[0].workers, srv.worker_addrs);
    let k0 = key_on(&map, 0, 0, "a");
    let k1 = key_on(&map, 0, 1, "b");

    // Routed connection on worker 0's own port.
    let mut r = Conn::open(srv.worker_addrs[0]);
    assert_eq!(r.cmd("mbal hello 1\r\n"), "MBAL 0 0 1\r\n");
    assert_eq!(r.set(&k0, b"zero"), "STORED\r\n");
    assert_eq!(r.set(&k1, b"one"), "RD 1 0 1\r\n", "worker 1 owns k1");
    assert_eq!(r.cmd(&format!("mg {k1} v\r\n")), "RD 1 0 1\r\n");
    assert_eq!(r.cmd(&format!("get {k0} {k1}\r\n")), "RD 1 0 1\r\n", "mixed multi-get is redirected whole");
    assert_eq!(r.get(&k0).as_deref(), Some(&b"zero"[..]), "the pipeline goes on after a redirect");

    // The same requests on a plain connection to the same port are served.
    let mut p = Conn::open(srv.worker_addrs[0]);
    assert_eq!(p.set(&k1, b"one"), "STORED\r\n");
    assert_eq!(p.get(&k1).as_deref(), Some(&b"one"[..]));
    let mut r1 = Conn::open(srv.worker_addrs[1]);
    assert_eq!(r1.cmd("mbal hello 1\r\n"), "MBAL 0 1 1\r\n");
    assert_eq!(r1.get(&k1).as_deref(), Some(&b"one"[..]));
    let st = stats(&mut plain, "");
    assert!(stat(&mut plain, "redirects") >= 3, "{st:?}");
    assert_eq!(r.cmd("mbal bogus\r\n").split(' ').next(), Some("CLIENT_ERROR"));
    srv.shutdown();
}

#[test]
fn a_connection_routed_by_thread_is_served_its_thread_mates_keys() {
    // 4 workers on 2 threads (fixed): {0, 2} and {1, 3}
    let srv = start(Settings { worker_threads: 2, ..settings(4) });
    let mut plain = Conn::open(srv.main_addr);
    let map = fetch_map(&mut plain);
    let k: Vec<String> = (0..4).map(|w| key_on(&map, 0, w, &format!("w{w}-"))).collect();
    let mut r = Conn::open(srv.worker_addrs[0]);
    assert_eq!(r.cmd("mbal hello 1 0 threads\r\n"), "MBAL 0 0 1 2\r\n");
    assert_eq!(r.set(&k[0], b"zero"), "STORED\r\n");
    assert_eq!(r.set(&k[2], b"two"), "STORED\r\n", "worker 2 shares worker 0's thread");
    assert_eq!(r.cmd(&format!("mg {} v\r\n", k[2])), "VA 3\r\n");
    assert_eq!(r.line(), "two\r\n");
    r.send(format!("get {} {}\r\n", k[2], k[0]).as_bytes());
    assert_eq!(r.line(), format!("VALUE {} 0 3\r\n", k[2]));
    assert_eq!(r.line(), "two\r\n");
    assert_eq!(r.line(), format!("VALUE {} 0 4\r\n", k[0]));
    assert_eq!(r.line(), "zero\r\n");
    assert_eq!(r.line(), "END\r\n");
    assert_eq!(r.set(&k[1], b"one"), "RD 1 0 1\r\n", "worker 1 does not");
    // After a redirect to a worker, no thread-mate's key is served on the connection (a later
    // write of the pipeline must not overtake the redirected one) until a new hello.
    assert_eq!(r.set(&k[2], b"2"), "RD 1 0 2\r\n");
    assert_eq!(r.set(&k[0], b"0"), "STORED\r\n", "its own worker's keys still are");
    assert_eq!(r.cmd("mbal hello 1 0 threads\r\n"), "MBAL 0 0 1 2\r\n");
    assert_eq!(r.set(&k[2], b"2"), "STORED\r\n");
    let mixed = r.cmd(&format!("get {} {}\r\n", k[0], k[3]));
    assert_eq!(mixed, "RD 1 0 3\r\n", "a multi-get with a key of the other thread");
    // without `threads`, a routed connection is served its own worker's keys only
    let mut own = Conn::open(srv.worker_addrs[0]);
    assert_eq!(own.cmd("mbal hello 1\r\n"), "MBAL 0 0 1\r\n");
    assert_eq!(own.set(&k[2], b"2"), "RD 1 0 2\r\n");
    assert_eq!(stat(&mut plain, "redirects"), 4);
    srv.shutdown();

    // With an emulated capacity each worker pays for its own requests: one "thread" per worker.
    let srv = start(Settings { worker_threads: 2, worker_capacity: 1_000_000, ..settings(4) });
    let mut r = Conn::open(srv.worker_addrs[0]);
    assert_eq!(r.cmd("mbal hello 1 0 threads\r\n"), "MBAL 0 0 1 4\r\n");
    assert_eq!(r.set(&k[2], b"two"), "RD 1 0 2\r\n");
    srv.shutdown();
}

#[test]
fn moving_a_cachelet_keeps_every_item_and_every_reader_consistent() {
    let srv = start(settings(2));
    let addr = srv.main_addr;
    let mut admin = Conn::open(addr);
    let map = fetch_map(&mut admin);
    let c = map.route(key_hash(b"hot0")).0;
    // Preload keys of that cachelet.
    let keys: Vec<String> = (0..100_000)
        .map(|i| format!("hot{i}"))
        .filter(|k| map.route(key_hash(k.as_bytes())).0 == c)
        .take(200)
        .collect();
    for k in &keys {
        assert_eq!(admin.set(k, k.as_bytes()), "STORED\r\n");
    }
    // Writers/readers on plain connections (both workers via SO_REUSEPORT)
    // and routed ones, while the cachelet moves back and forth.
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for t in 0..3 {
        let stop = stop.clone();
        let keys = keys.clone();
        threads.push(std::thread::spawn(move || {
            let mut conn = Conn::open(addr);
            let mut rounds = 0u64;
            // Bounded: stops when told, or after 200k operations.
            while !stop.load(Ordering::Relaxed) && rounds < 200_000 {
                let k = &keys[(rounds as usize * 7 + t) % keys.len()];
                let v = format!("{k}-{t}-{rounds}");
                let mine = format!("{k}-t{t}");
                // A per-thread key: the thread's own last write must be read back.
                assert_eq!(conn.set(&mine, v.as_bytes()), "STORED\r\n");
                assert_eq!(conn.get(&mine).as_deref(), Some(v.as_bytes()), "read-your-writes across a move");
                // A shared key: never missing (nobody deletes), always some thread's value or the preload.
                let got = conn.get(k).expect("preloaded key vanished during a move");
                assert!(got.starts_with(k.as_bytes()), "foreign value {:?}", String::from_utf8_lossy(&got));
                rounds += 1;
            }
            rounds
        }));
    }
    let mut last_epoch = 1;
    let mut to = map.owner(c).1 as usize;
    for _ in 0..40 {
        to = 1 - to;
        let l = admin.cmd(&format!("mbal move {c} {to}\r\n"));
        assert!(l.starts_with("MOVED "), "{l}");
        let e: u64 = l.trim_end()[6..].parse().unwrap();
        assert!(e > last_epoch, "epoch only grows");
        last_epoch = e;
        let m = fetch_map(&mut admin);
        assert_eq!(m.owner(c), (0, to as u16));
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        assert!(t.join().expect("client thread") > 0);
    }
    for k in &keys {
        assert!(admin.get(k).is_some(), "{k} survived 40 moves");
    }
    let cl = stats(&mut admin, "cachelets");
    let items: u64 =
        cl.iter().find(|(n, _)| n == &format!("cachelet:{c}:items")).map(|(_, v)| v.parse().unwrap()).unwrap();
    assert!(items >= keys.len() as u64);
    srv.shutdown();
}

fn free_ports(n: usize) -> Vec<u16> {
    let ls: Vec<std::net::TcpListener> = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    ls.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

#[test]
fn three_server_cluster_serves_only_its_partition() {
    // Ports: main, worker0, worker1 per server.
    let ports = free_ports(9);
    let spec = ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 1024,
        cachelets_per_worker: 4,
        workers: 2,
        servers: (0..3)
            .map(|i| ServerSpec {
                addr: format!("127.0.0.1:{}", ports[i * 3]).parse().unwrap(),
                worker_port_base: Some(ports[i * 3 + 1]),
            })
            .collect(),
        secret: None,
        secret_file: None,
        tls: None,
    };
    // Worker ports must be consecutive: pick a consecutive pair per server.
    let spec = consecutive(spec);
    let servers: Vec<_> = (0..3)
        .map(|id| {
            let mut s = settings(2);
            s.apply_cluster(spec.clone(), id).unwrap();
            start(s)
        })
        .collect();
    let map = spec.initial_map();
    for (id, srv) in servers.iter().enumerate() {
        let mut c = Conn::open(srv.main_addr);
        assert_eq!(fetch_map(&mut c), map);
        let mine = key_on(&map, id as u16, 1, "m");
        let other = key_on(&map, ((id + 1) % 3) as u16, 0, "o");
        assert_eq!(c.set(&mine, b"v"), "STORED\r\n");
        assert_eq!(c.get(&mine).as_deref(), Some(&b"v"[..]));
        // Standard replies only, never the wrong partition.
        assert_eq!(c.set(&other, b"v"), "SERVER_ERROR key is served by another mbal server\r\n");
        assert_eq!(c.get(&other), None);
        assert_eq!(c.cmd(&format!("delete {other}\r\n")), "NOT_FOUND\r\n");
        assert_eq!(c.cmd(&format!("incr {other} 1\r\n")), "NOT_FOUND\r\n");
        c.send(format!("get {mine} {other}\r\n").as_bytes());
        assert_eq!(c.until_end().len(), 2, "only {mine}'s VALUE line and data");
        // A routed connection is told where the key lives.
        let mut r = Conn::open(srv.worker_addrs[0]);
        r.cmd("mbal hello 1\r\n");
        assert_eq!(r.cmd(&format!("mg {other} v\r\n")), format!("RD 1 {} 0\r\n", (id + 1) % 3));
    }
    for s in servers {
        s.shutdown();
    }
}

/// Rewrite a spec so each server's two worker ports are consecutive free ports.
fn consecutive(mut spec: ClusterSpec) -> ClusterSpec {
    for s in spec.servers.iter_mut() {
        loop {
            let base = free_ports(1)[0];
            if base < 65000 && std::net::TcpListener::bind(("127.0.0.1", base + 1)).is_ok() {
                s.worker_port_base = Some(base);
                break;
            }
        }
    }
    spec
}
