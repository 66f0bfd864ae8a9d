//! An in-process cluster of engines, the engine tests' fixture: an embedded
//! bootstrap server, prefill ranks (DCP `src_dcp`, usually 1) and decode
//! ranks (DCP `dcp`) over synthetic pools (heap, shared pool allocations, or
//! device memory: the fake libcuda where there is no GPU, the synthetic pools
//! then the host mirror that is uploaded and read back) and a chosen
//! transport (rdma on the software NIC fabric with the `testing` feature), with the steps
//! of one request as helpers: [`Cluster::open_room`] (fill, metadata,
//! senders), [`Cluster::send_all`] / [`Cluster::send_layerwise`],
//! [`Cluster::wait_success`], [`Cluster::verify`] and [`Cluster::finish`]
//! (wait, every received byte checked, cleared). Built with
//! [`Cluster::build`]; a test keeps to itself only what is specific to it.

use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, EngineConfig, KvPoll, SendOptions};
use pdxfer::layout::{DcpLayout, Side};
#[cfg(feature = "testing")]
use pdxfer::transport::rdma::{fake::FakeNic, handshake::Mtu, nic::NicProvider};
use pdxfer::transport::TransportKind;
#[cfg(feature = "cuda")]
use pdxfer::{cuda::DeviceBuffer, relayout::gpu::GpuRelayout};
use std::ops::Range;
#[cfg(feature = "testing")]
use std::sync::Arc;
use std::time::Duration;

/// Bytes of one layer of one token row.
pub const ROW: u64 = 64;
/// Tokens per page.
pub const P: u64 = 16;
/// Pages of a prefill rank's pools and of a decode rank's.
pub const PREFILL_PAGES: u64 = 64;
/// See [`PREFILL_PAGES`].
pub const DECODE_PAGES: u64 = 32;
/// The aux item every request fills (prefill) and checks (decode).
pub const AUX_ITEM: u64 = 3;
/// The aux slot the decode ranks receive the aux item into.
pub const AUX_SLOT: u64 = 5;

/// Where a decode rank's KV pools live.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Pools {
    /// Private heap memory: the prefill writes through staging or the wire.
    Heap,
    /// Shared pool allocations a same-host prefill maps (the one-copy path).
    Shared,
    /// Strided heap pools ([`SyntheticPools::new_strided`]): page `p` of a
    /// layer `step` pages after page `p - 1`; `interleaved`, every layer in
    /// one allocation (block-outermost, `step >= layers`), else one
    /// allocation per layer (padded pages). The bytes between pages are
    /// checked untouched by [`Cluster::finish`].
    Strided {
        /// Pages from one page's start to the next's.
        step: u64,
        /// Every layer in one allocation.
        interleaved: bool,
        /// In shared pool allocations (the one-copy path, as [`Pools::Shared`]).
        shared: bool,
    },
    /// Device memory of device 0 (`pool_device` 0), one allocation per
    /// layer, zeroed; the rank's [`SyntheticPools`] are its host mirror:
    /// [`Cluster::fill`] uploads it, [`Cluster::verify_rank`] reads back into it.
    #[cfg(feature = "cuda")]
    Device,
}

/// rdma runs on the software NIC fabric (two rails per engine; the fabric
/// exists with the `testing` feature).
#[cfg(feature = "testing")]
pub fn fake_nic(transport: TransportKind, name: &str) -> Option<Arc<dyn NicProvider>> {
    (transport == TransportKind::Rdma).then(|| FakeNic::new(name, 2, Mtu::Mtu4096) as _)
}

