//! The prefill's transfer workers: each moves its rooms' chunks in order to
//! every decode rank of the room (aux and state rows after the last chunk),
//! and reports the room's outcome. A chunk's pair is planned and written
//! through its link's write path (`conn.path.write`), then completed with
//! the chunk's flight.

use crate::engine::control::CtlMsg;
use crate::engine::device::DeviceStage;
use crate::engine::flight::Flight;
use crate::engine::layers::{wait_ready, LayerPlan};
use crate::engine::path::chunk::{Chunk, Pair};
use crate::engine::path::PairPlan;
use crate::engine::prefill::jobs::{Job, JobQueue};
use crate::engine::prefill::Prefill;
use crate::engine::prefill::{notify_decode, MetaInfo};
use crate::engine::room::KvPoll;
use crate::engine::room::RoomTimes;
use crate::engine::state::{catch, lock};
use crate::error::{Error, Result, Status};
use crate::layout::{DcpLayout, PairRequest, PoolGeometry, Side};
use crate::transport::{BatchOptions, TransportKind, WriteOp};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

pub(in crate::engine) fn worker_loop(
    w: std::sync::Weak<Prefill>,
    jobs: Arc<JobQueue>,
    idx: usize,
    mut stage: Option<DeviceStage>,
) {
    let mut swept = Instant::now();
    loop {
        // waits without holding the engine, so dropping it is not delayed
        let job = jobs.take(Duration::from_millis(200));
        let Some(inner) = w.upgrade() else { return };
        if job.is_none() || swept.elapsed() >= Duration::from_millis(200) {
            release_ended(&inner, &jobs);
            swept = Instant::now();
        }
        let Some(job) = job else { continue };
        let (room, attempt) = (job.room, job.attempt);
        let r = catch("transfer worker", || {
            run_job(&inner, idx, &job, stage.as_mut())
        });
        // the room's last chunk ran (this job's, or a layer group after it)
        let last = matches!(r, Ok(true));
        let r = r.map(|_| ());
        // the last chunk closes the room's grants: every decode rank's room
        // end is sent here, at once; the answers are awaited on a thread of
        // its own, so a decode slow to answer holds no worker
        let mut ended = None;
        if last && r.is_ok() && jobs.start_close() {
            let ends = Arc::new(std::sync::Mutex::new(Some(end_grants(
                &inner, room, attempt,
            ))));
            let (p, q, e) = (inner.clone(), jobs.clone(), ends.clone());
            let spawned = crate::threads::spawn("pdxfer-close".into(), move || {
                let ends = lock(&e).take().unwrap_or_default();
                let r = await_grants(&p, room, attempt, ends);
                conclude(&p, room, attempt, last, r);
                q.end_close();
                p.cv.notify_all();
            });
            if spawned.is_ok() {
                inner.jobs.done(&job);
                inner.cv.notify_all();
                continue;
            }
            jobs.end_close();
            // the thread did not start: the ends sent are awaited here
            ended = lock(&ends).take();
        }
        let r = r.and_then(|()| match (last, ended) {
            (true, Some(ends)) => await_grants(&inner, room, attempt, ends),
            (true, None) => close_grants(&inner, room, attempt),
            (false, _) => Ok(()),
        });
        conclude(&inner, room, attempt, last, r);
        inner.jobs.done(&job);
        inner.cv.notify_all();
    }
}

/// Releases the queued jobs waiting for a ready flag whose room ended (it
/// failed, was aborted or is gone) or whose engine closed, so a worker takes
/// them and fails them at once.
fn release_ended(inner: &Prefill, jobs: &JobQueue) {
    let waiting = jobs.waiting();
    if waiting.is_empty() {
        return;
    }
    let closed = inner.closed.load(Ordering::Acquire);
    let ended: Vec<(u64, u64)> = {
        let rooms = lock(&inner.rooms);
        waiting
            .into_iter()
            .filter(|&(room, attempt)| {
                closed
                    || !rooms.get(room).is_ok_and(|r| {
                        r.attempt == attempt && r.poll != KvPoll::Failed && !r.aborted
                    })
            })
            .collect()
    };
    jobs.release(&ended);
}

