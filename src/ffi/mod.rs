//! The C ABI (`include/pdxfer.h`): thin, converting and validating, then
//! calling the Rust API.
//!
//! Conventions (also in docs/c-api.md, "Conventions"):
//! - every export returns [`PdxStatus`] and writes results through out-pointers;
//! - every export runs inside [`boundary`]: a panic becomes `PDX_STATUS_PANIC`,
//!   never an unwind across the boundary;
//! - the detail of the calling thread's last failure is read with
//!   `pdxfer_last_error()`;
//! - structs passed in start with `struct_size`; older (smaller) versions are
//!   accepted and missing fields read as zero; structs filled for the caller
//!   are written only up to the caller's `struct_size`;
//! - arrays and strings are never retained after a call returns;
//! - every raw pointer is turned into a reference or slice here, in `ptr`, and
//!   nowhere else.

// Exports take raw pointers from C callers; their validity is the C contract
// (documented per function), and every dereference goes through `ptr`, which
// checks NULL, alignment and lengths first (the rustls-ffi convention).
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod agent;
pub mod batch;
pub mod bootstrap;
pub mod bootstrap_client;
pub mod engine;
pub mod log;
pub mod memory;
pub mod metrics;
pub mod peer;
pub mod plan;
pub mod pool_desc;
pub mod ptr;
pub mod rank_targets;
pub mod registration;
pub mod room_key;
pub mod status;
pub mod topology;

pub use crate::error::PdxStatus;

use crate::error::{Error, Result, Status};
use std::cell::RefCell;
use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as the calling thread's last error detail.
pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Pointer to the calling thread's last error text (valid until its next failing call).
pub(crate) fn last_error_ptr() -> *const std::ffi::c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// Runs `f` behind the panic boundary and turns its result into a status.
pub(crate) fn boundary(f: impl FnOnce() -> Result<Status>) -> PdxStatus {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            // The status already carries the kind; the text is the detail.
            set_last_error(e.detail());
            e.status()
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            set_last_error(&format!(
                "panic: internal error caught at the C boundary: {what}"
            ));
            PdxStatus::Panic
        }
    }
}

/// Returns `Ok(Status::Ok)`; shorthand for export bodies.
pub(crate) fn ok() -> Result<Status> {
    Ok(Status::Ok)
}

/// Converts a caller-provided i64 to u64, naming the argument when it is negative.
pub(crate) fn non_negative(v: i64, what: &str) -> Result<u64> {
    u64::try_from(v).map_err(|_| Error::invalid(format!("{what} must be >= 0, got {v}")))
}
