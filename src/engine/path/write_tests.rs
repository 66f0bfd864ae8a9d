//! The write paths against the test rig (`engine::test_rig`): a chunk's
//! rows land byte-exact in the decode's pools through the staged path
//! (packed through the host staging or straight from the pools) and the
//! one-copy path, as a whole chunk and layer group by layer group.

use super::chunk::{Chunk, Pair};
use super::{Conn, PairPlan, WritePath};
use crate::engine::flight::Flight;
use crate::engine::prefill::jobs::Job;
use crate::engine::room::KvPoll;
use crate::engine::state::lock;
use crate::engine::synthetic::SyntheticPools;
use crate::engine::test_rig::{rig, rig_over, side, Rig, DST_REGION, LAYERS, P, ROOM, ROW};
use crate::layout::{PairRequest, PoolGeometry};
use crate::transport::{BatchOptions, MappedRegion};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn job(layers: Range<usize>, layered: bool) -> Job {
    Job {
        room: ROOM,
        attempt: 1,
        pages: Vec::new(),
        start: 0,
        num_tokens: 0,
        last: false,
        aux_index: 0,
        state_indices: Vec::new(),
        queued: Instant::now(),
        peers: Vec::new(),
        layers,
        layered,
        ready: Default::default(),
    }
}

/// Writes `tokens` rows of `src_pages` into `dst_pages` through `path`, one
/// flight per layer group of `groups`, and checks every decode row; returns
/// the bytes the path reported.
fn write_through(
    r: &mut Rig,
    path: WritePath,
    groups: &[Range<usize>],
    (src_pages, dst_pages, tokens): (&[u64], &[u64], u64),
) -> u64 {
    r.src.fill(ROOM, &side(src_pages), tokens);
    let attempt = lock(&r.prefill.rooms)
        .create(ROOM, KvPoll::WaitingForInput, None, Instant::now())
        .unwrap();
    // the page ids the plan addresses, as the worker makes them
    let src_pitch = PoolGeometry::pitch_pages(r.prefill.cfg.page_step(), src_pages);
    let dst_step = r.link.regions.page_step(&r.link.hello.topology).unwrap();
    let dst_pitch = PoolGeometry::pitch_pages(dst_step, dst_pages);
    let req = PairRequest {
        src: side(&src_pitch),
        dst: side(&dst_pitch),
        start: 0,
        num_tokens: tokens,
    };
    req.validate().unwrap();
    let plan = PairPlan::new(&req);
    let row_bytes = vec![ROW; LAYERS as usize];
    let dst_regions: Vec<u64> = (0..u64::from(LAYERS)).map(|e| DST_REGION + e).collect();
    let pair = Pair {
        req: &req,
        plan: &plan,
        row_bytes: &row_bytes,
        dst_regions: &dst_regions,
    };
    let conn = Conn {
        data: r.conn.clone(),
        path: Arc::new(path),
    };
    let opts = BatchOptions {
        timeout: Duration::from_secs(5),
        checksum: false,
        room: ROOM,
        epoch: attempt,
    };
    let mut bytes = 0;
    for g in groups {
        let j = job(g.clone(), groups.len() > 1);
        let mut flight = Flight::new(&r.prefill.rooms, opts);
        let mut cx = Chunk {
            inner: &r.prefill,
            job: &j,
            idx: 0,
            stage: None,
            flight: &mut flight,
            nccl: Vec::new(),
        };
        bytes += conn.path.write(&mut cx, &r.link, &conn, &pair, g).unwrap();
        flight.drain().unwrap();
    }
    let checked = r.dst.verify(ROOM, &side(dst_pages), tokens, None).unwrap();
    assert_eq!(checked, tokens * ROW * u64::from(LAYERS));
    assert_eq!(bytes, checked, "the bytes the path reported");
    bytes
}

/// Scattered prefill pages into consecutive decode pages: the packed runs
/// merge (one per chunk) where the pool runs do not (one per page).
const SCATTERED: (&[u64], &[u64], u64) = (&[3, 0, 7, 5], &[2, 3, 4, 5], 14);
/// Consecutive prefill pages into scattered decode pages: packing saves nothing.
const SPREAD: (&[u64], &[u64], u64) = (&[4, 5, 6, 7], &[9, 1, 12, 3], 16);
/// A whole chunk: one group of every layer.
#[allow(clippy::single_range_in_vec_init)]
const WHOLE: &[Range<usize>] = &[0..3];
const GROUPS: &[Range<usize>] = &[0..1, 1..3];

fn staged(sender_gathers: bool) -> WritePath {
    WritePath::Staged { sender_gathers }
}

