//! Prefill attention context parallelism (CP): which CP rank sends which
//! tokens of a request, and which CP storages a pair can move.
//!
//! SGLang's prefill CP splits the attention compute, not the KV storage: every
//! CP rank writes every token of the batch into its own pool at the same rows,
//! so the C pools are replicas with the same page ids. Two send modes follow
//! SGLang 0.5.23:
//! - [`CpMode::Rank0`] (SGLang's default): CP rank 0 sends the whole request;
//!   the other CP ranks are dummy ranks that conclude locally;
//! - [`CpMode::AllCp`] (`SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`, and
//!   every hybrid-MLA stack): CP rank `c` sends the contiguous page range
//!   [`cp_page_bounds`] of the post-prefix page list, SGLang's
//!   `_get_cp_rank_page_bounds`, with the chunk's token count recomputed for
//!   its share (SGLang keeps the chunk's count, which walks past the narrowed
//!   pages).
//!
//! Token `t` at or past the decode prefix `Π` is sent by the CP rank whose
//! range holds page `(t - Π) div P`; the destination rule is the decode's DCP
//! layout, unchanged. A DSA cache-layer split (each CP rank some layers,
//! every page) sends every page from every CP rank, as pipeline stages do,
//! to a decode without DCP; KV sharded by page id is not moved.

use super::cp_transfer::{CpMode, CpStorage};
use super::plan::{PairRequest, Side};
use super::topology::{DcpLayout, PoolKind, Topology};
use crate::error::{Error, Result, Status};
use std::ops::Range;

/// SGLang's `_get_cp_rank_page_bounds`: the contiguous pages of
/// `0..total_pages` CP rank `cp_rank` of `cp_size` sends (the first
/// `total_pages mod cp_size` ranks one more page; ranks past the pages none).
pub fn cp_page_bounds(total_pages: u64, cp_rank: u64, cp_size: u64) -> Range<u64> {
    let cp_size = cp_size.max(1);
    let base = total_pages / cp_size;
    let rem = total_pages % cp_size;
    let start = cp_rank * base + cp_rank.min(rem);
    let n = base + u64::from(cp_rank < rem);
    start..start + n
}

fn kv_sharding_unsupported(cp_size: u64) -> Error {
    Error::new(
        Status::Unsupported,
        format!(
            "the prefill's {cp_size} attention CP ranks shard the KV by page id (--enable-kv-cache-sharding), which pdxfer does not move; relaunch the prefill without --enable-kv-cache-sharding"
        ),
    )
}

/// Refuses a CP storage the pair cannot move: a DCP decode takes only
/// replicated CP KV (the other storages split what DCP needs whole), and no
/// decode takes KV sharded by page id. A layer split pairs with a decode
/// without DCP as pipeline stages do: each CP rank sends its own layers.
pub fn check_cp_storage(prefill: &Topology, decode: &Topology, both: &str) -> Result<()> {
    if prefill.attn_cp_size <= 1 {
        return Ok(());
    }
    if prefill.cp.storage == CpStorage::KvSharded && decode.dcp_size <= 1 {
        let e = kv_sharding_unsupported(u64::from(prefill.attn_cp_size));
        return Err(Error::new(e.status(), format!("{}; {both}", e.detail())));
    }
    if decode.dcp_size <= 1 {
        return Ok(());
    }
    let storage = prefill.cp.storage;
    let Some(flag) = storage.sglang_flag() else {
        return Ok(());
    };
    Err(Error::new(
        Status::PrefillCpWithDecodeDcp,
        format!(
            "PD decode DCP needs the prefill's attention CP ranks to hold replicated KV, but the prefill (attention CP={}) stores it {} ({flag}); relaunch the prefill without {flag}, or decode with --dcp-size 1; {both}",
            prefill.attn_cp_size,
            match storage {
                CpStorage::LayerSplit => "split by layer",
                _ => "sharded by page id",
            }
        ),
    ))
}

/// One prefill rank's place in its CP group, as the send plan needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpSender {
    /// Attention CP size C.
    pub cp_size: u64,
    /// Attention CP rank c.
    pub cp_rank: u64,
    /// The send mode in effect.
    pub mode: CpMode,
    /// How the CP ranks store the KV: replicated ranks send page shares in
    /// all-CP-ranks mode; layer-split ranks each send every page of their
    /// own layers.
    pub storage: CpStorage,
}

/// One CP rank's part of one chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpShare {
    /// The chunk's pages this rank sends (indices into the chunk's page list).
    pub pages: Range<usize>,
    /// Absolute position of the share's first token.
    pub start: u64,
    /// Tokens in the share (0 for an empty share).
    pub num_tokens: u64,
}

