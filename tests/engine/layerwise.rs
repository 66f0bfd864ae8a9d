//! Layer-wise sends and sends ordered after a ready flag, end to end in one
//! process: a bootstrap server, prefill and decode DCP ranks as engines over
//! cma, tcp and rdma on the in-process fake NIC fabric; every received byte is
//! checked, and the typed errors, abort and deadline mid-layer.

use crate::support::cluster::{Cluster, Pools, P, ROW};
use pdxfer::engine::{KvPoll, ReadyFlag, SendOptions};
use pdxfer::transport::TransportKind;
use pdxfer::Status;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const LAYERS: u32 = 6;
/// How a chunk's layers are sent: uneven groups, in order.
const GROUPS: [Range<u32>; 3] = [0..1, 1..4, 4..6];

/// Prefill ranks (DCP `src_dcp`, staging `staging`) and decode ranks (DCP
/// `dcp`, no staging), both with room timeout `timeout`.
fn cluster(
    name: &str,
    dcp: (u32, u32),
    transport: TransportKind,
    staging: u64,
    timeout: Duration,
) -> Cluster {
    Cluster::build(name, dcp, transport)
        .layers(LAYERS)
        .staging(staging)
        .decode_staging(0)
        .room_timeout(timeout)
        .decode_room_timeout(timeout)
        .start()
}

fn layers(g: &Range<u32>) -> SendOptions {
    SendOptions {
        layers: Some(g.clone()),
        ..Default::default()
    }
}

const TOKEN: u64 = LAYERS as u64 * ROW;

#[test]
fn layerwise_dcp_1_to_4_byte_exact_over_cma_tcp_and_the_fake_nic() {
    let t = Duration::from_secs(20);
    for transport in [TransportKind::Cma, TransportKind::Tcp, TransportKind::Rdma] {
        for staging in [1 << 20, 0, 7 * TOKEN] {
            let name = format!("lw-{}-{staging}", transport.name());
            let mut c = cluster(&name, (1, 4), transport, staging, t);
            // one chunk; chunked with a prefix; many slices of a tiny staging
            for (room, total, prefix, chunk_pages) in [
                (1u64, 300u64, 0u64, 100usize),
                (2, 700, 128, 3),
                (3, 1000, 0, 7),
            ] {
                let req = c.open_room(room, total, prefix, true);
                c.send_layerwise(&req, chunk_pages, &GROUPS);
                assert_eq!(
                    c.finish(&req),
                    req.n() * TOKEN + 4 * 32,
                    "{name} room {room}"
                );
            }
        }
    }
}

#[test]
fn layerwise_dcp_4_to_4_chunked_with_prefix() {
    for transport in [TransportKind::Cma, TransportKind::Tcp, TransportKind::Rdma] {
        let name = format!("lw44-{}", transport.name());
        let mut c = cluster(&name, (4, 4), transport, 1 << 20, Duration::from_secs(20));
        let req = c.open_room(21, 900, P * 4, true);
        c.send_layerwise(&req, 3, &GROUPS);
        assert_eq!(c.finish(&req), req.n() * TOKEN + 4 * 32, "{name}");
    }
}

