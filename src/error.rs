//! The one error type of pdxfer and its stable numeric codes.
//!
//! [`Status`] is the C status enum (`PdxStatus` in `include/pdxfer.h`) and the
//! `.code` of every Python exception. Numbers never change once released:
//!
//! | range | origin |
//! |---|---|
//! | `0`, `1` | success, in progress (not errors) |
//! | `-1xx` | common: arguments, ABI, panics, buffers |
//! | `-2xx` | layout: token plans and peer compatibility |
//! | `-3xx` | memory registration and bounds |
//! | `-4xx` | transports (local, cma, tcp) |
//! | `-5xx` | bootstrap and metadata |
//! | `-6xx` | relayout and CUDA |
//! | `-7xx` | RDMA |
//! | `-8xx` | NCCL |
//! | `-9xx` | engine, rooms and sessions |
//!
//! Each status has a static message ([`Status::message`]) and a stable
//! snake_case kind ([`Status::kind`]); the detail of one failure (both sides'
//! values, the likely cause, the fix) travels in [`Error`].

use std::fmt;

/// Stable status codes shared by Rust, C (`PdxStatus`) and Python (`.code`).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PdxStatus {
    /// Success.
    Ok = 0,
    /// The operation has not finished yet (poll again).
    InProgress = 1,

    /// A required pointer argument was NULL.
    NullArgument = -100,
    /// An argument is out of range or inconsistent with another.
    InvalidArgument = -101,
    /// A Rust panic was caught at the C boundary; the handle may be unusable.
    Panic = -102,
    /// A struct passed in is smaller than the oldest supported version.
    AbiMismatch = -103,
    /// The caller's output array is too small; the needed length was written.
    BufferTooSmall = -104,
    /// The operation is not supported by this build or configuration.
    Unsupported = -105,
    /// An operating-system I/O error.
    Io = -106,
    /// A deadline passed.
    Timeout = -107,
    /// A string argument is not valid UTF-8.
    InvalidUtf8 = -108,

    /// `decode_prefix_len` is not a multiple of the decode virtual page (P*D).
    PrefixMisaligned = -200,
    /// More tokens were asked for than the source pages hold.
    TokensExceedSource = -201,
    /// The decode rank registered too few destination pages for the chunk.
    InsufficientDestination = -202,
    /// Peers with equal DCP sizes but different DCP ranks were connected.
    DcpRankMismatch = -203,
    /// The (prefill DCP, decode DCP) combination cannot be served.
    UnsupportedDcpTopology = -204,
    /// Decode DCP > 1 needs an MLA or hybrid-MLA KV pool.
    DcpRequiresMla = -205,
    /// Prefill attention CP > 1 cannot feed a decode with DCP > 1.
    PrefillCpWithDecodeDcp = -206,
    /// The two sides use different KV cache dtypes.
    KvDtypeMismatch = -207,
    /// The KV entries (layers, row bytes) of the two sides do not match.
    GeometryMismatch = -208,
    /// The two sides use different page sizes on a path that needs equal ones.
    PageSizeMismatch = -209,
    /// A topology is internally inconsistent (rank >= size, sizes not dividing).
    InvalidTopology = -210,
    /// Pipeline-parallel sizes cannot be paired.
    PpMismatch = -211,
    /// A layout (page size, DCP size, interleave) is invalid.
    InvalidLayout = -212,

    /// Memory region registration failed or the region is unknown.
    RegionNotFound = -300,
    /// An access falls outside the owner's registered regions.
    OutOfBounds = -301,
    /// A region overlaps an existing registration.
    RegionOverlap = -302,
    /// The region is still in use by in-flight operations.
    RegionBusy = -303,

    /// The peer could not be reached or closed the connection.
    PeerUnreachable = -400,
    /// The peer sent a malformed or unexpected message.
    Protocol = -401,
    /// The peer is not the process it claims to be (pid reuse, other host).
    PeerIdentity = -402,
    /// A transfer batch failed; the detail names the reason.
    BatchFailed = -403,
    /// The requested transport is not available here.
    TransportUnavailable = -404,
    /// A peer failed mutual authentication with the cluster secret.
    AuthFailed = -405,
    /// A listener on a non-loopback address needs a cluster secret.
    AuthRequired = -406,
    /// A control frame after the authentication exchange carried a missing or
    /// wrong MAC (tampered, replayed, reordered or injected): the connection is dropped.
    ChannelIntegrity = -407,

    /// The bootstrap server answered with an error or could not be reached.
    Bootstrap = -500,
    /// Bootstrap metadata is stale (older epoch or other instance id).
    StaleMetadata = -501,
    /// The request was refused: missing or wrong token.
    Unauthorized = -502,
    /// The bootstrap has no entry for the requested rank.
    NotRegistered = -503,
    /// A request body is larger than the bootstrap server accepts.
    PayloadTooLarge = -504,
    /// The bootstrap does not yet list every rank of the peer's current epoch.
    NotReady = -505,
    /// The bootstrap store is at its byte bound (`--max-store-bytes`).
    StoreFull = -506,

    /// No CUDA driver library (libcuda) could be loaded.
    NoCudaDriver = -600,
    /// A CUDA driver call failed.
    Cuda = -601,
    /// NVRTC is missing or failed to compile a kernel.
    Nvrtc = -602,
    /// A relayout (gather/scatter) failed.
    Relayout = -603,

    /// No RDMA device is usable on this machine.
    NoRdmaDevice = -700,
    /// An RDMA verbs call failed.
    Rdma = -701,
    /// The RDMA handshake failed; the detail names the field (mtu, gid, lid, qpn, psn, ...).
    RdmaHandshake = -702,
    /// An RDMA work request completed with an error; the batch failed and was not retried.
    RdmaCompletion = -703,
    /// Device (GPU) memory cannot be registered with the RDMA NIC (no
    /// GPUDirect RDMA: no `cuda` feature, no driver, no dma-buf or
    /// nvidia-peermem); the detail names the reason.
    NoGpuDirect = -704,

    /// No NCCL library could be loaded.
    NoNccl = -800,
    /// An NCCL call failed.
    Nccl = -801,
    /// The two sides of an NCCL pair derived different send/recv plans.
    NcclPlanMismatch = -802,
    /// Transport nccl between two ranks on one GPU (NCCL refuses two ranks
    /// of one communicator on one device): use cma or tcp there.
    NcclSameGpu = -803,

    /// The room id is unknown to this engine.
    UnknownRoom = -900,
    /// The room has failed; its reason is kept on the room.
    RoomFailed = -901,
    /// The room was aborted.
    Aborted = -902,
    /// The engine is shutting down or was poisoned by a panic.
    EngineClosed = -903,
    /// A layer-wise send came out of order, repeated a layer, or left layers
    /// of a chunk unsent; the detail names the layers.
    LayerOrder = -904,
    /// Two different room keys (request ids) map to one room on this engine;
    /// the detail names both keys.
    RoomKeyCollision = -910,
}

