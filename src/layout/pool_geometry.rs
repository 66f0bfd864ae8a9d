//! Where a KV pool's pages lie in memory: page `p` starts `p * page_stride`
//! bytes after the pool's base and holds `page_bytes` bytes (its token rows,
//! contiguous); the bytes between two pages (`page_stride - page_bytes`) are
//! not the pool's. A layer-compact pool has `page_stride == page_bytes`; a
//! block-outermost one (vLLM's `BLNHC`: the layers of one block side by
//! side) or a padded one has a larger stride.
//!
//! The planner and the data path address pages of `page_bytes` laid end to
//! end ("pitch pages"). A strided pool's stride is a whole number of pages
//! (its *page step*), so real page `p` is pitch page `p * step`, and every
//! row, run and byte offset computed from pitch pages lands on the real
//! page: [`PoolGeometry::pitch_pages`] is the one translation, done where a
//! page table enters a plan. Every pool of one rank shares the step, since a
//! page id names the same page of every pool ([`side_page_step`]).

use std::borrow::Cow;

use crate::error::{Error, Result, Status};

/// One KV pool's page geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolGeometry {
    /// Bytes of one page (`page_size * row_bytes`).
    pub page_bytes: u64,
    /// Bytes from the start of one page to the start of the next.
    pub page_stride: u64,
    /// Pages in the pool.
    pub num_pages: u64,
}

impl PoolGeometry {
    /// A validated geometry; `page_stride` 0 means `page_bytes` (pages end to
    /// end). Refused as `InvalidLayout`: a zero page, a stride below the page
    /// or not a whole number of pages, a span that overflows `u64`.
    pub fn new(page_bytes: u64, page_stride: u64, num_pages: u64) -> Result<PoolGeometry> {
        let page_stride = if page_stride == 0 {
            page_bytes
        } else {
            page_stride
        };
        if page_bytes == 0 {
            return Err(Error::new(Status::InvalidLayout, "page_bytes must be > 0"));
        }
        if page_stride < page_bytes {
            return Err(Error::new(
                Status::InvalidLayout,
                format!("page_stride {page_stride} is below page_bytes {page_bytes}: pages would overlap; pass the distance in bytes between the starts of two consecutive pages"),
            ));
        }
        if page_stride % page_bytes != 0 {
            return Err(Error::new(
                Status::InvalidLayout,
                format!("page_stride {page_stride} is not a multiple of page_bytes {page_bytes}: a pool's pages must be a whole number of pages apart"),
            ));
        }
        let g = PoolGeometry {
            page_bytes,
            page_stride,
            num_pages,
        };
        g.checked_span().ok_or_else(|| {
            Error::new(
                Status::InvalidLayout,
                format!("pool span overflows u64: {num_pages} pages {page_stride} B apart"),
            )
        })?;
        Ok(g)
    }

    fn checked_span(&self) -> Option<u64> {
        match self.num_pages {
            0 => Some(0),
            n => (n - 1)
                .checked_mul(self.page_stride)
                .and_then(|b| b.checked_add(self.page_bytes)),
        }
    }

    /// Bytes from the base to the end of the last page:
    /// `(num_pages - 1) * page_stride + page_bytes` (0 for no pages).
    pub fn span(&self) -> u64 {
        self.checked_span().expect("validated in new")
    }

    /// Byte offset of page `page` from the pool's base.
    pub fn page_offset(&self, page: u64) -> u64 {
        page * self.page_stride
    }

    /// Pages of `page_bytes` from one page's start to the next's (1: pages
    /// end to end).
    pub fn page_step(&self) -> u64 {
        self.page_stride / self.page_bytes
    }

    /// True when the pages lie end to end.
    pub fn is_compact(&self) -> bool {
        self.page_stride == self.page_bytes
    }

