//! `mbal proxy` against REAL mbal servers started in-process on loopback:
//! replies equal a single server's, bad input, a multi-get spanning every
//! server, cachelet moves mid-pipeline, an upstream killed mid-pipeline and
//! one that stalls.

use mbal_cluster::{key_hash, ClusterMap};
use mbal_member::{ClusterSpec, ServerSpec};
use mbal_proxy::{Config, ProxyHandle};
use mbal_server::config::Settings;
use mbal_server::ServerHandle;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const WORKERS: u16 = 2;

/// The tests run one at a time: one of them kills a server and starts it
/// again on the same port, which a cluster of a test running alongside
/// could have taken in between (and its proxy would then talk to that one).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

struct Cluster {
    spec: ClusterSpec,
    servers: Vec<Option<ServerHandle>>,
}

fn server_settings(spec: &ClusterSpec, id: u16) -> Settings {
    let mut s = Settings { memory_limit: 32 << 20, ..Settings::default() };
    s.apply_cluster(spec.clone(), id).unwrap();
    s
}

impl Cluster {
    /// `n` servers of two workers on free loopback ports, one port each
    /// (routed connections reach a worker with `mbal hello`).
    fn start(n: usize) -> Cluster {
        for _ in 0..10 {
            let spec = free_spec(n);
            let mut servers = Vec::new();
            for id in 0..n as u16 {
                match mbal_server::start(server_settings(&spec, id)) {
                    Ok(h) => servers.push(Some(h)),
                    Err(_) => break,
                }
            }
            if servers.len() == n {
                return Cluster { spec, servers };
            }
            for s in servers.into_iter().flatten() {
                s.shutdown();
            }
        }
        panic!("could not start a cluster on free ports");
    }

    fn map(&self) -> ClusterMap {
        self.spec.initial_map()
    }

    fn addr(&self, id: usize) -> SocketAddr {
        self.spec.servers[id].addr
    }

    fn kill(&mut self, id: usize) {
        self.servers[id].take().unwrap().shutdown();
    }

    /// Start server `id` again on its address (retrying while the port is released).
    fn restart(&mut self, id: usize) {
        let t0 = Instant::now();
        loop {
            match mbal_server::start(server_settings(&self.spec, id as u16)) {
                Ok(h) => {
                    self.servers[id] = Some(h);
                    return;
                }
                Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                    let _ = e;
                    std::thread::yield_now();
                }
                Err(e) => panic!("restart server {id}: {e}"),
            }
        }
    }

    fn stop(self) {
        for s in self.servers.into_iter().flatten() {
            s.shutdown();
        }
    }
}

fn free_spec(n: usize) -> ClusterSpec {
    let held: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let servers = held.iter().map(|l| ServerSpec { addr: l.local_addr().unwrap(), worker_port_base: None }).collect();
    ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 1024,
        cachelets_per_worker: 4,
        workers: WORKERS,
        servers,
        secret: None,
        secret_file: None,
        tls: None,
    }
}

fn proxy(map: ClusterMap, threads: usize, timeout_ms: u64) -> ProxyHandle {
    let cfg = Config {
        threads,
        upstream_timeout: Duration::from_millis(timeout_ms),
        ..Config::new("127.0.0.1:0".parse().unwrap())
    };
    mbal_proxy::start(cfg, map).expect("proxy starts")
}

/// One standalone server: the reference the proxy's replies are compared with.
fn single_server() -> ServerHandle {
    mbal_server::start(Settings { port: 0, threads: 2, memory_limit: 32 << 20, ..Settings::default() }).unwrap()
}

struct Conn {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Conn {
    fn open(addr: SocketAddr) -> Conn {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        Conn { r: BufReader::new(s.try_clone().unwrap()), w: s }
    }

    fn send(&mut self, b: &[u8]) {
        self.w.write_all(b).expect("write");
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.r.read_line(&mut l).expect("read line");
        l
    }

    fn cmd(&mut self, c: &str) -> String {
        self.send(c.as_bytes());
        self.line()
    }

    fn exact(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.r.read_exact(&mut v).expect("read exact");
        v
    }

    /// Lines up to END (without it).
    fn until_end(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        loop {
            let l = self.line();
            assert!(!l.is_empty(), "closed before END; got {out:?}");
            if l == "END\r\n" {
                return out;
            }
            out.push(l);
        }
    }

    /// A get reply's values: (key, data), or the error line.
    fn values(&mut self) -> Result<Vec<(String, Vec<u8>)>, String> {
        let mut out = Vec::new();
        loop {
            let l = self.line();
            if l == "END\r\n" {
                return Ok(out);
            }
            if !l.starts_with("VALUE ") {
                return Err(l);
            }
            let p: Vec<&str> = l.split_whitespace().collect();
            let n: usize = p[3].parse().unwrap();
            let d = self.exact(n + 2);
            out.push((p[1].to_string(), d[..n].to_vec()));
        }
    }

    /// Send a get request and read its values.
    fn cmd_values(&mut self, c: &str) -> Result<Vec<(String, Vec<u8>)>, String> {
        self.send(c.as_bytes());
        self.values()
    }

    /// Send `script` then a sentinel (a miss no script has), and read
    /// everything up to the sentinel's reply.
    fn transcript(&mut self, script: &[u8]) -> Vec<u8> {
        const END: &[u8] = b"EN Oend k__end__\r\n";
        self.send(script);
        self.send(b"mg __end__ Oend k\r\n");
        let mut out = Vec::new();
        let mut b = [0u8; 4096];
        while !out.ends_with(END) {
            let n = self.r.read(&mut b).expect("read");
            assert!(n > 0, "closed; so far {:?}", String::from_utf8_lossy(&out));
            out.extend_from_slice(&b[..n]);
        }
        out
    }

    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.r.read(&mut b), Ok(0) | Err(_))
    }
}

