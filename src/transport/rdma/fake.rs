//! A software NIC for tests: an in-process fabric where every [`FakeNic`]
//! rail is a "device" with its own memory keys, and queue pairs and memory
//! regions live in one process-global table.
//!
//! Posting a work request executes it at once, the way a NIC would, after
//! the same checks: the local range must lie inside a region registered on
//! the posting rail under its lkey, the peer QP must exist and be alive, and
//! the remote range must lie inside a region registered on the peer's rail
//! under the rkey. Then WRITE copies real bytes into the peer's memory (READ
//! the other way), WRITE_WITH_IMM delivers the immediate to the peer's
//! receive queue, and a signalled WR completes. A failed check completes
//! the WR with the verbs status a NIC reports (LOC_PROT, REM_ACCESS,
//! RETRY_EXC, RNR_RETRY_EXC) and moves the QP to the error state, where
//! every later WR is flushed.
//!
//! Registration behaves like verbs: a range overlapping another registration
//! is refused (`RegionOverlap`), deregistering removes its keys from the
//! fabric at once, and device-kind regions (plain memory here) are accepted
//! and recorded unless the NIC is set without GPUDirect RDMA
//! ([`FakeNic::set_gpu_direct`]: `NoGpuDirect`), or set to refuse them at
//! registration only ([`FakeNic::refuse_device_registrations`]).
//!
//! Tests can kill a QP ([`kill_qp`]), make it fail after some WRs
//! ([`fail_qp_after`]) or make its next posts accepted only part-way
//! ([`refuse_posts`]). The fabric only connects QPs of one process; it is
//! selected explicitly (`AgentOptions::nic`), never in production.

use super::handshake::{
    random_psn, random_u64, Gid, Handshake, LinkLayer, Mtu, Negotiated, RailInfo,
};
use super::nic::{DataPath, NicEndpoint, NicProvider};
use super::session::{lock, RailIo, Session, SessionParams, SessionRail};
use super::slice::{LocalRegion, RailKeys};
use super::tracker::WorkCompletion;
use super::wr::{Opcode, WorkRequest};
use super::RecordMode;
use crate::error::{Error, Result, Status};
use crate::memory::RegionKind;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

const WC_RDMA_WRITE: u32 = 1;
const WC_RDMA_READ: u32 = 4;
const WC_RECV_RDMA_WITH_IMM: u32 = 129;
const LOC_PROT_ERR: u32 = 4;
const WR_FLUSH_ERR: u32 = 5;
const REM_ACCESS_ERR: u32 = 10;
const RETRY_EXC_ERR: u32 = 12;
const RNR_RETRY_EXC_ERR: u32 = 13;

#[derive(Clone, Copy)]
struct Mr {
    device: u64,
    addr: u64,
    len: u64,
}

struct Qp {
    qpn: u32,
    device: u64,
    remote: AtomicU32,
    error: AtomicBool,
    /// Fail the WR after this many more have executed (`u64::MAX`: never).
    fail_after: AtomicU64,
    /// Refuse part of this many next `post_send` calls (as `ibv_post_send`
    /// does when out of resources; the QP stays usable).
    refuse_posts: AtomicU64,
    cq: Mutex<VecDeque<WorkCompletion>>,
    recvs: AtomicUsize,
}

#[derive(Default)]
struct Fabric {
    next_key: u32,
    next_qpn: u32,
    next_device: u64,
    mrs: HashMap<u32, Mr>,
    qps: HashMap<u32, Arc<Qp>>,
}

fn fabric() -> &'static Mutex<Fabric> {
    static F: OnceLock<Mutex<Fabric>> = OnceLock::new();
    F.get_or_init(|| {
        Mutex::new(Fabric {
            next_key: 0x100,
            next_qpn: 0x40,
            next_device: 1,
            ..Default::default()
        })
    })
}

/// Kills the QP `qpn` (as a NIC or cable failure would): its posted and
/// future work requests fail, and so do the peer's (retries exceeded).
pub fn kill_qp(qpn: u32) {
    if let Some(q) = lock(fabric()).qps.get(&qpn) {
        q.error.store(true, Ordering::SeqCst);
    }
}

/// Makes QP `qpn` fail (retries exceeded) on its `n`-th next work request.
pub fn fail_qp_after(qpn: u32, n: u64) {
    if let Some(q) = lock(fabric()).qps.get(&qpn) {
        q.fail_after.store(n, Ordering::SeqCst);
    }
}

