//! A context and one stream on a device ([`GpuStream`]), the general
//! operations ordered on it (allocation, copies, memset, events, waits on
//! other events), and the events it records ([`GpuEvent`]). The relayout
//! kernels launch on such a stream (`relayout::gpu::GpuRelayout::stream`).

use super::driver::{driver_present, guard};
use super::memory::{check_device_range_in, check_range, DeviceBuffer, PinnedBuffer};
use crate::error::Result;
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};
use std::sync::Arc;

/// A CUDA event recorded on a [`GpuStream`] after some work.
pub struct GpuEvent {
    ev: CudaEvent,
}

impl GpuEvent {
    /// True once the work before the event has finished; never blocks.
    pub fn is_complete(&self) -> Result<bool> {
        guard("cuEventQuery", || self.ev.try_is_complete())
    }

    /// Blocks until the work before this event (only) has finished.
    pub fn wait(&self) -> Result<()> {
        guard("cuEventSynchronize", || self.ev.synchronize())
    }

    /// Milliseconds from `self` to `end` (both recorded with timing).
    pub fn elapsed_ms(&self, end: &GpuEvent) -> Result<f32> {
        guard("cuEventElapsedTime", || self.ev.elapsed_ms(&end.ev))
    }

    /// The raw `CUevent` handle (what a send's `cuda_event` takes); valid
    /// while this event lives.
    pub fn raw(&self) -> u64 {
        self.ev.cu_event() as u64
    }
}

/// The primary context of one device and one non-blocking stream on it.
/// Everything enqueued through it is ordered on that stream; its events say
/// when. Buffers it allocates keep the context alive on their own.
pub struct GpuStream {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl GpuStream {
    /// Opens device `ordinal`: its primary context and a non-blocking stream.
    pub fn new(ordinal: usize) -> Result<GpuStream> {
        driver_present()?;
        let ctx = guard("cuDevicePrimaryCtxRetain", || CudaContext::new(ordinal))?;
        // SAFETY: all work on this stream is ordered by the stream and its own
        // events; cudarc's per-slice event tracking is not used.
        unsafe { ctx.disable_event_tracking() };
        let stream = guard("cuStreamCreate", || ctx.new_stream())?;
        Ok(GpuStream { ctx, stream })
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Compute capability `(major, minor)` of the device.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        guard("cuDeviceGetAttribute(compute capability)", || {
            self.ctx.compute_capability()
        })
    }

    /// Device name.
    pub fn device_name(&self) -> Result<String> {
        guard("cuDeviceGetName", || self.ctx.name())
    }

    /// Raw `CUstream` of the stream (for NCCL on the same stream).
    pub fn raw(&self) -> u64 {
        self.stream.cu_stream() as u64
    }

    /// Makes the stream's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        guard("cuCtxSetCurrent", || self.ctx.bind_to_thread())
    }

