//! TLS (`-Z`): real rustls handshakes against the server's listeners, with
//! certificates made at test time (rcgen): get/set on the main and worker
//! ports, a routed hand-over that carries its TLS session to another worker,
//! wrong CA, expired certificates, client certificates, plaintext on a TLS
//! port, and certificate reload.

mod common;

use common::{settings, start, Layout};
use mbal_client::{Client, Config};
use mbal_cluster::key_hash;
use mbal_server::config::Settings;
use mbal_tls::test_certs::{CertFiles, Pki};
use mbal_tls::{BlockingStream, ClientTls, ClientTlsFiles, ServerTlsFiles, VerifyMode};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

fn tls_settings(threads: usize, cert: &CertFiles, ca: Option<&Pki>, verify_mode: VerifyMode) -> Settings {
    let mut s = settings(threads);
    s.tls = Some(ServerTlsFiles {
        chain_cert: cert.cert.clone(),
        key: Some(cert.key.clone()),
        ca_cert: ca.map(|p| p.ca()),
        verify_mode,
        tls13_only: false,
    });
    s
}

fn client_tls(ca: &Pki, cert: Option<&CertFiles>) -> ClientTls {
    ClientTls::load(&ClientTlsFiles {
        ca_cert: ca.ca(),
        cert: cert.map(|c| c.cert.clone()),
        key: cert.map(|c| c.key.clone()),
        server_name: None,
    })
    .unwrap()
}

/// A blocking text-protocol connection over TLS (the handshake done in `open`).
struct TlsConn {
    s: BlockingStream,
    buf: Vec<u8>,
}

impl TlsConn {
    fn open(addr: SocketAddr, tls: &ClientTls) -> io::Result<TlsConn> {
        let sock = TcpStream::connect(addr)?;
        sock.set_read_timeout(Some(Duration::from_secs(10)))?;
        sock.set_write_timeout(Some(Duration::from_secs(10)))?;
        Ok(TlsConn { s: BlockingStream::new(sock, addr, Some(tls))?, buf: Vec::new() })
    }

    fn send(&mut self, b: &[u8]) -> io::Result<()> {
        self.s.write_all(b)
    }

    fn fill(&mut self) -> io::Result<()> {
        let mut chunk = [0u8; 16 << 10];
        let n = self.s.read(&mut chunk)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    fn line(&mut self) -> io::Result<String> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let l: Vec<u8> = self.buf.drain(..i + 2).collect();
                return Ok(String::from_utf8_lossy(&l).into_owned());
            }
            self.fill()?;
        }
    }

    fn exact(&mut self, n: usize) -> io::Result<Vec<u8>> {
        while self.buf.len() < n {
            self.fill()?;
        }
        Ok(self.buf.drain(..n).collect())
    }

    fn cmd(&mut self, c: &str) -> io::Result<String> {
        self.send(c.as_bytes())?;
        self.line()
    }

    fn until_end(&mut self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        loop {
            let l = self.line()?;
            if l == "END\r\n" {
                return Ok(out);
            }
            out.push(l);
        }
    }

    /// set then get of `key` (a full round trip of a request over TLS).
    fn set_get(&mut self, key: &str, val: &[u8]) -> io::Result<Vec<u8>> {
        self.send(format!("set {key} 0 0 {}\r\n", val.len()).as_bytes())?;
        self.send(val)?;
        self.send(b"\r\n")?;
        assert_eq!(self.line()?, "STORED\r\n");
        self.send(format!("get {key}\r\n").as_bytes())?;
        let head = self.line()?;
        assert_eq!(head, format!("VALUE {key} 0 {}\r\n", val.len()));
        let v = self.exact(val.len() + 2)?;
        assert_eq!(self.line()?, "END\r\n");
        Ok(v[..val.len()].to_vec())
    }
}

fn stat(c: &mut TlsConn, group: &str, name: &str) -> Option<String> {
    c.send(format!("stats {group}\r\n").trim_end().as_bytes()).unwrap();
    c.send(b"\r\n").unwrap();
    let prefix = format!("STAT {name} ");
    c.until_end().unwrap().into_iter().find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim_end().to_string()))
}

