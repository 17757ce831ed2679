//! # mbal-proto — memcached wire codecs
//!
//! This crate turns bytes into requests and replies into bytes for the three
//! memcached protocols mbal speaks: the classic **text** protocol (`get`,
//! `set`, ...), the **meta** text protocol of memcached 1.6 (`mg`, `ms`, `md`,
//! `ma`, `mn`, `me`) and the **binary** protocol (24-byte headers, magic
//! 0x80). It does no I/O and keeps no per-connection state.
//!
//! ## Design
//!
//! * **One entry point.** [`parse`] looks at the front of a connection's read
//!   buffer and returns [`Parsed`]: a complete [`Request`] plus how many bytes
//!   it used, [`Parsed::NeedMore`], or [`Parsed::Err`] with an already
//!   protocol-correct error reply, a byte count to discard (which may exceed
//!   the buffer: the caller swallows the rest as it arrives, like memcached's
//!   `conn_swallow`) and whether to close the connection.
//! * **Zero-copy.** Requests borrow the input: keys, data blocks, meta flag
//!   tokens and binary extras/key/value are sub-slices of `buf`. The multi-key
//!   `get` line is kept as one slice ([`text::Keys`]) and split lazily.
//! * **Incremental and allocation-free.** A prefix of a valid request yields
//!   `NeedMore` without allocating; the parser is simply re-run from the start
//!   of the request when more bytes arrive (command lines are short, data
//!   blocks are not rescanned byte by byte: only their length and the
//!   trailing `\r\n` are checked). The decision for a line depends on the line
//!   alone, so a prefix of a malformed request gives either `NeedMore` or the
//!   same error as the full request.
//! * **Bounded.** A text line longer than [`Limits::max_line`] is an error
//!   (`CLIENT_ERROR line too long`, close), except a retrieval line
//!   (`get`/`gets`/`gat`/`gats`), which [`parse_stream`] yields in pieces of
//!   complete keys as its bytes arrive ([`text::Line`], [`text::LineState`]):
//!   a connection holds its state between pieces, never the line. A data
//!   block larger than [`Limits::max_item_size`] is refused with
//!   `SERVER_ERROR object too large for cache` and swallowed; a binary body
//!   larger than `max_item_size + 250 + 64` is refused with E2BIG and the
//!   connection is closed, so the caller never has to buffer more than about
//!   `max_line + max_item_size` bytes.
//! * **memcached-exact errors.** Error strings and which error wins were
//!   checked against memcached 1.6.18. Errors that memcached suppresses
//!   because of `noreply` are returned as [`ErrReply::Silent`].
//! * **Semantics live in the server.** The parser validates syntax (token
//!   counts, numbers, key lengths, meta flag syntax, binary extras/key/value
//!   lengths per opcode); what a flag or a store mode *means* is executed by
//!   the server. Meta flags are kept in request order with their tokens.
//! * **Reply writers** (in [`reply`], re-exported from [`text`], [`meta`] and
//!   [`binary`]) append to a `Vec<u8>`.
//! * **The client side** ([`client`]): an incremental decoder of the text
//!   replies a server sends (mbal's `MBAL`, `MAP`, `RD`, `MOVED` included),
//!   zero-copy over the caller's buffer, plus an owning reader that returns
//!   whole replies. The routing client, the bench and the proxy use it.
//! * **Known memcached quirks the server must apply itself:** a `set` refused
//!   as too large also unlinks the old value ([`key_to_unlink_on_too_large`]);
//!   a meta key with flag `b` is decoded by [`meta::meta_key`] (decode errors
//!   are `CLIENT_ERROR error decoding key`).
//!
//! ## Testing
//!
//! Unit tests beside each module (every command, every error path, every
//! prefix of a valid request is `NeedMore`, pipelining, noreply), proptests in
//! this file, `tests/vs_memcached.rs` (compares error replies byte for byte
//! with a real memcached when `MBAL_MEMCACHED_ADDR` is set) and cargo-fuzz
//! targets in `fuzz/` (`fuzz/run-all.sh [seconds]`; `fuzz_client` drives the
//! client-side reply decoder).

pub mod auth;
pub mod binary;
pub mod client;
pub mod ext;
pub mod meta;
pub mod reply;
pub mod text;

pub use reply::ErrReply;

