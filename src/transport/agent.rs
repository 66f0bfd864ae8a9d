//! The [`Agent`]: one per process. It owns the region registry, listens for
//! peers (receiver side: validates every write against the registry before
//! touching memory, delivers completion records after the data landed), and
//! opens connections to peers (sender side).

use super::conn::Conn;
use super::handshake::{random_u64, Attach, Hello, HelloAck, Select, SelectOk};
use super::identity::ProcIdentity;
use super::rdma::link::RdmaLink;
use super::rdma::nic::{DataPath, NicProvider};
use super::rdma::Handshake;
use super::wire::{self, Commit, DataHeader, FrameType, Range, DATA_HEADER_LEN};
use super::{checksum, BatchId, Completion, Transport, TransportKind};
use crate::error::{Error, Result, Status};
use crate::memory::{AccessGuard, RegionDesc, RegionKind, Registry};
use crossbeam::channel::{unbounded, Receiver, Sender};
use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
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

#[derive(Default)]
struct RecvBatch {
    received: u64,
    sum: u64,
    failed: Option<Error>,
    commit: Option<Commit>,
}

#[derive(Default)]
struct TcpRecv {
    batches: HashMap<u64, RecvBatch>,
    finished: HashSet<u64>,
    /// Batches the test stall knob already delayed.
    stalled: HashSet<u64>,
}

/// Finished batch ids remembered per session (late frames of a finished batch
/// are dropped); batch ids grow, so only the newest ones need remembering.
const FINISHED_WINDOW: u64 = 8192;

impl TcpRecv {
    fn mark_finished(&mut self, batch: u64) {
        self.finished.insert(batch);
        if self.finished.len() as u64 > 2 * FINISHED_WINDOW {
            let keep = batch.saturating_sub(FINISHED_WINDOW);
            self.finished.retain(|&b| b >= keep);
        }
    }
}

struct Granted {
    ranges: Vec<Range>,
    guards: Vec<AccessGuard>,
    /// Some range lies in device memory (rdma only; never read by the CPU).
    device: bool,
    /// The peer reads these ranges (no completion record is delivered here).
    read: bool,
}

struct Session {
    id: u64,
    token: u64,
    nonce: Box<u64>,
    peer: Mutex<Option<ProcIdentity>>,
    writer: Mutex<Option<TcpStream>>,
    granted: Mutex<HashMap<u64, Granted>>,
    tcp: Mutex<TcpRecv>,
    sockets: Mutex<Vec<TcpStream>>,
    /// rdma: this side's connected QPs (the peer writes through them).
    rdma: Mutex<Option<Box<dyn DataPath>>>,
    closed: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Session {
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        for s in lock(&self.sockets).iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        lock(&self.granted).clear();
        lock(&self.tcp).batches.clear();
        let path = lock(&self.rdma).take();
        drop(path);
    }

    fn send(&self, ty: FrameType, p: &[u8]) {
        if let Some(w) = lock(&self.writer).as_mut() {
            if wire::write_frame(w, ty, p).is_err() {
                let _ = w.shutdown(Shutdown::Both);
            }
        }
    }
}

pub(crate) struct AgentInner {
    pub registry: Registry,
    pub identity: ProcIdentity,
    addr: Option<SocketAddr>,
    shutdown: AtomicBool,
    tx: Sender<Incoming>,
    rx: Receiver<Incoming>,
    sessions: Mutex<HashMap<u64, Arc<Session>>>,
    next_session: AtomicU64,
    stall: Duration,
    nic: OnceLock<Result<Arc<dyn NicProvider>>>,
    deny_same_host: bool,
}

impl AgentInner {
    /// The RDMA NICs of this process: the provider given in the options, else
    /// the real NICs (opened once, on first use); `NoRdmaDevice` with the reason.
    pub(crate) fn nic(&self) -> Result<Arc<dyn NicProvider>> {
        self.nic.get_or_init(open_default_nic).clone()
    }

    pub(crate) fn deliver(&self, peer: ProcIdentity, session: u64, completion: Completion) {
        let _ = self.tx.send(Incoming {
            peer,
            session,
            completion,
        });
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
                .spawn(move || accept_loop(l, weak))?;
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
        register_all(&self.inner.registry, &*nic)
    }

    /// Number of sender sessions currently connected.
    pub fn sessions(&self) -> usize {
        lock(&self.inner.sessions).len()
    }

    /// A transport into another agent of this process (`local`).
    pub fn connect_local(&self, target: &Agent) -> Box<dyn Transport> {
        Box::new(super::local::LocalTransport::new(
            self.inner.registry.clone(),
            self.inner.identity.clone(),
            target.inner.clone(),
        ))
    }

    /// Connects to the agent listening at `addr` and performs the handshake.
    ///
    /// With [`TransportKind::Auto`], when rdma was chosen but its setup failed
    /// (e.g. the NICs cannot negotiate: different link layers, no GID), the
    /// connection falls back to tcp and logs why; an explicit `Rdma` fails
    /// with the reason instead.
    pub fn connect(&self, addr: &str, opts: &ConnectOptions) -> Result<Box<dyn Transport>> {
        match self.connect_once(addr, opts) {
            Err(e) if opts.transport == TransportKind::Auto && is_rdma_error(&e) => {
                log::warn!("rdma to {addr} failed ({e}); falling back to tcp");
                self.connect_once(
                    addr,
                    &ConnectOptions {
                        transport: TransportKind::Tcp,
                        ..opts.clone()
                    },
                )
            }
            r => r,
        }
    }

