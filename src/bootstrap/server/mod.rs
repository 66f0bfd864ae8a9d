//! The embedded HTTP/JSON bootstrap server: a bounded accept loop over
//! `httparse` (one short-lived thread per admitted connection, at most
//! [`ServerConfig::max_connections`] of them, served concurrently).
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
//! missing or wrong token, 404 unknown route/rank/lease, 408 headers or body
//! not received in time, 409 stale, 411 a body without `Content-Length`, 413
//! body over the limit (decided from the header, before reading a byte of
//! it, on every route), 431 headers over [`MAX_HEAD_BYTES`], 503 more
//! connections than the bound while every one of them is past its request
//! (answered at once and closed, never queued),
//! 507 a registration past the store's byte bound
//! ([`ServerConfig::max_store_bytes`]).
//! A refused request changes nothing. Every connection carries one request
//! (`Connection: close`).
//!
//! The server stays up under hostile clients: a connection holds its thread
//! for at most the header timeout plus the body timeout; while it is still
//! sending its request it can be evicted for a newcomer (an [`Admission`]
//! table: when the bound is reached, the oldest such connection of the
//! source holding the most is shut down; a source holding
//! [`ServerConfig::max_per_source`] loses its oldest once that one has
//! waited a second), so idle or slow connections cannot lock `/health` or a
//! real registration out; the accept loop
//! backs off (10 ms doubling to 500 ms) when accepting fails, e.g. on
//! EMFILE, and never exits until the server stops.

mod http;
mod routes;

use super::store::MemStore;
use crate::admission::{Admission, AdmitLimits, Source, DEFAULT_GRACE, DEFAULT_PER_SOURCE};
use crate::error::{Error, Result, Status};
use http::{read_request, response_bytes};
use routes::{answer, error_reply};
pub use routes::{error_body, http_code};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Default largest request body (4 MiB: room for tens of thousands of region descriptors).
/// cbindgen:ignore
pub const DEFAULT_MAX_BODY: usize = 4 << 20;
/// Default bound on connections served at once.
/// cbindgen:ignore
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Default time a client has to send its request line and headers.
/// cbindgen:ignore
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time a client has to send its body once the headers are in.
/// cbindgen:ignore
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest request line plus headers (larger: 431).
/// cbindgen:ignore
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Most header lines in one request (more: 431).
/// Time a client has to take its answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// After an early refusal (413, 408, ...) the server reads and discards what
/// the client is still sending, for at most this long and this many bytes,
/// so the client reads the answer instead of a connection reset.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES: usize = 1 << 20;
/// How often a waiting accept loop looks at the stop flag.
const ACCEPT_POLL_MS: libc::c_int = 200;
/// Backoff of the accept loop after a failed accept (EMFILE, ENFILE, ENOMEM, ...).
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_millis(500);
/// Stack of a connection thread (it parses one small request and routes it).
const CONN_STACK: usize = 256 * 1024;

/// How to run a bootstrap server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// Shared token required for writes and for reading endpoint data.
    pub token: Option<String>,
    /// Largest accepted request body in bytes (larger: 413, from the header).
    pub max_body_bytes: usize,
    /// Most connections served at once; past it a newcomer evicts a
    /// connection still sending its request (none: 503 and close).
    pub max_connections: usize,
    /// Connections one source (an IP address; all of loopback is one) holds
    /// while sending their requests before its oldest is evicted for its
    /// newcomer (once that one has waited a second).
    pub max_per_source: usize,
    /// Time from accepting a connection to the end of its headers (then 408).
    pub header_timeout: Duration,
    /// Time from the end of the headers to the end of the body (then 408).
    pub body_timeout: Duration,
    /// Most live entries the store holds (new keys beyond it: 503).
    pub max_entries: usize,
    /// Largest serialized size of the live entries together, in bytes (a
    /// registration past it: 507).
    pub max_store_bytes: usize,
    /// Serve a non-loopback address without a token (warned). Without it,
    /// such a server refuses to start.
    pub insecure: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:0".into(),
            token: None,
            max_body_bytes: DEFAULT_MAX_BODY,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_source: DEFAULT_PER_SOURCE,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_entries: super::store::DEFAULT_MAX_ENTRIES,
            max_store_bytes: super::store::DEFAULT_MAX_STORE_BYTES,
            insecure: false,
        }
    }
}

