//! A dead server costs the routing client misses, not errors or hangs (issue 33, item 3):
//! a REAL two-server cluster in-process, one server shut down (its sockets closed): reads of
//! its keys are misses, at once; writes fail naming it; the other server's keys are served
//! throughout; it is not redialed during its backoff; once it is back its keys are served
//! again. And the map refresh: after the failure the client asks the other server for the map
//! and, once that one has a newer map (here: a live server that owns every cachelet and moved
//! one, so its epoch grew), installs it and sends the dead server's keys where it says.

use mbal_client::{key_hash, Client, ClusterMap, ClusterSpec, Config, Error};
use mbal_cluster::ServerInfo;
use mbal_server::config::Settings;
use mbal_server::ServerHandle;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const WORKERS: u16 = 2;
/// The client's I/O timeout: every call must come back well within it.
const IO_TIMEOUT: Duration = Duration::from_secs(3);

fn settings(spec: &ClusterSpec, id: u16) -> Settings {
    let mut s = Settings { memory_limit: 32 << 20, ..Settings::default() };
    s.apply_cluster(spec.clone(), id).unwrap();
    s.worker_threads = WORKERS as usize;
    s
}

/// Start server `id` of `spec` (on its address; retried while a port is being released).
fn start(spec: &ClusterSpec, id: u16) -> ServerHandle {
    let t0 = Instant::now();
    loop {
        match mbal_server::start(settings(spec, id)) {
            Ok(h) => return h,
            Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::yield_now();
            }
            Err(e) => panic!("start server {id}: {e}"),
        }
    }
}

fn cfg() -> Config {
    Config { io_timeout: IO_TIMEOUT, ..Config::default() }
}

/// `n` keys whose owner is on server `s` in `map`.
fn keys_on(map: &ClusterMap, s: u16, n: usize, prefix: &str) -> Vec<String> {
    (0..).map(|i| format!("{prefix}{i}")).filter(|k| map.route(key_hash(k.as_bytes())).1 == s).take(n).collect()
}

/// Run `f`, and check it came back within the I/O timeout (a dead server must not cost a
/// timeout, let alone a hang).
fn bounded<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let r = f();
    assert!(t0.elapsed() < IO_TIMEOUT, "{what}: took {:?}", t0.elapsed());
    r
}

fn line(addr: SocketAddr, cmd: &str) -> String {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    (&s).write_all(cmd.as_bytes()).unwrap();
    let mut l = String::new();
    BufReader::new(s).read_line(&mut l).unwrap();
    l
}

