//! The PD session layer: an [`Engine`] per rank, rooms (one per request) and
//! the `KVPoll` state machine, the rank-to-rank control channel.
//!
//! The files, roughly from the bottom up: no two import each other in a circle
//! (`src/architecture.rs` checks it), and besides the re-exports here only
//! `deadline`, `metrics_http` and `setup` import the handle.
//!
//! - `config`: [`EngineConfig`], [`KvPool`], [`AuxBuffer`]; [`control`]:
//!   the control messages and channel; [`room`]: the room table and its
//!   times; `metrics` (its Prometheus text in `metrics/prometheus.rs`),
//!   `telemetry`: the counters and per-room telemetry; `room_grants`: the
//!   rows a room's grant covers (both roles); [`room_keys`]: rooms
//!   named by string keys (request ids) and the keys bound on an engine.
//! - `state`: `Shared`, the state of both roles (configuration, agent,
//!   store, room table, regions, staging, counters) and its lock order.
//! - [`gpu_identity`]: the GPU of an engine's device pools (host and PCI
//!   bus id), carried by the control hello; transport nccl refuses a link
//!   whose ends are one GPU.
//! - `device`: KV pools in CUDA device memory (checks, each worker's GPU
//!   stage, the decode's device writer, the GPUDirect policy).
//! - `path` (`path/mod.rs`): the write path of each link (`WritePath`:
//!   staged, one-copy, device, nccl), chosen when its data connection is set
//!   up (`Conn`), and a pair's plan.
//! - `link`: the links between ranks (`DecodeLink` with its `Conn`,
//!   `PrefillLink`); `flight`: the batches of one chunk in flight (fenced
//!   writes, staging slots).
//! - `path/*`: each path's writes of a chunk's pair as a range of layers
//!   (`staged`, `direct`, `device`, `nccl/`), what a worker writes a chunk
//!   with (`chunk`) and the dispatch (`write`).
//! - `layers`: sends ordered after the caller's compute (a CUDA event or a
//!   ready flag) and the order of layer-wise sends (their checks, the plan
//!   a chunk's layer groups share).
//! - `nccl_link`: transport nccl (device pools on both sides, one NCCL
//!   communicator per link, set up over the control channel): the checks
//!   and the NCCL state of both roles (the prefill's sends are the nccl
//!   write path, `path/nccl/`; the decode's NCCL thread is `decode/nccl.rs`).
//! - `prefill/`: the prefill's state (`Prefill`, its lock order), `sender`
//!   and `send`; `accept`: the control listener and each decode rank's
//!   connection; `jobs`: the job queue; `worker`: the transfer workers.
//! - `decode/`: the decode's state (`Decode`, its lock order), `receiver`
//!   and `send_metadata`; `reader`: the control link to each prefill rank
//!   and its reader; `nccl`: the NCCL thread of each prefill link.
//! - `handle`: the [`Engine`] handle (one role's state), its API: the
//!   role-independent queries, metrics and telemetry, abort, close, and each
//!   role's calls; `deadline`: the deadline thread; `metrics_http`: the
//!   optional `/metrics` responder.
//! - `setup`: `Engine::new` (checks, region registration, threads, bootstrap).
//! - [`synthetic`]: verifiable pools for the demo and tests;
//!   [`gpu_layerwise_bench`] (feature `cuda`): the layer-wise benchmark with
//!   device pools written by kernels (`examples/gpu_check.rs --layerwise`).

mod config;
pub mod control;
mod deadline;
mod decode;
mod device;
mod flight;
pub mod gpu_identity;
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
mod ready_bell;
pub mod room;
mod room_grants;
pub mod room_keys;
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
pub use room_keys::{room_for_key, RoomKeys, MAX_ROOM_KEY_BYTES};
pub use telemetry::RoomTelemetry;