/// A job's outcome on its room: the room succeeds after its last chunk (and
/// the close of its grants), fails on an error; aborts that waited for the
/// in-flight writes are answered.
fn conclude(inner: &Prefill, room: u64, attempt: u64, last: bool, r: Result<()>) {
    if last || r.is_err() {
        // the room's writes are kept for a resume until it ends
        if let Some(p) = lock(&inner.prefill_rooms).get_mut(&room) {
            p.tcp_sent = Default::default();
        }
    }
    match r {
        Ok(()) if last => {
            if lock(&inner.rooms)
                .get(room)
                .is_ok_and(|r| r.attempt == attempt && r.poll != KvPoll::Failed)
            {
                notify_decode(inner, room, true, None);
                lock(&inner.rooms).update(room, attempt, KvPoll::Success);
            }
        }
        Ok(()) => {}
        Err(e) => {
            forget_grants(inner, room, attempt);
            inner.fail_room(room, attempt, e.clone());
            notify_decode(inner, room, false, Some(e));
        }
    }
    // answer aborts that waited for in-flight writes
    if lock(&inner.rooms).is_fenced(room) {
        let pending = lock(&inner.prefill_rooms)
            .get_mut(&room)
            .map(|r| std::mem::take(&mut r.abort_pending))
            .unwrap_or_default();
        for (l, a) in pending {
            let _ = l.writer.send(&CtlMsg::AbortAck { room, attempt: a });
        }
    }
}

/// Moves one chunk to every decode rank of the room (and aux and state on
/// the last chunk): the batches of all decode ranks are in flight together
/// (a [`Flight`]), and the chunk is done once every one of them completed.
/// A layer group's send is followed by the room's next ones already ready
/// ([`JobQueue::take_follow`]): each is planned and posted while the
/// batches before it move, into the same flight. Returns whether the
/// room's last chunk was among them.
fn run_job(
    inner: &Prefill,
    idx: usize,
    job: &Job,
    mut stage: Option<&mut DeviceStage>,
) -> Result<bool> {
    wait_ready(
        inner,
        job.room,
        job.attempt,
        &job.ready,
        stage.as_deref_mut(),
    )?;
    let opts = BatchOptions {
        timeout: inner.cfg.batch_timeout,
        checksum: false,
        room: job.room,
        epoch: job.attempt,
    };
    let mut flight = Flight::new(&inner.rooms, opts);
    flight.resumable = true;
    let mut last = job.last;
    let mut sent = send_chunk(inner, idx, job, stage.as_deref_mut(), &mut flight);
    while let Ok(bytes) = &mut sent {
        if last || !job.layered {
            break;
        }
        let Some(next) = inner.jobs.take_follow(job) else {
            break;
        };
        last = next.last;
        match send_chunk(inner, idx, &next, stage.as_deref_mut(), &mut flight) {
            Ok(more) => bytes.iter_mut().zip(more).for_each(|(b, m)| *b += m),
            Err(e) => sent = Err(e),
        }
    }
    // every batch completes (or fails) before the chunk ends, error or not:
    // the room's in-flight count falls back and the staging is free again
    let drained = flight.drain();
    let bytes = sent?;
    drained?;
    // tcp links broken under the flight resume on a new connection
    super::resume::settle(inner, job.room, job.attempt, &mut flight)?;
    if let Some(r) = lock(&inner.prefill_rooms).get_mut(&job.room) {
        for (x, b) in r.infos.iter_mut().zip(bytes) {
            x.bytes += b;
        }
    }
    Ok(last)
}

