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
        epoch_ms: 1000,
        hot: None,
        coordinated: false,
    };
    ControlCore::new(settings, map(1), 0)
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
                Event::Sample { seq, sample, keys: Vec::new(), home_reads: Vec::new() }
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
    for epoch in 0..=epochs {
        pending.push_back(if epoch == 0 { Event::Start } else { Event::Tick });
        while let Some(e) = pending.pop_front() {
            for c in core.step(workers.now_s * 1_000_000_000, e) {
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
            Command::Epoch(e) => e.balancer.as_ref().map(|d| (e.snapshot.seq, d)),
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
    let epochs = log.iter().filter(|c| matches!(c, Command::Epoch(_))).count();
    assert_eq!(epochs, 12, "every epoch closes, Phase 2 or not");
}

#[test]
fn with_the_balancer_off_epochs_close_and_nothing_moves() {
    let log = run(&mut core(1, false), 6_000, 5);
    assert_eq!(log.iter().filter(|c| matches!(c, Command::Epoch(e) if e.balancer.is_none())).count(), 5);
    assert!(!log.iter().any(|c| matches!(c, Command::Release { .. } | Command::Status(_))));
}

#[test]
fn a_tick_while_a_round_is_open_starts_none() {
    let mut c = core(1, true);
    assert_eq!(c.step(0, Event::Tick), vec![Command::SampleWorkers { seq: 0 }]);
    assert!(c.gathering());
    assert!(c.step(0, Event::Tick).is_empty(), "round 0 still open");
    // A sample of another round is ignored.
    let s = WorkerSample { worker: 0, ..WorkerSample::default() };
    assert!(c.step(0, Event::Sample { seq: 7, sample: s, keys: Vec::new(), home_reads: Vec::new() }).is_empty());
}

#[test]
fn moves_asked_for_a_moving_cachelet_wait_their_turn() {
    let mut c = core(1, false);
    let cachelet = c.map().cachelets_of(0, 0)[0];
    let out = c.step(0, Event::MoveAsked { cachelet, to: 1, reply: 10 });
    let [Command::Release { token: t1, from: 0, to: 1, .. }] = out[..] else { panic!("{out:?}") };
    // Another destination waits; the same one again joins the first.
    assert!(c.step(0, Event::MoveAsked { cachelet, to: 2, reply: 11 }).is_empty());
    assert!(c.step(0, Event::MoveAsked { cachelet, to: 1, reply: 12 }).is_empty());
    let out = c.step(0, Event::Moved { token: t1, cachelet, worker: 1 });
    let moved = Answer::Moved { epoch: 2 };
    assert_eq!(out[0], Command::MapEpoch(2));
    assert_eq!(out[1], Command::Reply { to: 10, answer: moved });
    assert_eq!(out[2], Command::Reply { to: 12, answer: moved });
    let Command::Release { token: t2, from: 1, to: 2, .. } = out[3] else { panic!("{out:?}") };
    assert_eq!(out.len(), 4);
    let out = c.step(0, Event::Moved { token: t2, cachelet, worker: 2 });
    assert_eq!(out, vec![Command::MapEpoch(3), Command::Reply { to: 11, answer: Answer::Moved { epoch: 3 } }]);
    assert_eq!(c.map().owner(cachelet), (0, 2));
}

#[test]
fn a_move_the_owner_refused_is_answered_as_stayed_and_the_map_keeps_the_owner() {
    let mut c = core(1, false);
    let cachelet = c.map().cachelets_of(0, 0)[0];
    let out = c.step(0, Event::MoveAsked { cachelet, to: 1, reply: 10 });
    let [Command::Release { token, from: 0, to: 1, .. }] = out[..] else { panic!("{out:?}") };
    // The owning worker kept it (it was migrating to another server): `Moved` names worker 0.
    let out = c.step(0, Event::Moved { token, cachelet, worker: 0 });
    assert!(out.contains(&Command::Reply { to: 10, answer: Answer::Stayed }), "{out:?}");
    assert!(!out.iter().any(|o| matches!(o, Command::Reply { answer: Answer::Moved { .. }, .. })), "{out:?}");
    assert_eq!(c.map().owner(cachelet), (0, 0));
}

#[test]
fn a_move_that_cannot_be_made_here_is_answered_at_once() {
    let mut c: ControlCore<u32> = ControlCore::new(
        CoreSettings {
            server: 0,
            workers: WORKERS,
            balance_every: 1,
            balancer: None,
            epoch_ms: 1000,
            hot: None,
            coordinated: false,
        },
        map(2),
        0,
    );
    let theirs = c.map().cachelets_of(1, 0)[0];
    let ours = c.map().cachelets_of(0, 3)[0];
    let not_here = |to| vec![Command::Reply { to, answer: Answer::NotHere }];
    assert_eq!(c.step(0, Event::MoveAsked { cachelet: theirs, to: 1, reply: 1 }), not_here(1));
    assert_eq!(c.step(0, Event::MoveAsked { cachelet: ours, to: WORKERS, reply: 2 }), not_here(2));
    assert_eq!(c.step(0, Event::MoveAsked { cachelet: 1 << 20, to: 0, reply: 3 }), not_here(3));
    assert_eq!(
        c.step(0, Event::MoveAsked { cachelet: ours, to: 3, reply: 4 }),
        vec![Command::Reply { to: 4, answer: Answer::Moved { epoch: 1 } }],
        "already there"
    );
}

// ---- Phase 1 through the core ------------------------------------------

use crate::hot::HotConfig;

/// Server 0 of 8 servers x 2 workers with Phase 1 (every request sampled,
/// no decay) and no slot lending.
fn hot_core() -> ControlCore<u32> {
    let policy = HotConfig { sample_rate: 1.0, sample_target: 0.0, decay: 0.0, ..HotConfig::default() };
    let hot = HotSettings { policy, balance: Config::default(), copy_ttl_ms: 3_000, lend_slots: false };
    let servers = (0..8u16)
        .map(|s| ServerInfo {
            main: format!("127.0.0.1:{}", 31000 + s * 10).parse().unwrap(),
            workers: (0..2u16).map(|w| format!("127.0.0.1:{}", 31001 + s * 10 + w).parse().unwrap()).collect(),
        })
        .collect();
    let settings = CoreSettings {
        server: 0,
        workers: 2,
        balance_every: 1,
        balancer: None,
        epoch_ms: 1000,
        hot: Some(hot),
        coordinated: false,
    };
    ControlCore::new(settings, ClusterMap::even(servers, 4, 1024), 0)
}

/// One epoch of server 0: worker 0 serves 2,500 reads/s, 1,600 of them of
/// `key` (sampled), worker 1 900/s of one-off keys; every other server
/// says its workers carry 1,000/s. The commands of the epoch's close.
fn hot_epoch(c: &mut ControlCore<u32>, epoch: u64, key: &[u8], reads: &mut [u64; 2]) -> Vec<Command<u32>> {
    let at = epoch * 1_000_000_000;
    for s in 1..8 {
        assert!(c.step(at, Event::PeerLoad { server: s, mean: 1_000.0, hot: None }).is_empty());
    }
    let rates = [2_500u64, 900];
    let mut out = Vec::new();
    for w in 0..2u16 {
        reads[usize::from(w)] += rates[usize::from(w)];
        let mine = c.map().cachelets_of(0, w);
        let n = mine.len() as u64;
        let cachelets = mine
            .iter()
            .map(|&id| CacheletSample { id, reads: reads[usize::from(w)] / n, ..CacheletSample::default() })
            .collect();
        let sample = WorkerSample { worker: w, at_ns: at, cachelets, ..WorkerSample::default() };
        let keys: Vec<SampledKey> = if w == 0 {
            (0..1_600).map(|_| (key.into(), false)).collect()
        } else {
            (0..200).map(|j| (format!("cold{epoch}-{j}").into_bytes().into(), false)).collect()
        };
        out.extend(c.step(at, Event::Sample { seq: epoch, sample, keys, home_reads: Vec::new() }));
    }
    out
}

#[test]
fn phase_1_replicates_a_hot_key_and_grants_leases_once_its_copies_are_made() {
    let mut c = hot_core();
    assert_eq!(c.step(0, Event::Start), vec![Command::SampleWorkers { seq: 0 }], "no slots to ask for");
    let mut reads = [0u64; 2];
    hot_epoch(&mut c, 0, b"none", &mut reads);
    assert_eq!(c.step(1_000_000_000, Event::Tick), vec![Command::SampleWorkers { seq: 1 }]);
    let out = hot_epoch(&mut c, 1, b"hot", &mut reads);
    let replicas = out
        .iter()
        .find_map(|c| match c {
            Command::Hot { worker: 0, cmd: HotCommand::Replicate { key, replicas } } if &**key == b"hot" => {
                Some(*replicas)
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no copies asked for: {out:?}"));
    let Some(Command::Epoch(e)) = out.last() else { panic!("{out:?}") };
    let d = e.hot.as_ref().expect("Phase 1 decided");
    assert_eq!(d.hot_workers, vec![0]);
    assert_eq!(c.hot_avg(), 1_000.0 * 7.0 / 8.0 + (2_500.0 + 900.0) / 2.0 / 8.0, "the cluster's mean from the peers");
    // Every worker hears the alarm limit and, the first time, the rate.
    for w in 0..2 {
        assert!(out
            .iter()
            .any(|c| matches!(c, Command::Hot { worker, cmd: HotCommand::SampleRate(_) } if *worker == w)));
    }
    // No lease until the copies are made; then one until they expire.
    assert!(!out
        .iter()
        .any(|c| matches!(c, Command::Hot { cmd: HotCommand::Grants(g), .. } if g.iter().any(|x| x.1.is_some()))));
    let made_at = 1_200_000_000;
    let out = c.step(
        made_at,
        Event::HotDone { key: (*b"hot").into(), created: true, ok: true, at_ns: made_at, copy_reads: 0 },
    );
    assert!(matches!(&out[0], Command::HotStatus(st) if st.copies_made == 1));
    let until = made_at + 3_000_000_000 - 50_000_000;
    let grants = vec![((*b"hot").into(), Some((replicas, until)))];
    assert_eq!(out[1], Command::Hot { worker: 0, cmd: HotCommand::Grants(grants) });
    // The next epoch renews the copies it made, where they live.
    assert_eq!(c.step(2_000_000_000, Event::Tick), vec![Command::SampleWorkers { seq: 2 }]);
    let out = hot_epoch(&mut c, 2, b"hot", &mut reads);
    let Some(Command::Renew { key, to, ttl_ms: 3_000, at_ns: 2_000_000_000 }) =
        out.iter().find(|c| matches!(c, Command::Renew { .. }))
    else {
        panic!("no renewal: {out:?}")
    };
    assert_eq!(&**key, b"hot");
    assert_eq!(to.len(), replicas as usize);
    assert!(to.iter().all(|&(s, w)| s != 0 && w < 2), "copies on other servers: {to:?}");
}

#[test]
fn phase_1_runs_the_same_way_twice() {
    let run = || {
        let mut c = hot_core();
        let mut log = c.step(0, Event::Start);
        let mut reads = [0u64; 2];
        for e in 0..6u64 {
            if e > 0 {
                log.extend(c.step(e * 1_000_000_000, Event::Tick));
            }
            log.extend(hot_epoch(&mut c, e, b"hot", &mut reads));
            let at = e * 1_000_000_000 + 1;
            log.extend(c.step(
                at,
                Event::HotDone { key: (*b"hot").into(), created: e == 1, ok: true, at_ns: at, copy_reads: 40 },
            ));
        }
        log
    };
    assert_eq!(run(), run());
}

#[test]
fn pins_and_slot_questions_are_answered_by_the_core() {
    let mut c = hot_core();
    c.step(0, Event::Start);
    // A key homed on another server cannot be pinned here.
    let elsewhere =
        (0..).map(|i| format!("k{i}")).find(|k| c.map().route(mbal_cluster::key_hash(k.as_bytes())).1 != 0).unwrap();
    let out = c.step(1, Event::Pin { key: elsewhere.as_bytes().into(), replicas: 2, reply: 7 });
    assert_eq!(out, vec![Command::Reply { to: 7, answer: Answer::KeyElsewhere }]);
    // A key homed here: the copies are asked for, the answer waits for them.
    let mine =
        (0..).map(|i| format!("k{i}")).find(|k| c.map().route(mbal_cluster::key_hash(k.as_bytes())).1 == 0).unwrap();
    let out = c.step(2, Event::Pin { key: mine.as_bytes().into(), replicas: 2, reply: 8 });
    assert!(matches!(&out[..], [Command::Hot { cmd: HotCommand::Replicate { replicas: 2, .. }, .. }]), "{out:?}");
    let out =
        c.step(3, Event::HotDone { key: mine.as_bytes().into(), created: true, ok: true, at_ns: 3, copy_reads: 0 });
    assert_eq!(out.last(), Some(&Command::Reply { to: 8, answer: Answer::Ok }));
    // Without lending, slots are neither lent nor asked for.
    let out = c.step(4, Event::Lend { borrower: 1, slots: 3, lease_ms: 10_000, reply: 9 });
    assert_eq!(out, vec![Command::Reply { to: 9, answer: Answer::Slots { granted: 0, lease_ms: 4_000 } }]);
    let out = c.step(5, Event::DebugSlots { demand: 5, reply: 10 });
    assert_eq!(out, vec![Command::Reply { to: 10, answer: Answer::NoSlots }]);
    assert_eq!(
        c.step(6, Event::Held { lender: 1, reply: 11 }),
        vec![Command::Reply { to: 11, answer: Answer::Held(0) }]
    );
}

#[test]
fn a_lending_server_asks_the_others_what_they_hold_until_all_have_said() {
    let policy = HotConfig::default();
    let hot = HotSettings { policy, balance: Config::default(), copy_ttl_ms: 3_000, lend_slots: true };
    let m = hot_core().map().clone();
    let settings = CoreSettings {
        server: 2,
        workers: 2,
        balance_every: 1,
        balancer: None,
        epoch_ms: 500,
        hot: Some(hot),
        coordinated: false,
    };
    let mut c: ControlCore<u32> = ControlCore::new(settings, m, 0);
    let out = c.step(0, Event::Start);
    let asked: Vec<u16> =
        out.iter().filter_map(|c| if let Command::AskHeld { peer } = c { Some(*peer) } else { None }).collect();
    assert_eq!(asked, vec![0, 1, 3, 4, 5, 6, 7], "everyone but itself");
    assert_eq!(c.hot_status().slots_lent, 0, "before the first cap");
    for p in [0u16, 1, 3, 4, 5, 6] {
        assert!(c.step(1, Event::PeerHolds { peer: p, held: Some(0) }).is_empty());
    }
    let out = c.step(1, Event::PeerHolds { peer: 7, held: Some(2) });
    let Some(Command::HotStatus(st)) = out.last() else { panic!("{out:?}") };
    assert_eq!(st.slots_lent, 2, "only what the others said they hold counts as lent");
    // Every one said: the next tick asks nobody what it holds.
    let out = c.step(500_000_000, Event::Tick);
    assert!(!out.iter().any(|c| matches!(c, Command::AskHeld { .. })), "{out:?}");
}

/// A coordinated core of server 1 of a 3-server map.
fn coordinated_core() -> ControlCore<u32> {
    let settings = CoreSettings {
        server: 1,
        workers: WORKERS,
        balance_every: 1,
        balancer: Some(Config::default()),
        epoch_ms: 1000,
        hot: None,
        coordinated: true,
    };
    ControlCore::new(settings, map(3), 0)
}

fn reassigns(log: &[Command<u32>]) -> Vec<(u32, (u16, u16))> {
    log.iter()
        .filter_map(|c| match c {
            Command::Reassign { cachelet, owner } => Some((*cachelet, *owner)),
            _ => None,
        })
        .collect()
}

#[test]
fn the_coordinators_map_gives_and_takes_cachelets_and_keeps_local_placement() {
    let mut core = coordinated_core();
    let start = core.map().clone();
    let mine: Vec<u32> = start.cachelets_of(1, 0);
    let dead: Vec<u32> = start.cachelets_of(2, 1);
    // A local move (worker 0 -> 1 of this server) changes the map here without an epoch and
    // is reported.
    let c = mine[0];
    let log = core.step(1, Event::MoveAsked { cachelet: c, to: 1, reply: 7 });
    let token = match log[0] {
        Command::Release { token, .. } => token,
        ref other => panic!("{other:?}"),
    };
    let log = core.step(2, Event::Moved { token, cachelet: c, worker: 1 });
    assert!(log.contains(&Command::ReportMove { cachelet: c, worker: 1 }));
    assert!(log.contains(&Command::Reply { to: 7, answer: Answer::Moved { epoch: 1 } }));
    assert_eq!(core.map().epoch(), 1, "the coordinator numbers epochs");
    // The coordinator (not yet told of the move) gives server 2's worker-1 cachelets to
    // server 1 worker 0 and server 0 worker 1.
    let mut next = start.clone();
    for (i, &d) in dead.iter().enumerate() {
        next.move_cachelet(d, if i % 2 == 0 { (1, 0) } else { (0, 1) });
    }
    let epoch = next.epoch();
    let log = core.step(3, Event::Map { map: next.clone(), reset: false });
    let r = reassigns(&log);
    assert_eq!(r.len(), dead.len(), "every cachelet of the dead worker, nothing else: {r:?}");
    // Those leaving for another server come before those arriving here.
    let first_here = r.iter().position(|(_, o)| o.0 == 1).unwrap();
    assert!(r[first_here..].iter().all(|(_, o)| o.0 == 1));
    assert_eq!(core.map().epoch(), epoch);
    assert_eq!(core.map().owner(c), (1, 1), "the local move is kept over the coordinator's stale view");
    assert!(log.contains(&Command::MapEpoch(epoch)));
    // The same map again, or an older one: nothing.
    assert!(core.step(4, Event::Map { map: next.clone(), reset: false }).is_empty());
    assert!(core.step(4, Event::Map { map: start.clone(), reset: false }).is_empty());
    // Declared dead and back (reset): everything held here is given up, even what comes back.
    let log = core.step(5, Event::Map { map: next.clone(), reset: true });
    let held: usize = (0..WORKERS).map(|w| next.cachelets_of(1, w).len()).sum();
    let r = reassigns(&log);
    assert_eq!(r.len(), held);
    assert!(r.iter().all(|(_, o)| o.0 == 1));
    assert_eq!(core.map().owner(c), next.owner(c), "after a reset the coordinator's placement holds");
}

#[test]
fn a_map_of_another_geometry_is_refused() {
    let mut core = coordinated_core();
    let mut other = map(4);
    other.move_cachelet(0, (3, 0));
    assert!(core.step(1, Event::Map { map: other, reset: false }).is_empty());
    assert_eq!(core.map().epoch(), 1);
}
