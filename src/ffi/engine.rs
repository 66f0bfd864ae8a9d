//! `PdxEngine`: one rank's prefill or decode transfer engine over the C ABI
//! (rooms with SGLang's `KVPoll` lifecycle; see `engine::Engine`).

use super::pool_desc::PdxKvPoolDesc;
use super::ptr::{self, Versioned};
use super::topology::{topology_from_c, PdxTopology};
use super::{boundary, non_negative, ok, PdxStatus};
use crate::bootstrap::schema::Role;
use crate::engine::{AuxBuffer, Engine, EngineConfig, KvPool, ReadyFlag, SendOptions};
use crate::error::{Error, Result, Status};
use crate::transport::TransportKind;
use std::ffi::{c_char, c_void};
use std::time::Duration;

/// `PdxEngineConfig.role`: the engine sends KV (prefill).
pub const PDXFER_ROLE_PREFILL: u32 = 1;
/// `PdxEngineConfig.role`: the engine receives KV (decode).
pub const PDXFER_ROLE_DECODE: u32 = 2;

/// `PdxEngineConfig.flags`: no staging (pack) buffer; every write goes
/// straight from the prefill pool.
pub const PDXFER_ENGINE_NO_STAGING: u32 = 1;

/// `PdxEngineConfig.flags`: a prefill never copies rows straight into a
/// same-host decode rank's shared KV pools (`pdxfer_alloc_shared_pool`);
/// every write takes the staged path.
pub const PDXFER_ENGINE_NO_ONE_COPY: u32 = 2;

/// `PdxEngineConfig.flags`: a decode does not fault its host KV pools, aux
/// and state buffers in at creation (they fault on first touch instead).
pub const PDXFER_ENGINE_NO_PREFAULT: u32 = 4;

/// `PdxEngineConfig.pool_memory`: the KV pools are host memory (the default,
/// and what structs older than ABI 1.2 mean).
pub const PDXFER_POOL_HOST: u32 = 0;
/// `PdxEngineConfig.pool_memory`: the KV pools are CUDA device memory of
/// device `pool_device` (a decode's pools: not over cma; see `PdxEngineConfig`).
pub const PDXFER_POOL_CUDA: u32 = 1;

/// `KVPoll` values (SGLang's): the room failed; `pdxfer_engine_failure` says why.
pub const PDXFER_POLL_FAILED: i32 = 0;
/// `KVPoll`: waiting for the peers' metadata.
pub const PDXFER_POLL_BOOTSTRAPPING: i32 = 1;
/// `KVPoll`: peers known; waiting for the KV (prefill: to be sent, decode: to arrive).
pub const PDXFER_POLL_WAITING_FOR_INPUT: i32 = 2;
/// `KVPoll`: data is moving.
pub const PDXFER_POLL_TRANSFERRING: i32 = 3;
/// `KVPoll`: every byte landed and was acknowledged.
pub const PDXFER_POLL_SUCCESS: i32 = 4;

/// Opaque engine handle (`pdxfer_engine_create` / `pdxfer_engine_destroy`).
pub struct PdxEngine {
    engine: Engine,
}

/// One KV entry's pool: `num_pages` pages of `page_bytes` at `base`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxKvPool {
    /// Global layer id (the topology entry's).
    pub layer_id: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Start of the pool: host memory, or a CUDA device address with
    /// `PDXFER_POOL_CUDA`.
    pub base: *mut c_void,
    /// Bytes of one page (`page_size * row_bytes` of the entry).
    pub page_bytes: u64,
    /// Pages in the pool.
    pub num_pages: u64,
}

/// One aux buffer: `count` rows of `item_bytes` at `base`; a request uses one row.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxAuxBuffer {
    /// Start of the buffer (host memory).
    pub base: *mut c_void,
    /// Bytes of one row.
    pub item_bytes: u64,
    /// Rows.
    pub count: u64,
}

/// How to create an engine (`pdxfer_engine_create`). Zero fields take the
/// documented defaults.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxEngineConfig {
    /// `sizeof(PdxEngineConfig)`, set by the caller.
    pub struct_size: u64,
    /// `PDXFER_ROLE_PREFILL` or `PDXFER_ROLE_DECODE`.
    pub role: u32,
    /// Data-parallel size (0: 1).
    pub dp_size: u32,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Prefill transfer worker threads (0: 2).
    pub workers: u32,
    /// `PDXFER_ENGINE_*` flags.
    pub flags: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Cluster name in the bootstrap namespace (required).
    pub cluster: *const c_char,
    /// Bootstrap URL, `http://host:port` or `etcd://host:port` (required).
    pub bootstrap: *const c_char,
    /// The cluster secret (at least 16 bytes): guards bootstrap writes and
    /// authenticates every peer connection. NULL reads `PDXFER_CLUSTER_SECRET`;
    /// without either only loopback listeners are allowed (`PDX_STATUS_AUTH_REQUIRED`).
    pub token: *const c_char,
    /// This rank's topology (required); its entries must match `pools`.
    pub topology: *const PdxTopology,
    /// KV pools, one per topology entry, same order.
    pub pools: *const PdxKvPool,
    /// Number of `pools`.
    pub num_pools: u64,
    /// Aux buffers (same count and row sizes on both sides); NULL with 0 for none.
    pub aux: *const PdxAuxBuffer,
    /// Number of `aux`.
    pub num_aux: u64,
    /// Transport for KV data: `"auto"` (NULL), `"cma"`, `"tcp"`, `"local"`, `"rdma"`, `"nccl"` (device pools on both sides).
    pub transport: *const c_char,
    /// Host to listen on (NULL: `127.0.0.1`).
    pub host: *const c_char,
    /// Prefill: bytes of each worker's staging buffer (0: 64 MiB; see `PDXFER_ENGINE_NO_STAGING`).
    pub staging_bytes: u64,
    /// Default room deadline in ms (0: 60 s).
    pub room_timeout_ms: u64,
    /// Deadline of one transfer batch in ms (0: 30 s).
    pub batch_timeout_ms: u64,
    /// Bootstrap lease TTL in ms (0: 10 s).
    pub lease_ttl_ms: u64,
    /// ABI 1.1: optional state buffers (one row per buffer and request, sent
    /// whole to every decode rank after the KV); NULL with 0 for none.
    pub state: *const PdxAuxBuffer,
    /// ABI 1.1: number of `state`.
    pub num_state: u64,
    /// ABI 1.2: where the KV pools live: `PDXFER_POOL_HOST` (0) or
    /// `PDXFER_POOL_CUDA` (device memory of device `pool_device`). The rules
    /// for device pools (transports, staging, what is refused) are in
    /// docs/gpu.md, "KV pools in device memory".
    pub pool_memory: u32,
    /// ABI 1.2: CUDA device ordinal of the pools with `PDXFER_POOL_CUDA`.
    pub pool_device: u32,
    /// ABI 1.3: where to serve the engine's Prometheus text over HTTP
    /// (`GET /metrics`), `"host:port"` (port 0 picks one; read it with
    /// `pdxfer_engine_metrics_address`); NULL serves nothing
    /// (`pdxfer_engine_metrics` still answers). No authentication: keep it
    /// on loopback or a monitoring network.
    pub metrics_listen: *const c_char,
    /// ABI 1.7: the KV pools with their page strides, one per topology
    /// entry, same order, in place of `pools` (which must then be NULL with
    /// 0); NULL with 0 takes `pools`. See `PdxKvPoolDesc`.
    pub pool_descs: *const PdxKvPoolDesc,
    /// ABI 1.7: number of `pool_descs`.
    pub num_pool_descs: u64,
}

