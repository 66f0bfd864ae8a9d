//! GPU check for `scripts/gpu-check.sh`: kernel correctness against the CPU
//! relayout on the device, then the gather benchmark against a device-to-device
//! memcpy of the same bytes. Built here, run on a GPU host without Rust:
//!
//! ```sh
//! cargo build --release --example gpu_check --no-default-features --features cuda
//! strip -o target/gpu-check target/release/examples/gpu_check
//! ```
//!
//! Exit codes: 0 all passed (and the ratio target met, when `--min-ratio`),
//! 1 a correctness or ratio failure, 2 usage, 3 no usable kernels or device.

use clap::Parser;
use pdxfer::relayout::gpu::check::{bench, self_check, BenchParams};
use pdxfer::relayout::gpu::GpuRelayout;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "pdxfer GPU relayout check and benchmark")]
struct Args {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Random plans checked against the CPU relayout.
    #[arg(long, default_value_t = 40)]
    cases: u32,
    /// Request tokens of the benchmark.
    #[arg(long, default_value_t = 131_072)]
    tokens: u64,
    /// KV entries (layers) of the benchmark.
    #[arg(long, default_value_t = 61)]
    layers: u64,
    /// Bytes per row (576 bf16 = 1152).
    #[arg(long, default_value_t = 1152)]
    row_bytes: u64,
    /// Page size of the benchmark pools.
    #[arg(long, default_value_t = 64)]
    page_size: u64,
    /// Decode DCP sizes to benchmark.
    #[arg(long, value_delimiter = ',', default_values_t = [4u64, 16])]
    dcp: Vec<u64>,
    /// Timed iterations per measurement (after 3 warm-ups).
    #[arg(long, default_value_t = 20)]
    iters: u32,
    /// Spans per warp to try in the benchmark (the fastest is reported).
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 2, 4, 8, 16])]
    spans_per_warp: Vec<u32>,
    /// Fail (exit 1) when gather/memcpy falls below this ratio.
    #[arg(long)]
    min_ratio: Option<f64>,
    /// Skip the benchmark.
    #[arg(long)]
    no_bench: bool,
}

fn main() {
    let a = Args::parse();
    let t0 = Instant::now();
    let mut g = match GpuRelayout::new(a.device) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu-check: cannot open device {}: {e}", a.device);
            std::process::exit(3);
        }
    };
    println!(
        "device {}: {} (sm_{}{}), kernels: {:?}, nvcc at build: {}",
        a.device,
        g.device_name().unwrap_or_default(),
        g.compute_capability().0,
        g.compute_capability().1,
        g.kernel_origin(),
        pdxfer::relayout::gpu::kernels::NVCC_VERSION
    );
    let failures = self_check(&mut g, a.cases, 0x9d_2026, true);
    for f in &failures {
        eprintln!("gpu-check: FAIL: {f}");
    }
    let failed = failures.len() as u32;
    println!(
        "correctness: {} of {} random plans match the CPU relayout byte for byte ({:.1} s)",
        a.cases - failed,
        a.cases,
        t0.elapsed().as_secs_f64()
    );
    let mut code = i32::from(failed > 0);
    if !a.no_bench {
        let params = BenchParams {
            tokens: a.tokens,
            layers: a.layers,
            row_bytes: a.row_bytes,
            page_size: a.page_size,
            dcp: a.dcp.clone(),
            iters: a.iters,
            spans_per_warp: a.spans_per_warp.clone(),
        };
        match bench(&mut g, &params) {
            Ok(rows) => {
                let json: Vec<_> = rows
                    .iter()
                    .map(|r| {
                        serde_json::json!({"dcp": r.dcp, "bytes": r.bytes, "spans": r.spans,
                        "gather_ms": r.gather_ms, "spans_per_warp": r.spans_per_warp, "sweep": r.sweep, "gather_upload_ms": r.gather_upload_ms,
                        "memcpy_ms": r.memcpy_ms, "ratio": r.ratio(),
                        "ratio_with_upload": r.memcpy_ms / r.gather_upload_ms})
                    })
                    .collect();
                println!("bench-json: {}", serde_json::Value::Array(json));
                if let Some(min) = a.min_ratio {
                    for r in &rows {
                        if r.ratio() < min {
                            eprintln!(
                                "gpu-check: FAIL: DCP {} gather/memcpy {:.3} < {min}",
                                r.dcp,
                                r.ratio()
                            );
                            code = 1;
                        }
                    }
                }
            }
            Err(e) => {
                eprintln!("gpu-check: FAIL: benchmark: {e}");
                code = 1;
            }
        }
    }
    println!(
        "gpu-check: done in {:.1} s, exit {code}",
        t0.elapsed().as_secs_f64()
    );
    std::process::exit(code);
}
