//! Retrieval lines of any length (`get`/`gets`/`gat`/`gats` with thousands
//! of keys on one line), over real sockets: answered in order with one
//! `END`, across workers on the main port and with per-key redirects on a
//! routed connection; other commands keep the line limit.

mod common;
use common::*;
use mbal_cluster::{key_hash, ClusterMap};
use std::io::{Read, Write};
use std::net::TcpStream;

fn fetch_map(c: &mut Conn) -> ClusterMap {
    c.send(b"mbal map\r\n");
    let l = c.line();
    let mut it = l.split_whitespace();
    assert_eq!(it.next(), Some("MAP"), "{l}");
    let _epoch: u64 = it.next().unwrap().parse().unwrap();
    let n: usize = it.next().unwrap().parse().unwrap();
    let body = c.exact(n + 2);
    ClusterMap::from_json(std::str::from_utf8(&body[..n]).unwrap()).unwrap()
}

/// Store `keys` (value = the key reversed) with one pipelined write of
/// noreply sets, synchronised by a `mn`.
fn preload(c: &mut Conn, keys: &[String]) {
    let mut req = Vec::new();
    for k in keys {
        let v: String = k.chars().rev().collect();
        req.extend_from_slice(format!("set {k} 7 0 {} noreply\r\n{v}\r\n", v.len()).as_bytes());
    }
    req.extend_from_slice(b"mn\r\n");
    c.send(&req);
    assert_eq!(c.line(), "MN\r\n");
}

fn value_block(k: &str) -> String {
    let v: String = k.chars().rev().collect();
    format!("VALUE {k} 7 {}\r\n{v}\r\n", v.len())
}

/// Write `chunks` from another thread (the replies are read meanwhile, so
/// neither side blocks on a full socket buffer), then read exactly
/// `want.len()` bytes and compare.
fn send_and_expect(c: &mut Conn, chunks: Vec<Vec<u8>>, want: &[u8]) {
    let mut w = c.w.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        for ch in chunks {
            w.write_all(&ch).expect("write");
        }
    });
    let got = c.exact(want.len());
    writer.join().unwrap();
    if got != want {
        let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
        panic!(
            "reply differs at byte {at}: got {:?}, want {:?}",
            String::from_utf8_lossy(&got[at.saturating_sub(60)..(at + 60).min(got.len())]),
            String::from_utf8_lossy(&want[at.saturating_sub(60)..(at + 60).min(want.len())])
        );
    }
}

#[test]
fn twenty_thousand_keys_on_one_line_main_port_four_workers() {
    let srv = start(settings(4));
    let mut c = Conn::open(srv.main_addr);
    let keys: Vec<String> = (0..20_000).map(|i| format!("longline:key:{i}")).collect();
    // Every third key is missing.
    let stored: Vec<String> = keys.iter().enumerate().filter(|(i, _)| i % 3 != 0).map(|(_, k)| k.clone()).collect();
    preload(&mut c, &stored);
    let line = format!("get {}\r\n", keys.join(" "));
    assert!(line.len() > 4 * 64 * 1024, "{} bytes", line.len());
    let mut want: String = keys.iter().enumerate().filter(|(i, _)| i % 3 != 0).map(|(_, k)| value_block(k)).collect();
    want.push_str("END\r\n");
    let hits0 = stat(&mut c, "get_hits");
    let cross0 = stat(&mut c, "cross_worker_requests");
    send_and_expect(&mut c, vec![line.clone().into_bytes()], want.as_bytes());
    // One END: the next request's reply follows at once.
    assert_eq!(c.cmd("mn\r\n"), "MN\r\n");
    assert_eq!(stat(&mut c, "get_hits") - hits0, stored.len() as u64, "get_hits counts every key");
    assert!(stat(&mut c, "cross_worker_requests") - cross0 > 1000, "keys spread over the four workers");

    // The same line split at every kind of boundary, in separate writes:
    // inside a key, at a space, between \r and \n.
    let b = line.as_bytes();
    let inside_key = b.len() / 3 + 5;
    let at_space = b.len() / 2 + b[b.len() / 2..].iter().position(|&x| x == b' ').unwrap();
    let in_crlf = b.len() - 1;
    let mut cuts = vec![1, 3, 4, inside_key, at_space, at_space + 1, in_crlf];
    cuts.sort_unstable();
    let mut chunks = Vec::new();
    let mut prev = 0;
    for cut in cuts {
        chunks.push(b[prev..cut].to_vec());
        prev = cut;
    }
    chunks.push(b[prev..].to_vec());
    send_and_expect(&mut c, chunks, want.as_bytes());
    // Byte-sized writes across a piece boundary.
    let small: Vec<Vec<u8>> = b.chunks(7).map(<[u8]>::to_vec).collect();
    send_and_expect(&mut c, small, want.as_bytes());
    assert_eq!(c.cmd("mn\r\n"), "MN\r\n");

    // gets and gat carry the same keys.
    c.send(format!("gets {}\r\n", keys.join(" ")).as_bytes());
    let lines = c.until_end();
    assert_eq!(lines.iter().filter(|l| l.starts_with("VALUE ")).count(), stored.len());
    c.send(format!("gat 1000 {}\r\n", keys.join(" ")).as_bytes());
    let lines = c.until_end();
    assert_eq!(lines.iter().filter(|l| l.starts_with("VALUE ")).count(), stored.len());
    srv.shutdown();
}

