//! Same-host one-sided writes with `process_vm_writev` (cross-memory attach).
//!
//! Protocol per batch: the sender validates every op against the
//! receiver's descriptors, sends the write intent (destination ranges); the
//! receiver validates it against its registry and pins the regions (Grant)
//! or refuses it (Refuse, nothing written); only then the sender writes, in
//! batched iovecs (IOV_MAX per call, partial writes resumed, optionally
//! split over several threads), and sends the commit record; the receiver
//! delivers the completion and acknowledges (Ack). An out-of-bounds range
//! is never written: the sender checks it, and the receiver's grant is
//! required before the first byte moves.
//!
//! A batch of a room whose grant is open on the connection
//! ([`room`](super::room)) skips that exchange: it is checked against the
//! room's granted ranges here, written, and done once its bytes landed, with
//! no frame at all; the room's one RoomEnd/RoomAck follows its last batch.
//!
//! The peer is checked to be the process it claims: same boot id, the
//! claimed start time in `/proc/<pid>/stat`, a pidfd opened before the
//! proof, and a nonce read from the peer's memory and echoed back over the
//! control connection. The pidfd is polled before each batch: a peer that
//! exited (and whose pid might be reused) is never written to.

use super::agent::Dialed;
use super::batch::Stage;
use super::conn::{Conn, Piece, Reach};
use super::handshake::Select;
use super::identity::ProcIdentity;
use super::wire::{self, Commit, FrameType};
use super::{
    BatchId, BatchOptions, BatchStatus, MappedRegion, PlacedRange, ReadOp, Transport,
    TransportKind, WriteOp,
};
use crate::error::{Error, Result, Status};
use crate::memory::{AccessGuard, RegionDesc};
use crossbeam::channel::{unbounded, Sender};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// Most iovecs per `process_vm_writev` call (Linux IOV_MAX).
const IOV_MAX: usize = 1024;

/// A verified same-host peer process.
pub(crate) struct PeerProcess {
    pid: libc::pid_t,
    pidfd: Option<OwnedFd>,
    claimed: ProcIdentity,
    /// Peer regions backed by a memfd, mapped here: written with memcpy.
    mapped: HashMap<u64, RemoteMap>,
}

/// The pages of a peer's shared region, mapped into this process: the
/// region starts `delta` bytes into the mapping (mmap offsets are page-aligned).
struct RemoteMap {
    base: *mut u8,
    len: usize,
    delta: usize,
    region_len: u64,
}

// SAFETY: a shared mapping used only as a destination address by the writer threads.
unsafe impl Send for RemoteMap {}
// SAFETY: as above; concurrent writers touch disjoint granted ranges.
unsafe impl Sync for RemoteMap {}

