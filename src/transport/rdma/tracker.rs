//! Batch completion bookkeeping (pure): which signalled work requests each batch
//! still waits for, how many send-queue slots each completion frees, and why a
//! batch failed.
//!
//! The completion-queue poller thread feeds every work completion in
//! ([`Tracker::on_send_completion`], [`Tracker::on_recv_imm`]); callers read
//! [`Tracker::state`]. A failed completion fails its batch with the verbs status
//! and a hint, and **nothing is re-posted**: after an ambiguous failure (e.g. a
//! retry-exceeded WRITE) the bytes may or may not have landed, so the caller
//! decides (complaint 11 of the anchors: no blind retries). The QP is then in the
//! error state, so the rail is marked dead and every other batch on it fails too.

use crate::error::{Error, Status};
use std::collections::{HashMap, HashSet, VecDeque};

/// Incoming batch ids (newest first) whose partial records are kept.
const PARTIAL_WINDOW: u32 = 4096;

/// `IBV_WC_SUCCESS`.
pub(crate) const WC_SUCCESS: u32 = 0;
/// `IBV_WC_WR_FLUSH_ERR`.
pub(crate) const WC_WR_FLUSH_ERR: u32 = 5;

/// One work completion, copied out of `ibv_wc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The WR's id.
    pub wr_id: u64,
    /// `ibv_wc_status` (0 = success).
    pub status: u32,
    /// Vendor syndrome.
    pub vendor_err: u32,
    /// `ibv_wc_opcode`.
    pub opcode: u32,
    /// Immediate data (host order) when present.
    pub imm: Option<u32>,
}

/// `IBV_WC_RECV`: the bit set on every receive-queue completion opcode.
#[allow(dead_code)] // mirrored for the binding check and the fake NIC
pub(crate) const WC_RECV: u32 = 128;
/// `IBV_WC_RDMA_WRITE` (the fake NIC reports it; checked against the bindings).
#[allow(dead_code)]
pub(crate) const WC_OP_RDMA_WRITE: u32 = 1;
/// `IBV_WC_RDMA_READ`.
#[allow(dead_code)]
pub(crate) const WC_OP_RDMA_READ: u32 = 2;
/// `IBV_WC_RECV_RDMA_WITH_IMM`.
#[allow(dead_code)]
pub(crate) const WC_OP_RECV_RDMA_WITH_IMM: u32 = 129;
/// `IBV_WC_LOC_PROT_ERR`.
#[allow(dead_code)]
pub(crate) const WC_LOC_PROT_ERR: u32 = 4;
/// `IBV_WC_REM_ACCESS_ERR`.
#[allow(dead_code)]
pub(crate) const WC_REM_ACCESS_ERR: u32 = 10;
/// `IBV_WC_RETRY_EXC_ERR`.
#[allow(dead_code)]
pub(crate) const WC_RETRY_EXC_ERR: u32 = 12;
/// `IBV_WC_RNR_RETRY_EXC_ERR`.
#[allow(dead_code)]
pub(crate) const WC_RNR_RETRY_EXC_ERR: u32 = 13;

/// `wr_id` of every posted receive (for incoming WRITE_WITH_IMM records).
/// Send `wr_id`s pack (batch, sequence) and never reach it.
pub(crate) const RECV_WR_ID: u64 = u64::MAX;

impl WorkCompletion {
    /// True for a receive-queue completion. Told by `wr_id`, not by opcode:
    /// for a completion in error only `wr_id`, `status`, `qp_num` and
    /// `vendor_err` are defined (`ibv_poll_cq(3)`), so a flushed send may
    /// carry any opcode.
    pub fn is_recv(&self) -> bool {
        self.wr_id == RECV_WR_ID
    }
}

