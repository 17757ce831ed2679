//! `mbal server`: one process, `-t` worker threads, each owning
//! `cachelets_per_worker` cachelets of the key space.
//!
//! * `config`: memcached's command line, mbal's options and the TOML file.
//! * `worker`: the per-thread event loop: listeners, connections, routing,
//!   cross-worker messages.
//! * `exec`: executes text, meta and binary requests against the store.
//! * `stats`: counters and memcached-named stats.
//!
//! Ports: every worker listens on the main port (SO_REUSEPORT, so the kernel
//! spreads standard clients over workers) and on a port of its own (routed
//! clients talk to the owning worker directly, MBal §2.3).

pub mod config;
mod exec;
pub mod stats;
mod worker;

use anyhow::{Context, Result};
use config::Settings;
use mbal_cluster::{ClusterMap, Layout, ServerInfo};
use mbal_store::{GlobalPool, StoreConfig, WorkerStore};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use worker::{bind_listener, Envelope, Shared, Worker};

/// The version string reported by `version` and `stats`.
pub const VERSION: &str = concat!("1.6.18-mbal-", env!("CARGO_PKG_VERSION"));

/// A running server.
pub struct ServerHandle {
    pub main_addr: SocketAddr,
    pub worker_addrs: Vec<SocketAddr>,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl ServerHandle {
    /// Ask every worker to stop and wait for them.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        self.shared.wake_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Block until the server stops (a `shutdown` command with `-A`).
    pub fn wait(mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Has the server been asked to stop?
    pub fn is_shutting_down(&self) -> bool {
        self.shared.shutdown.load(Ordering::Relaxed)
    }

    /// A token that can stop the server from another thread (a signal
    /// handler) without owning the handle.
    pub fn stop_token(&self) -> StopToken {
        StopToken(self.shared.clone())
    }
}

/// Stops a server from any thread.
#[derive(Clone)]
pub struct StopToken(Arc<Shared>);

impl StopToken {
    pub fn stop(&self) {
        self.0.shutdown.store(true, Ordering::Relaxed);
        self.0.wake_all();
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start a server with these settings; returns once every listener is bound.
pub fn start(settings: Settings) -> Result<ServerHandle> {
    let workers = settings.threads;
    let main_addr = SocketAddr::new(settings.listen, settings.port);
    // Bind the main port once to learn the real port when 0 was asked for;
    // every worker then binds the same port with SO_REUSEPORT.
    let first =
        bind_listener(main_addr, true, settings.backlog).with_context(|| format!("binding main port {main_addr}"))?;
    let main_addr = first.local_addr()?;
    let mut mains = vec![first];
    for _ in 1..workers {
        mains.push(
            bind_listener(main_addr, true, settings.backlog)
                .with_context(|| format!("binding main port {main_addr} (reuseport)"))?,
        );
    }
    let mut owns = Vec::new();
    for i in 0..workers {
        let port = match settings.worker_port_base {
            Some(base) => base.checked_add(i as u16).context("worker port overflows")?,
            None if settings.port == 0 => 0,
            None => main_addr.port().checked_add(1 + i as u16).context("worker port overflows")?,
        };
        let addr = SocketAddr::new(settings.listen, port);
        owns.push(
            bind_listener(addr, false, settings.backlog).with_context(|| format!("binding worker {i} port {addr}"))?,
        );
    }
    let worker_addrs: Vec<SocketAddr> = owns.iter().map(|l| l.local_addr()).collect::<std::io::Result<_>>()?;
    let (map, server_id) = match &settings.cluster {
        Some((spec, id)) => (ClusterMap::from_spec(spec), *id),
        None => {
            let layout = Layout::even(1, workers as u16, settings.cachelets_per_worker, settings.vn_count);
            (ClusterMap::new(layout, vec![ServerInfo { main: main_addr, workers: worker_addrs.clone() }]), 0)
        }
    };
    let layout = map.layout().clone();

    let start_unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let pool = GlobalPool::new(settings.memory_limit, settings.page_size);
    let shared = Arc::new(Shared {
        layout: layout.clone(),
        server_id,
        epoch: AtomicU64::new(map.epoch()),
        map: Mutex::new(map),
        start: Instant::now(),
        start_unix,
        curr_conns: AtomicUsize::new(0),
        shutdown: AtomicBool::new(false),
        senders: OnceLock::new(),
        wakers: OnceLock::new(),
        main_port: main_addr.port(),
        worker_ports: OnceLock::new(),
        next_conn_id: AtomicU64::new(1),
        settings: settings.clone(),
    });
    let _ = shared.worker_ports.set(worker_addrs.iter().map(|a| a.port()).collect());

    let mut senders = Vec::new();
    let mut wakers = Vec::new();
    let mut built = Vec::new();
    for (i, (main, own)) in mains.into_iter().zip(owns).enumerate() {
        let (tx, rx) = crossbeam_channel::unbounded::<Envelope>();
        let cfg = StoreConfig {
            mem_limit: settings.memory_limit,
            page_size: settings.page_size,
            max_item_size: settings.max_item_size,
            evict: settings.evictions,
            cas_enabled: settings.cas_enabled,
            start_unix,
            worker_id: i as u16,
            workers,
            ..StoreConfig::default()
        };
        let mut store = WorkerStore::new(pool.clone(), cfg, layout.cachelet_count());
        for c in layout.cachelets_of(server_id, i as u16) {
            store.insert_cachelet(mbal_store::Cachelet::new(c));
        }
        let (w, waker) = Worker::new(i, shared.clone(), main, own, rx, store)?;
        senders.push(tx);
        wakers.push(waker);
        built.push(w);
    }
    let _ = shared.senders.set(senders);
    let _ = shared.wakers.set(wakers);
    let mut threads = Vec::new();
    for (i, w) in built.into_iter().enumerate() {
        threads.push(std::thread::Builder::new().name(format!("mbal-worker-{i}")).spawn(move || w.run())?);
    }
    tracing::info!(%main_addr, ?worker_addrs, workers, "mbal server ready");
    Ok(ServerHandle { main_addr, worker_addrs, shared, threads })
}
