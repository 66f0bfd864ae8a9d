//! The engine end to end in one process: a bootstrap server, one prefill rank
//! and decode DCP ranks as engines over real sockets and the cma/tcp
//! transports, and rdma over the in-process fake NIC fabric; every received
//! byte is checked.

use crate::support as common;
use crate::support::cluster::{self, Cluster, Pools, P, ROW};

use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, EngineConfig, KvPoll};
use pdxfer::layout::{DcpLayout, Side};
use pdxfer::transport::rdma::fake::FakeNic;
use pdxfer::transport::rdma::handshake::Mtu;
use pdxfer::transport::TransportKind;
use pdxfer::Status;
use std::time::Duration;

const LAYERS: u32 = 4;

/// One engine rank over fresh synthetic pools of `pages` pages, DCP `dcp`
/// rank `r` (rdma on the software NIC fabric); the pools live beside it.
fn rank(
    role: Role,
    name: &str,
    url: &str,
    pages: u64,
    dcp_rank: (u32, u32),
    transport: TransportKind,
) -> (Engine, SyntheticPools) {
    let pools = cluster::pools(LAYERS, pages);
    cluster::rank(role, name, url, pools, dcp_rank, transport)
}

fn cluster(name: &str, src_dcp: u32, dcp: u32, transport: TransportKind, staging: u64) -> Cluster {
    cluster_with(name, src_dcp, dcp, transport, staging, false)
}

/// [`cluster`], the decode ranks' KV pools in shared pool allocations when
/// `shared_decode` (a same-host prefill maps them: the one-copy path).
fn cluster_with(
    name: &str,
    src_dcp: u32,
    dcp: u32,
    transport: TransportKind,
    staging: u64,
    shared_decode: bool,
) -> Cluster {
    assert_eq!(src_dcp, 1, "the prefill side of these tests is DCP 1");
    Cluster::build(name, (1, dcp), transport)
        .layers(LAYERS)
        .staging(staging)
        .room_timeout(Duration::from_secs(20))
        .receiver_timeout(Duration::from_secs(20))
        .decode_pools(if shared_decode {
            Pools::Shared
        } else {
            Pools::Heap
        })
        .start()
}

#[test]
fn dcp_1_to_4_over_cma_packed_chunked_and_with_prefix() {
    let mut c = cluster("e2e-cma", 1, 4, TransportKind::Cma, 1 << 20);
    let row_total = LAYERS as u64 * ROW;
    assert_eq!(c.request(1, 300, 0, 100), 300 * row_total + 4 * 32);
    assert_eq!(c.request(2, 700, 128, 3), 572 * row_total + 4 * 32);
    // staging of 1 MiB holds 4096 tokens of 256 B: this one needs slices
    assert_eq!(c.request(3, 1000, 0, 100), 1000 * row_total + 4 * 32);
}

/// Decode pools in shared memory: the prefill gathers every KV row straight
/// into the decode ranks' pools (one copy, its staging unused); heap decode
/// pools on the same host take the staged path. Every byte is verified.
#[test]
fn dcp_1_to_4_over_cma_one_copy_into_shared_decode_pools() {
    let row_total = LAYERS as u64 * ROW;
    let mut c = cluster_with("e2e-one-copy", 1, 4, TransportKind::Cma, 1 << 20, true);
    let kv = 300 * row_total + 572 * row_total + 1000 * row_total;
    assert_eq!(c.request(1, 300, 0, 100), 300 * row_total + 4 * 32);
    assert_eq!(c.request(2, 700, 128, 3), 572 * row_total + 4 * 32);
    assert_eq!(c.request(3, 1000, 0, 100), 1000 * row_total + 4 * 32);
    let s = c.prefill().metrics_snapshot();
    assert_eq!(s.one_copy_bytes, kv, "every KV byte took the one-copy path");
    assert!(
        s.gathers > 0 && s.gather_seconds > 0.0,
        "counted as gathers"
    );
    assert!(c
        .prefill()
        .metrics()
        .contains(&format!("pdxfer_engine_one_copy_bytes_total {kv}")));
    // heap decode pools on the same host: nothing on the one-copy path, and
    // no staging either: process_vm_writev gathers the rows from the pools
    let mut h = cluster_with("e2e-staged", 1, 4, TransportKind::Cma, 1 << 20, false);
    assert_eq!(h.request(4, 1000, 0, 100), 1000 * row_total + 4 * 32);
    let s = h.prefill().metrics_snapshot();
    assert_eq!(s.one_copy_bytes, 0);
    assert_eq!(s.gathers, 0, "the rows went straight from the pools");
    // tcp never maps the decode's memory: shared decode pools are written
    // from the prefill's pools, its sender gathering the rows
    let mut t = cluster_with("e2e-shared-tcp", 1, 2, TransportKind::Tcp, 1 << 20, true);
    assert_eq!(t.request(5, 333, 64, 2), 269 * row_total + 2 * 32);
    assert_eq!(t.prefill().metrics_snapshot().one_copy_bytes, 0);
}

