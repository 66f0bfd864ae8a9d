//! The tcp receiver: each data stream attaches to a sender's session and
//! reads its pieces through its receive buffer ([`super::inbuf`]): many
//! headers and small payloads per `read`, a payload not all buffered read
//! straight into its destination. Each destination is validated against the
//! registry (the region stays pinned by the stream across a run of buffered
//! pieces to it, so a piece costs no lock); device regions land through
//! [`super::device`]. A stream counts the bytes of each batch itself and
//! merges its counts into the session's batch table before it waits on its
//! socket; once the batch's commit arrived on the control connection and
//! every byte counted, the verdict (bytes, checksum) is delivered and
//! answered with Ack or Nack. A piece of a granted room is checked against
//! the room's grant (its token, for the session's authenticated instance),
//! not only the registry, and its bytes are counted under the grant; the
//! room's RoomEnd is answered once every byte it names landed.

use super::device::{receive_into_device, DEVICE_BOUNCE_BYTES};
use super::inbuf::{drain, InBuf, Source, STREAM_BUFFER_BYTES};
use super::seal::{PieceOpener, SEALED_PIECE_BYTES, SEAL_TAG_LEN};
use crate::auth::{PeerInstance, SessionKeys};
use crate::error::{Error, Result, Status};
use crate::memory::{AccessGuard, DeviceWriter, RegionDesc, RegionKind, Registry};
use crate::transport::agent::{
    completion, lock, piece_landed, refuse, AgentInner, ReceiverSession,
};
use crate::transport::checksum;
use crate::transport::handshake::Attach;
use crate::transport::identity::ProcIdentity;
use crate::transport::listen::Slot;
use crate::transport::wire::{self, Commit, DataHeader, FrameType, DATA_HEADER_LEN};
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Read;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// One batch as the receiver counts it.
#[derive(Default)]
pub(crate) struct RecvBatch {
    received: u64,
    sum: u64,
    failed: Option<Error>,
    pub(crate) commit: Option<Commit>,
}

/// The tcp batches of one session in progress, and the finished ones.
#[derive(Default)]
pub(crate) struct TcpRecv {
    pub(crate) batches: HashMap<u64, RecvBatch>,
    pub(crate) finished: HashSet<u64>,
    /// Batches the test stall knob already delayed.
    stalled: HashSet<u64>,
}

/// Finished batch ids remembered per session (late frames of a finished batch
/// are dropped); batch ids grow, so only the newest ones need remembering.
const FINISHED_WINDOW: u64 = 8192;

impl TcpRecv {
    /// Adds one stream's count of a batch; false when the batch is already
    /// finished (a late piece: not counted).
    fn absorb(&mut self, c: Count) -> bool {
        if self.finished.contains(&c.batch) {
            return false;
        }
        let b = self.batches.entry(c.batch).or_default();
        b.received += c.received;
        b.sum = checksum::combine(b.sum, c.sum);
        if b.failed.is_none() {
            b.failed = c.failed;
        }
        true
    }

    /// Whether pieces of `batch` arriving now are no longer landed: the
    /// batch finished, or a piece of it failed.
    fn closed_to(&self, batch: u64) -> bool {
        self.finished.contains(&batch)
            || self.batches.get(&batch).is_some_and(|b| b.failed.is_some())
    }

    /// Merges one stream's counts (emptying `tally`), running `decide` for
    /// each batch counted, and closes in `tally` the batches that take no
    /// more pieces.
    pub(super) fn merge(&mut self, tally: &mut Tally, mut decide: impl FnMut(&mut TcpRecv, u64)) {
        let mut counts = std::mem::take(&mut tally.counts);
        for c in counts.drain(..) {
            let batch = c.batch;
            if self.absorb(c) {
                decide(self, batch);
            }
            if self.closed_to(batch) {
                tally.close(batch);
            }
        }
        tally.counts = counts; // keeps its capacity
    }

    fn mark_finished(&mut self, batch: u64) {
        self.finished.insert(batch);
        if self.finished.len() as u64 > 2 * FINISHED_WINDOW {
            let keep = batch.saturating_sub(FINISHED_WINDOW);
            self.finished.retain(|&b| b >= keep);
        }
    }
}

/// Decides a batch once its commit arrived and every byte counted (or one
/// piece failed): delivers it and answers Ack, or answers Nack with why.
pub(crate) fn finalize_tcp(
    a: &AgentInner,
    sess: &ReceiverSession,
    t: &mut TcpRecv,
    batch: u64,
    peer: &ProcIdentity,
) {
    let Some(b) = t.batches.get(&batch) else {
        return;
    };
    let Some(c) = b.commit else { return };
    let verdict = if let Some(e) = &b.failed {
        Some(Err(e.clone()))
    } else if b.received > c.bytes {
        Some(Err(Error::new(
            Status::Protocol,
            format!(
                "received {} bytes for a batch committed with {}",
                b.received, c.bytes
            ),
        )))
    } else if b.received == c.bytes {
        match c.checksum {
            Some(want) if want != b.sum => Some(Err(Error::new(
                Status::BatchFailed,
                format!(
                    "checksum mismatch: sender 0x{want:016x}, landed bytes 0x{:016x}",
                    b.sum
                ),
            ))),
            _ => Some(Ok(())),
        }
    } else {
        None
    };
    match verdict {
        None => {}
        Some(Ok(())) => {
            t.batches.remove(&batch);
            t.mark_finished(batch);
            a.deliver(peer.clone(), sess.id, completion(&c));
            sess.send(FrameType::Ack, &batch.to_le_bytes());
        }
        Some(Err(e)) => {
            t.batches.remove(&batch);
            t.mark_finished(batch);
            sess.send(FrameType::Nack, &wire::encode_reason(batch, &e));
        }
    }
}

