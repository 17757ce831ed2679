//! A get line's keys, located a few keys ahead of the one being served.
//!
//! A multi-get line is known whole before its first lookup, so its lookups need not take
//! their cache misses one after the other: while key `i` is served, the index line of key
//! `i + BUCKET_AHEAD` is requested, and the item of key `i + ITEM_AHEAD` (whose index line
//! was requested a few keys earlier and names it) too. Each key is split off the line and
//! hashed once, here; the prefetches are hints (a key that turns out to be another worker's
//! costs its hash, which dispatch needs anyway).

use crate::exec::{locate, Loc};
use mbal_cluster::KeySpace;

/// How many keys ahead the index line is requested.
pub(super) const BUCKET_AHEAD: usize = 8;
/// How many keys ahead the item is requested (its index line should be in by then).
pub(super) const ITEM_AHEAD: usize = 4;
/// Keys located and not served yet, at most `BUCKET_AHEAD + 1`.
const RING: usize = 16;
const _: () = assert!(RING.is_power_of_two() && RING > BUCKET_AHEAD && ITEM_AHEAD < BUCKET_AHEAD);

/// What to start loading for a located key: its index line, or the item it names.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Fetch {
    Bucket,
    Item,
}

pub(super) struct Ahead<'k, I> {
    keys: I,
    ring: [(&'k [u8], Loc); RING],
    /// Keys located so far, and served so far (`served <= located`).
    located: usize,
    served: usize,
}

impl<'k, I: Iterator<Item = &'k [u8]>> Ahead<'k, I> {
    pub fn new(keys: I) -> Self {
        Ahead { keys, ring: [(&[][..], Loc { hash: 0, cachelet: 0 }); RING], located: 0, served: 0 }
    }

    /// The next key in order with its location, after asking `fetch` to start loading what
    /// the lookups of the keys ahead of it will read.
    #[inline]
    pub fn next(&mut self, layout: &KeySpace, mut fetch: impl FnMut(Loc, Fetch)) -> Option<(&'k [u8], Loc)> {
        while self.located <= self.served + BUCKET_AHEAD {
            let Some(key) = self.keys.next() else { break };
            let at = locate(layout, key);
            fetch(at, Fetch::Bucket);
            self.ring[self.located % RING] = (key, at);
            self.located += 1;
        }
        if self.served == self.located {
            return None;
        }
        if self.served + ITEM_AHEAD < self.located {
            fetch(self.ring[(self.served + ITEM_AHEAD) % RING].1, Fetch::Item);
        }
        let next = self.ring[self.served % RING];
        self.served += 1;
        Some(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_in_order_each_prefetched_once_and_ahead() {
        let layout = KeySpace::even(64, 16_384);
        for n in [0usize, 1, 3, ITEM_AHEAD, BUCKET_AHEAD, BUCKET_AHEAD + 1, 100] {
            let line: Vec<u8> = (0..n).map(|i| format!("key{i}")).collect::<Vec<_>>().join(" ").into_bytes();
            let mut ahead = Ahead::new(line.split(|&b| b == b' ').filter(|k| !k.is_empty()));
            let mut got = Vec::new();
            let mut buckets = Vec::new();
            let mut items = Vec::new();
            loop {
                let mut fetched = Vec::new();
                let Some((key, at)) = ahead.next(&layout, |at, f| fetched.push((at.hash, f))) else { break };
                assert_eq!(at.hash, mbal_cluster::key_hash(key));
                assert_eq!(at.cachelet, layout.cachelet_of_hash(at.hash));
                let i = got.len();
                for (h, f) in fetched {
                    match f {
                        Fetch::Bucket => buckets.push(h),
                        Fetch::Item => items.push(h),
                    }
                }
                // The served key's bucket was asked for before it (or with it, for the first
                // keys), and keys up to BUCKET_AHEAD later are asked for too.
                assert_eq!(buckets.len(), n.min(i + BUCKET_AHEAD + 1), "key {i} of {n}");
                got.push(key.to_vec());
            }
            let want: Vec<Vec<u8>> = (0..n).map(|i| format!("key{i}").into_bytes()).collect();
            assert_eq!(got, want);
            let hashes: Vec<u64> = want.iter().map(|k| mbal_cluster::key_hash(k)).collect();
            assert_eq!(buckets, hashes, "every bucket once, in order");
            // Items of keys ITEM_AHEAD.. are asked for while earlier keys are served.
            assert_eq!(items, hashes[ITEM_AHEAD.min(n)..], "items once, ahead, in order");
        }
    }
}
