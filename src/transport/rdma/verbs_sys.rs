//! The raw libibverbs interface (feature `rdma`): `repr(C)` copies of the
//! `<infiniband/verbs.h>` structs pdxfer passes to the library, and the
//! library itself opened at run time with `dlopen`, so `libpdxfer.so` has no
//! link-time dependency on rdma-core and loads (tcp and cma working) on a host
//! without it.
//!
//! The library is `libibverbs.so.1` (the soname of every rdma-core since
//! v13), or the one file named by `$PDXFER_IBVERBS`. It is opened once per
//! process; a missing library, or one without an entry point pdxfer needs,
//! is [`Status::NoRdmaDevice`] naming what was tried, never a panic.
//!
//! Layout: every struct here is checked field by field (`offsetof`, `sizeof`)
//! and every constant by value against the installed verbs.h by the test in
//! `verbs_layout_check.rs`. Only the fields pdxfer reads or writes are named;
//! the rest of a struct is kept as padding of the right size and alignment
//! (the library and its providers write whole structs: `ibv_port_attr`,
//! `ibv_device_attr` and `ibv_wc` are complete). `ibv_post_send`,
//! `ibv_post_recv` and `ibv_poll_cq` are `static inline` in verbs.h and not
//! exported: they are called through the context's `ops` table, as verbs.h
//! does.

use crate::error::{Error, Result, Status};
use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

/// `struct ibv_device` (opaque).
#[repr(C)]
pub struct ibv_device {
    _opaque: [u8; 0],
}
/// `struct ibv_pd` (opaque: only passed back to the library).
#[repr(C)]
pub struct ibv_pd {
    _opaque: [u8; 0],
}
/// `struct ibv_comp_channel` (opaque).
#[repr(C)]
pub struct ibv_comp_channel {
    _opaque: [u8; 0],
}
/// `struct ibv_srq` (opaque).
#[repr(C)]
pub struct ibv_srq {
    _opaque: [u8; 0],
}