    fn connect_once(&self, addr: &str, opts: &ConnectOptions) -> Result<Box<dyn Transport>> {
        if opts.transport == TransportKind::Local {
            return Err(Error::invalid(
                "the local transport connects two agents of one process: use Agent::connect_local",
            ));
        }
        if opts.transport == TransportKind::Rdma {
            // No usable NIC here: the typed NoRdmaDevice with the reason, before dialing.
            self.inner.nic()?;
        }
        let sa = resolve(addr)?;
        let mut s = TcpStream::connect_timeout(&sa, opts.timeout)
            .map_err(|e| Error::new(Status::PeerUnreachable, format!("connect to {addr}: {e}")))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(opts.timeout))?;
        s.set_write_timeout(Some(opts.timeout))?;
        wire::write_json(
            &mut s,
            FrameType::Hello,
            &Hello {
                version: wire::VERSION,
                identity: self.inner.identity.clone(),
            },
        )?;
        let ack: HelloAck = wire::read_json(&mut s, FrameType::HelloAck).map_err(|e| {
            Error::new(e.status(), format!("handshake with {addr}: {}", e.detail()))
        })?;
        let me = &self.inner.identity;
        let kind = match opts.transport {
            TransportKind::Auto => {
                let same_host = !self.inner.deny_same_host
                    && me.same_host(&ack.identity)
                    && me.verify_local_peer(&ack.identity).is_ok();
                // cma cannot write device memory: a peer with device regions never gets it,
                // and gets rdma only when its NICs can take GPU memory (GPUDirect).
                let peer_device = ack
                    .regions
                    .iter()
                    .any(|r| matches!(r.kind, RegionKind::Device { .. }));
                let peer_nic = ack.rdma.is_some() && (!peer_device || ack.rdma_gpu_direct);
                // Open the local NICs only when rdma could be chosen.
                let local_nic = (!same_host || peer_device) && peer_nic && self.inner.nic().is_ok();
                super::choose_auto_for(same_host, local_nic, peer_nic, peer_device)
            }
            k => k,
        };
        // the control connection becomes the session's once the transport is agreed
        let start = |s: TcpStream| {
            Conn::start(
                s,
                ack.identity.clone(),
                ack.regions.clone(),
                self.inner.registry.clone(),
                ack.session,
                addr.to_string(),
            )
        };
        match kind {
            TransportKind::Cma => {
                let pidfd = super::cma::PeerProcess::open(me, &ack.identity)?;
                let proof = pidfd.read_u64(ack.nonce_addr)?;
                wire::write_json(
                    &mut s,
                    FrameType::Select,
                    &Select {
                        transport: TransportKind::Cma,
                        streams: 0,
                        proof,
                        rdma: None,
                    },
                )?;
                let _: serde_json::Value = wire::read_json(&mut s, FrameType::SelectOk)?;
                s.set_read_timeout(None)?;
                let conn = start(s)?;
                Ok(Box::new(super::cma::CmaTransport::new(
                    conn,
                    pidfd,
                    opts.threads.max(1) as usize,
                )?))
            }
            TransportKind::Rdma => {
                if ack.rdma.is_none() {
                    return Err(Error::new(
                        Status::TransportUnavailable,
                        format!(
                            "peer pid {} on {} at {addr} offers no RDMA: {}; use cma or tcp",
                            ack.identity.pid,
                            ack.identity.hostname,
                            ack.rdma_unavailable
                                .as_deref()
                                .unwrap_or("it predates RDMA support")
                        ),
                    ));
                }
                let nic = self.inner.nic()?;
                let ep = nic.endpoint()?;
                wire::write_json(
                    &mut s,
                    FrameType::Select,
                    &Select {
                        transport: TransportKind::Rdma,
                        streams: 0,
                        proof: 0,
                        rdma: Some(ep.local().encode()?),
                    },
                )?;
                let ok: SelectOk = wire::read_json(&mut s, FrameType::SelectOk).map_err(|e| {
                    Error::new(
                        e.status(),
                        format!("rdma handshake with {addr}: {}", e.detail()),
                    )
                })?;
                let remote = ok.rdma.ok_or_else(|| {
                    Error::new(
                        Status::Protocol,
                        format!("{addr} accepted rdma without sending its RDMA handshake"),
                    )
                })?;
                let remote = Handshake::decode(&remote).map_err(Error::from)?;
                let (path, negotiated) = ep.connect(&remote)?;
                log::info!(
                    "rdma: connected to {addr} over {} rail(s) of {} (path MTU {})",
                    negotiated.len(),
                    nic.describe(),
                    negotiated.first().map(|n| n.mtu.bytes()).unwrap_or(0)
                );
                s.set_read_timeout(None)?;
                let conn = start(s)?;
                Ok(Box::new(RdmaLink::new(conn, path, nic)?))
            }
            TransportKind::Tcp => {
                let n = opts.streams.clamp(1, 64);
                wire::write_json(
                    &mut s,
                    FrameType::Select,
                    &Select {
                        transport: TransportKind::Tcp,
                        streams: n,
                        proof: 0,
                        rdma: None,
                    },
                )?;
                let _: serde_json::Value = wire::read_json(&mut s, FrameType::SelectOk)?;
                let mut streams = Vec::new();
                for index in 0..n {
                    let mut d = TcpStream::connect_timeout(&sa, opts.timeout).map_err(|e| {
                        Error::new(
                            Status::PeerUnreachable,
                            format!("data stream {index} to {addr}: {e}"),
                        )
                    })?;
                    d.set_nodelay(true)?;
                    d.set_read_timeout(Some(opts.timeout))?;
                    wire::write_json(
                        &mut d,
                        FrameType::Attach,
                        &Attach {
                            session: ack.session,
                            token: ack.token,
                            index,
                        },
                    )?;
                    let _: serde_json::Value = wire::read_json(&mut d, FrameType::AttachOk)?;
                    streams.push(d);
                }
                s.set_read_timeout(None)?;
                let conn = start(s)?;
                Ok(Box::new(super::tcp::TcpTransport::new(conn, streams)?))
            }
            _ => Err(Error::new(
                Status::TransportUnavailable,
                format!("transport {} cannot be used here", kind.name()),
            )),
        }
    }

    /// Stops accepting peers and closes every receiver session.
    pub fn shutdown(&self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        let sessions: Vec<Arc<Session>> =
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

/// An error of the RDMA layer (-7xx): only the rdma path produces them.
fn is_rdma_error(e: &Error) -> bool {
    matches!(
        e.status(),
        Status::NoRdmaDevice
            | Status::Rdma
            | Status::RdmaHandshake
            | Status::RdmaCompletion
            | Status::NoGpuDirect
    )
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::invalid(format!("bad peer address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::invalid(format!("peer address {addr:?} resolves to nothing")))
}

fn accept_loop(l: TcpListener, agent: std::sync::Weak<AgentInner>) {
    let fd = l.as_raw_fd();
    loop {
        let Some(a) = agent.upgrade() else { return };
        if a.shutdown.load(Ordering::SeqCst) {
            return;
        }
        drop(a);
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: pfd is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 100) };
        if n <= 0 {
            continue;
        }
        let Ok((s, _)) = l.accept() else { continue };
        let Some(a) = agent.upgrade() else { return };
        let _ = std::thread::Builder::new()
            .name("pdxfer-rx".into())
            .spawn(move || serve_connection(a, s));
    }
}

fn serve_connection(a: Arc<AgentInner>, mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let (ty, p) = match wire::read_frame(&mut s) {
        Ok(f) => f,
        Err(_) => return,
    };
    match ty {
        FrameType::Hello => serve_control(a, s, &p),
        FrameType::Attach => serve_stream(a, s, &p),
        _ => {
            let e = Error::new(
                Status::Protocol,
                format!("first frame must be Hello or Attach, got {ty:?}"),
            );
            let _ = wire::write_frame(&mut s, FrameType::Error, &wire::encode_error(&e));
        }
    }
}

fn refuse(s: &mut TcpStream, e: Error) {
    let _ = wire::write_frame(s, FrameType::Error, &wire::encode_error(&e));
}

fn serve_control(a: Arc<AgentInner>, mut s: TcpStream, hello: &[u8]) {
    let hello: Hello = match serde_json::from_slice(hello) {
        Ok(h) => h,
        Err(e) => {
            return refuse(
                &mut s,
                Error::new(Status::Protocol, format!("malformed Hello: {e}")),
            );
        }
    };
    if hello.version != wire::VERSION {
        return refuse(
            &mut s,
            Error::new(
                Status::Protocol,
                format!(
                    "client speaks wire version {}, server {}",
                    hello.version,
                    wire::VERSION
                ),
            ),
        );
    }
    let id = a.next_session.fetch_add(1, Ordering::SeqCst);
    let session = Arc::new(Session {
        id,
        token: random_u64(),
        nonce: Box::new(random_u64()),
        peer: Mutex::new(Some(hello.identity.clone())),
        writer: Mutex::new(s.try_clone().ok()),
        granted: Mutex::new(HashMap::new()),
        tcp: Mutex::new(TcpRecv::default()),
        sockets: Mutex::new(s.try_clone().into_iter().collect()),
        rdma: Mutex::new(None),
        closed: AtomicBool::new(false),
    });
    let nic = a.nic();
    let ack = HelloAck {
        version: wire::VERSION,
        identity: a.identity.clone(),
        regions: a.registry.descriptors(),
        session: id,
        token: session.token,
        nonce_addr: &*session.nonce as *const u64 as u64,
        rdma: nic.as_ref().ok().map(|n| n.describe()),
        rdma_unavailable: nic.as_ref().err().map(|e| e.detail().to_string()),
        rdma_gpu_direct: nic.as_ref().is_ok_and(|n| n.gpu_direct().is_ok()),
    };
    lock(&a.sessions).insert(id, session.clone());
    let mut run = || -> Result<()> {
        wire::write_json(&mut s, FrameType::HelloAck, &ack)?;
        let sel: Select = wire::read_json(&mut s, FrameType::Select)?;
        let mut ok = SelectOk::default();
        match sel.transport {
            TransportKind::Cma => {
                if sel.proof != *session.nonce {
                    return Err(Error::new(
                        Status::PeerIdentity,
                        "cma proof mismatch: the client read another process's memory (pid namespace or pid mix-up); use tcp",
                    ));
                }
            }
            TransportKind::Tcp => {}
            TransportKind::Rdma => {
                let nic = nic.clone()?;
                let remote = sel.rdma.as_deref().ok_or_else(|| {
                    Error::new(
                        Status::Protocol,
                        "rdma selected without the client's RDMA handshake",
                    )
                })?;
                let remote = Handshake::decode(remote).map_err(Error::from)?;
                let (local, path) = accept_rdma(&a.registry, &*nic, &remote)?;
                *lock(&session.rdma) = Some(path);
                ok.rdma = Some(local);
            }
            k => {
                return Err(Error::new(
                    Status::TransportUnavailable,
                    format!("this receiver serves cma, tcp and rdma, not {}", k.name()),
                ))
            }
        }
        wire::write_json(&mut s, FrameType::SelectOk, &ok)?;
        s.set_read_timeout(None)?;
        control_loop(&a, &session, &mut s, hello.identity.clone())
    };
    if let Err(e) = run() {
        if e.status() != Status::PeerUnreachable {
            refuse(&mut s, e);
        }
    }
    session.close();
    lock(&a.sessions).remove(&id);
}

/// The receiver's half of the RDMA handshake: registers every region with
/// the NIC (so rkeys exist; device regions where it has GPUDirect RDMA), creates the endpoint, negotiates with the
/// client's handshake and brings the QPs up. Returns the encoded local
/// handshake and the connected data path.
fn accept_rdma(
    reg: &Registry,
    nic: &dyn NicProvider,
    remote: &Handshake,
) -> Result<(Vec<u8>, Box<dyn DataPath>)> {
    register_all(reg, nic)?;
    let ep = nic.endpoint()?;
    let local = ep.local().encode()?;
    let (path, negotiated) = ep.connect(remote)?;
    log::info!(
        "rdma: accepted a connection over {} rail(s) of {}",
        negotiated.len(),
        nic.describe()
    );
    Ok((local, path))
}

/// Registers every region of `reg` with the NIC (already registered ranges
/// are skipped by the provider). Device regions go through the NIC's GPU
/// path; where that fails (no GPUDirect RDMA) they are skipped with a
/// warning, since the host regions still work: batches into them are refused
/// at grant, and from them at submit, with the reason.
fn register_all(reg: &Registry, nic: &dyn NicProvider) -> Result<()> {
    let gpu = nic.gpu_direct();
    for d in reg.descriptors() {
        if d.kind != RegionKind::Host {
            let r = gpu.clone().and_then(|()| {
                // SAFETY: as for host regions below.
                unsafe { nic.register(d.addr, d.len, d.kind) }
            });
            if let Err(e) = r {
                log::warn!(
                    "rdma: device region {} is not registered with the NIC, so rdma cannot move it: {e}",
                    d.id
                );
            }
            continue;
        }
        // SAFETY: a registry region stays valid until unregistered, and the
        // registry's unregister hook deregisters it from the NIC first; peers
        // write only into ranges this side granted and pinned.
        unsafe { nic.register(d.addr, d.len, d.kind) }.map_err(|e| {
            Error::new(
                e.status(),
                format!(
                    "region {} cannot be registered with the RDMA NIC: {}",
                    d.id,
                    e.detail()
                ),
            )
        })?;
    }
    Ok(())
}

#[cfg(feature = "rdma")]
fn open_default_nic() -> Result<Arc<dyn NicProvider>> {
    let cfg = super::rdma::RdmaConfig::from_env()?;
    Ok(Arc::new(super::rdma::nic::VerbsProvider::open(cfg)?))
}

#[cfg(not(feature = "rdma"))]
fn open_default_nic() -> Result<Arc<dyn NicProvider>> {
    Err(Error::new(
        Status::NoRdmaDevice,
        "this build of pdxfer has no `rdma` feature (no verbs support)",
    ))
}

fn control_loop(
    a: &AgentInner,
    sess: &Session,
    s: &mut TcpStream,
    peer: ProcIdentity,
) -> Result<()> {
    loop {
        let (ty, p) = wire::read_frame(s)?;
        match ty {
            FrameType::Intent | FrameType::ReadIntent => {
                let read = ty == FrameType::ReadIntent;
                let (batch, ranges) = wire::decode_intent(&p)?;
                if !a.stall.is_zero() {
                    std::thread::sleep(a.stall);
                }
                // Device memory only over rdma, and only once the NIC registered
                // it (GPUDirect RDMA; an exact range registered before is a lookup).
                let nic = lock(&sess.rdma).is_some().then(|| a.nic());
                let device = |d: &RegionDesc| -> Result<()> {
                    match &nic {
                        // SAFETY: a registry region stays valid until unregistered,
                        // whose hook deregisters it from the NIC first.
                        Some(Ok(n)) => unsafe { n.register(d.addr, d.len, d.kind) }.map(|_| ()),
                        Some(Err(e)) => Err(e.clone()),
                        None => Err(Error::new(
                            Status::Unsupported,
                            "cma writes host memory only",
                        )),
                    }
                };
                match grant(&a.registry, &ranges, &device) {
                    Ok((guards, device)) => {
                        lock(&sess.granted).insert(
                            batch,
                            Granted {
                                ranges,
                                guards,
                                device,
                                read,
                            },
                        );
                        sess.send(FrameType::Grant, &batch.to_le_bytes());
                    }
                    Err(e) => sess.send(FrameType::Refuse, &wire::encode_reason(batch, &e)),
                }
            }
            FrameType::Abort => {
                let batch = wire::decode_batch(&p)?;
                lock(&sess.granted).remove(&batch);
            }
            FrameType::Commit => {
                let c = wire::decode_commit(&p)?;
                let g = lock(&sess.granted).remove(&c.batch);
                match g {
                    Some(g) => {
                        let r = finish_cma(&g, &c);
                        let read = g.read;
                        drop(g);
                        match r {
                            Ok(()) => {
                                if !read {
                                    a.deliver(peer.clone(), sess.id, completion(&c));
                                }
                                sess.send(FrameType::Ack, &c.batch.to_le_bytes());
                            }
                            Err(e) => sess.send(FrameType::Nack, &wire::encode_reason(c.batch, &e)),
                        }
                    }
                    None => {
                        let mut t = lock(&sess.tcp);
                        if t.finished.contains(&c.batch) {
                            continue;
                        }
                        t.batches.entry(c.batch).or_default().commit = Some(c);
                        finalize_tcp(a, sess, &mut t, c.batch, &peer);
                    }
                }
            }
            other => {
                return Err(Error::new(
                    Status::Protocol,
                    format!("unexpected {other:?} frame on a control connection"),
                ))
            }
        }
    }
}

fn completion(c: &Commit) -> Completion {
    Completion {
        batch_id: BatchId(c.batch),
        bytes: c.bytes,
        checksum: c.checksum,
        room: c.room,
        epoch: c.epoch,
    }
}

/// Validates and pins every range of a cma or rdma intent; all or nothing.
/// `device` says whether a device region may be written (cma: never; rdma:
/// once the NIC registered it), or why not. Returns the guards and whether
/// a range is device memory.
fn grant(
    reg: &Registry,
    ranges: &[Range],
    device: &dyn Fn(&RegionDesc) -> Result<()>,
) -> Result<(Vec<AccessGuard>, bool)> {
    let mut guards: Vec<AccessGuard> = Vec::new();
    let mut descs: HashMap<u64, RegionDesc> = HashMap::new();
    let mut any_device = false;
    for (i, r) in ranges.iter().enumerate() {
        let ctx = |e: Error| Error::new(e.status(), format!("range {i}: {}", e.detail()));
        let d = match descs.entry(r.region) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let d = reg.get(r.region).map_err(ctx)?;
                if d.kind != RegionKind::Host {
                    device(&d).map_err(|e| {
                        ctx(Error::new(
                            e.status(),
                            format!("region {} is device memory: {}", r.region, e.detail()),
                        ))
                    })?;
                    any_device = true;
                }
                guards.push(reg.acquire(r.region, 0, 0).map_err(ctx)?);
                v.insert(d)
            }
        };
        d.check(r.offset, r.len).map_err(ctx)?;
    }
    Ok((guards, any_device))
}