// SAFETY: repr(C), starts with u64 struct_size, integers and raw pointers only (zero is valid).
unsafe impl Versioned for PdxEngineConfig {
    /// ABI 1.0 callers (without `state`, the pool memory, `metrics_listen`
    /// and `pool_descs`) are accepted.
    const MIN_SIZE: usize = std::mem::size_of::<PdxEngineConfig>() - 48;
    const NAME: &'static str = "PdxEngineConfig";
}

/// A caller's array of row buffers (aux or state); a NULL base is refused.
fn aux_buffers(p: *const PdxAuxBuffer, n: u64, what: &str) -> Result<Vec<AuxBuffer>> {
    let n = usize::try_from(n).map_err(|_| Error::invalid(format!("{what}: count too large")))?;
    let out = ptr::slice(p, n, what)?
        .iter()
        .map(|a| AuxBuffer {
            base: a.base as u64,
            item_bytes: a.item_bytes,
            count: a.count,
        })
        .collect::<Vec<_>>();
    if let Some((i, _)) = out.iter().enumerate().find(|(_, a)| a.base == 0) {
        return Err(Error::new(
            Status::NullArgument,
            format!("{what}[{i}].base is NULL"),
        ));
    }
    Ok(out)
}

fn ms(v: u64) -> Option<Duration> {
    (v > 0).then(|| Duration::from_millis(v))
}

/// Converts the C config into the engine's.
fn config_from_c(p: *const PdxEngineConfig) -> Result<EngineConfig> {
    let c = ptr::read_versioned(p)?;
    let role = match c.role {
        PDXFER_ROLE_PREFILL => Role::Prefill,
        PDXFER_ROLE_DECODE => Role::Decode,
        r => {
            return Err(Error::invalid(format!(
                "config.role={r}: use PDXFER_ROLE_PREFILL (1) or PDXFER_ROLE_DECODE (2)"
            )))
        }
    };
    if c.flags & !(PDXFER_ENGINE_NO_STAGING | PDXFER_ENGINE_NO_ONE_COPY | PDXFER_ENGINE_NO_PREFAULT)
        != 0
    {
        return Err(Error::invalid(format!(
            "unknown engine flags 0x{:x}",
            c.flags
        )));
    }
    let cluster = ptr::c_str(c.cluster, "config.cluster")?;
    let bootstrap = ptr::c_str(c.bootstrap, "config.bootstrap")?;
    if c.topology.is_null() {
        return Err(Error::new(Status::NullArgument, "config.topology is NULL"));
    }
    let topology = topology_from_c(c.topology)?;
    let n = usize::try_from(c.num_pools).map_err(|_| Error::invalid("num_pools too large"))?;
    let pools = if c.num_pool_descs > 0 {
        if n > 0 {
            return Err(Error::invalid(format!(
                "config has {n} pools and {} pool_descs: give the pools once, as PdxKvPool (pages end to end) or as PdxKvPoolDesc (with a page stride)",
                c.num_pool_descs
            )));
        }
        super::pool_desc::kv_pools(c.pool_descs, c.num_pool_descs)?
    } else {
        ptr::slice(c.pools, n, "config.pools")?
            .iter()
            .map(|p| KvPool {
                layer_id: p.layer_id,
                base: p.base as u64,
                page_bytes: p.page_bytes,
                num_pages: p.num_pages,
                page_stride: p.page_bytes,
            })
            .collect::<Vec<_>>()
    };
    let what = if c.num_pool_descs > 0 {
        "pool_descs"
    } else {
        "pools"
    };
    if let Some((i, _)) = pools.iter().enumerate().find(|(_, p)| p.base == 0) {
        return Err(Error::new(
            Status::NullArgument,
            format!("config.{what}[{i}].base is NULL"),
        ));
    }
    let aux = aux_buffers(c.aux, c.num_aux, "config.aux")?;
    let state = aux_buffers(c.state, c.num_state, "config.state")?;
    let mut cfg = EngineConfig::new(role, cluster, bootstrap, topology, pools);
    cfg.token = ptr::opt_c_str(c.token, "config.token")?.map(str::to_string);
    cfg.aux = aux;
    cfg.state = state;
    if c.dp_size > 0 {
        cfg.dp_size = c.dp_size;
    }
    if c.dp_rank >= cfg.dp_size {
        return Err(Error::invalid(format!(
            "config.dp_rank={} is not below dp_size={}",
            c.dp_rank, cfg.dp_size
        )));
    }
    cfg.dp_rank = c.dp_rank;
    if c.workers > 0 {
        cfg.workers = c.workers as usize;
    }
    if let Some(t) = ptr::opt_c_str(c.transport, "config.transport")? {
        cfg.transport = TransportKind::parse(t)?;
    }
    if let Some(h) = ptr::opt_c_str(c.host, "config.host")? {
        cfg.host = h.to_string();
    }
    cfg.one_copy = c.flags & PDXFER_ENGINE_NO_ONE_COPY == 0;
    cfg.prefault = c.flags & PDXFER_ENGINE_NO_PREFAULT == 0;
    if c.flags & PDXFER_ENGINE_NO_STAGING != 0 {
        cfg.staging_bytes = 0;
    } else if c.staging_bytes > 0 {
        cfg.staging_bytes = c.staging_bytes;
    }
    if let Some(d) = ms(c.room_timeout_ms) {
        cfg.room_timeout = d;
    }
    if let Some(d) = ms(c.batch_timeout_ms) {
        cfg.batch_timeout = d;
    }
    if let Some(d) = ms(c.lease_ttl_ms) {
        cfg.lease_ttl = d;
    }
    cfg.metrics_listen =
        ptr::opt_c_str(c.metrics_listen, "config.metrics_listen")?.map(str::to_string);
    cfg.pool_device = match c.pool_memory {
        PDXFER_POOL_HOST => None,
        PDXFER_POOL_CUDA => Some(c.pool_device),
        m => {
            return Err(Error::invalid(format!(
                "config.pool_memory={m}: use PDXFER_POOL_HOST (0) or PDXFER_POOL_CUDA (1)"
            )))
        }
    };
    Ok(cfg)
}

