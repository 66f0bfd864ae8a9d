//! Multi-process data-plane tests: `pdxfer target` children as peers, this
//! test process as the initiator, over cma and tcp.

use crate::support::target::Target;
use pdxfer::rng::SplitMix64;
use pdxfer::transport::{
    wire, Agent, AgentOptions, BatchOptions, ConnectOptions, PlacedRange, Transport, TransportKind,
    WriteOp,
};
use pdxfer::Status;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const REGION: usize = 4 << 20;

/// A `pdxfer target` with a [`REGION`]-byte region that stalls `stall_ms`
/// before validating each batch.
fn target(stall_ms: u64) -> Target {
    target_with(stall_ms, false)
}

/// [`target`], its region in heap memory when `heap`.
fn target_with(stall_ms: u64, heap: bool) -> Target {
    let stall = stall_ms.to_string();
    let mut args = vec!["--stall-ms", stall.as_str()];
    if heap {
        args.push("--heap");
    }
    Target::spawn(REGION as u64, &args, None)
}

fn initiator(src_len: usize) -> (Agent, Vec<u8>, u64) {
    let a = Agent::new(&AgentOptions::default()).unwrap();
    let mut src = vec![0u8; src_len];
    let mut r = SplitMix64::new(0x1234_5678_9abc_def1);
    for b in src.iter_mut() {
        *b = r.next_u64() as u8;
    }
    // SAFETY: the buffer is returned with the agent and outlives its use.
    let d = unsafe { a.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
    (a, src, d.id)
}

fn connect(a: &Agent, t: &Target, kind: TransportKind, n: u32) -> Box<dyn Transport> {
    a.connect(
        &t.addr,
        &ConnectOptions {
            transport: kind,
            streams: n,
            threads: n,
            ..Default::default()
        },
    )
    .unwrap()
}

fn random_batches(kind: TransportKind, n: u32, seed: u64, heap: bool) {
    let mut target = target_with(0, heap);
    let (a, src, sreg) = initiator(2 << 20);
    let t = connect(&a, &target, kind, n);
    assert_eq!(t.kind(), kind);
    if kind == TransportKind::Cma {
        assert_eq!(t.data_path().contains("memcpy"), !heap, "{}", t.data_path());
    }
    let mut model = vec![0u8; REGION];
    let mut r = SplitMix64::new(seed);
    let mut batches = 0;
    for _ in 0..12 {
        let nops = 1 + r.below(48) as usize;
        let mut ops: Vec<WriteOp> = Vec::new();
        while ops.len() < nops {
            let big = r.below(4) == 0;
            let len = 1 + r.below(if big { 700_000 } else { 9000 });
            let lo = r.below(src.len() as u64 - len);
            let ro = r.below(REGION as u64 - len);
            // Destinations within one batch do not overlap (streams may land them in any order).
            if ops
                .iter()
                .any(|o| ro < o.remote_offset + o.len && o.remote_offset < ro + len)
            {
                continue;
            }
            ops.push(WriteOp {
                local_region: sreg,
                local_offset: lo,
                remote_region: target.region,
                remote_offset: ro,
                len,
            });
        }
        for o in &ops {
            model[o.remote_offset as usize..(o.remote_offset + o.len) as usize]
                .copy_from_slice(&src[o.local_offset as usize..(o.local_offset + o.len) as usize]);
        }
        let opts = BatchOptions {
            checksum: r.below(2) == 0,
            room: batches,
            ..Default::default()
        };
        let id = t.submit(&ops, &opts).unwrap();
        let c = t.wait(id, Duration::from_secs(20)).unwrap();
        assert_eq!(c.bytes, ops.iter().map(|o| o.len).sum::<u64>());
        // The receiver saw the same completion record, after the data.
        let line = target.line("completion");
        assert_eq!(line["completion"]["bytes"], c.bytes, "{line}");
        assert_eq!(line["completion"]["room"], batches, "{line}");
        batches += 1;
    }
    if kind == TransportKind::Cma {
        // Read a random slice back with one-sided reads and compare with the model.
        let mut back = vec![0u8; 1 << 20];
        // SAFETY: back outlives the read below (waited for).
        let bk = unsafe { a.register_host(back.as_mut_ptr(), back.len()) }.unwrap();
        let off = r.below((REGION - (1 << 20)) as u64);
        let op = pdxfer::transport::ReadOp {
            local_region: bk.id,
            local_offset: 0,
            remote_region: target.region,
            remote_offset: off,
            len: 1 << 20,
        };
        let id = t
            .submit_reads(
                &[op],
                &BatchOptions {
                    checksum: true,
                    ..Default::default()
                },
            )
            .unwrap();
        t.wait(id, Duration::from_secs(20)).unwrap();
        assert!(
            back == model[off as usize..off as usize + (1 << 20)],
            "read-back differs"
        );
    }
    let got = target.dump();
    assert_eq!(got.len(), REGION);
    if let Some(i) = (0..REGION).find(|&i| got[i] != model[i]) {
        panic!(
            "{kind:?}: byte {i} differs: target has {}, expected {}",
            got[i], model[i]
        );
    }
}

#[test]
fn cma_random_batches_every_byte_verified() {
    // Shared (memfd) target regions: written with memcpy through a mapping.
    random_batches(TransportKind::Cma, 1, 11, false);
    // Heap target regions: written with process_vm_writev.
    random_batches(TransportKind::Cma, 2, 12, true);
}

#[test]
fn tcp_random_batches_every_byte_verified() {
    random_batches(TransportKind::Tcp, 1, 21, false);
    random_batches(TransportKind::Tcp, 3, 22, true);
}

/// Opens a raw tcp session to `addr` (hello, select) whose control connection announces a batch writing
/// the first 4 KiB of `region`, and returns once the receiver granted (pinned) it.
fn pin_first_page(addr: std::net::SocketAddr, region: u64) -> Raw {
    let mut s = dial(addr);
    let me = pdxfer::transport::ProcIdentity::current().unwrap();
    wire::write_json(
        &mut s,
        wire::FrameType::Hello,
        &serde_json::json!({"version": wire::VERSION, "identity": me}),
    )
    .unwrap();
    assert_eq!(read_frame_timeout(&mut s).0, wire::FrameType::HelloAck);
    wire::write_json(
        &mut s,
        wire::FrameType::Select,
        &serde_json::json!({"transport": "tcp", "streams": 1, "proof": 0}),
    )
    .unwrap();
    assert_eq!(read_frame_timeout(&mut s).0, wire::FrameType::SelectOk);
    let range = wire::Range {
        region,
        offset: 0,
        len: 4096,
    };
    wire::write_frame(
        &mut s,
        wire::FrameType::Intent,
        &wire::encode_intent(1, &[range]),
    )
    .unwrap();
    assert_eq!(read_frame_timeout(&mut s).0, wire::FrameType::Grant);
    s
}

/// A raw-wire client: dials `addr` and performs the authentication
/// exchange (the target runs without a secret, on loopback), as instance
/// `RAW_CLIENT`; its frames after the exchange are sealed with the session keys.
fn dial(addr: impl std::net::ToSocketAddrs) -> Raw {
    dial_as(addr, RAW_CLIENT)
}

type Raw = pdxfer::transport::peer_auth::Sealed<TcpStream>;

fn dial_as(addr: impl std::net::ToSocketAddrs, instance: [u8; 16]) -> Raw {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (_, keys) = pdxfer::transport::peer_auth::authenticate_client(
        &mut s,
        &pdxfer::auth::Mode::Open,
        instance,
        None,
        "target",
    )
    .unwrap();
    Raw::new(s, keys)
}

const RAW_CLIENT: [u8; 16] = [0x5a; 16];

fn read_frame_timeout(s: &mut Raw) -> (wire::FrameType, Vec<u8>) {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    wire::read_frame(s).unwrap()
}

/// Hand-crafted malformed requests over the raw wire: every one is refused
/// and the target's memory stays all zero.
#[test]
fn malformed_requests_refused_nothing_written() {
    let mut target = target(0);
    let me = pdxfer::transport::ProcIdentity::current().unwrap();
    let mut s = dial(&target.addr);
    wire::write_json(
        &mut s,
        wire::FrameType::Hello,
        &serde_json::json!({"version": wire::VERSION, "identity": me}),
    )
    .unwrap();
    let (ty, p) = read_frame_timeout(&mut s);
    assert_eq!(ty, wire::FrameType::HelloAck);
    let ack: serde_json::Value = serde_json::from_slice(&p).unwrap();
    let session = ack["session"].as_u64().unwrap();
    let token = ack["token"].as_str().unwrap().to_string();
    assert_eq!(token.len(), 32, "a 128-bit session token");
    let region = ack["regions"][0]["id"].as_u64().unwrap();
    let len = ack["regions"][0]["len"].as_u64().unwrap();
    wire::write_json(
        &mut s,
        wire::FrameType::Select,
        &serde_json::json!({"transport": "tcp", "streams": 1, "proof": 0}),
    )
    .unwrap();
    assert_eq!(read_frame_timeout(&mut s).0, wire::FrameType::SelectOk);

    // cma-style intents: out of bounds, overflowing, unknown region.
    let cases = [
        (
            1u64,
            wire::Range {
                region,
                offset: len - 8,
                len: 9,
            },
            Status::OutOfBounds,
        ),
        (
            2,
            wire::Range {
                region,
                offset: u64::MAX - 4,
                len: 16,
            },
            Status::OutOfBounds,
        ),
        (
            3,
            wire::Range {
                region: region + 100,
                offset: 0,
                len: 1,
            },
            Status::RegionNotFound,
        ),
    ];
    for (batch, range, want) in cases {
        let ok = wire::Range {
            region,
            offset: 0,
            len: 16,
        };
        wire::write_frame(
            &mut s,
            wire::FrameType::Intent,
            &wire::encode_intent(batch, &[ok, range]),
        )
        .unwrap();
        let (ty, p) = read_frame_timeout(&mut s);
        assert_eq!(ty, wire::FrameType::Refuse);
        let (b, e) = wire::decode_reason(&p).unwrap();
        assert_eq!((b, e.status()), (batch, want), "{e}");
    }

    // tcp data frames to bad destinations: drained, never written; the commit is refused.
    let mut d = dial(&target.addr);
    wire::write_json(
        &mut d,
        wire::FrameType::Attach,
        &serde_json::json!({"session": session, "token": token, "index": 0}),
    )
    .unwrap();
    assert_eq!(read_frame_timeout(&mut d).0, wire::FrameType::AttachOk);
    // A wrong token cannot attach a data stream, nor the right token from
    // a connection authenticated as another instance.
    let last = if token.ends_with('0') { "1" } else { "0" };
    let wrong = format!("{}{last}", &token[..31]);
    for (instance, token) in [(RAW_CLIENT, wrong), ([0x77; 16], token.clone())] {
        let mut d2 = dial_as(&target.addr, instance);
        wire::write_json(
            &mut d2,
            wire::FrameType::Attach,
            &serde_json::json!({"session": session, "token": token, "index": 1}),
        )
        .unwrap();
        let (ty, p) = read_frame_timeout(&mut d2);
        assert_eq!(ty, wire::FrameType::Error);
        assert_eq!(wire::decode_error(&p).status(), Status::Unauthorized);
    }

    let payload = vec![0xABu8; 64];
    for (batch, off, reg) in [
        (10u64, len - 32, region),
        (11, u64::MAX - 16, region),
        (12, 0, region + 7),
    ] {
        let h = wire::DataHeader {
            flags: 0,
            batch,
            region: reg,
            offset: off,
            len: payload.len() as u64,
        };
        d.write_all(&h.encode()).unwrap();
        d.write_all(&payload).unwrap();
        let c = wire::Commit {
            batch,
            bytes: payload.len() as u64,
            checksum: None,
            room: 0,
            epoch: 0,
        };
        wire::write_frame(&mut s, wire::FrameType::Commit, &wire::encode_commit(&c)).unwrap();
        let (ty, p) = read_frame_timeout(&mut s);
        assert_eq!(ty, wire::FrameType::Nack);
        let (b, e) = wire::decode_reason(&p).unwrap();
        assert_eq!(b, batch);
        assert!(
            matches!(e.status(), Status::OutOfBounds | Status::RegionNotFound),
            "{e}"
        );
    }
    // Read intents are validated the same way: nothing outside the regions is readable.
    wire::write_frame(
        &mut s,
        wire::FrameType::ReadIntent,
        &wire::encode_intent(
            30,
            &[wire::Range {
                region,
                offset: len - 1,
                len: 2,
            }],
        ),
    )
    .unwrap();
    let (ty, p) = read_frame_timeout(&mut s);
    assert_eq!(ty, wire::FrameType::Refuse);
    assert_eq!(
        wire::decode_reason(&p).unwrap().1.status(),
        Status::OutOfBounds
    );
    // A commit claiming more bytes than granted (cma path) is refused too.
    wire::write_frame(
        &mut s,
        wire::FrameType::Intent,
        &wire::encode_intent(
            20,
            &[wire::Range {
                region,
                offset: 0,
                len: 8,
            }],
        ),
    )
    .unwrap();
    assert_eq!(read_frame_timeout(&mut s).0, wire::FrameType::Grant);
    let c = wire::Commit {
        batch: 20,
        bytes: 9,
        checksum: None,
        room: 0,
        epoch: 0,
    };
    wire::write_frame(&mut s, wire::FrameType::Commit, &wire::encode_commit(&c)).unwrap();
    let (ty, p) = read_frame_timeout(&mut s);
    assert_eq!(ty, wire::FrameType::Nack, "{:?}", wire::decode_reason(&p));
    // Garbage (bad magic) ends the session.
    s.write_all(b"GARBAGE-GARBAGE-").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).unwrap_or(0);
    assert!(
        n == 0 || buf[..4] == wire::MAGIC.to_le_bytes(),
        "the session should end"
    );
    let mem = target.dump();
    assert!(
        mem.iter().all(|&b| b == 0),
        "a refused request wrote into the target"
    );
}

