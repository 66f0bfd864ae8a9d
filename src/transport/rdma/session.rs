//! One connection's data path, independent of the NIC (pure logic plus a poller
//! thread): slicing a batch across rails, resolving keys, building and posting
//! work-request groups under send-queue credits (round-robin over the rails),
//! and turning completions into batch states.
//!
//! The NIC side is the [`RailIo`] trait: the verbs QP/CQ pair in production
//! (`endpoint`), an in-memory fake NIC in the tests below, which moves real bytes
//! between buffers so the whole path (slicing, keys, WRs, credits, completions,
//! immediate records, failures) is exercised without hardware.

use super::config::RecordMode;
use super::slice::{slice_across, LocalRegion, RailKeys, Span};
use super::tracker::{BatchState, Posted, Tracker, WorkCompletion};
use super::wr::{
    build_batch, imm_encode, post_groups, BatchParams, CompletionRecord, Direction, Transfer,
    WorkRequest,
};
use crate::error::{Error, Result, Status};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the data path needs from one rail's NIC queue pair.
pub trait RailIo: Send + Sync + 'static {
    /// Posts `wrs` as one linked list; on failure, how many were accepted and why.
    fn post_send(&self, wrs: &[WorkRequest]) -> std::result::Result<(), (usize, Error)>;
    /// Posts `n` receives for incoming WRITE_WITH_IMM records.
    fn post_recvs(&self, n: usize) -> Result<()>;
    /// Appends up to `max` completions to `out`; returns how many.
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize>;
}

/// One rail of a session.
pub struct SessionRail<R> {
    /// The NIC queue pair.
    pub io: R,
    /// Slicing weight (link rate).
    pub weight: u64,
    /// Largest message per WR.
    pub max_msg: u64,
    /// Send-queue depth.
    pub sq_depth: u32,
    /// Receives kept posted.
    pub recv_depth: u32,
    keys: Mutex<Option<RailKeys>>,
}

impl<R> SessionRail<R> {
    /// A rail; keys are set when the peer's regions are known.
    pub fn new(io: R, weight: u64, max_msg: u64, sq_depth: u32, recv_depth: u32) -> Self {
        SessionRail {
            io,
            weight,
            max_msg,
            sq_depth,
            recv_depth,
            keys: Mutex::new(None),
        }
    }
}

/// Posting parameters of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionParams {
    /// Signal one completion every this many WRs.
    pub signal_every: u32,
    /// Smallest piece when slicing across rails.
    pub min_slice: u64,
    /// Completion record of write batches.
    pub record: RecordMode,
    /// How long posting waits for send-queue slots.
    pub post_timeout: Duration,
}

struct Shared<R> {
    rails: Vec<SessionRail<R>>,
    tracker: Mutex<Tracker>,
    cv: Condvar,
    stop: AtomicBool,
    /// Groups between "awaited" and "handed to the NIC": the poller waits
    /// for their kick instead of backing off.
    posting: AtomicUsize,
    /// Bumped by every post (and by stop): wakes an idle or backing-off poller.
    kicks: Mutex<u64>,
    kick_cv: Condvar,
    /// Backoff waits of the poller that ran their full length while work
    /// was awaited (a post or a completion ends a wait early and is not
    /// counted): what a completion can have been delayed by.
    sleeps: AtomicU64,
    /// Whether completions can arrive with nothing posted here (incoming
    /// WRITE_WITH_IMM records).
    incoming: bool,
}

impl<R> Shared<R> {
    fn kick(&self) {
        *lock(&self.kicks) += 1;
        self.kick_cv.notify_all();
    }
}

/// Polls the poller makes without completions before it starts to back off.
const SPIN_POLLS: u32 = 256;
/// First and largest backoff wait of the poller while work is awaited.
const BACKOFF_MIN: Duration = Duration::from_micros(1);
const BACKOFF_MAX: Duration = Duration::from_micros(64);
/// How long an idle poller parks before looking again (a post wakes it at once).
const PARK: Duration = Duration::from_millis(50);

/// The data path of one connection.
pub struct Session<R: RailIo> {
    shared: Arc<Shared<R>>,
    /// The NIC rail index of each session rail (the session keeps only the
    /// rails paired with the peer, in pair order).
    nic_rails: Vec<usize>,
    connected: usize,
    poller: Option<JoinHandle<()>>,
    params: SessionParams,
}

impl<R: RailIo> Session<R> {
    /// A session over `rails` (not started: nothing can be posted yet).
    pub fn new(rails: Vec<SessionRail<R>>, params: SessionParams) -> Self {
        Session {
            nic_rails: (0..rails.len()).collect(),
            shared: Arc::new(Shared {
                rails,
                tracker: Mutex::new(Tracker::new(0, 0)),
                cv: Condvar::new(),
                stop: AtomicBool::new(false),
                posting: AtomicUsize::new(0),
                kicks: Mutex::new(0),
                kick_cv: Condvar::new(),
                sleeps: AtomicU64::new(0),
                incoming: params.record == RecordMode::Immediate,
            }),
            connected: 0,
            poller: None,
            params,
        }
    }

