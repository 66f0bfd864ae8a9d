//! Per-room telemetry: when a room's chunks were queued and planned, when
//! its first batch was posted and when it succeeded, with its bytes,
//! batches and retries ([`Engine::telemetry`](super::Engine::telemetry)), from
//! the room's [`RoomTimes`](super::RoomTimes), which are stamped under the
//! room table's lock by calls that take it anyway.

use super::room::KvPoll;
use std::time::Duration;

/// One room's telemetry ([`Engine::telemetry`](super::Engine::telemetry)). Offsets are from the room's
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
