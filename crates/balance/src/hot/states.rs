//! SPORE's five states of a tracked key (Fig. 5), the events that move
//! it, and the transition table ([`step`]).

use serde::{Deserialize, Serialize};

/// A tracked key's state (SPORE Fig. 5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KeyState {
    /// Not in the metadata table.
    Invalid,
    /// Tracked, not replicated.
    Cold,
    /// Replicas being created or a write being propagated to them: no new
    /// leases (the hint says 0 replicas).
    HotPending,
    /// Replicated: reads get the replica count and a lease.
    Hot,
    /// Cooled: no new leases; replicas stay (and get writes) until every
    /// lease handed out has ended, then they are deleted.
    ColdPending,
}

/// What happens to a tracked key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KeyEvent {
    /// It is among the tracker's hottest keys.
    Tracked,
    /// It left the tracker's hottest keys.
    Dropped,
    /// Hot enough, read-mostly, on a worker past its threshold.
    Heated,
    /// Hot and its rate now calls for more replicas.
    Grew,
    /// The mechanism created (or updated) every replica.
    Ready,
    /// The mechanism could not create or update the replicas (or did not
    /// confirm in time).
    Failed,
    /// A write at home is being propagated to the replicas.
    WriteStarted,
    /// Cool (or write-heavy) for `cool_epochs` epochs.
    Cooled,
    /// Every lease handed out has ended.
    LeasesEnded,
}

/// A named edge of [`step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KeyTransition {
    /// INVALID → COLD.
    Track,
    /// COLD → INVALID (only cold entries are evicted).
    Evict,
    /// COLD → HOT_PENDING: create replicas.
    Replicate,
    /// HOT → HOT_PENDING: create more replicas.
    AddReplicas,
    /// HOT_PENDING → HOT: replicas ready, leases granted.
    ReplicasReady,
    /// HOT_PENDING → COLD_PENDING: creation or propagation failed; wait
    /// out the leases and delete what exists.
    ReplicationFailed,
    /// HOT → HOT_PENDING: propagating a write, leases revoked meanwhile.
    PropagateWrite,
    /// HOT → COLD_PENDING: the key cooled.
    Cool,
    /// COLD_PENDING → HOT: hot again while its replicas still exist.
    Reheat,
    /// COLD_PENDING → COLD: leases over (or, to make room under REPL_high
    /// for a hotter key, at once), replicas deleted.
    Retire,
}

/// The state machine: the next state and the edge taken, or `None` when
/// the event does not apply in that state (it is then ignored).
pub fn step(s: KeyState, e: KeyEvent) -> Option<(KeyState, KeyTransition)> {
    use KeyEvent as E;
    use KeyState as S;
    use KeyTransition as T;
    Some(match (s, e) {
        (S::Invalid, E::Tracked) => (S::Cold, T::Track),
        (S::Cold, E::Dropped) => (S::Invalid, T::Evict),
        (S::Cold, E::Heated) => (S::HotPending, T::Replicate),
        (S::HotPending, E::Ready) => (S::Hot, T::ReplicasReady),
        (S::HotPending, E::Failed) => (S::ColdPending, T::ReplicationFailed),
        (S::Hot, E::Grew) => (S::HotPending, T::AddReplicas),
        (S::Hot, E::WriteStarted) => (S::HotPending, T::PropagateWrite),
        (S::Hot, E::Cooled) => (S::ColdPending, T::Cool),
        (S::ColdPending, E::Heated) => (S::Hot, T::Reheat),
        (S::ColdPending, E::LeasesEnded) => (S::Cold, T::Retire),
        _ => return None,
    })
}
