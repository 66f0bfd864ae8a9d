//! The `pdxfer` command line: `info`, `plan`, `bootstrap`, `rank` (more
//! subcommands join as their layers land).

mod bench;
mod bootstrap;
mod plan;
mod rank;
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
    },
    /// Show where each token of a request goes, per (prefill rank, decode rank).
    Plan(plan::PlanArgs),
    /// Run a receiving peer (registers zeroed regions, prints completions).
    Target(target::TargetArgs),
    /// Measure a transport between two processes (initiator and target).
    Bench(bench::BenchArgs),
    /// Run the standalone bootstrap server (HTTP/JSON; /health, /metrics).
    Bootstrap(bootstrap::BootstrapArgs),
    /// A stand-in engine rank for bootstrap tests and demos (register, hello, pair).
    Rank(rank::RankArgs),
}

/// Runs the CLI; returns the process exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Info { json } => info(json),
        Cmd::Plan(a) => plan::run(&a),
        Cmd::Target(a) => target::run(&a),
        Cmd::Bench(a) => bench::run(&a),
        Cmd::Bootstrap(a) => bootstrap::run(&a),
        Cmd::Rank(a) => rank::run(&a),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("pdxfer: error: {e}");
            2
        }
    }
}

fn info(json: bool) -> crate::Result<()> {
    let cuda = crate::relayout::gpu::probe();
    let nvrtc = crate::relayout::gpu::probe_nvrtc();
    let nccl = crate::transport::nccl::probe();
    let rdma = crate::transport::rdma::list_devices();
    let show = |r: std::result::Result<String, crate::Error>| match r {
        Ok(s) => serde_json::json!({"available": true, "detail": s}),
        Err(e) => {
            serde_json::json!({"available": false, "kind": e.kind(), "code": e.status() as i32, "detail": e.detail()})
        }
    };
    let v = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "abi_version": format!("{}.{}", crate::ABI_VERSION_MAJOR, crate::ABI_VERSION_MINOR),
        "features": {"rdma": cfg!(feature = "rdma"), "cuda": cfg!(feature = "cuda"), "nccl": cfg!(feature = "nccl")},
        "cuda": show(cuda.map(|i| format!("{} device(s)", i.device_count))),
        "nvrtc": show(nvrtc.map(|_| "loaded".to_string())),
        "nccl": show(nccl.map(|v| format!("version {v}"))),
        "rdma": show(rdma.map(|d| d.iter().map(|x| x.name.clone()).collect::<Vec<_>>().join(","))),
    });
    if json {
        println!("{v}");
    } else {
        println!(
            "pdxfer {} (ABI {})",
            env!("CARGO_PKG_VERSION"),
            v["abi_version"].as_str().unwrap_or("")
        );
        for k in ["cuda", "nvrtc", "nccl", "rdma"] {
            let e = &v[k];
            let state = if e["available"].as_bool() == Some(true) {
                "yes"
            } else {
                "no "
            };
            println!(
                "  {k:<6} {state}  {}{}",
                e["kind"]
                    .as_str()
                    .map(|k| format!("[{k}] "))
                    .unwrap_or_default(),
                e["detail"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}
