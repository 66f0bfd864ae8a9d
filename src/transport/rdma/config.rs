//! RDMA transport settings and their `PDXFER_RDMA_*` environment variables.

use super::device::{Affinity, NicPolicy};
use super::qp::QpTuning;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How completion of a write batch is made visible to the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecordMode {
    /// The last WRITE on each rail is a WRITE_WITH_IMM carrying (batch id, rails).
    #[default]
    Immediate,
    /// No record (the peer learns completion another way, e.g. the control channel).
    None,
}

/// How the two ends of a connection pair their rails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PairingMode {
    /// Each rail with a rail of the peer on the same GID subnet.
    #[default]
    Subnet,
    /// Rail `i` with the peer's rail `i` (a fabric routed between subnets,
    /// where rails on different subnets reach each other). Either end asking
    /// for it makes both ends pair by index.
    Index,
}

/// Settings of an RDMA transport.
#[derive(Debug, Clone, PartialEq)]
pub struct RdmaConfig {
    /// sysfs root (`/sys`; tests use a fake tree).
    pub sys_root: PathBuf,
    /// Which NICs to use.
    pub policy: NicPolicy,
    /// NUMA node of the memory served, when known.
    pub numa_node: Option<i32>,
    /// PCI bus id of the GPU whose memory is served (`0000:3b:00.0`), when
    /// known: `PDXFER_RDMA_GPU_PCI`, else derived from `gpu_ordinal`.
    pub gpu_pci: Option<String>,
    /// The CUDA device whose memory is served (an engine's `pool_device`):
    /// NIC choice follows its PCI address, and GPUDirect RDMA is probed on it.
    pub gpu_ordinal: Option<u32>,
    /// Force this GID index on every rail (default: RoCE v2 IPv4 first).
    pub gid_index: Option<u8>,
    /// Use at most this many rails (0 = every selected NIC).
    pub max_rails: usize,
    /// Send-queue depth per QP.
    pub sq_depth: u32,
    /// Receives kept posted per QP for incoming WRITE_WITH_IMM records.
    pub recv_depth: u32,
    /// Signal one completion every this many WRs.
    pub signal_every: u32,
    /// Smallest piece a span is cut into when slicing across rails.
    pub min_slice: u64,
    /// Completion record of write batches.
    pub record: RecordMode,
    /// How rails are paired with the peer's (`PDXFER_RDMA_PAIRING`).
    pub pairing: PairingMode,
    /// QP timeouts and retry counts.
    pub tuning: QpTuning,
    /// Threads registering memory in parallel.
    pub reg_threads: usize,
    /// How long posting waits for free send-queue slots before failing the batch.
    pub post_timeout: Duration,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            sys_root: PathBuf::from("/sys"),
            policy: NicPolicy::Nearest,
            numa_node: None,
            gpu_pci: None,
            gpu_ordinal: None,
            gid_index: None,
            max_rails: 0,
            sq_depth: 1024,
            recv_depth: 256,
            signal_every: 64,
            min_slice: 64 << 10,
            record: RecordMode::Immediate,
            pairing: PairingMode::Subnet,
            tuning: QpTuning::default(),
            reg_threads: 8,
            post_timeout: Duration::from_secs(30),
        }
    }
}

fn num<T: std::str::FromStr>(key: &str, v: &str) -> Result<T> {
    v.trim()
        .parse()
        .map_err(|_| Error::invalid(format!("{key}={v:?} is not a valid number")))
}

