//! Same-host one-sided writes with `process_vm_writev` (cross-memory attach).
//!
//! Protocol per batch: the sender validates every op against the
//! receiver's descriptors, sends the write intent (destination ranges); the
//! receiver validates it against its registry and pins the regions (Grant)
//! or refuses it (Refuse, nothing written); only then the sender writes, in
//! batched iovecs (IOV_MAX per call, partial writes resumed, optionally
//! split over several threads), and sends the commit record; the receiver
//! delivers the completion and acknowledges (Ack). An out-of-bounds range
//! is never written: the sender checks it, and the receiver's grant is
//! required before the first byte moves.
//!
//! A batch of a room whose grant is open on the connection
//! ([`room`](super::room)) skips that exchange: it is checked against the
//! room's granted ranges here, written, and done once its bytes landed, with
//! no frame at all; the room's one RoomEnd/RoomAck follows its last batch.
//!
//! A batch into regions the receiver granted for the connection's life
//! (`transport::standing`: every host region it had at the
//! handshake, until an unregister revokes one) skips the exchange too: it
//! is checked against the peer's descriptors, written, and ends with one
//! `StandingCommit` frame, after which the receiver delivers its completion;
//! nothing is answered. When the submitting thread wrote the bytes, it seals
//! the commit in order on the connection and the writer thread writes it
//! (with any other waiting, in one write): the batch is done once its bytes
//! are in the receiver's memory and its commit is queued behind them. Reads and batches with a checksum keep the exchange.
//!
//! The process written into is the one the kernel names ([`bind`]): the
//! listener of the receiver's per-session Unix socket, by `SO_PEERCRED` and
//! its pidfd (`SO_PEERPIDFD`); a HelloAck naming any other pid is refused,
//! and nothing of a claimed process is read. The identity is checked too
//! (same boot id, the start time in `/proc/<pid>/stat`). The pidfd is
//! polled before each batch: a peer that exited (and whose pid might be
//! reused) is never written to.

use super::agent::Dialed;
use super::batch::Stage;
use super::conn::{Conn, Reach};
use super::handshake::Select;
use super::piece::Piece;
use super::standing::Ticket;
use super::wire::{self, Commit, FrameType};
use super::{
    BatchId, BatchOptions, BatchStatus, MappedRegion, PlacedRange, ReadOp, Transport,
    TransportKind, WriteOp,
};
use crate::error::{Error, Result, Status};
use crate::memory::{AccessGuard, RegionDesc};
use crossbeam::channel::{unbounded, Sender};
use std::sync::Arc;
use writers::Writers;

pub(crate) mod bind;
mod peer;
mod writers;
pub(crate) use peer::{split_even, PeerProcess};

/// A one-sided batch (a granted room's, or under standing grants) below this
/// many bytes is moved on the submitting thread whatever the writer threads
/// (one thread would move it anyway): no hand-off to the writer thread and
/// back, whose two wake-ups cost more than the copy.
const INLINE_BYTES: u64 = 256 << 10;

/// A batch of a granted room or under standing grants up to this many
/// bytes, on a connection with one writer thread and without `fan_out`, is
/// moved on the submitting thread whatever its size: the writer thread would move it alone anyway,
/// and handing it over costs two wake-ups per batch (a third of a 1 MiB
/// batch's time on a 2-core machine). `submit` then returns with the bytes
/// written; a standing batch's `StandingCommit` is sealed there and written
/// by the writer thread, off the caller's time.
const INLINE_ONE_THREAD_BYTES: u64 = 4 << 20;

struct Job {
    id: u64,
    read: bool,
    pieces: Vec<Piece>,
    commit: Commit,
    /// A batch of a room open under a grant: (room, epoch); it ends here,
    /// with no frame to the receiver.
    room: Option<(u64, u64)>,
    _guards: Arc<Vec<AccessGuard>>,
    /// The caller placed the bytes already (`submit_placed`): nothing to move.
    placed: bool,
    /// A batch under standing grants, held until its bytes were written; it
    /// ends with a `StandingCommit` and no answer.
    standing: Option<Ticket>,
}

/// What the writer thread is handed.
enum Task {
    /// A batch to move (and end).
    Move(Job),
    /// Write the control frames the submitting thread deferred (the
    /// `StandingCommit`s of batches it moved itself).
    Flush,
}

