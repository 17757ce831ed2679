//! `mbal top`: a live view of a cluster, refreshed every epoch: per-worker
//! load (requests/s from each server's own counters, busy time, requests
//! passed between workers), the cluster's max/avg, the hottest keys with
//! their replica counts and states (Phase 1), and the balancers' latest
//! events (Phase 2 moves and escalations, Phase 1 copies made and retired).
//!
//! It reads each server's controller with `mbal load <after>` (docs/
//! protocol.md), which answers as soon as the next epoch ends: no polling
//! and no sleeps; a server's epoch paces the refresh.

use anyhow::{bail, Context, Result};
use mbal_balance::{Decision, EpochSnapshot, HotKeyStat};
use mbal_proto::client::{Expect, Reply, ReplyReader};
use serde::Deserialize;
use std::collections::VecDeque;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct TopArgs {
    /// Any server of the cluster (the map is fetched from it)
    #[arg(long, conflicts_with = "cluster")]
    server: Option<SocketAddr>,
    /// The cluster file
    #[arg(long)]
    cluster: Option<std::path::PathBuf>,
    /// Refresh this many times, then exit (0: until interrupted)
    #[arg(long, default_value_t = 0)]
    iterations: u64,
    /// Hot keys listed
    #[arg(long, default_value_t = 10)]
    keys: usize,
    /// TLS to the servers (`--tls-ca FILE [--tls-cert F --tls-key F] [--tls-server-name N]`)
    /// [default: the cluster file's [tls]]
    #[command(flatten)]
    tls: mbal_bench::TlsArgs,
}

/// One `mbal load` answer.
#[derive(Deserialize)]
struct Record {
    #[serde(flatten)]
    snap: EpochSnapshot,
    #[serde(default)]
    balancer: Option<Decision>,
    #[serde(default)]
    hot: Option<HotView>,
    #[serde(default)]
    hotkeys: Vec<HotKeyStat>,
}

/// The part of Phase 1's decision shown here (its threshold can be
/// infinite, which JSON writes as null).
#[derive(Deserialize)]
struct HotView {
    #[serde(default)]
    replicate: Vec<mbal_balance::hot::Replicate>,
    #[serde(default)]
    retire: Vec<mbal_balance::hot::Retire>,
    #[serde(default)]
    replicated: usize,
}

struct Server {
    id: u16,
    s: mbal_tls::BlockingStream,
    rr: ReplyReader,
    last: u64,
    rec: Option<Record>,
    /// Phase 2's state as of its last decision: it decides once per
    /// `--balance-epoch-ms`, every other epoch at the defaults.
    phase2: String,
}

impl Server {
    fn open(id: u16, addr: SocketAddr, dialer: &mbal_member::dial::Dialer) -> Result<Server> {
        let s = dialer.dial(addr, mbal_member::dial::Proto::Text).with_context(|| format!("connecting to {addr}"))?;
        // `mbal load` waits for the epoch to end.
        s.sock().set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(Server { id, s, rr: ReplyReader::new(), last: 0, rec: None, phase2: "off".into() })
    }

    /// The next epoch after the last one read (blocks until it ends).
    fn next(&mut self) -> Result<()> {
        write!(self.s, "mbal load {}\r\n", self.last)?;
        self.s.flush()?;
        let json = match self.rr.read_reply(&mut self.s, Expect::Line)? {
            Reply::Load { json, .. } => json,
            other => bail!("server {}: unexpected answer to mbal load: {other:?}", self.id),
        };
        let rec: Record = serde_json::from_slice(&json).context("parsing mbal load")?;
        self.last = rec.snap.seq;
        if let Some(d) = &rec.balancer {
            self.phase2 = format!("{:?}", d.state);
        }
        self.rec = Some(rec);
        Ok(())
    }

    /// Skip the history the controller keeps: read until an answer had to
    /// wait for its epoch to end.
    fn catch_up(&mut self) -> Result<()> {
        for _ in 0..70 {
            let t = Instant::now();
            self.next()?;
            if t.elapsed() > Duration::from_millis(20) {
                break;
            }
        }
        Ok(())
    }
}

