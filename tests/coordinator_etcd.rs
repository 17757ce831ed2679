//! Two coordinators on a real etcd (`mbal cluster up --coordinator --coordinators 2 --store
//! etcd://...`, real processes): one leads, the standby answers `not the leader` with the
//! leader's address; after a SIGKILL of the leader the standby takes over with the same map and
//! epoch, and the server moves its beats to it without ever losing its lease (it answers every
//! read throughout, and is never declared dead).
//!
//! Needs the `etcd` binary (Debian's etcd-server; scripts/test.sh installs it). Without it the
//! test says so and passes, unless MBAL_REQUIRE_ETCD=1 (as scripts/test.sh sets).

mod common;

use common::{mbal, Kill};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A loopback port free now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A single-member etcd in a temp dir, on loopback ports; None if there is no `etcd` binary.
fn etcd(dir: &std::path::Path) -> Option<(Kill, SocketAddr)> {
    let has = Command::new("etcd").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !has.is_ok_and(|s| s.success()) {
        assert!(std::env::var("MBAL_REQUIRE_ETCD").is_err(), "MBAL_REQUIRE_ETCD is set but there is no etcd binary");
        eprintln!("SKIPPED: no etcd binary (apt-get install etcd-server)");
        return None;
    }
    let (p, q) = (free_port(), free_port());
    let client = format!("http://127.0.0.1:{p}");
    let peer = format!("http://127.0.0.1:{q}");
    let child = Command::new("etcd")
        .arg("--data-dir")
        .arg(dir.join("etcd"))
        .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("default={peer}")])
        // A 1 s lease is allowed (etcd's minimum TTL is 1.5 election timeouts).
        .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd");
    let guard = Kill(child);
    let addr: SocketAddr = format!("127.0.0.1:{p}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        assert!(Instant::now() < deadline, "etcd did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some((guard, addr))
}

/// Send one request, read its answer: lines until `END`, or the first line if it is not a
/// `STAT`/`MEMBER` line (one-line answers), or a map's blob.
fn ask(addr: SocketAddr, req: &str) -> Vec<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(format!("{req}\r\n").as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut out = Vec::new();
    for _ in 0..10_000 {
        let mut l = String::new();
        if r.read_line(&mut l).unwrap() == 0 {
            break;
        }
        let l = l.trim_end().to_string();
        if l == "END" {
            break;
        }
        if let Some(len) = l.strip_prefix("MAP ").and_then(|x| x.split_whitespace().nth(1)) {
            let mut blob = vec![0; len.parse::<usize>().unwrap() + 2];
            r.read_exact(&mut blob).unwrap();
            out.push(l.clone());
            out.push(String::from_utf8_lossy(&blob).trim_end().to_string());
            break;
        }
        let more = l.starts_with("STAT ") || l.starts_with("MEMBER ");
        out.push(l);
        if !more {
            break;
        }
    }
    out
}

fn stat(addr: SocketAddr, name: &str) -> Option<u64> {
    let lines = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok().map(|_| ask(addr, "stats"))?;
    lines.iter().find_map(|l| l.strip_prefix(&format!("STAT {name} "))?.parse().ok())
}

/// Poll until `f` is true (10 s at most).
fn wait(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_standby_takes_over_from_a_killed_leader_and_the_server_keeps_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    let Some((_etcd, etcd_addr)) = etcd(dir.path()) else { return };
    let file = dir.path().join("cluster.toml");
    let mut up = mbal()
        .args(["cluster", "up", "--coordinator", "--coordinators", "2", "--servers", "1", "--workers", "2", "-m", "16"])
        .arg("--store")
        .arg(format!("etcd://{etcd_addr}"))
        .arg("--file")
        .arg(&file)
        .args(["--server-arg=--hot-keys=off", "--server-arg=--balancer=off"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("cluster up");
    let out = up.stdout.take().unwrap();
    let _guard = Kill(up);
    let (mut server, mut coords) = (None, Vec::new());
    let pid_of = |rest: &str| -> i32 {
        let i = rest.find("(pid ").unwrap() + 5;
        rest[i..].split(')').next().unwrap().parse().unwrap()
    };
    for line in BufReader::new(out).lines() {
        let line = line.unwrap();
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("server ") {
            server = Some(rest.split_whitespace().nth(1).unwrap().parse::<SocketAddr>().unwrap());
        } else if let Some(rest) = t.strip_prefix("coordinator: ") {
            coords.push((rest.split_whitespace().next().unwrap().parse::<SocketAddr>().unwrap(), pid_of(rest)));
        }
        if line.starts_with("Ctrl-C") {
            break;
        }
    }
    let server = server.expect("a server");
    assert_eq!(coords.len(), 2);

    // Exactly one leads; the server beats to it.
    let leads = |a: SocketAddr| stat(a, "leader") == Some(1);
    wait("a leader", || coords.iter().filter(|c| leads(c.0)).count() == 1);
    let (leader, leader_pid) = *coords.iter().find(|c| leads(c.0)).unwrap();
    let standby = coords.iter().find(|c| c.0 != leader).unwrap().0;
    wait("the server's beats", || stat(server, "coordinator_beats").unwrap_or(0) >= 3);
    assert!(!leads(standby));

    // The standby answers the map, the members and stats (from etcd), and refuses the rest
    // naming the leader.
    let map = ask(leader, "mbal map");
    wait("the standby's copy of the map", || ask(standby, "mbal map") == map);
    let members = ask(standby, "mbal members");
    assert!(members[0].starts_with("MEMBER 0 ") && members[0].contains(" up "), "{members:?}");
    assert_eq!(ask(standby, "mbal beat 0 1"), vec![format!("SERVER_ERROR not the leader; leader {leader}")]);
    assert_eq!(ask(standby, "mbal leave 0")[0], format!("SERVER_ERROR not the leader; leader {leader}"));

    let mut c = TcpStream::connect(server).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut line = || {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        l.trim_end().to_string()
    };
    c.write_all(b"set k 0 0 2\r\nv1\r\n").unwrap();
    assert_eq!(line(), "STORED");

    // SIGKILL the leader: the standby takes over; meanwhile the server answers every read.
    unsafe { libc::kill(leader_pid, libc::SIGKILL) };
    let mut reads = 0;
    wait("the standby to lead and take the server's beats", || {
        c.write_all(b"get k\r\n").unwrap();
        let l = line();
        assert_eq!(l, "VALUE k 0 2", "read {reads} during the fail-over");
        assert_eq!(line(), "v1");
        assert_eq!(line(), "END");
        reads += 1;
        leads(standby) && stat(standby, "beats").unwrap_or(0) >= 3
    });
    assert!(reads > 5, "{reads} reads");
    assert_eq!(ask(standby, "mbal map"), map, "the same map and epoch");
    assert_eq!(stat(server, "coordinator_declared_dead"), Some(0));
    assert!(stat(server, "coordinator_lease_left_ms").unwrap() > 0);
    let members = ask(standby, "mbal members");
    assert!(members[0].contains(" up "), "{members:?}");
}