    /// The rails (for the verbs layer to move QPs through their states).
    pub fn rails(&self) -> &[SessionRail<R>] {
        &self.shared.rails
    }

    /// Keeps only the rails at NIC rail indices `order`, in that order (the rails
    /// paired with the peer); the others are dropped (their QPs destroyed).
    /// Only before [`start`](Self::start). [`add_local`](Self::add_local) keeps
    /// taking lkeys by NIC rail index.
    pub fn keep_rails(&mut self, order: &[usize]) -> Result<()> {
        let n = self.shared.rails.len();
        let mut seen = vec![false; n];
        for &i in order {
            if i >= n || std::mem::replace(&mut seen[i], true) {
                return Err(Error::invalid(format!(
                    "rail order {order:?} is not a selection of {n} rails"
                )));
            }
        }
        let shared = match Arc::get_mut(&mut self.shared) {
            Some(s) if self.poller.is_none() => s,
            _ => return Err(Error::invalid("session already started")),
        };
        let mut all: Vec<Option<SessionRail<R>>> = shared.rails.drain(..).map(Some).collect();
        shared.rails = order.iter().filter_map(|&i| all[i].take()).collect();
        self.nic_rails = order.iter().map(|&i| self.nic_rails[i]).collect();
        Ok(())
    }

    /// Starts the first `keys.len()` rails with their keys: posts the receives and
    /// starts the completion poller thread.
    pub fn start(&mut self, keys: Vec<RailKeys>) -> Result<()> {
        if self.poller.is_some() {
            return Err(Error::invalid("session already started"));
        }
        let n = keys.len();
        if n == 0 || n > self.shared.rails.len() {
            return Err(Error::invalid(format!(
                "cannot start {n} of {} rails",
                self.shared.rails.len()
            )));
        }
        for (r, k) in self.shared.rails.iter().zip(keys) {
            r.io.post_recvs(r.recv_depth as usize)?;
            *lock(&r.keys) = Some(k);
        }
        let sq = self.shared.rails[..n]
            .iter()
            .map(|r| r.sq_depth)
            .min()
            .unwrap_or(1);
        *lock(&self.shared.tracker) = Tracker::new(n, sq);
        let shared = self.shared.clone();
        self.poller = Some(
            crate::threads::spawn("pdxfer-rdma-cq".into(), move || poll_loop(&shared, n)).map_err(
                |e| {
                    Error::new(
                        Status::Rdma,
                        format!("cannot start the CQ poller thread: {e}"),
                    )
                },
            )?,
        );
        self.connected = n;
        Ok(())
    }

    /// Adds a local region registered after the session started: `per_rail[i]`
    /// holds its lkey on NIC rail `i` (rails not connected are ignored).
    pub fn add_local(&self, per_rail: &[LocalRegion]) {
        for (j, r) in self.shared.rails[..self.connected].iter().enumerate() {
            let Some(l) = per_rail.get(self.nic_rails[j]) else {
                continue;
            };
            if let Some(k) = lock(&r.keys).as_mut() {
                k.add_local(*l);
            }
        }
    }

    /// Forgets every local region overlapping `[addr, addr+len)` on every rail
    /// (deregistered: its lkeys are gone).
    pub fn remove_local(&self, addr: u64, len: u64) {
        for r in &self.shared.rails[..self.connected] {
            if let Some(k) = lock(&r.keys).as_mut() {
                k.remove_local(addr, len);
            }
        }
    }

    /// Batches the tracker still holds (in flight, or finished and not yet reported).
    pub fn tracked(&self) -> usize {
        lock(&self.shared.tracker).len()
    }

    /// How many backoff waits of the completion poller ran their full length
    /// while work was awaited (the completion poller's backoff): 0 when every completion was
    /// picked up by spinning or right after a post woke the poller.
    pub fn poller_sleeps(&self) -> u64 {
        self.shared.sleeps.load(Ordering::Relaxed)
    }

    /// Why the session is unusable, if a rail died (its QP went to the
    /// error state: every later batch on it fails, so the connection must
    /// be made again).
    pub fn broken(&self) -> Option<String> {
        let t = lock(&self.shared.tracker);
        (0..self.connected).find_map(|i| t.rail_dead(i).map(|w| format!("rail {i}: {w}")))
    }

    /// The number of connected rails (0 before [`start`](Self::start)).
    pub fn connected_rails(&self) -> usize {
        self.connected
    }

    /// Posts one batch (see `RdmaEndpoint::post_batch`).
    pub fn post_batch(&self, batch: u32, dir: Direction, spans: &[Span]) -> Result<()> {
        self.post_batch_with(batch, dir, spans, None)
    }

    /// Posts one write batch followed, on the same rail, by an ordered WRITE of `record`.
    pub fn post_batch_with_record(&self, batch: u32, spans: &[Span], record: Span) -> Result<()> {
        self.post_batch_with(batch, Direction::Write, spans, Some(record))
    }

