//! The operator's tools against a real memcached (issue 36): `lru_crawler metadump`, `stats
//! cachedump`, `memcached-tool dump`, binary `STAT` with a key, `stats sizes`, and `-M`
//! refusing every store once full. Each test runs the same requests on an mbal server and
//! on the memcached at `MBAL_MEMCACHED_ADDR` and compares the bytes (up to what legitimately
//! differs: CAS numbers, item sizes and slab classes, a second's tick); without it, the mbal
//! side still runs and is checked alone, unless `MBAL_REQUIRE_MEMCACHED` is set (then a
//! missing memcached fails). The `-M` test and the memcached-tool test start their own
//! processes (`memcached`, `perl` with Debian's script) when those are installed.

mod common;
use common::*;
use mbal_proto::binary::{opcode as op, write_request, HEADER_LEN};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn memcached() -> Option<SocketAddr> {
    let a = std::env::var("MBAL_MEMCACHED_ADDR").ok().filter(|s| !s.is_empty());
    if a.is_none() && std::env::var_os("MBAL_REQUIRE_MEMCACHED").is_some() {
        panic!("MBAL_REQUIRE_MEMCACHED is set but MBAL_MEMCACHED_ADDR is not");
    }
    a.map(|a| a.parse().expect("MBAL_MEMCACHED_ADDR is host:port"))
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Send `req` on a fresh connection and read until the reply ends with `end`.
fn ask(addr: SocketAddr, req: &str, end: &str) -> String {
    let mut s = connect(addr);
    s.write_all(req.as_bytes()).unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 16384];
    while !got.ends_with(end.as_bytes()) {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// A prefix unique to this test run (memcached is shared with other tests and runs).
fn run_id(tag: &str) -> String {
    let us = std::time::SystemTime::UNIX_EPOCH.elapsed().unwrap().as_micros();
    format!("{tag}{}x{us}", std::process::id())
}

/// Store this run's items: `a` (never expires, read once), `b:1` (expires in 1000 s, not read).
fn fill(addr: SocketAddr, run: &str) {
    let req = format!("set {run}a 5 0 3\r\nbar\r\nset {run}b:1 0 1000 2\r\nhi\r\nget {run}a\r\n");
    let got = ask(addr, &req, "END\r\n");
    assert_eq!(got, format!("STORED\r\nSTORED\r\nVALUE {run}a 5 3\r\nbar\r\nEND\r\n"));
}

/// This run's lines of a metadump, each with its class and size fields cut off (mbal's
/// classes are workers and its items have another layout) and its cas masked.
fn metadump_lines(addr: SocketAddr, run: &str) -> Vec<String> {
    let got = ask(addr, "lru_crawler metadump all\r\n", "END\r\n");
    assert!(got.ends_with("\nEND\r\n") || got == "END\r\n", "{got:?}");
    let enc = run.to_string();
    let mut lines: Vec<String> = got
        .split('\n')
        .filter(|l| l.starts_with(&format!("key={enc}")))
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            assert_eq!(f.len(), 7, "{l}");
            let names: Vec<&str> = f.iter().map(|x| x.split('=').next().unwrap()).collect();
            assert_eq!(names, ["key", "exp", "la", "cas", "fetch", "cls", "size"], "{l}");
            assert!(
                f[3][4..].parse::<u64>().is_ok()
                    && f[5][4..].parse::<u32>().is_ok()
                    && f[6][5..].parse::<u32>().is_ok()
            );
            format!("{} {} {} fetch={}", f[0], f[1], f[2], &f[4][6..])
        })
        .collect();
    lines.sort();
    lines
}

/// Times in a line within a second of the other's (two servers, two clocks' ticks).
fn same_but_seconds(a: &str, b: &str) -> bool {
    let (ta, tb): (Vec<&str>, Vec<&str>) =
        (a.split([' ', '=', '[', ';']).collect(), b.split([' ', '=', '[', ';']).collect());
    ta.len() == tb.len()
        && ta.iter().zip(&tb).all(|(x, y)| match (x.parse::<i64>(), y.parse::<i64>()) {
            (Ok(x), Ok(y)) if x > 1_000_000_000 => (x - y).abs() <= 1,
            _ => x == y,
        })
}