/// Fresh synthetic pools of `kind` (heap, or the host mirror of device
/// pools; shared pool allocations for [`Pools::Shared`]): `layers` layers of
/// `row`-byte rows, [`P`] tokens a page, `pages` pages, 8 aux slots of 32 bytes.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn pools_of(kind: Pools, layers: u32, row: u64, pages: u64, device_step: u64) -> SyntheticPools {
    match kind {
        #[cfg(feature = "cuda")]
        Pools::Device if device_step > 1 => {
            SyntheticPools::new_strided(layers, row, P, pages, 8, 32, device_step, false).unwrap()
        }
        Pools::Shared => SyntheticPools::new_shared(layers, row, P, pages, 8, 32).unwrap(),
        Pools::Strided {
            step,
            interleaved,
            shared,
        } => {
            let p = SyntheticPools::new_strided(layers, row, P, pages, 8, 32, step, interleaved)
                .unwrap();
            if shared {
                p.into_shared().unwrap()
            } else {
                p
            }
        }
        _ => SyntheticPools::new(layers, row, P, pages, 8, 32).unwrap(),
    }
}

/// Fresh synthetic heap pools: `layers` layers of [`ROW`]-byte rows, [`P`]
/// tokens a page, `pages` pages, 8 aux slots of 32 bytes.
pub fn pools(layers: u32, pages: u64) -> SyntheticPools {
    SyntheticPools::new(layers, ROW, P, pages, 8, 32).unwrap()
}

/// Device pools for the layers of `pools` (on the fake libcuda in the tests
/// that have no GPU): one allocation per layer, and `pools`' KV pools moved
/// onto them (same geometry; `pools` stays the host mirror to fill, upload
/// and read back into).
#[cfg(feature = "cuda")]
pub fn device_pools(
    g: &pdxfer::relayout::gpu::GpuRelayout,
    pools: &SyntheticPools,
) -> (Vec<pdxfer::cuda::DeviceBuffer>, Vec<pdxfer::engine::KvPool>) {
    let kv = pools.kv_pools();
    let bufs: Vec<_> = (0..kv.len())
        .map(|l| g.stream().alloc(pools.layer_bytes(l).len()).unwrap())
        .collect();
    let kv = kv
        .into_iter()
        .zip(&bufs)
        .map(|(p, d)| pdxfer::engine::KvPool { base: d.ptr(), ..p })
        .collect();
    (bufs, kv)
}

/// The config of one rank over `pools`, DCP `dcp` rank `r` (aux buffers,
/// transport, rdma on the software NIC fabric), for the caller to adjust.
pub fn config(
    role: Role,
    name: &str,
    url: &str,
    pools: &SyntheticPools,
    (dcp, r): (u32, u32),
    transport: TransportKind,
) -> EngineConfig {
    let mut cfg = EngineConfig::new(role, name, url, pools.topology(dcp, r), pools.kv_pools());
    cfg.aux = pools.aux_buffers();
    cfg.transport = transport;
    #[cfg(feature = "testing")]
    {
        cfg.testing.nic = fake_nic(transport, role.as_str());
    }
    cfg
}

/// One engine rank over `pools` with [`config`]; the pools are returned
/// beside it.
pub fn rank(
    role: Role,
    name: &str,
    url: &str,
    pools: SyntheticPools,
    dcp_rank: (u32, u32),
    transport: TransportKind,
) -> (Engine, SyntheticPools) {
    let cfg = config(role, name, url, &pools, dcp_rank, transport);
    // SAFETY: the pools are returned with the engine and kept alive next to it.
    (unsafe { Engine::new(cfg) }.unwrap(), pools)
}

/// Side `rank` of DCP `dcp` in SGLang's layout ([`P`]-token pages): its
/// `pages`, from position `origin`.
pub fn side(dcp: u64, rank: u64, pages: &[u64], origin: u64) -> Side<'_> {
    Side {
        layout: DcpLayout::sglang(P, dcp).unwrap(),
        rank,
        pages,
        origin,
    }
}

/// Each engine of `decode` opens `room` (deadline `timeout`, none: the room
/// timeout) and sends its metadata: pages `dst`, `prefix`, aux slot [`AUX_SLOT`].
pub fn open_decode<'a>(
    decode: impl IntoIterator<Item = &'a Engine>,
    room: u64,
    dst: &[u64],
    prefix: u64,
    timeout: Option<Duration>,
) {
    for e in decode {
        e.receiver(room, 0, timeout).unwrap();
        e.send_metadata(room, dst, prefix, AUX_SLOT).unwrap();
    }
}