fn stats(c: &mut Conn, group: &str) -> Vec<(String, String)> {
    let cmd = if group.is_empty() { "stats\r\n".to_string() } else { format!("stats {group}\r\n") };
    c.send(cmd.as_bytes());
    c.until_end()
        .into_iter()
        .map(|l| {
            let mut it = l.trim_end().splitn(3, ' ');
            assert_eq!(it.next(), Some("STAT"), "{l}");
            (it.next().unwrap().to_string(), it.next().unwrap_or("").to_string())
        })
        .collect()
}

/// A stat that may not be listed yet (0 then).
fn stat_or0(all: &[(String, String)], name: &str) -> u64 {
    all.iter().find(|(k, _)| k == name).map_or(0, |(_, v)| v.parse().unwrap())
}

fn stat(all: &[(String, String)], name: &str) -> u64 {
    all.iter().find(|(k, _)| k == name).unwrap_or_else(|| panic!("no stat {name}")).1.parse().unwrap()
}

/// Keys that together land on every worker of every server.
fn keys_everywhere(map: &ClusterMap, per_worker: usize) -> Vec<String> {
    let mut seen = std::collections::HashMap::new();
    let mut out = Vec::new();
    for i in 0.. {
        let k = format!("key:{i}");
        let (_, s, w) = map.route(key_hash(k.as_bytes()));
        let n = seen.entry((s, w)).or_insert(0usize);
        if *n < per_worker {
            *n += 1;
            out.push(k);
        }
        if seen.len() == map.servers().len() * WORKERS as usize && seen.values().all(|&n| n == per_worker) {
            return out;
        }
    }
    unreachable!()
}

/// Text and meta commands on keys spread over every worker of every server;
/// no CAS values or access times (they differ between any two servers).
fn script(keys: &[String]) -> Vec<u8> {
    let mut s = String::new();
    for (i, k) in keys.iter().enumerate() {
        s += &format!("set {k} {i} 0 {}\r\nv{i}\r\n", 1 + i.to_string().len());
    }
    let all = keys.join(" ");
    s += &format!("get {all} nokey1 {} nokey2\r\n", keys[0]);
    s += &format!("gat 100 {} nokey {}\r\n", keys[1], keys[2]);
    for k in keys.iter().take(4) {
        s += &format!("add {k} 0 0 1\r\nx\r\nreplace {k} 0 0 2\r\nyy\r\nappend {k} 0 0 1\r\na\r\n");
        s += &format!("prepend {k} 0 0 1\r\np\r\nget {k}\r\ncas {k} 0 0 1 1\r\nz\r\ntouch {k} 10\r\n");
        s += &format!("set {k}n 0 0 1 noreply\r\n5\r\nincr {k}n 10\r\ndecr {k}n 3\r\nincr {k} 1\r\n");
        s += &format!("delete {k}n\r\ndelete {k}n\r\nincr {k}n 1\r\ntouch {k}n 1\r\ncas {k}n 0 0 1 1\r\nz\r\n");
        s += &format!("delete {k} noreply\r\nget {k}\r\nadd {k} 3 0 2 noreply\r\nab\r\nget {k}\r\n");
        // meta
        s += &format!("ms {k}m 3 T0 F7\r\nabc\r\nmg {k}m v f k Oop s\r\nmg {k}x v Oq1 q\r\nmg {k}m q v k\r\n");
        s += &format!("ma {k}x N0 J13 v\r\nma {k}x MD D3 v\r\nma {k}x q\r\nmd {k}x q\r\nmd {k}x q Oz\r\n");
        s += &format!("ms {k}m 1 MA\r\nz\r\nmg {k}m v\r\nms {k}y 1 ME\r\n1\r\nms {k}y 1 ME\r\n2\r\nmg {k}y v t\r\n");
        s += &format!("md {k}m\r\nmg {k}m v\r\nmn\r\nms {k}q 2 q\r\nqq\r\nmg {k}q v\r\n");
    }
    // the same keys, base64 (`b`): routed by the decoded key
    s += &format!("ms {} 2 b\r\nbb\r\nmg {} b v k\r\n", b64(&keys[3]), b64(&keys[3]));
    s += &format!("get {}\r\n", keys[3]);
    s += "verbosity 1\r\nverbosity 1 noreply\r\n";
    s += &format!("get {all}\r\nflush_all\r\nget {all}\r\nflush_all noreply\r\n");
    s.into_bytes()
}

