//! The [`Agent`]: one per process. It owns the region registry, listens for
//! peers (receiver side: validates every write against the registry before
//! touching memory, delivers completion records after the data landed), and
//! opens connections to peers (sender side).
//!
//! - `connect`: the sender's handshake and the choice of transport; each
//!   transport's own setup lives beside it (`cma`, `tcp`, `rdma`);
//! - `accept`: the listener, the first frame of each connection, the
//!   receiver's handshake and RDMA registration;
//! - `session`: the receiver's state for one sender connection;
//! - `grant`: the grant protocol of cma and rdma (intent, grant, commit);
//! - `standing_grant`: a cma connection's regions granted for its life, and
//!   their fenced revoke on unregister;
//! - the tcp receiver is in [`tcp`](super::tcp).

mod accept;
mod connect;
// set only by a decode engine with device pools (the `cuda` feature)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod gpu_direct;
mod grant;
mod room_grant;
mod session;
mod standing_grant;
#[cfg(any(test, feature = "testing"))]
mod test_knobs;
#[cfg(test)]
mod tests;

pub(crate) use accept::refuse;
pub(crate) use connect::Dialed;
pub(crate) use grant::completion;
pub(crate) use room_grant::piece_landed;
pub(crate) use session::ReceiverSession;

use super::identity::ProcIdentity;
use super::listen::{ListenLimits, ListenStats};
use super::local::{LocalTarget, LocalTransport};
use super::rdma::nic::NicProvider;
use super::{Completion, Transport, TransportKind};
use crate::auth::{Mode, PeerInstance};
use crate::error::{Error, Result, Status};
use crate::memory::{RegionDesc, Registry};
use crossbeam::channel::{unbounded, Receiver, Sender};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;
#[cfg(any(test, feature = "testing"))]
pub use test_knobs::TestKnobs;

/// Options of an [`Agent`].
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Address to accept peers on (`"127.0.0.1:0"` picks a port); `None`
    /// makes a send-only agent.
    pub listen: Option<String>,
    /// Bounds on the connections peers open: connections waiting for their
    /// first frame (no thread each), handshakes, live connections; the
    /// excess is refused (closed).
    pub limits: ListenLimits,
    /// How long a connection may take from its first frame to the end of
    /// its handshake (each frame of it must arrive within this).
    pub handshake_timeout: Duration,
    /// A session whose sender sent no frame for this long is closed (a
    /// half-open or abandoned connection). Senders send a keepalive every
    /// [`ConnectOptions::keepalive`], which must be shorter.
    pub idle_timeout: Duration,
    /// Longest a peer may pin a region for one batch: a tcp piece whose
    /// payload stops arriving, or a cma / rdma grant without its commit, is
    /// dropped after this (the session is closed, or the commit refused), so
    /// the region can be unregistered.
    pub pin_timeout: Duration,
    /// The CUDA device whose memory this agent's regions are in, if any:
    /// the real RDMA NICs are then chosen nearest to it on PCIe and
    /// GPUDirect RDMA is probed on it.
    pub gpu: Option<u32>,
    /// The cluster secret every peer must prove (at least 16 bytes); `None`
    /// reads `PDXFER_CLUSTER_SECRET`, and without either the agent accepts
    /// unauthenticated peers, which only a loopback-bound listener may do.
    pub secret: Option<String>,
    /// This agent's instance id in the authentication exchange (an engine
    /// gives its bootstrap instance id); `None` picks a random one.
    pub instance: Option<[u8; 16]>,
    /// Encrypt the payload of tcp pieces (ChaCha20-Poly1305 under per-stream
    /// keys from the authentication exchange), for links that cross hosts;
    /// both ends must agree (a receiver refuses a sender with the other
    /// setting, `TransportUnavailable` naming both). Other transports are
    /// unaffected. `None` reads [`TCP_ENCRYPT_ENV`] (`1` or `true`: on),
    /// else off. Without a cluster secret the keys come from public nonces:
    /// the bytes are then scrambled, not kept secret.
    pub tcp_encrypt: Option<bool>,
    /// RDMA: the RoCE traffic class of the QPs (DSCP << 2; the fabric's
    /// lossless class, commonly 106); `None` reads
    /// `PDXFER_RDMA_TRAFFIC_CLASS`, else 0.
    pub rdma_traffic_class: Option<u8>,
    /// Behaviour only tests change (a stalled receiver, a software NIC, no
    /// same-host shortcut); the default is production behaviour.
    #[cfg(any(test, feature = "testing"))]
    pub testing: TestKnobs,
}