#[derive(Default)]
struct HttpStats {
    by_code: BTreeMap<u16, u64>,
    rejected: BTreeMap<&'static str, u64>,
}

/// The connections being served: their fds, so that stopping can shut them
/// down. A connection thread removes its entry and closes its socket under
/// this lock, so every fd listed here is open while the lock is held.
struct Conns {
    next_id: u64,
    open: HashMap<u64, RawFd>,
    /// The connections still sending their request (id, fd): evictable.
    reading: Admission<(u64, RawFd)>,
    /// Evicted connections whose threads have not ended yet (not counted
    /// against the bound).
    evicted: HashSet<u64>,
}

impl Conns {
    /// Connections counted against the bound.
    fn live(&self) -> usize {
        self.open.len() - self.evicted.len()
    }

    /// Shuts an evicted connection down: its thread's read ends, it answers
    /// nothing and forgets the connection.
    fn evict(&mut self, (id, fd): (u64, RawFd)) {
        self.evicted.insert(id);
        // SAFETY: fd is in `open` (a reading connection's thread removes it
        // from `reading` before it closes the socket, both under this lock),
        // so it is an open socket; shutdown does not close it.
        unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    }
}

struct Shared {
    store: Arc<MemStore>,
    token: Option<Vec<u8>>,
    max_body: usize,
    max_connections: usize,
    header_timeout: Duration,
    body_timeout: Duration,
    stats: Mutex<HttpStats>,
    conns: Mutex<Conns>,
    conns_done: Condvar,
    refused_connections: AtomicU64,
    evicted_connections: AtomicU64,
    accept_errors: AtomicU64,
    running: AtomicBool,
}

impl Shared {
    fn count(&self, code: u16, reason: Option<&'static str>) {
        let mut st = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        *st.by_code.entry(code).or_default() += 1;
        if let Some(r) = reason {
            *st.rejected.entry(r).or_default() += 1;
        }
    }

