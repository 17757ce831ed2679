//! A cross-server move cut off by a kill -9 (issue 34, "Faults"; the seeded runs are
//! scripts/fault-migrate.py), as real processes: a coordinator and two servers (`mbal cluster
//! up --coordinator`).
//!
//! - The destination dies in the middle of the move: the move aborts (`mbal migrate` answers
//!   `SERVER_ERROR migration failed`), the coordinator's map still gives the cachelet to the
//!   source, and the source serves it again with every item it acknowledged, those written
//!   during the move among them.
//! - The source dies in the middle of the move: after the failure detection the cachelet's
//!   new owner (the destination, the only server left) serves its keys as misses, never a value
//!   older than one the source acknowledged (what arrived of the move is not kept).
//! - The coordinator dies before the commit reaches it: the frozen cachelet's requests get an
//!   error at once (not a miss, not a wait) until a coordinator says the move did not stand.

mod common;

use common::cluster::{keys_of, signal, up_mem, wait_map, wait_servers, Cluster, Conn};
use mbal_cluster::ClusterMap;
use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Values of 10 KB: the 12 MB cachelet moves in many frames, so the kill lands in the middle.
const VALUE: usize = 10 << 10;
const ITEMS: usize = 1200;

fn value(k: &str, v: u64) -> String {
    let head = format!("{k}:{v}:");
    let pad = VALUE - head.len();
    head + &"x".repeat(pad)
}

/// A cluster of two servers with a cachelet of server 0 (worker `w`) filled: the cachelet,
/// its items.
fn filled(c: &Cluster) -> (ClusterMap, u32, Vec<String>) {
    let map0 = Conn::new(c.coordinator).map();
    let cl = map0.cachelets_of(0, 0)[0];
    let items = keys_of(&map0, cl, ITEMS, "item");
    let mut conn = Conn::new(c.servers[0].0);
    for k in &items {
        assert_eq!(conn.set(k, &value(k, 1)), "STORED");
    }
    (map0, cl, items)
}

/// The kill tests' leases: long enough that a server whose heartbeat thread is starved for a
/// second on a loaded 2-core machine (CI runs tests side by side) does not fence itself: a
/// fenced source answers the writer's sets "served by another mbal server", which is not what
/// these tests are about. Failure detection then takes ~2 s instead of ~0.6.
const ROOMY_LEASES: [&str; 2] = ["--coordinator-arg=--lease-ms=1500", "--coordinator-arg=--failure-timeout-ms=2000"];

/// `mbal migrate <c> 1 0` sent to `src`, answered on the returned connection.
fn start_move(src: SocketAddr, cl: u32) -> Conn {
    let mut conn = Conn::new(src);
    conn.s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    conn.s.write_all(format!("mbal migrate {cl} 1 0\r\n").as_bytes()).unwrap();
    conn
}

/// Poll the destination's `stats` until the first frame of the move arrived (bounded).
fn until_bytes_arrive(dst: SocketAddr) {
    let mut d = Conn::new(dst);
    let until = Instant::now() + Duration::from_secs(20);
    while d.stat("migrated_in_bytes").parse::<u64>().unwrap() == 0 {
        assert!(Instant::now() < until, "no byte of the move arrived");
    }
}

/// A writer of new versions of `keys` through `addr` until `stop`: the last version each key
/// was acknowledged with (an answer other than STORED ends it: the server died).
fn writer(addr: SocketAddr, keys: Vec<String>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<HashMap<String, u64>> {
    std::thread::spawn(move || {
        let mut acked = HashMap::new();
        let mut conn = Conn::new(addr);
        let t0 = Instant::now();
        for v in 2u64.. {
            for k in &keys {
                if stop.load(Ordering::Relaxed) || t0.elapsed() > Duration::from_secs(30) {
                    return acked;
                }
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| conn.set(k, &value(k, v))));
                match r {
                    Ok(a) if a == "STORED" => {
                        acked.insert(k.clone(), v);
                    }
                    Ok(a) => panic!("a write of {k} during the move: {a}"),
                    Err(_) => return acked, // the connection died with the server
                }
            }
        }
        acked
    })
}

