//! The verified same-host peer process of a cma connection: its pidfd (from
//! the kernel-vouched binding socket) and identity checks, its memfd-backed regions mapped here (populated at
//! connect), and the byte mover (`memcpy` into mapped regions,
//! `process_vm_writev`/`_readv` for the rest, in IOV_MAX batches).

use crate::error::{Error, Result, Status};
use crate::memory::RegionDesc;
use crate::transport::identity::ProcIdentity;
use crate::transport::piece::Piece;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

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
    /// The peer process the kernel vouched for (`vouched`, the listener of
    /// the receiver's binding socket), which must be the one the HelloAck
    /// names (`claimed`: same pid, boot id and start time); takes its pidfd.
    pub(crate) fn bound(
        me: &ProcIdentity,
        claimed: &ProcIdentity,
        vouched: &mut super::bind::Vouched,
        addr: &str,
    ) -> Result<PeerProcess> {
        if vouched.pid != claimed.pid {
            return Err(Error::new(
                Status::PeerIdentity,
                format!(
                    "the peer at {addr} names pid {} as the process to write into, but the \
                     kernel says its binding socket is held by pid {} (uid {}): refused, \
                     nothing of either process is read or written",
                    claimed.pid, vouched.pid, vouched.uid
                ),
            ));
        }
        me.verify_local_peer(claimed)?;
        Ok(PeerProcess {
            pid: claimed.pid as libc::pid_t,
            pidfd: vouched.pidfd.take(),
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
                let st = crate::transport::identity::start_time_of(self.claimed.pid)?;
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
            let mut local: Vec<libc::iovec> = Vec::with_capacity(IOV_MAX.min(pieces.len() - i));
            let mut remote: Vec<libc::iovec> = Vec::with_capacity(local.capacity());
            let mut want = 0u64;
            for (k, p) in pieces[i..].iter().enumerate() {
                let skip = if k == 0 { off } else { 0 };
                if p.len == skip {
                    continue;
                }
                let (l, r) = if read { (p.dst, p.src) } else { (p.src, p.dst) };
                let (l, r, n) = (l + skip, r + skip, p.len - skip);
                // a piece that continues the previous one (rows gathered from
                // scattered sources into one destination run, say) extends its
                // iovec: the lists are independent, the bytes move in order
                let l_joins = local
                    .last()
                    .is_some_and(|v| v.iov_base as u64 + v.iov_len as u64 == l);
                let r_joins = remote
                    .last()
                    .is_some_and(|v| v.iov_base as u64 + v.iov_len as u64 == r);
                if (!l_joins && local.len() == IOV_MAX) || (!r_joins && remote.len() == IOV_MAX) {
                    break;
                }
                for (list, joins, at) in [(&mut local, l_joins, l), (&mut remote, r_joins, r)] {
                    match list.last_mut() {
                        Some(v) if joins => v.iov_len += n as usize,
                        _ => list.push(libc::iovec {
                            iov_base: at as *mut libc::c_void,
                            iov_len: n as usize,
                        }),
                    }
                }
                want += n;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// This process as its own peer (`process_vm_writev` into itself).
    fn me() -> PeerProcess {
        PeerProcess {
            pid: std::process::id() as libc::pid_t,
            pidfd: None,
            claimed: ProcIdentity::current().unwrap(),
            mapped: HashMap::new(),
        }
    }

    fn piece(src: u64, s: usize, dst: u64, d: usize, len: usize) -> Piece {
        Piece {
            src: src + s as u64,
            region: 1,
            offset: d as u64,
            dst: dst + d as u64,
            len: len as u64,
        }
    }

    /// Rows gathered from scattered sources into runs of the destination
    /// (one remote iovec per run), runs split over scattered destinations
    /// from one source stretch (one local iovec), and more pieces than
    /// IOV_MAX: every byte lands where its piece says, nothing else moves.
    #[test]
    fn joined_iovecs_move_every_piece_byte_exact() {
        let rows = 3 * IOV_MAX;
        let src: Vec<u8> = (0..rows * 64).map(|i| (i * 7 % 251) as u8).collect();
        for case in 0..3 {
            let mut dst = vec![0u8; rows * 64 * 2];
            let (sb, db) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
            let pieces: Vec<Piece> = (0..rows)
                .map(|k| match case {
                    // scattered sources (every 3rd row of the source, wrapping) into one run
                    0 => piece(sb, (k * 3 % rows) * 64, db, k * 64, 64),
                    // one source stretch into every other row of the destination
                    1 => piece(sb, k * 64, db, k * 128, 64),
                    // runs of 5 rows each way, with a gap between runs
                    _ => piece(sb, k * 64, db, (k + k / 5) * 64, 64),
                })
                .collect();
            let moved = me().writev(&pieces, false).unwrap();
            assert_eq!(moved, (rows * 64) as u64, "case {case}");
            let mut want = vec![0u8; dst.len()];
            for p in &pieces {
                let s = (p.src - sb) as usize;
                let d = p.offset as usize;
                want[d..d + 64].copy_from_slice(&src[s..s + 64]);
            }
            assert!(dst == want, "case {case}: the destination differs");
        }
    }
}
