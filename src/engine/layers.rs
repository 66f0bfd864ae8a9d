//! Sends ordered after the caller's compute, and layer-wise sends.
//!
//! - [`SendOptions`]: what `Engine::send_with` takes beyond a chunk: a CUDA
//!   event the worker's stream waits on before gathering device pools, a
//!   [`ReadyFlag`] the worker waits on before reading host pools, and a range
//!   of layers (topology entries) when a chunk is sent layer by layer.
//! - [`LayerChunk`]: a chunk whose layers are still arriving, on its room;
//!   the checks that make out-of-order, repeated and missing layers typed
//!   `layer_order` errors before any of them is queued.
//! - [`LayerPlan`]: a chunk's token plan toward every decode rank, made once
//!   by the worker at the chunk's first layers and reused for the others; each
//!   layer group is packed on its own (entry-major), so its writes stay long.

use super::device::DeviceStage;
use super::flight::Flight;
use super::handle::{lock, Inner};
use super::link::DecodeLink;
use super::room::KvPoll;
use super::staging::{gather_into_slot, pool_slices, sender_gathers, staging_slots};
use crate::error::{Error, Result, Status};
use crate::layout::{PackLayout, PairRequest, Run};
use crate::transport::{BatchOptions, WriteOp};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A host-memory completion flag: a `u64` the caller sets non-zero (with
/// release ordering) once the rows of a send are written. The transfer
/// worker waits for it before it reads the host pools; the caller never
/// blocks. For host pools, what a CUDA event is for device pools.
#[derive(Clone)]
pub struct ReadyFlag {
    addr: *const AtomicU64,
    _keep: Option<Arc<AtomicU64>>,
}

// SAFETY: the flag is only read atomically; `from_raw`'s caller keeps the
// address valid, `new` keeps its Arc.
unsafe impl Send for ReadyFlag {}
// SAFETY: as above (atomic loads only).
unsafe impl Sync for ReadyFlag {}

impl std::fmt::Debug for ReadyFlag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReadyFlag({:p}, set: {})", self.addr, self.is_set())
    }
}

impl ReadyFlag {
    /// A flag shared with the caller.
    pub fn new(flag: Arc<AtomicU64>) -> ReadyFlag {
        ReadyFlag {
            addr: Arc::as_ptr(&flag),
            _keep: Some(flag),
        }
    }

    /// A flag at a caller's address (the C ABI's `ready_flag`).
    ///
    /// # Safety
    /// `addr` must be an aligned `u64` that stays valid until the room is
    /// terminal (or cleared), written by the caller only atomically.
    pub unsafe fn from_raw(addr: *const AtomicU64) -> ReadyFlag {
        ReadyFlag { addr, _keep: None }
    }

    /// True once the caller set the flag non-zero.
    pub fn is_set(&self) -> bool {
        // SAFETY: `new` keeps the Arc alive; `from_raw`'s caller keeps the address valid.
        unsafe { &*self.addr }.load(Ordering::Acquire) != 0
    }
}

/// Options of one send beyond the chunk (`Engine::send_with`).
#[derive(Debug, Clone, Default)]
pub struct SendOptions {
    /// Device pools: a `CUevent` (raw handle) recorded after the kernels that
    /// wrote the rows; the worker's stream waits on it (`cuStreamWaitEvent`)
    /// before gathering, so the caller never synchronises. The event must not
    /// be destroyed before the room is terminal; re-recording it before the
    /// worker reached the send makes the send wait for the newer work.
    pub cuda_event: Option<u64>,
    /// Host pools (or either): the worker waits for this flag before it reads
    /// the rows of the send (polling; abort and deadlines still end the wait).
    /// The job holds its worker and its decode ranks meanwhile: other rooms
    /// to the same decode ranks queue behind it (until the flag is set, the
    /// room fails or its deadline passes).
    pub ready_flag: Option<ReadyFlag>,
    /// Layer-wise: the layers (topology entries, by position) whose rows this
    /// call sends. A chunk's layers come in order over many calls with the
    /// same `pages`, `num_tokens`, `last` and `aux_index`; the aux and state
    /// rows follow the last chunk's last layers. `None`: every layer at once.
    pub layers: Option<Range<u32>>,
}

impl SendOptions {
    /// The layers of the send among `entries` topology entries (every one
    /// when `layers` is `None`); an empty range or one past the entries is refused.
    pub(super) fn layer_range(&self, entries: usize) -> Result<Range<usize>> {
        let Some(l) = &self.layers else {
            return Ok(0..entries);
        };
        let (s, e) = (l.start as usize, l.end as usize);
        if s >= e || e > entries {
            return Err(Error::invalid(format!(
                "layers {}..{} are not a non-empty range inside the {entries} layers (topology entries)",
                l.start, l.end
            )));
        }
        Ok(s..e)
    }
}

