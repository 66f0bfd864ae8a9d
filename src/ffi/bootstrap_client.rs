//! Bootstrap clients over the C ABI (`PdxBootstrapClient`): lookups,
//! summaries and the handshake re-check, all exchanging JSON strings
//! (the schema of `pdxfer::bootstrap::schema`).
//!
//! Functions that return JSON write it NUL-terminated into the caller's
//! buffer and the needed size (NUL included) to `out_len`; a NULL buffer with
//! capacity 0 is a size query, a small buffer is `PDX_STATUS_BUFFER_TOO_SMALL`.

use super::ptr;
use super::{boundary, PdxStatus};
use crate::bootstrap::schema::from_json;
use crate::bootstrap::{open_store, verify_peer, PeerHello, RankKey, Registration, Role, Store};
use crate::error::{Error, Result};
use std::ffi::c_char;
use std::sync::Arc;

/// Opaque handle of a bootstrap client (thread-safe: calls may run concurrently).
pub struct PdxBootstrapClient {
    pub(crate) store: Arc<dyn Store>,
}

pub(crate) fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| Error::invalid(format!("cannot encode JSON: {e}")))
}

/// Opens a client for `url`: `http://HOST:PORT` (a bootstrap server) or
/// `etcd://HOST:PORT/NAMESPACE`. `token` may be NULL. Nothing is contacted yet.
#[no_mangle]
pub extern "C" fn pdxfer_bootstrap_client_open(
    url: *const c_char,
    token: *const c_char,
    out: *mut *mut PdxBootstrapClient,
) -> PdxStatus {
    boundary(|| {
        let url = ptr::c_str(url, "url")?;
        let token = ptr::opt_c_str(token, "token")?;
        let store = open_store(url, token)?;
        ptr::new_handle(PdxBootstrapClient { store }, out, "out")?;
        super::ok()
    })
}

/// Frees a client. NULL is a no-op. Registrations made through it keep working.
///
/// Threads: every other call on the same `PdxBootstrapClient` may run concurrently with the others,
/// from any thread. This one may not race any of them: it frees the handle,
/// so no call on the same `PdxBootstrapClient` may be in flight when it starts, and none may start
/// after it. (The Python package enforces this: its `BootstrapClient.close()` waits for the
/// calls in flight and refuses later ones with a typed error.)
#[no_mangle]
pub extern "C" fn pdxfer_bootstrap_client_close(client: *mut PdxBootstrapClient) -> PdxStatus {
    boundary(|| {
        drop(ptr::take_handle(client));
        super::ok()
    })
}

/// The current entry of one rank as JSON. `role` is `"prefill"` or
/// `"decode"`, `rank_key` like `"dp0-tp1-cp0-pp0"`. Errors:
/// `PDX_STATUS_NOT_REGISTERED`, `PDX_STATUS_STALE_METADATA` (the only entry
/// there belongs to an older layout), `PDX_STATUS_UNAUTHORIZED`.
#[no_mangle]
pub extern "C" fn pdxfer_bootstrap_lookup(
    client: *const PdxBootstrapClient,
    cluster: *const c_char,
    role: *const c_char,
    rank_key: *const c_char,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let c = ptr::handle(client, "client")?;
        let cluster = ptr::c_str(cluster, "cluster")?;
        let role = Role::parse(ptr::c_str(role, "role")?)?;
        let key = RankKey::parse(ptr::c_str(rank_key, "rank_key")?)?;
        let reg = c.store.lookup(cluster, role, &key)?;
        ptr::fill_str(&to_json(&reg)?, buf, capacity, out_len, "buf")
    })
}

/// Topology and readiness of one (cluster, role) as JSON.
#[no_mangle]
pub extern "C" fn pdxfer_bootstrap_summary(
    client: *const PdxBootstrapClient,
    cluster: *const c_char,
    role: *const c_char,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let c = ptr::handle(client, "client")?;
        let cluster = ptr::c_str(cluster, "cluster")?;
        let role = Role::parse(ptr::c_str(role, "role")?)?;
        let s = c.store.summary(cluster, role)?;
        ptr::fill_str(&to_json(&s)?, buf, capacity, out_len, "buf")
    })
}

/// Re-checks a direct handshake: `advertised_json` (the entry the bootstrap
/// gave), `hello_json` (what the peer said on the connection) and
/// `local_json` (this rank's registration). On success writes the pair's
/// compatibility (mode, entry pairs, decode ranks served) as JSON; on a
/// mismatch returns `PDX_STATUS_STALE_METADATA`, `PDX_STATUS_PEER_IDENTITY`
/// or the layout error (`PDX_STATUS_DCP_RANK_MISMATCH`, ...), with both
/// entries named in `pdxfer_last_error()`.
#[no_mangle]
pub extern "C" fn pdxfer_bootstrap_verify_peer(
    advertised_json: *const c_char,
    hello_json: *const c_char,
    local_json: *const c_char,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let adv: Registration = from_json(
            ptr::c_str(advertised_json, "advertised_json")?.as_bytes(),
            "advertised registration",
        )?;
        let hello: PeerHello = from_json(
            ptr::c_str(hello_json, "hello_json")?.as_bytes(),
            "peer hello",
        )?;
        let local: Registration = from_json(
            ptr::c_str(local_json, "local_json")?.as_bytes(),
            "local registration",
        )?;
        let compat = verify_peer(&adv, &hello, &local)?;
        ptr::fill_str(&to_json(&compat)?, buf, capacity, out_len, "buf")
    })
}
