//! The servers' own per-worker load during a run: one side thread per mbal server asks its
//! controller `mbal load <after>` (docs/protocol.md), which answers with the next epoch
//! snapshot ([`mbal_balance::EpochSnapshot`]) as soon as that epoch ends. So the thread reads
//! every epoch in turn and never sleeps: each request blocks until there is something new.
//!
//! Times: a snapshot's `end_ns` is on the server's clock; the bench places an epoch on its own
//! time axis by when the answer arrived (an epoch's answer to a caller that keeps up leaves the
//! server as the epoch ends), as `t_end` seconds since the run started, `t_end - secs` for
//! its start. Epochs answered before the run started (the controller keeps the last 64; the
//! thread reads them first to catch up) are dropped.
//!
//! Moves are read off the snapshots too: a cachelet listed under another worker than in the
//! previous epoch of the same server moved between them ([`LoadEvent`], source
//! `"epoch-snapshots"`). The server's balancer will report its own decisions later (`stats
//! balancer`); they belong in the same list with their own source.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use mbal_balance::EpochSnapshot;
use serde::{Deserialize, Serialize};

/// How often a poller looks at the stop flag while its request waits for the next epoch.
const STOP_CHECK: Duration = Duration::from_millis(200);
/// A reply that took this long was not in the server's history: the poller has caught up.
const CAUGHT_UP_AFTER: Duration = Duration::from_millis(20);

/// One worker in one epoch, from the server's counters.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct WorkerEpoch {
    pub server: u16,
    pub worker: u16,
    /// Requests executed per second (reads + writes over the epoch).
    pub ops_per_sec: f64,
    /// Fraction of the epoch the worker spent working.
    pub busy: f64,
    /// How long batches from other workers waited in its inbox, mean.
    pub queue_wait_mean_us: f64,
    pub forwarded_in: u64,
    pub cachelets: usize,
}

/// One epoch of one server.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ServerEpoch {
    pub server: u16,
    /// The controller's epoch number.
    pub seq: u64,
    /// When the epoch ended and how long it was, seconds on the run's time axis.
    pub t_end: f64,
    pub secs: f64,
    pub workers: Vec<WorkerEpoch>,
}

/// Something a balancer did, on the run's time axis.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct LoadEvent {
    /// Seconds since the run started (the end of the epoch it was seen in).
    pub t: f64,
    pub server: u16,
    /// `"move"`.
    pub kind: String,
    pub cachelet: u32,
    pub from_worker: u16,
    pub to_worker: u16,
    /// Where it was learnt: `"epoch-snapshots"` (a cachelet listed under another worker than in
    /// the epoch before).
    pub source: String,
}

/// Per-worker load over the run from the servers' own counters.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ServerLoad {
    /// Servers that answered `mbal load` (others, e.g. memcached, are left out).
    pub servers: Vec<String>,
    /// Every epoch that ended during the run, per server, in arrival order.
    pub epochs: Vec<ServerEpoch>,
    /// Per worker (`s<server>/w<worker>`), its mean requests/s over the epochs of the run.
    pub workers: Vec<(String, f64)>,
    /// max / avg of those means (1.0 = even).
    pub max_over_avg: f64,
    /// Balancer events (moves) on the same time axis; empty when nothing moved.
    pub events: Vec<LoadEvent>,
}

struct Poller {
    addr: SocketAddr,
    /// Told once, when the poller has caught up (or given up).
    caught_up: Mutex<Option<std::sync::mpsc::Sender<()>>>,
    /// (arrival, snapshot), in order.
    got: Mutex<Vec<(Instant, EpochSnapshot)>>,
    failed: Mutex<Option<String>>,
}

