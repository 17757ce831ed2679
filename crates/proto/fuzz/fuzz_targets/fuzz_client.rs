#![no_main]
//! The client-side reply codec (`mbal_proto::client`) on arbitrary server
//! output: no panic, never more consumed than given, the same frames however
//! the input is split, and the owned reader agrees with the decoder (replies
//! and hot-key hints).
use libfuzzer_sys::fuzz_target;
use mbal_proto::client::{Decoder, Expect, Reply, ReplyReader};

const EXPECTS: [Expect; 5] = [Expect::Values, Expect::Hits, Expect::Stats, Expect::Line, Expect::Meta];

/// Frames (as text) decoded from `input` fed `chunk` bytes at a time; the
/// expected reply kinds come from `ex` in turn (cycled).
fn decode(input: &[u8], ex: &[Expect], chunk: usize) -> Result<Vec<String>, ()> {
    let mut d = Decoder::new();
    let mut buf = Vec::new();
    let (mut out, mut fed, mut ei) = (Vec::new(), 0, 0);
    for _ in 0..100_000 {
        let (n, f) = d.decode(&buf, ex[ei % ex.len()]).map_err(|_| ())?;
        assert!(n <= buf.len(), "consumed more than given");
        let f = f.map(|f| (format!("{f:?}"), f.ends_reply()));
        buf.drain(..n);
        match f {
            Some((f, end)) => {
                out.push(f);
                ei += end as usize;
            }
            None if fed == input.len() => break,
            None => {
                let end = (fed + chunk).min(input.len());
                buf.extend_from_slice(&input[fed..end]);
                fed = end;
            }
        }
    }
    Ok(out)
}

fuzz_target!(|data: &[u8]| {
    let Some((&head, input)) = data.split_first() else { return };
    // three expected reply kinds (cycled): the digits of `head` in base 5
    let ex: Vec<Expect> = (0..3).map(|i| EXPECTS[(head as usize / 5usize.pow(i)) % 5]).collect();
    let whole = decode(input, &ex, input.len().max(1));
    for chunk in [1, 3, 17] {
        assert_eq!(decode(input, &ex, chunk), whole, "split every {chunk} bytes");
    }
    // The owned reader: same number of complete replies, or an error.
    let mut r = ReplyReader::new();
    r.feed(input);
    let mut replies = 0;
    let mut hints = 0;
    let mut ok = true;
    for i in 0..10_000 {
        match r.next(ex[i % ex.len()]) {
            Ok(Some(rep)) => {
                if let Reply::Values(vs) = &rep {
                    assert!(vs.iter().all(|v| !v.key.is_empty()));
                }
                replies += 1;
                hints += r.take_hints().len();
            }
            Ok(None) => break,
            Err(_) => {
                ok = false;
                break;
            }
        }
    }
    if let Ok(frames) = whole {
        if ok {
            let is_end = |f: &String| !f.starts_with("Value(") && !f.starts_with("Stat {") && !f.starts_with("Hint(");
            let ends = frames.iter().filter(|f| is_end(f)).count();
            assert_eq!(replies, ends.min(10_000));
            if ends < 10_000 {
                // every hint before the last complete reply was kept (up to the bound)
                let last = frames.iter().rposition(is_end).unwrap_or(0);
                let before = frames[..last].iter().filter(|f| f.starts_with("Hint(")).count();
                assert!(hints >= before.min(mbal_proto::client::MAX_HINTS), "hints {hints} < {before}");
            }
        }
    }
});
