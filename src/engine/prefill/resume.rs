//! A room resumed over tcp after its data connection broke in its middle:
//! the prefill keeps every write of the room it sent over tcp (per decode
//! rank, `PrefillRoom::tcp_sent`),
//! redials the link, asks the decode's agent what landed under the room's
//! grant ([`Transport::resume_room`](crate::transport::Transport::resume_room):
//! the receiver records it per grant, across connections) and sends only
//! the rest on the new connection, which counts the bytes that landed
//! before ([`Transport::carry_room`](crate::transport::Transport::carry_room)),
//! so the room's end names its whole total. A link without a room grant,
//! or whose redial fails, fails the room as before.

use super::Prefill;
use crate::engine::flight::Flight;
use crate::engine::link::DecodeLink;
use crate::engine::state::lock;
use crate::error::{Error, Result};
use crate::transport::landed::Landed;
use crate::transport::{BatchOptions, TransportKind, WriteOp};
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::Duration;

/// Redials a link tries before the room fails.
const RESUME_TRIES: usize = 3;

/// Writes per batch of what is sent again.
const RESEND_BATCH_OPS: usize = 4096;

/// After a flight of `room`'s `attempt` drained: keeps its tcp writes in
/// the room's record and resumes every link whose tcp connection broke
/// under it; the first link that cannot resume fails the room with why.
pub(super) fn settle(
    inner: &Prefill,
    room: u64,
    attempt: u64,
    flight: &mut Flight<'_>,
) -> Result<()> {
    let sent = std::mem::take(&mut flight.tcp_sent);
    let broken = std::mem::take(&mut flight.broken);
    if !sent.is_empty() {
        if let Some(r) = lock(&inner.prefill_rooms).get_mut(&room) {
            for (link, ops) in sent {
                match r.tcp_sent.entry(link.hello.instance_id.0) {
                    Entry::Occupied(mut o) => o.get_mut().extend(ops),
                    Entry::Vacant(v) => {
                        v.insert(ops);
                    }
                }
            }
        }
    }
    for (link, cause) in broken {
        resume_link(inner, room, attempt, &link, cause)?;
    }
    Ok(())
}

/// Resumes `room` toward `link` on a new connection after `cause` broke the
/// last one (see the module documentation).
pub(super) fn resume_link(
    inner: &Prefill,
    room: u64,
    attempt: u64,
    link: &Arc<DecodeLink>,
    cause: Error,
) -> Result<()> {
    let id = link.hello.instance_id;
    let grant = lock(&inner.prefill_rooms).get(&room).and_then(|r| {
        r.infos
            .iter()
            .find(|m| Arc::ptr_eq(&m.link, link))
            .and_then(|m| m.grant.clone())
    });
    let Some(grant) = grant else {
        return Err(cause);
    };
    let timeout = inner.cfg.batch_timeout;
    let mut cause = cause;
    for attempt_no in 1..=RESUME_TRIES {
        inner.redial_if_broken(link);
        let data = link.data();
        if !data.is_alive() || data.kind() != TransportKind::Tcp {
            std::thread::sleep(Duration::from_millis(20 * attempt_no as u64));
            continue;
        }
        let landed = match data.resume_room(&grant, attempt, timeout) {
            Ok(l) => l,
            Err(e) if data.is_alive() => return Err(e),
            Err(e) => {
                cause = e;
                continue;
            }
        };
        let sent = lock(&inner.prefill_rooms)
            .get(&room)
            .and_then(|r| r.tcp_sent.get(&id.0).cloned())
            .unwrap_or_default();
        let total: u64 = sent.iter().map(|o| o.len).sum();
        let missing = missing_writes(&sent, &landed);
        let again: u64 = missing.iter().map(|o| o.len).sum();
        data.carry_room(room, attempt, total - again)?;
        let mut flight = Flight::new(
            &inner.rooms,
            BatchOptions {
                timeout,
                checksum: false,
                room,
                epoch: attempt,
            },
        );
        flight.resumable = true;
        for ops in missing.chunks(RESEND_BATCH_OPS) {
            flight.submit(link, ops, None)?;
        }
        flight.drain()?;
        if let Some((_, e)) = flight.broken.pop() {
            cause = e;
            continue;
        }
        inner.metrics.room_resumed(again);
        log::warn!(
            "room {room}: the tcp data link to decode {id} broke ({}); resumed on a new connection, sending {again} of the room's {total} bytes sent so far again",
            cause.detail()
        );
        return Ok(());
    }
    Err(cause)
}

/// The parts of `sent` whose destination bytes did not land, as writes
/// (each source offset moved with its destination).
fn missing_writes(sent: &[WriteOp], landed: &Landed) -> Vec<WriteOp> {
    let mut out = Vec::new();
    for op in sent {
        for (offset, len) in landed.missing(op.remote_region, op.remote_offset, op.len) {
            out.push(WriteOp {
                local_offset: op.local_offset + (offset - op.remote_offset),
                remote_offset: offset,
                len,
                ..*op
            });
        }
    }
    out
}

/// Test knob `sever_tcp_data_after`: counts `bytes` just submitted to
/// `link` over tcp down, and closes its data connection when the count
/// reaches zero (once).
#[cfg(any(test, feature = "testing"))]
pub(super) fn sever_for_test(inner: &Prefill, link: &DecodeLink, bytes: u64) {
    use std::sync::atomic::Ordering;
    let Some(left) = &inner.cfg.testing.sever_tcp_data_after else {
        return;
    };
    let data = link.data();
    if data.kind() != TransportKind::Tcp || bytes == 0 {
        return;
    }
    let before = left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        (n > 0).then(|| n.saturating_sub(bytes))
    });
    if matches!(before, Ok(n) if n <= bytes) {
        log::warn!(
            "engine: test knob: closing the tcp data link to decode {}",
            link.hello.instance_id
        );
        data.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_did_not_land_is_sent_again_from_the_matching_source() {
        let mut landed = Landed::default();
        landed.insert(7, 100, 50);
        landed.insert(7, 300, 100);
        landed.insert(8, 0, 64);
        let op = |local_offset, remote_region, remote_offset, len| WriteOp {
            local_region: 1,
            local_offset,
            remote_region,
            remote_offset,
            len,
        };
        let sent = [op(1000, 7, 0, 400), op(0, 8, 0, 64), op(5000, 8, 64, 10)];
        let again = missing_writes(&sent, &landed);
        assert_eq!(
            again,
            [
                op(1000, 7, 0, 100),
                op(1150, 7, 150, 150),
                op(5000, 8, 64, 10),
            ]
        );
        let total: u64 = sent.iter().map(|o| o.len).sum();
        let again_bytes: u64 = again.iter().map(|o| o.len).sum();
        assert_eq!(
            total - again_bytes,
            landed.bytes(),
            "what lands again is what was missing"
        );
    }
}
