//! A worker's counters and the snapshot it reports when stats are gathered: plain data
//! (integers the worker alone writes, so they cost one add on the data path), at the leaf
//! of the server's modules so that the messages that carry a snapshot (`msg::ctl`) need
//! nothing else. Rendering them with memcached's names is `stats`.

use mbal_store::{CacheletStats, WorkerStats};
use std::fmt::Display;

/// Renders `STAT name value` lines through a sink so the text and binary
/// protocols share one list of names.
pub trait StatSink {
    fn stat(&mut self, name: &str, value: &dyn Display);
    /// A raw reply line (`stats detail dump`); the binary protocol has none.
    fn line(&mut self, _line: &str) {}
}

/// Command counters of one worker. Only that worker writes them.
#[derive(Clone, Default, Debug)]
pub struct Counters {
    pub cmd_flush: u64,
    pub cmd_meta: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub conn_yields: u64,
    /// Requests this worker passed to another worker (main-port clients
    /// asking for a cachelet it does not own).
    pub forwarded_out: u64,
    /// Requests this worker executed for another worker.
    pub forwarded_in: u64,
    /// Of `forwarded_out`, those executed directly on the owner's store, which shares this
    /// worker's thread (`near`).
    pub forwarded_direct: u64,
    pub total_connections: u64,
    pub rejected_connections: u64,
    /// Redirects sent to routed clients.
    pub redirects: u64,
    /// Keys asked of this server that another server of the cluster holds.
    pub foreign_keys: u64,
    /// Requests passed to another server by the forwarder (`--forward`).
    pub forwarded_servers: u64,
    /// Cachelets this worker took over from another worker.
    pub cachelets_adopted: u64,
    /// Cachelets the coordinator's map took from this worker (their items dropped) and gave
    /// it (empty).
    pub cachelets_dropped: u64,
    pub cachelets_claimed: u64,
    /// Cachelets that arrived from another server with their items (a cross-server move).
    pub migrations_in: u64,
    /// Moves to this worker refused (no room) or cut off (out of memory).
    pub migrations_refused: u64,
    /// Frame bytes of moving cachelets taken in.
    pub migrated_in_bytes: u64,
    /// Requests answered as for another server's key because this server was fenced (its
    /// lease from the coordinator ran out).
    pub fenced_keys: u64,
    /// Requests answered with an error because their cachelet's move to another server
    /// waited to learn whether its commit stood (`Tables::unsure`).
    pub moving_errors: u64,
    /// Times a connection stopped reading because the worker had
    /// `max_inflight` forwarded requests unanswered.
    pub inflight_stalls: u64,
    /// Times the worker ran out of its emulated capacity (`--worker-capacity`)
    /// and left work waiting until its bucket refilled.
    pub capacity_stalls: u64,
    /// Connections closed for being idle longer than `-o idle_timeout`.
    pub idle_kicks: u64,
    /// Values refused as larger than `-I` (memcached's `store_too_large`).
    pub store_too_large: u64,
    /// TLS connections closed on a failed handshake or a bad record
    /// (memcached's `ssl_handshake_errors`).
    pub tls_errors: u64,
    /// Phase 1: copies made of hot keys homed here, `RH hot` hints sent,
    /// reads served from the shadow table, shadow misses redirected home,
    /// and the shadow table's size and refusals (set when snapshotted).
    pub hot_replications: u64,
    pub hot_hints: u64,
    pub replica_reads: u64,
    pub replica_redirects: u64,
    pub replica_items: u64,
    pub replica_bytes: u64,
    pub replica_refused: u64,
    /// Authentications tried (ASCII or SASL) and those that failed (memcached's names).
    pub auth_cmds: u64,
    pub auth_errors: u64,
    /// `mbal peer <answer>` tried, and failed.
    pub peer_auth_cmds: u64,
    pub peer_auth_errors: u64,
    /// Control commands refused to a connection that is not a cluster peer.
    pub control_refused: u64,
    /// Connections closed for needing more input than `--max-input-buffer`.
    pub input_limit_closes: u64,
    /// Connections closed for sending a request slower than `--request-timeout-ms`.
    pub request_timeouts: u64,
    /// `stats detail`: per key prefix counts of what this worker executed.
    pub prefixes: PrefixStats,
}

