//! The decode role: its state ([`Decode`]), rooms opened by `receiver`
//! against the prefill ranks, the metadata (and room grants) sent to them.
//!
//! - `nccl`: the decode side of transport nccl (the NCCL thread of each
//!   prefill link; a stub without the `nccl` feature);
//! - `reader`: the control link to each prefill rank (dialled, authenticated,
//!   checked) and its reader (statuses, abort acknowledgements, NCCL
//!   messages, disconnects).

mod dummy;
#[cfg(feature = "nccl")]
mod nccl;
mod reader;
#[cfg(test)]
mod tests;

use super::control::{CtlMsg, MetaGrant};
use super::link::PrefillLink;
use super::nccl_link::NcclLinks;
use super::room::KvPoll;
use super::room::RoomTimes;
use super::room_grants::room_ranges;
use super::state::{lock, peer_names, Shared};
use crate::auth::PeerInstance;
use crate::bootstrap::peer::prefill_targets;
use crate::bootstrap::schema::InstanceId;
use crate::error::{Error, Result, Status};
use std::collections::{BTreeSet, HashMap};
use std::ops::Deref;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A room's control links to prefill ranks.
type Links = Vec<Arc<PrefillLink>>;

/// Decode-side room data beyond the state machine.
pub(super) struct DecodeRoom {
    pub(super) attempt: u64,
    pub(super) targets: Vec<Arc<PrefillLink>>,
    /// The prefill ranks the rank mapping names dummy targets of the room
    /// (told that nothing is needed from them, and of an abort; never
    /// waited for).
    pub(super) dummies: Vec<Arc<PrefillLink>>,
    pub(super) responded: BTreeSet<u32>,
    pub(super) bytes: u64,
    pub(super) abort_acks: usize,
    pub(super) state_indices: Vec<u64>,
    /// The room's grants to its prefill ranks: (prefill instance, token).
    pub(super) grants: Vec<(u128, u64)>,
    /// What this decode named for the room in its last `send_metadata`
    /// (transport nccl checks each chunk against it).
    pub(super) named: Option<NamedPages>,
}

/// The decode pages and prefix a decode named for a room.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(super) struct NamedPages {
    pub(super) dst_pages: Vec<u64>,
    pub(super) decode_prefix_len: u64,
}

/// A decode engine's state: the [`Shared`] state and the decode's own.
///
/// # Lock order
///
/// `decode_rooms` and `prefill_links` are never held while another engine
/// lock is taken, nor taken under one (nor are the shared `rooms` and
/// `registrar`); the `nccl` state's locks are leaves too. No control socket
/// is written under any of them except a control writer's own lock.
pub(super) struct Decode {
    pub(super) shared: Shared,
    pub(super) decode_rooms: Mutex<HashMap<u64, DecodeRoom>>,
    pub(super) prefill_links: Mutex<HashMap<(InstanceId, u64), Arc<PrefillLink>>>,
    /// Transport nccl: the decode's NCCL receivers and their threads.
    pub(super) nccl: NcclLinks,
}

impl Deref for Decode {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}

impl Decode {
    /// A decode engine over `shared`, with no room and no prefill link yet.
    pub(super) fn new(shared: Shared) -> Decode {
        Decode {
            shared,
            decode_rooms: Mutex::new(HashMap::new()),
            prefill_links: Mutex::new(HashMap::new()),
            nccl: Default::default(),
        }
    }

    /// Fails the room's `attempt` with `e` (its grants revoked) and logs it
    /// with the room's prefill ranks (`rooms` is not held).
    pub(super) fn fail_room(&self, room: u64, attempt: u64, e: Error) {
        let peers = self.room_peers(room);
        self.revoke_room_grants(room, None);
        self.shared.fail_room_with(room, attempt, e, &peers);
    }

    /// Decode: revokes the grants of `room` (every attempt) issued to the
    /// prefill instance `only`, or to all of them.
    pub(super) fn revoke_room_grants(&self, room: u64, only: Option<u128>) {
        let tokens: Vec<u64> = {
            let mut d = lock(&self.decode_rooms);
            let Some(r) = d.get_mut(&room) else { return };
            let mut taken = Vec::new();
            r.grants.retain(|&(inst, token)| {
                let hit = only.is_none_or(|o| o == inst);
                if hit {
                    taken.push(token);
                }
                !hit
            });
            taken
        };
        for t in tokens {
            self.agent.revoke_room(t);
        }
    }

    /// The room's prefill ranks, for log lines (takes and releases `decode_rooms`).
    pub(super) fn room_peers(&self, room: u64) -> String {
        peer_names(
            lock(&self.decode_rooms)
                .get(&room)
                .map(|r| {
                    r.targets
                        .iter()
                        .map(|t| t.registration.instance_id.to_string())
                        .collect()
                })
                .unwrap_or_default(),
        )
    }

    /// [`Engine::receiver`](crate::engine::Engine::receiver) (the role checked).
    pub(super) fn receiver(
        self: &Arc<Self>,
        room: u64,
        prefill_dp: u32,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let attempt = self.create_room(room, timeout)?;
        let r = (|| -> Result<(Links, Links)> {
            let local = self.registration()?;
            let targets = prefill_targets(self.store.as_ref(), &local, prefill_dp)?;
            let mut links = Vec::new();
            for t in targets.iter().filter(|t| !t.dummy) {
                links.push(self.prefill_link(&t.registration, &local)?);
            }
            Ok((links, self.dummy_links(room, &targets, &local)))
        })();
        match r {
            Ok((links, dummies)) => {
                lock(&self.decode_rooms).insert(
                    room,
                    DecodeRoom {
                        attempt,
                        targets: links,
                        dummies,
                        responded: BTreeSet::new(),
                        bytes: 0,
                        abort_acks: 0,
                        state_indices: Vec::new(),
                        grants: Vec::new(),
                        named: None,
                    },
                );
                Ok(())
            }
            Err(e) => {
                self.fail_room(room, attempt, e.clone());
                Err(e)
            }
        }
    }

