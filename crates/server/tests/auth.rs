//! Authentication and the control plane against a real server over real
//! sockets: memcached's ASCII auth (-Y) and SASL PLAIN over the binary
//! protocol, `mbal peer` and the control commands, and the limits under
//! abuse (connections per address, input buffered, slow senders).

mod common;

use common::{settings, start, stat, Conn};
use mbal_member::peer_auth::{self, Secret};
use mbal_proto::binary::{opcode as op, status as st, write_request, BinHeader, HEADER_LEN};
use mbal_server::auth::Credentials;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

fn users() -> Option<Arc<Credentials>> {
    Some(Arc::new(Credentials::parse(b"foo:bar\nbaaaz:quux\n").unwrap()))
}

fn secret() -> Secret {
    Secret::new(b"the cluster secret, 32 bytes ...".to_vec()).unwrap()
}

/// Authenticate a text connection (memcached's ASCII auth).
fn login(c: &mut Conn, user: &str, pass: &str) -> String {
    let token = format!("{user} {pass}");
    c.cmd(&format!("set auth 0 0 {}\r\n{token}\r\n", token.len()))
}

/// Become a cluster peer with `secret`; returns the server's last reply.
fn peer(c: &mut Conn, secret: &Secret) -> String {
    let nonce = c.cmd("mbal peer\r\n");
    assert!(nonce.starts_with("NONCE "), "{nonce:?}");
    c.cmd(&peer_auth::answer_line(secret, nonce.trim_end()).unwrap())
}

#[test]
fn ascii_auth_is_memcacheds() {
    let srv = start(Settings { auth: users(), ..settings(2) });
    let mut c = Conn::open(srv.main_addr);
    // No password: every request is refused, the connection stays.
    assert_eq!(c.cmd("get foo\r\n"), "CLIENT_ERROR unauthenticated\r\n");
    assert_eq!(c.cmd("version\r\n"), "CLIENT_ERROR unauthenticated\r\n");
    assert_eq!(c.cmd("mbal hello 0\r\n"), "CLIENT_ERROR unauthenticated\r\n");
    // Wrong password, malformed token.
    assert_eq!(login(&mut c, "foo", "bab"), "CLIENT_ERROR authentication failure\r\n");
    assert_eq!(login(&mut c, "nobody", "bar"), "CLIENT_ERROR authentication failure\r\n");
    assert_eq!(c.cmd("set foo 0 0 2\r\nhi\r\n"), "CLIENT_ERROR bad authentication token format\r\n");
    assert_eq!(c.cmd("set foo 0 0 99999\r\n"), "CLIENT_ERROR auth token too long\r\n");
    assert_eq!(c.cmd("get foo\r\n"), "CLIENT_ERROR unauthenticated\r\n");
    // The right one, then commands work (a set that looks like a token is a set).
    assert_eq!(login(&mut c, "foo", "bar"), "STORED\r\n");
    assert_eq!(c.set("toast", b"hi"), "STORED\r\n");
    assert_eq!(c.get("toast").as_deref(), Some(&b"hi"[..]));
    assert_eq!(c.set("x", b"a b"), "STORED\r\n");
    assert!(c.cmd("version\r\n").starts_with("VERSION "));
    assert!(c.cmd("mbal hello 0\r\n").starts_with("MBAL "), "routing stays available");
    // A second user, pipelined with its first request.
    let mut d = Conn::open(srv.main_addr);
    d.send(b"set a 0 0 10\r\nbaaaz quux\r\nget toast\r\n");
    assert_eq!(d.line(), "STORED\r\n");
    assert_eq!(d.line(), "VALUE toast 0 2\r\n");
    assert_eq!(d.exact(4), b"hi\r\n");
    assert_eq!(d.line(), "END\r\n");
    assert_eq!(stat(&mut d, "auth_cmds"), 4);
    assert_eq!(stat(&mut d, "auth_errors"), 2);
    // Junk with no line end is closed without a reply, as memcached does.
    let mut j = Conn::open(srv.main_addr);
    j.send(&[b'x'; 3000]);
    assert!(j.closed());
    srv.shutdown();
}

/// A blocking binary-protocol connection.
struct Bin(TcpStream);

impl Bin {
    fn open(addr: SocketAddr) -> Bin {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Bin(s)
    }

    fn call(&mut self, opcode: u8, extras: &[u8], key: &[u8], value: &[u8]) -> (u16, Vec<u8>) {
        let mut req = Vec::new();
        write_request(&mut req, opcode, 0, 7, 0, extras, key, value);
        self.0.write_all(&req).unwrap();
        let mut h = [0u8; HEADER_LEN];
        self.0.read_exact(&mut h).unwrap();
        let h = BinHeader::decode(&h);
        assert_eq!((h.magic, h.opcode, h.opaque), (0x81, opcode, 7));
        let mut body = vec![0; h.body_len as usize];
        self.0.read_exact(&mut body).unwrap();
        // The response's status is in the request header's vbucket field.
        (h.vbucket, body[h.extras_len as usize + h.key_len as usize..].to_vec())
    }

    fn closed(&mut self) -> bool {
        matches!(self.0.read(&mut [0u8; 1]), Ok(0) | Err(_))
    }
}

