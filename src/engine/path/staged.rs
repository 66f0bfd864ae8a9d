//! The host staging path of a prefill worker: a pair's rows written
//! straight from the pools, or gathered on the CPU into the worker's
//! registered staging buffer slice by slice and written from there. Over
//! tcp and cma the rows always go straight from the pools: their sender
//! gathers the scattered rows of a destination run itself (tcp: one piece,
//! one `writev`; cma: one `process_vm_writev` whose local iovecs are the
//! rows and whose remote iovec is the run), so packing them first would
//! only add a copy.

use super::chunk::{Chunk, Pair};
use super::{clip, packed_ops};
use crate::engine::flight::Flight;
use crate::engine::link::DecodeLink;
use crate::engine::state::Shared;
use crate::error::Result;
use crate::layout::{PackLayout, Run};
use crate::memory::RegionDesc;
use crate::transport::WriteOp;
use std::ops::Range;
use std::sync::Arc;

/// Slots a worker's host staging buffer is cut into (fewer when a slot
/// would not hold one token): two halves, one gathered into while the other
/// is on the wire (four measured no faster on the demo).
pub(in crate::engine) const STAGING_SLOTS: u64 = 2;

/// `len` zeroed bytes for a worker's host staging, on transparent huge pages
/// where the system allows them, every page written once, so the first
/// request's gathers take no page faults.
pub(in crate::engine) fn faulted_in(len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    // SAFETY: the buffer's own bytes; the advice changes none of them.
    let _ = unsafe { crate::memory::prefault::advise_huge_pages(buf.as_mut_ptr(), len) };
    for i in (0..len).step_by(4096) {
        // SAFETY: i < len; a volatile write of the zero already there only faults the page in.
        unsafe { std::ptr::write_volatile(buf.as_mut_ptr().add(i), 0) };
    }
    buf
}

/// A worker's host staging cut into slots for rows of `token_bytes` a token:
/// `(slots, bytes per slot)`; `(1, 0)` without staging.
pub(super) fn staging_slots(
    staging: Option<&(Vec<u8>, RegionDesc)>,
    token_bytes: u64,
) -> (usize, u64) {
    staging.map_or((1, 0), |(b, _)| {
        let len = b.len() as u64;
        let n = (len / token_bytes.max(1)).clamp(1, STAGING_SLOTS);
        (n as usize, len / n)
    })
}

/// The writes of `layers` of a pair's rows straight from the pools: one per
/// run and entry, run-major, or entry-major (`by_entry`: each entry's runs
/// in order, so runs that follow each other in the decode's rows are
/// consecutive writes).
fn pool_ops(
    inner: &Shared,
    runs: &[Run],
    layers: &Range<usize>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    by_entry: bool,
) -> Vec<WriteOp> {
    let op = |e: usize, r: &Run| WriteOp {
        local_region: inner.pool_regions[e].id,
        local_offset: r.src * row_bytes[e],
        remote_region: dst_regions[e],
        remote_offset: r.dst * row_bytes[e],
        len: r.len * row_bytes[e],
    };
    let mut ops = Vec::with_capacity(runs.len() * layers.len());
    if by_entry {
        for e in layers.clone() {
            ops.extend(runs.iter().map(|r| op(e, r)));
        }
    } else {
        for r in runs {
            ops.extend(layers.clone().map(|e| op(e, r)));
        }
    }
    ops
}

/// The KV pools of `entries` as byte slices, for the CPU gather.
pub(super) fn pool_slices(inner: &Shared, entries: std::ops::Range<usize>) -> Vec<&[u8]> {
    inner.pool_regions[entries]
        .iter()
        // SAFETY: pool memory is valid for the engine's life (Engine::new contract); read-only here.
        .map(|r| unsafe { std::slice::from_raw_parts(r.addr as *const u8, r.len as usize) })
        .collect()
}

