//! Servers a routing caller could not reach, with no I/O and no clock: one
//! [`Health`] per routing client and per proxy thread (the caller passes the
//! time in), next to its [`Router`](crate::Router).
//!
//! The rule every caller applies when it cannot reach a server (a connect
//! refused or timed out, a connection reset or closed, a request unanswered
//! for the caller's timeout):
//!
//! * [`Health::failed`] marks the server down for a backoff, [`UNREACHABLE_BACKOFF_MIN`]
//!   doubling up to [`UNREACHABLE_BACKOFF_MAX`] on every failed retry. While it is down
//!   ([`Health::is_down`]) the caller answers that server's keys without
//!   touching the network: reads as misses, writes and other commands as an
//!   error naming the server. After the backoff the next request dials it
//!   again; an answer ([`Health::reachable`]) forgets the failure.
//! * A failure that starts a backoff (the first one, and each failed retry:
//!   at most once per backoff interval) returns `refresh: true`: the caller
//!   asks another server of its map for the map (`mbal map`; the server to
//!   ask is [`Health::map_source`], which skips servers that are down) and
//!   installs it if it is newer, so that keys the cluster gave to other
//!   servers go to their new owners.
//!
//! When nothing is down the caller's only cost is one branch per request
//! ([`Health::any_down`]).

use crate::{ClusterMap, ServerInfo};
use std::time::{Duration, Instant};

/// The first backoff of a server that could not be reached.
pub const UNREACHABLE_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// The longest backoff (the backoff doubles on every failed retry up to it).
pub const UNREACHABLE_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// While a server is down, the map is fetched again at most this often (`Health::refresh_due`),
/// so the new owners of its keys are found soon after the coordinator names them (~0.7 s after
/// a server dies, at the defaults), not only when a backoff ends.
pub const REFRESH_WHILE_DOWN: Duration = Duration::from_millis(200);

/// Does an I/O error mean the server could not be reached (refused, reset, closed, timed
/// out, no route), rather than that it answered wrongly (a refused login, a TLS error)?
pub fn unreachable_kind(k: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind as K;
    closed_kind(k)
        || matches!(
            k,
            K::ConnectionRefused
                | K::TimedOut
                | K::WouldBlock
                | K::HostUnreachable
                | K::NetworkUnreachable
                | K::NetworkDown
                | K::AddrNotAvailable
        )
}

/// Does an I/O error mean the connection was closed or reset by the server (which, on a
/// connection that served earlier requests, may only mean the server restarted or closed it
/// idle)?
pub fn closed_kind(k: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind as K;
    matches!(k, K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::NotConnected)
}

#[derive(Clone, Copy, Debug)]
struct Down {
    until: Instant,
    backoff: Duration,
}

/// What a failure asks of the caller (see [`Health::failed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failed {
    /// The server was up before (or its backoff had run out): a new backoff started.
    pub new_backoff: bool,
    /// Fetch the map from another server ([`Health::map_source`]).
    pub refresh: bool,
}

/// Per server: the backoff of a server that could not be reached. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct Health {
    /// Indexed by server id; `None`: up (or never failed).
    down: Vec<Option<Down>>,
    /// Servers with an entry in `down`.
    n_down: usize,
    /// Where the next [`Health::map_source`] search starts.
    next_source: usize,
    failures: u64,
    /// When a map refresh was last asked for (`failed`, `refresh_due`).
    last_refresh: Option<Instant>,
}

impl Health {
    pub fn new() -> Health {
        Health::default()
    }

    /// Has any server failed since it last answered? (The caller's one branch on the hot
    /// path: when false, nothing else here needs asking.)
    #[inline]
    pub fn any_down(&self) -> bool {
        self.n_down != 0
    }

    /// Is server `s` in its backoff at `now` (answer its keys without the network)?
    #[inline]
    pub fn is_down(&self, s: u16, now: Instant) -> bool {
        self.n_down != 0 && self.down.get(s as usize).copied().flatten().is_some_and(|d| now < d.until)
    }

    /// Has server `s` failed since it last answered (in its backoff or past it, not retried yet)?
    pub fn has_failed(&self, s: u16) -> bool {
        self.down.get(s as usize).copied().flatten().is_some()
    }