pub(super) fn eng<'a>(p: *const PdxEngine) -> Result<&'a Engine> {
    ptr::handle(p, "engine").map(|e| &e.engine)
}

fn pages(p: *const i64, n: usize, what: &str) -> Result<Vec<u64>> {
    ptr::slice(p, n, what)?
        .iter()
        .enumerate()
        .map(|(i, &v)| non_negative(v, &format!("{what}[{i}]")))
        .collect()
}

/// Creates an engine: registers the pools and aux buffers, starts its threads
/// and registers the rank with the bootstrap. `*out` receives the handle.
///
/// Every pool and aux buffer must stay valid, writable host memory until
/// `pdxfer_engine_destroy` returns (peers write into decode pools; the
/// prefill reads its pools from its worker threads). With
/// `PDXFER_POOL_CUDA` the pools are device memory instead, and a chunk's
/// rows must be complete on the device (forward pass synchronised) before
/// `pdxfer_engine_send` queues it.
#[no_mangle]
pub extern "C" fn pdxfer_engine_create(
    config: *const PdxEngineConfig,
    out: *mut *mut PdxEngine,
) -> PdxStatus {
    boundary(|| {
        ptr::check_out(out, "out")?;
        let cfg = config_from_c(config)?;
        // SAFETY: the caller keeps the pool and aux memory valid until destroy (documented contract above).
        let engine = unsafe { Engine::new(cfg) }?;
        ptr::new_handle(PdxEngine { engine }, out, "out")?;
        ok()
    })
}

/// Deregisters the rank, stops the engine's threads and frees the handle.
/// NULL is a no-op. The handle must not be used afterwards.
///
/// Threads: every other call on the same `PdxEngine` may run concurrently with the others,
/// from any thread. This one may not race any of them: it frees the handle,
/// so no call on the same `PdxEngine` may be in flight when it starts, and none may start
/// after it. (The Python package enforces this: its `Engine.close()` waits for the
/// calls in flight and refuses later ones with a typed error.)
#[no_mangle]
pub extern "C" fn pdxfer_engine_destroy(engine: *mut PdxEngine) -> PdxStatus {
    boundary(|| {
        if let Some(e) = ptr::take_handle(engine) {
            e.engine.close();
        }
        ok()
    })
}

/// Prefill: opens room `room` (SGLang's `bootstrap_room`). It polls
/// `PDXFER_POLL_WAITING_FOR_INPUT` once every decode rank targeting this
/// rank sent its metadata. A room id still live is refused.
#[no_mangle]
pub extern "C" fn pdxfer_engine_sender(engine: *const PdxEngine, room: u64) -> PdxStatus {
    boundary(|| {
        eng(engine)?.sender(room)?;
        ok()
    })
}

/// Prefill: queues one chunk of the request: this rank's `num_pages` page ids
/// holding `num_tokens` tokens (only the last chunk may end in a partial
/// page). `last` (0/1) marks the final chunk, after which the aux row
/// `aux_index` is sent. With prefill DCP the pages are this rank's local
/// pages. Pages outside the pool fail with `PDX_STATUS_OUT_OF_BOUNDS` and
/// nothing is queued. `pages` is not retained.
#[no_mangle]
pub extern "C" fn pdxfer_engine_send(
    engine: *const PdxEngine,
    room: u64,
    pages: *const i64,
    num_pages: usize,
    num_tokens: u64,
    last: u32,
    aux_index: u64,
) -> PdxStatus {
    boundary(|| {
        let e = eng(engine)?;
        let pg = self::pages(pages, num_pages, "pages")?;
        if last > 1 {
            return Err(Error::invalid(format!("last must be 0 or 1, got {last}")));
        }
        e.send(room, &pg, num_tokens, last == 1, aux_index)?;
        ok()
    })
}

/// Options of `pdxfer_engine_send_ex`. Zero fields take the defaults: aux
/// row 0, no event, no flag, every layer.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxSendOptions {
    /// `sizeof(PdxSendOptions)`, set by the caller.
    pub struct_size: u64,
    /// The aux row sent after the last chunk (as `pdxfer_engine_send`'s `aux_index`).
    pub aux_index: u64,
    /// Device pools: a `CUevent` handle (0: none) recorded after the kernels
    /// that wrote the rows. A wrapper taking event objects must refuse one
    /// whose handle is still 0 (a `torch.cuda.Event` never recorded) rather
    /// than pass it: 0 sends with no ordering. The engine's stream waits on it
    /// (`cuStreamWaitEvent`) before gathering; the caller never synchronises.
    /// The event must not be destroyed before the room is terminal. Host
    /// pools refuse it (`PDX_STATUS_INVALID_ARGUMENT`): use `ready_flag`.
    pub cuda_event: u64,
    /// Host pools (or either): the address of an 8-byte aligned `uint64_t`
    /// (NULL: none) that the caller sets non-zero, with release ordering
    /// (`__atomic_store_n(flag, 1, __ATOMIC_RELEASE)`), once the rows are
    /// written; a transfer worker waits for it before reading them. It must
    /// stay valid until the room is terminal.
    pub ready_flag: *const u64,
    /// Layer-wise: the first layer (topology entry, by position) of the send.
    pub first_layer: u32,
    /// Layer-wise: the number of layers (0 with `first_layer` 0: every layer).
    /// A chunk's layers come in order over many calls with the same pages,
    /// `num_tokens`, `last` and `aux_index`; out-of-order, repeated and
    /// missing layers are `PDX_STATUS_LAYER_ORDER` and queue nothing.
    pub num_layers: u32,
    /// Reserved, zero.
    pub flags: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

