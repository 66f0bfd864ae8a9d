//! A small HTTP responder for unauthenticated scrapes (an engine's
//! `/metrics`): request heads are read in one poll loop without a thread,
//! each within a whole-request deadline from its accept; connections still
//! sending their head are held in an [`Admission`] table (the oldest of the
//! source holding the most is closed for a newcomer, a source past its share
//! loses its oldest after the grace), so neither a client trickling a header
//! byte at a time nor a crowd of idle ones delays a real scrape. A whole
//! head is answered on a short thread of its own (at most
//! [`HttpLimits::max_answering`] at once, the excess answered `503`), so
//! answers are served concurrently and a client that does not read its
//! answer holds only its own thread, for at most the write timeout.

use crate::admission::{Admission, AdmitLimits, Source, DEFAULT_GRACE};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bounds of a [`serve`]d responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Connections still sending their request head.
    pub max_pending: usize,
    /// Connections of one source (all of loopback per uid) among them
    /// before its oldest is closed for its newcomer (after 1 s).
    pub max_per_source: usize,
    /// Time from accept to the end of the request head (then closed).
    pub request_deadline: Duration,
    /// Time an answer may take to be written.
    pub write_timeout: Duration,
    /// Largest request head (larger: `431`).
    pub max_head: usize,
    /// Answers being written at once (more: `503`).
    pub max_answering: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_pending: 64,
            max_per_source: 8,
            request_deadline: Duration::from_secs(2),
            write_timeout: Duration::from_secs(2),
            max_head: 8 * 1024,
            max_answering: 8,
        }
    }
}

/// One answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpReply {
    /// Status code.
    pub code: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// Body.
    pub body: String,
}

impl HttpReply {
    /// A plain-text answer.
    pub fn text(code: u16, body: impl Into<String>) -> HttpReply {
        HttpReply {
            code,
            content_type: "text/plain",
            body: body.into(),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let reason = match self.code {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            431 => "Request Header Fields Too Large",
            503 => "Service Unavailable",
            _ => "Internal Server Error",
        };
        let mut out = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.code,
            self.content_type,
            self.body.len()
        )
        .into_bytes();
        out.extend_from_slice(self.body.as_bytes());
        out
    }
}

/// The answer for a request (`method`, `path` with its query).
pub type Answer = Arc<dyn Fn(&str, &str) -> HttpReply + Send + Sync>;

struct Pending {
    stream: TcpStream,
    buf: Vec<u8>,
    /// `Some` once the head is whole (`Ok`), or refused with this answer.
    done: Option<Result<(), HttpReply>>,
    gone: bool,
}

