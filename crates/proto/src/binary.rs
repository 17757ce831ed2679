//! The memcached binary protocol: 24-byte header (magic 0x80 for requests,
//! 0x81 for responses, big-endian fields) followed by extras, key and value.
//!
//! The parser validates, per opcode, what memcached validates (extras length,
//! key required/forbidden, value forbidden) and refuses oversized bodies from
//! the header alone, so it never waits for or buffers a body it will reject.

use crate::reply::ErrReply;
use crate::{Limits, Parsed, Request, MAX_KEY_LEN};

pub use crate::reply::{status_message, write_response};

/// Request magic byte.
pub const MAGIC_REQUEST: u8 = 0x80;
/// Response magic byte.
pub const MAGIC_RESPONSE: u8 = 0x81;
/// Header length.
pub const HEADER_LEN: usize = 24;
/// Slack allowed over `max_item_size` for the key and extras of a body.
pub const BODY_SLACK: usize = MAX_KEY_LEN + 64;

/// Binary opcodes.
pub mod opcode {
    pub const GET: u8 = 0x00;
    pub const SET: u8 = 0x01;
    pub const ADD: u8 = 0x02;
    pub const REPLACE: u8 = 0x03;
    pub const DELETE: u8 = 0x04;
    pub const INCREMENT: u8 = 0x05;
    pub const DECREMENT: u8 = 0x06;
    pub const QUIT: u8 = 0x07;
    pub const FLUSH: u8 = 0x08;
    pub const GETQ: u8 = 0x09;
    pub const NOOP: u8 = 0x0a;
    pub const VERSION: u8 = 0x0b;
    pub const GETK: u8 = 0x0c;
    pub const GETKQ: u8 = 0x0d;
    pub const APPEND: u8 = 0x0e;
    pub const PREPEND: u8 = 0x0f;
    pub const STAT: u8 = 0x10;
    pub const SETQ: u8 = 0x11;
    pub const ADDQ: u8 = 0x12;
    pub const REPLACEQ: u8 = 0x13;
    pub const DELETEQ: u8 = 0x14;
    pub const INCREMENTQ: u8 = 0x15;
    pub const DECREMENTQ: u8 = 0x16;
    pub const QUITQ: u8 = 0x17;
    pub const FLUSHQ: u8 = 0x18;
    pub const APPENDQ: u8 = 0x19;
    pub const PREPENDQ: u8 = 0x1a;
    pub const VERBOSITY: u8 = 0x1b;
    pub const TOUCH: u8 = 0x1c;
    pub const GAT: u8 = 0x1d;
    pub const GATQ: u8 = 0x1e;
    pub const GATK: u8 = 0x23;
    pub const GATKQ: u8 = 0x24;
    pub const SASL_LIST_MECHS: u8 = 0x20;
    pub const SASL_AUTH: u8 = 0x21;
    pub const SASL_STEP: u8 = 0x22;
}

/// Binary response status codes.
pub mod status {
    pub const NO_ERROR: u16 = 0x00;
    pub const KEY_ENOENT: u16 = 0x01;
    pub const KEY_EEXISTS: u16 = 0x02;
    pub const E2BIG: u16 = 0x03;
    pub const EINVAL: u16 = 0x04;
    pub const NOT_STORED: u16 = 0x05;
    pub const DELTA_BADVAL: u16 = 0x06;
    /// Authentication required, or failed (SASL).
    pub const AUTH_ERROR: u16 = 0x20;
    /// SASL: send the next step.
    pub const AUTH_CONTINUE: u16 = 0x21;
    pub const UNKNOWN_COMMAND: u16 = 0x81;
    pub const ENOMEM: u16 = 0x82;
}

use opcode as op;

/// A decoded request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BinHeader {
    pub magic: u8,
    pub opcode: u8,
    pub key_len: u16,
    pub extras_len: u8,
    pub data_type: u8,
    /// Kept for routing (the request's vbucket id field).
    pub vbucket: u16,
    pub body_len: u32,
    pub opaque: u32,
    pub cas: u64,
}

