//! Tests of the client-side reply codec: the owned [`ReplyReader`] (ported
//! from the routing client's parser), the hit-counting path (ported from the
//! bench's parser) and the decoder's incremental contract.

use super::*;
use proptest::prelude::*;

fn parse_all(bytes: &[u8], expects: &[Expect]) -> Vec<Reply> {
    let mut p = ReplyReader::new();
    p.feed(bytes);
    let out: Vec<Reply> = expects.iter().map(|&e| p.next(e).unwrap().expect("complete")).collect();
    assert_eq!(p.buffered(), 0, "everything consumed");
    out
}

/// Feed one byte at a time: no reply may appear before its last byte.
fn parse_bytewise(bytes: &[u8], expects: &[Expect]) -> Vec<Reply> {
    let mut p = ReplyReader::new();
    let mut out = Vec::new();
    let mut i = 0;
    for b in bytes {
        p.feed(std::slice::from_ref(b));
        while i < expects.len() {
            match p.next(expects[i]).unwrap() {
                Some(r) => {
                    out.push(r);
                    i += 1;
                }
                None => break,
            }
        }
    }
    assert_eq!(out.len(), expects.len());
    out
}

fn v(key: &str, flags: u32, data: &[u8], cas: Option<u64>) -> OwnedValue {
    OwnedValue { key: key.into(), flags, data: data.to_vec(), cas }
}

#[test]
fn every_reply_kind() {
    let stream = b"STORED\r\nNOT_STORED\r\nEXISTS\r\nNOT_FOUND\r\nDELETED\r\nTOUCHED\r\nOK\r\n42\r\n\
18446744073709551615\r\nRD 7 2 1\r\nMBAL 1 3 9 4\r\nMOVED 12\r\nMAP 5 7\r\n{\"a\":1}\r\nERROR\r\n\
CLIENT_ERROR bad command line format\r\nSERVER_ERROR out of memory\r\nEND\r\n\
VALUE k 5 3\r\nabc\r\nVALUE k2 0 0 99\r\n\r\nEND\r\nSTAT pid 12\r\nSTAT version 1.6 x\r\nEND\r\nEND\r\n\
VALUE k 0 2\r\nhi\r\nVALUE j 0 1\r\nx\r\nEND\r\n";
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
        Reply::Hello { server: 1, worker: 3, epoch: 9, threads: 4 },
        Reply::Moved { epoch: 12 },
        Reply::Map { epoch: 5, json: b"{\"a\":1}".to_vec() },
        Reply::Error("ERROR".into()),
        Reply::Error("CLIENT_ERROR bad command line format".into()),
        Reply::Error("SERVER_ERROR out of memory".into()),
        Reply::Values(vec![]),
        Reply::Values(vec![v("k", 5, b"abc", None), v("k2", 0, b"", Some(99))]),
        Reply::Stats(vec![("pid".into(), "12".into()), ("version".into(), "1.6 x".into())]),
        Reply::Stats(vec![]),
        Reply::Hits(2),
    ];
    let mut ex = vec![Expect::Line; 16];
    ex.extend([Expect::Values, Expect::Values, Expect::Stats, Expect::Stats, Expect::Hits]);
    assert_eq!(parse_all(stream, &ex), want);
    assert_eq!(parse_bytewise(stream, &ex), want);
}

#[test]
fn value_data_may_contain_crlf_and_value_words() {
    let stream = b"VALUE a 1 12\r\nEND\r\nVALUE b\r\nEND\r\n";
    assert_eq!(
        parse_bytewise(stream, &[Expect::Values]),
        vec![Reply::Values(vec![v("a", 1, b"END\r\nVALUE b", None)])]
    );
    assert_eq!(parse_bytewise(stream, &[Expect::Hits]), vec![Reply::Hits(1)]);
}

