//! Statistics: per-worker counters (plain integers owned by the worker, so
//! they cost one add on the data path), per-worker snapshots gathered by
//! message when a client asks, and rendering with memcached's names.

use crate::config::Settings;
use mbal_store::WorkerStats;
use std::fmt::Display;

pub use crate::counters::{CacheletInfo, ConnInfo, Counters, PrefixOp, PrefixStats, StatSink, WorkerSnapshot};

trait AddStats {
    fn add(&mut self, o: &WorkerStats);
}

impl AddStats for WorkerStats {
    fn add(&mut self, o: &WorkerStats) {
        macro_rules! sum { ($($f:ident),*) => { $( self.$f += o.$f; )* } }
        sum!(
            cmd_get,
            cmd_set,
            cmd_touch,
            get_hits,
            get_misses,
            delete_hits,
            delete_misses,
            incr_hits,
            incr_misses,
            decr_hits,
            decr_misses,
            cas_hits,
            cas_misses,
            cas_badval,
            touch_hits,
            touch_misses,
            hash_bytes,
            out_of_memory
        );
    }
}

/// Process-wide facts for the `stats` header.
pub struct ProcessInfo<'a> {
    pub settings: &'a Settings,
    pub uptime: u32,
    pub now_unix: u64,
    pub main_port: u16,
    pub worker_ports: &'a [u16],
    /// Connections the acceptor refused (over `-c`).
    pub rejected_conns: u64,
    /// Connections refused for `--max-conns-per-ip`.
    pub rejected_per_ip: u64,
    /// `stats detail on` is in effect.
    pub detail_enabled: bool,
    /// The forwarder's figures, when it runs (`--forward`).
    pub forward: Option<ForwardFigures>,
    /// The heartbeat thread's figures, with a coordinator (`--coordinator`).
    pub coordinator: Option<CoordinatorFigures>,
    /// The threads running the workers: started, in use, whether the thread policy chooses,
    /// and its changes and trials so far.
    pub worker_threads: WorkerThreads,
}

/// `stats`: worker_threads*, the thread policy's figures (`worker/group.rs`, `fold.rs`).
#[derive(Clone, Copy, Debug, Default)]
pub struct WorkerThreads {
    pub started: usize,
    pub active: usize,
    pub auto: bool,
    pub changes: u64,
    pub trials: u64,
}

/// The heartbeat thread's counters and the lease (`--coordinator`), for `stats`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CoordinatorFigures {
    pub id: u16,
    pub beats: u64,
    pub beat_failures: u64,
    pub maps_installed: u64,
    pub registrations: u64,
    pub gone: u64,
    pub peer_reports: u64,
    pub migrations_out: u64,
    pub migrations_failed: u64,
    pub migrated_out_bytes: u64,
    pub migration_last_ms: u64,
    /// Milliseconds left of the lease (0: fenced).
    pub lease_left_ms: u64,
}

/// The forwarder's counters (`--forward`), for `stats`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardFigures {
    /// Requests sent to their owning server (resends included).
    pub requests: u64,
    /// Requests answered with an error (owner unreachable, timed out, or
    /// too many redirects), or runs of a multi-key get left missed.
    pub errors: u64,
    /// Owner connections dropped for an unanswered request.
    pub timeouts: u64,
    /// Redirects followed.
    pub redirects: u64,
    /// Owner connections opened.
    pub connects: u64,
}

fn rusage() -> (f64, f64) {
    // SAFETY: getrusage writes into the zeroed struct we pass and nothing else.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    (t(ru.ru_utime), t(ru.ru_stime))
}