    /// The end of server `s`'s backoff, if it failed.
    pub fn down_until(&self, s: u16) -> Option<Instant> {
        self.down.get(s as usize).copied().flatten().map(|d| d.until)
    }

    /// Server `s` could not be reached at `now`. A failure while it is in its backoff (another
    /// connection to it failing) changes nothing; the first failure starts a backoff of
    /// [`UNREACHABLE_BACKOFF_MIN`], a failure after the backoff ran out (the retry failed) doubles it.
    /// Either asks for a map refresh.
    pub fn failed(&mut self, s: u16, now: Instant) -> Failed {
        self.failures += 1;
        let i = s as usize;
        if self.down.len() <= i {
            self.down.resize(i + 1, None);
        }
        let backoff = match self.down[i] {
            Some(d) if now < d.until => return Failed { new_backoff: false, refresh: false },
            Some(d) => (d.backoff * 2).min(UNREACHABLE_BACKOFF_MAX),
            None => {
                self.n_down += 1;
                UNREACHABLE_BACKOFF_MIN
            }
        };
        self.down[i] = Some(Down { until: now + backoff, backoff });
        self.last_refresh = Some(now);
        Failed { new_backoff: true, refresh: true }
    }

    /// A request for a server in its backoff is answered without the network: should the map
    /// be fetched again now? Yes once per [`REFRESH_WHILE_DOWN`] (counted from the last refresh
    /// asked for), so the keys go to their new owners soon after the cluster reassigned them.
    pub fn refresh_due(&mut self, now: Instant) -> bool {
        if self.n_down == 0 || self.last_refresh.is_some_and(|t| now < t + REFRESH_WHILE_DOWN) {
            return false;
        }
        self.last_refresh = Some(now);
        true
    }

    /// Server `s` answered: it is used again, and its next failure starts from [`UNREACHABLE_BACKOFF_MIN`].
    #[inline]
    pub fn reachable(&mut self, s: u16) {
        if self.n_down != 0 {
            if let Some(d) = self.down.get_mut(s as usize) {
                if d.take().is_some() {
                    self.n_down -= 1;
                }
            }
        }
    }

    /// A new map was installed: forget the servers it no longer has, or has at other
    /// addresses than the old one (`old`: the old map's servers; a replacement is a new
    /// server).
    pub fn map_changed(&mut self, old: &[ServerInfo], new: &[ServerInfo]) {
        for (i, d) in self.down.iter_mut().enumerate() {
            let same = old.get(i).zip(new.get(i)).is_some_and(|(a, b)| a == b);
            if d.is_some() && !same {
                *d = None;
                self.n_down -= 1;
            }
        }
    }

    /// A server to ask for the map after `failed` could not be reached: the next server of
    /// `map` after the last one asked that is neither `failed` nor in its backoff; `None` when
    /// there is none.
    pub fn map_source(&mut self, map: &ClusterMap, failed: u16, now: Instant) -> Option<u16> {
        let n = map.servers().len();
        for k in 0..n {
            let s = (self.next_source + k) % n;
            if s != failed as usize && !self.is_down(s as u16, now) {
                self.next_source = s + 1;
                return Some(s as u16);
            }
        }
        None
    }

    /// Failures reported so far ([`Health::failed`] calls).
    pub fn failures(&self) -> u64 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn map(servers: u16) -> ClusterMap {
        let info = (0..servers)
            .map(|s| ServerInfo {
                main: SocketAddr::from(([127, 0, 0, 1], 1000 + s * 10)),
                workers: vec![SocketAddr::from(([127, 0, 0, 1], 1001 + s * 10))],
            })
            .collect();
        ClusterMap::even(info, 2, 64)
    }

