//! Memory limit and eviction over real sockets: a full server keeps
//! serving writes, on every worker, however the load was spread before.

mod common;
use common::*;
use mbal_cluster::{key_hash, ClusterMap};

#[test]
fn full_server_keeps_storing_on_every_worker() {
    let srv = start(mbal_server::config::Settings { memory_limit: 8 << 20, ..settings(2) });
    let mut c = Conn::open(srv.main_addr);
    c.send(b"mbal map\r\n");
    let l = c.line();
    let n: usize = l.split_whitespace().nth(2).unwrap().parse().unwrap();
    let body = c.exact(n + 2);
    let map = ClusterMap::from_json(std::str::from_utf8(&body[..n]).unwrap()).unwrap();
    let val = vec![b'x'; 1000];
    // Phase 1: 3x the memory, all of it into worker 0's cachelets.
    let w0_keys = (0..).map(|i| format!("a{i}")).filter(|k| map.route(key_hash(k.as_bytes())).2 == 0);
    let mut first = None;
    for k in w0_keys.take(24_000) {
        assert_eq!(c.set(&k, &val), "STORED\r\n", "{k}");
        first.get_or_insert(k);
    }
    // Phase 2: worker 1, which holds nothing yet, is served at once.
    let w1_keys = (0..).map(|i| format!("b{i}")).filter(|k| map.route(key_hash(k.as_bytes())).2 == 1);
    let mut last = String::new();
    for k in w1_keys.take(24_000) {
        assert_eq!(c.set(&k, &val), "STORED\r\n", "{k}");
        last = k;
    }
    assert!(stat(&mut c, "evictions") > 0);
    // The most recent write is readable; the oldest of worker 0 was evicted.
    assert_eq!(c.get(&last).as_deref(), Some(&val[..]));
    assert_eq!(c.get(&first.unwrap()), None);
    srv.shutdown();
}

/// What a memcached-protocol server at `addr` does when filled past its memory with -M:
/// the distinct reply lines to 100 sets of 50 KB, the failures, and its counters.
struct FullReport {
    lines: std::collections::BTreeSet<String>,
    /// An overwrite with a larger value failed (and dropped the old one).
    dropped: bool,
    failed: u64,
    store_no_memory: u64,
    outofmemory: u64,
    evictions: u64,
}

fn fill_without_evictions(addr: std::net::SocketAddr) -> FullReport {
    let mut c = Conn::open(addr);
    let val = vec![b'x'; 50_000];
    let mut lines = std::collections::BTreeSet::new();
    let mut failed = 0;
    let mut stored = Vec::new();
    for i in 0..100 {
        let l = c.set(&format!("k{i}"), &val);
        if l.starts_with("SERVER_ERROR") {
            failed += 1;
        } else {
            stored.push(i);
        }
        lines.insert(l);
    }
    // nothing stored was evicted to make room
    for i in &stored {
        assert_eq!(c.get(&format!("k{i}")).as_deref(), Some(&val[..]), "k{i}");
    }
    // noreply hides a failed store's error too (memcached 1.6), and counts it
    c.send(format!("set nr 0 0 {} noreply\r\n", val.len()).as_bytes());
    c.send(&val);
    c.send(b"\r\nversion\r\n");
    assert!(c.line().starts_with("VERSION "), "nothing before the version");
    failed += 1;
    // a set that fails drops the value it was to replace (no stale reads)
    let k = format!("k{}", stored[0]);
    let mut dropped = false;
    let bigger = vec![b'y'; 60_000];
    for _ in 0..4 {
        if c.set(&k, &bigger).starts_with("SERVER_ERROR") {
            failed += 1;
            assert_eq!(c.get(&k), None, "the old value of {k} is gone");
            dropped = true;
            break;
        }
        assert_eq!(c.get(&k).as_deref(), Some(&bigger[..]));
    }
    let items = stats(&mut c, "items");
    let outofmemory =
        items.iter().filter(|(k, _)| k.ends_with(":outofmemory")).map(|(_, v)| v.parse::<u64>().unwrap()).sum();
    FullReport {
        lines,
        dropped,
        failed,
        store_no_memory: stat(&mut c, "store_no_memory"),
        outofmemory,
        evictions: stat(&mut c, "evictions"),
    }
}

#[test]
fn no_evictions_refuses_stores_once_full_and_counts_them() {
    let srv = start(mbal_server::config::Settings { memory_limit: 2 << 20, evictions: false, ..settings(2) });
    let r = fill_without_evictions(srv.main_addr);
    let want: std::collections::BTreeSet<String> =
        ["STORED\r\n", "SERVER_ERROR out of memory storing object\r\n"].iter().map(|s| s.to_string()).collect();
    assert_eq!(r.lines, want);
    assert!(r.dropped, "a full server refused an overwrite");
    assert!(r.failed > 50, "2 MB hold fewer than 50 values of 50 KB: {}", r.failed);
    assert_eq!((r.store_no_memory, r.outofmemory, r.evictions), (r.failed, r.failed, 0));
    srv.shutdown();
}

/// The same against a real memcached 1.6 started with -M -m 2, when one can be started
/// (`memcached` on PATH or `MBAL_MEMCACHED_BIN`; required when `MBAL_REQUIRE_MEMCACHED` is set).
#[test]
fn no_evictions_matches_memcached() {
    let bin = std::env::var("MBAL_MEMCACHED_BIN").unwrap_or_else(|_| "memcached".into());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut cmd = std::process::Command::new(&bin);
    cmd.args(["-l", "127.0.0.1", "-p", &port.to_string(), "-U", "0", "-t", "1", "-m", "2", "-M"]);
    if unsafe { libc::geteuid() } == 0 {
        cmd.args(["-u", "nobody"]);
    }
    let mut child = match cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn() {
        Ok(c) => c,
        Err(e) => {
            assert!(std::env::var_os("MBAL_REQUIRE_MEMCACHED").is_none(), "cannot start {bin}: {e}");
            eprintln!("skipped: cannot start {bin}: {e}");
            return;
        }
    };
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    // memcached says nothing when it is ready: try to connect, a bounded number of times
    let up = (0..200).any(|_| {
        std::net::TcpStream::connect(addr).is_ok() || {
            std::thread::sleep(std::time::Duration::from_millis(25));
            false
        }
    });
    let mc = up.then(|| fill_without_evictions(addr));
    let _ = child.kill();
    let _ = child.wait();
    let mc = mc.expect("memcached started");
    let srv = start(mbal_server::config::Settings { memory_limit: 2 << 20, evictions: false, ..settings(1) });
    let mb = fill_without_evictions(srv.main_addr);
    srv.shutdown();
    assert_eq!(mb.lines, mc.lines, "the same replies");
    assert_eq!((mc.store_no_memory, mc.outofmemory, mc.evictions), (mc.failed, mc.failed, 0), "memcached's counters");
    assert_eq!((mb.store_no_memory, mb.outofmemory, mb.evictions), (mb.failed, mb.failed, 0), "mbal's, the same");
    // how much fits differs by the per-item overhead of each design, not by much
    assert!(mb.failed.abs_diff(mc.failed) <= 15, "mbal {} vs memcached {} failures", mb.failed, mc.failed);
}