/// Longest key memcached accepts (bytes).
pub const MAX_KEY_LEN: usize = 250;

/// Size limits applied while parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest value accepted (memcached `-I`, default 1 MiB). Larger data ->
    /// `SERVER_ERROR object too large for cache` (binary: E2BIG).
    pub max_item_size: usize,
    /// Longest text command line accepted, including its line end
    /// (default 64 KiB); a longer retrieval line is parsed in pieces of
    /// about this size ([`parse_stream`]).
    pub max_line: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_item_size: 1024 * 1024, max_line: 64 * 1024 }
    }
}

/// Which protocol a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// Text protocol, including the meta commands.
    Text,
    /// Binary protocol.
    Binary,
}

/// Which protocol a connection speaks, from its first byte (0x80 = binary request magic).
pub fn detect(first: u8) -> Protocol {
    if first == binary::MAGIC_REQUEST {
        Protocol::Binary
    } else {
        Protocol::Text
    }
}

/// Result of parsing one request from the front of a buffer.
// Large because a meta request carries its flags inline (no allocation).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// A complete request; `consumed` bytes (command line + data block) can be dropped.
    Req { req: Request<'a>, consumed: usize },
    /// Not enough bytes yet (and nothing is wrong so far).
    NeedMore,
    /// A malformed / oversized request: send `reply`, drop `skip` bytes from the
    /// front of the stream (may exceed the buffer: swallow the rest as it
    /// arrives), then close the connection if `close`.
    Err { reply: ErrReply, skip: usize, close: bool },
}

/// One parsed request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    Text(text::TextCmd<'a>),
    Meta(meta::MetaCmd<'a>),
    Bin(binary::BinReq<'a>),
}

/// Parse one request, text+meta ([`Protocol::Text`]) or binary, from the front of `buf`.
pub fn parse<'a>(proto: Protocol, buf: &'a [u8], limits: &Limits) -> Parsed<'a> {
    match proto {
        Protocol::Text => text::parse(buf, limits),
        Protocol::Binary => binary::parse(buf, limits),
    }
}

/// Parse the next request of a connection, or the next piece of a long
/// retrieval line. `state` is the connection's: it leaves
/// [`text::LineState::Start`] only inside a `get`/`gets`/`gat`/`gats` line
/// longer than [`Limits::max_line`], which is answered piece by piece
/// ([`text::Line`]) instead of refused, so the connection never buffers
/// more than about `max_line` bytes of it. Other lines are exactly
/// [`parse`]'s.
#[inline]
pub fn parse_stream<'a>(state: &mut text::LineState, proto: Protocol, buf: &'a [u8], limits: &Limits) -> Parsed<'a> {
    if !matches!(state, text::LineState::Start) {
        return text::parse_more(state, buf, limits);
    }
    let p = parse(proto, buf, limits);
    if let Parsed::Err { reply: ErrReply::Text(text::E_LINE_TOO_LONG), .. } = p {
        if proto == Protocol::Text {
            return text::long_line(state, buf, limits).unwrap_or(p);
        }
    }
    p
}

/// memcached unlinks the old value when a `set` (or a set-mode `ms`) is
/// refused as too large, so stale data does not survive a failed overwrite.
/// Given the buffer [`parse`] just answered with
/// `SERVER_ERROR object too large for cache`, return the key the server should
/// delete (None for other commands, add/replace/append/prepend/cas, other
/// ms modes, or a base64 (`b`) ms key).
pub fn key_to_unlink_on_too_large(buf: &[u8]) -> Option<&[u8]> {
    let nl = memchr::memchr(b'\n', buf)?;
    let line = &buf[..nl];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut toks = line.split(|&b| b == b' ').filter(|t| !t.is_empty());
    let cmd = toks.next()?;
    let key = toks.next().filter(|k| valid_key(k))?;
    match cmd {
        b"set" => Some(key),
        b"ms" => {
            let mut set_mode = true;
            for f in toks.skip(1) {
                match f {
                    [b'b', ..] => return None,
                    [b'M', m, ..] => set_mode = matches!(m, b'S' | b's'),
                    _ => {}
                }
            }
            set_mode.then_some(key)
        }
        _ => None,
    }
}

