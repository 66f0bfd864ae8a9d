//! The deadline thread (both roles): fails rooms past their deadline (the
//! prefill tells their decode ranks), and drains what nothing else consumes
//! (the decode agent's completion records, the prefill's parked metadata).

use super::decode::Decode;
use super::handle::{Inner, WeakInner};
use super::prefill::{notify_decode, Prefill};
use super::state::lock;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub(super) fn deadline_loop(w: WeakInner) {
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let Some(inner) = w.upgrade() else { return };
        if inner.shared().closed.load(Ordering::Acquire) {
            return;
        }
        match &inner {
            Inner::Prefill(p) => prefill_turn(p),
            Inner::Decode(d) => decode_turn(d),
        }
    }
}

/// Fails the prefill's rooms past their deadline (naming the decode ranks
/// it was sending to) and tells their decode ranks; forgets stale parked metadata.
fn prefill_turn(inner: &Prefill) {
    // metadata for a room this prefill never opened (or already cleared) is forgotten
    let ttl = inner.cfg.room_timeout;
    lock(&inner.pending_meta).retain(|_, v| v.iter().any(|m| m.arrived.elapsed() < ttl));
    let now = Instant::now();
    // the prefill names the decode ranks of each room it fails, read
    // while the rooms lock is not held (it is a leaf of the lock order)
    let mut context = HashMap::new();
    let due = lock(&inner.rooms).due(now);
    for room in due {
        let c = waiting_on(inner, room);
        if !c.is_empty() {
            context.insert(room, c);
        }
    }
    let expired = lock(&inner.rooms).expire_with(now, &context);
    if expired.is_empty() {
        return;
    }
    inner.cv.notify_all();
    for room in expired {
        // read the failure first: the rooms lock is not held while
        // the decode ranks' control sockets are written
        let failure = lock(&inner.rooms)
            .get(room)
            .ok()
            .and_then(|r| r.failure.clone());
        notify_decode(inner, room, false, failure);
    }
}

/// Drains the decode agent's completion records and fails the decode's
/// rooms past their deadline (their grants revoked).
fn decode_turn(inner: &Decode) {
    // The agent queues a completion record per received batch; the engine
    // learns a room's outcome and bytes from the prefill's status message
    // instead, so the records are drained here rather than accumulating.
    let mut landed = 0;
    while inner.agent.try_completion().is_some() {
        landed += 1;
    }
    inner.metrics.received(landed);
    let expired = lock(&inner.rooms).expire_with(Instant::now(), &HashMap::new());
    if expired.is_empty() {
        return;
    }
    inner.cv.notify_all();
    for &room in &expired {
        inner.revoke_room_grants(room, None);
    }
}

/// The decode ranks an expired prefill room was sending to, in words.
fn waiting_on(inner: &Prefill, room: u64) -> String {
    let pr = lock(&inner.prefill_rooms);
    let Some(r) = pr.get(&room).filter(|r| r.sent_positions > 0) else {
        return String::new(); // nothing was queued: no writes to wait on
    };
    let names: Vec<String> = r
        .infos
        .iter()
        .map(|m| {
            format!(
                "decode rank instance {} (dcp_rank {})",
                m.link.hello.instance_id, m.link.hello.topology.dcp_rank
            )
        })
        .collect();
    if names.is_empty() {
        String::new()
    } else {
        format!("its writes to {} did not complete", names.join(", "))
    }
}
