//! The device path of a prefill worker (KV pools in CUDA device memory): a
//! pair's rows gathered on the GPU slice by slice into the worker's device
//! staging ([`DeviceStage`]) and written
//! from there (zero copy: rdma with GPUDirect RDMA) or copied to its pinned
//! host half and written from there; slice `i+1` is gathered (and copied)
//! while slice `i` is on the wire.

use super::chunk::{Chunk, Pair};
use super::{clip, packed_ops};
use crate::engine::device::DeviceStage;
use crate::engine::flight::Flight;
use crate::engine::link::DecodeLink;
use crate::engine::state::lock;
use crate::error::{Error, Result, Status};
use crate::layout::Run;
use crate::transport::BatchOptions;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Writes `layers` of one pair's rows of a chunk from device pools through
/// the worker's GPU stage; `gpu_direct` is the path's zero-copy switch. A
/// NIC that refuses the device staging (`NoGpuDirect`) moves the path to
/// the host copy for good and the rows are written again through it
/// (rewriting the same bytes is harmless). Returns the bytes.
pub(super) fn write(
    cx: &mut Chunk<'_, '_>,
    link: &Arc<DecodeLink>,
    gpu_direct: &AtomicBool,
    pair: &Pair<'_>,
    layers: &Range<usize>,
) -> Result<u64> {
    let inner = cx.inner;
    let (plan, req) = (pair.plan, pair.req);
    let (row_bytes, dst_regions) = (pair.row_bytes, pair.dst_regions);
    let stage: &mut DeviceStage = cx.stage.as_deref_mut().ok_or_else(|| {
        Error::new(
            Status::Unsupported,
            "device pools are written through the worker's GPU stage, and this worker has none",
        )
    })?;
    let rb = &row_bytes[layers.clone()];
    let token_bytes: u64 = rb.iter().sum();
    // the CPU cannot read device memory: never a checksum over these batches
    let opts = BatchOptions {
        checksum: false,
        ..cx.flight.opts
    };
    let cap = stage.slice_tokens(rb).max(1);
    let bounds: Vec<(u64, u64)> = (0..plan.tokens)
        .step_by(cap as usize)
        .map(|lo| (lo, (lo + cap).min(plan.tokens)))
        .collect();
    let gather = plan.gather(req)?;
    let scatter = plan.scatter(req)?;
    let spans: Vec<Vec<Run>> = bounds
        .iter()
        .map(|&(lo, hi)| clip(gather, lo, hi, false))
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
                    scatter,
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
    let zero_copy = gpu_direct.load(Ordering::Acquire);
    match run(stage, zero_copy) {
        Err(e) if zero_copy && e.status() == Status::NoGpuDirect => {
            // The NIC refused to register the device staging (nothing was
            // posted from it). Only a host-path success
            // proves the device staging was the problem (not the peer's pools).
            if let Some(t) = lock(&inner.rooms).times_mut(opts.room, opts.epoch) {
                t.retries += 1;
            }
            run(stage, false)?;
            if gpu_direct.swap(false, Ordering::AcqRel) {
                inner.log_no_gpu_direct(&e);
            }
        }
        r => r?,
    }
    Ok(plan.tokens * token_bytes)
}
