//! The local balancer (Phase 2) in a real server: under a sustained hot
//! partition it moves cachelets away from the hot worker while plain and
//! routed clients keep reading and writing, and every reply is right; under a
//! uniform load it stays quiet.

mod common;

use common::{settings, start, Conn, Layout};
use mbal_client::{Client, Config as ClientConfig};
use mbal_cluster::key_hash;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// `mbal load <after>` as raw JSON (the snapshot and the balancer's decision).
fn load(c: &mut Conn, after: u64) -> Value {
    let head = c.cmd(&format!("mbal load {after}\r\n"));
    let n: usize = head.split_whitespace().nth(2).unwrap_or_else(|| panic!("bad {head:?}")).parse().unwrap();
    let body = c.exact(n + 2);
    serde_json::from_slice(&body[..n]).unwrap()
}

fn stats(c: &mut Conn, group: &str) -> HashMap<String, String> {
    c.send(format!("stats {group}\r\n").as_bytes());
    c.until_end()
        .into_iter()
        .map(|l| {
            let mut p = l.split_whitespace().skip(1);
            (p.next().unwrap().to_string(), p.next().unwrap_or("").to_string())
        })
        .collect()
}

/// Keys of the given cachelets, `per` each.
fn keys_of(layout: &Layout, cachelets: &[u32], per: usize) -> Vec<String> {
    let mut out = Vec::new();
    for &c in cachelets {
        out.extend(
            (0..)
                .map(|i| format!("hot:{c}:{i}"))
                .filter(|k| layout.cachelet_of_hash(key_hash(k.as_bytes())) == c)
                .take(per),
        );
    }
    out
}

/// A plain main-port client: sets its own keys with a version it counts up
/// and reads them back, checking every reply against what it wrote last.
fn plain_client(addr: std::net::SocketAddr, keys: Vec<String>, stop: Arc<AtomicBool>, max_ops: usize) -> usize {
    let mut c = Conn::open(addr);
    let mut last: HashMap<&str, u64> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ops = 0;
    while !stop.load(Ordering::Relaxed) && ops < max_ops && Instant::now() < deadline {
        let k = &keys[ops % keys.len()];
        if ops % 4 == 0 {
            let v = last.get(k.as_str()).map_or(1, |v| v + 1);
            let val = v.to_string();
            assert_eq!(c.cmd(&format!("set {k} 0 0 {}\r\n{val}\r\n", val.len())), "STORED\r\n");
            last.insert(k, v);
        } else {
            let got = c.get(k).map(|v| String::from_utf8(v).unwrap().parse::<u64>().unwrap());
            assert_eq!(got, last.get(k.as_str()).copied(), "key {k}: read what was last written");
        }
        ops += 1;
    }
    ops
}

/// A routed client (mbal-client): follows redirects as cachelets move.
fn routed_client(addr: std::net::SocketAddr, keys: Vec<String>, stop: Arc<AtomicBool>, max_ops: usize) -> usize {
    let mut c = Client::connect(addr, ClientConfig::default()).expect("routed client");
    let mut last: HashMap<&str, u64> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ops = 0;
    while !stop.load(Ordering::Relaxed) && ops < max_ops && Instant::now() < deadline {
        let k = &keys[ops % keys.len()];
        if ops % 4 == 0 {
            let v = last.get(k.as_str()).map_or(1, |v| v + 1);
            assert!(c.set(k.as_bytes(), v.to_string().as_bytes(), 0, 0).unwrap());
            last.insert(k, v);
        } else {
            let got = c.get(k.as_bytes()).unwrap().map(|v| String::from_utf8(v.data).unwrap().parse::<u64>().unwrap());
            assert_eq!(got, last.get(k.as_str()).copied(), "key {k}: read what was last written");
        }
        ops += 1;
    }
    ops
}

fn balanced_settings(threads: usize) -> mbal_server::config::Settings {
    let mut s = settings(threads);
    s.worker_port_base = None;
    s.epoch_ms = 50;
    s.balance_epoch_ms = 50;
    s.balancer = true;
    s.balance.persistence = 2;
    s.balance.lease_epochs = 10;
    s
}

