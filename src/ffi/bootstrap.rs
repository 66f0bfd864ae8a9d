//! The embedded bootstrap server over the C ABI (`PdxBootstrapServer`).

use super::ptr::{self, Versioned};
use super::{boundary, ok, PdxStatus};
use crate::bootstrap::{BootstrapServer, ServerConfig};
use std::ffi::c_char;

/// Version of the bootstrap JSON schema (registrations, hellos) this library speaks.
pub const PDXFER_BOOTSTRAP_SCHEMA_VERSION: u32 = 1;

/// Opaque handle of a running bootstrap server.
pub struct PdxBootstrapServer {
    inner: BootstrapServer,
}

/// How to start a bootstrap server (`pdxfer_bootstrap_server_start`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxBootstrapServerConfig {
    /// `sizeof(PdxBootstrapServerConfig)`, set by the caller.
    pub struct_size: u64,
    /// Listen address, e.g. `"127.0.0.1:0"` (port 0 picks a free port); NULL means `127.0.0.1:0`.
    pub listen: *const c_char,
    /// Shared token for writes and endpoint reads; NULL for none. Copied.
    pub token: *const c_char,
    /// Largest accepted request body in bytes; 0 for the default (4 MiB).
    pub max_body_bytes: u64,
    /// Most connections served at once (more are answered 503 and closed);
    /// 0 for the default (256).
    pub max_connections: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

// SAFETY: repr(C), starts with u64 struct_size, integers and raw pointers only (zero is valid).
unsafe impl Versioned for PdxBootstrapServerConfig {
    const MIN_SIZE: usize = std::mem::size_of::<PdxBootstrapServerConfig>();
    const NAME: &'static str = "PdxBootstrapServerConfig";
}

/// Starts a bootstrap server; `*out` receives the handle (stop it with
/// `pdxfer_bootstrap_server_stop`).
#[no_mangle]
pub extern "C" fn pdxfer_bootstrap_server_start(
    config: *const PdxBootstrapServerConfig,
    out: *mut *mut PdxBootstrapServer,
) -> PdxStatus {
    boundary(|| {
        let c = ptr::read_versioned(config)?;
        let d = ServerConfig::default();
        let cfg = ServerConfig {
            listen: ptr::opt_c_str(c.listen, "config.listen")?.map_or(d.listen, str::to_string),
            token: ptr::opt_c_str(c.token, "config.token")?.map(str::to_string),
            max_body_bytes: if c.max_body_bytes == 0 {
                d.max_body_bytes
            } else {
                usize::try_from(c.max_body_bytes).unwrap_or(usize::MAX)
            },
            max_connections: if c.max_connections == 0 {
                d.max_connections
            } else {
                c.max_connections as usize
            },
            max_per_source: d.max_per_source,
            header_timeout: d.header_timeout,
            body_timeout: d.body_timeout,
            max_entries: d.max_entries,
            max_store_bytes: d.max_store_bytes,
            // The C struct has no such field: its callers keep serving any
            // address they name, with the server's warning when open.
            insecure: true,
        };
        let inner = BootstrapServer::start(cfg)?;
        ptr::new_handle(PdxBootstrapServer { inner }, out, "out")?;
        ok()
    })
}

/// Writes the server's URL (`"http://127.0.0.1:PORT"`, NUL-terminated) into
/// `buf` of `capacity` bytes; the needed size goes to `out_len` (NULL buffer
/// and capacity 0: size query).
#[no_mangle]
pub extern "C" fn pdxfer_bootstrap_server_url(
    server: *const PdxBootstrapServer,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let s = ptr::handle(server, "server")?;
        ptr::fill_str(&s.inner.url(), buf, capacity, out_len, "buf")
    })
}

/// Stops the server, joins its threads and frees the handle. NULL is a no-op.
///
/// Threads: every other call on the same `PdxBootstrapServer` may run concurrently with the others,
/// from any thread. This one may not race any of them: it frees the handle,
/// so no call on the same `PdxBootstrapServer` may be in flight when it starts, and none may start
/// after it. (The Python package enforces this: its `BootstrapServer.stop()` waits for the
/// calls in flight and refuses later ones with a typed error.)
#[no_mangle]
pub extern "C" fn pdxfer_bootstrap_server_stop(server: *mut PdxBootstrapServer) -> PdxStatus {
    boundary(|| {
        if let Some(s) = ptr::take_handle(server) {
            s.inner.stop();
        }
        ok()
    })
}