/// The name of an `ibv_wc_status` and what it usually means.
pub fn wc_status_text(status: u32) -> (&'static str, &'static str) {
    match status {
        0 => ("IBV_WC_SUCCESS", "success"),
        1 => ("IBV_WC_LOC_LEN_ERR", "local length error: a message exceeds what the port or path allows (MTU or max message size mismatch?)"),
        2 => ("IBV_WC_LOC_QP_OP_ERR", "local QP operation error: the work request is malformed for this QP"),
        4 => ("IBV_WC_LOC_PROT_ERR", "local protection error: the lkey does not cover the local buffer (region deregistered or wrong NIC's key)"),
        5 => ("IBV_WC_WR_FLUSH_ERR", "flushed: the QP had already gone to the error state after an earlier failure"),
        9 => ("IBV_WC_REM_INV_REQ_ERR", "remote invalid request: the peer refused the operation (access flags, length, or MTU mismatch)"),
        10 => ("IBV_WC_REM_ACCESS_ERR", "remote access error: the rkey or remote address is wrong or the peer deregistered the region"),
        11 => ("IBV_WC_REM_OP_ERR", "remote operation error: the peer's QP failed to complete the request"),
        12 => ("IBV_WC_RETRY_EXC_ERR", "transport retries exceeded: no ACK from the peer (peer gone, link down, or wrong GID/LID/MTU at connect)"),
        13 => ("IBV_WC_RNR_RETRY_EXC_ERR", "RNR retries exceeded: the peer posted no receive for a WRITE_WITH_IMM"),
        19 => ("IBV_WC_FATAL_ERR", "fatal NIC error"),
        20 => ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout"),
        21 => ("IBV_WC_GENERAL_ERR", "general error"),
        _ => ("IBV_WC_(other)", "see ibv_poll_cq(3)"),
    }
}

/// The state of one batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchState {
    /// Some signalled work requests have not completed yet.
    InProgress,
    /// Every work request completed successfully.
    Done {
        /// Bytes the batch moved.
        bytes: u64,
    },
    /// The batch failed; it was not retried. The error says why.
    Failed(Error),
}

#[derive(Debug)]
struct Entry {
    /// Signalled work requests still awaited, per rail.
    pending: HashMap<usize, usize>,
    bytes: u64,
    rails: HashSet<usize>,
    failed: Option<Error>,
    /// Its failure was reported (by [`Tracker::finish`] or by the error of a
    /// failed post): it is forgotten as soon as it settles.
    reported: bool,
}

impl Entry {
    fn pending(&self) -> usize {
        self.pending.values().sum()
    }
}

/// Bookkeeping for all batches of one endpoint.
#[derive(Debug, Default)]
pub struct Tracker {
    batches: HashMap<u32, Entry>,
    /// Signalled wr_id -> (batch, slots it frees), per rail.
    inflight: HashMap<(usize, u64), (u32, u32)>,
    /// Free send-queue slots per rail.
    credits: Vec<u32>,
    /// Why a rail's QP is dead (it went to the error state).
    dead: Vec<Option<String>>,
    /// Batch ids the peer announced with WRITE_WITH_IMM, in completion order.
    incoming: VecDeque<u32>,
    /// Records seen so far per incoming batch (a batch over k rails sends k).
    partial: HashMap<u32, usize>,
    /// Send slots of WRs a refused post left without a signalled WR, per rail:
    /// the next signalled WR posted on the rail carries them, and its
    /// completion returns them (a send completion covers earlier WRs only, so
    /// an older WR's completion does not free them).
    orphans: Vec<u32>,
}

/// One signalled work request of a batch, as posted on a rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Posted {
    /// The rail (QP) it was posted on.
    pub rail: usize,
    /// Its `wr_id`.
    pub wr_id: u64,
    /// Send-queue slots its completion frees.
    pub retires: u32,
}

impl Tracker {
    /// A tracker for `rails` QPs of `sq_depth` send slots each.
    pub fn new(rails: usize, sq_depth: u32) -> Self {
        Tracker {
            credits: vec![sq_depth; rails],
            dead: vec![None; rails],
            orphans: vec![0; rails],
            ..Default::default()
        }
    }

