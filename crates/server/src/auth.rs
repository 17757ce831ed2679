//! Authentication: who may use a connection, and for what.
//!
//! * **Data plane** (`-Y FILE`, memcached's `user:password` lines): a text
//!   connection's first request must be memcached's ASCII authentication
//!   (a `set` whose data is `username password`, parsed by
//!   [`mbal_proto::auth`]); a binary connection authenticates with SASL PLAIN
//!   (`SASL_LIST_MECHS`, `SASL_AUTH`), checked against the same file. Until
//!   then a text connection gets `CLIENT_ERROR unauthenticated` for every
//!   request and a binary one an auth error (status 0x20) and a close.
//! * **Control plane** (`mbal move`, `mbal debug`, `mbal replica`, ...:
//!   [`mbal_member::peer_auth::is_control`]): accepted only from a
//!   connection that answered the `mbal peer` challenge with the cluster
//!   secret. Without a secret, only on a loopback listener with `-Y` off
//!   (a single test or development server, as before).
//!
//! The parsing is in `mbal_proto::auth`, the routing of an unauthenticated
//! connection's input in `worker/conn.rs` and `dispatch`, the decisions and
//! their replies here.

use crate::config::Settings;
use crate::counters::Counters;
use crate::output::Output;
use mbal_member::peer_auth;
#[cfg(test)]
use mbal_member::peer_auth::Secret;
use mbal_proto::auth::{parse_ascii_auth, AsciiAuth, E_AUTH_FAILURE, SASL_MECHS};
use mbal_proto::binary::{opcode as op, status as st, write_response, BinReq};

pub use crate::credentials::Credentials;

/// A connection's authentication state and its handshake (their types
/// travel with a connection that changes worker: `crate::msg::conn`).
pub(crate) use crate::msg::{ConnAuth, Peer};

impl ConnAuth {
    pub fn new(settings: &Settings) -> ConnAuth {
        ConnAuth { authenticated: settings.auth.is_none(), peer: Peer::None }
    }
}

/// What an unauthenticated text connection's input came to.
pub(crate) enum AsciiStep {
    NeedMore,
    /// `n` bytes were answered (and consumed).
    Consumed(usize),
    /// Close without a reply.
    Close,
}

/// One step of ASCII authentication on an unauthenticated text connection.
pub(crate) fn ascii_step(
    settings: &Settings,
    counters: &mut Counters,
    auth: &mut ConnAuth,
    buf: &[u8],
    out: &mut Vec<u8>,
) -> AsciiStep {
    // A cluster member logs in with the cluster secret (`mbal peer`), which
    // is accepted before a -Y login and counts as one.
    if settings.control_secret.is_some() && buf.starts_with(b"mbal peer") {
        let Some(nl) = buf.iter().position(|&b| b == b'\n') else {
            return if buf.len() > 256 { AsciiStep::Close } else { AsciiStep::NeedMore };
        };
        let line = String::from_utf8_lossy(&buf[..nl]);
        let mut it = line.split_whitespace();
        if let (Some("mbal"), Some("peer"), answer, None) = (it.next(), it.next(), it.next(), it.next()) {
            peer_step(settings, counters, auth, answer, out);
            if auth.peer == Peer::Ok {
                auth.authenticated = true;
            }
            return AsciiStep::Consumed(nl + 1);
        }
    }
    match parse_ascii_auth(buf) {
        AsciiAuth::NeedMore => AsciiStep::NeedMore,
        AsciiAuth::Close => AsciiStep::Close,
        AsciiAuth::Refuse { reply, consumed } => {
            out.extend_from_slice(reply);
            AsciiStep::Consumed(consumed)
        }
        AsciiAuth::Creds { user, pass, consumed } => {
            counters.auth_cmds += 1;
            if settings.auth.as_ref().is_some_and(|c| c.check(user, pass)) {
                auth.authenticated = true;
                out.extend_from_slice(mbal_proto::text::STORED);
            } else {
                counters.auth_errors += 1;
                out.extend_from_slice(E_AUTH_FAILURE);
            }
            AsciiStep::Consumed(consumed)
        }
    }
}

