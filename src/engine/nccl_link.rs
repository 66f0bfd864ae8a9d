//! Transport nccl (`EngineConfig::transport = Nccl`): KV pools in CUDA device
//! memory on both sides, moved by NCCL point-to-point over one two-rank
//! communicator per (prefill rank, decode rank) link.
//!
//! The communicator is made through the engine's control channel: the
//! prefill sends `nccl_open` (a generation and a fresh unique id) and both
//! ends join it non-blocking, against a deadline, the peer's liveness and an
//! abort flag ([`NcclPair::connect`](crate::transport::nccl::NcclPair)). It
//! is cached per peer instance and epoch (one per link) and, after any
//! failure, dropped (aborted): the next chunk to that peer opens a new
//! generation with a new unique id.
//!
//! Per chunk and decode rank the prefill gathers the pair's rows on its own
//! stream into a device staging buffer and sends `nccl_chunk` (the chunk's
//! pages, the decode's pages and the plan's digest). The decode's NCCL thread
//! for that prefill link builds the same plan from the message and its own
//! geometry; a different digest is `nccl_plan_mismatch` on both sides
//! before anything is posted. Otherwise it answers `nccl_accepted`, posts
//! the recvs on its own stream (Direct into the pool rows, or Staged into a
//! staging buffer scattered by the relayout kernel after), and answers
//! `nccl_ready` once the recvs' completion event (and the scatter) ran. The
//! prefill posts its sends after `nccl_accepted`, waits for their event and
//! then for `nccl_ready`: only then is the chunk done, so the room's
//! completion (the prefill's final status) reaches the decode only after
//! every byte is in its pools.
//!
//! Never a hang: every wait is bounded by the room's deadline and polls
//! NCCL's async error, the link's liveness, the room (aborted or failed) and
//! the engine (closing); any of them aborts the communicator (its kernels
//! return, the stream is waited) and fails the room with a reason naming the
//! peer. Other links have their own communicators and go on. A decode's
//! aborted room is fenced only once its recvs stopped; closing an engine
//! aborts the communicators in use and joins the decode's NCCL threads, so
//! nothing NCCL writes outlives it.
//!
//! The aux and state rows of an nccl engine move over the automatic data
//! connection (host memory), as for any other transport.

#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

use super::config::EngineConfig;
use super::control::CtlMsg;
use super::handle::{lock, Inner};
use crate::bootstrap::schema::InstanceId;
use crate::error::{Error, Result, Status};
use crate::transport::TransportKind;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Checks an nccl engine before anything is opened: device pools, and an
/// NCCL that loads (`no_nccl` listing the paths tried, otherwise).
pub(super) fn preflight(cfg: &EngineConfig) -> Result<()> {
    if cfg.transport != TransportKind::Nccl {
        return Ok(());
    }
    if cfg.pool_device.is_none() {
        return Err(Error::new(
            Status::Unsupported,
            "transport nccl moves KV pools in CUDA device memory: set pool_device on both sides (host pools: use cma, tcp or rdma)",
        ));
    }
    let (version, path) = crate::transport::nccl::probe()?;
    log::info!("engine: transport nccl, NCCL {version} from {path}");
    Ok(())
}

/// A peer link's key: the peer's instance and epoch.
pub(super) type LinkKey = (InstanceId, u64);

/// Which answer of the decode a prefill waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct AnswerKey {
    link: LinkKey,
    room: u64,
    attempt: u64,
    generation: u64,
    start: u64,
    /// false: `nccl_accepted`; true: `nccl_ready`.
    landed: bool,
}

/// One answer of the decode.
#[derive(Debug, Clone)]
struct Answer {
    ok: bool,
    reason: Option<String>,
    code: Option<i32>,
}

/// Answers kept at most (late ones for chunks nobody waits for any more).
const MAX_ANSWERS: usize = 4096;

/// The engine's NCCL state (empty unless the transport is nccl).
#[derive(Default)]
pub(super) struct NcclLinks {
    /// Prefill: the decode's answers, by chunk.
    answers: Mutex<HashMap<AnswerKey, Answer>>,
    answered: Condvar,
    /// Decode: rooms whose recvs are being posted or run, with a count.
    active: Mutex<HashMap<u64, usize>>,
    /// Set by `close`: every wait aborts.
    closing: AtomicBool,
    /// Prefill: the sending end of each decode link.
    #[cfg(feature = "nccl")]
    senders: Mutex<HashMap<LinkKey, std::sync::Arc<Mutex<imp::Sender>>>>,
    /// Decode: the NCCL thread of each prefill link.
    #[cfg(feature = "nccl")]
    receivers: Mutex<HashMap<LinkKey, imp::ReceiverThread>>,
}

