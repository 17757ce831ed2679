//! The memcached 1.6 meta protocol: `mg`, `ms`, `md`, `ma`, `mn`, `me`.
//!
//! `m<c> <key> <flags>*\r\n`, and for ms `ms <key> <datalen> <flags>*\r\n<data>\r\n`.
//! A flag is one ASCII letter followed by an optional token (`v`, `T30`,
//! `Oabc`). The parser checks only syntax (letters, no duplicates, at most
//! [`MAX_META_FLAGS`], opaque length, key length); what each flag means is
//! up to the server.

use crate::reply::ErrReply;
use crate::text::{data_block, fail, next_token, num, split_spaces, Decimal, E_ERROR, E_FORMAT, E_TOO_LARGE};
use crate::{valid_key, Limits, Parsed, Request, MAX_KEY_LEN};
use base64::Engine as _;

pub use crate::reply::{write_b64, MetaReply};

/// Most flags one meta request may carry.
pub const MAX_META_FLAGS: usize = 24;
/// Longest opaque (`O`) token memcached accepts.
pub const MAX_OPAQUE_LEN: usize = 32;
/// Most flags memcached accepts on `mg`, `md`, `ma` (its 20 tokens, less command, key and end).
pub const MAX_FLAGS: usize = 17;
/// Most flags memcached accepts on `ms` (one token fewer: the data length).
pub const MAX_FLAGS_SET: usize = 16;

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
#[derive(Debug, Clone, Copy, Default)]
pub struct MetaFlags<'a> {
    /// The part of the line the tokens are in; each token is `spans[i]` (start, length) of
    /// it: offsets, not slices, so that a parsed request stays small (it is moved by value).
    base: &'a [u8],
    spans: [(u32, u32); MAX_META_FLAGS],
    letters: [u8; MAX_META_FLAGS],
    len: u8,
    mask: u64,
}

