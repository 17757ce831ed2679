//! Text and meta protocol over real sockets, against 1- and 2-worker servers
//! (with two workers about half of all keys belong to the worker the
//! connection does not live on, so forwarding and reply ordering are
//! exercised on every test).

mod common;
use common::*;

#[test]
fn basic_commands_on_one_and_two_workers() {
    for threads in [1, 2] {
        let srv = start(settings(threads));
        let mut c = Conn::open(srv.main_addr);
        assert_eq!(c.set("foo", b"bar"), "STORED\r\n");
        assert_eq!(c.get("foo").as_deref(), Some(&b"bar"[..]));
        assert_eq!(c.cmd("add foo 0 0 1\r\nx\r\n"), "NOT_STORED\r\n");
        assert_eq!(c.cmd("add new 5 0 1\r\nx\r\n"), "STORED\r\n");
        assert_eq!(c.cmd("replace nope 0 0 1\r\nx\r\n"), "NOT_STORED\r\n");
        assert_eq!(c.cmd("append foo 0 0 1\r\n!\r\n"), "STORED\r\n");
        assert_eq!(c.cmd("prepend foo 0 0 1\r\n<\r\n"), "STORED\r\n");
        assert_eq!(c.get("foo").as_deref(), Some(&b"<bar!"[..]));
        c.send(b"gets foo\r\n");
        let l = c.line();
        let cas: u64 = l.split_whitespace().nth(4).unwrap().parse().unwrap();
        assert_eq!(c.exact(7), b"<bar!\r\n");
        assert_eq!(c.line(), "END\r\n");
        assert_eq!(c.cmd(&format!("cas foo 0 0 1 {}\r\nz\r\n", cas + 1)), "EXISTS\r\n");
        assert_eq!(c.cmd(&format!("cas foo 0 0 1 {cas}\r\nz\r\n")), "STORED\r\n");
        assert_eq!(c.cmd("cas nothere 0 0 1 1\r\nz\r\n"), "NOT_FOUND\r\n");
        assert_eq!(c.set("n", b"18446744073709551615"), "STORED\r\n");
        assert_eq!(c.cmd("incr n 2\r\n"), "1\r\n", "incr wraps at 2^64");
        assert_eq!(c.cmd("decr n 5\r\n"), "0\r\n", "decr floors at 0");
        assert_eq!(c.cmd("incr foo 1\r\n"), "CLIENT_ERROR cannot increment or decrement non-numeric value\r\n");
        assert_eq!(c.cmd("incr missing 1\r\n"), "NOT_FOUND\r\n");
        assert_eq!(c.cmd("touch foo 100\r\n"), "TOUCHED\r\n");
        assert_eq!(c.cmd("touch missing 100\r\n"), "NOT_FOUND\r\n");
        assert_eq!(c.cmd("delete foo\r\n"), "DELETED\r\n");
        assert_eq!(c.cmd("delete foo\r\n"), "NOT_FOUND\r\n");
        assert!(c.cmd("version\r\n").starts_with("VERSION 1.6"));
        assert_eq!(c.cmd("verbosity 1\r\n"), "OK\r\n");
        // noreply: nothing comes back, the next reply is the version.
        c.send(b"set q 0 0 1 noreply\r\na\r\ndelete nothere noreply\r\nincr q 1 noreply\r\n");
        assert!(c.cmd("version\r\n").starts_with("VERSION"));
        assert_eq!(c.get("q").as_deref(), Some(&b"a"[..]));
        // gat touches and returns.
        c.send(b"gat 100 new\r\n");
        assert_eq!(c.line(), "VALUE new 5 1\r\n");
        assert_eq!(c.exact(3), b"x\r\n");
        assert_eq!(c.line(), "END\r\n");
        srv.shutdown();
    }
}

#[test]
fn pipelined_mixed_requests_reply_in_order() {
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    let mut req = Vec::new();
    let n = 500;
    for i in 0..n {
        req.extend_from_slice(format!("set key{i} {i} 0 {}\r\nval{i}\r\n", format!("val{i}").len()).as_bytes());
        req.extend_from_slice(format!("get key{i} key{} nokey{i}\r\n", (i + 7) % n).as_bytes());
        req.extend_from_slice(b"mn\r\n");
    }
    c.send(&req);
    for i in 0..n {
        assert_eq!(c.line(), "STORED\r\n", "reply {i}");
        let l = c.line();
        let v = format!("val{i}");
        assert_eq!(l, format!("VALUE key{i} {i} {}\r\n", v.len()));
        assert_eq!(c.exact(v.len() + 2), format!("{v}\r\n").into_bytes());
        let other = (i + 7) % n;
        let l = c.line();
        if other < i {
            let v = format!("val{other}");
            assert_eq!(l, format!("VALUE key{other} {other} {}\r\n", v.len()));
            c.exact(v.len() + 2);
            assert_eq!(c.line(), "END\r\n");
        } else {
            assert_eq!(l, "END\r\n");
        }
        assert_eq!(c.line(), "MN\r\n");
    }
    srv.shutdown();
}

