//! `mbal server --forward`: a plain client pointed at one server of a
//! cluster reads and writes every server's keys through it (issue 11).
//! Real servers on loopback, real sockets.

mod common;
use common::*;
use mbal_cluster::{key_hash, ClusterMap};
use mbal_member::{ClusterSpec, ServerSpec};
use mbal_proto::binary::{opcode as op, write_request, BinHeader, HEADER_LEN};
use mbal_server::ServerHandle;
use std::io::Read;

/// A key whose cachelet is owned by `worker` on server `server` in `map`.
fn key_on(map: &ClusterMap, server: u16, worker: u16, salt: &str) -> String {
    (0..100_000)
        .map(|i| format!("{salt}{i}"))
        .find(|k| {
            let (_, s, w) = map.route(key_hash(k.as_bytes()));
            (s, w) == (server, worker)
        })
        .expect("some key lands on every worker")
}

fn owner(map: &ClusterMap, key: &str) -> u16 {
    map.route(key_hash(key.as_bytes())).1
}

/// `n` servers of 2 workers on ephemeral ports, server 0 with `--forward`
/// (and `timeout_ms`).
fn cluster(n: usize, timeout_ms: u64) -> (Vec<ServerHandle>, ClusterMap) {
    let (servers, map, _) = cluster_with_silent(n, 0, timeout_ms);
    (servers, map)
}

/// The same, where the last `silent` servers of the map are listening
/// sockets that accept connections and never answer.
fn cluster_with_silent(
    n: usize,
    silent: usize,
    timeout_ms: u64,
) -> (Vec<ServerHandle>, ClusterMap, Vec<std::net::TcpListener>) {
    let listeners: Vec<_> = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let spec = ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 1024,
        cachelets_per_worker: 4,
        workers: 2,
        servers: listeners
            .iter()
            .map(|l| ServerSpec { addr: l.local_addr().unwrap(), worker_port_base: None })
            .collect(),
        secret: None,
        secret_file: None,
        tls: None,
    };
    let silent: Vec<_> = listeners.into_iter().skip(n - silent).collect();
    let servers = (0..n - silent.len())
        .map(|id| {
            let mut s = settings(2);
            s.apply_cluster(spec.clone(), id as u16).unwrap();
            s.forward = id == 0;
            s.forward_timeout_ms = timeout_ms;
            start(s)
        })
        .collect();
    (servers, spec.initial_map(), silent)
}

/// The lines of a reply up to END, without their line ends.
fn lines(c: &mut Conn) -> Vec<String> {
    c.until_end().into_iter().map(|l| l.trim_end_matches("\r\n").to_string()).collect()
}

fn value(v: &str) -> String {
    format!("<{v}>")
}

