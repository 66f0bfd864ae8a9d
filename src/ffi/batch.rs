//! Batches over the C ABI: submit writes to a peer, poll or wait.

use super::agent::PdxCompletion;
use super::peer::PdxPeer;
use super::ptr::{self, Versioned};
use super::{boundary, PdxStatus};
use crate::error::{Error, Status};
use crate::transport::{BatchId, BatchOptions, BatchStatus, ReadOp, WriteOp};
use std::time::Duration;

/// One write of a batch: `len` bytes from a local region to a peer region.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PdxWriteOp {
    /// Source region id (this agent's registry).
    pub local_region: u64,
    /// Offset in the source region.
    pub local_offset: u64,
    /// Destination region id (the peer's registry).
    pub remote_region: u64,
    /// Offset in the destination region.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Compute a checksum; the receiver verifies it over the landed bytes.
pub const PDXFER_BATCH_CHECKSUM: u32 = 1;

/// Options of `pdxfer_submit`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxBatchOptions {
    /// `sizeof(PdxBatchOptions)`, set by the caller.
    pub struct_size: u64,
    /// The batch fails with `PDX_STATUS_TIMEOUT` this long after submission (0 means 30 s).
    pub timeout_ms: u64,
    /// Caller tag carried to the receiver's completion (room id).
    pub room: u64,
    /// Caller epoch carried to the receiver's completion.
    pub epoch: u64,
    /// `PDXFER_BATCH_*` flags.
    pub flags: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

// SAFETY: repr(C), starts with u64 struct_size, integers only.
unsafe impl Versioned for PdxBatchOptions {
    const MIN_SIZE: usize = std::mem::size_of::<PdxBatchOptions>();
    const NAME: &'static str = "PdxBatchOptions";
}

fn batch_options(options: *const PdxBatchOptions) -> crate::Result<BatchOptions> {
    let mut o = BatchOptions::default();
    if !options.is_null() {
        let b = ptr::read_versioned(options)?;
        if b.flags & !PDXFER_BATCH_CHECKSUM != 0 {
            return Err(Error::invalid(format!(
                "unknown batch flags 0x{:x}",
                b.flags
            )));
        }
        if b.timeout_ms > 0 {
            o.timeout = Duration::from_millis(b.timeout_ms);
        }
        o.checksum = b.flags & PDXFER_BATCH_CHECKSUM != 0;
        o.room = b.room;
        o.epoch = b.epoch;
    }
    Ok(o)
}

/// The shared part of `pdxfer_submit` and `pdxfer_submit_reads`: checks the
/// arguments, submits through `f`, writes the batch id.
fn submit_with(
    peer: *const PdxPeer,
    ops: *const PdxWriteOp,
    num_ops: usize,
    options: *const PdxBatchOptions,
    out_batch: *mut u64,
    f: impl FnOnce(
        &dyn crate::transport::Transport,
        &[PdxWriteOp],
        &crate::transport::BatchOptions,
    ) -> crate::Result<crate::transport::BatchId>,
) -> crate::Result<Status> {
    let p = ptr::handle(peer, "peer")?;
    let ops = ptr::slice(ops, num_ops, "ops")?;
    let o = batch_options(options)?;
    ptr::check_out(out_batch, "out_batch")?;
    let id = f(p.t.as_ref(), ops, &o)?;
    ptr::write_out(out_batch, id.0, "out_batch")?;
    super::ok()
}

/// The Rust op of a C op (reads use the same fields, data flowing the other way).
fn write_op(w: &PdxWriteOp) -> WriteOp {
    WriteOp {
        local_region: w.local_region,
        local_offset: w.local_offset,
        remote_region: w.remote_region,
        remote_offset: w.remote_offset,
        len: w.len,
    }
}

