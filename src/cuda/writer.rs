//! The device writer of the tcp receiver: [`HostToDevice`] lands bytes that
//! arrived on the host in device memory.

use super::driver::{driver_present, guard};
use super::memory::{check_device_range_in, mapping_without_gpu_direct_in};
use crate::error::Result;
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// Copies host bytes into device memory of one device, for receivers that
/// land bytes on the host first (the tcp receiver of a decode whose KV pools
/// are device memory): each [`write`](crate::memory::DeviceWriter::write) is
/// an asynchronous host-to-device copy on a stream of its own (a small pool,
/// one per concurrent caller) followed by a wait on that stream, so it
/// returns only once the bytes are in device memory;
/// [`write_async`](crate::memory::DeviceWriter::write_async) enqueues the
/// copy and returns a fence on an event recorded after it. Needs no kernels.
pub struct HostToDevice {
    ctx: Arc<CudaContext>,
    streams: Mutex<Vec<Arc<CudaStream>>>,
}

impl HostToDevice {
    /// Opens device `ordinal` (its primary context).
    pub fn new(ordinal: usize) -> Result<HostToDevice> {
        driver_present()?;
        let ctx = guard("cuDevicePrimaryCtxRetain", || CudaContext::new(ordinal))?;
        // SAFETY: every copy is waited on through its own stream; cudarc's
        // per-buffer event tracking is not used.
        unsafe { ctx.disable_event_tracking() };
        Ok(HostToDevice {
            ctx,
            streams: Mutex::new(Vec::new()),
        })
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Checks that `[ptr, ptr + len)` is mapped device memory of this device
    /// (as [`GpuStream::check_device_range`](super::GpuStream::check_device_range)).
    pub fn check_device_range(&self, ptr: u64, len: u64) -> Result<()> {
        check_device_range_in(&self.ctx, ptr, len)
    }

    /// The first mapping of `[ptr, ptr + len)` that cannot be registered for
    /// GPUDirect RDMA (`CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`
    /// 0), as `[start, end)`; `None` when all can or the driver cannot say.
    pub fn mapping_without_gpu_direct(&self, ptr: u64, len: u64) -> Result<Option<(u64, u64)>> {
        mapping_without_gpu_direct_in(&self.ctx, ptr, len)
    }
}

impl std::fmt::Debug for HostToDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostToDevice(device {})", self.ctx.ordinal())
    }
}

impl crate::memory::DeviceWriter for HostToDevice {
    /// Page-locked (`cuMemHostAlloc`, portable) when the driver gives it,
    /// else heap memory.
    fn bounce(&self, len: usize) -> crate::memory::BounceBuffer {
        let ctx = self.ctx.clone();
        let pinned = guard("cuMemHostAlloc", || {
            ctx.bind_to_thread()?;
            // SAFETY: plain allocation in the bound context (u8 has no invalid values).
            unsafe { result::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
        });
        match pinned {
            Ok(p) => {
                let release: Box<dyn FnOnce(*mut u8) + Send> = Box::new(move |p| {
                    // Errors cannot be reported from a drop; they are ignored, never panicked on.
                    let _ = catch_unwind(AssertUnwindSafe(|| {
                        ctx.bind_to_thread()?;
                        // SAFETY: p came from cuMemHostAlloc above and is freed once.
                        unsafe { result::free_host(p as *mut std::ffi::c_void) }
                    }));
                });
                // SAFETY: a fresh allocation of len bytes, owned by the buffer until released.
                unsafe { crate::memory::BounceBuffer::from_raw(p as *mut u8, len, release) }
            }
            Err(e) => {
                log::warn!("host-to-device bounce buffer not page-locked ({e}); using heap memory");
                crate::memory::BounceBuffer::heap(len)
            }
        }
    }

    fn write(&self, dst: u64, src: &[u8]) -> Result<()> {
        let pooled = self.streams.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let stream = match pooled {
            Some(s) => s,
            None => guard("cuStreamCreate", || self.ctx.new_stream())?,
        };
        guard("cuMemcpyHtoDAsync + cuStreamSynchronize", || {
            self.ctx.bind_to_thread()?;
            // SAFETY: the caller checked [dst, dst + len) against a registered
            // device region of this device; the stream is synchronised before
            // `src` is released.
            unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }?;
            stream.synchronize()
        })?;
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(stream);
        Ok(())
    }

    /// Enqueues the copy on a pooled stream and records an event after it;
    /// the fence synchronises that event (the copy only), so the stream goes
    /// straight back to the pool for the next copy.
    unsafe fn write_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<crate::memory::Fence> {
        let pooled = self.streams.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let stream = match pooled {
            Some(s) => s,
            None => guard("cuStreamCreate", || self.ctx.new_stream())?,
        };
        let ev = guard("cuMemcpyHtoDAsync + cuEventRecord", || {
            self.ctx.bind_to_thread()?;
            // SAFETY: the caller checked [dst, dst + len) against a registered
            // device region of this device and keeps [src, src + len) intact
            // until the fence (which synchronises the event) is waited or dropped.
            let bytes = unsafe { std::slice::from_raw_parts(src, len) };
            // SAFETY: as above.
            unsafe { result::memcpy_htod_async(dst, bytes, stream.cu_stream()) }?;
            stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
        });
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(stream);
        let ev = ev?;
        let ctx = self.ctx.clone();
        Ok(crate::memory::Fence::new(move || {
            guard("cuEventSynchronize", || {
                ctx.bind_to_thread()?;
                ev.synchronize()
            })
        }))
    }
}
