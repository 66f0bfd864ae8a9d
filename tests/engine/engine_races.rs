//! Races of the engine's room setup, stressed in one process.
//!
//! The soak run found that a decode's metadata arriving at the same moment as
//! the prefill's `sender()` could be parked after `sender()` had drained the
//! parked metadata: the room then stayed `Bootstrapping` until its deadline.
//! Here the two calls are released together by a barrier, room after room;
//! every room must leave `Bootstrapping` at once (the race hit about one room
//! in a thousand in the soak; with the barrier it is much more frequent).

use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, EngineConfig, KvPoll};
use pdxfer::transport::TransportKind;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[test]
fn metadata_racing_sender_is_never_lost() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let pp = SyntheticPools::new(1, 64, 16, 8, 2, 32).unwrap();
    let mut cfg = EngineConfig::new(
        Role::Prefill,
        "races",
        &url,
        pp.topology(1, 0),
        pp.kv_pools(),
    );
    cfg.aux = pp.aux_buffers();
    cfg.transport = TransportKind::Tcp;
    cfg.staging_bytes = 0;
    // SAFETY: the pools outlive the engines (dropped at the end of the test, after them).
    let prefill = unsafe { Engine::new(cfg) }.unwrap();
    let dp = SyntheticPools::new(1, 64, 16, 8, 2, 32).unwrap();
    let mut cfg = EngineConfig::new(
        Role::Decode,
        "races",
        &url,
        dp.topology(1, 0),
        dp.kv_pools(),
    );
    cfg.aux = dp.aux_buffers();
    cfg.transport = TransportKind::Tcp;
    // SAFETY: as above.
    let decode = unsafe { Engine::new(cfg) }.unwrap();
    let rooms = 1000u64;
    // `go` releases sender() and send_metadata() together; `opened` says sender() returned
    let (go, opened) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let (g2, o2, p2) = (go.clone(), opened.clone(), prefill.clone());
    let t = std::thread::spawn(move || {
        for room in 1..=rooms {
            g2.wait();
            p2.sender(room).unwrap();
            o2.wait();
        }
    });
    let mut stuck = Vec::new();
    let mut waited = 0;
    for room in 1..=rooms {
        decode
            .receiver(room, 0, Some(Duration::from_secs(5)))
            .unwrap();
        go.wait();
        decode.send_metadata(room, &[1], 0, 0).unwrap();
        opened.wait();
        waited += 1;
        // the prefill's room must reach WaitingForInput promptly
        let end = Instant::now() + Duration::from_secs(2);
        while prefill.poll(room) == KvPoll::Bootstrapping && Instant::now() < end {
            std::thread::sleep(Duration::from_micros(200));
        }
        if prefill.poll(room) == KvPoll::Bootstrapping {
            stuck.push(room);
            if stuck.len() > 2 {
                break;
            }
        }
        let _ = prefill.abort(room);
        let _ = decode.abort(room);
    }
    // let the sender thread finish if the loop stopped early
    for _ in waited..rooms {
        go.wait();
        opened.wait();
    }
    t.join().unwrap();
    assert!(stuck.is_empty(), "rooms whose metadata was lost: {stuck:?}");
    drop((prefill, decode));
    drop((pp, dp));
}
