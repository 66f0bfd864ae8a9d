//! The PD session layer: an [`Engine`] per rank, rooms (one per request) and
//! the `KVPoll` state machine, the rank-to-rank control channel.
//!
//! - `config`: [`EngineConfig`], [`KvPool`], [`AuxBuffer`].
//! - `handle`: the [`Engine`] handle and its shared state (`Inner`, with its
//!   lock order), the queries of both roles, abort and close.
//! - `setup`: `Engine::new` (checks, region registration, threads, bootstrap).
//! - `prefill` / `decode`: each role's API and control plane.
//! - `jobs`: the prefill's job queue (a room's chunks in order, a decode
//!   rank on one worker at a time, so a stalled one delays only its rooms).
//! - `worker`: the prefill's transfer workers and chunk assembly.
//! - `layers`: sends ordered after the caller's compute (a CUDA event or a
//!   ready flag) and layer-wise sends (their checks and per-chunk plans).
//! - `flight`: the batches of one chunk in flight (fenced writes, staging slots).
//! - `staging`: the host staging path (CPU gather into a registered buffer).
//! - `direct`: the one-copy path (rows gathered straight into a same-host
//!   decode rank's mapped pools).
//! - `device`: KV pools in CUDA device memory (GPU staging, the device writer).
//! - `deadline`: the deadline thread.
//! - `nccl_link`: transport nccl (device pools on both sides, one NCCL
//!   communicator per link, set up over the control channel).
//! - `metrics`: the engine's counters and their Prometheus text;
//!   `metrics_http`: the optional `/metrics` responder.
//! - `telemetry`: per-room times and counts.
//! - [`control`], [`room`], [`synthetic`]: control messages, the room table,
//!   verifiable pools for the demo and tests.
//! - [`gpu_layerwise_bench`] (feature `cuda`): the layer-wise benchmark with
//!   device pools written by kernels (`examples/gpu_check.rs --layerwise`).

mod config;
pub mod control;
mod deadline;
mod decode;
mod device;
mod flight;
#[cfg(feature = "cuda")]
pub mod gpu_layerwise_bench;
mod handle;
mod layers;
mod link;
mod metrics;
mod metrics_http;
mod nccl_link;
mod path;
mod prefill;
pub mod room;
mod room_grants;
mod setup;
mod state;
pub mod synthetic;
mod telemetry;
#[cfg(test)]
mod test_rig;

pub use config::{AuxBuffer, EngineConfig, KvPool};
pub use handle::Engine;
pub use layers::{ReadyFlag, SendOptions};
pub use metrics::{
    Histogram, MetricsSnapshot, PeerSnapshot, RoomTotals, LATENCY_BUCKETS, STATE_NAMES,
};
pub use room::{KvPoll, Room, RoomTable, RoomTimes};
pub use telemetry::RoomTelemetry;
