//! Standing grants on real cma connections between two agents of this
//! process: a batch without a room grant moves with no intent, grant or ack
//! (one StandingCommit, then the receiver's completion), an out-of-bounds
//! write is refused with the target unchanged, and an unregister racing the
//! writes is fenced: the writes in flight finish, none lands after it
//! returned, and the later batches are refused. A commit the submitting
//! thread sealed is written before a later fence and before a close.

use super::room_grants::serial;
use pdxfer::error::Status;
use pdxfer::memory::RegionDesc;
use pdxfer::transport::control_counts::{frames_received, frames_sent};
use pdxfer::transport::wire::FrameType;
use pdxfer::transport::{
    Agent, AgentOptions, BatchOptions, ConnectOptions, Transport, TransportKind, WriteOp,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const LEN: usize = 1 << 20;

struct Side {
    rx: Agent,
    _tx: Agent,
    dst: Vec<u8>,
    src: Vec<u8>,
    d: RegionDesc,
    s: RegionDesc,
    t: Box<dyn Transport>,
}

fn side() -> Side {
    side_with_threads(1)
}

/// Two agents and a cma connection with `threads` writer threads.
fn side_with_threads(threads: u32) -> Side {
    let rx = Agent::new(&AgentOptions {
        listen: Some("127.0.0.1:0".into()),
        ..Default::default()
    })
    .unwrap();
    let tx = Agent::new(&AgentOptions::default()).unwrap();
    let mut dst = vec![0u8; LEN];
    let mut src: Vec<u8> = (0..LEN as u32).map(|i| (i * 13 + 5) as u8).collect();
    // SAFETY: both buffers live in the Side next to the agents and outlive their use.
    let d = unsafe { rx.register_host(dst.as_mut_ptr(), dst.len()) }.unwrap();
    // SAFETY: as above.
    let s = unsafe { tx.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
    let t = tx
        .connect(
            &rx.local_addr().unwrap().to_string(),
            &ConnectOptions {
                transport: TransportKind::Cma,
                timeout: Duration::from_secs(5),
                threads,
                ..Default::default()
            },
        )
        .unwrap();
    Side {
        rx,
        _tx: tx,
        dst,
        src,
        d,
        s,
        t,
    }
}

fn ops(s: &Side, first: u64, n: u64, len: u64) -> Vec<WriteOp> {
    (0..n)
        .map(|i| WriteOp {
            local_region: s.s.id,
            local_offset: (first + i) * len,
            remote_region: s.d.id,
            remote_offset: (first + i) * len,
            len,
        })
        .collect()
}

fn opts() -> BatchOptions {
    BatchOptions {
        timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

/// Waits until the sender uses the standing grant (a batch sent no Intent);
/// the grant reaches it with the connection, asynchronously.
fn granted(s: &Side) {
    let t0 = Instant::now();
    loop {
        let intents = frames_sent(FrameType::Intent);
        let id = s.t.submit(&ops(s, 0, 1, 4096), &opts()).unwrap();
        s.t.wait(id, Duration::from_secs(10)).unwrap();
        // the batch's completion: its last frame (a StandingCommit) has been received,
        // so a caller counting frames after this counts only its own
        s.rx.next_completion(Duration::from_secs(5))
            .expect("a completion per batch");
        if frames_sent(FrameType::Intent) == intents {
            assert_eq!(
                s.rx.standing_grants_held(),
                1,
                "the cma session holds its region"
            );
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the standing grant never arrived"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Batches without a room grant move with one StandingCommit each: no
/// Intent, Grant, Commit or Ack frame; every byte lands and the receiver
/// gets one completion per batch.
#[test]
fn cma_batches_under_standing_grants_send_one_frame_each() {
    let _g = serial();
    let s = side();
    granted(&s);
    let per_batch = || {
        [
            frames_received(FrameType::Intent),
            frames_received(FrameType::Grant),
            frames_received(FrameType::Commit),
            frames_received(FrameType::Ack),
        ]
    };
    let before = per_batch();
    let commits = frames_received(FrameType::StandingCommit);
    // 16 batches of 16 x 4 KiB, and one of 64 x 4 KiB
    let mut sizes = Vec::new();
    for b in 0..16u64 {
        let id = s.t.submit(&ops(&s, b * 16, 16, 4096), &opts()).unwrap();
        s.t.wait(id, Duration::from_secs(10)).unwrap();
        sizes.push(16 * 4096);
    }
    let id = s.t.submit(&ops(&s, 192, 64, 4096), &opts()).unwrap();
    assert_eq!(
        s.t.wait(id, Duration::from_secs(10)).unwrap().bytes,
        64 * 4096
    );
    sizes.push(64 * 4096);
    assert_eq!(per_batch(), before, "no per-batch round trip");
    let t0 = Instant::now();
    while frames_received(FrameType::StandingCommit) < commits + 17 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the commits did not arrive"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(frames_received(FrameType::StandingCommit), commits + 17);
    let mut got = Vec::new();
    while got.len() < sizes.len() {
        let c =
            s.rx.next_completion(Duration::from_secs(5))
                .expect("a completion per batch");
        got.push(c.completion.bytes);
    }
    assert_eq!(got, sizes);
    assert_eq!(&s.dst[..256 * 4096], &s.src[..256 * 4096]);
}

/// An op past the end of the granted region is refused before anything is
/// sent or written.
#[test]
fn out_of_bounds_write_under_standing_grant_refused_target_unchanged() {
    let _g = serial();
    let s = side();
    granted(&s);
    let before = s.dst.clone();
    let sent = frames_sent(FrameType::StandingCommit);
    let mut bad = ops(&s, 0, 2, 4096);
    bad[1].remote_offset = LEN as u64 - 100;
    let e = s.t.submit(&bad, &opts()).unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(s.dst, before, "a refused batch wrote nothing");
    assert_eq!(
        frames_sent(FrameType::StandingCommit),
        sent,
        "nothing was sent"
    );
    assert!(s.rx.try_completion().is_none());
    // the connection keeps working
    let id = s.t.submit(&ops(&s, 3, 1, 4096), &opts()).unwrap();
    s.t.wait(id, Duration::from_secs(10)).unwrap();
    assert_eq!(&s.dst[3 * 4096..4 * 4096], &s.src[3 * 4096..4 * 4096]);
}

/// On a connection with one writer thread, a standing batch (here 1 MiB)
/// is written on the submitting thread: when `submit` returns its bytes
/// are in the target and the batch is done, with no hand-off to wait for.
#[test]
fn one_thread_standing_batch_is_written_inside_submit() {
    let _g = serial();
    let s = side();
    granted(&s);
    let dst = s.dst.as_ptr() as usize;
    for (b, fill) in [(0u64, 256u64), (1, 128)] {
        // SAFETY: dst is the Side's buffer (alive, LEN bytes); no batch is in flight.
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, LEN) };
        let id = s.t.submit(&ops(&s, 0, fill, 4096), &opts()).unwrap();
        let n = fill as usize * 4096;
        // SAFETY: as above; the batch's bytes were written before submit returned.
        let landed = unsafe { std::slice::from_raw_parts(dst as *const u8, n) };
        assert_eq!(
            landed,
            &s.src[..n],
            "batch {b}: every byte landed inside submit"
        );
        match s.t.poll(id).unwrap() {
            pdxfer::transport::BatchStatus::Done(c) => assert_eq!(c.bytes, n as u64),
            other => panic!("batch {b}: {other:?} right after submit, not Done"),
        }
    }
    while s.rx.next_completion(Duration::from_millis(200)).is_some() {}
}

/// An unregister racing a writer: the sender is told (Revoke), fences its
/// writes (Fenced) and the unregister returns; no byte lands after it, and
/// later batches into the region are refused. Two writer threads, so the
/// batches in flight are on the connection's writer threads, not the caller's.
#[test]
fn unregister_racing_standing_writes_is_fenced() {
    let _g = serial();
    let mut s = side_with_threads(2);
    granted(&s);
    let stop = AtomicBool::new(false);
    let (ok, failed) = (AtomicU64::new(0), AtomicU64::new(0));
    let dst = s.dst.as_mut_ptr() as usize;
    std::thread::scope(|sc| {
        let (s, stop, ok, failed) = (&s, &stop, &ok, &failed);
        sc.spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                // 1 MiB batches, moved by the writer threads
                let r =
                    s.t.submit(&ops(s, 0, 256, 4096), &opts())
                        .and_then(|id| s.t.wait(id, Duration::from_secs(10)));
                match r {
                    Ok(_) => ok.fetch_add(1, Ordering::SeqCst),
                    Err(_) => failed.fetch_add(1, Ordering::SeqCst),
                };
            }
        });
        let t0 = Instant::now();
        while ok.load(Ordering::SeqCst) < 3 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the writer never wrote"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let revokes = frames_received(FrameType::Revoke);
        s.rx.registry()
            .unregister(s.d.id, Duration::from_secs(10))
            .unwrap();
        assert_eq!(frames_received(FrameType::Revoke), revokes + 1);
        assert_eq!(
            s.rx.standing_grants_held(),
            0,
            "the pin went with the fence"
        );
        // nothing of this connection lands in the memory from here on
        // SAFETY: dst is the Side's buffer (alive); no region covers it now.
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0xEE, LEN) };
        let failed_then = failed.load(Ordering::SeqCst);
        let t1 = Instant::now();
        while failed.load(Ordering::SeqCst) < failed_then + 3 {
            assert!(
                t1.elapsed() < Duration::from_secs(20),
                "later batches were not refused"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Ordering::SeqCst);
    });
    assert!(
        s.dst.iter().all(|&b| b == 0xEE),
        "a write landed after the unregister returned"
    );
    let e =
        s.t.submit(&ops(&s, 0, 1, 4096), &opts())
            .and_then(|id| s.t.wait(id, Duration::from_secs(10)));
    assert_eq!(e.unwrap_err().status(), Status::RegionNotFound);
    s.dst.clear();
}

/// On one writer thread the submitting thread moves the bytes and seals the
/// batch's `StandingCommit`, and the writer thread writes it: an unregister
/// racing such batches still sees every commit of a batch the sender was
/// told is done before the `Fenced` (the frames go out in the order sealed),
/// so the receiver delivers a completion for each of them and keeps the
/// connection (a commit after the fence would be a protocol error).
#[test]
fn deferred_commits_are_written_before_the_fence() {
    let _g = serial();
    let s = side();
    granted(&s);
    let stop = AtomicBool::new(false);
    let ok = AtomicU64::new(0);
    std::thread::scope(|sc| {
        let (s, stop, ok) = (&s, &stop, &ok);
        sc.spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                // 64 KiB batches, each moved inside submit
                let r =
                    s.t.submit(&ops(s, 0, 16, 4096), &opts())
                        .and_then(|id| s.t.wait(id, Duration::from_secs(10)));
                if r.is_ok() {
                    ok.fetch_add(1, Ordering::SeqCst);
                } else {
                    return;
                }
            }
        });
        let t0 = Instant::now();
        while ok.load(Ordering::SeqCst) < 50 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the writer never wrote"
            );
            std::thread::yield_now();
        }
        s.rx.registry()
            .unregister(s.d.id, Duration::from_secs(10))
            .unwrap();
        stop.store(true, Ordering::SeqCst);
    });
    let done = ok.load(Ordering::SeqCst);
    let mut delivered = 0u64;
    while delivered < done {
        match s.rx.next_completion(Duration::from_secs(5)) {
            Some(c) => {
                assert_eq!(c.completion.bytes, 16 * 4096);
                delivered += 1;
            }
            None => panic!("{delivered} of {done} completions arrived"),
        }
    }
    assert!(
        s.rx.next_completion(Duration::from_millis(100)).is_none(),
        "one completion per batch"
    );
    // the connection outlived the fence: the next batch is refused for the
    // region, not for a dead connection
    let e =
        s.t.submit(&ops(&s, 0, 1, 4096), &opts())
            .and_then(|id| s.t.wait(id, Duration::from_secs(10)));
    assert_eq!(e.unwrap_err().status(), Status::RegionNotFound);
}

/// A batch done inside `submit` whose commit is still waiting to be written
/// when the connection is closed: the close writes it first, so the receiver
/// gets the completion of every batch the sender saw done.
#[test]
fn close_writes_the_deferred_commits_first() {
    let _g = serial();
    let s = side();
    granted(&s);
    let n = 20u64;
    for b in 0..n {
        let id = s.t.submit(&ops(&s, b, 1, 4096), &opts()).unwrap();
        assert!(matches!(
            s.t.poll(id).unwrap(),
            pdxfer::transport::BatchStatus::Done(_)
        ));
    }
    s.t.close();
    for b in 0..n {
        assert!(
            s.rx.next_completion(Duration::from_secs(5)).is_some(),
            "completion {b} of {n} did not arrive"
        );
    }
}