/// `ibv_context_ops.poll_cq`.
pub type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
/// `ibv_context_ops.req_notify_cq`.
pub type ReqNotifyCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
/// `ibv_context_ops.post_send`.
pub type PostSendFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
/// `ibv_context_ops.post_recv`.
pub type PostRecvFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops`: 32 function pointers, of which verbs.h's inline
/// functions call these four.
#[repr(C)]
pub struct ibv_context_ops {
    _compat_query_device_to_dealloc_mw: [*mut c_void; 11],
    /// `ibv_poll_cq`.
    pub poll_cq: Option<PollCqFn>,
    /// `ibv_req_notify_cq`.
    pub req_notify_cq: Option<ReqNotifyCqFn>,
    _compat_cq_event_to_destroy_qp: [*mut c_void; 12],
    /// `ibv_post_send`.
    pub post_send: Option<PostSendFn>,
    /// `ibv_post_recv`.
    pub post_recv: Option<PostRecvFn>,
    _compat_create_ah_to_async_event: [*mut c_void; 5],
}

/// `struct ibv_context`.
#[repr(C)]
pub struct ibv_context {
    /// The device.
    pub device: *mut ibv_device,
    /// The provider's entry points.
    pub ops: ibv_context_ops,
    /// Command file descriptor.
    pub cmd_fd: c_int,
    /// Asynchronous event file descriptor.
    pub async_fd: c_int,
    /// Completion vectors.
    pub num_comp_vectors: c_int,
    mutex: libc::pthread_mutex_t,
    abi_compat: *mut c_void,
}

/// `struct ibv_cq` (the leading fields; the library allocates it).
#[repr(C)]
pub struct ibv_cq {
    /// The context it belongs to.
    pub context: *mut ibv_context,
}

/// `struct ibv_qp` (the fields up to `qp_num`; the library allocates it).
#[repr(C)]
pub struct ibv_qp {
    /// The context it belongs to.
    pub context: *mut ibv_context,
    qp_context: *mut c_void,
    pd: *mut ibv_pd,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    srq: *mut ibv_srq,
    handle: u32,
    /// The QP number.
    pub qp_num: u32,
}

/// `struct ibv_mr` (allocated by the library).
#[repr(C)]
pub struct ibv_mr {
    /// The context.
    pub context: *mut ibv_context,
    /// The protection domain.
    pub pd: *mut ibv_pd,
    /// Start address.
    pub addr: *mut c_void,
    /// Length.
    pub length: usize,
    /// Kernel handle.
    pub handle: u32,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

/// `union ibv_gid`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_gid {
    /// The 16 bytes.
    pub raw: [u8; 16],
    /// Subnet prefix and interface id (big-endian).
    pub global: [u64; 2],
}

/// `struct ibv_device_attr` (complete: `ibv_query_device` writes all of it).
#[repr(C)]
pub struct ibv_device_attr {
    fw_ver: [c_char; 64],
    node_guid: u64,
    sys_image_guid: u64,
    /// Largest MR.
    pub max_mr_size: u64,
    page_size_cap: u64,
    vendor_id: u32,
    vendor_part_id: u32,
    hw_ver: u32,
    max_qp: c_int,
    /// Largest send/receive queue.
    pub max_qp_wr: c_int,
    device_cap_flags: u32,
    max_sge: c_int,
    max_sge_rd: c_int,
    max_cq: c_int,
    /// Largest CQ.
    pub max_cqe: c_int,
    max_mr: c_int,
    max_pd: c_int,
    /// Largest outstanding RDMA READs per QP.
    pub max_qp_rd_atom: c_int,
    // max_ee_rd_atom .. max_srq_sge: 19 ints (atomic_cap is an enum).
    _ints: [c_int; 19],
    pub(super) max_pkeys: u16,
    local_ca_ack_delay: u8,
    /// Number of ports.
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr` (complete: providers write all of it).
#[repr(C)]
pub struct ibv_port_attr {
    /// `enum ibv_port_state`.
    pub state: u32,
    /// `enum ibv_mtu`.
    pub max_mtu: u32,
    /// `enum ibv_mtu`.
    pub active_mtu: u32,
    /// GID table length.
    pub gid_tbl_len: c_int,
    port_cap_flags: u32,
    /// Largest message.
    pub max_msg_sz: u32,
    bad_pkey_cntr: u32,
    qkey_viol_cntr: u32,
    pkey_tbl_len: u16,
    /// LID.
    pub lid: u16,
    sm_lid: u16,
    lmc: u8,
    max_vl_num: u8,
    sm_sl: u8,
    subnet_timeout: u8,
    init_type_reply: u8,
    active_width: u8,
    active_speed: u8,
    phys_state: u8,
    /// `IBV_LINK_LAYER_*`.
    pub link_layer: u8,
    flags: u8,
    port_cap_flags2: u16,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_cap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send WR.
    pub max_send_sge: u32,
    /// SGEs per receive WR.
    pub max_recv_sge: u32,
    /// Inline data bytes.
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct ibv_qp_init_attr {
    /// User context.
    pub qp_context: *mut c_void,
    /// Send CQ.
    pub send_cq: *mut ibv_cq,
    /// Receive CQ.
    pub recv_cq: *mut ibv_cq,
    /// Shared receive queue.
    pub srq: *mut ibv_srq,
    /// Queue sizes.
    pub cap: ibv_qp_cap,
    /// `enum ibv_qp_type`.
    pub qp_type: u32,
    /// Signal every send WR.
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_global_route {
    /// Destination GID.
    pub dgid: ibv_gid,
    /// Flow label.
    pub flow_label: u32,
    /// Source GID index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ah_attr {
    /// Global route.
    pub grh: ibv_global_route,
    /// Destination LID.
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub src_path_bits: u8,
    /// Static rate.
    pub static_rate: u8,
    /// GRH present.
    pub is_global: u8,
    /// Port.
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
pub struct ibv_qp_attr {
    /// `enum ibv_qp_state`.
    pub qp_state: u32,
    /// `enum ibv_qp_state`.
    pub cur_qp_state: u32,
    /// `enum ibv_mtu`.
    pub path_mtu: u32,
    /// `enum ibv_mig_state`.
    pub path_mig_state: u32,
    /// Q_Key.
    pub qkey: u32,
    /// Receive PSN.
    pub rq_psn: u32,
    /// Send PSN.
    pub sq_psn: u32,
    /// Destination QP.
    pub dest_qp_num: u32,
    /// `IBV_ACCESS_*`.
    pub qp_access_flags: u32,
    /// Queue sizes.
    pub cap: ibv_qp_cap,
    /// Primary path.
    pub ah_attr: ibv_ah_attr,
    /// Alternate path.
    pub alt_ah_attr: ibv_ah_attr,
    /// P_Key index.
    pub pkey_index: u16,
    /// Alternate P_Key index.
    pub alt_pkey_index: u16,
    /// SQD async notification.
    pub en_sqd_async_notify: u8,
    /// SQ draining.
    pub sq_draining: u8,
    /// Outstanding RDMA READs as initiator.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READs as target.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer.
    pub min_rnr_timer: u8,
    /// Port.
    pub port_num: u8,
    /// Local ACK timeout.
    pub timeout: u8,
    /// Retry count.
    pub retry_cnt: u8,
    /// RNR retry count.
    pub rnr_retry: u8,
    /// Alternate port.
    pub alt_port_num: u8,
    /// Alternate timeout.
    pub alt_timeout: u8,
    /// Rate limit.
    pub rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ibv_sge {
    /// Address.
    pub addr: u64,
    /// Length.
    pub length: u32,
    /// Local key.
    pub lkey: u32,
}

/// `ibv_send_wr.wr.rdma`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_rdma_wr {
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
}

/// `ibv_send_wr.wr` (the `rdma` member; `atomic`, the largest, sets the size).
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    /// RDMA WRITE/READ.
    pub rdma: ibv_rdma_wr,
    atomic: [u64; 4],
}

/// `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// Next WR (NULL ends the list).
    pub next: *mut ibv_send_wr,
    /// Scatter/gather list.
    pub sg_list: *mut ibv_sge,
    /// Entries in `sg_list`.
    pub num_sge: c_int,
    /// `enum ibv_wr_opcode`.
    pub opcode: u32,
    /// `IBV_SEND_*`.
    pub send_flags: u32,
    /// The anonymous `imm_data` / `invalidate_rkey` union: immediate data
    /// in network byte order.
    pub imm_data: u32,
    /// Opcode-specific fields.
    pub wr: ibv_send_wr_wr,
    /// `qp_type.xrc.remote_srqn`.
    pub remote_srqn: u32,
    // The anonymous bind_mw / tso union (48 bytes, 8-aligned).
    _bind_mw_tso: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct ibv_recv_wr {
    /// Caller's id.
    pub wr_id: u64,
    /// Next WR.
    pub next: *mut ibv_recv_wr,
    /// Scatter/gather list.
    pub sg_list: *mut ibv_sge,
    /// Entries in `sg_list`.
    pub num_sge: c_int,
}

/// `struct ibv_wc` (complete: `poll_cq` writes whole entries).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wc {
    /// The WR's id.
    pub wr_id: u64,
    /// `enum ibv_wc_status`.
    pub status: u32,
    /// `enum ibv_wc_opcode`.
    pub opcode: u32,
    /// Vendor syndrome.
    pub vendor_err: u32,
    /// Bytes transferred.
    pub byte_len: u32,
    /// Immediate data (network order) when `wc_flags` has [`IBV_WC_WITH_IMM`].
    pub imm_data: u32,
    /// Local QP.
    pub qp_num: u32,
    /// Source QP.
    pub src_qp: u32,
    /// `IBV_WC_*` flags.
    pub wc_flags: u32,
    /// P_Key index.
    pub pkey_index: u16,
    /// Source LID.
    pub slid: u16,
    /// Service level.
    pub sl: u8,
    /// Destination LID path bits.
    pub dlid_path_bits: u8,
}

/// `IBV_QPT_RC`.
pub const IBV_QPT_RC: u32 = 2;
/// `IBV_WR_RDMA_WRITE`.
pub const IBV_WR_RDMA_WRITE: u32 = 0;
/// `IBV_WR_RDMA_WRITE_WITH_IMM`.
pub const IBV_WR_RDMA_WRITE_WITH_IMM: u32 = 1;
/// `IBV_WR_RDMA_READ`.
pub const IBV_WR_RDMA_READ: u32 = 4;
/// `IBV_SEND_SIGNALED`.
pub const IBV_SEND_SIGNALED: u32 = 1 << 1;
/// `IBV_WC_WITH_IMM`.
pub const IBV_WC_WITH_IMM: u32 = 1 << 1;
/// `IBV_WC_SUCCESS`.
pub const IBV_WC_SUCCESS: u32 = 0;
/// `IBV_LINK_LAYER_ETHERNET`.
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

type GetDeviceListFn = unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;
type FreeDeviceListFn = unsafe extern "C" fn(*mut *mut ibv_device);
type GetDeviceNameFn = unsafe extern "C" fn(*mut ibv_device) -> *const c_char;
type OpenDeviceFn = unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
type CloseDeviceFn = unsafe extern "C" fn(*mut ibv_context) -> c_int;
type QueryPortFn = unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
type QueryGidFn = unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
type QueryDeviceFn = unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
type AllocPdFn = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;
type DeallocPdFn = unsafe extern "C" fn(*mut ibv_pd) -> c_int;
type RegMrFn = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
type RegDmabufMrFn =
    unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
type DeregMrFn = unsafe extern "C" fn(*mut ibv_mr) -> c_int;
type CreateCqFn = unsafe extern "C" fn(
    *mut ibv_context,
    c_int,
    *mut c_void,
    *mut ibv_comp_channel,
    c_int,
) -> *mut ibv_cq;
type DestroyCqFn = unsafe extern "C" fn(*mut ibv_cq) -> c_int;
type CreateQpFn = unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
type ModifyQpFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
type DestroyQpFn = unsafe extern "C" fn(*mut ibv_qp) -> c_int;

/// The exported libibverbs entry points pdxfer calls (signatures of verbs.h),
/// resolved from one loaded library that stays loaded for the process.
pub struct Verbs {
    /// What was passed to `dlopen`.
    pub name: String,
    /// The file the loader opened (the soname's target, e.g.
    /// `libibverbs.so.1.14.44.0`), when it can be told.
    pub file: Option<String>,
    /// `ibv_get_device_list`.
    pub get_device_list: GetDeviceListFn,
    /// `ibv_free_device_list`.
    pub free_device_list: FreeDeviceListFn,
    /// `ibv_get_device_name`.
    pub get_device_name: GetDeviceNameFn,
    /// `ibv_open_device`.
    pub open_device: OpenDeviceFn,
    /// `ibv_close_device`.
    pub close_device: CloseDeviceFn,
    /// `ibv_query_port` (the exported symbol; it fills the whole struct
    /// through the provider's `query_port`).
    pub query_port: QueryPortFn,
    /// `ibv_query_gid`.
    pub query_gid: QueryGidFn,
    /// `ibv_query_device`.
    pub query_device: QueryDeviceFn,
    /// `ibv_alloc_pd`.
    pub alloc_pd: AllocPdFn,
    /// `ibv_dealloc_pd`.
    pub dealloc_pd: DeallocPdFn,
    /// `ibv_reg_mr`.
    pub reg_mr: RegMrFn,
    /// `ibv_reg_dmabuf_mr`: rdma-core 34 and later only.
    pub reg_dmabuf_mr: Option<RegDmabufMrFn>,
    /// `ibv_dereg_mr`.
    pub dereg_mr: DeregMrFn,
    /// `ibv_create_cq`.
    pub create_cq: CreateCqFn,
    /// `ibv_destroy_cq`.
    pub destroy_cq: DestroyCqFn,
    /// `ibv_create_qp`.
    pub create_qp: CreateQpFn,
    /// `ibv_modify_qp`.
    pub modify_qp: ModifyQpFn,
    /// `ibv_destroy_qp`.
    pub destroy_qp: DestroyQpFn,
    _lib: libloading::Library,
}

/// The soname pdxfer opens when `$PDXFER_IBVERBS` is unset.
pub const SONAME: &str = "libibverbs.so.1";
/// The environment variable naming the libibverbs file to open instead.
pub const ENV: &str = "PDXFER_IBVERBS";

/// What to pass to `dlopen`: `$PDXFER_IBVERBS` alone when set, else [`SONAME`].
pub fn candidate() -> String {
    std::env::var(ENV)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| SONAME.to_string())
}

