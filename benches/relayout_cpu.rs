//! CPU relayout (host pools): gather one decode rank's rows of an 8,192-token
//! request (page 64, DCP 4, 61 layers of 1152 B rows) into its pack buffer,
//! the scatter back into destination pages, and a plain memcpy of the same
//! bytes as the baseline. One thread.
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pdxfer::layout::{PackLayout, SglangChunk};
use pdxfer::relayout::{self, cpu};

const TOKENS: u64 = 8192;
const P: u64 = 64;
const D: u64 = 4;
const LAYERS: usize = 61;
const ROW: u64 = 1152;

fn bench(c: &mut Criterion) {
    let src_pages: Vec<u64> = (0..TOKENS / P).map(|i| (i * 37) % (TOKENS / P)).collect();
    let dst_pages: Vec<u64> = (0..TOKENS.div_ceil(P * D)).rev().collect();
    let req = SglangChunk {
        src_pages: &src_pages,
        dst_pages: &dst_pages,
        page_size: P,
        dcp_size: D,
        dcp_rank: 1,
        src_page_offset: 0,
        decode_prefix_len: 0,
        num_tokens: Some(TOKENS),
    }
    .to_pair()
    .unwrap();
    let gspans = relayout::gather_spans(&req).unwrap();
    let sspans = relayout::scatter_spans(&req).unwrap();
    let rows = vec![ROW; LAYERS];
    let pack = PackLayout::new(req.token_count(), &rows).unwrap();
    let pools: Vec<Vec<u8>> = (0..LAYERS)
        .map(|e| vec![e as u8; (TOKENS * ROW) as usize])
        .collect();
    let refs: Vec<&[u8]> = pools.iter().map(|v| v.as_slice()).collect();
    let mut out = vec![0u8; pack.total_bytes as usize];
    let mut dst: Vec<Vec<u8>> = (0..LAYERS)
        .map(|_| vec![0u8; (TOKENS / D * ROW) as usize])
        .collect();
    let mut g = c.benchmark_group("relayout_cpu");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(pack.total_bytes));
    g.bench_function("gather_dcp4_61x1152", |b| {
        b.iter(|| cpu::gather(&refs, &rows, &gspans, &pack, &mut out).unwrap())
    });
    g.bench_function("scatter_dcp4_61x1152", |b| {
        b.iter(|| {
            let mut d: Vec<&mut [u8]> = dst.iter_mut().map(|v| v.as_mut_slice()).collect();
            cpu::scatter(&out, &pack, &rows, &sspans, &mut d).unwrap()
        })
    });
    let src_flat = vec![1u8; pack.total_bytes as usize];
    g.bench_function("memcpy_same_bytes", |b| {
        b.iter(|| out.copy_from_slice(&src_flat))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
