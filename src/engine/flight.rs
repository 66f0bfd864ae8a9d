//! [`Flight`]: the batches of one chunk in flight together, each one of its
//! room's fenced writes, and the host staging slots they read.

use super::link::DecodeLink;
use super::room::RoomTable;
use super::state::lock;
use crate::error::{Error, Result};
use crate::transport::{BatchId, BatchOptions, PlacedRange, Transport, TransportKind, WriteOp};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// The data connection it was submitted on (the link may have made a
    /// new one since: batch ids are per connection).
    data: Arc<dyn Transport>,
    id: BatchId,
    slot: Option<usize>,
    /// Bytes the batch writes (all of them read from staging with a slot).
    bytes: u64,
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
    /// tcp links may resume the room on a new connection: every write
    /// submitted over tcp is kept in `tcp_sent`, and a batch that fails
    /// because its tcp connection broke is not an error of the flight: its
    /// link goes to `broken` (the caller resumes it).
    pub(super) resumable: bool,
    /// The writes submitted over tcp, per link (with `resumable`).
    pub(super) tcp_sent: Vec<(Arc<DecodeLink>, Vec<WriteOp>)>,
    /// Links whose tcp connection broke under a batch, and why (with
    /// `resumable`; each link once).
    pub(super) broken: Vec<(Arc<DecodeLink>, Error)>,
}

