//! Memory the driver owns for this crate: device buffers ([`DeviceBuffer`],
//! `cuMemAlloc`) and page-locked host buffers ([`PinnedBuffer`],
//! `cuMemHostAlloc`), both freed on drop without panicking, and the pointer
//! checks that tell whether an address range is mapped device memory of one
//! device (one allocation, or contiguous VMM mappings).

use super::driver::guard;
use crate::error::{Error, Result, Status};
use cudarc::driver::{result, sys, CudaContext};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// Device memory owned by this crate (pools in tests, staging buffers).
/// Its address and length are what transports register. Dropping it frees
/// the memory: keep it alive until the work that uses it has completed.
pub struct DeviceBuffer {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ptr: u64,
    pub(super) len: usize,
}

impl DeviceBuffer {
    /// Device address of byte 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device ordinal of the buffer.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Copies `out.len()` bytes from `offset` to the host with a synchronous
    /// copy. It does not wait for any stream: wait on the event of
    /// the work that wrote the bytes first.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(self, offset, out.len())?;
        guard("cuMemcpyDtoH", || {
            self.ctx.bind_to_thread()?;
            // SAFETY: the range was checked against the allocation.
            unsafe { result::memcpy_dtoh_sync(out, self.ptr + offset as u64) }
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let (ctx, ptr) = (&self.ctx, self.ptr);
        // Errors cannot be reported from Drop; they are ignored, never panicked on.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            ctx.bind_to_thread()?;
            // SAFETY: ptr came from cuMemAlloc in this context and is freed once.
            unsafe { result::free_sync(ptr) }
        }));
    }
}

/// Page-locked host memory from `cuMemHostAlloc`: device-to-host copies into
/// it are asynchronous (a copy into pageable memory blocks the caller). It is
/// ordinary host memory to everything else (a transport registers and sends
/// it like any buffer). Dropping it frees it: keep it alive until the copies
/// into it have completed.
pub struct PinnedBuffer {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; the pointer is
// only dereferenced by its owner (or a driver copy the owner orders with events).
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// Host address of byte 0.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        let (ctx, ptr) = (&self.ctx, self.ptr);
        // Errors cannot be reported from Drop; they are ignored, never panicked on.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            ctx.bind_to_thread()?;
            // SAFETY: ptr came from cuMemHostAlloc and is freed once.
            unsafe { result::free_host(ptr as *mut std::ffi::c_void) }
        }));
    }
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedBuffer({:p}, {} B)", self.ptr, self.len)
    }
}

pub(super) fn check_range(buf: &DeviceBuffer, offset: usize, len: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|e| e > buf.len) {
        return Err(Error::new(
            Status::OutOfBounds,
            format!(
                "device buffer access {offset}..{} outside its {} B",
                offset.saturating_add(len),
                buf.len
            ),
        ));
    }
    Ok(())
}

/// [`GpuStream::check_device_range`](super::GpuStream::check_device_range) in context `ctx`.
///
/// The range may span several mappings: CUDA VMM memory (PyTorch's
/// `expandable_segments`, memory-saver allocators) is one VA range backed by
/// many `cuMemCreate` chunks, and `CU_POINTER_ATTRIBUTE_RANGE_*` covers only
/// the chunk holding the address. So the check walks from `ptr` chunk by
/// chunk to `ptr + len`, and requires each to be mapped device memory of
/// this device, each starting where the previous one ended.
pub(super) fn check_device_range_in(ctx: &Arc<CudaContext>, ptr: u64, len: u64) -> Result<()> {
    guard("cuCtxSetCurrent", || ctx.bind_to_thread())?;
    let end = ptr.checked_add(len).ok_or_else(|| {
        Error::new(
            Status::OutOfBounds,
            format!("device range 0x{ptr:x}+{len} wraps the address space"),
        )
    })?;
    let first = mapping_at(ctx, ptr).map_err(|e| {
        if e.status() == Status::NoCudaDriver {
            e
        } else {
            Error::invalid(e.detail().to_string())
        }
    })?;
    let (mut at, mut chunks) = (first.1, 1u64);
    while at < end {
        let (start, stop) = mapping_at(ctx, at).map_err(|e| {
            if e.status() == Status::NoCudaDriver {
                return e;
            }
            Error::new(
                Status::OutOfBounds,
                format!(
                    "device range 0x{ptr:x}+{len} runs past its allocation: mapped up to 0x{at:x} ({chunks} mapping(s) from 0x{:x}), then {}",
                    first.0,
                    e.detail()
                ),
            )
        })?;
        if start != at || stop <= at {
            return Err(Error::new(
                Status::OutOfBounds,
                format!(
                    "device range 0x{ptr:x}+{len} is not one contiguous mapping: the mapping at 0x{at:x} spans 0x{start:x}..0x{stop:x}"
                ),
            ));
        }
        at = stop;
        chunks += 1;
    }
    Ok(())
}

