//! Unit tests: routing, key checks, multi-get reassembly, and the client's
//! behaviour against small scripted fake servers on loopback (redirect
//! loops, non-mbal servers, mismatched hello, timeouts, reconnects).

use super::*;
use crate::multi::assign;
use mbal_cluster::ServerInfo;
use mbal_member::ServerSpec;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn spec_map(servers: u16, workers: u16) -> ClusterMap {
    let spec = ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 1024,
        cachelets_per_worker: 4,
        workers,
        servers: (0..servers)
            .map(|i| ServerSpec {
                addr: format!("127.0.0.1:{}", 30000 + i * 10).parse().unwrap(),
                worker_port_base: Some(30001 + i * 10),
            })
            .collect(),
        secret: None,
        secret_file: None,
        tls: None,
    };
    spec.initial_map()
}

#[test]
fn routing_follows_the_map_and_spreads_keys() {
    let map = spec_map(3, 2);
    let c = Client::from_map(map.clone(), Config::default());
    let mut per = HashMap::new();
    for i in 0..6000 {
        let k = format!("key:{i}");
        let r = c.route(k.as_bytes());
        assert_eq!(r, map.route(key_hash(k.as_bytes())));
        *per.entry((r.1, r.2)).or_insert(0u32) += 1;
    }
    assert_eq!(per.len(), 6, "every worker of every server gets keys: {per:?}");
    for (&w, &n) in &per {
        assert!((600..1400).contains(&n), "worker {w:?} got {n} of 6000 keys");
    }
}

#[test]
fn overrides_change_only_their_cachelet() {
    let map = spec_map(2, 2);
    let mut c = Client::from_map(map.clone(), Config::default());
    let (cl, s, w) = c.route(b"hello");
    let to = (1 - s, 1 - w);
    let h = vec![key_hash(b"hello")];
    c.learn(vec![Seen { from: (s, w), rd: Redirect { epoch: 1, to }, hashes: h.clone() }]).unwrap();
    assert_eq!(c.route(b"hello"), (cl, to.0, to.1));
    for i in 0..2000 {
        let k = format!("k{i}");
        let want = map.route(key_hash(k.as_bytes()));
        let got = c.route(k.as_bytes());
        if want.0 == cl {
            assert_eq!(got, (cl, to.0, to.1));
        } else {
            assert_eq!(got, want);
        }
    }
    // A redirect naming a worker the map does not have is refused.
    let bad = c.learn(vec![Seen { from: (s, w), rd: Redirect { epoch: 1, to: (9, 0) }, hashes: h }]);
    assert!(matches!(bad, Err(Error::Protocol { .. })), "{bad:?}");
}

#[test]
fn key_rules() {
    assert!(check_key(b"a").is_ok());
    assert!(check_key(&[b'x'; 250]).is_ok());
    for bad in [&b""[..], &[b'x'; 251][..], b"a b", b"a\r\nset", b"\x7f", b"tab\t"] {
        assert!(matches!(check_key(bad), Err(Error::InvalidKey { .. })), "{bad:?}");
    }
    let mut c = Client::from_map(spec_map(1, 1), Config::default());
    // Refused before any connection is attempted (nothing listens there).
    assert!(matches!(c.set(b"a b", b"v", 0, 0), Err(Error::InvalidKey { .. })));
    assert!(matches!(c.get_multi(&[b"ok", b""]), Err(Error::InvalidKey { .. })));
}

#[test]
fn assign_matches_values_to_keys_in_order() {
    let keys: Vec<&[u8]> = vec![b"a", b"b", b"a", b"c"];
    let mut out = vec![None; 4];
    let rv = |k: &str, d: &str| OwnedValue { key: k.into(), flags: 0, data: d.into(), cas: None };
    assign(&keys, &[0, 1, 2, 3], vec![rv("a", "1"), rv("a", "2"), rv("c", "3")], &mut out).unwrap();
    let data: Vec<Option<&[u8]>> = out.iter().map(|v| v.as_ref().map(|v| v.data.as_slice())).collect();
    assert_eq!(data, vec![Some(&b"1"[..]), None, Some(b"2"), Some(b"3")]);
    let mut out = vec![None; 4];
    assert!(assign(&keys, &[0, 1, 2, 3], vec![rv("c", "1"), rv("a", "2")], &mut out).is_err(), "out of order");
    assert!(assign(&keys, &[1], vec![rv("z", "1")], &mut out).is_err(), "not asked for");
}

