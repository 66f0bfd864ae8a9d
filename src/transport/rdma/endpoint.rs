//! The RDMA transport on real NICs (feature `rdma`): rails, memory registration,
//! endpoints (one RC QP per rail), batch posting and the completion poller thread.
//!
//! ```text
//! let t = RdmaTransport::new(RdmaConfig::from_env()?)?;       // NoRdmaDevice without NICs
//! unsafe { t.register_host(&[(ptr, len)])? };                 // parallel, timed
//! let mut ep = t.endpoint()?;                                  // QPs in RESET
//! send(ep.local_handshake().encode()?); let remote = Handshake::decode(&recv())?;
//! ep.connect(&remote)?;                                        // negotiate, INIT -> RTR -> RTS
//! ep.post_batch(7, Direction::Write, &spans)?;                 // sliced across rails
//! ep.wait(7, timeout)?;                                        // Done / Failed(reason), never retried
//! ```

use super::config::{RdmaConfig, RecordMode};
use super::device::{select_rails, RailChoice};
use super::handshake::{
    negotiate_all, random_psn, random_u64, Gid, Handshake, HandshakeField, LinkLayer, Mtu,
    Negotiated, RailInfo, RemoteRegion,
};
use super::qp::transitions;
use super::slice::{slice_across, LocalRegion, RailKeys, Span};
use super::tracker::{BatchState, Posted, Tracker};
use super::verbs::{region_access, Context, Cq, DeviceAttr, Mr, Pd, PortAttr, Qp};
use super::wr::{
    build_batch, imm_encode, post_groups, BatchParams, CompletionRecord, Direction, Transfer,
    WorkRequest,
};
use crate::error::{Error, Result, Status};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `wr_id` of the receives posted for incoming WRITE_WITH_IMM records.
const RECV_WR_ID: u64 = u64::MAX;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One opened NIC port.
pub struct Rail {
    /// Why and how it was chosen.
    pub choice: RailChoice,
    /// The port's attributes.
    pub port: PortAttr,
    /// The device's limits.
    pub device: DeviceAttr,
    /// The local GID at `choice.gid_index`.
    pub gid: Gid,
    /// The port's active MTU.
    pub mtu: Mtu,
    pd: Arc<Pd>,
    ctx: Arc<Context>,
}

/// Where a registered region lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory (`ibv_reg_mr`).
    Host,
    /// GPU memory through a dma-buf (`ibv_reg_dmabuf_mr`).
    GpuDmabuf,
    /// GPU memory through nvidia-peermem (`ibv_reg_mr` on a device pointer).
    GpuPeermem,
}

/// A region registered on every rail.
pub struct Region {
    /// Start address.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Host or GPU.
    pub kind: MemoryKind,
    mrs: Vec<Mr>,
}

/// What one registration call did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistrationReport {
    /// Regions registered.
    pub regions: usize,
    /// Bytes registered (per rail).
    pub bytes: u64,
    /// Rails each region was registered on.
    pub rails: usize,
    /// Threads used.
    pub threads: usize,
    /// Wall time of the whole call.
    pub elapsed: Duration,
}

/// The RDMA transport: the chosen rails and the registered memory.
pub struct RdmaTransport {
    cfg: RdmaConfig,
    rails: Vec<Arc<Rail>>,
    regions: Mutex<Vec<Arc<Region>>>,
    instance_id: u64,
}