#[test]
fn incomplete_reply_is_not_consumed() {
    let mut p = ReplyReader::new();
    p.feed(b"VALUE a 0 5\r\nhel");
    assert_eq!(p.next(Expect::Values).unwrap(), None);
    p.feed(b"lo\r\nVALUE b 0 1\r\nx\r\n");
    assert_eq!(p.next(Expect::Values).unwrap(), None, "END not yet seen");
    assert!(p.mid_reply());
    p.feed(b"END\r\nSTO");
    assert_eq!(
        p.next(Expect::Values).unwrap(),
        Some(Reply::Values(vec![v("a", 0, b"hello", None), v("b", 0, b"x", None)]))
    );
    assert!(!p.mid_reply());
    assert_eq!(p.next(Expect::Line).unwrap(), None);
    p.feed(b"RED\r\n");
    assert_eq!(p.next(Expect::Line).unwrap(), Some(Reply::Stored));
    assert_eq!(p.next(Expect::Line).unwrap(), None);
}

#[test]
fn map_waits_for_its_body() {
    let mut p = ReplyReader::new();
    p.feed(b"MAP 3 4\r\nab");
    assert_eq!(p.next(Expect::Line).unwrap(), None);
    p.feed(b"cd\r\n");
    assert_eq!(p.next(Expect::Line).unwrap(), Some(Reply::Map { epoch: 3, json: b"abcd".to_vec() }));
}

#[test]
fn error_inside_values_ends_the_reply() {
    let r = parse_all(b"VALUE a 0 1\r\nx\r\nSERVER_ERROR out of memory\r\nSTORED\r\n", &[Expect::Values, Expect::Line]);
    assert_eq!(r, vec![Reply::Error("SERVER_ERROR out of memory".into()), Reply::Stored]);
    let r = parse_all(b"VALUE a 0 1\r\nx\r\nSERVER_ERROR out of memory\r\nEND\r\n", &[Expect::Hits, Expect::Hits]);
    assert_eq!(r, vec![Reply::Error("SERVER_ERROR out of memory".into()), Reply::Hits(0)]);
}

#[test]
fn malformed_streams_are_errors() {
    let bad: &[(&[u8], Expect)] = &[
        (b"VALUE a x 1\r\nx\r\nEND\r\n", Expect::Values),
        (b"VALUE a 0 1\r\nxy\r\nEND\r\n", Expect::Values),
        (b"VALUE a 0 1\r\nxy\r\nEND\r\n", Expect::Hits),
        (b"VALUE a 0 1 2 3\r\nx\r\nEND\r\n", Expect::Values),
        (b"VALUE a 0 1 z\r\nx\r\nEND\r\n", Expect::Values),
        (b"VALUE  \r\n", Expect::Values),
        (b"VALUE a 0 1\r\nx\r\n", Expect::Line),
        (b"VALUE k 0 x\r\n", Expect::Hits),
        (b"VALUE a 0\r\nx\r\nEND\r\n", Expect::Values),
        (b"VALUE a 4294967296 1\r\nx\r\nEND\r\n", Expect::Values),
        (b"VALUE a -1 1\r\nx\r\nEND\r\n", Expect::Values),
        (b"END\r\n", Expect::Line),
        (b"STAT a b\r\n", Expect::Values),
        (b"HELLO\r\n", Expect::Line),
        (b"HELLO\r\n", Expect::Hits),
        (b"STORED extra\r\n", Expect::Line),
        (b"RD 1 2\r\n", Expect::Line),
        (b"RD x 1 2\r\n", Expect::Hits),
        (b"RD 1 2 3 4\r\n", Expect::Line),
        (b"RD 1 70000 0\r\n", Expect::Line),
        (b"MBAL x 0 1\r\n", Expect::Line),
        (b"MOVED\r\n", Expect::Line),
        (b"MAP 1\r\n", Expect::Line),
        (b"99999999999999999999999\r\n", Expect::Line),
        (b"VALUE a 0 1\r\nx\r\nSTORED\r\n", Expect::Values),
        (b"VALUE a 0 1\r\nx\r\nRD 1 0 0\r\n", Expect::Hits),
        (b"MAP 1 2\r\nabcd", Expect::Line),
    ];
    for (bytes, e) in bad {
        let mut p = ReplyReader::new();
        p.feed(bytes);
        assert!(p.next(*e).is_err(), "{:?} must be refused ({e:?})", String::from_utf8_lossy(bytes));
    }
    for e in [Expect::Line, Expect::Values, Expect::Hits] {
        let mut p = ReplyReader::new();
        p.feed(&vec![b'x'; MAX_LINE + 1]);
        assert!(p.next(e).is_err(), "endless line");
    }
}

