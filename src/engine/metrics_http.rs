//! The engine's optional `/metrics` responder (`metrics_listen`): one thread
//! answering one short request at a time, `GET /metrics` with the Prometheus
//! text, anything else 404 (405 for another method). A connection has
//! [`IO_TIMEOUT`] to send its request head and take the answer; the thread
//! ends once the engine is closed or dropped.

use super::handle::{Engine, WeakInner};
use crate::error::{Error, Result, Status};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Time a scraper has to send its request head, and to take the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the idle responder looks whether the engine is still open.
const IDLE_POLL: Duration = Duration::from_millis(50);
/// Largest request head read.
const MAX_HEAD: usize = 8 * 1024;

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
    loop {
        let Some(inner) = w.upgrade() else { return };
        if inner.shared().closed.load(Ordering::Acquire) {
            return;
        }
        drop(inner);
        match l.accept() {
            Ok((s, _)) => {
                let _ = answer(&w, s);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(IDLE_POLL),
            // EMFILE and friends: back off like an idle loop
            Err(_) => std::thread::sleep(IDLE_POLL),
        }
    }
}

/// Reads one request head and answers it.
fn answer(w: &WeakInner, mut s: TcpStream) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut buf = vec![0u8; MAX_HEAD];
    let mut got = 0;
    let (method, path) = loop {
        let n = s.read(&mut buf[got..])?;
        if n == 0 {
            return Ok(());
        }
        got += n;
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf[..got]) {
            Ok(httparse::Status::Complete(_)) => {
                break (
                    req.method.unwrap_or("").to_string(),
                    req.path.unwrap_or("").to_string(),
                )
            }
            Ok(httparse::Status::Partial) if got < buf.len() => continue,
            _ => return reply(&mut s, 400, "text/plain", "bad request\n"),
        }
    };
    let route = path.split('?').next().unwrap_or("");
    match (method.as_str(), route) {
        ("GET", "/metrics") => {
            let Some(inner) = w.upgrade() else {
                return reply(&mut s, 503, "text/plain", "engine closed\n");
            };
            let text = Engine { inner }.metrics();
            reply(&mut s, 200, "text/plain; version=0.0.4", &text)
        }
        (_, "/metrics") => reply(&mut s, 405, "text/plain", "only GET /metrics\n"),
        _ => reply(&mut s, 404, "text/plain", "only GET /metrics\n"),
    }
}

fn reply(s: &mut TcpStream, code: u16, content_type: &str, body: &str) -> std::io::Result<()> {
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Service Unavailable",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    s.flush()
}
