//! How a pair's rows reach a decode rank: one [`WritePath`] per data
//! connection of a decode link, chosen when the connection is set up
//! (every input is known then: the engine's pools and transport, the
//! connection's kind and the decode pools it has mapped here), and read by
//! each chunk. A chunk's pair is written through it as a range of layers
//! (topology entries): a whole-chunk send is the range `0..n`, a layer-wise
//! send the layers of the call.
//!
//! - [`staged`]: host pools; rows written straight from the pools, or
//!   gathered on the CPU into the worker's host staging when that makes
//!   fewer writes (never over tcp or cma, whose senders gather themselves).
//! - [`direct`]: the one-copy path (host pools, the decode's pools mapped
//!   here: cma with shared pools).
//! - [`device`]: device pools, gathered on the GPU into the worker's device
//!   staging and written from there (GPUDirect RDMA) or from its pinned copy.
//! - [`nccl`]: transport nccl (whole chunks over the link's communicator).
//!
//! `spread` is the one-copy path's copy crew (a pair split by destination
//! over helper threads). `chunk` holds what a worker writes one chunk with (`Chunk`, `Pair`),
//! `write` the dispatch of [`WritePath::write`] to the path's file.

pub(super) mod chunk;
mod device;
mod direct;
pub(super) mod nccl;
pub(in crate::engine) mod spread;
pub(super) mod staged;
mod write;
#[cfg(test)]
mod write_tests;

use super::control::RegionMap;
use super::state::Shared;
use crate::bootstrap::schema::InstanceId;
use crate::error::Result;
use crate::layout::{PairRequest, Run};
use crate::transport::{MappedRegion, Transport, TransportKind};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// The way a link's rows move, for the life of one data connection.
pub(super) enum WritePath {
    /// Host pools: straight from the pools, or packed through the worker's
    /// host staging when that makes fewer writes. `sender_gathers`: the
    /// connection's sender gathers scattered sources itself (tcp sends
    /// consecutive writes whose destinations follow each other as one piece,
    /// its payload gathered by the kernel; cma hands `process_vm_writev` the
    /// scattered rows as its local iovecs and their destination run as one
    /// remote iovec), so rows go straight from the pools (each entry's runs
    /// in order) and packing would only add a copy.
    Staged { sender_gathers: bool },
    /// One copy: every decode pool of the pair is mapped here (cma, decode
    /// pools in shared memory), one mapping per topology entry.
    Direct { maps: Vec<MappedRegion> },
    /// Device pools: slices written from the device staging (`gpu_direct`:
    /// rdma with GPUDirect RDMA; cleared for good when the NIC refuses
    /// device memory) or from its pinned host copy.
    Device { gpu_direct: AtomicBool },
    /// Transport nccl: the KV over the link's NCCL communicator.
    Nccl,
}

/// A link's data connection and the path its rows take over it.
#[derive(Clone)]
pub(super) struct Conn {
    pub(super) data: Arc<dyn Transport>,
    pub(super) path: Arc<WritePath>,
}

impl Conn {
    /// The connection `data` to decode `peer` (whose regions are `regions`)
    /// with its path chosen; `gpu_direct` is false once an earlier
    /// connection of the link found that the NIC refuses device memory.
    pub(super) fn new(
        inner: &Shared,
        data: Arc<dyn Transport>,
        regions: &RegionMap,
        peer: InstanceId,
        gpu_direct: bool,
    ) -> Conn {
        // the decode's KV region of each topology entry, where it named them all
        let kv: Option<Vec<u64>> = inner
            .cfg
            .topology
            .entries
            .iter()
            .map(|e| regions.kv_region(e.layer_id))
            .collect();
        let path = WritePath::choose(inner, &*data, kv.as_deref(), peer, gpu_direct);
        log::debug!(
            "engine: decode {peer} over {}: the {} write path",
            data.kind().name(),
            path.name()
        );
        Conn {
            data,
            path: Arc::new(path),
        }
    }
}

