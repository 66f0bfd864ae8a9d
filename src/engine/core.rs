//! [`Engine`]: one per rank. Joins the layout core (plans), the relayout
//! (CPU gather into a registered staging buffer), the data plane (agent and
//! transports) and the bootstrap (registration, peer lookup, handshake re-check)
//! into prefill and decode engines with SGLang's room lifecycle.
//!
//! Threads: a control listener (prefill) and one reader per control
//! connection; `workers` transfer threads on the prefill (a room always uses
//! the same worker, so its chunks stay in order); a deadline thread. Every
//! failure is kept on its room (reason + code), and one failing peer or room
//! never stops the others: workers and readers catch errors and panics per job.

use super::control::{CtlMsg, CtlReader, CtlWriter, RegionMap, CONTROL_VERSION};
use super::device::DeviceStage;
use super::room::{KvPoll, RoomTable};
use crate::bootstrap::client::Registrar;
use crate::bootstrap::peer::{check_pair, prefill_targets, verify_peer};
use crate::bootstrap::schema::{InstanceId, PeerHello, RegionDescriptor, Registration, Role};
use crate::bootstrap::store::Store;
use crate::error::{Error, Result, Status};
use crate::layout::plan::RunMerger;
use crate::layout::{prefill_unique_rank, DcpLayout, PackLayout, PairRequest, Run, Side, Topology};
use crate::memory::RegionDesc;
use crate::transport::{
    Agent, AgentOptions, BatchId, BatchOptions, ConnectOptions, Transport, TransportKind, WriteOp,
};
use crossbeam::channel::{unbounded, Receiver, Sender};
use std::collections::{BTreeSet, HashMap};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One KV entry's pool: `num_pages` pages of `page_bytes` at `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPool {
    /// Global layer id (matches the topology entry).
    pub layer_id: u32,
    /// Start address: host memory, or a CUDA device address when the
    /// engine's [`EngineConfig::pool_device`] is set.
    pub base: u64,
    /// Bytes of one page of this entry (`page_size * row_bytes`).
    pub page_bytes: u64,
    /// Pages in the pool.
    pub num_pages: u64,
}

/// One aux buffer: `count` items of `item_bytes` at `base`; a request uses one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuxBuffer {
    /// Start address (host memory).
    pub base: u64,
    /// Bytes of one item (row).
    pub item_bytes: u64,
    /// Rows.
    pub count: u64,
}

/// How an engine is set up.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Prefill or decode.
    pub role: Role,
    /// Cluster name in the bootstrap namespace.
    pub cluster: String,
    /// Bootstrap store URL (`http://host:port` or `etcd://host:port`).
    pub bootstrap: String,
    /// Optional bootstrap token.
    pub token: Option<String>,
    /// This rank's topology; its entries must match `pools`.
    pub topology: Topology,
    /// Data-parallel size and rank.
    pub dp_size: u32,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// KV pools, one per topology entry, same order.
    pub pools: Vec<KvPool>,
    /// Where the KV pools live: `None` host memory; `Some(n)` device memory
    /// of CUDA device `n`. Prefill: gathered on the GPU into staging buffers
    /// of `staging_bytes` per worker, on the device and pinned on the host;
    /// over rdma with GPUDirect RDMA written straight from the device staging
    /// (no host copy), otherwise (cma, tcp, or a NIC without GPUDirect,
    /// logged once) copied to the pinned staging and sent from there. Decode: registered as device regions; over tcp
    /// the receiver copies each piece into them (host-to-device, waited on
    /// before the piece counts), over rdma the NIC writes them (GPUDirect);
    /// a decode with device pools and `transport` cma is refused
    /// (`Unsupported`), and `auto` never picks cma for it. Aux and state
    /// buffers stay host memory. Without a CUDA driver creation fails with
    /// `NoCudaDriver` (without the `cuda` feature, `Unsupported`). A chunk's rows must be
    /// complete on the device when `send` queues it (the gather runs on the
    /// engine's own stream, unordered with the model's).
    pub pool_device: Option<u32>,
    /// Aux buffers (same count and item sizes on both sides).
    pub aux: Vec<AuxBuffer>,
    /// Optional state buffers (Mamba/SWA-like per-request state): one row per
    /// buffer and request, sent whole to every decode rank after the KV
    /// (state is not DCP-sharded, as in SGLang).
    pub state: Vec<AuxBuffer>,
    /// Transport for KV data (`Auto`: cma on one host, else rdma when both
    /// sides have a usable NIC, else tcp; `Rdma` needs a NIC: `no_rdma_device`).
    pub transport: TransportKind,
    /// Host to listen on.
    pub host: String,
    /// Prefill: bytes of each worker's staging (pack) buffer; 0 disables packing.
    pub staging_bytes: u64,
    /// Prefill: transfer worker threads.
    pub workers: usize,
    /// Default room deadline.
    pub room_timeout: Duration,
    /// Deadline of one transfer batch.
    pub batch_timeout: Duration,
    /// Bootstrap lease TTL.
    pub lease_ttl: Duration,
    /// Test knob: the RDMA NIC provider of the engine's agent (the software
    /// fabric in tests); `None` (production) uses the real NICs.
    #[doc(hidden)]
    pub nic: Option<std::sync::Arc<dyn crate::transport::rdma::nic::NicProvider>>,
}

impl EngineConfig {
    /// Defaults for everything but the role, cluster, bootstrap, topology and pools.
    pub fn new(
        role: Role,
        cluster: &str,
        bootstrap: &str,
        topology: Topology,
        pools: Vec<KvPool>,
    ) -> EngineConfig {
        EngineConfig {
            role,
            cluster: cluster.to_string(),
            bootstrap: bootstrap.to_string(),
            token: None,
            topology,
            dp_size: 1,
            dp_rank: 0,
            pools,
            pool_device: None,
            aux: Vec::new(),
            state: Vec::new(),
            transport: TransportKind::Auto,
            host: "127.0.0.1".to_string(),
            staging_bytes: 64 << 20,
            workers: 2,
            room_timeout: Duration::from_secs(60),
            batch_timeout: Duration::from_secs(30),
            lease_ttl: Duration::from_secs(10),
            nic: None,
        }
    }
}

/// A decode rank as the prefill engine sees it.
struct DecodeLink {
    hello: PeerHello,
    regions: RegionMap,
    writer: CtlWriter,
    data: Box<dyn Transport>,
    alive: AtomicBool,
    /// Device pools: slices are written straight from the device staging
    /// buffer (rdma with GPUDirect RDMA), not copied to the host first;
    /// cleared for good when the NIC refuses device memory.
    zero_copy: AtomicBool,
}

/// What one decode rank asked for in one room.
#[derive(Clone)]
struct MetaInfo {
    link: Arc<DecodeLink>,
    attempt: u64,
    dst_pages: Vec<u64>,
    prefix: u64,
    aux_index: u64,
    state_indices: Vec<u64>,
    required: u32,
    bytes: u64,
    arrived: Instant,
}

/// Prefill-side room data beyond the state machine.
#[derive(Default)]
struct PrefillRoom {
    attempt: u64,
    infos: Vec<MetaInfo>,
    sent_positions: u64,
    queued_last: bool,
    abort_pending: Vec<(Arc<DecodeLink>, u64)>,
    state_indices: Vec<u64>,
}

/// A prefill rank as the decode engine sees it.
struct PrefillLink {
    registration: Registration,
    writer: CtlWriter,
    alive: AtomicBool,
}

/// Decode-side room data beyond the state machine.
struct DecodeRoom {
    attempt: u64,
    targets: Vec<Arc<PrefillLink>>,
    responded: BTreeSet<u32>,
    bytes: u64,
    abort_acks: usize,
    state_indices: Vec<u64>,
}

struct Job {
    room: u64,
    attempt: u64,
    pages: Vec<u64>,
    start: u64,
    num_tokens: u64,
    last: bool,
    aux_index: u64,
    state_indices: Vec<u64>,
}

struct Inner {
    cfg: EngineConfig,
    agent: Agent,
    store: Arc<dyn Store>,
    registrar: Mutex<Option<Registrar>>,
    rooms: Mutex<RoomTable>,
    cv: Condvar,
    pool_regions: Vec<RegionDesc>,
    aux_regions: Vec<RegionDesc>,
    state_regions: Vec<RegionDesc>,
    staging: Vec<(Vec<u8>, RegionDesc)>,
    closed: AtomicBool,
    /// Device pools over rdma: why the zero-copy path is not used was logged.
    gpu_direct_logged: AtomicBool,
    // prefill
    prefill_rooms: Mutex<HashMap<u64, PrefillRoom>>,
    pending_meta: Mutex<HashMap<u64, Vec<MetaInfo>>>,
    decode_links: Mutex<Vec<Arc<DecodeLink>>>,
    jobs: Vec<Sender<Job>>,
    // decode
    decode_rooms: Mutex<HashMap<u64, DecodeRoom>>,
    prefill_links: Mutex<HashMap<(InstanceId, u64), Arc<PrefillLink>>>,
}

