//! The server's lifecycle, on the real binary: `shutdown` (with `-A`) and SIGTERM end the
//! process with status 0 within 2 s under a pipelined load, and the stop is graceful in this
//! precise sense (docs/operations.md "Stopping"): on every connection, each request the
//! client had finished sending before the stop was asked for gets its whole reply, in order;
//! the connection then ends with EOF, never in the middle of a reply. Where a memcached is
//! running (`MBAL_MEMCACHED_ADDR`, as in crates/proto/tests/vs_memcached.rs), the answers to
//! `shutdown` are compared with its; with `memcached` on the PATH too, a memcached started
//! with `-A` is stopped the same way and both must exit with status 0.

#[allow(dead_code)]
mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `mbal server -A` on a free loopback port: the child and its main address.
fn start_mbal(threads: &str) -> (Child, String) {
    let mut child = common::mbal()
        .args(["server", "-A", "-l", "127.0.0.1", "-p", "0", "-t", threads, "-m", "64", "--print-ports"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn mbal");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).expect("--print-ports line");
    (child, v["main"].as_str().unwrap().to_string())
}

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    // No Nagle: a request sent is on its way to the server, not held for an ACK.
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Wait (bounded) for the child to exit: its status and how long it took from `since`.
fn exit_within(child: &mut Child, since: Instant, bound: Duration) -> (std::process::ExitStatus, Duration) {
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return (st, since.elapsed());
        }
        if since.elapsed() > bound {
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
            let _ = child.wait();
            panic!("the server did not exit within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One pipelining client: a writer sends batches of `set`/`get` pairs and counts the
/// requests it finished sending; a reader checks each reply, in order, until EOF.
struct Load {
    sent: Arc<AtomicU64>,
    answered: Arc<AtomicU64>,
    writer: std::thread::JoinHandle<()>,
    reader: std::thread::JoinHandle<Result<u64, String>>,
}

const BATCH: u64 = 64;
/// Requests a client has sent and not had answered, at most: about 11 KB, less than a
/// loopback socket's receive buffer, so that a request sent has reached the server's socket.
const WINDOW: u64 = 512;
/// Bound on one client's requests (the stop comes long before).
const MAX_REQUESTS: u64 = 4_000_000;

fn request(c: usize, i: u64, out: &mut Vec<u8>) {
    let key = format!("c{c}k{}", (i / 2) % 1000);
    if i.is_multiple_of(2) {
        write!(out, "set {key} {i} 0 8\r\n{:08}\r\n", i % 100_000_000).unwrap();
    } else {
        write!(out, "get {key}\r\n").unwrap();
    }
}

fn reply(c: usize, i: u64) -> Vec<u8> {
    if i.is_multiple_of(2) {
        b"STORED\r\n".to_vec()
    } else {
        let (key, set) = (format!("c{c}k{}", (i / 2) % 1000), i - 1);
        format!("VALUE {key} {set} 8\r\n{:08}\r\nEND\r\n", set % 100_000_000).into_bytes()
    }
}

fn start_load(addr: &str, c: usize, done: Arc<AtomicBool>) -> Load {
    let s = connect(addr);
    let mut w = s.try_clone().unwrap();
    let mut r = s;
    let sent = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let (sent2, answered2, answered3) = (sent.clone(), answered.clone(), answered.clone());
    let eof = Arc::new(AtomicBool::new(false));
    let eof2 = eof.clone();
    let writer = std::thread::spawn(move || {
        let mut i = 0;
        let mut buf = Vec::new();
        let t0 = Instant::now();
        while i < MAX_REQUESTS && !done.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(60) {
            if i - answered3.load(Ordering::SeqCst) + BATCH > WINDOW {
                if eof2.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_micros(100));
                continue;
            }
            buf.clear();
            for j in i..i + BATCH {
                request(c, j, &mut buf);
            }
            if w.write_all(&buf).is_err() {
                return;
            }
            i += BATCH;
            sent2.store(i, Ordering::SeqCst);
        }
    });
    let reader = std::thread::spawn(move || {
        let mut got: Vec<u8> = Vec::new();
        let mut chunk = vec![0u8; 64 << 10];
        let mut i = 0u64;
        loop {
            let n = match r.read(&mut chunk) {
                Ok(0) => {
                    eof.store(true, Ordering::SeqCst);
                    break;
                }
                Ok(n) => n,
                Err(e) => return Err(format!("client {c}: read failed after {i} replies: {e}")),
            };
            got.extend_from_slice(&chunk[..n]);
            let mut at = 0;
            loop {
                let want = reply(c, i);
                if got.len() - at < want.len() {
                    if !want.starts_with(&got[at..]) {
                        return Err(format!("client {c}: reply {i} is {:?}", String::from_utf8_lossy(&got[at..])));
                    }
                    break;
                }
                if got[at..at + want.len()] != want[..] {
                    let end = (at + want.len()).min(got.len());
                    return Err(format!("client {c}: reply {i} is {:?}", String::from_utf8_lossy(&got[at..end])));
                }
                at += want.len();
                i += 1;
            }
            got.drain(..at);
            answered2.store(i, Ordering::SeqCst);
        }
        if !got.is_empty() {
            return Err(format!(
                "client {c}: the connection ended inside reply {i}: {:?}",
                String::from_utf8_lossy(&got)
            ));
        }
        Ok(i)
    });
    Load { sent, answered, writer, reader }
}

/// Stop a loaded server with `stop` and check the exit and every client's replies.
fn stop_under_load(stop: impl FnOnce(&Child, &str)) {
    let (mut child, addr) = start_mbal("2");
    let done = Arc::new(AtomicBool::new(false));
    let loads: Vec<Load> = (0..3).map(|c| start_load(&addr, c, done.clone())).collect();
    // Under load: every client has had replies.
    let t0 = Instant::now();
    while loads.iter().any(|l| l.answered.load(Ordering::SeqCst) < 2000) {
        assert!(t0.elapsed() < Duration::from_secs(30), "no load");
        std::thread::sleep(Duration::from_millis(5));
    }
    // What each client had finished sending before the stop was asked for; a round trip on
    // another connection orders the sends before the stop on loopback.
    let before: Vec<u64> = loads.iter().map(|l| l.sent.load(Ordering::SeqCst)).collect();
    let mut ping = connect(&addr);
    ping.write_all(b"version\r\n").unwrap();
    let mut v = [0u8; 64];
    assert!(ping.read(&mut v).unwrap() > 0);
    let at = Instant::now();
    stop(&child, &addr);
    let (status, took) = exit_within(&mut child, at, Duration::from_secs(10));
    done.store(true, Ordering::Relaxed);
    assert!(status.success(), "exit status {status}");
    assert!(took < Duration::from_secs(2), "took {took:?}");
    for (c, l) in loads.into_iter().enumerate() {
        let _ = l.writer.join();
        let answered = l.reader.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
        assert!(answered >= before[c], "client {c}: {answered} replies, {} requests sent before the stop", before[c]);
    }
}

#[test]
fn sigterm_under_pipelined_load_answers_what_was_sent_and_exits_0() {
    stop_under_load(|child, _| unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    });
}

#[test]
fn sigint_under_pipelined_load_answers_what_was_sent_and_exits_0() {
    stop_under_load(|child, _| unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    });
}

#[test]
fn shutdown_under_pipelined_load_answers_what_was_sent_and_exits_0() {
    stop_under_load(|_, addr| {
        let mut s = connect(addr);
        s.write_all(b"shutdown graceful\r\n").unwrap();
        // memcached hangs up on the asker, writing nothing.
        let mut buf = [0u8; 64];
        assert_eq!(s.read(&mut buf).unwrap(), 0);
    });
}

/// What the asker of `shutdown` reads (until EOF, or `bound`), and whether the server exited.
fn ask(addr: &str, req: &[u8]) -> Vec<u8> {
    let mut s = connect(addr);
    s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    s.write_all(req).unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 256];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => {
                got.extend_from_slice(b"<EOF>");
                break;
            }
            Ok(n) => got.extend_from_slice(&chunk[..n]),
            Err(_) => break,
        }
    }
    got
}

