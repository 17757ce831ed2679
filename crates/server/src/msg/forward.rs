//! The `--forward` forwarder's jobs (`crate::forward` runs them): one request for a key of
//! another server, the workers' handle on the forwarder, and what `stats` shows of it.

use super::{Mailbox, ReplyTo};
use crossbeam_channel::Sender;
use mbal_proto::client::Expect;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// How a forwarded request's reply is read and what a failure answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A text or meta request with a one-frame reply. `quiet`: the server
    /// may send nothing (so `mn` follows it); `silent`: text `noreply`, the
    /// client reads nothing back, errors included.
    Line { expect: Expect, quiet: bool, silent: bool },
    /// A `get` family request for keys of one cachelet. `whole`: it is the
    /// client's whole request (its `END` and errors pass through); else it
    /// is a run of a longer get and only its `VALUE` blocks are returned
    /// (the asking worker writes `END`), a failure leaving its keys missed.
    Values { whole: bool },
    /// A binary request (to the owning server's main port).
    Bin { quiet: bool },
}

/// One request for the forwarder: its bytes, where its key lives (the key
/// hash routes it), and the output slot its answer fills.
pub(crate) struct Job {
    pub to: ReplyTo,
    pub hash: u64,
    pub kind: Kind,
    pub req: Vec<u8>,
}

/// What `stats` shows of the forwarder (written by it alone).
#[derive(Default)]
pub(crate) struct ForwardStats {
    /// Requests sent to another server (resends after a redirect included).
    pub requests: AtomicU64,
    /// Requests answered with an error because their owner could not be reached.
    pub errors: AtomicU64,
    /// Connections dropped for an unanswered request.
    pub timeouts: AtomicU64,
    /// Redirects followed.
    pub redirects: AtomicU64,
    /// Connections opened.
    pub connects: AtomicU64,
}

/// The workers' side: the job channel and the forwarder's mailbox.
pub(crate) struct ForwardHandle {
    pub(crate) tx: Sender<Vec<Job>>,
    pub(crate) mailbox: Arc<Mailbox>,
    pub stats: ForwardStats,
    /// A newer cluster map for the forwarder's router (the coordinator's, installed by the
    /// controller): taken by the forwarder's loop. Written once per map change, never on the
    /// data path; the flag spares the loop the lock.
    pub(crate) map: std::sync::Mutex<Option<mbal_cluster::ClusterMap>>,
    pub(crate) has_map: std::sync::atomic::AtomicBool,
}

impl ForwardHandle {
    /// Hand the forwarder a round's jobs.
    pub fn send(&self, jobs: Vec<Job>) {
        let _ = self.tx.send(jobs);
        self.mailbox.notify();
    }

    pub fn wake(&self) {
        self.mailbox.wake();
    }

    /// Give the forwarder a newer map.
    pub fn new_map(&self, map: mbal_cluster::ClusterMap) {
        *self.map.lock().unwrap_or_else(|p| p.into_inner()) = Some(map);
        self.has_map.store(true, std::sync::atomic::Ordering::Release);
        self.mailbox.wake();
    }
}
