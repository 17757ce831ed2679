use super::*;
use crate::GlobalPool;
use mbal_cluster::key_hash;

const PAGE: usize = 4096;

pub(super) fn mk(mem: usize, f: impl FnOnce(&mut StoreConfig)) -> WorkerStore {
    let mut cfg = StoreConfig {
        mem_limit: mem,
        page_size: PAGE,
        max_item_size: 64 * 1024,
        refill_pages: 4,
        local_high_pages: 8,
        global_low_pages: 4,
        start_unix: 1_000_000_000,
        worker_id: 3,
        ..Default::default()
    };
    f(&mut cfg);
    let g = GlobalPool::new(mem, PAGE);
    let mut w = WorkerStore::new(g, cfg, 4);
    for i in 0..4 {
        w.insert_cachelet(Cachelet::new(i));
    }
    w
}

fn set(w: &mut WorkerStore, k: &str, v: &str, exp: i64, now: u32) -> StoreResult {
    w.store(0, key_hash(k.as_bytes()), k.as_bytes(), v.as_bytes(), 7, exp, Mode::Set, None, now)
}
fn st(w: &mut WorkerStore, k: &str, v: &str, mode: Mode, cas: Option<u64>, now: u32) -> StoreResult {
    w.store(0, key_hash(k.as_bytes()), k.as_bytes(), v.as_bytes(), 7, 0, mode, cas, now)
}
fn get(w: &mut WorkerStore, k: &str, now: u32) -> Option<Vec<u8>> {
    w.get(0, key_hash(k.as_bytes()), k.as_bytes(), now).map(|v| v.value.to_vec())
}
fn cas_of(r: StoreResult) -> u64 {
    match r {
        StoreResult::Stored { cas } => cas,
        o => panic!("not stored: {o:?}"),
    }
}

#[test]
fn set_get_overwrite_delete() {
    let mut w = mk(1 << 20, |_| {});
    assert!(get(&mut w, "a", 0).is_none());
    cas_of(set(&mut w, "a", "1", 0, 0));
    assert_eq!(get(&mut w, "a", 0).unwrap(), b"1");
    cas_of(set(&mut w, "a", "22", 0, 0));
    let v = w.get(0, key_hash(b"a"), b"a", 0).unwrap();
    assert_eq!(v.value, b"22");
    assert_eq!(v.flags, 7);
    assert!(!v.fetched_before);
    assert!(w.get(0, key_hash(b"a"), b"a", 0).unwrap().fetched_before);
    assert_eq!(w.stats().curr_items, 1);
    assert_eq!(w.delete(0, key_hash(b"a"), b"a", None, 0), DeleteResult::Deleted);
    assert_eq!(w.delete(0, key_hash(b"a"), b"a", None, 0), DeleteResult::NotFound);
    assert!(get(&mut w, "a", 0).is_none());
    let s = w.stats();
    assert_eq!((s.curr_items, s.bytes, s.get_hits, s.get_misses), (0, 0, 3, 2));
    let cs = w.cachelet(0).unwrap().stats();
    assert_eq!((cs.reads, cs.hits, cs.misses), (5, 3, 2));
}

#[test]
fn get_reports_the_previous_access() {
    let mut w = mk(1 << 20, |_| {});
    cas_of(set(&mut w, "a", "1", 0, 3));
    let h = key_hash(b"a");
    let v = w.get(0, h, b"a", 10).unwrap();
    assert_eq!((v.last_access, v.fetched_before), (3, false));
    let v = w.get(0, h, b"a", 10).unwrap();
    assert_eq!((v.last_access, v.fetched_before), (10, true));
    let v = w.get(0, h, b"a", 15).unwrap();
    assert_eq!(v.last_access, 10);
    // peek does not count as an access
    assert_eq!(w.peek(0, h, b"a", 20).unwrap().last_access, 15);
    assert_eq!(w.get(0, h, b"a", 20).unwrap().last_access, 15);
    // touch/gat is an access and reports the previous one
    assert_eq!(w.touch(0, h, b"a", 0, 30).unwrap().last_access, 20);
    assert_eq!(w.get(0, h, b"a", 31).unwrap().last_access, 30);
}

#[test]
fn modes_and_cas() {
    let mut w = mk(1 << 20, |_| {});
    assert_eq!(st(&mut w, "k", "v", Mode::Replace, None, 0), StoreResult::NotStored);
    assert_eq!(st(&mut w, "k", "v", Mode::Append, None, 0), StoreResult::NotStored);
    let c1 = cas_of(st(&mut w, "k", "v", Mode::Add, None, 0));
    assert_eq!(c1 & 0xffff, 3, "worker id in low bits");
    assert_eq!(st(&mut w, "k", "x", Mode::Add, None, 0), StoreResult::NotStored);
    assert_eq!(st(&mut w, "k", "x", Mode::Set, Some(c1 + 1), 0), StoreResult::Exists);
    assert_eq!(st(&mut w, "nope", "x", Mode::Set, Some(c1), 0), StoreResult::NotFound);
    let c2 = cas_of(st(&mut w, "k", "w", Mode::Set, Some(c1), 0));
    assert!(c2 > c1);
    assert_eq!(get(&mut w, "k", 0).unwrap(), b"w");
    assert_eq!(w.delete(0, key_hash(b"k"), b"k", Some(c1), 0), DeleteResult::Exists);
    assert_eq!(w.delete(0, key_hash(b"k"), b"k", Some(c2), 0), DeleteResult::Deleted);
}

