//! Cross-server migration (docs/design-notes.md, "Cross-server migration"), as real processes:
//! a coordinator and two servers (`mbal cluster up --coordinator`).
//!
//! While a cachelet moves, clients keep writing and reading its keys; every answer is checked:
//! no acknowledged write is lost, no read returns a value older than one the same client wrote
//! or read before, nothing but the documented answers. After the move the destination holds
//! every item (a value of `-I` size among them) and the map says so.

mod common;

use common::cluster::{up_with, wait_map, wait_servers, Conn};
use mbal_cluster::{key_hash, ClusterMap};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Keys of cachelet `c` in `map`.
fn keys_of(map: &ClusterMap, c: u32, n: usize, prefix: &str) -> Vec<String> {
    (0..).map(|i| format!("{prefix}:{i}")).filter(|k| map.route(key_hash(k.as_bytes())).0 == c).take(n).collect()
}

/// The answer line of `mbal migrate <c> <server> <worker>` on `addr`.
fn migrate(addr: SocketAddr, c: u32, to: (u16, u16)) -> String {
    let mut conn = Conn::new(addr);
    use std::io::Write;
    conn.s.write_all(format!("mbal migrate {c} {} {}\r\n", to.0, to.1).as_bytes()).unwrap();
    conn.line()
}

/// A routed connection (as the routing client and the proxy make): on `worker` of the server
/// at `servers[server]`; on a redirect (`RD <epoch> <server> <worker>`) it moves there.
struct Routed {
    conn: Conn,
    servers: Vec<SocketAddr>,
    redirects: u64,
}

impl Routed {
    fn new(servers: Vec<SocketAddr>, (server, worker): (u16, u16)) -> Routed {
        let conn = Routed::hello(servers[server as usize], worker);
        Routed { conn, servers, redirects: 0 }
    }

    /// A plain connection (no redirects: the server passes what it does not own on, `--forward`).
    fn plain(addr: SocketAddr) -> Routed {
        Routed { conn: Conn::new(addr), servers: Vec::new(), redirects: 0 }
    }

    fn hello(addr: SocketAddr, worker: u16) -> Conn {
        use std::io::Write;
        let mut c = Conn::new(addr);
        c.s.write_all(format!("mbal hello 0 {worker}\r\n").as_bytes()).unwrap();
        let l = c.line();
        assert!(l.starts_with("MBAL "), "{l}");
        c
    }

    /// Follow a redirect line, if `line` is one.
    fn follow(&mut self, line: &str) -> bool {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.first() != Some(&"RD") {
            return false;
        }
        let (s, wk): (usize, u16) = (w[2].parse().unwrap(), w[3].parse().unwrap());
        self.conn = Routed::hello(self.servers[s], wk);
        self.redirects += 1;
        assert!(self.redirects < 1000, "redirect loop");
        true
    }

    fn set(&mut self, k: &str, v: &str) -> String {
        loop {
            let a = self.conn.set(k, v);
            if !self.follow(&a) {
                return a;
            }
        }
    }

    fn get(&mut self, k: &str) -> Result<Option<String>, String> {
        loop {
            match self.conn.get(k) {
                Err(l) if self.follow(&l) => continue,
                r => return r,
            }
        }
    }
}

/// A client writing versions of its own keys and reading them back until `stop`, checking
/// each answer against what it already saw. Returns (writes, reads, redirects).
fn client(
    mut conn: Routed,
    keys: Vec<String>,
    stop: Arc<AtomicBool>,
    ops: Arc<AtomicU64>,
    seed: u64,
) -> (u64, u64, u64) {
    let mut seen: HashMap<String, u64> = HashMap::new();
    let (mut writes, mut reads) = (0u64, 0u64);
    let mut x = seed | 1;
    let t0 = Instant::now();
    while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(60) && writes + reads < 400_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let k = &keys[(x % keys.len() as u64) as usize];
        let last = seen.get(k).copied().unwrap_or(0);
        ops.fetch_add(1, Ordering::Relaxed);
        if x.is_multiple_of(3) {
            let v = last + 1;
            assert_eq!(conn.set(k, &format!("{v}")), "STORED", "a write of {k}");
            seen.insert(k.clone(), v);
            writes += 1;
        } else {
            let got = conn.get(k).unwrap_or_else(|e| panic!("a read of {k}: {e}"));
            let v: u64 = got.map_or(0, |s| s.parse().unwrap());
            assert!(v >= last, "{k}: read {v} after this client saw {last}");
            seen.insert(k.clone(), v);
            reads += 1;
        }
    }
    (writes, reads, conn.redirects)
}