/// Asserts that `e` ends `room` with `Success` (20 s at most); `what` names
/// it in the failure, with the room's failure.
pub fn assert_success(e: &Engine, room: u64, what: &str) {
    assert_eq!(
        e.wait(room, Duration::from_secs(20)),
        KvPoll::Success,
        "{what}: {:?}",
        e.failure(room)
    );
}

/// A test's own settings of one rank's config: its role, its DCP rank.
type Knobs = Box<dyn Fn(Role, u32, &mut EngineConfig)>;

/// What [`Cluster::build`] starts; each setter returns the spec.
pub struct Spec {
    name: String,
    layers: u32,
    src_dcp: u32,
    dcp: u32,
    transport: TransportKind,
    decode_transport: Option<TransportKind>,
    row: u64,
    prefill_pools: Pools,
    decode_pools: Pools,
    decode_device: usize,
    device_page_step: u64,
    prefill_staging: Option<u64>,
    decode_staging: Option<u64>,
    prefill_timeout: Option<Duration>,
    decode_timeout: Option<Duration>,
    receiver_timeout: Option<Duration>,
    metrics_listen: Option<String>,
    room_grants: Option<bool>,
    knobs: Option<Knobs>,
    #[cfg(feature = "testing")]
    rails: Option<usize>,
    #[cfg(feature = "testing")]
    prefill_nic: Option<Arc<FakeNic>>,
}

impl Spec {
    /// KV layers of every pool (default 4).
    pub fn layers(mut self, n: u32) -> Self {
        self.layers = n;
        self
    }
    /// Bytes of one layer of one token row (default [`ROW`]).
    pub fn row_bytes(mut self, row: u64) -> Self {
        self.row = row;
        self
    }
    /// The decode ranks' transport (default: the cluster's).
    pub fn decode_transport(mut self, t: TransportKind) -> Self {
        self.decode_transport = Some(t);
        self
    }
    /// The prefill ranks' KV pools (default [`Pools::Heap`]).
    pub fn prefill_pools(mut self, p: Pools) -> Self {
        self.prefill_pools = p;
        self
    }
    /// The decode ranks' KV pools (default [`Pools::Heap`]).
    pub fn decode_pools(mut self, p: Pools) -> Self {
        self.decode_pools = p;
        self
    }
    /// The CUDA device of the decode ranks' [`Pools::Device`] (default 0,
    /// the prefill's; transport nccl needs another: the fake libcuda with
    /// `PDXFER_FAKE_CUDA_DEVICES=2`).
    pub fn decode_device(mut self, ordinal: usize) -> Self {
        self.decode_device = ordinal;
        self
    }
    /// Pages from one page's start to the next in [`Pools::Device`] pools
    /// (default 1; more: padded pages, one allocation per layer, the host
    /// mirror [`SyntheticPools::new_strided`], the gaps checked by
    /// [`Cluster::finish`]).
    pub fn device_page_step(mut self, step: u64) -> Self {
        self.device_page_step = step;
        self
    }
    /// The decode ranks' `room_grants` (default: the engine's).
    pub fn room_grants(mut self, on: bool) -> Self {
        self.room_grants = Some(on);
        self
    }
    /// `f(role, dcp_rank, config)` adjusts every rank's config last (test
    /// knobs of one role or rank).
    pub fn knobs(mut self, f: impl Fn(Role, u32, &mut EngineConfig) + 'static) -> Self {
        self.knobs = Some(Box::new(f));
        self
    }
    /// Rails of each rank's software NIC over rdma (default 2); set, the
    /// ranks over `auto` get one too.
    #[cfg(feature = "testing")]
    pub fn rails(mut self, n: usize) -> Self {
        self.rails = Some(n);
        self
    }
    /// Prefill rank 0's software NIC over rdma, made and set (GPUDirect,
    /// refused registrations) by the caller, who keeps it to look at.
    #[cfg(feature = "testing")]
    pub fn prefill_nic(mut self, nic: Arc<FakeNic>) -> Self {
        self.prefill_nic = Some(nic);
        self
    }
    /// The prefill ranks' staging bytes (default: the engine's).
    pub fn staging(mut self, bytes: u64) -> Self {
        self.prefill_staging = Some(bytes);
        self
    }
    /// The decode ranks' staging bytes (default: the engine's).
    pub fn decode_staging(mut self, bytes: u64) -> Self {
        self.decode_staging = Some(bytes);
        self
    }
    /// The prefill ranks' room timeout (default: the engine's).
    pub fn room_timeout(mut self, t: Duration) -> Self {
        self.prefill_timeout = Some(t);
        self
    }
    /// The decode ranks' room timeout (default: the engine's).
    pub fn decode_room_timeout(mut self, t: Duration) -> Self {
        self.decode_timeout = Some(t);
        self
    }
    /// The deadline each decode rank's `receiver()` of [`Cluster::open_room`]
    /// is given (default none: the room timeout).
    pub fn receiver_timeout(mut self, t: Duration) -> Self {
        self.receiver_timeout = Some(t);
        self
    }
    /// The prefill (rank 0) serves `/metrics` on `addr`.
    pub fn metrics_listen(mut self, addr: Option<&str>) -> Self {
        self.metrics_listen = addr.map(str::to_string);
        self
    }

