//! The grant protocol of cma and rdma, receiver side: the sender sends an
//! intent (the destination ranges of a batch, or the source ranges of a
//! read); this side validates and pins them (Grant) or refuses (Refuse:
//! nothing is written); the sender moves the bytes itself (cma:
//! `process_vm_writev`; rdma: one-sided WRITE/READ) and commits; this side
//! checks the commit against the grant ([`finish_granted`]), delivers the
//! completion record (writes only) and answers Ack or Nack. A commit for a
//! batch without a grant is a tcp batch's: it goes to the tcp receiver.

use super::{lock, AgentInner, ReceiverSession};
use crate::auth::SessionMac;
use crate::error::{Error, Result, Status};
use crate::memory::{AccessGuard, RegionDesc, RegionKind, Registry};
use crate::transport::conn::readable;
use crate::transport::identity::ProcIdentity;
use crate::transport::tcp::finalize_tcp;
use crate::transport::wire::{self, Commit, FrameType, Range};
use crate::transport::{checksum, BatchId, Completion};
use std::collections::HashMap;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The ranges of one granted batch, pinned until its commit or abort, or
/// until it expires ([`AgentOptions::pin_timeout`](super::AgentOptions::pin_timeout)).
pub(crate) struct Granted {
    since: Instant,
    ranges: Vec<Range>,
    guards: Vec<AccessGuard>,
    /// Some range lies in device memory (rdma only; never read by the CPU).
    device: bool,
    /// The peer reads these ranges (no completion record is delivered here).
    read: bool,
}

pub(super) fn control_loop(
    a: &AgentInner,
    sess: &ReceiverSession,
    s: &mut TcpStream,
    mac: &mut SessionMac,
    peer: ProcIdentity,
) -> Result<()> {
    let mut last = Instant::now();
    loop {
        // Wait for the next frame in ticks: between them, grants past the
        // pin timeout are dropped, and a sender silent past the idle timeout
        // (no keepalive: gone, or never a real sender) ends the session.
        let tick = (a.pin_timeout.min(a.idle_timeout) / 4)
            .clamp(Duration::from_millis(10), Duration::from_secs(1));
        if !readable(s, tick)? {
            expire_grants(a, sess);
            a.room_grants.expire();
            if last.elapsed() >= a.idle_timeout {
                return Err(Error::new(
                    Status::Timeout,
                    format!(
                        "session {}: no frame from the sender for {:?}; closed",
                        sess.id, a.idle_timeout
                    ),
                ));
            }
            continue;
        }
        // a frame that started arrives whole within the handshake timeout
        s.set_read_timeout(Some(a.handshake_timeout))?;
        let (ty, p) = wire::read_frame_sealed(s, wire::MAX_CONTROL_PAYLOAD, mac)?;
        last = Instant::now();
        expire_grants(a, sess);
        match ty {
            FrameType::Keepalive => {}
            FrameType::Intent | FrameType::ReadIntent => {
                let read = ty == FrameType::ReadIntent;
                let (batch, ranges) = wire::decode_intent(&p)?;
                if !a.stall().is_zero() {
                    std::thread::sleep(a.stall());
                }
                // Device memory only over rdma, and only once the NIC registered
                // it (GPUDirect RDMA; an exact range registered before is a lookup).
                let nic = lock(&sess.rdma).is_some().then(|| a.nic());
                let device = |d: &RegionDesc| -> Result<()> {
                    match &nic {
                        Some(Ok(n)) => {
                            a.gpu_direct(&**n)?;
                            // SAFETY: a registry region stays valid until unregistered,
                            // whose hook deregisters it from the NIC first.
                            unsafe { n.register(d.addr, d.len, d.kind) }.map(|_| ())
                        }
                        Some(Err(e)) => Err(e.clone()),
                        None => Err(Error::new(
                            Status::Unsupported,
                            "cma writes host memory only",
                        )),
                    }
                };
                match grant(&a.registry, &ranges, &device) {
                    Ok((guards, device)) => {
                        lock(&sess.granted).insert(
                            batch,
                            Granted {
                                since: Instant::now(),
                                ranges,
                                guards,
                                device,
                                read,
                            },
                        );
                        sess.send(FrameType::Grant, &batch.to_le_bytes());
                    }
                    Err(e) => sess.send(FrameType::Refuse, &wire::encode_reason(batch, &e)),
                }
            }
            FrameType::RoomEnd => super::room_grant::room_end(a, sess, &p, &peer),
            FrameType::RoomQuery => super::room_grant::room_query(a, sess, &p),
            FrameType::Fenced => super::standing_grant::fenced(a, sess, &p)?,
            FrameType::StandingCommit => super::standing_grant::committed(a, sess, &p, &peer)?,
            FrameType::Abort => {
                let batch = wire::decode_batch(&p)?;
                lock(&sess.granted).remove(&batch);
            }
            FrameType::Commit => {
                let c = wire::decode_commit(&p)?;
                let g = lock(&sess.granted).remove(&c.batch);
                match g {
                    Some(g) => {
                        // GPUDirect writes into device memory are made visible
                        // to CUDA work (flushed where the device does not order
                        // them) before their completion is delivered, while the
                        // ranges are still pinned.
                        let r = finish_granted(&g, &c).and_then(|()| {
                            if g.device && !g.read {
                                a.before_device_delivery()
                            } else {
                                Ok(())
                            }
                        });
                        let read = g.read;
                        drop(g);
                        match r {
                            Ok(()) => {
                                if !read {
                                    a.deliver(peer.clone(), sess.id, completion(&c));
                                }
                                sess.send(FrameType::Ack, &c.batch.to_le_bytes());
                            }
                            Err(e) => sess.send(FrameType::Nack, &wire::encode_reason(c.batch, &e)),
                        }
                    }
                    None if lock(&sess.expired).contains(&c.batch) => {
                        let e = Error::new(
                            Status::Timeout,
                            format!(
                                "batch {}: its grant expired after {:?} without a commit; the ranges were released",
                                c.batch, a.pin_timeout
                            ),
                        );
                        sess.send(FrameType::Nack, &wire::encode_reason(c.batch, &e));
                    }
                    None => {
                        let mut t = lock(&sess.tcp);
                        if t.finished.contains(&c.batch) {
                            continue;
                        }
                        t.batches.entry(c.batch).or_default().commit = Some(c);
                        finalize_tcp(a, sess, &mut t, c.batch, &peer);
                    }
                }
            }
            other => {
                return Err(Error::new(
                    Status::Protocol,
                    format!("unexpected {other:?} frame on a control connection"),
                ))
            }
        }
    }
}

