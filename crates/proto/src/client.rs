//! The client side of the text protocol: an incremental decoder of the
//! replies a memcached or mbal server sends, mbal's extension replies
//! included (`MBAL`, `MAP`, `RD`, `MOVED`, the Phase 1 hint `RH hot`). The
//! routing client, the bench and the proxy all read replies with it.
//!
//! Two layers:
//!
//! * [`Decoder`]: zero-copy and allocation-free over the caller's read
//!   buffer. [`Decoder::decode`] consumes what it can from the front of the
//!   buffer and returns at most one [`Frame`]: a one-line reply, one element
//!   of a multi-line reply (a `VALUE` item, a `STAT` line) or the `END` that
//!   completes it. Frames borrow the buffer. Its state (inside a multi-line
//!   reply, how much of a skipped value is left) survives between calls, so
//!   input may be split anywhere. With [`Expect::Hits`] the values' data is
//!   skipped as it arrives (never buffered whole) and only the count of
//!   items is reported, which is all a load generator needs.
//! * [`ReplyReader`]: owns a buffer (fed with [`ReplyReader::feed`] or
//!   [`ReplyReader::read_from`]) and returns whole owned [`Reply`]s (a
//!   multi-get's values collected), for a client that keeps the data.
//!
//! Replies arrive in request order and the caller says what the next one
//! answers ([`Expect`]). A well-formed one-line reply is returned whatever was
//! expected (the caller decides whether it fits its request); `VALUE` where
//! no retrieval was asked, `STAT` where no stats were asked, `END` after a
//! one-line request, a line that is not an error inside a multi-line reply,
//! an unknown line or one longer than [`MAX_LINE`] are a [`ReplyError`]: the
//! stream cannot be trusted any more and the connection should be dropped.
//! An error line (`ERROR`, `CLIENT_ERROR ...`, `SERVER_ERROR ...`) ends any
//! reply, a half-read multi-line one included.
//!
//! Hot-key hints (`RH hot <key> <replicas> <lease-ms>`, docs/protocol.md)
//! come only on routed connections, before a key's `VALUE` block in a
//! retrieval reply or before the reply line of a meta command. The decoder
//! returns each as a [`Frame::Hint`], which does not end the reply it
//! precedes (with [`Expect::Hits`] too, so a load generator sees them); the
//! [`ReplyReader`] keeps them aside for [`ReplyReader::take_hints`] and
//! returns the reply unchanged. A hint anywhere else (in reply to a request
//! that reads nothing, or after the reply line of a meta command) is a
//! [`ReplyError`].

use std::fmt;
use std::io::{self, Read};

/// The longest reply line (without data) accepted before the stream is
/// declared broken.
pub const MAX_LINE: usize = 8192;
/// The largest `MAP` body accepted.
pub const MAX_MAP: usize = 256 << 20;

/// What the next reply answers, which decides how `END`, `VALUE` and `STAT`
/// lines are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// `get`/`gets`/`gat`/`gats`: `VALUE` items (each a [`Frame::Value`])
    /// then `END`.
    Values,
    /// The same reply, with the items' data skipped as it arrives: only
    /// [`Frame::End`] with the item count comes out.
    Hits,
    /// `stats [group]`: `STAT` lines (each a [`Frame::Stat`]) then `END`.
    Stats,
    /// Every other request: one line (or `MAP` with its body).
    Line,
    /// A meta command (`mg`, `ms`, `md`, `ma`, `me`, `mn`): one
    /// [`Frame::Meta`] (`HD`, `VA` with its data, `EN`, `NF`, `NS`, `EX`,
    /// `MN`, `ME ...`), or `RD`, or an error line.
    Meta,
}

/// One `VALUE` item of a retrieval reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Value<'a> {
    pub key: &'a [u8],
    pub flags: u32,
    pub data: &'a [u8],
    pub cas: Option<u64>,
}

/// A hot-key hint `RH hot <key> <replicas> <lease-ms>` (Phase 1): copies of
/// `key` live at `replicas` places besides its home
/// (`mbal_cluster::replica_location`), and the client may read any one of
/// them for `lease_ms` milliseconds from now. `replicas` or `lease_ms` 0:
/// read the key at home only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hint<'a> {
    pub key: &'a [u8],
    pub replicas: u32,
    pub lease_ms: u64,
}

/// A [`Hint`], owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedHint {
    pub key: Vec<u8>,
    pub replicas: u32,
    pub lease_ms: u64,
}

