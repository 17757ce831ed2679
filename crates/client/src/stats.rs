//! Cluster-wide statistics for `mbal stats`: one plain connection per
//! server's main port, `stats` and `stats workers`, parsed into
//! [`ServerStats`]; [`render_stats_table`] turns one or two samples into a
//! text table.

use crate::conn::Conn;
use crate::{ClusterMap, Error, Peer, Result};
use mbal_proto::client::{Expect, Reply};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

/// One worker's figures (from `stats workers`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerStats {
    pub worker: u16,
    pub port: u16,
    pub cmd_get: u64,
    pub cmd_set: u64,
    pub get_hits: u64,
    pub curr_items: u64,
    pub bytes: u64,
    pub cachelets: u64,
    pub curr_connections: u64,
    pub forwarded_out: u64,
    pub forwarded_in: u64,
}

/// One server's figures (from `stats` and `stats workers`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    pub server: u16,
    pub addr: Option<SocketAddr>,
    pub uptime: u64,
    pub cmd_get: u64,
    pub cmd_set: u64,
    pub get_hits: u64,
    pub get_misses: u64,
    pub curr_items: u64,
    pub bytes: u64,
    pub curr_connections: u64,
    pub cachelets: u64,
    pub redirects: u64,
    pub cross_worker_requests: u64,
    pub workers: Vec<WorkerStats>,
    /// Every `stats` line as sent, for fields not parsed above.
    pub raw: BTreeMap<String, String>,
}

fn stat_u64(m: &BTreeMap<String, String>, name: &str) -> u64 {
    m.get(name).and_then(|v| v.parse().ok()).unwrap_or(0)
}

impl ServerStats {
    /// Build from the lines of `stats` and `stats workers`.
    pub fn from_stats(server: u16, general: Vec<(String, String)>, workers: Vec<(String, String)>) -> ServerStats {
        let raw: BTreeMap<String, String> = general.into_iter().collect();
        let mut ws: BTreeMap<u16, WorkerStats> = BTreeMap::new();
        for (name, value) in workers {
            let mut it = name.splitn(3, ':');
            let (Some("worker"), Some(n), Some(field)) = (it.next(), it.next(), it.next()) else { continue };
            let Ok(n) = n.parse::<u16>() else { continue };
            let v: u64 = value.trim().parse().unwrap_or(0);
            let w = ws.entry(n).or_insert_with(|| WorkerStats { worker: n, ..WorkerStats::default() });
            match field {
                "port" => w.port = v as u16,
                "cmd_get" => w.cmd_get = v,
                "cmd_set" => w.cmd_set = v,
                "get_hits" => w.get_hits = v,
                "curr_items" => w.curr_items = v,
                "bytes" => w.bytes = v,
                "cachelets" => w.cachelets = v,
                "curr_connections" => w.curr_connections = v,
                "forwarded_out" => w.forwarded_out = v,
                "forwarded_in" => w.forwarded_in = v,
                _ => {}
            }
        }
        ServerStats {
            server,
            addr: None,
            uptime: stat_u64(&raw, "uptime"),
            cmd_get: stat_u64(&raw, "cmd_get"),
            cmd_set: stat_u64(&raw, "cmd_set"),
            get_hits: stat_u64(&raw, "get_hits"),
            get_misses: stat_u64(&raw, "get_misses"),
            curr_items: stat_u64(&raw, "curr_items"),
            bytes: stat_u64(&raw, "bytes"),
            curr_connections: stat_u64(&raw, "curr_connections"),
            cachelets: stat_u64(&raw, "cachelets"),
            redirects: stat_u64(&raw, "redirects"),
            cross_worker_requests: stat_u64(&raw, "cross_worker_requests"),
            workers: ws.into_values().collect(),
            raw,
        }
    }
}

