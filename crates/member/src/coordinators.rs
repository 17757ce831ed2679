//! The cluster map from the coordinators (`mbal coordinator`), for the clients of the cluster
//! (the proxy's threads, the routing client): the coordinator numbers the map's epochs, and a
//! server hears of a new epoch only at its next heartbeat, so just after a commit a server's
//! `mbal map` can be behind the coordinator's. Coordinators sharing etcd all answer `mbal map`
//! (a standby shows what etcd holds); the one that answered last is asked first ([`Link`]).
//! Blocking, each connect, read and write bounded by [`Coordinators::timeout`].

use crate::call::MemberConn;
use mbal_proto::client::Reply;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

/// Where the coordinators are and how to reach them.
#[derive(Clone, Debug)]
pub struct Coordinators {
    pub addrs: Vec<SocketAddr>,
    /// The cluster's client TLS (coordinators listen with TLS where the cluster file has it).
    pub tls: Option<mbal_tls::ClientTls>,
    /// Bounds each connect, and each read and write.
    pub timeout: Duration,
}

/// One connection kept to the coordinator that answered last (none at first).
#[derive(Default)]
pub struct Link {
    at: usize,
    conn: Option<MemberConn>,
}

impl Coordinators {
    /// `mbal map [<have>]` from the coordinators, starting with `link.at` and trying each
    /// once: the answer's epoch and JSON, empty if `have` is given and the map is no newer
    /// than that. A connection that fails is dropped and the next one tried.
    pub fn fetch_with(&self, link: &mut Link, have: Option<u64>) -> io::Result<(u64, Vec<u8>)> {
        let n = self.addrs.len();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no coordinator is named");
        for k in 0..n {
            let i = (link.at + k) % n;
            if link.at != i {
                link.conn = None;
            }
            link.at = i;
            match self.ask(link, have) {
                Ok(json) => return Ok(json),
                Err(e) => {
                    tracing::debug!(coordinator = %self.addrs[i], "mbal map from a coordinator: {e}");
                    link.conn = None;
                    last = e;
                }
            }
        }
        Err(last)
    }

    fn ask(&self, link: &mut Link, have: Option<u64>) -> io::Result<(u64, Vec<u8>)> {
        if link.conn.is_none() {
            let s = mbal_tls::dial_timeouts(self.addrs[link.at], self.tls.as_ref(), self.timeout, self.timeout)?;
            link.conn = Some(MemberConn::over(s));
        }
        let c = link.conn.as_mut().expect("connected above");
        match c.call(&mbal_proto::ext::map_request(have))? {
            Reply::Map { epoch, json } => Ok((epoch, json)),
            other => {
                Err(io::Error::new(io::ErrorKind::InvalidData, format!("unexpected answer to mbal map: {other:?}")))
            }
        }
    }

    /// The map's JSON, once, from the first coordinator that answers (a start).
    pub fn fetch(&self) -> io::Result<Vec<u8>> {
        self.fetch_with(&mut Link::default(), None).map(|(_, json)| json)
    }
}