#[test]
fn sasl_plain_over_binary() {
    let srv = start(Settings { auth: users(), ..settings(2) });
    let mut b = Bin::open(srv.main_addr);
    assert_eq!(b.call(op::SASL_LIST_MECHS, &[], b"", b""), (st::NO_ERROR, b"PLAIN".to_vec()));
    assert_eq!(b.call(op::VERSION, &[], b"", b"").0, st::NO_ERROR, "version is allowed before auth");
    assert_eq!(b.call(op::SASL_AUTH, &[], b"PLAIN", b"\0foo\0bab"), (st::AUTH_ERROR, b"Auth failure.".to_vec()));
    assert_eq!(b.call(op::SASL_AUTH, &[], b"CRAM-MD5", b"foo").0, st::AUTH_ERROR);
    assert_eq!(b.call(op::SASL_STEP, &[], b"PLAIN", b"\0foo\0bar").0, st::AUTH_ERROR, "PLAIN has no steps");
    assert_eq!(b.call(op::SASL_AUTH, &[], b"PLAIN", b"\0foo\0bar"), (st::NO_ERROR, b"Authenticated".to_vec()));
    let extras = [0u8; 8];
    assert_eq!(b.call(op::SET, &extras, b"k", b"v").0, st::NO_ERROR);
    assert_eq!(b.call(op::GET, &[], b"k", b""), (st::NO_ERROR, b"v".to_vec()));
    // Anything else before authenticating: an auth error, then the close.
    let mut u = Bin::open(srv.main_addr);
    assert_eq!(u.call(op::GET, &[], b"k", b""), (st::AUTH_ERROR, b"Auth failure.".to_vec()));
    assert!(u.closed());
    // Without -Y there is no SASL (memcached: unknown command) and no need for it.
    let open = start(settings(1));
    let mut o = Bin::open(open.main_addr);
    assert_eq!(o.call(op::SASL_LIST_MECHS, &[], b"", b"").0, st::UNKNOWN_COMMAND);
    assert_eq!(o.call(op::GET, &[], b"k", b"").0, st::KEY_ENOENT);
    open.shutdown();
    srv.shutdown();
}

/// Every control command a data-plane client might try.
const CONTROL: &[&str] = &[
    "mbal move 0 1\r\n",
    "mbal debug stall 1 10\r\n",
    "mbal threads 1\r\n",
    "mbal replica add k 1\r\n",
    "mbal replica drop k\r\n",
    "mbal no-such-command\r\n",
];

#[test]
fn data_plane_clients_cannot_send_control_commands() {
    let srv = start(Settings { auth: users(), control_secret: Some(secret()), debug_commands: true, ..settings(2) });
    let mut c = Conn::open(srv.main_addr);
    assert_eq!(login(&mut c, "foo", "bar"), "STORED\r\n");
    for cmd in CONTROL {
        let r = c.cmd(cmd);
        assert!(r.starts_with("CLIENT_ERROR control command refused"), "{cmd:?} -> {r:?}");
    }
    // The routing commands stay.
    assert!(c.cmd("mbal hello 0\r\n").starts_with("MBAL "));
    c.send(b"mbal map\r\n");
    assert!(c.line().starts_with("MAP "));
    let map = c.line();
    assert!(map.starts_with('{'), "{map:?}");
    assert_eq!(stat(&mut c, "control_refused"), CONTROL.len() as u64);
    // A wrong secret is no better.
    let wrong = Secret::new(b"not the cluster secret at all...".to_vec()).unwrap();
    assert_eq!(peer(&mut c, &wrong), "CLIENT_ERROR bad peer credentials\r\n");
    assert!(c.cmd("mbal move 0 1\r\n").starts_with("CLIENT_ERROR control command refused"));
    assert_eq!(c.cmd("mbal peer 00ff\r\n"), "CLIENT_ERROR bad peer credentials\r\n", "no challenge, no entry");
    // With -Y and no secret, no one may (a -Y user is a data-plane identity).
    let nosecret = start(Settings { auth: users(), ..settings(2) });
    let mut d = Conn::open(nosecret.main_addr);
    assert_eq!(login(&mut d, "foo", "bar"), "STORED\r\n");
    let r = d.cmd("mbal move 0 1\r\n");
    assert!(r.contains("--control-secret-file"), "{r:?}");
    assert!(d.cmd("mbal peer\r\n").starts_with("CLIENT_ERROR no control secret"));
    nosecret.shutdown();
    srv.shutdown();
}

