//! Which file a loaded shared library came from (`dladdr`), for `pdxfer info`:
//! the path and, through the versioned file name, the version of libcuda,
//! libibverbs and the others that pdxfer opens at run time.

use std::ffi::{c_void, CStr};

/// The canonical path (symlinks resolved) of the loaded file holding the
/// code or data at address `addr` (a function's address, say).
pub fn file_of(addr: usize) -> Option<String> {
    // SAFETY: Dl_info is plain data; zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only compares `addr` with the loaded objects' ranges (it
    // never dereferences it) and fills `info`.
    if unsafe { libc::dladdr(addr as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader.
    let p = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy();
    Some(
        std::fs::canonicalize(&*p)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| p.into_owned()),
    )
}

/// The file the loader gives for the first of `sonames` that loads, found
/// through `symbol` in it; `Err` lists each name with the loader's reason.
pub fn file_of_library(sonames: &[&str], symbol: &CStr) -> Result<String, String> {
    let mut tried = Vec::new();
    for name in sonames {
        let Ok(c) = std::ffi::CString::new(*name) else {
            continue;
        };
        // SAFETY: dlopen of a system library that pdxfer loads anyway (its
        // constructors run once); the handle is kept, as the process keeps it.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if h.is_null() {
            // SAFETY: dlerror returns a thread-local message or null.
            let e = unsafe { libc::dlerror() };
            let why = if e.is_null() {
                "not found".to_string()
            } else {
                // SAFETY: non-null dlerror results are NUL-terminated strings.
                unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            tried.push(why);
            continue;
        }
        // SAFETY: h is a live handle; symbol is NUL-terminated.
        let p = unsafe { libc::dlsym(h, symbol.as_ptr()) };
        match (!p.is_null()).then(|| file_of(p as usize)).flatten() {
            Some(f) => return Ok(f),
            None => tried.push(format!("{name}: no {symbol:?}")),
        }
    }
    Err(tried.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libc_is_found_by_soname_and_a_missing_library_says_why() {
        let f = file_of_library(&["libc.so.6"], c"malloc").unwrap();
        assert!(f.contains("libc"), "{f}");
        let e = file_of_library(&["libpdxfer-no-such-lib.so.1"], c"x").unwrap_err();
        assert!(e.contains("libpdxfer-no-such-lib.so.1"), "{e}");
    }
}