/// The side threads polling every server's `mbal load`.
pub struct LoadWatch {
    pollers: Vec<(u16, Arc<Poller>)>,
    caught_up: std::sync::mpsc::Receiver<()>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl LoadWatch {
    /// Start one poller per server (`servers[i]` is server `i`'s main address).
    pub fn start(servers: &[SocketAddr]) -> LoadWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, caught_up) = std::sync::mpsc::channel();
        let mut pollers = Vec::new();
        let mut threads = Vec::new();
        for (i, &addr) in servers.iter().enumerate() {
            let p = Arc::new(Poller {
                addr,
                caught_up: Mutex::new(Some(tx.clone())),
                got: Mutex::new(Vec::new()),
                failed: Mutex::new(None),
            });
            let (p2, stop2) = (p.clone(), stop.clone());
            let spawned = std::thread::Builder::new().name(format!("bench-load-{i}")).spawn(move || {
                if let Err(e) = poll_loop(&p2, &stop2) {
                    *p2.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{e:#}"));
                }
                p2.tell_caught_up();
            });
            if let Ok(h) = spawned {
                threads.push(h);
                pollers.push((i as u16, p));
            }
        }
        LoadWatch { pollers, caught_up, stop, threads }
    }

    /// Wait (at most `limit`) until every poller has read the server's history and waits for
    /// the next epoch, so that what arrives from now on is new.
    pub fn wait_caught_up(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        for _ in &self.pollers {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.caught_up.recv_timeout(left).is_err() {
                return;
            }
        }
    }

    /// Stop the pollers and return what they saw of the run that started at `run_start`.
    pub fn finish(mut self, run_start: Instant) -> ServerLoad {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
        let mut out = ServerLoad::default();
        for (server, p) in &self.pollers {
            if p.failed.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                continue;
            }
            out.servers.push(p.addr.to_string());
            let got = std::mem::take(&mut *p.got.lock().unwrap_or_else(|e| e.into_inner()));
            let mut prev_owner: Option<std::collections::HashMap<u32, u16>> = None;
            for (at, snap) in got {
                let owners: std::collections::HashMap<u32, u16> =
                    snap.workers.iter().flat_map(|w| w.cachelets.iter().map(move |c| (c.id, w.worker))).collect();
                if at < run_start {
                    prev_owner = Some(owners);
                    continue;
                }
                let t_end = at.duration_since(run_start).as_secs_f64();
                if let Some(prev) = &prev_owner {
                    let mut moved: Vec<LoadEvent> = owners
                        .iter()
                        .filter_map(|(&c, &w)| {
                            let was = *prev.get(&c)?;
                            (was != w).then(|| LoadEvent {
                                t: t_end,
                                server: *server,
                                kind: "move".into(),
                                cachelet: c,
                                from_worker: was,
                                to_worker: w,
                                source: "epoch-snapshots".into(),
                            })
                        })
                        .collect();
                    moved.sort_by_key(|e| e.cachelet);
                    out.events.extend(moved);
                }
                prev_owner = Some(owners);
                let secs = snap.workers.iter().map(|w| w.secs).fold(0.0, f64::max);
                out.epochs.push(ServerEpoch {
                    server: *server,
                    seq: snap.seq,
                    t_end,
                    secs,
                    workers: snap
                        .workers
                        .iter()
                        .map(|w| WorkerEpoch {
                            server: *server,
                            worker: w.worker,
                            ops_per_sec: w.ops_per_sec(),
                            busy: w.busy,
                            queue_wait_mean_us: w.queue_wait_mean_us,
                            forwarded_in: w.forwarded_in,
                            cachelets: w.cachelets.len(),
                        })
                        .collect(),
                });
            }
        }
        out.events.sort_by(|a, b| a.t.total_cmp(&b.t));
        let (workers, max_over_avg) = worker_means(&out.epochs);
        out.workers = workers;
        out.max_over_avg = max_over_avg;
        out
    }
}

/// Per worker, the mean of its requests/s over the epochs given, and their max/avg.
pub fn worker_means(epochs: &[ServerEpoch]) -> (Vec<(String, f64)>, f64) {
    let mut sums: std::collections::BTreeMap<(u16, u16), (f64, u32)> = Default::default();
    for e in epochs {
        for w in &e.workers {
            let s = sums.entry((w.server, w.worker)).or_default();
            s.0 += w.ops_per_sec;
            s.1 += 1;
        }
    }
    let means: Vec<(String, f64)> =
        sums.into_iter().map(|((s, w), (sum, n))| (format!("s{s}/w{w}"), sum / n.max(1) as f64)).collect();
    let avg = means.iter().map(|m| m.1).sum::<f64>() / means.len().max(1) as f64;
    let max = means.iter().map(|m| m.1).fold(0.0, f64::max);
    (means, if avg > 0.0 { max / avg } else { 0.0 })
}

