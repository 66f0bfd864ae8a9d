//! Fuzz targets shared by the cargo-fuzz binaries (`fuzz/fuzz_targets/*.rs`,
//! long runs through `scripts/fuzz.sh`) and the bounded, seeded property test
//! `tests/abi/fuzz_smoke.rs` that `cargo test` runs on the stable toolchain.
//!
//! Each target takes arbitrary bytes and must return without panicking,
//! hanging or touching memory it was not given; decoders that accept an input
//! must also round-trip it (encode, decode again, same value).

#![allow(dead_code)]

use pdxfer::auth::{AuthChallenge, AuthHello, AuthProof, Mode};
use pdxfer::bootstrap::schema::{
    from_json, PeerHello, RegisterAck, RegisterRequest, Registration, Summary,
};
use pdxfer::engine::control::{CtlMsg, CtlReader};
use pdxfer::transport::handshake::{Attach, Hello, HelloAck, Select};
use pdxfer::transport::landed::Landed;
use pdxfer::transport::peer_auth::authenticate_server;
use pdxfer::transport::wire::{self, DataHeader, FrameType, DATA_HEADER_LEN};
use std::ffi::c_char;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::OnceLock;

/// The names `run` accepts, one per cargo-fuzz binary.
pub const TARGETS: &[&str] = &[
    "wire",
    "transport_handshake",
    "rdma_handshake",
    "control",
    "control_stream",
    "bootstrap_json",
    "c_abi",
];

/// Runs target `name` on `data`.
pub fn run(name: &str, data: &[u8]) {
    match name {
        "wire" => wire_records(data),
        "transport_handshake" => transport_handshake(data),
        "rdma_handshake" => rdma_handshake(data),
        "control" => control(data),
        "control_stream" => control_stream(data),
        "bootstrap_json" => bootstrap_json(data),
        "c_abi" => c_abi(data),
        other => panic!("unknown fuzz target {other}"),
    }
}