/// One rank's transfer engine.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("role", &self.inner.cfg.role)
            .field("cluster", &self.inner.cfg.cluster)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn catch<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            Status::Panic,
            format!("internal panic in {what}"),
        )),
    }
}

impl Engine {
    /// Creates the engine: registers the pools, starts the agent and threads,
    /// and registers the rank with the bootstrap.
    ///
    /// # Safety
    /// Every pool and aux buffer must be valid, writable host memory of the
    /// given size for the engine's whole life (peers write into decode pools,
    /// the prefill reads its pools); with `pool_device`, the pools are device
    /// memory of that device instead (checked against the driver), and the
    /// rows of a chunk must be written (the forward pass finished) before
    /// `send` queues it: the GPU gather runs on the engine's own stream.
    pub unsafe fn new(cfg: EngineConfig) -> Result<Engine> {
        cfg.topology.validate(cfg.role.as_str())?;
        if cfg.pools.len() != cfg.topology.entries.len() {
            return Err(Error::new(
                Status::GeometryMismatch,
                format!(
                    "{} pools for {} topology entries",
                    cfg.pools.len(),
                    cfg.topology.entries.len()
                ),
            ));
        }
        let p = u64::from(cfg.topology.page_size);
        for (i, (pool, e)) in cfg.pools.iter().zip(&cfg.topology.entries).enumerate() {
            if pool.layer_id != e.layer_id || pool.page_bytes != e.row_bytes * p {
                return Err(Error::new(
                    Status::GeometryMismatch,
                    format!(
                        "pool {i} (layer {}, {} B pages) does not match topology entry (layer {}, {} B rows x page {p})",
                        pool.layer_id, pool.page_bytes, e.layer_id, e.row_bytes
                    ),
                ));
            }
        }
        if let Some(ordinal) = cfg.pool_device {
            super::device::preflight(&cfg, ordinal)?;
        }
        let agent = Agent::new(&AgentOptions {
            listen: (cfg.role == Role::Decode).then(|| format!("{}:0", cfg.host)),
            stall: Duration::ZERO,
            nic: cfg.nic.clone(),
            ..Default::default()
        })?;
        if cfg.transport == TransportKind::Rdma {
            // Without a usable NIC: the typed `no_rdma_device` naming the reason.
            let nics = agent.rdma_nics()?;
            log::info!("engine: transport rdma over {nics}");
            if cfg.role == Role::Decode && cfg.pool_device.is_some() {
                // Peers write the decode's device pools straight through the NIC.
                agent.rdma_gpu_direct().map_err(|e| {
                    Error::new(
                        Status::NoGpuDirect,
                        format!(
                            "decode KV pools in device memory over rdma need GPUDirect RDMA, which {nics} cannot do: {}; use transport tcp (the receiver copies into device memory) or auto",
                            e.detail()
                        ),
                    )
                })?;
            }
        }
        let store = crate::bootstrap::open_store(&cfg.bootstrap, cfg.token.as_deref())?;
        let reg = agent.registry();
        let workers = if cfg.role == Role::Prefill {
            cfg.workers.max(1)
        } else {
            0
        };
        let mut pool_spans = Vec::new();
        for pool in &cfg.pools {
            let len = pool
                .page_bytes
                .checked_mul(pool.num_pages)
                .ok_or_else(|| Error::invalid("pool size overflows"))?;
            pool_spans.push((pool.base, len));
        }
        // device pools: one GPU stage per worker (checks the pools first)
        let mut stages = match cfg.pool_device {
            Some(ordinal) => {
                DeviceStage::open(ordinal, cfg.staging_bytes, &pool_spans, reg, workers)?
            }
            None => Vec::new(),
        };
        // decode device pools: the tcp receiver copies into them through this writer
        let decode_writer = match (cfg.role, cfg.pool_device) {
            (Role::Decode, Some(ordinal)) => {
                Some(super::device::decode_writer(ordinal, &pool_spans)?)
            }
            _ => None,
        };
        let mut pool_regions = Vec::new();
        for &(base, len) in &pool_spans {
            pool_regions.push(match (cfg.pool_device, &decode_writer) {
                // SAFETY: the caller guarantees the pool memory is valid for the engine's life (function contract).
                (Some(ordinal), Some(w)) => unsafe {
                    reg.register_device_with(base, len as usize, ordinal, w.clone())?
                },
                // SAFETY: as above.
                (Some(ordinal), None) => unsafe {
                    reg.register_device(base, len as usize, ordinal)?
                },
                // SAFETY: as above.
                (None, _) => unsafe { reg.register_host(base as *mut u8, len as usize)? },
            });
        }
        let mut aux_regions = Vec::new();
        for a in &cfg.aux {
            let len = a
                .item_bytes
                .checked_mul(a.count)
                .ok_or_else(|| Error::invalid("aux size overflows"))?;
            // SAFETY: as above, the caller guarantees the aux memory.
            aux_regions.push(unsafe { reg.register_host(a.base as *mut u8, len as usize)? });
        }
        let mut state_regions = Vec::new();
        for a in &cfg.state {
            let len = a
                .item_bytes
                .checked_mul(a.count)
                .ok_or_else(|| Error::invalid("state buffer size overflows"))?;
            // SAFETY: as above, the caller guarantees the state memory (function contract).
            state_regions.push(unsafe { reg.register_host(a.base as *mut u8, len as usize)? });
        }
        let mut staging = Vec::new();
        for _ in 0..workers {
            if cfg.staging_bytes == 0 || cfg.pool_device.is_some() {
                break;
            }
            let mut buf = vec![0u8; cfg.staging_bytes as usize];
            // SAFETY: the buffer is owned by the engine and unregistered (registry dropped) before it is freed.
            let desc = unsafe { reg.register_host(buf.as_mut_ptr(), buf.len())? };
            staging.push((buf, desc));
        }
        if cfg.transport == TransportKind::Rdma {
            // Register the pools with the NICs now, not inside the first handshake.
            let t0 = std::time::Instant::now();
            agent.rdma_register_all()?;
            log::info!(
                "engine: registered {} region(s) with the RDMA NICs in {:?}",
                agent.registry().descriptors().len(),
                t0.elapsed()
            );
        }
        let mut txs = Vec::new();
        let mut rxs = Vec::new();
        for _ in 0..workers {
            let (t, r) = unbounded();
            txs.push(t);
            rxs.push(r);
        }
        let inner = Arc::new(Inner {
            cfg,
            agent,
            store,
            registrar: Mutex::new(None),
            rooms: Mutex::new(RoomTable::new()),
            cv: Condvar::new(),
            pool_regions,
            aux_regions,
            state_regions,
            staging,
            closed: AtomicBool::new(false),
            gpu_direct_logged: AtomicBool::new(false),
            prefill_rooms: Mutex::new(HashMap::new()),
            pending_meta: Mutex::new(HashMap::new()),
            decode_links: Mutex::new(Vec::new()),
            jobs: txs,
            decode_rooms: Mutex::new(HashMap::new()),
            prefill_links: Mutex::new(HashMap::new()),
        });
        let mut endpoints = std::collections::BTreeMap::new();
        let mut listener = None;
        if inner.cfg.role == Role::Prefill {
            let l = TcpListener::bind(format!("{}:0", inner.cfg.host))?;
            endpoints.insert("ctl".to_string(), l.local_addr()?.to_string());
            // accepted only once the registration is stored (below); peers wait in the backlog
            listener = Some(l);
            for (i, rx) in rxs.into_iter().enumerate() {
                let w = Arc::downgrade(&inner);
                // the worker owns its GPU stage (device pools) for its whole life
                let stage = (!stages.is_empty()).then(|| stages.remove(0));
                std::thread::Builder::new()
                    .name(format!("pdxfer-worker-{i}"))
                    .spawn(move || worker_loop(w, i, rx, stage))?;
            }
        } else if let Some(a) = inner.agent.local_addr() {
            endpoints.insert("data".to_string(), a.to_string());
        }
        let w = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("pdxfer-deadlines".into())
            .spawn(move || deadline_loop(w))?;

        let mut registration = Registration::new(
            &inner.cfg.cluster,
            inner.cfg.role,
            InstanceId::random()?,
            inner.cfg.topology.clone(),
        );
        registration.dp_size = inner.cfg.dp_size;
        registration.dp_rank = inner.cfg.dp_rank;
        registration.endpoints = endpoints;
        registration.regions = inner
            .pool_regions
            .iter()
            .zip(&inner.cfg.pools)
            .map(|(r, p)| {
                let mut d = region_descriptor(r, "kv", Some(p.layer_id));
                if let Some(o) = inner.cfg.pool_device {
                    d.keys.insert("memory".to_string(), format!("cuda:{o}"));
                }
                d
            })
            .chain(
                inner
                    .aux_regions
                    .iter()
                    .map(|r| region_descriptor(r, "aux", None)),
            )
            .collect();
        let registrar = Registrar::start(inner.store.clone(), registration, inner.cfg.lease_ttl)?;
        *lock(&inner.registrar) = Some(registrar);
        if let Some(l) = listener {
            let w = Arc::downgrade(&inner);
            std::thread::Builder::new()
                .name("pdxfer-ctl".into())
                .spawn(move || accept_loop(w, l))?;
        }
        Ok(Engine { inner })
    }

