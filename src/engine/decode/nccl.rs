//! The decode side of transport nccl: one NCCL thread per prefill link that
//! joins the link's communicators and checks, posts and completes each
//! chunk's recvs.

use crate::engine::control::CtlMsg;
use crate::engine::decode::{Decode, DecodeRoom};
use crate::engine::link::PrefillLink;
use crate::engine::nccl_link::{
    plan_options, room_deadline, room_live, LinkKey, ReceiverThread, Staging,
};
use crate::engine::state::lock;
use crate::error::{Error, Result, Status};
use crate::layout::{PairRequest, PoolGeometry, Side};
use crate::relayout::{self, gpu::GpuRelayout};
use crate::transport::nccl::{
    check_mirror, NcclAbort, NcclBuffer, NcclId, NcclPair, NcclPlan, NcclRole,
};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Decode: hands an `nccl_open` or `nccl_chunk` from prefill `link` to
/// that link's NCCL thread (started on the first one).
pub(in crate::engine) fn on_prefill_message(
    inner: &Arc<Decode>,
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
    match crate::threads::spawn("pdxfer-nccl-d".into(), move || receiver_loop(w, l, rx, o)) {
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
    staging: Staging,
    gpu: Result<GpuRelayout>,
    /// See [`ReceiverThread::opened`].
    opened: Arc<AtomicU64>,
}

fn receiver_loop(
    w: Weak<Decode>,
    link: Arc<PrefillLink>,
    rx: mpsc::Receiver<CtlMsg>,
    opened: Arc<AtomicU64>,
) {
    let ordinal = w.upgrade().and_then(|i| i.cfg.pool_device).unwrap_or(0);
    let mut st = Receiver {
        pair: None,
        generation: 0,
        open_error: None,
        staging: Staging::default(),
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
                    claimed_dst_pages: &dst_pages,
                    claimed_prefix: decode_prefix_len,
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
    inner: &Decode,
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
    let t0 = Instant::now();
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
            gpu.stream().raw(),
            peer,
            Instant::now() + inner.cfg.handshake_timeout,
            &mut alive,
            abort,
        )
    })();
    inner.metrics.nccl_init(t0.elapsed(), r.is_ok());
    match r {
        Ok(p) => {
            log::info!(
                "engine: NCCL communicator {generation} with {peer} is up ({} ms init)",
                t0.elapsed().as_millis()
            );
            st.pair = Some(p);
            // the link's staging, once, before any of its chunks
            if let Ok(gpu) = &st.gpu {
                if let Err(e) = st.staging.preallocate(gpu, inner.cfg.staging_bytes) {
                    log::warn!("engine: nccl staging for {peer} not allocated at set-up: {e}");
                }
            }
        }
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
    /// The prefill's own pages: they shape the plan's runs, never where a
    /// recv lands.
    src_pages: &'a [u64],
    /// The decode pages and prefix the prefill says the room has: only
    /// compared with what this decode named ([`named_pages`]); the plan
    /// is built from the decode's own.
    claimed_dst_pages: &'a [u64],
    claimed_prefix: u64,
    digest: u64,
}

/// Checks, posts and completes one chunk's recvs, answering the prefill
/// at each step; a failure also fails the local room, naming the prefill.
fn receive(inner: &Decode, link: &PrefillLink, st: &mut Receiver, peer: &str, c: &Chunk<'_>) {
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
        // only a room this prefill serves: a chunk naming another's
        // room is refused without touching it
        let attempt = lock(&inner.decode_rooms)
            .get(&c.room)
            .filter(|r| r.attempt == c.attempt && targets(r, link))
            .map(|r| r.attempt);
        if let Some(a) = attempt {
            inner.fail_room(c.room, a, local);
        }
    };
    inner.nccl.enter(c.room);
    let r = accept(inner, link, st, peer, c);
    let (plan, req_parts) = match r {
        Ok(v) => v,
        Err(e) => {
            // the room fails here first, with this decode's reason, before
            // the prefill hears of it (and could report its own failure back)
            fail(&e, st, false);
            send(false, &Err(e.clone()));
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

/// The decode side's pair request of a chunk: the decode's own pages and
/// prefix for the room, the prefill's pages from the message.
struct ReqParts {
    src_layout: crate::layout::DcpLayout,
    src_rank: u64,
    dst_layout: crate::layout::DcpLayout,
    dst_rank: u64,
    dst_pages: Vec<u64>,
    dst_origin: u64,
}

impl ReqParts {
    fn request<'a>(&'a self, c: &'a Chunk<'a>) -> PairRequest<'a> {
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
                pages: &self.dst_pages,
                origin: self.dst_origin,
            },
            start: c.start,
            num_tokens: c.num_tokens,
        }
    }
}

