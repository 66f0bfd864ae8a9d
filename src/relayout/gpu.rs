//! CUDA through cudarc, loaded at run time. Every entry point first checks that
//! the library is present (cudarc panics when it is not) and runs behind
//! `catch_unwind`, so a machine without a GPU gets [`Status::NoCudaDriver`].

use crate::error::{Error, Result, Status};
use serde::Serialize;

/// What this process can see of CUDA.
#[derive(Debug, Clone, Serialize)]
pub struct CudaInfo {
    /// Number of CUDA devices.
    pub device_count: i32,
}

/// Probes the CUDA driver: device count, or a typed error saying why not.
pub fn probe() -> Result<CudaInfo> {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: is_culib_present only tries to dlopen the library and reports the result.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::new(
                Status::NoCudaDriver,
                "no CUDA driver: libcuda.so / libcuda.so.1 could not be loaded (no NVIDIA driver on this machine, or it is not on the loader path)",
            ));
        }
        let r = std::panic::catch_unwind(cudarc::driver::CudaContext::device_count);
        match r {
            Ok(Ok(n)) => Ok(CudaInfo { device_count: n }),
            Ok(Err(e)) => Err(Error::new(
                Status::Cuda,
                format!("cuDeviceGetCount failed: {e}"),
            )),
            Err(_) => Err(Error::new(
                Status::NoCudaDriver,
                "the CUDA driver library is missing a required symbol",
            )),
        }
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
        // SAFETY: only tries to dlopen the library and reports the result.
        if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            Ok(())
        } else {
            Err(Error::new(Status::Nvrtc, "libnvrtc could not be loaded (install nvidia-cuda-nvrtc and put its lib/ on LD_LIBRARY_PATH)"))
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::new(
            Status::Unsupported,
            "built without the `cuda` feature",
        ))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_never_panics() {
        // On machines without a GPU this is a typed error; with one, a count.
        match super::probe() {
            Ok(info) => assert!(info.device_count >= 0),
            Err(e) => assert!(matches!(
                e.status(),
                crate::Status::NoCudaDriver | crate::Status::Cuda | crate::Status::Unsupported
            )),
        }
        let _ = super::probe_nvrtc();
    }
}