impl RdmaTransport {
    /// Discovers NICs, picks rails (logging one line per rail with the reason) and
    /// opens them. Without a usable NIC: [`Status::NoRdmaDevice`] with the reason.
    pub fn new(cfg: RdmaConfig) -> Result<RdmaTransport> {
        cfg.validate()?;
        let devs = super::device::scan(&cfg.sys_root)?;
        let choices = select_rails(
            &devs,
            &cfg.policy,
            &cfg.affinity(),
            cfg.gid_index,
            cfg.max_rails,
        )?;
        let mut rails = Vec::with_capacity(choices.len());
        for (i, c) in choices.into_iter().enumerate() {
            let ctx = Context::open(&c.device)?;
            let port = ctx.query_port(c.port)?;
            if port.state != 4 {
                return Err(Error::new(
                    Status::NoRdmaDevice,
                    format!(
                        "{} port {} is not ACTIVE according to verbs (state {})",
                        c.device, c.port, port.state
                    ),
                ));
            }
            let mtu = port.active_mtu.ok_or_else(|| {
                Error::new(
                    Status::RdmaHandshake,
                    format!(
                        "RDMA handshake: field `mtu`: {} port {} reports no valid active MTU",
                        c.device, c.port
                    ),
                )
            })?;
            let gid = ctx.query_gid(c.port, c.gid_index)?;
            if port.link_layer == LinkLayer::Ethernet && gid.is_zero() {
                return Err(Error::new(
                    Status::RdmaHandshake,
                    format!(
                        "RDMA handshake: field `gid`: {} port {} GID index {} is all zero; set PDXFER_RDMA_GID_INDEX to a populated entry (see `pdxfer info`)",
                        c.device, c.port, c.gid_index
                    ),
                ));
            }
            let device = ctx.query_device()?;
            let pd = Pd::alloc(&ctx)?;
            log::info!(
                "rdma rail {i}: {} port {} ({}, mtu {mtu}, gid[{}]={gid}, lid {:#x}, numa {:?}, weight {}): {}",
                c.device,
                c.port,
                port.link_layer,
                c.gid_index,
                port.lid,
                c.numa_node,
                c.weight,
                c.reason
            );
            rails.push(Arc::new(Rail {
                choice: c,
                port,
                device,
                gid,
                mtu,
                pd,
                ctx,
            }));
        }
        if rails.is_empty() {
            return Err(Error::new(
                Status::NoRdmaDevice,
                "no rail selected (max_rails = 0 devices?)",
            ));
        }
        Ok(RdmaTransport {
            cfg,
            rails,
            regions: Mutex::new(Vec::new()),
            instance_id: random_u64(),
        })
    }

    /// The rails in use.
    pub fn rails(&self) -> Vec<RailChoice> {
        self.rails.iter().map(|r| r.choice.clone()).collect()
    }

    /// Registers host ranges `(addr, len)` on every rail, in parallel over
    /// (range, rail) pairs, and logs the time taken. All or nothing: on any failure
    /// the ranges registered by this call are released.
    ///
    /// # Safety
    /// Each range must stay allocated until it is deregistered and every endpoint
    /// created after this call is dropped.
    pub unsafe fn register_host(&self, ranges: &[(u64, u64)]) -> Result<RegistrationReport> {
        self.register_with(ranges, MemoryKind::Host, |pd, addr, len| {
            // SAFETY: forwarded from this function's contract.
            unsafe { Mr::register(pd, addr, len, region_access()) }
        })
    }

    /// Registers GPU memory `[dptr, dptr+len)` on every rail: through a dma-buf
    /// (`cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`) when the driver
    /// offers one, else through nvidia-peermem (`ibv_reg_mr` on the device
    /// pointer). When neither works the error says so: memory is never staged
    /// through the host silently. Call with the pointer's CUDA context current.
    ///
    /// # Safety
    /// The allocation must outlive the registration, as for [`register_host`](Self::register_host).
    #[cfg(feature = "cuda")]
    pub unsafe fn register_gpu(&self, dptr: u64, len: u64) -> Result<RegistrationReport> {
        match super::verbs::gpu_dmabuf(dptr, len) {
            Ok((fd, offset, _span)) => {
                let r = self.register_with(&[(dptr, len)], MemoryKind::GpuDmabuf, |pd, addr, len| {
                    // SAFETY: fd is a live dma-buf covering [addr, addr+len) at `offset`.
                    unsafe { Mr::register_dmabuf(pd, fd, offset, len, addr, region_access()) }
                });
                // SAFETY: fd came from the CUDA driver and is ours to close; the MRs keep
                // their own reference to the buffer.
                unsafe { libc::close(fd) };
                match r {
                    Ok(r) => Ok(r),
                    Err(e) => self.register_peermem(dptr, len).map_err(|e2| {
                        Error::new(
                            e2.status(),
                            format!("GPUDirect RDMA unavailable: dma-buf registration failed ({}) and so did nvidia-peermem ({})", e.detail(), e2.detail()),
                        )
                    }),
                }
            }
            Err(e) => self.register_peermem(dptr, len).map_err(|e2| {
                Error::new(
                    e2.status(),
                    format!(
                        "GPUDirect RDMA unavailable: no dma-buf ({}) and nvidia-peermem registration failed ({}): load nvidia_peermem or use a driver with dma-buf support",
                        e.detail(),
                        e2.detail()
                    ),
                )
            }),
        }
    }

