//! A cluster with a coordinator as real processes (`mbal cluster up --coordinator`), and a
//! plain text connection with a deadline on every read, for the root package's tests.
#![allow(dead_code)]

use super::{mbal, Kill};
use mbal_cluster::ClusterMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Stdio;
use std::time::{Duration, Instant};

pub struct Cluster {
    pub _guard: Kill,
    pub servers: Vec<(SocketAddr, i32)>,
    pub coordinator: SocketAddr,
    pub coordinator_pid: i32,
    pub _dir: tempfile::TempDir,
}

pub fn up(servers: usize) -> Cluster {
    up_with(servers, &[])
}

/// `up` with more arguments for `mbal cluster up`.
pub fn up_with(servers: usize, extra: &[&str]) -> Cluster {
    up_mem(servers, 16, extra)
}

/// `up_with`, each server with `memory_mb` MB of items.
pub fn up_mem(servers: usize, memory_mb: usize, extra: &[&str]) -> Cluster {
    let mut args = vec!["--server-arg=--hot-keys=off", "--server-arg=--balancer=off"];
    args.extend_from_slice(extra);
    up_args_mem(servers, memory_mb, &args)
}

/// `mbal cluster up --coordinator` with these arguments after the common ones.
pub fn up_args(servers: usize, args: &[&str]) -> Cluster {
    up_args_mem(servers, 16, args)
}

fn up_args_mem(servers: usize, memory_mb: usize, args: &[&str]) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.toml");
    let mut cmd = mbal();
    let (n, m) = (servers.to_string(), memory_mb.to_string());
    cmd.args(["cluster", "up", "--coordinator", "--servers", &n, "--workers", "2", "-m", &m])
        .arg("--file")
        .arg(&file)
        .args(args);
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("cluster up");
    let out = child.stdout.take().unwrap();
    let guard = Kill(child);
    let mut list = Vec::new();
    let mut coordinator = None;
    // "  server 0: 127.0.0.1:p (pid n), 2 workers" / "  coordinator: 127.0.0.1:p (pid n), ..."
    let pid_of = |rest: &str| -> i32 {
        let i = rest.find("(pid ").unwrap() + 5;
        rest[i..].split(')').next().unwrap().parse().unwrap()
    };
    for line in BufReader::new(out).lines() {
        let line = line.unwrap();
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("server ") {
            let addr = rest.split_whitespace().nth(1).unwrap().parse().unwrap();
            list.push((addr, pid_of(rest)));
        } else if let Some(rest) = t.strip_prefix("coordinator: ") {
            coordinator = Some((rest.split_whitespace().next().unwrap().parse().unwrap(), pid_of(rest)));
        }
        if line.starts_with("Ctrl-C") {
            break;
        }
    }
    assert_eq!(list.len(), servers);
    let (coordinator, coordinator_pid) = coordinator.expect("a coordinator");
    Cluster { _guard: guard, servers: list, coordinator, coordinator_pid, _dir: dir }
}

/// A plain text connection with a deadline on every read.
pub struct Conn {
    pub s: TcpStream,
    pub buf: Vec<u8>,
}

impl Conn {
    pub fn new(addr: SocketAddr) -> Conn {
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap_or_else(|e| panic!("{addr}: {e}"));
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Conn { s, buf: Vec::new() }
    }

    pub fn line(&mut self) -> String {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let l = String::from_utf8_lossy(&self.buf[..i]).into_owned();
                self.buf.drain(..i + 2);
                return l;
            }
            let mut chunk = [0u8; 4096];
            let n = self.s.read(&mut chunk).expect("an answer");
            assert!(n > 0, "connection closed");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    pub fn set(&mut self, key: &str, val: &str) -> String {
        self.s.write_all(format!("set {key} 0 0 {}\r\n{val}\r\n", val.len()).as_bytes()).unwrap();
        self.line()
    }

    /// The value, or None for a miss; an error line is returned as Err.
    pub fn get(&mut self, key: &str) -> Result<Option<String>, String> {
        self.s.write_all(format!("get {key}\r\n").as_bytes()).unwrap();
        let l = self.line();
        if l == "END" {
            return Ok(None);
        }
        if !l.starts_with("VALUE ") {
            return Err(l);
        }
        let v = self.line();
        assert_eq!(self.line(), "END");
        Ok(Some(v))
    }

    /// One figure of `stats`.
    pub fn stat(&mut self, name: &str) -> String {
        self.s.write_all(b"stats\r\n").unwrap();
        let mut found = None;
        loop {
            let l = self.line();
            if l == "END" {
                return found.unwrap_or_else(|| panic!("no stat {name}"));
            }
            if let Some(v) = l.strip_prefix(&format!("STAT {name} ")) {
                found = Some(v.to_string());
            }
        }
    }

    /// `mbal map`: the map's blob.
    pub fn map(&mut self) -> ClusterMap {
        self.s.write_all(b"mbal map\r\n").unwrap();
        let head = self.line();
        let len: usize = head.split_whitespace().nth(2).unwrap().parse().unwrap();
        while self.buf.len() < len + 2 {
            let mut chunk = [0u8; 65536];
            let n = self.s.read(&mut chunk).unwrap();
            assert!(n > 0);
            self.buf.extend_from_slice(&chunk[..n]);
        }
        let json: Vec<u8> = self.buf.drain(..len + 2).take(len).collect();
        ClusterMap::from_json(std::str::from_utf8(&json).unwrap()).unwrap()
    }
}

pub fn owner(map: &ClusterMap, key: &str) -> u16 {
    map.route(mbal_cluster::key_hash(key.as_bytes())).1
}

/// Poll the coordinator's map until `pred` holds (bounded).
pub fn wait_map(coord: SocketAddr, what: &str, pred: impl Fn(&ClusterMap) -> bool) -> ClusterMap {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let m = Conn::new(coord).map();
        if pred(&m) {
            return m;
        }
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Wait until each of `servers` has installed the coordinator's map of `epoch` (they learn it
/// from their next heartbeat's answer).
pub fn wait_servers(servers: &[SocketAddr], epoch: u64) {
    for &a in servers {
        wait_map(a, "a server to install the coordinator's map", |m| m.epoch() >= epoch);
    }
}

pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a pid this test's `cluster up` started.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

pub fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("key:{i}")).collect()
}

/// `n` keys of cachelet `c` in `map`, named `<prefix>:<i>`.
pub fn keys_of(map: &ClusterMap, c: u32, n: usize, prefix: &str) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}:{i}"))
        .filter(|k| map.route(mbal_cluster::key_hash(k.as_bytes())).0 == c)
        .take(n)
        .collect()
}
