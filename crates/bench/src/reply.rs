//! Incremental parser for memcached text-protocol replies, as a client sees them.
//!
//! The caller keeps a read buffer and tells the parser which kind of reply comes next (replies
//! arrive in request order). [`ReplyParser::parse`] consumes as much as it can: whole lines and
//! value bodies (a value body is skipped even when only part of it has arrived, so a large value
//! never has to be buffered), and reports a [`Reply`] when one is complete. State survives
//! between calls, so input may be split anywhere.

use memchr::memchr;

/// What the next reply on the wire answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// `get`/`gets`: zero or more `VALUE` items then `END`.
    Get,
    /// `set`/`add`/...: one status line.
    Store,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// A complete get reply with this many `VALUE` items.
    Get {
        hits: u32,
    },
    Stored,
    NotStored,
    Exists,
    NotFound,
    /// `ERROR`, `CLIENT_ERROR ...` or `SERVER_ERROR ...`.
    Error,
    /// mbal's `RD <epoch> <server> <worker>` (routed connections only): the whole reply of the
    /// request is this line; the key's cachelet is served by (`server`, `worker`) as of map
    /// `epoch`.
    Redirect {
        epoch: u64,
        server: u16,
        worker: u16,
    },
}

#[derive(Debug, PartialEq, Eq)]
pub struct ParseError(pub String);

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "bad reply from server: {}", self.0)
    }
}
impl std::error::Error for ParseError {}

/// Longest reply line accepted before the stream is declared garbage.
const MAX_LINE: usize = 8192;

#[derive(Default, Debug)]
pub struct ReplyParser {
    /// Hits counted so far in the get reply being parsed.
    hits: u32,
    /// Bytes of a value body (plus its CRLF) still to skip.
    skip: usize,
    in_get: bool,
}

impl ReplyParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Parse from `buf`. Returns `(consumed, Some(reply))` when a reply completed (stop there;
    /// the next reply may be of another kind), or `(consumed, None)` when more input is needed
    /// (`consumed` bytes can be dropped anyway).
    pub fn parse(&mut self, buf: &[u8], expect: Expect) -> Result<(usize, Option<Reply>), ParseError> {
        let mut pos = 0;
        loop {
            if self.skip > 0 {
                let n = self.skip.min(buf.len() - pos);
                // the last two bytes must be CRLF; check when we have them
                if n == self.skip && n >= 2 && &buf[pos + n - 2..pos + n] != b"\r\n" {
                    return Err(ParseError("value body not terminated by CRLF".into()));
                }
                self.skip -= n;
                pos += n;
                if self.skip > 0 {
                    return Ok((pos, None));
                }
            }
            let rest = &buf[pos..];
            let Some(nl) = memchr(b'\n', rest) else {
                if rest.len() > MAX_LINE {
                    return Err(ParseError("reply line too long".into()));
                }
                return Ok((pos, None));
            };
            let line = &rest[..nl];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            pos += nl + 1;
            match expect {
                Expect::Get => {
                    if line == b"END" {
                        let hits = self.hits;
                        self.hits = 0;
                        self.in_get = false;
                        return Ok((pos, Some(Reply::Get { hits })));
                    } else if let Some(rest) = line.strip_prefix(b"VALUE ") {
                        // VALUE <key> <flags> <bytes> [<cas>]
                        let mut it = rest.split(|&b| b == b' ').filter(|t| !t.is_empty());
                        let (_key, _flags, bytes) = (it.next(), it.next(), it.next());
                        let bytes = bytes
                            .and_then(|b| std::str::from_utf8(b).ok())
                            .and_then(|b| b.parse::<usize>().ok())
                            .ok_or_else(|| ParseError(format!("bad VALUE line {:?}", String::from_utf8_lossy(line))))?;
                        self.in_get = true;
                        self.hits += 1;
                        self.skip = bytes + 2;
                    } else if is_error(line) {
                        self.hits = 0;
                        self.in_get = false;
                        return Ok((pos, Some(Reply::Error)));
                    } else if line.starts_with(b"RD ") && !self.in_get {
                        return Ok((pos, Some(parse_redirect(line)?)));
                    } else {
                        return Err(ParseError(format!("unexpected line in get reply {:?}", lossy(line))));
                    }
                }
                Expect::Store => {
                    let r = match line {
                        b"STORED" => Reply::Stored,
                        b"NOT_STORED" => Reply::NotStored,
                        b"EXISTS" => Reply::Exists,
                        b"NOT_FOUND" => Reply::NotFound,
                        l if is_error(l) => Reply::Error,
                        l if l.starts_with(b"RD ") => parse_redirect(l)?,
                        l => return Err(ParseError(format!("unexpected store reply {:?}", lossy(l)))),
                    };
                    return Ok((pos, Some(r)));
                }
            }
        }
    }

    /// True when the parser is in the middle of a reply.
    pub fn mid_reply(&self) -> bool {
        self.in_get || self.skip > 0
    }
}

/// `RD <epoch> <server> <worker>`.
fn parse_redirect(line: &[u8]) -> Result<Reply, ParseError> {
    fn num<T: std::str::FromStr>(t: Option<&[u8]>) -> Option<T> {
        std::str::from_utf8(t?).ok()?.parse().ok()
    }
    let mut it = line[3..].split(|&b| b == b' ').filter(|t| !t.is_empty());
    let r = (|| {
        let epoch = num(it.next())?;
        let server = num(it.next())?;
        let worker = num(it.next())?;
        if it.next().is_some() {
            return None;
        }
        Some(Reply::Redirect { epoch, server, worker })
    })();
    r.ok_or_else(|| ParseError(format!("bad redirect line {:?}", lossy(line))))
}

