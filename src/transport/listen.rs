//! A bounded listener for connections from peers that have not proved
//! anything yet (the agent's data plane, the engine's control port).
//!
//! Accepted connections wait in one poll set, without a thread, until their
//! first message arrived whole (a wire frame, or a control line), or, with
//! [`serve_exchange`], until a whole exchange of messages (the
//! authentication: hello, challenge, proof) is done, each message answered
//! from the poll loop; only then is a handler started. Two tables hold the connections that have not
//! proved anything yet, both an [`Admission`] table: the poll set
//! ([`ListenLimits::max_pending`]) and the handshakes, from the hand-off
//! until the handler calls [`Slot::established`]
//! ([`ListenLimits::max_handshakes`], a thread each). Neither refuses a
//! newcomer when full: the oldest connection of the source holding the most
//! is closed instead (a handshake's socket is shut down, which ends its
//! handler), and a source holding [`ListenLimits::max_per_source`] loses its
//! oldest once that one has waited [`ListenLimits::source_grace`]; so a
//! flood of idle or stalled connections cannot lock a real peer out, and one
//! source's flood closes mostly its own. Live connections
//! ([`ListenLimits::max_connections`]) are bounded too; their excess is
//! refused (closed), never queued. A first message that does not arrive
//! within [`ListenLimits::first_message_timeout`], or is larger than
//! [`ListenLimits::max_first_message`], closes the connection. When
//! `accept` fails for lack of descriptors or memory (`EMFILE`, `ENFILE`,
//! `ENOBUFS`, `ENOMEM`) the listener closes the connection that waited
//! longest (a descriptor for the next peer) and backs off (10 ms doubling to
//! 1 s) instead of polling the still-readable listener in a tight loop.

use crate::admission::{Admission, AdmitLimits, Source, DEFAULT_GRACE, DEFAULT_PER_SOURCE};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bounds of a [`serve_exchange`]d listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenLimits {
    /// Connections waiting for their first message (no thread each); when
    /// full, the oldest of the source holding the most is closed.
    pub max_pending: usize,
    /// Connections past their first message but not yet through their
    /// handshake (a thread each); when full, the oldest of the source
    /// holding the most is shut down.
    pub max_handshakes: usize,
    /// Connections one source (an IP address; all of loopback is one) holds
    /// in either table before its oldest is closed for its newcomer, once
    /// that one waited [`source_grace`](Self::source_grace).
    pub max_per_source: usize,
    /// How long a connection is safe from its own source's newcomers (a real
    /// handshake takes milliseconds, a burst of real peers from one host is
    /// not cut short).
    pub source_grace: Duration,
    /// Live connections handed to a handler (handshakes included); the
    /// excess is refused.
    pub max_connections: usize,
    /// How long a connection may take to send its first message (with
    /// [`serve_exchange`]: to finish the whole exchange), from its accept.
    pub first_message_timeout: Duration,
    /// Largest first message (with [`serve_exchange`]: each message of the
    /// exchange) accepted, in payload bytes (a frame without its
    /// 12-byte header, a line without its newline): the unauthenticated limit.
    pub max_first_message: usize,
}

impl Default for ListenLimits {
    fn default() -> Self {
        ListenLimits {
            max_pending: 256,
            max_handshakes: 32,
            max_per_source: DEFAULT_PER_SOURCE,
            source_grace: DEFAULT_GRACE,
            max_connections: 1024,
            first_message_timeout: Duration::from_secs(10),
            max_first_message: super::wire::MAX_UNAUTHENTICATED_PAYLOAD as usize,
        }
    }
}

/// How the first message of a connection ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// One wire control frame (`magic | version | type | len | payload`).
    Wire,
    /// One line ending in `\n`.
    Line,
}

