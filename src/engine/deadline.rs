//! The deadline thread (both roles): fails rooms past their deadline (the
//! prefill tells their decode ranks), and drains what nothing else consumes
//! (the decode agent's completion records, the prefill's parked metadata).

use super::handle::{lock, Inner};
use super::prefill::notify_decode;
use crate::bootstrap::schema::Role;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub(super) fn deadline_loop(w: std::sync::Weak<Inner>) {
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let Some(inner) = w.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        if inner.cfg.role == Role::Decode {
            // The agent queues a completion record per received batch; the engine
            // learns a room's outcome and bytes from the prefill's status message
            // instead, so the records are drained here rather than accumulating.
            let mut landed = 0;
            while inner.agent.try_completion().is_some() {
                landed += 1;
            }
            inner.metrics.received(landed);
        }
        if inner.cfg.role == Role::Prefill {
            // metadata for a room this prefill never opened (or already cleared) is forgotten
            let ttl = inner.cfg.room_timeout;
            lock(&inner.pending_meta).retain(|_, v| v.iter().any(|m| m.arrived.elapsed() < ttl));
        }
        let expired = lock(&inner.rooms).expire(Instant::now());
        if !expired.is_empty() {
            inner.cv.notify_all();
            if inner.cfg.role == Role::Prefill {
                for room in expired {
                    notify_decode(
                        &inner,
                        room,
                        false,
                        lock(&inner.rooms)
                            .get(room)
                            .ok()
                            .and_then(|r| r.failure.clone()),
                    );
                }
            }
        }
    }
}