impl RemoteMap {
    /// Maps `len` bytes at `offset` of the peer's memfd `fd`; `None` when the
    /// file is shorter or the mapping fails.
    fn new(fd: &OwnedFd, offset: u64, len: u64) -> Option<RemoteMap> {
        // SAFETY: st is a valid out-struct for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid fd and out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return None;
        }
        let end = offset.checked_add(len)?;
        if (st.st_size as u64) < end || len == 0 {
            return None;
        }
        let page = page_size() as u64;
        let start = offset - offset % page;
        let delta = (offset - start) as usize;
        let map_len = usize::try_from(end - start).ok()?;
        // SAFETY: maps map_len bytes of the shared file from a page-aligned
        // offset inside it (checked against its size); MAP_FAILED is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                start as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        Some(RemoteMap {
            base: p as *mut u8,
            len: map_len,
            delta,
            region_len: len,
        })
    }

    /// Address of the region's first byte in this process.
    fn region_addr(&self) -> u64 {
        self.base as u64 + self.delta as u64
    }

    /// Populates the mapping's page tables now, off the request path:
    /// `MADV_POPULATE_WRITE` (Linux 5.14+), else one read per page (never a
    /// write: the peer may be using the memory). Returns the bytes populated.
    fn populate(&self) -> u64 {
        // SAFETY: base/len are exactly this mapping; the advice only faults its pages in.
        let r = unsafe {
            libc::madvise(
                self.base as *mut libc::c_void,
                self.len,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            let page = page_size();
            let mut sum = 0u8;
            for off in (0..self.len).step_by(page) {
                // SAFETY: off < len: inside this live mapping; a volatile read only faults the page in.
                sum ^= unsafe { std::ptr::read_volatile(self.base.add(off)) };
            }
            std::hint::black_box(sum);
        }
        self.len as u64
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

impl Drop for RemoteMap {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly the mapping made in RemoteMap::new.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

fn cma_error(op: &str, pid: libc::pid_t, e: std::io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::ESRCH) => Error::new(
            Status::PeerUnreachable,
            format!("{op}: peer process {pid} no longer exists"),
        ),
        Some(libc::EPERM) => Error::new(
            Status::PeerIdentity,
            format!("{op} into pid {pid}: permission denied (needs the same uid and ptrace permission, or CAP_SYS_PTRACE; check /proc/sys/kernel/yama/ptrace_scope); use tcp"),
        ),
        Some(libc::EFAULT) => Error::new(
            Status::BatchFailed,
            format!("{op} into pid {pid}: address not mapped in the peer (it freed memory it had registered?)"),
        ),
        Some(libc::ENOSYS) => Error::new(
            Status::TransportUnavailable,
            format!("{op}: the kernel has no cross-memory attach"),
        ),
        _ => Error::new(Status::Io, format!("{op} into pid {pid}: {e}")),
    }
}

impl PeerProcess {
    /// Opens a pidfd for the claimed peer and verifies the claim.
    pub fn open(me: &ProcIdentity, claimed: &ProcIdentity) -> Result<PeerProcess> {
        let pid = claimed.pid as libc::pid_t;
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let pidfd = if fd >= 0 {
            // SAFETY: fd is a fresh descriptor we own.
            Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
        } else {
            None
        };
        // Verify after opening the pidfd: the fd then refers to the verified process.
        me.verify_local_peer(claimed)?;
        Ok(PeerProcess {
            pid,
            pidfd,
            claimed: claimed.clone(),
            mapped: HashMap::new(),
        })
    }

    /// Maps the peer's memfd-backed regions (`pidfd_getfd` + `mmap`) so
    /// they are written with memcpy, and populates the mappings now
    /// ([`populate`]) so the first batch takes no page faults; a region that
    /// cannot be mapped (old kernel, no permission, size mismatch) stays on
    /// `process_vm_writev`. Returns the number of regions mapped.
    pub fn map_shared(&mut self, regions: &[RegionDesc]) -> usize {
        let Some(pidfd) = &self.pidfd else { return 0 };
        let t0 = std::time::Instant::now();
        let mut populated = 0u64;
        for d in regions {
            let Some(&remote_fd) = d.keys.get(crate::memory::MEMFD_KEY) else {
                continue;
            };
            if d.kind != crate::memory::RegionKind::Host {
                continue;
            }
            let offset = d
                .keys
                .get(crate::memory::MEMFD_OFFSET_KEY)
                .copied()
                .unwrap_or(0);
            // SAFETY: pidfd_getfd duplicates the peer's descriptor into ours or returns -1.
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_pidfd_getfd,
                    pidfd.as_raw_fd(),
                    remote_fd as i32,
                    0,
                )
            };
            if fd < 0 {
                continue;
            }
            // SAFETY: fd is a fresh descriptor we own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            let Some(m) = RemoteMap::new(&fd, offset, d.len) else {
                continue;
            };
            populated += m.populate();
            self.mapped.insert(d.id, m);
        }
        if !self.mapped.is_empty() {
            log::debug!(
                "cma: mapped {} region(s) of pid {}, {populated} B populated in {:?}",
                self.mapped.len(),
                self.pid,
                t0.elapsed()
            );
        }
        self.mapped.len()
    }

    /// The peer region `region` as mapped here: its start address in this
    /// process and its length.
    pub fn mapped(&self, region: u64) -> Option<(u64, u64)> {
        self.mapped
            .get(&region)
            .map(|m| (m.region_addr(), m.region_len))
    }

    /// Reads 8 bytes at `addr` in the peer (the handshake proof).
    pub fn read_u64(&self, addr: u64) -> Result<u64> {
        let mut v = 0u64;
        let local = libc::iovec {
            iov_base: &mut v as *mut u64 as *mut libc::c_void,
            iov_len: 8,
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: 8,
        };
        // SAFETY: local points at a live u64; the remote address is only interpreted by the kernel in the peer.
        let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
        if n != 8 {
            return Err(cma_error(
                "process_vm_readv (handshake proof)",
                self.pid,
                std::io::Error::last_os_error(),
            ));
        }
        Ok(v)
    }

    /// Fails when the peer exited since the handshake.
    pub fn check_alive(&self) -> Result<()> {
        match &self.pidfd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, zero timeout.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                if n > 0 {
                    return Err(Error::new(
                        Status::PeerUnreachable,
                        format!("peer process {} exited; not writing to its pid", self.pid),
                    ));
                }
                Ok(())
            }
            None => {
                let st = super::identity::start_time_of(self.claimed.pid)?;
                if st != self.claimed.start_time {
                    return Err(Error::new(
                        Status::PeerIdentity,
                        format!(
                            "pid {} now belongs to another process (start tick {st} != {})",
                            self.pid, self.claimed.start_time
                        ),
                    ));
                }
                Ok(())
            }
        }
    }

    /// Moves every piece: writes (`src` local, `dst` in the peer) or reads
    /// (`src` in the peer, `dst` local). Mapped peer regions use memcpy.
    pub fn xfer(&self, pieces: &[Piece], read: bool) -> Result<u64> {
        if self.mapped.is_empty() {
            return self.writev(pieces, read);
        }
        let mut total = 0u64;
        let mut rest = Vec::new();
        for p in pieces {
            match self.mapped.get(&p.region) {
                Some(m)
                    if p.offset
                        .checked_add(p.len)
                        .is_some_and(|e| e <= m.region_len) =>
                {
                    // SAFETY: the local range is pinned in our registry; the peer range was granted by the peer and lies inside the mapping (checked just above).
                    unsafe {
                        let peer = m.base.add(m.delta + p.offset as usize);
                        if read {
                            std::ptr::copy_nonoverlapping(
                                peer as *const u8,
                                p.dst as *mut u8,
                                p.len as usize,
                            )
                        } else {
                            std::ptr::copy_nonoverlapping(p.src as *const u8, peer, p.len as usize)
                        }
                    };
                    total += p.len;
                }
                _ => rest.push(*p),
            }
        }
        Ok(total + self.writev(&rest, read)?)
    }

    /// Moves pieces with `process_vm_writev` (or `_readv`); returns the bytes moved.
    fn writev(&self, pieces: &[Piece], read: bool) -> Result<u64> {
        let mut total = 0u64;
        let mut i = 0usize; // current piece
        let mut off = 0u64; // bytes of piece i already written
        while i < pieces.len() {
            let mut local = Vec::with_capacity(IOV_MAX.min(pieces.len() - i));
            let mut remote = Vec::with_capacity(local.capacity());
            let mut want = 0u64;
            for (k, p) in pieces[i..].iter().enumerate().take(IOV_MAX) {
                let skip = if k == 0 { off } else { 0 };
                if p.len == skip {
                    continue;
                }
                let (l, r) = if read { (p.dst, p.src) } else { (p.src, p.dst) };
                local.push(libc::iovec {
                    iov_base: (l + skip) as *mut libc::c_void,
                    iov_len: (p.len - skip) as usize,
                });
                remote.push(libc::iovec {
                    iov_base: (r + skip) as *mut libc::c_void,
                    iov_len: (p.len - skip) as usize,
                });
                want += p.len - skip;
            }
            if local.is_empty() {
                i += 1;
                off = 0;
                continue;
            }
            let f = if read {
                libc::process_vm_readv
            } else {
                libc::process_vm_writev
            };
            // SAFETY: local iovecs lie in registered, pinned regions of this process; remote ones were granted by the peer.
            let n = unsafe {
                f(
                    self.pid,
                    local.as_ptr(),
                    local.len() as libc::c_ulong,
                    remote.as_ptr(),
                    remote.len() as libc::c_ulong,
                    0,
                )
            };
            if n < 0 {
                return Err(cma_error(
                    "process_vm_writev",
                    self.pid,
                    std::io::Error::last_os_error(),
                ));
            }
            if n == 0 && want > 0 {
                return Err(Error::new(
                    Status::BatchFailed,
                    "process_vm_writev wrote 0 bytes",
                ));
            }
            total += n as u64;
            // Advance (i, off) by n bytes; partial writes resume mid-piece.
            let mut n = n as u64;
            while n > 0 && i < pieces.len() {
                let left = pieces[i].len - off;
                if n >= left {
                    n -= left;
                    i += 1;
                    off = 0;
                } else {
                    off += n;
                    n = 0;
                }
            }
            while i < pieces.len() && pieces[i].len == off {
                i += 1;
                off = 0;
            }
        }
        Ok(total)
    }
}

