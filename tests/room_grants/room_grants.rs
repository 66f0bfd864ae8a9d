//! Room-level grants on real connections (cma and tcp between two agents of
//! this process, rdma on the software fabric): a granted room's batches flow
//! with no per-batch frame, writes outside the grant are refused with nothing
//! written (by the sender, and on tcp by the receiver against the grant it
//! holds), revoked, expired, forged and foreign grants are refused, and one
//! RoomEnd/RoomAck closes the room after every byte landed.
//!
//! The frame counts are process-wide, so the tests of this binary take one
//! lock and count only their own traffic.

use pdxfer::auth::PeerInstance;
use pdxfer::error::Status;
use pdxfer::memory::RegionDesc;
use pdxfer::transport::control_counts::{frames_received, frames_sent};
use pdxfer::transport::rdma::fake::FakeNic;
use pdxfer::transport::rdma::handshake::Mtu;
use pdxfer::transport::rdma::nic::NicProvider;
use pdxfer::transport::room::{GrantRange, RoomGrant};
use pdxfer::transport::wire::FrameType;
use pdxfer::transport::{
    Agent, AgentOptions, BatchOptions, BatchStatus, ConnectOptions, TestKnobs, Transport,
    TransportKind, WriteOp,
};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

static SERIAL: Mutex<()> = Mutex::new(());

pub(crate) fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const LEN: usize = 1 << 20;
const ROOM: u64 = 5;
const DECODE_EPOCH: u64 = 1;
const EPOCH: u64 = 7;

struct Pair {
    rx: Agent,
    tx: Agent,
    dst: Vec<u8>,
    _src: Vec<u8>,
    d: RegionDesc,
    s: RegionDesc,
    t: Box<dyn Transport>,
}

