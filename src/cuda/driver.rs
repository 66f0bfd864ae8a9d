//! The CUDA driver itself: whether libcuda loads, its version, the device
//! count, a device's PCI bus id, and [`guard`], the wrapper every cudarc call
//! of this crate goes through (a driver error becomes [`Status::Cuda`], a
//! panic from a missing library or symbol [`Status::NoCudaDriver`]).

use crate::error::{Error, Result, Status};
#[cfg(feature = "cuda")]
use cudarc::driver::{result, sys, DriverError};
use serde::Serialize;
#[cfg(feature = "cuda")]
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What this process can see of CUDA.
#[derive(Debug, Clone, Serialize)]
pub struct CudaInfo {
    /// Number of CUDA devices.
    pub device_count: i32,
    /// `cuDriverGetVersion`, e.g. 12040 for CUDA 12.4.
    pub driver_version: i32,
}

impl CudaInfo {
    /// "1 device(s), driver CUDA 12.4".
    pub fn describe(&self) -> String {
        format!(
            "{} device(s), driver CUDA {}",
            self.device_count,
            version_text(self.driver_version)
        )
    }
}

/// "12.4" for a `cuDriverGetVersion` value of 12040.
pub fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
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
        driver_present()?;
        let n = guard(
            "cuDeviceGetCount",
            cudarc::driver::CudaContext::device_count,
        )?;
        let driver_version = driver_version()?;
        Ok(CudaInfo {
            device_count: n,
            driver_version,
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::new(
            Status::Unsupported,
            "built without the `cuda` feature",
        ))
    }
}

/// The PCI bus id of CUDA device `ordinal` (`0000:3b:00.0`, lower case, as
/// sysfs names it), from `cuDeviceGetPCIBusId`: what RDMA NIC selection
/// measures PCIe distance from.
pub fn pci_bus_id(ordinal: u32) -> Result<String> {
    #[cfg(feature = "cuda")]
    {
        driver_present()?;
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
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(Error::new(
            Status::Unsupported,
            "built without the `cuda` feature",
        ))
    }
}

#[cfg(feature = "cuda")]
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// `Ok` when libcuda can be loaded.
#[cfg(feature = "cuda")]
pub(crate) fn driver_present() -> Result<()> {
    // SAFETY: is_culib_present only tries to dlopen the library and reports the result.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(no_driver())
    }
}

/// Runs one cudarc driver call: its error becomes [`Status::Cuda`], a panic
/// (missing library or symbol) [`Status::NoCudaDriver`].
#[cfg(feature = "cuda")]
pub(crate) fn guard<T>(
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
#[cfg(feature = "cuda")]
pub(crate) fn driver_version() -> Result<i32> {
    driver_present()?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: one out-pointer to a local.
    guard("cuDriverGetVersion", || unsafe {
        sys::cuDriverGetVersion(&mut v).result()
    })?;
    Ok(v)
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
    fn pci_bus_id_is_sysfs_spelled_or_a_typed_error() {
        match pci_bus_id(0) {
            Ok(id) => {
                // dddd:bb:dd.f, lower case
                let b = id.as_bytes();
                assert!(
                    id.len() >= 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.',
                    "{id}"
                );
                assert_eq!(id, id.to_ascii_lowercase());
            }
            Err(e) => assert!(
                matches!(
                    e.status(),
                    Status::NoCudaDriver | Status::Cuda | Status::Unsupported
                ),
                "{e}"
            ),
        }
    }

    #[test]
    fn version_text_reads_the_driver_number() {
        assert_eq!(version_text(12040), "12.4");
        assert_eq!(version_text(13050), "13.5");
    }
}