#[test]
fn cas_disabled_reports_zero() {
    let mut w = mk(1 << 20, |c| c.cas_enabled = false);
    assert_eq!(set(&mut w, "k", "v", 0, 0), StoreResult::Stored { cas: 0 });
    assert_eq!(w.get(0, key_hash(b"k"), b"k", 0).unwrap().cas, 0);
}

#[test]
fn append_prepend_keep_flags_and_exptime() {
    let mut w = mk(1 << 20, |_| {});
    w.store(0, key_hash(b"k"), b"k", b"mid", 42, 100, Mode::Set, None, 0);
    st(&mut w, "k", "_end", Mode::Append, None, 1);
    st(&mut w, "k", "start_", Mode::Prepend, None, 2);
    let v = w.get(0, key_hash(b"k"), b"k", 3).unwrap();
    assert_eq!(v.value, b"start_mid_end");
    assert_eq!(v.flags, 42);
    assert_eq!(v.exptime, 100);
    assert!(get(&mut w, "k", 100).is_none());
}

#[test]
fn expiry_relative_absolute_negative() {
    let mut w = mk(1 << 20, |_| {});
    set(&mut w, "r", "v", 10, 5);
    assert!(get(&mut w, "r", 14).is_some());
    assert!(get(&mut w, "r", 15).is_none());
    assert_eq!(w.stats().get_expired, 1);
    // absolute: start_unix + 50
    set(&mut w, "a", "v", 1_000_000_050, 5);
    assert_eq!(w.peek(0, key_hash(b"a"), b"a", 5).unwrap().exptime, 50);
    assert!(get(&mut w, "a", 49).is_some());
    assert!(get(&mut w, "a", 50).is_none());
    // absolute in the past and negative: stored as already expired, old copy gone
    set(&mut w, "p", "v", 0, 5);
    assert!(matches!(set(&mut w, "p", "v2", 1_000_000_001, 5), StoreResult::Stored { .. }));
    assert!(get(&mut w, "p", 5).is_none());
    set(&mut w, "n", "v", 0, 5);
    assert!(matches!(set(&mut w, "n", "v2", -1, 5), StoreResult::Stored { .. }));
    assert!(get(&mut w, "n", 5).is_none());
    assert_eq!(w.stats().curr_items, 0);
}

#[test]
fn flush_all_immediate_and_delayed() {
    let mut w = mk(1 << 20, |_| {});
    set(&mut w, "a", "1", 0, 10);
    w.flush_all(10);
    assert!(get(&mut w, "a", 10).is_none());
    // set in the same second after the flush survives
    set(&mut w, "b", "1", 0, 10);
    assert!(get(&mut w, "b", 10).is_some());
    assert!(get(&mut w, "b", 11).is_some());
    // delayed flush at 20: items set before 20 survive until 20
    set(&mut w, "c", "1", 0, 12);
    w.flush_all(20);
    assert!(get(&mut w, "c", 19).is_some());
    set(&mut w, "d", "1", 0, 19);
    assert!(get(&mut w, "c", 20).is_none());
    assert!(get(&mut w, "d", 20).is_none());
    assert!(get(&mut w, "b", 21).is_none());
    set(&mut w, "e", "1", 0, 21);
    assert!(get(&mut w, "e", 21).is_some());
    assert!(w.stats().get_flushed >= 3);
}

#[test]
fn incr_decr() {
    let mut w = mk(1 << 20, |_| {});
    let h = key_hash(b"n");
    assert_eq!(w.arith(0, h, b"n", true, 1, 0), ArithResult::NotFound);
    set(&mut w, "n", "abc", 0, 0);
    assert_eq!(w.arith(0, h, b"n", true, 1, 0), ArithResult::NonNumeric);
    set(&mut w, "n", "18446744073709551615", 0, 0);
    assert!(matches!(w.arith(0, h, b"n", true, 2, 0), ArithResult::Value { value: 1, .. }));
    assert_eq!(get(&mut w, "n", 0).unwrap(), b"1", "shrunk in place");
    assert!(matches!(w.arith(0, h, b"n", false, 5, 0), ArithResult::Value { value: 0, .. }));
    assert!(matches!(w.arith(0, h, b"n", true, 99, 0), ArithResult::Value { value: 99, .. }));
    assert_eq!(get(&mut w, "n", 0).unwrap(), b"99", "grew by reallocation");
    set(&mut w, "m", "100", 0, 0);
    let hm = key_hash(b"m");
    assert!(matches!(w.arith(0, hm, b"m", false, 1, 0), ArithResult::Value { value: 99, .. }));
    assert_eq!(get(&mut w, "m", 0).unwrap(), b"99");
    let ArithResult::Value { cas, .. } = w.arith(0, hm, b"m", true, 1, 0) else { panic!() };
    let v = w.get(0, hm, b"m", 0).unwrap();
    assert_eq!((v.value, v.cas, v.flags), (&b"100"[..], cas, 7));
    assert_eq!(w.stats().curr_items, 2);
    // sweep walks the shrunk items with slack correctly
    w.sweep(1, 1000);
    assert_eq!(get(&mut w, "m", 1).unwrap(), b"100");
}