/// `stats` counters of memcached mechanisms mbal does not have; always 0.
const NEVER_GENERAL: [&str; 29] = [
    "listen_disabled_num",
    "time_in_listen_disabled_us",
    "hash_is_expanding",
    "slab_reassign_rescues",
    "slab_reassign_chunk_rescues",
    "slab_reassign_evictions_nomem",
    "slab_reassign_inline_reclaim",
    "slab_reassign_busy_items",
    "slab_reassign_busy_deletes",
    "slab_reassign_running",
    "slabs_moved",
    "lru_crawler_running",
    "lru_crawler_starts",
    "lru_maintainer_juggles",
    "malloc_fails",
    "log_worker_dropped",
    "log_worker_written",
    "log_watcher_skipped",
    "log_watcher_sent",
    "log_watchers",
    "unexpected_napi_ids",
    "round_robin_fallback",
    "lrutail_reflocked",
    "moves_to_cold",
    "moves_to_warm",
    "moves_within_lru",
    "direct_reclaims",
    "lru_bumps_dropped",
    "response_obj_oom",
];

/// `stats items` fields of memcached's LRU segments and maintainer; always 0 in mbal.
const NEVER_ITEMS: [&str; 12] = [
    "number_hot",
    "number_warm",
    "age_hot",
    "age_warm",
    "tailrepairs",
    "lrutail_reflocked",
    "moves_to_cold",
    "moves_to_warm",
    "moves_within_lru",
    "hits_to_hot",
    "hits_to_warm",
    "hits_to_temp",
];

