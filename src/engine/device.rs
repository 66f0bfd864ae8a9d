//! KV pools in CUDA device memory (`EngineConfig::pool_device`).
//!
//! Prefill: each transfer worker owns a [`DeviceStage`]: a relayout engine
//! (its own context binding, stream and kernels), a device staging buffer and
//! a pinned host staging buffer of `staging_bytes` each, both used as two
//! halves. A pair's packed rows are gathered on the GPU (entry-major, the
//! same pack layout as the CPU path) into a device half, and then either
//!
//! * written straight from the device half (zero copy): when the link to the
//!   decode rank is rdma and the NIC can register device memory (GPUDirect
//!   RDMA); the device staging buffer is registered with the agent as a
//!   device region ([`DeviceStage::device_region`]) and its bytes never
//!   touch host memory; or
//! * copied device-to-host into the pinned half and written from there:
//!   over cma and tcp (which reach host memory only), and over rdma when the
//!   NIC has no GPUDirect RDMA (its provider says so up front, or it refuses
//!   the device staging region with `NoGpuDirect` on the first batch: that
//!   link then stays on this path, logged once).
//!
//! Either way the gather (and copy) of slice `i+1` runs while slice `i` is
//! on the wire, ordered by events (`GpuRelayout::gather_to_host`), and no
//! batch asks for a checksum (the CPU cannot read device memory).
//!
//! Decode: the pools are registered as device regions. Over tcp the
//! receiver reads each piece into a bounded host bounce buffer and copies it
//! into the pools with a [`HostToDevice`](crate::cuda::HostToDevice) writer (an
//! asynchronous host-to-device copy waited on before the piece counts), so a
//! completion is delivered only once every byte is in device memory. Over
//! rdma the NIC writes the pools itself (GPUDirect RDMA, where the NIC can).
//! cma cannot reach device memory: an explicit cma decode is refused at
//! creation, and `auto` never picks cma for a peer with device regions.

use crate::bootstrap::schema::Role;
use crate::error::{Error, Result, Status};
use crate::layout::Run;
use crate::memory::Registry;
use crate::transport::TransportKind;

use super::config::EngineConfig;
use super::state::Shared;
use crate::transport::Transport;
use std::sync::atomic::Ordering;

/// Checks a device-pool configuration before anything is opened: role,
/// staging size, build, and the driver (typed `no_cuda_driver` without one).
pub(super) fn preflight(cfg: &EngineConfig, ordinal: u32) -> Result<()> {
    if cfg.role == Role::Decode && cfg.transport == TransportKind::Cma {
        return Err(Error::new(
            Status::Unsupported,
            format!(
                "decode KV pools in CUDA device memory (device {ordinal}) cannot be written over cma: process_vm_writev reaches host memory only. Use tcp (the receiver copies into the pools), rdma (GPUDirect) or auto (which never picks cma for a decode with device pools), or host-memory pools"
            ),
        ));
    }
    if cfg.transport == TransportKind::Local {
        return Err(Error::new(
            Status::Unsupported,
            "device-memory pools need the cma, tcp or rdma transport (the local transport has no staging)",
        ));
    }
    let token_bytes: u64 = cfg.topology.entries.iter().map(|e| e.row_bytes).sum();
    if cfg.role == Role::Prefill && cfg.staging_bytes / 2 < token_bytes.max(1) {
        return Err(Error::invalid(format!(
            "device-memory pools are sent through staging buffers: staging_bytes={} must hold at least two tokens ({} B each); the default is 64 MiB",
            cfg.staging_bytes, token_bytes
        )));
    }
    if !cfg!(feature = "cuda") {
        return Err(Error::new(
            Status::Unsupported,
            "device-memory pools need pdxfer built with the `cuda` feature",
        ));
    }
    crate::cuda::probe().map(|_| ())
}

/// Decode: checks every pool `(base, len)` against the driver (device memory
/// of `ordinal`, inside one allocation) and returns the host-to-device copier
/// the tcp receiver lands the pools' bytes through.
#[cfg(feature = "cuda")]
pub(super) fn decode_writer(
    ordinal: u32,
    pools: &[(u64, u64)],
) -> Result<std::sync::Arc<dyn crate::memory::DeviceWriter>> {
    let w = crate::cuda::HostToDevice::new(ordinal as usize)?;
    for (i, &(base, len)) in pools.iter().enumerate() {
        w.check_device_range(base, len)
            .map_err(|e| Error::new(e.status(), format!("KV pool {i}: {}", e.detail())))?;
    }
    Ok(std::sync::Arc::new(w))
}

