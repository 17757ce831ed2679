//! mbal's TLS, with rustls (the `ring` provider), shared by the server, the
//! routing client, the bench and `mbal stats`.
//!
//! * [`ServerTlsFiles`] / [`ServerTls`]: a server's certificate chain, key and
//!   client-certificate policy (memcached's `-o ssl_chain_cert`, `ssl_key`,
//!   `ssl_ca_cert`, `ssl_verify_mode`), loaded from PEM files, and reloaded on
//!   request: connections accepted after a reload use the new files, those
//!   already open keep what they started with.
//! * [`ClientTlsFiles`] / [`ClientTls`]: the CA a client trusts, its optional
//!   certificate and key, and the name it expects the server to have.
//! * [`Stream`]: a socket that is either plain or TLS, for non-blocking
//!   (mio) event loops. Its TLS read fills the buffer until the socket would
//!   block, so a short read means the socket is drained, as with a plain
//!   socket under edge-triggered polling.
//! * [`BlockingStream`]: the same for blocking sockets (the routing client).
//!
//! The plain path costs one enum match per read or write call.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection, StreamOwned};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub use rustls;

#[cfg(feature = "test-certs")]
pub mod test_certs;

/// The crypto provider every mbal TLS configuration uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_file(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

/// Every certificate in a PEM file, in order (a chain: leaf first).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read_file(path, "certificate file")?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("certificate file {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("certificate file {}: no CERTIFICATE in it", path.display()));
    }
    Ok(certs)
}

/// The first private key (PKCS#8, PKCS#1 or SEC1) in a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let pem = read_file(path, "key file")?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| format!("key file {}: no usable private key ({e})", path.display()))
}

/// A root store with every certificate of a PEM file.
pub fn load_roots(path: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(path)? {
        roots.add(c).map_err(|e| format!("CA file {}: {e}", path.display()))?;
    }
    Ok(roots)
}

/// Client-certificate verification, memcached's `ssl_verify_mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VerifyMode {
    /// 0: no client certificate asked for.
    #[default]
    None,
    /// 1 (memcached's "request"): asked for; a client without one is served,
    /// one with a certificate the CA did not sign is refused.
    Optional,
    /// 2 ("require") and 3 ("once"): a client must present a certificate
    /// signed by the CA.
    Required,
}

impl VerifyMode {
    /// From memcached's number (0..=3).
    pub fn from_memcached(n: u8) -> Result<VerifyMode, String> {
        match n {
            0 => Ok(VerifyMode::None),
            1 => Ok(VerifyMode::Optional),
            2 | 3 => Ok(VerifyMode::Required),
            _ => Err(format!("ssl_verify_mode must be 0, 1, 2 or 3 (got {n})")),
        }
    }
}

/// Where a server's TLS material lives (read again on every reload).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTlsFiles {
    /// PEM certificate chain, leaf first (`ssl_chain_cert`).
    pub chain_cert: PathBuf,
    /// PEM private key (`ssl_key`); `None`: the key is in `chain_cert`.
    pub key: Option<PathBuf>,
    /// PEM CA certificates that client certificates must chain to (`ssl_ca_cert`).
    pub ca_cert: Option<PathBuf>,
    pub verify_mode: VerifyMode,
    /// Refuse TLS 1.2 (memcached's `ssl_min_version=3`).
    pub tls13_only: bool,
}

