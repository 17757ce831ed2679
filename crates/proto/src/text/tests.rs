//! Tests of the text protocol parser (`super`).

use super::*;
use crate::testutil::*;
use crate::Protocol::Text as T;

fn cmd(buf: &[u8]) -> TextCmd<'_> {
    match whole(T, buf) {
        Request::Text(c) => c,
        other => panic!("{other:?}"),
    }
}

fn keys_of(c: &TextCmd) -> Vec<Vec<u8>> {
    match c {
        TextCmd::Get { keys, .. } => keys.iter().map(|k| k.to_vec()).collect(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn get_gets_gat_gats() {
    let c = cmd(b"get a\r\n");
    assert_eq!(keys_of(&c), [b"a".to_vec()]);
    assert!(matches!(c, TextCmd::Get { cas: false, touch: None, .. }));
    let c = cmd(b"gets a  bb ccc\r\n");
    assert_eq!(keys_of(&c), [b"a".to_vec(), b"bb".to_vec(), b"ccc".to_vec()]);
    assert!(matches!(c, TextCmd::Get { cas: true, touch: None, ref keys, .. } if keys.len() == 3));
    assert!(
        matches!(cmd(b"gat 10 a b\r\n"), TextCmd::Get { cas: false, touch: Some(10), ref keys, .. } if keys.len() == 2)
    );
    assert!(matches!(cmd(b"gats -1 a\n"), TextCmd::Get { cas: true, touch: Some(-1), .. }));
    // gat with no keys is accepted (memcached answers END)
    assert!(matches!(cmd(b"gat 1\r\n"), TextCmd::Get { ref keys, .. } if keys.is_empty()));
    // leading/trailing spaces, bare \n
    assert_eq!(keys_of(&cmd(b"   get  x   \n")), [b"x".to_vec()]);
    // Runs of spaces between keys, a 250-byte key, bytes above 0x7f.
    let k250 = vec![b'k'; 250];
    let line = [b"get a  b ".as_slice(), &k250, b"   \xc3\xa9t\xe9 z\r\n"].concat();
    let want = [b"a".to_vec(), b"b".to_vec(), k250.clone(), b"\xc3\xa9t\xe9".to_vec(), b"z".to_vec()];
    assert_eq!(keys_of(&cmd(&line)), want);
    assert!(matches!(cmd(&line), TextCmd::Get { ref keys, .. } if keys.len() == 5));
}

#[test]
fn get_errors() {
    assert_eq!(terr(b"get\r\n"), ("ERROR", 5, false));
    assert_eq!(terr(b"get   \r\n"), ("ERROR", 8, false));
    let long = [b"get a ".as_slice(), &[b'k'; 251], b" b\r\n"].concat();
    assert_eq!(terr(&long), (E_FORMAT, long.len(), false));
    assert_eq!(terr(b"get a\tb\r\n").0, E_FORMAT);
    // The last key too long, a DEL byte, a control byte at the end.
    let long = [b"get a ".as_slice(), &[b'k'; 251], b"\r\n"].concat();
    assert_eq!(terr(&long).0, E_FORMAT);
    assert_eq!(terr(b"get a b\x7f\r\n").0, E_FORMAT);
    assert_eq!(terr(b"get a b\x01\r\n").0, E_FORMAT);
    assert_eq!(terr(b"gat x a\r\n"), ("CLIENT_ERROR invalid exptime argument", 9, false));
    assert_eq!(terr(b"gat\r\n").0, "ERROR");
    assert_eq!(terr(b"GET a\r\n").0, "ERROR");
    assert_eq!(terr(b"\r\n"), ("ERROR", 2, false));
    assert_eq!(terr(b"bogus\n"), ("ERROR", 6, false));
}

#[test]
fn many_keys_up_to_max_line() {
    let mut line = b"get".to_vec();
    for i in 0..5000 {
        line.extend_from_slice(format!(" key{i}").as_bytes());
    }
    line.extend_from_slice(b"\r\n");
    let limits = Limits { max_line: line.len(), ..Limits::default() };
    match crate::parse(crate::Protocol::Text, &line, &limits) {
        Parsed::Req { req: Request::Text(TextCmd::Get { keys, .. }), consumed } => {
            assert_eq!(keys.len(), 5000);
            assert_eq!(keys.iter().last(), Some(b"key4999".as_slice()));
            assert_eq!(consumed, line.len());
        }
        other => panic!("{other:?}"),
    }
    let limits = Limits { max_line: line.len() - 1, ..Limits::default() };
    assert_eq!(
        crate::parse(crate::Protocol::Text, &line, &limits),
        Parsed::Err { reply: ErrReply::Text(E_LINE_TOO_LONG), skip: line.len() - 1, close: true }
    );
}

#[test]
fn line_too_long_without_newline() {
    let limits = Limits { max_line: 100, ..Limits::default() };
    let buf = vec![b'x'; 99];
    assert_eq!(crate::parse(crate::Protocol::Text, &buf, &limits), Parsed::NeedMore);
    let buf = vec![b'x'; 100];
    assert!(matches!(
        crate::parse(crate::Protocol::Text, &buf, &limits),
        Parsed::Err { reply: ErrReply::Text(E_LINE_TOO_LONG), close: true, .. }
    ));
    let buf = vec![b'x'; 5000];
    assert!(matches!(crate::parse(crate::Protocol::Text, &buf, &limits), Parsed::Err { close: true, .. }));
}

#[test]
fn store_commands() {
    let c = cmd(b"set k 5 100 3\r\nabc\r\n");
    assert_eq!(
        c,
        TextCmd::Store {
            mode: StoreMode::Set,
            key: b"k",
            flags: 5,
            exptime: 100,
            data: b"abc",
            cas_unique: 0,
            noreply: false
        }
    );
    for (name, mode) in [
        ("add", StoreMode::Add),
        ("replace", StoreMode::Replace),
        ("append", StoreMode::Append),
        ("prepend", StoreMode::Prepend),
    ] {
        let buf = format!("{name} key 0 -1 2 noreply\r\nhi\r\n");
        match cmd(buf.as_bytes()) {
            TextCmd::Store { mode: m, key, exptime: -1, data: b"hi", noreply: true, .. } => {
                assert_eq!(m, mode);
                assert_eq!(key, b"key");
            }
            other => panic!("{other:?}"),
        }
    }
    match cmd(b"cas k 1 2 0 99 noreply\n\r\n") {
        TextCmd::Store {
            mode: StoreMode::Cas, cas_unique: 99, data: b"", noreply: true, flags: 1, exptime: 2, ..
        } => {}
        other => panic!("{other:?}"),
    }
    // data may contain \r\n and spaces
    assert!(matches!(cmd(b"set k 0 0 4\r\n\r\n \n\r\n"), TextCmd::Store { data: b"\r\n \n", .. }));
    // flags above u32: memcached keeps the low 32 bits
    assert!(matches!(cmd(b"set k 4294967297 0 1\r\nx\r\n"), TextCmd::Store { flags: 1, .. }));
    assert!(matches!(cmd(b"set k 0 99999999999 1\r\nx\r\n"), TextCmd::Store { exptime: 99999999999, .. }));
    // a non-"noreply" 6th token is ignored like memcached
    assert!(matches!(cmd(b"set k 0 0 1 junk\r\nx\r\n"), TextCmd::Store { noreply: false, .. }));
}

#[test]
fn store_errors() {
    // wrong token counts -> ERROR, no swallow
    assert_eq!(terr(b"set a 0 0\r\n"), ("ERROR", 11, false));
    assert_eq!(terr(b"set aaa 0 0 1 2 3\r\nx\r\n"), ("ERROR", 19, false));
    assert_eq!(terr(b"cas a 0 0 1\r\nx\r\n"), ("ERROR", 13, false));
    // bad numbers -> CLIENT_ERROR, no swallow
    assert_eq!(terr(b"set a b 0 1\r\nx\r\n"), (E_FORMAT, 13, false));
    assert_eq!(terr(b"set a 0 x 1\r\nx\r\n"), (E_FORMAT, 13, false));
    assert_eq!(terr(b"set a -1 0 1\r\nx\r\n").0, E_FORMAT);
    assert_eq!(terr(b"cas a 0 0 1 x\r\nx\r\n"), (E_FORMAT, 15, false));
    assert_eq!(terr(b"set a 0 0 -1\r\n"), (E_FORMAT, 14, false));
    let long = [b"set ".as_slice(), &[b'k'; 251], b" 0 0 1\r\n"].concat();
    assert_eq!(terr(&long), (E_FORMAT, long.len(), false));
    // bad data chunk: swallow line + declared + 2, like memcached
    assert_eq!(terr(b"set a 0 0 2\r\nxyzw\r\n"), (E_CHUNK, 17, false));
    assert_eq!(terr(b"set a 0 0 1\nx\nget a\n"), (E_CHUNK, 15, false));
    assert_eq!(silent(b"set a 0 0 2 noreply\r\nxyz\r\n"), 25);
    // too large: reply and swallow the whole block (more than the buffer)
    let (msg, skip, close) = terr(b"set a 0 0 2000000\r\n");
    assert_eq!((msg, skip, close), (E_TOO_LARGE, 19 + 2_000_002, false));
    assert_eq!(silent(b"set a 0 0 2000000 noreply\r\n"), 27 + 2_000_002);
    // exactly max_item_size is fine
    let limits = Limits { max_item_size: 3, ..Limits::default() };
    assert!(matches!(crate::parse(crate::Protocol::Text, b"set a 0 0 3\r\nabc\r\n", &limits), Parsed::Req { .. }));
    assert!(matches!(
        crate::parse(crate::Protocol::Text, b"set a 0 0 4\r\n", &limits),
        Parsed::Err { reply: ErrReply::Text(E_TOO_LARGE), skip: 19, close: false }
    ));
    // noreply silences format errors after it was seen
    assert_eq!(silent(b"set a b 0 1 noreply\r\n"), 21);
}

#[test]
fn store_incremental_and_pipelined() {
    let buf = b"set k 0 0 5\r\nhello\r\nget k\r\n";
    match p(T, buf) {
        Parsed::Req { consumed, .. } => {
            assert_eq!(consumed, 20);
            assert!(matches!(p(T, &buf[20..]), Parsed::Req { consumed: 7, .. }));
        }
        other => panic!("{other:?}"),
    }
    for i in 0..20 {
        assert_eq!(p(T, &buf[..i]), Parsed::NeedMore);
    }
}

#[test]
fn delete_forms() {
    assert_eq!(cmd(b"delete a\r\n"), TextCmd::Delete { key: b"a", noreply: false });
    assert_eq!(cmd(b"delete a 0\r\n"), TextCmd::Delete { key: b"a", noreply: false });
    assert_eq!(cmd(b"delete a noreply\r\n"), TextCmd::Delete { key: b"a", noreply: true });
    assert_eq!(cmd(b"delete a 0 noreply\r\n"), TextCmd::Delete { key: b"a", noreply: true });
    assert_eq!(terr(b"delete a 1\r\n").0, E_DELETE_USAGE);
    assert_eq!(terr(b"delete a 1 2\r\n").0, E_DELETE_USAGE);
    assert_eq!(silent(b"delete a 1 noreply\r\n"), 20);
    assert_eq!(terr(b"delete\r\n").0, "ERROR");
    assert_eq!(terr(b"delete a 0 noreply x\r\n").0, "ERROR");
}

#[test]
fn arith_forms() {
    assert_eq!(cmd(b"incr a 5\r\n"), TextCmd::Arith { incr: true, key: b"a", delta: 5, noreply: false });
    assert_eq!(
        cmd(b"decr a 18446744073709551615 noreply\r\n"),
        TextCmd::Arith { incr: false, key: b"a", delta: u64::MAX, noreply: true }
    );
    assert_eq!(terr(b"incr a x\r\n").0, "CLIENT_ERROR invalid numeric delta argument");
    assert_eq!(terr(b"incr a -1\r\n").0, "CLIENT_ERROR invalid numeric delta argument");
    assert_eq!(terr(b"incr a 18446744073709551616\r\n").0, "CLIENT_ERROR invalid numeric delta argument");
    assert_eq!(silent(b"incr a x noreply\r\n"), 18);
    assert_eq!(terr(b"incr a\r\n").0, "ERROR");
}

#[test]
fn touch_flush_verbosity_misc() {
    assert_eq!(cmd(b"touch a 10\r\n"), TextCmd::Touch { key: b"a", exptime: 10, noreply: false });
    assert_eq!(cmd(b"touch a 10 noreply\r\n"), TextCmd::Touch { key: b"a", exptime: 10, noreply: true });
    assert_eq!(terr(b"touch a x\r\n").0, "CLIENT_ERROR invalid exptime argument");
    assert_eq!(terr(b"touch a\r\n").0, "ERROR");
    assert_eq!(cmd(b"flush_all\r\n"), TextCmd::FlushAll { delay: 0, noreply: false });
    assert_eq!(cmd(b"flush_all 10\r\n"), TextCmd::FlushAll { delay: 10, noreply: false });
    assert_eq!(cmd(b"flush_all noreply\r\n"), TextCmd::FlushAll { delay: 0, noreply: true });
    assert_eq!(cmd(b"flush_all 5 noreply\r\n"), TextCmd::FlushAll { delay: 5, noreply: true });
    assert_eq!(terr(b"flush_all x\r\n").0, "CLIENT_ERROR invalid exptime argument");
    assert_eq!(terr(b"flush_all 1 2 3\r\n").0, "ERROR");
    assert_eq!(cmd(b"verbosity 1\r\n"), TextCmd::Verbosity { noreply: false });
    assert_eq!(cmd(b"verbosity 1 noreply\r\n"), TextCmd::Verbosity { noreply: true });
    assert_eq!(terr(b"verbosity\r\n").0, "ERROR");
    assert_eq!(terr(b"verbosity x\r\n").0, E_FORMAT);
    assert_eq!(cmd(b"version\r\n"), TextCmd::Version);
    assert_eq!(cmd(b"quit\r\n"), TextCmd::Quit);
    assert_eq!(cmd(b"refresh_certs\r\n"), TextCmd::RefreshCerts);
    assert_eq!(cmd(b"shutdown\r\n"), TextCmd::Shutdown { args: b"" });
    assert_eq!(cmd(b"shutdown  graceful \r\n"), TextCmd::Shutdown { args: b"graceful" });
    assert_eq!(cmd(b"slabs automove 1\r\n"), TextCmd::Tune { cmd: TuneCmd::Slabs, args: b"automove 1" });
    assert_eq!(cmd(b"lru mode flat\r\n"), TextCmd::Tune { cmd: TuneCmd::Lru, args: b"mode flat" });
    assert_eq!(cmd(b"cache_memlimit 9\r\n"), TextCmd::Tune { cmd: TuneCmd::CacheMemlimit, args: b"9" });
    assert_eq!(cmd(b"lru_crawler metadump all\r\n"), TextCmd::Tune { cmd: TuneCmd::LruCrawler, args: b"metadump all" });
    assert_eq!(
        cmd(b"watch fetchers evictions\r\n"),
        TextCmd::Tune { cmd: TuneCmd::Watch, args: b"fetchers evictions" }
    );
    assert_eq!(cmd(b"watch\r\n"), TextCmd::Tune { cmd: TuneCmd::Watch, args: b"" });
    assert!(matches!(cmd(b"bget a b\r\n"), TextCmd::Get { cas: false, touch: None, ref keys, .. } if keys.len() == 2));
    assert_eq!(cmd(b"mbal hello 3\r\n"), TextCmd::Mbal { args: b"hello 3", data: b"" });
    assert_eq!(cmd(b"mbal rset k 5 0 3 2000\r\nabc\r\n"), TextCmd::Mbal { args: b"rset k 5 0 3 2000", data: b"abc" });
    assert!(matches!(parse(b"mbal rset k 5 0 3 2000\r\nab", &Limits::default()), Parsed::NeedMore));
    assert!(matches!(parse(b"mbal rset k 5 0\r\n", &Limits::default()), Parsed::Err { .. }));
    assert_eq!(
        cmd(b"mbal import data 7 2 final\r\nab\r\n"),
        TextCmd::Mbal { args: b"import data 7 2 final", data: b"ab" }
    );
    assert_eq!(cmd(b"mbal import data 7 0\r\n\r\n"), TextCmd::Mbal { args: b"import data 7 0", data: b"" });
    assert!(matches!(parse(b"mbal import data 7 3 delta\r\nab", &Limits::default()), Parsed::NeedMore));
    assert!(matches!(parse(b"mbal import data 7 3 later\r\nabc\r\n", &Limits::default()), Parsed::Err { .. }));
    assert_eq!(cmd(b"mbal import begin 7 12 100\r\n"), TextCmd::Mbal { args: b"import begin 7 12 100", data: b"" });
    assert_eq!(cmd(b"stats\r\n"), TextCmd::Stats { args: b"" });
    assert_eq!(cmd(b"stats  slabs  \r\n"), TextCmd::Stats { args: b"slabs" });
    assert_eq!(cmd(b"stats detail on\n"), TextCmd::Stats { args: b"detail on" });
}

#[test]
fn http_request_lines_close_silently() {
    let close = |b: &[u8]| p(T, b) == Parsed::Err { reply: ErrReply::Silent, skip: b.len(), close: true };
    for line in [
        &b"GET / HTTP/1.0\r\n"[..],
        b"PUT /asdf HTTP/1.1\r\n",
        b"DELETE HTTP/1.1\r\n",
        b"HTTP/1.0\n",
        b"POST /x HTTP/1.1 \r\n",
        b"OPTIONS * HTTP/2\r\n",
    ] {
        assert!(close(line), "{:?}", String::from_utf8_lossy(line));
    }
    // memcached answers ERROR to these (or runs them)
    assert_eq!(terr(b"X HTTP\r\n").0, "ERROR");
    assert_eq!(terr(b"X http/1.1\r\n").0, "ERROR");
    assert_eq!(terr(b"gxx HTTP/1.1\r\n").0, "ERROR");
    assert_eq!(terr(b"delet HTTP/1.1\r\n").0, "ERROR");
    assert_eq!(terr(b"G HTTP/1.1\r\n").0, "ERROR");
    // (a watch of an unknown category: the server answers ERROR)
    assert!(matches!(p(T, b"watch HTTP/1.1\r\n"), Parsed::Req { .. }));
    assert!(matches!(p(T, b"get / HTTP/1.0\r\n"), Parsed::Req { .. }));
    // only the first 23 tokens count
    let many = format!("GET {} HTTP/1.1\r\n", vec!["a"; 22].join(" "));
    assert_eq!(terr(many.as_bytes()).0, "ERROR");
    let at23 = format!("GET {} HTTP/1.1 b c\r\n", vec!["a"; 21].join(" "));
    assert!(close(at23.as_bytes()));
    // a prefix of the line is NeedMore
    assert_eq!(p(T, b"GET / HTTP/1.1"), Parsed::NeedMore);
}

#[test]
fn crlf_only_stripped_once() {
    // "\r" inside a key token is a control char -> bad format
    assert_eq!(terr(b"get a\r\r\n").0, E_FORMAT);
}

/// `num` reads every token as `FromStr` does.
mod decimal {
    use super::*;
    use proptest::prelude::*;

    /// `num` must read a token exactly as `FromStr` does.
    fn same<T: Decimal + std::str::FromStr + PartialEq + std::fmt::Debug>(tok: &[u8]) {
        let std = std::str::from_utf8(tok).ok().and_then(|s| s.parse::<T>().ok());
        assert_eq!(num::<T>(tok), std, "{:?}", String::from_utf8_lossy(tok));
    }

    fn all(tok: &[u8]) {
        same::<u8>(tok);
        same::<u16>(tok);
        same::<u32>(tok);
        same::<u64>(tok);
        same::<usize>(tok);
        same::<i32>(tok);
        same::<i64>(tok);
    }

    #[test]
    fn edges_read_as_from_str_reads_them() {
        for tok in [
            &b""[..],
            b"+",
            b"-",
            b"0",
            b"-0",
            b"+0",
            b"00012",
            b"255",
            b"256",
            b"65536",
            b"4294967295",
            b"4294967296",
            b"18446744073709551615",
            b"18446744073709551616",
            b"9223372036854775807",
            b"9223372036854775808",
            b"-9223372036854775808",
            b"-9223372036854775809",
            b"-2147483648",
            b"2147483648",
            b"1 ",
            b" 1",
            b"1a",
            b"--1",
            b"+-1",
            b"\xff1",
            b"\xd9\xa1",
        ] {
            all(tok);
        }
    }

    proptest! {
        #[test]
        fn any_token_reads_as_from_str_reads_it(tok in proptest::collection::vec(
            prop_oneof![4 => b'0'..=b'9', 1 => Just(b'-'), 1 => Just(b'+'), 1 => any::<u8>()], 0..24)) {
            all(&tok);
        }
    }
}

#[test]
fn key_lists_are_checked_as_key_by_key() {
    // `keys` checks eight bytes at a time; it must agree with `valid_key` on each token for
    // every mix of separators, bytes at the edges of the allowed range and key lengths.
    let alphabet = [b' ', b'a', b'z', 0x21, 0x20, 0x1f, 0x00, b'\t', 0x7e, 0x7f, 0x80, 0xff];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..20_000 {
        let len = (next() % 64) as usize + if round % 50 == 0 { 240 } else { 0 };
        // Mostly key bytes, so that whole clean words occur; sometimes a bad byte.
        let line: Vec<u8> = (0..len)
            .map(|_| match next() % 100 {
                0..=74 => b'k',
                75..=89 => b' ',
                n => alphabet[n as usize % alphabet.len()],
            })
            .collect();
        let want = super::split_spaces(super::trim(&line))
            .try_fold(0usize, |n, k| crate::valid_key(k).then_some(n + 1))
            .ok_or(());
        let got = super::keys(&line).map(|k| k.len());
        assert_eq!(got, want, "{line:?}");
        if let Ok(k) = super::keys(&line) {
            assert!(k.iter().eq(super::split_spaces(super::trim(&line))));
        }
        assert_eq!(super::first_space(&line), line.iter().position(|&b| b == b' '), "{line:?}");
    }
}