/// The version in a value of key `k`.
fn version(k: &str, v: &str) -> u64 {
    let rest = v.strip_prefix(&format!("{k}:")).unwrap_or_else(|| panic!("{k}: a foreign value {:?}", &v[..40]));
    assert_eq!(v.len(), VALUE, "{k}: a torn value");
    rest.split(':').next().unwrap().parse().unwrap()
}

/// A local move (`mbal move`, as Phase 2 makes) of a cachelet that is migrating to another
/// server is refused while the migration runs: the worker keeps it (a thread-mate given it
/// would serve it beside the destination, and what it acknowledged would be lost when the
/// destination adopts the frozen copy). Every write the source acknowledged is at the
/// destination afterwards.
#[test]
fn a_local_move_of_a_migrating_cachelet_is_refused_and_no_write_is_lost() {
    let c = up_mem(2, 48, &[]);
    let (src, dst) = (c.servers[0].0, c.servers[1].0);
    let (map0, cl, items) = filled(&c);
    // A writer on the source until it answers otherwise than STORED (the commit).
    let w = {
        let keys = items[..50].to_vec();
        std::thread::spawn(move || {
            let (mut acked, mut conn, t0) = (HashMap::new(), Conn::new(src), Instant::now());
            for v in 2u64.. {
                for k in &keys {
                    if t0.elapsed() > Duration::from_secs(30) || conn.set(k, &value(k, v)) != "STORED" {
                        return acked;
                    }
                    acked.insert(k.clone(), v);
                }
            }
            acked
        })
    };
    let mut mv = start_move(src, cl);
    until_bytes_arrive(dst);
    let other = 1 - map0.owner(cl).1;
    let mut ctl = Conn::new(src);
    ctl.s.write_all(format!("mbal move {cl} {other}\r\n").as_bytes()).unwrap();
    let local = ctl.line();
    let answer = mv.line();
    assert!(answer.starts_with(&format!("MIGRATED {cl} ")), "{answer}");
    // Refused while it moves (or, had the migration ended first, not here any more): never done.
    assert!(
        local.starts_with("SERVER_ERROR cachelet is moving to another server")
            || local.starts_with("CLIENT_ERROR cachelet is not on this server"),
        "the local move of a migrating cachelet: {local}"
    );
    let acked = w.join().expect("the writer");
    assert!(!acked.is_empty());
    let map1 = wait_map(c.coordinator, "the move's commit", |m| m.owner(cl).0 == 1);
    wait_servers(&[src, dst], map1.epoch());
    // On the new owner's routed connection: every item, at its last acknowledged version.
    let mut d = Conn::new(dst);
    d.s.write_all(format!("mbal hello 0 {}\r\n", map1.owner(cl).1).as_bytes()).unwrap();
    assert!(d.line().starts_with("MBAL "));
    for k in &items {
        let got = d.get(k).unwrap_or_else(|e| panic!("{k}: {e}")).unwrap_or_else(|| panic!("{k}: lost"));
        assert_eq!(version(k, &got), acked.get(k).copied().unwrap_or(1), "{k}");
    }
}

#[test]
fn a_killed_destination_aborts_the_move_and_the_source_serves_every_item() {
    let c = up_mem(2, 48, &ROOMY_LEASES);
    let (src, dst) = (c.servers[0].0, c.servers[1].0);
    let (map0, cl, items) = filled(&c);
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(src, items[..50].to_vec(), stop.clone());
    let mut mv = start_move(src, cl);
    until_bytes_arrive(dst);
    signal(c.servers[1].1, libc::SIGKILL);
    let answer = mv.line();
    assert!(answer.starts_with("SERVER_ERROR migration failed"), "the move was not cut off: {answer}");
    // The coordinator finds the destination dead: its own cachelets go to the source; the
    // moving one never left it.
    let map1 = wait_map(c.coordinator, "the dead destination's cachelets to move", |m| {
        (0..m.cachelet_count()).all(|x| m.owner(x).0 == 0)
    });
    assert_eq!(map1.owner(cl), map0.owner(cl), "the map still gives the cachelet to the source");
    wait_servers(&[src], map1.epoch());
    stop.store(true, Ordering::Relaxed);
    let acked = w.join().expect("a write during the move was refused");
    assert!(!acked.is_empty());
    // Every acknowledged item is served by the source, at its last acknowledged version.
    let mut s = Conn::new(src);
    for k in &items {
        let got = s.get(k).unwrap_or_else(|e| panic!("{k}: {e}")).unwrap_or_else(|| panic!("{k}: lost"));
        assert_eq!(version(k, &got), acked.get(k).copied().unwrap_or(1), "{k}");
    }
    assert_eq!(s.set(&items[0], "after"), "STORED");
    assert_eq!(s.get(&items[0]).unwrap().as_deref(), Some("after"));
    assert_eq!(s.stat("migrations_failed"), "1");
    assert_eq!(s.stat("migrations_out"), "0");
}

