//! Reply writers. Everything appends to a `&mut Vec<u8>`.
//!
//! The text writers are re-exported from [`crate::text`], the meta builder
//! from [`crate::meta`] and the binary writer from [`crate::binary`].

use base64::Engine as _;
use std::fmt::Display;
use std::io::Write as _;

/// An error reply produced by the parser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrReply {
    /// A text line without its `\r\n` (e.g. `ERROR`, `CLIENT_ERROR bad data chunk`).
    Text(&'static str),
    /// A binary error response; the body is the memcached message for `status`.
    Bin { opcode: u8, status: u16, opaque: u32 },
    /// Nothing is sent (memcached suppresses this error because of `noreply`).
    Silent,
}

impl ErrReply {
    /// Render the reply (nothing for [`ErrReply::Silent`]).
    pub fn write(&self, out: &mut Vec<u8>) {
        match *self {
            ErrReply::Text(line) => {
                out.extend_from_slice(line.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            ErrReply::Bin { opcode, status, opaque } => {
                write_response(out, opcode, status, opaque, 0, &[], &[], status_message(status))
            }
            ErrReply::Silent => {}
        }
    }

    /// Is this the refusal of a value larger than the item size limit (text or binary)?
    pub fn is_too_large(&self) -> bool {
        match *self {
            ErrReply::Text(t) => t == "SERVER_ERROR object too large for cache",
            ErrReply::Bin { status, .. } => status == 0x03,
            ErrReply::Silent => false,
        }
    }

    /// The text line, if this is a text error.
    pub fn text(&self) -> Option<&'static str> {
        match *self {
            ErrReply::Text(t) => Some(t),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------- text

pub const END: &[u8] = b"END\r\n";
pub const STORED: &[u8] = b"STORED\r\n";
pub const NOT_STORED: &[u8] = b"NOT_STORED\r\n";
pub const EXISTS: &[u8] = b"EXISTS\r\n";
pub const NOT_FOUND: &[u8] = b"NOT_FOUND\r\n";
pub const DELETED: &[u8] = b"DELETED\r\n";
pub const TOUCHED: &[u8] = b"TOUCHED\r\n";
pub const OK: &[u8] = b"OK\r\n";
pub const ERROR: &[u8] = b"ERROR\r\n";

/// `VALUE <key> <flags> <bytes> [<cas>]\r\n<data>\r\n`
pub fn write_value(out: &mut Vec<u8>, key: &[u8], flags: u32, data: &[u8], cas: Option<u64>) {
    let mut b = itoa::Buffer::new();
    out.reserve(key.len() + data.len() + 48);
    out.extend_from_slice(b"VALUE ");
    out.extend_from_slice(key);
    out.push(b' ');
    out.extend_from_slice(b.format(flags).as_bytes());
    out.push(b' ');
    out.extend_from_slice(b.format(data.len()).as_bytes());
    if let Some(c) = cas {
        out.push(b' ');
        out.extend_from_slice(b.format(c).as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// `<n>\r\n` (incr/decr result).
pub fn write_number(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// `STAT <name> <value>\r\n`
pub fn write_stat(out: &mut Vec<u8>, name: &str, value: impl Display) {
    let _ = write!(out, "STAT {name} {value}\r\n");
}

/// `VERSION <ver>\r\n`
pub fn write_version(out: &mut Vec<u8>, ver: &str) {
    out.extend_from_slice(b"VERSION ");
    out.extend_from_slice(ver.as_bytes());
    out.extend_from_slice(b"\r\n");
}

// ---------------------------------------------------------------- meta

/// Builder for one meta reply line (`VA`, `HD`, `EN`, `NS`, `EX`, `NF`, `MN`, `ME`).
///
/// ```
/// let mut out = Vec::new();
/// let mut w = mbal_proto::meta::MetaReply::begin(&mut out, b"VA");
/// w.value_len(5);
/// w.flag_num(b'c', 123);
/// w.flag_num(b'f', 0);
/// w.finish(Some(b"hello"));
/// assert_eq!(out, b"VA 5 c123 f0\r\nhello\r\n");
/// ```
pub struct MetaReply<'o> {
    out: &'o mut Vec<u8>,
}

impl<'o> MetaReply<'o> {
    /// Start a reply with a two-letter code.
    pub fn begin(out: &'o mut Vec<u8>, code: &[u8; 2]) -> Self {
        out.extend_from_slice(code);
        MetaReply { out }
    }
    /// The value length (VA only); call before any flag.
    pub fn value_len(&mut self, n: usize) {
        self.out.push(b' ');
        self.out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    }
    /// A bare flag, e.g. ` W`.
    pub fn flag(&mut self, f: u8) {
        self.out.push(b' ');
        self.out.push(f);
    }
    /// A flag with an unsigned number, e.g. ` c123`.
    pub fn flag_num(&mut self, f: u8, n: u64) {
        self.flag(f);
        self.out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    }
    /// A flag with a signed number, e.g. ` t-1`.
    pub fn flag_signed(&mut self, f: u8, n: i64) {
        self.flag(f);
        self.out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    }
    /// A flag with a raw token, e.g. ` kfoo` or ` Oopaque`.
    pub fn flag_bytes(&mut self, f: u8, tok: &[u8]) {
        self.flag(f);
        self.out.extend_from_slice(tok);
    }
    /// A flag whose token is `raw` base64-encoded (e.g. ` k` + key when the key was decoded from flag b).
    pub fn flag_b64(&mut self, f: u8, raw: &[u8]) {
        self.flag(f);
        write_b64(self.out, raw);
    }
    /// End the line; with `Some(value)` also write the data block.
    pub fn finish(self, value: Option<&[u8]>) {
        self.out.extend_from_slice(b"\r\n");
        if let Some(v) = value {
            self.out.extend_from_slice(v);
            self.out.extend_from_slice(b"\r\n");
        }
    }
}

/// Append `raw` base64-encoded (standard alphabet, padded), as meta flag `b` expects.
pub fn write_b64(out: &mut Vec<u8>, raw: &[u8]) {
    let start = out.len();
    let n = base64::encoded_len(raw.len(), true).unwrap_or(0);
    out.resize(start + n, 0);
    let w = base64::engine::general_purpose::STANDARD.encode_slice(raw, &mut out[start..]).unwrap_or(0);
    out.truncate(start + w);
}

// ---------------------------------------------------------------- binary

/// memcached's message body for a binary error status.
pub fn status_message(status: u16) -> &'static [u8] {
    match status {
        0x01 => b"Not found",
        0x02 => b"Data exists for key.",
        0x03 => b"Too large.",
        0x04 => b"Invalid arguments",
        0x05 => b"Not stored.",
        0x06 => b"Non-numeric server-side value for incr or decr",
        0x20 => b"Auth failure.",
        0x81 => b"Unknown command",
        0x82 => b"Out of memory",
        _ => b"",
    }
}

/// Append a binary response (magic 0x81, data type 0).
#[allow(clippy::too_many_arguments)]
pub fn write_response(
    out: &mut Vec<u8>,
    opcode: u8,
    status: u16,
    opaque: u32,
    cas: u64,
    extras: &[u8],
    key: &[u8],
    value: &[u8],
) {
    let body = extras.len() + key.len() + value.len();
    out.reserve(24 + body);
    out.push(crate::binary::MAGIC_RESPONSE);
    out.push(opcode);
    out.extend_from_slice(&(key.len() as u16).to_be_bytes());
    out.push(extras.len() as u8);
    out.push(0);
    out.extend_from_slice(&status.to_be_bytes());
    out.extend_from_slice(&(body as u32).to_be_bytes());
    out.extend_from_slice(&opaque.to_be_bytes());
    out.extend_from_slice(&cas.to_be_bytes());
    out.extend_from_slice(extras);
    out.extend_from_slice(key);
    out.extend_from_slice(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_with_and_without_cas() {
        let mut out = Vec::new();
        write_value(&mut out, b"k", 7, b"abc", None);
        write_value(&mut out, b"k", 0, b"", Some(42));
        assert_eq!(out, b"VALUE k 7 3\r\nabc\r\nVALUE k 0 0 42\r\n\r\n");
    }

    #[test]
    fn value_blocks_match_their_format_and_append() {
        let mut out = b"before".to_vec();
        let mut want = b"before".to_vec();
        for (key, flags, data, cas) in [
            (&b"key"[..], 0u32, &b"x"[..], None),
            (b"k", u32::MAX, b"0123456789", Some(u64::MAX)),
            (b"a-longer-key", 10, &[b'v'; 300][..], Some(0)),
        ] {
            write_value(&mut out, key, flags, data, cas);
            want.extend_from_slice(format!("VALUE {} {flags} {}", String::from_utf8_lossy(key), data.len()).as_bytes());
            if let Some(c) = cas {
                want.extend_from_slice(format!(" {c}").as_bytes());
            }
            want.extend_from_slice(b"\r\n");
            want.extend_from_slice(data);
            want.extend_from_slice(b"\r\n");
        }
        assert_eq!(out, want);
    }

    #[test]
    fn number_stat_version() {
        let mut out = Vec::new();
        write_number(&mut out, 18446744073709551615);
        write_stat(&mut out, "pid", 12);
        write_version(&mut out, "1.6.18");
        assert_eq!(out, b"18446744073709551615\r\nSTAT pid 12\r\nVERSION 1.6.18\r\n");
    }

    #[test]
    fn meta_builder() {
        let mut out = Vec::new();
        let mut w = MetaReply::begin(&mut out, b"HD");
        w.flag(b'W');
        w.flag_signed(b't', -1);
        w.flag_bytes(b'O', b"op");
        w.flag_b64(b'k', b"a");
        w.finish(None);
        MetaReply::begin(&mut out, b"EN").finish(None);
        assert_eq!(out, b"HD W t-1 Oop kYQ==\r\nEN\r\n");
    }

    #[test]
    fn b64_roundtrip_bytes() {
        let mut out = b"x".to_vec();
        write_b64(&mut out, b"\x00\xffhello");
        assert_eq!(out, b"xAP9oZWxsbw==");
    }

    #[test]
    fn binary_response_layout() {
        let mut out = Vec::new();
        write_response(&mut out, 0x00, 0, 0xdeadbeef, 9, &[0, 0, 0, 1], b"k", b"vv");
        assert_eq!(out.len(), 24 + 7);
        assert_eq!(out[0], 0x81);
        assert_eq!(&out[2..4], &[0, 1]);
        assert_eq!(out[4], 4);
        assert_eq!(&out[8..12], &7u32.to_be_bytes());
        assert_eq!(&out[12..16], &0xdeadbeefu32.to_be_bytes());
        assert_eq!(&out[16..24], &9u64.to_be_bytes());
        assert_eq!(&out[24..], b"\x00\x00\x00\x01kvv");
    }

    #[test]
    fn err_reply_rendering() {
        let mut out = Vec::new();
        ErrReply::Text("ERROR").write(&mut out);
        ErrReply::Silent.write(&mut out);
        assert_eq!(out, b"ERROR\r\n");
        out.clear();
        ErrReply::Bin { opcode: 0x40, status: 0x81, opaque: 1 }.write(&mut out);
        assert_eq!(&out[24..], b"Unknown command");
        assert_eq!(out[1], 0x40);
        assert_eq!(&out[6..8], &[0, 0x81]);
    }
}