/// A key of a cachelet that `worker` owns at start (one server).
fn key_on(layout: &Layout, worker: u16, n: usize) -> String {
    (0..)
        .map(|i| format!("k{worker}:{i}"))
        .filter(|k| layout.owner(layout.cachelet_of_hash(key_hash(k.as_bytes()))).1 == worker)
        .nth(n)
        .unwrap()
}

#[test]
fn get_and_set_over_tls_on_the_main_and_worker_ports() {
    let pki = Pki::new("srv");
    let cert = pki.server("server");
    let srv = start(tls_settings(2, &cert, None, VerifyMode::None));
    let tls = client_tls(&pki, None);

    let mut c = TlsConn::open(srv.main_addr, &tls).unwrap();
    assert_eq!(c.set_get("a", b"hello").unwrap(), b"hello");
    // A value larger than a TLS record and than the server's read chunk.
    let big: Vec<u8> = (0..300_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    assert_eq!(c.set_get("big", &big).unwrap(), big);
    // Pipelined: many requests in one write, every reply in order.
    let mut batch = Vec::new();
    for i in 0..200 {
        batch.extend_from_slice(format!("set p{i} 0 0 {}\r\n{i}\r\n", i.to_string().len()).as_bytes());
    }
    for i in 0..200 {
        batch.extend_from_slice(format!("get p{i}\r\n").as_bytes());
    }
    c.send(&batch).unwrap();
    for _ in 0..200 {
        assert_eq!(c.line().unwrap(), "STORED\r\n");
    }
    for i in 0..200 {
        assert_eq!(c.line().unwrap(), format!("VALUE p{i} 0 {}\r\n", i.to_string().len()));
        assert_eq!(c.line().unwrap(), format!("{i}\r\n"));
        assert_eq!(c.line().unwrap(), "END\r\n");
    }
    assert_eq!(stat(&mut c, "settings", "ssl_enabled").as_deref(), Some("yes"));
    assert_eq!(stat(&mut c, "", "ssl_handshake_errors").as_deref(), Some("0"));

    // Each worker port speaks TLS too: the routing client over TLS.
    assert_eq!(srv.worker_addrs.len(), 2);
    for &w in &srv.worker_addrs {
        let mut d = TlsConn::open(w, &tls).unwrap();
        assert_eq!(d.cmd("version\r\n").unwrap(), format!("VERSION {}\r\n", mbal_server::VERSION));
    }
    let cfg = Config { tls: Some(tls.clone()), ..Config::default() };
    let mut rc = Client::connect(srv.main_addr, cfg).unwrap();
    let keys: Vec<String> = (0..64).map(|i| format!("r{i}")).collect();
    let items: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (k.as_bytes(), k.as_bytes())).collect();
    assert!(rc.set_multi(&items, 0, 0).unwrap().iter().all(|&ok| ok));
    let ks: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    let got = rc.get_multi(&ks).unwrap();
    for (k, v) in keys.iter().zip(got) {
        assert_eq!(v.unwrap().data, k.as_bytes());
    }
    assert_eq!(rc.get(b"a").unwrap().unwrap().data, b"hello");
    srv.shutdown();
}

#[test]
fn a_routed_hand_over_carries_the_tls_session_to_its_worker() {
    let pki = Pki::new("handoff");
    let cert = pki.server("server");
    let mut s = tls_settings(3, &cert, None, VerifyMode::None);
    s.worker_port_base = None;
    let (cpw, vn) = (s.cachelets_per_worker, s.vn_count);
    let srv = start(s);
    let layout = Layout::even(1, 3, cpw, vn);
    let (mine, other) = (key_on(&layout, 2, 0), key_on(&layout, 0, 0));
    let tls = client_tls(&pki, None);

    // The hello and the requests behind it in one write: the worker that
    // accepted the connection decrypted them all, and what it read past the
    // hello travels with the TLS session to worker 2.
    let mut c = TlsConn::open(srv.main_addr, &tls).unwrap();
    c.send(format!("mbal hello 0 2\r\nset {mine} 0 0 2\r\nhi\r\nget {mine}\r\nget {other}\r\n").as_bytes()).unwrap();
    assert!(c.line().unwrap().starts_with("MBAL 0 2 "));
    assert_eq!(c.line().unwrap(), "STORED\r\n");
    assert_eq!(c.line().unwrap(), format!("VALUE {mine} 0 2\r\n"));
    assert_eq!(c.line().unwrap(), "hi\r\n");
    assert_eq!(c.line().unwrap(), "END\r\n");
    let rd = c.line().unwrap();
    assert!(rd.starts_with("RD ") && rd.trim_end().ends_with(" 0 0"), "{rd:?}");
    // The same session goes on at worker 2, for many more requests.
    for i in 0..50 {
        let v = format!("v{i}");
        assert_eq!(c.set_get(&mine, v.as_bytes()).unwrap(), v.as_bytes());
    }

    // The routing client reaches every worker through the main port.
    let cfg = Config { tls: Some(tls), ..Config::default() };
    let mut rc = Client::connect(srv.main_addr, cfg).unwrap();
    for w in 0..3u16 {
        let k = key_on(&layout, w, 1);
        assert!(rc.set(k.as_bytes(), b"x", 0, 0).unwrap());
        assert_eq!(rc.get(k.as_bytes()).unwrap().unwrap().data, b"x");
    }
    srv.shutdown();
}

