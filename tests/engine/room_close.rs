//! How a room ends with several decode ranks: the prefill closes the room's
//! grants on every decode rank at once, so decode ranks slow to answer their
//! RoomEnd cost the room one wait, not one per rank.

use crate::support::cluster::Cluster;
use pdxfer::bootstrap::schema::Role;
use pdxfer::transport::TransportKind;
use std::time::{Duration, Instant};

/// DCP 1 -> 4 over cma, every decode rank answering its RoomEnd after
/// `STALL`: the room succeeds after about one stall (one after another it
/// would take four), and every byte landed.
#[test]
fn room_closes_reach_every_decode_rank_at_once() {
    const STALL: Duration = Duration::from_millis(800);
    let mut c = Cluster::build("close-at-once", (1, 4), TransportKind::Cma)
        .layers(4)
        .room_timeout(Duration::from_secs(30))
        .receiver_timeout(Duration::from_secs(30))
        .knobs(|role, _, cfg| {
            if role == Role::Decode {
                cfg.testing.room_end_stall = STALL;
            }
        })
        .start();
    let req = c.open_room(1, 300, 0, true);
    let t0 = Instant::now();
    c.send_all(&req, 100);
    c.wait_prefill_success(req.room);
    let took = t0.elapsed();
    assert!(
        took >= STALL,
        "the closes waited for the decode ranks: {took:?}"
    );
    assert!(
        took < STALL * 3,
        "4 decode ranks slow to close cost {took:?}: closed one after another"
    );
    assert!(c.finish(&req) > 0);
}
