//! The CUDA foundation: everything of the driver that the layers above use,
//! through cudarc loaded at run time, and the finder for CUDA user-space
//! libraries. `relayout::gpu` (the kernels) and `transport` (NCCL, GPUDirect
//! RDMA, the tcp receiver's device writes, NIC selection) both sit on it; it
//! uses neither.
//!
//! Every entry point first checks that libcuda is present (cudarc panics
//! when it is not) and runs each cudarc call behind `catch_unwind`
//! (`driver::guard`), so a machine without a GPU gets
//! [`Status::NoCudaDriver`](crate::Status::NoCudaDriver), a failing driver
//! call [`Status::Cuda`](crate::Status::Cuda); nothing panics, and no `Drop`
//! here panics. Built without the `cuda` feature, [`probe`] and
//! [`pci_bus_id`] answer `Unsupported` and only [`library`] remains.
//!
//! One concept per file:
//! - `driver`: is libcuda loadable, its version, the device count
//!   ([`probe`], [`CudaInfo`]), a device's PCI bus id ([`pci_bus_id`]);
//! - [`library`]: finding NVRTC and NCCL by soname and in pip wheels;
//! - [`loaded`]: which file a loaded library came from (`pdxfer info`);
//! - `memory`: [`DeviceBuffer`], [`PinnedBuffer`], and the checks that an
//!   address range is mapped device memory of one device;
//! - `stream`: [`GpuStream`] (a context and one stream: alloc, upload,
//!   download, memset, copies, events, waits) and [`GpuEvent`];
//! - `writer`: [`HostToDevice`], the device writer of the tcp receiver;
//! - `gpudirect`: [`GpuDirectInfo`] and [`RdmaWriteFlush`] (what a device says
//!   about GPUDirect RDMA writes, and the flush where it does not order them);
//! - `gpudirect_probe`: [`probe_gpudirect`], which GPUDirect route works here;
//! - `vmm_probe`: [`probe_vmm_gpudirect`], what the driver says about
//!   GPUDirect RDMA on `cuMemAlloc` and `cuMemCreate` memory.

mod driver;
#[cfg(feature = "cuda")]
mod gpudirect;
#[cfg(feature = "cuda")]
mod gpudirect_probe;
pub mod library;
pub mod loaded;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod stream;
#[cfg(feature = "cuda")]
mod vmm_probe;
#[cfg(feature = "cuda")]
mod writer;

/// For the kernels of `relayout::gpu`, which call the driver the same way.
#[cfg(feature = "cuda")]
pub(crate) use driver::{driver_version, guard};
pub use driver::{no_driver, pci_bus_id, probe, version_text, CudaInfo};
#[cfg(feature = "cuda")]
pub use gpudirect::{GpuDirectInfo, RdmaWriteFlush, RdmaWritesOrdering};
#[cfg(feature = "cuda")]
pub use gpudirect_probe::{probe_gpudirect, GpuDirectProbe, GpuDirectRoute};
#[cfg(feature = "cuda")]
pub use memory::{DeviceBuffer, PinnedBuffer};
#[cfg(feature = "cuda")]
pub use stream::{GpuEvent, GpuStream};
#[cfg(feature = "cuda")]
pub use vmm_probe::{probe_vmm_gpudirect, VmmGpuDirect};
#[cfg(feature = "cuda")]
pub use writer::HostToDevice;

/// One line on GPUDirect RDMA for device `ordinal`: the route (dma-buf,
/// peermem or none), how it was decided, and the writes ordering.
pub fn gpudirect_summary(ordinal: usize) -> String {
    #[cfg(feature = "cuda")]
    {
        probe_gpudirect(ordinal).to_string()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        "none (built without the `cuda` feature)".to_string()
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;

    #[test]
    fn driver_types_move_between_threads() {
        fn send<T: Send>() {}
        send::<GpuStream>();
        send::<DeviceBuffer>();
        send::<PinnedBuffer>();
        send::<GpuEvent>();
    }

    #[test]
    fn no_driver_is_typed_everywhere() {
        if driver::driver_present().is_ok() {
            crate::test_skip::skip("gpu-present", "a CUDA driver is present");
            return;
        }
        let e = GpuStream::new(0).unwrap_err();
        assert_eq!(e.status(), crate::Status::NoCudaDriver, "{e}");
        assert_eq!(
            HostToDevice::new(0).unwrap_err().status(),
            crate::Status::NoCudaDriver
        );
        assert_eq!(probe().unwrap_err().status(), crate::Status::NoCudaDriver);
        // a second call still answers (cudarc's loader state is not poisoned)
        assert_eq!(
            GpuStream::new(0).unwrap_err().status(),
            crate::Status::NoCudaDriver
        );
    }
}
