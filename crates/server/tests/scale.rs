//! The cross-worker path under load, over real sockets: long pipelines whose
//! keys live on every worker, from several clients at once (text, meta and
//! binary, multi-gets spanning all workers, noreply and quiet commands,
//! cachelets moving mid-pipeline), checked byte for byte against a model;
//! how the acceptor spreads connections; and the bound on forwarded
//! requests when a worker stalls.

mod common;
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Send `req` from a thread of its own while reading `expect.len()` bytes,
/// so neither side waits for the other's buffers; return what came back.
fn exchange(addr: SocketAddr, req: Vec<u8>, expect_len: usize) -> Vec<u8> {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&req).expect("write"));
    let mut got = vec![0u8; expect_len];
    let mut r = &s;
    r.read_exact(&mut got).unwrap_or_else(|e| panic!("reading {expect_len} bytes: {e}"));
    writer.join().unwrap();
    got
}

/// A random text + meta pipeline over `keys` and the replies a memcached
/// would give, from a model of the values.
fn text_pipeline(rng: &mut StdRng, keys: &[String], ops: usize) -> (Vec<u8>, Vec<u8>) {
    let mut model: HashMap<&str, String> = HashMap::new();
    let (mut req, mut rep) = (Vec::new(), Vec::new());
    let value = |k: &str, model: &HashMap<&str, String>, cas: &str| match model.get(k) {
        Some(v) => format!("VALUE {k} 0 {}{cas}\r\n{v}\r\n", v.len()),
        None => String::new(),
    };
    for _ in 0..ops {
        let k = keys[rng.gen_range(0..keys.len())].as_str();
        match rng.gen_range(0..12) {
            0..=2 => {
                let v = rng.gen_range(0..1_000_000u64).to_string();
                let noreply = rng.gen_bool(0.3);
                let nr = if noreply { " noreply" } else { "" };
                req.extend(format!("set {k} 0 0 {}{nr}\r\n{v}\r\n", v.len()).bytes());
                if !noreply {
                    rep.extend(b"STORED\r\n");
                }
                model.insert(k, v);
            }
            3 | 4 => {
                req.extend(format!("get {k}\r\n").bytes());
                rep.extend(value(k, &model, "").bytes());
                rep.extend(b"END\r\n");
            }
            5 | 6 => {
                // A multi-get over keys on every worker, in request order.
                let n = rng.gen_range(2..40);
                let ks: Vec<&str> = (0..n).map(|_| keys[rng.gen_range(0..keys.len())].as_str()).collect();
                req.extend(format!("get {}\r\n", ks.join(" ")).bytes());
                for k in ks {
                    rep.extend(value(k, &model, "").bytes());
                }
                rep.extend(b"END\r\n");
            }
            7 => {
                let noreply = rng.gen_bool(0.5);
                req.extend(format!("delete {k}{}\r\n", if noreply { " noreply" } else { "" }).bytes());
                let line: &[u8] = if model.remove(k).is_some() { b"DELETED\r\n" } else { b"NOT_FOUND\r\n" };
                if !noreply {
                    rep.extend(line);
                }
            }
            8 => {
                req.extend(format!("incr {k} 7\r\n").bytes());
                match model.get_mut(k) {
                    Some(v) => {
                        *v = (v.parse::<u64>().unwrap() + 7).to_string();
                        rep.extend(format!("{v}\r\n").bytes());
                    }
                    None => rep.extend(b"NOT_FOUND\r\n"),
                }
            }
            9 => {
                let v = rng.gen_range(0..1_000u64).to_string();
                req.extend(format!("ms {k} {} q\r\n{v}\r\n", v.len()).bytes());
                model.insert(k, v);
            }
            10 => {
                let quiet = rng.gen_bool(0.5);
                req.extend(format!("mg {k} v{}\r\n", if quiet { " q" } else { "" }).bytes());
                match model.get(k) {
                    Some(v) => rep.extend(format!("VA {}\r\n{v}\r\n", v.len()).bytes()),
                    None if !quiet => rep.extend(b"EN\r\n"),
                    None => {}
                }
            }
            _ => {
                req.extend(b"mn\r\n");
                rep.extend(b"MN\r\n");
            }
        }
    }
    req.extend(b"version\r\n");
    rep.extend(format!("VERSION {}\r\n", mbal_server::VERSION).bytes());
    (req, rep)
}

