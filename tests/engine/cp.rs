//! Prefill attention CP (C replicated pools) to decode DCP D, in one process:
//! both send modes, chunked sends, decode prefixes, more CP ranks than pages,
//! a final chunk with no token; every decode byte checked, every byte outside
//! the request left as it was, and an abort fenced with C senders.

use crate::support::cluster::{assert_success, config, AUX_ITEM, AUX_SLOT, ROW};
use crate::support::{self as common};
use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, KvPoll, SendOptions};
use pdxfer::layout::{cp_page_bounds, CpMode, DcpLayout, Side};
use pdxfer::transport::TransportKind;
use std::time::Duration;

const LAYERS: u32 = 2;
const PREFILL_PAGES: u64 = 80;
const DECODE_PAGES: u64 = 24;
/// The pattern a CP rank holds where it must not be read from.
const WRONG: u64 = 0xbad;

/// One request from C prefill CP ranks to D decode ranks.
struct Case {
    p: u64,
    c: u32,
    d: u32,
    len: u64,
    prefix: u64,
    /// The prefill's chunk ends (absolute positions, the last `len`).
    ends: Vec<u64>,
    mode: CpMode,
    /// Each chunk sent layer by layer (one call per layer).
    layered: bool,
}

struct Ranks {
    _server: BootstrapServer,
    prefill: Vec<(Engine, SyntheticPools)>,
    decode: Vec<(Engine, SyntheticPools)>,
}

fn start(name: &str, k: &Case) -> Ranks {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let mut prefill = Vec::new();
    for c in 0..k.c {
        let pools = SyntheticPools::new(LAYERS, ROW, k.p, PREFILL_PAGES, 8, 32).unwrap();
        let mut cfg = config(
            Role::Prefill,
            name,
            &url,
            &pools,
            (1, 0),
            TransportKind::Auto,
        );
        cfg.topology.attn_cp_size = k.c;
        cfg.topology.attn_cp_rank = c;
        cfg.topology.cp.mode = k.mode;
        // SAFETY: the pools are kept beside the engine.
        prefill.push((unsafe { Engine::new(cfg) }.unwrap(), pools));
    }
    let mut decode = Vec::new();
    for d in 0..k.d {
        let pools = SyntheticPools::new(LAYERS, ROW, k.p, DECODE_PAGES, 8, 32).unwrap();
        let cfg = config(
            Role::Decode,
            name,
            &url,
            &pools,
            (k.d, d),
            TransportKind::Auto,
        );
        // SAFETY: the pools are kept beside the engine.
        decode.push((unsafe { Engine::new(cfg) }.unwrap(), pools));
    }
    Ranks {
        _server: server,
        prefill,
        decode,
    }
}

fn dcp_side(p: u64, d: u64, rank: u64, pages: &[u64], origin: u64) -> Side<'_> {
    Side {
        layout: DcpLayout::sglang(p, d).unwrap(),
        rank,
        pages,
        origin,
    }
}