impl CpShare {
    /// The share as a pair request from `chunk_pages` (the whole chunk's
    /// pages, of `src_layout`) to the decode side `dst`.
    pub fn pair<'a>(
        &self,
        chunk_pages: &'a [u64],
        src_layout: DcpLayout,
        src_rank: u64,
        dst: Side<'a>,
    ) -> PairRequest<'a> {
        PairRequest {
            src: Side {
                layout: src_layout,
                rank: src_rank,
                pages: &chunk_pages[self.pages.clone()],
                origin: self.start,
            },
            dst,
            start: self.start,
            num_tokens: self.num_tokens,
        }
    }
}

impl CpSender {
    /// The rank of `t` (a prefill topology), with the mode it publishes; a
    /// hybrid-MLA or layer-split prefill always sends from every CP rank, as
    /// SGLang's does.
    pub fn of(t: &Topology) -> CpSender {
        let every = t.cp.mode == CpMode::AllCp
            || t.pool == PoolKind::HybridMla
            || t.cp.storage == CpStorage::LayerSplit;
        CpSender {
            cp_size: u64::from(t.attn_cp_size.max(1)),
            cp_rank: u64::from(t.attn_cp_rank),
            mode: if every { CpMode::AllCp } else { CpMode::Rank0 },
            storage: t.cp.storage,
        }
    }

    /// True when every CP rank sends (C > 1 in all-CP-ranks mode).
    pub fn all_ranks_send(&self) -> bool {
        self.cp_size > 1 && self.mode == CpMode::AllCp
    }

    /// SGLang's `is_dummy_cp_rank`: a rank-0-mode CP rank other than 0, which
    /// no decode contacts and which concludes its rooms locally.
    pub fn is_dummy(&self) -> bool {
        self.cp_size > 1 && self.mode == CpMode::Rank0 && self.cp_rank != 0
    }

    /// True on the rank that sends the aux and state rows (CP rank 0).
    pub fn sends_aux_and_state(&self) -> bool {
        self.cp_rank == 0
    }