/// A cma client that cannot prove it reads the receiver's memory (wrong
/// nonce: another process, another pid namespace) is refused by name.
#[test]
fn cma_identity_proof_mismatch_refused() {
    let target = target(0);
    let me = pdxfer::transport::ProcIdentity::current().unwrap();
    let mut s = dial(&target.addr);
    wire::write_json(
        &mut s,
        wire::FrameType::Hello,
        &serde_json::json!({"version": wire::VERSION, "identity": me}),
    )
    .unwrap();
    let (ty, p) = read_frame_timeout(&mut s);
    assert_eq!(ty, wire::FrameType::HelloAck);
    let ack: serde_json::Value = serde_json::from_slice(&p).unwrap();
    assert_eq!(ack["identity"]["pid"].as_u64().unwrap() as u32, target.pid);
    wire::write_json(
        &mut s,
        wire::FrameType::Select,
        &serde_json::json!({"transport": "cma", "streams": 0, "proof": 12345}),
    )
    .unwrap();
    let (ty, p) = read_frame_timeout(&mut s);
    assert_eq!(ty, wire::FrameType::Error);
    let e = wire::decode_error(&p);
    assert_eq!(e.status(), Status::PeerIdentity, "{e}");
    // A wire version from the future is refused at the hello, naming both versions.
    let mut s = dial(&target.addr);
    wire::write_json(
        &mut s,
        wire::FrameType::Hello,
        &serde_json::json!({"version": 99, "identity": me}),
    )
    .unwrap();
    let (ty, p) = read_frame_timeout(&mut s);
    assert_eq!(ty, wire::FrameType::Error);
    let e = wire::decode_error(&p);
    assert!(e.detail().contains("99"), "{e}");
}

