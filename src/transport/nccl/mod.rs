//! NCCL point-to-point between one prefill rank and one decode rank, with
//! libnccl loaded by path at run time (`sys`: `libnccl.so.2`, the pip wheel's
//! `nvidia/nccl/lib`, or `$PDXFER_NCCL`).
//!
//! This is **not** a [`Transport`](crate::transport::Transport): it moves no
//! [`WriteOp`](crate::transport::WriteOp)s between registered regions, has no
//! registry checks, grants or completion records, and the agent never
//! selects it. The engine uses it for transport nccl (`engine::nccl_link`:
//! the communicator of a link is made over the engine's control channel,
//! and both sides plan each chunk from the room's metadata); `pdxfer info`,
//! `examples/nccl_check.rs` and tests use it directly.
//!
//! One communicator per (prefill rank, decode rank) pair: world size 2, the
//! prefill (sender) is NCCL rank 0, the decode (receiver) rank 1. The prefill
//! side creates the [`NcclId`] and sends it to the decode side in the
//! handshake (hex in JSON).
//!
//! - this file: [`probe`], [`NcclId`], [`NcclRole`] and [`NcclPair`] (the
//!   communicator and its lifecycle; feature `nccl`);
//! - `plan`: the mirrored send/recv plan both sides compute ([`NcclPlan`]);
//! - `sys`: the NCCL entry points, resolved with dlopen/dlsym.
//!
//! Both sides compute the same [`NcclPlan`] from the same pair request, KV
//! geometry and [`NcclPlanOptions`], so the receiver posts exactly the recvs
//! that match the sender's sends, in the same order and the same groups.
//! [`NcclPlan::digest`] summarises a plan; the two sides exchange digests and
//! [`check_mirror`] refuses to post anything when they differ, so a mismatched
//! pair fails with a typed error instead of hanging inside NCCL.
//!
//! Modes: **Direct** moves each (entry, run) of the packed plan straight from
//! the sender's staging buffer into the receiver's pool rows (one send/recv
//! per run and entry); **Staged** moves the whole pack in large chunks into a
//! receiver staging buffer, which the receiver then scatters
//! (`relayout::scatter_spans`). Direct is chosen while the op count is small.
//!
//! Never a hang (NCCL's own calls only enqueue, and a peer that never posts
//! its half leaves the kernels spinning): the communicator is created
//! non-blocking (`ncclCommInitRankConfig` with `blocking = 0`) and
//! `ncclCommGetAsyncError` is polled until it leaves `ncclInProgress`; every
//! posted plan ends with a CUDA event recorded on the stream, and
//! [`NcclPair::wait`] polls that event together with `ncclCommGetAsyncError`,
//! the caller's peer-liveness check, an abort flag and a deadline. Any of
//! those failing calls `ncclCommAbort` (which makes the enqueued kernels
//! return) and yields a typed error naming the peer: [`Status::Timeout`],
//! [`Status::PeerUnreachable`], [`Status::Aborted`] or [`Status::Nccl`].
//! The clean end is `ncclCommFinalize` (polled) and `ncclCommDestroy`; `Drop`
//! of a pair with work in flight aborts and then waits for the stream, so
//! the caller may free its buffers right after.

mod plan;
#[cfg(feature = "nccl")]
mod sys;

pub use plan::{check_mirror, group_ops, NcclBuffer, NcclMode, NcclOp, NcclPlan, NcclPlanOptions};

#[allow(unused_imports)] // Status is used only without the `nccl` feature (and in the docs).
use crate::error::{Error, Result, Status};

/// NCCL's version code (e.g. 23203 for 2.32.3) and the library it loaded
/// from (a soname or a full path), or a typed error ([`Status::NoNccl`]
/// listing every path tried).
pub fn probe() -> Result<(i32, String)> {
    #[cfg(feature = "nccl")]
    {
        let n = sys::nccl()?;
        Ok((n.version, n.path.clone()))
    }
    #[cfg(not(feature = "nccl"))]
    {
        Err(not_built())
    }
}

#[cfg(not(feature = "nccl"))]
fn not_built() -> Error {
    Error::new(Status::Unsupported, "built without the `nccl` feature")
}

