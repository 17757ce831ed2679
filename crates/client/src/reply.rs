//! Incremental parser for the replies an mbal (or memcached) server sends on
//! the text protocol, plus mbal's extension replies (`MBAL`, `MAP`, `RD`,
//! `MOVED`).
//!
//! [`ReplyParser`] owns a byte buffer. Bytes arrive with [`ReplyParser::feed`]
//! or [`ReplyParser::read_from`]; [`ReplyParser::next`] returns one complete
//! reply, or `None` when the buffer holds only part of one. Nothing is
//! consumed until a whole reply is there, except the VALUE/STAT elements of a
//! multi-element reply, which are kept in the parser between calls so a long
//! multi-get is parsed in linear time. Several pipelined replies in the
//! buffer come out one per call, in order.

use std::io::{self, Read};

/// The longest reply line (without data) accepted before the stream is
/// declared broken.
pub const MAX_LINE: usize = 8192;

/// What the request expects, which decides how `END`, `VALUE` and `STAT`
/// lines are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// `get`/`gets`: `VALUE` blocks then `END`.
    Values,
    /// `stats [group]`: `STAT` lines then `END`.
    Stats,
    /// Every other request: one line (or `MAP` with its body).
    Line,
}

/// One value block of a retrieval reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawValue {
    pub key: Vec<u8>,
    pub flags: u32,
    pub data: Vec<u8>,
    pub cas: Option<u64>,
}

/// One complete reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `VALUE ...` blocks up to `END` (possibly none).
    Values(Vec<RawValue>),
    /// `STAT name value` lines up to `END`.
    Stats(Vec<(String, String)>),
    Stored,
    NotStored,
    Exists,
    NotFound,
    Deleted,
    Touched,
    Ok,
    /// `incr`/`decr` result.
    Number(u64),
    /// `RD <epoch> <server> <worker>`: the key's cachelet is elsewhere.
    Redirect {
        epoch: u64,
        server: u16,
        worker: u16,
    },
    /// `MBAL <server> <worker> <epoch>`: reply to `mbal hello`.
    Hello {
        server: u16,
        worker: u16,
        epoch: u64,
    },
    /// `MAP <epoch> <bytes>` + JSON: reply to `mbal map`.
    Map {
        epoch: u64,
        json: Vec<u8>,
    },
    /// `MOVED <epoch>`: reply to `mbal move`.
    Moved {
        epoch: u64,
    },
    /// `ERROR`, `CLIENT_ERROR ...` or `SERVER_ERROR ...` (line without CRLF).
    Error(String),
}

/// The stream is not a valid reply stream (the connection must be dropped).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

#[derive(Default)]
enum Partial {
    #[default]
    None,
    Values(Vec<RawValue>),
    Stats(Vec<(String, String)>),
}

/// Incremental reply parser; see the module docs.
#[derive(Default)]
pub struct ReplyParser {
    buf: Vec<u8>,
    pos: usize,
    partial: Partial,
}

fn perr<T>(msg: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError(msg.into()))
}

fn num<T: std::str::FromStr>(field: Option<&[u8]>, what: &str, line: &[u8]) -> Result<T, ParseError> {
    field
        .and_then(|f| std::str::from_utf8(f).ok())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ParseError(format!("bad {what} in reply line {:?}", String::from_utf8_lossy(line))))
}

fn words(line: &[u8]) -> impl Iterator<Item = &[u8]> {
    line.split(|&b| b == b' ').filter(|w| !w.is_empty())
}

impl ReplyParser {
    pub fn new() -> ReplyParser {
        ReplyParser::default()
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
        let want = 64 * 1024;
        self.buf.resize(len + want, 0);
        let res = r.read(&mut self.buf[len..]);
        let n = *res.as_ref().unwrap_or(&0);
        self.buf.truncate(len + n);
        res
    }