/// A peer killed with SIGKILL in the middle of a batch fails that batch with
/// a reason well within its deadline; another peer keeps working.
#[test]
fn killed_peer_fails_batch_within_deadline_others_keep_working() {
    for kind in [TransportKind::Cma, TransportKind::Tcp] {
        let mut a_t = target(3000); // stalls before validating each batch
        let mut b_t = target(0);
        let (a, src, sreg) = initiator(1 << 20);
        let ta = connect(&a, &a_t, kind, 2);
        let tb = connect(&a, &b_t, kind, 2);
        let op = |t: &Target| WriteOp {
            local_region: sreg,
            local_offset: 0,
            remote_region: t.region,
            remote_offset: 4096,
            len: 1 << 20,
        };
        let deadline = Duration::from_secs(10);
        let opts = BatchOptions {
            timeout: deadline,
            ..Default::default()
        };
        let t0 = Instant::now();
        let ida = ta.submit(&[op(&a_t)], &opts).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        a_t.kill9();
        let e = ta.wait(ida, Duration::from_secs(20)).unwrap_err();
        let took = t0.elapsed();
        assert_eq!(e.status(), Status::PeerUnreachable, "{kind:?}: {e}");
        assert!(e.detail().contains("pid"), "the reason names the peer: {e}");
        assert!(took < deadline / 2, "{kind:?}: failure took {took:?}");
        assert!(!ta.is_alive());
        assert_eq!(
            ta.submit(&[op(&a_t)], &opts).unwrap_err().status(),
            Status::PeerUnreachable
        );
        // The other peer is unaffected.
        let idb = tb.submit(&[op(&b_t)], &opts).unwrap();
        tb.wait(idb, Duration::from_secs(20)).unwrap();
        let mem = b_t.dump();
        assert_eq!(&mem[4096..4096 + (1 << 20)], &src[..1 << 20]);
    }
}