#[test]
fn a_dead_servers_keys_are_misses_its_writes_errors_and_it_is_used_again_once_back() {
    let spec = mbal_server::testing::loopback_spec(2, WORKERS);
    let mut s0 = Some(start(&spec, 0));
    let mut s1 = Some(start(&spec, 1));
    let map = spec.initial_map();
    let k0 = keys_on(&map, 0, 8, "a");
    let k1 = keys_on(&map, 1, 8, "b");
    let mut c = Client::from_map(map.clone(), cfg());
    for k in k0.iter().chain(&k1) {
        assert!(c.set(k.as_bytes(), k.as_bytes(), 0, 0).unwrap());
    }
    assert_eq!(c.get(k1[0].as_bytes()).unwrap().unwrap().data, k1[0].as_bytes());

    s1.take().unwrap().shutdown();

    // reads of its keys: misses, at once (its pooled connection is found closed, a fresh
    // connect is refused; then its backoff answers without the network)
    for k in &k1 {
        assert_eq!(bounded("get", || c.get(k.as_bytes())).unwrap(), None, "{k}");
    }
    assert_eq!(bounded("gets", || c.gets(k1[0].as_bytes())).unwrap(), None);
    // writes: an error naming the server
    match bounded("set", || c.set(k1[1].as_bytes(), b"x", 0, 0)) {
        Err(e @ Error::Unreachable { .. }) => {
            assert!(e.to_string().contains("server 1"), "{e}");
        }
        r => panic!("a write to a dead server: {r:?}"),
    }
    assert!(matches!(bounded("delete", || c.delete(k1[2].as_bytes())), Err(Error::Unreachable { .. })));
    assert!(matches!(bounded("incr", || c.incr(k1[2].as_bytes(), 1)), Err(Error::Unreachable { .. })));
    // the live server's keys: served throughout
    for k in &k0 {
        assert_eq!(c.get(k.as_bytes()).unwrap().unwrap().data, k.as_bytes());
        assert!(c.set(k.as_bytes(), b"new", 0, 0).unwrap());
    }
    // a multi-get: the live server's values, the dead server's keys left out
    let all: Vec<&[u8]> = k0.iter().chain(&k1).map(|k| k.as_bytes()).collect();
    let got = bounded("get_multi", || c.get_multi(&all)).unwrap();
    assert!(got[..k0.len()].iter().all(|v| v.as_ref().is_some_and(|v| v.data == b"new")), "{got:?}");
    assert!(got[k0.len()..].iter().all(Option::is_none), "{got:?}");
    // a multi-set: fails naming the dead server; the live server's items are stored
    let items: Vec<(&[u8], &[u8])> = vec![(k0[0].as_bytes(), b"m"), (k1[0].as_bytes(), b"m")];
    let e = bounded("set_multi", || c.set_multi(&items, 0, 0)).unwrap_err();
    assert!(matches!(e, Error::Unreachable { .. }) && e.to_string().contains("server 1"), "{e}");
    assert_eq!(c.get(k0[0].as_bytes()).unwrap().unwrap().data, b"m");

    let st = c.stats();
    assert!(st.unreachable >= 1, "{st:?}");
    assert!(st.unreachable_misses >= (k1.len() + 1 + k1.len()) as u64, "{st:?}");
    assert!(st.unreachable_errors >= 4, "{st:?}");
    // the first failure asked the other server for the map (not newer: not installed)
    assert!(st.map_refreshes >= 1, "{st:?}");
    assert_eq!((st.maps_installed, c.map().epoch()), (0, 1), "{st:?}");
    // not redialed for every request: far fewer failures than requests for its keys
    assert!(st.unreachable < st.unreachable_misses + st.unreachable_errors, "{st:?}");

    // it comes back on its address: after the backoff, the next request dials it
    s1 = Some(start(&spec, 1));
    let t0 = Instant::now();
    loop {
        match c.set(k1[0].as_bytes(), b"back", 0, 0) {
            Ok(stored) => {
                assert!(stored);
                break;
            }
            Err(Error::Unreachable { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "never used again");
        std::thread::sleep(Duration::from_millis(20)); // the backoff is time, not an event
    }
    assert!(!c.is_down(1));
    assert_eq!(c.get(k1[0].as_bytes()).unwrap().unwrap().data, b"back");
    for s in [s0.take(), s1.take()].into_iter().flatten() {
        s.shutdown();
    }
}

/// The client's map: the live server's map (one server, every cachelet) with half of the
/// cachelets given to a second server that is not there (`dead`: nothing listens).
fn map_with_a_dead_server(live: &ClusterMap, dead: SocketAddr) -> ClusterMap {
    let owners = live.owners().iter().enumerate().map(|(c, &o)| if c % 2 == 1 { (1, 0) } else { o }).collect();
    let mut servers = live.servers().to_vec();
    servers.push(ServerInfo { main: dead, workers: vec![dead] });
    ClusterMap::new(live.keyspace().clone(), owners, servers)
}

#[test]
fn after_a_failure_the_map_is_refreshed_from_another_server_and_the_keys_go_to_their_new_owner() {
    // the live server: a cluster of one, which owns every cachelet
    let spec = mbal_server::testing::loopback_spec(1, WORKERS);
    let live = start(&spec, 0);
    let live_map = Client::connect(spec.servers[0].addr, cfg()).unwrap().map().clone();
    assert_eq!(live_map.epoch(), 1);
    let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // closed again
    let mut c = Client::from_map(map_with_a_dead_server(&live_map, dead), cfg());
    let kd = keys_on(c.map(), 1, 4, "d");
    assert_eq!(c.route(kd[0].as_bytes()).1, 1);

    // the failure asks server 0 for the map: its epoch is the client's, nothing changes
    assert_eq!(bounded("get", || c.get(kd[0].as_bytes())).unwrap(), None);
    let st = c.stats();
    assert_eq!((st.unreachable, st.unreachable_misses, st.map_refreshes, st.maps_installed), (1, 1, 1, 0));

    // the cluster reassigns (here: the live server moves a cachelet, so its map is newer and
    // names only itself; a coordinator would give it the dead server's cachelets)
    let c0 = live_map.cachelets_of(0, 0)[0];
    assert_eq!(line(spec.servers[0].addr, &format!("mbal move {c0} 1\r\n")), "MOVED 2\r\n");

    // the next failure after the backoff refreshes again, installs it, and the key's request
    // goes to its new owner: a write to the dead server's key is stored, by the live server
    let t0 = Instant::now();
    loop {
        match c.set(kd[0].as_bytes(), b"moved", 0, 0) {
            Ok(stored) => {
                assert!(stored);
                break;
            }
            Err(Error::Unreachable { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the newer map was never installed");
        std::thread::sleep(Duration::from_millis(20)); // the backoff is time, not an event
    }
    assert_eq!(c.map().epoch(), 2);
    assert_eq!(c.map().servers().len(), 1, "the live server's map");
    assert_eq!(c.route(kd[0].as_bytes()).1, 0);
    let st = c.stats();
    assert_eq!(st.maps_installed, 1, "{st:?}");
    assert!(st.map_refreshes >= 2, "{st:?}");
    // every key of the dead server is served by the live one now
    for k in &kd {
        assert!(c.set(k.as_bytes(), k.as_bytes(), 0, 0).unwrap());
        assert_eq!(c.get(k.as_bytes()).unwrap().unwrap().data, k.as_bytes());
    }
    let all: Vec<&[u8]> = kd.iter().map(|k| k.as_bytes()).collect();
    let got = c.get_multi(&all).unwrap();
    assert!(got.iter().zip(&kd).all(|(v, k)| v.as_ref().is_some_and(|v| v.data == k.as_bytes())), "{got:?}");
    assert_eq!(
        line(spec.servers[0].addr, &format!("get {}\r\n", kd[1])),
        format!("VALUE {} 0 {}\r\n", kd[1], kd[1].len())
    );
    live.shutdown();
}
