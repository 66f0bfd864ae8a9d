//! RDMA transport: one-sided RDMA WRITE/READ over RC queue pairs through
//! `ibverbs-sys`, host and GPU (dma-buf) memory regions, a negotiated handshake,
//! and batches sliced across several NICs.
//!
//! Layers, pure first:
//! - [`handshake`]: the versioned wire format of what each side sends (QPN, LID,
//!   GID, PSN, MTU, regions with rkeys) and [`handshake::negotiate`] (min MTU,
//!   zero-GID detection, errors naming the failing field);
//! - [`wr`]: work-request lists for a batch (splitting, signalling every k, the
//!   WRITE_WITH_IMM or final-write completion record);
//! - [`slice`]: spreading a batch across rails and resolving keys with bounds checks;
//! - [`qp`]: the INIT/RTR/RTS attribute sets;
//! - [`tracker`]: completion bookkeeping, failure reasons, no retries;
//! - [`device`]: sysfs discovery and NUMA/PCIe-aware NIC selection;
//! - `verbs` (feature `rdma`): RAII wrappers over `ibverbs-sys` and the
//!   [`RdmaTransport`] / [`RdmaEndpoint`] that drive real NICs.
//!
//! Without a device every entry point returns [`Status::NoRdmaDevice`] with the
//! reason (e.g. no `/sys/class/infiniband`), never a panic.

/// cbindgen:ignore
pub mod device;
/// cbindgen:ignore
pub mod handshake;
/// cbindgen:ignore
pub mod qp;
/// cbindgen:ignore
pub mod slice;
/// cbindgen:ignore
pub mod tracker;
#[cfg(feature = "rdma")]
/// cbindgen:ignore
pub mod verbs;
/// cbindgen:ignore
pub mod wr;

pub use device::{RdmaDevice, RdmaPort};

use crate::error::{Error, Result, Status};
use std::path::Path;

/// Lists RDMA devices (from sysfs, completed by verbs where a device can be
/// opened), or says why there are none ([`Status::NoRdmaDevice`]).
pub fn list_devices() -> Result<Vec<RdmaDevice>> {
    list_devices_at(Path::new("/sys"))
}

/// [`list_devices`] with another sysfs root (tests use a fake tree).
pub fn list_devices_at(sys_root: &Path) -> Result<Vec<RdmaDevice>> {
    #[allow(unused_mut)]
    let mut devs = device::scan(sys_root)?;
    #[cfg(feature = "rdma")]
    verbs::enrich(&mut devs);
    #[cfg(not(feature = "rdma"))]
    for d in &mut devs {
        d.verbs_error = Some("built without the `rdma` feature".into());
    }
    Ok(devs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_is_typed() {
        match list_devices() {
            Ok(d) => assert!(!d.is_empty()),
            Err(e) => assert_eq!(e.status(), Status::NoRdmaDevice, "{e}"),
        }
    }

    #[test]
    fn fake_tree_lists_devices_with_verbs_reason() {
        let s = device::tests::four_nics();
        let d = list_devices_at(&s.0).unwrap();
        assert_eq!(d.len(), 4);
        // The fake devices are unknown to libibverbs: each says why.
        assert!(d.iter().all(|x| x.verbs_error.is_some()));
        let _ = Error::new(Status::Rdma, "");
    }
}
