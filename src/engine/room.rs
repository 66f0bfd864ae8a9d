//! Rooms (one per request) and the `KVPoll` state machine.
//!
//! Values and order are SGLang's: Failed=0, Bootstrapping=1, WaitingForInput=2,
//! Transferring=3, Success=4. Updates are monotonic; Failed and Success are
//! terminal; a failure keeps its reason. Beyond SGLang:
//! - every room has an *attempt* number; a message for an older attempt of a
//!   reused room id is dropped, never applied to the new request;
//! - cleared rooms leave a tombstone so a late status cannot resurrect them;
//! - deadlines per room, checked by [`RoomTable::expire`];
//! - a *fenced* abort: writes are counted per room, and an abort is
//!   acknowledged only when no write for the room can still land.

use super::metrics::RoomTotals;
use crate::error::{Error, Result, Status};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// SGLang's `KVPoll` values.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KvPoll {
    /// The transfer failed; the room keeps the reason.
    Failed = 0,
    /// Waiting for the peers' metadata.
    Bootstrapping = 1,
    /// Peers known; waiting for the KV to be ready (prefill) or to arrive (decode).
    WaitingForInput = 2,
    /// Data is moving.
    Transferring = 3,
    /// Every byte landed and was acknowledged.
    Success = 4,
}

impl KvPoll {
    /// The state with this numeric value.
    pub fn from_i32(v: i32) -> Option<KvPoll> {
        Some(match v {
            0 => KvPoll::Failed,
            1 => KvPoll::Bootstrapping,
            2 => KvPoll::WaitingForInput,
            3 => KvPoll::Transferring,
            4 => KvPoll::Success,
            _ => return None,
        })
    }

    /// True for Failed and Success.
    pub fn is_terminal(self) -> bool {
        matches!(self, KvPoll::Failed | KvPoll::Success)
    }
}

/// One request's state.
#[derive(Debug, Clone)]
pub struct Room {
    /// The caller's room id (SGLang's `bootstrap_room`).
    pub id: u64,
    /// Incarnation of this room id in this table (1, 2, ... on reuse).
    pub attempt: u64,
    /// Current state.
    pub poll: KvPoll,
    /// Why it failed, when it did.
    pub failure: Option<Error>,
    /// When the room fails unless it reached a terminal state.
    pub deadline: Option<Instant>,
    /// Writes submitted for the room that have not completed or failed.
    pub inflight: u64,
    /// An abort was requested.
    pub aborted: bool,
    /// When the room was created.
    pub created: Instant,
    /// Its telemetry times and counts.
    pub times: RoomTimes,
}

impl Room {
    fn fail(&mut self, e: Error) {
        if !self.poll.is_terminal() {
            self.poll = KvPoll::Failed;
            self.failure = Some(e);
        }
    }
}

/// The rooms of one engine.
#[derive(Debug, Default)]
pub struct RoomTable {
    rooms: HashMap<u64, Room>,
    /// Cleared rooms: id -> last attempt, so late messages are recognised.
    tombstones: HashMap<u64, u64>,
    /// Tombstones in the order they were made, to forget the oldest.
    tomb_order: std::collections::VecDeque<(u64, u64)>,
    /// Rooms created, and the outcomes of the finished rooms cleared.
    totals: RoomTotals,
}

/// Cleared rooms remembered; older tombstones are forgotten (a message for a
/// room cleared that long ago is then "unknown room", still never applied).
pub const MAX_TOMBSTONES: usize = 65_536;

impl RoomTable {
    /// An empty table.
    pub fn new() -> RoomTable {
        RoomTable::default()
    }

    /// Creates room `id` in `initial` (Bootstrapping or WaitingForInput) with an
    /// optional timeout; returns its attempt number. An id that is still live is refused.
    pub fn create(
        &mut self,
        id: u64,
        initial: KvPoll,
        timeout: Option<Duration>,
        now: Instant,
    ) -> Result<u64> {
        if !matches!(initial, KvPoll::Bootstrapping | KvPoll::WaitingForInput) {
            return Err(Error::invalid(format!(
                "a room starts in Bootstrapping or WaitingForInput, not {initial:?}"
            )));
        }
        if let Some(r) = self.rooms.get(&id) {
            return Err(Error::invalid(format!(
                "room {id} is still live (attempt {}, state {:?}); clear it before reusing the id",
                r.attempt, r.poll
            )));
        }
        let attempt = self.tombstones.remove(&id).unwrap_or(0) + 1;
        self.rooms.insert(
            id,
            Room {
                id,
                attempt,
                poll: initial,
                failure: None,
                deadline: timeout.map(|t| now + t),
                inflight: 0,
                aborted: false,
                created: now,
                times: RoomTimes::default(),
            },
        );
        self.totals.created += 1;
        Ok(attempt)
    }