fn finish_cma(g: &Granted, c: &Commit) -> Result<()> {
    let total: u64 = g.ranges.iter().map(|r| r.len).sum();
    if total != c.bytes {
        return Err(Error::new(
            Status::Protocol,
            format!("commit says {} bytes but {} were granted", c.bytes, total),
        ));
    }
    if let Some(want) = c.checksum {
        if g.device {
            return Err(Error::new(
                Status::Unsupported,
                "a checksum over device memory is not supported (the CPU cannot read it); submit without checksum",
            ));
        }
        let mut got = 0u64;
        for (r, addr) in g.ranges.iter().zip(range_addrs(g)) {
            // SAFETY: the range was bounds-checked at grant and its region is pinned by g.guards.
            let d = unsafe { std::slice::from_raw_parts(addr as *const u8, r.len as usize) };
            got = checksum::combine(got, checksum::piece(r.region, r.offset, d));
        }
        if got != want {
            return Err(Error::new(
                Status::BatchFailed,
                format!("checksum mismatch: sender 0x{want:016x}, landed bytes 0x{got:016x}"),
            ));
        }
    }
    Ok(())
}

fn range_addrs(g: &Granted) -> Vec<u64> {
    // Guards are per region (offset 0): region base = guard addr.
    let base: HashMap<u64, u64> = g.guards.iter().map(|x| (x.region(), x.addr())).collect();
    g.ranges
        .iter()
        .map(|r| base.get(&r.region).copied().unwrap_or(0) + r.offset)
        .collect()
}

