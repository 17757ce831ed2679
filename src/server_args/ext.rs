//! memcached's `-o` options: which mean something here, which only tune a part of memcached
//! mbal does not have (accepted with one log line), and which are refused by name.

use super::*;

/// What mbal does with one of memcached's `-o` options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtKind {
    /// Does here what it does in memcached (for `modern`, `inline_ascii_resp` and the like,
    /// that is nothing, in memcached 1.6 too).
    Implemented,
    /// Accepted; it only tunes a part of memcached mbal does not have. One log line says so.
    NoEffect,
}

const SLAB: &str = "mbal has no slab classes: items of any size share their cachelet's pages \
                    (--page-size-kb), so there is nothing to size, reassign or move";
const LRU: &str = "mbal evicts per worker, oldest segment first with a CLOCK second chance, not \
                   with memcached's segmented LRU";
const CRAWLER: &str = "mbal drops expired items when they are looked up and in a sweep every 50 ms; \
                       there is no crawler thread";
const INDEX: &str = "mbal's hash index is per cachelet and grows by doubling in small steps";
const EXTSTORE: &str = "extstore tuning; mbal keeps items in memory only (ext_path is refused)";
const LOGBUF: &str = "mbal has no `watch` log stream to buffer";

fn ext_value<'a>(name: &str, value: Option<&'a str>) -> Result<&'a str> {
    value.with_context(|| format!("-o {name}: missing value (use {name}=...)"))
}

fn ext_num<T: FromStr>(name: &str, value: Option<&str>) -> Result<T> {
    let v = ext_value(name, value)?;
    v.trim().parse().map_err(|_| anyhow::anyhow!("-o {name}: bad value '{v}'"))
}