    /// The room, if live.
    pub fn get(&self, id: u64) -> Result<&Room> {
        self.rooms.get(&id).ok_or_else(|| self.unknown(id))
    }

    fn unknown(&self, id: u64) -> Error {
        match self.tombstones.get(&id) {
            Some(a) => Error::new(
                Status::UnknownRoom,
                format!("room {id} was cleared (last attempt {a})"),
            ),
            None => Error::new(
                Status::UnknownRoom,
                format!("room {id} is unknown to this engine"),
            ),
        }
    }

    fn live(&mut self, id: u64, attempt: u64) -> Option<&mut Room> {
        self.rooms.get_mut(&id).filter(|r| r.attempt == attempt)
    }

    /// Moves room `id` (of `attempt`) forward to `poll`. Lower states are
    /// ignored; terminal states stay. Returns false when the message was stale
    /// (older attempt, cleared room) and dropped.
    pub fn update(&mut self, id: u64, attempt: u64, poll: KvPoll) -> bool {
        let Some(r) = self.live(id, attempt) else {
            return false;
        };
        if r.poll.is_terminal() || poll == KvPoll::Failed {
            if poll == KvPoll::Failed {
                r.fail(Error::new(Status::RoomFailed, "failed without a reason"));
            }
            return true;
        }
        if poll > r.poll {
            r.poll = poll;
            if poll == KvPoll::Success {
                RoomTimes::stamp(&mut r.times.last_ack, Instant::now());
            }
        }
        true
    }

    /// Fails room `id` (of `attempt`) with `reason`, unless already terminal.
    pub fn fail(&mut self, id: u64, attempt: u64, reason: Error) -> bool {
        match self.live(id, attempt) {
            Some(r) => {
                r.fail(reason);
                true
            }
            None => false,
        }
    }

    /// Counts a write about to be submitted for the room; refused once the room
    /// is terminal or aborted, so nothing new starts after an abort.
    pub fn begin_write(&mut self, id: u64, attempt: u64) -> Result<()> {
        let e = self.unknown(id);
        let r = self.live(id, attempt).ok_or(e)?;
        if r.aborted {
            return Err(Error::new(
                Status::Aborted,
                format!("room {id} was aborted"),
            ));
        }
        if r.poll.is_terminal() {
            return Err(Error::new(
                Status::RoomFailed,
                format!("room {id} is {:?}; no new writes", r.poll),
            ));
        }
        r.inflight += 1;
        r.times.batches += 1;
        if r.times.first_byte.is_none() {
            r.times.first_byte = Some(Instant::now());
        }
        Ok(())
    }

    /// Marks one write of the room as completed (landed or failed).
    pub fn end_write(&mut self, id: u64, attempt: u64) {
        if let Some(r) = self.live(id, attempt) {
            r.inflight = r.inflight.saturating_sub(1);
        }
    }

    /// Requests an abort: the room fails with `Aborted` and takes no new writes.
    /// Returns whether the abort is already fenced (no write in flight).
    pub fn abort(&mut self, id: u64, attempt: u64) -> Result<bool> {
        let e = self.unknown(id);
        let r = self.live(id, attempt).ok_or(e)?;
        r.aborted = true;
        r.fail(Error::new(
            Status::Aborted,
            format!("room {id} aborted by the caller"),
        ));
        Ok(r.inflight == 0)
    }

    /// True when an aborted room has no write in flight: its pages may be reused.
    pub fn is_fenced(&self, id: u64) -> bool {
        self.rooms.get(&id).is_none_or(|r| r.inflight == 0)
    }