    /// Starts the server and every rank.
    pub fn start(self) -> Cluster {
        let server = BootstrapServer::start(ServerConfig::default()).unwrap();
        let url = server.url();
        #[cfg(feature = "cuda")]
        let gpu = [self.prefill_pools, self.decode_pools]
            .contains(&Pools::Device)
            .then(|| GpuRelayout::new(0).expect("device 0 (the fake libcuda without a GPU)"));
        #[cfg(feature = "cuda")]
        let decode_gpu =
            (self.decode_pools == Pools::Device && self.decode_device != 0).then(|| {
                GpuRelayout::new(self.decode_device)
                    .unwrap_or_else(|e| panic!("device {} for the decode: {e}", self.decode_device))
            });
        #[cfg(feature = "cuda")]
        let (mut prefill_dev, mut decode_dev) = (Vec::new(), Vec::new());
        let mut prefill = Vec::new();
        for r in 0..self.src_dcp {
            let pools = pools_of(
                self.prefill_pools,
                self.layers,
                self.row,
                PREFILL_PAGES,
                self.device_page_step,
            );
            let mut cfg = self.config(Role::Prefill, &url, &pools, (self.src_dcp, r));
            #[cfg(feature = "cuda")]
            prefill_dev.push(on_device(
                gpu.as_ref(),
                self.prefill_pools,
                &pools,
                &mut cfg,
            ));
            if let Some(s) = self.prefill_staging {
                cfg.staging_bytes = s;
            }
            if let Some(t) = self.prefill_timeout {
                cfg.room_timeout = t;
            }
            if r == 0 {
                cfg.metrics_listen = self.metrics_listen.clone();
                #[cfg(feature = "testing")]
                if let Some(n) = &self.prefill_nic {
                    cfg.testing.nic = Some(n.clone() as _);
                }
            }
            if let Some(f) = &self.knobs {
                f(Role::Prefill, r, &mut cfg);
            }
            // SAFETY: the pools (and device pools) live in the returned Cluster, beside the engine.
            prefill.push((unsafe { Engine::new(cfg) }.unwrap(), pools));
        }
        let mut decode = Vec::new();
        for r in 0..self.dcp {
            let pools = pools_of(
                self.decode_pools,
                self.layers,
                self.row,
                DECODE_PAGES,
                self.device_page_step,
            );
            let mut cfg = self.config(Role::Decode, &url, &pools, (self.dcp, r));
            #[cfg(feature = "cuda")]
            decode_dev.push(on_device(
                decode_gpu.as_ref().or(gpu.as_ref()),
                self.decode_pools,
                &pools,
                &mut cfg,
            ));
            if let Some(s) = self.decode_staging {
                cfg.staging_bytes = s;
            }
            if let Some(t) = self.decode_timeout {
                cfg.room_timeout = t;
            }
            if let Some(on) = self.room_grants {
                cfg.room_grants = on;
            }
            if let Some(f) = &self.knobs {
                f(Role::Decode, r, &mut cfg);
            }
            // SAFETY: the pools (and device pools) live in the returned Cluster, beside the engine.
            decode.push((unsafe { Engine::new(cfg) }.unwrap(), pools));
        }
        Cluster {
            server,
            prefill,
            decode,
            receiver_timeout: self.receiver_timeout,
            #[cfg(feature = "cuda")]
            prefill_dev,
            #[cfg(feature = "cuda")]
            decode_dev,
            #[cfg(feature = "cuda")]
            gpu,
            #[cfg(feature = "cuda")]
            decode_gpu,
        }
    }