/// Submits `num_ops` writes to the peer as one batch; its id goes to
/// `out_batch`. `options` may be NULL. An op outside the local or the
/// peer's regions fails the call (`PDX_STATUS_OUT_OF_BOUNDS`,
/// `PDX_STATUS_REGION_NOT_FOUND`) and nothing is sent. `ops` is not retained.
#[no_mangle]
pub extern "C" fn pdxfer_submit(
    peer: *const PdxPeer,
    ops: *const PdxWriteOp,
    num_ops: usize,
    options: *const PdxBatchOptions,
    out_batch: *mut u64,
) -> PdxStatus {
    boundary(|| {
        submit_with(peer, ops, num_ops, options, out_batch, |t, ops, o| {
            let rust: Vec<WriteOp> = ops.iter().map(write_op).collect();
            t.submit(&rust, o)
        })
    })
}

/// Submits `num_ops` one-sided reads as one batch: each op's `len` bytes go
/// from the peer's `remote_region` at `remote_offset` into this agent's
/// `local_region` at `local_offset` (the same `PdxWriteOp` fields, data
/// flowing the other way). The peer validates and pins the source ranges
/// first. `PDX_STATUS_UNSUPPORTED` on transports that cannot read (tcp).
#[no_mangle]
pub extern "C" fn pdxfer_submit_reads(
    peer: *const PdxPeer,
    ops: *const PdxWriteOp,
    num_ops: usize,
    options: *const PdxBatchOptions,
    out_batch: *mut u64,
) -> PdxStatus {
    boundary(|| {
        submit_with(peer, ops, num_ops, options, out_batch, |t, ops, o| {
            let rust: Vec<ReadOp> = ops.iter().map(|w| write_op(w).as_read()).collect();
            t.submit_reads(&rust, o)
        })
    })
}

/// Polls a batch: `PDX_STATUS_OK` (done; `out` filled, may be NULL),
/// `PDX_STATUS_IN_PROGRESS`, or the batch's failure (reason in
/// `pdxfer_last_error()`). A finished batch is reported once. An `out` whose
/// `struct_size` is too small is `PDX_STATUS_ABI_MISMATCH` before the batch
/// is looked at: its result stays to be reported.
#[no_mangle]
pub extern "C" fn pdxfer_poll(
    peer: *const PdxPeer,
    batch: u64,
    out: *mut PdxCompletion,
) -> PdxStatus {
    boundary(|| {
        let p = ptr::handle(peer, "peer")?;
        if !out.is_null() {
            ptr::check_versioned_out(out)?;
        }
        match p.t.poll(BatchId(batch))? {
            BatchStatus::Pending => Ok(Status::InProgress),
            BatchStatus::Done(c) => {
                if !out.is_null() {
                    ptr::write_versioned(out, &PdxCompletion::from_rust(&c, None))?;
                }
                super::ok()
            }
            BatchStatus::Failed(e) => Err(e),
        }
    })
}

/// Waits up to `timeout_ms` for a batch: `PDX_STATUS_OK` (`out` filled, may
/// be NULL), the batch's failure, or `PDX_STATUS_TIMEOUT` when the wait
/// ended first (the batch keeps its own deadline). An `out` whose
/// `struct_size` is too small is `PDX_STATUS_ABI_MISMATCH` before waiting:
/// the result is not consumed and a later call still gets it.
#[no_mangle]
pub extern "C" fn pdxfer_wait(
    peer: *const PdxPeer,
    batch: u64,
    timeout_ms: u64,
    out: *mut PdxCompletion,
) -> PdxStatus {
    boundary(|| {
        let p = ptr::handle(peer, "peer")?;
        if !out.is_null() {
            ptr::check_versioned_out(out)?;
        }
        let c =
            p.t.wait(BatchId(batch), Duration::from_millis(timeout_ms))?;
        if !out.is_null() {
            ptr::write_versioned(out, &PdxCompletion::from_rust(&c, None))?;
        }
        super::ok()
    })
}

