//! Creating an [`Engine`]: the pools checked against the topology, the
//! memory registered with the agent, the threads started and the rank
//! registered with the bootstrap.

use super::config::EngineConfig;
use super::deadline::deadline_loop;
use super::decode::Decode;
use super::device::DeviceStage;
use super::handle::{Engine, Inner};
use super::prefill::worker::worker_loop;
use super::prefill::{accept_loop, Prefill};
use super::room::RoomTable;
use super::state::{lock, Shared};
use crate::bootstrap::client::Registrar;
use crate::bootstrap::schema::{InstanceId, RegionDescriptor, Registration, Role};
use crate::error::{Error, Result, Status};
use crate::memory::RegionDesc;
use crate::transport::{Agent, AgentOptions, TransportKind};
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};

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
        validate(&cfg)?;
        // the bootstrap instance id is also the one both channels authenticate as
        let instance = InstanceId::random()?;
        let agent = open_agent(&cfg, instance)?;
        let store = crate::bootstrap::open_store(&cfg.bootstrap, cfg.token.as_deref())?;
        let workers = if cfg.role == Role::Prefill {
            cfg.workers.max(1)
        } else {
            0
        };
        // SAFETY: this function's contract is `register_regions`' (valid pool, aux and state memory).
        let regions = unsafe { register_regions(&cfg, &agent, workers)? };
        let metrics_listener = cfg
            .metrics_listen
            .as_deref()
            .map(super::metrics_http::bind)
            .transpose()?;
        let metrics_addr = metrics_listener
            .as_ref()
            .map(|l| l.local_addr())
            .transpose()?;
        let shared = Shared {
            cfg,
            agent,
            store,
            registrar: Mutex::new(None),
            rooms: Mutex::new(RoomTable::new()),
            cv: Condvar::new(),
            pool_regions: regions.pools,
            aux_regions: regions.aux,
            state_regions: regions.state,
            staging: regions.staging,
            closed: AtomicBool::new(false),
            gpu_direct_logged: AtomicBool::new(false),
            metrics: Default::default(),
            metrics_addr,
        };
        let inner = match shared.cfg.role {
            Role::Prefill => Inner::Prefill(Arc::new(Prefill::new(shared))),
            Role::Decode => Inner::Decode(Arc::new(Decode::new(shared))),
        };
        let (mut endpoints, listener) = start_threads(&inner, workers, regions.stages)?;
        if let (Some(l), Some(addr)) = (metrics_listener, metrics_addr) {
            endpoints.insert("metrics".to_string(), addr.to_string());
            let w = inner.downgrade();
            crate::threads::spawn("pdxfer-metrics".into(), move || {
                super::metrics_http::serve(w, l)
            })?;
        }
        register_with_bootstrap(inner.shared(), endpoints)?;
        // the prefill accepts decode ranks only once its registration is stored
        if let (Some(l), Inner::Prefill(p)) = (listener, &inner) {
            let w = Arc::downgrade(p);
            crate::threads::spawn("pdxfer-ctl".into(), move || accept_loop(w, l))?;
        }
        Ok(Engine {
            inner,
            room_keys: Default::default(),
        })
    }
}

/// Checks the configuration before anything is opened: the topology, one
/// pool per topology entry with its layer and page size, and (device pools)
/// the device preflight.
fn validate(cfg: &EngineConfig) -> Result<()> {
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
    check_page_strides(cfg)?;
    if let Some(ordinal) = cfg.pool_device {
        super::device::preflight(cfg, ordinal)?;
    }
    super::nccl_link::preflight(cfg)?;
    Ok(())
}

