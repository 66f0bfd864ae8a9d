//! The tcp sender: one thread per data stream writes its pieces with
//! `writev`, long sources straight from registered memory; the last stream
//! of a batch sends its
//! commit on the control connection. A batch of a room whose grant is open
//! on the connection sends no commit: its pieces carry the grant's token, it
//! is done once they were written, and the room's RoomEnd (after its last
//! batch) is answered once the receiver landed every byte.
//!
//! Consecutive ops of a batch whose destinations follow each other (same
//! remote region, each starting where the previous one ends) go as one
//! piece: one header naming the whole destination run, its payload gathered
//! from the ops' sources, so scattered rows need no packing into staging
//! and the receiver reads the run straight into place. Headers and sources
//! shorter than [`COPY_BELOW`] are gathered into the stream's small buffer,
//! which stays in cache, and sent from there; measured on loopback, the
//! kernel's copy from many short scattered iovecs ran at half the speed.

use super::seal::{PieceSealer, SEALED_PIECE_BYTES};
use crate::error::{Error, Result, Status};
use crate::memory::AccessGuard;
use crate::transport::agent::Dialed;
use crate::transport::batch::Stage;
use crate::transport::checksum;
use crate::transport::conn::{Conn, Reach};
use crate::transport::handshake::Attach;
use crate::transport::handshake::Select;
use crate::transport::peer_auth::authenticate_client;
use crate::transport::piece::Piece;
use crate::transport::wire::{self, Commit, DataHeader, FrameType};
use crate::transport::{BatchId, BatchOptions, Completion, Transport, TransportKind, WriteOp};
use crossbeam::channel::{unbounded, Sender};
use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Pieces larger than this are split across streams when there are several.
const SPLIT: u64 = 512 << 10;
/// Most iovecs one `writev` takes (Linux `IOV_MAX`).
const IOV_MAX: usize = 1024;
/// A write blocked this long fails the connection.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

struct BatchShared {
    remaining: AtomicUsize,
    commit: Commit,
    /// A batch of a granted room: (room, epoch) and the grant's token.
    room: Option<((u64, u64), u64)>,
    _guards: Arc<Vec<AccessGuard>>,
}

/// One piece as sent: a header naming the destination `[offset, offset +
/// len)` of `region`, its payload gathered from the next `nsrc` sources of
/// its [`Part`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    region: u64,
    offset: u64,
    len: u64,
    nsrc: usize,
}

/// A source range of a span's payload (a pinned registered address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Src {
    addr: u64,
    len: u64,
}

/// What one stream sends of a batch: its spans, in order, and their sources.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Part {
    spans: Vec<Span>,
    srcs: Vec<Src>,
}

impl Part {
    fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Appends `len` bytes at `addr` to the sources of the span being built
    /// (whose first source is `srcs[first]`), extending its last source when
    /// they follow it.
    fn push_src(&mut self, first: usize, addr: u64, len: u64) {
        if len == 0 {
            return;
        }
        match self.srcs[first..].last_mut() {
            Some(l) if l.addr + l.len == addr => l.len += len,
            _ => self.srcs.push(Src { addr, len }),
        }
    }

    /// The batch checksum of the spans as sent: the receiver hashes each
    /// span's bytes, in order, as one piece.
    fn checksum(&self) -> u64 {
        let mut at = 0;
        self.spans.iter().fold(0u64, |acc, sp| {
            let mut h = checksum::PieceHasher::new(sp.region, sp.offset);
            for src in &self.srcs[at..at + sp.nsrc] {
                // SAFETY: validate_ops checked every source lies in a registered local region, pinned by the batch's guards.
                h.update(unsafe {
                    std::slice::from_raw_parts(src.addr as *const u8, src.len as usize)
                });
            }
            at += sp.nsrc;
            checksum::combine(acc, h.finish())
        })
    }
}

struct Job {
    part: Part,
    flags: u32,
    batch: Arc<BatchShared>,
}

/// The tcp transport (sender side).
pub struct TcpTransport {
    conn: Arc<Conn>,
    streams: Vec<Sender<Job>>,
    sockets: Vec<TcpStream>,
    /// Pieces are encrypted (each stream has its sealer): runs are cut at
    /// [`SEALED_PIECE_BYTES`].
    encrypt: bool,
}