/// Splits pieces into `n` groups of about equal bytes (splitting large pieces).
pub(crate) fn split_even(pieces: &[Piece], n: usize) -> Vec<Vec<Piece>> {
    let total: u64 = pieces.iter().map(|p| p.len).sum();
    let n = n.max(1);
    let share = total.div_ceil(n as u64).max(1);
    let mut out = vec![Vec::new()];
    let mut cur = 0u64;
    for p in pieces {
        let mut p = *p;
        while p.len > 0 {
            if cur >= share && out.len() < n {
                out.push(Vec::new());
                cur = 0;
            }
            let take = if out.len() < n {
                p.len.min(share - cur)
            } else {
                p.len
            };
            let mut part = p;
            part.len = take;
            if let Some(v) = out.last_mut() {
                v.push(part);
            }
            cur += take;
            p.src += take;
            p.dst += take;
            p.offset += take;
            p.len -= take;
        }
    }
    out
}

/// A write batch of a granted room below this many bytes is moved on the
/// submitting thread (one thread would move it anyway): no hand-off to the
/// writer thread and back, whose two wake-ups cost more than the copy.
const INLINE_ROOM_BYTES: u64 = 256 << 10;

struct Job {
    id: u64,
    read: bool,
    pieces: Vec<Piece>,
    commit: Commit,
    /// A batch of a room open under a grant: (room, epoch); it ends here,
    /// with no frame to the receiver.
    room: Option<(u64, u64)>,
    _guards: Arc<Vec<AccessGuard>>,
    /// The caller placed the bytes already (`submit_placed`): nothing to move.
    placed: bool,
}