fn is_error(line: &[u8]) -> bool {
    line == b"ERROR" || line.starts_with(b"CLIENT_ERROR") || line.starts_with(b"SERVER_ERROR")
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(&b[..b.len().min(100)]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `input` split at every chunk size, collecting replies.
    fn feed(input: &[u8], expects: &[Expect], chunk: usize) -> Vec<Reply> {
        let mut p = ReplyParser::new();
        let mut buf: Vec<u8> = Vec::new();
        let mut out = Vec::new();
        let mut fed = 0;
        let mut ei = 0;
        while ei < expects.len() {
            let (n, r) = p.parse(&buf, expects[ei]).unwrap();
            buf.drain(..n);
            match r {
                Some(r) => {
                    out.push(r);
                    ei += 1;
                }
                None => {
                    assert!(fed < input.len(), "ran out of input, got {out:?}");
                    let end = (fed + chunk).min(input.len());
                    buf.extend_from_slice(&input[fed..end]);
                    fed = end;
                }
            }
        }
        assert!(buf.is_empty() && fed == input.len());
        out
    }

    #[test]
    fn pipelined_replies_any_split() {
        let input = b"VALUE k1 0 5\r\nhello\r\nVALUE k2 3 0 99\r\n\r\nEND\r\nSTORED\r\nEND\r\nNOT_STORED\r\nSERVER_ERROR out of memory\r\nCLIENT_ERROR bad\r\nVALUE k 0 3\r\nEND\r\nEND\r\nEXISTS\r\nNOT_FOUND\r\n";
        let ex = [
            Expect::Get,
            Expect::Store,
            Expect::Get,
            Expect::Store,
            Expect::Store,
            Expect::Get,
            Expect::Get,
            Expect::Store,
            Expect::Store,
        ];
        let want = vec![
            Reply::Get { hits: 2 },
            Reply::Stored,
            Reply::Get { hits: 0 },
            Reply::NotStored,
            Reply::Error,
            Reply::Error,
            // a value body that itself looks like "END": must be skipped as data
            Reply::Get { hits: 1 },
            Reply::Exists,
            Reply::NotFound,
        ];
        // the 7th get: "VALUE k 0 3\r\nEND\r\n" + "END\r\n" -> body "END" then END
        for chunk in [1, 2, 3, 7, 64, 4096] {
            assert_eq!(feed(input, &ex, chunk), want, "chunk {chunk}");
        }
    }

    #[test]
    fn garbage_is_an_error() {
        let mut p = ReplyParser::new();
        assert!(p.parse(b"HELLO\r\n", Expect::Get).is_err());
        let mut p = ReplyParser::new();
        assert!(p.parse(b"END\r\n", Expect::Store).is_err());
        let mut p = ReplyParser::new();
        assert!(p.parse(b"VALUE k 0 x\r\n", Expect::Get).is_err());
        let mut p = ReplyParser::new();
        assert!(p.parse(b"VALUE k 0 2\r\nabcd", Expect::Get).is_err());
        let mut p = ReplyParser::new();
        assert!(p.parse(&vec![b'a'; MAX_LINE + 1], Expect::Get).is_err());
    }

    #[test]
    fn redirects_replace_any_reply() {
        let input = b"RD 7 2 1\r\nVALUE k 0 1\r\nx\r\nEND\r\nRD 12 0 3\r\nSTORED\r\n";
        let ex = [Expect::Get, Expect::Get, Expect::Store, Expect::Store];
        let want = vec![
            Reply::Redirect { epoch: 7, server: 2, worker: 1 },
            Reply::Get { hits: 1 },
            Reply::Redirect { epoch: 12, server: 0, worker: 3 },
            Reply::Stored,
        ];
        for chunk in [1, 3, 4096] {
            assert_eq!(feed(input, &ex, chunk), want, "chunk {chunk}");
        }
        for bad in [&b"RD 1 2\r\n"[..], b"RD x 1 2\r\n", b"RD 1 2 3 4\r\n", b"RD 1 70000 0\r\n"] {
            assert!(ReplyParser::new().parse(bad, Expect::Store).is_err(), "{bad:?}");
            assert!(ReplyParser::new().parse(bad, Expect::Get).is_err(), "{bad:?}");
        }
        // inside a get reply (after a VALUE) an RD line is garbage, not a redirect
        assert!(ReplyParser::new().parse(b"VALUE k 0 1\r\nx\r\nRD 1 0 0\r\n", Expect::Get).is_err());
    }

    #[test]
    fn large_value_consumed_progressively() {
        let mut p = ReplyParser::new();
        let (n, r) = p.parse(b"VALUE big 0 1000000\r\n", Expect::Get).unwrap();
        assert_eq!((n, r), (21, None));
        assert!(p.mid_reply());
        let chunk = vec![b'x'; 500_000];
        assert_eq!(p.parse(&chunk, Expect::Get).unwrap(), (500_000, None));
        assert_eq!(p.parse(&chunk, Expect::Get).unwrap(), (500_000, None));
        let (n, r) = p.parse(b"\r\nEND\r\n", Expect::Get).unwrap();
        assert_eq!((n, r), (7, Some(Reply::Get { hits: 1 })));
        assert!(!p.mid_reply());
    }
}
