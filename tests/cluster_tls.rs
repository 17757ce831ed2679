//! `mbal cluster up --tls-* --secret-file`: the cluster file it writes has
//! `[tls]` and the secret, its members listen with TLS (with -Y, passed
//! with --server-arg) and the tools that read the file (`mbal stats
//! --cluster`, `mbal top --cluster`, `mbal proxy --cluster`) talk TLS to
//! them, and the proxy logs in upstream. Real processes, real handshakes.

use mbal_tls::test_certs::Pki;
use mbal_tls::{BlockingStream, ClientTls, ClientTlsFiles};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::Duration;

mod common;
use common::{cluster_up, mbal, Kill};

/// Start `mbal cluster up` with TLS (verify_mode 2), a secret and -Y; the
/// servers' addresses once they listen.
fn tls_cluster(pki: &Pki) -> (Kill, Vec<String>, std::path::PathBuf) {
    tls_cluster_with(pki, &[])
}

fn tls_cluster_with(pki: &Pki, extra: &[&str]) -> (Kill, Vec<String>, std::path::PathBuf) {
    pki.server("member");
    pki.client("peer");
    std::fs::write(pki.dir.join("secret"), "a cluster secret of 32 bytes....\n").unwrap();
    std::fs::write(pki.dir.join("users"), "app:pw\n").unwrap();
    let file = pki.dir.join("cluster.toml");
    let p = |f: &str| pki.dir.join(f).to_str().unwrap().to_string();
    let mut up = mbal();
    up.args(["cluster", "up", "--servers", "2", "--workers", "2", "-m", "16", "--file", &p("cluster.toml")])
        .args(["--tls-ca", &p("ca.pem"), "--tls-cert", &p("member.pem"), "--tls-key", &p("member.key")])
        .args(["--tls-verify-mode", "2", "--tls-client-cert", &p("peer.pem"), "--tls-client-key", &p("peer.key")])
        .args(["--secret-file", &p("secret")])
        .arg(format!("--server-arg=-Y{}", p("users")))
        .args(extra);
    let (guard, addrs) = cluster_up(up, 2);
    (guard, addrs, file)
}

#[test]
fn cluster_up_with_tls_and_the_tools_that_read_its_file() {
    let pki = Pki::new("up");
    let (_up, addrs, file) = tls_cluster(&pki);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("[tls]") && text.contains("verify_mode = 2") && text.contains("secret_file"), "{text}");
    // A plaintext client gets nowhere: the members speak TLS only.
    let mut plain = TcpStream::connect(&addrs[0]).unwrap();
    plain.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    plain.write_all(b"version\r\n").unwrap();
    let mut buf = [0u8; 64];
    assert!(!matches!(plain.read(&mut buf), Ok(n) if n > 0 && buf.starts_with(b"VERSION")));

    let stats = mbal().args(["stats", "--cluster", file.to_str().unwrap(), "--interval", "0.1"]).output().unwrap();
    let out = String::from_utf8_lossy(&stats.stdout);
    assert!(stats.status.success(), "{out}\n{}", String::from_utf8_lossy(&stats.stderr));
    let top = mbal().args(["top", "--cluster", file.to_str().unwrap(), "--iterations", "1"]).output().unwrap();
    let out = String::from_utf8_lossy(&top.stdout);
    assert!(top.status.success(), "{out}\n{}", String::from_utf8_lossy(&top.stderr));
    assert!(out.contains("mbal top: 2 servers, 4 workers"), "{out}");
}

