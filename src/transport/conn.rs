//! The sender side of a control connection (cma and tcp): the batch table,
//! the control writer, the reader thread that turns Grant/Refuse/Ack/Nack
//! into batch states, and local validation of every op before it is sent.

use super::batch::{BatchTable, Stage};
use super::identity::ProcIdentity;
use super::piece::Piece;
use super::room::{self, OpenRooms, RoomEnd, RoomGrant, RoomSummary};
use super::standing::{self, StandingRegions};
use super::wire::{self, FrameType};
use super::WriteOp;
use crate::auth::{SessionKeys, SessionMac};
use crate::error::{Error, Result, Status};
use crate::memory::{AccessGuard, RegionDesc, RegionKind, Registry};
use std::collections::HashMap;
use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The write half of a control connection: when a frame was last written,
/// the session MAC that seals what this side sends, and the frames sealed
/// but not yet written ([`Conn::send_deferred`]). Every write puts the
/// deferred frames first, so frames reach the peer in the order sealed.
struct ControlWriter {
    stream: TcpStream,
    last: Instant,
    mac: SessionMac,
    deferred: Vec<u8>,
    /// The types of the frames in `deferred`, counted once written.
    deferred_types: Vec<FrameType>,
}

impl ControlWriter {
    /// Writes the deferred frames and then `frame` (may be empty) in one write.
    fn write(&mut self, frame: Option<(FrameType, &[u8])>) -> Result<()> {
        if let Some((ty, payload)) = frame {
            wire::seal_frame(&mut self.deferred, ty, payload, &mut self.mac)?;
            self.deferred_types.push(ty);
        }
        if self.deferred.is_empty() {
            return Ok(());
        }
        self.last = Instant::now();
        let r = self.stream.write_all(&self.deferred);
        self.deferred.clear();
        for ty in self.deferred_types.drain(..) {
            super::control_counts::frame_sent(ty);
        }
        Ok(r?)
    }
}

pub(crate) struct Conn {
    pub table: BatchTable,
    /// The control connection's write half (see [`ControlWriter`]).
    writer: Mutex<ControlWriter>,
    shut: TcpStream,
    pub peer: ProcIdentity,
    pub regions: HashMap<u64, RegionDesc>,
    pub registry: Registry,
    pub session: u64,
    pub addr: String,
    /// The instance this side authenticated as (room grants name it).
    pub instance: [u8; 16],
    /// Room grants open on this connection.
    pub rooms: OpenRooms,
    /// The receiver's regions granted for the connection's life (cma).
    pub standing: Arc<StandingRegions>,
}