#[test]
fn metadump_and_cachedump_match_memcached() {
    let srv = start(settings(2));
    let mut addrs = vec![srv.main_addr];
    // A memcached of its own with one LRU per class (`no_lru_maintainer`), when installed:
    // with its segmented LRU, `stats cachedump` lists only the cold items. Else the shared
    // one, whose cachedump lines are then not compared.
    let mut own = None;
    let mut flat = false;
    if memcached_binary() {
        let (child, addr) = spawn_memcached(&["-m", "64", "-o", "no_lru_maintainer"]);
        own = Some(child);
        addrs.push(addr);
        flat = true;
    } else {
        addrs.extend(memcached());
    }
    let run = run_id("md");
    let mut dumps = Vec::new();
    let mut items = Vec::new();
    for &addr in &addrs {
        fill(addr, &run);
        let lines = metadump_lines(addr, &run);
        assert_eq!(lines.len(), 2, "{addr}: {lines:?}");
        // The class of each of our items, and its cachedump line.
        let got = ask(addr, "lru_crawler metadump all\r\n", "END\r\n");
        let mut ours = Vec::new();
        for l in got.split('\n').filter(|l| l.starts_with(&format!("key={run}"))) {
            let cls = l.split(' ').find_map(|f| f.strip_prefix("cls=")).unwrap();
            let dump = ask(addr, &format!("stats cachedump {cls} 0\r\n"), "END\r\n");
            assert!(dump.ends_with("END\r\n"), "{dump}");
            let key = l.split(' ').next().unwrap()[4..].replace("%3A", ":");
            let line = dump.split("\r\n").find(|d| d.starts_with(&format!("ITEM {key} ")));
            if addr == srv.main_addr || flat {
                ours.push(line.unwrap_or_else(|| panic!("{key}: {dump}")).to_string());
            }
            // The limit: one line.
            let one = ask(addr, &format!("stats cachedump {cls} 1\r\n"), "END\r\n");
            assert_eq!(one.matches("ITEM ").count(), 1, "{one}");
        }
        ours.sort();
        dumps.push(lines);
        items.push(ours);
    }
    let now = std::time::SystemTime::UNIX_EPOCH.elapsed().unwrap().as_secs() as i64;
    let exp: i64 = dumps[0][1].split(' ').nth(1).unwrap()[4..].parse().unwrap();
    assert!((exp - now - 1000).abs() <= 2, "an absolute unix time: {}", dumps[0][1]);
    assert!(dumps[0][0].ends_with(" exp=-1 ") || dumps[0][0].contains(" exp=-1 "), "{}", dumps[0][0]);
    assert!(dumps[0][0].ends_with("fetch=yes") && dumps[0][1].ends_with("fetch=no"), "{:?}", dumps[0]);
    assert!(dumps[0][1].starts_with(&format!("key={run}b%3A1 ")), "%-encoded: {}", dumps[0][1]);
    if addrs.len() == 2 {
        assert_eq!(items[1].len(), if flat { 2 } else { 0 });
        for (m, c) in dumps[0].iter().zip(&dumps[1]).chain(items[0].iter().zip(&items[1])) {
            assert!(same_but_seconds(m, c), "mbal {m:?}\nmemcached {c:?}");
        }
        // The errors, byte for byte.
        for req in [
            "lru_crawler metadump\r\n",
            "lru_crawler metadump 99\r\n",
            "lru_crawler metadump 0\r\n",
            "lru_crawler metadump x\r\n",
            "lru_crawler metadump all x\r\n",
            "lru_crawler crawl 99\r\n",
            "lru_crawler tocrawl x\r\n",
            "lru_crawler sleep x\r\n",
            "lru_crawler bogus\r\n",
            "lru_crawler\r\n",
            "stats cachedump 64 1\r\n",
            "stats cachedump 1\r\n",
            "stats cachedump\r\n",
            "stats cachedump 1 x\r\n",
            "stats cachedump 0 1\r\n",
        ] {
            let (m, c) = (ask(addrs[0], req, "\r\n"), ask(addrs[1], req, "\r\n"));
            assert_eq!(m, c, "{req:?}");
        }
    }
    if let Some(mut mc) = own {
        let _ = mc.kill();
        let _ = mc.wait();
    }
    srv.shutdown();
}

