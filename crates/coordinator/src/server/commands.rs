//! The coordinator's text protocol (docs/protocol.md, "Coordinator"): one request line in,
//! its answer out. Parsing and answering only; every decision is `crate::state::Coord`'s.

use super::*;

const USAGE_REGISTER: &str = "usage: mbal register <id|-> <main_addr> <workers> <worker_addrs|-> <memory_bytes> [warm]";
const USAGE_BEAT: &str = "usage: mbal beat <id> <epoch_seen>";
const USAGE_LEAVE: &str = "usage: mbal leave <id>";
const USAGE_MOVED: &str = "usage: mbal moved <id> <cachelet> <worker>";
const USAGE_MIGRATE: &str =
    "usage: mbal migrate begin <cachelet> <from> <to> <worker> | commit <id> [<items> <bytes>] | abort <id> <cachelet> <to>";

fn client_error(out: &mut Vec<u8>, msg: &str) {
    out.extend_from_slice(b"CLIENT_ERROR ");
    out.extend_from_slice(msg.as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn line_out(out: &mut Vec<u8>, text: std::fmt::Arguments<'_>) {
    let _ = out.write_fmt(text);
    out.extend_from_slice(b"\r\n");
}

/// One request line; false: close the connection (`quit`).
pub(super) fn command(sh: &Shared, session: &mut Session, line: &[u8], out: &mut Vec<u8>) -> bool {
    let text = String::from_utf8_lossy(line);
    let words: Vec<&str> = text.split_ascii_whitespace().collect();
    match words.as_slice() {
        ["mbal", "peer"] => match &sh.secret {
            None => client_error(out, "no cluster secret is set on this coordinator"),
            Some(_) => {
                let nonce = peer_auth::new_nonce();
                session.nonce = Some(nonce);
                line_out(out, format_args!("NONCE {}", peer_auth::to_hex(&nonce)));
            }
        },
        ["mbal", "peer", answer] => match &sh.secret {
            None => client_error(out, "no cluster secret is set on this coordinator"),
            Some(secret) => {
                // A nonce is good for one answer.
                let ok = session.nonce.take().is_some_and(|n| peer_auth::verify(secret, &n, answer));
                if ok {
                    session.peer_ok = true;
                    out.extend_from_slice(b"OK\r\n");
                } else {
                    sh.lock().counters.peer_auth_errors += 1;
                    client_error(out, "bad peer credentials");
                }
            }
        },
        ["mbal", "map", have] => match have.parse::<u64>() {
            // A refresh (a client or proxy thread that saw a server fail asks every 200 ms):
            // the map only if it is newer than the asker's.
            Ok(have) => map_reply(sh, Some(have), out),
            Err(_) => client_error(out, "usage: mbal map [<epoch you have>]"),
        },
        ["mbal", "map"] => map_reply(sh, None, out),
        ["mbal", "members"] => {
            let rows = sh.lock().member_rows(Instant::now());
            for r in rows {
                let age = r.ms_since_beat.map_or_else(|| "-".to_string(), |ms| ms.to_string());
                line_out(
                    out,
                    format_args!("MEMBER {} {} {} {} {} {age}", r.id, r.main, r.state.name(), r.workers, r.cachelets),
                );
            }
            out.extend_from_slice(b"END\r\n");
        }
        ["mbal", "migrations"] => {
            let now = Instant::now();
            let c = sh.lock();
            for m in c.migrations().rows() {
                let ms = m.ended.unwrap_or(now).duration_since(m.started).as_millis();
                let outcome = m.outcome.unwrap_or("in-flight").replace(' ', "_");
                line_out(
                    out,
                    format_args!(
                        "MIGRATION {} {} {} {}:{} {outcome} {ms} {} {}",
                        m.id, m.cachelet, m.from, m.to.0, m.to.1, m.items, m.bytes
                    ),
                );
            }
            out.extend_from_slice(b"END\r\n");
        }
        ["mbal", "drain", id] => {
            if !leader_may_act(sh, session, out) {
                return true;
            }
            let Ok(id) = id.parse::<u16>() else {
                client_error(out, "usage: mbal drain <id>");
                return true;
            };
            let _plans = sh.plans.lock().unwrap_or_else(|e| e.into_inner());
            let (draining, pending) = {
                let o = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner());
                (o.draining(), o.pending())
            };
            let plan = sh.lock().drain_plan(id, &draining, &pending);
            match plan {
                Ok(plan) => {
                    let mut o = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner());
                    let n = o.add(plan);
                    o.drain(id);
                    tracing::info!(server = id, moves = n, "coordinator: draining a server");
                    line_out(out, format_args!("OK {n}"));
                }
                Err(e) => client_error(out, &e),
            }
        }
        ["mbal", "rebalance"] => {
            if !leader_may_act(sh, session, out) {
                return true;
            }
            let _plans = sh.plans.lock().unwrap_or_else(|e| e.into_inner());
            let pending = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner()).pending();
            let plan = sh.lock().rebalance_plan(&pending);
            let n = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner()).add(plan);
            line_out(out, format_args!("OK {n}"));
        }
        ["mbal", "queue"] => {
            let o = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner());
            for r in o.rows() {
                line_out(out, format_args!("{r}"));
            }
            line_out(out, format_args!("ORDERED {} {}", o.done, o.failed));
            out.extend_from_slice(b"END\r\n");
        }
        ["mbal", "migrate", args @ ..] => {
            if !leader_may_act(sh, session, out) {
                return true;
            }
            if let Err(usage) = migrate(sh, args, out) {
                sh.lock().counters.bad_commands += 1;
                client_error(out, usage);
            }
        }
        ["stats"] => stats(sh, out),
        ["version"] => line_out(out, format_args!("VERSION {}", env!("CARGO_PKG_VERSION"))),
        ["quit"] => return false,
        ["mbal", "report", id, words @ ..] => {
            if !leader_may_act(sh, session, out) {
                return true;
            }
            match id.parse::<u16>() {
                Ok(id) => report(sh, id, &words.join(" "), out),
                Err(_) => {
                    sh.lock().counters.bad_commands += 1;
                    client_error(out, "usage: mbal report <id> <report>");
                }
            }
        }
        ["mbal", cmd @ ("register" | "beat" | "leave" | "moved"), args @ ..] => {
            if !leader_may_act(sh, session, out) {
                return true;
            }
            let r = match *cmd {
                "register" => register(sh, args, out),
                "beat" => beat(sh, args, out),
                "leave" => leave(sh, args, out),
                _ => moved(sh, args, out),
            };
            if let Err(usage) = r {
                sh.lock().counters.bad_commands += 1;
                client_error(out, usage);
            }
        }
        _ => {
            sh.lock().counters.bad_commands += 1;
            out.extend_from_slice(b"ERROR\r\n");
        }
    }
    true
}

