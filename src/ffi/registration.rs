//! One registered rank over the C ABI (`PdxRegistration`): registered through
//! a `PdxBootstrapClient`, its lease kept alive by a background thread until
//! it is deregistered or destroyed.

use super::bootstrap_client::{to_json, PdxBootstrapClient};
use super::ptr;
use super::{boundary, ok, PdxStatus};
use crate::bootstrap::schema::from_json;
use crate::bootstrap::{InstanceId, Registrar, Registration};
use crate::error::Error;
use std::ffi::c_char;
use std::time::Duration;

/// Opaque handle of a registered rank.
pub struct PdxRegistration {
    inner: Registrar,
}

/// Registers a rank. `registration_json` is a registration (see the schema);
/// an `instance_id` of 32 zeros, or none at all, is replaced by a fresh random
/// one; `epoch` and `registered_at_ms` are assigned by the store. The lease of
/// `ttl_ms` is kept alive by a background thread. `*out` receives the handle.
#[no_mangle]
pub extern "C" fn pdxfer_bootstrap_register(
    client: *const PdxBootstrapClient,
    registration_json: *const c_char,
    ttl_ms: u64,
    out: *mut *mut PdxRegistration,
) -> PdxStatus {
    boundary(|| {
        let c = ptr::handle(client, "client")?;
        let text = ptr::c_str(registration_json, "registration_json")?;
        let mut v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid(format!("malformed registration: {e}")))?;
        let zero = InstanceId(0).to_string();
        if let Some(o) = v.as_object_mut() {
            let missing = o
                .get("instance_id")
                .is_none_or(|i| i.as_str() == Some(zero.as_str()));
            if missing {
                o.insert(
                    "instance_id".into(),
                    serde_json::Value::String(InstanceId::random()?.to_string()),
                );
            }
        }
        let reg: Registration = from_json(v.to_string().as_bytes(), "registration")?;
        ptr::check_out(out, "out")?;
        let inner = Registrar::start(c.store.clone(), reg, Duration::from_millis(ttl_ms))?;
        ptr::new_handle(PdxRegistration { inner }, out, "out")?;
        ok()
    })
}

/// The registration as the store holds it now (with instance id, epoch and
/// registration time) as JSON.
#[no_mangle]
pub extern "C" fn pdxfer_registration_json(
    registration: *const PdxRegistration,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let r = ptr::handle(registration, "registration")?;
        ptr::fill_str(
            &to_json(&r.inner.registration())?,
            buf,
            capacity,
            out_len,
            "buf",
        )
    })
}

/// What this rank says about itself on a direct connection (its `PeerHello`) as JSON.
#[no_mangle]
pub extern "C" fn pdxfer_registration_hello_json(
    registration: *const PdxRegistration,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let r = ptr::handle(registration, "registration")?;
        ptr::fill_str(&to_json(&r.inner.hello())?, buf, capacity, out_len, "buf")
    })
}

/// Removes the entry from the store at once, stops the keep-alive thread and
/// frees the handle (also when removal fails). NULL is a no-op.
///
/// Threads: every other call on the same `PdxRegistration` may run concurrently with the others,
/// from any thread. This one may not race any of them: it frees the handle,
/// so no call on the same `PdxRegistration` may be in flight when it starts, and none may start
/// after it. (The Python package enforces this: its `Registration.deregister()` waits for the
/// calls in flight and refuses later ones with a typed error.)
#[no_mangle]
pub extern "C" fn pdxfer_registration_deregister(registration: *mut PdxRegistration) -> PdxStatus {
    boundary(|| {
        if let Some(r) = ptr::take_handle(registration) {
            r.inner.deregister()?;
        }
        ok()
    })
}

/// Stops the keep-alive thread and frees the handle; the entry expires with
/// its lease. NULL is a no-op.
///
/// Threads: every other call on the same `PdxRegistration` may run concurrently with the others,
/// from any thread. This one may not race any of them: it frees the handle,
/// so no call on the same `PdxRegistration` may be in flight when it starts, and none may start
/// after it. (The Python package enforces this: its `Registration.close()` waits for the
/// calls in flight and refuses later ones with a typed error.)
#[no_mangle]
pub extern "C" fn pdxfer_registration_destroy(registration: *mut PdxRegistration) -> PdxStatus {
    boundary(|| {
        drop(ptr::take_handle(registration));
        ok()
    })
}