    /// The config of `role`'s rank `r` of DCP `dcp` over `pools`, with the
    /// spec's transport of the role and NIC rails (not yet its per-role options).
    fn config(
        &self,
        role: Role,
        url: &str,
        pools: &SyntheticPools,
        (dcp, r): (u32, u32),
    ) -> EngineConfig {
        let transport = match role {
            Role::Decode => self.decode_transport.unwrap_or(self.transport),
            Role::Prefill => self.transport,
        };
        #[allow(unused_mut)]
        let mut cfg = config(role, &self.name, url, pools, (dcp, r), transport);
        #[cfg(feature = "testing")]
        if transport == TransportKind::Rdma
            || (transport == TransportKind::Auto && self.rails.is_some())
        {
            cfg.testing.nic =
                Some(FakeNic::new(role.as_str(), self.rails.unwrap_or(2), Mtu::Mtu4096) as _);
        }
        cfg
    }
}

/// For [`Pools::Device`]: `mirror`'s KV pools moved onto device memory of
/// `gpu` (zeroed), set in `cfg` with `pool_device` its device; returns the buffers
/// (none for host pools).
#[cfg(feature = "cuda")]
fn on_device(
    gpu: Option<&GpuRelayout>,
    kind: Pools,
    mirror: &SyntheticPools,
    cfg: &mut EngineConfig,
) -> Vec<DeviceBuffer> {
    let Some(g) = gpu.filter(|_| kind == Pools::Device) else {
        return Vec::new();
    };
    let (bufs, kv) = device_pools(g, mirror);
    for (l, b) in bufs.iter().enumerate() {
        if mirror.page_step > 1 {
            // the mirror's gap words too, which the transfer must not touch
            g.stream().upload(b, 0, mirror.layer_bytes(l)).unwrap();
        } else {
            g.stream().memset(b, 0).unwrap();
        }
    }
    g.stream().record(false).unwrap().wait().unwrap();
    cfg.pools = kv;
    cfg.pool_device = Some(g.stream().ordinal() as u32);
    bufs
}

/// The ranks of one cluster and the server they met through.
pub struct Cluster {
    /// The embedded bootstrap server.
    pub server: BootstrapServer,
    /// Prefill ranks with their pools, by DCP rank.
    pub prefill: Vec<(Engine, SyntheticPools)>,
    /// Decode ranks with their pools, by DCP rank.
    pub decode: Vec<(Engine, SyntheticPools)>,
    /// See [`Spec::receiver_timeout`].
    pub receiver_timeout: Option<Duration>,
    /// Each prefill rank's device pools, by layer (none for host pools).
    #[cfg(feature = "cuda")]
    pub prefill_dev: Vec<Vec<DeviceBuffer>>,
    /// Each decode rank's device pools, by layer (none for host pools).
    #[cfg(feature = "cuda")]
    pub decode_dev: Vec<Vec<DeviceBuffer>>,
    /// The context the device pools were allocated in (with [`Pools::Device`]).
    #[cfg(feature = "cuda")]
    pub gpu: Option<GpuRelayout>,
    /// The decode ranks' own device, when [`Spec::decode_device`] names another.
    #[cfg(feature = "cuda")]
    pub decode_gpu: Option<GpuRelayout>,
}