    /// Batches held: in flight, or finished and not yet reported. Bounded by
    /// what the caller has in flight: every batch is forgotten once it is
    /// reported and none of its work requests is awaited on a live rail.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// True when no batch is held.
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Signalled work requests awaited (all batches, all rails).
    pub fn awaited(&self) -> usize {
        self.inflight.len()
    }

    /// Whether a failed batch no longer waits for any work request on a live
    /// rail (those on dead rails may never complete, e.g. after a CQ failure).
    fn settled(&self, e: &Entry) -> bool {
        e.failed.is_some()
            && e.pending
                .iter()
                .all(|(r, n)| *n == 0 || self.dead.get(*r).is_some_and(|d| d.is_some()))
    }

    /// Forgets `batch` if it failed, was reported and settled.
    fn maybe_retire(&mut self, batch: u32) {
        let retire = self
            .batches
            .get(&batch)
            .is_some_and(|e| e.reported && self.settled(e));
        if retire {
            self.retire(batch);
        }
    }

    fn retire(&mut self, batch: u32) {
        if let Some(e) = self.batches.remove(&batch) {
            if e.pending() > 0 {
                // Awaited only on dead rails: nothing will return those slots anyway.
                self.inflight.retain(|_, (b, _)| *b != batch);
            }
        }
    }

    /// Free send-queue slots on `rail`.
    pub fn credits(&self, rail: usize) -> u32 {
        self.credits.get(rail).copied().unwrap_or(0)
    }

    /// Why `rail` is unusable, if it is.
    pub fn rail_dead(&self, rail: usize) -> Option<&str> {
        self.dead.get(rail).and_then(|d| d.as_deref())
    }

    /// Starts tracking `batch` moving `bytes`; fails if the id is in use or a rail is dead.
    pub fn begin(&mut self, batch: u32, rails: &[usize], bytes: u64) -> Result<(), Error> {
        if self.batches.contains_key(&batch) {
            return Err(Error::invalid(format!(
                "batch id {batch} is already in flight"
            )));
        }
        for r in rails {
            if *r >= self.dead.len() {
                return Err(Error::invalid(format!("rail {r} does not exist")));
            }
            if let Some(why) = &self.dead[*r] {
                return Err(Error::new(
                    Status::RdmaCompletion,
                    format!("rail {r} is unusable since an earlier failure ({why}); reconnect the endpoint"),
                ));
            }
        }
        self.batches.insert(
            batch,
            Entry {
                pending: HashMap::new(),
                bytes,
                rails: rails.iter().copied().collect(),
                failed: None,
                reported: false,
            },
        );
        Ok(())
    }

    /// Reserves `n` send slots on `rail` for a group about to be posted; false if
    /// fewer are free (the poster waits for completions).
    pub fn take_credits(&mut self, rail: usize, n: u32) -> bool {
        match self.credits.get_mut(rail) {
            Some(c) if *c >= n => {
                *c -= n;
                true
            }
            _ => false,
        }
    }

    /// Records a group as posted: its signalled WRs are now awaited.
    pub fn posted(&mut self, batch: u32, signalled: &[Posted]) {
        let e = self.batches.get_mut(&batch);
        let Some(e) = e else { return };
        for p in signalled {
            // Orphaned slots ride on the first signalled WR posted after them.
            let carried = self.orphans.get_mut(p.rail).map_or(0, std::mem::take);
            self.inflight
                .insert((p.rail, p.wr_id), (batch, p.retires + carried));
            *e.pending.entry(p.rail).or_insert(0) += 1;
        }
    }

