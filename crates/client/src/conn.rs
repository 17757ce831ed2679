//! One blocking TCP connection (plain or TLS) to an mbal worker (or server
//! main port) with its reply parser, and the mapping of I/O failures to
//! [`Error`].

use crate::{Error, Peer, Result};
use mbal_proto::client::{Expect, OwnedHint, Reply, ReplyReader};
use mbal_tls::{BlockingStream, ClientTls};
use std::io::{self, Write};
use std::net::SocketAddr;
use std::time::Duration;

pub(crate) struct Conn {
    stream: BlockingStream,
    parser: ReplyReader,
    pub addr: SocketAddr,
    pub peer: Peer,
    /// Taken from a pool (it served earlier requests): a server that restarted or closed it
    /// idle shows as a closed connection, which says nothing about the server until a fresh
    /// connection is tried.
    pub reused: bool,
}

/// Did a request fail because the server could not be reached (refused, reset, closed,
/// timed out; not a bad reply, a refusal or a TLS error)?
pub(crate) fn unreachable(e: &Error) -> bool {
    match e {
        Error::Timeout { .. } | Error::Unreachable { .. } => true,
        Error::Io { source, .. } => mbal_cluster::unreachable_kind(source.kind()),
        _ => false,
    }
}

/// Did a request fail because its connection was closed or reset by the server?
pub(crate) fn was_closed(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if mbal_cluster::closed_kind(source.kind()))
}

fn io_err(addr: SocketAddr, peer: Peer, e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::Timeout { addr, peer },
        _ => Error::Io { addr, peer, source: e },
    }
}

impl Conn {
    /// Connect with `connect_timeout`; reads and writes (and the TLS
    /// handshake, with `tls`) time out after `io_timeout`.
    pub fn open(
        addr: SocketAddr,
        peer: Peer,
        connect_timeout: Duration,
        io_timeout: Duration,
        tls: Option<&ClientTls>,
    ) -> Result<Conn> {
        let stream =
            mbal_tls::dial_timeouts(addr, tls, connect_timeout, io_timeout).map_err(|e| io_err(addr, peer, e))?;
        Ok(Conn { stream, parser: ReplyReader::new(), addr, peer, reused: false })
    }

    /// Over a stream already connected (and logged in) to `addr`.
    pub fn from_stream(stream: BlockingStream, addr: SocketAddr, peer: Peer) -> Conn {
        Conn { stream, parser: ReplyReader::new(), addr, peer, reused: false }
    }

    /// Authenticate first, if the client has a login (memcached's ASCII auth).
    pub fn login(&mut self, login: Option<&crate::Login>) -> Result<()> {
        let Some(login) = login else { return Ok(()) };
        match self.call(&login.request(), Expect::Line)? {
            Reply::Stored => Ok(()),
            Reply::Error(line) => Err(crate::Error::Server { addr: self.addr, peer: self.peer, line }),
            r => Err(self.unexpected("the login", &r)),
        }
    }

    pub fn send(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream.write_all(bytes).map_err(|e| io_err(self.addr, self.peer, e))
    }

    /// Read one complete reply. A malformed stream or EOF is an error (the
    /// caller drops the connection).
    pub fn read_reply(&mut self, expect: Expect) -> Result<Reply> {
        loop {
            match self.parser.next(expect) {
                Ok(Some(r)) => return Ok(r),
                Ok(None) => {}
                Err(e) => return Err(Error::Protocol { addr: self.addr, peer: self.peer, detail: e.0 }),
            }
            match self.parser.read_from(&mut self.stream) {
                Ok(0) => {
                    return Err(Error::Io {
                        addr: self.addr,
                        peer: self.peer,
                        source: io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed by the server"),
                    })
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(self.addr, self.peer, e)),
            }
        }
    }

    /// The hot-key hints read since the last call (see
    /// [`ReplyReader::take_hints`]).
    pub fn take_hints(&mut self) -> Vec<OwnedHint> {
        self.parser.take_hints()
    }

    /// Send one request and read its reply.
    pub fn call(&mut self, req: &[u8], expect: Expect) -> Result<Reply> {
        self.send(req)?;
        self.read_reply(expect)
    }

    /// An error for a reply that is complete but not one the request allows.
    pub fn unexpected(&self, req: &str, r: &Reply) -> Error {
        Error::Protocol { addr: self.addr, peer: self.peer, detail: format!("unexpected reply {r:?} to {req}") }
    }

    /// The error of a reply that ends the use of this connection: a reply
    /// `req` cannot have, or the error reading it.
    pub fn failure(&self, req: &str, res: Result<Reply>) -> Error {
        match res {
            Ok(r) => self.unexpected(req, &r),
            Err(e) => e,
        }
    }
}