/// Runs one request and checks every decode byte; returns the request's pages.
fn run(name: &str, k: &Case, room: u64) {
    let mut r = start(name, k);
    let n_pages = (k.len - k.prefix).div_ceil(k.p);
    // scattered, distinct prefill pages (identical on every CP rank: replicas)
    let src: Vec<u64> = (0..n_pages).map(|i| (i * 7 + 3) % PREFILL_PAGES).collect();
    let dst: Vec<u64> = (0..(k.len - k.prefix).div_ceil(k.p * u64::from(k.d)))
        .map(|i| (i * 5 + 1) % DECODE_PAGES)
        .collect();
    // every CP rank holds the right rows only where it is the sender, so a
    // read from the wrong rank shows in the decode bytes
    for (c, (_, pools)) in r.prefill.iter_mut().enumerate() {
        let whole = dcp_side(k.p, 1, 0, &src, k.prefix);
        pools.fill(room + WRONG, &whole, k.len);
        let owned = match k.mode {
            CpMode::AllCp if k.c > 1 => cp_page_bounds(n_pages, c as u64, u64::from(k.c)),
            _ if c == 0 => 0..n_pages,
            _ => 0..0,
        };
        if !owned.is_empty() {
            let mine = &src[owned.start as usize..owned.end as usize];
            let side = dcp_side(k.p, 1, 0, mine, k.prefix + owned.start * k.p);
            pools.fill(room, &side, (k.prefix + owned.end * k.p).min(k.len));
        }
        pools.fill_aux(if c == 0 { room } else { room + WRONG }, AUX_ITEM);
    }
    for (e, _) in &r.decode {
        e.receiver(room, 0, None).unwrap();
        e.send_metadata(room, &dst, k.prefix, AUX_SLOT).unwrap();
    }
    for (e, _) in &r.prefill {
        e.sender(room).unwrap();
        e.set_request_pages(room, n_pages).unwrap();
    }
    for (c, (e, _)) in r.prefill.iter().enumerate() {
        let up = common::poll(Duration::from_secs(10), || {
            (e.poll(room) != KvPoll::Bootstrapping).then_some(())
        });
        assert!(up.is_some(), "CP rank {c} never left Bootstrapping");
        // a dummy rank answers at once; a sender once the decode's metadata came
        assert_eq!(
            e.decode_prefix_len(room),
            Some(if k.mode == CpMode::Rank0 && c > 0 {
                0
            } else {
                k.prefix
            })
        );
    }
    // every CP rank is driven with the same chunks, as SGLang's scheduler does
    for (e, _) in &r.prefill {
        let mut a = k.prefix;
        for &b in &k.ends {
            let off = ((a - k.prefix) / k.p) as usize;
            let np = (b - a).div_ceil(k.p) as usize;
            let pages = &src[off..off + np];
            if k.layered {
                for l in 0..LAYERS {
                    let o = SendOptions {
                        layers: Some(l..l + 1),
                        ..Default::default()
                    };
                    e.send_with(room, pages, b - a, b == k.len, AUX_ITEM, &o)
                        .unwrap();
                }
            } else {
                e.send(room, pages, b - a, b == k.len, AUX_ITEM).unwrap();
            }
            a = b;
        }
    }
    for (c, (e, _)) in r.prefill.iter().enumerate() {
        assert_success(e, room, &format!("{name}: CP rank {c}"));
    }
    for (d, (e, pools)) in r.decode.iter().enumerate() {
        assert_success(e, room, &format!("{name}: decode rank {d}"));
        let side = dcp_side(k.p, u64::from(k.d), d as u64, &dst, k.prefix);
        pools
            .verify(room, &side, k.len, Some(AUX_SLOT))
            .unwrap_or_else(|e| panic!("{name}: decode rank {d}: {e}"));
        untouched_outside(name, k, d as u64, &dst, pools);
    }
    for (e, _) in r.prefill.iter().chain(&r.decode) {
        e.close();
    }
}

/// Every decode row the request does not own, and every aux row but
/// [`AUX_SLOT`], is still zero.
fn untouched_outside(name: &str, k: &Case, d: u64, dst: &[u64], pools: &SyntheticPools) {
    let dd = u64::from(k.d);
    let mut mine = vec![false; (DECODE_PAGES * k.p) as usize];
    for t in (k.prefix..k.len).filter(|t| t % dd == d) {
        let i = t / dd - k.prefix / dd;
        mine[(dst[(i / k.p) as usize] * k.p + i % k.p) as usize] = true;
    }
    for l in 0..LAYERS as usize {
        let bytes = pools.layer_bytes(l);
        for (row, owned) in mine.iter().enumerate() {
            let at = row * ROW as usize;
            if !owned {
                assert!(
                    bytes[at..at + ROW as usize].iter().all(|&b| b == 0),
                    "{name}: decode rank {d} layer {l} row {row} outside the request was written"
                );
            }
        }
    }
}

fn case(p: u64, c: u32, d: u32, len: u64, prefix: u64, ends: &[u64], mode: CpMode) -> Case {
    Case {
        p,
        c,
        d,
        len,
        prefix,
        ends: if ends.is_empty() {
            vec![len]
        } else {
            ends.to_vec()
        },
        mode,
        layered: false,
    }
}

#[test]
fn all_cp_ranks_send_their_pages_c_below_and_above_d() {
    use CpMode::AllCp;
    run("cp-2-4", &case(16, 2, 4, 300, 0, &[], AllCp), 1);
    run("cp-4-2", &case(16, 4, 2, 300, 0, &[], AllCp), 2);
    run("cp-4-4", &case(16, 4, 4, 197, 0, &[], AllCp), 3);
}

#[test]
fn all_cp_ranks_chunked_prefixed_and_c_not_dividing_d() {
    use CpMode::AllCp;
    run(
        "cp-chunks",
        &case(16, 2, 4, 411, 0, &[96, 224, 320, 411], AllCp),
        4,
    );
    run("cp-prefix", &case(16, 4, 2, 300, 64, &[160, 300], AllCp), 5);
    run("cp-3-4", &case(16, 3, 4, 261, 0, &[128, 261], AllCp), 6);
}