/// Whether decode room `r` targets prefill `link`.
fn targets(r: &DecodeRoom, link: &PrefillLink) -> bool {
    r.targets.iter().any(|t| std::ptr::eq(&**t, link))
}

/// The decode pages and prefix this decode named for the chunk's room in
/// its metadata: the room's attempt must be open here against this
/// prefill link, and the pages the chunk names must be exactly those
/// (else `out_of_bounds`, naming the prefill and the room). The plan is
/// built from what is returned, never from the message.
fn named_pages(
    inner: &Decode,
    link: &PrefillLink,
    peer: &str,
    c: &Chunk<'_>,
) -> Result<(Vec<u64>, u64)> {
    let d = lock(&inner.decode_rooms);
    let r = d
        .get(&c.room)
        .filter(|r| r.attempt == c.attempt && targets(r, link))
        .ok_or_else(|| {
            Error::new(
                Status::UnknownRoom,
                format!(
                    "room {} attempt {} is not open here against {peer}",
                    c.room, c.attempt
                ),
            )
        })?;
    let named = r.named.as_ref().ok_or_else(|| {
        Error::new(
            Status::OutOfBounds,
            format!(
                "{peer} sent a chunk of room {} before this decode named its pages; nothing was posted",
                c.room
            ),
        )
    })?;
    if c.claimed_prefix != named.decode_prefix_len {
        return Err(Error::new(
            Status::OutOfBounds,
            format!(
                "{peer} named decode prefix {} for room {}, this decode named {}; nothing was posted",
                c.claimed_prefix, c.room, named.decode_prefix_len
            ),
        ));
    }
    // the prefill plans strided pools' pages as pitch pages (PoolGeometry)
    let pitched = PoolGeometry::pitch_pages(inner.cfg.page_step(), &named.dst_pages);
    if c.claimed_dst_pages != &*pitched {
        let at = c
            .claimed_dst_pages
            .iter()
            .zip(pitched.iter())
            .position(|(a, b)| a != b);
        let why = match at {
            Some(i) => format!(
                "page {} at index {i} where this decode named page {}",
                c.claimed_dst_pages[i], pitched[i]
            ),
            None => format!(
                "{} pages where this decode named {}",
                c.claimed_dst_pages.len(),
                pitched.len()
            ),
        };
        return Err(Error::new(
            Status::OutOfBounds,
            format!(
                "{peer} named decode pages for room {} that this decode did not name for it ({why}); nothing was posted",
                c.room
            ),
        ));
    }
    Ok((named.dst_pages.clone(), named.decode_prefix_len))
}

/// Everything checked before anything is posted: the room (open here
/// against this prefill), the pages (exactly those this decode named for
/// the room, inside its pools), the communicator, the plan (built from
/// the decode's own pages) and its digest, and every op's range.
fn accept(
    inner: &Decode,
    link: &PrefillLink,
    st: &mut Receiver,
    peer: &str,
    c: &Chunk<'_>,
) -> Result<(NcclPlan, ReqParts)> {
    room_live(inner, &inner.nccl, c.room, c.attempt)?;
    let (dst_pages, dst_origin) = named_pages(inner, link, peer, c)?;
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
    inner.cfg.check_pages(&dst_pages, "dst_pages", "decode")?;
    // strided pools: the page ids the plan addresses, as the prefill's
    let dst_pages = PoolGeometry::pitch_pages(inner.cfg.page_step(), &dst_pages).into_owned();
    let topo = &inner.cfg.topology;
    let src = &link.registration.topology;
    let parts = ReqParts {
        src_layout: src.dcp_layout()?,
        src_rank: u64::from(src.dcp_rank),
        dst_layout: topo.dcp_layout()?,
        dst_rank: u64::from(topo.dcp_rank),
        dst_pages,
        dst_origin,
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
    inner: &Decode,
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
    let buf = slot.reserve(gpu, need)?;
    let bases: Vec<u64> = inner.pool_regions.iter().map(|r| r.addr).collect();
    let abort = pair.abort_handle();
    let mut watch = || {
        if room_live(inner, &inner.nccl, c.room, c.attempt).is_err()
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