// SAFETY: repr(C), starts with u64 struct_size, integers and a raw pointer only (zero is valid).
unsafe impl Versioned for PdxSendOptions {
    const MIN_SIZE: usize = std::mem::size_of::<PdxSendOptions>();
    const NAME: &'static str = "PdxSendOptions";
}

fn send_options(options: *const PdxSendOptions) -> Result<(u64, SendOptions)> {
    if options.is_null() {
        return Ok((0, SendOptions::default()));
    }
    let o = ptr::read_versioned(options)?;
    if o.flags != 0 || o.reserved != 0 {
        return Err(Error::invalid(format!(
            "PdxSendOptions: flags and reserved must be 0, got 0x{:x} and 0x{:x}",
            o.flags, o.reserved
        )));
    }
    let layers = match (o.first_layer, o.num_layers) {
        (0, 0) => None,
        (f, 0) => {
            return Err(Error::invalid(format!(
                "PdxSendOptions: num_layers is 0 with first_layer {f}"
            )))
        }
        (f, n) => Some(
            f..f.checked_add(n).ok_or_else(|| {
                Error::invalid("PdxSendOptions: first_layer + num_layers overflows")
            })?,
        ),
    };
    let ready_flag = if o.ready_flag.is_null() {
        None
    } else if !(o.ready_flag as usize).is_multiple_of(8) {
        return Err(Error::invalid(
            "PdxSendOptions.ready_flag must be an 8-byte aligned uint64_t",
        ));
    } else {
        // SAFETY: aligned and non-NULL; the caller keeps it valid until the room
        // is terminal and writes it atomically (documented on the field).
        Some(unsafe { ReadyFlag::from_raw(o.ready_flag.cast()) })
    };
    Ok((
        o.aux_index,
        SendOptions {
            cuda_event: (o.cuda_event != 0).then_some(o.cuda_event),
            ready_flag,
            layers,
        },
    ))
}

/// Prefill: `pdxfer_engine_send` with options (NULL: the defaults): ordered
/// after a CUDA event (device pools) or a ready flag (host pools) instead of
/// needing complete rows, and/or for a range of layers only (a chunk sent
/// layer by layer over many calls; the decode sees one completion after all
/// layers and the aux/state rows landed). A refused call queues nothing.
#[no_mangle]
pub extern "C" fn pdxfer_engine_send_ex(
    engine: *const PdxEngine,
    room: u64,
    pages: *const i64,
    num_pages: usize,
    num_tokens: u64,
    last: u32,
    options: *const PdxSendOptions,
) -> PdxStatus {
    boundary(|| {
        let e = eng(engine)?;
        let pg = self::pages(pages, num_pages, "pages")?;
        if last > 1 {
            return Err(Error::invalid(format!("last must be 0 or 1, got {last}")));
        }
        let (aux_index, opts) = send_options(options)?;
        e.send_with(room, &pg, num_tokens, last == 1, aux_index, &opts)?;
        ok()
    })
}

/// Decode: opens room `room` against the prefill instance's data-parallel
/// group `prefill_dp`: finds the prefill ranks in the bootstrap, connects and
/// re-checks each (a layout mismatch, e.g. a DCP rank pairing with the wrong
/// prefill rank, fails here with its typed status). `timeout_ms` 0 takes the
/// engine's room timeout.
#[no_mangle]
pub extern "C" fn pdxfer_engine_receiver(
    engine: *const PdxEngine,
    room: u64,
    prefill_dp: u32,
    timeout_ms: u64,
) -> PdxStatus {
    boundary(|| {
        eng(engine)?.receiver(room, prefill_dp, ms(timeout_ms))?;
        ok()
    })
}

/// Decode: tells the room's prefill ranks where its KV goes: the virtual page
/// ids `dst_pages` (the same list on every DCP rank), the decode prefix
/// already held (`decode_prefix_len`, a multiple of `page_size * dcp_size`)
/// and the aux row. Nothing is sent when an argument is bad. `dst_pages` is not retained.
#[no_mangle]
pub extern "C" fn pdxfer_engine_send_metadata(
    engine: *const PdxEngine,
    room: u64,
    dst_pages: *const i64,
    num_dst_pages: usize,
    decode_prefix_len: u64,
    aux_index: u64,
) -> PdxStatus {
    boundary(|| {
        let e = eng(engine)?;
        let pg = pages(dst_pages, num_dst_pages, "dst_pages")?;
        e.send_metadata(room, &pg, decode_prefix_len, aux_index)?;
        ok()
    })
}

/// Writes the room's `KVPoll` value (`PDXFER_POLL_*`) to `*out_poll`;
/// an unknown room polls `PDXFER_POLL_FAILED`, as in SGLang.
#[no_mangle]
pub extern "C" fn pdxfer_engine_poll(
    engine: *const PdxEngine,
    room: u64,
    out_poll: *mut i32,
) -> PdxStatus {
    boundary(|| {
        let p = eng(engine)?.poll(room);
        ptr::write_out(out_poll, p as i32, "out_poll")?;
        ok()
    })
}

/// Waits up to `timeout_ms` for the room to reach `SUCCESS` or `FAILED` and
/// writes its state then to `*out_poll` (not terminal when the time ran out).
#[no_mangle]
pub extern "C" fn pdxfer_engine_wait(
    engine: *const PdxEngine,
    room: u64,
    timeout_ms: u64,
    out_poll: *mut i32,
) -> PdxStatus {
    boundary(|| {
        let e = eng(engine)?;
        ptr::check_out(out_poll, "out_poll")?;
        let p = e.wait(room, Duration::from_millis(timeout_ms));
        ptr::write_out(out_poll, p as i32, "out_poll")?;
        ok()
    })
}