    /// Allocates `len` bytes of device memory (uninitialised).
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        self.bind()?;
        // SAFETY: plain allocation in the bound context.
        let ptr = guard("cuMemAlloc", || unsafe { result::malloc_sync(len.max(1)) })?;
        Ok(DeviceBuffer {
            ctx: self.ctx.clone(),
            ptr,
            len,
        })
    }

    /// Copies `data` into `buf` at `offset`, ordered on the stream
    /// (later work on it sees them); returns once the host bytes have been taken.
    pub fn upload(&self, buf: &DeviceBuffer, offset: usize, data: &[u8]) -> Result<()> {
        check_range(buf, offset, data.len())?;
        self.bind()?;
        // SAFETY: the range was checked against the allocation; an async copy
        // from pageable memory has staged the host bytes when it returns.
        guard("cuMemcpyHtoDAsync", || unsafe {
            result::memcpy_htod_async(buf.ptr + offset as u64, data, self.stream.cu_stream())
        })
    }

    /// Copies `out.len()` bytes from `buf` at `offset` after all work enqueued
    /// on the stream (blocks; for checks and tests).
    pub fn download(&self, buf: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(buf, offset, out.len())?;
        self.bind()?;
        let stream = self.stream.cu_stream();
        // SAFETY: the range was checked; the stream is synchronised before the
        // host buffer is released.
        guard("cuMemcpyDtoHAsync", || unsafe {
            result::memcpy_dtoh_async(out, buf.ptr + offset as u64, stream)?;
            result::stream::synchronize(stream)
        })
    }

    /// Fills `buf` with `byte`, ordered on the stream.
    pub fn memset(&self, buf: &DeviceBuffer, byte: u8) -> Result<()> {
        self.bind()?;
        // SAFETY: the whole allocation.
        guard("cuMemsetD8Async", || unsafe {
            result::memset_d8_async(buf.ptr, byte, buf.len, self.stream.cu_stream())
        })
    }

    /// Enqueues a device-to-device copy of `len` bytes (the benchmark baseline).
    ///
    /// # Safety
    /// Both ranges must be valid device memory of this context.
    pub unsafe fn memcpy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees the ranges.
        guard("cuMemcpyDtoDAsync", || unsafe {
            result::memcpy_dtod_async(dst, src, len, self.stream.cu_stream())
        })
    }

    /// Records an event after the work enqueued so far; `timing` enables
    /// [`GpuEvent::elapsed_ms`].
    pub fn record(&self, timing: bool) -> Result<GpuEvent> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let ev = guard("cuEventRecord", || self.stream.record_event(Some(flags)))?;
        Ok(GpuEvent { ev })
    }

    /// Makes later work on the stream wait for `ev` (e.g. the end of
    /// the forward pass that wrote the KV rows). Does not block the host.
    pub fn wait_for(&self, ev: &GpuEvent) -> Result<()> {
        guard("cuStreamWaitEvent", || self.stream.wait(&ev.ev))
    }

    /// Makes later work on the stream wait for a CUDA event the
    /// caller recorded on its own stream (its raw `CUevent` handle), e.g. the
    /// end of the layer kernels that wrote the KV rows. Does not block the host.
    ///
    /// # Safety
    /// `event` must be a live `CUevent` of this device's context (recorded, or
    /// never recorded, which the driver treats as complete).
    pub unsafe fn wait_raw_event(&self, event: u64) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees the event; the stream is this value's own.
        guard("cuStreamWaitEvent", || unsafe {
            result::stream::wait_event(
                self.stream.cu_stream(),
                event as sys::CUevent,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        })
    }

    /// Allocates `len` bytes of page-locked host memory (`cuMemHostAlloc`).
    pub fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer> {
        self.bind()?;
        // SAFETY: plain allocation in the bound context; the bytes are uninitialised
        // (u8 has no invalid values).
        let ptr = guard("cuMemHostAlloc", || unsafe {
            result::malloc_host(len.max(1), 0)
        })?;
        Ok(PinnedBuffer {
            ctx: self.ctx.clone(),
            ptr: ptr as *mut u8,
            len,
        })
    }

    /// Checks that `[ptr, ptr + len)` is device memory of this stream's
    /// device, mapped throughout: one allocation, or contiguous VMM mappings
    /// walked chunk by chunk (`cuPointerGetAttribute`). Host memory or
    /// another device is `InvalidArgument`, a range running past mapped
    /// memory (or into another device's) `OutOfBounds`.
    pub fn check_device_range(&self, ptr: u64, len: u64) -> Result<()> {
        check_device_range_in(&self.ctx, ptr, len)
    }

    /// Enqueues a device-to-host copy of `len` bytes and returns its event.
    ///
    /// # Safety
    /// `src..src+len` must be device memory of this context and
    /// `dst..dst+len` host memory that nothing reads or frees before the
    /// event completes (asynchronous only when `dst` is pinned).
    pub unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<GpuEvent> {
        self.bind()?;
        let stream = self.stream.cu_stream();
        // SAFETY: the caller guarantees both ranges and the host buffer's life.
        guard("cuMemcpyDtoHAsync", || unsafe {
            let out = std::slice::from_raw_parts_mut(dst, len);
            result::memcpy_dtoh_async(out, src, stream)
        })?;
        self.record(false)
    }

    /// Blocks until all work enqueued on the stream so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        guard("cuStreamSynchronize", || self.stream.synchronize())
    }

    /// The cudarc context, for the kernel module of `relayout::gpu`.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The cudarc stream, for kernel launches on it.
    pub(crate) fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl std::fmt::Debug for GpuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuStream(device {})", self.ctx.ordinal())
    }
}

impl std::fmt::Debug for GpuEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GpuEvent")
    }
}