/// Makes the next `n` `post_send` calls on QP `qpn` accept only the first
/// half of their work-request list and refuse the rest with `ENOMEM`, as
/// `ibv_post_send` does when the NIC runs out of resources; the QP stays
/// healthy and the accepted WRs execute.
pub fn refuse_posts(qpn: u32, n: u64) {
    if let Some(q) = lock(fabric()).qps.get(&qpn) {
        q.refuse_posts.store(n, Ordering::SeqCst);
    }
}

/// Whether QP `qpn` exists and is not in the error state.
pub fn qp_alive(qpn: u32) -> bool {
    lock(fabric())
        .qps
        .get(&qpn)
        .is_some_and(|q| !q.error.load(Ordering::SeqCst))
}

fn covers(mrs: &HashMap<u32, Mr>, key: u32, device: u64, addr: u64, len: u64) -> bool {
    mrs.get(&key).is_some_and(|m| {
        m.device == device
            && addr >= m.addr
            && addr.checked_add(len).is_some_and(|e| e <= m.addr + m.len)
    })
}

impl Qp {
    fn complete(&self, wr_id: u64, status: u32, opcode: u32) {
        lock(&self.cq).push_back(WorkCompletion {
            wr_id,
            status,
            vendor_err: 0,
            opcode,
            imm: None,
        });
    }

    fn execute(&self, w: &WorkRequest) {
        if self.error.load(Ordering::SeqCst) {
            return self.complete(w.wr_id, WR_FLUSH_ERR, 0);
        }
        let left = self.fail_after.load(Ordering::SeqCst);
        if left != u64::MAX {
            if left == 0 {
                self.error.store(true, Ordering::SeqCst);
                return self.complete(w.wr_id, RETRY_EXC_ERR, 0);
            }
            self.fail_after.store(left - 1, Ordering::SeqCst);
        }
        let len = u64::from(w.len);
        let (peer, ok_local, ok_remote) = {
            let f = lock(fabric());
            let peer = f.qps.get(&self.remote.load(Ordering::SeqCst)).cloned();
            let ok_local = len == 0 || covers(&f.mrs, w.lkey, self.device, w.local_addr, len);
            let ok_remote = peer
                .as_ref()
                .is_some_and(|p| len == 0 || covers(&f.mrs, w.rkey, p.device, w.remote_addr, len));
            (peer, ok_local, ok_remote)
        };
        let Some(peer) = peer.filter(|p| !p.error.load(Ordering::SeqCst)) else {
            // No ACK from a dead or vanished peer.
            self.error.store(true, Ordering::SeqCst);
            return self.complete(w.wr_id, RETRY_EXC_ERR, 0);
        };
        if !ok_local {
            self.error.store(true, Ordering::SeqCst);
            return self.complete(w.wr_id, LOC_PROT_ERR, 0);
        }
        if !ok_remote {
            self.error.store(true, Ordering::SeqCst);
            return self.complete(w.wr_id, REM_ACCESS_ERR, 0);
        }
        if w.imm.is_some() && peer.recvs.load(Ordering::SeqCst) == 0 {
            self.error.store(true, Ordering::SeqCst);
            return self.complete(w.wr_id, RNR_RETRY_EXC_ERR, 0);
        }
        let (src, dst) = match w.opcode {
            Opcode::Read => (w.remote_addr, w.local_addr),
            _ => (w.local_addr, w.remote_addr),
        };
        if len > 0 {
            // SAFETY: both ranges lie inside regions registered on this fabric (checked
            // just above); registration requires them to stay valid while registered,
            // and the agent writes only into ranges the receiver granted and pinned.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
        }
        if let Some(imm) = w.imm {
            peer.recvs.fetch_sub(1, Ordering::SeqCst);
            lock(&peer.cq).push_back(WorkCompletion {
                wr_id: u64::MAX,
                status: 0,
                vendor_err: 0,
                opcode: WC_RECV_RDMA_WITH_IMM,
                imm: Some(imm),
            });
        }
        if w.signaled {
            let op = if w.opcode == Opcode::Read {
                WC_RDMA_READ
            } else {
                WC_RDMA_WRITE
            };
            self.complete(w.wr_id, 0, op);
        }
    }
}

/// One rail's QP on the fake fabric.
pub struct FakeRail {
    qp: Arc<Qp>,
}

