//! Host CPU cost of preparing one RDMA batch before the NIC sees it: slice the
//! spans across 4 rails, resolve keys (with bounds checks), build the work
//! requests (signal every 64) and, with the `rdma` feature, convert them to
//! linked `ibv_send_wr` lists. Two shapes of one request's MLA KV for one decode
//! rank over 61 layers: unpacked (75 one-row writes of 576 B per layer = 4575
//! spans) and packed (2 writes of 21.6 KB per layer = 122 spans).
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use pdxfer::transport::rdma::handshake::RemoteRegion;
use pdxfer::transport::rdma::slice::{slice_across, LocalRegion, RailKeys, Span};
use pdxfer::transport::rdma::wr::{build_batch, BatchParams, CompletionRecord, Direction};

const LAYERS: u64 = 61;
const ROW: u64 = 576;
const RAILS: usize = 4;
const BASE_L: u64 = 0x7f00_0000_0000;
const BASE_R: u64 = 0x7e00_0000_0000;
const POOL: u64 = 8 << 30;

fn unpacked() -> Vec<Span> {
    let mut v = Vec::new();
    for l in 0..LAYERS {
        for t in 0..75u64 {
            let row = (t * 4 + 1) * 7 % 100_000;
            v.push(Span {
                local_addr: BASE_L + l * (100 << 20) + row * ROW,
                remote_addr: BASE_R + l * (100 << 20) + (t * 13 % 50_000) * ROW,
                len: ROW,
            });
        }
    }
    v
}

fn packed() -> Vec<Span> {
    let mut v = Vec::new();
    for l in 0..LAYERS {
        for k in 0..2u64 {
            v.push(Span {
                local_addr: BASE_L + l * (100 << 20) + k * (1 << 20),
                remote_addr: BASE_R + l * (100 << 20) + k * (1 << 20),
                len: 37 * ROW + k * ROW,
            });
        }
    }
    v
}

fn keys() -> Vec<RailKeys> {
    (0..RAILS as u32)
        .map(|r| {
            RailKeys::new(
                vec![LocalRegion {
                    addr: BASE_L,
                    len: POOL,
                    lkey: 10 + r,
                }],
                vec![RemoteRegion {
                    addr: BASE_R,
                    len: POOL,
                    rkey: 20 + r,
                }],
            )
        })
        .collect()
}

fn prepare(spans: &[Span], keys: &[RailKeys]) -> usize {
    let p = BatchParams {
        max_msg: 1 << 30,
        signal_every: 64,
        sq_depth: 1024,
    };
    let per_rail = slice_across(spans, &[100; RAILS], 64 << 10).unwrap();
    let mut n = 0;
    for (i, s) in per_rail.iter().enumerate() {
        if s.is_empty() {
            continue;
        }
        let t = keys[i].resolve_all(s).unwrap();
        let w = build_batch(
            7,
            Direction::Write,
            &t,
            CompletionRecord::Immediate(7 << 8 | 4),
            &p,
        )
        .unwrap();
        #[cfg(feature = "rdma")]
        {
            let l = pdxfer::transport::rdma::verbs::SendList::new(&w);
            n += l.len();
        }
        #[cfg(not(feature = "rdma"))]
        {
            n += w.len();
        }
    }
    n
}

fn bench(c: &mut Criterion) {
    let k = keys();
    let (u, pk) = (unpacked(), packed());
    let mut g = c.benchmark_group("rdma_prepare_batch_61_layers_4_rails");
    g.bench_function("unpacked_4575_spans", |b| {
        b.iter(|| black_box(prepare(black_box(&u), &k)))
    });
    g.bench_function("packed_122_spans", |b| {
        b.iter(|| black_box(prepare(black_box(&pk), &k)))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