#[test]
fn a_peer_with_the_secret_moves_a_cachelet() {
    let srv = start(Settings { auth: users(), control_secret: Some(secret()), ..settings(2) });
    let mut c = Conn::open(srv.main_addr);
    assert_eq!(login(&mut c, "foo", "bar"), "STORED\r\n");
    assert_eq!(peer(&mut c, &secret()), "OK\r\n");
    // Cachelet 0 starts on worker 0.
    let r = c.cmd("mbal move 0 1\r\n");
    assert!(r.starts_with("MOVED "), "{r:?}");
    assert_eq!(stat(&mut c, "peer_auth_cmds"), 1);
    assert_eq!(stat(&mut c, "peer_auth_errors"), 0);
    // The standing is the connection's, not the address's.
    let mut other = Conn::open(srv.main_addr);
    assert_eq!(login(&mut other, "foo", "bar"), "STORED\r\n");
    assert!(other.cmd("mbal move 0 0\r\n").starts_with("CLIENT_ERROR control command refused"));
    // Without -Y, a peer needs no data-plane login; a secret still guards control.
    let plain = start(Settings { control_secret: Some(secret()), ..settings(2) });
    let mut p = Conn::open(plain.main_addr);
    assert!(p.cmd("mbal move 0 1\r\n").starts_with("CLIENT_ERROR control command refused"));
    assert_eq!(peer(&mut p, &secret()), "OK\r\n");
    assert!(p.cmd("mbal move 0 1\r\n").starts_with("MOVED "));
    plain.shutdown();
    srv.shutdown();
}

#[test]
fn without_a_secret_loopback_keeps_control() {
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    assert!(c.cmd("mbal move 0 1\r\n").starts_with("MOVED "));
    assert!(c.cmd("mbal peer\r\n").starts_with("CLIENT_ERROR no control secret"));
    srv.shutdown();
}

#[test]
fn connections_per_address_are_limited() {
    let srv = start(Settings { max_conns_per_ip: 2, ..settings(1) });
    let mut a = Conn::open(srv.main_addr);
    let mut b = Conn::open(srv.main_addr);
    assert!(a.cmd("version\r\n").starts_with("VERSION"));
    assert!(b.cmd("version\r\n").starts_with("VERSION"));
    let mut c = Conn::open(srv.main_addr);
    assert_eq!(c.line(), "ERROR Too many open connections from this address\r\n");
    assert!(c.closed());
    // The worker ports count too.
    let mut w = Conn::open(srv.worker_addrs[0]);
    assert_eq!(w.line(), "ERROR Too many open connections from this address\r\n");
    assert_eq!(stat(&mut a, "rejected_connections_per_ip"), 2);
    // Once one closes, the address may connect again (the server sees the
    // close when it reads; ask it until it has).
    drop(b);
    let mut freed = false;
    for _ in 0..1000 {
        if stat(&mut a, "curr_connections") == 1 {
            freed = true;
            break;
        }
    }
    assert!(freed, "the closed connection was never counted out");
    let mut d = Conn::open(srv.main_addr);
    assert!(d.cmd("version\r\n").starts_with("VERSION"));
    srv.shutdown();
}

#[test]
fn input_is_bounded_per_connection() {
    let srv = start(Settings { max_input_buffer: 64 << 10, ..settings(1) });
    let mut c = Conn::open(srv.main_addr);
    assert_eq!(c.set("small", &[b'x'; 30_000]), "STORED\r\n");
    // A value that fits -I but not the connection's input limit.
    let big = vec![b'y'; 200_000];
    let mut req = format!("set big 0 0 {}\r\n", big.len()).into_bytes();
    req.extend_from_slice(&big);
    req.extend_from_slice(b"\r\n");
    // The server may close before taking all of it: ignore a failed write.
    let _ = c.w.write_all(&req);
    assert_eq!(c.line(), "SERVER_ERROR request larger than the input buffer limit\r\n");
    assert!(c.closed());
    let mut d = Conn::open(srv.main_addr);
    assert_eq!(stat(&mut d, "input_limit_closes"), 1);
    assert_eq!(d.get("small").map(|v| v.len()), Some(30_000));
    // Many small pipelined requests are not refused: they are read as the
    // buffer is parsed down.
    let mut pipe = Vec::new();
    for i in 0..20_000 {
        pipe.extend_from_slice(format!("set p{i} 0 0 4\r\nabcd\r\n").as_bytes());
    }
    let mut w = d.w.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&pipe).unwrap());
    for _ in 0..20_000 {
        assert_eq!(d.line(), "STORED\r\n");
    }
    writer.join().unwrap();
    assert_eq!(stat(&mut d, "input_limit_closes"), 1);
    srv.shutdown();
}

#[test]
fn slow_senders_are_closed() {
    let srv = start(Settings { request_timeout_ms: 200, ..settings(1) });
    let mut idle = Conn::open(srv.main_addr);
    assert!(idle.cmd("version\r\n").starts_with("VERSION"));
    let mut slow = Conn::open(srv.main_addr);
    slow.send(b"get half-a-req");
    assert_eq!(slow.line(), "SERVER_ERROR timed out waiting for the rest of the request\r\n");
    assert!(slow.closed());
    // So is one that stops in the middle of a data block.
    let mut slow2 = Conn::open(srv.main_addr);
    slow2.send(b"set k 0 0 10\r\nabc");
    assert_eq!(slow2.line(), "SERVER_ERROR timed out waiting for the rest of the request\r\n");
    // A connection idle between requests is not a slow sender (it waited as long).
    assert!(idle.cmd("version\r\n").starts_with("VERSION"));
    assert_eq!(stat(&mut idle, "request_timeouts"), 2);
    srv.shutdown();
}

use mbal_server::config::Settings;