#[test]
fn multiget_across_workers_keeps_request_order() {
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    let keys: Vec<String> = (0..100).map(|i| format!("mk{i}")).collect();
    for k in &keys {
        assert_eq!(c.set(k, k.as_bytes()), "STORED\r\n");
    }
    c.send(format!("get {}\r\n", keys.join(" ")).as_bytes());
    let lines = c.until_end();
    let got: Vec<&str> =
        lines.iter().filter(|l| l.starts_with("VALUE")).map(|l| l.split_whitespace().nth(1).unwrap()).collect();
    assert_eq!(got, keys.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    // Some requests crossed workers (two workers, 100 keys).
    assert!(stat(&mut c, "cross_worker_requests") > 0);
    srv.shutdown();
}

#[test]
fn flush_all_reaches_every_worker() {
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    for i in 0..50 {
        c.set(&format!("f{i}"), b"v");
    }
    assert_eq!(c.cmd("flush_all\r\n"), "OK\r\n");
    for i in 0..50 {
        assert_eq!(c.get(&format!("f{i}")), None, "f{i} survived flush_all");
    }
    assert_eq!(c.set("after", b"v"), "STORED\r\n");
    assert_eq!(c.get("after").as_deref(), Some(&b"v"[..]));
    srv.shutdown();
}

#[test]
fn flush_all_disabled_with_f() {
    let srv = start(mbal_server::config::Settings { flush_enabled: false, ..settings(1) });
    let mut c = Conn::open(srv.main_addr);
    assert_eq!(c.cmd("flush_all\r\n"), "CLIENT_ERROR flush_all not allowed\r\n");
    srv.shutdown();
}

#[test]
fn cas_disabled_with_c() {
    let srv = start(mbal_server::config::Settings { cas_enabled: false, ..settings(1) });
    let mut c = Conn::open(srv.main_addr);
    c.set("a", b"1");
    c.send(b"gets a\r\n");
    assert_eq!(c.line(), "VALUE a 0 1 0\r\n");
    c.exact(3);
    c.line();
    assert_eq!(c.cmd("cas a 0 0 1 0\r\nz\r\n"), "EXISTS\r\n");
    srv.shutdown();
}

#[test]
fn stats_groups_have_memcached_names() {
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    c.set("s1", b"v");
    c.get("s1");
    c.get("nope");
    let s = stats(&mut c, "");
    for name in [
        "pid",
        "uptime",
        "time",
        "version",
        "curr_connections",
        "total_connections",
        "cmd_get",
        "cmd_set",
        "get_hits",
        "get_misses",
        "bytes_read",
        "bytes_written",
        "limit_maxbytes",
        "threads",
        "curr_items",
        "total_items",
        "evictions",
        "bytes",
        "hash_bytes",
    ] {
        assert!(s.iter().any(|(k, _)| k == name), "stats lacks {name}");
    }
    assert!(stat(&mut c, "get_hits") >= 1);
    assert!(stat(&mut c, "get_misses") >= 1);
    assert_eq!(stat(&mut c, "threads"), 2);
    assert!(stat(&mut c, "hash_bytes") >= 64, "one item: at least one 64-byte index bucket");
    let settings = stats(&mut c, "settings");
    assert!(settings.iter().any(|(k, v)| k == "maxbytes" && v == &(32u64 << 20).to_string()));
    assert!(settings.iter().any(|(k, v)| k == "item_size_max" && v == "1048576"));
    let cl = stats(&mut c, "cachelets");
    let owners = cl.iter().filter(|(k, _)| k.ends_with(":owner")).count();
    assert_eq!(owners, 32, "2 workers x 16 cachelets");
    let items: u64 = cl.iter().filter(|(k, _)| k.ends_with(":items")).map(|(_, v)| v.parse::<u64>().unwrap()).sum();
    assert_eq!(items, 1);
    assert!(!stats(&mut c, "items").is_empty());
    assert!(!stats(&mut c, "slabs").is_empty());
    assert!(stats(&mut c, "conns").iter().any(|(k, _)| k.ends_with(":addr")));
    assert_eq!(c.cmd("stats bogus\r\n"), "ERROR\r\n");
    assert_eq!(c.cmd("stats reset\r\n"), "RESET\r\n");
    assert_eq!(stat(&mut c, "get_hits"), 0, "stats reset clears the command counters on every worker");
    assert_eq!(stat(&mut c, "get_misses"), 0);
    assert_eq!(stat(&mut c, "curr_items"), 1, "but not the items");
    srv.shutdown();
}

#[test]
fn meta_commands() {
    for threads in [1, 2] {
        let srv = start(settings(threads));
        let mut c = Conn::open(srv.main_addr);
        assert_eq!(c.cmd("ms mk 2 T0 F5\r\nhi\r\n"), "HD\r\n");
        c.send(b"mg mk v f s k O123\r\n");
        assert_eq!(c.line(), "VA 2 f5 s2 kmk O123\r\n");
        assert_eq!(c.exact(4), b"hi\r\n");
        assert_eq!(c.cmd("mg nothere v\r\n"), "EN\r\n");
        // quiet miss says nothing; mn terminates the pipeline.
        assert_eq!(c.cmd("mg nothere v q\r\nmn\r\n"), "MN\r\n");
        assert_eq!(c.cmd("ms mk 1 ME\r\nx\r\n"), "NS\r\n", "add mode on existing key");
        assert_eq!(c.cmd("ma cnt N0 J10\r\n"), "HD\r\n");
        c.send(b"ma cnt v D5\r\n");
        assert_eq!(c.line(), "VA 2\r\n");
        assert_eq!(c.exact(4), b"15\r\n");
        assert_eq!(c.cmd("md mk\r\n"), "HD\r\n");
        assert_eq!(c.cmd("md mk\r\n"), "NF\r\n");
        // q hides only HD: a quiet miss still says NF, as memcached 1.6 does.
        assert_eq!(c.cmd("md mk q\r\nmn\r\n"), "NF\r\n");
        assert_eq!(c.line(), "MN\r\n");
        // base64 key: "Zm9v" = "foo"; the text get sees the decoded key.
        assert_eq!(c.cmd("ms Zm9v 3 b\r\nbar\r\n"), "HD\r\n");
        assert_eq!(c.get("foo").as_deref(), Some(&b"bar"[..]));
        srv.shutdown();
    }
}

/// The `c<cas>` flag of a meta reply line.
fn cas_flag(line: &str) -> u64 {
    let tok = line.split_whitespace().find(|t| t.starts_with('c')).unwrap_or_else(|| panic!("no c flag: {line}"));
    tok[1..].parse().unwrap()
}

#[test]
fn meta_invalidate_and_explicit_cas() {
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    // ms I with a CAS older than the item's: stored, but stale, keeping the TTL; the next mg
    // wins the recache (W), later ones see Z (memcached 1.6.18 does the same).
    assert_eq!(c.cmd("ms a 1 T100\r\nx\r\n"), "HD\r\n");
    let x = cas_flag(&c.cmd("mg a c\r\n"));
    let y = cas_flag(&c.cmd(&format!("ms a 1 C{} I c T0\r\ny\r\n", x - 1)));
    assert_ne!(y, x);
    c.send(b"mg a c t v\r\n");
    let line = c.line();
    assert!(line.starts_with(&format!("VA 1 c{y} t")) && line.ends_with(" X W\r\n"), "{line}");
    let ttl: i64 = line.split_whitespace().nth(3).unwrap()[1..].parse().unwrap();
    assert!((98..=100).contains(&ttl), "the stale value keeps the old TTL: {line}");
    assert_eq!(c.exact(3), b"y\r\n");
    assert!(c.cmd("mg a c\r\n").ends_with(" Z X\r\n"));
    // a newer CAS than the item's is still a conflict; the item's own CAS clears the stale mark
    assert_eq!(c.cmd(&format!("ms a 1 C{} I c\r\nz\r\n", y + 1)), "EX c0\r\n");
    let z = cas_flag(&c.cmd(&format!("ms a 1 C{y} I c\r\nw\r\n")));
    assert_eq!(c.cmd("mg a c\r\n"), format!("HD c{z}\r\n"));
    assert_eq!(c.cmd("ms gone 1 C5 I c\r\nw\r\n"), "NF c0\r\n");

    // E: the client picks the new CAS (ms, ma, md I, mg N)
    assert_eq!(c.cmd("ms e 1 E777 c\r\nq\r\n"), "HD c777\r\n");
    assert_eq!(c.cmd("mg e c\r\n"), "HD c777\r\n");
    assert_eq!(c.cmd("ms e 1 C777\r\nr\r\n"), "HD\r\n", "a client-chosen CAS compares like any other");
    assert_eq!(c.cmd("ms n 1\r\n5\r\n"), "HD\r\n");
    c.send(b"ma n E900 c v\r\n");
    assert_eq!(c.line(), "VA 1 c900\r\n");
    assert_eq!(c.exact(3), b"6\r\n");
    let line = c.cmd("mg viv N30 E1234 c\r\n");
    assert!(line.starts_with("HD c1234") && line.contains(" W"), "{line}");
    assert_eq!(c.cmd("ms e 1 Exyz\r\nq\r\n"), "CLIENT_ERROR bad token in command line format\r\n");

    // md I: stale with a new CAS; a wrong C is EX (also with q), a missing key NF
    assert_eq!(c.cmd("ms b 1\r\nq\r\n"), "HD\r\n");
    let b = cas_flag(&c.cmd("mg b c\r\n"));
    assert_eq!(c.cmd(&format!("md b C{} I\r\n", b + 1)), "EX\r\n");
    c.send(format!("md b C{} I q\r\nmn\r\n", b + 1).as_bytes());
    assert_eq!((c.line(), c.line()), ("EX\r\n".to_string(), "MN\r\n".to_string()));
    assert_eq!(c.cmd(&format!("md b C{b} I\r\n")), "HD\r\n");
    let line = c.cmd("mg b c\r\n");
    assert!(cas_flag(&line) != b && line.ends_with(" X W\r\n"), "{line}");
    assert_eq!(c.cmd("md b I E4242\r\n"), "HD\r\n");
    assert!(c.cmd("mg b c\r\n").starts_with("HD c4242 "));
    assert_eq!(c.cmd("md nob I\r\n"), "NF\r\n");
    srv.shutdown();
}

#[test]
fn idle_connections_are_closed_after_idle_timeout() {
    let srv = start(mbal_server::config::Settings { idle_timeout: 1, ..settings(1) });
    let mut idle = Conn::open(srv.main_addr);
    assert!(idle.cmd("version\r\n").starts_with("VERSION"));
    // Await the server's close: the read blocks until EOF (Ok(0)); a read
    // timeout (10 s) would be an Err and fail the test.
    let mut b = [0u8; 1];
    assert_eq!(std::io::Read::read(&mut idle.r, &mut b).expect("EOF, not a timeout"), 0);
    let mut fresh = Conn::open(srv.main_addr);
    assert!(fresh.cmd("version\r\n").starts_with("VERSION"));
    srv.shutdown();
}

#[test]
fn set_after_flush_all_in_the_same_second_survives() {
    // memcached 1.6.18 (CAS on) keeps a value set right after flush_all in the same second,
    // and so does mbal: the flush covers items written before it, ordered by CAS within
    // the second (docs/protocol.md). Older memcached releases lost such a set.
    for threads in [1, 2] {
        let srv = start(settings(threads));
        let mut c = Conn::open(srv.main_addr);
        for i in 0..20 {
            assert_eq!(c.set(&format!("old{i}"), b"x"), "STORED\r\n");
        }
        c.send(b"flush_all\r\n");
        assert_eq!(c.line(), "OK\r\n");
        for i in 0..20 {
            assert_eq!(c.set(&format!("new{i}"), b"y"), "STORED\r\n");
        }
        for i in 0..20 {
            assert_eq!(c.get(&format!("old{i}")), None, "old{i} flushed");
            assert_eq!(c.get(&format!("new{i}")).as_deref(), Some(&b"y"[..]), "new{i} kept");
        }
        srv.shutdown();
    }
}

/// One side of `storage_commands_answer_alike_on_one_and_on_four_workers`: a
/// connection and the cas unique it last saw for each key.
struct Side {
    c: Conn,
    cas: std::collections::HashMap<String, u64>,
}

impl Side {
    /// Send one pipelined batch, closed by a meta no-op; return the replies
    /// with cas uniques replaced by `C` (each server numbers its own).
    fn batch(&mut self, cmds: &[Cmd]) -> Vec<String> {
        let mut req = String::new();
        for cmd in cmds {
            req += &cmd.text(&self.cas);
        }
        req += "mn\r\n";
        self.c.send(req.as_bytes());
        let mut out = Vec::new();
        loop {
            let l = self.c.line();
            if l == "MN\r\n" {
                return out;
            }
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() == 5 && f[0] == "VALUE" {
                self.cas.insert(f[1].to_string(), f[4].parse().unwrap());
                out.push(format!("VALUE {} {} {} C", f[1], f[2], f[3]));
            } else {
                out.push(l);
            }
        }
    }
}

/// A storage, read or delete command of the differential test.
enum Cmd {
    Store { verb: &'static str, key: String, flags: u32, exptime: i64, value: String, noreply: bool, good_cas: bool },
    Gets(Vec<String>),
    Delete(String),
    Incr(String),
    FlushAll,
}

impl Cmd {
    fn text(&self, cas: &std::collections::HashMap<String, u64>) -> String {
        match self {
            Cmd::Store { verb, key, flags, exptime, value, noreply, good_cas } => {
                let unique = match (verb, cas.get(key)) {
                    (&"cas", Some(c)) if *good_cas => format!(" {c}"),
                    (&"cas", _) => " 4611686018427387904".to_string(),
                    _ => String::new(),
                };
                let nr = if *noreply { " noreply" } else { "" };
                format!("{verb} {key} {flags} {exptime} {}{unique}{nr}\r\n{value}\r\n", value.len())
            }
            Cmd::Gets(keys) => format!("gets {}\r\n", keys.join(" ")),
            Cmd::Delete(key) => format!("delete {key}\r\n"),
            Cmd::Incr(key) => format!("incr {key} 7\r\n"),
            Cmd::FlushAll => "flush_all\r\n".to_string(),
        }
    }
}

#[test]
fn storage_commands_answer_alike_on_one_and_on_four_workers() {
    // With four workers three keys in four belong to a worker the connection does not
    // live on. On four threads their storage commands travel pre-parsed (flags, exptime,
    // cas unique, the value) and must come out as they do where nothing travels; with the
    // four workers on one thread they run on the owner's store directly (`near`), and must
    // keep the pipeline's order (a flush_all included) all the same.
    for (threads, direct) in [(4, false), (1, true)] {
        let mut s = settings(4);
        s.worker_threads = threads;
        answer_alike(s, direct);
    }
}

fn answer_alike(four: mbal_server::config::Settings, direct: bool) {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let (one, four) = (start(settings(1)), start(four));
    let mut a = Side { c: Conn::open(one.main_addr), cas: Default::default() };
    let mut b = Side { c: Conn::open(four.main_addr), cas: Default::default() };
    let key = |rng: &mut StdRng| format!("key:{}", rng.gen_range(0..40));
    for round in 0..300 {
        let cmds: Vec<Cmd> = (0..rng.gen_range(1..10))
            .map(|_| match rng.gen_range(0..60) {
                0..=35 => Cmd::Store {
                    verb: ["set", "set", "add", "replace", "append", "prepend", "cas", "cas"][rng.gen_range(0..8)],
                    key: key(&mut rng),
                    flags: [0, 1, u32::MAX, rng.gen()][rng.gen_range(0..4)],
                    exptime: [0, 0, 1000, -1][rng.gen_range(0..4)],
                    value: match rng.gen_range(0..4) {
                        0 => rng.gen_range(0..100u32).to_string(),
                        _ => (0..rng.gen_range(0..40)).map(|_| rng.gen_range(b'a'..=b'z') as char).collect(),
                    },
                    noreply: rng.gen_range(0..5) == 0,
                    good_cas: rng.gen_range(0..3) != 0,
                },
                36..=53 => Cmd::Gets((0..rng.gen_range(1..5)).map(|_| key(&mut rng)).collect()),
                54..=56 => Cmd::Delete(key(&mut rng)),
                57..=58 => Cmd::Incr(key(&mut rng)),
                _ => Cmd::FlushAll,
            })
            .collect();
        let (ra, rb) = (a.batch(&cmds), b.batch(&cmds));
        assert_eq!(ra, rb, "round {round}: one worker vs four (direct: {direct})");
    }
    assert!(stat(&mut b.c, "cross_worker_requests") > 1000, "most commands went to another worker");
    let direct_hops = stat(&mut b.c, "cross_worker_direct");
    if direct {
        assert!(direct_hops > 1000, "on one thread most went directly: {direct_hops}");
    } else {
        assert_eq!(direct_hops, 0, "on a thread each, every one was a message");
    }
    one.shutdown();
    four.shutdown();
}
