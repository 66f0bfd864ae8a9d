//! Room-level grants, the parts both sides share: the [`RoomGrant`] a
//! receiver issues once per room ([`Agent::grant_room`](super::Agent::grant_room)),
//! the sender's table of open rooms (every batch of an open room is checked
//! against its grant's ranges before a byte moves), and the room-end frames.
//!
//! With a grant open on a connection, the batches whose [`BatchOptions`]
//! carry its room and epoch skip the per-batch exchange and are done on the
//! sender with no frame at all: on cma once the bytes landed (synchronously),
//! on rdma at their RC work completions, on tcp once their pieces (carrying
//! the grant's token, checked by the receiver against the grant it holds)
//! were written. [`Transport::close_room`](super::Transport::close_room) is
//! the one round trip of the room (RoomEnd with the batch and byte totals,
//! answered by RoomAck once the receiver accepted them; on tcp once every
//! byte the totals name landed).

use super::landed::Landed;
use super::piece::Piece;
use super::wire::Cursor;
use super::BatchOptions;
use crate::error::{Error, Result, Status};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One granted range of a receiver's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GrantRange {
    /// The receiver's region id.
    pub region: u64,
    /// Offset inside the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The ranges of a room a receiver validated and pinned once, for the
/// batches of one sending instance (carried in the engine's metadata).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomGrant {
    /// A random 64-bit token naming the grant on the receiver.
    pub token: u64,
    /// The room.
    pub room: u64,
    /// The receiver's epoch of the room (its attempt).
    pub epoch: u64,
    /// The instance the grant is for: only a connection authenticated as it may use it.
    pub grantee: [u8; 16],
    /// Milliseconds the grant lives from its issue (it is revoked then).
    pub expires_in_ms: u64,
    /// The granted ranges, sorted and coalesced.
    pub ranges: Vec<GrantRange>,
}

/// What the receiver accepted when a room closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoomSummary {
    /// Batches the sender completed under the grant.
    pub batches: u64,
    /// Bytes they wrote.
    pub bytes: u64,
}

/// Sorts and coalesces ranges (adjacent or overlapping ones of a region merge).
pub fn coalesce(ranges: &[GrantRange]) -> Vec<GrantRange> {
    let mut v: Vec<GrantRange> = ranges.iter().copied().filter(|r| r.len > 0).collect();
    v.sort();
    let mut out: Vec<GrantRange> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(l) if l.region == r.region && r.offset <= l.offset + l.len => {
                l.len = l.len.max(r.offset + r.len - l.offset);
            }
            _ => out.push(r),
        }
    }
    out
}

/// A grant's ranges by region, for containment checks.
#[derive(Debug, Default)]
pub(crate) struct RangeSet(HashMap<u64, BTreeMap<u64, u64>>);

impl RangeSet {
    pub(crate) fn new(ranges: &[GrantRange]) -> RangeSet {
        let mut m: HashMap<u64, BTreeMap<u64, u64>> = HashMap::new();
        for r in coalesce(ranges) {
            m.entry(r.region)
                .or_default()
                .insert(r.offset, r.offset + r.len);
        }
        RangeSet(m)
    }

    /// The index of the first of `pieces` that does not lie inside one
    /// range, if any. A piece inside the range the piece before it matched
    /// costs no lookup (a batch's pieces mostly follow each other).
    pub(crate) fn first_outside(&self, pieces: &[Piece]) -> Option<usize> {
        let mut hit: Option<(u64, u64, u64)> = None;
        for (i, p) in pieces.iter().enumerate() {
            let Some(end) = p.offset.checked_add(p.len) else {
                return Some(i);
            };
            if let Some((region, start, stop)) = hit {
                if region == p.region && p.offset >= start && end <= stop {
                    continue;
                }
            }
            match self
                .0
                .get(&p.region)
                .and_then(|m| m.range(..=p.offset).next_back())
            {
                Some((&start, &stop)) if end <= stop => hit = Some((p.region, start, stop)),
                _ => return Some(i),
            }
        }
        None
    }

    /// Whether `[offset, offset + len)` of `region` lies inside one range.
    pub(crate) fn contains(&self, region: u64, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else {
            return false;
        };
        self.0
            .get(&region)
            .and_then(|m| m.range(..=offset).next_back())
            .is_some_and(|(_, &e)| end <= e)
    }
}

/// One room open on a sender's connection.
struct OpenRoom {
    grant: RoomGrant,
    ranges: RangeSet,
    deadline: Instant,
    /// Batches submitted and not yet completed or failed.
    pending: u64,
    batches: u64,
    bytes: u64,
    failed: Option<Error>,
}

