//! `mbal server --metrics-listen`: a scrape of each server of a loaded 2-server cluster (2
//! workers each) is parsed; every metric has HELP and TYPE lines, and the metrics scraped are
//! exactly the ones docs/operations.md "Metrics" lists (those listed as present only with an
//! option the cluster does not use excepted).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The metrics the docs list: name as scraped -> the "Only with" column (empty: always).
fn documented() -> BTreeMap<String, String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md")).unwrap();
    let start = doc.find("\n## Metrics").expect("a Metrics section");
    let section = &doc[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let mut out = BTreeMap::new();
    for line in section.lines().filter(|l| l.starts_with("| `mbal_")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let name = cells[1].trim_matches('`').split('{').next().unwrap().to_string();
        let only_with = cells.get(4).unwrap_or(&"").to_string();
        assert!(out.insert(name.clone(), only_with).is_none(), "{name} twice in the docs");
    }
    assert!(out.len() > 100, "{out:?}");
    out
}

/// One parsed scrape: family -> (type, help), and the sample names seen.
struct Scrape {
    families: BTreeMap<String, (String, String)>,
    samples: BTreeMap<String, Vec<f64>>,
}

fn parse(text: &str) -> Scrape {
    let mut families = BTreeMap::new();
    let mut helps = BTreeMap::new();
    let mut samples: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap();
            helps.insert(name.to_string(), help.to_string());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            let help = helps.get(name).unwrap_or_else(|| panic!("TYPE before HELP: {name}")).clone();
            assert!(help.len() > 5, "{name}: help {help:?}");
            families.insert(name.to_string(), (kind.to_string(), help));
        } else if line == "# EOF" || line.is_empty() {
        } else {
            let (name, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line:?}"));
            let name = name.split('{').next().unwrap();
            let v: f64 = value.parse().unwrap_or_else(|_| panic!("{line:?}"));
            samples.entry(name.to_string()).or_default().push(v);
        }
    }
    Scrape { families, samples }
}

/// The scrape's metrics (a counter's as its `_total` sample), each with HELP, TYPE, a sample,
/// and a line in the docs.
fn described(scrape: &Scrape, docs: &BTreeMap<String, String>) -> BTreeSet<String> {
    let mut scraped = BTreeSet::new();
    for (family, (kind, _help)) in &scrape.families {
        let sample = if kind == "counter" { format!("{family}_total") } else { family.clone() };
        assert!(scrape.samples.contains_key(&sample), "{sample}: HELP/TYPE without a sample");
        assert!(docs.contains_key(&sample), "{sample} is scraped but not in docs/operations.md \"Metrics\"");
        scraped.insert(sample);
    }
    for sample in scrape.samples.keys() {
        assert!(scraped.contains(sample), "{sample} has no HELP/TYPE");
    }
    scraped
}

fn get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"), "{head}");
    body.to_string()
}

/// Sets and gets on a server's main port (pipelined; every reply read).
fn load(addr: &str, n: usize) {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    let mut req = Vec::new();
    for i in 0..n {
        write!(req, "set key{i} 0 0 5 noreply\r\nvalue\r\nget key{i}\r\n").unwrap();
    }
    w.write_all(&req).unwrap();
    let mut ends = 0;
    let mut line = String::new();
    while ends < n {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "closed after {ends} gets");
        if line == "END\r\n" {
            ends += 1;
        }
    }
}

/// The cluster of issue 36's check: 4 servers x 2 workers.
const SERVERS: usize = 4;

