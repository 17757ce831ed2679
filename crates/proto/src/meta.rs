//! The memcached 1.6 meta protocol: `mg`, `ms`, `md`, `ma`, `mn`, `me`.
//!
//! `m<c> <key> <flags>*\r\n`, and for ms `ms <key> <datalen> <flags>*\r\n<data>\r\n`.
//! A flag is one ASCII letter followed by an optional token (`v`, `T30`,
//! `Oabc`). The parser checks only syntax (letters, no duplicates, at most
//! [`MAX_META_FLAGS`], opaque length, key length); what each flag means is
//! up to the server.

use crate::reply::ErrReply;
use crate::text::{data_block, fail, next_token, num, split_spaces, E_ERROR, E_FORMAT, E_TOO_LARGE};
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
    toks: [&'a [u8]; MAX_META_FLAGS],
    letters: [u8; MAX_META_FLAGS],
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
        let n = self.len as usize;
        self.letters[..n].iter().copied().zip(self.toks[..n].iter().copied())
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
pub(crate) fn parse_line<'a>(which: u8, rest: &'a [u8], buf: &'a [u8], line_len: usize, limits: &Limits) -> Parsed<'a> {
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
        let cmd = MetaCmd { kind, key: &[], flags: MetaFlags::default(), data: &[] };
        return Parsed::Req { req: Request::Meta(cmd), consumed: line_len };
    }
    let Some((key, mut rest)) = next_token(rest) else {
        return fail(if kind == MetaKind::Get { E_ERROR } else { E_FORMAT }, line_len);
    };
    if key.len() > MAX_B64_KEY_LEN {
        return fail(E_FORMAT, line_len);
    }
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
        MetaKind::Delete | MetaKind::Arith => {
            ("CLIENT_ERROR invalid or duplicate flag", "CLIENT_ERROR invalid or duplicate flag")
        }
        _ => ("CLIENT_ERROR invalid flag", "CLIENT_ERROR duplicate flag"),
    };
    if split_spaces(rest).count() > MAX_META_FLAGS {
        // memcached's wording differs between ms and the others.
        let msg = if kind == MetaKind::Set {
            "CLIENT_ERROR options flags too long"
        } else {
            "CLIENT_ERROR options flags are too long"
        };
        return fail(msg, line_len);
    }
    // Once ms has a valid length, memcached swallows its data block on flag errors.
    let flag_skip = if kind == MetaKind::Set { line_len + vlen + 2 } else { line_len };
    let mut flags = MetaFlags::default();
    for tok in split_spaces(rest) {
        let f = tok[0];
        let Some(b) = bit(f) else {
            return fail(e_invalid, flag_skip);
        };
        if flags.mask & b != 0 {
            return fail(e_dup, flag_skip);
        }
        let t = &tok[1..];
        if f == b'O' && t.len() > MAX_OPAQUE_LEN {
            return fail("CLIENT_ERROR opaque token too long", flag_skip);
        }
        flags.letters[flags.len as usize] = f;
        flags.toks[flags.len as usize] = t;
        flags.len += 1;
        flags.mask |= b;
    }
    let key_ok = if flags.has(b'b') {
        !key.is_empty() && key.len() <= MAX_B64_KEY_LEN && key.iter().all(|&c| c > b' ' && c != 0x7f)
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
    Parsed::Req { req: Request::Meta(MetaCmd { kind, key, flags, data }), consumed }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::text::E_CHUNK;
    use crate::Protocol::Text as T;

    fn cmd(buf: &[u8]) -> MetaCmd<'_> {
        match whole(T, buf) {
            Request::Meta(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn mg_flags_in_order() {
        let c = cmd(b"mg foo v c T30 Oab k\r\n");
        assert_eq!(c.kind, MetaKind::Get);
        assert_eq!(c.key, b"foo");
        assert!(c.data.is_empty());
        let f: Vec<(u8, &[u8])> = c.flags.iter().collect();
        assert_eq!(f, [(b'v', &b""[..]), (b'c', b""), (b'T', b"30"), (b'O', b"ab"), (b'k', b"")]);
        assert!(c.flags.has(b'v') && c.flags.has(b'T') && !c.flags.has(b'q') && !c.flags.has(b'1'));
        assert_eq!(c.flags.token(b'O'), Some(&b"ab"[..]));
        assert_eq!(c.flags.token(b'x'), None);
        assert_eq!(c.flags.num::<i64>(b'T'), Ok(Some(30)));
        assert_eq!(c.flags.num::<i64>(b'N'), Ok(None));
        assert_eq!(c.flags.num::<i64>(b'O'), Err(()));
        assert_eq!(c.flags.num::<u32>(b'v'), Err(()));
        assert_eq!(c.flags.len(), 5);
        assert_eq!(cmd(b"mg foo\n").flags.len(), 0);
    }

    #[test]
    fn ms_md_ma_me_mn() {
        let c = cmd(b"ms k 5 T10 F3 MS I\r\nhello\r\n");
        assert_eq!((c.kind, c.key, c.data), (MetaKind::Set, &b"k"[..], &b"hello"[..]));
        assert_eq!(c.flags.token(b'M'), Some(&b"S"[..]));
        assert!(c.flags.has(b'I'));
        let c = cmd(b"ms k 0\r\n\r\n");
        assert_eq!(c.data, b"");
        assert_eq!(cmd(b"md k q C5\r\n").kind, MetaKind::Delete);
        let c = cmd(b"ma k D10 MD N0 J5\r\n");
        assert_eq!((c.kind, c.flags.num::<u64>(b'D')), (MetaKind::Arith, Ok(Some(10))));
        assert_eq!(cmd(b"me k\r\n").kind, MetaKind::Debug);
        let c = cmd(b"mn\r\n");
        assert_eq!((c.kind, c.key, c.flags.len()), (MetaKind::Noop, &b""[..], 0));
        assert_eq!(cmd(b"mn ignored\r\n").kind, MetaKind::Noop);
    }

    #[test]
    fn meta_errors() {
        assert_eq!(terr(b"mg\r\n"), ("ERROR", 4, false));
        assert_eq!(terr(b"me\r\n").0, E_FORMAT);
        assert_eq!(terr(b"md\r\n").0, E_FORMAT);
        assert_eq!(terr(b"mz a\r\n").0, "ERROR");
        assert_eq!(terr(b"mg a v v\r\n").0, "CLIENT_ERROR duplicate flag");
        assert_eq!(terr(b"mg a !\r\n").0, "CLIENT_ERROR invalid flag");
        assert_eq!(terr(b"md a 1\r\n").0, "CLIENT_ERROR invalid or duplicate flag");
        assert_eq!(terr(b"ma a q q\r\n").0, "CLIENT_ERROR invalid or duplicate flag");
        assert_eq!(terr(b"ms a\r\n").0, E_FORMAT);
        assert_eq!(terr(b"ms a x\r\n").0, E_FORMAT);
        assert_eq!(terr(b"ms a -1\r\n").0, E_FORMAT);
        let long = [b"mg ".as_slice(), &[b'k'; 251], b" v\r\n"].concat();
        assert_eq!(terr(&long).0, E_FORMAT);
        let many: String = (b'A'..=b'Z').map(|c| format!(" {}", c as char)).collect();
        assert_eq!(terr(format!("mg a{many}\r\n").as_bytes()).0, "CLIENT_ERROR options flags are too long");
        let o33 = format!("mg a O{}\r\n", "x".repeat(33));
        assert_eq!(terr(o33.as_bytes()).0, "CLIENT_ERROR opaque token too long");
        let o32 = format!("mg a O{}\r\n", "x".repeat(32));
        assert!(matches!(p(T, o32.as_bytes()), Parsed::Req { .. }));
        // data chunk errors and too large (never silenced in meta, even with q)
        assert_eq!(terr(b"ms a 2 T1\r\nxyz\r\n"), (E_CHUNK, 15, false));
        assert_eq!(terr(b"ms a 2000000 q\r\n"), (E_TOO_LARGE, 16 + 2_000_002, false));
        // ms flag errors swallow the data block; too many flags / long keys do not
        assert_eq!(terr(b"ms a 1 !\r\nx\r\n"), ("CLIENT_ERROR invalid flag", 13, false));
        assert_eq!(terr(b"ms a 1 T1 T2\r\nx\r\n"), ("CLIENT_ERROR duplicate flag", 17, false));
        let o33 = format!("ms a 1 O{}\r\nx\r\n", "x".repeat(33));
        assert_eq!(terr(o33.as_bytes()), ("CLIENT_ERROR opaque token too long", o33.len(), false));
        let many = format!("ms a 1{many}\r\nx\r\n");
        assert_eq!(terr(many.as_bytes()), ("CLIENT_ERROR options flags too long", many.len() - 3, false));
        let long = [b"ms ".as_slice(), &[b'k'; 251], b" 1\r\nx\r\n"].concat();
        assert_eq!(terr(&long), (E_FORMAT, long.len() - 3, false));
    }

    #[test]
    fn base64_keys() {
        let c = cmd(b"mg YWJj b v\r\n");
        let mut s = [0u8; 256];
        assert_eq!(meta_key(&c, &mut s), Ok(&b"abc"[..]));
        let c = cmd(b"mg *** b v\r\n");
        let mut s = [0u8; 256];
        assert_eq!(meta_key(&c, &mut s), Err(ErrReply::Text("CLIENT_ERROR error decoding key")));
        let c = cmd(b"mg abc v\r\n");
        let mut s = [0u8; 256];
        assert_eq!(meta_key(&c, &mut s), Ok(&b"abc"[..]));
        // 250 raw bytes encode to 336 chars: accepted with b, decoded back
        let raw = [0xabu8; 250];
        let mut enc = Vec::new();
        write_b64(&mut enc, &raw);
        assert_eq!(enc.len(), MAX_B64_KEY_LEN);
        let line = [b"mg ".as_slice(), &enc, b" b\r\n"].concat();
        let c = cmd(&line);
        let mut s = [0u8; 256];
        assert_eq!(meta_key(&c, &mut s), Ok(&raw[..]));
        // 251 raw bytes: too long after decoding
        let mut enc = Vec::new();
        write_b64(&mut enc, &[1u8; 251]);
        let line = [b"mg ".as_slice(), &enc, b" b\r\n"].concat();
        match p(T, &line) {
            Parsed::Req { req: Request::Meta(c), .. } => {
                let mut s = [0u8; 256];
                assert_eq!(meta_key(&c, &mut s), Err(ErrReply::Text(E_FORMAT)));
            }
            Parsed::Err { reply, .. } => assert_eq!(reply, ErrReply::Text(E_FORMAT)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ms_pipelined_and_incremental() {
        let buf = b"ms a 3 T0\r\nabc\r\nmn\r\n";
        whole(T, &buf[..16]);
        match p(T, buf) {
            Parsed::Req { consumed: 16, .. } => {}
            other => panic!("{other:?}"),
        }
        assert!(matches!(p(T, &buf[16..]), Parsed::Req { consumed: 4, .. }));
    }
}
