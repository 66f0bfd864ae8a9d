//! The cudarc-backed part of [`super`]: contexts, streams, modules, launches.

use super::kernels::{self, ImageKind};
use super::no_driver;
use crate::error::{Error, Result, Status};
use crate::layout::{PackLayout, Run};
use crate::relayout::{
    gather_entries, launch_dims, rows_per_span, slice_gather_spans, split_spans, CopyEntry,
};
use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// Bytes one warp copies per span of the widest entry (load balance).
const SPAN_TARGET_BYTES: u64 = 16 * 1024;

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// `Ok` when libcuda can be loaded.
pub(super) fn driver_present() -> Result<()> {
    // SAFETY: is_culib_present only tries to dlopen the library and reports the result.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(no_driver())
    }
}

/// `cuDeviceGetPCIBusId` of device `ordinal`, lower-cased (sysfs spelling).
pub(super) fn pci_bus_id(ordinal: u32) -> Result<String> {
    guard("cuDeviceGetPCIBusId", || {
        result::init()?;
        let dev = result::device::get(ordinal as i32)?;
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: buf is writable for its length; the driver writes a NUL-terminated id.
        unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev).result()? };
        // SAFETY: the driver NUL-terminated the id inside buf (zeroed beforehand).
        let id = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
        Ok(id.to_string_lossy().to_ascii_lowercase())
    })
}

/// Runs one cudarc driver call: its error becomes [`Status::Cuda`], a panic
/// (missing library or symbol) [`Status::NoCudaDriver`].
pub(super) fn guard<T>(
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, DriverError>,
) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::new(Status::Cuda, format!("{what} failed: {e}"))),
        Err(p) => Err(Error::new(
            Status::NoCudaDriver,
            format!(
                "{what}: the CUDA driver library is unusable: {}",
                panic_text(&*p)
            ),
        )),
    }
}

/// `cuDriverGetVersion`: e.g. 12040 for a CUDA 12.4 driver.
pub(super) fn driver_version() -> Result<i32> {
    driver_present()?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: one out-pointer to a local.
    guard("cuDriverGetVersion", || unsafe {
        sys::cuDriverGetVersion(&mut v).result()
    })?;
    Ok(v)
}

/// Where the loaded kernels came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelOrigin {
    /// The file named by `$PDXFER_KERNEL_MODULE`.
    File(String),
    /// An image embedded at build time (PTX is JIT-compiled by the driver).
    Embedded {
        /// Cubin or PTX.
        kind: ImageKind,
        /// CUDA toolkit `(major, minor)` that compiled it.
        toolkit: (u32, u32),
        /// The compiler, as [`kernels::KernelImage::compiler`].
        compiler: &'static str,
    },
    /// NVRTC at run time: the architecture, and which NVRTC ("NVRTC 12.4 (path)").
    Nvrtc {
        /// The device's architecture (`sm_90`).
        arch: String,
        /// The NVRTC used.
        nvrtc: String,
    },
}

impl std::fmt::Display for KernelOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelOrigin::File(p) => write!(f, "PDXFER_KERNEL_MODULE {p}"),
            KernelOrigin::Embedded {
                kind,
                toolkit,
                compiler,
            } => {
                let kind = match kind {
                    ImageKind::Cubin => "cubin",
                    ImageKind::Ptx => "PTX",
                };
                write!(
                    f,
                    "embedded sm_90 {kind}, CUDA {}.{} ({compiler})",
                    toolkit.0, toolkit.1
                )
            }
            KernelOrigin::Nvrtc { arch, nvrtc } => write!(f, "{nvrtc} PTX for {arch}"),
        }
    }
}

/// A CUDA event recorded on the relayout stream after some work.
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

/// Device memory owned by this crate (pools in tests, staging buffers).
/// Its address and length are what transports register. Dropping it frees
/// the memory: keep it alive until the work that uses it has completed.
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: u64,
    len: usize,
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
    /// copy. It does not wait for the relayout stream: wait on the event of
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
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
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