impl Drop for FakeRail {
    fn drop(&mut self) {
        // A destroyed QP answers nothing: the peer's next WR fails with retries exceeded.
        self.qp.error.store(true, Ordering::SeqCst);
        lock(fabric()).qps.remove(&self.qp.qpn);
    }
}

impl RailIo for FakeRail {
    fn post_send(&self, wrs: &[WorkRequest]) -> std::result::Result<(), (usize, Error)> {
        let refuse = self
            .qp
            .refuse_posts
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let accepted = if refuse { wrs.len() / 2 } else { wrs.len() };
        for w in &wrs[..accepted] {
            self.qp.execute(w);
        }
        if accepted < wrs.len() {
            return Err((
                accepted,
                Error::new(
                    Status::Rdma,
                    format!(
                        "ibv_post_send refused work request {accepted} of {}: ENOMEM (fake fabric)",
                        wrs.len()
                    ),
                ),
            ));
        }
        Ok(())
    }
    fn post_recvs(&self, n: usize) -> Result<()> {
        self.qp.recvs.fetch_add(n, Ordering::SeqCst);
        Ok(())
    }
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize> {
        let mut cq = lock(&self.qp.cq);
        let n = max.min(cq.len());
        out.extend(cq.drain(..n));
        Ok(n)
    }
}

/// One range registered on every rail of a [`FakeNic`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeRegion {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The kind it was registered as (device memory is plain memory here).
    pub kind: RegionKind,
    /// Its key on each rail (lkey = rkey on this fabric).
    pub keys: Vec<u32>,
}

/// A software NIC with one or more rails ("devices") on the fake fabric.
pub struct FakeNic {
    name: String,
    devices: Vec<u64>,
    mtu: Mtu,
    link_layer: LinkLayer,
    regions: Mutex<Vec<FakeRegion>>,
    qps: Mutex<Vec<u32>>,
    instance_id: u64,
    gpu_direct: AtomicBool,
    refuse_device: AtomicBool,
}

impl FakeNic {
    /// A NIC named `name` with `rails` rails (at least 1) and active MTU `mtu`,
    /// on an InfiniBand link (addressed by LID).
    pub fn new(name: &str, rails: usize, mtu: Mtu) -> Arc<FakeNic> {
        Self::with_link_layer(name, rails, mtu, LinkLayer::InfiniBand)
    }

    /// [`new`](Self::new) on the given link layer (Ethernet: RoCE, addressed by a
    /// non-zero GID).
    pub fn with_link_layer(
        name: &str,
        rails: usize,
        mtu: Mtu,
        link_layer: LinkLayer,
    ) -> Arc<FakeNic> {
        let mut f = lock(fabric());
        let devices = (0..rails.max(1))
            .map(|_| {
                f.next_device += 1;
                f.next_device
            })
            .collect();
        Arc::new(FakeNic {
            name: name.to_string(),
            devices,
            mtu,
            link_layer,
            regions: Mutex::new(Vec::new()),
            qps: Mutex::new(Vec::new()),
            instance_id: random_u64(),
            gpu_direct: AtomicBool::new(true),
            refuse_device: AtomicBool::new(false),
        })
    }

    /// Whether this NIC accepts device-memory registrations (true by default;
    /// false acts like a NIC without GPUDirect RDMA: `NoGpuDirect`).
    pub fn set_gpu_direct(&self, on: bool) {
        self.gpu_direct.store(on, Ordering::SeqCst);
    }

    /// Whether device-memory registrations are refused (`NoGpuDirect`) while
    /// [`gpu_direct`](NicProvider::gpu_direct) still reports support: a NIC
    /// whose GPU path looks present up front but fails at registration.
    pub fn refuse_device_registrations(&self, on: bool) {
        self.refuse_device.store(on, Ordering::SeqCst);
    }

    /// Every range registered now, in registration order.
    pub fn regions(&self) -> Vec<FakeRegion> {
        lock(&self.regions).clone()
    }

    /// The QP numbers of every endpoint created on this NIC, oldest first
    /// (rail 0 of the first endpoint, rail 1 of it, ...).
    pub fn qpns(&self) -> Vec<u32> {
        lock(&self.qps).clone()
    }
}

impl NicProvider for FakeNic {
    fn describe(&self) -> String {
        format!("fake {} ({} rail(s))", self.name, self.devices.len())
    }