fn bin_request(opcode: u8, opaque: u32, extras: &[u8], key: &[u8], value: &[u8]) -> Vec<u8> {
    let body = extras.len() + key.len() + value.len();
    let mut b = vec![0x80, opcode];
    b.extend((key.len() as u16).to_be_bytes());
    b.push(extras.len() as u8);
    b.extend([0, 0, 0]);
    b.extend((body as u32).to_be_bytes());
    b.extend(opaque.to_be_bytes());
    b.extend([0u8; 8]);
    b.extend(extras);
    b.extend(key);
    b.extend(value);
    b
}

/// Binary SETQ / GETKQ / NOOP pipeline and the (opcode, opaque, key, value)
/// of every response a memcached would send (quiet ones only on a hit).
type BinReply = (u8, u32, Vec<u8>, Vec<u8>);

fn bin_pipeline(rng: &mut StdRng, keys: &[String], ops: usize) -> (Vec<u8>, Vec<BinReply>) {
    const SETQ: u8 = 0x11;
    const GETKQ: u8 = 0x0d;
    const NOOP: u8 = 0x0a;
    let mut model: HashMap<&str, Vec<u8>> = HashMap::new();
    let (mut req, mut rep) = (Vec::new(), Vec::new());
    for i in 0..ops as u32 {
        let k = keys[rng.gen_range(0..keys.len())].as_str();
        if rng.gen_bool(0.4) {
            let v = format!("b{}", rng.gen_range(0..1_000_000u32)).into_bytes();
            req.extend(bin_request(SETQ, i, &[0; 8], k.as_bytes(), &v));
            model.insert(k, v);
        } else {
            req.extend(bin_request(GETKQ, i, &[], k.as_bytes(), &[]));
            if let Some(v) = model.get(k) {
                rep.push((GETKQ, i, k.as_bytes().to_vec(), v.clone()));
            }
        }
    }
    req.extend(bin_request(NOOP, u32::MAX, &[], &[], &[]));
    rep.push((NOOP, u32::MAX, vec![], vec![]));
    (req, rep)
}

fn read_bin_replies(addr: SocketAddr, req: Vec<u8>, until_noop: usize) -> Vec<BinReply> {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&req).expect("write"));
    let mut r = &s;
    let mut out = Vec::new();
    while out.len() < until_noop {
        let mut h = [0u8; 24];
        r.read_exact(&mut h).expect("response header");
        assert_eq!(h[0], 0x81, "response magic");
        assert_eq!(u16::from_be_bytes([h[6], h[7]]), 0, "status of {:?}", h);
        let (klen, elen) = (u16::from_be_bytes([h[2], h[3]]) as usize, h[4] as usize);
        let body = u32::from_be_bytes([h[8], h[9], h[10], h[11]]) as usize;
        let mut b = vec![0u8; body];
        r.read_exact(&mut b).unwrap();
        let opaque = u32::from_be_bytes([h[12], h[13], h[14], h[15]]);
        out.push((h[1], opaque, b[elen..elen + klen].to_vec(), b[elen + klen..].to_vec()));
    }
    writer.join().unwrap();
    out
}

#[test]
fn pipelines_over_every_worker_come_back_complete_and_in_order() {
    // More workers than this machine has cores, as operators run memcached's
    // -t 4 on small machines, each on its own thread: every hop between
    // threads is exercised.
    pipelines_over_every_worker(mbal_server::config::Settings { worker_threads: 4, ..settings(4) }, false);
}

#[test]
fn pipelines_over_workers_sharing_threads_come_back_complete_and_in_order() {
    // The same with the 4 workers on 2 threads (what `-t 4` does by itself
    // on a 2-CPU machine): hops within a thread (run on the owner's store
    // directly, `near`) and across threads (messages).
    pipelines_over_every_worker(mbal_server::config::Settings { worker_threads: 2, ..settings(4) }, false);
}

#[test]
fn pipelines_over_workers_moving_between_threads_come_back_complete_and_in_order() {
    // The same while the number of threads in use changes all the time (`mbal threads`, what
    // the thread policy does when it folds or spreads the workers): workers leave one
    // thread and join another between their rounds, mid-pipeline, and a hop between two
    // workers turns from a message into a direct call and back.
    pipelines_over_every_worker(mbal_server::config::Settings { worker_threads: 4, ..settings(4) }, true);
}

