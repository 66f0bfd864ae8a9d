//! Token plans: which source rows go to which destination rows for one chunk
//! and one (prefill DCP rank, decode DCP rank) pair.
//!
//! [`PairRequest`] is the general planner: any page size, DCP size and
//! interleave on either side. [`SglangChunk`] is SGLang's
//! `build_dcp_token_transfer_plan` (reference 4.2) expressed in it, with the
//! same results and the same three errors.
//!
//! Page tables are relative to an *origin*: the sequence position of the first
//! token that `pages[0]` covers on that side. Origins must be aligned to the
//! side's virtual page (`P*W`) so that every rank's table starts on a page
//! boundary; on the decode side the origin is `decode_prefix_len`.

use super::runs::{Run, RunMerger};
use super::topology::DcpLayout;
use crate::error::{Error, Result, Status};

/// Per-token plan: `src_rows[i]` moves to `dst_rows[i]`, in sequence order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenPlan {
    /// Source token rows (page id * page size + slot).
    pub src_rows: Vec<u64>,
    /// Destination token rows.
    pub dst_rows: Vec<u64>,
}

impl TokenPlan {
    /// Number of tokens in the plan.
    pub fn len(&self) -> usize {
        self.src_rows.len()
    }

    /// True when the plan moves nothing.
    pub fn is_empty(&self) -> bool {
        self.src_rows.is_empty()
    }
}

/// A maximal stretch of positions over which both rows advance by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Absolute sequence position of the first token.
    pub pos: u64,
    /// Number of tokens.
    pub len: u64,
    /// Source row of the first token.
    pub src_row: u64,
    /// Destination row of the first token.
    pub dst_row: u64,
}

/// One side of a pair request: layout, rank, page table and its origin.
#[derive(Debug, Clone, Copy)]
pub struct Side<'a> {
    /// The side's layout.
    pub layout: DcpLayout,
    /// The DCP rank on this side.
    pub rank: u64,
    /// The rank's page table (physical page ids), starting at `origin`.
    pub pages: &'a [u64],
    /// Sequence position covered by the first slot of `pages[0]`'s share.
    pub origin: u64,
}

impl Side<'_> {
    fn row(&self, t: u64) -> (u64, u64) {
        // local index relative to the origin; origin alignment makes it page aligned.
        let l = self.layout.local(t) - self.layout.local(self.origin);
        let p = self.layout.page_size;
        let idx = (l / p) as usize;
        (self.pages[idx] * p + l % p, p - l % p)
    }
}

/// The general planner's input: one chunk `[start, start + num_tokens)` moved
/// from source rank `src.rank` to destination rank `dst.rank`.
#[derive(Debug, Clone, Copy)]
pub struct PairRequest<'a> {
    /// The sending side (prefill).
    pub src: Side<'a>,
    /// The receiving side (decode).
    pub dst: Side<'a>,
    /// Absolute position of the chunk's first token.
    pub start: u64,
    /// Number of tokens in the chunk.
    pub num_tokens: u64,
}