    /// [`Engine::send_metadata`](crate::engine::Engine::send_metadata) (the role checked).
    pub(super) fn send_metadata(
        &self,
        room: u64,
        dst_pages: &[u64],
        decode_prefix_len: u64,
        aux_index: u64,
    ) -> Result<()> {
        let lay = self.cfg.topology.dcp_layout()?;
        if !decode_prefix_len.is_multiple_of(lay.virtual_page()) {
            return Err(Error::new(
                Status::PrefixMisaligned,
                format!(
                    "decode_prefix_len {decode_prefix_len} must be a multiple of the virtual DCP page {} (page_size {} x dcp_size {}); round the reusable prefix down to {}",
                    lay.virtual_page(), lay.page_size, lay.dcp_size, decode_prefix_len / lay.virtual_page() * lay.virtual_page()
                ),
            ));
        }
        self.cfg.check_pages(dst_pages, "dst_pages", "decode")?;
        if let Some(a) = self.cfg.aux.first() {
            if aux_index >= a.count {
                return Err(Error::new(
                    Status::OutOfBounds,
                    format!("aux_index {aux_index} is outside the {} aux rows", a.count),
                ));
            }
        }
        let (attempt, targets, dummies) = {
            let d = lock(&self.decode_rooms);
            let r = d.get(&room).ok_or_else(|| {
                Error::new(
                    Status::UnknownRoom,
                    format!("room {room}: call receiver() first"),
                )
            })?;
            (r.attempt, r.targets.clone(), r.dummies.clone())
        };
        let state_indices = lock(&self.decode_rooms)
            .get(&room)
            .map(|r| r.state_indices.clone())
            .unwrap_or_default();
        let required = {
            let local = self.registration()?;
            let any = targets.first().map(|t| t.registration.topology.clone());
            match any {
                Some(p) => {
                    crate::layout::resolve_rank_mapping(&local.topology, &p, Default::default())?
                        .required_dst_info_num
                }
                None => 1,
            }
        };
        let timeout_ms = lock(&self.rooms)
            .get(room)
            .ok()
            .and_then(|r| r.deadline)
            .map_or(0, |d| {
                d.saturating_duration_since(Instant::now()).as_millis() as u64
            });
        // stamped before the first Meta leaves: the room may succeed before the loop ends
        if let Some(t) = lock(&self.rooms).times_mut(room, attempt) {
            RoomTimes::stamp(&mut t.queued, Instant::now());
            t.transport.get_or_insert(self.cfg.transport.name());
        }
        let ranges = room_ranges(
            &self.region_map(),
            &self.cfg.topology,
            dst_pages,
            aux_index,
            &state_indices,
        )?;
        let grant_for = if timeout_ms > 0 {
            Duration::from_millis(timeout_ms)
        } else {
            self.cfg.room_timeout
        };
        // a new Meta for the room replaces its grants
        self.revoke_room_grants(room, None);
        // recorded before any prefill can act on it
        if let Some(r) = lock(&self.decode_rooms)
            .get_mut(&room)
            .filter(|r| r.attempt == attempt)
        {
            r.named = Some(NamedPages {
                dst_pages: dst_pages.to_vec(),
                decode_prefix_len,
            });
        }
        for t in &targets {
            let inst = t.registration.instance_id.0;
            let grant = if !self.cfg.room_grants {
                None
            } else {
                match self.agent.grant_room(
                    PeerInstance(inst.to_be_bytes()),
                    room,
                    attempt,
                    &ranges,
                    grant_for,
                ) {
                    Ok(g) => Some(g),
                    Err(e) => {
                        self.revoke_room_grants(room, None);
                        self.fail_room(room, attempt, e.clone());
                        return Err(e);
                    }
                }
            };
            if let (Some(g), Some(r)) = (&grant, lock(&self.decode_rooms).get_mut(&room)) {
                r.grants.push((inst, g.token));
            }
            let m = CtlMsg::Meta {
                room,
                attempt,
                dst_pages: dst_pages.to_vec(),
                decode_prefix_len,
                aux_index,
                state_indices: state_indices.clone(),
                required_dst_info_num: required,
                timeout_ms,
                grant: grant.map(|g| MetaGrant {
                    token: g.token,
                    epoch: g.epoch,
                    grantee: g.grantee,
                    expires_in_ms: g.expires_in_ms,
                }),
            };
            if let Err(e) = t.writer.send(&m) {
                let e = Error::new(
                    e.status(),
                    format!(
                        "sending metadata to prefill {}: {}",
                        t.registration.describe(),
                        e.detail()
                    ),
                );
                self.fail_room(room, attempt, e.clone());
                return Err(e);
            }
        }
        self.tell_dummies(room, attempt, decode_prefix_len, &dummies);
        lock(&self.rooms).update(room, attempt, KvPoll::WaitingForInput);
        Ok(())
    }
}

/// Without the `nccl` feature no message is acted on.
#[cfg(not(feature = "nccl"))]
mod nccl {
    use crate::engine::control::CtlMsg;
    use crate::engine::link::PrefillLink;

    /// Without the `nccl` feature no message is acted on.
    pub(in crate::engine) fn on_prefill_message<T>(
        _inner: &T,
        _link: &std::sync::Arc<PrefillLink>,
        _m: CtlMsg,
    ) {
    }
}
