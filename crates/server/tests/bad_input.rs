//! Malformed, oversized and truncated requests: memcached's error replies or
//! a clean close, never a crash, never damage to other keys.

mod common;
use common::*;
use std::io::Write;
use std::net::TcpStream;

fn assert_alive_and_intact(addr: std::net::SocketAddr) {
    let mut c = Conn::open(addr);
    assert_eq!(c.get("sentinel").as_deref(), Some(&b"intact"[..]), "other keys must be untouched");
}

/// Send `req` then `version`, and return everything up to the VERSION line.
fn exchange(c: &mut Conn, req: &[u8]) -> String {
    c.send(req);
    c.send(b"version\r\n");
    let mut got = String::new();
    loop {
        let l = c.line();
        assert!(!l.is_empty(), "connection closed; got {got:?}");
        if l.starts_with("VERSION ") {
            return got;
        }
        got.push_str(&l);
    }
}

#[test]
fn errors_like_memcached() {
    // Expected bytes are what memcached 1.6.18 answers to the same input.
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    assert_eq!(c.set("sentinel", b"intact"), "STORED\r\n");
    let long_key = "k".repeat(251);
    let bad = "CLIENT_ERROR bad command line format\r\n";
    let cases: Vec<(Vec<u8>, String)> = vec![
        (b"bogus\r\n".to_vec(), "ERROR\r\n".into()),
        (b"\r\n".to_vec(), "ERROR\r\n".into()),
        (format!("get {long_key}\r\n").into_bytes(), bad.into()),
        // The data line of a refused set is then read as a command.
        (format!("set {long_key} 0 0 1\r\nx\r\n").into_bytes(), format!("{bad}ERROR\r\n")),
        (b"set k 0 0 notanumber\r\n".to_vec(), bad.into()),
        (b"set k 0 0 -1\r\n".to_vec(), bad.into()),
        (b"incr k abc\r\n".to_vec(), "CLIENT_ERROR invalid numeric delta argument\r\n".into()),
        (b"set k 0 0 2\r\nabcd\r\n".to_vec(), "CLIENT_ERROR bad data chunk\r\nERROR\r\n".into()),
    ];
    for (req, want) in cases {
        assert_eq!(exchange(&mut c, &req), want, "request {:?}", String::from_utf8_lossy(&req));
    }
    assert_alive_and_intact(srv.main_addr);
    srv.shutdown();
}

#[test]
fn too_large_value_is_refused_and_swallowed() {
    let srv = start(settings(1));
    let mut c = Conn::open(srv.main_addr);
    c.set("sentinel", b"intact");
    let n = 2 << 20; // -I is 1 MiB
    let mut req = format!("set big 0 0 {n}\r\n").into_bytes();
    req.extend(std::iter::repeat_n(b'x', n));
    req.extend_from_slice(b"\r\n");
    c.send(&req);
    assert_eq!(c.line(), "SERVER_ERROR object too large for cache\r\n");
    // The 2 MiB body was swallowed, not parsed as commands.
    assert!(c.cmd("version\r\n").starts_with("VERSION"));
    assert_eq!(c.get("big"), None);
    assert_alive_and_intact(srv.main_addr);
    srv.shutdown();
}

#[test]
fn absurd_declared_length_does_not_allocate() {
    let srv = start(settings(1));
    let mut c = Conn::open(srv.main_addr);
    c.set("sentinel", b"intact");
    // 4 GB declared; we send a little and hang up. Memory must not follow the claim.
    c.send(b"set huge 0 0 4294967295\r\nabc");
    let l = c.line();
    assert!(l.starts_with("SERVER_ERROR") || l.starts_with("CLIENT_ERROR"), "{l}");
    drop(c);
    assert_alive_and_intact(srv.main_addr);
    srv.shutdown();
}

#[test]
fn line_without_newline_is_bounded() {
    let srv = start(settings(1));
    let mut c = Conn::open(srv.main_addr);
    c.set("sentinel", b"intact");
    let junk = vec![b'a'; 1 << 20];
    // The server may close while we write; ignore write errors.
    let _ = c.w.write_all(&junk);
    let l = c.line();
    assert!(l.is_empty() || l.starts_with("CLIENT_ERROR") || l.starts_with("ERROR"), "{l}");
    assert_alive_and_intact(srv.main_addr);
    srv.shutdown();
}

