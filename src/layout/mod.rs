//! The layout core: pure functions, no I/O, no threads, no globals.
//!
//! - [`topology`]: one side's parallel topology, pool kind, per-entry geometry
//!   and the DCP ownership rule ([`DcpLayout`]).
//! - [`rank_map`]: which prefill ranks a decode rank talks to (reference 3.1-3.3).
//! - [`cp_transfer`]: what a prefill publishes about its attention CP.
//! - [`cp`]: which prefill CP rank sends which tokens ([`CpSender`]), and the
//!   CP storages a DCP decode refuses.
//! - [`compat`]: whether a prefill rank may send to a decode rank, and how.
//! - [`plan`]: token plans for one chunk and one rank pair, SGLang's and general.
//! - [`pool_geometry`]: where a KV pool's pages lie (page stride, span) and
//!   the page ids the planner addresses for them.
//! - [`runs`]: runs, byte operations per entry, packed layout and pack sizing.
//! - [`chunk`]: splitting a request's send into chunks under a pack limit, and
//!   a chunk's pair into staging slices.

pub mod chunk;
pub mod compat;
pub mod cp;
pub mod cp_transfer;
pub mod dcp_targets;
pub mod plan;
pub mod pool_geometry;
pub mod rank_map;
pub mod runs;
pub mod topology;

pub use chunk::{slice_requests, ChunkSpec, SendChunker};
pub use compat::{check_peer, PeerCompat, TransferMode};
pub use cp::{check_cp_storage, cp_page_bounds, CpSender, CpShare};
pub use cp_transfer::{CpMode, CpStorage, CpTransfer};
pub use dcp_targets::{dcp_targets, DcpTargets};
pub use plan::{
    dcp_token_plan, pairs_with_share, PairRequest, Segment, SglangChunk, Side, TokenPlan,
};
pub use pool_geometry::{side_page_step, PoolGeometry};
pub use rank_map::{prefill_unique_rank, resolve_rank_mapping, MappingOptions, RankMapping};
pub use runs::{
    byte_ops, coalesce_runs, dcp_pack_buffer_bytes, pack_slice_tokens, ByteOp, PackLayout, Run,
};
pub use topology::{DcpLayout, KvDtype, KvEntry, PoolKind, Topology};
