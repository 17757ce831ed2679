//! The controller (crates/server/src/control.rs) against a real server: its
//! epoch tick samples every worker without a client asking, the snapshots
//! count exactly the requests served, per cachelet, at the worker that
//! holds the cachelet, and `mbal move` goes through it.

mod common;

use common::{settings, start, Conn, Layout};
use mbal_balance::EpochSnapshot;
use mbal_cluster::key_hash;
use std::collections::HashSet;

/// `mbal load <after>`: the first epoch snapshot numbered above `after`
/// (the controller answers when it has one: nothing to poll).
fn load(c: &mut Conn, after: u64) -> EpochSnapshot {
    let head = c.cmd(&format!("mbal load {after}\r\n"));
    let parts: Vec<&str> = head.split_whitespace().collect();
    assert_eq!(parts.first(), Some(&"LOAD"), "unexpected {head:?}");
    let n: usize = parts[2].parse().unwrap();
    let body = c.exact(n + 2);
    let snap: EpochSnapshot = serde_json::from_slice(&body[..n]).expect("snapshot JSON");
    assert_eq!(snap.seq, parts[1].parse::<u64>().unwrap());
    assert!(snap.seq > after);
    snap
}

/// Keys of cachelet `c` in a one-server layout.
fn keys_of(layout: &Layout, c: u32, n: usize) -> Vec<String> {
    (0..).map(|i| format!("key:{i}")).filter(|k| layout.cachelet_of_hash(key_hash(k.as_bytes())) == c).take(n).collect()
}

/// Await epochs until cachelet `c` has been seen with `want` reads in
/// total, starting after epoch `after`; returns the last snapshot and the
/// owners the cachelet was reported at.
fn await_reads(c: &mut Conn, after: u64, cachelet: u32, want: u64) -> (EpochSnapshot, HashSet<u16>) {
    let mut seen = 0;
    let mut owners = HashSet::new();
    let mut last = after;
    for _ in 0..200 {
        let s = load(c, last);
        last = s.seq;
        if let Some((w, cl)) = s.cachelet(cachelet) {
            if cl.reads > 0 {
                owners.insert(w);
            }
            seen += cl.reads;
        }
        assert!(seen <= want, "counted {seen} reads of cachelet {cachelet}, only {want} were sent");
        if seen == want {
            return (s, owners);
        }
    }
    panic!("cachelet {cachelet}: {seen} of {want} reads counted after 200 epochs");
}

#[test]
fn epoch_snapshots_count_every_request_at_its_cachelets_owner() {
    let mut s = settings(2);
    s.epoch_ms = 20;
    let cpw = s.cachelets_per_worker;
    let vn = s.vn_count;
    let srv = start(s);
    let layout = Layout::even(1, 2, cpw, vn);
    // Cachelet 1 starts on worker 1 (dealt round-robin).
    let target = 1u32;
    assert_eq!(layout.owner(target), (0, 1));
    let keys = keys_of(&layout, target, 50);

    let mut admin = Conn::open(srv.main_addr);
    // The first epoch: everything after it is ours to count.
    let first = load(&mut admin, 0);
    assert_eq!(first.workers.len(), 2);
    assert!(first.workers.iter().all(|w| w.secs > 0.0));

    // 200 gets over two main-port connections (one lands on each worker,
    // so half of them are forwarded), then the same through a worker port.
    let mut conns = [Conn::open(srv.main_addr), Conn::open(srv.main_addr)];
    for i in 0..200 {
        let c = &mut conns[i % 2];
        assert_eq!(c.get(&keys[i % keys.len()]), None);
    }
    let (snap, owners) = await_reads(&mut admin, first.seq, target, 200);
    assert_eq!(owners, HashSet::from([1]), "counted at its owner, worker 1");
    assert_eq!(snap.workers.len(), 2);

    // Move it to worker 0 through the controller, then read it again.
    assert!(admin.cmd(&format!("mbal move {target} 0\r\n")).starts_with("MOVED "));
    let mut moved_after = snap.seq;
    // Epochs soon report it at worker 0 (those already taken, still at 1).
    let mut at_zero = false;
    for _ in 0..200 {
        let s = load(&mut admin, moved_after);
        moved_after = s.seq;
        if s.cachelet(target).is_some_and(|(w, _)| w == 0) {
            at_zero = true;
            break;
        }
    }
    assert!(at_zero, "the snapshots follow the move");
    let mut w1 = Conn::open(srv.worker_addrs[1]);
    for i in 0..120 {
        assert_eq!(w1.get(&keys[i % keys.len()]), None);
    }
    let (_, owners) = await_reads(&mut admin, moved_after, target, 120);
    assert_eq!(owners, HashSet::from([0]), "after the move it counts at worker 0");
    srv.shutdown();
}