#[test]
fn value_lines_take_runs_of_spaces_as_one() {
    let got = parse_all(b"VALUE  a   4294967295  1  7 \r\nx\r\nVALUE b 0 0\r\n\r\nEND\r\n", &[Expect::Values]);
    assert_eq!(got, vec![Reply::Values(vec![v("a", u32::MAX, b"x", Some(7)), v("b", 0, b"", None)])]);
}

#[test]
fn bare_lf_is_accepted() {
    assert_eq!(parse_all(b"STORED\n", &[Expect::Line]), vec![Reply::Stored]);
}

#[test]
fn long_pipeline_is_compacted() {
    let mut p = ReplyReader::new();
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
    let mut p = ReplyReader::new();
    assert_eq!(p.read_from(&mut r).unwrap(), data.len());
    assert_eq!(p.next(Expect::Line).unwrap(), Some(Reply::Deleted));
    assert_eq!(p.next(Expect::Values).unwrap(), Some(Reply::Values(vec![v("a", 0, b"hi", None)])));
    assert_eq!(p.read_from(&mut r).unwrap(), 0, "EOF");
}

/// Drive a [`Decoder`] over `input` fed in chunks of `chunk` bytes into a
/// buffer the caller trims, as the bench does; collect the complete replies
/// (as owned frames) for each expected reply in turn.
fn decode_chunked(input: &[u8], expects: &[Expect], chunk: usize) -> Result<Vec<String>, ReplyError> {
    let mut d = Decoder::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut out = Vec::new();
    let mut fed = 0;
    let mut ei = 0;
    while ei < expects.len() {
        let (n, f) = d.decode(&buf, expects[ei])?;
        assert!(n <= buf.len());
        let f = f.map(|f| (format!("{f:?}"), f.ends_reply()));
        buf.drain(..n);
        match f {
            Some((f, end)) => {
                out.push(f);
                if end {
                    ei += 1;
                }
            }
            None => {
                if fed == input.len() {
                    out.push("<need more>".into());
                    break;
                }
                let end = (fed + chunk).min(input.len());
                buf.extend_from_slice(&input[fed..end]);
                fed = end;
            }
        }
    }
    Ok(out)
}

#[test]
fn hits_skip_values_at_any_split() {
    let input = b"VALUE k1 0 5\r\nhello\r\nVALUE k2 3 0 99\r\n\r\nEND\r\nSTORED\r\nEND\r\nNOT_STORED\r\n\
SERVER_ERROR out of memory\r\nCLIENT_ERROR bad\r\nVALUE k 0 3\r\nEND\r\nEND\r\nEXISTS\r\nNOT_FOUND\r\nRD 7 2 1\r\n";
    let ex = [
        Expect::Hits,
        Expect::Line,
        Expect::Hits,
        Expect::Line,
        Expect::Line,
        Expect::Hits,
        Expect::Hits,
        Expect::Line,
        Expect::Line,
        Expect::Hits,
    ];
    let want = [
        "End { items: 2 }",
        "Stored",
        "End { items: 0 }",
        "NotStored",
        "Error([83, 69, 82, 86, 69, 82, 95, 69, 82, 82, 79, 82, 32, 111, 117, 116, 32, 111, 102, 32, 109, 101, 109, 111, 114, 121])",
        "Error([67, 76, 73, 69, 78, 84, 95, 69, 82, 82, 79, 82, 32, 98, 97, 100])",
        // a value body that looks like "END" is data
        "End { items: 1 }",
        "Exists",
        "NotFound",
        "Redirect { epoch: 7, server: 2, worker: 1 }",
    ];
    for chunk in [1, 2, 3, 7, 64, 4096] {
        assert_eq!(decode_chunked(input, &ex, chunk).unwrap(), want, "chunk {chunk}");
    }
}