/// Gathers `spans` of `pools` into the next free slot of the worker's host
/// staging `buf` (every batch still reading that slot completed first) and
/// counts the gather time; returns the slot and its byte offset in `buf`.
/// `buf` is cut into `slots` of `slot_bytes`; `pack` must fit one.
pub(super) fn gather_into_slot(
    inner: &Shared,
    flight: &mut Flight<'_>,
    (buf, slots, slot_bytes): (&[u8], usize, u64),
    pools: &[&[u8]],
    row_bytes: &[u64],
    spans: &[Run],
    pack: &PackLayout,
) -> Result<(usize, u64)> {
    let slot = flight.next_slot(slots)?;
    let offset = slot as u64 * slot_bytes;
    // SAFETY: this worker is the only user of its staging buffer, and every
    // batch reading this slot completed (next_slot); the slot's `slot_bytes`
    // hold the pack (the caller's contract) and lie in the buffer.
    let out = unsafe {
        std::slice::from_raw_parts_mut(
            buf.as_ptr().add(offset as usize) as *mut u8,
            pack.total_bytes as usize,
        )
    };
    let t0 = std::time::Instant::now();
    crate::relayout::cpu::gather(pools, row_bytes, spans, pack, out)?;
    inner.metrics.gathered(t0);
    Ok((slot, offset))
}

/// Submits `layers` of one pair's rows of a chunk into the chunk's flight:
/// straight from the pools where the link's sender gathers them
/// (`sender_gathers`: tcp, cma), else packed through the worker's host staging
/// buffer (the group's rows entry-major, slice by slice) when that makes
/// fewer writes, else straight from the pools. The staging is used as
/// [`STAGING_SLOTS`] slots: each slice is gathered into the next slot,
/// waited free first, while the batches of the others are on the wire.
/// Returns the bytes.
pub(super) fn write(
    cx: &mut Chunk<'_, '_>,
    link: &Arc<DecodeLink>,
    pair: &Pair<'_>,
    layers: &Range<usize>,
    sender_gathers: bool,
) -> Result<u64> {
    let (inner, plan, req) = (cx.inner, pair.plan, pair.req);
    let (row_bytes, dst_regions) = (pair.row_bytes, pair.dst_regions);
    let rb = &row_bytes[layers.clone()];
    let token_bytes: u64 = rb.iter().sum();
    let direct = plan.direct(req)?;
    if sender_gathers {
        let ops = pool_ops(inner, direct, layers, row_bytes, dst_regions, true);
        cx.flight.submit(link, &ops, None)?;
        return Ok(plan.tokens * token_bytes);
    }
    let staging = inner.staging.get(cx.idx);
    let (slots, slot_bytes) = staging_slots(staging, token_bytes);
    let cap = slot_bytes / token_bytes.max(1);
    // packed runs are consecutive staging indices: fewer writes when they merge
    let packs = staging.is_some() && cap > 0 && plan.scatter(req)?.len() * 2 <= direct.len();
    let (Some((buf, desc)), true) = (staging, packs) else {
        let ops = pool_ops(inner, direct, layers, row_bytes, dst_regions, false);
        cx.flight.submit(link, &ops, None)?;
        return Ok(plan.tokens * token_bytes);
    };
    let (gather, scatter) = (plan.gather(req)?, plan.scatter(req)?);
    let pools = pool_slices(inner, layers.clone());
    let mut lo = 0;
    while lo < plan.tokens {
        let hi = (lo + cap).min(plan.tokens);
        let pack = PackLayout::new(hi - lo, rb)?;
        let spans = clip(gather, lo, hi, false);
        // the pack holds `cap` tokens of the group at most: one slot
        let (slot, offset) = gather_into_slot(
            inner,
            cx.flight,
            (buf, slots, slot_bytes),
            &pools,
            rb,
            &spans,
            &pack,
        )?;
        let ops = packed_ops(
            scatter,
            (lo, hi),
            layers,
            row_bytes,
            dst_regions,
            (desc.id, offset),
            &pack.entry_offsets,
        );
        cx.flight.submit(link, &ops, Some(slot))?;
        lo = hi;
    }
    Ok(plan.tokens * token_bytes)
}