impl Default for AgentOptions {
    fn default() -> Self {
        AgentOptions {
            listen: None,
            limits: ListenLimits::default(),
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            pin_timeout: Duration::from_secs(60),
            gpu: None,
            secret: None,
            instance: None,
            tcp_encrypt: None,
            rdma_traffic_class: None,
            #[cfg(any(test, feature = "testing"))]
            testing: TestKnobs::default(),
        }
    }
}

/// `nic` registering the registry's overlapping pool views as one region
/// per allocation ([`ViewHulls`](crate::transport::rdma::view_hulls::ViewHulls)).
fn by_view_hulls(nic: Arc<dyn NicProvider>, registry: &Registry) -> Arc<dyn NicProvider> {
    let registry = registry.clone();
    crate::transport::rdma::view_hulls::ViewHulls::wrap(
        nic,
        Arc::new(move |addr, len, kind| registry.view_hull(addr, len, kind)),
    )
}

impl AgentOptions {
    /// The NIC provider the options give (the [`TestKnobs::nic`] knob), set
    /// up front so the unregister hook sees it before first use; unset in a
    /// product build (the real NICs open on first use).
    fn given_nic(&self, registry: &Registry) -> OnceLock<Result<Arc<dyn NicProvider>>> {
        #[cfg(any(test, feature = "testing"))]
        if let Some(p) = &self.testing.nic {
            return OnceLock::from(Ok(by_view_hulls(p.clone(), registry)));
        }
        let _ = registry;
        OnceLock::new()
    }
}

/// The environment variable read when [`AgentOptions::tcp_encrypt`] is unset.
pub const TCP_ENCRYPT_ENV: &str = "PDXFER_TCP_ENCRYPT";

/// Whether tcp pieces are encrypted: the option given, else
/// [`TCP_ENCRYPT_ENV`] (`1`, `true`, `yes` or `on`), else off.
pub fn tcp_encrypt(option: Option<bool>) -> bool {
    option.unwrap_or_else(|| {
        std::env::var(TCP_ENCRYPT_ENV).is_ok_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
    })
}

/// The environment variable read when no secret is configured.
pub const CLUSTER_SECRET_ENV: &str = "PDXFER_CLUSTER_SECRET";

/// The authentication mode from a configured secret, else
/// [`CLUSTER_SECRET_ENV`], else open.
pub fn auth_mode(secret: Option<&str>) -> Result<Mode> {
    match secret {
        Some(s) => Mode::from_option(Some(s)),
        None => match std::env::var(CLUSTER_SECRET_ENV) {
            Ok(s) if !s.is_empty() => Mode::from_option(Some(&s)).map_err(|e| {
                Error::new(e.status(), format!("{CLUSTER_SECRET_ENV}: {}", e.detail()))
            }),
            _ => Ok(Mode::Open),
        },
    }
}

/// Refuses a listener that is not loopback-bound when no secret is
/// configured (`AuthRequired` naming the address and the fix); warns about
/// an open loopback listener. `what` names the listener.
pub fn check_listener(mode: &Mode, addr: &SocketAddr, what: &str) -> Result<()> {
    if mode.is_secret() {
        return Ok(());
    }
    if !addr.ip().is_loopback() {
        return Err(Error::new(
            Status::AuthRequired,
            format!(
                "{what} on {addr} is not loopback-bound and no cluster secret is configured: anyone who can reach it could write this process's memory; configure the cluster secret (engine `token`, agent `secret`, or {CLUSTER_SECRET_ENV}) on every rank, or listen on 127.0.0.1"
            ),
        ));
    }
    log::warn!(
        "{what} on {addr}: NO CLUSTER SECRET configured, peers are not authenticated; any local process can connect (set the engine `token`, agent `secret` or {CLUSTER_SECRET_ENV})"
    );
    Ok(())
}