/// The cma transport (sender side).
pub struct CmaTransport {
    conn: Arc<Conn>,
    tx: Sender<Task>,
    mapped: usize,
    /// The peer (shared with the writer thread): its mapped regions live as
    /// long as this transport.
    peer: Arc<PeerProcess>,
    /// Writer threads a batch is split over (the connection's `threads`).
    threads: usize,
    /// The connection's `fan_out`: no batch of `INLINE_BYTES` or more is
    /// moved inside `submit`.
    fan_out: bool,
}

impl CmaTransport {
    pub(crate) fn new(
        conn: Arc<Conn>,
        mut peer: PeerProcess,
        threads: usize,
        fan_out: bool,
    ) -> Result<CmaTransport> {
        let regions: Vec<RegionDesc> = conn.regions.values().cloned().collect();
        let mapped = peer.map_shared(&regions);
        let peer = Arc::new(peer);
        let (tx, rx) = unbounded::<Task>();
        let (c, p) = (conn.clone(), peer.clone());
        let writers = Writers::start(&peer, threads)?;
        crate::threads::spawn("pdxfer-cma-tx".into(), move || {
            for task in rx {
                match task {
                    Task::Move(job) => {
                        c.run_job(&p, &writers, job, false);
                    }
                    Task::Flush => {
                        let _ = c.flush_deferred();
                    }
                }
            }
        })?;
        Ok(CmaTransport {
            conn,
            tx,
            mapped,
            peer,
            threads,
            fan_out,
        })
    }
}

/// The sender's cma setup on a dialed control connection: binds the target
/// to the process listening on the receiver's binding socket (`SO_PEERCRED`,
/// its pidfd) and checks that it is the process the HelloAck names, selects
/// cma, waits for the receiver's answer on the binding socket and starts the
/// transport.
pub(crate) fn connect(mut d: Dialed<'_>) -> Result<Box<dyn Transport>> {
    let mut vouched = match d.vouched.take() {
        Some(v) => v,
        None => {
            let name = d.ack.cma_socket.as_deref().ok_or_else(|| {
                Error::new(
                    Status::PeerIdentity,
                    format!(
                        "the peer at {} (claiming pid {} on {}) offers no cma binding socket: \
                         not on this host, or it predates kernel-vouched cma; use tcp",
                        d.addr, d.ack.identity.pid, d.ack.identity.hostname
                    ),
                )
            })?;
            bind::Vouched::connect(name, d.addr, d.opts.timeout)?
        }
    };
    let addr = d.addr;
    let pidfd = PeerProcess::bound(d.identity, &d.ack.identity, &mut vouched, addr)?;
    d.send_json(
        FrameType::Select,
        &Select {
            transport: TransportKind::Cma,
            streams: 0,
            rdma: None,
            tcp_encrypt: false,
        },
    )?;
    let _: serde_json::Value = d.recv_json(FrameType::SelectOk)?;
    vouched.confirm(addr)?;
    let (threads, fan_out) = (d.opts.threads.max(1) as usize, d.opts.fan_out);
    let conn = d.start()?;
    Ok(Box::new(CmaTransport::new(conn, pidfd, threads, fan_out)?))
}

impl Conn {
    /// Moves a job's bytes and ends its batch. `defer` (the submitting
    /// thread moved it): a `StandingCommit` is sealed in order but written by
    /// the writer thread, and `true` is returned when that thread must be
    /// asked to (the first frame waiting).
    fn run_job(&self, peer: &PeerProcess, writers: &Writers, mut job: Job, defer: bool) -> bool {
        let r = self.move_job(peer, writers, &job);
        if let Some(ticket) = job.standing.take() {
            // written (or failed) under standing grants: one frame, no answer.
            // The batch is done once its bytes are in the receiver's memory
            // and its commit is sealed behind them on the connection; the
            // ticket (a revoke's fence waits for it) goes after the sealing,
            // so a `Fenced` is always written after the commit.
            let mut flush = false;
            if r.is_ok() {
                let commit = wire::encode_commit(&job.commit);
                let sealed = if defer {
                    self.send_deferred(FrameType::StandingCommit, &commit)
                        .map(|first| flush = first)
                } else {
                    self.send(FrameType::StandingCommit, &commit)
                };
                if sealed.is_ok() {
                    self.table.set(job.id, Stage::Done);
                }
            }
            drop(ticket);
            return flush;
        }
        if let Some(key) = job.room {
            // a granted room's batch ends here: no commit, no frame
            let outcome = match r {
                Ok(_) => {
                    self.table.set(job.id, Stage::Done);
                    Ok(job.commit.bytes)
                }
                Err(e) => {
                    self.table.fail(job.id, e.clone());
                    Err(e)
                }
            };
            self.rooms.finished(key, outcome);
            return false;
        }
        match r {
            Ok(read_sum) => {
                let mut commit = job.commit;
                if read_sum.is_some() {
                    commit.checksum = read_sum;
                }
                let _ = self.send(FrameType::Commit, &wire::encode_commit(&commit));
            }
            Err(_) => {
                let _ = self.send(FrameType::Abort, &job.id.to_le_bytes());
            }
        }
        false
    }

