//! Which GPU an engine's device pools live on, as the control hello carries
//! it: the host (its boot id, equal exactly for processes of one host and
//! boot, containers included) and the device's PCI bus id. Transport nccl
//! needs the two ends on two GPUs: NCCL refuses two ranks of one
//! communicator on one device ("Duplicate GPU detected", `ncclInvalidUsage`,
//! from the ranks' host hash and bus id), so a link whose ends name one GPU
//! is refused when it is set up, before any room, naming what works there.

use super::config::EngineConfig;
use crate::error::{Error, Result, Status};
use crate::transport::TransportKind;
use serde::{Deserialize, Serialize};

/// One GPU: the host it is in and its PCI bus id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuIdentity {
    /// `/proc/sys/kernel/random/boot_id` of the host.
    pub host: String,
    /// `cuDeviceGetPCIBusId`, lower case (`0000:c1:00.0`).
    pub pci_bus_id: String,
}

impl GpuIdentity {
    /// The GPU of CUDA device `ordinal` on this host.
    pub fn of_device(ordinal: u32) -> Result<GpuIdentity> {
        let host = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map_err(|e| Error::new(Status::Io, format!("read the boot id: {e}")))?
            .trim()
            .to_string();
        Ok(GpuIdentity {
            host,
            pci_bus_id: crate::cuda::pci_bus_id(ordinal)?,
        })
    }
}

/// The GPU of this engine's device pools (None for host pools, or when the
/// driver cannot name it, which is logged).
pub(super) fn local_gpu(cfg: &EngineConfig) -> Option<GpuIdentity> {
    let ordinal = cfg.pool_device?;
    match GpuIdentity::of_device(ordinal) {
        Ok(g) => Some(g),
        Err(e) => {
            log::warn!("engine: cannot name CUDA device {ordinal} for the control hello: {e}");
            None
        }
    }
}

/// Refuses a transport nccl link whose two ends are one GPU
/// (`nccl_same_gpu`, naming the GPU and cma/tcp); any other pairing passes.
pub(super) fn refuse_same_gpu(
    transport: TransportKind,
    local: Option<&GpuIdentity>,
    peer: Option<&GpuIdentity>,
    peer_desc: &str,
) -> Result<()> {
    match (transport, local, peer) {
        (TransportKind::Nccl, Some(l), Some(p)) if l == p => Err(Error::new(
            Status::NcclSameGpu,
            format!(
                "transport nccl: {peer_desc} has its KV pools on the same GPU as this rank (PCI {} on this host), and NCCL does not run two ranks of one communicator on one GPU; use transport cma or tcp between ranks on one GPU, or put the ranks on two GPUs",
                l.pci_bus_id
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(host: &str, bus: &str) -> GpuIdentity {
        GpuIdentity {
            host: host.into(),
            pci_bus_id: bus.into(),
        }
    }

    /// Only nccl between one host's one GPU is refused; another GPU, another
    /// host, an end that did not say, or another transport pass.
    #[test]
    fn nccl_on_one_gpu_is_refused_naming_cma_and_tcp() {
        let a = gpu("boot-1", "0000:c1:00.0");
        let e = refuse_same_gpu(TransportKind::Nccl, Some(&a), Some(&a.clone()), "decode 7")
            .unwrap_err();
        assert_eq!(e.status(), Status::NcclSameGpu, "{e}");
        for want in ["decode 7", "0000:c1:00.0", "cma", "tcp"] {
            assert!(e.detail().contains(want), "{want}: {e}");
        }
        let other_gpu = gpu("boot-1", "0000:c2:00.0");
        let other_host = gpu("boot-2", "0000:c1:00.0");
        for p in [Some(&other_gpu), Some(&other_host), None] {
            refuse_same_gpu(TransportKind::Nccl, Some(&a), p, "d").unwrap();
        }
        refuse_same_gpu(TransportKind::Nccl, None, Some(&a), "d").unwrap();
        for t in [TransportKind::Tcp, TransportKind::Cma, TransportKind::Auto] {
            refuse_same_gpu(t, Some(&a), Some(&a), "d").unwrap();
        }
    }
}