/// Serves one data stream whose first frame was an Attach.
/// The stream authenticated as `peer`; it attaches only to a session whose
/// control connection authenticated as the same instance, with its token.
pub(crate) fn serve_stream(
    a: Arc<AgentInner>,
    mut s: TcpStream,
    p: &[u8],
    mut slot: Slot,
    peer: PeerInstance,
    mut keys: SessionKeys,
) {
    let att: Attach = match serde_json::from_slice(p) {
        Ok(x) => x,
        Err(e) => {
            return refuse(
                &mut s,
                &mut keys.send,
                Error::new(Status::Protocol, format!("malformed Attach: {e}")),
            )
        }
    };
    let sess = lock(&a.sessions).get(&att.session).cloned();
    let Some(sess) = sess.filter(|x| {
        x.instance == peer && bool::from(x.token.as_bytes().ct_eq(att.token.as_bytes()))
    }) else {
        return refuse(
            &mut s,
            &mut keys.send,
            Error::new(
                Status::Unauthorized,
                format!("no session {} with that token", att.session),
            ),
        );
    };
    // the stream's last sealed frame: data frames follow unsealed (each is
    // checked against this side's grants)
    if wire::write_json_sealed(
        &mut s,
        FrameType::AttachOk,
        &serde_json::json!({}),
        &mut keys.send,
    )
    .is_err()
    {
        return;
    }
    slot.established();
    // idle between batches as long as the session lives (closing it shuts
    // this socket); a piece's payload is bounded by the pin timeout
    let _ = s.set_read_timeout(None);
    if let Ok(c) = s.try_clone() {
        lock(&sess.sockets).push(c);
    }
    if sess.closed.load(Ordering::SeqCst) {
        return;
    }
    let peer = lock(&sess.peer)
        .clone()
        .unwrap_or_else(|| a.identity.clone());
    let mut ledger = SessionLedger {
        a: &a,
        sess: &sess,
        peer: &peer,
    };
    let mut rx = StreamReceiver::new(&a.registry, s, STREAM_BUFFER_BYTES, a.pin_timeout);
    if a.tcp_encrypt {
        rx.decrypt(PieceOpener::new(&keys.payload.recv));
    }
    if let Err(e) = rx.run(&mut ledger) {
        if matches!(
            e.status(),
            Status::Protocol | Status::Timeout | Status::ChannelIntegrity
        ) {
            // A desynchronised stream (or one whose piece stopped arriving
            // and released its pin, or failed its tag) cannot be trusted:
            // end the session, telling the sender why when a piece failed
            // its integrity check.
            log::warn!("session {}: data stream closed: {e}", sess.id);
            if e.status() == Status::ChannelIntegrity {
                sess.send(FrameType::Error, &wire::encode_error(&e));
            }
            sess.close();
        }
    }
}

/// Where a data stream's counts go: the session's batch table.
pub(super) trait Ledger {
    /// The session ended: the stream stops.
    fn closed(&self) -> bool;
    /// Whether the test stall knob is set ([`Self::stall`] sleeps).
    fn stalls(&self) -> bool;
    /// Sleeps the stall knob's time before the first piece of `batch`.
    fn stall(&mut self, batch: u64);
    /// Merges the stream's counts into the batch table (emptying `tally`),
    /// decides the batches whose every byte is counted, and tells `tally`
    /// which of them take no more pieces; hands the bytes landed under room
    /// grants to their grants.
    fn merge(&mut self, tally: &mut Tally);
    /// Whether piece `h` of a granted room (its batch field the grant's
    /// token) lies in the grant, for this session's authenticated instance;
    /// nothing is written when it does not.
    fn admit_room(&mut self, h: &DataHeader) -> Result<()> {
        let _ = h;
        Err(Error::new(
            Status::Unsupported,
            "this receiver holds no room grants",
        ))
    }
}

struct SessionLedger<'a> {
    a: &'a AgentInner,
    sess: &'a ReceiverSession,
    peer: &'a ProcIdentity,
}

impl Ledger for SessionLedger<'_> {
    fn closed(&self) -> bool {
        self.sess.closed.load(Ordering::SeqCst)
    }

    fn stalls(&self) -> bool {
        !self.a.stall().is_zero()
    }

    fn stall(&mut self, batch: u64) {
        let new = lock(&self.sess.tcp).stalled.insert(batch);
        if new {
            std::thread::sleep(self.a.stall());
        }
    }

    fn merge(&mut self, tally: &mut Tally) {
        let (a, sess, peer) = (self.a, self.sess, self.peer);
        for r in tally.rooms.drain(..) {
            piece_landed(
                a,
                sess,
                peer,
                r.token,
                r.failed.map_or(Ok(&r.landed[..]), Err),
            );
        }
        if tally.counts.is_empty() {
            return;
        }
        lock(&sess.tcp).merge(tally, |t, batch| finalize_tcp(a, sess, t, batch, peer));
    }

    fn admit_room(&mut self, h: &DataHeader) -> Result<()> {
        self.a
            .room_grants
            .admit_piece(h.batch, self.sess.instance, h.region, h.offset, h.len)
    }
}

/// One stream's count of the pieces of one room grant since its last merge:
/// the (region, offset, len) of each piece landed.
pub(crate) struct RoomCount {
    token: u64,
    landed: Vec<(u64, u64, u64)>,
    failed: Option<Error>,
}

/// One stream's count of one batch since its last merge.
pub(crate) struct Count {
    batch: u64,
    received: u64,
    sum: u64,
    failed: Option<Error>,
}

/// A data stream's counts per batch, merged into the session's table before
/// the stream waits on its socket (not per piece), and the batches it
/// lands no more pieces of.
#[derive(Default)]
pub(crate) struct Tally {
    counts: Vec<Count>,
    /// Bytes landed under room grants, by token.
    rooms: Vec<RoomCount>,
    /// Batches finished or failed (newest last): their pieces are drained.
    closed: VecDeque<u64>,
}

/// Closed batches a stream remembers (its pieces come batch after batch).
const CLOSED_REMEMBERED: usize = 64;

