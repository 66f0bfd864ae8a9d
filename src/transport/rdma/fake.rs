//! A software NIC for tests: an in-process fabric where every [`FakeNic`]
//! rail is a "device" with its own memory keys, and queue pairs and memory
//! regions live in one process-global table.
//!
//! Like a NIC, it works asynchronously: `post_send` only queues the work
//! requests (refusing what does not fit in the send queue with `ENOMEM`, as
//! `ibv_post_send` does), and the fabric's own thread executes them in
//! order a little later ([`WIRE_DELAY`]), after the same checks a NIC
//! makes: the local range must lie inside a region registered on the
//! posting rail under its lkey, the peer QP must exist and be alive, and
//! the remote range must lie inside a region registered on the peer's rail
//! under the rkey. Then WRITE copies real bytes into the peer's memory
//! (READ the other way), WRITE_WITH_IMM consumes one of the peer's posted
//! receives and completes it with the immediate, and a signalled WR
//! completes (opcodes and statuses are libibverbs' values). A failed check
//! completes the WR with the verbs status a NIC reports (LOC_PROT,
//! REM_ACCESS, RETRY_EXC, RNR_RETRY_EXC) and moves the QP to the error
//! state: every WR after it, signalled or not, and every posted receive is
//! flushed with `IBV_WC_WR_FLUSH_ERR`. Send-queue slots are freed only when
//! a completion covering them is polled, the receive queue holds at most
//! its depth, and a completion queue that overflows is in error (`poll`
//! fails; its QP goes to the error state), as on hardware. Depths, the
//! signalling interval, the slicing size and the posting timeout come from
//! the NIC's [`RdmaConfig`] (the verbs path's settings); completions in
//! error carry an undefined opcode, as `ibv_poll_cq(3)` allows.
//!
//! Registration is stricter than verbs: `ibv_reg_mr` accepts a range
//! overlapping another memory region (each pins the pages again and takes its
//! own MTT entries), while this fake refuses it (`RegionOverlap`), as the
//! verbs provider's own check does, so a double registration fails a test;
//! overlapping pool views reach a NIC as one region per allocation
//! ([`super::view_hulls`]). Deregistering removes its keys from the
//! fabric at once, and device-kind regions (plain memory here) are accepted
//! and recorded unless the NIC has no GPU path ([`FakeNic::set_gpu_direct`]:
//! libcuda absent) or its GPU registrations fail
//! ([`FakeNic::refuse_device_registrations`]: libcuda loads, but neither
//! dma-buf nor nvidia-peermem works). [`gpu_direct`](NicProvider::gpu_direct)
//! answers by a real probe registration, as the verbs provider does.
//!
//! Each rail's GID (and IPv4 prefix length) can be set
//! ([`FakeNic::set_rail_addresses`]) to put rails on different subnets: the
//! two ends pair their rails by subnet as the verbs NIC does, and a WR
//! between QPs on two different known subnets fails with RETRY_EXC (no
//! route), as on a fabric where those networks do not meet.
//!
//! Tests can kill a QP ([`kill_qp`]), make it fail after some WRs
//! ([`fail_qp_after`]) or make its next posts accepted only part-way
//! ([`refuse_posts`]). The fabric only connects QPs of one process; it is
//! selected explicitly (`TestKnobs::nic`: `AgentOptions::testing.nic`,
//! `EngineConfig::testing.nic`), never in production, and built only for unit
//! tests and with the `testing` feature.
//!
//! What this fake does not model:
//! - the negotiated attributes: GID, LID, MTU, PSN and the QP state
//!   transitions are carried but never checked against each other (a wrong
//!   GID or PSN "works" here and fails with RETRY_EXC on a fabric);
//! - RNR retries: a WRITE_WITH_IMM with no posted receive fails at once with
//!   RNR_RETRY_EXC instead of retrying (`rnr_retry` 7 retries forever);
//! - timing: no ACK timeouts or retry counts (a fault fails the WR at once),
//!   no congestion, bandwidth, PFC or traffic classes, no message size or
//!   MTU segmentation, one fixed delay per post;
//! - device memory: "device" regions are host memory, so dma-buf export,
//!   `ibv_reg_dmabuf_mr`, nvidia-peermem, relaxed ordering and PCIe
//!   topology never run here;
//! - asynchronous events (port down, `IBV_EVENT_QP_FATAL`), completion
//!   channels, and SQ slots freed by hardware before the CQE is polled;
//! - QPs of other processes or hosts.

use super::config::RdmaConfig;
use super::handshake::{
    random_psn, random_u64, Gid, Handshake, LinkLayer, Mtu, Negotiated, RailInfo,
};
use super::nic::{DataPath, NicEndpoint, NicProvider};
use super::pairing::{negotiate_paired, Subnet};
use super::session::{lock, RailIo, Session, SessionParams, SessionRail};
use super::slice::{LocalRegion, RailKeys};
use super::tracker::{
    WorkCompletion, RECV_WR_ID, WC_LOC_PROT_ERR, WC_OP_RDMA_READ, WC_OP_RDMA_WRITE,
    WC_OP_RECV_RDMA_WITH_IMM, WC_REM_ACCESS_ERR, WC_RETRY_EXC_ERR, WC_RNR_RETRY_EXC_ERR,
    WC_WR_FLUSH_ERR,
};
use super::wr::{Opcode, WorkRequest};
use super::RecordMode;
use crate::error::{Error, Result, Status};
use crate::memory::RegionKind;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long after `post_send` the fabric thread executes the work requests.
pub const WIRE_DELAY: Duration = Duration::from_micros(20);

