//! The plan of one NCCL pair: the ordered, grouped sends (sender) or recvs
//! (receiver) both sides compute from the same pair request, and the digest
//! that proves they mirror each other before anything is posted.

use super::NcclRole;
use crate::error::{Error, Result, Status};
use crate::layout::{byte_ops, PackLayout, PairRequest};
use std::ops::Range;

/// How a pair's bytes travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclMode {
    /// One send/recv per (entry, run): receiver writes its pool rows directly.
    Direct,
    /// The pack in chunks into a receiver staging buffer, then a scatter.
    Staged,
}

/// Knobs both sides must agree on (they are part of the digest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclPlanOptions {
    /// Direct mode while the pair has at most this many (entry, run) ops...
    pub max_direct_ops: usize,
    /// ...and its average op is at least this many bytes (NCCL runs a peer's
    /// ops of a group one after another, each with its own overhead, and
    /// small ones on the LL/LL128 protocols: many small ops move far slower
    /// than a few large staged chunks).
    pub min_direct_op_bytes: u64,
    /// Staged mode chunk size in bytes.
    pub chunk_bytes: u64,
    /// At most this many ops between one ncclGroupStart/End.
    pub max_group_ops: usize,
    /// At most this many bytes per group (a single larger op gets its own group).
    pub max_group_bytes: u64,
}

impl Default for NcclPlanOptions {
    fn default() -> Self {
        NcclPlanOptions {
            max_direct_ops: 1024,
            min_direct_op_bytes: 1 << 20,
            chunk_bytes: 64 << 20,
            max_group_ops: 256,
            max_group_bytes: 1 << 30,
        }
    }
}

/// Target of an op's bytes on this side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclBuffer {
    /// The side's staging (pack) buffer.
    Staging,
    /// Pool entry (layer) `e` of the receiver.
    Entry(u32),
}

/// One send (sender) or recv (receiver) of `len` bytes at `offset` of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclOp {
    /// Which buffer.
    pub buffer: NcclBuffer,
    /// Byte offset from that buffer's base.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The ordered, grouped operations of one side of a pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclPlan {
    /// This side's role.
    pub role: NcclRole,
    /// Chosen mode (the same on both sides).
    pub mode: NcclMode,
    /// Packed layout of the pair's tokens (sender staging, and the receiver's in Staged mode).
    pub pack: PackLayout,
    /// Operations in posting order.
    pub ops: Vec<NcclOp>,
    /// Index ranges of `ops`, one ncclGroupStart/End each.
    pub groups: Vec<Range<usize>>,
    /// Role-independent summary of the wire traffic (see [`check_mirror`]).
    pub digest: u64,
}

impl NcclPlan {
    /// Builds one side's plan. Both sides get the same mode, lengths, groups
    /// and digest from the same inputs.
    pub fn build(
        req: &PairRequest<'_>,
        row_bytes: &[u64],
        role: NcclRole,
        opts: &NcclPlanOptions,
    ) -> Result<NcclPlan> {
        if opts.chunk_bytes == 0 || opts.max_group_ops == 0 {
            return Err(Error::invalid(
                "NCCL plan options: chunk_bytes and max_group_ops must be >= 1",
            ));
        }
        let runs = req.runs(true)?;
        let pack = PackLayout::new(req.token_count(), row_bytes)?;
        let direct = byte_ops(&runs, row_bytes, Some(&pack));
        let direct: Vec<_> = direct.into_iter().filter(|o| o.len > 0).collect();
        let bytes: u64 = direct.iter().map(|o| o.len).sum();
        let average = bytes / (direct.len().max(1) as u64);
        let mode = if direct.len() <= opts.max_direct_ops && average >= opts.min_direct_op_bytes {
            NcclMode::Direct
        } else {
            NcclMode::Staged
        };
        let ops: Vec<NcclOp> = match mode {
            NcclMode::Direct => direct
                .iter()
                .map(|o| match role {
                    NcclRole::Sender => NcclOp {
                        buffer: NcclBuffer::Staging,
                        offset: o.src_offset,
                        len: o.len,
                    },
                    NcclRole::Receiver => NcclOp {
                        buffer: NcclBuffer::Entry(o.entry),
                        offset: o.dst_offset,
                        len: o.len,
                    },
                })
                .collect(),
            NcclMode::Staged => (0..pack.total_bytes.div_ceil(opts.chunk_bytes))
                .map(|k| {
                    let off = k * opts.chunk_bytes;
                    NcclOp {
                        buffer: NcclBuffer::Staging,
                        offset: off,
                        len: opts.chunk_bytes.min(pack.total_bytes - off),
                    }
                })
                .collect(),
        };
        let groups = group_ops(&ops, opts);
        let mut pair = vec![req.start, req.num_tokens, req.src.rank, req.dst.rank];
        for l in [&req.src.layout, &req.dst.layout] {
            pair.extend([l.page_size, l.dcp_size, l.interleave]);
        }
        pair.extend(row_bytes);
        let digest = digest(&pair, mode, &ops, &groups, opts);
        Ok(NcclPlan {
            role,
            mode,
            pack,
            ops,
            groups,
            digest,
        })
    }

