//! Differential test: the error replies our parser produces must be the
//! bytes a real memcached sends. Runs only when `MBAL_MEMCACHED_ADDR` points
//! at a memcached (e.g. `memcached -p 11987 -U 0 -l 127.0.0.1 &` and
//! `MBAL_MEMCACHED_ADDR=127.0.0.1:11987 cargo test -p mbal-proto --test vs_memcached`);
//! otherwise it is skipped, unless `MBAL_REQUIRE_MEMCACHED` is set (as
//! `scripts/test.sh` and CI do), in which case a missing memcached fails it.

use mbal_proto::binary::write_request;
use mbal_proto::meta::MetaKind;
use mbal_proto::{parse, Limits, Parsed, Protocol, Request};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn addr() -> Option<String> {
    let a = std::env::var("MBAL_MEMCACHED_ADDR").ok().filter(|s| !s.is_empty());
    if a.is_none() && std::env::var_os("MBAL_REQUIRE_MEMCACHED").is_some() {
        panic!("MBAL_REQUIRE_MEMCACHED is set but MBAL_MEMCACHED_ADDR is not");
    }
    a
}

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect to memcached");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// What our parser makes of `buf` when every request in it is an error,
/// except a final `mn` (answered MN).
fn ours(proto: Protocol, buf: &[u8]) -> (Vec<u8>, bool) {
    let limits = Limits::default();
    let mut out = Vec::new();
    let mut off = 0;
    while off < buf.len() {
        match parse(proto, &buf[off..], &limits) {
            Parsed::Err { reply, skip, close } => {
                reply.write(&mut out);
                if close {
                    return (out, true);
                }
                off += skip;
            }
            Parsed::Req { req: Request::Meta(m), consumed } if m.kind == MetaKind::Noop => {
                out.extend_from_slice(b"MN\r\n");
                off += consumed;
            }
            other => panic!("case {:?} is not all errors: {other:?}", String::from_utf8_lossy(buf)),
        }
    }
    (out, false)
}

fn read_until(s: &mut TcpStream, end: &[u8]) -> Vec<u8> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while !got.ends_with(end) {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
            Err(e) => {
                // Reported as a difference by the caller.
                got.extend_from_slice(format!("<read error: {e}>").as_bytes());
                break;
            }
        }
    }
    got
}

#[test]
fn text_and_meta_errors_match_memcached() {
    let Some(addr) = addr() else { return };
    let k251 = "k".repeat(251);
    let flags26: String = (b'A'..=b'Z').map(|c| format!(" {}", c as char)).collect();
    let cases: Vec<String> = vec![
        "get\r\n".into(),
        "\r\n".into(),
        "bogus\r\n".into(),
        "GET a\r\n".into(),
        "set a 0 0\r\n".into(),
        "set a b 0 1\r\nx\r\n".into(),
        "set a 0 0 -1\r\n".into(),
        "set a 0 0 2\r\nxyzw\r\n".into(),
        "set a 0 0 2 noreply\r\nxyzw\r\n".into(),
        "set a 0 0 1\nx\n\n".into(),
        "cas a 0 0 1\r\nx\r\n".into(),
        "cas a 0 0 1 x\r\nx\r\n".into(),
        "delete a 1\r\n".into(),
        "delete a 1 noreply\r\n".into(),
        "delete\r\n".into(),
        "incr a x\r\n".into(),
        "incr a -1\r\n".into(),
        "decr a\r\n".into(),
        "incr a x noreply\r\n".into(),
        "touch a x\r\n".into(),
        "touch a\r\n".into(),
        "gat x a\r\n".into(),
        "gat\r\n".into(),
        "flush_all x\r\n".into(),
        "verbosity\r\n".into(),
        "verbosity x\r\n".into(),
        format!("get a {k251}\r\n"),
        format!("set {k251} 0 0 1\r\nx\r\n"),
        format!("set {k251} 0 0 1 noreply\r\nx\r\n"),
        "mg\r\n".into(),
        "me\r\n".into(),
        "mz a\r\n".into(),
        "mg a v v\r\n".into(),
        "mg a !\r\n".into(),
        "ma a q q\r\n".into(),
        "md a 1\r\n".into(),
        "ma a !\r\n".into(),
        "md a q q\r\n".into(),
        "flush_all 1 2 3\r\n".into(),
        "delete a 0 noreply x\r\n".into(),
        "ms a\r\n".into(),
        "ms a x\r\n".into(),
        "ms a 2 T1\r\nxyz\r\n".into(),
        "ms a 1 !\r\nx\r\n".into(),
        "ms a 1 T1 T2\r\nx\r\n".into(),
        format!("mg a O{}\r\n", "x".repeat(33)),
        format!("mg a{flags26}\r\n"),
        format!("ms a 1{flags26}\r\nx\r\n"),
        format!("mg {k251} v\r\n"),
        format!("ms {k251} 1\r\nx\r\n"),
    ];
    let mut bad = Vec::new();
    for case in &cases {
        let buf = format!("{case}mn\r\n");
        let (want, _) = ours(Protocol::Text, buf.as_bytes());
        let mut s = connect(&addr);
        s.write_all(buf.as_bytes()).unwrap();
        let got = read_until(&mut s, b"MN\r\n");
        if got != want {
            bad.push(format!(
                "{case:?}: memcached {:?} ours {:?}",
                String::from_utf8_lossy(&got),
                String::from_utf8_lossy(&want)
            ));
        }
    }
    assert!(bad.is_empty(), "differences:\n{}", bad.join("\n"));
}

#[test]
fn binary_protocol_errors_match_memcached() {
    let Some(addr) = addr() else { return };
    let mut cases: Vec<Vec<u8>> = Vec::new();
    let mut r = |op: u8, ex: &[u8], k: &[u8], v: &[u8]| {
        let mut b = Vec::new();
        write_request(&mut b, op, 0, 0xdeadbeef, 0, ex, k, v);
        cases.push(b);
    };
    r(0x00, &[], b"", b""); // get without key
    r(0x01, &[0; 4], b"k", b"v"); // set with short extras
    r(0x04, &[], &[b'a'; 300], b""); // key too long
    r(0x05, &[0; 8], b"k", b""); // incr with wrong extras
    r(0x0a, &[], b"k", b""); // noop with key
    let mut bad = Vec::new();
    for case in &cases {
        let (want, close) = ours(Protocol::Binary, case);
        assert!(close);
        let mut s = connect(&addr);
        s.write_all(case).unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        if got != want {
            bad.push(format!("{:x?}: memcached {got:x?} ours {want:x?}", &case[..24]));
        }
    }
    assert!(bad.is_empty(), "differences:\n{}", bad.join("\n"));
}