/// The same cluster under a coordinator: the coordinator listens with the cluster's TLS
/// (client certificates required) and the secret; the servers register and beat over it, the
/// tools read its members table over it, and the members serve (a server answers only once
/// registered: `cluster up` waits for that).
#[test]
fn a_tls_cluster_under_a_coordinator() {
    let pki = Pki::new("coord");
    let (_up, addrs, file) = tls_cluster_with(&pki, &["--coordinator"]);
    let text = std::fs::read_to_string(&file).unwrap();
    let coord = text
        .lines()
        .find_map(|l| l.strip_prefix("coordinators = [\"").and_then(|r| r.split('"').next()))
        .unwrap_or_else(|| panic!("no coordinators in\n{text}"))
        .to_string();
    // Past the failure timeout (600 ms) from the coordinator's start, a server that could not
    // register or beat over TLS would be down; both are up, their last heartbeats recent.
    let started = std::time::Instant::now();
    let out = loop {
        let members = mbal()
            .args(["cluster", "members", "--coordinator", &coord, "--cluster", file.to_str().unwrap()])
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&members.stdout).into_owned();
        assert!(members.status.success(), "{out}\n{}", String::from_utf8_lossy(&members.stderr));
        if started.elapsed() > Duration::from_millis(1500) {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(out.contains("servers up 2"), "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit())).collect();
    assert_eq!(rows.len(), 2, "{out}");
    for row in rows {
        assert!(row.contains(" up "), "{out}");
        let age: u64 = row.split_whitespace().last().unwrap().parse().unwrap();
        assert!(age < 500, "a heartbeat {age} ms ago: {out}");
    }
    // Heartbeats go on over TLS: the servers' stats count them (through the tools, over TLS).
    let stats = mbal().args(["stats", "--cluster", file.to_str().unwrap(), "--interval", "0.1"]).output().unwrap();
    assert!(stats.status.success(), "{}", String::from_utf8_lossy(&stats.stderr));
    // A plaintext connection to the coordinator gets no answer in the clear.
    let mut plain = TcpStream::connect(&coord).unwrap();
    plain.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    plain.write_all(b"mbal members\r\n").unwrap();
    let mut buf = [0u8; 64];
    assert!(!matches!(plain.read(&mut buf), Ok(n) if n > 0 && buf.starts_with(b"MEMBER")));
    assert_eq!(addrs.len(), 2);
}

/// `mbal proxy --cluster FILE -Z -o ssl_*` with a login; its address.
fn proxy(pki: &Pki, file: &std::path::Path, password: &str) -> (Kill, String) {
    let pw = pki.dir.join(format!("pw-{password}"));
    std::fs::write(&pw, format!("{password}\n")).unwrap();
    let p = |f: &str| pki.dir.join(f).to_str().unwrap().to_string();
    let mut child = mbal()
        .args(["proxy", "--cluster", file.to_str().unwrap(), "-l", "127.0.0.1", "-p", "0", "-t", "1", "--print-ports"])
        .args(["-Z", "-o", &format!("ssl_chain_cert={},ssl_key={}", p("member.pem"), p("member.key"))])
        .args(["--user", "app", "--password-file", pw.to_str().unwrap(), "--upstream-timeout-ms", "3000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("mbal proxy");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    (Kill(child), v["main"].as_str().unwrap().to_string())
}

struct TConn(BufReader<BlockingStream>);

impl TConn {
    fn open(addr: &str, pki: &Pki) -> TConn {
        let tls = ClientTls::load(&ClientTlsFiles { ca_cert: pki.ca(), ..Default::default() }).unwrap();
        let s = mbal_tls::dial(addr.parse().unwrap(), Some(&tls), Duration::from_secs(10)).unwrap();
        TConn(BufReader::new(s))
    }
    fn send(&mut self, b: &[u8]) {
        self.0.get_mut().write_all(b).unwrap();
        self.0.get_mut().flush().unwrap();
    }
    fn line(&mut self) -> String {
        let mut l = String::new();
        self.0.read_line(&mut l).unwrap();
        l
    }
    fn cmd(&mut self, c: &str) -> String {
        self.send(c.as_bytes());
        self.line()
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
        self.send(&req);
        let mut h = [0u8; 24];
        self.0.read_exact(&mut h).unwrap();
        let len = u32::from_be_bytes([h[8], h[9], h[10], h[11]]) as usize;
        let mut rest = vec![0; len];
        self.0.read_exact(&mut rest).unwrap();
        let skip = h[4] as usize + u16::from_be_bytes([h[2], h[3]]) as usize;
        (u16::from_be_bytes([h[6], h[7]]), rest[skip..].to_vec())
    }
}

#[test]
fn the_proxy_speaks_tls_on_both_sides_and_logs_in_upstream() {
    let pki = Pki::new("proxy");
    let (_up, _addrs, file) = tls_cluster(&pki);
    let (_p, addr) = proxy(&pki, &file, "pw");
    let mut c = TConn::open(&addr, &pki);
    // Keys of both servers (64 keys: both are all but certain to be hit).
    for i in 0..64 {
        assert_eq!(c.cmd(&format!("set k{i} 0 0 2\r\nv{}\r\n", i % 10)), "STORED\r\n", "k{i}");
    }
    for i in 0..64 {
        assert_eq!(c.cmd(&format!("get k{i}\r\n")), format!("VALUE k{i} 0 2\r\n"));
        assert_eq!(c.line(), format!("v{}\r\n", i % 10));
        assert_eq!(c.line(), "END\r\n");
    }
    // Binary clients too: the binary upstreams log in with SASL PLAIN.
    let mut b = TConn::open(&addr, &pki);
    for i in 0..16 {
        assert_eq!(b.bin(0x01, &format!("b{i}"), &[0; 8], b"bin").0, 0, "binary set b{i}");
        let (st, v) = b.bin(0x00, &format!("b{i}"), &[], &[]);
        assert_eq!((st, v.as_slice()), (0, &b"bin"[..]), "binary get b{i}");
    }
    // A proxy whose upstream login fails answers at once, and says why.
    let (_bad, bad_addr) = proxy(&pki, &file, "wrong");
    let mut c = TConn::open(&bad_addr, &pki);
    assert_eq!(c.cmd("get k1\r\n"), "SERVER_ERROR upstream unavailable\r\n");
    let mut b = TConn::open(&bad_addr, &pki);
    let (st, v) = b.bin(0x00, "k1", &[], &[]);
    assert_eq!(st, 0x86, "{}", String::from_utf8_lossy(&v));
}

/// A member that accepts TCP connections and never answers (the kernel
/// completes the handshake; TLS then waits forever) must not stall the
/// proxy thread: at the timeout it is unreachable and its clients' reads are
/// misses (docs/operations.md, "A dead server"), and the other members' keys
/// are served meanwhile, first.
#[test]
fn a_silent_member_does_not_stall_the_proxy_thread() {
    use mbal_cluster::key_hash;
    use mbal_member::{ClusterSpec, ServerSpec, TlsSpec};
    let pki = Pki::new("silent");
    pki.server("member");
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let spec = ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 1024,
        cachelets_per_worker: 4,
        workers: 1,
        servers: [free.local_addr().unwrap(), silent.local_addr().unwrap()]
            .into_iter()
            .map(|addr| ServerSpec { addr, worker_port_base: None })
            .collect(),
        secret: None,
        secret_file: None,
        tls: Some(TlsSpec {
            ca_cert: "ca.pem".into(),
            cert: Some("member.pem".into()),
            key: Some("member.key".into()),
            ..TlsSpec::default()
        }),
    };
    drop(free);
    let file = pki.dir.join("cluster.toml");
    std::fs::write(&file, spec.to_toml()).unwrap();
    let member = mbal()
        .args(["server", "--cluster", file.to_str().unwrap(), "--id", "0", "-m", "16", "--print-ports"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut member = Kill(member);
    let mut line = String::new();
    BufReader::new(member.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.contains("main"), "{line:?}");
    let mut child = mbal()
        .args(["proxy", "--cluster", file.to_str().unwrap(), "-l", "127.0.0.1", "-p", "0", "-t", "1", "--print-ports"])
        .args(["--upstream-timeout-ms", "3000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let _proxy = Kill(child);
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    let addr: std::net::SocketAddr = v["main"].as_str().unwrap().parse().unwrap();
    let map = spec.initial_map();
    let key_on = |s: u16| (0..).map(|i| format!("s{i}")).find(|k| map.route(key_hash(k.as_bytes())).1 == s).unwrap();
    let plain = |a| {
        let s = std::net::TcpStream::connect(a).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s
    };
    // A asks for a key of the silent member: the dial hangs in its TLS handshake.
    let mut a = plain(addr);
    a.write_all(format!("get {}\r\n", key_on(1)).as_bytes()).unwrap();
    // B, after A, for a key of the live member: answered while A still waits.
    let mut b = BufReader::new(plain(addr));
    b.get_mut().write_all(format!("get {}\r\n", key_on(0)).as_bytes()).unwrap();
    let mut got = String::new();
    b.read_line(&mut got).unwrap();
    assert_eq!(got, "END\r\n");
    a.set_nonblocking(true).unwrap();
    let mut one = [0u8; 1];
    let early = a.peek(&mut one);
    assert!(matches!(&early, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock), "A answered first: {early:?}");
    a.set_nonblocking(false).unwrap();
    let mut r = BufReader::new(a);
    let mut got = String::new();
    r.read_line(&mut got).unwrap();
    assert_eq!(got, "END\r\n", "a miss");
    drop(silent);
    let _ = member.0.kill();
}
