//! Retrieval lines longer than `max_line`: parsed in pieces as their bytes
//! arrive (`parse_stream`), with the same result however the bytes are split
//! into reads, and never more than about `max_line` bytes buffered.

use mbal_proto::text::{Line, LineState, TextCmd};
use mbal_proto::{parse_stream, ErrReply, Limits, Parsed, Protocol, Request, MAX_KEY_LEN};
use proptest::prelude::*;

/// What a server would do with the stream, one entry per reply element.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ev {
    Key(Vec<u8>),
    End,
    Err(String),
    Other,
}

/// Feed `chunks` one after the other into a connection buffer, parsing as
/// much as possible after each (like the worker's read loop). Checks the
/// memory bound: the parser never waits with a full piece's worth buffered
/// inside a long line, nor with a too long line outside one.
fn run(chunks: &[&[u8]], limits: &Limits) -> Vec<Ev> {
    let bound = limits.max_line.max(2 * (MAX_KEY_LEN + 2));
    let mut state = LineState::Start;
    let mut buf: Vec<u8> = Vec::new();
    let mut evs = Vec::new();
    let mut closed = false;
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        let mut pos = 0;
        while pos < buf.len() && !closed {
            let before = state;
            match parse_stream(&mut state, Protocol::Text, &buf[pos..], limits) {
                Parsed::NeedMore => {
                    assert!(buf.len() - pos < bound, "waits with {} bytes buffered ({before:?})", buf.len() - pos);
                    break;
                }
                Parsed::Err { reply, skip, close } => {
                    assert!(skip > 0);
                    match reply {
                        ErrReply::Text(t) => evs.push(Ev::Err(t.to_string())),
                        ErrReply::Silent => {}
                        other => panic!("{other:?}"),
                    }
                    assert!(skip <= buf.len() - pos, "no data block to swallow here");
                    pos += skip;
                    closed = close;
                }
                Parsed::Req { req, consumed } => {
                    assert!(consumed > 0 && consumed <= buf.len() - pos);
                    match req {
                        Request::Text(TextCmd::Get { keys, line, .. }) => {
                            evs.extend(keys.iter().map(|k| Ev::Key(k.to_vec())));
                            if line != Line::Part {
                                evs.push(Ev::End);
                            }
                            assert_eq!(line == Line::Part, matches!(state, LineState::Keys { .. }));
                        }
                        _ => evs.push(Ev::Other),
                    }
                    pos += consumed;
                }
            }
        }
        buf.drain(..pos);
    }
    evs
}

fn keys_line(cmd: &str, keys: &[Vec<u8>], sep: &[u8], end: &[u8]) -> Vec<u8> {
    let mut l = cmd.as_bytes().to_vec();
    for k in keys {
        l.extend_from_slice(sep);
        l.extend_from_slice(k);
    }
    l.extend_from_slice(end);
    l
}

fn expect(keys: &[Vec<u8>]) -> Vec<Ev> {
    let mut e: Vec<Ev> = keys.iter().map(|k| Ev::Key(k.clone())).collect();
    e.push(Ev::End);
    e
}

fn many_keys(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("key:{i}").into_bytes()).collect()
}

const FORMAT: &str = "CLIENT_ERROR bad command line format";

#[test]
fn twenty_thousand_keys_in_one_line_and_one_read() {
    let limits = Limits::default();
    let keys = many_keys(20_000);
    let line = keys_line("get", &keys, b" ", b"\r\n");
    assert!(line.len() > 2 * limits.max_line);
    let mut stream = line.clone();
    stream.extend_from_slice(b"get after\r\n");
    let mut want = expect(&keys);
    want.extend(expect(&[b"after".to_vec()]));
    assert_eq!(run(&[&stream], &limits), want);
    // Other commands keep the limit.
    let long_set = [b"set k 0 0 1 ".as_slice(), &vec![b'x'; limits.max_line], b"\r\n"].concat();
    assert_eq!(run(&[&long_set], &limits), [Ev::Err("CLIENT_ERROR line too long".into())]);
}