#[test]
fn a_cachelet_moves_with_its_items_while_clients_write_and_read_it() {
    let c = up_with(2, &["--server-arg=--forward"]);
    let map0 = Conn::new(c.coordinator).map();
    let cl = map0.cachelets_of(0, 1)[0];
    let src = c.servers[0].0;
    let dst = c.servers[1].0;
    // Items to move: many small ones and one of the item size limit (1 MB by default).
    let items = keys_of(&map0, cl, 3000, "item");
    let mut conn = Conn::new(src);
    for k in &items {
        assert_eq!(conn.set(k, &format!("value-of-{k}")), "STORED");
    }
    let big: String = (0..(1 << 20) - 512).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    let big_key = keys_of(&map0, cl, 1, "big").remove(0);
    assert_eq!(conn.set(&big_key, &big), "STORED");
    // Routed clients (as the routing client and the proxy connect) on the owning worker, each
    // busy with its own keys of the moving cachelet.
    let servers: Vec<SocketAddr> = c.servers.iter().map(|s| s.0).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    // Until the clients made `n` more requests (bounded).
    let after = |n: u64| {
        let (from, until) = (ops.load(Ordering::Relaxed), Instant::now() + Duration::from_secs(20));
        while ops.load(Ordering::Relaxed) < from + n && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let hot = keys_of(&map0, cl, 400, "hot");
    // Two routed clients, and two plain ones on the source's main port (the server passes their
    // requests on, `--forward`; the connections land on either worker).
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let keys: Vec<String> = hot.iter().skip(i as usize).step_by(4).cloned().collect();
            let conn = if i < 2 { Routed::new(servers.clone(), (0, 1)) } else { Routed::plain(src) };
            let (stop, ops) = (stop.clone(), ops.clone());
            std::thread::spawn(move || client(conn, keys, stop, ops, 0x9E37 + i))
        })
        .collect();
    after(1000);
    let answer = migrate(src, cl, (1, 0));
    assert!(answer.starts_with(&format!("MIGRATED {cl} ")), "{answer}");
    let moved_items: u64 = answer.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert!(moved_items > items.len() as u64, "{answer}");
    let map1 = wait_map(c.coordinator, "the move's commit", |m| m.owner(cl) == (1, 0));
    assert_eq!(map1.epoch(), map0.epoch() + 1, "one epoch for the move");
    // The clients go on through the old owner for a while after the move, then stop.
    after(1000);
    stop.store(true, Ordering::Relaxed);
    for (i, h) in clients.into_iter().enumerate() {
        let (w, r, redirects) = h.join().expect("a client saw a wrong answer");
        assert!(w > 0 && r > 0);
        if i < 2 {
            assert!(redirects >= 1, "the routed client followed the cachelet to its new owner");
        }
    }
    // The destination has every item, the big one intact; the source has none of them.
    let mut d = Conn::new(dst);
    for k in &items {
        assert_eq!(d.get(k).unwrap().as_deref(), Some(format!("value-of-{k}").as_str()), "{k}");
    }
    assert_eq!(d.get(&big_key).unwrap().as_deref(), Some(big.as_str()));
    assert_eq!(d.stat("migrations_in"), "1");
    let mut s = Conn::new(src);
    assert_eq!(s.stat("migrations_out"), "1");
    assert_eq!(s.stat("migrations_failed"), "0");
    // The old owner's port still answers for the moved keys (forwarded to the new owner).
    assert_eq!(s.get(&items[0]).unwrap().as_deref(), Some(format!("value-of-{}", items[0]).as_str()));
    // And it can move back.
    let back = migrate(dst, cl, (0, 1));
    assert!(back.starts_with(&format!("MIGRATED {cl} ")), "{back}");
    let map2 = wait_map(c.coordinator, "the move back", |m| m.owner(cl) == (0, 1));
    // A plain connection lands on either worker of the source, and the one that did not adopt
    // the cachelet routes by the server's map, which the destination of a move installs from
    // the coordinator just after the commit (a beat it starts at once): until then that worker
    // sends the key to the old owner, which answers it as another server's (a miss).
    wait_servers(&[src], map2.epoch());
    assert_eq!(Conn::new(src).get(&big_key).unwrap().as_deref(), Some(big.as_str()));
}

