//! MBal Figure 5 without the network: per-thread stores vs one global lock vs striped locks.
//!
//! 10-byte keys, 20-byte values, uniform keys, 2M preloaded keys; GET-only then SET-only, at 1
//! and 2 threads pinned to cores 0 and 1. Each run lasts 1 s (SCALING_MS): every thread works
//! until the same deadline and throughput is the sum of the threads' rates. The budget is the
//! preload plus ~10%, so SET runs measure a 100%-full store that evicts (MBal's write-heavy
//! steady state); GET runs come first, on the preloaded store. Request streams are generated
//! before each run (as a load generator's would be) and are the same for every design: thread
//! t of 2 touches the keys of cachelets `c % 2 == t` (what client-side routing gives mbal);
//! only the synchronization differs. Each of 5 repeats (SCALING_REPEATS) runs 1 and 2 threads
//! back to back, alternating which goes first; scaling is the median of these paired ratios,
//! so slow drift in the machine's load cancels.
//!   mbal     : each thread owns its WorkerStore (no lock on the data path)
//!   one-lock : one WorkerStore behind one Mutex (memcached's global cache lock)
//!   striped  : 64 WorkerStores, one per cachelet, each behind its own Mutex (bucket locks)
//!
//! Run: `cargo bench -p mbal-store --bench scaling` (env SCALING_MS, SCALING_KEYS,
//! SCALING_MEM_MB, SCALING_REPEATS to change; SCALING_VERBOSE=1 prints per-thread rates; a
//! large SCALING_MEM_MB measures SET without eviction).

use mbal_cluster::{key_hash, vn_of};
use mbal_store::{Cachelet, GlobalPool, Mode, StoreConfig, StoreResult, WorkerStats, WorkerStore};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

const CACHELETS: u32 = 64;
const VN: u32 = 16_384;
const VAL: [u8; 20] = *b"vvvvvvvvvvvvvvvvvvvv";

fn env_usize(name: &str, d: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn make_key(i: u32) -> [u8; 10] {
    let mut k = *b"k000000000";
    let mut x = i;
    for j in (1..10).rev() {
        k[j] = b'0' + (x % 10) as u8;
        x /= 10;
    }
    k
}

#[inline]
fn cachelet_of(h: u64) -> u32 {
    vn_of(h, VN) % CACHELETS
}

fn pin(core: usize) {
    // SAFETY: plain libc call on a zeroed cpu_set_t owned by this frame.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

struct Rng(u64);
impl Rng {
    #[inline]
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 as u128 * n as u128) >> 64) as usize
    }
}

fn thread_cpu() -> Duration {
    // SAFETY: clock_gettime writes into a timespec owned by this frame.
    unsafe {
        let mut ts: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts);
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }
}

