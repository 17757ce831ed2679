//! The controller as an adapter, without a socket or a thread: a `Shared` built by hand
//! (`Shared::new`), the workers' channels held by the test, messages scripted in with
//! `Controller::handle` and `step`, and the envelopes that come out read off the channels.
//! The decisions themselves are the core's (`mbal_balance::control`'s tests); these check
//! that each message becomes the core's event and each command the right envelope.

use super::*;
use crate::config::Settings;
use crate::msg::{Envelope, Mailbox, Peers};
use crate::shared::Parts;
use mbal_balance::WorkerSample;
use mbal_cluster::ServerInfo;
use std::net::SocketAddr;

const WORKERS: usize = 2;

/// A controller whose workers are the test: their channels and mailboxes (the polls stay
/// alive for the wakers).
struct Rig {
    ctl: Controller,
    shared: Arc<Shared>,
    workers: Vec<crossbeam_channel::Receiver<Envelope>>,
    _polls: Vec<mio::Poll>,
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// `servers` servers of two workers each; this one is server 0.
fn map(servers: u16) -> ClusterMap {
    let infos =
        (0..servers).map(|s| ServerInfo { main: addr(11211 + s), workers: vec![addr(11211 + s); WORKERS] }).collect();
    ClusterMap::even(infos, 4, 256)
}

fn rig(tweak: impl FnOnce(&mut Settings), map: ClusterMap) -> Rig {
    rig_with(tweak, map, None, None)
}

/// With Phase 1: the replicator's and the slot thread's queues held by the test.
fn rig_with(
    tweak: impl FnOnce(&mut Settings),
    map: ClusterMap,
    replicator: Option<crossbeam_channel::Sender<crate::msg::ReplicaJob>>,
    slot_asks: Option<crossbeam_channel::Sender<crate::msg::Ask>>,
) -> Rig {
    let mut settings = Settings { threads: WORKERS, port: 0, epoch_ms: 100, ..Settings::default() };
    tweak(&mut settings);
    let (control, inbox) = crossbeam_channel::unbounded();
    let parts = Parts {
        server_id: 0,
        control,
        main_addr: addr(11211),
        start: Instant::now(),
        start_unix: 0,
        tls: None,
        replicator,
        forward: None,
        threads: crate::threads::Threads::new(1, WORKERS, false).unwrap(),
        lease_until_ns: u64::MAX,
    };
    let (shared, _ended) = Shared::new(settings, &map, parts);
    let shared = Arc::new(shared);
    let (mut senders, mut mailboxes, mut workers, mut polls) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..WORKERS {
        let (tx, rx) = crossbeam_channel::unbounded();
        let poll = mio::Poll::new().unwrap();
        mailboxes.push(Arc::new(Mailbox::new(mio::Waker::new(poll.registry(), mio::Token(0)).unwrap())));
        senders.push(tx);
        workers.push(rx);
        polls.push(poll);
    }
    assert!(shared.peers.set(Peers { senders, mailboxes }).is_ok());
    let ctl = Controller::new(shared.clone(), inbox, map, slot_asks, None);
    Rig { ctl, shared, workers, _polls: polls }
}

/// What an envelope is, in a word or two, for comparing what a worker got.
fn describe(e: &Envelope) -> String {
    match e {
        Envelope::Replies(b) => {
            let texts: Vec<String> = b.iter().map(|(_, d)| String::from_utf8_lossy(d).into_owned()).collect();
            format!("replies {}", texts.join("|"))
        }
        Envelope::Reqs(_) => "reqs".into(),
        Envelope::Conn(_) => "conn".into(),
        Envelope::Own(OwnMsg::Release { cachelet, to, .. }) => format!("release {cachelet} to {to}"),
        Envelope::Own(OwnMsg::Reassign { cachelet, server, worker, .. }) => {
            format!("reassign {cachelet} to {server}.{worker}")
        }
        Envelope::Own(OwnMsg::Applied { seq }) => format!("applied? {seq}"),
        Envelope::Own(_) => "own".into(),
        Envelope::Ctl(CtlCmd::Sample { seq }) => format!("sample {seq}"),
        Envelope::Ctl(CtlCmd::Hot(HotCmd::Replicate { key, replicas })) => {
            format!("replicate {} x{replicas}", String::from_utf8_lossy(key))
        }
        Envelope::Ctl(CtlCmd::Hot(HotCmd::Grants(g))) => format!("grants {}", g.len()),
        Envelope::Ctl(CtlCmd::Hot(_)) => "hot".into(),
        Envelope::Ctl(_) => "ctl".into(),
        Envelope::Mig(_) => "mig".into(),
    }
}

impl Rig {
    /// Everything worker `w` was sent since the last look.
    fn got(&self, w: usize) -> Vec<Envelope> {
        self.workers[w].try_iter().collect()
    }

