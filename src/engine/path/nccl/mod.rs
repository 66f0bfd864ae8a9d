//! The nccl path of a prefill worker (transport nccl): a pair's chunk
//! started over the link's NCCL communicator (`send::start_pair`), finished
//! with the chunk's other pairs once every one is on the wire
//! (`send::finish_all`). `send` is the prefill side of transport nccl (see
//! `engine::nccl_link` for the protocol); without the `nccl` feature it is
//! a stub here.

#[cfg(feature = "nccl")]
pub(in crate::engine) mod send;

/// Without the `nccl` feature an nccl engine is refused at creation.
#[cfg(not(feature = "nccl"))]
pub(in crate::engine) mod send {
    use crate::engine::link::DecodeLink;
    use crate::engine::prefill::jobs::Job;
    use crate::engine::state::Shared;
    use crate::error::{Error, Result, Status};

    /// Never made: there is no pair to finish.
    pub(in crate::engine) struct NcclSend<'a>(
        std::convert::Infallible,
        std::marker::PhantomData<&'a ()>,
    );

    /// Without the `nccl` feature there is no pair to finish.
    pub(in crate::engine) fn finish_all(pairs: Vec<NcclSend<'_>>) -> Result<()> {
        match pairs.into_iter().next() {
            None => Ok(()),
            Some(p) => match p.0 {},
        }
    }

    /// Without the `nccl` feature an nccl engine is refused at creation.
    pub(in crate::engine) fn keep_open(
        _inner: &std::sync::Arc<crate::engine::prefill::Prefill>,
        _link: &std::sync::Arc<DecodeLink>,
    ) {
    }

    /// Without the `nccl` feature an nccl engine is refused at creation.
    pub(in crate::engine) fn start_pair(
        _inner: &Shared,
        _job: &Job,
        _req: &crate::layout::PairRequest<'_>,
        _row_bytes: &[u64],
        _link: &std::sync::Arc<DecodeLink>,
    ) -> Result<Option<NcclSend<'static>>> {
        Err(Error::new(
            Status::Unsupported,
            "built without the `nccl` feature",
        ))
    }
}

use super::chunk::{Chunk, Pair};
use crate::engine::link::DecodeLink;
use crate::error::{Error, Result, Status};
use std::sync::Arc;

/// Starts one pair's chunk (whole chunks only) into the chunk's NCCL sends;
/// returns its KV bytes.
pub(super) fn write<'a>(
    cx: &mut Chunk<'a, '_>,
    link: &Arc<DecodeLink>,
    pair: &Pair<'_>,
) -> Result<u64> {
    if cx.job.layered {
        return Err(Error::new(
            Status::Unsupported,
            "layer-wise sends over transport nccl are not supported: send whole chunks",
        ));
    }
    let p = send::start_pair(cx.inner, cx.job, pair.req, pair.row_bytes, link)?;
    cx.nccl.extend(p);
    Ok(pair.req.token_count() * pair.row_bytes.iter().sum::<u64>())
}
