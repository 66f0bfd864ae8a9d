//! The bootstrap server's routes: token checks, the JSON answers over the
//! store, error bodies and HTTP codes, and the Prometheus metrics text.

use super::http::Request;
use super::Shared;
use crate::bootstrap::schema::{from_json, validate_cluster, RankKey, RegisterRequest, Role};
use crate::bootstrap::store::Store;
use crate::error::{Error, Result, Status};
use std::sync::atomic::Ordering;
use std::time::Duration;
use subtle::ConstantTimeEq;

/// HTTP status for a pdxfer status.
pub fn http_code(s: Status) -> u16 {
    match s {
        Status::Ok => 200,
        Status::Unauthorized => 401,
        Status::NotRegistered => 404,
        Status::StaleMetadata => 409,
        Status::PayloadTooLarge => 413,
        Status::NotReady | Status::Bootstrap => 503,
        Status::StoreFull => 507,
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

pub(super) struct Reply {
    pub(super) code: u16,
    pub(super) body: String,
    pub(super) content_type: &'static str,
}

fn json_reply<T: serde::Serialize>(v: &T) -> Result<Reply> {
    Ok(Reply {
        code: 200,
        body: serde_json::to_string(v)
            .map_err(|e| Error::new(Status::Bootstrap, format!("cannot encode answer: {e}")))?,
        content_type: "application/json",
    })
}

/// The reply for a request refused before routing; counts the reason.
pub(super) fn error_reply(shared: &Shared, code: u16, e: &Error) -> Reply {
    let reason = match code {
        401 => Some("unauthorized"),
        408 => Some("timeout"),
        413 | 431 => Some("too_large"),
        400 | 411 => Some("malformed"),
        _ => None,
    };
    if let Some(r) = reason {
        let mut st = shared.stats.lock().unwrap_or_else(|p| p.into_inner());
        *st.rejected.entry(r).or_default() += 1;
    }
    Reply {
        code,
        body: error_body(e),
        content_type: "application/json",
    }
}

pub(super) fn answer(shared: &Shared, req: &Request) -> Option<Reply> {
    Some(match route(shared, req) {
        Ok(r) => r,
        Err(e) => error_reply(shared, http_code(e.status()), &e),
    })
}

fn authorize(shared: &Shared, req: &Request) -> Result<()> {
    let Some(token) = &shared.token else {
        return Ok(());
    };
    let Some(given) = req.authorization.as_deref() else {
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

fn route(shared: &Shared, req: &Request) -> Result<Reply> {
    let method = req.method.as_str();
    let path = req.path.split('?').next().unwrap_or("");
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let store = &shared.store;
    match (method, parts.as_slice()) {
        ("GET", ["health"]) => json_reply(&serde_json::json!({"status": "ok"})),
        ("GET", ["metrics"]) => Ok(Reply {
            code: 200,
            body: metrics_text(shared),
            content_type: "text/plain; version=0.0.4",
        }),
        ("POST", ["v1", "register"]) => {
            authorize(shared, req)?;
            let r: RegisterRequest = from_json(&req.body, "registration request")?;
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
                _ => Err(not_found(method, path)),
            }
        }
        _ => Err(not_found(method, path)),
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
    let counts: [(&str, &str, &str, u64); 8] = [
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
        (
            "pdxfer_bootstrap_store_bytes",
            "gauge",
            "Serialized size of the live entries (bounded by max_store_bytes).",
            s.bytes,
        ),
    ];
    for (name, kind, help, v) in counts {
        metric(name, kind, help, &[(String::new(), v)]);
    }
    let open = shared.lock_conns().live() as u64;
    let conn_counts: [(&str, &str, &str, u64); 4] = [
        (
            "pdxfer_bootstrap_connections",
            "gauge",
            "Connections being served (this scrape included).",
            open,
        ),
        (
            "pdxfer_bootstrap_refused_connections_total",
            "counter",
            "Connections answered 503 and closed because max_connections were being served, each past its request.",
            shared.refused_connections.load(Ordering::Relaxed),
        ),
        (
            "pdxfer_bootstrap_evicted_connections_total",
            "counter",
            "Connections still sending their request, shut down to make room for a newer one.",
            shared.evicted_connections.load(Ordering::Relaxed),
        ),
        (
            "pdxfer_bootstrap_accept_errors_total",
            "counter",
            "Failed accepts (e.g. EMFILE), each followed by a backoff.",
            shared.accept_errors.load(Ordering::Relaxed),
        ),
    ];
    for (name, kind, help, v) in conn_counts {
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
    let rejected: Vec<(String, u64)> = ["malformed", "timeout", "too_large", "unauthorized"]
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
