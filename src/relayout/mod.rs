//! Executes plans: CPU gather/scatter for host pools ([`cpu`]), CUDA kernels
//! for device pools ([`gpu`], source in `cuda/relayout.cu`).
//!
//! Both execute the same description: a table of [`CopyEntry`] (one per KV
//! entry, i.e. layer: source base, destination base, row bytes) and a list of
//! spans ([`Run`]: `len` rows from `src` to `dst`). Row `k` of an entry is at
//! `base + k * row_bytes`. A **gather** copies one pair's token rows from the
//! pool into the entry-major pack buffer of reference 4.4 (entry `e` at
//! `pack + n * sum_{k<e} row_k`, row `j` at `+ j * row_e`); spans then map pool
//! rows to packed indices ([`gather_spans`]). A **scatter** does the reverse
//! on the receiving side; spans map packed indices to pool rows
//! ([`scatter_spans`], which is [`PairRequest::runs`] with `packed`).

pub mod cpu;
pub mod gpu;

use crate::error::{Error, Result};
use crate::layout::plan::push_run;
use crate::layout::{PackLayout, PairRequest, Run};

/// One KV entry (layer) of a relayout launch: rows `k` are at `src + k *
/// row_bytes` and `dst + k * row_bytes`. Same layout as `PdxCopyEntry` in
/// `cuda/relayout.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CopyEntry {
    /// Address of row 0 on the source side (host or device).
    pub src: u64,
    /// Address of row 0 on the destination side.
    pub dst: u64,
    /// Bytes per row (any size; 16-byte multiples take the vector path).
    pub row_bytes: u64,
    /// Reserved, zero.
    pub reserved: u64,
}

/// Spans of a gather for one pair: pool source rows to packed indices
/// `0..n`, in sequence order (the order [`PairRequest::runs`] packs in).
pub fn gather_spans(req: &PairRequest<'_>) -> Result<Vec<Run>> {
    let mut spans: Vec<Run> = Vec::new();
    let mut next = 0u64;
    req.for_each_segment(|s| {
        push_run(&mut spans, s.src_row, next, s.len);
        next += s.len;
    })?;
    Ok(spans)
}

/// Spans of a scatter for one pair: packed indices to destination pool rows.
pub fn scatter_spans(req: &PairRequest<'_>) -> Result<Vec<Run>> {
    req.runs(true)
}

/// Splits spans so that none has more than `max_rows` rows (load balance on
/// the GPU: one warp copies one span of one entry). `max_rows` 0 means 1.
pub fn split_spans(spans: &[Run], max_rows: u64) -> Vec<Run> {
    let m = max_rows.max(1);
    let mut out = Vec::with_capacity(spans.len());
    for s in spans {
        let mut done = 0;
        while done < s.len {
            let n = m.min(s.len - done);
            out.push(Run {
                src: s.src + done,
                dst: s.dst + done,
                len: n,
            });
            done += n;
        }
    }
    out
}

/// Rows per span for [`split_spans`] so that one warp copies about
/// `target_bytes` of the widest entry.
pub fn rows_per_span(row_bytes: &[u64], target_bytes: u64) -> u64 {
    let widest = row_bytes.iter().copied().max().unwrap_or(1).max(1);
    (target_bytes / widest).max(1)
}

/// Cuts gather spans (pool row -> packed index `0..n`) into slices of at most
/// `tokens_per_slice` packed tokens: `(first token, tokens, spans)` with packed
/// indices rebased to the slice. Used to reuse a staging buffer that cannot
/// hold all of a pair's tokens at once (reference 4.4, sliced packing).
pub fn slice_gather_spans(spans: &[Run], tokens_per_slice: u64) -> Vec<(u64, u64, Vec<Run>)> {
    let per = tokens_per_slice.max(1);
    let total = spans.iter().map(|s| s.dst + s.len).max().unwrap_or(0);
    let mut out: Vec<(u64, u64, Vec<Run>)> = (0..total.div_ceil(per))
        .map(|k| (k * per, per.min(total - k * per), Vec::new()))
        .collect();
    for s in spans {
        let mut done = 0;
        while done < s.len {
            let idx = s.dst + done;
            let k = idx / per;
            let n = (s.len - done).min((k + 1) * per - idx);
            push_run(&mut out[k as usize].2, s.src + done, idx - k * per, n);
            done += n;
        }
    }
    out
}