    /// This rank's current bootstrap entry (with its epoch).
    pub fn registration(&self) -> Result<Registration> {
        lock(&self.inner.registrar)
            .as_ref()
            .map(|r| r.registration())
            .ok_or_else(|| Error::new(Status::EngineClosed, "engine is closed"))
    }

    /// The room's state (`Failed` for an unknown room, like SGLang).
    pub fn poll(&self, room: u64) -> KvPoll {
        lock(&self.inner.rooms)
            .get(room)
            .map_or(KvPoll::Failed, |r| r.poll)
    }

    /// Why the room failed (or why it is unknown).
    pub fn failure(&self, room: u64) -> Option<Error> {
        match lock(&self.inner.rooms).get(room) {
            Ok(r) => r.failure.clone(),
            Err(e) => Some(e),
        }
    }

    /// Waits until the room is terminal or `timeout` passes; returns its state.
    pub fn wait(&self, room: u64, timeout: Duration) -> KvPoll {
        let end = Instant::now() + timeout;
        let mut rooms = lock(&self.inner.rooms);
        loop {
            let p = rooms.get(room).map_or(KvPoll::Failed, |r| r.poll);
            let now = Instant::now();
            if p.is_terminal() || now >= end {
                return p;
            }
            rooms = self
                .inner
                .cv
                .wait_timeout(rooms, end - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Forgets a terminal room (refused while writes for it are in flight).
    pub fn clear(&self, room: u64) -> Result<()> {
        lock(&self.inner.rooms).clear(room)?;
        lock(&self.inner.prefill_rooms).remove(&room);
        lock(&self.inner.decode_rooms).remove(&room);
        Ok(())
    }

    fn create_room(&self, room: u64, timeout: Option<Duration>) -> Result<u64> {
        let t = timeout.unwrap_or(self.inner.cfg.room_timeout);
        lock(&self.inner.rooms).create(room, KvPoll::Bootstrapping, Some(t), Instant::now())
    }

    fn require(&self, role: Role) -> Result<()> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::new(Status::EngineClosed, "engine is closed"));
        }
        if self.inner.cfg.role != role {
            return Err(Error::new(
                Status::Unsupported,
                format!(
                    "this is a {} engine; that call belongs to a {} engine",
                    self.inner.cfg.role.as_str(),
                    role.as_str()
                ),
            ));
        }
        Ok(())
    }

    // ----- prefill -----

    /// Prefill: opens room `room`; it becomes `WaitingForInput` once every
    /// decode rank that targets this rank sent its metadata.
    pub fn sender(&self, room: u64) -> Result<()> {
        self.require(Role::Prefill)?;
        let attempt = self.create_room(room, None)?;
        // Take the parked metadata and publish the room under the prefill_rooms
        // lock (add_meta parks under it too): otherwise a Meta arriving between
        // the two steps is parked after the drain and the room never leaves
        // Bootstrapping (found by the soak run).
        let pending = {
            let mut pr = lock(&self.inner.prefill_rooms);
            let pending = lock(&self.inner.pending_meta)
                .remove(&room)
                .unwrap_or_default();
            pr.insert(
                room,
                PrefillRoom {
                    attempt,
                    ..Default::default()
                },
            );
            pending
        };
        for m in pending {
            self.inner.add_meta(room, m);
        }
        Ok(())
    }

    /// Prefill: queues a chunk of the request: this rank's `pages` holding
    /// `num_tokens` tokens (only the last page may be partial), in order (with
    /// prefill DCP: this rank's local pages, `num_tokens` counting sequence
    /// positions, `page_size * dcp_size` per page);
    /// `last` marks the final chunk, after which the aux row `aux_index` follows.
    pub fn send(
        &self,
        room: u64,
        pages: &[u64],
        num_tokens: u64,
        last: bool,
        aux_index: u64,
    ) -> Result<()> {
        self.require(Role::Prefill)?;
        let attempt;
        {
            let rooms = lock(&self.inner.rooms);
            let r = rooms.get(room)?;
            if r.poll == KvPoll::Failed {
                return Err(Error::new(
                    Status::RoomFailed,
                    format!(
                        "room {room} failed: {}",
                        r.failure.as_ref().map_or("", |e| e.detail())
                    ),
                ));
            }
            if r.poll < KvPoll::WaitingForInput {
                return Err(Error::new(
                    Status::InvalidArgument,
                    format!(
                        "room {room} is still {:?}: poll until WaitingForInput before sending",
                        r.poll
                    ),
                ));
            }
            attempt = r.attempt;
        }
        // a page of this rank covers a virtual page of positions (P x its DCP size)
        let vs = self.inner.cfg.topology.dcp_layout()?.virtual_page();
        let cap = pages.len() as u64 * vs;
        if num_tokens > cap {
            return Err(Error::new(
                Status::TokensExceedSource,
                format!(
                    "num_tokens={num_tokens} exceeds the {} pages given (capacity {cap} positions)",
                    pages.len()
                ),
            ));
        }
        for (i, &pg) in pages.iter().enumerate() {
            let limit = self.inner.cfg.pools.first().map_or(0, |x| x.num_pages);
            if pg >= limit {
                return Err(Error::new(
                    Status::OutOfBounds,
                    format!("pages[{i}] = {pg} is outside the prefill pool of {limit} pages"),
                ));
            }
        }
        let start = {
            let mut pr = lock(&self.inner.prefill_rooms);
            let r = pr
                .get_mut(&room)
                .ok_or_else(|| Error::new(Status::UnknownRoom, format!("room {room}")))?;
            if r.queued_last {
                return Err(Error::invalid(format!(
                    "room {room}: the last chunk was already sent"
                )));
            }
            if !last && num_tokens != cap {
                return Err(Error::invalid(format!(
                    "room {room}: only the last chunk may end in a partial page ({num_tokens} tokens in {} pages)",
                    pages.len()
                )));
            }
            let prefix = r.infos.first().map_or(0, |m| m.prefix);
            let start = prefix + r.sent_positions;
            r.sent_positions += pages.len() as u64 * vs;
            r.queued_last = last;
            (
                start,
                if last {
                    r.state_indices.clone()
                } else {
                    Vec::new()
                },
            )
        };
        let (start, state_indices) = start;
        let w = (room as usize) % self.inner.jobs.len().max(1);
        self.inner.jobs[w]
            .send(Job {
                room,
                attempt,
                pages: pages.to_vec(),
                start,
                num_tokens,
                last,
                aux_index,
                state_indices,
            })
            .map_err(|_| Error::new(Status::EngineClosed, "transfer workers stopped"))?;
        lock(&self.inner.rooms).update(room, attempt, KvPoll::Transferring);
        Ok(())
    }

    /// Sets the room's state rows, one per configured state buffer: on the
    /// prefill the rows sent with the last chunk, on the decode the rows they
    /// land in (call before `send_metadata`). Both sides must give one row per
    /// state buffer; the rows follow the KV and aux, to every decode rank.
    pub fn set_state_indices(&self, room: u64, rows: &[u64]) -> Result<()> {
        if rows.len() != self.inner.cfg.state.len() {
            return Err(Error::invalid(format!(
                "room {room}: {} state rows given for {} state buffers",
                rows.len(),
                self.inner.cfg.state.len()
            )));
        }
        for (i, (&row, b)) in rows.iter().zip(&self.inner.cfg.state).enumerate() {
            if row >= b.count {
                return Err(Error::new(
                    Status::OutOfBounds,
                    format!(
                        "state row {row} of buffer {i} is outside its {} rows",
                        b.count
                    ),
                ));
            }
        }
        match self.inner.cfg.role {
            Role::Prefill => {
                let mut pr = lock(&self.inner.prefill_rooms);
                let r = pr.get_mut(&room).ok_or_else(|| {
                    Error::new(
                        Status::UnknownRoom,
                        format!("room {room}: call sender() first"),
                    )
                })?;
                if r.queued_last {
                    return Err(Error::invalid(format!(
                        "room {room}: the last chunk was already queued; set state rows before it"
                    )));
                }
                r.state_indices = rows.to_vec();
            }
            Role::Decode => {
                let mut d = lock(&self.inner.decode_rooms);
                let r = d.get_mut(&room).ok_or_else(|| {
                    Error::new(
                        Status::UnknownRoom,
                        format!("room {room}: call receiver() first"),
                    )
                })?;
                r.state_indices = rows.to_vec();
            }
        }
        Ok(())
    }

    // ----- decode -----