/// The first mapping of `[ptr, ptr + len)` that cannot be registered for
/// GPUDirect RDMA (`CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE` 0: VMM
/// memory from `cuMemCreate` without `allocFlags.gpuDirectRDMACapable`, as
/// PyTorch's expandable segments made it before 2.8), as `[start, end)`;
/// `None` when every mapping can. Walks the range mapping by mapping, as
/// [`check_device_range_in`] does; an address the driver cannot describe
/// ends the walk with `None` (that check refuses it, with the reason), and a
/// driver without the attribute (before CUDA 11.3) answers `None` too.
pub(super) fn mapping_without_gpu_direct_in(
    ctx: &Arc<CudaContext>,
    ptr: u64,
    len: u64,
) -> Result<Option<(u64, u64)>> {
    use sys::CUpointer_attribute as A;
    guard("cuCtxSetCurrent", || ctx.bind_to_thread())?;
    let end = ptr.saturating_add(len);
    let mut at = ptr;
    while at < end {
        let Ok((start, stop)) = mapping_at(ctx, at) else {
            return Ok(None);
        };
        let mut capable: i32 = 1;
        // SAFETY: `capable` is a local of the attribute's size (an int).
        let r = guard(
            "cuPointerGetAttribute(IS_GPU_DIRECT_RDMA_CAPABLE)",
            || unsafe {
                sys::cuPointerGetAttribute(
                    &mut capable as *mut i32 as *mut std::ffi::c_void,
                    A::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
                    at,
                )
                .result()
            },
        );
        match r {
            Err(e) if e.status() == Status::NoCudaDriver => return Err(e),
            Err(e) => {
                log::info!(
                    "cuda: the driver does not say whether 0x{at:x} is GPUDirect RDMA capable: {e}"
                );
                return Ok(None);
            }
            Ok(()) if capable == 0 => return Ok(Some((start, stop))),
            Ok(()) => {}
        }
        if stop <= at {
            return Ok(None);
        }
        at = stop;
    }
    Ok(None)
}

/// The mapping holding `addr` (`[start, end)` from
/// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` / `_SIZE`), after checking it is
/// device memory of `ctx`'s device; errors say which of those failed.
fn mapping_at(ctx: &Arc<CudaContext>, addr: u64) -> Result<(u64, u64)> {
    use sys::CUpointer_attribute as A;
    let what = format!("cuPointerGetAttribute(0x{addr:x})");
    let attr = |a: A, out: *mut std::ffi::c_void| {
        // SAFETY: `out` points at a local of the attribute's size (below).
        guard(&what, || unsafe {
            sys::cuPointerGetAttribute(out, a, addr).result()
        })
    };
    let mut mem_type: u32 = 0;
    if let Err(e) = attr(
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        &mut mem_type as *mut u32 as *mut _,
    ) {
        if e.status() == Status::NoCudaDriver {
            return Err(e);
        }
        return Err(Error::invalid(format!(
            "0x{addr:x} is not a CUDA allocation ({})",
            e.detail()
        )));
    }
    if mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Err(Error::invalid(format!(
            "0x{addr:x} is not device memory (CUmemorytype {mem_type}; 1 is host memory)"
        )));
    }
    let mut dev: i32 = -1;
    attr(
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        &mut dev as *mut i32 as *mut _,
    )?;
    if dev != ctx.ordinal() as i32 {
        return Err(Error::invalid(format!(
            "0x{addr:x} lives on CUDA device {dev}, not on device {}",
            ctx.ordinal()
        )));
    }
    let mut start: u64 = 0;
    let mut size: usize = 0;
    attr(
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        &mut start as *mut u64 as *mut _,
    )?;
    attr(
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        &mut size as *mut usize as *mut _,
    )?;
    let stop = start.saturating_add(size as u64);
    if !(start <= addr && addr < stop) {
        return Err(Error::new(
            Status::Cuda,
            format!(
                "the driver says 0x{addr:x} lies in 0x{start:x}+{size}, which does not hold it"
            ),
        ));
    }
    Ok((start, stop))
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} B)", self.ptr, self.len)
    }
}