/// Run `body` on one pinned thread per state, all started together and each stopping at the
/// same deadline `dur` later. `body` returns (ops, hits). Returns [wall, cpu] Mops/s: the sum
/// over threads of ops / wall time, and of ops / per-thread CPU time (what the run would give
/// with dedicated cores). A fixed duration rather than a fixed op count keeps both threads
/// running for the whole window: no thread finishes early and leaves the other alone.
fn par<S: Send>(states: Vec<S>, dur: Duration, body: impl Fn(S, &mut Rng, Instant) -> (u64, u64) + Sync) -> [f64; 2] {
    let n = states.len();
    let barrier = Barrier::new(n);
    let (body, barrier) = (&body, &barrier);
    let results: Vec<(Duration, Duration, u64, u64)> = std::thread::scope(|sc| {
        let hs: Vec<_> = states
            .into_iter()
            .enumerate()
            .map(|(t, s)| {
                sc.spawn(move || {
                    pin(t);
                    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) * 0x1234_5678_9abc_def1));
                    barrier.wait();
                    let (t0, c0) = (Instant::now(), thread_cpu());
                    let (ops, hits) = body(s, &mut rng, t0 + dur);
                    (t0.elapsed(), thread_cpu() - c0, ops, hits)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results.iter().map(|r| r.3).sum::<u64>() > 0);
    let rate = |t: Duration, ops: u64| ops as f64 / 1e6 / t.as_secs_f64().max(1e-9);
    if std::env::var_os("SCALING_VERBOSE").is_some() {
        let per: Vec<String> =
            results.iter().map(|r| format!("{:.2}/{:.2} Mops/s", rate(r.0, r.2), rate(r.1, r.2))).collect();
        println!("    {n} thread(s), wall/cpu rate per thread: {}", per.join(", "));
    }
    [results.iter().map(|r| rate(r.0, r.2)).sum(), results.iter().map(|r| rate(r.1, r.2)).sum()]
}

/// Apply `f` to the keys of `stream` in order (wrapping around) until `deadline`; the clock is
/// read every 256 ops. Returns (ops, hits).
#[inline]
fn until(stream: &[[u8; 10]], deadline: Instant, mut f: impl FnMut(&[u8; 10]) -> u64) -> (u64, u64) {
    let (mut ops, mut hits) = (0u64, 0u64);
    loop {
        for chunk in stream.chunks(256) {
            for key in chunk {
                hits += f(key);
            }
            ops += chunk.len() as u64;
            if Instant::now() >= deadline {
                return (ops, hits);
            }
        }
    }
}

#[inline]
fn do_get(w: &mut WorkerStore, k: &[u8; 10]) -> u64 {
    let h = key_hash(k);
    w.get(cachelet_of(h), h, k, 0).is_some() as u64
}

#[inline]
fn do_set(w: &mut WorkerStore, k: &[u8; 10]) -> u64 {
    let h = key_hash(k);
    matches!(w.store(cachelet_of(h), h, k, &VAL, 0, 0, Mode::Set, None, 0), StoreResult::Stored { .. }) as u64
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    Get,
    Set,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

struct Keys {
    keys: Vec<[u8; 10]>,
    all: Vec<u32>,
    /// thread t of 2: indices of keys in cachelets with c % 2 == t
    half: [Vec<u32>; 2],
}

/// Budget: the preloaded items plus ~10%, so SET runs measure the 100%-full, evicting store.
fn mem_for(nkeys: usize) -> usize {
    let page = StoreConfig::default().page_size;
    if let Some(mb) = std::env::var("SCALING_MEM_MB").ok().and_then(|v| v.parse::<usize>().ok()) {
        return mb << 20;
    }
    (nkeys * 72 * 11 / 10 + 2 * CACHELETS as usize * page).max(64 * page)
}

fn cfg(k: &Keys, worker_id: u16) -> StoreConfig {
    StoreConfig { mem_limit: mem_for(k.keys.len()), worker_id, ..Default::default() }
}

fn pool(k: &Keys) -> Arc<GlobalPool> {
    GlobalPool::new(mem_for(k.keys.len()), StoreConfig::default().page_size)
}

fn report_store(name: &str, g: &GlobalPool, stats: impl Iterator<Item = WorkerStats>) {
    let (mut items, mut ev, mut hits, mut misses) = (0, 0, 0, 0);
    for s in stats {
        items += s.curr_items;
        ev += s.evictions;
        hits += s.get_hits;
        misses += s.get_misses;
    }
    let p = g.stats();
    println!(
        "  [{name}] items {items}, evictions {ev}, get hit ratio {:.3}, pages {}/{}",
        hits as f64 / (hits + misses).max(1) as f64,
        p.created_pages + p.large_pages,
        p.total_pages
    );
}

/// The three designs, each preloaded once with every key.
struct Designs {
    mbal_pool: Arc<GlobalPool>,
    /// two workers; for 1-thread runs worker 1's cachelets are moved to worker 0
    mbal: Vec<WorkerStore>,
    one_pool: Arc<GlobalPool>,
    one: Mutex<WorkerStore>,
    striped_pool: Arc<GlobalPool>,
    striped: Vec<Mutex<WorkerStore>>,
}

fn build(k: &Keys) -> Designs {
    let mbal_pool = pool(k);
    let mut mbal: Vec<WorkerStore> =
        (0..2).map(|t| WorkerStore::new(mbal_pool.clone(), cfg(k, t as u16), CACHELETS)).collect();
    for c in 0..CACHELETS {
        mbal[(c % 2) as usize].insert_cachelet(Cachelet::new(c));
    }
    for (t, w) in mbal.iter_mut().enumerate() {
        for &i in &k.half[t] {
            do_set(w, &k.keys[i as usize]);
        }
    }
    let one_pool = pool(k);
    let mut one = WorkerStore::new(one_pool.clone(), cfg(k, 0), CACHELETS);
    for c in 0..CACHELETS {
        one.insert_cachelet(Cachelet::new(c));
    }
    for key in &k.keys {
        do_set(&mut one, key);
    }
    let striped_pool = pool(k);
    let striped: Vec<Mutex<WorkerStore>> = (0..CACHELETS)
        .map(|c| {
            // 64 small stores share the budget: refill one page at a time so no stripe
            // hoards pages another stripe needs.
            let sc = StoreConfig { refill_pages: 1, local_high_pages: 2, global_low_pages: 1, ..cfg(k, c as u16) };
            let mut w = WorkerStore::new(striped_pool.clone(), sc, CACHELETS);
            w.insert_cachelet(Cachelet::new(c));
            Mutex::new(w)
        })
        .collect();
    for key in &k.keys {
        let h = key_hash(key);
        do_set(&mut striped[cachelet_of(h) as usize].lock().unwrap(), key);
    }
    Designs { mbal_pool, mbal, one_pool, one: Mutex::new(one), striped_pool, striped }
}

/// Thread t's requests for one run: `len` keys drawn uniformly from `list`, generated before
/// the clock starts and read sequentially (wrapping around if the run outlasts them), so the
/// timed loop's memory misses are the store's.
fn stream(k: &Keys, list: &[u32], len: usize, seed: u64) -> Vec<[u8; 10]> {
    let mut rng = Rng(seed | 1);
    (0..len).map(|_| k.keys[list[rng.below(list.len())] as usize]).collect()
}

type Streams = [Vec<[u8; 10]>];

fn run_mbal(d: &mut Designs, op: Op, streams: &Streams, dur: Duration) -> [f64; 2] {
    let threads = streams.len();
    let ws = &mut d.mbal;
    if threads == 1 {
        // one worker owns everything: move worker 1's cachelets over (pointer moves)
        for c in (1..CACHELETS).step_by(2) {
            let cl = ws[1].take_cachelet(c).unwrap();
            ws[0].insert_cachelet(cl);
        }
    }
    let body = |(w, keys): (&mut WorkerStore, &Vec<[u8; 10]>), _: &mut Rng, end: Instant| {
        until(keys, end, |key| if op == Op::Get { do_get(w, key) } else { do_set(w, key) })
    };
    let states: Vec<(&mut WorkerStore, &Vec<[u8; 10]>)> = ws.iter_mut().zip(streams.iter()).collect();
    let r = par(states, dur, body);
    if threads == 1 {
        for c in (1..CACHELETS).step_by(2) {
            let cl = ws[0].take_cachelet(c).unwrap();
            ws[1].insert_cachelet(cl);
        }
    }
    r
}

fn run_one(d: &mut Designs, op: Op, streams: &Streams, dur: Duration) -> [f64; 2] {
    let m = &d.one;
    let body = |(m, keys): (&Mutex<WorkerStore>, &Vec<[u8; 10]>), _: &mut Rng, end: Instant| {
        until(keys, end, |key| {
            let mut w = m.lock().unwrap();
            if op == Op::Get {
                do_get(&mut w, key)
            } else {
                do_set(&mut w, key)
            }
        })
    };
    par(streams.iter().map(|s| (m, s)).collect(), dur, body)
}

fn run_striped(d: &mut Designs, op: Op, streams: &Streams, dur: Duration) -> [f64; 2] {
    let s = &d.striped;
    let body = |(s, keys): (&Vec<Mutex<WorkerStore>>, &Vec<[u8; 10]>), _: &mut Rng, end: Instant| {
        until(keys, end, |key| {
            let h = key_hash(key);
            let cl = cachelet_of(h);
            let mut w = s[cl as usize].lock().unwrap();
            if op == Op::Get {
                w.get(cl, h, key, 0).is_some() as u64
            } else {
                matches!(w.store(cl, h, key, &VAL, 0, 0, Mode::Set, None, 0), StoreResult::Stored { .. }) as u64
            }
        })
    };
    par(streams.iter().map(|st| (s, st)).collect(), dur, body)
}

type Runner = fn(&mut Designs, Op, &Streams, Duration) -> [f64; 2];

fn main() {
    let nkeys = env_usize("SCALING_KEYS", 2_000_000);
    let dur = Duration::from_millis(env_usize("SCALING_MS", 1000) as u64);
    let stream_len = env_usize("SCALING_STREAM", 5_000_000);
    let repeats = env_usize("SCALING_REPEATS", 5).max(1);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let t0 = Instant::now();
    let keys: Vec<[u8; 10]> = (0..nkeys as u32).map(make_key).collect();
    let mut half = [Vec::new(), Vec::new()];
    for (i, key) in keys.iter().enumerate() {
        half[(cachelet_of(key_hash(key)) % 2) as usize].push(i as u32);
    }
    let k = Keys { all: (0..nkeys as u32).collect(), keys, half };
    println!(
        "mbal-store scaling: {nkeys} keys (10 B), 20 B values, uniform, {} ms runs, {repeats} paired repeats (designs interleaved), {cores} cores visible, budget {} MiB per design",
        dur.as_millis(),
        mem_for(nkeys) >> 20
    );
    // Calibration: how much 2-thread parallelism does the machine give right now? (a pure
    // register loop; on a shared machine this is the ceiling for every design's scaling)
    let spin = |_: (), rng: &mut Rng, end: Instant| {
        let (mut x, mut ops) = (1u64, 0u64);
        while Instant::now() < end {
            for _ in 0..4096 {
                x = x.wrapping_add(rng.below(1000) as u64);
            }
            ops += 4096;
        }
        (ops, x | 1)
    };
    let cal = |n: usize| median((0..3).map(|_| par(vec![(); n], dur / 8, spin)[0]).collect());
    let (c1, c2) = (cal(1), cal(2));
    println!(
        "calibration (pure CPU loop): 1->2 thread wall scaling {:.2}x (below ~1.9x the machine is shared; trust the CPU-time table)",
        c2 / c1
    );
    // Memory calibration: a dependent random-read chain over an 80 MB buffer per thread (about
    // what each thread's half of the store spans). 2 threads / 1 thread is how far the memory
    // system lets two cores' misses proceed in parallel at that moment: on this VM it is ~2x
    // when the host is quiet and drops when a neighbour (or the other vCPU's placement) loads
    // the memory system. Measured right before every pair.
    let mem_bufs: Vec<Vec<u64>> = (0..2u64)
        .map(|t| {
            // one random cycle through every slot (Sattolo's shuffle), so the chase never
            // settles into a short, cache-resident loop
            let mut r = Rng(0xDEAD_BEEF ^ (t + 1));
            let mut p: Vec<u64> = (0..10u64 << 20).collect();
            for i in (1..p.len()).rev() {
                p.swap(i, r.below(i));
            }
            let mut next = vec![0u64; p.len()];
            for w in 0..p.len() {
                next[p[w] as usize] = p[(w + 1) % p.len()];
            }
            next
        })
        .collect();
    let chase = |buf: &Vec<u64>, rng: &mut Rng, end: Instant| {
        let (mut i, mut ops) = (rng.below(buf.len()), 0u64);
        while Instant::now() < end {
            for _ in 0..256 {
                i = buf[i] as usize;
            }
            ops += 256;
        }
        (ops, i as u64 | 1)
    };
    let mem_cal = || {
        let one = par(vec![&mem_bufs[0]], dur / 4, chase)[0];
        let two = par(mem_bufs.iter().collect(), dur / 4, chase)[0];
        two / one
    };
    let t = Instant::now();
    let mut d = build(&k);
    println!("preloaded 3 designs in {:.1}s", t.elapsed().as_secs_f64());
    let names = ["mbal", "one-lock", "striped"];
    let runners: [Runner; 3] = [run_mbal, run_one, run_striped];
    // Paired runs: each repeat measures 1 and 2 threads back to back for every design (the
    // order alternates between repeats), so a change in the machine's load between repeats
    // hits both halves of a pair alike. Scaling is the median of the per-repeat ratios; the
    // calibration loop is re-measured in every repeat to show what the machine gave then.
    // runs[wall|cpu][design][op][threads-1] and ratios[wall|cpu][design][op]
    let mut runs = vec![vec![vec![vec![Vec::new(); 2]; 2]; 3]; 2];
    let mut ratios = vec![vec![vec![Vec::new(); 2]; 3]; 2];
    let mut cal_ratios = Vec::new();
    let mut mem_ratios = Vec::new();
    for (oi, op) in [Op::Get, Op::Set].into_iter().enumerate() {
        for rep in 0..repeats {
            let order: [usize; 2] = if rep % 2 == 0 { [1, 2] } else { [2, 1] };
            let mut got = [[[0.0f64; 2]; 2]; 3]; // [design][threads-1][wall|cpu]
            mem_ratios.push(mem_cal());
            for threads in order {
                // one stream per thread, the same for every design
                let lists: Vec<&Vec<u32>> = if threads == 1 { vec![&k.all] } else { k.half.iter().collect() };
                let streams: Vec<Vec<[u8; 10]>> = lists
                    .iter()
                    .enumerate()
                    .map(|(t, l)| {
                        stream(&k, l, stream_len, (oi * 1000 + rep * 10 + threads * 2 + t) as u64 * 0x9E37_79B9)
                    })
                    .collect();
                for (i, r) in runners.iter().enumerate() {
                    got[i][threads - 1] = r(&mut d, op, &streams, dur);
                }
            }
            for (i, g) in got.iter().enumerate() {
                for m in 0..2 {
                    runs[m][i][oi][0].push(g[0][m]);
                    runs[m][i][oi][1].push(g[1][m]);
                    ratios[m][i][oi].push(g[1][m] / g[0][m]);
                }
            }
            cal_ratios.push(cal(2) / cal(1));
            println!(
                "  {} repeat {}: mbal 1->2 {:.2}x (wall); calibration: memory {:.2}x, CPU {:.2}x",
                ["GET", "SET"][oi],
                rep + 1,
                ratios[0][0][oi].last().unwrap(),
                mem_ratios.last().unwrap(),
                cal_ratios.last().unwrap()
            );
        }
    }
    let min = |v: &[f64]| v.iter().cloned().fold(f64::INFINITY, f64::min);
    println!(
        "calibration during the runs: memory chase 1->2 median {:.2}x (min {:.2}x), CPU loop median {:.2}x (min {:.2}x)",
        median(mem_ratios.clone()),
        min(&mem_ratios),
        median(cal_ratios.clone()),
        min(&cal_ratios)
    );
    report_store("mbal", &d.mbal_pool, d.mbal.iter().map(|w| w.stats()));
    report_store("one-lock", &d.one_pool, std::iter::once(d.one.lock().unwrap().stats()));
    report_store("striped", &d.striped_pool, d.striped.iter().map(|w| w.lock().unwrap().stats()));
    for (m, title) in ["wall-clock", "per-thread CPU time"].iter().enumerate() {
        println!("--- Mops/s by {title} (medians; scaling = median of paired ratios) ---");
        println!("{:<6} {:<9} {:>10} {:>10} {:>8}  per-repeat", "op", "design", "1t Mops/s", "2t Mops/s", "scaling");
        for (oi, name) in ["GET", "SET"].iter().enumerate() {
            let med = |i: usize, t: usize| median(runs[m][i][oi][t].clone());
            for (i, design) in names.iter().enumerate() {
                let list: Vec<String> = ratios[m][i][oi].iter().map(|r| format!("{r:.2}")).collect();
                println!(
                    "{name:<6} {design:<9} {:>10.2} {:>10.2} {:>7.2}x  {}",
                    med(i, 0),
                    med(i, 1),
                    median(ratios[m][i][oi].clone()),
                    list.join(" ")
                );
            }
            let (s, l2, s2) = (median(ratios[m][0][oi].clone()), med(1, 1), med(2, 1));
            let m2 = med(0, 1);
            println!("{name:<6} at 2 threads: mbal/one-lock = {:.2}x, mbal/striped = {:.2}x", m2 / l2, m2 / s2);
            println!(
                "{name:<6} targets ({title}): mbal 1->2 {s:.2}x (>=1.9x {}), mbal/one-lock {:.2}x (>=2x {})",
                if s >= 1.9 { "met" } else { "NOT met" },
                m2 / l2,
                if m2 / l2 >= 2.0 { "met" } else { "NOT met" }
            );
        }
    }
    println!("total bench time {:.1}s", t0.elapsed().as_secs_f64());
}
