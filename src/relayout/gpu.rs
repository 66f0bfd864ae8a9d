//! The relayout on CUDA devices, through cudarc loaded at run time.
//!
//! Every entry point first checks that the library is present (cudarc panics
//! when it is not) and runs each cudarc call behind `catch_unwind`, so a
//! machine without a GPU gets [`Status::NoCudaDriver`], a failing driver call
//! [`Status::Cuda`], and NVRTC trouble [`Status::Nvrtc`]; nothing panics.
//!
//! [`GpuRelayout`] owns a context, one stream, the kernel module and the
//! device tables of a launch. Kernels come from, in order: a module file named
//! by `$PDXFER_KERNEL_MODULE` (cubin or PTX, e.g. built on the GPU host by
//! `scripts/gpu-check.sh`), the sm_90 cubin embedded at build time when the
//! device is sm_90, the embedded sm_90 PTX, and finally NVRTC on the embedded
//! source for the device's own architecture ([`kernels`]).
//!
//! Launches never block the calling thread on the stream: each returns a
//! [`GpuEvent`] recorded after the kernel, which a sender polls or waits on.
//! [`GpuRelayout::gather_sliced`] overlaps the gather of slice `i+1` with the
//! transfer of slice `i` through two halves of a staging buffer.

use crate::error::{Error, Result, Status};
use serde::Serialize;

/// Kernel images embedded at build time (see `build.rs`).
pub mod kernels {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

#[cfg(feature = "cuda")]
pub mod check;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub use device::{
    DeviceBuffer, GatherSlice, GpuEvent, GpuRelayout, HostSlice, HostToDevice, KernelOrigin,
    PinnedBuffer, PreparedCopy,
};

/// What this process can see of CUDA.
#[derive(Debug, Clone, Serialize)]
pub struct CudaInfo {
    /// Number of CUDA devices.
    pub device_count: i32,
}

/// The error for a machine without a loadable CUDA driver.
pub fn no_driver() -> Error {
    Error::new(
        Status::NoCudaDriver,
        "no CUDA driver: libcuda.so / libcuda.so.1 could not be loaded (no NVIDIA driver on this machine, or it is not on the loader path)",
    )
}

/// Probes the CUDA driver: device count, or a typed error saying why not.
pub fn probe() -> Result<CudaInfo> {
    #[cfg(feature = "cuda")]
    {
        device::driver_present()?;
        let n = device::guard(
            "cuDeviceGetCount",
            cudarc::driver::CudaContext::device_count,
        )?;
        Ok(CudaInfo { device_count: n })
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::new(
            Status::Unsupported,
            "built without the `cuda` feature",
        ))
    }
}

/// Probes NVRTC (run-time kernel compilation).
pub fn probe_nvrtc() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        device::nvrtc_present()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::new(
            Status::Unsupported,
            "built without the `cuda` feature",
        ))
    }
}

/// Compiles the embedded kernel source with NVRTC for `arch` (e.g. `sm_90`)
/// and returns the PTX. Needs libnvrtc only, no GPU.
pub fn nvrtc_compile(arch: &str) -> Result<String> {
    #[cfg(feature = "cuda")]
    {
        device::nvrtc_compile(arch)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = arch;
        Err(Error::new(
            Status::Unsupported,
            "built without the `cuda` feature",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics() {
        // On machines without a GPU this is a typed error; with one, a count.
        match probe() {
            Ok(info) => assert!(info.device_count >= 0),
            Err(e) => assert!(matches!(
                e.status(),
                Status::NoCudaDriver | Status::Cuda | Status::Unsupported
            )),
        }
    }

    #[test]
    fn embedded_source_is_the_kernel_file() {
        assert!(kernels::SOURCE.contains("extern \"C\" __global__"));
        assert!(kernels::SOURCE.contains("pdx_gather"));
        assert!(kernels::SOURCE.contains("pdx_scatter"));
        if let Some(ptx) = kernels::PTX_SM90 {
            assert!(ptx.contains(".target sm_90"), "embedded PTX is not sm_90");
            assert!(ptx.contains("pdx_gather") && ptx.contains("pdx_scatter"));
        }
        if let Some(cubin) = kernels::CUBIN_SM90 {
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "embedded cubin is not an ELF image"
            );
        }
    }

    /// NVRTC compiles the embedded source when libnvrtc is loadable, and says
    /// why not otherwise. `PDXFER_REQUIRE_CUDA_TOOLS=1` (the CI test command,
    /// after `scripts/cuda-deps.sh`) turns a missing NVRTC into a failure.
    #[test]
    fn nvrtc_compiles_the_embedded_source() {
        match nvrtc_compile("sm_90") {
            Ok(ptx) => {
                assert!(
                    ptx.contains(".target sm_90"),
                    "{}",
                    &ptx[..ptx.len().min(400)]
                );
                assert!(ptx.contains(".entry pdx_gather"));
                assert!(ptx.contains(".entry pdx_scatter"));
            }
            Err(e) => {
                assert!(
                    matches!(e.status(), Status::Nvrtc | Status::Unsupported),
                    "{e}"
                );
                assert!(
                    std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
                    "PDXFER_REQUIRE_CUDA_TOOLS is set but NVRTC is unusable: {e}"
                );
                eprintln!("skipped: {e}");
            }
        }
    }

    /// `PDXFER_REQUIRE_CUDA_TOOLS=1` turns a missing NVRTC into a failure.
    #[test]
    fn nvrtc_reports_bad_arch_as_typed_error() {
        if let Err(e) = probe_nvrtc() {
            assert!(
                std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
                "PDXFER_REQUIRE_CUDA_TOOLS is set but NVRTC is unusable: {e}"
            );
            eprintln!("skipped: no libnvrtc: {e}");
            return;
        }
        let e = nvrtc_compile("sm_1").unwrap_err();
        assert_eq!(e.status(), Status::Nvrtc, "{e}");
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn engine_types_move_between_threads() {
        fn send<T: Send>() {}
        send::<GpuRelayout>();
        send::<DeviceBuffer>();
        send::<GpuEvent>();
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn no_driver_is_typed_everywhere() {
        if device::driver_present().is_ok() {
            eprintln!("skipped: a CUDA driver is present");
            return;
        }
        let e = GpuRelayout::new(0).unwrap_err();
        assert_eq!(e.status(), Status::NoCudaDriver, "{e}");
        assert_eq!(probe().unwrap_err().status(), Status::NoCudaDriver);
        // a second call still answers (cudarc's loader state is not poisoned)
        assert_eq!(
            GpuRelayout::new(0).unwrap_err().status(),
            Status::NoCudaDriver
        );
    }
}
