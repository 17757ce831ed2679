//! What it takes to be, or talk to, a member of an mbal cluster, as opposed
//! to the key space and the map themselves (`mbal-cluster`, no I/O):
//!
//! * [`ClusterFile`] / [`ClusterSpec`]: the cluster file (TOML), its
//!   `[tls]` section and its secret, and the initial map it gives;
//! * [`dial`]: opening a member connection (TLS when the cluster uses it,
//!   then the login);
//! * [`peer_auth`]: the `mbal peer` challenge over the cluster secret;
//! * [`call`]: blocking member-to-member calls ([`call::MemberConn`]), every reply read with
//!   the one reply codec;
//! * [`coordinators`]: the map fetched from the coordinators;
//! * [`pipe`]: the pipelined connections the proxy and the server's
//!   forwarder keep to the owning workers.
//!
//! Split from `mbal-cluster` so that the policy (`mbal-balance`) and the
//! simulator build without rustls, TOML or HMAC.

pub mod call;
pub mod coordinators;
pub mod dial;
mod file;
pub mod peer_auth;
pub mod pipe;

pub use file::{ClusterFile, ClusterSpec, ServerSpec, TlsSpec};
