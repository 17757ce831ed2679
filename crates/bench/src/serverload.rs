//! The servers' own per-worker load during a run: one side thread per mbal server asks its
//! controller `mbal load <after>` (docs/protocol.md), which answers with the next epoch
//! snapshot ([`mbal_balance::EpochSnapshot`]) as soon as that epoch ends. So the thread reads
//! every epoch in turn and never sleeps: each request blocks until there is something new.
//!
//! Times: a snapshot's `end_ns` is on the server's clock. An epoch's answer to a caller that
//! keeps up leaves the server as the epoch ends, but the answer can be late to arrive (a busy
//! machine: the poller thread or the controller waited for a core), so the bench maps the
//! server's clock onto its own with the smallest (arrival − `end_ns`) seen from that server —
//! the answer that waited least — and places each epoch at its `end_ns` on that axis, as
//! `t_end` seconds since the run started, `t_end - secs` for its start. Epochs that ended
//! before the run started (the controller keeps the last 64; the thread reads them first to
//! catch up) are dropped, and so are those that ended after the run (when `finish` is called).
//! A poller whose connection sits on a saturated worker (`--worker-capacity`: the worker reads
//! no input while out of tokens) falls behind during the run; `finish` waits (bounded) until
//! every poller has read the history up to a fresh epoch, so it still reports every epoch.
//!
//! Balancer events ([`LoadEvent`]) come from two sources: the server's own decisions (the
//! `balancer` field of each `mbal load` epoch, source `"balancer"`: the moves it decided at the
//! end of that epoch, and its requests for Phase 3, kind `"escalate"`), and, for a server whose
//! balancer is off, a cachelet listed under another worker than in the previous epoch of the
//! same server (an operator's `mbal move`, source `"epoch-snapshots"`, at the end of the epoch
//! it was seen in). A server that reports decisions has only its decisions listed.

use mbal_proto::client::{Expect, Reply, ReplyReader};
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use mbal_balance::{Decision, EpochSnapshot};
use serde::{Deserialize, Serialize};

/// How often a poller looks at the stop flag while its request waits for the next epoch.
const STOP_CHECK: Duration = Duration::from_millis(200);
/// A reply that took this long was not in the server's history: the poller has caught up.
const CAUGHT_UP_AFTER: Duration = Duration::from_millis(20);
/// How long `finish` waits for a poller that fell behind, beyond two epochs.
const FINISH_WAIT: Duration = Duration::from_secs(5);

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

/// One `mbal load` answer: the snapshot and the balancer's decision at its end (docs/protocol.md).
#[derive(Debug, Deserialize)]
struct LoadRecord {
    #[serde(flatten)]
    snapshot: EpochSnapshot,
    #[serde(default)]
    balancer: Option<Decision>,
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
    /// The balancer's state after this epoch (MBal Figure 4), when it ran and
    /// decided at this epoch (once per Phase 2 epoch: every other one at the
    /// defaults).
    pub balancer_state: Option<String>,
}

