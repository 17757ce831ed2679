// Shared by the fuzz targets: parse everything in `buf` like a server would
// and check the parser's contract.
use mbal_proto::text::{Line, LineState, TextCmd};
use mbal_proto::{meta, parse, parse_stream, Limits, Parsed, Protocol, Request, MAX_KEY_LEN};

pub fn drive(proto: Protocol, data: &[u8]) {
    // Small limits so size paths are reachable; first byte picks max_line.
    let (limits, buf) = match data.split_first() {
        Some((&b, rest)) => (Limits { max_item_size: 64 + b as usize, max_line: 16 + 4 * b as usize }, rest),
        None => (Limits::default(), data),
    };
    // A long get line is parsed in pieces of up to this many bytes.
    let piece = limits.max_line.max(2 * (MAX_KEY_LEN + 2));
    let mut off = 0usize;
    let mut out = Vec::new();
    let mut steps = 0;
    let mut state = LineState::Start;
    while off < buf.len() && steps < 10_000 {
        steps += 1;
        let cur = &buf[off..];
        match parse_stream(&mut state, proto, cur, &limits) {
            Parsed::NeedMore => {
                if proto == Protocol::Text {
                    // Bounded buffering: waiting is only for a command line
                    // shorter than max_line (a piece of a long get line), or
                    // for the data block of one (at most max_item_size + 2
                    // more bytes).
                    match cur.iter().position(|&b| b == b'\n') {
                        None => assert!(cur.len() < piece, "NeedMore with a too long line"),
                        Some(nl) => {
                            assert!(nl < piece, "NeedMore after a too long line");
                            assert!(cur.len() < limits.max_line + limits.max_item_size + 2, "NeedMore past one item");
                        }
                    }
                }
                // Text: a prefix never disagrees with the full buffer.
                break;
            }
            Parsed::Err { reply, skip, close } => {
                assert!(skip > 0);
                reply.write(&mut out);
                if close {
                    break;
                }
                off = off.saturating_add(skip);
            }
            Parsed::Req { req, consumed } => {
                assert!(consumed > 0 && consumed <= cur.len());
                match req {
                    Request::Meta(cmd) => {
                        let mut scratch = [0u8; 256];
                        if let Ok(k) = meta::meta_key(&cmd, &mut scratch) {
                            assert!(k.len() <= 256);
                        }
                        for (f, _) in cmd.flags.iter() {
                            assert!(cmd.flags.has(f));
                            let _ = cmd.flags.num::<u64>(f);
                        }
                        let mut w = meta::MetaReply::begin(&mut out, b"HD");
                        w.flag_bytes(b'k', cmd.key);
                        w.finish(Some(cmd.data));
                    }
                    Request::Bin(b) => {
                        let _ = (b.store_extras(), b.arith_extras(), b.exptime_extra(), b.flush_delay(), b.is_quiet());
                        assert_eq!(
                            24 + b.extras.len() + b.key.len() + b.value.len(),
                            consumed
                        );
                    }
                    Request::Text(cmd) => {
                        if let TextCmd::Get { keys, line, .. } = cmd {
                            assert_eq!(keys.iter().count(), keys.len());
                            // Only a piece that more keys follow leaves the line open.
                            assert_eq!(line == Line::Part, matches!(state, LineState::Keys { .. }));
                        }
                    }
                }
                off += consumed;
            }
        }
        out.clear();
    }
    // Incremental property for the first request: every prefix is NeedMore,
    // the same error, or (if a complete request fits) the same request.
    if proto == Protocol::Text && buf.len() <= 512 {
        let full = parse(proto, buf, &limits);
        for i in 0..buf.len() {
            match parse(proto, &buf[..i], &limits) {
                Parsed::NeedMore => {}
                pre => assert_eq!(pre, full, "prefix {i}"),
            }
        }
    }
}