#[test]
fn large_value_skipped_progressively() {
    let mut d = Decoder::new();
    let (n, r) = d.decode(b"VALUE big 0 1000000\r\n", Expect::Hits).unwrap();
    assert_eq!((n, r), (21, None));
    assert!(d.mid_reply());
    let chunk = vec![b'x'; 500_000];
    assert_eq!(d.decode(&chunk, Expect::Hits).unwrap(), (500_000, None));
    assert_eq!(d.decode(&chunk, Expect::Hits).unwrap(), (500_000, None));
    let (n, r) = d.decode(b"\r\nEND\r\n", Expect::Hits).unwrap();
    assert_eq!((n, r), (7, Some(Frame::End { items: 1 })));
    assert!(!d.mid_reply());
    // the data's CR LF is checked even when it arrives split
    let mut d = Decoder::new();
    assert_eq!(d.decode(b"VALUE k 0 1\r\nx", Expect::Hits).unwrap(), (14, None));
    assert!(d.decode(b"\n", Expect::Hits).is_err());
}

#[test]
fn frames_borrow_the_buffer() {
    let buf = b"VALUE key 7 3 5\r\nabc\r\nEND\r\n";
    let mut d = Decoder::new();
    let (n, f) = d.decode(buf, Expect::Values).unwrap();
    assert_eq!(f, Some(Frame::Value(Value { key: b"key", flags: 7, data: b"abc", cas: Some(5) })));
    assert!(!f.unwrap().ends_reply());
    let (m, f) = d.decode(&buf[n..], Expect::Values).unwrap();
    assert_eq!((n + m, f), (buf.len(), Some(Frame::End { items: 1 })));
}

fn arb_reply() -> impl Strategy<Value = (Vec<u8>, Expect)> {
    let key = "[a-z]{1,8}";
    prop_oneof![
        Just((b"STORED\r\n".to_vec(), Expect::Line)),
        Just((b"NOT_FOUND\r\n".to_vec(), Expect::Line)),
        Just((b"SERVER_ERROR out of memory\r\n".to_vec(), Expect::Values)),
        (any::<u64>(), any::<u16>(), any::<u16>())
            .prop_map(|(e, s, w)| (format!("RD {e} {s} {w}\r\n").into_bytes(), Expect::Hits)),
        (any::<u64>()).prop_map(|n| (format!("{n}\r\n").into_bytes(), Expect::Line)),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(|j| (
            [format!("MAP 3 {}\r\n", j.len()).into_bytes(), j, b"\r\n".to_vec()].concat(),
            Expect::Line
        )),
        (
            proptest::collection::vec((key, any::<u32>(), proptest::collection::vec(any::<u8>(), 0..30)), 0..4),
            any::<bool>()
        )
            .prop_map(|(items, hits)| {
                let mut b = Vec::new();
                for (k, f, d) in items {
                    if f % 3 == 0 {
                        b.extend_from_slice(format!("RH hot {k} {} {}\r\n", f % 5, f / 7).as_bytes());
                    }
                    b.extend_from_slice(format!("VALUE {k} {f} {}\r\n", d.len()).as_bytes());
                    b.extend_from_slice(&d);
                    b.extend_from_slice(b"\r\n");
                }
                b.extend_from_slice(b"END\r\n");
                (b, if hits { Expect::Hits } else { Expect::Values })
            }),
        proptest::collection::vec(("[a-z_]{1,8}", "[a-z0-9 .]{0,8}"), 0..4).prop_map(|st| {
            let mut b: Vec<u8> = st.iter().flat_map(|(n, v)| format!("STAT {n} {v}\r\n").into_bytes()).collect();
            b.extend_from_slice(b"END\r\n");
            (b, Expect::Stats)
        }),
    ]
}

