//! What the driver says about GPUDirect RDMA on VMM memory: one `cuMemCreate`
//! mapping made with `allocFlags.gpuDirectRDMACapable`, one made without it,
//! and a `cuMemAlloc` buffer, each asked
//! `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE` (the question the engine
//! asks of every mapping of a decode's device pools). `scripts/gpu-check.sh`
//! prints it first, with the GPUDirect route.

use super::driver::guard;
use super::stream::GpuStream;
use super::writer::HostToDevice;
use crate::error::Result;
use cudarc::driver::sys;

/// The answers for one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmGpuDirect {
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
    pub vmm: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
    pub gpudirect_with_vmm: bool,
    /// The attribute of `cuMemAlloc` memory (`None`: the driver did not say).
    pub mem_alloc: Option<bool>,
    /// The attribute of a `cuMemCreate` mapping with the flag.
    pub vmm_flagged: Option<bool>,
    /// The attribute of a `cuMemCreate` mapping without it.
    pub vmm_unflagged: Option<bool>,
}

impl VmmGpuDirect {
    /// One line for a report.
    pub fn describe(&self) -> String {
        let v = |x: Option<bool>| match x {
            Some(true) => "capable",
            Some(false) => "NOT capable",
            None => "unknown",
        };
        format!(
            "IS_GPU_DIRECT_RDMA_CAPABLE: cuMemAlloc {}, cuMemCreate(gpuDirectRDMACapable=1) {}, cuMemCreate(gpuDirectRDMACapable=0) {} (VMM {}, GPUDirect RDMA with VMM {}); pools whose mappings are not capable are refused for rdma and sent over tcp by auto",
            v(self.mem_alloc),
            v(self.vmm_flagged),
            v(self.vmm_unflagged),
            if self.vmm { "supported" } else { "unsupported" },
            if self.gpudirect_with_vmm { "supported" } else { "unsupported" },
        )
    }
}

fn device_attr(ordinal: usize, a: sys::CUdevice_attribute) -> Result<i32> {
    guard("cuDeviceGetAttribute", || {
        let dev = cudarc::driver::result::device::get(ordinal as i32)?;
        let mut v = 0i32;
        // SAFETY: an out-pointer to a local int, a device the driver handed out.
        unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev).result()? };
        Ok(v)
    })
}

/// Asks the attribute of one `[ptr, ptr + len)`: `Some(false)` when a
/// mapping of it is not capable.
fn capable(w: &HostToDevice, ptr: u64, len: u64) -> Result<Option<bool>> {
    Ok(Some(w.mapping_without_gpu_direct(ptr, len)?.is_none()))
}

/// One `cuMemCreate` mapping of the allocation granularity on `ordinal`,
/// made with or without `gpuDirectRDMACapable`, asked and freed again.
fn vmm_mapping(w: &HostToDevice, ordinal: usize, flag: bool) -> Result<Option<bool>> {
    // SAFETY: a plain C struct; zero is a valid value of every field (the
    // INVALID/NONE enum members, a null pointer).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal as i32;
    prop.allocFlags.gpuDirectRDMACapable = u8::from(flag);
    let mut size = 0usize;
    guard("cuMemGetAllocationGranularity", || {
        // SAFETY: out-pointer to a local; prop is initialised above.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut size,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
            .result()
        }
    })?;
    let size = size.max(2 << 20);
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    guard("cuMemCreate", || {
        // SAFETY: out-pointer to a local; prop as above.
        unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0).result() }
    })?;
    let mut va: sys::CUdeviceptr = 0;
    let reserved = guard("cuMemAddressReserve", || {
        // SAFETY: out-pointer to a local; no fixed address asked.
        unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0).result() }
    });
    let answer = reserved.and_then(|()| {
        guard("cuMemMap", || {
            // SAFETY: va..va+size was reserved above; the handle is `size` bytes.
            unsafe { sys::cuMemMap(va, size, 0, handle, 0).result() }
        })?;
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let r = guard("cuMemSetAccess", || {
            // SAFETY: va..va+size is mapped above; one descriptor.
            unsafe { sys::cuMemSetAccess(va, size, &access, 1).result() }
        })
        .and_then(|()| capable(w, va, size as u64));
        let _ = guard("cuMemUnmap", || {
            // SAFETY: the mapping made above, unmapped once; nothing uses it.
            unsafe { sys::cuMemUnmap(va, size).result() }
        });
        r
    });
    if va != 0 {
        let _ = guard("cuMemAddressFree", || {
            // SAFETY: the reservation made above, freed once, unmapped.
            unsafe { sys::cuMemAddressFree(va, size).result() }
        });
    }
    let _ = guard("cuMemRelease", || {
        // SAFETY: the handle made above, released once.
        unsafe { sys::cuMemRelease(handle).result() }
    });
    answer
}

/// Asks device `ordinal` (its primary context) about the three kinds of
/// memory; the VMM ones only where the device supports VMM.
pub fn probe_vmm_gpudirect(ordinal: usize) -> Result<VmmGpuDirect> {
    use sys::CUdevice_attribute as A;
    let w = HostToDevice::new(ordinal)?;
    let vmm = device_attr(
        ordinal,
        A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    )? != 0;
    let gpudirect_with_vmm = device_attr(
        ordinal,
        A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
    )? != 0;
    let plain = GpuStream::new(ordinal)?.alloc(2 << 20)?;
    let mem_alloc = capable(&w, plain.ptr(), plain.len() as u64)?;
    drop(plain);
    let (vmm_flagged, vmm_unflagged) = if vmm {
        (
            vmm_mapping(&w, ordinal, true)?,
            vmm_mapping(&w, ordinal, false)?,
        )
    } else {
        (None, None)
    };
    Ok(VmmGpuDirect {
        vmm,
        gpudirect_with_vmm,
        mem_alloc,
        vmm_flagged,
        vmm_unflagged,
    })
}