#[test]
fn touch_and_update() {
    let mut w = mk(1 << 20, |_| {});
    let h = key_hash(b"t");
    assert!(w.touch(0, h, b"t", 10, 0).is_none());
    set(&mut w, "t", "v", 5, 0);
    assert_eq!(w.touch(0, h, b"t", 100, 1).unwrap().exptime, 101);
    assert!(get(&mut w, "t", 50).is_some());
    assert!(w.update(0, h, b"t", 50, |m| {
        m.stale = true;
        m.win = true;
        m.exptime = 0;
    }));
    let v = w.peek(0, h, b"t", 500).unwrap();
    assert!(v.stale && v.win && v.exptime == 0);
    assert_eq!(w.touch(0, h, b"t", -1, 500).unwrap().value, b"v");
    assert!(get(&mut w, "t", 500).is_none());
    assert!(!w.update(0, h, b"t", 500, |_| {}));
    assert_eq!(w.stats().curr_items, 0);
}

#[test]
fn large_items_and_too_large() {
    let mut w = mk(64 * PAGE, |_| {});
    let big = "x".repeat(3 * PAGE);
    cas_of(set(&mut w, "big", &big, 0, 0));
    assert_eq!(get(&mut w, "big", 0).unwrap(), big.as_bytes());
    let ps = w.global().stats();
    assert_eq!(ps.large_pages, 4);
    assert_eq!(w.cachelet(0).unwrap().stats().pages, 4);
    let huge = "x".repeat(70 * 1024);
    assert_eq!(set(&mut w, "huge", &huge, 0, 0), StoreResult::TooLarge);
    assert_eq!(w.delete(0, key_hash(b"big"), b"big", None, 0), DeleteResult::Deleted);
    assert_eq!(w.global().stats().large_pages, 0);
    assert_eq!(w.cachelet(0).unwrap().stats().pages, 0);
    // append growing past a page moves the item to a large segment
    set(&mut w, "g", &"a".repeat(3000), 0, 0);
    st(&mut w, "g", &"b".repeat(3000), Mode::Append, None, 0);
    let v = get(&mut w, "g", 0).unwrap();
    assert_eq!(v.len(), 6000);
    assert_eq!(w.global().stats().large_pages, 2);
}

#[test]
fn eviction_at_full_under_writes() {
    let mut w = mk(32 * PAGE, |_| {});
    let total = w.global().total_pages();
    let val = "v".repeat(100);
    for i in 0..20_000u32 {
        let k = format!("key{i}");
        let cl = i % 4;
        let r = w.store(cl, key_hash(k.as_bytes()), k.as_bytes(), val.as_bytes(), 0, 0, Mode::Set, None, i / 100);
        assert!(matches!(r, StoreResult::Stored { .. }), "{i}: {r:?}");
        if i % 7 == 0 {
            let k2 = format!("key{}", i / 2);
            w.get(cl, key_hash(k2.as_bytes()), k2.as_bytes(), i / 100);
        }
        let ps = w.global().stats();
        assert!(ps.created_pages + ps.large_pages <= total);
    }
    let s = w.stats();
    assert!(s.evictions > 0);
    assert!(s.evicted_unfetched > 0);
    assert!(s.pages_held as usize <= total);
    // newest keys are present
    for i in 19_990..20_000u32 {
        let k = format!("key{i}");
        assert!(w.get(i % 4, key_hash(k.as_bytes()), k.as_bytes(), 200).is_some());
    }
    // bytes accounting matches a full recount
    let mut items = 0;
    for cl in 0..4 {
        items += w.cachelet(cl).unwrap().stats().items;
    }
    assert_eq!(items, s.curr_items);
    assert!(s.curr_items > 0 && s.curr_items < 20_000);
}

#[test]
fn second_chance_keeps_hot_item() {
    let mut w = mk(16 * PAGE, |_| {});
    let val = "v".repeat(200);
    set(&mut w, "hot", &val, 0, 0);
    for i in 0..5_000u32 {
        let k = format!("cold{i}");
        set(&mut w, &k, &val, 0, 0);
        assert!(get(&mut w, "hot", 0).is_some(), "hot evicted at {i}");
    }
    assert!(w.stats().evictions > 1000);
    assert!(w.stats().items_relocated > 0);
}

