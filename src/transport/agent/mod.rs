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
//! - the tcp receiver is in [`tcp`](super::tcp).

mod accept;
mod connect;
mod grant;
mod session;
#[cfg(test)]
mod tests;

pub(crate) use accept::refuse;
pub(crate) use connect::Dialed;
pub(crate) use grant::completion;
pub(crate) use session::ReceiverSession;

use super::identity::ProcIdentity;
use super::local::{LocalTarget, LocalTransport};
use super::rdma::nic::NicProvider;
use super::{Completion, Transport, TransportKind};
use crate::error::{Error, Result, Status};
use crate::memory::{RegionDesc, Registry};
use crossbeam::channel::{unbounded, Receiver, Sender};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// Options of an [`Agent`].
#[derive(Debug, Clone, Default)]
pub struct AgentOptions {
    /// Address to accept peers on (`"127.0.0.1:0"` picks a port); `None`
    /// makes a send-only agent.
    pub listen: Option<String>,
    /// Test knob: the receiver sleeps this long before validating each new
    /// batch (simulates a stalled peer). Zero in production.
    pub stall: Duration,
    /// Test knob: the RDMA NIC provider to use (e.g. the software fabric
    /// [`FakeNic`](crate::transport::rdma::fake::FakeNic)). `None` (production)
    /// opens the real NICs through verbs when first needed.
    #[doc(hidden)]
    pub nic: Option<Arc<dyn NicProvider>>,
    /// Test knob: never treat a peer as on this host when choosing a
    /// transport automatically (so two agents of one process can test the
    /// cross-host choice). False in production.
    #[doc(hidden)]
    pub deny_same_host: bool,
    /// The CUDA device whose memory this agent's regions are in, if any:
    /// the real RDMA NICs are then chosen nearest to it on PCIe and
    /// GPUDirect RDMA is probed on it.
    pub gpu: Option<u32>,
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
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            transport: TransportKind::Auto,
            streams: 1,
            threads: 1,
            timeout: Duration::from_secs(10),
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
    /// Test knob: see [`AgentOptions::stall`].
    pub(crate) stall: Duration,
    nic: OnceLock<Result<Arc<dyn NicProvider>>>,
    deny_same_host: bool,
    gpu: Option<u32>,
}

impl AgentInner {
    /// The RDMA NICs of this process: the provider given in the options, else
    /// the real NICs (opened once, on first use); `NoRdmaDevice` with the reason.
    pub(crate) fn nic(&self) -> Result<Arc<dyn NicProvider>> {
        self.nic
            .get_or_init(|| accept::open_default_nic(self.gpu))
            .clone()
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
        let listener = match &opts.listen {
            Some(a) => Some(
                TcpListener::bind(a.as_str())
                    .map_err(|e| Error::new(Status::Io, format!("cannot listen on {a}: {e}")))?,
            ),
            None => None,
        };
        let addr = listener.as_ref().map(|l| l.local_addr()).transpose()?;
        let (tx, rx) = unbounded();
        let inner = Arc::new(AgentInner {
            registry: Registry::new(),
            identity,
            addr,
            shutdown: AtomicBool::new(false),
            tx,
            rx,
            sessions: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(1),
            stall: opts.stall,
            nic: match &opts.nic {
                Some(p) => OnceLock::from(Ok(p.clone())),
                None => OnceLock::new(),
            },
            deny_same_host: opts.deny_same_host,
            gpu: opts.gpu,
        });
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
            std::thread::Builder::new()
                .name("pdxfer-accept".into())
                .spawn(move || accept::accept_loop(l, weak))?;
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
    /// (`NoGpuDirect` on the first batch from device memory).
    pub fn rdma_gpu_direct(&self) -> Result<()> {
        self.inner.nic()?.gpu_direct()
    }

    /// Registers every region of the registry with the RDMA NICs now (device
    /// regions too where the NIC has GPUDirect RDMA)
    /// (registration of large pools takes time; otherwise the first RDMA
    /// connection does it inside its handshake deadline, and a sender on its
    /// first batch). `NoRdmaDevice` with the reason when there is no NIC.
    pub fn rdma_register_all(&self) -> Result<()> {
        let nic = self.inner.nic()?;
        accept::register_all(&self.inner.registry, &*nic)
    }

    /// [`rdma_register_all`](Self::rdma_register_all) except the regions
    /// `skip` names (e.g. memory this side never moves over rdma itself; it
    /// is still registered on first use).
    pub fn rdma_register_all_but(&self, skip: &[u64]) -> Result<()> {
        let nic = self.inner.nic()?;
        accept::register_matching(&self.inner.registry, &*nic, &|d| !skip.contains(&d.id))
    }

    /// Number of sender sessions currently connected.
    pub fn sessions(&self) -> usize {
        lock(&self.inner.sessions).len()
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

impl Drop for Agent {
    fn drop(&mut self) {
        self.shutdown();
    }
}