#[test]
fn all_cp_ranks_edge_shapes() {
    use CpMode::AllCp;
    // page size 1
    run("cp-p1", &case(1, 2, 4, 37, 0, &[], AllCp), 7);
    // 5 pages over 8 CP ranks: three ranks have an empty share and still report
    run("cp-8-2", &case(16, 8, 2, 70, 0, &[], AllCp), 8);
    // one token
    run("cp-one", &case(16, 2, 2, 1, 0, &[], AllCp), 9);
    // everything cached: the final chunk carries only the aux row
    run("cp-cached", &case(16, 2, 4, 128, 128, &[128], AllCp), 10);
}

#[test]
fn rank0_mode_sends_from_cp_rank_zero_and_dummies_conclude() {
    use CpMode::Rank0;
    run("cp-r0", &case(16, 2, 4, 300, 0, &[], Rank0), 11);
    run(
        "cp-r0-chunks",
        &case(16, 3, 2, 300, 64, &[128, 256, 300], Rank0),
        12,
    );
    run("cp-r0-p64", &case(64, 2, 4, 300, 0, &[], Rank0), 13);
}

#[test]
fn page_size_64_all_cp_ranks() {
    run(
        "cp-p64",
        &case(64, 2, 4, 1000, 0, &[512, 1000], CpMode::AllCp),
        14,
    );
}

#[test]
fn layer_wise_sends_in_both_modes() {
    for (i, mode) in [CpMode::AllCp, CpMode::Rank0].into_iter().enumerate() {
        let mut k = case(16, 3, 2, 300, 32, &[128, 224, 300], mode);
        k.layered = true;
        run(&format!("cp-layers-{i}"), &k, 15 + i as u64);
    }
}

#[test]
fn a_decode_abort_with_cp_senders_is_fenced() {
    let k = case(16, 2, 2, 300, 0, &[], CpMode::AllCp);
    let r = start("cp-abort", &k);
    let room = 20;
    let dst: Vec<u64> = (0..10).collect();
    for (e, _) in &r.decode {
        e.receiver(room, 0, None).unwrap();
        e.send_metadata(room, &dst, 0, AUX_SLOT).unwrap();
    }
    for (e, _) in &r.prefill {
        e.sender(room).unwrap();
        e.set_request_pages(room, 19).unwrap();
    }
    for (e, _) in &r.prefill {
        let up = common::poll(Duration::from_secs(10), || {
            (e.poll(room) == KvPoll::WaitingForInput).then_some(())
        });
        assert!(up.is_some());
        // the first chunk only: the room is mid-request
        e.send(room, &(0..4).collect::<Vec<_>>(), 64, false, AUX_ITEM)
            .unwrap();
    }
    for (e, _) in &r.decode {
        e.abort(room).unwrap();
    }
    for (d, (e, _)) in r.decode.iter().enumerate() {
        let fenced = common::poll(Duration::from_secs(10), || e.is_fenced(room).then_some(()));
        assert!(
            fenced.is_some(),
            "decode rank {d}: the abort was never fenced"
        );
    }
    for (c, (e, _)) in r.prefill.iter().enumerate() {
        assert_eq!(
            e.wait(room, Duration::from_secs(10)),
            KvPoll::Failed,
            "CP rank {c}"
        );
    }
    for (e, _) in r.prefill.iter().chain(&r.decode) {
        e.close();
    }
}

#[test]
fn an_all_cp_sender_needs_the_request_page_count() {
    let k = case(16, 2, 2, 64, 0, &[], CpMode::AllCp);
    let r = start("cp-pages", &k);
    let room = 30;
    for (e, _) in &r.decode {
        e.receiver(room, 0, None).unwrap();
        e.send_metadata(room, &[0, 1], 0, AUX_SLOT).unwrap();
    }
    let e = &r.prefill[1].0;
    e.sender(room).unwrap();
    let up = common::poll(Duration::from_secs(10), || {
        (e.poll(room) == KvPoll::WaitingForInput).then_some(())
    });
    assert!(up.is_some());
    let err = e.send(room, &[0, 1, 2, 3], 64, true, AUX_ITEM).unwrap_err();
    assert!(err.detail().contains("set_request_pages"), "{err}");
    // refused, nothing changed: the same chunk goes once the count is given
    e.set_request_pages(room, 4).unwrap();
    e.send(room, &[0, 1, 2, 3], 64, true, AUX_ITEM).unwrap();
    for (e, _) in r.prefill.iter().chain(&r.decode) {
        e.close();
    }
}

fn split_word(room: u64, layer: u64, t: u64, j: u64) -> u64 {
    ((room * 1_000_003 + layer * 10_007 + t) << 8 | j) + 1
}

