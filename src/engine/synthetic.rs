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
}

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
        Ok(SyntheticPools {
            bufs: layers.collect::<Result<_>>()?,
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
        self.bufs
            .iter()
            .enumerate()
            .map(|(l, b)| KvPool {
                layer_id: l as u32,
                base: b.as_ptr() as u64,
                page_bytes: self.page_size * self.row_bytes,
                num_pages: self.num_pages,
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
            entries: (0..self.bufs.len() as u32)
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

    /// Prefill: writes the pattern of the positions of `[side.origin, end)` that
    /// `side.rank` owns into its rows (placed through `side.pages` from `side.origin`).
    pub fn fill(&mut self, room: u64, side: &Side<'_>, end: u64) {
        let (p, w) = (self.page_size, self.row_words());
        let base = side.layout.local(side.origin);
        for (l, buf) in self.bufs.iter_mut().enumerate() {
            for t in side.origin..end {
                if side.layout.owner(t) != side.rank {
                    continue;
                }
                let li = side.layout.local(t) - base;
                let row = (side.pages[(li / p) as usize] * p + li % p) as usize;
                let s = seed(room, l as u64, t);
                for (j, word) in buf[row * w..(row + 1) * w].iter_mut().enumerate() {
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
        for (l, buf) in self.bufs.iter().enumerate() {
            for t in side.origin..end {
                if side.layout.owner(t) != side.rank {
                    continue;
                }
                let li = side.layout.local(t) - base;
                let row = (side.pages[(li / p) as usize] * p + li % p) as usize;
                let s = seed(room, l as u64, t);
                for (j, word) in buf[row * w..(row + 1) * w].iter().enumerate() {
                    if *word != s.wrapping_add(j as u64) {
                        return Err(Error::new(
                            Status::Relayout,
                            format!("room {room}: layer {l} position {t} (row {row}) word {j} differs: got {word:#x}, want {:#x}", s.wrapping_add(j as u64)),
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
