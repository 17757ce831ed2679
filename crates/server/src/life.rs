//! The server's lifecycle: the stop (a `shutdown` command, a signal, the handle) and the
//! graceful drain that follows it, and the threads' ends, which `ServerHandle::wait` watches
//! so that a thread that panics (or ends on its own) takes the process down instead of
//! leaving it half-alive.
//!
//! A stop, once asked for (`Life::ask_stop`), runs in this order (docs/operations.md
//! "Stopping"): the acceptor and the workers' own ports stop accepting; each worker reads what
//! had arrived on each of its connections when it saw the stop (the bytes in the socket then,
//! `unread`), answers every whole request of it, writes the replies and closes the
//! connection (half-closing it first, and reading to its end, when the client sent more, so
//! that the replies are not lost to a reset); a worker whose connections are all closed and
//! whose requests to others are all answered is drained. When every worker is drained, or
//! [`DRAIN`] after the stop, the threads end.

use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The longest a stop waits for connections to be answered and closed.
pub const DRAIN: Duration = Duration::from_secs(1);

/// A server thread's end, as its [`Watch`] reports it.
#[derive(Debug)]
pub(crate) struct Ended {
    pub name: String,
    pub panicked: bool,
}

/// The stop's state, shared by every thread of the server.
pub(crate) struct Life {
    /// `Shared::clock_ns` when the stop was asked for, plus one (0: running).
    stop_at: AtomicU64,
    /// Workers not drained yet.
    draining: AtomicUsize,
    ended: Sender<Ended>,
    /// Dropped on stop: the thread policy's thread ends at once (`fold::spawn`).
    pub policy_stop: Mutex<Option<Sender<()>>>,
}

impl Life {
    pub fn new(workers: usize) -> (Life, Receiver<Ended>) {
        let (ended, rx) = crossbeam_channel::unbounded();
        let life = Life {
            stop_at: AtomicU64::new(0),
            draining: AtomicUsize::new(workers),
            ended,
            policy_stop: Mutex::new(None),
        };
        (life, rx)
    }

    /// Record the stop (at `now_ns`); false if it was asked for already.
    pub fn ask_stop(&self, now_ns: u64) -> bool {
        self.stop_at.compare_exchange(0, now_ns + 1, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }

    /// When the drain must end (`Shared::clock_ns`), if the stop was asked for.
    pub fn deadline_ns(&self) -> Option<u64> {
        match self.stop_at.load(Ordering::SeqCst) {
            0 => None,
            t => Some(t - 1 + DRAIN.as_nanos() as u64),
        }
    }

    /// A worker has drained; true if it was the last.
    pub fn drained(&self) -> bool {
        self.draining.fetch_sub(1, Ordering::SeqCst) == 1
    }

    /// Is the drain over: every worker drained, or the bound passed (or no stop was asked
    /// for: asked only once the server stops)?
    pub fn over(&self, now_ns: u64) -> bool {
        match self.deadline_ns() {
            None => true,
            Some(d) => self.draining.load(Ordering::SeqCst) == 0 || now_ns >= d,
        }
    }

    /// A guard for the calling thread: its drop reports the thread's end.
    pub fn watch(&self) -> Watch {
        let name = std::thread::current().name().unwrap_or("mbal").to_string();
        Watch { name, ended: self.ended.clone() }
    }
}

/// Reports its thread's end (and whether it is unwinding from a panic) when dropped.
pub(crate) struct Watch {
    name: String,
    ended: Sender<Ended>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let panicked = std::thread::panicking();
        if panicked {
            tracing::error!(thread = %self.name, "a server thread panicked: the server stops");
        }
        let _ = self.ended.send(Ended { name: std::mem::take(&mut self.name), panicked });
    }
}

/// The text of a panic's payload (a `&str` or a `String`), for the log.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}

/// Bytes waiting unread in a socket's receive queue.
pub(crate) fn unread(fd: std::os::fd::RawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the valid pointer.
    let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
    if rc < 0 {
        0
    } else {
        n.max(0) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_drain_ends_when_every_worker_drained_or_at_the_bound() {
        let (life, _rx) = Life::new(2);
        assert_eq!(life.deadline_ns(), None);
        assert!(life.ask_stop(10));
        assert!(!life.ask_stop(20), "asked once");
        assert_eq!(life.deadline_ns(), Some(10 + DRAIN.as_nanos() as u64));
        assert!(!life.over(11));
        assert!(!life.drained());
        assert!(!life.over(11));
        assert!(life.drained(), "the last");
        assert!(life.over(11));
        let (life, _rx) = Life::new(1);
        life.ask_stop(0);
        assert!(life.over(DRAIN.as_nanos() as u64), "bounded");
    }

    #[test]
    fn a_watch_reports_a_panic() {
        let (life, rx) = Life::new(1);
        let w = life.watch();
        let t = std::thread::Builder::new()
            .name("t-panics".into())
            .spawn(move || {
                let _w = life.watch();
                drop(w);
                panic!("boom");
            })
            .unwrap();
        let first = rx.recv().unwrap();
        assert!(!first.panicked);
        let second = rx.recv().unwrap();
        assert!(second.panicked);
        assert_eq!(second.name, "t-panics");
        assert_eq!(panic_text(&*t.join().unwrap_err()), "boom");
    }
}
