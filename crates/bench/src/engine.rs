//! The load loop of one client thread: closed loop (keep `pipeline` ops in flight per logical
//! client) or open loop (send at intended times, latency measured from the intended time, so
//! a slow server is not hidden by a client that waits: no coordinated omission), plus the
//! per-thread statistics it produces.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::driver::{Completion, Driver, OpKind, Request};
use crate::workload::KeyGen;

/// Open loop: how long after an op's intended time the client may send it, so that one wake-up
/// sends every op due in that span instead of one wake-up per op (at 45,000 ops/s the ops are
/// 22 µs apart). The latency of such an op still counts from its intended time, so this adds
/// at most this much to it (and 1/2 of it on average), far below the p99 figures measured.
pub const SEND_BATCH_NS: u64 = 50_000;

/// Where a thread's ops come from.
pub enum OpSource {
    /// Load phase: SET keys `next, next+step, ...` below `end`.
    Load { next: u32, step: u32, end: u32 },
    /// Run: phases as (end time in seconds since start, read ratio, key generator).
    Mix { phases: Vec<(f64, f64, KeyGen)> },
}

pub struct ThreadPlan {
    pub slots: usize,
    pub pipeline: usize,
    pub multiget: usize,
    /// SET value length: uniform in `value_size.0..=value_size.1` (drawn from this thread's
    /// seeded generator, so deterministic per op for a given seed; no draw when they are equal).
    pub value_size: (usize, usize),
    /// Max ops this thread may send.
    pub quota: u64,
    /// Open loop: this thread's ops/s. None: closed loop.
    pub rate: Option<f64>,
    pub start: Instant,
    pub duration: Duration,
    /// How long to wait for in-flight replies after the end.
    pub drain: Duration,
    pub source: OpSource,
    pub seed: u64,
    /// Offset of this thread's first intended send (open loop), to interleave threads.
    pub phase_offset_ns: u64,
    /// This thread's completed ops, published for the progress bar.
    pub progress: Arc<AtomicU64>,
    pub abort: Arc<AtomicBool>,
}

/// Per-second counters and latency of ops completed in that second.
#[derive(Clone)]
pub struct SecAcc {
    pub ops: u64,
    pub gets: u64,
    pub sets: u64,
    pub keys: u64,
    pub hits: u64,
    pub errors: u64,
    /// Open loop: ops sent in this second more than 1 ms after their intended time.
    pub late: u64,
    /// Latency in microseconds.
    pub hist: Histogram<u64>,
}

impl SecAcc {
    pub fn new() -> SecAcc {
        SecAcc {
            ops: 0,
            gets: 0,
            sets: 0,
            keys: 0,
            hits: 0,
            errors: 0,
            late: 0,
            hist: Histogram::new_with_bounds(1, 100_000_000, 2).expect("histogram bounds"),
        }
    }

    pub fn merge(&mut self, o: &SecAcc) {
        self.ops += o.ops;
        self.gets += o.gets;
        self.sets += o.sets;
        self.keys += o.keys;
        self.hits += o.hits;
        self.errors += o.errors;
        self.late += o.late;
        self.hist.add(&o.hist).expect("same bounds");
    }
}

impl Default for SecAcc {
    fn default() -> Self {
        Self::new()
    }
}

/// Latency histogram in nanoseconds.
pub fn ns_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("histogram bounds")
}

pub struct ThreadResult {
    pub get_hist: Histogram<u64>,
    pub set_hist: Histogram<u64>,
    pub seconds: Vec<SecAcc>,
    pub ops: u64,
    pub gets: u64,
    pub sets: u64,
    /// Keys requested by gets.
    pub get_keys: u64,
    pub hits: u64,
    pub errors: u64,
    /// Ops still in flight when the drain time ran out.
    pub unfinished: u64,
    pub sent: u64,
    /// Open loop: ops sent more than 1 ms after their intended time (the client fell behind).
    pub late: u64,
    pub target_requests: Vec<u64>,
    /// `target_requests` as they stood at the end of each second of the run (cumulative).
    pub target_seconds: Vec<Vec<u64>>,
    /// Redirects the driver followed.
    pub redirects: u64,
    /// Reads served by a hot key's copy, and reads sent to a copy that fell back home.
    pub replica_reads: u64,
    pub replica_fallbacks: u64,
    /// CPU time this thread used (user + system).
    pub cpu_secs: f64,
    /// Time from start to the last completion.
    pub elapsed: Duration,
}

