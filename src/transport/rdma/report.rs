//! What RDMA looks like for the memory of one GPU, as one JSON object (what
//! `pdxfer info --gpu N` prints): the NICs found, which of them are chosen
//! for the GPU and why (PCIe distance, NUMA), and whether GPUDirect RDMA
//! works, tested by a real registration of device memory (dma-buf,
//! nvidia-peermem, or none with why).

use crate::transport::rdma::device::{nearest, select_rails, NicPolicy};
use crate::transport::rdma::RdmaConfig;
use serde_json::{json, Value};

/// The report for CUDA device `ordinal` with the `PDXFER_RDMA_*` settings.
pub fn for_gpu(ordinal: u32) -> Value {
    match RdmaConfig::from_env() {
        Ok(c) => with_config(c.for_gpu(ordinal), ordinal),
        Err(e) => json!({"gpu": ordinal, "error": e.detail()}),
    }
}

/// [`for_gpu`] with the settings given.
pub fn with_config(cfg: RdmaConfig, ordinal: u32) -> Value {
    let mut v = json!({
        "gpu": ordinal,
        "gpu_pci": cfg.gpu_pci,
        "traffic_class": cfg.tuning.traffic_class,
        "qp_timeout": cfg.tuning.timeout,
        "retry_cnt": cfg.tuning.retry_cnt,
    });
    v["nics"] = nics(&cfg);
    v["gpudirect"] = gpudirect(cfg);
    v
}

/// Every active port, whether it is chosen for the GPU, and why.
fn nics(cfg: &RdmaConfig) -> Value {
    let devs = match crate::transport::rdma::list_devices_at(&cfg.sys_root) {
        Ok(d) => d,
        Err(e) => return json!({"error": e.detail(), "kind": e.kind()}),
    };
    let aff = cfg.affinity();
    let ports: Vec<Value> = match &cfg.policy {
        NicPolicy::Nearest => nearest(&devs, &aff)
            .into_iter()
            .map(|c| {
                json!({
                    "device": devs[c.dev].name,
                    "port": devs[c.dev].ports[c.port].num,
                    "pci": devs[c.dev].pci_addr,
                    "numa": devs[c.dev].numa_node,
                    "chosen": c.chosen,
                    "why": c.reason,
                })
            })
            .collect(),
        named => match select_rails(&devs, named, &aff, cfg.gid_index, cfg.max_rails) {
            Ok(r) => r
                .into_iter()
                .map(|c| json!({"device": c.device, "port": c.port, "chosen": true, "why": c.reason}))
                .collect(),
            Err(e) => return json!({"error": e.detail(), "kind": e.kind()}),
        },
    };
    let max = cfg.max_rails;
    json!({"ports": ports, "max_rails": max, "numa": aff.numa_node})
}

/// GPUDirect RDMA by a real registration on the chosen NICs.
fn gpudirect(cfg: RdmaConfig) -> Value {
    let sys = crate::transport::rdma::device::gpudirect(&cfg.sys_root);
    let mut v = json!({"nvidia_peermem_loaded": sys.peermem});
    #[cfg(feature = "rdma")]
    {
        use crate::transport::rdma::nic::VerbsProvider;
        use crate::transport::rdma::MemoryKind;
        match VerbsProvider::open(cfg).and_then(|p| p.gpu_direct_path()) {
            Ok(k) => {
                v["path"] = json!(match k {
                    MemoryKind::GpuDmabuf => "dma-buf",
                    MemoryKind::GpuPeermem => "nvidia-peermem",
                    MemoryKind::Host => "host",
                });
            }
            Err(e) => {
                v["path"] = json!("none");
                v["why"] = json!(e.detail());
            }
        }
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = cfg;
        v["path"] = json!("none");
        v["why"] = json!("built without the `rdma` feature");
    }
    v
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_report_always_has_nics_and_gpudirect_entries() {
        let v = super::for_gpu(0);
        assert_eq!(v["gpu"], 0);
        // On a machine without NIC or GPU both are typed absences, never a panic.
        assert!(v["nics"].is_object(), "{v}");
        let path = v["gpudirect"]["path"].as_str().unwrap();
        assert!(["dma-buf", "nvidia-peermem", "none"].contains(&path), "{v}");
        if path == "none" {
            assert!(v["gpudirect"]["why"]
                .as_str()
                .is_some_and(|w| !w.is_empty()));
        }
    }

    #[test]
    fn the_nics_of_a_gpu_are_those_behind_its_switch() {
        let s = crate::transport::rdma::device::tests::four_nics();
        let cfg = crate::transport::rdma::RdmaConfig {
            sys_root: s.0.clone(),
            gpu_pci: Some("0000:02:00.0".into()),
            ..Default::default()
        };
        let v = super::with_config(cfg, 0);
        let ports = v["nics"]["ports"].as_array().unwrap();
        let chosen: Vec<&str> = ports
            .iter()
            .filter(|p| p["chosen"] == true)
            .map(|p| p["device"].as_str().unwrap())
            .collect();
        assert_eq!(chosen, ["mlx5_0"], "{v}");
        assert_eq!(ports.len(), 3, "every active port is listed: {v}");
        assert!(ports.iter().all(|p| !p["why"].as_str().unwrap().is_empty()));
        // the fake devices cannot be opened: GPUDirect is "none", with why
        assert_eq!(v["gpudirect"]["path"], "none");
    }
}
