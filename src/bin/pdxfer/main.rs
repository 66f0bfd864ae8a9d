//! The `pdxfer` command line: `info`, `plan`, `demo`, `target`, `bench`,
//! `bootstrap`, `rank`, `rdma-bench`, `bench-request`, `bench-cp`. It lives in the binary, not in the
//! library, so `libpdxfer.so` does not link clap, plotters or indicatif.

mod bench;
mod bench_args;
mod bootstrap;
mod cp_bench;
mod demo;
mod layerwise_bench;
mod libraries;
mod logging;
#[cfg(feature = "nccl")]
mod nccl_bench;
mod plan;
mod rank;
mod rank_proc;
mod rdma_bench;
mod rdma_gpu;
mod request_bench;
mod request_shape;
mod target;

use clap::{Parser, Subcommand};

/// pdxfer: KV-cache transfer for prefill/decode disaggregated serving.
#[derive(Parser, Debug)]
#[command(name = "pdxfer", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// What transports and devices are usable here.
    Info {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Also report RDMA for CUDA device N: the NICs chosen for it and
        /// why, and GPUDirect RDMA tested by a real registration.
        #[arg(long)]
        gpu: Option<u32>,
    },
    /// Show where each token of a request goes, per (prefill rank, decode rank).
    Plan(plan::PlanArgs),
    /// The main job: bootstrap, 1 prefill and N decode DCP processes, verified transfers.
    Demo(demo::DemoArgs),
    /// One engine process of `pdxfer demo` (driven by JSON lines on stdin).
    #[command(hide = true)]
    DemoRank(demo::DemoRankArgs),
    /// Run a receiving peer (registers zeroed regions, prints completions).
    Target(target::TargetArgs),
    /// Measure a transport between two processes (initiator and target).
    Bench(bench_args::BenchArgs),
    /// Run the standalone bootstrap server (HTTP/JSON; /health, /metrics).
    Bootstrap(bootstrap::BootstrapArgs),
    /// A stand-in engine rank for bootstrap tests and demos (register, hello, pair).
    Rank(rank::RankArgs),
    /// RDMA bandwidth through pdxfer's RDMA transport (one host, or --serve/--connect).
    RdmaBench(rdma_bench::RdmaBenchArgs),
    /// One PD request through the engine (1 prefill -> N decode processes) against memcpy and iperf3.
    BenchRequest(request_bench::RequestBenchArgs),
    /// One engine process of `pdxfer bench-request` (driven by JSON lines on stdin).
    #[command(hide = true)]
    BenchRequestRank(request_bench::RequestRankArgs),
    /// One PD request from prefill attention CP processes to decode DCP processes: rank-0 vs all-CP-ranks mode.
    BenchCp(cp_bench::CpBenchArgs),
}

fn main() {
    std::process::exit(run());
}

/// Runs the CLI; returns the process exit code.
fn run() -> i32 {
    let cli = Cli::parse();
    logging::init();
    let r = match cli.cmd {
        Cmd::Info { json, gpu } => info(json, gpu),
        Cmd::Plan(a) => plan::run(&a),
        Cmd::Demo(a) => demo::run(&a),
        Cmd::DemoRank(a) => demo::run_rank(&a),
        Cmd::Target(a) => target::run(&a),
        Cmd::Bench(a) => bench::run(&a),
        Cmd::Bootstrap(a) => bootstrap::run(&a),
        Cmd::Rank(a) => rank::run(&a),
        Cmd::RdmaBench(a) => rdma_bench::run(&a),
        Cmd::BenchRequest(a) => request_bench::run(&a),
        Cmd::BenchRequestRank(a) => request_bench::run_rank(&a),
        Cmd::BenchCp(a) => cp_bench::run(&a),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("pdxfer: error: {e}");
            2
        }
    }
}

