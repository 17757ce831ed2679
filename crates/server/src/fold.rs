//! How many threads run the workers: the thread policy.
//!
//! A request for a key another worker owns is a message between workers. Between two threads
//! it costs a wake-up of the other thread and cache lines moved between cores; between two
//! workers on one thread it costs neither (`worker/group.rs`). So more threads only pay when
//! they get CPUs of their own. On a machine shared with the clients (an application and its
//! cache on one host, or a benchmark's generator), or given fewer CPUs than `-t`, the threads
//! wait for a CPU or for wake-ups instead, and the server serves less with two threads than
//! with one: on our 2-core machine with the generator beside it, `-t 2` served 0.6x what
//! `-t 1` did (docs/benchmarks-journal.md §7).
//!
//! The policy measures instead of guessing. Every [`TICK`] it reads, for each host thread in
//! use, its time on a CPU and its time runnable but waiting for one (the kernel's
//! `/proc/self/task/<tid>/schedstat`), the idle time of the CPUs this process may use
//! (`/proc/stat`), and the requests the workers served. From those it tries a change, and
//! keeps it only if the workers then served as much (fewer threads) or clearly more (more
//! threads):
//!
//! * fewer threads are tried when the work would fit in fewer ([`FOLD_FITS`]) or the threads
//!   wait a lot for a CPU ([`FOLD_WAIT`]);
//! * more threads are tried when every thread in use is busy ([`UNFOLD_BUSY`]) and a CPU is
//!   idle ([`UNFOLD_IDLE`]);
//! * a trial lasts two ticks (one to settle, one measured) against the tick before it;
//! * a trial that fails is not tried again for [`BACKOFF_MIN`], doubling up to [`BACKOFF_MAX`];
//!   the back-off ends when the served rate moves by half.
//!
//! A server starts with every thread in use. Under load (at least [`FOLD_MIN_RATE`]) that
//! its threads cannot use well it folds onto fewer; folded and saturated with a CPU idle, it
//! tries spreading again. `--worker-threads N` fixes the count, and
//! `mbal threads <n>` / `mbal threads auto` set it or hand it back to the policy at run time.

use crate::shared::Shared;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the policy looks.
pub const TICK: Duration = Duration::from_millis(500);
/// Try one thread fewer when the busy time of the threads in use would fit in one fewer at
/// this utilisation.
pub const FOLD_FITS: f64 = 0.8;
/// ... or when the threads spent this share of their running time waiting for a CPU.
pub const FOLD_WAIT: f64 = 0.2;
/// Try one thread more when every thread in use was busy this share of the tick ...
pub const UNFOLD_BUSY: f64 = 0.85;
/// ... and this many CPUs (of those the process may use) were idle.
pub const UNFOLD_IDLE: f64 = 0.7;
/// No trial of fewer threads below this rate (requests/s): a lightly loaded server loses
/// nothing to its threads, and one that starts spread needs no trial to spread when load
/// comes (a failed trial of more threads costs more than one of fewer: docs/benchmarks-journal.md §7).
pub const FOLD_MIN_RATE: f64 = 1000.0;
/// Keep fewer threads if they served at least this share of the rate before the trial.
pub const KEEP_FOLD: f64 = 0.97;
/// Keep more threads only if they served at least this share.
pub const KEEP_UNFOLD: f64 = 1.05;
pub const BACKOFF_MIN: Duration = Duration::from_secs(2);
pub const BACKOFF_MAX: Duration = Duration::from_secs(64);

/// What one tick measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tick {
    /// Each host thread in use: the share of the tick it ran on a CPU.
    pub busy: Vec<f64>,
    /// All those threads' time waiting for a CPU over their time on one.
    pub wait: f64,
    /// CPUs idle over the tick (of those the process may use).
    pub idle_cpus: f64,
    /// Requests served per second.
    pub rate: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dir {
    Fold,
    Unfold,
}

#[derive(Clone, Copy, Debug)]
struct Trial {
    dir: Dir,
    from: usize,
    base: f64,
    /// Ticks seen since the change (the first only settles).
    ticks: u32,
}