impl WritePath {
    fn choose(
        inner: &Shared,
        data: &dyn Transport,
        kv_regions: Option<&[u64]>,
        peer: InstanceId,
        gpu_direct: bool,
    ) -> WritePath {
        let cfg = &inner.cfg;
        if cfg.pool_device.is_some() {
            if cfg.transport == TransportKind::Nccl {
                return WritePath::Nccl;
            }
            let gpu_direct = gpu_direct && inner.zero_copy_for(data, peer);
            return WritePath::Device {
                gpu_direct: AtomicBool::new(gpu_direct),
            };
        }
        if cfg.one_copy {
            let maps = kv_regions.and_then(|rs| {
                rs.iter()
                    .map(|&r| data.mapped_dst(r))
                    .collect::<Option<Vec<MappedRegion>>>()
            });
            if let Some(maps) = maps.filter(|m| m.len() == inner.pool_regions.len()) {
                return WritePath::Direct { maps };
            }
        }
        WritePath::Staged {
            sender_gathers: matches!(data.kind(), TransportKind::Tcp | TransportKind::Cma),
        }
    }

    /// The path's name, for log lines.
    pub(super) fn name(&self) -> &'static str {
        match self {
            WritePath::Staged {
                sender_gathers: true,
            } => "pool (the sender gathers)",
            WritePath::Staged { .. } => "staged",
            WritePath::Direct { .. } => "one-copy",
            WritePath::Device { gpu_direct } if gpu_direct.load(Ordering::Acquire) => {
                "device (GPUDirect RDMA)"
            }
            WritePath::Device { .. } => "device (pinned host staging)",
            WritePath::Nccl => "nccl",
        }
    }

    /// Whether slices go from device memory (GPUDirect RDMA); `true` for
    /// a path without device pools, which never asks.
    pub(super) fn gpu_direct(&self) -> bool {
        match self {
            WritePath::Device { gpu_direct } => gpu_direct.load(Ordering::Acquire),
            _ => true,
        }
    }
}

/// The token plan of one chunk toward one decode rank, in three forms, none
/// of which depends on the layers: pool row to pool row (writes straight from
/// the pool), pool row to packed index (the gather into staging) and packed
/// index to pool row (the writes of the packed rows). Each form is made from
/// the chunk's request the first time a path asks for it, and kept (a
/// layer-wise chunk's plan serves all of its layer groups).
#[derive(Debug, Clone)]
pub(super) struct PairPlan {
    pub(super) tokens: u64,
    direct: OnceLock<Vec<Run>>,
    gather: OnceLock<Vec<Run>>,
    scatter: OnceLock<Vec<Run>>,
}

/// `cell`'s runs, made by `make` the first time.
fn runs(cell: &OnceLock<Vec<Run>>, make: impl FnOnce() -> Result<Vec<Run>>) -> Result<&[Run]> {
    if let Some(r) = cell.get() {
        return Ok(r);
    }
    let r = make()?;
    Ok(cell.get_or_init(|| r))
}

impl PairPlan {
    pub(super) fn new(req: &PairRequest<'_>) -> PairPlan {
        PairPlan {
            tokens: req.token_count(),
            direct: OnceLock::new(),
            gather: OnceLock::new(),
            scatter: OnceLock::new(),
        }
    }

    /// Pool row to pool row runs (`req`: the request the plan was made from).
    pub(super) fn direct(&self, req: &PairRequest<'_>) -> Result<&[Run]> {
        runs(&self.direct, || req.runs(false))
    }

    /// Pool row to packed index runs (the gather into staging).
    pub(super) fn gather(&self, req: &PairRequest<'_>) -> Result<&[Run]> {
        runs(&self.gather, || crate::relayout::gather_spans(req))
    }

    /// Packed index to pool row runs (the writes of packed rows).
    pub(super) fn scatter(&self, req: &PairRequest<'_>) -> Result<&[Run]> {
        runs(&self.scatter, || req.runs(true))
    }
}