impl TcpTransport {
    /// The sender over `streams`, each with its sealer when pieces are
    /// encrypted (all or none).
    pub(crate) fn new(
        conn: Arc<Conn>,
        streams: Vec<(TcpStream, Option<PieceSealer>)>,
    ) -> Result<TcpTransport> {
        let mut txs = Vec::new();
        let mut sockets = Vec::new();
        let encrypt = streams.iter().any(|(_, x)| x.is_some());
        for (i, (s, mut sealer)) in streams.into_iter().enumerate() {
            s.set_write_timeout(Some(WRITE_TIMEOUT))?;
            sockets.push(s.try_clone()?);
            let (tx, rx) = unbounded::<Job>();
            let c = conn.clone();
            crate::threads::spawn(format!("pdxfer-tcp-tx{i}"), move || {
                let mut gather = Gather::default();
                for job in rx {
                    if let Err(e) = send_job(&c, &s, &job, &mut gather, sealer.as_mut()) {
                        let e = Error::new(
                            Status::PeerUnreachable,
                            format!(
                                "data stream {i} to peer pid {} at {} failed: {}",
                                c.peer.pid,
                                c.addr,
                                e.detail()
                            ),
                        );
                        c.fail_all(e);
                        let _ = s.shutdown(Shutdown::Both);
                        return;
                    }
                    finish_part(&c, &job.batch);
                }
            })?;
            txs.push(tx);
        }
        Ok(TcpTransport {
            conn,
            streams: txs,
            sockets,
            encrypt,
        })
    }
}

/// The sender's tcp setup on a dialed control connection: selects tcp with
/// `opts.streams` (1 to 64) data streams, dials each and attaches it to the
/// receiver's session with its token, and starts the transport.
/// With `d.tcp_encrypt` each stream seals its pieces under its own payload
/// key; the receiver refuses the Select unless it encrypts too.
pub(crate) fn connect(mut d: Dialed<'_>) -> Result<Box<dyn Transport>> {
    let (addr, opts) = (d.addr, d.opts);
    let n = opts.streams.clamp(1, 64);
    d.send_json(
        FrameType::Select,
        &Select {
            transport: TransportKind::Tcp,
            streams: n,
            rdma: None,
            tcp_encrypt: d.tcp_encrypt,
        },
    )?;
    let _: serde_json::Value = d.recv_json(FrameType::SelectOk)?;
    let mut streams = Vec::new();
    for index in 0..n {
        let mut s = TcpStream::connect_timeout(&d.sockaddr, opts.timeout).map_err(|e| {
            Error::new(
                Status::PeerUnreachable,
                format!("data stream {index} to {addr}: {e}"),
            )
        })?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(opts.timeout))?;
        s.set_write_timeout(Some(opts.timeout))?;
        // each stream authenticates, as the same instance as the control connection
        // (its Attach and AttachOk sealed with its own keys; data frames are not)
        let (_, mut keys) = authenticate_client(&mut s, d.auth, d.instance, Some(d.peer), addr)?;
        wire::write_json_sealed(
            &mut s,
            FrameType::Attach,
            &Attach {
                session: d.ack.session,
                token: d.ack.token.clone(),
                index,
            },
            &mut keys.send,
        )?;
        let _: serde_json::Value =
            wire::read_json_sealed(&mut s, FrameType::AttachOk, &mut keys.recv)?;
        let sealer = d.tcp_encrypt.then(|| PieceSealer::new(&keys.payload.send));
        streams.push((s, sealer));
    }
    let conn = d.start()?;
    Ok(Box::new(TcpTransport::new(conn, streams)?))
}

fn finish_part(c: &Conn, b: &BatchShared) {
    if b.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
        let id = b.commit.batch;
        if let Some((key, _)) = b.room {
            // every piece is on the wire; the room's end confirms they landed
            match c.table.failure(id) {
                Some(e) => c.rooms.finished(key, Err(e)),
                None => {
                    c.table.set(id, Stage::Done);
                    c.rooms.finished(key, Ok(b.commit.bytes));
                }
            }
            return;
        }
        c.table.set(id, Stage::Written);
        let _ = c.send(FrameType::Commit, &wire::encode_commit(&b.commit));
    }
}