impl Tally {
    fn count(&mut self, batch: u64) -> &mut Count {
        let i = match self.counts.iter().rposition(|c| c.batch == batch) {
            Some(i) => i,
            None => {
                self.counts.push(Count {
                    batch,
                    received: 0,
                    sum: 0,
                    failed: None,
                });
                self.counts.len() - 1
            }
        };
        &mut self.counts[i]
    }

    fn landed(&mut self, batch: u64, len: u64, sum: u64) {
        let c = self.count(batch);
        c.received += len;
        c.sum = checksum::combine(c.sum, sum);
    }

    /// A piece of `batch` failed: the batch fails with the first such error,
    /// and no later piece of it is landed.
    fn failed(&mut self, batch: u64, e: Error) {
        let c = self.count(batch);
        if c.failed.is_none() {
            c.failed = Some(e);
        }
        self.close(batch);
    }

    fn close(&mut self, batch: u64) {
        if !self.closed.contains(&batch) {
            self.closed.push_back(batch);
            if self.closed.len() > CLOSED_REMEMBERED {
                self.closed.pop_front();
            }
        }
    }

    fn is_closed(&self, batch: u64) -> bool {
        self.closed.contains(&batch)
    }

    /// A piece of the room grant `token` landed (`Ok((region, offset,
    /// len))`), or failed.
    fn room(&mut self, token: u64, outcome: Result<(u64, u64, u64)>) {
        let i = match self.rooms.iter().rposition(|r| r.token == token) {
            Some(i) => i,
            None => {
                self.rooms.push(RoomCount {
                    token,
                    landed: Vec::new(),
                    failed: None,
                });
                self.rooms.len() - 1
            }
        };
        let r = &mut self.rooms[i];
        match outcome {
            Ok(piece) => match r.landed.last_mut() {
                // a run of pieces that follow each other is one range
                Some(l) if l.0 == piece.0 && l.1 + l.2 == piece.1 => l.2 += piece.2,
                _ => r.landed.push(piece),
            },
            Err(e) => {
                r.failed.get_or_insert(e);
            }
        }
    }
}

/// The region a stream pinned for the pieces it lands now.
struct Held {
    desc: RegionDesc,
    guard: AccessGuard,
    writer: Option<Arc<dyn DeviceWriter>>,
}

/// A validated destination of one piece: its start address, in a region
/// the stream holds pinned.
pub(super) enum Dest {
    Host(u64),
    Device(u64, Arc<dyn DeviceWriter>),
}

/// A stream's validation of piece destinations against the registry. The
/// region of the last piece stays pinned (one registry lock per run of
/// pieces to it rather than per piece) until [`release`](Self::release),
/// which the stream calls before it waits on its socket. Unregistering a
/// region waits for that pin as for any piece in flight; the pieces already
/// buffered to it may still land meanwhile, and from the stream's next wait
/// on, its pieces to the region are refused.
pub(super) struct Destinations<'r> {
    reg: &'r Registry,
    held: Option<Held>,
}

impl<'r> Destinations<'r> {
    pub(super) fn new(reg: &'r Registry) -> Destinations<'r> {
        Destinations { reg, held: None }
    }

    /// Validates the destination of piece `h`: its region is registered, not
    /// being unregistered, holds `[offset, offset + len)`, and is host memory
    /// or device memory with a device writer. The region stays pinned until
    /// [`release`](Self::release) or a piece to another region.
    pub(super) fn validate(&mut self, h: &DataHeader) -> Result<Dest> {
        let x = match &mut self.held {
            Some(x) if x.desc.id == h.region => &*x,
            slot => {
                *slot = None;
                let desc = self.reg.get(h.region)?;
                let guard = self.reg.acquire(h.region, 0, desc.len)?;
                let writer = match desc.kind {
                    RegionKind::Host => None,
                    RegionKind::Device { .. } => self.reg.device_writer(h.region),
                };
                &*slot.insert(Held {
                    desc,
                    guard,
                    writer,
                })
            }
        };
        x.desc.check(h.offset, h.len)?;
        let addr = x.guard.addr() + h.offset;
        match (x.desc.kind, &x.writer) {
            (RegionKind::Host, _) => Ok(Dest::Host(addr)),
            (RegionKind::Device { .. }, Some(w)) => Ok(Dest::Device(addr, w.clone())),
            (RegionKind::Device { .. }, None) => Err(Error::new(
                Status::Unsupported,
                format!(
                    "region {} is device memory registered without a device writer; tcp cannot write it",
                    h.region
                ),
            )),
        }
    }

    /// Unpins the region held.
    pub(super) fn release(&mut self) {
        self.held = None;
    }
}

/// One data stream's receiving side: its buffer, the destinations it holds,
/// its counts.
pub(super) struct StreamReceiver<'r, S> {
    inb: InBuf<S>,
    dests: Destinations<'r>,
    tally: Tally,
    scratch: Vec<u8>,
    // from the first device writer met (page-locked where it can)
    bounce: Option<crate::memory::BounceBuffer>,
    /// Pieces arrive encrypted: each is read whole into `sealed`, verified
    /// and decrypted there, and only then landed.
    opener: Option<PieceOpener>,
    sealed: Vec<u8>,
}

