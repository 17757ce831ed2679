//! A moving cachelet's items on the wire between two servers (`mbal import data`,
//! docs/protocol.md "Cross-server migration"): records back to back, each
//!
//! ```text
//! tag u8 (0: an item, 1: a key that is gone) | hash u64 LE | key length u8 | key
//!   an item then: flags u32 LE | seconds to live u32 LE | value length u32 LE | value
//! ```
//!
//! No I/O here; [`decode`] checks every length against the bytes it has and against the
//! limits it is given (a frame comes from a peer, but a bad one must be an error, never a
//! panic or a huge allocation).

use crate::{DeltaItem, ExportedItem, ItemRef};

const PUT: u8 = 0;
const GONE: u8 = 1;
/// Bytes a record takes besides its key and value.
pub const RECORD_OVERHEAD: usize = 1 + 8 + 1 + 4 + 4 + 4;

/// A record lent in place (in a frame, or in the store's memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record<'a> {
    Put(ItemRef<'a>),
    Gone { hash: u64, key: &'a [u8] },
}

/// Append `d`'s record to `out`.
pub fn encode(d: &DeltaItem, out: &mut Vec<u8>) {
    match d {
        DeltaItem::Put(it) => encode_ref(Record::Put(it.as_ref()), out),
        DeltaItem::Gone { hash, key } => encode_ref(Record::Gone { hash: *hash, key }, out),
    }
}

/// Append a borrowed record to `out`.
pub fn encode_ref(r: Record<'_>, out: &mut Vec<u8>) {
    match r {
        Record::Put(it) => {
            head(out, PUT, it.hash, it.key);
            out.extend_from_slice(&it.flags.to_le_bytes());
            out.extend_from_slice(&it.ttl.to_le_bytes());
            out.extend_from_slice(&(it.value.len() as u32).to_le_bytes());
            out.extend_from_slice(it.value);
        }
        Record::Gone { hash, key } => head(out, GONE, hash, key),
    }
}

/// The bytes an item's record takes.
pub fn item_len(key: usize, value: usize) -> usize {
    RECORD_OVERHEAD + key + value
}

fn head(out: &mut Vec<u8>, tag: u8, hash: u64, key: &[u8]) {
    debug_assert!(key.len() <= u8::MAX as usize, "keys are at most 250 bytes");
    out.push(tag);
    out.extend_from_slice(&hash.to_le_bytes());
    out.push(key.len() as u8);
    out.extend_from_slice(key);
}

/// The bytes `d`'s record takes.
pub fn encoded_len(d: &DeltaItem) -> usize {
    match d {
        DeltaItem::Put(it) => RECORD_OVERHEAD + it.key.len() + it.value.len(),
        DeltaItem::Gone { key, .. } => 10 + key.len(),
    }
}

/// The records of a frame, in order; an error names what is wrong. A value longer than
/// `max_value` is an error.
pub fn decode(b: &[u8], max_value: usize) -> Result<Vec<DeltaItem>, &'static str> {
    let mut out = Vec::new();
    for_each(b, max_value, |r| {
        out.push(match r {
            Record::Put(it) => DeltaItem::Put(ExportedItem {
                hash: it.hash,
                key: it.key.to_vec(),
                value: it.value.to_vec(),
                flags: it.flags,
                ttl: it.ttl,
            }),
            Record::Gone { hash, key } => DeltaItem::Gone { hash, key: key.to_vec() },
        })
    })?;
    Ok(out)
}

/// Each record of a frame, in order, lent to `f` (no copy); an error names what is wrong
/// (the records before it were given).
pub fn for_each<'a>(mut b: &'a [u8], max_value: usize, mut f: impl FnMut(Record<'a>)) -> Result<(), &'static str> {
    while !b.is_empty() {
        let tag = b[0];
        let (hash, rest) = take_u64(&b[1..]).ok_or("a record cut short")?;
        let (&klen, rest) = rest.split_first().ok_or("a record cut short")?;
        let klen = usize::from(klen);
        if klen == 0 || rest.len() < klen {
            return Err("a record's key is empty or cut short");
        }
        let (key, rest) = rest.split_at(klen);
        b = match tag {
            GONE => {
                f(Record::Gone { hash, key });
                rest
            }
            PUT => {
                let (flags, rest) = take_u32(rest).ok_or("a record cut short")?;
                let (ttl, rest) = take_u32(rest).ok_or("a record cut short")?;
                let (vlen, rest) = take_u32(rest).ok_or("a record cut short")?;
                let vlen = vlen as usize;
                if vlen > max_value {
                    return Err("a value longer than the item size limit");
                }
                if rest.len() < vlen {
                    return Err("a record's value is cut short");
                }
                let (value, rest) = rest.split_at(vlen);
                f(Record::Put(ItemRef { hash, key, value, flags, ttl }));
                rest
            }
            _ => return Err("an unknown record tag"),
        };
    }
    Ok(())
}

fn take_u64(b: &[u8]) -> Option<(u64, &[u8])> {
    let (x, rest) = b.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*x), rest))
}

fn take_u32(b: &[u8]) -> Option<(u32, &[u8])> {
    let (x, rest) = b.split_first_chunk::<4>()?;
    Some((u32::from_le_bytes(*x), rest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn item(k: &[u8], v: &[u8]) -> DeltaItem {
        DeltaItem::Put(ExportedItem { hash: 7, key: k.to_vec(), value: v.to_vec(), flags: 3, ttl: 9 })
    }

    #[test]
    fn a_frame_reads_back_and_bad_ones_are_errors() {
        let recs = vec![item(b"a", b"xyz"), DeltaItem::Gone { hash: 1, key: b"bb".to_vec() }, item(b"c", b"")];
        let mut f = Vec::new();
        for r in &recs {
            encode(r, &mut f);
        }
        assert_eq!(f.len(), recs.iter().map(encoded_len).sum::<usize>());
        assert_eq!(decode(&f, 10).unwrap(), recs);
        assert!(decode(&f, 2).is_err(), "value over the limit");
        for cut in 1..f.len() {
            if let Ok(got) = decode(&f[..cut], 10) {
                // Only a cut between records reads back, as a prefix.
                assert_eq!(got[..], recs[..got.len()]);
            }
        }
        assert!(decode(&[9, 0, 0, 0, 0, 0, 0, 0, 0, 1, b'k'], 10).is_err());
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_fail_cleanly(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&b, 64);
        }

        #[test]
        fn any_records_round_trip(recs in proptest::collection::vec(
            (any::<bool>(), any::<u64>(), proptest::collection::vec(any::<u8>(), 1..40),
             proptest::collection::vec(any::<u8>(), 0..100), any::<u32>(), any::<u32>()), 0..20)) {
            let recs: Vec<DeltaItem> = recs.into_iter().map(|(put, hash, key, value, flags, ttl)| if put {
                DeltaItem::Put(ExportedItem { hash, key, value, flags, ttl })
            } else {
                DeltaItem::Gone { hash, key }
            }).collect();
            let mut f = Vec::new();
            for r in &recs { encode(r, &mut f); }
            prop_assert_eq!(decode(&f, 100).unwrap(), recs);
        }
    }
}