    unsafe fn register(&self, addr: u64, len: u64, kind: RegionKind) -> Result<Vec<LocalRegion>> {
        let locals = |r: &FakeRegion| {
            r.keys
                .iter()
                .map(|k| LocalRegion {
                    addr: r.addr,
                    len: r.len,
                    lkey: *k,
                })
                .collect()
        };
        let mut regs = lock(&self.regions);
        if let Some(r) = regs.iter().find(|r| r.addr == addr && r.len == len) {
            return Ok(locals(r));
        }
        if let RegionKind::Device { ordinal } = kind {
            if !self.gpu_direct.load(Ordering::SeqCst) || self.refuse_device.load(Ordering::SeqCst)
            {
                return Err(Error::new(
                    Status::NoGpuDirect,
                    format!(
                        "GPUDirect RDMA unavailable on {}: this NIC cannot register device {ordinal} memory ({addr:#x}+{len})",
                        self.describe()
                    ),
                ));
            }
        }
        // Like verbs: every byte is registered once per NIC.
        let have: Vec<(u64, u64)> = regs.iter().map(|r| (r.addr, r.len)).collect();
        super::slice::check_new_regions(&have, &[(addr, len)])?;
        let mut f = lock(fabric());
        let mut keys = Vec::with_capacity(self.devices.len());
        for d in &self.devices {
            f.next_key = f.next_key.wrapping_add(1).max(0x100);
            let k = f.next_key;
            f.mrs.insert(
                k,
                Mr {
                    device: *d,
                    addr,
                    len,
                },
            );
            keys.push(k);
        }
        let r = FakeRegion {
            addr,
            len,
            kind,
            keys,
        };
        let out = locals(&r);
        regs.push(r);
        Ok(out)
    }

    fn deregister(&self, addr: u64, len: u64) -> Result<bool> {
        let mut regs = lock(&self.regions);
        let Some(i) = regs.iter().position(|r| r.addr == addr && r.len == len) else {
            return Ok(false);
        };
        let r = regs.remove(i);
        let mut f = lock(fabric());
        for k in r.keys {
            f.mrs.remove(&k);
        }
        Ok(true)
    }

    fn gpu_direct(&self) -> Result<()> {
        if self.gpu_direct.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(Error::new(
                Status::NoGpuDirect,
                format!(
                    "GPUDirect RDMA unavailable on {}: configured without GPU support",
                    self.describe()
                ),
            ))
        }
    }

    fn endpoint(&self) -> Result<Box<dyn NicEndpoint>> {
        let regions = lock(&self.regions).clone();
        let mut f = lock(fabric());
        let mut rails = Vec::new();
        let mut infos = Vec::new();
        let mut locals = Vec::new();
        for (i, d) in self.devices.iter().enumerate() {
            f.next_qpn = if f.next_qpn >= 0x00ff_fff0 {
                0x40
            } else {
                f.next_qpn + 1
            };
            let qpn = f.next_qpn;
            let qp = Arc::new(Qp {
                qpn,
                device: *d,
                remote: AtomicU32::new(0),
                error: AtomicBool::new(false),
                fail_after: AtomicU64::new(u64::MAX),
                refuse_posts: AtomicU64::new(0),
                cq: Mutex::new(VecDeque::new()),
                recvs: AtomicUsize::new(0),
            });
            f.qps.insert(qpn, qp.clone());
            lock(&self.qps).push(qpn);
            infos.push(RailInfo {
                device: format!("{}_{i}", self.name),
                port: 1,
                link_layer: self.link_layer,
                qpn,
                lid: (*d & 0x3fff) as u16 + 1,
                gid: match self.link_layer {
                    LinkLayer::InfiniBand => Gid::default(),
                    LinkLayer::Ethernet => {
                        let mut g = [0u8; 16];
                        g[10] = 0xff;
                        g[11] = 0xff;
                        g[12..].copy_from_slice(&(*d as u32).to_be_bytes());
                        Gid(g)
                    }
                },
                gid_index: 0,
                psn: random_psn(),
                mtu: self.mtu,
                regions: regions
                    .iter()
                    .map(|r| super::handshake::RemoteRegion {
                        addr: r.addr,
                        len: r.len,
                        rkey: r.keys[i],
                    })
                    .collect(),
            });
            locals.push(
                regions
                    .iter()
                    .map(|r| LocalRegion {
                        addr: r.addr,
                        len: r.len,
                        lkey: r.keys[i],
                    })
                    .collect::<Vec<_>>(),
            );
            rails.push(FakeRail { qp });
        }
        Ok(Box::new(FakeEndpoint {
            rails,
            locals,
            local: Handshake {
                instance_id: self.instance_id,
                rails: infos,
            },
        }))
    }
}