/// A scripted server: `reply(line)` gives the bytes to answer a request
/// line with (`None` closes the connection). Serves at most `conns`
/// connections; data blocks of storage commands are skipped.
fn fake(
    conns: usize,
    reply: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let acc = accepted.clone();
    let reply = Arc::new(reply);
    std::thread::spawn(move || {
        for s in l.incoming().take(conns) {
            let Ok(s) = s else { return };
            acc.fetch_add(1, Ordering::SeqCst);
            let reply = reply.clone();
            std::thread::spawn(move || {
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let mut w = s.try_clone().unwrap();
                let mut r = BufReader::new(s);
                for _ in 0..10_000 {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let words: Vec<&str> = line.split_whitespace().collect();
                    if matches!(words.first(), Some(&"set")) {
                        let n: usize = words[4].parse().unwrap();
                        let mut skip = vec![0; n + 2];
                        std::io::Read::read_exact(&mut r, &mut skip).unwrap();
                    }
                    match reply(line.trim_end()) {
                        Some(out) => {
                            if w.write_all(out.as_bytes()).is_err() {
                                return;
                            }
                        }
                        None => return,
                    }
                }
            });
        }
    });
    (addr, accepted)
}

fn one_server_map(main: SocketAddr, workers: Vec<SocketAddr>) -> ClusterMap {
    ClusterMap::even(vec![ServerInfo { main, workers }], 1, 64)
}

fn quick() -> Config {
    Config { connect_timeout: Duration::from_secs(2), io_timeout: Duration::from_secs(5), ..Config::default() }
}

#[test]
fn redirect_ping_pong_gives_up_after_max_redirects() {
    // Worker 0 says worker 1 owns everything, worker 1 says worker 0 does.
    let hello = |w: u16| {
        move |l: &str| -> Option<String> {
            Some(if l.starts_with("mbal hello") {
                format!("MBAL 0 {w} 1\r\n")
            } else {
                format!("RD 1 0 {}\r\n", 1 - w)
            })
        }
    };
    let (a0, _) = fake(4, hello(0));
    let (a1, _) = fake(4, hello(1));
    let mut c = Client::from_map(one_server_map(a0, vec![a0, a1]), quick());
    match c.get(b"k") {
        Err(Error::TooManyRedirects { key, redirects: 4 }) => assert_eq!(key, "k"),
        r => panic!("{r:?}"),
    }
    assert_eq!(c.redirects(), u64::from(mbal_cluster::MAX_REDIRECTS));
    assert!(matches!(c.get_multi(&[b"a", b"b", b"c"]), Err(Error::TooManyRedirects { .. })));
    assert!(matches!(c.set_multi(&[(b"a", b"1")], 0, 0), Err(Error::TooManyRedirects { .. })));
    assert!(c.redirects() > 3);
}

