//! The prefill role: its state ([`Prefill`]: rooms opened by `sender` and
//! fed by `send`, the decode ranks linked to this rank, the job queue), the
//! metadata of each decode rank, and the final status sent back.
//!
//! - `accept`: the control listener and one connection per decode rank
//!   (handshake, metadata, aborts);
//! - `jobs`: the job queue (a room's chunks in order, a decode rank on one
//!   worker at a time, so a stalled one delays only its rooms);
//! - `worker`: the transfer workers (a chunk planned and written through
//!   each link's write path, then completed);
//! - `resume`: a room resumed over tcp on a new connection after its data
//!   connection broke in its middle (only what did not land is sent again).

mod accept;
mod cp;
mod dummy;
pub(super) mod jobs;
mod resume;
#[cfg(test)]
mod tests;
pub(super) mod worker;

pub(super) use accept::accept_loop;

use super::control::CtlMsg;
use super::layers::{check_next, LayerChunk, LayerPlan, Ready, SendOptions};
use super::link::DecodeLink;
use super::nccl_link::NcclLinks;
use super::path::spread::CopyCrew;
use super::path::Conn;
use super::room::KvPoll;
use super::state::{lock, peer_names, Shared};
use crate::error::{Error, Result, Status};
use crate::layout::prefill_unique_rank;
use crate::transport::room::RoomGrant;
use crate::transport::{ConnectOptions, WriteOp};
use jobs::{Job, JobQueue};
use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What one decode rank asked for in one room.
#[derive(Clone)]
pub(super) struct MetaInfo {
    pub(super) link: Arc<DecodeLink>,
    pub(super) attempt: u64,
    pub(super) dst_pages: Vec<u64>,
    pub(super) prefix: u64,
    pub(super) aux_index: u64,
    pub(super) state_indices: Vec<u64>,
    pub(super) required: u32,
    pub(super) bytes: u64,
    pub(super) arrived: Instant,
    /// The room's grant on this decode rank (its batches then skip the
    /// per-batch round trip where the data connection supports grants).
    pub(super) grant: Option<RoomGrant>,
    /// The decode rank needs nothing from this rank in the room (a dummy
    /// TP target, `CtlMsg::DummyMeta`): only `link`, `attempt`, `prefix`
    /// and `arrived` are set.
    pub(super) dummy: bool,
}

/// Prefill-side room data beyond the state machine.
#[derive(Default)]
pub(super) struct PrefillRoom {
    pub(super) attempt: u64,
    pub(super) infos: Vec<MetaInfo>,
    pub(super) sent_positions: u64,
    pub(super) queued_last: bool,
    pub(super) abort_pending: Vec<(Arc<DecodeLink>, u64)>,
    pub(super) state_indices: Vec<u64>,
    /// A chunk sent layer by layer whose layers are still arriving.
    pub(super) layer_chunk: Option<LayerChunk>,
    /// That chunk's plan toward every decode rank (made by the worker).
    pub(super) layer_plan: Option<Arc<LayerPlan>>,
    /// The request's page count after the decode prefix (all-CP-ranks mode).
    pub(super) total_pages: Option<u64>,
    /// The decode prefix a decode rank named when it told this rank that it
    /// needs nothing from it in the room (`dummy`).
    pub(super) dummy_prefix: Option<u64>,
    /// The writes of the room sent over tcp so far, per decode rank (by
    /// instance id): what a redial in the middle of the room sends again
    /// where it did not land (`resume`).
    pub(in crate::engine) tcp_sent: HashMap<u128, Vec<WriteOp>>,
}