/// The opcode of a completion in error (undefined on hardware).
const WC_OPCODE_UNDEFINED: u32 = 0xff;

/// Largest message per WR on a fake port (`max_msg_sz`; small, so batches
/// stay multi-WR).
const FAKE_MAX_MSG: u64 = 1 << 20;

/// Slicing weight of a fake port (all rails are equal).
const FAKE_WEIGHT: u64 = 100;

#[derive(Clone, Copy)]
struct Mr {
    device: u64,
    addr: u64,
    len: u64,
}

/// A completion queue of fixed depth.
struct Cq {
    entries: VecDeque<WorkCompletion>,
    depth: usize,
    /// It overflowed: unusable, like a CQ after `IBV_EVENT_CQ_ERR`.
    overrun: bool,
}

/// The send queue: WRs posted and not yet retired by a polled completion,
/// and those the fabric thread has not executed yet.
struct SendQueue {
    /// `wr_id`s holding a slot, oldest first.
    slots: VecDeque<u64>,
    /// Work not executed yet, with when it may run.
    queued: VecDeque<(Instant, WorkRequest)>,
}

struct Qp {
    qpn: u32,
    device: u64,
    /// The subnet of its port's GID: a peer on another known subnet is unreachable.
    subnet: Subnet,
    remote: AtomicU32,
    error: AtomicBool,
    /// Destroyed: nothing it queued is executed any more.
    destroyed: AtomicBool,
    /// Its posted receives were flushed after it entered the error state.
    recvs_flushed: AtomicBool,
    /// Fail the WR after this many more have executed (`u64::MAX`: never).
    fail_after: AtomicU64,
    /// Refuse part of this many next `post_send` calls (as `ibv_post_send`
    /// does when out of resources; the QP stays usable).
    refuse_posts: AtomicU64,
    sq_depth: usize,
    recv_depth: usize,
    sq: Mutex<SendQueue>,
    cq: Mutex<Cq>,
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

/// QPs with queued work, and the fabric thread that executes it.
struct Wire {
    busy: Mutex<Vec<Arc<Qp>>>,
    cv: Condvar,
}

fn wire() -> &'static Wire {
    static W: OnceLock<&'static Wire> = OnceLock::new();
    W.get_or_init(|| {
        let w: &'static Wire = Box::leak(Box::new(Wire {
            busy: Mutex::new(Vec::new()),
            cv: Condvar::new(),
        }));
        crate::threads::spawn("pdxfer-fake-nic".into(), move || wire_loop(w))
            .expect("the fake NIC's fabric thread starts");
        w
    })
}

/// The fabric thread: executes every QP's queued work requests in order once
/// their delay passed.
fn wire_loop(w: &'static Wire) {
    loop {
        let qps: Vec<Arc<Qp>> = {
            let mut busy = lock(&w.busy);
            while busy.is_empty() {
                busy = w.cv.wait(busy).unwrap_or_else(|p| p.into_inner());
            }
            std::mem::take(&mut *busy)
        };
        let mut next: Option<Instant> = None;
        let mut again = Vec::new();
        for qp in qps {
            loop {
                let now = Instant::now();
                let ready = {
                    let mut sq = lock(&qp.sq);
                    match sq.queued.front() {
                        Some((at, _)) if *at > now => {
                            next = Some(next.map_or(*at, |n| n.min(*at)));
                            None
                        }
                        Some(_) => sq.queued.pop_front().map(|(_, w)| w),
                        None => break,
                    }
                };
                match ready {
                    Some(wr) => qp.execute(&wr),
                    None => {
                        again.push(qp.clone());
                        break;
                    }
                }
            }
        }
        if !again.is_empty() {
            let mut busy = lock(&w.busy);
            for q in again {
                if !busy.iter().any(|b| Arc::ptr_eq(b, &q)) {
                    busy.push(q);
                }
            }
            if let Some(at) = next {
                let wait = at.saturating_duration_since(Instant::now());
                if !wait.is_zero() {
                    drop(w.cv.wait_timeout(busy, wait));
                }
            }
        }
    }
}