#[test]
fn twenty_thousand_keys_on_a_routed_connection_redirect_per_key() {
    let srv = start(settings(4));
    let mut plain = Conn::open(srv.main_addr);
    let map = fetch_map(&mut plain);
    let keys: Vec<String> = (0..20_000).map(|i| format!("routed:{i}")).collect();
    preload(&mut plain, &keys);
    // Routed connection on worker 2's port: its keys are served, the others
    // come back as `RD <epoch> <server> <worker> <key>` in their place.
    let mut r = Conn::open(srv.worker_addrs[2]);
    assert_eq!(r.cmd("mbal hello 1\r\n"), "MBAL 0 2 1\r\n");
    let mut want = String::new();
    let (mut here, mut away) = (0u64, 0u64);
    for k in &keys {
        let (_, s, w) = map.route(key_hash(k.as_bytes()));
        if w == 2 {
            want.push_str(&value_block(k));
            here += 1;
        } else {
            want.push_str(&format!("RD 1 {s} {w} {k}\r\n"));
            away += 1;
        }
    }
    want.push_str("END\r\n");
    assert!(here > 1000 && away > 1000);
    let hits0 = stat(&mut plain, "get_hits");
    let line = format!("get {}\r\n", keys.join(" "));
    send_and_expect(&mut r, vec![line.clone().into_bytes()], want.as_bytes());
    assert_eq!(r.cmd("mn\r\n"), "MN\r\n");
    assert_eq!(stat(&mut plain, "get_hits") - hits0, here);
    // A short line keeps whole-request redirects.
    let (k_here, k_away) = (
        keys.iter().find(|k| map.route(key_hash(k.as_bytes())).2 == 2).unwrap(),
        keys.iter().find(|k| map.route(key_hash(k.as_bytes())).2 != 2).unwrap(),
    );
    let w_away = map.route(key_hash(k_away.as_bytes())).2;
    assert_eq!(r.cmd(&format!("get {k_here} {k_away}\r\n")), format!("RD 1 0 {w_away}\r\n"));
    // The same long line on a plain connection to the same port is served whole.
    let mut p = Conn::open(srv.worker_addrs[2]);
    let mut all: String = keys.iter().map(|k| value_block(k)).collect();
    all.push_str("END\r\n");
    send_and_expect(&mut p, vec![line.into_bytes()], all.as_bytes());
    srv.shutdown();
}

#[test]
fn replies_larger_than_the_output_bound_pause_and_resume() {
    // 12,000 keys of 1 KB values: 12 MB of replies to one line, more than
    // a connection's output bound (4 MiB). The client writes the whole
    // line before it reads anything.
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    let keys: Vec<String> = (0..12_000).map(|i| format!("big:{i}")).collect();
    let val = vec![b'v'; 1000];
    let mut req = Vec::new();
    for k in &keys {
        req.extend_from_slice(format!("set {k} 0 0 {} noreply\r\n", val.len()).as_bytes());
        req.extend_from_slice(&val);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"mn\r\n");
    c.send(&req);
    assert_eq!(c.line(), "MN\r\n");
    for line in [format!("get {}\r\n", keys.join(" ")), format!("get {}\r\n", keys[..3000].join(" "))] {
        c.send(line.as_bytes());
        c.send(b"mn\r\n");
        let n = line.split(' ').count() - 1;
        for k in &keys[..n] {
            assert_eq!(c.line(), format!("VALUE {k} 0 1000\r\n"));
            assert_eq!(c.exact(1002), [&val[..], b"\r\n"].concat());
        }
        assert_eq!(c.line(), "END\r\n");
        assert_eq!(c.line(), "MN\r\n");
    }
    srv.shutdown();
}

