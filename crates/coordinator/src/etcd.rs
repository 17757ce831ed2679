//! The etcd store (`--store etcd://HOST:PORT[,HOST:PORT...]`): the state
//! ([`Stored`], the same JSON the file store writes) under one key, and the
//! leadership among the coordinators that share it.
//!
//! * Keys: `<prefix>/state` (the state) and `<prefix>/leader` (the leader's
//!   address, attached to its etcd lease). The prefix defaults to
//!   `/mbal/<hash of the cluster file's initial map>`.
//! * Leadership: every coordinator holds an etcd lease (TTL ~1 s, kept alive
//!   every TTL/3). A coordinator that is not leading tries every tick to
//!   create the leader key with its lease in a transaction that succeeds
//!   only if the key does not exist; the one whose transaction succeeds
//!   leads. When the leader dies, its lease expires, etcd deletes the key,
//!   and a standby's next try succeeds.
//! * Fencing of the leader itself: it counts its leadership valid until the
//!   time its last acknowledged keep-alive was *sent* plus the TTL, which is
//!   never after etcd expires the lease; past that it answers no beat (see
//!   `server.rs`). Every state write is a transaction that checks that the
//!   leader key still has the create revision this leader made it with, so a
//!   deposed leader writes nothing.
//!
//! The etcd client is async (tokio); its runtime runs on one thread of its
//! own, and the coordinator's blocking threads call into it with
//! [`Etcd::run`], each call bounded by a timeout.

use crate::state::Stored;
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use std::future::Future;
use std::time::Duration;

/// How to reach etcd and which keys to use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdSettings {
    /// `http://HOST:PORT` endpoints.
    pub endpoints: Vec<String>,
    /// The keys' prefix (no trailing `/`); None: `/mbal/<hash of the initial map>`.
    pub prefix: Option<String>,
    /// The leadership lease's TTL (whole seconds; etcd may raise it to its minimum).
    pub ttl_secs: i64,
}

impl EtcdSettings {
    /// From `etcd://HOST:PORT[,HOST:PORT...]`.
    pub fn from_url(url: &str) -> Result<EtcdSettings, String> {
        let rest = url.strip_prefix("etcd://").ok_or_else(|| format!("{url}: not etcd://HOST:PORT[,HOST:PORT...]"))?;
        let mut endpoints = Vec::new();
        for hp in rest.split(',') {
            let hp = hp.trim().trim_end_matches('/');
            let Some((host, port)) = hp.rsplit_once(':') else {
                return Err(format!("{url}: {hp:?} is not HOST:PORT"));
            };
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(format!("{url}: {hp:?} is not HOST:PORT"));
            }
            endpoints.push(format!("http://{hp}"));
        }
        Ok(EtcdSettings { endpoints, prefix: None, ttl_secs: 1 })
    }
}

/// The default key prefix of a cluster: `/mbal/<xxh3 of its initial map's JSON, hex>`.
pub fn default_prefix(initial_map: &mbal_cluster::ClusterMap) -> String {
    format!("/mbal/{:016x}", xxhash_rust::xxh3::xxh3_64(initial_map.to_json().as_bytes()))
}

/// A connection to etcd with its runtime.
pub(crate) struct Etcd {
    rt: tokio::runtime::Runtime,
    client: Client,
    pub state_key: String,
    pub leader_key: String,
    timeout: Duration,
}

/// What a try for leadership found.
pub(crate) enum Campaign {
    /// This coordinator leads; the leader key's create revision.
    Won(i64),
    /// Another leads (its address, if the key holds one).
    Lost(Option<String>),
}