/// A server behind the client's map (it has not heard that the dead server's cachelets are
/// its own now) redirects to the dead server: the redirect is followed, forgotten when the
/// dead server cannot be reached (or is in its backoff), so that the next request goes to the
/// map's owner again (kept, the redirect sent that cachelet to the dead server until the next
/// map: seconds).
#[test]
fn a_redirect_to_a_dead_server_from_a_server_behind_the_map_is_forgotten_when_it_fails() {
    let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // closed now
    let sets = Arc::new(AtomicUsize::new(0));
    let n = sets.clone();
    let (a, _) = fake(4, move |l: &str| -> Option<String> {
        Some(if l.starts_with("mbal hello") {
            "MBAL 0 0 1\r\n".into()
        } else if l.starts_with("mbal map") {
            "MAP 1 0\r\n\r\n".into() // its map is older than the client's: nothing sent
        } else if n.fetch_add(1, Ordering::SeqCst).is_multiple_of(2) {
            "RD 1 1 0\r\n".into() // epoch 1: the dead server owned the key
        } else {
            "STORED\r\n".into()
        })
    });
    let servers = vec![ServerInfo { main: a, workers: vec![a] }, ServerInfo { main: dead, workers: vec![dead] }];
    let mut map = ClusterMap::even(servers, 2, 64);
    let c = map.keyspace().cachelet_of_hash(key_hash(b"k"));
    map.move_cachelet(c, (0, 0)); // epoch 2: the key is server 0's
    assert_eq!((map.epoch(), map.owner(c)), (2, (0, 0)));
    let mut cl = Client::from_map(map, quick());
    let unreachable =
        |r: Result<bool>| matches!(r, Err(Error::Unreachable { peer: Peer::Worker { server: 1, .. }, .. }));
    assert!(unreachable(cl.set(b"k", b"v", 0, 0)), "the redirect is followed to the dead server");
    assert_eq!(cl.route(b"k"), (c, 0, 0), "and forgotten when it failed");
    assert!(cl.set(b"k", b"v", 0, 0).unwrap(), "the map's owner took it");
    assert_eq!(sets.load(Ordering::SeqCst), 2);
    // The same redirect while the dead server is in its backoff: forgotten there too (that
    // request is answered as the dead server's: sent home, it would be redirected again).
    assert!(unreachable(cl.set(b"k", b"v", 0, 0)), "redirected, found in its backoff");
    assert_eq!(sets.load(Ordering::SeqCst), 3);
    assert_eq!(cl.route(b"k"), (c, 0, 0), "forgotten");
    assert!(cl.set(b"k", b"v", 0, 0).unwrap());
    assert_eq!(sets.load(Ordering::SeqCst), 4);
}

#[test]
fn an_older_mbal_without_threads_is_routed_per_worker() {
    // An mbal from before `mbal hello <epoch> <worker> threads` refuses the word.
    let old = |w: u16| {
        move |l: &str| -> Option<String> {
            Some(if l.starts_with("mbal hello") && l.ends_with("threads") {
                "CLIENT_ERROR unknown mbal command\r\n".into()
            } else if l.starts_with("mbal hello") {
                format!("MBAL 0 {w} 1\r\n")
            } else {
                "STORED\r\n".into()
            })
        }
    };
    let (a0, _) = fake(4, old(0));
    let (a1, _) = fake(4, old(1));
    let mut c = Client::from_map(one_server_map(a0, vec![a0, a1]), quick());
    for i in 0..20 {
        assert!(c.set(format!("k{i}").as_bytes(), b"v", 0, 0).unwrap());
    }
    assert_eq!(c.server_threads(0), 0, "per worker");
    assert_eq!(c.connected(), vec![(0, 0), (0, 1)]);
}

#[test]
fn plain_memcached_is_not_mbal() {
    let (a, _) = fake(4, |_| Some("ERROR\r\n".into()));
    assert!(matches!(Client::connect(a, quick()), Err(Error::NotMbal { addr }) if addr == a));
    let mut c = Client::from_map(one_server_map(a, vec![a]), quick());
    let e = c.get(b"k").unwrap_err();
    assert!(matches!(e, Error::NotMbal { .. }), "{e:?}");
}

#[test]
fn hello_from_the_wrong_worker_is_refused() {
    let (a, _) = fake(2, |l| Some(if l.starts_with("mbal") { "MBAL 0 1 1\r\n".into() } else { "END\r\n".into() }));
    let mut c = Client::from_map(one_server_map(a, vec![a]), quick());
    let e = c.get(b"k").unwrap_err();
    assert!(matches!(e, Error::Protocol { .. }), "{e:?}");
    assert!(e.to_string().contains("server 0 worker 0"), "{e}");
}