/// What the worker waits for before it reads a send's rows.
#[derive(Debug, Clone, Default)]
pub(super) struct Ready {
    pub(super) cuda_event: Option<u64>,
    pub(super) flag: Option<ReadyFlag>,
}

/// A chunk sent layer by layer whose layers are still arriving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LayerChunk {
    pub(super) pages: Vec<u64>,
    pub(super) num_tokens: u64,
    pub(super) last: bool,
    pub(super) aux_index: u64,
    /// First sequence position of the chunk.
    pub(super) start: u64,
    /// The next layer expected.
    pub(super) next: usize,
}

fn layer_error(detail: String) -> Error {
    Error::new(Status::LayerOrder, detail)
}

/// Checks a send against the room's pending layer-wise chunk (before anything
/// changes): a whole-chunk send or another chunk while layers of one are
/// missing, a repeated layer and a skipped one are `layer_order` errors.
pub(super) fn check_next(
    room: u64,
    pending: &LayerChunk,
    layers: Option<&Range<usize>>,
    chunk: (&[u64], u64, bool, u64),
    entries: usize,
) -> Result<()> {
    let missing = format!(
        "layers {}..{entries} of the chunk at position {}",
        pending.next, pending.start
    );
    let Some(l) = layers else {
        return Err(layer_error(format!(
            "room {room}: {missing} were never sent; a whole-chunk send cannot follow"
        )));
    };
    let (pages, num_tokens, last, aux_index) = chunk;
    if pending.pages != pages
        || pending.num_tokens != num_tokens
        || pending.last != last
        || pending.aux_index != aux_index
    {
        return Err(layer_error(format!(
            "room {room}: {missing} were never sent before a send of other pages, num_tokens, last or aux_index (layers {}..{})",
            l.start, l.end
        )));
    }
    if l.start < pending.next {
        return Err(layer_error(format!(
            "room {room}: layers {}..{} repeat layer {} of the chunk at position {} (next expected: {})",
            l.start, l.end, l.start, pending.start, pending.next
        )));
    }
    if l.start > pending.next {
        return Err(layer_error(format!(
            "room {room}: layers {}..{} skip layers {}..{} of the chunk at position {}",
            l.start, l.end, pending.next, l.start, pending.start
        )));
    }
    Ok(())
}

/// The token plan of one chunk toward one decode rank, in three forms, none
/// of which depends on the layers: pool row to pool row (writes straight from
/// the pool), pool row to packed index (the gather into staging) and packed
/// index to pool row (the writes of the packed rows).
#[derive(Debug, Clone)]
pub(super) struct PairPlan {
    pub(super) tokens: u64,
    direct: Vec<Run>,
    gather: Vec<Run>,
    scatter: Vec<Run>,
}

impl PairPlan {
    pub(super) fn new(req: &PairRequest<'_>) -> Result<PairPlan> {
        Ok(PairPlan {
            tokens: req.token_count(),
            direct: req.runs(false)?,
            gather: crate::relayout::gather_spans(req)?,
            scatter: req.runs(true)?,
        })
    }
}

/// A chunk's plans toward every decode rank of its room (in `infos` order).
#[derive(Debug)]
pub(super) struct LayerPlan {
    /// First sequence position of the chunk (which chunk it plans).
    pub(super) start: u64,
    pub(super) pairs: Vec<PairPlan>,
}

/// The part of `runs` (sorted by their packed side, `src` when `by_src`, else
/// `dst`) inside packed indices `lo..hi`, rebased to start at `lo`.
pub(super) fn clip(runs: &[Run], lo: u64, hi: u64, by_src: bool) -> Vec<Run> {
    let key = |r: &Run| if by_src { r.src } else { r.dst };
    let first = runs.partition_point(|r| key(r) + r.len <= lo);
    let mut out = Vec::new();
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
        out.push(Run {
            src,
            dst,
            len: b - a,
        });
    }
    out
}