    /// Withdraws signalled WRs recorded by [`posted`](Self::posted) that the NIC
    /// refused (they will never complete).
    pub fn unpost(&mut self, batch: u32, signalled: &[Posted]) {
        for p in signalled {
            if let Some((_, retires)) = self.inflight.remove(&(p.rail, p.wr_id)) {
                // Slots it carried for earlier orphans wait for the next one.
                if let Some(o) = self.orphans.get_mut(p.rail) {
                    *o += retires.saturating_sub(p.retires);
                }
                if let Some(n) = self
                    .batches
                    .get_mut(&batch)
                    .and_then(|e| e.pending.get_mut(&p.rail))
                {
                    *n = n.saturating_sub(1);
                }
            }
        }
        self.maybe_retire(batch);
    }

    /// `n` WRs were posted on `rail` without the signalled WR that would have
    /// returned their send slots (the post was refused part-way): their slots
    /// come back with the completion of the next signalled WR posted on it.
    pub fn orphan(&mut self, rail: usize, n: u32) {
        if let Some(o) = self.orphans.get_mut(rail) {
            *o += n;
        }
    }

    /// Fails a batch whose posting stopped part-way (`ibv_post_send` refused a WR,
    /// a rail died, or the send queues stayed full). Completions of the WRs
    /// already posted still return their slots. The poster reports this
    /// failure with its error, so the batch is forgotten once it settles, even
    /// if nobody asks for its state.
    pub fn post_failed(
        &mut self,
        batch: u32,
        rail: usize,
        posted: usize,
        total: usize,
        why: &str,
        refunded: u32,
    ) {
        if let Some(c) = self.credits.get_mut(rail) {
            *c += refunded;
        }
        if let Some(e) = self.batches.get_mut(&batch) {
            e.failed.get_or_insert_with(|| {
                Error::new(
                    Status::RdmaCompletion,
                    format!(
                        "batch {batch}: ibv_post_send on rail {rail} failed after {posted} of {total} work requests were posted: {why}; the batch is incomplete and was not retried"
                    ),
                )
            });
            e.reported = true;
        }
        self.maybe_retire(batch);
    }

    /// One send-queue completion. `status` is the `ibv_wc_status`, `vendor_err` the
    /// vendor syndrome. Returns the batch it belonged to, if known.
    pub fn on_send_completion(
        &mut self,
        rail: usize,
        wr_id: u64,
        status: u32,
        vendor_err: u32,
    ) -> Option<u32> {
        let (batch, retires) = match self.inflight.remove(&(rail, wr_id)) {
            Some(x) => x,
            None => {
                // An unsignalled WR flushed after an error: nothing awaited it, but the
                // rail is dead all the same.
                if status != WC_SUCCESS {
                    self.kill_rail(rail, status, vendor_err, wr_id);
                }
                return None;
            }
        };
        if let Some(c) = self.credits.get_mut(rail) {
            *c += retires;
        }
        if let Some(e) = self.batches.get_mut(&batch) {
            if let Some(n) = e.pending.get_mut(&rail) {
                *n = n.saturating_sub(1);
            }
            if status != WC_SUCCESS && e.failed.is_none() {
                let (name, hint) = wc_status_text(status);
                let (b, seq) = super::wr::split_wr_id(wr_id);
                e.failed = Some(Error::new(
                    Status::RdmaCompletion,
                    format!(
                        "batch {b}: work request {seq} on rail {rail} completed with {name} (status {status}, vendor_err {vendor_err:#x}): {hint}. Writes of this batch may or may not have reached the peer; it was not retried"
                    ),
                ));
            }
        }
        if status != WC_SUCCESS {
            self.kill_rail(rail, status, vendor_err, wr_id);
        }
        self.maybe_retire(batch);
        Some(batch)
    }

    fn kill_rail(&mut self, rail: usize, status: u32, vendor_err: u32, wr_id: u64) {
        // Flushes follow the real error, whose reason (kept first) is the useful one.
        let reason = if status == WC_WR_FLUSH_ERR {
            "QP flushed (error state)".to_string()
        } else {
            let (name, _) = wc_status_text(status);
            format!("{name} (vendor_err {vendor_err:#x}) on wr {wr_id:#x}")
        };
        self.fail_rail(rail, &reason);
    }

