//! The server's lifecycle in process: a worker thread that panics makes `ServerHandle::wait`
//! return an error at once (the binary then exits non-zero), and a stop through the handle
//! ends every thread, with more workers than threads too. The real binary's stop (signals,
//! `shutdown` under load) is tested in the root package's `tests/lifecycle.rs`.

mod common;
use common::*;
use std::time::{Duration, Instant};

/// `wait` on another thread; its result, within `bound`.
fn waited(h: mbal_server::ServerHandle, bound: Duration) -> Result<(), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(h.wait());
    });
    rx.recv_timeout(bound).expect("wait returned")
}

#[test]
fn a_worker_that_panics_ends_wait_with_the_reason() {
    for (threads, worker_threads) in [(1, 0), (4, 2)] {
        let mut s = settings(threads);
        s.debug_commands = true;
        s.worker_threads = worker_threads;
        let h = start(s);
        let mut c = Conn::open(h.main_addr);
        assert_eq!(c.cmd("version\r\n").split_whitespace().next(), Some("VERSION"));
        c.send(b"mbal debug panic\r\n");
        let t0 = Instant::now();
        let err = waited(h, Duration::from_secs(5)).expect_err("a panicked worker is an error");
        assert!(err.contains("mbal-worker-") && err.contains("panicked: mbal debug panic on worker"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }
}

#[test]
fn a_stop_ends_every_thread() {
    for (threads, worker_threads) in [(1, 0), (2, 0), (4, 2), (3, 1)] {
        let mut s = settings(threads);
        s.worker_threads = worker_threads;
        s.shutdown_enabled = true;
        let h = start(s);
        let mut idle = Conn::open(h.main_addr);
        assert_eq!(idle.set("k", b"v"), "STORED\r\n");
        let mut asker = Conn::open(h.main_addr);
        asker.send(b"shutdown\r\n");
        assert!(asker.closed());
        // The idle connection is closed by the stop, and wait returns Ok.
        assert!(idle.closed());
        waited(h, Duration::from_secs(3)).expect("a clean stop");
    }
}