fn pipelines_over_every_worker(s: mbal_server::config::Settings, rethread: bool) {
    let srv = start(s);
    let (main, workers) = (srv.main_addr, srv.worker_addrs.clone());
    let stop = Arc::new(AtomicBool::new(false));
    // Cachelets move between workers for as long as the clients run.
    let mover = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut admin = Conn::open(main);
            let mut moves = 0u32;
            let mut rng = StdRng::seed_from_u64(99);
            while !stop.load(Ordering::Relaxed) || moves < 20 {
                let (c, w) = (rng.gen_range(0..64u32), rng.gen_range(0..4u32));
                let l = admin.cmd(&format!("mbal move {c} {w}\r\n"));
                assert!(l.starts_with("MOVED "), "{l}");
                moves += 1;
                if rethread {
                    let n = rng.gen_range(1..=4u32);
                    assert_eq!(admin.cmd(&format!("mbal threads {n}\r\n")), format!("THREADS {n} 4 fixed\r\n"));
                }
            }
            moves
        })
    };
    let clients: Vec<_> = (0..6u64)
        .map(|t| {
            let addr = if t % 2 == 0 { main } else { workers[t as usize % workers.len()] };
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(t);
                let keys: Vec<String> = (0..300).map(|i| format!("c{t}:key{i}")).collect();
                for round in 0..3 {
                    let (req, rep) = text_pipeline(&mut rng, &keys, 3000);
                    let got = exchange(addr, req, rep.len());
                    if got != rep {
                        let at = got.iter().zip(&rep).position(|(a, b)| a != b).unwrap_or(0);
                        panic!(
                            "client {t} round {round}: replies differ at byte {at}: got {:?} want {:?}",
                            String::from_utf8_lossy(&got[at.saturating_sub(60)..(at + 60).min(got.len())]),
                            String::from_utf8_lossy(&rep[at.saturating_sub(60)..(at + 60).min(rep.len())])
                        );
                    }
                    // Each round starts from what the last one left: the
                    // model restarts empty, so clear the keys first.
                    let mut c = Conn::open(addr);
                    for k in &keys {
                        c.send(format!("delete {k} noreply\r\n").as_bytes());
                    }
                    assert!(c.cmd("version\r\n").starts_with("VERSION"));
                    let bkeys: Vec<String> = (0..200).map(|i| format!("c{t}:bin{round}:{i}")).collect();
                    let (req, rep) = bin_pipeline(&mut rng, &bkeys, 3000);
                    let got = read_bin_replies(addr, req, rep.len());
                    if let Some(i) = (0..rep.len()).find(|&i| got[i] != rep[i]) {
                        let show = |r: &BinReply| {
                            format!(
                                "op {:#x} opaque {} {}={}",
                                r.0,
                                r.1,
                                String::from_utf8_lossy(&r.2),
                                String::from_utf8_lossy(&r.3)
                            )
                        };
                        panic!(
                            "client {t} binary round {round}: reply {i} is {} but should be {}",
                            show(&got[i]),
                            show(&rep[i])
                        );
                    }
                }
            })
        })
        .collect();
    for c in clients {
        c.join().expect("client thread");
    }
    stop.store(true, Ordering::Relaxed);
    let moves = mover.join().expect("mover");
    let mut c = Conn::open(main);
    assert!(stat(&mut c, "cross_worker_requests") > 10_000, "requests crossed workers");
    assert!(moves >= 20);
    srv.shutdown();
}

fn worker_conns(c: &mut Conn) -> Vec<u64> {
    let st = stats(c, "workers");
    let mut v: Vec<(usize, u64)> = st
        .iter()
        .filter_map(|(k, val)| {
            let rest = k.strip_prefix("worker:")?;
            let (w, name) = rest.split_once(':')?;
            (name == "curr_connections").then(|| (w.parse().unwrap(), val.parse().unwrap()))
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, n)| n).collect()
}

#[test]
fn main_port_connections_are_spread_evenly() {
    for n in [2usize, 3, 4] {
        let srv = start(settings(n));
        let mut conns: Vec<Conn> = (0..8 * n).map(|_| Conn::open(srv.main_addr)).collect();
        // A round trip on each: every one is registered with its worker.
        for c in conns.iter_mut() {
            assert!(c.cmd("version\r\n").starts_with("VERSION"));
        }
        assert_eq!(worker_conns(&mut conns[0]), vec![8; n], "-t {n}: 8 connections per worker");
        // Close four connections of one worker; once it has seen them go,
        // four new ones go to it.
        let w0_before = worker_conns(&mut conns[1])[0];
        for i in (0..4).rev() {
            drop(conns.remove(i * n));
        }
        let mut rounds = 0;
        while worker_conns(&mut conns[0])[0] > w0_before - 4 {
            rounds += 1;
            assert!(rounds < 10_000, "the closes never reached the worker");
        }
        for _ in 0..4 {
            let mut c = Conn::open(srv.main_addr);
            assert!(c.cmd("version\r\n").starts_with("VERSION"));
            conns.push(c);
        }
        let mut after = Conn::open(srv.main_addr);
        assert!(after.cmd("version\r\n").starts_with("VERSION"));
        let counts = worker_conns(&mut after);
        let total: u64 = counts.iter().sum();
        assert_eq!(total as usize, 8 * n + 1, "{counts:?}");
        assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1, "-t {n}: {counts:?}");
        srv.shutdown();
    }
}

