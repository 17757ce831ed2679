//! `mbal server --metrics-listen ADDR`: Prometheus metrics over HTTP (`GET /metrics`).
//!
//! A scrape gathers the figures the way a client's `stats` does: it sends `stats`, `stats
//! workers`, `stats balancer` and `stats hotkeys` on one admin connection to the server
//! (`mbal_server::StatsConnector`: a loopback socket pair served by worker 0, plain and logged
//! in whatever `-Z`/`-Y` say, kept open between scrapes), and reads the controller's latest
//! epoch snapshot (per-worker busy fraction and queues). Nothing is added to the data path.
//! The text is encoded by `prometheus-client` (OpenMetrics text, which Prometheus reads);
//! every metric, its name, type and help, is in the tables below and in docs/operations.md
//! "Metrics" (a test checks the two agree with a scrape).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Counter,
    Gauge,
}
use Kind::{Counter as C, Gauge as G};

/// One metric from one `STAT` line: the stat's name, the metric's (without the `mbal_` prefix
/// and a counter's `_total`), its type and help.
type Def = (&'static str, &'static str, Kind, &'static str);

/// General `stats`. A stat that `stats` shows only in some setups (TLS, `-o idle_timeout`,
/// `--forward`, `--coordinator`) is exported when it is shown. Not exported: `pid`, `time`,
/// `version` (in `mbal_info`), `pointer_size`, `worker_threads_policy` (a word), and the
/// counters of memcached mechanisms mbal does not have (always 0).
const GENERAL: &[Def] = &[
    ("uptime", "uptime_seconds", G, "Seconds since the server started"),
    ("rusage_user", "rusage_user_seconds", C, "CPU time in user mode"),
    ("rusage_system", "rusage_system_seconds", C, "CPU time in system mode"),
    ("max_connections", "max_connections", G, "The connection limit (-c)"),
    ("curr_connections", "current_connections", G, "Open client connections (the metrics endpoint's own included)"),
    ("total_connections", "connections", C, "Connections accepted"),
    ("rejected_connections", "rejected_connections", C, "Connections refused over -c"),
    ("connection_structures", "connection_structures", G, "Connection structures in use"),
    ("ssl_handshake_errors", "ssl_handshake_errors", C, "TLS handshakes that failed (with -Z)"),
    ("cmd_get", "cmd_get", C, "Keys requested by get commands"),
    ("cmd_set", "cmd_set", C, "Storage commands"),
    ("cmd_flush", "cmd_flush", C, "flush_all commands"),
    ("cmd_touch", "cmd_touch", C, "touch commands"),
    ("cmd_meta", "cmd_meta", C, "Meta commands"),
    ("get_hits", "get_hits", C, "Keys found by get commands"),
    ("get_misses", "get_misses", C, "Keys not found by get commands"),
    ("get_expired", "get_expired", C, "Keys found expired by get commands"),
    ("get_flushed", "get_flushed", C, "Keys found flushed by get commands"),
    ("delete_misses", "delete_misses", C, "delete of a missing key"),
    ("delete_hits", "delete_hits", C, "delete of a present key"),
    ("incr_misses", "incr_misses", C, "incr of a missing key"),
    ("incr_hits", "incr_hits", C, "incr of a present key"),
    ("decr_misses", "decr_misses", C, "decr of a missing key"),
    ("decr_hits", "decr_hits", C, "decr of a present key"),
    ("cas_misses", "cas_misses", C, "cas of a missing key"),
    ("cas_hits", "cas_hits", C, "cas that stored"),
    ("cas_badval", "cas_badval", C, "cas refused for a stale cas value"),
    ("touch_hits", "touch_hits", C, "touch of a present key"),
    ("touch_misses", "touch_misses", C, "touch of a missing key"),
    ("store_too_large", "store_too_large", C, "Stores refused as larger than -I"),
    ("store_no_memory", "store_no_memory", C, "Stores refused for want of memory (-M)"),
    ("auth_cmds", "auth_cmds", C, "Authentication attempts (-Y)"),
    ("auth_errors", "auth_errors", C, "Failed authentication attempts (-Y)"),
    ("idle_kicks", "idle_kicks", C, "Connections closed as idle (-o idle_timeout)"),
    ("bytes_read", "read_bytes", C, "Bytes read from clients"),
    ("bytes_written", "written_bytes", C, "Bytes written to clients"),
    ("limit_maxbytes", "limit_maxbytes", G, "Item memory limit in bytes (-m)"),
    ("accepting_conns", "accepting_conns", G, "1 when the server accepts connections"),
    ("threads", "threads", G, "Workers (-t)"),
    ("worker_threads", "worker_threads", G, "OS threads running the workers, in use"),
    ("worker_threads_started", "worker_threads_started", G, "OS threads running the workers, started"),
    ("worker_thread_changes", "worker_thread_changes", C, "Changes of the threads in use by the thread policy"),
    ("worker_thread_trials", "worker_thread_trials", C, "Trials of the thread policy"),
    ("conn_yields", "conn_yields", C, "Times a connection yielded after -R requests"),
    ("hash_bytes", "hash_bytes", G, "Bytes of the hash tables"),
    ("bytes", "bytes", G, "Bytes of items stored"),
    ("curr_items", "current_items", G, "Items stored"),
    ("total_items", "items_stored", C, "Items stored since the start"),
    ("evictions", "evictions", C, "Items evicted for room"),
    ("reclaimed", "reclaimed", C, "Expired items whose room was reused"),
    ("expired_unfetched", "expired_unfetched", C, "Items expired never read"),
    ("evicted_unfetched", "evicted_unfetched", C, "Items evicted never read"),
    ("cross_worker_requests", "cross_worker_requests", C, "Requests passed to the owning worker"),
    ("cross_worker_direct", "cross_worker_direct", C, "Requests executed on a thread-mate's store directly"),
    ("redirects", "redirects", C, "Redirects (RD) sent to routed clients"),
    ("foreign_keys", "foreign_keys", C, "Requests for keys other servers own"),
    ("forwarded_to_servers", "forwarded_to_servers", C, "Requests passed to other servers (--forward)"),
    ("forward_requests", "forward_requests", C, "Requests the forwarder sent (--forward)"),
    ("forward_errors", "forward_errors", C, "Forwarded requests answered with an error (--forward)"),
    ("forward_timeouts", "forward_timeouts", C, "Owner connections dropped for an unanswered request (--forward)"),
    ("forward_redirects", "forward_redirects", C, "Redirects the forwarder followed (--forward)"),
    ("forward_connects", "forward_connects", C, "Owner connections the forwarder opened (--forward)"),
    ("cachelets_moved", "cachelets_moved", C, "Cachelets adopted by this server's workers"),
    ("coordinator_server_id", "server_id", G, "This server's id (--coordinator)"),
    ("coordinator_beats", "heartbeats", C, "Heartbeats sent (--coordinator)"),
    ("coordinator_beat_failures", "heartbeat_failures", C, "Heartbeats that failed (--coordinator)"),
    ("coordinator_maps_installed", "maps_installed", C, "Cluster maps installed (--coordinator)"),
    ("coordinator_registrations", "registrations", C, "Registrations (--coordinator)"),
    ("coordinator_declared_dead", "declared_dead", C, "Times declared down (--coordinator)"),
    ("coordinator_peer_reports", "peer_reports", C, "Peer reports sent (--coordinator)"),
    ("coordinator_lease_left_ms", "lease_left_milliseconds", G, "Lease left (--coordinator; 0: fenced)"),
    ("cachelets_dropped", "cachelets_dropped", C, "Cachelets dropped on a map change (--coordinator)"),
    ("cachelets_claimed", "cachelets_claimed", C, "Cachelets claimed on a map change (--coordinator)"),
    ("fenced_keys", "fenced_keys", C, "Requests refused while fenced (--coordinator)"),
    ("moving_errors", "moving_errors", C, "Requests refused while their move's commit was unresolved (--coordinator)"),
    ("hot_replications", "hot_replications", C, "Phase 1: hot keys replicated"),
    ("hot_hints", "hot_hints", C, "Phase 1: hot-key hints sent to clients"),
    ("replica_reads", "replica_reads", C, "Phase 1: reads served from copies"),
    ("replica_redirects", "replica_redirects", C, "Phase 1: reads of copies redirected home"),
    ("replica_items", "replica_items", G, "Phase 1: copies of other servers' keys held"),
    ("replica_bytes", "replica_bytes", G, "Phase 1: bytes of copies held"),
    ("replica_refused", "replica_refused", C, "Phase 1: copies refused (--replica-memory)"),
    ("cachelets", "cachelets", G, "Cachelets this server's workers own"),
    ("peer_auth_cmds", "peer_auth_cmds", C, "Control-plane logins (mbal peer)"),
    ("peer_auth_errors", "peer_auth_errors", C, "Failed control-plane logins"),
    ("control_refused", "control_refused", C, "Control commands refused"),
    ("rejected_connections_per_ip", "rejected_connections_per_ip", C, "Connections refused over --max-conns-per-ip"),
    ("input_limit_closes", "input_limit_closes", C, "Connections closed over --max-input-buffer"),
    ("request_timeouts", "request_timeouts", C, "Connections closed over --request-timeout-ms"),
];

/// `stats workers`: `worker:N:<stat>`, labelled `worker="N"`.
const WORKERS: &[Def] = &[
    ("cmd_get", "worker_cmd_get", C, "Per worker: keys requested by get commands"),
    ("cmd_set", "worker_cmd_set", C, "Per worker: storage commands"),
    ("get_hits", "worker_get_hits", C, "Per worker: keys found by get commands"),
    ("curr_items", "worker_current_items", G, "Per worker: items stored"),
    ("bytes", "worker_bytes", G, "Per worker: bytes of items stored"),
    ("cachelets", "worker_cachelets", G, "Per worker: cachelets owned"),
    ("curr_connections", "worker_current_connections", G, "Per worker: open connections"),
    ("forwarded_out", "worker_forwarded_out", C, "Per worker: requests passed to other workers"),
    ("forwarded_in", "worker_forwarded_in", C, "Per worker: requests executed for other workers"),
    ("forwarded_direct", "worker_forwarded_direct", C, "Per worker: requests executed on a thread-mate's store"),
    ("inflight_stalls", "worker_inflight_stalls", C, "Per worker: reads paused at --max-inflight"),
    ("capacity_stalls", "worker_capacity_stalls", C, "Per worker: requests that waited for --worker-capacity"),
];

/// `stats balancer` (Phase 2; besides `balancer` and `state`, below).
const BALANCER: &[Def] = &[
    ("epoch", "balancer_epoch", G, "Phase 2: epochs counted"),
    ("max_over_avg", "balancer_max_over_avg", G, "Phase 2: busiest worker's load over the mean, last epoch"),
    ("imbalance_factor", "balancer_imbalance_factor", G, "Phase 2: imbalance factor, last epoch"),
    ("plans", "balancer_plans", C, "Phase 2: plans made"),
    ("moves", "balancer_moves", C, "Phase 2: cachelet moves carried out"),
    ("moves_home", "balancer_moves_home", C, "Phase 2: moves that returned a cachelet home"),
    ("moves_failed", "balancer_moves_failed", C, "Phase 2: moves that failed"),
    ("escalations", "balancer_escalations", C, "Phase 2: times Phase 3 was wanted"),
    ("leases", "balancer_leases", G, "Phase 2: cachelets away from home"),
    ("planner_us_last", "balancer_planner_last_microseconds", G, "Phase 2: the planner's last step"),
    ("planner_us_max", "balancer_planner_max_microseconds", G, "Phase 2: the planner's longest step"),
];

/// `stats hotkeys` (Phase 1; besides `hot_keys`, below).
const HOTKEYS: &[Def] = &[
    ("sample_rate", "hot_sample_rate", G, "Phase 1: fraction of requests sampled"),
    ("epoch", "hot_epoch", G, "Phase 1: epochs counted"),
    ("threshold", "hot_threshold", G, "Phase 1: requests/s per copy (T)"),
    ("estimated_max_over_avg", "hot_estimated_max_over_avg", G, "Phase 1: estimated max/avg load with copies"),
    ("unreplicated_max_over_avg", "hot_unreplicated_max_over_avg", G, "Phase 1: estimated max/avg load without copies"),
    ("replicated", "hot_replicated_keys", G, "Phase 1: keys with copies"),
    ("repl_high", "hot_repl_high", G, "Phase 1: most keys replicated at once (REPL_high)"),
    ("waiting", "hot_waiting_keys", G, "Phase 1: keys that wanted copies and found no slot"),
    ("slots_lent", "hot_slots_lent", G, "Phase 1: REPL_high slots lent to other servers"),
    ("slots_held", "hot_slots_held", G, "Phase 1: REPL_high slots held from other servers"),
    ("copies_made", "hot_copies_made", C, "Phase 1: copies made"),
    ("copies_failed", "hot_copies_failed", C, "Phase 1: copies that failed"),
    ("alarms", "hot_alarms", C, "Phase 1: hotspot alarms raised by workers"),
];

/// The controller's latest epoch snapshot, per worker (`worker="N"`); all gauges.
const EPOCH: &[(&str, &str)] = &[
    ("worker_busy_ratio", "Per worker: fraction of the last epoch the worker was busy"),
    ("worker_queue_wait_mean_seconds", "Per worker: mean wait of other workers' messages in its inbox, last epoch"),
    ("worker_queue_wait_max_seconds", "Per worker: longest wait of another worker's message in its inbox, last epoch"),
    ("worker_inbox_messages", "Per worker: messages in its inbox at the end of the last epoch"),
    ("worker_ready_connections", "Per worker: connections ready to run at the end of the last epoch"),
    ("worker_epoch_requests_per_second", "Per worker: requests per second on its cachelets, last epoch"),
];

/// The `STAT` lines of the groups a scrape asks for.
#[derive(Default)]
struct Gathered {
    general: HashMap<String, String>,
    workers: HashMap<String, String>,
    balancer: HashMap<String, String>,
    hotkeys: HashMap<String, String>,
}

const GROUPS: &[u8] = b"stats\r\nstats workers\r\nstats balancer\r\nstats hotkeys\r\n";
const TIMEOUT: Duration = Duration::from_secs(5);

/// The endpoint's state: the server's connector and the open admin connection.
pub struct Metrics {
    connector: mbal_server::StatsConnector,
    conn: Mutex<Option<BufReader<TcpStream>>>,
}

impl Metrics {
    /// Bind `addr` and serve `/metrics` on a thread of its own; returns the bound address.
    pub fn serve(addr: SocketAddr, connector: mbal_server::StatsConnector) -> anyhow::Result<SocketAddr> {
        let m = Metrics { connector, conn: Mutex::new(None) };
        serve_with(addr, move || m.scrape())
    }

    /// One scrape: the stats (on the kept connection; one retry on a new one) and the epoch.
    fn scrape(&self) -> std::io::Result<String> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let mut last = None;
        for _ in 0..2 {
            if conn.is_none() {
                *conn = Some(BufReader::new(self.connector.connect(TIMEOUT)?));
            }
            match ask(conn.as_mut().expect("just set")) {
                Ok(g) => return Ok(render(&g, self.connector.latest_epoch().as_deref())),
                Err(e) => {
                    *conn = None;
                    last = Some(e);
                }
            }
        }
        Err(last.expect("tried"))
    }
}

