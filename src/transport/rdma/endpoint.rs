//! Real NICs through verbs (feature `rdma`): [`VerbsNic`] (rails, memory
//! registration) and its endpoints (one RC QP per rail), batch posting and
//! the completion poller thread.
//!
//! ```text
//! let t = VerbsNic::new(RdmaConfig::from_env()?)?;           // NoRdmaDevice without NICs
//! unsafe { t.register_host(&[(ptr, len)])? };                 // parallel, timed
//! let mut ep = t.endpoint()?;                                  // QPs in RESET
//! send(ep.local_handshake().encode()?); let remote = Handshake::decode(&recv())?;
//! ep.connect(&remote)?;                                        // negotiate, INIT -> RTR -> RTS
//! ep.post_batch(7, Direction::Write, &spans)?;                 // sliced across rails
//! ep.wait(7, timeout)?;                                        // Done / Failed(reason), never retried
//! ```

use super::config::{PairingMode, RdmaConfig};
use super::device::{select_rails, RailChoice};
use super::handshake::{
    random_psn, random_u64, Gid, Handshake, HandshakeField, LinkLayer, Mtu, Negotiated, RailInfo,
    RemoteRegion,
};
use super::pairing::negotiate_paired;
use super::qp::transitions;
use super::session::{lock, RailIo, Session, SessionParams, SessionRail};
use super::slice::{check_new_regions, LocalRegion, RailKeys, Span};
use super::tracker::{BatchState, WorkCompletion, RECV_WR_ID};
use super::verbs::{region_access, Context, Cq, DeviceAttr, Mr, Pd, PortAttr, Qp};
use super::wr::{Direction, WorkRequest};
use crate::error::{Error, Result, Status};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the RoCE traffic class of the QPs means, for the per-rail log line.
pub fn traffic_class_note(tc: u8) -> String {
    if tc == 0 {
        "RoCE traffic class 0 (DSCP 0): the default class, lossy on most fabrics; set PDXFER_RDMA_TRAFFIC_CLASS to the fabric's lossless class (commonly 106, DSCP 26) for N-to-1 incast".to_string()
    } else {
        format!(
            "RoCE traffic class {tc} (DSCP {}, from PDXFER_RDMA_TRAFFIC_CLASS)",
            tc >> 2
        )
    }
}

