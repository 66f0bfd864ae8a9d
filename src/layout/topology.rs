//! One side's parallel topology, KV pool kind and per-entry geometry, and the
//! DCP layout rule (who owns a token and at which local row).

use super::cp_transfer::CpTransfer;
use crate::error::{Error, Result, Status};
use serde::{Deserialize, Serialize};

/// The kind of KV pool an engine uses.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// Multi-head latent attention: one latent row per token per layer, replicated across TP.
    Mla = 0,
    /// MLA layers mixed with other (linear-attention / state) layers.
    HybridMla = 1,
    /// Multi-head attention: K and V per layer, head-sliced across TP.
    Mha = 2,
}

impl PoolKind {
    /// True for MLA and hybrid-MLA pools (the ones DCP can shard by token).
    pub fn is_mla_like(self) -> bool {
        matches!(self, PoolKind::Mla | PoolKind::HybridMla)
    }

    /// The pool kind with this numeric value.
    pub fn from_u32(v: u32) -> Result<PoolKind> {
        match v {
            0 => Ok(PoolKind::Mla),
            1 => Ok(PoolKind::HybridMla),
            2 => Ok(PoolKind::Mha),
            _ => Err(Error::invalid(format!(
                "unknown pool kind {v} (0=mla, 1=hybrid_mla, 2=mha)"
            ))),
        }
    }

    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolKind::Mla => "mla",
            PoolKind::HybridMla => "hybrid_mla",
            PoolKind::Mha => "mha",
        }
    }
}

/// The element type of the KV cache (the layout moves bytes; the dtype is checked, not converted).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    /// The model's own dtype ("auto" in SGLang).
    Auto = 0,
    /// bfloat16.
    Bf16 = 1,
    /// float16.
    Fp16 = 2,
    /// float32.
    Fp32 = 3,
    /// fp8 e4m3.
    Fp8E4m3 = 4,
    /// fp8 e5m2.
    Fp8E5m2 = 5,
    /// vLLM's `fp8_ds_mla` MLA rows (fp8 latent, fp32 scales and a bf16 rope
    /// part in one 656-byte token row): not interchangeable with plain fp8 rows.
    Fp8DsMla = 6,
}

impl KvDtype {
    /// The dtype with this numeric value.
    pub fn from_u32(v: u32) -> Result<KvDtype> {
        Ok(match v {
            0 => KvDtype::Auto,
            1 => KvDtype::Bf16,
            2 => KvDtype::Fp16,
            3 => KvDtype::Fp32,
            4 => KvDtype::Fp8E4m3,
            5 => KvDtype::Fp8E5m2,
            6 => KvDtype::Fp8DsMla,
            _ => return Err(Error::invalid(format!("unknown KV dtype {v}"))),
        })
    }

    /// The name SGLang's `--kv-cache-dtype` uses (vLLM's for `fp8_ds_mla`).
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::Auto => "auto",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp16 => "fp16",
            KvDtype::Fp32 => "fp32",
            KvDtype::Fp8E4m3 => "fp8_e4m3",
            KvDtype::Fp8E5m2 => "fp8_e5m2",
            KvDtype::Fp8DsMla => "fp8_ds_mla",
        }
    }
}

/// One KV entry (a layer, or K or V of a layer for MHA) of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvEntry {
    /// Global layer id (used to pair entries across pipeline stages).
    pub layer_id: u32,
    /// Bytes of one token row of this entry (page bytes / page size).
    pub row_bytes: u64,
}

/// How tokens are spread over the DCP ranks of one side and placed in their pages.
///
/// Owner of sequence position `t`: `(t div I) mod W`; its local index on that
/// rank: `(t div (W*I))*I + t mod I`; the local index `l` lives at row
/// `pages[l div P]*P + l mod P` of the rank's own page table. SGLang is `I = 1`;
/// vLLM's `cp_kv_cache_interleave_size` is `I`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DcpLayout {
    /// Tokens per physical page (P).
    pub page_size: u64,
    /// Number of DCP ranks (W); 1 means no DCP.
    pub dcp_size: u64,
    /// Interleave size (I): consecutive tokens kept together on one rank.
    pub interleave: u64,
}