    #[cfg(feature = "cuda")]
    fn register_peermem(&self, dptr: u64, len: u64) -> Result<RegistrationReport> {
        self.register_with(&[(dptr, len)], MemoryKind::GpuPeermem, |pd, addr, len| {
            // SAFETY: the caller of register_gpu guarantees the allocation's lifetime.
            unsafe { Mr::register(pd, addr, len, region_access()) }
        })
    }

    fn register_with(
        &self,
        ranges: &[(u64, u64)],
        kind: MemoryKind,
        reg: impl Fn(&Arc<Pd>, u64, u64) -> Result<Mr> + Sync,
    ) -> Result<RegistrationReport> {
        for (a, l) in ranges {
            if *l == 0 || a.checked_add(*l).is_none() {
                return Err(Error::invalid(format!("cannot register {a:#x}+{l}")));
            }
        }
        let start = Instant::now();
        let nr = self.rails.len();
        let jobs = ranges.len() * nr;
        let threads = self.cfg.reg_threads.clamp(1, jobs.max(1));
        let slots: Vec<Mutex<Option<Result<Mr>>>> = (0..jobs).map(|_| Mutex::new(None)).collect();
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    if j >= jobs {
                        break;
                    }
                    let (addr, len) = ranges[j / nr];
                    let r = reg(&self.rails[j % nr].pd, addr, len);
                    *lock(&slots[j]) = Some(r);
                });
            }
        });
        let mut mrs: Vec<Mr> = Vec::with_capacity(jobs);
        let mut first_err = None;
        for s in slots {
            match s.into_inner().unwrap_or_else(|p| p.into_inner()) {
                Some(Ok(m)) => mrs.push(m),
                Some(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                None => {
                    first_err
                        .get_or_insert(Error::new(Status::Rdma, "a registration job did not run"));
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let mut it = mrs.into_iter();
        let mut regs = lock(&self.regions);
        for (addr, len) in ranges {
            let mrs: Vec<Mr> = it.by_ref().take(nr).collect();
            regs.push(Arc::new(Region {
                addr: *addr,
                len: *len,
                kind,
                mrs,
            }));
        }
        let report = RegistrationReport {
            regions: ranges.len(),
            bytes: ranges.iter().map(|(_, l)| *l).sum(),
            rails: nr,
            threads,
            elapsed: start.elapsed(),
        };
        log::info!(
            "rdma: registered {} {kind:?} region(s), {:.3} GiB, on {} NIC(s) with {} thread(s) in {:.1} ms",
            report.regions,
            report.bytes as f64 / (1u64 << 30) as f64,
            nr,
            threads,
            report.elapsed.as_secs_f64() * 1e3
        );
        Ok(report)
    }

    /// Forgets the region starting at `addr`. Its MRs are released once no
    /// endpoint that advertised it is alive.
    pub fn deregister(&self, addr: u64) -> Result<()> {
        let mut regs = lock(&self.regions);
        let before = regs.len();
        regs.retain(|r| r.addr != addr);
        if regs.len() == before {
            return Err(Error::new(
                Status::RegionNotFound,
                format!("no RDMA region starts at {addr:#x}"),
            ));
        }
        Ok(())
    }

    /// Creates an endpoint: one CQ and one RC QP per rail, advertising every
    /// region registered so far.
    pub fn endpoint(&self) -> Result<RdmaEndpoint> {
        let regions: Vec<Arc<Region>> = lock(&self.regions).clone();
        let depth = (self.cfg.sq_depth + self.cfg.recv_depth) as i32;
        let mut rails = Vec::with_capacity(self.rails.len());
        let mut infos = Vec::with_capacity(self.rails.len());
        for (i, r) in self.rails.iter().enumerate() {
            let cq = Cq::create(&r.ctx, depth.min(r.device.max_cqe.max(1)))?;
            let sq = self.cfg.sq_depth.min(r.device.max_qp_wr.max(1) as u32);
            let rq = self.cfg.recv_depth.min(r.device.max_qp_wr.max(1) as u32);
            let qp = Qp::create(&r.pd, &cq, sq, rq)?;
            let local: Vec<LocalRegion> = regions
                .iter()
                .map(|g| LocalRegion {
                    addr: g.addr,
                    len: g.len,
                    lkey: g.mrs[i].lkey,
                })
                .collect();
            infos.push(RailInfo {
                device: r.choice.device.clone(),
                port: r.choice.port,
                link_layer: r.port.link_layer,
                qpn: qp.qpn(),
                lid: r.port.lid,
                gid: r.gid,
                gid_index: r.choice.gid_index,
                psn: random_psn(),
                mtu: r.mtu,
                regions: regions
                    .iter()
                    .map(|g| RemoteRegion {
                        addr: g.addr,
                        len: g.len,
                        rkey: g.mrs[i].rkey,
                    })
                    .collect(),
            });
            rails.push(EpRail {
                rail: r.clone(),
                cq,
                qp,
                local,
                keys: Mutex::new(None),
                sq_depth: sq,
                recv_depth: rq,
            });
        }
        Ok(RdmaEndpoint {
            shared: Arc::new(Shared {
                rails,
                tracker: Mutex::new(Tracker::new(0, 0)),
                cv: Condvar::new(),
                stop: AtomicBool::new(false),
            }),
            local: Handshake {
                instance_id: self.instance_id,
                rails: infos,
            },
            negotiated: Vec::new(),
            poller: None,
            cfg: self.cfg.clone(),
            _regions: regions,
        })
    }
}

struct EpRail {
    rail: Arc<Rail>,
    cq: Arc<Cq>,
    qp: Qp,
    local: Vec<LocalRegion>,
    keys: Mutex<Option<RailKeys>>,
    sq_depth: u32,
    recv_depth: u32,
}

struct Shared {
    rails: Vec<EpRail>,
    tracker: Mutex<Tracker>,
    cv: Condvar,
    stop: AtomicBool,
}

/// One connection to one peer: a QP per rail, a completion poller thread.
pub struct RdmaEndpoint {
    shared: Arc<Shared>,
    local: Handshake,
    negotiated: Vec<Negotiated>,
    poller: Option<JoinHandle<()>>,
    cfg: RdmaConfig,
    _regions: Vec<Arc<Region>>,
}

impl RdmaEndpoint {
    /// What to send the peer over the control channel (`.encode()` it).
    pub fn local_handshake(&self) -> &Handshake {
        &self.local
    }

    /// The negotiated attributes per connected rail (empty before [`connect`](Self::connect)).
    pub fn negotiated(&self) -> &[Negotiated] {
        &self.negotiated
    }

    /// Connects to the peer described by `remote`: negotiates each rail (min MTU,
    /// GIDs, LIDs), moves each QP INIT -> RTR -> RTS, posts the receives for
    /// completion records and starts the completion poller.
    pub fn connect(&mut self, remote: &Handshake) -> Result<Vec<Negotiated>> {
        if self.poller.is_some() {
            return Err(Error::invalid("endpoint is already connected"));
        }
        let negs = negotiate_all(&self.local, remote)?;
        for (i, n) in negs.iter().enumerate() {
            let r = &self.shared.rails[i];
            let gid_len = r.rail.port.gid_tbl_len;
            if n.use_grh && (n.sgid_index as i32) >= gid_len {
                return Err(super::handshake::HandshakeError {
                    field: HandshakeField::GidIndex,
                    detail: format!(
                        "rail {i}: local GID index {} is outside the table of {gid_len}",
                        n.sgid_index
                    ),
                }
                .into());
            }
            let rd = r.rail.device.max_qp_rd_atom.clamp(1, 255) as u8;
            for a in transitions(n, &self.cfg.tuning, rd, true) {
                r.qp.modify(&a)
                    .map_err(|e| Error::new(e.status(), format!("rail {i}: {}", e.detail())))?;
            }
            r.qp.post_recvs(r.recv_depth as usize, RECV_WR_ID)?;
            *lock(&r.keys) = Some(RailKeys::new(
                r.local.clone(),
                remote.rails[i].regions.clone(),
            ));
            log::info!(
                "rdma: rail {i} connected: {} port {} -> {} qpn {:#x}, mtu {} (local {}, remote {}), {}",
                r.rail.choice.device,
                n.port,
                remote.rails[i].device,
                n.remote_qpn,
                n.mtu,
                n.local_mtu,
                n.remote_mtu,
                if n.use_grh { format!("gid {}", n.dgid) } else { format!("lid {:#x}", n.dlid) }
            );
        }
        let sq = self
            .shared
            .rails
            .iter()
            .map(|r| r.sq_depth)
            .min()
            .unwrap_or(1);
        *lock(&self.shared.tracker) = Tracker::new(negs.len(), sq);
        let shared = self.shared.clone();
        let n = negs.len();
        self.poller = Some(
            std::thread::Builder::new()
                .name("pdxfer-rdma-cq".into())
                .spawn(move || poll_loop(&shared, n))
                .map_err(|e| {
                    Error::new(
                        Status::Rdma,
                        format!("cannot start the CQ poller thread: {e}"),
                    )
                })?,
        );
        self.negotiated = negs.clone();
        Ok(negs)
    }

    /// Posts one batch: the spans are sliced across the connected rails (a batch
    /// with a final-write record stays on one rail so RC ordering holds), keys are
    /// resolved and bounds-checked before anything is posted, and each rail posts
    /// linked WR lists signalled every `signal_every`. With [`RecordMode::Immediate`]
    /// each rail's last WRITE carries (batch id, rails) as immediate data.
    pub fn post_batch(&self, batch: u32, dir: Direction, spans: &[Span]) -> Result<()> {
        self.post_batch_with(batch, dir, spans, None)
    }

    /// [`post_batch`](Self::post_batch) followed, on the same rail, by an ordered
    /// WRITE of `record` (a small completion record the peer polls for).
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
        let n = self.negotiated.len();
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
            let weights: Vec<u64> = rails.iter().map(|r| r.rail.choice.weight).collect();
            slice_across(spans, &weights, self.cfg.min_slice)?
        };
        let imm_wanted = dir == Direction::Write
            && final_write.is_none()
            && self.cfg.record == RecordMode::Immediate;
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
                max_msg: rails[i].rail.port.max_msg_sz.max(1) as u64,
                signal_every: self.cfg.signal_every.min(rails[i].sq_depth),
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
        let deadline = Instant::now() + self.cfg.post_timeout;
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
                    t.posted(batch, &signalled);
                }
                if let Err((accepted, e)) = rails[*i].qp.post_send(group) {
                    let mut t = lock(&self.shared.tracker);
                    // The refused WRs (including the signalled one) will never complete.
                    t.unpost(batch, &signalled);
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
                            self.cfg.post_timeout, done
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

impl Drop for RdmaEndpoint {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.poller.take() {
            if h.join().is_err() {
                log::error!("rdma: the CQ poller thread panicked");
            }
        }
    }
}

fn poll_loop(shared: &Shared, n: usize) {
    let mut wcs = Vec::with_capacity(32);
    let mut idle = 0u32;
    while !shared.stop.load(Ordering::Acquire) {
        let mut any = false;
        for (i, r) in shared.rails[..n].iter().enumerate() {
            wcs.clear();
            if let Err(e) = r.cq.poll(&mut wcs, 32) {
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
                if let Err(e) = r.qp.post_recvs(reposts, RECV_WR_ID) {
                    log::error!("rdma: rail {i}: re-posting {reposts} receive(s): {e}");
                }
            }
            shared.cv.notify_all();
        }
        if any {
            idle = 0;
        } else {
            idle = idle.saturating_add(1);
            if idle > 1024 {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
