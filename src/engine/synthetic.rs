//! Synthetic KV pools for the demo and the end-to-end tests: a DeepSeek-like
//! MLA pool (per layer one buffer of pages of token rows) whose rows hold a
//! pattern derived from (room, layer, sequence position), so a decode rank can
//! verify every byte it received without seeing the prefill's memory.

use super::config::{AuxBuffer, KvPool};
use crate::error::{Error, Result, Status};
use crate::layout::{KvDtype, KvEntry, PoolKind, Side, Topology};

/// One layer's pool: heap memory, or a shared pool allocation
/// ([`alloc_pool`](crate::memory::shared::alloc_pool)) freed on drop.
#[derive(Debug)]
enum Words {
    Heap(Vec<u64>),
    Shared { addr: u64, words: usize },
}

impl std::ops::Deref for Words {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        match self {
            Words::Heap(v) => v,
            // SAFETY: a live, page-aligned shared allocation of `words` u64s owned by this value.
            Words::Shared { addr, words } => unsafe {
                std::slice::from_raw_parts(*addr as *const u64, *words)
            },
        }
    }
}

impl std::ops::DerefMut for Words {
    fn deref_mut(&mut self) -> &mut [u64] {
        match self {
            Words::Heap(v) => v,
            // SAFETY: as in `deref`; `&mut self` makes this the only view from here.
            Words::Shared { addr, words } => unsafe {
                std::slice::from_raw_parts_mut(*addr as *mut u64, *words)
            },
        }
    }
}

impl Drop for Words {
    fn drop(&mut self) {
        if let Words::Shared { addr, .. } = self {
            let _ = crate::memory::shared::free_pool(*addr);
        }
    }
}

/// Host memory for `layers` KV entries plus one aux buffer.
#[derive(Debug)]
pub struct SyntheticPools {
    bufs: Vec<Words>,
    /// KV entries (layers).
    layers: u32,
    /// Block-outermost: every layer in `bufs[0]`, layer `l`'s pages
    /// starting `l` pages in (vLLM's `BLNHC`); else one buffer per layer.
    interleaved: bool,
    aux: Vec<u64>,
    /// Tokens per page.
    pub page_size: u64,
    /// Bytes of one token row (a multiple of 8).
    pub row_bytes: u64,
    /// Pages per layer.
    pub num_pages: u64,
    /// Bytes of one aux row (a multiple of 8).
    pub aux_item: u64,
    /// Aux rows.
    pub aux_rows: u64,
    /// Pages of `page_size * row_bytes` from one page's start to the next's
    /// (1: end to end).
    pub page_step: u64,
}

/// What a strided pool's bytes outside every page hold, so a test can see
/// that no write touched them.
pub const GAP_WORD: u64 = 0xa5a5_5a5a_c3c3_3c3c;

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn seed(room: u64, layer: u64, pos: u64) -> u64 {
    mix(room.wrapping_mul(0x1000_0000_01b3) ^ (layer << 48) ^ pos)
}

impl SyntheticPools {
    /// Zeroed pools: `layers` x `num_pages` pages of `page_size` rows of `row_bytes`.
    pub fn new(
        layers: u32,
        row_bytes: u64,
        page_size: u64,
        num_pages: u64,
        aux_rows: u64,
        aux_item: u64,
    ) -> Result<SyntheticPools> {
        if !row_bytes.is_multiple_of(8) || !aux_item.is_multiple_of(8) || row_bytes == 0 {
            return Err(Error::invalid(
                "synthetic rows must be non-empty multiples of 8 bytes",
            ));
        }
        Self::with_layers(
            (0..layers).map(|_| {
                Ok(Words::Heap(vec![
                    0u64;
                    Self::words(
                        row_bytes, page_size, num_pages
                    )
                ]))
            }),
            row_bytes,
            page_size,
            num_pages,
            aux_rows,
            aux_item,
        )
    }