impl DcpLayout {
    /// A validated layout. The interleave must divide the page size.
    pub fn new(page_size: u64, dcp_size: u64, interleave: u64) -> Result<DcpLayout> {
        let l = DcpLayout {
            page_size,
            dcp_size,
            interleave,
        };
        l.validate()?;
        Ok(l)
    }

    /// SGLang's layout: interleave 1.
    pub fn sglang(page_size: u64, dcp_size: u64) -> Result<DcpLayout> {
        DcpLayout::new(page_size, dcp_size, 1)
    }

    /// Checks the invariants (all sizes >= 1, `I` divides `P`, no overflow of `P*W`).
    pub fn validate(&self) -> Result<()> {
        if self.page_size == 0 || self.dcp_size == 0 || self.interleave == 0 {
            return Err(Error::new(
                Status::InvalidLayout,
                format!(
                    "page_size, dcp_size and interleave must all be >= 1, got page_size={}, dcp_size={}, interleave={}",
                    self.page_size, self.dcp_size, self.interleave
                ),
            ));
        }
        if !self.page_size.is_multiple_of(self.interleave) {
            return Err(Error::new(
                Status::InvalidLayout,
                format!(
                    "interleave size {} must divide the page size {} (a page must hold whole interleave blocks)",
                    self.interleave, self.page_size
                ),
            ));
        }
        if self.page_size.checked_mul(self.dcp_size).is_none() {
            return Err(Error::new(
                Status::InvalidLayout,
                "page_size * dcp_size overflows u64",
            ));
        }
        Ok(())
    }

    /// The virtual page: tokens covered by one page id on every rank (`P*W`).
    pub fn virtual_page(&self) -> u64 {
        self.page_size * self.dcp_size
    }

    /// The DCP rank that owns absolute sequence position `t`.
    pub fn owner(&self, t: u64) -> u64 {
        if self.dcp_size == 1 {
            0
        } else {
            (t / self.interleave) % self.dcp_size
        }
    }

    /// The owner's local index of absolute position `t` (counted from position 0).
    pub fn local(&self, t: u64) -> u64 {
        if self.dcp_size == 1 {
            t
        } else {
            let wi = self.dcp_size * self.interleave;
            (t / wi) * self.interleave + t % self.interleave
        }
    }

    /// Number of positions in `[start, end)` that rank `r` owns.
    pub fn count_owned(&self, r: u64, start: u64, end: u64) -> u64 {
        if end <= start {
            return 0;
        }
        // positions owned by r in [0, x)
        let below = |x: u64| -> u64 {
            if self.dcp_size == 1 {
                return if r == 0 { x } else { 0 };
            }
            let wi = self.dcp_size * self.interleave;
            let full = (x / wi) * self.interleave;
            let rem = x % wi;
            let lo = r * self.interleave;
            full + rem.saturating_sub(lo).min(self.interleave)
        };
        below(end) - below(start)
    }
}

/// One side's parallel topology and KV pool description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    /// Global engine (TP) rank; rank mapping uses `engine_rank % attn_tp_size`.
    pub engine_rank: u32,
    /// Attention tensor-parallel size.
    pub attn_tp_size: u32,
    /// Attention tensor-parallel rank.
    pub attn_tp_rank: u32,
    /// Attention context-parallel size (decode must be 1).
    pub attn_cp_size: u32,
    /// Attention context-parallel rank.
    pub attn_cp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
    /// Decode-context-parallel size (1 = none).
    pub dcp_size: u32,
    /// Decode-context-parallel rank.
    pub dcp_rank: u32,
    /// DCP interleave size (SGLang: 1).
    pub dcp_interleave: u32,
    /// Tokens per physical page.
    pub page_size: u32,
    /// KV cache dtype.
    pub kv_dtype: KvDtype,
    /// Pool kind.
    pub pool: PoolKind,
    /// Per-entry geometry, in the pool's entry order.
    pub entries: Vec<KvEntry>,
    /// Prefill: which CP ranks send and how they store the KV (decode: the default).
    #[serde(default)]
    pub cp: CpTransfer,
}

impl Topology {
    /// A single-rank MLA topology with `layers` entries of `row_bytes` each.
    pub fn single_mla(page_size: u32, layers: u32, row_bytes: u64) -> Topology {
        Topology {
            engine_rank: 0,
            attn_tp_size: 1,
            attn_tp_rank: 0,
            attn_cp_size: 1,
            attn_cp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
            dcp_size: 1,
            dcp_rank: 0,
            dcp_interleave: 1,
            page_size,
            kv_dtype: KvDtype::Bf16,
            pool: PoolKind::Mla,
            entries: (0..layers)
                .map(|l| KvEntry {
                    layer_id: l,
                    row_bytes,
                })
                .collect(),
            cp: CpTransfer::default(),
        }
    }

