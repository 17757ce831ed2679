//! `mbal top` against a real cluster: it reads every server's epochs and
//! prints the per-worker table and the hot keys (a pinned one with its
//! replicas), refreshing once per epoch.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

mod common;
use common::{cluster_up, mbal};

#[test]
fn top_shows_workers_and_hot_keys() {
    let dir = std::env::temp_dir().join(format!("mbal-top-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cluster.toml");
    let mut up = mbal();
    up.args(["cluster", "up", "--servers", "2", "--workers", "2", "-m", "16", "--file"]).arg(&file).args([
        "--server-arg=--enable-debug-commands",
        "--server-arg=--epoch-ms",
        "--server-arg=100",
    ]);
    // Its report names each server once it listens.
    let (_guard, addrs) = cluster_up(up, 2);
    // Pin a key of server 0 as hot with one copy.
    let mut c = TcpStream::connect(&addrs[0]).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut line = String::new();
    let key = (0..10_000)
        .map(|i| format!("topkey{i}"))
        .find(|k| {
            line.clear();
            c.write_all(format!("set {k} 0 0 1\r\nv\r\n").as_bytes()).unwrap();
            r.read_line(&mut line).unwrap();
            line == "STORED\r\n"
        })
        .expect("a key server 0 holds");
    line.clear();
    c.write_all(format!("mbal debug hot {key} 1\r\n").as_bytes()).unwrap();
    r.read_line(&mut line).unwrap();
    assert_eq!(line, "OK\r\n");

    let top = mbal().args(["top", "--server", &addrs[0], "--iterations", "3"]).output().expect("mbal top");
    let text = String::from_utf8_lossy(&top.stdout);
    assert!(top.status.success(), "{text}\n{}", String::from_utf8_lossy(&top.stderr));
    assert_eq!(text.matches("mbal top: 2 servers, 4 workers").count(), 3, "three refreshes:\n{text}");
    assert!(text.contains("SERVER WORKER"), "{text}");
    let last = text.rsplit("mbal top:").next().unwrap();
    let hot = last.lines().find(|l| l.starts_with(&key)).unwrap_or_else(|| panic!("{key} listed:\n{last}"));
    assert!(hot.contains("Hot") && hot.trim_end().ends_with('1'), "{hot}");
    let _ = std::fs::remove_dir_all(&dir);
}
