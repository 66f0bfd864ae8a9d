//! `pdxfer bench --transport nccl`: a prefill engine on one GPU and a decode
//! engine on another, in this process, with KV pools in device memory and
//! transport nccl; per room size (`--block-sizes`: KV bytes per room) it
//! times whole rooms (from the prefill's `sender` to the decode's
//! `Success`) and checks every byte of the last room against the synthetic
//! source. Without NCCL it fails with `no_nccl` (the paths tried), without
//! a driver `no_cuda_driver`, and with fewer than two GPUs (NCCL needs one
//! per rank) `unsupported` unless `--nccl-gpus` names the two.

use crate::bench_args::{parse_size, BenchArgs};
use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::cuda::DeviceBuffer;
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, EngineConfig, KvPoll, KvPool};
use pdxfer::error::{Error, Result, Status};
use pdxfer::layout::{DcpLayout, Side};
use pdxfer::relayout::gpu::GpuRelayout;
use pdxfer::transport::TransportKind;
use std::time::{Duration, Instant};

/// KV entries (layers) of the benchmark's pools.
const LAYERS: u32 = 8;
/// Bytes per row of one entry (an MLA row of 576 bf16 values).
const ROW: u64 = 1152;
/// Tokens per page.
const PAGE: u64 = 64;

/// The (prefill, decode) GPU ordinals.
fn gpus(a: &BenchArgs, count: i32) -> Result<(u32, u32)> {
    if let Some(s) = &a.nccl_gpus {
        let v: Vec<u32> = s
            .split(',')
            .map(|x| x.trim().parse::<u32>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| {
                Error::invalid(format!("--nccl-gpus {s:?}: want two ordinals, e.g. 0,1"))
            })?;
        return match v[..] {
            [p, d] => Ok((p, d)),
            _ => Err(Error::invalid(format!(
                "--nccl-gpus {s:?}: want two ordinals, e.g. 0,1"
            ))),
        };
    }
    if count < 2 {
        return Err(Error::new(
            Status::Unsupported,
            format!(
                "transport nccl needs one GPU per rank (NCCL does not run two ranks of one communicator on one GPU), and this host has {count}; run it where two GPUs are visible, or name them with --nccl-gpus P,D"
            ),
        ));
    }
    Ok((0, 1))
}

/// Device copies of a synthetic pool set on `g`'s GPU, and the pools naming them.
fn on_device(g: &GpuRelayout, pools: &SyntheticPools) -> Result<(Vec<DeviceBuffer>, Vec<KvPool>)> {
    let bufs = (0..LAYERS as usize)
        .map(|l| g.stream().alloc(pools.layer_bytes(l).len()))
        .collect::<Result<Vec<_>>>()?;
    let kv = pools
        .kv_pools()
        .into_iter()
        .zip(&bufs)
        .map(|(p, d)| KvPool { base: d.ptr(), ..p })
        .collect();
    Ok((bufs, kv))
}

/// One rank's view of a room's pages (DCP 1, from position 0).
fn side(pages: &[u64]) -> Result<Side<'_>> {
    Ok(Side {
        layout: DcpLayout::sglang(PAGE, 1)?,
        rank: 0,
        pages,
        origin: 0,
    })
}