/// The prefix length of the chosen GID's IPv4 address on its net device
/// (0 when the GID is not IPv4 or the device or address is not found: the
/// rail then pairs with any rail the peer has left).
fn ipv4_prefix_len(devs: &[super::device::RdmaDevice], c: &RailChoice, gid: &Gid) -> u8 {
    if !gid.is_ipv4_mapped() {
        return 0;
    }
    let addr = std::net::Ipv4Addr::new(gid.0[12], gid.0[13], gid.0[14], gid.0[15]);
    let netdev = devs
        .iter()
        .filter(|d| d.name == c.device)
        .flat_map(|d| d.ports.iter().filter(|p| p.num == c.port))
        .flat_map(|p| p.gids.iter().filter(|g| g.index == c.gid_index))
        .find_map(|g| g.netdev.clone());
    let len = netdev
        .as_deref()
        .and_then(|nd| super::netdev::ipv4_prefix_len(nd, addr));
    match len {
        Some(l) => l,
        None => {
            log::warn!(
                "rdma: {} port {}: no prefix length for {addr} on net device {}: its subnet is unknown, so it pairs with any rail of the peer left unpaired",
                c.device,
                c.port,
                netdev.as_deref().unwrap_or("(none)")
            );
            0
        }
    }
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
    /// The prefix length of an IPv4 GID's address on the port's net device
    /// (0: not known, or not IPv4), sent in the handshake for rail pairing.
    pub prefix_len: u8,
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
    /// (lkey, rkey) per rail.
    keys: Vec<(u32, u32)>,
    /// The MRs; dropped (`ibv_dereg_mr`) by [`VerbsNic::deregister`].
    _mrs: Vec<Mr>,
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

/// The NICs opened through verbs: the chosen rails and the memory registered
/// on them. Not a [`Transport`](crate::transport::Transport): the rdma
/// transport moves batches over a connected endpoint of it.
pub struct VerbsNic {
    cfg: RdmaConfig,
    rails: Vec<Arc<Rail>>,
    regions: Mutex<Vec<Region>>,
    instance_id: u64,
}

impl VerbsNic {
    /// Discovers NICs, picks rails (logging one line per rail with the reason) and
    /// opens them. Without a usable NIC: [`Status::NoRdmaDevice`] with the reason.
    pub fn new(cfg: RdmaConfig) -> Result<VerbsNic> {
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
            let prefix_len = ipv4_prefix_len(&devs, &c, &gid);
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
            if port.link_layer == LinkLayer::Ethernet {
                log::info!(
                    "rdma rail {i}: {}",
                    traffic_class_note(cfg.tuning.traffic_class)
                );
            }
            rails.push(Arc::new(Rail {
                choice: c,
                port,
                device,
                gid,
                mtu,
                prefix_len,
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
        Ok(VerbsNic {
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
        // Held for the whole call, so concurrent registrations cannot both pass the
        // overlap check (registration is rare: at startup).
        let mut regs = lock(&self.regions);
        let have: Vec<(u64, u64)> = regs.iter().map(|r| (r.addr, r.len)).collect();
        check_new_regions(&have, ranges)?;
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
        for (addr, len) in ranges {
            let mrs: Vec<Mr> = it.by_ref().take(nr).collect();
            regs.push(Region {
                addr: *addr,
                len: *len,
                kind,
                keys: mrs.iter().map(|m| (m.lkey, m.rkey)).collect(),
                _mrs: mrs,
            });
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

    /// Deregisters the region starting at `addr` on every rail now
    /// (`ibv_dereg_mr`): its rkeys stop working at once, so a peer's WRITE
    /// with one fails with `IBV_WC_REM_ACCESS_ERR` and writes nothing, and
    /// local work requests with its lkeys fail. Call it only once no batch
    /// of this process uses the memory (the agent calls it from the
    /// registry's unregister hook, after the region's accesses drained).
    pub fn deregister(&self, addr: u64) -> Result<()> {
        let gone: Vec<Region> = {
            let mut regs = lock(&self.regions);
            let (gone, keep) = regs.drain(..).partition(|r| r.addr == addr);
            *regs = keep;
            gone
        };
        if gone.is_empty() {
            return Err(Error::new(
                Status::RegionNotFound,
                format!("no RDMA region starts at {addr:#x}"),
            ));
        }
        // Endpoints keep only the keys: the MRs are deregistered here.
        drop(gone);
        Ok(())
    }

    /// How the region starting at `addr` was registered, if it is.
    pub fn region_kind(&self, addr: u64) -> Option<MemoryKind> {
        lock(&self.regions)
            .iter()
            .find(|r| r.addr == addr)
            .map(|r| r.kind)
    }

    /// The lkeys of the region starting at `addr`, one per rail.
    pub fn local_keys(&self, addr: u64) -> Option<Vec<LocalRegion>> {
        let regs = lock(&self.regions);
        let g = regs.iter().find(|r| r.addr == addr)?;
        Some(
            g.keys
                .iter()
                .map(|(lkey, _)| LocalRegion {
                    addr: g.addr,
                    len: g.len,
                    lkey: *lkey,
                })
                .collect(),
        )
    }

    /// Creates an endpoint: one CQ and one RC QP per rail, advertising every
    /// region registered so far.
    pub fn endpoint(&self) -> Result<RdmaEndpoint> {
        // Keys only: a region's MRs go away when it is deregistered, even while
        // endpoints that advertised it live (its rkeys must stop working then).
        type Keys = (u64, u64, Vec<(u32, u32)>);
        let regions: Vec<Keys> = lock(&self.regions)
            .iter()
            .map(|g| (g.addr, g.len, g.keys.clone()))
            .collect();
        let depth = (self.cfg.sq_depth + self.cfg.recv_depth) as i32;
        let mut rails = Vec::with_capacity(self.rails.len());
        let mut infos = Vec::with_capacity(self.rails.len());
        let mut info = Vec::with_capacity(self.rails.len());
        for (i, r) in self.rails.iter().enumerate() {
            let cq = Cq::create(&r.ctx, depth.min(r.device.max_cqe.max(1)))?;
            let sq = self.cfg.sq_depth.min(r.device.max_qp_wr.max(1) as u32);
            let rq = self.cfg.recv_depth.min(r.device.max_qp_wr.max(1) as u32);
            let qp = Qp::create(&r.pd, &cq, sq, rq)?;
            let local: Vec<LocalRegion> = regions
                .iter()
                .map(|(addr, len, k)| LocalRegion {
                    addr: *addr,
                    len: *len,
                    lkey: k[i].0,
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
                prefix_len: r.prefix_len,
                psn: random_psn(),
                mtu: r.mtu,
                regions: regions
                    .iter()
                    .map(|(addr, len, k)| RemoteRegion {
                        addr: *addr,
                        len: *len,
                        rkey: k[i].1,
                    })
                    .collect(),
            });
            let max_msg = r.port.max_msg_sz.max(1) as u64;
            rails.push(SessionRail::new(
                VerbsRail { qp, cq },
                r.choice.weight,
                max_msg,
                sq,
                rq,
            ));
            info.push((r.clone(), local));
        }
        Ok(RdmaEndpoint {
            session: Session::new(
                rails,
                SessionParams {
                    signal_every: self.cfg.signal_every,
                    min_slice: self.cfg.min_slice,
                    record: self.cfg.record,
                    post_timeout: self.cfg.post_timeout,
                },
            ),
            info,
            local: Handshake {
                instance_id: self.instance_id,
                rails: infos,
                pair_by_index: self.cfg.pairing == PairingMode::Index,
            },
            negotiated: Vec::new(),
            cfg: self.cfg.clone(),
        })
    }
}

/// The verbs queue pair and completion queue of one rail.
pub struct VerbsRail {
    qp: Qp,
    cq: Arc<Cq>,
}

impl RailIo for VerbsRail {
    fn post_send(&self, wrs: &[WorkRequest]) -> std::result::Result<(), (usize, Error)> {
        self.qp.post_send(wrs)
    }
    fn post_recvs(&self, n: usize) -> Result<()> {
        self.qp.post_recvs(n, RECV_WR_ID)
    }
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize> {
        self.cq.poll(out, max)
    }
}

/// One connection to one peer: a QP per rail, a completion poller thread.
pub struct RdmaEndpoint {
    session: Session<VerbsRail>,
    info: Vec<(Arc<Rail>, Vec<LocalRegion>)>,
    local: Handshake,
    negotiated: Vec<Negotiated>,
    cfg: RdmaConfig,
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

    /// Connects to the peer described by `remote`: pairs the rails by subnet
    /// (`pairing`; no pair is `RdmaHandshake`, field `subnet`), negotiates each
    /// pair (min MTU, GIDs, LIDs), moves its QP INIT -> RTR -> RTS, drops the
    /// QPs of rails left out, posts the receives for completion records and
    /// starts the completion poller.
    pub fn connect(&mut self, remote: &Handshake) -> Result<Vec<Negotiated>> {
        if !self.negotiated.is_empty() {
            return Err(Error::invalid("endpoint is already connected"));
        }
        let paired = negotiate_paired(&self.local, remote)?;
        let mut keys = Vec::with_capacity(paired.len());
        for p in &paired {
            let (i, n) = (p.pair.local, &p.negotiated);
            let (rail, local) = &self.info[i];
            let qp = &self.session.rails()[i].io.qp;
            let gid_len = rail.port.gid_tbl_len;
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
            let rd = rail.device.max_qp_rd_atom.clamp(1, 255) as u8;
            for a in transitions(n, &self.cfg.tuning, rd, true) {
                qp.modify(&a)
                    .map_err(|e| Error::new(e.status(), format!("rail {i}: {}", e.detail())))?;
            }
            let peer = &remote.rails[p.pair.remote];
            keys.push(RailKeys::new(local.clone(), peer.regions.clone()));
            log::info!(
                "rdma: rail {i} connected: {} port {} -> peer rail {} {} qpn {:#x}, mtu {} (local {}, remote {}), {}",
                rail.choice.device,
                n.port,
                p.pair.remote,
                peer.device,
                n.remote_qpn,
                n.mtu,
                n.local_mtu,
                n.remote_mtu,
                if n.use_grh {
                    format!("gid {}", n.dgid)
                } else {
                    format!("lid {:#x}", n.dlid)
                }
            );
        }
        let order: Vec<usize> = paired.iter().map(|p| p.pair.local).collect();
        self.session.keep_rails(&order)?;
        self.session.start(keys)?;
        let negs: Vec<Negotiated> = paired.into_iter().map(|p| p.negotiated).collect();
        self.negotiated = negs.clone();
        Ok(negs)
    }

    /// Posts one batch: the spans are sliced across the connected rails by bytes
    /// (weighted by link rate), keys are resolved and bounds-checked before
    /// anything is posted, and each rail posts linked WR lists signalled every
    /// `signal_every`, round-robin with the other rails. With
    /// [`RecordMode::Immediate`](super::config::RecordMode::Immediate) each rail's last WRITE carries (batch id, rails)
    /// as immediate data; the peer's [`next_incoming`](Self::next_incoming) reports
    /// the batch once all of them arrived.
    pub fn post_batch(&self, batch: u32, dir: Direction, spans: &[Span]) -> Result<()> {
        self.session.post_batch(batch, dir, spans)
    }

    /// A write batch kept on one rail and followed there by an ordered WRITE of
    /// `record` (a small completion record the peer polls for; RC keeps the order).
    pub fn post_batch_with_record(&self, batch: u32, spans: &[Span], record: Span) -> Result<()> {
        self.session.post_batch_with_record(batch, spans, record)
    }

    /// Makes a region registered after this endpoint connected usable as a
    /// local source or destination (`per_rail[i]` holds its lkey on NIC rail `i`).
    pub fn session_add_local(&self, per_rail: &[LocalRegion]) {
        self.session.add_local(per_rail)
    }

    /// Forgets every local region overlapping `[addr, addr+len)` (deregistered).
    pub fn session_remove_local(&self, addr: u64, len: u64) {
        self.session.remove_local(addr, len)
    }

    /// Why the endpoint cannot carry batches any more (a dead rail), if so.
    pub fn session_broken(&self) -> Option<String> {
        self.session.broken()
    }

    /// Batches the completion tracker still holds.
    pub fn session_tracked(&self) -> usize {
        self.session.tracked()
    }

    /// The batch's state; a finished batch is forgotten after it is reported once.
    pub fn poll(&self, batch: u32) -> Result<BatchState> {
        self.session.poll(batch)
    }

    /// Waits until the batch is done or failed, at most `timeout`
    /// ([`Status::Timeout`] then; the batch keeps running and can be polled again).
    pub fn wait(&self, batch: u32, timeout: Duration) -> Result<BatchState> {
        self.session.wait(batch, timeout)
    }

    /// The next batch the peer announced as fully written, if any.
    pub fn next_incoming(&self) -> Option<u32> {
        self.session.next_incoming()
    }
}
