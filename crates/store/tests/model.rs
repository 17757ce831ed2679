//! Model-based test: random op sequences against a plain HashMap model.
//! Large memory: exact equality. Small memory: every hit equals the model; a key may vanish
//! only by eviction (the model then forgets it), and the page budget is never exceeded.

use mbal_cluster::key_hash;
use mbal_store::*;
use proptest::prelude::*;
use std::collections::HashMap;

const START: u64 = 1_700_000_000;
const PAGE: usize = 4096;
const NKEYS: u8 = 12;

#[derive(Debug, Clone)]
enum Op {
    Store(u8, Vec<u8>, u32, i64, Mode),
    Cas(u8, Vec<u8>, bool),
    Delete(u8),
    Arith(u8, bool, u64),
    Touch(u8, i64),
    Get(u8),
    Advance(u32),
    Flush(u32),
    Sweep(usize),
}

#[derive(Debug, Clone)]
struct MItem {
    value: Vec<u8>,
    flags: u32,
    exp: u32,
    set_time: u32,
    seq: u64,
    cas: u64,
}

fn value_strategy(big: bool) -> BoxedStrategy<Vec<u8>> {
    let maxlen = if big { 6000 } else { 40 };
    prop_oneof![
        any::<u64>().prop_map(|n| n.to_string().into_bytes()),
        (0u64..200).prop_map(|n| n.to_string().into_bytes()),
        proptest::collection::vec(any::<u8>(), 0..maxlen),
        (0usize..maxlen, any::<u8>()).prop_map(|(n, b)| vec![b; n]),
    ]
    .boxed()
}

fn exp_strategy() -> BoxedStrategy<i64> {
    prop_oneof![
        6 => Just(0i64),
        3 => 1i64..6,
        1 => Just(-1i64),
        1 => Just(START as i64 + 3),   // absolute: now-based second 3
        1 => Just(START as i64 + 100), // absolute future
    ]
    .boxed()
}

fn op_strategy(big: bool) -> BoxedStrategy<Op> {
    let k = 0..NKEYS;
    let mode =
        prop_oneof![Just(Mode::Set), Just(Mode::Add), Just(Mode::Replace), Just(Mode::Append), Just(Mode::Prepend)];
    prop_oneof![
        8 => (k.clone(), value_strategy(big), any::<u32>(), exp_strategy(), mode).prop_map(|(k, v, f, e, m)| Op::Store(k, v, f, e, m)),
        2 => (k.clone(), value_strategy(big), any::<bool>()).prop_map(|(k, v, r)| Op::Cas(k, v, r)),
        2 => k.clone().prop_map(Op::Delete),
        3 => (k.clone(), any::<bool>(), prop_oneof![0u64..10, any::<u64>()]).prop_map(|(k, i, d)| Op::Arith(k, i, d)),
        1 => (k.clone(), exp_strategy()).prop_map(|(k, e)| Op::Touch(k, e)),
        6 => k.prop_map(Op::Get),
        1 => (1u32..4).prop_map(Op::Advance),
        1 => (0u32..3).prop_map(Op::Flush),
        1 => (1usize..200).prop_map(Op::Sweep),
    ]
    .boxed()
}

fn key(k: u8) -> Vec<u8> {
    format!("key:{k}").into_bytes()
}

struct Model {
    items: HashMap<Vec<u8>, MItem>,
    flushes: Vec<(u32, u64)>,
    seq: u64,
}

impl Model {
    fn live(&self, k: &[u8], now: u32) -> Option<&MItem> {
        let it = self.items.get(k)?;
        if it.exp != 0 && it.exp <= now {
            return None;
        }
        for &(at, seq) in &self.flushes {
            if now >= at && (it.set_time < at || (it.set_time == at && it.seq <= seq)) {
                return None;
            }
        }
        Some(it)
    }
    fn purge(&mut self, k: &[u8], now: u32) {
        if self.live(k, now).is_none() {
            self.items.remove(k);
        }
    }
}

