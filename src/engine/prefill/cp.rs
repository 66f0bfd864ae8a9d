//! A prefill rank inside an attention CP group: the rooms of a dummy rank
//! (rank-0 mode, CP rank != 0), which conclude here without a decode, and the
//! page share an all-CP-ranks sender moves of each chunk.

use super::Prefill;
use crate::engine::room::KvPoll;
use crate::engine::state::lock;
use crate::error::{Error, Result, Status};
use crate::layout::CpSender;

impl Prefill {
    /// This rank's place in its CP group.
    pub(in crate::engine) fn cp_sender(&self) -> CpSender {
        CpSender::of(&self.cfg.topology)
    }

    /// A dummy CP rank's room needs no decode metadata: no decode rank
    /// contacts it, so it is `WaitingForInput` at once (SGLang's dummy sender).
    pub(super) fn open_dummy_cp_room(&self, room: u64, attempt: u64) {
        if self.cp_sender().is_dummy() {
            lock(&self.rooms).update(room, attempt, KvPoll::WaitingForInput);
            self.cv.notify_all();
        }
    }

    /// Records the request's page count after the decode prefix, which an
    /// all-CP-ranks sender needs before its first chunk to know its pages.
    pub(in crate::engine) fn set_request_pages(&self, room: u64, total_pages: u64) -> Result<()> {
        let mut pr = lock(&self.prefill_rooms);
        let r = pr.get_mut(&room).ok_or_else(|| {
            Error::new(
                Status::UnknownRoom,
                format!("room {room}: call sender() first"),
            )
        })?;
        if r.sent_positions > 0 || r.queued_last {
            return Err(Error::invalid(format!(
                "room {room}: the request's page count is set before its first chunk"
            )));
        }
        r.total_pages = Some(total_pages);
        Ok(())
    }

    /// Refuses a chunk an all-CP-ranks sender cannot place: before the
    /// request's page count is known, or past it. Called before the room's
    /// state moves, so a refused send changes nothing.
    pub(super) fn check_cp_chunk(&self, room: u64, pages: usize) -> Result<()> {
        let cp = self.cp_sender();
        if !cp.all_ranks_send() {
            return Ok(());
        }
        let vs = self.cfg.topology.dcp_layout()?.virtual_page();
        let pr = lock(&self.prefill_rooms);
        let Some(r) = pr.get(&room) else {
            return Ok(()); // the send's own checks name the room
        };
        let Some(total) = r.total_pages else {
            return Err(Error::invalid(format!(
                "room {room}: attention CP rank {} of {} sends its share of the request's pages: give the request's page count after the decode prefix (set_request_pages) before the first chunk",
                cp.cp_rank, cp.cp_size
            )));
        };
        let off = r.sent_positions / vs;
        if r.layer_chunk.is_none() && off + pages as u64 > total {
            return Err(Error::invalid(format!(
                "room {room}: the chunk's pages {off}..{} run past the request's {total} pages",
                off + pages as u64
            )));
        }
        Ok(())
    }

    /// What this rank moves of a queued chunk (`pages` from position
    /// `start`, `num_tokens` tokens): all of it without CP or on CP rank 0
    /// in rank-0 mode; its page share in all-CP-ranks mode (the final chunk
    /// is queued even when empty, as it carries the status, and on CP rank 0
    /// the aux and state rows); nothing on a dummy CP rank or in a room
    /// whose decode named this rank a dummy target, which concludes
    /// `Success` with its last chunk. `None`: no job to queue.
    pub(super) fn cp_share(
        &self,
        room: u64,
        attempt: u64,
        pages: &[u64],
        start: u64,
        num_tokens: u64,
        room_done: bool,
    ) -> Result<Option<(Vec<u64>, u64, u64)>> {
        let cp = self.cp_sender();
        if cp.is_dummy() || self.is_dummy_room(room) {
            if room_done {
                lock(&self.rooms).update(room, attempt, KvPoll::Success);
                self.cv.notify_all();
            }
            return Ok(None);
        }
        if !cp.all_ranks_send() {
            return Ok(Some((pages.to_vec(), start, num_tokens)));
        }
        let vs = self.cfg.topology.dcp_layout()?.virtual_page();
        let (total, prefix) = {
            let pr = lock(&self.prefill_rooms);
            let r = pr
                .get(&room)
                .ok_or_else(|| Error::new(Status::UnknownRoom, format!("room {room}")))?;
            (
                r.total_pages.unwrap_or(0),
                r.infos.first().map_or(0, |m| m.prefix),
            )
        };
        let off = (start - prefix) / vs;
        let share = cp.share(total, vs, prefix, off, pages.len() as u64, num_tokens)?;
        if share.num_tokens == 0 && !room_done {
            lock(&self.rooms).update(room, attempt, KvPoll::Transferring);
            return Ok(None);
        }
        Ok(Some((
            pages[share.pages.clone()].to_vec(),
            share.start,
            share.num_tokens,
        )))
    }
}