#[derive(Clone, Copy, Debug)]
struct Backoff {
    wait: Duration,
    until: Option<Instant>,
    /// The rate when the last trial failed.
    rate: f64,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff { wait: BACKOFF_MIN, until: None, rate: 0.0 }
    }

    fn allows(&mut self, now: Instant, rate: f64) -> bool {
        let moved = self.rate > 0.0 && (rate / self.rate > 1.5 || rate / self.rate < 1.0 / 1.5);
        if moved {
            *self = Backoff::new();
        }
        self.until.is_none_or(|u| now >= u)
    }

    fn failed(&mut self, now: Instant, rate: f64) {
        self.until = Some(now + self.wait);
        self.wait = (self.wait * 2).min(BACKOFF_MAX);
        self.rate = rate;
    }

    fn passed(&mut self) {
        *self = Backoff::new();
    }

    /// Not before `d` from now, whatever the back-off says.
    fn hold(&mut self, now: Instant, d: Duration) {
        self.until = Some(self.until.map_or(now + d, |u| u.max(now + d)));
    }
}

/// The decisions, apart from the measuring (unit-tested on made-up ticks).
#[derive(Debug)]
pub struct Policy {
    hosts: usize,
    trial: Option<Trial>,
    fold: Backoff,
    unfold: Backoff,
}

impl Policy {
    pub fn new(hosts: usize) -> Policy {
        Policy { hosts, trial: None, fold: Backoff::new(), unfold: Backoff::new() }
    }

    /// A tick with `active` threads in use; returns the count to use next if it changes
    /// (`trial` is true when the change starts a trial).
    pub fn tick(&mut self, now: Instant, active: usize, t: &Tick) -> Option<(usize, bool)> {
        if let Some(mut tr) = self.trial.take() {
            tr.ticks += 1;
            if tr.ticks < 2 {
                self.trial = Some(tr);
                return None;
            }
            let keep = match tr.dir {
                Dir::Fold => t.rate >= tr.base * KEEP_FOLD,
                Dir::Unfold => t.rate >= tr.base * KEEP_UNFOLD,
            };
            let (this, other) = match tr.dir {
                Dir::Fold => (&mut self.fold, &mut self.unfold),
                Dir::Unfold => (&mut self.unfold, &mut self.fold),
            };
            if keep {
                this.passed();
                // Do not try straight back.
                other.hold(now, BACKOFF_MIN);
                return None;
            }
            this.failed(now, tr.base);
            return Some((tr.from, false));
        }
        let rate = t.rate;
        let busy: f64 = t.busy.iter().sum();
        let crowded = busy <= (active - 1) as f64 * FOLD_FITS || t.wait >= FOLD_WAIT;
        if active > 1 && rate >= FOLD_MIN_RATE && crowded && self.fold.allows(now, rate) {
            self.trial = Some(Trial { dir: Dir::Fold, from: active, base: rate, ticks: 0 });
            return Some((active - 1, true));
        }
        let saturated = !t.busy.is_empty() && t.busy.iter().all(|&b| b >= UNFOLD_BUSY);
        if active < self.hosts && saturated && t.idle_cpus >= UNFOLD_IDLE && self.unfold.allows(now, rate) {
            self.trial = Some(Trial { dir: Dir::Unfold, from: active, base: rate, ticks: 0 });
            return Some((active + 1, true));
        }
        None
    }
}

/// Start the policy's thread (only when there is a choice to make). It stops when the server
/// does: at once when the returned sender is dropped (`ServerHandle` does so on shutdown),
/// else within a tick of the shutdown flag (a `shutdown` command).
pub(crate) fn spawn(shared: Arc<Shared>) -> std::io::Result<(JoinHandle<()>, Sender<()>)> {
    let (stop, stopped) = crossbeam_channel::bounded(0);
    let t = std::thread::Builder::new().name("mbal-threads".into()).spawn(move || {
        let _watch = shared.life.watch();
        run(shared.clone(), stopped)
    })?;
    Ok((t, stop))
}

