//! Room-level grants, receiver side: [`Agent::grant_room`] validates every
//! range of a room against the registry and pins its regions once, for one
//! sending instance, until the room ends (the sender's RoomEnd), the grant is
//! revoked ([`Agent::revoke_room`]: the engine does on every terminal state of
//! the room) or its deadline passes (checked on every control tick and on
//! use). A RoomEnd is accepted only on a session authenticated as the
//! grant's instance, for the grant's room and epoch; a forged, revoked or
//! expired token is refused.

use super::{lock, Agent, AgentInner, ReceiverSession};
use crate::auth::PeerInstance;
use crate::error::{Error, Result, Status};
use crate::memory::{AccessGuard, RegionKind};
use crate::transport::identity::ProcIdentity;
use crate::transport::landed::Landed;
use crate::transport::room::{self, GrantRange, RangeSet, RoomEnd, RoomGrant, RoomSummary};
use crate::transport::wire::{self, FrameType};
use crate::transport::{BatchId, Completion};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One room grant held by the receiver.
pub(crate) struct HeldGrant {
    pub(crate) room: u64,
    pub(crate) epoch: u64,
    pub(crate) grantee: PeerInstance,
    pub(crate) ranges: RangeSet,
    deadline: Instant,
    /// Some range lies in device memory.
    device: bool,
    /// tcp: the bytes landed under the grant so far, over every connection
    /// of the grantee (a byte landed twice counts once).
    landed: Landed,
    /// tcp: why a piece under the grant was refused or failed (the room end
    /// is then refused).
    failed: Option<Error>,
    /// tcp: the room end, parked until its bytes landed.
    end: Option<RoomEnd>,
    _guards: Vec<AccessGuard>,
}

/// Why a token no longer works (remembered for the refusal's reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gone {
    Revoked,
    Expired,
    Ended,
}

/// Tokens remembered after their grant ended.
const GONE_REMEMBERED: usize = 4096;

/// The agent's room grants, by token.
#[derive(Default)]
pub(crate) struct RoomGrants {
    m: Mutex<GrantState>,
}

#[derive(Default)]
struct GrantState {
    held: HashMap<u64, HeldGrant>,
    gone: HashMap<u64, Gone>,
    gone_order: VecDeque<u64>,
}

impl GrantState {
    fn forget(&mut self, token: u64, why: Gone) -> Option<HeldGrant> {
        let g = self.held.remove(&token)?;
        self.gone.insert(token, why);
        self.gone_order.push_back(token);
        if self.gone_order.len() > GONE_REMEMBERED {
            if let Some(old) = self.gone_order.pop_front() {
                self.gone.remove(&old);
            }
        }
        Some(g)
    }

    fn expire(&mut self, now: Instant) -> usize {
        let due: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, g)| now >= g.deadline)
            .map(|(&t, _)| t)
            .collect();
        for t in &due {
            if let Some(g) = self.forget(*t, Gone::Expired) {
                log::warn!(
                    "room {} epoch {}: its grant to instance {} expired; its ranges are released",
                    g.room,
                    g.epoch,
                    g.grantee
                );
            }
        }
        due.len()
    }

    /// The live grant `token` names for a session authenticated as `peer`, or why not.
    fn usable(&mut self, token: u64, peer: PeerInstance) -> Result<&HeldGrant> {
        // this grant's deadline only (a tcp piece asks per piece; the control
        // loop's tick sweeps them all)
        if self
            .held
            .get(&token)
            .is_some_and(|g| Instant::now() >= g.deadline)
        {
            self.forget(token, Gone::Expired);
        }
        match self.held.get(&token) {
            Some(g) if g.grantee == peer => Ok(self.held.get(&token).expect("present")),
            Some(g) => Err(Error::new(
                Status::PeerIdentity,
                format!(
                    "room {}: the grant is for instance {}, this connection authenticated as {peer}",
                    g.room, g.grantee
                ),
            )),
            None => Err(match self.gone.get(&token) {
                Some(Gone::Revoked) => Error::new(
                    Status::Aborted,
                    "the room's grant was revoked (the room ended, failed or was aborted)",
                ),
                Some(Gone::Expired) => {
                    Error::new(Status::Timeout, "the room's grant expired at its deadline")
                }
                Some(Gone::Ended) => {
                    Error::new(Status::InvalidArgument, "the room was already closed")
                }
                None => Error::new(
                    Status::PeerIdentity,
                    "no room grant has this token (forged, or from another receiver)",
                ),
            }),
        }
    }
}

