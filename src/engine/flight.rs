//! [`Flight`]: the batches of one chunk in flight together, each one of its
//! room's fenced writes, and the host staging slots they read.

use super::handle::lock;
use super::prefill::DecodeLink;
use super::room::RoomTable;
use crate::error::{Error, Result};
use crate::transport::{BatchId, BatchOptions, WriteOp};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A transport error of one batch, naming the room and the decode rank.
fn write_error(room: u64, link: &DecodeLink, e: &Error) -> Error {
    Error::new(
        e.status(),
        format!(
            "writing room {room} to decode rank instance {}: {}",
            link.hello.instance_id,
            e.detail()
        ),
    )
}

/// One submitted batch of a [`Flight`]: its link, its id, and the host
/// staging slot it reads (`None`: it reads the caller's memory only).
struct InFlight {
    link: Arc<DecodeLink>,
    id: BatchId,
    slot: Option<usize>,
}

/// The batches of one chunk in flight together, over every decode rank's
/// link. Each is one of the room's writes in flight (`begin_write` before
/// its submit, `end_write` once waited), so an abort stays fenced until
/// every one completed; a host staging slot is waited free before it is
/// gathered into again ([`Flight::free_slot`]); and nothing outlives the
/// chunk: [`Flight::drain`] waits for them all (dropping a flight does too).
pub(super) struct Flight<'a> {
    /// The engine's rooms: each batch is one of its room's writes in flight.
    rooms: &'a Mutex<RoomTable>,
    pub(super) opts: BatchOptions,
    pending: Vec<InFlight>,
    /// Slots handed out so far (the next slot is this modulo the slot count).
    turns: usize,
}

impl<'a> Flight<'a> {
    pub(super) fn new(rooms: &'a Mutex<RoomTable>, opts: BatchOptions) -> Flight<'a> {
        Flight {
            rooms,
            opts,
            pending: Vec::new(),
            turns: 0,
        }
    }

    /// Submits `ops` over `link` without waiting (nothing for no ops).
    pub(super) fn submit(
        &mut self,
        link: &Arc<DecodeLink>,
        ops: &[WriteOp],
        slot: Option<usize>,
    ) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let (room, epoch) = (self.opts.room, self.opts.epoch);
        lock(self.rooms).begin_write(room, epoch)?;
        match link.data.submit(ops, &self.opts) {
            Ok(id) => {
                self.pending.push(InFlight {
                    link: link.clone(),
                    id,
                    slot,
                });
                Ok(())
            }
            Err(e) => {
                lock(self.rooms).end_write(room, epoch);
                Err(write_error(room, link, &e))
            }
        }
    }

    /// Waits for the `i`-th pending batch (removed either way).
    fn wait_at(&mut self, i: usize) -> Result<()> {
        let b = self.pending.remove(i);
        let r = b
            .link
            .data
            .wait(b.id, self.opts.timeout + Duration::from_secs(1));
        lock(self.rooms).end_write(self.opts.room, self.opts.epoch);
        r.map(|_| ())
            .map_err(|e| write_error(self.opts.room, &b.link, &e))
    }

    /// The next of `slots` staging slots in turn, waited free (every batch
    /// that reads it completed).
    pub(super) fn next_slot(&mut self, slots: usize) -> Result<usize> {
        let slot = self.turns % slots.max(1);
        self.turns += 1;
        self.free_slot(slot)?;
        Ok(slot)
    }

    /// Waits for every pending batch that reads staging slot `slot`.
    fn free_slot(&mut self, slot: usize) -> Result<()> {
        while let Some(i) = self.pending.iter().position(|b| b.slot == Some(slot)) {
            self.wait_at(i)?;
        }
        Ok(())
    }

    /// Waits for every pending batch, oldest first; the first failure is
    /// returned once all of them completed or failed.
    pub(super) fn drain(&mut self) -> Result<()> {
        let mut first = None;
        while !self.pending.is_empty() {
            if let Err(e) = self.wait_at(0) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        // only after a panic mid-chunk: `run_job` drains every flight
        let _ = self.drain();
    }
}