/// The cma transport (sender side).
pub struct CmaTransport {
    conn: Arc<Conn>,
    tx: Sender<Job>,
    mapped: usize,
    /// The peer (shared with the writer thread): its mapped regions live as
    /// long as this transport.
    peer: Arc<PeerProcess>,
}

impl CmaTransport {
    pub(crate) fn new(
        conn: Arc<Conn>,
        mut peer: PeerProcess,
        threads: usize,
    ) -> Result<CmaTransport> {
        let regions: Vec<RegionDesc> = conn.regions.values().cloned().collect();
        let mapped = peer.map_shared(&regions);
        let peer = Arc::new(peer);
        let (tx, rx) = unbounded::<Job>();
        let (c, p) = (conn.clone(), peer.clone());
        std::thread::Builder::new()
            .name("pdxfer-cma-tx".into())
            .spawn(move || {
                for job in rx {
                    c.run_job(&p, threads, job);
                }
            })?;
        Ok(CmaTransport {
            conn,
            tx,
            mapped,
            peer,
        })
    }
}

/// The sender's cma setup on a dialed control connection: opens the peer
/// process (pidfd and identity checks), proves it by reading the nonce the
/// receiver named in its HelloAck, selects cma and starts the transport.
pub(crate) fn connect(mut d: Dialed<'_>) -> Result<Box<dyn Transport>> {
    let pidfd = PeerProcess::open(d.identity, &d.ack.identity)?;
    let proof = pidfd.read_u64(d.ack.nonce_addr)?;
    wire::write_json(
        &mut d.stream,
        FrameType::Select,
        &Select {
            transport: TransportKind::Cma,
            streams: 0,
            proof,
            rdma: None,
        },
    )?;
    let _: serde_json::Value = wire::read_json(&mut d.stream, FrameType::SelectOk)?;
    let threads = d.opts.threads.max(1) as usize;
    let conn = d.start()?;
    Ok(Box::new(CmaTransport::new(conn, pidfd, threads)?))
}

