//! Plan + coalesce into runs for a 131,072-token request, page 64, DCP 16, all
//! 16 decode ranks, packed and unpacked (the target: packed under 0.5 ms on one core).
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use pdxfer::layout::{coalesce_runs, dcp_token_plan, SglangChunk};

const TOKENS: u64 = 131_072;
const P: u64 = 64;
const D: u64 = 16;

fn pages() -> (Vec<u64>, Vec<u64>) {
    // scattered page ids, as a real allocator hands them out
    let src: Vec<u64> = (0..TOKENS / P).map(|i| (i * 7919) % 100_003).collect();
    let dst: Vec<u64> = (0..TOKENS.div_ceil(P * D))
        .map(|i| (i * 104_729) % 50_021)
        .collect();
    (src, dst)
}

fn chunk<'a>(src: &'a [u64], dst: &'a [u64], r: u64) -> SglangChunk<'a> {
    SglangChunk {
        src_pages: src,
        dst_pages: dst,
        page_size: P,
        dcp_size: D,
        dcp_rank: r,
        src_page_offset: 0,
        decode_prefix_len: 0,
        num_tokens: Some(TOKENS),
    }
}

fn bench(c: &mut Criterion) {
    let (src, dst) = pages();
    let mut g = c.benchmark_group("plan_131072_p64_dcp16_all_ranks");
    g.bench_function("packed_runs", |b| {
        b.iter(|| {
            let mut n = 0;
            for r in 0..D {
                n += chunk(&src, &dst, r)
                    .to_pair()
                    .unwrap()
                    .runs(true)
                    .unwrap()
                    .len();
            }
            black_box(n)
        })
    });
    g.bench_function("unpacked_runs", |b| {
        b.iter(|| {
            let mut n = 0;
            for r in 0..D {
                n += chunk(&src, &dst, r)
                    .to_pair()
                    .unwrap()
                    .runs(false)
                    .unwrap()
                    .len();
            }
            black_box(n)
        })
    });
    g.bench_function("token_plan_rows", |b| {
        b.iter(|| {
            let mut n = 0;
            for r in 0..D {
                n += dcp_token_plan(&chunk(&src, &dst, r)).unwrap().len();
            }
            black_box(n)
        })
    });
    g.bench_function("token_plan_rows_then_coalesce", |b| {
        b.iter(|| {
            let mut n = 0;
            for r in 0..D {
                let p = dcp_token_plan(&chunk(&src, &dst, r)).unwrap();
                n += coalesce_runs(&p.src_rows, &p.dst_rows).unwrap().len();
            }
            black_box(n)
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