fn b64(k: &str) -> String {
    // a tiny encoder for the test (the proxy decodes with the real one)
    const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let b = k.as_bytes();
    let mut out = String::new();
    for ch in b.chunks(3) {
        let n = (ch[0] as u32) << 16 | (*ch.get(1).unwrap_or(&0) as u32) << 8 | *ch.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= ch.len() {
                out.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[test]
fn text_and_meta_replies_equal_a_single_servers() {
    let _serial = serial();
    let cl = Cluster::start(3);
    let p = proxy(cl.map(), 2, 2000);
    let reference = single_server();
    let keys = keys_everywhere(&cl.map(), 2);
    let s = script(&keys);
    let want = Conn::open(reference.main_addr).transcript(&s);
    let got = Conn::open(p.addr).transcript(&s);
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(&want));
    // and byte by byte: the same script fed one byte at a time
    let mut c = Conn::open(p.addr);
    for b in &s {
        c.send(std::slice::from_ref(b));
    }
    assert_eq!(String::from_utf8_lossy(&c.transcript(b"")), String::from_utf8_lossy(&want));
    // every server was asked
    let st = stats(&mut c, "proxy");
    for id in 0..3 {
        for w in 0..WORKERS {
            assert!(stat(&st, &format!("upstream:{id}:{w}:requests")) > 0, "{st:?}");
        }
    }
    assert!(stat(&stats(&mut c, ""), "cmd_get") > 0);
    assert!(c.cmd("version\r\n").starts_with("VERSION "));
    drop(p);
    reference.shutdown();
    cl.stop();
}

#[test]
fn bad_input_gets_the_same_answers_as_at_a_server() {
    let _serial = serial();
    let cl = Cluster::start(2);
    let p = proxy(cl.map(), 1, 2000);
    let reference = single_server();
    let long_key = "k".repeat(251);
    let cases: Vec<Vec<u8>> = vec![
        b"bogus\r\n".to_vec(),
        b"get\r\n".to_vec(),
        format!("get a {long_key}\r\n").into_bytes(),
        b"set a 0 0 3\r\nabcd\r\nget a\r\n".to_vec(),
        b"set a 0 0 x\r\nabc\r\n".to_vec(),
        [&b"set a 0 0 2000000\r\n"[..], &[b'x'; 2_000_000], b"\r\nget a\r\n"].concat(),
        [&b"set k2 0 0 1\r\nx\r\nset k2 0 0 2000000 noreply\r\n"[..], &[b'x'; 2_000_000], b"\r\nget k2\r\n"].concat(),
        b"incr a x\r\ndecr\r\ntouch a x\r\ndelete a 5\r\ndelete a 0 noreply\r\n".to_vec(),
        b"set n 0 0 1\r\nx\r\nincr n 1\r\n".to_vec(),
        b"mg\r\nmg a zz\r\nmg a v v\r\nms a x\r\nms a 2 MZ\r\nab\r\nma a MX\r\nmd a Q\r\n".to_vec(),
        b"mg !!!! b v\r\nmg a Oooooooooooooooooooooooooooooooooooooooo\r\n".to_vec(),
        b"verbosity x\r\nslabs automove x\r\nslabs reassign a b\r\nlru tune\r\ncache_memlimit 1\r\n".to_vec(),
        b"cache_memlimit 100\r\nslabs automove 1\r\nshutdown\r\nflush_all x\r\n".to_vec(),
        b"stats bogus\r\n".to_vec(),
        b"gat\r\ngat x a\r\ngat 1\r\n".to_vec(),
    ];
    for case in &cases {
        let want = Conn::open(reference.main_addr).transcript(case);
        let got = Conn::open(p.addr).transcript(case);
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&want),
            "input {:?}",
            String::from_utf8_lossy(&case[..case.len().min(60)])
        );
    }
    // requests that close the connection: same on both
    for case in [&b"GET / HTTP/1.1\r\n"[..], &[b'x'; 70_000][..], b"quit\r\nget a\r\n"] {
        for addr in [reference.main_addr, p.addr] {
            let mut c = Conn::open(addr);
            c.send(case);
            let mut rest = Vec::new();
            let _ = c.r.read_to_end(&mut rest);
            let line_too_long = case.len() > 60_000;
            assert_eq!(
                String::from_utf8_lossy(&rest),
                if line_too_long { "CLIENT_ERROR line too long\r\n" } else { "" },
                "{addr}"
            );
        }
    }
    // a quit after requests still answers them first
    let mut c = Conn::open(p.addr);
    c.send(b"set q 0 0 1\r\n1\r\nget q\r\nquit\r\n");
    let mut rest = Vec::new();
    c.r.read_to_end(&mut rest).unwrap();
    assert_eq!(rest, b"STORED\r\nVALUE q 0 1\r\n1\r\nEND\r\n");
    drop(p);
    reference.shutdown();
    cl.stop();
}

#[test]
fn a_long_multi_get_spans_every_server() {
    let _serial = serial();
    let cl = Cluster::start(4);
    let p = proxy(cl.map(), 2, 2000);
    let mut c = Conn::open(p.addr);
    let keys: Vec<String> = (0..600).map(|i| format!("mg:{i}")).collect();
    let mut req = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        if !i.is_multiple_of(3) {
            req.extend_from_slice(
                format!("set {k} {i} 0 {}\r\n{}\r\n", k.len() + 1, k.to_uppercase() + "!").as_bytes(),
            );
        }
    }
    c.send(&req);
    for (i, _) in keys.iter().enumerate() {
        if !i.is_multiple_of(3) {
            assert_eq!(c.line(), "STORED\r\n");
        }
    }
    // every key, a miss in three, some twice, across 4 servers x 2 workers, in chunks of
    // 150 keys on one line (a line of about 1.5 KB)
    for chunk in keys.chunks(150) {
        let mut line = String::from("get");
        for k in chunk {
            line += " ";
            line += k;
        }
        line += &format!(" {} nokey {}\r\n", chunk[1], chunk[2]);
        c.send(line.as_bytes());
    }
    for chunk in keys.chunks(150) {
        let got = c.values().unwrap();
        let mut want: Vec<(String, Vec<u8>)> = Vec::new();
        for k in chunk.iter().chain([&chunk[1], &chunk[2]]) {
            let i: usize = k[3..].parse().unwrap();
            if !i.is_multiple_of(3) {
                want.push((k.clone(), (k.to_uppercase() + "!").into_bytes()));
            }
        }
        assert_eq!(got, want);
    }
    let st = stats(&mut c, "proxy");
    for s in 0..4 {
        for w in 0..WORKERS {
            assert!(stat(&st, &format!("upstream:{s}:{w}:replies")) > 0, "{st:?}");
        }
    }
    let g = stats(&mut c, "");
    assert_eq!(stat(&g, "cmd_get"), 4 * 153);
    // large values through the proxy's buffers, both ways, pipelined
    let big: Vec<Vec<u8>> = (0..4u8).map(|i| vec![b'a' + i; 900_000 + i as usize]).collect();
    let mut req = Vec::new();
    for (i, v) in big.iter().enumerate() {
        req.extend_from_slice(format!("set big{i} 0 0 {}\r\n", v.len()).as_bytes());
        req.extend_from_slice(v);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"get big0 big1 big2 big3\r\n");
    c.send(&req);
    for _ in &big {
        assert_eq!(c.line(), "STORED\r\n");
    }
    let got = c.values().unwrap();
    let want: Vec<(String, Vec<u8>)> = big.iter().enumerate().map(|(i, v)| (format!("big{i}"), v.clone())).collect();
    assert!(got == want, "large values come back whole and in order");
    assert_eq!(stat(&g, "get_hits"), 400 + 4 * 2);
    drop(p);
    cl.stop();
}

