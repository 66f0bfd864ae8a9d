//! The tcp receiver: each data stream attaches to a sender's session, reads
//! piece headers, validates each destination against the registry and reads
//! the payload straight into it (device regions through [`super::device`]),
//! counting the bytes of each batch across streams; once the batch's commit
//! arrived on the control connection and every byte counted, the verdict
//! (bytes, checksum) is delivered and answered with Ack or Nack. A piece of
//! a granted room is checked against the room's grant (its token, for this
//! session's authenticated instance) and counted there; the room's RoomEnd
//! is answered once every byte it names landed.

use super::device::{receive_into_device, DEVICE_BOUNCE_BYTES};
use crate::auth::PeerInstance;
use crate::error::{Error, Result, Status};
use crate::memory::{RegionKind, Registry};
use crate::transport::agent::{
    completion, lock, piece_landed, refuse, AgentInner, ReceiverSession,
};
use crate::transport::checksum;
use crate::transport::handshake::Attach;
use crate::transport::identity::ProcIdentity;
use crate::transport::listen::Slot;
use crate::transport::wire::{self, Commit, DataHeader, FrameType, DATA_HEADER_LEN};
use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;

/// One batch as the receiver counts it.
#[derive(Default)]
pub(crate) struct RecvBatch {
    received: u64,
    sum: u64,
    failed: Option<Error>,
    pub(crate) commit: Option<Commit>,
}

/// The tcp batches of one session in progress, and the finished ones.
#[derive(Default)]
pub(crate) struct TcpRecv {
    pub(crate) batches: HashMap<u64, RecvBatch>,
    pub(crate) finished: HashSet<u64>,
    /// Batches the test stall knob already delayed.
    stalled: HashSet<u64>,
}

/// Finished batch ids remembered per session (late frames of a finished batch
/// are dropped); batch ids grow, so only the newest ones need remembering.
const FINISHED_WINDOW: u64 = 8192;

impl TcpRecv {
    fn mark_finished(&mut self, batch: u64) {
        self.finished.insert(batch);
        if self.finished.len() as u64 > 2 * FINISHED_WINDOW {
            let keep = batch.saturating_sub(FINISHED_WINDOW);
            self.finished.retain(|&b| b >= keep);
        }
    }
}

/// Decides a batch once its commit arrived and every byte counted (or one
/// piece failed): delivers it and answers Ack, or answers Nack with why.
pub(crate) fn finalize_tcp(
    a: &AgentInner,
    sess: &ReceiverSession,
    t: &mut TcpRecv,
    batch: u64,
    peer: &ProcIdentity,
) {
    let Some(b) = t.batches.get(&batch) else {
        return;
    };
    let Some(c) = b.commit else { return };
    let verdict = if let Some(e) = &b.failed {
        Some(Err(e.clone()))
    } else if b.received > c.bytes {
        Some(Err(Error::new(
            Status::Protocol,
            format!(
                "received {} bytes for a batch committed with {}",
                b.received, c.bytes
            ),
        )))
    } else if b.received == c.bytes {
        match c.checksum {
            Some(want) if want != b.sum => Some(Err(Error::new(
                Status::BatchFailed,
                format!(
                    "checksum mismatch: sender 0x{want:016x}, landed bytes 0x{:016x}",
                    b.sum
                ),
            ))),
            _ => Some(Ok(())),
        }
    } else {
        None
    };
    match verdict {
        None => {}
        Some(Ok(())) => {
            t.batches.remove(&batch);
            t.mark_finished(batch);
            a.deliver(peer.clone(), sess.id, completion(&c));
            sess.send(FrameType::Ack, &batch.to_le_bytes());
        }
        Some(Err(e)) => {
            t.batches.remove(&batch);
            t.mark_finished(batch);
            sess.send(FrameType::Nack, &wire::encode_reason(batch, &e));
        }
    }
}