/// Render a `stats [group]` request. Returns false for an unknown group.
pub fn render(group: &str, p: &ProcessInfo, snaps: &mut [WorkerSnapshot], sink: &mut dyn StatSink) -> bool {
    snaps.sort_by_key(|s| s.worker);
    let s = p.settings;
    match group {
        "" => {
            let mut c = Counters::default();
            let mut curr_items = 0u64;
            let mut total_items = 0;
            let mut bytes = 0;
            let mut evictions = 0;
            let mut reclaimed = 0;
            let mut expired_unfetched = 0;
            let mut evicted_unfetched = 0;
            let mut get_expired = 0;
            let mut get_flushed = 0;
            let mut curr_conns = 0;
            let mut st = WorkerStats::default();
            for w in snaps.iter() {
                c.add(&w.counters);
                st.add(&w.store);
                curr_items += w.store.curr_items;
                total_items += w.store.total_items;
                bytes += w.store.bytes;
                evictions += w.store.evictions;
                reclaimed += w.store.reclaimed;
                expired_unfetched += w.store.expired_unfetched;
                evicted_unfetched += w.store.evicted_unfetched;
                get_expired += w.store.get_expired;
                get_flushed += w.store.get_flushed;
                curr_conns += w.curr_connections;
            }
            let (utime, stime) = rusage();
            sink.stat("pid", &std::process::id());
            sink.stat("uptime", &p.uptime);
            sink.stat("time", &p.now_unix);
            sink.stat("version", &crate::VERSION);
            sink.stat("pointer_size", &(std::mem::size_of::<usize>() * 8));
            sink.stat("rusage_user", &format!("{utime:.6}"));
            sink.stat("rusage_system", &format!("{stime:.6}"));
            sink.stat("max_connections", &s.max_conns);
            sink.stat("curr_connections", &curr_conns);
            sink.stat("total_connections", &c.total_connections);
            sink.stat("rejected_connections", &(c.rejected_connections + p.rejected_conns));
            sink.stat("connection_structures", &curr_conns);
            if s.tls.is_some() {
                sink.stat("ssl_handshake_errors", &c.tls_errors);
            }
            sink.stat("cmd_get", &st.cmd_get);
            sink.stat("cmd_set", &st.cmd_set);
            sink.stat("cmd_flush", &c.cmd_flush);
            sink.stat("cmd_touch", &st.cmd_touch);
            sink.stat("cmd_meta", &c.cmd_meta);
            sink.stat("get_hits", &st.get_hits);
            sink.stat("get_misses", &st.get_misses);
            sink.stat("get_expired", &get_expired);
            sink.stat("get_flushed", &get_flushed);
            sink.stat("delete_misses", &st.delete_misses);
            sink.stat("delete_hits", &st.delete_hits);
            sink.stat("incr_misses", &st.incr_misses);
            sink.stat("incr_hits", &st.incr_hits);
            sink.stat("decr_misses", &st.decr_misses);
            sink.stat("decr_hits", &st.decr_hits);
            sink.stat("cas_misses", &st.cas_misses);
            sink.stat("cas_hits", &st.cas_hits);
            sink.stat("cas_badval", &st.cas_badval);
            sink.stat("touch_hits", &st.touch_hits);
            sink.stat("touch_misses", &st.touch_misses);
            sink.stat("store_too_large", &c.store_too_large);
            sink.stat("store_no_memory", &snaps.iter().map(|w| w.store.out_of_memory).sum::<u64>());
            sink.stat("auth_cmds", &c.auth_cmds);
            sink.stat("auth_errors", &c.auth_errors);
            if s.idle_timeout > 0 {
                // memcached lists it whenever an idle timeout is set, from the start.
                sink.stat("idle_kicks", &c.idle_kicks);
            }
            sink.stat("bytes_read", &c.bytes_read);
            sink.stat("bytes_written", &c.bytes_written);
            sink.stat("limit_maxbytes", &s.memory_limit);
            sink.stat("accepting_conns", &1);
            sink.stat("threads", &s.threads);
            let wt = &p.worker_threads;
            sink.stat("worker_threads", &wt.active);
            sink.stat("worker_threads_started", &wt.started);
            sink.stat("worker_threads_policy", &if wt.auto { "auto" } else { "fixed" });
            sink.stat("worker_thread_changes", &wt.changes);
            sink.stat("worker_thread_trials", &wt.trials);
            sink.stat("conn_yields", &c.conn_yields);
            sink.stat("hash_bytes", &st.hash_bytes);
            sink.stat("bytes", &bytes);
            sink.stat("curr_items", &curr_items);
            sink.stat("total_items", &total_items);
            sink.stat("evictions", &evictions);
            sink.stat("reclaimed", &reclaimed);
            sink.stat("expired_unfetched", &expired_unfetched);
            sink.stat("evicted_unfetched", &evicted_unfetched);
            // memcached mechanisms mbal does not have (listener throttling, slab page
            // moves, the LRU crawler and maintainer, segmented LRU queues, the logger, NAPI):
            // their counters exist for exporters and stay 0 (docs/protocol.md).
            for name in NEVER_GENERAL {
                sink.stat(name, &0);
            }
            sink.stat("cross_worker_requests", &c.forwarded_out);
            sink.stat("cross_worker_direct", &c.forwarded_direct);
            sink.stat("redirects", &c.redirects);
            sink.stat("foreign_keys", &c.foreign_keys);
            if let Some(f) = &p.forward {
                sink.stat("forwarded_to_servers", &c.forwarded_servers);
                sink.stat("forward_requests", &f.requests);
                sink.stat("forward_errors", &f.errors);
                sink.stat("forward_timeouts", &f.timeouts);
                sink.stat("forward_redirects", &f.redirects);
                sink.stat("forward_connects", &f.connects);
            }
            sink.stat("cachelets_moved", &c.cachelets_adopted);
            if let Some(f) = &p.coordinator {
                sink.stat("coordinator_server_id", &f.id);
                sink.stat("coordinator_beats", &f.beats);
                sink.stat("coordinator_beat_failures", &f.beat_failures);
                sink.stat("coordinator_maps_installed", &f.maps_installed);
                sink.stat("coordinator_registrations", &f.registrations);
                sink.stat("coordinator_declared_dead", &f.gone);
                sink.stat("coordinator_peer_reports", &f.peer_reports);
                sink.stat("migrations_out", &f.migrations_out);
                sink.stat("migrations_failed", &f.migrations_failed);
                sink.stat("migrated_out_bytes", &f.migrated_out_bytes);
                sink.stat("migration_last_ms", &f.migration_last_ms);
                sink.stat("coordinator_lease_left_ms", &f.lease_left_ms);
                sink.stat("cachelets_dropped", &c.cachelets_dropped);
                sink.stat("cachelets_claimed", &c.cachelets_claimed);
                sink.stat("migrations_in", &c.migrations_in);
                sink.stat("migrations_refused", &c.migrations_refused);
                sink.stat("migrated_in_bytes", &c.migrated_in_bytes);
                sink.stat("fenced_keys", &c.fenced_keys);
                sink.stat("moving_errors", &c.moving_errors);
            }
            sink.stat("hot_replications", &c.hot_replications);
            sink.stat("hot_hints", &c.hot_hints);
            sink.stat("replica_reads", &c.replica_reads);
            sink.stat("replica_redirects", &c.replica_redirects);
            sink.stat("replica_items", &c.replica_items);
            sink.stat("replica_bytes", &c.replica_bytes);
            sink.stat("replica_refused", &c.replica_refused);
            sink.stat("cachelets", &snaps.iter().map(|w| w.cachelets.len()).sum::<usize>());
            sink.stat("peer_auth_cmds", &c.peer_auth_cmds);
            sink.stat("peer_auth_errors", &c.peer_auth_errors);
            sink.stat("control_refused", &c.control_refused);
            sink.stat("rejected_connections_per_ip", &p.rejected_per_ip);
            sink.stat("input_limit_closes", &c.input_limit_closes);
            sink.stat("request_timeouts", &c.request_timeouts);
        }
        "settings" => {
            sink.stat("maxbytes", &s.memory_limit);
            sink.stat("maxconns", &s.max_conns);
            sink.stat("tcpport", &p.main_port);
            sink.stat("udpport", &0);
            sink.stat("interface", &s.listen);
            sink.stat("inter", &s.listen);
            sink.stat("domain_socket", &"NULL");
            sink.stat("stat_key_prefix", &(s.prefix_delimiter as char));
            sink.stat("detail_enabled", &if p.detail_enabled { "yes" } else { "no" });
            sink.stat("num_threads_per_udp", &s.threads);
            sink.stat("auth_enabled_sasl", &if s.auth.is_some() { "yes" } else { "no" });
            sink.stat("auth_enabled_ascii", &if s.auth.is_some() { "yes" } else { "no" });
            sink.stat("maxconns_fast", &"yes");
            sink.stat("dump_enabled", &"no");
            let on = snaps.iter().any(|w| w.store.track_sizes);
            sink.stat("track_sizes", &if on { "yes" } else { "no" });
            match &s.tls {
                None => sink.stat("ssl_enabled", &"no"),
                Some(t) => {
                    sink.stat("ssl_enabled", &"yes");
                    sink.stat("ssl_chain_cert", &t.chain_cert.display());
                    sink.stat("ssl_key", &t.key.as_deref().unwrap_or(&t.chain_cert).display());
                    let ca = t.ca_cert.as_ref().map(|p| p.display().to_string());
                    sink.stat("ssl_ca_cert", &ca.as_deref().unwrap_or("NULL"));
                    let mode = match t.verify_mode {
                        mbal_tls::VerifyMode::None => 0,
                        mbal_tls::VerifyMode::Optional => 1,
                        mbal_tls::VerifyMode::Required => 2,
                    };
                    sink.stat("ssl_verify_mode", &mode);
                }
            }
            sink.stat("verbosity", &s.verbosity);
            sink.stat("evictions", &if s.evictions { "on" } else { "off" });
            sink.stat("num_threads", &s.threads);
            sink.stat("reqs_per_event", &s.reqs_per_event);
            sink.stat("cas_enabled", &if s.cas_enabled { "yes" } else { "no" });
            sink.stat("tcp_backlog", &s.backlog);
            sink.stat("binding_protocol", &s.binding.name());
            sink.stat("item_size_max", &s.max_item_size);
            sink.stat("idle_timeout", &s.idle_timeout);
            sink.stat("flush_enabled", &if s.flush_enabled { "yes" } else { "no" });
            sink.stat("shutdown_command", &if s.shutdown_enabled { "yes" } else { "no" });
            sink.stat("cachelets_per_worker", &s.cachelets_per_worker);
            sink.stat("max_conns_per_ip", &s.max_conns_per_ip);
            sink.stat("max_input_buffer", &s.max_input_buffer);
            sink.stat("request_timeout_ms", &s.request_timeout_ms);
            sink.stat("forward", &if s.forward { "yes" } else { "no" });
            sink.stat("forward_timeout_ms", &s.forward_timeout_ms);
            sink.stat("control_secret", &if s.control_secret.is_some() { "yes" } else { "no" });
            sink.stat("vn_count", &s.vn_count);
            sink.stat("page_size", &s.page_size);
            sink.stat("worker_capacity", &s.worker_capacity);
            let ports: Vec<String> = p.worker_ports.iter().map(|x| x.to_string()).collect();
            sink.stat("worker_ports", &ports.join(","));
        }
        // mbal has no slab classes; each worker is reported as one "class"
        // (numbered worker+1) so exporters that walk items:N:field work.
        "items" => {
            for w in snaps.iter() {
                let n = w.worker + 1;
                sink.stat(&format!("items:{n}:number"), &w.store.curr_items);
                sink.stat(&format!("items:{n}:evicted"), &w.store.evictions);
                sink.stat(&format!("items:{n}:evicted_unfetched"), &w.store.evicted_unfetched);
                sink.stat(&format!("items:{n}:expired_unfetched"), &w.store.expired_unfetched);
                sink.stat(&format!("items:{n}:reclaimed"), &w.store.reclaimed);
                sink.stat(&format!("items:{n}:outofmemory"), &w.store.out_of_memory);
                // One queue per worker, no hot/warm/temp LRU segments: everything is "cold".
                sink.stat(&format!("items:{n}:number_cold"), &w.store.curr_items);
                sink.stat(&format!("items:{n}:mem_requested"), &w.store.bytes);
                sink.stat(&format!("items:{n}:hits_to_cold"), &w.store.get_hits);
                for name in NEVER_ITEMS {
                    sink.stat(&format!("items:{n}:{name}"), &0);
                }
            }
        }
        "slabs" => {
            let mut total_pages = 0;
            for w in snaps.iter() {
                let n = w.worker + 1;
                sink.stat(&format!("{n}:chunk_size"), &s.page_size);
                sink.stat(&format!("{n}:total_pages"), &w.store.pages_held);
                sink.stat(&format!("{n}:used_chunks"), &w.store.curr_items);
                // No `N:mem_requested` here: memcached 1.6 reports it in `stats items` only,
                // and memcached_exporter, which maps both to one metric, fails on having both.
                sink.stat(&format!("{n}:get_hits"), &w.store.get_hits);
                sink.stat(&format!("{n}:cmd_set"), &w.store.cmd_set);
                sink.stat(&format!("{n}:delete_hits"), &w.store.delete_hits);
                sink.stat(&format!("{n}:incr_hits"), &w.store.incr_hits);
                sink.stat(&format!("{n}:decr_hits"), &w.store.decr_hits);
                sink.stat(&format!("{n}:cas_hits"), &w.store.cas_hits);
                sink.stat(&format!("{n}:cas_badval"), &w.store.cas_badval);
                sink.stat(&format!("{n}:touch_hits"), &w.store.touch_hits);
                total_pages += w.store.pages_held;
            }
            sink.stat("active_slabs", &snaps.len());
            sink.stat("total_malloced", &(total_pages * s.page_size as u64));
        }
        "conns" => {
            for w in snaps.iter() {
                for c in &w.conns {
                    sink.stat(&format!("{}:addr", c.id), &c.addr);
                    sink.stat(&format!("{}:listen_addr", c.id), &c.listen_addr);
                    sink.stat(&format!("{}:state", c.id), &c.state);
                    sink.stat(&format!("{}:secs_since_last_cmd", c.id), &c.idle_secs);
                    sink.stat(&format!("{}:worker", c.id), &w.worker);
                }
            }
        }
        "cachelets" => {
            let mut all: Vec<&CacheletInfo> = snaps.iter().flat_map(|w| w.cachelets.iter()).collect();
            all.sort_by_key(|c| c.id);
            for c in all {
                let id = c.id;
                sink.stat(&format!("cachelet:{id}:owner"), &c.owner);
                sink.stat(&format!("cachelet:{id}:items"), &c.stats.items);
                sink.stat(&format!("cachelet:{id}:bytes"), &c.stats.bytes);
                sink.stat(&format!("cachelet:{id}:reads"), &c.stats.reads);
                sink.stat(&format!("cachelet:{id}:writes"), &c.stats.writes);
                sink.stat(&format!("cachelet:{id}:reads_per_sec"), &c.reads_per_sec);
                sink.stat(&format!("cachelet:{id}:writes_per_sec"), &c.writes_per_sec);
            }
        }
        "workers" => {
            for w in snaps.iter() {
                let n = w.worker;
                let port = p.worker_ports.get(n).copied().unwrap_or(0);
                sink.stat(&format!("worker:{n}:port"), &port);
                sink.stat(&format!("worker:{n}:cmd_get"), &w.store.cmd_get);
                sink.stat(&format!("worker:{n}:cmd_set"), &w.store.cmd_set);
                sink.stat(&format!("worker:{n}:get_hits"), &w.store.get_hits);
                sink.stat(&format!("worker:{n}:curr_items"), &w.store.curr_items);
                sink.stat(&format!("worker:{n}:bytes"), &w.store.bytes);
                sink.stat(&format!("worker:{n}:cachelets"), &w.cachelets.len());
                sink.stat(&format!("worker:{n}:curr_connections"), &w.curr_connections);
                sink.stat(&format!("worker:{n}:forwarded_out"), &w.counters.forwarded_out);
                sink.stat(&format!("worker:{n}:forwarded_in"), &w.counters.forwarded_in);
                sink.stat(&format!("worker:{n}:forwarded_direct"), &w.counters.forwarded_direct);
                sink.stat(&format!("worker:{n}:inflight_stalls"), &w.counters.inflight_stalls);
                sink.stat(&format!("worker:{n}:capacity_stalls"), &w.counters.capacity_stalls);
            }
        }
        "detail dump" => {
            let mut all = PrefixStats::default();
            for w in snaps.iter() {
                all.add(&w.counters.prefixes);
            }
            all.dump(sink);
        }
        _ => return false,
    }
    true
}