    fn post_batch_with(
        &self,
        batch: u32,
        dir: Direction,
        spans: &[Span],
        final_write: Option<Span>,
    ) -> Result<()> {
        let n = self.connected;
        if n == 0 {
            return Err(Error::new(
                Status::PeerUnreachable,
                "RDMA endpoint is not connected",
            ));
        }
        let rails = &self.shared.rails[..n];
        let per_rail: Vec<Vec<Span>> = if final_write.is_some() {
            let mut v = vec![Vec::new(); n];
            v[batch as usize % n] = spans.to_vec();
            v
        } else {
            let weights: Vec<u64> = rails.iter().map(|r| r.weight).collect();
            slice_across(spans, &weights, self.params.min_slice)?
        };
        let imm_wanted = dir == Direction::Write
            && final_write.is_none()
            && self.params.record == RecordMode::Immediate;
        let mut used: Vec<usize> = (0..n).filter(|i| !per_rail[*i].is_empty()).collect();
        if used.is_empty() {
            if final_write.is_some() {
                used.push(batch as usize % n);
            } else if imm_wanted {
                used.push(0);
            } else {
                return Err(Error::invalid("empty batch"));
            }
        }
        let imm = if imm_wanted {
            Some(imm_encode(batch, used.len())?)
        } else {
            None
        };
        // Resolve and build everything before posting anything.
        let mut plans: Vec<(usize, Vec<WorkRequest>)> = Vec::with_capacity(used.len());
        let mut bytes = 0u64;
        for &i in &used {
            let keys = lock(&rails[i].keys);
            let keys = keys
                .as_ref()
                .ok_or_else(|| Error::new(Status::PeerUnreachable, "rail not connected"))?;
            let transfers: Vec<Transfer> = keys.resolve_all(&per_rail[i])?;
            bytes += transfers.iter().map(|t| t.len).sum::<u64>();
            let record = match (imm, final_write) {
                (Some(v), _) => CompletionRecord::Immediate(v),
                (None, Some(s)) => CompletionRecord::FinalWrite(keys.resolve(&s)?),
                (None, None) => CompletionRecord::None,
            };
            let params = BatchParams {
                max_msg: rails[i].max_msg.max(1),
                signal_every: self.params.signal_every.min(rails[i].sq_depth),
                sq_depth: rails[i].sq_depth,
            };
            plans.push((i, build_batch(batch, dir, &transfers, record, &params)?));
        }
        lock(&self.shared.tracker).begin(batch, &used, bytes)?;
        // Post round-robin over the rails, one signalled group at a time, so every
        // NIC works in parallel even when a batch is deeper than a send queue.
        let groups: Vec<(usize, Vec<&[WorkRequest]>)> =
            plans.iter().map(|(i, w)| (*i, post_groups(w))).collect();
        let totals: Vec<usize> = plans.iter().map(|(_, w)| w.len()).collect();
        let mut next = vec![0usize; groups.len()];
        let mut done = vec![0usize; groups.len()];
        let deadline = Instant::now() + self.params.post_timeout;
        loop {
            let mut progressed = false;
            let mut remaining = false;
            for (k, (i, gs)) in groups.iter().enumerate() {
                let Some(group) = gs.get(next[k]) else {
                    continue;
                };
                remaining = true;
                let g = group.len() as u32;
                let signalled: Vec<Posted> = group
                    .iter()
                    .filter(|w| w.signaled)
                    .map(|w| Posted {
                        rail: *i,
                        wr_id: w.wr_id,
                        retires: w.retires,
                    })
                    .collect();
                {
                    let mut t = lock(&self.shared.tracker);
                    if let Some(why) = t.rail_dead(*i) {
                        let why = why.to_string();
                        t.post_failed(
                            batch,
                            *i,
                            done[k],
                            totals[k],
                            &format!("rail died: {why}"),
                            0,
                        );
                        return Err(Error::new(
                            Status::RdmaCompletion,
                            format!(
                                "batch {batch}: rail {i} failed while posting ({why}); not retried"
                            ),
                        ));
                    }
                    if !t.take_credits(*i, g) {
                        continue;
                    }
                    // Register the awaited completions before posting, so a fast
                    // completion always finds its entry.
                    self.shared.posting.fetch_add(1, Ordering::AcqRel);
                    t.posted(batch, &signalled);
                }
                let posted = rails[*i].io.post_send(group);
                // Its completions may be there already: wake the poller.
                self.shared.posting.fetch_sub(1, Ordering::AcqRel);
                self.shared.kick();
                if let Err((accepted, e)) = posted {
                    let mut t = lock(&self.shared.tracker);
                    // The refused WRs (including the signalled one) will never complete;
                    // the accepted ones before it have no completion to return their slots.
                    t.unpost(batch, &signalled);
                    t.orphan(*i, accepted as u32);
                    t.post_failed(
                        batch,
                        *i,
                        done[k] + accepted,
                        totals[k],
                        e.detail(),
                        g - accepted as u32,
                    );
                    return Err(Error::new(
                        Status::RdmaCompletion,
                        format!(
                            "batch {batch}: {}; {} of {} WRs were posted on rail {i}; not retried",
                            e.detail(),
                            done[k] + accepted,
                            totals[k]
                        ),
                    ));
                }
                done[k] += group.len();
                next[k] += 1;
                progressed = true;
            }
            if !remaining {
                break;
            }
            if !progressed {
                // Every rail with work left is out of send slots: wait for completions.
                let t = lock(&self.shared.tracker);
                let now = Instant::now();
                if now >= deadline {
                    let mut t = t;
                    for (k, (i, _)) in groups.iter().enumerate() {
                        if done[k] < totals[k] {
                            t.post_failed(
                                batch,
                                *i,
                                done[k],
                                totals[k],
                                "no free send-queue slots before the post timeout",
                                0,
                            );
                        }
                    }
                    return Err(Error::new(
                        Status::Timeout,
                        format!(
                            "batch {batch}: send queues stayed full for {:?}; posted {:?} of {totals:?} WRs per rail",
                            self.params.post_timeout, done
                        ),
                    ));
                }
                let wait = (deadline - now).min(Duration::from_millis(10));
                drop(
                    self.shared
                        .cv
                        .wait_timeout(t, wait)
                        .unwrap_or_else(|p| p.into_inner()),
                );
            }
        }
        Ok(())
    }

