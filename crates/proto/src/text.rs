//! The classic memcached text protocol (and line framing shared with meta).
//!
//! A request is a command line ending in `\n` (an optional `\r` before it is
//! stripped), tokens separated by one or more spaces; storage commands are
//! followed by a data block of the declared length plus `\r\n`.

use crate::reply::ErrReply;
use crate::{meta, valid_key, Limits, Parsed, Request};

pub use crate::reply::{
    write_number, write_stat, write_value, write_version, DELETED, END, ERROR, EXISTS, NOT_FOUND, NOT_STORED, OK,
    STORED, TOUCHED,
};

pub(crate) const E_ERROR: &str = "ERROR";
pub(crate) const E_FORMAT: &str = "CLIENT_ERROR bad command line format";
pub(crate) const E_CHUNK: &str = "CLIENT_ERROR bad data chunk";
pub(crate) const E_TOO_LARGE: &str = "SERVER_ERROR object too large for cache";
pub(crate) const E_LINE_TOO_LONG: &str = "CLIENT_ERROR line too long";
const E_DELTA: &str = "CLIENT_ERROR invalid numeric delta argument";
const E_EXPTIME: &str = "CLIENT_ERROR invalid exptime argument";
const E_DELETE_USAGE: &str = "CLIENT_ERROR bad command line format.  Usage: delete <key> [noreply]";

/// Storage command of a text `set`-family request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreMode {
    Set,
    Add,
    Replace,
    Append,
    Prepend,
    Cas,
}

/// One text-protocol command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextCmd<'a> {
    /// `get`/`gets`/`gat`/`gats`; `cas` for the `s` forms, `touch` = exptime for gat/gats.
    /// A line longer than [`Limits::max_line`] comes in pieces (`line`).
    Get {
        keys: Keys<'a>,
        cas: bool,
        touch: Option<i64>,
        line: Line,
    },
    /// `set`/`add`/`replace`/`append`/`prepend`/`cas`; `data` is without its `\r\n`;
    /// `cas_unique` is 0 unless `mode == Cas`.
    Store {
        mode: StoreMode,
        key: &'a [u8],
        flags: u32,
        exptime: i64,
        data: &'a [u8],
        cas_unique: u64,
        noreply: bool,
    },
    /// `delete <key> [0] [noreply]`
    Delete {
        key: &'a [u8],
        noreply: bool,
    },
    /// `incr`/`decr <key> <delta> [noreply]`
    Arith {
        incr: bool,
        key: &'a [u8],
        delta: u64,
        noreply: bool,
    },
    /// `touch <key> <exptime> [noreply]`
    Touch {
        key: &'a [u8],
        exptime: i64,
        noreply: bool,
    },
    /// `flush_all [delay] [noreply]`
    FlushAll {
        delay: i64,
        noreply: bool,
    },
    Version,
    /// `verbosity <level> [noreply]` (the level is ignored)
    Verbosity {
        noreply: bool,
    },
    /// `stats [args]`; `args` is the rest of the line, trimmed (empty for plain `stats`).
    Stats {
        args: &'a [u8],
    },
    Quit,
    /// `refresh_certs`: read the TLS certificate files again (memcached's).
    RefreshCerts,
    /// `shutdown [graceful]`; `args` is the rest of the line, trimmed (whether shutdown is
    /// allowed and which modes exist is the server's business).
    Shutdown {
        args: &'a [u8],
    },
    /// memcached's tuning and inspection commands for its slab allocator and LRU (`slabs`,
    /// `lru`, `cache_memlimit`, `lru_crawler`, `watch`); `args` is the rest of the line,
    /// trimmed.
    Tune {
        cmd: TuneCmd,
        args: &'a [u8],
    },
    /// `mbal <args>`: mbal's extension commands (docs/protocol.md); `args` is
    /// the rest of the line, trimmed. memcached answers ERROR to these.
    /// `data` is the data block of the one that carries one (`mbal rset
    /// <key> <flags> <exptime> <bytes> <ttl-ms>`, a hot key's copy), else empty.
    Mbal {
        args: &'a [u8],
        data: &'a [u8],
    },
}