#[test]
fn staged_rows_land_byte_exact_through_the_staging_whole_and_by_layer() {
    for groups in [WHOLE, GROUPS] {
        // a staging slot holds 3 tokens of every layer: many slices
        let mut r = rig(2 * 3 * ROW * u64::from(LAYERS));
        let n = write_through(&mut r, staged(false), groups, SCATTERED);
        let gathers = r.prefill.metrics.gathers_total();
        assert!(gathers > 0, "{groups:?}: packed through the host staging");
        assert_eq!(r.conn.written.load(Ordering::Relaxed), n);
        assert_eq!(r.conn.placed.load(Ordering::Relaxed), 0);
    }
}

#[test]
fn staged_rows_go_straight_from_the_pools_when_packing_saves_nothing() {
    for (gathers, rows, staging) in [
        // packing would not merge the writes
        (false, SPREAD, 1 << 16),
        // no staging at all
        (false, SCATTERED, 0),
        // the sender gathers them itself (tcp, cma)
        (true, SCATTERED, 1 << 16),
    ] {
        for groups in [WHOLE, GROUPS] {
            let mut r = rig(staging);
            let n = write_through(&mut r, staged(gathers), groups, rows);
            assert_eq!(
                r.prefill.metrics.gathers_total(),
                0,
                "{groups:?}: no gather"
            );
            assert_eq!(r.conn.written.load(Ordering::Relaxed), n);
        }
    }
}

#[test]
fn one_copy_rows_land_byte_exact_in_the_mapped_pools_whole_and_by_layer() {
    for groups in [WHOLE, GROUPS] {
        for rows in [SCATTERED, SPREAD] {
            let mut r = rig(1 << 16);
            let maps = r
                .dst
                .kv_pools()
                .iter()
                .map(|p| MappedRegion {
                    addr: p.base,
                    len: p.geometry().unwrap().span(),
                })
                .collect();
            let n = write_through(&mut r, WritePath::Direct { maps }, groups, rows);
            assert_eq!(r.conn.placed.load(Ordering::Relaxed), n, "one copy");
            assert_eq!(r.conn.written.load(Ordering::Relaxed), 0, "nothing else");
            assert_eq!(r.prefill.metrics.one_copy_bytes_total(), n);
        }
    }
}

/// Strided pools on either side or both: the prefill's padded (pages two
/// apart, one allocation per layer), the decode's block-outermost (every
/// layer in one allocation, a block row of `LAYERS + 1` pages).
fn strided_rigs(staging: u64) -> Vec<(&'static str, Rig)> {
    let pools = |step, interleaved| {
        SyntheticPools::new_strided(LAYERS, ROW, P, 16, 2, 8, step, interleaved).unwrap()
    };
    let compact = || SyntheticPools::new(LAYERS, ROW, P, 16, 2, 8).unwrap();
    let block_row = u64::from(LAYERS) + 1;
    vec![
        (
            "strided decode",
            rig_over(staging, compact(), pools(block_row, true)),
        ),
        (
            "strided prefill",
            rig_over(staging, pools(2, false), compact()),
        ),
        (
            "both",
            rig_over(staging, pools(2, false), pools(block_row, true)),
        ),
    ]
}

/// The decode's strided pools: every byte between pages untouched.
fn gaps_untouched(what: &str, r: &Rig) {
    for (side, pools) in [("decode", &r.dst), ("prefill", &r.src)] {
        if pools.page_step > 1 {
            let n = pools
                .check_gaps()
                .unwrap_or_else(|e| panic!("{what}: {side}: {e}"));
            assert!(n > 0, "{what}: {side} has gap bytes to check");
        }
    }
}

#[test]
fn strided_pools_land_byte_exact_with_the_gaps_untouched_on_every_path() {
    for rows in [SCATTERED, SPREAD] {
        for groups in [WHOLE, GROUPS] {
            // packed through the staging, straight from the pools, gathered by the sender
            for (gathers, staging) in [
                (false, 2 * 3 * ROW * u64::from(LAYERS)),
                (false, 0),
                (true, 1 << 16),
            ] {
                for (what, mut r) in strided_rigs(staging) {
                    let n = write_through(&mut r, staged(gathers), groups, rows);
                    assert_eq!(r.conn.written.load(Ordering::Relaxed), n, "{what}");
                    gaps_untouched(what, &r);
                }
            }
            for (what, mut r) in strided_rigs(1 << 16) {
                let maps = r
                    .dst
                    .kv_pools()
                    .iter()
                    .map(|p| MappedRegion {
                        addr: p.base,
                        len: p.geometry().unwrap().span(),
                    })
                    .collect();
                let n = write_through(&mut r, WritePath::Direct { maps }, groups, rows);
                assert_eq!(r.conn.placed.load(Ordering::Relaxed), n, "{what}: one copy");
                gaps_untouched(what, &r);
            }
        }
    }
}