#[test]
fn no_evict_gives_out_of_memory() {
    let mut w = mk(8 * PAGE, |c| c.evict = false);
    let val = "v".repeat(500);
    let mut oom = false;
    for i in 0..1000 {
        match set(&mut w, &format!("k{i}"), &val, 0, 0) {
            StoreResult::Stored { .. } => {}
            StoreResult::OutOfMemory => {
                oom = true;
                break;
            }
            o => panic!("{o:?}"),
        }
    }
    assert!(oom);
    assert_eq!(w.stats().evictions, 0);
    assert!(get(&mut w, "k0", 0).is_some());
    // deleting makes room again
    for i in 0..20 {
        w.delete(0, key_hash(format!("k{i}").as_bytes()), format!("k{i}").as_bytes(), None, 0);
    }
    assert!(matches!(set(&mut w, "again", &val, 0, 0), StoreResult::Stored { .. }));
}

#[test]
fn moving_cachelet_keeps_items_and_pages() {
    let g = GlobalPool::new(256 * PAGE, PAGE);
    let cfg = StoreConfig { mem_limit: 256 * PAGE, page_size: PAGE, ..Default::default() };
    let mut a = WorkerStore::new(g.clone(), StoreConfig { worker_id: 1, ..cfg.clone() }, 2);
    let mut b = WorkerStore::new(g.clone(), StoreConfig { worker_id: 2, ..cfg }, 2);
    a.insert_cachelet(Cachelet::new(0));
    b.insert_cachelet(Cachelet::new(1));
    let mut last_cas = 0;
    for i in 0..3000 {
        let k = format!("k{i}");
        if let StoreResult::Stored { cas } =
            a.store(0, key_hash(k.as_bytes()), k.as_bytes(), k.as_bytes(), i, 0, Mode::Set, None, 0)
        {
            last_cas = cas;
        }
    }
    let big = vec![b'z'; 2 * PAGE];
    a.store(0, key_hash(b"big"), b"big", &big, 0, 0, Mode::Set, None, 0);
    let pages_a = a.stats().pages_held - a.stats().local_free_pages;
    let cpages = a.cachelet(0).unwrap().stats().pages;
    assert_eq!(pages_a, cpages);
    let c = a.take_cachelet(0).unwrap();
    assert!(!a.owns(0));
    assert_eq!(a.stats().pages_held, a.stats().local_free_pages);
    assert_eq!(a.stats().curr_items, 0);
    b.insert_cachelet(c);
    assert!(b.owns(0) && b.owns(1));
    assert_eq!(b.cachelet_ids().collect::<Vec<_>>(), vec![0, 1]);
    assert_eq!(b.stats().pages_held - b.stats().local_free_pages, cpages);
    for i in 0..3000u32 {
        let k = format!("k{i}");
        let v = b.get(0, key_hash(k.as_bytes()), k.as_bytes(), 0).unwrap();
        assert_eq!((v.value, v.flags), (k.as_bytes(), i));
    }
    assert_eq!(b.get(0, key_hash(b"big"), b"big", 0).unwrap().value, &big[..]);
    // CAS stays monotone and unique after the move
    let StoreResult::Stored { cas } = b.store(0, key_hash(b"n"), b"n", b"v", 0, 0, Mode::Set, None, 0) else {
        panic!()
    };
    assert!(cas >> 16 > last_cas >> 16);
    assert_eq!(cas & 0xffff, 2);
    // deleting everything returns every page
    for i in 0..3000u32 {
        let k = format!("k{i}");
        b.delete(0, key_hash(k.as_bytes()), k.as_bytes(), None, 0);
    }
    b.delete(0, key_hash(b"big"), b"big", None, 0);
    b.delete(0, key_hash(b"n"), b"n", None, 0);
    b.sweep(0, 10_000);
    let s = b.stats();
    assert_eq!(s.curr_items, 0);
    assert!(s.pages_held - s.local_free_pages <= 2, "only open segments remain");
    let ps = g.stats();
    assert_eq!(ps.outstanding_pages as u64, a.stats().pages_held + b.stats().pages_held);
}

#[test]
#[should_panic(expected = "cachelet 2 not owned by this worker")]
#[cfg(debug_assertions)]
fn get_on_unowned_cachelet_panics_in_debug() {
    let mut w = mk(1 << 20, |_| {});
    w.take_cachelet(2);
    w.get(2, 1, b"x", 0);
}