/// Serves `l` until `stop()` says so (checked at least every 100 ms).
pub fn serve(l: TcpListener, limits: HttpLimits, stop: impl Fn() -> bool, answer: Answer) {
    if l.set_nonblocking(true).is_err() {
        return;
    }
    let answering = Arc::new(AtomicUsize::new(0));
    let mut pending: Admission<Pending> = Admission::new(AdmitLimits {
        max: limits.max_pending,
        per_source: limits.max_per_source,
        grace: DEFAULT_GRACE,
    });
    let mut next = 0u64;
    let mut pfds: Vec<libc::pollfd> = Vec::new();
    while !stop() {
        pfds.clear();
        pfds.push(libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        for p in pending.items_mut() {
            pfds.push(libc::pollfd {
                fd: p.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let now = Instant::now();
        let mut wait = Duration::from_millis(100);
        if let Some(since) = pending.oldest_since() {
            wait = wait.min((since + limits.request_deadline).saturating_duration_since(now));
        }
        let ms = wait.as_millis().clamp(1, 100) as libc::c_int;
        // SAFETY: pfds is a valid array of pfds.len() pollfds for the duration of the call.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        if n < 0 {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        for (p, pfd) in pending.items_mut().zip(pfds[1..].iter()) {
            if pfd.revents != 0 {
                read_head(p, limits.max_head);
            }
        }
        let deadline = limits.request_deadline;
        let done = pending
            .take_if(|_, p, since| p.gone || p.done.is_some() || since.elapsed() >= deadline);
        for p in done {
            let Some(head) = p.done else { continue }; // gone or out of time: closed
            let reply = match head {
                Err(r) => Some(r),
                Ok(_) if answering.load(Ordering::SeqCst) >= limits.max_answering => {
                    Some(HttpReply::text(503, "busy; retry shortly\n"))
                }
                Ok(_) => None,
            };
            if let Some(r) = reply {
                // best effort on the non-blocking socket: a short answer fits
                let mut s = p.stream;
                let _ = s.write(&r.bytes());
                let _ = s.shutdown(Shutdown::Write);
                continue;
            }
            let Ok((method, path)) = head_of(&p.buf) else {
                continue;
            };
            answering.fetch_add(1, Ordering::SeqCst);
            let (count, answer, mut s) = (answering.clone(), answer.clone(), p.stream);
            let spawned = crate::threads::spawn("pdxfer-http".into(), move || {
                let r = answer(&method, &path);
                let _ = s.set_nonblocking(false);
                let _ = s.set_write_timeout(Some(limits.write_timeout));
                let _ = s.write_all(&r.bytes());
                let _ = s.flush();
                count.fetch_sub(1, Ordering::SeqCst);
            });
            if spawned.is_err() {
                answering.fetch_sub(1, Ordering::SeqCst);
            }
        }
        for _ in 0..64 {
            match l.accept() {
                Ok((s, _)) => {
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let source = Source::of_stream(&s);
                    let now = Instant::now();
                    drop(pending.make_room(source, now));
                    pending.insert(
                        next,
                        source,
                        now,
                        Pending {
                            stream: s,
                            buf: Vec::new(),
                            done: None,
                            gone: false,
                        },
                    );
                    next += 1;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    // EMFILE and the like: free a descriptor, back off a little
                    drop(pending.take_oldest());
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
    }
}

/// The method and path of a whole head.
fn head_of(buf: &[u8]) -> std::result::Result<(String, String), ()> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => Ok((
            req.method.unwrap_or("").to_string(),
            req.path.unwrap_or("").to_string(),
        )),
        _ => Err(()),
    }
}

fn read_head(p: &mut Pending, max: usize) {
    let mut chunk = [0u8; 4096];
    loop {
        match p.stream.read(&mut chunk) {
            Ok(0) => {
                p.gone = true;
                return;
            }
            Ok(n) => {
                p.buf.extend_from_slice(&chunk[..n]);
                let mut headers = [httparse::EMPTY_HEADER; 32];
                let mut req = httparse::Request::new(&mut headers);
                match req.parse(&p.buf) {
                    Ok(httparse::Status::Complete(_)) => {
                        p.done = Some(Ok(()));
                        return;
                    }
                    Ok(httparse::Status::Partial) if p.buf.len() <= max => {}
                    Ok(httparse::Status::Partial) => {
                        p.done = Some(Err(HttpReply::text(431, "request head too large\n")));
                        return;
                    }
                    Err(_) => {
                        p.done = Some(Err(HttpReply::text(400, "bad request\n")));
                        return;
                    }
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => {
                p.gone = true;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn get(addr: std::net::SocketAddr) -> (String, Duration) {
        let t = Instant::now();
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut a = String::new();
        let _ = s.read_to_string(&mut a);
        (a, t.elapsed())
    }

    /// A client trickling its head and a crowd of idle ones delay no scrape;
    /// the trickler is closed at the whole-request deadline.
    #[test]
    fn slow_and_idle_clients_delay_no_scrape() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let limits = HttpLimits {
            max_pending: 8,
            request_deadline: Duration::from_millis(800),
            ..HttpLimits::default()
        };
        let t = std::thread::spawn(move || {
            serve(
                l,
                limits,
                move || st.load(Ordering::SeqCst),
                Arc::new(|m: &str, p: &str| match (m, p) {
                    ("GET", "/metrics") => HttpReply::text(200, "up 1\n"),
                    _ => HttpReply::text(404, "no\n"),
                }),
            )
        });
        let idle: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(b"GET /met").unwrap();
        for _ in 0..3 {
            let (a, took) = get(addr);
            assert!(
                a.starts_with("HTTP/1.1 200") && a.ends_with("up 1\n"),
                "{a:?}"
            );
            assert!(took < Duration::from_secs(1), "a scrape took {took:?}");
            let _ = slow.write_all(b"r");
        }
        // the trickler never finishes its head: closed at the deadline
        std::thread::sleep(Duration::from_millis(1000));
        slow.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut b = [0u8; 16];
        assert!(matches!(slow.read(&mut b), Ok(0) | Err(_)));
        let (a, _) = get(addr);
        assert!(a.starts_with("HTTP/1.1 200"), "{a:?}");
        drop(idle);
        stop.store(true, Ordering::SeqCst);
        t.join().unwrap();
    }
}