impl PairRequest<'_> {
    /// Validates the request; every error is typed and names the values involved.
    pub fn validate(&self) -> Result<()> {
        let (s, d) = (&self.src, &self.dst);
        s.layout.validate()?;
        d.layout.validate()?;
        if s.rank >= s.layout.dcp_size || d.rank >= d.layout.dcp_size {
            return Err(Error::new(
                Status::InvalidTopology,
                format!(
                    "rank out of range: prefill dcp_rank={} (dcp_size={}), decode dcp_rank={} (dcp_size={})",
                    s.rank, s.layout.dcp_size, d.rank, d.layout.dcp_size
                ),
            ));
        }
        let vd = d.layout.virtual_page();
        if d.origin % vd != 0 {
            return Err(Error::new(
                Status::PrefixMisaligned,
                format!(
                    "PD DCP transfer requires decode_prefix_len to align to the virtual DCP page size ({vd} = page_size {} x dcp_size {}), got {}; the decode side should round its reusable prefix down to {}",
                    d.layout.page_size,
                    d.layout.dcp_size,
                    d.origin,
                    d.origin / vd * vd
                ),
            ));
        }
        let vs = s.layout.virtual_page();
        if s.origin % vs != 0 {
            return Err(Error::new(
                Status::PrefixMisaligned,
                format!(
                    "the source page table must start on a virtual page boundary ({vs} = page_size {} x dcp_size {}), got origin {}",
                    s.layout.page_size, s.layout.dcp_size, s.origin
                ),
            ));
        }
        if self.start < s.origin || self.start < d.origin {
            return Err(Error::invalid(format!(
                "chunk start {} lies before a page table origin (source origin {}, decode prefix {})",
                self.start, s.origin, d.origin
            )));
        }
        let end = self
            .start
            .checked_add(self.num_tokens)
            .ok_or_else(|| Error::invalid("chunk start + num_tokens overflows u64"))?;
        if self.num_tokens == 0 {
            return Ok(());
        }
        // A rank that owns no token of the chunk needs no pages for it.
        let owns_src = s.layout.count_owned(s.rank, self.start, end) > 0;
        let need_src = if owns_src {
            s.layout.count_owned(s.rank, s.origin, end)
        } else {
            0
        };
        let cap_src = (s.pages.len() as u64).saturating_mul(s.layout.page_size);
        if need_src > cap_src {
            return Err(Error::new(
                Status::TokensExceedSource,
                format!(
                    "num_kv_tokens must fit in the provided source pages, got tokens={}, capacity={cap_src} ({} pages x page_size {}) on prefill dcp_rank {}",
                    if s.layout.dcp_size == 1 { self.num_tokens + (self.start - s.origin) } else { need_src },
                    s.pages.len(),
                    s.layout.page_size,
                    s.rank
                ),
            ));
        }
        let owns_dst = d.layout.count_owned(d.rank, self.start, end) > 0;
        let need_dst = if owns_dst {
            d.layout.count_owned(d.rank, d.origin, end)
        } else {
            0
        };
        let cap_dst = (d.pages.len() as u64).saturating_mul(d.layout.page_size);
        if need_dst > cap_dst {
            let required = need_dst.div_ceil(d.layout.page_size);
            return Err(Error::new(
                Status::InsufficientDestination,
                format!(
                    "Insufficient destination DCP pages: required={required}, provided={}, chunk tokens [{}, {}), decode_prefix_len={}, dcp_rank={}; the decode rank must register ceil(tokens / {}) virtual pages for the request",
                    d.pages.len(),
                    self.start,
                    end,
                    d.origin,
                    d.rank,
                    d.layout.virtual_page()
                ),
            ));
        }
        Ok(())
    }

    /// Number of tokens this pair moves (no validation of the page tables).
    pub fn token_count(&self) -> u64 {
        let end = self.start.saturating_add(self.num_tokens);
        if self.src.layout.dcp_size == 1 {
            return self.dst.layout.count_owned(self.dst.rank, self.start, end);
        }
        let mut n = 0;
        walk_positions(self, |_, len| n += len);
        n
    }

    /// Calls `f` for every segment of the pair, in sequence order.
    pub fn for_each_segment(&self, mut f: impl FnMut(Segment)) -> Result<()> {
        self.validate()?;
        if self.src.layout.dcp_size == 1 {
            segments_single_source(self, f);
            return Ok(());
        }
        walk_positions(self, |t, len| {
            // split at page boundaries of both sides
            let (mut t, mut left) = (t, len);
            while left > 0 {
                let (sr, srem) = self.src.row(t);
                let (dr, drem) = self.dst.row(t);
                let n = left.min(srem).min(drem);
                f(Segment {
                    pos: t,
                    len: n,
                    src_row: sr,
                    dst_row: dr,
                });
                t += n;
                left -= n;
            }
        });
        Ok(())
    }

    /// The per-token plan.
    pub fn plan(&self) -> Result<TokenPlan> {
        let n = if self.validate().is_ok() {
            self.token_count() as usize
        } else {
            0
        };
        let mut plan = TokenPlan {
            src_rows: Vec::with_capacity(n),
            dst_rows: Vec::with_capacity(n),
        };
        self.for_each_segment(|s| {
            if s.len == 1 {
                plan.src_rows.push(s.src_row);
                plan.dst_rows.push(s.dst_row);
            } else {
                plan.src_rows.extend(s.src_row..s.src_row + s.len);
                plan.dst_rows.extend(s.dst_row..s.dst_row + s.len);
            }
        })?;
        Ok(plan)
    }

    /// Runs of rows, unpacked (source rows in the pool) or packed (source rows
    /// are indices `0..n` into a staging buffer that holds this pair's tokens
    /// in sequence order). Adjacent runs merge when both sides continue.
    pub fn runs(&self, packed: bool) -> Result<Vec<Run>> {
        let mut runs: Vec<Run> = Vec::new();
        if self.validate().is_ok() {
            runs.reserve(self.max_runs(packed) as usize);
        }
        self.for_each_run(packed, |r| runs.push(r))?;
        Ok(runs)
    }

    /// Calls `f` for every run (see [`runs`](Self::runs)), in order, without allocating.
    pub fn for_each_run(&self, packed: bool, mut f: impl FnMut(Run)) -> Result<()> {
        let mut m = RunMerger::default();
        if packed && self.src.layout.dcp_size == 1 {
            self.validate()?;
            packed_runs_single_source(self, &mut m, &mut f);
        } else {
            let mut next_pack = 0u64;
            self.for_each_segment(|s| {
                let src = if packed { next_pack } else { s.src_row };
                next_pack += s.len;
                m.push(src, s.dst_row, s.len, &mut f);
            })?;
        }
        m.finish(&mut f);
        Ok(())
    }

    /// An upper bound on the number of runs (for sizing output buffers).
    pub fn max_runs(&self, packed: bool) -> u64 {
        let tokens = self.token_count();
        if packed && self.src.layout.dcp_size == 1 {
            tokens.min(self.dst.pages.len() as u64)
        } else {
            tokens
        }
    }
}