impl Framing {
    /// `Some(n)`: the first message is `buf[..n]`; `None`: more is needed;
    /// `Err`: it can never be accepted (why, for the refusal).
    fn complete(self, buf: &[u8], max: usize) -> Result<Option<usize>, String> {
        match self {
            Framing::Wire => {
                if buf.len() >= 4 && buf[..4] != super::wire::MAGIC.to_le_bytes() {
                    return Err("the first bytes are not a pdxfer frame".into());
                }
                if buf.len() < 12 {
                    return Ok(None);
                }
                let len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]) as usize;
                let n = 12usize.saturating_add(len);
                if len > max {
                    return Err(format!(
                        "a first frame of {len} payload bytes: before authenticating, frames are at most {max} bytes"
                    ));
                }
                Ok((buf.len() >= n).then_some(n))
            }
            Framing::Line => match buf.iter().position(|&b| b == b'\n') {
                Some(i) if i > max => Err(format!(
                    "a first line of {i} bytes: before authenticating, lines are at most {max} bytes"
                )),
                Some(i) => Ok(Some(i + 1)),
                None if buf.len() > max => Err(format!(
                    "a first line of more than {max} bytes: before authenticating, lines are at most {max} bytes"
                )),
                None => Ok(None),
            },
        }
    }
}

/// A live connection's place under the listener's bounds: it counts as a
/// handshake (and may be shut down to make room for a newer one) until
/// [`established`](Self::established), and as a connection until dropped.
pub struct Slot {
    counts: Arc<Counts>,
    handshake: Option<u64>,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("handshake", &self.handshake)
            .finish()
    }
}

struct Counts {
    /// The handshakes: a second handle to each socket, to shut it down.
    handshakes: Mutex<Admission<TcpStream>>,
    next_id: AtomicU64,
    connections: AtomicUsize,
}

impl Default for Counts {
    fn default() -> Self {
        let l = ListenLimits::default();
        Counts {
            handshakes: Mutex::new(Admission::new(handshake_limits(&l))),
            next_id: AtomicU64::new(0),
            connections: AtomicUsize::new(0),
        }
    }
}

impl Counts {
    fn handshakes(&self) -> MutexGuard<'_, Admission<TcpStream>> {
        // every update is one insert or remove: a poisoned table is consistent
        self.handshakes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn handshake_limits(l: &ListenLimits) -> AdmitLimits {
    AdmitLimits {
        max: l.max_handshakes,
        per_source: l.max_per_source,
        grace: l.source_grace,
    }
}

impl Slot {
    /// The handshake succeeded: the connection no longer counts as one (and
    /// is no longer shut down for a newer one).
    pub fn established(&mut self) {
        if let Some(id) = self.handshake.take() {
            self.counts.handshakes().remove(id);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.established();
        self.counts.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Live connections of a listener, for tests and diagnostics.
#[derive(Clone, Default)]
pub struct ListenStats(Arc<Counts>);

impl std::fmt::Debug for ListenStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenStats")
            .field("connections", &self.connections())
            .field("handshakes", &self.handshakes())
            .finish()
    }
}

impl ListenStats {
    /// Connections handed to a handler and not yet ended.
    pub fn connections(&self) -> usize {
        self.0.connections.load(Ordering::SeqCst)
    }