/// Kills the QP `qpn` (as a NIC or cable failure would): its queued and
/// future work requests are flushed, and the peer's fail (retries exceeded).
pub fn kill_qp(qpn: u32) {
    if let Some(q) = lock(fabric()).qps.get(&qpn).cloned() {
        q.enter_error();
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
    fn new(qpn: u32, device: u64, subnet: Subnet, depths: (usize, usize, usize)) -> Qp {
        let (sq_depth, recv_depth, cq_depth) = depths;
        Qp {
            qpn,
            device,
            subnet,
            remote: AtomicU32::new(0),
            error: AtomicBool::new(false),
            destroyed: AtomicBool::new(false),
            recvs_flushed: AtomicBool::new(false),
            fail_after: AtomicU64::new(u64::MAX),
            refuse_posts: AtomicU64::new(0),
            sq_depth: sq_depth.max(1),
            recv_depth,
            sq: Mutex::new(SendQueue {
                slots: VecDeque::new(),
                queued: VecDeque::new(),
            }),
            cq: Mutex::new(Cq {
                entries: VecDeque::new(),
                depth: cq_depth.max(1),
                overrun: false,
            }),
            recvs: AtomicUsize::new(0),
        }
    }

    /// Adds a completion; a full CQ overflows (unusable, the QP in error).
    fn push(&self, wc: WorkCompletion) {
        let overrun = {
            let mut cq = lock(&self.cq);
            if cq.entries.len() >= cq.depth {
                cq.overrun = true;
                true
            } else {
                cq.entries.push_back(wc);
                false
            }
        };
        if overrun {
            self.error.store(true, Ordering::SeqCst);
        }
    }

    fn complete(&self, wr_id: u64, status: u32, opcode: u32) {
        let opcode = if status == 0 {
            opcode
        } else {
            WC_OPCODE_UNDEFINED
        };
        self.push(WorkCompletion {
            wr_id,
            status,
            vendor_err: 0,
            opcode,
            imm: None,
        });
    }

    /// Moves the QP to the error state: its posted receives are flushed now,
    /// its queued and later send WRs when the fabric thread reaches them.
    fn enter_error(&self) {
        self.error.store(true, Ordering::SeqCst);
        if self.recvs_flushed.swap(true, Ordering::SeqCst) {
            return;
        }
        let n = self.recvs.swap(0, Ordering::SeqCst);
        for _ in 0..n {
            self.complete(RECV_WR_ID, WC_WR_FLUSH_ERR, 0);
        }
    }

    /// Fails `w` with `status` and moves the QP to the error state.
    fn fault(&self, w: &WorkRequest, status: u32) {
        self.complete(w.wr_id, status, 0);
        self.enter_error();
    }

    fn execute(&self, w: &WorkRequest) {
        if self.destroyed.load(Ordering::SeqCst) {
            return;
        }
        if self.error.load(Ordering::SeqCst) {
            // Every WR of a QP in error completes flushed, signalled or not.
            return self.complete(w.wr_id, WC_WR_FLUSH_ERR, 0);
        }
        let left = self.fail_after.load(Ordering::SeqCst);
        if left != u64::MAX {
            if left == 0 {
                self.fail_after.store(u64::MAX, Ordering::SeqCst);
                return self.fault(w, WC_RETRY_EXC_ERR);
            }
            self.fail_after.store(left - 1, Ordering::SeqCst);
        }
        let len = u64::from(w.len);
        // Checked and copied under the fabric lock: a region deregistered (and
        // then freed by its owner) cannot slip between the check and the copy.
        let f = lock(fabric());
        let peer = f.qps.get(&self.remote.load(Ordering::SeqCst)).cloned();
        let Some(peer) = peer.filter(|p| !p.error.load(Ordering::SeqCst)) else {
            drop(f);
            // No ACK from a dead or vanished peer.
            return self.fault(w, WC_RETRY_EXC_ERR);
        };
        if self.subnet.is_known() && peer.subnet.is_known() && self.subnet != peer.subnet {
            drop(f);
            // No route between the two networks: no ACK either.
            return self.fault(w, WC_RETRY_EXC_ERR);
        }
        if len > 0 && !covers(&f.mrs, w.lkey, self.device, w.local_addr, len) {
            drop(f);
            return self.fault(w, WC_LOC_PROT_ERR);
        }
        if len > 0 && !covers(&f.mrs, w.rkey, peer.device, w.remote_addr, len) {
            drop(f);
            return self.fault(w, WC_REM_ACCESS_ERR);
        }
        if w.imm.is_some()
            && peer
                .recvs
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_err()
        {
            drop(f);
            return self.fault(w, WC_RNR_RETRY_EXC_ERR);
        }
        let (src, dst) = match w.opcode {
            Opcode::Read => (w.remote_addr, w.local_addr),
            _ => (w.local_addr, w.remote_addr),
        };
        if len > 0 {
            // SAFETY: both ranges lie inside regions registered on this fabric (checked
            // just above, under the lock that deregistration takes); registration
            // requires them to stay valid while registered, and the agent writes only
            // into ranges the receiver granted and pinned.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
        }
        drop(f);
        if let Some(imm) = w.imm {
            peer.push(WorkCompletion {
                wr_id: RECV_WR_ID,
                status: 0,
                vendor_err: 0,
                opcode: WC_OP_RECV_RDMA_WITH_IMM,
                imm: Some(imm),
            });
        }
        if w.signaled {
            let op = if w.opcode == Opcode::Read {
                WC_OP_RDMA_READ
            } else {
                WC_OP_RDMA_WRITE
            };
            self.complete(w.wr_id, 0, op);
        }
    }
}

/// One rail's QP on the fake fabric.
pub struct FakeRail {
    qp: Arc<Qp>,
}

impl FakeRail {
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qp.qpn
    }
}