impl ServerTlsFiles {
    /// Read the files into a rustls server configuration.
    pub fn load(&self) -> Result<Arc<ServerConfig>, String> {
        let chain = load_certs(&self.chain_cert)?;
        let key = load_key(self.key.as_deref().unwrap_or(&self.chain_cert))?;
        let versions: &[&rustls::SupportedProtocolVersion] =
            if self.tls13_only { &[&rustls::version::TLS13] } else { rustls::DEFAULT_VERSIONS };
        let builder = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(versions)
            .map_err(|e| e.to_string())?;
        let builder = match self.verify_mode {
            VerifyMode::None => builder.with_no_client_auth(),
            mode => {
                let ca = self.ca_cert.as_deref().ok_or("ssl_verify_mode 1..3 needs ssl_ca_cert (the client CA)")?;
                let roots = Arc::new(load_roots(ca)?);
                let v = WebPkiClientVerifier::builder_with_provider(roots, provider());
                let v = if mode == VerifyMode::Optional { v.allow_unauthenticated() } else { v };
                builder.with_client_cert_verifier(v.build().map_err(|e| format!("client CA: {e}"))?)
            }
        };
        let cfg = builder.with_single_cert(chain, key).map_err(|e| {
            format!("certificate {} and its key do not make a usable pair: {e}", self.chain_cert.display())
        })?;
        Ok(Arc::new(cfg))
    }
}

/// A server's TLS configuration, reloadable while it runs.
pub struct ServerTls {
    files: ServerTlsFiles,
    current: RwLock<Arc<ServerConfig>>,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls").field("files", &self.files).finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Load the files (an error names the file and what is wrong with it).
    pub fn new(files: ServerTlsFiles) -> Result<ServerTls, String> {
        let cfg = files.load()?;
        Ok(ServerTls { files, current: RwLock::new(cfg) })
    }

    pub fn files(&self) -> &ServerTlsFiles {
        &self.files
    }

    /// Read the files again. On success new connections use them; on an
    /// error the configuration in use stays.
    pub fn reload(&self) -> Result<(), String> {
        let cfg = self.files.load()?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = cfg;
        Ok(())
    }

    /// The server side of a new connection (taken once per accept).
    pub fn accept(&self) -> Result<ServerConnection, String> {
        let cfg = self.current.read().unwrap_or_else(|e| e.into_inner()).clone();
        ServerConnection::new(cfg).map_err(|e| e.to_string())
    }
}

/// Where a client's TLS material lives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTlsFiles {
    /// PEM CA certificates the server's certificate must chain to.
    pub ca_cert: PathBuf,
    /// PEM client certificate chain and key, for servers that ask for one.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// The name the server's certificate must carry; `None`: the IP address
    /// connected to (the certificate needs it as an IP SAN).
    pub server_name: Option<String>,
}

/// A client's TLS configuration (cheap to clone).
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls").field("server_name", &self.server_name).finish_non_exhaustive()
    }
}

impl ClientTls {
    pub fn load(files: &ClientTlsFiles) -> Result<ClientTls, String> {
        let roots = load_roots(&files.ca_cert)?;
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots);
        let config = match (&files.cert, &files.key) {
            (Some(cert), key) => {
                let chain = load_certs(cert)?;
                let key = load_key(key.as_deref().unwrap_or(cert))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| format!("client certificate: {e}"))?
            }
            (None, Some(_)) => return Err("a client key needs its certificate".into()),
            (None, None) => builder.with_no_client_auth(),
        };
        let server_name = match &files.server_name {
            Some(n) => Some(ServerName::try_from(n.clone()).map_err(|e| format!("server name {n:?}: {e}"))?),
            None => None,
        };
        Ok(ClientTls { config: Arc::new(config), server_name })
    }

    /// The client side of a connection to `addr`.
    pub fn connection(&self, addr: SocketAddr) -> io::Result<ClientConnection> {
        let name = self.server_name.clone().unwrap_or_else(|| ServerName::IpAddress(addr.ip().into()));
        ClientConnection::new(self.config.clone(), name).map_err(io::Error::other)
    }

    /// Run the handshake on a blocking socket (its timeouts apply).
    pub fn handshake(
        &self,
        mut sock: TcpStream,
        addr: SocketAddr,
    ) -> io::Result<StreamOwned<ClientConnection, TcpStream>> {
        let mut conn = self.connection(addr)?;
        while conn.is_handshaking() {
            match conn.complete_io(&mut sock) {
                Ok((0, 0)) if conn.is_handshaking() => {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "TLS handshake: connection closed"))
                }
                Ok(_) => {}
                Err(e) => return Err(io::Error::new(e.kind(), format!("TLS handshake with {addr}: {e}"))),
            }
        }
        Ok(StreamOwned::new(conn, sock))
    }
}

