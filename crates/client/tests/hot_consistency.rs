//! Consistency under Phase 1, against real servers: a writer hammers hot
//! keys while routing clients read them from their copies under leases
//! (short leases, so they turn over many times) and write and read back
//! keys of their own. Every operation is recorded with its start and end
//! time, then checked:
//!
//! * read-your-writes: a client reads back what it wrote, at once;
//! * monotonic reads: per client and key, the versions read never go back;
//! * staleness: a read that starts after a write was answered returns that
//!   write or a newer one, or (async copies) is late by less than the
//!   copies' time to live; with `--replica-writes sync`, never late at all.

use mbal_client::{key_hash, Client, Config};
use mbal_member::ClusterSpec;
use mbal_server::config::Settings;
use mbal_server::ServerHandle;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WORKERS: u16 = 2;
const EPOCH_MS: u64 = 100;
const LEASE_EPOCHS: u32 = 3;
const WRITES: u64 = 600;
const READERS: usize = 3;

struct Op {
    key: usize,
    version: u64,
    start: Duration,
    end: Duration,
}

fn start(sync: bool) -> (ClusterSpec, Vec<ServerHandle>, Settings) {
    let spec = mbal_server::testing::loopback_spec(3, WORKERS);
    let mut last = Settings::default();
    let servers = (0..3)
        .map(|id| {
            let mut s = mbal_server::testing::hot_member(&spec, id, EPOCH_MS);
            s.hot.sync = sync;
            s.hot.policy.lease_epochs = LEASE_EPOCHS;
            last = s.clone();
            mbal_server::start(s).expect("server starts")
        })
        .collect();
    (spec, servers, last)
}

fn pin(spec: &ClusterSpec, key: &str, replicas: u32) {
    let map = spec.initial_map();
    let home = map.route(key_hash(key.as_bytes())).1;
    let s = TcpStream::connect(spec.servers[home as usize].addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut w = s.try_clone().unwrap();
    w.write_all(format!("mbal debug hot {key} {replicas}\r\n").as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    assert_eq!(line, "OK\r\n", "pin {key}");
}

fn version(c: &mut Client, key: &str) -> u64 {
    let v = c.get(key.as_bytes()).unwrap().expect("hot keys are never missing");
    String::from_utf8(v.data).unwrap().parse().unwrap()
}

fn run(sync: bool) {
    let (spec, servers, settings) = start(sync);
    let map = spec.initial_map();
    let hot: Vec<String> = (0..2).map(|i| format!("hammered{i}")).collect();
    let own: Vec<String> = (0..READERS).map(|i| format!("own{i}")).collect();
    let mut setup = Client::from_map(map.clone(), Config::default());
    for k in hot.iter().chain(&own) {
        assert!(setup.set(k.as_bytes(), b"0", 0, 0).unwrap());
        pin(&spec, k, 2);
    }
    let t0 = Instant::now();
    let done = Arc::new(AtomicBool::new(false));

    let writer = {
        let (map, hot, done) = (map.clone(), hot.clone(), done.clone());
        std::thread::spawn(move || {
            let mut c = Client::from_map(map, Config::default());
            let mut log = Vec::new();
            for n in 1..=WRITES {
                for (k, key) in hot.iter().enumerate() {
                    let start = t0.elapsed();
                    assert!(c.set(key.as_bytes(), n.to_string().as_bytes(), 0, 0).unwrap());
                    log.push(Op { key: k, version: n, start, end: t0.elapsed() });
                }
            }
            done.store(true, Ordering::Relaxed);
            log
        })
    };
    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let (map, hot, mine, done) = (map.clone(), hot.clone(), own[r].clone(), done.clone());
            std::thread::spawn(move || {
                let mut c = Client::from_map(map, Config::default());
                let mut log = Vec::new();
                let mut mine_v = 0u64;
                let deadline = Instant::now() + Duration::from_secs(60);
                for i in 0..200_000u64 {
                    if done.load(Ordering::Relaxed) || Instant::now() > deadline {
                        break;
                    }
                    for (k, key) in hot.iter().enumerate() {
                        let start = t0.elapsed();
                        let version = version(&mut c, key);
                        log.push(Op { key: k, version, start, end: t0.elapsed() });
                    }
                    if i % 8 == 0 {
                        // Read-your-writes on a hot key of its own.
                        mine_v += 1;
                        assert!(c.set(mine.as_bytes(), mine_v.to_string().as_bytes(), 0, 0).unwrap());
                        assert_eq!(version(&mut c, &mine), mine_v, "reader {r} reads its write {mine_v}");
                        assert_eq!(version(&mut c, &mine), mine_v, "and again");
                    }
                }
                (log, c.replica_reads())
            })
        })
        .collect();
    let writes = writer.join().unwrap();
    let mut copy_reads = 0;
    let mut reads = 0usize;
    let mut late = Duration::ZERO;
    let bound = Duration::from_millis(settings.hot.copy_ttl_ms());
    for (r, h) in readers.into_iter().enumerate() {
        let (log, replica_reads) = h.join().unwrap();
        copy_reads += replica_reads;
        reads += log.len();
        let mut last = vec![0u64; hot.len()];
        for op in &log {
            assert!(
                op.version >= last[op.key],
                "reader {r}: key {} went back from {} to {}",
                op.key,
                last[op.key],
                op.version
            );
            last[op.key] = op.version;
            // The newest write answered before this read started.
            let newer = writes.iter().filter(|w| w.key == op.key && w.end < op.start && w.version > op.version);
            if let Some(first) = newer.min_by_key(|w| w.version) {
                let by = op.start - first.end;
                late = late.max(by);
                assert!(
                    !sync,
                    "reader {r}: stale read in sync mode: key {} version {} after {} was answered",
                    op.key, op.version, first.version
                );
                assert!(
                    by < bound,
                    "reader {r}: key {} read {} {by:?} after {} was answered (bound {bound:?})",
                    op.key,
                    op.version,
                    first.version
                );
            }
        }
    }
    assert!(copy_reads > 100, "the readers read copies ({copy_reads} of {reads} reads)");
    eprintln!(
        "{} copies: {reads} reads, {copy_reads} at copies, {} writes; stalest read {late:?} (bound {bound:?})",
        if sync { "sync" } else { "async" },
        writes.len()
    );
    for s in servers {
        s.shutdown();
    }
}

#[test]
fn async_copies_read_your_writes_monotonic_and_bounded_staleness() {
    run(false);
}

#[test]
fn sync_copies_never_serve_a_stale_read() {
    run(true);
}