/// Keys (of one server) whose cachelet is `c`.
fn keys_of(map: &ClusterMap, c: u32, n: usize) -> Vec<String> {
    (0..).map(|i| format!("mv:{i}")).filter(|k| map.route(key_hash(k.as_bytes())).0 == c).take(n).collect()
}

#[test]
fn cachelet_moves_mid_pipeline_lose_and_reorder_nothing() {
    let _serial = serial();
    let cl = Cluster::start(2);
    let map = cl.map();
    let p = proxy(map.clone(), 2, 5000);
    // two cachelets of server 0, one per worker, and a cachelet of server 1
    let c0 = map.cachelets_of(0, 0)[0];
    let c1 = map.cachelets_of(0, 1)[0];
    let c2 = map.cachelets_of(1, 0)[0];
    let keys: Vec<String> = [c0, c1, c2].iter().flat_map(|&c| keys_of(&map, c, 4)).collect();
    let mut admin = Conn::open(cl.addr(0));
    let mut c = Conn::open(p.addr);
    let mut moves = 0;
    for round in 0..40u32 {
        // a pipeline: write then read back every key, and one multi-get of all of them
        let mut req = Vec::new();
        for k in &keys {
            let v = format!("{k}@{round}");
            req.extend_from_slice(format!("set {k} 0 0 {}\r\n{v}\r\nget {k}\r\n", v.len()).as_bytes());
            req.extend_from_slice(format!("mg {k} v q\r\nmn\r\n").as_bytes());
        }
        req.extend_from_slice(format!("get {}\r\n", keys.join(" ")).as_bytes());
        let half = req.len() / 2;
        c.send(&req[..half]);
        // move both cachelets of server 0 to the other worker while the pipeline runs
        for (cl_id, home) in [(c0, 0), (c1, 1)] {
            let to = if round % 2 == 0 { 1 - home } else { home };
            let l = admin.cmd(&format!("mbal move {cl_id} {to}\r\n"));
            assert!(l.starts_with("MOVED "), "{l}");
            moves += 1;
        }
        c.send(&req[half..]);
        for k in &keys {
            let v = format!("{k}@{round}");
            assert_eq!(c.line(), "STORED\r\n", "round {round} key {k}");
            assert_eq!(c.values().unwrap(), vec![(k.clone(), v.clone().into_bytes())], "round {round}");
            assert_eq!(c.line(), format!("VA {}\r\n", v.len()));
            assert_eq!(c.line(), format!("{v}\r\n"));
            assert_eq!(c.line(), "MN\r\n");
        }
        let all = c.values().unwrap();
        let want: Vec<(String, Vec<u8>)> =
            keys.iter().map(|k| (k.clone(), format!("{k}@{round}").into_bytes())).collect();
        assert_eq!(all, want, "round {round}");
    }
    assert_eq!(moves, 80);
    let g = stats(&mut c, "");
    assert!(stat(&g, "proxy_redirects") > 0, "{g:?}");
    assert!(stat(&g, "proxy_map_fetches") > 0, "{g:?}");
    assert_eq!(stat(&g, "proxy_upstream_errors"), 0, "{g:?}");
    drop(p);
    cl.stop();
}

