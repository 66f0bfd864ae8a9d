//! An engine's metrics (Prometheus text), the address of its `/metrics`
//! responder, and per-room telemetry over the C ABI (ABI 1.3).

use super::engine::{eng, PdxEngine};
use super::ptr::{self, Versioned};
use super::{ok, PdxStatus};
use crate::engine::RoomTelemetry;
use crate::error::{Error, Status};
use std::ffi::c_char;
use std::time::Duration;

/// `PdxRoomTelemetry` fields this side of the room does not see, or that
/// the room has not reached yet.
pub const PDXFER_TELEMETRY_UNSET: u64 = u64::MAX;

/// One room's telemetry (`pdxfer_engine_room_telemetry`). Times are
/// nanoseconds from the room's creation (`pdxfer_engine_sender` /
/// `pdxfer_engine_receiver`); `PDXFER_TELEMETRY_UNSET` where this side does
/// not see that step (a decode sees no planning, first byte, batches or
/// retries) or the room has not reached it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxRoomTelemetry {
    /// `sizeof(PdxRoomTelemetry)`, set by the caller.
    pub struct_size: u64,
    /// The room id.
    pub room: u64,
    /// Incarnation of the room id (1, 2, ... on reuse).
    pub attempt: u64,
    /// Current `KVPoll` state (`PDXFER_POLL_*`).
    pub state: i32,
    /// Reserved, zero.
    pub reserved: u32,
    /// When the room was created, nanoseconds since the Unix epoch.
    pub created_unix_ns: u64,
    /// Prefill: first chunk queued (`pdxfer_engine_send`); decode: metadata
    /// sent to every prefill rank.
    pub queued_ns: u64,
    /// Prefill: first chunk planned by a transfer worker.
    pub planned_ns: u64,
    /// Prefill: first batch posted.
    pub first_byte_ns: u64,
    /// The room succeeded (prefill: every batch completed; decode: every
    /// prefill rank reported success).
    pub last_ack_ns: u64,
    /// KV bytes of the room (prefill: to every decode rank; decode: as the
    /// prefill ranks reported, what `pdxfer_engine_room_bytes` says).
    pub bytes: u64,
    /// Prefill: batches posted (aux and state batches included).
    pub batches: u64,
    /// Prefill: writes done again.
    pub retries: u64,
}

// SAFETY: repr(C), starts with u64 struct_size, integers only (zero is valid).
unsafe impl Versioned for PdxRoomTelemetry {
    const MIN_SIZE: usize = std::mem::size_of::<PdxRoomTelemetry>();
    const NAME: &'static str = "PdxRoomTelemetry";
}

fn ns(d: Option<Duration>) -> u64 {
    d.map_or(PDXFER_TELEMETRY_UNSET, |d| {
        u64::try_from(d.as_nanos()).unwrap_or(PDXFER_TELEMETRY_UNSET - 1)
    })
}

impl PdxRoomTelemetry {
    fn from_rust(t: &RoomTelemetry) -> PdxRoomTelemetry {
        PdxRoomTelemetry {
            struct_size: std::mem::size_of::<PdxRoomTelemetry>() as u64,
            room: t.room,
            attempt: t.attempt,
            state: t.state as i32,
            reserved: 0,
            created_unix_ns: t.created_unix_ns,
            queued_ns: ns(t.queued),
            planned_ns: ns(t.planned),
            first_byte_ns: ns(t.first_byte),
            last_ack_ns: ns(t.last_ack),
            bytes: t.bytes,
            batches: t.batches.unwrap_or(PDXFER_TELEMETRY_UNSET),
            retries: t.retries.unwrap_or(PDXFER_TELEMETRY_UNSET),
        }
    }
}

