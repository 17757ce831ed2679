//! Dialing a cluster member: the one place mbal's own connections to its
//! servers are opened (the Phase 1 replicator, the `--forward` forwarder,
//! the proxy's upstreams). A [`Dialer`] connects with a timeout, runs the
//! TLS handshake when the cluster uses TLS ([`mbal_tls::dial`]) and logs in:
//!
//! * a text connection with the cluster secret (the `mbal peer` challenge,
//!   [`crate::peer_auth`]) when it has one — a server with `-Y` takes that
//!   as the connection's login — else with a user and password
//!   (memcached's ASCII auth, a `set` whose data is `user password`);
//! * a binary connection likewise: the challenge over SASL (mechanism
//!   [`PEER_SASL_MECH`]) with the secret, else SASL PLAIN with a user.
//!
//! The result is a blocking stream; an event loop takes it over with
//! [`Dialer::dial_nonblocking`].

use crate::peer_auth::{self, Secret};
use mbal_tls::{BlockingStream, ClientTls, Stream};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// The SASL mechanism of the `mbal peer` challenge on a binary connection:
/// `SASL_AUTH` answers status 0x21 (continue) with the nonce's hex,
/// `SASL_STEP` carries the answer's hex (docs/protocol.md).
pub const PEER_SASL_MECH: &[u8] = b"MBAL-PEER";

/// A user and password for servers started with `-Y` (neither may contain a
/// space). Its `Debug` form shows the user only.
#[derive(Clone, PartialEq, Eq)]
pub struct UserLogin {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for UserLogin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UserLogin({:?}, ..)", self.user)
    }
}

/// Which protocol the connection will speak (it decides the login).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Text,
    Binary,
}

/// How mbal connects to the members of a cluster.
#[derive(Clone, Debug)]
pub struct Dialer {
    pub tls: Option<ClientTls>,
    pub secret: Option<Secret>,
    pub user: Option<UserLogin>,
    /// The connect's, the handshake's and the login's time limit.
    pub timeout: Duration,
}

impl Dialer {
    pub fn plain(timeout: Duration) -> Dialer {
        Dialer { tls: None, secret: None, user: None, timeout }
    }

    /// Is there more to a connection than a TCP connect (TLS or a login)?
    /// Event loops connect without blocking when there is not.
    pub fn is_plain(&self, proto: Proto) -> bool {
        self.tls.is_none()
            && match proto {
                Proto::Text => self.secret.is_none() && self.user.is_none(),
                Proto::Binary => self.secret.is_none() && self.user.is_none(),
            }
    }

    /// Connect, handshake and log in (blocking, each step within `timeout`).
    pub fn dial(&self, addr: SocketAddr, proto: Proto) -> io::Result<BlockingStream> {
        let mut s = mbal_tls::dial(addr, self.tls.as_ref(), self.timeout)?;
        match proto {
            Proto::Text => {
                if let Some(secret) = &self.secret {
                    peer_login(&mut s, secret)?;
                } else if let Some(u) = &self.user {
                    ascii_login(&mut s, u)?;
                }
            }
            Proto::Binary => {
                if let Some(secret) = &self.secret {
                    sasl_peer_login(&mut s, secret)?;
                } else if let Some(u) = &self.user {
                    sasl_login(&mut s, u)?;
                }
            }
        }
        Ok(s)
    }

    /// [`Dialer::dial`], then the socket made non-blocking for an event loop
    /// (its TLS session goes with it).
    pub fn dial_nonblocking(&self, addr: SocketAddr, proto: Proto) -> io::Result<Stream<TcpStream>> {
        let s = self.dial(addr, proto)?.into_stream();
        s.sock().set_nonblocking(true)?;
        Ok(s)
    }
}

/// Read one reply line (through `\n`). Used only where one line is the
/// whole of what the server has to say, so nothing past it is read.
fn read_line(s: &mut impl Read) -> io::Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.last() != Some(&b'\n') {
        if line.len() > 1024 {
            return Err(io::Error::other("reply line too long"));
        }
        match s.read(&mut b)? {
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed during login")),
            _ => line.push(b[0]),
        }
    }
    Ok(String::from_utf8_lossy(&line).into_owned())
}

/// The `mbal peer` challenge, answered with the cluster secret.
pub fn peer_login(s: &mut (impl Read + Write), secret: &Secret) -> io::Result<()> {
    s.write_all(peer_auth::HELLO)?;
    s.flush()?;
    let nonce = read_line(s)?;
    let answer = peer_auth::answer_line(secret, nonce.trim_end()).map_err(io::Error::other)?;
    s.write_all(answer.as_bytes())?;
    s.flush()?;
    let line = read_line(s)?;
    if line != "OK\r\n" {
        return Err(io::Error::other(format!("peer authentication refused: {:?}", line.trim_end())));
    }
    Ok(())
}

/// memcached's ASCII authentication.
pub fn ascii_login(s: &mut (impl Read + Write), u: &UserLogin) -> io::Result<()> {
    let token = format!("{} {}", u.user, u.password);
    s.write_all(format!("set auth 0 0 {}\r\n{token}\r\n", token.len()).as_bytes())?;
    s.flush()?;
    let line = read_line(s)?;
    if line != "STORED\r\n" {
        return Err(io::Error::other(format!("login refused: {:?}", line.trim_end())));
    }
    Ok(())
}