/// A connection's TLS state and its socket.
pub struct TlsStream<S> {
    pub conn: Connection,
    pub sock: S,
    eof: bool,
}

impl<S: Read + Write> TlsStream<S> {
    pub fn new(conn: impl Into<Connection>, sock: S) -> TlsStream<S> {
        TlsStream { conn: conn.into(), sock, eof: false }
    }

    /// Write pending TLS records until the socket would block.
    fn flush_tls(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut self.sock) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut filled = 0;
        while filled < buf.len() {
            match self.conn.reader().read(&mut buf[filled..]) {
                // Closed cleanly (close_notify): what was read, then EOF.
                Ok(0) => return Ok(filled),
                Ok(n) => {
                    filled += n;
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && !self.eof => {}
                Err(e) => {
                    return if filled > 0 {
                        Ok(filled)
                    } else if e.kind() == io::ErrorKind::WouldBlock {
                        Ok(0)
                    } else {
                        Err(e)
                    }
                }
            }
            match self.conn.read_tls(&mut self.sock) {
                Ok(0) => self.eof = true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return if filled > 0 { Ok(filled) } else { Err(e) };
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if let Err(e) = self.conn.process_new_packets() {
                // Send the alert that says why, then fail the connection.
                let _ = self.flush_tls();
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
            // Handshake messages and the like.
            self.flush_tls()?;
        }
        Ok(filled)
    }

    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut n = self.conn.writer().write(buf)?;
        self.flush_tls()?;
        if n == 0 && !buf.is_empty() {
            // rustls' buffer was full: the flush may have made room.
            n = self.conn.writer().write(buf)?;
            if n == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.flush_tls()?;
        }
        Ok(n)
    }
}

/// A plain or TLS socket for a non-blocking event loop. See the crate docs.
pub enum Stream<S> {
    Plain(S),
    Tls(Box<TlsStream<S>>),
}

impl<S: Read + Write> Stream<S> {
    pub fn tls(conn: impl Into<Connection>, sock: S) -> Stream<S> {
        Stream::Tls(Box::new(TlsStream::new(conn, sock)))
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    pub fn sock(&self) -> &S {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(t) => &t.sock,
        }
    }

    pub fn sock_mut(&mut self) -> &mut S {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(t) => &mut t.sock,
        }
    }

    /// The same stream over another type of socket (mio <-> std, to move a
    /// connection between event loops with its TLS state).
    pub fn map_sock<T>(self, f: impl FnOnce(S) -> T) -> Stream<T> {
        match self {
            Stream::Plain(s) => Stream::Plain(f(s)),
            Stream::Tls(t) => {
                let TlsStream { conn, sock, eof } = *t;
                Stream::Tls(Box::new(TlsStream { conn, sock: f(sock), eof }))
            }
        }
    }