    /// Bytes on the wire.
    pub fn total_bytes(&self) -> u64 {
        self.ops.iter().map(|o| o.len).sum()
    }

    /// True when the receiver must scatter its staging buffer afterwards.
    pub fn needs_scatter(&self) -> bool {
        self.role == NcclRole::Receiver && self.mode == NcclMode::Staged
    }
}

/// Splits `ops` into groups of at most `max_group_ops` ops and
/// `max_group_bytes` bytes (an op larger than that is a group of its own).
pub fn group_ops(ops: &[NcclOp], opts: &NcclPlanOptions) -> Vec<Range<usize>> {
    let mut groups = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (i, op) in ops.iter().enumerate() {
        let full = i - start >= opts.max_group_ops.max(1)
            || (i > start && bytes.saturating_add(op.len) > opts.max_group_bytes);
        if full {
            groups.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes = bytes.saturating_add(op.len);
    }
    if start < ops.len() {
        groups.push(start..ops.len());
    }
    groups
}

/// FNV-1a over what both sides must agree on: the pair (token range, ranks,
/// layouts, row bytes), mode, options, every op's length and the group
/// boundaries (not offsets or page ids, which are side-local).
fn digest(
    pair: &[u64],
    mode: NcclMode,
    ops: &[NcclOp],
    groups: &[Range<usize>],
    o: &NcclPlanOptions,
) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: u64| {
        for b in v.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(pair.len() as u64);
    for &v in pair {
        eat(v);
    }
    eat(mode as u64);
    eat(o.max_direct_ops as u64);
    eat(o.min_direct_op_bytes);
    eat(o.chunk_bytes);
    eat(o.max_group_ops as u64);
    eat(o.max_group_bytes);
    eat(ops.len() as u64);
    for op in ops {
        eat(op.len);
    }
    for g in groups {
        eat(g.end as u64);
    }
    h
}

/// Refuses to post when the peer's plan digest differs from ours.
pub fn check_mirror(local: &NcclPlan, remote_digest: u64) -> Result<()> {
    if local.digest == remote_digest {
        return Ok(());
    }
    Err(Error::new(
        Status::NcclPlanMismatch,
        format!(
            "NCCL {:?} plan digest {:#018x} differs from the peer's {:#018x} ({:?} mode, {} ops, {} B here): the two sides computed different plans (different pair request, KV geometry or NCCL plan options); nothing was posted",
            local.role,
            local.digest,
            remote_digest,
            local.mode,
            local.ops.len(),
            local.total_bytes()
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DcpLayout, SglangChunk, Side};

    fn worked_example(rank: u64) -> (Vec<u64>, Vec<u64>, u64) {
        (vec![7, 3, 12, 5, 20], vec![40, 9], rank)
    }

    fn chunk<'a>(s: &'a [u64], d: &'a [u64], r: u64) -> PairRequest<'a> {
        SglangChunk {
            src_pages: s,
            dst_pages: d,
            page_size: 64,
            dcp_size: 4,
            dcp_rank: r,
            src_page_offset: 0,
            decode_prefix_len: 0,
            num_tokens: Some(300),
        }
        .to_pair()
        .unwrap()
    }

    #[test]
    fn sender_and_receiver_mirror_the_worked_example() {
        let (s, d, r) = worked_example(1);
        let req = chunk(&s, &d, r);
        let rows = vec![1152u64; 61];
        // ops of 43 KB on average: Direct only with the size floor off
        let o = NcclPlanOptions {
            min_direct_op_bytes: 0,
            ..Default::default()
        };
        let tx = NcclPlan::build(&req, &rows, NcclRole::Sender, &o).unwrap();
        let rx = NcclPlan::build(&req, &rows, NcclRole::Receiver, &o).unwrap();
        assert_eq!(tx.mode, NcclMode::Direct);
        assert_eq!(tx.ops.len(), 122, "2 runs x 61 layers (reference 4.5)");
        assert_eq!(tx.digest, rx.digest);
        assert_eq!(tx.groups, rx.groups);
        let lens = |p: &NcclPlan| p.ops.iter().map(|o| o.len).collect::<Vec<_>>();
        assert_eq!(lens(&tx), lens(&rx));
        assert_eq!(tx.total_bytes(), 5_270_400);
        assert_eq!(
            (tx.ops[0], rx.ops[0]),
            (
                NcclOp {
                    buffer: NcclBuffer::Staging,
                    offset: 0,
                    len: 73_728
                },
                NcclOp {
                    buffer: NcclBuffer::Entry(0),
                    offset: 2_949_120,
                    len: 73_728
                }
            )
        );
        assert_eq!(rx.ops[3].buffer, NcclBuffer::Entry(1));
        assert!(!rx.needs_scatter());
        check_mirror(&rx, tx.digest).unwrap();
    }

    /// By default Direct only where the average op is at least 1 MiB: the
    /// worked example's 122 ops of 43 KB go Staged, the same runs with rows
    /// of 64 KiB (ops of 2.4 MiB) go Direct; both sides agree either way.
    #[test]
    fn small_ops_go_staged_by_default() {
        let (s, d, r) = worked_example(1);
        let req = chunk(&s, &d, r);
        let o = NcclPlanOptions::default();
        let small = NcclPlan::build(&req, &[1152; 61], NcclRole::Sender, &o).unwrap();
        assert_eq!(small.mode, NcclMode::Staged);
        assert_eq!(small.ops.len(), 1, "5,270,400 B in one 64 MiB chunk");
        let large = NcclPlan::build(&req, &[64 << 10; 61], NcclRole::Sender, &o).unwrap();
        let large_rx = NcclPlan::build(&req, &[64 << 10; 61], NcclRole::Receiver, &o).unwrap();
        assert_eq!(large.mode, NcclMode::Direct);
        assert_eq!(large.ops.len(), 122);
        assert!(large.total_bytes() / 122 >= 1 << 20);
        check_mirror(&large_rx, large.digest).unwrap();
        // the floor is part of the digest: sides with different floors refuse
        let other = NcclPlanOptions {
            min_direct_op_bytes: 1,
            ..o
        };
        let rx = NcclPlan::build(&req, &[64 << 10; 61], NcclRole::Receiver, &other).unwrap();
        assert_eq!(rx.mode, NcclMode::Direct);
        assert!(check_mirror(&rx, large.digest).is_err());
    }

    #[test]
    fn many_ops_switch_to_staged_chunks() {
        let (s, d, r) = worked_example(2);
        let req = chunk(&s, &d, r);
        let rows = vec![1152u64; 61];
        let o = NcclPlanOptions {
            max_direct_ops: 100,
            chunk_bytes: 1 << 20,
            ..Default::default()
        };
        let tx = NcclPlan::build(&req, &rows, NcclRole::Sender, &o).unwrap();
        let rx = NcclPlan::build(&req, &rows, NcclRole::Receiver, &o).unwrap();
        assert_eq!(tx.mode, NcclMode::Staged);
        assert!(rx.needs_scatter() && !tx.needs_scatter());
        assert_eq!(
            tx.ops, rx.ops,
            "staged ops are staging-to-staging on both sides"
        );
        assert_eq!(tx.ops.len(), 6); // 5,270,400 B in 1 MiB chunks
        assert_eq!(tx.ops[5].len, 5_270_400 - 5 * (1 << 20));
        assert_eq!(tx.total_bytes(), tx.pack.total_bytes);
    }

    #[test]
    fn random_pairs_mirror() {
        // General layouts (interleave, DCP on both sides): lengths and groups agree,
        // and the receiver's direct ops cover exactly its destination rows.
        let mut seed = 12345u64;
        let mut next = move |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..200 {
            let ps = [1u64, 2, 4, 8][next(4) as usize];
            let pd = [1u64, 2, 4, 8][next(4) as usize];
            let ws = 1 + next(3);
            let wd = 1 + next(4);
            let src = DcpLayout::new(ps, ws, 1).unwrap();
            let dst =
                DcpLayout::new(pd, wd, if pd.is_multiple_of(2) { 1 + next(2) } else { 1 }).unwrap();
            let n = 1 + next(200);
            let spages: Vec<u64> = (0..n.div_ceil(ps * ws) + 1).map(|i| i * 3 + 1).collect();
            let dpages: Vec<u64> = (0..n.div_ceil(pd * wd) + 1).map(|i| i * 5 + 2).collect();
            let req = PairRequest {
                src: Side {
                    layout: src,
                    rank: next(ws),
                    pages: &spages,
                    origin: 0,
                },
                dst: Side {
                    layout: dst,
                    rank: next(wd),
                    pages: &dpages,
                    origin: 0,
                },
                start: 0,
                num_tokens: n,
            };
            if req.validate().is_err() {
                continue;
            }
            let rows: Vec<u64> = (0..1 + next(4)).map(|_| 1 + next(100)).collect();
            let o = NcclPlanOptions {
                max_direct_ops: next(2000) as usize,
                min_direct_op_bytes: next(3) * 100,
                chunk_bytes: 1 + next(5000),
                max_group_ops: 1 + next(50) as usize,
                max_group_bytes: 1 + next(20_000),
            };
            let tx = NcclPlan::build(&req, &rows, NcclRole::Sender, &o).unwrap();
            let rx = NcclPlan::build(&req, &rows, NcclRole::Receiver, &o).unwrap();
            assert_eq!(tx.digest, rx.digest);
            assert_eq!(tx.groups, rx.groups);
            assert!(tx.ops.iter().zip(&rx.ops).all(|(a, b)| a.len == b.len));
            assert_eq!(tx.total_bytes(), tx.pack.total_bytes);
            for g in &tx.groups {
                assert!(!g.is_empty() && g.len() <= o.max_group_ops);
                let b: u64 = tx.ops[g.clone()].iter().map(|x| x.len).sum();
                assert!(g.len() == 1 || b <= o.max_group_bytes);
            }
            if rx.mode == NcclMode::Direct {
                // every destination row byte of every entry exactly once
                let plan = req.plan().unwrap();
                for (e, &rb) in rows.iter().enumerate() {
                    let mut want: Vec<u64> = plan.dst_rows.iter().map(|r| r * rb).collect();
                    let mut got: Vec<u64> = rx
                        .ops
                        .iter()
                        .filter(|op| op.buffer == NcclBuffer::Entry(e as u32))
                        .flat_map(|op| (0..op.len / rb).map(move |k| op.offset + k * rb))
                        .collect();
                    want.sort_unstable();
                    got.sort_unstable();
                    assert_eq!(got, want);
                }
            }
        }
    }

    #[test]
    fn mismatched_plans_are_refused() {
        let (s, d, r) = worked_example(1);
        let req = chunk(&s, &d, r);
        let o = NcclPlanOptions::default();
        let tx = NcclPlan::build(&req, &[1152; 61], NcclRole::Sender, &o).unwrap();
        // receiver with other geometry, other options, other rank
        let rx1 = NcclPlan::build(&req, &[576; 61], NcclRole::Receiver, &o).unwrap();
        let o2 = NcclPlanOptions {
            max_group_ops: 7,
            ..o
        };
        let rx2 = NcclPlan::build(&req, &[1152; 61], NcclRole::Receiver, &o2).unwrap();
        let req3 = chunk(&s, &d, 0);
        let rx3 = NcclPlan::build(&req3, &[1152; 61], NcclRole::Receiver, &o).unwrap();
        for rx in [rx1, rx2, rx3] {
            let e = check_mirror(&rx, tx.digest).unwrap_err();
            assert_eq!(e.status(), Status::NcclPlanMismatch);
            assert!(e.detail().contains("nothing was posted"), "{e}");
        }
        let bad = NcclPlanOptions {
            chunk_bytes: 0,
            ..o
        };
        assert!(NcclPlan::build(&req, &[1], NcclRole::Sender, &bad).is_err());
    }

    #[test]
    fn grouping_limits() {
        let op = |len| NcclOp {
            buffer: NcclBuffer::Staging,
            offset: 0,
            len,
        };
        let ops = [op(10), op(10), op(100), op(5), op(5), op(5)];
        let o = NcclPlanOptions {
            max_group_ops: 2,
            max_group_bytes: 25,
            ..Default::default()
        };
        assert_eq!(group_ops(&ops, &o), vec![0..2, 2..3, 3..5, 5..6]);
        assert!(group_ops(&[], &o).is_empty());
    }
}