impl NcclLinks {
    /// Prefill: records an `nccl_accepted` or `nccl_ready` from decode `link`.
    pub(super) fn answer(&self, link: LinkKey, m: CtlMsg) {
        let (key, a) = match m {
            CtlMsg::NcclAccepted {
                room,
                attempt,
                generation,
                start,
                ok,
                reason,
                code,
            } => (
                AnswerKey {
                    link,
                    room,
                    attempt,
                    generation,
                    start,
                    landed: false,
                },
                Answer { ok, reason, code },
            ),
            CtlMsg::NcclReady {
                room,
                attempt,
                generation,
                start,
                ok,
                reason,
                code,
            } => (
                AnswerKey {
                    link,
                    room,
                    attempt,
                    generation,
                    start,
                    landed: true,
                },
                Answer { ok, reason, code },
            ),
            _ => return,
        };
        let mut m = lock(&self.answers);
        if m.len() >= MAX_ANSWERS {
            m.retain(|k, _| k.room == key.room);
        }
        m.insert(key, a);
        drop(m);
        self.answered.notify_all();
    }

    /// Prefill: waits for one answer until `deadline`, while `live` holds
    /// (checked every few milliseconds; its error ends the wait).
    fn wait_answer(
        &self,
        key: AnswerKey,
        deadline: Instant,
        live: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Answer> {
        let mut m = lock(&self.answers);
        loop {
            if let Some(a) = m.remove(&key) {
                return Ok(a);
            }
            drop(m);
            live()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    Status::Timeout,
                    format!(
                        "no {} from the decode for room {} chunk at {} by the room's deadline",
                        if key.landed {
                            "nccl_ready"
                        } else {
                            "nccl_accepted"
                        },
                        key.room,
                        key.start
                    ),
                ));
            }
            m = lock(&self.answers);
            if m.contains_key(&key) {
                continue;
            }
            let nap = (deadline - now).min(Duration::from_millis(5));
            m = self
                .answered
                .wait_timeout(m, nap)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Prefill: takes one answer if it arrived.
    fn take_answer(&self, key: &AnswerKey) -> Option<Answer> {
        lock(&self.answers).remove(key)
    }

    /// Forgets every answer of a room's attempt (its chunk ended).
    fn forget(&self, link: LinkKey, room: u64, attempt: u64) {
        lock(&self.answers)
            .retain(|k, _| !(k.link == link && k.room == room && k.attempt == attempt));
    }

    /// Decode: true while no recv of `room` is being posted or runs.
    pub(super) fn idle(&self, room: u64) -> bool {
        !lock(&self.active).contains_key(&room)
    }

    fn enter(&self, room: u64) {
        *lock(&self.active).entry(room).or_default() += 1;
    }

    fn leave(&self, room: u64) {
        let mut a = lock(&self.active);
        if let Some(n) = a.get_mut(&room) {
            *n -= 1;
            if *n == 0 {
                a.remove(&room);
            }
        }
    }

    /// True once the engine is closing.
    fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Closing the engine: every NCCL wait aborts its communicator, and the
    /// decode's NCCL threads are joined (their recvs stopped and their
    /// streams waited), so no NCCL write into the pools outlives the engine.
    pub(super) fn close(&self) {
        self.closing.store(true, Ordering::Release);
        self.answered.notify_all();
        #[cfg(feature = "nccl")]
        {
            let threads: Vec<imp::ReceiverThread> =
                lock(&self.receivers).drain().map(|(_, t)| t).collect();
            for t in threads {
                t.join();
            }
            // a prefill worker moving a chunk holds its link's sender until
            // its waits abort (they watch `closing`); then the communicator
            // goes and the link's stream is waited, so no gather or send
            // still reads the pools or the staging once close returns
            let senders: Vec<_> = lock(&self.senders).drain().map(|(_, s)| s).collect();
            for slot in senders {
                let mut s = lock(&slot);
                s.pair = None;
                if let Ok(ev) = s.gpu.record(false) {
                    let _ = ev.wait();
                }
            }
        }
    }
}

/// The room's deadline, or the engine's default from now.
fn room_deadline(inner: &Inner, room: u64) -> Instant {
    lock(&inner.rooms)
        .get(room)
        .ok()
        .and_then(|r| r.deadline)
        .unwrap_or_else(|| Instant::now() + inner.cfg.room_timeout)
}

/// Whether the room's `attempt` still takes bytes (not failed, aborted or
/// ended) and the engine is open.
fn room_live(inner: &Inner, room: u64, attempt: u64) -> Result<()> {
    if inner.closed.load(Ordering::Acquire) || inner.nccl.is_closing() {
        return Err(Error::new(Status::EngineClosed, "engine is closing"));
    }
    let rooms = lock(&inner.rooms);
    match rooms.get(room) {
        Ok(r) if r.attempt == attempt && !r.aborted && r.poll != super::room::KvPoll::Failed => {
            Ok(())
        }
        Ok(r) if r.aborted => Err(Error::new(
            Status::Aborted,
            format!("room {room} was aborted"),
        )),
        Ok(r) => Err(Error::new(
            Status::RoomFailed,
            format!(
                "room {room} ended: {}",
                r.failure.as_ref().map_or("superseded", |e| e.detail())
            ),
        )),
        Err(e) => Err(e),
    }
}

/// The plan options of this engine (the defaults; test builds may set others).
#[cfg(feature = "nccl")]
fn plan_options(cfg: &EngineConfig) -> crate::transport::nccl::NcclPlanOptions {
    #[cfg(any(test, feature = "testing"))]
    if let Some(o) = cfg.testing.nccl_plan {
        return o;
    }
    let _ = cfg;
    Default::default()
}