/// Runs the nccl benchmark.
pub fn run(a: &BenchArgs) -> Result<()> {
    let (version, path) = pdxfer::transport::nccl::probe()?;
    let info = pdxfer::cuda::probe()?;
    let (pg, dg) = gpus(a, info.device_count)?;
    let token = LAYERS as u64 * ROW;
    let sizes: Vec<u64> = a
        .block_sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_>>()?;
    let max_tokens = sizes.iter().map(|s| s.div_ceil(token)).max().unwrap_or(1);
    let pages = max_tokens.div_ceil(PAGE) + 1;
    let server = BootstrapServer::start(ServerConfig::default())?;
    let url = server.url();
    let cluster = format!("nccl-bench-{}", std::process::id());
    let gp = GpuRelayout::new(pg as usize)?;
    let gd = GpuRelayout::new(dg as usize)?;
    let mut host = SyntheticPools::new(LAYERS, ROW, PAGE, pages, 4, 64)?;
    let mut mirror = SyntheticPools::new(LAYERS, ROW, PAGE, pages, 4, 64)?;
    let (src_bufs, src_kv) = on_device(&gp, &host)?;
    let (dst_bufs, dst_kv) = on_device(&gd, &mirror)?;
    let mut pcfg = EngineConfig::new(Role::Prefill, &cluster, &url, host.topology(1, 0), src_kv);
    pcfg.pool_device = Some(pg);
    pcfg.aux = host.aux_buffers();
    pcfg.transport = TransportKind::Nccl;
    let mut dcfg = EngineConfig::new(Role::Decode, &cluster, &url, mirror.topology(1, 0), dst_kv);
    dcfg.pool_device = Some(dg);
    dcfg.aux = mirror.aux_buffers();
    dcfg.transport = TransportKind::Nccl;
    // SAFETY: the device pools and aux buffers live until the engines are closed below.
    let prefill = unsafe { Engine::new(pcfg) }?;
    // SAFETY: as above.
    let decode = unsafe { Engine::new(dcfg) }?;
    eprintln!(
        "nccl bench: NCCL {}.{}.{} ({path}), prefill on GPU {pg}, decode on GPU {dg}, {LAYERS} entries of {ROW} B rows, pages of {PAGE}",
        version / 10000,
        version / 100 % 100,
        version % 100
    );
    let mut points = Vec::new();
    let mut room = 0u64;
    let result = (|| -> Result<()> {
        for &size in &sizes {
            let tokens = size.div_ceil(token).max(1);
            let src_pages: Vec<u64> = (0..tokens.div_ceil(PAGE)).collect();
            let dst_pages: Vec<u64> = (0..tokens.div_ceil(PAGE)).rev().collect();
            let seed = room + 1;
            host.fill(seed, &side(&src_pages)?, tokens);
            host.fill_aux(seed, 1);
            for (l, b) in src_bufs.iter().enumerate() {
                gp.stream().upload(b, 0, host.layer_bytes(l))?;
            }
            gp.stream().record(false)?.wait()?;
            let t_end = Instant::now() + Duration::from_millis(a.max_ms);
            let mut times = Vec::new();
            while times.len() < a.iters.max(2) && (times.len() < 2 || Instant::now() < t_end) {
                room += 1;
                let last = times.len() + 1 >= a.iters.max(2) || Instant::now() >= t_end;
                if last {
                    // the checked room lands in zeroed pools
                    for b in &dst_bufs {
                        gd.stream().memset(b, 0)?;
                    }
                    gd.stream().record(false)?.wait()?;
                }
                decode.receiver(room, 0, Some(Duration::from_secs(60)))?;
                decode.send_metadata(room, &dst_pages, 0, 2)?;
                let t0 = Instant::now();
                prefill.sender(room)?;
                while prefill.poll(room) == KvPoll::Bootstrapping {
                    if t0.elapsed() > Duration::from_secs(30) {
                        return Err(Error::new(
                            Status::Timeout,
                            "the decode's metadata never arrived",
                        ));
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
                prefill.send(room, &src_pages, tokens, true, 1)?;
                if decode.wait(room, Duration::from_secs(60)) != KvPoll::Success {
                    return Err(decode.failure(room).unwrap_or_else(|| {
                        Error::new(Status::Timeout, format!("room {room} did not finish"))
                    }));
                }
                times.push(t0.elapsed().as_secs_f64());
                prefill.wait(room, Duration::from_secs(10));
                prefill.clear(room)?;
                decode.clear(room)?;
                if last {
                    for (l, b) in dst_bufs.iter().enumerate() {
                        b.read(0, mirror.layer_bytes_mut(l))?;
                    }
                    mirror.verify(seed, &side(&dst_pages)?, tokens, Some(2))?;
                    break;
                }
            }
            times.sort_by(f64::total_cmp);
            let bytes = tokens * token;
            let p50 = times[times.len() / 2];
            let gbps = bytes as f64 / p50 / 1e9;
            println!(
                "nccl  room {:>12} B  {:>5} rooms  p50 {:>9.3} ms  {gbps:>8.2} GB/s  (every byte of the last room checked)",
                bytes,
                times.len(),
                p50 * 1e3
            );
            points.push(serde_json::json!({
                "transport": "nccl",
                "room_bytes": bytes,
                "rooms": times.len(),
                "p50_ms": p50 * 1e3,
                "gb_per_s": gbps,
                "verified": true,
            }));
        }
        Ok(())
    })();
    prefill.close();
    decode.close();
    result?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({"transport": "nccl", "prefill_gpu": pg, "decode_gpu": dg, "points": points})
        );
    }
    Ok(())
}
