//! Authentication on the wire: memcached's ASCII authentication (`-Y`) and
//! the payload of binary SASL PLAIN. Parsing only; whether credentials are
//! right is the server's business.
//!
//! **ASCII auth** (memcached 1.6.18, `proto_text.c`, checked against the
//! real server): while a text connection is unauthenticated, each request
//! line is looked at on its own. A line of at least five tokens whose first
//! is `set` and whose fifth (`<bytes>`) is a number starts an authentication:
//! its data block of `<bytes>` bytes plus `\r\n` carries `username password`
//! (further tokens ignored). Any other line is answered
//! `CLIENT_ERROR unauthenticated` and dropped (its data, if any, is then read
//! as the next line, as memcached does). A connection that sends more than
//! 2048 bytes without a line end is closed without a reply. Unlike memcached
//! (which waits for any `<bytes>`), a token longer than
//! [`MAX_AUTH_TOKEN`] is refused (`CLIENT_ERROR auth token too long`, as
//! newer memcached does), so an unauthenticated client cannot make the
//! server buffer more than a few KiB.

/// Longest `username password` payload accepted (memcached's `MAX_AUTH_REQ_LEN`).
pub const MAX_AUTH_TOKEN: usize = 16384;
/// Bytes without a line end after which an unauthenticated connection is closed.
pub const MAX_AUTH_LINE: usize = 2048;

pub const E_UNAUTHENTICATED: &[u8] = b"CLIENT_ERROR unauthenticated\r\n";
pub const E_AUTH_FAILURE: &[u8] = b"CLIENT_ERROR authentication failure\r\n";
pub const E_TOKEN_FORMAT: &[u8] = b"CLIENT_ERROR bad authentication token format\r\n";
pub const E_TERMINATION: &[u8] = b"CLIENT_ERROR bad command line termination\r\n";
pub const E_TOKEN_TOO_LONG: &[u8] = b"CLIENT_ERROR auth token too long\r\n";

/// What the front of an unauthenticated text connection's input holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsciiAuth<'a> {
    /// Not enough bytes yet.
    NeedMore,
    /// Junk (no line end within [`MAX_AUTH_LINE`] bytes): close, no reply.
    Close,
    /// Send `reply`, drop `consumed` bytes; the connection stays
    /// unauthenticated.
    Refuse { reply: &'static [u8], consumed: usize },
    /// Credentials to check: `STORED` and authenticated if they are right,
    /// else [`E_AUTH_FAILURE`]; drop `consumed` bytes either way.
    Creds { user: &'a [u8], pass: &'a [u8], consumed: usize },
}

fn tokens(s: &[u8]) -> impl Iterator<Item = &[u8]> {
    s.split(|&b| b == b' ').filter(|t| !t.is_empty())
}

/// memcached's `safe_strtoul` on a token: digits, optionally followed by
/// whitespace (the `\r` of the line end stays in the last token).
fn u32_token(t: &[u8]) -> Option<u32> {
    let end = t.iter().position(|b| !b.is_ascii_digit()).unwrap_or(t.len());
    if end == 0 || !t[end..].iter().all(|b| b.is_ascii_whitespace()) {
        return None;
    }
    std::str::from_utf8(&t[..end]).ok()?.parse().ok()
}

/// Parse the next step of ASCII authentication from the front of `buf`.
pub fn parse_ascii_auth(buf: &[u8]) -> AsciiAuth<'_> {
    let Some(nl) = memchr::memchr(b'\n', buf) else {
        return if buf.len() > MAX_AUTH_LINE { AsciiAuth::Close } else { AsciiAuth::NeedMore };
    };
    let line_len = nl + 1;
    let line = &buf[..nl];
    let mut toks = tokens(line);
    let first = toks.next();
    let size = toks.nth(3).and_then(u32_token);
    let (Some(b"set"), Some(size)) = (first, size) else {
        return AsciiAuth::Refuse { reply: E_UNAUTHENTICATED, consumed: line_len };
    };
    let size = size as usize;
    if size > MAX_AUTH_TOKEN {
        return AsciiAuth::Refuse { reply: E_TOKEN_TOO_LONG, consumed: line_len };
    }
    let total = line_len + size + 2;
    if buf.len() < total {
        return AsciiAuth::NeedMore;
    }
    let data = &buf[line_len..total];
    if &data[size..] != b"\r\n" {
        return AsciiAuth::Refuse { reply: E_TERMINATION, consumed: total };
    }
    let mut creds = tokens(&data[..size]);
    match (creds.next(), creds.next()) {
        (Some(user), Some(pass)) => AsciiAuth::Creds { user, pass, consumed: total },
        _ => AsciiAuth::Refuse { reply: E_TOKEN_FORMAT, consumed: total },
    }
}