/// Submits one chunk's batches to every decode rank of the room into
/// `flight`; returns the KV bytes for each decode rank (in `infos` order),
/// counted once the flight drained without error.
fn send_chunk<'a>(
    inner: &'a Prefill,
    idx: usize,
    job: &Job,
    stage: Option<&mut DeviceStage>,
    flight: &mut Flight<'a>,
) -> Result<Vec<u64>> {
    stamp_queued(inner, job);
    let infos = lock(&inner.prefill_rooms)
        .get(&job.room)
        .map(|r| r.infos.clone())
        .unwrap_or_default();
    if infos.is_empty() {
        return Err(Error::new(
            Status::UnknownRoom,
            format!("room {}: no decode metadata", job.room),
        ));
    }
    let topo = &inner.cfg.topology;
    let src_l = topo.dcp_layout()?;
    let row_bytes: Vec<u64> = topo.entries.iter().map(|e| e.row_bytes).collect();
    let mut sent = Vec::with_capacity(infos.len());
    // a layer-wise chunk's plan, made by its first job
    let cached: Option<Arc<LayerPlan>> = if job.layered {
        lock(&inner.prefill_rooms)
            .get(&job.room)
            .and_then(|r| r.layer_plan.clone())
            .filter(|p| p.start == job.start && p.pairs.len() == infos.len())
    } else {
        None
    };
    let src_pages = PoolGeometry::pitch_pages(inner.cfg.page_step(), &job.pages);
    let mut planned: Vec<PairPlan> = Vec::new();
    let mut cx = Chunk {
        inner,
        job,
        idx,
        stage,
        flight,
        nccl: Vec::new(),
    };
    for (i, m) in infos.iter().enumerate() {
        if !m.link.alive.load(Ordering::Acquire) {
            return Err(Error::new(
                Status::PeerUnreachable,
                format!("decode rank instance {} is gone", m.link.hello.instance_id),
            ));
        }
        open_grant(m, job.attempt)?;
        let dt = &m.link.hello.topology;
        let dst_l = DcpLayout::new(
            u64::from(dt.page_size),
            u64::from(dt.dcp_size),
            u64::from(dt.dcp_interleave),
        )?;
        // strided pools: the page ids the plan addresses (PoolGeometry)
        let dst_pages = PoolGeometry::pitch_pages(m.link.regions.page_step(dt)?, &m.dst_pages);
        let req = PairRequest {
            src: Side {
                layout: src_l,
                rank: u64::from(topo.dcp_rank),
                pages: &src_pages,
                origin: job.start,
            },
            dst: Side {
                layout: dst_l,
                rank: u64::from(dt.dcp_rank),
                pages: &dst_pages,
                origin: m.prefix,
            },
            start: job.start,
            num_tokens: job.num_tokens,
        };
        if i == 0 {
            stamp_planned(inner, job, &infos);
        }
        let dst_regions: Vec<u64> = topo
            .entries
            .iter()
            .map(|e| {
                m.link.regions.kv_region(e.layer_id).ok_or_else(|| {
                    Error::new(
                        Status::GeometryMismatch,
                        format!("decode rank has no KV region for layer {}", e.layer_id),
                    )
                })
            })
            .collect::<Result<_>>()?;
        // plan, write through the link's path
        let plan = match &cached {
            Some(c) => &c.pairs[i],
            None => {
                req.validate()?;
                planned.push(PairPlan::new(&req));
                planned.last().expect("pushed")
            }
        };
        let pair = Pair {
            req: &req,
            plan,
            row_bytes: &row_bytes,
            dst_regions: &dst_regions,
        };
        let conn = m.link.conn();
        let wrote = conn
            .path
            .write(&mut cx, &m.link, &conn, &pair, &job.layers)?;
        #[cfg(any(test, feature = "testing"))]
        super::resume::sever_for_test(inner, &m.link, wrote);
        sent.push(wrote);
        // the aux and state rows are CP replicas: CP rank 0 sends them
        let aux_and_state = job.last && inner.cp_sender().sends_aux_and_state();
        if aux_and_state && !inner.cfg.aux.is_empty() {
            let mut ops = Vec::new();
            for (i, (a, r)) in inner.cfg.aux.iter().zip(&inner.aux_regions).enumerate() {
                let (dr, ditem) = *m.link.regions.aux.get(i).ok_or_else(|| {
                    Error::new(
                        Status::GeometryMismatch,
                        format!(
                            "decode rank has {} aux buffers, prefill {}",
                            m.link.regions.aux.len(),
                            inner.cfg.aux.len()
                        ),
                    )
                })?;
                if ditem != a.item_bytes {
                    return Err(Error::new(
                        Status::GeometryMismatch,
                        format!(
                            "aux buffer {i}: prefill rows are {} B, decode rows {ditem} B",
                            a.item_bytes
                        ),
                    ));
                }
                ops.push(WriteOp {
                    local_region: r.id,
                    local_offset: job.aux_index * a.item_bytes,
                    remote_region: dr,
                    remote_offset: m.aux_index * ditem,
                    len: a.item_bytes,
                });
            }
            cx.flight.submit(&m.link, &ops, None)?;
        }
        // a request without state rows on either side moves no state
        if aux_and_state && !(job.state_indices.is_empty() && m.state_indices.is_empty()) {
            let ops = state_ops(inner, job, m)?;
            cx.flight.submit(&m.link, &ops, None)?;
        }
    }
    // every nccl pair of the chunk is on the wire: each completes (or aborts) here
    crate::engine::path::nccl::send::finish_all(cx.nccl)?;
    if job.layered {
        let done = job.layers.end == topo.entries.len();
        if let Some(r) = lock(&inner.prefill_rooms).get_mut(&job.room) {
            if done {
                r.layer_plan = None;
            } else if cached.is_none() {
                r.layer_plan = Some(Arc::new(LayerPlan {
                    start: job.start,
                    pairs: planned,
                }));
            }
        }
    }
    Ok(sent)
}