#[test]
fn a_move_that_does_not_fit_is_refused_and_the_source_serves_on() {
    let c = up_with(2, &[]);
    let map0 = Conn::new(c.coordinator).map();
    let cl = map0.cachelets_of(0, 0)[0];
    let (src, dst) = (c.servers[0].0, c.servers[1].0);
    // 10 MB in the moving cachelet; 10 MB already at the destination (16 MB each).
    let value: String = "x".repeat(100 << 10);
    let mut s = Conn::new(src);
    let moving = keys_of(&map0, cl, 100, "m");
    for k in &moving {
        assert_eq!(s.set(k, &value), "STORED");
    }
    let theirs = map0.cachelets_of(1, 0)[0];
    let mut d = Conn::new(dst);
    for k in keys_of(&map0, theirs, 100, "d") {
        assert_eq!(d.set(&k, &value), "STORED");
    }
    let answer = migrate(src, cl, (1, 1));
    assert!(answer.starts_with("SERVER_ERROR migration failed") && answer.contains("out of memory"), "{answer}");
    assert_eq!(Conn::new(c.coordinator).map().owner(cl), map0.owner(cl), "the map is unchanged");
    // The source serves the cachelet as before, reads and writes.
    let mut hit = 0;
    for k in &moving {
        hit += usize::from(s.get(k).unwrap().is_some());
    }
    assert!(hit > 0);
    assert_eq!(s.set(&moving[0], "after"), "STORED");
    assert_eq!(s.get(&moving[0]).unwrap().as_deref(), Some("after"));
    assert_eq!(s.stat("migrations_failed"), "1");
    assert_eq!(d.stat("migrations_refused"), "1");
}

/// A process `mbal cluster add-server` started for this test: stopped (SIGTERM, by pid) when
/// dropped.
struct Pid(i32);

impl Drop for Pid {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the pid of the server this test had started.
        unsafe { libc::kill(self.0, libc::SIGTERM) };
    }
}

/// `mbal cluster <args> --cluster <its file> --coordinator <its coordinator>`, run to its end.
fn cluster_cmd(c: &common::cluster::Cluster, args: &[&str]) -> std::process::Output {
    common::mbal()
        .arg("cluster")
        .args(args)
        .arg("--cluster")
        .arg(c._dir.path().join("cluster.toml"))
        .args(["--coordinator", &c.coordinator.to_string()])
        .output()
        .unwrap()
}

/// Every key's value, read from its owner in `map`.
fn read_all(servers: &[SocketAddr], map: &ClusterMap, keys: &[String]) -> Vec<Option<String>> {
    let mut conns: Vec<Conn> = servers.iter().map(|&a| Conn::new(a)).collect();
    keys.iter().map(|k| conns[map.route(key_hash(k.as_bytes())).1 as usize].get(k).unwrap()).collect()
}