fn info(json: bool, gpu: Option<u32>) -> pdxfer::Result<()> {
    let cuda = pdxfer::cuda::probe();
    let nvrtc = pdxfer::relayout::gpu::probe_nvrtc();
    // which kernel image device 0's driver loads (only where a device exists)
    let kernels = match &cuda {
        Ok(i) if i.device_count > 0 => pdxfer::relayout::gpu::probe_kernels(0),
        Ok(_) => Err(pdxfer::Error::new(pdxfer::Status::Cuda, "no CUDA device")),
        Err(e) => Err(e.clone()),
    };
    let nccl = pdxfer::transport::nccl::probe();
    let rdma = pdxfer::transport::rdma::list_devices();
    let rdma_json = rdma_info(&rdma);
    let show = |r: std::result::Result<String, pdxfer::Error>| match r {
        Ok(s) => serde_json::json!({"available": true, "detail": s}),
        Err(e) => {
            serde_json::json!({"available": false, "kind": e.kind(), "code": e.status() as i32, "detail": e.detail()})
        }
    };
    let mut v = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "abi_version": format!("{}.{}", pdxfer::ABI_VERSION_MAJOR, pdxfer::ABI_VERSION_MINOR),
        "features": {"rdma": cfg!(feature = "rdma"), "cuda": cfg!(feature = "cuda"), "nccl": cfg!(feature = "nccl")},
        "cuda": show(cuda.map(|i| i.describe())),
        "kernels": show(kernels),
        "kernel_images": libraries::kernel_images(),
        "libraries": libraries::libraries(),
        "nvrtc": show(nvrtc),
        "nccl": show(nccl.map(|(v, path)| format!("version {}.{}.{} ({path})", v / 10000, v / 100 % 100, v % 100))),
        "rdma": rdma_json,
    });
    if let Some(g) = gpu {
        v["rdma_for_gpu"] = pdxfer::transport::rdma::report::for_gpu(g);
    }
    if json {
        println!("{v}");
    } else {
        println!(
            "pdxfer {} (ABI {})",
            env!("CARGO_PKG_VERSION"),
            v["abi_version"].as_str().unwrap_or("")
        );
        for k in ["cuda", "kernels", "nvrtc", "nccl", "rdma"] {
            let e = &v[k];
            let state = if e["available"].as_bool() == Some(true) {
                "yes"
            } else {
                "no "
            };
            println!(
                "  {k:<7} {state}  {}{}",
                e["kind"]
                    .as_str()
                    .map(|k| format!("[{k}] "))
                    .unwrap_or_default(),
                e["detail"].as_str().unwrap_or("")
            );
        }
        if let Ok(devs) = &rdma {
            print_rdma_devices(devs);
        }
        libraries::print(&v["libraries"], &v["kernel_images"]);
        if gpu.is_some() {
            rdma_gpu::print(&v["rdma_for_gpu"]);
        }
    }
    Ok(())
}

/// The `rdma` object of `pdxfer info --json`: availability plus every device,
/// port (state, link layer, rate, active MTU, LID) and populated GID.
fn rdma_info(r: &pdxfer::Result<Vec<pdxfer::transport::rdma::RdmaDevice>>) -> serde_json::Value {
    match r {
        Err(e) => {
            serde_json::json!({"available": false, "kind": e.kind(), "code": e.status() as i32, "detail": e.detail(), "devices": []})
        }
        Ok(devs) => {
            let usable: Vec<&str> = devs
                .iter()
                .filter(|d| d.verbs_error.is_none() && d.ports.iter().any(|p| p.active))
                .map(|d| d.name.as_str())
                .collect();
            let summary = devs
                .iter()
                .map(|d| {
                    let ports = d
                        .ports
                        .iter()
                        .map(|p| format!("port {} {} {}", p.num, p.state, p.link_layer))
                        .collect::<Vec<_>>()
                        .join(", ");
                    format!("{} ({ports})", d.name)
                })
                .collect::<Vec<_>>()
                .join("; ");
            let mut v = if usable.is_empty() {
                let why = devs
                    .iter()
                    .find_map(|d| d.verbs_error.clone())
                    .unwrap_or_else(|| "no port is ACTIVE".to_string());
                let st = pdxfer::Status::NoRdmaDevice;
                serde_json::json!({"available": false, "kind": st.kind(), "code": st as i32,
                    "detail": format!("no usable RDMA device: {summary}: {why}")})
            } else {
                serde_json::json!({"available": true, "detail": format!("{} usable: {summary}", usable.join(","))})
            };
            v["devices"] = serde_json::to_value(devs).unwrap_or_default();
            v["gpudirect"] = serde_json::to_value(pdxfer::transport::rdma::device::gpudirect(
                std::path::Path::new("/sys"),
            ))
            .unwrap_or_default();
            v
        }
    }
}