#[test]
fn an_upstream_killed_mid_pipeline_gets_misses_then_recovers() {
    let _serial = serial();
    let mut cl = Cluster::start(3);
    let map = cl.map();
    let p = proxy(map.clone(), 1, 2000);
    let keys = keys_everywhere(&map, 3);
    let on = |k: &String| map.route(key_hash(k.as_bytes())).1;
    let mut c = Conn::open(p.addr);
    for k in &keys {
        assert_eq!(c.cmd(&format!("set {k} 0 0 1\r\n1\r\n")), "STORED\r\n");
    }
    // a long pipeline; server 2 dies while it is in flight
    let rounds = 300;
    let mut req = Vec::new();
    for _ in 0..rounds {
        for k in &keys {
            req.extend_from_slice(format!("get {k}\r\n").as_bytes());
        }
    }
    let half = req.len() / 3;
    c.send(&req[..half]);
    cl.kill(2);
    let w = c.w.try_clone().unwrap();
    let rest = req[half..].to_vec();
    let writer = std::thread::spawn(move || {
        let mut w = w;
        w.write_all(&rest).unwrap();
    });
    let (mut ok, mut misses) = (0, 0);
    for _ in 0..rounds {
        for k in &keys {
            // a dead server's keys are misses (reads), never errors
            let v = c.values().unwrap();
            if v.is_empty() {
                assert_eq!(on(k), 2, "only server 2's keys miss: {k}");
                misses += 1;
            } else {
                assert_eq!(v, vec![(k.clone(), b"1".to_vec())]);
                ok += 1;
            }
        }
    }
    writer.join().unwrap();
    assert!(misses > 0, "server 2 was killed mid-pipeline");
    assert!(ok >= rounds * 6 * 2, "servers 0 and 1 answered all their keys: {ok}");
    let st = stats(&mut c, "proxy");
    assert!(stat_or0(&st, "upstream:2:0:errors") + stat_or0(&st, "upstream:2:1:errors") > 0, "{st:?}");
    // server 2 comes back on its address: after the backoff, its keys are served again
    cl.restart(2);
    let k2: Vec<&String> = keys.iter().filter(|k| on(k) == 2).collect();
    let t0 = Instant::now();
    for k in k2 {
        loop {
            c.send(format!("set {k} 0 0 1\r\n2\r\n").as_bytes());
            let l = c.line();
            if l == "STORED\r\n" {
                break;
            }
            assert_eq!(l, format!("SERVER_ERROR mbal server {} unreachable\r\n", cl.addr(2)));
            assert!(t0.elapsed() < Duration::from_secs(20), "no recovery");
            std::thread::sleep(Duration::from_millis(5)); // the proxy's backoff is time, not an event
        }
        c.send(format!("get {k}\r\n").as_bytes());
        assert_eq!(c.values(), Ok(vec![(k.clone(), b"2".to_vec())]));
    }
    drop(p);
    cl.stop();
}

/// A one-server cluster, and a map of it plus a second server that is a socket which accepts
/// and never answers (server 0 runs with a one-server map; the proxy's map has both).
fn with_a_stalled_server() -> (Cluster, TcpListener, ClusterMap) {
    let cl = Cluster::start(1);
    let stall = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut spec = cl.spec.clone();
    spec.servers.push(ServerSpec { addr: stall.local_addr().unwrap(), worker_port_base: None });
    let map = spec.initial_map();
    (cl, stall, map)
}

#[test]
fn a_stalled_upstream_times_out_into_misses_and_errors() {
    let _serial = serial();
    let (cl, stall, map) = with_a_stalled_server();
    let p = proxy(map.clone(), 1, 300);
    let k0 = (0..).map(|i| format!("a{i}")).find(|k| map.route(key_hash(k.as_bytes())).1 == 0).unwrap();
    let k1 = (0..).map(|i| format!("b{i}")).find(|k| map.route(key_hash(k.as_bytes())).1 == 1).unwrap();
    let mut c = Conn::open(p.addr);
    assert_eq!(c.cmd(&format!("set {k0} 0 0 1\r\nx\r\n")), "STORED\r\n");
    let t0 = Instant::now();
    c.send(format!("get {k1}\r\nmg {k1} v\r\nget {k0}\r\nget {k0} {k1}\r\nset {k1} 0 0 1\r\ny\r\n").as_bytes());
    // a request older than the timeout: reads are misses, writes errors naming the server
    assert_eq!(c.values(), Ok(vec![]), "a miss");
    assert_eq!(c.line(), "EN\r\n");
    assert_eq!(c.values(), Ok(vec![(k0.clone(), b"x".to_vec())]), "server 0 answers");
    assert_eq!(c.values(), Ok(vec![(k0.clone(), b"x".to_vec())]), "a multi-get with a failed part: its keys miss");
    assert_eq!(c.line(), format!("SERVER_ERROR mbal server {} unreachable\r\n", stall.local_addr().unwrap()));
    assert!(t0.elapsed() < Duration::from_secs(8), "answered, not hung");
    let st = stats(&mut c, "proxy");
    assert!(stat_or0(&st, "upstream:1:0:timeouts") + stat_or0(&st, "upstream:1:1:timeouts") > 0, "{st:?}");
    drop(stall);
    drop(p);
    cl.stop();
}

/// The replies to one client read go out in one write once all are in (an
/// upstream answering part of them does not split them), unless they pass
/// the early-flush size: then what is complete goes out first.
#[test]
fn a_read_batch_is_answered_in_one_write() {
    let _serial = serial();
    // server 1 of the map never answers: its requests end with the timeout
    let (cl, stall, map) = with_a_stalled_server();
    let p = proxy(map.clone(), 1, 1000);
    let on =
        |s: u16, p: &str| (0..).map(|i| format!("{p}{i}")).find(|k| map.route(key_hash(k.as_bytes())).1 == s).unwrap();
    let (k0, k1, big) = (on(0, "a"), on(1, "b"), on(0, "c"));
    let mut c = Conn::open(p.addr);
    assert_eq!(c.cmd(&format!("set {k0} 0 0 1\r\nx\r\n")), "STORED\r\n");
    let mut first = vec![0u8; 1 << 16];
    // one write, one read batch: server 0's reply waits for server 1's (a miss, at the timeout)
    c.send(format!("get {k0}\r\nget {k1}\r\nmn\r\n").as_bytes());
    let n = c.r.read(&mut first).unwrap();
    let got = String::from_utf8_lossy(&first[..n]).into_owned();
    assert_eq!(got, format!("VALUE {k0} 0 1\r\nx\r\nEND\r\nEND\r\nMN\r\n"), "one write with all three replies");
    // past EARLY_FLUSH, the complete replies go out without waiting for the rest (a
    // new proxy: this one refuses server 1 at once during its backoff)
    let p = proxy(map.clone(), 1, 1000);
    let mut c = Conn::open(p.addr);
    let value = vec![b'v'; 20_000];
    c.send(format!("set {big} 0 0 {}\r\n", value.len()).as_bytes());
    c.send(&value);
    assert_eq!(c.cmd("\r\n"), "STORED\r\n");
    c.send(format!("get {big}\r\nget {big}\r\nget {k1}\r\n").as_bytes());
    let mut early = Vec::new();
    while early.windows(5).filter(|w| w == b"END\r\n").count() < 2 {
        let n = c.r.read(&mut first).unwrap();
        assert!(n > 0);
        early.extend_from_slice(&first[..n]);
    }
    let ends = early.windows(5).filter(|w| w == b"END\r\n").count();
    assert_eq!(ends, 2, "the two values came before the timed-out request's miss");
    assert_eq!(c.line(), "END\r\n", "the timed-out get: a miss");
    drop(stall);
    drop(p);
    cl.stop();
}

