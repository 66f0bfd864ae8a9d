//! Thin, owned wrappers over libibverbs (feature `rdma`).
//!
//! Layering: [`super::verbs_sys`] (the `repr(C)` structs and the library's
//! entry points, loaded at run time) -> functions here that turn each call's
//! NULL / non-zero return into a [`Result`] carrying the errno and the call's
//! name -> RAII types ([`Context`], [`Pd`], [`Mr`], [`Cq`], [`Qp`]) whose `Drop`
//! never panics (a failed destroy is logged and ignored). Objects keep their
//! parents alive through `Arc`s, so destruction order is always QP, CQ, MR, PD,
//! context. `ibv_post_send`, `ibv_post_recv` and `ibv_poll_cq` are `static
//! inline` in verbs.h and not exported: they are called through the provider's
//! `context.ops` table.

use super::device::RdmaDevice;
use super::handshake::{Gid, LinkLayer, Mtu};
use super::qp::{
    QpAttrs, ACCESS_LOCAL_WRITE, ACCESS_RELAXED_ORDERING, ACCESS_REMOTE_READ, ACCESS_REMOTE_WRITE,
};
use super::tracker::WorkCompletion;
use super::verbs_sys::{self as ffi, Verbs};
use super::wr::{Opcode, WorkRequest};
use crate::error::{Error, Result, Status};
use std::ffi::CStr;
use std::sync::Arc;

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn verbs_err(call: &str, what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(Status::Rdma, format!("{call} failed for {what}: {e}"))
}

/// The device list of libibverbs; freed on drop.
pub struct DeviceList {
    v: &'static Verbs,
    list: *mut *mut ffi::ibv_device,
    n: usize,
}

impl DeviceList {
    /// `ibv_get_device_list`, or [`Status::NoRdmaDevice`] with the reason
    /// (no libibverbs among them).
    pub fn get() -> Result<DeviceList> {
        let v = ffi::verbs()?;
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the returned list is freed in Drop.
        let list = unsafe { (v.get_device_list)(&mut n) };
        if list.is_null() {
            let e = errno();
            let hint = if e.raw_os_error() == Some(libc::ENOSYS) {
                " (the kernel has no RDMA support: no ib_uverbs / /sys/class/infiniband)"
            } else {
                ""
            };
            return Err(Error::new(
                Status::NoRdmaDevice,
                format!("no RDMA device: ibv_get_device_list failed: {e}{hint}"),
            ));
        }
        Ok(DeviceList {
            v,
            list,
            n: n.max(0) as usize,
        })
    }

    /// Names of the devices libibverbs can see.
    pub fn names(&self) -> Vec<String> {
        (0..self.n).map(|i| self.name(i)).collect()
    }

    fn name(&self, i: usize) -> String {
        // SAFETY: i < n, and the list holds n valid device pointers while self lives;
        // ibv_get_device_name returns a NUL-terminated string owned by the device.
        unsafe {
            let d = *self.list.add(i);
            let p = (self.v.get_device_name)(d);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }

    fn find(&self, name: &str) -> Option<*mut ffi::ibv_device> {
        // SAFETY: i < n indexes the list returned by ibv_get_device_list.
        (0..self.n)
            .find(|i| self.name(*i) == name)
            .map(|i| unsafe { *self.list.add(i) })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed exactly once.
        unsafe { (self.v.free_device_list)(self.list) }
    }
}

/// Port attributes (from `ibv_query_port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// `ibv_port_state` (4 = ACTIVE).
    pub state: u32,
    /// Active MTU.
    pub active_mtu: Option<Mtu>,
    /// Largest MTU the port supports.
    pub max_mtu: Option<Mtu>,
    /// LID.
    pub lid: u16,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// GID table length.
    pub gid_tbl_len: i32,
    /// Largest message size.
    pub max_msg_sz: u32,
}

/// Device limits (from `ibv_query_device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Largest send/receive queue.
    pub max_qp_wr: i32,
    /// Largest outstanding RDMA READs per QP.
    pub max_qp_rd_atom: i32,
    /// Largest CQ.
    pub max_cqe: i32,
    /// Largest MR.
    pub max_mr_size: u64,
    /// Number of ports.
    pub phys_port_cnt: u8,
}

