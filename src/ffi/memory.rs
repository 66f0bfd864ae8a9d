//! Memory registration over the C ABI (`pdxfer_register_memory` and friends).

use super::agent::PdxAgent;
use super::ptr::{self, Versioned};
use super::{boundary, PdxStatus};
use crate::memory::{RegionDesc, RegionKind};
use std::ffi::c_void;
use std::time::Duration;

/// Host memory.
pub const PDXFER_REGION_HOST: u32 = 0;
/// CUDA device memory.
pub const PDXFER_REGION_DEVICE: u32 = 1;

/// A registered region's descriptor.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PdxRegion {
    /// `sizeof(PdxRegion)`, set by the caller before the call.
    pub struct_size: u64,
    /// Region id in the owner's registry.
    pub id: u64,
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// `PDXFER_REGION_HOST` or `PDXFER_REGION_DEVICE`.
    pub kind: u32,
    /// CUDA device ordinal for device regions, else 0.
    pub device_ordinal: u32,
}

// SAFETY: repr(C), starts with u64 struct_size, integers only.
unsafe impl Versioned for PdxRegion {
    const MIN_SIZE: usize = std::mem::size_of::<PdxRegion>();
    const NAME: &'static str = "PdxRegion";
}

impl PdxRegion {
    pub(crate) fn from_desc(d: &RegionDesc) -> Self {
        let (kind, ord) = match d.kind {
            RegionKind::Host => (PDXFER_REGION_HOST, 0),
            RegionKind::Device { ordinal } => (PDXFER_REGION_DEVICE, ordinal),
        };
        PdxRegion {
            struct_size: std::mem::size_of::<PdxRegion>() as u64,
            id: d.id,
            addr: d.addr,
            len: d.len,
            kind,
            device_ordinal: ord,
        }
    }
}

/// Registers `len` bytes of host memory at `ptr` with the agent; the
/// descriptor goes to `out` (may be NULL; one whose `struct_size` is too
/// small is `PDX_STATUS_ABI_MISMATCH` and nothing is registered). The memory must stay valid until
/// `pdxfer_unregister_memory` returns for it. Overlapping an existing region
/// is `PDX_STATUS_REGION_OVERLAP`.
#[no_mangle]
pub extern "C" fn pdxfer_register_memory(
    agent: *const PdxAgent,
    addr: *mut c_void,
    len: usize,
    out: *mut PdxRegion,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::handle(agent, "agent")?;
        let p = ptr::raw_range(addr, len, "addr")?;
        if !out.is_null() {
            ptr::check_versioned_out(out)?;
        }
        // SAFETY: the C contract (documented above) keeps the memory valid until unregistered.
        let d = unsafe { a.agent.registry().register_host(p, len) }?;
        if !out.is_null() {
            ptr::write_versioned(out, &PdxRegion::from_desc(&d))?;
        }
        super::ok()
    })
}

/// Allocates `len` zeroed bytes of shared host memory (a memfd mapped into
/// this process) and registers it; the region's address is in `out->addr`.
/// Same-host cma peers write such regions with plain memcpy through a
/// mapping instead of `process_vm_writev`. Freed by `pdxfer_unregister_memory`
/// (or when the agent is destroyed): do not use `addr` afterwards.
#[no_mangle]
pub extern "C" fn pdxfer_alloc_shared_memory(
    agent: *const PdxAgent,
    len: usize,
    out: *mut PdxRegion,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::handle(agent, "agent")?;
        if out.is_null() {
            return Err(crate::Error::new(
                crate::Status::NullArgument,
                "out is NULL (it receives the address of the allocation)",
            ));
        }
        ptr::check_versioned_out(out)?;
        let d = a.agent.registry().alloc_shared(len)?;
        ptr::write_versioned(out, &PdxRegion::from_desc(&d))?;
        super::ok()
    })
}