/// Which piece of a get line a [`TextCmd::Get`] carries.
///
/// A retrieval line longer than [`Limits::max_line`] is not refused: it is
/// parsed and answered in pieces of at most about `max_line` bytes each, as
/// its bytes arrive ([`crate::parse_stream`] with a connection's
/// [`LineState`]), so a connection buffers a bounded number of bytes
/// however many keys the line holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line {
    /// A whole line: answer its keys, then `END`.
    Whole,
    /// Keys of a long line; more follow (no `END` yet).
    Part,
    /// The last keys of a long line: answer them, then `END`.
    Last,
}

/// Where a text connection is in its input, between two calls of
/// [`crate::parse_stream`]. Only a long retrieval line leaves `Start`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LineState {
    /// At the start of a request.
    #[default]
    Start,
    /// Inside the key list of a long `get`/`gets`/`gat`/`gats` line;
    /// `any`: a key was seen already.
    Keys { cas: bool, touch: Option<i64>, any: bool },
    /// Discarding the rest of a long line whose error was answered.
    Discard,
}

/// memcached's tuning commands ([`TextCmd::Tune`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TuneCmd {
    Slabs,
    Lru,
    CacheMemlimit,
    /// `lru_crawler ...` (`metadump`, `crawl`, `tocrawl`, `sleep`, `enable`, `disable`).
    LruCrawler,
    /// `watch [fetchers] [mutations] [evictions] ...`: log streaming.
    Watch,
}

/// The keys of a get line (validated, at least one except for gat/gats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keys<'a> {
    raw: &'a [u8],
    count: usize,
}

impl<'a> Keys<'a> {
    /// The keys in request order.
    pub fn iter(&self) -> impl Iterator<Item = &'a [u8]> + Clone + 'a {
        KeyIter { rest: self.raw }
    }
    /// Number of keys.
    pub fn len(&self) -> usize {
        self.count
    }
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
    /// The raw space-separated key list as sent.
    pub fn raw(&self) -> &'a [u8] {
        self.raw
    }
}

/// The keys of a validated key list: the tokens between spaces.
#[derive(Clone)]
struct KeyIter<'a> {
    rest: &'a [u8],
}

/// Where the first space of `s` is, eight bytes at a time (keys are short: a call to a
/// vectorised search costs more than it finds).
#[inline]
pub fn first_space(s: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let mut at = 0;
    while let Some(w) = s.get(at..at + 8) {
        let y = u64::from_le_bytes(w.try_into().expect("8 bytes")) ^ (ONES * u64::from(b' '));
        // The lowest byte flagged is the first zero byte of `y` (exact; only bytes above a
        // zero byte can be flagged wrongly).
        let zero = y.wrapping_sub(ONES) & !y & (ONES * 0x80);
        if zero != 0 {
            return Some(at + zero.trailing_zeros() as usize / 8);
        }
        at += 8;
    }
    s[at..].iter().position(|&b| b == b' ').map(|i| at + i)
}

impl<'a> Iterator for KeyIter<'a> {
    type Item = &'a [u8];

    #[inline]
    fn next(&mut self) -> Option<&'a [u8]> {
        while !self.rest.is_empty() {
            let (key, rest) = match first_space(self.rest) {
                Some(i) => (&self.rest[..i], &self.rest[i + 1..]),
                None => (self.rest, &[][..]),
            };
            self.rest = rest;
            if !key.is_empty() {
                return Some(key);
            }
        }
        None
    }
}

pub(crate) fn split_spaces(s: &[u8]) -> impl Iterator<Item = &[u8]> + Clone {
    s.split(|&b| b == b' ').filter(|t| !t.is_empty())
}

/// Strip leading and trailing spaces.
pub(crate) fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' '] = s {
        s = rest;
    }
    s
}

/// A decimal integer token, read as Rust's `FromStr` reads the integer types (an optional
/// `+`, or `-` for a signed type, then one or more ASCII digits, no overflow) but straight from
/// the bytes: no UTF-8 check, no `&str`. Every number of every request line goes through it.
pub(crate) fn num<T: Decimal>(tok: &[u8]) -> Option<T> {
    T::decimal(tok)
}

/// The integer types a request's numbers are read as ([`num`]).
pub trait Decimal: Sized {
    fn decimal(tok: &[u8]) -> Option<Self>;
}