    /// Moves a job's bytes once it is granted; `Ok` when every byte landed
    /// before the batch's deadline (the batch is then `Written`; a read asked
    /// for a checksum gets it, recorded and returned), else why not (the
    /// batch failed).
    fn move_job(&self, peer: &PeerProcess, writers: &Writers, job: &Job) -> Result<Option<u64>> {
        let gone = || Error::new(Status::BatchFailed, "the batch ended before it was written");
        self.table.wait_granted(job.id)?;
        if let Err(e) = peer.check_alive() {
            self.fail_all(e.clone());
            return Err(e);
        }
        if self.table.finished(job.id) {
            return Err(gone());
        }
        let threads = writers.threads();
        let r = if job.placed {
            Ok(job.commit.bytes)
        } else if threads <= 1 || job.pieces.is_empty() || job.commit.bytes < (256 << 10) {
            peer.xfer(&job.pieces, job.read)
        } else {
            writers.xfer(peer, split_even(&job.pieces, threads), job.read)
        };
        match r {
            Ok(n) if n == job.commit.bytes => {
                let mut read_sum = None;
                if job.read && job.commit.checksum.is_some() {
                    let sum = read_checksum(&job.pieces);
                    self.table.set_checksum(job.id, sum);
                    read_sum = Some(sum);
                }
                self.table.set(job.id, Stage::Written);
                if self.table.finished(job.id) {
                    // Deadline passed while writing: no completion for the receiver.
                    return Err(gone());
                }
                Ok(read_sum)
            }
            Ok(n) => {
                let e = Error::new(
                    Status::BatchFailed,
                    format!("wrote {n} of {} bytes", job.commit.bytes),
                );
                self.table.fail(job.id, e.clone());
                Err(e)
            }
            Err(e) => {
                self.table.fail(job.id, e.clone());
                if e.status() == Status::PeerUnreachable {
                    self.fail_all(e.clone());
                }
                Err(e)
            }
        }
    }
}

/// Checksum of the bytes a read landed locally (same pieces as the peer's ranges).
fn read_checksum(pieces: &[Piece]) -> u64 {
    pieces.iter().fold(0u64, |acc, p| {
        // SAFETY: dst is a pinned local registered range the read just filled.
        let d = unsafe { std::slice::from_raw_parts(p.dst as *const u8, p.len as usize) };
        super::checksum::combine(acc, super::checksum::piece(p.region, p.offset, d))
    })
}

impl CmaTransport {
    fn submit_dir(&self, ops: &[WriteOp], opts: &BatchOptions, read: bool) -> Result<BatchId> {
        let (mut pieces, guards, bytes) = self.conn.validate(ops, Reach::Host)?;
        if read {
            for p in &mut pieces {
                std::mem::swap(&mut p.src, &mut p.dst);
            }
        }
        let granted = if read {
            None
        } else {
            self.conn.rooms.admit(&pieces, opts)?
        };
        let standing = if read || opts.checksum || granted.is_some() {
            None
        } else {
            self.conn.standing.admit(&pieces)
        };
        let (commit, room) = match (granted, &standing) {
            (Some(_token), _) => (
                self.conn.insert_room_batch(bytes, &guards, opts)?,
                Some((opts.room, opts.epoch)),
            ),
            (None, Some(_)) => (self.conn.insert_standing_batch(bytes, &guards, opts)?, None),
            (None, None) => (
                self.conn.announce(&pieces, &guards, bytes, opts, read)?,
                None,
            ),
        };
        let one_sided = room.is_some() || standing.is_some();
        let inline = one_sided
            && (bytes < INLINE_BYTES
                || (!self.fan_out && self.threads <= 1 && bytes <= INLINE_ONE_THREAD_BYTES));
        let id = commit.batch;
        let job = Job {
            id,
            read,
            pieces,
            commit,
            room,
            _guards: guards,
            placed: false,
            standing,
        };
        if inline {
            // nothing to wait for (granted with the room, or standing):
            // moved on this thread, sparing the writer thread's wake-up and
            // the caller's; a standing commit is written by the writer thread
            if self.conn.run_job(&self.peer, &Writers::single(), job, true)
                && self.tx.send(Task::Flush).is_err()
            {
                let _ = self.conn.flush_deferred();
            }
        } else {
            self.queue(job);
        }
        Ok(BatchId(id))
    }

