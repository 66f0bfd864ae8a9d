//! Room-level grants in the engine: the decode's metadata is the grant.
//!
//! `send_metadata` grants each prefill rank of the room (its authenticated
//! instance) the room's destination rows once: the pages of every KV pool,
//! the aux row and the state rows ([`room_ranges`]); the Meta carries the
//! grant's token ([`MetaGrant`](super::control::MetaGrant)); the prefill rebuilds the same ranges from
//! the same Meta and opens the grant on its data connection, so the room's
//! batches skip the per-batch round trip where the transport supports it,
//! and closes it (one round trip) before reporting the room done. The decode
//! revokes the grants on every terminal state of the room.

use super::control::RegionMap;
use crate::error::{Error, Result, Status};
use crate::layout::{PoolGeometry, Topology};
use crate::transport::room::GrantRange;

/// The decode rank's rows a room writes, as byte ranges of its regions: the
/// pages `dst_pages` of every KV pool (`topo`'s entries, their regions in
/// `map`), row `aux_index` of every aux buffer, and row `state_indices[i]` of
/// state buffer `i`. The decode computes them to grant; the prefill, from the
/// same Meta, to open the grant.
pub(super) fn room_ranges(
    map: &RegionMap,
    topo: &Topology,
    dst_pages: &[u64],
    aux_index: u64,
    state_indices: &[u64],
) -> Result<Vec<GrantRange>> {
    let page = u64::from(topo.page_size);
    let mut pages = dst_pages.to_vec();
    pages.sort_unstable();
    pages.dedup();
    let mut out = Vec::with_capacity(pages.len() * topo.entries.len() + 2);
    for e in &topo.entries {
        let region = map.kv_region(e.layer_id).ok_or_else(|| {
            Error::new(
                Status::GeometryMismatch,
                format!("decode rank has no KV region for layer {}", e.layer_id),
            )
        })?;
        let stride = map.kv_page_stride(e.layer_id);
        // one range per run of consecutive pages (per page when strided)
        let g = PoolGeometry::new(page * e.row_bytes, stride, 0)?;
        for (offset, len) in g.page_ranges(&pages) {
            out.push(GrantRange {
                region,
                offset,
                len,
            });
        }
    }
    for &(region, item) in &map.aux {
        out.push(GrantRange {
            region,
            offset: aux_index * item,
            len: item,
        });
    }
    for (&(region, item), &row) in map.state.iter().zip(state_indices) {
        out.push(GrantRange {
            region,
            offset: row * item,
            len: item,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_each_pool_page_run_and_the_aux_and_state_rows() {
        let mut topo = Topology::single_mla(4, 2, 8);
        topo.entries[1].row_bytes = 16;
        let map = RegionMap {
            kv: vec![(0, 10), (1, 11)],
            aux: vec![(20, 64)],
            state: vec![(30, 100), (31, 7)],
            kv_stride: Vec::new(),
        };
        let r = room_ranges(&map, &topo, &[5, 2, 3, 9], 3, &[2, 4]).unwrap();
        let g = |region, offset, len| GrantRange {
            region,
            offset,
            len,
        };
        assert_eq!(
            r,
            [
                g(10, 2 * 32, 2 * 32),
                g(10, 5 * 32, 32),
                g(10, 9 * 32, 32),
                g(11, 2 * 64, 2 * 64),
                g(11, 5 * 64, 64),
                g(11, 9 * 64, 64),
                g(20, 3 * 64, 64),
                g(30, 200, 100),
                g(31, 28, 7),
            ]
        );
        // a strided pool: one range per page, none over the gaps
        let strided = RegionMap {
            kv_stride: vec![(1, 3 * 64)],
            ..map.clone()
        };
        let r = room_ranges(&strided, &topo, &[3, 2], 0, &[]).unwrap();
        assert_eq!(
            r[..4],
            [
                g(10, 2 * 32, 2 * 32),
                g(11, 2 * 192, 64),
                g(11, 3 * 192, 64),
                g(20, 0, 64),
            ]
        );
        // a layer without a region is a geometry mismatch
        let short = RegionMap {
            kv: vec![(0, 10)],
            ..map
        };
        assert_eq!(
            room_ranges(&short, &topo, &[0], 0, &[])
                .unwrap_err()
                .status(),
            Status::GeometryMismatch
        );
    }
}