impl Conn {
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        stream: TcpStream,
        peer: ProcIdentity,
        regions: Vec<RegionDesc>,
        registry: Registry,
        session: u64,
        addr: String,
        keepalive: Duration,
        instance: [u8; 16],
        keys: SessionKeys,
    ) -> Result<Arc<Conn>> {
        let reader = stream.try_clone()?;
        let shut = stream.try_clone()?;
        let SessionKeys { send, recv, .. } = keys;
        let conn = Arc::new(Conn {
            table: BatchTable::default(),
            writer: Mutex::new(ControlWriter {
                stream,
                last: Instant::now(),
                mac: send,
                deferred: Vec::new(),
                deferred_types: Vec::new(),
            }),
            shut,
            peer,
            regions: regions.into_iter().map(|d| (d.id, d)).collect(),
            registry,
            session,
            addr,
            instance,
            rooms: OpenRooms::default(),
            standing: Arc::default(),
        });
        let c = conn.clone();
        crate::threads::spawn("pdxfer-ctrl-rx".into(), move || {
            c.reader(reader, keepalive, recv)
        })?;
        Ok(conn)
    }

    /// Reads the receiver's frames; between them, sends a keepalive whenever
    /// nothing was sent for `keepalive` (the receiver closes sessions whose
    /// sender is silent past its idle timeout).
    fn reader(self: Arc<Self>, mut r: TcpStream, keepalive: Duration, mut mac: SessionMac) {
        let keepalive = keepalive.max(Duration::from_millis(10));
        let err = loop {
            let idle = self.idle();
            if idle >= keepalive {
                if let Err(e) = self.send(FrameType::Keepalive, &[]) {
                    break e;
                }
                continue;
            }
            match readable(&r, keepalive - idle) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => break e,
            }
            let (ty, p) = match wire::read_frame_sealed(&mut r, wire::MAX_CONTROL_PAYLOAD, &mut mac)
            {
                Ok(f) => f,
                Err(e) => break e,
            };
            let r = match ty {
                FrameType::Grant => {
                    wire::decode_batch(&p).map(|b| self.table.set(b, Stage::Granted))
                }
                FrameType::Ack => wire::decode_batch(&p).map(|b| self.table.set(b, Stage::Done)),
                FrameType::Refuse | FrameType::Nack => {
                    wire::decode_reason(&p).map(|(b, e)| self.table.fail(b, e))
                }
                FrameType::RoomAck => room::decode_room_ack(&p)
                    .map(|(token, sum)| self.rooms.answered(token, Ok(sum))),
                FrameType::RoomLanded => crate::transport::landed::Landed::decode(&p)
                    .map(|(token, l)| self.rooms.landed(token, l)),
                FrameType::RoomRefuse => {
                    wire::decode_reason(&p).map(|(token, e)| self.rooms.answered(token, Err(e)))
                }
                FrameType::StandingGrant => {
                    standing::decode_regions(&p).map(|r| self.standing.grant(&r))
                }
                FrameType::Revoke => wire::decode_batch(&p).and_then(|region| self.fence(region)),
                // the receiver drops the session because a data stream
                // failed its integrity check (an encrypted piece's tag)
                FrameType::Error => Err(match wire::decode_error(&p) {
                    e if e.status() == Status::ChannelIntegrity => e,
                    e => Error::new(
                        Status::Protocol,
                        format!("unexpected Error frame from the receiver: {e}"),
                    ),
                }),
                other => Err(Error::new(
                    Status::Protocol,
                    format!("unexpected {other:?} frame from the receiver"),
                )),
            };
            if let Err(e) = r {
                break e;
            }
        };
        let detail = format!(
            "control connection (session {}) to peer pid {} ({}) at {} lost: {} (the peer process died, closed the connection, or sent garbage)",
            self.session,
            self.peer.pid,
            self.peer.hostname,
            self.addr,
            err.detail()
        );
        let status = if matches!(err.status(), Status::Protocol | Status::ChannelIntegrity) {
            err.status()
        } else {
            Status::PeerUnreachable
        };
        let e = Error::new(status, detail);
        self.fail_all(e);
        let _ = self.shut.shutdown(Shutdown::Both);
    }

    /// Answers the receiver's revoke of the standing grant of `region`: off
    /// this thread (a batch it waits for may wait for a frame this thread
    /// reads), once no batch under the grant is writing, `Fenced`.
    fn fence(self: &Arc<Self>, region: u64) -> Result<()> {
        let c = self.clone();
        crate::threads::spawn("pdxfer-fence".into(), move || {
            match c.standing.revoke(region, FENCE_WAIT) {
                Ok(()) => {
                    let _ = c.send(FrameType::Fenced, &region.to_le_bytes());
                }
                // no Fenced: the receiver keeps the region pinned
                Err(e) => log::error!("revoking the standing grant of region {region}: {e}"),
            }
        })?;
        Ok(())
    }

    /// Fails every open room grant and batch of this connection with `e`.
    pub(crate) fn fail_all(&self, e: Error) {
        self.rooms.fail_all(e.clone());
        self.table.fail_all(e);
    }

    /// Sends a control frame (after any deferred ones); a failure kills the
    /// connection.
    pub fn send(&self, ty: FrameType, payload: &[u8]) -> Result<()> {
        let r = self.writer().write(Some((ty, payload)));
        self.sent(r)
    }

    /// Seals a control frame now and writes it with the next write on this
    /// connection (`send`, `flush_deferred`), in order. `Ok(true)` when it is
    /// the first frame waiting: the caller arranges a `flush_deferred` then.
    pub fn send_deferred(&self, ty: FrameType, payload: &[u8]) -> Result<bool> {
        if let Some(e) = self.table.dead() {
            return Err(e);
        }
        let mut guard = self.writer();
        let w = &mut *guard;
        let first = w.deferred.is_empty();
        wire::seal_frame(&mut w.deferred, ty, payload, &mut w.mac)?;
        w.deferred_types.push(ty);
        Ok(first)
    }

    /// Writes the frames `send_deferred` sealed; a failure kills the connection.
    pub fn flush_deferred(&self) -> Result<()> {
        let r = self.writer().write(None);
        self.sent(r)
    }

    fn writer(&self) -> std::sync::MutexGuard<'_, ControlWriter> {
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A write's outcome: a failure fails the connection.
    fn sent(&self, r: Result<()>) -> Result<()> {
        if let Err(e) = &r {
            let e = Error::new(
                Status::PeerUnreachable,
                format!(
                    "sending to peer pid {} at {} failed: {}",
                    self.peer.pid,
                    self.addr,
                    e.detail()
                ),
            );
            self.fail_all(e);
        }
        r
    }

    /// Opens a room grant on this connection for the batches tagged
    /// `(grant.room, epoch)`.
    pub fn open_room(&self, grant: &RoomGrant, epoch: u64) -> Result<()> {
        if let Some(e) = self.table.dead() {
            return Err(e);
        }
        self.rooms.open(grant, epoch, self.instance)
    }

    /// Reopens `grant` on this connection after an earlier connection of
    /// the room broke: asks the receiver what landed under it (within
    /// `timeout`), opens the room here and counts `carried` bytes as landed
    /// before (the caller's total of the room minus what it sends again
    /// here, computed from the answer); returns the answer.
    pub fn resume_room(
        &self,
        grant: &RoomGrant,
        epoch: u64,
        timeout: Duration,
    ) -> Result<crate::transport::landed::Landed> {
        if let Some(e) = self.table.dead() {
            return Err(e);
        }
        self.rooms.ask(grant.token);
        if let Err(e) = self.send(FrameType::RoomQuery, &grant.token.to_le_bytes()) {
            self.rooms.answered(grant.token, Err(e));
        }
        let landed = self.rooms.wait_landed(grant.token, timeout).map_err(|e| {
            Error::new(
                e.status(),
                format!(
                    "asking peer pid {} what landed of room {}: {}",
                    self.peer.pid,
                    grant.room,
                    e.detail()
                ),
            )
        })?;
        self.rooms.open(grant, epoch, self.instance)?;
        Ok(landed)
    }

    /// Sends an open room's RoomEnd (once its batches are done, within
    /// `timeout`) and returns without waiting for the answer; `close_room`
    /// of the same room then waits for it. A caller closing a room on several
    /// connections sends every RoomEnd first, so the answers overlap.
    pub fn end_room(&self, room: u64, epoch: u64, timeout: Duration) -> Result<()> {
        let (token, sum) = self.send_room_end(room, epoch, timeout)?;
        self.rooms.ended(room, epoch, token, sum);
        Ok(())
    }

    /// Takes the room once its batches are done and sends its RoomEnd: the
    /// grant's token and the totals sent.
    fn send_room_end(
        &self,
        room: u64,
        epoch: u64,
        timeout: Duration,
    ) -> Result<(u64, RoomSummary)> {
        let (grant, sum) = self.rooms.take(room, epoch, timeout)?;
        let end = RoomEnd {
            token: grant.token,
            room: grant.room,
            epoch: grant.epoch,
            batches: sum.batches,
            bytes: sum.bytes,
        };
        if let Err(e) = self.send(FrameType::RoomEnd, &end.encode()) {
            self.rooms.answered(grant.token, Err(e));
        }
        Ok((grant.token, sum))
    }

    /// Closes an open room: waits for its batches, sends RoomEnd with their
    /// totals (unless `end_room` did) and waits for the receiver's RoomAck
    /// (all within `timeout`).
    pub fn close_room(&self, room: u64, epoch: u64, timeout: Duration) -> Result<RoomSummary> {
        let t0 = Instant::now();
        let (token, sum) = match self.rooms.take_ended(room, epoch) {
            Some(ended) => ended,
            None => self.send_room_end(room, epoch, timeout)?,
        };
        let got = self
            .rooms
            .wait_answer(token, timeout.saturating_sub(t0.elapsed()))
            .map_err(|e| {
                Error::new(
                    e.status(),
                    format!(
                        "closing room {room} on peer pid {}: {}",
                        self.peer.pid,
                        e.detail()
                    ),
                )
            })?;
        if got != sum {
            return Err(Error::new(
                Status::Protocol,
                format!(
                    "room {room}: the receiver acknowledged {} batches / {} bytes, this side wrote {} / {}",
                    got.batches, got.bytes, sum.batches, sum.bytes
                ),
            ));
        }
        Ok(sum)
    }

    /// How long since a frame was last sent.
    fn idle(&self) -> Duration {
        self.writer().last.elapsed()
    }

    /// Fails what is open on this connection and shuts it down; the frames
    /// still deferred are written first (their batches are done).
    pub fn close(&self) {
        let _ = self.flush_deferred();
        let e = Error::new(
            Status::PeerUnreachable,
            "the connection was closed by this side",
        );
        self.fail_all(e);
        let _ = self.shut.shutdown(Shutdown::Both);
    }

    pub fn alive(&self) -> bool {
        self.table.dead().is_none()
    }

    /// Numbers a batch of a room whose grant is open here (its pieces were
    /// admitted against the grant): no Intent, no Grant frame; the entry is
    /// granted at once. Returns the commit record the batch ends with. A
    /// refusal (the batch table is full or dead) is counted as the room's.
    pub fn insert_room_batch(
        &self,
        bytes: u64,
        guards: &Arc<Vec<AccessGuard>>,
        opts: &super::BatchOptions,
    ) -> Result<wire::Commit> {
        let template = super::Completion::pending(bytes, None, opts);
        let id = match self.table.insert(opts.timeout, template, guards.clone()) {
            Ok(id) => id,
            Err(e) => {
                self.rooms.finished((opts.room, opts.epoch), Err(e.clone()));
                return Err(e);
            }
        };
        self.table.set(id, Stage::Granted);
        Ok(wire::Commit {
            batch: id,
            bytes,
            checksum: None,
            room: opts.room,
            epoch: opts.epoch,
        })
    }

    /// Numbers a batch whose destinations are all under standing grants (a
    /// [`Ticket`](standing::Ticket) holds them): no Intent, no Grant frame; the
    /// entry is granted at once. Returns the commit record to send once the
    /// bytes landed.
    pub fn insert_standing_batch(
        &self,
        bytes: u64,
        guards: &Arc<Vec<AccessGuard>>,
        opts: &super::BatchOptions,
    ) -> Result<wire::Commit> {
        let template = super::Completion::pending(bytes, None, opts);
        let id = self.table.insert(opts.timeout, template, guards.clone())?;
        self.table.set(id, Stage::Granted);
        Ok(wire::Commit {
            batch: id,
            bytes,
            checksum: None,
            room: opts.room,
            epoch: opts.epoch,
        })
    }

    /// Numbers a one-sided batch and announces it to the peer: the checksum of
    /// the source pieces for writes (a placeholder for reads, computed once the
    /// bytes landed), the batch-table entry holding `guards` until the batch
    /// ends, and the `Intent` (`ReadIntent`) listing the peer's ranges for it to
    /// validate and pin. Returns the commit record to send once the data is placed.
    pub fn announce(
        &self,
        pieces: &[Piece],
        guards: &Arc<Vec<AccessGuard>>,
        bytes: u64,
        opts: &super::BatchOptions,
        read: bool,
    ) -> Result<wire::Commit> {
        let checksum = opts
            .checksum
            .then(|| if read { 0 } else { checksum_pieces(pieces) });
        let template = super::Completion::pending(bytes, checksum, opts);
        let id = self.table.insert(opts.timeout, template, guards.clone())?;
        let ranges: Vec<wire::Range> = pieces
            .iter()
            .map(|p| wire::Range {
                region: p.region,
                offset: p.offset,
                len: p.len,
            })
            .collect();
        let ty = if read {
            FrameType::ReadIntent
        } else {
            FrameType::Intent
        };
        self.send(ty, &wire::encode_intent(id, &ranges))?;
        Ok(wire::Commit {
            batch: id,
            bytes,
            checksum,
            room: opts.room,
            epoch: opts.epoch,
        })
    }

    /// Validates every op (local source against our registry, destination
    /// against the peer's descriptors, device memory only where `reach`
    /// allows it) and pins the local sources.
    pub fn validate(
        &self,
        ops: &[WriteOp],
        reach: Reach,
    ) -> Result<(Vec<Piece>, Arc<Vec<AccessGuard>>, u64)> {
        if let Some(e) = self.table.dead() {
            return Err(e);
        }
        validate_ops(
            &self.registry,
            |id| self.regions.get(&id).cloned(),
            ops,
            reach,
        )
    }
}

