//! The receive buffer of one tcp data stream: one `read` fills it with many
//! piece headers and small payloads, which are then taken from memory; a
//! payload that is not all buffered is read from the socket straight into
//! its destination, with the buffer as a second iovec (`readv`), so the bytes
//! after it arrive in the same call; a long payload is read
//! [`DIRECT_READ_BYTES`] at a time (the kernel reopens the receive window
//! after each read, so the sender never waits for one long read to end).
//! Reads of a payload are bounded by the
//! pin timeout (its destination is pinned meanwhile); reads between pieces
//! wait as long as the stream lives.

use std::io::{ErrorKind, IoSliceMut, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Bytes a data stream reads from its socket at a time.
pub(crate) const STREAM_BUFFER_BYTES: usize = 256 << 10;

/// Most bytes one read takes of a payload straight into its destination.
/// Measured on loopback: 64-128 KiB reads keep the sender busy (one read of
/// a whole multi-megabyte payload left it waiting for the window).
pub(super) const DIRECT_READ_BYTES: usize = 128 << 10;

/// Receive timeouts shorter than this are not kept while the stream idles
/// between pieces (the stream would wake up that often for nothing).
const IDLE_TIMEOUT_FLOOR: Duration = Duration::from_millis(100);

/// What a data stream reads from: a socket whose reads can be bounded in time.
pub(super) trait Source: Read {
    /// Sets the receive timeout of later reads (`None`: they block).
    fn set_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()>;
}

impl Source for TcpStream {
    fn set_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()> {
        self.set_read_timeout(t)
    }
}

/// A data stream's socket behind its receive buffer.
pub(super) struct InBuf<S> {
    s: S,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    pin_timeout: Duration,
    /// The receive timeout the socket has now.
    timeout: Option<Duration>,
}

impl<S: Source> InBuf<S> {
    /// A buffer of `capacity` bytes (at least one header) over `s`, which
    /// has no receive timeout.
    pub(super) fn new(s: S, capacity: usize, pin_timeout: Duration) -> InBuf<S> {
        InBuf {
            s,
            buf: vec![0u8; capacity.max(super::super::wire::DATA_HEADER_LEN)].into_boxed_slice(),
            start: 0,
            end: 0,
            pin_timeout: pin_timeout.max(Duration::from_millis(1)),
            timeout: None,
        }
    }

    #[cfg(test)]
    pub(super) fn source(&self) -> &S {
        &self.s
    }

    /// The bytes read from the socket and not yet taken.
    pub(super) fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Takes the first `n` buffered bytes.
    pub(super) fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Reads until at least `n` bytes (at most the capacity) are buffered,
    /// waiting as long as it takes (the stream idles between pieces).
    pub(super) fn fill(&mut self, n: usize) -> std::io::Result<()> {
        let n = n.min(self.buf.len());
        if self.end - self.start >= n {
            return Ok(());
        }
        if self.start > 0 {
            // fewer than `n` bytes move: the read gets the whole buffer
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if matches!(self.timeout, Some(t) if t < IDLE_TIMEOUT_FLOOR) {
            self.s.set_timeout(None)?;
            self.timeout = None;
        }
        while self.end - self.start < n {
            match self.s.read(&mut self.buf[self.end..]) {
                Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                Ok(k) => self.end += k,
                // a payload's timeout still set: idle on
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// A reader of one piece's payload: the buffered bytes first, then the
    /// socket, every read failing with `TimedOut` once the pin timeout
    /// passed since the first of them waited on the socket.
    pub(super) fn piece(&mut self) -> PieceReader<'_, S> {
        PieceReader {
            b: self,
            deadline: None,
        }
    }

    /// One read from the socket into `dst` and, when `behind`, into the
    /// (empty) buffer behind it (the bytes that follow in the stream),
    /// bounded by `deadline`: the bytes read into `dst`.
    fn read_through(
        &mut self,
        dst: &mut [u8],
        deadline: &mut Option<Instant>,
        behind: bool,
    ) -> std::io::Result<usize> {
        debug_assert!(self.start == self.end);
        self.start = 0;
        self.end = 0;
        let end = *deadline.get_or_insert_with(|| Instant::now() + self.pin_timeout);
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(
                    ErrorKind::TimedOut,
                    format!(
                        "a piece's payload did not arrive within the pin timeout ({:?}); its pin was released",
                        self.pin_timeout
                    ),
                ));
            }
            // A read waits at most the timeout set: lower it when it would
            // overrun the deadline by more than an eighth of the pin timeout.
            if self.timeout.is_none_or(|t| t > left + self.pin_timeout / 8) {
                self.s.set_timeout(Some(left))?;
                self.timeout = Some(left);
            }
            let mut iov = [IoSliceMut::new(dst), IoSliceMut::new(&mut self.buf)];
            let n = if behind { 2 } else { 1 };
            match self.s.read_vectored(&mut iov[..n]) {
                Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                Ok(k) => {
                    let into_dst = k.min(dst.len());
                    self.end = k - into_dst;
                    return Ok(into_dst);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// The payload of one piece (see [`InBuf::piece`]).
pub(super) struct PieceReader<'a, S> {
    b: &'a mut InBuf<S>,
    deadline: Option<Instant>,
}

impl<S: Source> Read for PieceReader<'_, S> {
    fn read(&mut self, dst: &mut [u8]) -> std::io::Result<usize> {
        if dst.is_empty() {
            return Ok(0);
        }
        let have = self.b.buffered();
        if !have.is_empty() {
            let n = have.len().min(dst.len());
            dst[..n].copy_from_slice(&have[..n]);
            self.b.consume(n);
            return Ok(n);
        }
        // a long `dst` is read in parts with no buffer behind them (the
        // bytes after a part are its own: they go straight in next)
        if dst.len() > DIRECT_READ_BYTES {
            let dst = &mut dst[..DIRECT_READ_BYTES];
            return self.b.read_through(dst, &mut self.deadline, false);
        }
        self.b.read_through(dst, &mut self.deadline, true)
    }
}

/// Reads and discards `left` payload bytes through `scratch` (a piece that
/// is refused or failed is drained, so the stream stays in sync).
pub(super) fn drain(
    s: &mut impl Read,
    mut left: u64,
    scratch: &mut [u8],
) -> crate::error::Result<()> {
    while left > 0 {
        let n = left.min(scratch.len() as u64) as usize;
        s.read_exact(&mut scratch[..n])?;
        left -= n as u64;
    }
    Ok(())
}