/// Appends a run to `runs`, merging it into the last one when both sides continue.
pub(crate) fn push_run(runs: &mut Vec<Run>, src: u64, dst: u64, len: u64) {
    if let Some(last) = runs.last_mut() {
        if last.src + last.len == src && last.dst + last.len == dst {
            last.len += len;
            return;
        }
    }
    runs.push(Run { src, dst, len });
}

/// Segments when one source rank holds every token (prefill DCP 1, SGLang's
/// case): walks the destination rank's contiguous local indices with running
/// counters, so the loop does no division.
fn segments_single_source(req: &PairRequest<'_>, mut f: impl FnMut(Segment)) {
    let (s, d) = (&req.src, &req.dst);
    let (dl, sl) = (&d.layout, &s.layout);
    let end = req.start + req.num_tokens;
    let lo = dl.count_owned(d.rank, d.origin, req.start);
    let hi = dl.count_owned(d.rank, d.origin, end);
    if lo == hi {
        return;
    }
    let (pd, ps) = (dl.page_size, sl.page_size);
    // interleave block of the destination (unbounded without DCP)
    let (blk, gap) = if dl.dcp_size == 1 {
        (u64::MAX, 0)
    } else {
        (dl.interleave, (dl.dcp_size - 1) * dl.interleave)
    };
    let abs_l = lo + dl.local(d.origin);
    let mut t = if dl.dcp_size == 1 {
        abs_l
    } else {
        (abs_l / dl.interleave) * dl.dcp_size * dl.interleave
            + d.rank * dl.interleave
            + abs_l % dl.interleave
    };
    let mut in_blk = if dl.dcp_size == 1 {
        0
    } else {
        abs_l % dl.interleave
    };
    let (mut dpi, mut doff) = ((lo / pd) as usize, lo % pd);
    let soff0 = t - s.origin;
    let (mut spi, mut soff) = ((soff0 / ps) as usize, soff0 % ps);
    let mut left = hi - lo;
    while left > 0 {
        let n = left.min(blk - in_blk).min(pd - doff).min(ps - soff);
        f(Segment {
            pos: t,
            len: n,
            src_row: s.pages[spi] * ps + soff,
            dst_row: d.pages[dpi] * pd + doff,
        });
        left -= n;
        doff += n;
        if doff == pd {
            doff = 0;
            dpi += 1;
        }
        in_blk += n;
        let mut step = n;
        if in_blk == blk {
            in_blk = 0;
            step += gap;
        }
        t += step;
        soff += step;
        if soff >= ps {
            if soff < 2 * ps {
                soff -= ps;
                spi += 1;
            } else {
                spi += (soff / ps) as usize;
                soff %= ps;
            }
        }
    }
}

