//! Which GPUDirect RDMA route works on this host, found by a real
//! registration of device memory with an RDMA NIC where one exists.
//!
//! libibverbs is `dlopen`ed here (not linked), so this works in binaries
//! built without the `rdma` feature (`examples/gpu_check`). Routes, tried in
//! order on the first RDMA device that opens:
//! 1. dma-buf: export 2 MiB of `cuMemAlloc` memory with
//!    `cuMemGetHandleForAddressRange(DMA_BUF_FD)` and `ibv_reg_dmabuf_mr` it;
//! 2. peermem: `ibv_reg_mr` on the device pointer (works when
//!    `nvidia_peermem` is loaded).
//!
//! Without an RDMA device the answer comes from
//! `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` and `/sys/module/nvidia_peermem`,
//! and says it was not tested by a registration.

use super::driver::{driver_present, guard};
use super::gpudirect::GpuDirectInfo;
use cudarc::driver::{result, sys, CudaContext};
use serde::Serialize;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;

/// The GPUDirect RDMA route found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuDirectRoute {
    /// dma-buf export and `ibv_reg_dmabuf_mr`.
    DmaBuf,
    /// `ibv_reg_mr` on a device pointer through nvidia-peermem.
    Peermem,
    /// Neither.
    None,
}

/// The answer of [`probe_gpudirect`].
#[derive(Debug, Clone, Serialize)]
pub struct GpuDirectProbe {
    /// The route that works (or would, when `tested` is false).
    pub route: GpuDirectRoute,
    /// True when a real registration decided `route`.
    pub tested: bool,
    /// What was done and seen.
    pub detail: String,
    /// The device's attributes, when they could be read.
    pub attributes: Option<GpuDirectInfo>,
}

impl std::fmt::Display for GpuDirectProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let route = match self.route {
            GpuDirectRoute::DmaBuf => "dma-buf",
            GpuDirectRoute::Peermem => "peermem",
            GpuDirectRoute::None => "none",
        };
        write!(f, "{route} ({})", self.detail)?;
        if let Some(a) = &self.attributes {
            write!(
                f,
                "; writes ordering {:?}, host flush {}",
                a.writes_ordering,
                if a.host_flush_supported {
                    "supported"
                } else {
                    "unsupported"
                }
            )?;
        }
        Ok(())
    }
}