/// Waits for what a send's rows depend on: the device stream on the caller's
/// CUDA event (enqueued, not waited), the worker thread on the ready flag
/// (polled; ends when the room fails, is aborted or the engine closes).
pub(super) fn wait_ready(
    inner: &Inner,
    room: u64,
    attempt: u64,
    ready: &Ready,
    stage: Option<&mut DeviceStage>,
) -> Result<()> {
    if let Some(ev) = ready.cuda_event {
        let st = stage.ok_or_else(|| {
            Error::invalid(
                "a CUDA event orders sends from device pools; host pools take a ready flag",
            )
        })?;
        // SAFETY: the caller keeps the event alive until the room is terminal
        // (the contract of `SendOptions::cuda_event`), in the pools' context.
        unsafe { st.wait_event(ev) }?;
    }
    let Some(flag) = &ready.flag else {
        return Ok(());
    };
    let mut turns = 0u32;
    while !flag.is_set() {
        turns += 1;
        if turns.is_multiple_of(64) {
            if inner.closed.load(Ordering::Acquire) {
                return Err(Error::new(Status::EngineClosed, "engine is closed"));
            }
            let rooms = lock(&inner.rooms);
            let live = rooms
                .get(room)
                .is_ok_and(|r| r.attempt == attempt && r.poll != KvPoll::Failed && !r.aborted);
            if !live {
                return Err(Error::new(
                    Status::RoomFailed,
                    format!("room {room} ended while its send waited for the ready flag"),
                ));
            }
        }
        if turns < 256 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
    Ok(())
}

/// The writes of one layer group's rows straight from the pools.
fn direct_ops(
    inner: &Inner,
    plan: &PairPlan,
    layers: &Range<usize>,
    row_bytes: &[u64],
    dst_regions: &[u64],
) -> Vec<WriteOp> {
    let mut ops = Vec::with_capacity(plan.direct.len() * layers.len());
    for e in layers.clone() {
        let rb = row_bytes[e];
        for r in &plan.direct {
            ops.push(WriteOp {
                local_region: inner.pool_regions[e].id,
                local_offset: r.src * rb,
                remote_region: dst_regions[e],
                remote_offset: r.dst * rb,
                len: r.len * rb,
            });
        }
    }
    ops
}

/// The writes of packed rows `lo..hi` of a layer group (entry-major at
/// `entry_offsets`, relative to the group, from `offset` in `region`).
fn packed_ops(
    plan: &PairPlan,
    (lo, hi): (u64, u64),
    layers: &Range<usize>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    (region, offset): (u64, u64),
    entry_offsets: &[u64],
) -> Vec<WriteOp> {
    let runs = clip(&plan.scatter, lo, hi, true);
    let mut ops = Vec::with_capacity(runs.len() * layers.len());
    for (i, e) in layers.clone().enumerate() {
        let rb = row_bytes[e];
        for r in &runs {
            ops.push(WriteOp {
                local_region: region,
                local_offset: offset + entry_offsets[i] + r.src * rb,
                remote_region: dst_regions[e],
                remote_offset: r.dst * rb,
                len: r.len * rb,
            });
        }
    }
    ops
}

/// Submits one layer group of one pair into `flight` from host pools: packed
/// through the worker's host staging (the group's rows entry-major, slice by
/// slice) when that makes fewer writes, else straight from the pools.
/// Returns the bytes of the group.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_group(
    inner: &Inner,
    idx: usize,
    plan: &PairPlan,
    layers: &Range<usize>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    link: &Arc<DecodeLink>,
    flight: &mut Flight<'_>,
) -> Result<u64> {
    let rb = &row_bytes[layers.clone()];
    let token_bytes: u64 = rb.iter().sum();
    if plan.tokens == 0 {
        return Ok(0);
    }
    let staging = inner.staging.get(idx);
    let (slots, slot_bytes) = staging_slots(staging, token_bytes);
    let cap = slot_bytes / token_bytes.max(1);
    // over tcp the sender gathers each destination run itself (sender_gathers)
    let (Some((buf, desc)), true) = (
        staging,
        cap > 0 && plan.scatter.len() * 2 <= plan.direct.len() && !sender_gathers(link),
    ) else {
        let ops = direct_ops(inner, plan, layers, row_bytes, dst_regions);
        flight.submit(link, &ops, None)?;
        return Ok(plan.tokens * token_bytes);
    };
    let pools = pool_slices(inner, layers.clone());
    let mut lo = 0;
    while lo < plan.tokens {
        let hi = (lo + cap).min(plan.tokens);
        let pack = PackLayout::new(hi - lo, rb)?;
        let spans = clip(&plan.gather, lo, hi, false);
        // the pack holds `cap` tokens of the group at most: one slot
        let (slot, offset) = gather_into_slot(
            inner,
            flight,
            (buf, slots, slot_bytes),
            &pools,
            rb,
            &spans,
            &pack,
        )?;
        let ops = packed_ops(
            plan,
            (lo, hi),
            layers,
            row_bytes,
            dst_regions,
            (desc.id, offset),
            &pack.entry_offsets,
        );
        flight.submit(link, &ops, Some(slot))?;
        lo = hi;
    }
    Ok(plan.tokens * token_bytes)
}