#[test]
fn a_killed_source_leaves_misses_at_the_new_owner_never_an_old_value() {
    let c = up_mem(2, 48, &ROOMY_LEASES);
    let (src, dst) = (c.servers[0].0, c.servers[1].0);
    let (_, cl, items) = filled(&c);
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(src, items[..50].to_vec(), stop.clone());
    let _mv = start_move(src, cl);
    until_bytes_arrive(dst);
    signal(c.servers[0].1, libc::SIGKILL);
    let acked = w.join().expect("a write during the move was refused");
    assert!(!acked.is_empty());
    // The failure detection gives every cachelet to the destination.
    let map1 = wait_map(c.coordinator, "the dead source's cachelets to move", |m| {
        (0..m.cachelet_count()).all(|x| m.owner(x).0 == 1)
    });
    wait_servers(&[dst], map1.epoch());
    // On the owning worker's routed connection (a redirect would say it does not own it).
    let mut d = Conn::new(dst);
    d.s.write_all(format!("mbal hello 0 {}\r\n", map1.owner(cl).1).as_bytes()).unwrap();
    assert!(d.line().starts_with("MBAL "));
    let mut hits = 0;
    for k in &items {
        match d.get(k) {
            Ok(None) => {}
            Ok(Some(v)) => {
                // Only the source's newest state could be whole (the move's last frame).
                assert_eq!(version(k, &v), acked.get(k).copied().unwrap_or(1), "{k}: an old value");
                hits += 1;
            }
            Err(e) => panic!("{k}: {e}"),
        }
    }
    assert_eq!(hits, 0, "the move was cut off before its last frame: its items are not kept");
    // The new owner takes the cachelet's keys (once its lease covers the new map).
    let until = Instant::now() + Duration::from_secs(10);
    while d.set(&items[0], "again") != "STORED" {
        assert!(Instant::now() < until, "the new owner never took the cachelet");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(d.get(&items[0]).unwrap().as_deref(), Some("again"));
}

/// `mbal proxy --cluster FILE` on loopback (`-t 1`): its address, and the process (killed on drop).
fn proxy_of(file: &std::path::Path) -> (SocketAddr, common::Kill) {
    use std::io::{BufRead, BufReader};
    let mut child = common::mbal()
        .args(["proxy", "--cluster", file.to_str().unwrap(), "-l", "127.0.0.1", "-p", "0", "-t", "1", "--print-ports"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("mbal proxy");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    (v["main"].as_str().unwrap().parse().unwrap(), common::Kill(child))
}

/// Issue 34's finding (scripts/fault-migrate.py seed 305): after a commit, a server that took
/// no part in the move hears of the new epoch only at its next heartbeat (here 1 s away). A
/// proxy, and a routing client, whose map predates the commit, when the old owner then dies,
/// fetch the map from the coordinator (the cluster file names it), not from that server: the
/// moved cachelet's reads go to the new owner at once instead of being answered as misses.
#[test]
fn a_proxy_fetches_the_map_from_the_coordinator_not_from_a_server_a_beat_behind() {
    let slow_beats = [
        "--coordinator-arg=--beat-ms=1000",
        "--coordinator-arg=--lease-ms=4000",
        "--coordinator-arg=--failure-timeout-ms=6000",
    ];
    let c = up_mem(3, 16, &slow_beats);
    let (proxy, _proxy) = proxy_of(&c._dir.path().join("cluster.toml"));
    let map0 = Conn::new(c.coordinator).map();
    let cl = map0.cachelets_of(0, 0)[0];
    let keys = keys_of(&map0, cl, 20, "q");
    let mut p = Conn::new(proxy);
    for k in &keys {
        assert_eq!(p.set(k, "v1"), "STORED");
    }
    let file = c._dir.path().join("cluster.toml");
    let mut routed = mbal_client::Client::from_cluster_file(&file, mbal_client::Config::default()).unwrap();
    assert_eq!(routed.get(keys[0].as_bytes()).unwrap().map(|v| v.data), Some(b"v1".to_vec()));
    // server 0 -> server 2; server 1 takes no part
    let mut m = Conn::new(c.servers[0].0);
    m.s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    m.s.write_all(format!("mbal migrate {cl} 2 0\r\n").as_bytes()).unwrap();
    let answer = m.line();
    assert!(answer.starts_with(&format!("MIGRATED {cl} ")), "{answer}");
    signal(c.servers[0].1, libc::SIGKILL);
    for k in &keys {
        assert_eq!(p.get(k).unwrap().as_deref(), Some("v1"), "{k} through the proxy: the new owner is alive");
    }
    let fetched: u64 = p.stat("proxy_map_coordinator_fetches").parse().unwrap();
    assert!(fetched >= 1, "the map came from the coordinator ({fetched} fetches there)");
    for k in &keys {
        let got = routed.get(k.as_bytes()).unwrap_or_else(|e| panic!("{k}: {e}"));
        assert_eq!(got.map(|v| v.data), Some(b"v1".to_vec()), "{k} through the routing client");
    }
    let st = routed.stats();
    assert!(st.map_coordinator_fetches >= 2 && st.map_coordinator_failures == 0, "{st:?}");
}

/// Issue 34's finding (scripts/fault-migrate.py seed 316): a proxy whose map predates a move's
/// commit, when the old owner then dies, must not answer the moved cachelet's reads as misses
/// (`unreachable`) while the new owner is alive and holds them: the failed requests wait for
/// the map fetch the failure starts and go to the new owner (`proxy_unreachable_waits`).
#[test]
fn a_proxy_behind_a_commit_finds_the_moved_cachelet_when_the_old_owner_dies() {
    let c = up_mem(2, 16, &[]);
    let (proxy, _proxy) = proxy_of(&c._dir.path().join("cluster.toml"));
    let map0 = Conn::new(c.coordinator).map();
    let cl = map0.cachelets_of(0, 0)[0];
    let keys = keys_of(&map0, cl, 20, "p");
    let mut p = Conn::new(proxy);
    for k in &keys {
        assert_eq!(p.set(k, "v1"), "STORED");
        assert_eq!(p.get(k).unwrap().as_deref(), Some("v1"));
    }
    let answer = start_move(c.servers[0].0, cl).line();
    assert!(answer.starts_with(&format!("MIGRATED {cl} ")), "{answer}");
    let committed = Conn::new(c.coordinator).map().epoch();
    // The old owner dies before the proxy sent it anything of the moved cachelet.
    signal(c.servers[0].1, libc::SIGKILL);
    // The new owner serves the cachelet from its adoption (the source's `mbal import commit`)
    // and its map says so from its next beat (one at once, `Report::BeatNow`): the proxy's
    // fetch must find the commit there, not the few milliseconds before it.
    wait_servers(&[c.servers[1].0], committed);
    let mut d = Conn::new(c.servers[1].0);
    assert_eq!(d.get(&keys[0]).unwrap().as_deref(), Some("v1"), "the new owner holds it");
    for k in &keys {
        assert_eq!(p.get(k).unwrap().as_deref(), Some("v1"), "{k} through the proxy: the new owner is alive");
    }
}

/// The coordinator gone when the move's commit is sent (killed once it recorded the move; the
/// destination paused until then, so the move cannot commit first): whether the move stands is
/// unknown until a coordinator answers, and the cachelet stays frozen at its owner. Its
/// requests there are answered at once with an error, never a miss (older than what the client
/// wrote) and never a wait past a client's timeout (a proxy would then take the whole server
/// for down). Once the coordinator is back, with the same data, the move is aborted and the
/// source serves every item again.
#[test]
fn with_the_coordinator_gone_at_the_commit_the_frozen_cachelet_answers_errors_not_misses() {
    let c = up_mem(2, 48, &ROOMY_LEASES);
    let src = c.servers[0].0;
    let (_, cl, items) = filled(&c);
    // `cluster up` stops the cluster when its coordinator exits: it is paused meanwhile (and
    // continued before it is stopped, whatever happens: `Resume` drops before `c`).
    struct Resume(i32);
    impl Drop for Resume {
        fn drop(&mut self) {
            signal(self.0, libc::SIGCONT);
        }
    }
    let up = c._guard.0.id() as i32;
    signal(up, libc::SIGSTOP);
    let _resume = Resume(up);
    signal(c.servers[1].1, libc::SIGSTOP);
    let _resume_dst = Resume(c.servers[1].1);
    // The move's begin answered by the coordinator: its mover then dials the destination
    // (paused, so the connection waits there, its hello unanswered).
    let (pid, port) = (c.servers[0].1, c.servers[1].0.port());
    let before = connections_to(pid, port);
    let mut mv = start_move(src, cl);
    let until = Instant::now() + Duration::from_secs(20);
    while connections_to(pid, port) <= before {
        assert!(Instant::now() < until, "the mover never dialed the destination");
        std::thread::sleep(Duration::from_millis(5));
    }
    signal(c.coordinator_pid, libc::SIGKILL);
    signal(c.servers[1].1, libc::SIGCONT);
    // On the owning worker's routed connection, as the proxy and the routing clients connect.
    let mut owner = Conn::new(src);
    owner.s.write_all(b"mbal hello 0 0\r\n").unwrap();
    assert!(owner.line().starts_with("MBAL "));
    let k = &items[0];
    let until = Instant::now() + Duration::from_secs(30);
    let error = loop {
        match owner.get(k) {
            Ok(Some(v)) => assert_eq!(version(k, &v), 1, "{k}"),
            Ok(None) => panic!("{k}: a miss while its move waits for the coordinator"),
            Err(e) => break e,
        }
        if Instant::now() > until {
            // Why (the move's answer, if it ended).
            mv.s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            let mut b = [0u8; 512];
            let n = std::io::Read::read(&mut mv.s, &mut b).unwrap_or(0);
            panic!("the move never reached its commit: {}", String::from_utf8_lossy(&b[..n]));
        }
    };
    assert_eq!(error, format!("SERVER_ERROR cachelet {cl} is moving to another server; try again"));
    assert!(owner.stat("moving_errors").parse::<u64>().unwrap() > 0);
    // The coordinator again, on its address and data directory: the commit never reached it.
    let file = c._dir.path().join("cluster.toml");
    let _coordinator = common::Kill(
        common::mbal()
            .args(["coordinator", "--cluster"])
            .arg(&file)
            .args(["--listen", &c.coordinator.to_string(), "--data-dir"])
            .arg(c._dir.path().join("cluster.toml.coordinator"))
            .args(["--lease-ms", "1500", "--failure-timeout-ms", "2000"])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let answer = mv.line();
    assert!(answer.starts_with("SERVER_ERROR migration failed"), "{answer}");
    for k in &items {
        let v = owner.get(k).unwrap_or_else(|e| panic!("{k}: {e}")).unwrap_or_else(|| panic!("{k}: lost"));
        assert_eq!(version(k, &v), 1, "{k}");
    }
    assert_eq!(owner.stat("migrations_failed"), "1");
}

/// The established TCP connections process `pid` holds to port `port` of 127.0.0.1 (from
/// /proc: its socket inodes, and /proc/net/tcp's remote address and state).
fn connections_to(pid: i32, port: u16) -> usize {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let remote = format!("0100007F:{port:04X}");
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 9 && f[2] == remote && f[3] == "01" && inodes.contains(f[9]))
        .count()
}