/// The part of `runs` (sorted by their packed side, `src` when `by_src`, else
/// `dst`) inside packed indices `lo..hi`, rebased to start at `lo`.
pub(super) fn clip(runs: &[Run], lo: u64, hi: u64, by_src: bool) -> Vec<Run> {
    let mut out = Vec::new();
    clip_each(runs, lo, hi, by_src, |r| out.push(r));
    out
}

/// [`clip`] without allocating: calls `f` for each clipped run, in order.
fn clip_each(runs: &[Run], lo: u64, hi: u64, by_src: bool, mut f: impl FnMut(Run)) {
    let key = |r: &Run| if by_src { r.src } else { r.dst };
    let first = runs.partition_point(|r| key(r) + r.len <= lo);
    for r in &runs[first..] {
        let k = key(r);
        if k >= hi {
            break;
        }
        let a = k.max(lo);
        let b = (k + r.len).min(hi);
        let skip = a - k;
        let (src, dst) = if by_src {
            (a - lo, r.dst + skip)
        } else {
            (r.src + skip, a - lo)
        };
        f(Run {
            src,
            dst,
            len: b - a,
        });
    }
}

/// The writes of packed rows `lo..hi` of a layer group (entry-major at
/// `entry_offsets`, relative to the group, from `offset` in `region`).
pub(super) fn packed_ops(
    scatter: &[Run],
    (lo, hi): (u64, u64),
    layers: &Range<usize>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    (region, offset): (u64, u64),
    entry_offsets: &[u64],
) -> Vec<crate::transport::WriteOp> {
    let mut runs = 0;
    clip_each(scatter, lo, hi, true, |_| runs += 1);
    let mut ops = Vec::with_capacity(runs * layers.len());
    for (i, e) in layers.clone().enumerate() {
        let rb = row_bytes[e];
        clip_each(scatter, lo, hi, true, |r| {
            ops.push(crate::transport::WriteOp {
                local_region: region,
                local_offset: offset + entry_offsets[i] + r.src * rb,
                remote_region: dst_regions[e],
                remote_offset: r.dst * rb,
                len: r.len * rb,
            })
        });
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(src: u64, dst: u64, len: u64) -> Run {
        Run { src, dst, len }
    }

    #[test]
    fn clip_cuts_runs_at_packed_bounds() {
        // packed index on dst (a gather): pool rows 100.., 40.., 7..
        let g = [run(100, 0, 4), run(40, 4, 3), run(7, 7, 5)];
        assert_eq!(clip(&g, 0, 12, false), g.to_vec());
        assert_eq!(
            clip(&g, 2, 9, false),
            vec![run(102, 0, 2), run(40, 2, 3), run(7, 5, 2)]
        );
        assert_eq!(clip(&g, 5, 6, false), vec![run(41, 0, 1)]);
        assert!(clip(&g, 12, 20, false).is_empty());
        // packed index on src (the writes of packed rows)
        let s = [run(0, 30, 6), run(6, 90, 2)];
        assert_eq!(clip(&s, 4, 8, true), vec![run(0, 34, 2), run(2, 90, 2)]);
        assert_eq!(clip(&s, 6, 7, true), vec![run(0, 90, 1)]);
    }

    #[test]
    fn clipped_slices_cover_every_row_once() {
        let g = [run(100, 0, 4), run(40, 4, 3), run(7, 7, 5)];
        for cap in 1..13 {
            let mut rows = Vec::new();
            let mut lo = 0;
            while lo < 12 {
                let hi = (lo + cap).min(12);
                for r in clip(&g, lo, hi, false) {
                    assert!(r.dst + r.len <= hi - lo);
                    rows.extend((0..r.len).map(|i| (r.src + i, lo + r.dst + i)));
                }
                lo = hi;
            }
            let want: Vec<_> = g
                .iter()
                .flat_map(|r| (0..r.len).map(move |i| (r.src + i, r.dst + i)))
                .collect();
            assert_eq!(rows, want, "cap {cap}");
        }
    }
}