/// Over tcp the rows go straight from the prefill's pools, staging or not:
/// the sender sends each run of consecutive destination rows as one piece
/// gathered from the scattered rows. Every byte is verified.
#[test]
fn dcp_1_to_4_over_tcp_from_the_pools_with_or_without_staging() {
    let row_total = LAYERS as u64 * ROW;
    for staging in [0, 1 << 20] {
        let mut c = cluster(
            &format!("e2e-tcp-{staging}"),
            1,
            4,
            TransportKind::Tcp,
            staging,
        );
        assert_eq!(c.request(9, 333, 64, 2), 269 * row_total + 4 * 32);
        assert_eq!(c.request(10, 1000, 0, 100), 1000 * row_total + 4 * 32);
        let s = c.prefill().metrics_snapshot();
        assert_eq!(
            s.gathers, 0,
            "staging {staging}: rows gathered into staging"
        );
    }
}

#[test]
fn dcp_1_to_2_over_rdma_on_the_fake_fabric_packed_and_unpacked() {
    let row_total = LAYERS as u64 * ROW;
    let mut c = cluster("e2e-rdma", 1, 2, TransportKind::Rdma, 1 << 20);
    assert_eq!(c.request(1, 300, 0, 100), 300 * row_total + 2 * 32);
    assert_eq!(c.request(2, 700, 128, 3), 572 * row_total + 2 * 32);
    let mut c = cluster("e2e-rdma-unpacked", 1, 2, TransportKind::Rdma, 0);
    assert_eq!(c.request(3, 333, 64, 2), 269 * row_total + 2 * 32);
}

/// A staging buffer of 6 tokens (256 B each) is two halves of 3 tokens: a
/// 250-token pair needs 84 slices, so each half is gathered into again about
/// 170 times per chunk across the 4 decode ranks while the other half's batch
/// is on the wire; a reused half before its batch completed would corrupt rows.
#[test]
fn dcp_1_to_4_tiny_staging_reuses_both_halves_byte_exact() {
    let row_total = LAYERS as u64 * ROW;
    for t in [TransportKind::Cma, TransportKind::Tcp, TransportKind::Rdma] {
        let mut c = cluster(&format!("e2e-halves-{}", t.name()), 1, 4, t, 6 * row_total);
        assert_eq!(c.request(1, 1000, 0, 100), 1000 * row_total + 4 * 32);
        assert_eq!(c.request(2, 700, 128, 3), 572 * row_total + 4 * 32);
    }
    // under two tokens the staging is one slot: gathered, sent and waited in turn
    let mut c = cluster("e2e-one-slot", 1, 4, TransportKind::Cma, row_total + 100);
    assert_eq!(c.request(3, 300, 0, 100), 300 * row_total + 4 * 32);
}

#[test]
fn dcp_1_to_1_pages() {
    let mut c = cluster("e2e-1to1", 1, 1, TransportKind::Cma, 1 << 20);
    assert_eq!(c.request(4, 200, 16, 4), 184 * LAYERS as u64 * ROW + 32);
}

#[test]
fn bad_inputs_are_typed_and_write_nothing() {
    let c = cluster("e2e-bad", 1, 2, TransportKind::Cma, 1 << 20);
    let (d0, _) = &c.decode[0];
    assert_eq!(
        c.prefill()
            .send(77, &[1], 16, true, 0)
            .unwrap_err()
            .status(),
        Status::UnknownRoom
    );
    d0.receiver(5, 0, None).unwrap();
    assert_eq!(
        d0.send_metadata(5, &[999], 0, 0).unwrap_err().status(),
        Status::OutOfBounds
    );
    assert_eq!(
        d0.send_metadata(5, &[1], 16, 0).unwrap_err().status(),
        Status::PrefixMisaligned
    );
    assert_eq!(
        d0.send_metadata(5, &[1], 0, 99).unwrap_err().status(),
        Status::OutOfBounds
    );
    assert_eq!(d0.sender(6).unwrap_err().status(), Status::Unsupported);
    c.prefill().sender(8).unwrap();
    assert_eq!(
        c.prefill().send(8, &[1], 16, true, 0).unwrap_err().status(),
        Status::InvalidArgument,
        "not WaitingForInput yet"
    );
    assert_eq!(c.prefill().poll(12345), KvPoll::Failed);
    assert_eq!(
        c.prefill().failure(12345).unwrap().status(),
        Status::UnknownRoom
    );
}