    /// Hands a job to the writer thread (it fails when the thread is gone).
    fn queue(&self, job: Job) {
        let (id, room) = (job.id, job.room);
        if self.tx.send(Task::Move(job)).is_err() {
            let e = Error::new(Status::PeerUnreachable, "cma writer thread is gone");
            if let Some(key) = room {
                self.conn.rooms.finished(key, Err(e.clone()));
            }
            self.conn.table.fail(id, e);
        }
    }
}

impl CmaTransport {
    /// Checks placed ranges against the peer's descriptors and the mapped
    /// regions: pieces whose source is the mapped destination itself.
    fn placed_pieces(&self, ranges: &[PlacedRange]) -> Result<(Vec<Piece>, u64)> {
        if let Some(e) = self.conn.table.dead() {
            return Err(e);
        }
        let mut pieces = Vec::with_capacity(ranges.len());
        let mut total = 0u64;
        for (i, r) in ranges.iter().enumerate() {
            let refused = |status, what: String| {
                Err(Error::new(
                    status,
                    format!("range {i} of the placed batch: {what}; nothing was sent"),
                ))
            };
            let Some(d) = self.conn.regions.get(&r.remote_region) else {
                return refused(
                    Status::RegionNotFound,
                    format!("the peer exported no region {}", r.remote_region),
                );
            };
            if let Err(e) = d.check(r.remote_offset, r.len) {
                return refused(e.status(), e.detail().to_string());
            }
            let Some((addr, _)) = self.peer.mapped(r.remote_region) else {
                return refused(
                    Status::Unsupported,
                    format!(
                        "the peer's region {} is not mapped here (not memfd-backed); use submit",
                        r.remote_region
                    ),
                );
            };
            total = total
                .checked_add(r.len)
                .ok_or_else(|| Error::invalid("batch size overflows"))?;
            pieces.push(Piece {
                src: addr + r.remote_offset,
                region: r.remote_region,
                offset: r.remote_offset,
                dst: d.addr + r.remote_offset,
                len: r.len,
            });
        }
        Ok((pieces, total))
    }

    /// `submit_placed`: the write path of `submit_dir` with the caller's
    /// placement between the grant and the commit, and the job flagged as
    /// placed so the writer thread only commits it.
    fn submit_placed_dir(
        &self,
        ranges: &[PlacedRange],
        opts: &BatchOptions,
        place: &mut dyn FnMut() -> Result<()>,
    ) -> Result<BatchId> {
        let (pieces, bytes) = self.placed_pieces(ranges)?;
        let guards = Arc::new(Vec::new());
        if let Some(_token) = self.conn.rooms.admit(&pieces, opts)? {
            return self.submit_placed_in_room(pieces, bytes, guards, opts, place);
        }
        // the checksum covers the placed bytes: computed once they are there
        let announce_opts = BatchOptions {
            checksum: false,
            ..*opts
        };
        let mut commit = self
            .conn
            .announce(&pieces, &guards, bytes, &announce_opts, false)?;
        let id = commit.batch;
        let gone = |e: Error| {
            self.conn.table.fail(id, e);
            let _ = self.conn.send(FrameType::Abort, &id.to_le_bytes());
            match self.conn.table.poll(BatchId(id)) {
                Ok(BatchStatus::Failed(e)) => e,
                _ => Error::new(Status::BatchFailed, "placed batch failed"),
            }
        };
        // Place only after the grant: the peer validated and pinned every range.
        if let Err(e) = self.conn.table.wait_granted(id) {
            return Err(gone(e));
        }
        if let Err(e) = self.peer.check_alive() {
            self.conn.table.fail_all(e.clone());
            return Err(gone(e));
        }
        if let Err(e) = place() {
            return Err(gone(e));
        }
        if opts.checksum {
            let sum = super::conn::checksum_pieces(&pieces);
            commit.checksum = Some(sum);
            self.conn.table.set_checksum(id, sum);
        }
        let job = Job {
            id,
            read: false,
            pieces,
            commit,
            room: None,
            _guards: guards,
            placed: true,
            standing: None,
        };
        self.queue(job);
        Ok(BatchId(id))
    }