fn parse(v: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(v).ok()?;
    let s = s.trim_end_matches([' ', '\r', '\n', '\t']);
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn run(ops: Vec<Op>, mem: usize, exact: bool) -> Result<(), TestCaseError> {
    let g = GlobalPool::new(mem, PAGE);
    let cfg = StoreConfig {
        mem_limit: mem,
        page_size: PAGE,
        max_item_size: 64 * 1024,
        refill_pages: 2,
        local_high_pages: 4,
        global_low_pages: 2,
        start_unix: START,
        worker_id: 1,
        ..Default::default()
    };
    let mut w = WorkerStore::new(g.clone(), cfg, 2);
    w.insert_cachelet(Cachelet::new(0));
    w.insert_cachelet(Cachelet::new(1));
    let mut m = Model { items: HashMap::new(), flushes: Vec::new(), seq: 0 };
    let mut now = 0u32;
    for op in ops {
        let kk = match &op {
            Op::Store(k, ..) | Op::Cas(k, ..) | Op::Delete(k) | Op::Arith(k, ..) | Op::Touch(k, _) | Op::Get(k) => {
                Some(key(*k))
            }
            _ => None,
        };
        let (h, cl) = match &kk {
            Some(k) => {
                let h = key_hash(k);
                (h, (h % 2) as u32)
            }
            None => (0, 0),
        };
        if let Some(k) = &kk {
            m.purge(k, now);
            let present = w.peek(cl, h, k, now).is_some();
            if exact {
                prop_assert_eq!(present, m.items.contains_key(k), "presence of {:?}", op);
            } else if !present {
                m.items.remove(k); // evicted
            } else {
                prop_assert!(m.items.contains_key(k), "store has a key the model lacks: {:?}", op);
            }
        }
        match op {
            Op::Store(_, v, flags, exp, mode) => {
                let k = kk.unwrap();
                let r = w.store(cl, h, &k, &v, flags, exp, mode, None, now);
                let cur = m.items.get(&k).cloned();
                let ok = match mode {
                    Mode::Set => true,
                    Mode::Add => cur.is_none(),
                    _ => cur.is_some(),
                };
                if !ok {
                    prop_assert_eq!(r, StoreResult::NotStored);
                    continue;
                }
                let StoreResult::Stored { cas } = r else {
                    if !exact && r == StoreResult::OutOfMemory {
                        continue;
                    }
                    return Err(TestCaseError::fail(format!("{r:?} for {mode:?}")));
                };
                m.seq += 1;
                let new = match mode {
                    Mode::Append | Mode::Prepend => {
                        let c = cur.unwrap();
                        let value = if mode == Mode::Append { [c.value, v].concat() } else { [v, c.value].concat() };
                        Some(MItem { value, flags: c.flags, exp: c.exp, set_time: now, seq: m.seq, cas })
                    }
                    _ => rel_exptime(exp, now, START).map(|e| MItem {
                        value: v,
                        flags,
                        exp: e,
                        set_time: now,
                        seq: m.seq,
                        cas,
                    }),
                };
                match new {
                    Some(it) => m.items.insert(k, it),
                    None => m.items.remove(&k),
                };
            }
            Op::Cas(_, v, right) => {
                let k = kk.unwrap();
                let cur = m.items.get(&k).cloned();
                let want = match (&cur, right) {
                    (Some(c), true) => c.cas,
                    (Some(c), false) => c.cas ^ 0x10000,
                    (None, _) => 12345 << 16,
                };
                let r = w.store(cl, h, &k, &v, 9, 0, Mode::Set, Some(want), now);
                match cur {
                    None => prop_assert_eq!(r, StoreResult::NotFound),
                    Some(_) if !right => prop_assert_eq!(r, StoreResult::Exists),
                    Some(_) => {
                        let StoreResult::Stored { cas } = r else {
                            prop_assert!(!exact && r == StoreResult::OutOfMemory, "{:?}", r);
                            continue;
                        };
                        m.seq += 1;
                        m.items.insert(k, MItem { value: v, flags: 9, exp: 0, set_time: now, seq: m.seq, cas });
                    }
                }
            }
            Op::Delete(_) => {
                let k = kk.unwrap();
                let r = w.delete(cl, h, &k, None, now);
                let had = m.items.remove(&k).is_some();
                prop_assert_eq!(r, if had { DeleteResult::Deleted } else { DeleteResult::NotFound });
            }
            Op::Arith(_, incr, d) => {
                let k = kk.unwrap();
                let r = w.arith(cl, h, &k, incr, d, now);
                match m.items.get_mut(&k) {
                    None => prop_assert_eq!(r, ArithResult::NotFound),
                    Some(it) => match parse(&it.value) {
                        None => prop_assert_eq!(r, ArithResult::NonNumeric),
                        Some(n) => {
                            let new = if incr { n.wrapping_add(d) } else { n.saturating_sub(d) };
                            let ArithResult::Value { value, cas } = r else {
                                prop_assert!(!exact, "{:?}", r);
                                continue;
                            };
                            prop_assert_eq!(value, new);
                            let digits = new.to_string().into_bytes();
                            m.seq += 1;
                            if digits.len() > it.value.len() {
                                it.set_time = now; // reallocated
                            }
                            it.value = digits;
                            it.seq = m.seq;
                            it.cas = cas;
                        }
                    },
                }
            }
            Op::Touch(_, exp) => {
                let k = kk.unwrap();
                let r = w.touch(cl, h, &k, exp, now).map(|v| v.value.to_vec());
                match m.items.get_mut(&k) {
                    None => prop_assert!(r.is_none()),
                    Some(it) => {
                        prop_assert_eq!(r.as_deref(), Some(&it.value[..]));
                        match rel_exptime(exp, now, START) {
                            Some(e) => it.exp = e,
                            None => {
                                m.items.remove(&k);
                            }
                        }
                    }
                }
            }
            Op::Get(_) => {
                let k = kk.unwrap();
                let r = w.get(cl, h, &k, now).map(|v| (v.value.to_vec(), v.flags, v.cas, v.exptime));
                let e = m.items.get(&k).map(|it| (it.value.clone(), it.flags, it.cas, it.exp));
                prop_assert_eq!(r, e);
            }
            Op::Advance(d) => now += d,
            Op::Flush(d) => {
                w.flush_all(now + d);
                m.flushes.push((now + d, m.seq));
            }
            Op::Sweep(b) => {
                w.sweep(now, b);
            }
        }
        let ps = g.stats();
        prop_assert!(ps.created_pages + ps.large_pages <= ps.total_pages, "{:?}", ps);
        let st = w.stats();
        prop_assert_eq!(ps.outstanding_pages as u64 + ps.large_pages as u64, st.pages_held);
        prop_assert!(st.pages_held as usize <= ps.total_pages);
        let items: u64 = (0..2).map(|c| w.cachelet(c).unwrap().stats().items).sum();
        prop_assert_eq!(items, st.curr_items);
    }
    // final: every model key readable with the model's value (small mode: or evicted)
    for k in 0..NKEYS {
        let k = key(k);
        let h = key_hash(&k);
        m.purge(&k, now);
        let r = w.peek((h % 2) as u32, h, &k, now).map(|v| v.value.to_vec());
        match (r, m.items.get(&k)) {
            (Some(v), Some(it)) => prop_assert_eq!(v, it.value.clone()),
            (None, Some(_)) => prop_assert!(!exact),
            (Some(_), None) => prop_assert!(false, "store has extra key"),
            (None, None) => {}
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn large_memory_exact(ops in proptest::collection::vec(op_strategy(false), 1..300)) {
        run(ops, 64 << 20, true)?;
    }

    #[test]
    fn small_memory_hits_match(ops in proptest::collection::vec(op_strategy(true), 1..400)) {
        run(ops, 5 * PAGE, false)?;
    }
}
