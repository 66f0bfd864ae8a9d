//! Bootstrap and metadata: how prefill and decode ranks find each other, and
//! why they never pair with a stale or miswired entry.
//!
//! - [`schema`]: the versioned JSON schema ([`Registration`], [`PeerHello`], ...).
//! - [`view`]: which live entries are current (newest layout wins; older
//!   layouts are stale, listed but never handed out).
//! - [`store`]: the [`Store`] trait and the in-memory store with leases.
//! - [`server`]: the embedded HTTP/JSON server (`pdxfer bootstrap`).
//! - [`client`]: [`HttpStore`] (a store over HTTP) and [`Registrar`]
//!   (register + keep-alive thread), the same for every backend.
//! - [`etcd`]: the etcd backend (v3 JSON gateway, leases, transactions).
//! - [`peer`]: rank resolution and the handshake re-check [`verify_peer`].
//!
//! Identity: every process draws a random 128-bit [`InstanceId`]; the store
//! gives every write an epoch larger than all before it, so a
//! re-registration replaces its entry atomically with a larger epoch;
//! readiness counts distinct rank keys of the current layout only.

pub mod client;
pub mod etcd;
pub mod peer;
pub mod schema;
pub mod server;
pub mod store;
pub mod view;

pub use client::{HttpStore, LeaseState, Registrar};
pub use etcd::EtcdStore;
pub use peer::{check_pair, decode_peers, prefill_targets, verify_peer, Target};
pub use schema::{
    InstanceId, Layout, PeerHello, RankBrief, RankKey, RegionDescriptor, RegisterAck,
    RegisterRequest, Registration, Role, Summary, SCHEMA_VERSION,
};
pub use server::{BootstrapServer, ServerConfig};
pub use store::{MemStore, Store};
pub use view::View;

use crate::error::{Error, Result};
use std::sync::Arc;

/// Opens a store from a URL: `http://host:port` (a bootstrap server) or
/// `etcd://host:port/namespace` (etcd's JSON gateway, keys under `/namespace/`).
pub fn open_store(url: &str, token: Option<&str>) -> Result<Arc<dyn Store>> {
    if let Some(rest) = url.strip_prefix("etcd://") {
        let (addr, ns) = rest.split_once('/').unwrap_or((rest, "pdxfer"));
        Ok(Arc::new(EtcdStore::new(&format!("http://{addr}"), ns)?))
    } else if url.starts_with("http://") {
        Ok(Arc::new(HttpStore::new(url, token)?))
    } else {
        Err(Error::invalid(format!(
            "bootstrap url must be http://HOST:PORT or etcd://HOST:PORT/NAMESPACE, got {url:?}"
        )))
    }
}