    /// As [`new`](Self::new), with every KV pool in a shared pool allocation
    /// ([`alloc_pool`](crate::memory::shared::alloc_pool)): a same-host
    /// prefill gathers rows straight into them (one copy).
    pub fn new_shared(
        layers: u32,
        row_bytes: u64,
        page_size: u64,
        num_pages: u64,
        aux_rows: u64,
        aux_item: u64,
    ) -> Result<SyntheticPools> {
        let words = Self::words(row_bytes, page_size, num_pages);
        Self::with_layers(
            (0..layers).map(|_| {
                let addr = crate::memory::shared::alloc_pool(words.max(1) * 8)?;
                Ok(Words::Shared { addr, words })
            }),
            row_bytes,
            page_size,
            num_pages,
            aux_rows,
            aux_item,
        )
    }

    /// Strided pools: page `p` of every layer `page_step` pages after page
    /// `p - 1` (`page_stride = page_step * page_size * row_bytes`). With
    /// `interleaved`, one allocation holds every layer, layer `l`'s pages `l`
    /// pages into each block row of `page_step >= layers` pages (vLLM's
    /// block-outermost `BLNHC`); else one allocation per layer (padded
    /// pages). Bytes outside every page hold [`GAP_WORD`]
    /// ([`check_gaps`](Self::check_gaps)).
    #[allow(clippy::too_many_arguments)]
    pub fn new_strided(
        layers: u32,
        row_bytes: u64,
        page_size: u64,
        num_pages: u64,
        aux_rows: u64,
        aux_item: u64,
        page_step: u64,
        interleaved: bool,
    ) -> Result<SyntheticPools> {
        if page_step == 0 || (interleaved && page_step < u64::from(layers)) {
            return Err(Error::invalid(format!(
                "page_step {page_step} cannot hold {layers} interleaved layers"
            )));
        }
        let span_pages = num_pages.saturating_sub(1) * page_step + 1;
        // interleaved: whole block rows, as vLLM allocates them
        let words = if interleaved {
            num_pages * page_step
        } else {
            span_pages
        };
        let words = Self::words(row_bytes, page_size, words);
        let n = if interleaved { 1 } else { layers };
        let mut pools = Self::with_layers(
            (0..n).map(|_| Ok(Words::Heap(vec![GAP_WORD; words]))),
            row_bytes,
            page_size,
            num_pages,
            aux_rows,
            aux_item,
        )?;
        pools.page_step = page_step;
        pools.interleaved = interleaved;
        pools.layers = layers;
        // every page starts zeroed, as the other pools
        for l in 0..layers as usize {
            for pg in 0..num_pages {
                let r = pools.page_word_range(l, pg);
                let (b, _) = pools.layer_buf(l);
                pools.bufs[b][r].fill(0);
            }
        }
        Ok(pools)
    }

    /// The same pools (contents and geometry) moved into shared pool
    /// allocations ([`alloc_pool`](crate::memory::shared::alloc_pool)), so a
    /// same-host prefill writes them with one copy.
    pub fn into_shared(mut self) -> Result<SyntheticPools> {
        for b in &mut self.bufs {
            let words = b.len();
            let addr = crate::memory::shared::alloc_pool(words.max(1) * 8)?;
            let mut shared = Words::Shared { addr, words };
            shared.copy_from_slice(b);
            *b = shared;
        }
        Ok(self)
    }

    /// (buffer, first word) of layer `l`'s pool.
    fn layer_buf(&self, l: usize) -> (usize, usize) {
        if self.interleaved {
            (0, l * Self::words(self.row_bytes, self.page_size, 1))
        } else {
            (l, 0)
        }
    }

    /// The words of page `pg` of layer `l`, in its buffer.
    fn page_word_range(&self, l: usize, pg: u64) -> std::ops::Range<usize> {
        let (_, first) = self.layer_buf(l);
        let page_words = Self::words(self.row_bytes, self.page_size, 1);
        let start = first + (pg * self.page_step) as usize * page_words;
        start..start + page_words
    }