    /// Marks `rail` unusable (its QP or CQ failed) and fails every in-flight batch
    /// on it with `reason`. The first reason is kept.
    pub fn fail_rail(&mut self, rail: usize, reason: &str) {
        let Some(d) = self.dead.get_mut(rail) else {
            return;
        };
        if d.is_some() {
            return;
        }
        *d = Some(reason.to_string());
        // Every other in-flight batch on this rail will be flushed: fail them now
        // with the real cause rather than with "flushed".
        for (id, e) in self.batches.iter_mut() {
            if e.rails.contains(&rail) && e.pending() > 0 && e.failed.is_none() {
                e.failed = Some(Error::new(
                    Status::RdmaCompletion,
                    format!("batch {id}: rail {rail}'s QP failed ({reason}); the batch may be partly written and was not retried"),
                ));
            }
        }
        // Reported batches that now wait only on dead rails are done with.
        let ids: Vec<u32> = self.batches.keys().copied().collect();
        for id in ids {
            self.maybe_retire(id);
        }
    }

    /// A receive completion carrying the immediate of one of the peer's
    /// WRITE_WITH_IMM records ([`super::wr::imm_encode`]); the batch counts as
    /// arrived once the records of all its rails are in.
    pub fn on_recv_imm(&mut self, imm: u32) {
        let (batch, rails) = super::wr::imm_decode(imm);
        let seen = self.partial.entry(batch).or_insert(0);
        *seen += 1;
        if *seen >= rails.max(1) {
            self.partial.remove(&batch);
            self.incoming.push_back(batch);
        } else if self.partial.len() > 2 * PARTIAL_WINDOW as usize {
            // Records of a batch that failed on another rail never complete:
            // keep only the newest window of ids (24-bit, wrapping; amortised).
            self.partial
                .retain(|b, _| batch.wrapping_sub(*b) & 0x00ff_ffff < PARTIAL_WINDOW);
        }
    }

    /// Incoming batches with some but not all of their records (bounded).
    pub fn partial_incoming(&self) -> usize {
        self.partial.len()
    }

    /// The next batch id the peer announced as fully written, if any.
    pub fn next_incoming(&mut self) -> Option<u32> {
        self.incoming.pop_front()
    }

    /// The state of `batch` (`None` if unknown).
    pub fn state(&self, batch: u32) -> Option<BatchState> {
        let e = self.batches.get(&batch)?;
        Some(match (&e.failed, e.pending()) {
            (Some(err), _) => BatchState::Failed(err.clone()),
            (None, 0) => BatchState::Done { bytes: e.bytes },
            (None, _) => BatchState::InProgress,
        })
    }