#[test]
fn random_bytes_never_crash() {
    let srv = start(settings(2));
    {
        let mut c = Conn::open(srv.main_addr);
        c.set("sentinel", b"intact");
    }
    // A deterministic pseudo-random stream (xorshift), many connections.
    let mut x: u64 = 0x9E3779B97F4A7C15;
    for round in 0..50 {
        let mut s = TcpStream::connect(srv.main_addr).unwrap();
        let mut buf = vec![0u8; 4096];
        for b in buf.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        if round % 2 == 0 {
            buf[0] = b'g'; // text path
        }
        let _ = s.write_all(&buf);
        drop(s);
    }
    assert_alive_and_intact(srv.main_addr);
    srv.shutdown();
}

#[test]
fn binary_header_with_huge_body_closes() {
    let srv = start(settings(1));
    {
        let mut c = Conn::open(srv.main_addr);
        c.set("sentinel", b"intact");
    }
    let mut c = Conn::open(srv.main_addr);
    let mut h = [0u8; 24];
    h[0] = 0x80;
    h[1] = 0x01; // SET
    h[2..4].copy_from_slice(&3u16.to_be_bytes());
    h[4] = 8;
    h[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
    c.send(&h);
    // An error response (E2BIG) may come first; then the server closes.
    let mut got = Vec::new();
    let _ = std::io::Read::read_to_end(&mut c.r, &mut got);
    if !got.is_empty() {
        assert_eq!(got[0], 0x81, "a binary response");
    }
    assert_alive_and_intact(srv.main_addr);
    srv.shutdown();
}

#[test]
fn more_connections_than_c_are_refused() {
    let srv = start(mbal_server::config::Settings { max_conns: 4, ..settings(1) });
    let mut held: Vec<Conn> = (0..4).map(|_| Conn::open(srv.main_addr)).collect();
    for c in held.iter_mut() {
        assert!(c.cmd("version\r\n").starts_with("VERSION"));
    }
    let mut extra = Conn::open(srv.main_addr);
    assert_eq!(extra.line(), "ERROR Too many open connections\r\n");
    assert!(extra.closed());
    drop(held.pop());
    // A slot frees up once the server sees the close; retry until it does
    // (bounded: the server handles the close on its next loop turn).
    let mut ok = false;
    for _ in 0..200 {
        let mut c = Conn::open(srv.main_addr);
        c.send(b"version\r\n");
        if c.line().starts_with("VERSION") {
            ok = true;
            break;
        }
    }
    assert!(ok, "a freed slot is reusable");
    srv.shutdown();
}

/// `-o no_maxconns_fast`: a connection over `-c` is not refused; it waits in the listen
/// backlog, unserved, until another closes, as in memcached.
#[test]
fn without_maxconns_fast_connections_over_c_wait() {
    let srv = start(mbal_server::config::Settings { max_conns: 2, maxconns_fast: false, ..settings(1) });
    let mut held: Vec<Conn> = (0..2).map(|_| Conn::open(srv.main_addr)).collect();
    for c in held.iter_mut() {
        assert!(c.cmd("version\r\n").starts_with("VERSION"));
    }
    let mut waiting = Conn::open(srv.main_addr);
    waiting.send(b"version\r\n");
    // Nothing comes while the limit holds: no error line, no close.
    waiting.w.set_read_timeout(Some(std::time::Duration::from_millis(300))).unwrap();
    let mut b = [0u8; 64];
    match std::io::Read::read(&mut waiting.r, &mut b) {
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
        other => panic!("served or refused over -c: {other:?}"),
    }
    waiting.w.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    drop(held.pop());
    assert!(waiting.line().starts_with("VERSION"), "served once a slot frees");
    srv.shutdown();
}

#[test]
fn many_half_sent_requests_held_open() {
    let srv = start(settings(2));
    {
        let mut c = Conn::open(srv.main_addr);
        c.set("sentinel", b"intact");
    }
    let mut held = Vec::new();
    for i in 0..200 {
        let mut s = TcpStream::connect(srv.main_addr).unwrap();
        let part: &[u8] = match i % 3 {
            0 => b"set half 0 0 100\r\nonly-some",
            1 => b"get half",
            _ => b"\x80\x00\x00\x05",
        };
        s.write_all(part).unwrap();
        held.push(s);
    }
    // Everyone else is still served while the half-requests hang.
    assert_alive_and_intact(srv.main_addr);
    drop(held);
    assert_alive_and_intact(srv.main_addr);
    srv.shutdown();
}

#[test]
fn client_that_never_reads_does_not_grow_memory_without_bound() {
    let srv = start(settings(1));
    let mut c = Conn::open(srv.main_addr);
    c.set("v", &vec![b'x'; 100_000]);
    // Ask for 100k * 100 KB = 10 GB of replies without reading any. The
    // server must stop reading once its output buffer is full; we stop
    // writing when the socket pushes back.
    c.w.set_write_timeout(Some(std::time::Duration::from_millis(500))).unwrap();
    let req = b"get v\r\n".repeat(1000);
    for _ in 0..100 {
        if c.w.write_all(&req).is_err() {
            break;
        }
    }
    drop(c);
    let mut d = Conn::open(srv.main_addr);
    assert!(d.cmd("version\r\n").starts_with("VERSION"));
    srv.shutdown();
}

#[test]
fn too_large_set_drops_the_old_value_like_memcached() {
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    for i in 0..20 {
        let key = format!("old{i}");
        assert_eq!(c.set(&key, b"v1"), "STORED\r\n");
        let n = (1 << 20) + 10;
        let mut req = format!("set {key} 0 0 {n}\r\n").into_bytes();
        req.extend(std::iter::repeat_n(b'y', n));
        req.extend_from_slice(b"\r\n");
        c.send(&req);
        assert_eq!(c.line(), "SERVER_ERROR object too large for cache\r\n");
        assert_eq!(c.get(&key), None, "{key}: the old value is gone, as in memcached");
    }
    srv.shutdown();
}

/// Read to EOF; the bytes the server wrote before hanging up.
fn rest_until_eof(c: &mut Conn) -> Vec<u8> {
    let mut got = Vec::new();
    std::io::Read::read_to_end(&mut c.r, &mut got).expect("server closes, read does not time out");
    got
}

#[test]
fn http_request_lines_are_hung_up_on_every_port() {
    // memcached 1.6 closes the connection, writing nothing, when an unknown command's line
    // ends in an HTTP version: a browser tricked into posting to a cache gets nothing back
    // and runs nothing after its request line.
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    assert_eq!(c.set("sentinel", b"intact"), "STORED\r\n");
    let lines: [&[u8]; 4] = [
        b"GET / HTTP/1.0\r\n",
        b"PUT /asdf HTTP/1.1\r\n",
        b"DELETE HTTP/1.1\r\n",
        b"POST /x HTTP/1.1\r\nHost: a\r\n\r\nset sentinel 0 0 4\r\nevil\r\n",
    ];
    let mut ports: Vec<(&str, std::net::SocketAddr, bool)> = vec![("main", srv.main_addr, false)];
    for (i, w) in srv.worker_addrs.iter().enumerate() {
        ports.push(if i == 0 { ("worker", *w, false) } else { ("routed", *w, true) });
    }
    for (name, addr, routed) in ports {
        for line in lines {
            let mut c = Conn::open(addr);
            if routed {
                assert!(c.cmd("mbal hello 0\r\n").starts_with("MBAL "), "{name}");
            }
            c.send(line);
            assert_eq!(rest_until_eof(&mut c), b"", "{name}: {:?}", String::from_utf8_lossy(line));
        }
        // Not HTTP: the usual ERROR, and the connection stays open.
        let mut c = Conn::open(addr);
        assert_eq!(exchange(&mut c, b"X HTTP\r\nGET /\r\ntouch HTTP/1.1\r\n"), "ERROR\r\nERROR\r\nERROR\r\n", "{name}");
    }
    assert_alive_and_intact(srv.main_addr);
    srv.shutdown();
}