impl BinHeader {
    /// Decode the first 24 bytes of `b` (no validation). Panics if `b.len() < 24`.
    pub fn decode(b: &[u8]) -> BinHeader {
        let u16_at = |i: usize| u16::from_be_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        BinHeader {
            magic: b[0],
            opcode: b[1],
            key_len: u16_at(2),
            extras_len: b[4],
            data_type: b[5],
            vbucket: u16_at(6),
            body_len: u32_at(8),
            opaque: u32_at(12),
            cas: u64::from_be_bytes(b[16..24].try_into().expect("8 bytes")),
        }
    }

    /// Encode as a request header (used by clients and tests).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.magic);
        out.push(self.opcode);
        out.extend_from_slice(&self.key_len.to_be_bytes());
        out.push(self.extras_len);
        out.push(self.data_type);
        out.extend_from_slice(&self.vbucket.to_be_bytes());
        out.extend_from_slice(&self.body_len.to_be_bytes());
        out.extend_from_slice(&self.opaque.to_be_bytes());
        out.extend_from_slice(&self.cas.to_be_bytes());
    }

    fn value_len(&self) -> usize {
        self.body_len as usize - self.key_len as usize - self.extras_len as usize
    }
}

/// One binary request; slices borrow the input buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BinReq<'a> {
    pub header: BinHeader,
    pub extras: &'a [u8],
    pub key: &'a [u8],
    pub value: &'a [u8],
}

