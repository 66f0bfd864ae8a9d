//! Peer compatibility: may this prefill rank send to this decode rank, and how.
//!
//! The checks of reference 3.4 and the seed pages, as typed errors whose text
//! names both sides' values, the likely cause and the fix. Where pdxfer's
//! general planner serves a case that SGLang refuses, it is accepted:
//! - different page sizes on the two sides (MLA pools): token relayout;
//! - prefill DCP `M > 1` to decode DCP `N != M` (MLA pools): token relayout per
//!   (prefill rank, decode rank) pair with a non-empty share;
//! - different interleave sizes: token relayout.
//!
//! A pair that shares no token under the two layouts is a miswire and fails
//! with `dcp_rank_mismatch`, the seed's error, before any byte moves.

use super::cp::check_cp_storage;
use super::cp_transfer::CpStorage;
use super::plan::pairs_with_share;
use super::topology::Topology;
use crate::error::{Error, Result, Status};
use serde::Serialize;

/// How the pair's KV is moved.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferMode {
    /// Same layout, same rank: whole pages are copied.
    Pages = 0,
    /// Token rows are relaid out by the plan (and packed when it pays).
    TokenRelayout = 1,
}

/// The outcome of a successful compatibility check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerCompat {
    /// Page copy or token relayout.
    pub mode: TransferMode,
    /// `(prefill entry index, decode entry index)` for every prefill entry.
    pub entry_pairs: Vec<(u32, u32)>,
    /// Decode DCP ranks this prefill rank shares tokens with (all of them, for DCP 1 -> N).
    pub decode_ranks_served: Vec<u32>,
}

fn side_desc(t: &Topology) -> String {
    format!(
        "tp={}/{} cp={}/{} pp={}/{} dcp={}/{} interleave={} page_size={} dtype={} pool={}",
        t.attn_tp_rank,
        t.attn_tp_size,
        t.attn_cp_rank,
        t.attn_cp_size,
        t.pp_rank,
        t.pp_size,
        t.dcp_rank,
        t.dcp_size,
        t.dcp_interleave,
        t.page_size,
        t.kv_dtype.as_str(),
        t.pool.as_str()
    )
}

/// Checks that `prefill` may send its KV to `decode` and says how.
pub fn check_peer(prefill: &Topology, decode: &Topology) -> Result<PeerCompat> {
    prefill.validate("prefill")?;
    decode.validate("decode")?;
    let both = format!(
        "prefill [{}], decode [{}]",
        side_desc(prefill),
        side_desc(decode)
    );
    let mla_like = prefill.pool.is_mla_like() && decode.pool.is_mla_like();

    if prefill.page_size != decode.page_size && !mla_like {
        return Err(Error::new(
            Status::PageSizeMismatch,
            format!(
                "Page size mismatch: prefill server has page_size={}, but decode server has page_size={}. Both servers must use the same --page-size value for {} pools (MLA pools are relaid out by token instead); {both}",
                prefill.page_size, decode.page_size, decode.pool.as_str()
            ),
        ));
    }
    if prefill.kv_dtype != decode.kv_dtype {
        return Err(Error::new(
            Status::KvDtypeMismatch,
            format!(
                "KV cache dtype mismatch: prefill server has kv_cache_dtype={}, but decode server has kv_cache_dtype={}. Both servers must use the same --kv-cache-dtype value; {both}",
                prefill.kv_dtype.as_str(),
                decode.kv_dtype.as_str()
            ),
        ));
    }
    if decode.dcp_size > 1 && !decode.pool.is_mla_like() {
        return Err(Error::new(
            Status::DcpRequiresMla,
            format!("PD decode DCP requires an MLA or hybrid-MLA KV pool, decode has a {} pool with dcp_size={}; run decode with --dcp-size 1 or an MLA model; {both}", decode.pool.as_str(), decode.dcp_size),
        ));
    }
    check_cp_storage(prefill, decode, &both)?;

    let sl = prefill.dcp_layout()?;
    let dl = decode.dcp_layout()?;
    let same_layout = sl == dl;
    let mode = if same_layout && prefill.dcp_rank == decode.dcp_rank {
        TransferMode::Pages
    } else if same_layout && (prefill.dcp_size > 1 || !mla_like) {
        return Err(Error::new(
            Status::DcpRankMismatch,
            format!(
                "PD peers must connect matching DCP ranks, got prefill={}, decode={} (both dcp_size={}). Likely cause: stale bootstrap metadata from an earlier cluster layout, or non-deterministic rank assignment. Fix: restart the decode ranks so they re-register (pdxfer refuses entries of other instances and older epochs), and check that both sides derive DCP ranks the same way; {both}",
                prefill.dcp_rank, decode.dcp_rank, prefill.dcp_size
            ),
        ));
    } else if !mla_like {
        return Err(Error::new(
            Status::UnsupportedDcpTopology,
            format!(
                "Unsupported PD DCP topology: {} -> {} for a {} pool; token relayout needs MLA or hybrid-MLA pools on both sides; {both}",
                prefill.dcp_size,
                decode.dcp_size,
                decode.pool.as_str()
            ),
        ));
    } else {
        TransferMode::TokenRelayout
    };

    let pairs = pairs_with_share(&sl, &dl);
    let (a, b) = (u64::from(prefill.dcp_rank), u64::from(decode.dcp_rank));
    if !pairs.contains(&(a, b)) {
        let should: Vec<u64> = pairs.iter().filter(|p| p.1 == b).map(|p| p.0).collect();
        return Err(Error::new(
            Status::DcpRankMismatch,
            format!(
                "PD peers must connect matching DCP ranks, got prefill={a}, decode={b}: under prefill dcp_size={} and decode dcp_size={} they share no token; decode rank {b} must connect to prefill DCP ranks {should:?}. Likely cause: stale bootstrap metadata or miswired peer discovery; {both}",
                prefill.dcp_size, decode.dcp_size
            ),
        ));
    }
    let served = pairs
        .iter()
        .filter(|p| p.0 == a)
        .map(|p| p.1 as u32)
        .collect();
    let entry_pairs = pair_entries(prefill, decode)?;
    Ok(PeerCompat {
        mode,
        entry_pairs,
        decode_ranks_served: served,
    })
}

