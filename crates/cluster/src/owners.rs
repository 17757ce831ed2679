//! Every cachelet's owner, as a [`crate::ClusterMap`] holds them: shared
//! between the copies of a map until one changes.
//!
//! Why: a map is copied into every holder (each server's controller core,
//! the coordinator, clients, `mbal sim`'s thousands of cores), and most
//! copies change a few owners or none. A plain `Vec` made each copy cost the
//! whole table (10 MB at 10,000 servers x 16 workers x 16 cachelets, for
//! each of the sim's 10,000 cores). Here the owners sit in chunks of
//! [`CHUNK`] behind `Arc`s: cloning a map clones one `Arc`, and changing an
//! owner copies the chunk list (one pointer per chunk) and that chunk only,
//! when they are shared (`Arc::make_mut`). Reading an owner is one more
//! index than a `Vec`; the data path routes with its own tables
//! (`Router`, the server's route table), not with this.

use crate::Owner;
use std::sync::Arc;

/// Owners per chunk.
pub const CHUNK: usize = 4096;

/// Every cachelet's owner, by cachelet id (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owners {
    len: usize,
    chunks: Arc<Vec<Arc<Vec<Owner>>>>,
}

impl Owners {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Owner of cachelet `i`; panics past the end, as a slice does.
    #[inline]
    pub fn get(&self, i: usize) -> Owner {
        assert!(i < self.len, "cachelet {i} of {}", self.len);
        self.chunks[i / CHUNK][i % CHUNK]
    }

    /// Give cachelet `i` to `o` (copying the chunk first if another map shares it).
    pub fn set(&mut self, i: usize, o: Owner) {
        assert!(i < self.len, "cachelet {i} of {}", self.len);
        let chunks = Arc::make_mut(&mut self.chunks);
        Arc::make_mut(&mut chunks[i / CHUNK])[i % CHUNK] = o;
    }

    pub fn iter(&self) -> impl Iterator<Item = &Owner> + '_ {
        self.chunks.iter().flat_map(|c| c.iter())
    }

    pub fn to_vec(&self) -> Vec<Owner> {
        self.iter().copied().collect()
    }

    /// Do `self` and `other` share their storage (no owner of either was changed since one
    /// was cloned from the other)?
    pub fn shares_with(&self, other: &Owners) -> bool {
        Arc::ptr_eq(&self.chunks, &other.chunks)
    }
}

impl From<Vec<Owner>> for Owners {
    fn from(v: Vec<Owner>) -> Owners {
        let len = v.len();
        let chunks = v.chunks(CHUNK).map(|c| Arc::new(c.to_vec())).collect();
        Owners { len, chunks: Arc::new(chunks) }
    }
}

impl<'a> IntoIterator for &'a Owners {
    type Item = &'a Owner;
    type IntoIter = Box<dyn Iterator<Item = &'a Owner> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_clone_shares_until_one_changes_and_then_only_that_chunk_is_copied() {
        let v: Vec<Owner> = (0..3 * CHUNK + 5).map(|i| ((i % 7) as u16, (i % 3) as u16)).collect();
        let a = Owners::from(v.clone());
        let mut b = a.clone();
        assert!(a.shares_with(&b));
        b.set(CHUNK + 1, (9, 9));
        assert!(!a.shares_with(&b));
        assert_eq!(a.to_vec(), v, "the original is untouched");
        assert_eq!(b.get(CHUNK + 1), (9, 9));
        assert!(Arc::ptr_eq(&a.chunks[0], &b.chunks[0]), "other chunks still shared");
        assert!(!Arc::ptr_eq(&a.chunks[1], &b.chunks[1]));
        assert_eq!(b.iter().count(), v.len());
    }

    proptest! {
        /// Against a plain Vec: the same owners after any sets, in any copy.
        #[test]
        fn behaves_as_a_vec(len in 1usize..3 * CHUNK, sets in proptest::collection::vec((0usize..3 * CHUNK, 0u16..5, 0u16..5), 0..40)) {
            let mut model: Vec<Owner> = vec![(0, 0); len];
            let mut o = Owners::from(model.clone());
            let before = o.clone();
            for (i, s, w) in sets {
                let i = i % len;
                model[i] = (s, w);
                o.set(i, (s, w));
            }
            prop_assert_eq!(o.to_vec(), model.clone());
            prop_assert_eq!(o.len(), model.len());
            for (i, &m) in model.iter().enumerate() {
                prop_assert_eq!(o.get(i), m);
            }
            prop_assert_eq!(before.to_vec(), vec![(0, 0); len]);
            prop_assert_eq!(o == Owners::from(model), true);
        }
    }
}