#[test]
fn a_server_joins_warm_and_a_removed_server_hands_its_items_over() {
    // Phase 3 off: the reads below are load enough for it to move a cachelet between them.
    let c = up_with(2, &["--coordinator-arg=--phase3-epoch-ms=0"]);
    let map0 = Conn::new(c.coordinator).map();
    let keys: Vec<String> = (0..2000).map(|i| format!("warm:{i}")).collect();
    let mut servers: Vec<SocketAddr> = c.servers.iter().map(|s| s.0).collect();
    {
        let mut conns: Vec<Conn> = servers.iter().map(|&a| Conn::new(a)).collect();
        for k in &keys {
            assert_eq!(conns[map0.route(key_hash(k.as_bytes())).1 as usize].set(k, &format!("v-{k}")), "STORED");
        }
    }
    // A third server joins (`mbal cluster add-server`: warm): its share arrives with its items.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let new_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let addr = new_addr.to_string();
    let off = ["--server-arg=--hot-keys=off", "--server-arg=--balancer=off"];
    let out = cluster_cmd(&c, &[&["add-server", &addr, "-m", "16", "--wait", "120"][..], &off[..]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pid: i32 = stdout
        .split("(pid ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{stdout} {}", String::from_utf8_lossy(&out.stderr)));
    let _joiner = Pid(pid);
    assert!(out.status.success(), "{stdout} {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("joined; its share arrived"), "{stdout}");
    servers.push(new_addr);
    let share = map0.cachelet_count() as usize / 3;
    let map1 = wait_map(c.coordinator, "the joiner's share to arrive", |m| {
        m.servers().len() == 3 && (0..m.cachelet_count()).filter(|&cl| m.owner(cl).0 == 2).count() >= share
    });
    let want: Vec<Option<String>> = keys.iter().map(|k| Some(format!("v-{k}"))).collect();
    assert!(read_all(&servers, &map1, &keys) == want, "every item is where the map says, warm");
    // Server 0 is removed: its cachelets move to the others with their items, then it leaves.
    let out = cluster_cmd(&c, &["remove-server", "--id", "0", "--wait", "120", "--grace-ms", "100"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("redirects clients with an older map for 100 ms"));
    let map2 = Conn::new(c.coordinator).map();
    assert!((0..map2.cachelet_count()).all(|cl| map2.owner(cl).0 != 0));
    assert!(read_all(&servers, &map2, &keys) == want, "no item lost with the removed server");
    // And one cachelet moves on the command line.
    let cl = map2.cachelets_of(1, 0)[0];
    let out = cluster_cmd(&c, &["move", &cl.to_string(), "2:1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("cachelet {cl} moved from server 1 to 2:1")));
    // At once back again (the server it just arrived at has not installed the map yet).
    let out = cluster_cmd(&c, &["move", &cl.to_string(), "1:0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let map3 = wait_map(c.coordinator, "the move back", |m| m.owner(cl) == (1, 0));
    assert!(read_all(&servers, &map3, &keys) == want);
}

/// Phase 3 at the coordinator, live: the servers' epoch reports show one server far busier than
/// the others (a hot partition on all its cachelets, half writes: Phase 1 cannot help, Phase 2
/// has nowhere to go), and the coordinator moves some of its cachelets away with their items.
#[test]
fn phase3_moves_cachelets_off_a_hot_server() {
    let c = common::cluster::up_args(3, &["--server-arg=--hot-keys=off"]);
    let map0 = Conn::new(c.coordinator).map();
    let hot: Vec<String> =
        map0.cachelets_of(0, 0).iter().chain(&map0.cachelets_of(0, 1)).map(|c| c.to_string()).collect();
    let out = common::mbal()
        .args([
            "bench",
            "--routed",
            "--server",
            &c.servers[0].0.to_string(),
            "--workload",
            "custom",
            "--dist",
            "hotpart",
        ])
        .args(["--hot-cachelet-ids", &hot.join(","), "--hot-ops", "0.9", "--read-ratio", "0.5"])
        .args(["--rate", "3000", "--duration", "8", "--keys", "20000", "--load", "--quiet"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let map1 = wait_map(c.coordinator, "Phase 3 to move a cachelet off server 0", |m| {
        (0..m.cachelet_count()).any(|cl| map0.owner(cl).0 == 0 && m.owner(cl).0 != 0)
    });
    let moved: Vec<u32> =
        (0..map1.cachelet_count()).filter(|&cl| map0.owner(cl).0 == 0 && map1.owner(cl).0 != 0).collect();
    let mut co = Conn::new(c.coordinator);
    assert!(co.stat("phase3_migrations").parse::<u64>().unwrap() >= moved.len() as u64, "{moved:?}");
    assert!(co.stat("phase3_reports").parse::<u64>().unwrap() > 0);
}

#[test]
fn a_cachelet_moved_back_and_forth_at_once_keeps_every_item() {
    // Each move starts as soon as the last one answered: the answer must mean the source let
    // the cachelet go (it found itself still holding it: "already here"), and a map older
    // than a cachelet's arrival, reaching a server after it, must not take it (and its items)
    // away. (`--forward`: a plain connection to either server, on either worker, reads every
    // key. Phase 3 off: nothing else moves.)
    let c = up_with(2, &["--server-arg=--forward", "--coordinator-arg=--phase3-epoch-ms=0"]);
    let map0 = Conn::new(c.coordinator).map();
    let cl = map0.cachelets_of(0, 1)[0];
    let addrs = [c.servers[0].0, c.servers[1].0];
    let items = keys_of(&map0, cl, 200, "pp");
    let mut conn = Conn::new(addrs[0]);
    for k in &items {
        assert_eq!(conn.set(k, &format!("v-{k}")), "STORED");
    }
    let mut at = 0usize;
    for round in 0..16 {
        let to = 1 - at;
        let a = migrate(addrs[at], cl, (to as u16, (round % 2) as u16));
        assert!(a.starts_with(&format!("MIGRATED {cl} {} ", items.len())), "move {round}: {a}");
        at = to;
    }
    let owner = (at as u16, 1);
    let map = wait_map(c.coordinator, "the last move", |m| m.owner(cl) == owner);
    wait_servers(&addrs, map.epoch());
    for a in addrs.iter().flat_map(|&a| [a; 4]) {
        let mut s = Conn::new(a);
        for k in &items {
            assert_eq!(s.get(k).unwrap().as_deref(), Some(format!("v-{k}").as_str()), "{k} at {a}");
        }
    }
}