/// Rust-side name of the status enum.
pub type Status = PdxStatus;

const fn cstr(s: &'static str) -> &'static std::ffi::CStr {
    match std::ffi::CStr::from_bytes_with_nul(s.as_bytes()) {
        Ok(c) => c,
        Err(_) => c"",
    }
}

macro_rules! status_table {
    ($($v:ident => $kind:literal, $msg:literal;)*) => {
        impl PdxStatus {
            /// Every status, in declaration order.
            pub const ALL: &'static [PdxStatus] = &[$(PdxStatus::$v),*];

            /// The stable snake_case kind (`"prefix_misaligned"`), also the Python `.kind`.
            pub fn kind(self) -> &'static str {
                match self { $(PdxStatus::$v => $kind),* }
            }

            /// A static one-line description of the status.
            pub fn message(self) -> &'static str {
                match self { $(PdxStatus::$v => $msg),* }
            }

            /// [`kind`](Self::kind) as a static C string.
            pub fn kind_cstr(self) -> &'static std::ffi::CStr {
                match self { $(PdxStatus::$v => const { cstr(concat!($kind, "\0")) }),* }
            }

            /// [`message`](Self::message) as a static C string.
            pub fn message_cstr(self) -> &'static std::ffi::CStr {
                match self { $(PdxStatus::$v => const { cstr(concat!($msg, "\0")) }),* }
            }

            /// The status with this numeric code, if any.
            pub fn from_code(code: i32) -> Option<PdxStatus> {
                PdxStatus::ALL.iter().copied().find(|s| *s as i32 == code)
            }
        }
    };
}