#[test]
fn binary_and_connection_limit() {
    let _serial = serial();
    let cl = Cluster::start(1);
    let cfg = Config { max_conns: 2, ..Config::new("127.0.0.1:0".parse().unwrap()) };
    let p = mbal_proxy::start(cfg, cl.map()).unwrap();
    let mut c1 = Conn::open(p.addr);
    let mut c2 = Conn::open(p.addr);
    assert_eq!(c1.cmd("mn\r\n"), "MN\r\n");
    assert_eq!(c2.cmd("mn\r\n"), "MN\r\n");
    let mut c3 = Conn::open(p.addr);
    assert_eq!(c3.line(), "ERROR Too many open connections\r\n");
    assert!(c3.closed());
    drop(p);
    cl.stop();
}

/// Binary requests: (opcode, opaque, extras, key, value).
fn bin(out: &mut Vec<u8>, opcode: u8, opaque: u32, extras: &[u8], key: &str, value: &[u8]) {
    mbal_proto::binary::write_request(out, opcode, 0, opaque, 0, extras, key.as_bytes(), value);
}

/// Send binary requests then a NOOP sentinel; the responses up to it, with
/// their CAS zeroed (CAS values differ between any two servers).
fn bin_transcript(addr: SocketAddr, reqs: &[u8]) -> Vec<Vec<u8>> {
    let mut c = Conn::open(addr);
    let mut all = reqs.to_vec();
    bin(&mut all, 0x0a, 0xfeed_f00d, &[], "", b"");
    c.send(&all);
    let mut out = Vec::new();
    loop {
        let mut h = c.exact(24);
        let body = u32::from_be_bytes([h[8], h[9], h[10], h[11]]) as usize;
        let opaque = u32::from_be_bytes([h[12], h[13], h[14], h[15]]);
        let end = h[1] == 0x0a && opaque == 0xfeed_f00d;
        h[16..24].fill(0);
        h.extend_from_slice(&c.exact(body));
        if end {
            return out;
        }
        out.push(h);
    }
}

#[test]
fn binary_replies_equal_a_single_servers() {
    use mbal_proto::binary::opcode as op;
    let _serial = serial();
    let cl = Cluster::start(3);
    let p = proxy(cl.map(), 2, 2000);
    let reference = single_server();
    let keys = keys_everywhere(&cl.map(), 2);
    let flags_exp = |f: u32, e: u32| [f.to_be_bytes(), e.to_be_bytes()].concat();
    let delta = |d: u64, init: u64| [d.to_be_bytes().to_vec(), init.to_be_bytes().to_vec(), vec![0; 4]].concat();
    let mut r = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let o = i as u32 * 100;
        bin(&mut r, op::SET, o, &flags_exp(i as u32, 0), k, format!("v{i}").as_bytes());
        bin(&mut r, op::GET, o + 1, &[], k, b"");
        bin(&mut r, op::GETK, o + 2, &[], k, b"");
        bin(&mut r, op::GETQ, o + 3, &[], &format!("{k}-missing"), b"");
        bin(&mut r, op::GETKQ, o + 4, &[], k, b"");
        bin(&mut r, op::ADD, o + 5, &flags_exp(0, 0), k, b"x");
        bin(&mut r, op::ADDQ, o + 6, &flags_exp(0, 0), &format!("{k}q"), b"q");
        bin(&mut r, op::APPEND, o + 7, &[], k, b"!");
        bin(&mut r, op::PREPENDQ, o + 8, &[], k, b"<");
        bin(&mut r, op::GET, o + 9, &[], k, b"");
        bin(&mut r, op::INCREMENT, o + 10, &delta(5, 7), &format!("{k}n"), b"");
        bin(&mut r, op::INCREMENT, o + 11, &delta(5, 7), &format!("{k}n"), b"");
        bin(&mut r, op::DECREMENTQ, o + 12, &delta(1, 0), &format!("{k}n"), b"");
        bin(&mut r, op::GET, o + 13, &[], &format!("{k}n"), b"");
        bin(&mut r, op::TOUCH, o + 14, &100u32.to_be_bytes(), k, b"");
        bin(&mut r, op::GAT, o + 15, &100u32.to_be_bytes(), k, b"");
        bin(&mut r, op::DELETE, o + 16, &[], k, b"");
        bin(&mut r, op::DELETE, o + 17, &[], k, b"");
        bin(&mut r, op::DELETEQ, o + 18, &[], k, b"");
        bin(&mut r, op::REPLACE, o + 19, &flags_exp(0, 0), k, b"r");
        bin(&mut r, op::NOOP, o + 20, &[], "", b"");
    }
    bin(&mut r, op::FLUSH, 7, &[0; 4], "", b"");
    bin(&mut r, op::GETK, 8, &[], &keys[0], b"");
    bin(&mut r, op::VERBOSITY, 9, &1u32.to_be_bytes(), "", b"");
    bin(&mut r, 0x55, 10, &[], "", b""); // unknown opcode
    let want = bin_transcript(reference.main_addr, &r);
    let got = bin_transcript(p.addr, &r);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "response {i}");
    }
    let mut c = Conn::open(p.addr);
    let st = stats(&mut c, "proxy");
    assert!(st.iter().any(|(k, v)| k.ends_with(":main:requests") && v != "0"), "{st:?}");
    drop(p);
    reference.shutdown();
    cl.stop();
}

