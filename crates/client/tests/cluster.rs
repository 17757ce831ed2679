//! The client against a REAL 3-server mbal cluster (2 workers each) started
//! in-process on loopback ports: every operation, multi-get and multi-set
//! across all servers, a stale map, cluster stats, and cachelet moves while a
//! client thread keeps reading and writing.

use mbal_client::{
    cluster_stats, key_hash, render_stats_table, CasResult, Client, ClusterMap, ClusterSpec, Config, Error,
};
use mbal_member::ServerSpec;
use mbal_server::config::Settings;
use mbal_server::ServerHandle;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WORKERS: u16 = 2;

struct Cluster {
    spec: ClusterSpec,
    servers: Vec<ServerHandle>,
}

impl Cluster {
    /// Three servers on free loopback ports (main port, then two
    /// consecutive worker ports each). Retries if a port was taken between
    /// choosing and binding it.
    fn start() -> Cluster {
        for _ in 0..10 {
            let spec = free_spec(3);
            let mut servers = Vec::new();
            for id in 0..3 {
                let mut s = Settings { memory_limit: 32 << 20, ..Settings::default() };
                s.apply_cluster(spec.clone(), id).unwrap();
                // A thread per worker, whatever the load: the redirects these tests count
                // would not be sent between workers the thread policy had put on one thread
                // (tests/threads.rs covers those).
                s.worker_threads = WORKERS as usize;
                match mbal_server::start(s) {
                    Ok(h) => servers.push(h),
                    Err(_) => break,
                }
            }
            if servers.len() == 3 {
                return Cluster { spec, servers };
            }
            for s in servers {
                s.shutdown();
            }
        }
        panic!("could not start a cluster on free ports");
    }

    fn map(&self) -> ClusterMap {
        self.spec.initial_map()
    }

    fn stop(self) {
        for s in self.servers {
            s.shutdown();
        }
    }
}

fn free_spec(n: usize) -> ClusterSpec {
    let mut held = Vec::new();
    let mut servers = Vec::new();
    while servers.len() < n {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p > 65000 {
            continue;
        }
        let (Ok(a), Ok(b)) = (TcpListener::bind(("127.0.0.1", p + 1)), TcpListener::bind(("127.0.0.1", p + 2))) else {
            continue;
        };
        servers.push(ServerSpec { addr: format!("127.0.0.1:{p}").parse().unwrap(), worker_port_base: Some(p + 1) });
        held.extend([l, a, b]);
    }
    ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 1024,
        cachelets_per_worker: 4,
        workers: WORKERS,
        servers,
        secret: None,
        secret_file: None,
        tls: None,
    }
}

fn cfg() -> Config {
    Config { io_timeout: Duration::from_secs(10), ..Config::default() }
}

/// A plain (non-routed) text connection, for admin commands and checks.
struct Plain {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Plain {
    fn open(addr: SocketAddr) -> Plain {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Plain { r: BufReader::new(s.try_clone().unwrap()), w: s }
    }

    fn cmd(&mut self, c: &str) -> String {
        self.w.write_all(c.as_bytes()).unwrap();
        let mut l = String::new();
        self.r.read_line(&mut l).unwrap();
        l
    }

