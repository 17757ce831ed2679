//! `mbal cluster up`: a local cluster of N servers x W workers on loopback,
//! as child processes of this one, described by a cluster file it writes.

use anyhow::{bail, Context, Result};
use clap::Args;
use mbal_member::{ClusterSpec, ServerSpec};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Clone, Debug)]
pub struct UpArgs {
    /// Number of servers
    #[arg(long, default_value_t = 4)]
    pub servers: u16,
    /// Workers (threads) per server
    #[arg(long, default_value_t = 2)]
    pub workers: u16,
    /// Cachelets per worker
    #[arg(long, default_value_t = mbal_cluster::DEFAULT_CACHELETS_PER_WORKER)]
    pub cachelets_per_worker: u32,
    /// Virtual nodes in the key space
    #[arg(long, default_value_t = mbal_cluster::DEFAULT_VN_COUNT)]
    pub vn_count: u32,
    /// Item memory per server, MB
    #[arg(short = 'm', long, default_value_t = 64)]
    pub memory: usize,
    /// First port: server i listens on base + i (one port per server; routed clients reach a
    /// worker through it) [default: find free ports]
    #[arg(long)]
    pub base_port: Option<u16>,
    /// Where to write the cluster file
    #[arg(long, default_value = "mbal-cluster.toml")]
    pub file: PathBuf,
    /// Emulated capacity of every worker, requests per second, passed to every server as
    /// `--worker-capacity` (0: unlimited)
    #[arg(long, default_value_t = 0)]
    pub worker_capacity: u64,
    /// TLS: the CA (PEM) the members' certificates chain to, written into the cluster file's
    /// [tls] section; every member listens with TLS and dials the others over it
    #[arg(long = "tls-ca", value_name = "FILE", requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
    /// The members' certificate chain (PEM; needs 127.0.0.1 as an IP SAN, or --tls-server-name)
    #[arg(long = "tls-cert", value_name = "FILE", requires = "tls_ca")]
    pub tls_cert: Option<PathBuf>,
    /// The members' private key [default: in --tls-cert]
    #[arg(long = "tls-key", value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Client certificates the members require (memcached's ssl_verify_mode: 0..3)
    #[arg(long = "tls-verify-mode", default_value_t = 0, requires = "tls_ca")]
    pub tls_verify_mode: u8,
    /// The client certificate (and key) members, the proxy and the tools present to members
    #[arg(long = "tls-client-cert", value_name = "FILE", requires = "tls_ca")]
    pub tls_client_cert: Option<PathBuf>,
    #[arg(long = "tls-client-key", value_name = "FILE", requires = "tls_client_cert")]
    pub tls_client_key: Option<PathBuf>,
    /// The name checked in the members' certificates [default: the IP address connected to]
    #[arg(long = "tls-server-name", value_name = "NAME", requires = "tls_ca")]
    pub tls_server_name: Option<String>,
    /// The cluster secret's file (at least 16 bytes), written into the cluster file as
    /// secret_file: control commands need it (mbal peer)
    #[arg(long = "secret-file", value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Extra arguments passed to every `mbal server` (e.g. "-v")
    #[arg(long, allow_hyphen_values = true)]
    pub server_arg: Vec<String>,
    /// Start a coordinator beside the servers (`mbal coordinator`, on the port after the
    /// servers', its state in <file>.coordinator/): the servers register with it and serve
    /// under its lease; a server that dies has its cachelets given to the others, and the
    /// cluster keeps running
    #[arg(long)]
    pub coordinator: bool,
    /// Extra arguments passed to the coordinator (e.g. "--failure-timeout-ms=1000")
    #[arg(long, allow_hyphen_values = true, requires = "coordinator")]
    pub coordinator_arg: Vec<String>,
    /// How many coordinators (more than 1 needs --store etcd://...: one leads, the others
    /// stand by and take over when it dies)
    #[arg(long, default_value_t = 1, requires = "coordinator")]
    pub coordinators: u16,
    /// The coordinators' store (`mbal coordinator --store`, e.g. etcd://127.0.0.1:2379)
    /// [default: the file store in <file>.coordinator/]
    #[arg(long, requires = "coordinator")]
    pub store: Option<String>,
}

