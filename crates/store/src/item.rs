//! Item layout inside a segment (little endian, 8-byte aligned):
//!
//! ```text
//! 0  hash u64 | 8 cas u64 | 16 exptime u32 | 20 set_time u32 | 24 last_access u32
//! 28 flags u32 | 32 vlen u32 | 36 klen u8 | 37 bits u8 | 38 slack u16 | 40 key | value | pad
//! ```
//! `slack` is unused space after the value (an in-place shrink by incr/decr), so the item's
//! footprint `align8(HDR + klen + vlen + slack)` never changes once written.

pub(crate) const HDR: usize = 40;
pub(crate) const MAX_KEY: usize = 250;

pub(crate) const DEAD: u8 = 1;
pub(crate) const FETCHED: u8 = 2;
pub(crate) const STALE: u8 = 4;
pub(crate) const WIN: u8 = 8;
/// Read since it was written or last kept by eviction (the CLOCK bit).
pub(crate) const ACCESSED: u8 = 16;
/// Counted in the `stats sizes` histogram (`store/sizes.rs`).
pub(crate) const SIZED: u8 = 32;

#[inline]
pub(crate) fn footprint(klen: usize, vlen: usize) -> usize {
    (HDR + klen + vlen + 7) & !7
}

#[inline]
fn rd32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}
#[inline]
fn rd64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}
#[inline]
fn wr32(b: &mut [u8], o: usize, v: u32) {
    b[o..o + 4].copy_from_slice(&v.to_le_bytes());
}
#[inline]
fn wr64(b: &mut [u8], o: usize, v: u64) {
    b[o..o + 8].copy_from_slice(&v.to_le_bytes());
}

/// Field accessors on a segment buffer at item offset `o`.
pub(crate) struct It;

impl It {
    #[inline]
    pub fn hash(b: &[u8], o: usize) -> u64 {
        rd64(b, o)
    }
    #[inline]
    pub fn cas(b: &[u8], o: usize) -> u64 {
        rd64(b, o + 8)
    }
    #[inline]
    pub fn set_cas(b: &mut [u8], o: usize, v: u64) {
        wr64(b, o + 8, v)
    }
    #[inline]
    pub fn exptime(b: &[u8], o: usize) -> u32 {
        rd32(b, o + 16)
    }
    #[inline]
    pub fn set_exptime(b: &mut [u8], o: usize, v: u32) {
        wr32(b, o + 16, v)
    }
    #[inline]
    pub fn set_time(b: &[u8], o: usize) -> u32 {
        rd32(b, o + 20)
    }
    #[inline]
    pub fn last_access(b: &[u8], o: usize) -> u32 {
        rd32(b, o + 24)
    }
    #[inline]
    pub fn set_last_access(b: &mut [u8], o: usize, v: u32) {
        wr32(b, o + 24, v)
    }
    #[inline]
    pub fn flags(b: &[u8], o: usize) -> u32 {
        rd32(b, o + 28)
    }
    #[inline]
    pub fn vlen(b: &[u8], o: usize) -> usize {
        rd32(b, o + 32) as usize
    }
    #[inline]
    pub fn klen(b: &[u8], o: usize) -> usize {
        b[o + 36] as usize
    }
    #[inline]
    pub fn bits(b: &[u8], o: usize) -> u8 {
        b[o + 37]
    }
    #[inline]
    pub fn set_bits(b: &mut [u8], o: usize, v: u8) {
        b[o + 37] = v
    }
    #[inline]
    pub fn slack(b: &[u8], o: usize) -> usize {
        u16::from_le_bytes([b[o + 38], b[o + 39]]) as usize
    }
    #[inline]
    pub fn size(b: &[u8], o: usize) -> usize {
        footprint(Self::klen(b, o), Self::vlen(b, o) + Self::slack(b, o))
    }
    #[inline]
    pub fn key(b: &[u8], o: usize) -> &[u8] {
        let k = Self::klen(b, o);
        &b[o + HDR..o + HDR + k]
    }
    #[inline]
    pub fn value(b: &[u8], o: usize) -> &[u8] {
        let k = Self::klen(b, o);
        let v = Self::vlen(b, o);
        &b[o + HDR + k..o + HDR + k + v]
    }
    #[inline]
    pub fn value_mut(b: &mut [u8], o: usize) -> &mut [u8] {
        let k = Self::klen(b, o);
        let v = Self::vlen(b, o);
        &mut b[o + HDR + k..o + HDR + k + v]
    }
    /// Shrink the value in place to `new_len`, moving the difference to slack.
    pub fn shrink_value(b: &mut [u8], o: usize, new_len: usize) {
        let v = Self::vlen(b, o);
        debug_assert!(new_len <= v);
        let slack = Self::slack(b, o) + (v - new_len);
        wr32(b, o + 32, new_len as u32);
        b[o + 38..o + 40].copy_from_slice(&(slack as u16).to_le_bytes());
    }

    /// Write a full item header + key; the value area (`vlen` bytes) is returned for filling.
    #[allow(clippy::too_many_arguments)]
    pub fn write<'b>(
        b: &'b mut [u8],
        o: usize,
        hash: u64,
        cas: u64,
        exptime: u32,
        now: u32,
        flags: u32,
        key: &[u8],
        vlen: usize,
        bits: u8,
    ) -> &'b mut [u8] {
        wr64(b, o, hash);
        wr64(b, o + 8, cas);
        wr32(b, o + 16, exptime);
        wr32(b, o + 20, now);
        wr32(b, o + 24, now);
        wr32(b, o + 28, flags);
        wr32(b, o + 32, vlen as u32);
        b[o + 36] = key.len() as u8;
        b[o + 37] = bits;
        b[o + 38] = 0;
        b[o + 39] = 0;
        b[o + HDR..o + HDR + key.len()].copy_from_slice(key);
        let vs = o + HDR + key.len();
        &mut b[vs..vs + vlen]
    }
}
