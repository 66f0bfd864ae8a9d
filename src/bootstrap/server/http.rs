//! HTTP/1.1 framing for the bootstrap server: one request read within the
//! header and body timeouts (parsed by `httparse`, bounded by
//! [`MAX_HEAD_BYTES`](super::MAX_HEAD_BYTES) and the body limit), one response written.

use super::{Shared, MAX_HEAD_BYTES};
use crate::error::{Error, Status};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const MAX_HEADERS: usize = 64;

pub(super) struct Request {
    pub(super) method: String,
    pub(super) path: String,
    pub(super) authorization: Option<String>,
    pub(super) body: Vec<u8>,
}

/// A refusal before routing: the HTTP code and the error.
pub(super) type Refusal = (u16, Error);

fn refusal(code: u16, status: Status, detail: impl Into<String>) -> Refusal {
    (code, Error::new(status, detail))
}

/// Reads `stream` until `deadline` into `buf`; `Ok(0)` at end of stream.
fn read_until(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<usize> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(buf) {
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Err(ErrorKind::TimedOut.into()),
            r => return r,
        }
    }
}

/// Reads one request: the head within the header timeout, then (after
/// checking `Content-Length` against the limit) the body within the body
/// timeout. `Ok(None)`: the client closed without sending anything.
pub(super) fn read_request(
    shared: &Shared,
    stream: &mut TcpStream,
) -> std::result::Result<Option<Request>, Refusal> {
    let timed_out = |what: &str, t: Duration| {
        refusal(
            408,
            Status::Timeout,
            format!("the {what} did not arrive within {} ms", t.as_millis()),
        )
    };
    let head_deadline = Instant::now() + shared.header_timeout;
    let mut buf: Vec<u8> = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let (head_len, mut req, content_length, expect_continue) = loop {
        let n = match read_until(stream, &mut chunk, head_deadline) {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) => {
                return Err(refusal(
                    400,
                    Status::InvalidArgument,
                    "the connection closed in the middle of the request headers",
                ))
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::TimedOut => {
                return Err(timed_out("request headers", shared.header_timeout))
            }
            Err(_) => return Ok(None),
        };
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Request::new(&mut headers);
        match parsed.parse(&buf) {
            Ok(httparse::Status::Complete(len)) => {
                let (req, cl, expect) = head_fields(&parsed)?;
                break (len, req, cl, expect);
            }
            Ok(httparse::Status::Partial) => {}
            Err(httparse::Error::TooManyHeaders) => {
                return Err(refusal(
                    431,
                    Status::InvalidArgument,
                    format!("more than {MAX_HEADERS} header lines"),
                ))
            }
            Err(e) => {
                return Err(refusal(
                    400,
                    Status::InvalidArgument,
                    format!("not an HTTP/1.x request: {e}"),
                ))
            }
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Err(refusal(
                431,
                Status::InvalidArgument,
                format!("request line and headers exceed {MAX_HEAD_BYTES} bytes"),
            ));
        }
    };
    let limit = shared.max_body;
    if content_length > limit as u64 {
        return Err(refusal(
            413,
            Status::PayloadTooLarge,
            format!("request body is {content_length} bytes, the limit is {limit}"),
        ));
    }
    let want = content_length as usize;
    let mut body = buf.split_off(head_len.min(buf.len()));
    if body.len() > want {
        // Pipelined bytes after the body: one request per connection.
        body.truncate(want);
    }
    if body.len() < want && expect_continue {
        let _ = stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
    }
    let body_deadline = Instant::now() + shared.body_timeout;
    while body.len() < want {
        let room = (want - body.len()).min(chunk.len());
        match read_until(stream, &mut chunk[..room], body_deadline) {
            Ok(0) => {
                return Err(refusal(
                    400,
                    Status::InvalidArgument,
                    format!(
                        "the connection closed after {} of {want} body bytes",
                        body.len()
                    ),
                ))
            }
            Ok(n) => body.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::TimedOut => {
                return Err(timed_out("request body", shared.body_timeout))
            }
            Err(_) => return Ok(None),
        }
    }
    req.body = body;
    Ok(Some(req))
}

/// The fields of a parsed head the routes use: the request, its declared
/// body length and whether the client waits for `100 Continue`.
fn head_fields(
    parsed: &httparse::Request<'_, '_>,
) -> std::result::Result<(Request, u64, bool), Refusal> {
    let bad = |d: String| refusal(400, Status::InvalidArgument, d);
    let mut content_length: Option<u64> = None;
    let mut authorization = None;
    let mut expect_continue = false;
    for h in parsed.headers.iter() {
        let value = std::str::from_utf8(h.value)
            .map_err(|_| bad(format!("header {}: not UTF-8", h.name)))?
            .trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            let n: u64 = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
                value.parse().unwrap_or(u64::MAX)
            } else {
                return Err(bad(format!(
                    "Content-Length: {value:?} is not a byte count"
                )));
            };
            if content_length.is_some_and(|m| m != n) {
                return Err(bad("two different Content-Length headers".into()));
            }
            content_length = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(refusal(
                411,
                Status::InvalidArgument,
                "Transfer-Encoding is not accepted; send the body with Content-Length",
            ));
        } else if h.name.eq_ignore_ascii_case("authorization") {
            authorization = Some(value.to_string());
        } else if h.name.eq_ignore_ascii_case("expect") {
            expect_continue = value.eq_ignore_ascii_case("100-continue");
        }
    }
    let req = Request {
        method: parsed.method.unwrap_or("").to_string(),
        path: parsed.path.unwrap_or("").to_string(),
        authorization,
        body: Vec::new(),
    };
    Ok((req, content_length.unwrap_or(0), expect_continue))
}

fn reason_phrase(code: u16) -> &'static str {
    match code {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        507 => "Insufficient Storage",
        _ => "Internal Server Error",
    }
}

/// One whole response (head and body in one buffer, one write).
pub(super) fn response_bytes(code: u16, content_type: &str, body: &str) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reason_phrase(code),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}