/// Serves one data stream whose first frame was an Attach.
/// The stream authenticated as `peer`; it attaches only to a session whose
/// control connection authenticated as the same instance, with its token.
pub(crate) fn serve_stream(
    a: Arc<AgentInner>,
    mut s: TcpStream,
    p: &[u8],
    mut slot: Slot,
    peer: PeerInstance,
) {
    let att: Attach = match serde_json::from_slice(p) {
        Ok(x) => x,
        Err(e) => {
            return refuse(
                &mut s,
                Error::new(Status::Protocol, format!("malformed Attach: {e}")),
            )
        }
    };
    let sess = lock(&a.sessions).get(&att.session).cloned();
    let Some(sess) = sess.filter(|x| {
        x.instance == peer && bool::from(x.token.as_bytes().ct_eq(att.token.as_bytes()))
    }) else {
        return refuse(
            &mut s,
            Error::new(
                Status::Unauthorized,
                format!("no session {} with that token", att.session),
            ),
        );
    };
    if wire::write_json(&mut s, FrameType::AttachOk, &serde_json::json!({})).is_err() {
        return;
    }
    slot.established();
    // idle between batches as long as the session lives (closing it shuts
    // this socket); a piece's payload is bounded by the pin timeout
    let _ = s.set_read_timeout(None);
    if let Ok(c) = s.try_clone() {
        lock(&sess.sockets).push(c);
    }
    if sess.closed.load(Ordering::SeqCst) {
        return;
    }
    let peer = lock(&sess.peer)
        .clone()
        .unwrap_or_else(|| a.identity.clone());
    if let Err(e) = stream_loop(&a, &sess, &mut s, &peer) {
        if matches!(e.status(), Status::Protocol | Status::Timeout) {
            // A desynchronised stream (or one whose piece stopped arriving
            // and released its pin) cannot be trusted: end the session.
            log::warn!("session {}: data stream closed: {e}", sess.id);
            sess.close();
        }
    }
}

fn stream_loop(
    a: &AgentInner,
    sess: &ReceiverSession,
    s: &mut TcpStream,
    peer: &ProcIdentity,
) -> Result<()> {
    let mut scratch = vec![0u8; 64 << 10];
    // from the first device writer met (page-locked where it can)
    let mut bounce: Option<crate::memory::BounceBuffer> = None;
    let mut hb = [0u8; DATA_HEADER_LEN];
    loop {
        if sess.closed.load(Ordering::SeqCst) {
            return Ok(());
        }
        s.read_exact(&mut hb)?;
        let h = DataHeader::decode(&hb)?;
        if h.flags & wire::DATA_FLAG_ROOM != 0 {
            receive_room_piece(a, sess, s, &h, &mut scratch, &mut bounce, peer)?;
            continue;
        }
        if !a.stall().is_zero() {
            let new = lock(&sess.tcp).stalled.insert(h.batch);
            if new {
                std::thread::sleep(a.stall());
            }
        }
        let mut payload = PinDeadline::new(s, a.pin_timeout);
        let outcome = receive_piece(&a.registry, &mut payload, &h, &mut scratch, &mut bounce);
        let _ = s.set_read_timeout(None);
        let outcome = outcome?;
        let mut t = lock(&sess.tcp);
        if t.finished.contains(&h.batch) {
            continue;
        }
        let b = t.batches.entry(h.batch).or_default();
        match outcome {
            Ok(sum) => {
                b.received += h.len;
                b.sum = checksum::combine(b.sum, sum);
            }
            Err(e) => {
                if b.failed.is_none() {
                    b.failed = Some(e);
                }
            }
        }
        finalize_tcp(a, sess, &mut t, h.batch, peer);
    }
}

/// Receives one piece of a granted room (its header's batch field is the
/// grant's token): checked against the grant the token names for this
/// session's authenticated instance, not against the registry alone;
/// refused (its payload drained, nothing written) outside it, or for a
/// forged, revoked or expired token. The grant counts the bytes landed.
fn receive_room_piece(
    a: &AgentInner,
    sess: &ReceiverSession,
    s: &mut TcpStream,
    h: &DataHeader,
    scratch: &mut [u8],
    bounce: &mut Option<crate::memory::BounceBuffer>,
    peer: &ProcIdentity,
) -> Result<()> {
    let token = h.batch;
    let outcome = match a
        .room_grants
        .admit_piece(token, sess.instance, h.region, h.offset, h.len)
    {
        Ok(()) => {
            let mut payload = PinDeadline::new(s, a.pin_timeout);
            let r = receive_piece(&a.registry, &mut payload, h, scratch, bounce);
            let _ = s.set_read_timeout(None);
            r?.map(|_| h.len)
        }
        Err(e) => {
            drain(s, h.len, scratch)?;
            Err(e)
        }
    };
    piece_landed(a, sess, peer, token, outcome);
    Ok(())
}