/// Text-protocol sink: `STAT name value\r\n`.
/// `stats balancer`: the local balancer's state, as the controller last
/// published it (memcached-style lines; docs/protocol.md).
pub(crate) fn render_balancer(settings: &Settings, st: &mbal_balance::BalancerStatus, sink: &mut dyn StatSink) {
    let on = settings.balancer;
    sink.stat("balancer", &if on { "on" } else { "off" });
    sink.stat("epoch_ms", &settings.epoch_ms);
    // Phase 2's epoch as it runs: whole epochs.
    sink.stat("balance_epoch_ms", &settings.balance_every().saturating_mul(settings.epoch_ms));
    sink.stat("state", &if on && !st.state.is_empty() { st.state.as_str() } else { "off" });
    sink.stat("epoch", &st.epoch);
    sink.stat("max_over_avg", &format_args!("{:.3}", st.max_over_avg));
    sink.stat("imbalance_factor", &format_args!("{:.3}", st.imbalance_factor));
    sink.stat("plans", &st.plans);
    sink.stat("moves", &st.moves);
    sink.stat("moves_home", &st.moves_home);
    sink.stat("moves_failed", &st.moves_failed);
    sink.stat("escalations", &st.escalations);
    sink.stat("leases", &st.leases);
    sink.stat("planner_us_last", &st.planner_us_last);
    sink.stat("planner_us_max", &st.planner_us_max);
    for (w, load) in &st.loads {
        sink.stat(&format!("worker:{w}:load"), &format_args!("{load:.0}"));
    }
}

