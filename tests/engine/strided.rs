//! KV pools with a page stride: block-outermost decode pools (every layer in
//! one allocation, a block row of `LAYERS + 1` pages, as vLLM's `BLNHC`
//! with a padding page), padded prefill pools (pages two apart), and both,
//! over cma, tcp and rdma (the software NIC; the same-process local
//! transport is the write paths' rig, `engine::path::write_tests`), in
//! whole-page copy (DCP 1 -> 1) and token
//! relayout (DCP 1 -> 2); every destination byte is checked and the bytes
//! between pages untouched ([`Cluster::finish`]). Pools that cannot be one
//! are refused, typed, before anything is opened.

use crate::support::cluster::{self, Cluster, Pools, P, ROW};
use pdxfer::bootstrap::schema::Role;
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, KvPool};
use pdxfer::transport::TransportKind;
use pdxfer::Status;
use std::time::Duration;

const LAYERS: u32 = 3;
const BLOCK_OUTERMOST: Pools = Pools::Strided {
    step: LAYERS as u64 + 1,
    interleaved: true,
    shared: false,
};
const PADDED: Pools = Pools::Strided {
    step: 2,
    interleaved: false,
    shared: false,
};

fn strided(name: &str, dcp: u32, t: TransportKind, prefill: Pools, decode: Pools) -> Cluster {
    Cluster::build(name, (1, dcp), t)
        .layers(LAYERS)
        .staging(1 << 16)
        .prefill_pools(prefill)
        .decode_pools(decode)
        .room_timeout(Duration::from_secs(20))
        .receiver_timeout(Duration::from_secs(20))
        .start()
}

#[test]
fn strided_pools_land_byte_exact_over_cma_tcp_and_rdma_by_page_and_by_token() {
    let row_total = u64::from(LAYERS) * ROW;
    for t in [TransportKind::Cma, TransportKind::Tcp, TransportKind::Rdma] {
        for dcp in [1u32, 2] {
            let mut cases = vec![
                ("strided decode", Pools::Heap, BLOCK_OUTERMOST),
                ("padded prefill", PADDED, Pools::Heap),
                ("both", PADDED, BLOCK_OUTERMOST),
            ];
            if t == TransportKind::Rdma {
                // interleaved views on both NICs: one memory region per allocation
                cases.push(("block-outermost both", BLOCK_OUTERMOST, BLOCK_OUTERMOST));
                cases.push(("padded decode", Pools::Heap, PADDED));
            }
            for (what, prefill, decode) in cases {
                let name = format!("strided-{}-{dcp}-{}", t.name(), what.replace(' ', "-"));
                let mut c = strided(&name, dcp, t, prefill, decode);
                let aux = u64::from(dcp) * 32;
                // chunked, with a decode prefix, and one page short of whole
                let got = c.request(1, 300, 0, 3);
                assert_eq!(got, 300 * row_total + aux, "{name}");
                let prefix = P * u64::from(dcp) * 2;
                let got = c.request(2, 250, prefix, 2);
                assert_eq!(got, (250 - prefix) * row_total + aux, "{name}");
            }
        }
    }
}

/// Block-outermost decode pools in shared pool allocations: a same-host
/// prefill over cma gathers every row straight into them (one copy), by page
/// and by token, the gaps untouched.
#[test]
fn strided_shared_decode_pools_take_the_one_copy_path() {
    let row_total = u64::from(LAYERS) * ROW;
    for (dcp, prefill) in [(1u32, Pools::Heap), (2, PADDED)] {
        let shared = Pools::Strided {
            step: LAYERS as u64 + 1,
            interleaved: true,
            shared: true,
        };
        let name = format!("strided-one-copy-{dcp}");
        let mut c = strided(&name, dcp, TransportKind::Cma, prefill, shared);
        let aux = u64::from(dcp) * 32;
        assert_eq!(c.request(1, 300, 0, 3), 300 * row_total + aux, "{name}");
        let s = c.prefill().metrics_snapshot();
        assert_eq!(
            s.one_copy_bytes,
            300 * row_total,
            "{name}: every KV byte in one copy"
        );
    }
}

/// The pools of a fresh synthetic rank, changed by `f`, as a decode engine.
fn engine_with(name: &str, t: TransportKind, f: impl Fn(&mut Vec<KvPool>)) -> pdxfer::Result<()> {
    let server = pdxfer::bootstrap::server::BootstrapServer::start(Default::default()).unwrap();
    let pools = SyntheticPools::new_strided(2, ROW, P, 8, 8, 32, 3, false).unwrap();
    let mut cfg = cluster::config(Role::Decode, name, &server.url(), &pools, (1, 0), t);
    f(&mut cfg.pools);
    // SAFETY: the pools outlive the engine (dropped at the end of this function).
    let e = unsafe { Engine::new(cfg) }?;
    e.close();
    Ok(())
}

#[test]
fn pools_that_cannot_be_strided_are_refused_typed() {
    let t = TransportKind::Tcp;
    engine_with("stride-ok", t, |_| {}).unwrap();
    let below = engine_with("stride-below", t, |p| {
        p[0].page_stride = p[0].page_bytes / 2
    })
    .unwrap_err();
    assert_eq!(below.status(), Status::InvalidLayout, "{below}");
    assert!(below.detail().contains("pool 0 (layer 0)"), "{below}");
    let odd = engine_with("stride-odd", t, |p| {
        p[1].page_stride = p[1].page_bytes * 3 + 8
    })
    .unwrap_err();
    assert_eq!(odd.status(), Status::InvalidLayout, "{odd}");
    let overflow = engine_with("stride-overflow", t, |p| {
        p[0].page_stride = p[0].page_bytes * (u64::MAX / p[0].page_bytes)
    })
    .unwrap_err();
    assert_eq!(overflow.status(), Status::InvalidLayout, "{overflow}");
    assert!(overflow.detail().contains("overflows"), "{overflow}");
    let mixed = engine_with("stride-mixed", t, |p| p[1].page_stride = p[1].page_bytes).unwrap_err();
    assert_eq!(mixed.status(), Status::GeometryMismatch, "{mixed}");
}
