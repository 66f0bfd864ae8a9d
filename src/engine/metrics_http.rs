//! The engine's optional `/metrics` responder (`metrics_listen`): `GET
//! /metrics` with the Prometheus text, anything else 404 (405 for another
//! method), served by the bounded responder of [`crate::transport::http_serve`]
//! (request heads read in one poll loop within a whole-request deadline,
//! answers written concurrently, idle or trickling connections evicted for
//! newcomers), so no client can keep a scrape waiting. The responder ends
//! once the engine is closed or dropped.

use super::handle::{Engine, WeakInner};
use crate::error::{Error, Result, Status};
use crate::transport::http_serve::{self, HttpLimits, HttpReply};
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Binds the responder's listener on `addr` (`host:port`; port 0 picks one).
pub(super) fn bind(addr: &str) -> Result<TcpListener> {
    let l = TcpListener::bind(addr).map_err(|e| {
        Error::new(
            Status::Io,
            format!("metrics_listen {addr:?}: cannot listen: {e}"),
        )
    })?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Serves `/metrics` on `l` until the engine is closed or dropped.
pub(super) fn serve(w: WeakInner, l: TcpListener) {
    let stop = {
        let w = w.clone();
        move || {
            w.upgrade()
                .is_none_or(|inner| inner.shared().closed.load(Ordering::Acquire))
        }
    };
    let answer = Arc::new(move |method: &str, path: &str| {
        let route = path.split('?').next().unwrap_or("");
        match (method, route) {
            ("GET", "/metrics") => match w.upgrade() {
                Some(inner) => HttpReply {
                    code: 200,
                    content_type: "text/plain; version=0.0.4",
                    body: Engine {
                        inner,
                        room_keys: Default::default(),
                    }
                    .metrics(),
                },
                None => HttpReply::text(503, "engine closed\n"),
            },
            (_, "/metrics") => HttpReply::text(405, "only GET /metrics\n"),
            _ => HttpReply::text(404, "only GET /metrics\n"),
        }
    });
    http_serve::serve(l, HttpLimits::default(), stop, answer);
}
