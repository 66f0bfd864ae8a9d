//! The prefill's room state machine against the test rig
//! (`engine::test_rig`): metadata parked before `sender`, a room waiting for
//! every decode rank, prefixes that disagree, the order of layer-wise sends
//! and the jobs they queue.

use super::{MetaInfo, Prefill};
use crate::engine::layers::SendOptions;
use crate::engine::link::DecodeLink;
use crate::engine::room::KvPoll;
use crate::engine::state::lock;
use crate::engine::test_rig::{rig, ROOM};
use crate::error::Status;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What decode rank `link` asks for in room [`ROOM`]: `required` ranks in
/// all, its decode prefix `prefix`.
fn meta(link: &Arc<DecodeLink>, required: u32, prefix: u64) -> MetaInfo {
    MetaInfo {
        link: link.clone(),
        attempt: 1,
        dst_pages: vec![2, 3, 4, 5],
        prefix,
        aux_index: 0,
        state_indices: Vec::new(),
        required,
        bytes: 0,
        arrived: Instant::now(),
        grant: None,
        dummy: false,
    }
}

fn poll(p: &Prefill) -> KvPoll {
    lock(&p.rooms).get(ROOM).map_or(KvPoll::Failed, |r| r.poll)
}

#[test]
fn a_prefill_room_waits_for_every_decode_rank_metadata_even_when_it_came_first() {
    let r = rig(0);
    let p = &r.prefill;
    // another decode rank (its rig's pools are not written)
    let other = rig(0).link.clone();
    // one of the two decode ranks' metadata arrives before `sender`: parked
    p.add_meta(ROOM, meta(&r.link, 2, 0));
    assert_eq!(lock(&p.pending_meta).get(&ROOM).map(Vec::len), Some(1));
    p.sender(ROOM).unwrap();
    assert!(lock(&p.pending_meta).is_empty(), "drained by sender");
    assert_eq!(poll(p), KvPoll::Bootstrapping, "one of two decode ranks");
    p.add_meta(ROOM, meta(&other, 2, 0));
    assert_eq!(poll(p), KvPoll::WaitingForInput);
    // a send queues one job per call; a second whole-chunk last send is refused
    p.send_with(ROOM, &[3, 0, 7, 5], 14, true, 0, &SendOptions::default())
        .unwrap();
    assert_eq!(poll(p), KvPoll::Transferring);
    let j = p.jobs.take(Duration::ZERO).expect("queued");
    assert_eq!(
        (j.room, j.num_tokens, j.last, j.peers.len()),
        (ROOM, 14, true, 2)
    );
    let e = p
        .send_with(ROOM, &[1], 4, true, 0, &SendOptions::default())
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
}

#[test]
fn decode_ranks_that_disagree_on_the_prefix_fail_the_room() {
    let r = rig(0);
    let p = &r.prefill;
    let other = rig(0).link.clone();
    p.sender(ROOM).unwrap();
    p.add_meta(ROOM, meta(&r.link, 2, 0));
    p.add_meta(ROOM, meta(&other, 2, 16));
    assert_eq!(poll(p), KvPoll::Failed);
    let e = lock(&p.rooms).get(ROOM).unwrap().failure.clone().unwrap();
    assert!(e.detail().contains("disagree on decode_prefix_len"), "{e}");
}

#[test]
fn layer_wise_sends_are_checked_against_the_pending_chunk() {
    let r = rig(0);
    let p = &r.prefill;
    p.sender(ROOM).unwrap();
    p.add_meta(ROOM, meta(&r.link, 1, 0));
    let layers = |l: Range<u32>| SendOptions {
        layers: Some(l),
        ..Default::default()
    };
    let pages = [3u64, 0, 7, 5];
    p.send_with(ROOM, &pages, 16, false, 0, &layers(0..1))
        .unwrap();
    for (l, status) in [(0..1, Status::LayerOrder), (2..3, Status::LayerOrder)] {
        let e = p
            .send_with(ROOM, &pages, 16, false, 0, &layers(l))
            .unwrap_err();
        assert_eq!(e.status(), status, "{e}");
    }
    let e = p
        .send_with(ROOM, &pages, 16, false, 0, &SendOptions::default())
        .unwrap_err();
    assert_eq!(
        e.status(),
        Status::LayerOrder,
        "a whole chunk mid-layers: {e}"
    );
    p.send_with(ROOM, &pages, 16, false, 0, &layers(1..3))
        .unwrap();
    let queued: Vec<Range<usize>> = std::iter::from_fn(|| {
        let j = p.jobs.take(Duration::ZERO)?;
        p.jobs.done(&j);
        Some(j.layers)
    })
    .collect();
    assert_eq!(queued, vec![0..1, 1..3]);
}

#[test]
fn a_dummy_notice_parked_before_sender_opens_the_room_and_its_last_chunk_moves_nothing() {
    let r = rig(0);
    let p = &r.prefill;
    let notice = MetaInfo {
        dummy: true,
        dst_pages: Vec::new(),
        ..meta(&r.link, 0, 8)
    };
    p.add_meta(ROOM, notice);
    assert_eq!(lock(&p.pending_meta).get(&ROOM).map(Vec::len), Some(1));
    p.sender(ROOM).unwrap();
    assert_eq!(poll(p), KvPoll::WaitingForInput, "no data is waited for");
    let infos = lock(&p.prefill_rooms).get(&ROOM).map(|r| r.infos.len());
    assert_eq!(infos, Some(0), "a notice is no decode rank to write to");
    p.send_with(ROOM, &[1, 2], 8, false, 0, &SendOptions::default())
        .unwrap();
    assert_eq!(poll(p), KvPoll::WaitingForInput);
    p.send_with(ROOM, &[3], 3, true, 0, &SendOptions::default())
        .unwrap();
    assert_eq!(poll(p), KvPoll::Success);
    assert!(p.jobs.take(Duration::ZERO).is_none(), "no job queued");
    assert_eq!(r.conn.written.load(std::sync::atomic::Ordering::Relaxed), 0);
}