#[test]
fn the_tick_measures_busy_time_and_queueing_of_forwarded_work() {
    let mut s = settings(2);
    s.epoch_ms = 20;
    // A thread each: workers on one thread run each other's requests directly, with no
    // batch to queue (`near`).
    s.worker_threads = 2;
    let cpw = s.cachelets_per_worker;
    let vn = s.vn_count;
    let srv = start(s);
    let layout = Layout::even(1, 2, cpw, vn);
    let keys = keys_of(&layout, 1, 20);
    let mut admin = Conn::open(srv.main_addr);
    let first = load(&mut admin, 0);
    // Worker 0's own port: every get for cachelet 1 (worker 1's) crosses
    // to worker 1 and its reply crosses back.
    let mut c = Conn::open(srv.worker_addrs[0]);
    for i in 0..300 {
        assert_eq!(c.get(&keys[i % keys.len()]), None);
    }
    let mut last = first.seq;
    let (mut fwd_in, mut fwd_out, mut batches_seen, mut busy) = (0, 0, false, 0.0f64);
    for _ in 0..200 {
        let s = load(&mut admin, last);
        last = s.seq;
        fwd_out += s.workers[0].forwarded_out;
        fwd_in += s.workers[1].forwarded_in;
        batches_seen |= s.workers.iter().any(|w| w.queue_wait_mean_us > 0.0);
        busy = busy.max(s.workers[0].busy);
        if fwd_in >= 300 && fwd_out >= 300 {
            break;
        }
    }
    assert_eq!((fwd_out, fwd_in), (300, 300), "every forwarded get counted once at each end");
    assert!(batches_seen, "batches between workers have a measured wait");
    assert!(busy > 0.0 && busy <= 1.0, "busy fraction {busy}");
    srv.shutdown();
}

#[test]
fn concurrent_moves_of_one_cachelet_are_serialised_by_the_controller() {
    let srv = start(settings(3));
    let mut conns: Vec<Conn> = (0..6).map(|_| Conn::open(srv.main_addr)).collect();
    // Six moves of cachelet 0 to alternating workers, all in flight at once.
    for (i, c) in conns.iter_mut().enumerate() {
        c.send(format!("mbal move 0 {}\r\n", i % 3).as_bytes());
    }
    let mut epochs = Vec::new();
    for c in conns.iter_mut() {
        let l = c.line();
        assert!(l.starts_with("MOVED "), "unexpected {l:?}");
        epochs.push(l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap());
    }
    // The map agrees with the workers: `stats cachelets` names the owner the
    // map holds.
    let mut a = Conn::open(srv.main_addr);
    a.send(b"mbal map\r\n");
    let head = a.line();
    let n: usize = head.split_whitespace().nth(2).unwrap().parse().unwrap();
    let body = a.exact(n + 2);
    let map = mbal_cluster::ClusterMap::from_json(std::str::from_utf8(&body[..n]).unwrap()).unwrap();
    assert_eq!(map.epoch(), *epochs.iter().max().unwrap(), "the last answer carries the map's epoch");
    // Asked with the epoch one has (a refresh): no JSON unless the map is newer.
    let e = map.epoch();
    a.send(format!("mbal map {e}\r\nmbal map {}\r\n", e + 7).as_bytes());
    assert_eq!(a.line(), format!("MAP {e} 0\r\n"));
    assert_eq!(a.line(), "\r\n");
    assert_eq!(a.line(), format!("MAP {e} 0\r\n"));
    assert_eq!(a.line(), "\r\n");
    a.send(format!("mbal map {}\r\n", e - 1).as_bytes());
    assert_eq!(a.line(), head, "an older epoch gets the whole map");
    assert_eq!(a.exact(n + 2), body);
    a.send(b"mbal map x\r\n");
    assert!(a.line().starts_with("CLIENT_ERROR usage: mbal map"));
    let owner = map.owner(0).1;
    a.send(b"stats cachelets\r\n");
    let lines = a.until_end();
    assert!(
        lines.iter().any(|l| l == &format!("STAT cachelet:0:owner {owner}\r\n")),
        "map says worker {owner}: {lines:?}"
    );
    srv.shutdown();
}