    /// The byte ranges `(offset, len)` of `pages` (sorted, distinct): one per
    /// run of consecutive pages when the pages lie end to end, else one per
    /// page, so no range covers a gap between pages.
    pub fn page_ranges(&self, pages: &[u64]) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for &p in pages {
            let off = self.page_offset(p);
            match out.last_mut() {
                Some((s, n)) if self.is_compact() && *s + *n == off => *n += self.page_bytes,
                _ => out.push((off, self.page_bytes)),
            }
        }
        out
    }

    /// The page ids the planner and the data path address for real page ids
    /// `pages`: `p * step` (borrowed unchanged when the step is 1).
    pub fn pitch_pages(step: u64, pages: &[u64]) -> Cow<'_, [u64]> {
        if step == 1 {
            Cow::Borrowed(pages)
        } else {
            Cow::Owned(pages.iter().map(|&p| p * step).collect())
        }
    }
}

/// The page step shared by every pool of one rank (1 for none); pools with
/// different steps are refused as `GeometryMismatch`, naming both.
pub fn side_page_step<'a>(pools: impl IntoIterator<Item = &'a PoolGeometry>) -> Result<u64> {
    let mut step: Option<(usize, u64)> = None;
    for (i, g) in pools.into_iter().enumerate() {
        match step {
            None => step = Some((i, g.page_step())),
            Some((j, s)) if s != g.page_step() => {
                return Err(Error::new(
                    Status::GeometryMismatch,
                    format!(
                        "KV pool {i} has pages {} page(s) apart, pool {j} {s}: a page id names the same page of every pool, so every pool of a rank needs the same page_stride / page_bytes",
                        g.page_step()
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(step.map_or(1, |(_, s)| s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_by_default_and_strided_span_ends_at_the_last_page() {
        let g = PoolGeometry::new(64, 0, 10).unwrap();
        assert_eq!((g.page_stride, g.span(), g.page_step()), (64, 640, 1));
        assert!(g.is_compact());
        let s = PoolGeometry::new(64, 192, 10).unwrap();
        assert_eq!(s.span(), 9 * 192 + 64);
        assert_eq!((s.page_offset(3), s.page_step()), (576, 3));
        assert!(!s.is_compact());
        assert_eq!(PoolGeometry::new(64, 192, 0).unwrap().span(), 0);
    }

    #[test]
    fn bad_strides_and_overflowing_spans_are_refused() {
        for (pb, st, n) in [(64, 32, 4), (64, 100, 4), (0, 0, 4), (64, u64::MAX / 2, 4)] {
            let e = PoolGeometry::new(pb, st, n).unwrap_err();
            assert_eq!(e.status(), Status::InvalidLayout, "{pb} {st} {n}: {e}");
        }
        assert!(PoolGeometry::new(64, 32, 4)
            .unwrap_err()
            .detail()
            .contains("below page_bytes 64"));
    }

    #[test]
    fn ranges_merge_only_end_to_end_pages() {
        let c = PoolGeometry::new(8, 8, 20).unwrap();
        assert_eq!(c.page_ranges(&[2, 3, 4, 9]), [(16, 24), (72, 8)]);
        let s = PoolGeometry::new(8, 24, 20).unwrap();
        assert_eq!(s.page_ranges(&[2, 3, 9]), [(48, 8), (72, 8), (216, 8)]);
    }

    #[test]
    fn pitch_pages_land_on_the_real_pages() {
        let s = PoolGeometry::new(8, 24, 20).unwrap();
        let pitch = PoolGeometry::pitch_pages(s.page_step(), &[0, 5, 19]);
        for (&real, &v) in [0u64, 5, 19].iter().zip(pitch.iter()) {
            // the data path's formula on pitch pages: v * page_bytes
            assert_eq!(v * s.page_bytes, s.page_offset(real));
        }
        assert!(matches!(
            PoolGeometry::pitch_pages(1, &[1, 2]),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn one_step_per_rank() {
        let a = PoolGeometry::new(8, 24, 4).unwrap();
        let b = PoolGeometry::new(16, 48, 4).unwrap();
        assert_eq!(side_page_step([&a, &b]).unwrap(), 3);
        assert_eq!(side_page_step([]).unwrap(), 1);
        let c = PoolGeometry::new(16, 16, 4).unwrap();
        assert_eq!(
            side_page_step([&a, &c]).unwrap_err().status(),
            Status::GeometryMismatch
        );
    }
}