impl From<Hint<'_>> for OwnedHint {
    fn from(h: Hint<'_>) -> OwnedHint {
        OwnedHint { key: h.key.to_vec(), replicas: h.replicas, lease_ms: h.lease_ms }
    }
}

/// One decoded piece of a reply, borrowing the decoder's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// An item of a retrieval reply (not the end of the reply).
    Value(Value<'a>),
    /// A hot-key hint before a retrieval item or a meta reply line (not the
    /// end of the reply).
    Hint(Hint<'a>),
    /// A `STAT <name> <value>` line (not the end of the reply); `value` is
    /// the rest of the line.
    Stat {
        name: &'a [u8],
        value: &'a [u8],
    },
    /// `END`: the retrieval or stats reply is complete, with `items` values
    /// or stat lines in it.
    End {
        items: u32,
    },
    Stored,
    NotStored,
    Exists,
    NotFound,
    Deleted,
    Touched,
    Ok,
    /// `OK <n>`: the answer to `mbal rttl` (reads the renewed copy served).
    OkCount(u64),
    /// `SLOTS <granted> <lease ms>`: the answer to `mbal slots`.
    Slots {
        granted: u64,
        lease_ms: u64,
    },
    /// `HELD <n>`: the answer to `mbal slots held`.
    Held(u64),
    /// `incr`/`decr` result.
    Number(u64),
    /// `RD <epoch> <server> <worker>`: the request's cachelet is served
    /// elsewhere (routed connections only; replaces the whole reply).
    Redirect {
        epoch: u64,
        server: u16,
        worker: u16,
    },
    /// `MBAL <server> <worker> <epoch> [<threads>]`: reply to `mbal hello` (`threads` 0 when
    /// absent: route to each worker's own connection).
    Hello {
        server: u16,
        worker: u16,
        epoch: u64,
        threads: u16,
    },
    /// `MAP <epoch> <bytes>` + JSON: reply to `mbal map`.
    Map {
        epoch: u64,
        json: &'a [u8],
    },
    /// `MOVED <epoch>`: reply to `mbal move`.
    Moved {
        epoch: u64,
    },
    /// A meta reply (read with [`Expect::Meta`]): `code` is its two
    /// letters (`HD`, `VA`, `EN`, `NF`, `NS`, `EX`, `MN`, `ME`), `line` the
    /// whole line without its line end, `data` the value of a `VA` (without
    /// its CR LF).
    Meta {
        code: [u8; 2],
        line: &'a [u8],
        data: Option<&'a [u8]>,
    },
    /// `LOAD <seq> <bytes>` + JSON: reply to `mbal load` (an epoch snapshot).
    Load {
        seq: u64,
        json: &'a [u8],
    },
    /// `ERROR`, `CLIENT_ERROR ...` or `SERVER_ERROR ...` (the line without
    /// its line end). Ends any reply.
    Error(&'a [u8]),
}

impl Frame<'_> {
    /// Does this frame complete a reply? (Everything but a `VALUE` item, a
    /// `STAT` line or a hint.)
    #[inline]
    pub fn ends_reply(&self) -> bool {
        !matches!(self, Frame::Value(_) | Frame::Stat { .. } | Frame::Hint(_))
    }
}

/// The stream is not a valid reply stream (drop the connection).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplyError(pub String);

impl fmt::Display for ReplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad reply from server: {}", self.0)
    }
}

impl std::error::Error for ReplyError {}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(&b[..b.len().min(100)]).into_owned()
}

fn bad<T>(what: &str, line: &[u8]) -> Result<T, ReplyError> {
    Err(ReplyError(format!("{what}: {:?}", lossy(line))))
}

/// A decimal number of at most `u64::MAX` (no sign, no spaces).
#[inline]
fn num_u64(t: &[u8]) -> Option<u64> {
    if t.is_empty() || t.len() > 20 {
        return None;
    }
    let mut n: u64 = 0;
    for &b in t {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(d as u64)?;
    }
    Some(n)
}

#[inline]
fn num<T: TryFrom<u64>>(t: Option<&[u8]>) -> Option<T> {
    T::try_from(num_u64(t?)?).ok()
}

/// The space-separated words of a line.
#[inline]
fn words(line: &[u8]) -> impl Iterator<Item = &[u8]> {
    line.split(|&b| b == b' ').filter(|w| !w.is_empty())
}

