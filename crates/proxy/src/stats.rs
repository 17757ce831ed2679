//! The proxy's statistics: each thread counts into plain local integers and
//! publishes the deltas once per loop round into its own slot (a mutex only
//! `stats` readers contend for); `stats` adds the slots up.

use mbal_cluster::Owner;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Buckets of the latency histogram (see [`bucket`]).
pub const BUCKETS: usize = 252;

/// Log-linear bucket of a latency in microseconds: exact below 4, then four
/// buckets per power of two (at most 25% wide).
#[inline]
pub fn bucket(us: u64) -> usize {
    if us < 4 {
        return us as usize;
    }
    let e = 63 - us.leading_zeros() as usize;
    (e - 1) * 4 + ((us >> (e - 2)) & 3) as usize
}

/// The largest latency (µs) that falls in bucket `i`.
pub fn bucket_high(i: usize) -> u64 {
    if i < 4 {
        return i as u64;
    }
    let e = i / 4 + 1;
    let m = (i % 4) as u64;
    ((4 + m) << (e - 2)) + (1u64 << (e - 2)) - 1
}

/// Counters of one upstream (a worker of a server), summed over threads.
#[derive(Clone, Debug)]
pub struct UpTotals {
    pub addr: String,
    /// Requests sent (each resend after a redirect counts again).
    pub requests: u64,
    /// Requests answered with `SERVER_ERROR` because the upstream failed,
    /// stalled or was down.
    pub errors: u64,
    /// Times a request waited longer than `--upstream-timeout-ms`.
    pub timeouts: u64,
    /// Redirects (`RD`) received.
    pub redirects: u64,
    /// Connections opened (the first and every reconnect).
    pub connects: u64,
    pub latency_sum_us: u64,
    pub hist: Box<[u64; BUCKETS]>,
}

impl UpTotals {
    fn new(addr: String) -> UpTotals {
        UpTotals {
            addr,
            requests: 0,
            errors: 0,
            timeouts: 0,
            redirects: 0,
            connects: 0,
            latency_sum_us: 0,
            hist: Box::new([0; BUCKETS]),
        }
    }

    fn add(&mut self, o: &UpTotals) {
        self.requests += o.requests;
        self.errors += o.errors;
        self.timeouts += o.timeouts;
        self.redirects += o.redirects;
        self.connects += o.connects;
        self.latency_sum_us += o.latency_sum_us;
        for (a, b) in self.hist.iter_mut().zip(o.hist.iter()) {
            *a += b;
        }
    }

