//! Splitting one request's send into chunks (reference 5.2 step 1 and test 6C).
//!
//! Sending starts at the decode prefix. A partial page that is not the last one
//! is held back until the request's tail is known; a limit (the pack buffer's
//! capacity in tokens) splits a send into chunks of at most that many tokens,
//! at page boundaries. The chunker holds only counters: it is pure.
//!
//! Within a chunk, [`slice_requests`] cuts one rank pair's share into slices
//! of at most as many tokens as a staging slice holds.

use crate::error::{Error, Result, Status};
use crate::layout::plan::PairRequest;

/// One send: pages `[page_start, page_end)` of the prefill page list (indices,
/// not page ids) carrying `num_tokens` valid tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSpec {
    /// First page index (into the request's full prefill page list).
    pub page_start: u64,
    /// One past the last page index.
    pub page_end: u64,
    /// Valid tokens in the chunk (only the final page may be partial).
    pub num_tokens: u64,
    /// `src_page_offset` of the plan: pages after the decode prefix before this chunk.
    pub src_page_offset: u64,
    /// True for the request's final chunk (aux and state data follow it).
    pub last: bool,
}

/// Tracks what of one request has been sent.
#[derive(Debug, Clone)]
pub struct SendChunker {
    page_size: u64,
    prefix_pages: u64,
    limit_pages: Option<u64>,
    next_token: u64,
    done: bool,
}

impl SendChunker {
    /// A chunker for a request whose decode side already holds `decode_prefix_len`
    /// tokens; `max_tokens` (if any) bounds one chunk and is rounded down to whole pages.
    pub fn new(
        page_size: u64,
        decode_prefix_len: u64,
        max_tokens: Option<u64>,
    ) -> Result<SendChunker> {
        if page_size == 0 {
            return Err(Error::new(Status::InvalidLayout, "page_size must be >= 1"));
        }
        if !decode_prefix_len.is_multiple_of(page_size) {
            return Err(Error::new(
                Status::PrefixMisaligned,
                format!("decode_prefix_len {decode_prefix_len} is not a multiple of the page size {page_size}"),
            ));
        }
        let limit_pages = match max_tokens {
            None => None,
            Some(t) if t < page_size => {
                return Err(Error::invalid(format!(
                    "the chunk limit of {t} tokens is smaller than one page ({page_size}); a pack buffer must hold at least one page of every rank"
                )))
            }
            Some(t) => Some(t / page_size),
        };
        Ok(SendChunker {
            page_size,
            prefix_pages: decode_prefix_len / page_size,
            limit_pages,
            next_token: decode_prefix_len,
            done: false,
        })
    }

    /// The sends that become possible once `ready_tokens` tokens of the request
    /// exist; `is_final` says that `ready_tokens` is the request's total length.
    /// A final call always returns at least one chunk (possibly empty) marked `last`.
    pub fn advance(&mut self, ready_tokens: u64, is_final: bool) -> Result<Vec<ChunkSpec>> {
        if self.done {
            return Err(Error::invalid("the request's final chunk was already sent"));
        }
        if ready_tokens < self.next_token {
            return Err(Error::invalid(format!(
                "ready_tokens {ready_tokens} is below what was already sent ({})",
                self.next_token
            )));
        }
        let p = self.page_size;
        // without the tail, send only whole pages
        let end = if is_final {
            ready_tokens
        } else {
            ready_tokens / p * p
        };
        let mut out = Vec::new();
        let mut t = self.next_token;
        while t < end {
            let page_start = t / p;
            let mut page_end = end.div_ceil(p);
            if let Some(l) = self.limit_pages {
                page_end = page_end.min(page_start + l);
            }
            let chunk_end = (page_end * p).min(end);
            out.push(ChunkSpec {
                page_start,
                page_end,
                num_tokens: chunk_end - t,
                src_page_offset: page_start - self.prefix_pages,
                last: false,
            });
            t = chunk_end;
        }
        self.next_token = t;
        if is_final {
            if out.is_empty() {
                let page = t.div_ceil(p);
                out.push(ChunkSpec {
                    page_start: page,
                    page_end: page,
                    num_tokens: 0,
                    src_page_offset: page - self.prefix_pages,
                    last: true,
                });
            } else if let Some(c) = out.last_mut() {
                c.last = true;
            }
            self.done = true;
        }
        Ok(out)
    }
}