macro_rules! decimal {
    ($($t:ty: $signed:expr),*) => {$(
        impl Decimal for $t {
            fn decimal(tok: &[u8]) -> Option<$t> {
                let (negative, digits) = match tok {
                    [b'-', rest @ ..] if $signed => (true, rest),
                    [b'+', rest @ ..] => (false, rest),
                    _ => (false, tok),
                };
                if digits.is_empty() {
                    return None;
                }
                // Accumulated towards the sign, so that a signed MIN (one more than -MAX) fits.
                let mut n: $t = 0;
                for &b in digits {
                    let d = b.wrapping_sub(b'0');
                    if d > 9 {
                        return None;
                    }
                    n = n.checked_mul(10)?;
                    n = if negative { n.checked_sub(d as $t)? } else { n.checked_add(d as $t)? };
                }
                Some(n)
            }
        }
    )*};
}

decimal!(u8: false, u16: false, u32: false, u64: false, usize: false, i32: true, i64: true);

pub(crate) fn fail<'a>(msg: &'static str, skip: usize) -> Parsed<'a> {
    Parsed::Err { reply: ErrReply::Text(msg), skip, close: false }
}

fn fail_nr<'a>(noreply: bool, msg: &'static str, skip: usize) -> Parsed<'a> {
    let reply = if noreply { ErrReply::Silent } else { ErrReply::Text(msg) };
    Parsed::Err { reply, skip, close: false }
}

/// Split off the first token; returns (token, rest-after-token).
pub(crate) fn next_token(s: &[u8]) -> Option<(&[u8], &[u8])> {
    let start = s.iter().position(|&b| b != b' ')?;
    let s = &s[start..];
    let end = memchr::memchr(b' ', s).unwrap_or(s.len());
    Some((&s[..end], &s[end..]))
}

/// Up to N tokens; the count is N+1 when there are more.
fn take<const N: usize>(rest: &[u8]) -> ([&[u8]; N], usize) {
    let mut out: [&[u8]; N] = [&[]; N];
    let mut n = 0;
    for t in split_spaces(rest) {
        if n == N {
            return (out, N + 1);
        }
        out[n] = t;
        n += 1;
    }
    (out, n)
}

#[allow(clippy::result_large_err)]
/// Check and slice the data block following a command line of `line_len` bytes.
pub(crate) fn data_block<'a>(
    buf: &'a [u8],
    line_len: usize,
    vlen: usize,
    silent: bool,
) -> Result<&'a [u8], Parsed<'a>> {
    let need = line_len + vlen + 2;
    if buf.len() < need {
        return Err(Parsed::NeedMore);
    }
    if &buf[line_len + vlen..need] != b"\r\n" {
        return Err(fail_nr(silent, E_CHUNK, need));
    }
    Ok(&buf[line_len..line_len + vlen])
}

