//! [`Engine`]: one per rank. Joins the layout core (plans), the relayout
//! (CPU gather into a registered staging buffer), the data plane (agent and
//! transports) and the bootstrap (registration, peer lookup, handshake re-check)
//! into prefill and decode engines with SGLang's room lifecycle.
//!
//! Threads: a control listener (prefill) and one reader per control
//! connection; `workers` transfer threads on the prefill (a room always uses
//! the same worker, so its chunks stay in order); a deadline thread. Every
//! failure is kept on its room (reason + code), and one failing peer or room
//! never stops the others: workers and readers catch errors and panics per job.

use super::control::{CtlMsg, RegionMap};
use super::decode::DecodeRoom;
use super::jobs::JobQueue;
use super::link::{DecodeLink, PrefillLink};
use super::metrics::EngineMetrics;
use super::prefill::{MetaInfo, PrefillRoom};
use super::room::{KvPoll, RoomTable};
use super::EngineConfig;
use crate::bootstrap::client::Registrar;
use crate::bootstrap::schema::{InstanceId, Registration, Role};
use crate::bootstrap::store::Store;
use crate::error::{Error, Result, Status};
use crate::memory::RegionDesc;
use crate::transport::{Agent, TransportKind};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The state an [`Engine`] handle shares with its threads. One struct for
/// both roles: the prefill fields stay empty on a decode engine and the
/// decode fields on a prefill engine.
///
/// # Lock order
///
/// A thread that takes one of these mutexes while it holds another takes
/// them in this order, never the reverse:
///
/// 1. `prefill_rooms`;
/// 2. `pending_meta`: `sender` drains and `add_meta` parks a room's
///    metadata under `prefill_rooms`, so none is parked after the drain.
///
/// `rooms` (`cv` waits on it), `registrar`, `decode_links`, `decode_rooms`,
/// `prefill_links` and the job queue are never held while another of these
/// is taken, nor taken under one. The `nccl` state's locks are leaves too,
/// except a link's NCCL sender (held by the one worker moving that link's
/// chunk), under which `rooms`, `decode_links` and `nccl`'s answers are taken. No control socket is written under any of
/// them except a control writer's own lock (`CtlWriter::send`, `shutdown`),
/// which takes none: a stuck decode socket then stalls only the thread
/// writing to it (`notify_decode` copies the room's links out of
/// `prefill_rooms` before it writes).
pub(super) struct Inner {
    pub(super) cfg: EngineConfig,
    pub(super) agent: Agent,
    pub(super) store: Arc<dyn Store>,
    pub(super) registrar: Mutex<Option<Registrar>>,
    pub(super) rooms: Mutex<RoomTable>,
    pub(super) cv: Condvar,
    pub(super) pool_regions: Vec<RegionDesc>,
    pub(super) aux_regions: Vec<RegionDesc>,
    pub(super) state_regions: Vec<RegionDesc>,
    pub(super) staging: Vec<(Vec<u8>, RegionDesc)>,
    pub(super) closed: AtomicBool,
    /// The engine's counters (atomics; see `metrics`).
    pub(super) metrics: EngineMetrics,
    /// Where the `/metrics` responder listens, when `metrics_listen` is set.
    pub(super) metrics_addr: Option<std::net::SocketAddr>,
    /// Device pools over rdma: why the zero-copy path is not used was logged.
    pub(super) gpu_direct_logged: AtomicBool,
    // prefill
    pub(super) prefill_rooms: Mutex<HashMap<u64, PrefillRoom>>,
    pub(super) pending_meta: Mutex<HashMap<u64, Vec<MetaInfo>>>,
    pub(super) decode_links: Mutex<Vec<Arc<DecodeLink>>>,
    pub(super) jobs: Arc<JobQueue>,
    // decode
    pub(super) decode_rooms: Mutex<HashMap<u64, DecodeRoom>>,
    pub(super) prefill_links: Mutex<HashMap<(InstanceId, u64), Arc<PrefillLink>>>,
    /// Transport nccl: communicators, the decode's NCCL threads, answers.
    pub(super) nccl: super::nccl_link::NcclLinks,
}

/// One rank's transfer engine.
#[derive(Clone)]
pub struct Engine {
    pub(super) inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("role", &self.inner.cfg.role)
            .field("cluster", &self.inner.cfg.cluster)
            .finish()
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) fn catch<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            Status::Panic,
            format!("internal panic in {what}"),
        )),
    }
}

impl Engine {
    /// This rank's current bootstrap entry (with its epoch).
    pub fn registration(&self) -> Result<Registration> {
        lock(&self.inner.registrar)
            .as_ref()
            .map(|r| r.registration())
            .ok_or_else(|| Error::new(Status::EngineClosed, "engine is closed"))
    }