/// One room's request: `total` positions, decode prefix `prefix`, the pages
/// it uses on every rank.
pub struct Request {
    /// The room id.
    pub room: u64,
    /// Positions of the request.
    pub total: u64,
    /// Positions the decode already holds.
    pub prefix: u64,
    /// Each prefill rank's local pages.
    pub src: Vec<Vec<u64>>,
    /// The decode ranks' pages.
    pub dst: Vec<u64>,
}

impl Request {
    /// Positions sent: `total - prefix`.
    pub fn n(&self) -> u64 {
        self.total - self.prefix
    }
}

impl Cluster {
    /// A cluster `name` of `src_dcp` prefill and `dcp` decode ranks over
    /// `transport`, to adjust and [`Spec::start`].
    pub fn build(name: &str, (src_dcp, dcp): (u32, u32), transport: TransportKind) -> Spec {
        Spec {
            name: name.to_string(),
            layers: 4,
            src_dcp,
            dcp,
            transport,
            decode_transport: None,
            row: ROW,
            prefill_pools: Pools::Heap,
            decode_pools: Pools::Heap,
            decode_device: 0,
            device_page_step: 1,
            prefill_staging: None,
            decode_staging: None,
            prefill_timeout: None,
            decode_timeout: None,
            receiver_timeout: None,
            metrics_listen: None,
            room_grants: None,
            knobs: None,
            #[cfg(feature = "testing")]
            rails: None,
            #[cfg(feature = "testing")]
            prefill_nic: None,
        }
    }

    /// A cluster of ranks the caller built (with [`rank`] or its own config).
    pub fn from_parts(
        server: BootstrapServer,
        prefill: Vec<(Engine, SyntheticPools)>,
        decode: Vec<(Engine, SyntheticPools)>,
    ) -> Cluster {
        Cluster {
            server,
            prefill,
            decode,
            receiver_timeout: None,
            #[cfg(feature = "cuda")]
            prefill_dev: Vec::new(),
            #[cfg(feature = "cuda")]
            decode_dev: Vec::new(),
            #[cfg(feature = "cuda")]
            gpu: None,
            #[cfg(feature = "cuda")]
            decode_gpu: None,
        }
    }

    /// Prefill rank 0 (the prefill of a DCP-1 prefill side).
    pub fn prefill(&self) -> &Engine {
        &self.prefill[0].0
    }

    /// Prefill rank 0's pools.
    pub fn p_pools(&mut self) -> &mut SyntheticPools {
        &mut self.prefill[0].1
    }

    /// Picks the pages of a request: scattered, distinct page ids (7 and 3
    /// are coprime with the pool sizes); one local page of a prefill rank
    /// covers `P * src_dcp` positions, one decode page `P * dcp`.
    pub fn plan(&self, room: u64, total: u64, prefix: u64) -> Request {
        let sd = self.prefill.len() as u64;
        let dcp = self.decode.len() as u64;
        let n = total - prefix;
        let src = (0..sd)
            .map(|r| {
                (0..n.div_ceil(P * sd))
                    .map(|i| (i * 7 + room + r) % PREFILL_PAGES)
                    .collect()
            })
            .collect();
        let dst = (0..n.div_ceil(P * dcp))
            .map(|i| (i * 3 + room) % DECODE_PAGES)
            .collect();
        Request {
            room,
            total,
            prefix,
            src,
            dst,
        }
    }

