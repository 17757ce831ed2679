//! The memcached 1.6 meta protocol: `mg`, `ms`, `md`, `ma`, `mn`, `me`.
//!
//! `m<c> <key> <flags>*\r\n`, and for ms `ms <key> <datalen> <flags>*\r\n<data>\r\n`.
//! A flag is one ASCII letter followed by an optional token (`v`, `T30`,
//! `Oabc`). The parser checks only syntax (letters, no duplicates, at most
//! [`MAX_META_FLAGS`], opaque length, key length); what each flag means is
//! up to the server.

use crate::reply::ErrReply;
use crate::text::{
    data_block, fail, next_token, num, split_spaces, E_ERROR, E_FORMAT, E_TOO_LARGE,
};
use crate::{valid_key, Limits, Parsed, Request, MAX_KEY_LEN};
use base64::Engine as _;
use std::str::FromStr;

pub use crate::reply::{write_b64, MetaReply};

/// Most flags one meta request may carry.
pub const MAX_META_FLAGS: usize = 24;
/// Longest opaque (`O`) token memcached accepts.
pub const MAX_OPAQUE_LEN: usize = 32;
/// Longest key token when flag `b` is given (base64 of 250 bytes).
pub const MAX_B64_KEY_LEN: usize = 4 * MAX_KEY_LEN.div_ceil(3);

/// Which meta command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetaKind {
    Get,
    Set,
    Delete,
    Arith,
    Noop,
    Debug,
}

/// One meta request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaCmd<'a> {
    pub kind: MetaKind,
    /// Raw key token as sent (still base64 if flag `b`); empty for `mn`.
    pub key: &'a [u8],
    /// Flags in request order.
    pub flags: MetaFlags<'a>,
    /// `ms` data block (without `\r\n`); empty otherwise.
    pub data: &'a [u8],
}

/// Flags of a meta request: a fixed-capacity list of (flag letter, token) in
/// request order plus a presence bitmask. Each letter occurs at most once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetaFlags<'a> {
    items: [(u8, &'a [u8]); MAX_META_FLAGS],
    len: u8,
    mask: u64,
}

fn bit(f: u8) -> Option<u64> {
    f.is_ascii_alphabetic().then(|| 1u64 << (f - b'A'))
}

impl<'a> MetaFlags<'a> {
    /// Is flag `f` present?
    pub fn has(&self, f: u8) -> bool {
        bit(f).is_some_and(|b| self.mask & b != 0)
    }
    /// The token of flag `f` (empty slice for a bare flag), if present.
    pub fn token(&self, f: u8) -> Option<&'a [u8]> {
        if !self.has(f) {
            return None;
        }
        self.iter().find(|&(g, _)| g == f).map(|(_, t)| t)
    }
    /// Flag `f` parsed as a number: `Ok(None)` if absent, `Err(())` if its token is not a valid `T`.
    #[allow(clippy::result_unit_err)]
    pub fn num<T: FromStr>(&self, f: u8) -> Result<Option<T>, ()> {
        match self.token(f) {
            None => Ok(None),
            Some(t) => num::<T>(t).map(Some).ok_or(()),
        }
    }
    /// (flag, token) pairs in request order.
    pub fn iter(&self) -> impl Iterator<Item = (u8, &'a [u8])> + '_ {
        self.items[..self.len as usize].iter().copied()
    }
    /// Number of flags.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Presence bitmask: bit `f - b'A'` is set for each flag letter `f`.
    pub fn mask(&self) -> u64 {
        self.mask
    }
}

/// Decode the key: if flag `b`, base64-decode into `scratch` and return it; else return the key.
pub fn meta_key<'k>(cmd: &MetaCmd<'k>, scratch: &'k mut [u8; 256]) -> Result<&'k [u8], ErrReply> {
    if !cmd.flags.has(b'b') {
        return Ok(cmd.key);
    }
    let n = base64::engine::general_purpose::STANDARD
        .decode_slice(cmd.key, &mut scratch[..])
        .map_err(|_| ErrReply::Text("CLIENT_ERROR error decoding key"))?;
    if n == 0 || n > MAX_KEY_LEN {
        return Err(ErrReply::Text(E_FORMAT));
    }
    Ok(&scratch[..n])
}

/// Parse a meta command line (`m` + `which`), `rest` = the line after the command token.
pub(crate) fn parse_line<'a>(
    which: u8,
    rest: &'a [u8],
    buf: &'a [u8],
    line_len: usize,
    limits: &Limits,
) -> Parsed<'a> {
    let kind = match which {
        b'g' => MetaKind::Get,
        b's' => MetaKind::Set,
        b'd' => MetaKind::Delete,
        b'a' => MetaKind::Arith,
        b'n' => MetaKind::Noop,
        b'e' => MetaKind::Debug,
        _ => return fail(E_ERROR, line_len),
    };
    if kind == MetaKind::Noop {
        let cmd = MetaCmd {
            kind,
            key: &[],
            flags: MetaFlags::default(),
            data: &[],
        };
        return Parsed::Req {
            req: Request::Meta(cmd),
            consumed: line_len,
        };
    }
    let Some((key, mut rest)) = next_token(rest) else {
        return fail(
            if kind == MetaKind::Get {
                E_ERROR
            } else {
                E_FORMAT
            },
            line_len,
        );
    };
    let mut vlen = 0usize;
    if kind == MetaKind::Set {
        let Some((len_tok, r)) = next_token(rest) else {
            return fail(E_FORMAT, line_len);
        };
        rest = r;
        match num::<i64>(len_tok) {
            Some(v) if (0..=(i32::MAX - 2) as i64).contains(&v) => vlen = v as usize,
            _ => return fail(E_FORMAT, line_len),
        }
    }
    let (e_invalid, e_dup) = match kind {
        MetaKind::Delete | MetaKind::Arith => (
            "CLIENT_ERROR invalid or duplicate flag",
            "CLIENT_ERROR invalid or duplicate flag",
        ),
        _ => ("CLIENT_ERROR invalid flag", "CLIENT_ERROR duplicate flag"),
    };
    let mut flags = MetaFlags::default();
    for tok in split_spaces(rest) {
        let f = tok[0];
        let Some(b) = bit(f) else {
            return fail(e_invalid, line_len);
        };
        if flags.mask & b != 0 {
            return fail(e_dup, line_len);
        }
        if flags.len as usize == MAX_META_FLAGS {
            return fail("CLIENT_ERROR options flags are too long", line_len);
        }
        let t = &tok[1..];
        if f == b'O' && t.len() > MAX_OPAQUE_LEN {
            return fail("CLIENT_ERROR opaque token too long", line_len);
        }
        flags.items[flags.len as usize] = (f, t);
        flags.len += 1;
        flags.mask |= b;
    }
    let key_ok = if flags.has(b'b') {
        !key.is_empty()
            && key.len() <= MAX_B64_KEY_LEN
            && key.iter().all(|&c| c > b' ' && c != 0x7f)
    } else {
        valid_key(key)
    };
    if !key_ok {
        return fail(E_FORMAT, line_len);
    }
    let mut data: &[u8] = &[];
    let mut consumed = line_len;
    if kind == MetaKind::Set {
        if vlen > limits.max_item_size {
            return fail(E_TOO_LARGE, line_len + vlen + 2);
        }
        data = match data_block(buf, line_len, vlen, false) {
            Ok(d) => d,
            Err(p) => return p,
        };
        consumed = line_len + vlen + 2;
    }
    Parsed::Req {
        req: Request::Meta(MetaCmd {
            kind,
            key,
            flags,
            data,
        }),
        consumed,
    }
}
