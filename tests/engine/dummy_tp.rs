//! Prefill TP 2 -> decode TP 1 over MLA (replicated KV): the decode reads
//! from prefill rank 0 only, and prefill rank 1 is a dummy target. The
//! decode tells it that it needs nothing from it, so its rooms conclude
//! with their last chunk (or with the decode's abort) long before their
//! deadline, moving no byte; in both orders (the prefill's room opened
//! before the decode's notice, or after it).

use crate::support::cluster::{self, AUX_ITEM, AUX_SLOT, P, ROW};

use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, KvPoll};
use pdxfer::transport::TransportKind;
use pdxfer::Status;
use std::time::{Duration, Instant};

const LAYERS: u32 = 2;
/// Far beyond every wait below: a room that ends did not time out.
const ROOM_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a dummy room may take to conclude.
const PROMPT: Duration = Duration::from_secs(5);

struct Pair {
    _server: BootstrapServer,
    /// Prefill TP ranks 0 and 1, with their pools.
    prefill: Vec<(Engine, SyntheticPools)>,
    decode: (Engine, SyntheticPools),
}

fn pair(name: &str) -> Pair {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let mut prefill = Vec::new();
    for r in 0..2u32 {
        let pools = cluster::pools(LAYERS, 16);
        let mut cfg = cluster::config(
            Role::Prefill,
            name,
            &url,
            &pools,
            (1, 0),
            TransportKind::Cma,
        );
        cfg.topology.attn_tp_size = 2;
        cfg.topology.attn_tp_rank = r;
        cfg.topology.engine_rank = r;
        cfg.staging_bytes = 1 << 20;
        cfg.room_timeout = ROOM_TIMEOUT;
        // SAFETY: the pools are kept beside the engine, which drops first.
        prefill.push((unsafe { Engine::new(cfg) }.unwrap(), pools));
    }
    let pools = cluster::pools(LAYERS, 16);
    let mut cfg = cluster::config(Role::Decode, name, &url, &pools, (1, 0), TransportKind::Cma);
    cfg.room_timeout = ROOM_TIMEOUT;
    // SAFETY: as above.
    let decode = (unsafe { Engine::new(cfg) }.unwrap(), pools);
    Pair {
        _server: server,
        prefill,
        decode,
    }
}