impl<'r, S: Source> StreamReceiver<'r, S> {
    pub(super) fn new(
        reg: &'r Registry,
        s: S,
        buffer: usize,
        pin_timeout: std::time::Duration,
    ) -> StreamReceiver<'r, S> {
        StreamReceiver {
            inb: InBuf::new(s, buffer, pin_timeout),
            dests: Destinations::new(reg),
            tally: Tally::default(),
            scratch: vec![0u8; 64 << 10],
            bounce: None,
            opener: None,
            sealed: Vec::new(),
        }
    }

    /// Pieces arrive encrypted, opened by `opener` (the stream's payload key).
    pub(super) fn decrypt(&mut self, opener: PieceOpener) {
        self.opener = Some(opener);
        self.sealed = Vec::with_capacity(SEALED_PIECE_BYTES as usize + SEAL_TAG_LEN);
    }

    #[cfg(test)]
    fn inb_source(&self) -> &S {
        self.inb.source()
    }

    /// Unpins the held region and merges the counts: before a wait.
    fn settle(&mut self, ledger: &mut impl Ledger) {
        self.dests.release();
        ledger.merge(&mut self.tally);
    }

    /// Receives pieces until the session closes (`Ok`) or the stream fails;
    /// either way, the pieces landed are counted and no region stays pinned.
    pub(super) fn run(&mut self, ledger: &mut impl Ledger) -> Result<()> {
        let r = self.receive_all(ledger);
        self.settle(ledger);
        r
    }

    fn receive_all(&mut self, ledger: &mut impl Ledger) -> Result<()> {
        loop {
            if ledger.closed() {
                return Ok(());
            }
            if self.inb.buffered().len() < DATA_HEADER_LEN {
                self.settle(ledger);
                self.inb.fill(DATA_HEADER_LEN)?;
            }
            let mut hb = [0u8; DATA_HEADER_LEN];
            hb.copy_from_slice(&self.inb.buffered()[..DATA_HEADER_LEN]);
            self.inb.consume(DATA_HEADER_LEN);
            let h = DataHeader::decode(&hb)?;
            if ledger.stalls() {
                self.settle(ledger);
                ledger.stall(h.batch);
            }
            match self.opener.is_some() {
                true => self.receive_sealed(&h, &hb, ledger)?,
                false => self.receive(&h, ledger)?,
            }
        }
    }

    /// [`receive`](Self::receive) of an encrypted piece: its ciphertext and
    /// tag are read into the stream's own buffer and opened there; only a
    /// piece whose tag verified is landed, copied from that buffer (its
    /// destination is validated as for any piece). A piece that fails fails
    /// its batch (or room) and the stream (`ChannelIntegrity`), writing
    /// nothing.
    fn receive_sealed(
        &mut self,
        h: &DataHeader,
        hb: &[u8],
        ledger: &mut impl Ledger,
    ) -> Result<()> {
        if h.len > SEALED_PIECE_BYTES {
            return Err(Error::new(
                Status::Protocol,
                format!(
                    "an encrypted piece of {} bytes (at most {SEALED_PIECE_BYTES} are sent per piece)",
                    h.len
                ),
            ));
        }
        let n = h.len as usize;
        let buffered = self.inb.buffered().len() >= n + SEAL_TAG_LEN;
        if !buffered {
            // the reads below may wait: earlier batches are not held up
            self.settle(ledger);
        }
        self.sealed.resize(n + SEAL_TAG_LEN, 0);
        self.inb.piece().read_exact(&mut self.sealed)?;
        let (body, tag) = self.sealed.split_at_mut(n);
        let Some(opener) = self.opener.as_mut() else {
            return Err(Error::new(
                Status::Protocol,
                "no key for an encrypted piece",
            ));
        };
        if let Err(e) = opener.open(hb, body, tag) {
            if h.flags & wire::DATA_FLAG_ROOM != 0 {
                self.tally.room(h.batch, Err(e.clone()));
            } else {
                self.tally.failed(h.batch, e.clone());
            }
            return Err(e);
        }
        let mut r: &[u8] = &self.sealed[..n];
        land_piece(
            &mut self.dests,
            &mut self.tally,
            &mut self.scratch,
            &mut self.bounce,
            &mut r,
            h,
            ledger,
        )?;
        if !buffered {
            self.dests.release();
        }
        Ok(())
    }

    /// Lands the payload of piece `h` (or drains it: a piece of a closed
    /// batch, or one refused) and counts it.
    fn receive(&mut self, h: &DataHeader, ledger: &mut impl Ledger) -> Result<()> {
        let buffered = self.inb.buffered().len() as u64 >= h.len;
        if !buffered {
            // the reads below may wait: earlier batches are not held up
            ledger.merge(&mut self.tally);
        }
        let mut r = self.inb.piece();
        land_piece(
            &mut self.dests,
            &mut self.tally,
            &mut self.scratch,
            &mut self.bounce,
            &mut r,
            h,
            ledger,
        )?;
        if !buffered {
            // the pin is not kept across a wait
            self.dests.release();
        }
        Ok(())
    }
}

/// Lands the payload of piece `h`, read from `r`, and counts it in `tally`:
/// a granted room's piece checked against its grant first, a piece of a
/// closed batch drained, any other validated against the registry.
fn land_piece(
    dests: &mut Destinations<'_>,
    tally: &mut Tally,
    scratch: &mut [u8],
    bounce: &mut Option<crate::memory::BounceBuffer>,
    r: &mut impl Read,
    h: &DataHeader,
    ledger: &mut impl Ledger,
) -> Result<()> {
    if h.flags & wire::DATA_FLAG_ROOM != 0 {
        // a granted room's piece: checked against its grant first
        let outcome = match ledger.admit_room(h) {
            Ok(()) => {
                let dest = dests.validate(h);
                land(dest, r, h, scratch, bounce)?.map(|_| (h.region, h.offset, h.len))
            }
            Err(e) => {
                drain(r, h.len, scratch)?;
                Err(e)
            }
        };
        tally.room(h.batch, outcome);
    } else if tally.is_closed(h.batch) {
        drain(r, h.len, scratch)?;
    } else {
        let dest = dests.validate(h);
        match land(dest, r, h, scratch, bounce)? {
            Ok(sum) => tally.landed(h.batch, h.len, sum),
            Err(e) => tally.failed(h.batch, e),
        }
    }
    Ok(())
}

