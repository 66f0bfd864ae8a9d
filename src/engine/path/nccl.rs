//! The nccl path of a prefill worker (transport nccl): a pair's chunk
//! started over the link's NCCL communicator
//! ([`start_pair`](crate::engine::nccl_link)), finished with the chunk's
//! other pairs once every one is on the wire.

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
    let p = crate::engine::nccl_link::send::start_pair(
        cx.inner,
        cx.job,
        pair.req,
        pair.row_bytes,
        link,
    )?;
    cx.nccl.extend(p);
    Ok(pair.req.token_count() * pair.row_bytes.iter().sum::<u64>())
}