impl Conn {
    fn run_job(&self, peer: &PeerProcess, threads: usize, job: Job) {
        let r = self.move_job(peer, threads, &job);
        if let Some(key) = job.room {
            // a granted room's batch ends here: no commit, no frame
            let outcome = match r {
                Ok(_) => {
                    self.table.set(job.id, Stage::Done);
                    Ok(job.commit.bytes)
                }
                Err(e) => {
                    self.table.fail(job.id, e.clone());
                    Err(e)
                }
            };
            self.rooms.finished(key, outcome);
            return;
        }
        match r {
            Ok(read_sum) => {
                let mut commit = job.commit;
                if read_sum.is_some() {
                    commit.checksum = read_sum;
                }
                let _ = self.send(FrameType::Commit, &wire::encode_commit(&commit));
            }
            Err(_) => {
                let _ = self.send(FrameType::Abort, &job.id.to_le_bytes());
            }
        }
    }

    /// Moves a job's bytes once it is granted; `Ok` when every byte landed
    /// before the batch's deadline (the batch is then `Written`; a read asked
    /// for a checksum gets it, recorded and returned), else why not (the
    /// batch failed).
    fn move_job(&self, peer: &PeerProcess, threads: usize, job: &Job) -> Result<Option<u64>> {
        let gone = || Error::new(Status::BatchFailed, "the batch ended before it was written");
        self.table.wait_granted(job.id)?;
        if let Err(e) = peer.check_alive() {
            self.rooms.fail_all(e.clone());
            self.table.fail_all(e.clone());
            return Err(e);
        }
        if self.table.finished(job.id) {
            return Err(gone());
        }
        let r = if job.placed {
            Ok(job.commit.bytes)
        } else if threads <= 1 || job.pieces.is_empty() || job.commit.bytes < (256 << 10) {
            peer.xfer(&job.pieces, job.read)
        } else {
            let groups = split_even(&job.pieces, threads);
            std::thread::scope(|s| {
                let hs: Vec<_> = groups
                    .iter()
                    .map(|g| s.spawn(move || peer.xfer(g, job.read)))
                    .collect();
                let mut sum = 0u64;
                let mut err = None;
                for h in hs {
                    match h.join() {
                        Ok(Ok(n)) => sum += n,
                        Ok(Err(e)) => err = Some(e),
                        Err(_) => {
                            err = Some(Error::new(
                                Status::BatchFailed,
                                "a cma writer thread panicked",
                            ))
                        }
                    }
                }
                err.map_or(Ok(sum), Err)
            })
        };
        match r {
            Ok(n) if n == job.commit.bytes => {
                let mut read_sum = None;
                if job.read && job.commit.checksum.is_some() {
                    let sum = read_checksum(&job.pieces);
                    self.table.set_checksum(job.id, sum);
                    read_sum = Some(sum);
                }
                self.table.set(job.id, Stage::Written);
                if self.table.finished(job.id) {
                    // Deadline passed while writing: no completion for the receiver.
                    return Err(gone());
                }
                Ok(read_sum)
            }
            Ok(n) => {
                let e = Error::new(
                    Status::BatchFailed,
                    format!("wrote {n} of {} bytes", job.commit.bytes),
                );
                self.table.fail(job.id, e.clone());
                Err(e)
            }
            Err(e) => {
                self.table.fail(job.id, e.clone());
                if e.status() == Status::PeerUnreachable {
                    self.rooms.fail_all(e.clone());
                    self.table.fail_all(e.clone());
                }
                Err(e)
            }
        }
    }
}

/// Checksum of the bytes a read landed locally (same pieces as the peer's ranges).
fn read_checksum(pieces: &[Piece]) -> u64 {
    pieces.iter().fold(0u64, |acc, p| {
        // SAFETY: dst is a pinned local registered range the read just filled.
        let d = unsafe { std::slice::from_raw_parts(p.dst as *const u8, p.len as usize) };
        super::checksum::combine(acc, super::checksum::piece(p.region, p.offset, d))
    })
}