/// Options of [`Agent::connect`].
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Transport to use (`Auto` chooses).
    pub transport: TransportKind,
    /// tcp: parallel data streams (>= 1).
    pub streams: u32,
    /// cma: writer threads per batch (>= 1).
    pub threads: u32,
    /// Deadline for connecting and the handshake.
    pub timeout: Duration,
    /// An idle control connection sends a keepalive this often, so the
    /// receiver's [`AgentOptions::idle_timeout`] does not close it.
    pub keepalive: Duration,
    /// The instance the peer must authenticate as (`PeerIdentity` naming both
    /// ids otherwise); `None` accepts any peer that proves the secret.
    pub expect_instance: Option<PeerInstance>,
    /// cma: the caller submits one job's batches over several connections
    /// and then waits for them all, so every batch of 256 KiB or more is
    /// moved by this connection's writer thread (the connections move in
    /// parallel). Without it, a one-thread connection moves a one-sided
    /// batch of up to 4 MiB inside `submit`, sparing two thread hand-offs.
    pub fan_out: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            transport: TransportKind::Auto,
            streams: 1,
            threads: 1,
            timeout: Duration::from_secs(10),
            keepalive: Duration::from_secs(15),
            expect_instance: None,
            fan_out: false,
        }
    }
}

/// A completion record seen by the receiver: every byte of the batch landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incoming {
    /// The sending process.
    pub peer: ProcIdentity,
    /// The session (one per sender connection).
    pub session: u64,
    /// The record.
    pub completion: Completion,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) struct AgentInner {
    pub registry: Registry,
    pub identity: ProcIdentity,
    addr: Option<SocketAddr>,
    shutdown: AtomicBool,
    tx: Sender<Incoming>,
    rx: Receiver<Incoming>,
    pub(crate) sessions: Mutex<HashMap<u64, Arc<ReceiverSession>>>,
    next_session: AtomicU64,
    pub(crate) handshake_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) pin_timeout: Duration,
    listen_stats: ListenStats,
    nic: OnceLock<Result<Arc<dyn NicProvider>>>,
    #[cfg(any(test, feature = "testing"))]
    knobs: TestKnobs,
    gpu: Option<u32>,
    /// Whether peers must prove the cluster secret.
    pub(crate) auth: Mode,
    /// This agent's instance id in the authentication exchange.
    pub(crate) instance: [u8; 16],
    /// How peers' GPUDirect RDMA writes into device regions are treated
    /// (unset: delivered as the NIC completes them).
    gpu_writes: OnceLock<gpu_direct::GpuDirectWrites>,
    /// Room-level grants issued to senders ([`Agent::grant_room`]).
    pub(crate) room_grants: room_grant::RoomGrants,
    /// tcp pieces are encrypted, both ways ([`AgentOptions::tcp_encrypt`]).
    pub(crate) tcp_encrypt: bool,
    /// [`AgentOptions::rdma_traffic_class`].
    rdma_traffic_class: Option<u8>,
    /// Regions granted to cma senders for their connection's life.
    pub(crate) standing: standing_grant::StandingGrants,
}

impl AgentInner {
    /// The RDMA NICs of this process: the provider given in the options, else
    /// the real NICs (opened once, on first use); `NoRdmaDevice` with the reason.
    pub(crate) fn nic(&self) -> Result<Arc<dyn NicProvider>> {
        self.nic
            .get_or_init(|| {
                accept::open_default_nic(self.gpu, self.rdma_traffic_class)
                    .map(|n| by_view_hulls(n, &self.registry))
            })
            .clone()
    }

    /// How long the receiver sleeps before validating each new batch (the
    /// [`TestKnobs::stall`] knob; zero in a product build).
    pub(crate) fn stall(&self) -> Duration {
        #[cfg(any(test, feature = "testing"))]
        return self.knobs.stall;
        #[cfg(not(any(test, feature = "testing")))]
        Duration::ZERO
    }

    /// How long the receiver sleeps before answering each RoomEnd (the
    /// [`TestKnobs::room_end_stall`] knob; zero in a product build).
    pub(crate) fn room_end_stall(&self) -> Duration {
        #[cfg(any(test, feature = "testing"))]
        return self.knobs.room_end_stall;
        #[cfg(not(any(test, feature = "testing")))]
        Duration::ZERO
    }

    /// Whether a peer is never taken as on this host (the
    /// [`TestKnobs::deny_same_host`] knob; false in a product build).
    pub(crate) fn deny_same_host(&self) -> bool {
        #[cfg(any(test, feature = "testing"))]
        return self.knobs.deny_same_host;
        #[cfg(not(any(test, feature = "testing")))]
        false
    }

    pub(crate) fn deliver(&self, peer: ProcIdentity, session: u64, completion: Completion) {
        let _ = self.tx.send(Incoming {
            peer,
            session,
            completion,
        });
    }
}