fn stats_group(c: &mut Conn, group: &str) -> Result<Vec<(String, String)>> {
    let req = if group.is_empty() { "stats\r\n".to_string() } else { format!("stats {group}\r\n") };
    match c.call(req.as_bytes(), Expect::Stats)? {
        Reply::Stats(s) => Ok(s),
        Reply::Error(line) => Err(Error::Server { addr: c.addr, peer: c.peer, line }),
        r => Err(c.unexpected(req.trim_end(), &r)),
    }
}

/// `stats` and `stats workers` of every server of the map, in server order
/// (one connection to each main port, TLS with `tls`; `timeout` bounds the connect
/// and every read and write).
pub fn cluster_stats(
    map: &ClusterMap,
    timeout: Duration,
    tls: Option<&mbal_tls::ClientTls>,
) -> Result<Vec<ServerStats>> {
    let mut out = Vec::new();
    for (i, s) in map.servers().iter().enumerate() {
        let mut c = Conn::open(s.main, Peer::Server(i as u16), timeout, timeout, tls)?;
        let general = stats_group(&mut c, "")?;
        let workers = stats_group(&mut c, "workers")?;
        let mut st = ServerStats::from_stats(i as u16, general, workers);
        st.addr = Some(s.main);
        out.push(st);
    }
    Ok(out)
}

/// [`cluster_stats`] over connections opened by `dialer` (the cluster
/// file's TLS, and its secret's `mbal peer` login for servers with `-Y`).
pub fn cluster_stats_dialed(map: &ClusterMap, dialer: &mbal_member::dial::Dialer) -> Result<Vec<ServerStats>> {
    let mut out = Vec::new();
    for (i, s) in map.servers().iter().enumerate() {
        let peer = Peer::Server(i as u16);
        let stream = dialer.dial(s.main, mbal_member::dial::Proto::Text).map_err(|source| crate::Error::Io {
            addr: s.main,
            peer,
            source,
        })?;
        let mut c = Conn::from_stream(stream, s.main, peer);
        let general = stats_group(&mut c, "")?;
        let workers = stats_group(&mut c, "workers")?;
        let mut st = ServerStats::from_stats(i as u16, general, workers);
        st.addr = Some(s.main);
        out.push(st);
    }
    Ok(out)
}

fn rate(cur: u64, prev: Option<u64>, secs: f64) -> String {
    match prev {
        Some(p) if secs > 0.0 => format!("{:.0}", cur.saturating_sub(p) as f64 / secs),
        _ => "-".into(),
    }
}