    /// The latency (µs) below which a fraction `q` of the answered requests fell.
    pub fn quantile(&self, q: f64) -> u64 {
        let n: u64 = self.hist.iter().sum();
        if n == 0 {
            return 0;
        }
        let want = ((n as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, &c) in self.hist.iter().enumerate() {
            seen += c;
            if seen >= want {
                return bucket_high(i);
            }
        }
        bucket_high(BUCKETS - 1)
    }
}

/// Per-upstream deltas kept by a thread between publications.
#[derive(Default, Debug)]
pub struct UpDelta {
    pub requests: u64,
    pub errors: u64,
    pub timeouts: u64,
    pub redirects: u64,
    pub connects: u64,
    /// Latencies (µs) of the replies received.
    pub latencies: Vec<u32>,
}

impl UpDelta {
    pub fn is_empty(&self) -> bool {
        self.requests == 0
            && self.errors == 0
            && self.timeouts == 0
            && self.redirects == 0
            && self.connects == 0
            && self.latencies.is_empty()
    }
}

/// Proxy-wide command counters (deltas locally, totals when published).
#[derive(Clone, Copy, Default, Debug)]
pub struct Counters {
    pub total_connections: u64,
    pub rejected_connections: u64,
    pub cmd_get: u64,
    pub get_hits: u64,
    pub cmd_set: u64,
    pub cmd_touch: u64,
    pub cmd_flush: u64,
    pub cmd_meta: u64,
    pub map_fetches: u64,
    /// Gets answered by a hot key's copy, and gets sent to a copy that went home instead.
    pub replica_reads: u64,
    pub replica_fallbacks: u64,
    /// Times a server could not be reached (each starts or extends its backoff).
    pub unreachable: u64,
    /// Reads of a server that could not be reached answered as misses (per request, or per
    /// part of a multi-get), and other requests answered `SERVER_ERROR mbal server <addr>
    /// unreachable`.
    pub unreachable_misses: u64,
    pub unreachable_errors: u64,
    /// Requests for a server that could not be reached that waited for a map fetch before
    /// they were sent again (to a new owner) or answered as unreachable.
    pub unreachable_waits: u64,
    /// Map fetches after a server could not be reached (also in `map_fetches`), and newer maps
    /// installed (from those or from redirects).
    pub map_refreshes: u64,
    pub maps_installed: u64,
    /// Map fetches asked of the coordinators (also in `map_fetches`), and those no coordinator
    /// answered (then a server's map was fetched).
    pub map_coordinator_fetches: u64,
    pub map_coordinator_failures: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
}

impl Counters {
    pub fn add(&mut self, o: &Counters) {
        self.total_connections += o.total_connections;
        self.rejected_connections += o.rejected_connections;
        self.cmd_get += o.cmd_get;
        self.get_hits += o.get_hits;
        self.cmd_set += o.cmd_set;
        self.cmd_touch += o.cmd_touch;
        self.cmd_flush += o.cmd_flush;
        self.cmd_meta += o.cmd_meta;
        self.map_fetches += o.map_fetches;
        self.replica_reads += o.replica_reads;
        self.replica_fallbacks += o.replica_fallbacks;
        self.unreachable += o.unreachable;
        self.unreachable_misses += o.unreachable_misses;
        self.unreachable_errors += o.unreachable_errors;
        self.unreachable_waits += o.unreachable_waits;
        self.map_refreshes += o.map_refreshes;
        self.maps_installed += o.maps_installed;
        self.map_coordinator_fetches += o.map_coordinator_fetches;
        self.map_coordinator_failures += o.map_coordinator_failures;
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
    }
}

/// What one thread published.
#[derive(Default)]
pub struct ThreadTotals {
    pub counters: Counters,
    pub ups: BTreeMap<Owner, UpTotals>,
    pub map_epoch: u64,
}

impl ThreadTotals {
    pub fn publish(&mut self, owner: Owner, addr: &str, d: &mut UpDelta) {
        let t = self.ups.entry(owner).or_insert_with(|| UpTotals::new(addr.to_string()));
        if t.addr != addr {
            t.addr = addr.to_string();
        }
        t.requests += d.requests;
        t.errors += d.errors;
        t.timeouts += d.timeouts;
        t.redirects += d.redirects;
        t.connects += d.connects;
        for &us in &d.latencies {
            t.latency_sum_us += us as u64;
            t.hist[bucket(us as u64)] += 1;
        }
        *d = UpDelta { latencies: std::mem::take(&mut d.latencies), ..UpDelta::default() };
        d.latencies.clear();
    }
}

/// Shared by the proxy's threads: one published slot per thread.
pub struct Shared {
    pub started: Instant,
    pub threads: Vec<Mutex<ThreadTotals>>,
    pub curr_connections: AtomicU64,
    pub settings: Vec<(&'static str, String)>,
}

impl Shared {
    fn sum(&self) -> ThreadTotals {
        let mut all = ThreadTotals::default();
        for t in &self.threads {
            let t = t.lock().unwrap();
            all.counters.add(&t.counters);
            all.map_epoch = all.map_epoch.max(t.map_epoch);
            for (o, u) in &t.ups {
                all.ups.entry(*o).or_insert_with(|| UpTotals::new(u.addr.clone())).add(u);
            }
        }
        all
    }

    pub fn reset(&self) {
        for t in &self.threads {
            let mut t = t.lock().unwrap();
            t.counters = Counters { total_connections: 0, ..Counters::default() };
            for u in t.ups.values_mut() {
                *u = UpTotals::new(u.addr.clone());
            }
        }
    }