#[allow(clippy::result_large_err)]
/// Frame one line: returns (line without line end, bytes including line end).
pub(crate) fn frame<'a>(buf: &'a [u8], limits: &Limits) -> Result<(&'a [u8], usize), Parsed<'a>> {
    let max = limits.max_line.max(1);
    let scan = &buf[..buf.len().min(max)];
    match memchr::memchr(b'\n', scan) {
        Some(i) => {
            let line = &buf[..i];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            Ok((line, i + 1))
        }
        None if buf.len() >= max => Err(Parsed::Err { reply: ErrReply::Text(E_LINE_TOO_LONG), skip: max, close: true }),
        None => Err(Parsed::NeedMore),
    }
}

/// Parse one text or meta request from the front of `buf`.
pub fn parse<'a>(buf: &'a [u8], limits: &Limits) -> Parsed<'a> {
    let (line, line_len) = match frame(buf, limits) {
        Ok(x) => x,
        Err(p) => return p,
    };
    let Some((cmd, rest)) = next_token(line) else {
        return fail(E_ERROR, line_len);
    };
    if cmd.len() == 2 && cmd[0] == b'm' {
        return meta::parse_line(cmd[1], rest, buf, line_len, limits);
    }
    let req = |c: TextCmd<'a>| Parsed::Req { req: Request::Text(c), consumed: line_len };
    match cmd {
        // `bget`: memcached's undocumented old alias of get.
        b"get" | b"gets" | b"bget" => {
            let cas = cmd == b"gets";
            match keys(rest) {
                Ok(k) if k.count == 0 => fail(E_ERROR, line_len),
                Ok(keys) => req(TextCmd::Get { keys, cas, touch: None, line: Line::Whole }),
                Err(()) => fail(E_FORMAT, line_len),
            }
        }
        b"gat" | b"gats" => {
            let cas = cmd.len() == 4;
            let Some((exp, rest)) = next_token(rest) else {
                return fail(E_ERROR, line_len);
            };
            let Some(exptime) = num::<i64>(exp) else {
                return fail(E_EXPTIME, line_len);
            };
            match keys(rest) {
                Ok(keys) => req(TextCmd::Get { keys, cas, touch: Some(exptime), line: Line::Whole }),
                Err(()) => fail(E_FORMAT, line_len),
            }
        }
        b"set" | b"add" | b"replace" | b"append" | b"prepend" | b"cas" => {
            let mode = match cmd {
                b"set" => StoreMode::Set,
                b"add" => StoreMode::Add,
                b"replace" => StoreMode::Replace,
                b"append" => StoreMode::Append,
                b"prepend" => StoreMode::Prepend,
                _ => StoreMode::Cas,
            };
            store(mode, rest, buf, line_len, limits)
        }
        b"delete" => {
            let (t, n) = take::<3>(rest);
            if n == 0 || n > 3 {
                return fail(E_ERROR, line_len);
            }
            let noreply = n > 1 && t[n - 1] == b"noreply";
            if !valid_key(t[0]) {
                return fail_nr(noreply, E_FORMAT, line_len);
            }
            if n > 1 {
                let hold_zero = t[1] == b"0";
                let ok = (n == 2 && (hold_zero || noreply)) || (n == 3 && hold_zero && noreply);
                if !ok {
                    return fail_nr(noreply, E_DELETE_USAGE, line_len);
                }
            }
            req(TextCmd::Delete { key: t[0], noreply })
        }
        b"incr" | b"decr" => {
            let (t, n) = take::<3>(rest);
            if !(2..=3).contains(&n) {
                return fail(E_ERROR, line_len);
            }
            let noreply = n == 3 && t[2] == b"noreply";
            if !valid_key(t[0]) {
                return fail_nr(noreply, E_FORMAT, line_len);
            }
            let Some(delta) = num::<u64>(t[1]) else {
                return fail_nr(noreply, E_DELTA, line_len);
            };
            req(TextCmd::Arith { incr: cmd == b"incr", key: t[0], delta, noreply })
        }
        b"touch" => {
            let (t, n) = take::<3>(rest);
            if !(2..=3).contains(&n) {
                return fail(E_ERROR, line_len);
            }
            let noreply = n == 3 && t[2] == b"noreply";
            if !valid_key(t[0]) {
                return fail_nr(noreply, E_FORMAT, line_len);
            }
            let Some(exptime) = num::<i64>(t[1]) else {
                return fail_nr(noreply, E_EXPTIME, line_len);
            };
            req(TextCmd::Touch { key: t[0], exptime, noreply })
        }
        b"flush_all" => {
            let (t, n) = take::<2>(rest);
            if n > 2 {
                return fail(E_ERROR, line_len);
            }
            let noreply = n > 0 && t[n - 1] == b"noreply";
            let delay_tok = if n == 2 || (n == 1 && !noreply) { Some(t[0]) } else { None };
            let delay = match delay_tok {
                None => 0,
                Some(d) => match num::<i64>(d) {
                    Some(d) => d,
                    None => return fail_nr(noreply, E_EXPTIME, line_len),
                },
            };
            req(TextCmd::FlushAll { delay, noreply })
        }
        b"version" => req(TextCmd::Version),
        b"verbosity" => {
            let (t, n) = take::<2>(rest);
            if n == 0 || n > 2 {
                return fail(E_ERROR, line_len);
            }
            let noreply = t[n - 1] == b"noreply";
            if num::<u32>(t[0]).is_none() {
                return fail_nr(noreply, E_FORMAT, line_len);
            }
            req(TextCmd::Verbosity { noreply })
        }
        b"stats" => req(TextCmd::Stats { args: trim(rest) }),
        b"quit" => req(TextCmd::Quit),
        b"refresh_certs" => req(TextCmd::RefreshCerts),
        b"shutdown" => req(TextCmd::Shutdown { args: trim(rest) }),
        b"slabs" => req(TextCmd::Tune { cmd: TuneCmd::Slabs, args: trim(rest) }),
        b"lru" => req(TextCmd::Tune { cmd: TuneCmd::Lru, args: trim(rest) }),
        b"cache_memlimit" => req(TextCmd::Tune { cmd: TuneCmd::CacheMemlimit, args: trim(rest) }),
        b"lru_crawler" => req(TextCmd::Tune { cmd: TuneCmd::LruCrawler, args: trim(rest) }),
        b"watch" => req(TextCmd::Tune { cmd: TuneCmd::Watch, args: trim(rest) }),
        b"mbal" => {
            let args = trim(rest);
            if let Some(r) = args.strip_prefix(b"rset ") {
                mbal_rset(args, r, buf, line_len, limits)
            } else if let Some(r) = args.strip_prefix(b"import data ") {
                mbal_import(args, r, buf, line_len, limits)
            } else {
                req(TextCmd::Mbal { args, data: &[] })
            }
        }
        _ if looks_like_http(cmd, line) => Parsed::Err { reply: ErrReply::Silent, skip: line_len, close: true },
        _ => fail(E_ERROR, line_len),
    }
}

