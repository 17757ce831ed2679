//! Several workers on one thread, when there are more workers than CPUs to run them.
//!
//! memcached's `-t 4` is often copied onto machines (or containers, or `taskset` masks) with
//! fewer CPUs. With a thread per worker, the workers then take turns on a CPU and every
//! request that hops between two of them costs a sleep, a wake-up and a context switch. So
//! when the workers outnumber the CPUs this process may use, the server runs them on as many
//! threads as there are CPUs, each thread hosting a fixed group of workers (`lib.rs`;
//! `--worker-threads` chooses another count). Nothing else changes: each worker keeps its own
//! cachelets, connections, listening port, event loop (`mio::Poll`) and inbox, and a request
//! for another worker's key is still a message; only the sleeping is shared. A hosted worker
//! whose peer on the same thread sends it a batch finds it on the thread's next pass, without
//! an eventfd write or a context switch.
//!
//! The thread blocks in one `epoll_wait` on an epoll set holding each hosted worker's own
//! epoll descriptor (level-triggered: a worker's epoll is readable while it has events, so an
//! event is never lost to an edge). A wake-up from another thread (a `Mailbox` eventfd, which
//! lives in the worker's own epoll set) wakes the thread the same way. Then it runs passes:
//! each hosted worker whose epoll is ready runs a round that polls it (timeout 0), each one
//! with messages or ready connections a round without polling, until a pass finds nothing
//! to do; then every hosted worker's mailbox is marked asleep (`prepare_sleep`) and the
//! thread blocks again. After every wake-up each worker runs one round, so its timers
//! (housekeeping, emulated capacity) run as on its own thread.

use super::Worker;
use mio::Events;
use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// An epoll set of the hosted workers' epoll descriptors.
struct Outer(libc::c_int);

impl Drop for Outer {
    fn drop(&mut self) {
        // SAFETY: the descriptor was returned by epoll_create1 and is closed only here.
        unsafe { libc::close(self.0) };
    }
}

impl Outer {
    fn new(fds: &[libc::c_int]) -> io::Result<Outer> {
        // SAFETY: plain system calls on descriptors this thread owns; `ev` outlives each call.
        let outer = Outer(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) });
        if outer.0 < 0 {
            return Err(io::Error::last_os_error());
        }
        for (i, &fd) in fds.iter().enumerate() {
            let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: i as u64 };
            if unsafe { libc::epoll_ctl(outer.0, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(outer)
    }

    /// Mark in `ready` the hosted workers whose epoll has events, waiting up to `timeout`.
    fn wait(&self, ready: &mut [bool], timeout: Duration) -> io::Result<()> {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 64];
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `evs` is a valid buffer of `evs.len()` events for the kernel to fill.
        let n = unsafe { libc::epoll_wait(self.0, evs.as_mut_ptr(), evs.len() as libc::c_int, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted { Ok(()) } else { Err(e) };
        }
        for ev in &evs[..n as usize] {
            if let Some(r) = ready.get_mut(ev.u64 as usize) {
                *r = true;
            }
        }
        Ok(())
    }
}

/// Run `workers` on this thread until the server stops.
pub(crate) fn run_group(mut workers: Vec<Worker>) {
    let fds: Vec<libc::c_int> = workers.iter().map(|w| w.poll.as_raw_fd()).collect();
    let outer = match Outer::new(&fds) {
        Ok(o) => o,
        Err(e) => {
            tracing::error!("workers {:?}: epoll set failed: {e}", workers.iter().map(|w| w.id).collect::<Vec<_>>());
            return;
        }
    };
    let n = workers.len();
    let mut events = Events::with_capacity(1024);
    let mut sweeps = vec![Instant::now(); n];
    let mut ready = vec![false; n];
    let mut timeout = Duration::ZERO;
    loop {
        if let Err(e) = outer.wait(&mut ready, timeout) {
            tracing::error!("workers' epoll_wait failed: {e}");
            return;
        }
        for w in &workers {
            w.mailbox.awake();
        }
        // After a wake-up (or a timeout), every hosted worker runs a round; then only those
        // with something to do, until none has.
        let mut all = true;
        loop {
            let mut worked = false;
            for (i, w) in workers.iter_mut().enumerate() {
                let poll = std::mem::take(&mut ready[i]);
                if !all && !poll && w.ready.is_empty() && w.inbox.is_empty() {
                    continue;
                }
                match w.round(&mut events, poll.then_some(Duration::ZERO), &mut sweeps[i]) {
                    None => return,
                    Some(did) => worked |= did,
                }
            }
            all = false;
            // Sockets that became ready during the pass.
            if let Err(e) = outer.wait(&mut ready, Duration::ZERO) {
                tracing::error!("workers' epoll_wait failed: {e}");
                return;
            }
            if !worked && !ready.contains(&true) {
                break;
            }
        }
        // Nothing to do: sleep unless a message arrived while the mailboxes were marked.
        let mut idle = true;
        timeout = Duration::from_millis(100);
        for w in &workers {
            idle &= w.ready.is_empty() && w.mailbox.prepare_sleep(&w.inbox);
            timeout = w.sleep_limit(timeout);
        }
        if !idle {
            timeout = Duration::ZERO;
        }
    }
}
