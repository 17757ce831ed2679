//! The host threads' shared state (`Shared::threads`): how many are in use, their
//! wake-ups, and what the thread policy reads. The hosts themselves run in
//! `crate::worker::group`.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};

/// An eventfd: how a host is told that `active` changed or a worker was handed to it.
pub(crate) struct EventFd(pub(crate) libc::c_int);

impl EventFd {
    fn new() -> io::Result<EventFd> {
        // SAFETY: a plain system call; the descriptor is owned by the returned value.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(EventFd(fd))
    }

    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to a descriptor we own.
        unsafe { libc::write(self.0, (&one as *const u64).cast(), 8) };
    }

    pub(crate) fn drain(&self) {
        let mut n: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from a descriptor we own (non-blocking).
        unsafe { libc::read(self.0, (&mut n as *mut u64).cast(), 8) };
    }
}

impl Drop for EventFd {
    fn drop(&mut self) {
        // SAFETY: the descriptor was returned by eventfd and is closed only here.
        unsafe { libc::close(self.0) };
    }
}

/// A worker's count of requests served, on its own cache line (each worker stores to its
/// own once per round; the thread policy reads them all twice a second).
#[repr(align(64))]
#[derive(Default)]
pub(crate) struct Served(AtomicU64);

/// The host threads' shared state (in `Shared`): how many are in use, and what the thread
/// policy reads.
pub(crate) struct Threads {
    /// Host threads started.
    pub(crate) hosts: usize,
    /// Hosts in use: worker `i` runs on host `i % active`.
    pub(crate) active: AtomicUsize,
    /// Bumped with every change of `active`; a host re-places its workers when it sees a new one.
    pub(crate) epoch: AtomicU64,
    /// May the thread policy change `active`? (No with `--worker-threads`, or after
    /// `mbal threads <n>` until `mbal threads auto`.)
    pub(crate) auto: AtomicBool,
    pub(crate) wakes: Vec<EventFd>,
    /// Each host's kernel thread id, for its scheduler statistics (0 until it starts).
    pub(crate) tids: Vec<AtomicI32>,
    pub(crate) served: Vec<Served>,
    /// Changes of `active` made by the policy, and its trials (`stats`: worker_threads_*).
    pub changes: AtomicU64,
    pub trials: AtomicU64,
}

impl Threads {
    pub fn new(hosts: usize, workers: usize, auto: bool) -> io::Result<Threads> {
        let hosts = hosts.clamp(1, workers.max(1));
        Ok(Threads {
            hosts,
            active: AtomicUsize::new(hosts),
            epoch: AtomicU64::new(0),
            auto: AtomicBool::new(auto && hosts > 1),
            wakes: (0..hosts).map(|_| EventFd::new()).collect::<io::Result<_>>()?,
            tids: (0..hosts).map(|_| AtomicI32::new(0)).collect(),
            served: (0..workers).map(|_| Served::default()).collect(),
            changes: AtomicU64::new(0),
            trials: AtomicU64::new(0),
        })
    }

    pub fn hosts(&self) -> usize {
        self.hosts
    }

    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    pub fn auto(&self) -> bool {
        self.auto.load(Ordering::Relaxed)
    }

    /// `mbal threads <n>` (Some: fixed from now on) or `mbal threads auto` (None).
    pub fn set_manual(&self, n: Option<usize>, peers: &crate::msg::Peers) {
        match n {
            Some(n) => {
                self.auto.store(false, Ordering::Relaxed);
                self.set_active(n, peers);
            }
            None => self.auto.store(self.hosts > 1, Ordering::Relaxed),
        }
    }

    /// Run the workers on `n` hosts (clamped to 1..=hosts). Returns whether that changed
    /// anything.
    pub fn set_active(&self, n: usize, peers: &crate::msg::Peers) -> bool {
        let n = n.clamp(1, self.hosts);
        if self.active.swap(n, Ordering::AcqRel) == n {
            return false;
        }
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.kick_all(peers);
        true
    }

    /// Wake every host, whatever it blocks in: its eventfd (a host with none or several
    /// workers) and every worker's mailbox (a host with one blocks in that one's poll). Rare:
    /// on a change of `active`, a hand-off, shutdown.
    pub fn kick_all(&self, peers: &crate::msg::Peers) {
        for w in &self.wakes {
            w.signal();
        }
        peers.wake_all();
    }

    /// The host that should run `worker` when `active` hosts are in use.
    pub(crate) fn home(worker: usize, active: usize) -> usize {
        worker % active.max(1)
    }

    pub(crate) fn publish_served(&self, worker: usize, n: u64) {
        if let Some(s) = self.served.get(worker) {
            s.0.store(n, Ordering::Relaxed);
        }
    }

    /// Requests served by all workers since the start.
    pub fn served(&self) -> u64 {
        self.served.iter().map(|s| s.0.load(Ordering::Relaxed)).sum()
    }

    /// The kernel thread ids of the first `n` hosts (0: not started yet).
    pub fn tids(&self, n: usize) -> Vec<i32> {
        self.tids.iter().take(n).map(|t| t.load(Ordering::Relaxed)).collect()
    }
}
