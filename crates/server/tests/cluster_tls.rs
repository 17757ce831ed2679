//! A cluster whose file has a `[tls]` section and a secret: the members'
//! own connections to each other (the Phase 1 replicator's copies, the
//! `--forward` forwarder's requests) run over TLS with client certificates
//! (`verify_mode = 2`) and log in with the cluster secret (`mbal peer`),
//! which a server with `-Y` takes as the connection's login. Real rustls
//! handshakes on loopback; certificates made at test time.

mod common;

use common::settings;
use mbal_cluster::{key_hash, replica_location, ClusterMap};
use mbal_member::dial::{Dialer, Proto};
use mbal_member::{peer_auth, ClusterFile, ClusterSpec, ServerSpec, TlsSpec};
use mbal_server::ServerHandle;
use mbal_tls::test_certs::Pki;
use mbal_tls::{BlockingStream, ClientTls, ClientTlsFiles};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const WORKERS: u16 = 2;
const SECRET: &str = "a cluster secret of 32 bytes....";

/// A blocking text connection over TLS.
struct TConn {
    r: BufReader<BlockingStream>,
}

impl TConn {
    fn open(addr: SocketAddr, tls: &ClientTls) -> std::io::Result<TConn> {
        let s = mbal_tls::dial(addr, Some(tls), Duration::from_secs(10))?;
        let mut c = TConn { r: BufReader::new(s) };
        // A refused handshake shows on the first exchange at the latest.
        c.send(b"version\r\n")?;
        c.line()?;
        Ok(c)
    }
    /// A connection whose first bytes are the caller's (binary clients).
    fn raw(addr: SocketAddr, tls: &ClientTls) -> TConn {
        TConn { r: BufReader::new(mbal_tls::dial(addr, Some(tls), Duration::from_secs(10)).unwrap()) }
    }
    /// A binary request; (status, value).
    fn bin(&mut self, opcode: u8, key: &str, extras: &[u8], value: &[u8]) -> (u16, Vec<u8>) {
        let body = (extras.len() + key.len() + value.len()) as u32;
        let mut req = vec![0x80, opcode, 0, key.len() as u8, extras.len() as u8, 0, 0, 0];
        req.extend_from_slice(&body.to_be_bytes());
        req.extend_from_slice(&[0; 12]);
        req.extend_from_slice(extras);
        req.extend_from_slice(key.as_bytes());
        req.extend_from_slice(value);
        self.send(&req).unwrap();
        let mut h = [0u8; 24];
        self.r.read_exact(&mut h).unwrap();
        let len = u32::from_be_bytes([h[8], h[9], h[10], h[11]]) as usize;
        let mut rest = vec![0; len];
        self.r.read_exact(&mut rest).unwrap();
        let skip = h[4] as usize + u16::from_be_bytes([h[2], h[3]]) as usize;
        (u16::from_be_bytes([h[6], h[7]]), rest[skip..].to_vec())
    }
    fn send(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.r.get_mut().write_all(b)?;
        self.r.get_mut().flush()
    }
    fn line(&mut self) -> std::io::Result<String> {
        let mut l = String::new();
        if self.r.read_line(&mut l)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(l)
    }
    fn cmd(&mut self, c: &str) -> String {
        self.send(c.as_bytes()).unwrap();
        self.line().unwrap()
    }
    fn get(&mut self, key: &str) -> Option<String> {
        self.send(format!("get {key}\r\n").as_bytes()).unwrap();
        let mut head = self.line().unwrap();
        while head.starts_with("RH ") {
            head = self.line().unwrap();
        }
        if head == "END\r\n" {
            return None;
        }
        let n: usize = head.split_whitespace().nth(3).unwrap().parse().unwrap();
        let mut v = vec![0; n + 2];
        self.r.read_exact(&mut v).unwrap();
        assert_eq!(self.line().unwrap(), "END\r\n");
        Some(String::from_utf8_lossy(&v[..n]).into_owned())
    }
    fn peer(&mut self) {
        let nonce = self.cmd("mbal peer\r\n");
        let secret = peer_auth::Secret::new(SECRET.as_bytes().to_vec()).unwrap();
        assert_eq!(self.cmd(&peer_auth::answer_line(&secret, nonce.trim_end()).unwrap()), "OK\r\n");
    }
}

struct TlsCluster {
    pki: Pki,
    file: PathBuf,
    map: ClusterMap,
    servers: Vec<ServerHandle>,
    tls: ClientTls,
}