/// A prefill engine's state: the [`Shared`] state and the prefill's own.
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
/// `decode_links`, the job queue and the shared `rooms` and `registrar` are
/// never held while another of these is taken, nor taken under one. The
/// `nccl` state's locks are leaves too, except a link's NCCL sender (held
/// by the one worker moving that link's chunk), under which `rooms`,
/// `decode_links` and `nccl`'s answers are taken. No control socket is
/// written under any of them except a control writer's own lock
/// (`CtlWriter::send`, `shutdown`), which takes none: a stuck decode socket
/// then stalls only the thread writing to it (`notify_decode` copies the
/// room's links out of `prefill_rooms` before it writes).
pub(super) struct Prefill {
    pub(super) shared: Shared,
    pub(super) prefill_rooms: Mutex<HashMap<u64, PrefillRoom>>,
    pub(super) pending_meta: Mutex<HashMap<u64, Vec<MetaInfo>>>,
    pub(super) decode_links: Mutex<Vec<Arc<DecodeLink>>>,
    pub(super) jobs: Arc<JobQueue>,
    /// Transport nccl: each decode link's sending end, the decode's answers.
    pub(super) nccl: NcclLinks,
    /// The one-copy path's helper threads (started at its first pair).
    pub(in crate::engine) copy_crew: CopyCrew,
}

impl Deref for Prefill {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}

impl Prefill {
    /// A prefill engine over `shared`, with no room and no decode link yet.
    pub(super) fn new(shared: Shared) -> Prefill {
        Prefill {
            shared,
            prefill_rooms: Mutex::new(HashMap::new()),
            pending_meta: Mutex::new(HashMap::new()),
            decode_links: Mutex::new(Vec::new()),
            jobs: Arc::new(JobQueue::default()),
            nccl: Default::default(),
            copy_crew: CopyCrew::default(),
        }
    }

    /// Fails the room's `attempt` with `e` and logs it with the decode ranks
    /// that sent metadata for it (`rooms` is not held).
    pub(super) fn fail_room(&self, room: u64, attempt: u64, e: Error) {
        let peers = self.room_peers(room);
        self.shared.fail_room_with(room, attempt, e, &peers);
    }

    /// The decode ranks that sent metadata for `room`, for log lines (takes
    /// and releases `prefill_rooms`).
    pub(super) fn room_peers(&self, room: u64) -> String {
        peer_names(
            lock(&self.prefill_rooms)
                .get(&room)
                .map(|r| {
                    r.infos
                        .iter()
                        .map(|m| m.link.hello.instance_id.to_string())
                        .collect()
                })
                .unwrap_or_default(),
        )
    }

    /// [`Engine::sender`](crate::engine::Engine::sender) (the role checked):
    /// opens the room with the metadata parked for it.
    pub(super) fn sender(&self, room: u64) -> Result<()> {
        let attempt = self.create_room(room, None)?;
        // Take the parked metadata and publish the room under the prefill_rooms
        // lock (add_meta parks under it too): otherwise a Meta arriving between
        // the two steps is parked after the drain and the room never leaves
        // Bootstrapping (found by the soak run).
        let pending = {
            let mut pr = lock(&self.prefill_rooms);
            let pending = lock(&self.pending_meta).remove(&room).unwrap_or_default();
            pr.insert(
                room,
                PrefillRoom {
                    attempt,
                    ..Default::default()
                },
            );
            pending
        };
        for m in pending {
            self.add_meta(room, m);
        }
        self.open_dummy_cp_room(room, attempt);
        Ok(())
    }