    /// Does this server hold `key`? (`get` on its main port: a server
    /// answers a miss for keys of other servers.)
    fn holds(&mut self, key: &str) -> bool {
        let first = self.cmd(&format!("get {key}\r\n"));
        if first == "END\r\n" {
            return false;
        }
        assert!(first.starts_with("VALUE "), "{first}");
        let mut rest = String::new();
        while rest != "END\r\n" {
            rest.clear();
            self.r.read_line(&mut rest).unwrap();
        }
        true
    }
}

/// Keys of every (server, worker), `per` each.
fn keys_everywhere(map: &ClusterMap, per: usize) -> Vec<String> {
    let mut count: HashMap<(u16, u16), usize> = HashMap::new();
    let mut out = Vec::new();
    for i in 0..100_000 {
        let k = format!("key:{i}");
        let (_, s, w) = map.route(key_hash(k.as_bytes()));
        let n = count.entry((s, w)).or_default();
        if *n < per {
            *n += 1;
            out.push(k);
        }
        if out.len() == per * 3 * WORKERS as usize {
            break;
        }
    }
    assert_eq!(out.len(), per * 3 * WORKERS as usize);
    out
}

#[test]
fn every_operation_on_every_worker() {
    let cl = Cluster::start();
    let mut c = Client::connect(cl.servers[1].main_addr, cfg()).unwrap();
    assert_eq!(c.map(), &cl.map(), "mbal map returns the cluster file's map");
    let mut plains: Vec<Plain> = cl.servers.iter().map(|s| Plain::open(s.main_addr)).collect();
    for key in keys_everywhere(c.map(), 2) {
        let k = key.as_bytes();
        let (_, s, _) = c.route(k);
        assert_eq!(c.get(k).unwrap(), None);
        assert!(c.set(k, b"one", 7, 0).unwrap());
        let v = c.get(k).unwrap().unwrap();
        assert_eq!((v.data.as_slice(), v.flags, v.cas), (&b"one"[..], 7, None));
        // The item lives on the server the map names, and only there.
        for (i, p) in plains.iter_mut().enumerate() {
            assert_eq!(p.holds(&key), i == s as usize, "{key} on server {i}");
        }
        assert!(!c.add(k, b"x", 0, 0).unwrap(), "add of an existing key");
        assert!(c.replace(k, b"two", 1, 0).unwrap());
        assert!(c.append(k, b"-a", 0, 0).unwrap());
        assert!(c.prepend(k, b"p-", 0, 0).unwrap());
        let v = c.gets(k).unwrap().unwrap();
        assert_eq!((v.data.as_slice(), v.flags), (&b"p-two-a"[..], 1));
        let cas = v.cas.expect("gets returns a cas value");
        assert_eq!(c.cas(k, b"three", 2, 0, cas + 1000).unwrap(), CasResult::Exists);
        assert_eq!(c.cas(k, b"three", 2, 0, cas).unwrap(), CasResult::Stored);
        assert_eq!(c.get(k).unwrap().unwrap().data, b"three");
        assert!(c.touch(k, 1000).unwrap());
        assert!(c.delete(k).unwrap());
        assert!(!c.delete(k).unwrap());
        assert_eq!(c.cas(k, b"x", 0, 0, cas).unwrap(), CasResult::NotFound);
        assert!(!c.replace(k, b"x", 0, 0).unwrap());
        assert!(!c.append(k, b"x", 0, 0).unwrap());
        assert!(!c.touch(k, 10).unwrap());
        assert_eq!(c.incr(k, 1).unwrap(), None);
        assert!(c.add(k, b"10", 0, 0).unwrap());
        assert_eq!(c.incr(k, 5).unwrap(), Some(15));
        assert_eq!(c.decr(k, 20).unwrap(), Some(0), "decr stops at 0");
        assert!(c.set(k, b"abc", 0, 0).unwrap());
        assert!(matches!(c.incr(k, 1), Err(Error::Server { .. })), "incr of a non-number");
        // The connection is still usable after a server error.
        assert_eq!(c.get(k).unwrap().unwrap().data, b"abc");
        // Binary data with CR LF inside.
        assert!(c.set(k, b"a\r\nEND\r\nb", 0, 0).unwrap());
        assert_eq!(c.get(k).unwrap().unwrap().data, b"a\r\nEND\r\nb");
    }
    assert_eq!(c.redirects(), 0, "a current map never redirects");
    let big = vec![b'x'; 2 << 20];
    let e = c.set(b"too-big", &big, 0, 0).unwrap_err();
    assert!(matches!(e, Error::Server { .. }), "{e:?}");
    assert!(c.set(b"after-big", b"ok", 0, 0).unwrap());
    cl.stop();
}

#[test]
fn multi_get_and_multi_set_across_all_servers() {
    let cl = Cluster::start();
    let mut c = Client::from_map(cl.map(), Config { conns_per_worker: 2, ..cfg() });
    let keys = keys_everywhere(c.map(), 150);
    let vals: Vec<String> = keys.iter().map(|k| format!("value of {k}")).collect();
    // Store every other key.
    let items: Vec<(&[u8], &[u8])> =
        keys.iter().zip(&vals).step_by(2).map(|(k, v)| (k.as_bytes(), v.as_bytes())).collect();
    let stored = c.set_multi(&items, 5, 0).unwrap();
    assert_eq!(stored, vec![true; items.len()]);
    // Ask for all of them, twice over, plus duplicates, in a scrambled order.
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.reverse();
    order.extend((0..keys.len()).step_by(3));
    let ask: Vec<&[u8]> = order.iter().map(|&i| keys[i].as_bytes()).collect();
    let got = c.get_multi(&ask).unwrap();
    assert_eq!(got.len(), ask.len());
    for (n, &i) in order.iter().enumerate() {
        match &got[n] {
            Some(v) => {
                assert_eq!(i % 2, 0, "{} was never stored", keys[i]);
                assert_eq!((v.data.as_slice(), v.flags), (vals[i].as_bytes(), 5));
            }
            None => assert_eq!(i % 2, 1, "{} was stored", keys[i]),
        }
    }
    // More keys than one window, in one call.
    let many: Vec<String> = (0..3000).map(|i| format!("many:{i}")).collect();
    let items: Vec<(&[u8], &[u8])> = many.iter().map(|k| (k.as_bytes(), k.as_bytes())).collect();
    assert!(c.set_multi(&items, 0, 0).unwrap().iter().all(|&b| b));
    let ask: Vec<&[u8]> = many.iter().map(|k| k.as_bytes()).collect();
    let got = c.get_multi(&ask).unwrap();
    for (k, v) in many.iter().zip(&got) {
        assert_eq!(v.as_ref().map(|v| v.data.as_slice()), Some(k.as_bytes()));
    }
    assert_eq!(c.get_multi(&[]).unwrap(), vec![]);
    assert_eq!(c.redirects(), 0);

    // Stats: every server, every worker; items add up to what was stored.
    let st = cluster_stats(c.map(), Duration::from_secs(5), None).unwrap();
    assert_eq!(st.len(), 3);
    let items: u64 = st.iter().map(|s| s.curr_items).sum();
    assert_eq!(items, (keys.len() / 2 + many.len()) as u64);
    for s in &st {
        assert_eq!(s.workers.len(), WORKERS as usize);
        assert_eq!(s.workers.iter().map(|w| w.curr_items).sum::<u64>(), s.curr_items);
        assert!(s.workers.iter().all(|w| w.cmd_set > 0 && w.cachelets == 4), "{s:?}");
        assert_eq!(s.addr, Some(cl.servers[s.server as usize].main_addr));
    }
    c.get(keys[0].as_bytes()).unwrap();
    let st2 = cluster_stats(c.map(), Duration::from_secs(5), None).unwrap();
    let table = render_stats_table(Some(&st), &st2, 1.0);
    assert_eq!(table.lines().count(), 1 + 3 * (1 + WORKERS as usize), "{table}");
    assert!(table.contains(&cl.servers[2].main_addr.to_string()), "{table}");
    cl.stop();
}

/// Send `mbal move <c> <to>` on a server's main port; returns the new epoch.
fn move_cachelet(admin: &mut Plain, c: u32, to: u16) -> u64 {
    let l = admin.cmd(&format!("mbal move {c} {to}\r\n"));
    assert!(l.starts_with("MOVED "), "{l}");
    l.trim_end()[6..].parse().unwrap()
}

#[test]
fn a_stale_map_costs_one_redirect_per_cachelet() {
    let cl = Cluster::start();
    let map = cl.map();
    // Two keys of one cachelet on server 0.
    let ks: Vec<String> =
        (0..100_000).map(|i| format!("s{i}")).filter(|k| map.route(key_hash(k.as_bytes())).1 == 0).collect();
    let c0 = map.route(key_hash(ks[0].as_bytes())).0;
    let same: Vec<&String> = ks.iter().filter(|k| map.route(key_hash(k.as_bytes())).0 == c0).take(3).collect();
    let (_, _, w) = map.route(key_hash(same[0].as_bytes()));
    let mut admin = Plain::open(cl.servers[0].main_addr);
    let epoch = move_cachelet(&mut admin, c0, 1 - w);
    assert!(epoch > map.epoch());

    let mut c = Client::from_map(map.clone(), cfg());
    assert!(c.set(same[0].as_bytes(), b"v0", 0, 0).unwrap());
    assert_eq!(c.redirects(), 1);
    assert_eq!(c.route(same[0].as_bytes()), (c0, 0, 1 - w));
    assert_eq!(c.map().epoch(), epoch, "the newer map was fetched");
    assert!(c.set(same[1].as_bytes(), b"v1", 0, 0).unwrap());
    assert_eq!(c.get(same[0].as_bytes()).unwrap().unwrap().data, b"v0");
    assert_eq!(c.redirects(), 1, "learned once for the whole cachelet");

    // A multi-get through a fresh stale client: the mixed group of the old
    // owner is redirected, re-split and retried; all values come back.
    let mut c2 = Client::from_map(map.clone(), cfg());
    let mut ask: Vec<&[u8]> = vec![same[0].as_bytes(), same[1].as_bytes(), same[2].as_bytes()];
    let others = keys_everywhere(&map, 3);
    for k in &others {
        assert!(c.set(k.as_bytes(), k.as_bytes(), 0, 0).unwrap());
        ask.push(k.as_bytes());
    }
    let got = c2.get_multi(&ask).unwrap();
    assert_eq!(got[0].as_ref().unwrap().data, b"v0");
    assert_eq!(got[1].as_ref().unwrap().data, b"v1");
    assert!(got[2].is_none());
    for (i, k) in others.iter().enumerate() {
        assert_eq!(got[3 + i].as_ref().unwrap().data, k.as_bytes());
    }
    assert!(c2.redirects() >= 1);
    // Stale client, multi-set.
    let mut c3 = Client::from_map(map, cfg());
    let items: Vec<(&[u8], &[u8])> = ask.iter().map(|k| (*k, &b"new"[..])).collect();
    assert!(c3.set_multi(&items, 0, 0).unwrap().iter().all(|&b| b));
    assert!(c3.redirects() >= 1);
    assert!(c.get_multi(&ask).unwrap().iter().all(|v| v.as_ref().unwrap().data == b"new"));
    cl.stop();
}

#[test]
fn cachelet_moves_while_a_client_reads_and_writes() {
    let cl = Cluster::start();
    let map = cl.map();
    // Keys of two cachelets of server 0, and some keys elsewhere.
    let on0: Vec<String> =
        (0..100_000).map(|i| format!("m{i}")).filter(|k| map.route(key_hash(k.as_bytes())).1 == 0).collect();
    let moving: Vec<u32> = {
        let mut v: Vec<u32> = on0.iter().map(|k| map.route(key_hash(k.as_bytes())).0).collect();
        v.dedup();
        v.sort();
        v.dedup();
        v.into_iter().take(2).collect()
    };
    let mut keys: Vec<String> =
        on0.iter().filter(|k| moving.contains(&map.route(key_hash(k.as_bytes())).0)).take(40).cloned().collect();
    keys.extend(keys_everywhere(&map, 2));

    let ops = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (ops, stop, keys, map) = (ops.clone(), stop.clone(), keys.clone(), map.clone());
        std::thread::spawn(move || {
            let mut c = Client::from_map(map, cfg());
            let mut model: HashMap<String, String> = HashMap::new();
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut round = 0u64;
            // Bounded by the stop flag, a round count and a deadline.
            while !stop.load(Ordering::Relaxed) && round < 200_000 && Instant::now() < deadline {
                let k = &keys[(round as usize * 7) % keys.len()];
                let v = format!("{k}={round}");
                match round % 4 {
                    0 | 1 => assert!(c.set(k.as_bytes(), v.as_bytes(), 0, 0).unwrap()),
                    2 => {
                        let items: Vec<(&[u8], &[u8])> =
                            keys.iter().take(10).map(|k| (k.as_bytes(), v.as_bytes())).collect();
                        assert!(c.set_multi(&items, 0, 0).unwrap().iter().all(|&b| b));
                        for k in keys.iter().take(10) {
                            model.insert(k.clone(), v.clone());
                        }
                    }
                    _ => {
                        let ask: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
                        let got = c.get_multi(&ask).unwrap();
                        for (k, g) in keys.iter().zip(got) {
                            assert_eq!(
                                g.map(|g| String::from_utf8(g.data).unwrap()).as_ref(),
                                model.get(k),
                                "multi-get of {k} returns the last value written"
                            );
                        }
                    }
                }
                if round % 4 < 2 {
                    model.insert(k.clone(), v);
                }
                // Every single-key read returns the last value written.
                let g = c.get(k.as_bytes()).unwrap().map(|g| String::from_utf8(g.data).unwrap());
                assert_eq!(g.as_ref(), model.get(k), "get of {k}");
                round += 1;
                ops.store(round, Ordering::Release);
            }
            (round, c.redirects())
        })
    };
    let mut admin = Plain::open(cl.servers[0].main_addr);
    let mut owner: HashMap<u32, u16> = moving.iter().map(|&c| (c, map.owner(c).1)).collect();
    let mut last_epoch = map.epoch();
    let deadline = Instant::now() + Duration::from_secs(60);
    for i in 0..30 {
        let c = moving[i % moving.len()];
        let to = 1 - owner[&c];
        let e = move_cachelet(&mut admin, c, to);
        assert!(e > last_epoch, "the epoch only grows");
        last_epoch = e;
        owner.insert(c, to);
        // Let the client do some work under the new map before the next move.
        let seen = ops.load(Ordering::Acquire);
        while ops.load(Ordering::Acquire) < seen + 8 && !worker.is_finished() && Instant::now() < deadline {
            std::thread::yield_now();
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (rounds, redirects) = worker.join().expect("client thread");
    assert!(rounds > 30 * 8, "the client kept working: {rounds} rounds");
    assert!(redirects > 0, "moves were noticed through redirects");
    // Every move is followed by at least one multi-get over all keys at the
    // client, which meets the moved cachelet at its old owner first.
    assert!(redirects >= 30, "one redirect per move at least: {redirects} for 30 moves ({rounds} rounds)");
    eprintln!("{rounds} rounds, {redirects} redirects over 30 moves");
    cl.stop();
}

/// Servers move cachelets independently, so their epochs differ. A client
/// whose map came from a server with a higher epoch than the one that
/// redirects it cannot refetch its way out: it must learn the owner from the
/// redirect itself (an override), also for a multi-get whose group spans
/// several cachelets (the server redirects such a group as a whole).
#[test]
fn redirects_from_a_server_with_an_older_epoch_are_learned_per_cachelet() {
    let cl = Cluster::start();
    let map = cl.map();
    let mut admin0 = Plain::open(cl.servers[0].main_addr);
    let c0 = map.cachelets_of(0, 0)[0];
    let mut e0 = 0;
    for i in 0..6 {
        e0 = move_cachelet(&mut admin0, c0, 1 - i % 2);
    }
    // On server 1: move one cachelet of worker 0 to worker 1.
    let cells = map.cachelets_of(1, 0);
    let (moved, stays) = (cells[0], cells[1]);
    let mut admin1 = Plain::open(cl.servers[1].main_addr);
    let e1 = move_cachelet(&mut admin1, moved, 1);
    assert!(e1 < e0, "server 1 ({e1}) is behind server 0 ({e0})");

    let key_in = |c: u32, salt: &str| -> String {
        (0..100_000).map(|i| format!("{salt}{i}")).find(|k| map.route(key_hash(k.as_bytes())).0 == c).unwrap()
    };
    let (km, ks) = (key_in(moved, "m"), key_in(stays, "s"));
    let mut writer = Client::connect(cl.servers[1].main_addr, cfg()).unwrap();
    assert!(writer.set(km.as_bytes(), b"moved", 0, 0).unwrap());
    assert!(writer.set(ks.as_bytes(), b"stays", 0, 0).unwrap());
    assert_eq!(writer.redirects(), 0, "server 1's own map is current for its cachelets");

    let mut c = Client::connect(cl.servers[0].main_addr, cfg()).unwrap();
    assert_eq!(c.map().epoch(), e0);
    assert_eq!(c.route(km.as_bytes()), (moved, 1, 0), "server 0 does not know about server 1's move");
    // Mixed group on worker (1, 0): redirected whole, re-split per
    // cachelet, the moved cachelet redirected again and learned.
    let got = c.get_multi(&[ks.as_bytes(), km.as_bytes()]).unwrap();
    assert_eq!(got[0].as_ref().unwrap().data, b"stays");
    assert_eq!(got[1].as_ref().unwrap().data, b"moved");
    assert_eq!(c.redirects(), 2);
    assert_eq!(c.map().epoch(), e0, "no refetch for an older epoch");
    assert_eq!(c.route(km.as_bytes()), (moved, 1, 1), "learned from the redirect");
    assert_eq!(c.route(ks.as_bytes()), (stays, 1, 0));
    assert_eq!(c.get(km.as_bytes()).unwrap().unwrap().data, b"moved");
    assert_eq!(c.redirects(), 2, "no further redirect once learned");
    cl.stop();
}

#[test]
fn client_is_send() {
    fn send<T: Send>() {}
    send::<Client>();
}