impl Drop for TlsCluster {
    fn drop(&mut self) {
        for s in self.servers.drain(..) {
            s.shutdown();
        }
    }
}

/// Two servers of two workers, with -Y, a cluster file with `[tls]`
/// (verify_mode 2, the members' client certificate) and `secret_file`;
/// server 0 forwards.
fn tls_cluster() -> TlsCluster {
    let pki = Pki::new("cluster");
    pki.server("member");
    pki.client("peer");
    std::fs::write(pki.dir.join("secret"), format!("{SECRET}\n")).unwrap();
    std::fs::write(pki.dir.join("users"), "app:pw\n").unwrap();
    let ls: Vec<_> = (0..2).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let spec = ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 1024,
        cachelets_per_worker: 4,
        workers: WORKERS,
        servers: ls.iter().map(|l| ServerSpec { addr: l.local_addr().unwrap(), worker_port_base: None }).collect(),
        secret: None,
        secret_file: Some("secret".into()),
        tls: Some(TlsSpec {
            ca_cert: "ca.pem".into(),
            cert: Some("member.pem".into()),
            key: Some("member.key".into()),
            verify_mode: 2,
            client_cert: Some("peer.pem".into()),
            client_key: Some("peer.key".into()),
            server_name: None,
        }),
    };
    drop(ls);
    let file = pki.dir.join("cluster.toml");
    std::fs::write(&file, spec.to_toml()).unwrap();
    // What `mbal server --cluster FILE --id N -Y users` makes of it.
    let cf = ClusterFile::load(&file).unwrap();
    let servers = (0..2)
        .map(|id| {
            let mut s = settings(WORKERS as usize);
            s.apply_cluster(cf.spec.clone(), id).unwrap();
            s.worker_port_base = None;
            s.tls = Some(cf.spec.tls.as_ref().unwrap().server_files(cf.dir.as_deref()).unwrap());
            s.peer_tls = cf.client_tls.clone();
            s.control_secret = cf.secret.clone();
            s.auth = Some(std::sync::Arc::new(mbal_server::auth::Credentials::load(&pki.dir.join("users")).unwrap()));
            s.debug_commands = true;
            s.balancer = false;
            s.hot.enabled = true;
            s.epoch_ms = 100;
            s.hot.epoch_ms = 100;
            s.forward = id == 0;
            s.forward_timeout_ms = 5000;
            mbal_server::start(s).expect("server starts")
        })
        .collect();
    let tls = cf.client_tls.clone().unwrap();
    TlsCluster { map: cf.spec.initial_map(), pki, file, servers, tls }
}

impl TlsCluster {
    fn addr(&self, s: usize) -> SocketAddr {
        self.servers[s].main_addr
    }
    /// A data-plane client: TLS with the client certificate, logged in with -Y.
    fn client(&self, s: usize) -> TConn {
        let mut c = TConn::open(self.addr(s), &self.tls).unwrap();
        assert_eq!(c.cmd("set auth 0 0 6\r\napp pw\r\n"), "STORED\r\n");
        c
    }
    fn key_on(&self, server: u16, prefix: &str) -> (String, u16) {
        (0..100_000)
            .map(|i| format!("{prefix}{i}"))
            .find_map(|k| {
                let (_, s, w) = self.map.route(key_hash(k.as_bytes()));
                (s == server).then_some((k, w))
            })
            .unwrap()
    }
}

