//! NCCL point-to-point between one prefill rank and one decode rank, through
//! cudarc (libnccl loaded at run time).
//!
//! This is **not** a [`Transport`](crate::transport::Transport): it moves no
//! [`WriteOp`](crate::transport::WriteOp)s between registered regions, has no
//! registry checks, grants or completion records, and no engine or agent
//! selects it. It is the building block of an NCCL path: the `probe` CLI
//! and tests use it today.
//!
//! One communicator per (prefill rank, decode rank) pair: world size 2, the
//! prefill (sender) is NCCL rank 0, the decode (receiver) rank 1. The prefill
//! side creates the [`NcclId`] and sends it to the decode side in the
//! bootstrap handshake (hex in JSON).
//!
//! - this file: [`probe`], [`NcclId`], [`NcclRole`] and [`NcclPair`] (the
//!   communicator; feature `nccl`);
//! - `plan`: the mirrored send/recv plan both sides compute ([`NcclPlan`]).
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
//! cudarc's safe NCCL types panic in `Drop` (group end, comm abort), so this
//! module calls the `nccl::result` functions itself, each behind
//! `catch_unwind`; a missing library is [`Status::NoNccl`], a failing call
//! [`Status::Nccl`] with NCCL's result code.

mod plan;

pub use plan::{check_mirror, group_ops, NcclBuffer, NcclMode, NcclOp, NcclPlan, NcclPlanOptions};

#[allow(unused_imports)] // Status is used only without the `nccl` feature (and in the docs).
use crate::error::{Error, Result, Status};