/// The chunk's pair cut into consecutive sub-requests of at most
/// `cap_tokens` pair tokens each (one staging slice each); sub-requests
/// without tokens of the pair are left out. Every slice but the last holds
/// exactly `cap_tokens` tokens of the pair. A `cap_tokens` of 0 (a staging
/// slice smaller than one token) is refused with `Relayout`.
pub fn slice_requests<'a>(req: &PairRequest<'a>, cap_tokens: u64) -> Result<Vec<PairRequest<'a>>> {
    if cap_tokens == 0 {
        return Err(Error::new(
            Status::Relayout,
            "the staging buffer cannot hold one token",
        ));
    }
    let mut out = Vec::new();
    let end = req
        .start
        .checked_add(req.num_tokens)
        .ok_or_else(|| Error::invalid("chunk start + num_tokens overflows u64"))?;
    let mut s = req.start;
    while s < end {
        let (mut lo, mut hi) = (s + 1, end);
        let count = |e: u64| {
            PairRequest {
                start: s,
                num_tokens: e - s,
                ..*req
            }
            .token_count()
        };
        if count(hi) > cap_tokens {
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if count(mid) <= cap_tokens {
                    lo = mid
                } else {
                    hi = mid - 1
                }
            }
        } else {
            lo = hi;
        }
        let sub = PairRequest {
            start: s,
            num_tokens: lo - s,
            ..*req
        };
        if sub.token_count() > 0 {
            out.push(sub);
        }
        s = lo;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::plan::{dcp_token_plan, SglangChunk, Side};
    use crate::layout::DcpLayout;

    fn pages(total: u64) -> Vec<u64> {
        // a scattered prefill page list
        (0..total.div_ceil(64))
            .map(|i| (i * 37 + 11) % 1009)
            .collect()
    }

    #[test]
    fn reference_6c_2055_tokens_limit_256() {
        for prefix in [0u64, 256] {
            let mut c = SendChunker::new(64, prefix, Some(256)).unwrap();
            let chunks = c.advance(2055, true).unwrap();
            let all_pages: Vec<u64> = chunks
                .iter()
                .flat_map(|c| c.page_start..c.page_end)
                .collect();
            assert_eq!(all_pages, (prefix / 64..33).collect::<Vec<_>>());
            assert_eq!(
                chunks.iter().map(|c| c.num_tokens).sum::<u64>(),
                2055 - prefix
            );
            assert!(chunks.iter().all(|c| c.num_tokens <= 256));
            assert_eq!(chunks.last().unwrap().num_tokens, 7);
            assert_eq!(chunks.iter().filter(|c| c.last).count(), 1);
            assert!(chunks.last().unwrap().last);
            // each chunk's plan, concatenated, equals the single-shot plan for every rank
            let src = pages(2055);
            let dst: Vec<u64> = (0..(2055u64 - prefix).div_ceil(256))
                .map(|i| 500 + 3 * i)
                .collect();
            for r in 0..4 {
                let single = dcp_token_plan(&SglangChunk {
                    src_pages: &src[(prefix / 64) as usize..],
                    dst_pages: &dst,
                    page_size: 64,
                    dcp_size: 4,
                    dcp_rank: r,
                    src_page_offset: 0,
                    decode_prefix_len: prefix,
                    num_tokens: Some(2055 - prefix),
                })
                .unwrap();
                let (mut s, mut d) = (Vec::new(), Vec::new());
                for ch in &chunks {
                    let p = dcp_token_plan(&SglangChunk {
                        src_pages: &src[ch.page_start as usize..ch.page_end as usize],
                        dst_pages: &dst,
                        page_size: 64,
                        dcp_size: 4,
                        dcp_rank: r,
                        src_page_offset: ch.src_page_offset,
                        decode_prefix_len: prefix,
                        num_tokens: Some(ch.num_tokens),
                    })
                    .unwrap();
                    s.extend(p.src_rows);
                    d.extend(p.dst_rows);
                }
                assert_eq!(
                    (s, d),
                    (single.src_rows, single.dst_rows),
                    "rank {r} prefix {prefix}"
                );
            }
        }
    }

    #[test]
    fn partial_page_waits_for_the_tail() {
        let mut c = SendChunker::new(64, 0, Some(256)).unwrap();
        let first = c.advance(1000, false).unwrap();
        assert_eq!(first.iter().map(|c| c.num_tokens).sum::<u64>(), 960);
        assert!(first.iter().all(|c| !c.last));
        let rest = c.advance(1031, true).unwrap();
        let all: Vec<u64> = first
            .iter()
            .chain(&rest)
            .flat_map(|c| c.page_start..c.page_end)
            .collect();
        assert_eq!(all, (0..17).collect::<Vec<_>>());
        assert_eq!(
            first.iter().chain(&rest).map(|c| c.num_tokens).sum::<u64>(),
            1031
        );
        assert!(rest.last().unwrap().last);
        assert!(c.advance(1031, true).is_err());
    }

    #[test]
    fn empty_final_send_and_no_limit() {
        let mut c = SendChunker::new(64, 256, None).unwrap();
        let f = c.advance(256, true).unwrap();
        assert_eq!(f.len(), 1);
        assert!(f[0].last && f[0].num_tokens == 0);
        let mut c = SendChunker::new(64, 0, None).unwrap();
        assert_eq!(c.advance(2055, true).unwrap().len(), 1);
        assert_eq!(
            SendChunker::new(64, 32, None).unwrap_err().status(),
            Status::PrefixMisaligned
        );
        assert!(SendChunker::new(64, 0, Some(10)).is_err());
    }

    /// A pair over page size 4: source `(dcp_size, interleave, rank)` and
    /// destination likewise, both page tables starting at `start` (a
    /// multiple of 16, the largest virtual page used here), with pages to spare.
    fn pair<'a>(
        src: (u64, u64, u64),
        dst: (u64, u64, u64),
        src_pages: &'a [u64],
        dst_pages: &'a [u64],
        start: u64,
        num_tokens: u64,
    ) -> PairRequest<'a> {
        let side = |(size, interleave, rank): (u64, u64, u64), pages| Side {
            layout: DcpLayout::new(4, size, interleave).unwrap(),
            rank,
            pages,
            origin: start,
        };
        let req = PairRequest {
            src: side(src, src_pages),
            dst: side(dst, dst_pages),
            start,
            num_tokens,
        };
        req.validate().unwrap();
        req
    }

    /// Every token of the pair as (position, source row, destination row).
    fn rows(req: &PairRequest<'_>) -> Vec<(u64, u64, u64)> {
        let mut v = Vec::new();
        req.for_each_segment(|s| {
            v.extend((0..s.len).map(|k| (s.pos + k, s.src_row + k, s.dst_row + k)))
        })
        .unwrap();
        v
    }

    fn spans(subs: &[PairRequest<'_>]) -> Vec<(u64, u64)> {
        subs.iter().map(|s| (s.start, s.num_tokens)).collect()
    }

    const SRC: [u64; 16] = [7, 3, 12, 0, 9, 14, 1, 5, 11, 2, 15, 4, 8, 13, 6, 10];
    const DST: [u64; 16] = [
        20, 31, 22, 27, 25, 30, 21, 29, 24, 26, 23, 28, 19, 18, 17, 16,
    ];

    #[test]
    fn slices_of_a_single_source_pair_at_exact_multiples_and_with_a_tail() {
        let req = pair((1, 1, 0), (1, 1, 0), &SRC, &DST, 16, 16);
        assert_eq!(req.token_count(), 16);
        assert_eq!(
            spans(&slice_requests(&req, 4).unwrap()),
            [(16, 4), (20, 4), (24, 4), (28, 4)]
        );
        assert_eq!(
            spans(&slice_requests(&req, 5).unwrap()),
            [(16, 5), (21, 5), (26, 5), (31, 1)]
        );
        // a cap of the whole pair, or more, is one slice: the request itself
        for cap in [16, 17, u64::MAX] {
            assert_eq!(spans(&slice_requests(&req, cap).unwrap()), [(16, 16)]);
        }
        assert_eq!(slice_requests(&req, 1).unwrap().len(), 16);
    }

    #[test]
    fn dcp_slices_skip_positions_of_other_ranks_and_hold_cap_pair_tokens() {
        // prefill rank 0 of 2 owns the even positions, decode rank 2 of 4 those
        // with t % 4 == 2: the pair moves every fourth position
        let req = pair((2, 1, 0), (4, 1, 2), &SRC, &DST, 16, 32);
        assert_eq!(req.token_count(), 8);
        // the pair's tokens are 18, 22, ..., 46; a slice ends just before the
        // pair's next token, so the next one starts on a pair token
        assert_eq!(
            spans(&slice_requests(&req, 2).unwrap()),
            [(16, 10), (26, 8), (34, 8), (42, 6)]
        );
        assert_eq!(
            spans(&slice_requests(&req, 3).unwrap()),
            [(16, 14), (30, 12), (42, 6)]
        );
    }

    #[test]
    fn slices_cover_the_pair_in_order_within_the_cap() {
        let cases = [
            ((1, 1, 0), (1, 1, 0), 0, 13),
            ((1, 1, 0), (4, 1, 3), 16, 29),
            ((2, 1, 1), (1, 1, 0), 0, 31),
            ((2, 2, 0), (4, 2, 0), 16, 40),
            ((2, 4, 1), (2, 1, 1), 32, 27),
        ];
        for (src, dst, start, n) in cases {
            let req = pair(src, dst, &SRC, &DST, start, n);
            let total = req.token_count();
            assert!(total > 0, "{src:?} {dst:?}: the case moves tokens");
            for cap in 1..=total + 1 {
                let subs = slice_requests(&req, cap).unwrap();
                let what = format!("{src:?} -> {dst:?} from {start}, {n} tokens, cap {cap}");
                assert_eq!(subs.len() as u64, total.div_ceil(cap), "{what}");
                let mut at = req.start;
                for (i, s) in subs.iter().enumerate() {
                    assert_eq!(s.start, at, "{what}: slice {i} starts where the last ended");
                    let k = s.token_count();
                    assert!(k >= 1 && k <= cap, "{what}: slice {i} holds {k}");
                    if i + 1 < subs.len() {
                        assert_eq!(k, cap, "{what}: slice {i} is full");
                    }
                    assert_eq!((s.src.rank, s.dst.rank), (req.src.rank, req.dst.rank));
                    at += s.num_tokens;
                }
                assert_eq!(
                    at,
                    req.start + req.num_tokens,
                    "{what}: the slices reach the end"
                );
                // the slices' rows, one after the other, are the pair's rows
                let joined: Vec<_> = subs.iter().flat_map(|s| rows(s)).collect();
                assert_eq!(joined, rows(&req), "{what}");
            }
        }
    }

    #[test]
    fn slices_of_nothing_and_of_a_pair_without_tokens_are_none() {
        let empty = pair((1, 1, 0), (1, 1, 0), &SRC, &DST, 16, 0);
        assert!(slice_requests(&empty, 4).unwrap().is_empty());
        // prefill rank 0 of 2 owns even positions, decode rank 1 of 4 odd ones
        let disjoint = pair((2, 1, 0), (4, 1, 1), &SRC, &DST, 16, 32);
        assert_eq!(disjoint.token_count(), 0);
        for cap in [1, 3, 64] {
            assert!(slice_requests(&disjoint, cap).unwrap().is_empty());
        }
    }

    #[test]
    fn a_slice_smaller_than_one_token_and_an_overflowing_request_are_refused() {
        let req = pair((1, 1, 0), (1, 1, 0), &SRC, &DST, 16, 8);
        assert_eq!(
            slice_requests(&req, 0).unwrap_err().status(),
            Status::Relayout
        );
        let empty = pair((1, 1, 0), (1, 1, 0), &SRC, &DST, 16, 0);
        assert_eq!(
            slice_requests(&empty, 0).unwrap_err().status(),
            Status::Relayout
        );
        let overflow = PairRequest {
            num_tokens: u64::MAX,
            ..req
        };
        assert_eq!(
            slice_requests(&overflow, 4).unwrap_err().status(),
            Status::InvalidArgument
        );
    }
}