/// memcached's guard against cross-protocol requests (a browser tricked into sending an
/// HTTP request to a cache): a line with a command it does not know, whose last token
/// starts with `HTTP/` (`GET / HTTP/1.1`, `DELETE HTTP/1.1`), closes the connection with
/// nothing written. memcached 1.6's exact rule (`process_command_ascii`): the command is at
/// least two bytes, does not start with a lower-case letter it dispatches on (`g s a c i d t`,
/// where an unknown command is a plain `ERROR`), is none of its other commands, and the last
/// of the line's first 23 space-separated tokens starts with `HTTP/`.
fn looks_like_http(cmd: &[u8], line: &[u8]) -> bool {
    const MEMCACHED_COMMANDS: [&[u8]; 10] = [
        b"replace",
        b"prepend",
        b"bget",
        b"flush_all",
        b"version",
        b"quit",
        b"lru_crawler",
        b"watch",
        b"verbosity",
        b"lru",
    ];
    if cmd.len() < 2
        || matches!(cmd[0], b'g' | b's' | b'a' | b'c' | b'i' | b'd' | b't')
        || MEMCACHED_COMMANDS.contains(&cmd)
    {
        return false;
    }
    split_spaces(line).take(23).last().is_some_and(|t| t.starts_with(b"HTTP/"))
}

/// A get line's key list: every key valid (`valid_key`), counted. One pass over the bytes,
/// eight at a time where none of them is a space or a byte a key may not hold (a 100-key
/// line is checked once here, and split again only as it is served).
fn keys(rest: &[u8]) -> Result<Keys<'_>, ()> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = ONES * 0x80;
    let raw = trim(rest);
    let mut c = KeyCount::default();
    let mut words = raw.chunks_exact(8);
    for w in &mut words {
        let x = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        // Is any byte below 0x21 (a space or a control byte), or 0x7f? (Exact for "any".)
        let low = x.wrapping_sub(ONES * 0x21) & !x & HIGH;
        let y = x ^ (ONES * 0x7f);
        let del = y.wrapping_sub(ONES) & !y & HIGH;
        if low | del == 0 {
            // Eight key bytes (the length is checked at the key's end).
            c.len += 8;
        } else {
            w.iter().try_for_each(|&b| c.byte(b))?;
        }
    }
    words.remainder().iter().try_for_each(|&b| c.byte(b))?;
    c.byte(b' ')?;
    Ok(Keys { raw, count: c.count })
}

/// `keys`' state: keys ended so far, and the length of the one going on.
#[derive(Default)]
struct KeyCount {
    count: usize,
    len: usize,
}

impl KeyCount {
    /// One byte: a space ends a key (one too long is an error), a control byte or DEL is an
    /// error, anything else (0x80.. included) is part of a key.
    #[inline]
    fn byte(&mut self, b: u8) -> Result<(), ()> {
        if b == b' ' {
            if self.len > 0 {
                if self.len > crate::MAX_KEY_LEN {
                    return Err(());
                }
                self.count += 1;
                self.len = 0;
            }
        } else if b < b' ' || b == 0x7f {
            return Err(());
        } else {
            self.len += 1;
        }
        Ok(())
    }
}

/// The least a piece of a long get line spans, whatever `max_line` is: room
/// for a whole key between two separators, so every piece makes progress.
const MIN_PIECE: usize = 2 * (crate::MAX_KEY_LEN + 2);