#[derive(Args, Clone, Debug)]
pub struct LeaveArgs {
    /// The coordinator (HOST:PORT)
    #[arg(long)]
    pub coordinator: SocketAddr,
    /// The server's id
    #[arg(long)]
    pub id: u16,
    /// The cluster file: its secret (leaving is a control command) and its `[tls]`
    #[arg(long)]
    pub cluster: PathBuf,
}

/// `mbal cluster leave`: `mbal leave <id>` at the coordinator.
pub fn leave(a: LeaveArgs) -> Result<()> {
    use std::io::{BufRead, BufReader, Write};
    let file = mbal_member::ClusterFile::load(&a.cluster).map_err(anyhow::Error::msg)?;
    let dialer = mbal_member::dial::Dialer {
        tls: file.client_tls.clone(),
        secret: file.secret.clone(),
        user: None,
        timeout: Duration::from_secs(5),
    };
    let mut s = dialer
        .dial(a.coordinator, mbal_member::dial::Proto::Text)
        .with_context(|| format!("coordinator {}", a.coordinator))?;
    s.write_all(format!("mbal leave {}\r\n", a.id).as_bytes())?;
    s.flush()?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    let line = line.trim_end();
    match line.strip_prefix("OK ") {
        Some(epoch) => {
            println!("server {} left the cluster; its cachelets went to the others (map epoch {epoch})", a.id);
            Ok(())
        }
        None => bail!("coordinator: {line}"),
    }
}

/// Where `mbal cluster up --coordinator` keeps the coordinator's state.
pub fn coordinator_dir(file: &std::path::Path) -> PathBuf {
    let mut d = file.as_os_str().to_owned();
    d.push(".coordinator");
    PathBuf::from(d)
}

fn port_free(p: u16) -> bool {
    TcpListener::bind(("127.0.0.1", p)).is_ok()
}

/// The first port the kernel hands out as the source port of outgoing
/// connections (Linux: `ip_local_port_range`; 32768, its default, when
/// it cannot be read).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// A base port such that the whole block of ports is free right now, below
/// the ephemeral range when there is room: a port from that range (what
/// binding port 0 gives) can be taken, between this pick and a server's
/// bind, as the source port of another server's outgoing connection (the
/// servers that start first dial the others), and the late server then
/// fails with "Address already in use" (seen twice in ~40 bench runs).
fn find_base(count: u32) -> Result<u16> {
    use rand::Rng;
    let low = u32::from(ephemeral_low());
    if low > 10_000 + count {
        let mut rng = rand::thread_rng();
        for _ in 0..200 {
            let base = rng.gen_range(10_000..low - count) as u16;
            if (0..count as u16).all(|i| port_free(base + i)) {
                return Ok(base);
            }
        }
    }
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let base = l.local_addr()?.port();
        drop(l);
        if base as u32 + count >= 65535 {
            continue;
        }
        if (0..count as u16).all(|i| port_free(base + i)) {
            return Ok(base);
        }
    }
    bail!("could not find {count} consecutive free ports on 127.0.0.1")
}

/// An absolute path (the cluster file may be written elsewhere than the
/// current directory, and relative paths in it are read from its folder).
fn absolute(p: &std::path::Path) -> Result<PathBuf> {
    std::fs::canonicalize(p).with_context(|| format!("{}", p.display()))
}

pub fn spec_for(a: &UpArgs, base: u16) -> Result<ClusterSpec> {
    let opt = |p: &Option<PathBuf>| p.as_deref().map(absolute).transpose();
    let tls = match &a.tls_ca {
        Some(ca) => Some(mbal_member::TlsSpec {
            ca_cert: absolute(ca)?,
            cert: opt(&a.tls_cert)?,
            key: opt(&a.tls_key)?,
            verify_mode: a.tls_verify_mode,
            client_cert: opt(&a.tls_client_cert)?,
            client_key: opt(&a.tls_client_key)?,
            server_name: a.tls_server_name.clone(),
        }),
        None => None,
    };
    Ok(ClusterSpec {
        coordinators: Vec::new(),
        vn_count: a.vn_count,
        cachelets_per_worker: a.cachelets_per_worker,
        workers: a.workers,
        servers: (0..a.servers)
            .map(|i| ServerSpec { addr: SocketAddr::from(([127, 0, 0, 1], base + i)), worker_port_base: None })
            .collect(),
        secret: None,
        secret_file: opt(&a.secret_file)?,
        tls,
    })
}