/// DCP 4 -> 4: four prefill ranks, each holding its own share; prefill rank r
/// pairs with decode rank r only (whole pages), chunked and with a prefix.
#[test]
fn dcp_4_to_4_matching_ranks() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for r in 0..4u32 {
        prefill.push(rank(
            Role::Prefill,
            "e2e-4to4",
            &url,
            32,
            (4, r),
            TransportKind::Cma,
        ));
    }
    for r in 0..4u32 {
        decode.push(rank(
            Role::Decode,
            "e2e-4to4",
            &url,
            32,
            (4, r),
            TransportKind::Auto,
        ));
    }
    let v = P * 4;
    let (room, prefix, total) = (21u64, v, 900u64);
    let n = total - prefix;
    let dst_pages: Vec<u64> = (0..n.div_ceil(v)).map(|i| (i * 5 + 1) % 32).collect();
    for (r, (e, pools)) in prefill.iter_mut().enumerate() {
        // each prefill rank's local pages (one per virtual page of positions)
        let src: Vec<u64> = (0..n.div_ceil(v))
            .map(|i| (i * 3 + r as u64) % 32)
            .collect();
        let side = Side {
            layout: DcpLayout::sglang(P, 4).unwrap(),
            rank: r as u64,
            pages: &src,
            origin: prefix,
        };
        pools.fill(room, &side, total);
        pools.fill_aux(room, 2);
        e.sender(room).unwrap();
    }
    for (e, _) in &decode {
        e.receiver(room, 0, None).unwrap();
        e.send_metadata(room, &dst_pages, prefix, 6).unwrap();
    }
    for (r, (e, _)) in prefill.iter().enumerate() {
        let src: Vec<u64> = (0..n.div_ceil(v))
            .map(|i| (i * 3 + r as u64) % 32)
            .collect();
        let mut waited = 0;
        while e.poll(room) == KvPoll::Bootstrapping {
            std::thread::sleep(Duration::from_millis(5));
            waited += 1;
            assert!(waited < 2000);
        }
        // chunks of 3 local pages = 3 virtual pages of positions each
        let mut sent = 0;
        for (i, c) in src.chunks(3).enumerate() {
            let last = (i + 1) * 3 >= src.len();
            let tokens = if last { n - sent } else { c.len() as u64 * v };
            e.send(room, c, tokens, last, 2).unwrap();
            sent += tokens;
        }
    }
    for (r, (e, _)) in prefill.iter().enumerate() {
        assert_eq!(
            e.wait(room, Duration::from_secs(20)),
            KvPoll::Success,
            "prefill {r}: {:?}",
            e.failure(room)
        );
    }
    for (r, (e, pools)) in decode.iter().enumerate() {
        assert_eq!(
            e.wait(room, Duration::from_secs(20)),
            KvPoll::Success,
            "decode {r}: {:?}",
            e.failure(room)
        );
        let side = Side {
            layout: DcpLayout::sglang(P, 4).unwrap(),
            rank: r as u64,
            pages: &dst_pages,
            origin: prefix,
        };
        let owned = DcpLayout::sglang(P, 4)
            .unwrap()
            .count_owned(r as u64, prefix, total);
        assert_eq!(
            pools.verify(room, &side, total, Some(6)).unwrap(),
            owned * LAYERS as u64 * ROW + 32
        );
        assert_eq!(e.room_bytes(room), owned * LAYERS as u64 * ROW);
    }
}

/// A decode rank that pairs with the wrong prefill rank is refused at the
/// handshake with the seed's error, before any byte moves.
#[test]
fn miswired_dcp_ranks_are_refused() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    // prefill: DCP 4 rank 0 as TP rank 0; decode: DCP 4 rank 1 as TP rank 0 (miswired)
    let pp = SyntheticPools::new(LAYERS, ROW, P, 8, 8, 32).unwrap();
    let mut pt = pp.topology(4, 0);
    pt.attn_tp_size = 1;
    pt.attn_tp_rank = 0;
    let cfg = EngineConfig::new(Role::Prefill, "e2e-miswired", &url, pt, pp.kv_pools());
    // SAFETY: pools outlive the engines in this test.
    let _prefill = unsafe { Engine::new(cfg) }.unwrap();
    let dp = SyntheticPools::new(LAYERS, ROW, P, 8, 8, 32).unwrap();
    let mut dt = dp.topology(4, 1);
    dt.attn_tp_size = 1;
    dt.attn_tp_rank = 0;
    dt.engine_rank = 0;
    let cfg = EngineConfig::new(Role::Decode, "e2e-miswired", &url, dt, dp.kv_pools());
    // SAFETY: as above.
    let decode = unsafe { Engine::new(cfg) }.unwrap();
    let e = decode.receiver(1, 0, None).unwrap_err();
    assert_eq!(e.status(), Status::DcpRankMismatch, "{e}");
    assert!(
        e.detail()
            .contains("PD peers must connect matching DCP ranks, got prefill=0, decode=1"),
        "{e}"
    );
    assert_eq!(decode.poll(1), KvPoll::Failed);
}

/// State buffers (Mamba/SWA-like): one row per buffer and request, sent whole
/// to every decode rank after the KV; a mismatch in state geometry is typed.
#[test]
fn state_rows_follow_the_kv_to_every_decode_rank() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let (rows, item) = (4u64, 48u64);
    let p_pools = SyntheticPools::new(LAYERS, ROW, P, 16, 8, 32).unwrap();
    let mut p_state = vec![0u8; (rows * item) as usize];
    for (i, b) in p_state.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let mut cfg = EngineConfig::new(
        Role::Prefill,
        "e2e-state",
        &url,
        p_pools.topology(1, 0),
        p_pools.kv_pools(),
    );
    cfg.state = vec![pdxfer::engine::AuxBuffer {
        base: p_state.as_ptr() as u64,
        item_bytes: item,
        count: rows,
    }];
    // SAFETY: pools and state buffers outlive the engines in this test.
    let prefill = unsafe { Engine::new(cfg) }.unwrap();
    let mut decode = Vec::new();
    for r in 0..2u32 {
        let pools = SyntheticPools::new(LAYERS, ROW, P, 16, 8, 32).unwrap();
        let state = vec![0u8; (rows * item) as usize];
        let mut cfg = EngineConfig::new(
            Role::Decode,
            "e2e-state",
            &url,
            pools.topology(2, r),
            pools.kv_pools(),
        );
        cfg.state = vec![pdxfer::engine::AuxBuffer {
            base: state.as_ptr() as u64,
            item_bytes: item,
            count: rows,
        }];
        // SAFETY: as above.
        decode.push((unsafe { Engine::new(cfg) }.unwrap(), pools, state));
    }
    let room = 31;
    for (e, _, _) in &decode {
        e.receiver(room, 0, None).unwrap();
        assert_eq!(
            e.set_state_indices(room, &[9]).unwrap_err().status(),
            Status::OutOfBounds
        );
        e.set_state_indices(room, &[3]).unwrap();
        e.send_metadata(room, &[2, 5], 0, 0).unwrap();
    }
    prefill.sender(room).unwrap();
    assert!(
        prefill.set_state_indices(room, &[1, 2]).is_err(),
        "one row per state buffer"
    );
    prefill.set_state_indices(room, &[1]).unwrap();
    while prefill.poll(room) == KvPoll::Bootstrapping {
        std::thread::sleep(Duration::from_millis(5));
    }
    prefill.send(room, &[0, 1, 2, 3], 60, true, 0).unwrap();
    assert_eq!(
        prefill.wait(room, Duration::from_secs(20)),
        KvPoll::Success,
        "{:?}",
        prefill.failure(room)
    );
    for (e, _, state) in &decode {
        assert_eq!(e.wait(room, Duration::from_secs(20)), KvPoll::Success);
        // decode row 3 holds prefill row 1; other rows untouched
        assert_eq!(
            &state[(3 * item) as usize..(4 * item) as usize],
            &p_state[item as usize..(2 * item) as usize]
        );
        assert!(state[..(3 * item) as usize].iter().all(|&b| b == 0));
    }
}