/// One binary request; the response's (status, body after extras and key).
fn bin_call(c: &mut Conn, opcode: u8, extras: &[u8], key: &str, value: &[u8]) -> (u16, Vec<u8>) {
    let mut r = Vec::new();
    bin(&mut r, opcode, 7, extras, key, value);
    c.send(&r);
    let h = c.exact(24);
    let status = u16::from_be_bytes([h[6], h[7]]);
    let body = c.exact(u32::from_be_bytes([h[8], h[9], h[10], h[11]]) as usize);
    let skip = h[4] as usize + u16::from_be_bytes([h[2], h[3]]) as usize;
    (status, body[skip..].to_vec())
}

/// A dead server (its sockets closed) costs the proxy's clients misses, not errors or hangs:
/// reads of its keys miss, at once, writes get `SERVER_ERROR mbal server <addr> unreachable`
/// (binary: a miss is `KEY_ENOENT`, a write status 0x86), the other server's keys are served
/// throughout, it is not redialed for every request, and once back it is used again.
#[test]
fn a_dead_servers_keys_are_misses_and_its_writes_errors() {
    use mbal_proto::binary::opcode as op;
    let _serial = serial();
    let mut cl = Cluster::start(2);
    let map = cl.map();
    let timeout = Duration::from_millis(3000);
    let p = proxy(map.clone(), 1, timeout.as_millis() as u64);
    let on = |s: u16, p: &str| -> Vec<String> {
        (0..).map(|i| format!("{p}{i}")).filter(|k| map.route(key_hash(k.as_bytes())).1 == s).take(4).collect()
    };
    let (k0, k1) = (on(0, "a"), on(1, "b"));
    let mut c = Conn::open(p.addr);
    for k in k0.iter().chain(&k1) {
        assert_eq!(c.cmd(&format!("set {k} 0 0 1\r\n1\r\n")), "STORED\r\n");
    }
    cl.kill(1);
    let err = format!("SERVER_ERROR mbal server {} unreachable\r\n", cl.addr(1));
    let bounded = |t0: Instant, what: &str| assert!(t0.elapsed() < timeout, "{what}: {:?}", t0.elapsed());
    for k in &k1 {
        let t0 = Instant::now();
        assert_eq!(c.cmd_values(&format!("get {k}\r\n")), Ok(vec![]), "{k}");
        bounded(t0, "get");
    }
    let t0 = Instant::now();
    assert_eq!(c.cmd_values(&format!("gets {}\r\n", k1[0])), Ok(vec![]));
    let both = c.cmd_values(&format!("get {} {} {}\r\n", k0[0], k1[0], k0[1]));
    assert_eq!(both, Ok(vec![(k0[0].clone(), b"1".to_vec()), (k0[1].clone(), b"1".to_vec())]));
    assert_eq!(c.cmd(&format!("mg {} v\r\n", k1[0])), "EN\r\n");
    assert_eq!(c.cmd(&format!("mg {} v q\r\nmn\r\n", k1[0])), "MN\r\n", "a quiet miss says nothing");
    assert_eq!(c.cmd(&format!("set {} 0 0 1\r\n2\r\n", k1[0])), err);
    assert_eq!(c.cmd(&format!("delete {}\r\n", k1[0])), err);
    assert_eq!(c.cmd(&format!("ms {} 1\r\n2\r\n", k1[0])), err);
    assert_eq!(c.cmd(&format!("set {} 0 0 1 noreply\r\n2\r\nmn\r\n", k1[0])), "MN\r\n", "noreply: silent");
    bounded(t0, "the text requests");
    // binary, on another connection (the protocol is the connection's)
    let mut b = Conn::open(p.addr);
    assert_eq!(
        bin_call(&mut b, op::GET, &[], &k1[0], b""),
        (mbal_proto::binary::status::KEY_ENOENT, b"Not found".to_vec())
    );
    let (st, body) = bin_call(&mut b, op::SET, &[0; 8], &k1[0], b"v");
    assert_eq!(
        (st, String::from_utf8_lossy(&body).into_owned()),
        (0x86, format!("mbal server {} unreachable", cl.addr(1)))
    );
    assert_eq!(bin_call(&mut b, op::GET, &[], &k0[0], b"").0, 0, "the live server's key");
    // the live server's keys: served throughout
    for k in &k0 {
        assert_eq!(c.cmd(&format!("set {k} 0 0 1\r\n3\r\n")), "STORED\r\n");
        assert_eq!(c.cmd_values(&format!("get {k}\r\n")), Ok(vec![(k.clone(), b"3".to_vec())]));
    }
    let g = stats(&mut c, "");
    assert!(stat(&g, "proxy_unreachable_misses") >= k1.len() as u64 + 4, "{g:?}");
    assert!(stat(&g, "proxy_unreachable_errors") >= 4, "{g:?}");
    // the first failure asked server 0 for the map (the same epoch: not installed)
    assert!(stat(&g, "proxy_map_refreshes") >= 1, "{g:?}");
    assert_eq!((stat(&g, "proxy_maps_installed"), stat(&g, "proxy_map_epoch")), (0, 1), "{g:?}");
    // not redialed for every request
    let failures = stat(&g, "proxy_unreachable");
    assert!(failures >= 1 && failures < stat(&g, "proxy_unreachable_misses"), "{g:?}");

    // it comes back: after the backoff the next request dials it, and it is used again
    cl.restart(1);
    let t0 = Instant::now();
    loop {
        let l = c.cmd(&format!("set {} 0 0 1\r\n4\r\n", k1[0]));
        if l == "STORED\r\n" {
            break;
        }
        assert_eq!(l, err);
        assert!(t0.elapsed() < Duration::from_secs(20), "never used again");
        std::thread::sleep(Duration::from_millis(20)); // the backoff is time, not an event
    }
    assert_eq!(c.cmd_values(&format!("get {}\r\n", k1[0])), Ok(vec![(k1[0].clone(), b"4".to_vec())]));
    drop(p);
    cl.stop();
}