/// What `stats detail` counts.
#[derive(Clone, Copy, Debug)]
pub enum PrefixOp {
    Get { hit: bool },
    Set,
    Delete,
}

/// memcached's per-prefix statistics (`stats detail on|off|dump`): for each key prefix (the
/// bytes before the first delimiter, `-D`, default `:`; keys without one are not counted)
/// the gets, hits, sets and deletes. Each worker counts what it executes; `stats detail dump`
/// adds them up.
#[derive(Clone, Default, Debug)]
pub struct PrefixStats(std::collections::HashMap<Vec<u8>, [u64; 4]>);

impl PrefixStats {
    pub fn record(&mut self, key: &[u8], delimiter: u8, op: PrefixOp) {
        let Some(end) = key.iter().position(|&b| b == delimiter) else { return };
        let prefix = &key[..end];
        let e = match self.0.get_mut(prefix) {
            Some(e) => e,
            None => self.0.entry(prefix.to_vec()).or_default(),
        };
        match op {
            PrefixOp::Get { hit } => {
                e[0] += 1;
                e[1] += hit as u64;
            }
            PrefixOp::Set => e[2] += 1,
            PrefixOp::Delete => e[3] += 1,
        }
    }

    pub fn add(&mut self, o: &PrefixStats) {
        for (k, v) in &o.0 {
            let e = self.0.entry(k.clone()).or_default();
            for i in 0..4 {
                e[i] += v[i];
            }
        }
    }

    /// memcached's dump lines, `PREFIX <p> get <n> hit <n> set <n> del <n>`, by prefix.
    pub fn dump(&self, out: &mut dyn StatSink) {
        let mut all: Vec<_> = self.0.iter().collect();
        all.sort();
        for (p, [get, hit, set, del]) in all {
            let p = String::from_utf8_lossy(p);
            out.line(&format!("PREFIX {p} get {get} hit {hit} set {set} del {del}"));
        }
    }
}

impl Counters {
    pub fn add(&mut self, o: &Counters) {
        macro_rules! sum { ($($f:ident),*) => { $( self.$f += o.$f; )* } }
        sum!(
            cmd_flush,
            cmd_meta,
            bytes_read,
            bytes_written,
            conn_yields,
            forwarded_out,
            forwarded_in,
            forwarded_direct,
            total_connections,
            rejected_connections,
            redirects,
            foreign_keys,
            forwarded_servers,
            cachelets_adopted,
            cachelets_dropped,
            cachelets_claimed,
            migrations_in,
            migrations_refused,
            migrated_in_bytes,
            fenced_keys,
            moving_errors,
            inflight_stalls,
            capacity_stalls,
            idle_kicks,
            store_too_large,
            tls_errors,
            hot_replications,
            hot_hints,
            replica_reads,
            replica_redirects,
            replica_items,
            replica_bytes,
            replica_refused,
            auth_cmds,
            auth_errors,
            peer_auth_cmds,
            peer_auth_errors,
            control_refused,
            input_limit_closes,
            request_timeouts
        );
        self.prefixes.add(&o.prefixes);
    }
}

/// Sums of the store's command counters over workers.
/// One open connection, for `stats conns`.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub id: u64,
    pub addr: String,
    pub listen_addr: String,
    pub state: &'static str,
    pub idle_secs: u32,
}

/// Per-cachelet figures for `stats cachelets` and the load balancer.
#[derive(Clone, Debug)]
pub struct CacheletInfo {
    pub id: u32,
    pub owner: usize,
    pub stats: CacheletStats,
    pub reads_per_sec: u64,
    pub writes_per_sec: u64,
}

/// Everything one worker reports when stats are gathered.
#[derive(Clone, Debug)]
pub struct WorkerSnapshot {
    pub worker: usize,
    pub counters: Counters,
    pub store: WorkerStats,
    pub curr_connections: u64,
    pub conns: Vec<ConnInfo>,
    pub cachelets: Vec<CacheletInfo>,
    /// `lru_crawler metadump` / `stats cachedump`: this worker's lines, rendered.
    pub dump: Vec<u8>,
}
