//! The prefill side of transport nccl: each decode link's sending end (its
//! communicator, stream and staging), kept open from the link's hello on
//! by a thread of its own ([`keep_open`]: opened at once, rebuilt after a
//! failure, off the data path), a chunk's pairs started one after another
//! and finished together.

use crate::engine::control::CtlMsg;
use crate::engine::link::DecodeLink;
use crate::engine::nccl_link::{
    plan_options, room_deadline, room_live, Answer, AnswerKey, LinkKey, Sender, Staging,
};
use crate::engine::prefill::jobs::Job;
use crate::engine::prefill::Prefill;
use crate::engine::state::lock;
use crate::error::{Error, Result, Status};
use crate::layout::PairRequest;
use crate::relayout::{self, gpu::GpuRelayout};
use crate::transport::nccl::{NcclAbort, NcclId, NcclPair, NcclPlan, NcclRole};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
    inner: &'a Prefill,
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
fn sender_of(inner: &Prefill, link: &DecodeLink, ordinal: u32) -> Result<Arc<Mutex<Sender>>> {
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
        staging: Staging::default(),
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
    inner: &'a Prefill,
    job: &Job,
    req: &PairRequest<'_>,
    row_bytes: &[u64],
    link: &Arc<DecodeLink>,
) -> Result<Option<NcclSend<'a>>> {
    if req.token_count() == 0 {
        return Ok(None);
    }
    room_live(inner, &inner.nccl, job.room, job.attempt)?;
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
fn answer_live(inner: &Prefill, link: &DecodeLink, room: u64, attempt: u64) -> Result<()> {
    if !link.alive.load(Ordering::Acquire) {
        return Err(Error::new(
            Status::PeerUnreachable,
            "the control connection closed; the peer is gone",
        ));
    }
    room_live(inner, &inner.nccl, room, attempt)
}

/// Opens the link's next communicator generation (the decode joins on
/// `nccl_open`); its init time is logged and counted in the metrics.
#[allow(clippy::too_many_arguments)]
fn open_locked(
    inner: &Prefill,
    s: &mut Sender,
    link: &DecodeLink,
    peer: &str,
    deadline: Instant,
    ordinal: u32,
    alive: &mut dyn FnMut() -> bool,
    abort: NcclAbort,
) -> Result<()> {
    s.generation += 1;
    let id = NcclId::new()?;
    link.writer.send(&CtlMsg::NcclOpen {
        generation: s.generation,
        id: id.to_hex(),
    })?;
    let t0 = Instant::now();
    let pair = NcclPair::connect(
        &id,
        NcclRole::Sender,
        ordinal as usize,
        s.gpu.stream().raw(),
        peer,
        deadline,
        alive,
        abort,
    );
    inner.metrics.nccl_init(t0.elapsed(), pair.is_ok());
    let pair = pair?;
    log::info!(
        "engine: NCCL communicator {} with {peer} is up ({} ms init)",
        s.generation,
        t0.elapsed().as_millis()
    );
    s.pair = Some(pair);
    // the link's staging, once, before any of its transfers
    if let Err(e) = s.staging.preallocate(&s.gpu, inner.cfg.staging_bytes) {
        log::warn!("engine: nccl staging for {peer} not allocated at set-up: {e}");
    }
    Ok(())
}

/// How often a link's keeper looks at its communicator.
const KEEP_OPEN_PERIOD: Duration = Duration::from_millis(50);

/// Prefill: keeps the communicator of decode `link` open from its hello on,
/// on a thread of its own: opened at once, and opened again (a new
/// generation) whenever a failure dropped it and no worker holds the link,
/// so rooms do not pay NCCL's init and first connect. A chunk that finds no
/// communicator still opens one itself. The thread ends with the link (its
/// control connection closed or replaced) or the engine.
pub(in crate::engine) fn keep_open(inner: &Arc<Prefill>, link: &Arc<DecodeLink>) {
    let Some(ordinal) = inner.cfg.pool_device else {
        return;
    };
    let (w, link) = (Arc::downgrade(inner), link.clone());
    let spawned = crate::threads::spawn("pdxfer-nccl-open".into(), move || {
        let peer = peer_of(&link);
        let mut backoff = KEEP_OPEN_PERIOD;
        loop {
            {
                let Some(inner) = w.upgrade() else { return };
                let gone = inner.nccl.is_closing()
                    || inner.closed.load(Ordering::Acquire)
                    || !link.alive.load(Ordering::Acquire)
                    || !lock(&inner.decode_links)
                        .iter()
                        .any(|l| Arc::ptr_eq(l, &link));
                if gone {
                    return;
                }
                let slot = match sender_of(&inner, &link, ordinal) {
                    Ok(s) => s,
                    Err(e) => {
                        log::warn!("engine: no NCCL sending end for {peer}: {e}");
                        return;
                    }
                };
                // a worker moving a chunk holds the slot: look again later
                if let Ok(mut s) = slot.try_lock() {
                    if s.pair.is_none() {
                        let abort = NcclAbort::new();
                        let a2 = abort.clone();
                        let mut alive = || {
                            if inner.nccl.is_closing() || inner.closed.load(Ordering::Acquire) {
                                a2.abort();
                            }
                            link.alive.load(Ordering::Acquire)
                        };
                        let deadline = Instant::now() + inner.cfg.handshake_timeout;
                        match open_locked(
                            &inner, &mut s, &link, &peer, deadline, ordinal, &mut alive, abort,
                        ) {
                            Ok(()) => backoff = KEEP_OPEN_PERIOD,
                            Err(e) => {
                                log::warn!(
                                    "engine: NCCL communicator {} with {peer} failed: {e}",
                                    s.generation
                                );
                                backoff = (backoff * 2).min(Duration::from_secs(2));
                            }
                        }
                    }
                };
            }
            std::thread::sleep(backoff);
        }
    });
    if let Err(e) = spawned {
        log::warn!("engine: cannot start the NCCL keeper thread: {e}");
    }
}

#[allow(clippy::too_many_arguments)]
fn post_locked(
    inner: &Prefill,
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
    #[cfg(any(test, feature = "testing"))]
    let forged;
    #[cfg(any(test, feature = "testing"))]
    let req = match inner
        .cfg
        .testing
        .nccl_forge_dst_pages
        .iter()
        .find(|(r, _)| *r == room)
    {
        Some((_, pages)) => {
            log::warn!("engine: test knob: the chunks of room {room} name forged decode pages");
            forged = PairRequest {
                dst: crate::layout::Side { pages, ..req.dst },
                ..*req
            };
            &forged
        }
        None => req,
    };
    // the peer's liveness; a room or engine that ended asks for the abort
    let watch = |abort: &NcclAbort| {
        let abort = abort.clone();
        move || {
            if room_live(inner, &inner.nccl, room, attempt).is_err() {
                abort.abort();
            }
            link.alive.load(Ordering::Acquire)
        }
    };
    if s.pair.is_none() {
        // the link's keeper had not (re)opened it yet: this chunk does
        let init_deadline = deadline.min(Instant::now() + inner.cfg.handshake_timeout);
        let abort = NcclAbort::new();
        open_locked(
            inner,
            s,
            link,
            peer,
            init_deadline,
            ordinal,
            &mut watch(&abort),
            abort.clone(),
        )?;
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
    let buf = slot.reserve(gpu, need)?;
    if let Some(ev) = job.ready.cuda_event {
        // SAFETY: the caller keeps the event alive until the room is
        // terminal (`SendOptions::cuda_event`), in the pools' context.
        unsafe { gpu.stream().wait_raw_event(ev) }?;
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