#[test]
fn a_wrong_ca_or_plaintext_fails_that_connection_only() {
    let pki = Pki::new("good");
    let stranger = Pki::new("stranger");
    let cert = pki.server("server");
    let srv = start(tls_settings(2, &cert, None, VerifyMode::None));
    let good = client_tls(&pki, None);
    let mut keep = TlsConn::open(srv.main_addr, &good).unwrap();
    assert_eq!(keep.set_get("k", b"v").unwrap(), b"v");

    let e = TlsConn::open(srv.main_addr, &client_tls(&stranger, None)).err().expect("an unknown CA must fail");
    assert!(e.to_string().contains("UnknownIssuer"), "{e}");

    // Plaintext memcached on a TLS port: the server closes it.
    let mut plain = common::Conn::open(srv.main_addr);
    plain.send(b"version\r\n");
    let mut rest = Vec::new();
    let n = plain.r.read_to_end(&mut rest);
    assert!(n.is_err() || !rest.starts_with(b"VERSION"), "plaintext was answered: {rest:?}");

    // Others are still served, the open connection too.
    assert_eq!(keep.set_get("k2", b"v2").unwrap(), b"v2");
    let mut again = TlsConn::open(srv.main_addr, &good).unwrap();
    assert_eq!(again.set_get("k3", b"v3").unwrap(), b"v3");
    let errors: u64 = stat(&mut again, "", "ssl_handshake_errors").unwrap().parse().unwrap();
    assert!(errors >= 2, "the wrong CA's alert and the plaintext are counted: {errors}");
    srv.shutdown();
}

#[test]
fn an_expired_server_certificate_is_rejected() {
    let pki = Pki::new("expired");
    let cert = pki.expired_server("old");
    let srv = start(tls_settings(1, &cert, None, VerifyMode::None));
    let e = TlsConn::open(srv.main_addr, &client_tls(&pki, None)).err().expect("an expired certificate must fail");
    assert!(e.to_string().contains("certificate expired"), "{e}");
    srv.shutdown();
}

#[test]
fn a_required_client_certificate() {
    let pki = Pki::new("mtls");
    let stranger = Pki::new("mtls-stranger");
    let cert = pki.server("server");
    let srv = start(tls_settings(2, &cert, Some(&pki), VerifyMode::Required));

    // Without one: the handshake is refused (TLS 1.3 says so at the first read).
    let refused = |tls: &ClientTls| -> io::Error {
        match TlsConn::open(srv.main_addr, tls) {
            Err(e) => e,
            Ok(mut c) => c.cmd("version\r\n").expect_err("a client without an accepted certificate was served"),
        }
    };
    let e = refused(&client_tls(&pki, None));
    assert!(e.to_string().contains("CertificateRequired"), "{e}");
    // Signed by another CA, or expired: refused too.
    refused(&client_tls(&pki, Some(&stranger.client("other"))));
    refused(&client_tls(&pki, Some(&pki.expired_client("old"))));
    // With one the CA signed: served, on every port.
    let me = pki.client("me");
    let tls = client_tls(&pki, Some(&me));
    let mut c = TlsConn::open(srv.main_addr, &tls).unwrap();
    assert_eq!(c.set_get("m", b"tls").unwrap(), b"tls");
    assert_eq!(stat(&mut c, "settings", "ssl_verify_mode").as_deref(), Some("2"));
    let cfg = Config { tls: Some(tls), ..Config::default() };
    let mut rc = Client::connect(srv.main_addr, cfg).unwrap();
    assert_eq!(rc.get(b"m").unwrap().unwrap().data, b"tls");
    srv.shutdown();
}