#[test]
fn a_scrape_of_a_loaded_cluster_has_every_documented_metric() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.toml");
    let mut up = common::mbal()
        .args(["cluster", "up", "--servers", &SERVERS.to_string(), "--workers", "2", "-m", "16"])
        .args(["--file", file.to_str().unwrap()])
        .args([
            "--server-arg=--metrics-listen=127.0.0.1:0",
            "--server-arg=--print-ports",
            "--server-arg=--epoch-ms=100",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = up.stdout.take().unwrap();
    let _guard = common::Kill(up);
    // The servers' --print-ports lines and cluster up's report share the pipe.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            if tx.send(line.unwrap()).is_err() {
                return;
            }
        }
    });
    let (mut mains, mut metrics, mut ready) = (Vec::new(), Vec::new(), false);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(ready && metrics.len() == SERVERS) {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).expect("cluster up's report and a metrics address per server");
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
            mains.push(v["main"].as_str().unwrap().to_string());
            metrics.push(v["metrics"].as_str().expect("a metrics address").to_string());
        }
        ready |= line.starts_with("Ctrl-C");
    }
    for m in &mains {
        load(m, 300);
    }
    let docs = documented();
    for addr in &metrics {
        // Until the controller's first epoch after the load has been measured (bounded).
        let deadline = Instant::now() + Duration::from_secs(20);
        let scrape = loop {
            let s = parse(&get(addr, "/metrics"));
            let busy = s.samples.get("mbal_worker_busy_ratio").is_some_and(|v| v.len() == 2);
            let cmds = s.samples.get("mbal_cmd_get_total").is_some_and(|v| v[0] > 0.0);
            let loads = s.samples.get("mbal_worker_load_requests_per_second").is_some_and(|v| v.len() == 2);
            if busy && cmds && loads {
                break s;
            }
            assert!(Instant::now() < deadline, "no epoch measured with the load");
            std::thread::sleep(Duration::from_millis(50));
        };
        let scraped = described(&scrape, &docs);
        for (name, only_with) in &docs {
            assert!(!only_with.is_empty() || scraped.contains(name), "{name} is documented but not scraped");
        }
        for name in &scraped {
            assert_eq!(docs[name], "", "{name}: scraped from a server without the option the docs name");
        }
        assert_eq!(scrape.samples["mbal_up"], [1.0]);
        assert_eq!(scrape.samples["mbal_worker_current_connections"].len(), 2, "one per worker");
        assert_eq!(scrape.samples["mbal_balancer_enabled"], [1.0], "on in a cluster");
        assert_eq!(scrape.samples["mbal_hot_keys_enabled"], [1.0], "on in a cluster");
        assert!(scrape.samples["mbal_read_bytes_total"][0] > 0.0);
    }
}

/// With `-Z` and `-Y`, a scrape still gathers (its admin connection is plain and logged in)
/// and shows the TLS and auth counters.
#[test]
fn a_scrape_of_a_server_with_tls_and_logins() {
    let pki = mbal_tls::test_certs::Pki::new("metrics");
    pki.server("srv");
    std::fs::write(pki.dir.join("users"), "app:pw\n").unwrap();
    let p = |f: &str| pki.dir.join(f).to_str().unwrap().to_string();
    let mut child = common::mbal()
        .args(["server", "-l", "127.0.0.1", "-p", "0", "-t", "1", "-m", "16", "--print-ports"])
        .args(["--metrics-listen", "127.0.0.1:0", "-Y", &p("users"), "-Z"])
        .args(["-o", &format!("ssl_chain_cert={},ssl_key={}", p("srv.pem"), p("srv.key"))])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let _guard = common::Kill(child);
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    // A plain-text client on the TLS port: a failed handshake.
    let mut plain = TcpStream::connect(v["main"].as_str().unwrap()).unwrap();
    plain.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    plain.write_all(b"version\r\n").unwrap();
    let _ = plain.read(&mut [0u8; 64]);
    let addr = v["metrics"].as_str().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = parse(&get(addr, "/metrics"));
        assert_eq!(s.samples["mbal_up"], [1.0]);
        assert_eq!(s.samples["mbal_auth_errors_total"], [0.0]);
        if s.samples["mbal_ssl_handshake_errors_total"][0] >= 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the failed handshake is not counted");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `mbal coordinator --metrics-listen`: its documented metrics, members up.
#[test]
fn a_scrape_of_the_coordinator() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.toml");
    let mut up = common::mbal()
        .args(["cluster", "up", "--servers", "2", "--workers", "1", "-m", "16", "--coordinator"])
        .args(["--file", file.to_str().unwrap()])
        .args(["--coordinator-arg=--metrics-listen=127.0.0.1:0", "--coordinator-arg=--print-ports"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = up.stdout.take().unwrap();
    let _guard = common::Kill(up);
    let mut metrics = None;
    for line in BufReader::new(out).lines() {
        let line = line.unwrap();
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
            metrics = Some(v["metrics"].as_str().expect("a metrics address").to_string());
        }
        if line.starts_with("Ctrl-C") {
            break;
        }
    }
    let addr = metrics.expect("the coordinator's --print-ports line");
    let docs: BTreeMap<String, String> =
        documented().into_iter().filter(|(_, only)| only == "`mbal coordinator`").collect();
    assert!(docs.len() > 20, "{docs:?}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let scrape = parse(&get(&addr, "/metrics"));
        let scraped = described(&scrape, &docs);
        for name in docs.keys() {
            assert!(scraped.contains(name), "{name} is documented but not scraped");
        }
        assert_eq!(scrape.samples["mbal_coordinator_servers"], [2.0]);
        if scrape.samples["mbal_coordinator_servers_up"] == [2.0]
            && scrape.samples["mbal_coordinator_beats_total"][0] > 0.0
        {
            assert_eq!(scrape.samples["mbal_coordinator_member_state"], [1.0, 1.0]);
            break;
        }
        assert!(Instant::now() < deadline, "the servers are not up at the coordinator");
        std::thread::sleep(Duration::from_millis(50));
    }
}