/// The words of a VALUE line after `VALUE `: `<key> <flags> <bytes> [<cas>]`, split eight
/// bytes at a time (a multi-get's reply has one per key: this is the decoder's hot line). Runs of
/// spaces count as one, as in [`words`].
#[inline]
fn value_line(args: &[u8]) -> Option<(&[u8], u32, usize, Option<u64>)> {
    let mut rest = args;
    let mut next = || -> Option<&[u8]> {
        while let [b' ', tail @ ..] = rest {
            rest = tail;
        }
        if rest.is_empty() {
            return None;
        }
        let n = crate::text::first_space(rest).unwrap_or(rest.len());
        let (w, tail) = rest.split_at(n);
        rest = tail;
        Some(w)
    };
    let key = next()?;
    let flags = num::<u32>(next())?;
    let len = num::<usize>(next())?;
    let cas = match next() {
        None => None,
        Some(c) => Some(num_u64(c)?),
    };
    match next() {
        None => Some((key, flags, len, cas)),
        Some(_) => None,
    }
}

fn is_error_word(w: &[u8]) -> bool {
    w == b"ERROR" || w == b"CLIENT_ERROR" || w == b"SERVER_ERROR"
}

/// Incremental, zero-copy reply decoder. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct Decoder {
    /// Inside a multi-line reply (after its first `VALUE`/`STAT`).
    multi: bool,
    /// Items of the multi-line reply so far.
    items: u32,
    /// Bytes of a skipped value's data (with its CR LF) still to come.
    skip: usize,
    /// A hint was returned and the reply it precedes has not ended yet.
    hinted: bool,
}

impl Decoder {
    pub fn new() -> Decoder {
        Decoder::default()
    }

    /// Is a reply half decoded?
    pub fn mid_reply(&self) -> bool {
        self.multi || self.skip > 0 || self.hinted
    }