/// `mbal coordinator`'s `stats` (all of them; `beat_ms`, `lease_ms`, `failure_timeout_ms` too).
const COORDINATOR: &[Def] = &[
    ("uptime", "coordinator_uptime_seconds", G, "Seconds since the coordinator started"),
    ("epoch", "coordinator_epoch", G, "The cluster map's epoch"),
    ("servers", "coordinator_servers", G, "Members known"),
    ("servers_up", "coordinator_servers_up", G, "Members up"),
    ("servers_down", "coordinator_servers_down", G, "Members declared down"),
    ("servers_left", "coordinator_servers_left", G, "Members that left"),
    ("cachelets", "coordinator_cachelets", G, "Cachelets in the map"),
    ("registrations", "coordinator_registrations", C, "Registrations accepted"),
    ("joins", "coordinator_joins", C, "Servers that joined (given an id)"),
    ("register_refused", "coordinator_register_refused", C, "Registrations refused"),
    ("beats", "coordinator_beats", C, "Heartbeats received"),
    ("failures_detected", "coordinator_failures_detected", C, "Members declared down"),
    ("leaves", "coordinator_leaves", C, "Members that left"),
    ("moves", "coordinator_moves", C, "Cachelet moves recorded"),
    ("auth_refused", "coordinator_auth_refused", C, "Commands refused before the login"),
    ("peer_auth_errors", "coordinator_peer_auth_errors", C, "Failed logins"),
    ("bad_commands", "coordinator_bad_commands", C, "Commands not understood"),
    ("state_writes", "coordinator_state_writes", C, "Writes of state.json"),
    ("state_write_errors", "coordinator_state_write_errors", C, "Failed writes of state.json"),
    ("curr_connections", "coordinator_current_connections", G, "Open connections"),
    ("total_connections", "coordinator_connections", C, "Connections accepted"),
    ("rejected_connections", "coordinator_rejected_connections", C, "Connections refused"),
    ("beat_ms", "coordinator_beat_milliseconds", G, "Heartbeat interval given to the servers"),
    ("lease_ms", "coordinator_lease_milliseconds", G, "The servers' lease"),
    (
        "failure_timeout_ms",
        "coordinator_failure_timeout_milliseconds",
        G,
        "Silence after which a member is declared down",
    ),
];

