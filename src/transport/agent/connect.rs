//! The sender's handshake: dial the receiver, exchange Hello / HelloAck,
//! choose the transport (with [`TransportKind::Auto`]: cma on this host when
//! the peer proves it, else rdma when both sides have a usable NIC, else tcp),
//! then hand the control connection to that transport's own setup
//! (`cma::connect`, `tcp::connect`, `rdma::transport::connect`).

use super::{Agent, ConnectOptions};
use crate::auth::{Mode, PeerInstance, SessionKeys};
use crate::error::{Error, Result, Status};
use crate::memory::{RegionKind, Registry};
use crate::transport::conn::Conn;
use crate::transport::handshake::{Hello, HelloAck};
use crate::transport::identity::ProcIdentity;
use crate::transport::peer_auth::authenticate_client;
use crate::transport::wire::{self, FrameType};
use crate::transport::{cma, rdma, tcp, Transport, TransportKind};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;

/// A control connection whose Hello the receiver answered: what each
/// transport's sender-side setup starts from.
pub(crate) struct Dialed<'a> {
    /// The control connection (read and write timeouts: the connect deadline).
    pub(crate) stream: TcpStream,
    /// The receiver's answer.
    pub(crate) ack: HelloAck,
    /// The address as the caller gave it (for messages).
    pub(crate) addr: &'a str,
    /// The address it resolved to (data streams dial it too).
    pub(crate) sockaddr: SocketAddr,
    pub(crate) opts: &'a ConnectOptions,
    /// This process.
    pub(crate) identity: &'a ProcIdentity,
    registry: &'a Registry,
    /// How this side authenticates (data streams repeat the exchange).
    pub(crate) auth: &'a Mode,
    /// This agent's instance id.
    pub(crate) instance: [u8; 16],
    /// The instance the receiver authenticated as.
    pub(crate) peer: PeerInstance,
    /// The receiver process as the kernel names it (its cma binding
    /// socket), when `Auto` already connected to it.
    pub(crate) vouched: Option<cma::bind::Vouched>,
    /// The session MACs of the control connection (every frame is sealed).
    pub(crate) keys: SessionKeys,
    /// tcp: this agent encrypts its pieces ([`AgentOptions::tcp_encrypt`](super::AgentOptions::tcp_encrypt)).
    pub(crate) tcp_encrypt: bool,
}

impl Dialed<'_> {
    /// Sends a sealed JSON frame on the control connection.
    pub(crate) fn send_json<T: serde::Serialize>(&mut self, ty: FrameType, v: &T) -> Result<()> {
        wire::write_json_sealed(&mut self.stream, ty, v, &mut self.keys.send)
    }

    /// Reads a sealed JSON frame of type `want` from the control connection.
    pub(crate) fn recv_json<T: serde::de::DeserializeOwned>(
        &mut self,
        want: FrameType,
    ) -> Result<T> {
        wire::read_json_sealed(&mut self.stream, want, &mut self.keys.recv)
    }

    /// Hands the control connection to the session's [`Conn`] once the
    /// transport is agreed (no read timeout from here on).
    pub(crate) fn start(self) -> Result<Arc<Conn>> {
        self.stream.set_read_timeout(None)?;
        Conn::start(
            self.stream,
            self.ack.identity,
            self.ack.regions,
            self.registry.clone(),
            self.ack.session,
            self.addr.to_string(),
            self.opts.keepalive,
            self.instance,
            self.keys,
        )
    }
}

impl Agent {
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
        // Authentication first: the receiver says nothing about itself before it.
        let (peer, mut keys) = authenticate_client(
            &mut s,
            &self.inner.auth,
            self.inner.instance,
            opts.expect_instance,
            addr,
        )?;
        wire::write_json_sealed(
            &mut s,
            FrameType::Hello,
            &Hello {
                version: wire::VERSION,
                identity: self.inner.identity.clone(),
            },
            &mut keys.send,
        )?;
        let ack: HelloAck = wire::read_json_sealed(&mut s, FrameType::HelloAck, &mut keys.recv)
            .map_err(|e| {
                Error::new(e.status(), format!("handshake with {addr}: {}", e.detail()))
            })?;
        let me = &self.inner.identity;
        let mut vouched = None;
        let kind = match opts.transport {
            TransportKind::Auto => {
                // cma only into a live process of this host that the kernel
                // names as the listener of the receiver's binding socket, and
                // that runs as this uid (SO_PEERCRED, not the claimed process:
                // a claim names any pid)
                let same_host = !self.inner.deny_same_host()
                    && me.same_host(&ack.identity)
                    && me.verify_local_peer(&ack.identity).is_ok()
                    && ack.cma_socket.as_deref().is_some_and(|name| {
                        match cma::bind::Vouched::connect(name, addr, opts.timeout) {
                            Ok(v) if v.pid == ack.identity.pid && same_uid(v.uid) => {
                                vouched = Some(v);
                                true
                            }
                            Ok(v) => {
                                log::warn!(
                                    "the peer at {addr} names pid {} but its cma binding socket \
                                     is held by pid {} (uid {}): not using cma",
                                    ack.identity.pid,
                                    v.pid,
                                    v.uid
                                );
                                false
                            }
                            Err(e) => {
                                log::debug!("no cma to {addr}: {e}");
                                false
                            }
                        }
                    });
                // cma cannot write device memory: a peer with device regions never gets it,
                // and gets rdma only when its NICs can take GPU memory (GPUDirect).
                let peer_device = ack
                    .regions
                    .iter()
                    .any(|r| matches!(r.kind, RegionKind::Device { .. }));
                let peer_nic = ack.rdma.is_some() && (!peer_device || ack.rdma_gpu_direct);
                // Open the local NICs only when rdma could be chosen.
                let local_nic = (!same_host || peer_device) && peer_nic && self.inner.nic().is_ok();
                crate::transport::choose_auto_for(same_host, local_nic, peer_nic, peer_device)
            }
            k => k,
        };
        let d = Dialed {
            stream: s,
            ack,
            addr,
            sockaddr: sa,
            opts,
            identity: me,
            registry: &self.inner.registry,
            auth: &self.inner.auth,
            instance: self.inner.instance,
            peer,
            vouched,
            keys,
            tcp_encrypt: self.inner.tcp_encrypt,
        };
        match kind {
            TransportKind::Cma => cma::connect(d),
            TransportKind::Rdma => {
                if d.ack.rdma.is_none() {
                    return Err(Error::new(
                        Status::TransportUnavailable,
                        format!(
                            "peer pid {} on {} at {addr} offers no RDMA: {}; use cma or tcp",
                            d.ack.identity.pid,
                            d.ack.identity.hostname,
                            d.ack
                                .rdma_unavailable
                                .as_deref()
                                .unwrap_or("it predates RDMA support")
                        ),
                    ));
                }
                let nic = self.inner.nic()?;
                rdma::transport::connect(d, nic)
            }
            TransportKind::Tcp => tcp::connect(d),
            _ => Err(Error::new(
                Status::TransportUnavailable,
                format!("transport {} cannot be used here", kind.name()),
            )),
        }
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

/// Whether `uid` (the binding socket listener's, from `SO_PEERCRED`) is this
/// process's effective uid.
fn same_uid(uid: u32) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    uid == unsafe { libc::geteuid() }
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::invalid(format!("bad peer address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::invalid(format!("peer address {addr:?} resolves to nothing")))
}
