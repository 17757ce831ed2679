//! The core driven by scripted events: a small deterministic model of a
//! server's workers (cumulative counters, ownership that follows the
//! core's releases) stands where the server's workers would.

use super::*;
use crate::snapshot::CacheletSample;
use mbal_cluster::ServerInfo;

const WORKERS: u16 = 4;
const PER_WORKER: u32 = 4;

fn map(servers: u16) -> ClusterMap {
    let servers = (0..servers)
        .map(|s| ServerInfo {
            main: format!("127.0.0.1:{}", 30000 + s * 10).parse().unwrap(),
            workers: (0..WORKERS).map(|w| format!("127.0.0.1:{}", 30001 + s * 10 + w).parse().unwrap()).collect(),
        })
        .collect();
    ClusterMap::even(servers, PER_WORKER, 1024)
}

fn core(balance_every: u64, balancer: bool) -> ControlCore<u32> {
    let settings = CoreSettings {
        server: 0,
        workers: WORKERS,
        balance_every,
        balancer: balancer.then(|| Config { persistence: 2, ..Config::default() }),
    };
    ControlCore::new(settings, map(1))
}

/// The workers: who owns each cachelet, and each cachelet's reads so far.
/// Cachelets first homed on worker 0 take `hot` reads a second, the
/// others 500.
struct Workers {
    owner: Vec<u16>,
    reads: Vec<u64>,
    hot: u64,
    now_s: u64,
}

impl Workers {
    fn new(core: &ControlCore<u32>, hot: u64) -> Workers {
        let m = core.map();
        let owner = (0..m.cachelet_count()).map(|c| m.owner(c).1).collect();
        Workers { owner, reads: vec![0; m.cachelet_count() as usize], hot, now_s: 0 }
    }

    /// One second of load, then every worker's sample for round `seq`.
    fn samples(&mut self, seq: u64, first_owner: &[u16]) -> Vec<Event<u32>> {
        self.now_s += 1;
        for (c, r) in self.reads.iter_mut().enumerate() {
            *r += if first_owner[c] == 0 { self.hot } else { 500 };
        }
        (0..WORKERS)
            .map(|w| {
                let cachelets = (0..self.owner.len())
                    .filter(|&c| self.owner[c] == w)
                    .map(|c| CacheletSample { id: c as u32, reads: self.reads[c], ..CacheletSample::default() })
                    .collect();
                let sample =
                    WorkerSample { worker: w, at_ns: self.now_s * 1_000_000_000, cachelets, ..WorkerSample::default() };
                Event::Sample { seq, sample }
            })
            .collect()
    }
}

/// Run `epochs` epochs: a tick each, the samples asked for, every release
/// carried out at once. Every command, in order.
fn run(core: &mut ControlCore<u32>, hot: u64, epochs: usize) -> Vec<Command<u32>> {
    let mut workers = Workers::new(core, hot);
    let first_owner = workers.owner.clone();
    let mut log = Vec::new();
    let mut pending: VecDeque<Event<u32>> = VecDeque::new();
    for _ in 0..=epochs {
        pending.push_back(Event::Tick);
        while let Some(e) = pending.pop_front() {
            for c in core.step(e) {
                match &c {
                    Command::SampleWorkers { seq } => pending.extend(workers.samples(*seq, &first_owner)),
                    Command::Release { cachelet, from, to, token } => {
                        assert_eq!(workers.owner[*cachelet as usize], *from, "released by its owner");
                        workers.owner[*cachelet as usize] = *to;
                        pending.push_back(Event::Moved { token: *token, cachelet: *cachelet, worker: *to });
                    }
                    _ => {}
                }
                log.push(c);
            }
        }
    }
    log
}

fn decisions(log: &[Command<u32>]) -> Vec<(u64, &Decision)> {
    log.iter()
        .filter_map(|c| match c {
            Command::Epoch { snapshot, balancer: Some(d) } => Some((snapshot.seq, d)),
            _ => None,
        })
        .collect()
}

#[test]
fn the_same_events_give_the_same_commands() {
    let a = run(&mut core(1, true), 6_000, 12);
    let b = run(&mut core(1, true), 6_000, 12);
    assert_eq!(a, b);
    let releases = a.iter().filter(|c| matches!(c, Command::Release { .. })).count();
    assert!(releases > 0, "a hot worker's cachelets moved");
}

#[test]
fn phase_2_moves_a_hot_workers_cachelets_and_the_map_follows() {
    let mut c = core(1, true);
    let log = run(&mut c, 6_000, 12);
    let d = decisions(&log);
    assert_eq!(d.len(), 12, "one decision per epoch");
    let last = d.last().unwrap().1;
    assert!(last.imbalance.max_over_avg < 1.3, "balanced after the moves: {}", last.imbalance.max_over_avg);
    let first = d[0].1;
    assert!(first.imbalance.max_over_avg > 2.0, "hot before: {}", first.imbalance.max_over_avg);
    // The map counts one epoch per move, and agrees with every release.
    let moves = log.iter().filter(|c| matches!(c, Command::Release { .. })).count() as u64;
    assert_eq!(c.map().epoch(), 1 + moves);
    assert_eq!(c.status().moves, moves);
    let mut owners: Vec<u16> = (0..c.map().cachelet_count()).map(|x| map(1).owner(x).1).collect();
    for cmd in &log {
        if let Command::Release { cachelet, to, .. } = cmd {
            owners[*cachelet as usize] = *to;
        }
    }
    assert!((0..c.map().cachelet_count()).all(|x| c.map().owner(x) == (0, owners[x as usize])));
}