fn finalize_tcp(a: &AgentInner, sess: &Session, t: &mut TcpRecv, batch: u64, peer: &ProcIdentity) {
    let Some(b) = t.batches.get(&batch) else {
        return;
    };
    let Some(c) = b.commit else { return };
    let verdict = if let Some(e) = &b.failed {
        Some(Err(e.clone()))
    } else if b.received > c.bytes {
        Some(Err(Error::new(
            Status::Protocol,
            format!(
                "received {} bytes for a batch committed with {}",
                b.received, c.bytes
            ),
        )))
    } else if b.received == c.bytes {
        match c.checksum {
            Some(want) if want != b.sum => Some(Err(Error::new(
                Status::BatchFailed,
                format!(
                    "checksum mismatch: sender 0x{want:016x}, landed bytes 0x{:016x}",
                    b.sum
                ),
            ))),
            _ => Some(Ok(())),
        }
    } else {
        None
    };
    match verdict {
        None => {}
        Some(Ok(())) => {
            t.batches.remove(&batch);
            t.mark_finished(batch);
            a.deliver(peer.clone(), sess.id, completion(&c));
            sess.send(FrameType::Ack, &batch.to_le_bytes());
        }
        Some(Err(e)) => {
            t.batches.remove(&batch);
            t.mark_finished(batch);
            sess.send(FrameType::Nack, &wire::encode_reason(batch, &e));
        }
    }
}

fn serve_stream(a: Arc<AgentInner>, mut s: TcpStream, p: &[u8]) {
    let att: Attach = match serde_json::from_slice(p) {
        Ok(x) => x,
        Err(e) => {
            return refuse(
                &mut s,
                Error::new(Status::Protocol, format!("malformed Attach: {e}")),
            )
        }
    };
    let sess = lock(&a.sessions).get(&att.session).cloned();
    let Some(sess) = sess.filter(|x| x.token == att.token) else {
        return refuse(
            &mut s,
            Error::new(
                Status::Unauthorized,
                format!("no session {} with that token", att.session),
            ),
        );
    };
    if wire::write_json(&mut s, FrameType::AttachOk, &serde_json::json!({})).is_err() {
        return;
    }
    let _ = s.set_read_timeout(None);
    if let Ok(c) = s.try_clone() {
        lock(&sess.sockets).push(c);
    }
    let peer = lock(&sess.peer)
        .clone()
        .unwrap_or_else(|| a.identity.clone());
    if let Err(e) = stream_loop(&a, &sess, &mut s, &peer) {
        if e.status() == Status::Protocol {
            // A desynchronised stream cannot be trusted: end the session.
            sess.close();
        }
    }
}

fn stream_loop(
    a: &AgentInner,
    sess: &Session,
    s: &mut TcpStream,
    peer: &ProcIdentity,
) -> Result<()> {
    let mut scratch = vec![0u8; 64 << 10];
    // from the first device writer met (page-locked where it can)
    let mut bounce: Option<crate::memory::BounceBuffer> = None;
    let mut hb = [0u8; DATA_HEADER_LEN];
    loop {
        if sess.closed.load(Ordering::SeqCst) {
            return Ok(());
        }
        s.read_exact(&mut hb)?;
        let h = DataHeader::decode(&hb)?;
        if !a.stall.is_zero() {
            let new = lock(&sess.tcp).stalled.insert(h.batch);
            if new {
                std::thread::sleep(a.stall);
            }
        }
        let outcome = receive_piece(&a.registry, s, &h, &mut scratch, &mut bounce)?;
        let mut t = lock(&sess.tcp);
        if t.finished.contains(&h.batch) {
            continue;
        }
        let b = t.batches.entry(h.batch).or_default();
        match outcome {
            Ok(sum) => {
                b.received += h.len;
                b.sum = checksum::combine(b.sum, sum);
            }
            Err(e) => {
                if b.failed.is_none() {
                    b.failed = Some(e);
                }
            }
        }
        finalize_tcp(a, sess, &mut t, h.batch, peer);
    }
}

/// Bytes of the host bounce buffer a tcp stream lands device-region payloads
/// in before its device writer copies them (one per stream, on first use),
/// used as two halves of 2 MiB: one is read into while the other is copied.
const DEVICE_BOUNCE_BYTES: usize = 4 << 20;