/// The payload of one piece: reads fail with `TimedOut` once `timeout`
/// passed since the piece began (its destination is pinned meanwhile).
struct PinDeadline<'a> {
    s: &'a mut TcpStream,
    end: Instant,
    timeout: Duration,
}

impl<'a> PinDeadline<'a> {
    fn new(s: &'a mut TcpStream, timeout: Duration) -> PinDeadline<'a> {
        PinDeadline {
            s,
            end: Instant::now() + timeout,
            timeout,
        }
    }
}

impl Read for PinDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "a piece's payload did not arrive within the pin timeout ({:?}); its pin was released",
                    self.timeout
                ),
            ));
        }
        self.s.set_read_timeout(Some(left))?;
        match self.s.read(buf) {
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock) => {
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "a piece's payload did not arrive within the pin timeout ({:?}); its pin was released",
                        self.timeout
                    ),
                ))
            }
            r => r,
        }
    }
}

/// Receives the payload of one data piece `h` from `s` into its destination:
/// straight into a host region, or through `bounce` (allocated by the first
/// device writer met, [`DEVICE_BOUNCE_BYTES`]) and the region's
/// [`DeviceWriter`](crate::memory::DeviceWriter) into a device region (the
/// piece counts as received only once the writer has every byte in device
/// memory). The outer error is the socket's (the stream is lost); the inner
/// one a refused or failed write, whose payload was drained so the stream
/// stays in sync. `Ok(Ok(sum))` carries the piece checksum (0 unless the
/// header asks for one), computed on the bytes received.
pub(super) fn receive_piece(
    reg: &Registry,
    s: &mut impl Read,
    h: &DataHeader,
    scratch: &mut [u8],
    bounce: &mut Option<crate::memory::BounceBuffer>,
) -> Result<Result<u64>> {
    let want_sum = h.flags & wire::DATA_FLAG_CHECKSUM != 0;
    let access = reg.acquire(h.region, h.offset, h.len).and_then(|g| {
        match reg.kind(h.region)? {
            RegionKind::Host => Ok((g, None)),
            RegionKind::Device { .. } => match reg.device_writer(h.region) {
                Some(w) => Ok((g, Some(w))),
                None => Err(Error::new(
                    Status::Unsupported,
                    format!(
                        "region {} is device memory registered without a device writer; tcp cannot write it",
                        h.region
                    ),
                )),
            },
        }
    });
    let refused = match access {
        Ok((g, None)) => {
            // SAFETY: the guard proves [addr, addr+len) lies in a registered host region, pinned until g drops.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(g.addr() as *mut u8, h.len as usize) };
            s.read_exact(dst)?;
            let sum = if want_sum {
                checksum::piece(h.region, h.offset, dst)
            } else {
                0
            };
            drop(g);
            return Ok(Ok(sum));
        }
        Ok((g, Some(w))) => {
            let b = bounce.get_or_insert_with(|| w.bounce(DEVICE_BOUNCE_BYTES));
            let r = receive_into_device(s, h, g.addr(), &*w, b.as_mut_slice(), scratch)?;
            drop(g);
            return Ok(r);
        }
        Err(e) => e,
    };
    // Nothing is written: drain the payload into scratch to stay in sync.
    drain(s, h.len, scratch)?;
    Ok(Err(Error::new(
        refused.status(),
        format!(
            "write of {} bytes to region {} offset {} refused: {}",
            h.len,
            h.region,
            h.offset,
            refused.detail()
        ),
    )))
}

pub(super) fn drain(s: &mut impl Read, mut left: u64, scratch: &mut [u8]) -> Result<()> {
    while left > 0 {
        let n = left.min(scratch.len() as u64) as usize;
        s.read_exact(&mut scratch[..n])?;
        left -= n as u64;
    }
    Ok(())
}
