//! A server that cannot be reached (docs/operations.md, "A dead server"): its backoff, the
//! errors and misses its keys get meanwhile, and the map fetched from another server so that
//! its keys reach their new owners ([`mbal_cluster::Health`] decides when).

use super::*;

impl Client {
    /// The error of a request for server `s`'s keys during its backoff.
    pub(super) fn in_backoff(&self, s: u16, w: u16) -> Error {
        let reason = self.down_reason.get(s as usize).map_or("", String::as_str);
        Error::Unreachable {
            addr: self.router.map().worker_addr(s, w),
            peer: Peer::Worker { server: s, worker: w },
            reason: format!("{reason} (not retried before its backoff ends)"),
        }
    }

    /// A request to (s, w) failed with `e`. If the server could not be reached, it is
    /// marked down for its backoff (the first failure, and each failed retry, also fetches
    /// the map from another server: [`Client::refresh_map`]) and `e` becomes
    /// [`Error::Unreachable`]; any other error is returned as it is.
    pub(super) fn server_failed(&mut self, s: u16, w: u16, e: Error) -> Error {
        if matches!(e, Error::Unreachable { .. }) || !conn::unreachable(&e) {
            return e;
        }
        let reason = e.to_string();
        let addr = self.router.map().worker_addr(s, w); // (before a refresh changes the map)
        self.stats.unreachable += 1;
        // A redirect to it from a server behind the map is done with (`Router`'s doc).
        self.router.forget_stale_redirects_to(s);
        let f = self.health.failed(s, Instant::now());
        if f.new_backoff {
            // Every pooled connection to that server's workers is as dead as this one: a
            // request after its backoff must not find one the server closed meanwhile (a write
            // on it would fail although the server is back).
            self.pools.retain(|&(ps, _), _| ps != s);
        }
        let i = s as usize;
        if self.down_reason.len() <= i {
            self.down_reason.resize(i + 1, String::new());
        }
        self.down_reason[i].clone_from(&reason);
        if f.refresh {
            self.refresh_map(s);
        }
        Error::Unreachable { addr, peer: Peer::Worker { server: s, worker: w }, reason }
    }

    /// A request on `conn` (to (s, w)) failed with `e` (the connection is dropped). A pooled
    /// connection the server closed says nothing about the server yet (it may have restarted,
    /// or closed it idle): a fresh connection decides, and is pooled when it opens (then `e`
    /// is returned as it is: the caller may resend a read; the other pooled connections to that
    /// worker are dropped, as old as this one). Otherwise [`Client::server_failed`].
    pub(super) fn conn_failed(&mut self, conn: Conn, e: Error) -> Error {
        let Peer::Worker { server: s, worker: w } = conn.peer else { return e };
        let reused = conn.reused;
        drop(conn);
        if reused && conn::was_closed(&e) {
            // its pool-mates are as old: let the fresh connection replace them all
            if let Some(pool) = self.pools.get_mut(&(s, w)) {
                pool.slots.iter_mut().for_each(|c| *c = None);
            }
            return match self.dial(s, w) {
                Ok(c) => {
                    self.put_conn(c);
                    e
                }
                Err(e2) => e2,
            };
        }
        self.server_failed(s, w, e)
    }

    /// Server `failed` could not be reached: ask another server of the map (one not in its
    /// backoff; at most two are tried) for the map, and install it if it is newer, so that
    /// keys the cluster gave to other servers go there. One at a time.
    pub(super) fn refresh_map(&mut self, failed: u16) {
        if self.refreshing {
            return;
        }
        self.refreshing = true;
        if self.coordinators.is_some() {
            self.stats.map_refreshes += 1;
            if self.map_from_coordinators() {
                self.refreshing = false;
                return;
            }
        }
        for _ in 0..2 {
            let Some(src) = self.health.map_source(self.router.map(), failed, Instant::now()) else { break };
            self.stats.map_refreshes += 1;
            let fetched = match self.take_conn(src, 0) {
                Ok(mut c) => match fetch_map(&mut c, Some(self.router.map().epoch())) {
                    Ok(m) => {
                        self.put_conn(c);
                        Ok(m)
                    }
                    Err(e) => Err(self.conn_failed(c, e)),
                },
                Err(e) => Err(e),
            };
            match fetched {
                Ok((epoch, m)) => {
                    let _ = self.take_map(epoch, m);
                    break;
                }
                Err(e) => {
                    if !matches!(e, Error::Unreachable { .. }) {
                        break; // a server that answered, wrongly: not the cluster's fault
                    }
                }
            }
        }
        self.refreshing = false;
    }

    /// An answer to `mbal map <epoch>`: its epoch, and the map if it was newer. The same
    /// epoch confirms the router's map (redirects from servers behind it are dropped); a map
    /// is installed ([`Client::install_map`]). Whether one was.
    pub(super) fn take_map(&mut self, epoch: u64, map: Option<ClusterMap>) -> std::result::Result<bool, String> {
        self.router.confirm_epoch(epoch);
        map.map_or(Ok(false), |m| self.install_map(m))
    }

    /// Install a map if it is newer than the router's (forgetting the failures of servers it
    /// changed). Whether it was.
    pub(super) fn install_map(&mut self, map: ClusterMap) -> std::result::Result<bool, String> {
        let old = self.router.map().servers().to_vec();
        let installed = self.router.install_map(map)?;
        if installed {
            self.stats.maps_installed += 1;
            if self.health.any_down() {
                self.health.map_changed(&old, self.router.map().servers());
            }
        }
        Ok(installed)
    }
}