/// NCCL version code (e.g. 23203 for 2.32.3), or a typed error.
pub fn probe() -> Result<i32> {
    #[cfg(feature = "nccl")]
    {
        imp::library_present()?;
        imp::guard("ncclGetVersion", cudarc::nccl::result::get_nccl_version)
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
/// to the decode side through the bootstrap handshake.
#[derive(Clone, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl NcclId {
    /// A fresh id from `ncclGetUniqueId` (needs libnccl, not a GPU).
    pub fn new() -> Result<NcclId> {
        #[cfg(feature = "nccl")]
        {
            imp::library_present()?;
            let id = imp::guard("ncclGetUniqueId", cudarc::nccl::result::get_uniqueid)?;
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
pub use imp::NcclPair;

#[cfg(feature = "nccl")]
mod imp {
    use super::{NcclBuffer, NcclId, NcclPlan, NcclRole};
    use crate::error::{Error, Result, Status};
    use cudarc::nccl::{result, sys};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    pub(super) fn library_present() -> Result<()> {
        // SAFETY: only tries to dlopen the library and reports the result.
        if unsafe { sys::is_culib_present() } {
            Ok(())
        } else {
            Err(Error::new(
                Status::NoNccl,
                "libnccl.so could not be loaded (NCCL wheels ship libnccl.so.2 only: link it as libnccl.so on LD_LIBRARY_PATH; scripts/cuda-deps.sh does)",
            ))
        }
    }

    /// Runs one NCCL call: its error becomes [`Status::Nccl`] with the
    /// result code, a panic (missing symbol) [`Status::NoNccl`].
    pub(super) fn guard<T>(
        what: &str,
        f: impl FnOnce() -> std::result::Result<T, result::NcclError>,
    ) -> Result<T> {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Error::new(
                Status::Nccl,
                format!("{what} failed: {:?}", e.0),
            )),
            Err(_) => Err(Error::new(
                Status::NoNccl,
                format!("{what}: libnccl is missing a required symbol"),
            )),
        }
    }

    fn no_driver() -> Error {
        Error::new(
            Status::NoCudaDriver,
            "no CUDA driver: libcuda.so / libcuda.so.1 could not be loaded, so no NCCL communicator can be created",
        )
    }

    /// A two-rank communicator for one (prefill rank, decode rank) pair.
    pub struct NcclPair {
        comm: sys::ncclComm_t,
        role: NcclRole,
        stream: sys::cudaStream_t,
        _ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    }

    // SAFETY: an NCCL communicator may be used from any thread, one at a time;
    // NcclPair methods take &mut self for every call that uses it.
    unsafe impl Send for NcclPair {}

    impl NcclPair {
        /// Joins the pair's communicator (blocks until the peer joins too).
        /// `stream` is the raw `CUstream` the ops are enqueued on (e.g. the
        /// relayout stream, so sends follow the gather without a host wait).
        pub fn connect(
            id: &NcclId,
            role: NcclRole,
            ordinal: usize,
            stream: u64,
        ) -> Result<NcclPair> {
            // SAFETY: only tries to dlopen the library.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(no_driver());
            }
            library_present()?;
            let ctx = match catch_unwind(|| cudarc::driver::CudaContext::new(ordinal)) {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    return Err(Error::new(
                        Status::Nccl,
                        format!("CUDA context for device {ordinal}: {e}"),
                    ))
                }
                Err(_) => return Err(no_driver()),
            };
            let bound = catch_unwind(AssertUnwindSafe(|| ctx.bind_to_thread()));
            if !matches!(bound, Ok(Ok(()))) {
                return Err(Error::new(
                    Status::Nccl,
                    format!("cannot bind device {ordinal} to this thread"),
                ));
            }
            let uid = sys::ncclUniqueId {
                internal: id.0.map(|b| b as std::ffi::c_char),
            };
            let mut comm: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: comm is a valid out-pointer; world size 2, rank 0 or 1.
            guard("ncclCommInitRank", || unsafe {
                result::comm_init_rank(&mut comm, 2, uid, role.rank())
            })?;
            Ok(NcclPair {
                comm,
                role,
                stream: stream as usize as sys::cudaStream_t,
                _ctx: ctx,
            })
        }

        /// Posts the plan's ops on the stream, grouped as planned. Sender ops
        /// read `staging`; receiver ops write `staging` (Staged mode) or the
        /// pool entries at `entry_bases` (Direct mode). A failure inside a
        /// group still ends the group before returning the error.
        ///
        /// # Safety
        /// Every op's range must be valid device memory of the pair's device
        /// until the stream has executed the ops, and the peer must post the
        /// mirrored plan (check digests with [`super::check_mirror`] first).
        pub unsafe fn post(
            &mut self,
            plan: &NcclPlan,
            staging: u64,
            entry_bases: &[u64],
        ) -> Result<()> {
            if plan.role != self.role {
                return Err(Error::invalid(format!(
                    "plan is for the {:?} but this pair end is the {:?}",
                    plan.role, self.role
                )));
            }
            let peer = 1 - self.role.rank();
            for g in &plan.groups {
                guard("ncclGroupStart", result::group_start)?;
                let mut first_err = None;
                for op in &plan.ops[g.clone()] {
                    let base = match op.buffer {
                        NcclBuffer::Staging => staging,
                        NcclBuffer::Entry(e) => match entry_bases.get(e as usize) {
                            Some(&b) => b,
                            None => {
                                first_err = Some(Error::invalid(format!(
                                    "NCCL op names entry {e} but {} entry bases were given",
                                    entry_bases.len()
                                )));
                                break;
                            }
                        },
                    };
                    let ptr = (base + op.offset) as usize;
                    let (comm, stream, len) = (self.comm, self.stream, op.len as usize);
                    let r = match self.role {
                        // SAFETY: the caller guarantees the ranges (see above).
                        NcclRole::Sender => guard("ncclSend", || unsafe {
                            result::send(
                                ptr as *const _,
                                len,
                                sys::ncclDataType_t::ncclUint8,
                                peer,
                                comm,
                                stream,
                            )
                        }),
                        // SAFETY: as above.
                        NcclRole::Receiver => guard("ncclRecv", || unsafe {
                            result::recv(
                                ptr as *mut _,
                                len,
                                sys::ncclDataType_t::ncclUint8,
                                peer,
                                comm,
                                stream,
                            )
                        }),
                    };
                    if let Err(e) = r {
                        first_err = Some(e);
                        break;
                    }
                }
                let end = guard("ncclGroupEnd", result::group_end);
                if let Some(e) = first_err {
                    return Err(e);
                }
                end?;
            }
            Ok(())
        }
    }

    impl std::fmt::Debug for NcclPair {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("NcclPair")
                .field("role", &self.role)
                .finish()
        }
    }

    impl Drop for NcclPair {
        fn drop(&mut self) {
            if self.comm.is_null() {
                return;
            }
            let comm = self.comm;
            // Errors cannot be reported from Drop; they are ignored, never panicked on.
            // SAFETY: comm came from ncclCommInitRank and is released once.
            let _ = catch_unwind(|| unsafe { result::comm_abort(comm) });
        }
    }
}

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

    /// With the PyPI NCCL (scripts/cuda-deps.sh: libnccl.so link on
    /// LD_LIBRARY_PATH) the version and a unique id come back without a GPU.
    /// `PDXFER_REQUIRE_CUDA_TOOLS=1` turns a missing library into a failure.
    #[test]
    fn library_version_and_unique_id() {
        match probe() {
            Ok(v) => {
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
        let e = NcclPair::connect(&id, NcclRole::Receiver, 0, 0).unwrap_err();
        assert_eq!(e.status(), Status::NoCudaDriver, "{e}");
    }
}