#[test]
fn pool_refill_and_return_in_bulk() {
    let g = GlobalPool::new(64 * PAGE, PAGE);
    let cfg = StoreConfig {
        mem_limit: 64 * PAGE,
        page_size: PAGE,
        refill_pages: 8,
        local_high_pages: 8,
        global_low_pages: 40,
        ..Default::default()
    };
    let mut w = WorkerStore::new(g.clone(), cfg, 1);
    w.insert_cachelet(Cachelet::new(0));
    set(&mut w, "a", "1", 0, 0);
    // one refill took 8 pages at once
    assert_eq!(g.stats().outstanding_pages, 8);
    assert_eq!(w.stats().pages_held, 8);
    // fill ~30 pages with items of one page each (~3.9 KiB), then delete them
    let val = "v".repeat(PAGE - 100);
    for i in 0..30 {
        set(&mut w, &format!("k{i}"), &val, 0, 0);
    }
    assert!(g.stats().outstanding_pages >= 31);
    assert_eq!(g.stats().outstanding_pages % 8, 0, "refills are bulk");
    for i in 0..30 {
        let k = format!("k{i}");
        w.delete(0, key_hash(k.as_bytes()), k.as_bytes(), None, 0);
    }
    // global available < 40 while worker held > 8 free -> returned down to the refill size,
    // in bulk, until the global pool was no longer low
    let s = w.stats();
    let ps = g.stats();
    assert!(ps.free_pages >= 8, "{ps:?}");
    assert!(ps.available_pages >= 40, "{ps:?}");
    assert!(s.local_free_pages < 30, "{s:?}");
    assert_eq!(ps.outstanding_pages as u64, s.pages_held);
    // shed_pages returns local pages
    let before = g.stats().free_pages;
    let n = w.shed_pages(3);
    assert_eq!(n, 3);
    assert_eq!(g.stats().free_pages, before + 3);
}

#[test]
fn sweep_reclaims_expired_and_frees_pages() {
    let mut w = mk(128 * PAGE, |_| {});
    let val = "v".repeat(300);
    for i in 0..1000 {
        set(&mut w, &format!("e{i}"), &val, 10, 0);
    }
    set(&mut w, "keep", "v", 0, 0);
    let held = w.stats().pages_held - w.stats().local_free_pages;
    assert!(held > 50);
    let mut n = 0;
    while w.sweep(20, 100) > 0 && n < 100 {
        n += 1;
    }
    let s = w.stats();
    assert_eq!(s.curr_items, 1);
    assert_eq!(s.reclaimed, 1000);
    assert_eq!(s.expired_unfetched, 1000);
    assert!(s.pages_held - s.local_free_pages <= 2, "{s:?}");
    assert!(get(&mut w, "keep", 20).is_some());
}

#[test]
fn sweep_compacts_mostly_dead_segments() {
    let mut w = mk(128 * PAGE, |_| {});
    let val = "v".repeat(200);
    for i in 0..2000 {
        set(&mut w, &format!("k{i}"), &val, 0, 0);
    }
    let before = w.stats().pages_held - w.stats().local_free_pages;
    for i in 0..2000 {
        if i % 8 != 0 {
            let k = format!("k{i}");
            w.delete(0, key_hash(k.as_bytes()), k.as_bytes(), None, 0);
        }
    }
    for _ in 0..20 {
        w.sweep(0, 1000);
    }
    let after = w.stats().pages_held - w.stats().local_free_pages;
    assert!(after * 3 < before, "before {before} after {after}");
    assert!(w.stats().segments_compacted > 0);
    for i in (0..2000).step_by(8) {
        assert_eq!(get(&mut w, &format!("k{i}"), 0).unwrap(), val.as_bytes());
    }
}

#[test]
fn cachelet_and_store_are_send() {
    fn is_send<T: Send>() {}
    is_send::<Box<Cachelet>>();
    is_send::<WorkerStore>();
}

#[test]
fn single_item_larger_than_budget_is_out_of_memory() {
    let mut w = mk(8 * PAGE, |c| c.max_item_size = 1 << 20);
    let v = "x".repeat(9 * PAGE);
    assert_eq!(set(&mut w, "k", &v, 0, 0), StoreResult::OutOfMemory);
    // a large item that fits the budget evicts small ones to make room
    for i in 0..50 {
        set(&mut w, &format!("s{i}"), &"v".repeat(400), 0, 0);
    }
    let v = "x".repeat(6 * PAGE);
    assert!(matches!(set(&mut w, "k", &v, 0, 0), StoreResult::Stored { .. }));
    assert_eq!(get(&mut w, "k", 0).unwrap().len(), 6 * PAGE);
    assert!(w.stats().evictions > 0);
    let ps = w.global().stats();
    assert!(ps.created_pages + ps.large_pages <= ps.total_pages);
}

#[test]
fn drop_and_discard_return_pages_to_the_pool() {
    let g = GlobalPool::new(64 * PAGE, PAGE);
    let cfg = StoreConfig { mem_limit: 64 * PAGE, page_size: PAGE, ..Default::default() };
    let mut w = WorkerStore::new(g.clone(), cfg.clone(), 2);
    w.insert_cachelet(Cachelet::new(0));
    w.insert_cachelet(Cachelet::new(1));
    for i in 0..200u32 {
        let k = format!("k{i}");
        w.store(i % 2, key_hash(k.as_bytes()), k.as_bytes(), &[b'v'; 300], 0, 0, Mode::Set, None, 0);
    }
    w.store(1, key_hash(b"big"), b"big", &[b'b'; 3 * PAGE], 0, 0, Mode::Set, None, 0);
    assert!(g.stats().large_pages == 4);
    let held = w.stats().pages_held;
    assert!(w.discard_cachelet(1));
    assert!(!w.owns(1));
    assert_eq!(g.stats().large_pages, 0);
    assert_eq!(w.stats().pages_held + 4, held, "pages of cachelet 1 now local free");
    drop(w);
    let ps = g.stats();
    assert_eq!(ps.outstanding_pages, 0);
    assert_eq!(ps.available_pages, ps.total_pages);
}

