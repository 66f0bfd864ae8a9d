//! How an engine is set up: [`EngineConfig`] and the memory it is given
//! ([`KvPool`], [`AuxBuffer`]).

use crate::bootstrap::schema::Role;
use crate::layout::Topology;
use crate::transport::listen::ListenLimits;
use crate::transport::TransportKind;
use std::time::Duration;

/// One KV entry's pool: `num_pages` pages of `page_bytes` at `base`, page
/// `p` at `base + p * page_stride` ([`PoolGeometry`](crate::layout::PoolGeometry)).
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
    /// Bytes from one page's start to the next's: `page_bytes` (or 0, the
    /// same) for pages end to end; larger for block-outermost or padded
    /// layouts, a whole number of pages (docs/engine.md, "Page stride").
    pub page_stride: u64,
}

impl KvPool {
    /// The pool's page geometry (stride, span), validated.
    pub fn geometry(&self) -> crate::Result<crate::layout::PoolGeometry> {
        crate::layout::PoolGeometry::new(self.page_bytes, self.page_stride, self.num_pages)
    }
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
    /// The cluster secret (at least 16 bytes): guards bootstrap writes and
    /// authenticates every peer connection (control channel and data plane).
    /// `None` reads `PDXFER_CLUSTER_SECRET`; without either, peers are not
    /// authenticated and only loopback listeners are allowed (`host`).
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
    /// of CUDA device `n`. The rules for device pools (transports, staging,
    /// what is refused) are in docs/gpu.md, "KV pools in device memory".
    pub pool_device: Option<u32>,
    /// Aux buffers (same count and item sizes on both sides).
    pub aux: Vec<AuxBuffer>,
    /// Optional state buffers (Mamba/SWA-like per-request state): one row per
    /// buffer and request, sent whole to every decode rank after the KV
    /// (state is not DCP-sharded, as in SGLang).
    pub state: Vec<AuxBuffer>,
    /// Transport for KV data (`Auto`: cma on one host, else rdma when both
    /// sides have a usable NIC, else tcp; `Rdma` needs a NIC: `no_rdma_device`;
    /// `Nccl`: device pools on both sides, NCCL point-to-point, `no_nccl`
    /// without a loadable NCCL).
    pub transport: TransportKind,
    /// Host to listen on.
    pub host: String,
    /// Prefill: bytes of each worker's staging (pack) buffer; 0 disables packing.
    pub staging_bytes: u64,
    /// Prefill: when a same-host decode rank's KV pools are mapped into this
    /// process (cma, pools allocated with
    /// [`shared::alloc_pool`](crate::memory::shared::alloc_pool)), gather
    /// rows straight into its pool rows: one copy, no staging. `false` keeps
    /// the staged path everywhere.
    pub one_copy: bool,
    /// Decode: fault the host KV pools, aux and state buffers in when the
    /// engine is created (`MADV_POPULATE_WRITE`: every page mapped writable,
    /// no byte changed), so the first request's bytes take no page faults.
    /// It commits the memory now; `false` leaves the pages to first touch.
    pub prefault: bool,
    /// Prefill: transfer worker threads.
    pub workers: usize,
    /// Default room deadline.
    pub room_timeout: Duration,
    /// Deadline of one transfer batch.
    pub batch_timeout: Duration,
    /// Bootstrap lease TTL.
    pub lease_ttl: Duration,
    /// Where to serve the engine's Prometheus text over HTTP (`GET
    /// /metrics`), `host:port` (port 0 picks one; see
    /// [`Engine::metrics_addr`](super::Engine::metrics_addr)); `None` serves
    /// nothing ([`Engine::metrics`](super::Engine::metrics) still answers).
    /// The responder has no authentication: keep it on loopback or a
    /// monitoring network.
    pub metrics_listen: Option<String>,
    /// Bounds on the connections peers open to this rank (the decode's
    /// agent, the prefill's control port): waiting for a first message,
    /// in a handshake, live; the excess is refused.
    pub listen_limits: ListenLimits,
    /// The agent's peer timeouts: handshake, idle session, region pin
    /// (see [`AgentOptions`](crate::transport::AgentOptions)).
    pub handshake_timeout: Duration,
    /// See [`AgentOptions::idle_timeout`](crate::transport::AgentOptions::idle_timeout).
    pub idle_timeout: Duration,
    /// See [`AgentOptions::pin_timeout`](crate::transport::AgentOptions::pin_timeout).
    pub pin_timeout: Duration,
    /// Prefill: keepalive interval of the idle data connections to decode
    /// ranks (shorter than their `idle_timeout`).
    pub keepalive: Duration,
    /// Decode: grant each room's rows to its prefill ranks once, with the
    /// metadata, so their batches skip the per-batch round trip where the
    /// data connection supports it (cma, tcp, rdma); `false` keeps the per-batch
    /// grant for every batch.
    pub room_grants: bool,
    /// RDMA: the RoCE traffic class (IPv6 traffic class / IPv4 ToS byte:
    /// DSCP << 2) of the QPs, e.g. 106 (DSCP 26) where the fabric's lossless
    /// (PFC) class is DSCP 26; `None` reads `PDXFER_RDMA_TRAFFIC_CLASS`,
    /// else 0 (see docs/transports.md).
    pub rdma_traffic_class: Option<u8>,
    /// Test knobs of the engine's agent (e.g. the software RDMA fabric);
    /// the default is production behaviour.
    #[cfg(any(test, feature = "testing"))]
    pub testing: crate::transport::TestKnobs,
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
            one_copy: true,
            prefault: true,
            workers: 2,
            room_timeout: Duration::from_secs(60),
            batch_timeout: Duration::from_secs(30),
            lease_ttl: Duration::from_secs(10),
            metrics_listen: None,
            listen_limits: ListenLimits::default(),
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            room_grants: true,
            pin_timeout: Duration::from_secs(60),
            keepalive: Duration::from_secs(15),
            rdma_traffic_class: None,
            #[cfg(any(test, feature = "testing"))]
            testing: Default::default(),
        }
    }

    /// The transport of the agent's data connection: the configured one, or
    /// `Auto` for an nccl engine (its KV moves over NCCL; the aux and state
    /// rows, in host memory, over the automatic choice).
    pub(crate) fn data_transport(&self) -> TransportKind {
        match self.transport {
            TransportKind::Nccl => TransportKind::Auto,
            t => t,
        }
    }

    /// The page step of this rank's KV pools (1: pages end to end), checked
    /// when the engine was created ([`crate::layout::side_page_step`]).
    pub(crate) fn page_step(&self) -> u64 {
        self.pools
            .first()
            .and_then(|p| p.geometry().ok())
            .map_or(1, |g| g.page_step())
    }

    /// Checks every page id against every pool: a page id addresses the same
    /// page of each KV pool, so it must lie inside the smallest one (pools may
    /// differ in size; a gather must never read or write past any of them).
    /// `OutOfBounds` naming the first bad index and the pool it overruns.
    pub(crate) fn check_pages(&self, pages: &[u64], what: &str, side: &str) -> crate::Result<()> {
        let Some((p, pool)) = self
            .pools
            .iter()
            .enumerate()
            .min_by_key(|(_, p)| p.num_pages)
        else {
            return Ok(());
        };
        let limit = pool.num_pages;
        match pages.iter().enumerate().find(|(_, &pg)| pg >= limit) {
            None => Ok(()),
            Some((i, pg)) => Err(crate::Error::new(
                crate::Status::OutOfBounds,
                format!(
                    "{what}[{i}] = {pg} is outside the {side} pool {p} (layer {}) of {limit} pages",
                    pool.layer_id
                ),
            )),
        }
    }
}