#[cfg(feature = "nccl")]
pub(super) use imp::{finish_all, on_prefill_message, start_pair};

/// Without the `nccl` feature an nccl engine is refused at creation.
#[cfg(not(feature = "nccl"))]
pub(super) enum NcclSend {}

/// Without the `nccl` feature there is no pair to finish.
#[cfg(not(feature = "nccl"))]
pub(super) fn finish_all(pairs: Vec<NcclSend>) -> Result<()> {
    match pairs.into_iter().next() {
        None => Ok(()),
        Some(p) => match p {},
    }
}

/// Without the `nccl` feature an nccl engine is refused at creation.
#[cfg(not(feature = "nccl"))]
pub(super) fn start_pair(
    _inner: &Inner,
    _job: &super::worker::Job,
    _req: &crate::layout::PairRequest<'_>,
    _row_bytes: &[u64],
    _link: &std::sync::Arc<super::prefill::DecodeLink>,
) -> Result<Option<NcclSend>> {
    Err(Error::new(
        Status::Unsupported,
        "built without the `nccl` feature",
    ))
}

/// Without the `nccl` feature no message is acted on.
#[cfg(not(feature = "nccl"))]
pub(super) fn on_prefill_message(
    _inner: &std::sync::Arc<Inner>,
    _link: &std::sync::Arc<super::decode::PrefillLink>,
    _m: CtlMsg,
) {
}

#[cfg(feature = "nccl")]
mod imp {
    use super::*;
    use crate::engine::decode::PrefillLink;
    use crate::engine::prefill::DecodeLink;
    use crate::engine::worker::Job;
    use crate::layout::{PairRequest, Side};
    use crate::relayout::{
        self,
        gpu::{DeviceBuffer, GpuRelayout},
    };
    use crate::transport::nccl::{
        check_mirror, NcclAbort, NcclBuffer, NcclId, NcclPair, NcclPlan, NcclRole,
    };
    use std::sync::atomic::AtomicU64;
    use std::sync::mpsc;
    use std::sync::{Arc, Weak};

    /// The prefill end of one decode link. Fields drop in order: the pair
    /// (aborted and its stream waited, when work is in flight) before the
    /// staging buffer and the stream it uses.
    pub(in crate::engine) struct Sender {
        pub(super) pair: Option<NcclPair>,
        generation: u64,
        staging: Option<DeviceBuffer>,
        pub(super) gpu: GpuRelayout,
    }