/// Eviction keeps (relocates) only items read since they were written: a
/// write-only load under memory pressure relocates nothing, and once some
/// items are read, those are the ones kept.
#[test]
fn eviction_keeps_only_items_read_since_written() {
    let mut w = mk(16 * PAGE, |_| {});
    let val = "v".repeat(100);
    for i in 0..2_000 {
        set(&mut w, &format!("w{i}"), &val, 0, 0);
    }
    assert!(w.stats().evictions > 1000, "memory pressure");
    assert_eq!(w.stats().items_relocated, 0, "nothing was read, nothing is kept");
    let survivors: Vec<String> = (0..2_000).map(|i| format!("w{i}")).filter(|k| get(&mut w, k, 0).is_some()).collect();
    assert!(!survivors.is_empty());
    for i in 0..2_000 {
        set(&mut w, &format!("x{i}"), &val, 0, 0);
    }
    assert!(w.stats().items_relocated > 0, "the items just read got a second chance");
}

/// memcached -M: a full store refuses new items, drops no live item, and
/// reuses the room of deleted, overwritten, expired and flushed items.
#[test]
fn no_evict_never_drops_a_live_item_and_reuses_dead_room() {
    let mut w = mk(8 * PAGE, |c| c.evict = false);
    let val = "v".repeat(500);
    let mut stored = Vec::new();
    for i in 0..200 {
        match set(&mut w, &format!("k{i}"), &val, 0, 0) {
            StoreResult::Stored { .. } => stored.push(i),
            StoreResult::OutOfMemory => {}
            o => panic!("{o:?}"),
        }
    }
    let full = stored.len();
    assert!(full > 10 && full < 200, "{full}");
    assert_eq!(w.stats().evictions, 0);
    assert_eq!(w.stats().out_of_memory, 200 - full as u64);
    for &i in &stored {
        assert!(get(&mut w, &format!("k{i}"), 0).is_some(), "k{i} was dropped");
    }
    // deletes make room for as many new items
    for &i in &stored[..full / 2] {
        assert_eq!(
            w.delete(0, key_hash(format!("k{i}").as_bytes()), format!("k{i}").as_bytes(), None, 0),
            DeleteResult::Deleted
        );
    }
    for i in 0..full / 2 {
        assert!(matches!(set(&mut w, &format!("d{i}"), &val, 0, 0), StoreResult::Stored { .. }), "d{i}");
    }
    // overwrites of a full store: as in memcached, a set that finds no room fails and drops
    // the old copy, whose room the next set reuses (here by compaction)
    let (mut ok, mut failed) = (0, 0);
    for round in 0..5 {
        for i in 0..full / 2 {
            let v = format!("{round}{}", &val[1..]);
            match set(&mut w, &format!("d{i}"), &v, 0, 0) {
                StoreResult::Stored { .. } => {
                    ok += 1;
                    assert_eq!(get(&mut w, &format!("d{i}"), 0).unwrap(), v.as_bytes());
                }
                StoreResult::OutOfMemory => {
                    failed += 1;
                    assert!(get(&mut w, &format!("d{i}"), 0).is_none(), "no stale value");
                }
                o => panic!("{o:?}"),
            }
        }
    }
    // (memcached alternates exactly; segment tails cost mbal a few more failures)
    assert!(ok * 2 >= failed, "room is reused: {ok} stored, {failed} failed");
    for &i in &stored[full / 2..] {
        assert!(get(&mut w, &format!("k{i}"), 0).is_some(), "k{i} was dropped");
    }
    assert_eq!(w.stats().evictions, 0);
    // expired and flushed items are reclaimed too
    for i in 0..full {
        set(&mut w, &format!("d{i}"), &val, 1, 0);
    }
    w.flush_all(0);
    for i in 0..full / 2 {
        assert!(matches!(set(&mut w, &format!("e{i}"), &val, 0, 2), StoreResult::Stored { .. }), "e{i}");
    }
}

/// memcached -M keeps refusing once full: after the first refusal, every item as large is
/// refused, whichever cachelet's open segment still has room for it, each refusal counted;
/// a smaller item may still fit, and once room is made (a delete) the same size fits again.
#[test]
fn no_evict_keeps_refusing_once_full() {
    let mut w = mk(16 * PAGE, |c| c.evict = false);
    let val = "v".repeat(1000);
    // Cachelet 0 fills twice as fast as the others: when it finds no page, their open
    // segments have room left.
    let cl = |i: usize| [0, 0, 1, 2, 3][i % 5];
    let put = |w: &mut WorkerStore, i: usize, v: &str| {
        let k = format!("k{i}");
        w.store(cl(i), key_hash(k.as_bytes()), k.as_bytes(), v.as_bytes(), 0, 0, Mode::Set, None, 0)
    };
    let mut i = 0;
    while matches!(put(&mut w, i, &val), StoreResult::Stored { .. }) {
        i += 1;
    }
    assert_eq!(w.stats().out_of_memory, 1);
    for j in 1..=40 {
        assert_eq!(put(&mut w, i + j, &val), StoreResult::OutOfMemory, "k{} after the first refusal", i + j);
    }
    assert_eq!(w.stats().out_of_memory, 41, "each refusal counted");
    assert!(matches!(put(&mut w, 10_000, "small"), StoreResult::Stored { .. }), "a smaller item fits a tail");
    // a delete frees room: the same size fits again
    for j in 0..8 {
        let k = format!("k{j}");
        w.delete(cl(j), key_hash(k.as_bytes()), k.as_bytes(), None, 0);
    }
    assert!(matches!(put(&mut w, 20_000, &val), StoreResult::Stored { .. }));
}

