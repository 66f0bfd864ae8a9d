//! Runs of contiguous rows, byte operations per KV entry, and the packed
//! (staging) layout of reference 4.4.

use crate::error::{Error, Result, Status};

/// `len` consecutive rows starting at `src` go to `len` consecutive rows at `dst`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Run {
    /// First source row (or packed index).
    pub src: u64,
    /// First destination row.
    pub dst: u64,
    /// Number of rows.
    pub len: u64,
}

/// Merges consecutive runs whose both sides continue, emitting finished ones
/// (SGLang's `group_concurrent_contiguous`, streaming).
#[derive(Default)]
pub struct RunMerger {
    pending: Option<Run>,
}

impl RunMerger {
    /// Adds a run, merging it into the pending one when both sides continue.
    #[inline]
    pub fn push(&mut self, src: u64, dst: u64, len: u64, f: &mut impl FnMut(Run)) {
        if let Some(p) = &mut self.pending {
            if p.src + p.len == src && p.dst + p.len == dst {
                p.len += len;
                return;
            }
        }
        if let Some(done) = self.pending.replace(Run { src, dst, len }) {
            f(done);
        }
    }

    /// Emits the pending run.
    pub fn finish(&mut self, f: &mut impl FnMut(Run)) {
        if let Some(done) = self.pending.take() {
            f(done);
        }
    }
}

/// Groups row pairs into runs; a run breaks wherever either sequence does not
/// advance by exactly 1 (SGLang's `group_concurrent_contiguous`).
pub fn coalesce_runs(src_rows: &[u64], dst_rows: &[u64]) -> Result<Vec<Run>> {
    if src_rows.len() != dst_rows.len() {
        return Err(Error::invalid(format!(
            "src_rows and dst_rows differ in length: {} vs {}",
            src_rows.len(),
            dst_rows.len()
        )));
    }
    let mut runs: Vec<Run> = Vec::new();
    let mut m = RunMerger::default();
    let mut f = |r| runs.push(r);
    for (&s, &d) in src_rows.iter().zip(dst_rows) {
        m.push(s, d, 1, &mut f);
    }
    m.finish(&mut f);
    Ok(runs)
}

/// One write of `len` bytes for KV entry `entry`, as offsets from the entry's
/// source base (pool or pack buffer) and destination base.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ByteOp {
    /// Entry (layer) index.
    pub entry: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Source byte offset.
    pub src_offset: u64,
    /// Destination byte offset (from the destination entry's base).
    pub dst_offset: u64,
    /// Bytes to write.
    pub len: u64,
}

/// The entry-major packed layout of one pair's tokens in a staging buffer:
/// entry `e` occupies `[offset(e), offset(e) + tokens * row_bytes[e])`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackLayout {
    /// Tokens packed.
    pub tokens: u64,
    /// Byte offset of each entry's block.
    pub entry_offsets: Vec<u64>,
    /// Total bytes.
    pub total_bytes: u64,
}

impl PackLayout {
    /// The layout for `tokens` rows of entries with `row_bytes`.
    pub fn new(tokens: u64, row_bytes: &[u64]) -> Result<PackLayout> {
        let mut off = 0u64;
        let mut entry_offsets = Vec::with_capacity(row_bytes.len());
        for &rb in row_bytes {
            entry_offsets.push(off);
            off = rb
                .checked_mul(tokens)
                .and_then(|b| off.checked_add(b))
                .ok_or_else(|| Error::invalid("pack layout size overflows u64"))?;
        }
        Ok(PackLayout {
            tokens,
            entry_offsets,
            total_bytes: off,
        })
    }
}

/// Byte operations for `runs` over entries with per-entry `row_bytes`.
/// With `pack`, source offsets are into the pack buffer (entry-major).
pub fn byte_ops(runs: &[Run], row_bytes: &[u64], pack: Option<&PackLayout>) -> Vec<ByteOp> {
    let mut ops = Vec::with_capacity(runs.len() * row_bytes.len());
    for (e, &rb) in row_bytes.iter().enumerate() {
        let base = pack.map_or(0, |p| p.entry_offsets[e]);
        for r in runs {
            ops.push(ByteOp {
                entry: e as u32,
                reserved: 0,
                src_offset: base + r.src * rb,
                dst_offset: r.dst * rb,
                len: r.len * rb,
            });
        }
    }
    ops
}

