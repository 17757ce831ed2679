//! `mbal cluster move | moves | remove-server | rebalance`: cross-server moves of cachelets
//! (docs/operations.md "Moving cachelets, adding and removing servers"). `move` asks the
//! cachelet's owner (found in the coordinator's map) and waits for the move's end; the others
//! ask the coordinator, which orders the moves one or two at a time.

use anyhow::{bail, Context, Result};
use mbal_member::dial::{Dialer, Proto};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone, Debug)]
pub struct Target {
    /// The coordinator (HOST:PORT)
    #[arg(long)]
    pub coordinator: SocketAddr,
    /// The cluster file: its secret (moves are control commands) and its `[tls]`
    #[arg(long)]
    pub cluster: PathBuf,
}

#[derive(clap::Args, Clone, Debug)]
pub struct MoveArgs {
    #[command(flatten)]
    pub target: Target,
    /// The cachelet's id
    pub cachelet: u32,
    /// Where it goes: SERVER:WORKER (ids)
    pub to: String,
}

#[derive(clap::Args, Clone, Debug)]
pub struct RemoveArgs {
    #[command(flatten)]
    pub target: Target,
    /// The server's id
    #[arg(long)]
    pub id: u16,
    /// Seconds to wait for its cachelets to move (0: do not wait)
    #[arg(long, default_value_t = 600)]
    pub wait: u64,
    /// Once it left, milliseconds to wait before returning: the server still answers clients
    /// whose map is older than its last move with a redirect, so that they learn the new
    /// owners from it; stopped at once, its last cachelets' reads through those clients would
    /// be misses until they fetch the map (0: return at once)
    #[arg(long, default_value_t = 1000)]
    pub grace_ms: u64,
}

#[derive(clap::Args, Clone, Debug)]
pub struct RebalanceArgs {
    #[command(flatten)]
    pub target: Target,
    /// Seconds to wait for the moves (0: do not wait)
    #[arg(long, default_value_t = 600)]
    pub wait: u64,
}

struct Line {
    r: BufReader<mbal_tls::BlockingStream>,
}

impl Line {
    fn dial(t: &Target, addr: SocketAddr, timeout: Duration) -> Result<Line> {
        let file = mbal_member::ClusterFile::load(&t.cluster).map_err(anyhow::Error::msg)?;
        let dialer = Dialer { tls: file.client_tls.clone(), secret: file.secret.clone(), user: None, timeout };
        let s = dialer.dial(addr, Proto::Text).with_context(|| format!("{addr}"))?;
        Ok(Line { r: BufReader::new(s) })
    }

    fn call(&mut self, req: &str) -> Result<String> {
        self.r.get_mut().write_all(format!("{req}\r\n").as_bytes())?;
        self.r.get_mut().flush()?;
        self.line()
    }

    fn line(&mut self) -> Result<String> {
        let mut l = String::new();
        if self.r.read_line(&mut l)? == 0 {
            bail!("the connection closed");
        }
        Ok(l.trim_end().to_string())
    }

    /// Lines up to `END`.
    fn list(&mut self, req: &str) -> Result<Vec<String>> {
        let mut out = vec![self.call(req)?];
        while out.last().is_some_and(|l| l != "END" && !l.contains("ERROR")) {
            out.push(self.line()?);
        }
        match out.pop() {
            Some(l) if l == "END" => Ok(out),
            l => bail!("{}", l.unwrap_or_default()),
        }
    }

    fn map(&mut self) -> Result<mbal_cluster::ClusterMap> {
        let head = self.call("mbal map")?;
        let len: usize = match head.split_whitespace().collect::<Vec<_>>()[..] {
            ["MAP", _, n] => n.parse()?,
            _ => bail!("coordinator: {head}"),
        };
        let mut json = vec![0u8; len + 2];
        self.r.read_exact(&mut json)?;
        json.truncate(len);
        mbal_cluster::ClusterMap::from_json(std::str::from_utf8(&json)?).map_err(anyhow::Error::msg)
    }
}

