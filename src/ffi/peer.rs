//! `PdxPeer`: a connection to one peer over one transport, over the C ABI.

use super::agent::PdxAgent;
use super::memory::PdxRegion;
use super::ptr::{self, Versioned};
use super::{boundary, PdxStatus};
use crate::error::Error;
use crate::transport::{ConnectOptions, Transport, TransportKind};
use std::ffi::c_char;
use std::time::Duration;

/// Choose automatically: cma on this host, else rdma when both sides have a NIC, else tcp.
pub const PDXFER_TRANSPORT_AUTO: u32 = 0;
/// Same process (`pdxfer_peer_open_local`).
pub const PDXFER_TRANSPORT_LOCAL: u32 = 1;
/// Same host, `process_vm_writev`.
pub const PDXFER_TRANSPORT_CMA: u32 = 2;
/// TCP streams.
pub const PDXFER_TRANSPORT_TCP: u32 = 3;
/// RDMA: one-sided RDMA WRITE/READ (`PDX_STATUS_NO_RDMA_DEVICE` without a usable NIC).
pub const PDXFER_TRANSPORT_RDMA: u32 = 4;
/// NCCL point-to-point between engines with device pools on both sides
/// (`PdxEngineConfig.transport = "nccl"`; a peer cannot be opened with it).
pub const PDXFER_TRANSPORT_NCCL: u32 = 5;

/// Opaque peer handle (`pdxfer_peer_open` / `pdxfer_peer_close`).
pub struct PdxPeer {
    pub(crate) t: Box<dyn Transport>,
}

/// Options of `pdxfer_peer_open`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxPeerOptions {
    /// `sizeof(PdxPeerOptions)`, set by the caller.
    pub struct_size: u64,
    /// `PDXFER_TRANSPORT_*`.
    pub transport: u32,
    /// tcp data streams (0 means 1).
    pub streams: u32,
    /// cma writer threads (0 means 1).
    pub threads: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Connect and handshake deadline in ms (0 means 10 s).
    pub timeout_ms: u64,
}

// SAFETY: repr(C), starts with u64 struct_size, integers only.
unsafe impl Versioned for PdxPeerOptions {
    const MIN_SIZE: usize = std::mem::size_of::<PdxPeerOptions>();
    const NAME: &'static str = "PdxPeerOptions";
}

pub(crate) fn kind_from_u32(v: u32) -> crate::Result<TransportKind> {
    Ok(match v {
        PDXFER_TRANSPORT_AUTO => TransportKind::Auto,
        PDXFER_TRANSPORT_LOCAL => TransportKind::Local,
        PDXFER_TRANSPORT_CMA => TransportKind::Cma,
        PDXFER_TRANSPORT_TCP => TransportKind::Tcp,
        PDXFER_TRANSPORT_RDMA => TransportKind::Rdma,
        PDXFER_TRANSPORT_NCCL => TransportKind::Nccl,
        _ => {
            return Err(Error::invalid(format!(
                "unknown transport {v} (PDXFER_TRANSPORT_*)"
            )))
        }
    })
}

fn kind_to_u32(k: TransportKind) -> u32 {
    match k {
        TransportKind::Auto => PDXFER_TRANSPORT_AUTO,
        TransportKind::Local => PDXFER_TRANSPORT_LOCAL,
        TransportKind::Cma => PDXFER_TRANSPORT_CMA,
        TransportKind::Tcp => PDXFER_TRANSPORT_TCP,
        TransportKind::Rdma => PDXFER_TRANSPORT_RDMA,
        TransportKind::Nccl => PDXFER_TRANSPORT_NCCL,
    }
}