/// `mbal threads`: the workers run on the threads in use (all of them at the start; an idle
/// server leaves them so, `fold.rs`); an operator can fix the count and hand it back to the
/// thread policy; wrong counts are refused.
#[test]
fn operators_can_fix_the_number_of_threads_and_hand_it_back() {
    let srv = start(settings(2));
    let mut c = Conn::open(srv.main_addr);
    let hosts = stat(&mut c, "worker_threads_started");
    if hosts < 2 {
        eprintln!("one CPU: a single thread runs the workers, nothing to choose");
        assert_eq!(c.cmd("mbal threads\r\n"), "THREADS 1 1 fixed\r\n");
        srv.shutdown();
        return;
    }
    assert_eq!(c.cmd("mbal threads\r\n"), "THREADS 2 2 auto\r\n");
    assert_eq!(c.cmd("mbal threads 1\r\n"), "THREADS 1 2 fixed\r\n");
    assert_eq!(stat(&mut c, "worker_threads"), 1);
    // Both workers still serve, each with its own cachelets.
    for k in 0..100 {
        assert_eq!(c.cmd(&format!("set fold{k} 0 0 1\r\nx\r\n")), "STORED\r\n");
    }
    assert!(stat(&mut c, "cross_worker_requests") > 0);
    assert_eq!(c.cmd("mbal threads 2\r\n"), "THREADS 2 2 fixed\r\n");
    let mut w1 = Conn::open(srv.worker_addrs[1]);
    for k in 0..100 {
        assert_eq!(w1.get(&format!("fold{k}")).as_deref(), Some(&b"x"[..]));
    }
    assert_eq!(c.cmd("mbal threads 3\r\n"), "CLIENT_ERROR usage: mbal threads [<1..2> | auto]\r\n");
    assert_eq!(c.cmd("mbal threads 0\r\n"), "CLIENT_ERROR usage: mbal threads [<1..2> | auto]\r\n");
    assert_eq!(c.cmd("mbal threads auto\r\n"), "THREADS 2 2 auto\r\n");
    srv.shutdown();
}

#[test]
fn a_stalled_worker_holds_back_its_peers_clients_without_losing_a_request() {
    // Worker 1 stops serving for a while; a client of worker 0 pipelines
    // thousands of requests for worker 1's keys. Worker 0 may have at most
    // `max_inflight` of them waiting; it stops reading until answers come,
    // then every reply arrives, right and in order.
    let s = mbal_server::config::Settings { max_inflight: 64, debug_commands: true, worker_threads: 2, ..settings(2) };
    let srv = start(s);
    let (w0, w1) = (srv.worker_addrs[0], srv.worker_addrs[1]);
    // Keys worker 1 owns: the ones a routed hello on worker 1 accepts.
    let mut r1 = Conn::open(w1);
    assert!(r1.cmd("mbal hello 0\r\n").starts_with("MBAL 0 1"));
    let keys: Vec<String> =
        (0..20_000).map(|i| format!("slow{i}")).filter(|k| r1.set(k, k.as_bytes()) == "STORED\r\n").take(500).collect();
    assert_eq!(keys.len(), 500);
    let mut c0 = Conn::open(w0);
    assert_eq!(c0.cmd("mbal debug stall 1 800\r\n"), "OK\r\n");
    let mut req = Vec::new();
    let mut rep = Vec::new();
    for i in 0..5_000 {
        let k = &keys[i % keys.len()];
        req.extend(format!("get {k}\r\n").bytes());
        rep.extend(format!("VALUE {k} 0 {}\r\n{k}\r\nEND\r\n", k.len()).bytes());
    }
    assert_eq!(exchange(w0, req, rep.len()), rep);
    let st = stats(&mut c0, "workers");
    let stalls: u64 = st.iter().find(|(k, _)| k == "worker:0:inflight_stalls").unwrap().1.parse().unwrap();
    assert!(stalls > 0, "worker 0 hit its in-flight bound: {st:?}");
    // Without the debug switch the hook does not exist.
    let plain = start(settings(2));
    let mut c = Conn::open(plain.main_addr);
    assert!(c.cmd("mbal debug stall 1 800\r\n").starts_with("CLIENT_ERROR"));
    plain.shutdown();
    srv.shutdown();
}