/// `mbal report <id> <report>`: keep server `id`'s report (one line, opaque here: its mean
/// load and Phase 1's slot figures, `crates/server/src/beat.rs`), answer with the other Up
/// servers' latest: `PEER <id> <ms since it came> <report>` lines, then `END`.
fn report(sh: &Shared, id: u16, report: &str, out: &mut Vec<u8>) {
    let now = Instant::now();
    let up: Vec<u16> = {
        let c = sh.lock();
        c.member_rows(now).iter().filter(|r| r.state == MemberState::Up).map(|r| r.id).collect()
    };
    if !up.contains(&id) {
        client_error(out, "not an Up server");
        return;
    }
    let mut reports = sh.reports.lock().unwrap_or_else(|p| p.into_inner());
    reports.insert(id, (now, report.to_string()));
    for (&peer, (at, r)) in reports.iter() {
        if peer != id && up.contains(&peer) {
            line_out(out, format_args!("PEER {peer} {} {r}", now.duration_since(*at).as_millis()));
        }
    }
    out.extend_from_slice(b"END\r\n");
}

/// May this connection's request change something here? It must have logged in (with a
/// cluster secret), and this coordinator must lead: with etcd only the leader decides, checked
/// when the request is read, so a beat answered BEAT was received while this coordinator still
/// led (beat.rs). Otherwise the refusal is written to `out`.
pub(super) fn may_act(sh: &Shared, session: &Session, out: &mut Vec<u8>) -> bool {
    leader_may_act(sh, session, out)
}