/// Receives the payload of one data piece `h` from `s` into its destination:
/// straight into a host region, or through `bounce` (allocated by the first
/// device writer met, [`DEVICE_BOUNCE_BYTES`]) and the region's
/// [`DeviceWriter`](crate::memory::DeviceWriter) into a device region (the
/// piece counts as received only once the writer has every byte in device
/// memory). The outer error is the socket's (the stream is lost); the inner
/// one a refused or failed write, whose payload was drained so the stream
/// stays in sync. `Ok(Ok(sum))` carries the piece checksum (0 unless the
/// header asks for one), computed on the bytes received.
fn receive_piece(
    reg: &Registry,
    s: &mut impl Read,
    h: &DataHeader,
    scratch: &mut [u8],
    bounce: &mut Option<crate::memory::BounceBuffer>,
) -> Result<Result<u64>> {
    let want_sum = h.flags & wire::DATA_FLAG_CHECKSUM != 0;
    let access = reg.acquire(h.region, h.offset, h.len).and_then(|g| {
        match reg.kind(h.region)? {
            RegionKind::Host => Ok((g, None)),
            RegionKind::Device { .. } => match reg.device_writer(h.region) {
                Some(w) => Ok((g, Some(w))),
                None => Err(Error::new(
                    Status::Unsupported,
                    format!(
                        "region {} is device memory registered without a device writer; tcp cannot write it",
                        h.region
                    ),
                )),
            },
        }
    });
    let refused = match access {
        Ok((g, None)) => {
            // SAFETY: the guard proves [addr, addr+len) lies in a registered host region, pinned until g drops.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(g.addr() as *mut u8, h.len as usize) };
            s.read_exact(dst)?;
            let sum = if want_sum {
                checksum::piece(h.region, h.offset, dst)
            } else {
                0
            };
            drop(g);
            return Ok(Ok(sum));
        }
        Ok((g, Some(w))) => {
            let b = bounce.get_or_insert_with(|| w.bounce(DEVICE_BOUNCE_BYTES));
            let r = receive_into_device(s, h, g.addr(), &*w, b.as_mut_slice(), scratch)?;
            drop(g);
            return Ok(r);
        }
        Err(e) => e,
    };
    // Nothing is written: drain the payload into scratch to stay in sync.
    drain(s, h.len, scratch)?;
    Ok(Err(Error::new(
        refused.status(),
        format!(
            "write of {} bytes to region {} offset {} refused: {}",
            h.len,
            h.region,
            h.offset,
            refused.detail()
        ),
    )))
}

fn drain(s: &mut impl Read, mut left: u64, scratch: &mut [u8]) -> Result<()> {
    while left > 0 {
        let n = left.min(scratch.len() as u64) as usize;
        s.read_exact(&mut scratch[..n])?;
        left -= n as u64;
    }
    Ok(())
}

