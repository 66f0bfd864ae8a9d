//! Status text, the calling thread's last error and the ABI version.

use super::{last_error_ptr, PdxStatus};
pub use crate::version::{PDXFER_ABI_VERSION_MAJOR, PDXFER_ABI_VERSION_MINOR};
use std::ffi::c_char;

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