#[cfg(test)]
mod tests {
    use super::super::agent::*;
    use super::super::memory::*;
    use super::super::peer::*;
    use super::*;
    use std::ffi::CString;
    use std::mem::size_of;

    /// Struct sizes are part of the ABI; C and Python pin the same numbers.
    #[test]
    fn abi_struct_sizes_are_pinned() {
        assert_eq!(size_of::<PdxAgentOptions>(), 24);
        assert_eq!(size_of::<PdxCompletion>(), 64);
        assert_eq!(size_of::<PdxRegion>(), 40);
        assert_eq!(size_of::<PdxPeerOptions>(), 32);
        assert_eq!(size_of::<PdxWriteOp>(), 40);
        assert_eq!(size_of::<PdxBatchOptions>(), 40);
    }

    /// A non-loopback listener needs the secret; a 1.2 caller (16-byte
    /// struct, no `secret`) still creates a loopback agent.
    #[test]
    fn agent_secret_option_and_the_older_struct() {
        let any = CString::new("0.0.0.0:0").unwrap();
        let mut a: *mut PdxAgent = std::ptr::null_mut();
        let open = PdxAgentOptions {
            struct_size: size_of::<PdxAgentOptions>() as u64,
            listen: any.as_ptr(),
            secret: std::ptr::null(),
        };
        assert_eq!(pdxfer_agent_create(&open, &mut a), PdxStatus::AuthRequired);
        assert!(a.is_null(), "a refused create returns no handle");
        let secret = CString::new("0123456789abcdef-cluster").unwrap();
        let with = PdxAgentOptions {
            secret: secret.as_ptr(),
            ..open
        };
        assert_eq!(pdxfer_agent_create(&with, &mut a), PdxStatus::Ok);
        pdxfer_agent_destroy(a);
        let short = CString::new("short").unwrap();
        let bad = PdxAgentOptions {
            secret: short.as_ptr(),
            ..open
        };
        a = std::ptr::null_mut();
        assert_eq!(
            pdxfer_agent_create(&bad, &mut a),
            PdxStatus::InvalidArgument
        );
        let lo = CString::new("127.0.0.1:0").unwrap();
        let old = PdxAgentOptions {
            struct_size: 16,
            listen: lo.as_ptr(),
            // beyond the 1.2 struct: never read
            secret: std::ptr::dangling::<std::ffi::c_char>(),
        };
        assert_eq!(pdxfer_agent_create(&old, &mut a), PdxStatus::Ok);
        pdxfer_agent_destroy(a);
    }

