//! RDMA through ibverbs; no device is [`Status::NoRdmaDevice`] with the reason.

use crate::error::{Error, Result, Status};
use serde::Serialize;

/// One RDMA device.
#[derive(Debug, Clone, Serialize)]
pub struct RdmaDevice {
    /// Device name (e.g. `mlx5_0`).
    pub name: String,
}

/// Lists RDMA devices, or says why there are none.
pub fn list_devices() -> Result<Vec<RdmaDevice>> {
    #[cfg(feature = "rdma")]
    {
        let sys = std::path::Path::new("/sys/class/infiniband");
        let list = ibverbs::devices().map_err(|e| {
            Error::new(
                Status::NoRdmaDevice,
                format!(
                    "no RDMA device: ibv_get_device_list failed: {e}{}",
                    if sys.exists() {
                        ""
                    } else {
                        " (no /sys/class/infiniband: the kernel has no RDMA support or no NIC)"
                    }
                ),
            )
        })?;
        let devs: Vec<RdmaDevice> = list
            .iter()
            .map(|d| RdmaDevice {
                name: d
                    .name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            })
            .collect();
        if devs.is_empty() {
            return Err(Error::new(
                Status::NoRdmaDevice,
                "no RDMA device: ibv_get_device_list returned an empty list",
            ));
        }
        Ok(devs)
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(Error::new(
            Status::Unsupported,
            "built without the `rdma` feature",
        ))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn no_device_is_typed() {
        match super::list_devices() {
            Ok(d) => assert!(!d.is_empty()),
            Err(e) => assert!(
                matches!(
                    e.status(),
                    crate::Status::NoRdmaDevice | crate::Status::Unsupported
                ),
                "{e}"
            ),
        }
    }
}