pub fn run(a: TopArgs) -> Result<()> {
    let tls = a.tls.load()?;
    let mut dialer = mbal_member::dial::Dialer::plain(Duration::from_secs(5));
    let map = match (&a.server, &a.cluster) {
        (Some(addr), _) => {
            let cfg = mbal_client::Config { tls: tls.clone(), ..mbal_client::Config::default() };
            dialer.tls = tls;
            mbal_client::Client::connect(*addr, cfg)?.map().clone()
        }
        (None, Some(p)) => {
            // The cluster file's TLS (unless --tls-ca) and secret: `mbal load`
            // is logged in as a member where the servers require a login (-Y).
            let file = mbal_member::ClusterFile::load(p).map_err(anyhow::Error::msg)?;
            dialer.tls = tls.or(file.client_tls);
            dialer.secret = file.secret;
            file.spec.initial_map()
        }
        (None, None) => bail!("give --server HOST:PORT or --cluster FILE"),
    };
    let mut servers: Vec<Server> = map
        .servers()
        .iter()
        .enumerate()
        .map(|(i, s)| Server::open(i as u16, s.main, &dialer))
        .collect::<Result<_>>()?;
    for s in servers.iter_mut() {
        s.catch_up()?;
    }
    let tty = std::io::stdout().is_terminal();
    let mut events: VecDeque<String> = VecDeque::new();
    let mut round = 0u64;
    loop {
        for s in servers.iter_mut() {
            s.next()?;
            collect_events(s, &mut events);
        }
        let table = render(&servers, &events, a.keys);
        let mut out = std::io::stdout().lock();
        if tty {
            // Clear the screen and go home: a refreshing table.
            write!(out, "\x1b[2J\x1b[H")?;
        } else if round > 0 {
            writeln!(out)?;
        }
        write!(out, "{table}")?;
        out.flush()?;
        round += 1;
        if a.iterations > 0 && round >= a.iterations {
            return Ok(());
        }
    }
}

const EVENTS: usize = 12;

fn collect_events(s: &Server, events: &mut VecDeque<String>) {
    let Some(rec) = &s.rec else { return };
    let e = rec.snap.seq;
    let mut push = |line: String| {
        if events.len() == EVENTS {
            events.pop_front();
        }
        events.push_back(line);
    };
    if let Some(d) = &rec.balancer {
        for m in &d.moves {
            push(format!(
                "s{} epoch {e}: move cachelet {} worker {} -> {} ({:?})",
                s.id, m.cachelet, m.from, m.to, m.why
            ));
        }
        if let Some(x) = &d.escalate {
            push(format!("s{} epoch {e}: phase 2 escalates ({:?})", s.id, x.why));
        }
    }
    if let Some(h) = &rec.hot {
        for r in &h.replicate {
            let k = String::from_utf8_lossy(&r.key);
            push(format!("s{} epoch {e}: replicate {k} (worker {}) x{}", s.id, r.worker, r.replicas));
        }
        for r in &h.retire {
            push(format!("s{} epoch {e}: retire {}", s.id, String::from_utf8_lossy(&r.key)));
        }
    }
}

fn render(servers: &[Server], events: &VecDeque<String>, keys: usize) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let mut loads = Vec::new();
    let mut rows = String::new();
    for s in servers {
        let Some(rec) = &s.rec else { continue };
        let state = &s.phase2;
        let replicated = rec.hot.as_ref().map_or("-".to_string(), |h| h.replicated.to_string());
        for w in &rec.snap.workers {
            let ops = if w.secs > 0.0 { (w.reads + w.writes) as f64 / w.secs } else { 0.0 };
            loads.push(ops);
            let _ = writeln!(
                rows,
                "{:>6} {:>6} {:>10.0} {:>5.0}% {:>9} {:>9} {:>12} {:>10}",
                s.id,
                w.worker,
                ops,
                w.busy * 100.0,
                w.forwarded_in,
                w.cachelets.len(),
                state,
                replicated
            );
        }
    }
    let avg = if loads.is_empty() { 0.0 } else { loads.iter().sum::<f64>() / loads.len() as f64 };
    let max = loads.iter().cloned().fold(0.0, f64::max);
    let total: f64 = loads.iter().sum();
    let epoch = servers.iter().filter_map(|s| s.rec.as_ref().map(|r| r.snap.seq)).max().unwrap_or(0);
    let _ = writeln!(
        o,
        "mbal top: {} servers, {} workers, epoch {epoch}: {total:.0} requests/s, per-worker max/avg {:.2}",
        servers.len(),
        loads.len(),
        if avg > 0.0 { max / avg } else { 0.0 }
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:>6} {:>6} {:>10} {:>6} {:>9} {:>9} {:>12} {:>10}",
        "SERVER", "WORKER", "REQ/S", "BUSY", "FWD_IN", "CACHELETS", "BALANCER", "HOT_KEYS"
    );
    o.push_str(&rows);
    let mut hot: Vec<(u16, &HotKeyStat)> =
        servers.iter().flat_map(|s| s.rec.iter().flat_map(move |r| r.hotkeys.iter().map(move |k| (s.id, k)))).collect();
    hot.sort_by(|a, b| (b.1.reads_per_sec + b.1.writes_per_sec).total_cmp(&(a.1.reads_per_sec + a.1.writes_per_sec)));
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<32} {:>6} {:>10} {:>10} {:>12} {:>8}",
        "HOT KEY", "HOME", "READS/S", "WRITES/S", "STATE", "REPLICAS"
    );
    for (s, k) in hot.iter().take(keys) {
        let _ = writeln!(
            o,
            "{:<32} {:>6} {:>10.0} {:>10.0} {:>12} {:>8}",
            String::from_utf8_lossy(&k.key),
            format!("{s}/{}", k.worker),
            k.reads_per_sec,
            k.writes_per_sec,
            format!("{:?}", k.state),
            k.replicas
        );
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "EVENTS");
    for e in events {
        let _ = writeln!(o, "  {e}");
    }
    o
}