/// Start plain (even) and routed (odd) clients, each on its own share of `keys`.
fn clients(addr: std::net::SocketAddr, keys: &[String], stop: &Arc<AtomicBool>) -> Vec<thread::JoinHandle<usize>> {
    (0..4)
        .map(|i| {
            let mine: Vec<String> = keys.iter().skip(i).step_by(4).cloned().collect();
            let stop = stop.clone();
            thread::spawn(move || {
                if i % 2 == 0 {
                    plain_client(addr, mine, stop, 2_000_000)
                } else {
                    routed_client(addr, mine, stop, 2_000_000)
                }
            })
        })
        .collect()
}

/// Moves away under a hot partition, and home again once it has cooled
/// and the leases end, with plain and routed clients reading their own
/// writes throughout (in the moving cachelets too).
#[test]
fn a_hot_partition_is_spread_and_goes_home_while_clients_read_their_writes() {
    let s = balanced_settings(4);
    let (cpw, vn) = (s.cachelets_per_worker, s.vn_count);
    let srv = start(s);
    let layout = Layout::even(1, 4, cpw, vn);
    // Four cachelets of worker 0 carry all the traffic.
    let hot: Vec<u32> = (0..layout.owners.len() as u32).filter(|&c| layout.owner(c).1 == 0).take(4).collect();
    let keys = keys_of(&layout, &hot, 32);
    let stop = Arc::new(AtomicBool::new(false));
    // Disjoint key sets: each client checks its own writes.
    let hot_clients = clients(srv.main_addr, &keys, &stop);
    // Await epochs until the balancer has moved cachelets away from worker 0
    // and the hottest worker carries less than twice the mean.
    let mut admin = Conn::open(srv.main_addr);
    let (mut last, mut moved, mut settled) = (0, 0usize, false);
    for _ in 0..400 {
        let e = load(&mut admin, last);
        last = e["seq"].as_u64().unwrap();
        if let Some(d) = e["balancer"].as_object() {
            moved += d["moves"].as_array().map_or(0, |m| m.len());
            let moa = d["imbalance"]["max_over_avg"].as_f64().unwrap_or(0.0);
            if moved > 0 && moa > 0.0 && moa < 2.0 {
                settled = true;
                break;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let ops: usize = hot_clients.into_iter().map(|c| c.join().expect("a client saw a wrong reply")).sum();
    assert!(ops > 0);
    assert!(moved > 0, "the balancer moved nothing");
    assert!(settled, "the load never spread (moves: {moved})");

    // The hotspot ends: every cachelet as busy as the next (the hot keys
    // among them, so clients read the cachelets as they go home).
    let mut cool: Vec<String> = (0..2048).map(|i| format!("cool:{i}")).collect();
    cool.extend(keys.iter().cloned());
    let stop = Arc::new(AtomicBool::new(false));
    let cool_clients = clients(srv.main_addr, &cool, &stop);
    let mut home = 0;
    for _ in 0..400 {
        let e = load(&mut admin, last);
        last = e["seq"].as_u64().unwrap();
        if let Some(moves) = e["balancer"]["moves"].as_array() {
            home += moves.iter().filter(|m| m["why"] == "LeaseExpired").count();
        }
        if home >= moved.min(1) && e["balancer"]["leases"] == 0 {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in cool_clients {
        c.join().expect("a client saw a wrong reply");
    }
    assert!(home > 0, "no cachelet went home after the hotspot ended");
    // A move the last loaded epochs started (the clients stopping skews the
    // final epoch) holds a lease of its own: with no load left it runs out and
    // its cachelet goes home. Await that, epoch by epoch, within a bound.
    let away_of = |admin: &mut Conn| -> (HashMap<String, String>, Vec<u32>) {
        let st = stats(admin, "balancer");
        let cl = stats(admin, "cachelets");
        let away = hot.iter().copied().filter(|c| cl[&format!("cachelet:{c}:owner")] != "0").collect();
        (st, away)
    };
    let (mut st, mut away) = away_of(&mut admin);
    for _ in 0..200 {
        if st["leases"] == "0" && away.is_empty() {
            break;
        }
        last = load(&mut admin, last)["seq"].as_u64().unwrap();
        (st, away) = away_of(&mut admin);
    }
    assert_eq!(st["balancer"], "on");
    assert!(st["moves_home"].parse::<u64>().unwrap() > 0, "{st:?}");
    assert_eq!(st["leases"], "0", "every lease ended: {st:?}");
    // Every hot cachelet is back on worker 0, its home.
    assert!(away.is_empty(), "hot cachelets still away from home: {away:?}");
    srv.shutdown();
}

#[test]
fn a_uniform_load_makes_no_moves() {
    let mut s = balanced_settings(4);
    // Longer epochs and the default persistence: per-epoch counts large
    // enough that sampling noise is not an imbalance.
    s.epoch_ms = 100;
    s.balance_epoch_ms = 100;
    s.balance.persistence = 4;
    let srv = start(s);
    let keys: Vec<String> = (0..4096).map(|i| format!("u:{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for i in 0..4 {
        let mine: Vec<String> = keys.iter().skip(i).step_by(4).cloned().collect();
        let (addr, stop) = (srv.main_addr, stop.clone());
        clients.push(thread::spawn(move || plain_client(addr, mine, stop, 2_000_000)));
    }
    let mut admin = Conn::open(srv.main_addr);
    let mut last = 0;
    let mut decisions = 0;
    // 30 epochs of steady uniform traffic: far past the persistence.
    while decisions < 30 {
        let e = load(&mut admin, last);
        last = e["seq"].as_u64().unwrap();
        if let Some(d) = e["balancer"].as_object() {
            decisions += 1;
            assert_eq!(d["moves"].as_array().map_or(0, |m| m.len()), 0, "a move under uniform load: {d:?}");
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().expect("a client saw a wrong reply");
    }
    let st = stats(&mut admin, "balancer");
    assert_eq!(st["moves"], "0", "{st:?}");
    srv.shutdown();
}

/// Phase 2 decides once per `balance_epoch_ms` (here every 3rd epoch), on
/// the load of the epochs since its last decision merged: each worker's load
/// in the decision is its requests over those epochs by their total length,
/// not the last epoch's.
#[test]
fn phase_2_decides_once_per_its_epoch_on_the_epochs_merged() {
    let mut s = balanced_settings(2);
    s.epoch_ms = 20;
    s.balance_epoch_ms = 60;
    // It only watches: no move, so each cachelet's counts are the epochs' sum.
    s.balance.persistence = 1_000_000;
    let srv = start(s);
    let keys: Vec<String> = (0..512).map(|i| format!("m:{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let clients = clients(srv.main_addr, &keys, &stop);
    let mut admin = Conn::open(srv.main_addr);
    let mut seen: Vec<Value> = Vec::new();
    let mut checked = 0;
    // Every epoch in turn (`mbal load` answers the next one, never skips).
    for _ in 0..300 {
        let after = seen.last().map_or(0, |e: &Value| e["seq"].as_u64().unwrap());
        let e = load(&mut admin, after);
        let seq = e["seq"].as_u64().unwrap();
        assert!(seen.is_empty() || seq == after + 1, "epoch {seq} after {after}");
        let d = e["balancer"].clone();
        assert_eq!(!d.is_null(), seq.is_multiple_of(3), "epoch {seq}: decided only at every 3rd: {d}");
        seen.push(e);
        if d.is_null() || seen.len() < 3 {
            continue;
        }
        let merged = &seen[seen.len() - 3..];
        for pair in d["loads"].as_array().unwrap() {
            let (w, got) = (pair[0].as_u64().unwrap(), pair[1].as_f64().unwrap());
            let (mut ops, mut secs) = (0u64, 0.0);
            for e in merged {
                let wl = e["workers"].as_array().unwrap().iter().find(|x| x["worker"].as_u64() == Some(w)).unwrap();
                secs += wl["secs"].as_f64().unwrap();
                for c in wl["cachelets"].as_array().unwrap() {
                    ops += c["reads"].as_u64().unwrap() + c["writes"].as_u64().unwrap();
                }
            }
            let want = ops as f64 / secs;
            assert!(
                (got - want).abs() <= 1e-6 * want.max(1.0),
                "epoch {seq} worker {w}: {got} req/s, the 3 epochs say {want}"
            );
        }
        let busy = d["loads"].as_array().unwrap().iter().all(|p| p[1].as_f64().unwrap() > 0.0);
        checked += usize::from(busy);
        if checked == 5 {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().expect("a client saw a wrong reply");
    }
    assert_eq!(checked, 5, "five decisions under load compared with their epochs");
    srv.shutdown();
}