#[test]
fn a_timeout_is_a_miss_for_a_read_and_an_error_naming_the_worker_for_a_write() {
    // First connection: answers hello, then never answers. Later connections answer normally.
    let first = Arc::new(AtomicUsize::new(0));
    let f = first.clone();
    let (a, accepted) = fake(4, move |l| {
        if l.starts_with("mbal hello") {
            f.fetch_add(1, Ordering::SeqCst);
            return Some("MBAL 0 0 1\r\n".into());
        }
        if f.load(Ordering::SeqCst) == 1 {
            Some(String::new()) // silence
        } else if l.starts_with("set") {
            Some("STORED\r\n".into())
        } else {
            Some("VALUE k 3 2\r\nhi\r\nEND\r\n".into())
        }
    });
    let cfg = Config { io_timeout: Duration::from_millis(200), ..quick() };
    let mut c = Client::from_map(one_server_map(a, vec![a]), cfg);
    // the read times out: a miss, counted, and the server is in its backoff
    assert_eq!(c.get(b"k").unwrap(), None);
    assert_eq!((c.stats().unreachable, c.stats().unreachable_misses), (1, 1));
    // a write for it during the backoff: an error naming the worker, without the network
    match c.set(b"k", b"v", 0, 0) {
        Err(Error::Unreachable { addr, peer: Peer::Worker { server: 0, worker: 0 }, reason }) => {
            assert_eq!(addr, a);
            assert!(reason.contains("timed out"), "{reason}");
        }
        Ok(_) if !c.is_down(0) => {} // (a slow machine: the backoff ended first)
        r => panic!("{r:?}"),
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "not redialed during the backoff");
    // after the backoff the next call dials again, and the new connection is used and kept
    let t0 = Instant::now();
    let v = loop {
        if let Some(v) = c.get(b"k").unwrap() {
            break v;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "never retried");
        std::thread::sleep(Duration::from_millis(10)); // the backoff is time, not an event
    };
    assert_eq!((v.data.as_slice(), v.flags), (&b"hi"[..], 3));
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "the timed-out connection was replaced");
    c.get(b"k").unwrap();
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    assert!(!c.is_down(0));
}