    /// Decode: opens room `room` against the prefill instance's data-parallel
    /// group `prefill_dp`: resolves the prefill ranks from current bootstrap
    /// entries, connects (once per peer instance) and re-checks each peer.
    pub fn receiver(&self, room: u64, prefill_dp: u32, timeout: Option<Duration>) -> Result<()> {
        self.require(Role::Decode)?;
        let attempt = self.create_room(room, timeout)?;
        let r = (|| -> Result<Vec<Arc<PrefillLink>>> {
            let local = self.registration()?;
            let targets = prefill_targets(self.inner.store.as_ref(), &local, prefill_dp)?;
            let mut links = Vec::new();
            for t in targets.iter().filter(|t| !t.dummy) {
                links.push(self.inner.prefill_link(&t.registration, &local)?);
            }
            Ok(links)
        })();
        match r {
            Ok(links) => {
                lock(&self.inner.decode_rooms).insert(
                    room,
                    DecodeRoom {
                        attempt,
                        targets: links,
                        responded: BTreeSet::new(),
                        bytes: 0,
                        abort_acks: 0,
                        state_indices: Vec::new(),
                    },
                );
                Ok(())
            }
            Err(e) => {
                lock(&self.inner.rooms).fail(room, attempt, e.clone());
                self.inner.cv.notify_all();
                Err(e)
            }
        }
    }

    /// Decode: tells every target prefill rank where the request's KV goes.
    pub fn send_metadata(
        &self,
        room: u64,
        dst_pages: &[u64],
        decode_prefix_len: u64,
        aux_index: u64,
    ) -> Result<()> {
        self.require(Role::Decode)?;
        let lay = self.inner.cfg.topology.dcp_layout()?;
        if !decode_prefix_len.is_multiple_of(lay.virtual_page()) {
            return Err(Error::new(
                Status::PrefixMisaligned,
                format!(
                    "decode_prefix_len {decode_prefix_len} must be a multiple of the virtual DCP page {} (page_size {} x dcp_size {}); round the reusable prefix down to {}",
                    lay.virtual_page(), lay.page_size, lay.dcp_size, decode_prefix_len / lay.virtual_page() * lay.virtual_page()
                ),
            ));
        }
        let limit = self.inner.cfg.pools.first().map_or(0, |x| x.num_pages);
        if let Some((i, pg)) = dst_pages.iter().enumerate().find(|(_, &pg)| pg >= limit) {
            return Err(Error::new(
                Status::OutOfBounds,
                format!("dst_pages[{i}] = {pg} is outside the decode pool of {limit} pages"),
            ));
        }
        if let Some(a) = self.inner.cfg.aux.first() {
            if aux_index >= a.count {
                return Err(Error::new(
                    Status::OutOfBounds,
                    format!("aux_index {aux_index} is outside the {} aux rows", a.count),
                ));
            }
        }
        let (attempt, targets) = {
            let d = lock(&self.inner.decode_rooms);
            let r = d.get(&room).ok_or_else(|| {
                Error::new(
                    Status::UnknownRoom,
                    format!("room {room}: call receiver() first"),
                )
            })?;
            (r.attempt, r.targets.clone())
        };
        let state_indices = lock(&self.inner.decode_rooms)
            .get(&room)
            .map(|r| r.state_indices.clone())
            .unwrap_or_default();
        let required = {
            let local = self.registration()?;
            let any = targets.first().map(|t| t.registration.topology.clone());
            match any {
                Some(p) => {
                    crate::layout::resolve_rank_mapping(&local.topology, &p, Default::default())?
                        .required_dst_info_num
                }
                None => 1,
            }
        };
        let timeout_ms = lock(&self.inner.rooms)
            .get(room)
            .ok()
            .and_then(|r| r.deadline)
            .map_or(0, |d| {
                d.saturating_duration_since(Instant::now()).as_millis() as u64
            });
        for t in &targets {
            let m = CtlMsg::Meta {
                room,
                attempt,
                dst_pages: dst_pages.to_vec(),
                decode_prefix_len,
                aux_index,
                state_indices: state_indices.clone(),
                required_dst_info_num: required,
                timeout_ms,
            };
            if let Err(e) = t.writer.send(&m) {
                let e = Error::new(
                    e.status(),
                    format!(
                        "sending metadata to prefill {}: {}",
                        t.registration.describe(),
                        e.detail()
                    ),
                );
                lock(&self.inner.rooms).fail(room, attempt, e.clone());
                self.inner.cv.notify_all();
                return Err(e);
            }
        }
        lock(&self.inner.rooms).update(room, attempt, KvPoll::WaitingForInput);
        Ok(())
    }

    /// Aborts a room. On decode the prefill ranks are told and answer once no
    /// write for the room can still land; [`is_fenced`](Self::is_fenced) says
    /// when the pages may be reused. On prefill the decode ranks that sent
    /// metadata are told the room failed. Returns whether it is fenced already.
    pub fn abort(&self, room: u64) -> Result<bool> {
        let attempt = lock(&self.inner.rooms).get(room)?.attempt;
        let fenced = lock(&self.inner.rooms).abort(room, attempt)?;
        self.inner.cv.notify_all();
        if self.inner.cfg.role == Role::Decode {
            let targets = lock(&self.inner.decode_rooms)
                .get(&room)
                .map(|r| r.targets.clone())
                .unwrap_or_default();
            for t in &targets {
                let _ = t.writer.send(&CtlMsg::Abort { room, attempt });
            }
            return Ok(self.is_fenced(room));
        }
        // the decode ranks of the room learn it now rather than at their timeout
        let failure = lock(&self.inner.rooms)
            .get(room)
            .ok()
            .and_then(|r| r.failure.clone());
        notify_decode(&self.inner, room, false, failure);
        Ok(fenced)
    }

    /// True when no write for an aborted room can still land in local memory
    /// (decode: every live prefill rank acknowledged the abort; a dead one cannot write).
    pub fn is_fenced(&self, room: u64) -> bool {
        if self.inner.cfg.role == Role::Decode {
            let d = lock(&self.inner.decode_rooms);
            return d.get(&room).is_none_or(|r| {
                r.abort_acks
                    >= r.targets
                        .iter()
                        .filter(|t| t.alive.load(Ordering::Acquire))
                        .count()
            });
        }
        lock(&self.inner.rooms).is_fenced(room)
    }

    /// Prefill: the `decode_prefix_len` the decode ranks sent for the room,
    /// once their metadata has arrived (`None` before, or for an unknown room).
    /// The prefill's chunks start right after it: SGLang's
    /// `pop_decode_prefix_len` reads it to skip the prefix the decode holds.
    pub fn decode_prefix_len(&self, room: u64) -> Option<u64> {
        lock(&self.inner.prefill_rooms)
            .get(&room)
            .and_then(|r| r.infos.first().map(|m| m.prefix))
    }

    /// Bytes received for a decode room (from the prefill ranks' completion records).
    pub fn room_bytes(&self, room: u64) -> u64 {
        lock(&self.inner.decode_rooms)
            .get(&room)
            .map_or(0, |r| r.bytes)
    }

    /// The transport the data of this engine moves over (decode: as chosen by the prefill).
    pub fn transport(&self) -> TransportKind {
        self.inner.cfg.transport
    }

    /// Deregisters from the bootstrap and stops the threads.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        if let Some(r) = lock(&self.inner.registrar).take() {
            let _ = r.deregister();
        }
        for l in lock(&self.inner.decode_links).drain(..) {
            l.writer.shutdown();
            l.data.close();
        }
        for (_, l) in lock(&self.inner.prefill_links).drain() {
            l.writer.shutdown();
        }
        self.inner.agent.shutdown();
    }
}

fn region_descriptor(r: &RegionDesc, kind: &str, layer: Option<u32>) -> RegionDescriptor {
    let mut keys = std::collections::BTreeMap::new();
    if let Some(l) = layer {
        keys.insert("layer".to_string(), l.to_string());
    }
    RegionDescriptor {
        id: r.id,
        addr: r.addr,
        len: r.len,
        kind: kind.to_string(),
        keys,
    }
}

impl Inner {
    /// Whether a new link to a decode rank sends device-pool slices straight
    /// from the device staging buffer: device pools, an rdma link, and a NIC
    /// that can register device memory (GPUDirect RDMA). Otherwise slices go
    /// through the pinned host staging (logged once when rdma lacks GPUDirect).
    fn zero_copy_for(&self, data: &dyn Transport, peer: impl std::fmt::Display) -> bool {
        if self.cfg.pool_device.is_none() || data.kind() != TransportKind::Rdma {
            return false;
        }
        match self.agent.rdma_gpu_direct() {
            Ok(()) => {
                log::info!("engine: rdma to decode {peer} writes device-pool slices from device memory (GPUDirect RDMA, no host copy)");
                true
            }
            Err(e) => {
                self.log_no_gpu_direct(&e);
                false
            }
        }
    }

    /// Logs (once per engine) why device-pool slices go through host memory over rdma.
    fn log_no_gpu_direct(&self, e: &Error) {
        if !self.gpu_direct_logged.swap(true, Ordering::AcqRel) {
            log::warn!(
                "engine: the RDMA NIC cannot send from GPU memory ({e}); device-pool slices are copied to pinned host staging and sent from there"
            );
        }
    }

