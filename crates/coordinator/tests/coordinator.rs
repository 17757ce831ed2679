//! A coordinator in-process on 127.0.0.1:0, spoken to over real sockets by
//! fake servers: registration, heartbeats, a failure and its reassignment,
//! a restart on the same data directory, logins, bad input, TLS.

use mbal_cluster::ClusterMap;
use mbal_coordinator::{start, Settings, Timing};
use mbal_member::dial::{Dialer, Proto};
use mbal_member::peer_auth::Secret;
use mbal_member::{ClusterFile, ClusterSpec, ServerSpec};
use mbal_proto::client::{Expect, Reply, ReplyReader};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

const SECRET: &str = "a cluster secret of 32 bytes....";

fn spec(servers: u16) -> ClusterSpec {
    ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 256,
        cachelets_per_worker: 4,
        workers: 2,
        servers: (0..servers)
            .map(|i| ServerSpec {
                addr: format!("127.0.0.1:{}", 20000 + 100 * i).parse().unwrap(),
                worker_port_base: Some(20001 + 100 * i),
            })
            .collect(),
        secret: Some(Secret::new(SECRET.as_bytes().to_vec()).unwrap()),
        secret_file: None,
        tls: None,
    }
}

fn settings(dir: &Path, spec: &ClusterSpec) -> Settings {
    Settings {
        secret: spec.secret.clone(),
        timing: Timing {
            beat: Duration::from_millis(100),
            lease: Duration::from_millis(400),
            failure_timeout: Duration::from_millis(1000),
        },
        ..Settings::new(spec.initial_map(), "127.0.0.1:0".parse().unwrap(), dir.to_path_buf())
    }
}

/// A text connection: one request, one reply.
struct Conn<S: Read + Write> {
    r: BufReader<S>,
    replies: ReplyReader,
}

impl<S: Read + Write> Conn<S> {
    fn new(s: S) -> Conn<S> {
        Conn { r: BufReader::new(s), replies: ReplyReader::new() }
    }

    fn line(&mut self, req: &str) -> String {
        self.r.get_mut().write_all(format!("{req}\r\n").as_bytes()).unwrap();
        self.r.get_mut().flush().unwrap();
        let mut l = String::new();
        self.r.read_line(&mut l).unwrap();
        l.trim_end().to_string()
    }

    /// Lines up to `END` (not included).
    fn lines(&mut self, req: &str) -> Vec<String> {
        let mut out = vec![self.line(req)];
        for _ in 0..10_000 {
            if out.last().unwrap() == "END" {
                out.pop();
                return out;
            }
            let mut l = String::new();
            self.r.read_line(&mut l).unwrap();
            out.push(l.trim_end().to_string());
        }
        panic!("no END");
    }

    fn map(&mut self) -> ClusterMap {
        self.r.get_mut().write_all(b"mbal map\r\n").unwrap();
        self.r.get_mut().flush().unwrap();
        // Through the clients' own reply codec.
        match self.replies.read_reply(self.r.get_mut(), Expect::Line).unwrap() {
            Reply::Map { epoch, json } => {
                let m = ClusterMap::from_json(std::str::from_utf8(&json).unwrap()).unwrap();
                assert_eq!(m.epoch(), epoch);
                m
            }
            other => panic!("{other:?}"),
        }
    }

    fn stat(&mut self, name: &str) -> u64 {
        let rows = self.lines("stats");
        let row = rows.iter().find_map(|l| l.strip_prefix(&format!("STAT {name} "))).expect(name);
        row.parse().unwrap()
    }
}

fn member(addr: SocketAddr) -> Conn<mbal_tls::BlockingStream> {
    let d = Dialer {
        secret: Some(Secret::new(SECRET.as_bytes().to_vec()).unwrap()),
        ..Dialer::plain(Duration::from_secs(5))
    };
    Conn::new(d.dial(addr, Proto::Text).expect("a Dialer with the secret logs in"))
}

fn anonymous(addr: SocketAddr) -> Conn<std::net::TcpStream> {
    let s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    Conn::new(s)
}

