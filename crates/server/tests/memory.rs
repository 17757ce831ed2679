//! Memory limit and eviction over real sockets: a full server keeps
//! serving writes, on every worker, however the load was spread before.

mod common;
use common::*;
use mbal_cluster::{key_hash, ClusterMap};

#[test]
fn full_server_keeps_storing_on_every_worker() {
    let srv = start(mbal_server::config::Settings { memory_limit: 8 << 20, ..settings(2) });
    let mut c = Conn::open(srv.main_addr);
    c.send(b"mbal map\r\n");
    let l = c.line();
    let n: usize = l.split_whitespace().nth(2).unwrap().parse().unwrap();
    let body = c.exact(n + 2);
    let map = ClusterMap::from_json(std::str::from_utf8(&body[..n]).unwrap()).unwrap();
    let val = vec![b'x'; 1000];
    // Phase 1: 3x the memory, all of it into worker 0's cachelets.
    let w0_keys = (0..).map(|i| format!("a{i}")).filter(|k| map.route(key_hash(k.as_bytes())).2 == 0);
    let mut first = None;
    for k in w0_keys.take(24_000) {
        assert_eq!(c.set(&k, &val), "STORED\r\n", "{k}");
        first.get_or_insert(k);
    }
    // Phase 2: worker 1, which holds nothing yet, is served at once.
    let w1_keys = (0..).map(|i| format!("b{i}")).filter(|k| map.route(key_hash(k.as_bytes())).2 == 1);
    let mut last = String::new();
    for k in w1_keys.take(24_000) {
        assert_eq!(c.set(&k, &val), "STORED\r\n", "{k}");
        last = k;
    }
    assert!(stat(&mut c, "evictions") > 0);
    // The most recent write is readable; the oldest of worker 0 was evicted.
    assert_eq!(c.get(&last).as_deref(), Some(&val[..]));
    assert_eq!(c.get(&first.unwrap()), None);
    srv.shutdown();
}