    /// [`Engine::send_with`](crate::engine::Engine::send_with) (the role
    /// checked): checks the chunk against the room and its pending layers,
    /// and queues it.
    pub(super) fn send_with(
        &self,
        room: u64,
        pages: &[u64],
        num_tokens: u64,
        last: bool,
        aux_index: u64,
        opts: &SendOptions,
    ) -> Result<()> {
        let entries = self.cfg.topology.entries.len();
        let layers = opts.layer_range(entries)?;
        if opts.cuda_event.is_some() && self.cfg.pool_device.is_none() {
            return Err(Error::invalid(
                "a CUDA event orders sends from device pools; host pools take a ready flag",
            ));
        }
        let attempt;
        {
            let rooms = lock(&self.rooms);
            let r = rooms.get(room)?;
            if r.poll == KvPoll::Failed {
                return Err(Error::new(
                    Status::RoomFailed,
                    format!(
                        "room {room} failed: {}",
                        r.failure.as_ref().map_or("", |e| e.detail())
                    ),
                ));
            }
            if r.poll < KvPoll::WaitingForInput {
                return Err(Error::new(
                    Status::InvalidArgument,
                    format!(
                        "room {room} is still {:?}: poll until WaitingForInput before sending",
                        r.poll
                    ),
                ));
            }
            attempt = r.attempt;
        }
        // a page of this rank covers a virtual page of positions (P x its DCP size)
        let vs = self.cfg.topology.dcp_layout()?.virtual_page();
        let cap = pages.len() as u64 * vs;
        if num_tokens > cap {
            return Err(Error::new(
                Status::TokensExceedSource,
                format!(
                    "num_tokens={num_tokens} exceeds the {} pages given (capacity {cap} positions)",
                    pages.len()
                ),
            ));
        }
        self.cfg.check_pages(pages, "pages", "prefill")?;
        self.check_cp_chunk(room, pages.len())?;
        let start = {
            let mut pr = lock(&self.prefill_rooms);
            let r = pr
                .get_mut(&room)
                .ok_or_else(|| Error::new(Status::UnknownRoom, format!("room {room}")))?;
            let layered = opts.layers.is_some();
            let start = match &r.layer_chunk {
                Some(pending) => {
                    let chunk = (pages, num_tokens, last, aux_index);
                    check_next(
                        room,
                        pending,
                        opts.layers.as_ref().map(|_| &layers),
                        chunk,
                        entries,
                    )?;
                    pending.start
                }
                None => {
                    if r.queued_last && layered {
                        return Err(Error::new(
                            Status::LayerOrder,
                            format!(
                                "room {room}: layers {}..{}: every layer of the last chunk was already sent",
                                layers.start, layers.end
                            ),
                        ));
                    }
                    if r.queued_last {
                        return Err(Error::invalid(format!(
                            "room {room}: the last chunk was already sent"
                        )));
                    }
                    if !last && num_tokens != cap {
                        return Err(Error::invalid(format!(
                            "room {room}: only the last chunk may end in a partial page ({num_tokens} tokens in {} pages)",
                            pages.len()
                        )));
                    }
                    if layers.start != 0 {
                        return Err(Error::new(
                            Status::LayerOrder,
                            format!(
                                "room {room}: a chunk's layers start at layer 0, not {}",
                                layers.start
                            ),
                        ));
                    }
                    let prefix = r.infos.first().map_or(0, |m| m.prefix);
                    r.sent_positions += pages.len() as u64 * vs;
                    prefix + r.sent_positions - pages.len() as u64 * vs
                }
            };
            let chunk_done = layers.end == entries;
            r.layer_chunk = (layered && !chunk_done).then(|| LayerChunk {
                pages: pages.to_vec(),
                num_tokens,
                last,
                aux_index,
                start,
                next: layers.end,
            });
            let room_done = last && chunk_done;
            r.queued_last = room_done;
            (
                start,
                if room_done {
                    r.state_indices.clone()
                } else {
                    Vec::new()
                },
                r.infos
                    .iter()
                    .map(|m| Arc::as_ptr(&m.link) as usize)
                    .collect(),
                room_done,
                layered,
            )
        };
        let (start, state_indices, peers, room_done, layered) = start;
        let Some((pages, start, num_tokens)) =
            self.cp_share(room, attempt, pages, start, num_tokens, room_done)?
        else {
            return Ok(());
        };
        self.jobs.push(Job {
            room,
            attempt,
            pages,
            start,
            num_tokens,
            last: room_done,
            aux_index,
            state_indices,
            peers,
            queued: Instant::now(),
            layers,
            layered,
            ready: Ready {
                cuda_event: opts.cuda_event,
                flag: opts.ready_flag.clone(),
            },
        });
        lock(&self.rooms).update(room, attempt, KvPoll::Transferring);
        Ok(())
    }