#[test]
fn a_plain_client_reads_and_writes_every_servers_keys() {
    let (servers, map) = cluster(3, 2000);
    let mut c = Conn::open(servers[0].main_addr);
    let mut direct: Vec<Conn> = servers.iter().map(|s| Conn::open(s.main_addr)).collect();
    for s in 0..3u16 {
        for w in 0..2u16 {
            let k = key_on(&map, s, w, &format!("k{s}{w}-"));
            // write through server 0, read at the owner, and back
            assert_eq!(c.set(&k, value(&k).as_bytes()), "STORED\r\n", "{k}");
            assert_eq!(direct[s as usize].get(&k), Some(value(&k).into_bytes()), "{k} at its owner");
            assert_eq!(direct[s as usize].set(&k, b"owner"), "STORED\r\n");
            assert_eq!(c.get(&k).as_deref(), Some(&b"owner"[..]), "{k} through server 0");
            // the rest of the keyed text commands
            assert_eq!(c.cmd(&format!("add {k} 0 0 1\r\nx\r\n")), "NOT_STORED\r\n");
            assert_eq!(c.cmd(&format!("append {k} 0 0 1\r\n!\r\n")), "STORED\r\n");
            assert_eq!(c.cmd(&format!("touch {k} 100\r\n")), "TOUCHED\r\n");
            c.send(format!("gets {k}\r\n").as_bytes());
            let head = c.line();
            let cas: u64 = head.split_whitespace().nth(4).unwrap().parse().unwrap();
            assert_eq!(head, format!("VALUE {k} 0 6 {cas}\r\n"));
            assert_eq!(lines(&mut c), ["owner!"]);
            assert_eq!(c.cmd(&format!("cas {k} 5 0 1 {}\r\ny\r\n", cas + 1)), "EXISTS\r\n");
            assert_eq!(c.cmd(&format!("cas {k} 5 0 1 {cas}\r\ny\r\n")), "STORED\r\n");
            c.send(format!("gat 0 {k}\r\n").as_bytes());
            assert_eq!(lines(&mut c), [format!("VALUE {k} 5 1"), "y".into()]);
            assert_eq!(c.cmd(&format!("set {k} 0 0 2\r\n10\r\n")), "STORED\r\n");
            assert_eq!(c.cmd(&format!("incr {k} 5\r\n")), "15\r\n");
            assert_eq!(c.cmd(&format!("decr {k} 20\r\n")), "0\r\n");
            assert_eq!(c.cmd(&format!("delete {k}\r\n")), "DELETED\r\n");
            assert_eq!(c.cmd(&format!("delete {k}\r\n")), "NOT_FOUND\r\n");
            assert_eq!(direct[s as usize].get(&k), None, "deleted at its owner");
            // noreply: nothing comes back, the write happens
            c.send(format!("set {k} 0 0 2 noreply\r\nnr\r\nincr {k} 1 noreply\r\n").as_bytes());
            assert_eq!(c.get(&k).as_deref(), Some(&b"nr"[..]));
            assert_eq!(
                c.cmd(&format!("incr {k} 1\r\n")),
                "CLIENT_ERROR cannot increment or decrement non-numeric value\r\n"
            );
            // meta commands, quiet ones included
            assert_eq!(c.cmd(&format!("ms {k} 2 T0 F3\r\nmm\r\n")), "HD\r\n");
            c.send(format!("mg {k} v f k\r\n").as_bytes());
            assert_eq!(c.line(), format!("VA 2 f3 k{k}\r\n"));
            assert_eq!(c.line(), "mm\r\n");
            c.send(format!("mg {k} v q\r\nmg missing-{k} v q\r\nmn\r\n").as_bytes());
            assert_eq!(c.line(), "VA 2\r\n");
            assert_eq!(c.line(), "mm\r\n");
            assert_eq!(c.line(), "MN\r\n", "a quiet miss says nothing");
            assert_eq!(c.cmd(&format!("md {k} q\r\nmg {k} v\r\n")), "EN\r\n");
            assert_eq!(c.cmd(&format!("ma {k} N0 J7 v\r\n")), "VA 1\r\n");
            assert_eq!(c.line(), "7\r\n");
        }
    }
    let fwd = stat(&mut c, "forwarded_to_servers");
    assert!(fwd >= 4 * 20, "{fwd} requests forwarded");
    assert_eq!(stat(&mut c, "forward_errors"), 0);
    // Without --forward, today's answers: a miss or SERVER_ERROR.
    let k = key_on(&map, 0, 1, "nf");
    assert_eq!(direct[1].set(&k, b"v"), "SERVER_ERROR key is served by another mbal server\r\n");
    assert_eq!(direct[1].get(&k), None);
    for s in servers {
        s.shutdown();
    }
}

/// A binary response: (opcode, status, opaque, key, value).
type BinResp = (u8, u16, u32, Vec<u8>, Vec<u8>);

/// Read one binary response.
fn bin_response(c: &mut Conn) -> BinResp {
    let head = c.exact(HEADER_LEN);
    let h = BinHeader::decode(&head);
    let mut body = vec![0; h.body_len as usize];
    c.r.read_exact(&mut body).unwrap();
    let status = u16::from_be_bytes([head[6], head[7]]);
    let (e, k) = (h.extras_len as usize, h.key_len as usize);
    (h.opcode, status, h.opaque, body[e..e + k].to_vec(), body[e + k..].to_vec())
}