/// Allocates `len` zeroed bytes of shareable host memory for the caller's
/// own use, e.g. as KV pools (a memfd mapping, populated now); its address
/// goes to `*out_addr` (page-aligned). No agent is needed: any host memory
/// registered inside it later (an engine's `PdxKvPool.base`, or
/// `pdxfer_register_memory`) is published to same-host peers as shared, so a
/// same-host prefill engine copies KV rows straight into it (one copy, no
/// staging) and cma peers write it with memcpy. Free it with
/// `pdxfer_free_shared_pool` after the engine or agent that registered it
/// closed. On failure nothing is allocated and `*out_addr` is untouched.
#[no_mangle]
pub extern "C" fn pdxfer_alloc_shared_pool(len: usize, out_addr: *mut *mut c_void) -> PdxStatus {
    boundary(|| {
        ptr::check_out(out_addr, "out_addr")?;
        let addr = crate::memory::shared::alloc_pool(len)?;
        ptr::write_out(out_addr, addr as *mut c_void, "out_addr")?;
        super::ok()
    })
}

/// Frees an allocation of `pdxfer_alloc_shared_pool` by its address.
/// Memory of it still registered (an engine not yet closed) stays mapped
/// until unregistered; do not use `addr` afterwards either way.
/// `PDX_STATUS_INVALID_ARGUMENT` (nothing freed) for an address that is not
/// the start of a live allocation.
#[no_mangle]
pub extern "C" fn pdxfer_free_shared_pool(addr: *mut c_void) -> PdxStatus {
    boundary(|| {
        if addr.is_null() {
            return Err(crate::Error::new(
                crate::Status::NullArgument,
                "addr is NULL",
            ));
        }
        crate::memory::shared::free_pool(addr as u64)?;
        super::ok()
    })
}

/// Registers `len` bytes of CUDA device memory at device address `dptr` on
/// device `ordinal`. `PDX_STATUS_NO_CUDA_DRIVER` without a driver,
/// `PDX_STATUS_UNSUPPORTED` without the `cuda` feature. Only the rdma
/// transport moves device regions (GPUDirect RDMA: the NIC reads and writes
/// GPU memory directly; `PDX_STATUS_NO_GPU_DIRECT` with the reason where the
/// NIC cannot); cma and tcp refuse them.
#[no_mangle]
pub extern "C" fn pdxfer_register_device_memory(
    agent: *const PdxAgent,
    dptr: u64,
    len: usize,
    ordinal: u32,
    out: *mut PdxRegion,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::handle(agent, "agent")?;
        if !out.is_null() {
            ptr::check_versioned_out(out)?;
        }
        // SAFETY: the C contract keeps the allocation valid until unregistered.
        let d = unsafe { a.agent.registry().register_device(dptr, len, ordinal) }?;
        if !out.is_null() {
            ptr::write_versioned(out, &PdxRegion::from_desc(&d))?;
        }
        super::ok()
    })
}

/// Unregisters a region, waiting up to `timeout_ms` for in-flight transfers
/// that touch it; `PDX_STATUS_REGION_BUSY` (region kept) when they do not finish.
#[no_mangle]
pub extern "C" fn pdxfer_unregister_memory(
    agent: *const PdxAgent,
    region_id: u64,
    timeout_ms: u64,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::handle(agent, "agent")?;
        a.agent
            .registry()
            .unregister(region_id, Duration::from_millis(timeout_ms))?;
        super::ok()
    })
}

/// Copies the agent's own region descriptors into `out` (of `capacity`);
/// the count goes to `out_len`. Entries are written with the full
/// `sizeof(PdxRegion)`.
#[no_mangle]
pub extern "C" fn pdxfer_agent_regions(
    agent: *const PdxAgent,
    out: *mut PdxRegion,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::handle(agent, "agent")?;
        let v: Vec<PdxRegion> = a
            .agent
            .registry()
            .descriptors()
            .iter()
            .map(PdxRegion::from_desc)
            .collect();
        ptr::fill(&v, out, capacity, out_len, "regions")
    })
}