/// The pools' page strides ([`PoolGeometry`](crate::layout::PoolGeometry)):
/// each valid and one step for all. Every transport moves them (interleaved
/// pools over rdma are one NIC region per allocation:
/// [`ViewHulls`](crate::transport::rdma::view_hulls::ViewHulls)).
fn check_page_strides(cfg: &EngineConfig) -> Result<()> {
    crate::layout::side_page_step(
        &cfg.pools
            .iter()
            .enumerate()
            .map(|(i, p)| {
                p.geometry().map_err(|e| {
                    Error::new(
                        e.status(),
                        format!("pool {i} (layer {}): {}", p.layer_id, e.detail()),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?,
    )?;
    Ok(())
}

/// The engine's agent (the decode's listens for data connections); with
/// transport rdma, checks there is a usable NIC, and for decode device
/// pools that it can do GPUDirect RDMA and that the device orders or
/// flushes the NIC's writes.
/// The engine's `token` (else `PDXFER_CLUSTER_SECRET`) is the cluster secret
/// both the agent and the control channel authenticate peers with.
fn open_agent(cfg: &EngineConfig, instance: InstanceId) -> Result<Agent> {
    let agent = Agent::new(&AgentOptions {
        listen: (cfg.role == Role::Decode).then(|| format!("{}:0", cfg.host)),
        limits: cfg.listen_limits,
        handshake_timeout: cfg.handshake_timeout,
        idle_timeout: cfg.idle_timeout,
        pin_timeout: cfg.pin_timeout,
        gpu: cfg.pool_device,
        secret: cfg.token.clone(),
        instance: Some(instance.0.to_be_bytes()),
        // PDXFER_TCP_ENCRYPT, on every rank alike
        tcp_encrypt: None,
        rdma_traffic_class: cfg.rdma_traffic_class,
        #[cfg(any(test, feature = "testing"))]
        testing: cfg.testing.clone(),
    })
    .map_err(|e| {
        if e.status() == Status::InvalidArgument && cfg.token.is_some() {
            Error::new(
                e.status(),
                format!("engine token (the cluster secret): {}", e.detail()),
            )
        } else {
            e
        }
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
    if let (Role::Decode, Some(ordinal)) = (cfg.role, cfg.pool_device) {
        super::device::decide_gpu_direct_writes(cfg, &agent, ordinal)?;
    }
    Ok(agent)
}

/// The memory an engine registers with its agent.
struct Regions {
    /// One per KV pool, in `cfg.pools` order.
    pools: Vec<RegionDesc>,
    /// One per aux buffer.
    aux: Vec<RegionDesc>,
    /// One per state buffer.
    state: Vec<RegionDesc>,
    /// Host pools: each prefill worker's host staging buffer (none when
    /// packing is off).
    staging: Vec<(Vec<u8>, RegionDesc)>,
    /// Device pools: each prefill worker's GPU stage.
    stages: Vec<DeviceStage>,
}

/// Registers the pools, aux and state buffers and the workers' staging with
/// the agent's registry (device pools: checked against the driver, one GPU
/// stage per worker; decode device pools get the tcp receiver's
/// host-to-device writer); with transport rdma, registers them all with the
/// NICs now rather than inside the first handshake.
///
/// # Safety
/// As [`Engine::new`]: every pool, aux and state buffer of `cfg` is valid
/// memory of its size for the engine's whole life.
unsafe fn register_regions(cfg: &EngineConfig, agent: &Agent, workers: usize) -> Result<Regions> {
    let reg = agent.registry();
    let mut pool_spans = Vec::new();
    let mut views = Vec::new();
    for pool in &cfg.pools {
        let g = pool.geometry()?;
        pool_spans.push((pool.base, g.span()));
        // strided pools may interleave (block-outermost): registered as views
        views.push(!g.is_compact());
    }
    // device pools: one GPU stage per worker (checks the pools first)
    let stages = match cfg.pool_device {
        Some(ordinal) => DeviceStage::open(ordinal, cfg.staging_bytes, &pool_spans, reg, workers)?,
        None => Vec::new(),
    };
    // decode device pools: the tcp receiver copies into them through this writer
    let decode_writer = match (cfg.role, cfg.pool_device) {
        (Role::Decode, Some(ordinal)) => Some(super::device::decode_writer(ordinal, &pool_spans)?),
        _ => None,
    };
    let mut pool_regions = Vec::new();
    for (&(base, len), &view) in pool_spans.iter().zip(&views) {
        pool_regions.push(match (cfg.pool_device, &decode_writer) {
            // SAFETY: the caller guarantees the pool memory is valid for the engine's life (function contract).
            (Some(ordinal), w) if view => unsafe {
                reg.register_device_view(base, len as usize, ordinal, w.clone())?
            },
            // SAFETY: as above.
            (None, _) if view => unsafe { reg.register_host_view(base as *mut u8, len as usize)? },
            // SAFETY: as above.
            (Some(ordinal), Some(w)) => unsafe {
                reg.register_device_with(base, len as usize, ordinal, w.clone())?
            },
            // SAFETY: as above.
            (Some(ordinal), None) => unsafe { reg.register_device(base, len as usize, ordinal)? },
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
    if cfg.role == Role::Decode && cfg.prefault {
        let host = cfg.pool_device.is_none().then_some(&pool_spans[..]);
        let rows: Vec<(u64, u64)> = (cfg.aux.iter().chain(&cfg.state))
            .map(|a| (a.base, a.item_bytes * a.count))
            .collect();
        // SAFETY: every span is pool, aux or state memory the caller guarantees valid (function contract).
        unsafe { prefault(host.into_iter().flatten().chain(&rows)) };
    }
    let mut staging = Vec::new();
    for _ in 0..workers {
        if cfg.staging_bytes == 0 || cfg.pool_device.is_some() {
            break;
        }
        let mut buf = super::path::staged::faulted_in(cfg.staging_bytes as usize);
        // SAFETY: the buffer is owned by the engine and unregistered (registry dropped) before it is freed.
        let desc = unsafe { reg.register_host(buf.as_mut_ptr(), buf.len())? };
        staging.push((buf, desc));
    }
    if cfg.transport == TransportKind::Rdma {
        // Register the pools with the NICs now, not inside the first handshake;
        // a prefill with device pools sends only from its staging buffers, so
        // its pools (possibly most of the GPU's memory) are left out.
        let t0 = std::time::Instant::now();
        let skip: Vec<u64> = match (cfg.role, cfg.pool_device) {
            (Role::Prefill, Some(_)) => pool_regions.iter().map(|r| r.id).collect(),
            _ => Vec::new(),
        };
        if (cfg.role, cfg.pool_device.is_some()) == (Role::Decode, true) {
            // peers write these device pools by GPUDirect: one the NIC cannot
            // register fails the engine now, not each room's first batch
            agent
                .rdma_register_all_but_devices_required(&skip)
                .map_err(|e| {
                    Error::new(
                        e.status(),
                        format!(
                            "{}; use transport tcp (the receiver copies into device memory) or auto",
                            e.detail()
                        ),
                    )
                })?;
        } else {
            agent.rdma_register_all_but(&skip)?;
        }
        log::info!(
            "engine: registered {} region(s) with the RDMA NICs in {:?}",
            agent.registry().descriptors().len(),
            t0.elapsed()
        );
    }
    Ok(Regions {
        pools: pool_regions,
        aux: aux_regions,
        state: state_regions,
        staging,
        stages,
    })
}

/// Faults the decode's host memory in before any request (see
/// [`EngineConfig::prefault`]); a kernel that refuses is logged, not an error.
///
/// # Safety
/// Every `(base, len)` span is mapped memory of this process.
unsafe fn prefault<'a>(spans: impl Iterator<Item = &'a (u64, u64)>) {
    let t0 = std::time::Instant::now();
    let mut bytes = 0u64;
    for &(base, len) in spans {
        // SAFETY: the caller guarantees the span is mapped (function contract).
        match unsafe { crate::memory::prefault::populate_write(base as *mut u8, len as usize) } {
            Ok(()) => bytes += len,
            Err(e) => {
                log::warn!("engine: could not fault in {len} B at 0x{base:x} ahead of the first request ({e}); its pages fault on first touch");
                return;
            }
        }
    }
    log::info!(
        "engine: faulted in {bytes} B of host KV, aux and state memory in {:?}",
        t0.elapsed()
    );
}

/// Binds the prefill's control listener (accepted from once the rank is
/// registered; peers wait in the backlog) and starts its transfer workers
/// (each owning its GPU stage, with device pools) and the deadline thread.
/// Returns the endpoints to advertise and the listener.
fn start_threads(
    inner: &Inner,
    workers: usize,
    mut stages: Vec<DeviceStage>,
) -> Result<(BTreeMap<String, String>, Option<TcpListener>)> {
    let mut endpoints = BTreeMap::new();
    let mut listener = None;
    if let Inner::Prefill(inner) = inner {
        let l = TcpListener::bind(format!("{}:0", inner.cfg.host))?;
        crate::transport::check_listener(
            inner.agent.auth(),
            &l.local_addr()?,
            "the prefill's control listener",
        )?;
        endpoints.insert("ctl".to_string(), l.local_addr()?.to_string());
        // accepted only once the registration is stored (below); peers wait in the backlog
        listener = Some(l);
        for i in 0..workers {
            let (w, jobs) = (Arc::downgrade(inner), inner.jobs.clone());
            // the worker owns its GPU stage (device pools) for its whole life
            let stage = (!stages.is_empty()).then(|| stages.remove(0));
            crate::threads::spawn(format!("pdxfer-worker-{i}"), move || {
                worker_loop(w, jobs, i, stage)
            })?;
        }
    } else if let Some(a) = inner.shared().agent.local_addr() {
        endpoints.insert("data".to_string(), a.to_string());
    }
    let w = inner.downgrade();
    crate::threads::spawn("pdxfer-deadlines".into(), move || deadline_loop(w))?;
    Ok((endpoints, listener))
}

/// Registers the rank with the bootstrap (its endpoints, KV and aux regions)
/// and keeps the lease alive.
fn register_with_bootstrap(inner: &Shared, endpoints: BTreeMap<String, String>) -> Result<()> {
    let mut registration = Registration::new(
        &inner.cfg.cluster,
        inner.cfg.role,
        InstanceId(u128::from_be_bytes(inner.agent.instance().0)),
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
    Ok(())
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