struct Children(Vec<(u16, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        // Ask politely (SIGTERM), then wait; kill what does not stop.
        for (_, c) in &self.0 {
            // SAFETY: kill(2) on the pid of a child we spawned and still own.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (_, c) in self.0.iter_mut() {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

pub fn run(a: UpArgs) -> Result<()> {
    if a.servers == 0 || a.workers == 0 {
        bail!("--servers and --workers must be at least 1");
    }
    let ncoord = if a.coordinator { a.coordinators } else { 0 };
    if a.coordinator && ncoord == 0 {
        bail!("--coordinators must be at least 1");
    }
    if ncoord > 1 && !a.store.as_deref().is_some_and(|s| s.starts_with("etcd://")) {
        bail!("--coordinators {ncoord} needs --store etcd://HOST:PORT (coordinators share their state there)");
    }
    let count = a.servers as u32 + u32::from(ncoord);
    let base = match a.base_port {
        Some(b) => b,
        None => find_base(count)?,
    };
    if base as u32 + count > 65535 {
        bail!("ports {base}..{} do not fit", base as u32 + count);
    }
    let mut spec = spec_for(&a, base)?;
    // The cluster file names its coordinators (a server started by hand with this file alone
    // registers with them).
    spec.coordinators = (0..ncoord).map(|i| SocketAddr::from(([127, 0, 0, 1], base + a.servers + i))).collect();
    spec.validate().map_err(|e| anyhow::anyhow!(e))?;
    // Check the secret and the TLS files now: one clear error, not N servers failing.
    let dir = a.file.parent().filter(|d| !d.as_os_str().is_empty());
    spec.load_secret(dir).map_err(anyhow::Error::msg)?;
    if let Some(t) = &spec.tls {
        mbal_tls::ServerTls::new(t.server_files(dir).map_err(anyhow::Error::msg)?).map_err(anyhow::Error::msg)?;
        mbal_tls::ClientTls::load(&t.client_files(dir)).map_err(anyhow::Error::msg)?;
    }
    std::fs::write(&a.file, spec.to_toml()).with_context(|| format!("writing {}", a.file.display()))?;
    let exe = std::env::current_exe().context("locating the mbal binary")?;
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst))?;
    }
    let mut children = Children(Vec::new());
    if a.coordinator && a.store.is_none() {
        // The cluster file is new (new ports): so is the coordinator's state.
        let dir = coordinator_dir(&a.file);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
    }
    let coordinators: Vec<SocketAddr> =
        (0..ncoord).map(|i| SocketAddr::from(([127, 0, 0, 1], base + a.servers + i))).collect();
    let mut coord_children = Vec::new();
    for (i, coordinator) in coordinators.iter().enumerate() {
        let mut cmd = Command::new(&exe);
        cmd.arg("coordinator").arg("--cluster").arg(&a.file).arg("--listen").arg(coordinator.to_string());
        match &a.store {
            Some(url) => cmd.arg("--store").arg(url),
            None => cmd.arg("--data-dir").arg(coordinator_dir(&a.file)),
        };
        let child = cmd
            .args(&a.coordinator_arg)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting coordinator {i}"))?;
        coord_children.push((*coordinator, child.id()));
        children.0.push((u16::MAX - i as u16, child));
    }
    let coord_list = coordinators.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(",");
    for id in 0..a.servers {
        let mut cmd = Command::new(&exe);
        cmd.arg("server").arg("--cluster").arg(&a.file).arg("--id").arg(id.to_string());
        if a.coordinator {
            cmd.arg("--coordinator").arg(&coord_list);
        }
        let child = cmd
            .arg("-m")
            .arg(a.memory.to_string())
            .arg("--worker-capacity")
            .arg(a.worker_capacity.to_string())
            .args(&a.server_arg)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting server {id}"))?;
        children.0.push((id, child));
    }
    // Ready when every main port answers `version` (a server answers once it has started,
    // after its registration with the coordinator) and every coordinator accepts (bounded wait).
    let deadline = Instant::now() + Duration::from_secs(20);
    let ready = |addr: &SocketAddr, ask: bool| -> bool {
        use std::io::{Read, Write};
        let Ok(mut c) = TcpStream::connect_timeout(addr, Duration::from_millis(200)) else { return false };
        if !ask {
            return true;
        }
        let _ = c.set_read_timeout(Some(Duration::from_millis(500)));
        let mut b = [0u8; 64];
        c.write_all(b"version\r\n").is_ok() && c.read(&mut b).is_ok_and(|n| b[..n].starts_with(b"VERSION"))
    };
    let waits = coordinators.iter().map(|c| (*c, false)).chain(spec.servers.iter().map(|s| (s.addr, true)));
    for (addr, ask) in waits {
        loop {
            if ready(&addr, ask && spec.tls.is_none()) {
                break;
            }
            for (id, c) in children.0.iter_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    if *id > u16::MAX - ncoord {
                        bail!("coordinator {} exited during start-up ({st})", u16::MAX - *id);
                    }
                    bail!("server {id} exited during start-up ({st})");
                }
            }
            if Instant::now() > deadline || stop.load(Ordering::SeqCst) {
                bail!("{addr} did not come up");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let cap = match a.worker_capacity {
        0 => String::new(),
        n => format!(", {n} requests/s per worker (emulated)"),
    };
    println!(
        "mbal cluster up: {} servers x {} workers, {} cachelets{cap}, cluster file {}",
        a.servers,
        a.workers,
        a.servers as u32 * a.workers as u32 * a.cachelets_per_worker,
        a.file.display()
    );
    for (id, c) in &children.0 {
        if let Some(s) = spec.servers.get(usize::from(*id)) {
            println!("  server {id}: {} (pid {}), {} workers", s.addr, c.id(), a.workers);
        }
    }
    for (coordinator, pid) in &coord_children {
        match &a.store {
            Some(url) => println!("  coordinator: {coordinator} (pid {pid}), state in {url}"),
            None => {
                println!("  coordinator: {coordinator} (pid {pid}), state in {}", coordinator_dir(&a.file).display())
            }
        }
    }
    match &spec.tls {
        None => println!("try: mbal bench --routed --server {} --load --workload a", spec.servers[0].addr),
        Some(t) => {
            let mut tls = format!(" --tls-ca {}", t.ca_cert.display());
            if let Some(c) = &t.client_cert {
                tls += &format!(" --tls-cert {}", c.display());
                if let Some(k) = &t.client_key {
                    tls += &format!(" --tls-key {}", k.display());
                }
            }
            println!("try: mbal bench --routed --server {} --load --workload a{tls}", spec.servers[0].addr);
            println!("     mbal stats --cluster {}", a.file.display());
        }
    }
    println!("Ctrl-C stops the cluster.");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    while !stop.load(Ordering::SeqCst) {
        for (id, c) in children.0.iter_mut() {
            if let Ok(Some(st)) = c.try_wait() {
                if *id > u16::MAX - ncoord && ncoord > 1 {
                    // The others take over (etcd leadership); the cluster goes on.
                    eprintln!("coordinator {} exited ({st})", u16::MAX - *id);
                } else if *id > u16::MAX - ncoord {
                    eprintln!("the coordinator exited ({st}); stopping the cluster");
                    stop.store(true, Ordering::SeqCst);
                } else if a.coordinator {
                    // The coordinator gives its cachelets to the others; the cluster goes on.
                    eprintln!("server {id} exited ({st}); the coordinator reassigns its cachelets");
                } else {
                    eprintln!("server {id} exited ({st}); stopping the cluster");
                    stop.store(true, Ordering::SeqCst);
                }
            }
        }
        if a.coordinator {
            children
                .0
                .retain_mut(|(id, c)| (*id > u16::MAX - ncoord && ncoord == 1) || !matches!(c.try_wait(), Ok(Some(_))));
            if ncoord > 1 && !children.0.iter().any(|(id, _)| *id > u16::MAX - ncoord) {
                eprintln!("every coordinator exited; stopping the cluster");
                stop.store(true, Ordering::SeqCst);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("stopping {} servers", children.0.len());
    drop(children);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_picked_block_is_free_and_below_the_ephemeral_range() {
        let low = u32::from(ephemeral_low());
        let base = find_base(8).unwrap();
        assert!(u32::from(base) + 8 <= low || low <= 10_008, "{base} in the ephemeral range from {low}");
        // Free when picked: bind the whole block (and let it go).
        let held: Vec<TcpListener> = (0..8).map(|i| TcpListener::bind(("127.0.0.1", base + i)).unwrap()).collect();
        assert_eq!(held.len(), 8);
    }
}