    /// Strided pools: the number of words outside every page of every
    /// layer, each checked to still hold [`GAP_WORD`]; the first one that
    /// does not is an error naming where it is.
    pub fn check_gaps(&self) -> Result<u64> {
        let mut in_page: Vec<Vec<bool>> = self.bufs.iter().map(|b| vec![false; b.len()]).collect();
        for l in 0..self.layers as usize {
            let (b, _) = self.layer_buf(l);
            for pg in 0..self.num_pages {
                in_page[b][self.page_word_range(l, pg)].fill(true);
            }
        }
        let mut n = 0;
        for (b, buf) in self.bufs.iter().enumerate() {
            for (i, (&w, &inside)) in buf.iter().zip(&in_page[b]).enumerate() {
                if inside {
                    continue;
                }
                if w != GAP_WORD {
                    return Err(Error::new(
                        Status::Relayout,
                        format!("buffer {b} word {i} between pages was written: {w:#x}"),
                    ));
                }
                n += 1;
            }
        }
        Ok(n)
    }

    fn words(row_bytes: u64, page_size: u64, num_pages: u64) -> usize {
        (num_pages * page_size * row_bytes / 8) as usize
    }

    fn with_layers(
        layers: impl Iterator<Item = Result<Words>>,
        row_bytes: u64,
        page_size: u64,
        num_pages: u64,
        aux_rows: u64,
        aux_item: u64,
    ) -> Result<SyntheticPools> {
        if !row_bytes.is_multiple_of(8) || !aux_item.is_multiple_of(8) || row_bytes == 0 {
            return Err(Error::invalid(
                "synthetic rows must be non-empty multiples of 8 bytes",
            ));
        }
        let bufs: Vec<Words> = layers.collect::<Result<_>>()?;
        Ok(SyntheticPools {
            layers: bufs.len() as u32,
            bufs,
            interleaved: false,
            page_step: 1,
            aux: vec![0u64; (aux_rows * aux_item / 8) as usize],
            page_size,
            row_bytes,
            num_pages,
            aux_item,
            aux_rows,
        })
    }

    /// The pools as engine descriptors (layer ids 0..layers).
    pub fn kv_pools(&self) -> Vec<KvPool> {
        let page_bytes = self.page_size * self.row_bytes;
        (0..self.layers as usize)
            .map(|l| {
                let (b, first) = self.layer_buf(l);
                KvPool {
                    layer_id: l as u32,
                    base: self.bufs[b].as_ptr() as u64 + first as u64 * 8,
                    page_bytes,
                    num_pages: self.num_pages,
                    page_stride: page_bytes * self.page_step,
                }
            })
            .collect()
    }

