//! The receiver's listener and handshake: the accept loop, the first frame of
//! each connection (a Hello opens a session's control connection, an Attach
//! adds a tcp data stream to one), the answer to the sender's transport
//! choice (the cma binding socket, the RDMA handshake), and registering the registry's
//! regions with the RDMA NICs.

use super::grant::control_loop;
use super::{lock, AgentInner, ReceiverSession};
use crate::auth::{Channel, PeerInstance, SessionKeys, SessionMac};
use crate::error::{Error, Result, Status};
use crate::memory::RegionKind;
use crate::transport::auth_exchange::{AuthExchange, WireAuth};
use crate::transport::cma::bind::BindListener;
use crate::transport::handshake::{random_token, Hello, HelloAck, Select, SelectOk};
use crate::transport::listen::{self, Framing, ListenLimits, Slot};
use crate::transport::peer_auth::Prefixed;
use crate::transport::rdma::nic::{DataPath, NicProvider};
use crate::transport::rdma::Handshake;
use crate::transport::tcp::{serve_stream, TcpRecv};
use crate::transport::wire::{self, FrameType};
use crate::transport::TransportKind;
use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub(super) fn accept_loop(
    l: TcpListener,
    limits: ListenLimits,
    agent: std::sync::Weak<AgentInner>,
) {
    let Some((stats, mode, instance)) = agent
        .upgrade()
        .map(|a| (a.listen_stats.clone(), a.auth.clone(), a.instance))
    else {
        return;
    };
    let stop = {
        let agent = agent.clone();
        move || {
            agent
                .upgrade()
                .is_none_or(|a| a.shutdown.load(Ordering::SeqCst))
        }
    };
    let refuse = |why: &str| {
        let mut b = Vec::new();
        let e = Error::new(Status::Protocol, why);
        let _ = wire::write_frame(&mut b, FrameType::Error, &wire::encode_error(&e));
        b
    };
    // Authentication first, in the listener's poll loop (no thread): nothing
    // else is read, allocated or said before the exchange succeeds.
    listen::serve_exchange(
        l,
        limits,
        Framing::Wire,
        stats,
        stop,
        refuse,
        || AuthExchange::new(mode.clone(), Channel::Data, instance, WireAuth),
        |s, rest, peer, slot| {
            let Some(a) = agent.upgrade() else { return };
            let _ = crate::threads::spawn("pdxfer-rx".into(), move || {
                serve_connection(a, s, &rest, peer, slot)
            });
        },
    );
}

/// Serves one authenticated connection (`rest`: what the listener read after
/// the AuthProof): a Hello opens a session and an Attach adds a data stream.
fn serve_connection(
    a: Arc<AgentInner>,
    mut s: TcpStream,
    rest: &[u8],
    peer: (PeerInstance, SessionKeys),
    slot: Slot,
) {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(a.handshake_timeout));
    let _ = s.set_write_timeout(Some(a.handshake_timeout));
    let (peer, mut keys) = peer;
    // The listener ran the authentication exchange; from here every frame is
    // sealed: a bad or missing MAC ends the connection.
    let mut pre = Prefixed::new(rest, &mut s);
    let read = wire::read_frame_sealed(&mut pre, wire::MAX_CONTROL_PAYLOAD, &mut keys.recv);
    let drained = pre.drained();
    let (ty, p) = match read {
        Ok(f) => f,
        Err(e) => return refuse(&mut s, &mut keys.send, e),
    };
    if !drained {
        let e = Error::new(
            Status::Protocol,
            format!("data after the {ty:?} frame before it was answered"),
        );
        return refuse(&mut s, &mut keys.send, e);
    }
    match ty {
        FrameType::Hello => serve_control(a, s, &p, slot, peer, keys),
        FrameType::Attach => serve_stream(a, s, &p, slot, peer, keys),
        _ => {
            let e = Error::new(
                Status::Protocol,
                format!("first frame must be Hello or Attach, got {ty:?}"),
            );
            refuse(&mut s, &mut keys.send, e);
        }
    }
}