fn run(shared: Arc<Shared>, stopped: Receiver<()>) {
    let th = &shared.threads;
    let mut policy = Policy::new(th.hosts());
    let cpus = allowed_cpus();
    let mut prev: Option<Reading> = None;
    while !shared.shutdown.load(Ordering::Relaxed) {
        if stopped.recv_timeout(TICK) != Err(RecvTimeoutError::Timeout) {
            return;
        }
        let active = th.active();
        let now = Instant::now();
        let r = Reading {
            at: now,
            sched: th.tids(active).into_iter().map(schedstat).collect(),
            idle: idle_ticks(&cpus),
            served: th.served(),
            active,
        };
        let Some(p) = prev.replace(r.clone()) else { continue };
        if !th.auto() {
            // An operator fixed the count: forget any trial in progress.
            policy = Policy::new(th.hosts());
            continue;
        }
        if p.active != active {
            continue;
        }
        let secs = now.duration_since(p.at).as_secs_f64().max(1e-3);
        let mut tick = Tick { rate: r.served.saturating_sub(p.served) as f64 / secs, ..Tick::default() };
        let (mut run_ns, mut wait_ns) = (0u64, 0u64);
        for ((r1, w1), (r0, w0)) in r.sched.iter().zip(&p.sched) {
            let r = r1.saturating_sub(*r0);
            run_ns += r;
            wait_ns += w1.saturating_sub(*w0);
            tick.busy.push(r as f64 / 1e9 / secs);
        }
        tick.wait = if run_ns > 0 { wait_ns as f64 / run_ns as f64 } else { 0.0 };
        tick.idle_cpus = r.idle.saturating_sub(p.idle) as f64 / clock_ticks_per_sec() / secs;
        if let Some((n, trial)) = policy.tick(now, active, &tick) {
            if trial {
                th.trials.fetch_add(1, Ordering::Relaxed);
            }
            if th.auto() && th.set_active(n, shared.peers()) {
                th.changes.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(from = active, to = n, trial, ?tick, "worker threads");
            }
        }
    }
}

/// What the policy reads each tick: when, each host in use's (run, wait) ns, the allowed
/// CPUs' idle clock ticks, the requests served, the hosts in use.
#[derive(Clone)]
struct Reading {
    at: Instant,
    sched: Vec<(u64, u64)>,
    idle: u64,
    served: u64,
    active: usize,
}

/// A thread's time on a CPU and waiting for one, in ns (zeros if unreadable).
fn schedstat(tid: i32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).unwrap_or_default();
    let mut it = text.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

fn clock_ticks_per_sec() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: `set` is a plain bitmask the kernel fills; its size is passed.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

/// Idle and I/O-wait clock ticks of `cpus` since boot (`/proc/stat`; all CPUs if empty).
fn idle_ticks(cpus: &[usize]) -> u64 {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    parse_idle(&text, cpus)
}