/// How many bytes one piece of a long get line may span.
fn piece_len(limits: &Limits) -> usize {
    limits.max_line.max(MIN_PIECE)
}

fn strip_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// The first piece of a line longer than `max_line` (`frame` found no line
/// end in its first `max_line` bytes). `None` when the line is not a
/// retrieval line (the caller keeps its `line too long` error). A piece is
/// decided by the bytes alone: it ends at the line end if that is within
/// [`piece_len`] bytes, else at the last space before that bound; so how
/// the line was split into reads does not change the pieces.
pub(crate) fn long_line<'a>(state: &mut LineState, buf: &'a [u8], limits: &Limits) -> Option<Parsed<'a>> {
    let w = piece_len(limits);
    let scan = &buf[..buf.len().min(w)];
    let nl = memchr::memchr(b'\n', scan);
    if nl.is_none() && buf.len() < w {
        return Some(Parsed::NeedMore);
    }
    let line = match nl {
        Some(i) => strip_cr(&scan[..i]),
        None => scan,
    };
    let (cmd, rest) = next_token(line)?;
    let (cas, gat) = match cmd {
        b"get" => (false, false),
        b"gets" => (true, false),
        b"gat" => (false, true),
        b"gats" => (true, true),
        _ => return None,
    };
    let (touch, rest) = if gat {
        let (exp, after) = next_token(rest)?;
        if nl.is_none() && after.is_empty() {
            // The exptime runs into the piece's bound: not a sane line.
            return None;
        }
        let at = after.as_ptr() as usize - buf.as_ptr() as usize;
        match (num::<i64>(exp), nl) {
            (Some(e), _) => (Some(e), after),
            (None, Some(i)) => return Some(fail(E_EXPTIME, i + 1)),
            (None, None) => {
                *state = LineState::Discard;
                return Some(fail(E_EXPTIME, at));
            }
        }
    } else {
        (None, rest)
    };
    if let Some(i) = nl {
        // The whole line is here after all: one piece, the first and the last.
        return Some(last_piece(cas, touch, false, rest, i + 1));
    }
    if rest.is_empty() {
        return None;
    }
    let start = rest.as_ptr() as usize - buf.as_ptr() as usize;
    // `rest` starts with a space, so there is one at or after `start`.
    let sp = memchr::memrchr(b' ', scan).filter(|&sp| sp >= start)?;
    Some(middle_piece(state, cas, touch, false, &buf[start..sp], sp + 1))
}

/// The next piece of a long line, in the state the previous piece left.
pub(crate) fn parse_more<'a>(state: &mut LineState, buf: &'a [u8], limits: &Limits) -> Parsed<'a> {
    match *state {
        LineState::Start => parse(buf, limits),
        LineState::Discard => match memchr::memchr(b'\n', buf) {
            Some(i) => {
                *state = LineState::Start;
                Parsed::Err { reply: ErrReply::Silent, skip: i + 1, close: false }
            }
            None if buf.is_empty() => Parsed::NeedMore,
            None => Parsed::Err { reply: ErrReply::Silent, skip: buf.len(), close: false },
        },
        LineState::Keys { cas, touch, any } => {
            let w = piece_len(limits);
            let scan = &buf[..buf.len().min(w)];
            match memchr::memchr(b'\n', scan) {
                Some(i) => {
                    *state = LineState::Start;
                    last_piece(cas, touch, any, strip_cr(&scan[..i]), i + 1)
                }
                None if buf.len() < w => Parsed::NeedMore,
                None => match memchr::memrchr(b' ', scan) {
                    Some(sp) => middle_piece(state, cas, touch, any, &scan[..sp], sp + 1),
                    None => {
                        // One token longer than any key.
                        *state = LineState::Discard;
                        fail(E_FORMAT, w)
                    }
                },
            }
        }
    }
}

/// A piece that more keys follow; sets the state for the next one.
fn middle_piece<'a>(
    state: &mut LineState,
    cas: bool,
    touch: Option<i64>,
    any: bool,
    list: &'a [u8],
    consumed: usize,
) -> Parsed<'a> {
    match keys(list) {
        Ok(keys) => {
            *state = LineState::Keys { cas, touch, any: any || keys.count > 0 };
            Parsed::Req { req: Request::Text(TextCmd::Get { keys, cas, touch, line: Line::Part }), consumed }
        }
        Err(()) => {
            *state = LineState::Discard;
            fail(E_FORMAT, consumed)
        }
    }
}