/// Without an RDMA NIC, an engine asked for the rdma transport fails at
/// creation with the typed `no_rdma_device` and its reason; nothing panics.
#[test]
fn rdma_engine_without_a_nic_is_typed() {
    if std::path::Path::new("/sys/class/infiniband").exists() {
        common::skip("rdma-nic", "this machine has /sys/class/infiniband");
        return;
    }
    let pools = SyntheticPools::new(LAYERS, ROW, P, 4, 8, 32).unwrap();
    let mut cfg = EngineConfig::new(
        Role::Prefill,
        "e2e-rdma",
        "http://127.0.0.1:9",
        pools.topology(1, 0),
        pools.kv_pools(),
    );
    cfg.transport = TransportKind::Rdma;
    // SAFETY: pools outlive the (never created) engine.
    let e = unsafe { Engine::new(cfg) }.unwrap_err();
    assert_eq!(e.status(), Status::NoRdmaDevice, "{e}");
    assert!(e.detail().contains("infiniband"), "{e}");
}

/// Device-memory pools on a machine without a CUDA driver (or a build
/// without the `cuda` feature) are a typed error at creation, never a panic,
/// on a prefill and on a decode (tcp/auto); a decode with device pools over
/// cma is refused whatever the machine, naming what works; a too-small
/// staging buffer is named.
#[test]
fn device_pools_without_a_driver_are_typed() {
    let pools = SyntheticPools::new(2, ROW, P, 8, 0, 0).unwrap();
    let cfg = |role: Role, staging: u64| {
        let mut c = EngineConfig::new(
            role,
            "dev-nodriver",
            "http://127.0.0.1:1",
            pools.topology(1, 0),
            pools.kv_pools(),
        );
        c.pool_device = Some(0);
        c.staging_bytes = staging;
        c
    };
    // SAFETY: every creation below fails before the pools are used.
    let create = |c: EngineConfig| unsafe { Engine::new(c) }.unwrap_err();
    let driver = pdxfer::cuda::probe();
    let e = create(cfg(Role::Prefill, 1 << 20));
    match &driver {
        Err(d) => assert_eq!(e.status(), d.status(), "{e}"),
        // a real driver: the host pools are refused as not device memory
        Ok(_) => assert_eq!(e.status(), Status::InvalidArgument, "{e}"),
    }
    if cfg!(feature = "cuda") && driver.is_err() {
        assert_eq!(e.status(), Status::NoCudaDriver, "{e}");
    }
    if !cfg!(feature = "cuda") {
        assert_eq!(e.status(), Status::Unsupported, "{e}");
    }
    // A decode's device pools over tcp/auto: the same driver check as the prefill's.
    for tr in [TransportKind::Auto, TransportKind::Tcp] {
        let mut c = cfg(Role::Decode, 0);
        c.transport = tr;
        let e = create(c);
        match &driver {
            Err(d) => assert_eq!(e.status(), d.status(), "{tr:?}: {e}"),
            Ok(_) => assert_eq!(e.status(), Status::InvalidArgument, "{tr:?}: {e}"),
        }
    }
    // ... over cma: refused whatever the machine, naming why and what works.
    let mut c = cfg(Role::Decode, 1 << 20);
    c.transport = TransportKind::Cma;
    let e = create(c);
    assert_eq!(e.status(), Status::Unsupported, "{e}");
    assert!(e.detail().contains("process_vm_writev"), "{e}");
    assert!(e.detail().contains("tcp"), "{e}");
    let e = create(cfg(Role::Prefill, 0));
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert!(e.detail().contains("staging_bytes"), "{e}");
}

