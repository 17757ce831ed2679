use super::ext::ExtKind;
use super::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    a: ServerArgs,
}

fn parse(args: &[&str]) -> Result<Settings> {
    parse_noted(args).map(|(s, _)| s)
}

fn parse_noted(args: &[&str]) -> Result<(Settings, Vec<String>)> {
    let mut v = vec!["mbal"];
    v.extend_from_slice(args);
    Cli::try_parse_from(v).map_err(anyhow::Error::from)?.a.resolve()
}

#[test]
fn worker_capacity_from_the_flag_and_the_config_file() {
    assert_eq!(parse(&["--worker-capacity", "50000"]).unwrap().worker_capacity, 50_000);
    assert_eq!(parse(&[]).unwrap().worker_capacity, 0, "unlimited unless asked");
    let dir = std::env::temp_dir().join(format!("mbal-cap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("mbal.toml");
    std::fs::write(&f, "worker_capacity = 1234\n").unwrap();
    assert_eq!(parse(&["--config", f.to_str().unwrap()]).unwrap().worker_capacity, 1234);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn balancer_flags_and_their_default() {
    let s = parse(&[]).unwrap();
    assert!(!s.balancer, "off for a stand-alone server");
    let s = parse(&[
        "--balancer",
        "on",
        "--balance-persistence",
        "2",
        "--balance-trigger",
        "1.5",
        "--balance-target",
        "1.05",
        "--balance-server-load-thresh",
        "0.5",
        "--balance-lease-epochs",
        "7",
        "--balance-planner",
        "greedy",
    ])
    .unwrap();
    assert!(s.balancer);
    let b = &s.balance;
    assert_eq!((b.persistence, b.lease_epochs), (2, 7));
    assert_eq!((b.trigger_max_over_avg, b.target_max_over_avg, b.server_load_thresh), (1.5, 1.05, 0.5));
    assert_eq!(b.planner, mbal_balance::Planner::Greedy);
    for bad in [
        &["--balancer", "maybe"][..],
        &["--balance-persistence", "0"],
        &["--balance-trigger", "0.9"],
        &["--balance-planner", "magic"],
    ] {
        assert!(parse(bad).is_err(), "{bad:?} accepted");
    }
}

#[test]
fn phase_1_decides_every_500_ms_epoch_and_phase_2_every_second() {
    let s = parse(&[]).unwrap();
    assert_eq!((s.epoch_ms, s.balance_epoch_ms, s.balance_every()), (500, 1000, 2));
    assert_eq!(s.hot.epoch_ms, 500, "Phase 1's leases count the sampling epoch");
    let s = parse(&["--epoch-ms", "1000"]).unwrap();
    assert_eq!(s.balance_every(), 1);
    let s = parse(&["--epoch-ms", "300", "--balance-epoch-ms", "1000"]).unwrap();
    assert_eq!(s.balance_every(), 3, "rounded to whole epochs");
    let s = parse(&["--epoch-ms", "2000"]).unwrap();
    assert_eq!(s.balance_every(), 1, "never less than an epoch");
    assert!(parse(&["--balance-epoch-ms", "0"]).is_err());
}

#[test]
fn memcached_flags() {
    let s = parse(&[
        "-p",
        "12000",
        "-t",
        "2",
        "-m",
        "128",
        "-c",
        "10",
        "-I",
        "2m",
        "-M",
        "-C",
        "-F",
        "-U",
        "0",
        "-B",
        "ascii",
        "-R",
        "5",
        "-A",
        "-vv",
        "-o",
        "idle_timeout=30",
    ])
    .unwrap();
    assert_eq!(s.port, 12000);
    assert_eq!(s.threads, 2);
    assert_eq!(s.memory_limit, 128 << 20);
    assert_eq!(s.max_conns, 10);
    assert_eq!(s.max_item_size, 2 << 20);
    assert!(!s.evictions && !s.cas_enabled && !s.flush_enabled && s.shutdown_enabled);
    assert_eq!(s.binding, Binding::Ascii);
    assert_eq!(s.reqs_per_event, 5);
    assert_eq!(s.verbosity, 2);
    assert_eq!(s.idle_timeout, 30);
}

#[test]
fn defaults() {
    let s = parse(&[]).unwrap();
    assert_eq!(s.port, 11211);
    assert_eq!(s.listen.to_string(), "127.0.0.1");
    assert_eq!(s.memory_limit, 64 << 20);
    assert_eq!(s.max_item_size, 1 << 20);
    assert_eq!(s.max_conns, 1024);
    assert!(s.evictions && s.cas_enabled && s.flush_enabled);
}

#[test]
fn too_many_pages_is_an_error() {
    // 2 TiB in 64 KiB pages is 32M pages: more than a cachelet's index can address
    let e = parse(&["-m", "2097152"]).unwrap_err().to_string();
    assert!(e.contains("--page-size-kb"), "{e}");
    assert!(parse(&["-m", "2097152", "--page-size-kb", "1024"]).is_ok());
}

#[test]
fn unsupported_is_an_error() {
    for bad in [&["-d"][..], &["-U", "11211"], &["-f", "1.25"], &["-B", "udp"]] {
        let e = parse(bad).unwrap_err().to_string();
        assert!(e.contains("not supported") || e.contains("must be") || e.contains("UDP"), "{bad:?}: {e}");
    }
    assert!(parse(&["--no-such-flag"]).is_err());
}

#[test]
fn config_file_and_precedence() {
    let dir = std::env::temp_dir().join(format!("mbal-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("c.toml");
    std::fs::write(&f, "port = 13000\nmemory_limit = 32\nmax_item_size = \"512k\"\ncachelets_per_worker = 8\n")
        .unwrap();
    let s = parse(&["--config", f.to_str().unwrap(), "-p", "14000"]).unwrap();
    assert_eq!(s.port, 14000, "command line wins");
    assert_eq!(s.memory_limit, 32 << 20);
    assert_eq!(s.max_item_size, 512 << 10);
    assert_eq!(s.cachelets_per_worker, 8);
    std::fs::write(&f, "bogus = 1\n").unwrap();
    assert!(parse(&["--config", f.to_str().unwrap()]).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sizes() {
    assert_eq!(parse_size("1m").unwrap(), 1 << 20);
    assert_eq!(parse_size("512k").unwrap(), 512 << 10);
    assert_eq!(parse_size("4096").unwrap(), 4096);
    assert!(parse_size("x").is_err());
}
/// Every `-o` option of memcached 1.6.18 (memcached.c's `subopts_tokens` and extstore's
/// `storage_read_config`, builds with TLS and proxy), with a valid value, and what mbal
/// does with it.
#[derive(Debug, PartialEq)]
enum Expect {
    Implemented,
    NoEffect,
    Refused,
}

const MEMCACHED_EXTENDED: &[(&str, Expect)] = {
    use Expect::*;
    &[
        ("maxconns_fast", Implemented),
        ("no_maxconns_fast", Implemented),
        ("hashpower=16", NoEffect),
        ("no_hashexpand", NoEffect),
        ("slab_reassign", NoEffect),
        ("no_slab_reassign", NoEffect),
        ("slab_automove", NoEffect),
        ("slab_automove=2", NoEffect),
        ("no_slab_automove", NoEffect),
        ("slab_automove_ratio=0.8", NoEffect),
        ("slab_automove_window=30", NoEffect),
        ("slab_automove_freeratio=0.01", NoEffect),
        ("tail_repair_time=60", NoEffect),
        ("hash_algorithm=murmur3", NoEffect),
        ("hash_algorithm=jenkins", NoEffect),
        ("hash_algorithm=xxh3", NoEffect),
        ("lru_crawler", NoEffect),
        ("no_lru_crawler", NoEffect),
        ("lru_crawler_sleep=100", NoEffect),
        ("lru_crawler_tocrawl=0", NoEffect),
        ("lru_maintainer", NoEffect),
        ("no_lru_maintainer", NoEffect),
        ("hot_lru_pct=20", NoEffect),
        ("warm_lru_pct=40", NoEffect),
        ("hot_max_factor=0.2", NoEffect),
        ("warm_max_factor=2.0", NoEffect),
        ("temporary_ttl=61", NoEffect),
        ("idle_timeout=30", Implemented),
        ("watcher_logbuf_size=256", NoEffect),
        ("worker_logbuf_size=64", NoEffect),
        ("slab_sizes=96-192-384", NoEffect),
        ("slab_chunk_max=16384", NoEffect),
        ("track_sizes", Implemented),
        ("no_inline_ascii_resp", Implemented),
        ("inline_ascii_resp", Implemented),
        ("modern", Implemented),
        ("no_modern", Implemented),
        ("no_chunked_items", NoEffect),
        ("no_drop_privileges", Implemented),
        ("drop_privileges", Refused),
        ("resp_obj_mem_limit", NoEffect),
        ("read_buf_mem_limit=0", NoEffect),
        ("sock_cookie_id=7", Implemented),
        ("ssl_chain_cert=c.pem", Implemented),
        ("ssl_key=k.pem", Implemented),
        ("ssl_verify_mode=0", Implemented),
        ("ssl_keyformat=0", NoEffect),
        ("ssl_ciphers=ALL", NoEffect),
        ("ssl_ca_cert=ca.pem", Implemented),
        ("ssl_wbuf_size=16", NoEffect),
        ("ssl_session_cache", NoEffect),
        ("ssl_kernel_tls", NoEffect),
        ("ssl_min_version=2", Implemented),
        ("proxy_config=p.lua", Refused),
        ("proxy_uring", Refused),
        ("ext_path=/tmp/extstore:1G", Refused),
        ("ext_page_size=64", NoEffect),
        ("ext_wbuf_size=4", NoEffect),
        ("ext_threads=1", NoEffect),
        ("ext_io_depth=1", NoEffect),
        ("ext_item_size=512", NoEffect),
        ("ext_item_age=10", NoEffect),
        ("ext_low_ttl=0", NoEffect),
        ("ext_recache_rate=2000", NoEffect),
        ("ext_compact_under=4", NoEffect),
        ("ext_drop_under=4", NoEffect),
        ("ext_max_sleep=1000000", NoEffect),
        ("ext_max_frag=0.8", NoEffect),
        ("ext_drop_unread", NoEffect),
    ]
};

#[test]
fn every_memcached_extended_option() {
    for (opt, want) in MEMCACHED_EXTENDED {
        // The TLS options need TLS on (-Z, with a certificate): without it they are an error
        // (tested in `tls_options`), not silently unused.
        let got = match opt.starts_with("ssl_") {
            true => parse_noted(&["-Z", "-o", "ssl_chain_cert=c.pem", "-o", opt]),
            false => parse_noted(&["-o", opt]),
        };
        match (want, got) {
            (Expect::Refused, Err(e)) => {
                let e = e.to_string();
                assert!(e.contains("is not supported by mbal: "), "{opt}: {e}");
            }
            (Expect::NoEffect, Ok((_, notes))) => {
                assert_eq!(notes.len(), 1, "{opt}: one log line");
                assert!(notes[0].contains("accepted, no effect in mbal: "), "{opt}: {notes:?}");
            }
            (Expect::Implemented, Ok((_, notes))) => {
                assert!(notes.len() <= 1, "{opt}: {notes:?}");
                let mut layer = ServerArgs::default();
                let (kind, _) = extended_option(&mut layer, opt).unwrap();
                assert_eq!(kind, ExtKind::Implemented, "{opt}");
            }
            (w, g) => panic!("{opt}: expected {w:?}, got {:?}", g.map(|(_, n)| n)),
        }
    }
}

#[test]
fn extended_options_take_effect() {
    let s = parse(&["-o", "modern,idle_timeout=7,sock_cookie_id=42,track_sizes", "-o", "no_maxconns_fast"]).unwrap();
    assert_eq!((s.idle_timeout, s.sock_cookie_id, s.maxconns_fast, s.track_sizes), (7, 42, false, true));
    assert!(parse(&[]).unwrap().maxconns_fast, "memcached's default");
    assert!(!parse(&[]).unwrap().track_sizes, "memcached's default");
    // no_modern is a bundle: its one part mbal has is the connection limit's behaviour
    let (s, notes) = parse_noted(&["-o", "no_modern"]).unwrap();
    assert!(!s.maxconns_fast);
    assert_eq!(notes.len(), 1, "{notes:?}");
    // later options win, as in memcached
    let s = parse(&["-o", "no_modern", "-o", "maxconns_fast,idle_timeout=1,idle_timeout=2"]).unwrap();
    assert!(s.maxconns_fast);
    assert_eq!(s.idle_timeout, 2);
    // one log line per accepted-without-effect option
    let (_, notes) = parse_noted(&["-o", "slab_reassign,slab_automove=1", "-o", "lru_crawler"]).unwrap();
    assert_eq!(notes.len(), 3, "{notes:?}");
}

#[test]
fn extended_option_errors_are_memcacheds() {
    for (opt, msg) in [
        ("bogus", "unknown option"),
        ("idle_timeout", "missing value"),
        ("idle_timeout=x", "bad value"),
        ("hash_algorithm=md5", "unknown 'md5'"),
        ("hash_algorithm", "missing value"),
        ("slab_automove=5", "between 0 and 2"),
        ("hashpower=8", "between 12 and 32"),
        ("tail_repair_time=5", "at least 10"),
        ("hot_lru_pct=80", "between 1 and 79"),
        ("slab_automove_ratio=2", "<= 1"),
        ("slab_sizes=96-x", "separated by '-'"),
        ("lru_crawler_sleep=2000000", "1000000"),
    ] {
        let e = parse(&["-o", opt]).unwrap_err().to_string();
        assert!(e.contains(msg), "{opt}: {e}");
    }
    // an error anywhere in a list stops the start
    assert!(parse(&["-o", "modern,bogus"]).is_err());
}

#[test]
fn item_size_limits_are_memcacheds() {
    // -I at most half of -m, and at most 1g
    let e = parse(&["-m", "64", "-I", "33m"]).unwrap_err().to_string();
    assert!(e.contains("half of -m"), "{e}");
    assert_eq!(parse(&["-m", "64", "-I", "32m"]).unwrap().max_item_size, 32 << 20);
    let e = parse(&["-m", "1"]).unwrap_err().to_string();
    assert!(e.contains("half of -m"), "the default -I of 1m needs -m 2: {e}");
    assert_eq!(parse(&["-m", "4096", "-I", "1g"]).unwrap().max_item_size, 1 << 30);
    let e = parse(&["-m", "4096", "-I", "1025m"]).unwrap_err().to_string();
    assert!(e.contains("1g"), "{e}");
    let e = parse(&["-I", "1000"]).unwrap_err().to_string();
    assert!(e.contains("at least 1k"), "{e}");
}

#[test]
fn layers_merge_key_by_key() {
    let dir = std::env::temp_dir().join(format!("mbal-cfg-layers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("c.toml");
    std::fs::write(
        &f,
        "threads = 3\nmax_reqs_per_event = 9\nlisten_backlog = 77\nprotocol = \"binary\"\n\
         disable_cas = true\nverbosity = 1\nmax_item_size = 2097152\nextended = [\"idle_timeout=5\"]\n",
    )
    .unwrap();
    let fs = f.to_str().unwrap();
    let s = parse(&["--config", fs]).unwrap();
    assert_eq!((s.threads, s.reqs_per_event, s.backlog), (3, 9, 77));
    assert_eq!(s.binding, Binding::Binary);
    assert!(!s.cas_enabled);
    assert_eq!((s.verbosity, s.max_item_size, s.idle_timeout), (1, 2 << 20, 5));
    // each key the command line gives wins; the rest stay the file's
    let s = parse(&["--config", fs, "-t", "2", "-vv", "-B", "ascii", "-o", "idle_timeout=6"]).unwrap();
    assert_eq!((s.threads, s.reqs_per_event, s.backlog, s.verbosity, s.idle_timeout), (2, 9, 77, 2, 6));
    assert_eq!(s.binding, Binding::Ascii);
    assert!(!s.cas_enabled, "a flag not given on the command line leaves the file's");
    // a bad value in the file names the file
    std::fs::write(&f, "protocol = \"udp\"\n").unwrap();
    let e = parse(&["--config", fs]).unwrap_err().to_string();
    assert!(e.contains("c.toml") && e.contains("-B must be"), "{e}");
    // command-line-only options are not file keys
    std::fs::write(&f, "print_ports = true\n").unwrap();
    assert!(parse(&["--config", fs]).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
    let e = parse(&["--config", "/nonexistent/mbal.toml"]).unwrap_err();
    assert!(format!("{e:#}").contains("reading config file /nonexistent/mbal.toml"), "{e:#}");
}

#[test]
fn tls_options() {
    let s = parse(&["-Z", "-o", "ssl_chain_cert=c.pem,ssl_key=k.pem,ssl_ca_cert=ca.pem,ssl_verify_mode=3"]).unwrap();
    let t = s.tls.unwrap();
    assert_eq!(t.chain_cert, PathBuf::from("c.pem"));
    assert_eq!(t.key, Some(PathBuf::from("k.pem")));
    assert_eq!(t.ca_cert, Some(PathBuf::from("ca.pem")));
    assert_eq!(t.verify_mode, mbal_tls::VerifyMode::Required);
    assert!(!t.tls13_only);
    let s = parse(&["--enable-ssl", "-o", "ssl_chain_cert=c.pem", "-o", "ssl_min_version=tlsv1.3"]).unwrap();
    let t = s.tls.unwrap();
    assert_eq!((t.key, t.verify_mode, t.tls13_only), (None, mbal_tls::VerifyMode::None, true));
    assert!(parse(&[]).unwrap().tls.is_none());
    for (bad, why) in [
        (&["-Z"][..], "ssl_chain_cert"),
        (&["-o", "ssl_key=k.pem"], "need -Z"),
        (&["-Z", "-o", "ssl_chain_cert=c.pem,ssl_verify_mode=2"], "ssl_ca_cert"),
        (&["-Z", "-o", "ssl_chain_cert=c.pem,ssl_verify_mode=4"], "must be 0"),
        (&["-Z", "-o", "ssl_chain_cert=c.pem,ssl_min_version=9"], "ssl_min_version"),
    ] {
        let e = parse(bad).unwrap_err().to_string();
        assert!(e.contains(why), "{bad:?}: {e}");
    }
}

#[test]
fn auth_and_limit_options() {
    let dir = std::env::temp_dir().join(format!("mbal-auth-args-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let users = dir.join("users");
    std::fs::write(&users, "foo:bar\n").unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123\n").unwrap();
    let e = parse(&["-S"]).unwrap_err().to_string();
    assert!(e.contains("-Y"), "{e}");
    let s = parse(&["-Y", users.to_str().unwrap(), "-S"]).unwrap();
    assert!(s.auth.as_ref().unwrap().check(b"foo", b"bar"));
    assert!(parse(&["-Y", dir.join("missing").to_str().unwrap()]).is_err());
    let s = parse(&["--control-secret-file", secret.to_str().unwrap()]).unwrap();
    assert_eq!(s.control_secret.unwrap().bytes(), b"0123456789abcdef0123");
    std::fs::write(dir.join("short"), "short").unwrap();
    assert!(parse(&["--control-secret-file", dir.join("short").to_str().unwrap()]).is_err());
    let s = parse(&["--max-conns-per-ip", "3", "--max-input-buffer", "64k", "--request-timeout-ms", "250"]).unwrap();
    assert_eq!((s.max_conns_per_ip, s.max_input_buffer, s.request_timeout_ms), (3, 64 << 10, 250));
    let d = parse(&[]).unwrap();
    assert_eq!((d.max_conns_per_ip, d.max_input_buffer, d.request_timeout_ms), (0, 0, 30_000));
    assert!(d.auth.is_none() && d.control_secret.is_none());
    // A cluster file's secret (relative secret_file: next to the cluster file).
    let cluster = dir.join("cluster.toml");
    std::fs::write(&cluster, "workers = 1\nsecret_file = \"secret\"\n[[servers]]\naddr = \"127.0.0.1:0\"\n").unwrap();
    let s = parse(&["--cluster", cluster.to_str().unwrap(), "--id", "0"]).unwrap();
    assert_eq!(s.control_secret.unwrap().bytes(), b"0123456789abcdef0123");
    let e = parse(&[
        "--cluster",
        cluster.to_str().unwrap(),
        "--id",
        "0",
        "--control-secret-file",
        secret.to_str().unwrap(),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("one place"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn cluster_file_tls_section() {
    let pki = mbal_tls::test_certs::Pki::new("args");
    pki.server("member");
    pki.server("own");
    pki.client("peer");
    let cluster = pki.dir.join("cluster.toml");
    std::fs::write(
        &cluster,
        "workers = 1\n[[servers]]\naddr = \"127.0.0.1:0\"\n[tls]\nca_cert = \"ca.pem\"\ncert = \"member.pem\"\n\
         key = \"member.key\"\nverify_mode = 2\nclient_cert = \"peer.pem\"\nclient_key = \"peer.key\"\n",
    )
    .unwrap();
    let c = cluster.to_str().unwrap();
    // The file's [tls]: the listeners speak TLS (no -Z needed) and the
    // member's own connections use its client certificate.
    let s = parse(&["--cluster", c, "--id", "0"]).unwrap();
    let t = s.tls.as_ref().unwrap();
    assert_eq!(t.chain_cert, pki.dir.join("member.pem"));
    assert_eq!(t.ca_cert.as_deref(), Some(pki.ca().as_path()));
    assert_eq!(t.verify_mode, mbal_tls::VerifyMode::Required);
    assert!(s.peer_tls.is_some());
    // -Z -o ssl_* on the command line wins for the listener (a member's own
    // certificate); the peers' side still comes from the file.
    let own =
        format!("ssl_chain_cert={},ssl_key={}", pki.dir.join("own.pem").display(), pki.dir.join("own.key").display());
    let s = parse(&["--cluster", c, "--id", "0", "-Z", "-o", &own]).unwrap();
    assert_eq!(s.tls.as_ref().unwrap().chain_cert, pki.dir.join("own.pem"));
    assert_eq!(s.tls.as_ref().unwrap().verify_mode, mbal_tls::VerifyMode::None);
    assert!(s.peer_tls.is_some());
    // A missing file is named.
    std::fs::write(&cluster, "workers = 1\n[[servers]]\naddr = \"127.0.0.1:0\"\n[tls]\nca_cert = \"nope.pem\"\n")
        .unwrap();
    let e = format!("{:#}", parse(&["--cluster", c, "--id", "0"]).unwrap_err());
    assert!(e.contains("nope.pem"), "{e}");
}

#[test]
fn forward_flag() {
    let d = parse(&[]).unwrap();
    assert!(!d.forward, "off by default");
    assert_eq!(d.forward_timeout_ms, 1000);
    let s = parse(&["--forward", "--forward-timeout-ms", "250"]).unwrap();
    assert!(s.forward);
    assert_eq!(s.forward_timeout_ms, 250);
}

#[test]
fn hot_sampling_flags() {
    let p = parse(&[]).unwrap().hot.policy;
    assert_eq!((p.sample_target, p.sample_min, p.sample_max, p.displace), (100.0, 0.0001, 0.25, true));
    // A rate given alone is a fixed rate; with a target, the first epoch's.
    let p = parse(&["--hot-sample-rate", "0.05"]).unwrap().hot.policy;
    assert_eq!((p.sample_rate, p.sample_target), (0.05, 0.0));
    let p = parse(&["--hot-sample-rate", "0.05", "--hot-sample-target", "200"]).unwrap().hot.policy;
    assert_eq!((p.sample_rate, p.sample_target), (0.05, 200.0));
    let p =
        parse(&["--hot-sample-min", "0.001", "--hot-sample-max", "0.5", "--hot-displace", "off"]).unwrap().hot.policy;
    assert_eq!((p.sample_min, p.sample_max, p.displace), (0.001, 0.5, false));
    for bad in [
        &["--hot-sample-target", "-1"][..],
        &["--hot-sample-max", "0"],
        &["--hot-sample-min", "0.5", "--hot-sample-max", "0.1"],
    ] {
        assert!(parse(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn replica_writes_per_server_or_per_key_prefix() {
    let h = parse(&["--replica-writes", "async"]).unwrap().hot;
    assert!(!h.may_sync() && !h.sync_for(b"user:1"));
    let h = parse(&["--replica-writes", "sync"]).unwrap().hot;
    assert!(h.sync_for(b"user:1") && h.sync_for(b"x"));
    let h = parse(&["--replica-writes", "sync:user:,acct:"]).unwrap().hot;
    assert!(h.may_sync() && !h.sync);
    assert!(h.sync_for(b"user:1") && h.sync_for(b"acct:9"));
    assert!(!h.sync_for(b"session:1") && !h.sync_for(b"use"));
    assert_eq!(h.writes_mode(), "sync:user:,acct:");
    for bad in ["sync:", "sync:,", "maybe"] {
        assert!(parse(&["--replica-writes", bad]).is_err(), "{bad}");
    }
}

#[test]
fn coordinators_are_a_list_on_the_command_line_and_in_the_config_file() {
    let a: std::net::SocketAddr = "127.0.0.1:7001".parse().unwrap();
    let b: std::net::SocketAddr = "127.0.0.1:7002".parse().unwrap();
    let cli = Cli::try_parse_from(["mbal", "--coordinator", "127.0.0.1:7001,127.0.0.1:7002"]).unwrap();
    assert_eq!(cli.a.coordinator, Some(vec![a, b]));
    let one: ServerArgs = toml::from_str("coordinator = \"127.0.0.1:7001\"").unwrap();
    assert_eq!(one.coordinator, Some(vec![a]));
    let many: ServerArgs = toml::from_str("coordinator = [\"127.0.0.1:7001\", \"127.0.0.1:7002\"]").unwrap();
    assert_eq!(many.coordinator, Some(vec![a, b]));
    // Layers merge through their TOML form.
    assert_eq!(many.merged(&ServerArgs::default()).unwrap().coordinator, Some(vec![a, b]));
    assert_eq!(ServerArgs::default().merged(&one).unwrap().coordinator, Some(vec![a]));
    assert!(parse(&["--coordinator", "127.0.0.1:7001"]).unwrap_err().to_string().contains("--cluster"));
}

#[test]
fn the_generated_config_file_has_every_option_and_its_defaults_parse() {
    let text = super::default_config_file();
    let keys = super::config_keys();
    assert!(keys.len() > 50 && keys.contains(&"port".to_string()), "{keys:?}");
    for k in &keys {
        assert!(text.lines().any(|l| l.starts_with(&format!("#{k} ="))), "{k} missing from\n{text}");
    }
    // As shipped (all commented out): the defaults.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mbal.toml");
    std::fs::write(&path, &text).unwrap();
    let args = ServerArgs { config: Some(path.clone()), ..ServerArgs::default() };
    let (shipped, _) = args.resolve().unwrap();
    // Every stated default uncommented: the same settings.
    let uncommented: String = text
        .lines()
        .map(|l| match l.strip_prefix('#') {
            Some(kv) if !kv.starts_with(' ') && !kv.trim_end().ends_with('=') => kv,
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&path, &uncommented).unwrap();
    let (explicit, _) = args.resolve().unwrap_or_else(|e| panic!("{e:#}\n{uncommented}"));
    assert_eq!(format!("{shipped:?}"), format!("{explicit:?}"), "a stated default is not the default");
}