    /// Prefill: remakes `link`'s data connection when it can no longer carry
    /// batches (an RDMA rail's QP went to the error state, which it never
    /// leaves) while the control connection lives, so one QP error fails
    /// the rooms in flight on it, not every later room of the pair. Batches
    /// still held on the old connection finish or fail on it; it closes when
    /// the last of them lets go. A failed redial leaves the broken link (the
    /// room then fails with its reason, and the next room tries again). A
    /// tcp room in flight on the broken connection resumes on the new one
    /// (`resume`). Of two threads redialling one
    /// link at once, the second's connection is dropped.
    pub(in crate::engine) fn redial_if_broken(&self, link: &DecodeLink) {
        let old = link.data();
        if old.is_alive() || !link.alive.load(Ordering::Acquire) {
            return;
        }
        let id = link.hello.instance_id;
        match self.agent.connect(
            &link.data_addr,
            &ConnectOptions {
                transport: self.cfg.data_transport(),
                fan_out: true,
                ..Default::default()
            },
        ) {
            Ok(data) => {
                log::warn!(
                    "engine: the {} data link to decode {id} broke; made a new {} connection",
                    old.kind().name(),
                    data.kind().name()
                );
                let gpu_direct = link.conn().path.gpu_direct();
                let conn = Conn::new(self, Arc::from(data), &link.regions, id, gpu_direct);
                let mut cur = lock(&link.conn);
                if Arc::ptr_eq(&cur.data, &old) {
                    *cur = conn;
                }
            }
            Err(e) => log::warn!(
                "engine: the {} data link to decode {id} broke and reconnecting failed: {e}",
                old.kind().name()
            ),
        }
    }

    /// Prefill: records one decode rank's metadata for a room.
    pub(in crate::engine) fn add_meta(&self, room: u64, m: MetaInfo) {
        let mut pr = lock(&self.prefill_rooms);
        let Some(r) = pr.get_mut(&room) else {
            // parked while prefill_rooms is held (the lock order on `Prefill`)
            lock(&self.pending_meta).entry(room).or_default().push(m);
            return;
        };
        if m.dummy {
            return self.add_dummy_meta(pr, room, m.prefix);
        }
        if let Some(first) = r.infos.first() {
            if first.prefix != m.prefix {
                let e = Error::invalid(format!(
                    "room {room}: decode ranks disagree on decode_prefix_len ({} vs {})",
                    first.prefix, m.prefix
                ));
                let a = r.attempt;
                drop(pr);
                self.fail_room(room, a, e);
                return;
            }
        }
        r.infos
            .retain(|x| x.link.hello.instance_id != m.link.hello.instance_id);
        r.infos.push(m);
        let required = r.infos.iter().map(|x| x.required).max().unwrap_or(1) as usize;
        let attempt = r.attempt;
        if r.infos.len() >= required {
            drop(pr);
            lock(&self.rooms).update(room, attempt, KvPoll::WaitingForInput);
            self.cv.notify_all();
        }
    }
}

/// Prefill: sends the room's final status to every decode rank of the room.
pub(super) fn notify_decode(inner: &Prefill, room: u64, ok: bool, err: Option<Error>) {
    let infos = lock(&inner.prefill_rooms)
        .get(&room)
        .map(|r| r.infos.clone())
        .unwrap_or_default();
    let rank = prefill_unique_rank(&inner.cfg.topology);
    for m in infos {
        let _ = m.link.writer.send(&CtlMsg::Status {
            room,
            attempt: m.attempt,
            ok,
            prefill_rank: rank,
            bytes: m.bytes,
            reason: err.as_ref().map(|e| e.detail().to_string()),
            code: err.as_ref().map(|e| e.status() as i32),
        });
    }
}