/// A DSA-style layer split (each CP rank holds some layers, every page) to a
/// decode without DCP: each CP rank sends every page of its own layers, as
/// pipeline stages do, and the decode waits for both.
#[test]
fn layer_split_cp_ranks_send_their_layers_to_a_decode_without_dcp() {
    use pdxfer::layout::CpStorage;
    let (c, per, p, len, prefix, room) = (2u32, 2u32, 16u64, 150u64, 32u64, 40u64);
    let name = "cp-layer-split";
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let n_pages = (len - prefix).div_ceil(p);
    let src: Vec<u64> = (0..n_pages).map(|i| (i * 7 + 3) % PREFILL_PAGES).collect();
    let dst: Vec<u64> = (0..n_pages).map(|i| (i * 5 + 1) % DECODE_PAGES).collect();
    let words = (ROW / 8) as usize;
    let mut prefill = Vec::new();
    for k in 0..c {
        let mut pools = SyntheticPools::new(per, ROW, p, PREFILL_PAGES, 8, 32).unwrap();
        for l in 0..per as usize {
            let layer = u64::from(k * per) + l as u64;
            let bytes = pools.layer_bytes_mut(l);
            for t in prefix..len {
                let row = (src[((t - prefix) / p) as usize] * p + (t - prefix) % p) as usize;
                for j in 0..words {
                    let at = (row * words + j) * 8;
                    bytes[at..at + 8]
                        .copy_from_slice(&split_word(room, layer, t, j as u64).to_le_bytes());
                }
            }
        }
        pools.fill_aux(if k == 0 { room } else { room + WRONG }, AUX_ITEM);
        let mut cfg = config(
            Role::Prefill,
            name,
            &url,
            &pools,
            (1, 0),
            TransportKind::Auto,
        );
        cfg.topology.attn_cp_size = c;
        cfg.topology.attn_cp_rank = k;
        cfg.topology.cp.storage = CpStorage::LayerSplit;
        for (l, e) in cfg.topology.entries.iter_mut().enumerate() {
            e.layer_id = k * per + l as u32;
        }
        for (l, pool) in cfg.pools.iter_mut().enumerate() {
            pool.layer_id = k * per + l as u32;
        }
        // SAFETY: the pools are kept beside the engine.
        prefill.push((unsafe { Engine::new(cfg) }.unwrap(), pools));
    }
    let dpools = SyntheticPools::new(c * per, ROW, p, DECODE_PAGES, 8, 32).unwrap();
    let cfg = config(
        Role::Decode,
        name,
        &url,
        &dpools,
        (1, 0),
        TransportKind::Auto,
    );
    // SAFETY: the pools are kept beside the engine.
    let dec = unsafe { Engine::new(cfg) }.unwrap();
    dec.receiver(room, 0, None).unwrap();
    dec.send_metadata(room, &dst, prefix, AUX_SLOT).unwrap();
    for (e, _) in &prefill {
        e.sender(room).unwrap();
        e.set_request_pages(room, n_pages).unwrap();
        let up = common::poll(Duration::from_secs(10), || {
            (e.poll(room) == KvPoll::WaitingForInput).then_some(())
        });
        assert!(up.is_some());
        e.send(room, &src[..4], 4 * p, false, AUX_ITEM).unwrap();
        e.send(room, &src[4..], len - prefix - 4 * p, true, AUX_ITEM)
            .unwrap();
    }
    for (k, (e, _)) in prefill.iter().enumerate() {
        assert_success(e, room, &format!("CP rank {k}"));
    }
    assert_success(&dec, room, "decode");
    // the aux row, from CP rank 0 (no KV position asked of the synthetic pattern)
    let side = dcp_side(p, 1, 0, &dst, prefix);
    dpools.verify(room, &side, prefix, Some(AUX_SLOT)).unwrap();
    for l in 0..(c * per) as usize {
        let bytes = dpools.layer_bytes(l);
        let mut mine = vec![false; (DECODE_PAGES * p) as usize];
        for t in prefix..len {
            let row = (dst[((t - prefix) / p) as usize] * p + (t - prefix) % p) as usize;
            mine[row] = true;
            for j in 0..words {
                let at = (row * words + j) * 8;
                let got = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
                assert_eq!(
                    got,
                    split_word(room, l as u64, t, j as u64),
                    "layer {l} position {t}"
                );
            }
        }
        for (row, owned) in mine.iter().enumerate() {
            let at = row * ROW as usize;
            assert!(
                *owned || bytes[at..at + ROW as usize].iter().all(|&b| b == 0),
                "layer {l} row {row}"
            );
        }
    }
    for (e, _) in &prefill {
        e.close();
    }
    dec.close();
}