/// `mbal coordinator --metrics-listen ADDR`: the coordinator's `stats` and members, read
/// in-process on each scrape. Returns the bound address.
pub fn serve_coordinator(addr: SocketAddr, src: mbal_coordinator::server::StatsSource) -> anyhow::Result<SocketAddr> {
    serve_with(addr, move || {
        let stats: HashMap<String, String> = src.stats().into_iter().collect();
        let mut reg = Registry::with_prefix("mbal");
        table(&mut reg, COORDINATOR, &stats);
        let state: Family<Labels, Gauge> = Family::default();
        let since: Family<Labels, Gauge<f64, AtomicU64>> = Family::default();
        for m in src.members() {
            let id = m.id.to_string();
            let l = vec![("id".to_string(), id.clone()), ("state".to_string(), m.state.name().to_string())];
            state.get_or_create(&l).set(1);
            if let Some(ms) = m.ms_since_beat {
                since.get_or_create(&vec![("id".to_string(), id)]).set(ms as f64 / 1e3);
            }
        }
        reg.register("coordinator_member_state", "1 per member, labelled with its id and state", state);
        reg.register("coordinator_member_seconds_since_beat", "Per member: seconds since its last heartbeat", since);
        let mut out = String::new();
        encode(&mut out, &reg).expect("writing to a String");
        Ok(out)
    })
}