fn parse_idle(text: &str, cpus: &[usize]) -> u64 {
    let mut total = 0;
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let Some(name) = f.next() else { continue };
        let Some(n) = name.strip_prefix("cpu").filter(|n| !n.is_empty()).and_then(|n| n.parse::<usize>().ok()) else {
            continue;
        };
        if !cpus.is_empty() && !cpus.contains(&n) {
            continue;
        }
        let v: Vec<u64> = f.map(|x| x.parse().unwrap_or(0)).collect();
        total += v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tick(busy: &[f64], wait: f64, idle: f64, rate: f64) -> Tick {
        Tick { busy: busy.to_vec(), wait, idle_cpus: idle, rate }
    }

    /// Two threads that wait for CPUs: try one; it serves more, so it stays.
    #[test]
    fn folds_when_threads_wait_and_one_serves_more() {
        let mut p = Policy::new(2);
        let t0 = Instant::now();
        assert_eq!(p.tick(t0, 2, &tick(&[0.5, 0.5], 0.35, 0.5, 700e3)), Some((1, true)));
        assert_eq!(p.tick(t0 + TICK, 1, &tick(&[1.0], 0.0, 0.3, 900e3)), None, "settling");
        assert_eq!(p.tick(t0 + TICK * 2, 1, &tick(&[1.0], 0.0, 0.3, 1.1e6)), None, "kept");
        // Saturated but no idle CPU: no trial of two.
        assert_eq!(p.tick(t0 + TICK * 3, 1, &tick(&[1.0], 0.0, 0.3, 1.1e6)), None);
    }

    /// A trial of fewer threads that serves less is undone, and not tried again until the
    /// back-off has passed (which doubles).
    #[test]
    fn undoes_a_fold_that_serves_less_and_backs_off() {
        let mut p = Policy::new(2);
        let t0 = Instant::now();
        let busy = tick(&[0.9, 0.9], 0.25, 0.1, 1e6);
        assert_eq!(p.tick(t0, 2, &busy), Some((1, true)));
        assert_eq!(p.tick(t0 + TICK, 1, &tick(&[1.0], 0.0, 1.0, 6e5)), None);
        assert_eq!(p.tick(t0 + TICK * 2, 1, &tick(&[1.0], 0.0, 1.0, 6e5)), Some((2, false)), "undone");
        assert_eq!(p.tick(t0 + TICK * 3, 2, &busy), None, "backing off");
        let later = t0 + TICK * 2 + BACKOFF_MIN;
        assert_eq!(p.tick(later, 2, &busy), Some((1, true)), "tried again after the back-off");
        assert_eq!(p.tick(later + TICK, 1, &tick(&[1.0], 0.0, 1.0, 6e5)), None);
        assert_eq!(p.tick(later + TICK * 2, 1, &tick(&[1.0], 0.0, 1.0, 6e5)), Some((2, false)));
        assert_eq!(p.tick(later + TICK * 2 + BACKOFF_MIN, 2, &busy), None, "the back-off doubled");
        // The load changes by more than half: the back-off ends.
        assert_eq!(p.tick(later + TICK * 3 + BACKOFF_MIN, 2, &tick(&[0.9, 0.9], 0.25, 0.1, 3e5)), Some((1, true)));
    }

    /// A lightly loaded server keeps its threads; one that serves the same on fewer folds
    /// (a tie keeps fewer); saturated with an idle CPU it tries two and keeps them if they
    /// serve clearly more.
    #[test]
    fn light_load_stays_ties_fold_then_saturation_with_idle_cpu_unfolds() {
        let mut p = Policy::new(2);
        let t0 = Instant::now();
        assert_eq!(p.tick(t0, 2, &tick(&[0.0, 0.0], 0.0, 2.0, 0.0)), None, "idle");
        assert_eq!(p.tick(t0, 2, &tick(&[0.01, 0.01], 0.5, 2.0, 500.0)), None, "light load");
        assert_eq!(p.tick(t0, 2, &tick(&[0.3, 0.3], 0.0, 1.4, 2e5)), Some((1, true)), "fits in one");
        assert_eq!(p.tick(t0 + TICK, 1, &tick(&[0.6], 0.0, 1.4, 2e5)), None);
        assert_eq!(p.tick(t0 + TICK * 2, 1, &tick(&[0.6], 0.0, 1.4, 1.95e5)), None, "kept on a tie");
        let sat = tick(&[0.99], 0.01, 0.9, 3e5);
        assert_eq!(p.tick(t0 + TICK * 3, 1, &sat), None, "no trial straight back");
        let t1 = t0 + TICK * 2 + BACKOFF_MIN;
        assert_eq!(p.tick(t1, 1, &sat), Some((2, true)));
        assert_eq!(p.tick(t1 + TICK, 2, &tick(&[0.9, 0.9], 0.05, 0.1, 1.6e6)), None);
        assert_eq!(p.tick(t1 + TICK * 2, 2, &tick(&[0.9, 0.9], 0.05, 0.1, 1.6e6)), None, "kept: more served");
        // Busy and not waiting: no trial of one.
        assert_eq!(p.tick(t1 + TICK * 3, 2, &tick(&[0.9, 0.9], 0.05, 0.1, 1.6e6)), None);
        assert_eq!(p.tick(t1 + TICK * 3 + BACKOFF_MAX, 2, &tick(&[0.9, 0.9], 0.05, 0.1, 1.6e6)), None);
    }

    /// One thread more that serves about the same is undone.
    #[test]
    fn undoes_an_unfold_that_does_not_pay() {
        let mut p = Policy::new(4);
        let t0 = Instant::now();
        assert_eq!(p.tick(t0, 2, &tick(&[0.95, 0.95], 0.05, 1.5, 1e6)), Some((3, true)));
        assert_eq!(p.tick(t0 + TICK, 3, &tick(&[0.7; 3], 0.05, 1.0, 1.02e6)), None);
        assert_eq!(p.tick(t0 + TICK * 2, 3, &tick(&[0.7; 3], 0.05, 1.0, 1.02e6)), Some((2, false)));
    }

    #[test]
    fn idle_time_of_the_allowed_cpus() {
        let stat = "cpu  10 0 10 500 5 0 0 0 0 0\ncpu0 5 0 5 200 2 0 0 0 0 0\ncpu1 5 0 5 300 3 0 0 0 0 0\nintr 1\n";
        assert_eq!(parse_idle(stat, &[]), 505);
        assert_eq!(parse_idle(stat, &[1]), 303);
        assert_eq!(parse_idle(stat, &[0, 1]), 505);
    }
}