/// Receives the payload of one data piece `h` from `s` into its validated
/// destination `dest`: straight into a host region, or through `bounce`
/// (allocated by the first device writer met, [`DEVICE_BOUNCE_BYTES`]) and
/// the region's [`DeviceWriter`] into a device region (the piece counts as
/// received only once the writer has every byte in device memory). The outer
/// error is the socket's (the stream is lost); the inner one a refused or
/// failed write, whose payload was drained so the stream stays in sync.
/// `Ok(Ok(sum))` carries the piece checksum (0 unless the header asks for
/// one), computed on the bytes received.
pub(super) fn land(
    dest: Result<Dest>,
    s: &mut impl Read,
    h: &DataHeader,
    scratch: &mut [u8],
    bounce: &mut Option<crate::memory::BounceBuffer>,
) -> Result<Result<u64>> {
    let want_sum = h.flags & wire::DATA_FLAG_CHECKSUM != 0;
    let refused = match dest {
        Ok(Dest::Host(addr)) => {
            // SAFETY: validate() proved [addr, addr+len) lies in a registered host region, which the stream keeps pinned while it lands this piece.
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, h.len as usize) };
            s.read_exact(dst)?;
            let sum = if want_sum {
                checksum::piece(h.region, h.offset, dst)
            } else {
                0
            };
            return Ok(Ok(sum));
        }
        Ok(Dest::Device(addr, w)) => {
            let b = bounce.get_or_insert_with(|| w.bounce(DEVICE_BOUNCE_BYTES));
            return receive_into_device(s, h, addr, &*w, b.as_mut_slice(), scratch);
        }
        Err(e) => e,
    };
    // Nothing is written: drain the payload into scratch to stay in sync.
    drain(s, h.len, scratch)?;
    Ok(Err(Error::new(
        refused.status(),
        format!(
            "write of {} bytes to region {} offset {} refused: {}",
            h.len,
            h.region,
            h.offset,
            refused.detail()
        ),
    )))
}