    /// Read plaintext. A TLS read fills `buf` until the socket would block:
    /// fewer bytes than asked means the socket is drained. Ok(0): closed.
    /// A handshake or record error is an `InvalidData` error.
    #[inline]
    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }

    /// Write plaintext; TLS records go to the socket as far as it takes
    /// them, the rest waits in rustls (bounded) for [`Stream::flush_tls`].
    #[inline]
    pub fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(t) => t.write(buf),
        }
    }

    /// Whether TLS records wait for the socket to take them.
    #[inline]
    pub fn wants_write(&self) -> bool {
        match self {
            Stream::Plain(_) => false,
            Stream::Tls(t) => t.conn.wants_write(),
        }
    }

    /// Write waiting TLS records until the socket would block.
    #[inline]
    pub fn flush_tls(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(_) => Ok(()),
            Stream::Tls(t) => t.flush_tls(),
        }
    }

    /// Write `buf[*pos..]` until the socket would block (or is still connecting), advancing
    /// `pos`; once all of it is written, empty `buf`. Then write the TLS records the socket did
    /// not take yet. An error means the connection is broken. For a client's outgoing buffer
    /// in an event loop (the server's forwarder, the proxy's upstreams).
    pub fn write_pending(&mut self, buf: &mut Vec<u8>, pos: &mut usize) -> io::Result<()> {
        while *pos < buf.len() {
            match self.write(&buf[*pos..]) {
                Ok(n) => *pos += n,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::NotConnected) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if *pos == buf.len() {
            buf.clear();
            *pos = 0;
        }
        if self.wants_write() {
            self.flush_tls()?;
        }
        Ok(())
    }

    /// Say goodbye (TLS close_notify), best effort, before a close.
    pub fn close_notify(&mut self) {
        if let Stream::Tls(t) = self {
            t.conn.send_close_notify();
            let _ = t.flush_tls();
        }
    }
}

impl<S: Read + Write> Read for Stream<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Stream::read(self, buf)
    }
}

impl<S: Read + Write> Write for Stream<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Stream::write(self, buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.flush_tls()
    }
}

/// Open a blocking client connection to `addr`: TCP connect, no Nagle,
/// `timeout` on the connect and on every read and write (the handshake
/// included), then the TLS handshake with `tls`. The one place every mbal
/// component that dials a server (the replicator, the forwarder, the proxy,
/// `mbal_member::dial::Dialer`, the routing client, the bench, `mbal top`)
/// connects.
pub fn dial(addr: SocketAddr, tls: Option<&ClientTls>, timeout: Duration) -> io::Result<BlockingStream> {
    dial_timeouts(addr, tls, timeout, timeout)
}

/// [`dial`] with separate limits for the connect and for each read and
/// write (the handshake's included).
pub fn dial_timeouts(
    addr: SocketAddr,
    tls: Option<&ClientTls>,
    connect_timeout: Duration,
    io_timeout: Duration,
) -> io::Result<BlockingStream> {
    let sock = TcpStream::connect_timeout(&addr, connect_timeout)?;
    sock.set_nodelay(true)?;
    sock.set_read_timeout(Some(io_timeout))?;
    sock.set_write_timeout(Some(io_timeout))?;
    BlockingStream::new(sock, addr, tls)
}

/// A plain or TLS blocking client socket.
pub enum BlockingStream {
    Plain(TcpStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl BlockingStream {
    /// Over `sock`, connected to `addr`: plain, or TLS after a completed
    /// handshake.
    pub fn new(sock: TcpStream, addr: SocketAddr, tls: Option<&ClientTls>) -> io::Result<BlockingStream> {
        Ok(match tls {
            None => BlockingStream::Plain(sock),
            Some(t) => BlockingStream::Tls(Box::new(t.handshake(sock, addr)?)),
        })
    }

    pub fn sock(&self) -> &TcpStream {
        match self {
            BlockingStream::Plain(s) => s,
            BlockingStream::Tls(t) => &t.sock,
        }
    }

    /// For a move to an event loop: the socket and its TLS state.
    pub fn into_stream(self) -> Stream<TcpStream> {
        match self {
            BlockingStream::Plain(s) => Stream::Plain(s),
            BlockingStream::Tls(t) => {
                let StreamOwned { conn, sock } = *t;
                Stream::tls(conn, sock)
            }
        }
    }
}

impl Read for BlockingStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            BlockingStream::Plain(s) => s.read(buf),
            BlockingStream::Tls(t) => t.read(buf),
        }
    }
}

impl Write for BlockingStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            BlockingStream::Plain(s) => s.write(buf),
            BlockingStream::Tls(t) => t.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            BlockingStream::Plain(s) => s.flush(),
            BlockingStream::Tls(t) => t.flush(),
        }
    }
}

#[cfg(all(test, feature = "test-certs"))]
mod tests;