/// Connects `agent` to the agent listening at `addr` (`host:port`) and
/// performs the handshake. `options` may be NULL (auto, 1 stream, 10 s).
/// Close the peer with `pdxfer_peer_close` before destroying the agent.
#[no_mangle]
pub extern "C" fn pdxfer_peer_open(
    agent: *const PdxAgent,
    addr: *const c_char,
    options: *const PdxPeerOptions,
    out: *mut *mut PdxPeer,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::handle(agent, "agent")?;
        let addr = ptr::c_str(addr, "addr")?;
        ptr::check_out(out, "peer output pointer")?;
        let mut o = ConnectOptions::default();
        if !options.is_null() {
            let p = ptr::read_versioned(options)?;
            o.transport = kind_from_u32(p.transport)?;
            if o.transport == TransportKind::Nccl {
                return Err(Error::new(
                    crate::Status::Unsupported,
                    "nccl is an engine transport (PdxEngineConfig.transport = \"nccl\", device pools on both sides): a peer cannot be opened with it; use auto, cma, tcp or rdma",
                ));
            }
            o.streams = p.streams.max(1);
            o.threads = p.threads.max(1);
            if p.timeout_ms > 0 {
                o.timeout = Duration::from_millis(p.timeout_ms);
            }
        }
        let t = a.agent.connect(addr, &o)?;
        ptr::new_handle(PdxPeer { t }, out, "peer")?;
        super::ok()
    })
}

/// Opens a same-process (`local`) peer from `agent` into `target`.
#[no_mangle]
pub extern "C" fn pdxfer_peer_open_local(
    agent: *const PdxAgent,
    target: *const PdxAgent,
    out: *mut *mut PdxPeer,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::handle(agent, "agent")?;
        let b = ptr::handle(target, "target agent")?;
        ptr::new_handle(
            PdxPeer {
                t: a.agent.connect_local(&b.agent),
            },
            out,
            "peer",
        )?;
        super::ok()
    })
}

/// Closes and frees a peer; its pending batches fail. NULL is a no-op.
///
/// Threads: every other call on the same `PdxPeer` may run concurrently with the others,
/// from any thread. This one may not race any of them: it frees the handle,
/// so no call on the same `PdxPeer` may be in flight when it starts, and none may start
/// after it. (The Python package enforces this: its `Peer.close()` waits for the
/// calls in flight and refuses later ones with a typed error.)
#[no_mangle]
pub extern "C" fn pdxfer_peer_close(peer: *mut PdxPeer) {
    let _ = boundary(|| {
        if !peer.is_null() {
            ptr::handle(peer as *const PdxPeer, "peer")?.t.close();
        }
        ptr::drop_handle(peer);
        super::ok()
    });
}

/// The transport the peer uses (`PDXFER_TRANSPORT_*`), written to `out`.
#[no_mangle]
pub extern "C" fn pdxfer_peer_transport(peer: *const PdxPeer, out: *mut u32) -> PdxStatus {
    boundary(|| {
        let p = ptr::handle(peer, "peer")?;
        ptr::write_out(out, kind_to_u32(p.t.kind()), "out")?;
        super::ok()
    })
}

/// The peer's region descriptors (as of the handshake) into `out`.
#[no_mangle]
pub extern "C" fn pdxfer_peer_regions(
    peer: *const PdxPeer,
    out: *mut PdxRegion,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let p = ptr::handle(peer, "peer")?;
        let v: Vec<PdxRegion> =
            p.t.remote_regions()
                .iter()
                .map(PdxRegion::from_desc)
                .collect();
        ptr::fill(&v, out, capacity, out_len, "regions")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The constants are the ABI: every kind maps to its number and back,
    /// and the numbers are the ones `include/pdxfer.h` and
    /// `python/pdxfer/transfer.py` carry (pinned there by their own tests).
    #[test]
    fn transport_constants_round_trip() {
        let pinned = [
            (TransportKind::Auto, 0),
            (TransportKind::Local, 1),
            (TransportKind::Cma, 2),
            (TransportKind::Tcp, 3),
            (TransportKind::Rdma, 4),
            (TransportKind::Nccl, 5),
        ];
        for (k, v) in pinned {
            assert_eq!(kind_to_u32(k), v, "{k:?}");
            assert_eq!(kind_from_u32(v).unwrap(), k);
        }
        assert!(kind_from_u32(6).is_err());
    }
}
