//! memcached's keyless tuning commands that mean nothing for mbal's item memory
//! (`slabs`, `lru`, `cache_memlimit`): arguments are checked and errors answered exactly as
//! memcached 1.6.18 answers them (`proto_text.c`), so scripts and exporters that send them
//! keep working; what each valid form does here is in docs/protocol.md.

use mbal_proto::text::TuneCmd;

const OK: &[u8] = b"OK\r\n";
const ERROR: &[u8] = b"ERROR\r\n";
const BAD_FORMAT: &[u8] = b"CLIENT_ERROR bad command line format\r\n";

/// Answer a tuning command; `args` is the line after the command word.
pub(crate) fn tune(cmd: TuneCmd, args: &[u8], out: &mut Vec<u8>) {
    let args = String::from_utf8_lossy(args);
    let t: Vec<&str> = args.split(' ').filter(|t| !t.is_empty()).collect();
    // memcached's `set_noreply_maybe`: a last token `noreply` silences the reply.
    let noreply = t.last() == Some(&"noreply");
    let reply: &[u8] = match cmd {
        TuneCmd::Slabs => slabs(&t),
        TuneCmd::Lru => lru(&t),
        TuneCmd::CacheMemlimit => cache_memlimit(&t),
        TuneCmd::LruCrawler => lru_crawler(&t),
        // The server serves `watch` itself (`crate::watch`); here only its refusal.
        TuneCmd::Watch => ERROR,
    };
    // memcached's `slabs reassign` does not look for noreply.
    if !noreply || matches!(t.first(), Some(&"reassign")) {
        out.extend_from_slice(reply);
    }
}

/// A class list of `lru_crawler crawl|metadump`: `all` (`None`), or ids `1,2,...`, each a
/// memcached slab class id (1..=63; mbal's classes are its workers, `stats items`); `Err`
/// (memcached's `BADCLASS invalid class id`) otherwise.
pub(crate) fn crawler_classes(arg: &str, hash_ok: bool) -> Result<Option<Vec<u32>>, ()> {
    if arg == "all" || (hash_ok && arg == "hash") {
        return Ok(None);
    }
    arg.split(',')
        .map(|id| u32_arg(id).filter(|&id| (1..64).contains(&id)).ok_or(()))
        .collect::<Result<_, _>>()
        .map(Some)
}

pub(crate) const BADCLASS: &[u8] = b"BADCLASS invalid class id\r\n";

/// `lru_crawler crawl|tocrawl|sleep|enable|disable` (`metadump` is the server's: a dump of
/// the items). mbal's crawler is each worker's expiry sweep, which always runs: the valid
/// forms answer OK and change nothing.
fn lru_crawler(t: &[&str]) -> &'static [u8] {
    match t {
        ["crawl", classes] => match crawler_classes(classes, false) {
            Ok(_) => OK,
            Err(()) => BADCLASS,
        },
        ["tocrawl" | "sleep", n] => match u32_arg(n) {
            Some(_) => OK,
            None => BAD_FORMAT,
        },
        ["enable" | "disable"] => OK,
        _ => ERROR,
    }
}

fn u32_arg(s: &str) -> Option<u32> {
    // memcached's safe_strtoul: a decimal unsigned long, no sign, truncated to 32 bits.
    s.parse::<u64>().ok().map(|v| v as u32)
}

/// `slabs reassign <src> <dst>` and `slabs automove <0|1|2>` / `slabs automove ratio <r>`.
/// mbal has no slab classes: its pages are shared by all workers and any page holds items of
/// any size, so there is nothing to reassign or automove; valid forms answer OK.
fn slabs(t: &[&str]) -> &'static [u8] {
    match t {
        ["reassign", src, dst] => {
            if src.parse::<i32>().is_err() || dst.parse::<i32>().is_err() {
                BAD_FORMAT
            } else {
                OK
            }
        }
        ["automove", "ratio", r, ..] => {
            if r.parse::<f64>().is_ok() {
                OK
            } else {
                ERROR
            }
        }
        ["automove", "ratio"] => ERROR,
        ["automove", level, ..] => match u32_arg(level) {
            None => BAD_FORMAT,
            Some(0..=2) => OK,
            Some(_) => ERROR,
        },
        _ => ERROR,
    }
}