/// Longest a revoke of a standing grant waits for the batches writing under it.
const FENCE_WAIT: Duration = Duration::from_secs(120);

/// Waits up to `timeout` for `s` to become readable (a frame, or its end).
pub(crate) fn readable(s: &TcpStream, timeout: Duration) -> Result<bool> {
    let mut pfd = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: pfd is one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e.into());
    }
    Ok(n > 0)
}

/// Which memory a byte mover reaches, so which sides of an op may be device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Host memory on both sides (local, cma).
    Host,
    /// Host sources, destinations of any kind: the receiver lands the bytes
    /// itself (tcp: with the region's device writer, or it refuses the write).
    AnyDestination,
    /// Host or device memory on both sides (rdma: the NIC moves device memory).
    Any,
}

/// Shared by every transport: checks ops (device regions only where `reach`
/// allows them), pins the local sources, returns pieces.
pub(crate) fn validate_ops(
    registry: &Registry,
    remote: impl Fn(u64) -> Option<RegionDesc>,
    ops: &[WriteOp],
    reach: Reach,
) -> Result<(Vec<Piece>, Arc<Vec<AccessGuard>>, u64)> {
    let mut pieces = Vec::with_capacity(ops.len());
    let mut total = 0u64;
    let mut pinned: HashMap<u64, AccessGuard> = HashMap::new();
    let mut locals: HashMap<u64, RegionDesc> = HashMap::new();
    let mut remotes: HashMap<u64, Option<RegionDesc>> = HashMap::new();
    // the previous op's regions (checked and pinned): an op into the same
    // ones, as most of a batch's are, costs no lookup
    let mut last: Option<LastRegions> = None;
    for (i, op) in ops.iter().enumerate() {
        let ctx = |e: Error| {
            Error::new(
                e.status(),
                format!("op {i} of the batch: {}; nothing was sent", e.detail()),
            )
        };
        let same = last
            .as_ref()
            .filter(|(l, _, r, _)| (*l, *r) == (op.local_region, op.remote_region));
        let (src_base, dst_base) = if let Some((_, ldesc, _, rdesc)) = same {
            ldesc.check(op.local_offset, op.len).map_err(ctx)?;
            rdesc.check(op.remote_offset, op.len).map_err(ctx)?;
            (ldesc.addr, rdesc.addr)
        } else {
            let bases = check_new_regions(
                registry,
                &remote,
                op,
                reach,
                &ctx,
                &mut locals,
                &mut remotes,
                &mut pinned,
            )?;
            last = Some(bases.1);
            bases.0
        };
        total = total
            .checked_add(op.len)
            .ok_or_else(|| Error::invalid("batch size overflows"))?;
        pieces.push(Piece {
            src: src_base + op.local_offset,
            region: op.remote_region,
            offset: op.remote_offset,
            dst: dst_base + op.remote_offset,
            len: op.len,
        });
    }
    Ok((pieces, Arc::new(pinned.into_values().collect()), total))
}