fn print_rdma_devices(devs: &[pdxfer::transport::rdma::RdmaDevice]) {
    let g = pdxfer::transport::rdma::device::gpudirect(std::path::Path::new("/sys"));
    println!(
        "         GPUDirect RDMA: nvidia_peermem {}, nvidia driver {}",
        if g.peermem { "loaded" } else { "not loaded" },
        if g.nvidia { "loaded" } else { "not loaded" }
    );
    for d in devs {
        println!(
            "         {}  pci {}  numa {}  fw {}{}",
            d.name,
            d.pci_addr.as_deref().unwrap_or("?"),
            d.numa_node
                .map(|n| n.to_string())
                .unwrap_or_else(|| "?".into()),
            d.fw_ver.as_deref().unwrap_or("?"),
            d.verbs_error
                .as_deref()
                .map(|e| format!("  (verbs: {e})"))
                .unwrap_or_default()
        );
        for p in &d.ports {
            println!(
                "           port {} {} ({}) {}  {}  mtu {}  lid {:#x}",
                p.num,
                p.state,
                p.phys_state,
                p.link_layer,
                p.rate,
                p.active_mtu
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| "?".into()),
                p.lid
            );
            for g in &p.gids {
                println!(
                    "             gid[{}] {} {} {}",
                    g.index,
                    g.gid,
                    g.kind.as_deref().unwrap_or(""),
                    g.netdev.as_deref().unwrap_or("")
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::{Path, PathBuf};

    /// A fake sysfs tree (`class/infiniband`, `class/net`, `devices`) in a
    /// fresh temp dir; removed on drop.
    struct FakeSys(PathBuf);

    impl Drop for FakeSys {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn w(p: &Path, s: &str) {
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, s).unwrap();
    }

    impl FakeSys {
        fn new(tag: &str) -> FakeSys {
            let p = std::env::temp_dir().join(format!(
                "pdxfer-cli-sysfs-{tag}-{}-{:x}",
                std::process::id(),
                pdxfer::transport::rdma::handshake::random_u64()
            ));
            fs::create_dir_all(&p).unwrap();
            FakeSys(p)
        }

        /// A RoCE NIC with one port in `state` and four populated GIDs.
        fn nic(&self, name: &str, pci: &str, numa: i32, state: &str) {
            let dev = self.0.join("devices").join(pci);
            w(&dev.join("numa_node"), &format!("{numa}\n"));
            let ib = self.0.join("class/infiniband").join(name);
            fs::create_dir_all(&ib).unwrap();
            std::os::unix::fs::symlink(&dev, ib.join("device")).unwrap();
            w(&ib.join("node_guid"), "0002:c903:0000:0001\n");
            w(&ib.join("fw_ver"), "28.39.1002\n");
            let port = ib.join("ports/1");
            w(&port.join("state"), state);
            w(&port.join("phys_state"), "5: LinkUp\n");
            w(&port.join("link_layer"), "Ethernet\n");
            w(&port.join("lid"), "0x0005\n");
            w(&port.join("rate"), "200 Gb/sec (4X HDR)\n");
            let ll = "fe80:0000:0000:0000:0202:c9ff:fe00:0001\n";
            let v4 = "0000:0000:0000:0000:0000:ffff:0a00:0001\n";
            let (v1, v2) = ("IB/RoCE v1\n", "RoCE v2\n");
            for (i, g, kind) in [(0, ll, v1), (1, ll, v2), (2, v4, v1), (3, v4, v2)] {
                w(&port.join("gids").join(i.to_string()), g);
                w(&port.join("gid_attrs/types").join(i.to_string()), kind);
                w(
                    &port.join("gid_attrs/ndevs").join(i.to_string()),
                    &format!("eth_{name}\n"),
                );
            }
            let mtu = self.0.join("class/net").join(format!("eth_{name}/mtu"));
            w(&mtu, "9000\n");
        }
    }

    #[test]
    fn rdma_info_lists_devices_ports_gids_and_reasons() {
        let fake = FakeSys::new("two");
        fake.nic(
            "mlx5_0",
            "pci0000:00/0000:00:01.0/0000:01:00.0",
            0,
            "4: ACTIVE\n",
        );
        fake.nic(
            "mlx5_3",
            "pci0000:80/0000:80:02.0/0000:82:00.0",
            1,
            "1: DOWN\n",
        );
        let r = pdxfer::transport::rdma::list_devices_at(&fake.0);
        let v = super::rdma_info(&r);
        // The fake NICs are not openable by libibverbs: listed, but not available.
        assert_eq!(v["available"], false);
        assert_eq!(v["kind"], "no_rdma_device");
        assert_eq!(v["code"], -700);
        let devs = v["devices"].as_array().unwrap();
        assert_eq!(devs.len(), 2);
        assert_eq!(devs[0]["name"], "mlx5_0");
        assert_eq!(devs[0]["numa_node"], 0);
        assert_eq!(devs[0]["ports"][0]["state"], "ACTIVE");
        assert_eq!(devs[0]["ports"][0]["active_mtu"], 4096);
        assert_eq!(devs[0]["ports"][0]["link_layer"], "Ethernet");
        assert_eq!(devs[0]["ports"][0]["gids"][3]["kind"], "RoCE v2");
        assert_eq!(devs[1]["name"], "mlx5_3");
        assert_eq!(devs[1]["ports"][0]["state"], "DOWN");
        assert!(v["detail"]
            .as_str()
            .unwrap()
            .contains("mlx5_3 (port 1 DOWN Ethernet)"));

        let empty = FakeSys::new("info-empty");
        let v = super::rdma_info(&pdxfer::transport::rdma::list_devices_at(&empty.0));
        assert_eq!(v["available"], false);
        assert_eq!(v["code"], -700);
        assert!(v["detail"].as_str().unwrap().contains("class/infiniband"));
    }
}
