//! The RDMA transport behind the [`Transport`] trait: the agent's control
//! connection plus one-sided RDMA WRITE/READ on a [`DataPath`] (a
//! [`Session`](super::session::Session) over any [`RailIo`](super::session::RailIo):
//! verbs QPs in production, the fake fabric in tests).
//!
//! Protocol per batch, as for cma: the sender validates every op against its
//! registry and the receiver's descriptors, sends the intent (destination
//! ranges); the receiver validates them against its registry and pins the
//! regions (Grant) or refuses (Refuse: nothing is written). Only then the
//! sender posts the RDMA WRITEs (the NIC enforces the rkeys), and only after
//! every send completion (RC: the data is placed in the peer's memory) does
//! it send the commit record; the receiver checks it (bytes, optional
//! checksum over the landed bytes), delivers its completion record and
//! acknowledges. A failed work request fails the batch with the verbs
//! reason and is never retried (the bytes may or may not have landed); the
//! receiver then drops its grant and delivers nothing.
//!
//! A batch of a room whose grant is open on the connection
//! ([`room`](crate::transport::room)) skips the intent and the commit: it is
//! checked against the room's granted ranges here and is done at its work
//! completions; the room's one RoomEnd/RoomAck follows its last batch.
//!
//! Device regions (GPU memory) move like host ones: the NIC reads and writes
//! them directly (GPUDirect RDMA), registered through the provider's GPU
//! path; a NIC without one refuses them with `NoGpuDirect` (the sender's for
//! its sources, the receiver's at grant). A checksum needs the CPU to read
//! the bytes, so it is refused for batches touching device memory.

use super::handshake::Handshake;
use super::nic::{DataPath, NicProvider};
use super::slice::Span;
use super::tracker::BatchState;
use super::wr::Direction;
use crate::error::{Error, Result, Status};
use crate::memory::{AccessGuard, RegionDesc, RegionKind};
use crate::transport::agent::Dialed;
use crate::transport::batch::Stage;
use crate::transport::conn::{Conn, Reach};
use crate::transport::handshake::{Select, SelectOk};
use crate::transport::piece::Piece;
use crate::transport::wire::{self, Commit, FrameType};
use crate::transport::{BatchId, BatchOptions, ReadOp, Transport, TransportKind, WriteOp};
use crossbeam::channel::{unbounded, Receiver, Sender};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct Job {
    id: u64,
    read: bool,
    pieces: Vec<Piece>,
    commit: Commit,
    deadline: Instant,
    /// A batch of a room open under a grant: (room, epoch); it is done at
    /// its work completions, with no frame to the receiver.
    room: Option<(u64, u64)>,
    _guards: Arc<Vec<AccessGuard>>,
}

/// The sender side of an RDMA connection.
pub struct RdmaTransport {
    conn: Arc<Conn>,
    tx: Sender<Job>,
    path: Arc<dyn DataPath>,
    nic: Arc<dyn NicProvider>,
    /// Local regions (id, addr, len) whose lkeys the data path knows.
    known: Mutex<HashSet<(u64, u64, u64)>>,
}

impl RdmaTransport {
    /// Starts the transport over a connected control channel and data path.
    pub(crate) fn new(
        conn: Arc<Conn>,
        path: Box<dyn DataPath>,
        nic: Arc<dyn NicProvider>,
    ) -> Result<RdmaTransport> {
        let path: Arc<dyn DataPath> = Arc::from(path);
        let (tx, rx) = unbounded::<Job>();
        let (done_tx, done_rx) = unbounded::<Job>();
        let (c, p) = (conn.clone(), path.clone());
        crate::threads::spawn("pdxfer-rdma-post".into(), move || {
            poster(&c, &*p, rx, done_tx)
        })?;
        let (c, p) = (conn.clone(), path.clone());
        crate::threads::spawn("pdxfer-rdma-done".into(), move || {
            completer(&c, &*p, done_rx)
        })?;
        Ok(RdmaTransport {
            conn,
            tx,
            path,
            nic,
            known: Mutex::new(HashSet::new()),
        })
    }

    /// Makes sure every local region of `ops` is registered with the NIC and
    /// its lkeys are known to the data path (regions registered with the agent
    /// after the connection included). Device regions go through the NIC's GPU
    /// path (`NoGpuDirect` with the reason without one).
    fn ensure_local(&self, ops: &[WriteOp]) -> Result<()> {
        let mut known = super::session::lock(&self.known);
        // a batch names few regions in many ops: look each up once
        let mut seen = std::collections::HashSet::new();
        for op in ops {
            if !seen.insert(op.local_region) {
                continue;
            }
            let d = self.conn.registry.get(op.local_region)?;
            if known.contains(&(d.id, d.addr, d.len)) {
                continue;
            }
            // SAFETY: a registry region stays valid until it is unregistered (whose
            // hook deregisters it from the NIC first), and the batch pins it
            // (validate_ops) while the NIC uses it.
            let keys = unsafe { self.nic.register(d.addr, d.len, d.kind) }.map_err(|e| {
                Error::new(
                    e.status(),
                    format!(
                        "local region {} cannot be registered with the RDMA NIC: {}",
                        d.id,
                        e.detail()
                    ),
                )
            })?;
            // Regions known before over these addresses were unregistered (live
            // regions overlap only as pool views, which share their allocation's
            // keys): their lkeys are gone, forget them.
            let end = d.addr + d.len;
            known.retain(|(id, a, l)| {
                let stale = *a < end && d.addr < a + l && self.conn.registry.get(*id).is_err();
                if stale {
                    self.path.remove_local(*a, *l);
                }
                !stale
            });
            self.path.add_local(&keys);
            known.insert((d.id, d.addr, d.len));
        }
        Ok(())
    }

    /// Batches the data path's completion tracker holds (bounded; for tests).
    pub fn tracked(&self) -> usize {
        self.path.tracked()
    }

    fn submit_dir(&self, ops: &[WriteOp], opts: &BatchOptions, read: bool) -> Result<BatchId> {
        let (pieces, guards, bytes) = self.conn.validate(ops, Reach::Any)?;
        if opts.checksum {
            // The CPU cannot read device memory: no checksum over it.
            let device = |d: Option<RegionDesc>| d.is_some_and(|d| d.kind != RegionKind::Host);
            if let Some(op) = ops.iter().find(|o| {
                device(self.conn.registry.get(o.local_region).ok())
                    || device(self.conn.regions.get(&o.remote_region).cloned())
            }) {
                return Err(Error::new(
                    Status::Unsupported,
                    format!(
                        "a checksum over device memory is not supported (the CPU cannot read it): op on local region {} / remote region {} touches device memory; submit without checksum",
                        op.local_region, op.remote_region
                    ),
                ));
            }
        }
        self.ensure_local(ops)?;
        let granted = if read {
            None
        } else {
            self.conn.rooms.admit(&pieces, opts)?
        };
        let room = granted.map(|_| (opts.room, opts.epoch));
        let commit = match room {
            None => self.conn.announce(&pieces, &guards, bytes, opts, read)?,
            Some(_) => self.conn.insert_room_batch(bytes, &guards, opts)?,
        };
        let id = commit.batch;
        let job = Job {
            id,
            read,
            pieces,
            commit,
            deadline: Instant::now() + opts.timeout,
            room,
            _guards: guards,
        };
        if self.tx.send(job).is_err() {
            let e = Error::new(Status::PeerUnreachable, "the rdma poster thread is gone");
            if let Some(key) = room {
                self.conn.rooms.finished(key, Err(e.clone()));
            }
            self.conn.table.fail(id, e);
        }
        Ok(BatchId(id))
    }
}

