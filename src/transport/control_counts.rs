//! Counts of the control messages this process sent and received: the
//! data plane's control frames ([`wire`](super::wire) frames other than tcp
//! data), by frame type, and the engine control channel's messages
//! ([`crate::engine::control`]). Process-wide: every agent and engine of the
//! process adds to the same counters, so a request's cost in round trips can
//! be read off before and after it.

use super::frame_type::FrameType;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// One slot per frame type number (they are below 64).
const SLOTS: usize = 64;

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);
static FRAMES_SENT: [AtomicU64; SLOTS] = [ZERO; SLOTS];
static FRAMES_RECEIVED: [AtomicU64; SLOTS] = [ZERO; SLOTS];
static ENGINE_SENT: AtomicU64 = AtomicU64::new(0);
static ENGINE_RECEIVED: AtomicU64 = AtomicU64::new(0);

fn slot(ty: FrameType) -> usize {
    (ty as usize).min(SLOTS - 1)
}

/// A data-plane control frame of type `ty` was sent.
pub(crate) fn frame_sent(ty: FrameType) {
    if ty != FrameType::Data {
        FRAMES_SENT[slot(ty)].fetch_add(1, Relaxed);
    }
}

/// A data-plane control frame of type `ty` was received.
pub(crate) fn frame_received(ty: FrameType) {
    if ty != FrameType::Data {
        FRAMES_RECEIVED[slot(ty)].fetch_add(1, Relaxed);
    }
}

/// An engine control message was sent.
pub(crate) fn engine_sent() {
    ENGINE_SENT.fetch_add(1, Relaxed);
}

/// An engine control message was received.
pub(crate) fn engine_received() {
    ENGINE_RECEIVED.fetch_add(1, Relaxed);
}

/// Data-plane control frames of type `ty` this process sent so far.
pub fn frames_sent(ty: FrameType) -> u64 {
    FRAMES_SENT[slot(ty)].load(Relaxed)
}

/// Data-plane control frames of type `ty` this process received so far.
pub fn frames_received(ty: FrameType) -> u64 {
    FRAMES_RECEIVED[slot(ty)].load(Relaxed)
}

/// This process's control message totals at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ControlCounts {
    /// Engine control channel messages sent.
    pub engine_sent: u64,
    /// Engine control channel messages received.
    pub engine_received: u64,
    /// Data-plane control frames sent (handshakes, intents, grants, commits,
    /// acks, room ends, keepalives; not tcp data).
    pub data_plane_sent: u64,
    /// Data-plane control frames received.
    pub data_plane_received: u64,
}

impl ControlCounts {
    /// Messages sent on both channels.
    pub fn sent(&self) -> u64 {
        self.engine_sent + self.data_plane_sent
    }

    /// Messages received on both channels.
    pub fn received(&self) -> u64 {
        self.engine_received + self.data_plane_received
    }
}

/// The totals so far.
pub fn control_counts() -> ControlCounts {
    let sum = |a: &[AtomicU64; SLOTS]| a.iter().map(|c| c.load(Relaxed)).sum();
    ControlCounts {
        engine_sent: ENGINE_SENT.load(Relaxed),
        engine_received: ENGINE_RECEIVED.load(Relaxed),
        data_plane_sent: sum(&FRAMES_SENT),
        data_plane_received: sum(&FRAMES_RECEIVED),
    }
}