#[test]
fn a_prefill_abort_fails_the_decode_room_at_once() {
    let c = cluster("prefill-abort", 1, 2, TransportKind::Tcp, 1 << 20);
    let (room, dst) = (41u64, [3u64, 4]);
    for (e, _) in &c.decode {
        e.receiver(room, 0, Some(Duration::from_secs(20))).unwrap();
        e.send_metadata(room, &dst, 0, 5).unwrap();
    }
    c.prefill().sender(room).unwrap();
    let mut waited = 0;
    while c.prefill().poll(room) == KvPoll::Bootstrapping {
        std::thread::sleep(Duration::from_millis(5));
        waited += 1;
        assert!(waited < 2000, "prefill never saw the decode metadata");
    }
    c.prefill().abort(room).unwrap();
    for (r, (e, pools)) in c.decode.iter().enumerate() {
        // well before the 20 s room deadline
        assert_eq!(
            e.wait(room, Duration::from_secs(5)),
            KvPoll::Failed,
            "decode {r}"
        );
        assert_eq!(
            e.failure(room).unwrap().status(),
            Status::Aborted,
            "decode {r}"
        );
        assert!(
            (0..LAYERS as usize).all(|l| pools.layer_bytes(l).iter().all(|&b| b == 0)),
            "decode {r}: nothing was sent, nothing written"
        );
    }
}

/// Page ids address the same page of every pool, so they are checked against
/// each pool, not only the first: a smaller later pool would otherwise let a
/// gather (or the peer's writes) run past its end.
#[test]
fn page_ids_are_checked_against_every_pool_not_only_the_first() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let p_pools = SyntheticPools::new(LAYERS, ROW, P, 64, 8, 32).unwrap();
    let mut pools = p_pools.kv_pools();
    // the last layer's pool holds only 8 of the 64 pages
    pools[LAYERS as usize - 1].num_pages = 8;
    let mut cfg = EngineConfig::new(
        Role::Prefill,
        "e2e-unequal",
        &url,
        p_pools.topology(1, 0),
        pools,
    );
    cfg.aux = p_pools.aux_buffers();
    cfg.transport = TransportKind::Cma;
    // SAFETY: p_pools outlives the engine (dropped after it, below).
    let prefill = unsafe { Engine::new(cfg) }.unwrap();
    let d_pools = SyntheticPools::new(LAYERS, ROW, P, 32, 8, 32).unwrap();
    let mut dkv = d_pools.kv_pools();
    dkv[1].num_pages = 4;
    let mut dcfg = EngineConfig::new(
        Role::Decode,
        "e2e-unequal",
        &url,
        d_pools.topology(1, 0),
        dkv,
    );
    dcfg.aux = d_pools.aux_buffers();
    dcfg.transport = TransportKind::Cma;
    // SAFETY: d_pools outlives the engine (dropped after it, below).
    let decode = unsafe { Engine::new(dcfg) }.unwrap();
    decode
        .receiver(1, 0, Some(Duration::from_secs(20)))
        .unwrap();
    // page 10 exists in decode pool 0 (32 pages) but not in pool 1 (4 pages)
    let e = decode.send_metadata(1, &[2, 10], 0, 5).unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    assert!(
        e.detail().contains("dst_pages[1] = 10") && e.detail().contains("pool 1"),
        "{e}"
    );
    decode.send_metadata(1, &[2, 3], 0, 5).unwrap();
    prefill.sender(1).unwrap();
    let mut waited = 0;
    while prefill.poll(1) == KvPoll::Bootstrapping {
        std::thread::sleep(Duration::from_millis(5));
        waited += 1;
        assert!(waited < 2000, "prefill never saw the decode metadata");
    }
    // page 20 exists in prefill pool 0 (64 pages) but not in the last (8 pages)
    let e = prefill.send(1, &[1, 20], 2 * P, true, 3).unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    assert!(
        e.detail().contains("pages[1] = 20") && e.detail().contains("pool 3"),
        "{e}"
    );
    // pages inside every pool still move
    prefill.send(1, &[1, 7], 2 * P, true, 3).unwrap();
    assert_eq!(prefill.wait(1, Duration::from_secs(20)), KvPoll::Success);
    assert_eq!(decode.wait(1, Duration::from_secs(20)), KvPoll::Success);
    drop((prefill, decode));
    drop((p_pools, d_pools));
}

