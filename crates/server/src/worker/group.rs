//! The threads that run the workers ("hosts"), and how many of them are in use.
//!
//! The server starts `min(workers, CPUs it may use)` host threads (`--worker-threads` fixes
//! another count). Worker `i` runs on host `i % active`; `active` (1..=hosts) is what the
//! thread policy (`crate::fold`) or an operator (`mbal threads`) sets. When the workers
//! outnumber the active hosts, several share a thread: memcached's `-t 4` is often copied onto
//! machines (or containers, or `taskset` masks) with fewer CPUs, and a machine shared with the
//! application gives the server fewer CPUs than it has. Workers on one thread take turns
//! without sleeping, waking or switching context between them: a request for another worker's
//! key is still a message, but one found on the thread's next pass.
//!
//! Nothing else changes when workers share a thread: each keeps its own cachelets,
//! connections, listening port, event loop (`mio::Poll`) and inbox. A worker moves between
//! hosts whole, between two of its rounds (where it holds no borrowed state and has sent its
//! outbox), through its new host's hand-off channel; its sockets stay registered in its own
//! poll, and a wake-up sent to it while in transit leaves its poll readable, which the new
//! host sees when it adds the poll to its epoll set (level-triggered).
//!
//! A host with one worker blocks in that worker's own poll, as a thread per worker would. A
//! host with several (or none) blocks in one `epoll_wait` on an epoll set holding its own
//! eventfd and each hosted worker's epoll descriptor (level-triggered: a worker's epoll is
//! readable while it has events, so none is lost to an edge), then runs passes: each hosted
//! worker whose epoll is ready runs a round that polls it (timeout 0), each one with messages
//! or ready connections a round without polling, until a pass finds nothing to do (what they
//! sent each other is first taken in up to `MESSAGE_PASSES` passes with no poll); then every
//! hosted worker's mailbox is marked asleep (`prepare_sleep`) and the thread blocks again.
//! After every wake-up each worker runs one round, so its timers (housekeeping, emulated
//! capacity) run as on its own thread.

use super::Worker;
use crate::near::Near;
use crate::shared::Shared;
use crate::threads::Threads;
use crossbeam_channel::{Receiver, Sender};
use mio::Events;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// The hosts' hand-off channels: a worker moving to host `t` is sent on `chans[t]`. Held by
/// the host threads only (not `Shared`, which the workers hold), so that a worker left in
/// transit at shutdown is dropped with the last host.
pub(crate) struct Handoff {
    chans: Vec<(Sender<Moving>, Receiver<Moving>)>,
}

/// A worker on its way to another host, with the time of its last housekeeping
/// (`Shared::clock_ns`).
type Moving = (Worker, u64);

impl Handoff {
    pub fn new(hosts: usize) -> Handoff {
        Handoff { chans: (0..hosts).map(|_| crossbeam_channel::unbounded()).collect() }
    }
}

/// An epoll set of the host's eventfd and the hosted workers' epoll descriptors.
struct Outer(libc::c_int);

/// The host's own eventfd's key in its epoll set (workers are keyed by id).
const HOST_KEY: u64 = u64::MAX;

impl Drop for Outer {
    fn drop(&mut self) {
        // SAFETY: the descriptor was returned by epoll_create1 and is closed only here.
        unsafe { libc::close(self.0) };
    }
}

