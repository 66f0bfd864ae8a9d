//! Topology, peer compatibility and rank mapping over the C ABI.

use super::ptr::{self, Versioned};
use super::{boundary, PdxStatus};
use crate::error::Result;
use crate::layout::{
    self, CpMode, CpStorage, CpTransfer, KvDtype, KvEntry, MappingOptions, PoolKind, Topology,
};

/// One side's parallel topology and KV geometry.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxTopology {
    /// `sizeof(PdxTopology)`, set by the caller.
    pub struct_size: u64,
    /// Global engine (TP) rank.
    pub engine_rank: u32,
    /// Attention TP size.
    pub attn_tp_size: u32,
    /// Attention TP rank.
    pub attn_tp_rank: u32,
    /// Attention CP size.
    pub attn_cp_size: u32,
    /// Attention CP rank.
    pub attn_cp_rank: u32,
    /// Pipeline size.
    pub pp_size: u32,
    /// Pipeline rank.
    pub pp_rank: u32,
    /// DCP size.
    pub dcp_size: u32,
    /// DCP rank.
    pub dcp_rank: u32,
    /// DCP interleave (SGLang: 1).
    pub dcp_interleave: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// `PdxKvDtype` value (0 auto, 1 bf16, 2 fp16, 3 fp32, 4 fp8_e4m3, 5 fp8_e5m2,
    /// 6 fp8_ds_mla: vLLM's 656-byte fp8 MLA rows).
    pub kv_dtype: u32,
    /// `PdxPoolKind` value (0 mla, 1 hybrid_mla, 2 mha).
    pub pool_kind: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Number of KV entries.
    pub num_entries: u64,
    /// Global layer id of each entry.
    pub entry_layer_ids: *const u32,
    /// Token row bytes of each entry.
    pub entry_row_bytes: *const u64,
    /// Prefill: `PDXFER_CP_MODE_*`, which attention CP ranks send (0, the
    /// default: CP rank 0 only). Absent from a 88-byte (older) struct.
    pub cp_mode: u32,
    /// Prefill: `PDXFER_CP_STORAGE_*`, how the CP ranks store the KV (0, the
    /// default: replicated).
    pub cp_storage: u32,
}

/// CP rank 0 sends the whole request; the other CP ranks conclude locally.
pub const PDXFER_CP_MODE_RANK0: u32 = 0;
/// Every CP rank sends its contiguous page range of the request.
pub const PDXFER_CP_MODE_ALL_CP: u32 = 1;
/// Every CP rank holds every token.
pub const PDXFER_CP_STORAGE_REPLICATED: u32 = 0;
/// Each CP rank holds a subset of the layers (DSA cache-layer split).
pub const PDXFER_CP_STORAGE_LAYER_SPLIT: u32 = 1;
/// Pages are sharded by page id (KV cache sharding).
pub const PDXFER_CP_STORAGE_KV_SHARDED: u32 = 2;

/// `sizeof(PdxTopology)` before the CP fields.
const PDX_TOPOLOGY_SIZE_V1: usize = 88;

// SAFETY: repr(C), starts with u64 struct_size, integers and raw pointers only (zero is valid).
unsafe impl Versioned for PdxTopology {
    const MIN_SIZE: usize = PDX_TOPOLOGY_SIZE_V1;
    const NAME: &'static str = "PdxTopology";
}

/// The result of `pdxfer_check_peer`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxPeerCompat {
    /// `sizeof(PdxPeerCompat)`, set by the caller before the call.
    pub struct_size: u64,
    /// 0: whole pages are copied; 1: token rows are relaid out.
    pub mode: u32,
    /// Decode DCP ranks this prefill rank shares tokens with.
    pub num_decode_ranks_served: u32,
    /// Prefill entries paired with a decode entry.
    pub num_entry_pairs: u64,
}

// SAFETY: repr(C), starts with u64 struct_size, integers only.
unsafe impl Versioned for PdxPeerCompat {
    const MIN_SIZE: usize = std::mem::size_of::<PdxPeerCompat>();
    const NAME: &'static str = "PdxPeerCompat";
}

/// The result of `pdxfer_rank_mapping`: which prefill ranks a decode rank
/// contacts, as half-open ranges.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxRankMapping {
    /// `sizeof(PdxRankMapping)`, set by the caller before the call.
    pub struct_size: u64,
    /// First prefill TP rank to contact (the real one).
    pub tp_rank_begin: u32,
    /// One past the last prefill TP rank to contact.
    pub tp_rank_end: u32,
    /// 1 when the TP ranks after the first are dummies (MLA replicas).
    pub tp_others_dummy: u32,
    /// First prefill CP rank to contact.
    pub cp_rank_begin: u32,
    /// One past the last prefill CP rank.
    pub cp_rank_end: u32,
    /// First prefill PP rank to contact.
    pub pp_rank_begin: u32,
    /// One past the last prefill PP rank.
    pub pp_rank_end: u32,
    /// Decode infos a prefill rank waits for per room.
    pub required_dst_info_num: u32,
    /// Distinct prefill responses the decode rank waits for per room.
    pub required_prefill_response_num: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

// SAFETY: repr(C), starts with u64 struct_size, integers only.
unsafe impl Versioned for PdxRankMapping {
    const MIN_SIZE: usize = std::mem::size_of::<PdxRankMapping>();
    const NAME: &'static str = "PdxRankMapping";
}

/// Every prefill CP rank transfers its shard.
pub const PDXFER_MAP_ALL_CP_RANKS: u32 = 1;