/// A `set` that cannot be stored removes the value it meant to replace (memcached: no stale
/// data after a failed set); a failed `cas`, `add` or `append` leaves it.
#[test]
fn failed_set_forgets_the_old_value() {
    let mut w = mk(8 * PAGE, |c| {
        c.evict = false;
        c.max_item_size = 2048;
    });
    cas_of(set(&mut w, "a", "old", 0, 0));
    assert_eq!(set(&mut w, "a", &"x".repeat(4096), 0, 0), StoreResult::TooLarge);
    assert!(get(&mut w, "a", 0).is_none(), "too large: the old value is gone");
    let c = cas_of(set(&mut w, "b", "old", 0, 0));
    assert_eq!(st(&mut w, "b", &"x".repeat(4096), Mode::Append, None, 0), StoreResult::TooLarge);
    assert_eq!(st(&mut w, "b", &"x".repeat(4096), Mode::Set, Some(c), 0), StoreResult::TooLarge);
    assert_eq!(get(&mut w, "b", 0).unwrap(), b"old", "append and cas keep it");
    // out of memory: fill, then overwrite one key with a value that does not fit
    let mut i = 0;
    while matches!(set(&mut w, &format!("f{i}"), &"v".repeat(1000), 0, 0), StoreResult::Stored { .. }) {
        i += 1;
    }
    cas_of(set(&mut w, "f0", "small", 0, 0));
    let big = "z".repeat(2000);
    let mut forgot = false;
    for _ in 0..3 {
        match set(&mut w, &format!("f{}", i - 1), &big, 0, 0) {
            StoreResult::OutOfMemory => {
                assert!(get(&mut w, &format!("f{}", i - 1), 0).is_none());
                forgot = true;
                break;
            }
            StoreResult::Stored { .. } => i -= 1,
            o => panic!("{o:?}"),
        }
    }
    assert!(forgot, "a full -M store refused a set");
}

#[test]
fn shed_pages_evicts_when_no_free_pages() {
    let mut w = mk(16 * PAGE, |_| {});
    for i in 0..2000 {
        set(&mut w, &format!("k{i}"), &"v".repeat(100), 0, 0);
    }
    let local = w.stats().local_free_pages as usize;
    let want = local + 3;
    assert_eq!(w.shed_pages(want), want);
    assert!(w.stats().evictions > 0);
    assert!(w.global().stats().free_pages >= want);
    // still serves afterwards
    assert!(matches!(set(&mut w, "after", "v", 0, 0), StoreResult::Stored { .. }));
    assert!(get(&mut w, "after", 0).is_some());
}

#[test]
fn sweep_survives_cachelet_moves() {
    let mut w = mk(1 << 20, |_| {});
    for i in 0..300u32 {
        let k = format!("k{i}");
        w.store(i % 4, key_hash(k.as_bytes()), k.as_bytes(), &[b'v'; 200], 0, 5, Mode::Set, None, 0);
    }
    w.sweep(1, 3);
    let c = w.take_cachelet(1).unwrap();
    w.sweep(10, 2);
    w.insert_cachelet(c);
    for _ in 0..100 {
        w.sweep(10, 50);
    }
    assert_eq!(w.stats().curr_items, 0);
    assert_eq!(w.stats().reclaimed, 300);
}

#[test]
fn dropped_cachelet_returns_its_pages() {
    let g = GlobalPool::new(64 * PAGE, PAGE);
    let cfg = StoreConfig { mem_limit: 64 * PAGE, page_size: PAGE, ..Default::default() };
    let mut w = WorkerStore::new(g.clone(), cfg, 1);
    w.insert_cachelet(Cachelet::new(0));
    for i in 0..100 {
        let k = format!("k{i}");
        w.store(0, key_hash(k.as_bytes()), k.as_bytes(), &[b'v'; 500], 0, 0, Mode::Set, None, 0);
    }
    w.store(0, key_hash(b"big"), b"big", &[b'b'; 2 * PAGE], 0, 0, Mode::Set, None, 0);
    let c = w.take_cachelet(0).unwrap();
    let held = c.stats().pages;
    assert!(held > 10);
    let before = g.stats();
    drop(c);
    let after = g.stats();
    assert_eq!(after.large_pages, 0);
    assert_eq!(after.free_pages, before.free_pages + held as usize - 3);
    assert_eq!(after.outstanding_pages as u64, w.stats().pages_held);
}

