//! A cluster with a coordinator, as real processes (`mbal cluster up --coordinator`): a server
//! killed with SIGKILL costs misses, not errors; a server paused past the failure timeout
//! (SIGSTOP) neither acknowledges a write nor answers a read from the copy it lost.
//!
//! Every request goes over a plain memcached connection to the server that owns the key in the
//! coordinator's map (read with `mbal map` from the coordinator), or on purpose to the paused
//! one; every reply is checked.

mod common;

use common::cluster::{keys, owner, signal, up, up_args, wait_map, wait_servers, Conn};
use common::{mbal, Kill};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Stdio;
use std::time::{Duration, Instant};

#[test]
fn a_killed_server_costs_misses_and_its_keys_are_served_again() {
    let c = up(3);
    let map0 = Conn::new(c.coordinator).map();
    let keys = keys(600);
    let mut conns: Vec<Conn> = c.servers.iter().map(|&(a, _)| Conn::new(a)).collect();
    for k in &keys {
        assert_eq!(conns[owner(&map0, k) as usize].set(k, &format!("v1-{k}")), "STORED");
    }
    // The servers hear each other's load through the coordinator (`mbal report`).
    let until = Instant::now() + Duration::from_secs(20);
    while conns[0].stat("coordinator_peer_reports").parse::<u64>().unwrap() == 0 {
        assert!(Instant::now() < until, "no load report relayed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let dead = 1u16;
    signal(c.servers[dead as usize].1, libc::SIGKILL);
    let killed = Instant::now();
    let map1 = wait_map(c.coordinator, "the dead server's cachelets to move", |m| {
        m.epoch() > map0.epoch() && (0..m.cachelet_count()).all(|cl| m.owner(cl).0 != dead)
    });
    let live: Vec<SocketAddr> =
        c.servers.iter().enumerate().filter(|&(i, _)| i != dead as usize).map(|(_, s)| s.0).collect();
    wait_servers(&live, map1.epoch());
    let detected = killed.elapsed();
    // Every key is served: the dead server's as misses, then stored again; the others' values
    // are all still there (nothing else disturbed).
    let mut missed = 0;
    for k in &keys {
        let s = owner(&map1, k) as usize;
        let got = conns[s].get(k).unwrap_or_else(|e| panic!("get {k} at server {s}: {e}"));
        if owner(&map0, k) == dead {
            assert_eq!(got, None, "{k} lived on the dead server: a miss");
            missed += 1;
            assert_eq!(conns[s].set(k, "v2"), "STORED");
            assert_eq!(conns[s].get(k).unwrap().as_deref(), Some("v2"));
        } else {
            assert_eq!(got.as_deref(), Some(format!("v1-{k}").as_str()), "{k} on a live server");
        }
    }
    assert!(missed > 0);
    eprintln!("reassigned and installed by every live server {:?} after the kill; {missed} keys missed", detected);
}

#[test]
fn a_paused_server_neither_acknowledges_nor_answers_for_what_moved() {
    let c = up(3);
    let map0 = Conn::new(c.coordinator).map();
    let keys = keys(400);
    let paused = 2u16;
    let mut conns: Vec<Conn> = c.servers.iter().map(|&(a, _)| Conn::new(a)).collect();
    for k in &keys {
        assert_eq!(conns[owner(&map0, k) as usize].set(k, "old"), "STORED");
    }
    let mine: Vec<&String> = keys.iter().filter(|k| owner(&map0, k) == paused).collect();
    assert!(!mine.is_empty());
    // A second connection to the paused server, opened now: its requests are read the moment
    // the process runs again.
    let mut stale = Conn::new(c.servers[paused as usize].0);
    signal(c.servers[paused as usize].1, libc::SIGSTOP);
    let map1 = wait_map(c.coordinator, "the paused server's cachelets to move", |m| {
        (0..m.cachelet_count()).all(|cl| m.owner(cl).0 != paused)
    });
    let live: Vec<SocketAddr> =
        c.servers.iter().enumerate().filter(|&(i, _)| i != paused as usize).map(|(_, s)| s.0).collect();
    wait_servers(&live, map1.epoch());
    // The new owners take new values.
    for k in &mine {
        let s = owner(&map1, k) as usize;
        assert_eq!(conns[s].set(k, "new"), "STORED");
    }
    // Requests for the moved keys sent to the paused server before it runs again.
    let mut pipeline = Vec::new();
    for k in &mine {
        write!(pipeline, "get {k}\r\nset {k} 0 0 5\r\nlate!\r\n").unwrap();
    }
    stale.s.write_all(&pipeline).unwrap();
    signal(c.servers[paused as usize].1, libc::SIGCONT);
    let mut acked = Vec::new();
    for k in &mine {
        match stale.get(k) {
            Ok(None) | Err(_) => {}
            Ok(Some(v)) => assert_ne!(v, "old", "{k}: the paused server answered from the copy it lost"),
        }
        let r = stale.line();
        if r == "STORED" {
            acked.push(k.to_string());
        } else {
            assert!(r.starts_with("SERVER_ERROR"), "{k}: {r}");
        }
    }
    // It registers again and is given a share of the cachelets (empty).
    let map3 = wait_map(c.coordinator, "the resumed server to get cachelets again", |m| {
        (0..m.cachelet_count()).any(|cl| m.owner(cl).0 == paused)
    });
    wait_servers(&c.servers.iter().map(|s| s.0).collect::<Vec<_>>(), map3.epoch());
    // A write the resumed server acknowledged is one it was entitled to take: it owns the key's
    // cachelet again, and the value is there.
    for k in &acked {
        let s = owner(&map3, k);
        assert_eq!(s, paused, "{k}: acknowledged by the resumed server, owned by server {s}");
        assert_eq!(conns[s as usize].get(k).unwrap().as_deref(), Some("late!"));
    }
    // What the others took while it was paused is still there, unless it went to the resumed
    // server with its share (empty).
    for k in &mine {
        let s = owner(&map3, k) as usize;
        if s != paused as usize {
            assert_eq!(conns[s].get(k).unwrap().as_deref(), Some("new"), "{k}");
        }
    }
    eprintln!("{} of {} late writes acknowledged (their cachelets came back)", acked.len(), mine.len());
    let back: Vec<&String> = keys.iter().filter(|k| owner(&map3, k) == paused).collect();
    assert!(!back.is_empty());
    for k in back {
        let got = conns[paused as usize].get(k).unwrap();
        assert!(got.is_none() || got.as_deref() == Some("late!"), "{k}: {got:?} (it came back empty)");
        // Until its lease is renewed (the next heartbeat after the map is applied) it refuses.
        let until = Instant::now() + Duration::from_secs(10);
        while conns[paused as usize].set(k, "again") != "STORED" {
            assert!(Instant::now() < until, "{k}: the resumed server never took it");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(conns[paused as usize].get(k).unwrap().as_deref(), Some("again"));
    }
}

#[test]
fn a_server_joins_takes_a_share_and_leaves_again() {
    let c = up(2);
    let file = c._dir.path().join("cluster.toml");
    let map0 = Conn::new(c.coordinator).map();
    let keys = keys(400);
    let mut conns: Vec<Conn> = c.servers.iter().map(|&(a, _)| Conn::new(a)).collect();
    for k in &keys {
        assert_eq!(conns[owner(&map0, k) as usize].set(k, "v1"), "STORED");
    }
    // A third server joins: no --id; the cluster file names the coordinator.
    let mut child = mbal()
        .args(["server", "-p", "0", "-m", "16", "--print-ports", "--hot-keys=off", "--balancer=off", "--join", "cold"])
        .arg("--cluster")
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let _joiner = Kill(child);
    let addr: SocketAddr =
        serde_json::from_str::<serde_json::Value>(&line).unwrap()["main"].as_str().unwrap().parse().unwrap();
    let map1 = wait_map(c.coordinator, "the joiner to get a share", |m| {
        m.servers().len() == 3 && (0..m.cachelet_count()).any(|cl| m.owner(cl).0 == 2)
    });
    assert_eq!(map1.servers()[2].main, addr);
    let share = (0..map1.cachelet_count()).filter(|&cl| map1.owner(cl).0 == 2).count();
    assert!(share >= map1.cachelet_count() as usize / 3 - 1, "an even share: {share}");
    let all: Vec<SocketAddr> = c.servers.iter().map(|s| s.0).chain([addr]).collect();
    wait_servers(&all, map1.epoch());
    conns.push(Conn::new(addr));
    for k in &keys {
        let s = owner(&map1, k) as usize;
        let got = conns[s].get(k).unwrap();
        if s == 2 {
            assert_eq!(got, None, "{k}: its cachelet came to the joiner empty");
            assert_eq!(conns[2].set(k, "v2"), "STORED");
        } else {
            assert_eq!(got.as_deref(), Some("v1"), "{k}");
        }
    }
    // It leaves: its cachelets go back to the others (empty), it serves none of them.
    let out = mbal()
        .args(["cluster", "leave", "--id", "2", "--coordinator", &c.coordinator.to_string(), "--cluster"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let map2 = wait_map(c.coordinator, "the leaver's cachelets to move", |m| {
        (0..m.cachelet_count()).all(|cl| m.owner(cl).0 != 2)
    });
    wait_servers(&all[..2], map2.epoch());
    for k in &keys {
        if owner(&map1, k) == 2 {
            let s = owner(&map2, k) as usize;
            assert_eq!(conns[s].get(k).unwrap(), None, "{k}: back empty");
            assert_eq!(conns[s].set(k, "v3"), "STORED");
            // The server that left answers nothing from what it had.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match conns[2].get(k) {
                    Ok(None) | Err(_) => break,
                    Ok(Some(v)) => {
                        assert_eq!(v, "v2", "{k}");
                        assert!(Instant::now() < deadline, "{k}: the server that left still serves it");
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        }
    }
}

/// A server taken out of the cluster (`mbal cluster leave`) idles until it is stopped (its
/// heartbeat thread once spun, waiting for the stop with a timeout that had run out).
#[test]
fn a_server_that_left_idles() {
    // The defaults (the balancers on): a controller that keeps the heartbeat thread's channel
    // open after the leave, as a server in production has.
    let c = up_args(2, &[]);
    let file = c._dir.path().join("cluster.toml");
    let out = mbal()
        .args(["cluster", "leave", "--id", "1", "--coordinator", &c.coordinator.to_string(), "--cluster"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let map = wait_map(c.coordinator, "the leaver's cachelets to move", |m| {
        (0..m.cachelet_count()).all(|cl| m.owner(cl).0 != 1)
    });
    wait_servers(&[c.servers[0].0], map.epoch());
    let pid = c.servers[1].1;
    let cpu_ticks = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let f: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        assert_ne!(f[0], "Z", "the server that left exited");
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap() // utime + stime
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    // Idle, it uses next to nothing (a tick or two); the spin used 0.15-0.85 s of CPU a second.
    let (t0, c0) = (Instant::now(), cpu_ticks());
    std::thread::sleep(Duration::from_secs(2));
    let used = (cpu_ticks() - c0) as f64 / hz as f64;
    let secs = t0.elapsed().as_secs_f64();
    assert!(used < 0.1 * secs, "the server that left used {used:.2} s of CPU in {secs:.1} s");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn spawn_coordinator(file: &std::path::Path, addr: SocketAddr, dir: &std::path::Path) -> Kill {
    let child = mbal()
        .args(["coordinator", "--cluster"])
        .arg(file)
        .args(["--listen", &addr.to_string(), "--data-dir"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < until, "the coordinator did not come up");
        std::thread::sleep(Duration::from_millis(10));
    }
    Kill(child)
}

#[test]
fn the_cluster_serves_through_a_coordinator_restart_and_the_map_survives() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.toml");
    let servers: Vec<SocketAddr> = (0..2).map(|_| SocketAddr::from(([127, 0, 0, 1], free_port()))).collect();
    let mut toml = String::from("workers = 2\n");
    for a in &servers {
        toml += &format!("[[servers]]\naddr = \"{a}\"\n");
    }
    std::fs::write(&file, toml).unwrap();
    let coord: SocketAddr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let data = dir.path().join("coordinator");
    let mut coordinator = spawn_coordinator(&file, coord, &data);
    let mut guards = Vec::new();
    for id in 0..2 {
        let child = mbal()
            .args(["server", "-m", "16", "--hot-keys=off", "--balancer=off", "--cluster"])
            .arg(&file)
            .args(["--id", &id.to_string(), "--coordinator", &coord.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        guards.push(Kill(child));
    }
    let mut conns: Vec<Conn> = Vec::new();
    for &a in &servers {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(s) = TcpStream::connect(a) {
                drop(s);
                break;
            }
            assert!(Instant::now() < until, "server {a} did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
        conns.push(Conn::new(a));
    }
    let map0 = Conn::new(coord).map();
    let keys = keys(200);
    // Wait until both serve (registered, lease held).
    for k in &keys {
        let s = owner(&map0, k) as usize;
        let until = Instant::now() + Duration::from_secs(10);
        while conns[s].set(k, "v1") != "STORED" {
            assert!(Instant::now() < until);
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // The coordinator dies: for well past the lease and the failure timeout, every key is
    // still served (the servers' heartbeats are refused: no one can take their cachelets).
    signal(coordinator.0.id() as i32, libc::SIGKILL);
    let _ = coordinator.0.wait();
    let until = Instant::now() + Duration::from_millis(1500);
    let mut rounds = 0;
    while Instant::now() < until {
        for k in &keys {
            let s = owner(&map0, k) as usize;
            assert_eq!(conns[s].get(k).unwrap().as_deref(), Some("v1"), "{k} with the coordinator down");
        }
        rounds += 1;
    }
    assert!(rounds > 0);
    let s0 = owner(&map0, &keys[0]) as usize;
    assert_eq!(conns[s0].set(&keys[0], "v1"), "STORED", "writes go on too");
    // It comes back on the same state: the same map and epoch; the servers beat again.
    coordinator = spawn_coordinator(&file, coord, &data);
    let map1 = Conn::new(coord).map();
    assert_eq!(map1, map0, "the map and its epoch survived");
    let beats = conns[0].stat("coordinator_beats").parse::<u64>().unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while conns[0].stat("coordinator_beats").parse::<u64>().unwrap() <= beats + 2 {
        assert!(Instant::now() < until, "no heartbeat after the coordinator's restart");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Nobody was declared dead on the way.
    assert_eq!(Conn::new(coord).map(), map0);
    drop(coordinator);
}

/// What one client saw: operations, errors, and any read that went backwards.
#[derive(Default, Debug)]
struct Seen {
    sets: u64,
    acked: u64,
    errors: u64,
    reads: u64,
    misses: u64,
    backwards: Vec<String>,
}

/// A routing client writing and reading its own keys with growing versions until `stop`,
/// checking every read: a miss is allowed (a dead server's keys are lost), a value older than
/// one this client already had acknowledged or read is not, nor one it never wrote.
fn client_loop(file: std::path::PathBuf, t: usize, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> Seen {
    use std::sync::atomic::Ordering;
    let cfg = mbal_client::Config {
        connect_timeout: Duration::from_millis(300),
        io_timeout: Duration::from_millis(800),
        ..Default::default()
    };
    let mut client = mbal_client::Client::from_cluster_file(&file, cfg).unwrap();
    let n = 40;
    let mut written = vec![0u64; n]; // the newest version sent
    let mut floor = vec![0u64; n]; // the newest version acknowledged or read
    let mut seen = Seen::default();
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        let key = format!("c{t}:k{}", i % n);
        let k = i % n;
        written[k] += 1;
        let v = written[k];
        seen.sets += 1;
        match client.set(key.as_bytes(), v.to_string().as_bytes(), 0, 0) {
            Ok(true) => {
                seen.acked += 1;
                floor[k] = floor[k].max(v);
            }
            Ok(false) | Err(_) => seen.errors += 1,
        }
        seen.reads += 1;
        match client.get(key.as_bytes()) {
            Ok(None) => seen.misses += 1,
            Ok(Some(val)) => {
                let got: u64 = String::from_utf8_lossy(&val.data).parse().unwrap_or(0);
                if got < floor[k] || got > written[k] || got == 0 {
                    seen.backwards.push(format!("{key}: read {got}, had {} (wrote up to {})", floor[k], written[k]));
                }
                floor[k] = floor[k].max(got);
            }
            Err(_) => seen.errors += 1,
        }
        i += 1;
    }
    seen
}

#[test]
fn concurrent_clients_through_a_kill_and_a_pause_never_read_backwards() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let c = up(4);
    let file = c._dir.path().join("cluster.toml");
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..3)
        .map(|t| {
            let (file, stop) = (file.clone(), stop.clone());
            std::thread::spawn(move || client_loop(file, t, stop))
        })
        .collect();
    let map0 = Conn::new(c.coordinator).map();
    std::thread::sleep(Duration::from_millis(300)); // load before the faults (bounded, not a wait)
    signal(c.servers[1].1, libc::SIGKILL);
    wait_map(c.coordinator, "the killed server's cachelets to move", |m| {
        m.epoch() > map0.epoch() && (0..m.cachelet_count()).all(|cl| m.owner(cl).0 != 1)
    });
    std::thread::sleep(Duration::from_millis(300));
    signal(c.servers[2].1, libc::SIGSTOP);
    wait_map(c.coordinator, "the paused server's cachelets to move", |m| {
        (0..m.cachelet_count()).all(|cl| m.owner(cl).0 != 2 && m.owner(cl).0 != 1)
    });
    std::thread::sleep(Duration::from_millis(300));
    signal(c.servers[2].1, libc::SIGCONT);
    wait_map(c.coordinator, "the resumed server to rejoin", |m| (0..m.cachelet_count()).any(|cl| m.owner(cl).0 == 2));
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    for (t, h) in clients.into_iter().enumerate() {
        let seen = h.join().unwrap();
        eprintln!("client {t}: {seen:?}");
        assert!(seen.backwards.is_empty(), "client {t} read backwards: {:?}", seen.backwards);
        assert!(seen.acked > 0 && seen.reads > seen.misses, "client {t} did work: {seen:?}");
    }
}
