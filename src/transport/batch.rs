//! Sender-side batch bookkeeping shared by the cma and tcp transports:
//! stages, per-batch deadlines, failure reasons, and waiting.

use super::{BatchId, BatchStatus, Completion};
use crate::error::{Error, Result, Status};
use crate::memory::AccessGuard;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Where a batch is on the sender side.
#[derive(Debug, Clone)]
pub(crate) enum Stage {
    Submitted,
    Granted,
    Written,
    Done,
    Failed(Error),
}

impl Stage {
    fn name(&self) -> &'static str {
        match self {
            Stage::Submitted => "waiting for the receiver to validate it",
            Stage::Granted => "validated, not yet written",
            Stage::Written => "written, waiting for the receiver's acknowledgement",
            Stage::Done => "done",
            Stage::Failed(_) => "failed",
        }
    }

    fn terminal(&self) -> bool {
        matches!(self, Stage::Done | Stage::Failed(_))
    }
}

struct Entry {
    stage: Stage,
    deadline: Instant,
    timeout: Duration,
    completion: Completion,
    _guards: Arc<Vec<AccessGuard>>,
}

#[derive(Default)]
struct Tbl {
    entries: HashMap<u64, Entry>,
    next: u64,
    dead: Option<Error>,
}

/// The batches of one peer connection.
#[derive(Default)]
pub(crate) struct BatchTable {
    m: Mutex<Tbl>,
    cv: Condvar,
}

impl BatchTable {
    fn lock(&self) -> MutexGuard<'_, Tbl> {
        self.m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allocates a batch id (fails when the connection is dead).
    pub fn insert(
        &self,
        timeout: Duration,
        mut completion: Completion,
        guards: Arc<Vec<AccessGuard>>,
    ) -> Result<u64> {
        let mut t = self.lock();
        if let Some(e) = &t.dead {
            return Err(e.clone());
        }
        t.next += 1;
        let id = t.next;
        completion.batch_id = BatchId(id);
        t.entries.insert(
            id,
            Entry {
                stage: Stage::Submitted,
                deadline: Instant::now() + timeout,
                timeout,
                completion,
                _guards: guards,
            },
        );
        Ok(id)
    }

    /// Moves a live batch to `stage` (ignored once terminal).
    pub fn set(&self, id: u64, stage: Stage) {
        let mut t = self.lock();
        if let Some(e) = t.entries.get_mut(&id) {
            if !e.stage.terminal() {
                e.stage = stage;
                self.cv.notify_all();
            }
        }
    }

    /// Records the checksum computed after a read landed.
    pub fn set_checksum(&self, id: u64, sum: u64) {
        if let Some(e) = self.lock().entries.get_mut(&id) {
            e.completion.checksum = Some(sum);
        }
    }

    /// Fails a live batch with `err`.
    pub fn fail(&self, id: u64, err: Error) {
        self.set(id, Stage::Failed(err));
    }

    /// Marks the connection dead and fails every live batch with `err`.
    pub fn fail_all(&self, err: Error) {
        let mut t = self.lock();
        if t.dead.is_none() {
            t.dead = Some(err.clone());
        }
        for e in t.entries.values_mut() {
            if !e.stage.terminal() {
                e.stage = Stage::Failed(err.clone());
            }
        }
        self.cv.notify_all();
    }

    /// Why a batch failed, while it is still held (not yet collected).
    pub fn failure(&self, id: u64) -> Option<Error> {
        match &self.lock().entries.get(&id)?.stage {
            Stage::Failed(e) => Some(e.clone()),
            _ => None,
        }
    }

    /// The reason the connection died, if it did.
    pub fn dead(&self) -> Option<Error> {
        self.lock().dead.clone()
    }

    fn expire(e: &mut Entry, now: Instant) {
        if !e.stage.terminal() && now >= e.deadline {
            e.stage = Stage::Failed(Error::new(
                Status::Timeout,
                format!(
                    "batch {} missed its {:?} deadline while {}",
                    e.completion.batch_id.0,
                    e.timeout,
                    e.stage.name()
                ),
            ));
        }
    }

    /// True when the batch is terminal or unknown (the worker skips it).
    pub fn finished(&self, id: u64) -> bool {
        let mut t = self.lock();
        match t.entries.get_mut(&id) {
            Some(e) => {
                Self::expire(e, Instant::now());
                e.stage.terminal()
            }
            None => true,
        }
    }

    /// Waits until the batch is granted; `Err` when it failed or expired.
    pub fn wait_granted(&self, id: u64) -> Result<()> {
        let mut t = self.lock();
        loop {
            let now = Instant::now();
            let Some(e) = t.entries.get_mut(&id) else {
                return Err(Error::new(Status::BatchFailed, "batch was collected"));
            };
            Self::expire(e, now);
            match &e.stage {
                Stage::Granted | Stage::Written | Stage::Done => return Ok(()),
                Stage::Failed(err) => return Err(err.clone()),
                Stage::Submitted => {}
            }
            let left = e.deadline.saturating_duration_since(now);
            t = self
                .cv
                .wait_timeout(t, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Polls: a terminal status is returned once and the batch forgotten.
    pub fn poll(&self, id: BatchId) -> Result<BatchStatus> {
        let mut t = self.lock();
        let e = t.entries.get_mut(&id.0).ok_or_else(|| unknown(id))?;
        Self::expire(e, Instant::now());
        let st = match &e.stage {
            Stage::Done => BatchStatus::Done(e.completion),
            Stage::Failed(err) => BatchStatus::Failed(err.clone()),
            _ => return Ok(BatchStatus::Pending),
        };
        t.entries.remove(&id.0);
        Ok(st)
    }

    /// Waits up to `timeout` for a terminal status.
    pub fn wait(&self, id: BatchId, timeout: Duration) -> Result<Completion> {
        let until = Instant::now() + timeout;
        let mut t = self.lock();
        loop {
            let now = Instant::now();
            let e = t.entries.get_mut(&id.0).ok_or_else(|| unknown(id))?;
            Self::expire(e, now);
            match &e.stage {
                Stage::Done => {
                    let c = e.completion;
                    t.entries.remove(&id.0);
                    return Ok(c);
                }
                Stage::Failed(err) => {
                    let err = err.clone();
                    t.entries.remove(&id.0);
                    return Err(err);
                }
                _ => {}
            }
            if now >= until {
                return Err(Error::new(
                    Status::Timeout,
                    format!(
                        "wait of {timeout:?} ended with batch {} still pending ({}); it keeps its own deadline",
                        id.0,
                        e.stage.name()
                    ),
                ));
            }
            let left = e.deadline.min(until).saturating_duration_since(now);
            t = self
                .cv
                .wait_timeout(t, left.max(Duration::from_micros(1)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

fn unknown(id: BatchId) -> Error {
    Error::invalid(format!(
        "unknown batch id {} on this peer (never submitted here, or its result was already collected)",
        id.0
    ))
}