fn leader_may_act(sh: &Shared, session: &Session, out: &mut Vec<u8>) -> bool {
    if sh.secret.is_some() && !session.peer_ok {
        sh.lock().counters.auth_refused += 1;
        client_error(out, "authenticate with mbal peer first");
        return false;
    }
    if let Err(e) = sh.leading(Instant::now()) {
        line_out(out, format_args!("SERVER_ERROR {e}"));
        return false;
    }
    true
}

/// A reply to a decision whose state could not be written.
fn not_saved(out: &mut Vec<u8>, e: &str) {
    line_out(out, format_args!("SERVER_ERROR {e}"));
}

fn register(sh: &Shared, args: &[&str], out: &mut Vec<u8>) -> Result<(), &'static str> {
    let (args, warm) = match args {
        [rest @ .., "warm"] => (rest, true),
        _ => (args, false),
    };
    let [id, main, workers, addrs, memory] = args else { return Err(USAGE_REGISTER) };
    let id = match *id {
        "-" => None,
        s => Some(s.parse::<u16>().map_err(|_| USAGE_REGISTER)?),
    };
    let main: SocketAddr = main.parse().map_err(|_| USAGE_REGISTER)?;
    let workers: u16 = workers.parse().map_err(|_| USAGE_REGISTER)?;
    if workers == 0 {
        return Err("a server has at least 1 worker");
    }
    let worker_addrs: Vec<SocketAddr> = match *addrs {
        "-" => vec![main; workers as usize],
        s => s.split(',').map(|a| a.parse()).collect::<Result<_, _>>().map_err(|_| USAGE_REGISTER)?,
    };
    if worker_addrs.len() != workers as usize {
        return Err("the worker addresses must be one per worker (or -)");
    }
    let memory: u64 = memory.parse().map_err(|_| USAGE_REGISTER)?;
    let info = ServerInfo { main, workers: worker_addrs };
    let now = Instant::now();
    // One plan against the pending moves at a time, from reading them to queueing this one.
    let plans = sh.plans.lock().unwrap_or_else(|e| e.into_inner());
    let pending = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner()).pending();
    let registered = sh.mutate(|c| {
        let r = match warm {
            true => c.register_warm(id, info, memory, now, &pending),
            false => c.register(id, info, memory, now).map(|r| (r, Vec::new())),
        };
        (c.timing(), r)
    });
    let (timing, result) = match registered {
        Ok((t, Ok((r, plan)))) => {
            // A warm join's share comes with its items, one move at a time (`orchestra`).
            let n = sh.orchestra.lock().unwrap_or_else(|e| e.into_inner()).add(plan);
            if n > 0 {
                tracing::info!(server = r.id, moves = n, "coordinator: warm join: its share will move to it");
            }
            (t, Ok(r))
        }
        Ok((t, Err(e))) => (t, Err(e)),
        Err(e) => {
            not_saved(out, &e);
            return Ok(());
        }
    };
    drop(plans);
    match result {
        Ok(r) => {
            if r.joined {
                tracing::info!(server = r.id, %main, cachelets = r.given, epoch = r.epoch, "coordinator: server joined");
            } else {
                tracing::info!(server = r.id, %main, epoch = r.epoch, "coordinator: server registered (keeps its cachelets)");
            }
            line_out(
                out,
                format_args!(
                    "REGISTERED {} {} {} {}",
                    r.id,
                    r.epoch,
                    timing.beat.as_millis(),
                    timing.lease.as_millis()
                ),
            );
        }
        Err(e) => {
            tracing::info!(%main, "coordinator: registration refused: {e}");
            client_error(out, &e);
        }
    }
    Ok(())
}

