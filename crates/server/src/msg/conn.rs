//! Connections changing worker: one accepted on the main port, or a routed one handed
//! over by the worker that had it. With their payloads: the connection's authentication
//! state travels with it.

use mbal_member::peer_auth::NONCE_LEN;

/// A connection changing worker.
pub(crate) enum ConnMsg {
    /// A connection accepted on the main port, handed to this worker.
    Accepted(std::net::TcpStream, std::net::SocketAddr),
    /// A routed connection handed over by the worker that had it (`mbal
    /// hello <epoch> <worker>`): serve it here, answer its hello first.
    HandOff(Box<HandOff>),
    /// The server's own admin connection (`StatsConnector`, the metrics endpoint): plain
    /// even with `-Z`, logged in even with `-Y`; counted in `curr_conns` by its maker.
    Internal(std::net::TcpStream, std::net::SocketAddr),
}

/// Where a connection is in the control-plane handshake.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Peer {
    #[default]
    None,
    /// Sent `NONCE`; the next `mbal peer <answer>` is checked against it.
    Challenged([u8; NONCE_LEN]),
    /// Proved it knows the cluster secret.
    Ok,
}

/// A connection's authentication state (travels with it on a hand-over).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ConnAuth {
    /// Data plane: may send requests (always, without `-Y`).
    pub authenticated: bool,
    pub peer: Peer,
}

/// A connection changing worker, with what it had read but not served.
pub(crate) struct HandOff {
    /// The socket with its TLS state, if any (a TLS session moves whole).
    pub sock: mbal_tls::Stream<std::net::TcpStream>,
    pub peer: std::net::SocketAddr,
    pub listen_addr: std::net::SocketAddr,
    pub id: u64,
    pub unread: Vec<u8>,
    pub auth: ConnAuth,
    /// Exempt from the emulated capacity (a peer's replicator), and not yet
    /// past its admin commands (see `Conn::fresh`).
    pub exempt: bool,
    pub fresh: bool,
    /// Asked to be served its worker's thread-mates' keys too (`mbal hello ... threads`).
    pub by_thread: bool,
}