impl LocalTarget for AgentInner {
    fn registry(&self) -> &Registry {
        &self.registry
    }

    fn deliver(&self, peer: ProcIdentity, session: u64, completion: Completion) {
        AgentInner::deliver(self, peer, session, completion)
    }
}

/// One process's endpoint: registry, listener, connections, completions.
pub struct Agent {
    pub(crate) inner: Arc<AgentInner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("addr", &self.inner.addr)
            .field("pid", &self.inner.identity.pid)
            .finish()
    }
}

impl Agent {
    /// Creates an agent, listening when `opts.listen` is set.
    pub fn new(opts: &AgentOptions) -> Result<Agent> {
        let identity = ProcIdentity::current()?;
        let auth = auth_mode(opts.secret.as_deref())?;
        let instance = match opts.instance {
            Some(i) => i,
            None => random_instance()?,
        };
        let listener = match &opts.listen {
            Some(a) => Some(
                TcpListener::bind(a.as_str())
                    .map_err(|e| Error::new(Status::Io, format!("cannot listen on {a}: {e}")))?,
            ),
            None => None,
        };
        let addr = listener.as_ref().map(|l| l.local_addr()).transpose()?;
        if let Some(a) = &addr {
            check_listener(&auth, a, "the pdxfer agent's data-plane listener")?;
        }
        let encrypt = tcp_encrypt(opts.tcp_encrypt);
        if encrypt && !auth.is_secret() {
            log::warn!(
                "tcp payload encryption is on without a cluster secret: its keys come from public nonces, so the bytes are scrambled but NOT secret (configure the cluster secret on every rank)"
            );
        }
        let (tx, rx) = unbounded();
        let registry = Registry::new();
        let inner = Arc::new(AgentInner {
            nic: opts.given_nic(&registry),
            registry,
            identity,
            addr,
            shutdown: AtomicBool::new(false),
            tx,
            rx,
            sessions: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(1),
            handshake_timeout: opts.handshake_timeout,
            idle_timeout: opts.idle_timeout,
            pin_timeout: opts.pin_timeout,
            listen_stats: ListenStats::default(),
            #[cfg(any(test, feature = "testing"))]
            knobs: opts.testing.clone(),
            gpu: opts.gpu,
            auth,
            instance,
            gpu_writes: OnceLock::new(),
            room_grants: Default::default(),
            tcp_encrypt: encrypt,
            rdma_traffic_class: opts.rdma_traffic_class,
            standing: Default::default(),
        });
        // An unregister revokes the region's standing grants first: their
        // senders fence their writes before the drain waits for the rest.
        let weak = Arc::downgrade(&inner);
        inner.registry.add_revoke_hook(Arc::new(
            move |d: &RegionDesc, deadline: std::time::Instant| {
                if let Some(a) = weak.upgrade() {
                    standing_grant::revoke(&a, d, deadline);
                }
            },
        ));
        // Unregistering a region drops its NIC registration before the memory
        // can be freed, so a peer holding its rkey cannot write into it.
        let weak = Arc::downgrade(&inner);
        inner
            .registry
            .add_unregister_hook(Arc::new(move |d: &RegionDesc| {
                let Some(a) = weak.upgrade() else { return };
                if let Some(Ok(nic)) = a.nic.get() {
                    if let Err(e) = nic.deregister(d.addr, d.len) {
                        log::error!(
                            "rdma: region {} ({:#x}+{}) could not be deregistered from the NIC: {e}",
                            d.id,
                            d.addr,
                            d.len
                        );
                    }
                }
            }));
        if let Some(l) = listener {
            let weak = Arc::downgrade(&inner);
            let limits = opts.limits;
            crate::threads::spawn("pdxfer-accept".into(), move || {
                accept::accept_loop(l, limits, weak)
            })?;
        }
        Ok(Agent { inner })
    }

    /// The region registry of this agent.
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// This process's identity.
    pub fn identity(&self) -> &ProcIdentity {
        &self.inner.identity
    }

    /// This agent's instance id (what peers authenticate it as).
    pub fn instance(&self) -> PeerInstance {
        PeerInstance(self.inner.instance)
    }

    /// Whether peers of this agent must prove the cluster secret.
    pub fn auth(&self) -> &Mode {
        &self.inner.auth
    }

