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

/// A prefill with `W` workers and `W` decodes slow to answer their RoomEnd
/// (DCP 1 each, one room each), and one healthy decode: the healthy room
/// succeeds long before the slow closes end (a room's close holds no
/// worker), and then every room succeeds with every byte in place.
#[test]
fn decodes_slow_to_close_never_delay_a_healthy_one() {
    use crate::support::cluster::{self, AUX_SLOT, DECODE_PAGES, P, PREFILL_PAGES};
    use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
    use pdxfer::engine::{Engine, KvPoll};
    const STALL: Duration = Duration::from_secs(4);
    const WORKERS: usize = 2;
    const LAYERS: u32 = 4;
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let mut p_pools = cluster::pools(LAYERS, PREFILL_PAGES);
    let mut cfg = cluster::config(
        Role::Prefill,
        "close-stall",
        &url,
        &p_pools,
        (1, 0),
        TransportKind::Cma,
    );
    cfg.workers = WORKERS;
    cfg.staging_bytes = 1 << 20;
    cfg.room_timeout = Duration::from_secs(30);
    // SAFETY: p_pools outlives the engine (dropped after it, below).
    let prefill = unsafe { Engine::new(cfg) }.unwrap();
    // decodes 0..WORKERS answer their RoomEnd late; the last one at once
    let mut decodes = Vec::new();
    for i in 0..=WORKERS {
        let pools = cluster::pools(LAYERS, DECODE_PAGES);
        let mut cfg = cluster::config(
            Role::Decode,
            "close-stall",
            &url,
            &pools,
            (1, 0),
            TransportKind::Cma,
        );
        // one data-parallel group each: each its own bootstrap entry
        (cfg.dp_size, cfg.dp_rank) = (WORKERS as u32 + 1, i as u32);
        if i < WORKERS {
            cfg.testing.room_end_stall = STALL;
        }
        cfg.room_timeout = Duration::from_secs(30);
        // SAFETY: the pools are kept next to the engine and dropped after it.
        decodes.push((unsafe { Engine::new(cfg) }.unwrap(), pools));
    }
    let room = |i: usize| i as u64 + 1;
    let src = |i: usize| vec![2 * i as u64, 2 * i as u64 + 1];
    let dst = [1u64, 2];
    let total = 2 * P;
    for (i, (d, _)) in decodes.iter().enumerate() {
        p_pools.fill(room(i), &cluster::side(1, 0, &src(i), 0), total);
        p_pools.fill_aux(room(i), 2 + i as u64);
        d.receiver(room(i), 0, Some(Duration::from_secs(30)))
            .unwrap();
        d.send_metadata(room(i), &dst, 0, AUX_SLOT).unwrap();
        prefill.sender(room(i)).unwrap();
    }
    for i in 0..decodes.len() {
        let t0 = Instant::now();
        while prefill.poll(room(i)) == KvPoll::Bootstrapping {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "room {} never bootstrapped",
                room(i)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let t0 = Instant::now();
    for i in 0..decodes.len() {
        prefill
            .send(room(i), &src(i), total, true, 2 + i as u64)
            .unwrap();
    }
    let healthy = WORKERS;
    assert_eq!(
        prefill.wait(room(healthy), Duration::from_secs(20)),
        KvPoll::Success
    );
    let took = t0.elapsed();
    assert!(
        took < STALL / 2,
        "the healthy room took {took:?}: it waited for the {WORKERS} slow closes"
    );
    for i in 0..WORKERS {
        assert_ne!(
            prefill.poll(room(i)),
            KvPoll::Success,
            "room {} closed early",
            room(i)
        );
    }
    for (i, (d, pools)) in decodes.iter().enumerate() {
        assert_eq!(
            prefill.wait(room(i), Duration::from_secs(20)),
            KvPoll::Success
        );
        assert_eq!(d.wait(room(i), Duration::from_secs(20)), KvPoll::Success);
        let side = cluster::side(1, 0, &dst, 0);
        let n = pools
            .verify(room(i), &side, total, Some(AUX_SLOT))
            .unwrap_or_else(|e| panic!("decode {i}: {e}"));
        assert!(n > 0);
    }
    prefill.close();
    for (d, _) in &decodes {
        d.close();
    }
    drop((prefill, decodes, p_pools));
}