#[test]
fn members_copy_hot_keys_and_forward_over_tls_with_the_cluster_secret() {
    let cl = tls_cluster();
    assert!(cl.file.exists());
    let mut c0 = cl.client(0);
    // --forward over TLS: a key of server 1 written and read through server 0.
    let (k1, _) = cl.key_on(1, "fwd");
    assert_eq!(c0.cmd(&format!("set {k1} 0 0 3\r\nfwd\r\n")), "STORED\r\n");
    assert_eq!(c0.get(&k1).as_deref(), Some("fwd"));
    let mut c1 = cl.client(1);
    assert_eq!(c1.get(&k1).as_deref(), Some("fwd"), "stored at its owner");
    assert_eq!(c1.cmd(&format!("set {k1} 0 0 5\r\nowner\r\n")), "STORED\r\n");
    assert_eq!(c0.get(&k1).as_deref(), Some("owner"));

    // Binary requests are forwarded too: the forwarder's binary connection
    // logs in with the cluster secret over SASL (mechanism MBAL-PEER).
    let mut b0 = TConn::raw(cl.addr(0), &cl.tls);
    assert_eq!(b0.bin(0x21, "PLAIN", &[], b"\0app\0pw").0, 0, "SASL PLAIN login");
    assert_eq!(b0.bin(0x01, &k1, &[0; 8], b"binary").0, 0, "binary set forwarded");
    assert_eq!(b0.bin(0x00, &k1, &[], &[]), (0, b"binary".to_vec()), "binary get forwarded");
    assert_eq!(c1.get(&k1).as_deref(), Some("binary"));
    // A binary client without the secret gets nowhere with MBAL-PEER.
    let mut b1 = TConn::raw(cl.addr(1), &cl.tls);
    let (st, nonce) = b1.bin(0x21, "MBAL-PEER", &[], &[]);
    assert_eq!((st, nonce.len()), (0x21, 32), "a nonce to answer");
    assert_eq!(b1.bin(0x22, "MBAL-PEER", &[], b"00").0, 0x20);

    // A hot key of server 0 copied to server 1 over TLS by the replicator.
    let (k0, w) = cl.key_on(0, "hot");
    assert_eq!(c0.cmd(&format!("set {k0} 0 0 3\r\nhot\r\n")), "STORED\r\n");
    c0.peer();
    assert_eq!(c0.cmd(&format!("mbal debug hot {k0} 1\r\n")), "OK\r\n");
    let (s, cw) = replica_location(key_hash(k0.as_bytes()), 1, (0, w), 2, |_| WORKERS).unwrap();
    assert_eq!(s, 1);
    // Read the copy at the shadow worker: a member's connection, logged in
    // with `mbal peer` alone (no -Y login), handed to the shadow worker.
    let mut shadow = TConn::open(cl.addr(1), &cl.tls).unwrap();
    shadow.peer();
    assert!(shadow.cmd(&format!("mbal hello 0 {cw}\r\n")).starts_with(&format!("MBAL 1 {cw} ")));
    let deadline = Instant::now() + Duration::from_secs(20);
    while shadow.get(&k0).as_deref() != Some("hot") {
        assert!(Instant::now() < deadline, "the copy never reached the shadow");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A write at home travels to the copy too.
    assert_eq!(c0.cmd(&format!("set {k0} 0 0 4\r\nhot2\r\n")), "STORED\r\n");
    let deadline = Instant::now() + Duration::from_secs(20);
    while shadow.get(&k0).as_deref() != Some("hot2") {
        assert!(Instant::now() < deadline, "the write never reached the copy");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The members' connections were TLS: the servers count no failed
    // handshakes, and the forwarder no errors.
    let stats = c0.cmd("stats\r\n");
    let mut all = vec![stats];
    loop {
        let l = c0.line().unwrap();
        if l == "END\r\n" {
            break;
        }
        all.push(l);
    }
    let get = |n: &str| all.iter().find_map(|l| l.strip_prefix(&format!("STAT {n} "))).map(|v| v.trim_end().to_owned());
    assert_eq!(get("forward_errors").as_deref(), Some("0"));
    assert_eq!(get("ssl_handshake_errors").as_deref(), Some("0"));
}

#[test]
fn a_wrong_ca_or_a_missing_client_certificate_is_refused() {
    let cl = tls_cluster();
    let other = Pki::new("other");
    let load = |ca: PathBuf, cert: Option<&str>| {
        ClientTls::load(&ClientTlsFiles {
            ca_cert: ca,
            cert: cert.map(|c| cl.pki.dir.join(format!("{c}.pem"))),
            key: cert.map(|c| cl.pki.dir.join(format!("{c}.key"))),
            server_name: None,
        })
        .unwrap()
    };
    // The server's certificate is not signed by the CA the client trusts.
    assert!(TConn::open(cl.addr(0), &load(other.ca(), Some("peer"))).is_err());
    // verify_mode 2: no client certificate, no connection.
    assert!(TConn::open(cl.addr(0), &load(cl.pki.ca(), None)).is_err());
    // A client certificate from another CA neither.
    other.client("stranger");
    let stranger = ClientTls::load(&ClientTlsFiles {
        ca_cert: cl.pki.ca(),
        cert: Some(other.dir.join("stranger.pem")),
        key: Some(other.dir.join("stranger.key")),
        server_name: None,
    })
    .unwrap();
    assert!(TConn::open(cl.addr(0), &stranger).is_err());
    // The right ones work; a dialer with the secret logs in with it.
    assert!(TConn::open(cl.addr(0), &cl.tls).is_ok());
    let d = Dialer {
        tls: Some(cl.tls.clone()),
        secret: Some(peer_auth::Secret::new(SECRET.as_bytes().to_vec()).unwrap()),
        user: None,
        timeout: Duration::from_secs(5),
    };
    let s = d.dial(cl.addr(1), Proto::Text).unwrap();
    let mut c = TConn { r: BufReader::new(s) };
    // (Not `CLIENT_ERROR unauthenticated`: `mbal peer` counted as the login.)
    assert_eq!(c.cmd("get k\r\n"), "END\r\n");
    let wrong = Dialer { secret: Some(peer_auth::Secret::new(b"not the secret, 16+ bytes".to_vec()).unwrap()), ..d };
    assert!(wrong.dial(cl.addr(1), Proto::Text).is_err());
}

/// A member that accepts TCP connections and never answers must not stall
/// the forwarder: the TLS dial runs off its loop, so requests for a live
/// member are forwarded (and answered) while the silent one's wait, and
/// those get `SERVER_ERROR forwarding failed: owner unavailable`.
#[test]
fn a_silent_member_does_not_stall_the_forwarder() {
    let pki = Pki::new("fwd-silent");
    pki.server("member");
    pki.client("peer");
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ls: Vec<_> = (0..2).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs = [ls[0].local_addr().unwrap(), silent.local_addr().unwrap(), ls[1].local_addr().unwrap()];
    let spec = ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 1024,
        cachelets_per_worker: 4,
        workers: 1,
        servers: addrs.iter().map(|&addr| ServerSpec { addr, worker_port_base: None }).collect(),
        secret: None,
        secret_file: None,
        tls: Some(TlsSpec {
            ca_cert: "ca.pem".into(),
            cert: Some("member.pem".into()),
            key: Some("member.key".into()),
            client_cert: Some("peer.pem".into()),
            client_key: Some("peer.key".into()),
            ..TlsSpec::default()
        }),
    };
    drop(ls);
    let file = pki.dir.join("cluster.toml");
    std::fs::write(&file, spec.to_toml()).unwrap();
    let cf = ClusterFile::load(&file).unwrap();
    let servers: Vec<ServerHandle> = [0u16, 2]
        .into_iter()
        .map(|id| {
            let mut s = settings(1);
            s.apply_cluster(cf.spec.clone(), id).unwrap();
            s.worker_port_base = None;
            s.tls = Some(cf.spec.tls.as_ref().unwrap().server_files(cf.dir.as_deref()).unwrap());
            s.peer_tls = cf.client_tls.clone();
            s.hot.enabled = false;
            s.balancer = false;
            s.forward = id == 0;
            s.forward_timeout_ms = 3000;
            mbal_server::start(s).expect("server starts")
        })
        .collect();
    let tls = cf.client_tls.clone().unwrap();
    let map = cf.spec.initial_map();
    let key_on = |s: u16| (0..).map(|i| format!("q{i}")).find(|k| map.route(key_hash(k.as_bytes())).1 == s).unwrap();
    // A: a key of the silent member; the forwarder's dial hangs in the TLS handshake.
    let mut a = TConn::open(servers[0].main_addr, &tls).unwrap();
    a.send(format!("get {}\r\n", key_on(1)).as_bytes()).unwrap();
    // B, after A: a key of the live member 2, forwarded and answered first.
    let mut b = TConn::open(servers[0].main_addr, &tls).unwrap();
    assert_eq!(b.cmd(&format!("set {} 0 0 1\r\nx\r\n", key_on(2))), "STORED\r\n");
    // A's answer has not come yet (its socket holds no byte), then it is the error.
    let sock = a.r.get_ref().sock();
    sock.set_nonblocking(true).unwrap();
    let mut one = [0u8; 1];
    let early = sock.peek(&mut one);
    assert!(matches!(&early, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock), "A answered first: {early:?}");
    sock.set_nonblocking(false).unwrap();
    assert_eq!(a.line().unwrap(), "SERVER_ERROR forwarding failed: owner unavailable\r\n");
    drop(silent);
    for s in servers {
        s.shutdown();
    }
}