#[test]
fn shutdown_answers_as_memcached_and_a_second_signal_exits_at_once() {
    let (mut child, addr) = start_mbal("1");
    assert_eq!(ask(&addr, b"shutdown bogus\r\n"), b"CLIENT_ERROR invalid shutdown mode\r\n");
    assert_eq!(ask(&addr, b"shutdown graceful x\r\n"), b"CLIENT_ERROR invalid shutdown mode\r\n");
    if let Some(mc) = memcached_addr() {
        // A stock memcached (started without -A): the same refusal; mbal's without -A too.
        let (mut plain, plain_addr) = {
            let mut c = common::mbal()
                .args(["server", "-l", "127.0.0.1", "-p", "0", "-t", "1", "--print-ports"])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let mut line = String::new();
            BufReader::new(c.stdout.take().unwrap()).read_line(&mut line).unwrap();
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            (c, v["main"].as_str().unwrap().to_string())
        };
        for req in [&b"shutdown\r\n"[..], b"shutdown graceful\r\n", b"shutdown bogus\r\n"] {
            assert_eq!(ask(&plain_addr, req), ask(&mc, req), "{:?}", String::from_utf8_lossy(req));
        }
        unsafe { libc::kill(plain.id() as libc::pid_t, libc::SIGTERM) };
        assert!(exit_within(&mut plain, Instant::now(), Duration::from_secs(5)).0.success());
    }
    // Replies to what came before `shutdown` on the asker's connection, then EOF.
    assert_eq!(ask(&addr, b"version\r\nshutdown\r\nversion\r\n"), format!("VERSION {}\r\n<EOF>", version()).as_bytes());
    let (status, _) = exit_within(&mut child, Instant::now(), Duration::from_secs(2));
    assert!(status.success(), "{status}");

    // A second signal while the first stop drains a connection that never reads: exit at once, 1.
    let (mut child, addr) = start_mbal("1");
    let mut stuck = connect(&addr);
    // Replies pile up unread; the server cannot finish writing them.
    let big = b"get k\r\n".repeat(200_000);
    stuck.write_all(b"set k 0 0 4000\r\n").unwrap();
    stuck.write_all(&[b'x'; 4000]).unwrap();
    stuck.write_all(b"\r\n").unwrap();
    let w = std::thread::spawn(move || {
        let _ = stuck.write_all(&big);
        stuck
    });
    // Until the server has answered some of the gets (and is stuck writing the rest).
    let t0 = Instant::now();
    while stat(&addr, "get_hits") < 100 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the gets were not read");
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = child.id() as libc::pid_t;
    unsafe { libc::kill(pid, libc::SIGTERM) };
    std::thread::sleep(Duration::from_millis(100));
    assert!(child.try_wait().unwrap().is_none(), "still draining");
    let at = Instant::now();
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let (status, took) = exit_within(&mut child, at, Duration::from_secs(1));
    assert_eq!(status.code(), Some(1), "{status}");
    assert!(took < Duration::from_millis(500), "{took:?}");
    drop(w.join());
}