fn agent(listen: bool, nic: Option<Arc<FakeNic>>) -> Agent {
    Agent::new(&AgentOptions {
        listen: listen.then(|| "127.0.0.1:0".to_string()),
        testing: TestKnobs {
            deny_same_host: nic.is_some(),
            nic: nic.map(|n| n as Arc<dyn NicProvider>),
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap()
}

fn connect(tx: &Agent, rx: &Agent, kind: TransportKind) -> Box<dyn Transport> {
    tx.connect(
        &rx.local_addr().unwrap().to_string(),
        &ConnectOptions {
            transport: kind,
            timeout: Duration::from_secs(5),
            ..Default::default()
        },
    )
    .unwrap()
}

fn pair(kind: TransportKind, name: &str) -> Pair {
    let nic = |side: &str| {
        (kind == TransportKind::Rdma)
            .then(|| FakeNic::new(&format!("{name}-{side}"), 1, Mtu::Mtu4096))
    };
    let rx = agent(true, nic("rx"));
    let tx = agent(false, nic("tx"));
    let mut dst = vec![0u8; LEN];
    let mut src: Vec<u8> = (0..LEN as u32).map(|i| (i * 7 + 3) as u8).collect();
    // SAFETY: both buffers live in the Pair next to the agents and outlive their use.
    let d = unsafe { rx.register_host(dst.as_mut_ptr(), dst.len()) }.unwrap();
    // SAFETY: as above.
    let s = unsafe { tx.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
    let t = connect(&tx, &rx, kind);
    assert_eq!(t.kind(), kind);
    Pair {
        rx,
        tx,
        dst,
        _src: src,
        d,
        s,
        t,
    }
}

fn range(d: &RegionDesc, offset: u64, len: u64) -> GrantRange {
    GrantRange {
        region: d.id,
        offset,
        len,
    }
}

fn op(p: &Pair, src: u64, dst: u64, len: u64) -> WriteOp {
    WriteOp {
        local_region: p.s.id,
        local_offset: src,
        remote_region: p.d.id,
        remote_offset: dst,
        len,
    }
}

fn opts() -> BatchOptions {
    BatchOptions {
        timeout: Duration::from_secs(10),
        room: ROOM,
        epoch: EPOCH,
        ..Default::default()
    }
}

/// The source bytes `src_offset..src_offset + len` (the pattern of [`pair`]).
fn expected(len: usize, src_offset: usize) -> Vec<u8> {
    (src_offset..src_offset + len)
        .map(|i| ((i as u32).wrapping_mul(7).wrapping_add(3)) as u8)
        .collect()
}

/// Intent, Grant, Commit and Ack frames this process received so far.
fn per_batch_frames() -> [u64; 4] {
    [
        frames_received(FrameType::Intent),
        frames_received(FrameType::Grant),
        frames_received(FrameType::Commit),
        frames_received(FrameType::Ack),
    ]
}

/// A room's batches move with no per-batch frame; RoomEnd/RoomAck close it
/// after every byte landed, and the receiver sees one completion record.
fn room_flows_without_per_batch_frames(kind: TransportKind) {
    let _g = serial();
    let p = pair(kind, "flow");
    // the room's rows: two ranges of the region
    let g =
        p.rx.grant_room(
            p.tx.instance(),
            ROOM,
            DECODE_EPOCH,
            &[range(&p.d, 0, 64 << 10), range(&p.d, 512 << 10, 4096)],
            Duration::from_secs(30),
        )
        .unwrap();
    assert_eq!(p.rx.room_grants_held(), 1);
    p.t.open_room(&g, EPOCH).unwrap();
    // opening the same grant again is a no-op
    p.t.open_room(&g, EPOCH).unwrap();
    let before = per_batch_frames();
    let room_ends = (
        frames_sent(FrameType::RoomEnd),
        frames_received(FrameType::RoomEnd),
    );
    let mut bytes = 0;
    for i in 0..16u64 {
        let ops = [op(&p, i * 4096, i * 4096, 4096)];
        let id = p.t.submit(&ops, &opts()).unwrap();
        if kind == TransportKind::Cma {
            // a small granted cma batch is moved inside submit: done already
            assert!(
                matches!(p.t.poll(id).unwrap(), BatchStatus::Done(_)),
                "a small granted cma batch is done when submit returns"
            );
            assert_eq!(
                &p.dst[(i * 4096) as usize..][..4096],
                &expected(4096, (i * 4096) as usize)[..]
            );
            bytes += 4096;
            continue;
        }
        let c = p.t.wait(id, Duration::from_secs(10)).unwrap();
        assert_eq!((c.bytes, c.room, c.epoch), (4096, ROOM, EPOCH));
        bytes += 4096;
    }
    let id =
        p.t.submit(&[op(&p, 9000, 512 << 10, 4096)], &opts())
            .unwrap();
    p.t.wait(id, Duration::from_secs(10)).unwrap();
    bytes += 4096;
    assert_eq!(
        per_batch_frames(),
        before,
        "no Intent, Grant, Commit or Ack frame for a granted room's batches"
    );
    let landed = |p: &Pair| {
        p.dst[..64 << 10] == expected(64 << 10, 0)[..]
            && p.dst[512 << 10..(512 << 10) + 4096] == expected(4096, 9000)[..]
    };
    // cma and rdma: the bytes are there before the room closes (written
    // synchronously, or acknowledged by the fabric); tcp: once it closed
    if kind != TransportKind::Tcp {
        assert!(landed(&p));
    }
    let sum =
        p.t.close_room(ROOM, EPOCH, Duration::from_secs(10))
            .unwrap();
    assert!(landed(&p), "every byte landed when the room closed");
    assert_eq!((sum.batches, sum.bytes), (17, bytes));
    assert_eq!(
        (
            frames_sent(FrameType::RoomEnd),
            frames_received(FrameType::RoomEnd)
        ),
        (room_ends.0 + 1, room_ends.1 + 1),
        "one RoomEnd for the room"
    );
    // the grant was released with the room; one completion record for it
    assert_eq!(p.rx.room_grants_held(), 0);
    let inc = p.rx.next_completion(Duration::from_secs(5)).unwrap();
    assert_eq!(
        (
            inc.completion.room,
            inc.completion.epoch,
            inc.completion.bytes
        ),
        (ROOM, DECODE_EPOCH, bytes)
    );
    assert!(p.rx.try_completion().is_none());
    // closing again: the room is no longer open here
    let e =
        p.t.close_room(ROOM, EPOCH, Duration::from_secs(1))
            .unwrap_err();
    assert_eq!(e.status(), Status::UnknownRoom, "{e}");
    // batches of other rooms use the per-batch protocol (tcp, rdma) or, on
    // cma, the connection's standing grant (one StandingCommit, no answer)
    let before = per_batch_frames();
    let standing = frames_received(FrameType::StandingCommit);
    let other = BatchOptions {
        room: ROOM + 1,
        ..opts()
    };
    let id = p.t.submit(&[op(&p, 0, 900 << 10, 64)], &other).unwrap();
    p.t.wait(id, Duration::from_secs(10)).unwrap();
    let after = per_batch_frames();
    if kind == TransportKind::Cma {
        assert_eq!(
            after, before,
            "no per-batch round trip under a standing grant"
        );
        let t0 = std::time::Instant::now();
        while frames_received(FrameType::StandingCommit) == standing {
            assert!(t0.elapsed() < Duration::from_secs(5), "no StandingCommit");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(frames_received(FrameType::StandingCommit), standing + 1);
    } else {
        if kind == TransportKind::Rdma {
            assert_eq!(after[0] - before[0], 1, "one Intent for an ungranted batch");
        }
        assert_eq!(after[2] - before[2], 1, "one Commit for an ungranted batch");
        assert_eq!(after[3] - before[3], 1, "one Ack for an ungranted batch");
    }
    assert_eq!(&p.dst[900 << 10..(900 << 10) + 64], &expected(64, 0)[..]);
}

#[test]
fn cma_room_flows_without_per_batch_frames() {
    room_flows_without_per_batch_frames(TransportKind::Cma);
}

#[test]
fn rdma_room_flows_without_per_batch_frames() {
    room_flows_without_per_batch_frames(TransportKind::Rdma);
}

/// A write outside the room's grant is refused before a byte moves, naming
/// the room; the batch never reaches the receiver.
fn outside_the_grant_is_refused(kind: TransportKind) {
    let _g = serial();
    let mut p = pair(kind, "outside");
    p.dst.iter_mut().for_each(|b| *b = 0xee);
    let g =
        p.rx.grant_room(
            p.tx.instance(),
            ROOM,
            DECODE_EPOCH,
            &[range(&p.d, 4096, 8192)],
            Duration::from_secs(30),
        )
        .unwrap();
    p.t.open_room(&g, EPOCH).unwrap();
    let before = per_batch_frames();
    // past the end, before the start, and straddling the end of the grant;
    // the first op of the batch is inside: nothing of the batch is written
    for bad in [
        op(&p, 0, 4096 + 8192, 16),
        op(&p, 0, 0, 16),
        op(&p, 0, 4096 + 8000, 400),
    ] {
        let e =
            p.t.submit(&[op(&p, 0, 4096, 64), bad], &opts())
                .unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds, "{e}");
        assert!(e.detail().contains("room 5"), "names the room: {e}");
        assert!(e.detail().contains("nothing was written"), "{e}");
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(p.dst.iter().all(|&b| b == 0xee), "nothing was written");
    assert_eq!(per_batch_frames(), before, "nothing was sent");
    // a write inside still works, and the room closes with only it
    let id = p.t.submit(&[op(&p, 0, 4096, 64)], &opts()).unwrap();
    p.t.wait(id, Duration::from_secs(10)).unwrap();
    let sum =
        p.t.close_room(ROOM, EPOCH, Duration::from_secs(10))
            .unwrap();
    assert_eq!((sum.batches, sum.bytes), (1, 64));
    assert_eq!(&p.dst[4096..4160], &expected(64, 0)[..]);
    assert!(p.dst[..4096].iter().all(|&b| b == 0xee));
    assert!(p.dst[4160..].iter().all(|&b| b == 0xee));
}

#[test]
fn cma_write_outside_the_grant_is_refused() {
    outside_the_grant_is_refused(TransportKind::Cma);
}

#[test]
fn rdma_write_outside_the_grant_is_refused() {
    outside_the_grant_is_refused(TransportKind::Rdma);
}

#[test]
fn expired_and_revoked_grants_are_refused() {
    let _g = serial();
    let mut p = pair(TransportKind::Cma, "expiry");
    p.dst.iter_mut().for_each(|b| *b = 0xee);
    // expired: the sender refuses at its deadline, the receiver at the close
    let g =
        p.rx.grant_room(
            p.tx.instance(),
            ROOM,
            DECODE_EPOCH,
            &[range(&p.d, 0, 4096)],
            Duration::from_millis(150),
        )
        .unwrap();
    p.t.open_room(&g, EPOCH).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let e = p.t.submit(&[op(&p, 0, 0, 64)], &opts()).unwrap_err();
    assert_eq!(e.status(), Status::Timeout, "{e}");
    assert!(p.dst.iter().all(|&b| b == 0xee), "nothing was written");
    assert_eq!(p.rx.room_grants_held(), 0, "expired at its deadline");
    let e =
        p.t.close_room(ROOM, EPOCH, Duration::from_secs(5))
            .unwrap_err();
    assert_eq!(e.status(), Status::Timeout, "{e}");
    assert!(e.detail().contains("expired"), "{e}");
    // revoked: the receiver refuses the room's end and delivers nothing
    let g =
        p.rx.grant_room(
            p.tx.instance(),
            ROOM,
            DECODE_EPOCH,
            &[range(&p.d, 0, 4096)],
            Duration::from_secs(30),
        )
        .unwrap();
    p.t.open_room(&g, EPOCH).unwrap();
    assert!(p.rx.revoke_room(g.token));
    assert!(!p.rx.revoke_room(g.token), "revoked once");
    assert_eq!(p.rx.room_grants_held(), 0);
    let e =
        p.t.close_room(ROOM, EPOCH, Duration::from_secs(5))
            .unwrap_err();
    assert_eq!(e.status(), Status::Aborted, "{e}");
    assert!(e.detail().contains("revoked"), "{e}");
    assert!(
        p.rx.try_completion().is_none(),
        "no completion for a revoked room"
    );
}

#[test]
fn forged_and_foreign_tokens_are_refused() {
    let _g = serial();
    let p = pair(TransportKind::Cma, "foreign");
    let g =
        p.rx.grant_room(
            p.tx.instance(),
            ROOM,
            DECODE_EPOCH,
            &[range(&p.d, 0, 4096)],
            Duration::from_secs(30),
        )
        .unwrap();
    // another instance cannot open a grant made for this one
    let other = agent(false, None);
    let mut other_src = vec![1u8; 4096];
    // SAFETY: other_src outlives the other agent's use below.
    unsafe { other.register_host(other_src.as_mut_ptr(), other_src.len()) }.unwrap();
    let t2 = connect(&other, &p.rx, TransportKind::Cma);
    let e = t2.open_room(&g, EPOCH).unwrap_err();
    assert_eq!(e.status(), Status::PeerIdentity, "{e}");
    // ... nor present its token as its own: the receiver checks the
    // authenticated instance of the connection, and keeps the grant
    let stolen = RoomGrant {
        grantee: other.instance().0,
        ..g.clone()
    };
    t2.open_room(&stolen, EPOCH).unwrap();
    let e = t2
        .close_room(ROOM, EPOCH, Duration::from_secs(5))
        .unwrap_err();
    assert_eq!(e.status(), Status::PeerIdentity, "{e}");
    assert_eq!(
        p.rx.room_grants_held(),
        1,
        "the grant stays for its instance"
    );
    // a forged token
    let forged = RoomGrant {
        token: g.token ^ 0x5a5a,
        ..g.clone()
    };
    p.t.open_room(&forged, EPOCH + 1).unwrap();
    let e =
        p.t.close_room(ROOM, EPOCH + 1, Duration::from_secs(5))
            .unwrap_err();
    assert_eq!(e.status(), Status::PeerIdentity, "{e}");
    assert!(e.detail().contains("no room grant has this token"), "{e}");
    // a grant for the wrong room or epoch
    let moved = RoomGrant {
        room: ROOM + 1,
        ..g.clone()
    };
    p.t.open_room(&moved, EPOCH).unwrap();
    let e =
        p.t.close_room(ROOM + 1, EPOCH, Duration::from_secs(5))
            .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    // the real one still closes
    p.t.open_room(&g, EPOCH).unwrap();
    p.t.close_room(ROOM, EPOCH, Duration::from_secs(5)).unwrap();
    assert_eq!(p.rx.room_grants_held(), 0);
    // a grant over memory the receiver does not have is refused whole
    let e =
        p.rx.grant_room(
            PeerInstance([9; 16]),
            ROOM,
            DECODE_EPOCH,
            &[range(&p.d, 0, 16), range(&p.d, LEN as u64 - 8, 16)],
            Duration::from_secs(30),
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    assert_eq!(p.rx.room_grants_held(), 0);
    drop(other_src);
}

#[test]
fn tcp_room_flows_without_per_batch_frames() {
    room_flows_without_per_batch_frames(TransportKind::Tcp);
}

#[test]
fn tcp_write_outside_the_grant_is_refused() {
    outside_the_grant_is_refused(TransportKind::Tcp);
}

/// A granted room's rows gathered from scattered sources into consecutive
/// destination rows go as one tcp piece per run, also across ranges granted
/// apart that adjoin; a run leaving the grant is refused, nothing written.
#[test]
fn tcp_runs_of_a_granted_room_land_across_adjoining_ranges() {
    let _g = serial();
    let mut p = pair(TransportKind::Tcp, "tcp-runs");
    p.dst.iter_mut().for_each(|b| *b = 0xee);
    let g =
        p.rx.grant_room(
            p.tx.instance(),
            ROOM,
            DECODE_EPOCH,
            &[
                range(&p.d, 0, 8192),
                range(&p.d, 8192, 8192),
                range(&p.d, 64 << 10, 4096),
            ],
            Duration::from_secs(30),
        )
        .unwrap();
    p.t.open_room(&g, EPOCH).unwrap();
    // every 4th 1 KiB row of the source into consecutive rows
    let rows = |dst: u64, n: u64| -> Vec<WriteOp> {
        (0..n)
            .map(|i| op(&p, (1 + 4 * i) * 1024, dst + i * 1024, 1024))
            .collect()
    };
    let want = |n: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|i| expected(1024, (1 + 4 * i) * 1024))
            .collect()
    };
    // a run past the end of the last range: refused, nothing written
    let e = p.t.submit(&rows(64 << 10, 5), &opts()).unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    // 16 rows across the two adjoining ranges, 4 rows in the third
    let mut ops = rows(0, 16);
    ops.extend(rows(64 << 10, 4));
    let id = p.t.submit(&ops, &opts()).unwrap();
    p.t.wait(id, Duration::from_secs(10)).unwrap();
    let sum =
        p.t.close_room(ROOM, EPOCH, Duration::from_secs(10))
            .unwrap();
    assert_eq!((sum.batches, sum.bytes), (1, 20 * 1024));
    assert!(p.dst[..16 << 10] == want(16)[..], "the first run differs");
    assert!(
        p.dst[64 << 10..68 << 10] == want(4)[..],
        "the second run differs"
    );
    assert!(p.dst[16 << 10..64 << 10].iter().all(|&b| b == 0xee));
    assert!(p.dst[68 << 10..].iter().all(|&b| b == 0xee));
}

/// The tcp receiver checks every piece of a room against the grant it
/// holds, not against what the sender was told: a sender whose copy of the
/// grant was widened, forged, revoked or taken from another instance gets
/// its pieces refused, with nothing written, and its room end refused.
#[test]
fn tcp_receiver_refuses_pieces_outside_its_own_grant() {
    let _g = serial();
    let mut p = pair(TransportKind::Tcp, "tcp-recv");
    p.dst.iter_mut().for_each(|b| *b = 0xee);
    let grant = |p: &Pair| {
        p.rx.grant_room(
            p.tx.instance(),
            ROOM,
            DECODE_EPOCH,
            &[range(&p.d, 0, 4096)],
            Duration::from_secs(30),
        )
        .unwrap()
    };
    let untouched = |p: &Pair, from: usize| p.dst[from..].iter().all(|&b| b == 0xee);
    // widened on the sender: the piece past the real grant is refused
    let g = grant(&p);
    let widened = RoomGrant {
        ranges: vec![range(&p.d, 0, LEN as u64)],
        ..g.clone()
    };
    p.t.open_room(&widened, EPOCH).unwrap();
    for dst in [0, 8192] {
        let id = p.t.submit(&[op(&p, 0, dst, 64)], &opts()).unwrap();
        p.t.wait(id, Duration::from_secs(10)).unwrap();
    }
    let e =
        p.t.close_room(ROOM, EPOCH, Duration::from_secs(10))
            .unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    assert_eq!(
        &p.dst[..64],
        &expected(64, 0)[..],
        "inside the grant: landed"
    );
    assert!(untouched(&p, 64), "outside the grant: nothing written");
    assert!(
        p.rx.try_completion().is_none(),
        "no completion for a refused room"
    );
    // a forged token, and another instance's: nothing written
    let other = agent(false, None);
    let mut other_src = vec![1u8; 4096];
    // SAFETY: other_src outlives the other agent's use below.
    let os = unsafe { other.register_host(other_src.as_mut_ptr(), other_src.len()) }.unwrap();
    let t2 = connect(&other, &p.rx, TransportKind::Tcp);
    let g2 = grant(&p);
    let forged = RoomGrant {
        token: g2.token ^ 0x77,
        ..g2.clone()
    };
    let stolen = RoomGrant {
        grantee: other.instance().0,
        ..g2.clone()
    };
    p.dst[..64].iter_mut().for_each(|b| *b = 0xee);
    for (t, g, local) in [(&p.t, &forged, p.s.id), (&t2, &stolen, os.id)] {
        t.open_room(g, EPOCH).unwrap();
        let w = WriteOp {
            local_region: local,
            ..op(&p, 0, 0, 64)
        };
        let id = t.submit(&[w], &opts()).unwrap();
        t.wait(id, Duration::from_secs(10)).unwrap();
        let e = t
            .close_room(ROOM, EPOCH, Duration::from_secs(10))
            .unwrap_err();
        assert_eq!(e.status(), Status::PeerIdentity, "{e}");
        assert!(untouched(&p, 0), "nothing written");
    }
    assert_eq!(p.rx.room_grants_held(), 1, "the real grant stays held");
    // revoked: nothing written
    assert!(p.rx.revoke_room(g2.token));
    p.t.open_room(&g2, EPOCH).unwrap();
    let id = p.t.submit(&[op(&p, 0, 0, 64)], &opts()).unwrap();
    p.t.wait(id, Duration::from_secs(10)).unwrap();
    let e =
        p.t.close_room(ROOM, EPOCH, Duration::from_secs(10))
            .unwrap_err();
    assert_eq!(e.status(), Status::Aborted, "{e}");
    assert!(untouched(&p, 0), "a revoked grant writes nothing");
    drop(other_src);
}

/// A placed (one-copy) batch of a room whose grant is open: the caller's
/// placement runs at once, with no per-batch frame; one outside the grant is
/// refused before anything is placed.
#[test]
fn cma_placed_batches_of_a_room_skip_the_per_batch_frames() {
    use pdxfer::transport::PlacedRange;
    let _g = serial();
    let rx = agent(true, None);
    let tx = agent(false, None);
    let d = rx.registry().alloc_shared(LEN).unwrap();
    let t = connect(&tx, &rx, TransportKind::Cma);
    let m = t.mapped_dst(d.id).expect("the shared region is mapped");
    let g = rx
        .grant_room(
            tx.instance(),
            ROOM,
            DECODE_EPOCH,
            &[range(&d, 0, 8192)],
            Duration::from_secs(30),
        )
        .unwrap();
    t.open_room(&g, EPOCH).unwrap();
    let before = per_batch_frames();
    let ranges = [PlacedRange {
        remote_region: d.id,
        remote_offset: 100,
        len: 4000,
    }];
    let mut place = || {
        // SAFETY: the range lies in the mapped region (4100 <= LEN) and in the room's grant.
        let dst = unsafe { std::slice::from_raw_parts_mut((m.addr + 100) as *mut u8, 4000) };
        dst.copy_from_slice(&expected(4000, 0));
        Ok(())
    };
    let id = t.submit_placed(&ranges, &opts(), &mut place).unwrap();
    t.wait(id, Duration::from_secs(10)).unwrap();
    assert_eq!(per_batch_frames(), before, "no per-batch frame");
    // outside the grant: refused, the placement never runs
    let bad = [PlacedRange {
        remote_offset: 8000,
        len: 400,
        ..ranges[0]
    }];
    let mut never = || -> pdxfer::Result<()> { panic!("placed a refused batch") };
    let e = t.submit_placed(&bad, &opts(), &mut never).unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    let sum = t.close_room(ROOM, EPOCH, Duration::from_secs(10)).unwrap();
    assert_eq!((sum.batches, sum.bytes), (1, 4000));
    // SAFETY: the region is registered with rx (alive) and no batch writes it now.
    let landed = unsafe { std::slice::from_raw_parts(d.addr as *const u8, 8400) };
    assert_eq!(&landed[100..4100], &expected(4000, 0)[..]);
    assert!(landed[..100].iter().chain(&landed[4100..]).all(|&b| b == 0));
}

/// `end_room` sends the room's end and returns before the answer; the
/// receiver releases the grant on it, and `close_room` then only waits for
/// the answer (one RoomEnd in all) and returns the room's totals. An end of
/// a room not open here is `UnknownRoom`, and sends nothing.
fn end_then_close(kind: TransportKind) {
    let _g = serial();
    let p = pair(kind, "end");
    let g =
        p.rx.grant_room(
            p.tx.instance(),
            ROOM,
            DECODE_EPOCH,
            &[range(&p.d, 0, 64 << 10)],
            Duration::from_secs(30),
        )
        .unwrap();
    p.t.open_room(&g, EPOCH).unwrap();
    for i in 0..4u64 {
        let id =
            p.t.submit(&[op(&p, i * 4096, i * 4096, 4096)], &opts())
                .unwrap();
        p.t.wait(id, Duration::from_secs(10)).unwrap();
    }
    let ends = frames_sent(FrameType::RoomEnd);
    p.t.end_room(ROOM, EPOCH, Duration::from_secs(10)).unwrap();
    assert_eq!(
        frames_sent(FrameType::RoomEnd),
        ends + 1,
        "the end went out"
    );
    let t0 = std::time::Instant::now();
    while p.rx.room_grants_held() != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the receiver never released the grant"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let sum =
        p.t.close_room(ROOM, EPOCH, Duration::from_secs(10))
            .unwrap();
    assert_eq!((sum.batches, sum.bytes), (4, 4 * 4096));
    assert_eq!(
        frames_sent(FrameType::RoomEnd),
        ends + 1,
        "one RoomEnd in all"
    );
    assert_eq!(&p.dst[..4 * 4096], &expected(4 * 4096, 0)[..]);
    let e =
        p.t.end_room(ROOM, EPOCH, Duration::from_secs(1))
            .unwrap_err();
    assert_eq!(e.status(), Status::UnknownRoom, "{e}");
    assert_eq!(frames_sent(FrameType::RoomEnd), ends + 1);
}

#[test]
fn cma_end_room_then_close_waits_only_for_the_answer() {
    end_then_close(TransportKind::Cma);
}

#[test]
fn tcp_end_room_then_close_waits_only_for_the_answer() {
    end_then_close(TransportKind::Tcp);
}
