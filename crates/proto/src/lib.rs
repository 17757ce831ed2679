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
//!   (`CLIENT_ERROR line too long`, close); a data block larger than
//!   [`Limits::max_item_size`] is refused with
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

pub mod binary;
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
    /// (default 64 KiB, enough for multi-gets with a few hundred keys).
    pub max_line: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_item_size: 1024 * 1024,
            max_line: 64 * 1024,
        }
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// A complete request; `consumed` bytes (command line + data block) can be dropped.
    Req { req: Request<'a>, consumed: usize },
    /// Not enough bytes yet (and nothing is wrong so far).
    NeedMore,
    /// A malformed / oversized request: send `reply`, drop `skip` bytes from the
    /// front of the stream (may exceed the buffer: swallow the rest as it
    /// arrives), then close the connection if `close`.
    Err {
        reply: ErrReply,
        skip: usize,
        close: bool,
    },
}

/// One parsed request.
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

/// A key is valid when it is 1..=250 bytes with no control characters or spaces.
pub fn valid_key(key: &[u8]) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_LEN && key.iter().all(|&b| b > b' ' && b != 0x7f)
}