    /// The address peers connect to, when listening.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.addr
    }

    /// Registers host memory (see [`Registry::register_host`]).
    ///
    /// # Safety
    /// As [`Registry::register_host`]: the memory must stay valid until unregistered.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<RegionDesc> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.registry.register_host(ptr, len) }
    }

    /// Registers CUDA device memory (see [`Registry::register_device`]). Only
    /// the rdma transport moves it (GPUDirect RDMA: the NIC reads and writes
    /// the GPU's memory directly); cma and tcp refuse device regions.
    ///
    /// # Safety
    /// As [`Registry::register_device`]: the allocation must stay valid until unregistered.
    pub unsafe fn register_device(
        &self,
        dptr: u64,
        len: usize,
        ordinal: u32,
    ) -> Result<RegionDesc> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.registry.register_device(dptr, len, ordinal) }
    }

    /// The next completion record received, waiting up to `timeout`.
    pub fn next_completion(&self, timeout: Duration) -> Option<Incoming> {
        self.inner.rx.recv_timeout(timeout).ok()
    }

    /// A completion record if one is ready.
    pub fn try_completion(&self) -> Option<Incoming> {
        self.inner.rx.try_recv().ok()
    }

    /// The RDMA NICs this agent uses, in words, or why there are none
    /// (`NoRdmaDevice` with the reason). Opens them on first use.
    pub fn rdma_nics(&self) -> Result<String> {
        self.inner.nic().map(|n| n.describe())
    }

    /// Whether the RDMA NICs can register device (GPU) memory (GPUDirect
    /// RDMA), or why not: `NoGpuDirect` with the reason, `NoRdmaDevice`
    /// without a NIC. A NIC that says yes may still refuse a registration
    /// (`NoGpuDirect` on the first batch from device memory). `NoGpuDirect`
    /// too where this agent's device cannot make GPUDirect writes consistent.
    pub fn rdma_gpu_direct(&self) -> Result<()> {
        self.inner.gpu_direct(&*self.inner.nic()?)
    }

    /// Registers every region of the registry with the RDMA NICs now (device
    /// regions too where the NIC has GPUDirect RDMA)
    /// (registration of large pools takes time; otherwise the first RDMA
    /// connection does it inside its handshake deadline, and a sender on its
    /// first batch). `NoRdmaDevice` with the reason when there is no NIC.
    pub fn rdma_register_all(&self) -> Result<()> {
        let nic = self.inner.nic()?;
        accept::register_all(&self.inner, &*nic)
    }

    /// [`rdma_register_all`](Self::rdma_register_all) except the regions
    /// `skip` names (e.g. memory this side never moves over rdma itself; it
    /// is still registered on first use).
    pub fn rdma_register_all_but(&self, skip: &[u64]) -> Result<()> {
        let nic = self.inner.nic()?;
        accept::register_matching(&self.inner, &*nic, &|d| !skip.contains(&d.id), false)
    }

    /// [`rdma_register_all_but`](Self::rdma_register_all_but), where a
    /// device region that cannot be registered (no GPUDirect RDMA for it) is
    /// the error, `NoGpuDirect` naming it: a receiver whose device memory
    /// peers must write refuses to start rather than fail its batches later.
    pub fn rdma_register_all_but_devices_required(&self, skip: &[u64]) -> Result<()> {
        let nic = self.inner.nic()?;
        accept::register_matching(&self.inner, &*nic, &|d| !skip.contains(&d.id), true)
    }

    /// Number of sender sessions currently connected.
    pub fn sessions(&self) -> usize {
        lock(&self.inner.sessions).len()
    }

    /// Number of connections peers hold open past their first frame
    /// (control connections and tcp data streams, handshakes included).
    pub fn connections(&self) -> usize {
        self.inner.listen_stats.connections()
    }

    /// A transport into another agent of this process (`local`).
    pub fn connect_local(&self, target: &Agent) -> Box<dyn Transport> {
        Box::new(LocalTransport::new(
            self.inner.registry.clone(),
            self.inner.identity.clone(),
            target.inner.clone(),
        ))
    }

    /// Stops accepting peers and closes every receiver session.
    pub fn shutdown(&self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        let sessions: Vec<Arc<ReceiverSession>> =
            lock(&self.inner.sessions).drain().map(|(_, s)| s).collect();
        for s in sessions {
            s.close();
        }
    }
}

fn random_instance() -> Result<[u8; 16]> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|e| {
        Error::new(
            Status::Io,
            format!("getrandom failed for an instance id: {e}"),
        )
    })?;
    Ok(b)
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shutdown();
    }
}