/// How a room close ended on the receiver (set by the control reader).
type CloseOutcome = Option<Result<RoomSummary>>;

/// A sender connection's open rooms, keyed by (room, the batches' epoch).
#[derive(Default)]
pub(crate) struct OpenRooms {
    m: Mutex<OpenState>,
    cv: Condvar,
}

#[derive(Default)]
struct OpenState {
    rooms: HashMap<(u64, u64), OpenRoom>,
    /// Room closes waiting for the receiver's answer, by token.
    closing: HashMap<u64, CloseOutcome>,
    /// Rooms whose RoomEnd went out ([`Conn::end_room`](super::conn::Conn::end_room))
    /// and whose answer nobody waits for yet: their token and totals.
    ended: HashMap<(u64, u64), (u64, RoomSummary)>,
    /// Questions of what landed waiting for the receiver's answer, by token.
    asking: HashMap<u64, Option<Result<Landed>>>,
    dead: Option<Error>,
}

impl OpenRooms {
    fn lock(&self) -> MutexGuard<'_, OpenState> {
        self.m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens `grant` for the batches tagged `(grant.room, epoch)`; `me` is
    /// this side's authenticated instance (a grant for another is refused).
    /// Opening the same grant again is a no-op.
    pub(crate) fn open(&self, grant: &RoomGrant, epoch: u64, me: [u8; 16]) -> Result<()> {
        if grant.grantee != me {
            return Err(Error::new(
                Status::PeerIdentity,
                format!(
                    "room {}: the grant is for instance {}, this connection authenticated as {}",
                    grant.room,
                    crate::auth::PeerInstance(grant.grantee),
                    crate::auth::PeerInstance(me)
                ),
            ));
        }
        let mut s = self.lock();
        if let Some(e) = &s.dead {
            return Err(e.clone());
        }
        let key = (grant.room, epoch);
        if let Some(r) = s.rooms.get(&key) {
            if r.grant.token == grant.token {
                return Ok(());
            }
            if r.pending > 0 {
                return Err(Error::new(
                    Status::InvalidArgument,
                    format!(
                        "room {} epoch {epoch}: another grant is open with {} batches in flight",
                        grant.room, r.pending
                    ),
                ));
            }
        }
        s.rooms.insert(
            key,
            OpenRoom {
                grant: grant.clone(),
                ranges: RangeSet::new(&grant.ranges),
                deadline: Instant::now() + Duration::from_millis(grant.expires_in_ms),
                pending: 0,
                batches: 0,
                bytes: 0,
                failed: None,
            },
        );
        Ok(())
    }

    /// The grant token of the open room a batch with `opts` belongs to, after
    /// checking every piece against the grant (`OutOfBounds` naming the room
    /// when one lies outside it: nothing is written); `None` when no room is
    /// open for it (or the batch asks for a checksum, which the receiver
    /// verifies per batch): the per-batch protocol applies. Counts the batch
    /// as pending in its room.
    pub(crate) fn admit(&self, pieces: &[Piece], opts: &BatchOptions) -> Result<Option<u64>> {
        if opts.checksum {
            return Ok(None);
        }
        let mut s = self.lock();
        let Some(r) = s.rooms.get_mut(&(opts.room, opts.epoch)) else {
            return Ok(None);
        };
        if Instant::now() >= r.deadline {
            return Err(Error::new(
                Status::Timeout,
                format!(
                    "room {}: its grant expired after {} ms; nothing was written",
                    opts.room, r.grant.expires_in_ms
                ),
            ));
        }
        if let Some(e) = &r.failed {
            return Err(e.clone());
        }
        if let Some(i) = r.ranges.first_outside(pieces) {
            let p = &pieces[i];
            return Err(Error::new(
                Status::OutOfBounds,
                format!(
                    "op {i} of the batch: region {} offset {} len {} lies outside room {}'s grant; nothing was written",
                    p.region, p.offset, p.len, opts.room
                ),
            ));
        }
        r.pending += 1;
        Ok(Some(r.grant.token))
    }

    /// A batch of an open room ended: `Ok(bytes)` landed, or it failed.
    pub(crate) fn finished(&self, opts_room: (u64, u64), outcome: Result<u64>) {
        let mut s = self.lock();
        if let Some(r) = s.rooms.get_mut(&opts_room) {
            r.pending = r.pending.saturating_sub(1);
            match outcome {
                Ok(n) => {
                    r.batches += 1;
                    r.bytes += n;
                }
                Err(e) => {
                    r.failed.get_or_insert(e);
                }
            }
        }
        self.cv.notify_all();
    }

