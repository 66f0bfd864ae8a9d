//! The host staging path of a prefill worker: a pair's rows written
//! straight from the pools, or gathered on the CPU into the worker's
//! registered staging buffer slice by slice and written from there. Over
//! tcp the rows always go straight from the pools: its sender gathers the
//! scattered rows of a destination run itself (one piece, one `writev`), so
//! packing them first would only add a copy.

use super::flight::Flight;
use super::handle::Inner;
use super::prefill::DecodeLink;
use crate::error::Result;
use crate::layout::runs::RunMerger;
use crate::layout::{slice_requests, PackLayout, PairRequest, Run};
use crate::memory::RegionDesc;
use crate::transport::{TransportKind, WriteOp};
use std::sync::Arc;

/// Slots a worker's host staging buffer is cut into (fewer when a slot
/// would not hold one token): two halves, one gathered into while the other
/// is on the wire (four measured no faster on the demo).
pub(super) const STAGING_SLOTS: u64 = 2;

/// `len` zeroed bytes for a worker's host staging, every page written once,
/// so the first request's gathers take no page faults.
pub(super) fn faulted_in(len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
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

/// Whether `link`'s sender gathers scattered sources itself: tcp sends
/// consecutive writes whose destinations follow each other as one piece,
/// its payload gathered by the kernel from their sources, so rows written
/// straight from the pools (each entry's runs in order) cost no more pieces
/// than packed ones and save the copy into staging.
pub(super) fn sender_gathers(link: &DecodeLink) -> bool {
    link.data().kind() == TransportKind::Tcp
}

/// The writes of a pair's rows straight from the pools: one per run and
/// entry, run-major, or entry-major (`by_entry`: each entry's runs in
/// order, so runs that follow each other in the decode's rows are
/// consecutive writes).
fn pool_ops(
    inner: &Inner,
    req: &PairRequest<'_>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    by_entry: bool,
) -> Result<Vec<WriteOp>> {
    let op = |e: usize, r: &Run| WriteOp {
        local_region: inner.pool_regions[e].id,
        local_offset: r.src * row_bytes[e],
        remote_region: dst_regions[e],
        remote_offset: r.dst * row_bytes[e],
        len: r.len * row_bytes[e],
    };
    let mut ops = Vec::new();
    if by_entry {
        let runs = req.runs(false)?;
        ops.reserve(runs.len() * row_bytes.len());
        for e in 0..row_bytes.len() {
            ops.extend(runs.iter().map(|r| op(e, r)));
        }
    } else {
        req.for_each_run(false, |r| {
            ops.extend((0..row_bytes.len()).map(|e| op(e, &r)))
        })?;
    }
    Ok(ops)
}

/// The KV pools of `entries` as byte slices, for the CPU gather.
pub(super) fn pool_slices(inner: &Inner, entries: std::ops::Range<usize>) -> Vec<&[u8]> {
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
    inner: &Inner,
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

/// Submits one pair's tokens of a chunk into `flight`: gathered straight
/// into the decode rank's pools where they are mapped here (the one-copy
/// path, [`super::direct`]), else straight from the pools where the link's
/// sender gathers them ([`sender_gathers`]: tcp), else packed through the
/// worker's host staging buffer when that makes fewer writes, else straight
/// from the pool. The staging is used as [`STAGING_SLOTS`] slots: each slice
/// is gathered into the next slot, waited free first, while the batches of
/// the others are on the wire.
pub(super) fn write_pair(
    inner: &Inner,
    idx: usize,
    req: &PairRequest<'_>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    link: &Arc<DecodeLink>,
    flight: &mut Flight<'_>,
) -> Result<u64> {
    let tokens = req.token_count();
    if tokens == 0 {
        return Ok(0);
    }
    if let Some(n) =
        super::direct::write_pair_direct(inner, req, row_bytes, dst_regions, link, flight)?
    {
        return Ok(n);
    }
    let token_bytes: u64 = row_bytes.iter().sum();
    if sender_gathers(link) {
        let ops = pool_ops(inner, req, row_bytes, dst_regions, true)?;
        flight.submit(link, &ops, None)?;
        return Ok(tokens * token_bytes);
    }
    // one walk counts the writes both ways: unpacked runs (pool rows) and
    // packed runs (consecutive staging indices)
    let (mut unpacked, mut packed) = (0u64, 0u64);
    let (mut mu, mut mp) = (RunMerger::default(), RunMerger::default());
    let mut next = 0u64;
    req.for_each_segment(|seg| {
        mu.push(seg.src_row, seg.dst_row, seg.len, &mut |_| unpacked += 1);
        mp.push(next, seg.dst_row, seg.len, &mut |_| packed += 1);
        next += seg.len;
    })?;
    mu.finish(&mut |_| unpacked += 1);
    mp.finish(&mut |_| packed += 1);
    let staging = inner.staging.get(idx);
    let (slots, slot_bytes) = staging_slots(staging, token_bytes);
    let cap_tokens = slot_bytes / token_bytes.max(1);
    if staging.is_none() || packed * 2 > unpacked || cap_tokens == 0 {
        let ops = pool_ops(inner, req, row_bytes, dst_regions, false)?;
        flight.submit(link, &ops, None)?;
        return Ok(tokens * token_bytes);
    }
    let (buf, desc) = staging.expect("checked above");
    let pools = pool_slices(inner, 0..inner.pool_regions.len());
    for sub in slice_requests(req, cap_tokens)? {
        let n = sub.token_count();
        let pack = PackLayout::new(n, row_bytes)?;
        let mut spans = Vec::new();
        let mut next = 0u64;
        let mut m = RunMerger::default();
        sub.for_each_segment(|seg| {
            m.push(seg.src_row, next, seg.len, &mut |r: Run| spans.push(r));
            next += seg.len;
        })?;
        m.finish(&mut |r: Run| spans.push(r));
        // the pack holds `cap_tokens` tokens at most: one slot
        let (slot, offset) = gather_into_slot(
            inner,
            flight,
            (buf, slots, slot_bytes),
            &pools,
            row_bytes,
            &spans,
            &pack,
        )?;
        let ops = staged_ops(
            &sub,
            row_bytes,
            dst_regions,
            desc.id,
            offset,
            &pack.entry_offsets,
        )?;
        flight.submit(link, &ops, Some(slot))?;
    }
    Ok(tokens * token_bytes)
}

/// Writes of one staged slice: packed rows (entry-major at `entry_offsets`
/// from `offset` in staging region `region`) to the decode rank's pool rows.
pub(super) fn staged_ops(
    sub: &PairRequest<'_>,
    row_bytes: &[u64],
    dst_regions: &[u64],
    region: u64,
    offset: u64,
    entry_offsets: &[u64],
) -> Result<Vec<WriteOp>> {
    let mut ops = Vec::new();
    sub.for_each_run(true, |r| {
        for (e, &rb) in row_bytes.iter().enumerate() {
            ops.push(WriteOp {
                local_region: region,
                local_offset: offset + entry_offsets[e] + r.src * rb,
                remote_region: dst_regions[e],
                remote_offset: r.dst * rb,
                len: r.len * rb,
            });
        }
    })?;
    Ok(ops)
}