#[test]
fn a_silent_server_goes_down_its_cachelets_move_and_the_map_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(2);
    let h = start(settings(dir.path(), &spec)).unwrap();
    let mut c = member(h.addr());
    assert_eq!(
        c.line("mbal register 0 127.0.0.1:20000 2 127.0.0.1:20001,127.0.0.1:20002 1048576"),
        "REGISTERED 0 1 100 400"
    );
    assert_eq!(
        c.line("mbal register - 127.0.0.1:20100 2 127.0.0.1:20101,127.0.0.1:20102 1048576"),
        "REGISTERED 1 1 100 400"
    );
    let before = c.map();
    assert_eq!(before.epoch(), 1);
    assert_eq!(before.cachelets_of(1, 0).len(), 4);
    // Server 0 beats; server 1 is silent: poll until the coordinator says it is down.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(c.line("mbal beat 0 1").starts_with("BEAT "));
        let rows = c.lines("mbal members");
        assert_eq!(rows.len(), 2);
        assert!(rows[0].starts_with("MEMBER 0 127.0.0.1:20000 up 2 "), "{rows:?}");
        if rows[1].starts_with("MEMBER 1 127.0.0.1:20100 down 2 0 ") {
            break;
        }
        assert!(Instant::now() < deadline, "server 1 never went down: {rows:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let after = c.map();
    assert_eq!(after.epoch(), 2, "one epoch bump for the whole reassignment");
    assert!(after.owners().iter().all(|&(s, _)| s == 0), "everything on server 0");
    assert_eq!(after.cachelets_of(0, 0).len(), 8);
    assert_eq!(c.line("mbal beat 1 1"), "GONE 1");
    assert_eq!(c.stat("failures_detected"), 1);
    assert_eq!(c.stat("servers_down"), 1);
    assert!(c.stat("state_writes") >= 3);
    // A join takes its share with one bump; a stolen id is refused.
    assert_eq!(c.line("mbal register - 127.0.0.1:20200 2 - 0"), "REGISTERED 2 3 100 400");
    // Written before the reply.
    let on_disk: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("state.json")).unwrap()).unwrap();
    assert_eq!(on_disk["map"]["epoch"], 3);
    assert_eq!(on_disk["members"][1]["state"], "down");
    assert_eq!(c.line("mbal register 0 127.0.0.1:29999 2 - 0"), "CLIENT_ERROR server 0 is 127.0.0.1:20000");
    assert_eq!(c.stat("register_refused"), 1);
    let joined = c.map();
    assert_eq!(joined.cachelets_of(2, 0).len() + joined.cachelets_of(2, 1).len(), 8);
    assert_eq!(joined.worker_addr(2, 1), "127.0.0.1:20200".parse().unwrap(), "`-`: workers through main");
    drop(c);
    h.shutdown();

    // A restart on the same data directory: the map and its epoch survive.
    // (A long failure timeout now: the fake servers stop beating.)
    let mut again = settings(dir.path(), &spec);
    again.timing.failure_timeout = Duration::from_secs(600);
    let h = start(again).unwrap();
    let mut c = anonymous(h.addr());
    assert_eq!(c.map(), joined);
    let rows = c.lines("mbal members");
    assert_eq!(rows.len(), 3);
    assert!(rows[1].starts_with("MEMBER 1 127.0.0.1:20100 down 2 0 -"), "{rows:?}");
    // Without the secret: reads yes, changes no.
    assert_eq!(c.line("mbal register - 127.0.0.1:20300 2 - 0"), "CLIENT_ERROR authenticate with mbal peer first");
    assert_eq!(c.line("mbal leave 0"), "CLIENT_ERROR authenticate with mbal peer first");
    assert!(c.line("mbal peer").starts_with("NONCE "));
    assert_eq!(c.line(&format!("mbal peer {}", "00".repeat(32))), "CLIENT_ERROR bad peer credentials");
    assert_eq!(c.line("mbal beat 0 3"), "CLIENT_ERROR authenticate with mbal peer first");
    assert_eq!(c.stat("auth_refused"), 3);
    assert_eq!(c.map(), joined, "nothing changed");
    assert!(c.line("version").starts_with("VERSION "));
    assert_eq!(c.line("bogus"), "ERROR");
    assert_eq!(c.stat("bad_commands"), 1);
    // Malformed arguments get the usage.
    let mut m = member(h.addr());
    assert!(m.line("mbal register x").starts_with("CLIENT_ERROR usage: mbal register"));
    assert!(m.line("mbal moved 0 1").starts_with("CLIENT_ERROR usage: mbal moved"));
    assert_eq!(m.line("mbal beat 9 1"), "CLIENT_ERROR no server 9");
    // A local move, then a leave.
    let cl = joined.cachelets_of(0, 0)[0];
    assert_eq!(m.line(&format!("mbal moved 0 {cl} 1")), "OK 4");
    assert!(m.line(&format!("mbal moved 2 {cl} 1")).starts_with("CLIENT_ERROR cachelet"));
    assert_eq!(m.line("mbal leave 2"), "OK 5");
    // A refresh asks with the epoch it has: no JSON unless the map is newer.
    m.r.get_mut().write_all(b"mbal map 5\r\nmbal map 6\r\nmbal map x\r\nmbal map 4\r\n").unwrap();
    let mut next = || {
        let mut l = String::new();
        m.r.read_line(&mut l).unwrap();
        l.trim_end().to_string()
    };
    assert_eq!([next(), next(), next(), next()], ["MAP 5 0", "", "MAP 5 0", ""]);
    assert_eq!(next(), "CLIENT_ERROR usage: mbal map [<epoch you have>]");
    let head = next();
    assert!(head.starts_with("MAP 5 ") && head != "MAP 5 0", "{head}: the map of epoch 5 for epoch 4");
    let n: usize = head.split_whitespace().nth(2).unwrap().parse().unwrap();
    let mut body = vec![0; n + 2];
    m.r.read_exact(&mut body).unwrap();
    assert_eq!(m.line("mbal beat 9 1"), "CLIENT_ERROR no server 9", "the stream is in step");
    assert_eq!(m.line("mbal leave 0"), "SERVER_ERROR no other server to take its cachelets");
    assert!(m.map().owners().iter().all(|&(s, _)| s == 0));
    // An oversized line: refused, then the connection is closed.
    let mut big = anonymous(h.addr());
    let long = format!("mbal map {}", "x".repeat(5000));
    assert_eq!(big.line(&long), "CLIENT_ERROR line too long");
    let mut rest = String::new();
    assert_eq!(big.r.read_line(&mut rest).unwrap_or(0), 0, "closed");
    drop((c, m, big));
    h.shutdown();
}