#[cfg(test)]
mod tests {
    use super::super::bootstrap_client::*;
    use super::super::registration::*;
    use super::*;
    use crate::bootstrap::schema::SCHEMA_VERSION;
    use crate::bootstrap::{InstanceId, PeerHello, Registration, Role};
    use crate::layout::Topology;
    use std::ffi::{CStr, CString};
    use std::ptr::{null, null_mut};

    fn last_error() -> String {
        // SAFETY: pdxfer_last_error returns a NUL-terminated thread-local string.
        unsafe { CStr::from_ptr(crate::ffi::status::pdxfer_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    /// Calls `f(buf, cap, out_len)` with a size query first, then a right-sized buffer.
    fn get_string(f: impl Fn(*mut c_char, usize, *mut usize) -> PdxStatus) -> String {
        let mut need = 0usize;
        assert_eq!(
            f(null_mut(), 0, &mut need),
            PdxStatus::Ok,
            "{}",
            last_error()
        );
        assert!(need > 1);
        let mut small = vec![0 as c_char; need - 1];
        assert_eq!(
            f(small.as_mut_ptr(), small.len(), &mut need),
            PdxStatus::BufferTooSmall
        );
        let mut buf = vec![0 as c_char; need];
        assert_eq!(f(buf.as_mut_ptr(), buf.len(), &mut need), PdxStatus::Ok);
        // SAFETY: the library wrote a NUL-terminated string into buf.
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn struct_sizes_are_pinned() {
        assert_eq!(std::mem::size_of::<PdxBootstrapServerConfig>(), 40);
        assert_eq!(PDXFER_BOOTSTRAP_SCHEMA_VERSION, SCHEMA_VERSION);
    }

    #[test]
    fn server_client_register_lookup_verify_over_the_c_abi() {
        let token = CString::new("tok").unwrap();
        let cfg = PdxBootstrapServerConfig {
            struct_size: std::mem::size_of::<PdxBootstrapServerConfig>() as u64,
            listen: null(),
            token: token.as_ptr(),
            max_body_bytes: 0,
            max_connections: 16,
            reserved: 0,
        };
        let mut srv = null_mut();
        assert_eq!(pdxfer_bootstrap_server_start(&cfg, &mut srv), PdxStatus::Ok);
        let url = get_string(|b, c, n| pdxfer_bootstrap_server_url(srv, b, c, n));
        assert!(url.starts_with("http://127.0.0.1:"), "{url}");
        let curl = CString::new(url).unwrap();
        let mut client = null_mut();
        assert_eq!(
            pdxfer_bootstrap_client_open(curl.as_ptr(), token.as_ptr(), &mut client),
            PdxStatus::Ok
        );

        // Register a prefill rank with instance id left for the library to draw.
        let mut reg = Registration::new(
            "ffi",
            Role::Prefill,
            InstanceId(0),
            Topology::single_mla(64, 2, 1152),
        );
        reg.endpoints.insert("tcp".into(), "127.0.0.1:9".into());
        let json = CString::new(serde_json::to_string(&reg).unwrap()).unwrap();
        let mut handle = null_mut();
        assert_eq!(
            pdxfer_bootstrap_register(client, json.as_ptr(), 5000, &mut handle),
            PdxStatus::Ok,
            "{}",
            last_error()
        );
        let mine: Registration = serde_json::from_str(&get_string(|b, c, n| {
            pdxfer_registration_json(handle, b, c, n)
        }))
        .unwrap();
        assert_ne!(mine.instance_id, InstanceId(0));
        assert!(mine.epoch > 0);

        let (cl, pf) = (
            CString::new("ffi").unwrap(),
            CString::new("prefill").unwrap(),
        );
        let key = CString::new("dp0-tp0-cp0-pp0").unwrap();
        let got = get_string(|b, c, n| {
            pdxfer_bootstrap_lookup(client, cl.as_ptr(), pf.as_ptr(), key.as_ptr(), b, c, n)
        });
        let got: Registration = serde_json::from_str(&got).unwrap();
        assert_eq!(got, mine);
        let sum = get_string(|b, c, n| {
            pdxfer_bootstrap_summary(client, cl.as_ptr(), pf.as_ptr(), b, c, n)
        });
        assert!(sum.contains("\"ready\":true"), "{sum}");

        // The handshake re-check: the advertised entry and its own hello pass...
        let hello = get_string(|b, c, n| pdxfer_registration_hello_json(handle, b, c, n));
        let mut dec = Registration::new(
            "ffi",
            Role::Decode,
            InstanceId(5),
            Topology::single_mla(64, 2, 1152),
        );
        dec.topology.dcp_size = 2;
        let local = CString::new(serde_json::to_string(&dec).unwrap()).unwrap();
        let adv = CString::new(serde_json::to_string(&got).unwrap()).unwrap();
        let h = CString::new(hello.clone()).unwrap();
        let compat = get_string(|b, c, n| {
            pdxfer_bootstrap_verify_peer(adv.as_ptr(), h.as_ptr(), local.as_ptr(), b, c, n)
        });
        assert!(compat.contains("token_relayout"), "{compat}");
        // ...a hello from another instance is stale metadata, named.
        let mut other: PeerHello = serde_json::from_str(&hello).unwrap();
        other.instance_id = InstanceId(77);
        let h2 = CString::new(serde_json::to_string(&other).unwrap()).unwrap();
        let mut n = 0usize;
        assert_eq!(
            pdxfer_bootstrap_verify_peer(
                adv.as_ptr(),
                h2.as_ptr(),
                local.as_ptr(),
                null_mut(),
                0,
                &mut n
            ),
            PdxStatus::StaleMetadata
        );
        assert!(last_error().contains(&InstanceId(77).to_string()));

        // Errors: unknown rank, NULL and non-UTF-8 arguments, a malformed registration.
        let k1 = CString::new("dp0-tp1-cp0-pp0").unwrap();
        assert_eq!(
            pdxfer_bootstrap_lookup(
                client,
                cl.as_ptr(),
                pf.as_ptr(),
                k1.as_ptr(),
                null_mut(),
                0,
                &mut n
            ),
            PdxStatus::NotRegistered
        );
        assert_eq!(
            pdxfer_bootstrap_lookup(
                null(),
                cl.as_ptr(),
                pf.as_ptr(),
                k1.as_ptr(),
                null_mut(),
                0,
                &mut n
            ),
            PdxStatus::NullArgument
        );
        let bad_utf8 = [0xffu8 as c_char, 0];
        assert_eq!(
            pdxfer_bootstrap_summary(
                client,
                bad_utf8.as_ptr(),
                pf.as_ptr(),
                null_mut(),
                0,
                &mut n
            ),
            PdxStatus::InvalidUtf8
        );
        let junk = CString::new("{\"cluster\": 3}").unwrap();
        let mut h3 = null_mut();
        assert_eq!(
            pdxfer_bootstrap_register(client, junk.as_ptr(), 5000, &mut h3),
            PdxStatus::InvalidArgument
        );
        assert!(h3.is_null());

        assert_eq!(pdxfer_registration_deregister(handle), PdxStatus::Ok);
        assert_eq!(
            pdxfer_bootstrap_lookup(
                client,
                cl.as_ptr(),
                pf.as_ptr(),
                key.as_ptr(),
                null_mut(),
                0,
                &mut n
            ),
            PdxStatus::NotRegistered
        );
        assert_eq!(pdxfer_registration_destroy(null_mut()), PdxStatus::Ok);
        assert_eq!(pdxfer_bootstrap_client_close(client), PdxStatus::Ok);
        assert_eq!(pdxfer_bootstrap_server_stop(srv), PdxStatus::Ok);
        assert_eq!(pdxfer_bootstrap_server_stop(null_mut()), PdxStatus::Ok);
    }
}