    /// Decode from the front of `buf`. Returns `(consumed, Some(frame))`
    /// when a frame is complete, or `(consumed, None)` when more input is
    /// needed; either way the first `consumed` bytes are done with (drop
    /// them, and start the next call after them).
    #[inline]
    pub fn decode<'a>(&mut self, buf: &'a [u8], expect: Expect) -> Result<(usize, Option<Frame<'a>>), ReplyError> {
        let mut pos = 0;
        loop {
            if self.skip > 0 {
                let n = self.skip.min(buf.len() - pos);
                // the last two bytes are the data's CR LF: check each as it arrives
                for i in n.saturating_sub(2)..n {
                    let want = match self.skip - i {
                        2 => b'\r',
                        1 => b'\n',
                        _ => continue,
                    };
                    if buf[pos + i] != want {
                        return Err(ReplyError("value data not followed by CR LF".into()));
                    }
                }
                self.skip -= n;
                pos += n;
                if self.skip > 0 {
                    return Ok((pos, None));
                }
            }
            let rest = &buf[pos..];
            let Some(nl) = memchr::memchr(b'\n', rest) else {
                if rest.len() > MAX_LINE {
                    return Err(ReplyError(format!("reply line longer than {MAX_LINE} bytes")));
                }
                return Ok((pos, None));
            };
            if nl > MAX_LINE {
                return Err(ReplyError(format!("reply line longer than {MAX_LINE} bytes")));
            }
            let line = &rest[..nl];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let next = pos + nl + 1;
            if line == b"END" {
                if matches!(expect, Expect::Line | Expect::Meta) {
                    return bad("END in reply to a request that expects one line", line);
                }
                let items = self.items;
                self.multi = false;
                self.hinted = false;
                self.items = 0;
                return Ok((next, Some(Frame::End { items })));
            }
            if let Some(args) = line.strip_prefix(b"VALUE ") {
                if !matches!(expect, Expect::Values | Expect::Hits) {
                    return bad("VALUE in reply to a request that retrieves nothing", line);
                }
                // VALUE <key> <flags> <bytes> [<cas>]
                let Some((key, flags, len, cas)) = value_line(args) else {
                    return bad("bad VALUE line", line);
                };
                self.multi = true;
                if expect == Expect::Hits {
                    self.items += 1;
                    self.skip = len.checked_add(2).ok_or_else(|| ReplyError("value length overflows".into()))?;
                    pos = next;
                    continue;
                }
                let end = next.checked_add(len).filter(|&e| e <= usize::MAX - 2);
                let Some(end) = end else { return bad("value length overflows", line) };
                if buf.len() < end + 2 {
                    if buf.len() > end && buf[end] != b'\r' {
                        return Err(ReplyError("value data not followed by CR LF".into()));
                    }
                    return Ok((pos, None));
                }
                if &buf[end..end + 2] != b"\r\n" {
                    return Err(ReplyError("value data not followed by CR LF".into()));
                }
                self.items += 1;
                return Ok((end + 2, Some(Frame::Value(Value { key, flags, data: &buf[next..end], cas }))));
            }
            if let Some(args) = line.strip_prefix(b"STAT ") {
                if expect != Expect::Stats {
                    return bad("STAT in reply to a request that is not stats", line);
                }
                let args = args.trim_ascii_start();
                let (name, value) = match memchr::memchr(b' ', args) {
                    Some(i) => (&args[..i], &args[i + 1..]),
                    None => (args, &b""[..]),
                };
                self.multi = true;
                self.items += 1;
                return Ok((next, Some(Frame::Stat { name, value })));
            }
            let mut w = words(line);
            let first = w.next().unwrap_or(b"");
            if is_error_word(first) {
                self.multi = false;
                self.hinted = false;
                self.items = 0;
                return Ok((next, Some(Frame::Error(line))));
            }
            if first == b"RH" {
                if !matches!(expect, Expect::Values | Expect::Hits | Expect::Meta) {
                    return bad("RH in reply to a request that reads nothing", line);
                }
                // RH hot <key> <replicas> <lease-ms>
                let (Some(b"hot"), Some(key), Some(replicas), Some(lease_ms), None) =
                    (w.next(), w.next(), num::<u32>(w.next()), num::<u64>(w.next()), w.next())
                else {
                    return bad("bad RH line", line);
                };
                self.hinted = true;
                return Ok((next, Some(Frame::Hint(Hint { key, replicas, lease_ms }))));
            }
            if self.multi {
                return bad("unexpected line inside a multi-line reply", line);
            }
            self.hinted = false;
            if expect == Expect::Meta && first.len() == 2 && first != b"RD" {
                let code = [first[0], first[1]];
                match &code {
                    b"HD" | b"EN" | b"NF" | b"NS" | b"EX" | b"MN" | b"ME" => {
                        return Ok((next, Some(Frame::Meta { code, line, data: None })));
                    }
                    b"VA" => {
                        let Some(len) = num::<usize>(w.next()) else { return bad("bad VA line", line) };
                        let end = next.checked_add(len).filter(|&e| e <= usize::MAX - 2);
                        let Some(end) = end else { return bad("value length overflows", line) };
                        if buf.len() < end + 2 {
                            if buf.len() > end && buf[end] != b'\r' {
                                return Err(ReplyError("value data not followed by CR LF".into()));
                            }
                            return Ok((pos, None));
                        }
                        if &buf[end..end + 2] != b"\r\n" {
                            return Err(ReplyError("value data not followed by CR LF".into()));
                        }
                        return Ok((end + 2, Some(Frame::Meta { code, line, data: Some(&buf[next..end]) })));
                    }
                    _ => return bad("unrecognised meta reply line", line),
                }
            }
            let only = |f: Frame<'a>, w: &mut dyn Iterator<Item = &[u8]>| match w.next() {
                None => Ok(f),
                Some(_) => bad("trailing words in reply line", line),
            };
            let frame = match first {
                b"STORED" => only(Frame::Stored, &mut w)?,
                b"NOT_STORED" => only(Frame::NotStored, &mut w)?,
                b"EXISTS" => only(Frame::Exists, &mut w)?,
                b"NOT_FOUND" => only(Frame::NotFound, &mut w)?,
                b"DELETED" => only(Frame::Deleted, &mut w)?,
                b"TOUCHED" => only(Frame::Touched, &mut w)?,
                b"OK" => match w.next() {
                    None => Frame::Ok,
                    Some(n) => match num(Some(n)) {
                        Some(n) => only(Frame::OkCount(n), &mut w)?,
                        None => return bad("bad OK line", line),
                    },
                },
                b"SLOTS" => {
                    let (Some(granted), Some(lease_ms)) = (num(w.next()), num(w.next())) else {
                        return bad("bad SLOTS line", line);
                    };
                    only(Frame::Slots { granted, lease_ms }, &mut w)?
                }
                b"HELD" => {
                    let Some(n) = num(w.next()) else { return bad("bad HELD line", line) };
                    only(Frame::Held(n), &mut w)?
                }
                b"RD" => {
                    let (Some(epoch), Some(server), Some(worker)) = (num(w.next()), num(w.next()), num(w.next()))
                    else {
                        return bad("bad redirect line", line);
                    };
                    only(Frame::Redirect { epoch, server, worker }, &mut w)?
                }
                b"MBAL" => {
                    let (Some(server), Some(worker), Some(epoch)) = (num(w.next()), num(w.next()), num(w.next()))
                    else {
                        return bad("bad MBAL line", line);
                    };
                    // The thread count came later: 0 (route per worker) when a server leaves it out.
                    let threads = match w.next() {
                        None => 0,
                        Some(t) => match num(Some(t)) {
                            Some(t) => t,
                            None => return bad("bad MBAL line", line),
                        },
                    };
                    only(Frame::Hello { server, worker, epoch, threads }, &mut w)?
                }
                b"MOVED" => {
                    let Some(epoch) = num(w.next()) else { return bad("bad MOVED line", line) };
                    only(Frame::Moved { epoch }, &mut w)?
                }
                b"MAP" | b"LOAD" => {
                    // A line with a number and a length, then that many bytes of JSON.
                    let (Some(n), Some(len), None) = (num(w.next()), num::<usize>(w.next()), w.next()) else {
                        return bad("bad MAP/LOAD line", line);
                    };
                    if len > MAX_MAP {
                        return bad("map or snapshot larger than MAX_MAP", line);
                    }
                    if buf.len() < next + len + 2 {
                        if buf.len() > next + len && buf[next + len] != b'\r' {
                            return Err(ReplyError("map data not followed by CR LF".into()));
                        }
                        return Ok((pos, None));
                    }
                    if &buf[next + len..next + len + 2] != b"\r\n" {
                        return Err(ReplyError("map data not followed by CR LF".into()));
                    }
                    let json = &buf[next..next + len];
                    let frame =
                        if first == b"MAP" { Frame::Map { epoch: n, json } } else { Frame::Load { seq: n, json } };
                    return Ok((next + len + 2, Some(frame)));
                }
                d => match num_u64(d) {
                    // memcached pads incr/decr results with spaces in some versions
                    Some(n) => only(Frame::Number(n), &mut w)?,
                    None => return bad("unrecognised reply line", line),
                },
            };
            return Ok((next, Some(frame)));
        }
    }
}