impl Drop for FakeRail {
    fn drop(&mut self) {
        // A destroyed QP answers nothing: the peer's next WR fails with retries exceeded.
        self.qp.destroyed.store(true, Ordering::SeqCst);
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
        let at = Instant::now() + WIRE_DELAY;
        let (accepted, held) = {
            let mut sq = lock(&self.qp.sq);
            let free = self.qp.sq_depth.saturating_sub(sq.slots.len());
            let mut accepted = wrs.len().min(free);
            if refuse {
                accepted = accepted.min(wrs.len() / 2);
            }
            for w in &wrs[..accepted] {
                sq.slots.push_back(w.wr_id);
                sq.queued.push_back((at, *w));
            }
            (accepted, sq.slots.len())
        };
        if accepted > 0 {
            let w = wire();
            let mut busy = lock(&w.busy);
            if !busy.iter().any(|b| Arc::ptr_eq(b, &self.qp)) {
                busy.push(self.qp.clone());
            }
            w.cv.notify_all();
        }
        if accepted < wrs.len() {
            let why = if refuse {
                "out of resources (fake fabric)".to_string()
            } else {
                format!(
                    "send queue full ({held} of {} slots held)",
                    self.qp.sq_depth
                )
            };
            return Err((
                accepted,
                Error::new(
                    Status::Rdma,
                    format!(
                        "ibv_post_send refused work request {accepted} of {}: ENOMEM, {why}",
                        wrs.len()
                    ),
                ),
            ));
        }
        Ok(())
    }
    fn post_recvs(&self, n: usize) -> Result<()> {
        if self.qp.error.load(Ordering::SeqCst) {
            // A QP in error flushes receives at once.
            for _ in 0..n {
                self.qp.complete(RECV_WR_ID, WC_WR_FLUSH_ERR, 0);
            }
            return Ok(());
        }
        self.qp
            .recvs
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| {
                (r + n <= self.qp.recv_depth).then_some(r + n)
            })
            .map(|_| ())
            .map_err(|r| {
                Error::new(
                    Status::Rdma,
                    format!(
                        "ibv_post_recv: ENOMEM, receive queue full ({r} of {} posted, {n} more asked)",
                        self.qp.recv_depth
                    ),
                )
            })
    }
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize> {
        let mut cq = lock(&self.qp.cq);
        if cq.overrun {
            return Err(Error::new(
                Status::Rdma,
                format!(
                    "completion queue overrun (depth {}): the CQ and its QP are in error",
                    cq.depth
                ),
            ));
        }
        let n = max.min(cq.entries.len());
        let got: Vec<WorkCompletion> = cq.entries.drain(..n).collect();
        drop(cq);
        let mut sq = lock(&self.qp.sq);
        for c in &got {
            // A polled send completion frees its WR's slot and every earlier one.
            if !c.is_recv() && sq.slots.contains(&c.wr_id) {
                while let Some(id) = sq.slots.pop_front() {
                    if id == c.wr_id {
                        break;
                    }
                }
            }
        }
        drop(sq);
        out.extend(got);
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
    refuse_device_late: AtomicBool,
    cfg: RdmaConfig,
    /// Completion-queue depth of later endpoints (default: send plus receive depth).
    cq_depth: Mutex<Option<usize>>,
    /// GID and IPv4 prefix length per rail set by the test (default: see `endpoint`).
    addresses: Mutex<Vec<(Gid, u8)>>,
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
        Self::with_config(name, rails, mtu, link_layer, RdmaConfig::default())
    }

    /// A NIC whose queue depths, signalling interval, slicing size and
    /// posting timeout come from `cfg`, as the verbs NIC's do (its record
    /// mode is ignored: the agent's control channel carries the record).
    pub fn with_config(
        name: &str,
        rails: usize,
        mtu: Mtu,
        link_layer: LinkLayer,
        cfg: RdmaConfig,
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
            refuse_device_late: AtomicBool::new(false),
            cfg,
            cq_depth: Mutex::new(None),
            addresses: Mutex::new(Vec::new()),
        })
    }

    /// Whether this NIC has a GPU path at all (true by default; false acts
    /// like a host where libcuda does not load: `NoGpuDirect` up front).
    pub fn set_gpu_direct(&self, on: bool) {
        self.gpu_direct.store(on, Ordering::SeqCst);
    }

    /// Whether device-memory registrations fail (`NoGpuDirect`) although the
    /// GPU path is present: libcuda loads, but neither dma-buf nor
    /// nvidia-peermem registration works. [`gpu_direct`](NicProvider::gpu_direct)
    /// finds it out by its probe registration, as the verbs provider does.
    pub fn refuse_device_registrations(&self, on: bool) {
        self.refuse_device.store(on, Ordering::SeqCst);
    }

    /// Whether device-memory registrations fail although the GPUDirect
    /// probe passes: a registration that fails for its own reasons (a range
    /// the driver will not export, MR resources), found only on first use.
    pub fn refuse_device_registrations_after_probe(&self, on: bool) {
        self.refuse_device_late.store(on, Ordering::SeqCst);
    }

    /// Sets the completion-queue depth of endpoints created from now on
    /// (default: send-queue plus receive-queue depth, as the verbs NIC).
    pub fn set_cq_depth(&self, depth: usize) {
        *lock(&self.cq_depth) = Some(depth);
    }

    /// Sets the GID and IPv4 prefix length of rails `0..addrs.len()` in
    /// endpoints created from now on (the others keep the default: on
    /// InfiniBand the zero GID, all on one subnet; on RoCE an IPv4-mapped GID
    /// of unknown prefix length). Rails on different subnets cannot reach
    /// each other.
    pub fn set_rail_addresses(&self, addrs: &[(Gid, u8)]) {
        *lock(&self.addresses) = addrs.to_vec();
    }

    /// The settings its rails use.
    pub fn config(&self) -> &RdmaConfig {
        &self.cfg
    }

    /// Why a device-memory registration of `ordinal` fails here, if it does
    /// (`probe`: the GPUDirect probe's registration).
    fn device_path(&self, ordinal: u32, what: &str, probe: bool) -> Result<()> {
        if !probe && self.refuse_device_late.load(Ordering::SeqCst) {
            return Err(Error::new(
                Status::NoGpuDirect,
                format!(
                    "GPUDirect RDMA: {} refused the registration of device {ordinal} memory ({what})",
                    self.describe()
                ),
            ));
        }
        if !self.gpu_direct.load(Ordering::SeqCst) {
            return Err(Error::new(
                Status::NoGpuDirect,
                format!(
                    "GPUDirect RDMA unavailable on {}: libcuda could not be loaded (configured without GPU support)",
                    self.describe()
                ),
            ));
        }
        if self.refuse_device.load(Ordering::SeqCst) {
            return Err(Error::new(
                Status::NoGpuDirect,
                format!(
                    "GPUDirect RDMA unavailable on {}: registering device {ordinal} memory ({what}) failed: no dma-buf support and nvidia-peermem is not loaded",
                    self.describe()
                ),
            ));
        }
        Ok(())
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
            self.device_path(ordinal, &format!("{addr:#x}+{len}"), false)?;
        }
        // As the verbs provider (not verbs itself): every byte is registered once per NIC.
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
        // A probe registration of device 0 memory, as the verbs provider makes.
        self.device_path(0, "probe registration", true)
    }

    fn endpoint(&self) -> Result<Box<dyn NicEndpoint>> {
        let regions = lock(&self.regions).clone();
        let addresses = lock(&self.addresses).clone();
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
            let (sq, rq) = (self.cfg.sq_depth as usize, self.cfg.recv_depth as usize);
            let cq = lock(&self.cq_depth).unwrap_or(sq + rq);
            let (gid, prefix_len) = addresses.get(i).copied().unwrap_or_else(|| {
                let gid = match self.link_layer {
                    LinkLayer::InfiniBand => Gid::default(),
                    LinkLayer::Ethernet => {
                        let mut g = [0u8; 16];
                        g[10] = 0xff;
                        g[11] = 0xff;
                        g[12..].copy_from_slice(&(*d as u32).to_be_bytes());
                        Gid(g)
                    }
                };
                (gid, 0)
            });
            let info = RailInfo {
                device: format!("{}_{i}", self.name),
                port: 1,
                link_layer: self.link_layer,
                qpn,
                lid: (*d & 0x3fff) as u16 + 1,
                gid,
                gid_index: 0,
                prefix_len,
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
            };
            let qp = Arc::new(Qp::new(qpn, *d, Subnet::of(&info), (sq, rq, cq)));
            f.qps.insert(qpn, qp.clone());
            lock(&self.qps).push(qpn);
            infos.push(info);
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
            cfg: self.cfg.clone(),
            locals,
            local: Handshake {
                instance_id: self.instance_id,
                rails: infos,
                pair_by_index: self.cfg.pairing == super::config::PairingMode::Index,
            },
        }))
    }
}