/// `mbal cluster move <cachelet> <server>:<worker>`.
pub fn move_one(a: MoveArgs) -> Result<()> {
    let (s, w) = a.to.split_once(':').context("the destination is SERVER:WORKER")?;
    let (s, w): (u16, u16) = (s.parse()?, w.parse()?);
    let map = Line::dial(&a.target, a.target.coordinator, Duration::from_secs(5))?.map()?;
    if a.cachelet >= map.cachelet_count() {
        bail!("no cachelet {}: the map has {}", a.cachelet, map.cachelet_count());
    }
    let (from, _) = map.owner(a.cachelet);
    let src = map.servers()[from as usize].main;
    let mut conn = Line::dial(&a.target, src, Duration::from_secs(600))?;
    let answer = conn.call(&format!("mbal migrate {} {s} {w}", a.cachelet))?;
    match answer.split_whitespace().collect::<Vec<_>>()[..] {
        ["MIGRATED", c, items, bytes, ms] => {
            println!("cachelet {c} moved from server {from} to {s}:{w}: {items} items, {bytes} bytes, {ms} ms");
            Ok(())
        }
        _ => bail!("server {from} ({src}): {answer}"),
    }
}

/// `mbal cluster moves`: the moves the coordinator runs or queued, and the last ones.
pub fn moves(t: Target) -> Result<()> {
    let mut c = Line::dial(&t, t.coordinator, Duration::from_secs(5))?;
    for l in c.list("mbal queue")? {
        println!("{l}");
    }
    println!(
        "{:>6} {:>9} {:>5} {:>8} {:<28} {:>8} {:>9} {:>12}",
        "id", "cachelet", "from", "to", "outcome", "ms", "items", "bytes"
    );
    for l in c.list("mbal migrations")? {
        match l.split_whitespace().collect::<Vec<_>>()[..] {
            ["MIGRATION", id, cl, from, to, outcome, ms, items, bytes] => {
                println!("{id:>6} {cl:>9} {from:>5} {to:>8} {outcome:<28} {ms:>8} {items:>9} {bytes:>12}")
            }
            _ => bail!("coordinator: unexpected line {l:?}"),
        }
    }
    Ok(())
}