    /// This side's DCP layout.
    pub fn dcp_layout(&self) -> Result<DcpLayout> {
        DcpLayout::new(
            u64::from(self.page_size),
            u64::from(self.dcp_size),
            u64::from(self.dcp_interleave),
        )
    }

    /// Checks that every size is >= 1 and every rank is below its size.
    pub fn validate(&self, side: &str) -> Result<()> {
        let pairs = [
            ("attn_tp", self.attn_tp_size, self.attn_tp_rank),
            ("attn_cp", self.attn_cp_size, self.attn_cp_rank),
            ("pp", self.pp_size, self.pp_rank),
            ("dcp", self.dcp_size, self.dcp_rank),
        ];
        for (name, size, rank) in pairs {
            if size == 0 {
                return Err(Error::new(
                    Status::InvalidTopology,
                    format!("{side}: {name}_size must be >= 1, got 0"),
                ));
            }
            if rank >= size {
                return Err(Error::new(
                    Status::InvalidTopology,
                    format!("{side}: {name}_rank={rank} is not below {name}_size={size}"),
                ));
            }
        }
        self.dcp_layout()
            .map_err(|e| Error::new(e.status(), format!("{side}: {}", e.detail())))?;
        for (i, e) in self.entries.iter().enumerate() {
            if e.row_bytes == 0 {
                return Err(Error::new(
                    Status::GeometryMismatch,
                    format!("{side}: entry {i} (layer {}) has row_bytes=0", e.layer_id),
                ));
            }
        }
        Ok(())
    }

    /// Total bytes of one token row across all entries.
    pub fn token_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.row_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_rule_owner_and_local() {
        let l = DcpLayout::sglang(64, 4).unwrap();
        for v in 0..2000u64 {
            assert_eq!(l.owner(v), v % 4);
            assert_eq!(l.local(v), v / 4);
        }
    }

    #[test]
    fn vllm_rule_with_interleave() {
        // vLLM block_table: vb = B*W, off = pos mod vb, owner = (off div I) mod W,
        // local_slot = (off div (W*I))*I + off mod I, slot = bt[pos div vb]*B + local_slot.
        let (b, w, i) = (16u64, 4u64, 4u64);
        let l = DcpLayout::new(b, w, i).unwrap();
        for pos in 0..4000u64 {
            let vb = b * w;
            let off = pos % vb;
            assert_eq!(l.owner(pos), (off / i) % w);
            let local_slot = (off / (w * i)) * i + off % i;
            assert_eq!(l.local(pos), (pos / vb) * b + local_slot);
        }
    }

    #[test]
    fn count_owned_matches_brute_force() {
        for (p, w, i) in [(4, 1, 1), (4, 2, 1), (8, 4, 2), (16, 3, 4), (64, 16, 1)] {
            let l = DcpLayout::new(p, w, i).unwrap();
            for start in [0u64, 1, 5, 17, 63] {
                for end in [start, start + 1, start + 9, start + 200] {
                    for r in 0..w {
                        let brute = (start..end).filter(|&t| l.owner(t) == r).count() as u64;
                        assert_eq!(
                            l.count_owned(r, start, end),
                            brute,
                            "{p} {w} {i} r={r} [{start},{end})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn invalid_layouts_are_typed_errors() {
        assert_eq!(
            DcpLayout::new(0, 1, 1).unwrap_err().status(),
            Status::InvalidLayout
        );
        assert_eq!(
            DcpLayout::new(64, 4, 3).unwrap_err().status(),
            Status::InvalidLayout
        );
        assert_eq!(
            DcpLayout::new(u64::MAX, 4, 1).unwrap_err().status(),
            Status::InvalidLayout
        );
        let mut t = Topology::single_mla(64, 2, 1152);
        t.dcp_rank = 1;
        let e = t.validate("decode").unwrap_err();
        assert_eq!(e.status(), Status::InvalidTopology);
        assert!(e.detail().contains("decode: dcp_rank=1"), "{}", e.detail());
    }
}
