//! One port per server: without worker ports, a routed client reaches a
//! worker through the main port with `mbal hello <epoch> <worker>`, and the
//! connection is handed to that worker once (docs/protocol.md).

mod common;

use common::{settings, start, Conn, Layout};
use mbal_cluster::key_hash;

/// A key of a cachelet that `worker` owns at start (one server, dealt
/// round-robin).
fn key_on(layout: &Layout, worker: u16, n: usize) -> String {
    (0..)
        .map(|i| format!("k{worker}:{i}"))
        .filter(|k| layout.owner(layout.cachelet_of_hash(key_hash(k.as_bytes()))).1 == worker)
        .nth(n)
        .unwrap()
}

fn curr_connections(c: &mut Conn) -> Vec<u64> {
    c.send(b"stats workers\r\n");
    let mut v: Vec<(usize, u64)> = c
        .until_end()
        .iter()
        .filter_map(|l| {
            let mut p = l.split_whitespace().skip(1);
            let (name, val) = (p.next()?, p.next()?);
            let (w, field) = name.strip_prefix("worker:")?.split_once(':')?;
            (field == "curr_connections").then(|| (w.parse().unwrap(), val.parse().unwrap()))
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, n)| n).collect()
}

#[test]
fn a_routed_connection_on_the_main_port_is_handed_to_its_worker() {
    let mut s = settings(3);
    s.worker_port_base = None;
    let (cpw, vn) = (s.cachelets_per_worker, s.vn_count);
    let srv = start(s);
    assert!(srv.worker_addrs.is_empty(), "no worker ports unless asked for");
    let layout = Layout::even(1, 3, cpw, vn);
    let (mine, other) = (key_on(&layout, 2, 0), key_on(&layout, 0, 0));

    // The hello and the requests behind it arrive in one write: what the
    // first worker read past the hello travels with the connection.
    let mut c = Conn::open(srv.main_addr);
    c.send(format!("mbal hello 0 2\r\nset {mine} 0 0 2\r\nhi\r\nget {mine}\r\nget {other}\r\n").as_bytes());
    let hello = c.line();
    assert!(hello.starts_with("MBAL 0 2 "), "{hello:?}");
    assert_eq!(c.line(), "STORED\r\n");
    assert_eq!(c.line(), format!("VALUE {mine} 0 2\r\n"));
    assert_eq!(c.line(), "hi\r\n");
    assert_eq!(c.line(), "END\r\n");
    // Routed: a key of another worker is redirected, not forwarded.
    let rd = c.line();
    assert!(rd.starts_with("RD ") && rd.trim_end().ends_with(" 0 0"), "{rd:?}");
    // Served by worker 2 from now on, with no hop: counted there.
    let mut admin = Conn::open(srv.main_addr);
    let conns = curr_connections(&mut admin);
    assert_eq!(conns.iter().sum::<u64>(), 2);
    // The acceptor gave `c` to worker 0 (all had none) and `admin` to a
    // worker with the fewest: 0 or 1, as 2 has `c` now.
    assert_eq!(conns[2], 1, "{conns:?}");
    assert_eq!(c.get(&mine), Some(b"hi".to_vec()));
    // stats counts the connection once.
    admin.send(b"stats\r\n");
    let total = admin.until_end().into_iter().find(|l| l.starts_with("STAT total_connections ")).unwrap();
    assert_eq!(total, "STAT total_connections 2\r\n");
    srv.shutdown();
}

#[test]
fn hello_to_a_worker_must_come_first_and_name_a_worker() {
    let mut s = settings(2);
    s.worker_port_base = None;
    let srv = start(s);
    let mut c = Conn::open(srv.main_addr);
    assert_eq!(c.cmd("mbal hello 0 7\r\n"), "CLIENT_ERROR no such worker\r\n");
    assert_eq!(c.cmd("version\r\n").split_whitespace().next(), Some("VERSION"));
    // Pipelined behind another request whose reply is not yet written.
    c.send(b"version\r\nmbal hello 0 0\r\nmbal hello 0 1\r\n");
    assert!(c.line().starts_with("VERSION"));
    let l = c.line();
    let l2 = c.line();
    // The connection is on one of the two workers: the hello naming that
    // one is answered in place, the other refused (replies not yet sent).
    let (ok, refused) = if l.starts_with("MBAL") { (l, l2) } else { (l2, l) };
    assert!(ok.starts_with("MBAL 0 "), "{ok:?}");
    assert!(refused.starts_with("CLIENT_ERROR mbal hello <epoch> <worker> must come before"), "{refused:?}");
    // The plain form still opts in where the connection is.
    let mut d = Conn::open(srv.main_addr);
    assert!(d.cmd("mbal hello 0\r\n").starts_with("MBAL 0 "));
    srv.shutdown();
}