/// Sends `e` as a sealed Error frame (the peer authenticated: it checks the MAC).
pub(crate) fn refuse(s: &mut TcpStream, mac: &mut SessionMac, e: Error) {
    let _ = wire::write_frame_sealed(s, FrameType::Error, &wire::encode_error(&e), mac);
}

fn serve_control(
    a: Arc<AgentInner>,
    mut s: TcpStream,
    hello: &[u8],
    mut slot: Slot,
    peer: PeerInstance,
    keys: SessionKeys,
) {
    let SessionKeys {
        send: mut send_mac,
        recv: mut recv_mac,
        ..
    } = keys;
    let hello: Hello = match serde_json::from_slice(hello) {
        Ok(h) => h,
        Err(e) => {
            return refuse(
                &mut s,
                &mut send_mac,
                Error::new(Status::Protocol, format!("malformed Hello: {e}")),
            );
        }
    };
    if hello.version != wire::VERSION {
        return refuse(
            &mut s,
            &mut send_mac,
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
    let token = match random_token() {
        Ok(t) => t,
        Err(e) => return refuse(&mut s, &mut send_mac, e),
    };
    let session = Arc::new(ReceiverSession {
        id,
        token,
        instance: peer,
        peer: Mutex::new(Some(hello.identity.clone())),
        writer: Mutex::new(s.try_clone().ok().map(|w| (w, send_mac))),
        granted: Mutex::new(HashMap::new()),
        expired: Mutex::new(Default::default()),
        tcp: Mutex::new(TcpRecv::default()),
        sockets: Mutex::new(s.try_clone().into_iter().collect()),
        rdma: Mutex::new(None),
        lands_tcp: AtomicBool::new(false),
        closed: AtomicBool::new(false),
    });
    let nic = a.nic();
    // A same-host sender may choose cma: it binds its writes to the process
    // listening here (the kernel names it), not to anything claimed.
    let binding = if a.identity.same_host(&hello.identity) {
        BindListener::new()
            .map_err(|e| log::debug!("no cma binding socket for session {id}: {e}"))
            .ok()
    } else {
        None
    };
    let ack = HelloAck {
        version: wire::VERSION,
        identity: a.identity.clone(),
        regions: a.registry.descriptors(),
        session: id,
        token: session.token.clone(),
        cma_socket: binding.as_ref().map(|b| b.name().to_string()),
        rdma: nic.as_ref().ok().map(|n| n.describe()),
        rdma_unavailable: nic.as_ref().err().map(|e| e.detail().to_string()),
        rdma_gpu_direct: nic.as_ref().is_ok_and(|n| a.gpu_direct(&**n).is_ok()),
    };
    lock(&a.sessions).insert(id, session.clone());
    let mut run = || -> Result<()> {
        session.write(FrameType::HelloAck, &json(&ack)?)?;
        let sel: Select = wire::read_json_sealed(&mut s, FrameType::Select, &mut recv_mac)?;
        let mut ok = SelectOk::default();
        match sel.transport {
            TransportKind::Cma => {
                let b = binding.as_ref().ok_or_else(|| {
                    Error::new(
                        Status::PeerIdentity,
                        "cma selected, but this receiver offered no binding socket (the sender \
                         is not on this host); use tcp",
                    )
                })?;
                b.accept(a.handshake_timeout)?;
            }
            TransportKind::Tcp => {
                if sel.tcp_encrypt != a.tcp_encrypt {
                    let on = |x: bool| if x { "on" } else { "off" };
                    return Err(Error::new(
                        Status::TransportUnavailable,
                        format!(
                            "tcp payload encryption differs: the sender has it {}, this receiver \
                             {}; both ends must agree (AgentOptions::tcp_encrypt or \
                             {}=1 on both, or on neither)",
                            on(sel.tcp_encrypt),
                            on(a.tcp_encrypt),
                            super::TCP_ENCRYPT_ENV
                        ),
                    ));
                }
                session.lands_tcp.store(true, Ordering::SeqCst)
            }
            TransportKind::Rdma => {
                let nic = nic.clone()?;
                let remote = sel.rdma.as_deref().ok_or_else(|| {
                    Error::new(
                        Status::Protocol,
                        "rdma selected without the client's RDMA handshake",
                    )
                })?;
                let remote = Handshake::decode(remote).map_err(Error::from)?;
                let (local, path) = accept_rdma(&a, &*nic, &remote)?;
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
        session.write(FrameType::SelectOk, &json(&ok)?)?;
        if sel.transport == TransportKind::Cma {
            super::standing_grant::grant_session(&a, &session, &ack.regions);
        }
        slot.established();
        // a sender that stops reading cannot pin this thread in a write
        s.set_write_timeout(Some(a.idle_timeout))?;
        control_loop(&a, &session, &mut s, &mut recv_mac, hello.identity.clone())
    };
    if let Err(e) = run() {
        if e.status() != Status::PeerUnreachable {
            let _ = session.write(FrameType::Error, &wire::encode_error(&e));
        }
    }
    session.close();
    lock(&a.sessions).remove(&id);
    super::standing_grant::session_ended(&a, id);
}

fn json<T: serde::Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| Error::invalid(format!("encode a handshake answer: {e}")))
}

/// The receiver's half of the RDMA handshake: registers every region with
/// the NIC (so rkeys exist; device regions where it has GPUDirect RDMA), creates the endpoint, negotiates with the
/// client's handshake and brings the QPs up. Returns the encoded local
/// handshake and the connected data path.
fn accept_rdma(
    a: &AgentInner,
    nic: &dyn NicProvider,
    remote: &Handshake,
) -> Result<(Vec<u8>, Box<dyn DataPath>)> {
    register_all(a, nic)?;
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

/// Registers every region of the agent's registry with the NIC (already
/// registered ranges are skipped by the provider). Device regions go through
/// the NIC's GPU path; where that fails (no GPUDirect RDMA, or the device
/// cannot make its writes consistent) they are skipped with a warning, since
/// the host regions still work: batches into them are refused at grant, and
/// from them at submit, with the reason.
pub(super) fn register_all(a: &AgentInner, nic: &dyn NicProvider) -> Result<()> {
    register_matching(a, nic, &|_| true, false)
}

/// [`register_all`] for the regions `keep` accepts; with `devices_required`
/// a device region that cannot be registered is the error (`NoGpuDirect`
/// naming it) instead of a warning.
pub(super) fn register_matching(
    a: &AgentInner,
    nic: &dyn NicProvider,
    keep: &dyn Fn(&crate::memory::RegionDesc) -> bool,
    devices_required: bool,
) -> Result<()> {
    let gpu = a.gpu_direct(nic);
    for d in a.registry.descriptors().into_iter().filter(|d| keep(d)) {
        if d.kind != RegionKind::Host {
            let r = gpu.clone().and_then(|()| {
                // SAFETY: as for host regions below.
                unsafe { nic.register(d.addr, d.len, d.kind) }
            });
            if let Err(e) = r {
                if devices_required {
                    return Err(Error::new(
                        Status::NoGpuDirect,
                        format!(
                            "device region {} (0x{:x}+{}) cannot be registered with the RDMA NIC for GPUDirect RDMA: {}",
                            d.id,
                            d.addr,
                            d.len,
                            e.detail()
                        ),
                    ));
                }
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
pub(super) fn open_default_nic(
    gpu: Option<u32>,
    traffic_class: Option<u8>,
) -> Result<Arc<dyn NicProvider>> {
    let mut cfg = crate::transport::rdma::RdmaConfig::from_env()?.with_traffic_class(traffic_class);
    if let Some(ordinal) = gpu {
        cfg = cfg.for_gpu(ordinal);
    }
    Ok(Arc::new(crate::transport::rdma::nic::VerbsProvider::open(
        cfg,
    )?))
}

#[cfg(not(feature = "rdma"))]
pub(super) fn open_default_nic(
    _gpu: Option<u32>,
    _traffic_class: Option<u8>,
) -> Result<Arc<dyn NicProvider>> {
    Err(Error::new(
        Status::NoRdmaDevice,
        "this build of pdxfer has no `rdma` feature (no verbs support)",
    ))
}