/// One slice of [`GpuRelayout::gather_to_host`], handed to the sender once
/// its bytes are in place.
#[derive(Debug, Clone)]
pub struct HostSlice {
    /// Slice number, from 0.
    pub index: usize,
    /// Packed layout of the slice (entry-major, tokens `0..pack.tokens`).
    pub pack: PackLayout,
    /// Device address of the slice's pack block in the device staging buffer.
    pub device_addr: u64,
    /// Byte offset of the slice's pack block in the host buffer (when one was
    /// given; the bytes there are the device block's copy).
    pub host_offset: usize,
}

/// Relayout tables uploaded once ([`GpuRelayout::prepare`]). Keep it alive
/// until the event of its last launch has completed.
pub struct PreparedCopy {
    entries: u64,
    spans: u64,
    num_entries: u32,
    num_spans: u64,
    _tables: DeviceBuffer,
}

impl PreparedCopy {
    /// Spans after splitting (one warp each, per entry).
    pub fn num_spans(&self) -> u64 {
        self.num_spans
    }
}

/// One slice of a sliced gather, handed to the sender with its event.
#[derive(Debug, Clone)]
pub struct GatherSlice {
    /// Slice number, from 0.
    pub index: usize,
    /// First packed token of the slice within the whole pair.
    pub first_token: u64,
    /// Packed layout of the slice, at `base`.
    pub pack: PackLayout,
    /// Device address of the slice's pack block (one half of the staging buffer).
    pub base: u64,
}

/// A page-locked host buffer the relayout tables are copied from, and the
/// event after the last copy out of it: a table upload from pageable memory
/// may make the driver wait for the stream (it stages through pinned memory),
/// which would stall the host between slices.
#[derive(Default)]
struct TableStage {
    buf: Option<PinnedBuffer>,
    copied: Option<GpuEvent>,
}

/// The relayout engine of one device: context, stream, kernels, tables.
pub struct GpuRelayout {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    gather_fn: CudaFunction,
    scatter_fn: CudaFunction,
    /// `pdx_spin`, absent from a module built before it existed.
    spin_fn: Option<CudaFunction>,
    origin: KernelOrigin,
    cc: (i32, i32),
    driver: i32,
    tables: Option<DeviceBuffer>,
    retired: Vec<(DeviceBuffer, GpuEvent)>,
    staging: [TableStage; 2],
    next_stage: usize,
    spans_per_warp: u32,
}

impl Drop for GpuRelayout {
    fn drop(&mut self) {
        // Enqueued kernels may still read the tables: let them finish before
        // the buffers are freed. Errors cannot be reported from Drop.
        let _ = catch_unwind(AssertUnwindSafe(|| self.stream.synchronize()));
    }
}

impl GpuRelayout {
    /// Opens device `ordinal`: primary context, a non-blocking stream, kernels.
    pub fn new(ordinal: usize) -> Result<GpuRelayout> {
        driver_present()?;
        let ctx = guard("cuDevicePrimaryCtxRetain", || CudaContext::new(ordinal))?;
        // SAFETY: all work of this engine is ordered on its own stream and events;
        // cudarc's per-slice event tracking is not used.
        unsafe { ctx.disable_event_tracking() };
        let stream = guard("cuStreamCreate", || ctx.new_stream())?;
        let cc = guard("cuDeviceGetAttribute(compute capability)", || {
            ctx.compute_capability()
        })?;
        let driver = driver_version()?;
        let (module, origin) = load_module(&ctx, cc, driver)?;
        let gather_fn = guard("cuModuleGetFunction(pdx_gather)", || {
            module.load_function("pdx_gather")
        })?;
        let scatter_fn = guard("cuModuleGetFunction(pdx_scatter)", || {
            module.load_function("pdx_scatter")
        })?;
        let spin_fn = module.load_function("pdx_spin").ok();
        Ok(GpuRelayout {
            ctx,
            stream,
            gather_fn,
            scatter_fn,
            spin_fn,
            origin,
            cc,
            driver,
            tables: None,
            retired: Vec::new(),
            staging: [TableStage::default(), TableStage::default()],
            next_stage: 0,
            spans_per_warp: crate::relayout::DEFAULT_SPANS_PER_WARP,
        })
    }

    /// Sets how many spans each warp copies per entry (launch shape only;
    /// results are the same). `scripts/gpu-check.sh` measures the choices.
    pub fn set_spans_per_warp(&mut self, n: u32) {
        self.spans_per_warp = n.max(1);
    }

