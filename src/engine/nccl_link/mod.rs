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
//! for that prefill link trusts no decode page of the message: the room's
//! attempt must be open here against that prefill, the decode pages and
//! prefix the chunk names must be exactly those the decode's own metadata
//! named for the room (else `out_of_bounds`, naming the prefill and the
//! room), and it builds the plan from its own pages, prefix and geometry
//! (the prefill's pages only shape the runs). A different digest is
//! `nccl_plan_mismatch` on both sides. Any refusal comes before anything
//! is posted. Otherwise it answers `nccl_accepted`, posts
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
//!
//! - `staging`: each link end's device staging, allocated once when its
//!   communicator opens and never freed while the link lives;
//! - this file: the checks at creation, the engine's NCCL state
//!   ([`NcclLinks`]: the decode's answers, the decode's active rooms, each
//!   link's sending end or NCCL thread, close), which each role's state holds;
//! - the prefill side (a chunk's pairs started and finished) is the nccl
//!   write path, `engine/path/nccl/`;
//! - the decode side (the NCCL thread of a prefill link) is `engine/decode/nccl.rs`.

#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

#[cfg(feature = "nccl")]
mod staging;
#[cfg(feature = "nccl")]
pub(in crate::engine) use staging::Staging;

use super::config::EngineConfig;
use super::control::CtlMsg;
use super::state::{lock, Shared};
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
pub(in crate::engine) type LinkKey = (InstanceId, u64);

/// Which answer of the decode a prefill waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(in crate::engine) struct AnswerKey {
    pub(in crate::engine) link: LinkKey,
    pub(in crate::engine) room: u64,
    pub(in crate::engine) attempt: u64,
    pub(in crate::engine) generation: u64,
    pub(in crate::engine) start: u64,
    /// false: `nccl_accepted`; true: `nccl_ready`.
    pub(in crate::engine) landed: bool,
}

/// One answer of the decode.
#[derive(Debug, Clone)]
pub(in crate::engine) struct Answer {
    pub(in crate::engine) ok: bool,
    pub(in crate::engine) reason: Option<String>,
    pub(in crate::engine) code: Option<i32>,
}

/// Answers kept at most (late ones for chunks nobody waits for any more).
const MAX_ANSWERS: usize = 4096;

/// The engine's NCCL state (empty unless the transport is nccl).
#[derive(Default)]
pub(super) struct NcclLinks {
    /// Prefill: the decode's answers, by chunk.
    pub(in crate::engine) answers: Mutex<HashMap<AnswerKey, Answer>>,
    pub(in crate::engine) answered: Condvar,
    /// Decode: rooms whose recvs are being posted or run, with a count.
    pub(in crate::engine) active: Mutex<HashMap<u64, usize>>,
    /// Set by `close`: every wait aborts.
    pub(in crate::engine) closing: AtomicBool,
    /// Prefill: the sending end of each decode link.
    #[cfg(feature = "nccl")]
    pub(in crate::engine) senders: Mutex<HashMap<LinkKey, std::sync::Arc<Mutex<Sender>>>>,
    /// Decode: the NCCL thread of each prefill link.
    #[cfg(feature = "nccl")]
    pub(in crate::engine) receivers: Mutex<HashMap<LinkKey, ReceiverThread>>,
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
    pub(in crate::engine) fn wait_answer(
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
    pub(in crate::engine) fn take_answer(&self, key: &AnswerKey) -> Option<Answer> {
        lock(&self.answers).remove(key)
    }

    /// Forgets every answer of a room's attempt (its chunk ended).
    pub(in crate::engine) fn forget(&self, link: LinkKey, room: u64, attempt: u64) {
        lock(&self.answers)
            .retain(|k, _| !(k.link == link && k.room == room && k.attempt == attempt));
    }

    /// Decode: true while no recv of `room` is being posted or runs.
    pub(super) fn idle(&self, room: u64) -> bool {
        !lock(&self.active).contains_key(&room)
    }

    pub(in crate::engine) fn enter(&self, room: u64) {
        *lock(&self.active).entry(room).or_default() += 1;
    }

    pub(in crate::engine) fn leave(&self, room: u64) {
        let mut a = lock(&self.active);
        if let Some(n) = a.get_mut(&room) {
            *n -= 1;
            if *n == 0 {
                a.remove(&room);
            }
        }
    }

    /// True once the engine is closing.
    pub(in crate::engine) fn is_closing(&self) -> bool {
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
            let threads: Vec<ReceiverThread> =
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
                if let Ok(ev) = s.gpu.stream().record(false) {
                    let _ = ev.wait();
                }
            }
        }
    }
}

/// The room's deadline, or the engine's default from now.
pub(in crate::engine) fn room_deadline(inner: &Shared, room: u64) -> Instant {
    lock(&inner.rooms)
        .get(room)
        .ok()
        .and_then(|r| r.deadline)
        .unwrap_or_else(|| Instant::now() + inner.cfg.room_timeout)
}

/// Whether the room's `attempt` still takes bytes (not failed, aborted or
/// ended) and the engine is open.
pub(in crate::engine) fn room_live(
    inner: &Shared,
    nccl: &NcclLinks,
    room: u64,
    attempt: u64,
) -> Result<()> {
    if inner.closed.load(Ordering::Acquire) || nccl.is_closing() {
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
pub(in crate::engine) fn plan_options(
    cfg: &EngineConfig,
) -> crate::transport::nccl::NcclPlanOptions {
    #[cfg(any(test, feature = "testing"))]
    if let Some(o) = cfg.testing.nccl_plan {
        return o;
    }
    let _ = cfg;
    Default::default()
}

/// The prefill end of one decode link. Fields drop in order: the pair
/// (aborted and its stream waited, when work is in flight) before the
/// staging buffer and the stream it uses.
#[cfg(feature = "nccl")]
pub(in crate::engine) struct Sender {
    pub(in crate::engine) pair: Option<crate::transport::nccl::NcclPair>,
    pub(in crate::engine) generation: u64,
    pub(in crate::engine) staging: Staging,
    pub(in crate::engine) gpu: crate::relayout::gpu::GpuRelayout,
}

/// Decode: the NCCL thread of one prefill link.
#[cfg(feature = "nccl")]
pub(in crate::engine) struct ReceiverThread {
    pub(in crate::engine) tx: std::sync::mpsc::Sender<CtlMsg>,
    /// The newest generation the prefill opened (ahead of the thread
    /// while an `nccl_open` waits in the queue).
    pub(in crate::engine) opened: std::sync::Arc<std::sync::atomic::AtomicU64>,
    pub(in crate::engine) handle: std::thread::JoinHandle<()>,
}

#[cfg(feature = "nccl")]
impl ReceiverThread {
    /// Stops taking messages and waits for the thread (skipped when it
    /// is the caller: an engine dropped from its own NCCL thread).
    fn join(self) {
        drop(self.tx);
        if self.handle.thread().id() != std::thread::current().id() {
            let _ = self.handle.join();
        }
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
