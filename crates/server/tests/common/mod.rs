#![allow(dead_code)]
//! Helpers for integration tests: start a real server on loopback ephemeral
//! ports and talk to it over real sockets.

use mbal_server::config::Settings;
use mbal_server::ServerHandle;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub fn settings(threads: usize) -> Settings {
    // Ephemeral worker ports too: tests talk to workers directly.
    Settings { port: 0, threads, memory_limit: 32 << 20, worker_port_base: Some(0), ..Settings::default() }
}

pub fn start(s: Settings) -> ServerHandle {
    mbal_server::start(s).expect("server starts")
}

/// A blocking text-protocol connection with a read timeout (a hung server
/// fails the test instead of hanging it).
pub struct Conn {
    pub r: BufReader<TcpStream>,
    pub w: TcpStream,
}

impl Conn {
    pub fn open(addr: SocketAddr) -> Conn {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        Conn { r: BufReader::new(s.try_clone().unwrap()), w: s }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.w.write_all(bytes).expect("write");
    }

    pub fn line(&mut self) -> String {
        let mut l = String::new();
        self.r.read_line(&mut l).expect("read line");
        l
    }

    /// Send a command and read one reply line.
    pub fn cmd(&mut self, c: &str) -> String {
        self.send(c.as_bytes());
        self.line()
    }

    pub fn exact(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.r.read_exact(&mut v).expect("read exact");
        v
    }

    /// Read lines up to and including END; returns them without END.
    pub fn until_end(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        loop {
            let l = self.line();
            assert!(!l.is_empty(), "connection closed before END; got {out:?}");
            if l == "END\r\n" {
                return out;
            }
            out.push(l);
        }
    }

    /// get that returns Some(value) or None.
    pub fn get(&mut self, key: &str) -> Option<Vec<u8>> {
        self.send(format!("get {key}\r\n").as_bytes());
        let l = self.line();
        if l == "END\r\n" {
            return None;
        }
        let parts: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(parts[0], "VALUE", "unexpected {l:?}");
        let n: usize = parts[3].parse().unwrap();
        let v = self.exact(n + 2);
        assert_eq!(self.line(), "END\r\n");
        Some(v[..n].to_vec())
    }

    pub fn set(&mut self, key: &str, val: &[u8]) -> String {
        let mut b = format!("set {key} 0 0 {}\r\n", val.len()).into_bytes();
        b.extend_from_slice(val);
        b.extend_from_slice(b"\r\n");
        self.send(&b);
        self.line()
    }

    /// Is the connection closed by the server (EOF)?
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.r.read(&mut b), Ok(0) | Err(_))
    }
}

/// Parse `stats` into (name, value) pairs.
pub fn stats(c: &mut Conn, group: &str) -> Vec<(String, String)> {
    let cmd = if group.is_empty() { "stats\r\n".to_string() } else { format!("stats {group}\r\n") };
    c.send(cmd.as_bytes());
    c.until_end()
        .into_iter()
        .map(|l| {
            let mut it = l.trim_end().splitn(3, ' ');
            assert_eq!(it.next(), Some("STAT"), "{l}");
            (it.next().unwrap().to_string(), it.next().unwrap_or("").to_string())
        })
        .collect()
}

pub fn stat(c: &mut Conn, name: &str) -> u64 {
    stats(c, "")
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.parse().unwrap())
        .unwrap_or_else(|| panic!("no stat {name}"))
}

/// A one-server key space and its initial owners, as the server deals them.
pub struct Layout {
    pub keys: mbal_cluster::KeySpace,
    pub owners: Vec<mbal_cluster::Owner>,
}

impl Layout {
    pub fn even(servers: u16, workers: u16, cachelets_per_worker: u32, vn_count: u32) -> Layout {
        let owners = mbal_cluster::even_owners(servers, workers, cachelets_per_worker);
        let keys = mbal_cluster::KeySpace::even(owners.len() as u32, vn_count);
        Layout { keys, owners }
    }

    pub fn cachelet_of_hash(&self, hash: u64) -> u32 {
        self.keys.cachelet_of_hash(hash)
    }

    pub fn owner(&self, c: u32) -> mbal_cluster::Owner {
        self.owners[c as usize]
    }
}
