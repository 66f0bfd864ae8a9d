//! The C ABI version of this library, which the header states
//! (`PDXFER_ABI_VERSION_*`) and `pdxfer_abi_version` returns. Below every
//! layer: `ffi` re-exports it, and the crate root offers it as
//! [`ABI_VERSION_MAJOR`](crate::ABI_VERSION_MAJOR) /
//! [`ABI_VERSION_MINOR`](crate::ABI_VERSION_MINOR).

/// ABI major version of this header; a library with another major refuses to work with it.
pub const PDXFER_ABI_VERSION_MAJOR: u32 = 1;
/// ABI minor version of this header (functions or struct fields added).
/// 1.1: `PdxEngineConfig.state`, `pdxfer_engine_set_state_indices`.
/// 1.2: `PdxEngineConfig.pool_memory` / `pool_device` (KV pools in CUDA memory).
/// 1.3: `pdxfer_set_log_callback`, `pdxfer_engine_decode_prefix_len`,
/// `PdxEngineConfig.metrics_listen`, `pdxfer_engine_metrics`,
/// `pdxfer_engine_metrics_address`, `pdxfer_engine_room_telemetry`.
/// 1.4: `PdxAgentOptions.secret` (peer authentication), `pdxfer_engine_send_ex` /
/// `PdxSendOptions` (event-ordered and layer-wise sends).
/// 1.5: `pdxfer_alloc_shared_pool` / `pdxfer_free_shared_pool` (shared KV
/// pools, one copy on the same host), `PDXFER_ENGINE_NO_ONE_COPY`,
/// `PDXFER_ENGINE_NO_PREFAULT`.
/// 1.6: `PdxTopology.cp_mode` / `cp_storage` and `pdxfer_engine_set_request_pages`
/// (prefill attention CP), `pdxfer_room_for_key` / `pdxfer_engine_bind_room_key`
/// (rooms named by request ids), `PdxKvDtype` 6 (`fp8_ds_mla`).
/// 1.7: `PdxKvPoolDesc` and `PdxEngineConfig.pool_descs` / `num_pool_descs`
/// (KV pools with a page stride); `pdxfer_rank_targets` / `PdxRankTargets` (the
/// prefill ranks a decode rank contacts as lists, gaps included).
pub const PDXFER_ABI_VERSION_MINOR: u32 = 7;