/// Wait (up to `secs`) until the coordinator runs and queues no move.
fn wait_idle(c: &mut Line, secs: u64) -> Result<(u64, u64)> {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        let rows = c.list("mbal queue")?;
        let ordered = rows.iter().find_map(|l| l.strip_prefix("ORDERED ")).unwrap_or("0 0").to_string();
        if rows.len() == 1 {
            let mut f = ordered.split_whitespace().map(|x| x.parse::<u64>().unwrap_or(0));
            return Ok((f.next().unwrap_or(0), f.next().unwrap_or(0)));
        }
        if Instant::now() >= until {
            bail!("moves still running after {secs} s: {}", rows.len() - 1);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `mbal cluster remove-server --id N`: its cachelets move to the others with their items,
/// then it leaves.
pub fn remove_server(a: RemoveArgs) -> Result<()> {
    let mut c = Line::dial(&a.target, a.target.coordinator, Duration::from_secs(5))?;
    let answer = c.call(&format!("mbal drain {}", a.id))?;
    let Some(n) = answer.strip_prefix("OK ") else { bail!("coordinator: {answer}") };
    println!("server {}: {n} cachelets to move", a.id);
    if a.wait == 0 {
        return Ok(());
    }
    let (done, failed) = wait_idle(&mut c, a.wait)?;
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let members = c.list("mbal members")?;
        let left =
            members.iter().any(|l| l.split_whitespace().nth(1) == Some(&a.id.to_string()) && l.contains(" left "));
        if left {
            println!("server {} left the cluster ({done} moves done, {failed} failed in all)", a.id);
            if a.grace_ms > 0 {
                // Not waiting for an event: clients with an older map learn the new one only
                // when they next send to this server (a redirect), which no one can announce.
                use std::io::Write as _;
                println!("  it redirects clients with an older map for {} ms; stop it after that", a.grace_ms);
                let _ = std::io::stdout().flush();
                std::thread::sleep(Duration::from_millis(a.grace_ms));
            }
            return Ok(());
        }
        if Instant::now() >= until {
            bail!("server {} still owns cachelets ({failed} moves failed): see mbal cluster moves", a.id);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `mbal cluster rebalance`: every Up server gets its share of the cachelets, moved warm.
pub fn rebalance(a: RebalanceArgs) -> Result<()> {
    let mut c = Line::dial(&a.target, a.target.coordinator, Duration::from_secs(5))?;
    let answer = c.call("mbal rebalance")?;
    let Some(n) = answer.strip_prefix("OK ") else { bail!("coordinator: {answer}") };
    println!("{n} cachelets to move");
    if a.wait > 0 {
        let (done, failed) = wait_idle(&mut c, a.wait)?;
        println!("done ({done} moves done, {failed} failed in all)");
    }
    Ok(())
}

#[derive(clap::Args, Clone, Debug)]
pub struct AddArgs {
    #[command(flatten)]
    pub target: Target,
    /// The new server's address (HOST:PORT) on this host
    pub listen: SocketAddr,
    /// Its workers [default: the cluster file's per server]
    #[arg(long)]
    pub workers: Option<usize>,
    /// Its memory (MB)
    #[arg(short = 'm', long = "memory-limit", default_value_t = 64)]
    pub memory_mb: usize,
    /// More arguments for `mbal server` (repeatable), e.g. `--server-arg=--worker-capacity=5000`
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    pub server_args: Vec<String>,
    /// Seconds to wait for its share to arrive (0: do not wait)
    #[arg(long, default_value_t = 600)]
    pub wait: u64,
}

/// `mbal cluster add-server ADDR`: start `mbal server` on ADDR on this host, joining the
/// coordinator's cluster warm (its share of the cachelets moves to it with their items); it runs
/// on after this command (its log beside the cluster file), until it is stopped or removed.
pub fn add_server(a: AddArgs) -> Result<()> {
    let log_path = {
        let mut p = a.target.cluster.as_os_str().to_owned();
        p.push(format!(".server-{}.log", a.listen.port()));
        PathBuf::from(p)
    };
    let log = std::fs::File::create(&log_path).with_context(|| format!("{}", log_path.display()))?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.arg("server")
        .arg("--cluster")
        .arg(&a.target.cluster)
        .args(["--coordinator", &a.target.coordinator.to_string()])
        .args(["-l", &a.listen.ip().to_string(), "-p", &a.listen.port().to_string()])
        .args(["-m", &a.memory_mb.to_string(), "--join", "warm"]);
    if let Some(w) = a.workers {
        cmd.args(["-t", &w.to_string()]);
    }
    cmd.args(&a.server_args).stdin(std::process::Stdio::null()).stdout(log.try_clone()?).stderr(log);
    let child = cmd.spawn().context("starting mbal server")?;
    println!("server {} started (pid {}), log {}", a.listen, child.id(), log_path.display());
    if a.wait == 0 {
        return Ok(());
    }
    let mut c = Line::dial(&a.target, a.target.coordinator, Duration::from_secs(5))?;
    let until = Instant::now() + Duration::from_secs(a.wait.min(60));
    let id = loop {
        let members = c.list("mbal members")?;
        let me = members.iter().find(|l| l.split_whitespace().nth(2) == Some(&a.listen.to_string()));
        if let Some(id) = me.and_then(|l| l.split_whitespace().nth(1)) {
            break id.to_string();
        }
        if Instant::now() >= until {
            bail!("server {} did not join within 60 s: see {}", a.listen, log_path.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (done, failed) = wait_idle(&mut c, a.wait)?;
    println!("server {id} joined; its share arrived ({done} moves done, {failed} failed in all)");
    Ok(())
}
