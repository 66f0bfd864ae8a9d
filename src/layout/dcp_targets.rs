//! Which prefill TP ranks a decode rank reads from when the prefill shards
//! its KV over DCP (`dcp_size` M > 1): the ranks holding the DCP shares that
//! overlap the decode rank's positions, one TP replica of each.
//!
//! A prefill TP group of `T` ranks with DCP `M` holds `T / M` replicas of
//! each DCP share; TP rank `r` holds DCP share `r % M` (vLLM's and SGLang's
//! grouping: a DCP group is `M` consecutive TP ranks). A decode rank with TP
//! rank `e` and DCP rank `d` (decode DCP `N`, replica group `g = e / N`)
//! reads share `s` from TP rank `(g mod T/M) * M + s`, for every `s` whose
//! positions overlap its own under the two layouts (page size, DCP size and
//! interleave of each side). Each pair is then checked by the peer check,
//! which refuses a prefill registered under another grouping.

use super::plan::pairs_with_share;
use super::topology::Topology;
use crate::error::{Error, Result, Status};

/// The targets of one decode rank against a DCP-sharded prefill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcpTargets {
    /// Prefill TP ranks to read from (all real: each holds a distinct share).
    pub tp_ranks: Vec<u32>,
    /// Decode ranks that send metadata to each of those prefill ranks.
    pub dst_info_num: u32,
}

/// `None` when the prefill holds whole requests (DCP 1), a side's DCP does
/// not divide its TP, or the decode's DCP rank is not `tp_rank % N`: the TP
/// mapping applies (and the peer check).
pub fn dcp_targets(decode: &Topology, prefill: &Topology) -> Result<Option<DcpTargets>> {
    let m = prefill.dcp_size;
    if m <= 1 {
        return Ok(None);
    }
    let n = decode.dcp_size.max(1);
    let (tp, td) = (prefill.attn_tp_size, decode.attn_tp_size);
    if tp % m != 0 || td % n != 0 || decode.dcp_rank != (decode.engine_rank % td) % n {
        // DCP not grouped inside TP, or a decode DCP rank that is not its TP
        // rank's (stale or miswired): the TP mapping, whose peer check refuses
        // a pair that shares no position
        return Ok(None);
    }
    let pairs = pairs_with_share(&prefill.dcp_layout()?, &decode.dcp_layout()?);
    let d = u64::from(decode.dcp_rank);
    let shares: Vec<u32> = pairs
        .iter()
        .filter(|&&(_, b)| b == d)
        .map(|&(a, _)| a as u32)
        .collect();
    // decode DCP ranks reading each prefill share: the same for every share read
    let readers: Vec<usize> = shares
        .iter()
        .map(|&s| pairs.iter().filter(|&&(a, _)| a == u64::from(s)).count())
        .collect();
    let (replicas, groups) = (tp / m, td / n);
    // decode replica groups that read from one prefill replica
    let per_replica = if groups <= replicas {
        1
    } else if groups % replicas == 0 {
        groups / replicas
    } else {
        0
    };
    if shares.is_empty() || per_replica == 0 || readers.iter().any(|&r| r != readers[0]) {
        return Err(Error::new(
            Status::UnsupportedDcpTopology,
            format!(
                "prefill DCP {m} (tp {tp}, interleave {}) -> decode DCP {n} (tp {td}, interleave {}): the decode rank's shares cannot be read with the same number of decode ranks per prefill rank; use TP and DCP sizes that divide each other",
                prefill.dcp_interleave, decode.dcp_interleave
            ),
        ));
    }
    let g = (decode.engine_rank % td) / n;
    let replica = g % replicas;
    Ok(Some(DcpTargets {
        tp_ranks: shares.iter().map(|&s| replica * m + s).collect(),
        dst_info_num: readers[0] as u32 * per_replica,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(tp: u32, dcp: u32, inter: u32, tp_rank: u32) -> Topology {
        let mut t = Topology::single_mla(16, 4, 1152);
        t.attn_tp_size = tp;
        t.attn_tp_rank = tp_rank;
        t.engine_rank = tp_rank;
        t.dcp_size = dcp;
        t.dcp_rank = tp_rank % dcp;
        t.dcp_interleave = inter;
        t
    }

    fn targets(p: (u32, u32, u32), d: (u32, u32, u32), rank: u32) -> DcpTargets {
        dcp_targets(&topo(d.0, d.1, d.2, rank), &topo(p.0, p.1, p.2, 0))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn whole_request_prefills_keep_the_tp_mapping() {
        assert_eq!(
            dcp_targets(&topo(4, 4, 1, 1), &topo(2, 1, 1, 0)).unwrap(),
            None
        );
    }

    #[test]
    fn each_decode_rank_reads_the_shares_overlapping_its_positions() {
        // 2 -> 4 at interleave 1: decode d owns t % 4 == d, prefill s owns t % 2 == s
        for r in 0..4 {
            let t = targets((2, 2, 1), (4, 4, 1), r);
            assert_eq!((t.tp_ranks, t.dst_info_num), (vec![r % 2], 2), "decode {r}");
        }
        // 4 -> 2 at interleave 1: decode d reads shares d and d + 2
        for r in 0..2 {
            let t = targets((4, 4, 1), (2, 2, 1), r);
            assert_eq!(
                (t.tp_ranks, t.dst_info_num),
                (vec![r, r + 2], 1),
                "decode {r}"
            );
        }
        // 2 -> 2 at the block size: same layout, rank to rank
        let t = targets((2, 2, 16), (2, 2, 16), 1);
        assert_eq!((t.tp_ranks, t.dst_info_num), (vec![1], 1));
        // 2 -> 4 at the block size: decode pages of 16 positions per rank in
        // rounds of 64, prefill rounds of 32: decode d reads share d % 2
        let t = targets((2, 2, 16), (4, 4, 16), 3);
        assert_eq!((t.tp_ranks, t.dst_info_num), (vec![1], 2));
        // different interleaves: every share overlaps
        let t = targets((2, 2, 1), (2, 2, 16), 0);
        assert_eq!((t.tp_ranks, t.dst_info_num), (vec![0, 1], 2));
    }

    #[test]
    fn tp_replicas_spread_the_readers() {
        // prefill TP 4 DCP 2 (two replicas) -> decode TP 4 DCP 2 (two groups)
        let t = targets((4, 2, 1), (4, 2, 1), 3);
        assert_eq!((t.tp_ranks, t.dst_info_num), (vec![3], 1));
        let t = targets((4, 2, 1), (4, 2, 1), 0);
        assert_eq!((t.tp_ranks, t.dst_info_num), (vec![0], 1));
        // decode TP 4 DCP 2 from one replica (prefill TP 2 DCP 2): both groups read it
        let t = targets((2, 2, 1), (4, 2, 1), 2);
        assert_eq!((t.tp_ranks, t.dst_info_num), (vec![0], 2));
    }

    #[test]
    fn replica_counts_that_do_not_divide_are_refused() {
        assert_eq!(
            dcp_targets(&topo(4, 4, 1, 0), &topo(3, 2, 1, 0)).unwrap(),
            None
        );
        // a decode DCP rank that is not its TP rank's: left to the TP mapping's peer check
        let mut miswired = topo(2, 2, 1, 0);
        miswired.dcp_rank = 1;
        assert_eq!(dcp_targets(&miswired, &topo(2, 2, 1, 0)).unwrap(), None);
        let e = dcp_targets(&topo(4, 1, 1, 0), &topo(6, 2, 1, 0)).unwrap_err();
        assert_eq!(e.status(), Status::UnsupportedDcpTopology, "{e}");
    }
}