/// `stats sizes`, `stats sizes_enable`, `stats sizes_disable` (`group`'s first word): memcached's
/// item size histogram (`mbal_store`'s `store/sizes.rs`), summed over the workers. True when
/// the answer ends with `END` as memcached's does: `sizes_enable` and `sizes_disable` answer
/// their status line alone (memcached 1.6 sends no `END` after them).
pub(crate) fn render_sizes(
    settings: &Settings,
    pool: &mbal_store::GlobalPool,
    group: &str,
    sink: &mut dyn StatSink,
) -> bool {
    match group.split(' ').next() {
        Some("sizes_enable") => {
            if settings.cas_enabled {
                pool.sizes_enable(settings.threads, settings.max_item_size);
                sink.stat("sizes_status", &"enabled");
            } else {
                // memcached counts only items newer than the enabling, by CAS.
                sink.stat("sizes_status", &"error");
                sink.stat("sizes_error", &"cas_support_disabled");
            }
            false
        }
        Some("sizes_disable") => {
            pool.sizes_disable();
            sink.stat("sizes_status", &"disabled");
            false
        }
        _ => {
            match pool.sizes() {
                None => sink.stat("sizes_status", &"disabled"),
                Some(buckets) => {
                    for (size, n) in buckets {
                        sink.stat(&size.to_string(), &n);
                    }
                }
            }
            true
        }
    }
}