fn beat(sh: &Shared, args: &[&str], out: &mut Vec<u8>) -> Result<(), &'static str> {
    let [id, seen] = args else { return Err(USAGE_BEAT) };
    let id: u16 = id.parse().map_err(|_| USAGE_BEAT)?;
    let _seen: u64 = seen.parse().map_err(|_| USAGE_BEAT)?;
    let (b, lease) = {
        let mut c = sh.lock();
        (c.beat(id, Instant::now()), c.timing().lease)
    };
    match b {
        Beat::Up { epoch } => line_out(out, format_args!("BEAT {epoch} {}", lease.as_millis())),
        Beat::Gone { left: false } => line_out(out, format_args!("GONE {id}")),
        Beat::Gone { left: true } => line_out(out, format_args!("GONE {id} left")),
        Beat::NoServer => client_error(out, &format!("no server {id}")),
    }
    Ok(())
}

fn leave(sh: &Shared, args: &[&str], out: &mut Vec<u8>) -> Result<(), &'static str> {
    let [id] = args else { return Err(USAGE_LEAVE) };
    let id: u16 = id.parse().map_err(|_| USAGE_LEAVE)?;
    match sh.mutate(|c| c.leave(id)) {
        Err(e) => not_saved(out, &e),
        Ok(Ok(epoch)) => {
            tracing::info!(server = id, epoch, "coordinator: server left; its cachelets reassigned");
            line_out(out, format_args!("OK {epoch}"));
        }
        Ok(Err(LeaveError::NoServer)) => client_error(out, &format!("no server {id}")),
        Ok(Err(LeaveError::NoOtherServer)) => {
            out.extend_from_slice(b"SERVER_ERROR no other server to take its cachelets\r\n")
        }
        Ok(Err(LeaveError::Map(e))) => line_out(out, format_args!("SERVER_ERROR {e}")),
    }
    Ok(())
}

fn moved(sh: &Shared, args: &[&str], out: &mut Vec<u8>) -> Result<(), &'static str> {
    let [id, c, w] = args else { return Err(USAGE_MOVED) };
    let id: u16 = id.parse().map_err(|_| USAGE_MOVED)?;
    let c: u32 = c.parse().map_err(|_| USAGE_MOVED)?;
    let w: u16 = w.parse().map_err(|_| USAGE_MOVED)?;
    match sh.mutate(|co| co.moved(id, c, w)) {
        Err(e) => not_saved(out, &e),
        Ok(Ok(epoch)) => {
            tracing::info!(server = id, cachelet = c, worker = w, epoch, "coordinator: local move");
            line_out(out, format_args!("OK {epoch}"));
        }
        Ok(Err(e)) => client_error(out, &e),
    }
    Ok(())
}

/// `mbal migrate ...`: a cross-server move's steps (`crate::state::migrations`).
fn migrate(sh: &Shared, args: &[&str], out: &mut Vec<u8>) -> Result<(), &'static str> {
    let num = |s: &str| s.parse::<u64>().map_err(|_| USAGE_MIGRATE);
    let now = Instant::now();
    match *args {
        ["begin", c, from, to, w] => {
            let (c, from, to, w) = (num(c)? as u32, num(from)? as u16, num(to)? as u16, num(w)? as u16);
            match sh.mutate(|co| co.migrate_begin(c, from, (to, w), now)) {
                Err(e) => not_saved(out, &e),
                Ok(Ok(id)) => {
                    tracing::info!(cachelet = c, from, to, worker = w, id, "coordinator: move begins");
                    line_out(out, format_args!("OK {id}"));
                }
                Ok(Err(e)) => client_error(out, &e),
            }
        }
        ["commit", id, ref rest @ ..] => {
            let id = num(id)?;
            let sent = match *rest {
                [] => (0, 0),
                [items, bytes] => (num(items)?, num(bytes)?),
                _ => return Err(USAGE_MIGRATE),
            };
            match sh.mutate(|co| co.migrate_commit(id, sent, now)) {
                Err(e) => not_saved(out, &e),
                Ok(Ok(epoch)) => {
                    tracing::info!(id, epoch, "coordinator: move committed");
                    line_out(out, format_args!("OK {epoch}"));
                }
                Ok(Err(e)) => client_error(out, &e),
            }
        }
        ["abort", id, c, to] => {
            let (id, c, to) = (num(id)?, num(c)? as u32, num(to)? as u16);
            match sh.mutate(|co| co.migrate_abort(id, c, to, now)) {
                Err(e) => not_saved(out, &e),
                Ok(crate::state::AbortOutcome::Aborted) => {
                    tracing::info!(id, "coordinator: move aborted");
                    out.extend_from_slice(b"ABORTED\r\n");
                }
                Ok(crate::state::AbortOutcome::Committed(epoch)) => line_out(out, format_args!("COMMITTED {epoch}")),
            }
        }
        _ => return Err(USAGE_MIGRATE),
    }
    Ok(())
}