impl Etcd {
    pub fn connect(s: &EtcdSettings, prefix: String, timeout: Duration) -> Result<Etcd, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("mbal-coord-etcd-rt")
            .enable_all()
            .build()
            .map_err(|e| format!("etcd runtime: {e}"))?;
        let opts = ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
        let eps = s.endpoints.clone();
        let client = rt
            .block_on(async { tokio::time::timeout(timeout * 2, Client::connect(eps, Some(opts))).await })
            .map_err(|_| {
                format!("etcd {}: no connection within {} ms", s.endpoints.join(","), (timeout * 2).as_millis())
            })?
            .map_err(|e| format!("etcd {}: {e}", s.endpoints.join(",")))?;
        Ok(Etcd { rt, client, state_key: format!("{prefix}/state"), leader_key: format!("{prefix}/leader"), timeout })
    }

    /// Run one request, bounded by the timeout.
    fn run<T, F>(&self, f: impl FnOnce(Client) -> F) -> Result<T, String>
    where
        F: Future<Output = Result<T, etcd_client::Error>>,
    {
        let fut = f(self.client.clone());
        match self.rt.block_on(async { tokio::time::timeout(self.timeout, fut).await }) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!("etcd: {e}")),
            Err(_) => Err(format!("etcd: no answer within {} ms", self.timeout.as_millis())),
        }
    }

    /// The stored state, None if there is none yet.
    pub fn load(&self) -> Result<Option<Stored>, String> {
        let key = self.state_key.clone();
        let r = self.run(|mut c| async move { c.get(key, None).await })?;
        let Some(kv) = r.kvs().first() else { return Ok(None) };
        let s: Stored = serde_json::from_slice(kv.value()).map_err(|e| format!("etcd {}: {e}", self.state_key))?;
        s.check().map_err(|e| format!("etcd {}: {e}", self.state_key))?;
        Ok(Some(s))
    }

    /// A new lease: (id, TTL granted in seconds).
    pub fn grant(&self, ttl_secs: i64) -> Result<(i64, i64), String> {
        let r = self.run(|mut c| async move { c.lease_grant(ttl_secs, None).await })?;
        Ok((r.id(), r.ttl()))
    }

    /// One keep-alive: the TTL left (0: the lease is gone).
    pub fn keep_alive(&self, id: i64) -> Result<i64, String> {
        let r = self.run(|mut c| async move {
            let (mut keeper, mut stream) = c.lease_keep_alive(id).await?;
            keeper.keep_alive().await?;
            match stream.message().await? {
                Some(r) => Ok(r.ttl()),
                None => Ok(0),
            }
        });
        match r {
            // etcd's answer for a lease that expired or was revoked.
            Err(e) if e.contains("lease not found") => Ok(0),
            r => r,
        }
    }

    pub fn revoke(&self, id: i64) -> Result<(), String> {
        self.run(|mut c| async move { c.lease_revoke(id).await }).map(|_| ())
    }

    /// Try to become the leader: create the leader key (value: this
    /// coordinator's address) with the lease, if it does not exist.
    pub fn campaign(&self, lease: i64, addr: &str) -> Result<Campaign, String> {
        let key = self.leader_key.clone();
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), addr, Some(PutOptions::new().with_lease(lease)))])
            .or_else([TxnOp::get(key, None)]);
        let r = self.run(|mut c| async move { c.txn(txn).await })?;
        if r.succeeded() {
            let rev = r.header().map(|h| h.revision()).ok_or("etcd: a transaction's answer without a revision")?;
            return Ok(Campaign::Won(rev));
        }
        let kv = r.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(g) => g.kvs().first().cloned(),
            _ => None,
        });
        match kv {
            // The key is ours already (a take-over that did not finish, or a lost answer):
            // this coordinator leads with it.
            Some(kv) if kv.lease() == lease => Ok(Campaign::Won(kv.create_revision())),
            kv => Ok(Campaign::Lost(kv.and_then(|kv| kv.value_str().ok().map(str::to_string)))),
        }
    }

    /// Write the state if the leader key still has the create revision
    /// `rev` (this coordinator still leads). Ok(false): it does not.
    pub fn save_if_leader(&self, rev: i64, s: &Stored) -> Result<bool, String> {
        let json = serde_json::to_vec(s).map_err(|e| e.to_string())?;
        let txn = Txn::new()
            .when([Compare::create_revision(self.leader_key.clone(), CompareOp::Equal, rev)])
            .and_then([TxnOp::put(self.state_key.clone(), json, None)]);
        let r = self.run(|mut c| async move { c.txn(txn).await })?;
        Ok(r.succeeded())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Stored;
    use std::process::{Child, Command, Stdio};
    use std::time::Instant;

    /// A single-member etcd on loopback ports in a temp dir (removed after it), killed (by
    /// pid) when dropped.
    struct EtcdProc(Child, #[allow(dead_code)] tempfile::TempDir);

    impl Drop for EtcdProc {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    /// None (the test passes, saying so) without an `etcd` binary, unless MBAL_REQUIRE_ETCD is set.
    fn etcd() -> Option<(EtcdProc, EtcdSettings)> {
        let has = Command::new("etcd").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
        if !has.is_ok_and(|s| s.success()) {
            assert!(std::env::var("MBAL_REQUIRE_ETCD").is_err(), "MBAL_REQUIRE_ETCD is set but there is no etcd");
            eprintln!("SKIPPED: no etcd binary");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let (p, q) = (free_port(), free_port());
        let (client, peer) = (format!("http://127.0.0.1:{p}"), format!("http://127.0.0.1:{q}"));
        let child = Command::new("etcd")
            .arg("--data-dir")
            .arg(dir.path().join("etcd"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("default={peer}")])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let guard = EtcdProc(child, dir);
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr: std::net::SocketAddr = format!("127.0.0.1:{p}").parse().unwrap();
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(Instant::now() < deadline, "etcd did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some((guard, EtcdSettings::from_url(&format!("etcd://127.0.0.1:{p}")).unwrap()))
    }

    /// One request line to a coordinator, its first answer line.
    fn ask(addr: std::net::SocketAddr, req: &str) -> String {
        use std::io::{BufRead, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(format!("{req}\r\n").as_bytes()).unwrap();
        let mut l = String::new();
        std::io::BufReader::new(s).read_line(&mut l).unwrap();
        l.trim_end().to_string()
    }

    #[test]
    fn a_standby_takes_over_when_the_leader_stops_without_resigning() {
        let Some((_etcd, settings)) = etcd() else { return };
        let servers = (0..2u16)
            .map(|i| mbal_cluster::ServerInfo {
                main: format!("127.0.0.1:{}", 40000 + i).parse().unwrap(),
                workers: vec![format!("127.0.0.1:{}", 40000 + i).parse().unwrap()],
            })
            .collect();
        let map = mbal_cluster::ClusterMap::even(servers, 4, 64);
        let dir = tempfile::tempdir().unwrap();
        let mk = || {
            let mut s = crate::Settings::new(map.clone(), "127.0.0.1:0".parse().unwrap(), dir.path().join("unused"));
            s.etcd = Some(settings.clone());
            // No one is declared dead during the test, however slow the machine.
            s.timing.failure_timeout = Duration::from_secs(30);
            crate::start(s).unwrap()
        };
        let wait = |what: &str, f: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !f() {
                assert!(Instant::now() < deadline, "timed out waiting for {what}");
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        let a = mk();
        wait("a to lead", &|| a.is_leader());
        let b = mk();
        // b stands by: it names the leader, and shows the state a wrote.
        wait("b to know the leader", &|| {
            ask(b.addr(), "mbal beat 0 1") == format!("SERVER_ERROR not the leader; leader {}", a.addr())
        });
        // A change through the leader: server 1 leaves (one epoch bump).
        assert_eq!(ask(a.addr(), "mbal leave 1"), "OK 2");
        assert_eq!(ask(a.addr(), "mbal beat 0 2"), "BEAT 2 400");
        wait("b to see epoch 2", &|| b.epoch() == 2);
        assert!(!b.is_leader());
        assert_eq!(ask(b.addr(), "mbal leave 0"), format!("SERVER_ERROR not the leader; leader {}", a.addr()));
        // The leader stops as a crash would (its etcd lease is left to expire): b takes over
        // with the state a wrote, and answers beats.
        a.halt();
        wait("b to lead", &|| b.is_leader());
        assert_eq!(b.epoch(), 2);
        assert_eq!(ask(b.addr(), "mbal beat 0 2"), "BEAT 2 400");
        assert_eq!(ask(b.addr(), "mbal beat 1 2"), "GONE 1 left");
        b.shutdown();
    }

    #[test]
    fn one_leader_at_a_time_and_a_deposed_leader_writes_nothing() {
        let Some((_etcd, settings)) = etcd() else { return };
        let map = mbal_cluster::ClusterMap::even(
            vec![mbal_cluster::ServerInfo {
                main: "127.0.0.1:1".parse().unwrap(),
                workers: vec!["127.0.0.1:1".parse().unwrap()],
            }],
            4,
            64,
        );
        let prefix = default_prefix(&map);
        let a = Etcd::connect(&settings, prefix.clone(), Duration::from_secs(5)).unwrap();
        let b = Etcd::connect(&settings, prefix, Duration::from_secs(5)).unwrap();
        assert_eq!(a.load().unwrap(), None);
        let (la, ttl) = a.grant(1).unwrap();
        assert_eq!(ttl, 1, "etcd run with a short election timeout allows a 1 s TTL");
        let (lb, _) = b.grant(1).unwrap();
        let Campaign::Won(rev_a) = a.campaign(la, "127.0.0.1:7001").unwrap() else { panic!("a leads") };
        match b.campaign(lb, "127.0.0.1:7002").unwrap() {
            Campaign::Lost(leader) => assert_eq!(leader.as_deref(), Some("127.0.0.1:7001")),
            Campaign::Won(_) => panic!("two leaders"),
        }
        // Trying again with the lease that holds the key: still the same leadership.
        assert!(matches!(a.campaign(la, "127.0.0.1:7001").unwrap(), Campaign::Won(r) if r == rev_a));
        let s1 = Stored::initial(map.clone());
        assert!(a.save_if_leader(rev_a, &s1).unwrap());
        assert_eq!(b.load().unwrap(), Some(s1.clone()));
        assert!(a.keep_alive(la).unwrap() > 0);
        // a's lease ends (as when it dies): b takes over; a, deposed, writes nothing.
        a.revoke(la).unwrap();
        assert_eq!(a.keep_alive(la).unwrap(), 0);
        let Campaign::Won(rev_b) = b.campaign(lb, "127.0.0.1:7002").unwrap() else { panic!("b leads") };
        let mut s2 = s1.clone();
        s2.members[0].memory_bytes = 7;
        assert!(!a.save_if_leader(rev_a, &s2).unwrap(), "a deposed leader's write");
        assert_eq!(b.load().unwrap(), Some(s1));
        assert!(b.save_if_leader(rev_b, &s2).unwrap());
        assert_eq!(a.load().unwrap(), Some(s2));
    }

    #[test]
    fn urls() {
        let s = EtcdSettings::from_url("etcd://127.0.0.1:2379,localhost:2380").unwrap();
        assert_eq!(s.endpoints, vec!["http://127.0.0.1:2379", "http://localhost:2380"]);
        for bad in ["http://127.0.0.1:2379", "etcd://", "etcd://host", "etcd://h:x", "etcd://:1"] {
            assert!(EtcdSettings::from_url(bad).is_err(), "{bad}");
        }
    }
}