impl RoomGrants {
    fn lock(&self) -> std::sync::MutexGuard<'_, GrantState> {
        lock(&self.m)
    }

    /// Drops the grants past their deadline; returns how many.
    pub(crate) fn expire(&self) -> usize {
        self.lock().expire(Instant::now())
    }

    /// Checks one incoming tcp piece of a granted room: `[offset, offset +
    /// len)` of `region` must lie in the grant `token` names, for a session
    /// authenticated as `peer`. A refused piece of a live grant of `peer`
    /// fails its room (the room end is refused); nothing is written either way.
    pub(crate) fn admit_piece(
        &self,
        token: u64,
        peer: PeerInstance,
        region: u64,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        let mut s = self.lock();
        let g = s.usable(token, peer)?;
        if g.ranges.contains(region, offset, len) {
            return Ok(());
        }
        let e = Error::new(
            Status::OutOfBounds,
            format!(
                "region {region} offset {offset} len {len} lies outside room {}'s grant; nothing was written",
                g.room
            ),
        );
        if let Some(g) = s.held.get_mut(&token) {
            g.failed.get_or_insert(e.clone());
        }
        Err(e)
    }
}

/// tcp pieces of grant `token` were received on session `sess`: `Ok` the
/// (region, offset, len) of those that landed, or one failed. Answers the room end parked for the grant
/// once every byte it counts landed (or a piece failed).
pub(crate) fn piece_landed(
    a: &AgentInner,
    sess: &ReceiverSession,
    peer: &ProcIdentity,
    token: u64,
    outcome: Result<&[(u64, u64, u64)]>,
) {
    let done = {
        let mut s = a.room_grants.lock();
        let Some(g) = s
            .held
            .get_mut(&token)
            .filter(|g| g.grantee == sess.instance)
        else {
            return;
        };
        match outcome {
            Ok(pieces) => {
                for &(region, offset, len) in pieces {
                    g.landed.insert(region, offset, len);
                }
            }
            Err(e) => {
                g.failed.get_or_insert(e);
            }
        }
        match g.end {
            Some(e) if g.failed.is_some() || g.landed.bytes() >= e.bytes => {
                let g = s.forget(token, Gone::Ended).expect("held");
                Some((e, g))
            }
            _ => None,
        }
    };
    if let Some((e, g)) = done {
        let r = tcp_verdict(&g, &e);
        answer(a, sess, peer, &e, g, r);
    }
}

/// Whether the bytes a tcp room's pieces landed match its room end.
fn tcp_verdict(g: &HeldGrant, e: &RoomEnd) -> Result<()> {
    if let Some(f) = &g.failed {
        return Err(Error::new(
            f.status(),
            format!("room {}: a write was refused: {}", e.room, f.detail()),
        ));
    }
    if g.landed.bytes() != e.bytes {
        return Err(Error::new(
            Status::Protocol,
            format!(
                "room {}: {} bytes landed, the room end says {}",
                e.room,
                g.landed.bytes(),
                e.bytes
            ),
        ));
    }
    Ok(())
}

/// Answers a room end whose grant `g` was taken out: on `Ok`, one completion
/// record for the room (GPUDirect writes into device memory made visible
/// first, while pinned; a tcp session landed device bytes itself) and
/// RoomAck; else RoomRefuse with why.
fn answer(
    a: &AgentInner,
    sess: &ReceiverSession,
    peer: &ProcIdentity,
    e: &RoomEnd,
    g: HeldGrant,
    r: Result<()>,
) {
    let r = r.and_then(|()| {
        if g.device && lock(&sess.rdma).is_some() {
            a.before_device_delivery()?;
        }
        Ok(())
    });
    drop(g);
    match r {
        Ok(()) => {
            a.deliver(
                peer.clone(),
                sess.id,
                Completion {
                    batch_id: BatchId(e.token),
                    bytes: e.bytes,
                    checksum: None,
                    room: e.room,
                    epoch: e.epoch,
                },
            );
            let s = RoomSummary {
                batches: e.batches,
                bytes: e.bytes,
            };
            sess.send(FrameType::RoomAck, &room::encode_room_ack(e.token, &s));
        }
        Err(err) => sess.send(FrameType::RoomRefuse, &wire::encode_reason(e.token, &err)),
    }
}