/// The engine's metrics as Prometheus text (format 0.0.4), NUL-terminated,
/// into `buf` of `capacity` bytes; the needed size (NUL included) goes to
/// `*out_len`. NULL `buf` with capacity 0 is a size query; a smaller buffer
/// is `PDX_STATUS_BUFFER_TOO_SMALL` with the needed size written and `buf`
/// untouched. The text may grow between two calls (counters gain digits,
/// peers appear): size the buffer with some headroom, or retry.
///
/// Contents: live rooms by state, rooms created and finished, failures by
/// status kind, the transfer latency histogram per transport, bytes,
/// batches, failed batches and wire time per transport and peer, gather
/// time, host staging size and bytes in flight, registered memory by kind.
#[no_mangle]
pub extern "C" fn pdxfer_engine_metrics(
    engine: *const PdxEngine,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    super::boundary(|| {
        let e = eng(engine)?;
        ptr::check_out(out_len, "out_len")?;
        ptr::fill_str(&e.metrics(), buf, capacity, out_len, "buf")
    })
}

/// The address (`host:port`, NUL-terminated) the engine's `/metrics`
/// responder listens on, into `buf` as `pdxfer_engine_metrics` fills its
/// buffer. `PDX_STATUS_UNSUPPORTED` (nothing written) when the engine was
/// created without `metrics_listen`.
#[no_mangle]
pub extern "C" fn pdxfer_engine_metrics_address(
    engine: *const PdxEngine,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    super::boundary(|| {
        let e = eng(engine)?;
        ptr::check_out(out_len, "out_len")?;
        let addr = e.metrics_addr().ok_or_else(|| {
            Error::new(
                Status::Unsupported,
                "this engine serves no /metrics: set PdxEngineConfig.metrics_listen",
            )
        })?;
        ptr::fill_str(&addr.to_string(), buf, capacity, out_len, "buf")
    })
}

/// The telemetry of a live room (finished or not; a cleared room is
/// `PDX_STATUS_UNKNOWN_ROOM`) into `*out`, whose `struct_size` the caller
/// sets. A refused call writes nothing.
#[no_mangle]
pub extern "C" fn pdxfer_engine_room_telemetry(
    engine: *const PdxEngine,
    room: u64,
    out: *mut PdxRoomTelemetry,
) -> PdxStatus {
    super::boundary(|| {
        let e = eng(engine)?;
        ptr::check_versioned_out(out)?;
        let t = e.telemetry(room)?;
        ptr::write_versioned(out, &PdxRoomTelemetry::from_rust(&t))?;
        ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_size_is_pinned() {
        assert_eq!(std::mem::size_of::<PdxRoomTelemetry>(), 96);
    }

    #[test]
    fn unset_times_and_counts_read_as_the_sentinel() {
        let t = RoomTelemetry {
            room: 3,
            attempt: 1,
            state: crate::engine::KvPoll::Transferring,
            created_unix_ns: 5,
            queued: Some(Duration::from_micros(7)),
            planned: None,
            first_byte: None,
            last_ack: None,
            bytes: 9,
            batches: None,
            retries: Some(0),
            transport: None,
        };
        let c = PdxRoomTelemetry::from_rust(&t);
        assert_eq!((c.room, c.attempt, c.state), (3, 1, 3));
        assert_eq!(c.queued_ns, 7000);
        assert_eq!(c.planned_ns, PDXFER_TELEMETRY_UNSET);
        assert_eq!(c.last_ack_ns, PDXFER_TELEMETRY_UNSET);
        assert_eq!(
            (c.bytes, c.batches, c.retries),
            (9, PDXFER_TELEMETRY_UNSET, 0)
        );
    }

    #[test]
    fn refused_calls_write_nothing() {
        let mut len = 77usize;
        assert_eq!(
            pdxfer_engine_metrics(std::ptr::null(), std::ptr::null_mut(), 0, &mut len),
            PdxStatus::NullArgument
        );
        assert_eq!(len, 77);
        let mut t = PdxRoomTelemetry::from_rust(&RoomTelemetry {
            room: 1,
            attempt: 1,
            state: crate::engine::KvPoll::Success,
            created_unix_ns: 0,
            queued: None,
            planned: None,
            first_byte: None,
            last_ack: None,
            bytes: 0,
            batches: None,
            retries: None,
            transport: None,
        });
        t.struct_size = 8;
        assert_eq!(
            pdxfer_engine_room_telemetry(std::ptr::null(), 1, &mut t),
            PdxStatus::NullArgument
        );
    }
}