impl Drop for LoadWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Poller {
    fn tell_caught_up(&self) {
        if let Some(tx) = self.caught_up.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(());
        }
    }
}

/// One server: `mbal load <after>` until stopped. A server that does not answer `LOAD` (not an
/// mbal server) ends the loop with an error, which leaves it out of the report.
fn poll_loop(p: &Poller, stop: &AtomicBool) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&p.addr, Duration::from_secs(5))
        .with_context(|| format!("connect to {}", p.addr))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(STOP_CHECK))?;
    let mut after = 0u64;
    let mut buf: Vec<u8> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let asked = Instant::now();
        s.write_all(format!("mbal load {after}\r\n").as_bytes())?;
        let snap = loop {
            if let Some((snap, used)) = parse_load(&buf)? {
                buf.drain(..used);
                break snap;
            }
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            let mut chunk = [0u8; 16 << 10];
            match s.read(&mut chunk) {
                Ok(0) => bail!("{} closed the connection", p.addr),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        };
        let at = Instant::now();
        if at.duration_since(asked) >= CAUGHT_UP_AFTER {
            p.tell_caught_up();
        }
        after = snap.seq;
        p.got.lock().unwrap_or_else(|e| e.into_inner()).push((at, snap));
    }
    Ok(())
}

/// `LOAD <seq> <len>\r\n<json>\r\n` at the start of `buf`: the snapshot and the bytes used, or
/// None if incomplete.
fn parse_load(buf: &[u8]) -> Result<Option<(EpochSnapshot, usize)>> {
    let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
        if buf.len() > 1024 {
            bail!("no LOAD header in the first 1 KiB");
        }
        return Ok(None);
    };
    let line = std::str::from_utf8(&buf[..eol]).context("LOAD header is not UTF-8")?;
    let mut it = line.split_whitespace();
    if it.next() != Some("LOAD") {
        bail!("the server answered `mbal load` with {line:?}: not an mbal server?");
    }
    let _seq: u64 = it.next().context("LOAD without seq")?.parse().context("bad LOAD seq")?;
    let len: usize = it.next().context("LOAD without length")?.parse().context("bad LOAD length")?;
    let start = eol + 2;
    if buf.len() < start + len + 2 {
        return Ok(None);
    }
    let snap: EpochSnapshot = serde_json::from_slice(&buf[start..start + len]).context("bad LOAD JSON")?;
    Ok(Some((snap, start + len + 2)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_load_replies_whole_or_not_at_all() {
        let json = r#"{"seq":7,"end_ns":5,"workers":[]}"#;
        let full = format!("LOAD 7 {}\r\n{json}\r\n", json.len());
        for cut in 0..full.len() {
            assert!(parse_load(&full.as_bytes()[..cut]).unwrap().is_none(), "cut at {cut}");
        }
        let (snap, used) = parse_load(full.as_bytes()).unwrap().unwrap();
        assert_eq!((snap.seq, used), (7, full.len()));
        assert!(parse_load(b"ERROR\r\n").is_err());
    }

    #[test]
    fn worker_means_and_their_spread() {
        let w = |server, worker, ops| WorkerEpoch { server, worker, ops_per_sec: ops, ..Default::default() };
        let epochs = vec![
            ServerEpoch { workers: vec![w(0, 0, 300.0), w(0, 1, 100.0)], ..Default::default() },
            ServerEpoch { workers: vec![w(0, 0, 100.0), w(0, 1, 100.0)], ..Default::default() },
        ];
        let (means, m) = worker_means(&epochs);
        assert_eq!(means, vec![("s0/w0".to_string(), 200.0), ("s0/w1".to_string(), 100.0)]);
        assert!((m - 200.0 / 150.0).abs() < 1e-9);
    }
}