fn ratio(hits: u64, gets: u64) -> String {
    if gets == 0 {
        "-".into()
    } else {
        format!("{:.1}%", hits as f64 * 100.0 / gets as f64)
    }
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// A table per server and per worker: ops/s (gets + sets, from `prev` to
/// `cur` over `secs`; "-" without a previous sample), hit ratio (over the
/// interval when there is a previous sample, else since start), items,
/// bytes, cachelets.
pub fn render_stats_table(prev: Option<&[ServerStats]>, cur: &[ServerStats], secs: f64) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{:<24} {:>10} {:>10} {:>10} {:>8} {:>12} {:>12} {:>9}",
        "server/worker", "ops/s", "get/s", "set/s", "hit", "items", "bytes", "cachelets"
    );
    for s in cur {
        let p = prev.and_then(|p| p.iter().find(|x| x.server == s.server && x.addr == s.addr));
        let name = match s.addr {
            Some(a) => format!("server {} {a}", s.server),
            None => format!("server {}", s.server),
        };
        let (hits, gets) = match p {
            Some(p) => (s.get_hits.saturating_sub(p.get_hits), s.cmd_get.saturating_sub(p.cmd_get)),
            None => (s.get_hits, s.cmd_get),
        };
        let _ = writeln!(
            t,
            "{:<24} {:>10} {:>10} {:>10} {:>8} {:>12} {:>12} {:>9}",
            name,
            rate(s.cmd_get + s.cmd_set, p.map(|p| p.cmd_get + p.cmd_set), secs),
            rate(s.cmd_get, p.map(|p| p.cmd_get), secs),
            rate(s.cmd_set, p.map(|p| p.cmd_set), secs),
            ratio(hits, gets),
            s.curr_items,
            human_bytes(s.bytes),
            s.cachelets
        );
        for w in &s.workers {
            let pw = p.and_then(|p| p.workers.iter().find(|x| x.worker == w.worker));
            let (hits, gets) = match pw {
                Some(p) => (w.get_hits.saturating_sub(p.get_hits), w.cmd_get.saturating_sub(p.cmd_get)),
                None => (w.get_hits, w.cmd_get),
            };
            let _ = writeln!(
                t,
                "{:<24} {:>10} {:>10} {:>10} {:>8} {:>12} {:>12} {:>9}",
                format!("  worker {} :{}", w.worker, w.port),
                rate(w.cmd_get + w.cmd_set, pw.map(|p| p.cmd_get + p.cmd_set), secs),
                rate(w.cmd_get, pw.map(|p| p.cmd_get), secs),
                rate(w.cmd_set, pw.map(|p| p.cmd_set), secs),
                ratio(hits, gets),
                w.curr_items,
                human_bytes(w.bytes),
                w.cachelets
            );
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
    }

    fn sample(gets: u64, sets: u64, hits: u64) -> ServerStats {
        let g = gets.to_string();
        let s = sets.to_string();
        let h = hits.to_string();
        ServerStats::from_stats(
            0,
            kv(&[
                ("cmd_get", &g),
                ("cmd_set", &s),
                ("get_hits", &h),
                ("curr_items", "7"),
                ("bytes", "2048"),
                ("cachelets", "32"),
                ("version", "1.6.0-mbal"),
            ]),
            kv(&[
                ("worker:1:port", "9002"),
                ("worker:0:port", "9001"),
                ("worker:0:cmd_get", &g),
                ("worker:0:cmd_set", &s),
                ("worker:0:get_hits", &h),
                ("worker:0:curr_items", "7"),
                ("worker:0:bytes", "2048"),
                ("worker:0:cachelets", "16"),
                ("worker:1:cachelets", "16"),
                ("worker:0:forwarded_out", "3"),
                ("worker:1:new_field", "1"),
                ("garbage", "x"),
            ]),
        )
    }

    #[test]
    fn parses_stats_and_workers() {
        let s = sample(100, 50, 80);
        assert_eq!((s.cmd_get, s.cmd_set, s.get_hits, s.curr_items, s.bytes, s.cachelets), (100, 50, 80, 7, 2048, 32));
        assert_eq!(s.raw["version"], "1.6.0-mbal");
        assert_eq!(s.workers.len(), 2);
        assert_eq!(s.workers[0].worker, 0, "sorted by worker");
        assert_eq!(s.workers[0].port, 9001);
        assert_eq!(s.workers[0].forwarded_out, 3);
        assert_eq!(s.workers[1].port, 9002);
        assert_eq!(s.workers[1].cachelets, 16);
    }

    #[test]
    fn table_rates_and_ratios() {
        let a = vec![sample(100, 50, 80)];
        let b = vec![sample(300, 150, 230)];
        let one = render_stats_table(None, &b, 2.0);
        assert!(one.lines().nth(1).unwrap().contains(" - "), "no rate without a previous sample:\n{one}");
        assert!(one.contains("76.7%"), "230/300 since start:\n{one}");
        let two = render_stats_table(Some(&a), &b, 2.0);
        let server = two.lines().nth(1).unwrap();
        // (300+150 - 150) / 2 s = 150 ops/s; gets 100/s; sets 50/s; hits 150/200.
        let cols: Vec<&str> = server.split_whitespace().collect();
        assert_eq!(&cols[..2], ["server", "0"]);
        assert_eq!(&cols[2..7], ["150", "100", "50", "75.0%", "7"], "{two}");
        assert!(server.contains("2.0 KiB"));
        assert_eq!(two.lines().count(), 1 + 1 + 2, "header, server, two workers");
        assert!(two.lines().nth(2).unwrap().trim_start().starts_with("worker 0 :9001"));
    }

    #[test]
    fn human_bytes_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }
}