impl Verbs {
    /// Opens `name` (a soname on the loader path or a full path) and resolves
    /// every entry point; the error says why not.
    pub fn open(name: &str) -> std::result::Result<Verbs, String> {
        // SAFETY: loading a shared library runs its constructors: rdma-core's
        // (it reads its provider directory), which have no preconditions.
        let lib = unsafe { libloading::Library::new(name) }
            .map_err(|e| format!("{name}: {}", why(&e)))?;
        macro_rules! sym {
            ($s:literal, $t:ty) => {{
                // SAFETY: the symbol is the verbs.h function of this signature.
                unsafe { lib.get::<$t>(concat!($s, "\0").as_bytes()) }.map(|f| *f)
            }};
        }
        macro_rules! need {
            ($s:literal, $t:ty) => {
                sym!($s, $t).map_err(|e| {
                    format!(
                        "{name}: no symbol {} (not a libibverbs of rdma-core): {e}",
                        $s
                    )
                })?
            };
        }
        let get_device_list = need!("ibv_get_device_list", GetDeviceListFn);
        let file = crate::cuda::loaded::file_of(get_device_list as usize);
        Ok(Verbs {
            name: name.to_string(),
            file,
            get_device_list,
            free_device_list: need!("ibv_free_device_list", FreeDeviceListFn),
            get_device_name: need!("ibv_get_device_name", GetDeviceNameFn),
            open_device: need!("ibv_open_device", OpenDeviceFn),
            close_device: need!("ibv_close_device", CloseDeviceFn),
            query_port: need!("ibv_query_port", QueryPortFn),
            query_gid: need!("ibv_query_gid", QueryGidFn),
            query_device: need!("ibv_query_device", QueryDeviceFn),
            alloc_pd: need!("ibv_alloc_pd", AllocPdFn),
            dealloc_pd: need!("ibv_dealloc_pd", DeallocPdFn),
            reg_mr: need!("ibv_reg_mr", RegMrFn),
            reg_dmabuf_mr: sym!("ibv_reg_dmabuf_mr", RegDmabufMrFn).ok(),
            dereg_mr: need!("ibv_dereg_mr", DeregMrFn),
            create_cq: need!("ibv_create_cq", CreateCqFn),
            destroy_cq: need!("ibv_destroy_cq", DestroyCqFn),
            create_qp: need!("ibv_create_qp", CreateQpFn),
            modify_qp: need!("ibv_modify_qp", ModifyQpFn),
            destroy_qp: need!("ibv_destroy_qp", DestroyQpFn),
            _lib: lib,
        })
    }