status_table! {
    Ok => "ok", "success";
    InProgress => "in_progress", "operation in progress";
    NullArgument => "null_argument", "a required pointer argument was NULL";
    InvalidArgument => "invalid_argument", "an argument is out of range or inconsistent";
    Panic => "panic", "internal panic caught at the C boundary";
    AbiMismatch => "abi_mismatch", "struct size or ABI version not supported";
    BufferTooSmall => "buffer_too_small", "output buffer too small; required length written";
    Unsupported => "unsupported", "operation not supported by this build or configuration";
    Io => "io", "operating-system I/O error";
    Timeout => "timeout", "deadline exceeded";
    InvalidUtf8 => "invalid_utf8", "string argument is not valid UTF-8";
    PrefixMisaligned => "prefix_misaligned", "decode prefix length not aligned to the virtual DCP page";
    TokensExceedSource => "tokens_exceed_source", "more tokens than the source pages hold";
    InsufficientDestination => "insufficient_destination", "not enough destination pages for the chunk";
    DcpRankMismatch => "dcp_rank_mismatch", "PD peers must connect matching DCP ranks";
    UnsupportedDcpTopology => "unsupported_dcp_topology", "unsupported PD DCP topology";
    DcpRequiresMla => "dcp_requires_mla", "decode DCP requires an MLA or hybrid-MLA KV pool";
    PrefillCpWithDecodeDcp => "prefill_cp_with_decode_dcp", "decode DCP needs the prefill's attention CP ranks to hold replicated KV";
    KvDtypeMismatch => "kv_dtype_mismatch", "KV cache dtype differs between prefill and decode";
    GeometryMismatch => "geometry_mismatch", "KV entry geometry differs between prefill and decode";
    PageSizeMismatch => "page_size_mismatch", "page size differs between prefill and decode";
    InvalidTopology => "invalid_topology", "parallel topology is inconsistent";
    PpMismatch => "pp_mismatch", "pipeline-parallel sizes cannot be paired";
    InvalidLayout => "invalid_layout", "invalid page/DCP/interleave layout";
    RegionNotFound => "region_not_found", "memory region not registered";
    OutOfBounds => "out_of_bounds", "access outside the registered regions";
    RegionOverlap => "region_overlap", "region overlaps an existing registration";
    RegionBusy => "region_busy", "region still used by in-flight operations";
    PeerUnreachable => "peer_unreachable", "peer unreachable or connection closed";
    Protocol => "protocol", "malformed or unexpected message from peer";
    PeerIdentity => "peer_identity", "peer is not the process it claims to be";
    BatchFailed => "batch_failed", "transfer batch failed";
    TransportUnavailable => "transport_unavailable", "transport not available here";
    AuthFailed => "auth_failed", "peer failed authentication with the cluster secret";
    AuthRequired => "auth_required", "a non-loopback listener needs a cluster secret";
    ChannelIntegrity => "channel_integrity", "a control frame failed its session MAC (tampered, replayed or reordered)";
    Bootstrap => "bootstrap", "bootstrap server error";
    StaleMetadata => "stale_metadata", "bootstrap metadata is stale";
    Unauthorized => "unauthorized", "missing or wrong bootstrap token";
    NotRegistered => "not_registered", "rank not registered with the bootstrap";
    PayloadTooLarge => "payload_too_large", "request body too large for the bootstrap server";
    NotReady => "not_ready", "bootstrap does not yet list every rank of the current epoch";
    StoreFull => "store_full", "bootstrap store is at its byte bound";
    NoCudaDriver => "no_cuda_driver", "no CUDA driver library could be loaded";
    Cuda => "cuda", "CUDA driver call failed";
    Nvrtc => "nvrtc", "NVRTC missing or compilation failed";
    Relayout => "relayout", "relayout (gather/scatter) failed";
    NoRdmaDevice => "no_rdma_device", "no usable RDMA device";
    Rdma => "rdma", "RDMA verbs call failed";
    RdmaHandshake => "rdma_handshake", "RDMA handshake failed (the detail names the field)";
    RdmaCompletion => "rdma_completion", "RDMA work request completed with an error; not retried";
    NoGpuDirect => "no_gpudirect", "GPU memory cannot be registered with the RDMA NIC (no GPUDirect RDMA)";
    NoNccl => "no_nccl", "no NCCL library could be loaded";
    Nccl => "nccl", "NCCL call failed";
    NcclPlanMismatch => "nccl_plan_mismatch", "NCCL sender and receiver plans differ";
    NcclSameGpu => "nccl_same_gpu", "transport nccl between two ranks on one GPU (use cma or tcp)";
    UnknownRoom => "unknown_room", "unknown room";
    RoomFailed => "room_failed", "room failed";
    Aborted => "aborted", "room aborted";
    EngineClosed => "engine_closed", "engine closed or poisoned";
    LayerOrder => "layer_order", "layer-wise send out of order, repeated, or with layers missing";
    RoomKeyCollision => "room_key_collision", "two room keys map to the same room";
}