/// Append a complete request (used by clients, the proxy and tests).
#[allow(clippy::too_many_arguments)]
pub fn write_request(
    out: &mut Vec<u8>,
    opcode: u8,
    vbucket: u16,
    opaque: u32,
    cas: u64,
    extras: &[u8],
    key: &[u8],
    value: &[u8],
) {
    let h = BinHeader {
        magic: MAGIC_REQUEST,
        opcode,
        key_len: key.len() as u16,
        extras_len: extras.len() as u8,
        data_type: 0,
        vbucket,
        body_len: (extras.len() + key.len() + value.len()) as u32,
        opaque,
        cas,
    };
    h.encode(out);
    out.extend_from_slice(extras);
    out.extend_from_slice(key);
    out.extend_from_slice(value);
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

impl<'a> BinReq<'a> {
    fn einval(&self) -> ErrReply {
        ErrReply::Bin { opcode: self.header.opcode, status: status::EINVAL, opaque: self.header.opaque }
    }
    /// set/add/replace extras: (flags, exptime).
    pub fn store_extras(&self) -> Result<(u32, u32), ErrReply> {
        match self.extras.len() {
            8 => Ok((be32(&self.extras[0..4]), be32(&self.extras[4..8]))),
            _ => Err(self.einval()),
        }
    }
    /// incr/decr extras: (delta, initial, exptime).
    pub fn arith_extras(&self) -> Result<(u64, u64, u32), ErrReply> {
        match self.extras.len() {
            20 => Ok((be64(&self.extras[0..8]), be64(&self.extras[8..16]), be32(&self.extras[16..20]))),
            _ => Err(self.einval()),
        }
    }
    /// touch/gat extras: exptime.
    pub fn exptime_extra(&self) -> Result<u32, ErrReply> {
        match self.extras.len() {
            4 => Ok(be32(self.extras)),
            _ => Err(self.einval()),
        }
    }
    /// flush extras: optional 4-byte delay (0 when absent).
    pub fn flush_delay(&self) -> Result<u32, ErrReply> {
        match self.extras.len() {
            0 => Ok(0),
            4 => Ok(be32(self.extras)),
            _ => Err(self.einval()),
        }
    }
    /// A quiet opcode (no reply on success; GETQ/GETKQ/GATQ/GATKQ: none on miss).
    pub fn is_quiet(&self) -> bool {
        is_quiet(self.header.opcode)
    }
}

/// Is `opcode` a quiet variant?
pub fn is_quiet(opcode: u8) -> bool {
    matches!(
        opcode,
        op::GETQ
            | op::GETKQ
            | op::SETQ
            | op::ADDQ
            | op::REPLACEQ
            | op::DELETEQ
            | op::INCREMENTQ
            | op::DECREMENTQ
            | op::QUITQ
            | op::FLUSHQ
            | op::APPENDQ
            | op::PREPENDQ
            | op::GATQ
            | op::GATKQ
    )
}

enum Need {
    /// extras length must be one of these
    Extras(&'static [u8]),
}

/// Length rules per opcode: (allowed extras lengths, key: Some(true)=required,
/// Some(false)=forbidden, None=optional, value allowed). None = unknown opcode.
fn rules(opcode: u8) -> Option<(Need, Option<bool>, bool)> {
    use Need::Extras as E;
    Some(match opcode {
        op::GET | op::GETQ | op::GETK | op::GETKQ => (E(&[0]), Some(true), false),
        op::SET | op::SETQ | op::ADD | op::ADDQ | op::REPLACE | op::REPLACEQ => (E(&[8]), Some(true), true),
        op::APPEND | op::APPENDQ | op::PREPEND | op::PREPENDQ => (E(&[0]), Some(true), true),
        op::DELETE | op::DELETEQ => (E(&[0]), Some(true), false),
        op::INCREMENT | op::INCREMENTQ | op::DECREMENT | op::DECREMENTQ => (E(&[20]), Some(true), false),
        op::QUIT | op::QUITQ | op::NOOP | op::VERSION => (E(&[0]), Some(false), false),
        op::FLUSH | op::FLUSHQ => (E(&[0, 4]), Some(false), false),
        op::VERBOSITY => (E(&[4]), Some(false), false),
        op::STAT => (E(&[0]), None, false),
        op::TOUCH | op::GAT | op::GATQ | op::GATK | op::GATKQ => (E(&[4]), Some(true), false),
        // SASL: the key is the mechanism, the value the client's message.
        op::SASL_LIST_MECHS => (E(&[0]), Some(false), false),
        op::SASL_AUTH | op::SASL_STEP => (E(&[0]), Some(true), true),
        _ => return None,
    })
}

/// set/add/replace/append/prepend and their quiet forms.
pub fn is_store(opcode: u8) -> bool {
    matches!(
        opcode,
        op::SET
            | op::SETQ
            | op::ADD
            | op::ADDQ
            | op::REPLACE
            | op::REPLACEQ
            | op::APPEND
            | op::APPENDQ
            | op::PREPEND
            | op::PREPENDQ
    )
}

/// Parse one binary request from the front of `buf`.
pub fn parse<'a>(buf: &'a [u8], limits: &Limits) -> Parsed<'a> {
    if let Some(&m) = buf.first() {
        if m != MAGIC_REQUEST {
            // memcached drops the connection without a reply.
            return Parsed::Err { reply: ErrReply::Silent, skip: buf.len(), close: true };
        }
    }
    if buf.len() < HEADER_LEN {
        return Parsed::NeedMore;
    }
    let h = BinHeader::decode(buf);
    let body = h.body_len as usize;
    let total = HEADER_LEN + body;
    let err = |status: u16, skip: usize, close: bool| Parsed::Err {
        reply: ErrReply::Bin { opcode: h.opcode, status, opaque: h.opaque },
        skip,
        close,
    };
    if body > limits.max_item_size + BODY_SLACK {
        return err(status::E2BIG, total, true);
    }
    if h.extras_len as usize + h.key_len as usize > body || h.key_len as usize > MAX_KEY_LEN {
        return err(status::EINVAL, total, true);
    }
    let Some((Need::Extras(ext_ok), key_rule, value_ok)) = rules(h.opcode) else {
        return err(status::UNKNOWN_COMMAND, total, false);
    };
    let ok = ext_ok.contains(&h.extras_len)
        && match key_rule {
            Some(true) => h.key_len > 0,
            Some(false) => h.key_len == 0,
            None => true,
        }
        && (value_ok || h.value_len() == 0);
    if !ok {
        if h.opcode == op::VERBOSITY {
            return err(status::UNKNOWN_COMMAND, total, false);
        }
        return err(status::EINVAL, total, true);
    }
    if is_store(h.opcode) && h.value_len() > limits.max_item_size {
        return err(status::E2BIG, total, false);
    }
    if buf.len() < total {
        return Parsed::NeedMore;
    }
    let e_end = HEADER_LEN + h.extras_len as usize;
    let k_end = e_end + h.key_len as usize;
    let req = BinReq { header: h, extras: &buf[HEADER_LEN..e_end], key: &buf[e_end..k_end], value: &buf[k_end..total] };
    Parsed::Req { req: Request::Bin(req), consumed: total }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::Protocol::Binary as B;

    fn req(opcode: u8, extras: &[u8], key: &[u8], value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        write_request(&mut out, opcode, 7, 0x01020304, 99, extras, key, value);
        out
    }

    fn bin(buf: &[u8]) -> BinReq<'_> {
        match whole(B, buf) {
            Request::Bin(r) => r,
            other => panic!("{other:?}"),
        }
    }

    fn berr(buf: &[u8]) -> (u8, u16, u32, usize, bool) {
        match p(B, buf) {
            Parsed::Err { reply: ErrReply::Bin { opcode, status, opaque }, skip, close } => {
                (opcode, status, opaque, skip, close)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn sasl_requests() {
        let buf = req(opcode::SASL_LIST_MECHS, &[], b"", b"");
        assert_eq!(bin(&buf).header.opcode, opcode::SASL_LIST_MECHS);
        let buf = req(opcode::SASL_AUTH, &[], b"PLAIN", b"\0foo\0bar");
        let r = bin(&buf);
        assert_eq!((r.key, r.value), (&b"PLAIN"[..], &b"\0foo\0bar"[..]));
        assert_eq!(bin(&req(opcode::SASL_STEP, &[], b"PLAIN", b"x")).value, b"x");
        // The mechanism is required; LIST_MECHS takes no key.
        assert_eq!(berr(&req(opcode::SASL_AUTH, &[], b"", b"x")).1, status::EINVAL);
        assert_eq!(berr(&req(opcode::SASL_LIST_MECHS, &[], b"k", b"")).1, status::EINVAL);
    }

    #[test]
    fn header_roundtrip() {
        let h = BinHeader {
            magic: 0x80,
            opcode: 1,
            key_len: 3,
            extras_len: 8,
            data_type: 0,
            vbucket: 0xbeef,
            body_len: 16,
            opaque: 42,
            cas: u64::MAX - 1,
        };
        let mut out = Vec::new();
        h.encode(&mut out);
        assert_eq!(out.len(), 24);
        assert_eq!(BinHeader::decode(&out), h);
    }

    #[test]
    fn set_roundtrip_and_extras() {
        let mut ex = Vec::new();
        ex.extend_from_slice(&0xdeadbeefu32.to_be_bytes());
        ex.extend_from_slice(&300u32.to_be_bytes());
        let buf = req(opcode::SET, &ex, b"key", b"value");
        let r = bin(&buf);
        assert_eq!((r.key, r.value, r.extras), (&b"key"[..], &b"value"[..], &ex[..]));
        assert_eq!(r.header.vbucket, 7);
        assert_eq!(r.header.opaque, 0x01020304);
        assert_eq!(r.header.cas, 99);
        assert_eq!(r.store_extras(), Ok((0xdeadbeef, 300)));
        assert!(!r.is_quiet());
        assert_eq!(
            r.arith_extras(),
            Err(ErrReply::Bin { opcode: opcode::SET, status: status::EINVAL, opaque: 0x01020304 })
        );
        let buf = req(opcode::SETQ, &ex, b"k", b"");
        assert!(bin(&buf).is_quiet());
    }

    #[test]
    fn arith_touch_flush_extras() {
        let mut ex = Vec::new();
        ex.extend_from_slice(&5u64.to_be_bytes());
        ex.extend_from_slice(&10u64.to_be_bytes());
        ex.extend_from_slice(&0xffffffffu32.to_be_bytes());
        let buf = req(opcode::DECREMENTQ, &ex, b"c", b"");
        let r = bin(&buf);
        assert_eq!(r.arith_extras(), Ok((5, 10, 0xffffffff)));
        assert!(r.is_quiet());
        let buf = req(opcode::GAT, &9u32.to_be_bytes(), b"k", b"");
        assert_eq!(bin(&buf).exptime_extra(), Ok(9));
        let buf = req(opcode::FLUSH, &[], b"", b"");
        assert_eq!(bin(&buf).flush_delay(), Ok(0));
        let buf = req(opcode::FLUSHQ, &60u32.to_be_bytes(), b"", b"");
        let r = bin(&buf);
        assert_eq!((r.flush_delay(), r.is_quiet()), (Ok(60), true));
    }

    #[test]
    fn every_known_opcode_with_valid_lengths() {
        let cases: &[(u8, usize, &[u8], &[u8])] = &[
            (opcode::GET, 0, b"k", b""),
            (opcode::GETQ, 0, b"k", b""),
            (opcode::GETK, 0, b"k", b""),
            (opcode::GETKQ, 0, b"k", b""),
            (opcode::ADD, 8, b"k", b"v"),
            (opcode::REPLACEQ, 8, b"k", b""),
            (opcode::APPEND, 0, b"k", b"v"),
            (opcode::PREPENDQ, 0, b"k", b"v"),
            (opcode::DELETE, 0, b"k", b""),
            (opcode::INCREMENT, 20, b"k", b""),
            (opcode::QUIT, 0, b"", b""),
            (opcode::QUITQ, 0, b"", b""),
            (opcode::NOOP, 0, b"", b""),
            (opcode::VERSION, 0, b"", b""),
            (opcode::VERBOSITY, 4, b"", b""),
            (opcode::STAT, 0, b"", b""),
            (opcode::STAT, 0, b"items", b""),
            (opcode::TOUCH, 4, b"k", b""),
            (opcode::GATKQ, 4, b"k", b""),
        ];
        for &(op, el, k, v) in cases {
            let buf = req(op, &vec![0; el], k, v);
            let r = bin(&buf);
            assert_eq!(r.header.opcode, op);
            assert_eq!((r.extras.len(), r.key, r.value), (el, k, v));
        }
    }

    #[test]
    fn invalid_lengths_are_einval_and_close() {
        let bad: &[(u8, usize, &[u8], &[u8])] = &[
            (opcode::GET, 0, b"", b""),      // key required
            (opcode::GET, 0, b"k", b"v"),    // value forbidden
            (opcode::GET, 4, b"k", b""),     // extras forbidden
            (opcode::SET, 4, b"k", b"v"),    // extras must be 8
            (opcode::SET, 8, b"", b"v"),     // key required
            (opcode::DELETE, 0, b"k", b"v"), // value forbidden
            (opcode::INCREMENT, 8, b"k", b""),
            (opcode::NOOP, 0, b"k", b""),
            (opcode::VERSION, 0, b"", b"v"),
            (opcode::FLUSH, 8, b"", b""),
            (opcode::TOUCH, 0, b"k", b""),
            (opcode::STAT, 4, b"", b""),
        ];
        for &(op, el, k, v) in bad {
            let buf = req(op, &vec![0; el], k, v);
            assert_eq!(berr(&buf), (op, status::EINVAL, 0x01020304, buf.len(), true), "op {op:#x}");
            // decided from the header alone
            assert_eq!(berr(&buf[..24]).1, status::EINVAL);
        }
        // key longer than 250
        let buf = req(opcode::GET, &[], &[b'k'; 251], b"");
        assert_eq!(berr(&buf).1, status::EINVAL);
        // extras + key larger than body
        let mut buf = req(opcode::GET, &[], b"key", b"");
        buf[8..12].copy_from_slice(&2u32.to_be_bytes());
        assert_eq!(berr(&buf[..24]), (opcode::GET, status::EINVAL, 0x01020304, 26, true));
    }

    #[test]
    fn verbosity_bad_and_unknown_opcode_skip_without_close() {
        let buf = req(opcode::VERBOSITY, &[], b"", b"");
        assert_eq!(berr(&buf), (opcode::VERBOSITY, status::UNKNOWN_COMMAND, 0x01020304, 24, false));
        let buf = req(0x40, &[], b"a", b"xyz");
        assert_eq!(berr(&buf[..24]), (0x40, status::UNKNOWN_COMMAND, 0x01020304, 28, false));
        let mut out = Vec::new();
        ErrReply::Bin { opcode: 0x40, status: status::UNKNOWN_COMMAND, opaque: 5 }.write(&mut out);
        assert_eq!(&out[24..], b"Unknown command");
    }

    #[test]
    fn oversized_bodies() {
        let limits = Limits { max_item_size: 100, ..Limits::default() };
        // value just over max_item_size: E2BIG, skip the request, keep the connection
        let buf = req(opcode::SET, &[0; 8], b"k", &[0; 101]);
        assert_eq!(
            crate::parse(crate::Protocol::Binary, &buf[..24], &limits),
            Parsed::Err {
                reply: ErrReply::Bin { opcode: opcode::SET, status: status::E2BIG, opaque: 0x01020304 },
                skip: buf.len(),
                close: false
            }
        );
        let buf = req(opcode::SET, &[0; 8], b"k", &[0; 100]);
        assert!(matches!(crate::parse(crate::Protocol::Binary, &buf, &limits), Parsed::Req { .. }));
        // absurd body length: E2BIG and close, decided from the header
        let mut h = req(opcode::GET, &[], b"k", b"");
        h[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            crate::parse(crate::Protocol::Binary, &h[..24], &limits),
            Parsed::Err { reply: ErrReply::Bin { status: status::E2BIG, .. }, close: true, .. }
        ));
    }

    #[test]
    fn bad_magic_closes_silently() {
        let mut buf = req(opcode::NOOP, &[], b"", b"");
        buf[0] = 0x81;
        assert!(matches!(p(B, &buf), Parsed::Err { reply: ErrReply::Silent, close: true, .. }));
        assert!(matches!(p(B, b"g"), Parsed::Err { close: true, .. }));
        assert_eq!(p(B, b""), Parsed::NeedMore);
    }

    #[test]
    fn pipelined_quiet_gets_then_noop() {
        let mut buf = req(opcode::GETKQ, &[], b"a", b"");
        buf.extend(req(opcode::GETKQ, &[], b"bb", b""));
        buf.extend(req(opcode::NOOP, &[], b"", b""));
        let mut off = 0;
        let mut seen = Vec::new();
        while off < buf.len() {
            match p(B, &buf[off..]) {
                Parsed::Req { req: Request::Bin(r), consumed } => {
                    seen.push((r.header.opcode, r.key.to_vec()));
                    off += consumed;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(seen, [(opcode::GETKQ, b"a".to_vec()), (opcode::GETKQ, b"bb".to_vec()), (opcode::NOOP, vec![])]);
    }

    #[test]
    fn response_roundtrip_through_header_decode() {
        let mut out = Vec::new();
        write_response(&mut out, opcode::GETK, status::NO_ERROR, 77, 5, &1u32.to_be_bytes(), b"key", b"val");
        let h = BinHeader::decode(&out);
        assert_eq!(h.magic, MAGIC_RESPONSE);
        assert_eq!((h.opcode, h.key_len, h.extras_len, h.body_len, h.opaque, h.cas), (opcode::GETK, 3, 4, 10, 77, 5));
        assert_eq!(&out[24..], b"\x00\x00\x00\x01keyval");
    }
}