/// The previous op's regions: local id and descriptor, remote id and descriptor.
type LastRegions = (u64, RegionDesc, u64, RegionDesc);

/// An op into regions other than the previous op's: looks them up (cached per
/// batch), checks its bounds and the regions' kinds against `reach`, pins the
/// local source; returns both regions' base addresses and the op's regions for
/// the next op.
#[allow(clippy::too_many_arguments)]
fn check_new_regions(
    registry: &Registry,
    remote: &impl Fn(u64) -> Option<RegionDesc>,
    op: &WriteOp,
    reach: Reach,
    ctx: &impl Fn(Error) -> Error,
    locals: &mut HashMap<u64, RegionDesc>,
    remotes: &mut HashMap<u64, Option<RegionDesc>>,
    pinned: &mut HashMap<u64, AccessGuard>,
) -> Result<((u64, u64), LastRegions)> {
    let ldesc = match locals.entry(op.local_region) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            v.insert(registry.get(op.local_region).map_err(ctx)?)
        }
    };
    ldesc.check(op.local_offset, op.len).map_err(ctx)?;
    if ldesc.kind != RegionKind::Host && reach != Reach::Any {
        return Err(ctx(Error::new(
            Status::Unsupported,
            format!(
                "local region {} is device memory; this transport moves host memory only",
                op.local_region
            ),
        )));
    }
    let rdesc = remotes
        .entry(op.remote_region)
        .or_insert_with(|| remote(op.remote_region))
        .as_ref()
        .ok_or_else(|| {
            ctx(Error::new(
                Status::RegionNotFound,
                format!("the peer exported no region {}", op.remote_region),
            ))
        })?;
    rdesc.check(op.remote_offset, op.len).map_err(ctx)?;
    if rdesc.kind != RegionKind::Host && reach == Reach::Host {
        return Err(ctx(Error::new(
            Status::Unsupported,
            format!(
                "remote region {} is device memory; this transport moves host memory only",
                op.remote_region
            ),
        )));
    }
    if let std::collections::hash_map::Entry::Vacant(v) = pinned.entry(op.local_region) {
        v.insert(registry.acquire(op.local_region, 0, 0).map_err(ctx)?);
    }
    // without their transport keys: nothing to allocate per change of regions
    let bare = |d: &RegionDesc| RegionDesc {
        keys: Default::default(),
        ..*d
    };
    Ok((
        (ldesc.addr, rdesc.addr),
        (op.local_region, bare(ldesc), op.remote_region, bare(rdesc)),
    ))
}