    fn region_map(&self) -> RegionMap {
        RegionMap {
            kv: self
                .cfg
                .pools
                .iter()
                .zip(&self.pool_regions)
                .map(|(p, r)| (p.layer_id, r.id))
                .collect(),
            aux: self
                .cfg
                .aux
                .iter()
                .zip(&self.aux_regions)
                .map(|(a, r)| (r.id, a.item_bytes))
                .collect(),
            state: self
                .cfg
                .state
                .iter()
                .zip(&self.state_regions)
                .map(|(a, r)| (r.id, a.item_bytes))
                .collect(),
        }
    }

    fn fail_room(&self, room: u64, attempt: u64, e: Error) {
        lock(&self.rooms).fail(room, attempt, e);
        self.cv.notify_all();
    }

    /// Decode: the control link to a prefill rank, reused while its instance and epoch hold.
    fn prefill_link(
        self: &Arc<Self>,
        reg: &Registration,
        local: &Registration,
    ) -> Result<Arc<PrefillLink>> {
        let key = (reg.instance_id, reg.epoch);
        if let Some(l) = lock(&self.prefill_links).get(&key) {
            if l.alive.load(Ordering::Acquire) {
                return Ok(l.clone());
            }
        }
        let addr = reg.endpoints.get("ctl").ok_or_else(|| {
            Error::new(
                Status::Bootstrap,
                format!("prefill entry [{}] has no ctl endpoint", reg.describe()),
            )
        })?;
        let s = TcpStream::connect_timeout(
            &addr
                .parse()
                .map_err(|_| Error::invalid(format!("bad ctl address {addr}")))?,
            Duration::from_secs(5),
        )
        .map_err(|e| {
            Error::new(
                Status::PeerUnreachable,
                format!("connecting to prefill {} at {addr}: {e}", reg.describe()),
            )
        })?;
        s.set_nodelay(true)?;
        let writer = CtlWriter::new(s.try_clone()?);
        let mut reader = CtlReader::new(s.try_clone()?);
        let data_addr = self
            .agent
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        writer.send(&CtlMsg::Hello {
            version: CONTROL_VERSION,
            hello: PeerHello::from(local),
            data_addr,
            regions: self.region_map(),
        })?;
        s.set_read_timeout(Some(Duration::from_secs(15)))?;
        let ack = reader.recv()?.ok_or_else(|| {
            Error::new(
                Status::PeerUnreachable,
                format!(
                    "prefill {} closed the control connection during the handshake",
                    reg.describe()
                ),
            )
        })?;
        s.set_read_timeout(None)?;
        let hello = match ack {
            CtlMsg::HelloAck { version, hello } if version == CONTROL_VERSION => hello,
            CtlMsg::Status {
                ok: false,
                reason,
                code,
                ..
            } => {
                return Err(Error::new(
                    code.and_then(Status::from_code).unwrap_or(Status::Protocol),
                    format!(
                        "prefill {} refused this decode rank: {}",
                        reg.describe(),
                        reason.unwrap_or_default()
                    ),
                ))
            }
            other => {
                return Err(Error::new(
                    Status::Protocol,
                    format!("expected hello_ack from prefill, got {other:?}"),
                ))
            }
        };
        // the peer must still be the process the bootstrap advertised, with a compatible layout
        verify_peer(reg, &hello, local)?;
        let link = Arc::new(PrefillLink {
            registration: reg.clone(),
            writer,
            alive: AtomicBool::new(true),
        });
        {
            let mut links = lock(&self.prefill_links);
            // links to an older epoch of this instance, or dead ones, that no room
            // uses any more (the map and the link's reader hold the only two
            // references) are closed, so their sockets on both sides go away
            links.retain(|(inst, ep), l| {
                let stale = (*inst == key.0 && *ep < key.1) || !l.alive.load(Ordering::Acquire);
                if stale && Arc::strong_count(l) <= 2 {
                    l.writer.shutdown();
                    return false;
                }
                true
            });
            links.insert(key, link.clone());
        }
        let w = Arc::downgrade(self);
        let l2 = link.clone();
        std::thread::Builder::new()
            .name("pdxfer-ctl-d".into())
            .spawn(move || decode_reader(w, l2, reader))?;
        Ok(link)
    }

    /// Prefill: records one decode rank's metadata for a room.
    fn add_meta(&self, room: u64, m: MetaInfo) {
        let mut pr = lock(&self.prefill_rooms);
        let Some(r) = pr.get_mut(&room) else {
            // parked while prefill_rooms is held (lock order: prefill_rooms, then pending_meta)
            lock(&self.pending_meta).entry(room).or_default().push(m);
            return;
        };
        if let Some(first) = r.infos.first() {
            if first.prefix != m.prefix {
                let e = Error::invalid(format!(
                    "room {room}: decode ranks disagree on decode_prefix_len ({} vs {})",
                    first.prefix, m.prefix
                ));
                let a = r.attempt;
                drop(pr);
                self.fail_room(room, a, e);
                return;
            }
        }
        r.infos
            .retain(|x| x.link.hello.instance_id != m.link.hello.instance_id);
        r.infos.push(m);
        let required = r.infos.iter().map(|x| x.required).max().unwrap_or(1) as usize;
        let attempt = r.attempt;
        if r.infos.len() >= required {
            drop(pr);
            lock(&self.rooms).update(room, attempt, KvPoll::WaitingForInput);
            self.cv.notify_all();
        }
    }
}

fn accept_loop(w: std::sync::Weak<Inner>, l: TcpListener) {
    for s in l.incoming() {
        let Some(inner) = w.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        let Ok(s) = s else { continue };
        let w2 = Arc::downgrade(&inner);
        let _ = std::thread::Builder::new()
            .name("pdxfer-ctl-p".into())
            .spawn(move || prefill_conn(w2, s));
    }
}

/// The answer to a Hello that cannot be accepted.
fn refusal(e: &Error) -> CtlMsg {
    CtlMsg::Status {
        room: 0,
        attempt: 0,
        ok: false,
        prefill_rank: 0,
        bytes: 0,
        reason: Some(e.detail().to_string()),
        code: Some(e.status() as i32),
    }
}