    fn lock_conns(&self) -> std::sync::MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running bootstrap server; stopped by [`stop`](Self::stop) or on drop.
pub struct BootstrapServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl BootstrapServer {
    /// Binds `cfg.listen` and starts the accept thread.
    pub fn start(cfg: ServerConfig) -> Result<BootstrapServer> {
        if cfg.token.as_deref() == Some("") {
            return Err(Error::invalid(
                "token: an empty token would accept every request; omit it instead",
            ));
        }
        if cfg.max_connections == 0 {
            return Err(Error::invalid(
                "max_connections: must be >= 1 (0 would refuse every client)",
            ));
        }
        if cfg.header_timeout.is_zero() || cfg.body_timeout.is_zero() {
            return Err(Error::invalid(
                "header_timeout/body_timeout: must be above zero",
            ));
        }
        let cannot = |e: &dyn std::fmt::Display| {
            Error::new(
                Status::Bootstrap,
                format!("cannot listen on {}: {e}", cfg.listen),
            )
        };
        let listener = TcpListener::bind(&cfg.listen).map_err(|e| cannot(&e))?;
        // Non-blocking, so a wake-up without a pending connection never blocks
        // the loop past a stop request.
        listener.set_nonblocking(true).map_err(|e| cannot(&e))?;
        let addr = listener.local_addr().map_err(|e| cannot(&e))?;
        check_open_listen(&addr, cfg.token.is_some(), cfg.insecure)?;
        let shared = Arc::new(Shared {
            store: Arc::new(MemStore::with_limits(cfg.max_entries, cfg.max_store_bytes)),
            token: cfg.token.map(String::into_bytes),
            max_body: cfg.max_body_bytes,
            max_connections: cfg.max_connections,
            header_timeout: cfg.header_timeout,
            body_timeout: cfg.body_timeout,
            stats: Mutex::new(HttpStats::default()),
            conns: Mutex::new(Conns {
                next_id: 0,
                open: HashMap::new(),
                reading: Admission::new(AdmitLimits {
                    max: cfg.max_connections,
                    per_source: cfg.max_per_source,
                    grace: DEFAULT_GRACE,
                }),
                evicted: HashSet::new(),
            }),
            conns_done: Condvar::new(),
            refused_connections: AtomicU64::new(0),
            evicted_connections: AtomicU64::new(0),
            accept_errors: AtomicU64::new(0),
            running: AtomicBool::new(true),
        });
        let sh = shared.clone();
        let acceptor = crate::threads::spawn("pdxfer-bootstrap-accept".into(), move || {
            accept_loop(&sh, &listener)
        })
        .map_err(|e| Error::new(Status::Io, format!("cannot start bootstrap server: {e}")))?;
        Ok(BootstrapServer {
            addr,
            shared,
            acceptor: Some(acceptor),
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

    /// Stops accepting, closes the listening socket, shuts down the
    /// connections being served and waits for their threads to finish.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.running.store(false, Ordering::Release);
        if let Some(h) = self.acceptor.take() {
            // The accept loop catches nothing that can panic; a panic would
            // have left nothing to clean up.
            let _ = h.join();
        }
        let mut conns = self.shared.lock_conns();
        for fd in conns.open.values() {
            // SAFETY: every fd in `open` is an open socket while the lock is
            // held (its thread closes it only under this lock); shutdown does
            // not close it, it only wakes the thread's blocked read or write.
            unsafe { libc::shutdown(*fd, libc::SHUT_RDWR) };
        }
        // Each woken thread finishes in about a syscall; the bound only
        // guards against a thread stuck elsewhere.
        let end = Instant::now() + Duration::from_secs(5);
        while !conns.open.is_empty() {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            conns = self
                .shared
                .conns_done
                .wait_timeout(conns, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Refuses a server without a token on a non-loopback address unless
/// `insecure` (`AuthRequired` naming the address and the fix); warns loudly
/// when `insecure` lets it start.
fn check_open_listen(addr: &SocketAddr, token: bool, insecure: bool) -> Result<()> {
    if token || addr.ip().is_loopback() {
        return Ok(());
    }
    if !insecure {
        return Err(Error::new(
            Status::AuthRequired,
            format!(
                "the bootstrap on {addr} is not loopback-bound and has no token: anyone who can reach it could register ranks and read every endpoint; set a token (--token or PDXFER_BOOTSTRAP_TOKEN), listen on 127.0.0.1, or pass --insecure to serve it open anyway"
            ),
        ));
    }
    log::warn!(
        "bootstrap on {addr}: NO TOKEN and not loopback-bound (--insecure): anyone who can reach it can register ranks and read every endpoint (set --token or PDXFER_BOOTSTRAP_TOKEN)"
    );
    Ok(())
}

/// Accepts until the server stops. A failed accept (EMFILE, ENFILE,
/// ENOBUFS, ENOMEM, ...) leaves the connection in the kernel's backlog and
/// makes the listener readable again at once, so the loop sleeps with a
/// doubling backoff instead of retrying: it neither exits nor spins.
fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    let mut backoff = Duration::ZERO;
    while shared.running.load(Ordering::Acquire) {
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd on the stack for the whole call, and the count is 1.
        let n = unsafe { libc::poll(&mut pfd, 1, ACCEPT_POLL_MS) };
        if n <= 0 {
            // Timeout or EINTR: look at the stop flag again.
            continue;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                backoff = Duration::ZERO;
                let source = Source::of_stream(&stream);
                admit(shared, stream, source);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::Interrupted | ErrorKind::ConnectionAborted
                ) => {}
            Err(_) => {
                shared.accept_errors.fetch_add(1, Ordering::Relaxed);
                backoff = (backoff * 2).clamp(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX);
                std::thread::sleep(backoff);
            }
        }
    }
}

/// Serves `stream` on its own thread, evicting a connection still sending
/// its request to make room when `max_connections` are being served, or
/// refuses it at once (503 and close) when every one of them is past its
/// request.
fn admit(shared: &Arc<Shared>, stream: TcpStream, source: Source) {
    let id = {
        let mut conns = shared.lock_conns();
        let now = Instant::now();
        let mut out = conns.reading.make_room(source, now);
        while conns.live() - out.len() >= shared.max_connections {
            match conns.reading.evict_one() {
                Some(x) => out.push(x),
                None => break,
            }
        }
        shared
            .evicted_connections
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        for x in out {
            conns.evict(x);
        }
        if conns.live() >= shared.max_connections {
            drop(conns);
            refuse(
                shared,
                stream,
                &format!(
                    "the bootstrap serves at most {} connections at once; retry shortly",
                    shared.max_connections
                ),
            );
            return;
        }
        let id = conns.next_id;
        conns.next_id += 1;
        conns.open.insert(id, stream.as_raw_fd());
        conns
            .reading
            .insert(id, source, now, (id, stream.as_raw_fd()));
        id
    };
    let sh = shared.clone();
    // The stream moves into the thread only if the spawn succeeds; keep a
    // second handle to it for the refusal otherwise.
    let slot = Arc::new(Mutex::new(Some(stream)));
    let slot2 = slot.clone();
    let builder = std::thread::Builder::new()
        .name("pdxfer-bootstrap-conn".into())
        .stack_size(CONN_STACK);
    let spawned = crate::threads::spawn_with(builder, move || {
        let stream = slot2.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(stream) = stream {
            serve(&sh, id, stream);
        }
    });
    if spawned.is_err() {
        let stream = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        let mut conns = shared.lock_conns();
        conns.reading.remove(id);
        conns.open.remove(&id);
        conns.evicted.remove(&id);
        drop(conns);
        if let Some(stream) = stream {
            refuse(
                shared,
                stream,
                "the bootstrap cannot start a thread; retry shortly",
            );
        }
    }
}

/// Answers 503 without waiting on the client and closes.
fn refuse(shared: &Shared, mut stream: TcpStream, detail: &str) {
    shared.refused_connections.fetch_add(1, Ordering::Relaxed);
    shared.count(503, None);
    let e = Error::new(Status::Bootstrap, detail);
    let bytes = response_bytes(503, "application/json", &error_body(&e));
    // A fresh socket's send buffer takes these few hundred bytes without
    // blocking; a client that cannot take them loses only its own answer.
    if stream.set_nonblocking(true).is_ok() {
        let _ = stream.write(&bytes);
    }
    let _ = stream.shutdown(Shutdown::Write);
}

/// Serves one connection and then forgets it.
fn serve(shared: &Shared, id: u64, mut stream: TcpStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let read = read_request(shared, &mut stream);
    let evicted = {
        let mut conns = shared.lock_conns();
        conns.reading.remove(id);
        conns.evicted.contains(&id)
    };
    let read = if evicted { Ok(None) } else { read };
    let (reply, linger) = match read {
        Ok(Some(req)) => (answer(shared, &req), false),
        // The client closed before sending a request: nothing to answer.
        Ok(None) => (None, false),
        Err((code, e)) => (Some(error_reply(shared, code, &e)), true),
    };
    if let Some(r) = reply {
        shared.count(r.code, None);
        let bytes = response_bytes(r.code, r.content_type, &r.body);
        // The client may have gone away; nothing to do then.
        if stream.write_all(&bytes).is_ok() && linger {
            let _ = stream.shutdown(Shutdown::Write);
            discard_rest(&mut stream);
        }
    }
    let mut conns = shared.lock_conns();
    conns.open.remove(&id);
    conns.evicted.remove(&id);
    // Closed under the lock: `shutdown` never sees a reused fd.
    drop(stream);
    drop(conns);
    shared.conns_done.notify_all();
}

/// Reads and drops what the client still sends, within [`LINGER`].
fn discard_rest(stream: &mut TcpStream) {
    let end = Instant::now() + LINGER;
    let mut buf = [0u8; 16 * 1024];
    let mut total = 0usize;
    while total < LINGER_BYTES {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => total += n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_registrations_answer_400() {
        for s in [
            Status::InvalidArgument,
            Status::InvalidTopology,
            Status::InvalidLayout,
            Status::GeometryMismatch,
        ] {
            assert_eq!(http_code(s), 400, "{s:?}");
        }
        assert_eq!(http_code(Status::NotRegistered), 404);
        assert_eq!(http_code(Status::StoreFull), 507);
    }

    #[test]
    fn an_open_non_loopback_listener_needs_insecure() {
        let any: SocketAddr = "0.0.0.0:8998".parse().unwrap();
        let e = check_open_listen(&any, false, false).unwrap_err();
        assert_eq!(e.status(), Status::AuthRequired);
        assert!(
            e.detail().contains("0.0.0.0:8998") && e.detail().contains("--insecure"),
            "{e}"
        );
        check_open_listen(&any, false, true).unwrap();
        check_open_listen(&any, true, false).unwrap();
        check_open_listen(&"127.0.0.1:1".parse().unwrap(), false, false).unwrap();
        check_open_listen(&"[::1]:1".parse().unwrap(), false, false).unwrap();
    }
}