    /// Takes the room out of the table once no batch of it is pending (up to
    /// `timeout`): its grant and totals, for the RoomEnd frame.
    pub(crate) fn take(
        &self,
        room: u64,
        epoch: u64,
        timeout: Duration,
    ) -> Result<(RoomGrant, RoomSummary)> {
        let end = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            let Some(r) = s.rooms.get(&(room, epoch)) else {
                return Err(Error::new(
                    Status::UnknownRoom,
                    format!("room {room} epoch {epoch} has no open grant on this connection"),
                ));
            };
            if r.pending == 0 {
                break;
            }
            let now = Instant::now();
            if now >= end {
                return Err(Error::new(
                    Status::Timeout,
                    format!(
                        "room {room}: {} batches still in flight after {timeout:?}",
                        r.pending
                    ),
                ));
            }
            s = self
                .cv
                .wait_timeout(s, end - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let r = s.rooms.remove(&(room, epoch)).expect("checked above");
        if let Some(e) = r.failed {
            return Err(e);
        }
        s.closing.insert(r.grant.token, None);
        Ok((
            r.grant,
            RoomSummary {
                batches: r.batches,
                bytes: r.bytes,
            },
        ))
    }

    /// Forgets a room without closing it (its batches failed).
    pub(crate) fn forget(&self, room: u64, epoch: u64) {
        let mut s = self.lock();
        s.rooms.remove(&(room, epoch));
        if let Some((token, _)) = s.ended.remove(&(room, epoch)) {
            s.closing.remove(&token);
        }
    }

    /// The RoomEnd of `(room, epoch)` (grant `token`, totals `sum`) went out:
    /// a later close waits for its answer instead of ending the room again.
    pub(crate) fn ended(&self, room: u64, epoch: u64, token: u64, sum: RoomSummary) {
        self.lock().ended.insert((room, epoch), (token, sum));
    }

    /// The token and totals of `(room, epoch)` if its RoomEnd went out already.
    pub(crate) fn take_ended(&self, room: u64, epoch: u64) -> Option<(u64, RoomSummary)> {
        self.lock().ended.remove(&(room, epoch))
    }

    /// The receiver answered the close of grant `token` (or refused a
    /// question of what landed under it).
    pub(crate) fn answered(&self, token: u64, outcome: Result<RoomSummary>) {
        let mut s = self.lock();
        if let Err(e) = &outcome {
            if let Some(slot) = s.asking.get_mut(&token) {
                *slot = Some(Err(e.clone()));
                self.cv.notify_all();
                return;
            }
        }
        if let Some(slot) = s.closing.get_mut(&token) {
            *slot = Some(outcome);
            self.cv.notify_all();
        }
    }

    /// Asks after grant `token`: a question now waits for its answer
    /// ([`wait_landed`](Self::wait_landed)).
    pub(crate) fn ask(&self, token: u64) {
        self.lock().asking.insert(token, None);
    }

    /// The receiver said what landed under grant `token`.
    pub(crate) fn landed(&self, token: u64, landed: Landed) {
        let mut s = self.lock();
        if let Some(slot) = s.asking.get_mut(&token) {
            *slot = Some(Ok(landed));
            self.cv.notify_all();
        }
    }

    /// Waits up to `timeout` for the answer to the question after `token`.
    pub(crate) fn wait_landed(&self, token: u64, timeout: Duration) -> Result<Landed> {
        let end = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            if let Some(Some(_)) = s.asking.get(&token) {
                return s.asking.remove(&token).flatten().expect("checked above");
            }
            if let Some(e) = s.dead.clone() {
                s.asking.remove(&token);
                return Err(e);
            }
            let now = Instant::now();
            if now >= end {
                s.asking.remove(&token);
                return Err(Error::new(
                    Status::Timeout,
                    format!("the receiver did not say what landed within {timeout:?}"),
                ));
            }
            s = self
                .cv
                .wait_timeout(s, end - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Counts `bytes` that landed over an earlier connection in the open
    /// room `(room, epoch)`: its room end then names the room's whole total.
    pub(crate) fn carry(&self, room: u64, epoch: u64, bytes: u64) -> Result<()> {
        match self.lock().rooms.get_mut(&(room, epoch)) {
            Some(r) => {
                r.bytes += bytes;
                Ok(())
            }
            None => Err(Error::new(
                Status::UnknownRoom,
                format!("room {room} epoch {epoch} has no open grant on this connection"),
            )),
        }
    }

    /// Waits up to `timeout` for the receiver's answer to the close of `token`.
    pub(crate) fn wait_answer(&self, token: u64, timeout: Duration) -> Result<RoomSummary> {
        let end = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            if let Some(Some(_)) = s.closing.get(&token) {
                return s.closing.remove(&token).flatten().expect("checked above");
            }
            if let Some(e) = s.dead.clone() {
                s.closing.remove(&token);
                return Err(e);
            }
            let now = Instant::now();
            if now >= end {
                s.closing.remove(&token);
                return Err(Error::new(
                    Status::Timeout,
                    format!("the receiver did not answer the room end within {timeout:?}"),
                ));
            }
            s = self
                .cv
                .wait_timeout(s, end - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The connection died: every open room and waiting close fails with `e`.
    pub(crate) fn fail_all(&self, e: Error) {
        let mut s = self.lock();
        s.dead.get_or_insert(e);
        self.cv.notify_all();
    }
}

/// The room-end record: the grant's token, the receiver's room and epoch,
/// and the totals of the batches written under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RoomEnd {
    pub token: u64,
    pub room: u64,
    pub epoch: u64,
    pub batches: u64,
    pub bytes: u64,
}

impl RoomEnd {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(40);
        for v in [self.token, self.room, self.epoch, self.batches, self.bytes] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    pub(crate) fn decode(p: &[u8]) -> Result<RoomEnd> {
        let mut c = Cursor::new(p, "room end");
        let e = RoomEnd {
            token: c.u64()?,
            room: c.u64()?,
            epoch: c.u64()?,
            batches: c.u64()?,
            bytes: c.u64()?,
        };
        c.finish()?;
        Ok(e)
    }
}

/// The receiver's acceptance of a room end: `token | batches | bytes`.
pub(crate) fn encode_room_ack(token: u64, s: &RoomSummary) -> Vec<u8> {
    let mut b = Vec::with_capacity(24);
    for v in [token, s.batches, s.bytes] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

pub(crate) fn decode_room_ack(p: &[u8]) -> Result<(u64, RoomSummary)> {
    let mut c = Cursor::new(p, "room ack");
    let token = c.u64()?;
    let s = RoomSummary {
        batches: c.u64()?,
        bytes: c.u64()?,
    };
    c.finish()?;
    Ok((token, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(region: u64, offset: u64, len: u64) -> GrantRange {
        GrantRange {
            region,
            offset,
            len,
        }
    }

    #[test]
    fn coalesce_merges_adjacent_and_overlapping_ranges_per_region() {
        let v = coalesce(&[
            r(2, 0, 8),
            r(1, 16, 16),
            r(1, 0, 16),
            r(1, 40, 8),
            r(1, 44, 2),
        ]);
        assert_eq!(v, [r(1, 0, 32), r(1, 40, 8), r(2, 0, 8)]);
        let s = RangeSet::new(&v);
        assert!(s.contains(1, 0, 32));
        assert!(s.contains(1, 8, 8));
        assert!(!s.contains(1, 30, 4), "crosses the gap at 32..40");
        assert!(!s.contains(1, 36, 2));
        assert!(s.contains(1, 40, 8));
        assert!(!s.contains(1, 40, 9));
        assert!(!s.contains(3, 0, 1));
        assert!(!s.contains(1, u64::MAX, 2));
        // the batch check agrees with the piece check, piece by piece
        let piece = |region, offset, len| Piece {
            src: 0,
            region,
            offset,
            dst: 0,
            len,
        };
        let inside = [
            piece(1, 0, 8),
            piece(1, 8, 8),
            piece(1, 40, 8),
            piece(2, 0, 8),
            piece(1, 16, 16),
        ];
        assert_eq!(s.first_outside(&inside), None);
        for bad in [
            piece(1, 30, 4),
            piece(1, 44, 8),
            piece(3, 0, 1),
            piece(1, u64::MAX, 2),
        ] {
            let mut v = inside.to_vec();
            v.insert(3, bad);
            assert_eq!(s.first_outside(&v), Some(3), "{bad:?}");
        }
    }

    #[test]
    fn room_frames_round_trip() {
        let e = RoomEnd {
            token: 9,
            room: 3,
            epoch: 2,
            batches: 5,
            bytes: 77,
        };
        assert_eq!(RoomEnd::decode(&e.encode()).unwrap(), e);
        assert!(RoomEnd::decode(&e.encode()[..39]).is_err());
        let s = RoomSummary {
            batches: 5,
            bytes: 77,
        };
        assert_eq!(decode_room_ack(&encode_room_ack(9, &s)).unwrap(), (9, s));
    }
}