#[test]
fn reload_serves_new_connections_with_the_new_certificate() {
    let old_ca = Pki::new("reload-old");
    let new_ca = Pki::new("reload-new");
    let cert = old_ca.server("server");
    let srv = start(tls_settings(2, &cert, None, VerifyMode::None));
    let (old_tls, new_tls) = (client_tls(&old_ca, None), client_tls(&new_ca, None));
    let mut open = TlsConn::open(srv.main_addr, &old_tls).unwrap();
    assert_eq!(open.set_get("a", b"1").unwrap(), b"1");

    // A broken file: ERROR and why; the certificate in use stays.
    std::fs::write(&cert.cert, "not a certificate").unwrap();
    let e = open.cmd("refresh_certs\r\n").unwrap();
    assert!(e.starts_with("ERROR ") && e.contains("server.pem"), "{e:?}");
    assert!(srv.reload_tls().is_err());
    TlsConn::open(srv.main_addr, &old_tls).unwrap();

    // The files replaced by a certificate of another CA, then reloaded.
    let fresh = new_ca.server("fresh");
    std::fs::copy(&fresh.cert, &cert.cert).unwrap();
    std::fs::copy(&fresh.key, &cert.key).unwrap();
    assert_eq!(open.cmd("refresh_certs\r\n").unwrap(), "OK\r\n");
    assert!(TlsConn::open(srv.main_addr, &old_tls).is_err(), "new connections get the new certificate");
    let mut n = TlsConn::open(srv.main_addr, &new_tls).unwrap();
    assert_eq!(n.set_get("b", b"2").unwrap(), b"2");
    // The connection opened before keeps its session.
    assert_eq!(open.set_get("c", b"3").unwrap(), b"3");
    // The library call does the same.
    srv.reload_tls().unwrap();
    TlsConn::open(srv.main_addr, &new_tls).unwrap();
    srv.shutdown();
}

#[test]
fn refresh_certs_without_tls_is_an_error() {
    let srv = start(settings(1));
    let mut c = common::Conn::open(srv.main_addr);
    assert_eq!(c.cmd("refresh_certs\r\n"), "ERROR TLS is not enabled\r\n");
    assert!(srv.reload_tls().is_err());
    srv.shutdown();
}

#[test]
fn ascii_auth_inside_tls_and_a_hand_over_keeps_both() {
    let pki = Pki::new("auth");
    let cert = pki.server("server");
    let mut s = tls_settings(3, &cert, None, VerifyMode::None);
    s.worker_port_base = None;
    s.auth = Some(std::sync::Arc::new(mbal_server::auth::Credentials::parse(b"foo:bar\n").unwrap()));
    let srv = start(s);
    let tls = client_tls(&pki, None);
    let mut c = TlsConn::open(srv.main_addr, &tls).unwrap();
    assert_eq!(c.cmd("get a\r\n").unwrap(), "CLIENT_ERROR unauthenticated\r\n");
    let mut c = TlsConn::open(srv.main_addr, &tls).unwrap();
    assert_eq!(c.cmd("set auth 0 0 7\r\nfoo bar\r\n").unwrap(), "STORED\r\n");
    assert_eq!(c.set_get("a", b"1").unwrap(), b"1");
    // The routing client logs in on each connection, over TLS, through hand-overs.
    let login = mbal_client::Login { user: "foo".into(), password: "bar".into() };
    let cfg = Config { tls: Some(tls), login: Some(login), ..Config::default() };
    let mut rc = Client::connect(srv.main_addr, cfg).unwrap();
    for i in 0..30 {
        let k = format!("k{i}");
        assert!(rc.set(k.as_bytes(), b"v", 0, 0).unwrap());
        assert_eq!(rc.get(k.as_bytes()).unwrap().unwrap().data, b"v");
    }
    srv.shutdown();
}