impl<'a> Flight<'a> {
    pub(super) fn new(rooms: &'a Mutex<RoomTable>, opts: BatchOptions) -> Flight<'a> {
        Flight {
            rooms,
            opts,
            pending: Vec::new(),
            turns: 0,
            resumable: false,
            tcp_sent: Vec::new(),
            broken: Vec::new(),
        }
    }

    /// With `resumable`: whether a failure of a batch on `data` is its tcp
    /// connection breaking (recorded in `broken`: not the flight's error).
    fn broke(&mut self, link: &Arc<DecodeLink>, data: &Arc<dyn Transport>, e: &Error) -> bool {
        if !self.resumable || data.kind() != TransportKind::Tcp || data.is_alive() {
            return false;
        }
        if !self.broken.iter().any(|(l, _)| Arc::ptr_eq(l, link)) {
            self.broken.push((link.clone(), e.clone()));
        }
        true
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
        let bytes = ops.iter().map(|o| o.len).sum();
        let data = link.data();
        if self.resumable && data.kind() == TransportKind::Tcp {
            match self.tcp_sent.iter_mut().find(|(l, _)| Arc::ptr_eq(l, link)) {
                Some((_, v)) => v.extend_from_slice(ops),
                None => self.tcp_sent.push((link.clone(), ops.to_vec())),
            }
        }
        let t0 = Instant::now();
        let r = data.submit(ops, &self.opts);
        link.counters.add_wire(t0);
        match r {
            Ok(id) => {
                if slot.is_some() {
                    link.counters.staged_bytes.fetch_add(bytes, Relaxed);
                }
                self.pending.push(InFlight {
                    link: link.clone(),
                    data,
                    id,
                    slot,
                    bytes,
                });
                Ok(())
            }
            Err(e) => {
                link.counters.failed_batches.fetch_add(1, Relaxed);
                lock(self.rooms).end_write(room, epoch);
                let e = write_error(room, link, &e);
                if self.broke(link, &data, &e) {
                    return Ok(());
                }
                Err(e)
            }
        }
    }

    /// Submits a batch whose bytes `place` writes into `data`'s mapped
    /// destination ranges once the peer granted them
    /// ([`Transport::submit_placed`]), as one of the room's writes in flight;
    /// `data` must be the connection the caller took the mapped addresses
    /// from. Nothing for no ranges.
    pub(super) fn submit_placed(
        &mut self,
        link: &Arc<DecodeLink>,
        data: Arc<dyn Transport>,
        ranges: &[PlacedRange],
        place: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        if ranges.is_empty() {
            return Ok(());
        }
        let (room, epoch) = (self.opts.room, self.opts.epoch);
        lock(self.rooms).begin_write(room, epoch)?;
        let bytes = ranges.iter().map(|r| r.len).sum();
        match data.submit_placed(ranges, &self.opts, place) {
            Ok(id) => {
                self.pending.push(InFlight {
                    link: link.clone(),
                    data,
                    id,
                    slot: None,
                    bytes,
                });
                Ok(())
            }
            Err(e) => {
                link.counters.failed_batches.fetch_add(1, Relaxed);
                lock(self.rooms).end_write(room, epoch);
                Err(write_error(room, link, &e))
            }
        }
    }

    /// Waits for the `i`-th pending batch (removed either way).
    fn wait_at(&mut self, i: usize) -> Result<()> {
        let b = self.pending.remove(i);
        let t0 = Instant::now();
        let r = b
            .data
            .wait(b.id, self.opts.timeout + Duration::from_secs(1));
        let c = &b.link.counters;
        c.add_wire(t0);
        if b.slot.is_some() {
            c.staged_bytes.fetch_sub(b.bytes, Relaxed);
        }
        if r.is_ok() {
            c.batches.fetch_add(1, Relaxed);
            c.bytes.fetch_add(b.bytes, Relaxed);
        } else {
            c.failed_batches.fetch_add(1, Relaxed);
        }
        lock(self.rooms).end_write(self.opts.room, self.opts.epoch);
        match r {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = write_error(self.opts.room, &b.link, &e);
                if self.broke(&b.link, &b.data, &e) {
                    return Ok(());
                }
                Err(e)
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::schema::{InstanceId, PeerHello, Registration, Role};
    use crate::engine::control::{CtlWriter, RegionMap};
    use crate::engine::path::{Conn, WritePath};
    use crate::engine::room::KvPoll;
    use crate::error::Status;
    use crate::layout::Topology;
    use crate::memory::RegionDesc;
    use crate::transport::{BatchStatus, Completion, Transport, TransportKind};
    use std::collections::HashMap;
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::AtomicBool;
    use std::sync::Condvar;

    /// The batches of every fake link. Ids are unique across links, and a
    /// batch completes only once the test finishes it (from any thread).
    #[derive(Default)]
    struct Fabric {
        state: Mutex<FabricState>,
        finished: Condvar,
    }

    #[derive(Default)]
    struct FabricState {
        next: u64,
        /// Every accepted batch, in submission order.
        submitted: Vec<(u64, Vec<WriteOp>)>,
        /// Outcomes of finished batches not yet waited for.
        outcomes: HashMap<u64, Result<()>>,
        /// Batches in the order their waits returned.
        waited: Vec<u64>,
        /// The error the next submit fails with.
        refuse_next: Option<Error>,
    }

    impl Fabric {
        fn finish(&self, id: u64, outcome: Result<()>) {
            lock(&self.state).outcomes.insert(id, outcome);
            self.finished.notify_all();
        }

        fn submitted(&self) -> Vec<u64> {
            lock(&self.state).submitted.iter().map(|b| b.0).collect()
        }

        fn waited(&self) -> Vec<u64> {
            lock(&self.state).waited.clone()
        }
    }

    /// One link's transport on the fabric.
    struct FakeTransport(Arc<Fabric>);

    impl Transport for FakeTransport {
        fn kind(&self) -> TransportKind {
            TransportKind::Tcp
        }

        fn remote_regions(&self) -> Vec<RegionDesc> {
            Vec::new()
        }

        fn submit(&self, ops: &[WriteOp], _opts: &BatchOptions) -> Result<BatchId> {
            let mut s = lock(&self.0.state);
            if let Some(e) = s.refuse_next.take() {
                return Err(e);
            }
            s.next += 1;
            let id = s.next;
            s.submitted.push((id, ops.to_vec()));
            Ok(BatchId(id))
        }

        fn poll(&self, id: BatchId) -> Result<BatchStatus> {
            let mut s = lock(&self.0.state);
            Ok(match s.outcomes.remove(&id.0) {
                None => BatchStatus::Pending,
                Some(Ok(())) => BatchStatus::Done(completion(id)),
                Some(Err(e)) => BatchStatus::Failed(e),
            })
        }

        fn wait(&self, id: BatchId, timeout: Duration) -> Result<Completion> {
            let end = Instant::now() + timeout;
            let mut s = lock(&self.0.state);
            loop {
                if let Some(outcome) = s.outcomes.remove(&id.0) {
                    s.waited.push(id.0);
                    return outcome.map(|()| completion(id));
                }
                let now = Instant::now();
                if now >= end {
                    return Err(Error::new(Status::Timeout, "the test never finished it"));
                }
                s = self
                    .0
                    .finished
                    .wait_timeout(s, end - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }

        fn close(&self) {}

        fn is_alive(&self) -> bool {
            true
        }
    }

    fn completion(id: BatchId) -> Completion {
        Completion {
            batch_id: id,
            bytes: 0,
            checksum: None,
            room: ROOM,
            epoch: 1,
        }
    }

    const ROOM: u64 = 7;

    /// A decode link of instance `instance` over the fabric (its control
    /// writer is a loopback socket the flight never uses).
    fn link(fabric: &Arc<Fabric>, instance: u128) -> Arc<DecodeLink> {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let ctl = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let reg = Registration::new(
            "flight",
            Role::Decode,
            InstanceId(instance),
            Topology::single_mla(1, 1, 8),
        );
        Arc::new(DecodeLink {
            hello: PeerHello::from(&reg),
            regions: RegionMap::default(),
            writer: CtlWriter::new(ctl),
            conn: Mutex::new(Conn {
                data: Arc::new(FakeTransport(fabric.clone())),
                path: Arc::new(WritePath::Staged {
                    sender_gathers: false,
                }),
            }),
            data_addr: String::new(),
            alive: AtomicBool::new(true),
            counters: Default::default(),
        })
    }

    /// A room table holding room [`ROOM`] (attempt 1) and the options of its batches.
    fn room() -> (Mutex<RoomTable>, BatchOptions) {
        let mut t = RoomTable::new();
        let attempt = t
            .create(ROOM, KvPoll::WaitingForInput, None, Instant::now())
            .unwrap();
        assert!(t.update(ROOM, attempt, KvPoll::Transferring));
        let opts = BatchOptions {
            timeout: Duration::from_secs(5),
            checksum: false,
            room: ROOM,
            epoch: attempt,
        };
        (Mutex::new(t), opts)
    }

    fn in_flight(rooms: &Mutex<RoomTable>) -> u64 {
        lock(rooms).get(ROOM).unwrap().inflight
    }

    fn op(i: u64) -> WriteOp {
        WriteOp {
            local_region: 1,
            local_offset: i * 8,
            remote_region: 2,
            remote_offset: i * 16,
            len: 8,
        }
    }

    /// Finishes `ids` from another thread, in that order, after a short
    /// delay (so the flight's waits usually block first; the assertions do
    /// not depend on it).
    fn finish_later(
        fabric: &Arc<Fabric>,
        ids: Vec<(u64, Result<()>)>,
    ) -> std::thread::JoinHandle<()> {
        let f = fabric.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            for (id, outcome) in ids {
                f.finish(id, outcome);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    }

    #[test]
    fn each_batch_is_a_write_in_flight_until_it_completed() {
        let fabric = Arc::new(Fabric::default());
        let (a, b) = (link(&fabric, 0xa), link(&fabric, 0xb));
        let (rooms, opts) = room();
        let mut f = Flight::new(&rooms, opts);
        f.submit(&a, &[op(0), op(1)], None).unwrap();
        f.submit(&b, &[op(2)], None).unwrap();
        f.submit(&a, &[op(3)], None).unwrap();
        assert_eq!(fabric.submitted(), [1, 2, 3]);
        assert_eq!(lock(&fabric.state).submitted[0].1, [op(0), op(1)]);
        assert_eq!(in_flight(&rooms), 3);
        // an abort now is not fenced: the batches may still land
        assert!(!lock(&rooms).abort(ROOM, opts.epoch).unwrap());
        // completions arrive late and newest first; the drain waits oldest first
        let t = finish_later(&fabric, vec![(3, Ok(())), (2, Ok(())), (1, Ok(()))]);
        f.drain().unwrap();
        t.join().unwrap();
        assert_eq!(fabric.waited(), [1, 2, 3]);
        assert_eq!(in_flight(&rooms), 0);
        assert!(lock(&rooms).is_fenced(ROOM));
    }

    #[test]
    fn a_failed_batch_fails_the_drain_once_every_batch_completed() {
        let fabric = Arc::new(Fabric::default());
        let (a, b) = (link(&fabric, 0xa), link(&fabric, 0xb));
        let (rooms, opts) = room();
        let mut f = Flight::new(&rooms, opts);
        for (l, i) in [(&a, 0), (&b, 1), (&a, 2), (&b, 3)] {
            f.submit(l, &[op(i)], None).unwrap();
        }
        let t = finish_later(
            &fabric,
            vec![
                (1, Ok(())),
                (2, Err(Error::new(Status::PeerUnreachable, "peer died"))),
                (3, Ok(())),
                (4, Err(Error::new(Status::Timeout, "deadline"))),
            ],
        );
        let e = f.drain().unwrap_err();
        t.join().unwrap();
        // the first failure, naming the room and the decode rank of that batch
        assert_eq!(e.status(), Status::PeerUnreachable);
        assert!(e.detail().contains("writing room 7"), "{e}");
        assert!(
            e.detail().contains(&InstanceId(0xb).to_string()),
            "names decode b: {e}"
        );
        assert!(e.detail().ends_with("peer died"), "{e}");
        // every batch was waited for regardless, and none is still counted
        assert_eq!(fabric.waited(), [1, 2, 3, 4]);
        assert_eq!(in_flight(&rooms), 0);
        f.drain().unwrap();
    }

    #[test]
    fn a_refused_submit_leaves_nothing_in_flight() {
        let fabric = Arc::new(Fabric::default());
        let a = link(&fabric, 0xa);
        let (rooms, opts) = room();
        let mut f = Flight::new(&rooms, opts);
        lock(&fabric.state).refuse_next =
            Some(Error::new(Status::OutOfBounds, "op 0 past the end"));
        let e = f.submit(&a, &[op(0)], None).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds);
        assert!(e.detail().contains("writing room 7"), "{e}");
        assert_eq!(in_flight(&rooms), 0);
        // no ops: nothing submitted, nothing counted
        f.submit(&a, &[], Some(0)).unwrap();
        assert!(fabric.submitted().is_empty());
        assert_eq!(in_flight(&rooms), 0);
        f.drain().unwrap();
        assert!(fabric.waited().is_empty());
        // an aborted room takes no new write: the transport is not asked
        lock(&rooms).abort(ROOM, opts.epoch).unwrap();
        let e = f.submit(&a, &[op(1)], None).unwrap_err();
        assert_eq!(e.status(), Status::Aborted);
        assert!(fabric.submitted().is_empty());
        assert_eq!(in_flight(&rooms), 0);
    }

    #[test]
    fn a_staging_slot_is_handed_out_again_only_once_its_batches_completed() {
        let fabric = Arc::new(Fabric::default());
        let (a, b) = (link(&fabric, 0xa), link(&fabric, 0xb));
        let (rooms, opts) = room();
        let mut f = Flight::new(&rooms, opts);
        // slot 0 to both links, then slot 1, then a batch reading no slot
        assert_eq!(f.next_slot(2).unwrap(), 0);
        f.submit(&a, &[op(0)], Some(0)).unwrap();
        f.submit(&b, &[op(1)], Some(0)).unwrap();
        assert_eq!(f.next_slot(2).unwrap(), 1);
        f.submit(&a, &[op(2)], Some(1)).unwrap();
        f.submit(&b, &[op(3)], None).unwrap();
        assert!(
            fabric.waited().is_empty(),
            "handing out free slots waits for nothing"
        );
        // slot 0 again: waits for batches 1 and 2 (finished late), not 3 or 4
        let t = finish_later(&fabric, vec![(4, Ok(())), (2, Ok(())), (1, Ok(()))]);
        assert_eq!(f.next_slot(2).unwrap(), 0);
        t.join().unwrap();
        assert_eq!(fabric.waited(), [1, 2]);
        assert_eq!(in_flight(&rooms), 2);
        // slot 1's batch failed: handing slot 1 out again reports it
        fabric.finish(3, Err(Error::new(Status::PeerUnreachable, "gone")));
        assert_eq!(
            f.next_slot(2).unwrap_err().status(),
            Status::PeerUnreachable
        );
        assert_eq!(fabric.waited(), [1, 2, 3]);
        f.drain().unwrap();
        assert_eq!(fabric.waited(), [1, 2, 3, 4]);
        assert_eq!(in_flight(&rooms), 0);
        // one slot (or none configured) is always slot 0
        let mut g = Flight::new(&rooms, opts);
        assert_eq!(g.next_slot(1).unwrap(), 0);
        assert_eq!(g.next_slot(0).unwrap(), 0);
    }

    #[test]
    fn dropping_a_flight_waits_for_its_batches() {
        let fabric = Arc::new(Fabric::default());
        let a = link(&fabric, 0xa);
        let (rooms, opts) = room();
        let mut f = Flight::new(&rooms, opts);
        f.submit(&a, &[op(0)], None).unwrap();
        f.submit(&a, &[op(1)], None).unwrap();
        let t = finish_later(&fabric, vec![(2, Ok(())), (1, Ok(()))]);
        drop(f);
        t.join().unwrap();
        assert_eq!(fabric.waited(), [1, 2]);
        assert_eq!(in_flight(&rooms), 0);
    }
}
