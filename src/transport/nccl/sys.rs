//! The few NCCL entry points pdxfer calls, resolved with `dlopen`/`dlsym`
//! from one library file: `libnccl.so.2` (the soname of every NCCL 2.x), the
//! pip wheel's copy in site-packages (`nvidia/nccl/lib`) by full path, or the
//! file named by `$PDXFER_NCCL` ([`library::NCCL`]). No symlink and no
//! loader-path setup is needed. The library is opened once per process; a
//! missing one is [`Status::NoNccl`] listing every path tried.

use crate::cuda::library;
use crate::error::{Error, Result, Status};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

/// `ncclComm_t`.
pub type Comm = *mut c_void;
/// `ncclResult_t`.
pub type NcclResult = c_int;

/// `ncclSuccess`.
pub const SUCCESS: NcclResult = 0;
/// `ncclInProgress`: a non-blocking call has not finished yet.
pub const IN_PROGRESS: NcclResult = 7;
/// `ncclUint8`.
pub const UINT8: c_int = 1;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    /// 128 opaque bytes.
    pub internal: [c_char; 128],
}

/// `NCCL_CONFIG_UNDEF_INT`.
const UNDEF_INT: c_int = c_int::MIN;

/// The NCCL 2.18 prefix of `ncclConfig_t`. The struct is append-only and
/// versioned: NCCL copies `size` bytes of it over `NCCL_CONFIG_INITIALIZER`
/// and resets fields newer than `version` to their defaults. `size` ends at
/// `splitShare`, so the trailing padding is never read as `trafficClass`.
#[repr(C)]
pub struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking` set.
    pub fn new(blocking: bool) -> Config {
        Config {
            size: std::mem::offset_of!(Config, split_share) + std::mem::size_of::<c_int>(),
            magic: 0xcafe_beef,
            version: 21800,
            blocking: c_int::from(blocking),
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
        }
    }
}

type VersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type UniqueIdFn = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type InitConfigFn =
    unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> NcclResult;
type AsyncErrorFn = unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult;
type CommFn = unsafe extern "C" fn(Comm) -> NcclResult;
type GroupFn = unsafe extern "C" fn() -> NcclResult;
type SendFn =
    unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, *mut c_void) -> NcclResult;
type RecvFn =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> NcclResult;
type ErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;
type LastErrorFn = unsafe extern "C" fn(Comm) -> *const c_char;

/// One loaded NCCL library and its entry points (signatures of `nccl.h`).
pub struct Nccl {
    /// What was passed to `dlopen` (a soname or a full path).
    pub path: String,
    /// `ncclGetVersion` (e.g. 23203 for 2.32.3).
    pub version: i32,
    pub(super) get_unique_id: UniqueIdFn,
    pub(super) comm_init_rank_config: InitConfigFn,
    pub(super) comm_get_async_error: AsyncErrorFn,
    pub(super) comm_abort: CommFn,
    pub(super) comm_finalize: CommFn,
    pub(super) comm_destroy: CommFn,
    pub(super) group_start: GroupFn,
    pub(super) group_end: GroupFn,
    pub(super) send: SendFn,
    pub(super) recv: RecvFn,
    error_string: ErrorStringFn,
    /// `ncclGetLastError` (NCCL 2.13 on): the text of the last warning,
    /// e.g. "Duplicate GPU detected ..."; absent from stand-ins without it.
    last_error: Option<LastErrorFn>,
}

// SAFETY: only function pointers of a library that stays loaded for the life
// of the process; NCCL's entry points may be called from any thread.
unsafe impl Send for Nccl {}
// SAFETY: as above; nothing here is mutated after `open`.
unsafe impl Sync for Nccl {}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local message or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null dlerror results are NUL-terminated strings.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl Nccl {
    /// Opens `name` (a soname on the loader path or a full path) and resolves
    /// every entry point; the error says why not. The handle is never closed.
    pub fn open(name: &str) -> std::result::Result<Nccl, String> {
        let c = CString::new(name).map_err(|_| format!("{name}: NUL in the name"))?;
        // SAFETY: dlopen of a shared library; its constructors are NCCL's own.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!("{name}: {}", dl_error()));
        }
        macro_rules! need {
            ($s:literal, $t:ty) => {{
                // SAFETY: handle is a live dlopen handle; the name is NUL-terminated.
                let p = unsafe { libc::dlsym(handle, $s.as_ptr()) };
                if p.is_null() {
                    // SAFETY: handle came from dlopen above and is closed once.
                    unsafe { libc::dlclose(handle) };
                    return Err(format!("{name}: no symbol {:?} (not an NCCL >= 2.18)", $s));
                }
                // SAFETY: the symbol is the NCCL function of this signature (nccl.h).
                unsafe { std::mem::transmute::<*mut c_void, $t>(p) }
            }};
        }
        let get_version = need!(c"ncclGetVersion", VersionFn);
        let mut me = Nccl {
            path: name.to_string(),
            version: 0,
            get_unique_id: need!(c"ncclGetUniqueId", UniqueIdFn),
            comm_init_rank_config: need!(c"ncclCommInitRankConfig", InitConfigFn),
            comm_get_async_error: need!(c"ncclCommGetAsyncError", AsyncErrorFn),
            comm_abort: need!(c"ncclCommAbort", CommFn),
            comm_finalize: need!(c"ncclCommFinalize", CommFn),
            comm_destroy: need!(c"ncclCommDestroy", CommFn),
            group_start: need!(c"ncclGroupStart", GroupFn),
            group_end: need!(c"ncclGroupEnd", GroupFn),
            send: need!(c"ncclSend", SendFn),
            recv: need!(c"ncclRecv", RecvFn),
            error_string: need!(c"ncclGetErrorString", ErrorStringFn),
            last_error: {
                // SAFETY: handle is a live dlopen handle; the name is NUL-terminated.
                let p = unsafe { libc::dlsym(handle, c"ncclGetLastError".as_ptr()) };
                // SAFETY: when present, the NCCL function of this signature (nccl.h).
                (!p.is_null())
                    .then(|| unsafe { std::mem::transmute::<*mut c_void, LastErrorFn>(p) })
            },
        };
        let mut v = 0;
        // SAFETY: an out-pointer to a local.
        let rc = unsafe { get_version(&mut v) };
        if rc != SUCCESS {
            return Err(format!("{name}: ncclGetVersion failed: {}", me.error(rc)));
        }
        me.version = v;
        Ok(me)
    }

    /// NCCL's text for a result code, with the code.
    pub fn error(&self, rc: NcclResult) -> String {
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let p = unsafe { (self.error_string)(rc) };
        let text = if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated static string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        format!("{} ({text})", result_name(rc))
    }

    /// NCCL's last warning (`ncclGetLastError`) for `comm`, when it has one.
    pub fn last_error(&self, comm: Comm) -> Option<String> {
        let f = self.last_error?;
        // SAFETY: ncclGetLastError takes a communicator or NULL and returns
        // a NUL-terminated string NCCL owns (or NULL).
        let p = unsafe { f(comm) };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-null, NUL-terminated.
        let t = unsafe { CStr::from_ptr(p) }
            .to_string_lossy()
            .trim()
            .to_string();
        (!t.is_empty()).then_some(t)
    }

    /// A call's result as a typed error ([`Status::Nccl`]).
    pub fn check(&self, what: &str, rc: NcclResult) -> Result<()> {
        if rc == SUCCESS {
            Ok(())
        } else {
            Err(Error::new(
                Status::Nccl,
                format!("{what} failed: {}", self.error(rc)),
            ))
        }
    }
}

/// The `ncclResult_t` name of a code.
pub fn result_name(rc: NcclResult) -> &'static str {
    match rc {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "unknown ncclResult_t",
    }
}

/// Tries every candidate of [`library::NCCL`] in order; the first that loads
/// and resolves wins.
fn open_first(candidates: Vec<String>) -> std::result::Result<Nccl, String> {
    let mut tried = Vec::new();
    for c in candidates {
        match Nccl::open(&c) {
            Ok(n) => return Ok(n),
            Err(e) => tried.push(e),
        }
    }
    Err(library::NCCL.not_found(&tried))
}

static LOADED: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();

/// The process's NCCL, loaded on first use; [`Status::NoNccl`] with every
/// path tried when none loads.
pub fn nccl() -> Result<&'static Nccl> {
    LOADED
        .get_or_init(|| open_first(library::NCCL.candidates()))
        .as_ref()
        .map_err(|e| Error::new(Status::NoNccl, e.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_lists_the_paths_tried() {
        let e = open_first(vec![
            "/nonexistent/libnccl.so.2".into(),
            "libpdxfer-no-such-nccl.so.2".into(),
        ])
        .err()
        .expect("nothing loads");
        assert!(e.contains("NCCL could not be loaded"), "{e}");
        assert!(e.contains("/nonexistent/libnccl.so.2"), "{e}");
        assert!(e.contains("libpdxfer-no-such-nccl.so.2"), "{e}");
        assert!(e.contains("PDXFER_NCCL"), "{e}");
    }

    #[test]
    fn a_library_without_nccl_symbols_is_refused() {
        // libc loads but is no NCCL: the message names the first missing symbol
        let e = Nccl::open("libc.so.6").err().expect("not an NCCL");
        assert!(e.contains("ncclGetVersion"), "{e}");
    }

    /// The NCCL wheel that `scripts/cuda-deps.sh` installs (its `--target`
    /// directory is on `PYTHONPATH`, searched as site-packages) is found by
    /// full path, with no symlink and no loader path, and works: a version
    /// and a unique id without a GPU.
    #[test]
    fn the_wheel_is_found_in_site_packages() {
        let found = library::NCCL
            .candidates()
            .into_iter()
            .find(|c| c.ends_with("/nvidia/nccl/lib/libnccl.so.2"));
        let Some(path) = found else {
            assert!(
                std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
                "PDXFER_REQUIRE_CUDA_TOOLS is set but no NCCL wheel is in any site-packages: {:?}",
                library::NCCL.searched_dirs()
            );
            crate::test_skip::skip(
                "cuda-tools",
                "no NCCL wheel in site-packages (scripts/cuda-deps.sh)",
            );
            return;
        };
        let n = Nccl::open(&path).unwrap();
        assert!(n.version >= 21800, "NCCL {} at {path}", n.version);
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: an out-pointer to a local ncclUniqueId.
        n.check("ncclGetUniqueId", unsafe { (n.get_unique_id)(&mut id) })
            .unwrap();
        assert!(id.internal.iter().any(|&b| b != 0));
    }

    #[test]
    fn config_is_the_nccl_2_18_prefix() {
        // size_t size; u32 magic, version; int blocking, cga, min, max; ptr netName; int splitShare
        assert_eq!(std::mem::offset_of!(Config, blocking), 16);
        assert_eq!(std::mem::offset_of!(Config, net_name), 32);
        let c = Config::new(false);
        assert_eq!(c.size, 44, "the bytes NCCL copies end at splitShare");
        assert_eq!(
            (c.blocking, c.min_ctas, c.magic),
            (0, c_int::MIN, 0xcafe_beef)
        );
    }
}