    /// The room's state (`Failed` for an unknown room, like SGLang).
    pub fn poll(&self, room: u64) -> KvPoll {
        lock(&self.inner.rooms)
            .get(room)
            .map_or(KvPoll::Failed, |r| r.poll)
    }

    /// Why the room failed (or why it is unknown).
    pub fn failure(&self, room: u64) -> Option<Error> {
        match lock(&self.inner.rooms).get(room) {
            Ok(r) => r.failure.clone(),
            Err(e) => Some(e),
        }
    }

    /// Waits until the room is terminal or `timeout` passes; returns its state.
    pub fn wait(&self, room: u64, timeout: Duration) -> KvPoll {
        let end = Instant::now() + timeout;
        let mut rooms = lock(&self.inner.rooms);
        loop {
            let p = rooms.get(room).map_or(KvPoll::Failed, |r| r.poll);
            let now = Instant::now();
            if p.is_terminal() || now >= end {
                return p;
            }
            rooms = self
                .inner
                .cv
                .wait_timeout(rooms, end - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Forgets a terminal room (refused while writes for it are in flight).
    pub fn clear(&self, room: u64) -> Result<()> {
        lock(&self.inner.rooms).clear(room)?;
        self.inner.revoke_room_grants(room, None);
        lock(&self.inner.prefill_rooms).remove(&room);
        lock(&self.inner.decode_rooms).remove(&room);
        Ok(())
    }

    pub(super) fn create_room(&self, room: u64, timeout: Option<Duration>) -> Result<u64> {
        let t = timeout.unwrap_or(self.inner.cfg.room_timeout);
        lock(&self.inner.rooms).create(room, KvPoll::Bootstrapping, Some(t), Instant::now())
    }

    pub(super) fn require(&self, role: Role) -> Result<()> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::new(Status::EngineClosed, "engine is closed"));
        }
        if self.inner.cfg.role != role {
            return Err(Error::new(
                Status::Unsupported,
                format!(
                    "this is a {} engine; that call belongs to a {} engine",
                    self.inner.cfg.role.as_str(),
                    role.as_str()
                ),
            ));
        }
        Ok(())
    }

    /// Sets the room's state rows, one per configured state buffer: on the
    /// prefill the rows sent with the last chunk, on the decode the rows they
    /// land in (call before `send_metadata`). Both sides must give one row per
    /// state buffer; the rows follow the KV and aux, to every decode rank.
    pub fn set_state_indices(&self, room: u64, rows: &[u64]) -> Result<()> {
        if rows.len() != self.inner.cfg.state.len() {
            return Err(Error::invalid(format!(
                "room {room}: {} state rows given for {} state buffers",
                rows.len(),
                self.inner.cfg.state.len()
            )));
        }
        for (i, (&row, b)) in rows.iter().zip(&self.inner.cfg.state).enumerate() {
            if row >= b.count {
                return Err(Error::new(
                    Status::OutOfBounds,
                    format!(
                        "state row {row} of buffer {i} is outside its {} rows",
                        b.count
                    ),
                ));
            }
        }
        match self.inner.cfg.role {
            Role::Prefill => {
                let mut pr = lock(&self.inner.prefill_rooms);
                let r = pr.get_mut(&room).ok_or_else(|| {
                    Error::new(
                        Status::UnknownRoom,
                        format!("room {room}: call sender() first"),
                    )
                })?;
                if r.queued_last {
                    return Err(Error::invalid(format!(
                        "room {room}: the last chunk was already queued; set state rows before it"
                    )));
                }
                r.state_indices = rows.to_vec();
            }
            Role::Decode => {
                let mut d = lock(&self.inner.decode_rooms);
                let r = d.get_mut(&room).ok_or_else(|| {
                    Error::new(
                        Status::UnknownRoom,
                        format!("room {room}: call receiver() first"),
                    )
                })?;
                r.state_indices = rows.to_vec();
            }
        }
        Ok(())
    }

    /// Aborts a room. On decode the prefill ranks are told and answer once no
    /// write for the room can still land; [`is_fenced`](Self::is_fenced) says
    /// when the pages may be reused. On prefill the decode ranks that sent
    /// metadata are told the room failed. Returns whether it is fenced already.
    pub fn abort(&self, room: u64) -> Result<bool> {
        let attempt = lock(&self.inner.rooms).get(room)?.attempt;
        let fenced = lock(&self.inner.rooms).abort(room, attempt)?;
        self.inner.cv.notify_all();
        if self.inner.cfg.role == Role::Decode {
            let targets = lock(&self.inner.decode_rooms)
                .get(&room)
                .map(|r| r.targets.clone())
                .unwrap_or_default();
            for t in &targets {
                let _ = t.writer.send(&CtlMsg::Abort { room, attempt });
            }
            return Ok(self.is_fenced(room));
        }
        // the decode ranks of the room learn it now rather than at their timeout
        let failure = lock(&self.inner.rooms)
            .get(room)
            .ok()
            .and_then(|r| r.failure.clone());
        super::prefill::notify_decode(&self.inner, room, false, failure);
        Ok(fenced)
    }

