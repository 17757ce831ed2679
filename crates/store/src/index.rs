//! A cachelet's hash index: bucketized open addressing with cache-line buckets.
//!
//! Each bucket is one 64-byte line: a displacement count and 7 slots. A slot packs a 16-bit
//! tag from the key hash with the item's location (segment slot, offset / 8), so a lookup
//! reads one line of index and then the item itself; hashbrown, which this replaced, kept
//! control bytes and entries in separate arrays (two misses per lookup on a large index).
//!
//! An item lives in its home bucket (`hash & mask`) or, when that is full, in the first
//! bucket after it with a free slot (linear probing). `over[b]` counts the items whose probe
//! passed bucket `b` without stopping; a lookup stops at the first bucket with `over == 0`.
//! Removing an item decrements the counts along its path, so deletes leave no tombstones.
//!
//! The index keeps no full hashes: growing it asks the caller for each item's hash (the item
//! header holds it). Tags are compared first; the caller's `eq` confirms a match by key.

/// Slots per bucket (one word of the line holds the displacement count).
const SLOTS: usize = 7;
/// Grow when more than this fraction of slots is used (numerator / 8).
const LOAD_NUM: usize = 7;
const SEG_BITS: u32 = 24;
const OFF_BITS: u32 = 24;
/// Largest segment slot and byte offset a slot can hold.
pub(crate) const MAX_SEG: u32 = (1 << SEG_BITS) - 1;
pub(crate) const MAX_OFF: u32 = ((1 << OFF_BITS) - 1) << 3;

#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Bucket {
    over: u32,
    _pad: u32,
    slot: [u64; SLOTS],
}

#[inline]
fn tag(hash: u64) -> u64 {
    // The high 16 bits; never 0, so 0 marks a free slot. (The VN uses bits 32.., the home
    // bucket the low bits: the tag stays informative inside one cachelet and one bucket.)
    (hash >> 48) | 1
}

#[inline]
fn pack(hash: u64, seg: u32, off: u32) -> u64 {
    assert!(seg <= MAX_SEG && off <= MAX_OFF && off & 7 == 0, "item location out of index range");
    tag(hash) << 48 | (seg as u64) << OFF_BITS | (off >> 3) as u64
}

#[inline]
fn loc(slot: u64) -> (u32, u32) {
    (((slot >> OFF_BITS) & MAX_SEG as u64) as u32, ((slot & ((1 << OFF_BITS) - 1)) << 3) as u32)
}

#[inline]
fn slot_tag(slot: u64) -> u64 {
    slot >> 48
}

#[derive(Default)]
pub(crate) struct Index {
    buckets: Vec<Bucket>,
    len: usize,
}

