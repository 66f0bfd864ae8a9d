//! Property tests of the general planner against a brute-force model:
//! every token is delivered exactly once, to the right row, by the right pair;
//! runs and packed runs expand to the same rows; chunked sends concatenate to
//! the single-shot plan.

use pdxfer::layout::{pairs_with_share, DcpLayout, PairRequest, Side};
use proptest::prelude::*;
use std::collections::BTreeMap;

/// (position, src row, dst row) per (src rank, dst rank), by brute force.
type Deliveries = BTreeMap<(u64, u64), Vec<(u64, u64, u64)>>;

#[allow(clippy::too_many_arguments)]
fn brute(
    src: &DcpLayout,
    dst: &DcpLayout,
    src_pages: &[Vec<u64>],
    dst_pages: &[Vec<u64>],
    src_origin: u64,
    dst_origin: u64,
    start: u64,
    n: u64,
) -> Deliveries {
    let mut out = Deliveries::new();
    for t in start..start + n {
        let (a, b) = (src.owner(t), dst.owner(t));
        let sl = src.local(t) - src.local(src_origin);
        let dl = dst.local(t) - dst.local(dst_origin);
        let sr = src_pages[a as usize][(sl / src.page_size) as usize] * src.page_size
            + sl % src.page_size;
        let dr = dst_pages[b as usize][(dl / dst.page_size) as usize] * dst.page_size
            + dl % dst.page_size;
        out.entry((a, b)).or_default().push((t, sr, dr));
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn planner(
    src: &DcpLayout,
    dst: &DcpLayout,
    src_pages: &[Vec<u64>],
    dst_pages: &[Vec<u64>],
    src_origin: u64,
    dst_origin: u64,
    start: u64,
    n: u64,
) -> Deliveries {
    let mut out = Deliveries::new();
    for a in 0..src.dcp_size {
        for b in 0..dst.dcp_size {
            let req = PairRequest {
                src: Side {
                    layout: *src,
                    rank: a,
                    pages: &src_pages[a as usize],
                    origin: src_origin,
                },
                dst: Side {
                    layout: *dst,
                    rank: b,
                    pages: &dst_pages[b as usize],
                    origin: dst_origin,
                },
                start,
                num_tokens: n,
            };
            let mut rows = Vec::new();
            req.for_each_segment(|s| {
                for i in 0..s.len {
                    rows.push((s.pos + i, s.src_row + i, s.dst_row + i));
                }
            })
            .unwrap();
            let plan = req.plan().unwrap();
            assert_eq!(plan.len() as u64, req.token_count());
            assert_eq!(plan.src_rows, rows.iter().map(|r| r.1).collect::<Vec<_>>());
            assert_eq!(plan.dst_rows, rows.iter().map(|r| r.2).collect::<Vec<_>>());
            // runs expand to the plan, and are maximal
            let runs = req.runs(false).unwrap();
            let mut exp = Vec::new();
            for r in &runs {
                for i in 0..r.len {
                    exp.push((r.src + i, r.dst + i));
                }
            }
            assert_eq!(
                exp,
                plan.src_rows
                    .iter()
                    .copied()
                    .zip(plan.dst_rows.iter().copied())
                    .collect::<Vec<_>>()
            );
            for w in runs.windows(2) {
                assert!(
                    !(w[0].src + w[0].len == w[1].src && w[0].dst + w[0].len == w[1].dst),
                    "runs not maximal"
                );
            }
            // packed runs: source is 0..n in order, destinations as the plan
            let packed = req.runs(true).unwrap();
            let mut next = 0;
            let mut pdst = Vec::new();
            for r in &packed {
                assert_eq!(r.src, next);
                next += r.len;
                pdst.extend(r.dst..r.dst + r.len);
            }
            assert_eq!(pdst, plan.dst_rows);
            if !rows.is_empty() {
                assert!(
                    pairs_with_share(src, dst).contains(&(a, b)),
                    "pair ({a},{b}) has tokens but no share"
                );
                out.insert((a, b), rows);
            }
        }
    }
    out
}

/// Layout strategy: page size a multiple of the interleave.
fn layout() -> impl Strategy<Value = DcpLayout> {
    (1u64..=4, 1u64..=4, prop::sample::select(vec![1u64, 2, 4]))
        .prop_map(|(pages_of_i, w, i)| DcpLayout::new(pages_of_i * i, w, i).unwrap())
}

/// Distinct page ids per rank (so a wrong row can never look right).
fn tables(w: u64, len: usize, salt: u64) -> Vec<Vec<u64>> {
    (0..w)
        .map(|r| {
            (0..len as u64)
                .map(|i| 1000 * (r + 1) + (i * 7 + salt) % 997)
                .collect()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn every_token_once_to_the_right_row(
        src in layout(), dst in layout(),
        src_vp in 0u64..3, dst_vp in 0u64..3, extra in 0u64..40, n in 0u64..300, salt in 0u64..1000,
    ) {
        let src_origin = src_vp * src.virtual_page();
        let dst_origin = dst_vp * dst.virtual_page();
        let start = src_origin.max(dst_origin) + extra;
        let end = start + n;
        let sp = tables(src.dcp_size, (src.count_owned(0, src_origin, end).div_ceil(src.page_size) + 1) as usize, salt);
        let dp = tables(dst.dcp_size, (dst.count_owned(0, dst_origin, end).div_ceil(dst.page_size) + 1) as usize, salt + 1);
        let want = brute(&src, &dst, &sp, &dp, src_origin, dst_origin, start, n);
        let got = planner(&src, &dst, &sp, &dp, src_origin, dst_origin, start, n);
        prop_assert_eq!(&got, &want);
        // exactly once: positions across all pairs are start..end with no repeats
        let mut all: Vec<u64> = got.values().flatten().map(|r| r.0).collect();
        all.sort();
        prop_assert_eq!(all, (start..end).collect::<Vec<_>>());
    }

    #[test]
    fn chunked_sends_concatenate_to_single_shot(
        src in layout(), dst in layout(), dst_vp in 0u64..2, n in 1u64..400,
        cuts in prop::collection::vec(1u64..6, 1..6), salt in 0u64..1000,
    ) {
        // Prefill starts at the decode prefix; chunk boundaries at multiples of the source virtual page.
        let dst_origin = dst_vp * dst.virtual_page();
        let src_origin = dst_origin - dst_origin % src.virtual_page();
        let start = dst_origin;
        let end = start + n;
        let sp = tables(src.dcp_size, (src.count_owned(0, src_origin, end).div_ceil(src.page_size) + 1) as usize, salt);
        let dp = tables(dst.dcp_size, (dst.count_owned(0, dst_origin, end).div_ceil(dst.page_size) + 1) as usize, salt + 3);
        let single = planner(&src, &dst, &sp, &dp, src_origin, dst_origin, start, n);
        // chunk with sliced source tables: origin moves to the chunk start
        let mut merged = Deliveries::new();
        let mut cs = start;
        let mut k = 0;
        while cs < end {
            let vp = src.virtual_page();
            let mut ce = (cs / vp + cuts[k % cuts.len()]) * vp;
            ce = ce.min(end);
            let chunk_origin = cs - cs % vp;
            let page_off = ((chunk_origin - src_origin) / vp) as usize;
            let sliced: Vec<Vec<u64>> = sp.iter().map(|t| t[page_off..].to_vec()).collect();
            let part = planner(&src, &dst, &sliced, &dp, chunk_origin, dst_origin, cs, ce - cs);
            for (key, rows) in part {
                merged.entry(key).or_default().extend(rows);
            }
            cs = ce;
            k += 1;
        }
        prop_assert_eq!(merged, single);
    }
}