    /// Prefill: the `decode_prefix_len` the decode ranks sent for the room,
    /// once their metadata has arrived (`None` before, or for an unknown room).
    /// The prefill's chunks start right after it: SGLang's
    /// `pop_decode_prefix_len` reads it to skip the prefix the decode holds.
    pub fn decode_prefix_len(&self, room: u64) -> Option<u64> {
        lock(&self.inner.prefill_rooms)
            .get(&room)
            .and_then(|r| r.infos.first().map(|m| m.prefix))
    }

    /// True when no write for an aborted room can still land in local memory
    /// (decode: every live prefill rank acknowledged the abort; a dead one cannot write).
    pub fn is_fenced(&self, room: u64) -> bool {
        if self.inner.cfg.role == Role::Decode {
            let d = lock(&self.inner.decode_rooms);
            let acked = d.get(&room).is_none_or(|r| {
                r.abort_acks
                    >= r.targets
                        .iter()
                        .filter(|t| t.alive.load(Ordering::Acquire))
                        .count()
            });
            drop(d);
            // transport nccl: this side's own recvs for the room stopped too
            return acked && self.inner.nccl.idle(room);
        }
        lock(&self.inner.rooms).is_fenced(room)
    }

    /// Bytes received for a decode room (from the prefill ranks' completion records).
    pub fn room_bytes(&self, room: u64) -> u64 {
        lock(&self.inner.decode_rooms)
            .get(&room)
            .map_or(0, |r| r.bytes)
    }

    /// The transport the data of this engine moves over (decode: as chosen by the prefill).
    pub fn transport(&self) -> TransportKind {
        self.inner.cfg.transport
    }

    /// Deregisters from the bootstrap and stops the threads.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        if let Some(r) = lock(&self.inner.registrar).take() {
            let _ = r.deregister();
        }
        for l in lock(&self.inner.decode_links).drain(..) {
            l.writer.shutdown();
            l.data().close();
        }
        for (_, l) in lock(&self.inner.prefill_links).drain() {
            l.writer.shutdown();
        }
        // NCCL waits abort, the decode's NCCL threads are joined
        self.inner.nccl.close();
        self.inner.agent.shutdown();
    }
}

impl Inner {
    pub(super) fn region_map(&self) -> RegionMap {
        RegionMap {
            kv: self
                .cfg
                .pools
                .iter()
                .zip(&self.pool_regions)
                .map(|(p, r)| (p.layer_id, r.id))
                .collect(),
            aux: self
                .cfg
                .aux
                .iter()
                .zip(&self.aux_regions)
                .map(|(a, r)| (r.id, a.item_bytes))
                .collect(),
            state: self
                .cfg
                .state
                .iter()
                .zip(&self.state_regions)
                .map(|(a, r)| (r.id, a.item_bytes))
                .collect(),
        }
    }

    /// Fails the room's `attempt` with `e` and logs it, naming the room, the
    /// peer instances it was moving bytes with and the status kind (the log
    /// reaches a C or Python host through the log callback).
    pub(super) fn fail_room(&self, room: u64, attempt: u64, e: Error) {
        let peers = self.room_peers(room);
        if self.cfg.role == Role::Decode {
            self.revoke_room_grants(room, None);
        }
        if lock(&self.rooms).fail(room, attempt, e.clone()) {
            log::warn!(
                "{} room {room} failed, peers [{peers}]: {} ({}): {}",
                self.cfg.role.as_str(),
                e.kind(),
                e.status() as i32,
                e.detail()
            );
        }
        self.cv.notify_all();
    }

    /// The peer instances of a room, for log lines: a prefill's decode ranks
    /// that sent metadata, a decode's prefill ranks (takes and releases the
    /// role's room lock; `rooms` is not held).
    pub(super) fn room_peers(&self, room: u64) -> String {
        let ids: Vec<String> = match self.cfg.role {
            Role::Prefill => lock(&self.prefill_rooms)
                .get(&room)
                .map(|r| {
                    r.infos
                        .iter()
                        .map(|m| m.link.hello.instance_id.to_string())
                        .collect()
                })
                .unwrap_or_default(),
            Role::Decode => lock(&self.decode_rooms)
                .get(&room)
                .map(|r| {
                    r.targets
                        .iter()
                        .map(|t| t.registration.instance_id.to_string())
                        .collect()
                })
                .unwrap_or_default(),
        };
        if ids.is_empty() {
            "none yet".into()
        } else {
            ids.join(", ")
        }
    }
}