#[test]
fn binary_requests_are_forwarded_quiet_ones_too() {
    let (servers, map) = cluster(2, 2000);
    let mut c = Conn::open(servers[0].main_addr);
    let mut direct = Conn::open(servers[1].main_addr);
    let keys: Vec<String> = (0..2).map(|w| key_on(&map, 1, w, "bin")).collect();
    let local = key_on(&map, 0, 0, "bin");
    let extras = [0u8, 0, 0, 7, 0, 0, 0, 0];
    let mut req = Vec::new();
    write_request(&mut req, op::SET, 0, 1, 0, &extras, keys[0].as_bytes(), b"one");
    write_request(&mut req, op::SETQ, 0, 2, 0, &extras, keys[1].as_bytes(), b"two");
    write_request(&mut req, op::SETQ, 0, 3, 0, &extras, local.as_bytes(), b"here");
    write_request(&mut req, op::GETKQ, 0, 4, 0, &[], b"nobody-has-this", &[]);
    write_request(&mut req, op::GETKQ, 0, 5, 0, &[], keys[1].as_bytes(), &[]);
    write_request(&mut req, op::GETK, 0, 6, 0, &[], local.as_bytes(), &[]);
    write_request(&mut req, op::GET, 0, 7, 0, &[], keys[0].as_bytes(), &[]);
    write_request(&mut req, op::DELETE, 0, 8, 0, &[], keys[0].as_bytes(), &[]);
    write_request(&mut req, op::GET, 0, 9, 0, &[], keys[0].as_bytes(), &[]);
    write_request(&mut req, op::NOOP, 0, 10, 0, &[], &[], &[]);
    c.send(&req);
    let got: Vec<BinResp> = (0..7).map(|_| bin_response(&mut c)).collect();
    let r = |o: u8, s: u16, q: u32, k: &[u8], v: &[u8]| (o, s, q, k.to_vec(), v.to_vec());
    let want = vec![
        r(op::SET, 0, 1, b"", b""),
        r(op::GETKQ, 0, 5, keys[1].as_bytes(), b"two"),
        r(op::GETK, 0, 6, local.as_bytes(), b"here"),
        r(op::GET, 0, 7, b"", b"one"),
        r(op::DELETE, 0, 8, b"", b""),
        r(op::GET, 1, 9, b"", b"Not found"),
        r(op::NOOP, 0, 10, b"", b""),
    ];
    assert_eq!(got, want);
    assert_eq!(direct.get(&keys[1]).as_deref(), Some(&b"two"[..]), "the quiet set reached its owner");
    for s in servers {
        s.shutdown();
    }
}

#[test]
fn a_multi_get_spanning_every_server_comes_back_complete_and_in_order() {
    let (servers, map) = cluster(3, 2000);
    let mut c = Conn::open(servers[0].main_addr);
    // 120 keys over every server and worker, one in three never set.
    let keys: Vec<String> = (0..120).map(|i| format!("span{i}")).collect();
    assert!((0..3).all(|s| keys.iter().any(|k| owner(&map, k) == s)), "every server is asked");
    let mut want = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        if i % 3 != 2 {
            assert_eq!(c.set(k, value(k).as_bytes()), "STORED\r\n");
            want.push(format!("VALUE {k} 0 {}", value(k).len()));
            want.push(value(k));
        }
    }
    for cmd in ["get", "gat 0"] {
        c.send(format!("{cmd} {}\r\n", keys.join(" ")).as_bytes());
        assert_eq!(lines(&mut c), want, "{cmd}");
    }
    // gets: the same, each with its cas
    c.send(format!("gets {}\r\n", keys.join(" ")).as_bytes());
    let got = lines(&mut c);
    let heads: Vec<String> = got.iter().step_by(2).map(|l| l.rsplit_once(' ').unwrap().0.to_string()).collect();
    assert_eq!(heads, want.iter().step_by(2).cloned().collect::<Vec<_>>());
    // A long line, read in pieces by the server, all of it on other servers.
    let far: Vec<String> = (0..4000).map(|i| format!("far-away-key-{i:05}")).filter(|k| owner(&map, k) != 0).collect();
    c.set(&far[far.len() - 1], b"last");
    c.send(format!("get {}\r\n", far.join(" ")).as_bytes());
    assert_eq!(lines(&mut c), [format!("VALUE {} 0 4", far[far.len() - 1]), "last".into()]);
    for s in servers {
        s.shutdown();
    }
}