    /// A device buffer of at least `need` bytes in `slot` (grown, never shrunk).
    fn staging<'a>(
        gpu: &GpuRelayout,
        slot: &'a mut Option<DeviceBuffer>,
        need: usize,
    ) -> Result<&'a DeviceBuffer> {
        if slot.as_ref().is_none_or(|b| b.len() < need) {
            if slot.is_some() {
                // work enqueued on this stream (a gather whose chunk was
                // refused) may still use the old buffer: wait before freeing
                gpu.record(false)?.wait()?;
            }
            *slot = None;
            *slot = Some(gpu.alloc(need.max(1))?);
        }
        Ok(slot.as_ref().expect("allocated above"))
    }

    fn peer_of(link: &DecodeLink) -> String {
        format!(
            "decode rank instance {} (dcp_rank {})",
            link.hello.instance_id, link.hello.topology.dcp_rank
        )
    }

    /// The decode's refusal or failure of a chunk as this side's error.
    fn refused(peer: &str, a: Answer) -> Error {
        Error::new(
            a.code.and_then(Status::from_code).unwrap_or(Status::Nccl),
            format!("{peer}: {}", a.reason.unwrap_or_default()),
        )
    }

    /// One pair's chunk with its sends posted ([`start_pair`]); finished
    /// by [`finish_all`], or aborted when dropped unfinished.
    pub(in crate::engine) struct NcclSend<'a> {
        inner: &'a Inner,
        slot: Arc<Mutex<Sender>>,
        link: Arc<DecodeLink>,
        peer: String,
        key: AnswerKey,
        deadline: Instant,
        /// KV bytes of the pair's chunk, and when it started (the link's counters).
        bytes: u64,
        started: Instant,
        done: bool,
    }

    /// The prefill end of `link`, made on first use; the ends of links that
    /// are gone are dropped (their communicators with them).
    fn sender_of(inner: &Inner, link: &DecodeLink, ordinal: u32) -> Result<Arc<Mutex<Sender>>> {
        let key: LinkKey = (link.hello.instance_id, link.hello.epoch);
        let live: Vec<LinkKey> = lock(&inner.decode_links)
            .iter()
            .map(|l| (l.hello.instance_id, l.hello.epoch))
            .collect();
        let mut m = lock(&inner.nccl.senders);
        m.retain(|k, _| *k == key || live.contains(k));
        if let Some(s) = m.get(&key) {
            return Ok(s.clone());
        }
        let s = Arc::new(Mutex::new(Sender {
            pair: None,
            generation: 0,
            staging: None,
            gpu: GpuRelayout::new(ordinal as usize)?,
        }));
        m.insert(key, s.clone());
        Ok(s)
    }

    /// The error of a pair, naming the room and the peer.
    fn pair_error(room: u64, peer: &str, e: Error) -> Error {
        Error::new(
            e.status(),
            format!("nccl room {room} to {peer}: {}", e.detail()),
        )
    }

    /// Prefill: starts one pair's tokens of a chunk to decode `link` over its
    /// communicator (made first when there is none): gathered, checked by the
    /// decode (digest) and posted. `None` for a pair without tokens. The
    /// pairs of a chunk are started one after another and then finished
    /// together, so they are on the wire at the same time.
    pub(in crate::engine) fn start_pair<'a>(
        inner: &'a Inner,
        job: &Job,
        req: &PairRequest<'_>,
        row_bytes: &[u64],
        link: &Arc<DecodeLink>,
    ) -> Result<Option<NcclSend<'a>>> {
        if req.token_count() == 0 {
            return Ok(None);
        }
        room_live(inner, job.room, job.attempt)?;
        let ordinal = inner
            .cfg
            .pool_device
            .ok_or_else(|| Error::new(Status::Unsupported, "transport nccl needs device pools"))?;
        let slot = sender_of(inner, link, ordinal)?;
        let peer = peer_of(link);
        let (room, attempt) = (job.room, job.attempt);
        let deadline = room_deadline(inner, room);
        lock(&inner.rooms).begin_write(room, attempt)?;
        let mut pending = NcclSend {
            inner,
            slot,
            link: link.clone(),
            peer,
            key: AnswerKey {
                link: (link.hello.instance_id, link.hello.epoch),
                room,
                attempt,
                generation: 0,
                start: req.start,
                landed: false,
            },
            deadline,
            bytes: req.token_count() * row_bytes.iter().sum::<u64>(),
            started: Instant::now(),
            done: false,
        };
        let r = {
            let mut s = lock(&pending.slot);
            let r = post_locked(
                inner,
                &mut s,
                job,
                req,
                row_bytes,
                link,
                &pending.peer,
                deadline,
                ordinal,
            );
            pending.key.generation = s.generation;
            if let Err(e) = &r {
                // a mismatch posted nothing on either side: the communicator
                // stays; any other failure drops (aborts) it
                if e.status() != Status::NcclPlanMismatch {
                    s.pair = None;
                }
            }
            r
        };
        match r {
            Ok(()) => Ok(Some(pending)),
            Err(e) => {
                pending.close();
                Err(pair_error(room, &pending.peer, e))
            }
        }
    }

    impl NcclSend<'_> {
        /// Ends the pair's room write and forgets its answers (once).
        fn close(&mut self) {
            if !self.done {
                self.done = true;
                lock(&self.inner.rooms).end_write(self.key.room, self.key.attempt);
                self.inner
                    .nccl
                    .forget(self.key.link, self.key.room, self.key.attempt);
            }
        }

        /// One look at the pair: `Ok(true)` once its sends completed and the
        /// decode answered `nccl_ready` ok; an error (the communicator
        /// aborted) when they failed, the decode refused, the peer is gone,
        /// the room ended, the engine closes or the deadline passed.
        fn step(&mut self) -> Result<bool> {
            let (inner, link) = (self.inner, self.link.clone());
            let (room, attempt) = (self.key.room, self.key.attempt);
            let mut s = lock(&self.slot);
            let r = (|| {
                let pair = s.pair.as_mut().ok_or_else(|| {
                    Error::new(Status::Nccl, "the communicator was dropped mid-chunk")
                })?;
                if pair.in_flight() && !pair.poll()? {
                    // the sends still run
                } else if let Some(a) = inner.nccl.take_answer(&AnswerKey {
                    landed: true,
                    ..self.key
                }) {
                    return if a.ok {
                        Ok(true)
                    } else {
                        Err(refused(&self.peer, a))
                    };
                }
                answer_live(inner, &link, room, attempt)?;
                if Instant::now() >= self.deadline {
                    return Err(Error::new(
                        Status::Timeout,
                        format!(
                            "the chunk at {} did not land by the room's deadline ({})",
                            self.key.start,
                            if pair.in_flight() {
                                "its sends did not complete"
                            } else {
                                "no nccl_ready from the decode"
                            }
                        ),
                    ));
                }
                Ok(false)
            })();
            if r.is_err() {
                // aborts a communicator with work in flight (its stream is
                // waited); the next chunk to this peer opens a new generation
                s.pair = None;
            }
            r
        }
    }

    /// Finishes the pairs of a chunk together: each is done once its sends'
    /// completion event ran and the decode answered `nccl_ready` (its recvs
    /// and scatter ran); a failing pair aborts its own communicator and the
    /// others go on. Returns the first failure, naming its peer.
    pub(in crate::engine) fn finish_all(mut pairs: Vec<NcclSend<'_>>) -> Result<()> {
        let mut failed = None;
        let mut nap = Duration::from_micros(20);
        while !pairs.is_empty() {
            let mut i = 0;
            while i < pairs.len() {
                match pairs[i].step() {
                    Ok(false) => i += 1,
                    Ok(true) => {
                        let mut p = pairs.swap_remove(i);
                        let c = &p.link.counters;
                        c.bytes.fetch_add(p.bytes, Ordering::Relaxed);
                        c.batches.fetch_add(1, Ordering::Relaxed);
                        c.add_wire(p.started);
                        p.close();
                    }
                    Err(e) => {
                        let mut p = pairs.swap_remove(i);
                        p.link
                            .counters
                            .failed_batches
                            .fetch_add(1, Ordering::Relaxed);
                        p.close();
                        failed.get_or_insert(pair_error(p.key.room, &p.peer, e));
                    }
                }
            }
            if !pairs.is_empty() {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(2));
            }
        }
        failed.map_or(Ok(()), Err)
    }

    impl Drop for NcclSend<'_> {
        fn drop(&mut self) {
            if !self.done {
                // an unfinished pair (another pair of the chunk failed): abort
                // its communicator, which waits for its stream
                lock(&self.slot).pair = None;
                self.close();
            }
        }
    }

    /// While the prefill waits for a decode's answer: the link and the room live.
    fn answer_live(inner: &Inner, link: &DecodeLink, room: u64, attempt: u64) -> Result<()> {
        if !link.alive.load(Ordering::Acquire) {
            return Err(Error::new(
                Status::PeerUnreachable,
                "the control connection closed; the peer is gone",
            ));
        }
        room_live(inner, room, attempt)
    }

    #[allow(clippy::too_many_arguments)]
    fn post_locked(
        inner: &Inner,
        s: &mut Sender,
        job: &Job,
        req: &PairRequest<'_>,
        row_bytes: &[u64],
        link: &Arc<DecodeLink>,
        peer: &str,
        deadline: Instant,
        ordinal: u32,
    ) -> Result<()> {
        let (room, attempt) = (job.room, job.attempt);
        let key: LinkKey = (link.hello.instance_id, link.hello.epoch);
        // the peer's liveness; a room or engine that ended asks for the abort
        let watch = |abort: &NcclAbort| {
            let abort = abort.clone();
            move || {
                if room_live(inner, room, attempt).is_err() {
                    abort.abort();
                }
                link.alive.load(Ordering::Acquire)
            }
        };
        if s.pair.is_none() {
            s.generation += 1;
            let id = NcclId::new()?;
            link.writer.send(&CtlMsg::NcclOpen {
                generation: s.generation,
                id: id.to_hex(),
            })?;
            let init_deadline = deadline.min(Instant::now() + inner.cfg.handshake_timeout);
            let abort = NcclAbort::new();
            let pair = NcclPair::connect(
                &id,
                NcclRole::Sender,
                ordinal as usize,
                s.gpu.stream_handle(),
                peer,
                init_deadline,
                &mut watch(&abort),
                abort.clone(),
            )?;
            log::info!(
                "engine: NCCL communicator {} with {peer} is up",
                s.generation
            );
            s.pair = Some(pair);
        }
        let plan = NcclPlan::build(req, row_bytes, NcclRole::Sender, &plan_options(&inner.cfg))?;
        let need = usize::try_from(plan.pack.total_bytes)
            .map_err(|_| Error::invalid("the pair's pack does not fit this machine"))?;
        let Sender {
            pair,
            generation,
            staging: slot,
            gpu,
        } = s;
        let buf = staging(gpu, slot, need)?;
        if let Some(ev) = job.ready.cuda_event {
            // SAFETY: the caller keeps the event alive until the room is
            // terminal (`SendOptions::cuda_event`), in the pools' context.
            unsafe { gpu.wait_raw_event(ev) }?;
        }
        let bases: Vec<u64> = inner.pool_regions.iter().map(|r| r.addr).collect();
        let ents = relayout::gather_entries(&bases, row_bytes, buf.ptr(), &plan.pack)?;
        let spans = relayout::gather_spans(req)?;
        // SAFETY: the pools are device memory of this device for the engine's
        // life (checked at creation) and the plan's rows lie inside them; the
        // staging buffer holds the whole pack. Not waited: the sends follow
        // the gather on the same stream.
        let _gathered = unsafe { gpu.gather(&ents, &spans) }?;
        let generation = *generation;
        link.writer.send(&CtlMsg::NcclChunk {
            room,
            attempt,
            generation,
            start: req.start,
            num_tokens: req.num_tokens,
            src_pages: req.src.pages.to_vec(),
            dst_pages: req.dst.pages.to_vec(),
            decode_prefix_len: req.dst.origin,
            digest: plan.digest,
        })?;
        let answer_key = AnswerKey {
            link: key,
            room,
            attempt,
            generation,
            start: req.start,
            landed: false,
        };
        let accepted = inner.nccl.wait_answer(answer_key, deadline, &mut || {
            answer_live(inner, link, room, attempt)
        })?;
        if !accepted.ok {
            return Err(refused(peer, accepted));
        }
        #[cfg(any(test, feature = "testing"))]
        if inner.cfg.testing.nccl_never_send_rooms.contains(&room) {
            log::warn!("engine: test knob: the sends of room {room} are never posted");
            return Ok(());
        }
        let pair = pair.as_mut().expect("connected above");
        let abort = pair.abort_handle();
        // SAFETY: the staging buffer holds the gathered pack until the pair's
        // work completed or was aborted (the pair drops before the buffer,
        // and the buffer is not regrown while the pair is in flight: the next
        // chunk of this link starts after this one finished); the decode
        // posts the mirrored plan (digest checked: accepted).
        unsafe { pair.post(&plan, buf.ptr(), &[], deadline, &mut watch(&abort)) }?;
        Ok(())
    }

    /// Decode: the NCCL thread of one prefill link.
    pub(in crate::engine) struct ReceiverThread {
        tx: mpsc::Sender<CtlMsg>,
        /// The newest generation the prefill opened (ahead of the thread
        /// while an `nccl_open` waits in the queue).
        opened: Arc<AtomicU64>,
        handle: std::thread::JoinHandle<()>,
    }

    impl ReceiverThread {
        /// Stops taking messages and waits for the thread (skipped when it
        /// is the caller: an engine dropped from its own NCCL thread).
        pub(super) fn join(self) {
            drop(self.tx);
            if self.handle.thread().id() != std::thread::current().id() {
                let _ = self.handle.join();
            }
        }
    }

    /// Decode: hands an `nccl_open` or `nccl_chunk` from prefill `link` to
    /// that link's NCCL thread (started on the first one).
    pub(in crate::engine) fn on_prefill_message(
        inner: &Arc<Inner>,
        link: &Arc<PrefillLink>,
        m: CtlMsg,
    ) {
        if inner.nccl.is_closing() {
            return;
        }
        let key: LinkKey = (link.registration.instance_id, link.registration.epoch);
        let newer = match &m {
            CtlMsg::NcclOpen { generation, .. } => *generation,
            _ => 0,
        };
        let mut r = lock(&inner.nccl.receivers);
        r.retain(|_, t| !t.handle.is_finished());
        let m = match r.get(&key) {
            Some(t) => {
                // a recv of an older communicator still waiting is aborted:
                // the prefill gave up on it
                t.opened.fetch_max(newer, Ordering::AcqRel);
                match t.tx.send(m) {
                    Ok(()) => return,
                    Err(mpsc::SendError(m)) => m,
                }
            }
            None => m,
        };
        let (tx, rx) = mpsc::channel();
        let _ = tx.send(m);
        let opened = Arc::new(AtomicU64::new(newer));
        let (w, l, o) = (Arc::downgrade(inner), link.clone(), opened.clone());
        match std::thread::Builder::new()
            .name("pdxfer-nccl-d".into())
            .spawn(move || receiver_loop(w, l, rx, o))
        {
            Ok(handle) => {
                r.insert(key, ReceiverThread { tx, opened, handle });
            }
            Err(e) => log::warn!(
                "engine: cannot start the NCCL thread for prefill {}: {e}",
                link.registration.describe()
            ),
        }
    }

    /// The decode end of one prefill link (drop order: the pair first).
    struct Receiver {
        pair: Option<NcclPair>,
        generation: u64,
        /// Why the last `nccl_open` failed (named in the chunks' refusals).
        open_error: Option<Error>,
        staging: Option<DeviceBuffer>,
        gpu: Result<GpuRelayout>,
        /// See [`ReceiverThread::opened`].
        opened: Arc<AtomicU64>,
    }

    fn receiver_loop(
        w: Weak<Inner>,
        link: Arc<PrefillLink>,
        rx: mpsc::Receiver<CtlMsg>,
        opened: Arc<AtomicU64>,
    ) {
        let ordinal = w.upgrade().and_then(|i| i.cfg.pool_device).unwrap_or(0);
        let mut st = Receiver {
            pair: None,
            generation: 0,
            open_error: None,
            staging: None,
            gpu: GpuRelayout::new(ordinal as usize),
            opened,
        };
        let peer = format!("prefill {}", link.registration.describe());
        loop {
            let m = match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(m) => m,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let gone = w
                        .upgrade()
                        .is_none_or(|i| i.nccl.is_closing() || i.closed.load(Ordering::Acquire));
                    if gone || !link.alive.load(Ordering::Acquire) {
                        return;
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            };
            let Some(inner) = w.upgrade() else { return };
            match m {
                CtlMsg::NcclOpen { generation, id } => {
                    open(&inner, &link, &mut st, &peer, generation, &id, ordinal)
                }
                CtlMsg::NcclChunk {
                    room,
                    attempt,
                    generation,
                    start,
                    num_tokens,
                    src_pages,
                    dst_pages,
                    decode_prefix_len,
                    digest,
                } => {
                    let c = Chunk {
                        room,
                        attempt,
                        generation,
                        start,
                        num_tokens,
                        src_pages: &src_pages,
                        dst_pages: &dst_pages,
                        prefix: decode_prefix_len,
                        digest,
                    };
                    receive(&inner, &link, &mut st, &peer, &c);
                }
                _ => {}
            }
        }
    }

    /// Joins communicator `generation` (the previous one is dropped first).
    fn open(
        inner: &Inner,
        link: &PrefillLink,
        st: &mut Receiver,
        peer: &str,
        generation: u64,
        id: &str,
        ordinal: u32,
    ) {
        st.pair = None;
        st.generation = generation;
        st.open_error = None;
        let r = (|| {
            let id = NcclId::from_hex(id)?;
            let gpu = st.gpu.as_ref().map_err(Clone::clone)?;
            let abort = NcclAbort::new();
            let a2 = abort.clone();
            let mut alive = || {
                if inner.nccl.is_closing() || inner.closed.load(Ordering::Acquire) {
                    a2.abort();
                }
                link.alive.load(Ordering::Acquire)
            };
            NcclPair::connect(
                &id,
                NcclRole::Receiver,
                ordinal as usize,
                gpu.stream_handle(),
                peer,
                Instant::now() + inner.cfg.handshake_timeout,
                &mut alive,
                abort,
            )
        })();
        match r {
            Ok(p) => st.pair = Some(p),
            Err(e) => {
                log::warn!("engine: NCCL communicator {generation} with {peer} failed: {e}");
                st.open_error = Some(e);
            }
        }
    }

    /// One `nccl_chunk` as the decode read it.
    struct Chunk<'a> {
        room: u64,
        attempt: u64,
        generation: u64,
        start: u64,
        num_tokens: u64,
        src_pages: &'a [u64],
        dst_pages: &'a [u64],
        prefix: u64,
        digest: u64,
    }

    /// Checks, posts and completes one chunk's recvs, answering the prefill
    /// at each step; a failure also fails the local room, naming the prefill.
    fn receive(inner: &Inner, link: &PrefillLink, st: &mut Receiver, peer: &str, c: &Chunk<'_>) {
        let send = |landed: bool, r: &Result<()>| {
            let (ok, reason, code) = match r {
                Ok(()) => (true, None, None),
                Err(e) => (false, Some(e.detail().to_string()), Some(e.status() as i32)),
            };
            let (room, attempt, generation, start) = (c.room, c.attempt, c.generation, c.start);
            let m = if landed {
                CtlMsg::NcclReady {
                    room,
                    attempt,
                    generation,
                    start,
                    ok,
                    reason,
                    code,
                }
            } else {
                CtlMsg::NcclAccepted {
                    room,
                    attempt,
                    generation,
                    start,
                    ok,
                    reason,
                    code,
                }
            };
            let _ = link.writer.send(&m);
        };
        let fail = |e: &Error, st: &mut Receiver, posted: bool| {
            if posted {
                st.pair = None; // aborts a communicator with work in flight
            }
            let local = Error::new(
                e.status(),
                format!("nccl chunk at {} from {peer}: {}", c.start, e.detail()),
            );
            let attempt = lock(&inner.decode_rooms)
                .get(&c.room)
                .map(|r| r.attempt)
                .filter(|&a| a == c.attempt);
            if let Some(a) = attempt {
                inner.fail_room(c.room, a, local);
            }
        };
        inner.nccl.enter(c.room);
        let r = accept(inner, link, st, peer, c);
        let (plan, req_parts) = match r {
            Ok(v) => v,
            Err(e) => {
                send(false, &Err(e.clone()));
                fail(&e, st, false);
                inner.nccl.leave(c.room);
                inner.cv.notify_all();
                return;
            }
        };
        send(false, &Ok(()));
        #[cfg(any(test, feature = "testing"))]
        if inner.cfg.testing.nccl_never_post_rooms.contains(&c.room) {
            log::warn!("engine: test knob: room {} is never posted", c.room);
            inner.nccl.leave(c.room);
            return;
        }
        let r = post_and_wait(inner, link, st, c, &plan, &req_parts);
        send(true, &r);
        if let Err(e) = &r {
            fail(e, st, true);
        }
        inner.nccl.leave(c.room);
        inner.cv.notify_all();
    }

    /// The decode side's pair request of a chunk (owned page lists).
    struct ReqParts {
        src_layout: crate::layout::DcpLayout,
        src_rank: u64,
        dst_layout: crate::layout::DcpLayout,
        dst_rank: u64,
    }

    impl ReqParts {
        fn request<'a>(&self, c: &'a Chunk<'a>) -> PairRequest<'a> {
            PairRequest {
                src: Side {
                    layout: self.src_layout,
                    rank: self.src_rank,
                    pages: c.src_pages,
                    origin: c.start,
                },
                dst: Side {
                    layout: self.dst_layout,
                    rank: self.dst_rank,
                    pages: c.dst_pages,
                    origin: c.prefix,
                },
                start: c.start,
                num_tokens: c.num_tokens,
            }
        }
    }

    /// Everything checked before anything is posted: the room, the
    /// communicator, the pages (inside this engine's pools), the plan and
    /// its digest, and every op's range.
    fn accept(
        inner: &Inner,
        link: &PrefillLink,
        st: &mut Receiver,
        peer: &str,
        c: &Chunk<'_>,
    ) -> Result<(NcclPlan, ReqParts)> {
        room_live(inner, c.room, c.attempt)?;
        let known = lock(&inner.decode_rooms)
            .get(&c.room)
            .is_some_and(|r| r.attempt == c.attempt);
        if !known {
            return Err(Error::new(
                Status::UnknownRoom,
                format!("room {} attempt {} is not open here", c.room, c.attempt),
            ));
        }
        if st.generation != c.generation || st.pair.is_none() {
            let why = st.open_error.as_ref().map_or_else(
                || "it was dropped after a failure".to_string(),
                |e| e.to_string(),
            );
            return Err(Error::new(
                Status::Nccl,
                format!(
                    "no NCCL communicator of generation {} with {peer} (this side has generation {}: {why})",
                    c.generation, st.generation
                ),
            ));
        }
        inner.cfg.check_pages(c.dst_pages, "dst_pages", "decode")?;
        let topo = &inner.cfg.topology;
        let src = &link.registration.topology;
        let parts = ReqParts {
            src_layout: src.dcp_layout()?,
            src_rank: u64::from(src.dcp_rank),
            dst_layout: topo.dcp_layout()?,
            dst_rank: u64::from(topo.dcp_rank),
        };
        let req = parts.request(c);
        req.validate()?;
        let rows: Vec<u64> = topo.entries.iter().map(|e| e.row_bytes).collect();
        let plan = NcclPlan::build(&req, &rows, NcclRole::Receiver, &plan_options(&inner.cfg))?;
        check_mirror(&plan, c.digest)?;
        for op in &plan.ops {
            let end = op.offset.checked_add(op.len);
            let cap = match op.buffer {
                NcclBuffer::Staging => Some(plan.pack.total_bytes),
                NcclBuffer::Entry(e) => inner.pool_regions.get(e as usize).map(|r| r.len),
            };
            if end.is_none() || cap.is_none() || end > cap {
                return Err(Error::new(
                    Status::OutOfBounds,
                    format!(
                        "NCCL recv of {} B at {} into {:?} lies outside this engine's memory",
                        op.len, op.offset, op.buffer
                    ),
                ));
            }
        }
        Ok((plan, parts))
    }

    fn post_and_wait(
        inner: &Inner,
        link: &PrefillLink,
        st: &mut Receiver,
        c: &Chunk<'_>,
        plan: &NcclPlan,
        parts: &ReqParts,
    ) -> Result<()> {
        let deadline = room_deadline(inner, c.room);
        let Receiver {
            pair,
            staging: slot,
            gpu,
            opened,
            ..
        } = st;
        let gpu = gpu.as_mut().map_err(|e| e.clone())?;
        let pair = pair.as_mut().expect("checked by accept");
        let need = if plan.needs_scatter() {
            usize::try_from(plan.pack.total_bytes)
                .map_err(|_| Error::invalid("the pair's pack does not fit this machine"))?
        } else {
            1
        };
        let buf = staging(gpu, slot, need)?;
        let bases: Vec<u64> = inner.pool_regions.iter().map(|r| r.addr).collect();
        let abort = pair.abort_handle();
        let mut watch = || {
            if room_live(inner, c.room, c.attempt).is_err()
                || opened.load(Ordering::Acquire) > c.generation
            {
                abort.abort();
            }
            link.alive.load(Ordering::Acquire)
        };
        // SAFETY: every op was checked to lie inside a pool (device memory of
        // this device for the engine's life) or the staging buffer, which
        // outlives the pair's work (waited here; close joins this thread).
        unsafe { pair.post(plan, buf.ptr(), &bases, deadline, &mut watch) }?;
        pair.wait(deadline, &mut watch)?;
        if plan.needs_scatter() {
            let req = parts.request(c);
            let rows: Vec<u64> = inner
                .cfg
                .topology
                .entries
                .iter()
                .map(|e| e.row_bytes)
                .collect();
            let ents = relayout::scatter_entries(&bases, &rows, buf.ptr(), &plan.pack)?;
            let spans = relayout::scatter_spans(&req)?;
            // SAFETY: as above; the scatter reads the staging buffer the recvs
            // filled (complete: their event was waited) into the pools.
            unsafe { gpu.scatter(&ents, &spans) }?.wait()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::schema::Role;
    use crate::engine::synthetic::SyntheticPools;

    /// Transport nccl moves device pools only: host pools are refused
    /// before anything opens, saying what to use instead; other transports
    /// pass this check untouched.
    #[test]
    fn nccl_engines_need_device_pools() {
        let pools = SyntheticPools::new(2, 64, 16, 4, 1, 8).unwrap();
        let mut cfg = EngineConfig::new(
            Role::Decode,
            "c",
            "http://127.0.0.1:1",
            pools.topology(1, 0),
            pools.kv_pools(),
        );
        cfg.transport = TransportKind::Nccl;
        let e = preflight(&cfg).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported, "{e}");
        assert!(e.detail().contains("pool_device"), "{e}");
        cfg.transport = TransportKind::Tcp;
        preflight(&cfg).unwrap();
        assert_eq!(cfg.data_transport(), TransportKind::Tcp);
        cfg.transport = TransportKind::Nccl;
        assert_eq!(cfg.data_transport(), TransportKind::Auto);
    }
}