/// One QP error fails the rooms in flight on that data link, not the pair:
/// the prefill drops the broken rdma link and makes a new one (a fresh
/// handshake) for the next room, so later rooms succeed.
#[test]
fn a_qp_error_fails_its_room_and_later_rooms_reconnect_over_rdma() {
    use pdxfer::transport::rdma::fake;
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let p_pools = SyntheticPools::new(LAYERS, ROW, P, 64, 8, 32).unwrap();
    let mut cfg = EngineConfig::new(
        Role::Prefill,
        "e2e-redial",
        &url,
        p_pools.topology(1, 0),
        p_pools.kv_pools(),
    );
    cfg.aux = p_pools.aux_buffers();
    cfg.transport = TransportKind::Rdma;
    let nic = FakeNic::new("redial-p", 2, Mtu::Mtu4096);
    cfg.testing.nic = Some(nic.clone() as _);
    cfg.staging_bytes = 1 << 20;
    cfg.room_timeout = Duration::from_secs(20);
    // SAFETY: the pools live in the Cluster below, alongside the engine.
    let prefill = unsafe { Engine::new(cfg) }.unwrap();
    let decode = vec![rank(
        Role::Decode,
        "e2e-redial",
        &url,
        32,
        (1, 0),
        TransportKind::Rdma,
    )];
    let mut c = Cluster::from_parts(server, vec![(prefill, p_pools)], decode);
    c.receiver_timeout = Some(Duration::from_secs(20));
    let row_total = LAYERS as u64 * ROW;
    assert_eq!(c.request(1, 300, 0, 100), 300 * row_total + 32);
    let first = nic.qpns();
    assert_eq!(first.len(), 2, "one data link of two rails");
    // Both rails of the data link fail on their next work request.
    for q in &first {
        fake::fail_qp_after(*q, 0);
    }
    let room = 2;
    let (d, _) = &c.decode[0];
    d.receiver(room, 0, Some(Duration::from_secs(20))).unwrap();
    d.send_metadata(room, &[1, 2], 0, 5).unwrap();
    c.prefill().sender(room).unwrap();
    while c.prefill().poll(room) == KvPoll::Bootstrapping {
        std::thread::sleep(Duration::from_millis(5));
    }
    c.prefill().send(room, &[3, 4], 2 * P, true, 3).unwrap();
    assert_eq!(
        c.prefill().wait(room, Duration::from_secs(20)),
        KvPoll::Failed
    );
    let e = c.prefill().failure(room).unwrap();
    assert_eq!(e.status(), Status::RdmaCompletion, "{e}");
    assert!(e.detail().contains("IBV_WC_RETRY_EXC_ERR"), "{e}");
    assert_eq!(d.wait(room, Duration::from_secs(20)), KvPoll::Failed);
    d.clear(room).unwrap();
    c.prefill().clear(room).unwrap();
    assert!(first.iter().all(|q| !fake::qp_alive(*q)));
    // The next rooms of the same pair reconnect and move every byte (at
    // most 32 distinct decode pages a room).
    assert_eq!(c.request(3, 400, 128, 3), 272 * row_total + 32);
    assert_eq!(c.request(4, 300, 0, 100), 300 * row_total + 32);
    let qpns = nic.qpns();
    assert_eq!(qpns.len(), 4, "one new data link: {qpns:?}");
    assert!(qpns[2..].iter().all(|q| fake::qp_alive(*q)));
}

/// Rails are paired by GID subnet across engines: the prefill's rails A
/// (10.0.1.0/24), B (10.0.2.0/24) and the decode's B', A' listed crossed
/// connect A-A' and B-B' (the fake fabric has no route between the two
/// subnets, so pairing by index would fail with RETRY_EXC), and every byte
/// lands.
#[test]
fn rdma_rails_listed_crossed_pair_by_subnet() {
    use pdxfer::transport::rdma::handshake::{Gid, LinkLayer};
    let gid = |a: [u8; 4]| {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&a);
        Gid(g)
    };
    let nic = |name: &str, addrs: &[[u8; 4]]| {
        let n = FakeNic::with_link_layer(name, addrs.len(), Mtu::Mtu4096, LinkLayer::Ethernet);
        n.set_rail_addresses(&addrs.iter().map(|a| (gid(*a), 24)).collect::<Vec<_>>());
        n
    };
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let p_pools = SyntheticPools::new(LAYERS, ROW, P, 64, 8, 32).unwrap();
    let mut cfg = EngineConfig::new(
        Role::Prefill,
        "e2e-subnet",
        &url,
        p_pools.topology(1, 0),
        p_pools.kv_pools(),
    );
    cfg.aux = p_pools.aux_buffers();
    cfg.transport = TransportKind::Rdma;
    cfg.testing.nic = Some(nic("subnet-p", &[[10, 0, 1, 1], [10, 0, 2, 1]]) as _);
    cfg.staging_bytes = 1 << 20;
    cfg.room_timeout = Duration::from_secs(20);
    // SAFETY: the pools live in the Cluster below, alongside the engine.
    let prefill = unsafe { Engine::new(cfg) }.unwrap();
    let d_pools = cluster::pools(LAYERS, 32);
    let mut dcfg = cluster::config(
        Role::Decode,
        "e2e-subnet",
        &url,
        &d_pools,
        (1, 0),
        TransportKind::Rdma,
    );
    let d_nic = nic("subnet-d", &[[10, 0, 2, 2], [10, 0, 1, 2]]);
    dcfg.testing.nic = Some(d_nic.clone() as _);
    // SAFETY: the pools live in the Cluster below, alongside the engine.
    let decode = unsafe { Engine::new(dcfg) }.unwrap();
    let mut c = Cluster::from_parts(server, vec![(prefill, p_pools)], vec![(decode, d_pools)]);
    c.receiver_timeout = Some(Duration::from_secs(20));
    let row_total = LAYERS as u64 * ROW;
    assert_eq!(c.request(1, 300, 0, 100), 300 * row_total + 32);
    assert_eq!(c.request(2, 200, 0, 3), 200 * row_total + 32);
    assert_eq!(d_nic.qpns().len(), 2, "one data link of two rails");
}

/// Room grants held by each decode rank of `c`.
fn grants_held(c: &Cluster) -> Vec<u64> {
    c.decode
        .iter()
        .map(|(e, _)| e.metrics_snapshot().room_grants_held)
        .collect()
}

/// Opens `room` on every decode rank (metadata for pages `dst`) and on the
/// prefill, and waits until the prefill saw every decode rank's metadata.
fn open_room(c: &Cluster, room: u64, dst: &[u64], timeout: Duration) {
    let decode = c.decode.iter().map(|(e, _)| e);
    cluster::open_decode(decode, room, dst, 0, Some(timeout));
    c.senders(room);
    c.wait_bootstrapped(room);
}