/// One `VALUE` item, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedValue {
    pub key: Vec<u8>,
    pub flags: u32,
    pub data: Vec<u8>,
    pub cas: Option<u64>,
}

/// One complete reply, owned (see [`ReplyReader`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `VALUE ...` items up to `END` (possibly none).
    Values(Vec<OwnedValue>),
    /// The item count of a retrieval reply read with [`Expect::Hits`].
    Hits(u32),
    /// `STAT name value` lines up to `END`.
    Stats(Vec<(String, String)>),
    Stored,
    NotStored,
    Exists,
    NotFound,
    Deleted,
    Touched,
    Ok,
    OkCount(u64),
    Slots {
        granted: u64,
        lease_ms: u64,
    },
    Held(u64),
    Number(u64),
    Redirect {
        epoch: u64,
        server: u16,
        worker: u16,
    },
    Hello {
        server: u16,
        worker: u16,
        epoch: u64,
        threads: u16,
    },
    Map {
        epoch: u64,
        json: Vec<u8>,
    },
    Moved {
        epoch: u64,
    },
    /// A meta reply: its line (without CR LF) and the data of a `VA`.
    Meta {
        line: String,
        data: Option<Vec<u8>>,
    },
    Load {
        seq: u64,
        json: Vec<u8>,
    },
    /// `ERROR`, `CLIENT_ERROR ...` or `SERVER_ERROR ...` (without CR LF).
    Error(String),
}

#[derive(Debug, Default)]
enum Partial {
    #[default]
    None,
    Values(Vec<OwnedValue>),
    Stats(Vec<(String, String)>),
}

/// Hints a [`ReplyReader`] keeps for [`ReplyReader::take_hints`]; later ones
/// are dropped (a hint is advice: losing one costs a read at home).
pub const MAX_HINTS: usize = 1024;

/// A [`Decoder`] with its own buffer, returning whole owned replies. See
/// the module docs.
#[derive(Debug, Default)]
pub struct ReplyReader {
    buf: Vec<u8>,
    pos: usize,
    dec: Decoder,
    partial: Partial,
    hints: Vec<OwnedHint>,
}

impl ReplyReader {
    pub fn new() -> ReplyReader {
        ReplyReader::default()
    }