/// Calls `f(t, len)` for each maximal stretch of positions in the chunk owned by
/// both ranks and inside one interleave block of each side.
fn walk_positions(req: &PairRequest<'_>, mut f: impl FnMut(u64, u64)) {
    let (s, d) = (&req.src.layout, &req.dst.layout);
    let (a, b) = (req.src.rank, req.dst.rank);
    let end = req.start.saturating_add(req.num_tokens);
    let mut t = req.start;
    while t < end {
        // move to the next position owned by the destination rank
        if d.dcp_size > 1 && d.owner(t) != b {
            t = next_owned_block(d, b, t);
            continue;
        }
        if s.dcp_size > 1 && s.owner(t) != a {
            t = next_owned_block(s, a, t);
            continue;
        }
        let dst_left = block_left(d, t);
        let src_left = block_left(s, t);
        let n = (end - t).min(dst_left).min(src_left);
        f(t, n);
        t += n;
    }
}

/// Positions left in `t`'s interleave block (unbounded without DCP).
fn block_left(l: &DcpLayout, t: u64) -> u64 {
    if l.dcp_size == 1 {
        u64::MAX
    } else {
        l.interleave - t % l.interleave
    }
}

/// First position after `t` that starts an interleave block owned by `rank`.
fn next_owned_block(l: &DcpLayout, rank: u64, t: u64) -> u64 {
    let q = t / l.interleave + 1;
    let step = (rank + l.dcp_size - q % l.dcp_size) % l.dcp_size;
    (q + step).saturating_mul(l.interleave)
}

/// Packed runs when one source rank sends everything: the destination's local
/// indices of its tokens are contiguous, so runs follow its pages only.
fn packed_runs_single_source(req: &PairRequest<'_>, m: &mut RunMerger, f: &mut impl FnMut(Run)) {
    let d = &req.dst;
    let end = req.start + req.num_tokens;
    let lo = d.layout.count_owned(d.rank, d.origin, req.start);
    let hi = d.layout.count_owned(d.rank, d.origin, end);
    let p = d.layout.page_size;
    let mut l = lo;
    while l < hi {
        let n = (p - l % p).min(hi - l);
        let row = d.pages[(l / p) as usize] * p + l % p;
        m.push(l - lo, row, n, f);
        l += n;
    }
}

/// SGLang's per-chunk DCP plan inputs (`build_dcp_token_transfer_plan`).
#[derive(Debug, Clone, Copy)]
pub struct SglangChunk<'a> {
    /// Prefill physical page ids of this chunk.
    pub src_pages: &'a [u64],
    /// The whole virtual page list the decode rank sent for the request.
    pub dst_pages: &'a [u64],
    /// Physical page size P (equal on both sides).
    pub page_size: u64,
    /// Decode DCP size D.
    pub dcp_size: u64,
    /// Decode DCP rank r.
    pub dcp_rank: u64,
    /// Index of this chunk's first page within the post-prefix page sequence.
    pub src_page_offset: u64,
    /// Tokens the decode side already holds (multiple of P*D).
    pub decode_prefix_len: u64,
    /// Valid tokens in this chunk; `None` means every slot of `src_pages`.
    pub num_tokens: Option<u64>,
}

impl<'a> SglangChunk<'a> {
    /// The equivalent general request (prefill: DCP 1; decode: DCP D, interleave 1).
    pub fn to_pair(&self) -> Result<PairRequest<'a>> {
        let src = DcpLayout::sglang(self.page_size, 1)?;
        let dst = DcpLayout::sglang(self.page_size, self.dcp_size)?;
        let off_tokens = self
            .src_page_offset
            .checked_mul(self.page_size)
            .ok_or_else(|| Error::invalid("src_page_offset * page_size overflows"))?;
        let chunk_start = self
            .decode_prefix_len
            .checked_add(off_tokens)
            .ok_or_else(|| Error::invalid("decode_prefix_len + offset overflows"))?;
        let n = match self.num_tokens {
            Some(n) => n,
            None => (self.src_pages.len() as u64).saturating_mul(self.page_size),
        };
        Ok(PairRequest {
            src: Side {
                layout: src,
                rank: 0,
                pages: self.src_pages,
                origin: chunk_start,
            },
            dst: Side {
                layout: dst,
                rank: self.dcp_rank,
                pages: self.dst_pages,
                origin: self.decode_prefix_len,
            },
            start: chunk_start,
            num_tokens: n,
        })
    }
}