/// A peer that is alive but stalled fails the batch at its deadline, before
/// the peer would have completed it.
#[test]
fn stalled_peer_times_out_at_batch_deadline() {
    for kind in [TransportKind::Cma, TransportKind::Tcp] {
        let t = target(2500);
        let (a, _src, sreg) = initiator(1 << 16);
        let tr = connect(&a, &t, kind, 1);
        let opts = BatchOptions {
            timeout: Duration::from_millis(400),
            ..Default::default()
        };
        let t0 = Instant::now();
        let id = tr
            .submit(
                &[WriteOp {
                    local_region: sreg,
                    local_offset: 0,
                    remote_region: t.region,
                    remote_offset: 0,
                    len: 4096,
                }],
                &opts,
            )
            .unwrap();
        // The peer validates after 2.5 s and would then complete the batch, so
        // only the batch's own 400 ms deadline ends it with this error (the
        // wait's 20 s limit reports "wait of ... ended" instead).
        let e = tr.wait(id, Duration::from_secs(20)).unwrap_err();
        let took = t0.elapsed();
        assert_eq!(e.status(), Status::Timeout, "{kind:?}: {e}");
        let missed = format!("batch {} missed its {:?} deadline", id.0, opts.timeout);
        assert!(e.detail().contains(&missed), "{kind:?}: {e}");
        assert!(
            took >= opts.timeout,
            "{kind:?}: failed early, after {took:?}"
        );
    }
}