/// Checksum of the pieces' source bytes.
pub(crate) fn checksum_pieces(pieces: &[Piece]) -> u64 {
    pieces.iter().fold(0u64, |acc, p| {
        // SAFETY: validate_ops checked [src, src+len) lies in a registered local region, pinned by the batch's guards.
        let data = unsafe { std::slice::from_raw_parts(p.src as *const u8, p.len as usize) };
        super::checksum::combine(acc, super::checksum::piece(p.region, p.offset, data))
    })
}

/// The `Transport` methods every connection-backed transport (cma, tcp, rdma)
/// answers from its [`Conn`] alone: the peer's regions as of the handshake,
/// batch status and waits from the batch table, and liveness. Expands inside
/// an `impl Transport for T` block whose `T` has a `conn: Arc<Conn>` field.
macro_rules! conn_backed_transport {
    () => {
        fn remote_regions(&self) -> Vec<$crate::memory::RegionDesc> {
            let mut v: Vec<$crate::memory::RegionDesc> =
                self.conn.regions.values().cloned().collect();
            v.sort_by_key(|d| d.id);
            v
        }

        fn poll(
            &self,
            id: $crate::transport::BatchId,
        ) -> $crate::error::Result<$crate::transport::BatchStatus> {
            self.conn.table.poll(id)
        }

        fn wait(
            &self,
            id: $crate::transport::BatchId,
            timeout: std::time::Duration,
        ) -> $crate::error::Result<$crate::transport::Completion> {
            self.conn.table.wait(id, timeout)
        }

        fn is_alive(&self) -> bool {
            self.conn.alive()
        }
    };
}
pub(crate) use conn_backed_transport;