/// Sources shorter than this are copied into the stream's gather buffer
/// (with the headers) rather than sent in place.
const COPY_BELOW: u64 = 16 << 10;
/// A stream's gather buffer: small enough to stay in cache (64 KiB sent
/// 1152-byte rows faster than 256 KiB or 1 MiB, measured on loopback).
const GATHER_BYTES: usize = 64 << 10;
const _: () = assert!(COPY_BELOW as usize + wire::DATA_HEADER_LEN <= GATHER_BYTES);

/// What one `writev` of a stream sends: iovecs over its gather buffer
/// (headers, and short sources copied there) and over longer sources in
/// place. Reused from call to call.
struct Gather {
    buf: Box<[u8]>,
    used: usize,
    iov: Vec<libc::iovec>,
    /// An encrypted piece as sent (header, ciphertext, tag); empty until
    /// the stream encrypts.
    sealed: Vec<u8>,
}

impl Default for Gather {
    fn default() -> Gather {
        Gather {
            buf: vec![0u8; GATHER_BYTES].into_boxed_slice(),
            used: 0,
            iov: Vec::with_capacity(IOV_MAX),
            sealed: Vec::new(),
        }
    }
}

impl Gather {
    /// Writes what is gathered.
    fn flush(&mut self, s: &TcpStream) -> Result<()> {
        if !self.iov.is_empty() {
            writev_all(s, &mut self.iov)?;
        }
        self.iov.clear();
        self.used = 0;
        Ok(())
    }

    /// Makes room for one more iovec and, in the buffer, `len` bytes.
    fn room(&mut self, s: &TcpStream, len: usize) -> Result<()> {
        if self.iov.len() >= IOV_MAX || self.used + len > self.buf.len() {
            self.flush(s)?;
        }
        Ok(())
    }

    /// Copies `data` into the buffer, to be sent next.
    fn copy(&mut self, s: &TcpStream, data: &[u8]) -> Result<()> {
        self.room(s, data.len())?;
        let at = self.used;
        self.buf[at..at + data.len()].copy_from_slice(data);
        self.used += data.len();
        let base = self.buf.as_ptr() as usize;
        match self.iov.last_mut() {
            Some(l) if l.iov_base as usize + l.iov_len == base + at => l.iov_len += data.len(),
            _ => self.iov.push(libc::iovec {
                iov_base: (base + at) as *mut libc::c_void,
                iov_len: data.len(),
            }),
        }
        Ok(())
    }

    /// Sends `len` bytes at `addr` next, copied when short.
    fn source(&mut self, s: &TcpStream, addr: u64, len: u64) -> Result<()> {
        if len < COPY_BELOW {
            // SAFETY: validate_ops checked [addr, addr+len) lies in a registered local region, pinned by the batch's guards.
            let data = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
            return self.copy(s, data);
        }
        self.room(s, 0)?;
        self.iov.push(libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len as usize,
        });
        Ok(())
    }
}

fn send_job(
    c: &Conn,
    s: &TcpStream,
    job: &Job,
    g: &mut Gather,
    sealer: Option<&mut PieceSealer>,
) -> Result<()> {
    if c.table.finished(job.batch.commit.batch) {
        return Ok(()); // failed or expired: skip its bytes
    }
    let batch = job.batch.room.map_or(job.batch.commit.batch, |(_, t)| t);
    match sealer {
        Some(x) => send_part_sealed(s, &job.part, job.flags, batch, x, g),
        None => send_part(s, &job.part, job.flags, batch, g),
    }
}