    /// `stats` (memcached's general names the proxy can fill, then the
    /// proxy's own totals), `STAT` lines and `END`.
    pub fn render_general(&self, out: &mut Vec<u8>) {
        let all = self.sum();
        let c = &all.counters;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let mut s = String::new();
        let mut stat = |name: &str, v: &dyn std::fmt::Display| {
            let _ = write!(s, "STAT {name} {v}\r\n");
        };
        stat("pid", &std::process::id());
        stat("uptime", &self.started.elapsed().as_secs());
        stat("time", &now);
        stat("version", &crate::VERSION);
        stat("pointer_size", &(std::mem::size_of::<usize>() * 8));
        stat("threads", &self.threads.len());
        stat("curr_connections", &self.curr_connections.load(Ordering::Relaxed));
        stat("total_connections", &c.total_connections);
        stat("rejected_connections", &c.rejected_connections);
        stat("cmd_get", &c.cmd_get);
        stat("cmd_set", &c.cmd_set);
        stat("cmd_flush", &c.cmd_flush);
        stat("cmd_touch", &c.cmd_touch);
        stat("cmd_meta", &c.cmd_meta);
        stat("get_hits", &c.get_hits);
        stat("get_misses", &c.cmd_get.saturating_sub(c.get_hits));
        stat("bytes_read", &c.bytes_read);
        stat("bytes_written", &c.bytes_written);
        let sum = |f: fn(&UpTotals) -> u64| all.ups.values().map(f).sum::<u64>();
        stat("proxy_upstreams", &all.ups.len());
        stat("proxy_upstream_requests", &sum(|u| u.requests));
        stat("proxy_upstream_errors", &sum(|u| u.errors));
        stat("proxy_upstream_timeouts", &sum(|u| u.timeouts));
        stat("proxy_redirects", &sum(|u| u.redirects));
        stat("proxy_upstream_connects", &sum(|u| u.connects));
        stat("proxy_map_fetches", &c.map_fetches);
        stat("proxy_replica_reads", &c.replica_reads);
        stat("proxy_replica_fallbacks", &c.replica_fallbacks);
        stat("proxy_unreachable", &c.unreachable);
        stat("proxy_unreachable_misses", &c.unreachable_misses);
        stat("proxy_unreachable_errors", &c.unreachable_errors);
        stat("proxy_unreachable_waits", &c.unreachable_waits);
        stat("proxy_map_refreshes", &c.map_refreshes);
        stat("proxy_maps_installed", &c.maps_installed);
        stat("proxy_map_coordinator_fetches", &c.map_coordinator_fetches);
        stat("proxy_map_coordinator_failures", &c.map_coordinator_failures);
        stat("proxy_map_epoch", &all.map_epoch);
        out.extend_from_slice(s.as_bytes());
        out.extend_from_slice(b"END\r\n");
    }

    /// `stats proxy`: per upstream `upstream:<server>:<worker>:<name>`.
    pub fn render_proxy(&self, out: &mut Vec<u8>) {
        let all = self.sum();
        let mut s = String::new();
        for ((sv, w), u) in &all.ups {
            // a server's binary upstream (its main port) is worker "main"
            let p = if *w == u16::MAX { format!("upstream:{sv}:main") } else { format!("upstream:{sv}:{w}") };
            let answered: u64 = u.hist.iter().sum();
            let mean = u.latency_sum_us.checked_div(answered).unwrap_or(0);
            let _ = write!(
                s,
                "STAT {p}:addr {}\r\nSTAT {p}:requests {}\r\nSTAT {p}:errors {}\r\nSTAT {p}:timeouts {}\r\n\
                 STAT {p}:redirects {}\r\nSTAT {p}:connects {}\r\nSTAT {p}:replies {answered}\r\n\
                 STAT {p}:latency_mean_us {mean}\r\nSTAT {p}:latency_p50_us {}\r\nSTAT {p}:latency_p99_us {}\r\n",
                u.addr,
                u.requests,
                u.errors,
                u.timeouts,
                u.redirects,
                u.connects,
                u.quantile(0.5),
                u.quantile(0.99),
            );
        }
        out.extend_from_slice(s.as_bytes());
        out.extend_from_slice(b"END\r\n");
    }

    /// `stats settings`.
    pub fn render_settings(&self, out: &mut Vec<u8>) {
        for (k, v) in &self.settings {
            let _ = write!(SliceWriter(out), "STAT {k} {v}\r\n");
        }
        out.extend_from_slice(b"END\r\n");
    }
}

struct SliceWriter<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for SliceWriter<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_tight() {
        let mut prev = 0;
        for us in 0..100_000u64 {
            let b = bucket(us);
            assert!(b >= prev && b < BUCKETS);
            assert!(bucket_high(b) >= us, "{us} in bucket {b} up to {}", bucket_high(b));
            assert!(bucket_high(b) <= us + us / 4 + 1, "{us}: bucket too wide");
            prev = b;
        }
        assert!(bucket(u64::MAX) < BUCKETS);
    }

    #[test]
    fn quantiles() {
        let mut t = ThreadTotals::default();
        let mut d = UpDelta { requests: 100, latencies: (1..=100).collect(), ..UpDelta::default() };
        t.publish((0, 1), "a", &mut d);
        assert!(d.is_empty());
        let u = &t.ups[&(0, 1)];
        assert_eq!(u.requests, 100);
        let p50 = u.quantile(0.5);
        assert!((50..=63).contains(&p50), "{p50}");
        let p99 = u.quantile(0.99);
        assert!((99..=127).contains(&p99), "{p99}");
        assert_eq!(UpTotals::new("x".into()).quantile(0.5), 0);
    }
}
