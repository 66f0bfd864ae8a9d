//! The tcp sender: one thread per data stream gathers pieces straight from
//! registered memory with `writev`; the last stream of a batch sends its
//! commit on the control connection. A batch of a room whose grant is open
//! on the connection sends no commit: its pieces carry the grant's token, it
//! is done once they were written, and the room's RoomEnd (after its last
//! batch) is answered once the receiver landed every byte.

use crate::error::{Error, Result, Status};
use crate::memory::AccessGuard;
use crate::transport::agent::Dialed;
use crate::transport::batch::Stage;
use crate::transport::conn::{checksum_pieces, Conn, Piece, Reach};
use crate::transport::handshake::Attach;
use crate::transport::handshake::Select;
use crate::transport::peer_auth::authenticate_client;
use crate::transport::wire::{self, Commit, DataHeader, FrameType, DATA_HEADER_LEN};
use crate::transport::{BatchId, BatchOptions, Completion, Transport, TransportKind, WriteOp};
use crossbeam::channel::{unbounded, Sender};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Pieces larger than this are split across streams when there are several.
const SPLIT: u64 = 512 << 10;
/// Most pieces gathered into one `writev` (2 iovecs each: `IOV_MAX` is 1024).
const GATHER: usize = 512;
/// A write blocked this long fails the connection.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

struct BatchShared {
    remaining: AtomicUsize,
    commit: Commit,
    /// A batch of a granted room: (room, epoch) and the grant's token.
    room: Option<((u64, u64), u64)>,
    _guards: Arc<Vec<AccessGuard>>,
}

struct Job {
    pieces: Vec<Piece>,
    flags: u32,
    batch: Arc<BatchShared>,
}

/// The tcp transport (sender side).
pub struct TcpTransport {
    conn: Arc<Conn>,
    streams: Vec<Sender<Job>>,
    sockets: Vec<TcpStream>,
}

