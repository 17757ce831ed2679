//! Phase 1, hot-key replication, against real servers: copies on shadow
//! workers of other servers, `RH hot` hints on routed connections, writes
//! copied (async and sync), copies deleted and retired, a dead shadow,
//! `stats hotkeys`, and the policy replicating a key under real load.

mod common;

use common::*;
use mbal_cluster::{key_hash, replica_location, ClusterMap};
use mbal_member::ClusterSpec;
use mbal_server::ServerHandle;
use std::time::{Duration, Instant};

const WORKERS: u16 = 2;

struct Cluster {
    spec: ClusterSpec,
    map: ClusterMap,
    servers: Vec<Option<ServerHandle>>,
}

fn cluster(n: usize, tune: impl Fn(&mut mbal_server::config::Settings)) -> Cluster {
    let spec = mbal_server::testing::loopback_spec(n, WORKERS);
    let servers = (0..n)
        .map(|id| {
            let mut s = mbal_server::testing::hot_member(&spec, id as u16, 100);
            tune(&mut s);
            Some(start(s))
        })
        .collect();
    let map = spec.initial_map();
    Cluster { spec, map, servers }
}

impl Cluster {
    fn addr(&self, s: u16) -> std::net::SocketAddr {
        self.spec.servers[s as usize].addr
    }

    /// A routed connection to worker `w` of server `s`.
    fn routed(&self, s: u16, w: u16) -> Conn {
        let mut c = Conn::open(self.addr(s));
        let hello = c.cmd(&format!("mbal hello 0 {w}\r\n"));
        assert!(hello.starts_with(&format!("MBAL {s} {w} ")), "{hello:?}");
        c
    }

    /// A key whose home is server `s`.
    fn key_on(&self, s: u16, prefix: &str) -> (String, u16) {
        (0..100_000)
            .map(|i| format!("{prefix}{i}"))
            .find_map(|k| {
                let c = self.map.keyspace().cachelet_of_hash(key_hash(k.as_bytes()));
                let (srv, w) = self.map.owner(c);
                (srv == s).then_some((k, w))
            })
            .expect("a key on every server")
    }

    /// A key whose home is worker `w` of server `s`.
    fn key_on_worker(&self, s: u16, w: u16, prefix: &str) -> (String, u16) {
        (0..100_000)
            .map(|i| format!("{prefix}{i}"))
            .find_map(|k| {
                let c = self.map.keyspace().cachelet_of_hash(key_hash(k.as_bytes()));
                (self.map.owner(c) == (s, w)).then_some((k, w))
            })
            .expect("a key on every worker")
    }

    fn copies(&self, key: &str, home: (u16, u16), n: u32) -> Vec<(u16, u16)> {
        let servers = self.spec.servers.len() as u16;
        (1..=n).map(|i| replica_location(key_hash(key.as_bytes()), i, home, servers, |_| WORKERS).unwrap()).collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for s in self.servers.iter_mut().filter_map(Option::take) {
            s.shutdown();
        }
    }
}

/// A routed read: (hint, value). The hint is `Some((replicas, lease_ms))`
/// when an `RH hot` line came first.
fn routed_get(c: &mut Conn, key: &str) -> (Option<(u32, u64)>, Option<String>) {
    c.send(format!("get {key}\r\n").as_bytes());
    let mut hint = None;
    let mut line = c.line();
    if let Some(rest) = line.strip_prefix("RH hot ") {
        let t: Vec<&str> = rest.split_whitespace().collect();
        assert_eq!(t[0], key);
        hint = Some((t[1].parse().unwrap(), t[2].parse().unwrap()));
        line = c.line();
    }
    if line.starts_with("RD ") {
        return (hint, Some(line));
    }
    if line == "END\r\n" {
        return (hint, None);
    }
    let n: usize = line.split_whitespace().nth(3).unwrap().parse().unwrap();
    let v = c.exact(n + 2);
    assert_eq!(c.line(), "END\r\n");
    (hint, Some(String::from_utf8_lossy(&v[..n]).into_owned()))
}

/// Read the key at home until the hint says `want` (bounded by a deadline).
fn await_hint(c: &mut Conn, key: &str, want: impl Fn(Option<(u32, u64)>) -> bool) -> Option<(u32, u64)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (h, _) = routed_get(c, key);
        if want(h) {
            return h;
        }
        assert!(Instant::now() < deadline, "hint for {key} stuck at {h:?}");
        std::thread::yield_now();
    }
}