/// The piece that ends a long line (the state is back at `Start`).
fn last_piece(cas: bool, touch: Option<i64>, any: bool, list: &[u8], consumed: usize) -> Parsed<'_> {
    match keys(list) {
        // As for a short line: get/gets need a key, gat/gats do not.
        Ok(keys) if !any && keys.count == 0 && touch.is_none() => fail(E_ERROR, consumed),
        Ok(keys) => Parsed::Req { req: Request::Text(TextCmd::Get { keys, cas, touch, line: Line::Last }), consumed },
        Err(()) => fail(E_FORMAT, consumed),
    }
}

/// `mbal rset <key> <flags> <exptime> <bytes> <ttl-ms>` and its data block
/// (the executor reads the other fields from `args`).
fn mbal_rset<'a>(args: &'a [u8], r: &'a [u8], buf: &'a [u8], line_len: usize, limits: &Limits) -> Parsed<'a> {
    let (t, n) = take::<5>(r);
    if n != 5 {
        return fail(E_ERROR, line_len);
    }
    mbal_block(args, t[3], buf, line_len, limits)
}

/// `mbal import data <id> <bytes> [delta|final]` and its data block, a frame of a moving
/// cachelet's records (at most the item size limit; docs/protocol.md "Cross-server migration").
fn mbal_import<'a>(args: &'a [u8], r: &'a [u8], buf: &'a [u8], line_len: usize, limits: &Limits) -> Parsed<'a> {
    let (t, n) = take::<3>(r);
    if !(n == 2 || (n == 3 && (t[2] == b"final" || t[2] == b"delta"))) {
        return fail(E_ERROR, line_len);
    }
    mbal_block(args, t[1], buf, line_len, limits)
}

/// An `mbal` command with a data block of `len` bytes (at most the item size limit).
fn mbal_block<'a>(args: &'a [u8], len: &[u8], buf: &'a [u8], line_len: usize, limits: &Limits) -> Parsed<'a> {
    let Some(vlen) = num::<usize>(len) else {
        return fail(E_FORMAT, line_len);
    };
    if vlen > limits.max_item_size {
        return fail(E_TOO_LARGE, line_len.saturating_add(vlen).saturating_add(2));
    }
    match data_block(buf, line_len, vlen, false) {
        Ok(data) => Parsed::Req { req: Request::Text(TextCmd::Mbal { args, data }), consumed: line_len + vlen + 2 },
        Err(p) => p,
    }
}

fn store<'a>(mode: StoreMode, rest: &'a [u8], buf: &'a [u8], line_len: usize, limits: &Limits) -> Parsed<'a> {
    let (t, n) = take::<6>(rest);
    let base = if mode == StoreMode::Cas { 5 } else { 4 };
    if n != base && n != base + 1 {
        return fail(E_ERROR, line_len);
    }
    let noreply = n == base + 1 && t[base] == b"noreply";
    let key = t[0];
    if !valid_key(key) {
        return fail_nr(noreply, E_FORMAT, line_len);
    }
    // memcached parses flags as an unsigned long and keeps the low 32 bits.
    let (Some(flags), Some(exptime), Some(vlen)) = (num::<u64>(t[1]), num::<i64>(t[2]), num::<i64>(t[3])) else {
        return fail_nr(noreply, E_FORMAT, line_len);
    };
    let cas_unique = if mode == StoreMode::Cas {
        match num::<u64>(t[4]) {
            Some(c) => c,
            None => return fail_nr(noreply, E_FORMAT, line_len),
        }
    } else {
        0
    };
    if vlen < 0 || vlen > (i32::MAX - 2) as i64 {
        return fail_nr(noreply, E_FORMAT, line_len);
    }
    let vlen = vlen as usize;
    if vlen > limits.max_item_size {
        return fail_nr(noreply, E_TOO_LARGE, line_len + vlen + 2);
    }
    match data_block(buf, line_len, vlen, noreply) {
        Ok(data) => Parsed::Req {
            req: Request::Text(TextCmd::Store { mode, key, flags: flags as u32, exptime, data, cas_unique, noreply }),
            consumed: line_len + vlen + 2,
        },
        Err(p) => p,
    }
}

#[cfg(test)]
mod tests;