/// A key is valid when it is 1..=250 bytes with no control characters or spaces.
pub fn valid_key(key: &[u8]) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_LEN && key.iter().all(|&b| b > b' ' && b != 0x7f)
}

#[cfg(test)]
pub(crate) mod testutil {
    use super::*;

    pub fn lim() -> Limits {
        Limits::default()
    }

    pub fn p(proto: Protocol, buf: &[u8]) -> Parsed<'_> {
        parse(proto, buf, &lim())
    }

    /// A complete request: every strict prefix is NeedMore, the whole parses
    /// and consumes everything; returns the request.
    pub fn whole(proto: Protocol, buf: &[u8]) -> Request<'_> {
        for i in 0..buf.len() {
            assert_eq!(p(proto, &buf[..i]), Parsed::NeedMore, "prefix {i} of {:?}", String::from_utf8_lossy(buf));
        }
        match p(proto, buf) {
            Parsed::Req { req, consumed } => {
                assert_eq!(consumed, buf.len(), "{:?}", String::from_utf8_lossy(buf));
                req
            }
            other => panic!("{:?} -> {other:?}", String::from_utf8_lossy(buf)),
        }
    }

    /// Text error: (line, skip, close).
    pub fn terr(buf: &[u8]) -> (&'static str, usize, bool) {
        match p(Protocol::Text, buf) {
            Parsed::Err { reply: ErrReply::Text(t), skip, close } => (t, skip, close),
            other => panic!("{:?} -> {other:?}", String::from_utf8_lossy(buf)),
        }
    }

    /// Text error that noreply silenced: (skip).
    pub fn silent(buf: &[u8]) -> usize {
        match p(Protocol::Text, buf) {
            Parsed::Err { reply: ErrReply::Silent, skip, close: false } => skip,
            other => panic!("{:?} -> {other:?}", String::from_utf8_lossy(buf)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn detect_by_first_byte() {
        assert_eq!(detect(0x80), Protocol::Binary);
        assert_eq!(detect(b'g'), Protocol::Text);
        assert_eq!(detect(b'm'), Protocol::Text);
        assert_eq!(detect(0x81), Protocol::Text);
    }

    #[test]
    fn pipelined_mixed_text_and_meta() {
        let buf = b"set a 0 0 1\r\nx\r\nmg a v\r\nget a b\r\nmn\r\n";
        let mut off = 0;
        let mut kinds = Vec::new();
        while off < buf.len() {
            match p(Protocol::Text, &buf[off..]) {
                Parsed::Req { req, consumed } => {
                    kinds.push(match req {
                        Request::Text(text::TextCmd::Store { .. }) => "store",
                        Request::Text(text::TextCmd::Get { .. }) => "get",
                        Request::Meta(m) if m.kind == meta::MetaKind::Get => "mg",
                        Request::Meta(m) if m.kind == meta::MetaKind::Noop => "mn",
                        _ => "other",
                    });
                    off += consumed;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(kinds, ["store", "mg", "get", "mn"]);
    }

    #[test]
    fn unlink_key_after_too_large() {
        assert_eq!(key_to_unlink_on_too_large(b"set k 0 0 9999999\r\n"), Some(&b"k"[..]));
        assert_eq!(key_to_unlink_on_too_large(b"add k 0 0 9999999\r\n"), None);
        assert_eq!(key_to_unlink_on_too_large(b"ms k 9999999 T0\r\n"), Some(&b"k"[..]));
        assert_eq!(key_to_unlink_on_too_large(b"ms k 9999999 MS\r\n"), Some(&b"k"[..]));
        assert_eq!(key_to_unlink_on_too_large(b"ms k 9999999 ME\r\n"), None);
        assert_eq!(key_to_unlink_on_too_large(b"ms aw== 9999999 b\r\n"), None);
        assert_eq!(key_to_unlink_on_too_large(b"set k 0 0 9999999"), None);
    }

    #[test]
    fn parsed_stays_small_enough_to_return_by_value() {
        // Meta flags are inline (as offsets into the line); keep the result from growing
        // unnoticed: the worker's look-ahead moves one per pipelined request.
        assert!(std::mem::size_of::<Parsed>() <= 320, "{}", std::mem::size_of::<Parsed>());
    }

    #[test]
    fn valid_key_rules() {
        assert!(valid_key(b"a"));
        assert!(valid_key(&[b'k'; 250]));
        assert!(!valid_key(&[b'k'; 251]));
        assert!(!valid_key(b""));
        assert!(!valid_key(b"a\tb"));
        assert!(!valid_key(b"a b"));
        assert!(!valid_key(b"a\x7f"));
    }

    fn check_any(proto: Protocol, buf: &[u8], limits: &Limits) {
        match parse(proto, buf, limits) {
            Parsed::Req { consumed, req } => {
                assert!(consumed <= buf.len() && consumed > 0);
                if let Request::Meta(cmd) = &req {
                    let mut s = [0u8; 256];
                    let _ = meta::meta_key(cmd, &mut s);
                }
                if let Request::Bin(b) = &req {
                    let _ = (b.store_extras(), b.arith_extras(), b.exptime_extra(), b.flush_delay());
                }
            }
            Parsed::Err { skip, .. } => assert!(skip > 0),
            Parsed::NeedMore => {
                assert!(buf.len() < limits.max_line.max(1) || proto == Protocol::Binary)
            }
        }
    }

    /// Bytes that look a bit like requests, so the interesting paths are hit.
    fn texty() -> impl Strategy<Value = Vec<u8>> {
        let tok = prop::sample::select(vec![
            "get ",
            "gets ",
            "gat ",
            "set ",
            "cas ",
            "add ",
            "append ",
            "delete ",
            "incr ",
            "touch ",
            "flush_all ",
            "verbosity ",
            "stats ",
            "mg ",
            "ms ",
            "md ",
            "ma ",
            "mn",
            "me ",
            "k ",
            "0 ",
            "1 ",
            "2 ",
            "-1 ",
            "noreply",
            "v ",
            "T1 ",
            "b ",
            "YQ== ",
            "\r\n",
            "\n",
            "xy",
            "99999999999 ",
            "Oabc ",
        ]);
        prop::collection::vec(tok, 0..12).prop_map(|v| v.concat().into_bytes())
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(buf in prop::collection::vec(any::<u8>(), 0..600), max_line in 1usize..300) {
            let limits = Limits { max_item_size: 64, max_line };
            check_any(Protocol::Text, &buf, &limits);
            check_any(Protocol::Binary, &buf, &limits);
            let mut b = buf.clone();
            if !b.is_empty() { b[0] = 0x80; }
            check_any(Protocol::Binary, &b, &limits);
        }

        #[test]
        fn text_prefix_is_needmore_or_same_err(buf in texty(), max_line in 8usize..200) {
            let limits = Limits { max_item_size: 16, max_line };
            check_any(Protocol::Text, &buf, &limits);
            let full = parse(Protocol::Text, &buf, &limits);
            for i in 0..buf.len() {
                let pre = parse(Protocol::Text, &buf[..i], &limits);
                match (&pre, &full) {
                    (Parsed::NeedMore, _) => {}
                    (Parsed::Err { .. }, Parsed::Err { .. }) => prop_assert_eq!(&pre, &full),
                    // A complete request in a prefix must be the same request.
                    (Parsed::Req { .. }, Parsed::Req { .. }) => prop_assert_eq!(&pre, &full),
                    _ => prop_assert!(false, "prefix {} gave {:?}, full gave {:?}", i, pre, full),
                }
            }
        }

        #[test]
        fn binary_prefix_is_needmore_or_same(op in 0u8..0x30, kl in 0u16..6, el in prop::sample::select(vec![0u8, 4, 8, 20]), vl in 0u32..6, opaque in any::<u32>()) {
            let mut buf = Vec::new();
            let body = el as u32 + kl as u32 + vl;
            binary::BinHeader { magic: 0x80, opcode: op, key_len: kl, extras_len: el, data_type: 0, vbucket: 0, body_len: body, opaque, cas: 0 }.encode(&mut buf);
            buf.resize(24 + body as usize, b'x');
            let full = p(Protocol::Binary, &buf);
            for i in 0..buf.len() {
                let pre = p(Protocol::Binary, &buf[..i]);
                if pre != Parsed::NeedMore {
                    prop_assert_eq!(&pre, &full);
                    prop_assert!(i >= 24, "header incomplete but decided");
                }
            }
            if let Parsed::Req { consumed, .. } = full { prop_assert_eq!(consumed, buf.len()); }
        }
    }
}