/// [`send_part`] with each span encrypted: its header, its payload gathered
/// from its sources into a buffer and sealed there (the header as associated
/// data), its tag, in one write. Spans are at most [`SEALED_PIECE_BYTES`]
/// long ([`assign`] cut them).
fn send_part_sealed(
    s: &TcpStream,
    part: &Part,
    flags: u32,
    batch: u64,
    sealer: &mut PieceSealer,
    g: &mut Gather,
) -> Result<()> {
    let mut at = 0usize;
    let buf = &mut g.sealed;
    for sp in &part.spans {
        debug_assert!(sp.len <= SEALED_PIECE_BYTES);
        let h = DataHeader {
            flags,
            batch,
            region: sp.region,
            offset: sp.offset,
            len: sp.len,
        }
        .encode();
        buf.clear();
        buf.extend_from_slice(&h);
        for x in &part.srcs[at..at + sp.nsrc] {
            // SAFETY: validate_ops checked [addr, addr+len) lies in a registered local region, pinned by the batch's guards.
            buf.extend_from_slice(unsafe {
                std::slice::from_raw_parts(x.addr as *const u8, x.len as usize)
            });
        }
        at += sp.nsrc;
        let tag = sealer.seal(&h, &mut buf[wire::DATA_HEADER_LEN..])?;
        buf.extend_from_slice(&tag);
        write_all(s, buf)?;
    }
    Ok(())
}

/// Writes all of `data`, a write blocked for [`WRITE_TIMEOUT`] failing as
/// [`writev_all`] does.
fn write_all(mut s: &TcpStream, data: &[u8]) -> Result<()> {
    s.write_all(data).map_err(|e| {
        if e.kind() == std::io::ErrorKind::WouldBlock {
            Error::new(
                Status::Timeout,
                format!("peer accepted no data for {WRITE_TIMEOUT:?} (stalled)"),
            )
        } else {
            e.into()
        }
    })
}

/// Writes the spans of `part`, each a header (`flags`, `batch`) and its
/// payload from its sources, with as few `writev` calls as the gather
/// buffer and [`IOV_MAX`] allow (a span may take several).
fn send_part(s: &TcpStream, part: &Part, flags: u32, batch: u64, g: &mut Gather) -> Result<()> {
    let mut at = 0usize;
    for sp in &part.spans {
        let h = DataHeader {
            flags,
            batch,
            region: sp.region,
            offset: sp.offset,
            len: sp.len,
        }
        .encode();
        g.copy(s, &h)?;
        for x in &part.srcs[at..at + sp.nsrc] {
            g.source(s, x.addr, x.len)?;
        }
        at += sp.nsrc;
    }
    g.flush(s)
}

/// `writev` until every iovec is written, resuming partial writes.
fn writev_all(s: &TcpStream, iov: &mut [libc::iovec]) -> Result<()> {
    let fd = s.as_raw_fd();
    let mut start = 0usize;
    while start < iov.len() {
        let cnt = (iov.len() - start).min(IOV_MAX);
        // SAFETY: every iovec points into the stream's gather buffer or at a pinned registered source range.
        let n = unsafe { libc::writev(fd, iov[start..].as_ptr(), cnt as i32) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Err(Error::new(
                    Status::Timeout,
                    format!("peer accepted no data for {WRITE_TIMEOUT:?} (stalled)"),
                ));
            }
            return Err(e.into());
        }
        if n == 0 {
            return Err(Error::new(Status::PeerUnreachable, "writev wrote 0 bytes"));
        }
        let mut n = n as usize;
        while start < iov.len() && n >= iov[start].iov_len {
            n -= iov[start].iov_len;
            start += 1;
        }
        if n > 0 {
            iov[start].iov_base = (iov[start].iov_base as usize + n) as *mut libc::c_void;
            iov[start].iov_len -= n;
        }
    }
    Ok(())
}