/// Serve `/metrics` on a thread of its own, `scrape` making each answer.
fn serve_with(
    addr: SocketAddr,
    scrape: impl Fn() -> std::io::Result<String> + Send + 'static,
) -> anyhow::Result<SocketAddr> {
    let server = tiny_http::Server::http(addr).map_err(|e| anyhow::anyhow!("--metrics-listen {addr}: {e}"))?;
    let bound = server.server_addr().to_ip().ok_or_else(|| anyhow::anyhow!("--metrics-listen: not an IP address"))?;
    std::thread::Builder::new().name("mbal-metrics".into()).spawn(move || {
        for req in server.incoming_requests() {
            let resp = if req.url() == "/metrics" || req.url().starts_with("/metrics?") {
                match scrape() {
                    Ok(text) => {
                        let ct = "application/openmetrics-text; version=1.0.0; charset=utf-8";
                        tiny_http::Response::from_string(text).with_header(header("Content-Type", ct))
                    }
                    Err(e) => tiny_http::Response::from_string(format!("mbal: stats: {e}\n")).with_status_code(503),
                }
            } else {
                tiny_http::Response::from_string("mbal: see /metrics\n").with_status_code(404)
            };
            let _ = req.respond(resp);
        }
    })?;
    Ok(bound)
}

fn header(k: &str, v: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(k.as_bytes(), v.as_bytes()).expect("a valid header")
}