/// CPU time used by the calling thread.
pub fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer to a timespec; CLOCK_THREAD_CPUTIME_ID is supported on Linux.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if r != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

struct Slot {
    start_ns: u64,
    kind: OpKind,
    slot: u32,
    nkeys: u32,
}

/// Run one thread's load against `driver` until its quota, the duration or the op source runs out.
pub fn run_thread(driver: &mut dyn Driver, mut plan: ThreadPlan) -> Result<ThreadResult> {
    let cpu0 = thread_cpu_secs();
    let cap = plan.slots * plan.pipeline;
    let mut free: Vec<u32> = (0..cap as u32).rev().collect();
    let mut meta: Vec<Slot> = (0..cap).map(|_| Slot { start_ns: 0, kind: OpKind::Get, slot: 0, nkeys: 0 }).collect();
    let mut inflight = vec![0usize; plan.slots];
    let mut total_inflight = 0usize;
    let mut rng = SmallRng::seed_from_u64(plan.seed);
    let mut keys: Vec<u32> = Vec::with_capacity(plan.multiget.max(1));
    let mut done: Vec<Completion> = Vec::with_capacity(cap);
    let mut res = ThreadResult {
        get_hist: ns_histogram(),
        set_hist: ns_histogram(),
        seconds: Vec::new(),
        ops: 0,
        gets: 0,
        sets: 0,
        get_keys: 0,
        hits: 0,
        errors: 0,
        unfinished: 0,
        sent: 0,
        late: 0,
        target_requests: Vec::new(),
        target_seconds: Vec::new(),
        redirects: 0,
        replica_reads: 0,
        replica_fallbacks: 0,
        cpu_secs: 0.0,
        elapsed: Duration::ZERO,
    };
    let start = plan.start;
    let deadline_ns = plan.duration.as_nanos() as u64;
    let interval_ns = plan.rate.map(|r| (1e9 / r.max(1e-9)) as u64).unwrap_or(0).max(1);
    let mut next_intended = plan.phase_offset_ns;
    let mut rr = 0usize;
    let mut stopping = false;
    let mut exhausted = false;
    let mut drain_deadline = 0u64;
    let mut last_end = 0u64;
    let elapsed_ns = || start.elapsed().as_nanos() as u64;
    let (mut load_state, phases) = match std::mem::replace(&mut plan.source, OpSource::Mix { phases: Vec::new() }) {
        OpSource::Load { next, step, end } => (Some((next, step.max(1), end)), Vec::new()),
        OpSource::Mix { phases } => (None, phases),
    };
    if load_state.is_none() && phases.is_empty() {
        anyhow::bail!("no phases");
    }

    loop {
        let now = elapsed_ns();
        // Per-target counts at each second's end (once a second: an allocation is fine).
        while (res.target_seconds.len() as u64) < now / 1_000_000_000 {
            res.target_seconds.push(driver.target_requests());
        }
        if !stopping
            && (now >= deadline_ns || res.sent >= plan.quota || exhausted || plan.abort.load(Ordering::Relaxed))
        {
            stopping = true;
            drain_deadline = now + plan.drain.as_nanos() as u64;
        }
        if !stopping {
            let (read_ratio, keygen) = if load_state.is_some() {
                (0.0, None)
            } else {
                let t = now as f64 * 1e-9;
                let p = phases.iter().find(|p| t < p.0).unwrap_or(&phases[phases.len() - 1]);
                (p.1, Some(&p.2))
            };
            let mut submitted = false;
            loop {
                if res.sent >= plan.quota {
                    break;
                }
                // pick a slot with room
                let slot = if plan.rate.is_none() {
                    while rr < plan.slots && inflight[rr] >= plan.pipeline {
                        rr += 1;
                    }
                    if rr == plan.slots {
                        rr = 0;
                        break;
                    }
                    rr
                } else {
                    if next_intended > now {
                        break;
                    }
                    let mut found = None;
                    for i in 0..plan.slots {
                        let s = (rr + i) % plan.slots;
                        if inflight[s] < plan.pipeline {
                            found = Some(s);
                            break;
                        }
                    }
                    let Some(s) = found else { break };
                    rr = (s + 1) % plan.slots;
                    s
                };
                // generate the op
                keys.clear();
                let kind = match (&mut load_state, keygen) {
                    (Some((next, step, end)), _) => {
                        if *next >= *end {
                            exhausted = true;
                            break;
                        }
                        keys.push(*next);
                        *next = next.saturating_add(*step);
                        OpKind::Set
                    }
                    (None, Some(kg)) => {
                        if read_ratio >= 1.0 || rng.gen::<f64>() < read_ratio {
                            for _ in 0..plan.multiget.max(1) {
                                keys.push(kg.next(&mut rng));
                            }
                            OpKind::Get
                        } else {
                            keys.push(kg.next(&mut rng));
                            OpKind::Set
                        }
                    }
                    (None, None) => unreachable!("a mix always has a key generator"),
                };
                let token = free.pop().expect("a free token when a slot has room");
                let start_ns = if plan.rate.is_some() {
                    let t = next_intended;
                    next_intended += interval_ns;
                    if now > t + 1_000_000 {
                        res.late += 1;
                        let sec = (now / 1_000_000_000) as usize;
                        if res.seconds.len() <= sec {
                            res.seconds.resize_with(sec + 1, SecAcc::new);
                        }
                        res.seconds[sec].late += 1;
                    }
                    t
                } else {
                    now
                };
                meta[token as usize] = Slot { start_ns, kind, slot: slot as u32, nkeys: keys.len() as u32 };
                let (vmin, vmax) = plan.value_size;
                let value_size = match kind {
                    OpKind::Set if vmax > vmin => rng.gen_range(vmin..=vmax) as u32,
                    _ => vmin as u32,
                };
                driver.submit(slot, &Request { kind, keys: &keys, token, value_size })?;
                inflight[slot] += 1;
                total_inflight += 1;
                res.sent += 1;
                submitted = true;
            }
            if submitted {
                driver.flush()?;
            }
        }
        if stopping {
            if total_inflight == 0 {
                break;
            }
            if now >= drain_deadline {
                res.unfinished = total_inflight as u64;
                break;
            }
        }
        // how long may we block?
        let mut timeout = Duration::from_millis(100);
        if stopping {
            timeout = timeout.min(Duration::from_nanos(drain_deadline.saturating_sub(now)));
        } else {
            timeout = timeout.min(Duration::from_nanos(deadline_ns.saturating_sub(now)));
            if plan.rate.is_some() && inflight.iter().any(|&i| i < plan.pipeline) {
                // Sleep until the next intended send plus SEND_BATCH_NS (the drivers' wait ends
                // to the microsecond: a timer), then send everything due in one batch. Replies
                // still wake the thread at once. Busy-polling instead (as the bench did before)
                // kept the sends within a few µs but took a whole core from the servers sharing
                // the machine (docs/benchmarks-journal.md §15, round 6).
                let wait = next_intended.saturating_sub(now) + SEND_BATCH_NS;
                timeout = timeout.min(Duration::from_nanos(wait));
            }
        }
        driver.poll(timeout, &mut done)?;
        if done.is_empty() {
            continue;
        }
        let end = elapsed_ns();
        last_end = end;
        let sec = (end / 1_000_000_000) as usize;
        if res.seconds.len() <= sec {
            res.seconds.resize_with(sec + 1, SecAcc::new);
        }
        let acc = &mut res.seconds[sec];
        for c in done.drain(..) {
            let m = &meta[c.token as usize];
            let lat = end.saturating_sub(m.start_ns).max(1);
            match m.kind {
                OpKind::Get => {
                    res.get_hist.saturating_record(lat);
                    res.gets += 1;
                    res.get_keys += m.nkeys as u64;
                    res.hits += c.hits as u64;
                    acc.gets += 1;
                    acc.keys += m.nkeys as u64;
                    acc.hits += c.hits as u64;
                }
                OpKind::Set => {
                    res.set_hist.saturating_record(lat);
                    res.sets += 1;
                    acc.sets += 1;
                    acc.keys += 1;
                }
            }
            res.errors += c.errors as u64;
            acc.errors += c.errors as u64;
            acc.ops += 1;
            acc.hist.saturating_record((lat / 1000).max(1));
            res.ops += 1;
            inflight[m.slot as usize] -= 1;
            total_inflight -= 1;
            free.push(c.token);
        }
        plan.progress.store(res.ops, Ordering::Relaxed);
    }
    res.target_requests = driver.target_requests();
    res.redirects = driver.redirects();
    res.replica_reads = driver.replica_reads();
    res.replica_fallbacks = driver.replica_fallbacks();
    res.cpu_secs = thread_cpu_secs() - cpu0;
    res.elapsed = Duration::from_nanos(last_end);
    Ok(res)
}
