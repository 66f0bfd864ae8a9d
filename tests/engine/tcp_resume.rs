//! A tcp data link broken in the middle of a room: the prefill redials it,
//! asks the decode's agent what landed under the room's grant and sends only
//! the rest on the new connection; the room succeeds with every byte in
//! place, its totals spanning both connections.

use crate::support::cluster::{Cluster, AUX_ITEM, ROW};
use pdxfer::bootstrap::schema::Role;
use pdxfer::transport::TransportKind;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

/// DCP 1 -> 2 over tcp, 4 layers of 64-byte rows. A room is sent in 8
/// chunks of 8 pages (64 tokens to each decode rank): the first lands, then
/// the prefill's knob closes the data connection that takes the next write
/// right after its submit, and the later chunks go over the new
/// connection. The room succeeds on both decode ranks with every byte
/// verified; the resumed link sent again at most what followed its first
/// chunk (a piece that landed is not sent twice); a later room on the new
/// connection is untouched.
#[test]
fn a_tcp_link_broken_mid_room_resumes_the_rest_and_every_byte_lands() {
    const LAYERS: u64 = 4;
    let left = Arc::new(AtomicU64::new(0));
    let knob = left.clone();
    let mut c = Cluster::build("tcp-resume", (1, 2), TransportKind::Tcp)
        .layers(LAYERS as u32)
        .room_timeout(Duration::from_secs(30))
        .receiver_timeout(Duration::from_secs(30))
        .knobs(move |role, _, cfg| {
            if role == Role::Prefill {
                cfg.testing.sever_tcp_data_after = Some(knob.clone());
            }
        })
        .start();
    // a first room, the knob off: what a room moves
    let total = c.request(1, 1000, 0, 100);
    assert_eq!(c.prefill().metrics_snapshot().tcp_resumes, 0);
    let req = c.open_room(2, 1000, 0, true);
    let chunks = c.chunks(&req, 0, 8);
    assert_eq!(chunks.len(), 8);
    let send = |(pages, tokens, last): &(Vec<u64>, u64, bool)| {
        c.prefill()
            .send(req.room, pages, *tokens, *last, AUX_ITEM)
            .unwrap()
    };
    send(&chunks[0]);
    std::thread::sleep(Duration::from_millis(300));
    left.store(1, SeqCst);
    chunks[1..].iter().for_each(send);
    assert_eq!(
        c.finish(&req),
        total,
        "every byte of the resumed room landed"
    );
    assert_eq!(left.load(SeqCst), 0, "the knob closed a connection");
    let s = c.prefill().metrics_snapshot();
    assert_eq!(s.tcp_resumes, 1, "one link resumed once");
    // the first chunk landed before the break: it is not sent again
    let link_part = total / 2;
    let first_chunk = 64 * LAYERS * ROW;
    assert!(
        s.tcp_resent_bytes <= link_part - first_chunk,
        "the resumed link sent {} bytes again of its {link_part}; its first chunk ({first_chunk} B) landed before the break, so landed pieces were sent twice",
        s.tcp_resent_bytes
    );
    // the new connection carries the next room whole
    assert_eq!(c.request(3, 1000, 0, 100), total);
    assert_eq!(c.prefill().metrics_snapshot().tcp_resumes, 1);
}