    /// Bytes received and not yet returned as (part of) a reply.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Is a multi-element reply half read?
    pub fn in_reply(&self) -> bool {
        !matches!(self.partial, Partial::None)
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

    /// The next line from `pos`: (line without CR LF, index after LF).
    fn line_at(&self, from: usize) -> Result<Option<(usize, usize)>, ParseError> {
        let rest = &self.buf[from..];
        match memchr::memchr(b'\n', rest) {
            Some(i) => {
                let end = if i > 0 && rest[i - 1] == b'\r' { i - 1 } else { i };
                Ok(Some((from + end, from + i + 1)))
            }
            None if rest.len() > MAX_LINE => perr(format!("reply line longer than {MAX_LINE} bytes")),
            None => Ok(None),
        }
    }

    /// The next complete reply, `Ok(None)` when more bytes are needed.
    pub fn next(&mut self, expect: Expect) -> Result<Option<Reply>, ParseError> {
        loop {
            let Some((end, next)) = self.line_at(self.pos)? else { return Ok(None) };
            let line = &self.buf[self.pos..end];
            let first = words(line).next().unwrap_or(b"");
            match first {
                b"VALUE" => {
                    if expect != Expect::Values {
                        return perr("VALUE in reply to a request that retrieves nothing");
                    }
                    let mut w = words(line).skip(1);
                    let key = w.next().ok_or_else(|| ParseError("VALUE line without key".into()))?.to_vec();
                    let flags: u32 = num(w.next(), "flags", line)?;
                    let len: usize = num(w.next(), "length", line)?;
                    let cas: Option<u64> = match w.next() {
                        Some(c) => Some(num(Some(c), "cas", line)?),
                        None => None,
                    };
                    if self.buf.len() < next + len + 2 {
                        return Ok(None);
                    }
                    if &self.buf[next + len..next + len + 2] != b"\r\n" {
                        return perr("value data not followed by CR LF");
                    }
                    let data = self.buf[next..next + len].to_vec();
                    self.pos = next + len + 2;
                    let v = RawValue { key, flags, data, cas };
                    match &mut self.partial {
                        Partial::Values(vs) => vs.push(v),
                        _ => self.partial = Partial::Values(vec![v]),
                    }
                }
                b"STAT" => {
                    if expect != Expect::Stats {
                        return perr("STAT in reply to a request that is not stats");
                    }
                    let text = String::from_utf8_lossy(line);
                    let mut it = text.splitn(3, ' ');
                    it.next();
                    let name = it.next().unwrap_or("").to_string();
                    let value = it.next().unwrap_or("").to_string();
                    self.pos = next;
                    match &mut self.partial {
                        Partial::Stats(s) => s.push((name, value)),
                        _ => self.partial = Partial::Stats(vec![(name, value)]),
                    }
                }
                b"END" if line.len() == 3 => {
                    self.pos = next;
                    let p = std::mem::take(&mut self.partial);
                    return match (expect, p) {
                        (Expect::Values, Partial::Values(v)) => Ok(Some(Reply::Values(v))),
                        (Expect::Values, Partial::None) => Ok(Some(Reply::Values(Vec::new()))),
                        (Expect::Stats, Partial::Stats(s)) => Ok(Some(Reply::Stats(s))),
                        (Expect::Stats, Partial::None) => Ok(Some(Reply::Stats(Vec::new()))),
                        _ => perr("END in reply to a request that expects one line"),
                    };
                }
                _ => {
                    if self.in_reply() {
                        // An error line ends a half-read multi-element reply;
                        // anything else is out of place.
                        if !(first == b"ERROR" || first == b"SERVER_ERROR" || first == b"CLIENT_ERROR") {
                            return perr(format!(
                                "unexpected line {:?} inside a multi-line reply",
                                String::from_utf8_lossy(line)
                            ));
                        }
                        self.partial = Partial::None;
                    }
                    return self.single(end, next);
                }
            }
        }
    }

    /// A one-line reply (or `MAP` with its body) at `pos`.
    fn single(&mut self, end: usize, next: usize) -> Result<Option<Reply>, ParseError> {
        let line = &self.buf[self.pos..end];
        let mut w = words(line);
        let first = w.next().unwrap_or(b"");
        let only = |r: Reply| if words(line).count() == 1 { Ok(r) } else { perr("trailing words") };
        let reply = match first {
            b"STORED" => only(Reply::Stored),
            b"NOT_STORED" => only(Reply::NotStored),
            b"EXISTS" => only(Reply::Exists),
            b"NOT_FOUND" => only(Reply::NotFound),
            b"DELETED" => only(Reply::Deleted),
            b"TOUCHED" => only(Reply::Touched),
            b"OK" => only(Reply::Ok),
            b"ERROR" | b"CLIENT_ERROR" | b"SERVER_ERROR" => {
                Ok(Reply::Error(String::from_utf8_lossy(line).into_owned()))
            }
            b"RD" => {
                let epoch = num(w.next(), "epoch", line)?;
                let server = num(w.next(), "server", line)?;
                let worker = num(w.next(), "worker", line)?;
                Ok(Reply::Redirect { epoch, server, worker })
            }
            b"MBAL" => {
                let server = num(w.next(), "server", line)?;
                let worker = num(w.next(), "worker", line)?;
                let epoch = num(w.next(), "epoch", line)?;
                Ok(Reply::Hello { server, worker, epoch })
            }
            b"MOVED" => Ok(Reply::Moved { epoch: num(w.next(), "epoch", line)? }),
            b"MAP" => {
                let epoch = num(w.next(), "epoch", line)?;
                let len: usize = num(w.next(), "length", line)?;
                if self.buf.len() < next + len + 2 {
                    return Ok(None);
                }
                if &self.buf[next + len..next + len + 2] != b"\r\n" {
                    return perr("map data not followed by CR LF");
                }
                let json = self.buf[next..next + len].to_vec();
                self.pos = next + len + 2;
                return Ok(Some(Reply::Map { epoch, json }));
            }
            d if !d.is_empty() && d.iter().all(u8::is_ascii_digit) => {
                // memcached pads incr/decr results with spaces in some versions.
                Ok(Reply::Number(num(Some(d), "number", line)?))
            }
            _ => perr(format!("unrecognised reply line {:?}", String::from_utf8_lossy(line))),
        };
        let reply = reply.map_err(|e| ParseError(format!("{}: {:?}", e.0, String::from_utf8_lossy(line))))?;
        self.pos = next;
        Ok(Some(reply))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(bytes: &[u8], expects: &[Expect]) -> Vec<Reply> {
        let mut p = ReplyParser::new();
        p.feed(bytes);
        let out: Vec<Reply> = expects.iter().map(|&e| p.next(e).unwrap().expect("complete")).collect();
        assert_eq!(p.buffered(), 0, "everything consumed");
        out
    }

    /// Feed one byte at a time: no reply may appear before its last byte.
    fn parse_bytewise(bytes: &[u8], expects: &[Expect]) -> Vec<Reply> {
        let mut p = ReplyParser::new();
        let mut out = Vec::new();
        let mut i = 0;
        for (n, b) in bytes.iter().enumerate() {
            p.feed(std::slice::from_ref(b));
            while i < expects.len() {
                match p.next(expects[i]).unwrap() {
                    Some(r) => {
                        out.push((n, r));
                        i += 1;
                    }
                    None => break,
                }
            }
        }
        assert_eq!(out.len(), expects.len());
        out.into_iter().map(|(_, r)| r).collect()
    }

    fn v(key: &str, flags: u32, data: &[u8], cas: Option<u64>) -> RawValue {
        RawValue { key: key.into(), flags, data: data.to_vec(), cas }
    }

    #[test]
    fn every_reply_kind() {
        let stream = b"STORED\r\nNOT_STORED\r\nEXISTS\r\nNOT_FOUND\r\nDELETED\r\nTOUCHED\r\nOK\r\n42\r\n\
18446744073709551615\r\nRD 7 2 1\r\nMBAL 1 3 9\r\nMOVED 12\r\nMAP 5 7\r\n{\"a\":1}\r\nERROR\r\n\
CLIENT_ERROR bad command line format\r\nSERVER_ERROR out of memory\r\nEND\r\n\
VALUE k 5 3\r\nabc\r\nVALUE k2 0 0 99\r\n\r\nEND\r\nSTAT pid 12\r\nSTAT version 1.6 x\r\nEND\r\nEND\r\n";
        let want = vec![
            Reply::Stored,
            Reply::NotStored,
            Reply::Exists,
            Reply::NotFound,
            Reply::Deleted,
            Reply::Touched,
            Reply::Ok,
            Reply::Number(42),
            Reply::Number(u64::MAX),
            Reply::Redirect { epoch: 7, server: 2, worker: 1 },
            Reply::Hello { server: 1, worker: 3, epoch: 9 },
            Reply::Moved { epoch: 12 },
            Reply::Map { epoch: 5, json: b"{\"a\":1}".to_vec() },
            Reply::Error("ERROR".into()),
            Reply::Error("CLIENT_ERROR bad command line format".into()),
            Reply::Error("SERVER_ERROR out of memory".into()),
            Reply::Values(vec![]),
            Reply::Values(vec![v("k", 5, b"abc", None), v("k2", 0, b"", Some(99))]),
            Reply::Stats(vec![("pid".into(), "12".into()), ("version".into(), "1.6 x".into())]),
            Reply::Stats(vec![]),
        ];
        // 16 one-line replies, two retrievals, two stats.
        let mut ex2 = vec![Expect::Line; 16];
        ex2.extend([Expect::Values, Expect::Values, Expect::Stats, Expect::Stats]);
        assert_eq!(parse_all(stream, &ex2), want);
        assert_eq!(parse_bytewise(stream, &ex2), want);
    }

    #[test]
    fn value_data_may_contain_crlf_and_value_words() {
        let stream = b"VALUE a 1 12\r\nEND\r\nVALUE b\r\nEND\r\n";
        let r = parse_bytewise(stream, &[Expect::Values]);
        assert_eq!(r, vec![Reply::Values(vec![v("a", 1, b"END\r\nVALUE b", None)])]);
    }

    #[test]
    fn incomplete_reply_is_not_consumed() {
        let mut p = ReplyParser::new();
        p.feed(b"VALUE a 0 5\r\nhel");
        assert_eq!(p.next(Expect::Values).unwrap(), None);
        p.feed(b"lo\r\nVALUE b 0 1\r\nx\r\n");
        assert_eq!(p.next(Expect::Values).unwrap(), None, "END not yet seen");
        assert!(p.in_reply());
        p.feed(b"END\r\nSTO");
        assert_eq!(
            p.next(Expect::Values).unwrap(),
            Some(Reply::Values(vec![v("a", 0, b"hello", None), v("b", 0, b"x", None)]))
        );
        assert_eq!(p.next(Expect::Line).unwrap(), None);
        p.feed(b"RED\r\n");
        assert_eq!(p.next(Expect::Line).unwrap(), Some(Reply::Stored));
        assert_eq!(p.next(Expect::Line).unwrap(), None);
    }

    #[test]
    fn map_waits_for_its_body() {
        let mut p = ReplyParser::new();
        p.feed(b"MAP 3 4\r\nab");
        assert_eq!(p.next(Expect::Line).unwrap(), None);
        p.feed(b"cd\r\n");
        assert_eq!(p.next(Expect::Line).unwrap(), Some(Reply::Map { epoch: 3, json: b"abcd".to_vec() }));
    }

    #[test]
    fn error_inside_values_ends_the_reply() {
        let r = parse_all(b"VALUE a 0 1\r\nx\r\nSERVER_ERROR out of memory\r\n", &[Expect::Values]);
        assert_eq!(r, vec![Reply::Error("SERVER_ERROR out of memory".into())]);
    }

    #[test]
    fn malformed_streams_are_errors() {
        let bad: &[(&[u8], Expect)] = &[
            (b"VALUE a x 1\r\nx\r\nEND\r\n", Expect::Values),
            (b"VALUE a 0 1\r\nxy\r\nEND\r\n", Expect::Values),
            (b"VALUE a 0 1\r\nx\r\n", Expect::Line),
            (b"END\r\n", Expect::Line),
            (b"STAT a b\r\n", Expect::Values),
            (b"HELLO\r\n", Expect::Line),
            (b"STORED extra\r\n", Expect::Line),
            (b"RD 1 2\r\n", Expect::Line),
            (b"RD 1 70000 0\r\n", Expect::Line),
            (b"MBAL x 0 1\r\n", Expect::Line),
            (b"VALUE a 0 1\r\nx\r\nSTORED\r\n", Expect::Values),
            (b"MAP 1 2\r\nabcd", Expect::Line),
        ];
        for (bytes, e) in bad {
            let mut p = ReplyParser::new();
            p.feed(bytes);
            assert!(p.next(*e).is_err(), "{:?} must be refused", String::from_utf8_lossy(bytes));
        }
        let mut p = ReplyParser::new();
        p.feed(&vec![b'x'; MAX_LINE + 1]);
        assert!(p.next(Expect::Line).is_err(), "endless line");
    }

    #[test]
    fn bare_lf_is_accepted() {
        assert_eq!(parse_all(b"STORED\n", &[Expect::Line]), vec![Reply::Stored]);
    }

    #[test]
    fn long_pipeline_is_compacted() {
        let mut p = ReplyParser::new();
        let mut n = 0;
        for _ in 0..10_000 {
            p.feed(b"VALUE key 0 10\r\n0123456789\r\nEND\r\n");
            if let Some(Reply::Values(v)) = p.next(Expect::Values).unwrap() {
                assert_eq!(v.len(), 1);
                n += 1;
            }
        }
        assert_eq!(n, 10_000);
        assert!(p.buf.capacity() < 1 << 20, "buffer does not grow without bound");
    }

    #[test]
    fn read_from_reads_a_stream() {
        let data: &[u8] = b"DELETED\r\nVALUE a 0 2\r\nhi\r\nEND\r\n";
        let mut r = data;
        let mut p = ReplyParser::new();
        assert_eq!(p.read_from(&mut r).unwrap(), data.len());
        assert_eq!(p.next(Expect::Line).unwrap(), Some(Reply::Deleted));
        assert_eq!(p.next(Expect::Values).unwrap(), Some(Reply::Values(vec![v("a", 0, b"hi", None)])));
        assert_eq!(p.read_from(&mut r).unwrap(), 0, "EOF");
    }
}