/// Waits until `e`'s `room` has its metadata (`WaitingForInput` or later).
fn until_input(e: &Engine, room: u64, what: &str) {
    let t = Instant::now();
    while e.poll(room) == KvPoll::Bootstrapping {
        assert!(t.elapsed() < PROMPT, "{what}: no metadata for room {room}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The dummy prefill rank moved nothing and holds nothing.
fn moved_nothing(e: &Engine) {
    let s = e.metrics_snapshot();
    assert_eq!(s.staging_in_flight_bytes(), 0, "{s:?}");
    assert_eq!(s.gathers, 0, "{s:?}");
    assert!(
        s.peers.iter().all(|p| p.bytes == 0 && p.batches == 0),
        "{:?}",
        s.peers
    );
}

/// The prefill sends room `room` (`n` tokens on `pages`) on both ranks,
/// rank 1 from its own pages, as a TP group does.
fn send_both(p: &Pair, room: u64, prefix: u64, n: u64, pages: &[u64]) {
    for (e, _) in &p.prefill {
        let at = e.decode_prefix_len(room).expect("metadata arrived");
        assert_eq!(at, prefix, "every TP rank skips the decode's prefix");
        let first = (at / P) as usize;
        e.send(room, &pages[first..], n - at, true, AUX_ITEM)
            .unwrap();
    }
}

#[test]
fn a_dummy_prefill_rank_concludes_its_room_at_once_in_both_orders() {
    let mut p = pair("dummy-tp");
    let n: u64 = 40;
    let dst: Vec<u64> = vec![4, 5, 6];
    // the sequential order: the prefill's rooms exist before the decode does
    let room = 1;
    let src: Vec<u64> = (0..n.div_ceil(P)).collect();
    let src2: Vec<u64> = src.iter().map(|s| s + 8).collect();
    p.prefill[0].1.fill(room, &cluster::side(1, 0, &src, 0), n);
    p.prefill[0].1.fill_aux(room, AUX_ITEM);
    // room 2's KV too (filled before the engines are shared below)
    p.prefill[0].1.fill(2, &cluster::side(1, 0, &src2, 0), n);
    for (e, _) in &p.prefill {
        e.sender(room).unwrap();
    }
    cluster::open_decode([&p.decode.0], room, &dst, 0, None);
    for (i, (e, _)) in p.prefill.iter().enumerate() {
        until_input(e, room, &format!("prefill rank {i}"));
    }
    send_both(&p, room, 0, n, &src);
    let t = Instant::now();
    let dummy = &p.prefill[1].0;
    assert_eq!(
        dummy.wait(room, PROMPT),
        KvPoll::Success,
        "{:?}",
        dummy.failure(room)
    );
    assert!(t.elapsed() < PROMPT && dummy.is_fenced(room));
    cluster::assert_success(&p.prefill[0].0, room, "prefill rank 0");
    cluster::assert_success(&p.decode.0, room, "decode");
    let got = p
        .decode
        .1
        .verify(room, &cluster::side(1, 0, &dst, 0), n, Some(AUX_SLOT))
        .unwrap();
    assert_eq!(got, n * LAYERS as u64 * ROW + 32);
    moved_nothing(dummy);

    // the router order: the decode's notice comes before the prefill's room
    // opens (parked like other early metadata), with a decode prefix
    let room = 2;
    let prefix = P;
    cluster::open_decode([&p.decode.0], room, &dst, prefix, None);
    // the notice is on its way on rank 1's control connection; rank 0's
    // metadata on rank 0's: both are in once rank 0 has its own
    std::thread::sleep(Duration::from_millis(200));
    for (i, (e, _)) in p.prefill.iter().enumerate() {
        e.sender(room).unwrap();
        until_input(e, room, &format!("prefill rank {i}"));
    }
    send_both(&p, room, prefix, n, &src2);
    assert_eq!(
        dummy.wait(room, PROMPT),
        KvPoll::Success,
        "{:?}",
        dummy.failure(room)
    );
    cluster::assert_success(&p.decode.0, room, "decode");
    let got = p
        .decode
        .1
        .verify(room, &cluster::side(1, 0, &dst, prefix), n, None)
        .unwrap();
    assert_eq!(got, (n - prefix) * LAYERS as u64 * ROW);
    moved_nothing(dummy);
    for (e, _) in &p.prefill {
        e.clear(1).unwrap();
        e.clear(2).unwrap();
    }
}

#[test]
fn a_decode_abort_releases_the_dummy_prefill_rank_room() {
    let p = pair("dummy-tp-abort");
    let room = 3;
    for (e, _) in &p.prefill {
        e.sender(room).unwrap();
    }
    cluster::open_decode([&p.decode.0], room, &[1, 2], 0, None);
    let dummy = &p.prefill[1].0;
    until_input(dummy, room, "the dummy prefill rank");
    p.decode.0.abort(room).unwrap();
    let t = Instant::now();
    assert_eq!(dummy.wait(room, PROMPT), KvPoll::Failed);
    assert!(t.elapsed() < PROMPT && dummy.is_fenced(room));
    assert_eq!(dummy.failure(room).unwrap().status(), Status::Aborted);
    // the real rank is fenced too, and the decode only once it acknowledged
    assert_eq!(p.prefill[0].0.wait(room, PROMPT), KvPoll::Failed);
    while !p.decode.0.is_fenced(room) {
        assert!(t.elapsed() < PROMPT, "the decode's abort is not fenced");
        std::thread::sleep(Duration::from_millis(2));
    }
    moved_nothing(dummy);
}
