//! [`Engine`]: one per rank. Joins the layout core (plans), the relayout
//! (CPU gather into a registered staging buffer), the data plane (agent and
//! transports) and the bootstrap (registration, peer lookup, handshake re-check)
//! into prefill and decode engines with SGLang's room lifecycle.
//!
//! The handle holds one role's state ([`Inner`]: a `Prefill` or a `Decode`,
//! each over the `Shared` state); this file is the engine's API: the
//! role-independent queries, abort and close, and each role's calls handed
//! to its state.
//!
//! Threads: a control listener (prefill) and one reader per control
//! connection; `workers` transfer threads on the prefill (a room always uses
//! the same worker, so its chunks stay in order); a deadline thread. Every
//! failure is kept on its room (reason + code), and one failing peer or room
//! never stops the others: workers and readers catch errors and panics per job.

use super::control::CtlMsg;
use super::decode::Decode;
use super::layers::SendOptions;
use super::metrics::MetricsSnapshot;
use super::prefill::{notify_decode, Prefill};
use super::room::KvPoll;
use super::room_keys::RoomKeys;
use super::state::{lock, Shared};
use super::telemetry::RoomTelemetry;
use crate::bootstrap::schema::{Registration, Role};
use crate::error::{Error, Result, Status};
use crate::memory::RegionDesc;
use crate::transport::TransportKind;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The state an [`Engine`] handle shares with its threads: one role's.
#[derive(Clone)]
pub(super) enum Inner {
    Prefill(Arc<Prefill>),
    Decode(Arc<Decode>),
}

/// What a thread that must not keep the engine alive holds of it.
#[derive(Clone)]
pub(super) enum WeakInner {
    Prefill(Weak<Prefill>),
    Decode(Weak<Decode>),
}

impl Inner {
    /// The role-independent state.
    pub(super) fn shared(&self) -> &Shared {
        match self {
            Inner::Prefill(p) => &p.shared,
            Inner::Decode(d) => &d.shared,
        }
    }

    pub(super) fn downgrade(&self) -> WeakInner {
        match self {
            Inner::Prefill(p) => WeakInner::Prefill(Arc::downgrade(p)),
            Inner::Decode(d) => WeakInner::Decode(Arc::downgrade(d)),
        }
    }
}

impl WeakInner {
    /// The engine's state while a handle to it lives.
    pub(super) fn upgrade(&self) -> Option<Inner> {
        match self {
            WeakInner::Prefill(p) => p.upgrade().map(Inner::Prefill),
            WeakInner::Decode(d) => d.upgrade().map(Inner::Decode),
        }
    }
}

/// One rank's transfer engine.
#[derive(Clone)]
pub struct Engine {
    pub(super) inner: Inner,
    /// Room keys bound on this engine ([`Engine::bind_room_key`]).
    pub(super) room_keys: Arc<std::sync::Mutex<RoomKeys>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("role", &self.shared().cfg.role)
            .field("cluster", &self.shared().cfg.cluster)
            .finish()
    }
}

impl Engine {
    pub(super) fn shared(&self) -> &Shared {
        self.inner.shared()
    }
}

impl Engine {
    /// This rank's current bootstrap entry (with its epoch).
    pub fn registration(&self) -> Result<Registration> {
        self.shared().registration()
    }

    /// The room's state (`Failed` for an unknown room, like SGLang).
    pub fn poll(&self, room: u64) -> KvPoll {
        lock(&self.shared().rooms)
            .get(room)
            .map_or(KvPoll::Failed, |r| r.poll)
    }

    /// Why the room failed (or why it is unknown).
    pub fn failure(&self, room: u64) -> Option<Error> {
        match lock(&self.shared().rooms).get(room) {
            Ok(r) => r.failure.clone(),
            Err(e) => Some(e),
        }
    }