#[test]
fn phase_2_decides_once_per_its_epoch_on_the_epochs_merged() {
    let log = run(&mut core(3, true), 6_000, 12);
    let d = decisions(&log);
    assert!(d.iter().all(|(seq, _)| seq % 3 == 0), "{:?}", d.iter().map(|x| x.0).collect::<Vec<_>>());
    assert_eq!(d.len(), 4);
    // The merged epoch's load is the 3 epochs' requests over their length:
    // before any move (the first decision) worker 0 carries 4 x 6,000/s.
    let w0 = d[0].1.loads.iter().find(|l| l.0 == 0).unwrap().1;
    assert!((w0 - 24_000.0).abs() < 1.0, "{w0}");
    let epochs = log.iter().filter(|c| matches!(c, Command::Epoch { .. })).count();
    assert_eq!(epochs, 12, "every epoch closes, Phase 2 or not");
}

#[test]
fn with_the_balancer_off_epochs_close_and_nothing_moves() {
    let log = run(&mut core(1, false), 6_000, 5);
    assert_eq!(log.iter().filter(|c| matches!(c, Command::Epoch { balancer: None, .. })).count(), 5);
    assert!(!log.iter().any(|c| matches!(c, Command::Release { .. } | Command::Status(_))));
}

#[test]
fn a_tick_while_a_round_is_open_starts_none() {
    let mut c = core(1, true);
    assert_eq!(c.step(Event::Tick), vec![Command::SampleWorkers { seq: 0 }]);
    assert!(c.gathering());
    assert!(c.step(Event::Tick).is_empty(), "round 0 still open");
    // A sample of another round is ignored.
    let s = WorkerSample { worker: 0, ..WorkerSample::default() };
    assert!(c.step(Event::Sample { seq: 7, sample: s }).is_empty());
}

#[test]
fn moves_asked_for_a_moving_cachelet_wait_their_turn() {
    let mut c = core(1, false);
    let cachelet = c.map().cachelets_of(0, 0)[0];
    let out = c.step(Event::MoveAsked { cachelet, to: 1, reply: 10 });
    let [Command::Release { token: t1, from: 0, to: 1, .. }] = out[..] else { panic!("{out:?}") };
    // Another destination waits; the same one again joins the first.
    assert!(c.step(Event::MoveAsked { cachelet, to: 2, reply: 11 }).is_empty());
    assert!(c.step(Event::MoveAsked { cachelet, to: 1, reply: 12 }).is_empty());
    let out = c.step(Event::Moved { token: t1, cachelet, worker: 1 });
    let moved = MoveAnswer::Moved { epoch: 2 };
    assert_eq!(out[0], Command::MapEpoch(2));
    assert_eq!(out[1], Command::Reply { to: 10, answer: moved });
    assert_eq!(out[2], Command::Reply { to: 12, answer: moved });
    let Command::Release { token: t2, from: 1, to: 2, .. } = out[3] else { panic!("{out:?}") };
    assert_eq!(out.len(), 4);
    let out = c.step(Event::Moved { token: t2, cachelet, worker: 2 });
    assert_eq!(out, vec![Command::MapEpoch(3), Command::Reply { to: 11, answer: MoveAnswer::Moved { epoch: 3 } }]);
    assert_eq!(c.map().owner(cachelet), (0, 2));
}

#[test]
fn a_move_that_cannot_be_made_here_is_answered_at_once() {
    let mut c: ControlCore<u32> =
        ControlCore::new(CoreSettings { server: 0, workers: WORKERS, balance_every: 1, balancer: None }, map(2));
    let theirs = c.map().cachelets_of(1, 0)[0];
    let ours = c.map().cachelets_of(0, 3)[0];
    let not_here = |to| vec![Command::Reply { to, answer: MoveAnswer::NotHere }];
    assert_eq!(c.step(Event::MoveAsked { cachelet: theirs, to: 1, reply: 1 }), not_here(1));
    assert_eq!(c.step(Event::MoveAsked { cachelet: ours, to: WORKERS, reply: 2 }), not_here(2));
    assert_eq!(c.step(Event::MoveAsked { cachelet: 1 << 20, to: 0, reply: 3 }), not_here(3));
    assert_eq!(
        c.step(Event::MoveAsked { cachelet: ours, to: 3, reply: 4 }),
        vec![Command::Reply { to: 4, answer: MoveAnswer::Moved { epoch: 1 } }],
        "already there"
    );
}