/// The mechanism mbal offers (the answer to SASL_LIST_MECHS).
pub const SASL_MECHS: &[u8] = b"PLAIN";

/// A SASL PLAIN message (RFC 4616): `[authzid] NUL authcid NUL passwd`.
/// Returns (authcid, passwd); None when malformed.
pub fn sasl_plain(msg: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut parts = msg.splitn(3, |&b| b == 0);
    let (_authzid, user, pass) = (parts.next()?, parts.next()?, parts.next()?);
    if user.is_empty() || pass.contains(&0) {
        return None;
    }
    Some((user, pass))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(buf: &[u8]) -> (&[u8], &[u8], usize) {
        match parse_ascii_auth(buf) {
            AsciiAuth::Creds { user, pass, consumed } => (user, pass, consumed),
            other => panic!("{:?} -> {other:?}", String::from_utf8_lossy(buf)),
        }
    }

    fn refuse(buf: &[u8]) -> (&'static [u8], usize) {
        match parse_ascii_auth(buf) {
            AsciiAuth::Refuse { reply, consumed } => (reply, consumed),
            other => panic!("{:?} -> {other:?}", String::from_utf8_lossy(buf)),
        }
    }

    #[test]
    fn the_auth_set_carries_user_and_password() {
        let req = b"set foo 0 0 7\r\nfoo bar\r\nget x\r\n";
        assert_eq!(creds(req), (&b"foo"[..], &b"bar"[..], 24));
        // Every strict prefix waits for more.
        for i in 0..24 {
            assert_eq!(parse_ascii_auth(&req[..i]), AsciiAuth::NeedMore, "{i}");
        }
        // Key, flags and exptime are ignored; noreply, extra spaces, a bare \n
        // and extra payload tokens are accepted (memcached 1.6.18).
        assert_eq!(creds(b"set  k  9 9  7 noreply\nfoo bar\r\n").0, b"foo");
        assert_eq!(creds(b"set k 0 0 12\r\nfoo bar baz \r\n").1, b"bar");
    }

    #[test]
    fn other_lines_are_unauthenticated() {
        for line in [
            &b"get foo\r\n"[..],
            b"set foo 0 0\r\n",
            b"setx foo 0 0 7\r\n",
            b"set foo 0 0 abc\r\n",
            b"set foo 0 0 -1\r\n",
            b"add foo 0 0 7\r\n",
            b"g\n",
            b"\r\n",
            b"mbal hello 0\r\n",
        ] {
            assert_eq!(refuse(line), (E_UNAUTHENTICATED, line.len()), "{:?}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn bad_payloads() {
        assert_eq!(refuse(b"set foo 0 0 2\r\nhi\r\n"), (E_TOKEN_FORMAT, 19));
        assert_eq!(refuse(b"set foo 0 0 0\r\n\r\n"), (E_TOKEN_FORMAT, 17));
        assert_eq!(refuse(b"set foo 0 0 7\r\nfoo barx\r\n"), (E_TERMINATION, 24));
        assert_eq!(refuse(b"set foo 0 0 99999\r\n"), (E_TOKEN_TOO_LONG, 19));
        assert_eq!(refuse(b"set foo 0 0 99999999999\r\n").0, E_UNAUTHENTICATED);
    }

    #[test]
    fn junk_without_a_line_end_closes() {
        assert_eq!(parse_ascii_auth(&[b'x'; MAX_AUTH_LINE]), AsciiAuth::NeedMore);
        assert_eq!(parse_ascii_auth(&[b'x'; MAX_AUTH_LINE + 1]), AsciiAuth::Close);
    }

    #[test]
    fn sasl_plain_messages() {
        assert_eq!(sasl_plain(b"\0foo\0bar"), Some((&b"foo"[..], &b"bar"[..])));
        assert_eq!(sasl_plain(b"admin\0foo\0bar"), Some((&b"foo"[..], &b"bar"[..])));
        assert_eq!(sasl_plain(b"\0foo\0"), Some((&b"foo"[..], &b""[..])));
        assert_eq!(sasl_plain(b"foo\0bar"), None);
        assert_eq!(sasl_plain(b"\0\0bar"), None);
        assert_eq!(sasl_plain(b""), None);
    }
}