struct FakeEndpoint {
    rails: Vec<FakeRail>,
    cfg: RdmaConfig,
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
        let paired = negotiate_paired(&self.local, remote)?;
        let this = *self;
        let mut keys = Vec::new();
        for p in &paired {
            this.rails[p.pair.local]
                .qp
                .remote
                .store(p.negotiated.remote_qpn, Ordering::SeqCst);
            keys.push(RailKeys::new(
                this.locals[p.pair.local].clone(),
                remote.rails[p.pair.remote].regions.clone(),
            ));
        }
        let rails: Vec<SessionRail<FakeRail>> = this
            .rails
            .into_iter()
            .map(|r| {
                let (sq, rq) = (r.qp.sq_depth as u32, r.qp.recv_depth as u32);
                SessionRail::new(r, FAKE_WEIGHT, FAKE_MAX_MSG, sq, rq)
            })
            .collect();
        let mut s = Session::new(
            rails,
            SessionParams {
                signal_every: this.cfg.signal_every,
                min_slice: this.cfg.min_slice,
                // The agent's control channel carries the record (as VerbsProvider).
                record: RecordMode::None,
                post_timeout: this.cfg.post_timeout,
            },
        );
        s.keep_rails(&paired.iter().map(|p| p.pair.local).collect::<Vec<_>>())?;
        s.start(keys)?;
        Ok((
            Box::new(s),
            paired.into_iter().map(|p| p.negotiated).collect(),
        ))
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
            lock(&qp.cq).entries.pop_back().map(|c| c.status)
        };
        // An rkey of the sender's own NIC, a made-up rkey, and a range past the
        // region's end are all refused with REM_ACCESS_ERR, writing nothing.
        assert_eq!(status(wr(lo.lkey, ld.addr, 100)), Some(WC_REM_ACCESS_ERR));
        assert_eq!(status(wr(0xdead, ld.addr, 100)), Some(WC_REM_ACCESS_ERR));
        assert_eq!(
            status(wr(ld.lkey, ld.addr + 8100, 100)),
            Some(WC_REM_ACCESS_ERR)
        );
        assert!(dst.iter().all(|x| *x == 0));
        // The right key inside the region lands.
        assert_eq!(status(wr(ld.lkey, ld.addr + 8000, 100)), Some(0));
        assert!(dst[8000..8100].iter().all(|x| *x == 7));
        assert!(dst[..8000].iter().all(|x| *x == 0));
        // A local buffer outside the lkey's region is a local protection error.
        let mut w = wr(ld.lkey, ld.addr, 100);
        w.local_addr = ls.addr + 8150;
        assert_eq!(status(w), Some(WC_LOC_PROT_ERR));
        // A QP in the error state flushes.
        qp.execute(&wr(ld.lkey, ld.addr, 1));
        qp.error.store(true, Ordering::SeqCst);
        qp.execute(&wr(ld.lkey, ld.addr, 1));
        assert_eq!(
            lock(&qp.cq).entries.pop_back().map(|c| c.status),
            Some(WC_WR_FLUSH_ERR)
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

    fn v4(a: [u8; 4]) -> Gid {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&a);
        Gid(g)
    }

    #[test]
    fn rails_listed_crossed_pair_by_subnet_and_bytes_land() {
        let ll = LinkLayer::Ethernet;
        // Prefill rails A (10.0.1.0/24), B (10.0.2.0/24); decode rails listed
        // crossed: B' (10.0.2.0/24), A' (10.0.1.0/24).
        let a = FakeNic::with_link_layer("xa", 2, Mtu::Mtu4096, ll);
        let b = FakeNic::with_link_layer("xb", 2, Mtu::Mtu4096, ll);
        a.set_rail_addresses(&[(v4([10, 0, 1, 1]), 24), (v4([10, 0, 2, 1]), 24)]);
        b.set_rail_addresses(&[(v4([10, 0, 2, 2]), 24), (v4([10, 0, 1, 2]), 24)]);
        let src: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + 3) as u8).collect();
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
        let (pb, negs_b) = eb.connect(&ha).unwrap();
        assert_eq!((pa.rails(), pb.rails()), (2, 2));
        // A -> A' (decode rail 1), B -> B' (decode rail 0), and the reverse there.
        assert_eq!(negs[0].dgid, v4([10, 0, 1, 2]));
        assert_eq!(negs[1].dgid, v4([10, 0, 2, 2]));
        assert_eq!(negs_b[0].dgid, v4([10, 0, 2, 1]));
        assert_eq!(negs_b[1].dgid, v4([10, 0, 1, 1]));
        let (qa, qb) = (a.qpns(), b.qpns());
        {
            let f = lock(fabric());
            let remote = |q: u32| f.qps[&q].remote.load(Ordering::SeqCst);
            assert_eq!((remote(qa[0]), remote(qa[1])), (qb[1], qb[0]));
            assert_eq!((remote(qb[0]), remote(qb[1])), (qa[1], qa[0]));
        }
        // Sliced over both pairs: every byte lands (a pair across subnets
        // would fail with RETRY_EXC).
        let span = Span {
            local_addr: src.as_ptr() as u64 + 5,
            remote_addr: dst.as_ptr() as u64 + 9,
            len: 290_000,
        };
        pa.post_batch(1, Direction::Write, &[span]).unwrap();
        assert_eq!(
            pa.wait(1, Duration::from_secs(5)).unwrap(),
            BatchState::Done { bytes: 290_000 }
        );
        assert_eq!(&dst[9..290_009], &src[5..290_005]);
        assert!(dst[..9].iter().all(|x| *x == 0));

        // What pairing by index would have done: rail A to B' has no route
        // (fresh endpoints, no session polling their queues).
        let (_ea2, _eb2) = (a.endpoint().unwrap(), b.endpoint().unwrap());
        let (qa, qb) = (a.qpns(), b.qpns());
        let qp = lock(fabric()).qps[&qa[2]].clone();
        let (l, r) = (a.regions()[0].keys[0], b.regions()[0].keys[1]);
        let status = |to: u32, rkey: u32| {
            qp.remote.store(to, Ordering::SeqCst);
            qp.execute(&WorkRequest {
                wr_id: 9,
                opcode: Opcode::Write,
                local_addr: src.as_ptr() as u64,
                lkey: l,
                len: 16,
                remote_addr: dst.as_ptr() as u64,
                rkey,
                signaled: true,
                imm: None,
                retires: 1,
            });
            lock(&qp.cq).entries.pop_back().map(|c| c.status)
        };
        // A to A' (decode rail 1, its rkey there) lands; A to B' does not.
        assert_eq!(status(qb[3], r), Some(0));
        assert_eq!(
            status(qb[2], b.regions()[0].keys[0]),
            Some(WC_RETRY_EXC_ERR)
        );
    }

    #[test]
    fn a_rail_with_no_partner_is_left_out_and_regions_added_later_use_the_paired_rail() {
        let ll = LinkLayer::Ethernet;
        // Prefill rails A (10.0.1.0/24), B (10.0.2.0/24); the decode has only B'.
        let a = FakeNic::with_link_layer("pa", 2, Mtu::Mtu4096, ll);
        let b = FakeNic::with_link_layer("pb", 1, Mtu::Mtu4096, ll);
        a.set_rail_addresses(&[(v4([10, 0, 1, 1]), 24), (v4([10, 0, 2, 1]), 24)]);
        b.set_rail_addresses(&[(v4([10, 0, 2, 2]), 24)]);
        let dst = vec![0u8; 200_000];
        // SAFETY: dst outlives the endpoints below.
        unsafe {
            b.register(dst.as_ptr() as u64, dst.len() as u64, RegionKind::Host)
                .unwrap();
        }
        let ea = a.endpoint().unwrap();
        let eb = b.endpoint().unwrap();
        let (ha, hb) = (ea.local().clone(), eb.local().clone());
        let (pa, negs) = ea.connect(&hb).unwrap();
        let (_pb, _) = eb.connect(&ha).unwrap();
        assert_eq!((pa.rails(), negs.len()), (1, 1));
        assert_eq!(negs[0].dgid, v4([10, 0, 2, 2]));
        // Rail A's QP is gone; B's talks to B'.
        let (qa, qb) = (a.qpns(), b.qpns());
        assert!(!qp_alive(qa[0]));
        assert_eq!(
            lock(fabric()).qps[&qa[1]].remote.load(Ordering::SeqCst),
            qb[0]
        );
        // A source registered after connecting: its lkey on NIC rail 1 is used
        // (rail 0's key would be a local protection error on B's QP).
        let src: Vec<u8> = (0..200_000u32).map(|i| (i * 11 + 1) as u8).collect();
        // SAFETY: src outlives the data path below.
        let keys = unsafe {
            a.register(src.as_ptr() as u64, src.len() as u64, RegionKind::Host)
                .unwrap()
        };
        pa.add_local(&keys);
        let span = Span {
            local_addr: src.as_ptr() as u64,
            remote_addr: dst.as_ptr() as u64,
            len: 200_000,
        };
        pa.post_batch(3, Direction::Write, &[span]).unwrap();
        assert_eq!(
            pa.wait(3, Duration::from_secs(5)).unwrap(),
            BatchState::Done { bytes: 200_000 }
        );
        assert_eq!(dst, src);
    }

    #[test]
    fn rails_with_no_common_subnet_are_refused_with_the_subnets_named() {
        let ll = LinkLayer::Ethernet;
        let a = FakeNic::with_link_layer("na", 2, Mtu::Mtu4096, ll);
        let b = FakeNic::with_link_layer("nb", 1, Mtu::Mtu4096, ll);
        a.set_rail_addresses(&[(v4([10, 0, 1, 1]), 24), (v4([10, 0, 2, 1]), 24)]);
        b.set_rail_addresses(&[(v4([10, 0, 3, 2]), 24)]);
        let ea = a.endpoint().unwrap();
        let eb = b.endpoint().unwrap();
        let (ha, hb) = (ea.local().clone(), eb.local().clone());
        for e in [ea.connect(&hb).err(), eb.connect(&ha).err()] {
            let e = e.expect("no rail pair is refused");
            assert_eq!(e.status(), Status::RdmaHandshake);
            let d = e.detail();
            assert!(d.contains("field `subnet`"), "{d}");
            for want in [
                "na_0 port 1 (10.0.1.0/24)",
                "na_1 port 1 (10.0.2.0/24)",
                "nb_0 port 1 (10.0.3.0/24)",
            ] {
                assert!(d.contains(want), "{want}: {d}");
            }
        }
    }

    #[test]
    fn device_registrations_follow_the_gpu_direct_knobs() {
        let n = FakeNic::new("gd", 1, Mtu::Mtu4096);
        let buf = vec![0u8; 256];
        let (addr, dev) = (buf.as_ptr() as u64, RegionKind::Device { ordinal: 0 });
        // libcuda loads but GPU registrations fail: the probe finds it out up front
        n.refuse_device_registrations(true);
        let e = n.gpu_direct().unwrap_err();
        assert_eq!(e.status(), Status::NoGpuDirect, "{e}");
        assert!(e.detail().contains("nvidia-peermem"), "{e}");
        // SAFETY: `buf` outlives the registration attempts (deregistered below).
        let e = unsafe { n.register(addr, 128, dev) }.unwrap_err();
        assert_eq!(e.status(), Status::NoGpuDirect, "{e}");
        // host memory is still accepted
        // SAFETY: as above.
        unsafe { n.register(addr + 128, 128, RegionKind::Host) }.unwrap();
        n.refuse_device_registrations(false);
        assert!(n.gpu_direct().is_ok());
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
        // The probe passes, a later registration fails on its own.
        n.set_gpu_direct(true);
        n.refuse_device_registrations_after_probe(true);
        assert!(n.gpu_direct().is_ok());
        // SAFETY: as above.
        let e = unsafe { n.register(addr, 128, dev) }.unwrap_err();
        assert_eq!(e.status(), Status::NoGpuDirect, "{e}");
    }

    /// Two connected rails of one NIC pair (a on `an`, b on `bn`) over the
    /// given buffers, returned with their raw QPs.
    fn rails(
        cfg: RdmaConfig,
        src: &[u8],
        dst: &[u8],
    ) -> (FakeRail, FakeRail, LocalRegion, LocalRegion) {
        rails_with(cfg, None, src, dst)
    }

    fn rails_with(
        cfg: RdmaConfig,
        cq_depth: Option<usize>,
        src: &[u8],
        dst: &[u8],
    ) -> (FakeRail, FakeRail, LocalRegion, LocalRegion) {
        let an = FakeNic::with_config("qa", 1, Mtu::Mtu4096, LinkLayer::InfiniBand, cfg.clone());
        if let Some(d) = cq_depth {
            an.set_cq_depth(d);
        }
        let bn = FakeNic::with_config("qb", 1, Mtu::Mtu4096, LinkLayer::InfiniBand, cfg);
        // SAFETY: the callers keep both buffers alive while the rails work on them.
        let (ls, ld) = unsafe {
            (
                an.register(src.as_ptr() as u64, src.len() as u64, RegionKind::Host)
                    .unwrap()[0],
                bn.register(dst.as_ptr() as u64, dst.len() as u64, RegionKind::Host)
                    .unwrap()[0],
            )
        };
        let (ea, eb) = (an.endpoint().unwrap(), bn.endpoint().unwrap());
        let (qa, qb) = (an.qpns()[0], bn.qpns()[0]);
        let (a, b) = {
            let f = lock(fabric());
            (f.qps[&qa].clone(), f.qps[&qb].clone())
        };
        a.remote.store(qb, Ordering::SeqCst);
        b.remote.store(qa, Ordering::SeqCst);
        // The endpoints' own rails stay unused: forget them without destroying the QPs.
        std::mem::forget((ea, eb));
        (FakeRail { qp: a }, FakeRail { qp: b }, ls, ld)
    }

    fn write(
        id: u64,
        l: &LocalRegion,
        r: &LocalRegion,
        off: u64,
        len: u32,
        signaled: bool,
    ) -> WorkRequest {
        WorkRequest {
            wr_id: id,
            opcode: Opcode::Write,
            local_addr: l.addr + off,
            lkey: l.lkey,
            len,
            remote_addr: r.addr + off,
            rkey: r.lkey,
            signaled,
            imm: None,
            retires: 1,
        }
    }

    fn drain(r: &FakeRail, want: usize) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        let t0 = std::time::Instant::now();
        while out.len() < want && t0.elapsed() < Duration::from_secs(5) {
            if r.poll(&mut out, 64).is_err() {
                break;
            }
            std::thread::yield_now();
        }
        out
    }

    #[test]
    fn work_completes_later_from_the_fabric_thread_with_verbs_opcodes() {
        let src = vec![5u8; 4096];
        let dst = vec![0u8; 4096];
        let (a, _b, ls, ld) = rails(RdmaConfig::default(), &src, &dst);
        let here = std::thread::current().id();
        a.post_send(&[write(1, &ls, &ld, 0, 4096, true)]).unwrap();
        // Posting only queued it: nothing completed or landed yet.
        let mut out = Vec::new();
        assert_eq!(a.poll(&mut out, 8).unwrap(), 0, "completed at post time");
        let got = drain(&a, 1);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].status, got[0].opcode), (0, WC_OP_RDMA_WRITE));
        assert!(dst.iter().all(|b| *b == 5));
        assert_eq!(std::thread::current().id(), here);
        // A READ completes with IBV_WC_RDMA_READ (2), not another opcode.
        let mut r = write(2, &ls, &ld, 0, 16, true);
        r.opcode = Opcode::Read;
        a.post_send(&[r]).unwrap();
        assert_eq!(drain(&a, 1)[0].opcode, WC_OP_RDMA_READ);
        assert_eq!(WC_OP_RDMA_READ, 2);
    }

    #[test]
    fn the_send_queue_depth_is_enforced_until_completions_are_polled() {
        let src = vec![1u8; 1 << 16];
        let dst = vec![0u8; 1 << 16];
        let cfg = RdmaConfig {
            sq_depth: 8,
            signal_every: 4,
            ..RdmaConfig::default()
        };
        let (a, _b, ls, ld) = rails(cfg, &src, &dst);
        // 8 fit; the 9th to 12th are refused with ENOMEM, naming the depth.
        let wrs: Vec<WorkRequest> = (0..12u64)
            .map(|i| write(i, &ls, &ld, i * 64, 64, i % 4 == 3))
            .collect();
        let (accepted, e) = a.post_send(&wrs).unwrap_err();
        assert_eq!(accepted, 8);
        assert!(
            e.detail().contains("ENOMEM") && e.detail().contains("8 of 8"),
            "{e}"
        );
        // Executed, but the slots stay held until the completions are polled.
        std::thread::sleep(Duration::from_millis(5));
        assert!(
            a.post_send(&wrs[8..9]).is_err(),
            "slots freed before the poll"
        );
        let got = drain(&a, 2);
        assert_eq!(got.iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![3, 7]);
        // Polling WR 7's completion freed all 8 slots.
        a.post_send(&wrs[8..12]).unwrap();
        assert_eq!(drain(&a, 1)[0].wr_id, 11);
    }

    #[test]
    fn a_fault_puts_the_qp_in_error_and_flushes_what_follows_and_the_receives() {
        let src = vec![1u8; 1 << 16];
        let dst = vec![0u8; 1 << 16];
        let (a, _b, ls, ld) = rails(RdmaConfig::default(), &src, &dst);
        a.post_recvs(3).unwrap();
        fail_qp_after(a.qpn(), 1);
        let wrs: Vec<WorkRequest> = (0..4u64)
            .map(|i| write(i, &ls, &ld, i * 64, 64, i == 3))
            .collect();
        a.post_send(&wrs).unwrap();
        // WR 0 ran; WR 1 failed; WRs 2 and 3 (signalled or not) and the three
        // receives are flushed.
        let got = drain(&a, 6);
        let sends: Vec<(u64, u32)> = got
            .iter()
            .filter(|c| !c.is_recv())
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(
            sends,
            vec![
                (1, WC_RETRY_EXC_ERR),
                (2, WC_WR_FLUSH_ERR),
                (3, WC_WR_FLUSH_ERR)
            ]
        );
        let recvs: Vec<u32> = got
            .iter()
            .filter(|c| c.is_recv())
            .map(|c| c.status)
            .collect();
        assert_eq!(recvs, vec![WC_WR_FLUSH_ERR; 3]);
        // Errors carry no meaningful opcode (ibv_poll_cq(3)); they are told apart by wr_id.
        assert!(got.iter().all(|c| c.opcode == WC_OPCODE_UNDEFINED));
        assert!(!qp_alive(a.qpn()));
        assert!(dst[..64].iter().all(|b| *b == 1) && dst[64..].iter().all(|b| *b == 0));
        // Still in error: later posts are flushed too.
        a.post_send(&wrs[..1]).unwrap();
        assert_eq!(drain(&a, 1)[0].status, WC_WR_FLUSH_ERR);
    }

    #[test]
    fn an_overflowing_completion_queue_is_an_error() {
        let src = vec![1u8; 1 << 16];
        let dst = vec![0u8; 1 << 16];
        let cfg = RdmaConfig {
            sq_depth: 16,
            ..RdmaConfig::default()
        };
        let (a, _b, ls, ld) = rails_with(cfg, Some(4), &src, &dst);
        // Six signalled WRs, nothing polled: the fifth completion overflows.
        let wrs: Vec<WorkRequest> = (0..6u64)
            .map(|i| write(i, &ls, &ld, i * 64, 64, true))
            .collect();
        a.post_send(&wrs).unwrap();
        let t0 = std::time::Instant::now();
        while !lock(&a.qp.cq).overrun && t0.elapsed() < Duration::from_secs(5) {
            std::thread::yield_now();
        }
        let mut out = Vec::new();
        let e = a.poll(&mut out, 64).unwrap_err();
        assert!(
            e.detail().contains("overrun") && e.detail().contains("depth 4"),
            "{e}"
        );
        assert!(!qp_alive(a.qpn()));
        assert!(out.is_empty());
    }
}