/// Something a balancer did, on the run's time axis.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct LoadEvent {
    /// Seconds since the run started (the end of the epoch it was seen in).
    pub t: f64,
    pub server: u16,
    /// `"move"`, or `"escalate"` (the balancer asks for Phase 3; cachelet and workers are 0).
    pub kind: String,
    pub cachelet: u32,
    pub from_worker: u16,
    pub to_worker: u16,
    /// Where it was learnt: `"balancer"` (the server's decision in `mbal load`) or
    /// `"epoch-snapshots"` (a cachelet listed under another worker than in the epoch before).
    pub source: String,
    /// The balancer's reason (`Balance`, `LeaseExpired`, `NoLocalPlan`, ...); empty otherwise.
    pub why: String,
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
    /// (arrival, snapshot, the balancer's decision), in order.
    got: Mutex<Vec<(Instant, EpochSnapshot, Option<Decision>)>>,
    failed: Mutex<Option<String>>,
    /// When the last answer that waited for its epoch to end was asked for (the history was
    /// read up to it), and the epoch length seen; `fresh_cv` is told of each.
    fresh: Mutex<(Option<Instant>, f64)>,
    fresh_cv: Condvar,
    /// The poller's thread has ended (stopped or failed).
    ended: AtomicBool,
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
        LoadWatch::start_tls(servers, None)
    }

    /// [`LoadWatch::start`] over TLS connections with `tls`.
    pub fn start_tls(servers: &[SocketAddr], tls: Option<mbal_tls::ClientTls>) -> LoadWatch {
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
                fresh: Mutex::new((None, 0.0)),
                fresh_cv: Condvar::new(),
                ended: AtomicBool::new(false),
            });
            let (p2, stop2, tls2) = (p.clone(), stop.clone(), tls.clone());
            let spawned = std::thread::Builder::new().name(format!("bench-load-{i}")).spawn(move || {
                if let Err(e) = poll_loop(&p2, &stop2, tls2.as_ref()) {
                    *p2.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{e:#}"));
                }
                p2.tell_caught_up();
                let _g = p2.fresh.lock().unwrap_or_else(|e| e.into_inner());
                p2.ended.store(true, Ordering::Relaxed);
                p2.fresh_cv.notify_all();
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

    /// Stop the pollers and return what they saw of the run that started at `run_start` and
    /// ended now. First waits (at most two epochs and [`FINISH_WAIT`]) until each poller has
    /// asked after now and had to wait for the answer's epoch to end: it has read every epoch
    /// of the run, also one that fell behind (its connection's worker was saturated: an answer
    /// to a request made during the run can be slow and still be history).
    pub fn finish(mut self, run_start: Instant) -> ServerLoad {
        let run_end = Instant::now();
        for (_, p) in &self.pollers {
            let epoch = p.fresh.lock().unwrap_or_else(|e| e.into_inner()).1.clamp(0.0, 10.0);
            let deadline = run_end + FINISH_WAIT + Duration::from_secs_f64(2.0 * epoch);
            let mut g = p.fresh.lock().unwrap_or_else(|e| e.into_inner());
            while g.0.is_none_or(|asked| asked < run_end) && !p.ended.load(Ordering::Relaxed) {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                g = p.fresh_cv.wait_timeout(g, left.min(STOP_CHECK)).unwrap_or_else(|e| e.into_inner()).0;
            }
        }
        self.stop.store(true, Ordering::Relaxed);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
        self.collect(run_start, run_end.saturating_duration_since(run_start).as_secs_f64())
    }

    /// What the pollers got, placed on the run's axis; epochs ending outside (0, run_end_s] left out.
    fn collect(&self, run_start: Instant, run_end_s: f64) -> ServerLoad {
        let mut out = ServerLoad::default();
        for (server, p) in &self.pollers {
            if p.failed.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                continue;
            }
            out.servers.push(p.addr.to_string());
            let got = p.got.lock().unwrap_or_else(|e| e.into_inner()).clone();
            // The server's clock on the run's axis: the least-delayed answer's offset.
            let rel = |at: Instant| match at.checked_duration_since(run_start) {
                Some(d) => d.as_secs_f64(),
                None => -run_start.duration_since(at).as_secs_f64(),
            };
            let offset =
                got.iter().map(|(at, snap, _)| rel(*at) - snap.end_ns as f64 / 1e9).fold(f64::INFINITY, f64::min);
            let decides = got.iter().any(|g| g.2.is_some());
            let mut prev_owner: Option<std::collections::HashMap<u32, u16>> = None;
            for (_, snap, decision) in got {
                let owners: std::collections::HashMap<u32, u16> =
                    snap.workers.iter().flat_map(|w| w.cachelets.iter().map(move |c| (c.id, w.worker))).collect();
                let t_end = snap.end_ns as f64 / 1e9 + offset;
                if t_end <= 0.0 || t_end > run_end_s {
                    prev_owner = Some(owners);
                    continue;
                }
                let event = |kind: &str, cachelet, from_worker, to_worker, source: &str, why: String| LoadEvent {
                    t: t_end,
                    server: *server,
                    kind: kind.into(),
                    cachelet,
                    from_worker,
                    to_worker,
                    source: source.into(),
                    why,
                };
                if let Some(d) = &decision {
                    for m in &d.moves {
                        out.events.push(event("move", m.cachelet, m.from, m.to, "balancer", format!("{:?}", m.why)));
                    }
                    if let Some(e) = &d.escalate {
                        out.events.push(event("escalate", 0, 0, 0, "balancer", format!("{:?}", e.why)));
                    }
                }
                if let (Some(prev), false) = (&prev_owner, decides) {
                    let mut moved: Vec<LoadEvent> = owners
                        .iter()
                        .filter_map(|(&c, &w)| {
                            let was = *prev.get(&c)?;
                            (was != w).then(|| event("move", c, was, w, "epoch-snapshots", String::new()))
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
                    balancer_state: decision.map(|d| format!("{:?}", d.state)),
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
fn poll_loop(p: &Poller, stop: &AtomicBool, tls: Option<&mbal_tls::ClientTls>) -> Result<()> {
    let mut s =
        mbal_tls::dial(p.addr, tls, Duration::from_secs(5)).with_context(|| format!("connect to {}", p.addr))?;
    s.sock().set_read_timeout(Some(STOP_CHECK))?;
    let mut after = 0u64;
    let mut rr = ReplyReader::new();
    while !stop.load(Ordering::Relaxed) {
        let asked = Instant::now();
        s.write_all(format!("mbal load {after}\r\n").as_bytes())?;
        let snap: LoadRecord = loop {
            match rr.read_reply(&mut s, Expect::Line) {
                Ok(Reply::Load { json, .. }) => break serde_json::from_slice(&json).context("bad LOAD JSON")?,
                Ok(other) => bail!("the server answered `mbal load` with {other:?}: not an mbal server?"),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    if stop.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => bail!("{} closed the connection", p.addr),
                Err(e) => return Err(e.into()),
            }
        };
        let at = Instant::now();
        let fresh = at.duration_since(asked) >= CAUGHT_UP_AFTER;
        if fresh {
            p.tell_caught_up();
        }
        after = snap.snapshot.seq;
        let secs = snap.snapshot.workers.iter().map(|w| w.secs).fold(0.0, f64::max);
        p.got.lock().unwrap_or_else(|e| e.into_inner()).push((at, snap.snapshot, snap.balancer));
        if fresh {
            let mut g = p.fresh.lock().unwrap_or_else(|e| e.into_inner());
            *g = (Some(asked), secs);
            p.fresh_cv.notify_all();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_load_reply_read_by_the_reply_codec_is_a_record() {
        let json = r#"{"seq":7,"end_ns":5,"workers":[]}"#;
        let full = format!("LOAD 7 {}\r\n{json}\r\n", json.len());
        let Reply::Load { seq, json } = ReplyReader::new().read_reply(&mut full.as_bytes(), Expect::Line).unwrap()
        else {
            panic!("not a LOAD")
        };
        let rec: LoadRecord = serde_json::from_slice(&json).unwrap();
        assert_eq!((seq, rec.snapshot.seq, rec.balancer), (7, 7, None));
    }

    /// A server's decisions become events (and its snapshot diffs do not double them), and
    /// epochs are placed on the server's clock: a late answer does not move its epoch.
    #[test]
    fn decisions_become_events_on_the_servers_clock() {
        use mbal_balance::{EscalateWhy, Escalation, Move, State, Why, WorkerLoad};
        let run_start = Instant::now();
        let snap = |seq: u64, owners: &[(u16, u32)]| EpochSnapshot {
            seq,
            end_ns: seq * 1_000_000_000,
            workers: (0..2u16)
                .map(|w| WorkerLoad {
                    worker: w,
                    secs: 1.0,
                    reads: 100 * (u64::from(w) + 1),
                    cachelets: owners
                        .iter()
                        .filter(|o| o.0 == w)
                        .map(|o| mbal_balance::CacheletLoad { id: o.1, ..Default::default() })
                        .collect(),
                    ..Default::default()
                })
                .collect(),
        };
        let decision = |seq: u64, moves: Vec<Move>, escalate: Option<Escalation>| Decision {
            epoch: seq,
            state: State::LocalMigration,
            transition: None,
            imbalance: Default::default(),
            loads: vec![],
            limit: 0.0,
            overloaded: vec![],
            moves,
            plan: None,
            escalate,
            leases: 0,
        };
        let mv = Move { cachelet: 3, from: 1, to: 0, why: Why::Balance, lease_epochs: 10 };
        // Epoch k ends at k s on the server; the run starts as epoch 1 ends. Epochs 1 and 2 are
        // answered as they end; epoch 3's answer comes 1 s late, with epoch 4's.
        let at = |secs: f64| run_start + Duration::from_secs_f64(secs);
        let got = vec![
            (run_start, snap(1, &[(0, 2), (1, 3)]), Some(decision(1, vec![], None))),
            (at(1.0), snap(2, &[(0, 2), (1, 3)]), Some(decision(2, vec![mv], None))),
            (at(4.0), snap(3, &[(0, 2), (0, 3)]), Some(decision(3, vec![], None))),
            (
                at(4.0),
                snap(4, &[(0, 2), (0, 3)]),
                Some(decision(4, vec![], Some(Escalation { why: EscalateWhy::NoLocalPlan, sources: vec![0] }))),
            ),
        ];
        let poller = Arc::new(Poller {
            addr: "127.0.0.1:1".parse().unwrap(),
            caught_up: Mutex::new(None),
            got: Mutex::new(got),
            failed: Mutex::new(None),
            fresh: Mutex::new((None, 0.0)),
            fresh_cv: Condvar::new(),
            ended: AtomicBool::new(true),
        });
        let (_tx, caught_up) = std::sync::mpsc::channel();
        let watch = LoadWatch {
            pollers: vec![(0, poller)],
            caught_up,
            stop: Arc::new(AtomicBool::new(false)),
            threads: vec![],
        };
        // Epoch 1 ended at t = 0 (dropped); the others at 1, 2, 3 s, whenever they arrived;
        // the run ended at 3.5 s. Then the same with the run ending at 2.5 s: epoch 4 is after it.
        assert_eq!(watch.collect(run_start, 2.5).epochs.len(), 2);
        let load = watch.collect(run_start, 3.5);
        let ts: Vec<f64> = load.epochs.iter().map(|e| (e.t_end * 10.0).round() / 10.0).collect();
        assert_eq!(ts, vec![1.0, 2.0, 3.0], "epochs at their servers' times");
        assert_eq!(load.epochs[0].balancer_state.as_deref(), Some("LocalMigration"));
        let ev: Vec<(f64, &str, u32, u16, u16, &str, &str)> = load
            .events
            .iter()
            .map(|e| {
                (
                    (e.t * 10.0).round() / 10.0,
                    e.kind.as_str(),
                    e.cachelet,
                    e.from_worker,
                    e.to_worker,
                    e.source.as_str(),
                    e.why.as_str(),
                )
            })
            .collect();
        assert_eq!(
            ev,
            vec![(1.0, "move", 3, 1, 0, "balancer", "Balance"), (3.0, "escalate", 0, 0, 0, "balancer", "NoLocalPlan")]
        );
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