/// Cuts validated pieces into what each of `n` streams sends: consecutive
/// pieces whose destinations follow each other (same region, each starting
/// where the previous one ends) become one span, its sources gathered; with
/// several streams a span is cut into parts of [`SPLIT`] bytes at most. Each
/// span (or part) goes to the least loaded stream.
/// Spans are at most `max_span` bytes long (encrypted pieces are bounded).
fn assign(pieces: &[Piece], n: usize, max_span: u64) -> Vec<Part> {
    let n = n.max(1);
    let cap = if n > 1 { SPLIT } else { u64::MAX }.min(max_span.max(1));
    let mut out = vec![Part::default(); n];
    let mut load = vec![0u64; n];
    let mut i = 0;
    while i < pieces.len() {
        let (region, start) = (pieces[i].region, pieces[i].offset);
        let mut end = start + pieces[i].len;
        let mut j = i + 1;
        while j < pieces.len() && pieces[j].region == region && pieces[j].offset == end {
            end += pieces[j].len;
            j += 1;
        }
        // pieces[i..j] land as [start, end) of region; `at` is the next
        // source piece, `used` the bytes of it already sent
        let (mut at, mut used) = (i, 0u64);
        let mut offset = start;
        loop {
            let take = (end - offset).min(cap);
            let k = (0..n).min_by_key(|&k| load[k]).unwrap_or(0);
            load[k] += take.max(1);
            let part = &mut out[k];
            let first = part.srcs.len();
            let mut left = take;
            while left > 0 {
                let p = &pieces[at];
                let t = (p.len - used).min(left);
                part.push_src(first, p.src + used, t);
                left -= t;
                used += t;
                if used == p.len {
                    at += 1;
                    used = 0;
                }
            }
            part.spans.push(Span {
                region,
                offset,
                len: take,
                nsrc: part.srcs.len() - first,
            });
            offset += take;
            if offset == end {
                break;
            }
        }
        i = j;
    }
    out
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    crate::transport::conn::conn_backed_transport!();
    crate::transport::conn::conn_room_grants!();

    fn resume_room(
        &self,
        grant: &crate::transport::room::RoomGrant,
        epoch: u64,
        timeout: std::time::Duration,
    ) -> Result<crate::transport::landed::Landed> {
        self.conn.resume_room(grant, epoch, timeout)
    }

    fn carry_room(&self, room: u64, epoch: u64, bytes: u64) -> Result<()> {
        self.conn.rooms.carry(room, epoch, bytes)
    }

    fn submit(&self, ops: &[WriteOp], opts: &BatchOptions) -> Result<BatchId> {
        // device destinations are landed by the receiver's device writer
        let (pieces, guards, bytes) = self.conn.validate(ops, Reach::AnyDestination)?;
        let room = self
            .conn
            .rooms
            .admit(&pieces, opts)?
            .map(|token| ((opts.room, opts.epoch), token));
        let max_span = if self.encrypt {
            SEALED_PIECE_BYTES
        } else {
            u64::MAX
        };
        let parts = assign(&pieces, self.streams.len(), max_span);
        // The checksum is over the spans as sent (the receiver sums the same spans).
        let checksum = opts.checksum.then(|| {
            parts
                .iter()
                .map(Part::checksum)
                .fold(0u64, checksum::combine)
        });
        let template = Completion::pending(bytes, checksum, opts);
        let id = match self
            .conn
            .table
            .insert(opts.timeout, template, guards.clone())
        {
            Ok(id) => id,
            Err(e) => {
                if let Some((key, _)) = room {
                    self.conn.rooms.finished(key, Err(e.clone()));
                }
                return Err(e);
            }
        };
        self.conn.table.set(id, Stage::Granted);
        let used: Vec<usize> = (0..parts.len()).filter(|&k| !parts[k].is_empty()).collect();
        let shared = Arc::new(BatchShared {
            remaining: AtomicUsize::new(used.len().max(1)),
            commit: Commit {
                batch: id,
                bytes,
                checksum,
                room: opts.room,
                epoch: opts.epoch,
            },
            room,
            _guards: guards,
        });
        if used.is_empty() {
            finish_part(&self.conn, &shared);
            return Ok(BatchId(id));
        }
        let flags = if checksum.is_some() {
            wire::DATA_FLAG_CHECKSUM
        } else if room.is_some() {
            wire::DATA_FLAG_ROOM
        } else {
            0
        };
        for (k, part) in parts.into_iter().enumerate() {
            if part.is_empty() {
                continue;
            }
            let job = Job {
                part,
                flags,
                batch: shared.clone(),
            };
            if self.streams[k].send(job).is_err() {
                let e = self.conn.table.dead().unwrap_or_else(|| {
                    Error::new(Status::PeerUnreachable, format!("data stream {k} is gone"))
                });
                if let Some((key, _)) = room {
                    self.conn.rooms.finished(key, Err(e.clone()));
                }
                self.conn.table.fail(id, e);
                break;
            }
        }
        Ok(BatchId(id))
    }

    fn close(&self) {
        self.conn.close();
        for s in &self.sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::wire::DATA_HEADER_LEN;
    use std::io::Read;
    use std::net::TcpListener;

    fn p(src: u64, region: u64, offset: u64, len: u64) -> Piece {
        Piece {
            src,
            region,
            offset,
            dst: offset,
            len,
        }
    }

    /// Every byte a part sends, as (region, destination offset, source address).
    fn bytes_of(parts: &[Part]) -> Vec<(u64, u64, u64)> {
        let mut v = Vec::new();
        for part in parts {
            let mut at = 0;
            for sp in &part.spans {
                let mut off = sp.offset;
                for x in &part.srcs[at..at + sp.nsrc] {
                    for b in 0..x.len {
                        v.push((sp.region, off, x.addr + b));
                        off += 1;
                    }
                }
                assert_eq!(off, sp.offset + sp.len, "a span's sources cover its length");
                at += sp.nsrc;
            }
            assert_eq!(at, part.srcs.len());
        }
        v.sort_unstable();
        v
    }

    fn bytes_of_pieces(pieces: &[Piece]) -> Vec<(u64, u64, u64)> {
        let mut v: Vec<_> = pieces
            .iter()
            .flat_map(|x| (0..x.len).map(move |b| (x.region, x.offset + b, x.src + b)))
            .collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn contiguous_destinations_from_scattered_sources_make_one_span() {
        // every 4th row of the source into consecutive destination rows
        let pieces: Vec<Piece> = (0..10)
            .map(|i| p(1000 + i * 4 * 64, 7, i * 64, 64))
            .collect();
        let parts = assign(&pieces, 1, u64::MAX);
        assert_eq!(
            parts[0].spans,
            vec![Span {
                region: 7,
                offset: 0,
                len: 640,
                nsrc: 10
            }]
        );
        assert_eq!(bytes_of(&parts), bytes_of_pieces(&pieces));
    }

    #[test]
    fn only_destinations_that_follow_each_other_merge() {
        let pieces = vec![
            p(0, 1, 0, 10),
            p(50, 1, 10, 10), // follows: merged
            p(90, 1, 21, 5),  // a gap of one byte
            p(200, 2, 26, 5), // another region
            p(300, 2, 0, 5),  // before the previous one
            p(400, 2, 5, 0),  // empty, where the previous one ends: merged
            p(500, 2, 5, 3),  // merged
        ];
        let parts = assign(&pieces, 1, u64::MAX);
        let spans: Vec<(u64, u64, u64, usize)> = parts[0]
            .spans
            .iter()
            .map(|s| (s.region, s.offset, s.len, s.nsrc))
            .collect();
        assert_eq!(
            spans,
            vec![(1, 0, 20, 2), (1, 21, 5, 1), (2, 26, 5, 1), (2, 0, 8, 2)]
        );
        assert_eq!(bytes_of(&parts), bytes_of_pieces(&pieces));
        // a lone empty op is still sent (its header names its destination)
        let empty = assign(&[p(0, 1, 30, 0)], 1, u64::MAX);
        assert_eq!(empty[0].spans.len(), 1);
        assert!(empty[0].srcs.is_empty());
    }

    #[test]
    fn sources_that_follow_each_other_take_one_iovec() {
        let pieces = vec![p(0, 1, 0, 100), p(100, 1, 100, 100), p(300, 1, 200, 50)];
        let parts = assign(&pieces, 1, u64::MAX);
        assert_eq!(
            parts[0].srcs,
            vec![Src { addr: 0, len: 200 }, Src { addr: 300, len: 50 }]
        );
        assert_eq!(parts[0].spans[0].nsrc, 2);
    }

    #[test]
    fn several_streams_split_runs_and_cover_every_byte() {
        // a run of 3 * SPLIT + 5 bytes in rows of 1000 bytes, then a lone piece
        let rows = (3 * SPLIT + 5).div_ceil(1000);
        let mut pieces: Vec<Piece> = (0..rows).map(|i| p(i * 3000, 1, i * 1000, 1000)).collect();
        pieces.last_mut().unwrap().len = 3 * SPLIT + 5 - (rows - 1) * 1000;
        pieces.push(p(90_000_000, 1, 50_000_000, 7));
        let parts = assign(&pieces, 3, u64::MAX);
        assert!(parts.iter().all(|x| !x.is_empty()));
        assert!(parts
            .iter()
            .flat_map(|x| &x.spans)
            .all(|sp| sp.len <= SPLIT));
        assert_eq!(parts.iter().map(|x| x.spans.len()).sum::<usize>(), 5);
        assert_eq!(bytes_of(&parts), bytes_of_pieces(&pieces));
        // one stream: the run is one span
        let one = assign(&pieces, 1, u64::MAX);
        assert_eq!(one[0].spans.len(), 2);
    }

    /// Reads one header and its payload from `r`.
    fn read_piece(r: &mut impl Read) -> (DataHeader, Vec<u8>) {
        let mut hb = [0u8; DATA_HEADER_LEN];
        r.read_exact(&mut hb).unwrap();
        let h = DataHeader::decode(&hb).unwrap();
        let mut data = vec![0u8; h.len as usize];
        r.read_exact(&mut data).unwrap();
        (h, data)
    }

    /// Sends `part` over a loopback socket; the pieces the peer reads.
    fn send_and_read(part: &Part, flags: u32, batch: u64) -> Vec<(DataHeader, Vec<u8>)> {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut rx, _) = l.accept().unwrap();
        let part = part.clone();
        let sender = std::thread::spawn(move || {
            let mut g = Gather::default();
            send_part(&tx, &part, flags, batch, &mut g).unwrap();
        });
        let mut all = Vec::new();
        rx.read_to_end(&mut all).unwrap();
        sender.join().unwrap();
        let mut r = &all[..];
        let mut out = Vec::new();
        while !r.is_empty() {
            out.push(read_piece(&mut r));
        }
        out
    }

    /// The bytes of `rows` rows of `row` bytes, every `stride`-th row of `src`.
    fn every_nth(src: &[u8], rows: usize, row: usize, stride: usize) -> Vec<u8> {
        (0..rows)
            .flat_map(|i| src[i * stride * row..][..row].iter().copied())
            .collect()
    }

    #[test]
    fn runs_of_scattered_rows_go_as_one_piece_each_byte_exact() {
        // short rows (copied through the gather buffer, many buffers' worth)
        let row = 1152u64;
        let rows = 2 * IOV_MAX as u64 + 300;
        let src: Vec<u8> = (0..rows * row * 3).map(|i| (i * 31 % 251) as u8).collect();
        let base = src.as_ptr() as u64;
        // every 3rd row of the source, to consecutive destination rows
        let mut pieces: Vec<Piece> = (0..rows)
            .map(|i| p(base + i * 3 * row, 4, 8192 + i * row, row))
            .collect();
        // and a short run elsewhere
        pieces.push(p(base + row, 4, 0, 100));
        pieces.push(p(base + 5 * row, 4, 100, 28));
        let parts = assign(&pieces, 1, u64::MAX);
        assert_eq!(parts[0].spans.len(), 2);
        let got = send_and_read(&parts[0], wire::DATA_FLAG_CHECKSUM, 77);
        assert_eq!(got.len(), 2, "one piece per destination run");
        let (h1, d1) = &got[0];
        assert_eq!(
            (h1.flags, h1.batch, h1.region, h1.offset, h1.len),
            (wire::DATA_FLAG_CHECKSUM, 77, 4, 8192, rows * row)
        );
        assert!(
            *d1 == every_nth(&src, rows as usize, row as usize, 3),
            "the run's payload differs"
        );
        let (h2, d2) = &got[1];
        assert_eq!((h2.region, h2.offset, h2.len), (4, 0, 128));
        let want2 = [&src[row as usize..][..100], &src[5 * row as usize..][..28]].concat();
        assert_eq!(*d2, want2);
        // the checksum is the receiver's: one hash per piece as received
        let sum = checksum::combine(checksum::piece(4, 8192, d1), checksum::piece(4, 0, d2));
        assert_eq!(parts[0].checksum(), sum);
    }

    #[test]
    fn encrypted_runs_are_cut_sealed_per_piece_and_open_byte_exact() {
        use super::super::seal::{PieceOpener, SEAL_TAG_LEN};
        // 300 scattered 4 KiB rows to consecutive destination rows: cut at SEALED_PIECE_BYTES
        let row = 4096u64;
        let rows = 300u64;
        let src: Vec<u8> = (0..rows * row * 2).map(|i| (i * 17 % 253) as u8).collect();
        let base = src.as_ptr() as u64;
        let pieces: Vec<Piece> = (0..rows)
            .map(|i| p(base + i * 2 * row, 3, i * row, row))
            .collect();
        let parts = assign(&pieces, 1, SEALED_PIECE_BYTES);
        assert!(parts[0].spans.iter().all(|sp| sp.len <= SEALED_PIECE_BYTES));
        assert_eq!(
            parts[0].spans.len() as u64,
            (rows * row).div_ceil(SEALED_PIECE_BYTES)
        );
        let key = [5u8; 32];
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut rx, _) = l.accept().unwrap();
        let part = parts[0].clone();
        let sender = std::thread::spawn(move || {
            let mut g = Gather::default();
            let mut sealer = PieceSealer::new(&key);
            send_part_sealed(&tx, &part, 0, 11, &mut sealer, &mut g).unwrap();
        });
        let mut all = Vec::new();
        rx.read_to_end(&mut all).unwrap();
        sender.join().unwrap();
        let mut opener = PieceOpener::new(&key);
        let mut r = &all[..];
        let mut landed = vec![0u8; (rows * row) as usize];
        let mut n = 0;
        while !r.is_empty() {
            let mut hb = [0u8; DATA_HEADER_LEN];
            r.read_exact(&mut hb).unwrap();
            let h = DataHeader::decode(&hb).unwrap();
            let mut body = vec![0u8; h.len as usize];
            r.read_exact(&mut body).unwrap();
            let mut tag = [0u8; SEAL_TAG_LEN];
            r.read_exact(&mut tag).unwrap();
            opener.open(&hb, &mut body, &tag).unwrap();
            landed[h.offset as usize..][..body.len()].copy_from_slice(&body);
            n += 1;
        }
        assert_eq!(n, parts[0].spans.len());
        assert!(landed == every_nth(&src, rows as usize, row as usize, 2));
    }

    #[test]
    fn a_run_of_more_sources_in_place_than_iov_max_is_byte_exact() {
        // sources long enough to go in place, one iovec each, scattered
        let row = COPY_BELOW as usize;
        let rows = IOV_MAX + 37;
        let src: Vec<u8> = (0..rows * row * 2).map(|i| (i * 13 % 241) as u8).collect();
        let base = src.as_ptr() as u64;
        let r = row as u64;
        let mut pieces: Vec<Piece> = (0..rows as u64)
            .map(|i| p(base + i * 2 * r, 9, i * r, r))
            .collect();
        // a short source inside the run: copied between sources in place
        pieces.insert(5, p(base + 3 * r, 9, 5 * r, 10));
        for x in &mut pieces[6..] {
            x.offset += 10;
        }
        let parts = assign(&pieces, 1, u64::MAX);
        assert_eq!(parts[0].spans.len(), 1);
        assert!(parts[0].srcs.len() > IOV_MAX, "{}", parts[0].srcs.len());
        let got = send_and_read(&parts[0], 0, 3);
        assert_eq!(got.len(), 1);
        let (h, d) = &got[0];
        assert_eq!((h.region, h.offset, h.len), (9, 0, rows as u64 * r + 10));
        let mut want = every_nth(&src, 5, row, 2);
        want.extend_from_slice(&src[3 * row..][..10]);
        want.extend(every_nth(&src[10 * row..], rows - 5, row, 2));
        assert!(*d == want, "the run's payload differs");
    }
}