/// The room's failure: its status code goes to `*out_status` (`PDX_STATUS_OK`
/// when it has not failed; `PDX_STATUS_UNKNOWN_ROOM` for an unknown room) and
/// its detail text, NUL-terminated, into `buf` of `capacity` bytes, with the
/// needed size in `*out_len` (NULL buffer and capacity 0: size query). A
/// failure met on a worker thread is kept on the room and read here.
#[no_mangle]
pub extern "C" fn pdxfer_engine_failure(
    engine: *const PdxEngine,
    room: u64,
    out_status: *mut i32,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let f = eng(engine)?.failure(room);
        let (st, text) = match &f {
            Some(e) => (e.status() as i32, e.detail()),
            None => (Status::Ok as i32, ""),
        };
        ptr::write_out(out_status, st, "out_status")?;
        ptr::fill_str(text, buf, capacity, out_len, "buf")
    })
}

/// Aborts the room. Writes 1 to `*out_fenced` (may be NULL) when no write for
/// it can still land in local memory; otherwise poll `pdxfer_engine_is_fenced`
/// before reusing its pages.
#[no_mangle]
pub extern "C" fn pdxfer_engine_abort(
    engine: *const PdxEngine,
    room: u64,
    out_fenced: *mut u32,
) -> PdxStatus {
    boundary(|| {
        let e = eng(engine)?;
        if !out_fenced.is_null() {
            ptr::check_out(out_fenced, "out_fenced")?;
        }
        let f = e.abort(room)?;
        if !out_fenced.is_null() {
            ptr::write_out(out_fenced, u32::from(f), "out_fenced")?;
        }
        ok()
    })
}

/// Writes 1 to `*out_fenced` when no write for the room can still land in
/// local memory (decode: every live prefill rank acknowledged the abort), else 0.
#[no_mangle]
pub extern "C" fn pdxfer_engine_is_fenced(
    engine: *const PdxEngine,
    room: u64,
    out_fenced: *mut u32,
) -> PdxStatus {
    boundary(|| {
        let f = eng(engine)?.is_fenced(room);
        ptr::write_out(out_fenced, u32::from(f), "out_fenced")?;
        ok()
    })
}

/// Sets the room's state rows, one per configured state buffer (ABI 1.1):
/// on the prefill the rows sent with the last chunk (call before it), on the
/// decode the rows they land in (call before `pdxfer_engine_send_metadata`).
#[no_mangle]
pub extern "C" fn pdxfer_engine_set_state_indices(
    engine: *const PdxEngine,
    room: u64,
    rows: *const i64,
    num_rows: usize,
) -> PdxStatus {
    boundary(|| {
        let rows = ptr::slice(rows, num_rows, "rows")?
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                u64::try_from(v).map_err(|_| Error::invalid(format!("rows[{i}] = {v} is negative")))
            })
            .collect::<Result<Vec<u64>>>()?;
        eng(engine)?.set_state_indices(room, &rows)?;
        ok()
    })
}

/// Prefill: the request's page count after the decode prefix (SGLang's
/// `num_kv_indices`), before its first chunk (ABI 1.6). An attention CP rank
/// in all-CP-ranks mode (`PdxTopology.cp_mode`) sends only its share of the
/// pages and needs it; elsewhere it is kept and unused.
#[no_mangle]
pub extern "C" fn pdxfer_engine_set_request_pages(
    engine: *const PdxEngine,
    room: u64,
    total_pages: u64,
) -> PdxStatus {
    boundary(|| {
        eng(engine)?.set_request_pages(room, total_pages)?;
        ok()
    })
}

/// Forgets a terminal room so its id can be reused (refused while writes for
/// it are in flight, and for a live room).
#[no_mangle]
pub extern "C" fn pdxfer_engine_clear(engine: *const PdxEngine, room: u64) -> PdxStatus {
    boundary(|| {
        eng(engine)?.clear(room)?;
        ok()
    })
}

/// Decode: bytes received so far for the room (from the prefill ranks'
/// completion records) into `*out_bytes`.
#[no_mangle]
pub extern "C" fn pdxfer_engine_room_bytes(
    engine: *const PdxEngine,
    room: u64,
    out_bytes: *mut u64,
) -> PdxStatus {
    boundary(|| {
        let b = eng(engine)?.room_bytes(room);
        ptr::write_out(out_bytes, b, "out_bytes")?;
        ok()
    })
}

