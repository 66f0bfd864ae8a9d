//! What a device says about GPUDirect RDMA, and the flush a receiver needs
//! where the device does not order remote writes.
//!
//! `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` says whether writes
//! a NIC makes into device memory (GPUDirect RDMA) are seen in order by CUDA
//! work: `OWNER` (the owning device sees them, expected on Hopper) or
//! `ALL_DEVICES`, or `NONE`, where the consumer must first call
//! `cuFlushGPUDirectRDMAWrites` (CUDA driver API, `CUGPUDirectRDMAWritesOrdering`).
//! A decode that lands KV bytes by GPUDirect RDMA calls
//! [`RdmaWriteFlush::before_delivery`] after the transfer's completion and
//! before it reports the bytes as delivered; it is a no-op where the device
//! orders the writes itself.

use super::driver::{driver_present, guard};
use crate::error::{Error, Result, Status};
use cudarc::driver::{sys, CudaContext};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// `CUGPUDirectRDMAWritesOrdering` of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RdmaWritesOrdering {
    /// Remote writes are not ordered for CUDA work: flush before consuming.
    None,
    /// The owning device sees remote writes in order.
    Owner,
    /// Every device sees remote writes in order.
    AllDevices,
}

impl RdmaWritesOrdering {
    fn from_raw(v: i32) -> Result<RdmaWritesOrdering> {
        match v {
            0 => Ok(RdmaWritesOrdering::None),
            100 => Ok(RdmaWritesOrdering::Owner),
            200 => Ok(RdmaWritesOrdering::AllDevices),
            v => Err(Error::new(
                Status::Cuda,
                format!("unknown GPUDirect RDMA writes ordering {v}"),
            )),
        }
    }
}

/// The GPUDirect attributes of one device.
#[derive(Debug, Clone, Serialize)]
pub struct GpuDirectInfo {
    /// Device ordinal.
    pub device: usize,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub rdma_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: device memory can be exported
    /// as a dma-buf (`cuMemGetHandleForAddressRange`) for `ibv_reg_dmabuf_mr`.
    pub dma_buf_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`.
    pub writes_ordering: RdmaWritesOrdering,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS` has
    /// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST` (the flush call works).
    pub host_flush_supported: bool,
}

fn attribute(ctx: &CudaContext, a: sys::CUdevice_attribute) -> Result<i32> {
    guard("cuDeviceGetAttribute", || ctx.attribute(a))
}

impl GpuDirectInfo {
    /// Reads the attributes of device `ordinal`.
    pub fn query(ordinal: usize) -> Result<GpuDirectInfo> {
        driver_present()?;
        let ctx = guard("cuDevicePrimaryCtxRetain", || CudaContext::new(ordinal))?;
        Self::of(&ctx)
    }

    fn of(ctx: &CudaContext) -> Result<GpuDirectInfo> {
        use sys::CUdevice_attribute as A;
        let flush = attribute(
            ctx,
            A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
        )?;
        let host_bit =
            sys::CUflushGPUDirectRDMAWritesOptions::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST
                as i32;
        Ok(GpuDirectInfo {
            device: ctx.ordinal(),
            rdma_supported: attribute(ctx, A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)? != 0,
            dma_buf_supported: attribute(ctx, A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? != 0,
            writes_ordering: RdmaWritesOrdering::from_raw(attribute(
                ctx,
                A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
            )?)?,
            host_flush_supported: flush & host_bit != 0,
        })
    }
}

/// The flush of GPUDirect RDMA writes for one device, decided once from its
/// writes-ordering attribute: needed only where it is `NONE`.
pub struct RdmaWriteFlush {
    ctx: Arc<CudaContext>,
    info: GpuDirectInfo,
    flushes: AtomicU64,
}

impl RdmaWriteFlush {
    /// Opens device `ordinal` (its primary context) and reads its attributes.
    /// Where writes are unordered and the device cannot flush either, that
    /// is `Unsupported`: GPUDirect RDMA into its memory cannot be made
    /// consistent, so the caller must not use it.
    pub fn new(ordinal: usize) -> Result<RdmaWriteFlush> {
        driver_present()?;
        let ctx = guard("cuDevicePrimaryCtxRetain", || CudaContext::new(ordinal))?;
        let info = GpuDirectInfo::of(&ctx)?;
        if info.writes_ordering == RdmaWritesOrdering::None && !info.host_flush_supported {
            return Err(Error::new(
                Status::Unsupported,
                format!(
                    "CUDA device {ordinal} neither orders GPUDirect RDMA writes (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING is NONE) nor can flush them (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS lacks HOST: no cuFlushGPUDirectRDMAWrites)"
                ),
            ));
        }
        Ok(RdmaWriteFlush {
            ctx,
            info,
            flushes: AtomicU64::new(0),
        })
    }

    /// The device's attributes.
    pub fn info(&self) -> &GpuDirectInfo {
        &self.info
    }

    /// True when the device needs a flush before CUDA work reads remote writes.
    pub fn needed(&self) -> bool {
        self.info.writes_ordering == RdmaWritesOrdering::None
    }

    /// Call after the NIC reported a GPUDirect RDMA write into this device's
    /// memory complete and before the bytes are handed to CUDA work (a
    /// delivered completion): flushes those writes to the owning device
    /// (`cuFlushGPUDirectRDMAWrites(CURRENT_CTX, TO_OWNER)`) where the device
    /// does not order them; does nothing otherwise. Returns whether it flushed.
    /// The call is synchronous: writes completed before it are visible to
    /// work enqueued after it returns.
    pub fn before_delivery(&self) -> Result<bool> {
        if !self.needed() {
            return Ok(false);
        }
        guard("cuFlushGPUDirectRDMAWrites", || {
            self.ctx.bind_to_thread()?;
            // SAFETY: plain driver call with the current context bound above.
            unsafe {
                sys::cuFlushGPUDirectRDMAWrites(
                    sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                    sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
                )
                .result()
            }
        })?;
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Flushes made so far.
    pub fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for RdmaWriteFlush {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaWriteFlush")
            .field("info", &self.info)
            .finish()
    }
}