/// An open device (`ibv_context`).
pub struct Context {
    v: &'static Verbs,
    ctx: *mut ffi::ibv_context,
    name: String,
}

// SAFETY: libibverbs contexts are thread-safe; the pointer is only freed in Drop.
unsafe impl Send for Context {}
// SAFETY: as above; every verbs call on a context may be made from any thread.
unsafe impl Sync for Context {}

impl Context {
    /// Opens the device named `name`.
    pub fn open(name: &str) -> Result<Arc<Context>> {
        let list = DeviceList::get()?;
        let dev = list.find(name).ok_or_else(|| {
            Error::new(
                Status::NoRdmaDevice,
                format!(
                    "RDMA device {name} is in sysfs but libibverbs does not list it (libibverbs sees [{}]): install the provider (Debian ibverbs-providers)",
                    list.names().join(", ")
                ),
            )
        })?;
        // SAFETY: dev is a valid device from the live list; the context outlives the list.
        let ctx = unsafe { (list.v.open_device)(dev) };
        if ctx.is_null() {
            return Err(Error::new(
                Status::NoRdmaDevice,
                format!(
                    "ibv_open_device({name}) failed: {} (permissions on /dev/infiniband/uverbs*?)",
                    errno()
                ),
            ));
        }
        Ok(Arc::new(Context {
            v: list.v,
            ctx,
            name: name.to_string(),
        }))
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ibv_query_port`.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        // SAFETY: ibv_port_attr is plain data; all-zero is a valid value.
        let mut a: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the exported symbol fills the (larger, zeroed) full ibv_port_attr
        // through the provider's query_port; ctx is open.
        let rc = unsafe { (self.v.query_port)(self.ctx, port, &mut a) };
        if rc != 0 {
            return Err(verbs_err(
                "ibv_query_port",
                &format!("{} port {port}", self.name),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(PortAttr {
            state: a.state,
            active_mtu: Mtu::from_ibv(a.active_mtu),
            max_mtu: Mtu::from_ibv(a.max_mtu),
            lid: a.lid,
            link_layer: LinkLayer::from_u8(a.link_layer).unwrap_or(LinkLayer::InfiniBand),
            gid_tbl_len: a.gid_tbl_len,
            max_msg_sz: a.max_msg_sz,
        })
    }

    /// `ibv_query_gid`.
    pub fn query_gid(&self, port: u8, index: u8) -> Result<Gid> {
        // SAFETY: ibv_gid is a 16-byte union of plain data.
        let mut g: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is open and g is a valid out-pointer.
        let rc = unsafe { (self.v.query_gid)(self.ctx, port, index as i32, &mut g) };
        if rc != 0 {
            return Err(Error::new(
                Status::RdmaHandshake,
                format!("RDMA handshake: field `gid_index`: ibv_query_gid({} port {port} index {index}) failed: {}", self.name, errno()),
            ));
        }
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        Ok(Gid(unsafe { g.raw }))
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> Result<DeviceAttr> {
        // SAFETY: plain data; zero is valid.
        let mut a: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is open; a is a valid out-pointer.
        let rc = unsafe { (self.v.query_device)(self.ctx, &mut a) };
        if rc != 0 {
            return Err(verbs_err(
                "ibv_query_device",
                &self.name,
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(DeviceAttr {
            max_qp_wr: a.max_qp_wr,
            max_qp_rd_atom: a.max_qp_rd_atom,
            max_cqe: a.max_cqe,
            max_mr_size: a.max_mr_size,
            phys_port_cnt: a.phys_port_cnt,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: ctx came from ibv_open_device and every child holds an Arc to us,
        // so none is alive any more.
        let rc = unsafe { (self.v.close_device)(self.ctx) };
        if rc != 0 {
            log::warn!("rdma: ibv_close_device({}) failed: {}", self.name, errno());
        }
    }
}

/// Fills each device's `verbs_error` (why libibverbs cannot open it) and, where it
/// can, each port's active MTU.
pub(crate) fn enrich(devs: &mut [RdmaDevice]) {
    let list = match DeviceList::get() {
        Ok(l) => l,
        Err(e) => {
            for d in devs.iter_mut() {
                d.verbs_error = Some(e.detail().to_string());
            }
            return;
        }
    };
    let names = list.names();
    drop(list);
    for d in devs.iter_mut() {
        if !names.contains(&d.name) {
            d.verbs_error = Some(format!(
                "libibverbs does not list {} (it sees [{}]): install the provider (Debian ibverbs-providers)",
                d.name,
                names.join(", ")
            ));
            continue;
        }
        match Context::open(&d.name) {
            Ok(ctx) => {
                for p in d.ports.iter_mut() {
                    match ctx.query_port(p.num) {
                        Ok(a) => {
                            if a.active_mtu.is_some() {
                                p.active_mtu = a.active_mtu;
                            }
                            p.lid = a.lid;
                        }
                        Err(e) => d.verbs_error = Some(e.detail().to_string()),
                    }
                }
            }
            Err(e) => d.verbs_error = Some(e.detail().to_string()),
        }
    }
}

/// A protection domain.
pub struct Pd {
    pd: *mut ffi::ibv_pd,
    ctx: Arc<Context>,
}

// SAFETY: PDs may be used from any thread; freed only in Drop.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    /// `ibv_alloc_pd`.
    pub fn alloc(ctx: &Arc<Context>) -> Result<Arc<Pd>> {
        // SAFETY: ctx is open.
        let pd = unsafe { (ctx.v.alloc_pd)(ctx.ctx) };
        if pd.is_null() {
            return Err(verbs_err("ibv_alloc_pd", &ctx.name, errno()));
        }
        Ok(Arc::new(Pd {
            pd,
            ctx: ctx.clone(),
        }))
    }

    /// The device this PD belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: pd came from ibv_alloc_pd; MRs and QPs hold Arcs to it, so none is alive.
        let rc = unsafe { (self.ctx.v.dealloc_pd)(self.pd) };
        if rc != 0 {
            log::warn!(
                "rdma: ibv_dealloc_pd on {} failed: errno {rc}",
                self.ctx.name
            );
        }
    }
}

/// Access flags of registered regions: local write, remote write, remote
/// read, and relaxed ordering (`IBV_ACCESS_RELAXED_ORDERING`, an optional
/// flag: rdma-core drops it where the kernel or NIC lacks it, and a
/// registration that still refuses it is retried without; it lets PCIe
/// writes to GPU memory complete out of order, which GPUDirect write
/// bandwidth needs on some platforms, as NCCL does).
pub fn region_access() -> i32 {
    (ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ | ACCESS_RELAXED_ORDERING) as i32
}

/// `access` without relaxed ordering, when it asked for it.
fn without_relaxed_ordering(access: i32) -> Option<i32> {
    let ro = ACCESS_RELAXED_ORDERING as i32;
    (access & ro != 0).then_some(access & !ro)
}

/// A registered memory region.
pub struct Mr {
    mr: *mut ffi::ibv_mr,
    pd: Arc<Pd>,
    /// Start address (host or GPU VA).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

// SAFETY: an MR is immutable after registration; deregistered only in Drop.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    fn wrap(mr: *mut ffi::ibv_mr, pd: &Arc<Pd>, addr: u64, len: u64) -> Mr {
        // SAFETY: mr is a non-NULL MR just returned by a registration call.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Mr {
            mr,
            pd: pd.clone(),
            addr,
            len,
            lkey,
            rkey,
        }
    }

    /// `ibv_reg_mr` on `[addr, addr+len)`: host memory, or GPU memory where the
    /// nvidia-peermem module makes device pointers registrable.
    ///
    /// # Safety
    /// The range must stay mapped (and not be freed) while the MR lives.
    pub unsafe fn register(pd: &Arc<Pd>, addr: u64, len: u64, access: i32) -> Result<Mr> {
        // SAFETY: the caller guarantees the range; pd is live.
        let mut mr =
            unsafe { (pd.ctx.v.reg_mr)(pd.pd, addr as *mut libc::c_void, len as usize, access) };
        if mr.is_null() {
            if let Some(plain) = without_relaxed_ordering(access) {
                // An older libibverbs that passes the optional flag to a kernel without it.
                // SAFETY: as above.
                mr = unsafe {
                    (pd.ctx.v.reg_mr)(pd.pd, addr as *mut libc::c_void, len as usize, plain)
                };
            }
        }
        if mr.is_null() {
            return Err(verbs_err(
                "ibv_reg_mr",
                &format!("{:#x}+{len} on {}", addr, pd.ctx.name),
                errno(),
            ));
        }
        Ok(Mr::wrap(mr, pd, addr, len))
    }

    /// `ibv_reg_dmabuf_mr`: registers `len` bytes at `offset` in the dma-buf `fd`
    /// (GPU memory exported by `cuMemGetHandleForAddressRange`), addressed by the
    /// peer as `iova`.
    ///
    /// # Safety
    /// `fd` must be a dma-buf whose memory stays allocated while the MR lives.
    pub unsafe fn register_dmabuf(
        pd: &Arc<Pd>,
        fd: i32,
        offset: u64,
        len: u64,
        iova: u64,
        access: i32,
    ) -> Result<Mr> {
        let Some(reg_dmabuf_mr) = pd.ctx.v.reg_dmabuf_mr else {
            return Err(Error::new(
                Status::NoGpuDirect,
                format!(
                    "{} has no ibv_reg_dmabuf_mr (rdma-core 34 or later registers dma-bufs)",
                    pd.ctx.v.name
                ),
            ));
        };
        // SAFETY: the caller guarantees the fd; pd is live.
        let mut mr = unsafe { reg_dmabuf_mr(pd.pd, offset, len as usize, iova, fd, access) };
        if mr.is_null() {
            if let Some(plain) = without_relaxed_ordering(access) {
                // SAFETY: as above.
                mr = unsafe { reg_dmabuf_mr(pd.pd, offset, len as usize, iova, fd, plain) };
            }
        }
        if mr.is_null() {
            return Err(verbs_err(
                "ibv_reg_dmabuf_mr",
                &format!(
                    "dma-buf fd {fd} offset {offset} len {len} on {}",
                    pd.ctx.name
                ),
                errno(),
            ));
        }
        Ok(Mr::wrap(mr, pd, iova, len))
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: mr came from a registration call and is deregistered once.
        let rc = unsafe { (self.pd.ctx.v.dereg_mr)(self.mr) };
        if rc != 0 {
            log::warn!(
                "rdma: ibv_dereg_mr({:#x}+{}) on {} failed: errno {rc}",
                self.addr,
                self.len,
                self.pd.ctx.name
            );
        }
    }
}

/// A completion queue.
pub struct Cq {
    cq: *mut ffi::ibv_cq,
    ctx: Arc<Context>,
}

// SAFETY: CQs may be polled from any thread (one poller at a time, which the
// endpoint guarantees); freed only in Drop.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// `ibv_create_cq` with at least `depth` entries.
    pub fn create(ctx: &Arc<Context>, depth: i32) -> Result<Arc<Cq>> {
        // SAFETY: ctx is open; no channel, vector 0.
        let cq = unsafe {
            (ctx.v.create_cq)(
                ctx.ctx,
                depth,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(verbs_err(
                "ibv_create_cq",
                &format!("{} ({depth} entries)", ctx.name),
                errno(),
            ));
        }
        Ok(Arc::new(Cq {
            cq,
            ctx: ctx.clone(),
        }))
    }

    /// Polls up to `out.len()` completions; returns how many were written.
    pub fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize> {
        // SAFETY: ibv_wc is plain data (integers); zero is valid.
        let mut raw: [ffi::ibv_wc; 32] = unsafe { std::mem::zeroed() };
        let n = max.min(raw.len()) as i32;
        // SAFETY: cq is live and belongs to ctx; the ops table is the provider's.
        let poll = unsafe { (*(*self.cq).context).ops.poll_cq };
        let Some(poll) = poll else {
            return Err(Error::new(
                Status::Rdma,
                format!("{}: provider has no poll_cq", self.ctx.name),
            ));
        };
        // SAFETY: raw has room for n entries; cq is live.
        let got = unsafe { poll(self.cq, n, raw.as_mut_ptr()) };
        if got < 0 {
            return Err(verbs_err("ibv_poll_cq", &self.ctx.name, got));
        }
        for w in &raw[..got as usize] {
            let ok = w.status == ffi::IBV_WC_SUCCESS;
            out.push(WorkCompletion {
                wr_id: w.wr_id,
                status: w.status,
                vendor_err: if ok { 0 } else { w.vendor_err },
                opcode: w.opcode,
                imm: (ok && w.wc_flags & ffi::IBV_WC_WITH_IMM != 0)
                    .then_some(u32::from_be(w.imm_data)),
            });
        }
        Ok(got as usize)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: cq came from ibv_create_cq; QPs using it hold Arcs, so none is alive.
        let rc = unsafe { (self.ctx.v.destroy_cq)(self.cq) };
        if rc != 0 {
            log::warn!(
                "rdma: ibv_destroy_cq on {} failed: errno {rc}",
                self.ctx.name
            );
        }
    }
}

/// An RC queue pair.
pub struct Qp {
    qp: *mut ffi::ibv_qp,
    pd: Arc<Pd>,
    _cq: Arc<Cq>,
    name: String,
}

// SAFETY: posting to a QP is thread-safe in libibverbs; freed only in Drop.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    /// `ibv_create_qp` (RC, one SGE, send and receive completions on `cq`).
    pub fn create(pd: &Arc<Pd>, cq: &Arc<Cq>, max_send_wr: u32, max_recv_wr: u32) -> Result<Qp> {
        // SAFETY: plain data; zero is valid.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq;
        init.recv_cq = cq.cq;
        init.qp_type = ffi::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = max_send_wr;
        init.cap.max_recv_wr = max_recv_wr;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: pd and cq are live; init is fully initialised.
        let qp = unsafe { (pd.ctx.v.create_qp)(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(verbs_err(
                "ibv_create_qp",
                &format!(
                    "RC QP on {} (send {max_send_wr}, recv {max_recv_wr})",
                    pd.ctx.name
                ),
                errno(),
            ));
        }
        Ok(Qp {
            qp,
            pd: pd.clone(),
            _cq: cq.clone(),
            name: pd.ctx.name.clone(),
        })
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: qp is live.
        unsafe { (*self.qp).qp_num }
    }

    /// `ibv_modify_qp` with the attributes computed by [`super::qp`]; the error lists
    /// every value that was tried.
    pub fn modify(&self, a: &QpAttrs) -> Result<()> {
        // SAFETY: plain data; zero is valid.
        let mut r: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        r.qp_state = a.state as u32;
        r.pkey_index = a.pkey_index;
        r.port_num = a.port_num;
        r.qp_access_flags = a.access;
        if let Some(m) = a.path_mtu {
            r.path_mtu = m.to_ibv();
        }
        r.dest_qp_num = a.dest_qpn;
        r.rq_psn = a.rq_psn;
        r.max_dest_rd_atomic = a.max_dest_rd_atomic;
        r.min_rnr_timer = a.min_rnr_timer;
        if let Some(av) = a.av {
            r.ah_attr.dlid = av.dlid;
            r.ah_attr.sl = av.sl;
            r.ah_attr.port_num = av.port_num;
            r.ah_attr.is_global = av.is_global as u8;
            r.ah_attr.grh.dgid.raw = av.dgid.0;
            r.ah_attr.grh.sgid_index = av.sgid_index;
            r.ah_attr.grh.hop_limit = av.hop_limit;
            r.ah_attr.grh.traffic_class = av.traffic_class;
        }
        r.sq_psn = a.sq_psn;
        r.timeout = a.timeout;
        r.retry_cnt = a.retry_cnt;
        r.rnr_retry = a.rnr_retry;
        r.max_rd_atomic = a.max_rd_atomic;
        // SAFETY: qp is live; r is fully initialised.
        let rc = unsafe { (self.pd.ctx.v.modify_qp)(self.qp, &mut r, a.mask as i32) };
        if rc != 0 {
            return Err(Error::new(
                Status::RdmaHandshake,
                format!(
                    "RDMA handshake: ibv_modify_qp to {:?} on {} QP {:#x} failed: {} (values tried: {})",
                    a.state,
                    self.name,
                    self.qpn(),
                    std::io::Error::from_raw_os_error(rc),
                    a.describe()
                ),
            ));
        }
        Ok(())
    }

    /// Posts `wrs` as one linked list. On failure returns how many were accepted
    /// before the refused one, with the error.
    pub fn post_send(&self, wrs: &[WorkRequest]) -> std::result::Result<(), (usize, Error)> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut list = SendList::new(wrs);
        let base = list.head();
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: qp is live; the ops table is the provider's.
        let post = unsafe { (*(*self.qp).context).ops.post_send };
        let Some(post) = post else {
            return Err((
                0,
                Error::new(
                    Status::Rdma,
                    format!("{}: provider has no post_send", self.name),
                ),
            ));
        };
        // SAFETY: `list` (WRs and SGEs) outlives the call; the chain ends with NULL.
        let rc = unsafe { post(self.qp, base, &mut bad) };
        if rc != 0 {
            let accepted = if bad.is_null() {
                0
            } else {
                // SAFETY: bad points into `list` (the provider returns the refused WR).
                (unsafe { bad.offset_from(base) }).max(0) as usize
            };
            return Err((
                accepted,
                verbs_err(
                    "ibv_post_send",
                    &self.name,
                    std::io::Error::from_raw_os_error(rc),
                ),
            ));
        }
        Ok(())
    }

    /// Posts `n` zero-length receives (each consumed by one incoming WRITE_WITH_IMM).
    pub fn post_recvs(&self, n: usize, wr_id: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let mut list: Vec<ffi::ibv_recv_wr> = (0..n)
            .map(|_| ffi::ibv_recv_wr {
                wr_id,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: 0,
            })
            .collect();
        let base = list.as_mut_ptr();
        for i in 0..n.saturating_sub(1) {
            // SAFETY: i + 1 < n: both are inside the vector, untouched until the post returns.
            unsafe { (*base.add(i)).next = base.add(i + 1) };
        }
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: qp is live; the ops table is the provider's.
        let post = unsafe { (*(*self.qp).context).ops.post_recv };
        let Some(post) = post else {
            return Err(Error::new(
                Status::Rdma,
                format!("{}: provider has no post_recv", self.name),
            ));
        };
        // SAFETY: list outlives the call; the chain ends with NULL.
        let rc = unsafe { post(self.qp, base, &mut bad) };
        if rc != 0 {
            return Err(verbs_err(
                "ibv_post_recv",
                &self.name,
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }
}

/// Work requests converted to a linked `ibv_send_wr` list with one SGE each
/// (none for a zero-length WRITE_WITH_IMM). The pointers point into the two
/// heap buffers, which never move while the list lives.
pub struct SendList {
    sges: Vec<ffi::ibv_sge>,
    wrs: Vec<ffi::ibv_send_wr>,
}

impl SendList {
    /// Converts `wrs` (in order) into a linked list.
    pub fn new(wrs: &[WorkRequest]) -> SendList {
        let mut sges: Vec<ffi::ibv_sge> = wrs
            .iter()
            .map(|w| ffi::ibv_sge {
                addr: w.local_addr,
                length: w.len,
                lkey: w.lkey,
            })
            .collect();
        let mut list: Vec<ffi::ibv_send_wr> = wrs
            .iter()
            .map(|w| {
                // SAFETY: ibv_send_wr is plain data and pointers; zero is valid.
                let mut x: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
                x.wr_id = w.wr_id;
                x.opcode = match w.opcode {
                    Opcode::Write => ffi::IBV_WR_RDMA_WRITE,
                    Opcode::WriteWithImm => ffi::IBV_WR_RDMA_WRITE_WITH_IMM,
                    Opcode::Read => ffi::IBV_WR_RDMA_READ,
                };
                x.send_flags = if w.signaled {
                    ffi::IBV_SEND_SIGNALED
                } else {
                    0
                };
                if let Some(imm) = w.imm {
                    x.imm_data = imm.to_be();
                }
                x.wr.rdma.remote_addr = w.remote_addr;
                x.wr.rdma.rkey = w.rkey;
                x
            })
            .collect();
        // Link the list only through raw pointers taken after every safe access, so
        // no later reference invalidates them.
        let n = list.len();
        let base = list.as_mut_ptr();
        let sge_base = sges.as_mut_ptr();
        for (i, w) in wrs.iter().enumerate() {
            // SAFETY: i < n, so base + i and sge_base + i are inside their vectors, which
            // are not touched again until the post below returns.
            unsafe {
                let x = base.add(i);
                if w.len > 0 {
                    (*x).sg_list = sge_base.add(i);
                    (*x).num_sge = 1;
                }
                (*x).next = if i + 1 < n {
                    base.add(i + 1)
                } else {
                    std::ptr::null_mut()
                };
            }
        }
        SendList { sges, wrs: list }
    }

    /// The first WR of the chain (NULL when empty).
    pub fn head(&mut self) -> *mut ffi::ibv_send_wr {
        if self.wrs.is_empty() {
            std::ptr::null_mut()
        } else {
            self.wrs.as_mut_ptr()
        }
    }

    /// The converted WRs, in order.
    pub fn wrs(&self) -> &[ffi::ibv_send_wr] {
        &self.wrs
    }

    /// Number of WRs.
    pub fn len(&self) -> usize {
        self.wrs.len()
    }

    /// True when there is no WR.
    pub fn is_empty(&self) -> bool {
        self.wrs.is_empty()
    }

    /// The SGE buffer (for checks).
    pub fn sges(&self) -> &[ffi::ibv_sge] {
        &self.sges
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: qp came from ibv_create_qp and is destroyed once.
        let rc = unsafe { (self.pd.ctx.v.destroy_qp)(self.qp) };
        if rc != 0 {
            log::warn!("rdma: ibv_destroy_qp on {} failed: errno {rc}", self.name);
        }
    }
}

/// Exports `[dptr, dptr+len)` of GPU memory as a dma-buf fd
/// (`cuMemGetHandleForAddressRange`), page-aligned; returns (fd, offset of `dptr`
/// in it, aligned length). The caller closes the fd.
#[cfg(feature = "cuda")]
pub fn gpu_dmabuf(dptr: u64, len: u64) -> Result<(i32, u64, u64)> {
    use cudarc::driver::sys as cu;
    // SAFETY: only tries to dlopen libcuda and reports the result.
    if !unsafe { cu::is_culib_present() } {
        return Err(Error::new(
            Status::NoCudaDriver,
            "no CUDA driver: cannot export GPU memory as a dma-buf",
        ));
    }
    // SAFETY: sysconf has no preconditions.
    let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as u64;
    let start = dptr & !(page - 1);
    let end = dptr
        .checked_add(len)
        .map(|e| e.div_ceil(page) * page)
        .ok_or_else(|| Error::invalid("GPU range wraps the address space"))?;
    let r = std::panic::catch_unwind(|| {
        let mut fd_local: i32 = -1;
        // SAFETY: fd_local is a valid out-pointer for an int fd; the range is the caller's
        // device allocation (the driver validates it and fails otherwise).
        let rc = unsafe {
            cu::cuMemGetHandleForAddressRange(
                &mut fd_local as *mut i32 as *mut std::ffi::c_void,
                start,
                (end - start) as usize,
                cu::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        (rc, fd_local)
    });
    match r {
        Ok((cu::CUresult::CUDA_SUCCESS, fd)) => Ok((fd, dptr - start, end - start)),
        Ok((rc, _)) => {
            Err(Error::new(
                Status::Cuda,
                format!("cuMemGetHandleForAddressRange({start:#x}+{}) failed: {rc:?} (dma-buf needs CUDA 11.7+, an open kernel module and a current context)", end - start),
            ))
        }
        Err(_) => Err(Error::new(Status::NoCudaDriver, "libcuda lacks cuMemGetHandleForAddressRange")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::wr::{build_batch, BatchParams, CompletionRecord, Direction, Transfer};
    use super::*;

    #[test]
    fn region_access_asks_for_relaxed_ordering_and_can_drop_it() {
        assert_eq!(
            region_access() as u32,
            ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ | ACCESS_RELAXED_ORDERING
        );
        assert_eq!(
            without_relaxed_ordering(region_access()),
            Some((ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ) as i32)
        );
        assert_eq!(without_relaxed_ordering(1), None);
    }

    #[test]
    fn send_list_links_wrs_with_opcodes_flags_and_immediate() {
        let t = |l: u64, r: u64, len: u64| Transfer {
            local_addr: l,
            lkey: 5,
            remote_addr: r,
            rkey: 6,
            len,
        };
        let p = BatchParams {
            max_msg: 1000,
            signal_every: 2,
            sq_depth: 16,
        };
        let wrs = build_batch(
            9,
            Direction::Write,
            &[t(0x1000, 0x8000, 2500)],
            CompletionRecord::Immediate(0x0102_0304),
            &p,
        )
        .unwrap();
        let mut list = SendList::new(&wrs);
        assert_eq!(list.len(), 3);
        // Walk the chain from the head.
        let mut cur = list.head();
        let mut seen = Vec::new();
        while !cur.is_null() && seen.len() < 10 {
            // SAFETY: every link points into `list`, which is alive.
            let w = unsafe { &*cur };
            seen.push(*w);
            cur = w.next;
        }
        assert_eq!(seen.len(), 3, "three linked WRs ending in NULL");
        for (i, w) in seen.iter().enumerate() {
            assert_eq!(w.wr_id, wrs[i].wr_id);
            assert_eq!(w.num_sge, 1);
            // SAFETY: sg_list points into the list's SGE buffer.
            let sge = unsafe { *w.sg_list };
            assert_eq!(
                (sge.addr, sge.length, sge.lkey),
                (0x1000 + 1000 * i as u64, wrs[i].len, 5)
            );
            // SAFETY: the rdma member is the one written for RDMA opcodes.
            let (ra, rk) = unsafe { (w.wr.rdma.remote_addr, w.wr.rdma.rkey) };
            assert_eq!((ra, rk), (0x8000 + 1000 * i as u64, 6));
        }
        let sig = ffi::IBV_SEND_SIGNALED;
        assert_eq!(seen[0].send_flags & sig, 0);
        assert_eq!(seen[1].send_flags & sig, sig);
        assert_eq!(seen[2].send_flags & sig, sig);
        assert_eq!(seen[0].opcode, ffi::IBV_WR_RDMA_WRITE);
        assert_eq!(seen[2].opcode, ffi::IBV_WR_RDMA_WRITE_WITH_IMM);
        // Immediate data is big-endian on the wire.
        let imm = seen[2].imm_data;
        assert_eq!(imm, 0x0102_0304u32.to_be());
        assert_eq!(list.sges().len(), 3);

        // A zero-length immediate-only record carries no SGE; reads use RDMA_READ.
        let w0 = build_batch(1, Direction::Write, &[], CompletionRecord::Immediate(1), &p).unwrap();
        let l0 = SendList::new(&w0);
        assert_eq!(l0.wrs()[0].num_sge, 0);
        assert!(l0.wrs()[0].sg_list.is_null());
        let r = build_batch(
            2,
            Direction::Read,
            &[t(0, 0, 10)],
            CompletionRecord::None,
            &p,
        )
        .unwrap();
        assert_eq!(SendList::new(&r).wrs()[0].opcode, ffi::IBV_WR_RDMA_READ);
        let mut empty = SendList::new(&[]);
        assert!(empty.is_empty() && empty.head().is_null());
    }

    #[test]
    fn device_list_without_rdma_is_typed() {
        match DeviceList::get() {
            Ok(l) => {
                let _ = l.names();
            }
            Err(e) => {
                assert_eq!(e.status(), Status::NoRdmaDevice);
                assert!(e.detail().contains("ibv_get_device_list"), "{e}");
            }
        }
    }
}