/// The SASL mechanism a cluster member logs in with on a binary connection
/// (the `mbal peer` challenge; not listed by SASL_LIST_MECHS).
pub const PEER_MECH: &[u8] = mbal_member::dial::PEER_SASL_MECH;

/// Binary requests an unauthenticated connection may send (memcached's list).
pub(crate) fn bin_allowed_before_auth(opcode: u8) -> bool {
    matches!(opcode, op::SASL_LIST_MECHS | op::SASL_AUTH | op::SASL_STEP | op::VERSION)
}

/// The answer to a binary request before authentication: an auth error,
/// then the connection closes (memcached).
pub(crate) fn bin_unauthenticated(req: &BinReq, out: &mut Vec<u8>) {
    let h = &req.header;
    write_response(out, h.opcode, st::AUTH_ERROR, h.opaque, 0, &[], &[], b"Auth failure.");
}

/// SASL_LIST_MECHS, SASL_AUTH (PLAIN) and SASL_STEP.
pub(crate) fn sasl(settings: &Settings, counters: &mut Counters, auth: &mut ConnAuth, req: &BinReq, out: &mut Vec<u8>) {
    let h = &req.header;
    if matches!(h.opcode, op::SASL_AUTH | op::SASL_STEP) && req.key == PEER_MECH && settings.control_secret.is_some() {
        // A cluster member (`mbal peer` over SASL, unadvertised; with or
        // without -Y): SASL_AUTH gets the nonce (status "continue"),
        // SASL_STEP the answer.
        let answer = (h.opcode == op::SASL_STEP).then(|| String::from_utf8_lossy(req.value).into_owned());
        let mut line = Vec::new();
        peer_step(settings, counters, auth, answer.as_deref(), &mut line);
        if let Some(hex) = line.strip_prefix(b"NONCE ") {
            let hex = hex.strip_suffix(b"\r\n").unwrap_or(hex);
            write_response(out, h.opcode, st::AUTH_CONTINUE, h.opaque, 0, &[], &[], hex);
        } else if auth.peer == Peer::Ok {
            auth.authenticated = true;
            write_response(out, h.opcode, st::NO_ERROR, h.opaque, 0, &[], &[], b"Authenticated");
        } else {
            write_response(out, h.opcode, st::AUTH_ERROR, h.opaque, 0, &[], &[], b"Auth failure.");
        }
        return;
    }
    let Some(creds) = &settings.auth else {
        // SASL is off: memcached answers unknown command.
        write_response(out, h.opcode, st::UNKNOWN_COMMAND, h.opaque, 0, &[], &[], b"Unknown command");
        return;
    };
    match h.opcode {
        op::SASL_LIST_MECHS => write_response(out, h.opcode, st::NO_ERROR, h.opaque, 0, &[], &[], SASL_MECHS),
        op::SASL_AUTH if req.key == SASL_MECHS => {
            counters.auth_cmds += 1;
            match mbal_proto::auth::sasl_plain(req.value) {
                Some((user, pass)) if creds.check(user, pass) => {
                    auth.authenticated = true;
                    write_response(out, h.opcode, st::NO_ERROR, h.opaque, 0, &[], &[], b"Authenticated");
                }
                _ => {
                    counters.auth_errors += 1;
                    write_response(out, h.opcode, st::AUTH_ERROR, h.opaque, 0, &[], &[], b"Auth failure.");
                }
            }
        }
        // Another mechanism, or a step (PLAIN has none): an auth error.
        _ => {
            counters.auth_cmds += 1;
            counters.auth_errors += 1;
            write_response(out, h.opcode, st::AUTH_ERROR, h.opaque, 0, &[], &[], b"Auth failure.");
        }
    }
}