#[test]
fn a_pinned_key_is_copied_hinted_and_read_from_its_shadows() {
    let cl = cluster(3, |_| {});
    let (key, w) = cl.key_on(0, "hot");
    let mut plain = Conn::open(cl.addr(0));
    assert_eq!(plain.set(&key, b"v1"), "STORED\r\n");
    let mut home = cl.routed(0, w);
    assert_eq!(routed_get(&mut home, &key), (None, Some("v1".into())), "not hot: no hint");

    assert_eq!(plain.cmd(&format!("mbal debug hot {key} 2\r\n")), "OK\r\n");
    let (g, lease) = await_hint(&mut home, &key, |h| h.is_some_and(|h| h.0 > 0)).unwrap();
    assert_eq!(g, 2);
    assert!(lease > 0 && lease <= 200, "a lease of at most lease_epochs × epoch: {lease}");
    let copies = cl.copies(&key, (0, w), 2);
    assert!(copies.iter().all(|c| c.0 != 0), "copies live on other servers: {copies:?}");
    for &(s, cw) in &copies {
        let mut r = cl.routed(s, cw);
        assert_eq!(routed_get(&mut r, &key), (None, Some("v1".into())), "copy at {s}/{cw}");
    }
    // A worker that holds no copy redirects home, as for any foreign key.
    let other = (0..WORKERS).map(|x| (1, x)).chain((0..WORKERS).map(|x| (2, x))).find(|l| !copies.contains(l)).unwrap();
    let (_, v) = routed_get(&mut cl.routed(other.0, other.1), &key);
    assert!(v.unwrap().starts_with(&format!("RD 1 0 {w}")));
    // A plain connection never sees a hint.
    assert_eq!(plain.get(&key).as_deref(), Some(&b"v1"[..]));

    // stats: the key, its state and copies; the shadows' reads.
    let hk = stats(&mut plain, "hotkeys");
    let line = hk.iter().find(|(n, _)| n == "key:0").map(|(_, v)| v.clone()).expect("listed");
    assert!(line.starts_with(&format!("{key} worker={w} ")) && line.contains("state=Hot replicas=2"), "{line}");
    let mut s1 = Conn::open(cl.addr(copies[0].0));
    assert!(stat(&mut s1, "replica_reads") >= 1);
    assert!(stat(&mut s1, "replica_items") >= 1);
    assert!(stat(&mut plain, "hot_hints") >= 1);
}

#[test]
fn async_writes_reach_every_copy_before_a_new_lease() {
    async_writes_reach_copies(cluster(3, |_| {}), false);
}

#[test]
fn async_writes_run_on_a_neighbours_store_reach_every_copy_before_a_new_lease() {
    // Both workers of each server on one thread: the plain connection's writes to the other
    // worker's hot key run on that worker's store directly (`near`), and must be on their way
    // to the copies before the home grants a lease again.
    async_writes_reach_copies(cluster(3, |s| s.worker_threads = 1), true);
}

fn async_writes_reach_copies(cl: Cluster, direct: bool) {
    let mut plain = Conn::open(cl.addr(0));
    // A key of server 0 whose home is not the plain connection's worker: its writes hop.
    let (probe, _) = cl.key_on_worker(0, 0, "probe");
    let hops = stat(&mut plain, "cross_worker_requests");
    assert_eq!(plain.set(&probe, b"p"), "STORED\r\n");
    let plain_worker = if stat(&mut plain, "cross_worker_requests") > hops { 1 } else { 0 };
    let (key, w) = cl.key_on_worker(0, 1 - plain_worker, "aw");
    assert_eq!(plain.set(&key, b"v0"), "STORED\r\n");
    assert_eq!(plain.cmd(&format!("mbal debug hot {key} 2\r\n")), "OK\r\n");
    let copies = cl.copies(&key, (0, w), 2);
    let mut home = cl.routed(0, w);
    let mut shadows: Vec<Conn> = copies.iter().map(|&(s, cw)| cl.routed(s, cw)).collect();
    for i in 1..=20 {
        let v = format!("v{i}");
        // Through a plain connection on another worker too (a hop to the home).
        let setter = if i % 2 == 0 { &mut plain } else { &mut home };
        assert_eq!(setter.set(&key, v.as_bytes()), "STORED\r\n");
        // Once the home grants a lease again, every copy holds the write.
        await_hint(&mut home, &key, |h| h.is_some_and(|h| h.0 > 0));
        for s in shadows.iter_mut() {
            assert_eq!(routed_get(s, &key), (None, Some(v.clone())));
        }
    }
    // A delete at home deletes the copies: reads there go home.
    assert_eq!(plain.cmd(&format!("delete {key}\r\n")), "DELETED\r\n");
    let deadline = Instant::now() + Duration::from_secs(10);
    for s in shadows.iter_mut() {
        loop {
            let (_, v) = routed_get(s, &key);
            if v.as_deref().is_some_and(|v| v.starts_with("RD ")) {
                break;
            }
            assert!(Instant::now() < deadline, "copy outlived the delete: {v:?}");
        }
    }
    let direct_hops = stat(&mut plain, "cross_worker_direct");
    assert_eq!(direct_hops > 0, direct, "direct hops: {direct_hops}");
}