    /// The rdma-core release of the loaded file, from its versioned name
    /// (`libibverbs.so.1.14.44.0` is rdma-core 44), when it has one.
    pub fn rdma_core_release(&self) -> Option<u32> {
        let f = self.file.as_deref()?;
        let tail = f.rsplit('/').next()?.strip_prefix("libibverbs.so.1.")?;
        tail.split('.').nth(1)?.parse().ok()
    }
}

/// A libloading error with the loader's own words (`dlerror`), which
/// libloading keeps as the error's source.
fn why(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(src) => src.to_string(),
        None => e.to_string(),
    }
}

/// Why no libibverbs loaded, with what was tried and the fix.
fn not_found(tried: &str) -> String {
    format!(
        "libibverbs could not be loaded (tried {tried}): install rdma-core's libibverbs and its providers (Debian/Ubuntu: libibverbs1 ibverbs-providers; RHEL: rdma-core libibverbs), or name the file in ${ENV}"
    )
}

static LOADED: OnceLock<std::result::Result<Verbs, String>> = OnceLock::new();

/// The process's libibverbs, loaded on first use; [`Status::NoRdmaDevice`]
/// naming what was tried when it does not load.
pub fn verbs() -> Result<&'static Verbs> {
    LOADED
        .get_or_init(|| Verbs::open(&candidate()).map_err(|e| not_found(&e)))
        .as_ref()
        .map_err(|e| Error::new(Status::NoRdmaDevice, format!("no RDMA device: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_typed_and_names_what_was_tried() {
        let e = Verbs::open("/nonexistent/libibverbs.so.1")
            .err()
            .expect("nothing loads");
        let msg = not_found(&e);
        assert!(msg.contains("/nonexistent/libibverbs.so.1"), "{msg}");
        assert!(msg.contains("libibverbs1 ibverbs-providers"), "{msg}");
        assert!(msg.contains(ENV), "{msg}");
    }

    #[test]
    fn a_library_without_verbs_symbols_is_refused() {
        let e = Verbs::open("libc.so.6").err().expect("not a libibverbs");
        assert!(e.contains("ibv_get_device_list"), "{e}");
    }

    #[test]
    fn the_system_library_loads_and_reports_its_file() {
        // libibverbs1 is installed on the test machines (scripts/deps.sh).
        let v = Verbs::open(SONAME).expect("libibverbs.so.1 (Debian libibverbs1)");
        let file = v.file.clone().expect("dladdr names the file");
        assert!(file.contains("libibverbs.so.1"), "{file}");
        assert!(v.rdma_core_release().is_some_and(|r| r >= 13), "{file}");
    }
}
