//! Shared set-up for the integration tests of the crates that start real servers (server,
//! client, proxy): a cluster of `n` loopback servers and a Phase 1 member's settings. Not
//! part of mbal's interface.

use crate::config::Settings;
use mbal_member::{ClusterSpec, ServerSpec};
use std::net::TcpListener;

/// `n` servers of `workers` workers on free loopback ports (1,024 virtual nodes, 4 cachelets
/// per worker, no secret, no TLS). The ports are found by binding and releasing them.
pub fn loopback_spec(n: usize, workers: u16) -> ClusterSpec {
    let ls: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    ClusterSpec {
        coordinators: Vec::new(),
        vn_count: 1024,
        cachelets_per_worker: 4,
        workers,
        servers: ls.iter().map(|l| ServerSpec { addr: l.local_addr().unwrap(), worker_port_base: None }).collect(),
        secret: None,
        secret_file: None,
        tls: None,
    }
}

/// Member `id` of `spec` with Phase 1 on and the Phase 2 balancer off: 32 MiB, worker ports
/// chosen by the system, the debug commands, epochs of `epoch_ms` for both.
pub fn hot_member(spec: &ClusterSpec, id: u16, epoch_ms: u64) -> Settings {
    let mut s = Settings { port: 0, threads: spec.workers as usize, memory_limit: 32 << 20, ..Settings::default() };
    s.apply_cluster(spec.clone(), id).unwrap();
    s.worker_port_base = None;
    s.debug_commands = true;
    s.epoch_ms = epoch_ms;
    s.hot.epoch_ms = epoch_ms;
    s.hot.enabled = true;
    s.balancer = false;
    s
}