#[test]
fn sync_writes_are_on_every_copy_when_answered() {
    sync_writes_reach_copies(cluster(3, |s| s.hot.sync = true));
}

#[test]
fn sync_writes_by_key_prefix_are_on_every_copy_when_answered() {
    // `--replica-writes sync:sw`: SE mode for the keys starting with "sw" only.
    sync_writes_reach_copies(cluster(3, |s| s.hot.sync_prefixes = vec![b"sw".as_slice().into()]));
}

fn sync_writes_reach_copies(cl: Cluster) {
    let (key, w) = cl.key_on(0, "sw");
    let mut plain = Conn::open(cl.addr(0));
    assert_eq!(plain.set(&key, b"v0"), "STORED\r\n");
    assert_eq!(plain.cmd(&format!("mbal debug hot {key} 3\r\n")), "OK\r\n");
    let copies = cl.copies(&key, (0, w), 3);
    let mut home = cl.routed(0, w);
    let mut shadows: Vec<Conn> = copies.iter().map(|&(s, cw)| cl.routed(s, cw)).collect();
    for i in 1..=30 {
        let v = format!("s{i}");
        let setter = if i % 2 == 0 { &mut plain } else { &mut home };
        assert_eq!(setter.set(&key, v.as_bytes()), "STORED\r\n");
        // No stale read once the write is answered: every copy has it.
        for s in shadows.iter_mut() {
            assert_eq!(routed_get(s, &key), (None, Some(v.clone())), "write {i}");
        }
        // noreply writes and pipelines keep their order too.
        plain.send(format!("set {key} 0 0 2 noreply\r\nnr\r\nget {key}\r\n").as_bytes());
        let got = plain.until_end();
        assert_eq!(got[1], "nr\r\n");
    }
}

#[test]
fn a_dead_shadow_ends_the_leases_and_the_key_retires() {
    let mut cl = cluster(3, |_| {});
    let (key, w) = cl.key_on(0, "dead");
    let mut plain = Conn::open(cl.addr(0));
    assert_eq!(plain.set(&key, b"v"), "STORED\r\n");
    assert_eq!(plain.cmd(&format!("mbal debug hot {key} 2\r\n")), "OK\r\n");
    let mut home = cl.routed(0, w);
    await_hint(&mut home, &key, |h| h.is_some_and(|h| h.0 > 0));
    let copies = cl.copies(&key, (0, w), 2);
    let (dead, alive) = (copies[0], copies[1]);
    assert_ne!(dead.0, alive.0, "two copies on two servers");
    cl.servers[dead.0 as usize].take().unwrap().shutdown();
    // The next renewal fails: no more leases.
    await_hint(&mut home, &key, |h| h == Some((0, 0)));
    assert_eq!(routed_get(&mut home, &key).1.as_deref(), Some("v"), "the home still serves it");
    // Unpinned, it cools and retires: the surviving copy is deleted.
    assert_eq!(plain.cmd(&format!("mbal debug cool {key}\r\n")), "OK\r\n");
    let mut s = cl.routed(alive.0, alive.1);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, v) = routed_get(&mut s, &key);
        if v.as_deref().is_some_and(|v| v.starts_with("RD ")) {
            break;
        }
        assert!(Instant::now() < deadline, "copy never retired: {v:?}");
    }
    let mut st = Conn::open(cl.addr(0));
    assert!(stat_of(&mut st, "hotkeys", "copies_failed") >= 1);
}

