//! The decode's room state machine against its control reader: a decode
//! engine's state (`engine::test_rig::decode_state`) and prefill links over
//! loopback sockets whose far ends the test writes the prefill's messages
//! to. No bootstrap, no handshake, no data plane.

use super::reader::decode_reader;
use super::{Decode, DecodeRoom};
use crate::bootstrap::schema::{InstanceId, Registration, Role};
use crate::engine::control::{CtlMsg, CtlReader, CtlWriter};
use crate::engine::link::PrefillLink;
use crate::engine::room::KvPoll;
use crate::engine::state::lock;
use crate::engine::test_rig::{decode_state, ROOM};
use crate::error::Status;
use std::collections::BTreeSet;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A prefill link of instance `instance` whose reader runs on its own thread
/// (as `prefill_link` starts it), and the prefill's end of the socket.
fn link(d: &Arc<Decode>, instance: u128) -> (Arc<PrefillLink>, CtlWriter) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (theirs, _) = l.accept().unwrap();
    let reg = Registration::new(
        "decode-tests",
        Role::Prefill,
        InstanceId(instance),
        d.cfg.topology.clone(),
    );
    let link = Arc::new(PrefillLink {
        registration: reg,
        writer: CtlWriter::new(ours.try_clone().unwrap()),
        alive: AtomicBool::new(true),
        counters: Default::default(),
    });
    let (w, l2, r) = (Arc::downgrade(d), link.clone(), CtlReader::new(ours));
    std::thread::spawn(move || decode_reader(w, l2, r));
    (link, CtlWriter::new(theirs))
}

/// Opens room [`ROOM`] against `targets` (as `receiver` and `send_metadata`
/// leave it: waiting for the prefill ranks); returns its attempt.
fn open(d: &Decode, targets: &[Arc<PrefillLink>]) -> u64 {
    open_with(d, targets, &[])
}

/// [`open`], with `dummies` as the room's dummy targets.
fn open_with(d: &Decode, targets: &[Arc<PrefillLink>], dummies: &[Arc<PrefillLink>]) -> u64 {
    let attempt = d.create_room(ROOM, None).unwrap();
    lock(&d.rooms).update(ROOM, attempt, KvPoll::WaitingForInput);
    lock(&d.decode_rooms).insert(
        ROOM,
        DecodeRoom {
            attempt,
            targets: targets.to_vec(),
            responded: BTreeSet::new(),
            bytes: 0,
            abort_acks: 0,
            dummies: dummies.to_vec(),
            state_indices: Vec::new(),
            grants: Vec::new(),
            named: None,
        },
    );
    attempt
}

fn status(attempt: u64, ok: bool, rank: u32, bytes: u64, code: Option<Status>) -> CtlMsg {
    CtlMsg::Status {
        room: ROOM,
        attempt,
        ok,
        prefill_rank: rank,
        bytes,
        reason: (!ok).then(|| "the prefill's reason".to_string()),
        code: code.map(|c| c as i32),
    }
}

/// Waits (up to 5 s) until `f` holds of the decode's state.
fn until(d: &Decode, what: &str, f: impl Fn(&Decode) -> bool) {
    let end = Instant::now() + Duration::from_secs(5);
    while !f(d) {
        assert!(Instant::now() < end, "never: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn poll(d: &Decode) -> KvPoll {
    lock(&d.rooms).get(ROOM).map_or(KvPoll::Failed, |r| r.poll)
}

#[test]
fn a_decode_room_succeeds_once_every_prefill_rank_reported() {
    let (d, _pools) = decode_state();
    let d = Arc::new(d);
    let (a, pa) = link(&d, 1);
    let (b, pb) = link(&d, 2);
    let attempt = open(&d, &[a, b]);
    // a status of an older attempt of the room id changes nothing
    pa.send(&status(attempt + 1, true, 0, 99, None)).unwrap();
    pa.send(&status(attempt, true, 0, 100, None)).unwrap();
    until(&d, "transferring", |d| poll(d) == KvPoll::Transferring);
    let bytes = |d: &Decode| lock(&d.decode_rooms).get(&ROOM).map_or(0, |r| r.bytes);
    assert_eq!(bytes(&d), 100);
    pb.send(&status(attempt, true, 1, 28, None)).unwrap();
    until(&d, "success", |d| poll(d) == KvPoll::Success);
    assert_eq!(bytes(&d), 128);
}

#[test]
fn a_prefill_ranks_failure_fails_the_room_with_its_code_and_reason() {
    let (d, _pools) = decode_state();
    let d = Arc::new(d);
    let (a, pa) = link(&d, 1);
    let attempt = open(&d, &[a]);
    pa.send(&status(attempt, false, 0, 0, Some(Status::OutOfBounds)))
        .unwrap();
    until(&d, "failed", |d| poll(d) == KvPoll::Failed);
    let e = lock(&d.rooms).get(ROOM).unwrap().failure.clone().unwrap();
    assert_eq!(e.status(), Status::OutOfBounds);
    assert!(e.detail().contains("reported: the prefill's reason"), "{e}");
}

#[test]
fn a_lost_prefill_link_fails_its_rooms_and_an_abort_ack_is_counted() {
    let (d, _pools) = decode_state();
    let d = Arc::new(d);
    let (a, pa) = link(&d, 1);
    let attempt = open(&d, std::slice::from_ref(&a));
    pa.send(&CtlMsg::AbortAck {
        room: ROOM,
        attempt,
    })
    .unwrap();
    until(&d, "abort acknowledged", |d| {
        lock(&d.decode_rooms)
            .get(&ROOM)
            .is_some_and(|r| r.abort_acks == 1)
    });
    assert_eq!(
        poll(&d),
        KvPoll::WaitingForInput,
        "an ack alone ends nothing"
    );
    pa.shutdown();
    until(&d, "failed", |d| poll(d) == KvPoll::Failed);
    assert!(!a.alive.load(Ordering::Acquire));
    let e = lock(&d.rooms).get(ROOM).unwrap().failure.clone().unwrap();
    assert_eq!(e.status(), Status::PeerUnreachable);
    assert!(e.detail().contains("lost the control connection"), "{e}");
}

#[test]
fn a_dummy_targets_abort_ack_fences_nothing_and_its_loss_fails_nothing() {
    let (d, _pools) = decode_state();
    let d = Arc::new(d);
    let (a, pa) = link(&d, 1);
    let (b, pb) = link(&d, 2);
    let attempt = open_with(&d, std::slice::from_ref(&a), std::slice::from_ref(&b));
    let ack = CtlMsg::AbortAck {
        room: ROOM,
        attempt,
    };
    // the dummy's ack, then its link lost: its reader has read both once
    // the link is marked dead
    pb.send(&ack).unwrap();
    pb.shutdown();
    until(&d, "dummy link lost", |_| !b.alive.load(Ordering::Acquire));
    let acks = |d: &Decode| lock(&d.decode_rooms).get(&ROOM).map(|r| r.abort_acks);
    assert_eq!(
        acks(&d),
        Some(0),
        "a dummy never writes: its ack fences nothing"
    );
    assert_eq!(
        poll(&d),
        KvPoll::WaitingForInput,
        "the room waits for no dummy"
    );
    pa.send(&ack).unwrap();
    until(&d, "the real target's ack", |d| acks(d) == Some(1));
}