impl CmaTransport {
    fn submit_dir(&self, ops: &[WriteOp], opts: &BatchOptions, read: bool) -> Result<BatchId> {
        let (mut pieces, guards, bytes) = self.conn.validate(ops, Reach::Host)?;
        if read {
            for p in &mut pieces {
                std::mem::swap(&mut p.src, &mut p.dst);
            }
        }
        let granted = if read {
            None
        } else {
            self.conn.rooms.admit(&pieces, opts)?
        };
        let (commit, room) = match granted {
            None => (
                self.conn.announce(&pieces, &guards, bytes, opts, read)?,
                None,
            ),
            Some(_token) => (
                self.conn.insert_room_batch(bytes, &guards, opts)?,
                Some((opts.room, opts.epoch)),
            ),
        };
        let id = commit.batch;
        let job = Job {
            id,
            read,
            pieces,
            commit,
            room,
            _guards: guards,
            placed: false,
        };
        if room.is_some() && bytes < INLINE_ROOM_BYTES {
            // nothing to wait for (granted with the room): moved on this
            // thread, sparing the writer thread's wake-up and the caller's
            self.conn.run_job(&self.peer, 1, job);
        } else {
            self.queue(job);
        }
        Ok(BatchId(id))
    }

    /// Hands a job to the writer thread (it fails when the thread is gone).
    fn queue(&self, job: Job) {
        let (id, room) = (job.id, job.room);
        if self.tx.send(job).is_err() {
            let e = Error::new(Status::PeerUnreachable, "cma writer thread is gone");
            if let Some(key) = room {
                self.conn.rooms.finished(key, Err(e.clone()));
            }
            self.conn.table.fail(id, e);
        }
    }
}

impl CmaTransport {
    /// Checks placed ranges against the peer's descriptors and the mapped
    /// regions: pieces whose source is the mapped destination itself.
    fn placed_pieces(&self, ranges: &[PlacedRange]) -> Result<(Vec<Piece>, u64)> {
        if let Some(e) = self.conn.table.dead() {
            return Err(e);
        }
        let mut pieces = Vec::with_capacity(ranges.len());
        let mut total = 0u64;
        for (i, r) in ranges.iter().enumerate() {
            let refused = |status, what: String| {
                Err(Error::new(
                    status,
                    format!("range {i} of the placed batch: {what}; nothing was sent"),
                ))
            };
            let Some(d) = self.conn.regions.get(&r.remote_region) else {
                return refused(
                    Status::RegionNotFound,
                    format!("the peer exported no region {}", r.remote_region),
                );
            };
            if let Err(e) = d.check(r.remote_offset, r.len) {
                return refused(e.status(), e.detail().to_string());
            }
            let Some((addr, _)) = self.peer.mapped(r.remote_region) else {
                return refused(
                    Status::Unsupported,
                    format!(
                        "the peer's region {} is not mapped here (not memfd-backed); use submit",
                        r.remote_region
                    ),
                );
            };
            total = total
                .checked_add(r.len)
                .ok_or_else(|| Error::invalid("batch size overflows"))?;
            pieces.push(Piece {
                src: addr + r.remote_offset,
                region: r.remote_region,
                offset: r.remote_offset,
                dst: d.addr + r.remote_offset,
                len: r.len,
            });
        }
        Ok((pieces, total))
    }

    /// `submit_placed`: the write path of `submit_dir` with the caller's
    /// placement between the grant and the commit, and the job flagged as
    /// placed so the writer thread only commits it.
    fn submit_placed_dir(
        &self,
        ranges: &[PlacedRange],
        opts: &BatchOptions,
        place: &mut dyn FnMut() -> Result<()>,
    ) -> Result<BatchId> {
        let (pieces, bytes) = self.placed_pieces(ranges)?;
        let guards = Arc::new(Vec::new());
        if let Some(_token) = self.conn.rooms.admit(&pieces, opts)? {
            return self.submit_placed_in_room(pieces, bytes, guards, opts, place);
        }
        // the checksum covers the placed bytes: computed once they are there
        let announce_opts = BatchOptions {
            checksum: false,
            ..*opts
        };
        let mut commit = self
            .conn
            .announce(&pieces, &guards, bytes, &announce_opts, false)?;
        let id = commit.batch;
        let gone = |e: Error| {
            self.conn.table.fail(id, e);
            let _ = self.conn.send(FrameType::Abort, &id.to_le_bytes());
            match self.conn.table.poll(BatchId(id)) {
                Ok(BatchStatus::Failed(e)) => e,
                _ => Error::new(Status::BatchFailed, "placed batch failed"),
            }
        };
        // Place only after the grant: the peer validated and pinned every range.
        if let Err(e) = self.conn.table.wait_granted(id) {
            return Err(gone(e));
        }
        if let Err(e) = self.peer.check_alive() {
            self.conn.table.fail_all(e.clone());
            return Err(gone(e));
        }
        if let Err(e) = place() {
            return Err(gone(e));
        }
        if opts.checksum {
            let sum = super::conn::checksum_pieces(&pieces);
            commit.checksum = Some(sum);
            self.conn.table.set_checksum(id, sum);
        }
        let job = Job {
            id,
            read: false,
            pieces,
            commit,
            room: None,
            _guards: guards,
            placed: true,
        };
        self.queue(job);
        Ok(BatchId(id))
    }