    /// The batch's state; a finished batch is forgotten after it is reported once.
    pub fn poll(&self, batch: u32) -> Result<BatchState> {
        lock(&self.shared.tracker)
            .finish(batch)
            .ok_or_else(|| Error::invalid(format!("unknown RDMA batch {batch}")))
    }

    /// Waits until the batch is done or failed, at most `timeout`
    /// ([`Status::Timeout`] then; the batch keeps running and can be polled again).
    pub fn wait(&self, batch: u32, timeout: Duration) -> Result<BatchState> {
        let deadline = Instant::now() + timeout;
        let mut t = lock(&self.shared.tracker);
        loop {
            match t.finish(batch) {
                None => return Err(Error::invalid(format!("unknown RDMA batch {batch}"))),
                Some(BatchState::InProgress) => {}
                Some(s) => return Ok(s),
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    Status::Timeout,
                    format!("RDMA batch {batch} still in flight after {timeout:?}"),
                ));
            }
            t = self
                .shared
                .cv
                .wait_timeout(t, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// The next batch the peer announced as fully written (WRITE_WITH_IMM records
    /// of all its rails arrived), if any.
    pub fn next_incoming(&self) -> Option<u32> {
        lock(&self.shared.tracker).next_incoming()
    }
}

impl<R: RailIo> Drop for Session<R> {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.kick();
        if let Some(h) = self.poller.take() {
            if h.join().is_err() {
                log::error!("rdma: the CQ poller thread panicked");
            }
        }
    }
}

/// Lets the poller's short waits be short: the default 50 us timer slack of
/// a Linux thread would turn every 1 us wait into about 55 us.
fn tighten_timer_slack() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK only changes this thread's timer slack (in ns).
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong);
    }
}