/// Threads per block of the relayout kernels (8 warps; `__launch_bounds__`).
pub(crate) const THREADS_PER_BLOCK: u32 = 256;

/// Spans each warp copies per entry by default (see [`launch_dims`]).
pub const DEFAULT_SPANS_PER_WARP: u32 = 4;

/// Grid of a relayout launch as `(grid_x, grid_y, block_x)`: x covers the
/// spans, `spans_per_warp` per warp (more per warp means fewer, longer-lived
/// blocks; 1 means one span each), y the entries. The kernels' loops are
/// grid-stride, so the caps only bound the launch, never the work.
pub fn launch_dims(num_spans: u64, num_entries: u32, spans_per_warp: u32) -> (u32, u32, u32) {
    let per_block = u64::from(THREADS_PER_BLOCK / 32) * u64::from(spans_per_warp.max(1));
    let gx = num_spans.div_ceil(per_block).clamp(1, 1 << 20) as u32;
    let gy = num_entries.clamp(1, 65_535);
    (gx, gy, THREADS_PER_BLOCK)
}

/// The entry table of a gather: pool entry bases to the pack buffer blocks.
pub fn gather_entries(
    pool_bases: &[u64],
    row_bytes: &[u64],
    pack_base: u64,
    pack: &PackLayout,
) -> Result<Vec<CopyEntry>> {
    entries(pool_bases, row_bytes, pack_base, pack, false)
}

/// The entry table of a scatter: pack buffer blocks to pool entry bases.
pub fn scatter_entries(
    pool_bases: &[u64],
    row_bytes: &[u64],
    pack_base: u64,
    pack: &PackLayout,
) -> Result<Vec<CopyEntry>> {
    entries(pool_bases, row_bytes, pack_base, pack, true)
}

