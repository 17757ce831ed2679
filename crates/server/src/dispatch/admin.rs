//! `mbal <args>`, the extension commands (docs/protocol.md): the routing
//! handshake, the controller's commands (map, epoch snapshots, moves,
//! REPL_high slots), copies on shadows, threads, and the debug commands.

use super::*;
use crate::msg::Own;

/// `mbal <args>`: the extension commands of docs/protocol.md. The map,
/// moves and epoch snapshots belong to the controller: those commands wait
/// in an output slot for its answer.
pub(super) fn admin(shared: &Shared, rt: &mut Route, output: &mut Output, args: &[u8], data: &[u8]) -> Action {
    let args = String::from_utf8_lossy(args);
    let mut it = args.split_whitespace();
    let word = it.clone().next().unwrap_or("");
    if mbal_member::peer_auth::is_control(word) {
        if let Err(reply) = crate::auth::control_allowed(&shared.settings, rt.auth) {
            rt.counters.control_refused += 1;
            output.buf().extend_from_slice(reply);
            return Action::None;
        }
    }
    if word == "import" {
        return Action::Import;
    }
    if word == "replicator" {
        output.buf().extend_from_slice(text::OK);
        return Action::Exempt;
    }
    if matches!(word, "rset" | "rdel" | "rttl") {
        shadow_cmd(shared, rt, output.buf(), &args, data);
        return Action::None;
    }
    match (it.next(), it.next(), it.next(), it.next()) {
        (Some("peer"), answer, None, None) => {
            crate::auth::peer(&shared.settings, rt.counters, rt.auth, answer, output);
            Action::None
        }
        (Some("hello"), Some(epoch), w, by) if epoch.parse::<u64>().is_ok() && matches!(by, None | Some("threads")) => {
            let by_thread = by.is_some();
            let to = match w.map(str::parse::<usize>) {
                None => rt.worker,
                Some(Ok(w)) if w < shared.settings.threads => w,
                Some(_) => {
                    output.buf().extend_from_slice(b"CLIENT_ERROR no such worker\r\n");
                    return Action::None;
                }
            };
            if to != rt.worker {
                // The connection moves: nothing of it may be left behind.
                if output.waiting() || output.unsent() > 0 {
                    output.buf().extend_from_slice(
                        b"CLIENT_ERROR mbal hello <epoch> <worker> must come before other requests\r\n",
                    );
                    return Action::None;
                }
                return Action::HandOff(to, by_thread);
            }
            hello(shared, rt.server, rt.worker, by_thread, output.buf());
            Action::Routed { by_thread }
        }
        (Some("map"), have, None, ..) => {
            let have = match have.map(str::parse::<u64>) {
                None => None,
                Some(Ok(e)) => Some(e),
                Some(Err(_)) => {
                    output.buf().extend_from_slice(b"CLIENT_ERROR usage: mbal map [<epoch you have>]\r\n");
                    return Action::None;
                }
            };
            rt.ask_controller(shared, output, |reply| CtlMsg::Map { have, reply });
            Action::None
        }
        (Some("slots"), Some("held"), Some(from), None) => {
            // A server that started asks what this one still holds of the
            // slots it lent before (docs/protocol.md).
            let Ok(lender) = from.parse::<u16>() else {
                output.buf().extend_from_slice(b"CLIENT_ERROR usage: mbal slots held <server>\r\n");
                return Action::None;
            };
            rt.ask_controller(shared, output, |reply| CtlMsg::Held { lender, reply });
            Action::None
        }
        (Some("slots"), Some(from), Some(n), Some(lease)) => {
            // Another server asks for REPL_high slots (Phase 1, docs/protocol.md).
            let (Ok(borrower), Ok(slots), Ok(lease_ms)) =
                (from.parse::<u16>(), n.parse::<usize>(), lease.parse::<u64>())
            else {
                output.buf().extend_from_slice(b"CLIENT_ERROR usage: mbal slots <server> <slots> <lease ms>\r\n");
                return Action::None;
            };
            rt.ask_controller(shared, output, |reply| CtlMsg::Lend { borrower, slots, lease_ms, reply });
            Action::None
        }
        (Some("load"), after, None, None) => {
            let Ok(after) = after.map_or(Ok(0), str::parse::<u64>) else {
                output.buf().extend_from_slice(b"CLIENT_ERROR usage: mbal load [<after epoch>]\r\n");
                return Action::None;
            };
            rt.ask_controller(shared, output, |reply| CtlMsg::Load { after, reply });
            Action::None
        }
        (Some("move"), Some(c), Some(w), None) => {
            let (Ok(c), Ok(to)) = (c.parse::<u32>(), w.parse::<usize>()) else {
                output.buf().extend_from_slice(b"CLIENT_ERROR usage: mbal move <cachelet> <worker>\r\n");
                return Action::None;
            };
            if c as usize >= rt.tables.len() || to >= shared.settings.threads {
                output.buf().extend_from_slice(b"CLIENT_ERROR no such cachelet or worker\r\n");
                return Action::None;
            }
            let Own { server: s, .. } = rt.tables.owner[c as usize];
            if s != rt.server {
                output.buf().extend_from_slice(b"CLIENT_ERROR cachelet is not on this server\r\n");
                return Action::None;
            }
            rt.ask_controller(shared, output, |reply| CtlMsg::Move { cachelet: c, to, reply });
            Action::None
        }
        (Some("migrate"), Some(c), Some(s), Some(w)) => {
            // A fifth word: the destination worker's address (a server this one's map may not
            // show yet: a coordinator's order for a server that just joined).
            let addr = it.next().map(str::parse::<std::net::SocketAddr>);
            let (Ok(cachelet), Ok(server), Ok(worker), None | Some(Ok(_))) =
                (c.parse::<u32>(), s.parse::<u16>(), w.parse::<u16>(), &addr)
            else {
                output.buf().extend_from_slice(
                    b"CLIENT_ERROR usage: mbal migrate <cachelet> <server> <worker> [<address>]\r\n",
                );
                return Action::None;
            };
            let addr = addr.and_then(Result::ok);
            rt.ask_controller(shared, output, |reply| CtlMsg::Migrate { cachelet, server, worker, addr, reply });
            Action::None
        }
        (Some("threads"), n, None, None) => {
            // How many threads run the workers (`worker/group.rs`): `<n>` fixes it, `auto`
            // hands it back to the thread policy (`fold.rs`).
            let th = &shared.threads;
            match n {
                None => {}
                Some("auto") => th.set_manual(None, shared.peers()),
                Some(n) => match n.parse::<usize>() {
                    Ok(n) if (1..=th.hosts()).contains(&n) => th.set_manual(Some(n), shared.peers()),
                    _ => {
                        let usage = format!("CLIENT_ERROR usage: mbal threads [<1..{}> | auto]\r\n", th.hosts());
                        output.buf().extend_from_slice(usage.as_bytes());
                        return Action::None;
                    }
                },
            }
            let policy = if th.auto() { "auto" } else { "fixed" };
            let line = format!("THREADS {} {} {policy}\r\n", th.active(), th.hosts());
            output.buf().extend_from_slice(line.as_bytes());
            Action::None
        }
        (Some("debug"), Some(what @ ("hot" | "cool")), Some(key), n) if shared.settings.debug_commands => {
            // Pin a key as hot with n copies (or let it cool): Phase 1 made
            // deterministic for tests.
            let replicas = match (what, n.map(str::parse::<u32>)) {
                ("hot", Some(Ok(n))) if n > 0 => n,
                ("cool", None) => 0,
                _ => {
                    output
                        .buf()
                        .extend_from_slice(b"CLIENT_ERROR usage: mbal debug hot <key> <replicas> | cool <key>\r\n");
                    return Action::None;
                }
            };
            let key: Box<[u8]> = key.as_bytes().into();
            rt.ask_controller(shared, output, |reply| CtlMsg::Pin { key, replicas, reply });
            Action::None
        }
        (Some("debug"), Some("slots"), Some(n), None) if shared.settings.debug_commands => {
            // Ask for REPL_high slots as if `n` keys had or wanted copies
            // (0: back to the policy's own count): lending made
            // deterministic for tests.
            let Ok(demand) = n.parse::<usize>() else {
                output.buf().extend_from_slice(b"CLIENT_ERROR usage: mbal debug slots <keys>\r\n");
                return Action::None;
            };
            rt.ask_controller(shared, output, |reply| CtlMsg::DebugSlots { demand, reply });
            Action::None
        }
        #[cfg(feature = "test-hooks")]
        (Some("debug"), Some("stall"), Some(w), Some(ms)) if shared.settings.debug_commands => {
            match (w.parse::<usize>(), ms.parse::<u64>()) {
                (Ok(w), Ok(ms)) if w < shared.settings.threads && w != rt.worker => {
                    rt.outbox[w].push(Envelope::Ctl(crate::msg::CtlCmd::Stall { ms }));
                    output.buf().extend_from_slice(text::OK);
                }
                _ => output.buf().extend_from_slice(b"CLIENT_ERROR usage: mbal debug stall <other worker> <ms>\r\n"),
            }
            Action::None
        }
        // A worker that panics (`life`: the process must not carry on without it).
        #[cfg(feature = "test-hooks")]
        (Some("debug"), Some("panic"), None, None) if shared.settings.debug_commands => {
            panic!("mbal debug panic on worker {}", rt.worker)
        }
        _ => {
            output.buf().extend_from_slice(
                b"CLIENT_ERROR unknown mbal command (hello <epoch> | map | load [<after>] | peer [<answer>] | move <cachelet> <worker>)\r\n",
            );
            Action::None
        }
    }
}