/// One counter of `stats`.
fn stat(addr: &str, name: &str) -> u64 {
    let mut s = connect(addr);
    s.write_all(b"stats\r\n").unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while !got.ends_with(b"END\r\n") {
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0);
        got.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&got);
    let line = text.lines().find(|l| l.split_whitespace().nth(1) == Some(name)).unwrap();
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

fn version() -> String {
    let out = common::mbal().arg("--version").output().unwrap();
    let v = String::from_utf8_lossy(&out.stdout);
    format!("1.6.18-mbal-{}", v.split_whitespace().last().unwrap())
}

fn memcached_addr() -> Option<String> {
    let a = std::env::var("MBAL_MEMCACHED_ADDR").ok().filter(|s| !s.is_empty());
    if a.is_none() && std::env::var_os("MBAL_REQUIRE_MEMCACHED").is_some() {
        panic!("MBAL_REQUIRE_MEMCACHED is set but MBAL_MEMCACHED_ADDR is not");
    }
    a
}

/// memcached with `-A`, stopped by `shutdown` and by SIGTERM: both exit 0, the asker reads
/// EOF and nothing else, as with mbal (above).
#[test]
fn memcached_exits_0_on_shutdown_and_sigterm_as_mbal_does() {
    if memcached_addr().is_none() {
        return;
    }
    let Ok(true) = Command::new("memcached").arg("-h").stdout(Stdio::null()).status().map(|s| s.success()) else {
        return;
    };
    for how in ["shutdown", "sigterm"] {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut args = vec!["-A", "-l", "127.0.0.1", "-U", "0", "-t", "1", "-m", "64"];
        if unsafe { libc::geteuid() } == 0 {
            args.extend(["-u", "nobody"]);
        }
        let p = port.to_string();
        args.extend(["-p", &p]);
        let mut mc = Command::new("memcached").args(&args).stderr(Stdio::null()).spawn().unwrap();
        let addr = format!("127.0.0.1:{port}");
        let t0 = Instant::now();
        let s = loop {
            match TcpStream::connect(&addr) {
                Ok(s) => break s,
                Err(_) if t0.elapsed() < Duration::from_secs(5) => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => panic!("memcached did not start: {e}"),
            }
        };
        drop(s);
        let at = Instant::now();
        if how == "shutdown" {
            assert_eq!(ask(&addr, b"shutdown\r\n"), b"<EOF>");
        } else {
            unsafe { libc::kill(mc.id() as libc::pid_t, libc::SIGTERM) };
        }
        let (status, _) = exit_within(&mut mc, at, Duration::from_secs(5));
        assert!(status.success(), "memcached after {how}: {status}");
    }
    let (mut child, addr) = start_mbal("1");
    assert_eq!(ask(&addr, b"shutdown\r\n"), b"<EOF>");
    assert!(exit_within(&mut child, Instant::now(), Duration::from_secs(2)).0.success());
}
