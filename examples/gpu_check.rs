//! GPU check for `scripts/gpu-check.sh`: kernel correctness against the CPU
//! relayout on the device, then the gather benchmark against a device-to-device
//! memcpy of the same bytes. Built here, run on a GPU host without Rust:
//!
//! ```sh
//! cargo build --release --example gpu_check --no-default-features --features cuda
//! strip -o target/gpu-check target/release/examples/gpu_check
//! ```
//!
//! `--engine-only` runs the engine with KV pools in device memory instead: a
//! prefill engine whose pools are `cuMemAlloc`ed on the GPU sends to
//! host-memory decode ranks (DCP `--engine-dcp`) over cma in this process,
//! then the same request from host-memory pools, then device pools on both
//! sides over tcp (the decode's receiver copies each piece into its device
//! pools); every byte is verified (device pools read back) and the GB/s of
//! each is printed.
//!
//! `--layerwise` runs the layer-wise benchmark with device prefill pools
//! (`pdxfer::engine::gpu_layerwise_bench`): per layer, a kernel writes the
//! layer's rows and `pdx_spin` spins on a model stream, an event is recorded
//! and the layer is sent ordered after it (no synchronisation); against
//! whole-request (synchronise on the last layer, then one send). 1 prefill ->
//! `--engine-dcp` decode ranks over cma, `--layerwise-tokens`; prints the
//! exposed transfer time of both, every decode byte verified.
//!
//! `--summary` prints only the driver version, the embedded kernel images,
//! which one loaded, the GPUDirect RDMA route, and what the driver says of
//! GPUDirect RDMA on `cuMemAlloc` and `cuMemCreate` (with and without
//! `gpuDirectRDMACapable`) memory.
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
    /// Only run the engine with device-memory prefill pools (see the module docs).
    #[arg(long)]
    engine_only: bool,
    /// Only print the summary (driver version, embedded images, which kernel
    /// image loaded, GPUDirect RDMA) and exit: 0, or 3 when no kernels load.
    #[arg(long)]
    summary: bool,
    /// Engine check: request tokens.
    #[arg(long, default_value_t = 16_384)]
    engine_tokens: u64,
    /// Engine check: KV entries (layers).
    #[arg(long, default_value_t = 61)]
    engine_layers: u32,
    /// Engine check: decode DCP size.
    #[arg(long, default_value_t = 4)]
    engine_dcp: u32,
    /// Engine check: timed rooms per pool kind.
    #[arg(long, default_value_t = 3)]
    engine_rooms: u64,
    /// Only run the layer-wise benchmark with device prefill pools (see the module docs).
    #[arg(long)]
    layerwise: bool,
    /// Layer-wise benchmark: request lengths (tokens).
    #[arg(long, value_delimiter = ',', default_values_t = [8192u64, 32768])]
    layerwise_tokens: Vec<u64>,
    /// Layer-wise benchmark: compute time of one layer in microseconds (0:
    /// 1.5x the measured transfer time of one layer).
    #[arg(long, default_value_t = 0)]
    layerwise_layer_us: u64,
    /// Layer-wise benchmark: repetitions per mode (the median is reported).
    #[arg(long, default_value_t = 3)]
    layerwise_reps: usize,
    /// Engine check: staging bytes per worker (device and pinned host).
    #[arg(long, default_value_t = 64 << 20)]
    engine_staging: u64,
}

/// Where one engine run keeps its KV pools and how it moves them.
#[derive(Clone, Copy)]
struct EngineMode {
    /// Name in the report.
    what: &'static str,
    /// Prefill pools in device memory.
    prefill_device: bool,
    /// Decode pools in device memory (read back to verify).
    decode_device: bool,
    /// Transport of both sides.
    transport: pdxfer::transport::TransportKind,
}