    /// Fills every prefill rank's pages of `req` (and aux item
    /// [`AUX_ITEM`]) with the room's pattern; device pools are uploaded
    /// from their mirror (and the upload waited for).
    pub fn fill(&mut self, req: &Request) {
        self.fill_host(req);
        #[cfg(feature = "cuda")]
        for (r, bufs) in self.prefill_dev.iter().enumerate() {
            if let Some(g) = self.gpu.as_ref().filter(|_| !bufs.is_empty()) {
                for (l, d) in bufs.iter().enumerate() {
                    g.stream()
                        .upload(d, 0, self.prefill[r].1.layer_bytes(l))
                        .unwrap();
                }
                g.stream().record(false).unwrap().wait().unwrap();
            }
        }
    }

    /// [`Cluster::fill`] of the host pools (the mirrors) only.
    pub fn fill_host(&mut self, req: &Request) {
        let sd = self.prefill.len() as u64;
        for (r, (_, pools)) in self.prefill.iter_mut().enumerate() {
            let side = side(sd, r as u64, &req.src[r], req.prefix);
            pools.fill(req.room, &side, req.total);
            pools.fill_aux(req.room, AUX_ITEM);
        }
    }

    /// Every decode rank opens the room and sends its metadata (pages
    /// `req.dst`, aux slot [`AUX_SLOT`]).
    pub fn post_metadata(&self, req: &Request) {
        open_decode(
            self.decode.iter().map(|(e, _)| e),
            req.room,
            &req.dst,
            req.prefix,
            self.receiver_timeout,
        );
    }

    /// Every prefill rank opens the room.
    pub fn senders(&self, room: u64) {
        for (e, _) in &self.prefill {
            e.sender(room).unwrap();
        }
    }

    /// Waits (10 s at most) until every prefill rank left `Bootstrapping`.
    pub fn wait_bootstrapped(&self, room: u64) {
        for (e, _) in &self.prefill {
            let mut waited = 0;
            while e.poll(room) == KvPoll::Bootstrapping {
                std::thread::sleep(Duration::from_millis(5));
                waited += 1;
                assert!(waited < 2000, "prefill never saw the decode metadata");
            }
        }
    }

    /// Opens `room` on every rank: fills the prefill pools unless `fill` is
    /// false, decode metadata, then the senders; returns once every prefill
    /// rank left `Bootstrapping`.
    pub fn open_room(&mut self, room: u64, total: u64, prefix: u64, fill: bool) -> Request {
        let req = self.plan(room, total, prefix);
        if fill {
            self.fill(&req);
        }
        self.post_metadata(&req);
        self.senders(room);
        self.wait_bootstrapped(room);
        req
    }

    /// The chunks of prefill rank `r`: (pages, tokens, last), `chunk_pages`
    /// local pages each.
    pub fn chunks(
        &self,
        req: &Request,
        r: usize,
        chunk_pages: usize,
    ) -> Vec<(Vec<u64>, u64, bool)> {
        let v = P * self.prefill.len() as u64;
        let src = &req.src[r];
        let mut out = Vec::new();
        let mut sent = 0;
        for (i, ch) in src.chunks(chunk_pages).enumerate() {
            let last = (i + 1) * chunk_pages >= src.len();
            let t = if last {
                req.n() - sent
            } else {
                ch.len() as u64 * v
            };
            out.push((ch.to_vec(), t, last));
            sent += t;
        }
        out
    }

    /// Sends every chunk of every prefill rank whole.
    pub fn send_all(&self, req: &Request, chunk_pages: usize) {
        for (r, (e, _)) in self.prefill.iter().enumerate() {
            for (pages, t, last) in self.chunks(req, r, chunk_pages) {
                e.send(req.room, &pages, t, last, AUX_ITEM).unwrap();
            }
        }
    }

    /// Sends every chunk of every prefill rank layer group by layer group.
    pub fn send_layerwise(&self, req: &Request, chunk_pages: usize, groups: &[Range<u32>]) {
        for (r, (e, _)) in self.prefill.iter().enumerate() {
            for (pages, t, last) in self.chunks(req, r, chunk_pages) {
                for g in groups {
                    let o = SendOptions {
                        layers: Some(g.clone()),
                        ..Default::default()
                    };
                    e.send_with(req.room, &pages, t, last, AUX_ITEM, &o)
                        .unwrap();
                }
            }
        }
    }