    /// Spans each warp copies per entry.
    pub fn spans_per_warp(&self) -> u32 {
        self.spans_per_warp
    }

    /// Where the kernels came from.
    pub fn kernel_origin(&self) -> &KernelOrigin {
        &self.origin
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// The driver's CUDA version (`cuDriverGetVersion`, e.g. 12040), which
    /// chose the kernel image.
    pub fn driver_version(&self) -> i32 {
        self.driver
    }

    /// Device name.
    pub fn device_name(&self) -> Result<String> {
        guard("cuDeviceGetName", || self.ctx.name())
    }

    /// Raw `CUstream` of the relayout stream (for NCCL on the same stream).
    pub fn stream_handle(&self) -> u64 {
        self.stream.cu_stream() as u64
    }

    fn bind(&self) -> Result<()> {
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

    /// Copies `data` into `buf` at `offset`, ordered on the relayout stream
    /// (later launches see it); returns once the host bytes have been taken.
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
    /// on the relayout stream (blocks; for checks and tests).
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

    /// Enqueues `pdx_spin`: one thread busy for `ns` nanoseconds of the GPU's
    /// global timer (a synthetic layer's compute in the layer-wise benchmark).
    pub fn spin(&self, ns: u64) -> Result<()> {
        let f = self.spin_fn.as_ref().ok_or_else(|| {
            Error::invalid(
                "the loaded kernel module has no pdx_spin (built from an older cuda/relayout.cu)",
            )
        })?;
        self.bind()?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&ns);
        // SAFETY: the argument list matches `pdx_spin(pdx_u64)` in cuda/relayout.cu;
        // it touches no memory.
        guard("cuLaunchKernel(pdx_spin)", || unsafe { b.launch(cfg) }).map(|_| ())
    }

    /// Makes later work on the relayout stream wait for `ev` (e.g. the end of
    /// the forward pass that wrote the KV rows). Does not block the host.
    pub fn wait_for(&self, ev: &GpuEvent) -> Result<()> {
        guard("cuStreamWaitEvent", || self.stream.wait(&ev.ev))
    }

    /// Makes later work on the relayout stream wait for a CUDA event the
    /// caller recorded on its own stream (its raw `CUevent` handle), e.g. the
    /// end of the layer kernels that wrote the KV rows. Does not block the host.
    ///
    /// # Safety
    /// `event` must be a live `CUevent` of this device's context (recorded, or
    /// never recorded, which the driver treats as complete).
    pub unsafe fn wait_raw_event(&self, event: u64) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees the event; the stream is this engine's own.
        guard("cuStreamWaitEvent", || unsafe {
            result::stream::wait_event(
                self.stream.cu_stream(),
                event as sys::CUevent,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        })
    }

    /// Ensures the table buffer holds at least `bytes`, without waiting: a
    /// buffer that is too small retires with an event recorded after its last
    /// use, and is freed once that event has completed.
    fn tables(&mut self, bytes: usize) -> Result<u64> {
        self.retired
            .retain(|(_, ev)| !matches!(ev.is_complete(), Ok(true)));
        if self.tables.as_ref().is_none_or(|t| t.len < bytes) {
            if let Some(old) = self.tables.take() {
                let ev = self.record(false)?;
                self.retired.push((old, ev));
            }
            self.tables = Some(self.alloc(bytes.next_power_of_two().max(4096))?);
        }
        Ok(self.tables.as_ref().map_or(0, |t| t.ptr))
    }

    /// Uploads `entries` and `spans` to the table buffer, stream-ordered,
    /// through one of two pinned staging buffers (used in turn, each
    /// rewritten only after the event of its previous copy: in the slice
    /// pipeline that copy belongs to a slice already waited on, so this does
    /// not block). Falls back to a copy from pageable memory when pinned
    /// memory cannot be had. Returns the device addresses of the two tables.
    fn upload_tables(&mut self, entries: &[CopyEntry], spans: &[Run]) -> Result<(u64, u64)> {
        let eb = std::mem::size_of_val(entries);
        let sb = std::mem::size_of_val(spans);
        let base = self.tables(eb + sb)?;
        self.bind()?;
        let stream = self.stream.cu_stream();
        let slot = self.next_stage;
        self.next_stage ^= 1;
        if let Some(ev) = self.staging[slot].copied.take() {
            ev.wait()?;
        }
        if self.staging[slot]
            .buf
            .as_ref()
            .is_none_or(|b| b.len < eb + sb)
        {
            self.staging[slot].buf = None;
            match self.alloc_pinned((eb + sb).next_power_of_two().max(4096)) {
                Ok(b) => self.staging[slot].buf = Some(b),
                Err(e) => log::debug!("relayout tables from pageable memory: {e}"),
            }
        }
        let Some(stage) = self.staging[slot].buf.as_ref() else {
            // SAFETY: both copies fit in the table buffer (sized above); the host
            // slices outlive the calls, and async copies from pageable memory have
            // taken the bytes when they return.
            guard("cuMemcpyHtoDAsync(tables)", || unsafe {
                result::memcpy_htod_async(base, entries, stream)?;
                result::memcpy_htod_async(base + eb as u64, spans, stream)
            })?;
            return Ok((base, base + eb as u64));
        };
        // SAFETY: the staging buffer holds eb + sb bytes (sized above) and no
        // copy reads it any more (its last copy's event was waited above); the
        // sources are plain-old-data tables of those sizes.
        let bytes = unsafe {
            std::ptr::copy_nonoverlapping(entries.as_ptr() as *const u8, stage.ptr, eb);
            std::ptr::copy_nonoverlapping(spans.as_ptr() as *const u8, stage.ptr.add(eb), sb);
            std::slice::from_raw_parts(stage.ptr as *const u8, eb + sb)
        };
        // SAFETY: the copy fits in the table buffer; the pinned source stays
        // untouched until the event recorded below has completed.
        guard("cuMemcpyHtoDAsync(tables)", || unsafe {
            result::memcpy_htod_async(base, bytes, stream)
        })?;
        self.staging[slot].copied = Some(self.record(false)?);
        Ok((base, base + eb as u64))
    }

    fn launch(
        &self,
        f: &CudaFunction,
        entries: u64,
        num_entries: u32,
        spans: u64,
        num_spans: u64,
    ) -> Result<()> {
        if num_entries == 0 || num_spans == 0 {
            return Ok(());
        }
        let (gx, gy, bx) = launch_dims(num_spans, num_entries, self.spans_per_warp);
        let cfg = LaunchConfig {
            grid_dim: (gx, gy, 1),
            block_dim: (bx, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&entries)
            .arg(&num_entries)
            .arg(&spans)
            .arg(&num_spans);
        // SAFETY: the argument list matches the kernel signature in cuda/relayout.cu;
        // the caller of gather/scatter guarantees the addresses.
        guard("cuLaunchKernel", || unsafe { b.launch(cfg) }).map(|_| ())
    }

    /// Uploads the tables of a gather or scatter once, for repeated launches
    /// with [`launch_prepared`](Self::launch_prepared) (a plan reused across
    /// steps, or a benchmark of the kernel alone). Spans are split as for
    /// [`gather`](Self::gather).
    pub fn prepare(&self, entries: &[CopyEntry], spans: &[Run]) -> Result<PreparedCopy> {
        let rows: Vec<u64> = entries.iter().map(|e| e.row_bytes).collect();
        let spans = split_spans(spans, rows_per_span(&rows, SPAN_TARGET_BYTES));
        let num_entries = u32::try_from(entries.len())
            .map_err(|_| Error::invalid("more than u32::MAX relayout entries"))?;
        let eb = std::mem::size_of_val(entries);
        let tables = self.alloc(eb + std::mem::size_of_val(spans.as_slice()))?;
        let stream = self.stream.cu_stream();
        // SAFETY: both copies fit in `tables`, sized for them above.
        guard("cuMemcpyHtoDAsync(tables)", || unsafe {
            result::memcpy_htod_async(tables.ptr, entries, stream)?;
            result::memcpy_htod_async(tables.ptr + eb as u64, spans.as_slice(), stream)
        })?;
        Ok(PreparedCopy {
            entries: tables.ptr,
            spans: tables.ptr + eb as u64,
            num_entries,
            num_spans: spans.len() as u64,
            _tables: tables,
        })
    }

    /// Launches a prepared gather (`scatter` false) or scatter and returns
    /// its event.
    ///
    /// # Safety
    /// As for [`gather`](Self::gather), for the tables `p` was prepared from.
    pub unsafe fn launch_prepared(&self, p: &PreparedCopy, scatter: bool) -> Result<GpuEvent> {
        let f = if scatter {
            &self.scatter_fn
        } else {
            &self.gather_fn
        };
        self.launch(f, p.entries, p.num_entries, p.spans, p.num_spans)?;
        self.record(false)
    }

    fn copy(&mut self, scatter: bool, entries: &[CopyEntry], spans: &[Run]) -> Result<GpuEvent> {
        let rows: Vec<u64> = entries.iter().map(|e| e.row_bytes).collect();
        let spans = split_spans(spans, rows_per_span(&rows, SPAN_TARGET_BYTES));
        let n = u32::try_from(entries.len())
            .map_err(|_| Error::invalid("more than u32::MAX relayout entries"))?;
        let (ep, sp) = self.upload_tables(entries, &spans)?;
        let f = if scatter {
            self.scatter_fn.clone()
        } else {
            self.gather_fn.clone()
        };
        self.launch(&f, ep, n, sp, spans.len() as u64)?;
        self.record(false)
    }

    /// Enqueues a gather (pool rows to packed indices) and returns its event.
    ///
    /// # Safety
    /// Every entry's rows touched by `spans` must be valid device memory of
    /// this context, destinations disjoint from sources and from each other,
    /// and all of it must stay allocated until the event completes.
    pub unsafe fn gather(&mut self, entries: &[CopyEntry], spans: &[Run]) -> Result<GpuEvent> {
        self.copy(false, entries, spans)
    }

    /// Enqueues a scatter (packed indices to pool rows) and returns its event.
    ///
    /// # Safety
    /// As for [`gather`](Self::gather).
    pub unsafe fn scatter(&mut self, entries: &[CopyEntry], spans: &[Run]) -> Result<GpuEvent> {
        self.copy(true, entries, spans)
    }

    /// Gathers a pair's tokens through `staging` in slices, overlapping the
    /// gather of slice `i+1` (into one half of `staging`) with `send` of
    /// slice `i` (from the other). `send` gets the slice and its event, must
    /// wait on the event before reading, and must return only when the slice's
    /// half may be overwritten. Stops at the first error.
    ///
    /// # Safety
    /// `pool_bases` must be device addresses of this context holding every row
    /// that `spans` (pool row -> packed index, see `relayout::gather_spans`)
    /// names, for entries of `row_bytes`.
    pub unsafe fn gather_sliced(
        &mut self,
        pool_bases: &[u64],
        row_bytes: &[u64],
        spans: &[Run],
        staging: &DeviceBuffer,
        mut send: impl FnMut(&GatherSlice, &GpuEvent) -> Result<()>,
    ) -> Result<()> {
        let half = (staging.len / 2) as u64;
        let per_slice = crate::layout::pack_slice_tokens(half, row_bytes);
        if per_slice == 0 {
            return Err(Error::new(
                Status::Relayout,
                format!(
                    "staging buffer of {} B cannot hold one token per half ({} B per token)",
                    staging.len,
                    row_bytes.iter().sum::<u64>()
                ),
            ));
        }
        let slices = slice_gather_spans(spans, per_slice);
        // One upload of every slice's tables, then launches at offsets.
        let mut all_entries = Vec::new();
        let mut all_spans = Vec::new();
        let mut meta = Vec::with_capacity(slices.len());
        for (i, (first, tokens, s)) in slices.iter().enumerate() {
            let pack = PackLayout::new(*tokens, row_bytes)?;
            let base = staging.ptr + (i as u64 % 2) * half;
            let s = split_spans(s, rows_per_span(row_bytes, SPAN_TARGET_BYTES));
            meta.push((
                GatherSlice {
                    index: i,
                    first_token: *first,
                    pack: pack.clone(),
                    base,
                },
                all_entries.len(),
                all_spans.len(),
                s.len(),
            ));
            all_entries.extend(gather_entries(pool_bases, row_bytes, base, &pack)?);
            all_spans.extend(s);
        }
        let (ep, sp) = self.upload_tables(&all_entries, &all_spans)?;
        let ne = row_bytes.len() as u32;
        let ent = std::mem::size_of::<CopyEntry>() as u64;
        let run = std::mem::size_of::<Run>() as u64;
        let f = self.gather_fn.clone();
        let launch = |me: &Self, m: &(GatherSlice, usize, usize, usize)| -> Result<GpuEvent> {
            me.launch(
                &f,
                ep + m.1 as u64 * ent,
                ne,
                sp + m.2 as u64 * run,
                m.3 as u64,
            )?;
            me.record(false)
        };
        let mut next = match meta.first() {
            Some(m) => Some(launch(self, m)?),
            None => return Ok(()),
        };
        for i in 0..meta.len() {
            let ev = next
                .take()
                .ok_or_else(|| Error::new(Status::Relayout, "missing slice event"))?;
            if let Some(m) = meta.get(i + 1) {
                next = Some(launch(self, m)?);
            }
            send(&meta[i].0, &ev)?;
        }
        Ok(())
    }
}

/// [`GpuRelayout::check_device_range`] in context `ctx`.
///
/// The range may span several mappings: CUDA VMM memory (PyTorch's
/// `expandable_segments`, memory-saver allocators) is one VA range backed by
/// many `cuMemCreate` chunks, and `CU_POINTER_ATTRIBUTE_RANGE_*` covers only
/// the chunk holding the address. So the check walks from `ptr` chunk by
/// chunk to `ptr + len`, and requires each to be mapped device memory of
/// this device, each starting where the previous one ended.
fn check_device_range_in(ctx: &Arc<CudaContext>, ptr: u64, len: u64) -> Result<()> {
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
    /// (as [`GpuRelayout::check_device_range`]).
    pub fn check_device_range(&self, ptr: u64, len: u64) -> Result<()> {
        check_device_range_in(&self.ctx, ptr, len)
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

impl GpuRelayout {
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

    /// Checks that `[ptr, ptr + len)` is device memory of this relayout's
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

    /// Gathers a pair's tokens slice by slice into `device` staging (two
    /// halves, slice `i` in half `i % 2`), copies each slice to the same half
    /// of `host` when one is given, and calls `send` for slice `i` once its
    /// bytes are in place (it waits on the slice's event, never on the whole
    /// stream). The gather and copy of slice `i+1` are enqueued before `send`
    /// of slice `i`, so they overlap its transfer; `send` must return only
    /// when the slice's half may be overwritten.
    ///
    /// `slices[i]` are the spans of slice `i` (pool row -> packed index,
    /// indices `0..n_i` of the slice, as `relayout::gather_spans` of a
    /// sub-request). Without `host` the slices stay on the device: the seam
    /// for a transport that sends device memory itself (GPUDirect RDMA).
    /// Stops at the first error, after the enqueued work has finished.
    ///
    /// # Safety
    /// `pool_bases` must be device addresses of this context holding every
    /// row the spans name, for entries of `row_bytes`.
    pub unsafe fn gather_to_host(
        &mut self,
        pool_bases: &[u64],
        row_bytes: &[u64],
        slices: &[Vec<Run>],
        device: &DeviceBuffer,
        host: Option<&PinnedBuffer>,
        mut send: impl FnMut(&HostSlice) -> Result<()>,
    ) -> Result<()> {
        let half = host.map_or(device.len, |h| h.len.min(device.len)) / 2;
        let mut plan = Vec::with_capacity(slices.len());
        for (i, spans) in slices.iter().enumerate() {
            let n: u64 = spans.iter().map(|s| s.len).sum();
            let pack = PackLayout::new(n, row_bytes)?;
            if pack.total_bytes > half as u64 {
                return Err(Error::new(
                    Status::Relayout,
                    format!(
                        "slice {i} packs {} B; the staging halves hold {half} B",
                        pack.total_bytes
                    ),
                ));
            }
            plan.push(HostSlice {
                index: i,
                pack,
                device_addr: device.ptr + (i % 2 * half) as u64,
                host_offset: i % 2 * half,
            });
        }
        let enqueue = |me: &mut Self, i: usize| -> Result<GpuEvent> {
            let s = &plan[i];
            let ents = gather_entries(pool_bases, row_bytes, s.device_addr, &s.pack)?;
            let ev = me.copy(false, &ents, &slices[i])?;
            match host {
                // SAFETY: the host half holds the slice (checked above); it is
                // read by `send` only after this event, and rewritten only by a
                // copy enqueued after `send` of the slice two back returned.
                Some(h) => unsafe {
                    me.copy_to_host(
                        h.ptr.add(s.host_offset),
                        s.device_addr,
                        s.pack.total_bytes as usize,
                    )
                },
                None => Ok(ev),
            }
        };
        let mut next = match plan.first() {
            Some(_) => Some(enqueue(self, 0)?),
            None => return Ok(()),
        };
        for i in 0..plan.len() {
            let ev = next
                .take()
                .ok_or_else(|| Error::new(Status::Relayout, "missing slice event"))?;
            let r = (|| {
                if i + 1 < plan.len() {
                    next = Some(enqueue(self, i + 1)?);
                }
                ev.wait()?;
                send(&plan[i])
            })();
            if let Err(e) = r {
                // leave nothing in flight that writes the buffers
                if let Some(n) = next.take() {
                    let _ = n.wait();
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

fn check_range(buf: &DeviceBuffer, offset: usize, len: usize) -> Result<()> {
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

/// Loads the kernel module, trying each source in turn (see the module
/// docs); the error lists every source tried or left out, and why.
fn load_module(
    ctx: &Arc<CudaContext>,
    cc: (i32, i32),
    driver: i32,
) -> Result<(Arc<cudarc::driver::CudaModule>, KernelOrigin)> {
    let mut tried: Vec<String> = Vec::new();
    let attempt = |tried: &mut Vec<String>,
                   ptx: Ptx,
                   what: &str|
     -> Option<Arc<cudarc::driver::CudaModule>> {
        match guard("cuModuleLoadData", || ctx.load_module(ptx)) {
            Ok(m) => Some(m),
            Err(e) => {
                tried.push(format!("{what}: {}", e.detail()));
                None
            }
        }
    };
    if let Some(path) = std::env::var_os("PDXFER_KERNEL_MODULE") {
        let p = std::path::PathBuf::from(&path);
        match std::fs::read(&p) {
            Ok(bytes) => {
                let ptx = if bytes.starts_with(b"\x7fELF") {
                    Ptx::from_binary(bytes)
                } else {
                    Ptx::from_src(String::from_utf8_lossy(&bytes).into_owned())
                };
                if let Some(m) = attempt(&mut tried, ptx, "PDXFER_KERNEL_MODULE") {
                    return Ok((m, KernelOrigin::File(p.display().to_string())));
                }
            }
            Err(e) => tried.push(format!("PDXFER_KERNEL_MODULE {}: {e}", p.display())),
        }
    }
    let (images, skipped) = kernels::plan(kernels::IMAGES, driver, cc);
    tried.extend(skipped);
    for img in images {
        let ptx = match img.kind {
            ImageKind::Cubin => Ptx::from_binary(img.bytes.to_vec()),
            ImageKind::Ptx => Ptx::from_src(String::from_utf8_lossy(img.bytes).into_owned()),
        };
        if let Some(m) = attempt(&mut tried, ptx, &img.describe()) {
            return Ok((
                m,
                KernelOrigin::Embedded {
                    kind: img.kind,
                    toolkit: img.toolkit,
                    compiler: img.compiler,
                },
            ));
        }
    }
    let arch = format!("sm_{}{}", cc.0, cc.1);
    match super::nvrtc_compile_for_driver(&arch, driver) {
        Ok((ptx, nvrtc)) => {
            if let Some(m) = attempt(&mut tried, Ptx::from_src(ptx), &format!("{nvrtc} PTX")) {
                return Ok((m, KernelOrigin::Nvrtc { arch, nvrtc }));
            }
        }
        Err(e) => tried.push(format!("NVRTC: {}", e.detail())),
    }
    Err(Error::new(
        Status::Cuda,
        format!(
            "no usable relayout kernels for {arch} on driver CUDA {}; tried: {}",
            kernels::version_text(driver),
            tried.join("; ")
        ),
    ))
}

impl std::fmt::Debug for GpuRelayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRelayout")
            .field("ordinal", &self.ctx.ordinal())
            .field("compute_capability", &self.cc)
            .field("driver", &self.driver)
            .field("origin", &self.origin)
            .finish()
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} B)", self.ptr, self.len)
    }
}

impl std::fmt::Debug for GpuEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GpuEvent")
    }
}
