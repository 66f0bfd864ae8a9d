//! The one-copy path of a prefill worker on the same host: when the link's
//! transport has the decode rank's KV pools mapped into this process (cma,
//! decode pools in shared memory: [`alloc_pool`](crate::memory::shared::alloc_pool)),
//! a pair's rows are copied straight from the prefill's pools into the
//! decode's rows, after the decode granted the destination ranges; no
//! staging, no second copy. The copy is split by destination over the
//! engine's copy crew ([`super::spread`]).

use super::chunk::{Chunk, Pair};
use crate::engine::link::DecodeLink;
use crate::error::{Error, Result, Status};
use crate::layout::Run;
use crate::relayout::CopyEntry;
use crate::transport::{MappedRegion, PlacedRange, Transport};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Submits `layers` of one pair's rows of a chunk on the one-copy path:
/// `maps` are the decode's pools mapped here (one per topology entry, from
/// `data`, the connection the path was chosen on); returns the bytes.
pub(super) fn write(
    cx: &mut Chunk<'_, '_>,
    link: &Arc<DecodeLink>,
    data: &Arc<dyn Transport>,
    maps: &[MappedRegion],
    pair: &Pair<'_>,
    layers: &Range<usize>,
) -> Result<u64> {
    let inner = cx.inner;
    let (row_bytes, dst_regions) = (pair.row_bytes, pair.dst_regions);
    if maps.len() != row_bytes.len() || inner.pool_regions.len() != row_bytes.len() {
        return Err(Error::new(
            Status::GeometryMismatch,
            format!(
                "{} row sizes, {} decode pools, {} prefill pools",
                row_bytes.len(),
                maps.len(),
                inner.pool_regions.len()
            ),
        ));
    }
    let runs = pair.plan.direct(pair.req)?;
    let mut entries = Vec::with_capacity(layers.len());
    for e in layers.clone() {
        let rb = row_bytes[e];
        let src = &inner.pool_regions[e];
        for r in runs {
            check_rows(r.src, r.len, rb, src.len, "prefill pool", e)?;
            check_rows(r.dst, r.len, rb, maps[e].len, "decode pool", e)?;
        }
        entries.push(CopyEntry {
            src: src.addr,
            dst: maps[e].addr,
            row_bytes: rb,
            reserved: 0,
        });
    }
    let ranges = placed_ranges(
        runs,
        &row_bytes[layers.clone()],
        &dst_regions[layers.clone()],
    );
    let bytes: u64 = ranges.iter().map(|r| r.len).sum();
    let metrics = &inner.metrics;
    let mut place = || {
        let t0 = Instant::now();
        // SAFETY: every run of every entry was checked above to lie inside the
        // prefill's pool (valid for the engine's life) and inside the decode
        // pool's mapping (valid while `data`, held by the flight, lives); the
        // decode has granted and pinned exactly these destination ranges (this
        // runs only after its grant); source and destination are different
        // memory (our pool, the peer's memfd).
        unsafe { inner.copy_crew.copy(&entries, runs, bytes) }?;
        metrics.gathered(t0);
        metrics.placed(bytes);
        Ok(())
    };
    cx.flight
        .submit_placed(link, data.clone(), &ranges, &mut place)?;
    Ok(bytes)
}

/// `OutOfBounds` unless rows `row..row + rows` of `row_bytes` lie in `len` bytes.
fn check_rows(row: u64, rows: u64, row_bytes: u64, len: u64, what: &str, e: usize) -> Result<()> {
    let end = row.checked_add(rows).and_then(|r| r.checked_mul(row_bytes));
    match end {
        Some(end) if end <= len => Ok(()),
        _ => Err(Error::new(
            Status::OutOfBounds,
            format!(
                "one-copy rows {row}..{} of {row_bytes} B are outside the {what} of entry {e} ({len} B); nothing was copied",
                row.saturating_add(rows)
            ),
        )),
    }
}

/// The destination ranges of `runs` for each entry (region `dst_regions[e]`,
/// rows of `row_bytes[e]`), merged where the destination rows continue
/// (whatever the source rows do): what the decode validates and pins.
fn placed_ranges(runs: &[Run], row_bytes: &[u64], dst_regions: &[u64]) -> Vec<PlacedRange> {
    let mut out = Vec::new();
    for (&rb, &region) in row_bytes.iter().zip(dst_regions) {
        let first = out.len();
        for r in runs {
            let (off, len) = (r.dst * rb, r.len * rb);
            if let Some(last) = out[first..].last_mut() {
                let last: &mut PlacedRange = last;
                if last.remote_offset + last.len == off {
                    last.len += len;
                    continue;
                }
            }
            out.push(PlacedRange {
                remote_region: region,
                remote_offset: off,
                len,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_where_the_destination_continues() {
        let runs = [
            Run {
                src: 8,
                dst: 0,
                len: 1,
            },
            // the source jumps, the destination continues: one range
            Run {
                src: 12,
                dst: 1,
                len: 2,
            },
            Run {
                src: 14,
                dst: 9,
                len: 1,
            },
        ];
        let r = placed_ranges(&runs, &[4, 10], &[5, 6]);
        let want = |remote_region, remote_offset, len| PlacedRange {
            remote_region,
            remote_offset,
            len,
        };
        assert_eq!(
            r,
            [
                want(5, 0, 12),
                want(5, 36, 4),
                want(6, 0, 30),
                want(6, 90, 10)
            ]
        );
        assert_eq!(r.iter().map(|r| r.len).sum::<u64>(), 4 * (4 + 10));
    }

    #[test]
    fn rows_outside_a_pool_are_refused() {
        check_rows(2, 2, 8, 32, "decode pool", 0).unwrap();
        let e = check_rows(3, 2, 8, 32, "decode pool", 1).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds);
        assert!(e.detail().contains("decode pool of entry 1"), "{e}");
        let e = check_rows(u64::MAX, 2, 8, 32, "prefill pool", 0).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds);
    }
}