/// `stats`: `STAT <name> <value>` lines, then `END`.
pub(super) fn stats(sh: &Shared, out: &mut Vec<u8>) {
    let leader = u64::from(sh.leading(Instant::now()).is_ok());
    let c = sh.lock();
    let k = &c.counters;
    let live = sh.conns.lock().unwrap_or_else(|e| e.into_inner()).len() as u64;
    let (p3_reports, p3_issued) = sh.phase3.as_ref().map_or((0, 0), |d| {
        let d = d.lock().unwrap_or_else(|e| e.into_inner());
        (d.reports, d.issued_total)
    });
    let rows: [(&str, u64); 28] = [
        ("uptime", sh.started.elapsed().as_secs()),
        ("epoch", c.epoch()),
        ("migrations_begun", k.migrations_begun),
        ("migrations_committed", k.migrations_committed),
        ("migrations_aborted", k.migrations_aborted),
        ("phase3_reports", p3_reports),
        ("phase3_migrations", p3_issued),
        ("servers", c.members().len() as u64),
        ("servers_up", c.count(MemberState::Up) as u64),
        ("servers_down", c.count(MemberState::Down) as u64),
        ("servers_left", c.count(MemberState::Left) as u64),
        ("cachelets", c.map().cachelet_count() as u64),
        ("registrations", k.registrations),
        ("joins", k.joins),
        ("register_refused", k.register_refused),
        ("beats", k.beats),
        ("failures_detected", k.failures_detected),
        ("leaves", k.leaves),
        ("moves", k.moves),
        ("auth_refused", k.auth_refused),
        ("peer_auth_errors", k.peer_auth_errors),
        ("bad_commands", k.bad_commands),
        ("state_writes", k.state_writes),
        ("state_write_errors", k.state_write_errors),
        ("curr_connections", live),
        ("total_connections", sh.total_conns.load(Ordering::Relaxed)),
        ("rejected_connections", sh.conns_refused.load(Ordering::Relaxed)),
        ("beat_ms", c.timing().beat.as_millis() as u64),
    ];
    for (name, v) in rows {
        line_out(out, format_args!("STAT {name} {v}"));
    }
    line_out(out, format_args!("STAT lease_ms {}", c.timing().lease.as_millis()));
    line_out(out, format_args!("STAT failure_timeout_ms {}", c.timing().failure_timeout.as_millis()));
    line_out(out, format_args!("STAT leader {leader}"));
    out.extend_from_slice(b"END\r\n");
}

/// `mbal map [<have>]`: the map, serialised once per epoch (every server fetches each new map:
/// at 100 servers x 16 workers that is ~0.6 MB each, docs/benchmarks.md); with `have`, only if
/// it is newer than that (else `MAP <epoch> 0`).
fn map_reply(sh: &Shared, have: Option<u64>, out: &mut Vec<u8>) {
    let c = sh.lock();
    let epoch = c.epoch();
    if have.is_some_and(|h| h >= epoch) {
        drop(c);
        return mbal_proto::ext::write_map(out, epoch, b"");
    }
    let mut cache = sh.map_cache.lock().unwrap_or_else(|p| p.into_inner());
    let bytes = match &*cache {
        Some((e, b)) if *e == epoch => b.clone(),
        _ => {
            let mut b = Vec::new();
            mbal_proto::ext::write_map(&mut b, epoch, c.map().to_json().as_bytes());
            let b = Arc::new(b);
            *cache = Some((epoch, b.clone()));
            b
        }
    };
    drop((cache, c));
    out.extend_from_slice(&bytes);
}