/// Send the four `stats` requests and read their four answers.
fn ask(conn: &mut BufReader<TcpStream>) -> std::io::Result<Gathered> {
    conn.get_mut().write_all(GROUPS)?;
    let mut g = Gathered::default();
    for group in [&mut g.general, &mut g.workers, &mut g.balancer, &mut g.hotkeys] {
        let mut line = String::new();
        // Bounded: a group is at most a few hundred lines.
        for _ in 0..100_000 {
            line.clear();
            if conn.read_line(&mut line)? == 0 {
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the server closed the connection"));
            }
            let l = line.trim_end();
            if l == "END" {
                break;
            }
            let Some(rest) = l.strip_prefix("STAT ") else {
                return Err(std::io::Error::other(format!("unexpected line {l:?}")));
            };
            let (k, v) = rest.split_once(' ').unwrap_or((rest, ""));
            group.insert(k.to_string(), v.to_string());
        }
    }
    Ok(g)
}

type Labels = Vec<(String, String)>;

fn worker_label(w: impl ToString) -> Labels {
    vec![("worker".to_string(), w.to_string())]
}

/// A stat's value as a number (`inf` too: Phase 1's threshold before any load).
fn number(v: &str) -> Option<f64> {
    v.parse::<f64>().ok().filter(|x| !x.is_nan())
}

