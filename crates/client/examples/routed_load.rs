//! An open-loop load of routing clients that records every operation (for
//! `scripts/fault-kill.py`, which measures a server killed under load).
//!
//!     routed_load <any-server> <ops/s> <threads> <start-unix-s> <end-unix-s> <keys> <seed> <out.csv>
//!
//! `threads` routing clients ([`mbal_client::Client`], default `Config`: connect timeout 1 s,
//! I/O timeout 5 s), each its own thread, share the rate; from the wall-clock time `start` to
//! `end` each sends its operations at fixed intervals (a late one is sent at once; its latency
//! counts from when it was due): 90% `get`, 10% `set` of key `fk:<i>`, `i` uniform below `keys`,
//! with the value `<i>:<tag>:` + padding (a hit whose value names another key is `corrupt`).
//! Written at the end, one line per operation: intended, sent, done (Unix seconds), key index,
//! `get`|`set`, `hit`|`miss`|`stored`|`not_stored`|`error`|`corrupt`, the error (quoted).
//! The clock is the wall clock because the caller is another process.

use mbal_client::{Client, Config};
use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_secs_f64()
}

/// A small deterministic generator (SplitMix64): the load only needs spread, not quality.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

struct Op {
    intended: f64,
    sent: f64,
    done: f64,
    key: u64,
    set: bool,
    outcome: &'static str,
    msg: String,
}

#[allow(clippy::too_many_arguments)]
fn client(
    server: SocketAddr,
    period: f64,
    phase: f64,
    start: f64,
    end: f64,
    keys: u64,
    seed: u64,
    tag: usize,
) -> Vec<Op> {
    let mut c = Client::connect(server, Config::default()).expect("the first map");
    let mut rng = Rng(seed);
    let pad = [b'x'; 64];
    let mut ops = Vec::new();
    for i in 0u64.. {
        let intended = start + phase + i as f64 * period;
        if intended >= end {
            break;
        }
        let t = now();
        if t < intended {
            std::thread::sleep(Duration::from_secs_f64(intended - t));
        }
        let k = rng.next() % keys;
        let set = rng.next().is_multiple_of(10);
        let key = format!("fk:{k}");
        let sent = now();
        let (outcome, msg) = if set {
            let mut v = format!("{k}:r{tag}.{i}:").into_bytes();
            v.extend_from_slice(&pad);
            match c.set(key.as_bytes(), &v, 0, 0) {
                Ok(true) => ("stored", String::new()),
                Ok(false) => ("not_stored", String::new()),
                Err(e) => ("error", e.to_string()),
            }
        } else {
            match c.get(key.as_bytes()) {
                Ok(None) => ("miss", String::new()),
                Ok(Some(v)) if v.data.starts_with(format!("{k}:").as_bytes()) => ("hit", String::new()),
                Ok(Some(v)) => ("corrupt", String::from_utf8_lossy(&v.data[..v.data.len().min(40)]).into_owned()),
                Err(e) => ("error", e.to_string()),
            }
        };
        ops.push(Op { intended, sent, done: now(), key: k, set, outcome, msg });
    }
    ops
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 9 {
        eprintln!(
            "usage: routed_load <any-server> <ops/s> <threads> <start-unix-s> <end-unix-s> <keys> <seed> <out.csv>"
        );
        std::process::exit(2);
    }
    let server: SocketAddr = a[1].parse().expect("HOST:PORT");
    let rate: f64 = a[2].parse().expect("ops/s");
    let threads: usize = a[3].parse().expect("threads");
    let (start, end): (f64, f64) = (a[4].parse().expect("start"), a[5].parse().expect("end"));
    let keys: u64 = a[6].parse().expect("keys");
    let seed: u64 = a[7].parse().expect("seed");
    assert!(rate > 0.0 && threads > 0 && keys > 0 && end > start && end - start < 600.0, "bad arguments");
    let period = threads as f64 / rate;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let phase = period * t as f64 / threads as f64;
            let s = seed.wrapping_mul(1000).wrapping_add(t as u64);
            std::thread::spawn(move || client(server, period, phase, start, end, keys, s, t))
        })
        .collect();
    let mut out = std::io::BufWriter::new(std::fs::File::create(&a[8]).expect("the output file"));
    for h in handles {
        for o in h.join().expect("a load thread") {
            let op = if o.set { "set" } else { "get" };
            writeln!(out, "{:.6},{:.6},{:.6},{},{op},{},{:?}", o.intended, o.sent, o.done, o.key, o.outcome, o.msg)
                .expect("writing");
        }
    }
    out.flush().expect("writing");
}