/// Without the `cuda` feature there are no device pools.
#[cfg(not(feature = "cuda"))]
pub(super) fn decode_writer(
    _ordinal: u32,
    _pools: &[(u64, u64)],
) -> Result<std::sync::Arc<dyn crate::memory::DeviceWriter>> {
    Err(Error::new(
        Status::Unsupported,
        "device-memory pools need pdxfer built with the `cuda` feature",
    ))
}

/// Decode device pools: whether peers may write them by GPUDirect RDMA,
/// decided from the device's writes-ordering attribute
/// ([`RdmaWriteFlush`](crate::cuda::RdmaWriteFlush)) wherever rdma
/// could reach them (transport rdma, or a NIC with GPUDirect RDMA): the
/// agent flushes before it delivers each GPUDirect batch where the device
/// does not order the NIC's writes. Where the device can neither order nor
/// flush them, an explicit rdma decode is refused (`NoGpuDirect`, naming the
/// attribute) and any other one is left to tcp (its agent stops offering
/// GPUDirect RDMA).
pub(super) fn decide_gpu_direct_writes(
    cfg: &EngineConfig,
    agent: &crate::transport::Agent,
    ordinal: u32,
) -> Result<()> {
    if cfg.transport != TransportKind::Rdma && agent.rdma_gpu_direct().is_err() {
        return Ok(()); // no NIC can write device memory: rdma never reaches the pools
    }
    #[cfg(feature = "cuda")]
    if let Some(e) = pool_without_gpu_direct(cfg, ordinal)? {
        // a pool the NIC cannot register: never a late failure of its rooms
        if cfg.transport == TransportKind::Rdma {
            return Err(e);
        }
        log::warn!("engine: peers write the device pools over tcp, not GPUDirect RDMA: {e}");
        return agent.refuse_gpu_direct(&e);
    }
    #[cfg(feature = "cuda")]
    match crate::cuda::RdmaWriteFlush::new(ordinal as usize) {
        Ok(f) => {
            log::info!(
                "engine: device {ordinal} GPUDirect RDMA writes ordering {:?}: {}",
                f.info().writes_ordering,
                if f.needed() {
                    "each batch is flushed (cuFlushGPUDirectRDMAWrites) before its completion is delivered"
                } else {
                    "no flush needed"
                }
            );
            agent.flush_gpu_direct_writes(std::sync::Arc::new(f))
        }
        Err(e) if e.status() == Status::Unsupported && cfg.transport == TransportKind::Rdma => {
            Err(Error::new(
                Status::NoGpuDirect,
                format!(
                    "decode KV pools in device memory over rdma need GPUDirect RDMA writes the device orders or flushes: {}; use transport tcp (the receiver copies into device memory) or auto (which then uses tcp)",
                    e.detail()
                ),
            ))
        }
        Err(e) if cfg.transport == TransportKind::Rdma => Err(e),
        Err(e) => {
            log::warn!(
                "engine: peers write the device pools over tcp, not GPUDirect RDMA: {e}"
            );
            agent.refuse_gpu_direct(&e)
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        // device pools are refused at the preflight without the `cuda` feature
        let _ = ordinal;
        Err(Error::new(
            Status::Unsupported,
            "device-memory pools need pdxfer built with the `cuda` feature",
        ))
    }
}

/// Decode device pools: the first pool with a mapping the driver says
/// cannot be registered for GPUDirect RDMA
/// (`CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE` 0: `cuMemCreate`
/// memory without `gpuDirectRDMACapable`), as the `NoGpuDirect` error naming
/// it; `None` when every mapping of every pool can (or the driver cannot
/// say). Each mapping is asked, since VMM pools are many.
#[cfg(feature = "cuda")]
fn pool_without_gpu_direct(cfg: &EngineConfig, ordinal: u32) -> Result<Option<Error>> {
    let w = crate::cuda::HostToDevice::new(ordinal as usize)?;
    for (i, p) in cfg.pools.iter().enumerate() {
        let len = p.geometry()?.span();
        if let Some((start, end)) = w.mapping_without_gpu_direct(p.base, len)? {
            return Ok(Some(Error::new(
                Status::NoGpuDirect,
                format!(
                    "decode KV pool {i} (0x{:x}+{len}) cannot be written by GPUDirect RDMA: its mapping 0x{start:x}..0x{end:x} is not GPUDirect RDMA capable (CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE 0: VMM memory from cuMemCreate without allocFlags.gpuDirectRDMACapable, as PyTorch's expandable_segments made before 2.8); allocate the pools with gpuDirectRDMACapable = 1 (or with cuMemAlloc), or use transport tcp or auto (which then uses tcp)",
                    p.base
                ),
            )));
        }
    }
    Ok(None)
}

/// One slice of a staged device gather, ready in a staging buffer.
#[derive(Debug, Clone)]
pub(super) struct StagedSlice {
    /// Slice number, from 0 (index into the slices given to `run`).
    pub index: usize,
    /// Registry id of the staging buffer holding the slice: the device
    /// staging region (zero copy) or the pinned host one.
    pub region: u64,
    /// Byte offset of the slice's pack block in that staging buffer.
    pub offset: u64,
    /// Byte offset of each entry's block within the slice's pack block.
    pub entry_offsets: Vec<u64>,
}

/// A transfer worker's GPU relayout and staging buffers.
#[cfg(feature = "cuda")]
pub(super) struct DeviceStage {
    gpu: crate::relayout::gpu::GpuRelayout,
    device: crate::cuda::DeviceBuffer,
    host: crate::cuda::PinnedBuffer,
    host_region: u64,
    device_region: u64,
}

/// Without the `cuda` feature there is no device stage (never constructed).
#[cfg(not(feature = "cuda"))]
pub(super) enum DeviceStage {}

#[cfg(feature = "cuda")]
impl DeviceStage {
    /// Checks every pool `(base, len)` against the driver (device memory of
    /// `ordinal`, inside one allocation) and opens one stage per worker, its
    /// buffers registered with `reg`.
    pub(super) fn open(
        ordinal: u32,
        staging_bytes: u64,
        pools: &[(u64, u64)],
        reg: &Registry,
        workers: usize,
    ) -> Result<Vec<DeviceStage>> {
        use crate::relayout::gpu::GpuRelayout;
        let len = usize::try_from(staging_bytes)
            .map_err(|_| Error::invalid("staging_bytes does not fit this machine"))?;
        let mut out = Vec::with_capacity(workers);
        for w in 0..workers {
            let gpu = GpuRelayout::new(ordinal as usize)?;
            if w == 0 {
                for (i, &(base, plen)) in pools.iter().enumerate() {
                    gpu.stream().check_device_range(base, plen).map_err(|e| {
                        Error::new(e.status(), format!("KV pool {i}: {}", e.detail()))
                    })?;
                }
            }
            let device = gpu.stream().alloc(len)?;
            let host = gpu.stream().alloc_pinned(len)?;
            // SAFETY: the pinned buffer is owned by this stage, which the worker
            // keeps until the engine's registry is gone (jobs stop first).
            let host_region = unsafe { reg.register_host(host.as_ptr(), len)? }.id;
            // SAFETY: as above, for the device buffer.
            let device_region = unsafe { reg.register_device(device.ptr(), len, ordinal)? }.id;
            out.push(DeviceStage {
                gpu,
                device,
                host,
                host_region,
                device_region,
            });
        }
        Ok(out)
    }

    /// Registry id of the pinned host staging buffer (the `local_region` of
    /// the writes of a slice copied to the host).
    pub(super) fn host_region(&self) -> u64 {
        self.host_region
    }

    /// Registry id of the device staging buffer: where a transport that reads
    /// device memory (GPUDirect RDMA) writes slices from, skipping the host
    /// copy (`run` with `zero_copy`).
    pub(super) fn device_region(&self) -> u64 {
        self.device_region
    }

    /// Orders the stage's later gathers after the caller's CUDA event (its
    /// raw `CUevent`): the stream waits on it, the host does not.
    ///
    /// # Safety
    /// `event` must be a live `CUevent` of the pools' device context.
    pub(super) unsafe fn wait_event(&self, event: u64) -> Result<()> {
        // SAFETY: the caller guarantees the event.
        unsafe { self.gpu.stream().wait_raw_event(event) }
    }

    /// Tokens of one slice (half a staging buffer) for entries of `row_bytes`.
    pub(super) fn slice_tokens(&self, row_bytes: &[u64]) -> u64 {
        let half = self.device.len().min(self.host.len()) as u64 / 2;
        crate::layout::pack_slice_tokens(half, row_bytes)
    }

    /// Gathers each slice's spans (pool row -> packed index of the slice) on
    /// the GPU into a device staging half and calls `send` for it with its
    /// bytes in place: with `zero_copy` in the device staging buffer (for a
    /// transport that reads device memory, GPUDirect RDMA), else copied into
    /// the pinned host staging buffer first. Slice `i+1` is gathered (and
    /// copied) during `send` of slice `i`.
    ///
    /// # Safety
    /// `pool_bases` must be device memory of the stage's device holding every
    /// row the spans name (checked at creation by `open`, rows by the plan).
    pub(super) unsafe fn run(
        &mut self,
        pool_bases: &[u64],
        row_bytes: &[u64],
        slices: &[Vec<Run>],
        zero_copy: bool,
        mut send: impl FnMut(&StagedSlice) -> Result<()>,
    ) -> Result<()> {
        let (device, host) = (&self.device, &self.host);
        let (base, region) = (device.ptr(), self.device_region());
        let host_region = self.host_region();
        let host = (!zero_copy).then_some(host);
        // SAFETY: the caller guarantees the pools; the staging buffers are this stage's.
        unsafe {
            self.gpu
                .gather_to_host(pool_bases, row_bytes, slices, device, host, |s| {
                    let (region, offset) = match host {
                        Some(_) => (host_region, s.host_offset as u64),
                        None => (region, s.device_addr - base),
                    };
                    send(&StagedSlice {
                        index: s.index,
                        region,
                        offset,
                        entry_offsets: s.pack.entry_offsets.clone(),
                    })
                })
        }
    }
}

#[cfg(not(feature = "cuda"))]
impl DeviceStage {
    pub(super) fn open(
        _ordinal: u32,
        _staging_bytes: u64,
        _pools: &[(u64, u64)],
        _reg: &Registry,
        _workers: usize,
    ) -> Result<Vec<DeviceStage>> {
        Err(Error::new(
            Status::Unsupported,
            "device-memory pools need pdxfer built with the `cuda` feature",
        ))
    }

    pub(super) fn slice_tokens(&self, _row_bytes: &[u64]) -> u64 {
        match *self {}
    }

    pub(super) unsafe fn wait_event(&self, _event: u64) -> Result<()> {
        match *self {}
    }

    pub(super) unsafe fn run(
        &mut self,
        _pool_bases: &[u64],
        _row_bytes: &[u64],
        _slices: &[Vec<Run>],
        _zero_copy: bool,
        _send: impl FnMut(&StagedSlice) -> Result<()>,
    ) -> Result<()> {
        match *self {}
    }
}

impl Shared {
    /// Whether a new link to a decode rank sends device-pool slices straight
    /// from the device staging buffer: device pools, an rdma link, and a NIC
    /// that can register device memory (GPUDirect RDMA). Otherwise slices go
    /// through the pinned host staging (logged once when rdma lacks GPUDirect).
    pub(super) fn zero_copy_for(&self, data: &dyn Transport, peer: impl std::fmt::Display) -> bool {
        if self.cfg.pool_device.is_none() || data.kind() != TransportKind::Rdma {
            return false;
        }
        match self.agent.rdma_gpu_direct() {
            Ok(()) => {
                log::info!("engine: rdma to decode {peer} writes device-pool slices from device memory (GPUDirect RDMA, no host copy)");
                true
            }
            Err(e) => {
                self.log_no_gpu_direct(&e);
                false
            }
        }
    }

    /// Logs (once per engine) why device-pool slices go through host memory over rdma.
    pub(super) fn log_no_gpu_direct(&self, e: &Error) {
        if !self.gpu_direct_logged.swap(true, Ordering::AcqRel) {
            log::warn!(
                "engine: the RDMA NIC cannot send from GPU memory ({e}); device-pool slices are copied to pinned host staging and sent from there"
            );
        }
    }
}