fn stat_of(c: &mut Conn, group: &str, name: &str) -> u64 {
    stats(c, group).into_iter().find(|(n, _)| n == name).and_then(|(_, v)| v.parse().ok()).expect(name)
}

#[test]
fn flush_all_drops_the_copies() {
    let cl = cluster(2, |_| {});
    let (key, w) = cl.key_on(0, "fl");
    let mut plain = Conn::open(cl.addr(0));
    assert_eq!(plain.set(&key, b"v"), "STORED\r\n");
    assert_eq!(plain.cmd(&format!("mbal debug hot {key} 1\r\n")), "OK\r\n");
    let (s, cw) = cl.copies(&key, (0, w), 1)[0];
    let mut shadow = cl.routed(s, cw);
    assert_eq!(routed_get(&mut shadow, &key).1.as_deref(), Some("v"));
    assert_eq!(plain.cmd("flush_all\r\n"), "OK\r\n");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, v) = routed_get(&mut shadow, &key);
        if v.as_deref().is_some_and(|v| v.starts_with("RD ")) {
            break;
        }
        assert!(Instant::now() < deadline, "copy outlived flush_all: {v:?}");
    }
}

#[test]
fn the_policy_replicates_a_key_that_overloads_its_worker() {
    // Emulated capacity: one key's load saturates its worker.
    let cl = cluster(2, |s| {
        s.worker_capacity = 3000;
        s.hot.policy.sample_rate = 0.2;
    });
    let (key, w) = cl.key_on(0, "pol");
    let mut plain = Conn::open(cl.addr(0));
    assert_eq!(plain.set(&key, b"v"), "STORED\r\n");
    let mut watcher = Conn::open(cl.addr(0));
    let mut after = 0u64;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Load: pipelined routed gets of the key at its home, bounded.
    let loaders: Vec<_> = (0..2)
        .map(|_| {
            let mut c = cl.routed(0, w);
            let key = key.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let batch = format!("get {key}\r\n").repeat(32);
                for _ in 0..2000 {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    c.send(batch.as_bytes());
                    for _ in 0..32 {
                        let mut l = c.line();
                        if l.starts_with("RH ") {
                            l = c.line();
                        }
                        assert!(l.starts_with("VALUE"), "{l:?}");
                        c.line();
                        assert_eq!(c.line(), "END\r\n");
                    }
                }
            })
        })
        .collect();
    // Await epochs (each `mbal load` answers when the next one ends).
    let mut replicated = false;
    for _ in 0..100 {
        watcher.send(format!("mbal load {after}\r\n").as_bytes());
        let head = watcher.line();
        let t: Vec<&str> = head.split_whitespace().collect();
        assert_eq!(t[0], "LOAD", "{head:?}");
        after = t[1].parse().unwrap();
        let n: usize = t[2].parse().unwrap();
        let json = watcher.exact(n + 2);
        let v: serde_json::Value = serde_json::from_slice(&json[..n]).unwrap();
        let hot = &v["hot"];
        if hot["replicate"].as_array().is_some_and(|r| r.iter().any(|r| r["key"] == serde_json::json!(key.as_bytes())))
        {
            replicated = true;
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for l in loaders {
        l.join().unwrap();
    }
    assert!(replicated, "the hot key was never replicated");
    let hk = stats(&mut plain, "hotkeys");
    assert!(hk.iter().any(|(n, v)| n == "key:0" && v.starts_with(&key)), "{hk:?}");
}

#[test]
fn copies_travel_between_members_that_share_the_cluster_secret() {
    use mbal_member::peer_auth::{self, Secret};
    let secret = Secret::new(b"a cluster secret of 32 bytes....".to_vec()).unwrap();
    let cl = cluster(2, |s| s.control_secret = Some(secret.clone()));
    let (key, w) = cl.key_on(0, "sec");
    let mut plain = Conn::open(cl.addr(0));
    assert_eq!(plain.set(&key, b"v"), "STORED\r\n");
    // Without proving membership, a data-plane client cannot pin it...
    assert!(plain.cmd(&format!("mbal debug hot {key} 1\r\n")).starts_with("CLIENT_ERROR control command refused"));
    // ... nor write a copy on a shadow.
    let (s, cw) = cl.copies(&key, (0, w), 1)[0];
    let mut shadow = cl.routed(s, cw);
    assert!(shadow
        .cmd(&format!("mbal rset {key} 0 0 1 1000\r\nx\r\n"))
        .starts_with("CLIENT_ERROR control command refused"));
    let nonce = plain.cmd("mbal peer\r\n");
    assert_eq!(plain.cmd(&peer_auth::answer_line(&secret, nonce.trim_end()).unwrap()), "OK\r\n");
    // The home's replicator authenticates itself to the shadow.
    assert_eq!(plain.cmd(&format!("mbal debug hot {key} 1\r\n")), "OK\r\n");
    assert_eq!(routed_get(&mut shadow, &key), (None, Some("v".into())));
}

/// REPL_high shared across the cluster: a server that needs more slots
/// than its share borrows them from one that has slots to spare, renews
/// them while it needs them and gives them back when it does not; the
/// lender's own cap falls by what it lent until the lease ends.
#[test]
fn a_server_borrows_repl_high_slots_from_one_with_slots_to_spare() {
    // 2 servers x 2 workers: floor(2·4·ln 4) = 11 slots, 6 and 5.
    let cl = cluster(2, |_| {});
    let mut a = Conn::open(cl.addr(0));
    let mut b = Conn::open(cl.addr(1));
    let await_stat = |c: &mut Conn, name: &str, want: u64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let v = stat_of(c, "hotkeys", name);
            if v == want {
                return;
            }
            assert!(Instant::now() < deadline, "{name} stuck at {v}, want {want}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    await_stat(&mut a, "repl_high", 6);
    await_stat(&mut b, "repl_high", 5);
    // Server 0 wants 9 (asked at once and at every epoch; it asks once it
    // has heard server 1's epochs, which carry its slots): 3 beyond its share, which server 1 can spare (5 less a margin of 1).
    assert_eq!(a.cmd("mbal debug slots 9\r\n"), "OK\r\n");
    await_stat(&mut a, "slots_held", 3);
    await_stat(&mut a, "repl_high", 9);
    await_stat(&mut b, "slots_lent", 3);
    await_stat(&mut b, "repl_high", 2);
    // What a server that restarts asks the others: how many of its slots they hold.
    assert_eq!(a.cmd("mbal slots held 1\r\n"), "HELD 3\r\n");
    assert_eq!(b.cmd("mbal slots held 0\r\n"), "HELD 0\r\n");
    // Still held after many leases (100 ms epochs, 400 ms leases): renewed every tick.
    await_epochs(&mut a, 10);
    await_stat(&mut a, "slots_held", 3);
    await_stat(&mut b, "slots_lent", 3);
    // Server 1 asked directly for more than it can give: what is left.
    let mut peer = Conn::open(cl.addr(1));
    assert_eq!(peer.cmd("mbal slots 0 10 300\r\n"), "SLOTS 4 300\r\n", "5 less the margin; a new ask replaces the old");
    assert_eq!(peer.cmd("mbal slots 0 1 900000\r\n"), "SLOTS 1 400\r\n", "never longer than its own lease");
    assert_eq!(peer.cmd("mbal slots 9 1 300\r\n"), "SLOTS 0 300\r\n", "no such server");
    assert!(peer.cmd("mbal slots x 1 300\r\n").starts_with("CLIENT_ERROR usage"));
    // No longer needed: given back at the borrower, then counted free again at the lender.
    assert_eq!(a.cmd("mbal debug slots 0\r\n"), "OK\r\n");
    await_stat(&mut a, "slots_held", 0);
    await_stat(&mut a, "repl_high", 6);
    await_stat(&mut b, "slots_lent", 0);
    await_stat(&mut b, "repl_high", 5);
}

/// Wait for `n` more of the server's epochs to end (`mbal load <after>`
/// answers when the epoch after `after` has ended).
fn await_epochs(c: &mut Conn, n: usize) {
    let mut after = stat_of(c, "hotkeys", "epoch");
    for _ in 0..n {
        c.send(format!("mbal load {after}\r\n").as_bytes());
        let head = c.line();
        let t: Vec<&str> = head.split_whitespace().collect();
        assert_eq!(t[0], "LOAD", "{head:?}");
        after = t[1].parse().unwrap();
        let len: usize = t[2].parse().unwrap();
        c.exact(len + 2);
    }
}
