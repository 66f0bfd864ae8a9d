//! Device self-check and gather benchmark, shared by `examples/gpu_check`
//! (run on GPU hosts by `scripts/gpu-check.sh`) and the fake-driver test.

use super::GpuRelayout;
use crate::cuda::DeviceBuffer;
use crate::error::{Error, Result, Status};
use crate::layout::{PackLayout, SglangChunk};
use crate::relayout::{self, cpu, CopyEntry};
use crate::rng::SplitMix64;

fn fail(msg: String) -> Error {
    Error::new(Status::Relayout, msg)
}

/// One random plan on the device, gather + scatter + sliced gather, compared
/// byte for byte with `relayout::cpu`. `big` is a 4,096-token, 61-layer plan.
fn check_case(g: &mut GpuRelayout, rng: &mut SplitMix64, case: u32, big: bool) -> Result<()> {
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
    let mis = |rng: &mut SplitMix64| if big { 0 } else { rng.below(16) };
    let mut dev_pools: Vec<(DeviceBuffer, u64)> = Vec::new();
    for v in &pools {
        let off = mis(rng);
        let b = g.stream().alloc(v.len() + 16)?;
        g.stream().upload(&b, off as usize, v)?;
        dev_pools.push((b, off));
    }
    let pack_off = mis(rng);
    let dpack = g.stream().alloc(pack.total_bytes as usize + 16)?;
    g.stream().upload(&dpack, pack_off as usize, &junk)?;
    let bases: Vec<u64> = dev_pools.iter().map(|(b, o)| b.ptr() + o).collect();
    let ents: Vec<CopyEntry> =
        relayout::gather_entries(&bases, &row_bytes, dpack.ptr() + pack_off, &pack)?;
    // SAFETY: every span was bounds-checked by cpu::gather on the same shapes,
    // and the device buffers have those sizes.
    let ev = unsafe { g.gather(&ents, &gspans)? };
    ev.wait()?;
    let mut got = vec![0u8; junk.len()];
    g.stream().download(&dpack, pack_off as usize, &mut got)?;
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
        let b = g.stream().alloc(v.len() + 16)?;
        g.stream().upload(&b, off as usize, v)?;
        dev_dst.push((b, off));
    }
    let dbases: Vec<u64> = dev_dst.iter().map(|(b, o)| b.ptr() + o).collect();
    let ents = relayout::scatter_entries(&dbases, &row_bytes, dpack.ptr() + pack_off, &pack)?;
    // SAFETY: as above, checked by cpu::scatter.
    let ev = unsafe { g.scatter(&ents, &sspans)? };
    ev.wait()?;
    for (e, ((b, off), w)) in dev_dst.iter().zip(&cpu_dst).enumerate() {
        let mut got = vec![0u8; w.len()];
        g.stream().download(b, *off as usize, &mut got)?;
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
    let staging = g.stream().alloc((2 * slice_tokens * per_token) as usize)?;
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

/// One benchmark result.
#[derive(Debug, Clone)]
pub struct BenchRow {
    /// Decode DCP size.
    pub dcp: u64,
    /// Bytes gathered (one rank's pack).
    pub bytes: u64,
    /// Spans (rows runs) of the plan.
    pub spans: usize,
    /// Gather kernel, ms per call, at the fastest spans-per-warp setting.
    pub gather_ms: f64,
    /// That setting.
    pub spans_per_warp: u32,
    /// Gather kernel ms per call for every setting tried.
    pub sweep: Vec<(u32, f64)>,
    /// Gather with table upload, ms per call.
    pub gather_upload_ms: f64,
    /// Device memcpy of the same bytes, ms per call.
    pub memcpy_ms: f64,
}

impl BenchRow {
    /// memcpy time over gather time: 1.0 means the gather runs at memcpy speed.
    pub fn ratio(&self) -> f64 {
        if self.gather_ms > 0.0 {
            self.memcpy_ms / self.gather_ms
        } else {
            0.0
        }
    }
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

/// Benchmark shape: one decode rank's share of a request, per DCP size.
#[derive(Debug, Clone)]
pub struct BenchParams {
    /// Request tokens.
    pub tokens: u64,
    /// KV entries (layers).
    pub layers: u64,
    /// Bytes per row.
    pub row_bytes: u64,
    /// Page size of the pools.
    pub page_size: u64,
    /// Decode DCP sizes.
    pub dcp: Vec<u64>,
    /// Timed iterations (after 3 warm-ups).
    pub iters: u32,
    /// Spans-per-warp settings to try (empty: the engine's current one).
    pub spans_per_warp: Vec<u32>,
}

/// Times the gather kernel (tables prepared once), the gather with a table
/// upload per call, and `cuMemcpyDtoDAsync` of the same bytes, per DCP size.
pub fn bench(g: &mut GpuRelayout, a: &BenchParams) -> Result<Vec<BenchRow>> {
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
    let pool = g.stream().alloc(total_pool as usize)?;
    g.stream().memset(&pool, 0x5a)?;
    let mut rng = SplitMix64::new(7);
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
        let dpack = g.stream().alloc(pack.total_bytes as usize)?;
        let ents = relayout::gather_entries(&bases, &row_bytes, dpack.ptr(), &pack)?;
        let n = pack.total_bytes as usize;
        let prepared = g.prepare(&ents, &spans)?;
        let time = |g: &mut GpuRelayout, op: Op| -> Result<f64> {
            let run = |g: &mut GpuRelayout| -> Result<()> {
                match op {
                    // SAFETY: spans index rows inside the pools; the pack holds them.
                    Op::Gather => unsafe { g.launch_prepared(&prepared, false).map(|_| ())? },
                    // SAFETY: as above.
                    Op::GatherUpload => unsafe { g.gather(&ents, &spans).map(|_| ())? },
                    // SAFETY: both ranges are inside their allocations (n <= pool size).
                    Op::Memcpy => unsafe { g.stream().memcpy_dtod(dpack.ptr(), pool.ptr(), n)? },
                }
                Ok(())
            };
            for _ in 0..3 {
                run(g)?;
            }
            let start = g.stream().record(true)?;
            for _ in 0..a.iters {
                run(g)?;
            }
            let end = g.stream().record(true)?;
            end.wait()?;
            Ok(start.elapsed_ms(&end)? as f64 / a.iters as f64)
        };
        let before = g.spans_per_warp();
        let settings = if a.spans_per_warp.is_empty() {
            vec![before]
        } else {
            a.spans_per_warp.clone()
        };
        let mut sweep = Vec::new();
        for &spw in &settings {
            g.set_spans_per_warp(spw);
            sweep.push((g.spans_per_warp(), time(g, Op::Gather)?));
        }
        let (spans_per_warp, gather_ms) = sweep.iter().copied().fold(
            (before, f64::INFINITY),
            |b, x| if x.1 < b.1 { x } else { b },
        );
        g.set_spans_per_warp(spans_per_warp);
        let gather_upload_ms = time(g, Op::GatherUpload)?;
        g.set_spans_per_warp(before);
        let memcpy_ms = time(g, Op::Memcpy)?;
        rows.push(BenchRow {
            dcp: d,
            bytes: pack.total_bytes,
            spans: spans.len(),
            gather_ms,
            spans_per_warp,
            sweep: sweep.clone(),
            gather_upload_ms,
            memcpy_ms,
        });
        let r = rows.last().map_or(0.0, BenchRow::ratio);
        println!(
            "bench: DCP {d}: {} spans, {:.1} MiB per rank: gather {:.3} ms ({:.0} GB/s, {spans_per_warp} spans/warp; sweep {}; {:.3} ms with table upload), memcpy {:.3} ms ({:.0} GB/s), gather/memcpy {:.3}x",
            spans.len(),
            n as f64 / (1 << 20) as f64,
            gather_ms,
            n as f64 / gather_ms / 1e6,
            sweep
                .iter()
                .map(|(k, ms)| format!("{k}:{ms:.3}ms"))
                .collect::<Vec<_>>()
                .join(" "),
            gather_upload_ms,
            memcpy_ms,
            n as f64 / memcpy_ms / 1e6,
            r
        );
    }
    Ok(rows)
}

/// Runs `cases` random plans (with `large_first`, the first one is 4,096
/// tokens of 61 layers) through gather, scatter and sliced gather on the
/// device and compares each with the CPU relayout byte for byte. Returns the
/// failures' messages.
pub fn self_check(g: &mut GpuRelayout, cases: u32, seed: u64, large_first: bool) -> Vec<String> {
    let mut rng = SplitMix64::new(seed);
    let mut failures = Vec::new();
    for case in 0..cases {
        if let Err(e) = check_case(g, &mut rng, case, large_first && case == 0) {
            failures.push(e.to_string());
        }
    }
    failures
}
