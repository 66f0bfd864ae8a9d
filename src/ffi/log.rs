//! Log records to the host program: `pdxfer_set_log_callback`.
//!
//! The library logs through the `log` crate. A C, C++ or Python host has no
//! Rust logger, so this module installs one (the first time a callback is
//! set) that hands each record — level, target, message — to the host's
//! callback. Replacing the callback is safe while other threads log: it waits
//! until no thread is inside the previous callback, so the previous `user`
//! may be freed once `pdxfer_set_log_callback` returns.

use super::{boundary, PdxStatus};
use crate::error::{Error, Status};
use log::{LevelFilter, Log, Metadata, Record};
use std::cell::Cell;
use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{OnceLock, RwLock};

/// Log level: forward nothing (`pdxfer_set_log_callback` level only).
pub const PDXFER_LOG_OFF: u32 = 0;
/// Log level: errors.
pub const PDXFER_LOG_ERROR: u32 = 1;
/// Log level: warnings (refused pairings, fallbacks).
pub const PDXFER_LOG_WARN: u32 = 2;
/// Log level: informational (transports chosen, engines started).
pub const PDXFER_LOG_INFO: u32 = 3;
/// Log level: debugging detail.
pub const PDXFER_LOG_DEBUG: u32 = 4;
/// Log level: tracing detail.
pub const PDXFER_LOG_TRACE: u32 = 5;

/// A log callback: `user` as given to `pdxfer_set_log_callback`, the record's
/// `PDXFER_LOG_*` level, its target (the Rust module path, e.g.
/// `"pdxfer::bootstrap::peer"`) and its message, both NUL-terminated and valid
/// only during the call. It may be called from any thread, including threads
/// the library started; it must not unwind (no C++ exception may leave it).
pub type PdxLogFn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        level: u32,
        target: *const c_char,
        message: *const c_char,
    ),
>;

/// The host's callback and the most verbose level it wants.
struct Sink {
    f: unsafe extern "C" fn(*mut c_void, u32, *const c_char, *const c_char),
    user: *mut c_void,
    level: LevelFilter,
}

// SAFETY: `user` is opaque to the library and only handed back to the host's
// callback; the C contract of `pdxfer_set_log_callback` is that the callback
// may run on any thread with it.
unsafe impl Send for Sink {}
// SAFETY: as for Send: the library never dereferences `user`.
unsafe impl Sync for Sink {}

/// Readers are threads inside `log` (one callback call each); the writer is
/// `pdxfer_set_log_callback`, which therefore waits for calls in flight.
static SINK: RwLock<Option<Sink>> = RwLock::new(None);

/// Whether this module's logger became the process's `log` logger.
static INSTALLED: OnceLock<bool> = OnceLock::new();

thread_local! {
    /// True while this thread runs the host's callback: records logged from
    /// inside it are dropped (no re-entry), and replacing the callback from
    /// inside it is refused (it would wait for itself).
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// Resets [`IN_CALLBACK`] even if formatting or the callback path panics.
struct InCallback;

impl InCallback {
    fn enter() -> Option<InCallback> {
        if IN_CALLBACK.with(|c| c.replace(true)) {
            None
        } else {
            Some(InCallback)
        }
    }
}

impl Drop for InCallback {
    fn drop(&mut self) {
        IN_CALLBACK.with(|c| c.set(false));
    }
}

struct CallbackLogger;

static LOGGER: CallbackLogger = CallbackLogger;

fn level_code(l: log::Level) -> u32 {
    match l {
        log::Level::Error => PDXFER_LOG_ERROR,
        log::Level::Warn => PDXFER_LOG_WARN,
        log::Level::Info => PDXFER_LOG_INFO,
        log::Level::Debug => PDXFER_LOG_DEBUG,
        log::Level::Trace => PDXFER_LOG_TRACE,
    }
}

fn level_filter(code: u32) -> Option<LevelFilter> {
    Some(match code {
        PDXFER_LOG_OFF => LevelFilter::Off,
        PDXFER_LOG_ERROR => LevelFilter::Error,
        PDXFER_LOG_WARN => LevelFilter::Warn,
        PDXFER_LOG_INFO => LevelFilter::Info,
        PDXFER_LOG_DEBUG => LevelFilter::Debug,
        PDXFER_LOG_TRACE => LevelFilter::Trace,
        _ => return None,
    })
}

fn c_string(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).unwrap_or_default()
}