/// Lands one piece in device memory at `dst` (bounds-checked and pinned by
/// the caller), double-buffered: `bounce` is split in two halves, and while
/// the copy of one slice (started with
/// [`write_async`](crate::memory::DeviceWriter::write_async)) runs from one
/// half, the next slice is read from the socket into the other. A half is
/// rewritten only after its previous copy was waited, and every copy is
/// waited before this returns, so the piece counts as received only once all
/// its bytes are in device memory. A failed copy drains the rest of the
/// payload and fails the piece.
fn receive_into_device(
    s: &mut impl Read,
    h: &DataHeader,
    dst: u64,
    w: &dyn crate::memory::DeviceWriter,
    bounce: &mut [u8],
    scratch: &mut [u8],
) -> Result<Result<u64>> {
    let mut hasher = (h.flags & wire::DATA_FLAG_CHECKSUM != 0)
        .then(|| checksum::PieceHasher::new(h.region, h.offset));
    if bounce.is_empty() {
        return Err(Error::new(
            Status::InvalidArgument,
            "empty device bounce buffer",
        ));
    }
    // A one-byte bounce buffer is used as one half (the second is empty).
    let (first, second) = bounce.split_at_mut((bounce.len() / 2).max(1));
    let halves = [first, second];
    // Per half: the copy still reading it (fence, piece-relative offset, length).
    // Dropping a fence waits for it, so an early return (a lost socket)
    // never leaves a copy reading a half that is released or rewritten.
    let mut pending: [Option<(crate::memory::Fence, u64, usize)>; 2] = [None, None];
    let mut failed: Option<(Error, u64, usize)> = None;
    let mut done = 0u64;
    let mut k = 0usize;
    while done < h.len {
        if halves[k].is_empty() {
            k = 0;
        }
        // Reusing half k: its previous copy must be done reading it.
        if let Some((f, at, n)) = pending[k].take() {
            if let Err(e) = f.wait() {
                failed = Some((e, at, n));
                break;
            }
        }
        let n = (h.len - done).min(halves[k].len() as u64) as usize;
        let buf = &mut halves[k][..n];
        s.read_exact(buf)?;
        if let Some(x) = hasher.as_mut() {
            x.update(buf);
        }
        // SAFETY: `buf` lies in `bounce`, which outlives this call; half k is
        // rewritten only after this copy's fence was waited (above), and
        // every fence is waited, or dropped (which waits), before this returns.
        match unsafe { w.write_async(dst + done, buf.as_ptr(), n) } {
            Ok(f) => pending[k] = Some((f, done, n)),
            Err(e) => {
                failed = Some((e, done, n));
                done += n as u64;
                break;
            }
        }
        done += n as u64;
        k ^= 1;
    }
    // Every copy still running is waited, the older first (k is the next half
    // to be reused, hence the older copy).
    for i in [k, k ^ 1] {
        if let Some((f, at, n)) = pending[i].take() {
            if let Err(e) = f.wait() {
                if failed.is_none() {
                    failed = Some((e, at, n));
                }
            }
        }
    }
    if let Some((e, at, n)) = failed {
        drain(s, h.len - done, scratch)?;
        return Ok(Err(Error::new(
            e.status(),
            format!(
                "copying {n} bytes into device region {} at offset {}: {}",
                h.region,
                h.offset + at,
                e.detail()
            ),
        )));
    }
    Ok(Ok(hasher.map_or(0, |x| x.finish())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{BatchOptions, BatchStatus, WriteOp};

    type Pair = (
        Agent,
        Agent,
        Vec<u8>,
        Vec<u8>,
        Box<dyn Transport>,
        RegionDesc,
        RegionDesc,
    );

    fn pair(kind: TransportKind, streams: u32) -> Pair {
        let rx = Agent::new(&AgentOptions {
            listen: Some("127.0.0.1:0".into()),
            ..Default::default()
        })
        .unwrap();
        let tx = Agent::new(&AgentOptions::default()).unwrap();
        let mut dst = vec![0u8; 1 << 20];
        let mut src: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
        // SAFETY: the buffers are returned to the caller and outlive the agents' use.
        let d = unsafe { rx.register_host(dst.as_mut_ptr(), dst.len()) }.unwrap();
        // SAFETY: as above.
        let s = unsafe { tx.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
        let addr = rx.local_addr().unwrap().to_string();
        let t = if kind == TransportKind::Local {
            tx.connect_local(&rx)
        } else {
            tx.connect(
                &addr,
                &ConnectOptions {
                    transport: kind,
                    streams,
                    threads: 2,
                    ..Default::default()
                },
            )
            .unwrap()
        };
        (rx, tx, dst, src, t, d, s)
    }

    fn roundtrip(kind: TransportKind, streams: u32) {
        let (rx, _tx, dst, src, t, d, s) = pair(kind, streams);
        assert_eq!(t.kind(), kind);
        assert_eq!(t.remote_regions(), vec![d.clone()]);
        let ops = vec![
            WriteOp {
                local_region: s.id,
                local_offset: 0,
                remote_region: d.id,
                remote_offset: 100,
                len: 4096,
            },
            WriteOp {
                local_region: s.id,
                local_offset: 5000,
                remote_region: d.id,
                remote_offset: 300_000,
                len: 700_000,
            },
            WriteOp {
                local_region: s.id,
                local_offset: 17,
                remote_region: d.id,
                remote_offset: 0,
                len: 1,
            },
        ];
        let opts = BatchOptions {
            checksum: true,
            room: 42,
            epoch: 3,
            ..Default::default()
        };
        let id = t.submit(&ops, &opts).unwrap();
        let c = t.wait(id, Duration::from_secs(10)).unwrap();
        assert_eq!(c.bytes, 4096 + 700_000 + 1);
        assert_eq!((c.room, c.epoch), (42, 3));
        assert!(c.checksum.is_some());
        let inc = rx
            .next_completion(Duration::from_secs(5))
            .expect("receiver completion");
        assert_eq!(inc.completion, c);
        assert_eq!(&dst[100..4196], &src[..4096]);
        assert_eq!(&dst[300_000..1_000_000], &src[5000..705_000]);
        assert_eq!(dst[0], src[17]);
        assert!(dst[4196..300_000].iter().all(|&b| b == 0));
        // Out of bounds: refused before anything is sent.
        let bad = [WriteOp {
            remote_offset: (1 << 20) - 10,
            len: 11,
            ..ops[0]
        }];
        let e = t.submit(&bad, &opts).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds, "{e}");
        let bad = [WriteOp {
            remote_region: 99,
            ..ops[0]
        }];
        assert_eq!(
            t.submit(&bad, &opts).unwrap_err().status(),
            Status::RegionNotFound
        );
        // Polling: once terminal, the id is forgotten.
        let id = t.submit(&ops[..1], &BatchOptions::default()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match t.poll(id).unwrap() {
                BatchStatus::Pending => assert!(std::time::Instant::now() < deadline),
                BatchStatus::Done(c) => {
                    assert_eq!(c.bytes, 4096);
                    break;
                }
                BatchStatus::Failed(e) => panic!("{e}"),
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(t.poll(id).unwrap_err().status(), Status::InvalidArgument);
        // The receiver's region stays pinned-free afterwards and can be unregistered.
        std::thread::sleep(Duration::from_millis(20));
        rx.registry()
            .unregister(d.id, Duration::from_secs(2))
            .unwrap();
        t.close();
        assert!(!t.is_alive());
    }

    fn reads(kind: TransportKind, shared: bool) {
        let rx = Agent::new(&AgentOptions {
            listen: Some("127.0.0.1:0".into()),
            ..Default::default()
        })
        .unwrap();
        let tx = Agent::new(&AgentOptions::default()).unwrap();
        let mut heap = vec![0u8; 1 << 16];
        let d = if shared {
            rx.registry().alloc_shared(1 << 16).unwrap()
        } else {
            // SAFETY: heap outlives the agents' use in this test.
            unsafe { rx.register_host(heap.as_mut_ptr(), heap.len()) }.unwrap()
        };
        let base = rx.registry().check_access(d.id, 0, 1 << 16).unwrap();
        for i in 0..(1u64 << 16) {
            // SAFETY: inside the registered region.
            unsafe { *((base + i) as *mut u8) = (i * 5 + 1) as u8 };
        }
        let mut local = vec![0u8; 1 << 16];
        // SAFETY: local outlives the transport.
        let l = unsafe { tx.register_host(local.as_mut_ptr(), local.len()) }.unwrap();
        let t = if kind == TransportKind::Local {
            tx.connect_local(&rx)
        } else {
            let o = ConnectOptions {
                transport: kind,
                ..Default::default()
            };
            tx.connect(&rx.local_addr().unwrap().to_string(), &o)
                .unwrap()
        };
        let ops = [crate::transport::ReadOp {
            local_region: l.id,
            local_offset: 8,
            remote_region: d.id,
            remote_offset: 1000,
            len: 30_000,
        }];
        let opts = BatchOptions {
            checksum: true,
            ..Default::default()
        };
        let c = t
            .wait(
                t.submit_reads(&ops, &opts).unwrap(),
                Duration::from_secs(10),
            )
            .unwrap();
        assert_eq!(c.bytes, 30_000);
        assert!(c.checksum.is_some());
        for i in 0..30_000usize {
            assert_eq!(
                local[8 + i],
                ((1000 + i) * 5 + 1) as u8,
                "{kind:?} byte {i}"
            );
        }
        // A read leaves the peer's memory as it was.
        for i in 0..(1u64 << 16) {
            // SAFETY: inside the registered region.
            assert_eq!(
                unsafe { *((base + i) as *const u8) },
                (i * 5 + 1) as u8,
                "peer byte {i} changed"
            );
        }
        // The peer delivers no completion record for reads.
        assert!(rx.next_completion(Duration::from_millis(50)).is_none());
        let bad = [crate::transport::ReadOp {
            remote_offset: 60_000,
            len: 10_000,
            ..ops[0]
        }];
        assert_eq!(
            t.submit_reads(&bad, &opts).unwrap_err().status(),
            Status::OutOfBounds
        );
        drop(heap);
    }

    #[test]
    fn reads_over_local_and_cma() {
        reads(TransportKind::Local, false);
        reads(TransportKind::Cma, false);
        reads(TransportKind::Cma, true);
        let (_rx, _tx, _d, _s, t, d, s) = pair(TransportKind::Tcp, 1);
        let op = crate::transport::ReadOp {
            local_region: s.id,
            local_offset: 0,
            remote_region: d.id,
            remote_offset: 0,
            len: 1,
        };
        let e = t.submit_reads(&[op], &BatchOptions::default()).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported);
    }

    #[test]
    fn local_roundtrip() {
        roundtrip(TransportKind::Local, 1);
    }

    #[test]
    fn cma_roundtrip_in_process() {
        roundtrip(TransportKind::Cma, 1);
    }

    #[test]
    fn tcp_roundtrip_in_process() {
        roundtrip(TransportKind::Tcp, 1);
        roundtrip(TransportKind::Tcp, 3);
    }

    #[test]
    fn auto_picks_cma_on_this_host_and_rdma_is_typed() {
        let (_rx, _tx, _d, _s, t, _, _) = pair(TransportKind::Auto, 1);
        assert_eq!(t.kind(), TransportKind::Cma);
        let tx = Agent::new(&AgentOptions::default()).unwrap();
        let e = tx
            .connect(
                "127.0.0.1:1",
                &ConnectOptions {
                    transport: TransportKind::Rdma,
                    ..Default::default()
                },
            )
            .unwrap_err();
        // Without a usable NIC here: the typed NoRdmaDevice with the reason,
        // before dialing; with NICs, the dial itself fails.
        if tx.inner.nic().is_err() {
            assert_eq!(e.status(), Status::NoRdmaDevice, "{e}");
            assert!(!e.detail().is_empty());
        } else {
            assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
        }
        let e = tx
            .connect(
                "127.0.0.1:1",
                &ConnectOptions {
                    transport: TransportKind::Tcp,
                    ..Default::default()
                },
            )
            .unwrap_err();
        assert_eq!(e.status(), Status::PeerUnreachable);
    }

    /// A host-memory stand-in for a CUDA device writer: "device" addresses
    /// are host addresses of `[base, base + len)`; counts its copies.
    struct HostAsDevice {
        base: u64,
        len: u64,
        writes: AtomicU64,
        largest: AtomicU64,
        fail_at: Option<u64>,
    }

    impl HostAsDevice {
        fn new(buf: &mut [u8], fail_at: Option<u64>) -> Arc<HostAsDevice> {
            Arc::new(HostAsDevice {
                base: buf.as_mut_ptr() as u64,
                len: buf.len() as u64,
                writes: AtomicU64::new(0),
                largest: AtomicU64::new(0),
                fail_at,
            })
        }
    }

    impl crate::memory::DeviceWriter for HostAsDevice {
        fn write(&self, dst: u64, src: &[u8]) -> Result<()> {
            let n = self.writes.fetch_add(1, Ordering::SeqCst);
            if Some(n) == self.fail_at {
                return Err(Error::new(Status::Cuda, "injected copy failure"));
            }
            assert!(
                dst >= self.base && dst + src.len() as u64 <= self.base + self.len,
                "write outside the fake device memory"
            );
            self.largest.fetch_max(src.len() as u64, Ordering::SeqCst);
            // SAFETY: checked above to lie inside the live test buffer.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
            Ok(())
        }
    }

    #[test]
    fn tcp_receiver_lands_device_pieces_through_the_writer_in_slices() {
        let mut mem = vec![0u8; 4096];
        let w = HostAsDevice::new(&mut mem, None);
        let reg = Registry::new();
        // SAFETY: the writer accepts exactly the buffer's addresses.
        let d = unsafe { reg.register_device_unchecked_with(w.base, 4096, 0, Some(w.clone())) }
            .unwrap();
        assert!(matches!(d.kind, RegionKind::Device { ordinal: 0 }));
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 13 + 1) as u8).collect();
        let h = DataHeader {
            flags: wire::DATA_FLAG_CHECKSUM,
            batch: 1,
            region: d.id,
            offset: 100,
            len: 1000,
        };
        let mut scratch = vec![0u8; 100];
        let mut bounce = Some(crate::memory::BounceBuffer::heap(64));
        let mut s = std::io::Cursor::new(payload.clone());
        let sum = receive_piece(&reg, &mut s, &h, &mut scratch, &mut bounce)
            .unwrap()
            .unwrap();
        assert_eq!(sum, checksum::piece(d.id, 100, &payload));
        assert_eq!(&mem[100..1100], &payload[..]);
        assert!(mem[..100].iter().chain(&mem[1100..]).all(|&b| b == 0));
        // two 32-byte halves of the 64-byte bounce buffer
        assert_eq!(w.writes.load(Ordering::SeqCst), 1000u64.div_ceil(32));
        assert_eq!(w.largest.load(Ordering::SeqCst), 32);
        assert_eq!(reg.inflight(d.id).unwrap(), 0);

        // Out of bounds: refused, nothing written, the payload drained.
        let before = mem.clone();
        let bad = DataHeader {
            offset: 4000,
            len: 200,
            ..h
        };
        let mut s = std::io::Cursor::new(vec![0xabu8; 200 + 7]);
        let e = receive_piece(&reg, &mut s, &bad, &mut scratch, &mut bounce)
            .unwrap()
            .unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds, "{e}");
        assert_eq!(s.position(), 200);
        assert_eq!(mem, before);
        assert_eq!(w.writes.load(Ordering::SeqCst), 1000u64.div_ceil(32));

        // A failed copy fails the piece and drains the rest of it.
        let mut mem2 = vec![0u8; 4096];
        let w2 = HostAsDevice::new(&mut mem2, Some(1));
        // SAFETY: as above.
        let d2 = unsafe { reg.register_device_unchecked_with(w2.base, 4096, 0, Some(w2.clone())) }
            .unwrap();
        let mut s = std::io::Cursor::new(payload.clone());
        let h2 = DataHeader { region: d2.id, ..h };
        let e = receive_piece(&reg, &mut s, &h2, &mut scratch, &mut bounce)
            .unwrap()
            .unwrap_err();
        assert_eq!(e.status(), Status::Cuda, "{e}");
        assert_eq!(s.position(), 1000);

        // A device region without a writer: refused as unsupported, drained.
        let mut mem3 = vec![0u8; 64];
        // SAFETY: no writer: nothing may write it.
        let d3 =
            unsafe { reg.register_device_unchecked_with(mem3.as_mut_ptr() as u64, 64, 0, None) }
                .unwrap();
        let mut s = std::io::Cursor::new(vec![1u8; 8]);
        let h3 = DataHeader {
            region: d3.id,
            offset: 0,
            len: 8,
            ..h
        };
        let e = receive_piece(&reg, &mut s, &h3, &mut scratch, &mut bounce)
            .unwrap()
            .unwrap_err();
        assert_eq!(e.status(), Status::Unsupported, "{e}");
        assert!(mem3.iter().all(|&b| b == 0));
        assert_eq!(s.position(), 8);
    }

    /// One copy started by [`DeferredDevice`] and not yet waited.
    struct PendingCopy {
        id: u64,
        dst: u64,
        src: usize,
        len: usize,
        /// The source bytes when the copy was started.
        snapshot: Vec<u8>,
    }

    #[derive(Default)]
    struct DeferredState {
        pending: Vec<PendingCopy>,
        next: u64,
        started: u64,
        landed: u64,
        most_pending: usize,
        /// Copies whose source changed between their start and their wait.
        overwritten: u64,
        /// Socket reads into memory a pending copy still reads.
        reads_into_pending: u64,
        fail_wait_of: Option<u64>,
    }

    /// A host-memory "device" whose asynchronous copies land only when their
    /// fence is waited (or dropped), reading the source at that moment as a
    /// DMA from pinned memory does.
    struct DeferredDevice {
        base: u64,
        len: u64,
        st: Arc<Mutex<DeferredState>>,
    }

    impl DeferredDevice {
        fn land(st: &Mutex<DeferredState>, id: u64) -> Result<()> {
            let mut g = lock(st);
            let i = g.pending.iter().position(|c| c.id == id).unwrap();
            let c = g.pending.remove(i);
            if g.fail_wait_of == Some(id) {
                return Err(Error::new(Status::Cuda, "injected copy failure"));
            }
            // SAFETY: the receiver keeps the source alive until the fence is waited.
            let now = unsafe { std::slice::from_raw_parts(c.src as *const u8, c.len) };
            if now != &c.snapshot[..] {
                g.overwritten += 1;
            }
            // SAFETY: dst was checked against the fake device memory at the start.
            unsafe { std::ptr::copy_nonoverlapping(now.as_ptr(), c.dst as *mut u8, c.len) };
            g.landed += 1;
            Ok(())
        }
    }

    impl crate::memory::DeviceWriter for DeferredDevice {
        fn write(&self, _dst: u64, _src: &[u8]) -> Result<()> {
            panic!("the receiver must use write_async");
        }

        unsafe fn write_async(
            &self,
            dst: u64,
            src: *const u8,
            len: usize,
        ) -> Result<crate::memory::Fence> {
            assert!(dst >= self.base && dst + len as u64 <= self.base + self.len);
            let mut g = lock(&self.st);
            let id = g.next;
            g.next += 1;
            g.started += 1;
            // SAFETY: the caller's contract: the source is valid host memory.
            let snapshot = unsafe { std::slice::from_raw_parts(src, len) }.to_vec();
            g.pending.push(PendingCopy {
                id,
                dst,
                src: src as usize,
                len,
                snapshot,
            });
            g.most_pending = g.most_pending.max(g.pending.len());
            let st = self.st.clone();
            Ok(crate::memory::Fence::new(move || {
                DeferredDevice::land(&st, id)
            }))
        }
    }

    /// A socket stand-in returning a few bytes per read, which counts reads
    /// into memory a pending copy of `st` still reads.
    struct WatchedSocket {
        data: Vec<u8>,
        pos: usize,
        st: Arc<Mutex<DeferredState>>,
    }

    impl Read for WatchedSocket {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min(7).min(self.data.len() - self.pos);
            let (lo, hi) = (buf.as_ptr() as usize, buf.as_ptr() as usize + n);
            let mut g = lock(&self.st);
            let clash = g.pending.iter().any(|c| lo < c.src + c.len && c.src < hi);
            if clash {
                g.reads_into_pending += 1;
            }
            drop(g);
            buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    #[test]
    fn tcp_receiver_double_buffers_device_copies_and_waits_for_each() {
        let mut mem = vec![0u8; 4096];
        let st = Arc::new(Mutex::new(DeferredState::default()));
        let w = Arc::new(DeferredDevice {
            base: mem.as_mut_ptr() as u64,
            len: mem.len() as u64,
            st: st.clone(),
        });
        let reg = Registry::new();
        // SAFETY: the writer accepts exactly the buffer's addresses.
        let d = unsafe { reg.register_device_unchecked_with(w.base, 4096, 0, Some(w.clone())) }
            .unwrap();
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 29 + 5) as u8).collect();
        let h = DataHeader {
            flags: wire::DATA_FLAG_CHECKSUM,
            batch: 1,
            region: d.id,
            offset: 300,
            len: 1000,
        };
        let mut scratch = vec![0u8; 100];
        let mut bounce = Some(crate::memory::BounceBuffer::heap(64));
        let mut s = WatchedSocket {
            data: payload.clone(),
            pos: 0,
            st: st.clone(),
        };
        let sum = receive_piece(&reg, &mut s, &h, &mut scratch, &mut bounce)
            .unwrap()
            .unwrap();
        assert_eq!(sum, checksum::piece(d.id, 300, &payload));
        assert_eq!(&mem[300..1300], &payload[..]);
        assert!(mem[..300].iter().chain(&mem[1300..]).all(|&b| b == 0));
        {
            let g = lock(&st);
            assert!(
                g.pending.is_empty(),
                "a copy was not waited before the piece counted"
            );
            assert_eq!(g.started, 1000u64.div_ceil(32));
            assert_eq!(g.landed, g.started);
            assert_eq!(g.most_pending, 2, "the copies did not overlap the reads");
            assert_eq!(g.overwritten, 0);
            assert_eq!(g.reads_into_pending, 0);
        }

        // A copy failing at its wait fails the piece with its reason, after
        // every other copy was waited, and the payload is drained.
        {
            let mut g = lock(&st);
            g.fail_wait_of = Some(g.next + 4);
        }
        mem[300..1300].fill(0);
        let mut s = WatchedSocket {
            data: [payload.clone(), vec![9u8; 5]].concat(),
            pos: 0,
            st: st.clone(),
        };
        let e = receive_piece(&reg, &mut s, &h, &mut scratch, &mut bounce)
            .unwrap()
            .unwrap_err();
        assert_eq!(e.status(), Status::Cuda, "{e}");
        assert!(e.detail().contains("at offset 428"), "{e}");
        assert_eq!(s.pos, 1000);
        let g = lock(&st);
        assert!(g.pending.is_empty());
        assert_eq!(g.overwritten, 0);
        assert_eq!(g.reads_into_pending, 0);
        // Slices 0-3 landed, 4 failed (waited before half 0 was reused for
        // slice 6, so 6 was never read), and 5, already started, was waited.
        assert_eq!(&mem[300..428], &payload[..128]);
        assert!(mem[428..460].iter().all(|&b| b == 0));
        assert_eq!(&mem[460..492], &payload[160..192]);
        assert!(mem[492..].iter().all(|&b| b == 0));
    }

    #[test]
    fn tcp_into_a_device_region_completes_after_the_copies_and_auto_skips_cma() {
        let rx = Agent::new(&AgentOptions {
            listen: Some("127.0.0.1:0".into()),
            ..Default::default()
        })
        .unwrap();
        let tx = Agent::new(&AgentOptions::default()).unwrap();
        let mut dev = vec![0u8; 6 << 20];
        let w = HostAsDevice::new(&mut dev, None);
        // SAFETY: the writer accepts exactly the buffer's addresses; dev outlives the agents' use.
        let d = unsafe {
            rx.registry()
                .register_device_unchecked_with(w.base, dev.len(), 0, Some(w.clone()))
        }
        .unwrap();
        let mut src: Vec<u8> = (0..(6u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
        // SAFETY: src outlives the agents' use.
        let s = unsafe { tx.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
        let addr = rx.local_addr().unwrap().to_string();
        // Same host, but the peer has device memory: auto picks tcp (or rdma), never cma.
        let t = tx
            .connect(
                &addr,
                &ConnectOptions {
                    transport: TransportKind::Auto,
                    streams: 2,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_ne!(t.kind(), TransportKind::Cma);
        if t.kind() == TransportKind::Tcp {
            let ops = [
                WriteOp {
                    local_region: s.id,
                    local_offset: 3,
                    remote_region: d.id,
                    remote_offset: 10,
                    len: 5 << 20,
                },
                WriteOp {
                    local_region: s.id,
                    local_offset: 0,
                    remote_region: d.id,
                    remote_offset: (6 << 20) - 1,
                    len: 1,
                },
            ];
            let opts = BatchOptions {
                checksum: true,
                room: 7,
                ..Default::default()
            };
            let id = t.submit(&ops, &opts).unwrap();
            let c = t.wait(id, Duration::from_secs(20)).unwrap();
            let inc = rx.next_completion(Duration::from_secs(5)).unwrap();
            assert_eq!(inc.completion, c);
            // delivered after every byte went through the writer
            assert_eq!(&dev[10..10 + (5 << 20)], &src[3..3 + (5 << 20)]);
            assert_eq!(dev[(6 << 20) - 1], src[0]);
            assert!(dev[..10].iter().all(|&b| b == 0));
            assert!(w.writes.load(Ordering::SeqCst) >= 2);
            assert!(w.largest.load(Ordering::SeqCst) <= DEVICE_BOUNCE_BYTES as u64);
        }
        t.close();
        // Explicit cma into device memory: refused, nothing written.
        let t = tx
            .connect(
                &addr,
                &ConnectOptions {
                    transport: TransportKind::Cma,
                    ..Default::default()
                },
            )
            .unwrap();
        let before = w.writes.load(Ordering::SeqCst);
        let op = [WriteOp {
            local_region: s.id,
            local_offset: 0,
            remote_region: d.id,
            remote_offset: 0,
            len: 8,
        }];
        let e = match t.submit(&op, &BatchOptions::default()) {
            Err(e) => e,
            Ok(id) => t.wait(id, Duration::from_secs(10)).unwrap_err(),
        };
        assert_eq!(e.status(), Status::Unsupported, "{e}");
        assert!(dev[..10].iter().all(|&b| b == 0));
        assert_eq!(w.writes.load(Ordering::SeqCst), before);
        t.close();
    }
}