    /// The bytes of layer `l`'s pool (e.g. to upload into device memory).
    pub fn layer_bytes(&self, l: usize) -> &[u8] {
        let b = &self.bufs[l];
        // SAFETY: a u64 slice viewed as its bytes; u8 has no alignment or validity requirements.
        unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, b.len() * 8) }
    }

    /// The bytes of layer `l`'s pool, writable (e.g. to download device memory into).
    pub fn layer_bytes_mut(&mut self, l: usize) -> &mut [u8] {
        let b = &mut self.bufs[l];
        // SAFETY: a u64 slice viewed as its bytes; any byte pattern is a valid u64.
        unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut u8, b.len() * 8) }
    }

    /// The aux buffer as an engine descriptor.
    pub fn aux_buffers(&self) -> Vec<AuxBuffer> {
        vec![AuxBuffer {
            base: self.aux.as_ptr() as u64,
            item_bytes: self.aux_item,
            count: self.aux_rows,
        }]
    }

    /// An MLA topology for these pools with the given DCP size and rank.
    pub fn topology(&self, dcp_size: u32, dcp_rank: u32) -> Topology {
        Topology {
            engine_rank: dcp_rank,
            attn_tp_size: dcp_size,
            attn_tp_rank: dcp_rank,
            attn_cp_size: 1,
            attn_cp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
            dcp_size,
            dcp_rank,
            dcp_interleave: 1,
            page_size: self.page_size as u32,
            kv_dtype: KvDtype::Bf16,
            pool: PoolKind::Mla,
            entries: (0..self.layers)
                .map(|l| KvEntry {
                    layer_id: l,
                    row_bytes: self.row_bytes,
                })
                .collect(),
            cp: Default::default(),
        }
    }

    fn row_words(&self) -> usize {
        (self.row_bytes / 8) as usize
    }

    /// (buffer, first word) of slot `slot` of page `pg` of layer `l`.
    fn row_word(&self, l: usize, pg: u64, slot: u64) -> (usize, usize) {
        let (b, _) = self.layer_buf(l);
        (
            b,
            self.page_word_range(l, pg).start + slot as usize * self.row_words(),
        )
    }

    /// Prefill: writes the pattern of the positions of `[side.origin, end)` that
    /// `side.rank` owns into its rows (placed through `side.pages` from `side.origin`).
    pub fn fill(&mut self, room: u64, side: &Side<'_>, end: u64) {
        let (p, w) = (self.page_size, self.row_words());
        let base = side.layout.local(side.origin);
        for l in 0..self.layers as usize {
            for t in side.origin..end {
                if side.layout.owner(t) != side.rank {
                    continue;
                }
                let li = side.layout.local(t) - base;
                let (b, at) = self.row_word(l, side.pages[(li / p) as usize], li % p);
                let s = seed(room, l as u64, t);
                for (j, word) in self.bufs[b][at..at + w].iter_mut().enumerate() {
                    *word = s.wrapping_add(j as u64);
                }
            }
        }
    }

    /// Prefill: writes `room`'s aux pattern into aux row `idx`.
    pub fn fill_aux(&mut self, room: u64, idx: u64) {
        let w = (self.aux_item / 8) as usize;
        let s = seed(room, u64::MAX >> 16, 0);
        for (j, word) in self.aux[idx as usize * w..(idx as usize + 1) * w]
            .iter_mut()
            .enumerate()
        {
            *word = s ^ j as u64;
        }
    }

    /// Decode: checks every row `side.rank` owns of positions `[side.origin, end)`
    /// (placed through `side.pages`) and, if given, the aux row; returns the bytes checked.
    pub fn verify(
        &self,
        room: u64,
        side: &Side<'_>,
        end: u64,
        aux_idx: Option<u64>,
    ) -> Result<u64> {
        let (p, w) = (self.page_size, self.row_words());
        let base = side.layout.local(side.origin);
        let mut bytes = 0u64;
        for l in 0..self.layers as usize {
            for t in side.origin..end {
                if side.layout.owner(t) != side.rank {
                    continue;
                }
                let li = side.layout.local(t) - base;
                let (pg, slot) = (side.pages[(li / p) as usize], li % p);
                let (b, at) = self.row_word(l, pg, slot);
                let s = seed(room, l as u64, t);
                for (j, word) in self.bufs[b][at..at + w].iter().enumerate() {
                    if *word != s.wrapping_add(j as u64) {
                        return Err(Error::new(
                            Status::Relayout,
                            format!("room {room}: layer {l} position {t} (page {pg} slot {slot}) word {j} differs: got {word:#x}, want {:#x}", s.wrapping_add(j as u64)),
                        ));
                    }
                }
                bytes += self.row_bytes;
            }
        }
        if let Some(idx) = aux_idx {
            let aw = (self.aux_item / 8) as usize;
            let s = seed(room, u64::MAX >> 16, 0);
            for (j, word) in self.aux[idx as usize * aw..(idx as usize + 1) * aw]
                .iter()
                .enumerate()
            {
                if *word != s ^ j as u64 {
                    return Err(Error::new(
                        Status::Relayout,
                        format!("room {room}: aux row {idx} word {j} differs"),
                    ));
                }
            }
            bytes += self.aux_item;
        }
        Ok(bytes)
    }
}