/// Drops the grants held longer than the pin timeout (their regions can be
/// unregistered again); a late commit of one is refused.
fn expire_grants(a: &AgentInner, sess: &ReceiverSession) {
    let mut g = lock(&sess.granted);
    let mut gone = Vec::new();
    g.retain(|&b, x| {
        let keep = x.since.elapsed() < a.pin_timeout;
        if !keep {
            gone.push(b);
        }
        keep
    });
    drop(g);
    if !gone.is_empty() {
        let mut ex = lock(&sess.expired);
        for b in gone {
            log::warn!(
                "session {}: the grant of batch {b} expired after {:?} without a commit; its ranges are released",
                sess.id,
                a.pin_timeout
            );
            ex.push_back(b);
            if ex.len() > EXPIRED_REMEMBERED {
                ex.pop_front();
            }
        }
    }
}

/// Expired grants remembered per session (to refuse their late commits).
const EXPIRED_REMEMBERED: usize = 1024;

pub(crate) fn completion(c: &Commit) -> Completion {
    Completion {
        batch_id: BatchId(c.batch),
        bytes: c.bytes,
        checksum: c.checksum,
        room: c.room,
        epoch: c.epoch,
    }
}

/// Validates and pins every range of a cma or rdma intent; all or nothing.
/// `device` says whether a device region may be written (cma: never; rdma:
/// once the NIC registered it), or why not. Returns the guards and whether
/// a range is device memory.
fn grant(
    reg: &Registry,
    ranges: &[Range],
    device: &dyn Fn(&RegionDesc) -> Result<()>,
) -> Result<(Vec<AccessGuard>, bool)> {
    let mut guards: Vec<AccessGuard> = Vec::new();
    let mut descs: HashMap<u64, RegionDesc> = HashMap::new();
    let mut any_device = false;
    for (i, r) in ranges.iter().enumerate() {
        let ctx = |e: Error| Error::new(e.status(), format!("range {i}: {}", e.detail()));
        let d = match descs.entry(r.region) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let d = reg.get(r.region).map_err(ctx)?;
                if d.kind != RegionKind::Host {
                    device(&d).map_err(|e| {
                        ctx(Error::new(
                            e.status(),
                            format!("region {} is device memory: {}", r.region, e.detail()),
                        ))
                    })?;
                    any_device = true;
                }
                guards.push(reg.acquire(r.region, 0, 0).map_err(ctx)?);
                v.insert(d)
            }
        };
        d.check(r.offset, r.len).map_err(ctx)?;
    }
    Ok((guards, any_device))
}

/// Checks the commit of a granted cma or rdma batch against its grant: the
/// byte count, and the checksum over the landed bytes when the sender sent
/// one (refused for device memory, which the CPU cannot read).
fn finish_granted(g: &Granted, c: &Commit) -> Result<()> {
    let total: u64 = g.ranges.iter().map(|r| r.len).sum();
    if total != c.bytes {
        return Err(Error::new(
            Status::Protocol,
            format!("commit says {} bytes but {} were granted", c.bytes, total),
        ));
    }
    if let Some(want) = c.checksum {
        if g.device {
            return Err(Error::new(
                Status::Unsupported,
                "a checksum over device memory is not supported (the CPU cannot read it); submit without checksum",
            ));
        }
        let mut got = 0u64;
        for (r, addr) in g.ranges.iter().zip(range_addrs(g)) {
            // SAFETY: the range was bounds-checked at grant and its region is pinned by g.guards.
            let d = unsafe { std::slice::from_raw_parts(addr as *const u8, r.len as usize) };
            got = checksum::combine(got, checksum::piece(r.region, r.offset, d));
        }
        if got != want {
            return Err(Error::new(
                Status::BatchFailed,
                format!("checksum mismatch: sender 0x{want:016x}, landed bytes 0x{got:016x}"),
            ));
        }
    }
    Ok(())
}

fn range_addrs(g: &Granted) -> Vec<u64> {
    // Guards are per region (offset 0): region base = guard addr.
    let base: HashMap<u64, u64> = g.guards.iter().map(|x| (x.region(), x.addr())).collect();
    g.ranges
        .iter()
        .map(|r| base.get(&r.region).copied().unwrap_or(0) + r.offset)
        .collect()
}
