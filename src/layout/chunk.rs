//! Splitting one request's send into chunks (reference 5.2 step 1 and test 6C).
//!
//! Sending starts at the decode prefix. A partial page that is not the last one
//! is held back until the request's tail is known; a limit (the pack buffer's
//! capacity in tokens) splits a send into chunks of at most that many tokens,
//! at page boundaries. The chunker holds only counters: it is pure.

use crate::error::{Error, Result, Status};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::plan::{dcp_token_plan, SglangChunk};

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
}