/// Opens the room's grant from decode rank `m` on its data connection
/// (again on each chunk: a no-op once open); a transport without grants
/// keeps the per-batch protocol.
fn open_grant(m: &MetaInfo, epoch: u64) -> Result<()> {
    let Some(g) = &m.grant else { return Ok(()) };
    let data = m.link.data();
    match data.open_room(g, epoch) {
        Err(e) if e.status() == Status::Unsupported => Ok(()),
        // a tcp connection broken in the middle of the room: the chunk's
        // batches fail on it, and the room resumes on a new one
        Err(_) if data.kind() == TransportKind::Tcp && !data.is_alive() => Ok(()),
        Err(e) => Err(Error::new(
            e.status(),
            format!(
                "room {}: opening the grant of decode rank instance {}: {}",
                g.room,
                m.link.hello.instance_id,
                e.detail()
            ),
        )),
        Ok(()) => Ok(()),
    }
}

/// Closes the room's grants once every batch completed: one RoomEnd /
/// RoomAck per decode rank whose connection opened one (after every byte
/// landed on it), all decode ranks at once (a thread each beyond the first),
/// before the room is reported done: a slow decode rank's answer costs the
/// room one wait, not one per rank.
fn close_grants(inner: &Prefill, room: u64, attempt: u64) -> Result<()> {
    let ended = end_grants(inner, room, attempt);
    await_grants(inner, room, attempt, ended)
}