/// Prefill: one decode rank's control connection.
fn prefill_conn(w: std::sync::Weak<Inner>, s: TcpStream) {
    let _ = s.set_nodelay(true);
    let (Ok(ws), Ok(rs)) = (s.try_clone(), s.try_clone()) else {
        return;
    };
    let writer = CtlWriter::new(ws);
    let mut reader = CtlReader::new(rs);
    let (version, hello, data_addr, regions) = match reader.recv() {
        Ok(Some(CtlMsg::Hello {
            version,
            hello,
            data_addr,
            regions,
        })) => (version, hello, data_addr, regions),
        Ok(None) => return,
        Ok(Some(other)) => {
            let _ = writer.send(&refusal(&Error::new(
                Status::Protocol,
                format!("expected hello first, got {other:?}"),
            )));
            return;
        }
        Err(e) => {
            let _ = writer.send(&refusal(&e));
            return;
        }
    };
    let Some(inner) = w.upgrade() else { return };
    let setup = catch("control handshake", || {
        if version != CONTROL_VERSION {
            return Err(Error::new(
                Status::Protocol,
                format!("control protocol {version}, this build {CONTROL_VERSION}"),
            ));
        }
        let local = lock(&inner.registrar)
            .as_ref()
            .map(|r| r.registration())
            .ok_or_else(|| Error::new(Status::EngineClosed, "closing"))?;
        let mut peer = local.clone();
        peer.role = Role::Decode;
        peer.topology = hello.topology.clone();
        peer.instance_id = hello.instance_id;
        peer.epoch = hello.epoch;
        peer.registered_at_ms = hello.registered_at_ms;
        check_pair(&local, &peer)?;
        Ok(local)
    });
    let local = match setup {
        Ok(l) => l,
        Err(e) => {
            let _ = writer.send(&refusal(&e));
            return;
        }
    };
    let data = match inner.agent.connect(
        &data_addr,
        &ConnectOptions {
            transport: inner.cfg.transport,
            ..Default::default()
        },
    ) {
        Ok(d) => d,
        Err(e) => {
            let _ = writer.send(&refusal(&e));
            return;
        }
    };
    if data.kind() == TransportKind::Cma
        && data
            .remote_regions()
            .iter()
            .any(|r| matches!(r.kind, crate::memory::RegionKind::Device { .. }))
    {
        data.close();
        let _ = writer.send(&refusal(&Error::new(
            Status::Unsupported,
            format!(
                "decode {} has KV pools in CUDA device memory, which cma (process_vm_writev) cannot write; use tcp, rdma or auto on the prefill",
                hello.instance_id
            ),
        )));
        return;
    }
    let zero_copy = inner.zero_copy_for(&*data, hello.instance_id);
    let link = Arc::new(DecodeLink {
        hello,
        regions,
        writer,
        data,
        alive: AtomicBool::new(true),
        zero_copy: AtomicBool::new(zero_copy),
    });
    if link
        .writer
        .send(&CtlMsg::HelloAck {
            version: CONTROL_VERSION,
            hello: PeerHello::from(&local),
        })
        .is_err()
    {
        return;
    }
    lock(&inner.decode_links).push(link.clone());
    drop(inner);
    loop {
        let msg = reader.recv();
        let Some(inner) = w.upgrade() else { return };
        match msg {
            Ok(Some(CtlMsg::Meta {
                room,
                attempt,
                dst_pages,
                decode_prefix_len,
                aux_index,
                state_indices,
                required_dst_info_num,
                ..
            })) => {
                inner.add_meta(
                    room,
                    MetaInfo {
                        link: link.clone(),
                        attempt,
                        dst_pages,
                        prefix: decode_prefix_len,
                        aux_index,
                        state_indices,
                        required: required_dst_info_num,
                        bytes: 0,
                        arrived: Instant::now(),
                    },
                );
            }
            Ok(Some(CtlMsg::Abort { room, attempt })) if lock(&inner.rooms).get(room).is_ok() => {
                let local_attempt = lock(&inner.rooms).get(room).map(|r| r.attempt).unwrap_or(0);
                let fenced = lock(&inner.rooms)
                    .abort(room, local_attempt)
                    .unwrap_or(true);
                inner.cv.notify_all();
                if fenced {
                    let _ = link.writer.send(&CtlMsg::AbortAck { room, attempt });
                } else if let Some(r) = lock(&inner.prefill_rooms).get_mut(&room) {
                    r.abort_pending.push((link.clone(), attempt));
                }
            }
            Ok(Some(CtlMsg::Abort { room, attempt })) => {
                let _ = link.writer.send(&CtlMsg::AbortAck { room, attempt });
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => {
                link.alive.store(false, Ordering::Release);
                link.data.close();
                // rooms waiting on this decode rank fail; others go on
                let pr = lock(&inner.prefill_rooms);
                let hit: Vec<(u64, u64)> = pr
                    .iter()
                    .filter(|(_, r)| r.infos.iter().any(|m| Arc::ptr_eq(&m.link, &link)))
                    .map(|(id, r)| (*id, r.attempt))
                    .collect();
                drop(pr);
                for (room, a) in hit {
                    inner.fail_room(
                        room,
                        a,
                        Error::new(
                            Status::PeerUnreachable,
                            format!(
                                "decode rank instance {} (dcp_rank {}) disconnected",
                                link.hello.instance_id, link.hello.topology.dcp_rank
                            ),
                        ),
                    );
                }
                lock(&inner.decode_links).retain(|l| !Arc::ptr_eq(l, &link));
                return;
            }
        }
    }
}

/// Decode: status messages from one prefill rank.
fn decode_reader(w: std::sync::Weak<Inner>, link: Arc<PrefillLink>, mut reader: CtlReader) {
    loop {
        let msg = reader.recv();
        let Some(inner) = w.upgrade() else { return };
        match msg {
            Ok(Some(CtlMsg::Status {
                room,
                attempt,
                ok,
                prefill_rank,
                bytes,
                reason,
                code,
            })) => {
                let mut d = lock(&inner.decode_rooms);
                let Some(r) = d.get_mut(&room).filter(|r| r.attempt == attempt) else {
                    continue;
                };
                if ok {
                    r.responded.insert(prefill_rank);
                    r.bytes += bytes;
                    let done = r.responded.len() >= r.targets.len();
                    drop(d);
                    if done {
                        lock(&inner.rooms).update(room, attempt, KvPoll::Success);
                    } else {
                        lock(&inner.rooms).update(room, attempt, KvPoll::Transferring);
                    }
                } else {
                    drop(d);
                    let st = code
                        .and_then(Status::from_code)
                        .unwrap_or(Status::RoomFailed);
                    inner.fail_room(
                        room,
                        attempt,
                        Error::new(
                            st,
                            format!(
                                "prefill {} reported: {}",
                                link.registration.describe(),
                                reason.unwrap_or_default()
                            ),
                        ),
                    );
                }
                inner.cv.notify_all();
            }
            Ok(Some(CtlMsg::AbortAck { room, attempt })) => {
                let mut d = lock(&inner.decode_rooms);
                if let Some(r) = d.get_mut(&room).filter(|r| r.attempt == attempt) {
                    r.abort_acks += 1;
                }
                inner.cv.notify_all();
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => {
                link.alive.store(false, Ordering::Release);
                let d = lock(&inner.decode_rooms);
                let hit: Vec<(u64, u64)> = d
                    .iter()
                    .filter(|(_, r)| r.targets.iter().any(|t| Arc::ptr_eq(t, &link)))
                    .map(|(id, r)| (*id, r.attempt))
                    .collect();
                drop(d);
                for (room, a) in hit {
                    if !lock(&inner.rooms)
                        .get(room)
                        .is_ok_and(|r| r.poll.is_terminal())
                    {
                        inner.fail_room(
                            room,
                            a,
                            Error::new(
                                Status::PeerUnreachable,
                                format!(
                                    "lost the control connection to prefill {}; it may have died",
                                    link.registration.describe()
                                ),
                            ),
                        );
                    }
                }
                return;
            }
        }
    }
}

fn deadline_loop(w: std::sync::Weak<Inner>) {
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let Some(inner) = w.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        if inner.cfg.role == Role::Decode {
            // The agent queues a completion record per received batch; the engine
            // learns a room's outcome and bytes from the prefill's status message
            // instead, so the records are drained here rather than accumulating.
            while inner.agent.try_completion().is_some() {}
        }
        if inner.cfg.role == Role::Prefill {
            // metadata for a room this prefill never opened (or already cleared) is forgotten
            let ttl = inner.cfg.room_timeout;
            lock(&inner.pending_meta).retain(|_, v| v.iter().any(|m| m.arrived.elapsed() < ttl));
        }
        let expired = lock(&inner.rooms).expire(Instant::now());
        if !expired.is_empty() {
            inner.cv.notify_all();
            if inner.cfg.role == Role::Prefill {
                for room in expired {
                    notify_decode(
                        &inner,
                        room,
                        false,
                        lock(&inner.rooms)
                            .get(room)
                            .ok()
                            .and_then(|r| r.failure.clone()),
                    );
                }
            }
        }
    }
}

/// Prefill: sends the room's final status to every decode rank of the room.
fn notify_decode(inner: &Inner, room: u64, ok: bool, err: Option<Error>) {
    let infos = lock(&inner.prefill_rooms)
        .get(&room)
        .map(|r| r.infos.clone())
        .unwrap_or_default();
    let rank = prefill_unique_rank(&inner.cfg.topology);
    for m in infos {
        let _ = m.link.writer.send(&CtlMsg::Status {
            room,
            attempt: m.attempt,
            ok,
            prefill_rank: rank,
            bytes: m.bytes,
            reason: err.as_ref().map(|e| e.detail().to_string()),
            code: err.as_ref().map(|e| e.status() as i32),
        });
    }
}

fn worker_loop(
    w: std::sync::Weak<Inner>,
    idx: usize,
    rx: Receiver<Job>,
    mut stage: Option<DeviceStage>,
) {
    while let Ok(job) = rx.recv() {
        let Some(inner) = w.upgrade() else { return };
        let (room, attempt, last) = (job.room, job.attempt, job.last);
        let r = catch("transfer worker", || {
            run_job(&inner, idx, &job, stage.as_mut())
        });
        match r {
            Ok(()) if last => {
                if lock(&inner.rooms)
                    .get(room)
                    .is_ok_and(|r| r.attempt == attempt && r.poll != KvPoll::Failed)
                {
                    notify_decode(&inner, room, true, None);
                    lock(&inner.rooms).update(room, attempt, KvPoll::Success);
                }
            }
            Ok(()) => {}
            Err(e) => {
                inner.fail_room(room, attempt, e.clone());
                notify_decode(&inner, room, false, Some(e));
            }
        }
        // answer aborts that waited for in-flight writes
        if lock(&inner.rooms).is_fenced(room) {
            let pending = lock(&inner.prefill_rooms)
                .get_mut(&room)
                .map(|r| std::mem::take(&mut r.abort_pending))
                .unwrap_or_default();
            for (l, a) in pending {
                let _ = l.writer.send(&CtlMsg::AbortAck { room, attempt: a });
            }
        }
        inner.cv.notify_all();
    }
}

/// Moves one chunk to every decode rank of the room (and aux and state on
/// the last chunk): the batches of all decode ranks are in flight together
/// (a [`Flight`]), and the chunk is done once every one of them completed.
fn run_job(inner: &Inner, idx: usize, job: &Job, stage: Option<&mut DeviceStage>) -> Result<()> {
    let opts = BatchOptions {
        timeout: inner.cfg.batch_timeout,
        checksum: false,
        room: job.room,
        epoch: job.attempt,
    };
    let mut flight = Flight::new(inner, opts);
    let sent = send_chunk(inner, idx, job, stage, &mut flight);
    // every batch completes (or fails) before the chunk ends, error or not:
    // the room's in-flight count falls back and the staging is free again
    let drained = flight.drain();
    let bytes = sent?;
    drained?;
    if let Some(r) = lock(&inner.prefill_rooms).get_mut(&job.room) {
        for (x, b) in r.infos.iter_mut().zip(bytes) {
            x.bytes += b;
        }
    }
    Ok(())
}

/// Submits one chunk's batches to every decode rank of the room into
/// `flight`; returns the KV bytes for each decode rank (in `infos` order),
/// counted once the flight drained without error.
fn send_chunk(
    inner: &Inner,
    idx: usize,
    job: &Job,
    mut stage: Option<&mut DeviceStage>,
    flight: &mut Flight<'_>,
) -> Result<Vec<u64>> {
    let infos = lock(&inner.prefill_rooms)
        .get(&job.room)
        .map(|r| r.infos.clone())
        .unwrap_or_default();
    if infos.is_empty() {
        return Err(Error::new(
            Status::UnknownRoom,
            format!("room {}: no decode metadata", job.room),
        ));
    }
    let topo = &inner.cfg.topology;
    let src_l = topo.dcp_layout()?;
    let row_bytes: Vec<u64> = topo.entries.iter().map(|e| e.row_bytes).collect();
    let opts = flight.opts;
    let mut sent = Vec::with_capacity(infos.len());
    for m in &infos {
        if !m.link.alive.load(Ordering::Acquire) {
            return Err(Error::new(
                Status::PeerUnreachable,
                format!("decode rank instance {} is gone", m.link.hello.instance_id),
            ));
        }
        let dt = &m.link.hello.topology;
        let dst_l = DcpLayout::new(
            u64::from(dt.page_size),
            u64::from(dt.dcp_size),
            u64::from(dt.dcp_interleave),
        )?;
        let req = PairRequest {
            src: Side {
                layout: src_l,
                rank: u64::from(topo.dcp_rank),
                pages: &job.pages,
                origin: job.start,
            },
            dst: Side {
                layout: dst_l,
                rank: u64::from(dt.dcp_rank),
                pages: &m.dst_pages,
                origin: m.prefix,
            },
            start: job.start,
            num_tokens: job.num_tokens,
        };
        req.validate()?;
        let dst_regions: Vec<u64> = topo
            .entries
            .iter()
            .map(|e| {
                m.link.regions.kv_region(e.layer_id).ok_or_else(|| {
                    Error::new(
                        Status::GeometryMismatch,
                        format!("decode rank has no KV region for layer {}", e.layer_id),
                    )
                })
            })
            .collect::<Result<_>>()?;
        let bytes = match stage.as_deref_mut() {
            Some(st) => {
                write_pair_device(inner, st, &req, &row_bytes, &dst_regions, &m.link, &opts)?
            }
            None => write_pair(inner, idx, &req, &row_bytes, &dst_regions, &m.link, flight)?,
        };
        sent.push(bytes);
        if job.last && !inner.cfg.aux.is_empty() {
            let mut ops = Vec::new();
            for (i, (a, r)) in inner.cfg.aux.iter().zip(&inner.aux_regions).enumerate() {
                let (dr, ditem) = *m.link.regions.aux.get(i).ok_or_else(|| {
                    Error::new(
                        Status::GeometryMismatch,
                        format!(
                            "decode rank has {} aux buffers, prefill {}",
                            m.link.regions.aux.len(),
                            inner.cfg.aux.len()
                        ),
                    )
                })?;
                if ditem != a.item_bytes {
                    return Err(Error::new(
                        Status::GeometryMismatch,
                        format!(
                            "aux buffer {i}: prefill rows are {} B, decode rows {ditem} B",
                            a.item_bytes
                        ),
                    ));
                }
                ops.push(WriteOp {
                    local_region: r.id,
                    local_offset: job.aux_index * a.item_bytes,
                    remote_region: dr,
                    remote_offset: m.aux_index * ditem,
                    len: a.item_bytes,
                });
            }
            flight.submit(&m.link, &ops, None)?;
        }
        // a request without state rows on either side moves no state
        if job.last && !(job.state_indices.is_empty() && m.state_indices.is_empty()) {
            let ops = state_ops(inner, job, m)?;
            flight.submit(&m.link, &ops, None)?;
        }
    }
    Ok(sent)
}

/// The state rows of the room's last chunk, whole, to one decode rank.
fn state_ops(inner: &Inner, job: &Job, m: &MetaInfo) -> Result<Vec<WriteOp>> {
    let n = inner.cfg.state.len();
    if job.state_indices.len() != n || m.state_indices.len() != n || m.link.regions.state.len() != n
    {
        return Err(Error::new(
            Status::GeometryMismatch,
            format!(
                "room {}: state rows: prefill has {n} state buffers and gave {} rows; decode instance {} has {} buffers and gave {} rows",
                job.room,
                job.state_indices.len(),
                m.link.hello.instance_id,
                m.link.regions.state.len(),
                m.state_indices.len()
            ),
        ));
    }
    let mut ops = Vec::with_capacity(n);
    for (i, (b, r)) in inner.cfg.state.iter().zip(&inner.state_regions).enumerate() {
        let (dr, ditem) = m.link.regions.state[i];
        if ditem != b.item_bytes {
            return Err(Error::new(
                Status::GeometryMismatch,
                format!(
                    "state buffer {i}: prefill rows are {} B, decode rows {ditem} B",
                    b.item_bytes
                ),
            ));
        }
        ops.push(WriteOp {
            local_region: r.id,
            local_offset: job.state_indices[i] * b.item_bytes,
            remote_region: dr,
            remote_offset: m.state_indices[i] * ditem,
            len: b.item_bytes,
        });
    }
    Ok(ops)
}

/// A transport error of one batch, naming the room and the decode rank.
fn write_error(room: u64, link: &DecodeLink, e: &Error) -> Error {
    Error::new(
        e.status(),
        format!(
            "writing room {room} to decode rank instance {}: {}",
            link.hello.instance_id,
            e.detail()
        ),
    )
}

/// One submitted batch of a [`Flight`]: its link, its id, and the host
/// staging slot it reads (`None`: it reads the caller's memory only).
struct InFlight {
    link: Arc<DecodeLink>,
    id: BatchId,
    slot: Option<usize>,
}

/// The batches of one chunk in flight together, over every decode rank's
/// link. Each is one of the room's writes in flight (`begin_write` before
/// its submit, `end_write` once waited), so an abort stays fenced until
/// every one completed; a host staging slot is waited free before it is
/// gathered into again ([`Flight::free_slot`]); and nothing outlives the
/// chunk: [`Flight::drain`] waits for them all (dropping a flight does too).
struct Flight<'a> {
    inner: &'a Inner,
    opts: BatchOptions,
    pending: Vec<InFlight>,
    /// Slots handed out so far (the next slot is this modulo the slot count).
    turns: usize,
}