    /// Returns the final state of `batch` and forgets it once it is done, or once
    /// it failed and none of its posted WRs is still awaited on a live rail. A
    /// failed batch reported here while WRs are still outstanding is forgotten
    /// by itself as soon as they complete (or their rails die), so entries
    /// never pile up even if nobody asks again.
    pub fn finish(&mut self, batch: u32) -> Option<BatchState> {
        let s = self.state(batch)?;
        match s {
            BatchState::InProgress => {}
            BatchState::Done { .. } => self.retire(batch),
            BatchState::Failed(_) => {
                if let Some(e) = self.batches.get_mut(&batch) {
                    e.reported = true;
                }
                self.maybe_retire(batch);
            }
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::super::wr::wr_id;
    use super::*;

    fn posted(rail: usize, batch: u32, seq: u32, retires: u32) -> Posted {
        Posted {
            rail,
            wr_id: wr_id(batch, seq),
            retires,
        }
    }

    #[test]
    fn batch_completes_after_every_signalled_wr_and_credits_return() {
        let mut t = Tracker::new(2, 16);
        t.begin(1, &[0, 1], 4096).unwrap();
        assert!(t.take_credits(0, 8));
        assert!(t.take_credits(1, 4));
        assert!(!t.take_credits(1, 13), "only 12 slots left");
        t.posted(
            1,
            &[posted(0, 1, 3, 4), posted(0, 1, 7, 4), posted(1, 1, 3, 4)],
        );
        assert_eq!(t.credits(0), 8);
        assert_eq!(t.state(1), Some(BatchState::InProgress));
        assert_eq!(t.on_send_completion(0, wr_id(1, 3), WC_SUCCESS, 0), Some(1));
        assert_eq!(t.on_send_completion(1, wr_id(1, 3), WC_SUCCESS, 0), Some(1));
        assert_eq!(t.finish(1), Some(BatchState::InProgress));
        assert_eq!(t.on_send_completion(0, wr_id(1, 7), WC_SUCCESS, 0), Some(1));
        assert_eq!(t.credits(0), 16);
        assert_eq!(t.credits(1), 16);
        assert_eq!(t.finish(1), Some(BatchState::Done { bytes: 4096 }));
        assert_eq!(t.state(1), None, "forgotten once finished");
        // The id can be reused afterwards.
        t.begin(1, &[0], 1).unwrap();
        assert!(t.begin(1, &[0], 1).is_err());
    }

    #[test]
    fn failure_is_reported_with_cause_and_never_retried() {
        let mut t = Tracker::new(1, 64);
        t.begin(5, &[0], 100).unwrap();
        t.begin(6, &[0], 100).unwrap();
        assert!(t.take_credits(0, 3));
        t.posted(5, &[posted(0, 5, 0, 1), posted(0, 5, 1, 1)]);
        t.posted(6, &[posted(0, 6, 0, 1)]);
        t.on_send_completion(0, wr_id(5, 0), 12, 0x81);
        match t.state(5).unwrap() {
            BatchState::Failed(e) => {
                assert_eq!(e.status(), Status::RdmaCompletion);
                assert!(e.detail().contains("IBV_WC_RETRY_EXC_ERR"), "{e}");
                assert!(e.detail().contains("not retried"), "{e}");
                assert!(e.detail().contains("vendor_err 0x81"), "{e}");
                assert!(e.detail().contains("work request 0 on rail 0"), "{e}");
                assert!(e.detail().contains("no ACK from the peer"), "{e}");
            }
            s => panic!("{s:?}"),
        }
        // The other batch on the same QP fails with the real cause, not "flushed".
        match t.state(6).unwrap() {
            BatchState::Failed(e) => assert!(e.detail().contains("IBV_WC_RETRY_EXC_ERR"), "{e}"),
            s => panic!("{s:?}"),
        }
        // The flush completions that follow change nothing and return slots.
        t.on_send_completion(0, wr_id(5, 1), WC_WR_FLUSH_ERR, 0);
        t.on_send_completion(0, wr_id(6, 0), WC_WR_FLUSH_ERR, 0);
        assert!(t.rail_dead(0).unwrap().contains("RETRY_EXC"));
        assert_eq!(t.credits(0), 64);
        assert!(matches!(t.finish(5), Some(BatchState::Failed(_))));
        assert_eq!(t.state(5), None);
        // A dead rail refuses new batches with the reason instead of posting again.
        let e = t.begin(7, &[0], 1).unwrap_err();
        assert!(e.detail().contains("reconnect"), "{e}");
    }

    #[test]
    fn partial_post_fails_the_batch() {
        let mut t = Tracker::new(1, 8);
        t.begin(2, &[0], 10).unwrap();
        assert!(t.take_credits(0, 8));
        t.posted(2, &[posted(0, 2, 3, 4)]);
        // The second group is refused outright: withdrawn, its slots refunded.
        t.posted(2, &[posted(0, 2, 7, 4)]);
        t.unpost(2, &[posted(0, 2, 7, 4)]);
        t.post_failed(2, 0, 4, 8, "ENOMEM", 4);
        assert_eq!(t.credits(0), 4);
        match t.state(2).unwrap() {
            BatchState::Failed(e) => assert!(e.detail().contains("after 4 of 8"), "{e}"),
            s => panic!("{s:?}"),
        }
        // Still waits for the posted group's completion before forgetting the batch.
        assert!(matches!(t.finish(2), Some(BatchState::Failed(_))));
        assert!(t.state(2).is_some());
        t.on_send_completion(0, wr_id(2, 3), WC_SUCCESS, 0);
        assert_eq!(t.credits(0), 8);
        // Reported (by the failed post) and settled: forgotten without another ask.
        assert_eq!(t.state(2), None);
        assert_eq!(t.finish(2), None);
        assert!(t.is_empty());
    }

    #[test]
    fn failed_batches_always_retire_so_the_tracker_stays_bounded() {
        // Two rails; every batch fails on rail 1 (post refused part-way) while
        // rail 0 stays healthy and its WRs complete later. Nobody asks for the
        // state again after the failed post reported it.
        let mut t = Tracker::new(2, 64);
        for b in 0..5000u32 {
            t.begin(b, &[0, 1], 100).unwrap();
            assert!(t.take_credits(0, 4));
            t.posted(b, &[posted(0, b, 3, 4)]);
            assert!(t.take_credits(1, 4));
            t.posted(b, &[posted(1, b, 3, 4)]);
            // Rail 1 accepted 2 of its 4 WRs, not the signalled one.
            t.unpost(b, &[posted(1, b, 3, 4)]);
            t.orphan(1, 2);
            t.post_failed(b, 1, 2, 4, "ENOMEM", 2);
            // Some waiters look once while rail 0 is still busy.
            if b % 2 == 0 {
                assert!(matches!(t.finish(b), Some(BatchState::Failed(_))));
            }
            assert!(t.len() <= 1, "batch {b}: {} held", t.len());
            t.on_send_completion(0, wr_id(b, 3), WC_SUCCESS, 0);
            assert!(t.is_empty(), "batch {b} stayed after it settled");
            // Rail 1's next completion returns the orphaned slots.
            if b % 10 == 9 {
                t.begin(u32::MAX, &[1], 1).unwrap();
                assert!(t.take_credits(1, 1));
                t.posted(u32::MAX, &[posted(1, u32::MAX, 0, 1)]);
                t.on_send_completion(1, wr_id(u32::MAX, 0), WC_SUCCESS, 0);
                assert_eq!(t.finish(u32::MAX), Some(BatchState::Done { bytes: 1 }));
                assert_eq!(t.credits(1), 64, "orphaned slots came back");
            }
        }
        assert_eq!((t.len(), t.awaited()), (0, 0));
        assert_eq!(t.credits(0), 64);
    }

    /// A send completion covers the WRs posted before it only: slots orphaned
    /// by a part-refused post come back with a later WR's completion, not
    /// with an older one's (which would over-commit the send queue).
    #[test]
    fn orphaned_slots_return_only_with_a_later_wrs_completion() {
        let mut t = Tracker::new(1, 16);
        // batch 1: a group of 8 in flight
        t.begin(1, &[0], 100).unwrap();
        assert!(t.take_credits(0, 8));
        t.posted(1, &[posted(0, 1, 7, 8)]);
        // batch 2: a group of 8 of which the NIC accepted 4, not the signalled one
        t.begin(2, &[0], 100).unwrap();
        assert!(t.take_credits(0, 8));
        t.posted(2, &[posted(0, 2, 7, 8)]);
        t.unpost(2, &[posted(0, 2, 7, 8)]);
        t.orphan(0, 4);
        t.post_failed(2, 0, 4, 8, "ENOMEM", 4);
        assert_eq!(t.credits(0), 4);
        // batch 1's completion is older than the orphans: 8 come back, not 12
        t.on_send_completion(0, wr_id(1, 7), WC_SUCCESS, 0);
        assert_eq!(t.credits(0), 12, "orphans returned by an older completion");
        // the next signalled WR carries them
        t.begin(3, &[0], 1).unwrap();
        assert!(t.take_credits(0, 2));
        t.posted(3, &[posted(0, 3, 1, 2)]);
        t.on_send_completion(0, wr_id(3, 1), WC_SUCCESS, 0);
        assert_eq!(t.credits(0), 16);
        assert_eq!(t.finish(3), Some(BatchState::Done { bytes: 1 }));
    }

    #[test]
    fn a_batch_awaiting_only_a_dead_rails_completions_retires() {
        // Rail 0's CQ fails (its completions will never be polled); rail 1 stays
        // healthy and completes its part.
        let mut t = Tracker::new(2, 16);
        t.begin(8, &[0, 1], 10).unwrap();
        t.posted(8, &[posted(0, 8, 1, 1), posted(1, 8, 1, 1)]);
        t.fail_rail(0, "ibv_poll_cq failed: EIO");
        // Still waiting for rail 1: kept, reported once.
        assert!(matches!(t.finish(8), Some(BatchState::Failed(_))));
        assert_eq!(t.len(), 1);
        t.on_send_completion(1, wr_id(8, 1), WC_SUCCESS, 0);
        assert_eq!(
            (t.len(), t.awaited()),
            (0, 0),
            "retired, rail 0's WR dropped"
        );
        // A failure nobody has been told about yet is kept until it is asked once.
        t.begin(9, &[1], 10).unwrap();
        t.posted(9, &[posted(1, 9, 1, 1)]);
        t.on_send_completion(1, wr_id(9, 1), 10, 0);
        assert_eq!(t.len(), 1);
        match t.finish(9) {
            Some(BatchState::Failed(e)) => assert!(e.detail().contains("REM_ACCESS"), "{e}"),
            s => panic!("{s:?}"),
        }
        assert!(t.is_empty());
    }

    #[test]
    fn incoming_immediates_queue_in_order_and_unknown_wrs_are_ignored() {
        use super::super::wr::imm_encode;
        let mut t = Tracker::new(1, 8);
        // Batch 3 over two rails needs both records; batch 1 over one rail needs one.
        t.on_recv_imm(imm_encode(3, 2).unwrap());
        assert_eq!(t.next_incoming(), None);
        t.on_recv_imm(imm_encode(1, 1).unwrap());
        t.on_recv_imm(imm_encode(3, 2).unwrap());
        assert_eq!(t.next_incoming(), Some(1));
        assert_eq!(t.next_incoming(), Some(3));
        assert_eq!(t.next_incoming(), None);
        // Batches whose other rails' records never come (failed there) do not pile
        // up, and a recent incomplete batch still completes.
        for b in 10..30_000u32 {
            t.on_recv_imm(imm_encode(b, 2).unwrap());
        }
        assert!(
            t.partial_incoming() <= 2 * PARTIAL_WINDOW as usize + 1,
            "{}",
            t.partial_incoming()
        );
        t.on_recv_imm(imm_encode(29_990, 2).unwrap());
        assert_eq!(t.next_incoming(), Some(29_990));
        assert_eq!(t.on_send_completion(0, 42, WC_SUCCESS, 0), None);
        assert_eq!(t.on_send_completion(9, 42, WC_SUCCESS, 0), None);
        assert!(t.begin(1, &[3], 1).is_err());
        assert_eq!(wc_status_text(10).0, "IBV_WC_REM_ACCESS_ERR");
        // A failed CQ poll kills the rail and its batches with that reason.
        t.begin(4, &[0], 1).unwrap();
        t.posted(4, &[posted(0, 4, 0, 1)]);
        t.fail_rail(0, "ibv_poll_cq failed: EIO");
        t.fail_rail(0, "later reason is ignored");
        assert_eq!(t.rail_dead(0), Some("ibv_poll_cq failed: EIO"));
        match t.state(4).unwrap() {
            BatchState::Failed(e) => assert!(e.detail().contains("EIO"), "{e}"),
            s => panic!("{s:?}"),
        }
    }
}