    fn got_words(&self, w: usize) -> Vec<String> {
        self.got(w).iter().map(describe).collect()
    }

    /// Every worker's answer to sampling round `seq` (no load).
    fn answer_round(&mut self, seq: u64) {
        for w in 0..WORKERS {
            let cachelets = self.ctl.core.map().cachelets_of(0, w as u16);
            let sample = WorkerSample {
                worker: w as u16,
                at_ns: self.shared.clock_ns(),
                cachelets: cachelets
                    .into_iter()
                    .map(|id| mbal_balance::snapshot::CacheletSample { id, ..Default::default() })
                    .collect(),
                ..WorkerSample::default()
            };
            let msg = CtlMsg::Sample { seq, sample: Box::new(sample), keys: Vec::new(), home_reads: Vec::new() };
            self.ctl.handle(msg);
        }
    }
}

fn reply_to(worker: usize, seq: u64) -> ReplyTo {
    ReplyTo { worker, conn: 3, gen: 1, seq }
}

#[test]
fn the_start_and_each_tick_ask_every_worker_for_a_sample_and_their_answers_close_an_epoch() {
    let mut r = rig(|_| {}, map(1));
    r.ctl.step(Event::Start);
    for w in 0..WORKERS {
        assert_eq!(r.got_words(w), ["sample 0"], "worker {w}");
    }
    // A tick while round 0 is open asks for nothing more.
    r.ctl.step(Event::Tick);
    assert!(r.got(0).is_empty() && r.got(1).is_empty());
    // `mbal load` waits for an epoch after round 0's baseline.
    r.ctl.handle(CtlMsg::Load { after: 0, reply: reply_to(1, 7) });
    r.answer_round(0);
    assert!(r.got(1).is_empty(), "round 0 is the baseline, no epoch yet");
    r.ctl.step(Event::Tick);
    for w in 0..WORKERS {
        assert_eq!(r.got_words(w), ["sample 1"], "worker {w}");
    }
    r.answer_round(1);
    let latest = r.shared.latest.lock().unwrap().clone().expect("epoch 1 published");
    assert_eq!(latest.seq, 1);
    let [Envelope::Replies(b)] = &r.got(1)[..] else { panic!("one reply batch to the waiting connection") };
    let (item, bytes) = b.iter().next().unwrap();
    assert_eq!(item.to, reply_to(1, 7));
    assert!(bytes.starts_with(b"LOAD 1 "), "{}", String::from_utf8_lossy(bytes));
    // Later callers get the kept epoch at once.
    r.ctl.handle(CtlMsg::Load { after: 0, reply: reply_to(0, 8) });
    let words = r.got_words(0);
    assert!(words.len() == 1 && words[0].starts_with("replies LOAD 1 "), "{words:?}");
}

#[test]
fn a_move_releases_the_cachelet_at_its_owner_and_answers_once_the_adopter_has_it() {
    let mut r = rig(|_| {}, map(1));
    let c = r.ctl.core.map().cachelets_of(0, 0)[0];
    let epoch = r.shared.epoch.load(Ordering::Relaxed);
    r.ctl.handle(CtlMsg::Move { cachelet: c, to: 1, reply: reply_to(1, 9) });
    let out = r.got(0);
    let [Envelope::Own(OwnMsg::Release { cachelet, to: 1, token })] = out[..] else {
        panic!("{:?}", out.iter().map(describe).collect::<Vec<_>>())
    };
    assert_eq!(cachelet, c);
    assert!(r.got(1).is_empty(), "nothing until the move ends");
    // The adopter's notice ends it: the waiting connection hears `MOVED <epoch>`, and the
    // epoch redirects read is raised.
    r.ctl.handle(CtlMsg::Moved { token, cachelet: c, worker: 1 });
    assert_eq!(r.got_words(1), [format!("replies MOVED {}\r\n", epoch + 1)]);
    assert_eq!(r.shared.epoch.load(Ordering::Relaxed), epoch + 1);
    assert_eq!(r.ctl.core.map().owner(c), (0, 1));
}

#[test]
fn asks_the_core_refuses_are_answered_with_memcached_style_errors() {
    let mut r = rig(|_| {}, map(2));
    let theirs = r.ctl.core.map().cachelets_of(1, 0)[0];
    r.ctl.handle(CtlMsg::Move { cachelet: theirs, to: 1, reply: reply_to(0, 1) });
    // A worker index past u16 is no worker.
    let ours = r.ctl.core.map().cachelets_of(0, 0)[0];
    r.ctl.handle(CtlMsg::Move { cachelet: ours, to: usize::MAX, reply: reply_to(0, 2) });
    // Another server's cachelet cannot move without a coordinator.
    r.ctl.handle(CtlMsg::Migrate { cachelet: ours, server: 1, worker: 0, addr: None, reply: reply_to(0, 3) });
    // Phase 1 is off: nothing to pin, no slots to lend.
    r.ctl.handle(CtlMsg::Pin { key: b"k".to_vec().into(), replicas: 2, reply: reply_to(0, 4) });
    r.ctl.handle(CtlMsg::Lend { borrower: 1, slots: 3, lease_ms: 100, reply: reply_to(0, 5) });
    let words = r.got_words(0);
    assert_eq!(
        words,
        [
            "replies CLIENT_ERROR cachelet is not on this server\r\n",
            "replies CLIENT_ERROR cachelet is not on this server\r\n",
            "replies CLIENT_ERROR moving a cachelet to another server needs a coordinator\r\n",
            "replies CLIENT_ERROR hot-key replication is off\r\n",
            "replies SLOTS 0 100\r\n",
        ]
    );
    assert!(r.got(1).is_empty(), "no worker was told to move anything");
}

#[test]
fn a_map_ask_is_answered_with_the_cores_map() {
    let mut r = rig(|_| {}, map(2));
    r.ctl.handle(CtlMsg::Map { have: None, reply: reply_to(1, 4) });
    let out = r.got(1);
    let [Envelope::Replies(b)] = &out[..] else { panic!("one reply") };
    let (_, bytes) = b.iter().next().unwrap();
    let text = String::from_utf8_lossy(bytes);
    let (head, json) = text.split_once("\r\n").unwrap();
    let epoch = r.ctl.core.map().epoch();
    assert!(head.starts_with(&format!("MAP {epoch} ")), "{head}");
    let back = ClusterMap::from_json(json.trim_end()).unwrap();
    assert_eq!(back.owners(), r.ctl.core.map().owners());
    // Asked with the epoch the asker has: no JSON unless the map is newer.
    for (have, whole) in [(epoch, false), (epoch + 1, false), (epoch - 1, true)] {
        r.ctl.handle(CtlMsg::Map { have: Some(have), reply: reply_to(1, 4) });
        let out = r.got(1);
        let [Envelope::Replies(b)] = &out[..] else { panic!("one reply") };
        let (_, bytes) = b.iter().next().unwrap();
        let text = String::from_utf8_lossy(bytes);
        if whole {
            assert_eq!(text.len(), head.len() + json.len() + 2, "have {have}: the whole map");
        } else {
            assert_eq!(text, format!("MAP {epoch} 0\r\n\r\n"), "have {have}");
        }
    }
}

#[test]
fn a_coordinators_map_reassigns_at_every_worker_new_owner_first_and_a_reset_waits_for_all() {
    let before = map(2);
    let mut r = rig(|s| s.coordinator = vec![addr(2379)], before.clone());
    // The coordinator gives one of server 1's cachelets to worker 1 here, and adds a server.
    let theirs = before.cachelets_of(1, 0)[0];
    let mut next = before.clone();
    next.add_server(ServerInfo { main: addr(11300), workers: vec![addr(11300); 3] });
    next.reassign(&[(theirs, (0, 1))]).unwrap();
    r.ctl.handle(CtlMsg::CoordMap { map: Box::new(next.clone()), reset: false });
    let to = format!("reassign {theirs} to 0.1");
    assert_eq!(r.got_words(1), [to.clone(), "applied? 1".into()], "the new owner");
    assert_eq!(r.got_words(0), [to, "applied? 1".into()]);
    assert_eq!(r.shared.epoch.load(Ordering::Relaxed), next.epoch());
    assert_eq!(r.shared.members.read().unwrap().len(), 3, "the servers the threads dial follow the map");
    assert!(!r.shared.resetting.load(Ordering::Acquire));

    // Declared dead and registered again: the map reclaims every cachelet of this server
    // (their items are dropped), and the lease is renewed only once every worker applied it.
    r.shared.resetting.store(true, Ordering::Release);
    r.ctl.handle(CtlMsg::CoordMap { map: Box::new(next.clone()), reset: true });
    let ours = (0..WORKERS as u16).map(|w| next.cachelets_of(0, w).len()).sum::<usize>();
    for w in 0..WORKERS {
        let words = r.got_words(w);
        assert_eq!(words.len(), ours + 1, "worker {w}: {words:?}");
        assert!(words[..ours].iter().all(|x| x.starts_with("reassign ")), "{words:?}");
        assert_eq!(words[ours], "applied? 2");
    }
    r.ctl.handle(CtlMsg::Applied { seq: 1 });
    r.ctl.handle(CtlMsg::Applied { seq: 2 });
    assert!(r.shared.resetting.load(Ordering::Acquire), "an older map's answer does not count");
    r.ctl.handle(CtlMsg::Applied { seq: 2 });
    assert!(!r.shared.resetting.load(Ordering::Acquire));

    // An older map changes nothing.
    r.ctl.handle(CtlMsg::CoordMap { map: Box::new(before), reset: false });
    assert_eq!(r.got_words(0), ["applied? 3"]);
    assert_eq!(r.ctl.core.map().owner(theirs), (0, 1));
}

#[test]
fn a_map_older_than_an_arrivals_commit_leaves_the_cachelet_where_it_arrived() {
    // One of ours moved to server 1 (epoch e+1) and straight back to worker 1 here (committed
    // at e+2); the beat's answer carrying e+1 comes only after the cachelet arrived.
    let before = map(2);
    let mut r = rig(|s| s.coordinator = vec![addr(2379)], before.clone());
    let c = before.cachelets_of(0, 0)[0];
    let (mut away, mut back) = (before.clone(), before.clone());
    let e1 = away.reassign(&[(c, (1, 0))]).unwrap();
    back.reassign(&[(c, (1, 0))]).unwrap();
    let e2 = back.reassign(&[(c, (0, 1))]).unwrap();
    r.ctl.handle(CtlMsg::Arrived { cachelet: c, worker: 1, epoch: e2 });
    r.ctl.handle(CtlMsg::CoordMap { map: Box::new(away), reset: false });
    for w in 0..WORKERS {
        assert_eq!(r.got_words(w), ["applied? 1"], "worker {w}: nothing reassigned");
    }
    assert_eq!(r.ctl.core.map().owner(c), (0, 1), "the core's map has it here");
    assert_eq!(r.ctl.core.map().epoch(), e1);
    // The map of the commit changes nothing more; an arrival it shows is forgotten.
    r.ctl.handle(CtlMsg::CoordMap { map: Box::new(back.clone()), reset: false });
    for w in 0..WORKERS {
        assert_eq!(r.got_words(w), ["applied? 2"], "worker {w}");
    }
    assert!(r.ctl.arrived.is_empty());
    // Without the commit's epoch (0), an older map is followed as before.
    let mut later = back.clone();
    later.reassign(&[(c, (1, 1))]).unwrap();
    r.ctl.handle(CtlMsg::Arrived { cachelet: c, worker: 1, epoch: 0 });
    r.ctl.handle(CtlMsg::CoordMap { map: Box::new(later), reset: false });
    assert_eq!(r.got_words(1), [format!("reassign {c} to 1.1"), "applied? 3".into()]);
}

#[test]
fn phase_1s_commands_reach_the_home_worker_and_the_slot_thread() {
    let (rep_tx, _rep_rx) = crossbeam_channel::unbounded();
    let (ask_tx, ask_rx) = crossbeam_channel::unbounded();
    let m = map(2);
    let mut r = rig_with(|s| s.hot.enabled = true, m.clone(), Some(rep_tx), Some(ask_tx));
    r.ctl.step(Event::Start);
    for w in 0..WORKERS {
        assert_eq!(r.got_words(w), ["sample 0"], "worker {w}");
    }
    // A starting server asks the other how many of its slots it holds.
    let asks: Vec<u16> = ask_rx.try_iter().map(|a| a.peer()).collect();
    assert_eq!(asks, [1]);
    // `mbal debug hot <key> 2` for a key homed here: its home worker makes the copies, and
    // the caller is answered once they are made.
    let (key, home) = (0..)
        .map(|i| format!("key{i}").into_bytes())
        .find_map(|k| {
            let (s, w) = m.owner(m.keyspace().cachelet_of_hash(mbal_cluster::key_hash(&k)));
            (s == 0).then_some((k, usize::from(w)))
        })
        .unwrap();
    let name = String::from_utf8_lossy(&key).into_owned();
    r.ctl.handle(CtlMsg::Pin { key: key.clone().into(), replicas: 2, reply: reply_to(1 - home, 5) });
    assert_eq!(r.got_words(home), [format!("replicate {name} x2")]);
    assert!(r.got(1 - home).is_empty(), "no answer before the copies exist");
    let at_ns = r.shared.clock_ns();
    r.ctl.handle(CtlMsg::HotDone { key: key.into(), created: true, ok: true, at_ns, copy_reads: 0 });
    assert_eq!(r.got_words(1 - home), ["replies OK\r\n"]);
    assert_eq!(r.shared.hot_status().copies_made, 1, "`stats hotkeys` sees the copies");
    // `mbal debug slots 500`: more keys than this server's share of REPL_high, so it asks
    // the other server, which said it has slots to spare, to lend some.
    let hot = mbal_balance::PeerHot { spare: 40, heat: Default::default() };
    r.ctl.handle(CtlMsg::PeerLoad { server: 1, mean: 0.0, hot: Some(hot) });
    r.ctl.handle(CtlMsg::DebugSlots { demand: 500, reply: reply_to(0, 6) });
    assert!(r.got_words(0).contains(&"replies OK\r\n".to_string()));
    let asks: Vec<u16> = ask_rx.try_iter().map(|a| a.peer()).collect();
    assert!(asks.contains(&1), "{asks:?}");
}