#[test]
fn pipelined_mixed_requests_keep_their_order() {
    let (servers, map) = cluster(3, 2000);
    let mut c = Conn::open(servers[0].main_addr);
    let keys: Vec<String> = (0..60).map(|i| format!("pipe{i}")).collect();
    assert!((0..3).all(|s| keys.iter().any(|k| owner(&map, k) == s)));
    // Every key deleted first (noreply: nothing back), then one request
    // pattern per key, pipelined in one write, three times over.
    let (mut req, mut want) = (String::new(), String::new());
    for k in &keys {
        req += &format!("delete {k} noreply\r\n");
    }
    let mut held = std::collections::HashMap::new();
    for (i, k) in keys.iter().enumerate() {
        let v = format!("v{i}");
        match i % 5 {
            0 => {
                req += &format!("set {k} 0 0 {}\r\n{v}\r\nget {k}\r\n", v.len());
                want += &format!("STORED\r\nVALUE {k} 0 {}\r\n{v}\r\nEND\r\n", v.len());
                held.insert(k.clone(), v);
            }
            1 => {
                req += &format!("set {k} 0 0 1\r\n{}\r\nincr {k} 3\r\n", i % 7);
                want += &format!("STORED\r\n{}\r\n", i % 7 + 3);
                held.insert(k.clone(), (i % 7 + 3).to_string());
            }
            2 => {
                req += &format!("ms {k} {} T0\r\n{v}\r\nmg {k} v\r\n", v.len());
                want += &format!("HD\r\nVA {}\r\n{v}\r\n", v.len());
                held.insert(k.clone(), v);
            }
            3 => {
                // the three keys before this one, in reverse order, and this one (deleted)
                let ks: Vec<&String> = (1..4).map(|d| &keys[i - d]).collect();
                req += &format!("delete {k}\r\nget {} {} {} {k}\r\n", ks[0], ks[1], ks[2]);
                want += "NOT_FOUND\r\n";
                for k2 in ks {
                    let v2 = &held[k2];
                    want += &format!("VALUE {k2} 0 {}\r\n{v2}\r\n", v2.len());
                }
                want += "END\r\n";
            }
            _ => {
                req += &format!("set {k} 0 0 1 noreply\r\nx\r\nappend {k} 0 0 1\r\ny\r\nmg {k} v q\r\nmn\r\n");
                want += "STORED\r\nVA 2\r\nxy\r\nMN\r\n";
                held.insert(k.clone(), "xy".into());
            }
        }
    }
    req += "version\r\n";
    want += &format!("VERSION {}\r\n", mbal_server::VERSION);
    for _ in 0..3 {
        c.send(req.as_bytes());
        let got = c.exact(want.len());
        assert_eq!(String::from_utf8_lossy(&got), want);
    }
    for s in servers {
        s.shutdown();
    }
}

#[test]
fn an_unreachable_owner_gets_server_error_and_local_keys_go_on() {
    // Server 1 is a socket that accepts and never answers; server 2 is
    // killed half way.
    let (mut servers, map, silent) = cluster_with_silent(3, 1, 300);
    let mut c = Conn::open(servers[0].main_addr);
    let mine = key_on(&map, 0, 1, "mine");
    let dead = key_on(&map, 1, 0, "dead");
    let mute = key_on(&map, 2, 1, "mute");
    for k in [&mine, &dead] {
        assert_eq!(c.set(k, b"v"), "STORED\r\n");
    }
    // A silent owner: the request times out (the next one waits behind it).
    c.send(format!("get {mute}\r\nget {mine}\r\n").as_bytes());
    assert_eq!(c.line(), "SERVER_ERROR forwarding failed: owner timed out\r\n");
    assert_eq!(lines(&mut c), ["VALUE ".to_string() + &mine + " 0 1", "v".into()]);
    assert!(stat(&mut c, "forward_timeouts") >= 1);
    drop(silent);
    // A dead owner: refused at once, and during the backoff.
    let srv1 = servers.pop().unwrap();
    srv1.shutdown();
    for _ in 0..3 {
        let l = c.cmd(&format!("set {dead} 0 0 1\r\nw\r\n"));
        assert!(l.starts_with("SERVER_ERROR forwarding failed: "), "{l}");
        assert_eq!(c.cmd(&format!("get {dead}\r\n")).split(':').next(), Some("SERVER_ERROR forwarding failed"));
        c.send(format!("set {dead} 0 0 1 noreply\r\nw\r\n").as_bytes()); // nothing comes back
        assert_eq!(c.get(&mine).as_deref(), Some(&b"v"[..]), "its own keys are served");
    }
    // A multi-get spanning the dead server: its keys are misses.
    c.send(format!("get {dead} {mine}\r\n").as_bytes());
    assert_eq!(lines(&mut c), ["VALUE ".to_string() + &mine + " 0 1", "v".into()]);
    c.send(format!("mg {dead} v\r\n").as_bytes());
    assert!(c.line().starts_with("SERVER_ERROR forwarding failed"));
    assert!(stat(&mut c, "forward_errors") >= 8);
    for s in servers {
        s.shutdown();
    }
}