/// Valid encodings to mutate from, per target (a fuzzer also starts from these).
pub fn seeds(name: &str) -> Vec<Vec<u8>> {
    use pdxfer::transport::wire::{Commit, Range};
    let frame = |ty: FrameType, p: &[u8]| {
        let mut v = Vec::new();
        wire::write_frame(&mut v, ty, p).unwrap();
        v
    };
    match name {
        "wire" => {
            let intent = wire::encode_intent(
                7,
                &[
                    Range {
                        region: 1,
                        offset: 64,
                        len: 4096,
                    },
                    Range {
                        region: 2,
                        offset: 0,
                        len: 8,
                    },
                ],
            );
            let commit = wire::encode_commit(&Commit {
                batch: 7,
                bytes: 4104,
                checksum: Some(9),
                room: 3,
                epoch: 1,
            });
            let reason = wire::encode_reason(7, &pdxfer::Error::new(pdxfer::Status::Protocol, "x"));
            let hdr = DataHeader {
                flags: 1,
                batch: 7,
                region: 1,
                offset: 64,
                len: 4096,
            }
            .encode();
            vec![
                [vec![0], intent.clone()].concat(),
                [vec![1], commit.clone()].concat(),
                [vec![2], reason].concat(),
                [vec![3], 7u64.to_le_bytes().to_vec()].concat(),
                [vec![4], hdr.to_vec()].concat(),
                [
                    vec![5],
                    frame(FrameType::Intent, &intent),
                    frame(FrameType::Commit, &commit),
                ]
                .concat(),
            ]
        }
        "transport_handshake" => {
            let id = r#"{"pid":1,"start_time":2,"boot_id":"b","hostname":"h"}"#;
            vec![
                [vec![0], frame(FrameType::Hello, format!(r#"{{"version":1,"identity":{id}}}"#).as_bytes())].concat(),
                [vec![1], frame(FrameType::HelloAck, format!(r#"{{"version":1,"identity":{id},"regions":[],"session":1,"token":"0123456789abcdef0123456789abcdef","nonce_addr":3}}"#).as_bytes())].concat(),
                [vec![2], frame(FrameType::Select, br#"{"transport":"tcp","streams":2,"proof":0}"#)].concat(),
                [vec![3], frame(FrameType::Attach, br#"{"session":1,"token":"0123456789abcdef0123456789abcdef","index":0}"#)].concat(),
                [vec![0], frame(FrameType::Error, br#"{"code":-401,"detail":"no"}"#)].concat(),
                [vec![4], frame(FrameType::AuthHello, AUTH_HELLO.as_bytes())].concat(),
                [vec![5], frame(FrameType::AuthChallenge, AUTH_CHALLENGE.as_bytes())].concat(),
                [vec![6], frame(FrameType::AuthProof, AUTH_PROOF.as_bytes())].concat(),
                // the accepting side's whole exchange: hello, then a proof
                [
                    vec![7],
                    frame(FrameType::AuthHello, AUTH_HELLO.as_bytes()),
                    frame(FrameType::AuthProof, AUTH_PROOF.as_bytes()),
                ]
                .concat(),
            ]
        }
        #[cfg(feature = "rdma")]
        "rdma_handshake" => {
            use pdxfer::transport::rdma::handshake::Handshake;
            let mut v = b"PDXR".to_vec();
            v.extend_from_slice(&Handshake::VERSION.to_le_bytes());
            v.extend_from_slice(&0u16.to_le_bytes());
            v.extend_from_slice(&42u64.to_le_bytes());
            v.extend_from_slice(&1u16.to_le_bytes());
            v.push(5);
            v.extend_from_slice(b"mlx5_0");
            v.truncate(v.len() - 1); // name length 5: "mlx5_"
            v.extend_from_slice(&[1, 1, 0, 5]);
            v.extend_from_slice(&0x1234u32.to_le_bytes());
            v.extend_from_slice(&7u16.to_le_bytes());
            v.extend_from_slice(&0x55u32.to_le_bytes());
            v.extend_from_slice(&[0u8; 16]);
            v.push(24); // IPv4 prefix length
            v.extend_from_slice(&1u32.to_le_bytes());
            v.extend_from_slice(&0x1000u64.to_le_bytes());
            v.extend_from_slice(&0x2000u64.to_le_bytes());
            v.extend_from_slice(&9u32.to_le_bytes());
            vec![v]
        }
        "control" | "control_stream" => {
            let hello = format!(r#"{{"type":"auth_hello","auth":{AUTH_HELLO}}}"#);
            let challenge = format!(r#"{{"type":"auth_challenge","auth":{AUTH_CHALLENGE}}}"#);
            let proof = format!(r#"{{"type":"auth_proof","auth":{AUTH_PROOF}}}"#);
            let msgs = [
                hello.as_str(),
                challenge.as_str(),
                proof.as_str(),
                r#"{"type":"meta","room":1,"attempt":1,"dst_pages":[1,2,3],"decode_prefix_len":0,"aux_index":0,"required_dst_info_num":2,"timeout_ms":100}"#,
                r#"{"type":"status","room":1,"attempt":1,"ok":false,"prefill_rank":0,"bytes":5,"reason":"x","code":-401}"#,
                r#"{"type":"dummy_meta","room":1,"attempt":1,"decode_prefix_len":16}"#,
                r#"{"type":"abort","room":1,"attempt":2}"#,
                r#"{"type":"abort_ack","room":1,"attempt":2}"#,
            ];
            let all = msgs.join("\n") + "\n";
            let mut v: Vec<Vec<u8>> = msgs.iter().map(|m| m.as_bytes().to_vec()).collect();
            v.push(all.into_bytes());
            v
        }
        "bootstrap_json" => {
            let reg = registration_json();
            vec![
                [vec![0], reg.clone().into_bytes()].concat(),
                [
                    vec![1],
                    format!(r#"{{"registration":{reg},"ttl_ms":3000}}"#).into_bytes(),
                ]
                .concat(),
                [
                    vec![3],
                    br#"{"epoch":1,"registered_at_ms":2,"lease_id":3,"ttl_ms":4,"replaced":false}"#
                        .to_vec(),
                ]
                .concat(),
            ]
        }
        #[cfg(not(feature = "rdma"))]
        "rdma_handshake" => vec![Vec::new()],
        "c_abi" => vec![vec![0; 64], (0..=255u8).collect(), vec![0xff; 300]],
        _ => Vec::new(),
    }
}

fn registration_json() -> String {
    use pdxfer::bootstrap::schema::{InstanceId, Role};
    use pdxfer::layout::{KvDtype, KvEntry, PoolKind, Topology};
    let t = Topology {
        engine_rank: 0,
        attn_tp_size: 2,
        attn_tp_rank: 1,
        attn_cp_size: 1,
        attn_cp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        dcp_size: 2,
        dcp_rank: 1,
        dcp_interleave: 1,
        page_size: 16,
        kv_dtype: KvDtype::Bf16,
        pool: PoolKind::Mla,
        entries: vec![KvEntry {
            layer_id: 0,
            row_bytes: 64,
        }],
        cp: Default::default(),
    };
    let r = Registration::new("c1", Role::Decode, InstanceId(5), t);
    serde_json::to_string(&r).unwrap()
}

// ----- wire records -----

fn wire_records(data: &[u8]) {
    let Some((&sel, p)) = data.split_first() else {
        return;
    };
    match sel % 6 {
        0 => {
            if let Ok((batch, ranges)) = wire::decode_intent(p) {
                let again = wire::decode_intent(&wire::encode_intent(batch, &ranges))
                    .expect("re-decode intent");
                assert_eq!(again.0, batch);
                assert_eq!(again.1.len(), ranges.len());
            }
        }
        1 => {
            if let Ok(c) = wire::decode_commit(p) {
                let again =
                    wire::decode_commit(&wire::encode_commit(&c)).expect("re-decode commit");
                assert_eq!(format!("{again:?}"), format!("{c:?}"));
            }
        }
        2 => {
            if let Ok((b, e)) = wire::decode_reason(p) {
                let (b2, e2) =
                    wire::decode_reason(&wire::encode_reason(b, &e)).expect("re-decode reason");
                assert_eq!((b2, e2.status()), (b, e.status()));
            }
            let _ = wire::decode_error(p);
        }
        3 => {
            let _ = wire::decode_batch(p);
            // a RoomLanded answer: what decodes re-encodes to the same ranges
            if let Ok((token, l)) = Landed::decode(p) {
                let (t2, again) = Landed::decode(&l.encode(token)).expect("re-decode room landed");
                assert_eq!((t2, again), (token, l));
            }
        }
        4 => {
            if p.len() >= DATA_HEADER_LEN {
                let h: &[u8; DATA_HEADER_LEN] = p[..DATA_HEADER_LEN].try_into().unwrap();
                if let Ok(d) = DataHeader::decode(h) {
                    // bytes 12..16 are reserved and ignored, so compare decoded values
                    assert_eq!(
                        DataHeader::decode(&d.encode()).expect("re-decode"),
                        d,
                        "data header does not round-trip"
                    );
                }
            }
        }
        _ => {
            // a stream of frames: read until the first error, bounded
            let mut r = p;
            for _ in 0..64 {
                if wire::read_frame(&mut r).is_err() {
                    break;
                }
            }
        }
    }
}

const AUTH_HELLO: &str = r#"{"version":1,"instance":"0123456789abcdef0123456789abcdef","nonce":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef","secret":true}"#;
const AUTH_CHALLENGE: &str = r#"{"version":1,"instance":"0123456789abcdef0123456789abcdef","nonce":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef","proof":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}"#;
const AUTH_PROOF: &str =
    r#"{"proof":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}"#;

/// Reads from the fuzz input, discards what is written (the accepting side
/// of the auth exchange talks to it).
struct Duplex<'a>(&'a [u8]);

impl std::io::Read for Duplex<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Duplex<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn transport_handshake(data: &[u8]) {
    let Some((&sel, p)) = data.split_first() else {
        return;
    };
    let mut r = p;
    match sel % 8 {
        4 => {
            let _ = wire::read_json_max::<AuthHello>(
                &mut r,
                FrameType::AuthHello,
                wire::MAX_UNAUTHENTICATED_PAYLOAD,
            );
        }
        5 => {
            let _ = wire::read_json_max::<AuthChallenge>(
                &mut r,
                FrameType::AuthChallenge,
                wire::MAX_UNAUTHENTICATED_PAYLOAD,
            );
        }
        6 => {
            let _ = wire::read_json_max::<AuthProof>(
                &mut r,
                FrameType::AuthProof,
                wire::MAX_UNAUTHENTICATED_PAYLOAD,
            );
        }
        7 => {
            static MODE: OnceLock<Mode> = OnceLock::new();
            let mode = MODE
                .get_or_init(|| Mode::from_option(Some("fuzz-cluster-secret-0123456789")).unwrap());
            // random bytes never prove the secret
            let r = authenticate_server(&mut Duplex(p), mode, [1; 16]);
            assert!(r.is_err(), "the fuzz input authenticated");
        }
        0 => {
            let _ = wire::read_json::<Hello>(&mut r, FrameType::Hello);
        }
        1 => {
            let _ = wire::read_json::<HelloAck>(&mut r, FrameType::HelloAck);
        }
        2 => {
            let _ = wire::read_json::<Select>(&mut r, FrameType::Select);
        }
        _ => {
            let _ = wire::read_json::<Attach>(&mut r, FrameType::Attach);
        }
    }
}

#[cfg(not(feature = "rdma"))]
fn rdma_handshake(_data: &[u8]) {}

#[cfg(feature = "rdma")]
fn rdma_handshake(data: &[u8]) {
    use pdxfer::transport::rdma::handshake::Handshake;
    if let Ok(h) = Handshake::decode(data) {
        let enc = h.encode().expect("a decoded handshake encodes");
        assert_eq!(
            Handshake::decode(&enc).expect("re-decode"),
            h,
            "rdma handshake does not round-trip"
        );
    }
}

// ----- engine control channel -----

fn control(data: &[u8]) {
    if let Ok(m) = serde_json::from_slice::<CtlMsg>(data) {
        let enc = serde_json::to_vec(&m).unwrap();
        assert_eq!(
            serde_json::from_slice::<CtlMsg>(&enc).unwrap(),
            m,
            "control message does not round-trip"
        );
    }
}

fn listener() -> &'static TcpListener {
    static L: OnceLock<TcpListener> = OnceLock::new();
    L.get_or_init(|| TcpListener::bind("127.0.0.1:0").expect("bind loopback"))
}

/// The real framed reader over a loopback connection carrying `data`.
fn control_stream(data: &[u8]) {
    let l = listener();
    let c = TcpStream::connect(l.local_addr().unwrap()).expect("connect loopback");
    let (s, _) = l.accept().expect("accept");
    let owned = data.to_vec();
    let w = std::thread::spawn(move || {
        let mut c = c;
        let _ = c.write_all(&owned);
        let _ = c.shutdown(std::net::Shutdown::Write);
    });
    let mut r = CtlReader::new(s);
    // every line is at least one byte, so this bound is never the limit
    for _ in 0..=data.len() {
        match r.recv() {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => {}
        }
    }
    w.join().unwrap();
}

// ----- bootstrap JSON -----

fn bootstrap_json(data: &[u8]) {
    let Some((&sel, p)) = data.split_first() else {
        return;
    };
    match sel % 5 {
        0 => {
            if let Ok(r) = from_json::<Registration>(p, "registration") {
                let _ = r.validate();
                let _ = r.describe();
                let _ = r.layout();
                let enc = serde_json::to_vec(&r).unwrap();
                assert_eq!(
                    from_json::<Registration>(&enc, "again").unwrap(),
                    r,
                    "registration does not round-trip"
                );
            }
        }
        1 => {
            if let Ok(r) = from_json::<RegisterRequest>(p, "register request") {
                let _ = r.registration.validate();
            }
        }
        2 => {
            let _ = from_json::<PeerHello>(p, "hello");
        }
        3 => {
            let _ = from_json::<RegisterAck>(p, "ack");
        }
        _ => {
            let _ = from_json::<Summary>(p, "summary");
        }
    }
}

// ----- C ABI -----

/// Reads fuzz input as a sequence of small integers (zeros once exhausted).
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u64(&mut self) -> u64 {
        let mut v = 0u64;
        for i in 0..8 {
            v |= u64::from(self.u8()) << (8 * i);
        }
        v
    }
    /// A small value most of the time, any u64 sometimes.
    fn num(&mut self) -> u64 {
        match self.u8() % 8 {
            0 => self.u64(),
            1 => 0,
            _ => u64::from(self.u8() % 33),
        }
    }
    /// True with probability about 1/n.
    fn one_in(&mut self, n: u8) -> bool {
        self.u8().is_multiple_of(n)
    }
    fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.u8()).collect()
    }
    /// A NUL-terminated string of fuzzed bytes (NUL bytes inside end it early).
    fn cstring(&mut self) -> Vec<u8> {
        let n = usize::from(self.u8() % 48);
        let mut v: Vec<u8> = self.bytes(n).into_iter().filter(|&b| b != 0).collect();
        v.push(0);
        v
    }
}

/// An exported function may fail, never panic internally (the boundary
/// would catch it, but an internal panic is a bug: an unchecked case).
fn no_panic(s: pdxfer::ffi::PdxStatus) {
    if s == pdxfer::ffi::PdxStatus::Panic {
        // SAFETY: the library's last-error string is NUL-terminated and thread-local.
        let msg = unsafe { std::ffi::CStr::from_ptr(pdxfer::ffi::status::pdxfer_last_error()) };
        panic!("internal panic behind the C boundary: {msg:?}");
    }
}

fn ptr_or_null<T>(v: &[T], null: bool) -> *const T {
    if null {
        std::ptr::null()
    } else {
        v.as_ptr()
    }
}

/// The exported functions with fuzzed struct contents, NULLs, sizes and
/// lengths. Every pointer is NULL or points at a live buffer of at least the
/// length passed with it (what the C contract asks of a caller); everything
/// else is arbitrary. Page sizes and counts are kept small so a plan call
/// stays fast (the planner is linear in tokens by design).
fn c_abi(data: &[u8]) {
    use pdxfer::ffi::plan::*;
    use pdxfer::ffi::status::*;
    use pdxfer::ffi::topology::*;
    let mut f = Input(data);
    // status strings for any code
    let code = f.u64() as i32;
    for p in [
        pdxfer_status_str(code),
        pdxfer_status_kind(code),
        pdxfer_last_error(),
    ] {
        if !p.is_null() {
            // SAFETY: the library returns NUL-terminated static or thread-local strings.
            let _ = unsafe { std::ffi::CStr::from_ptr(p) };
        }
    }
    let topo = |f: &mut Input, ids: &mut Vec<u32>, rows: &mut Vec<u64>| -> PdxTopology {
        let n = usize::from(f.u8() % 5);
        *ids = (0..n).map(|_| f.num() as u32).collect();
        *rows = (0..n).map(|_| f.num()).collect();
        let size = std::mem::size_of::<PdxTopology>() as u64;
        let lie = f.one_in(8);
        PdxTopology {
            struct_size: match f.u8() % 6 {
                0 => f.u64() % 256,
                1 => size + 16,
                _ => size,
            },
            engine_rank: f.num() as u32,
            attn_tp_size: f.num() as u32,
            attn_tp_rank: f.num() as u32,
            attn_cp_size: f.num() as u32,
            attn_cp_rank: f.num() as u32,
            pp_size: f.num() as u32,
            pp_rank: f.num() as u32,
            dcp_size: f.num() as u32,
            dcp_rank: f.num() as u32,
            dcp_interleave: f.num() as u32,
            page_size: f.num() as u32,
            kv_dtype: f.num() as u32,
            pool_kind: f.num() as u32,
            reserved: f.num() as u32,
            // a count larger than the arrays only ever comes with NULL arrays
            // (anything else would be caller UB)
            num_entries: if lie {
                n as u64 + 1 + f.u64() % 8
            } else {
                n as u64
            },
            entry_layer_ids: if lie {
                std::ptr::null()
            } else {
                ptr_or_null(ids, f.one_in(8))
            },
            entry_row_bytes: if lie {
                std::ptr::null()
            } else {
                ptr_or_null(rows, f.one_in(8))
            },
            cp_mode: f.u8() as u32 % 3,
            cp_storage: f.u8() as u32 % 4,
        }
    };
    let (mut i1, mut r1, mut i2, mut r2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let a = [
        topo(&mut f, &mut i1, &mut r1),
        topo(&mut f, &mut i2, &mut r2),
    ];
    let pa = ptr_or_null(&a[0..], f.one_in(16));
    let pb = ptr_or_null(&a[1..], f.one_in(16));
    let mut compat = [PdxPeerCompat {
        struct_size: f.num(),
        mode: 0,
        num_decode_ranks_served: 0,
        num_entry_pairs: 0,
    }; 2];
    let out_null = f.one_in(16);
    no_panic(pdxfer_check_peer(
        pa,
        pb,
        if out_null {
            std::ptr::null_mut()
        } else {
            compat.as_mut_ptr()
        },
    ));
    let mut map = [PdxRankMapping {
        struct_size: f.num(),
        tp_rank_begin: 0,
        tp_rank_end: 0,
        tp_others_dummy: 0,
        cp_rank_begin: 0,
        cp_rank_end: 0,
        pp_rank_begin: 0,
        pp_rank_end: 0,
        required_dst_info_num: 0,
        required_prefill_response_num: 0,
        reserved: 0,
    }; 2];
    no_panic(pdxfer_rank_mapping(
        pb,
        pa,
        f.u8() as u32 % 4,
        map.as_mut_ptr(),
    ));
    // the list form: a size query, caller arrays of a fuzzed capacity, NULL arrays
    let cap = usize::from(f.u8() % 6);
    let mut lists = [[0u32; 5]; 4];
    let [tp, dummy, cp, pp] = &mut lists;
    let null_some = f.one_in(4);
    let mut targets = pdxfer::ffi::rank_targets::PdxRankTargets {
        struct_size: f.num(),
        tp_ranks: if cap == 0 {
            std::ptr::null_mut()
        } else {
            tp.as_mut_ptr()
        },
        tp_dummy: if f.one_in(2) {
            std::ptr::null_mut()
        } else {
            dummy.as_mut_ptr()
        },
        cp_ranks: if null_some {
            std::ptr::null_mut()
        } else {
            cp.as_mut_ptr()
        },
        pp_ranks: pp.as_mut_ptr(),
        capacity: cap.min(5) as u64,
        num_tp_ranks: 0,
        num_cp_ranks: 0,
        num_pp_ranks: 0,
        required_dst_info_num: 0,
        required_prefill_response_num: 0,
    };
    no_panic(pdxfer::ffi::rank_targets::pdxfer_rank_targets(
        pb,
        pa,
        f.u8() as u32 % 4,
        &mut targets,
    ));

    // plans
    let pages = |f: &mut Input| -> Vec<i64> {
        let n = usize::from(f.u8() % 12);
        (0..n)
            .map(|_| match f.u8() % 10 {
                0 => f.u64() as i64,
                _ => i64::from(f.u8() % 64),
            })
            .collect()
    };
    let (sp, dp) = (pages(&mut f), pages(&mut f));
    let small = |f: &mut Input| u64::from(f.u8() % 40);
    let dargs = [PdxDcpPlanArgs {
        struct_size: if f.one_in(8) {
            f.num()
        } else {
            std::mem::size_of::<PdxDcpPlanArgs>() as u64
        },
        src_pages: ptr_or_null(&sp, f.one_in(8)),
        num_src_pages: sp.len(),
        dst_pages: ptr_or_null(&dp, f.one_in(8)),
        num_dst_pages: dp.len(),
        page_size: small(&mut f),
        dcp_size: small(&mut f) % 9,
        dcp_rank: small(&mut f) % 9,
        src_page_offset: small(&mut f),
        decode_prefix_len: small(&mut f) * 8,
        num_tokens: match f.u8() % 4 {
            0 => -1,
            1 => f.u64() as i64,
            _ => f.u8() as i64 * 4,
        },
    }; 2];
    let cap = usize::from(f.u8()) * 4;
    let (mut s, mut d) = (vec![0i64; cap], vec![0i64; cap]);
    let mut out_len = 0usize;
    let nulls = f.u8();
    let sp_ = if nulls & 1 == 1 {
        std::ptr::null_mut()
    } else {
        s.as_mut_ptr()
    };
    let dp_ = if nulls & 2 == 2 {
        std::ptr::null_mut()
    } else {
        d.as_mut_ptr()
    };
    let ol = if nulls & 4 == 4 {
        std::ptr::null_mut()
    } else {
        &mut out_len as *mut usize
    };
    no_panic(pdxfer_dcp_token_plan(
        dargs.as_ptr(),
        sp_,
        dp_,
        if nulls & 8 == 8 { 0 } else { cap },
        ol,
    ));

    let lay = |f: &mut Input| PdxLayout {
        page_size: small(f),
        dcp_size: small(f) % 9,
        interleave: small(f) % 17,
    };
    let pargs = [PdxPairPlanArgs {
        struct_size: if f.one_in(8) {
            f.num()
        } else {
            std::mem::size_of::<PdxPairPlanArgs>() as u64
        },
        src_layout: lay(&mut f),
        src_rank: small(&mut f) % 9,
        src_pages: ptr_or_null(&sp, f.one_in(8)),
        num_src_pages: sp.len(),
        src_origin: small(&mut f) * 4,
        dst_layout: lay(&mut f),
        dst_rank: small(&mut f) % 9,
        dst_pages: ptr_or_null(&dp, f.one_in(8)),
        num_dst_pages: dp.len(),
        dst_origin: small(&mut f) * 4,
        start: small(&mut f) * 4,
        num_tokens: if f.one_in(8) {
            f.u64()
        } else {
            small(&mut f) * 8
        },
        flags: u32::from(f.u8() % 4),
        reserved: 0,
    }; 2];
    no_panic(pdxfer_pair_token_plan(pargs.as_ptr(), sp_, dp_, cap, ol));
    let mut runs = vec![PdxRun::default(); cap];
    let rp = if f.bool() {
        runs.as_mut_ptr()
    } else {
        std::ptr::null_mut()
    };
    no_panic(pdxfer_pair_runs(
        pargs.as_ptr(),
        rp,
        if rp.is_null() { 0 } else { cap },
        ol,
    ));
    let n = cap.min(usize::from(f.u8()));
    no_panic(pdxfer_coalesce_runs(
        s.as_ptr(),
        d.as_ptr(),
        n,
        rp,
        if rp.is_null() { 0 } else { cap },
        ol,
    ));
    let lens: Vec<u64> = (0..f.u8() % 6).map(|_| f.num()).collect();
    let mut bytes = 0u64;
    no_panic(pdxfer_dcp_pack_buffer_bytes(
        ptr_or_null(&lens, f.one_in(8)),
        lens.len(),
        f.num(),
        f.num(),
        f.num(),
        &mut bytes,
    ));

    // JSON-taking entry points and NULL handles
    let (j1, j2, j3) = (f.cstring(), f.cstring(), f.cstring());
    let mut buf = vec![0 as c_char; usize::from(f.u8())];
    let bl = buf.len();
    no_panic(pdxfer::ffi::bootstrap_client::pdxfer_bootstrap_verify_peer(
        j1.as_ptr().cast(),
        ptr_or_null(&j2, f.one_in(8)).cast(),
        j3.as_ptr().cast(),
        buf.as_mut_ptr(),
        bl,
        &mut out_len,
    ));
    no_panic(pdxfer::ffi::bootstrap_client::pdxfer_bootstrap_lookup(
        std::ptr::null(),
        j1.as_ptr().cast(),
        j2.as_ptr().cast(),
        j3.as_ptr().cast(),
        buf.as_mut_ptr(),
        bl,
        &mut out_len,
    ));
    // destructors and handle functions with NULL handles
    no_panic(pdxfer::ffi::bootstrap_client::pdxfer_bootstrap_client_close(std::ptr::null_mut()));
    no_panic(pdxfer::ffi::registration::pdxfer_registration_destroy(
        std::ptr::null_mut(),
    ));
    no_panic(pdxfer::ffi::registration::pdxfer_registration_json(
        std::ptr::null(),
        buf.as_mut_ptr(),
        bl,
        &mut out_len,
    ));
    pdxfer::ffi::agent::pdxfer_agent_destroy(std::ptr::null_mut());
    pdxfer::ffi::peer::pdxfer_peer_close(std::ptr::null_mut());
    let mut t = 0u32;
    no_panic(pdxfer::ffi::peer::pdxfer_peer_transport(
        std::ptr::null(),
        &mut t,
    ));
}