/// [`write_group`] from device pools: the group's rows gathered on the GPU
/// slice by slice into the worker's device staging and written from there
/// (zero copy) or from its pinned host copy, as `write_pair_device` does for
/// whole chunks (with its fallback when the NIC refuses device memory).
#[allow(clippy::too_many_arguments)]
pub(super) fn write_group_device(
    inner: &Inner,
    stage: &mut DeviceStage,
    plan: &PairPlan,
    layers: &Range<usize>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    link: &Arc<DecodeLink>,
    opts: &BatchOptions,
) -> Result<u64> {
    let rb = &row_bytes[layers.clone()];
    let token_bytes: u64 = rb.iter().sum();
    if plan.tokens == 0 {
        return Ok(0);
    }
    let opts = BatchOptions {
        checksum: false,
        ..*opts
    };
    let cap = stage.slice_tokens(rb).max(1);
    let bounds: Vec<(u64, u64)> = (0..plan.tokens)
        .step_by(cap as usize)
        .map(|lo| (lo, (lo + cap).min(plan.tokens)))
        .collect();
    let spans: Vec<Vec<Run>> = bounds
        .iter()
        .map(|&(lo, hi)| clip(&plan.gather, lo, hi, false))
        .collect();
    let bases: Vec<u64> = inner.pool_regions[layers.clone()]
        .iter()
        .map(|r| r.addr)
        .collect();
    let run = |stage: &mut DeviceStage, zero_copy: bool| {
        // SAFETY: the pools were checked as device memory of the stage's device
        // at creation and stay valid for the engine's life (Engine::new
        // contract); the plan's rows lie inside them (page ids checked by `send`).
        unsafe {
            stage.run(&bases, rb, &spans, zero_copy, |s| {
                let ops = packed_ops(
                    plan,
                    bounds[s.index],
                    layers,
                    row_bytes,
                    dst_regions,
                    (s.region, s.offset),
                    &s.entry_offsets,
                );
                // each slice completes before its staging half is gathered into again
                let mut f = Flight::new(&inner.rooms, opts);
                f.submit(link, &ops, None)?;
                f.drain()
            })
        }
    };
    let zero_copy = link.zero_copy.load(Ordering::Acquire);
    match run(stage, zero_copy) {
        Err(e) if zero_copy && e.status() == Status::NoGpuDirect => {
            run(stage, false)?;
            if link.zero_copy.swap(false, Ordering::AcqRel) {
                inner.log_no_gpu_direct(&e);
            }
        }
        r => r?,
    }
    Ok(plan.tokens * token_bytes)
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

    fn chunk() -> LayerChunk {
        LayerChunk {
            pages: vec![3, 4],
            num_tokens: 32,
            last: false,
            aux_index: 0,
            start: 64,
            next: 2,
        }
    }

    #[test]
    fn layer_order_errors() {
        let c = chunk();
        let same = (&[3u64, 4][..], 32, false, 0);
        assert!(check_next(1, &c, Some(&(2..4)), same, 4).is_ok());
        for (layers, what) in [
            (Some(1..3), "repeat layer 1"),
            (Some(3..4), "skip layers 2..3"),
            (None, "whole-chunk send"),
        ] {
            let e = check_next(1, &c, layers.as_ref(), same, 4).unwrap_err();
            assert_eq!(e.status(), Status::LayerOrder, "{e}");
            assert!(e.detail().contains(what), "{e}");
        }
        let other = (&[5u64, 6][..], 32, false, 0);
        let e = check_next(1, &c, Some(&(0..2)), other, 4).unwrap_err();
        assert_eq!(e.status(), Status::LayerOrder);
        assert!(e.detail().contains("layers 2..4"), "{e}");
        let o = SendOptions {
            layers: Some(3..3),
            ..Default::default()
        };
        assert_eq!(
            o.layer_range(4).unwrap_err().status(),
            Status::InvalidArgument
        );
        let o = SendOptions {
            layers: Some(2..5),
            ..Default::default()
        };
        assert!(o.layer_range(4).is_err());
        assert_eq!(SendOptions::default().layer_range(4).unwrap(), 0..4);
    }

    #[test]
    fn ready_flag_reads_the_shared_word() {
        let w = Arc::new(AtomicU64::new(0));
        let f = ReadyFlag::new(w.clone());
        assert!(!f.is_set());
        w.store(7, Ordering::Release);
        assert!(f.is_set());
    }
}
