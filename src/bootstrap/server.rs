//! The embedded HTTP/JSON bootstrap server (tiny_http, worker threads).
//!
//! Routes (all JSON; errors are `{"error": kind, "code": n, "detail": text}`):
//!
//! | method and path | token | answer |
//! |---|---|---|
//! | `GET /health` | no | `{"status":"ok"}` |
//! | `GET /metrics` | no | Prometheus text |
//! | `POST /v1/register` (body [`RegisterRequest`]) | yes | [`RegisterAck`] |
//! | `POST /v1/leases/{id}/keepalive` | yes | `{}`; 404 expired, 409 replaced |
//! | `DELETE /v1/leases/{id}` | yes | `{}`; 404 unknown |
//! | `GET /v1/clusters/{cluster}/{role}/summary` | no | [`Summary`](super::schema::Summary) (no endpoints) |
//! | `GET /v1/clusters/{cluster}/{role}/ranks` | yes | every live entry, current and stale |
//! | `GET /v1/clusters/{cluster}/{role}/ranks/{dpN-tpN-cpN-ppN}` | yes | the current entry; 404 none, 409 stale |
//!
//! Status codes: 400 malformed or invalid (the detail names the field), 401
//! missing or wrong token, 404 unknown route/rank/lease, 409 stale, 413 body
//! over the limit. A refused request changes nothing.

use super::schema::{from_json, validate_cluster, RankKey, RegisterRequest, Role};
use super::store::{MemStore, Store};
use crate::error::{Error, Result, Status};
use std::collections::BTreeMap;
use std::io::Read;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use subtle::ConstantTimeEq;

/// Default largest request body (4 MiB: room for tens of thousands of region descriptors).
/// cbindgen:ignore
pub const DEFAULT_MAX_BODY: usize = 4 << 20;

/// How to run a bootstrap server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// Shared token required for writes and for reading endpoint data.
    pub token: Option<String>,
    /// Largest accepted request body in bytes (larger: 413).
    pub max_body_bytes: usize,
    /// Worker threads answering requests.
    pub workers: usize,
    /// Most live entries the store holds (new keys beyond it: 503).
    pub max_entries: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:0".into(),
            token: None,
            max_body_bytes: DEFAULT_MAX_BODY,
            workers: 4,
            max_entries: super::store::DEFAULT_MAX_ENTRIES,
        }
    }
}

#[derive(Default)]
struct HttpStats {
    by_code: BTreeMap<u16, u64>,
    rejected: BTreeMap<&'static str, u64>,
}

struct Shared {
    store: Arc<MemStore>,
    token: Option<Vec<u8>>,
    max_body: usize,
    stats: Mutex<HttpStats>,
}

