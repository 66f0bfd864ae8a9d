//! [`GpuRelayout`]: the relayout kernels of one device (`pdx_gather`,
//! `pdx_scatter`, `pdx_spin` from `cuda/relayout.cu`), their module, their
//! tables and their launches, on a [`GpuStream`] of the `cuda` layer.

use super::kernels::{self, ImageKind};
use crate::cuda::{
    driver_version, guard, version_text, DeviceBuffer, GpuEvent, GpuStream, PinnedBuffer,
};
use crate::error::{Error, Result, Status};
use crate::layout::{PackLayout, Run};
use crate::relayout::{
    gather_entries, launch_dims, rows_per_span, slice_gather_spans, split_spans, CopyEntry,
};
use cudarc::driver::{result, CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use std::sync::Arc;

/// Bytes one warp copies per span of the widest entry (load balance).
const SPAN_TARGET_BYTES: u64 = 16 * 1024;

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
    /// NVRTC at run time: the image kind, the architecture, and which NVRTC
    /// ("NVRTC 12.4 (path)").
    Nvrtc {
        /// Cubin (preferred) or PTX.
        kind: ImageKind,
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
            KernelOrigin::Nvrtc { kind, arch, nvrtc } => {
                let kind = match kind {
                    ImageKind::Cubin => "cubin",
                    ImageKind::Ptx => "PTX",
                };
                write!(f, "{nvrtc} {kind} for {arch}")
            }
        }
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

/// The relayout engine of one device: the kernels, their tables, and the
/// [`GpuStream`] they launch on ([`stream`](Self::stream): allocations,
/// copies and events ordered with the launches).
pub struct GpuRelayout {
    stream: GpuStream,
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
        let _ = self.stream.synchronize();
    }
}

