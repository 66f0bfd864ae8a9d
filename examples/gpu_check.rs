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
use pdxfer::layout::{PackLayout, SglangChunk};
use pdxfer::relayout::gpu::{DeviceBuffer, GpuRelayout};
use pdxfer::relayout::{self, cpu, CopyEntry};
use pdxfer::Status;
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
    /// Fail (exit 1) when gather/memcpy falls below this ratio.
    #[arg(long)]
    min_ratio: Option<f64>,
    /// Skip the benchmark.
    #[arg(long)]
    no_bench: bool,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    fn pages(&mut self, k: usize, n: u64) -> Vec<u64> {
        let mut all: Vec<u64> = (0..n).collect();
        for i in 0..k {
            let j = i + self.below(n - i as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

type Res<T> = Result<T, pdxfer::Error>;

fn fail(msg: String) -> pdxfer::Error {
    pdxfer::Error::new(Status::Relayout, msg)
}

/// One random plan on the device, gather + scatter + sliced gather, compared
/// byte for byte with `relayout::cpu`.
fn check_case(g: &mut GpuRelayout, rng: &mut Rng, case: u32, big: bool) -> Res<()> {
    let p = if big {
        64
    } else {
        rng.pick(&[1u64, 2, 16, 64])
    };
    let d = if big {
        4
    } else {
        rng.pick(&[1u64, 2, 3, 4, 8, 16])
    };
    let r = rng.below(d);
    let src_n = if big { 64 } else { 1 + rng.below(12) as usize };
    let n = if big {
        4096
    } else {
        1 + rng.below(src_n as u64 * p)
    };
    let src_pool_pages = src_n as u64 + rng.below(4);
    let src_pages = rng.pages(src_n, src_pool_pages);
    let need = n.div_ceil(p * d) as usize;
    let dst_pool_pages = need as u64 + rng.below(4);
    let dst_pages = rng.pages(need, dst_pool_pages);
    let chunk = SglangChunk {
        src_pages: &src_pages,
        dst_pages: &dst_pages,
        page_size: p,
        dcp_size: d,
        dcp_rank: r,
        src_page_offset: 0,
        decode_prefix_len: 0,
        num_tokens: Some(n),
    };
    let req = chunk.to_pair()?;
    let gspans = relayout::gather_spans(&req)?;
    let sspans = relayout::scatter_spans(&req)?;
    let tokens = req.token_count();
    let entries = if big { 61 } else { 1 + rng.below(6) as usize };
    let row_bytes: Vec<u64> = (0..entries)
        .map(|_| {
            if big {
                1152
            } else {
                rng.pick(&[1u64, 3, 16, 48, 100, 576, 1152, 1168])
            }
        })
        .collect();
    let pack = PackLayout::new(tokens, &row_bytes)?;

    // Host pools and the CPU reference.
    let pools: Vec<Vec<u8>> = row_bytes
        .iter()
        .map(|&rb| rng.bytes((src_pool_pages * p * rb) as usize))
        .collect();
    let junk = rng.bytes(pack.total_bytes as usize);
    let mut want = junk.clone();
    let refs: Vec<&[u8]> = pools.iter().map(|v| v.as_slice()).collect();
    cpu::gather(&refs, &row_bytes, &gspans, &pack, &mut want)?;

    // Device pools at random misalignment (same or different per entry).
    let mis = |rng: &mut Rng| if big { 0 } else { rng.below(16) };
    let mut dev_pools: Vec<(DeviceBuffer, u64)> = Vec::new();
    for v in &pools {
        let off = mis(rng);
        let b = g.alloc(v.len() + 16)?;
        g.upload(&b, off as usize, v)?;
        dev_pools.push((b, off));
    }
    let pack_off = mis(rng);
    let dpack = g.alloc(pack.total_bytes as usize + 16)?;
    g.upload(&dpack, pack_off as usize, &junk)?;
    let bases: Vec<u64> = dev_pools.iter().map(|(b, o)| b.ptr() + o).collect();
    let ents: Vec<CopyEntry> =
        relayout::gather_entries(&bases, &row_bytes, dpack.ptr() + pack_off, &pack)?;
    // SAFETY: every span was bounds-checked by cpu::gather on the same shapes,
    // and the device buffers have those sizes.
    let ev = unsafe { g.gather(&ents, &gspans)? };
    ev.wait()?;
    let mut got = vec![0u8; junk.len()];
    g.download(&dpack, pack_off as usize, &mut got)?;
    if got != want {
        let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        return Err(fail(format!(
            "case {case}: GPU gather differs from the CPU at byte {first} (P={p} D={d} r={r} n={n} rows={row_bytes:?})"
        )));
    }

    // Scatter into destination pools.
    let dst_init: Vec<Vec<u8>> = row_bytes
        .iter()
        .map(|&rb| rng.bytes((dst_pool_pages * p * rb) as usize))
        .collect();
    let mut cpu_dst = dst_init.clone();
    {
        let mut r: Vec<&mut [u8]> = cpu_dst.iter_mut().map(|v| v.as_mut_slice()).collect();
        cpu::scatter(&want, &pack, &row_bytes, &sspans, &mut r)?;
    }
    let mut dev_dst = Vec::new();
    for v in &dst_init {
        let off = mis(rng);
        let b = g.alloc(v.len() + 16)?;
        g.upload(&b, off as usize, v)?;
        dev_dst.push((b, off));
    }
    let dbases: Vec<u64> = dev_dst.iter().map(|(b, o)| b.ptr() + o).collect();
    let ents = relayout::scatter_entries(&dbases, &row_bytes, dpack.ptr() + pack_off, &pack)?;
    // SAFETY: as above, checked by cpu::scatter.
    let ev = unsafe { g.scatter(&ents, &sspans)? };
    ev.wait()?;
    for (e, ((b, off), w)) in dev_dst.iter().zip(&cpu_dst).enumerate() {
        let mut got = vec![0u8; w.len()];
        g.download(b, *off as usize, &mut got)?;
        if &got != w {
            return Err(fail(format!(
                "case {case}: GPU scatter differs from the CPU at entry {e} (P={p} D={d} r={r} n={n})"
            )));
        }
    }

    // Sliced gather through a small staging buffer: each slice must equal the
    // CPU gather of the same tokens.
    let per_token: u64 = row_bytes.iter().sum();
    let slice_tokens = 1 + rng.below(tokens.max(1));
    let staging = g.alloc((2 * slice_tokens * per_token) as usize)?;
    let mut seen = 0u64;
    // SAFETY: pool bases as above; spans checked by cpu::gather.
    unsafe {
        g.gather_sliced(&bases, &row_bytes, &gspans, &staging, |s, ev| {
            ev.wait()?;
            let mut got = vec![0u8; s.pack.total_bytes as usize];
            staging.read((s.base - staging.ptr()) as usize, &mut got)?;
            for (e, &rb) in row_bytes.iter().enumerate() {
                let from = (pack.entry_offsets[e] + s.first_token * rb) as usize;
                let len = (s.pack.tokens * rb) as usize;
                let at = s.pack.entry_offsets[e] as usize;
                if got[at..at + len] != want[from..from + len] {
                    return Err(fail(format!(
                        "case {case}: sliced gather slice {} entry {e} differs",
                        s.index
                    )));
                }
            }
            seen += s.pack.tokens;
            Ok(())
        })?;
    }
    if seen != tokens {
        return Err(fail(format!(
            "case {case}: sliced gather covered {seen} of {tokens} tokens"
        )));
    }
    Ok(())
}

struct BenchRow {
    dcp: u64,
    bytes: u64,
    spans: usize,
    gather_ms: f64,
    gather_upload_ms: f64,
    memcpy_ms: f64,
}

#[derive(Clone, Copy)]
enum Op {
    /// The kernel alone, tables uploaded once.
    Gather,
    /// Table upload plus kernel per call (`GpuRelayout::gather`).
    GatherUpload,
    /// cuMemcpyDtoDAsync of the same bytes.
    Memcpy,
}

fn bench(g: &mut GpuRelayout, a: &Args) -> Res<Vec<BenchRow>> {
    let p = a.page_size;
    let pages = a.tokens.div_ceil(p);
    let pool_bytes = pages * p * a.row_bytes; // one entry
    let total_pool = pool_bytes * a.layers;
    println!(
        "bench: {} tokens, {} layers, {} B rows, page {}: pools {:.2} GiB",
        a.tokens,
        a.layers,
        a.row_bytes,
        p,
        total_pool as f64 / (1u64 << 30) as f64
    );
    let pool = g.alloc(total_pool as usize)?;
    g.memset(&pool, 0x5a)?;
    let mut rng = Rng(7);
    let src_pages = rng.pages(pages as usize, pages);
    let row_bytes = vec![a.row_bytes; a.layers as usize];
    let bases: Vec<u64> = (0..a.layers).map(|e| pool.ptr() + e * pool_bytes).collect();
    let mut rows = Vec::new();
    for &d in &a.dcp {
        let dst_pages: Vec<u64> = (0..a.tokens.div_ceil(p * d)).collect();
        let chunk = SglangChunk {
            src_pages: &src_pages,
            dst_pages: &dst_pages,
            page_size: p,
            dcp_size: d,
            dcp_rank: 0,
            src_page_offset: 0,
            decode_prefix_len: 0,
            num_tokens: Some(a.tokens),
        };
        let req = chunk.to_pair()?;
        let spans = relayout::gather_spans(&req)?;
        let pack = PackLayout::new(req.token_count(), &row_bytes)?;
        let dpack = g.alloc(pack.total_bytes as usize)?;
        let ents = relayout::gather_entries(&bases, &row_bytes, dpack.ptr(), &pack)?;
        let n = pack.total_bytes as usize;
        let prepared = g.prepare(&ents, &spans)?;
        let time = |g: &mut GpuRelayout, op: Op| -> Res<f64> {
            let run = |g: &mut GpuRelayout| -> Res<()> {
                match op {
                    // SAFETY: spans index rows inside the pools; the pack holds them.
                    Op::Gather => unsafe { g.launch_prepared(&prepared, false).map(|_| ())? },
                    // SAFETY: as above.
                    Op::GatherUpload => unsafe { g.gather(&ents, &spans).map(|_| ())? },
                    // SAFETY: both ranges are inside their allocations (n <= pool size).
                    Op::Memcpy => unsafe { g.memcpy_dtod(dpack.ptr(), pool.ptr(), n)? },
                }
                Ok(())
            };
            for _ in 0..3 {
                run(g)?;
            }
            let start = g.record(true)?;
            for _ in 0..a.iters {
                run(g)?;
            }
            let end = g.record(true)?;
            end.wait()?;
            Ok(start.elapsed_ms(&end)? as f64 / a.iters as f64)
        };
        let gather_ms = time(g, Op::Gather)?;
        let gather_upload_ms = time(g, Op::GatherUpload)?;
        let memcpy_ms = time(g, Op::Memcpy)?;
        rows.push(BenchRow {
            dcp: d,
            bytes: pack.total_bytes,
            spans: spans.len(),
            gather_ms,
            gather_upload_ms,
            memcpy_ms,
        });
        let r = rows.last().map_or(0.0, |r| r.memcpy_ms / r.gather_ms);
        println!(
            "bench: DCP {d}: {} spans, {:.1} MiB per rank: gather {:.3} ms ({:.0} GB/s; {:.3} ms with table upload), memcpy {:.3} ms ({:.0} GB/s), gather/memcpy {:.3}x",
            spans.len(),
            n as f64 / (1 << 20) as f64,
            gather_ms,
            n as f64 / gather_ms / 1e6,
            gather_upload_ms,
            memcpy_ms,
            n as f64 / memcpy_ms / 1e6,
            r
        );
    }
    Ok(rows)
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
    let mut rng = Rng(0x9d_2026);
    let mut failed = 0;
    for case in 0..a.cases {
        if let Err(e) = check_case(&mut g, &mut rng, case, case == 0) {
            eprintln!("gpu-check: FAIL: {e}");
            failed += 1;
        }
    }
    println!(
        "correctness: {} of {} random plans match the CPU relayout byte for byte ({:.1} s)",
        a.cases - failed,
        a.cases,
        t0.elapsed().as_secs_f64()
    );
    let mut code = i32::from(failed > 0);
    if !a.no_bench {
        match bench(&mut g, &a) {
            Ok(rows) => {
                let json: Vec<_> = rows
                    .iter()
                    .map(|r| {
                        serde_json::json!({"dcp": r.dcp, "bytes": r.bytes, "spans": r.spans,
                        "gather_ms": r.gather_ms, "gather_upload_ms": r.gather_upload_ms,
                        "memcpy_ms": r.memcpy_ms, "ratio": r.memcpy_ms / r.gather_ms,
                        "ratio_with_upload": r.memcpy_ms / r.gather_upload_ms})
                    })
                    .collect();
                println!("bench-json: {}", serde_json::Value::Array(json));
                if let Some(min) = a.min_ratio {
                    for r in &rows {
                        if r.memcpy_ms / r.gather_ms < min {
                            eprintln!(
                                "gpu-check: FAIL: DCP {} gather/memcpy {:.3} < {min}",
                                r.dcp,
                                r.memcpy_ms / r.gather_ms
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