    /// This rank's share of a chunk: the chunk holds `chunk_pages` pages
    /// starting at page `page_offset` of the request's `total_pages`
    /// post-prefix pages (each of `page_tokens` positions), and
    /// `chunk_tokens` tokens from position `prefix + page_offset * page_tokens`.
    ///
    /// `invalid_topology` for a rank outside its group; `invalid_argument`
    /// for a chunk past the request's pages or with more tokens than its pages.
    pub fn share(
        &self,
        total_pages: u64,
        page_tokens: u64,
        prefix: u64,
        page_offset: u64,
        chunk_pages: u64,
        chunk_tokens: u64,
    ) -> Result<CpShare> {
        if self.cp_size == 0 || self.cp_rank >= self.cp_size {
            return Err(Error::new(
                Status::InvalidTopology,
                format!(
                    "attn_cp_rank={} is not below attn_cp_size={}",
                    self.cp_rank, self.cp_size
                ),
            ));
        }
        let chunk_end = page_offset
            .checked_add(chunk_pages)
            .ok_or_else(|| Error::invalid("page offset + chunk pages overflows u64"))?;
        if chunk_end > total_pages {
            return Err(Error::invalid(format!(
                "the chunk's pages {page_offset}..{chunk_end} run past the request's {total_pages} pages"
            )));
        }
        let cap = chunk_pages.saturating_mul(page_tokens);
        if chunk_tokens > cap {
            return Err(Error::new(
                Status::TokensExceedSource,
                format!("chunk of {chunk_tokens} tokens exceeds its {chunk_pages} pages (capacity {cap})"),
            ));
        }
        if self.cp_size > 1 && self.storage == CpStorage::KvSharded {
            return Err(kv_sharding_unsupported(self.cp_size));
        }
        let first = prefix.saturating_add(page_offset.saturating_mul(page_tokens));
        let bounds = if self.all_ranks_send() && self.storage == CpStorage::LayerSplit {
            0..total_pages
        } else if self.all_ranks_send() {
            cp_page_bounds(total_pages, self.cp_rank, self.cp_size)
        } else if self.cp_rank == 0 {
            0..total_pages
        } else {
            0..0
        };
        let lo = bounds.start.max(page_offset);
        let hi = bounds.end.min(chunk_end);
        if hi <= lo {
            return Ok(CpShare {
                pages: 0..0,
                start: first,
                num_tokens: 0,
            });
        }
        let start = prefix + lo * page_tokens;
        let end = (first + chunk_tokens).min(prefix + hi * page_tokens);
        Ok(CpShare {
            pages: (lo - page_offset) as usize..(hi - page_offset) as usize,
            start,
            num_tokens: end.saturating_sub(start),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `_get_cp_rank_page_bounds` written as SGLang does, for comparison.
    fn sglang_bounds(total: u64, r: u64, c: u64) -> (u64, u64) {
        let base = total / c;
        let rem = total % c;
        let s = r * base + std::cmp::min(r, rem);
        (s, s + base + if r < rem { 1 } else { 0 })
    }

    #[test]
    fn page_bounds_tile_the_pages_in_rank_order() {
        for total in 0..40u64 {
            for c in 1..9u64 {
                let mut next = 0;
                for r in 0..c {
                    let b = cp_page_bounds(total, r, c);
                    assert_eq!((b.start, b.end), sglang_bounds(total, r, c));
                    assert_eq!(b.start, next, "total={total} c={c} r={r}");
                    next = b.end;
                }
                assert_eq!(next, total);
            }
        }
        // 5 pages over 8 ranks: ranks 5..8 get nothing
        assert_eq!(cp_page_bounds(5, 4, 8), 4..5);
        assert!(cp_page_bounds(5, 5, 8).is_empty());
    }

    fn sender(c: u64, r: u64, mode: CpMode) -> CpSender {
        CpSender {
            cp_size: c,
            cp_rank: r,
            mode,
            storage: CpStorage::Replicated,
        }
    }

    #[test]
    fn share_recomputes_the_token_count() {
        // 1000 tokens, P=64: 16 pages, the last holding 40 tokens; C=2
        let s0 = sender(2, 0, CpMode::AllCp)
            .share(16, 64, 0, 0, 16, 1000)
            .unwrap();
        assert_eq!(
            s0,
            CpShare {
                pages: 0..8,
                start: 0,
                num_tokens: 512
            }
        );
        let s1 = sender(2, 1, CpMode::AllCp)
            .share(16, 64, 0, 0, 16, 1000)
            .unwrap();
        assert_eq!(
            s1,
            CpShare {
                pages: 8..16,
                start: 512,
                num_tokens: 488
            }
        );
        // a chunk of pages 4..12 with a prefix of 256
        let s1 = sender(2, 1, CpMode::AllCp)
            .share(16, 64, 256, 4, 8, 512)
            .unwrap();
        assert_eq!(
            s1,
            CpShare {
                pages: 4..8,
                start: 256 + 512,
                num_tokens: 256
            }
        );
        // a chunk wholly outside the rank's range
        let e = sender(2, 1, CpMode::AllCp)
            .share(16, 64, 0, 0, 4, 256)
            .unwrap();
        assert_eq!(e.num_tokens, 0);
        assert!(e.pages.is_empty());
    }

    #[test]
    fn rank0_mode_sends_from_rank_zero_only() {
        let all = sender(4, 0, CpMode::Rank0)
            .share(5, 64, 0, 0, 5, 300)
            .unwrap();
        assert_eq!((all.pages, all.num_tokens), (0..5, 300));
        let d = sender(4, 2, CpMode::Rank0);
        assert!(d.is_dummy());
        assert_eq!(d.share(5, 64, 0, 0, 5, 300).unwrap().num_tokens, 0);
        assert!(!sender(4, 2, CpMode::AllCp).is_dummy());
        assert!(!sender(1, 0, CpMode::Rank0).is_dummy());
        assert!(sender(4, 0, CpMode::AllCp).sends_aux_and_state());
        assert!(!sender(4, 3, CpMode::AllCp).sends_aux_and_state());
    }

    #[test]
    fn share_refusals_are_typed() {
        let e = sender(2, 2, CpMode::AllCp)
            .share(4, 64, 0, 0, 4, 10)
            .unwrap_err();
        assert_eq!(e.status(), Status::InvalidTopology);
        let e = sender(2, 0, CpMode::AllCp)
            .share(4, 64, 0, 2, 3, 10)
            .unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        let e = sender(2, 0, CpMode::AllCp)
            .share(4, 64, 0, 0, 1, 65)
            .unwrap_err();
        assert_eq!(e.status(), Status::TokensExceedSource);
    }

    #[test]
    fn layer_split_ranks_send_every_page_and_kv_sharding_is_refused() {
        let mut t = Topology::single_mla(64, 1, 8);
        t.attn_cp_size = 2;
        t.attn_cp_rank = 1;
        t.cp.storage = CpStorage::LayerSplit;
        let s = CpSender::of(&t);
        assert!(s.all_ranks_send(), "a layer split sends from every CP rank");
        let sh = s.share(5, 64, 0, 0, 5, 300).unwrap();
        assert_eq!(
            (sh.pages, sh.num_tokens),
            (0..5, 300),
            "its own layers, every page"
        );
        t.cp.storage = CpStorage::KvSharded;
        let e = CpSender::of(&t).share(5, 64, 0, 0, 5, 300).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported);
        let e = check_cp_storage(&t, &Topology::single_mla(64, 1, 8), "").unwrap_err();
        assert_eq!(e.status(), Status::Unsupported);
        assert!(
            e.detail().contains("without --enable-kv-cache-sharding"),
            "{e}"
        );
        t.cp.storage = CpStorage::LayerSplit;
        assert!(check_cp_storage(&t, &Topology::single_mla(64, 1, 8), "").is_ok());
    }

    #[test]
    fn a_hybrid_mla_prefill_sends_from_every_cp_rank() {
        let mut t = Topology::single_mla(64, 1, 8);
        t.attn_cp_size = 2;
        t.attn_cp_rank = 1;
        assert!(CpSender::of(&t).is_dummy());
        t.pool = PoolKind::HybridMla;
        assert!(CpSender::of(&t).all_ranks_send());
        t.pool = PoolKind::Mla;
        t.cp.mode = CpMode::AllCp;
        assert!(CpSender::of(&t).all_ranks_send());
    }

    /// Every token of a request goes exactly once, from the CP rank the
    /// owner rule names, to decode rank `t mod D` at row `V[k div P]*P + k mod P`
    /// with `k = t div D - prefix / D`, from row `S[(t-prefix) div P]*P + (t-prefix) mod P`.
    #[test]
    fn brute_force_owner_rule() {
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut rnd = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m.max(1)
        };
        for case in 0..600 {
            let p = [1u64, 4, 64][(case % 3) as usize];
            let c = 1 + rnd(8);
            let d = 1 + rnd(8);
            let mode = if case % 2 == 0 {
                CpMode::AllCp
            } else {
                CpMode::Rank0
            };
            let prefix = rnd(3) * p * d;
            let l = prefix + 1 + rnd(if p == 64 { 900 } else { 60 });
            let n_pages = (l - prefix).div_ceil(p);
            // distinct page ids in a shuffled order
            let mut src: Vec<u64> = (0..n_pages).map(|i| i * 3 + 5).collect();
            for i in (1..src.len()).rev() {
                src.swap(i, rnd(i as u64 + 1) as usize);
            }
            let vp = (l - prefix).div_ceil(p * d);
            let dst: Vec<u64> = (0..vp).map(|i| 2 * i + 11).collect();
            // chunk ends on page boundaries, the last at l
            let mut ends = Vec::new();
            let mut pos = prefix;
            while pos < l {
                let step = (1 + rnd(n_pages)) * p;
                pos = (pos + step).min(l);
                ends.push(pos);
            }
            let src_l = DcpLayout::sglang(p, 1).unwrap();
            let dst_l = DcpLayout::sglang(p, d).unwrap();
            let mut seen = std::collections::HashMap::new();
            for cr in 0..c {
                let snd = sender(c, cr, mode);
                let mut a = prefix;
                for &b in &ends {
                    let off = (a - prefix) / p;
                    let np = (b - a).div_ceil(p);
                    let chunk = &src[off as usize..(off + np) as usize];
                    let sh = snd.share(n_pages, p, prefix, off, np, b - a).unwrap();
                    for dr in 0..d {
                        let dst_side = Side {
                            layout: dst_l,
                            rank: dr,
                            pages: &dst,
                            origin: prefix,
                        };
                        let req = sh.pair(chunk, src_l, 0, dst_side);
                        req.for_each_segment(|sg| {
                            for i in 0..sg.len {
                                let prev = seen
                                    .insert(sg.pos + i, (cr, dr, sg.src_row + i, sg.dst_row + i));
                                assert!(prev.is_none(), "token {} sent twice", sg.pos + i);
                            }
                        })
                        .unwrap();
                    }
                    a = b;
                }
            }
            assert_eq!(seen.len() as u64, l - prefix, "case {case}");
            for t in prefix..l {
                let (cr, dr, sr, drow) = seen[&t];
                let page = (t - prefix) / p;
                let want_c = if mode == CpMode::AllCp && c > 1 {
                    (0..c)
                        .find(|&x| cp_page_bounds(n_pages, x, c).contains(&page))
                        .unwrap()
                } else {
                    0
                };
                let k = t / d - prefix / d;
                assert_eq!(cr, want_c, "case {case} t={t}");
                assert_eq!(dr, t % d);
                assert_eq!(sr, src[page as usize] * p + (t - prefix) % p);
                assert_eq!(drow, dst[(k / p) as usize] * p + k % p);
            }
        }
    }

    #[test]
    fn a_misaligned_decode_prefix_is_refused() {
        let snd = sender(2, 1, CpMode::AllCp);
        // P=4, D=2: the prefix must be a multiple of 8
        let sh = snd.share(4, 4, 4, 0, 4, 16).unwrap();
        let dst = [3u64, 4];
        let req = sh.pair(
            &[1, 2, 3, 4],
            DcpLayout::sglang(4, 1).unwrap(),
            0,
            Side {
                layout: DcpLayout::sglang(4, 2).unwrap(),
                rank: 0,
                pages: &dst,
                origin: 4,
            },
        );
        assert_eq!(
            req.validate().unwrap_err().status(),
            Status::PrefixMisaligned
        );
    }
}