    /// Connections handed to a handler and not yet established.
    pub fn handshakes(&self) -> usize {
        self.0.handshakes().len()
    }
}

/// How often a listener out of descriptors says so.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// A connection's exchange before its handler starts, driven message by
/// message by the poll loop (no thread): the authentication, so a peer
/// that stalls in it holds no thread and only a place in the poll set.
pub trait Exchange {
    /// What the handler gets when the exchange succeeded.
    type Done;
    /// One whole message arrived (its framing included: a whole frame, or
    /// a line with its newline).
    fn on_message(&mut self, msg: &[u8]) -> Turn<Self::Done>;
}

/// What an [`Exchange`] does with a message.
#[derive(Debug)]
pub enum Turn<D> {
    /// Send these bytes (at most a few KiB: they go to a fresh socket's
    /// send buffer without waiting) and wait for the next message; the peer
    /// must not send more before it got them.
    Continue(Vec<u8>),
    /// The exchange succeeded: the handler gets the connection, the bytes
    /// after this message and `D`.
    Done(D),
    /// Refused: send these bytes (best effort) and close.
    Refuse(Vec<u8>),
}

struct Pending<X: Exchange> {
    stream: TcpStream,
    source: Source,
    buf: Vec<u8>,
    since: Instant,
    /// What the last poll round found (`Wait` until the exchange is done).
    step: Step,
    exchange: X,
    done: Option<X::Done>,
}

fn out_of_resources(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// Serves `l` until `stop()` says so (checked at least every 100 ms), with an
/// [`Exchange`] (from `start`, one per connection) run in the poll loop
/// before the handler. `refuse` encodes the refusal sent to a connection whose
/// message can never be accepted (too large, not a pdxfer message), in the
/// protocol the peer speaks; the connection is then closed. Every message
/// until the exchange is done is read without a thread, within
/// [`ListenLimits::first_message_timeout`] of the connection's accept and
/// [`ListenLimits::max_first_message`] each. `handle` then gets the
/// connection, the bytes after the exchange's last message, its outcome
/// and the [`Slot`].
#[allow(clippy::too_many_arguments)]
pub fn serve_exchange<X: Exchange>(
    l: TcpListener,
    limits: ListenLimits,
    framing: Framing,
    stats: ListenStats,
    stop: impl Fn() -> bool,
    refuse: impl Fn(&str) -> Vec<u8>,
    mut start: impl FnMut() -> X,
    mut handle: impl FnMut(TcpStream, Vec<u8>, X::Done, Slot),
) {
    if let Err(e) = l.set_nonblocking(true) {
        log::error!("listener: cannot make it non-blocking ({e}); it is not served");
        return;
    }
    let counts = stats.0;
    counts.handshakes().set_limits(handshake_limits(&limits));
    let mut pending: Admission<Pending<X>> = Admission::new(AdmitLimits {
        max: limits.max_pending,
        per_source: limits.max_per_source,
        grace: limits.source_grace,
    });
    let mut next_id = 0u64;
    let mut backoff = Duration::ZERO;
    let mut backoff_until: Option<Instant> = None;
    let (mut last_warn, mut failures): (Option<Instant>, u64) = (None, 0);
    let mut pfds: Vec<libc::pollfd> = Vec::new();
    loop {
        if stop() {
            return;
        }
        let now = Instant::now();
        if backoff_until.is_some_and(|t| now >= t) {
            backoff_until = None;
        }
        let listening = backoff_until.is_none();
        pfds.clear();
        pfds.push(libc::pollfd {
            fd: l.as_raw_fd(),
            events: if listening { libc::POLLIN } else { 0 },
            revents: 0,
        });
        for p in pending.items_mut() {
            pfds.push(libc::pollfd {
                fd: p.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let mut wait = Duration::from_millis(100);
        if let Some(t) = backoff_until {
            wait = wait.min(t.saturating_duration_since(now));
        }
        if let Some(since) = pending.oldest_since() {
            let expiry = since + limits.first_message_timeout;
            wait = wait.min(expiry.saturating_duration_since(now));
        }
        let ms = wait.as_millis().clamp(1, 100) as libc::c_int;
        // SAFETY: pfds is a valid array of pfds.len() pollfds for the duration of the call.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        if n < 0 {
            // EINTR; anything else cannot be told from it here: wait a little
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        // Read the pending connections first (in the order of pfds[1..]).
        for (p, pfd) in pending.items_mut().zip(pfds[1..].iter()) {
            if pfd.revents != 0 {
                p.step = read_more(p, framing, limits.max_first_message);
            }
        }
        let timeout = limits.first_message_timeout;
        // what is done waiting: whole, refused, closed, or out of time
        let done = pending
            .take_if(|_, p, since| !matches!(p.step, Step::Wait) || since.elapsed() >= timeout);
        for mut p in done {
            match std::mem::replace(&mut p.step, Step::Wait) {
                Step::Ready => hand_off(p, &limits, &counts, &mut handle),
                Step::Refuse(why) => {
                    // best effort, on the non-blocking socket: a short
                    // refusal fits the send buffer; then it is closed
                    let _ = p.stream.write_all(&refuse(&why));
                }
                // closed: gone, or its first message did not arrive in time
                Step::Wait | Step::Drop => {}
            }
        }
        if listening && pfds[0].revents != 0 {
            // Accept what is waiting (a bounded number per round).
            for _ in 0..64 {
                match l.accept() {
                    Ok((s, _)) => {
                        backoff = Duration::ZERO;
                        if s.set_nonblocking(true).is_err() {
                            continue;
                        }
                        let source = Source::of_stream(&s);
                        let now = Instant::now();
                        // closed to make room: the longest waiting of the
                        // largest source, or this source's oldest
                        drop(pending.make_room(source, now));
                        pending.insert(
                            next_id,
                            source,
                            now,
                            Pending {
                                stream: s,
                                source,
                                buf: Vec::new(),
                                since: now,
                                step: Step::Wait,
                                exchange: start(),
                                done: None,
                            },
                        );
                        next_id += 1;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if out_of_resources(&e) => {
                        // free a descriptor for the next peer: the longest waiting is closed
                        drop(pending.take_oldest());
                        backoff =
                            (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                        // said once per interval, however often it happens
                        failures += 1;
                        if last_warn.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                            log::warn!(
                                "listener: accept failed {failures} time(s) since the last warning (now: {e}); backing off {backoff:?} each time and closing the longest-waiting connection (lower the peers' connection count or raise RLIMIT_NOFILE)"
                            );
                            last_warn = Some(Instant::now());
                            failures = 0;
                        }
                        backoff_until = Some(Instant::now() + backoff);
                        break;
                    }
                    Err(_) => break, // ECONNABORTED and the like: the next one
                }
            }
        }
    }
}

enum Step {
    Wait,
    Drop,
    Ready,
    /// The first message can never be accepted: answered with the refusal, closed.
    Refuse(String),
}

fn read_more<X: Exchange>(p: &mut Pending<X>, framing: Framing, max: usize) -> Step {
    let mut chunk = [0u8; 4096];
    loop {
        match p.stream.read(&mut chunk) {
            Ok(0) => return Step::Drop,
            Ok(n) => {
                p.buf.extend_from_slice(&chunk[..n]);
                // every whole message goes to the exchange, in order
                loop {
                    match framing.complete(&p.buf, max) {
                        Ok(Some(n)) => {
                            let msg: Vec<u8> = p.buf.drain(..n).collect();
                            match p.exchange.on_message(&msg) {
                                Turn::Continue(reply) => {
                                    if !p.buf.is_empty() {
                                        return Step::Refuse(
                                            "data after a message before it was answered".into(),
                                        );
                                    }
                                    if !matches!(p.stream.write(&reply), Ok(k) if k == reply.len())
                                    {
                                        return Step::Drop;
                                    }
                                }
                                Turn::Done(d) => {
                                    p.done = Some(d);
                                    return Step::Ready;
                                }
                                Turn::Refuse(bytes) => {
                                    let _ = p.stream.write(&bytes);
                                    return Step::Drop;
                                }
                            }
                        }
                        Ok(None) if p.buf.len() > max + 12 => return Step::Drop,
                        Ok(None) => break,
                        Err(why) => return Step::Refuse(why),
                    }
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Wait,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Step::Drop,
        }
    }
}

fn hand_off<X: Exchange>(
    p: Pending<X>,
    limits: &ListenLimits,
    counts: &Arc<Counts>,
    handle: &mut impl FnMut(TcpStream, Vec<u8>, X::Done, Slot),
) {
    let Some(done) = p.done else {
        return;
    };
    if counts.connections.load(Ordering::SeqCst) >= limits.max_connections {
        return; // refused: closed
    }
    if p.stream.set_nonblocking(false).is_err() {
        return;
    }
    let Ok(second) = p.stream.try_clone() else {
        return;
    };
    let id = counts.next_id.fetch_add(1, Ordering::SeqCst);
    {
        let mut hs = counts.handshakes();
        for old in hs.make_room(p.source, Instant::now()) {
            // wakes its handler's blocked read or write: it ends, and its
            // slot with it; this second handle closes on drop
            let _ = old.shutdown(Shutdown::Both);
        }
        hs.insert(id, p.source, p.since, second);
    }
    counts.connections.fetch_add(1, Ordering::SeqCst);
    let slot = Slot {
        counts: counts.clone(),
        handshake: Some(id),
    };
    handle(p.stream, p.buf, done, slot);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exchange of the tests' [`serve`]: done at the first message.
    struct FirstMessage;

    impl Exchange for FirstMessage {
        type Done = Vec<u8>;
        fn on_message(&mut self, msg: &[u8]) -> Turn<Vec<u8>> {
            Turn::Done(msg.to_vec())
        }
    }

    /// Serves `l` until `stop()` says so (checked at least every 100 ms): each
    /// connection whose first message arrived whole, within the bounds, goes to
    /// `handle` with that message (and any bytes after it) and its [`Slot`]
    /// (`handle` starts the connection's thread; the slot lives as long as it).
    /// `refuse` encodes the refusal sent to a connection whose first message can
    /// never be accepted (too large, not a pdxfer message), in the protocol the
    /// peer speaks; the connection is then closed.
    fn serve(
        l: TcpListener,
        limits: ListenLimits,
        framing: Framing,
        stats: ListenStats,
        stop: impl Fn() -> bool,
        refuse: impl Fn(&str) -> Vec<u8>,
        mut handle: impl FnMut(TcpStream, Vec<u8>, Slot),
    ) {
        serve_exchange(
            l,
            limits,
            framing,
            stats,
            stop,
            refuse,
            || FirstMessage,
            |s, rest, mut first: Vec<u8>, slot| {
                first.extend_from_slice(&rest);
                handle(s, first, slot)
            },
        )
    }

    use std::io::Write;
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;

    fn frame(ty: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = super::super::wire::MAGIC.to_le_bytes().to_vec();
        v.extend_from_slice(&super::super::wire::VERSION.to_le_bytes());
        v.extend_from_slice(&ty.to_le_bytes());
        v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn framing_finds_the_end_of_the_first_message() {
        let f = frame(1, b"abc");
        assert_eq!(Framing::Wire.complete(&f[..5], 100), Ok(None));
        assert_eq!(Framing::Wire.complete(&f, 100), Ok(Some(15)));
        // the limit counts payload bytes: 3 fit in 3, not in 2
        assert_eq!(Framing::Wire.complete(&f, 3), Ok(Some(15)));
        let e = Framing::Wire.complete(&f, 2).unwrap_err();
        assert!(
            e.contains("3 payload bytes") && e.contains("at most 2"),
            "{e}"
        );
        let e = Framing::Wire.complete(b"GET / HTTP/1.1", 100).unwrap_err();
        assert!(e.contains("not a pdxfer frame"), "{e}");
        assert_eq!(Framing::Line.complete(b"{}\nx", 100), Ok(Some(3)));
        assert_eq!(Framing::Line.complete(b"{", 100), Ok(None));
        assert_eq!(Framing::Line.complete(&[b'x'; 8], 8), Ok(None));
        let e = Framing::Line.complete(&[b'x'; 9], 8).unwrap_err();
        assert!(e.contains("at most 8"), "{e}");
        let e = Framing::Line.complete(b"123456789\n", 8).unwrap_err();
        assert!(e.contains("9 bytes"), "{e}");
    }

    /// A first message that can never be accepted gets the caller's refusal,
    /// then the connection is closed; no handler runs for it.
    #[test]
    fn an_oversized_first_message_is_refused_then_closed() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let handled = Arc::new(AtomicUsize::new(0));
        let limits = ListenLimits {
            max_first_message: 16,
            ..ListenLimits::default()
        };
        let (st, h) = (stop.clone(), handled.clone());
        let t = std::thread::spawn(move || {
            serve(
                l,
                limits,
                Framing::Line,
                ListenStats::default(),
                move || st.load(Ordering::SeqCst),
                |why: &str| format!("refused: {why}\n").into_bytes(),
                move |_, _, _| {
                    h.fetch_add(1, Ordering::SeqCst);
                },
            )
        });
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&[b'x'; 40]).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        let text = String::from_utf8_lossy(&got);
        assert!(
            text.starts_with("refused: ") && text.contains("at most 16 bytes"),
            "{text:?}"
        );
        // a message within the limit is still handed on
        let mut ok = TcpStream::connect(addr).unwrap();
        ok.write_all(b"{}\n").unwrap();
        for _ in 0..200 {
            if handled.load(Ordering::SeqCst) == 1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(handled.load(Ordering::SeqCst), 1);
        stop.store(true, Ordering::SeqCst);
        t.join().unwrap();
    }

    /// Idle connections stay in the poll set (no handler), the oldest is
    /// closed when it is full, and a real first message still gets through;
    /// live connections are bounded and the excess closed.
    #[test]
    fn pending_is_bounded_oldest_closed_first_and_real_peers_served() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let got = Arc::new(Mutex::new(Vec::new()));
        let stats = ListenStats::default();
        let limits = ListenLimits {
            max_pending: 4,
            max_handshakes: 8,
            max_connections: 2,
            first_message_timeout: Duration::from_secs(30),
            max_first_message: 1024,
            ..ListenLimits::default()
        };
        let (st, g, s2) = (stop.clone(), got.clone(), stats.clone());
        let t = std::thread::spawn(move || {
            serve(
                l,
                limits,
                Framing::Line,
                s2,
                move || st.load(Ordering::SeqCst),
                |why: &str| format!("refused: {why}\n").into_bytes(),
                move |s, buf, slot| g.lock().unwrap().push((s, buf, slot)),
            )
        });
        let idle: Vec<TcpStream> = (0..10).map(|_| TcpStream::connect(addr).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(300));
        // the first six were closed as newer ones arrived
        let mut closed = 0;
        for mut s in idle.iter().take(6) {
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut b = [0u8; 1];
            if matches!(s.read(&mut b), Ok(0) | Err(_)) {
                closed += 1;
            }
        }
        assert_eq!(closed, 6);
        assert!(
            got.lock().unwrap().is_empty(),
            "no handler for idle connections"
        );
        let mut real = TcpStream::connect(addr).unwrap();
        real.write_all(b"hello\n").unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while got.lock().unwrap().is_empty() {
            assert!(Instant::now() < end, "the real peer was not served");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(got.lock().unwrap()[0].1, b"hello\n");
        // connection bound: two live, the third refused
        let mut live = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"x\n").unwrap();
            live.push(s);
        }
        let end = Instant::now() + Duration::from_secs(5);
        let mut refused = false;
        while Instant::now() < end && !refused {
            std::thread::sleep(Duration::from_millis(50));
            refused = got.lock().unwrap().len() == 2;
        }
        assert!(refused, "two connections live");
        assert_eq!(stats.connections(), 2);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(got.lock().unwrap().len(), 2, "the third is refused");
        got.lock().unwrap().clear();
        assert_eq!(stats.connections(), 0);
        stop.store(true, Ordering::SeqCst);
        t.join().unwrap();
    }
}