impl<'a> Flight<'a> {
    fn new(inner: &'a Inner, opts: BatchOptions) -> Flight<'a> {
        Flight {
            inner,
            opts,
            pending: Vec::new(),
            turns: 0,
        }
    }

    /// Submits `ops` over `link` without waiting (nothing for no ops).
    fn submit(
        &mut self,
        link: &Arc<DecodeLink>,
        ops: &[WriteOp],
        slot: Option<usize>,
    ) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let (room, epoch) = (self.opts.room, self.opts.epoch);
        lock(&self.inner.rooms).begin_write(room, epoch)?;
        match link.data.submit(ops, &self.opts) {
            Ok(id) => {
                self.pending.push(InFlight {
                    link: link.clone(),
                    id,
                    slot,
                });
                Ok(())
            }
            Err(e) => {
                lock(&self.inner.rooms).end_write(room, epoch);
                Err(write_error(room, link, &e))
            }
        }
    }

    /// Waits for the `i`-th pending batch (removed either way).
    fn wait_at(&mut self, i: usize) -> Result<()> {
        let b = self.pending.remove(i);
        let r = b
            .link
            .data
            .wait(b.id, self.opts.timeout + Duration::from_secs(1));
        lock(&self.inner.rooms).end_write(self.opts.room, self.opts.epoch);
        r.map(|_| ())
            .map_err(|e| write_error(self.opts.room, &b.link, &e))
    }

    /// The next of `slots` staging slots in turn, waited free (every batch
    /// that reads it completed).
    fn next_slot(&mut self, slots: usize) -> Result<usize> {
        let slot = self.turns % slots.max(1);
        self.turns += 1;
        self.free_slot(slot)?;
        Ok(slot)
    }

    /// Waits for every pending batch that reads staging slot `slot`.
    fn free_slot(&mut self, slot: usize) -> Result<()> {
        while let Some(i) = self.pending.iter().position(|b| b.slot == Some(slot)) {
            self.wait_at(i)?;
        }
        Ok(())
    }