/// A granted (in-flight) batch pins the receiver's region: unregistering
/// waits, then fails with `RegionBusy` and keeps the region; once the sender
/// aborts (or commits), unregistering succeeds. A dropped connection
/// releases its pins too.
#[test]
fn unregister_waits_for_granted_batches() {
    let rx = Agent::new(&AgentOptions {
        listen: Some("127.0.0.1:0".into()),
        ..Default::default()
    })
    .unwrap();
    let d = rx.registry().alloc_shared(1 << 16).unwrap();
    let addr = rx.local_addr().unwrap();
    let mut s = pin_first_page(addr, d.id);
    let t0 = Instant::now();
    let e = rx
        .registry()
        .unregister(d.id, Duration::from_millis(150))
        .unwrap_err();
    assert_eq!(e.status(), Status::RegionBusy, "{e}");
    assert!(t0.elapsed() >= Duration::from_millis(140));
    wire::write_frame(&mut s, wire::FrameType::Abort, &1u64.to_le_bytes()).unwrap();
    rx.registry()
        .unregister(d.id, Duration::from_secs(5))
        .unwrap();
    // Pins of a connection that dies are released with it.
    let d = rx.registry().alloc_shared(1 << 16).unwrap();
    drop(pin_first_page(addr, d.id));
    rx.registry()
        .unregister(d.id, Duration::from_secs(5))
        .unwrap();
}

