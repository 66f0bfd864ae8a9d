//! [`WritePath::write`]: one pair's layers through the path's file.

use super::chunk::{Chunk, Pair};
use super::{device, direct, nccl, staged, Conn, WritePath};
use crate::engine::link::DecodeLink;
use crate::error::Result;
use std::ops::Range;
use std::sync::Arc;

impl WritePath {
    /// Writes `layers` of one pair's rows of a chunk over `conn` (this
    /// path's connection) into the chunk's flight (or its NCCL sends);
    /// returns their bytes.
    pub(in crate::engine) fn write<'a>(
        &self,
        cx: &mut Chunk<'a, '_>,
        link: &Arc<DecodeLink>,
        conn: &Conn,
        pair: &Pair<'_>,
        layers: &Range<usize>,
    ) -> Result<u64> {
        // transport nccl refuses layer-wise sends even of a pair without tokens
        if pair.plan.tokens == 0 && !matches!(self, WritePath::Nccl) {
            return Ok(0);
        }
        match self {
            WritePath::Staged { sender_gathers } => {
                staged::write(cx, link, pair, layers, *sender_gathers)
            }
            WritePath::Direct { maps } => direct::write(cx, link, &conn.data, maps, pair, layers),
            WritePath::Device { gpu_direct } => device::write(cx, link, gpu_direct, pair, layers),
            WritePath::Nccl => nccl::write(cx, link, pair),
        }
    }
}