    /// Waits until the room is terminal or `timeout` passes; returns its state.
    pub fn wait(&self, room: u64, timeout: Duration) -> KvPoll {
        let end = Instant::now() + timeout;
        let mut rooms = lock(&self.shared().rooms);
        loop {
            let p = rooms.get(room).map_or(KvPoll::Failed, |r| r.poll);
            let now = Instant::now();
            if p.is_terminal() || now >= end {
                return p;
            }
            rooms = self
                .shared()
                .cv
                .wait_timeout(rooms, end - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The room of a string key (a serving engine's request id), bound on
    /// this engine until the room is cleared: the same key gives the same
    /// room on every side ([`room_for_key`](super::room_keys::room_for_key));
    /// a different key that maps to a room bound here is refused
    /// (`room_key_collision`) and nothing changes.
    pub fn bind_room_key(&self, key: &[u8]) -> Result<u64> {
        lock(&self.room_keys).bind(key)
    }

    /// The key bound to `room` by [`Engine::bind_room_key`], if any.
    pub fn room_key(&self, room: u64) -> Option<Vec<u8>> {
        lock(&self.room_keys).key(room).map(<[u8]>::to_vec)
    }

    /// Forgets a terminal room (refused while writes for it are in flight),
    /// and the key bound to it (also when the room is unknown: a key bound
    /// to a room that was never opened).
    pub fn clear(&self, room: u64) -> Result<()> {
        let cleared = lock(&self.shared().rooms).clear(room);
        // a key bound to a room that was never opened (its sender or
        // receiver refused) is released too
        if matches!(&cleared, Err(e) if e.status() == Status::UnknownRoom) || cleared.is_ok() {
            lock(&self.room_keys).release(room);
        }
        cleared?;
        match &self.inner {
            Inner::Prefill(p) => {
                lock(&p.prefill_rooms).remove(&room);
            }
            Inner::Decode(d) => {
                d.revoke_room_grants(room, None);
                lock(&d.decode_rooms).remove(&room);
            }
        }
        Ok(())
    }

    /// Sets the room's state rows, one per configured state buffer: on the
    /// prefill the rows sent with the last chunk, on the decode the rows they
    /// land in (call before `send_metadata`). Both sides must give one row per
    /// state buffer; the rows follow the KV and aux, to every decode rank.
    pub fn set_state_indices(&self, room: u64, rows: &[u64]) -> Result<()> {
        if rows.len() != self.shared().cfg.state.len() {
            return Err(Error::invalid(format!(
                "room {room}: {} state rows given for {} state buffers",
                rows.len(),
                self.shared().cfg.state.len()
            )));
        }
        for (i, (&row, b)) in rows.iter().zip(&self.shared().cfg.state).enumerate() {
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
        match &self.inner {
            Inner::Prefill(p) => {
                let mut pr = lock(&p.prefill_rooms);
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
            Inner::Decode(d) => {
                let mut d = lock(&d.decode_rooms);
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
        let shared = self.shared();
        let attempt = lock(&shared.rooms).get(room)?.attempt;
        let fenced = lock(&shared.rooms).abort(room, attempt)?;
        shared.cv.notify_all();
        let p = match &self.inner {
            Inner::Prefill(p) => p,
            Inner::Decode(d) => {
                // the dummy targets too: their rooms wait for nothing then
                let targets = lock(&d.decode_rooms)
                    .get(&room)
                    .map(|r| [r.targets.as_slice(), r.dummies.as_slice()].concat())
                    .unwrap_or_default();
                for t in &targets {
                    let _ = t.writer.send(&CtlMsg::Abort { room, attempt });
                }
                return Ok(self.is_fenced(room));
            }
        };
        // the decode ranks of the room learn it now rather than at their timeout
        let failure = lock(&shared.rooms)
            .get(room)
            .ok()
            .and_then(|r| r.failure.clone());
        notify_decode(p, room, false, failure);
        Ok(fenced)
    }

    /// Prefill: the `decode_prefix_len` the decode ranks sent for the room,
    /// once their metadata has arrived (`None` before, or for an unknown room;
    /// 0 at once on a dummy CP rank, which no decode rank contacts; the
    /// decode's prefix in a room whose decode named this rank a dummy target).
    /// The prefill's chunks start right after it: SGLang's
    /// `pop_decode_prefix_len` reads it to skip the prefix the decode holds.
    pub fn decode_prefix_len(&self, room: u64) -> Option<u64> {
        let Inner::Prefill(p) = &self.inner else {
            return None;
        };
        // a dummy CP rank hears from no decode: it sends nothing, from position 0
        if p.cp_sender().is_dummy() {
            return lock(&p.prefill_rooms).get(&room).map(|_| 0);
        }
        lock(&p.prefill_rooms)
            .get(&room)
            .and_then(|r| r.infos.first().map(|m| m.prefix).or(r.dummy_prefix))
    }

    /// True when no write for an aborted room can still land in local memory
    /// (decode: every live prefill rank acknowledged the abort; a dead one cannot write).
    pub fn is_fenced(&self, room: u64) -> bool {
        if let Inner::Decode(dec) = &self.inner {
            let d = lock(&dec.decode_rooms);
            let acked = d.get(&room).is_none_or(|r| {
                r.abort_acks
                    >= r.targets
                        .iter()
                        .filter(|t| t.alive.load(Ordering::Acquire))
                        .count()
            });
            drop(d);
            // transport nccl: this side's own recvs for the room stopped too
            return acked && dec.nccl.idle(room);
        }
        lock(&self.shared().rooms).is_fenced(room)
    }

    /// Bytes received for a decode room (from the prefill ranks' completion records).
    pub fn room_bytes(&self, room: u64) -> u64 {
        let Inner::Decode(d) = &self.inner else {
            return 0;
        };
        lock(&d.decode_rooms).get(&room).map_or(0, |r| r.bytes)
    }

    /// The transport the data of this engine moves over (decode: as chosen by the prefill).
    pub fn transport(&self) -> TransportKind {
        self.shared().cfg.transport
    }

    /// Deregisters from the bootstrap and stops the threads.
    pub fn close(&self) {
        let shared = self.shared();
        shared.closed.store(true, Ordering::Release);
        if let Some(r) = lock(&shared.registrar).take() {
            let _ = r.deregister();
        }
        match &self.inner {
            Inner::Prefill(p) => {
                for l in lock(&p.decode_links).drain(..) {
                    l.writer.shutdown();
                    l.data().close();
                }
                // NCCL waits abort
                p.nccl.close();
            }
            Inner::Decode(d) => {
                for (_, l) in lock(&d.prefill_links).drain() {
                    l.writer.shutdown();
                }
                // NCCL waits abort, the decode's NCCL threads are joined
                d.nccl.close();
            }
        }
        shared.agent.shutdown();
    }

    /// The prefill's state, or the error of a call that belongs to a prefill
    /// engine (closed engines refuse every role call).
    fn prefill(&self) -> Result<&Arc<Prefill>> {
        self.shared().require(Role::Prefill)?;
        match &self.inner {
            Inner::Prefill(p) => Ok(p),
            Inner::Decode(_) => unreachable!("a decode engine's role is decode"),
        }
    }

    /// The decode's state, or the error of a call that belongs to a decode engine.
    fn decode(&self) -> Result<&Arc<Decode>> {
        self.shared().require(Role::Decode)?;
        match &self.inner {
            Inner::Decode(d) => Ok(d),
            Inner::Prefill(_) => unreachable!("a prefill engine's role is prefill"),
        }
    }

    /// Prefill: opens room `room`; it becomes `WaitingForInput` once every
    /// decode rank that targets this rank sent its metadata.
    pub fn sender(&self, room: u64) -> Result<()> {
        self.prefill()?.sender(room)
    }

    /// Prefill: the request's page count after the decode prefix (SGLang's
    /// `num_kv_indices`), before its first chunk. An attention CP rank in
    /// all-CP-ranks mode needs it to send its share
    /// ([`cp_page_bounds`](crate::layout::cp_page_bounds)); elsewhere it is
    /// kept and unused.
    pub fn set_request_pages(&self, room: u64, total_pages: u64) -> Result<()> {
        self.prefill()?.set_request_pages(room, total_pages)
    }

    /// Prefill: queues a chunk of the request: this rank's `pages` holding
    /// `num_tokens` tokens (only the last page may be partial), in order (with
    /// prefill DCP: this rank's local pages, `num_tokens` counting sequence
    /// positions, `page_size * dcp_size` per page);
    /// `last` marks the final chunk, after which the aux row `aux_index` follows.
    /// The rows must be complete when `send` is called: see
    /// [`send_with`](Self::send_with) for sends ordered after the caller's compute.
    pub fn send(
        &self,
        room: u64,
        pages: &[u64],
        num_tokens: u64,
        last: bool,
        aux_index: u64,
    ) -> Result<()> {
        self.send_with(
            room,
            pages,
            num_tokens,
            last,
            aux_index,
            &SendOptions::default(),
        )
    }

    /// Prefill: [`send`](Self::send) with [`SendOptions`]: ordered after a
    /// CUDA event (device pools) or a ready flag (host pools) instead of
    /// needing complete rows, and/or for a range of layers only.
    ///
    /// Layer-wise, a chunk is sent over many calls, each with the same
    /// `pages`, `num_tokens`, `last` and `aux_index` and the next layers
    /// (`0..a`, `a..b`, ..., `..n` for the `n` topology entries); the decode
    /// sees one room and one completion after every layer of every chunk and
    /// the aux and state rows landed, as with whole-chunk sends. A layer sent
    /// twice or skipped, another chunk or a whole-chunk send while layers of
    /// one are missing, are refused with `layer_order` and change nothing.
    pub fn send_with(
        &self,
        room: u64,
        pages: &[u64],
        num_tokens: u64,
        last: bool,
        aux_index: u64,
        opts: &SendOptions,
    ) -> Result<()> {
        self.prefill()?
            .send_with(room, pages, num_tokens, last, aux_index, opts)
    }

    /// Decode: opens room `room` against the prefill instance's data-parallel
    /// group `prefill_dp`: resolves the prefill ranks from current bootstrap
    /// entries, connects (once per peer instance) and re-checks each peer.
    pub fn receiver(&self, room: u64, prefill_dp: u32, timeout: Option<Duration>) -> Result<()> {
        self.decode()?.receiver(room, prefill_dp, timeout)
    }

    /// Decode: tells every target prefill rank where the request's KV goes.
    pub fn send_metadata(
        &self,
        room: u64,
        dst_pages: &[u64],
        decode_prefix_len: u64,
        aux_index: u64,
    ) -> Result<()> {
        self.decode()?
            .send_metadata(room, dst_pages, decode_prefix_len, aux_index)
    }
}

impl Engine {
    /// The telemetry of a live room (finished or not; gone once cleared):
    /// `UnknownRoom` for a room this engine does not hold.
    pub fn telemetry(&self, room: u64) -> Result<RoomTelemetry> {
        let (attempt, state, created, t) = {
            let rooms = lock(&self.shared().rooms);
            let r = rooms.get(room)?;
            (r.attempt, r.poll, r.created, r.times)
        };
        let prefill = matches!(self.inner, Inner::Prefill(_));
        let bytes = match &self.inner {
            Inner::Prefill(p) => lock(&p.prefill_rooms)
                .get(&room)
                .filter(|r| r.attempt == attempt)
                .map_or(0, |r| r.infos.iter().map(|m| m.bytes).sum()),
            Inner::Decode(d) => lock(&d.decode_rooms)
                .get(&room)
                .filter(|r| r.attempt == attempt)
                .map_or(0, |r| r.bytes),
        };
        let age = created.elapsed();
        let created_unix_ns = SystemTime::now()
            .checked_sub(age)
            .and_then(|c| c.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        let since = |i: Option<Instant>| i.map(|i| i.saturating_duration_since(created));
        Ok(RoomTelemetry {
            room,
            attempt,
            state,
            created_unix_ns,
            queued: since(t.queued),
            planned: since(t.planned),
            first_byte: since(t.first_byte),
            last_ack: since(t.last_ack),
            bytes,
            batches: prefill.then_some(t.batches),
            retries: prefill.then_some(t.retries),
            transport: t.transport.map(str::to_string),
        })
    }
}

impl Engine {
    /// Every metric of the engine now (cheap: the room table's lock is
    /// held while its live rooms are counted, the link registry's while the
    /// links' counters are read; neither while the other is taken).
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        let inner = self.shared();
        let (rooms, totals) = lock(&inner.rooms).totals();
        let len = |rs: &[RegionDesc]| rs.iter().map(|r| r.len).sum::<u64>();
        let staging_bytes: u64 = inner.staging.iter().map(|(_, d)| d.len).sum();
        let mut registered = BTreeMap::new();
        registered.insert("kv", len(&inner.pool_regions));
        registered.insert("aux", len(&inner.aux_regions));
        registered.insert("state", len(&inner.state_regions));
        registered.insert("staging", staging_bytes);
        let known: u64 = registered.values().sum();
        let all: u64 = inner
            .agent
            .registry()
            .descriptors()
            .iter()
            .map(|r| r.len)
            .sum();
        // device staging, the tcp receiver's bounce buffers, ...
        registered.insert("other", all.saturating_sub(known));
        let mut s = MetricsSnapshot::new(
            inner.cfg.role,
            &inner.cfg.cluster,
            rooms,
            totals,
            &inner.metrics,
            staging_bytes,
            registered,
        );
        s.room_grants_held = inner.agent.room_grants_held() as u64;
        s
    }

    /// The engine's metrics as Prometheus text (format 0.0.4).
    pub fn metrics(&self) -> String {
        self.metrics_snapshot().to_prometheus()
    }

    /// Where the `/metrics` responder listens (`metrics_listen` set), with
    /// the port it picked for `:0`.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.shared().metrics_addr
    }
}