/// Resident kB of the mapping that starts at `addr` in this process
/// (`/proc/self/smaps`: pages present in this process's page tables).
fn resident_kb(addr: u64) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let head = format!("{addr:x}-");
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
    assert!(lines.next().is_some(), "no mapping at 0x{addr:x}");
    let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
    rss.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// cma maps a same-host peer's shared regions and populates them at connect
/// (no page faults on the first batch); a placed batch is written by the
/// caller through that mapping only after the peer granted it (the peer here
/// stalls 300 ms before granting), then committed and completed as any
/// batch; ranges outside the region, or peers without mapped regions, are
/// refused before anything is sent.
#[test]
fn cma_maps_shared_regions_populated_and_places_after_the_grant() {
    let mut target = target(300);
    let (a, _src, _) = initiator(4096);
    let t = connect(&a, &target, TransportKind::Cma, 1);
    let m = t.mapped_dst(target.region).expect("shared region mapped");
    assert_eq!(m.len, REGION as u64);
    assert_eq!(
        resident_kb(m.addr),
        REGION as u64 / 1024,
        "the mapping is populated at connect"
    );
    let ranges = [
        PlacedRange {
            remote_region: target.region,
            remote_offset: 4096,
            len: 10_000,
        },
        PlacedRange {
            remote_region: target.region,
            remote_offset: REGION as u64 - 77,
            len: 77,
        },
    ];
    let mut model = vec![0u8; REGION];
    let mut r = SplitMix64::new(99);
    for g in &ranges {
        for b in &mut model[g.remote_offset as usize..(g.remote_offset + g.len) as usize] {
            *b = r.next_u64() as u8;
        }
    }
    let t0 = Instant::now();
    let mut placed_after = None;
    let mut place = || {
        placed_after = Some(t0.elapsed());
        for g in &ranges {
            let (o, n) = (g.remote_offset as usize, g.len as usize);
            // SAFETY: the range lies in the mapped region (len checked above), granted by the peer.
            let dst =
                unsafe { std::slice::from_raw_parts_mut((m.addr as usize + o) as *mut u8, n) };
            dst.copy_from_slice(&model[o..o + n]);
        }
        Ok(())
    };
    let opts = BatchOptions {
        checksum: true,
        room: 5,
        ..Default::default()
    };
    let id = t.submit_placed(&ranges, &opts, &mut place).unwrap();
    let waited = placed_after.expect("placed");
    assert!(
        waited >= Duration::from_millis(300),
        "placed after {waited:?}, before the peer's grant"
    );
    let c = t.wait(id, Duration::from_secs(20)).unwrap();
    assert_eq!((c.bytes, c.room), (10_077, 5));
    assert!(c.checksum.is_some());
    let line = target.line("completion");
    assert_eq!(line["completion"]["bytes"], 10_077, "{line}");
    assert!(
        target.dump() == model,
        "the placed bytes landed, nothing else"
    );
    // out of bounds: refused, nothing placed or sent
    let bad = [PlacedRange {
        remote_offset: REGION as u64 - 1,
        len: 2,
        ..ranges[0]
    }];
    let mut never = || -> pdxfer::Result<()> { panic!("placed a refused batch") };
    let e = t.submit_placed(&bad, &opts, &mut never).unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    // heap regions are not mapped: submit_placed is refused
    let heap = target_with(0, true);
    let th = connect(&a, &heap, TransportKind::Cma, 1);
    assert!(th.mapped_dst(heap.region).is_none());
    let e = th
        .submit_placed(
            &[PlacedRange {
                remote_region: heap.region,
                remote_offset: 0,
                len: 8,
            }],
            &opts,
            &mut never,
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::Unsupported, "{e}");
    // tcp maps nothing
    let tt = connect(&a, &target, TransportKind::Tcp, 1);
    assert!(tt.mapped_dst(target.region).is_none());
}