proptest! {
    /// Valid streams decode to the same frames however they are split.
    #[test]
    fn valid_streams_decode_the_same_at_any_split(
        replies in proptest::collection::vec(arb_reply(), 1..8),
        chunk in 1usize..50,
    ) {
        let input: Vec<u8> = replies.iter().flat_map(|(b, _)| b.clone()).collect();
        let ex: Vec<Expect> = replies.iter().map(|&(_, e)| e).collect();
        let whole = decode_chunked(&input, &ex, input.len()).unwrap();
        prop_assert!(!whole.iter().any(|f| f == "<need more>"));
        prop_assert_eq!(decode_chunked(&input, &ex, chunk).unwrap(), whole);
    }

    /// Any bytes: no panic, and a split changes nothing (same frames, or an
    /// error in both, or waiting for more in both).
    #[test]
    fn any_bytes_decode_the_same_at_any_split(
        input in proptest::collection::vec(prop_oneof![
            Just(b'\r'), Just(b'\n'), Just(b' '), Just(b'0'), Just(b'1'), Just(b'V'), any::<u8>()
        ], 0..200),
        words in proptest::collection::vec(prop_oneof![
            Just(&b"VALUE k 0 2\r\n"[..]), Just(&b"END\r\n"[..]), Just(&b"STAT a b\r\n"[..]), Just(&b"RD 1 2 3\r\n"[..]),
            Just(&b"MAP 1 2\r\n"[..]), Just(&b"ERROR\r\n"[..]), Just(&b"RH hot k 2 100\r\n"[..]),
            Just(&b"HD\r\n"[..]),
        ], 0..6),
        ex in proptest::collection::vec(prop_oneof![
            Just(Expect::Values), Just(Expect::Hits), Just(Expect::Stats), Just(Expect::Line), Just(Expect::Meta)
        ], 1..6),
        chunk in 1usize..20,
    ) {
        let mut data = Vec::new();
        for (i, w) in words.iter().enumerate() {
            data.extend_from_slice(w);
            data.extend_from_slice(&input[i.min(input.len())..(i * 7).min(input.len())]);
        }
        data.extend_from_slice(&input);
        let whole = decode_chunked(&data, &ex, data.len().max(1)).map_err(|_| ());
        let split = decode_chunked(&data, &ex, chunk).map_err(|_| ());
        prop_assert_eq!(split, whole);
    }
}

#[test]
fn meta_replies() {
    let stream = b"HD\r\nVA 3 f5 c9\r\nabc\r\nEN\r\nNF Oxy\r\nNS\r\nEX c0\r\nMN\r\nME k exp=-1 la=1\r\nRD 3 1 0\r\n\
VA 0\r\n\r\nCLIENT_ERROR bad command line format\r\n";
    let m = |l: &str, d: Option<&[u8]>| Reply::Meta { line: l.into(), data: d.map(|d| d.to_vec()) };
    let want = vec![
        m("HD", None),
        m("VA 3 f5 c9", Some(b"abc")),
        m("EN", None),
        m("NF Oxy", None),
        m("NS", None),
        m("EX c0", None),
        m("MN", None),
        m("ME k exp=-1 la=1", None),
        Reply::Redirect { epoch: 3, server: 1, worker: 0 },
        m("VA 0", Some(b"")),
        Reply::Error("CLIENT_ERROR bad command line format".into()),
    ];
    let expects = vec![Expect::Meta; want.len()];
    assert_eq!(parse_all(stream, &expects), want);
    assert_eq!(parse_bytewise(stream, &expects), want);
    // a meta reply where text was expected, and END where meta was, break the stream
    // (a text status line is returned whatever was expected, as the module docs say)
    for (bytes, e) in [(&b"HD\r\n"[..], Expect::Line), (b"END\r\n", Expect::Meta)] {
        let mut p = ReplyReader::new();
        p.feed(bytes);
        assert!(p.next(e).is_err(), "{:?}", String::from_utf8_lossy(bytes));
    }
    let mut p = ReplyReader::new();
    p.feed(b"VA 2\r\nabX\r\n");
    assert!(p.next(Expect::Meta).is_err(), "data not followed by CR LF");
    let mut p = ReplyReader::new();
    p.feed(b"VA x\r\n");
    assert!(p.next(Expect::Meta).is_err());
}

