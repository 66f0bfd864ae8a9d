//! Status text, the calling thread's last error and the ABI version.

use super::{last_error_ptr, PdxStatus};
use std::ffi::c_char;

/// ABI major version of this header; a library with another major refuses to work with it.
pub const PDXFER_ABI_VERSION_MAJOR: u32 = 1;
/// ABI minor version of this header (functions or struct fields added).
/// 1.1: `PdxEngineConfig.state`, `pdxfer_engine_set_state_indices`.
/// 1.2: `PdxEngineConfig.pool_memory` / `pool_device` (KV pools in CUDA memory).
/// 1.3: `pdxfer_set_log_callback`, `pdxfer_engine_decode_prefix_len`,
/// `PdxEngineConfig.metrics_listen`, `pdxfer_engine_metrics`,
/// `pdxfer_engine_metrics_address`, `pdxfer_engine_room_telemetry`.
/// 1.4: `PdxAgentOptions.secret` (peer authentication), `pdxfer_engine_send_ex` /
/// `PdxSendOptions` (event-ordered and layer-wise sends).
/// 1.5: `pdxfer_alloc_shared_pool` / `pdxfer_free_shared_pool` (shared KV
/// pools, one copy on the same host), `PDXFER_ENGINE_NO_ONE_COPY`,
/// `PDXFER_ENGINE_NO_PREFAULT`.
pub const PDXFER_ABI_VERSION_MINOR: u32 = 5;

/// The library's ABI version: `(major << 16) | minor`.
#[no_mangle]
pub extern "C" fn pdxfer_abi_version() -> u32 {
    (PDXFER_ABI_VERSION_MAJOR << 16) | PDXFER_ABI_VERSION_MINOR
}

/// Detail text of the calling thread's last failure ("" if none).
///
/// The pointer stays valid until the next failing pdxfer call on the same
/// thread; copy it if it must live longer. Never NULL, never freed by the caller.
#[no_mangle]
pub extern "C" fn pdxfer_last_error() -> *const c_char {
    // Reading a thread-local cannot panic except during thread teardown; fall back to "".
    std::panic::catch_unwind(last_error_ptr).unwrap_or(c"".as_ptr())
}

/// Static one-line description of a status code (unknown codes included). Never NULL.
#[no_mangle]
pub extern "C" fn pdxfer_status_str(status: i32) -> *const c_char {
    std::panic::catch_unwind(|| {
        PdxStatus::from_code(status)
            .map_or(c"unknown status code", |s| s.message_cstr())
            .as_ptr()
    })
    .unwrap_or(c"".as_ptr())
}

/// Static snake_case kind of a status code (`"prefix_misaligned"`), as Python's `.kind`. Never NULL.
#[no_mangle]
pub extern "C" fn pdxfer_status_kind(status: i32) -> *const c_char {
    std::panic::catch_unwind(|| {
        PdxStatus::from_code(status)
            .map_or(c"unknown_status", |s| s.kind_cstr())
            .as_ptr()
    })
    .unwrap_or(c"".as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn s(p: *const c_char) -> String {
        // SAFETY: the functions return NUL-terminated static or thread-local strings.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string()
    }

    #[test]
    fn status_text() {
        assert_eq!(s(pdxfer_status_kind(-200)), "prefix_misaligned");
        assert_eq!(s(pdxfer_status_kind(0)), "ok");
        assert_eq!(s(pdxfer_status_kind(77)), "unknown_status");
        assert!(s(pdxfer_status_str(-203)).contains("matching DCP ranks"));
        assert_eq!(pdxfer_abi_version() >> 16, 1);
    }
}