/// One engine run: a prefill with pools in device or host memory sends
/// `rooms` requests of `tokens` to `dcp` decode ranks (pools in device or
/// host memory); every byte is verified (device pools read back after the
/// completion). Returns (bytes per room, best seconds per room).
fn engine_run(a: &Args, g: &GpuRelayout, m: EngineMode) -> Result<(u64, f64), String> {
    use pdxfer::bootstrap::schema::Role;
    use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
    use pdxfer::engine::synthetic::SyntheticPools;
    use pdxfer::engine::{Engine, EngineConfig, KvPoll, KvPool};
    use pdxfer::layout::{DcpLayout, Side};
    use std::time::Duration;
    let e = |x: pdxfer::Error| x.to_string();
    let (p, row, dcp, tokens) = (64u64, 1152u64, a.engine_dcp, a.engine_tokens);
    let src_n = tokens.div_ceil(p);
    let dst_n = tokens.div_ceil(p * dcp as u64);
    let server = BootstrapServer::start(ServerConfig::default()).map_err(e)?;
    let url = server.url();
    let cluster = format!("gpu-check-{}", m.what.replace(' ', "-"));
    let cluster = cluster.as_str();
    let device = m.prefill_device.then_some(g);
    let mut host = SyntheticPools::new(a.engine_layers, row, p, src_n, 4, 64).map_err(e)?;
    let mut dev = Vec::new();
    if let Some(g) = device {
        for l in 0..a.engine_layers as usize {
            dev.push(g.stream().alloc(host.layer_bytes(l).len()).map_err(e)?);
        }
    }
    let pools: Vec<KvPool> = if device.is_some() {
        host.kv_pools()
            .into_iter()
            .zip(&dev)
            .map(|(k, d)| KvPool { base: d.ptr(), ..k })
            .collect()
    } else {
        host.kv_pools()
    };
    let mut cfg = EngineConfig::new(Role::Prefill, cluster, &url, host.topology(1, 0), pools);
    cfg.pool_device = device.map(|_| a.device as u32);
    cfg.aux = host.aux_buffers();
    cfg.transport = m.transport;
    cfg.staging_bytes = a.engine_staging;
    // SAFETY: the pools (device buffers, host SyntheticPools) outlive the engine (closed below).
    let prefill = unsafe { Engine::new(cfg) }.map_err(e)?;
    let mut decode = Vec::new();
    for r in 0..dcp {
        let pools = SyntheticPools::new(a.engine_layers, row, p, dst_n, 4, 64).map_err(e)?;
        let mut bufs = Vec::new();
        let mut kv = pools.kv_pools();
        if m.decode_device {
            for (l, k) in kv.iter_mut().enumerate() {
                let b = g.stream().alloc(pools.layer_bytes(l).len()).map_err(e)?;
                g.stream().memset(&b, 0).map_err(e)?;
                k.base = b.ptr();
                bufs.push(b);
            }
            g.stream().record(false).map_err(e)?.wait().map_err(e)?;
        }
        let mut cfg = EngineConfig::new(Role::Decode, cluster, &url, pools.topology(dcp, r), kv);
        cfg.pool_device = m.decode_device.then_some(a.device as u32);
        cfg.aux = pools.aux_buffers();
        cfg.transport = m.transport;
        // SAFETY: the pools (host, or device buffers) live in `decode` beside the engine.
        decode.push((unsafe { Engine::new(cfg) }.map_err(e)?, pools, bufs));
    }
    let src_pages: Vec<u64> = (0..src_n).map(|i| (i * 7) % src_n).collect();
    let dst_pages: Vec<u64> = (0..dst_n).map(|i| (i * 5) % dst_n).collect();
    let (mut best, mut bytes) = (f64::MAX, 0u64);
    let wait = Duration::from_secs(120);
    for room in 1..=a.engine_rooms {
        let src = Side {
            layout: DcpLayout::sglang(p, 1).map_err(e)?,
            rank: 0,
            pages: &src_pages,
            origin: 0,
        };
        host.fill(room, &src, tokens);
        host.fill_aux(room, 1);
        if let Some(g) = device {
            for (l, d) in dev.iter().enumerate() {
                g.stream().upload(d, 0, host.layer_bytes(l)).map_err(e)?;
            }
            g.stream().record(false).map_err(e)?.wait().map_err(e)?;
        }
        for (d, _, _) in &decode {
            d.receiver(room, 0, Some(wait)).map_err(e)?;
            d.send_metadata(room, &dst_pages, 0, 2).map_err(e)?;
        }
        prefill.sender(room).map_err(e)?;
        let t = Instant::now();
        while prefill.poll(room) == KvPoll::Bootstrapping {
            if t.elapsed() > wait {
                return Err("the prefill never saw the decode metadata".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let t0 = Instant::now();
        prefill.send(room, &src_pages, tokens, true, 1).map_err(e)?;
        if prefill.wait(room, wait) != KvPoll::Success {
            return Err(format!("room {room} failed: {:?}", prefill.failure(room)));
        }
        let secs = t0.elapsed().as_secs_f64();
        let mut checked = 0;
        for (r, (d, pools, bufs)) in decode.iter_mut().enumerate() {
            if d.wait(room, wait) != KvPoll::Success {
                return Err(format!("decode {r} room {room}: {:?}", d.failure(room)));
            }
            // device pools: read back with a plain copy (waits for no stream)
            for (l, b) in bufs.iter().enumerate() {
                b.read(0, pools.layer_bytes_mut(l)).map_err(e)?;
            }
            let side = Side {
                layout: DcpLayout::sglang(p, dcp as u64).map_err(e)?,
                rank: r as u64,
                pages: &dst_pages,
                origin: 0,
            };
            checked += pools.verify(room, &side, tokens, Some(2)).map_err(e)?;
            d.clear(room).map_err(e)?;
        }
        prefill.clear(room).map_err(e)?;
        bytes = tokens * a.engine_layers as u64 * row;
        if checked != bytes + dcp as u64 * 64 {
            return Err(format!(
                "room {room}: verified {checked} B, expected {bytes} B of KV + aux"
            ));
        }
        best = best.min(secs);
    }
    prefill.close();
    for (d, _, _) in &decode {
        d.close();
    }
    Ok((bytes, best))
}

/// The engine check, same request each time: prefill pools in device memory
/// to host decode pools over cma, the same from host-memory pools, then
/// device pools on both sides over tcp (the decode's receiver copies into
/// its device pools).
fn engine_check(a: &Args, g: &GpuRelayout) -> i32 {
    use pdxfer::transport::TransportKind;
    let t0 = Instant::now();
    let mut code = 0;
    let modes = [
        EngineMode {
            what: "device",
            prefill_device: true,
            decode_device: false,
            transport: TransportKind::Cma,
        },
        EngineMode {
            what: "host",
            prefill_device: false,
            decode_device: false,
            transport: TransportKind::Cma,
        },
        EngineMode {
            what: "device to device",
            prefill_device: true,
            decode_device: true,
            transport: TransportKind::Tcp,
        },
    ];
    for m in modes {
        let what = m.what;
        let path = format!(
            "prefill pools in {} memory -> {} decode ranks with pools in {} memory over {}",
            if m.prefill_device { "device" } else { "host" },
            a.engine_dcp,
            if m.decode_device { "device" } else { "host" },
            m.transport.name()
        );
        match engine_run(a, g, m) {
            Ok((bytes, secs)) => {
                println!(
                    "engine: {path}: {} tokens x {} layers ({:.1} MB) in {:.1} ms = {:.2} GB/s (best of {}), every byte verified",
                    a.engine_tokens,
                    a.engine_layers,
                    bytes as f64 / 1e6,
                    secs * 1e3,
                    bytes as f64 / secs / 1e9,
                    a.engine_rooms
                );
                println!(
                    "engine-json: {}",
                    serde_json::json!({"pools": what, "decode_pools": if m.decode_device { "device" } else { "host" },
                        "transport": m.transport.name(), "dcp": a.engine_dcp, "tokens": a.engine_tokens,
                        "layers": a.engine_layers, "bytes": bytes, "seconds": secs,
                        "gb_per_s": bytes as f64 / secs / 1e9})
                );
            }
            Err(err) => {
                eprintln!("gpu-check: FAIL: engine, {path}: {err}");
                code = 1;
            }
        }
    }
    println!(
        "gpu-check: engine check done in {:.1} s, exit {code}",
        t0.elapsed().as_secs_f64()
    );
    code
}

/// `--layerwise`: the exposed transfer time, layer-wise against whole-request.
fn layerwise_check(a: &Args, g: &GpuRelayout) -> i32 {
    use pdxfer::engine::gpu_layerwise_bench::{run, GpuLayerwiseParams};
    let t0 = Instant::now();
    let p = GpuLayerwiseParams {
        device: a.device as u32,
        layers: a.engine_layers,
        row_bytes: a.row_bytes,
        tokens: a.layerwise_tokens.clone(),
        dcp: a.engine_dcp,
        page_size: a.page_size,
        layer_us: a.layerwise_layer_us,
        reps: a.layerwise_reps,
        staging_bytes: a.engine_staging,
    };
    let code = match run(g, &p) {
        Ok(points) => {
            for q in &points {
                println!(
                    "layerwise: device pools, 1 -> {} decode ranks over cma, {} tokens x {} layers x {} B ({:.1} MB), layer compute {:.3} ms: whole-request exposed {:.2} ms ({:.3} ms/layer), layer-wise exposed {:.2} ms = {:.2} layers, {} B verified",
                    p.dcp,
                    q.tokens,
                    p.layers,
                    p.row_bytes,
                    q.bytes as f64 / 1e6,
                    q.layer_ms,
                    q.whole_exposed_ms,
                    q.layer_transfer_ms,
                    q.layerwise_exposed_ms,
                    q.exposed_in_layers,
                    q.verified_bytes
                );
            }
            println!(
                "layerwise-json: {}",
                serde_json::to_string(&points).unwrap_or_default()
            );
            0
        }
        Err(e) => {
            eprintln!("gpu-check: FAIL: layerwise: {e}");
            1
        }
    };
    println!(
        "gpu-check: layerwise done in {:.1} s, exit {code}",
        t0.elapsed().as_secs_f64()
    );
    code
}

/// `--summary`: driver version, the embedded images, which kernel image
/// loaded (or why none), and GPUDirect RDMA (a real registration where an
/// RDMA device exists).
fn summary(a: &Args) -> Option<GpuRelayout> {
    use pdxfer::relayout::gpu::kernels;
    match pdxfer::cuda::probe() {
        Ok(i) => println!("gpu-check: driver: {}", i.describe()),
        Err(e) => println!("gpu-check: driver: none ({e})"),
    }
    let images: Vec<String> = kernels::IMAGES.iter().map(|i| i.describe()).collect();
    println!(
        "gpu-check: embedded images: {}",
        if images.is_empty() {
            "none (NVRTC only)".to_string()
        } else {
            images.join("; ")
        }
    );
    let g = match GpuRelayout::new(a.device) {
        Ok(g) => {
            println!("gpu-check: kernels: {}", g.kernel_origin());
            Some(g)
        }
        Err(e) => {
            println!("gpu-check: kernels: none: {e}");
            None
        }
    };
    println!(
        "gpu-check: gpudirect: {}",
        pdxfer::cuda::gpudirect_summary(a.device)
    );
    match pdxfer::cuda::probe_vmm_gpudirect(a.device) {
        Ok(v) => println!("gpu-check: gpudirect on VMM memory: {}", v.describe()),
        Err(e) => println!("gpu-check: gpudirect on VMM memory: not asked: {e}"),
    }
    g
}

fn main() {
    let a = Args::parse();
    let t0 = Instant::now();
    if a.summary {
        std::process::exit(if summary(&a).is_some() { 0 } else { 3 });
    }
    let mut g = match GpuRelayout::new(a.device) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu-check: cannot open device {}: {e}", a.device);
            std::process::exit(3);
        }
    };
    println!(
        "device {}: {} (sm_{}{}), driver CUDA {}, kernels: {}",
        a.device,
        g.stream().device_name().unwrap_or_default(),
        g.compute_capability().0,
        g.compute_capability().1,
        pdxfer::cuda::version_text(g.driver_version()),
        g.kernel_origin(),
    );
    if a.engine_only {
        std::process::exit(engine_check(&a, &g));
    }
    if a.layerwise {
        std::process::exit(layerwise_check(&a, &g));
    }
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
