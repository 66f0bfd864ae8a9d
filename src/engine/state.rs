//! [`Shared`]: the state both roles' engines hold (configuration, agent,
//! bootstrap store and registration, the room table, registered regions,
//! staging, counters), beneath each role's own state (`prefill::Prefill`,
//! `decode::Decode`), and the two helpers every engine thread uses ([`lock`],
//! [`catch`]).

use super::config::EngineConfig;
use super::control::RegionMap;
use super::metrics::EngineMetrics;
use super::room::{KvPoll, RoomTable};
use crate::bootstrap::client::Registrar;
use crate::bootstrap::schema::{Registration, Role};
use crate::bootstrap::store::Store;
use crate::error::{Error, Result, Status};
use crate::memory::RegionDesc;
use crate::transport::Agent;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The state of an engine that does not depend on its role.
///
/// # Lock order
///
/// `rooms` (`cv` waits on it) and `registrar` are leaves: never held while
/// another engine lock is taken. Each role's own locks come first (see
/// `Prefill` and `Decode`).
pub(super) struct Shared {
    pub(super) cfg: EngineConfig,
    pub(super) agent: Agent,
    pub(super) store: Arc<dyn Store>,
    pub(super) registrar: Mutex<Option<Registrar>>,
    pub(super) rooms: Mutex<RoomTable>,
    pub(super) cv: Condvar,
    pub(super) pool_regions: Vec<RegionDesc>,
    pub(super) aux_regions: Vec<RegionDesc>,
    pub(super) state_regions: Vec<RegionDesc>,
    /// Host pools on the prefill: each transfer worker's host staging buffer.
    pub(super) staging: Vec<(Vec<u8>, RegionDesc)>,
    pub(super) closed: AtomicBool,
    /// The engine's counters (atomics; see `metrics`).
    pub(super) metrics: EngineMetrics,
    /// Where the `/metrics` responder listens, when `metrics_listen` is set.
    pub(super) metrics_addr: Option<std::net::SocketAddr>,
    /// Device pools over rdma: why the zero-copy path is not used was logged.
    pub(super) gpu_direct_logged: AtomicBool,
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

impl Shared {
    pub(super) fn region_map(&self) -> RegionMap {
        RegionMap {
            kv: self
                .cfg
                .pools
                .iter()
                .zip(&self.pool_regions)
                .map(|(p, r)| (p.layer_id, r.id))
                .collect(),
            kv_stride: self
                .cfg
                .pools
                .iter()
                .filter(|p| p.page_stride != 0 && p.page_stride != p.page_bytes)
                .map(|p| (p.layer_id, p.page_stride))
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
    /// peer instances it was moving bytes with (`peers`, from the role's
    /// state) and the status kind (the log reaches a C or Python host
    /// through the log callback).
    pub(super) fn fail_room_with(&self, room: u64, attempt: u64, e: Error, peers: &str) {
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

    /// This rank's current bootstrap entry (with its epoch).
    pub(super) fn registration(&self) -> Result<Registration> {
        lock(&self.registrar)
            .as_ref()
            .map(|r| r.registration())
            .ok_or_else(|| Error::new(Status::EngineClosed, "engine is closed"))
    }

    /// Opens room `room` in the room table (`Bootstrapping`, with its deadline).
    pub(super) fn create_room(&self, room: u64, timeout: Option<Duration>) -> Result<u64> {
        let t = timeout.unwrap_or(self.cfg.room_timeout);
        lock(&self.rooms).create(room, KvPoll::Bootstrapping, Some(t), Instant::now())
    }

    /// Refuses a call once the engine is closed, or one of the other role.
    pub(super) fn require(&self, role: Role) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::new(Status::EngineClosed, "engine is closed"));
        }
        if self.cfg.role != role {
            return Err(Error::new(
                Status::Unsupported,
                format!(
                    "this is a {} engine; that call belongs to a {} engine",
                    self.cfg.role.as_str(),
                    role.as_str()
                ),
            ));
        }
        Ok(())
    }
}

/// The names of peer instances for a log line (`none yet` for none).
pub(super) fn peer_names(ids: Vec<String>) -> String {
    if ids.is_empty() {
        "none yet".into()
    } else {
        ids.join(", ")
    }
}