/// Size of one DCP pack buffer: `D * ceil(max_tokens / D) * sum(item_len / P)`
/// (reference 4.4). Each `kv_item_len` is one page of an entry.
pub fn dcp_pack_buffer_bytes(
    kv_item_lens: &[u64],
    page_size: u64,
    max_tokens: u64,
    dcp_size: u64,
) -> Result<u64> {
    if page_size == 0 || dcp_size == 0 {
        return Err(Error::new(
            Status::InvalidLayout,
            "page_size and dcp_size must be >= 1",
        ));
    }
    let mut row_sum = 0u64;
    for &l in kv_item_lens {
        if l < page_size {
            return Err(Error::new(
                Status::GeometryMismatch,
                format!("PD DCP pack requires each kv_item_len to span at least one page, got {l} (page_size {page_size})"),
            ));
        }
        if l % page_size != 0 {
            return Err(Error::new(
                Status::GeometryMismatch,
                format!("PD DCP pack requires page-aligned kv_item_lens, got {l} (page_size {page_size})"),
            ));
        }
        row_sum = row_sum
            .checked_add(l / page_size)
            .ok_or_else(|| Error::invalid("sum of kv_item_lens overflows u64"))?;
    }
    dcp_size
        .checked_mul(max_tokens.div_ceil(dcp_size))
        .and_then(|t| t.checked_mul(row_sum))
        .ok_or_else(|| Error::invalid("pack buffer size overflows u64"))
}

/// Tokens of one rank that fit in a pack buffer of `buffer_bytes`
/// (`buffer_bytes div sum(row_bytes)`; 0 for no entries).
pub fn pack_slice_tokens(buffer_bytes: u64, row_bytes: &[u64]) -> u64 {
    let sum: u64 = row_bytes.iter().sum();
    buffer_bytes.checked_div(sum).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the c_abi fuzz target: the row sum overflowed (a panic in
    /// debug builds, a wrong size in release builds).
    #[test]
    fn pack_buffer_row_sum_overflow_is_an_error() {
        let l = u64::MAX / 16 * 16;
        let e = dcp_pack_buffer_bytes(&[l, l], 1, 1, 1).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
    }

    #[test]
    fn coalesce_matches_reference_grouping() {
        // P=2, D=4, src [0,1,2,3], dst [0], rank 0: rows [0,4] -> two groups; packed one.
        let runs = coalesce_runs(&[0, 4], &[0, 1]).unwrap();
        assert_eq!(runs.len(), 2);
        let packed = coalesce_runs(&[0, 1], &[0, 1]).unwrap();
        assert_eq!(
            packed,
            vec![Run {
                src: 0,
                dst: 0,
                len: 2
            }]
        );
        assert!(coalesce_runs(&[], &[]).unwrap().is_empty());
        assert_eq!(
            coalesce_runs(&[1], &[]).unwrap_err().status(),
            Status::InvalidArgument
        );
        // breaks when only one side jumps
        let r = coalesce_runs(&[5, 6, 7, 8], &[1, 2, 9, 10]).unwrap();
        assert_eq!(
            r,
            vec![
                Run {
                    src: 5,
                    dst: 1,
                    len: 2
                },
                Run {
                    src: 7,
                    dst: 9,
                    len: 2
                }
            ]
        );
    }

    #[test]
    fn pack_buffer_sizing_reference_values() {
        assert_eq!(
            dcp_pack_buffer_bytes(&[64 * 16, 64 * 16], 64, 10, 4).unwrap(),
            384
        );
        let e = dcp_pack_buffer_bytes(&[0], 64, 10, 4).unwrap_err();
        assert!(e.detail().contains("at least one page"));
        let e = dcp_pack_buffer_bytes(&[100], 64, 10, 4).unwrap_err();
        assert!(e.detail().contains("page-aligned"));
        assert_eq!(pack_slice_tokens(24 * 576 * 16384, &[576; 24]), 16384);
        assert_eq!(pack_slice_tokens(100, &[60, 30]), 1);
        assert_eq!(pack_slice_tokens(100, &[]), 0);
    }

    #[test]
    fn worked_example_bytes() {
        // 4.5: rank 1 packed, 75 tokens, 61 layers of 1152 B
        let rows = vec![1152u64; 61];
        let pack = PackLayout::new(75, &rows).unwrap();
        assert_eq!(pack.total_bytes, 5_270_400);
        assert_eq!(pack.entry_offsets[1], 86_400);
        let runs = [
            Run {
                src: 0,
                dst: 2560,
                len: 64,
            },
            Run {
                src: 64,
                dst: 576,
                len: 11,
            },
        ];
        let ops = byte_ops(&runs, &rows, Some(&pack));
        assert_eq!(ops.len(), 122);
        assert_eq!(
            (ops[0].src_offset, ops[0].dst_offset, ops[0].len),
            (0, 2_949_120, 73_728)
        );
        assert_eq!(
            (ops[1].src_offset, ops[1].dst_offset, ops[1].len),
            (73_728, 663_552, 12_672)
        );
        assert_eq!(ops[2].src_offset, 86_400);
        // unpacked p=1 for rank 1: A + 449*1152 = 517,248 -> B + 2,949,120
        let one = byte_ops(
            &[Run {
                src: 449,
                dst: 2560,
                len: 1,
            }],
            &rows[..1],
            None,
        );
        assert_eq!((one[0].src_offset, one[0].dst_offset), (517_248, 2_949_120));
    }
}