/// `lru tune <hot%> <warm%> <hot factor> <warm factor>`, `lru mode flat|segmented`,
/// `lru temp_ttl <ttl>`: mbal's eviction is segment-based, not memcached's segmented LRU, so
/// valid forms answer OK and change nothing.
fn lru(t: &[&str]) -> &'static [u8] {
    match t {
        ["tune", hot, warm, hf, wf, ..] => {
            let (Some(hot), Some(warm), Ok(hf), Ok(wf)) =
                (u32_arg(hot), u32_arg(warm), hf.parse::<f64>(), wf.parse::<f64>())
            else {
                return ERROR;
            };
            if hot as u64 + warm as u64 > 80 {
                b"ERROR hot and warm pcts must not exceed 80\r\n"
            } else if wf <= 0.0 || hf <= 0.0 {
                b"ERROR hot/warm age factors must be greater than 0\r\n"
            } else {
                OK
            }
        }
        ["mode", "flat" | "segmented", ..] => OK,
        ["temp_ttl", ttl, ..] if ttl.parse::<i64>().is_ok() => OK,
        _ => ERROR,
    }
}

/// `cache_memlimit <megabytes> [noreply]`: mbal's page pool is sized once at start (`-m`),
/// so a valid request answers memcached's refusal to adjust.
fn cache_memlimit(t: &[&str]) -> &'static [u8] {
    let (1 | 2) = t.len() else { return ERROR };
    match u32_arg(t[0]) {
        None => ERROR,
        Some(m) if m < 8 => b"MEMLIMIT_TOO_SMALL cannot set maxbytes to less than 8m\r\n",
        Some(m) if m > 1_000_000_000 => b"MEMLIMIT_ADJUST_FAILED input value is megabytes not bytes\r\n",
        Some(_) => b"MEMLIMIT_ADJUST_FAILED out of bounds or unable to adjust\r\n",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn say(cmd: TuneCmd, args: &str) -> String {
        let mut out = Vec::new();
        tune(cmd, args.as_bytes(), &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn memcached_replies() {
        use TuneCmd::*;
        assert_eq!(say(Slabs, "automove x"), "CLIENT_ERROR bad command line format\r\n");
        assert_eq!(say(Slabs, "automove 1"), "OK\r\n");
        assert_eq!(say(Slabs, "automove 1 noreply"), "");
        assert_eq!(say(Slabs, "automove 3"), "ERROR\r\n");
        assert_eq!(say(Slabs, "automove ratio 0.5 x"), "OK\r\n");
        assert_eq!(say(Slabs, "automove ratio"), "ERROR\r\n");
        assert_eq!(say(Slabs, "reassign x y"), "CLIENT_ERROR bad command line format\r\n");
        assert_eq!(say(Slabs, "reassign 1 2"), "OK\r\n");
        assert_eq!(say(Slabs, ""), "ERROR\r\n");
        assert_eq!(say(Slabs, "foo"), "ERROR\r\n");
        assert_eq!(say(Lru, "tune 10 10 0.1 2"), "OK\r\n");
        assert_eq!(say(Lru, "tune 50 40 0.1 2"), "ERROR hot and warm pcts must not exceed 80\r\n");
        assert_eq!(say(Lru, "tune 10 10 0 2"), "ERROR hot/warm age factors must be greater than 0\r\n");
        assert_eq!(say(Lru, "tune x 10 1 2"), "ERROR\r\n");
        assert_eq!(say(Lru, "mode flat"), "OK\r\n");
        assert_eq!(say(Lru, "x"), "ERROR\r\n");
        assert_eq!(say(CacheMemlimit, "x"), "ERROR\r\n");
        assert_eq!(say(CacheMemlimit, "4"), "MEMLIMIT_TOO_SMALL cannot set maxbytes to less than 8m\r\n");
        assert_eq!(say(CacheMemlimit, "100"), "MEMLIMIT_ADJUST_FAILED out of bounds or unable to adjust\r\n");
        assert_eq!(say(CacheMemlimit, "100 noreply"), "");
        assert_eq!(say(CacheMemlimit, "1 2 3"), "ERROR\r\n");
    }
}