/// The decode completes once, after the last layer group of the last chunk:
/// before it, every decode rank is still waiting.
#[test]
fn decode_completes_after_the_last_layers_only() {
    let mut c = cluster(
        "lw-once",
        (1, 2),
        TransportKind::Cma,
        1 << 20,
        Duration::from_secs(20),
    );
    let req = c.open_room(4, 200, 0, true);
    let (e, _) = &c.prefill[0];
    let ch = c.chunks(&req, 0, 100);
    let (pages, t, last) = &ch[0];
    for g in &GROUPS[..2] {
        e.send_with(req.room, pages, *t, *last, 3, &layers(g))
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    for (d, _) in &c.decode {
        assert_eq!(d.poll(req.room), KvPoll::WaitingForInput);
    }
    assert_eq!(e.poll(req.room), KvPoll::Transferring);
    e.send_with(req.room, pages, *t, *last, 3, &layers(&GROUPS[2]))
        .unwrap();
    assert_eq!(c.finish(&req), req.n() * TOKEN + 2 * 32);
}

/// A send ordered after a ready flag: the rows are written after the send
/// was queued, then the flag is set; a worker that read the pools before the
/// flag would send zeros (the pools start zeroed) and the check would fail.
/// With staging the flags are set by a plain store (what the C ABI's caller
/// or a GPU does: the queue's poll sees it), without by `ReadyFlag::set`
/// (which wakes the queue).
#[test]
fn ready_flag_orders_the_gather_after_the_caller_writes() {
    for staging in [1 << 20, 0] {
        let mut c = cluster(
            &format!("lw-flag-{staging}"),
            (1, 4),
            TransportKind::Tcp,
            staging,
            Duration::from_secs(20),
        );
        let req = c.open_room(6, 500, 64, false);
        let flags: Vec<Arc<AtomicU64>> = (0..GROUPS.len()).map(|_| Arc::default()).collect();
        let ready: Vec<ReadyFlag> = flags.iter().map(|f| ReadyFlag::new(f.clone())).collect();
        {
            let (e, _) = &c.prefill[0];
            let ch = c.chunks(&req, 0, 200);
            assert_eq!(ch.len(), 1);
            let (pages, t, last) = &ch[0];
            for (g, f) in GROUPS.iter().zip(&ready) {
                let o = SendOptions {
                    layers: Some(g.clone()),
                    ready_flag: Some(f.clone()),
                    ..Default::default()
                };
                e.send_with(req.room, pages, *t, *last, 3, &o).unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(c.decode[0].0.poll(req.room), KvPoll::WaitingForInput);
        c.fill(&req);
        for (f, r) in flags.iter().zip(&ready) {
            if staging == 0 {
                r.set();
            } else {
                f.store(1, Ordering::Release);
            }
        }
        assert_eq!(
            c.finish(&req),
            req.n() * TOKEN + 4 * 32,
            "staging {staging}"
        );
    }
}

#[test]
fn layer_order_errors_are_typed_and_change_nothing() {
    let mut c = cluster(
        "lw-order",
        (1, 2),
        TransportKind::Cma,
        1 << 20,
        Duration::from_secs(20),
    );
    let req = c.open_room(8, 400, 0, true);
    let (e, _) = &c.prefill[0];
    let ch = c.chunks(&req, 0, 10);
    assert_eq!(ch.len(), 3);
    let kind = |r: pdxfer::Result<()>| r.unwrap_err().status();
    let send = |i: usize, g: Range<u32>| {
        let (p, t, l) = &ch[i];
        e.send_with(req.room, p, *t, *l, 3, &layers(&g))
    };
    // a chunk starts at layer 0
    assert_eq!(kind(send(0, 1..3)), Status::LayerOrder);
    send(0, 0..2).unwrap();
    // duplicate, out of order (a gap), another chunk and a whole-chunk send
    // while layers 2..6 of chunk 0 are missing
    assert_eq!(kind(send(0, 1..3)), Status::LayerOrder);
    assert_eq!(kind(send(0, 0..2)), Status::LayerOrder);
    assert_eq!(kind(send(0, 3..6)), Status::LayerOrder);
    assert_eq!(kind(send(1, 0..6)), Status::LayerOrder);
    assert_eq!(kind(send(1, 2..6)), Status::LayerOrder);
    let (p, t, l) = &ch[0];
    let e2 = e.send(req.room, p, *t, *l, 3).unwrap_err();
    assert_eq!(e2.status(), Status::LayerOrder);
    assert!(e2.detail().contains("layers 2..6"), "{e2}");
    // empty or out-of-range layer ranges are argument errors
    assert_eq!(kind(send(0, 2..2)), Status::InvalidArgument);
    assert_eq!(kind(send(0, 2..7)), Status::InvalidArgument);
    // none of that changed the room: the rest goes through byte-exact,
    // a whole-chunk send between layer-wise chunks included
    send(0, 2..6).unwrap();
    let (p, t, l) = &ch[1];
    e.send(req.room, p, *t, *l, 3).unwrap();
    send(2, 0..3).unwrap();
    send(2, 3..6).unwrap();
    // after the last chunk's last layers nothing more is accepted
    assert_eq!(kind(send(2, 3..6)), Status::LayerOrder);
    assert_eq!(kind(send(2, 0..6)), Status::LayerOrder);
    let (p, t, l) = &ch[2];
    assert_eq!(
        e.send(req.room, p, *t, *l, 3).unwrap_err().status(),
        Status::InvalidArgument
    );
    assert_eq!(c.finish(&req), req.n() * TOKEN + 2 * 32);
}

/// An abort from the decode while the prefill's worker waits on a later
/// layer's ready flag: the wait ends, the room fails on both sides, the
/// decode's pages are fenced, and no later layer is accepted.
#[test]
fn abort_mid_layer_ends_the_wait_and_fences() {
    for transport in [TransportKind::Cma, TransportKind::Tcp, TransportKind::Rdma] {
        let name = format!("lw-abort-{}", transport.name());
        let mut c = cluster(&name, (1, 2), transport, 1 << 20, Duration::from_secs(20));
        let req = c.open_room(9, 300, 0, true);
        let (e, _) = &c.prefill[0];
        let ch = c.chunks(&req, 0, 100);
        let (pages, t, last) = &ch[0];
        e.send_with(req.room, pages, *t, *last, 3, &layers(&GROUPS[0]))
            .unwrap();
        let never = Arc::new(AtomicU64::new(0));
        let o = SendOptions {
            layers: Some(GROUPS[1].clone()),
            ready_flag: Some(ReadyFlag::new(never.clone())),
            ..Default::default()
        };
        e.send_with(req.room, pages, *t, *last, 3, &o).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let (d, _) = &c.decode[0];
        d.abort(req.room).unwrap();
        assert_eq!(
            e.wait(req.room, Duration::from_secs(10)),
            KvPoll::Failed,
            "{name}"
        );
        let fenced = (0..400).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            d.is_fenced(req.room)
        });
        assert!(fenced, "{name}: the abort was never acknowledged");
        assert_eq!(d.poll(req.room), KvPoll::Failed);
        let late = e.send_with(req.room, pages, *t, *last, 3, &layers(&GROUPS[2]));
        assert_eq!(late.unwrap_err().status(), Status::RoomFailed, "{name}");
        assert_eq!(never.load(Ordering::Relaxed), 0);
    }
}

/// A room whose last layers never come fails at its deadline on both sides.
#[test]
fn deadline_mid_layer_fails_the_room() {
    let mut c = cluster(
        "lw-deadline",
        (1, 2),
        TransportKind::Cma,
        1 << 20,
        Duration::from_millis(800),
    );
    let req = c.open_room(10, 300, 0, true);
    let (e, _) = &c.prefill[0];
    let ch = c.chunks(&req, 0, 100);
    let (pages, t, last) = &ch[0];
    e.send_with(req.room, pages, *t, *last, 3, &layers(&GROUPS[0]))
        .unwrap();
    assert_eq!(e.wait(req.room, Duration::from_secs(10)), KvPoll::Failed);
    assert_eq!(e.failure(req.room).unwrap().status(), Status::Timeout);
    for (d, _) in &c.decode {
        assert_eq!(d.wait(req.room, Duration::from_secs(10)), KvPoll::Failed);
    }
}

/// Host pools take a ready flag; a CUDA event is for device pools and refused.
#[test]
fn cuda_event_on_host_pools_is_refused() {
    let mut c = cluster(
        "lw-ev",
        (1, 1),
        TransportKind::Cma,
        1 << 20,
        Duration::from_secs(20),
    );
    let req = c.open_room(11, 64, 0, true);
    let (e, _) = &c.prefill[0];
    let o = SendOptions {
        cuda_event: Some(0x1234),
        ..Default::default()
    };
    let err = e
        .send_with(req.room, &req.src[0], 64, true, 3, &o)
        .unwrap_err();
    assert_eq!(err.status(), Status::InvalidArgument);
    assert!(err.detail().contains("ready flag"), "{err}");
    e.send(req.room, &req.src[0], 64, true, 3).unwrap();
    assert_eq!(c.finish(&req), 64 * TOKEN + 32);
}

/// Layer-wise sends over cma into decode pools in shared memory take the
/// one-copy path, as whole-chunk sends do: every KV byte is copied straight
/// into the decode ranks' pools (the one-copy counter equals the KV bytes),
/// and every byte is verified.
#[test]
fn layerwise_over_cma_into_shared_decode_pools_takes_the_one_copy_path() {
    let t = Duration::from_secs(20);
    let mut c = Cluster::build("lw-one-copy", (1, 4), TransportKind::Cma)
        .layers(LAYERS)
        .decode_pools(Pools::Shared)
        .staging(1 << 20)
        .decode_staging(0)
        .room_timeout(t)
        .decode_room_timeout(t)
        .start();
    let mut kv = 0;
    for (room, total, prefix, chunk_pages) in [(1u64, 300u64, 0u64, 100usize), (2, 700, 128, 3)] {
        let req = c.open_room(room, total, prefix, true);
        c.send_layerwise(&req, chunk_pages, &GROUPS);
        assert_eq!(c.finish(&req), req.n() * TOKEN + 4 * 32, "room {room}");
        kv += req.n() * TOKEN;
    }
    let p = c.prefill();
    assert_eq!(
        p.metrics_snapshot().one_copy_bytes,
        kv,
        "every KV byte of the layer-wise sends took the one-copy path"
    );
    assert!(p
        .metrics()
        .contains(&format!("pdxfer_engine_one_copy_bytes_total {kv}")));
}

/// Sends waiting for their ready flag hold no worker: with both of the
/// prefill's workers' worth of rooms waiting (the default 2 workers), a
/// ready room to the same decode ranks goes first and succeeds; the waiting
/// rooms move once the caller wrote their rows and set their flags.
#[test]
fn sends_waiting_for_their_ready_flag_hold_no_worker() {
    let mut c = cluster(
        "lw-flag-queue",
        (1, 2),
        TransportKind::Cma,
        1 << 20,
        Duration::from_secs(20),
    );
    let flags: Vec<Arc<AtomicU64>> = (0..2).map(|_| Arc::default()).collect();
    // one page per room: the rooms' pages are distinct
    let waiting: Vec<_> = (1..=2)
        .map(|room| c.open_room(room, 16, 0, false))
        .collect();
    for (req, f) in waiting.iter().zip(&flags) {
        let (pages, t, last) = c.chunks(req, 0, 100).remove(0);
        let o = SendOptions {
            ready_flag: Some(ReadyFlag::new(f.clone())),
            ..Default::default()
        };
        c.prefill[0]
            .0
            .send_with(req.room, &pages, t, last, 3, &o)
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    let ready = c.open_room(3, 16, 0, true);
    c.send_all(&ready, 100);
    assert_eq!(c.finish(&ready), ready.n() * TOKEN + 2 * 32);
    for (req, f) in waiting.iter().zip(&flags) {
        assert_eq!(c.prefill[0].0.poll(req.room), KvPoll::Transferring);
        c.fill(req);
        f.store(1, Ordering::Release);
        assert_eq!(c.finish(req), req.n() * TOKEN + 2 * 32);
    }
}
