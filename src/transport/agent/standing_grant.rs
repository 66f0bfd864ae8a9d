//! Standing grants, receiver side: a cma session is granted every host
//! region it was told of at the handshake, for the connection's life, so its
//! batches need no intent and no grant (one `StandingCommit` each, after the
//! bytes landed). Each grant pins its region. An unregister of a granted
//! region revokes it first (the registry's revoke hook, [`revoke`]): the
//! sender is sent `Revoke`, closes the region to new batches, waits for its
//! writes in flight and answers `Fenced`, and only then is the pin dropped
//! and the unregister's drain goes on. A session that ends drops its pins.

use super::{lock, AgentInner, ReceiverSession};
use crate::error::Result;
use crate::memory::{AccessGuard, RegionDesc, RegionKind};
use crate::transport::identity::ProcIdentity;
use crate::transport::standing::encode_regions;
use crate::transport::wire::{self, FrameType};
use crate::transport::{BatchId, Completion};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// One region granted to one session.
struct Held {
    _guard: AccessGuard,
    /// A `Revoke` was sent; the pin goes with the sender's `Fenced`.
    revoking: bool,
}

/// The agent's standing grants, by (session, region).
#[derive(Default)]
pub(crate) struct StandingGrants {
    m: Mutex<HashMap<(u64, u64), Held>>,
    released: Condvar,
}

impl StandingGrants {
    /// Standing grants held now (every session, every region).
    pub(crate) fn held(&self) -> usize {
        lock(&self.m).len()
    }
}

/// Grants `sess` (a cma session) the host regions among `told` (the ids its
/// HelloAck listed) still registered, pinning each, and tells the sender
/// (`StandingGrant`). A region being unregistered is left out.
pub(super) fn grant_session(a: &AgentInner, sess: &ReceiverSession, told: &[RegionDesc]) {
    if !a.stall().is_zero() {
        // a stalled receiver (a test knob) validates every batch itself
        return;
    }
    let mut m = lock(&a.standing.m);
    let mut ids = Vec::new();
    for d in told.iter().filter(|d| d.kind == RegionKind::Host) {
        if let Ok(guard) = a.registry.acquire(d.id, 0, 0) {
            m.insert(
                (sess.id, d.id),
                Held {
                    _guard: guard,
                    revoking: false,
                },
            );
            ids.push(d.id);
        }
    }
    if !ids.is_empty() {
        // under the lock: a Revoke of one of them is sent after this
        sess.send(FrameType::StandingGrant, &encode_regions(&ids));
    }
}

/// The sender fenced its writes into `region` (`Fenced`): the pin is dropped.
pub(super) fn fenced(a: &AgentInner, sess: &ReceiverSession, p: &[u8]) -> Result<()> {
    let region = wire::decode_batch(p)?;
    lock(&a.standing.m).remove(&(sess.id, region));
    a.standing.released.notify_all();
    Ok(())
}

/// A batch under standing grants landed (`StandingCommit`): its completion is
/// delivered. Only a session holding standing grants may send one.
pub(super) fn committed(
    a: &AgentInner,
    sess: &ReceiverSession,
    p: &[u8],
    peer: &ProcIdentity,
) -> Result<()> {
    let c = wire::decode_commit(p)?;
    let holds = lock(&a.standing.m).keys().any(|&(s, _)| s == sess.id);
    if !holds {
        return Err(crate::error::Error::new(
            crate::error::Status::Protocol,
            format!(
                "session {}: a StandingCommit, but the session holds no standing grant",
                sess.id
            ),
        ));
    }
    let done = Completion {
        batch_id: BatchId(c.batch),
        bytes: c.bytes,
        checksum: c.checksum,
        room: c.room,
        epoch: c.epoch,
    };
    a.deliver(peer.clone(), sess.id, done);
    Ok(())
}

/// The session ended: its pins are dropped.
pub(super) fn session_ended(a: &AgentInner, session: u64) {
    lock(&a.standing.m).retain(|&(s, _), _| s != session);
    a.standing.released.notify_all();
}

/// The registry's revoke hook: an unregister of `d` began. Every session
/// holding it is sent `Revoke`; this returns once each answered `Fenced` (or
/// ended), or at `deadline` (the pins left then keep the region registered:
/// the unregister fails with `RegionBusy`, and the pin goes with the late
/// `Fenced`).
pub(super) fn revoke(a: &AgentInner, d: &RegionDesc, deadline: Instant) {
    let mut m = lock(&a.standing.m);
    let due: Vec<u64> = m
        .iter_mut()
        .filter(|((_, r), h)| *r == d.id && !h.revoking)
        .map(|((s, _), h)| {
            h.revoking = true;
            *s
        })
        .collect();
    for s in due {
        let sess = lock(&a.sessions).get(&s).cloned();
        match sess {
            Some(sess) => sess.send(FrameType::Revoke, &d.id.to_le_bytes()),
            None => {
                m.remove(&(s, d.id));
            }
        }
    }
    loop {
        if !m.keys().any(|&(_, r)| r == d.id) {
            return;
        }
        let now = Instant::now();
        if now >= deadline {
            log::warn!(
                "region {}: a sender did not fence its writes under the standing grant in time; the region stays pinned",
                d.id
            );
            return;
        }
        m = a
            .standing
            .released
            .wait_timeout(m, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

impl super::Agent {
    /// Standing grants this receiver holds now: (cma session, region) pairs
    /// whose sender may write without a per-batch intent.
    pub fn standing_grants_held(&self) -> usize {
        self.inner.standing.held()
    }
}