    /// Asserts `Success` on every prefill rank (20 s at most each).
    pub fn wait_prefill_success(&self, room: u64) {
        for (r, (e, _)) in self.prefill.iter().enumerate() {
            assert_success(e, room, &format!("prefill {r}"));
        }
    }

    /// Asserts `Success` on decode rank `r` (20 s at most).
    pub fn wait_decode_success(&self, room: u64, r: usize) {
        assert_success(&self.decode[r].0, room, &format!("decode {r}"));
    }

    /// Asserts `Success` everywhere: the prefill ranks, then every decode rank.
    pub fn wait_success(&self, req: &Request) {
        self.wait_prefill_success(req.room);
        for r in 0..self.decode.len() {
            self.wait_decode_success(req.room, r);
        }
    }

    /// Checks every byte of `req` on decode rank `r` (KV rows and the aux
    /// item; device pools read back into their mirror first, a plain
    /// synchronous copy that waits for no stream); returns the bytes verified.
    pub fn verify_rank(&mut self, req: &Request, r: usize) -> u64 {
        #[cfg(feature = "cuda")]
        if let Some(bufs) = self.decode_dev.get(r) {
            for (l, b) in bufs.iter().enumerate() {
                b.read(0, self.decode[r].1.layer_bytes_mut(l)).unwrap();
            }
        }
        let side = side(self.decode.len() as u64, r as u64, &req.dst, req.prefix);
        self.decode[r]
            .1
            .verify(req.room, &side, req.total, Some(AUX_SLOT))
            .unwrap_or_else(|e| panic!("decode {r} room {}: {e}", req.room))
    }

    /// [`Cluster::verify_rank`] on every decode rank.
    pub fn verify(&mut self, req: &Request) -> u64 {
        (0..self.decode.len())
            .map(|r| self.verify_rank(req, r))
            .sum()
    }

    /// Closes every rank (the prefill ranks first).
    pub fn close(&self) {
        for (e, _) in self.prefill.iter().chain(&self.decode) {
            e.close();
        }
    }

    /// Clears the room on every rank.
    pub fn clear(&self, room: u64) {
        for (e, _) in &self.decode {
            e.clear(room).unwrap();
        }
        for (e, _) in &self.prefill {
            e.clear(room).unwrap();
        }
    }

    /// Waits for `Success` on the prefill ranks, then on each decode rank
    /// checks every byte and clears the room; clears the prefill ranks.
    /// Returns the bytes verified.
    pub fn finish(&mut self, req: &Request) -> u64 {
        self.wait_prefill_success(req.room);
        let mut verified = 0;
        for r in 0..self.decode.len() {
            self.wait_decode_success(req.room, r);
            verified += self.verify_rank(req, r);
            self.decode[r].0.clear(req.room).unwrap();
        }
        // strided pools: no byte between two pages written, on either side
        for (role, (_, pools)) in self
            .prefill
            .iter()
            .map(|p| ("prefill", p))
            .chain(self.decode.iter().map(|d| ("decode", d)))
        {
            if pools.page_step > 1 {
                pools
                    .check_gaps()
                    .unwrap_or_else(|e| panic!("{role} room {}: {e}", req.room));
            }
        }
        for (e, _) in &self.prefill {
            e.clear(req.room).unwrap();
        }
        verified
    }

    /// One whole request: [`open_room`](Self::open_room) (filled),
    /// [`send_all`](Self::send_all) in chunks of `chunk_pages` pages,
    /// [`finish`](Self::finish); returns the bytes verified on the decode ranks.
    pub fn request(&mut self, room: u64, total: u64, prefix: u64, chunk_pages: usize) -> u64 {
        let req = self.open_room(room, total, prefix, true);
        self.send_all(&req, chunk_pages);
        self.finish(&req)
    }
}