/// `stats hotkeys`: Phase 1's last epoch and its hottest tracked keys (by
/// estimated requests per second over all copies), with their replica
/// counts and states (`on`: Phase 1 runs here).
pub(crate) fn render_hotkeys(settings: &Settings, st: &mbal_balance::HotStatus, on: bool, sink: &mut dyn StatSink) {
    sink.stat("hot_keys", &if on { "on" } else { "off" });
    let h = &settings.hot;
    // The rate in force (set each epoch from the sample target, or fixed).
    let rate = if st.sample_rate > 0.0 { st.sample_rate } else { h.policy.sample_rate };
    sink.stat("sample_rate", &format_args!("{rate:.5}"));
    sink.stat("sample_target", &h.policy.sample_target);
    sink.stat("target_imbalance", &h.policy.target_imbalance);
    sink.stat("replica_writes", &h.writes_mode());
    sink.stat("lease_ms", &h.lease_ms());
    sink.stat("copy_ttl_ms", &h.copy_ttl_ms());
    sink.stat("epoch", &st.epoch);
    sink.stat("threshold", &format_args!("{:.0}", st.threshold));
    sink.stat("estimated_max_over_avg", &format_args!("{:.3}", st.estimated_max_over_avg));
    sink.stat("unreplicated_max_over_avg", &format_args!("{:.3}", st.unreplicated_max_over_avg));
    sink.stat("replicated", &st.replicated);
    sink.stat("repl_high", &st.repl_high);
    sink.stat("waiting", &st.waiting);
    sink.stat("slots_lent", &st.slots_lent);
    sink.stat("slots_held", &st.slots_held);
    sink.stat("copies_made", &st.copies_made);
    sink.stat("copies_failed", &st.copies_failed);
    sink.stat("alarms", &st.alarms);
    sink.stat("escalate", &st.escalate.as_deref().unwrap_or("none"));
    for (i, k) in st.top.iter().enumerate() {
        sink.stat(
            &format!("key:{i}"),
            &format_args!(
                "{} worker={} reads_per_sec={:.0} writes_per_sec={:.0} state={:?} replicas={}",
                String::from_utf8_lossy(&k.key),
                k.worker,
                k.reads_per_sec,
                k.writes_per_sec,
                k.state,
                k.replicas
            ),
        );
    }
}