/// Apply one memcached `-o` option (`name` or `name=value`) to a layer of options.
/// Returns what mbal does with it and, for an option without effect here, the line to log.
/// Refused options, unknown names and bad values are errors. Value checks are memcached's.
pub fn extended_option(layer: &mut ServerArgs, opt: &str) -> Result<(ExtKind, Option<String>)> {
    let (name, value) = match opt.split_once('=') {
        Some((k, v)) => (k.trim(), Some(v)),
        None => (opt.trim(), None),
    };
    let refuse =
        |why: &str| -> Result<(ExtKind, Option<String>)> { bail!("-o {name} is not supported by mbal: {why}") };
    let check = |ok: bool, what: &str| -> Result<()> {
        if !ok {
            bail!("-o {name}: {what} (got '{}')", value.unwrap_or(""))
        }
        Ok(())
    };
    let why: &str = match name {
        "idle_timeout" => {
            layer.idle_timeout = Some(ext_num(name, value)?);
            return Ok((ExtKind::Implemented, None));
        }
        "maxconns_fast" | "no_maxconns_fast" => {
            layer.maxconns_fast = Some(name == "maxconns_fast");
            return Ok((ExtKind::Implemented, None));
        }
        "sock_cookie_id" => {
            layer.sock_cookie_id = Some(ext_num(name, value)?);
            return Ok((ExtKind::Implemented, None));
        }
        "track_sizes" => {
            layer.track_sizes = Some(true);
            return Ok((ExtKind::Implemented, None));
        }
        // memcached 1.6: `modern` sets nothing new, the ascii-response options are no-ops, and
        // mbal never drops privileges: the same as asking for nothing, here as there.
        "modern" | "inline_ascii_resp" | "no_inline_ascii_resp" | "no_drop_privileges" => {
            return Ok((ExtKind::Implemented, None));
        }
        // memcached's 1.4 defaults, as a bundle: of these, only the connection limit's
        // behaviour exists in mbal.
        "no_modern" => {
            layer.maxconns_fast = Some(false);
            return Ok((
                ExtKind::Implemented,
                Some(
                    "-o no_modern: connections over -c now wait in the listen backlog (no_maxconns_fast); \
                     its slab, LRU, crawler and hash-algorithm parts have no effect in mbal"
                        .into(),
                ),
            ));
        }
        "hash_algorithm" => {
            let v = ext_value(name, value)?;
            if !matches!(v, "jenkins" | "murmur3" | "xxh3") {
                bail!("-o hash_algorithm: unknown '{v}' (jenkins, murmur3, xxh3)");
            }
            "mbal hashes keys with its one cluster-wide key hash (XXH3-64), which clients that \
             route by the cluster map share; the choice is not visible to memcached clients"
        }
        "hashpower" => {
            let n: u32 = ext_num(name, value)?;
            check((12..=32).contains(&n), "must be between 12 and 32")?;
            INDEX
        }
        "no_hashexpand" => INDEX,
        "slab_reassign" | "no_slab_reassign" | "no_slab_automove" | "no_chunked_items" => SLAB,
        "slab_automove" => {
            if value.is_some() {
                let n: u32 = ext_num(name, value)?;
                check(n <= 2, "must be between 0 and 2")?;
            }
            SLAB
        }
        "slab_automove_ratio" => {
            let f: f64 = ext_num(name, value)?;
            check(f > 0.0 && f <= 1.0, "must be > 0 and <= 1")?;
            SLAB
        }
        "slab_automove_window" => {
            let n: u32 = ext_num(name, value)?;
            check(n > 2, "must be > 2")?;
            SLAB
        }
        "slab_automove_freeratio" => {
            ext_num::<f64>(name, value)?;
            SLAB
        }
        "slab_chunk_max" => {
            ext_num::<u32>(name, value)?;
            SLAB
        }
        "slab_sizes" => {
            let v = ext_value(name, value)?;
            check(v.split('-').all(|n| n.trim().parse::<u32>().is_ok()), "sizes separated by '-'")?;
            SLAB
        }
        "tail_repair_time" => {
            let n: u32 = ext_num(name, value)?;
            check(n >= 10, "must be at least 10 seconds")?;
            LRU
        }
        "lru_maintainer" | "no_lru_maintainer" => LRU,
        "hot_lru_pct" | "warm_lru_pct" => {
            let n: u32 = ext_num(name, value)?;
            check((1..80).contains(&n), "must be between 1 and 79")?;
            LRU
        }
        "hot_max_factor" | "warm_max_factor" => {
            let f: f64 = ext_num(name, value)?;
            check(f > 0.0, "must be > 0")?;
            LRU
        }
        "temporary_ttl" => {
            ext_num::<u32>(name, value)?;
            LRU
        }
        "lru_crawler" | "no_lru_crawler" => CRAWLER,
        "lru_crawler_sleep" => {
            let n: u32 = ext_num(name, value)?;
            check(n <= 1_000_000, "must be between 0 and 1000000 microseconds")?;
            CRAWLER
        }
        "lru_crawler_tocrawl" => {
            ext_num::<u32>(name, value)?;
            CRAWLER
        }
        "watcher_logbuf_size" | "worker_logbuf_size" => {
            ext_num::<u32>(name, value)?;
            LOGBUF
        }
        "resp_obj_mem_limit" => "deprecated in memcached 1.6 as well",
        "read_buf_mem_limit" => {
            ext_num::<u32>(name, value)?;
            "mbal bounds each connection's buffers instead (16 KiB idle; one request and 4 MiB of \
             unsent replies busy), so the total is bounded by -c"
        }
        "ext_page_size" | "ext_wbuf_size" | "ext_threads" | "ext_io_depth" | "ext_item_size" | "ext_item_age"
        | "ext_low_ttl" | "ext_recache_rate" | "ext_compact_under" | "ext_drop_under" | "ext_max_sleep"
        | "ext_max_frag" | "ext_drop_unread" => EXTSTORE,
        "ext_path" => return refuse("mbal keeps items in memory only; it has no external (flash) storage"),
        "drop_privileges" => {
            return refuse("mbal does not sandbox itself (seccomp); use the service manager's sandboxing")
        }
        "ssl_chain_cert" | "ssl_key" | "ssl_ca_cert" => {
            let path = Some(PathBuf::from(ext_value(name, value)?));
            match name {
                "ssl_chain_cert" => layer.ssl_chain_cert = path,
                "ssl_key" => layer.ssl_key = path,
                _ => layer.ssl_ca_cert = path,
            }
            return Ok((ExtKind::Implemented, None));
        }
        "ssl_verify_mode" => {
            let v: u8 = ext_num(name, value)?;
            check(v <= 3, "must be 0 (none), 1 (request), 2 (require) or 3 (once)")?;
            layer.ssl_verify_mode = Some(v);
            return Ok((ExtKind::Implemented, None));
        }
        "ssl_min_version" => {
            // memcached's numbers or names: 0 tlsv1, 1 tlsv1.1, 2 tlsv1.2, 3 tlsv1.3.
            let v = match ext_value(name, value)? {
                "0" | "tlsv1" | "1" | "tlsv1.1" | "2" | "tlsv1.2" => 2,
                "3" | "tlsv1.3" => 3,
                _ => bail!("-o ssl_min_version: must be 0..3 or tlsv1, tlsv1.1, tlsv1.2, tlsv1.3"),
            };
            layer.ssl_min_version = Some(v);
            let note = (v == 2 && !matches!(value, Some("2" | "tlsv1.2")))
                .then(|| format!("-o ssl_min_version={}: mbal speaks TLS 1.2 and 1.3 only", value.unwrap_or("")));
            return Ok((ExtKind::Implemented, note));
        }
        "ssl_keyformat" => {
            ext_num::<u8>(name, value)?;
            "keys are read as PEM (PKCS#8, PKCS#1 or SEC1), whatever the number"
        }
        "ssl_ciphers" => {
            ext_value(name, value)?;
            "rustls offers its own safe suites (TLS 1.3 and TLS 1.2 ECDHE with AEAD ciphers)"
        }
        "ssl_wbuf_size" => {
            ext_num::<u32>(name, value)?;
            "each TLS connection buffers at most 64 KiB of records for the socket"
        }
        "ssl_session_cache" => "rustls keeps a server-side session cache (and TLS 1.3 tickets) by default",
        "ssl_kernel_tls" => "records are encrypted in user space (rustls)",
        "proxy_config" | "proxy_uring" => {
            return refuse("memcached's built-in proxy; mbal routes by its cluster map (--cluster)")
        }
        _ => bail!("-o {name}: unknown option (memcached 1.6 has no such option either)"),
    };
    Ok((ExtKind::NoEffect, Some(format!("-o {name}: accepted, no effect in mbal: {why}"))))
}
