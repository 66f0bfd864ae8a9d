//! The device staging buffer of one nccl link end: allocated once, when the
//! link's communicator opens, at the engine's `staging_bytes`, and never
//! freed while the link lives. `cuMemFree` synchronises the whole device, so
//! freeing (or regrowing) a buffer while other links' NCCL kernels spin
//! waiting for their peers stalls this link until they land (NCCL's user
//! guide, "Using multiple NCCL communicators concurrently"). A pair larger
//! than the buffer gets a larger one, logged with the size to configure;
//! the smaller one is kept, not freed, until the link ends.

use crate::cuda::DeviceBuffer;
use crate::error::Result;
use crate::relayout::gpu::GpuRelayout;

/// One link end's staging.
#[derive(Default)]
pub(in crate::engine) struct Staging {
    buf: Option<DeviceBuffer>,
    /// Outgrown buffers, freed with the link (never while it moves bytes).
    retired: Vec<DeviceBuffer>,
}

impl Staging {
    /// Allocates the buffer at `bytes` if there is none yet (at the link's
    /// set-up, before any transfer of it); a failure leaves it to the first
    /// pair, and is returned.
    pub(in crate::engine) fn preallocate(&mut self, gpu: &GpuRelayout, bytes: u64) -> Result<()> {
        if self.buf.is_none() {
            let len = usize::try_from(bytes.max(1)).unwrap_or(usize::MAX);
            self.buf = Some(gpu.stream().alloc(len)?);
        }
        Ok(())
    }

    /// A buffer of at least `need` bytes: the link's own, or a larger one
    /// made now (the outgrown one is kept until the link ends).
    pub(in crate::engine) fn reserve(
        &mut self,
        gpu: &GpuRelayout,
        need: usize,
    ) -> Result<&DeviceBuffer> {
        if self.buf.as_ref().is_none_or(|b| b.len() < need) {
            let fresh = gpu.stream().alloc(need.max(1))?;
            if let Some(old) = self.buf.replace(fresh) {
                log::warn!(
                    "engine: nccl staging grew from {} B to {need} B on device {}: set staging_bytes to at least {need} to allocate it once when the link opens",
                    old.len(),
                    gpu.stream().ordinal()
                );
                self.retired.push(old);
            }
        }
        Ok(self.buf.as_ref().expect("allocated above"))
    }
}