#[test]
fn hints_precede_values_and_meta_replies_without_changing_them() {
    let stream =
        b"RH hot a 2 500\r\nVALUE a 0 1\r\nx\r\nVALUE b 0 1\r\ny\r\nRH hot c 0 0\r\nVALUE c 0 2\r\nzz\r\nEND\r\n\
RH hot d 7 18446744073709551615\r\nEND\r\nSTORED\r\nRH hot e 1 10\r\nVA 1\r\nv\r\nRH hot f 3 9\r\nEN\r\nHD\r\n";
    let ex = [Expect::Values, Expect::Values, Expect::Line, Expect::Meta, Expect::Meta, Expect::Meta];
    let want = vec![
        Reply::Values(vec![v("a", 0, b"x", None), v("b", 0, b"y", None), v("c", 0, b"zz", None)]),
        Reply::Values(vec![]),
        Reply::Stored,
        Reply::Meta { line: "VA 1".into(), data: Some(b"v".to_vec()) },
        Reply::Meta { line: "EN".into(), data: None },
        Reply::Meta { line: "HD".into(), data: None },
    ];
    let h = |k: &str, replicas, lease_ms| OwnedHint { key: k.into(), replicas, lease_ms };
    let want_hints = vec![h("a", 2, 500), h("c", 0, 0), h("d", 7, u64::MAX), h("e", 1, 10), h("f", 3, 9)];
    assert_eq!(parse_all(stream, &ex), want);
    assert_eq!(parse_bytewise(stream, &ex), want);
    let mut p = ReplyReader::new();
    p.feed(stream);
    let mut got = Vec::new();
    for e in ex {
        p.next(e).unwrap().unwrap();
        got.extend(p.take_hints());
    }
    assert_eq!(got, want_hints);
    assert!(p.take_hints().is_empty(), "taken once");
    // the hint of a reply is there once the reply is returned, not before it
    let mut p = ReplyReader::new();
    p.feed(b"RH hot a 1 5\r\n");
    assert_eq!(p.next(Expect::Values).unwrap(), None);
    assert!(p.mid_reply(), "a hint starts the reply");
    p.feed(b"END\r\n");
    assert_eq!(p.next(Expect::Values).unwrap(), Some(Reply::Values(vec![])));
    assert!(!p.mid_reply());
    assert_eq!(p.take_hints(), vec![h("a", 1, 5)]);
}

#[test]
fn hints_reach_the_hit_counter_as_frames() {
    let input = b"RH hot k1 1 100\r\nVALUE k1 0 5\r\nhello\r\nRH hot k2 2 50\r\nVALUE k2 0 1\r\nx\r\nEND\r\nRH hot k3 1 1\r\nHD\r\n";
    let want = [
        "Hint(Hint { key: [107, 49], replicas: 1, lease_ms: 100 })",
        "Hint(Hint { key: [107, 50], replicas: 2, lease_ms: 50 })",
        "End { items: 2 }",
        "Hint(Hint { key: [107, 51], replicas: 1, lease_ms: 1 })",
        "Meta { code: [72, 68], line: [72, 68], data: None }",
    ];
    for chunk in [1, 2, 5, 4096] {
        assert_eq!(decode_chunked(input, &[Expect::Hits, Expect::Meta], chunk).unwrap(), want, "chunk {chunk}");
    }
    assert!(!Frame::Hint(Hint { key: b"k", replicas: 1, lease_ms: 1 }).ends_reply());
}

#[test]
fn misplaced_or_malformed_hints_break_the_stream() {
    let bad: &[(&[u8], Expect)] = &[
        (b"RH hot k 1 100\r\nSTORED\r\n", Expect::Line),
        (b"RH hot k 1 100\r\nEND\r\n", Expect::Stats),
        (b"RH cold k 1 100\r\nEND\r\n", Expect::Values),
        (b"RH hot k 1\r\nEND\r\n", Expect::Values),
        (b"RH hot k 1 100 5\r\nEND\r\n", Expect::Values),
        (b"RH hot k x 100\r\nEND\r\n", Expect::Hits),
        (b"RH hot k 4294967296 100\r\nEND\r\n", Expect::Values),
        (b"RH hot k 1 -5\r\nHD\r\n", Expect::Meta),
        (b"RH\r\nHD\r\n", Expect::Meta),
    ];
    for &(bytes, e) in bad {
        let mut p = ReplyReader::new();
        p.feed(bytes);
        assert!(p.next(e).is_err(), "{:?} {e:?}", String::from_utf8_lossy(bytes));
    }
}