/// Equal when they hold the same flags with the same tokens, in the same order (wherever the
/// tokens are).
impl PartialEq for MetaFlags<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.mask == other.mask && self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for MetaFlags<'_> {}

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
    pub fn num<T: Decimal>(&self, f: u8) -> Result<Option<T>, ()> {
        match self.token(f) {
            None => Ok(None),
            Some(t) => num::<T>(t).map(Some).ok_or(()),
        }
    }
    /// (flag, token) pairs in request order.
    pub fn iter(&self) -> impl Iterator<Item = (u8, &'a [u8])> + '_ {
        let n = self.len as usize;
        let base = self.base;
        self.letters[..n].iter().copied().zip(self.spans[..n].iter().map(move |&(at, len)| {
            let at = at as usize;
            &base[at..at + len as usize]
        }))
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

/// Flag letters memcached 1.6 accepts on `mg`/`ms`/`md`/`ma` (its `_meta_flag_preparse`),
/// plus `E` (explicit CAS, from newer memcached releases; see docs/protocol.md).
fn known_flag(f: u8) -> bool {
    matches!(
        f,
        b'b' | b'N'
            | b'T'
            | b'R'
            | b'l'
            | b'O'
            | b'P'
            | b'L'
            | b'k'
            | b's'
            | b't'
            | b'c'
            | b'f'
            | b'v'
            | b'h'
            | b'u'
            | b'q'
            | b'F'
            | b'C'
            | b'M'
            | b'J'
            | b'D'
            | b'I'
            | b'E'
    )
}

/// memcached's check of a flag's token (`safe_strtol`/`safe_strtoul`/`safe_strtoull`):
/// the error it records for a bad one, if any.
fn flag_token_error(f: u8, t: &[u8]) -> Option<&'static str> {
    const BAD_TOKEN: &str = "CLIENT_ERROR bad token in command line format";
    let ok = match f {
        b'N' | b'T' | b'R' => num::<i64>(t).is_some(),
        b'C' | b'E' => num::<u64>(t).is_some(),
        // memcached parses F as an unsigned long and keeps the low 32 bits; a bad F
        // leaves the default message.
        b'F' => return num::<u64>(t).is_none().then_some(E_FORMAT),
        b'M' => return (t.len() != 1).then_some("CLIENT_ERROR incorrect length for M token"),
        b'J' => return num::<u64>(t).is_none().then_some("CLIENT_ERROR invalid numeric initial value"),
        b'D' => return num::<u64>(t).is_none().then_some("CLIENT_ERROR invalid numeric delta value"),
        _ => true,
    };
    (!ok).then_some(BAD_TOKEN)
}

/// Does a base64 key token decode to 1..=250 bytes?
fn b64_key_ok(key: &[u8]) -> bool {
    let mut scratch = [0u8; 256];
    matches!(base64::engine::general_purpose::STANDARD.decode_slice(key, &mut scratch[..]), Ok(n) if n > 0)
}

/// Parse a meta command line (`m` + `which`), `rest` = the line after the command token.
///
/// Errors follow memcached 1.6.18 (`proto_text.c`): the key token (base64 or not) is at
/// most 250 bytes; at most 17 flags (16 on `ms`); flags are checked in order, an unknown
/// or repeated one ends the check at once, bad tokens are noted and the last one's message
/// wins; `md` and `ma` say `invalid or duplicate flag` for all of these; then the opaque's
/// length and `ms`/`ma`'s mode. `me` looks only at whether its first flag is `b`.
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
    if key.len() > MAX_KEY_LEN {
        return fail(E_FORMAT, line_len);
    }
    if kind == MetaKind::Debug {
        let mut flags = MetaFlags::default();
        if next_token(rest).is_some_and(|(t, _)| t == b"b") {
            if !b64_key_ok(key) {
                return fail(E_FORMAT, line_len);
            }
            flags.letters[0] = b'b';
            flags.len = 1;
            flags.mask = bit(b'b').unwrap_or(0);
        } else if !valid_key(key) {
            return fail(E_FORMAT, line_len);
        }
        return Parsed::Req { req: Request::Meta(MetaCmd { kind, key, flags, data: &[] }), consumed: line_len };
    }
    let mut vlen = 0usize;
    if kind == MetaKind::Set {
        let Some((len_tok, r)) = next_token(rest) else {
            return fail(E_FORMAT, line_len);
        };
        if split_spaces(r).count() > MAX_FLAGS_SET {
            return fail("CLIENT_ERROR options flags too long", line_len);
        }
        rest = r;
        match num::<i64>(len_tok) {
            Some(v) if (0..=(i32::MAX - 2) as i64).contains(&v) => vlen = v as usize,
            _ => return fail(E_FORMAT, line_len),
        }
    } else if split_spaces(rest).count() > MAX_FLAGS {
        // memcached's wording differs between mg and the others.
        let msg = if kind == MetaKind::Get {
            "CLIENT_ERROR options flags are too long"
        } else {
            "CLIENT_ERROR options flags too long"
        };
        return fail(msg, line_len);
    }
    // md and ma report every flag error with one message.
    let one_msg = matches!(kind, MetaKind::Delete | MetaKind::Arith);
    // Once ms has a valid length, memcached swallows its data block on flag errors.
    let flag_skip = if kind == MetaKind::Set { line_len + vlen + 2 } else { line_len };
    let flag_fail =
        |msg: &'static str| fail(if one_msg { "CLIENT_ERROR invalid or duplicate flag" } else { msg }, flag_skip);
    let mut flags = MetaFlags { base: rest, ..MetaFlags::default() };
    let mut noted: Option<&'static str> = None;
    for tok in split_spaces(rest) {
        let f = tok[0];
        if f >= 127 || flags.has(f) {
            return flag_fail("CLIENT_ERROR duplicate flag");
        }
        let Some(b) = bit(f).filter(|_| known_flag(f)) else {
            return flag_fail("CLIENT_ERROR invalid flag");
        };
        let t = &tok[1..];
        if let Some(e) = flag_token_error(f, t) {
            noted = Some(e);
        }
        if f == b'b' && !b64_key_ok(key) {
            noted = Some("CLIENT_ERROR error decoding key");
        }
        flags.letters[flags.len as usize] = f;
        let at = t.as_ptr() as usize - rest.as_ptr() as usize;
        flags.spans[flags.len as usize] = (at as u32, t.len() as u32);
        flags.len += 1;
        flags.mask |= b;
    }
    if let Some(e) = noted {
        return flag_fail(e);
    }
    if flags.token(b'O').is_some_and(|t| t.len() > MAX_OPAQUE_LEN) {
        return fail("CLIENT_ERROR opaque token too long", flag_skip);
    }
    match (kind, flags.token(b'M')) {
        (MetaKind::Set, Some(m)) if !matches!(m, b"E" | b"A" | b"P" | b"R" | b"S") => {
            return fail("CLIENT_ERROR invalid mode for ms M token", flag_skip);
        }
        (MetaKind::Arith, Some(m)) if !matches!(m, b"I" | b"+" | b"D" | b"-") => {
            return fail("CLIENT_ERROR invalid mode for ma M token", line_len);
        }
        _ => {}
    }
    if !flags.has(b'b') && !valid_key(key) {
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
        assert_eq!(terr(b"ma a q T1 q\r\n").0, "CLIENT_ERROR invalid or duplicate flag");
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
        let c = cmd(b"mg abc v\r\n");
        let mut s = [0u8; 256];
        assert_eq!(meta_key(&c, &mut s), Ok(&b"abc"[..]));
        // memcached limits the key token to 250 bytes, base64 or not: 187 raw bytes
        // (252 chars) are refused, 186 (248 chars) accepted and decoded back.
        let mut enc = Vec::new();
        write_b64(&mut enc, &[0xab; 187]);
        let line = [b"mg ".as_slice(), &enc, b" b\r\n"].concat();
        assert_eq!(terr(&line).0, E_FORMAT);
        let raw = [0xabu8; 186];
        let mut enc = Vec::new();
        write_b64(&mut enc, &raw);
        let line = [b"mg ".as_slice(), &enc, b" b\r\n"].concat();
        let c = cmd(&line);
        let mut s = [0u8; 256];
        assert_eq!(meta_key(&c, &mut s), Ok(&raw[..]));
        // undecodable: mg/ms say so, md/ma report a flag error, me a format error
        assert_eq!(terr(b"mg *** b\r\n").0, "CLIENT_ERROR error decoding key");
        assert_eq!(terr(b"ms *** 1 b\r\nx\r\n"), ("CLIENT_ERROR error decoding key", 15, false));
        assert_eq!(terr(b"md *** b\r\n").0, "CLIENT_ERROR invalid or duplicate flag");
        assert_eq!(terr(b"me *** b\r\n").0, E_FORMAT);
    }

    #[test]
    fn flag_checks_follow_memcached() {
        // unknown letters, per command wording
        assert_eq!(terr(b"mg a v z\r\n").0, "CLIENT_ERROR invalid flag");
        assert_eq!(terr(b"ma a x\r\n").0, "CLIENT_ERROR invalid or duplicate flag");
        // bad tokens: noted, the last one wins, a later duplicate overrides
        assert_eq!(terr(b"mg a Tx\r\n").0, "CLIENT_ERROR bad token in command line format");
        assert_eq!(terr(b"ms a 1 Fx\r\nx\r\n"), (E_FORMAT, 14, false));
        assert_eq!(terr(b"ms a 1 Dx Jx\r\nx\r\n").0, "CLIENT_ERROR invalid numeric initial value");
        assert_eq!(terr(b"ms a 1 Tx v v\r\nx\r\n").0, "CLIENT_ERROR duplicate flag");
        assert_eq!(terr(b"ms a 1 MSS\r\nx\r\n").0, "CLIENT_ERROR incorrect length for M token");
        assert_eq!(terr(b"ma a D18446744073709551616\r\n").0, "CLIENT_ERROR invalid or duplicate flag");
        // modes are upper case (or +/- for ma)
        assert_eq!(terr(b"ms a 1 Ms\r\nx\r\n"), ("CLIENT_ERROR invalid mode for ms M token", 14, false));
        assert_eq!(terr(b"ma a Mi\r\n").0, "CLIENT_ERROR invalid mode for ma M token");
        assert!(matches!(p(T, b"ma a M-\r\n"), Parsed::Req { .. }));
        // F keeps the low 32 bits, as memcached's strtoul does
        assert!(matches!(p(T, b"ms a 1 F4294967296\r\nx\r\n"), Parsed::Req { .. }));
        // me ignores its flags but a leading b
        assert!(matches!(p(T, b"me a x !\r\n"), Parsed::Req { .. }));
        // at most 17 flags (16 on ms)
        let f17 = " O1 k v c f s t h l q u b T1 N1 R1 C1 F1";
        assert!(matches!(p(T, format!("mg YQ=={f17}\r\n").as_bytes()), Parsed::Req { .. }));
        assert_eq!(terr(format!("mg a{f17} I\r\n").as_bytes()).0, "CLIENT_ERROR options flags are too long");
        assert_eq!(terr(format!("md a{f17} I\r\n").as_bytes()).0, "CLIENT_ERROR options flags too long");
        assert_eq!(terr(format!("ms a 1{f17}\r\nx\r\n").as_bytes()).0, "CLIENT_ERROR options flags too long");
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

#[cfg(test)]
mod flag_tests {
    use super::*;

    #[test]
    fn flags_compare_by_their_tokens_not_where_they_are() {
        let a = b"mg k v t N30 Oab\r\n".to_vec();
        let b = b"mg  k  v t  N30   Oab\r\n".to_vec();
        let (Parsed::Req { req: Request::Meta(x), .. }, Parsed::Req { req: Request::Meta(y), .. }) = (
            crate::parse(crate::Protocol::Text, &a, &Limits::default()),
            crate::parse(crate::Protocol::Text, &b, &Limits::default()),
        ) else {
            panic!("both parse");
        };
        assert_eq!(x.flags, y.flags);
        assert_eq!(x.flags.token(b'O'), Some(&b"ab"[..]));
        assert_eq!(x.flags.token(b'N'), Some(&b"30"[..]));
        assert_eq!(x.flags.token(b'v'), Some(&b""[..]));
        assert_eq!(x.flags.iter().map(|(f, _)| f).collect::<Vec<_>>(), b"vtNO");
        let c = b"mg k v t N31 Oab\r\n".to_vec();
        let Parsed::Req { req: Request::Meta(z), .. } = crate::parse(crate::Protocol::Text, &c, &Limits::default())
        else {
            panic!("parses");
        };
        assert_ne!(x.flags, z.flags);
    }
}