    /// Waits for every pending batch, oldest first; the first failure is
    /// returned once all of them completed or failed.
    fn drain(&mut self) -> Result<()> {
        let mut first = None;
        while !self.pending.is_empty() {
            if let Err(e) = self.wait_at(0) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        // only after a panic mid-chunk: `run_job` drains every flight
        let _ = self.drain();
    }
}

/// Slots a worker's host staging buffer is cut into (fewer when a slot
/// would not hold one token): two halves, one gathered into while the other
/// is on the wire (four measured no faster on the demo).
const STAGING_SLOTS: u64 = 2;

/// Submits one pair's tokens of a chunk into `flight`: packed through the
/// worker's host staging buffer when that makes fewer writes, else straight
/// from the pool. The staging is used as [`STAGING_SLOTS`] slots: each slice
/// is gathered into the next slot, waited free first, while the batches of
/// the others are on the wire.
fn write_pair(
    inner: &Inner,
    idx: usize,
    req: &PairRequest<'_>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    link: &Arc<DecodeLink>,
    flight: &mut Flight<'_>,
) -> Result<u64> {
    let tokens = req.token_count();
    if tokens == 0 {
        return Ok(0);
    }
    let token_bytes: u64 = row_bytes.iter().sum();
    // one walk counts the writes both ways: unpacked runs (pool rows) and
    // packed runs (consecutive staging indices)
    let (mut unpacked, mut packed) = (0u64, 0u64);
    let (mut mu, mut mp) = (RunMerger::default(), RunMerger::default());
    let mut next = 0u64;
    req.for_each_segment(|seg| {
        mu.push(seg.src_row, seg.dst_row, seg.len, &mut |_| unpacked += 1);
        mp.push(next, seg.dst_row, seg.len, &mut |_| packed += 1);
        next += seg.len;
    })?;
    mu.finish(&mut |_| unpacked += 1);
    mp.finish(&mut |_| packed += 1);
    let staging = inner.staging.get(idx);
    let (slots, slot_bytes) = staging.map_or((1, 0), |(b, _)| {
        let len = b.len() as u64;
        let n = (len / token_bytes.max(1)).clamp(1, STAGING_SLOTS);
        (n as usize, len / n)
    });
    let cap_tokens = slot_bytes / token_bytes.max(1);
    if staging.is_none() || packed * 2 > unpacked || cap_tokens == 0 {
        let mut ops = Vec::new();
        req.for_each_run(false, |r| {
            for (e, &rb) in row_bytes.iter().enumerate() {
                ops.push(WriteOp {
                    local_region: inner.pool_regions[e].id,
                    local_offset: r.src * rb,
                    remote_region: dst_regions[e],
                    remote_offset: r.dst * rb,
                    len: r.len * rb,
                });
            }
        })?;
        flight.submit(link, &ops, None)?;
        return Ok(tokens * token_bytes);
    }
    let (buf, desc) = staging.expect("checked above");
    // SAFETY: pool memory is valid for the engine's life (Engine::new contract); read-only here.
    let pools: Vec<&[u8]> = inner
        .pool_regions
        .iter()
        .map(|r| unsafe { std::slice::from_raw_parts(r.addr as *const u8, r.len as usize) })
        .collect();
    for sub in slice_requests(req, cap_tokens)? {
        let n = sub.token_count();
        let pack = PackLayout::new(n, row_bytes)?;
        let mut spans = Vec::new();
        let mut next = 0u64;
        let mut m = RunMerger::default();
        sub.for_each_segment(|seg| {
            m.push(seg.src_row, next, seg.len, &mut |r: Run| spans.push(r));
            next += seg.len;
        })?;
        m.finish(&mut |r: Run| spans.push(r));
        let slot = flight.next_slot(slots)?;
        let offset = slot as u64 * slot_bytes;
        // SAFETY: this worker is the only user of its staging buffer, and every
        // batch reading this slot completed (next_slot); the slot's
        // `slot_bytes` hold the pack (`cap_tokens` tokens at most) and lie in the buffer.
        let out = unsafe {
            std::slice::from_raw_parts_mut(
                buf.as_ptr().add(offset as usize) as *mut u8,
                pack.total_bytes as usize,
            )
        };
        crate::relayout::cpu::gather(&pools, row_bytes, &spans, &pack, out)?;
        let ops = staged_ops(
            &sub,
            row_bytes,
            dst_regions,
            desc.id,
            offset,
            &pack.entry_offsets,
        )?;
        flight.submit(link, &ops, Some(slot))?;
    }
    Ok(tokens * token_bytes)
}

/// The chunk's pair cut into consecutive sub-requests of at most
/// `cap_tokens` pair tokens each (one staging slice each); sub-requests
/// without tokens of the pair are left out.
fn slice_requests<'a>(req: &PairRequest<'a>, cap_tokens: u64) -> Result<Vec<PairRequest<'a>>> {
    if cap_tokens == 0 {
        return Err(Error::new(
            Status::Relayout,
            "the staging buffer cannot hold one token",
        ));
    }
    let mut out = Vec::new();
    let end = req.start + req.num_tokens;
    let mut s = req.start;
    while s < end {
        let (mut lo, mut hi) = (s + 1, end);
        let count = |e: u64| {
            PairRequest {
                start: s,
                num_tokens: e - s,
                ..*req
            }
            .token_count()
        };
        if count(hi) > cap_tokens {
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if count(mid) <= cap_tokens {
                    lo = mid
                } else {
                    hi = mid - 1
                }
            }
        } else {
            lo = hi;
        }
        let sub = PairRequest {
            start: s,
            num_tokens: lo - s,
            ..*req
        };
        if sub.token_count() > 0 {
            out.push(sub);
        }
        s = lo;
    }
    Ok(out)
}

/// Writes of one staged slice: packed rows (entry-major at `entry_offsets`
/// from `offset` in staging region `region`) to the decode rank's pool rows.
fn staged_ops(
    sub: &PairRequest<'_>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    region: u64,
    offset: u64,
    entry_offsets: &[u64],
) -> Result<Vec<WriteOp>> {
    let mut ops = Vec::new();
    sub.for_each_run(true, |r| {
        for (e, &rb) in row_bytes.iter().enumerate() {
            ops.push(WriteOp {
                local_region: region,
                local_offset: offset + entry_offsets[e] + r.src * rb,
                remote_region: dst_regions[e],
                remote_offset: r.dst * rb,
                len: r.len * rb,
            });
        }
    })?;
    Ok(ops)
}

/// Writes one pair's tokens of a chunk from device pools: gathered on the
/// GPU slice by slice into the worker's device staging and written from there
/// (zero copy, the link's `zero_copy`: rdma with GPUDirect RDMA), or copied
/// to its pinned host half and written from there; slice `i+1` is gathered
/// (and copied) while slice `i` is on the wire. A NIC that refuses the device
/// staging (`NoGpuDirect`) moves the link to the host path for good and the
/// pair is written again through it (rewriting the same bytes is harmless).
fn write_pair_device(
    inner: &Inner,
    stage: &mut DeviceStage,
    req: &PairRequest<'_>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    link: &Arc<DecodeLink>,
    opts: &BatchOptions,
) -> Result<u64> {
    let tokens = req.token_count();
    if tokens == 0 {
        return Ok(0);
    }
    // the CPU cannot read device memory: never a checksum over these batches
    let opts = BatchOptions {
        checksum: false,
        ..*opts
    };
    let subs = slice_requests(req, stage.slice_tokens(row_bytes))?;
    let spans = subs
        .iter()
        .map(crate::relayout::gather_spans)
        .collect::<Result<Vec<_>>>()?;
    let bases: Vec<u64> = inner.pool_regions.iter().map(|r| r.addr).collect();
    let run = |stage: &mut DeviceStage, zero_copy: bool| {
        // SAFETY: the pools were checked as device memory of the stage's device
        // at creation and stay valid for the engine's life (Engine::new contract);
        // the plan's rows lie inside them (page ids checked by `send`).
        unsafe {
            stage.run(&bases, row_bytes, &spans, zero_copy, |s| {
                let ops = staged_ops(
                    &subs[s.index],
                    row_bytes,
                    dst_regions,
                    s.region,
                    s.offset,
                    &s.entry_offsets,
                )?;
                // each slice completes before its staging half is gathered into again
                let mut f = Flight::new(inner, opts);
                f.submit(link, &ops, None)?;
                f.drain()
            })
        }
    };
    let zero_copy = link.zero_copy.load(Ordering::Acquire);
    match run(stage, zero_copy) {
        Err(e) if zero_copy && e.status() == Status::NoGpuDirect => {
            // The NIC refused to register the device staging (nothing was
            // posted from it). Only a host-path success
            // proves the device staging was the problem (not the peer's pools).
            run(stage, false)?;
            if link.zero_copy.swap(false, Ordering::AcqRel) {
                inner.log_no_gpu_direct(&e);
            }
        }
        r => r?,
    }
    Ok(tokens * row_bytes.iter().sum::<u64>())
}