/// The decode's metadata grants the room once per prefill rank; the grant
/// is released when the room succeeds, and the bytes are exact.
#[test]
fn cma_rooms_are_granted_with_the_metadata_and_released_on_success() {
    let mut c = cluster("grant-success", 1, 2, TransportKind::Cma, 1 << 20);
    let row_total = LAYERS as u64 * ROW;
    assert_eq!(grants_held(&c), [0, 0]);
    // a request whose metadata grants and whose success releases
    assert_eq!(c.request(1, 300, 0, 3), 300 * row_total + 2 * 32);
    assert_eq!(grants_held(&c), [0, 0], "released once the room succeeded");
    // held while the room is open
    open_room(&c, 2, &[4, 5], Duration::from_secs(20));
    assert_eq!(grants_held(&c), [1, 1], "one grant per decode rank");
    c.prefill().send(2, &[1, 2, 3, 4], 64, true, 3).unwrap();
    for (e, _) in &c.decode {
        assert_eq!(e.wait(2, Duration::from_secs(20)), KvPoll::Success);
    }
    assert_eq!(grants_held(&c), [0, 0]);
    // the metrics say so
    let m = c.decode[0].0.metrics();
    assert!(m.contains("pdxfer_engine_room_grants_held 0"), "{m}");
    assert!(
        m.contains("pdxfer_engine_control_messages_total{channel=\"engine\",direction=\"sent\"}"),
        "{m}"
    );
}

/// An aborted room's grants go once the prefill fenced the abort, a failed
/// room's at once, and a room past its deadline's at the deadline.
#[test]
fn abort_failure_and_deadline_revoke_the_room_grants() {
    let c = cluster("grant-revoke", 1, 2, TransportKind::Cma, 1 << 20);
    // decode abort: revoked once acknowledged (fenced)
    open_room(&c, 10, &[1, 2], Duration::from_secs(20));
    assert_eq!(grants_held(&c), [1, 1]);
    for (e, _) in &c.decode {
        e.abort(10).unwrap();
    }
    for (r, (e, _)) in c.decode.iter().enumerate() {
        let fenced = common::poll(Duration::from_secs(5), || e.is_fenced(10).then_some(()));
        assert!(fenced.is_some(), "decode {r}: the abort was never fenced");
    }
    assert_eq!(grants_held(&c), [0, 0], "revoked after the fenced abort");
    // a prefill abort fails the decode rooms: their grants go with them
    open_room(&c, 11, &[3, 4], Duration::from_secs(20));
    assert_eq!(grants_held(&c), [1, 1]);
    c.prefill().abort(11).unwrap();
    for (e, _) in &c.decode {
        assert_eq!(e.wait(11, Duration::from_secs(5)), KvPoll::Failed);
    }
    assert_eq!(grants_held(&c), [0, 0], "revoked when the room failed");
    // the room deadline (no prefill ever sends)
    for (e, _) in &c.decode {
        e.receiver(12, 0, Some(Duration::from_millis(300))).unwrap();
        e.send_metadata(12, &[5, 6], 0, 5).unwrap();
    }
    assert_eq!(grants_held(&c), [1, 1]);
    for (e, _) in &c.decode {
        assert_eq!(e.wait(12, Duration::from_secs(5)), KvPoll::Failed);
        assert_eq!(e.failure(12).unwrap().status(), Status::Timeout);
    }
    assert_eq!(grants_held(&c), [0, 0], "revoked at the deadline");
}

/// With room grants a room reaches each decode rank as one completion
/// record (after every byte landed), on every transport with grants.
#[test]
fn a_granted_room_is_one_completion_per_decode_rank_on_cma_tcp_and_rdma() {
    for transport in [TransportKind::Cma, TransportKind::Tcp, TransportKind::Rdma] {
        let name = format!("grant-records-{}", transport.name());
        let mut c = cluster(&name, 1, 2, transport, 1 << 20);
        let row_total = LAYERS as u64 * ROW;
        // chunked: several KV batches and the aux batch per decode rank
        assert_eq!(c.request(1, 300, 0, 3), 300 * row_total + 2 * 32);
        for (r, (e, _)) in c.decode.iter().enumerate() {
            let one = common::poll(Duration::from_secs(5), || {
                (e.metrics_snapshot().received_batches >= 1).then_some(())
            });
            assert!(one.is_some(), "{name}: decode {r} got no record");
            std::thread::sleep(Duration::from_millis(150)); // a later drain
            assert_eq!(
                e.metrics_snapshot().received_batches,
                1,
                "{name}: decode {r}: one record for the room"
            );
        }
        assert_eq!(grants_held(&c), [0, 0], "{name}");
    }
}

/// Pages of decode pool `l` resident in memory.
fn resident(pools: &SyntheticPools, l: usize) -> (usize, usize) {
    let b = pools.layer_bytes(l);
    // SAFETY: the layer's bytes are live memory of `pools` for this call.
    let n =
        unsafe { pdxfer::memory::prefault::resident_pages(b.as_ptr(), b.len()) }.expect("mincore");
    let (start, end) = (
        b.as_ptr() as usize / 4096,
        (b.as_ptr() as usize + b.len()).div_ceil(4096),
    );
    (n, end - start)
}