impl Agent {
    /// Grants `peer` (the instance a sending connection authenticates as)
    /// writes into `ranges` for room `room`, epoch `epoch`: every range is
    /// validated against the registry and its region pinned once, all or
    /// nothing, until the room ends, [`revoke_room`](Self::revoke_room) or
    /// `deadline` from now. The [`RoomGrant`] goes to the sender, which opens
    /// it on its connection ([`Transport::open_room`](crate::transport::Transport::open_room)).
    pub fn grant_room(
        &self,
        peer: PeerInstance,
        room: u64,
        epoch: u64,
        ranges: &[GrantRange],
        deadline: Duration,
    ) -> Result<RoomGrant> {
        let a = &self.inner;
        let ranges = room::coalesce(ranges);
        let mut guards = Vec::new();
        let mut pinned = HashSet::new();
        let mut device = false;
        for (i, r) in ranges.iter().enumerate() {
            let ctx = |e: Error| {
                Error::new(
                    e.status(),
                    format!(
                        "room {room}: range {i}: {}; nothing was granted",
                        e.detail()
                    ),
                )
            };
            let d = a.registry.get(r.region).map_err(ctx)?;
            d.check(r.offset, r.len).map_err(ctx)?;
            device |= d.kind != RegionKind::Host;
            if pinned.insert(r.region) {
                guards.push(a.registry.acquire(r.region, 0, 0).map_err(ctx)?);
            }
        }
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).map_err(|e| {
            Error::new(
                Status::Io,
                format!("getrandom failed for a room grant token: {e}"),
            )
        })?;
        let token = u64::from_le_bytes(b);
        let mut s = a.room_grants.lock();
        s.expire(Instant::now());
        s.held.insert(
            token,
            HeldGrant {
                room,
                epoch,
                grantee: peer,
                ranges: RangeSet::new(&ranges),
                deadline: Instant::now() + deadline,
                device,
                landed: Landed::default(),
                failed: None,
                end: None,
                _guards: guards,
            },
        );
        Ok(RoomGrant {
            token,
            room,
            epoch,
            grantee: peer.0,
            expires_in_ms: deadline.as_millis().min(u128::from(u64::MAX)) as u64,
            ranges,
        })
    }

    /// Revokes the grant `token` (its regions are released; a later use of
    /// the token is refused). Returns whether it was still held.
    pub fn revoke_room(&self, token: u64) -> bool {
        self.inner
            .room_grants
            .lock()
            .forget(token, Gone::Revoked)
            .is_some()
    }

    /// Room grants currently held.
    pub fn room_grants_held(&self) -> usize {
        let g = &self.inner.room_grants;
        g.expire();
        g.lock().held.len()
    }
}

/// The sender's RoomEnd on session `sess`: accepted when the token names a
/// live grant for the session's authenticated instance, room and epoch (a
/// grant named from the wrong instance stays held for its own sender) and,
/// on tcp, once the bytes its pieces landed match the totals (parked until
/// they did); the grant is then released, one completion record for the
/// room delivered (its batch id is the grant's token, its bytes the room's)
/// and RoomAck sent; otherwise RoomRefuse with the reason.
pub(super) fn room_end(a: &AgentInner, sess: &ReceiverSession, p: &[u8], peer: &ProcIdentity) {
    if !a.room_end_stall().is_zero() {
        std::thread::sleep(a.room_end_stall());
    }
    let e = match RoomEnd::decode(p) {
        Ok(e) => e,
        Err(err) => return sess.send(FrameType::RoomRefuse, &wire::encode_reason(0, &err)),
    };
    // tcp sessions land the bytes here, through their data streams
    let tcp = sess.lands_tcp.load(std::sync::atomic::Ordering::SeqCst);
    let taken = (|| -> Result<Option<HeldGrant>> {
        let mut s = a.room_grants.lock();
        let g = s.usable(e.token, sess.instance)?;
        if (g.room, g.epoch) != (e.room, e.epoch) {
            return Err(Error::new(
                Status::InvalidArgument,
                format!(
                    "the grant is for room {} epoch {}, the room end names room {} epoch {}",
                    g.room, g.epoch, e.room, e.epoch
                ),
            ));
        }
        if tcp && g.failed.is_none() && g.landed.bytes() < e.bytes {
            if let Some(g) = s.held.get_mut(&e.token) {
                g.end = Some(e);
            }
            return Ok(None);
        }
        Ok(s.forget(e.token, Gone::Ended))
    })();
    match taken {
        Ok(None) => {}
        Ok(Some(g)) => {
            let r = if tcp { tcp_verdict(&g, &e) } else { Ok(()) };
            answer(a, sess, peer, &e, g, r);
        }
        Err(err) => sess.send(FrameType::RoomRefuse, &wire::encode_reason(e.token, &err)),
    }
}

/// The sender's RoomQuery on session `sess` (a tcp sender that redialled in
/// the middle of the room): answered with RoomLanded, what landed under the
/// grant so far over every connection of its instance, when the token names
/// a live grant for the session's authenticated instance; else RoomRefuse.
pub(super) fn room_query(a: &AgentInner, sess: &ReceiverSession, p: &[u8]) {
    let answer = wire::decode_batch(p).and_then(|token| {
        let mut s = a.room_grants.lock();
        let g = s.usable(token, sess.instance)?;
        if let Some(f) = &g.failed {
            return Err(f.clone());
        }
        Ok((token, g.landed.encode(token)))
    });
    match answer {
        Ok((_, payload)) => sess.send(FrameType::RoomLanded, &payload),
        Err(err) => {
            let token = wire::decode_batch(p).unwrap_or(0);
            sess.send(FrameType::RoomRefuse, &wire::encode_reason(token, &err))
        }
    }
}