/// A whole number is written as one (`7`, not `7.0`).
fn one(reg: &mut Registry, name: &str, kind: Kind, help: &str, v: f64) {
    let whole = v.is_finite() && v.fract() == 0.0 && v.abs() < 9e15;
    match (kind, whole) {
        (Kind::Counter, true) => reg.register(name, help, ConstCounter::new(v as u64)),
        (Kind::Counter, false) => reg.register(name, help, ConstCounter::new(v)),
        (Kind::Gauge, true) => reg.register(name, help, ConstGauge::new(v as i64)),
        (Kind::Gauge, false) => reg.register(name, help, ConstGauge::new(v)),
    }
}

/// Register the defs found in `stats` (skipped when absent or not a number).
fn table(reg: &mut Registry, defs: &[Def], stats: &HashMap<String, String>) {
    for &(stat, name, kind, help) in defs {
        if let Some(v) = stats.get(stat).and_then(|v| number(v)) {
            one(reg, name, kind, help, v);
        }
    }
}

/// The exposition text of one scrape.
fn render(g: &Gathered, epoch: Option<&mbal_balance::snapshot::EpochSnapshot>) -> String {
    let mut reg = Registry::with_prefix("mbal");
    reg.register("up", "1: the server answered stats", ConstGauge::new(1i64));
    let info: Family<Labels, Gauge> = Family::default();
    let version = g.general.get("version").cloned().unwrap_or_default();
    info.get_or_create(&vec![("version".to_string(), version)]).set(1);
    reg.register("info", "The server's version (a constant 1)", info);
    table(&mut reg, GENERAL, &g.general);

    // Per worker, from `stats workers` (worker:N:stat).
    let mut by_stat: HashMap<&str, Vec<(usize, i64)>> = HashMap::new();
    for (k, v) in &g.workers {
        let mut parts = k.splitn(3, ':');
        if let (Some("worker"), Some(n), Some(stat), Ok(x)) =
            (parts.next(), parts.next(), parts.next(), v.parse::<i64>())
        {
            if let Ok(n) = n.parse::<usize>() {
                by_stat.entry(stat).or_default().push((n, x));
            }
        }
    }
    for &(stat, name, kind, help) in WORKERS {
        let Some(vals) = by_stat.get(stat) else { continue };
        match kind {
            Kind::Counter => {
                let f: Family<Labels, Counter> = Family::default();
                for &(w, x) in vals {
                    f.get_or_create(&worker_label(w)).inc_by(x.max(0) as u64);
                }
                reg.register(name, help, f);
            }
            Kind::Gauge => {
                let f: Family<Labels, Gauge> = Family::default();
                for &(w, x) in vals {
                    f.get_or_create(&worker_label(w)).set(x);
                }
                reg.register(name, help, f);
            }
        }
    }

    // Phase 2.
    let on = |v: Option<&String>| i64::from(v.map(String::as_str) == Some("on"));
    reg.register(
        "balancer_enabled",
        "Phase 2 (the local balancer): 1 on, 0 off",
        ConstGauge::new(on(g.balancer.get("balancer"))),
    );
    let state: Family<Labels, Gauge> = Family::default();
    if let Some(s) = g.balancer.get("state") {
        state.get_or_create(&vec![("state".to_string(), s.clone())]).set(1);
    }
    reg.register("balancer_state", "Phase 2: the balancer's state (label; the value is 1)", state);
    table(&mut reg, BALANCER, &g.balancer);
    let load: Family<Labels, Gauge<f64, AtomicU64>> = Family::default();
    for (k, v) in &g.balancer {
        if let (Some(w), Some(x)) = (k.strip_prefix("worker:").and_then(|r| r.strip_suffix(":load")), number(v)) {
            load.get_or_create(&worker_label(w)).set(x);
        }
    }
    reg.register("worker_load_requests_per_second", "Per worker: load over Phase 2's last epoch", load);

    // Phase 1.
    reg.register(
        "hot_keys_enabled",
        "Phase 1 (hot-key copies): 1 on, 0 off",
        ConstGauge::new(on(g.hotkeys.get("hot_keys"))),
    );
    table(&mut reg, HOTKEYS, &g.hotkeys);

    // The controller's latest epoch.
    let fams: Vec<Family<Labels, Gauge<f64, AtomicU64>>> = EPOCH.iter().map(|_| Family::default()).collect();
    if let Some(e) = epoch {
        for w in &e.workers {
            let l = worker_label(w.worker);
            let rate = if w.secs > 0.0 { (w.reads + w.writes) as f64 / w.secs } else { 0.0 };
            let vals = [
                w.busy,
                w.queue_wait_mean_us / 1e6,
                w.queue_wait_max_us / 1e6,
                w.inbox_len as f64,
                w.ready_conns as f64,
                rate,
            ];
            for (f, v) in fams.iter().zip(vals) {
                f.get_or_create(&l).set(v);
            }
        }
    }
    for ((name, help), f) in EPOCH.iter().zip(fams) {
        reg.register(*name, *help, f);
    }

    let mut out = String::new();
    encode(&mut out, &reg).expect("writing to a String");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_renders_counters_gauges_and_workers() {
        let mut g = Gathered::default();
        g.general.insert("cmd_get".into(), "7".into());
        g.general.insert("curr_items".into(), "3".into());
        g.general.insert("version".into(), "1.6.18-mbal-0.1.0".into());
        g.workers.insert("worker:1:curr_items".into(), "2".into());
        g.workers.insert("worker:0:cmd_get".into(), "5".into());
        g.balancer.insert("balancer".into(), "on".into());
        g.balancer.insert("state".into(), "Normal".into());
        g.balancer.insert("worker:0:load".into(), "12".into());
        let text = render(&g, None);
        for line in [
            "# HELP mbal_cmd_get Keys requested by get commands.",
            "# TYPE mbal_cmd_get counter",
            "mbal_cmd_get_total 7",
            "# TYPE mbal_current_items gauge",
            "mbal_current_items 3",
            "mbal_worker_current_items{worker=\"1\"} 2",
            "mbal_worker_cmd_get_total{worker=\"0\"} 5",
            "mbal_balancer_enabled 1",
            "mbal_balancer_state{state=\"Normal\"} 1",
            "mbal_worker_load_requests_per_second{worker=\"0\"} 12.0",
            "mbal_info{version=\"1.6.18-mbal-0.1.0\"} 1",
        ] {
            let want = line.trim_end_matches('.');
            assert!(text.lines().any(|l| l.trim_end_matches('.') == want || l == line), "{line} not in\n{text}");
        }
        assert!(!text.contains("mbal_get_misses"), "absent stats are not exported");
    }

    #[test]
    fn metric_names_are_unique_and_conventional() {
        let mut seen = std::collections::HashSet::new();
        let all =
            GENERAL.iter().chain(WORKERS).chain(BALANCER).chain(HOTKEYS).map(|d| d.1).chain(EPOCH.iter().map(|e| e.0));
        for name in all {
            assert!(seen.insert(name), "{name} twice");
            assert!(name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'), "{name}");
            assert!(!name.ends_with("_total"), "{name}: the counter suffix is added by the encoder");
        }
    }
}