struct FakeEndpoint {
    rails: Vec<FakeRail>,
    locals: Vec<Vec<LocalRegion>>,
    local: Handshake,
}

impl NicEndpoint for FakeEndpoint {
    fn local(&self) -> &Handshake {
        &self.local
    }

    fn connect(
        self: Box<Self>,
        remote: &Handshake,
    ) -> Result<(Box<dyn DataPath>, Vec<Negotiated>)> {
        let negs = super::handshake::negotiate_all(&self.local, remote)?;
        let this = *self;
        let mut keys = Vec::new();
        let mut rails = Vec::new();
        for (i, r) in this.rails.into_iter().enumerate() {
            if let Some(n) = negs.get(i) {
                r.qp.remote.store(n.remote_qpn, Ordering::SeqCst);
                keys.push(RailKeys::new(
                    this.locals[i].clone(),
                    remote.rails[i].regions.clone(),
                ));
            }
            // Messages of at most one path MTU's worth of 1 MiB keep batches multi-WR.
            rails.push(SessionRail::new(r, 100, 1 << 20, 256, 64));
        }
        let mut s = Session::new(
            rails,
            SessionParams {
                signal_every: 16,
                min_slice: 64 << 10,
                record: RecordMode::None,
                post_timeout: Duration::from_secs(10),
            },
        );
        s.start(keys)?;
        Ok((Box::new(s), negs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rdma::slice::Span;
    use crate::transport::rdma::wr::Direction;
    use crate::transport::rdma::BatchState;

    #[test]
    fn the_fabric_enforces_rkeys_and_bounds_like_a_nic() {
        let a = FakeNic::new("ka", 1, Mtu::Mtu4096);
        let b = FakeNic::new("kb", 1, Mtu::Mtu4096);
        let src = vec![7u8; 8192];
        let dst = vec![0u8; 8192];
        let other = vec![0u8; 8192];
        // SAFETY: the buffers outlive every work request below.
        let (ls, ld, lo) = unsafe {
            (
                a.register(src.as_ptr() as u64, 8192, RegionKind::Host)
                    .unwrap()[0],
                b.register(dst.as_ptr() as u64, 8192, RegionKind::Host)
                    .unwrap()[0],
                a.register(other.as_ptr() as u64, 8192, RegionKind::Host)
                    .unwrap()[0],
            )
        };
        let _ea = a.endpoint().unwrap();
        let _eb = b.endpoint().unwrap();
        let qp = lock(fabric()).qps[&a.qpns()[0]].clone();
        qp.remote.store(b.qpns()[0], Ordering::SeqCst);
        let wr = |rkey: u32, remote_addr: u64, len: u32| WorkRequest {
            wr_id: 1,
            opcode: Opcode::Write,
            local_addr: ls.addr,
            lkey: ls.lkey,
            len,
            remote_addr,
            rkey,
            signaled: true,
            imm: None,
            retires: 1,
        };
        let status = |w: WorkRequest| {
            qp.error.store(false, Ordering::SeqCst);
            qp.execute(&w);
            lock(&qp.cq).pop_back().map(|c| c.status)
        };
        // An rkey of the sender's own NIC, a made-up rkey, and a range past the
        // region's end are all refused with REM_ACCESS_ERR, writing nothing.
        assert_eq!(status(wr(lo.lkey, ld.addr, 100)), Some(REM_ACCESS_ERR));
        assert_eq!(status(wr(0xdead, ld.addr, 100)), Some(REM_ACCESS_ERR));
        assert_eq!(
            status(wr(ld.lkey, ld.addr + 8100, 100)),
            Some(REM_ACCESS_ERR)
        );
        assert!(dst.iter().all(|x| *x == 0));
        // The right key inside the region lands.
        assert_eq!(status(wr(ld.lkey, ld.addr + 8000, 100)), Some(0));
        assert!(dst[8000..8100].iter().all(|x| *x == 7));
        assert!(dst[..8000].iter().all(|x| *x == 0));
        // A local buffer outside the lkey's region is a local protection error.
        let mut w = wr(ld.lkey, ld.addr, 100);
        w.local_addr = ls.addr + 8150;
        assert_eq!(status(w), Some(LOC_PROT_ERR));
        // A QP in the error state flushes.
        qp.execute(&wr(ld.lkey, ld.addr, 1));
        qp.error.store(true, Ordering::SeqCst);
        qp.execute(&wr(ld.lkey, ld.addr, 1));
        assert_eq!(
            lock(&qp.cq).pop_back().map(|c| c.status),
            Some(WR_FLUSH_ERR)
        );
    }

    #[test]
    fn writes_land_after_key_checks_and_a_killed_qp_fails_with_the_reason() {
        let a = FakeNic::new("fa", 2, Mtu::Mtu4096);
        let b = FakeNic::new("fb", 2, Mtu::Mtu1024);
        let src: Vec<u8> = (0..300_000u32).map(|i| (i * 13 + 1) as u8).collect();
        let dst = vec![0u8; 300_000];
        // SAFETY: both buffers outlive the endpoints below.
        unsafe {
            a.register(src.as_ptr() as u64, src.len() as u64, RegionKind::Host)
                .unwrap();
            b.register(dst.as_ptr() as u64, dst.len() as u64, RegionKind::Host)
                .unwrap();
        }
        let ea = a.endpoint().unwrap();
        let eb = b.endpoint().unwrap();
        let (ha, hb) = (ea.local().clone(), eb.local().clone());
        let (pa, negs) = ea.connect(&hb).unwrap();
        assert_eq!(negs.len(), 2);
        assert!(negs.iter().all(|n| n.mtu == Mtu::Mtu1024), "min MTU");
        let (_pb, _) = eb.connect(&ha).unwrap();
        let span = Span {
            local_addr: src.as_ptr() as u64 + 10,
            remote_addr: dst.as_ptr() as u64 + 20,
            len: 250_000,
        };
        pa.post_batch(1, Direction::Write, &[span]).unwrap();
        assert_eq!(
            pa.wait(1, Duration::from_secs(5)).unwrap(),
            BatchState::Done { bytes: 250_000 }
        );
        assert_eq!(&dst[20..250_020], &src[10..250_010]);
        // Outside the registered destination: refused before posting.
        let bad = Span {
            remote_addr: dst.as_ptr() as u64 + 299_999,
            len: 2,
            ..span
        };
        assert!(pa.post_batch(2, Direction::Write, &[bad]).is_err());
        // A killed peer QP: the next batch fails with retries exceeded.
        for q in b.qpns() {
            kill_qp(q);
        }
        let r = pa.post_batch(3, Direction::Write, &[span]);
        let st = match r {
            Ok(()) => pa.wait(3, Duration::from_secs(5)).unwrap(),
            Err(e) => BatchState::Failed(e),
        };
        match st {
            BatchState::Failed(e) => assert!(e.detail().contains("RETRY_EXC"), "{e}"),
            s => panic!("expected failure, got {s:?}"),
        }
    }

    #[test]
    fn device_registrations_follow_the_gpu_direct_knobs() {
        let n = FakeNic::new("gd", 1, Mtu::Mtu4096);
        let buf = vec![0u8; 256];
        let (addr, dev) = (buf.as_ptr() as u64, RegionKind::Device { ordinal: 0 });
        // GPU path claimed up front but refused at registration
        n.refuse_device_registrations(true);
        assert!(n.gpu_direct().is_ok());
        // SAFETY: `buf` outlives the registration attempts (deregistered below).
        let e = unsafe { n.register(addr, 128, dev) }.unwrap_err();
        assert_eq!(e.status(), Status::NoGpuDirect, "{e}");
        // host memory is still accepted
        // SAFETY: as above.
        unsafe { n.register(addr + 128, 128, RegionKind::Host) }.unwrap();
        n.refuse_device_registrations(false);
        // SAFETY: as above.
        unsafe { n.register(addr, 128, dev) }.unwrap();
        let kinds: Vec<RegionKind> = n.regions().iter().map(|r| r.kind).collect();
        assert_eq!(kinds, vec![RegionKind::Host, dev]);
        assert!(n.deregister(addr, 128).unwrap());
        n.set_gpu_direct(false);
        assert_eq!(n.gpu_direct().unwrap_err().status(), Status::NoGpuDirect);
        // SAFETY: as above.
        let e = unsafe { n.register(addr, 128, dev) }.unwrap_err();
        assert_eq!(e.status(), Status::NoGpuDirect, "{e}");
        assert!(n.deregister(addr + 128, 128).unwrap());
    }
}