pub struct TextSink<'a>(pub &'a mut Vec<u8>);

impl StatSink for TextSink<'_> {
    fn stat(&mut self, name: &str, value: &dyn Display) {
        use std::io::Write;
        let _ = write!(self.0, "STAT {name} {value}\r\n");
    }
    fn line(&mut self, line: &str) {
        self.0.extend_from_slice(line.as_bytes());
        self.0.extend_from_slice(b"\r\n");
    }
}

/// Binary-protocol sink: one STAT response packet per statistic.
pub struct BinSink<'a> {
    pub out: &'a mut Vec<u8>,
    pub opaque: u32,
}

impl StatSink for BinSink<'_> {
    fn stat(&mut self, name: &str, value: &dyn Display) {
        let v = value.to_string();
        mbal_proto::binary::write_response(
            self.out,
            mbal_proto::binary::opcode::STAT,
            mbal_proto::binary::status::NO_ERROR,
            self.opaque,
            0,
            &[],
            name.as_bytes(),
            v.as_bytes(),
        );
    }
}

/// One item's line in a dump, as memcached 1.6 writes it: `lru_crawler metadump`'s
/// (`key=<key, %-encoded> exp=<unix time, or -1> la=<unix time> cas=<n> fetch=<yes|no>
/// cls=<class> size=<bytes>`, ending in a bare `\n`) or `stats cachedump`'s (`ITEM <key>
/// [<value bytes> b; <expiry, unix time, or 0> s]`). `class` is the worker + 1 (`stats
/// items`); `start_unix` turns the store's times into unix times.
pub(crate) fn dump_item(meta: bool, it: &mbal_store::ItemMeta, class: usize, start_unix: u64, out: &mut Vec<u8>) {
    use std::io::Write;
    let exp = (it.exptime != 0).then(|| start_unix + u64::from(it.exptime));
    if !meta {
        out.extend_from_slice(b"ITEM ");
        out.extend_from_slice(it.key);
        let _ = write!(out, " [{} b; {} s]\r\n", it.vlen, exp.unwrap_or(0));
        return;
    }
    out.extend_from_slice(b"key=");
    for &b in it.key {
        // memcached's uriencode: all but the unreserved characters as %XX.
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    let exp = exp.map_or(-1, |e| e as i64);
    let la = start_unix + u64::from(it.last_access);
    let fetch = if it.fetched { "yes" } else { "no" };
    let _ = writeln!(out, " exp={exp} la={la} cas={} fetch={fetch} cls={class} size={}", it.cas, it.size);
}

#[cfg(test)]
mod dump_tests {
    use super::dump_item;

    #[test]
    fn dump_lines_are_memcacheds() {
        let it = mbal_store::ItemMeta {
            key: b"baz:1",
            vlen: 2,
            exptime: 100,
            last_access: 4,
            cas: 2,
            fetched: true,
            size: 56,
        };
        let mut out = Vec::new();
        dump_item(true, &it, 1, 1_000, &mut out);
        assert_eq!(out, b"key=baz%3A1 exp=1100 la=1004 cas=2 fetch=yes cls=1 size=56\n");
        out.clear();
        dump_item(false, &it, 1, 1_000, &mut out);
        assert_eq!(out, b"ITEM baz:1 [2 b; 1100 s]\r\n");
        let it = mbal_store::ItemMeta { exptime: 0, fetched: false, key: b"foo", ..it };
        out.clear();
        dump_item(true, &it, 2, 1_000, &mut out);
        assert_eq!(out, b"key=foo exp=-1 la=1004 cas=2 fetch=no cls=2 size=56\n");
        out.clear();
        dump_item(false, &it, 2, 1_000, &mut out);
        assert_eq!(out, b"ITEM foo [2 b; 0 s]\r\n");
    }
}