#[test]
fn bad_settings_and_another_clusters_state_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = settings(dir.path(), &spec(2));
    s.timing.lease = s.timing.failure_timeout;
    let e = start(s).err().expect("lease >= failure timeout");
    assert!(e.to_string().contains("failure timeout"), "{e}");
    let h = start(settings(dir.path(), &spec(2))).unwrap();
    let e = start(settings(dir.path(), &spec(2))).err().expect("a second coordinator on the directory");
    assert!(e.to_string().contains("another coordinator"), "{e}");
    h.shutdown();
    // Three servers: another cachelet count than the stored state's.
    let e = start(settings(dir.path(), &spec(3))).err().expect("another cluster");
    assert!(e.to_string().contains("cachelets"), "{e}");
}

#[test]
fn over_tls_a_dialer_from_the_cluster_file_logs_in() {
    let pki = mbal_tls::test_certs::Pki::new("coord");
    pki.server("member");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.toml");
    let text = format!(
        "workers = 1\ncachelets_per_worker = 2\nvn_count = 64\nsecret = \"{SECRET}\"\n[[servers]]\naddr = \"127.0.0.1:20000\"\n\
         [tls]\nca_cert = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\n",
        pki.ca().display(),
        pki.dir.join("member.pem").display(),
        pki.dir.join("member.key").display()
    );
    std::fs::write(&file, text).unwrap();
    let cf = ClusterFile::load(&file).unwrap();
    let s = Settings::from_cluster_file(&cf, "127.0.0.1:0".parse().unwrap(), dir.path().join("data")).unwrap();
    assert!(s.tls.is_some());
    let h = start(s).unwrap();
    let d = Dialer { tls: cf.client_tls.clone(), secret: cf.secret.clone(), ..Dialer::plain(Duration::from_secs(5)) };
    let mut c = Conn::new(d.dial(h.addr(), Proto::Text).unwrap());
    assert_eq!(c.line("mbal register 0 127.0.0.1:20000 1 - 0"), "REGISTERED 0 1 100 400");
    assert_eq!(c.map().epoch(), 1);
    // Plain TCP gets no answer in the clear.
    let mut plain = anonymous(h.addr());
    plain.r.get_mut().write_all(b"mbal map\r\n").unwrap();
    let mut l = String::new();
    assert!(plain.r.read_line(&mut l).map_or(true, |_| !l.starts_with("MAP")), "{l:?}");
    drop((c, plain));
    h.shutdown();
}