/// Rows of `ROW` bytes: every 4th row of the source lands in consecutive
/// destination rows (a DCP rank's share of a request), so the tcp sender
/// sends each destination run as one piece gathered from its rows.
const ROW: u64 = 1152;

fn scattered_run(sreg: u64, dreg: u64, src_row: u64, dst_off: u64, rows: u64) -> Vec<WriteOp> {
    (0..rows)
        .map(|i| WriteOp {
            local_region: sreg,
            local_offset: (src_row + 4 * i) * ROW,
            remote_region: dreg,
            remote_offset: dst_off + i * ROW,
            len: ROW,
        })
        .collect()
}

#[test]
fn tcp_runs_of_scattered_rows_land_byte_exact_with_checksums() {
    for streams in [1, 3] {
        let mut target = target(0);
        let (a, src, sreg) = initiator(8 << 20);
        let t = connect(&a, &target, TransportKind::Tcp, streams);
        // a run of more rows than IOV_MAX, a run of rows long enough to be
        // sent in place, an op that follows no other, and rows in reverse
        // order (destinations descend: none follows the previous one)
        let mut ops = scattered_run(sreg, target.region, 3, 0, 1500);
        ops.extend((0..40u64).map(|i| WriteOp {
            local_region: sreg,
            local_offset: (6 << 20) + i * 40_000,
            remote_region: target.region,
            remote_offset: (2 << 20) + i * 20_000,
            len: 20_000,
        }));
        ops.push(WriteOp {
            local_region: sreg,
            local_offset: 17,
            remote_region: target.region,
            remote_offset: (3 << 20) + 5,
            len: 999,
        });
        ops.extend(
            scattered_run(sreg, target.region, 1, (3 << 20) + 100_000, 50)
                .into_iter()
                .rev(),
        );
        let mut model = vec![0u8; REGION];
        for o in &ops {
            model[o.remote_offset as usize..(o.remote_offset + o.len) as usize]
                .copy_from_slice(&src[o.local_offset as usize..(o.local_offset + o.len) as usize]);
        }
        for checksum in [true, false] {
            let opts = BatchOptions {
                checksum,
                ..Default::default()
            };
            let id = t.submit(&ops, &opts).unwrap();
            let c = t.wait(id, Duration::from_secs(20)).unwrap();
            assert_eq!(c.bytes, ops.iter().map(|o| o.len).sum::<u64>());
            target.line("completion");
        }
        let got = target.dump();
        if let Some(i) = (0..REGION).find(|&i| got[i] != model[i]) {
            panic!(
                "{streams} streams: byte {i} differs: target has {}, expected {}",
                got[i], model[i]
            );
        }
    }
}

#[test]
fn tcp_a_bad_op_inside_a_run_refuses_the_batch_nothing_written() {
    let mut target = target(0);
    let (a, _src, sreg) = initiator(8 << 20);
    let t = connect(&a, &target, TransportKind::Tcp, 1);
    for bad in 0..3 {
        let mut ops = scattered_run(sreg, target.region, 0, 0, 600);
        let e = match bad {
            // its source outside the local region
            0 => {
                ops[300].local_offset = (8 << 20) - 100;
                Status::OutOfBounds
            }
            // a region the peer never exported, where the run goes on
            1 => {
                ops[300].remote_region = target.region + 1000;
                Status::RegionNotFound
            }
            // the last row of the run past the end of the region
            _ => {
                let last = ops.last_mut().unwrap();
                last.remote_offset = REGION as u64 - 10;
                Status::OutOfBounds
            }
        };
        let err = t.submit(&ops, &BatchOptions::default()).unwrap_err();
        assert_eq!(err.status(), e, "{err}");
    }
    // the connection still works, and nothing of the refused batches landed
    let ops = scattered_run(sreg, target.region, 0, 1 << 20, 10);
    let id = t.submit(&ops, &BatchOptions::default()).unwrap();
    t.wait(id, Duration::from_secs(20)).unwrap();
    let got = target.dump();
    assert!(
        got[..1 << 20].iter().all(|&b| b == 0),
        "a refused batch wrote"
    );
    assert!(got[(1 << 20) + 10 * ROW as usize..].iter().all(|&b| b == 0));
}
