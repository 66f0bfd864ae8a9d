//! Handshake messages (JSON inside versioned control frames).

use super::identity::ProcIdentity;
use super::TransportKind;
use crate::memory::RegionDesc;
use serde::{Deserialize, Serialize};

/// Client -> server: who is connecting.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// The client's wire version (also in every frame header).
    pub version: u16,
    /// The client process.
    pub identity: ProcIdentity,
}

/// Server -> client: who answered, and what it exports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HelloAck {
    /// The server's wire version.
    pub version: u16,
    /// The server process.
    pub identity: ProcIdentity,
    /// The server's registered regions.
    pub regions: Vec<RegionDesc>,
    /// Session id (names this connection in completions and stream attaches).
    pub session: u64,
    /// Secret that data streams present to attach to this session.
    pub token: u64,
    /// Address (in the server) of an 8-byte nonce; a cma client reads it
    /// with `process_vm_readv` and sends it back, proving the pid it will
    /// write to is the process at the other end of this connection.
    pub nonce_addr: u64,
    /// The server's usable RDMA NICs, in words; `None` when it has none (or
    /// predates RDMA support).
    #[serde(default)]
    pub rdma: Option<String>,
    /// Why the server has no usable RDMA NIC.
    #[serde(default)]
    pub rdma_unavailable: Option<String>,
}

/// Client -> server: the transport chosen for this session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Select {
    /// `cma`, `tcp` or `rdma`.
    pub transport: TransportKind,
    /// tcp: data streams that will attach.
    pub streams: u32,
    /// cma: the nonce read from `nonce_addr`.
    pub proof: u64,
    /// rdma: the client's encoded [`rdma::Handshake`](super::rdma::Handshake).
    #[serde(default)]
    pub rdma: Option<Vec<u8>>,
}

/// Server -> client: the transport is accepted.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SelectOk {
    /// rdma: the server's encoded [`rdma::Handshake`](super::rdma::Handshake).
    #[serde(default)]
    pub rdma: Option<Vec<u8>>,
}

/// Data stream -> server: attach to a session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Attach {
    /// Session id from [`HelloAck`].
    pub session: u64,
    /// Token from [`HelloAck`].
    pub token: u64,
    /// Stream index.
    pub index: u32,
}

/// A random u64 from the kernel.
pub fn random_u64() -> u64 {
    let mut v = [0u8; 8];
    // SAFETY: v is a valid 8-byte buffer for getrandom to fill.
    let n = unsafe { libc::getrandom(v.as_mut_ptr() as *mut libc::c_void, 8, 0) };
    if n != 8 {
        // Fall back to time and address entropy; only uniqueness matters then.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        return t ^ ((&v as *const _ as u64).rotate_left(32)) ^ u64::from(std::process::id());
    }
    u64::from_le_bytes(v)
}