/// Prefill: the decode prefix length the decode ranks sent for the room into
/// `*out_len` and 1 into `*out_known` once their metadata has arrived; 0 and 0
/// before (and for an unknown room). A dummy attention CP rank (rank-0 mode,
/// CP rank != 0), which no decode rank contacts, answers 0 and 1 at once.
#[no_mangle]
pub extern "C" fn pdxfer_engine_decode_prefix_len(
    engine: *const PdxEngine,
    room: u64,
    out_len: *mut u64,
    out_known: *mut u32,
) -> PdxStatus {
    boundary(|| {
        let p = eng(engine)?.decode_prefix_len(room);
        ptr::write_out(out_len, p.unwrap_or(0), "out_len")?;
        ptr::write_out(out_known, u32::from(p.is_some()), "out_known")?;
        ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::{BootstrapServer, ServerConfig};
    use crate::engine::synthetic::SyntheticPools;
    use crate::engine::KvPoll;
    use crate::layout::{DcpLayout, Side};
    use std::ffi::{CStr, CString};
    use std::ptr::{null, null_mut};

    /// In C a `cuda_event` of 0 is "no event" (zero is every field's
    /// default), any other value the handle; an event object with no handle
    /// yet is refused by the wrapper that sees the object (Python's
    /// `_event_handle`), since only it knows an event was meant.
    #[test]
    fn a_zero_cuda_event_is_no_event() {
        let mut o = PdxSendOptions {
            struct_size: std::mem::size_of::<PdxSendOptions>() as u64,
            aux_index: 3,
            cuda_event: 0,
            ready_flag: null(),
            first_layer: 0,
            num_layers: 0,
            flags: 0,
            reserved: 0,
        };
        let (aux, opts) = send_options(&o).unwrap();
        assert_eq!((aux, opts.cuda_event), (3, None));
        o.cuda_event = 0x7f00;
        assert_eq!(send_options(&o).unwrap().1.cuda_event, Some(0x7f00));
    }

    #[test]
    fn struct_sizes_are_pinned() {
        use std::mem::size_of;
        assert_eq!(size_of::<PdxKvPool>(), 32);
        assert_eq!(size_of::<PdxAuxBuffer>(), 24);
        assert_eq!(size_of::<PdxEngineConfig>(), 192);
        for p in [
            KvPoll::Failed,
            KvPoll::Bootstrapping,
            KvPoll::WaitingForInput,
            KvPoll::Transferring,
            KvPoll::Success,
        ] {
            let c = [
                PDXFER_POLL_FAILED,
                PDXFER_POLL_BOOTSTRAPPING,
                PDXFER_POLL_WAITING_FOR_INPUT,
                PDXFER_POLL_TRANSFERRING,
                PDXFER_POLL_SUCCESS,
            ];
            assert_eq!(c[p as usize], p as i32);
        }
    }

    /// C-side views of a synthetic pool set; the arrays must outlive the call.
    struct CSide {
        ids: Vec<u32>,
        rows: Vec<u64>,
        pools: Vec<PdxKvPool>,
        aux: Vec<PdxAuxBuffer>,
        topo: PdxTopology,
    }

    fn c_side(p: &SyntheticPools, dcp: u32, rank: u32) -> Box<CSide> {
        let t = p.topology(dcp, rank);
        let mut s = Box::new(CSide {
            ids: t.entries.iter().map(|e| e.layer_id).collect(),
            rows: t.entries.iter().map(|e| e.row_bytes).collect(),
            pools: p
                .kv_pools()
                .iter()
                .map(|k| PdxKvPool {
                    layer_id: k.layer_id,
                    reserved: 0,
                    base: k.base as *mut c_void,
                    page_bytes: k.page_bytes,
                    num_pages: k.num_pages,
                })
                .collect(),
            aux: p
                .aux_buffers()
                .iter()
                .map(|a| PdxAuxBuffer {
                    base: a.base as *mut c_void,
                    item_bytes: a.item_bytes,
                    count: a.count,
                })
                .collect(),
            topo: PdxTopology {
                struct_size: std::mem::size_of::<PdxTopology>() as u64,
                engine_rank: t.engine_rank,
                attn_tp_size: t.attn_tp_size,
                attn_tp_rank: t.attn_tp_rank,
                attn_cp_size: 1,
                attn_cp_rank: 0,
                pp_size: 1,
                pp_rank: 0,
                dcp_size: t.dcp_size,
                dcp_rank: t.dcp_rank,
                dcp_interleave: 1,
                page_size: t.page_size,
                kv_dtype: 1,
                pool_kind: 0,
                reserved: 0,
                num_entries: t.entries.len() as u64,
                entry_layer_ids: null(),
                entry_row_bytes: null(),
                cp_mode: 0,
                cp_storage: 0,
            },
        });
        s.topo.entry_layer_ids = s.ids.as_ptr();
        s.topo.entry_row_bytes = s.rows.as_ptr();
        s
    }

    fn config(
        s: &CSide,
        role: u32,
        cluster: &CStr,
        url: &CStr,
        transport: &CStr,
    ) -> PdxEngineConfig {
        PdxEngineConfig {
            struct_size: std::mem::size_of::<PdxEngineConfig>() as u64,
            role,
            dp_size: 0,
            dp_rank: 0,
            workers: 0,
            flags: 0,
            reserved: 0,
            cluster: cluster.as_ptr(),
            bootstrap: url.as_ptr(),
            token: null(),
            topology: &s.topo,
            pools: s.pools.as_ptr(),
            num_pools: s.pools.len() as u64,
            aux: s.aux.as_ptr(),
            num_aux: s.aux.len() as u64,
            transport: transport.as_ptr(),
            host: null(),
            staging_bytes: 1 << 20,
            room_timeout_ms: 20_000,
            batch_timeout_ms: 0,
            lease_ttl_ms: 0,
            state: std::ptr::null(),
            num_state: 0,
            pool_memory: PDXFER_POOL_HOST,
            pool_device: 0,
            metrics_listen: null(),
            pool_descs: null(),
            num_pool_descs: 0,
        }
    }

    /// ABI 1.7 pool descriptions: read from a 1.7 struct (their strides
    /// reach the engine's pools), ignored in a 1.6 one (176 bytes: whatever
    /// follows is not the caller's).
    #[test]
    fn pool_descs_are_versioned() {
        let p = SyntheticPools::new(2, 64, 16, 4, 1, 32).unwrap();
        let s = c_side(&p, 1, 0);
        let (cl, url, tr) = (c"pd", c"http://127.0.0.1:1", c"tcp");
        let descs: Vec<PdxKvPoolDesc> = s
            .pools
            .iter()
            .map(|k| PdxKvPoolDesc {
                struct_size: std::mem::size_of::<PdxKvPoolDesc>() as u64,
                layer_id: k.layer_id,
                flags: 0,
                base: k.base,
                page_bytes: k.page_bytes,
                page_stride: 2 * k.page_bytes,
                num_pages: 2,
            })
            .collect();
        let mut c = config(&s, PDXFER_ROLE_DECODE, cl, url, tr);
        c.pools = null();
        c.num_pools = 0;
        c.pool_descs = descs.as_ptr();
        c.num_pool_descs = descs.len() as u64;
        let cfg = config_from_c(&c).unwrap();
        assert_eq!(cfg.pools.len(), 2);
        assert!(cfg
            .pools
            .iter()
            .all(|k| k.page_stride == 2 * k.page_bytes && k.num_pages == 2));
        // both arrays, or a NULL base: refused
        let mut both = c;
        both.pools = s.pools.as_ptr();
        both.num_pools = s.pools.len() as u64;
        let e = config_from_c(&both).map(|_| ()).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument, "{e}");
        let mut null_base = descs.clone();
        null_base[1].base = std::ptr::null_mut();
        let mut cn = c;
        cn.pool_descs = null_base.as_ptr();
        let e = config_from_c(&cn).map(|_| ()).unwrap_err();
        assert_eq!(e.status(), Status::NullArgument, "{e}");
        assert!(e.detail().contains("pool_descs[1]"), "{e}");
        // a 1.6 caller: the pools as PdxKvPool, nothing past 176 bytes read
        let mut old = config(&s, PDXFER_ROLE_DECODE, cl, url, tr);
        old.struct_size = 176;
        old.pool_descs = descs.as_ptr();
        old.num_pool_descs = 99;
        let cfg = config_from_c(&old).unwrap();
        assert!(cfg.pools.iter().all(|k| k.page_stride == k.page_bytes));
    }

    /// ABI 1.2 pool memory: older, smaller structs mean host pools whatever
    /// follows them; CUDA pools are read; unknown values are refused; a decode
    /// with CUDA pools over cma is refused at creation with its typed status,
    /// over tcp it is accepted up to the driver check.
    #[test]
    fn pool_memory_is_versioned() {
        let p = SyntheticPools::new(2, 64, 16, 4, 1, 32).unwrap();
        let s = c_side(&p, 1, 0);
        let (cl, url, tr) = (c"pm", c"http://127.0.0.1:1", c"cma");
        let mut c = config(&s, PDXFER_ROLE_PREFILL, cl, url, tr);
        c.pool_memory = PDXFER_POOL_CUDA;
        c.pool_device = 3;
        assert_eq!(config_from_c(&c).unwrap().pool_device, Some(3));
        for old in [144u64, 160] {
            c.struct_size = old;
            assert_eq!(config_from_c(&c).unwrap().pool_device, None, "size {old}");
        }
        // ABI 1.3 metrics_listen: read from a 1.3 struct, not from a 1.2 one
        c.metrics_listen = c"127.0.0.1:0".as_ptr();
        c.struct_size = 168;
        let old = config_from_c(&c).unwrap();
        assert_eq!((old.pool_device, old.metrics_listen), (Some(3), None));
        c.struct_size = std::mem::size_of::<PdxEngineConfig>() as u64;
        let new = config_from_c(&c).unwrap();
        assert_eq!(new.metrics_listen.as_deref(), Some("127.0.0.1:0"));
        c.metrics_listen = std::ptr::null();
        c.struct_size = 136;
        assert_eq!(config_from_c(&c).unwrap_err().status(), Status::AbiMismatch);
        c.struct_size = std::mem::size_of::<PdxEngineConfig>() as u64;
        c.pool_memory = 2;
        assert_eq!(
            config_from_c(&c).unwrap_err().status(),
            Status::InvalidArgument
        );
        let mut d = config(&s, PDXFER_ROLE_DECODE, cl, url, tr);
        d.pool_memory = PDXFER_POOL_CUDA;
        let mut out = null_mut();
        assert_eq!(pdxfer_engine_create(&d, &mut out), PdxStatus::Unsupported);
        assert!(out.is_null());
        // Over tcp a decode may have CUDA pools: what stops it here is the
        // driver check (no driver, or host memory that is not a CUDA
        // allocation), or the build without the `cuda` feature.
        let mut d = config(&s, PDXFER_ROLE_DECODE, cl, url, c"tcp");
        d.pool_memory = PDXFER_POOL_CUDA;
        let st = pdxfer_engine_create(&d, &mut out);
        assert!(out.is_null());
        if cfg!(feature = "cuda") {
            assert!(
                matches!(
                    st,
                    PdxStatus::NoCudaDriver | PdxStatus::Cuda | PdxStatus::InvalidArgument
                ),
                "{st:?}"
            );
        } else {
            assert_eq!(st, PdxStatus::Unsupported);
        }
    }

    fn failure(e: *const PdxEngine, room: u64) -> (i32, String) {
        let mut st = 0i32;
        let mut need = 0usize;
        assert_eq!(
            pdxfer_engine_failure(e, room, &mut st, null_mut(), 0, &mut need),
            PdxStatus::Ok
        );
        let mut buf = vec![0 as c_char; need];
        assert_eq!(
            pdxfer_engine_failure(e, room, &mut st, buf.as_mut_ptr(), need, &mut need),
            PdxStatus::Ok
        );
        // SAFETY: the library wrote a NUL-terminated string into buf.
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
        (st, s.to_string_lossy().into_owned())
    }

    /// A request 1 -> 2 over the C ABI, chunked with a prefix, verified byte
    /// for byte; then the bad inputs of every export.
    #[test]
    fn prefill_to_two_decode_ranks_and_bad_inputs() {
        let server = BootstrapServer::start(ServerConfig::default()).unwrap();
        let url = CString::new(server.url()).unwrap();
        let cluster = CString::new("ffi-engine").unwrap();
        let cma = CString::new("cma").unwrap();
        let (p, rows, layers) = (16u64, 64u64, 2u32);
        let mut pp = SyntheticPools::new(layers, rows, p, 32, 4, 32).unwrap();
        let ps = c_side(&pp, 1, 0);
        let mut pe = null_mut();
        let pc = config(&ps, PDXFER_ROLE_PREFILL, &cluster, &url, &cma);
        assert_eq!(pdxfer_engine_create(&pc, &mut pe), PdxStatus::Ok);
        let dpools: Vec<SyntheticPools> = (0..2)
            .map(|_| SyntheticPools::new(layers, rows, p, 16, 4, 32).unwrap())
            .collect();
        let dsides: Vec<_> = (0..2).map(|r| c_side(&dpools[r], 2, r as u32)).collect();
        let mut de = vec![null_mut(); 2];
        for r in 0..2 {
            let c = config(&dsides[r], PDXFER_ROLE_DECODE, &cluster, &url, &cma);
            assert_eq!(pdxfer_engine_create(&c, &mut de[r]), PdxStatus::Ok);
        }

        let (room, total, prefix) = (7u64, 150u64, 32u64);
        let src: Vec<i64> = vec![3, 9, 1, 20, 5, 11, 30, 2];
        let dst: Vec<i64> = vec![4, 1, 9, 12];
        let src_u: Vec<u64> = src.iter().map(|&x| x as u64).collect();
        let dst_u: Vec<u64> = dst.iter().map(|&x| x as u64).collect();
        pp.fill(
            room,
            &Side {
                layout: DcpLayout::sglang(p, 1).unwrap(),
                rank: 0,
                pages: &src_u,
                origin: prefix,
            },
            total,
        );
        pp.fill_aux(room, 2);
        for &d in &de {
            assert_eq!(pdxfer_engine_receiver(d, room, 0, 0), PdxStatus::Ok);
            assert_eq!(
                pdxfer_engine_send_metadata(d, room, dst.as_ptr(), dst.len(), prefix, 1),
                PdxStatus::Ok
            );
        }
        assert_eq!(pdxfer_engine_sender(pe, room), PdxStatus::Ok);
        let mut poll = -1;
        for _ in 0..2000 {
            assert_eq!(pdxfer_engine_poll(pe, room, &mut poll), PdxStatus::Ok);
            if poll != PDXFER_POLL_BOOTSTRAPPING {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(poll, PDXFER_POLL_WAITING_FOR_INPUT);
        let (mut plen, mut known) = (u64::MAX, 9u32);
        assert_eq!(
            pdxfer_engine_decode_prefix_len(pe, room, &mut plen, &mut known),
            PdxStatus::Ok
        );
        assert_eq!(
            (plen, known),
            (prefix, 1),
            "the prefix the decode ranks sent"
        );
        assert_eq!(
            pdxfer_engine_decode_prefix_len(pe, room + 1000, &mut plen, &mut known),
            PdxStatus::Ok
        );
        assert_eq!((plen, known), (0, 0), "no metadata for an unknown room");
        assert_eq!(
            pdxfer_engine_decode_prefix_len(pe, room, null_mut(), &mut known),
            PdxStatus::NullArgument
        );
        assert_eq!(
            pdxfer_engine_decode_prefix_len(null(), room, &mut plen, &mut known),
            PdxStatus::NullArgument
        );
        // 118 tokens: 5 full pages, then 3 pages holding 38
        assert_eq!(
            pdxfer_engine_send(pe, room, src.as_ptr(), 5, 80, 0, 2),
            PdxStatus::Ok
        );
        assert_eq!(
            pdxfer_engine_send(pe, room, src[5..].as_ptr(), 3, 38, 1, 2),
            PdxStatus::Ok
        );
        assert_eq!(
            pdxfer_engine_wait(pe, room, 20_000, &mut poll),
            PdxStatus::Ok
        );
        assert_eq!(poll, PDXFER_POLL_SUCCESS, "{:?}", failure(pe, room));
        for (r, &d) in de.iter().enumerate() {
            assert_eq!(
                pdxfer_engine_wait(d, room, 20_000, &mut poll),
                PdxStatus::Ok
            );
            assert_eq!(poll, PDXFER_POLL_SUCCESS, "{:?}", failure(d, room));
            let side = Side {
                layout: DcpLayout::sglang(p, 2).unwrap(),
                rank: r as u64,
                pages: &dst_u,
                origin: prefix,
            };
            let got = dpools[r].verify(room, &side, total, Some(1)).unwrap();
            assert_eq!(got, 59 * rows * layers as u64 + 32);
            let mut bytes = 0;
            assert_eq!(pdxfer_engine_room_bytes(d, room, &mut bytes), PdxStatus::Ok);
            assert_eq!(
                bytes,
                59 * rows * layers as u64,
                "KV bytes (aux not counted)"
            );
            assert_eq!(failure(d, room), (0, String::new()));
            assert_eq!(pdxfer_engine_clear(d, room), PdxStatus::Ok);
        }
        assert_eq!(pdxfer_engine_clear(pe, room), PdxStatus::Ok);

        // bad inputs: typed statuses, nothing written
        let d0 = de[0];
        assert_eq!(
            pdxfer_engine_send(pe, 99, src.as_ptr(), 1, 16, 1, 0),
            PdxStatus::UnknownRoom
        );
        assert_eq!(pdxfer_engine_poll(pe, 99, &mut poll), PdxStatus::Ok);
        assert_eq!(poll, PDXFER_POLL_FAILED);
        let (st, text) = failure(pe, 99);
        assert_eq!(st, PdxStatus::UnknownRoom as i32);
        assert!(text.contains("99"), "{text}");
        assert_eq!(pdxfer_engine_receiver(d0, 8, 0, 0), PdxStatus::Ok);
        let far = [16i64];
        assert_eq!(
            pdxfer_engine_send_metadata(d0, 8, far.as_ptr(), 1, 0, 0),
            PdxStatus::OutOfBounds
        );
        let neg = [-1i64];
        assert_eq!(
            pdxfer_engine_send_metadata(d0, 8, neg.as_ptr(), 1, 0, 0),
            PdxStatus::InvalidArgument
        );
        assert_eq!(
            pdxfer_engine_send_metadata(d0, 8, dst.as_ptr(), 1, 16, 0),
            PdxStatus::PrefixMisaligned
        );
        assert_eq!(
            pdxfer_engine_send_metadata(d0, 8, null(), 2, 0, 0),
            PdxStatus::NullArgument
        );
        assert_eq!(pdxfer_engine_sender(d0, 9), PdxStatus::Unsupported);
        assert_eq!(pdxfer_engine_receiver(pe, 9, 0, 0), PdxStatus::Unsupported);
        assert_eq!(pdxfer_engine_sender(null(), 9), PdxStatus::NullArgument);
        assert_eq!(
            pdxfer_engine_poll(pe, 9, null_mut()),
            PdxStatus::NullArgument
        );
        let mut fenced = 0u32;
        assert_eq!(pdxfer_engine_abort(d0, 8, &mut fenced), PdxStatus::Ok);
        assert_eq!(
            pdxfer_engine_abort(pe, 4242, null_mut()),
            PdxStatus::UnknownRoom
        );
        // a config that does not match its topology
        let mut bad = config(&ps, PDXFER_ROLE_PREFILL, &cluster, &url, &cma);
        bad.num_pools = 1;
        let mut h = null_mut();
        assert_eq!(
            pdxfer_engine_create(&bad, &mut h),
            PdxStatus::GeometryMismatch
        );
        bad.num_pools = 2;
        bad.role = 0;
        assert_eq!(
            pdxfer_engine_create(&bad, &mut h),
            PdxStatus::InvalidArgument
        );
        bad.role = PDXFER_ROLE_PREFILL;
        bad.struct_size = 8;
        assert_eq!(pdxfer_engine_create(&bad, &mut h), PdxStatus::AbiMismatch);
        assert!(h.is_null());
        for d in de {
            assert_eq!(pdxfer_engine_destroy(d), PdxStatus::Ok);
        }
        assert_eq!(pdxfer_engine_destroy(pe), PdxStatus::Ok);
        assert_eq!(pdxfer_engine_destroy(null_mut()), PdxStatus::Ok);
        drop(pp);
        drop(dpools);
    }
}