/// The room-grant `Transport` methods of a connection-backed transport whose
/// batches honour open grants (cma, tcp, rdma). Expands like
/// [`conn_backed_transport`].
macro_rules! conn_room_grants {
    () => {
        fn open_room(
            &self,
            grant: &$crate::transport::room::RoomGrant,
            epoch: u64,
        ) -> $crate::error::Result<()> {
            self.conn.open_room(grant, epoch)
        }

        fn end_room(
            &self,
            room: u64,
            epoch: u64,
            timeout: std::time::Duration,
        ) -> $crate::error::Result<()> {
            self.conn.end_room(room, epoch, timeout)
        }

        fn close_room(
            &self,
            room: u64,
            epoch: u64,
            timeout: std::time::Duration,
        ) -> $crate::error::Result<$crate::transport::room::RoomSummary> {
            self.conn.close_room(room, epoch, timeout)
        }

        fn forget_room(&self, room: u64, epoch: u64) {
            self.conn.rooms.forget(room, epoch)
        }
    };
}
pub(crate) use conn_room_grants;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RegionKind;

    #[test]
    fn device_and_out_of_range_ops_refused_before_sending() {
        let reg = Registry::new();
        let mut buf = vec![0u8; 4096];
        // SAFETY: buf outlives the registry use below.
        let l = unsafe { reg.register_host(buf.as_mut_ptr(), buf.len()) }.unwrap();
        let dev = RegionDesc {
            id: 9,
            addr: 0x7000_0000,
            len: 1 << 20,
            kind: RegionKind::Device { ordinal: 0 },
            keys: Default::default(),
        };
        let host = RegionDesc {
            id: 8,
            kind: RegionKind::Host,
            ..dev.clone()
        };
        let remote = |id: u64| [dev.clone(), host.clone()].into_iter().find(|d| d.id == id);
        let op = WriteOp {
            local_region: l.id,
            local_offset: 0,
            remote_region: 9,
            remote_offset: 0,
            len: 16,
        };
        let e = validate_ops(&reg, remote, &[op], Reach::Host).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported, "{e}");
        // A device-capable transport (rdma) takes the same op.
        let (pieces, _, _) = validate_ops(&reg, remote, &[op], Reach::Any).unwrap();
        assert_eq!(pieces[0].dst, 0x7000_0000);
        let op = WriteOp {
            remote_region: 8,
            ..op
        };
        let (pieces, guards, bytes) = validate_ops(&reg, remote, &[op, op], Reach::Host).unwrap();
        assert_eq!((pieces.len(), guards.len(), bytes), (2, 1, 32));
        assert_eq!(pieces[0].dst, 0x7000_0000);
        // The local source is pinned while the batch lives.
        assert_eq!(reg.inflight(l.id).unwrap(), 1);
        drop(guards);
        assert_eq!(reg.inflight(l.id).unwrap(), 0);
        let bad = WriteOp {
            local_offset: 4090,
            ..op
        };
        assert_eq!(
            validate_ops(&reg, remote, &[op, bad], Reach::Host)
                .unwrap_err()
                .status(),
            Status::OutOfBounds
        );
        assert_eq!(
            reg.inflight(l.id).unwrap(),
            0,
            "a refused batch pins nothing"
        );
    }
}