/// Abandons a batch: the receiver drops its grant (Abort); a batch of a
/// granted room has no receiver state: its room records the failure.
fn abort_job(conn: &Conn, job: &Job) {
    match job.room {
        Some(key) => conn.rooms.finished(
            key,
            Err(conn.table.failure(job.id).unwrap_or_else(|| {
                Error::new(
                    Status::BatchFailed,
                    format!("rdma batch {} was abandoned", job.id),
                )
            })),
        ),
        None => abort(conn, job.id),
    }
}

fn abort(conn: &Conn, id: u64) {
    let _ = conn.send(FrameType::Abort, &id.to_le_bytes());
}

/// How long past its deadline a failed batch may keep the receiver's grant
/// while its posted work requests drain.
const SETTLE_GRACE: Duration = Duration::from_secs(2);

/// Waits until every posted work request of a failed batch has completed (or
/// its rails are dead), at most until `until`: only then may the receiver drop
/// its grant (unpin), since a NIC may still be placing bytes of other rails.
fn settle(path: &dyn DataPath, batch: u32, until: Instant) {
    while Instant::now() < until {
        match path.wait(batch, Duration::from_millis(20)) {
            // Forgotten by the tracker: settled (or never started).
            Err(e) if e.status() != Status::Timeout => return,
            Ok(BatchState::Done { .. }) => return,
            _ => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

/// Fails the batch with `e` at once, then releases the receiver's grant once
/// the batch's work requests settled.
fn fail_and_abort(conn: &Conn, path: &dyn DataPath, job: &Job, e: Error) {
    conn.table.fail(job.id, e);
    settle(
        path,
        rdma_id(job.id),
        job.deadline.max(Instant::now()) + SETTLE_GRACE,
    );
    abort_job(conn, job);
}

/// The RDMA batch id of a connection batch (ids grow from 1; the tracker
/// refuses an id still in flight).
fn rdma_id(id: u64) -> u32 {
    id as u32
}

/// Waits for grants and posts the work requests, in submission order.
fn poster(conn: &Conn, path: &dyn DataPath, rx: Receiver<Job>, done: Sender<Job>) {
    for job in rx {
        if conn.table.wait_granted(job.id).is_err() || conn.table.finished(job.id) {
            abort_job(conn, &job);
            continue;
        }
        if job.pieces.is_empty() {
            let _ = done.send(job);
            continue;
        }
        let spans: Vec<Span> = job
            .pieces
            .iter()
            .map(|p| Span {
                local_addr: p.src,
                remote_addr: p.dst,
                len: p.len,
            })
            .collect();
        let dir = if job.read {
            Direction::Read
        } else {
            Direction::Write
        };
        match path.post_batch(rdma_id(job.id), dir, &spans) {
            Ok(()) => {
                let _ = done.send(job);
            }
            Err(e) => {
                // Never retried: fail it, let what was posted drain, then release the grant.
                let e = Error::new(e.status(), format!("rdma batch {}: {}", job.id, e.detail()));
                fail_and_abort(conn, path, &job, e);
            }
        }
    }
}

/// Waits for the send completions of each posted batch, then commits it.
fn completer(conn: &Conn, path: &dyn DataPath, rx: Receiver<Job>) {
    for job in rx {
        let state = if job.pieces.is_empty() {
            BatchState::Done { bytes: 0 }
        } else {
            loop {
                // Short slices, so a batch failed elsewhere (dead control
                // connection, deadline) is noticed promptly.
                match path.wait(rdma_id(job.id), Duration::from_millis(20)) {
                    Ok(s) => break s,
                    Err(e) if e.status() == Status::Timeout => {
                        if conn.table.finished(job.id) || Instant::now() >= job.deadline {
                            break BatchState::Failed(Error::new(
                                Status::Timeout,
                                format!(
                                    "rdma batch {}: work requests still in flight at the batch deadline",
                                    job.id
                                ),
                            ));
                        }
                    }
                    Err(e) => break BatchState::Failed(e),
                }
            }
        };
        match state {
            BatchState::Done { bytes } if bytes == job.commit.bytes => {
                let mut commit = job.commit;
                if job.read && commit.checksum.is_some() {
                    let sum = read_checksum(&job.pieces);
                    commit.checksum = Some(sum);
                    conn.table.set_checksum(job.id, sum);
                }
                conn.table.set(job.id, Stage::Written);
                if conn.table.finished(job.id) {
                    // Deadline passed while writing: no completion for the receiver.
                    abort_job(conn, &job);
                    continue;
                }
                if let Some(key) = job.room {
                    // RC work completions: every byte is placed in the peer's memory
                    conn.table.set(job.id, Stage::Done);
                    conn.rooms.finished(key, Ok(job.commit.bytes));
                    continue;
                }
                let _ = conn.send(FrameType::Commit, &wire::encode_commit(&commit));
            }
            BatchState::Done { bytes } => {
                let e = Error::new(
                    Status::BatchFailed,
                    format!("moved {bytes} of {} bytes", job.commit.bytes),
                );
                conn.table.fail(job.id, e);
                abort_job(conn, &job);
            }
            BatchState::Failed(e) => fail_and_abort(conn, path, &job, e),
            BatchState::InProgress => {
                let e = Error::new(Status::BatchFailed, "rdma batch left in progress");
                fail_and_abort(conn, path, &job, e);
            }
        }
    }
}

/// Checksum of the bytes a read landed locally (keyed by the peer's ranges).
fn read_checksum(pieces: &[Piece]) -> u64 {
    pieces.iter().fold(0u64, |acc, p| {
        // SAFETY: src is a pinned local registered range the read just filled.
        let d = unsafe { std::slice::from_raw_parts(p.src as *const u8, p.len as usize) };
        crate::transport::checksum::combine(
            acc,
            crate::transport::checksum::piece(p.region, p.offset, d),
        )
    })
}

/// The sender's rdma setup on a dialed control connection to a peer that
/// offers RDMA: makes an endpoint on this side's NICs, sends its handshake
/// in Select, negotiates with the peer's from SelectOk, brings the QPs up
/// and starts the transport.
pub(crate) fn connect(mut d: Dialed<'_>, nic: Arc<dyn NicProvider>) -> Result<Box<dyn Transport>> {
    let addr = d.addr;
    let ep = nic.endpoint()?;
    d.send_json(
        FrameType::Select,
        &Select {
            transport: TransportKind::Rdma,
            streams: 0,
            rdma: Some(ep.local().encode()?),
            tcp_encrypt: false,
        },
    )?;
    let ok: SelectOk = d.recv_json(FrameType::SelectOk).map_err(|e| {
        Error::new(
            e.status(),
            format!("rdma handshake with {addr}: {}", e.detail()),
        )
    })?;
    let remote = ok.rdma.ok_or_else(|| {
        Error::new(
            Status::Protocol,
            format!("{addr} accepted rdma without sending its RDMA handshake"),
        )
    })?;
    let remote = Handshake::decode(&remote).map_err(Error::from)?;
    let (path, negotiated) = ep.connect(&remote)?;
    log::info!(
        "rdma: connected to {addr} over {} rail(s) of {} (path MTU {})",
        negotiated.len(),
        nic.describe(),
        negotiated.first().map(|n| n.mtu.bytes()).unwrap_or(0)
    );
    let conn = d.start()?;
    Ok(Box::new(RdmaTransport::new(conn, path, nic)?))
}

impl Transport for RdmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn data_path(&self) -> &'static str {
        if self.path.rails() > 1 {
            "rdma: one-sided RDMA WRITE/READ on RC queue pairs, sliced across several NICs"
        } else {
            "rdma: one-sided RDMA WRITE/READ on an RC queue pair"
        }
    }

    fn remote_regions(&self) -> Vec<RegionDesc> {
        let mut v: Vec<RegionDesc> = self.conn.regions.values().cloned().collect();
        v.sort_by_key(|d| d.id);
        v
    }

    fn poll(&self, id: BatchId) -> Result<crate::transport::BatchStatus> {
        self.conn.table.poll(id)
    }

    fn wait(&self, id: BatchId, timeout: Duration) -> Result<crate::transport::Completion> {
        self.conn.table.wait(id, timeout)
    }

    crate::transport::conn::conn_room_grants!();

    /// False once the control connection is gone, and also once a rail's QP
    /// went to the error state: an RC QP in error stays there, so every
    /// later batch would fail until the connection is made again.
    fn is_alive(&self) -> bool {
        if !self.conn.alive() {
            return false;
        }
        match self.path.broken() {
            None => true,
            Some(why) => {
                log::debug!("rdma: data path unusable: {why}");
                false
            }
        }
    }

    fn submit(&self, ops: &[WriteOp], opts: &BatchOptions) -> Result<BatchId> {
        self.submit_dir(ops, opts, false)
    }

    fn submit_reads(&self, ops: &[ReadOp], opts: &BatchOptions) -> Result<BatchId> {
        let w: Vec<WriteOp> = ops.iter().map(ReadOp::as_write).collect();
        self.submit_dir(&w, opts, true)
    }

    fn close(&self) {
        self.conn.close();
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.conn.close();
    }
}

#[cfg(test)]
mod tests {
    use crate::error::Status;
    use crate::memory::{RegionDesc, RegionKind};
    use crate::transport::rdma::fake::{self, FakeNic};
    use crate::transport::rdma::handshake::Mtu;
    use crate::transport::rdma::nic::NicProvider;
    use crate::transport::TestKnobs;
    use crate::transport::{
        Agent, AgentOptions, BatchOptions, ConnectOptions, ReadOp, Transport, TransportKind,
        WriteOp,
    };
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn agent(listen: bool, nic: Option<Arc<FakeNic>>) -> Agent {
        Agent::new(&AgentOptions {
            listen: listen.then(|| "127.0.0.1:0".to_string()),
            testing: TestKnobs {
                nic: nic.map(|n| n as Arc<dyn super::NicProvider>),
                deny_same_host: true,
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap()
    }

    fn connect(tx: &Agent, rx: &Agent, kind: TransportKind) -> crate::Result<Box<dyn Transport>> {
        tx.connect(
            &rx.local_addr().unwrap().to_string(),
            &ConnectOptions {
                transport: kind,
                timeout: Duration::from_secs(5),
                ..Default::default()
            },
        )
    }

    const LEN: usize = 2 << 20;

    struct Setup {
        rx: Agent,
        tx: Agent,
        tx_nic: Arc<FakeNic>,
        dst: Vec<u8>,
        src: Vec<u8>,
        d: RegionDesc,
        s: RegionDesc,
    }

    fn setup() -> Setup {
        let rx_nic = FakeNic::new("rx", 2, Mtu::Mtu2048);
        let tx_nic = FakeNic::new("tx", 2, Mtu::Mtu4096);
        let rx = agent(true, Some(rx_nic));
        let tx = agent(false, Some(tx_nic.clone()));
        let mut dst = vec![0u8; LEN];
        let mut src: Vec<u8> = (0..LEN as u64).map(|i| (i * 7 + i / 251) as u8).collect();
        // SAFETY: the buffers live in the returned Setup, which outlives the agents' use.
        let d = unsafe { rx.register_host(dst.as_mut_ptr(), dst.len()) }.unwrap();
        // SAFETY: as above.
        let s = unsafe { tx.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
        Setup {
            rx,
            tx,
            tx_nic,
            dst,
            src,
            d,
            s,
        }
    }

    #[test]
    fn random_batches_land_byte_exact_and_the_record_follows_the_data() {
        let st = setup();
        let t = connect(&st.tx, &st.rx, TransportKind::Rdma).unwrap();
        assert_eq!(t.kind(), TransportKind::Rdma);
        assert!(t.data_path().contains("several NICs"), "{}", t.data_path());
        assert_eq!(t.remote_regions(), vec![st.d.clone()]);
        let mut model = vec![0u8; LEN];
        let mut rng = crate::rng::SplitMix64::new(0x9e37_79b9_7f4a_7c15);
        for round in 0..24u64 {
            // Disjoint destination pieces inside one batch (slicing may reorder them).
            let n = 1 + rng.below(12);
            let chunk = LEN as u64 / n;
            let mut ops = Vec::new();
            for k in 0..n {
                let len = 1 + rng.below(chunk.min(300_000));
                let remote_offset = k * chunk + rng.below(chunk - len + 1);
                let local_offset = rng.below(LEN as u64 - len + 1);
                ops.push(WriteOp {
                    local_region: st.s.id,
                    local_offset,
                    remote_region: st.d.id,
                    remote_offset,
                    len,
                });
            }
            let opts = BatchOptions {
                checksum: round % 2 == 0,
                room: 1000 + round,
                epoch: round,
                timeout: Duration::from_secs(10),
            };
            let id = t.submit(&ops, &opts).unwrap();
            for op in &ops {
                let (l, r, n) = (
                    op.local_offset as usize,
                    op.remote_offset as usize,
                    op.len as usize,
                );
                model[r..r + n].copy_from_slice(&st.src[l..l + n]);
            }
            // The receiver's record arrives only once every byte is in place.
            let inc = st
                .rx
                .next_completion(Duration::from_secs(10))
                .expect("receiver completion");
            assert!(
                st.dst == model,
                "round {round}: bytes differ when the record arrived"
            );
            let c = t.wait(id, Duration::from_secs(10)).unwrap();
            assert_eq!(inc.completion, c);
            assert_eq!(c.bytes, ops.iter().map(|o| o.len).sum::<u64>());
            assert_eq!((c.room, c.epoch), (1000 + round, round));
            assert_eq!(c.checksum.is_some(), round % 2 == 0);
        }
        // A local region registered after the connection is usable.
        let mut late: Vec<u8> = (0..4096u32).map(|i| (i % 97) as u8 + 1).collect();
        // SAFETY: `late` outlives the batch below.
        let l = unsafe { st.tx.register_host(late.as_mut_ptr(), late.len()) }.unwrap();
        let op = WriteOp {
            local_region: l.id,
            local_offset: 0,
            remote_region: st.d.id,
            remote_offset: 5,
            len: 4096,
        };
        let id = t.submit(&[op], &BatchOptions::default()).unwrap();
        t.wait(id, Duration::from_secs(10)).unwrap();
        assert_eq!(&st.dst[5..4101], &late[..]);
        // A region the receiver registered after the connection is refused clearly.
        let mut more = vec![0u8; 4096];
        // SAFETY: `more` outlives the receiver's use.
        let m = unsafe { st.rx.register_host(more.as_mut_ptr(), more.len()) }.unwrap();
        let e = t
            .submit(
                &[WriteOp {
                    remote_region: m.id,
                    remote_offset: 0,
                    ..op
                }],
                &BatchOptions::default(),
            )
            .unwrap_err();
        assert_eq!(e.status(), Status::RegionNotFound, "{e}");
        assert!(more.iter().all(|b| *b == 0));
        t.close();
        assert!(!t.is_alive());
        drop(late);
    }

    #[test]
    fn out_of_bounds_and_refused_writes_write_nothing() {
        let st = setup();
        let t = connect(&st.tx, &st.rx, TransportKind::Rdma).unwrap();
        let op = WriteOp {
            local_region: st.s.id,
            local_offset: 0,
            remote_region: st.d.id,
            remote_offset: LEN as u64 - 100,
            len: 101,
        };
        let e = t.submit(&[op], &BatchOptions::default()).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds, "{e}");
        // The receiver unregisters its region: the sender's descriptor is stale, the
        // receiver refuses the grant and nothing is written.
        st.rx
            .registry()
            .unregister(st.d.id, Duration::from_secs(2))
            .unwrap();
        let op = WriteOp {
            remote_offset: 0,
            len: 1000,
            ..op
        };
        let id = t.submit(&[op], &BatchOptions::default()).unwrap();
        let e = t.wait(id, Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.status(), Status::RegionNotFound, "{e}");
        assert!(
            st.dst.iter().all(|b| *b == 0),
            "a refused batch wrote bytes"
        );
        assert!(st.rx.next_completion(Duration::from_millis(50)).is_none());
    }

    #[test]
    fn a_qp_error_mid_batch_fails_it_with_the_reason_while_another_connection_works() {
        let st = setup();
        let t1 = connect(&st.tx, &st.rx, TransportKind::Rdma).unwrap();
        let q1 = st.tx_nic.qpns();
        let t2 = connect(&st.tx, &st.rx, TransportKind::Rdma).unwrap();
        assert_eq!(st.tx_nic.qpns().len(), 2 * q1.len());
        // Rail 0 of the first connection fails on its 3rd work request.
        fake::fail_qp_after(q1[0], 2);
        let ops: Vec<WriteOp> = (0..16u64)
            .map(|k| WriteOp {
                local_region: st.s.id,
                local_offset: k * 65_536,
                remote_region: st.d.id,
                remote_offset: k * 65_536,
                len: 65_536,
            })
            .collect();
        let opts = BatchOptions {
            timeout: Duration::from_secs(3),
            ..Default::default()
        };
        let start = Instant::now();
        let id = t1.submit(&ops, &opts).unwrap();
        let e = t1.wait(id, Duration::from_secs(10)).unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(e.status(), Status::RdmaCompletion, "{e}");
        assert!(e.detail().contains("IBV_WC_RETRY_EXC_ERR"), "{e}");
        assert!(e.detail().contains("not retried"), "{e}");
        assert!(
            st.rx.next_completion(Duration::from_millis(50)).is_none(),
            "no record for a failed batch"
        );
        // The connection says it no longer works (the engine then makes a new one),
        // and the dead rail refuses later batches of it, with the reason.
        assert!(!t1.is_alive());
        assert!(t2.is_alive());
        let id = t1.submit(&ops[..1], &opts).unwrap();
        let e = t1.wait(id, Duration::from_secs(10)).unwrap_err();
        assert!(e.detail().contains("reconnect"), "{e}");
        // The other connection keeps working.
        let id = t2.submit(&ops, &opts).unwrap();
        let c = t2.wait(id, Duration::from_secs(10)).unwrap();
        assert_eq!(c.bytes, 16 * 65_536);
        assert_eq!(&st.dst[..16 * 65_536], &st.src[..16 * 65_536]);
    }

    #[test]
    fn a_dead_peer_fails_batches_within_their_deadline() {
        let st = setup();
        let t = connect(&st.tx, &st.rx, TransportKind::Rdma).unwrap();
        let op = WriteOp {
            local_region: st.s.id,
            local_offset: 0,
            remote_region: st.d.id,
            remote_offset: 0,
            len: 1 << 20,
        };
        let opts = BatchOptions {
            timeout: Duration::from_secs(2),
            ..Default::default()
        };
        let id = t.submit(&[op], &opts).unwrap();
        t.wait(id, Duration::from_secs(5)).unwrap();
        let Setup { rx, tx, dst, .. } = st;
        drop(rx);
        let start = Instant::now();
        let r = t
            .submit(&[op], &opts)
            .and_then(|id| t.wait(id, Duration::from_secs(10)));
        let e = r.unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        assert!(
            matches!(
                e.status(),
                Status::PeerUnreachable | Status::RdmaCompletion | Status::Timeout
            ),
            "{e}"
        );
        drop((tx, dst));
    }

    #[test]
    fn reads_pull_the_peers_bytes_and_deliver_no_record() {
        let mut st = setup();
        for (i, b) in st.dst.iter_mut().enumerate() {
            *b = (i * 5 + 1) as u8;
        }
        let t = connect(&st.tx, &st.rx, TransportKind::Rdma).unwrap();
        let ops = [ReadOp {
            local_region: st.s.id,
            local_offset: 8,
            remote_region: st.d.id,
            remote_offset: 1000,
            len: 300_000,
        }];
        let opts = BatchOptions {
            checksum: true,
            ..Default::default()
        };
        let c = t
            .wait(
                t.submit_reads(&ops, &opts).unwrap(),
                Duration::from_secs(10),
            )
            .unwrap();
        assert_eq!(c.bytes, 300_000);
        assert!(c.checksum.is_some());
        assert_eq!(&st.src[8..300_008], &st.dst[1000..301_000]);
        assert!(st
            .dst
            .iter()
            .enumerate()
            .all(|(i, b)| *b == (i * 5 + 1) as u8));
        assert!(st.rx.next_completion(Duration::from_millis(50)).is_none());
        let bad = [ReadOp {
            remote_offset: LEN as u64 - 10,
            len: 11,
            ..ops[0]
        }];
        assert_eq!(
            t.submit_reads(&bad, &opts).unwrap_err().status(),
            Status::OutOfBounds
        );
    }

    #[test]
    fn a_failed_negotiation_names_the_field_and_roce_pairs_connect() {
        use crate::transport::rdma::handshake::LinkLayer;
        let rx = agent(true, Some(FakeNic::new("ib", 1, Mtu::Mtu4096)));
        let eth = FakeNic::with_link_layer("eth", 1, Mtu::Mtu1024, LinkLayer::Ethernet);
        let tx = agent(false, Some(eth.clone()));
        let e = connect(&tx, &rx, TransportKind::Rdma).unwrap_err();
        assert_eq!(e.status(), Status::RdmaHandshake, "{e}");
        assert!(e.detail().contains("link_layer"), "{e}");
        // Chosen automatically, the same mismatch falls back to tcp.
        let t = connect(&tx, &rx, TransportKind::Auto).unwrap();
        assert_eq!(t.kind(), TransportKind::Tcp);
        // The server stays usable: a RoCE peer on both sides connects.
        let rx2 = agent(
            true,
            Some(FakeNic::with_link_layer(
                "eth2",
                1,
                Mtu::Mtu4096,
                LinkLayer::Ethernet,
            )),
        );
        let mut buf = vec![0u8; 4096];
        // SAFETY: buf outlives the transport below.
        let d = unsafe { rx2.register_host(buf.as_mut_ptr(), buf.len()) }.unwrap();
        let mut src = vec![9u8; 4096];
        // SAFETY: src outlives the transport below.
        let s = unsafe { tx.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
        let t = connect(&tx, &rx2, TransportKind::Rdma).unwrap();
        let op = WriteOp {
            local_region: s.id,
            local_offset: 0,
            remote_region: d.id,
            remote_offset: 0,
            len: 4096,
        };
        t.wait(
            t.submit(&[op], &BatchOptions::default()).unwrap(),
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(buf.iter().all(|b| *b == 9));
        drop(src);
    }

    fn write_op(s: &RegionDesc, d: &RegionDesc, lo: u64, ro: u64, len: u64) -> WriteOp {
        WriteOp {
            local_region: s.id,
            local_offset: lo,
            remote_region: d.id,
            remote_offset: ro,
            len,
        }
    }

    fn run(t: &dyn Transport, ops: &[WriteOp]) -> crate::Result<crate::transport::Completion> {
        t.submit(ops, &BatchOptions::default())
            .and_then(|id| t.wait(id, Duration::from_secs(10)))
    }

    /// Connects a bare data path of `tx` to one of `rx` (no agent, no grant):
    /// what a peer holding rx's rkeys could post.
    fn raw_pair(
        tx: &FakeNic,
        rx: &FakeNic,
    ) -> (
        Box<dyn crate::transport::rdma::nic::DataPath>,
        Box<dyn crate::transport::rdma::nic::DataPath>,
    ) {
        use crate::transport::rdma::nic::NicProvider;
        let (et, er) = (tx.endpoint().unwrap(), rx.endpoint().unwrap());
        let (ht, hr) = (et.local().clone(), er.local().clone());
        let (pt, _) = et.connect(&hr).unwrap();
        let (pr, _) = er.connect(&ht).unwrap();
        (pt, pr)
    }

    fn state(
        p: &dyn crate::transport::rdma::nic::DataPath,
        batch: u32,
        spans: &[crate::transport::rdma::Span],
    ) -> crate::transport::rdma::BatchState {
        use crate::transport::rdma::{BatchState, Direction};
        match p.post_batch(batch, Direction::Write, spans) {
            Ok(()) => p.wait(batch, Duration::from_secs(5)).unwrap(),
            Err(e) => BatchState::Failed(e),
        }
    }

    #[test]
    fn unregistering_drops_the_nic_registration_so_old_rkeys_write_nothing() {
        use crate::transport::rdma::{BatchState, Span};
        let rn = FakeNic::new("unreg-rx", 2, Mtu::Mtu4096);
        let tn = FakeNic::new("unreg-tx", 2, Mtu::Mtu4096);
        let rx = agent(true, Some(rn.clone()));
        let mut dst = vec![0u8; 1 << 20];
        let src: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8 + 1).collect();
        // SAFETY: dst outlives every use below (unregistered before it drops).
        let d = unsafe { rx.register_host(dst.as_mut_ptr(), dst.len()) }.unwrap();
        rx.rdma_register_all().unwrap();
        // SAFETY: src outlives the data paths below.
        unsafe {
            tn.register(src.as_ptr() as u64, src.len() as u64, RegionKind::Host)
                .unwrap()
        };
        let old = rn.regions();
        assert_eq!(old.len(), 1);
        assert_eq!((old[0].addr, old[0].kind), (d.addr, RegionKind::Host));
        // A peer connected while the region was registered holds its rkeys.
        let (pt, _pr) = raw_pair(&tn, &rn);
        let span = |off: u64| Span {
            local_addr: src.as_ptr() as u64,
            remote_addr: d.addr + off,
            len: 300_000,
        };
        assert_eq!(
            state(&*pt, 1, &[span(0)]),
            BatchState::Done { bytes: 300_000 }
        );
        assert_eq!(&dst[..300_000], &src[..300_000]);
        rx.registry()
            .unregister(d.id, Duration::from_secs(2))
            .unwrap();
        assert!(rn.regions().is_empty(), "the MR is gone with the region");
        // The same peer writes with the old rkeys: the NIC refuses, nothing lands.
        match state(&*pt, 2, &[span(500_000)]) {
            BatchState::Failed(e) => assert!(e.detail().contains("REM_ACCESS"), "{e}"),
            s => panic!("a write with a deregistered rkey gave {s:?}"),
        }
        assert!(
            dst[300_000..].iter().all(|b| *b == 0),
            "bytes landed in unregistered memory"
        );
        // The same addresses registered again get fresh keys, and they work.
        // SAFETY: as above.
        let d2 = unsafe { rx.register_host(dst.as_mut_ptr(), dst.len()) }.unwrap();
        rx.rdma_register_all().unwrap();
        let new = rn.regions();
        assert_eq!(new.len(), 1);
        assert!(
            new[0].keys.iter().all(|k| !old[0].keys.contains(k)),
            "{new:?} vs {old:?}"
        );
        let (pt2, _pr2) = raw_pair(&tn, &rn);
        assert_eq!(
            state(&*pt2, 3, &[span(500_000)]),
            BatchState::Done { bytes: 300_000 }
        );
        assert_eq!(&dst[500_000..800_000], &src[..300_000]);
        // And through the agents: a sender connecting now writes into the new region.
        let tx = agent(false, Some(tn.clone()));
        let mut s2: Vec<u8> = (0..4096u32).map(|i| (i % 7) as u8 + 100).collect();
        // SAFETY: s2 outlives the transport below.
        let sd = unsafe { tx.register_host(s2.as_mut_ptr(), s2.len()) }.unwrap();
        let t = connect(&tx, &rx, TransportKind::Rdma).unwrap();
        run(&*t, &[write_op(&sd, &d2, 0, 900_000, 4096)]).unwrap();
        assert_eq!(&dst[900_000..904_096], &s2[..]);
        drop(t);
        rx.registry()
            .unregister(d2.id, Duration::from_secs(2))
            .unwrap();
        drop((s2, src));
    }

    #[test]
    fn regions_re_registered_over_the_same_addresses_work_on_both_sides() {
        let rn = FakeNic::new("rereg-rx", 2, Mtu::Mtu4096);
        let tn = FakeNic::new("rereg-tx", 2, Mtu::Mtu4096);
        let rx = agent(true, Some(rn.clone()));
        let tx = agent(false, Some(tn.clone()));
        let mut dst = vec![0u8; 1 << 20];
        let mut src: Vec<u8> = (0..1u32 << 20).map(|i| (i % 241) as u8 + 1).collect();
        let (sp, dp) = (src.as_mut_ptr(), dst.as_mut_ptr());
        // SAFETY: dst and src outlive every region and transport below.
        let d = unsafe { rx.register_host(dp.add(4096), 8192) }.unwrap();
        // SAFETY: as above.
        let s = unsafe { tx.register_host(sp.add(65_536), 65_536) }.unwrap();
        let t = connect(&tx, &rx, TransportKind::Rdma).unwrap();
        run(&*t, &[write_op(&s, &d, 0, 0, 8192)]).unwrap();
        assert_eq!(&dst[4096..12_288], &src[65_536..73_728]);
        // Without deregistration the NIC refuses an overlapping range (as the
        // verbs provider does; verbs itself would register it twice).
        // SAFETY: the range is only checked (refused), never used.
        let e = unsafe { tn.register(sp as u64 + 100_000, 4096, RegionKind::Host) }.unwrap_err();
        assert_eq!(e.status(), Status::RegionOverlap, "{e}");
        // The sender frees its source and registers a larger region starting
        // earlier over the same addresses: the live link drops the stale lkey
        // and uses the new one (a stale key would fail the QP with LOC_PROT).
        tx.registry()
            .unregister(s.id, Duration::from_secs(2))
            .unwrap();
        // SAFETY: as above.
        let s2 = unsafe { tx.register_host(sp, 1 << 20) }.unwrap();
        run(&*t, &[write_op(&s2, &d, 70_000, 0, 8192)]).unwrap();
        assert_eq!(&dst[4096..12_288], &src[70_000..78_192]);
        assert_eq!(tn.regions().len(), 1);
        assert_eq!(
            (tn.regions()[0].addr, tn.regions()[0].len),
            (sp as u64, 1 << 20)
        );
        // The receiver does the same; a new connection sees the new region.
        rx.registry()
            .unregister(d.id, Duration::from_secs(2))
            .unwrap();
        // The old descriptor is refused by the receiver, nothing lands.
        let e = run(&*t, &[write_op(&s2, &d, 0, 0, 8192)]).unwrap_err();
        assert_eq!(e.status(), Status::RegionNotFound, "{e}");
        // SAFETY: as above.
        let d2 = unsafe { rx.register_host(dp, 1 << 20) }.unwrap();
        let t2 = connect(&tx, &rx, TransportKind::Rdma).unwrap();
        run(&*t2, &[write_op(&s2, &d2, 0, 100_000, 500_000)]).unwrap();
        assert_eq!(&dst[100_000..600_000], &src[..500_000]);
        assert_eq!(rn.regions().len(), 1);
        drop((t, t2));
    }

    /// Interleaved pool views (block-outermost: three layers' pages 4 KiB
    /// apart in one allocation) on both sides: each side's NIC registers the
    /// allocation once, every view writes through its keys, and unregistering
    /// views keeps the others working until the last one takes the region.
    #[test]
    fn interleaved_views_share_one_nic_region_per_allocation() {
        const PAGE: usize = 4096;
        const LAYERS: usize = 3;
        const PAGES: usize = 16;
        let rn = FakeNic::new("views-rx", 2, Mtu::Mtu4096);
        let tn = FakeNic::new("views-tx", 2, Mtu::Mtu4096);
        let rx = agent(true, Some(rn.clone()));
        let tx = agent(false, Some(tn.clone()));
        let alloc = PAGE * LAYERS * PAGES;
        let view_len = PAGE * LAYERS * (PAGES - 1) + PAGE;
        let mut dst = vec![0u8; alloc];
        let mut src: Vec<u8> = (0..alloc as u64).map(|i| (i % 253) as u8 + 1).collect();
        let (sp, dp) = (src.as_mut_ptr(), dst.as_mut_ptr());
        let views = |agent: &Agent, base: *mut u8| -> Vec<RegionDesc> {
            (0..LAYERS)
                .map(|l| {
                    // SAFETY: every view lies inside its buffer, which outlives the agents' use.
                    let v = unsafe {
                        agent
                            .registry()
                            .register_host_view(base.add(l * PAGE), view_len)
                    };
                    v.unwrap()
                })
                .collect()
        };
        let (dv, sv) = (views(&rx, dp), views(&tx, sp));
        rx.rdma_register_all().unwrap();
        let one = |n: &FakeNic, base: *mut u8| {
            let r = n.regions();
            assert_eq!(r.len(), 1, "{r:?}");
            assert_eq!((r[0].addr, r[0].len), (base as u64, alloc as u64));
        };
        one(&rn, dp);
        let t = connect(&tx, &rx, TransportKind::Rdma).unwrap();
        // page p of layer l lies at (p * LAYERS + l) * PAGE: source layer l's
        // page p into destination layer d's page PAGES-1-p
        let op = |l: usize, d: usize, p: usize| {
            write_op(
                &sv[l],
                &dv[d],
                (p * LAYERS * PAGE) as u64,
                ((PAGES - 1 - p) * LAYERS * PAGE) as u64,
                PAGE as u64,
            )
        };
        let mut model = vec![0u8; alloc];
        let land = |ops: &[(usize, usize, usize)], model: &mut Vec<u8>| {
            let w: Vec<WriteOp> = ops.iter().map(|&(l, d, p)| op(l, d, p)).collect();
            run(&*t, &w).unwrap();
            for &(l, d, p) in ops {
                let dp_ = PAGES - 1 - p;
                let (from, to) = ((p * LAYERS + l) * PAGE, (dp_ * LAYERS + d) * PAGE);
                model[to..to + PAGE].copy_from_slice(&src[from..from + PAGE]);
            }
        };
        // every layer into the next one, the first half of the pages
        let all: Vec<(usize, usize, usize)> = (0..LAYERS)
            .flat_map(|l| (0..PAGES / 2).map(move |p| (l, (l + 1) % LAYERS, p)))
            .collect();
        land(&all, &mut model);
        assert!(dst == model, "every page and no byte between them");
        one(&tn, sp);
        // one view goes on each side: the others keep their keys
        rx.registry()
            .unregister(dv[0].id, Duration::from_secs(2))
            .unwrap();
        tx.registry()
            .unregister(sv[1].id, Duration::from_secs(2))
            .unwrap();
        one(&rn, dp);
        one(&tn, sp);
        // the second half: source layers 0 and 2 into destination layers 1 and 2
        let rest: Vec<(usize, usize, usize)> = [(0usize, 1usize), (2, 2)]
            .iter()
            .flat_map(|&(l, d)| (PAGES / 2..PAGES).map(move |p| (l, d, p)))
            .collect();
        land(&rest, &mut model);
        assert!(dst == model, "the remaining views still land byte-exact");
        // the unregistered destination view is refused, nothing lands
        let e = run(&*t, &[op(2, 0, 9)]).unwrap_err();
        assert_eq!(e.status(), Status::RegionNotFound, "{e}");
        assert!(dst == model);
        drop(t);
        // the last view takes the allocation's region with it
        for d in &dv[1..] {
            rx.registry()
                .unregister(d.id, Duration::from_secs(2))
                .unwrap();
        }
        for s in [&sv[0], &sv[2]] {
            tx.registry()
                .unregister(s.id, Duration::from_secs(2))
                .unwrap();
        }
        assert!(rn.regions().is_empty(), "{:?}", rn.regions());
        assert!(tn.regions().is_empty(), "{:?}", tn.regions());
        drop((src, dst));
    }

    #[test]
    fn many_failed_batches_leave_nothing_in_the_tracker() {
        use crate::transport::rdma::{BatchState, Direction, Span};
        let an = FakeNic::new("fail-a", 2, Mtu::Mtu4096);
        let bn = FakeNic::new("fail-b", 2, Mtu::Mtu4096);
        let src: Vec<u8> = (0..1u32 << 21).map(|i| (i % 239) as u8).collect();
        let dst = vec![0u8; 1 << 21];
        // SAFETY: both buffers outlive the data paths below.
        unsafe {
            an.register(src.as_ptr() as u64, src.len() as u64, RegionKind::Host)
                .unwrap();
            bn.register(dst.as_ptr() as u64, dst.len() as u64, RegionKind::Host)
                .unwrap();
        }
        let (pa, _pb) = raw_pair(&an, &bn);
        assert_eq!(pa.rails(), 2);
        let rail1 = an.qpns()[1];
        // 20 pieces of 64 KiB: about 10 work requests on each rail, one group each.
        let spans: Vec<Span> = (0..20u64)
            .map(|k| Span {
                local_addr: src.as_ptr() as u64 + k * 100_000,
                remote_addr: dst.as_ptr() as u64 + k * 100_000,
                len: 65_536,
            })
            .collect();
        let settle = |what: &str| {
            let t0 = Instant::now();
            while pa.tracked() > 0 && t0.elapsed() < Duration::from_secs(2) {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(pa.tracked(), 0, "{what}: the tracker kept batches");
        };
        for round in 0..150u32 {
            // Rail 1's NIC refuses half of its next post (out of resources): the
            // batch fails with rail 0's part in flight and both rails healthy.
            fake::refuse_posts(rail1, 1);
            let e = pa
                .post_batch(2 * round + 1, Direction::Write, &spans)
                .unwrap_err();
            assert!(e.detail().contains("ENOMEM"), "{e}");
            // Nobody waits for the failed batch: it must retire by itself.
            settle(&format!("round {round}"));
            // The rails stay usable and their send slots come back.
            let b = 2 * round + 2;
            pa.post_batch(b, Direction::Write, &spans).unwrap();
            assert_eq!(
                pa.wait(b, Duration::from_secs(5)).unwrap(),
                BatchState::Done { bytes: 20 * 65_536 }
            );
        }
        settle("end");
        assert!(fake::qp_alive(rail1));
        for k in 0..20 {
            let o = k * 100_000;
            assert_eq!(&dst[o..o + 65_536], &src[o..o + 65_536]);
        }
    }

    #[test]
    fn device_regions_move_over_rdma_and_a_nic_without_gpudirect_refuses_them() {
        let rn = FakeNic::new("gpu-rx", 2, Mtu::Mtu4096);
        let tn = FakeNic::new("gpu-tx", 2, Mtu::Mtu4096);
        let rx = agent(true, Some(rn.clone()));
        let tx = agent(false, Some(tn.clone()));
        // "Device" memory on the fake fabric is plain memory registered as Device.
        let mut dpool = vec![0u8; 1 << 20];
        let mut spool: Vec<u8> = (0..1u32 << 20).map(|i| (i * 3 % 253) as u8 + 1).collect();
        let mut host = vec![0u8; 65_536];
        // SAFETY: the buffers outlive every region and transport below.
        let (d, s, h) = unsafe {
            (
                rx.registry()
                    .register_device_unchecked(dpool.as_mut_ptr() as u64, dpool.len(), 0)
                    .unwrap(),
                tx.registry()
                    .register_device_unchecked(spool.as_mut_ptr() as u64, spool.len(), 1)
                    .unwrap(),
                rx.register_host(host.as_mut_ptr(), host.len()).unwrap(),
            )
        };
        assert_eq!(d.kind, RegionKind::Device { ordinal: 0 });
        let t = connect(&tx, &rx, TransportKind::Rdma).unwrap();
        // Device to device, and device to host.
        let c = run(
            &*t,
            &[
                write_op(&s, &d, 1000, 0, 400_000),
                write_op(&s, &d, 0, 600_000, 300_000),
                write_op(&s, &h, 5, 0, 65_536),
            ],
        )
        .unwrap();
        assert_eq!(c.bytes, 765_536);
        assert_eq!(&dpool[..400_000], &spool[1000..401_000]);
        assert_eq!(&dpool[600_000..900_000], &spool[..300_000]);
        assert_eq!(&host[..], &spool[5..65_541]);
        let inc = rx.next_completion(Duration::from_secs(5)).unwrap();
        assert_eq!(inc.completion.bytes, 765_536);
        // Both NICs registered the device regions through their GPU path.
        assert!(rn
            .regions()
            .iter()
            .any(|r| r.addr == d.addr && r.kind == RegionKind::Device { ordinal: 0 }));
        assert!(tn
            .regions()
            .iter()
            .any(|r| r.addr == s.addr && r.kind == RegionKind::Device { ordinal: 1 }));
        // Reads from device memory into device memory.
        let r = [crate::transport::ReadOp {
            local_region: s.id,
            local_offset: 900_000,
            remote_region: d.id,
            remote_offset: 0,
            len: 100_000,
        }];
        t.wait(
            t.submit_reads(&r, &BatchOptions::default()).unwrap(),
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(&spool[900_000..1_000_000], &dpool[..100_000]);
        // The CPU cannot checksum device memory: refused before anything moves.
        let opts = BatchOptions {
            checksum: true,
            ..Default::default()
        };
        let e = t.submit(&[write_op(&s, &h, 0, 0, 16)], &opts).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported, "{e}");
        assert!(e.detail().contains("device memory"), "{e}");
        // cma and tcp still refuse device memory.
        let tcp = connect(&tx, &rx, TransportKind::Tcp).unwrap();
        let e = run(&*tcp, &[write_op(&s, &d, 0, 0, 16)]).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported, "{e}");

        // A sender whose NIC has no GPUDirect RDMA: its device source is refused
        // with the typed reason; host sources still move.
        let tn2 = FakeNic::new("nogpu-tx", 1, Mtu::Mtu4096);
        tn2.set_gpu_direct(false);
        let tx2 = agent(false, Some(tn2.clone()));
        let mut spool2 = vec![7u8; 65_536];
        let mut hsrc = vec![9u8; 4096];
        // SAFETY: as above.
        let (s2, hs) = unsafe {
            (
                tx2.registry()
                    .register_device_unchecked(spool2.as_mut_ptr() as u64, spool2.len(), 0)
                    .unwrap(),
                tx2.register_host(hsrc.as_mut_ptr(), hsrc.len()).unwrap(),
            )
        };
        let t2 = connect(&tx2, &rx, TransportKind::Rdma).unwrap();
        let e = run(&*t2, &[write_op(&s2, &h, 0, 0, 4096)]).unwrap_err();
        assert_eq!(e.status(), Status::NoGpuDirect, "{e}");
        assert!(
            e.detail().contains("GPUDirect") && e.detail().contains("nogpu-tx"),
            "{e}"
        );
        assert!(tn2.regions().iter().all(|r| r.kind == RegionKind::Host));
        run(&*t2, &[write_op(&hs, &h, 0, 0, 4096)]).unwrap();
        assert!(host[..4096].iter().all(|b| *b == 9));

        // A receiver whose NIC has no GPUDirect RDMA: its device region is not
        // registered with the NIC, connections still come up, and a batch into
        // it is refused at grant with the reason; nothing lands.
        let rn3 = FakeNic::new("nogpu-rx", 1, Mtu::Mtu4096);
        rn3.set_gpu_direct(false);
        let rx3 = agent(true, Some(rn3.clone()));
        let mut dpool3 = vec![0u8; 65_536];
        // SAFETY: as above.
        let d3 = unsafe {
            rx3.registry()
                .register_device_unchecked(dpool3.as_mut_ptr() as u64, dpool3.len(), 0)
                .unwrap()
        };
        // Registering everything up front (the engine does) skips it, not fails.
        rx3.rdma_register_all().unwrap();
        let t3 = connect(&tx2, &rx3, TransportKind::Rdma).unwrap();
        assert!(rn3.regions().is_empty());
        let e = run(&*t3, &[write_op(&hs, &d3, 0, 0, 4096)]).unwrap_err();
        assert_eq!(e.status(), Status::NoGpuDirect, "{e}");
        assert!(e.detail().contains("device memory"), "{e}");
        assert!(dpool3.iter().all(|b| *b == 0));
        drop((t, tcp, t2, t3));
    }

    #[test]
    fn auto_picks_rdma_across_hosts_when_both_have_a_nic() {
        let rx = agent(true, Some(FakeNic::new("arx", 1, Mtu::Mtu4096)));
        let tx = agent(false, Some(FakeNic::new("atx", 1, Mtu::Mtu4096)));
        let t = connect(&tx, &rx, TransportKind::Auto).unwrap();
        assert_eq!(t.kind(), TransportKind::Rdma);
        // No NIC on this side (this machine's real /sys, or a build without verbs):
        // auto falls back to tcp, and asking for rdma is the typed NoRdmaDevice.
        let plain = agent(false, None);
        if plain.inner.nic().is_err() {
            let t = connect(&plain, &rx, TransportKind::Auto).unwrap();
            assert_eq!(t.kind(), TransportKind::Tcp);
            let e = connect(&plain, &rx, TransportKind::Rdma).unwrap_err();
            assert_eq!(e.status(), Status::NoRdmaDevice, "{e}");
            // A peer without a NIC: rdma is refused with the peer's reason.
            let bare = agent(true, None);
            let e = connect(&tx, &bare, TransportKind::Rdma).unwrap_err();
            assert_eq!(e.status(), Status::TransportUnavailable, "{e}");
            assert!(e.detail().contains("offers no RDMA"), "{e}");
            let t = connect(&tx, &bare, TransportKind::Auto).unwrap();
            assert_eq!(t.kind(), TransportKind::Tcp);
        }
    }

    /// A peer whose regions include device memory gets rdma from `auto` only
    /// when its NICs take GPU memory (GPUDirect); otherwise tcp, whose
    /// receiver copies into device memory.
    #[test]
    fn auto_gives_a_peer_with_device_regions_rdma_only_with_gpudirect() {
        // "refuses": libcuda loads but GPU registrations fail, found by the probe
        for mode in ["gpudirect", "none", "refuses"] {
            let gpu_direct = mode == "gpudirect";
            let rn = FakeNic::new("gdrx", 1, Mtu::Mtu4096);
            rn.set_gpu_direct(mode != "none");
            rn.refuse_device_registrations(mode == "refuses");
            let rx = agent(true, Some(rn));
            let tx = agent(false, Some(FakeNic::new("gdtx", 1, Mtu::Mtu4096)));
            let mut dpool = vec![0u8; 1 << 16];
            // SAFETY: the buffer outlives the registration (rx is dropped first).
            unsafe {
                rx.registry()
                    .register_device_unchecked(dpool.as_mut_ptr() as u64, dpool.len(), 0)
                    .unwrap();
            }
            let t = connect(&tx, &rx, TransportKind::Auto).unwrap();
            let want = if gpu_direct {
                TransportKind::Rdma
            } else {
                TransportKind::Tcp
            };
            assert_eq!(t.kind(), want, "{mode}");
            drop(t);
            drop(rx);
        }
    }
}