#[test]
fn errors_in_long_lines() {
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    let keys: Vec<String> = (0..10_000).map(|i| format!("e:{i}")).collect();
    preload(&mut c, &keys);
    // A bad key deep in a long line: the pieces before it were answered,
    // the error stands for END, the rest of the line is dropped and the
    // connection goes on.
    let mut line = format!("get {} {} ", keys.join(" "), "k".repeat(300));
    line.push_str(&keys.join(" "));
    line.push_str("\r\nmn\r\n");
    c.send(line.as_bytes());
    let mut values = 0;
    loop {
        let l = c.line();
        if l.starts_with("VALUE ") {
            values += 1;
            c.line();
            continue;
        }
        assert_eq!(l, "CLIENT_ERROR bad command line format\r\n");
        break;
    }
    assert!(values <= keys.len());
    assert_eq!(c.line(), "MN\r\n");
    assert_eq!(c.get("e:1").as_deref(), Some(&b"1:e"[..]));
    // Other commands keep the line limit: the clear error, then close.
    let mut s = TcpStream::connect(srv.main_addr).unwrap();
    let long = format!("delete {}", "x ".repeat(33_000));
    let _ = s.write_all(long.as_bytes());
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(got.starts_with(b"CLIENT_ERROR line too long\r\n"), "{:?}", String::from_utf8_lossy(&got));
    srv.shutdown();
}

/// The memcached to compare with, if `MBAL_MEMCACHED_ADDR` names one (a
/// missing one fails when `MBAL_REQUIRE_MEMCACHED` is set, as in CI).
fn memcached_addr() -> Option<std::net::SocketAddr> {
    let a = std::env::var("MBAL_MEMCACHED_ADDR").ok().filter(|s| !s.is_empty());
    if a.is_none() && std::env::var_os("MBAL_REQUIRE_MEMCACHED").is_some() {
        panic!("MBAL_REQUIRE_MEMCACHED is set but MBAL_MEMCACHED_ADDR is not");
    }
    a.map(|a| a.parse().expect("MBAL_MEMCACHED_ADDR is HOST:PORT"))
}

/// Replace the CAS of every `VALUE <key> <flags> <bytes> <cas>` line by 0.
fn without_cas(reply: &[u8]) -> String {
    let s = String::from_utf8_lossy(reply);
    s.split("\r\n")
        .map(|l| {
            let t: Vec<&str> = l.split(' ').collect();
            if t.len() == 5 && t[0] == "VALUE" {
                format!("VALUE {} {} {} 0", t[1], t[2], t[3])
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\r\n")
}

#[test]
fn long_lines_answer_like_memcached() {
    let Some(mc) = memcached_addr() else {
        eprintln!("MBAL_MEMCACHED_ADDR not set: skipping the comparison with memcached");
        return;
    };
    let srv = start(settings(4));
    // A prefix of our own: the memcached may be shared with other tests.
    let prefix = format!("ll{}:{}", std::process::id(), srv.main_addr.port());
    let keys: Vec<String> = (0..20_000).map(|i| format!("{prefix}:{i}")).collect();
    let stored: Vec<String> = keys.iter().step_by(2).cloned().collect();
    let script = [
        format!("get {}\r\n", keys.join(" ")),
        format!("gets {} {}\r\n", keys[..9000].join(" "), keys.join(" ")),
        "get tail\r\n".to_string(),
    ]
    .concat();
    // A throwaway memcached (as scripts/test.sh starts): flushed first, so
    // that nothing of ours is evicted to make room.
    let mut m = Conn::open(mc);
    assert_eq!(m.cmd("flush_all\r\n"), "OK\r\n");
    let mut replies = Vec::new();
    for addr in [mc, srv.main_addr] {
        let mut c = Conn::open(addr);
        preload(&mut c, &stored);
        let mut w = c.w.try_clone().unwrap();
        let s = script.clone();
        let writer = std::thread::spawn(move || w.write_all(s.as_bytes()).expect("write"));
        let mut got = Vec::new();
        for _ in 0..3 {
            for l in c.until_end() {
                got.extend_from_slice(l.as_bytes());
            }
            got.extend_from_slice(b"END\r\n");
        }
        writer.join().unwrap();
        replies.push(without_cas(&got));
    }
    let values = replies[0].matches("VALUE ").count();
    assert_eq!(values, 2 * stored.len() + 4500, "memcached lost keys (evicted?): the comparison would be void");
    assert!(replies[0] == replies[1], "mbal's replies differ from memcached's");
    srv.shutdown();
}