impl RdmaConfig {
    /// Reads the defaults overridden by environment variables:
    /// `PDXFER_RDMA_DEVICES` (`mlx5_0,mlx5_1:2`), `PDXFER_RDMA_GID_INDEX`,
    /// `PDXFER_RDMA_MAX_RAILS`, `PDXFER_RDMA_NUMA_NODE`, `PDXFER_RDMA_GPU_PCI`,
    /// `PDXFER_RDMA_SQ_DEPTH`, `PDXFER_RDMA_SIGNAL_EVERY`, `PDXFER_RDMA_MIN_SLICE`,
    /// `PDXFER_RDMA_TIMEOUT`, `PDXFER_RDMA_RETRY_CNT`, `PDXFER_RDMA_TRAFFIC_CLASS`,
    /// `PDXFER_RDMA_SL`, `PDXFER_RDMA_REG_THREADS`, `PDXFER_RDMA_RECORD` (`imm`|`none`),
    /// `PDXFER_RDMA_PAIRING` (`subnet`|`index`).
    pub fn from_env() -> Result<RdmaConfig> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) with any key lookup (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<RdmaConfig> {
        let mut c = RdmaConfig::default();
        let g = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        if let Some(v) = g("PDXFER_RDMA_DEVICES") {
            c.policy = NicPolicy::Named(
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect(),
            );
        }
        if let Some(v) = g("PDXFER_RDMA_GID_INDEX") {
            c.gid_index = Some(num("PDXFER_RDMA_GID_INDEX", &v)?);
        }
        if let Some(v) = g("PDXFER_RDMA_MAX_RAILS") {
            c.max_rails = num("PDXFER_RDMA_MAX_RAILS", &v)?;
        }
        if let Some(v) = g("PDXFER_RDMA_NUMA_NODE") {
            c.numa_node = Some(num("PDXFER_RDMA_NUMA_NODE", &v)?);
        }
        if let Some(v) = g("PDXFER_RDMA_GPU_PCI") {
            c.gpu_pci = Some(v.trim().to_string());
        }
        if let Some(v) = g("PDXFER_RDMA_SQ_DEPTH") {
            c.sq_depth = num("PDXFER_RDMA_SQ_DEPTH", &v)?;
        }
        if let Some(v) = g("PDXFER_RDMA_SIGNAL_EVERY") {
            c.signal_every = num("PDXFER_RDMA_SIGNAL_EVERY", &v)?;
        }
        if let Some(v) = g("PDXFER_RDMA_MIN_SLICE") {
            c.min_slice = num("PDXFER_RDMA_MIN_SLICE", &v)?;
        }
        if let Some(v) = g("PDXFER_RDMA_TIMEOUT") {
            c.tuning.timeout = num("PDXFER_RDMA_TIMEOUT", &v)?;
        }
        if let Some(v) = g("PDXFER_RDMA_RETRY_CNT") {
            c.tuning.retry_cnt = num("PDXFER_RDMA_RETRY_CNT", &v)?;
        }
        if let Some(v) = g("PDXFER_RDMA_TRAFFIC_CLASS") {
            c.tuning.traffic_class = num("PDXFER_RDMA_TRAFFIC_CLASS", &v)?;
        }
        if let Some(v) = g("PDXFER_RDMA_SL") {
            c.tuning.sl = num("PDXFER_RDMA_SL", &v)?;
        }
        if let Some(v) = g("PDXFER_RDMA_REG_THREADS") {
            c.reg_threads = num("PDXFER_RDMA_REG_THREADS", &v)?;
        }
        if let Some(v) = g("PDXFER_RDMA_RECORD") {
            c.record = match v.trim() {
                "imm" | "immediate" => RecordMode::Immediate,
                "none" => RecordMode::None,
                other => {
                    return Err(Error::invalid(format!(
                        "PDXFER_RDMA_RECORD={other:?}: expected imm or none"
                    )))
                }
            };
        }
        if let Some(v) = g("PDXFER_RDMA_PAIRING") {
            c.pairing = match v.trim() {
                "subnet" => PairingMode::Subnet,
                "index" => PairingMode::Index,
                other => {
                    return Err(Error::invalid(format!(
                        "PDXFER_RDMA_PAIRING={other:?}: expected subnet or index"
                    )))
                }
            };
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks the settings against each other.
    pub fn validate(&self) -> Result<()> {
        if self.sq_depth == 0 || self.signal_every == 0 || self.signal_every > self.sq_depth {
            return Err(Error::invalid(format!(
                "signal_every ({}) must be in 1..=sq_depth ({})",
                self.signal_every, self.sq_depth
            )));
        }
        if self.tuning.retry_cnt > 7 || self.tuning.timeout > 31 {
            return Err(Error::invalid(format!(
                "retry_cnt {} must be <= 7 and timeout {} <= 31",
                self.tuning.retry_cnt, self.tuning.timeout
            )));
        }
        if let NicPolicy::Named(v) = &self.policy {
            if v.is_empty() {
                return Err(Error::invalid("PDXFER_RDMA_DEVICES names no device"));
            }
        }
        Ok(())
    }

    /// The RoCE traffic class given in code (an engine's or agent's
    /// `rdma_traffic_class`) over the one from `PDXFER_RDMA_TRAFFIC_CLASS`;
    /// `None` keeps it.
    pub fn with_traffic_class(mut self, traffic_class: Option<u8>) -> RdmaConfig {
        if let Some(tc) = traffic_class {
            self.tuning.traffic_class = tc;
        }
        self
    }

    /// Serves the memory of CUDA device `ordinal`: without an explicit
    /// `gpu_pci` (`PDXFER_RDMA_GPU_PCI`), its PCI bus id comes from the
    /// driver (`cuDeviceGetPCIBusId`), so the NICs chosen are the GPU's; where
    /// the driver cannot say (no driver), or names an address sysfs does not
    /// know, NIC choice falls back to the NUMA node, logged.
    pub fn for_gpu(mut self, ordinal: u32) -> RdmaConfig {
        self.gpu_ordinal = Some(ordinal);
        if self.gpu_pci.is_none() {
            match crate::cuda::pci_bus_id(ordinal) {
                Ok(bus) => {
                    log::info!("rdma: GPU {ordinal} is at PCI {bus}: NICs are chosen nearest to it");
                    self.gpu_pci = Some(bus);
                }
                Err(e) => log::warn!(
                    "rdma: the PCI address of GPU {ordinal} is unknown ({e}); NICs are chosen by NUMA node; set PDXFER_RDMA_GPU_PCI"
                ),
            }
        }
        self
    }

    /// The memory's locality: from the GPU's PCI id when given, else the NUMA node.
    pub fn affinity(&self) -> Affinity {
        let mut a = match &self.gpu_pci {
            Some(bus) => Affinity::of_pci(Path::new(&self.sys_root), bus),
            None => Affinity::default(),
        };
        if a.numa_node.is_none() {
            a.numa_node = self.numa_node;
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(pairs: &[(&str, &str)]) -> Result<RdmaConfig> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RdmaConfig::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn env_overrides_defaults() {
        let c = from(&[]).unwrap();
        assert_eq!(c, RdmaConfig::default());
        let c = from(&[
            ("PDXFER_RDMA_DEVICES", "mlx5_0, mlx5_1:2"),
            ("PDXFER_RDMA_GID_INDEX", "3"),
            ("PDXFER_RDMA_MAX_RAILS", "2"),
            ("PDXFER_RDMA_NUMA_NODE", "1"),
            ("PDXFER_RDMA_SIGNAL_EVERY", "16"),
            ("PDXFER_RDMA_RETRY_CNT", "3"),
            ("PDXFER_RDMA_RECORD", "none"),
            ("PDXFER_RDMA_PAIRING", "index"),
        ])
        .unwrap();
        assert_eq!(
            c.policy,
            NicPolicy::Named(vec!["mlx5_0".into(), "mlx5_1:2".into()])
        );
        assert_eq!(c.gid_index, Some(3));
        assert_eq!(c.max_rails, 2);
        assert_eq!(c.numa_node, Some(1));
        assert_eq!(c.signal_every, 16);
        assert_eq!(c.tuning.retry_cnt, 3);
        assert_eq!(c.record, RecordMode::None);
        assert_eq!(c.pairing, PairingMode::Index);
        assert!(from(&[("PDXFER_RDMA_PAIRING", "gid")]).is_err());
        assert_eq!(c.affinity().numa_node, Some(1));
    }

    /// The RoCE traffic class: 0 by default, `PDXFER_RDMA_TRAFFIC_CLASS`, and
    /// the engine's or agent's setting over both.
    #[test]
    fn traffic_class_from_env_and_config() {
        assert_eq!(from(&[]).unwrap().tuning.traffic_class, 0);
        let env = from(&[("PDXFER_RDMA_TRAFFIC_CLASS", "106")]).unwrap();
        assert_eq!(env.tuning.traffic_class, 106);
        assert_eq!(
            env.clone().with_traffic_class(None).tuning.traffic_class,
            106
        );
        assert_eq!(env.with_traffic_class(Some(96)).tuning.traffic_class, 96);
        assert!(from(&[("PDXFER_RDMA_TRAFFIC_CLASS", "256")]).is_err());
    }

    #[test]
    fn bad_values_name_the_variable() {
        let e = from(&[("PDXFER_RDMA_GID_INDEX", "abc")]).unwrap_err();
        assert!(e.detail().contains("PDXFER_RDMA_GID_INDEX"), "{e}");
        let e = from(&[("PDXFER_RDMA_GID_INDEX", "300")]).unwrap_err();
        assert!(e.detail().contains("PDXFER_RDMA_GID_INDEX"), "{e}");
        assert!(from(&[("PDXFER_RDMA_SIGNAL_EVERY", "2000")]).is_err());
        assert!(from(&[("PDXFER_RDMA_RETRY_CNT", "8")]).is_err());
        assert!(from(&[("PDXFER_RDMA_DEVICES", ",")]).is_err());
        assert!(from(&[("PDXFER_RDMA_RECORD", "fence")]).is_err());
    }

    #[test]
    fn an_explicit_gpu_pci_wins_over_the_device() {
        let c = RdmaConfig {
            gpu_pci: Some("0000:02:00.0".into()),
            ..RdmaConfig::default()
        }
        .for_gpu(3);
        assert_eq!(c.gpu_ordinal, Some(3));
        assert_eq!(c.gpu_pci.as_deref(), Some("0000:02:00.0"));
        // Without one, the driver is asked (no driver here: still unknown, typed).
        let c = RdmaConfig::default().for_gpu(0);
        assert_eq!(c.gpu_ordinal, Some(0));
        if let Some(bus) = &c.gpu_pci {
            assert_eq!(bus, &crate::cuda::pci_bus_id(0).unwrap());
        }
    }

    #[test]
    fn gpu_pci_gives_numa_from_sysfs() {
        let s = super::super::device::tests::four_nics();
        let c = RdmaConfig {
            sys_root: s.0.clone(),
            gpu_pci: Some("0000:02:00.0".into()),
            numa_node: Some(7),
            ..RdmaConfig::default()
        };
        let a = c.affinity();
        assert_eq!(
            a.numa_node,
            Some(0),
            "the GPU's node wins over the configured one"
        );
        assert!(a.pci_path.is_some());
    }
}