/// One SASL request (`opcode`, mechanism `mech`, `value`); the response's
/// status and value.
fn sasl_exchange(s: &mut (impl Read + Write), opcode: u8, mech: &[u8], value: &[u8]) -> io::Result<(u16, Vec<u8>)> {
    let total = (mech.len() + value.len()) as u32;
    let mut req = vec![0x80, opcode, 0, mech.len() as u8, 0, 0, 0, 0];
    req.extend_from_slice(&total.to_be_bytes());
    req.extend_from_slice(&[0; 12]);
    req.extend_from_slice(mech);
    req.extend_from_slice(value);
    s.write_all(&req)?;
    s.flush()?;
    let mut h = [0u8; 24];
    s.read_exact(&mut h)?;
    let len = u32::from_be_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if h[0] != 0x81 || len > 4096 {
        return Err(io::Error::other("not a SASL response"));
    }
    let mut rest = vec![0u8; len];
    s.read_exact(&mut rest)?;
    let skip = (h[4] as usize + u16::from_be_bytes([h[2], h[3]]) as usize).min(len);
    Ok((u16::from_be_bytes([h[6], h[7]]), rest.split_off(skip)))
}

/// SASL PLAIN on a binary connection.
pub fn sasl_login(s: &mut (impl Read + Write), u: &UserLogin) -> io::Result<()> {
    let mut body = vec![0u8];
    body.extend_from_slice(u.user.as_bytes());
    body.push(0);
    body.extend_from_slice(u.password.as_bytes());
    match sasl_exchange(s, 0x21, b"PLAIN", &body)? {
        (0, _) => Ok(()),
        (status, _) => Err(io::Error::other(format!("SASL login refused (status {status:#x})"))),
    }
}

/// The `mbal peer` challenge over SASL on a binary connection.
pub fn sasl_peer_login(s: &mut (impl Read + Write), secret: &Secret) -> io::Result<()> {
    let (status, nonce) = sasl_exchange(s, 0x21, PEER_SASL_MECH, &[])?;
    if status != 0x21 {
        return Err(io::Error::other(format!("peer SASL login refused (status {status:#x})")));
    }
    let nonce = String::from_utf8_lossy(&nonce).into_owned();
    let answer = peer_auth::response(secret, &nonce).ok_or_else(|| io::Error::other("bad nonce"))?;
    match sasl_exchange(s, 0x22, PEER_SASL_MECH, answer.as_bytes())? {
        (0, _) => Ok(()),
        (status, _) => Err(io::Error::other(format!("peer SASL login refused (status {status:#x})"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake server side: what was written, and canned replies.
    struct Fake {
        input: io::Cursor<Vec<u8>>,
        out: Vec<u8>,
    }
    impl Read for Fake {
        fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
            self.input.read(b)
        }
    }
    impl Write for Fake {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.out.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn logins_send_what_servers_expect() {
        let u = UserLogin { user: "app".into(), password: "pw".into() };
        let mut f = Fake { input: io::Cursor::new(b"STORED\r\n".to_vec()), out: Vec::new() };
        ascii_login(&mut f, &u).unwrap();
        assert_eq!(f.out, b"set auth 0 0 6\r\napp pw\r\n");
        let mut f = Fake { input: io::Cursor::new(b"CLIENT_ERROR authentication failure\r\n".to_vec()), out: vec![] };
        assert!(ascii_login(&mut f, &u).unwrap_err().to_string().contains("authentication failure"));

        let secret = Secret::new(b"0123456789abcdef-cluster".to_vec()).unwrap();
        let mut f = Fake { input: io::Cursor::new(b"NONCE 00ff\r\nOK\r\n".to_vec()), out: vec![] };
        peer_login(&mut f, &secret).unwrap();
        let want = peer_auth::answer_line(&secret, "NONCE 00ff").unwrap();
        assert_eq!(f.out, [peer_auth::HELLO, want.as_bytes()].concat());

        let mut ok = vec![0x81, 0x21, 0, 0, 0, 0, 0, 0, 0, 0, 0, 13];
        ok.extend_from_slice(&[0; 12]);
        ok.extend_from_slice(b"Authenticated");
        let mut f = Fake { input: io::Cursor::new(ok.clone()), out: vec![] };
        sasl_login(&mut f, &u).unwrap();
        assert_eq!(&f.out[24..], b"PLAIN\0app\0pw");
        ok[7] = 0x20;
        let mut f = Fake { input: io::Cursor::new(ok), out: vec![] };
        assert!(sasl_login(&mut f, &u).is_err());
    }

    #[test]
    fn plainness_decides_the_connect() {
        let mut d = Dialer::plain(Duration::from_secs(1));
        assert!(d.is_plain(Proto::Text) && d.is_plain(Proto::Binary));
        d.secret = Some(Secret::new(b"0123456789abcdef-cluster".to_vec()).unwrap());
        assert!(!d.is_plain(Proto::Text) && !d.is_plain(Proto::Binary));
        d.secret = None;
        d.user = Some(UserLogin { user: "u".into(), password: "p".into() });
        assert!(!d.is_plain(Proto::Text) && !d.is_plain(Proto::Binary));
    }
}