/// The completion poller: polls every rail's CQ and feeds the tracker. With
/// no completions it spins [`SPIN_POLLS`] polls, then, while work is awaited
/// (or incoming records may arrive), waits [`BACKOFF_MIN`] doubling up to
/// [`BACKOFF_MAX`], and with nothing awaited parks until a post wakes it.
/// Every post, and every completion found, ends the wait or the backoff at
/// once, so a batch's last completion is never held back by a fixed sleep.
fn poll_loop<R: RailIo>(shared: &Shared<R>, n: usize) {
    tighten_timer_slack();
    let mut wcs = Vec::with_capacity(32);
    let mut idle = 0u32;
    let mut backoff = BACKOFF_MIN;
    while !shared.stop.load(Ordering::Acquire) {
        let seen = *lock(&shared.kicks);
        let mut any = false;
        for (i, r) in shared.rails[..n].iter().enumerate() {
            wcs.clear();
            if let Err(e) = r.io.poll(&mut wcs, 32) {
                let mut t = lock(&shared.tracker);
                if t.rail_dead(i).is_none() {
                    log::error!("rdma: rail {i}: {e}");
                    t.fail_rail(i, e.detail());
                    shared.cv.notify_all();
                }
                continue;
            }
            if wcs.is_empty() {
                continue;
            }
            any = true;
            let mut reposts = 0;
            {
                let mut t = lock(&shared.tracker);
                for wc in &wcs {
                    if wc.is_recv() {
                        if wc.status == 0 {
                            if let Some(imm) = wc.imm {
                                t.on_recv_imm(imm);
                            }
                            reposts += 1;
                        }
                    } else {
                        t.on_send_completion(i, wc.wr_id, wc.status, wc.vendor_err);
                    }
                }
            }
            if reposts > 0 {
                if let Err(e) = r.io.post_recvs(reposts) {
                    log::error!("rdma: rail {i}: re-posting {reposts} receive(s): {e}");
                }
            }
            shared.cv.notify_all();
        }
        if any {
            idle = 0;
            backoff = BACKOFF_MIN;
            continue;
        }
        idle = idle.saturating_add(1);
        if idle <= SPIN_POLLS {
            std::hint::spin_loop();
            continue;
        }
        let posting = shared.posting.load(Ordering::Acquire) > 0;
        let awaited = lock(&shared.tracker).awaited() > 0;
        let kicks = lock(&shared.kicks);
        if *kicks != seen {
            // Posted meanwhile: poll again at once.
            idle = 0;
            backoff = BACKOFF_MIN;
            continue;
        }
        if (awaited || shared.incoming) && !posting {
            let (k, r) = shared
                .kick_cv
                .wait_timeout_while(kicks, backoff, |k| *k == seen)
                .unwrap_or_else(|p| p.into_inner());
            drop(k);
            if r.timed_out() {
                if awaited {
                    shared.sleeps.fetch_add(1, Ordering::Relaxed);
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            } else {
                idle = 0;
                backoff = BACKOFF_MIN;
            }
        } else {
            // Nothing awaited and nothing can arrive unasked, or a post is
            // being handed to the NIC: park until a post's kick.
            drop(
                shared
                    .kick_cv
                    .wait_timeout_while(kicks, PARK, |k| *k == seen)
                    .unwrap_or_else(|p| p.into_inner()),
            );
            idle = 0;
            backoff = BACKOFF_MIN;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::handshake::RemoteRegion;
    use super::super::tracker::{WC_OP_RDMA_WRITE, WC_OP_RECV_RDMA_WITH_IMM};
    use super::super::wr::Opcode;
    use super::*;
    use std::collections::VecDeque;

    /// An in-memory queue pair: the [`RailIo`] of one rail, one layer below the
    /// whole software NIC of `rdma::fake` (`FakeNic`, used by the agent-level
    /// tests). Executes WRs synchronously at post time by copying bytes between
    /// real buffers of this process, checks keys, enforces the send-queue depth
    /// like hardware (ENOMEM when full), generates completions, delivers
    /// WRITE_WITH_IMM immediates to the peer's receive queue, and can be told to
    /// fail after `fail_after` WRs (then flushes everything, as a QP in error does).
    struct FakeQueuePair {
        sq_depth: usize,
        lkeys: Vec<(u64, u64, u32)>,
        rkeys: Vec<(u64, u64, u32)>,
        cq: Arc<Mutex<VecDeque<WorkCompletion>>>,
        peer_cq: Arc<Mutex<VecDeque<WorkCompletion>>>,
        recvs: Arc<AtomicUsize>,
        peer_recvs: Arc<AtomicUsize>,
        /// WR ids posted and not yet retired by a polled signalled completion.
        sq: Mutex<VecDeque<u64>>,
        fail_after: Option<usize>,
        executed: AtomicUsize,
        posts: AtomicUsize,
        dead: AtomicBool,
        /// While set, completions stay inside the NIC (a slow completion).
        hold: AtomicBool,
    }

    fn covers(keys: &[(u64, u64, u32)], key: u32, addr: u64, len: u64) -> bool {
        keys.iter()
            .any(|(a, l, k)| *k == key && addr >= *a && addr + len <= a + l)
    }

    impl FakeQueuePair {
        fn complete(&self, wr_id: u64, status: u32, opcode: u32) {
            lock(&self.cq).push_back(WorkCompletion {
                wr_id,
                status,
                vendor_err: 0,
                opcode,
                imm: None,
            });
        }
    }

    impl RailIo for FakeQueuePair {
        fn post_send(&self, wrs: &[WorkRequest]) -> std::result::Result<(), (usize, Error)> {
            {
                let mut sq = lock(&self.sq);
                if sq.len() + wrs.len() > self.sq_depth {
                    return Err((
                        0,
                        Error::new(Status::Rdma, "ibv_post_send: ENOMEM (send queue full)"),
                    ));
                }
                sq.extend(wrs.iter().map(|w| w.wr_id));
            }
            self.posts.fetch_add(1, Ordering::SeqCst);
            for w in wrs {
                if self.dead.load(Ordering::SeqCst) {
                    self.complete(w.wr_id, 5, 0);
                    continue;
                }
                let n = self.executed.fetch_add(1, Ordering::SeqCst);
                if self.fail_after == Some(n) {
                    self.dead.store(true, Ordering::SeqCst);
                    self.complete(w.wr_id, 12, 0);
                    continue;
                }
                let len = w.len as u64;
                if len > 0 && !covers(&self.lkeys, w.lkey, w.local_addr, len) {
                    self.dead.store(true, Ordering::SeqCst);
                    self.complete(w.wr_id, 4, 0);
                    continue;
                }
                if len > 0 && !covers(&self.rkeys, w.rkey, w.remote_addr, len) {
                    self.dead.store(true, Ordering::SeqCst);
                    self.complete(w.wr_id, 10, 0);
                    continue;
                }
                let (src, dst) = match w.opcode {
                    Opcode::Read => (w.remote_addr, w.local_addr),
                    _ => (w.local_addr, w.remote_addr),
                };
                // SAFETY: both ranges were checked against registered test buffers that
                // outlive the session, and source and destination never overlap in these tests.
                unsafe {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, w.len as usize)
                };
                if let Some(imm) = w.imm {
                    if self.peer_recvs.load(Ordering::SeqCst) == 0 {
                        self.dead.store(true, Ordering::SeqCst);
                        self.complete(w.wr_id, 13, 0);
                        continue;
                    }
                    self.peer_recvs.fetch_sub(1, Ordering::SeqCst);
                    lock(&self.peer_cq).push_back(WorkCompletion {
                        wr_id: u64::MAX,
                        status: 0,
                        vendor_err: 0,
                        opcode: WC_OP_RECV_RDMA_WITH_IMM,
                        imm: Some(imm),
                    });
                }
                if w.signaled {
                    self.complete(w.wr_id, 0, WC_OP_RDMA_WRITE);
                }
            }
            Ok(())
        }

        fn post_recvs(&self, n: usize) -> Result<()> {
            self.recvs.fetch_add(n, Ordering::SeqCst);
            Ok(())
        }

        fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize> {
            if self.hold.load(Ordering::SeqCst) {
                return Ok(0);
            }
            let mut cq = lock(&self.cq);
            let mut got = 0;
            while got < max {
                let Some(c) = cq.pop_front() else { break };
                if !c.is_recv() {
                    // A polled send completion retires its WR and every earlier one.
                    let mut sq = lock(&self.sq);
                    if sq.contains(&c.wr_id) {
                        while let Some(id) = sq.pop_front() {
                            if id == c.wr_id {
                                break;
                            }
                        }
                    }
                }
                out.push(c);
                got += 1;
            }
            Ok(got)
        }
    }

    const SQ: u32 = 16;

    struct Pair {
        a: Session<Arc<FakeQueuePair>>,
        b: Session<Arc<FakeQueuePair>>,
        a_nics: Vec<Arc<FakeQueuePair>>,
    }

    impl RailIo for Arc<FakeQueuePair> {
        fn post_send(&self, wrs: &[WorkRequest]) -> std::result::Result<(), (usize, Error)> {
            (**self).post_send(wrs)
        }
        fn post_recvs(&self, n: usize) -> Result<()> {
            (**self).post_recvs(n)
        }
        fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize> {
            (**self).poll(out, max)
        }
    }

    /// Two sessions A and B over `rails` fake NIC pairs. A's region `a` and B's
    /// region `b` are registered with a different key on every rail.
    fn pair(
        rails: usize,
        a: &[u8],
        b: &[u8],
        fail: Option<(usize, usize)>,
        record: RecordMode,
    ) -> Pair {
        let (aa, al) = (a.as_ptr() as u64, a.len() as u64);
        let (ba, bl) = (b.as_ptr() as u64, b.len() as u64);
        let params = SessionParams {
            signal_every: 4,
            min_slice: 1000,
            record,
            post_timeout: Duration::from_secs(5),
        };
        let mut a_rails = Vec::new();
        let mut b_rails = Vec::new();
        let mut a_nics = Vec::new();
        let mut a_keys = Vec::new();
        let mut b_keys = Vec::new();
        for r in 0..rails {
            let (ka, kb) = (100 + r as u32, 200 + r as u32);
            let (cqa, cqb) = (
                Arc::new(Mutex::new(VecDeque::new())),
                Arc::new(Mutex::new(VecDeque::new())),
            );
            let (ra, rb) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
            let nic = |lk, rk, cq: &Arc<_>, pcq: &Arc<_>, rc: &Arc<_>, prc: &Arc<_>, fail_after| {
                Arc::new(FakeQueuePair {
                    sq_depth: SQ as usize,
                    lkeys: lk,
                    rkeys: rk,
                    cq: Arc::clone(cq),
                    peer_cq: Arc::clone(pcq),
                    recvs: Arc::clone(rc),
                    peer_recvs: Arc::clone(prc),
                    sq: Mutex::new(VecDeque::new()),
                    fail_after,
                    executed: AtomicUsize::new(0),
                    posts: AtomicUsize::new(0),
                    dead: AtomicBool::new(false),
                    hold: AtomicBool::new(false),
                })
            };
            let fa = fail.filter(|(rail, _)| *rail == r).map(|(_, n)| n);
            let na = nic(
                vec![(aa, al, ka)],
                vec![(ba, bl, kb)],
                &cqa,
                &cqb,
                &ra,
                &rb,
                fa,
            );
            let nb = nic(
                vec![(ba, bl, kb)],
                vec![(aa, al, ka)],
                &cqb,
                &cqa,
                &rb,
                &ra,
                None,
            );
            a_nics.push(na.clone());
            a_rails.push(SessionRail::new(na, 100, 4096, SQ, 8));
            b_rails.push(SessionRail::new(nb, 100, 4096, SQ, 8));
            a_keys.push(RailKeys::new(
                vec![LocalRegion {
                    addr: aa,
                    len: al,
                    lkey: ka,
                }],
                vec![RemoteRegion {
                    addr: ba,
                    len: bl,
                    rkey: kb,
                }],
            ));
            b_keys.push(RailKeys::new(
                vec![LocalRegion {
                    addr: ba,
                    len: bl,
                    lkey: kb,
                }],
                vec![RemoteRegion {
                    addr: aa,
                    len: al,
                    rkey: ka,
                }],
            ));
        }
        let mut a = Session::new(a_rails, params);
        let mut b = Session::new(b_rails, params);
        a.start(a_keys).unwrap();
        b.start(b_keys).unwrap();
        Pair { a, b, a_nics }
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn wait_incoming(s: &Session<Arc<FakeQueuePair>>) -> Option<u32> {
        for _ in 0..500 {
            if let Some(b) = s.next_incoming() {
                return Some(b);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        None
    }

    #[test]
    fn write_batch_moves_the_right_bytes_across_two_rails_and_notifies_the_peer() {
        let src = pattern(256 << 10, 7);
        let dst = vec![0u8; 256 << 10];
        let p = pair(2, &src, &dst, None, RecordMode::Immediate);
        let (s0, d0) = (src.as_ptr() as u64, dst.as_ptr() as u64);
        // 40 scattered small writes (reversed order) plus one 100 KiB write that is
        // sliced across both rails and split into 4 KiB messages.
        let mut spans: Vec<Span> = (0..40u64)
            .map(|i| Span {
                local_addr: s0 + i * 1000,
                remote_addr: d0 + 200_000 - i * 1000,
                len: 700,
            })
            .collect();
        spans.push(Span {
            local_addr: s0 + 50_000,
            remote_addr: d0 + 10_000,
            len: 100 << 10,
        });
        let total: u64 = spans.iter().map(|s| s.len).sum();
        p.a.post_batch(42, Direction::Write, &spans).unwrap();
        assert_eq!(
            p.a.wait(42, Duration::from_secs(5)).unwrap(),
            BatchState::Done { bytes: total }
        );
        let mut want = vec![0u8; dst.len()];
        for s in &spans {
            let (l, r) = ((s.local_addr - s0) as usize, (s.remote_addr - d0) as usize);
            want[r..r + s.len as usize].copy_from_slice(&src[l..l + s.len as usize]);
        }
        assert!(dst == want, "destination bytes differ from the plan");
        // Both rails carried data, each under its own keys, within the queue depth.
        assert!(p.a_nics.iter().all(|n| n.posts.load(Ordering::SeqCst) > 0));
        assert!(p.a_nics.iter().all(|n| !n.dead.load(Ordering::SeqCst)));
        // The peer learns the batch once the records of both rails arrived.
        assert_eq!(wait_incoming(&p.b), Some(42));
        assert_eq!(p.b.next_incoming(), None);
        // Finished batches are forgotten.
        assert!(p.a.poll(42).is_err());
    }

    #[test]
    fn read_batch_pulls_remote_bytes() {
        let local = vec![0u8; 64 << 10];
        let remote = pattern(64 << 10, 3);
        let p = pair(2, &local, &remote, None, RecordMode::Immediate);
        let span = Span {
            local_addr: local.as_ptr() as u64 + 100,
            remote_addr: remote.as_ptr() as u64 + 5000,
            len: 30_000,
        };
        p.a.post_batch(1, Direction::Read, &[span]).unwrap();
        assert_eq!(
            p.a.wait(1, Duration::from_secs(5)).unwrap(),
            BatchState::Done { bytes: 30_000 }
        );
        assert_eq!(&local[100..30_100], &remote[5000..35_000]);
        // Reads send no completion record.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(p.b.next_incoming(), None);
    }

    #[test]
    fn final_write_record_lands_last_on_one_rail() {
        let src = pattern(32 << 10, 9);
        let dst = vec![0u8; 32 << 10];
        let p = pair(2, &src, &dst, None, RecordMode::None);
        let (s0, d0) = (src.as_ptr() as u64, dst.as_ptr() as u64);
        let spans = [Span {
            local_addr: s0,
            remote_addr: d0,
            len: 20_000,
        }];
        let record = Span {
            local_addr: s0 + 30_000,
            remote_addr: d0 + 30_000,
            len: 8,
        };
        p.a.post_batch_with_record(3, &spans, record).unwrap();
        assert_eq!(
            p.a.wait(3, Duration::from_secs(5)).unwrap(),
            BatchState::Done { bytes: 20_000 }
        );
        assert_eq!(&dst[..20_000], &src[..20_000]);
        assert_eq!(&dst[30_000..30_008], &src[30_000..30_008]);
        // Batch 3 over 2 rails: all of it on rail 1, nothing on rail 0.
        assert_eq!(p.a_nics[0].posts.load(Ordering::SeqCst), 0);
        assert!(p.a_nics[1].posts.load(Ordering::SeqCst) > 0);
        assert_eq!(
            p.b.next_incoming(),
            None,
            "no immediate in RecordMode::None"
        );
    }

    #[test]
    fn a_failed_write_fails_the_batch_once_and_is_never_reposted() {
        let src = pattern(128 << 10, 1);
        let dst = vec![0u8; 128 << 10];
        // Rail 1 fails on its 6th WR.
        let p = pair(2, &src, &dst, Some((1, 5)), RecordMode::Immediate);
        let span = Span {
            local_addr: src.as_ptr() as u64,
            remote_addr: dst.as_ptr() as u64,
            len: 100 << 10,
        };
        let r = p.a.post_batch(9, Direction::Write, &[span]);
        // Posting may already see the dead rail (its error is then the batch's
        // one report, and the batch is forgotten), or the failure shows at completion.
        let state = match r {
            Ok(()) => p.a.wait(9, Duration::from_secs(5)).unwrap(),
            Err(e) => BatchState::Failed(e),
        };
        match state {
            BatchState::Failed(e) => {
                assert_eq!(e.status(), Status::RdmaCompletion);
                assert!(e.detail().contains("IBV_WC_RETRY_EXC_ERR"), "{e}");
                assert!(e.detail().contains("not retried"), "{e}");
            }
            s => panic!("expected a failure, got {s:?}"),
        }
        let executed = p.a_nics[1].executed.load(Ordering::SeqCst);
        let posts = p.a_nics[1].posts.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(
            p.a_nics[1].executed.load(Ordering::SeqCst),
            executed,
            "nothing re-executed"
        );
        assert_eq!(
            p.a_nics[1].posts.load(Ordering::SeqCst),
            posts,
            "nothing re-posted"
        );
        // The peer never hears of the failed batch.
        assert_eq!(p.b.next_incoming(), None);
        // The dead rail refuses further batches with the reason.
        let e = p.a.post_batch(10, Direction::Write, &[span]).unwrap_err();
        assert!(e.detail().contains("reconnect"), "{e}");
    }

    #[test]
    fn out_of_bounds_spans_post_nothing() {
        let src = pattern(4096, 1);
        let dst = vec![0u8; 4096];
        let p = pair(2, &src, &dst, None, RecordMode::Immediate);
        let bad = Span {
            local_addr: src.as_ptr() as u64,
            remote_addr: dst.as_ptr() as u64 + 4000,
            len: 200,
        };
        let e = p.a.post_batch(1, Direction::Write, &[bad]).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds, "{e}");
        assert!(p.a_nics.iter().all(|n| n.posts.load(Ordering::SeqCst) == 0));
        assert!(p.a.poll(1).is_err(), "the batch was never started");
        assert!(dst.iter().all(|b| *b == 0));
    }

    #[test]
    fn unstarted_session_and_duplicate_batches_are_refused() {
        let src = pattern(8192, 1);
        let dst = vec![0u8; 8192];
        let p = pair(1, &src, &dst, None, RecordMode::Immediate);
        let s = Span {
            local_addr: src.as_ptr() as u64,
            remote_addr: dst.as_ptr() as u64,
            len: 8192,
        };
        p.a.post_batch(5, Direction::Write, &[s]).unwrap();
        // Reusing an id before its completion was collected is refused.
        let e = p.a.post_batch(5, Direction::Write, &[s]).unwrap_err();
        assert!(e.detail().contains("already in flight"), "{e}");
        assert!(matches!(
            p.a.wait(5, Duration::from_secs(5)).unwrap(),
            BatchState::Done { .. }
        ));
        let idle: Session<Arc<FakeQueuePair>> = Session::new(Vec::new(), p.a.params);
        let e = idle.post_batch(1, Direction::Write, &[s]).unwrap_err();
        assert_eq!(e.status(), Status::PeerUnreachable);
    }

    /// After the poller went idle, a batch whose completions the NIC has at
    /// once is picked up by the post's wake-up, not after a sleep: the
    /// poller takes no full-length wait while the batches are awaited.
    #[test]
    fn completions_after_idle_are_not_delayed_by_a_poller_sleep() {
        let src = pattern(64 << 10, 2);
        let dst = vec![0u8; 64 << 10];
        let p = pair(2, &src, &dst, None, RecordMode::None);
        let span = Span {
            local_addr: src.as_ptr() as u64,
            remote_addr: dst.as_ptr() as u64,
            len: 40_000,
        };
        for b in 1..=20u32 {
            // idle long enough for a poller that sleeps at fixed intervals to be asleep
            std::thread::sleep(Duration::from_millis(2));
            p.a.post_batch(b, Direction::Write, &[span]).unwrap();
            assert_eq!(
                p.a.wait(b, Duration::from_secs(5)).unwrap(),
                BatchState::Done { bytes: 40_000 }
            );
        }
        assert_eq!(p.a.poller_sleeps(), 0, "a completion waited for a sleep");
        assert_eq!(&dst[..40_000], &src[..40_000]);
    }

    /// While a batch is awaited and the NIC is slow, the poller backs off
    /// (it does not burn the core forever) and counts its waits.
    #[test]
    fn a_slow_completion_makes_the_poller_back_off() {
        let src = pattern(8192, 1);
        let dst = vec![0u8; 8192];
        let p = pair(1, &src, &dst, None, RecordMode::None);
        p.a_nics[0].hold.store(true, Ordering::SeqCst);
        let s = Span {
            local_addr: src.as_ptr() as u64,
            remote_addr: dst.as_ptr() as u64,
            len: 8192,
        };
        p.a.post_batch(1, Direction::Write, &[s]).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        p.a_nics[0].hold.store(false, Ordering::SeqCst);
        assert!(matches!(
            p.a.wait(1, Duration::from_secs(5)).unwrap(),
            BatchState::Done { .. }
        ));
        let n = p.a.poller_sleeps();
        // 20 ms of waiting in waits of 1 us doubling to 64 us: a few hundred
        assert!(n > 5 && n < 20_000, "{n} backoff waits");
    }
}
