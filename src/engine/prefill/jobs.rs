//! The prefill's job queue: the chunks `send` queued, handed to the transfer
//! workers so that one stalled or dead decode rank delays only its own rooms.
//!
//! A worker takes the oldest job whose room and whose decode ranks no other
//! worker is serving: a room's chunks stay in order (one at a time, oldest
//! first), and a decode rank is in flight on one worker at most, so a decode
//! that stops answering holds one worker (until its batches time out) while
//! the others go on with the rooms of every other decode rank. A job whose
//! ready flag is unset is not taken: it holds no worker and blocks neither
//! its decode ranks nor other rooms (only its own room's later chunks), and
//! the ready jobs behind it run first. A room's
//! close (its grants' RoomEnd/RoomAck, after its last chunk moved) runs on a
//! thread of its own, so a decode slow to answer it holds no worker at all.

use crate::engine::layers::Ready;
use crate::engine::ready_bell::FlagWatcher;
use crate::engine::state::lock;
use std::collections::{HashSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// One chunk (or layer group of one) that `send` queued for the workers.
pub(in crate::engine) struct Job {
    pub(in crate::engine) room: u64,
    pub(in crate::engine) attempt: u64,
    pub(in crate::engine) pages: Vec<u64>,
    pub(in crate::engine) start: u64,
    pub(in crate::engine) num_tokens: u64,
    pub(in crate::engine) last: bool,
    pub(in crate::engine) aux_index: u64,
    pub(in crate::engine) state_indices: Vec<u64>,
    /// When `send` queued the chunk.
    pub(in crate::engine) queued: Instant,
    /// The room's decode ranks (see [`JobQueue`]).
    pub(in crate::engine) peers: Vec<PeerKey>,
    /// The layers (topology entries) whose rows this job moves.
    pub(in crate::engine) layers: Range<usize>,
    /// Part of a chunk sent layer by layer: the chunk's plan is made by its
    /// first job and reused by the others.
    pub(in crate::engine) layered: bool,
    /// What the rows depend on (the caller's CUDA event or ready flag).
    pub(in crate::engine) ready: Ready,
}

/// A decode rank as the scheduler tells them apart (its link's address).
pub(in crate::engine) type PeerKey = usize;

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    busy_rooms: HashSet<u64>,
    busy_peers: HashSet<PeerKey>,
    /// (room, attempt) whose jobs are taken with their ready flag unset: the
    /// room ended (the worker's wait then fails at once).
    released: HashSet<(u64, u64)>,
    /// One idle worker watches the ready flags of the waiting jobs; the
    /// others sleep until a job is queued or finished.
    watched: bool,
}

impl State {
    fn eligible(&self, j: &Job) -> bool {
        !self.busy_rooms.contains(&j.room) && j.peers.iter().all(|p| !self.busy_peers.contains(p))
    }

    /// Whether the job's rows are ready to read (no flag, or it is set), or
    /// its room was released.
    fn runnable(&self, j: &Job) -> bool {
        j.ready.flag.as_ref().is_none_or(|f| f.is_set())
            || self.released.contains(&(j.room, j.attempt))
    }

    /// The oldest job to take: its room's first queued job, its room and
    /// decode ranks free, its rows ready. Also says whether some job waits
    /// only for its ready flag.
    fn next(&self) -> (Option<usize>, bool) {
        let mut passed: HashSet<u64> = HashSet::new();
        let mut flagged = false;
        for (i, j) in self.queue.iter().enumerate() {
            if passed.contains(&j.room) {
                continue;
            }
            if self.eligible(j) {
                if self.runnable(j) {
                    return (Some(i), flagged);
                }
                flagged = true;
            }
            // a room's later chunks wait for its first
            passed.insert(j.room);
        }
        (None, flagged)
    }
}

/// How often the idle worker watching the ready flags of the waiting jobs
/// looks at them (the caller sets a flag without telling anyone).
const FLAG_POLL: Duration = Duration::from_micros(20);

/// The queue's jobs and the condition its workers wait on; told by the
/// ready flags of its waiting jobs when they are set.
#[derive(Default)]
struct Core {
    state: Mutex<State>,
    cv: Condvar,
}

impl FlagWatcher for Core {
    fn flag_set(&self) {
        // taking the lock orders the wake after a watcher's look at the
        // flags: it saw the flag set, or it waits already and is woken
        drop(lock(&self.state));
        self.cv.notify_all();
    }
}

/// See the module documentation.
#[derive(Default)]
pub(in crate::engine) struct JobQueue {
    core: Arc<Core>,
    /// Room closes running on threads of their own (see [`start_close`](Self::start_close)).
    closing: AtomicUsize,
}

/// Room closes at most on threads of their own at once; beyond, a worker
/// closes its room itself.
const MAX_CLOSERS: usize = 256;

impl JobQueue {
    /// Queues a job.
    pub(in crate::engine) fn push(&self, job: Job) {
        if let Some(f) = &job.ready.flag {
            let core: Arc<dyn FlagWatcher> = self.core.clone();
            f.watch(Arc::downgrade(&core));
        }
        lock(&self.core.state).queue.push_back(job);
        self.core.cv.notify_all();
    }