/// Validates and lands one piece read from `s` (no buffer, no pin kept).
#[cfg(test)]
pub(super) fn receive_piece(
    reg: &Registry,
    s: &mut impl Read,
    h: &DataHeader,
    scratch: &mut [u8],
    bounce: &mut Option<crate::memory::BounceBuffer>,
) -> Result<Result<u64>> {
    let mut d = Destinations::new(reg);
    let dest = d.validate(h);
    land(dest, s, h, scratch, bounce)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::IoSliceMut;
    use std::time::Duration;

    /// A socket stand-in: at most `max` bytes per read, counting reads and
    /// recording where each read landed; once its data is spent it ends the
    /// stream, or (`stall`) reports every read as timed out.
    struct Script {
        data: Vec<u8>,
        pos: usize,
        max: usize,
        stall: bool,
        reads: usize,
        landed: Vec<(usize, usize)>,
    }

    impl Script {
        fn new(data: Vec<u8>, max: usize) -> Script {
            Script {
                data,
                pos: 0,
                max,
                stall: false,
                reads: 0,
                landed: Vec::new(),
            }
        }
    }

    impl Read for Script {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.read_vectored(&mut [IoSliceMut::new(buf)])
        }

        fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> std::io::Result<usize> {
            if self.stall && self.pos == self.data.len() {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            self.reads += 1;
            let mut budget = self.max.min(self.data.len() - self.pos);
            let mut n = 0;
            for b in bufs.iter_mut() {
                let k = b.len().min(budget);
                b[..k].copy_from_slice(&self.data[self.pos..self.pos + k]);
                if k > 0 {
                    self.landed.push((b.as_ptr() as usize, k));
                }
                self.pos += k;
                budget -= k;
                n += k;
            }
            Ok(n)
        }
    }

    impl Source for Script {
        fn set_timeout(&mut self, _: Option<Duration>) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The batch table of a session, without one: counts merges.
    #[derive(Default)]
    struct Book {
        t: TcpRecv,
        merges: usize,
    }

    impl Ledger for Book {
        fn closed(&self) -> bool {
            false
        }
        fn stalls(&self) -> bool {
            false
        }
        fn stall(&mut self, _: u64) {}
        fn merge(&mut self, tally: &mut Tally) {
            if !tally.counts.is_empty() {
                self.merges += 1;
            }
            self.t.merge(tally, |_, _| {});
        }
    }

    struct Piece {
        batch: u64,
        region: u64,
        offset: u64,
        data: Vec<u8>,
    }

    fn piece(batch: u64, region: u64, offset: u64, len: usize, seed: u8) -> Piece {
        Piece {
            batch,
            region,
            offset,
            data: (0..len)
                .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed) | 1)
                .collect(),
        }
    }

    fn frames(pieces: &[Piece]) -> Vec<u8> {
        let mut v = Vec::new();
        for p in pieces {
            let h = DataHeader {
                flags: wire::DATA_FLAG_CHECKSUM,
                batch: p.batch,
                region: p.region,
                offset: p.offset,
                len: p.data.len() as u64,
            };
            v.extend_from_slice(&h.encode());
            v.extend_from_slice(&p.data);
        }
        v
    }

    fn sum_of<'a>(pieces: impl IntoIterator<Item = &'a Piece>) -> u64 {
        pieces.into_iter().fold(0, |s, p| {
            checksum::combine(s, checksum::piece(p.region, p.offset, &p.data))
        })
    }

    /// Runs one stream over `src` until its data ends.
    fn run<'r>(
        reg: &'r Registry,
        src: Script,
        buffer: usize,
        book: &mut Book,
    ) -> (Error, StreamReceiver<'r, Script>) {
        let mut rx = StreamReceiver::new(reg, src, buffer, Duration::from_secs(5));
        let e = rx.run(book).unwrap_err();
        (e, rx)
    }

    fn host(reg: &Registry, mem: &mut [u8]) -> u64 {
        // SAFETY: the test's buffer outlives its registration's use.
        unsafe { reg.register_host(mem.as_mut_ptr(), mem.len()) }
            .unwrap()
            .id
    }

    /// Alters the bytes of one sealed piece as sent.
    type Tamper = dyn Fn(&mut Vec<u8>);

    /// The pieces as an encrypting sender sends them, under `key`; `tamper`
    /// alters the bytes of piece `at` (its header, ciphertext and tag).
    fn sealed_frames(
        pieces: &[Piece],
        key: &[u8; 32],
        tamper: Option<(usize, &Tamper)>,
    ) -> Vec<u8> {
        let mut sealer = super::super::seal::PieceSealer::new(key);
        let mut v = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            let mut f = frames(std::slice::from_ref(p));
            let (hb, body) = f.split_at_mut(DATA_HEADER_LEN);
            let tag = sealer.seal(hb, body).unwrap();
            f.extend_from_slice(&tag);
            if let Some((at, t)) = tamper {
                if at == i {
                    t(&mut f);
                }
            }
            v.extend_from_slice(&f);
        }
        v
    }

    fn run_sealed(reg: &Registry, data: Vec<u8>, key: &[u8; 32], book: &mut Book) -> Error {
        let mut rx =
            StreamReceiver::new(reg, Script::new(data, 1000), 4096, Duration::from_secs(5));
        rx.decrypt(PieceOpener::new(key));
        rx.run(book).unwrap_err()
    }

    #[test]
    fn encrypted_pieces_land_byte_exact_after_their_tags_verify() {
        let reg = Registry::new();
        let mut mem = vec![0u8; 1 << 20];
        let r = host(&reg, &mut mem);
        let key = [9u8; 32];
        let mut pieces: Vec<Piece> = (0..30).map(|i| piece(1, r, i * 100, 57, i as u8)).collect();
        // one of the largest size a sender cuts, longer than the stream's buffer
        pieces.push(piece(1, r, 500_000, SEALED_PIECE_BYTES as usize, 3));
        let data = sealed_frames(&pieces, &key, None);
        let mut book = Book::default();
        let e = run_sealed(&reg, data, &key, &mut book);
        assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
        for p in &pieces {
            let at = p.offset as usize;
            assert!(mem[at..at + p.data.len()] == p.data[..]);
        }
        let b = &book.t.batches[&1];
        assert_eq!(b.sum, sum_of(&pieces));
        assert!(b.failed.is_none());
        assert_eq!(reg.inflight(r).unwrap(), 0);
    }

    #[test]
    fn a_flipped_bit_in_an_encrypted_piece_fails_the_batch_and_writes_nothing() {
        let flip_ct: &dyn Fn(&mut Vec<u8>) = &|f| f[DATA_HEADER_LEN + 10] ^= 1;
        let flip_tag: &dyn Fn(&mut Vec<u8>) = &|f| {
            let n = f.len();
            f[n - 1] ^= 0x40
        };
        // the header's offset: still a valid destination, but not the sealed one
        let flip_hdr: &dyn Fn(&mut Vec<u8>) = &|f| {
            let h = DataHeader::decode(f[..DATA_HEADER_LEN].try_into().unwrap()).unwrap();
            let moved = DataHeader {
                offset: h.offset + 8,
                ..h
            };
            f[..DATA_HEADER_LEN].copy_from_slice(&moved.encode());
        };
        for (what, t) in [
            ("ciphertext", flip_ct),
            ("tag", flip_tag),
            ("header", flip_hdr),
        ] {
            let reg = Registry::new();
            let mut mem = vec![0u8; 64 << 10];
            let r = host(&reg, &mut mem);
            let key = [1u8; 32];
            let pieces: Vec<Piece> = (0..4)
                .map(|i| piece(2, r, i * 4096, 4096, i as u8))
                .collect();
            let data = sealed_frames(&pieces, &key, Some((2, t)));
            let mut book = Book::default();
            let e = run_sealed(&reg, data, &key, &mut book);
            assert_eq!(e.status(), Status::ChannelIntegrity, "{what}: {e}");
            // the pieces before it landed; from it on nothing was written
            assert!(mem[..2 * 4096] == [&pieces[0].data[..], &pieces[1].data[..]].concat()[..]);
            assert!(
                mem[2 * 4096..].iter().all(|&b| b == 0),
                "{what}: bytes written"
            );
            let b = &book.t.batches[&2];
            assert_eq!(
                b.failed.as_ref().map(Error::status),
                Some(Status::ChannelIntegrity)
            );
            assert_eq!(reg.inflight(r).unwrap(), 0);
        }
        // another key (a stream's pieces opened under another's): refused, nothing written
        let reg = Registry::new();
        let mut mem = vec![0u8; 8192];
        let r = host(&reg, &mut mem);
        let data = sealed_frames(&[piece(3, r, 0, 4096, 1)], &[1u8; 32], None);
        let e = run_sealed(&reg, data, &[2u8; 32], &mut Book::default());
        assert_eq!(e.status(), Status::ChannelIntegrity, "{e}");
        assert!(mem.iter().all(|&b| b == 0));
        // a piece longer than a sender cuts: refused before it is read
        let data = sealed_frames(
            &[piece(3, r, 0, SEALED_PIECE_BYTES as usize + 1, 1)],
            &[1u8; 32],
            None,
        );
        let e = run_sealed(&reg, data, &[1u8; 32], &mut Book::default());
        assert_eq!(e.status(), Status::Protocol, "{e}");
    }

    #[test]
    fn many_tiny_pieces_cross_buffer_boundaries_in_few_reads_and_merges() {
        let reg = Registry::new();
        let mut mem = vec![0u8; 64 << 10];
        let r = host(&reg, &mut mem);
        let pieces: Vec<Piece> = (0..500).map(|i| piece(1, r, i * 40, 37, i as u8)).collect();
        let data = frames(&pieces);
        let total = data.len();
        let buffer = 1024;
        let mut book = Book::default();
        let (e, rx) = run(&reg, Script::new(data, usize::MAX), buffer, &mut book);
        assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
        for p in &pieces {
            let at = p.offset as usize;
            assert_eq!(&mem[at..at + 37], &p.data[..]);
            assert!(mem[at + 37..at + 40].iter().all(|&b| b == 0));
        }
        let b = &book.t.batches[&1];
        assert_eq!(b.received, 500 * 37);
        assert_eq!(b.sum, sum_of(&pieces));
        assert!(b.failed.is_none());
        // each read brings nearly a buffer's worth: no read per header or payload
        let reads = rx.inb_source().reads;
        assert!(
            reads <= total.div_ceil(buffer - DATA_HEADER_LEN) + 2,
            "{reads} reads for {total} bytes"
        );
        // counts merge once per wait at most, not per piece
        assert!(book.merges <= reads, "{} merges", book.merges);
        assert_eq!(reg.inflight(r).unwrap(), 0, "a pin outlived the stream");
    }

    #[test]
    fn headers_split_across_reads_land_pieces_to_several_regions() {
        let reg = Registry::new();
        let mut m1 = vec![0u8; 4096];
        let mut m2 = vec![0u8; 4096];
        let (r1, r2) = (host(&reg, &mut m1), host(&reg, &mut m2));
        let pieces: Vec<Piece> = (0..40)
            .map(|i| {
                let r = if i % 3 == 0 { r2 } else { r1 };
                piece(1 + i / 20, r, i * 100, 1 + (i as usize * 13) % 90, i as u8)
            })
            .collect();
        // every header arrives in two or more reads
        let mut book = Book::default();
        let (e, _rx) = run(&reg, Script::new(frames(&pieces), 30), 256, &mut book);
        assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
        for p in &pieces {
            let m = if p.region == r1 { &m1 } else { &m2 };
            let at = p.offset as usize;
            assert_eq!(&m[at..at + p.data.len()], &p.data[..]);
        }
        for batch in [1u64, 2] {
            let mine: Vec<&Piece> = pieces.iter().filter(|p| p.batch == batch).collect();
            let b = &book.t.batches[&batch];
            assert_eq!(
                b.received,
                mine.iter().map(|p| p.data.len() as u64).sum::<u64>()
            );
            assert_eq!(b.sum, sum_of(mine));
        }
        assert_eq!(reg.inflight(r1).unwrap() + reg.inflight(r2).unwrap(), 0);
    }

    #[test]
    fn a_large_piece_after_small_ones_is_read_straight_into_its_destination() {
        let reg = Registry::new();
        let mut mem = vec![0u8; 1 << 20];
        let r = host(&reg, &mut mem);
        let mut pieces: Vec<Piece> = (0..20)
            .map(|i| piece(1, r, i * 128, 100, i as u8))
            .collect();
        pieces.push(piece(1, r, 8192, 300 << 10, 99));
        pieces.extend((0..3).map(|i| piece(1, r, (400 << 10) + i * 128, 100, 50 + i as u8)));
        let buffer = 4096;
        let mut book = Book::default();
        let (e, rx) = run(
            &reg,
            Script::new(frames(&pieces), 64 << 10),
            buffer,
            &mut book,
        );
        assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
        for p in &pieces {
            let at = p.offset as usize;
            assert_eq!(&mem[at..at + p.data.len()], &p.data[..]);
        }
        let b = &book.t.batches[&1];
        assert_eq!(b.received, 23 * 100 + (300 << 10));
        assert_eq!(b.sum, sum_of(&pieces));
        // the large payload went from the socket into its destination, but
        // for what one buffer read ahead
        let lo = mem.as_ptr() as usize + 8192;
        let hi = lo + (300 << 10);
        let straight: usize = rx
            .inb_source()
            .landed
            .iter()
            .filter(|&&(at, _)| at >= lo && at < hi)
            .map(|&(_, n)| n)
            .sum();
        assert!(
            straight >= (300 << 10) - buffer,
            "{straight} bytes read straight"
        );
    }

    #[test]
    fn a_long_payload_is_read_straight_in_bounded_reads() {
        use super::super::inbuf::DIRECT_READ_BYTES;
        let reg = Registry::new();
        let mut mem = vec![0u8; 2 << 20];
        let r = host(&reg, &mut mem);
        let len = 3 * DIRECT_READ_BYTES + 1000;
        let pieces = vec![piece(1, r, 4096, len, 5), piece(1, r, 0, 100, 6)];
        let buffer = 4096;
        let mut book = Book::default();
        // the socket would hand over everything in one read
        let (e, rx) = run(
            &reg,
            Script::new(frames(&pieces), usize::MAX),
            buffer,
            &mut book,
        );
        assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
        for p in &pieces {
            let at = p.offset as usize;
            assert_eq!(&mem[at..at + p.data.len()], &p.data[..]);
        }
        assert_eq!(book.t.batches[&1].sum, sum_of(&pieces));
        let lo = mem.as_ptr() as usize + 4096;
        let reads: Vec<usize> = rx
            .inb_source()
            .landed
            .iter()
            .filter(|&&(at, _)| at >= lo && at < lo + len)
            .map(|&(_, n)| n)
            .collect();
        // straight in (but for the first buffer's worth), at most
        // DIRECT_READ_BYTES a read: the window reopens between them
        assert!(reads.iter().sum::<usize>() >= len - buffer, "{reads:?}");
        assert!(reads.len() >= 3, "{reads:?}");
        assert!(reads.iter().all(|&n| n <= DIRECT_READ_BYTES), "{reads:?}");
    }

    #[test]
    fn a_bad_piece_fails_its_batch_and_nothing_after_it_lands_later_batches_do() {
        // one read brings it all, or reads of a few pieces each
        for (buffer, max) in [(1 << 16, usize::MAX), (300, 97)] {
            let reg = Registry::new();
            let mut mem = vec![0u8; 8192];
            let r = host(&reg, &mut mem);
            let ok1: Vec<Piece> = (0..5).map(|i| piece(1, r, i * 100, 60, i as u8)).collect();
            let bad = piece(1, r, 8190, 60, 9);
            let after: Vec<Piece> = (0..4)
                .map(|i| piece(1, r, 1000 + i * 100, 60, 20 + i as u8))
                .collect();
            let next: Vec<Piece> = (0..5)
                .map(|i| piece(2, r, 4000 + i * 100, 60, 40 + i as u8))
                .collect();
            let data = [
                frames(&ok1),
                frames(std::slice::from_ref(&bad)),
                frames(&after),
                frames(&next),
            ]
            .concat();
            let mut book = Book::default();
            let (e, _rx) = run(&reg, Script::new(data, max), buffer, &mut book);
            assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
            for p in ok1.iter().chain(&next) {
                let at = p.offset as usize;
                assert_eq!(&mem[at..at + 60], &p.data[..], "buffer {buffer}");
            }
            assert!(
                mem[1000..1400].iter().all(|&b| b == 0),
                "a piece after the bad one was written (buffer {buffer})"
            );
            assert!(mem[8100..].iter().all(|&b| b == 0));
            let b1 = &book.t.batches[&1];
            let f = b1.failed.as_ref().expect("batch 1 did not fail");
            assert_eq!(f.status(), Status::OutOfBounds, "{f}");
            assert!(f.detail().contains("offset 8190 refused"), "{f}");
            let b2 = &book.t.batches[&2];
            assert!(b2.failed.is_none());
            assert_eq!(b2.received, 5 * 60);
            assert_eq!(b2.sum, sum_of(&next));
            assert_eq!(reg.inflight(r).unwrap(), 0);
        }
    }

    #[test]
    fn a_payload_that_stops_arriving_times_out_and_releases_its_pin() {
        let reg = Registry::new();
        let mut mem = vec![0u8; 4096];
        let r = host(&reg, &mut mem);
        let mut data = frames(&[piece(1, r, 0, 10, 1), piece(1, r, 100, 1000, 2)]);
        data.truncate(data.len() - 900);
        let mut src = Script::new(data, usize::MAX);
        src.stall = true;
        let mut book = Book::default();
        let mut rx = StreamReceiver::new(&reg, src, 1 << 16, Duration::from_millis(50));
        let t0 = std::time::Instant::now();
        let e = rx.run(&mut book).unwrap_err();
        assert_eq!(e.status(), Status::Timeout, "{e}");
        assert!(e.detail().contains("pin timeout"), "{e}");
        assert!(t0.elapsed() >= Duration::from_millis(50));
        assert_eq!(reg.inflight(r).unwrap(), 0);
        // the piece before it was counted
        assert_eq!(book.t.batches[&1].received, 10);
    }

    #[test]
    fn buffered_pieces_to_a_device_region_land_through_its_writer() {
        use crate::transport::testing::HostAsDevice;
        let reg = Registry::new();
        let mut mem = vec![0u8; 64 << 10];
        let w = HostAsDevice::new(&mut mem, None);
        // SAFETY: the writer accepts exactly the buffer's addresses.
        let d = unsafe { reg.register_device_unchecked_with(w.base, 64 << 10, 0, Some(w.clone())) }
            .unwrap()
            .id;
        let mut host_mem = vec![0u8; 4096];
        let h = host(&reg, &mut host_mem);
        let mut pieces: Vec<Piece> = (0..30).map(|i| piece(1, d, i * 64, 50, i as u8)).collect();
        pieces.push(piece(1, h, 0, 70, 3));
        pieces.push(piece(1, d, 8192, 40 << 10, 77));
        pieces.push(piece(2, d, 4096, 33, 5));
        let mut book = Book::default();
        let (e, _rx) = run(&reg, Script::new(frames(&pieces), 1000), 512, &mut book);
        assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
        for p in &pieces {
            let m = if p.region == d { &mem } else { &host_mem };
            let at = p.offset as usize;
            assert_eq!(&m[at..at + p.data.len()], &p.data[..]);
        }
        let b1 = &book.t.batches[&1];
        assert_eq!(b1.received, 30 * 50 + 70 + (40 << 10));
        assert_eq!(b1.sum, sum_of(pieces.iter().filter(|p| p.batch == 1)));
        assert_eq!(book.t.batches[&2].received, 33);
        assert!(w.writes.load(std::sync::atomic::Ordering::SeqCst) >= 32);
        assert_eq!(reg.inflight(d).unwrap() + reg.inflight(h).unwrap(), 0);
    }

    #[test]
    fn pieces_of_a_batch_failed_or_finished_elsewhere_are_drained_from_the_next_merge_on() {
        let reg = Registry::new();
        let mut mem = vec![0u8; 8192];
        let r = host(&reg, &mut mem);
        let mut book = Book::default();
        // batch 5 failed on another stream; batch 6 already finished
        book.t.batches.entry(5).or_default().failed =
            Some(Error::new(Status::OutOfBounds, "on another stream"));
        book.t.finished.insert(6);
        let b5: Vec<Piece> = (0..4).map(|i| piece(5, r, i * 100, 60, i as u8)).collect();
        let b6: Vec<Piece> = (0..4)
            .map(|i| piece(6, r, 1000 + i * 100, 60, 10 + i as u8))
            .collect();
        let b7: Vec<Piece> = (0..4)
            .map(|i| piece(7, r, 2000 + i * 100, 60, 20 + i as u8))
            .collect();
        let data = [frames(&b5), frames(&b6), frames(&b7)].concat();
        // a read per piece or so: the stream merges before each wait
        let (e, _rx) = run(&reg, Script::new(data, 100), 128, &mut book);
        assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
        // the first piece of each landed before the stream learnt of it
        assert_eq!(&mem[..60], &b5[0].data[..]);
        assert_eq!(&mem[1000..1060], &b6[0].data[..]);
        assert!(mem[100..400].iter().all(|&b| b == 0), "batch 5 written");
        assert!(mem[1100..1400].iter().all(|&b| b == 0), "batch 6 written");
        for p in &b7 {
            let at = p.offset as usize;
            assert_eq!(&mem[at..at + 60], &p.data[..]);
        }
        assert_eq!(book.t.batches[&5].received, 60);
        assert!(!book.t.batches.contains_key(&6), "a finished batch counted");
        assert_eq!(book.t.batches[&7].received, 4 * 60);
    }
}