    /// `submit_placed` for a batch of a room whose grant is open (its
    /// ranges were checked against it): placed at once, no intent, no grant
    /// and no commit frame; done before this returns.
    fn submit_placed_in_room(
        &self,
        pieces: Vec<Piece>,
        bytes: u64,
        guards: Arc<Vec<AccessGuard>>,
        opts: &BatchOptions,
        place: &mut dyn FnMut() -> Result<()>,
    ) -> Result<BatchId> {
        let key = (opts.room, opts.epoch);
        let commit = self.conn.insert_room_batch(bytes, &guards, opts)?;
        let id = commit.batch;
        let placed = self.peer.check_alive().inspect_err(|e| {
            self.conn.fail_all(e.clone());
        });
        if let Err(e) = placed.and_then(|()| place()) {
            self.conn.table.fail(id, e.clone());
            let _ = self.conn.table.poll(BatchId(id));
            self.conn.rooms.finished(key, Err(e.clone()));
            return Err(e);
        }
        // placed already and granted with the room: marked done on this thread
        let _ = self.conn.run_job(
            &self.peer,
            &Writers::single(),
            Job {
                id,
                read: false,
                pieces,
                commit,
                room: Some(key),
                _guards: guards,
                placed: true,
                standing: None,
            },
            false,
        );
        Ok(BatchId(id))
    }
}

impl Transport for CmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Cma
    }

    fn data_path(&self) -> &'static str {
        if self.mapped > 0 {
            "cma: memcpy into the peer's mapped memfd regions (process_vm_writev for others)"
        } else {
            "cma: process_vm_writev"
        }
    }

    super::conn::conn_backed_transport!();
    super::conn::conn_room_grants!();

    fn submit(&self, ops: &[WriteOp], opts: &BatchOptions) -> Result<BatchId> {
        self.submit_dir(ops, opts, false)
    }

    fn submit_reads(&self, ops: &[ReadOp], opts: &BatchOptions) -> Result<BatchId> {
        let w: Vec<WriteOp> = ops.iter().map(ReadOp::as_write).collect();
        self.submit_dir(&w, opts, true)
    }

    fn mapped_dst(&self, region: u64) -> Option<MappedRegion> {
        self.peer
            .mapped(region)
            .map(|(addr, len)| MappedRegion { addr, len })
    }

    fn submit_placed(
        &self,
        ranges: &[PlacedRange],
        opts: &BatchOptions,
        place: &mut dyn FnMut() -> Result<()>,
    ) -> Result<BatchId> {
        self.submit_placed_dir(ranges, opts, place)
    }

    fn close(&self) {
        self.conn.close();
    }
}

impl Drop for CmaTransport {
    fn drop(&mut self) {
        self.conn.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_even_covers_every_byte_once() {
        let pieces = vec![
            Piece {
                src: 0,
                region: 1,
                offset: 0,
                dst: 1000,
                len: 10,
            },
            Piece {
                src: 100,
                region: 1,
                offset: 50,
                dst: 1050,
                len: 7,
            },
        ];
        for n in 1..5 {
            let g = split_even(&pieces, n);
            assert!(g.len() <= n);
            let mut bytes: Vec<(u64, u64)> = g
                .iter()
                .flatten()
                .flat_map(|p| (0..p.len).map(move |k| (p.src + k, p.dst + k)))
                .collect();
            bytes.sort();
            let want: Vec<(u64, u64)> = (0..10)
                .map(|k| (k, 1000 + k))
                .chain((0..7).map(|k| (100 + k, 1050 + k)))
                .collect();
            assert_eq!(bytes, want, "n={n}");
        }
    }
}
