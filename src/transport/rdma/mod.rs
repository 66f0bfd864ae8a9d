//! RDMA transport: one-sided RDMA WRITE/READ over RC queue pairs through
//! libibverbs (opened at run time), host and GPU (dma-buf) memory regions, a negotiated handshake,
//! and batches sliced across several NICs.
//!
//! Layers, pure first:
//! - `handshake`: the versioned wire format of what each side sends (QPN, LID,
//!   GID, PSN, MTU, regions with rkeys) and `handshake::negotiate` (min MTU,
//!   zero-GID detection, errors naming the failing field);
//! - `pairing`: which local rail connects to which peer rail, by the subnet
//!   of their GIDs (IB subnet prefix, IPv4 network, IPv6 /64), or by index
//!   where `PDXFER_RDMA_PAIRING=index` asks for it;
//! - `wr`: work-request lists for a batch (splitting, signalling every k, the
//!   WRITE_WITH_IMM or final-write completion record);
//! - `slice`: spreading a batch across rails and resolving keys with bounds checks;
//! - `qp`: the INIT/RTR/RTS attribute sets;
//! - `tracker`: completion bookkeeping, failure reasons, no retries;
//! - `device`: sysfs discovery and NIC selection nearest to the GPU on PCIe
//!   (else by NUMA node);
//! - `config`: settings and their `PDXFER_RDMA_*` environment variables;
//! - `verbs_sys` (feature `rdma`): the verbs.h structs and libibverbs'
//!   entry points, `dlopen`ed on first use (a host without rdma-core gets
//!   `NoRdmaDevice` naming the library, tcp and cma unaffected);
//! - `verbs` (feature `rdma`): RAII wrappers over `verbs_sys`;
//! - `endpoint` (feature `rdma`): `VerbsNic` (rails, parallel timed
//!   registration of host and GPU memory) and `RdmaEndpoint` (`connect`,
//!   `post_batch`, `poll`/`wait`, the completion poller thread).
//! - `nic`: what the agent needs from a NIC, independent of verbs
//!   (`NicProvider` registers memory and makes endpoints, `NicEndpoint`
//!   connects with the peer's handshake, `DataPath` posts and waits; every
//!   `Session<R: RailIo>` is one); `VerbsProvider` (feature `rdma`) on real NICs;
//! - `transport`: `RdmaTransport`, the RDMA transport behind the
//!   [`Transport`](crate::transport::Transport) trait: the agent's control
//!   channel (intent, grant, commit) around one-sided WRITE/READ on a `DataPath`;
//! - `fake` (tests): an in-process software fabric of QPs and MRs that moves
//!   real bytes after key and bounds checks, asynchronously from its own
//!   thread, with enforced queue depths and flush-on-error, selected only
//!   explicitly (`AgentOptions::nic`).
//!
//! Registrations follow the agent's registry: every region is registered
//! with the NIC (device regions through the GPU path: dma-buf, else
//! nvidia-peermem; `NoGpuDirect` with the reason where neither exists), and
//! unregistering a region deregisters its memory region on the NIC from the
//! registry's unregister hook, after its in-flight accesses drained and
//! before `unregister` returns: a peer still holding its rkey gets
//! `IBV_WC_REM_ACCESS_ERR` and writes nothing, and the same addresses can be
//! registered again (fresh keys).
//!
//! The agent's handshake carries it: the server offers its NICs in
//! `HelloAck.rdma`, the client sends its `Handshake` in `Select`, the server
//! answers with its own in `SelectOk`, and both pair their rails by subnet,
//! `negotiate` each pair and bring their QPs up.
//!
//! Without a device every entry point returns `Status::NoRdmaDevice` with the
//! reason (e.g. no `/sys/class/infiniband`), never a panic.

pub mod config;
pub mod device;
#[cfg(feature = "rdma")]
pub mod endpoint;
#[cfg(any(test, feature = "testing"))]
pub mod fake;
pub mod handshake;
#[cfg(feature = "rdma")]
pub mod netdev;
pub mod nic;
pub mod pairing;
pub mod qp;
pub mod report;
pub mod session;
pub mod slice;
pub mod tracker;
pub mod transport;
#[cfg(feature = "rdma")]
pub mod verbs;
#[cfg(all(test, feature = "rdma"))]
mod verbs_layout_check;
#[cfg(feature = "rdma")]
pub mod verbs_sys;
pub mod view_hulls;
pub mod wr;

pub use config::{PairingMode, RdmaConfig, RecordMode};
pub use device::{RdmaDevice, RdmaPort};
#[cfg(feature = "rdma")]
pub use endpoint::{MemoryKind, RdmaEndpoint, RegistrationReport, VerbsNic};
pub use handshake::{Handshake, HandshakeField, Negotiated};
pub use slice::Span;
pub use tracker::BatchState;
pub use transport::RdmaTransport;
pub use wr::Direction;

#[allow(unused_imports)] // Error and Status are used only without the `rdma` feature.
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

/// Opens the NICs the way an engine created with `transport=rdma` does:
/// [`Status::NoRdmaDevice`] with the reason when there is no usable NIC,
/// [`Status::Unsupported`] when built without the `rdma` feature.
#[cfg(feature = "rdma")]
pub fn open(cfg: RdmaConfig) -> Result<VerbsNic> {
    VerbsNic::new(cfg)
}

/// Without the `rdma` feature there are no verbs NICs.
#[cfg(not(feature = "rdma"))]
pub fn open(cfg: RdmaConfig) -> Result<()> {
    let _ = cfg;
    Err(Error::new(
        Status::Unsupported,
        "built without the `rdma` feature",
    ))
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
    }

    #[test]
    fn opening_without_devices_is_a_typed_error_never_a_panic() {
        // This machine's real /sys (no RDMA here; with NICs it opens).
        match open(RdmaConfig::default()) {
            Ok(_) => {}
            Err(e) => assert!(
                matches!(e.status(), Status::NoRdmaDevice | Status::Unsupported),
                "{e}"
            ),
        }
        // No /sys/class/infiniband at all: the reason names it.
        let empty = device::tests::FakeSys::new("open-empty");
        let e = open(RdmaConfig {
            sys_root: empty.0.clone(),
            ..RdmaConfig::default()
        })
        .map(|_| ())
        .expect_err("no devices");
        assert!(
            matches!(e.status(), Status::NoRdmaDevice | Status::Unsupported),
            "{e}"
        );
        if e.status() == Status::NoRdmaDevice {
            assert!(e.detail().contains("class/infiniband"), "{e}");
        }
        // Devices in sysfs that libibverbs cannot open: still NoRdmaDevice, with why.
        let fake = device::tests::four_nics();
        let e = open(RdmaConfig {
            sys_root: fake.0.clone(),
            ..RdmaConfig::default()
        })
        .map(|_| ())
        .expect_err("fake devices cannot be opened");
        assert!(
            matches!(e.status(), Status::NoRdmaDevice | Status::Unsupported),
            "{e}"
        );
    }
}
