//! Which prefill ranks a decode rank talks to (reference 3.1-3.3): TP, CP and
//! PP targets, dummy ranks, and how many peers each side waits for.

use super::cp::CpSender;
use super::dcp_targets::dcp_targets;
use super::topology::{PoolKind, Topology};
use crate::error::{Error, Result, Status};
use serde::Serialize;

/// Largest TP, CP or PP group size a rank mapping accepts. The mapping lists
/// target ranks, so an absurd size from a peer's topology would otherwise
/// allocate gigabytes (found by the c_abi fuzz target: pp_size = 2^31 asked
/// for an 11 GB allocation).
/// cbindgen:ignore
pub const MAX_GROUP_SIZE: u32 = 1 << 16;

/// The prefill ranks one decode rank connects to, and the counts both sides wait for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankMapping {
    /// Prefill attention-TP ranks to contact; the first is the real one.
    pub target_tp_ranks: Vec<u32>,
    /// `dummy_tp[i]`: the rank `target_tp_ranks[i]` only acknowledges (MLA replicas).
    pub dummy_tp: Vec<bool>,
    /// Prefill CP ranks to contact.
    pub target_cp_ranks: Vec<u32>,
    /// Prefill PP ranks to contact.
    pub target_pp_ranks: Vec<u32>,
    /// Decode infos a prefill rank waits for per room.
    pub required_dst_info_num: u32,
    /// Distinct prefill status messages the decode rank waits for per room.
    pub required_prefill_response_num: u32,
}

impl RankMapping {
    /// The real (non-dummy) prefill TP rank.
    pub fn target_tp_rank(&self) -> u32 {
        self.target_tp_ranks[0]
    }
}

/// Options that change the CP mapping (SGLang's environment switches).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MappingOptions {
    /// Every prefill CP rank transfers its shard (`SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`
    /// or DSA cache-layer split) even where the prefill does not publish
    /// [`CpMode::AllCp`](super::CpMode::AllCp).
    pub all_cp_ranks_transfer: bool,
}

/// Resolves the rank mapping of `decode` against the prefill instance `prefill`.
pub fn resolve_rank_mapping(
    decode: &Topology,
    prefill: &Topology,
    opts: MappingOptions,
) -> Result<RankMapping> {
    for (side, t) in [("decode", decode), ("prefill", prefill)] {
        for (name, v) in [
            ("attn_tp_size", t.attn_tp_size),
            ("attn_cp_size", t.attn_cp_size),
            ("pp_size", t.pp_size),
        ] {
            if v > MAX_GROUP_SIZE {
                return Err(Error::new(
                    Status::InvalidTopology,
                    format!("{side} {name}={v} exceeds the supported maximum {MAX_GROUP_SIZE}"),
                ));
            }
        }
    }
    let (td, tp) = (decode.attn_tp_size, prefill.attn_tp_size);
    if td == 0 || tp == 0 {
        return Err(Error::new(
            Status::InvalidTopology,
            format!("attention TP sizes must be >= 1, got prefill={tp}, decode={td}"),
        ));
    }
    let e = decode.engine_rank % td;
    let is_mla = decode.pool == PoolKind::Mla;
    let dcp = if decode.pool.is_mla_like() && prefill.pool.is_mla_like() {
        dcp_targets(decode, prefill)?
    } else {
        None
    };
    let (tp_ranks, dst_info, mut resp) = if let Some(t) = &dcp {
        // a DCP-sharded prefill: every target holds a share this rank owns
        let n = t.tp_ranks.len() as u32;
        (t.tp_ranks.clone(), t.dst_info_num, n)
    } else if td == tp {
        (vec![e], 1, 1)
    } else if td > tp {
        if td % tp != 0 {
            return Err(Error::new(
                Status::InvalidTopology,
                format!("decode attention TP {td} is not a multiple of prefill attention TP {tp}; use sizes that divide each other"),
            ));
        }
        let ratio = td / tp;
        (vec![e / ratio], ratio, 1)
    } else {
        if tp % td != 0 {
            return Err(Error::new(
                Status::InvalidTopology,
                format!("prefill attention TP {tp} is not a multiple of decode attention TP {td}; use sizes that divide each other"),
            ));
        }
        let ratio = tp / td;
        let ranks: Vec<u32> = (e * ratio..(e + 1) * ratio).collect();
        (ranks, 1, if is_mla { 1 } else { ratio })
    };
    let dummy_tp = tp_ranks
        .iter()
        .enumerate()
        .map(|(i, _)| i > 0 && is_mla && dcp.is_none())
        .collect();

    if decode.attn_cp_size != 1 {
        return Err(Error::new(
            Status::InvalidTopology,
            format!(
                "Decode cp size ({}) should be equal to 1; decode spreads context with DCP, not attention CP",
                decode.attn_cp_size
            ),
        ));
    }
    let cp = prefill.attn_cp_size.max(1);
    let cp_ranks: Vec<u32> = if cp > 1
        && (opts.all_cp_ranks_transfer
            || decode.pool == PoolKind::HybridMla
            || CpSender::of(prefill).all_ranks_send())
    {
        resp *= cp;
        (0..cp).collect()
    } else {
        vec![0]
    };

    let (ppd, ppp) = (decode.pp_size, prefill.pp_size);
    let pp_ranks: Vec<u32> = if ppd == ppp {
        vec![decode.pp_rank]
    } else if ppd == 1 {
        resp *= ppp;
        (0..ppp).collect()
    } else {
        return Err(Error::new(
            Status::PpMismatch,
            format!(
                "Decode pp size ({ppd}) should be equal to prefill pp size ({ppp}) or 1; relaunch decode with --pp-size {ppp} or 1"
            ),
        ));
    };

    Ok(RankMapping {
        target_tp_ranks: tp_ranks,
        dummy_tp,
        target_cp_ranks: cp_ranks,
        target_pp_ranks: pp_ranks,
        required_dst_info_num: dst_info,
        required_prefill_response_num: resp,
    })
}