impl TcpTransport {
    pub(crate) fn new(conn: Arc<Conn>, streams: Vec<TcpStream>) -> Result<TcpTransport> {
        let mut txs = Vec::new();
        let mut sockets = Vec::new();
        for (i, s) in streams.into_iter().enumerate() {
            s.set_write_timeout(Some(WRITE_TIMEOUT))?;
            sockets.push(s.try_clone()?);
            let (tx, rx) = unbounded::<Job>();
            let c = conn.clone();
            std::thread::Builder::new()
                .name(format!("pdxfer-tcp-tx{i}"))
                .spawn(move || {
                    let mut gather = Gather::default();
                    for job in rx {
                        if let Err(e) = send_job(&c, &s, &job, &mut gather) {
                            let e = Error::new(
                                Status::PeerUnreachable,
                                format!(
                                    "data stream {i} to peer pid {} at {} failed: {}",
                                    c.peer.pid,
                                    c.addr,
                                    e.detail()
                                ),
                            );
                            c.rooms.fail_all(e.clone());
                            c.table.fail_all(e);
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
        })
    }
}

/// The sender's tcp setup on a dialed control connection: selects tcp with
/// `opts.streams` (1 to 64) data streams, dials each and attaches it to the
/// receiver's session with its token, and starts the transport.
pub(crate) fn connect(mut d: Dialed<'_>) -> Result<Box<dyn Transport>> {
    let (addr, opts) = (d.addr, d.opts);
    let n = opts.streams.clamp(1, 64);
    wire::write_json(
        &mut d.stream,
        FrameType::Select,
        &Select {
            transport: TransportKind::Tcp,
            streams: n,
            proof: 0,
            rdma: None,
        },
    )?;
    let _: serde_json::Value = wire::read_json(&mut d.stream, FrameType::SelectOk)?;
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
        authenticate_client(&mut s, d.auth, d.instance, Some(d.peer), addr)?;
        wire::write_json(
            &mut s,
            FrameType::Attach,
            &Attach {
                session: d.ack.session,
                token: d.ack.token.clone(),
                index,
            },
        )?;
        let _: serde_json::Value = wire::read_json(&mut s, FrameType::AttachOk)?;
        streams.push(s);
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

/// A stream's headers and iovecs of one `writev`, reused from group to group.
#[derive(Default)]
struct Gather {
    headers: Vec<[u8; DATA_HEADER_LEN]>,
    iov: Vec<libc::iovec>,
}

fn send_job(c: &Conn, s: &TcpStream, job: &Job, g: &mut Gather) -> Result<()> {
    if c.table.finished(job.batch.commit.batch) {
        return Ok(()); // failed or expired: skip its bytes
    }
    for group in job.pieces.chunks(GATHER) {
        g.headers.clear();
        g.headers.extend(group.iter().map(|p| {
            DataHeader {
                flags: job.flags,
                batch: job.batch.room.map_or(job.batch.commit.batch, |(_, t)| t),
                region: p.region,
                offset: p.offset,
                len: p.len,
            }
            .encode()
        }));
        g.iov.clear();
        for (h, p) in g.headers.iter().zip(group) {
            g.iov.push(libc::iovec {
                iov_base: h.as_ptr() as *mut libc::c_void,
                iov_len: DATA_HEADER_LEN,
            });
            if p.len > 0 {
                g.iov.push(libc::iovec {
                    iov_base: p.src as *mut libc::c_void,
                    iov_len: p.len as usize,
                });
            }
        }
        writev_all(s, &mut g.iov)?;
    }
    Ok(())
}

/// `writev` until every iovec is written, resuming partial writes.
fn writev_all(s: &TcpStream, iov: &mut [libc::iovec]) -> Result<()> {
    let fd = s.as_raw_fd();
    let mut start = 0usize;
    while start < iov.len() {
        let cnt = (iov.len() - start).min(1024);
        // SAFETY: every iovec points at a live header or a pinned registered source range.
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

/// Splits large pieces (with several streams) and assigns them to the least loaded stream.
fn assign(pieces: Vec<Piece>, n: usize) -> Vec<Vec<Piece>> {
    let mut out = vec![Vec::new(); n];
    let mut load = vec![0u64; n];
    for p in pieces {
        let mut p = p;
        loop {
            let take = if n > 1 { p.len.min(SPLIT) } else { p.len };
            let mut part = p;
            part.len = take;
            let k = (0..n).min_by_key(|&k| load[k]).unwrap_or(0);
            load[k] += take.max(1);
            out[k].push(part);
            p.src += take;
            p.dst += take;
            p.offset += take;
            p.len -= take;
            if p.len == 0 {
                break;
            }
        }
    }
    out
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    crate::transport::conn::conn_backed_transport!();
    crate::transport::conn::conn_room_grants!();

    fn submit(&self, ops: &[WriteOp], opts: &BatchOptions) -> Result<BatchId> {
        // device destinations are landed by the receiver's device writer
        let (pieces, guards, bytes) = self.conn.validate(ops, Reach::AnyDestination)?;
        let room = self
            .conn
            .rooms
            .admit(&pieces, opts)?
            .map(|token| ((opts.room, opts.epoch), token));
        let parts = assign(pieces, self.streams.len());
        // The checksum is over the pieces as sent (the receiver sums the same pieces).
        let checksum = opts.checksum.then(|| {
            parts
                .iter()
                .map(|p| checksum_pieces(p))
                .fold(0u64, u64::wrapping_add)
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
        for (k, pieces) in parts.into_iter().enumerate() {
            if pieces.is_empty() {
                continue;
            }
            let job = Job {
                pieces,
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

    #[test]
    fn assign_balances_and_covers() {
        let p = |src, len| Piece {
            src,
            region: 1,
            offset: src,
            dst: src,
            len,
        };
        let parts = assign(vec![p(0, 3 * SPLIT + 5), p(10_000_000, 7)], 3);
        let total: u64 = parts.iter().flatten().map(|x| x.len).sum();
        assert_eq!(total, 3 * SPLIT + 12);
        assert!(parts.iter().all(|v| !v.is_empty()));
        let one = assign(vec![p(0, 3 * SPLIT)], 1);
        assert_eq!(one[0].len(), 1);
    }
}