impl fmt::Display for PdxStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind())
    }
}

/// The error of every fallible pdxfer call: a stable [`Status`] plus detail text.
///
/// The detail names the values on both sides, the likely cause and the fix; the
/// status is what programs branch on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {detail}")]
pub struct Error {
    status: Status,
    detail: String,
}

impl Error {
    /// An error with `status` and `detail`.
    pub fn new(status: Status, detail: impl Into<String>) -> Self {
        Error {
            status,
            detail: detail.into(),
        }
    }

    /// The stable status code.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The stable snake_case kind (`self.status().kind()`).
    pub fn kind(&self) -> &'static str {
        self.status.kind()
    }

    /// The detail text (without the kind prefix).
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// Shorthand for [`Status::InvalidArgument`].
    pub fn invalid(detail: impl Into<String>) -> Self {
        Error::new(Status::InvalidArgument, detail)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        let status = match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Status::Timeout,
            std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::NotConnected => Status::PeerUnreachable,
            _ => Status::Io,
        };
        Error::new(status, e.to_string())
    }
}

/// Result alias used throughout pdxfer.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn codes_and_kinds_are_unique_and_roundtrip() {
        let mut codes = HashSet::new();
        let mut kinds = HashSet::new();
        for s in PdxStatus::ALL {
            assert!(codes.insert(*s as i32), "duplicate code {}", *s as i32);
            assert!(kinds.insert(s.kind()), "duplicate kind {}", s.kind());
            assert_eq!(PdxStatus::from_code(*s as i32), Some(*s));
            assert!(!s.message().is_empty());
        }
        assert_eq!(PdxStatus::from_code(12345), None);
    }

    #[test]
    fn codes_sit_in_their_documented_ranges() {
        // The range table of the module doc, read from this file: `-4xx` -> 4.
        let doc: Vec<(i32, &str)> = include_str!("error.rs")
            .lines()
            .map_while(|l| l.strip_prefix("//!"))
            .filter_map(|l| {
                let mut cells = l.trim().strip_prefix("| `-")?.split('|');
                let hundreds = cells.next()?.trim().strip_suffix("xx`")?.parse().ok()?;
                Some((hundreds, cells.next()?.trim()))
            })
            .collect();
        assert_eq!(
            doc.iter().map(|d| d.0).collect::<Vec<_>>(),
            (1..=9).collect::<Vec<_>>(),
            "{doc:?}"
        );
        // Every error kind, in the area it belongs to (the doc's origin column).
        let areas: [(i32, &[&str]); 9] = [
            (
                1,
                &[
                    "null_argument",
                    "invalid_argument",
                    "panic",
                    "abi_mismatch",
                    "buffer_too_small",
                    "unsupported",
                    "io",
                    "timeout",
                    "invalid_utf8",
                ],
            ),
            (
                2,
                &[
                    "prefix_misaligned",
                    "tokens_exceed_source",
                    "insufficient_destination",
                    "dcp_rank_mismatch",
                    "unsupported_dcp_topology",
                    "dcp_requires_mla",
                    "prefill_cp_with_decode_dcp",
                    "kv_dtype_mismatch",
                    "geometry_mismatch",
                    "page_size_mismatch",
                    "invalid_topology",
                    "pp_mismatch",
                    "invalid_layout",
                ],
            ),
            (
                3,
                &[
                    "region_not_found",
                    "out_of_bounds",
                    "region_overlap",
                    "region_busy",
                ],
            ),
            (
                4,
                &[
                    "peer_unreachable",
                    "protocol",
                    "peer_identity",
                    "batch_failed",
                    "transport_unavailable",
                    "auth_failed",
                    "auth_required",
                    "channel_integrity",
                ],
            ),
            (
                5,
                &[
                    "bootstrap",
                    "stale_metadata",
                    "unauthorized",
                    "not_registered",
                    "payload_too_large",
                    "not_ready",
                    "store_full",
                ],
            ),
            (6, &["no_cuda_driver", "cuda", "nvrtc", "relayout"]),
            (
                7,
                &[
                    "no_rdma_device",
                    "rdma",
                    "rdma_handshake",
                    "rdma_completion",
                    "no_gpudirect",
                ],
            ),
            (
                8,
                &["no_nccl", "nccl", "nccl_plan_mismatch", "nccl_same_gpu"],
            ),
            (
                9,
                &[
                    "unknown_room",
                    "room_failed",
                    "aborted",
                    "engine_closed",
                    "layer_order",
                    "room_key_collision",
                ],
            ),
        ];
        assert_eq!(Status::Ok as i32, 0);
        assert_eq!(Status::InProgress as i32, 1);
        let mut placed = std::collections::BTreeSet::new();
        for (hundreds, kinds) in areas {
            assert!(
                doc.iter().any(|d| d.0 == hundreds),
                "-{hundreds}xx undocumented"
            );
            let range = -(hundreds * 100 + 99)..=-(hundreds * 100);
            for k in kinds {
                let s = PdxStatus::ALL
                    .iter()
                    .find(|s| s.kind() == *k)
                    .unwrap_or_else(|| panic!("no status of kind {k}"));
                let c = *s as i32;
                assert!(range.contains(&c), "{k} = {c} outside {range:?}");
                assert!(placed.insert(*k), "{k} listed twice");
            }
        }
        // a new status must be placed in an area here
        for s in PdxStatus::ALL {
            if !matches!(s, Status::Ok | Status::InProgress) {
                assert!(placed.contains(s.kind()), "{} is in no area", s.kind());
            }
        }
        assert_eq!(placed.len() + 2, PdxStatus::ALL.len());
    }

    #[test]
    fn display_has_kind_and_detail() {
        let e = Error::new(Status::PrefixMisaligned, "got 64, need a multiple of 256");
        assert_eq!(
            e.to_string(),
            "prefix_misaligned: got 64, need a multiple of 256"
        );
        assert_eq!(e.kind(), "prefix_misaligned");
        let io: Error = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "x").into();
        assert_eq!(io.status(), Status::PeerUnreachable);
    }
}