#[test]
fn every_split_point_gives_the_same_pieces() {
    // max_line small so the line has several pieces; keys of every length
    // class, runs of spaces, both line ends.
    let limits = Limits { max_line: 64, ..Limits::default() };
    let mut keys = many_keys(150);
    keys.insert(7, vec![b'k'; MAX_KEY_LEN]);
    keys.insert(90, vec![b'z'; MAX_KEY_LEN - 1]);
    for (cmd, sep, end) in [("get", &b" "[..], &b"\r\n"[..]), ("gets", b"   ", b"\n"), ("gat 100", b" ", b"  \r\n")] {
        let mut stream = keys_line(cmd, &keys, sep, end);
        stream.extend_from_slice(b"mn\r\n");
        let mut want = expect(&keys);
        want.push(Ev::Other);
        assert_eq!(run(&[&stream], &limits), want, "{cmd} in one read");
        for cut in 1..stream.len() {
            let (a, b) = stream.split_at(cut);
            assert_eq!(run(&[a, b], &limits), want, "{cmd} split at {cut}");
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(run(&bytes, &limits), want, "{cmd} byte by byte");
    }
}

#[test]
fn a_bad_key_ends_the_line_with_an_error_and_the_stream_goes_on() {
    let limits = Limits { max_line: 64, ..Limits::default() };
    let keys = many_keys(300);
    for bad in [vec![b'k'; MAX_KEY_LEN + 1], vec![b'k'; 5000], b"a\x01b".to_vec()] {
        let mut with_bad = keys.clone();
        with_bad.insert(200, bad.clone());
        let mut stream = keys_line("get", &with_bad, b" ", b"\r\n");
        stream.extend_from_slice(b"get next\r\n");
        let one = run(&[&stream], &limits);
        // Keys of pieces before the bad one are answered, then the error
        // stands for END, the rest of the line is dropped, the next request
        // is served.
        let err = one.iter().position(|e| *e == Ev::Err(FORMAT.into())).expect("an error");
        assert!(err <= 200);
        assert_eq!(one[..err], expect(&keys)[..err]);
        assert_eq!(one[err + 1..], expect(&[b"next".to_vec()]));
        for cut in (1..stream.len()).step_by(37) {
            let (a, b) = stream.split_at(cut);
            assert_eq!(run(&[a, b], &limits), one, "split at {cut}, bad key of {} bytes", bad.len());
        }
    }
}

#[test]
fn edge_cases_of_long_lines() {
    let limits = Limits { max_line: 64, ..Limits::default() };
    let spaces = vec![b' '; 3000];
    // No key at all: ERROR for get, END for gat (as for short lines).
    let get = [b"get".as_slice(), &spaces, b"\r\nmn\r\n"].concat();
    assert_eq!(run(&[&get], &limits), [Ev::Err("ERROR".into()), Ev::Other]);
    let gat = [b"gat 1".as_slice(), &spaces, b"\r\nmn\r\n"].concat();
    assert_eq!(run(&[&gat], &limits), [Ev::End, Ev::Other]);
    // A bad exptime in a long gat.
    let gat = [b"gat x".as_slice(), &spaces, b"k\r\nmn\r\n"].concat();
    assert_eq!(run(&[&gat], &limits), [Ev::Err("CLIENT_ERROR invalid exptime argument".into()), Ev::Other]);
    // Not a retrieval command: the line limit stands, and it closes.
    let other = [b"delete".as_slice(), &spaces, b"k\r\nmn\r\n"].concat();
    assert_eq!(run(&[&other], &limits), [Ev::Err("CLIENT_ERROR line too long".into())]);
    // A short line is one whole request, as before.
    match parse_stream(&mut LineState::Start, Protocol::Text, b"get a b\r\n", &limits) {
        Parsed::Req { req: Request::Text(TextCmd::Get { line: Line::Whole, keys, .. }), consumed: 9 } => {
            assert_eq!(keys.len(), 2)
        }
        other => panic!("{other:?}"),
    }
}

fn key_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![prop::collection::vec(b'a'..=b'z', 1..12), prop::collection::vec(b'!'..=b'~', 200..=MAX_KEY_LEN),]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn any_split_same_replies(
        keys in prop::collection::vec(key_strategy(), 1..400),
        seps in prop::collection::vec(1usize..4, 400),
        crlf in any::<bool>(),
        max_line in 16usize..2048,
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let limits = Limits { max_line, ..Limits::default() };
        let mut stream = b"gets".to_vec();
        for (k, n) in keys.iter().zip(&seps) {
            stream.extend(std::iter::repeat_n(b' ', *n));
            stream.extend_from_slice(k);
        }
        stream.extend_from_slice(if crlf { b"\r\n" } else { b"\n" });
        stream.extend_from_slice(b"get tail\r\n");
        let mut want = expect(&keys);
        want.extend(expect(&[b"tail".to_vec()]));
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(stream.len())).collect();
        at.sort_unstable();
        at.dedup();
        let mut chunks = Vec::new();
        let mut prev = 0;
        for c in at {
            chunks.push(&stream[prev..c]);
            prev = c;
        }
        chunks.push(&stream[prev..]);
        prop_assert_eq!(run(&chunks, &limits), want);
    }
}