impl Index {
    pub fn new() -> Self {
        Index::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes held by the table.
    pub fn heap_bytes(&self) -> usize {
        self.buckets.len() * std::mem::size_of::<Bucket>()
    }

    #[inline]
    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    /// Ask the CPU to start loading the bucket a lookup of `hash` reads first, so that a batch
    /// of lookups overlaps its cache misses instead of taking them one after the other.
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        if self.buckets.is_empty() {
            return;
        }
        let b = &self.buckets[hash as usize & self.mask()];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint: it reads nothing the program sees and cannot fault, and
        // the address is that of a live bucket anyway.
        #[allow(unused_unsafe)]
        unsafe {
            std::arch::x86_64::_mm_prefetch(b as *const Bucket as *const i8, std::arch::x86_64::_MM_HINT_T0);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = b;
    }

    /// The location named by the first slot of `hash`'s home bucket whose tag matches: the
    /// item a lookup will most likely read (a guess for a prefetch; `find` confirms by key).
    #[inline]
    pub fn guess(&self, hash: u64) -> Option<(u32, u32)> {
        if self.buckets.is_empty() {
            return None;
        }
        let t = tag(hash);
        let bk = &self.buckets[hash as usize & self.mask()];
        bk.slot.iter().find(|&&s| slot_tag(s) == t).map(|&s| loc(s))
    }

    /// The location of the item with this hash for which `eq(seg, off)` holds.
    #[inline]
    pub fn find(&self, hash: u64, mut eq: impl FnMut(u32, u32) -> bool) -> Option<(u32, u32)> {
        if self.buckets.is_empty() {
            return None;
        }
        let (t, mask) = (tag(hash), self.mask());
        let mut b = hash as usize & mask;
        // Every bucket can have `over > 0` at once (in a small table, items
        // displaced both ways round the ring): a miss then stops after one
        // lap instead of going round for ever.
        for _ in 0..self.buckets.len() {
            let bk = &self.buckets[b];
            for &s in &bk.slot {
                if slot_tag(s) == t {
                    let (seg, off) = loc(s);
                    if eq(seg, off) {
                        return Some((seg, off));
                    }
                }
            }
            if bk.over == 0 {
                return None;
            }
            b = (b + 1) & mask;
        }
        None
    }

    /// Bucket and slot of the entry `(hash, seg, off)`.
    fn position(&self, hash: u64, seg: u32, off: u32) -> Option<(usize, usize)> {
        if self.buckets.is_empty() {
            return None;
        }
        let (want, mask) = (pack(hash, seg, off), self.mask());
        let mut b = hash as usize & mask;
        for _ in 0..self.buckets.len() {
            let bk = &self.buckets[b];
            if let Some(i) = bk.slot.iter().position(|&s| s == want) {
                return Some((b, i));
            }
            if bk.over == 0 {
                return None;
            }
            b = (b + 1) & mask;
        }
        None
    }

    /// Add an entry (the caller knows the key is not indexed yet). `hash_of(seg, off)` gives
    /// the hash of an indexed item; it is called only when the table grows.
    pub fn insert(&mut self, hash: u64, seg: u32, off: u32, hash_of: impl Fn(u32, u32) -> u64) {
        if (self.len + 1) * 8 > self.buckets.len() * SLOTS * LOAD_NUM {
            self.grow(hash_of);
        }
        self.place(pack(hash, seg, off), hash);
        self.len += 1;
    }

    fn place(&mut self, packed: u64, hash: u64) {
        let mask = self.mask();
        let mut b = hash as usize & mask;
        loop {
            let bk = &mut self.buckets[b];
            if let Some(s) = bk.slot.iter_mut().find(|s| **s == 0) {
                *s = packed;
                return;
            }
            bk.over += 1;
            b = (b + 1) & mask;
        }
    }

    fn grow(&mut self, hash_of: impl Fn(u32, u32) -> u64) {
        let n = (self.buckets.len() * 2).max(2);
        let old = std::mem::replace(&mut self.buckets, vec![Bucket::default(); n]);
        for bk in &old {
            for &s in bk.slot.iter().filter(|&&s| s != 0) {
                let (seg, off) = loc(s);
                let h = hash_of(seg, off);
                debug_assert_eq!(tag(h), slot_tag(s), "hash_of disagrees with the indexed tag");
                self.place(s, h);
            }
        }
    }

    /// Remove the entry `(hash, seg, off)`. False if it is not indexed.
    pub fn remove(&mut self, hash: u64, seg: u32, off: u32) -> bool {
        let Some((at, i)) = self.position(hash, seg, off) else {
            return false;
        };
        self.buckets[at].slot[i] = 0;
        let mask = self.mask();
        let mut b = hash as usize & mask;
        while b != at {
            self.buckets[b].over -= 1;
            b = (b + 1) & mask;
        }
        self.len -= 1;
        true
    }

    /// One step of a scan of every entry (a cachelet's export): visit the entries whose home
    /// bucket is `cursor`'s under the table's size now (`f(seg, off)`; `hash_of` gives an
    /// entry's hash) and return the next cursor, 0 once the scan is done (start at 0).
    ///
    /// The cursor counts home buckets in bit-reversed order (the order of Redis's SCAN), so
    /// the table may grow between steps: a doubling splits home bucket `b` into `b` and
    /// `b + n`, which share the reversed prefix the cursor has passed or not. Every entry
    /// present for the whole scan is visited at least once; one that moved home bucket as the
    /// table grew may be visited twice. Entries displaced past their home bucket (linear
    /// probing) are found by following the probe while `over` says some entry passed.
    pub fn scan(&self, cursor: u64, hash_of: impl Fn(u32, u32) -> u64, mut f: impl FnMut(u32, u32)) -> u64 {
        if self.buckets.is_empty() {
            return 0;
        }
        let mask = self.mask();
        let home = cursor as usize & mask;
        let mut b = home;
        for _ in 0..self.buckets.len() {
            let bk = &self.buckets[b];
            for &slot in bk.slot.iter().filter(|&&s| s != 0) {
                let (seg, off) = loc(slot);
                if hash_of(seg, off) as usize & mask == home {
                    f(seg, off);
                }
            }
            if bk.over == 0 {
                break;
            }
            b = (b + 1) & mask;
        }
        // Increment the reversed cursor over the mask's bits.
        (cursor | !(mask as u64)).reverse_bits().wrapping_add(1).reverse_bits()
    }

    /// Point the entry `(hash, from)` at `to`. False if it is not indexed.
    pub fn relink(&mut self, hash: u64, from: (u32, u32), to: (u32, u32)) -> bool {
        let Some((b, i)) = self.position(hash, from.0, from.1) else {
            return false;
        };
        self.buckets[b].slot[i] = pack(hash, to.0, to.1);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Locations are derived from a counter; hashes are arbitrary (tests collide them on purpose).
    fn loc_of(i: u32) -> (u32, u32) {
        (i / 1000, (i % 1000) * 8)
    }

    /// A scan visits every entry exactly once when the table keeps its size, and at least
    /// once those present throughout when it grows between steps.
    #[test]
    fn a_scan_visits_every_entry_even_as_the_table_grows() {
        let mut x = 0x9E37_79B9_7F4A_7C15_u64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut hashes: HashMap<(u32, u32), u64> = HashMap::new();
        let mut ix = Index::new();
        for i in 0..5_000u32 {
            // a few shared home buckets, so probes run past home
            let h = if i % 50 == 0 { 0x1111_0000_0000_0003 ^ ((i as u64 % 3) << 60) } else { rnd() };
            hashes.insert(loc_of(i), h);
            let hm = &hashes;
            ix.insert(h, loc_of(i).0, loc_of(i).1, |s, o| hm[&(s, o)]);
        }
        let scan_all = |ix: &Index, hashes: &HashMap<(u32, u32), u64>, grow: &mut dyn FnMut(usize)| {
            let mut seen: HashMap<(u32, u32), usize> = HashMap::new();
            let (mut cursor, mut steps) = (0u64, 0usize);
            loop {
                cursor = ix.scan(cursor, |s, o| hashes[&(s, o)], |s, o| *seen.entry((s, o)).or_default() += 1);
                steps += 1;
                grow(steps);
                if cursor == 0 {
                    return seen;
                }
            }
        };
        let seen = scan_all(&ix, &hashes, &mut |_| {});
        assert_eq!(seen.len(), 5_000);
        assert!(seen.values().all(|&n| n == 1), "each once when nothing grows");

        // The same scan with entries added (and the table doubling) between its steps.
        let mut grown = Index::new();
        let mut all = hashes.clone();
        for (&(s, o), &h) in &hashes {
            let hm = &hashes;
            grown.insert(h, s, o, |s, o| hm[&(s, o)]);
        }
        let before = grown.heap_bytes();
        let mut seen: HashMap<(u32, u32), usize> = HashMap::new();
        let (mut cursor, mut next) = (0u64, 5_000u32);
        loop {
            cursor = grown.scan(cursor, |s, o| all[&(s, o)], |s, o| *seen.entry((s, o)).or_default() += 1);
            for _ in 0..if next < 25_000 { 40 } else { 0 } {
                let h = rnd();
                all.insert(loc_of(next), h);
                let am = &all;
                grown.insert(h, loc_of(next).0, loc_of(next).1, |s, o| am[&(s, o)]);
                next += 1;
            }
            if cursor == 0 {
                break;
            }
        }
        assert!(grown.heap_bytes() >= 4 * before, "the table grew during the scan");
        assert!(hashes.keys().all(|k| seen.contains_key(k)), "every entry present throughout was visited");
        assert!(Index::new().scan(0, |_, _| 0, |_, _| panic!("empty")) == 0);
    }

    #[test]
    fn insert_find_remove_relink_against_a_map() {
        let mut ix = Index::new();
        let mut model: HashMap<(u32, u32), u64> = HashMap::new();
        let mut x = 0x1234_5678_u64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..20_000u32 {
            // every 4th hash shares the home bucket and tag of another: probe chains and tag
            // collisions get exercised
            let h = if i % 4 == 0 { 0xABCD_0000_0000_0007 } else { rnd() };
            let (s, o) = loc_of(i);
            let hm = &model;
            ix.insert(h, s, o, |s, o| hm[&(s, o)]);
            model.insert((s, o), h);
            if i % 3 == 0 {
                // remove a random earlier one
                let j = (rnd() % (i as u64 + 1)) as u32;
                let l = loc_of(j);
                if let Some(h) = model.remove(&l) {
                    assert!(ix.remove(h, l.0, l.1));
                    assert!(!ix.remove(h, l.0, l.1));
                }
            }
            if i % 7 == 0 {
                let j = (rnd() % (i as u64 + 1)) as u32;
                let l = loc_of(j);
                if let Some(h) = model.remove(&l) {
                    let to = (l.0 + 100_000, l.1);
                    assert!(ix.relink(h, l, to));
                    model.insert(to, h);
                }
            }
        }
        assert_eq!(ix.len(), model.len());
        for (&(s, o), &h) in &model {
            assert_eq!(ix.find(h, |a, b| (a, b) == (s, o)), Some((s, o)));
        }
        assert_eq!(ix.find(0x5555_0000_0000_0001, |_, _| true), None);
        // remove everything: every displacement count returns to 0
        for (&(s, o), &h) in &model {
            assert!(ix.remove(h, s, o));
        }
        assert_eq!(ix.len(), 0);
        assert!(ix.buckets.iter().all(|b| b.over == 0 && b.slot.iter().all(|&s| s == 0)));
    }

    #[test]
    fn one_line_per_bucket_and_packing_round_trips() {
        assert_eq!(std::mem::size_of::<Bucket>(), 64);
        assert_eq!(std::mem::align_of::<Bucket>(), 64);
        for &(s, o) in &[(0, 0), (MAX_SEG, MAX_OFF), (12345, 65528)] {
            let p = pack(u64::MAX, s, o);
            assert_eq!(loc(p), (s, o));
            assert_ne!(p, 0);
            assert_eq!(slot_tag(pack(0, s, o)), 1);
        }
    }

    #[test]
    fn a_miss_ends_when_every_bucket_was_passed() {
        // Two buckets, each holding items displaced from the other: both
        // counts are non-zero, and a lookup of an absent key must still end.
        let mut ix = Index::new();
        ix.buckets = vec![Bucket::default(); 2];
        for i in 0..SLOTS as u32 {
            ix.place(pack(0x10, 0, i * 8), 0x10); // home 0
        }
        ix.place(pack(0x10, 1, 0), 0x10); // home 0, displaced into 1
        for i in 1..4u32 {
            ix.place(pack(0x11, 1, i * 8), 0x11); // home 1
        }
        ix.len = SLOTS + 4;
        // Free a slot of bucket 0 and displace an item homed at 1 into it.
        assert!(ix.remove(0x10, 0, 0));
        for i in 4..7u32 {
            ix.place(pack(0x11, 1, i * 8), 0x11);
        }
        ix.place(pack(0x11, 2, 0), 0x11); // bucket 1 full: goes round to 0
        assert!(ix.buckets.iter().all(|b| b.over > 0), "both buckets passed");
        assert_eq!(ix.find(0x5_0000_0000_0010, |_, _| true), None, "absent tag: a miss, in one lap");
        assert_eq!(ix.find(0x10, |s, o| (s, o) == (1, 0)), Some((1, 0)));
        assert!(ix.position(0x12, 9, 8).is_none());
    }

    #[test]
    fn lookup_stops_at_the_first_bucket_nobody_passed() {
        let mut ix = Index::new();
        let hash_of = |_: u32, _: u32| 0u64;
        // 7 items with the same hash fill one bucket; the 8th spills into the next
        for i in 0..8 {
            ix.insert(0, 0, i * 8, hash_of);
        }
        assert!(ix.buckets.len() >= 2);
        assert_eq!(ix.buckets[0].over, 1);
        assert_eq!(ix.find(0, |_, o| o == 56), Some((0, 56)));
        assert!(ix.remove(0, 0, 56));
        assert_eq!(ix.buckets[0].over, 0);
    }
}