#[test]
fn hints_kept_are_bounded() {
    let mut p = ReplyReader::new();
    for i in 0..MAX_HINTS + 10 {
        p.feed(format!("RH hot k{i} 1 100\r\n").as_bytes());
    }
    p.feed(b"END\r\n");
    assert_eq!(p.next(Expect::Values).unwrap(), Some(Reply::Values(vec![])));
    let h = p.take_hints();
    assert_eq!(h.len(), MAX_HINTS);
    assert_eq!(h[0].key, b"k0");
}

/// A reader that hands out its bytes a few at a time, then a timeout or EOF.
struct Trickle<'a> {
    data: &'a [u8],
    step: usize,
    then: std::io::ErrorKind,
}

impl std::io::Read for Trickle<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.data.is_empty() {
            return match self.then {
                std::io::ErrorKind::UnexpectedEof => Ok(0),
                k => Err(k.into()),
            };
        }
        let n = self.step.min(self.data.len()).min(out.len());
        out[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

#[test]
fn read_reply_gathers_a_load_across_reads_and_keeps_what_a_timeout_cut() {
    let json = br#"{"seq":7,"workers":[]}"#;
    let mut wire = format!("LOAD 7 {}\r\n", json.len()).into_bytes();
    wire.extend_from_slice(json);
    wire.extend_from_slice(b"\r\nLOAD 8 2\r\n{}");
    let mut rr = ReplyReader::new();
    let mut r = Trickle { data: &wire, step: 5, then: std::io::ErrorKind::WouldBlock };
    assert_eq!(rr.read_reply(&mut r, Expect::Line).unwrap(), Reply::Load { seq: 7, json: json.to_vec() });
    // The second is cut short by a timeout: the bytes stay for the next call.
    assert_eq!(rr.read_reply(&mut r, Expect::Line).unwrap_err().kind(), std::io::ErrorKind::WouldBlock);
    let mut rest = Trickle { data: b"\r\n", step: 1, then: std::io::ErrorKind::UnexpectedEof };
    assert_eq!(rr.read_reply(&mut rest, Expect::Line).unwrap(), Reply::Load { seq: 8, json: b"{}".to_vec() });
    // A connection closed mid-reply, and a malformed one.
    let mut cut = Trickle { data: b"LOAD 9 10\r\n{", step: 64, then: std::io::ErrorKind::UnexpectedEof };
    assert_eq!(
        ReplyReader::new().read_reply(&mut cut, Expect::Line).unwrap_err().kind(),
        std::io::ErrorKind::UnexpectedEof
    );
    let mut bad = Trickle { data: b"LOAD x\r\n", step: 64, then: std::io::ErrorKind::UnexpectedEof };
    assert_eq!(
        ReplyReader::new().read_reply(&mut bad, Expect::Line).unwrap_err().kind(),
        std::io::ErrorKind::InvalidData
    );
}

/// mbal's member-to-member answers: a renewal's `OK <reads>`, `SLOTS`, `HELD`
/// (what the replicator and the slot thread read, and the server writes with `ext`).
#[test]
fn member_answers_decode_and_round_trip_through_ext() {
    let mut wire = Vec::new();
    crate::ext::write_ok_count(&mut wire, 42);
    wire.extend_from_slice(b"OK\r\n");
    crate::ext::write_slots(&mut wire, 3, 3000);
    crate::ext::write_held(&mut wire, 2);
    let got = parse_all(&wire, &[Expect::Line; 4]);
    assert_eq!(got, vec![Reply::OkCount(42), Reply::Ok, Reply::Slots { granted: 3, lease_ms: 3000 }, Reply::Held(2)]);
    for bad in [&b"OK x\r\n"[..], b"OK 1 2\r\n", b"SLOTS 3\r\n", b"SLOTS 3 x\r\n", b"HELD\r\n", b"OKAY 1\r\n"] {
        let mut r = ReplyReader::new();
        r.feed(bad);
        assert!(r.next(Expect::Line).is_err(), "{:?}", String::from_utf8_lossy(bad));
    }
}