/// After a server cannot be reached, the proxy asks another server of its map for the map and
/// installs it once it is newer: the dead server's keys go where it says. The live server here
/// is a cluster of one that owns every cachelet (its map moves a cachelet so its epoch grows);
/// the proxy's map gives half of the cachelets to a second server where nothing listens.
#[test]
fn after_a_failure_the_proxy_refreshes_the_map_from_another_server() {
    refresh_after_a_failure(None);
}

/// The same with a coordinator named that does not answer: each fetch asks it first, then
/// falls back to a server's map.
#[test]
fn with_its_coordinator_gone_the_proxy_refreshes_the_map_from_a_server() {
    let gone = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // closed again
    let coords = mbal_proxy::coord::Coordinators { addrs: vec![gone], tls: None, timeout: Duration::from_millis(500) };
    refresh_after_a_failure(Some(coords));
}

fn refresh_after_a_failure(coordinators: Option<mbal_proxy::coord::Coordinators>) {
    let _serial = serial();
    let cl = Cluster::start(1);
    let live = cl.map();
    let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // closed again
    let owners = live.owners().iter().enumerate().map(|(c, &o)| if c % 2 == 1 { (1, 0) } else { o }).collect();
    let mut servers = live.servers().to_vec();
    servers.push(mbal_cluster::ServerInfo { main: dead, workers: vec![dead; WORKERS as usize] });
    let map = ClusterMap::new(live.keyspace().clone(), owners, servers);
    let with_coordinator = coordinators.is_some();
    let cfg = Config {
        threads: 1,
        upstream_timeout: Duration::from_millis(2000),
        coordinators,
        ..Config::new("127.0.0.1:0".parse().unwrap())
    };
    let p = mbal_proxy::start(cfg, map.clone()).expect("proxy starts");
    let kd: Vec<String> =
        (0..).map(|i| format!("d{i}")).filter(|k| map.route(key_hash(k.as_bytes())).1 == 1).take(4).collect();
    let mut c = Conn::open(p.addr);
    assert_eq!(c.cmd_values(&format!("get {}\r\n", kd[0])), Ok(vec![]), "a miss");
    let g = stats(&mut c, "");
    assert_eq!((stat(&g, "proxy_unreachable"), stat(&g, "proxy_map_refreshes")), (1, 1), "{g:?}");
    if with_coordinator {
        // asked first, did not answer; the server's map was fetched instead (the wait above)
        let (asked, failed) = (stat(&g, "proxy_map_coordinator_fetches"), stat(&g, "proxy_map_coordinator_failures"));
        assert!(asked >= 1 && failed == asked, "{g:?}");
    }
    // the cluster reassigns: the live server's map gets newer
    let c0 = live.cachelets_of(0, 0)[0];
    let mut admin = Conn::open(cl.addr(0));
    assert_eq!(admin.cmd(&format!("mbal move {c0} 1\r\n")), "MOVED 2\r\n");
    // the failed retry after the backoff refreshes again and installs it
    let t0 = Instant::now();
    loop {
        let l = c.cmd(&format!("set {} 0 0 1\r\n5\r\n", kd[0]));
        if l == "STORED\r\n" {
            break;
        }
        assert_eq!(l, format!("SERVER_ERROR mbal server {dead} unreachable\r\n"));
        assert!(t0.elapsed() < Duration::from_secs(20), "the newer map was never installed");
        std::thread::sleep(Duration::from_millis(20)); // the backoff is time, not an event
    }
    let g = stats(&mut c, "");
    assert_eq!((stat(&g, "proxy_maps_installed"), stat(&g, "proxy_map_epoch")), (1, 2), "{g:?}");
    for k in &kd {
        assert_eq!(c.cmd(&format!("set {k} 0 0 1\r\n6\r\n")), "STORED\r\n");
        assert_eq!(c.cmd_values(&format!("get {k}\r\n")), Ok(vec![(k.clone(), b"6".to_vec())]));
    }
    assert_eq!(
        admin.cmd(&format!("get {}\r\n", kd[1])),
        format!("VALUE {} 0 1\r\n", kd[1]),
        "stored by the live server"
    );
    drop(p);
    cl.stop();
}