    #[test]
    fn c_abi_roundtrip_over_tcp_and_errors() {
        let listen = CString::new("127.0.0.1:0").unwrap();
        let ao = PdxAgentOptions {
            struct_size: size_of::<PdxAgentOptions>() as u64,
            listen: listen.as_ptr(),
            secret: std::ptr::null(),
        };
        let mut rx: *mut PdxAgent = std::ptr::null_mut();
        assert_eq!(pdxfer_agent_create(&ao, &mut rx), PdxStatus::Ok);
        let mut tx: *mut PdxAgent = std::ptr::null_mut();
        assert_eq!(
            pdxfer_agent_create(std::ptr::null(), &mut tx),
            PdxStatus::Ok
        );
        let mut dst = vec![0u8; 8192];
        let mut src: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
        let mut rd = PdxRegion {
            struct_size: size_of::<PdxRegion>() as u64,
            ..Default::default()
        };
        let mut sd = rd;
        assert_eq!(
            pdxfer_register_memory(rx, dst.as_mut_ptr().cast(), dst.len(), &mut rd),
            PdxStatus::Ok
        );
        assert_eq!(
            pdxfer_register_memory(tx, src.as_mut_ptr().cast(), src.len(), &mut sd),
            PdxStatus::Ok
        );
        assert_eq!(
            pdxfer_register_memory(tx, src.as_mut_ptr().cast(), 16, std::ptr::null_mut()),
            PdxStatus::RegionOverlap
        );
        let mut addr = [0 as std::ffi::c_char; 64];
        let mut n = 0usize;
        assert_eq!(
            pdxfer_agent_listen_addr(rx, addr.as_mut_ptr(), addr.len(), &mut n),
            PdxStatus::Ok
        );
        let po = PdxPeerOptions {
            struct_size: size_of::<PdxPeerOptions>() as u64,
            transport: PDXFER_TRANSPORT_TCP,
            streams: 2,
            threads: 0,
            reserved: 0,
            timeout_ms: 0,
        };
        let mut peer: *mut PdxPeer = std::ptr::null_mut();
        assert_eq!(
            pdxfer_peer_open(tx, addr.as_ptr(), &po, &mut peer),
            PdxStatus::Ok
        );
        let mut kind = 99u32;
        assert_eq!(pdxfer_peer_transport(peer, &mut kind), PdxStatus::Ok);
        assert_eq!(kind, PDXFER_TRANSPORT_TCP);
        let ops = [PdxWriteOp {
            local_region: sd.id,
            local_offset: 10,
            remote_region: rd.id,
            remote_offset: 100,
            len: 4000,
        }];
        let bo = PdxBatchOptions {
            struct_size: size_of::<PdxBatchOptions>() as u64,
            timeout_ms: 5000,
            room: 7,
            epoch: 2,
            flags: PDXFER_BATCH_CHECKSUM,
            reserved: 0,
        };
        let mut b = 0u64;
        assert_eq!(
            pdxfer_submit(peer, ops.as_ptr(), 1, &bo, &mut b),
            PdxStatus::Ok
        );
        let mut c = PdxCompletion {
            struct_size: size_of::<PdxCompletion>() as u64,
            ..Default::default()
        };
        assert_eq!(pdxfer_wait(peer, b, 5000, &mut c), PdxStatus::Ok);
        assert_eq!((c.bytes, c.room, c.epoch, c.has_checksum), (4000, 7, 2, 1));
        let mut rc = PdxCompletion {
            struct_size: size_of::<PdxCompletion>() as u64,
            ..Default::default()
        };
        assert_eq!(
            pdxfer_agent_next_completion(rx, 5000, &mut rc),
            PdxStatus::Ok
        );
        assert_eq!(
            (rc.batch_id, rc.bytes, rc.checksum),
            (c.batch_id, 4000, c.checksum)
        );
        assert_eq!(rc.peer_pid, std::process::id());
        assert_eq!(&dst[100..4100], &src[10..4010]);
        // Out of bounds: refused, nothing sent.
        let bad = [PdxWriteOp {
            remote_offset: 8000,
            ..ops[0]
        }];
        assert_eq!(
            pdxfer_submit(peer, bad.as_ptr(), 1, &bo, &mut b),
            PdxStatus::OutOfBounds
        );
        assert_eq!(
            pdxfer_agent_next_completion(rx, 10, &mut rc),
            PdxStatus::Timeout
        );
        assert_eq!(
            pdxfer_submit(std::ptr::null(), ops.as_ptr(), 1, &bo, &mut b),
            PdxStatus::NullArgument
        );
        assert_eq!(pdxfer_poll(peer, 12345, &mut c), PdxStatus::InvalidArgument);
        // tcp cannot read from the peer: typed, not a crash.
        assert_eq!(
            pdxfer_submit_reads(peer, ops.as_ptr(), 1, &bo, &mut b),
            PdxStatus::Unsupported
        );
        pdxfer_peer_close(peer);
        assert_eq!(pdxfer_unregister_memory(rx, rd.id, 1000), PdxStatus::Ok);
        assert_eq!(
            pdxfer_unregister_memory(rx, rd.id, 1000),
            PdxStatus::RegionNotFound
        );
        pdxfer_agent_destroy(tx);
        pdxfer_agent_destroy(rx);
        pdxfer_agent_destroy(std::ptr::null_mut());
    }
}