    /// Append received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.compact();
        self.buf.extend_from_slice(bytes);
    }

    /// Read once from `r` into the buffer; returns the byte count (0 = EOF).
    pub fn read_from<R: Read>(&mut self, r: &mut R) -> io::Result<usize> {
        self.compact();
        let len = self.buf.len();
        self.buf.resize(len + 64 * 1024, 0);
        let res = r.read(&mut self.buf[len..]);
        self.buf.truncate(len + *res.as_ref().unwrap_or(&0));
        res
    }

    /// Read from `r` until one whole reply is in, and return it: the one
    /// loop of mbal's blocking clients of its own extensions (`mbal load`,
    /// `mbal map`, ...). A closed connection before it is complete is
    /// `UnexpectedEof`, a malformed reply `InvalidData`; a read timeout
    /// (`WouldBlock`, `TimedOut`) comes back as it is, with what was read
    /// kept for the next call.
    pub fn read_reply<R: Read>(&mut self, r: &mut R, expect: Expect) -> io::Result<Reply> {
        loop {
            if let Some(reply) = self.next(expect).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.0))? {
                return Ok(reply);
            }
            match self.read_from(r) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed mid-reply")),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Bytes received and not yet returned as (part of) a reply.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Is a reply half read?
    pub fn mid_reply(&self) -> bool {
        self.dec.mid_reply()
    }

    /// The hints read since the last call (at most [`MAX_HINTS`]), in stream
    /// order; those of a reply are all here once [`ReplyReader::next`] has
    /// returned it.
    pub fn take_hints(&mut self) -> Vec<OwnedHint> {
        std::mem::take(&mut self.hints)
    }

    fn compact(&mut self) {
        if self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        } else if self.pos > 4096 && self.pos * 2 > self.buf.len() {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
    }

    /// The next complete reply, `Ok(None)` when more bytes are needed.
    pub fn next(&mut self, expect: Expect) -> Result<Option<Reply>, ReplyError> {
        loop {
            let (n, frame) = self.dec.decode(&self.buf[self.pos..], expect)?;
            self.pos += n;
            let Some(frame) = frame else { return Ok(None) };
            let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            let reply = match frame {
                Frame::Value(v) => {
                    let v = OwnedValue { key: v.key.to_vec(), flags: v.flags, data: v.data.to_vec(), cas: v.cas };
                    match &mut self.partial {
                        Partial::Values(vs) => vs.push(v),
                        p => *p = Partial::Values(vec![v]),
                    }
                    continue;
                }
                Frame::Hint(h) => {
                    if self.hints.len() < MAX_HINTS {
                        self.hints.push(h.into());
                    }
                    continue;
                }
                Frame::Stat { name, value } => {
                    let st = (s(name), s(value));
                    match &mut self.partial {
                        Partial::Stats(st_all) => st_all.push(st),
                        p => *p = Partial::Stats(vec![st]),
                    }
                    continue;
                }
                Frame::End { items } => match (expect, std::mem::take(&mut self.partial)) {
                    (Expect::Hits, _) => Reply::Hits(items),
                    (Expect::Stats, Partial::Stats(st)) => Reply::Stats(st),
                    (Expect::Stats, _) => Reply::Stats(Vec::new()),
                    (_, Partial::Values(vs)) => Reply::Values(vs),
                    _ => Reply::Values(Vec::new()),
                },
                Frame::Stored => Reply::Stored,
                Frame::NotStored => Reply::NotStored,
                Frame::Exists => Reply::Exists,
                Frame::NotFound => Reply::NotFound,
                Frame::Deleted => Reply::Deleted,
                Frame::Touched => Reply::Touched,
                Frame::Ok => Reply::Ok,
                Frame::OkCount(n) => Reply::OkCount(n),
                Frame::Slots { granted, lease_ms } => Reply::Slots { granted, lease_ms },
                Frame::Held(n) => Reply::Held(n),
                Frame::Number(n) => Reply::Number(n),
                Frame::Redirect { epoch, server, worker } => Reply::Redirect { epoch, server, worker },
                Frame::Hello { server, worker, epoch, threads } => Reply::Hello { server, worker, epoch, threads },
                Frame::Map { epoch, json } => Reply::Map { epoch, json: json.to_vec() },
                Frame::Moved { epoch } => Reply::Moved { epoch },
                Frame::Meta { line, data, .. } => Reply::Meta { line: s(line), data: data.map(<[u8]>::to_vec) },
                Frame::Load { seq, json } => Reply::Load { seq, json: json.to_vec() },
                Frame::Error(l) => {
                    self.partial = Partial::None;
                    Reply::Error(s(l))
                }
            };
            return Ok(Some(reply));
        }
    }
}

#[cfg(test)]
mod tests;