/// SGLang's `build_dcp_token_transfer_plan` for one chunk and one decode rank.
///
/// Errors: `prefix_misaligned`, `tokens_exceed_source`, `insufficient_destination`
/// (and `invalid_layout` / `invalid_topology` for zero sizes or a rank >= D).
pub fn dcp_token_plan(chunk: &SglangChunk<'_>) -> Result<TokenPlan> {
    let req = chunk.to_pair()?;
    // SGLang checks the prefix first, before anything about the pages.
    req.plan()
}

/// Every (source rank, destination rank) pair that shares at least one token
/// position under the two layouts (checked over one full period).
pub fn pairs_with_share(src: &DcpLayout, dst: &DcpLayout) -> Vec<(u64, u64)> {
    let bs = src.dcp_size * src.interleave;
    let bd = dst.dcp_size * dst.interleave;
    let g = gcd(bs, bd);
    let period = (bs / g).saturating_mul(bd);
    let mut seen = vec![false; (src.dcp_size * dst.dcp_size) as usize];
    // positions only matter at block boundaries of either side
    let step = gcd(src.interleave, dst.interleave);
    let mut t = 0;
    while t < period {
        let (a, b) = (src.owner(t), dst.owner(t));
        seen[(a * dst.dcp_size + b) as usize] = true;
        t += step;
    }
    let mut out = Vec::new();
    for a in 0..src.dcp_size {
        for b in 0..dst.dcp_size {
            if seen[(a * dst.dcp_size + b) as usize] {
                out.push((a, b));
            }
        }
    }
    out
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::too_many_arguments)]
    fn sg(
        src: &[u64],
        dst: &[u64],
        p: u64,
        d: u64,
        r: u64,
        off: u64,
        prefix: u64,
        n: Option<u64>,
    ) -> Result<TokenPlan> {
        dcp_token_plan(&SglangChunk {
            src_pages: src,
            dst_pages: dst,
            page_size: p,
            dcp_size: d,
            dcp_rank: r,
            src_page_offset: off,
            decode_prefix_len: prefix,
            num_tokens: n,
        })
    }

    /// SGLang's algorithm written the obvious way (reference 4.2), for comparison.
    #[allow(clippy::too_many_arguments)]
    fn sglang_brute(
        src: &[u64],
        dst: &[u64],
        p: u64,
        d: u64,
        r: u64,
        off: u64,
        prefix: u64,
        n: u64,
    ) -> std::result::Result<TokenPlan, Status> {
        if !prefix.is_multiple_of(p * d) {
            return Err(Status::PrefixMisaligned);
        }
        if n > src.len() as u64 * p {
            return Err(Status::TokensExceedSource);
        }
        let chunk_start = prefix + off * p;
        let o0 = (r + d - chunk_start % d) % d;
        let mut plan = TokenPlan::default();
        let mut o = o0;
        while o < n {
            let local = (off * p + o) / d;
            if local / p >= dst.len() as u64 {
                return Err(Status::InsufficientDestination);
            }
            plan.src_rows.push(src[(o / p) as usize] * p + o % p);
            plan.dst_rows
                .push(dst[(local / p) as usize] * p + local % p);
            o += d;
        }
        Ok(plan)
    }

    #[test]
    fn reference_6a_small_cases() {
        let r0 = sg(&[10, 11], &[30], 4, 2, 0, 0, 0, None).unwrap();
        assert_eq!(r0.src_rows, vec![40, 42, 44, 46]);
        assert_eq!(r0.dst_rows, vec![120, 121, 122, 123]);
        let r1 = sg(&[10, 11], &[30], 4, 2, 1, 0, 0, None).unwrap();
        assert_eq!(r1.src_rows, vec![41, 43, 45, 47]);
        assert_eq!(r1.dst_rows, vec![120, 121, 122, 123]);

        let p = sg(&[11], &[30], 4, 2, 0, 1, 0, None).unwrap();
        assert_eq!((p.src_rows, p.dst_rows), (vec![44, 46], vec![122, 123]));

        let p = sg(&[10, 11, 12, 13], &[30, 47], 4, 2, 1, 0, 0, None).unwrap();
        assert_eq!(p.src_rows, vec![41, 43, 45, 47, 49, 51, 53, 55]);
        assert_eq!(p.dst_rows, vec![120, 121, 122, 123, 188, 189, 190, 191]);

        let p = sg(&[7], &[20], 4, 2, 1, 0, 8, None).unwrap();
        assert_eq!((p.src_rows, p.dst_rows), (vec![29, 31], vec![80, 81]));

        let expect: [(&[u64], &[u64]); 4] = [
            (&[36, 8], &[28, 29]),
            (&[37], &[28]),
            (&[38], &[28]),
            (&[39], &[28]),
        ];
        for (r, (s, d)) in expect.iter().enumerate() {
            let p = sg(&[9, 2], &[7], 4, 4, r as u64, 0, 0, Some(5)).unwrap();
            assert_eq!(p.src_rows, s.to_vec(), "rank {r}");
            assert_eq!(p.dst_rows, d.to_vec(), "rank {r}");
        }
    }

    #[test]
    fn reference_6a_error_cases() {
        assert!(sg(&[], &[], 4, 2, 0, 0, 0, Some(0)).unwrap().is_empty());
        let e = sg(&[1], &[2], 4, 2, 0, 0, 4, None).unwrap_err();
        assert_eq!(e.status(), Status::PrefixMisaligned);
        assert!(
            e.detail().contains("(8 = page_size 4 x dcp_size 2), got 4"),
            "{e}"
        );
        let e = sg(&[1, 2, 3, 4], &[9], 4, 2, 0, 0, 0, None).unwrap_err();
        assert_eq!(e.status(), Status::InsufficientDestination);
        assert!(e.detail().contains("required=2, provided=1"), "{e}");
        let e = sg(&[1], &[9], 4, 2, 0, 0, 0, Some(5)).unwrap_err();
        assert_eq!(e.status(), Status::TokensExceedSource);
        assert!(e.detail().contains("tokens=5, capacity=4"), "{e}");
    }

    #[test]
    fn reference_6b_cases() {
        let expect: [&[u64]; 4] = [&[10, 22], &[11, 23], &[4, 8], &[5, 9]];
        let mut union = Vec::new();
        for (r, s) in expect.iter().enumerate() {
            let p = sg(&[5, 2, 11, 4], &[7], 2, 4, r as u64, 0, 0, Some(8)).unwrap();
            assert_eq!(p.src_rows, s.to_vec(), "rank {r}");
            assert_eq!(p.dst_rows, vec![14, 15]);
            union.extend(p.src_rows);
        }
        union.sort();
        assert_eq!(union, vec![4, 5, 8, 9, 10, 11, 22, 23]);

        let p = sg(&[9, 3], &[4, 6], 2, 2, 0, 2, 4, Some(4)).unwrap();
        assert_eq!((p.src_rows, p.dst_rows), (vec![18, 6], vec![12, 13]));
        let p = sg(&[9, 3], &[4, 6], 2, 2, 1, 2, 4, Some(4)).unwrap();
        assert_eq!((p.src_rows, p.dst_rows), (vec![19, 7], vec![12, 13]));
    }

    #[test]
    fn worked_example_4_5() {
        let src = [7, 3, 12, 5, 20];
        let dst = [40, 9];
        let p1 = sg(&src, &dst, 64, 4, 1, 0, 0, Some(300)).unwrap();
        assert_eq!(p1.len(), 75);
        let table = [
            (0, 449, 2560),
            (1, 453, 2561),
            (15, 509, 2575),
            (16, 193, 2576),
            (63, 381, 2623),
            (64, 1281, 576),
            (74, 1321, 586),
        ];
        for (k, s, d) in table {
            assert_eq!((p1.src_rows[k], p1.dst_rows[k]), (s, d), "k={k}");
        }
        let p0 = sg(&src, &dst, 64, 4, 0, 0, 0, Some(300)).unwrap();
        assert_eq!((p0.src_rows[0], p0.dst_rows[0]), (448, 2560));
        assert_eq!((p0.src_rows[74], p0.dst_rows[74]), (1320, 586));
        let p3 = sg(&src, &dst, 64, 4, 3, 0, 0, Some(300)).unwrap();
        assert_eq!((p3.src_rows[0], p3.dst_rows[0]), (451, 2560));
        assert_eq!((p3.src_rows[74], p3.dst_rows[74]), (1323, 586));
        // chunked: second chunk of rank 1
        let c2 = sg(&[20], &dst, 64, 4, 1, 4, 0, Some(44)).unwrap();
        assert_eq!(c2.src_rows, (1281..=1321).step_by(4).collect::<Vec<_>>());
        assert_eq!(c2.dst_rows, (576..=586).collect::<Vec<_>>());
        // cached prefix of 256
        let pr = sg(&[20], &[9], 64, 4, 1, 0, 256, Some(44)).unwrap();
        assert_eq!(pr.dst_rows, (576..=586).collect::<Vec<_>>());
        assert_eq!(
            sg(&src, &dst, 64, 4, 1, 0, 64, None).unwrap_err().status(),
            Status::PrefixMisaligned
        );
        // N=301: rank 0 gets 76
        let src6 = [7, 3, 12, 5, 20];
        assert_eq!(
            sg(&src6, &dst, 64, 4, 0, 0, 0, Some(301)).unwrap().len(),
            76
        );
        assert_eq!(
            sg(&src6, &dst, 64, 4, 1, 0, 0, Some(301)).unwrap().len(),
            75
        );
        // packed: two runs of 64 and 11 rows
        let req = SglangChunk {
            src_pages: &src,
            dst_pages: &dst,
            page_size: 64,
            dcp_size: 4,
            dcp_rank: 1,
            src_page_offset: 0,
            decode_prefix_len: 0,
            num_tokens: Some(300),
        }
        .to_pair()
        .unwrap();
        assert_eq!(
            req.runs(true).unwrap(),
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
        assert_eq!(req.runs(false).unwrap().len(), 75);
    }

    #[test]
    fn kimi_shape_byte_exact_against_brute() {
        // reference 6D: tokens 3*64+17, src [9,2,5,11], dst [4,40,8,1], offset 4, prefix 64*16
        let src = [9, 2, 5, 11];
        let dst = [4, 40, 8, 1];
        for r in 0..16 {
            let got = sg(&src, &dst, 64, 16, r, 4, 64 * 16, Some(3 * 64 + 17)).unwrap();
            let want = sglang_brute(&src, &dst, 64, 16, r, 4, 64 * 16, 3 * 64 + 17).unwrap();
            assert_eq!(got, want, "rank {r}");
        }
    }

    #[test]
    fn randomized_against_sglang_brute() {
        // reference 6A: P in {1,4,8}, D in {2,4}, 1..2D source pages, every rank
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut rnd = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for p in [1u64, 4, 8] {
            for d in [2u64, 4] {
                for _ in 0..40 {
                    let ns = 1 + rnd(2 * d);
                    let src: Vec<u64> = (0..ns).map(|_| rnd(100)).collect();
                    let nd = rnd(4) as usize;
                    let dst: Vec<u64> = (0..nd).map(|_| rnd(100)).collect();
                    let off = rnd(3);
                    let prefix = rnd(3) * p * d + if rnd(5) == 0 { 1 } else { 0 };
                    let n = rnd(ns * p + 2);
                    for r in 0..d {
                        let got =
                            sg(&src, &dst, p, d, r, off, prefix, Some(n)).map_err(|e| e.status());
                        let want = sglang_brute(&src, &dst, p, d, r, off, prefix, n);
                        assert_eq!(got, want, "p={p} d={d} r={r} src={src:?} dst={dst:?} off={off} prefix={prefix} n={n}");
                    }
                }
            }
        }
    }

    #[test]
    fn pairs_with_share_cases() {
        let one = DcpLayout::new(64, 1, 1).unwrap();
        let four = DcpLayout::new(64, 4, 1).unwrap();
        assert_eq!(
            pairs_with_share(&one, &four),
            vec![(0, 0), (0, 1), (0, 2), (0, 3)]
        );
        assert_eq!(
            pairs_with_share(&four, &four),
            vec![(0, 0), (1, 1), (2, 2), (3, 3)]
        );
        let two = DcpLayout::new(64, 2, 1).unwrap();
        assert_eq!(
            pairs_with_share(&two, &four),
            vec![(0, 0), (0, 2), (1, 1), (1, 3)]
        );
        let four_i16 = DcpLayout::new(64, 4, 16).unwrap();
        assert_eq!(pairs_with_share(&four, &four_i16).len(), 16);
    }
}