/// The room's decode ranks holding a grant, each with its link.
fn granted_infos(inner: &Prefill, room: u64) -> Vec<MetaInfo> {
    lock(&inner.prefill_rooms)
        .get(&room)
        .map(|r| {
            r.infos
                .iter()
                .filter(|m| m.grant.is_some())
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// Sends the room end to every decode rank holding a grant, without
/// waiting for any answer (a few microseconds each): what each send gave,
/// in the order of [`granted_infos`], for [`await_grants`].
fn end_grants(inner: &Prefill, room: u64, attempt: u64) -> Vec<Result<()>> {
    granted_infos(inner, room)
        .iter()
        .map(|m| {
            m.link
                .data()
                .end_room(room, attempt, inner.cfg.batch_timeout)
        })
        .collect()
}

/// Waits for every decode rank's answer to the room end `end_grants` sent
/// (`ended`, one per rank); a tcp link that broke before every byte was
/// confirmed resumes the room on a new connection and closes it there.
fn await_grants(inner: &Prefill, room: u64, attempt: u64, ended: Vec<Result<()>>) -> Result<()> {
    let granted = granted_infos(inner, room);
    let mut ended = ended.into_iter();
    let mut results = Vec::with_capacity(granted.len());
    for m in &granted {
        let data = m.link.data();
        // a rank the ends did not see (the room's ranks are fixed before its
        // last chunk; kept for safety) is ended and closed here
        let mut r = match ended.next() {
            Some(Ok(())) | None => data.close_room(room, attempt, inner.cfg.batch_timeout),
            Some(Err(e)) => Err(e),
        };
        if let Err(e) = &r {
            // the connection broke before every byte was confirmed: the
            // room resumes on a new one and closes there
            if data.kind() == TransportKind::Tcp && !data.is_alive() {
                r = super::resume::resume_link(inner, room, attempt, &m.link, e.clone()).and_then(
                    |()| {
                        m.link
                            .data()
                            .close_room(room, attempt, inner.cfg.batch_timeout)
                    },
                );
            }
        }
        results.push(match r {
            Ok(_) => Ok(()),
            // never opened here: the transport has no grants, or the link was remade
            Err(e) if matches!(e.status(), Status::Unsupported | Status::UnknownRoom) => Ok(()),
            Err(e) => Err(Error::new(
                e.status(),
                format!(
                    "room {room}: closing the grant of decode rank instance {}: {}",
                    m.link.hello.instance_id,
                    e.detail()
                ),
            )),
        });
    }
    results.into_iter().collect()
}

/// Forgets the room's open grants after a failure (the decode revokes them).
fn forget_grants(inner: &Prefill, room: u64, attempt: u64) {
    let infos = lock(&inner.prefill_rooms)
        .get(&room)
        .map(|r| r.infos.clone())
        .unwrap_or_default();
    for m in infos.iter().filter(|m| m.grant.is_some()) {
        m.link.data().forget_room(room, attempt);
    }
}

/// Stamps the room's queued time (the chunk's, once).
fn stamp_queued(inner: &Prefill, job: &Job) {
    if let Some(t) = lock(&inner.rooms).times_mut(job.room, job.attempt) {
        RoomTimes::stamp(&mut t.queued, job.queued);
    }
}

/// Stamps the room's planned time (now, once) and the transport label of
/// its decode links (`mixed` when they differ).
fn stamp_planned(inner: &Prefill, job: &Job, infos: &[MetaInfo]) {
    let mut kinds = infos.iter().map(|m| m.link.data().kind().name());
    let first = kinds.next().unwrap_or("unknown");
    // transport nccl: the KV goes over NCCL (the data link carries aux and state)
    let transport = if inner.cfg.transport == TransportKind::Nccl {
        "nccl"
    } else if kinds.all(|k| k == first) {
        first
    } else {
        "mixed"
    };
    let now = Instant::now();
    if let Some(t) = lock(&inner.rooms).times_mut(job.room, job.attempt) {
        RoomTimes::stamp(&mut t.planned, now);
        t.transport.get_or_insert(transport);
    }
}

/// The state rows of the room's last chunk, whole, to one decode rank.
fn state_ops(inner: &Prefill, job: &Job, m: &MetaInfo) -> Result<Vec<WriteOp>> {
    let n = inner.cfg.state.len();
    if job.state_indices.len() != n || m.state_indices.len() != n || m.link.regions.state.len() != n
    {
        return Err(Error::new(
            Status::GeometryMismatch,
            format!(
                "room {}: state rows: prefill has {n} state buffers and gave {} rows; decode instance {} has {} buffers and gave {} rows",
                job.room,
                job.state_indices.len(),
                m.link.hello.instance_id,
                m.link.regions.state.len(),
                m.state_indices.len()
            ),
        ));
    }
    let mut ops = Vec::with_capacity(n);
    for (i, (b, r)) in inner.cfg.state.iter().zip(&inner.state_regions).enumerate() {
        let (dr, ditem) = m.link.regions.state[i];
        if ditem != b.item_bytes {
            return Err(Error::new(
                Status::GeometryMismatch,
                format!(
                    "state buffer {i}: prefill rows are {} B, decode rows {ditem} B",
                    b.item_bytes
                ),
            ));
        }
        ops.push(WriteOp {
            local_region: r.id,
            local_offset: job.state_indices[i] * b.item_bytes,
            remote_region: dr,
            remote_offset: m.state_indices[i] * ditem,
            len: b.item_bytes,
        });
    }
    Ok(ops)
}
