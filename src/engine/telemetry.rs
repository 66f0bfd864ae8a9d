//! Per-room telemetry: when a room's chunks were queued and planned, when
//! its first batch was posted and when it succeeded, with its bytes,
//! batches and retries ([`Engine::telemetry`]). The times are stamped under
//! the room table's lock by calls that take it anyway.

use super::room::KvPoll;
use std::time::{Duration, Instant};

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

/// One room's telemetry ([`Engine::telemetry`]). Offsets are from the room's
/// creation (`sender` / `receiver`); `None` where this side does not see
/// that step or the room has not reached it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomTelemetry {
    /// The room id.
    pub room: u64,
    /// Incarnation of the room id.
    pub attempt: u64,
    /// Current state.
    pub state: KvPoll,
    /// When the room was created, nanoseconds since the Unix epoch.
    pub created_unix_ns: u64,
    /// Creation to queued (prefill: first chunk; decode: metadata sent).
    pub queued: Option<Duration>,
    /// Creation to the first chunk planned (prefill only).
    pub planned: Option<Duration>,
    /// Creation to the first batch posted (prefill only).
    pub first_byte: Option<Duration>,
    /// Creation to Success.
    pub last_ack: Option<Duration>,
    /// KV bytes of the room: prefill, written to every decode rank;
    /// decode, as the prefill ranks reported (what `room_bytes` says).
    pub bytes: u64,
    /// Batches posted (prefill only; aux and state batches included).
    pub batches: Option<u64>,
    /// Writes done again (prefill only).
    pub retries: Option<u64>,
    /// The transport label of the room's data, once known.
    pub transport: Option<String>,
}