/// Converts a C topology into the layout core's.
pub(crate) fn topology_from_c(p: *const PdxTopology) -> Result<Topology> {
    let t = ptr::read_versioned(p)?;
    let n = usize::try_from(t.num_entries)
        .map_err(|_| crate::Error::invalid("num_entries does not fit size_t"))?;
    let ids = ptr::slice(t.entry_layer_ids, n, "entry_layer_ids")?;
    let rows = ptr::slice(t.entry_row_bytes, n, "entry_row_bytes")?;
    Ok(Topology {
        engine_rank: t.engine_rank,
        attn_tp_size: t.attn_tp_size,
        attn_tp_rank: t.attn_tp_rank,
        attn_cp_size: t.attn_cp_size,
        attn_cp_rank: t.attn_cp_rank,
        pp_size: t.pp_size,
        pp_rank: t.pp_rank,
        dcp_size: t.dcp_size,
        dcp_rank: t.dcp_rank,
        dcp_interleave: t.dcp_interleave,
        page_size: t.page_size,
        kv_dtype: KvDtype::from_u32(t.kv_dtype)?,
        pool: PoolKind::from_u32(t.pool_kind)?,
        entries: ids
            .iter()
            .zip(rows)
            .map(|(&layer_id, &row_bytes)| KvEntry {
                layer_id,
                row_bytes,
            })
            .collect(),
        cp: CpTransfer {
            mode: CpMode::from_u32(t.cp_mode)?,
            storage: CpStorage::from_u32(t.cp_storage)?,
        },
    })
}

/// Checks whether `prefill` may send its KV to `decode` (reference 3.4 and more).
///
/// On failure the status names the kind (`PDX_STATUS_DCP_RANK_MISMATCH`, ...) and
/// `pdxfer_last_error()` names both sides' values, the likely cause and the fix.
#[no_mangle]
pub extern "C" fn pdxfer_check_peer(
    prefill: *const PdxTopology,
    decode: *const PdxTopology,
    out: *mut PdxPeerCompat,
) -> PdxStatus {
    boundary(|| {
        let p = topology_from_c(prefill)?;
        let d = topology_from_c(decode)?;
        let c = layout::check_peer(&p, &d)?;
        ptr::write_versioned(
            out,
            &PdxPeerCompat {
                struct_size: 0,
                mode: c.mode as u32,
                num_decode_ranks_served: c.decode_ranks_served.len() as u32,
                num_entry_pairs: c.entry_pairs.len() as u64,
            },
        )?;
        super::ok()
    })
}

/// Resolves which prefill TP/CP/PP ranks the decode rank contacts (reference 3.1-3.3).
#[no_mangle]
pub extern "C" fn pdxfer_rank_mapping(
    decode: *const PdxTopology,
    prefill: *const PdxTopology,
    flags: u32,
    out: *mut PdxRankMapping,
) -> PdxStatus {
    boundary(|| {
        let d = topology_from_c(decode)?;
        let p = topology_from_c(prefill)?;
        if flags & !PDXFER_MAP_ALL_CP_RANKS != 0 {
            return Err(crate::Error::invalid(format!("unknown flags 0x{flags:x}")));
        }
        let opts = MappingOptions {
            all_cp_ranks_transfer: flags & PDXFER_MAP_ALL_CP_RANKS != 0,
        };
        let m = layout::resolve_rank_mapping(&d, &p, opts)?;
        // [first, last + 1); an empty list or a rank at u32::MAX is an error, not a
        // panic (found by the c_abi fuzz target: an empty list was indexed); a
        // list with gaps (a DCP-sharded prefill read by a smaller decode DCP:
        // shares d and d + N) has no range and is refused, not widened
        let range = |v: &[u32], what: &str| -> Result<(u32, u32)> {
            let consecutive = v.windows(2).all(|w| w[0].checked_add(1) == Some(w[1]));
            match (v.first(), v.last().and_then(|l| l.checked_add(1))) {
                (Some(&a), Some(b)) if consecutive => Ok((a, b)),
                _ => Err(crate::Error::new(
                    crate::Status::InvalidTopology,
                    format!("the mapping has no representable {what} rank range: {v:?}"),
                )),
            }
        };
        let (tb, te) = range(&m.target_tp_ranks, "tp")?;
        let (cb, ce) = range(&m.target_cp_ranks, "cp")?;
        let (pb, pe) = range(&m.target_pp_ranks, "pp")?;
        ptr::write_versioned(
            out,
            &PdxRankMapping {
                struct_size: 0,
                tp_rank_begin: tb,
                tp_rank_end: te,
                tp_others_dummy: u32::from(m.dummy_tp.get(1).copied().unwrap_or(false)),
                cp_rank_begin: cb,
                cp_rank_end: ce,
                pp_rank_begin: pb,
                pp_rank_end: pe,
                required_dst_info_num: m.required_dst_info_num,
                required_prefill_response_num: m.required_prefill_response_num,
                reserved: 0,
            },
        )?;
        super::ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Struct sizes are part of the ABI; C and Python pin the same numbers.
    #[test]
    fn abi_struct_sizes_are_pinned() {
        use std::mem::size_of;
        assert_eq!(size_of::<PdxTopology>(), 96);
        assert_eq!(PDX_TOPOLOGY_SIZE_V1, 88);
        assert_eq!(size_of::<PdxPeerCompat>(), 24);
        assert_eq!(size_of::<PdxRankMapping>(), 48);
        assert_eq!(size_of::<super::super::plan::PdxDcpPlanArgs>(), 88);
        assert_eq!(size_of::<super::super::plan::PdxPairPlanArgs>(), 144);
        assert_eq!(size_of::<super::super::plan::PdxRun>(), 24);
        assert_eq!(size_of::<super::super::plan::PdxLayout>(), 24);
    }
}