#[test]
fn a_busy_worker_leaves_a_reserve_and_sheds_to_a_starving_one() {
    let g = GlobalPool::new(64 * PAGE, PAGE);
    let cfg = StoreConfig { mem_limit: 64 * PAGE, page_size: PAGE, refill_pages: 4, workers: 2, ..Default::default() };
    let mut a = WorkerStore::new(g.clone(), StoreConfig { worker_id: 1, ..cfg.clone() }, 2);
    let mut b = WorkerStore::new(g.clone(), StoreConfig { worker_id: 2, ..cfg }, 2);
    a.insert_cachelet(Cachelet::new(0));
    b.insert_cachelet(Cachelet::new(1));
    let val = [b'v'; 300];
    for i in 0..5000 {
        let k = format!("a{i}");
        assert!(matches!(
            a.store(0, key_hash(k.as_bytes()), k.as_bytes(), &val, 0, 0, Mode::Set, None, 0),
            StoreResult::Stored { .. }
        ));
    }
    // a filled far past its share, but evicted its own rather than take the reserve.
    assert!(g.stats().available_pages > 0, "{:?}", g.stats());
    assert!(a.stats().evictions > 0);
    // b is served at once from the reserve, never out of memory.
    for i in 0..3000 {
        let k = format!("b{i}");
        let r = b.store(1, key_hash(k.as_bytes()), k.as_bytes(), &val, 0, 0, Mode::Set, None, 0);
        assert!(matches!(r, StoreResult::Stored { .. }), "{i}: {r:?}");
        // a keeps writing too, and sweeps now and then; both keep serving.
        let k = format!("a{}", 5000 + i);
        a.store(0, key_hash(k.as_bytes()), k.as_bytes(), &val, 0, 0, Mode::Set, None, 0);
        if i % 100 == 0 {
            a.sweep(0, 10);
        }
    }
    assert!(b.get(1, key_hash(b"b2999"), b"b2999", 0).is_some());
    // b, evicting below its share, got pages back from a.
    let (ha, hb) = (a.stats().pages_held, b.stats().pages_held);
    assert!(hb >= 16, "b holds {hb} pages, a {ha}");
    let ps = g.stats();
    assert!(ps.created_pages + ps.large_pages <= ps.total_pages);
    assert_eq!(b.stats().out_of_memory, 0);
}

#[test]
fn incr_accepts_leading_zeros_and_trailing_spaces() {
    let mut w = mk(1 << 20, |_| {});
    let h = key_hash(b"z");
    set(&mut w, "z", "0010000000000000000000", 0, 0);
    assert!(matches!(w.arith(0, h, b"z", true, 1, 0), ArithResult::Value { value: 10_000_000_000_000_000_001, .. }));
    set(&mut w, "z", "12  ", 0, 0);
    assert!(matches!(w.arith(0, h, b"z", false, 2, 0), ArithResult::Value { value: 10, .. }));
    set(&mut w, "z", "1 2", 0, 0);
    assert_eq!(w.arith(0, h, b"z", true, 1, 0), ArithResult::NonNumeric);
    set(&mut w, "z", "99999999999999999999", 0, 0);
    assert_eq!(w.arith(0, h, b"z", true, 1, 0), ArithResult::NonNumeric, "overflowing value");
}

#[test]
fn store_with_stale_if_older_and_new_cas() {
    let mut w = mk(1 << 20, |_| {});
    let (h, k) = (key_hash(b"a"), &b"a"[..]);
    let old = cas_of(set(&mut w, "a", "1", 100, 0));
    w.update(0, h, k, 0, |m| m.win = true);
    let opts = |compare, stale_if_older, new_cas| CasOpts { compare: Some(compare), stale_if_older, new_cas };
    // newer than the item's: a conflict even with stale_if_older
    let r = w.store_with(0, h, k, b"2", 0, 0, Mode::Set, opts(old + 1, true, None), 5);
    assert_eq!(r, StoreResult::Exists);
    // older: stored, stale, old expiry and win token kept, counted as a CAS hit
    let r = w.store_with(0, h, k, b"2", 0, 0, Mode::Set, opts(old - 1, true, Some(4242)), 5);
    assert_eq!(r, StoreResult::Stored { cas: 4242 });
    let v = w.peek(0, h, k, 5).unwrap();
    assert_eq!((v.value, v.cas, v.stale, v.win, v.exptime), (&b"2"[..], 4242, true, true, 100));
    let s = w.stats();
    assert_eq!((s.cas_hits, s.cas_badval), (1, 1));
    // the item's own CAS: a plain store, no longer stale
    let r = w.store_with(0, h, k, b"3", 0, 0, Mode::Set, opts(4242, true, None), 5);
    assert!(matches!(r, StoreResult::Stored { cas } if cas != 4242));
    assert!(!w.peek(0, h, k, 5).unwrap().stale);
}