#[test]
fn server_errors_are_reported_and_the_connection_kept() {
    let (a, accepted) = fake(4, |l| {
        Some(match l.split(' ').next().unwrap() {
            "mbal" => "MBAL 0 0 1\r\n".into(),
            "incr" => "CLIENT_ERROR cannot increment or decrement non-numeric value\r\n".into(),
            "set" => "SERVER_ERROR object too large for cache\r\n".into(),
            _ => "NOT_FOUND\r\n".into(),
        })
    });
    let mut c = Client::from_map(one_server_map(a, vec![a]), quick());
    let e = c.incr(b"k", 1).unwrap_err();
    assert!(matches!(&e, Error::Server { line, .. } if line.starts_with("CLIENT_ERROR")), "{e:?}");
    let e = c.set(b"k", b"v", 0, 0).unwrap_err();
    assert!(e.to_string().contains("SERVER_ERROR object too large"), "{e}");
    assert!(!c.delete(b"k").unwrap());
    assert_eq!(c.decr(b"k", 1).unwrap(), None);
    assert!(!c.touch(b"k", 1).unwrap());
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[test]
fn an_unexpected_reply_is_a_protocol_error() {
    let (a, _) = fake(4, |l| Some(if l.starts_with("mbal") { "MBAL 0 0 1\r\n".into() } else { "DELETED\r\n".into() }));
    let mut c = Client::from_map(one_server_map(a, vec![a]), quick());
    assert!(matches!(c.set(b"k", b"v", 0, 0), Err(Error::Protocol { .. })));
    assert!(matches!(c.incr(b"k", 1), Err(Error::Protocol { .. })));
    assert!(c.delete(b"k").unwrap());
}

#[test]
fn cluster_file_errors_name_the_file() {
    let e = Client::from_cluster_file(Path::new("/nonexistent/cluster.toml"), Config::default()).err().unwrap();
    assert!(e.to_string().contains("/nonexistent/cluster.toml"), "{e}");
    let dir = std::env::temp_dir().join(format!("mbal-client-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("c.toml");
    std::fs::write(&p, "workers = 2\nservers = []\n").unwrap();
    assert!(matches!(Client::from_cluster_file(&p, Config::default()), Err(Error::Config { .. })));
    std::fs::write(
        &p,
        "workers = 2\n[[servers]]\naddr = \"127.0.0.1:7000\"\nworker_port_base = 7001\n\
         [[servers]]\naddr = \"127.0.0.1:7100\"\nworker_port_base = 7101\n",
    )
    .unwrap();
    let c = Client::from_cluster_file(&p, Config::default()).unwrap();
    assert_eq!(c.map().servers().len(), 2);
    assert_eq!(c.map().worker_addr(1, 1).port(), 7102);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two one-worker fake servers: the home of every key answers reads with a
/// hint (γ = 1, a long lease) before the value "home"; the other server
/// holds the copy and answers "copy", or `RD` for keys starting with `rd`.
/// `copy_up`: whether the copy server listens at all.
fn hot_pair(copy_up: bool) -> (ClusterMap, Arc<AtomicUsize>) {
    let home_reads = Arc::new(AtomicUsize::new(0));
    let hr = home_reads.clone();
    let values = |who: &'static str, hint: bool, l: &str| -> String {
        let mut out = String::new();
        for k in l.split(' ').skip(1) {
            if hint {
                out += &format!("RH hot {k} 1 60000\r\n");
            }
            out += &format!("VALUE {k} 0 {}\r\n{who}\r\n", who.len());
        }
        out + "END\r\n"
    };
    // which server is whose home is decided by the map: both answer as home
    // for keys they own and as copy otherwise
    let serve = move |me: u16, map: Arc<std::sync::OnceLock<ClusterMap>>, hr: Arc<AtomicUsize>| {
        move |l: &str| -> Option<String> {
            if l.starts_with("mbal hello") {
                return Some(format!("MBAL {me} 0 1\r\n"));
            }
            let w: Vec<&str> = l.split(' ').collect();
            match w[0] {
                "get" | "gets" => {
                    let m = map.get().unwrap();
                    let home = m.route(key_hash(w[1].as_bytes())).1 == me;
                    if home {
                        hr.fetch_add(w.len() - 1, Ordering::SeqCst);
                        Some(values("home", true, l))
                    } else if w[1].starts_with("rd") {
                        Some(format!("RD 1 {} 0\r\n", 1 - me))
                    } else {
                        Some(values("copy", false, l))
                    }
                }
                _ => Some("STORED\r\n".into()),
            }
        }
    };
    let cell = Arc::new(std::sync::OnceLock::new());
    let (a0, _) = fake(16, serve(0, cell.clone(), hr.clone()));
    let a1 = if copy_up {
        fake(16, serve(1, cell.clone(), hr)).0
    } else {
        // a port nothing listens on: connections are refused
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
    };
    let map = ClusterMap::even(
        vec![ServerInfo { main: a0, workers: vec![a0] }, ServerInfo { main: a1, workers: vec![a1] }],
        1,
        64,
    );
    cell.set(map.clone()).unwrap();
    (map, home_reads)
}

/// `n` keys whose home is server `home`.
fn keys_of(map: &ClusterMap, home: u16, n: usize, prefix: &str) -> Vec<String> {
    (0..).map(|i| format!("{prefix}{i}")).filter(|k| map.route(key_hash(k.as_bytes())).1 == home).take(n).collect()
}

fn data(v: Option<Value>) -> String {
    String::from_utf8(v.unwrap().data).unwrap()
}

#[test]
fn hinted_keys_are_read_at_their_drawn_copy_and_writes_read_at_home() {
    let (map, home_reads) = hot_pair(true);
    let mut c = Client::from_map(map.clone(), quick());
    let keys = keys_of(&map, 0, 40, "hot");
    let mut at_copy = 0;
    for k in &keys {
        assert_eq!(data(c.get(k.as_bytes()).unwrap()), "home", "no lease yet");
        let lease = *c.leases().lease(key_hash(k.as_bytes())).expect("the hint granted a lease");
        assert_eq!((lease.home, lease.replicas), ((0, 0), 1));
        let want = if lease.copy == 1 { "copy" } else { "home" };
        if lease.copy == 1 {
            assert_eq!(lease.at, (1, 0));
            at_copy += 1;
        }
        for _ in 0..3 {
            assert_eq!(data(c.get(k.as_bytes()).unwrap()), want, "the same copy for the whole lease");
            assert_eq!(data(c.gets(k.as_bytes()).unwrap()), "home", "gets reads at home");
        }
    }
    assert!((8..=32).contains(&at_copy), "about half the leases draw the copy: {at_copy} of 40");
    assert_eq!(c.replica_reads(), 3 * at_copy as u64);
    assert_eq!(c.replica_fallbacks(), 0);
    // a write ends the writer's lease: its next read goes home
    let k = keys.iter().find(|k| c.leases().lease(key_hash(k.as_bytes())).unwrap().copy == 1).unwrap();
    assert!(c.set(k.as_bytes(), b"new", 0, 0).unwrap());
    assert!(c.leases().lease(key_hash(k.as_bytes())).is_none());
    let before = home_reads.load(Ordering::SeqCst);
    assert_eq!(data(c.get(k.as_bytes()).unwrap()), "home");
    assert_eq!(home_reads.load(Ordering::SeqCst), before + 1);
    // get_multi: keys with a copy lease read there, the rest at home, in order
    let all: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    let want: Vec<&str> = keys
        .iter()
        .map(|k| match c.leases().lease(key_hash(k.as_bytes())) {
            Some(l) if l.copy == 1 => "copy",
            _ => "home",
        })
        .collect();
    let reads = c.replica_reads();
    let got: Vec<String> = c.get_multi(&all).unwrap().into_iter().map(data).collect();
    assert_eq!(got, want);
    assert_eq!(c.replica_reads() - reads, want.iter().filter(|&&w| w == "copy").count() as u64);
    // set_multi ends the leases of its keys
    c.set_multi(&[(all[0], b"x"), (all[1], b"y")], 0, 0).unwrap();
    assert!(c.leases().lease(key_hash(all[0])).is_none() && c.leases().lease(key_hash(all[1])).is_none());
}

#[test]
fn a_copy_that_redirects_or_is_down_falls_back_home_without_error() {
    // RD at the copy: that key's lease ends, the read goes home
    let (map, _) = hot_pair(true);
    let mut c = Client::from_map(map.clone(), quick());
    let keys = keys_of(&map, 0, 40, "rd");
    for k in &keys {
        c.get(k.as_bytes()).unwrap();
    }
    let drew: Vec<&String> =
        keys.iter().filter(|k| c.leases().lease(key_hash(k.as_bytes())).is_some_and(|l| l.copy == 1)).collect();
    assert!(!drew.is_empty());
    for k in &drew {
        assert_eq!(data(c.get(k.as_bytes()).unwrap()), "home");
        // the home's reply granted a new lease, drawn anew
    }
    assert_eq!(c.replica_fallbacks(), drew.len() as u64);
    assert_eq!(c.replica_reads(), 0);
    // the copy's server is down: refused connections, every read still answered
    let (map, _) = hot_pair(false);
    let mut c = Client::from_map(map.clone(), quick());
    let keys = keys_of(&map, 0, 40, "k");
    for k in &keys {
        assert_eq!(data(c.get(k.as_bytes()).unwrap()), "home");
    }
    for _ in 0..3 {
        for k in &keys {
            assert_eq!(data(c.get(k.as_bytes()).unwrap()), "home");
        }
        let all: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let got: Vec<String> = c.get_multi(&all).unwrap().into_iter().map(data).collect();
        assert!(got.iter().all(|g| g == "home"));
    }
    assert!(c.replica_fallbacks() > 0);
    assert_eq!(c.replica_reads(), 0);
}