/// The RDMA devices in `sys_root/class/infiniband`.
fn rdma_devices(sys_root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(sys_root.join("class/infiniband"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn peermem_loaded(sys_root: &Path) -> bool {
    let m = sys_root.join("module");
    m.join("nvidia_peermem").exists() || m.join("nv_peer_mem").exists()
}

/// Probes GPUDirect RDMA for CUDA device `ordinal` (see the module docs).
pub fn probe_gpudirect(ordinal: usize) -> GpuDirectProbe {
    let sys_root = Path::new("/sys");
    let attributes = GpuDirectInfo::query(ordinal).ok();
    let peermem = peermem_loaded(sys_root);
    let devices = rdma_devices(sys_root);
    if devices.is_empty() {
        let dma_buf = attributes.as_ref().is_some_and(|a| a.dma_buf_supported);
        let route = if dma_buf {
            GpuDirectRoute::DmaBuf
        } else if peermem {
            GpuDirectRoute::Peermem
        } else {
            GpuDirectRoute::None
        };
        return GpuDirectProbe {
            route,
            tested: false,
            detail: format!(
                "no RDMA device, not tested by a registration: dma-buf attribute {}, nvidia_peermem {}",
                match &attributes {
                    Some(a) => a.dma_buf_supported.to_string(),
                    None => "unreadable".into(),
                },
                if peermem { "loaded" } else { "not loaded" }
            ),
            attributes,
        };
    }
    let (route, detail) = match register(ordinal, &devices) {
        Ok(v) => v,
        Err(e) => (GpuDirectRoute::None, e),
    };
    GpuDirectProbe {
        route,
        tested: true,
        detail: format!(
            "{detail}; nvidia_peermem {}",
            if peermem { "loaded" } else { "not loaded" }
        ),
        attributes,
    }
}

type Fn0<R> = unsafe extern "C" fn(*mut c_void) -> R;
type DeviceListFn = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FreeListFn = unsafe extern "C" fn(*mut *mut c_void);
type NameFn = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type RegMrFn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut c_void;
type RegDmabufFn = unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut c_void;

/// The libibverbs entry points used (signatures of `infiniband/verbs.h`).
struct Verbs {
    get_device_list: DeviceListFn,
    free_device_list: FreeListFn,
    device_name: NameFn,
    open_device: Fn0<*mut c_void>,
    close_device: Fn0<c_int>,
    alloc_pd: Fn0<*mut c_void>,
    dealloc_pd: Fn0<c_int>,
    reg_mr: RegMrFn,
    reg_dmabuf_mr: Option<RegDmabufFn>,
    dereg_mr: Fn0<c_int>,
}

fn load_verbs() -> Result<Verbs, String> {
    // SAFETY: dlopen of the system verbs library; the handle is kept for the process.
    let h = unsafe { libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_NOW) };
    if h.is_null() {
        return Err("libibverbs.so.1 could not be loaded".into());
    }
    let sym = |s: &CStr| {
        // SAFETY: live handle, NUL-terminated name.
        let p = unsafe { libc::dlsym(h, s.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    macro_rules! need {
        ($s:literal, $t:ty) => {
            match sym($s) {
                // SAFETY: the symbol is the verbs function of this signature (verbs.h).
                Some(p) => unsafe { std::mem::transmute::<*mut c_void, $t>(p) },
                None => return Err(format!("libibverbs has no {:?}", $s)),
            }
        };
    }
    Ok(Verbs {
        get_device_list: need!(c"ibv_get_device_list", DeviceListFn),
        free_device_list: need!(c"ibv_free_device_list", FreeListFn),
        device_name: need!(c"ibv_get_device_name", NameFn),
        open_device: need!(c"ibv_open_device", Fn0<*mut c_void>),
        close_device: need!(c"ibv_close_device", Fn0<c_int>),
        alloc_pd: need!(c"ibv_alloc_pd", Fn0<*mut c_void>),
        dealloc_pd: need!(c"ibv_dealloc_pd", Fn0<c_int>),
        reg_mr: need!(c"ibv_reg_mr", RegMrFn),
        // absent before rdma-core 34
        reg_dmabuf_mr: sym(c"ibv_reg_dmabuf_mr").map(|p| {
            // SAFETY: the symbol is the verbs function of this signature (verbs.h).
            unsafe { std::mem::transmute::<*mut c_void, RegDmabufFn>(p) }
        }),
        dereg_mr: need!(c"ibv_dereg_mr", Fn0<c_int>),
    })
}

const PROBE_BYTES: usize = 2 << 20;
/// IBV_ACCESS_LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ.
const ACCESS: c_int = 1 | 2 | 4;

fn errno_text() -> String {
    std::io::Error::last_os_error().to_string()
}

/// Registers 2 MiB of device memory on the first RDMA device that opens:
/// dma-buf first, then a plain device pointer.
fn register(ordinal: usize, devices: &[String]) -> Result<(GpuDirectRoute, String), String> {
    let v = load_verbs()?;
    driver_present().map_err(|e| e.to_string())?;
    let ctx = guard("cuDevicePrimaryCtxRetain", || CudaContext::new(ordinal))
        .map_err(|e| e.to_string())?;
    let dptr = guard("cuMemAlloc", || {
        ctx.bind_to_thread()?;
        // SAFETY: plain allocation in the bound context, freed below.
        unsafe { result::malloc_sync(PROBE_BYTES) }
    })
    .map_err(|e| e.to_string())?;
    let mut n: c_int = 0;
    // SAFETY: out-pointer to a local; the list is freed below.
    let list = unsafe { (v.get_device_list)(&mut n) };
    let out = if list.is_null() || n <= 0 {
        Err(format!(
            "RDMA devices {} in sysfs, but ibv_get_device_list found none ({})",
            devices.join(","),
            errno_text()
        ))
    } else {
        let mut last = String::new();
        let mut found = None;
        for i in 0..n as usize {
            // SAFETY: the list holds `n` device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a device of the list; the name is a NUL-terminated string it owns.
            let name = unsafe { CStr::from_ptr((v.device_name)(dev)) }
                .to_string_lossy()
                .into_owned();
            match register_on(&v, dev, &name, &ctx, dptr) {
                Ok(r) => {
                    found = Some(r);
                    break;
                }
                Err(e) => last = e,
            }
        }
        found.ok_or(last)
    };
    if !list.is_null() {
        // SAFETY: the list from ibv_get_device_list, freed once.
        unsafe { (v.free_device_list)(list) };
    }
    let _ = guard("cuMemFree", || {
        ctx.bind_to_thread()?;
        // SAFETY: dptr came from cuMemAlloc above, freed once, no work uses it.
        unsafe { result::free_sync(dptr) }
    });
    out
}

fn register_on(
    v: &Verbs,
    dev: *mut c_void,
    name: &str,
    ctx: &CudaContext,
    dptr: u64,
) -> Result<(GpuDirectRoute, String), String> {
    // SAFETY: a device from the live device list.
    let vctx = unsafe { (v.open_device)(dev) };
    if vctx.is_null() {
        return Err(format!("{name}: ibv_open_device: {}", errno_text()));
    }
    // SAFETY: an open verbs context.
    let pd = unsafe { (v.alloc_pd)(vctx) };
    let out = if pd.is_null() {
        Err(format!("{name}: ibv_alloc_pd: {}", errno_text()))
    } else {
        let dmabuf = register_dmabuf(v, pd, ctx, dptr);
        let r = match dmabuf {
            Ok(()) => Ok((
                GpuDirectRoute::DmaBuf,
                format!("{name}: ibv_reg_dmabuf_mr of 2 MiB of device memory succeeded"),
            )),
            Err(why_dmabuf) => {
                // SAFETY: pd is live; dptr is PROBE_BYTES of device memory the NIC
                // may map (peermem) or refuse.
                let mr = unsafe { (v.reg_mr)(pd, dptr as *mut c_void, PROBE_BYTES, ACCESS) };
                if mr.is_null() {
                    Err(format!(
                        "{name}: dma-buf: {why_dmabuf}; ibv_reg_mr of a device pointer: {}",
                        errno_text()
                    ))
                } else {
                    // SAFETY: the MR registered just above, deregistered once.
                    unsafe { (v.dereg_mr)(mr) };
                    Ok((
                        GpuDirectRoute::Peermem,
                        format!(
                            "{name}: ibv_reg_mr of a device pointer succeeded (dma-buf: {why_dmabuf})"
                        ),
                    ))
                }
            }
        };
        // SAFETY: pd allocated above, every MR on it deregistered.
        unsafe { (v.dealloc_pd)(pd) };
        r
    };
    // SAFETY: the context opened above, closed once.
    unsafe { (v.close_device)(vctx) };
    out
}

fn register_dmabuf(v: &Verbs, pd: *mut c_void, ctx: &CudaContext, dptr: u64) -> Result<(), String> {
    let reg = v
        .reg_dmabuf_mr
        .ok_or("libibverbs has no ibv_reg_dmabuf_mr")?;
    let mut fd: c_int = -1;
    guard("cuMemGetHandleForAddressRange", || {
        ctx.bind_to_thread()?;
        // SAFETY: out-pointer to a local int (a dma-buf fd); the range is the
        // whole 2 MiB allocation (page-aligned).
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                &mut fd as *mut c_int as *mut c_void,
                dptr,
                PROBE_BYTES,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
            .result()
        }
    })
    .map_err(|e| e.detail().to_string())?;
    // SAFETY: pd is live; fd is the dma-buf of the whole allocation, offset 0.
    let mr = unsafe { reg(pd, 0, PROBE_BYTES, dptr, fd, ACCESS) };
    let err = errno_text();
    // SAFETY: fd came from the driver and is closed once (the MR keeps the dma-buf).
    unsafe { libc::close(fd) };
    if mr.is_null() {
        return Err(format!("ibv_reg_dmabuf_mr: {err}"));
    }
    // SAFETY: the MR registered just above, deregistered once.
    unsafe { (v.dereg_mr)(mr) };
    Ok(())
}