/// Pairs each prefill entry with the decode entry of the same layer id and
/// checks that their token rows have the same size.
fn pair_entries(prefill: &Topology, decode: &Topology) -> Result<Vec<(u32, u32)>> {
    // a layer-split CP rank holds a subset of the layers, as a pipeline stage does
    let split = prefill.attn_cp_size > 1 && prefill.cp.storage == CpStorage::LayerSplit;
    if prefill.pp_size == decode.pp_size && !split && prefill.entries.len() != decode.entries.len()
    {
        return Err(Error::new(
            Status::GeometryMismatch,
            format!(
                "PD requires the decode to register one KV entry per prefill entry: src={}, dst={} (equal pp_size={}); check that both sides load the same model and speculative draft settings",
                prefill.entries.len(),
                decode.entries.len(),
                prefill.pp_size
            ),
        ));
    }
    let mut by_layer = std::collections::HashMap::with_capacity(decode.entries.len());
    for (i, e) in decode.entries.iter().enumerate() {
        if by_layer.insert(e.layer_id, i).is_some() {
            return Err(Error::new(
                Status::InvalidTopology,
                format!("decode registers layer id {} twice", e.layer_id),
            ));
        }
    }
    let mut out = Vec::with_capacity(prefill.entries.len());
    for (i, e) in prefill.entries.iter().enumerate() {
        let Some(&j) = by_layer.get(&e.layer_id) else {
            return Err(Error::new(
                Status::GeometryMismatch,
                format!(
                    "decode is missing a transfer entry for prefill layer {} (prefill entry {i}); decode layers span {:?}..={:?}",
                    e.layer_id,
                    decode.entries.iter().map(|x| x.layer_id).min(),
                    decode.entries.iter().map(|x| x.layer_id).max()
                ),
            ));
        };
        let d = decode.entries[j];
        if d.row_bytes != e.row_bytes {
            return Err(Error::new(
                Status::GeometryMismatch,
                format!(
                    "PD KV geometry differs at entry {i} (layer {}): src token bytes={}, dst token bytes={}; both sides must use the same model, kv_lora_rank + rope dims and dtype",
                    e.layer_id, e.row_bytes, d.row_bytes
                ),
            ));
        }
        out.push((i as u32, j as u32));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::topology::{KvDtype, KvEntry, PoolKind};
    use crate::layout::CpStorage;

    fn t(dcp: u32, rank: u32) -> Topology {
        let mut t = Topology::single_mla(64, 4, 1152);
        t.dcp_size = dcp;
        t.dcp_rank = rank;
        t
    }

    #[test]
    fn relayout_gate_like_sglang() {
        for r in 0..16 {
            assert_eq!(
                check_peer(&t(1, 0), &t(16, r)).unwrap().mode,
                TransferMode::TokenRelayout
            );
        }
        assert_eq!(
            check_peer(&t(16, 3), &t(16, 3)).unwrap().mode,
            TransferMode::Pages
        );
        let e = check_peer(&t(16, 3), &t(16, 4)).unwrap_err();
        assert_eq!(e.status(), Status::DcpRankMismatch);
        assert!(
            e.detail()
                .contains("PD peers must connect matching DCP ranks, got prefill=3, decode=4"),
            "{e}"
        );
        assert!(e.detail().contains("stale bootstrap metadata"));
        let mut p = t(1, 0);
        p.pool = PoolKind::Mha;
        let mut d = t(1, 0);
        d.pool = PoolKind::Mha;
        d.page_size = 32;
        assert_eq!(
            check_peer(&p, &d).unwrap_err().status(),
            Status::PageSizeMismatch
        );
        let mut d = t(4, 1);
        d.pool = PoolKind::Mha;
        assert_eq!(
            check_peer(&p, &d).unwrap_err().status(),
            Status::DcpRequiresMla
        );
        let mut p2 = t(2, 0);
        p2.pool = PoolKind::Mha;
        let mut d2 = t(1, 0);
        d2.pool = PoolKind::Mha;
        assert_eq!(
            check_peer(&p2, &d2).unwrap_err().status(),
            Status::UnsupportedDcpTopology
        );
    }

    #[test]
    fn general_planner_accepts_what_sglang_refuses() {
        // M=2 -> N=4 (SGLang: "Unsupported PD DCP topology: 2 -> 4")
        let c = check_peer(&t(2, 1), &t(4, 3)).unwrap();
        assert_eq!(c.mode, TransferMode::TokenRelayout);
        assert_eq!(c.decode_ranks_served, vec![1, 3]);
        let e = check_peer(&t(2, 0), &t(4, 1)).unwrap_err();
        assert_eq!(e.status(), Status::DcpRankMismatch);
        assert!(
            e.detail().contains("must connect to prefill DCP ranks [1]"),
            "{e}"
        );
        // different page sizes for MLA
        let mut d = t(4, 0);
        d.page_size = 32;
        assert_eq!(
            check_peer(&t(1, 0), &d).unwrap().mode,
            TransferMode::TokenRelayout
        );
    }

    #[test]
    fn bootstrap_side_errors() {
        let mut d = t(4, 0);
        d.kv_dtype = KvDtype::Fp8E4m3;
        let e = check_peer(&t(1, 0), &d).unwrap_err();
        assert_eq!(e.status(), Status::KvDtypeMismatch);
        assert!(e
            .detail()
            .contains("kv_cache_dtype=bf16, but decode server has kv_cache_dtype=fp8_e4m3"));
    }

    #[test]
    fn prefill_cp_pairs_with_decode_dcp_only_over_replicated_kv() {
        let mut p = t(1, 0);
        p.attn_cp_size = 2;
        p.attn_cp_rank = 1;
        let c = check_peer(&p, &t(4, 3)).unwrap();
        assert_eq!(c.mode, TransferMode::TokenRelayout);
        assert_eq!(c.decode_ranks_served, vec![0, 1, 2, 3]);
        for (storage, flag) in [
            (CpStorage::LayerSplit, "--enable-dsa-cache-layer-split"),
            (CpStorage::KvSharded, "--enable-kv-cache-sharding"),
        ] {
            p.cp.storage = storage;
            let e = check_peer(&p, &t(4, 0)).unwrap_err();
            assert_eq!(e.status(), Status::PrefillCpWithDecodeDcp);
            assert!(
                e.detail()
                    .contains(&format!("relaunch the prefill without {flag}")),
                "{e}"
            );
            // without DCP on the decode a layer split moves as pipeline stages do;
            // page-id sharding is not moved at all
            match storage {
                CpStorage::LayerSplit => assert!(check_peer(&p, &t(1, 0)).is_ok()),
                _ => assert_eq!(
                    check_peer(&p, &t(1, 0)).unwrap_err().status(),
                    Status::Unsupported
                ),
            }
        }
    }

    #[test]
    fn geometry_checks() {
        let mut d = t(4, 0);
        d.entries[2].row_bytes = 576;
        let e = check_peer(&t(1, 0), &d).unwrap_err();
        assert_eq!(e.status(), Status::GeometryMismatch);
        assert!(
            e.detail()
                .contains("entry 2 (layer 2): src token bytes=1152, dst token bytes=576"),
            "{e}"
        );
        let mut d = t(4, 0);
        d.entries.pop();
        assert!(check_peer(&t(1, 0), &d)
            .unwrap_err()
            .detail()
            .contains("src=4, dst=3"));
        // PP: prefill stage 1 of 2 holds layers 2,3; decode PP1 holds 0..4
        let mut p = t(1, 0);
        p.pp_size = 2;
        p.pp_rank = 1;
        p.entries = vec![
            KvEntry {
                layer_id: 2,
                row_bytes: 1152,
            },
            KvEntry {
                layer_id: 3,
                row_bytes: 1152,
            },
        ];
        assert_eq!(
            check_peer(&p, &t(4, 2)).unwrap().entry_pairs,
            vec![(0, 2), (1, 3)]
        );
        p.entries[1].layer_id = 9;
        assert!(check_peer(&p, &t(4, 2))
            .unwrap_err()
            .detail()
            .contains("missing a transfer entry for prefill layer 9"));
    }
}