fn entries(
    pool_bases: &[u64],
    row_bytes: &[u64],
    pack_base: u64,
    pack: &PackLayout,
    scatter: bool,
) -> Result<Vec<CopyEntry>> {
    if pool_bases.len() != row_bytes.len() || pack.entry_offsets.len() != row_bytes.len() {
        return Err(Error::invalid(format!(
            "relayout entries disagree: {} pool bases, {} row sizes, {} pack entries",
            pool_bases.len(),
            row_bytes.len(),
            pack.entry_offsets.len()
        )));
    }
    let mut out = Vec::with_capacity(row_bytes.len());
    for ((&base, &rb), &off) in pool_bases.iter().zip(row_bytes).zip(&pack.entry_offsets) {
        let packed = pack_base
            .checked_add(off)
            .ok_or_else(|| Error::invalid("pack base + entry offset overflows u64"))?;
        let (src, dst) = if scatter {
            (packed, base)
        } else {
            (base, packed)
        };
        out.push(CopyEntry {
            src,
            dst,
            row_bytes: rb,
            reserved: 0,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{dcp_token_plan, SglangChunk};

    fn chunk<'a>(src: &'a [u64], dst: &'a [u64], rank: u64) -> SglangChunk<'a> {
        SglangChunk {
            src_pages: src,
            dst_pages: dst,
            page_size: 64,
            dcp_size: 4,
            dcp_rank: rank,
            src_page_offset: 0,
            decode_prefix_len: 0,
            num_tokens: Some(300),
        }
    }

    #[test]
    fn spans_follow_the_worked_example() {
        // reference 4.5: rank 1 owns positions 1, 5, ..., 297 -> src 449, 453, ...
        let (s, d) = ([7u64, 3, 12, 5, 20], [40u64, 9]);
        let req = chunk(&s, &d, 1).to_pair().unwrap();
        let g = gather_spans(&req).unwrap();
        assert_eq!(g.len(), 75, "source rows are strided by D: no merging");
        assert_eq!(
            g[0],
            Run {
                src: 449,
                dst: 0,
                len: 1
            }
        );
        assert_eq!(
            g[74],
            Run {
                src: 1321,
                dst: 74,
                len: 1
            }
        );
        let sc = scatter_spans(&req).unwrap();
        assert_eq!(
            sc,
            vec![
                Run {
                    src: 0,
                    dst: 2560,
                    len: 64
                },
                Run {
                    src: 64,
                    dst: 576,
                    len: 11
                }
            ]
        );
        // gather then scatter is the token plan
        let plan = dcp_token_plan(&chunk(&s, &d, 1)).unwrap();
        let mut packed_src = vec![0u64; 75];
        for r in &g {
            for i in 0..r.len {
                packed_src[(r.dst + i) as usize] = r.src + i;
            }
        }
        let mut pairs = Vec::new();
        for r in &sc {
            for i in 0..r.len {
                pairs.push((packed_src[(r.src + i) as usize], r.dst + i));
            }
        }
        let want: Vec<_> = plan.src_rows.into_iter().zip(plan.dst_rows).collect();
        assert_eq!(pairs, want);
    }

    #[test]
    fn split_bounds_every_span() {
        let spans = [
            Run {
                src: 10,
                dst: 0,
                len: 7,
            },
            Run {
                src: 30,
                dst: 7,
                len: 2,
            },
        ];
        let s = split_spans(&spans, 3);
        assert_eq!(
            s.iter().map(|r| (r.src, r.dst, r.len)).collect::<Vec<_>>(),
            vec![(10, 0, 3), (13, 3, 3), (16, 6, 1), (30, 7, 2)]
        );
        assert_eq!(split_spans(&spans, 0).len(), 9);
        assert_eq!(rows_per_span(&[1152, 576], 16384), 14);
        assert_eq!(rows_per_span(&[], 100), 100);
        assert_eq!(launch_dims(32_768, 61, 1), (4096, 61, 256));
        assert_eq!(launch_dims(32_768, 61, 4), (1024, 61, 256));
        assert_eq!(launch_dims(32_769, 61, 0), (4097, 61, 256));
        assert_eq!(launch_dims(0, 0, 4), (1, 1, 256));
        assert_eq!(launch_dims(u64::MAX, 100_000, 1), (1 << 20, 65_535, 256));
    }

    #[test]
    fn slices_rebase_packed_indices() {
        let spans = [
            Run {
                src: 100,
                dst: 0,
                len: 5,
            },
            Run {
                src: 300,
                dst: 5,
                len: 2,
            },
        ];
        let s = slice_gather_spans(&spans, 3);
        let flat: Vec<_> = s
            .iter()
            .map(|(f, n, r)| {
                (
                    *f,
                    *n,
                    r.iter().map(|x| (x.src, x.dst, x.len)).collect::<Vec<_>>(),
                )
            })
            .collect();
        assert_eq!(
            flat,
            vec![
                (0, 3, vec![(100, 0, 3)]),
                (3, 3, vec![(103, 0, 2), (300, 2, 1)]),
                (6, 1, vec![(301, 0, 1)]),
            ]
        );
        assert!(slice_gather_spans(&[], 4).is_empty());
        // one slice holding everything is the plan itself
        assert_eq!(slice_gather_spans(&spans, 100)[0].2, spans.to_vec());
    }

    #[test]
    fn entry_tables_point_at_pack_blocks() {
        let pack = PackLayout::new(10, &[16, 8]).unwrap();
        let g = gather_entries(&[1000, 5000], &[16, 8], 100, &pack).unwrap();
        assert_eq!((g[0].src, g[0].dst), (1000, 100));
        assert_eq!((g[1].src, g[1].dst, g[1].row_bytes), (5000, 260, 8));
        let s = scatter_entries(&[1000, 5000], &[16, 8], 100, &pack).unwrap();
        assert_eq!((s[1].src, s[1].dst), (260, 5000));
        assert!(gather_entries(&[1], &[16, 8], 0, &pack).is_err());
    }

    #[test]
    fn copy_entry_matches_the_kernel_struct() {
        assert_eq!(std::mem::size_of::<CopyEntry>(), 32);
        assert_eq!(std::mem::size_of::<Run>(), 24);
    }
}
