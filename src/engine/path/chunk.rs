//! What a worker writes one chunk with, handed to the link's
//! [`WritePath`](super::WritePath).

use super::nccl::send::NcclSend;
use super::PairPlan;
use crate::engine::device::DeviceStage;
use crate::engine::flight::Flight;
use crate::engine::prefill::jobs::Job;
use crate::engine::prefill::Prefill;
use crate::layout::PairRequest;

/// What a worker writes one chunk with: the engine, the job, the worker's
/// staging (host staging by `idx`, its GPU stage), the chunk's flight and
/// its NCCL sends (finished together once every pair started).
pub(in crate::engine) struct Chunk<'a, 'b> {
    pub(in crate::engine) inner: &'a Prefill,
    pub(in crate::engine) job: &'b Job,
    pub(in crate::engine) idx: usize,
    pub(in crate::engine) stage: Option<&'b mut DeviceStage>,
    pub(in crate::engine) flight: &'b mut Flight<'a>,
    pub(in crate::engine) nccl: Vec<NcclSend<'a>>,
}

/// One pair of a chunk: its request and plan, the rows' sizes and the
/// decode's KV regions (one per topology entry).
pub(in crate::engine) struct Pair<'r> {
    pub(in crate::engine) req: &'r PairRequest<'r>,
    pub(in crate::engine) plan: &'r PairPlan,
    pub(in crate::engine) row_bytes: &'r [u64],
    pub(in crate::engine) dst_regions: &'r [u64],
}