/// A dump is bounded: `stats cachedump` stops at memcached's 2 MiB.
#[test]
fn cachedump_is_bounded() {
    let mut s = settings(1);
    s.memory_limit = 64 << 20;
    let srv = start(s);
    let mut c = Conn::open(srv.main_addr);
    let key = "k".repeat(200);
    let mut batch = Vec::new();
    for i in 0..12_000 {
        batch.extend_from_slice(format!("set {key}{i} 0 0 1 noreply\r\nx\r\n").as_bytes());
    }
    c.send(&batch);
    assert_eq!(c.cmd("version\r\n").split_whitespace().next(), Some("VERSION"));
    let dump = ask(srv.main_addr, "stats cachedump 1 0\r\n", "END\r\n");
    assert!(dump.len() <= 2 << 20 && dump.len() > (2 << 20) - 300, "{}", dump.len());
    assert!(dump.matches("ITEM ").count() < 12_000);
    let all = ask(srv.main_addr, "lru_crawler metadump all\r\n", "END\r\n");
    assert_eq!(all.matches("\n").count(), 12_000 + 1, "metadump's bound is larger");
    srv.shutdown();
}

/// The binary STAT packets of `key` (opcode, status, key, value), up to the terminator.
fn bin_stat(s: &mut TcpStream, key: &str) -> Vec<(u8, u16, Vec<u8>, Vec<u8>)> {
    let mut req = Vec::new();
    write_request(&mut req, op::STAT, 0, 7, 0, &[], key.as_bytes(), &[]);
    s.write_all(&req).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let mut out = Vec::new();
    loop {
        while buf.len() >= HEADER_LEN {
            let body = u32::from_be_bytes(buf[8..12].try_into().unwrap()) as usize;
            if buf.len() < HEADER_LEN + body {
                break;
            }
            let (kl, el) = (u16::from_be_bytes([buf[2], buf[3]]) as usize, buf[4] as usize);
            let status = u16::from_be_bytes([buf[6], buf[7]]);
            let b = &buf[HEADER_LEN..HEADER_LEN + body];
            let (k, v) = (b[el..el + kl].to_vec(), b[el + kl..].to_vec());
            assert_eq!(u32::from_be_bytes(buf[12..16].try_into().unwrap()), 7, "opaque");
            let end = kl == 0 && (status != 0 || v.is_empty());
            out.push((buf[1], status, k, v));
            buf.drain(..HEADER_LEN + body);
            if end {
                return out;
            }
        }
        let n = s.read(&mut chunk).expect("the connection stays");
        assert!(n > 0, "the server closed the connection after {key:?}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[test]
fn binary_stat_with_a_key_matches_memcached() {
    let srv = start(settings(2));
    let mut addrs = vec![srv.main_addr];
    addrs.extend(memcached());
    let mut answers = Vec::new();
    for &addr in &addrs {
        let mut s = connect(addr);
        let mut got = Vec::new();
        // (Not `detail` alone: memcached 1.6.18 compares past the end of the key, so its
        // answer depends on the bytes after it in its buffer.)
        for key in ["detail on", "detail off", "sizes", "bogus", "reset", "detail dump"] {
            let packets = bin_stat(&mut s, key);
            let shape: Vec<_> = packets
                .iter()
                .map(|(o, st, k, v)| {
                    // detail dump's text depends on the traffic before: its shape only.
                    let v = if k == b"detailed" && v.ends_with(b"END\r\n") { b"<dump>END".to_vec() } else { v.clone() };
                    (*o, *st, String::from_utf8_lossy(k).into_owned(), String::from_utf8_lossy(&v).into_owned())
                })
                .collect();
            got.push((key, shape));
        }
        // The connection still serves (a version request).
        let mut req = Vec::new();
        write_request(&mut req, op::VERSION, 0, 9, 0, &[], &[], &[]);
        s.write_all(&req).unwrap();
        let mut h = [0u8; HEADER_LEN];
        s.read_exact(&mut h).unwrap();
        assert_eq!((h[1], u16::from_be_bytes([h[6], h[7]])), (op::VERSION, 0));
        answers.push(got);
    }
    let ours = &answers[0];
    assert_eq!(ours[0].1, vec![(op::STAT, 0, String::new(), String::new())], "detail on: the end packet");
    assert_eq!(ours[2].1[0], (op::STAT, 0, "sizes_status".into(), "disabled".into()));
    assert_eq!(ours[5].1[0].2, "detailed");
    if let Some(theirs) = answers.get(1) {
        assert_eq!(ours, theirs, "mbal vs memcached");
    }
    srv.shutdown();
}

/// Send one request and read its reply up to `end` (what a reply of that kind ends with).
fn exchange(s: &mut TcpStream, req: &str, end: &str) -> String {
    s.write_all(req.as_bytes()).unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(end.as_bytes()) {
        match s.read(&mut b) {
            Ok(1) => got.push(b[0]),
            r => panic!("{req:?}: no {end:?} after {:?} ({r:?})", String::from_utf8_lossy(&got)),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// `stats sizes_enable`, `stats sizes`, `stats sizes_disable` over text and binary: the
/// histogram of the items written since the enabling, byte for byte as memcached's (sizes
/// as memcached 1.6 counts an item), on a 2-worker server. Its own memcached, as the
/// switch is server-wide.
#[test]
fn stats_sizes_matches_memcached() {
    let line = "\r\n";
    let end = "END\r\n";
    let script: Vec<(String, &str)> = vec![
        ("set pre 0 0 3\r\nabc\r\n".into(), line),
        ("stats sizes\r\n".into(), end),
        ("stats sizes_enable\r\n".into(), line),
        ("stats sizes_enable\r\n".into(), line),
        ("stats sizes\r\n".into(), end),
        ("set a 0 0 2\r\nab\r\n".into(), line),
        ("set b 5 0 2\r\nab\r\n".into(), line),
        (format!("set c 0 0 100\r\n{}\r\n", "x".repeat(100)), line),
        ("stats sizes\r\n".into(), end),
        ("delete pre\r\n".into(), line),
        ("set pre 0 0 3\r\nabc\r\n".into(), line),
        ("delete a\r\n".into(), line),
        ("set nn 0 0 3\r\n999\r\n".into(), line),
        ("incr nn 1\r\n".into(), line),
        (format!("append c 0 0 40\r\n{}\r\n", "y".repeat(40)), line),
        ("stats sizes\r\n".into(), end),
        ("stats sizes_disable\r\n".into(), line),
        ("stats sizes\r\n".into(), end),
        ("stats sizes_enable\r\n".into(), line),
        ("set z 0 0 1\r\nz\r\n".into(), line),
        ("stats sizes\r\n".into(), end),
    ];
    let run = |addr: SocketAddr| -> Vec<String> {
        let mut s = connect(addr);
        let mut out: Vec<String> = script.iter().map(|(req, end)| exchange(&mut s, req, end)).collect();
        // Binary: the same switch; `sizes_enable`/`sizes_disable` answer one packet, no end packet.
        let mut b = connect(addr);
        for key in ["sizes", "sizes_disable", "sizes", "sizes_enable", "sizes"] {
            let mut req = Vec::new();
            write_request(&mut req, op::STAT, 0, 7, 0, &[], key.as_bytes(), &[]);
            b.write_all(&req).unwrap();
            let mut packets = Vec::new();
            loop {
                let mut h = [0u8; HEADER_LEN];
                b.read_exact(&mut h).unwrap();
                let body = u32::from_be_bytes(h[8..12].try_into().unwrap()) as usize;
                let mut v = vec![0u8; body];
                b.read_exact(&mut v).unwrap();
                let kl = u16::from_be_bytes([h[2], h[3]]) as usize;
                packets.push(format!("{}={}", String::from_utf8_lossy(&v[..kl]), String::from_utf8_lossy(&v[kl..])));
                if kl == 0 || key != "sizes" {
                    break;
                }
            }
            out.push(format!("bin {key}: {}", packets.join(" ")));
        }
        // `stats settings` shows the switch as `track_sizes`.
        let track_sizes = |s: &mut TcpStream| {
            let all = exchange(s, "stats settings\r\n", end);
            all.lines().find(|l| l.starts_with("STAT track_sizes ")).unwrap_or("none").to_string()
        };
        out.push(track_sizes(&mut s));
        let _ = exchange(&mut s, "stats sizes_disable\r\n", line);
        out.push(track_sizes(&mut s));
        out
    };
    let srv = start(settings(2));
    let ours = run(srv.main_addr);
    let want = [
        "STORED\r\n",
        "STAT sizes_status disabled\r\nEND\r\n",
        "STAT sizes_status enabled\r\n",
        "STAT sizes_status enabled\r\n",
        "END\r\n",
        "STORED\r\n",
        "STORED\r\n",
        "STORED\r\n",
        // a: 48 + 2 + 4 + 8 = 62; b: + 4 for its flags; c: 160
        "STAT 64 1\r\nSTAT 96 1\r\nSTAT 160 1\r\nEND\r\n",
        "DELETED\r\n",
        "STORED\r\n",
        "DELETED\r\n",
        "STORED\r\n",
        "1000\r\n",
        "STORED\r\n",
        // pre (written before the enabling, uncounted when deleted) again: 65; nn 999 was 64,
        // 1000 is 65; c with 40 more bytes: 200
        "STAT 96 3\r\nSTAT 224 1\r\nEND\r\n",
        "STAT sizes_status disabled\r\n",
        "STAT sizes_status disabled\r\nEND\r\n",
        "STAT sizes_status enabled\r\n",
        "STORED\r\n",
        "STAT 64 1\r\nEND\r\n",
        "bin sizes: 64=1 =",
        "bin sizes_disable: sizes_status=disabled",
        "bin sizes: sizes_status=disabled =",
        "bin sizes_enable: sizes_status=enabled",
        "bin sizes: =",
        "STAT track_sizes yes",
        "STAT track_sizes no",
    ];
    assert_eq!(ours, want);
    srv.shutdown();
    if memcached_binary() {
        let (mut mc, addr) = spawn_memcached(&["-m", "64"]);
        let theirs = run(addr);
        let _ = mc.kill();
        let _ = mc.wait();
        assert_eq!(ours, theirs, "mbal vs memcached");
    }
}

/// `-o track_sizes`: the histogram is on from the start, as on memcached.
#[test]
fn track_sizes_starts_with_the_histogram_on() {
    let run = |addr: SocketAddr| -> Vec<String> {
        let mut s = connect(addr);
        ["set a 0 0 2\r\nab\r\n", "stats sizes\r\n", "stats sizes_disable\r\n", "stats sizes\r\n"]
            .iter()
            .zip(["\r\n", "END\r\n", "\r\n", "END\r\n"])
            .map(|(req, end)| exchange(&mut s, req, end))
            .collect()
    };
    let mut st = settings(2);
    st.track_sizes = true;
    let srv = start(st);
    let ours = run(srv.main_addr);
    srv.shutdown();
    let want = [
        "STORED\r\n",
        "STAT 64 1\r\nEND\r\n",
        "STAT sizes_status disabled\r\n",
        "STAT sizes_status disabled\r\nEND\r\n",
    ];
    assert_eq!(ours, want);
    if memcached_binary() {
        let (mut mc, addr) = spawn_memcached(&["-m", "64", "-o", "track_sizes"]);
        let theirs = run(addr);
        let _ = mc.kill();
        let _ = mc.wait();
        assert_eq!(ours, theirs, "mbal vs memcached");
    }
}

/// A `memcached` binary to start, when installed and a comparison is wanted.
fn memcached_binary() -> bool {
    memcached().is_some()
        && Command::new("memcached").arg("-h").stdout(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Start `memcached <args>` on a free loopback port; its child and address.
fn spawn_memcached(args: &[&str]) -> (std::process::Child, SocketAddr) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut a: Vec<String> = ["-l", "127.0.0.1", "-U", "0", "-t", "1"].iter().map(|s| s.to_string()).collect();
    a.extend(args.iter().map(|s| s.to_string()));
    a.extend(["-p".into(), port.to_string()]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        a.extend(["-u".into(), "nobody".into()]);
    }
    let child = Command::new("memcached").args(&a).stderr(Stdio::null()).spawn().unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let t0 = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(5), "memcached did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    (child, addr)
}

/// `-M -m 2` with 8 KB values: once a set is refused, every later one of the same size is
/// refused too, each counted in `store_no_memory`; on mbal (one and two workers) as on
/// memcached.
#[test]
fn no_evictions_keeps_refusing_once_full_as_memcached() {
    let run = |addr: SocketAddr| -> (usize, usize, u64) {
        let mut c = Conn::open(addr);
        let v = vec![b'x'; 8192];
        let (mut stored, mut refused_after, mut first) = (0, 0, None);
        for i in 0..600 {
            let r = c.set(&format!("k{i}"), &v);
            match (r.as_str(), first) {
                ("STORED\r\n", None) => stored += 1,
                ("SERVER_ERROR out of memory storing object\r\n", _) => {
                    first.get_or_insert(i);
                    refused_after += 1;
                }
                (r, _) => panic!("set k{i} after the first refusal: {r:?}"),
            }
        }
        assert!(first.is_some(), "never full");
        (stored, refused_after, stat(&mut c, "store_no_memory"))
    };
    for threads in [1, 2] {
        let mut s = settings(threads);
        s.memory_limit = 2 << 20;
        s.evictions = false;
        let srv = start(s);
        let (stored, refused, counted) = run(srv.main_addr);
        assert_eq!(stored + refused, 600);
        assert_eq!(counted, refused as u64, "each refusal counted");
        srv.shutdown();
    }
    if memcached_binary() {
        let (mut mc, addr) = spawn_memcached(&["-m", "2", "-M"]);
        let (stored, refused, counted) = run(addr);
        let _ = mc.kill();
        let _ = mc.wait();
        assert_eq!((stored + refused, counted), (600, refused as u64), "memcached");
    }
}

/// Debian's `memcached-tool HOST:PORT dump` prints the same `add` records from mbal as from
/// memcached (for this run's keys).
#[test]
fn memcached_tool_dump_works() {
    const TOOL: &str = "/usr/share/memcached/scripts/memcached-tool";
    let have_tool = std::path::Path::new(TOOL).exists()
        && Command::new("perl").arg("-v").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    if !have_tool {
        eprintln!("{TOOL} (Debian's memcached package) or perl is not installed: skipped");
        return;
    }
    let srv = start(settings(2));
    let mut addrs = vec![srv.main_addr];
    let mut mc = None;
    if memcached_binary() {
        // A memcached of its own: a dump of the shared one would hold every other test's keys.
        let (child, addr) = spawn_memcached(&["-m", "64"]);
        mc = Some(child);
        addrs.push(addr);
    }
    let run = run_id("tool");
    let mut outs = Vec::new();
    for &addr in &addrs {
        fill(addr, &run);
        let out = Command::new("perl").arg(TOOL).arg(addr.to_string()).arg("dump").output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut recs: Vec<String> = text.split("add ").filter(|r| !r.is_empty()).map(|r| r.to_string()).collect();
        recs.sort();
        outs.push(recs);
    }
    let exp = |r: &str| r.split(' ').nth(2).unwrap().parse::<i64>().unwrap();
    assert_eq!(outs[0].len(), 2, "{:?}", outs[0]);
    assert_eq!(outs[0][0], format!("{run}a 5 0 3\r\nbar\r\n"));
    assert!(outs[0][1].starts_with(&format!("{run}b:1 0 ")) && outs[0][1].ends_with(" 2\r\nhi\r\n"), "{}", outs[0][1]);
    if let Some(theirs) = outs.get(1) {
        assert_eq!(outs[0][0], theirs[0]);
        assert!((exp(&outs[0][1]) - exp(&theirs[1])).abs() <= 1, "{:?} {:?}", outs[0], theirs);
    }
    if let Some(mut mc) = mc {
        let _ = mc.kill();
        let _ = mc.wait();
    }
    srv.shutdown();
}

/// Read a watcher's lines until `done` says enough (bounded by the read timeout); each line
/// with its `ts=`, `gid=`, `cfd=` and `clsid=` fields cut (they differ between servers).
fn watched(w: &mut TcpStream, done: impl Fn(&[String]) -> bool) -> Vec<String> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 16384];
    let t0 = Instant::now();
    let lines = |got: &[u8]| -> Vec<String> {
        // Whole lines only.
        let end = got.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        String::from_utf8_lossy(&got[..end])
            .split('\n')
            .filter(|l| l.starts_with("ts="))
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                assert!(f[0][3..].contains('.') && f[1].starts_with("gid="), "{l}");
                f[2..]
                    .iter()
                    .filter(|x| !x.starts_with("cfd=") && !x.starts_with("clsid="))
                    .copied()
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    };
    while !done(&lines(&got)) && t0.elapsed() < Duration::from_secs(5) {
        match w.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
    lines(&got)
}

/// `watch fetchers mutations`: a line per lookup and per store, memcached's format; compared
/// with memcached's for the lines both write (memcached also logs its stores' internal
/// lookups, which mbal does not have).
#[test]
fn watch_streams_fetchers_and_mutations_as_memcached() {
    let srv = start(settings(2));
    let mut addrs = vec![srv.main_addr];
    addrs.extend(memcached());
    let run = run_id("w");
    let mut streams = Vec::new();
    for &addr in &addrs {
        ask(addr, &format!("set {run}a 0 0 2\r\nhi\r\n"), "\r\n");
        let mut w = connect(addr);
        w.write_all(b"watch fetchers mutations\r\n").unwrap();
        let mut ok = [0u8; 4];
        w.read_exact(&mut ok).unwrap();
        assert_eq!(&ok, b"OK\r\n");
        let req = format!(
            "get {run}a\r\nget {run}miss\r\nset {run}b 0 100 3\r\nabc\r\nadd {run}b 0 0 1\r\nx\r\n\
             append {run}b 0 0 1\r\nx\r\ncas {run}b 0 0 1 1\r\nx\r\ncas {run}nob 0 0 1 1\r\nx\r\n"
        );
        let reply = ask(addr, &req, "NOT_FOUND\r\n");
        assert!(reply.ends_with("NOT_FOUND\r\n"), "{reply}");
        let ours = |l: &String| l.contains(&format!("key={run}"));
        let want = 7;
        let lines = watched(&mut w, |ls| {
            ls.iter().filter(|l| ours(l) && !(l.contains("item_get") && l.contains(&format!("key={run}b")))).count()
                >= want
        });
        // memcached's internal lookups of the keys it stores are not mbal's.
        let mut lines: Vec<String> = lines
            .into_iter()
            .filter(|l| ours(l))
            .filter(|l| {
                !(l.contains("type=item_get")
                    && (l.contains(&format!("key={run}b ")) || l.contains(&format!("key={run}nob "))))
            })
            .collect();
        lines.sort();
        streams.push(lines);
    }
    let expect: Vec<String> = {
        let mut e = vec![
            format!("type=item_get key={run}a status=found size=2"),
            format!("type=item_get key={run}miss status=not_found size=0"),
            format!("type=item_store key={run}b status=stored cmd=set ttl=100 size=3"),
            format!("type=item_store key={run}b status=not_stored cmd=add ttl=0 size=1"),
            format!("type=item_store key={run}b status=stored cmd=append ttl=100 size=4"),
            format!("type=item_store key={run}b status=exists cmd=cas ttl=0 size=1"),
            format!("type=item_store key={run}nob status=not_found cmd=cas ttl=0 size=1"),
        ];
        e.sort();
        e
    };
    assert_eq!(streams[0], expect, "mbal");
    if let Some(theirs) = streams.get(1) {
        assert_eq!(&streams[0], theirs, "mbal vs memcached");
    }
    // An unknown category is memcached's ERROR; the connection stays a plain one.
    let mut c = Conn::open(srv.main_addr);
    assert_eq!(c.cmd("watch bogus\r\n"), "ERROR\r\n");
    assert!(c.cmd("version\r\n").starts_with("VERSION "));
    srv.shutdown();
}

/// `watch evictions` on a server of 2 MB filled with 4,000-byte values: its lines, each
/// evicted item's (`clsid=` cut), and the number of evictions `stats` counts.
fn evictions_watched(addr: SocketAddr) -> (Vec<String>, u64) {
    let mut w = connect(addr);
    w.write_all(b"watch evictions\r\n").unwrap();
    let mut ok = [0u8; 4];
    w.read_exact(&mut ok).unwrap();
    assert_eq!(&ok, b"OK\r\n");
    let mut c = Conn::open(addr);
    let v = vec![b'x'; 4000];
    let mut batch = Vec::new();
    for i in 0..2000 {
        batch.extend_from_slice(format!("set ev{i} 0 0 {} noreply\r\n", v.len()).as_bytes());
        batch.extend_from_slice(&v);
        batch.extend_from_slice(b"\r\n");
    }
    c.send(&batch);
    assert_eq!(c.cmd("version\r\n").split_whitespace().next(), Some("VERSION"));
    let evicted = stat(&mut c, "evictions");
    assert!(evicted > 100, "{evicted}");
    (watched(&mut w, |ls| ls.len() as u64 >= evicted), evicted)
}

/// `watch evictions`: a line per item evicted, in memcached's format (compared with one of
/// its own, `-m 2`, when memcached is installed).
#[test]
fn watch_streams_evictions() {
    let mut s = settings(1);
    s.memory_limit = 2 << 20;
    let srv = start(s);
    let (lines, evicted) = evictions_watched(srv.main_addr);
    assert_eq!(lines.len() as u64, evicted);
    // The fields but the key and the seconds since the last access.
    let shape = |l: &str| -> String {
        let f: Vec<&str> = l.split(' ').collect();
        assert!(
            f[1].starts_with("key=ev") && f[4].strip_prefix("la=").is_some_and(|n| n.parse::<u32>().is_ok()),
            "{l}"
        );
        format!("{} {} {} {}", f[0], f[2], f[3], f[5..].join(" "))
    };
    for l in &lines {
        assert_eq!(shape(l), "type=eviction fetch=no ttl=-1 size=4000");
    }
    srv.shutdown();
    if memcached_binary() {
        let (mut mc, addr) = spawn_memcached(&["-m", "2"]);
        let (theirs, _) = evictions_watched(addr);
        let _ = mc.kill();
        let _ = mc.wait();
        assert_eq!(shape(&theirs[0]), shape(&lines[0]), "memcached {}", theirs[0]);
    }
}