/// A running bootstrap server; stopped by [`stop`](Self::stop) or on drop.
pub struct BootstrapServer {
    addr: SocketAddr,
    server: Arc<tiny_http::Server>,
    shared: Arc<Shared>,
    running: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

impl BootstrapServer {
    /// Binds `cfg.listen` and starts the worker threads.
    pub fn start(cfg: ServerConfig) -> Result<BootstrapServer> {
        if cfg.token.as_deref() == Some("") {
            return Err(Error::invalid(
                "token: an empty token would accept every request; omit it instead",
            ));
        }
        let cannot = |e: &dyn std::fmt::Display| {
            Error::new(
                Status::Bootstrap,
                format!("cannot listen on {}: {e}", cfg.listen),
            )
        };
        let listener = std::net::TcpListener::bind(&cfg.listen).map_err(|e| cannot(&e))?;
        set_nodelay(&listener);
        let server = tiny_http::Server::from_listener(listener, None).map_err(|e| cannot(&e))?;
        let addr = server.server_addr().to_ip().ok_or_else(|| {
            Error::new(Status::Bootstrap, "bootstrap server is not on an IP socket")
        })?;
        let server = Arc::new(server);
        let shared = Arc::new(Shared {
            store: Arc::new(MemStore::with_max_entries(cfg.max_entries)),
            token: cfg.token.map(String::into_bytes),
            max_body: cfg.max_body_bytes,
            stats: Mutex::new(HttpStats::default()),
        });
        let running = Arc::new(AtomicBool::new(true));
        let mut workers = Vec::new();
        for i in 0..cfg.workers.max(1) {
            let (server, shared, running) = (server.clone(), shared.clone(), running.clone());
            let h = std::thread::Builder::new()
                .name(format!("pdxfer-bootstrap-{i}"))
                .spawn(move || {
                    while running.load(Ordering::Acquire) {
                        match server.recv_timeout(Duration::from_millis(200)) {
                            Ok(Some(req)) => handle(&shared, req),
                            Ok(None) => {}
                            Err(_) => break,
                        }
                    }
                })
                .map_err(|e| {
                    Error::new(Status::Io, format!("cannot start bootstrap worker: {e}"))
                })?;
            workers.push(h);
        }
        Ok(BootstrapServer {
            addr,
            server,
            shared,
            running,
            workers,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, for clients.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The server's store, for in-process registration by the prefill leader.
    pub fn store(&self) -> Arc<MemStore> {
        self.shared.store.clone()
    }

    /// Stops accepting requests and joins the workers.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.running.store(false, Ordering::Release);
        for _ in 0..self.workers.len() {
            self.server.unblock();
        }
        for h in self.workers.drain(..) {
            // A worker that panicked has nothing left to clean up.
            let _ = h.join();
        }
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Sets TCP_NODELAY on the listening socket; Linux copies it to every
/// accepted connection. tiny_http writes a response's head and body
/// separately, and without it a kept-alive connection stalls on Nagle's
/// algorithm against the client's delayed ACK (~40 ms per request).
fn set_nodelay(l: &std::net::TcpListener) {
    use std::os::fd::AsRawFd;
    let one: libc::c_int = 1;
    // SAFETY: the fd is open for the lifetime of `l`; the option value is a c_int that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            l.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    // Failure only costs latency, never correctness.
    let _ = rc;
}

/// HTTP status for a pdxfer status.
pub fn http_code(s: Status) -> u16 {
    match s {
        Status::Ok => 200,
        Status::Unauthorized => 401,
        Status::NotRegistered => 404,
        Status::StaleMetadata => 409,
        Status::PayloadTooLarge => 413,
        Status::NotReady | Status::Bootstrap => 503,
        Status::InvalidArgument
        | Status::InvalidUtf8
        | Status::InvalidTopology
        | Status::InvalidLayout
        | Status::GeometryMismatch
        | Status::NullArgument => 400,
        _ => 500,
    }
}

/// The JSON error body for `e`.
pub fn error_body(e: &Error) -> String {
    serde_json::json!({"error": e.kind(), "code": e.status() as i32, "detail": e.detail()})
        .to_string()
}

struct Reply {
    code: u16,
    body: String,
    content_type: &'static str,
}

fn json_reply<T: serde::Serialize>(v: &T) -> Result<Reply> {
    Ok(Reply {
        code: 200,
        body: serde_json::to_string(v)
            .map_err(|e| Error::new(Status::Bootstrap, format!("cannot encode answer: {e}")))?,
        content_type: "application/json",
    })
}

fn handle(shared: &Shared, mut req: tiny_http::Request) {
    let reply = match route(shared, &mut req) {
        Ok(r) => r,
        Err(e) => {
            let reason = match e.status() {
                Status::Unauthorized => Some("unauthorized"),
                Status::PayloadTooLarge => Some("too_large"),
                s if http_code(s) == 400 => Some("malformed"),
                _ => None,
            };
            if let Some(r) = reason {
                let mut st = shared.stats.lock().unwrap_or_else(|p| p.into_inner());
                *st.rejected.entry(r).or_default() += 1;
            }
            Reply {
                code: http_code(e.status()),
                body: error_body(&e),
                content_type: "application/json",
            }
        }
    };
    {
        let mut st = shared.stats.lock().unwrap_or_else(|p| p.into_inner());
        *st.by_code.entry(reply.code).or_default() += 1;
    }
    let mut resp = tiny_http::Response::from_string(reply.body).with_status_code(reply.code);
    // Both parts are static ASCII, so this always succeeds.
    if let Ok(ct) =
        tiny_http::Header::from_bytes(&b"Content-Type"[..], reply.content_type.as_bytes())
    {
        resp = resp.with_header(ct);
    }
    // One request per connection: an idle kept-alive connection would hold one
    // of tiny_http's connection threads, and enough of them starve new
    // clients. Registration and lookups are rare; a reconnect costs little.
    if let Ok(c) = tiny_http::Header::from_bytes(&b"Connection"[..], &b"close"[..]) {
        resp = resp.with_header(c);
    }
    // The client may have gone away; nothing to do then.
    let _ = req.respond(resp);
}

fn authorize(shared: &Shared, req: &tiny_http::Request) -> Result<()> {
    let Some(token) = &shared.token else {
        return Ok(());
    };
    let given = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("Authorization"))
        .map(|h| h.value.as_str());
    let Some(given) = given else {
        return Err(Error::new(
            Status::Unauthorized,
            "this bootstrap requires a token: send `Authorization: Bearer <token>`",
        ));
    };
    let presented = given.strip_prefix("Bearer ").unwrap_or("").as_bytes();
    // Constant time in the token's content (the length may still show).
    if bool::from(presented.ct_eq(token.as_slice())) {
        Ok(())
    } else {
        Err(Error::new(
            Status::Unauthorized,
            "wrong bootstrap token (expected `Authorization: Bearer <token>`)",
        ))
    }
}

fn read_body(shared: &Shared, req: &mut tiny_http::Request) -> Result<Vec<u8>> {
    let limit = shared.max_body;
    if let Some(n) = req.body_length() {
        if n > limit {
            return Err(Error::new(
                Status::PayloadTooLarge,
                format!("request body is {n} bytes, the limit is {limit}"),
            ));
        }
    }
    let mut buf = Vec::new();
    req.as_reader()
        .take(limit as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|e| Error::invalid(format!("cannot read the request body: {e}")))?;
    if buf.len() > limit {
        return Err(Error::new(
            Status::PayloadTooLarge,
            format!("request body exceeds the limit of {limit} bytes"),
        ));
    }
    Ok(buf)
}

fn parse_lease(s: &str) -> Result<u64> {
    s.parse()
        .map_err(|_| Error::invalid(format!("lease id must be an unsigned integer, got {s:?}")))
}

fn not_found(method: &str, path: &str) -> Error {
    Error::new(
        Status::NotRegistered,
        format!("no route {method} {path}; see the routes in the pdxfer bootstrap docs"),
    )
}

fn route(shared: &Shared, req: &mut tiny_http::Request) -> Result<Reply> {
    let method = req.method().as_str().to_string();
    let url = req.url().to_string();
    let path = url.split('?').next().unwrap_or("");
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let store = &shared.store;
    match (method.as_str(), parts.as_slice()) {
        ("GET", ["health"]) => json_reply(&serde_json::json!({"status": "ok"})),
        ("GET", ["metrics"]) => Ok(Reply {
            code: 200,
            body: metrics_text(shared),
            content_type: "text/plain; version=0.0.4",
        }),
        ("POST", ["v1", "register"]) => {
            authorize(shared, req)?;
            let body = read_body(shared, req)?;
            let r: RegisterRequest = from_json(&body, "registration request")?;
            let ack = store.register(&r.registration, Duration::from_millis(r.ttl_ms))?;
            json_reply(&ack)
        }
        ("POST", ["v1", "leases", id, "keepalive"]) => {
            authorize(shared, req)?;
            store.keepalive(parse_lease(id)?)?;
            json_reply(&serde_json::json!({}))
        }
        ("DELETE", ["v1", "leases", id]) => {
            authorize(shared, req)?;
            store.deregister(parse_lease(id)?)?;
            json_reply(&serde_json::json!({}))
        }
        ("GET", ["v1", "clusters", cluster, role, rest @ ..]) => {
            validate_cluster(cluster)?;
            let role = Role::parse(role)?;
            match rest {
                ["summary"] => json_reply(&store.summary(cluster, role)?),
                ["ranks"] => {
                    authorize(shared, req)?;
                    json_reply(&store.entries(cluster, role)?)
                }
                ["ranks", key] => {
                    authorize(shared, req)?;
                    let key = RankKey::parse(key)?;
                    json_reply(&store.lookup(cluster, role, &key)?)
                }
                _ => Err(not_found(&method, path)),
            }
        }
        _ => Err(not_found(&method, path)),
    }
}

fn metrics_text(shared: &Shared) -> String {
    use std::fmt::Write;
    let s = shared.store.stats();
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, u64)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    let counts: [(&str, &str, &str, u64); 7] = [
        (
            "pdxfer_bootstrap_registrations_total",
            "counter",
            "Successful registrations.",
            s.registrations,
        ),
        (
            "pdxfer_bootstrap_replacements_total",
            "counter",
            "Registrations that atomically replaced an entry at the same rank key.",
            s.replacements,
        ),
        (
            "pdxfer_bootstrap_expirations_total",
            "counter",
            "Entries removed because their lease was not kept alive.",
            s.expirations,
        ),
        (
            "pdxfer_bootstrap_deregistrations_total",
            "counter",
            "Entries removed by deregistration.",
            s.deregistrations,
        ),
        (
            "pdxfer_bootstrap_keepalives_total",
            "counter",
            "Successful lease keep-alives.",
            s.keepalives,
        ),
        (
            "pdxfer_bootstrap_entries",
            "gauge",
            "Live entries.",
            s.entries,
        ),
        ("pdxfer_bootstrap_leases", "gauge", "Live leases.", s.leases),
    ];
    for (name, kind, help, v) in counts {
        metric(name, kind, help, &[(String::new(), v)]);
    }
    let st = shared.stats.lock().unwrap_or_else(|p| p.into_inner());
    let codes: Vec<(String, u64)> = st
        .by_code
        .iter()
        .map(|(c, v)| (format!("{{code=\"{c}\"}}"), *v))
        .collect();
    metric(
        "pdxfer_bootstrap_http_requests_total",
        "counter",
        "HTTP requests answered, by status code (this scrape not included).",
        &codes,
    );
    let rejected: Vec<(String, u64)> = ["malformed", "too_large", "unauthorized"]
        .iter()
        .map(|r| {
            (
                format!("{{reason=\"{r}\"}}"),
                st.rejected.get(r).copied().unwrap_or(0),
            )
        })
        .collect();
    metric(
        "pdxfer_bootstrap_rejected_requests_total",
        "counter",
        "Requests refused with a 4xx before changing anything, by reason.",
        &rejected,
    );
    out
}
