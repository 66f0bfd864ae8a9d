//! A room whose decode rank named this prefill rank a dummy target
//! (`CtlMsg::DummyMeta`: a TP replica of MLA KV that another prefill rank
//! sends): `WaitingForInput` once the notice is in, no data sent, `Success`
//! with its last chunk (as a dummy CP rank's rooms, `cp`). A notice that
//! arrives before `sender` is parked with the other early metadata.

use super::{Prefill, PrefillRoom};
use crate::engine::room::KvPoll;
use crate::engine::state::lock;
use std::collections::HashMap;
use std::sync::MutexGuard;

impl Prefill {
    /// Records that the decode (whose prefix is `prefix`) needs nothing
    /// from this rank in `room`, which is in `pr`; the room waits for input
    /// at once unless a decode rank also sent real metadata for it. Takes
    /// the `prefill_rooms` guard and releases it before `rooms`.
    pub(super) fn add_dummy_meta(
        &self,
        mut pr: MutexGuard<'_, HashMap<u64, PrefillRoom>>,
        room: u64,
        prefix: u64,
    ) {
        let Some(r) = pr.get_mut(&room) else { return };
        r.dummy_prefix = Some(prefix);
        let (attempt, real) = (r.attempt, !r.infos.is_empty());
        drop(pr);
        if !real {
            lock(&self.rooms).update(room, attempt, KvPoll::WaitingForInput);
            self.cv.notify_all();
        }
    }

    /// True when every decode rank that spoke of `room` named this rank a
    /// dummy target: its chunks move nothing.
    pub(super) fn is_dummy_room(&self, room: u64) -> bool {
        lock(&self.prefill_rooms)
            .get(&room)
            .is_some_and(|r| r.infos.is_empty() && r.dummy_prefix.is_some())
    }
}