    /// `submit_placed` for a batch of a room whose grant is open (its
    /// ranges were checked against it): placed at once, no intent, no grant
    /// and no commit frame; done before this returns.
    fn submit_placed_in_room(
        &self,
        pieces: Vec<Piece>,
        bytes: u64,
        guards: Arc<Vec<AccessGuard>>,
        opts: &BatchOptions,
        place: &mut dyn FnMut() -> Result<()>,
    ) -> Result<BatchId> {
        let key = (opts.room, opts.epoch);
        let commit = self.conn.insert_room_batch(bytes, &guards, opts)?;
        let id = commit.batch;
        let placed = self.peer.check_alive().inspect_err(|e| {
            self.conn.rooms.fail_all(e.clone());
            self.conn.table.fail_all(e.clone());
        });
        if let Err(e) = placed.and_then(|()| place()) {
            self.conn.table.fail(id, e.clone());
            let _ = self.conn.table.poll(BatchId(id));
            self.conn.rooms.finished(key, Err(e.clone()));
            return Err(e);
        }
        // placed already and granted with the room: marked done on this thread
        self.conn.run_job(
            &self.peer,
            1,
            Job {
                id,
                read: false,
                pieces,
                commit,
                room: Some(key),
                _guards: guards,
                placed: true,
            },
        );
        Ok(BatchId(id))
    }
}

impl Transport for CmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Cma
    }

    fn data_path(&self) -> &'static str {
        if self.mapped > 0 {
            "cma: memcpy into the peer's mapped memfd regions (process_vm_writev for others)"
        } else {
            "cma: process_vm_writev"
        }
    }

    super::conn::conn_backed_transport!();
    super::conn::conn_room_grants!();

    fn submit(&self, ops: &[WriteOp], opts: &BatchOptions) -> Result<BatchId> {
        self.submit_dir(ops, opts, false)
    }

    fn submit_reads(&self, ops: &[ReadOp], opts: &BatchOptions) -> Result<BatchId> {
        let w: Vec<WriteOp> = ops.iter().map(ReadOp::as_write).collect();
        self.submit_dir(&w, opts, true)
    }

    fn mapped_dst(&self, region: u64) -> Option<MappedRegion> {
        self.peer
            .mapped(region)
            .map(|(addr, len)| MappedRegion { addr, len })
    }

    fn submit_placed(
        &self,
        ranges: &[PlacedRange],
        opts: &BatchOptions,
        place: &mut dyn FnMut() -> Result<()>,
    ) -> Result<BatchId> {
        self.submit_placed_dir(ranges, opts, place)
    }

    fn close(&self) {
        self.conn.close();
    }
}

impl Drop for CmaTransport {
    fn drop(&mut self) {
        self.conn.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_even_covers_every_byte_once() {
        let pieces = vec![
            Piece {
                src: 0,
                region: 1,
                offset: 0,
                dst: 1000,
                len: 10,
            },
            Piece {
                src: 100,
                region: 1,
                offset: 50,
                dst: 1050,
                len: 7,
            },
        ];
        for n in 1..5 {
            let g = split_even(&pieces, n);
            assert!(g.len() <= n);
            let mut bytes: Vec<(u64, u64)> = g
                .iter()
                .flatten()
                .flat_map(|p| (0..p.len).map(move |k| (p.src + k, p.dst + k)))
                .collect();
            bytes.sort();
            let want: Vec<(u64, u64)> = (0..10)
                .map(|k| (k, 1000 + k))
                .chain((0..7).map(|k| (100 + k, 1050 + k)))
                .collect();
            assert_eq!(bytes, want, "n={n}");
        }
    }
}
