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
    /// Secret (128 random bits, hex) that data streams present to attach to
    /// this session; a stream must also authenticate as the same instance.
    pub token: String,
    /// Abstract Unix-socket name this session's receiver listens on (same
    /// host only): a cma sender connects to it and writes only into the
    /// process the kernel names as its listener (`SO_PEERCRED`).
    #[serde(default)]
    pub cma_socket: Option<String>,
    /// The server's usable RDMA NICs, in words; `None` when it has none (or
    /// predates RDMA support).
    #[serde(default)]
    pub rdma: Option<String>,
    /// Why the server has no usable RDMA NIC.
    #[serde(default)]
    pub rdma_unavailable: Option<String>,
    /// Whether the server's NICs can register its GPU memory (GPUDirect RDMA);
    /// `false` from servers that predate it.
    #[serde(default)]
    pub rdma_gpu_direct: bool,
}

/// Client -> server: the transport chosen for this session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Select {
    /// `cma`, `tcp` or `rdma`.
    pub transport: TransportKind,
    /// tcp: data streams that will attach.
    pub streams: u32,
    /// rdma: the client's encoded [`rdma::Handshake`](super::rdma::Handshake).
    #[serde(default)]
    pub rdma: Option<Vec<u8>>,
    /// tcp: the pieces are encrypted (the sender's
    /// [`AgentOptions::tcp_encrypt`](super::agent::AgentOptions::tcp_encrypt));
    /// the receiver refuses a setting other than its own.
    #[serde(default)]
    pub tcp_encrypt: bool,
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
    pub token: String,
    /// Stream index.
    pub index: u32,
}

/// A fresh session token: 128 bits from the kernel's random source, in hex.
pub fn random_token() -> crate::error::Result<String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|e| {
        crate::error::Error::new(
            crate::error::Status::Io,
            format!("getrandom failed for a session token: {e}"),
        )
    })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_of_peers_without_rdma_still_parse() {
        let me = ProcIdentity::current().unwrap();
        // What a server from before RDMA support sends: no rdma fields.
        let old = serde_json::json!({
            "version": 1,
            "identity": me,
            "regions": [],
            "session": 3,
            "token": "04",
        });
        let ack: HelloAck = serde_json::from_value(old).unwrap();
        assert_eq!((ack.rdma, ack.rdma_unavailable), (None, None));
        assert_eq!(ack.cma_socket, None);
        let sel: Select = serde_json::from_value(
            serde_json::json!({"transport": "tcp", "streams": 2, "proof": 0}),
        )
        .unwrap();
        assert_eq!(sel.rdma, None);
        assert!(
            !sel.tcp_encrypt,
            "an older sender's Select encrypts nothing"
        );
        let ok: SelectOk = serde_json::from_value(serde_json::json!({})).unwrap();
        assert_eq!(ok.rdma, None);
        // And the new fields round-trip.
        let sel = Select {
            transport: TransportKind::Rdma,
            streams: 0,
            rdma: Some(vec![1, 2, 3]),
            tcp_encrypt: true,
        };
        let back: Select = serde_json::from_str(&serde_json::to_string(&sel).unwrap()).unwrap();
        assert_eq!(back.rdma, Some(vec![1, 2, 3]));
        assert!(back.tcp_encrypt);
        assert_eq!(back.transport, TransportKind::Rdma);
    }
}