    /// Fails every non-terminal room whose deadline passed; returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<u64> {
        self.expire_with(now, &HashMap::new())
    }

    /// The non-terminal rooms whose deadline passed at `now` (not failed yet).
    pub fn due(&self, now: Instant) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .rooms
            .values()
            .filter(|r| r.deadline.is_some_and(|d| now >= d) && !r.poll.is_terminal())
            .map(|r| r.id)
            .collect();
        out.sort_unstable();
        out
    }

    /// Like [`expire`](Self::expire), with `context` appended to the reason
    /// of the rooms it names (which peers the room waited on, say).
    pub fn expire_with(&mut self, now: Instant, context: &HashMap<u64, String>) -> Vec<u64> {
        let mut out = Vec::new();
        for r in self.rooms.values_mut() {
            if let Some(d) = r.deadline {
                if now >= d && !r.poll.is_terminal() {
                    let waited = now.duration_since(r.created);
                    let state = r.poll;
                    let extra = context
                        .get(&r.id)
                        .map_or(String::new(), |c| format!(" ({c})"));
                    r.fail(Error::new(
                        Status::Timeout,
                        format!(
                            "room {} exceeded its deadline after {:.1}s in state {state:?}{extra}",
                            r.id,
                            waited.as_secs_f64()
                        ),
                    ));
                    out.push(r.id);
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// Removes a room, leaving a tombstone. Refused while writes are in flight
    /// (the pages are still targets); abort and wait for the fence first.
    pub fn clear(&mut self, id: u64) -> Result<()> {
        let r = self.rooms.get(&id).ok_or_else(|| self.unknown(id))?;
        if r.inflight > 0 {
            return Err(Error::new(
                Status::RegionBusy,
                format!(
                    "room {id} still has {} writes in flight; abort and wait for the fence",
                    r.inflight
                ),
            ));
        }
        let attempt = r.attempt;
        self.totals.count(r);
        self.rooms.remove(&id);
        self.tombstones.insert(id, attempt);
        self.tomb_order.push_back((id, attempt));
        while self.tomb_order.len() > MAX_TOMBSTONES {
            if let Some((old, a)) = self.tomb_order.pop_front() {
                // a re-created and re-cleared id has a newer tombstone: keep that one
                if self.tombstones.get(&old) == Some(&a) {
                    self.tombstones.remove(&old);
                }
            }
        }
        Ok(())
    }

    /// The telemetry times of room `id` (of `attempt`), to stamp; `None`
    /// for a stale attempt or a cleared room.
    pub fn times_mut(&mut self, id: u64, attempt: u64) -> Option<&mut RoomTimes> {
        self.live(id, attempt).map(|r| &mut r.times)
    }

    /// Live rooms by state (indexed by the `KvPoll` value) and the totals,
    /// with the finished live rooms counted in.
    pub fn totals(&self) -> ([u64; 5], RoomTotals) {
        let mut by_state = [0u64; 5];
        for r in self.rooms.values() {
            by_state[r.poll as usize] += 1;
        }
        (by_state, self.totals.with_live(self.rooms.values()))
    }

    /// Number of live rooms.
    pub fn len(&self) -> usize {
        self.rooms.len()
    }

    /// True when no room is live.
    pub fn is_empty(&self) -> bool {
        self.rooms.is_empty()
    }
}

/// A room's times and counts as the engine stamps them.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoomTimes {
    /// Prefill: the first chunk was queued (`send`). Decode: the metadata
    /// was sent to every prefill rank (`send_metadata`).
    pub queued: Option<Instant>,
    /// Prefill: a transfer worker planned the first chunk (its pair
    /// requests checked). Not stamped on a decode.
    pub planned: Option<Instant>,
    /// Prefill: the first batch was posted. Not stamped on a decode.
    pub first_byte: Option<Instant>,
    /// The room succeeded: prefill, every batch completed and the decode
    /// ranks were told; decode, every prefill rank reported success.
    pub last_ack: Option<Instant>,
    /// Prefill: batches posted for the room.
    pub batches: u64,
    /// Prefill: writes done again (a NIC that refused the device staging
    /// has the slices written through the host).
    pub retries: u64,
    /// The transport label of the room's data: prefill, its decode links'
    /// (`mixed` when they differ); decode, its configured transport.
    pub transport: Option<&'static str>,
}

impl RoomTimes {
    /// Stamps a time once; later stamps keep the first.
    pub(crate) fn stamp(slot: &mut Option<Instant>, now: Instant) {
        slot.get_or_insert(now);
    }
}

impl RoomTotals {
    /// Counts one room's outcome if it finished (a room cleared before it
    /// finished counts nowhere but in `created`).
    pub(crate) fn count(&mut self, r: &Room) {
        match r.poll {
            KvPoll::Success => {
                self.succeeded += 1;
                let t = &r.times;
                let from = t.queued.unwrap_or(r.created);
                let to = t.last_ack.unwrap_or(from);
                self.latency
                    .entry(t.transport.unwrap_or("unknown"))
                    .or_default()
                    .observe(to.saturating_duration_since(from).as_secs_f64());
            }
            KvPoll::Failed => {
                let kind = r
                    .failure
                    .as_ref()
                    .map_or("room_failed", |e| e.status().kind());
                *self.failed.entry(kind).or_default() += 1;
            }
            _ => {}
        }
    }

    /// These totals with the finished rooms among `live` counted too.
    pub(crate) fn with_live<'a>(&self, live: impl Iterator<Item = &'a Room>) -> RoomTotals {
        let mut t = self.clone();
        for r in live {
            t.count(r);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_sglangs() {
        assert_eq!(KvPoll::Failed as i32, 0);
        assert_eq!(KvPoll::Bootstrapping as i32, 1);
        assert_eq!(KvPoll::WaitingForInput as i32, 2);
        assert_eq!(KvPoll::Transferring as i32, 3);
        assert_eq!(KvPoll::Success as i32, 4);
        for v in 0..5 {
            assert_eq!(KvPoll::from_i32(v).unwrap() as i32, v);
        }
        assert_eq!(KvPoll::from_i32(5), None);
    }

    #[test]
    fn monotonic_and_terminal() {
        let now = Instant::now();
        let mut t = RoomTable::new();
        let a = t.create(7, KvPoll::Bootstrapping, None, now).unwrap();
        assert!(t.update(7, a, KvPoll::Transferring));
        assert!(t.update(7, a, KvPoll::WaitingForInput));
        assert_eq!(t.get(7).unwrap().poll, KvPoll::Transferring);
        assert!(t.update(7, a, KvPoll::Success));
        assert!(t.update(7, a, KvPoll::Failed));
        assert_eq!(
            t.get(7).unwrap().poll,
            KvPoll::Success,
            "success is terminal"
        );
        assert!(
            t.create(7, KvPoll::Bootstrapping, None, now).is_err(),
            "live id refused"
        );
        assert!(t.create(8, KvPoll::Success, None, now).is_err());
        let b = t.create(9, KvPoll::WaitingForInput, None, now).unwrap();
        t.fail(
            9,
            b,
            Error::new(Status::PeerUnreachable, "decode 10.0.0.2 died"),
        );
        assert!(t.update(9, b, KvPoll::Success));
        let r = t.get(9).unwrap();
        assert_eq!(r.poll, KvPoll::Failed);
        assert!(r.failure.as_ref().unwrap().detail().contains("died"));
    }

    #[test]
    fn reused_room_ids_ignore_late_messages() {
        let now = Instant::now();
        let mut t = RoomTable::new();
        let a1 = t.create(1, KvPoll::Bootstrapping, None, now).unwrap();
        t.update(1, a1, KvPoll::Success);
        t.clear(1).unwrap();
        assert!(
            !t.update(1, a1, KvPoll::Failed),
            "late message for a cleared room dropped"
        );
        assert!(t.get(1).unwrap_err().detail().contains("cleared"));
        let a2 = t.create(1, KvPoll::Bootstrapping, None, now).unwrap();
        assert_eq!(a2, a1 + 1);
        assert!(
            !t.update(1, a1, KvPoll::Success),
            "old attempt cannot complete the new request"
        );
        assert_eq!(t.get(1).unwrap().poll, KvPoll::Bootstrapping);
    }

    #[test]
    fn tombstones_are_bounded() {
        let now = Instant::now();
        let mut t = RoomTable::new();
        for id in 0..(MAX_TOMBSTONES as u64 + 10) {
            let a = t.create(id, KvPoll::Bootstrapping, None, now).unwrap();
            t.update(id, a, KvPoll::Success);
            t.clear(id).unwrap();
        }
        assert_eq!(t.tombstones.len(), MAX_TOMBSTONES);
        assert!(t.get(3).unwrap_err().detail().contains("unknown"));
        assert!(t
            .get(MAX_TOMBSTONES as u64 + 5)
            .unwrap_err()
            .detail()
            .contains("cleared"));
    }

    #[test]
    fn totals_count_each_finished_room_once_cleared_or_not() {
        let now = Instant::now();
        let mut t = RoomTable::new();
        let a = t.create(1, KvPoll::Bootstrapping, None, now).unwrap();
        let b = t.create(2, KvPoll::Bootstrapping, None, now).unwrap();
        t.create(3, KvPoll::Bootstrapping, None, now).unwrap();
        t.times_mut(1, a).unwrap().transport = Some("tcp");
        t.times_mut(1, a).unwrap().queued = Some(now);
        t.begin_write(1, a).unwrap();
        t.begin_write(1, a).unwrap();
        t.end_write(1, a);
        t.end_write(1, a);
        assert!(t.update(1, a, KvPoll::Success));
        t.abort(2, b).unwrap();
        assert!(
            t.times_mut(1, a + 1).is_none(),
            "a stale attempt has no times"
        );
        let (live, totals) = t.totals();
        assert_eq!(live, [1, 1, 0, 0, 1]);
        assert_eq!((totals.created, totals.succeeded), (3, 1));
        assert_eq!(totals.failed["aborted"], 1);
        assert_eq!(totals.latency["tcp"].count, 1);
        let r = t.get(1).unwrap();
        assert_eq!(r.times.batches, 2);
        assert!(r.times.first_byte.unwrap() <= r.times.last_ack.unwrap());
        // cleared: the same totals, the rooms gone from the live counts
        t.clear(1).unwrap();
        t.clear(2).unwrap();
        t.clear(3).unwrap();
        let (live, again) = t.totals();
        assert_eq!(live, [0; 5]);
        assert_eq!((again.created, again.succeeded), (3, 1));
        assert_eq!(again.failed["aborted"], 1);
        assert_eq!(again.latency["tcp"].count, 1);
        // a room cleared unfinished counts as created only; a reused id again
        let c = t.create(1, KvPoll::Bootstrapping, None, now).unwrap();
        t.update(1, c, KvPoll::Success);
        let (_, more) = t.totals();
        assert_eq!((more.created, more.succeeded), (4, 2));
        assert_eq!(more.latency["unknown"].count, 1);
    }

    #[test]
    fn fenced_abort() {
        let now = Instant::now();
        let mut t = RoomTable::new();
        let a = t.create(3, KvPoll::WaitingForInput, None, now).unwrap();
        t.begin_write(3, a).unwrap();
        t.begin_write(3, a).unwrap();
        assert!(!t.abort(3, a).unwrap(), "two writes in flight: not fenced");
        assert_eq!(t.begin_write(3, a).unwrap_err().status(), Status::Aborted);
        assert_eq!(t.clear(3).unwrap_err().status(), Status::RegionBusy);
        t.end_write(3, a);
        assert!(!t.is_fenced(3));
        t.end_write(3, a);
        assert!(t.is_fenced(3));
        assert_eq!(t.get(3).unwrap().poll, KvPoll::Failed);
        assert_eq!(
            t.get(3).unwrap().failure.as_ref().unwrap().status(),
            Status::Aborted
        );
        t.clear(3).unwrap();
    }

    #[test]
    fn deadlines_fail_only_unfinished_rooms() {
        let now = Instant::now();
        let mut t = RoomTable::new();
        let a = t
            .create(1, KvPoll::Bootstrapping, Some(Duration::from_secs(5)), now)
            .unwrap();
        let b = t
            .create(2, KvPoll::Bootstrapping, Some(Duration::from_secs(5)), now)
            .unwrap();
        t.create(3, KvPoll::Bootstrapping, Some(Duration::from_secs(50)), now)
            .unwrap();
        t.update(2, b, KvPoll::Success);
        assert!(t.expire(now + Duration::from_secs(1)).is_empty());
        assert_eq!(t.expire(now + Duration::from_secs(6)), vec![1]);
        let r = t.get(1).unwrap();
        assert_eq!(r.failure.as_ref().unwrap().status(), Status::Timeout);
        assert!(r
            .failure
            .as_ref()
            .unwrap()
            .detail()
            .contains("Bootstrapping"));
        assert_eq!(t.get(2).unwrap().poll, KvPoll::Success);
        assert!(t.update(1, a, KvPoll::Transferring));
        assert_eq!(t.get(1).unwrap().poll, KvPoll::Failed);
    }
}