#[test]
fn a_decode_faults_its_host_pools_in_at_creation_unless_told_not_to() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    for prefault in [true, false] {
        // 40 MiB per layer: past glibc's largest mmap threshold (32 MiB), so
        // each pool is a fresh mapping, none of its pages touched yet (a
        // smaller one could be heap another test of this process freed,
        // already resident)
        let pools = SyntheticPools::new(LAYERS, ROW, P, 40 * 1024, 8, 32).unwrap();
        let before = resident(&pools, 1);
        assert!(
            before.0 * 2 < before.1,
            "fresh pool pages are not resident yet: {before:?}"
        );
        let name = format!("prefault-{prefault}");
        let mut cfg = EngineConfig::new(
            Role::Decode,
            &name,
            &url,
            pools.topology(1, 0),
            pools.kv_pools(),
        );
        cfg.aux = pools.aux_buffers();
        cfg.prefault = prefault;
        // SAFETY: the pools outlive the engine (dropped first, below).
        let engine = unsafe { Engine::new(cfg) }.unwrap();
        for l in 0..LAYERS as usize {
            let (n, total) = resident(&pools, l);
            if prefault {
                assert_eq!(n, total, "layer {l}: every page faulted in at creation");
            } else {
                assert!(
                    n * 2 < total,
                    "layer {l}: prefault off leaves the pages alone ({n} of {total})"
                );
            }
        }
        // not a byte changed
        assert!((0..LAYERS as usize).all(|l| pools.layer_bytes(l).iter().all(|&b| b == 0)));
        drop(engine);
    }
}

/// Prefill DCP `m` -> decode DCP `n` (m != n, both > 1): each decode rank
/// reads from every prefill rank whose share overlaps its positions (one for
/// 2 -> 4; two for 4 -> 2), chunked and with a prefix; every byte checked.
fn dcp_m_to_n(m: u32, n: u32, name: &str) {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let mut prefill: Vec<_> = (0..m)
        .map(|r| rank(Role::Prefill, name, &url, 32, (m, r), TransportKind::Cma))
        .collect();
    let decode: Vec<_> = (0..n)
        .map(|r| rank(Role::Decode, name, &url, 32, (n, r), TransportKind::Auto))
        .collect();
    let (vp, vd) = (P * u64::from(m), P * u64::from(n));
    let (room, prefix, total) = (33u64, vp.max(vd), 700u64);
    let dst_pages: Vec<u64> = (0..(total - prefix).div_ceil(vd))
        .map(|i| (i * 5 + 1) % 32)
        .collect();
    let src_pages = |r: u64| -> Vec<u64> {
        (0..(total - prefix).div_ceil(vp))
            .map(|i| (i * 3 + r) % 32)
            .collect()
    };
    for (r, (e, pools)) in prefill.iter_mut().enumerate() {
        let src = src_pages(r as u64);
        let side = Side {
            layout: DcpLayout::sglang(P, u64::from(m)).unwrap(),
            rank: r as u64,
            pages: &src,
            origin: prefix,
        };
        pools.fill(room, &side, total);
        pools.fill_aux(room, 2);
        e.sender(room).unwrap();
    }
    for (e, _) in &decode {
        e.receiver(room, 0, None).unwrap();
        e.send_metadata(room, &dst_pages, prefix, 6).unwrap();
    }
    for (r, (e, _)) in prefill.iter().enumerate() {
        let src = src_pages(r as u64);
        let mut waited = 0;
        while e.poll(room) == KvPoll::Bootstrapping {
            std::thread::sleep(Duration::from_millis(5));
            waited += 1;
            assert!(waited < 2000, "prefill {r}: no decode metadata");
        }
        // chunks of 2 local pages (2 prefill rounds of positions) each
        let mut sent = 0;
        for (i, c) in src.chunks(2).enumerate() {
            let last = (i + 1) * 2 >= src.len();
            let tokens = if last {
                total - prefix - sent
            } else {
                c.len() as u64 * vp
            };
            e.send(room, c, tokens, last, 2).unwrap();
            sent += tokens;
        }
    }
    for (r, (e, _)) in prefill.iter().enumerate() {
        assert_eq!(
            e.wait(room, Duration::from_secs(20)),
            KvPoll::Success,
            "prefill {r}: {:?}",
            e.failure(room)
        );
    }
    let dl = DcpLayout::sglang(P, u64::from(n)).unwrap();
    for (r, (e, pools)) in decode.iter().enumerate() {
        assert_eq!(
            e.wait(room, Duration::from_secs(20)),
            KvPoll::Success,
            "decode {r}: {:?}",
            e.failure(room)
        );
        let side = Side {
            layout: dl,
            rank: r as u64,
            pages: &dst_pages,
            origin: prefix,
        };
        let owned = dl.count_owned(r as u64, prefix, total);
        assert_eq!(
            pools.verify(room, &side, total, Some(6)).unwrap(),
            owned * LAYERS as u64 * ROW + 32,
            "decode {r}"
        );
        assert_eq!(e.room_bytes(room), owned * LAYERS as u64 * ROW);
    }
}

#[test]
fn dcp_2_to_4_each_decode_rank_reads_its_prefill_share() {
    dcp_m_to_n(2, 4, "e2e-2to4");
}

#[test]
fn dcp_4_to_2_each_decode_rank_reads_two_prefill_shares() {
    dcp_m_to_n(4, 2, "e2e-4to2");
}