impl GpuRelayout {
    /// Opens device `ordinal`: primary context, a non-blocking stream, kernels.
    pub fn new(ordinal: usize) -> Result<GpuRelayout> {
        let stream = GpuStream::new(ordinal)?;
        let cc = stream.compute_capability()?;
        let driver = driver_version()?;
        let (module, origin) = load_module(stream.context(), cc, driver)?;
        let gather_fn = guard("cuModuleGetFunction(pdx_gather)", || {
            module.load_function("pdx_gather")
        })?;
        let scatter_fn = guard("cuModuleGetFunction(pdx_scatter)", || {
            module.load_function("pdx_scatter")
        })?;
        let spin_fn = module.load_function("pdx_spin").ok();
        Ok(GpuRelayout {
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

    /// The stream the kernels launch on: allocations, uploads, downloads,
    /// events and waits ordered with the launches.
    pub fn stream(&self) -> &GpuStream {
        &self.stream
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

    /// Enqueues `pdx_spin`: one thread busy for `ns` nanoseconds of the GPU's
    /// global timer (a synthetic layer's compute in the layer-wise benchmark).
    pub fn spin(&self, ns: u64) -> Result<()> {
        let f = self.spin_fn.as_ref().ok_or_else(|| {
            Error::invalid(
                "the loaded kernel module has no pdx_spin (built from an older cuda/relayout.cu)",
            )
        })?;
        self.stream.bind()?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.cuda_stream().launch_builder(f);
        b.arg(&ns);
        // SAFETY: the argument list matches `pdx_spin(pdx_u64)` in cuda/relayout.cu;
        // it touches no memory.
        guard("cuLaunchKernel(pdx_spin)", || unsafe { b.launch(cfg) }).map(|_| ())
    }

    /// Ensures the table buffer holds at least `bytes`, without waiting: a
    /// buffer that is too small retires with an event recorded after its last
    /// use, and is freed once that event has completed.
    fn tables(&mut self, bytes: usize) -> Result<u64> {
        self.retired
            .retain(|(_, ev)| !matches!(ev.is_complete(), Ok(true)));
        if self.tables.as_ref().is_none_or(|t| t.len() < bytes) {
            if let Some(old) = self.tables.take() {
                let ev = self.stream.record(false)?;
                self.retired.push((old, ev));
            }
            self.tables = Some(self.stream.alloc(bytes.next_power_of_two().max(4096))?);
        }
        Ok(self.tables.as_ref().map_or(0, |t| t.ptr()))
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
        self.stream.bind()?;
        let stream = self.stream.cuda_stream().cu_stream();
        let slot = self.next_stage;
        self.next_stage ^= 1;
        if let Some(ev) = self.staging[slot].copied.take() {
            ev.wait()?;
        }
        if self.staging[slot]
            .buf
            .as_ref()
            .is_none_or(|b| b.len() < eb + sb)
        {
            self.staging[slot].buf = None;
            match self
                .stream
                .alloc_pinned((eb + sb).next_power_of_two().max(4096))
            {
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
            std::ptr::copy_nonoverlapping(entries.as_ptr() as *const u8, stage.as_ptr(), eb);
            std::ptr::copy_nonoverlapping(spans.as_ptr() as *const u8, stage.as_ptr().add(eb), sb);
            std::slice::from_raw_parts(stage.as_ptr() as *const u8, eb + sb)
        };
        // SAFETY: the copy fits in the table buffer; the pinned source stays
        // untouched until the event recorded below has completed.
        guard("cuMemcpyHtoDAsync(tables)", || unsafe {
            result::memcpy_htod_async(base, bytes, stream)
        })?;
        self.staging[slot].copied = Some(self.stream.record(false)?);
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
        let mut b = self.stream.cuda_stream().launch_builder(f);
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
        let tables = self
            .stream
            .alloc(eb + std::mem::size_of_val(spans.as_slice()))?;
        let stream = self.stream.cuda_stream().cu_stream();
        // SAFETY: both copies fit in `tables`, sized for them above.
        guard("cuMemcpyHtoDAsync(tables)", || unsafe {
            result::memcpy_htod_async(tables.ptr(), entries, stream)?;
            result::memcpy_htod_async(tables.ptr() + eb as u64, spans.as_slice(), stream)
        })?;
        Ok(PreparedCopy {
            entries: tables.ptr(),
            spans: tables.ptr() + eb as u64,
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
        self.stream.record(false)
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
        self.stream.record(false)
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
        let half = (staging.len() / 2) as u64;
        let per_slice = crate::layout::pack_slice_tokens(half, row_bytes);
        if per_slice == 0 {
            return Err(Error::new(
                Status::Relayout,
                format!(
                    "staging buffer of {} B cannot hold one token per half ({} B per token)",
                    staging.len(),
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
            let base = staging.ptr() + (i as u64 % 2) * half;
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
            me.stream.record(false)
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

impl GpuRelayout {
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
        let half = host.map_or(device.len(), |h| h.len().min(device.len())) / 2;
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
                device_addr: device.ptr() + (i % 2 * half) as u64,
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
                    me.stream.copy_to_host(
                        h.as_ptr().add(s.host_offset),
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
    match super::nvrtc_cubin_for_driver(&arch, driver) {
        Ok((cubin, nvrtc)) => {
            let what = format!("{nvrtc} cubin");
            if let Some(m) = attempt(&mut tried, Ptx::from_binary(cubin), &what) {
                let kind = ImageKind::Cubin;
                return Ok((m, KernelOrigin::Nvrtc { kind, arch, nvrtc }));
            }
        }
        Err(e) => tried.push(format!("NVRTC cubin: {}", e.detail())),
    }
    match super::nvrtc_compile_for_driver(&arch, driver) {
        Ok((ptx, nvrtc)) => {
            if let Some(m) = attempt(&mut tried, Ptx::from_src(ptx), &format!("{nvrtc} PTX")) {
                let kind = ImageKind::Ptx;
                return Ok((m, KernelOrigin::Nvrtc { kind, arch, nvrtc }));
            }
        }
        Err(e) => tried.push(format!("NVRTC PTX: {}", e.detail())),
    }
    Err(Error::new(
        Status::Cuda,
        format!(
            "no usable relayout kernels for {arch} on driver CUDA {}; tried: {}",
            version_text(driver),
            tried.join("; ")
        ),
    ))
}

impl std::fmt::Debug for GpuRelayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRelayout")
            .field("ordinal", &self.stream.ordinal())
            .field("compute_capability", &self.cc)
            .field("driver", &self.driver)
            .field("origin", &self.origin)
            .finish()
    }
}