/// An NCCL unique id: 128 opaque bytes, created by the prefill side and sent
/// to the decode side through the handshake.
#[derive(Clone, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl NcclId {
    /// A fresh id from `ncclGetUniqueId` (needs libnccl, not a GPU).
    pub fn new() -> Result<NcclId> {
        #[cfg(feature = "nccl")]
        {
            let n = sys::nccl()?;
            let mut id = sys::UniqueId { internal: [0; 128] };
            // SAFETY: an out-pointer to a local ncclUniqueId.
            n.check("ncclGetUniqueId", unsafe { (n.get_unique_id)(&mut id) })?;
            Ok(NcclId(id.internal.map(|c| c as u8)))
        }
        #[cfg(not(feature = "nccl"))]
        {
            Err(not_built())
        }
    }

    /// Lower-case hex, 256 characters (for the handshake's JSON).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`to_hex`](Self::to_hex) output.
    pub fn from_hex(s: &str) -> Result<NcclId> {
        let b = s.as_bytes();
        if b.len() != 256 {
            return Err(Error::invalid(format!(
                "NCCL unique id must be 256 hex characters, got {}",
                b.len()
            )));
        }
        let mut id = [0u8; 128];
        for (i, pair) in b.chunks(2).enumerate() {
            let hex = std::str::from_utf8(pair).ok();
            id[i] = hex
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    Error::invalid(format!("NCCL unique id has a non-hex byte at {}", 2 * i))
                })?;
        }
        Ok(NcclId(id))
    }
}

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({}..)", &self.to_hex()[..16])
    }
}

/// Which end of the pair this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclRole {
    /// The prefill rank: NCCL rank 0, sends from its staging buffer.
    Sender,
    /// The decode rank: NCCL rank 1, receives.
    Receiver,
}

impl NcclRole {
    /// NCCL rank in the pair communicator.
    pub fn rank(self) -> i32 {
        match self {
            NcclRole::Sender => 0,
            NcclRole::Receiver => 1,
        }
    }
}

#[cfg(feature = "nccl")]
mod pair;
#[cfg(feature = "nccl")]
pub use pair::{NcclAbort, NcclPair};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_hex_roundtrip() {
        let mut raw = [0u8; 128];
        for (i, b) in raw.iter_mut().enumerate() {
            *b = (i * 37) as u8;
        }
        let id = NcclId(raw);
        let h = id.to_hex();
        assert_eq!(h.len(), 256);
        assert_eq!(NcclId::from_hex(&h).unwrap(), id);
        assert!(NcclId::from_hex(&h[..10]).is_err());
        let mut bad = h.clone();
        bad.replace_range(4..6, "zz");
        assert!(NcclId::from_hex(&bad)
            .unwrap_err()
            .detail()
            .contains("at 4"));
    }

    /// With the PyPI NCCL (scripts/cuda-deps.sh puts its wheel tree on
    /// PYTHONPATH, found there as site-packages) the version and a unique id
    /// come back without a GPU.
    /// `PDXFER_REQUIRE_CUDA_TOOLS=1` turns a missing library into a failure.
    #[test]
    fn library_version_and_unique_id() {
        match probe() {
            Ok((v, _)) => {
                assert!(v >= 21800, "NCCL {v} is too old for point-to-point groups");
                let a = NcclId::new().unwrap();
                let b = NcclId::new().unwrap();
                assert_ne!(a, b, "two unique ids must differ");
            }
            Err(e) => {
                assert!(
                    matches!(e.status(), Status::NoNccl | Status::Unsupported),
                    "{e}"
                );
                assert_eq!(NcclId::new().unwrap_err().status(), e.status());
                assert!(
                    std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
                    "PDXFER_REQUIRE_CUDA_TOOLS is set but libnccl is unusable: {e}"
                );
                crate::test_skip::skip("cuda-tools", &e.to_string());
            }
        }
    }

    #[cfg(feature = "nccl")]
    #[test]
    fn connect_without_gpu_is_typed() {
        // SAFETY: only tries to dlopen the library.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            crate::test_skip::skip("gpu-present", "a CUDA driver is present");
            return;
        }
        let id = NcclId([1; 128]);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let e = NcclPair::connect(
            &id,
            NcclRole::Receiver,
            0,
            0,
            "decode 0",
            deadline,
            &mut || true,
            NcclAbort::new(),
        )
        .unwrap_err();
        assert_eq!(e.status(), Status::NoCudaDriver, "{e}");
    }
}