/// SGLang's `prefill_unique_rank`: `tp_rank*(pp_size*cp_size) + pp_rank*cp_size + cp_rank`.
pub fn prefill_unique_rank(prefill: &Topology) -> u32 {
    prefill.attn_tp_rank * (prefill.pp_size * prefill.attn_cp_size)
        + prefill.pp_rank * prefill.attn_cp_size
        + prefill.attn_cp_rank
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the c_abi fuzz target: a huge pp_size made the mapping
    /// allocate (0..pp_size) ranks; it is now a typed error.
    #[test]
    fn absurd_group_sizes_are_refused_not_allocated() {
        let d = topo(1, 1, 1, 0, PoolKind::Mla);
        for p in [
            topo(1, 1, 1 << 31, 0, PoolKind::Mla),
            topo(1, MAX_GROUP_SIZE + 1, 1, 0, PoolKind::Mla),
            topo(u32::MAX, 1, 1, 0, PoolKind::Mla),
        ] {
            let e = resolve_rank_mapping(&d, &p, MappingOptions::default()).unwrap_err();
            assert_eq!(e.status(), Status::InvalidTopology, "{e:?}");
        }
    }

    fn topo(tp: u32, cp: u32, pp: u32, engine_rank: u32, pool: PoolKind) -> Topology {
        let mut t = Topology::single_mla(64, 4, 1152);
        t.attn_tp_size = tp;
        t.attn_cp_size = cp;
        t.pp_size = pp;
        t.engine_rank = engine_rank;
        t.pool = pool;
        t
    }

    #[test]
    fn tp_cases() {
        // (decode tp, decode rank, prefill tp) -> (target tp ranks, dst infos, prefill responses)
        for (d_tp, rank, p_tp, want) in [(4, 6, 4, (vec![2], 1, 1)), (8, 5, 2, (vec![1], 4, 1))] {
            let m = resolve_rank_mapping(
                &topo(d_tp, 1, 1, rank, PoolKind::Mla),
                &topo(p_tp, 1, 1, 0, PoolKind::Mla),
                Default::default(),
            )
            .unwrap();
            let got = (
                m.target_tp_ranks.clone(),
                m.required_dst_info_num,
                m.required_prefill_response_num,
            );
            assert_eq!(got, want, "decode tp {d_tp} rank {rank}, prefill tp {p_tp}");
        }
        let m = resolve_rank_mapping(
            &topo(2, 1, 1, 1, PoolKind::Mla),
            &topo(8, 1, 1, 0, PoolKind::Mla),
            Default::default(),
        )
        .unwrap();
        assert_eq!(m.target_tp_ranks, vec![4, 5, 6, 7]);
        assert_eq!(m.dummy_tp, vec![false, true, true, true]);
        assert_eq!(
            (m.required_dst_info_num, m.required_prefill_response_num),
            (1, 1)
        );
        let m = resolve_rank_mapping(
            &topo(2, 1, 1, 1, PoolKind::Mha),
            &topo(8, 1, 1, 0, PoolKind::Mha),
            Default::default(),
        )
        .unwrap();
        assert_eq!(m.dummy_tp, vec![false; 4]);
        assert_eq!(m.required_prefill_response_num, 4);
        let e = resolve_rank_mapping(
            &topo(3, 1, 1, 1, PoolKind::Mla),
            &topo(2, 1, 1, 0, PoolKind::Mla),
            Default::default(),
        )
        .unwrap_err();
        assert_eq!(e.status(), Status::InvalidTopology);
    }

    #[test]
    fn cp_and_pp_cases() {
        let m = resolve_rank_mapping(
            &topo(4, 1, 1, 0, PoolKind::Mla),
            &topo(4, 2, 1, 0, PoolKind::Mla),
            Default::default(),
        )
        .unwrap();
        assert_eq!(m.target_cp_ranks, vec![0]);
        let all = MappingOptions {
            all_cp_ranks_transfer: true,
        };
        let m = resolve_rank_mapping(
            &topo(4, 1, 1, 0, PoolKind::Mla),
            &topo(4, 2, 1, 0, PoolKind::Mla),
            all,
        )
        .unwrap();
        assert_eq!(
            (m.target_cp_ranks.clone(), m.required_prefill_response_num),
            (vec![0, 1], 2)
        );
        let e = resolve_rank_mapping(
            &topo(4, 2, 1, 0, PoolKind::Mla),
            &topo(4, 1, 1, 0, PoolKind::Mla),
            Default::default(),
        )
        .unwrap_err();
        assert!(e
            .detail()
            .contains("Decode cp size (2) should be equal to 1"));
        let e = resolve_rank_mapping(
            &topo(4, 1, 2, 0, PoolKind::Mla),
            &topo(4, 1, 4, 0, PoolKind::Mla),
            Default::default(),
        )
        .unwrap_err();
        assert_eq!(e.status(), Status::PpMismatch);
        assert!(e
            .detail()
            .contains("Decode pp size (2) should be equal to prefill pp size (4) or 1"));
    }

    #[test]
    fn kimi_k3_shape() {
        // P: TP1 x PP16; D: TP16 x DCP16 x PP1
        for r in 0..16 {
            let mut d = topo(16, 1, 1, r, PoolKind::Mla);
            d.dcp_size = 16;
            d.dcp_rank = r;
            let m = resolve_rank_mapping(&d, &topo(1, 1, 16, 0, PoolKind::Mla), Default::default())
                .unwrap();
            assert_eq!(m.target_tp_ranks, vec![0]);
            assert_eq!(m.target_pp_ranks, (0..16).collect::<Vec<_>>());
            assert_eq!(m.target_cp_ranks, vec![0]);
            assert_eq!(
                (m.required_dst_info_num, m.required_prefill_response_num),
                (16, 16)
            );
        }
    }

    #[test]
    fn unique_rank_formula() {
        let mut p = topo(4, 2, 3, 0, PoolKind::Mla);
        p.attn_tp_rank = 3;
        p.pp_rank = 2;
        p.attn_cp_rank = 1;
        assert_eq!(prefill_unique_rank(&p), 3 * 6 + 2 * 2 + 1);
    }
}