impl Log for CallbackLogger {
    fn enabled(&self, m: &Metadata) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, r: &Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let Some(_guard) = InCallback::enter() else {
            return; // logged from inside the host's callback
        };
        // A failing record must never break the code that logged it.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            let sink = SINK.read().unwrap_or_else(|p| p.into_inner());
            let Some(s) = sink.as_ref() else { return };
            if r.level() > s.level {
                return;
            }
            let target = c_string(r.target());
            let message = c_string(&r.args().to_string());
            // SAFETY: `f` and `user` are what the host registered; the strings
            // live until the call returns, as the callback's contract says.
            unsafe {
                (s.f)(
                    s.user,
                    level_code(r.level()),
                    target.as_ptr(),
                    message.as_ptr(),
                )
            };
        }));
    }

    fn flush(&self) {}
}

/// Sets the callback that receives the library's log records at `level`
/// (`PDXFER_LOG_ERROR` .. `PDXFER_LOG_TRACE`) and more severe, replacing any
/// previous one. `callback` NULL or `level` `PDXFER_LOG_OFF` turns forwarding off.
///
/// When it returns, the previous callback is running on no thread and will not
/// be called again, so its `user` may be freed. It must not be called from
/// inside the callback (`PDX_STATUS_INVALID_ARGUMENT`); records logged from
/// inside the callback are dropped. `PDX_STATUS_UNSUPPORTED` when the process
/// already has another Rust `log` logger (a Rust program linking the crate).
#[no_mangle]
pub extern "C" fn pdxfer_set_log_callback(
    level: u32,
    callback: PdxLogFn,
    user: *mut c_void,
) -> PdxStatus {
    boundary(|| {
        let filter = level_filter(level).ok_or_else(|| {
            Error::invalid(format!(
                "log level {level} is not a PDXFER_LOG_* level (0 off .. 5 trace)"
            ))
        })?;
        if IN_CALLBACK.with(|c| c.get()) {
            return Err(Error::invalid(
                "pdxfer_set_log_callback called from inside the log callback; it would wait for itself",
            ));
        }
        if !*INSTALLED.get_or_init(|| log::set_logger(&LOGGER).is_ok()) {
            return Err(Error::new(
                Status::Unsupported,
                "another Rust logger is installed in this process; the library's records go to it",
            ));
        }
        let mut sink = SINK.write().unwrap_or_else(|p| p.into_inner());
        *sink = match callback {
            Some(f) if filter != LevelFilter::Off => Some(Sink {
                f,
                user,
                level: filter,
            }),
            _ => None,
        };
        log::set_max_level(if sink.is_some() {
            filter
        } else {
            LevelFilter::Off
        });
        super::ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    static SEEN: Mutex<Vec<(u32, String, String)>> = Mutex::new(Vec::new());
    static CALLS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn record(user: *mut c_void, level: u32, t: *const c_char, m: *const c_char) {
        // SAFETY: the logger passes NUL-terminated strings valid during the call.
        let (t, m) = unsafe { (CStr::from_ptr(t), CStr::from_ptr(m)) };
        assert_eq!(user as usize, 7);
        if t.to_bytes() != b"pdxfer::test" {
            return; // a record of another test running at the same time
        }
        SEEN.lock().unwrap().push((
            level,
            t.to_string_lossy().into_owned(),
            m.to_string_lossy().into_owned(),
        ));
        // logging from inside the callback is dropped, replacing it is refused
        log::error!(target: "pdxfer::test", "from inside the callback");
        assert_eq!(
            pdxfer_set_log_callback(PDXFER_LOG_OFF, None, std::ptr::null_mut()),
            PdxStatus::InvalidArgument
        );
        CALLS.fetch_add(1, Ordering::SeqCst);
    }

    // One test: the logger and its callback are process-wide.
    #[test]
    fn records_reach_the_callback_at_its_level_until_it_is_removed() {
        let user = 7usize as *mut c_void;
        assert_eq!(
            pdxfer_set_log_callback(9, Some(record), user),
            PdxStatus::InvalidArgument
        );
        assert_eq!(
            pdxfer_set_log_callback(PDXFER_LOG_WARN, Some(record), user),
            PdxStatus::Ok
        );
        log::info!(target: "pdxfer::test", "below the level");
        log::warn!(target: "pdxfer::test", "room {} refused\0here", 5);
        let seen = SEEN.lock().unwrap().clone();
        assert_eq!(
            seen,
            vec![(
                PDXFER_LOG_WARN,
                "pdxfer::test".to_string(),
                "room 5 refused\\0here".to_string()
            )]
        );
        assert_eq!(
            pdxfer_set_log_callback(PDXFER_LOG_WARN, None, user),
            PdxStatus::Ok
        );
        log::error!(target: "pdxfer::test", "after removal");
        assert_eq!(CALLS.load(Ordering::SeqCst), 1);
        assert_eq!(log::max_level(), LevelFilter::Off);
    }
}
