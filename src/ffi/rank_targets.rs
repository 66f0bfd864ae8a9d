//! `pdxfer_rank_targets`: the prefill ranks a decode rank contacts as lists
//! in the caller's arrays. `pdxfer_rank_mapping` gives them as half-open
//! ranges, which cannot hold a set with gaps: a DCP-sharded prefill read by a
//! smaller decode DCP (prefill DCP M -> decode DCP N, M > N) sends decode
//! rank d the shares d, d + N, ... (`layout::dcp_targets`).

use super::ptr::{self, Versioned};
use super::topology::{topology_from_c, PdxTopology, PDXFER_MAP_ALL_CP_RANKS};
use super::{boundary, PdxStatus};
use crate::error::{Error, Status};
use crate::layout::{self, MappingOptions};

/// The result of `pdxfer_rank_targets`: which prefill ranks a decode rank
/// contacts, as lists of ranks written into the caller's arrays.
///
/// The caller sets `struct_size`, the array pointers and `capacity` (the
/// entries each non-NULL array holds); the call writes the counts and the
/// arrays. All arrays NULL with `capacity` 0 is a size query: only the counts
/// and the two `required_*` numbers are written. Otherwise `tp_ranks`,
/// `cp_ranks` and `pp_ranks` must be non-NULL and `capacity` at least the
/// largest count (`tp_dummy` may stay NULL); a refused call writes nothing.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxRankTargets {
    /// `sizeof(PdxRankTargets)`, set by the caller before the call.
    pub struct_size: u64,
    /// In: the caller's array for the prefill TP ranks to contact (the first
    /// is the real one), or NULL for a size query.
    pub tp_ranks: *mut u32,
    /// In: the caller's array, or NULL: 1 where `tp_ranks[i]` only
    /// acknowledges (an MLA replica), else 0.
    pub tp_dummy: *mut u32,
    /// In: the caller's array for the prefill CP ranks to contact, or NULL for a size query.
    pub cp_ranks: *mut u32,
    /// In: the caller's array for the prefill PP ranks to contact, or NULL for a size query.
    pub pp_ranks: *mut u32,
    /// In: the entries each non-NULL array holds.
    pub capacity: u64,
    /// Out: the prefill TP ranks written (or needed).
    pub num_tp_ranks: u64,
    /// Out: the prefill CP ranks written (or needed).
    pub num_cp_ranks: u64,
    /// Out: the prefill PP ranks written (or needed).
    pub num_pp_ranks: u64,
    /// Out: decode infos a prefill rank waits for per room.
    pub required_dst_info_num: u32,
    /// Out: distinct prefill responses the decode rank waits for per room.
    pub required_prefill_response_num: u32,
}

// SAFETY: repr(C), starts with u64 struct_size, integers and raw pointers only (all-zero is valid).
unsafe impl Versioned for PdxRankTargets {
    const MIN_SIZE: usize = std::mem::size_of::<PdxRankTargets>();
    const NAME: &'static str = "PdxRankTargets";
}

/// Resolves which prefill TP/CP/PP ranks the decode rank contacts (reference
/// 3.1-3.3) as lists: any set of ranks, gaps included (prefill DCP M ->
/// decode DCP N). `flags`: `PDXFER_MAP_ALL_CP_RANKS` or 0. See
/// `PdxRankTargets` for the size query and the arrays.
#[no_mangle]
pub extern "C" fn pdxfer_rank_targets(
    decode: *const PdxTopology,
    prefill: *const PdxTopology,
    flags: u32,
    out: *mut PdxRankTargets,
) -> PdxStatus {
    boundary(|| {
        let req = ptr::read_versioned(out)?;
        let d = topology_from_c(decode)?;
        let p = topology_from_c(prefill)?;
        if flags & !PDXFER_MAP_ALL_CP_RANKS != 0 {
            return Err(Error::invalid(format!("unknown flags 0x{flags:x}")));
        }
        let opts = MappingOptions {
            all_cp_ranks_transfer: flags & PDXFER_MAP_ALL_CP_RANKS != 0,
        };
        let m = layout::resolve_rank_mapping(&d, &p, opts)?;
        let dummy: Vec<u32> = m.dummy_tp.iter().map(|&x| u32::from(x)).collect();
        let counts = PdxRankTargets {
            num_tp_ranks: m.target_tp_ranks.len() as u64,
            num_cp_ranks: m.target_cp_ranks.len() as u64,
            num_pp_ranks: m.target_pp_ranks.len() as u64,
            required_dst_info_num: m.required_dst_info_num,
            required_prefill_response_num: m.required_prefill_response_num,
            ..req
        };
        let query = req.tp_ranks.is_null()
            && req.tp_dummy.is_null()
            && req.cp_ranks.is_null()
            && req.pp_ranks.is_null()
            && req.capacity == 0;
        if !query {
            let need = [
                m.target_tp_ranks.len(),
                m.target_cp_ranks.len(),
                m.target_pp_ranks.len(),
            ]
            .into_iter()
            .max()
            .unwrap_or(0);
            let cap = usize::try_from(req.capacity).unwrap_or(usize::MAX);
            if cap < need {
                return Err(Error::new(
                    Status::BufferTooSmall,
                    format!(
                        "PdxRankTargets.capacity is {cap} but {need} entries are needed ({} tp, {} cp, {} pp ranks); query the counts with NULL arrays and capacity 0",
                        m.target_tp_ranks.len(),
                        m.target_cp_ranks.len(),
                        m.target_pp_ranks.len()
                    ),
                ));
            }
            // every array checked before anything is written: a refused call writes nothing
            let arrays = [
                (
                    req.tp_ranks,
                    &m.target_tp_ranks[..],
                    "PdxRankTargets.tp_ranks",
                ),
                (
                    req.cp_ranks,
                    &m.target_cp_ranks[..],
                    "PdxRankTargets.cp_ranks",
                ),
                (
                    req.pp_ranks,
                    &m.target_pp_ranks[..],
                    "PdxRankTargets.pp_ranks",
                ),
            ];
            for (a, _, what) in &arrays {
                if a.is_null() {
                    return Err(Error::new(
                        Status::NullArgument,
                        format!("{what} is NULL but capacity is {cap}; all three rank arrays are needed (or all NULL with capacity 0 for a size query)"),
                    ));
                }
            }
            let mut dst = Vec::new();
            for (a, v, what) in arrays {
                dst.push((ptr::slice_mut(a, v.len(), what)?, v));
            }
            let dummy_dst = if req.tp_dummy.is_null() {
                None
            } else {
                Some(ptr::slice_mut(
                    req.tp_dummy,
                    dummy.len(),
                    "PdxRankTargets.tp_dummy",
                )?)
            };
            for (slot, v) in dst {
                slot.copy_from_slice(v);
            }
            if let Some(slot) = dummy_dst {
                slot.copy_from_slice(&dummy);
            }
        }
        ptr::write_versioned(out, &counts)?;
        Ok(Status::Ok)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_size_is_pinned() {
        assert_eq!(std::mem::size_of::<PdxRankTargets>(), 80);
    }
}
