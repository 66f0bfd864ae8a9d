//! `pdxfer info --gpu N`: the RDMA report for one GPU
//! ([`pdxfer::transport::rdma::report`]) in words.

use serde_json::Value;

/// The report in words.
pub(super) fn print(v: &Value) {
    println!("RDMA for GPU {}", v["gpu"]);
    if let Some(e) = v["error"].as_str() {
        println!("  error: {e}");
        return;
    }
    match v["gpu_pci"].as_str() {
        Some(p) => println!("  GPU PCI address: {p}"),
        None => println!("  GPU PCI address: unknown (no driver answer; set PDXFER_RDMA_GPU_PCI): NICs chosen by NUMA node"),
    }
    let n = &v["nics"];
    match n["ports"].as_array() {
        Some(ports) => {
            println!("  NICs found (active ports): {}", ports.len());
            for p in ports {
                println!(
                    "    {} {}:{}  pci {}  numa {}  {}",
                    if p["chosen"].as_bool() == Some(true) {
                        "chosen   "
                    } else {
                        "left out "
                    },
                    p["device"].as_str().unwrap_or("?"),
                    p["port"],
                    p["pci"].as_str().unwrap_or("?"),
                    p["numa"],
                    p["why"].as_str().unwrap_or("")
                );
            }
            if n["max_rails"].as_u64().unwrap_or(0) > 0 {
                println!(
                    "    (PDXFER_RDMA_MAX_RAILS={} keeps the first ones)",
                    n["max_rails"]
                );
            }
        }
        None => println!("  NICs: none ({})", n["error"].as_str().unwrap_or("?")),
    }
    let g = &v["gpudirect"];
    println!(
        "  GPUDirect RDMA: {}{}  (nvidia_peermem {})",
        g["path"].as_str().unwrap_or("none"),
        g["why"]
            .as_str()
            .map(|w| format!(": {w}"))
            .unwrap_or_else(|| " (a real registration of device memory worked)".into()),
        if g["nvidia_peermem_loaded"].as_bool() == Some(true) {
            "loaded"
        } else {
            "not loaded"
        }
    );
    println!(
        "  QP timeout {} (4.096 us x 2^t per attempt), retry_cnt {}; RoCE traffic class {}{}",
        v["qp_timeout"],
        v["retry_cnt"],
        v["traffic_class"],
        if v["traffic_class"].as_u64() == Some(0) {
            " (default class; set PDXFER_RDMA_TRAFFIC_CLASS to the fabric's lossless class)"
        } else {
            ""
        }
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_report_prints_whatever_the_machine() {
        let v = pdxfer::transport::rdma::report::for_gpu(0);
        assert!(v["nics"].is_object() && v["gpudirect"].is_object(), "{v}");
        super::print(&v);
    }
}