impl Outer {
    fn new() -> io::Result<Outer> {
        // SAFETY: a plain system call; the descriptor is owned by the returned value.
        let outer = Outer(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) });
        if outer.0 < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(outer)
    }

    fn ctl(&self, op: libc::c_int, fd: libc::c_int, key: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: key };
        // SAFETY: a plain system call on descriptors this thread owns; `ev` outlives it.
        if unsafe { libc::epoll_ctl(self.0, op, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Wait up to `timeout`; mark in `hosted` the workers whose epoll has events. Returns
    /// whether the host's own eventfd was signalled.
    fn wait(&self, hosted: &mut [Hosted], timeout: Duration) -> io::Result<bool> {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 64];
        let ms = epoll_ms(timeout);
        // SAFETY: `evs` is a valid buffer of `evs.len()` events for the kernel to fill.
        let n = unsafe { libc::epoll_wait(self.0, evs.as_mut_ptr(), evs.len() as libc::c_int, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted { Ok(false) } else { Err(e) };
        }
        let mut host = false;
        for ev in &evs[..n as usize] {
            if ev.u64 == HOST_KEY {
                host = true;
            } else if let Some(h) = hosted.iter_mut().find(|h| h.w.id as u64 == ev.u64) {
                h.ready = true;
            }
        }
        Ok(host)
    }
}

/// `epoll_wait`'s timeout for `timeout`: whole milliseconds, rounded **up** (as mio does for a
/// worker alone on its thread). Rounded down, a worker out of emulated capacity with a
/// sub-millisecond wait for its next token (250 µs at 4,000 requests/s) had its host poll with
/// a zero timeout in a loop until the credit came back: the host spun, and with several
/// servers' hosts doing it on a small machine the servers' CPU tripled at the load where
/// workers first run out of credit (docs/benchmarks-journal.md §15, round 6).
fn epoll_ms(timeout: Duration) -> libc::c_int {
    timeout.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as libc::c_int
}

/// A worker on this host, the last time it ran its housekeeping, and whether its epoll
/// reported events.
struct Hosted {
    w: Worker,
    sweep: u64,
    ready: bool,
}

/// Passes a host with several workers runs for their messages alone before it polls the
/// sockets again.
const MESSAGE_PASSES: u32 = 4;

/// One host thread: `t` is its index, `initial` the workers it starts with. Runs until the
/// server stops.
pub(crate) fn run_host(shared: Arc<Shared>, handoff: Arc<Handoff>, t: usize, initial: Vec<Worker>) {
    if let Err(e) = host(&shared, &handoff, t, initial) {
        tracing::error!(host = t, "worker thread failed: {e}");
    }
}

fn host(shared: &Shared, handoff: &Handoff, t: usize, initial: Vec<Worker>) -> io::Result<()> {
    let th = &shared.threads;
    // SAFETY: gettid has no preconditions.
    th.tids[t].store(unsafe { libc::gettid() }, Ordering::Relaxed);
    let outer = Outer::new()?;
    outer.ctl(libc::EPOLL_CTL_ADD, th.wakes[t].0, HOST_KEY)?;
    let mut hosted: Vec<Hosted> = Vec::new();
    let now = shared.clock_ns();
    for w in initial {
        outer.ctl(libc::EPOLL_CTL_ADD, w.poll.as_raw_fd(), w.id as u64)?;
        hosted.push(Hosted { w, sweep: now, ready: true });
    }
    let (_, inbound) = &handoff.chans[t];
    let mut events = Events::with_capacity(1024);
    // No epoch seen yet: the first pass places the initial workers by the threads in use now,
    // which an `mbal threads` may have changed before this thread ran (its epoch would then
    // look already seen, and the workers would stay here for good).
    let mut seen = u64::MAX;
    let mut timeout = Duration::ZERO;
    loop {
        if let [h] = &mut hosted[..] {
            // One worker: block in its own poll, as a thread of its own would.
            if h.w.round(&mut events, Some(timeout), &mut h.sweep, &mut Near::default()).is_none() {
                return Ok(());
            }
        } else {
            let wait = if hosted.is_empty() { Duration::from_millis(100) } else { timeout };
            let signalled = outer.wait(&mut hosted, wait)?;
            if signalled {
                th.wakes[t].drain();
            }
            for h in &hosted {
                h.w.mailbox.awake();
            }
        }
        // After a stop, the workers drain first (`Worker::drain`).
        if shared.stopped() {
            return Ok(());
        }
        // Workers handed to us, and those that belong elsewhere now.
        let mut arrived = false;
        while let Ok((w, sweep)) = inbound.try_recv() {
            outer.ctl(libc::EPOLL_CTL_ADD, w.poll.as_raw_fd(), w.id as u64)?;
            hosted.push(Hosted { w, sweep, ready: true });
            arrived = true;
        }
        let epoch = th.epoch.load(Ordering::Acquire);
        if arrived || epoch != seen {
            seen = epoch;
            let active = th.active();
            let mut sent = false;
            let mut i = 0;
            while i < hosted.len() {
                let to = Threads::home(hosted[i].w.id, active);
                if to == t {
                    i += 1;
                    continue;
                }
                let Hosted { w, sweep, .. } = hosted.swap_remove(i);
                outer.ctl(libc::EPOLL_CTL_DEL, w.poll.as_raw_fd(), 0)?;
                let _ = handoff.chans[to].0.send((w, sweep));
                sent = true;
            }
            if sent {
                // The receiving hosts are woken by their eventfds, or, those blocked in their
                // one worker's poll, by that worker's mailbox.
                th.kick_all(shared.peers());
            }
        }
        if hosted.len() != 1 {
            // Several workers: after a wake-up (or a timeout), every hosted worker runs a
            // round; then only those with something to do, until none has.
            let mut all = true;
            let mut inner = 0;
            loop {
                let mut worked = false;
                for i in 0..hosted.len() {
                    let (before, rest) = hosted.split_at_mut(i);
                    let Some((h, after)) = rest.split_first_mut() else { break };
                    let poll = std::mem::take(&mut h.ready);
                    if !all && !poll && h.w.ready.is_empty() && h.w.inbox.is_empty() {
                        continue;
                    }
                    // The others are idle while this one runs: it may use their stores.
                    let mut near = Near::new(before.iter_mut().chain(after).filter_map(|o| o.w.lend()).collect());
                    match h.w.round(&mut events, poll.then_some(Duration::ZERO), &mut h.sweep, &mut near) {
                        None => return Ok(()),
                        Some(did) => worked |= did,
                    }
                    th.publish_served(h.w.id, h.w.requests);
                }
                all = false;
                if hosted.is_empty() {
                    break;
                }
                // What co-hosted workers sent each other in this pass (requests, their
                // replies) is taken in passes of its own, with no system call, before the
                // sockets are looked at again; a few at most, so that sockets wait no longer
                // than a few rounds.
                let pending = hosted.iter().any(|h| !h.w.ready.is_empty() || !h.w.inbox.is_empty());
                if pending && inner < MESSAGE_PASSES {
                    inner += 1;
                    continue;
                }
                inner = 0;
                // Sockets that became ready during the passes.
                if outer.wait(&mut hosted, Duration::ZERO)? {
                    th.wakes[t].drain();
                }
                // A change of the threads in use, or a worker handed to this host: the outer
                // loop sees to it first, even under a load that never lets the passes run dry
                // (or a fold would wait for the load to let up before it could be undone).
                if th.epoch.load(Ordering::Acquire) != seen || !inbound.is_empty() {
                    break;
                }
                if !worked && !pending && !hosted.iter().any(|h| h.ready) {
                    break;
                }
            }
        } else {
            th.publish_served(hosted[0].w.id, hosted[0].w.requests);
        }
        // Nothing to do: sleep unless a message arrived while the mailboxes were marked.
        let mut idle = true;
        timeout = Duration::from_millis(100);
        for h in &hosted {
            idle &= h.w.ready.is_empty() && h.w.mailbox.prepare_sleep(&h.w.inbox);
            timeout = h.w.sleep_limit(timeout);
        }
        if !idle || !inbound.is_empty() || th.epoch.load(Ordering::Acquire) != seen {
            timeout = Duration::ZERO;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_shorter_than_a_millisecond_blocks_instead_of_spinning() {
        assert_eq!(epoll_ms(Duration::ZERO), 0);
        // a token's wait at 4,000 requests/s, and one nanosecond: poll for 1 ms, not 0
        assert_eq!(epoll_ms(Duration::from_micros(250)), 1);
        assert_eq!(epoll_ms(Duration::from_nanos(1)), 1);
        assert_eq!(epoll_ms(Duration::from_millis(1)), 1);
        assert_eq!(epoll_ms(Duration::from_micros(1_500)), 2);
        assert_eq!(epoll_ms(Duration::from_millis(100)), 100);
        assert_eq!(epoll_ms(Duration::from_secs(u64::MAX)), i32::MAX);
    }
}