    /// The oldest job no other worker's room or decode rank blocks and whose
    /// rows are ready (a job waiting for its ready flag holds no worker and
    /// blocks no other room), marked busy until [`done`](Self::done); `None`
    /// after `wait` without one.
    pub(in crate::engine) fn take(&self, wait: Duration) -> Option<Job> {
        let mut st = lock(&self.core.state);
        let end = std::time::Instant::now() + wait;
        let mut watching = false;
        loop {
            let (found, flagged) = st.next();
            if watching && (found.is_some() || !flagged) {
                // handed on: another idle worker watches what is left
                st.watched = false;
                watching = false;
                self.core.cv.notify_all();
            }
            if let Some(i) = found {
                let j = st.queue.remove(i).expect("position is in the queue");
                st.busy_rooms.insert(j.room);
                st.busy_peers.extend(j.peers.iter().copied());
                let key = (j.room, j.attempt);
                if st.released.contains(&key)
                    && !st.queue.iter().any(|q| (q.room, q.attempt) == key)
                {
                    st.released.remove(&key);
                }
                return Some(j);
            }
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                if watching {
                    st.watched = false;
                    self.core.cv.notify_all();
                }
                return None;
            }
            if flagged && !st.watched {
                st.watched = true;
                watching = true;
            }
            let nap = if watching { left.min(FLAG_POLL) } else { left };
            st = self
                .core
                .cv
                .wait_timeout(st, nap)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The room's next queued job after `held` (a layer group taken by this
    /// worker, which holds the room and its decode ranks) when it is a layer
    /// group of the same attempt and decode ranks whose rows are ready and
    /// that waits for no CUDA event: taken without a busy mark of its own
    /// (the worker's [`done`](Self::done) of `held` frees both).
    pub(in crate::engine) fn take_follow(&self, held: &Job) -> Option<Job> {
        let mut st = lock(&self.core.state);
        let i = st.queue.iter().position(|j| j.room == held.room)?;
        let j = &st.queue[i];
        let follows = j.attempt == held.attempt
            && j.layered
            && j.peers == held.peers
            && j.ready.cuda_event.is_none()
            && st.runnable(j);
        if !follows {
            return None;
        }
        st.queue.remove(i)
    }

    /// The (room, attempt) of the queued jobs whose ready flag is unset.
    pub(in crate::engine) fn waiting(&self) -> Vec<(u64, u64)> {
        let st = lock(&self.core.state);
        let mut v: Vec<(u64, u64)> = st
            .queue
            .iter()
            .filter(|j| !st.runnable(j))
            .map(|j| (j.room, j.attempt))
            .collect();
        v.dedup();
        v
    }

    /// The rooms `ended` ended: their queued jobs are taken with their ready
    /// flag unset (the worker's wait fails them at once).
    pub(in crate::engine) fn release(&self, ended: &[(u64, u64)]) {
        if ended.is_empty() {
            return;
        }
        lock(&self.core.state)
            .released
            .extend(ended.iter().copied());
        self.core.cv.notify_all();
    }

    /// Reserves a room close on a thread of its own (false: too many run
    /// already, the worker closes it); [`end_close`](Self::end_close) when done.
    pub(in crate::engine) fn start_close(&self) -> bool {
        self.closing
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_CLOSERS).then_some(n + 1)
            })
            .is_ok()
    }

    /// A room close reserved with [`start_close`](Self::start_close) ended.
    pub(in crate::engine) fn end_close(&self) {
        self.closing.fetch_sub(1, Ordering::AcqRel);
    }

    /// The job taken is finished: its room and decode ranks are free again.
    pub(in crate::engine) fn done(&self, job: &Job) {
        let mut st = lock(&self.core.state);
        st.busy_rooms.remove(&job.room);
        for p in &job.peers {
            st.busy_peers.remove(p);
        }
        drop(st);
        self.core.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(room: u64, peers: &[PeerKey]) -> Job {
        Job {
            room,
            attempt: 1,
            pages: Vec::new(),
            start: 0,
            num_tokens: 0,
            last: false,
            aux_index: 0,
            state_indices: Vec::new(),
            peers: peers.to_vec(),
            queued: std::time::Instant::now(),
            layers: 0..0,
            layered: false,
            ready: Default::default(),
        }
    }

    const NOW: Duration = Duration::ZERO;

    #[test]
    fn a_busy_peer_blocks_only_its_own_rooms() {
        let q = JobQueue::default();
        q.push(job(1, &[10])); // to the stalled decode
        q.push(job(2, &[10])); // another room to it
        q.push(job(3, &[20])); // healthy decodes
        q.push(job(4, &[30]));
        let stuck = q.take(NOW).unwrap();
        assert_eq!(stuck.room, 1);
        // while room 1's worker waits on decode 10, the others are served
        let a = q.take(NOW).unwrap();
        assert_eq!(a.room, 3);
        q.done(&a);
        let b = q.take(NOW).unwrap();
        assert_eq!(b.room, 4);
        q.done(&b);
        assert!(q.take(NOW).is_none(), "room 2 waits for decode 10");
        q.done(&stuck);
        assert_eq!(q.take(NOW).unwrap().room, 2);
    }

    #[test]
    fn a_set_flag_wakes_the_queue_that_holds_its_job() {
        use crate::engine::layers::ReadyFlag;
        use std::sync::atomic::AtomicU64;
        use std::sync::Arc;
        let q = Arc::new(JobQueue::default());
        let flag = ReadyFlag::new(Arc::new(AtomicU64::new(0)));
        let mut waits = job(3, &[10]);
        waits.ready.flag = Some(flag.clone());
        q.push(waits);
        assert_eq!(flag.watchers(), 1, "the queue watches its job's flag");
        let q2 = q.clone();
        let taker = std::thread::spawn(move || q2.take(Duration::from_secs(10)).map(|j| j.room));
        std::thread::sleep(Duration::from_millis(20));
        flag.set();
        assert_eq!(taker.join().unwrap(), Some(3));
        drop(q);
        assert_eq!(flag.watchers(), 0, "a dropped queue is no watcher");
    }

    #[test]
    fn jobs_waiting_for_their_ready_flag_hold_nothing() {
        use crate::engine::layers::ReadyFlag;
        use std::sync::atomic::AtomicU64;
        use std::sync::Arc;
        let q = JobQueue::default();
        let flag = Arc::new(AtomicU64::new(0));
        let mut waits = job(1, &[10]);
        waits.ready.flag = Some(ReadyFlag::new(flag.clone()));
        q.push(waits);
        q.push(job(1, &[10])); // the same room's next chunk
        q.push(job(2, &[10])); // another room to the same decode
                               // the ready room to the same decode runs first; room 1 waits
        let a = q.take(NOW).unwrap();
        assert_eq!(a.room, 2);
        q.done(&a);
        assert!(q.take(NOW).is_none(), "room 1's chunks wait for its flag");
        assert_eq!(q.waiting(), vec![(1, 1)]);
        flag.store(1, std::sync::atomic::Ordering::Release);
        let b = q.take(Duration::from_millis(100)).unwrap();
        assert_eq!(b.room, 1);
        assert!(b.ready.flag.is_some(), "the flagged chunk first");
        q.done(&b);
        assert_eq!(q.take(NOW).unwrap().room, 1);
        // a released room's job is taken with its flag unset
        let mut never = job(3, &[20]);
        never.ready.flag = Some(ReadyFlag::new(Arc::new(AtomicU64::new(0))));
        q.push(never);
        assert!(q.take(NOW).is_none());
        q.release(&[(3, 1)]);
        assert_eq!(q.take(NOW).unwrap().room, 3);
        assert!(q.waiting().is_empty());
    }

    #[test]
    fn a_layer_group_is_followed_by_its_rooms_next_ready_one() {
        use crate::engine::layers::ReadyFlag;
        use std::sync::atomic::AtomicU64;
        use std::sync::Arc;
        let q = JobQueue::default();
        let group = |room, layers: Range<usize>| Job {
            layered: true,
            layers,
            ..job(room, &[1])
        };
        let flag = Arc::new(AtomicU64::new(0));
        q.push(group(4, 0..2));
        q.push(group(5, 0..2)); // another room: never a follow-up
        q.push(group(4, 2..4));
        let mut unset = group(4, 4..6);
        unset.ready.flag = Some(ReadyFlag::new(flag.clone()));
        q.push(unset);
        let a = q.take(NOW).unwrap();
        assert_eq!((a.room, a.layers.clone()), (4, 0..2));
        let b = q.take_follow(&a).unwrap();
        assert_eq!((b.room, b.layers.clone()), (4, 2..4));
        assert!(q.take_follow(&a).is_none(), "its flag is unset");
        flag.store(1, std::sync::atomic::Ordering::Release);
        assert_eq!(q.take_follow(&a).unwrap().layers, 4..6);
        assert!(q.take_follow(&a).is_none());
        // the worker's done frees the room and its decode rank for room 5
        assert!(q.take(NOW).is_none(), "decode 1 is busy");
        q.done(&a);
        assert_eq!(q.take(NOW).unwrap().room, 5);
    }

    #[test]
    fn a_rooms_chunks_run_one_at_a_time_in_order() {
        let q = JobQueue::default();
        let mut first = job(7, &[1]);
        first.start = 0;
        let mut second = job(7, &[1]);
        second.start = 16;
        q.push(first);
        q.push(second);
        q.push(job(8, &[2, 1])); // shares decode 1
        let a = q.take(NOW).unwrap();
        assert_eq!((a.room, a.start), (7, 0));
        assert!(q.take(NOW).is_none());
        assert!(q.take_follow(&a).is_none(), "whole chunks are not followed");
        q.done(&a);
        let b = q.take(NOW).unwrap();
        assert_eq!((b.room, b.start), (7, 16));
        q.done(&b);
        assert_eq!(q.take(NOW).unwrap().room, 8);
    }
}