/// May this connection send control commands? `Err` is the reply line.
pub(crate) fn control_allowed(settings: &Settings, auth: &ConnAuth) -> Result<(), &'static [u8]> {
    match &settings.control_secret {
        Some(_) if auth.peer == Peer::Ok => Ok(()),
        Some(_) => Err(b"CLIENT_ERROR control command refused: not an authenticated cluster peer (mbal peer)\r\n"),
        None if settings.auth.is_some() => Err(
            b"CLIENT_ERROR control command refused: -Y is on and no control secret is set (--control-secret-file, or secret in the cluster file)\r\n",
        ),
        None if settings.listen.is_loopback() => Ok(()),
        None => Err(
            b"CLIENT_ERROR control command refused: no control secret on a non-loopback listener (--control-secret-file, or secret in the cluster file)\r\n",
        ),
    }
}

/// `mbal peer [<answer>]`: the control-plane handshake.
pub(crate) fn peer(
    settings: &Settings,
    counters: &mut Counters,
    auth: &mut ConnAuth,
    answer: Option<&str>,
    out: &mut Output,
) {
    peer_step(settings, counters, auth, answer, out.buf());
}

fn peer_step(
    settings: &Settings,
    counters: &mut Counters,
    auth: &mut ConnAuth,
    answer: Option<&str>,
    out: &mut Vec<u8>,
) {
    let Some(secret) = &settings.control_secret else {
        out.extend_from_slice(
            b"CLIENT_ERROR no control secret is set on this server (--control-secret-file, or secret in the cluster file)\r\n",
        );
        return;
    };
    match answer {
        None => {
            let nonce = peer_auth::new_nonce();
            auth.peer = Peer::Challenged(nonce);
            out.extend_from_slice(b"NONCE ");
            out.extend_from_slice(peer_auth::to_hex(&nonce).as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Some(answer) => {
            counters.peer_auth_cmds += 1;
            // A nonce is good for one answer.
            let ok = match std::mem::take(&mut auth.peer) {
                Peer::Challenged(nonce) => peer_auth::verify(secret, &nonce, answer),
                Peer::Ok | Peer::None => false,
            };
            if ok {
                auth.peer = Peer::Ok;
                out.extend_from_slice(mbal_proto::text::OK);
            } else {
                counters.peer_auth_errors += 1;
                out.extend_from_slice(b"CLIENT_ERROR bad peer credentials\r\n");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auth_file_format() {
        let c = Credentials::parse(b"foo:bar\r\nbaaaz:quux\n\nc:pa:ss").unwrap();
        assert!(c.check(b"foo", b"bar"));
        assert!(c.check(b"baaaz", b"quux"));
        assert!(c.check(b"c", b"pa:ss"), "the password runs to the line end");
        assert!(!c.check(b"foo", b"bab"));
        assert!(!c.check(b"foo", b"ba"));
        assert!(!c.check(b"fo", b"bar"));
        assert!(!c.check(b"", b""));
        assert!(Credentials::parse(b"foo:bar\nnocolon\n").is_err());
        assert!(Credentials::parse(b"\n\n").is_err());
        assert!(Credentials::parse(b":pass\n").is_err());
        assert_eq!(format!("{c:?}"), "Credentials(3 users)");
    }

    fn settings(secret: bool, auth: bool, listen: &str) -> Settings {
        Settings {
            control_secret: secret.then(|| Secret::new(b"0123456789abcdef".to_vec()).unwrap()),
            auth: auth.then(|| std::sync::Arc::new(Credentials::parse(b"u:p").unwrap())),
            listen: listen.parse().unwrap(),
            ..Settings::default()
        }
    }

    #[test]
    fn who_may_send_control_commands() {
        let peer = ConnAuth { authenticated: true, peer: Peer::Ok };
        let plain = ConnAuth { authenticated: true, peer: Peer::None };
        let challenged =
            ConnAuth { authenticated: true, peer: Peer::Challenged([0; mbal_member::peer_auth::NONCE_LEN]) };
        // With a secret: peers only, wherever the server listens.
        for listen in ["127.0.0.1", "0.0.0.0"] {
            assert!(control_allowed(&settings(true, false, listen), &peer).is_ok());
            assert!(control_allowed(&settings(true, false, listen), &plain).is_err());
            assert!(control_allowed(&settings(true, true, listen), &challenged).is_err());
        }
        // Without: loopback and no -Y only.
        assert!(control_allowed(&settings(false, false, "127.0.0.1"), &plain).is_ok());
        assert!(control_allowed(&settings(false, false, "::1"), &plain).is_ok());
        let e = control_allowed(&settings(false, false, "0.0.0.0"), &plain).unwrap_err();
        assert!(String::from_utf8_lossy(e).contains("--control-secret-file"));
        assert!(control_allowed(&settings(false, true, "127.0.0.1"), &plain).is_err());
    }

    #[test]
    fn peer_handshake_takes_one_answer_per_nonce() {
        let s = settings(true, false, "127.0.0.1");
        let mut c = Counters::default();
        let mut auth = ConnAuth::new(&s);
        let mut out = Output::default();
        peer(&s, &mut c, &mut auth, None, &mut out);
        let line = String::from_utf8(out.buf().clone()).unwrap();
        let answer = peer_auth::answer_line(s.control_secret.as_ref().unwrap(), line.trim_end()).unwrap();
        let hex = answer.trim_end().rsplit(' ').next().unwrap().to_string();
        let mut out = Output::default();
        peer(&s, &mut c, &mut auth, Some(&hex), &mut out);
        assert_eq!(out.buf().as_slice(), b"OK\r\n");
        assert_eq!(auth.peer, Peer::Ok);
        // Replaying the answer without a new challenge fails and drops the standing.
        let mut out = Output::default();
        peer(&s, &mut c, &mut auth, Some(&hex), &mut out);
        assert_eq!(out.buf().as_slice(), b"CLIENT_ERROR bad peer credentials\r\n");
        assert_eq!(auth.peer, Peer::None);
        assert_eq!((c.peer_auth_cmds, c.peer_auth_errors), (2, 1));
    }

    #[test]
    fn mbal_peer_is_a_login_before_ascii_auth() {
        let s = settings(true, true, "127.0.0.1");
        let mut c = Counters::default();
        let mut auth = ConnAuth::new(&s);
        assert!(!auth.authenticated);
        let mut out = Vec::new();
        assert!(matches!(ascii_step(&s, &mut c, &mut auth, b"mbal peer", &mut out), AsciiStep::NeedMore));
        let AsciiStep::Consumed(11) = ascii_step(&s, &mut c, &mut auth, b"mbal peer\r\nget x\r\n", &mut out) else {
            panic!("the challenge line is consumed")
        };
        let answer =
            peer_auth::answer_line(s.control_secret.as_ref().unwrap(), String::from_utf8_lossy(&out).trim_end())
                .unwrap();
        // A wrong answer is no login.
        let mut out = Vec::new();
        ascii_step(&s, &mut c, &mut auth, b"mbal peer 00\r\n", &mut out);
        assert_eq!(out, b"CLIENT_ERROR bad peer credentials\r\n");
        assert!(!auth.authenticated);
        let mut out = Vec::new();
        ascii_step(&s, &mut c, &mut auth, b"mbal peer\r\n", &mut out);
        let answer2 =
            peer_auth::answer_line(s.control_secret.as_ref().unwrap(), String::from_utf8_lossy(&out).trim_end())
                .unwrap();
        assert_ne!(answer, answer2, "a fresh nonce");
        let mut out = Vec::new();
        ascii_step(&s, &mut c, &mut auth, answer2.as_bytes(), &mut out);
        assert_eq!(out, b"OK\r\n");
        assert!(auth.authenticated && auth.peer == Peer::Ok);
        // Without a secret `mbal peer` is just an unauthenticated request.
        let s = settings(false, true, "127.0.0.1");
        let mut auth = ConnAuth::new(&s);
        let mut out = Vec::new();
        ascii_step(&s, &mut c, &mut auth, b"mbal peer\r\n", &mut out);
        assert_eq!(out, mbal_proto::auth::E_UNAUTHENTICATED);
    }
}
