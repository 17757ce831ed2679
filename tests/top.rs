//! `mbal top` against a real cluster: it reads every server's epochs and
//! prints the per-worker table and the hot keys (a pinned one with its
//! replicas), refreshing once per epoch.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        // SIGTERM: `cluster up` stops its servers, then exits (only the
        // processes this test started, by pid).
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

#[test]
fn top_shows_workers_and_hot_keys() {
    let dir = std::env::temp_dir().join(format!("mbal-top-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cluster.toml");
    let mut up = Command::new(env!("CARGO_BIN_EXE_mbal"))
        .args(["cluster", "up", "--servers", "2", "--workers", "2", "-m", "16", "--file"])
        .arg(&file)
        .args(["--server-arg=--enable-debug-commands", "--server-arg=--epoch-ms", "--server-arg=100"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("cluster up");
    let out = up.stdout.take().unwrap();
    let _guard = Kill(up);
    // Its report names each server once it listens.
    let mut addrs = Vec::new();
    for line in BufReader::new(out).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.trim().strip_prefix("server ") {
            addrs.push(rest.split_whitespace().nth(1).unwrap().to_string());
        }
        if line.starts_with("Ctrl-C") {
            break;
        }
    }
    assert_eq!(addrs.len(), 2, "{addrs:?}");
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

    let top = Command::new(env!("CARGO_BIN_EXE_mbal"))
        .args(["top", "--server", &addrs[0], "--iterations", "3"])
        .output()
        .expect("mbal top");
    let text = String::from_utf8_lossy(&top.stdout);
    assert!(top.status.success(), "{text}\n{}", String::from_utf8_lossy(&top.stderr));
    assert_eq!(text.matches("mbal top: 2 servers, 4 workers").count(), 3, "three refreshes:\n{text}");
    assert!(text.contains("SERVER WORKER"), "{text}");
    let last = text.rsplit("mbal top:").next().unwrap();
    let hot = last.lines().find(|l| l.starts_with(&key)).unwrap_or_else(|| panic!("{key} listed:\n{last}"));
    assert!(hot.contains("Hot") && hot.trim_end().ends_with('1'), "{hot}");
    let _ = std::fs::remove_dir_all(&dir);
}