    #[test]
    fn backoff_doubles_to_the_cap_and_an_answer_resets_it() {
        let t0 = Instant::now();
        let mut h = Health::new();
        assert!(!h.any_down() && !h.is_down(1, t0));
        h.reachable(1); // nothing to forget
        assert_eq!(h.failed(1, t0), Failed { new_backoff: true, refresh: true });
        assert!(h.any_down() && h.is_down(1, t0) && !h.is_down(0, t0) && !h.is_down(7, t0));
        // another connection of the same server failing in the backoff: nothing new
        assert_eq!(h.failed(1, t0 + UNREACHABLE_BACKOFF_MIN / 2), Failed { new_backoff: false, refresh: false });
        assert_eq!(h.down_until(1), Some(t0 + UNREACHABLE_BACKOFF_MIN));
        // the backoff ran out: used again (a retry), still counted as failed
        let t1 = t0 + UNREACHABLE_BACKOFF_MIN;
        assert!(!h.is_down(1, t1) && h.has_failed(1) && h.any_down());
        // the retry fails: twice as long, and a refresh once more
        let mut t = t1;
        let mut want = UNREACHABLE_BACKOFF_MIN * 2;
        for _ in 0..6 {
            assert_eq!(h.failed(1, t), Failed { new_backoff: true, refresh: true });
            assert_eq!(h.down_until(1), Some(t + want));
            assert!(h.is_down(1, t + want - Duration::from_millis(1)));
            t += want;
            want = (want * 2).min(UNREACHABLE_BACKOFF_MAX);
        }
        assert_eq!(h.down_until(1).unwrap() - (t - UNREACHABLE_BACKOFF_MAX), UNREACHABLE_BACKOFF_MAX, "capped");
        h.reachable(1);
        assert!(!h.any_down() && !h.has_failed(1));
        assert_eq!(h.failed(1, t), Failed { new_backoff: true, refresh: true });
        assert_eq!(h.down_until(1), Some(t + UNREACHABLE_BACKOFF_MIN), "from the start again");
        assert_eq!(h.failures(), 9);
    }

    #[test]
    fn the_map_is_asked_of_a_server_that_is_not_down() {
        let t0 = Instant::now();
        let m = map(3);
        let mut h = Health::new();
        h.failed(1, t0);
        let picks: Vec<Option<u16>> = (0..4).map(|_| h.map_source(&m, 1, t0)).collect();
        assert_eq!(picks, [Some(0), Some(2), Some(0), Some(2)], "never the failed server");
        h.failed(2, t0);
        assert_eq!(h.map_source(&m, 1, t0), Some(0));
        assert_eq!(h.map_source(&m, 1, t0), Some(0), "2 is down too");
        h.failed(0, t0);
        assert_eq!(h.map_source(&m, 1, t0), None, "every server is down");
        assert_eq!(
            h.map_source(&m, 1, t0 + UNREACHABLE_BACKOFF_MIN),
            Some(2),
            "after the backoffs, anyone but 1 (the next in turn)"
        );
        assert_eq!(h.map_source(&map(1), 0, t0), None, "a one-server cluster has no other");
    }

    #[test]
    fn while_a_server_is_down_the_map_is_refreshed_every_interval() {
        let mut h = Health::new();
        let t0 = Instant::now();
        assert!(!h.refresh_due(t0), "nothing down: no refresh");
        assert!(h.failed(1, t0).refresh);
        assert!(!h.refresh_due(t0 + Duration::from_millis(50)), "just refreshed");
        assert!(h.refresh_due(t0 + REFRESH_WHILE_DOWN));
        assert!(!h.refresh_due(t0 + REFRESH_WHILE_DOWN + Duration::from_millis(10)));
        assert!(h.refresh_due(t0 + 2 * REFRESH_WHILE_DOWN));
        h.reachable(1);
        assert!(!h.refresh_due(t0 + 10 * REFRESH_WHILE_DOWN), "up again");
    }

    #[test]
    fn a_new_map_forgets_servers_that_changed() {
        let t0 = Instant::now();
        let old = map(3);
        let mut h = Health::new();
        h.failed(1, t0);
        h.failed(2, t0);
        let mut new = old.clone();
        new.move_cachelet(0, (0, 0));
        h.map_changed(old.servers(), new.servers());
        assert!(h.is_down(1, t0) && h.is_down(2, t0), "same servers: still down");
        h.map_changed(old.servers(), map(2).servers());
        assert!(h.is_down(1, t0) && !h.is_down(2, t0) && h.any_down(), "server 2 left the map");
        h.reachable(1);
        assert!(!h.any_down());
    }
}
