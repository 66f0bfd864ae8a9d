//! What the agent needs from "a NIC", independent of verbs: a [`NicProvider`]
//! registers memory and creates endpoints, a [`NicEndpoint`] carries the local
//! [`Handshake`] and connects to the peer's, and the connected result is a
//! [`DataPath`] (a [`Session`] over any [`RailIo`]) that posts batches and
//! reports their completions.
//!
//! Providers: [`VerbsProvider`] (feature `rdma`: real NICs through
//! `VerbsNic`) and [`super::fake::FakeNic`] (an in-process software
//! fabric that moves real bytes after key and bounds checks; tests only,
//! never chosen unless passed explicitly in `AgentOptions::nic`).

use super::handshake::{Handshake, Negotiated};
use super::session::{RailIo, Session};
use super::slice::{LocalRegion, Span};
use super::tracker::BatchState;
use super::wr::Direction;
use crate::error::Result;
use crate::memory::RegionKind;
use std::time::Duration;

/// A connected RDMA data path (one QP per rail).
pub trait DataPath: Send + Sync {
    /// Posts one batch: sliced across the rails, keys resolved and bounds-checked
    /// before anything is posted.
    fn post_batch(&self, batch: u32, dir: Direction, spans: &[Span]) -> Result<()>;
    /// Waits up to `timeout` for the batch (`Timeout` then; it keeps running).
    fn wait(&self, batch: u32, timeout: Duration) -> Result<BatchState>;
    /// Adds a local region registered after connecting (`per_rail[i]`: its lkey
    /// on NIC rail `i`; rails left out of the connection are skipped).
    fn add_local(&self, per_rail: &[LocalRegion]);
    /// Forgets every local region overlapping `[addr, addr+len)` (their
    /// registrations are gone; a stale lkey would fail the QP).
    fn remove_local(&self, addr: u64, len: u64);
    /// Batches the tracker still holds (in flight, or finished and not yet
    /// reported): bounded, for tests and diagnostics.
    fn tracked(&self) -> usize;
    /// Connected rails.
    fn rails(&self) -> usize;
    /// Why the data path cannot carry batches any more (a rail's QP is in
    /// the error state), if so: the connection must be made again.
    fn broken(&self) -> Option<String>;
}

impl<R: RailIo> DataPath for Session<R> {
    fn post_batch(&self, batch: u32, dir: Direction, spans: &[Span]) -> Result<()> {
        Session::post_batch(self, batch, dir, spans)
    }
    fn wait(&self, batch: u32, timeout: Duration) -> Result<BatchState> {
        Session::wait(self, batch, timeout)
    }
    fn add_local(&self, per_rail: &[LocalRegion]) {
        Session::add_local(self, per_rail)
    }
    fn remove_local(&self, addr: u64, len: u64) {
        Session::remove_local(self, addr, len)
    }
    fn tracked(&self) -> usize {
        Session::tracked(self)
    }
    fn rails(&self) -> usize {
        self.connected_rails()
    }
    fn broken(&self) -> Option<String> {
        Session::broken(self)
    }
}

/// One side of a connection before it is connected: QPs exist, the local
/// handshake is known.
pub trait NicEndpoint: Send {
    /// What to send the peer.
    fn local(&self) -> &Handshake;
    /// Pairs its rails with the peer's by subnet (`pairing`), negotiates each
    /// pair (errors name the failing field), brings those QPs up (the others
    /// are dropped) and returns the running data path.
    fn connect(self: Box<Self>, remote: &Handshake)
        -> Result<(Box<dyn DataPath>, Vec<Negotiated>)>;
}

/// The NICs of this process.
pub trait NicProvider: Send + Sync {
    /// What the NICs are, in words (for the handshake offer and reports).
    fn describe(&self) -> String;
    /// Registers `[addr, addr+len)` of `kind` memory on every rail (an exact
    /// range registered before returns its keys again; a range overlapping
    /// another registration is refused with `RegionOverlap`, although verbs
    /// would accept it: memory is registered and pinned once, overlapping
    /// pool views as their allocation by [`super::view_hulls::ViewHulls`]);
    /// returns the lkey per rail. Device memory goes through the NIC's GPU path
    /// (GPUDirect RDMA); without one: `NoGpuDirect` naming the reason.
    ///
    /// # Safety
    /// The memory must stay valid until [`deregister`](Self::deregister)ed
    /// (the agent passes registry regions and deregisters them from the
    /// registry's unregister hook).
    unsafe fn register(&self, addr: u64, len: u64, kind: RegionKind) -> Result<Vec<LocalRegion>>;
    /// Deregisters the range registered as exactly `[addr, addr+len)` on every
    /// rail: its keys stop working at once (a peer's WRITE with the old rkey
    /// fails with a remote access error, nothing is written). False when no
    /// such range is registered.
    fn deregister(&self, addr: u64, len: u64) -> Result<bool>;
    /// Whether device (GPU) memory can be registered, or why not
    /// (`NoGpuDirect` with the reason).
    fn gpu_direct(&self) -> Result<()>;
    /// A new endpoint (one QP per rail) advertising every region registered so far.
    fn endpoint(&self) -> Result<Box<dyn NicEndpoint>>;
}

impl std::fmt::Debug for dyn NicProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NicProvider({})", self.describe())
    }
}

#[cfg(feature = "rdma")]
pub use verbs_provider::VerbsProvider;

#[cfg(feature = "rdma")]
mod verbs_provider {
    use super::*;
    use crate::error::{Error, Status};
    use crate::transport::rdma::config::{RdmaConfig, RecordMode};
    use crate::transport::rdma::endpoint::{MemoryKind, RdmaEndpoint, VerbsNic};
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    /// Real NICs through [`VerbsNic`].
    pub struct VerbsProvider {
        t: VerbsNic,
        registered: Mutex<HashMap<(u64, u64), Vec<LocalRegion>>>,
        /// The CUDA device GPUDirect RDMA is probed on (`None`: no device
        /// given, nothing is allocated on any GPU; see [`Self::gpu_direct_path`]).
        gpu_ordinal: Option<u32>,
        /// sysfs root (for the kernel modules when no device is given).
        sys_root: std::path::PathBuf,
        /// The outcome of that probe (made once, on first ask).
        gpu: OnceLock<Result<MemoryKind>>,
    }

    /// Bytes of device memory the GPUDirect probe registers.
    #[cfg(feature = "cuda")]
    const PROBE_BYTES: usize = 2 << 20;

    impl VerbsProvider {
        /// Opens the NICs `cfg` selects ([`Status::NoRdmaDevice`] with the
        /// reason when none is usable). The agent's control channel carries the
        /// completion record, so no WRITE_WITH_IMM record is posted.
        pub fn open(mut cfg: RdmaConfig) -> Result<VerbsProvider> {
            cfg.record = RecordMode::None;
            let gpu_ordinal = cfg.gpu_ordinal;
            let sys_root = cfg.sys_root.clone();
            Ok(VerbsProvider {
                t: VerbsNic::new(cfg)?,
                registered: Mutex::new(HashMap::new()),
                gpu_ordinal,
                sys_root,
                gpu: OnceLock::new(),
            })
        }

        /// The rails in use, with why each was chosen.
        pub fn rails(&self) -> Vec<crate::transport::rdma::device::RailChoice> {
            self.t.rails()
        }

        /// How this host registers GPU memory with the NICs, found by a real
        /// registration of device memory on the served device (made once):
        /// [`MemoryKind::GpuDmabuf`] or [`MemoryKind::GpuPeermem`], or
        /// `NoGpuDirect` with why neither works (no libcuda, no dma-buf
        /// support and no nvidia_peermem, a driver refusing the export).
        ///
        /// Without a served device (`RdmaConfig::gpu_ordinal`; engines with
        /// device pools always give one) no GPU is touched: the answer comes
        /// from the kernel modules (nvidia_peermem loaded, else the nvidia
        /// module for dma-buf) and libcuda, untested, and a registration
        /// that then fails is reported on its region.
        pub fn gpu_direct_path(&self) -> Result<MemoryKind> {
            self.gpu
                .get_or_init(|| match self.gpu_ordinal {
                    Some(o) => self.probe_gpu_direct(o),
                    None => self.gpu_direct_modules(),
                })
                .clone()
        }

        /// The untested answer from libcuda and the kernel modules.
        fn gpu_direct_modules(&self) -> Result<MemoryKind> {
            gpu_direct_available()?;
            let m = crate::transport::rdma::device::gpudirect(&self.sys_root);
            if m.peermem {
                Ok(MemoryKind::GpuPeermem)
            } else if m.nvidia {
                Ok(MemoryKind::GpuDmabuf)
            } else {
                Err(Error::new(
                    Status::NoGpuDirect,
                    "GPUDirect RDMA unavailable: neither nvidia_peermem nor the nvidia kernel module is loaded",
                ))
            }
        }

        /// Allocates [`PROBE_BYTES`] on the device, registers them through the
        /// GPU path exactly as a device region would be, and releases both.
        #[cfg(feature = "cuda")]
        fn probe_gpu_direct(&self, ordinal: u32) -> Result<MemoryKind> {
            gpu_direct_available()?;
            use cudarc::driver::result as cu;
            let fail = |what: String| {
                Error::new(
                    Status::NoGpuDirect,
                    format!("GPUDirect RDMA probe on device {ordinal}: {what}"),
                )
            };
            // Runs `f` with the device's primary context current, then puts back
            // whatever this thread had current.
            let in_ctx = |f: &dyn Fn() -> std::result::Result<u64, cudarc::driver::DriverError>| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    cu::init()?;
                    let dev = cu::device::get(ordinal as i32)?;
                    let before = cu::ctx::get_current()?;
                    // SAFETY: dev comes from device::get; the primary context stays
                    // retained for the process.
                    unsafe { cu::ctx::set_current(cu::primary_ctx::retain(dev)?)? };
                    let r = f();
                    // SAFETY: `before` was current on this thread a moment ago (or none was).
                    let _ = unsafe { cu::ctx::set_current(before.unwrap_or(std::ptr::null_mut())) };
                    r
                }))
                .map_err(|_| fail("the CUDA driver library is missing a required symbol".into()))?
                .map_err(|e| fail(format!("{e}")))
            };
            // SAFETY: a plain device allocation, freed below.
            let ptr = in_ctx(&|| unsafe { cu::malloc_sync(PROBE_BYTES) })?;
            // SAFETY: the allocation lives until it is freed below, after deregistration.
            let reg = unsafe { self.register_device(ptr, PROBE_BYTES as u64, ordinal) };
            let kind = reg.map(|()| self.t.region_kind(ptr).unwrap_or(MemoryKind::GpuPeermem));
            if kind.is_ok() {
                let _ = self.t.deregister(ptr);
            }
            // SAFETY: ptr came from malloc_sync above and is no longer registered.
            let _ = in_ctx(&|| unsafe { cu::free_sync(ptr) }.map(|()| 0));
            match &kind {
                Ok(k) => log::info!(
                    "rdma: GPUDirect RDMA works on device {ordinal} through {} (a {} MiB probe registration)",
                    match k {
                        MemoryKind::GpuDmabuf => "dma-buf",
                        _ => "nvidia-peermem",
                    },
                    PROBE_BYTES >> 20
                ),
                Err(e) => log::warn!("rdma: no GPUDirect RDMA on device {ordinal}: {e}"),
            }
            kind.map_err(|e| fail(e.detail().to_string()))
        }

        /// Without the `cuda` feature device memory cannot be exported to the NIC.
        #[cfg(not(feature = "cuda"))]
        fn probe_gpu_direct(&self, ordinal: u32) -> Result<MemoryKind> {
            gpu_direct_available()
                .map(|()| MemoryKind::GpuPeermem)
                .map_err(|e| Error::new(e.status(), format!("device {ordinal}: {}", e.detail())))
        }
    }

    impl VerbsProvider {
        /// Registers device memory through the GPU path (dma-buf, else
        /// nvidia-peermem) with device `ordinal`'s primary context current.
        ///
        /// # Safety
        /// As [`NicProvider::register`].
        #[cfg(feature = "cuda")]
        unsafe fn register_device(&self, addr: u64, len: u64, ordinal: u32) -> Result<()> {
            gpu_direct_available()?;
            use cudarc::driver::result as cu;
            // Make the device's primary context current for the export, and put
            // back whatever this (possibly engine-owned) thread had current.
            let ctx = std::panic::catch_unwind(|| {
                cu::init()?;
                let dev = cu::device::get(ordinal as i32)?;
                let before = cu::ctx::get_current()?;
                // SAFETY: dev comes from device::get; the primary context stays retained
                // for the process (the registry's device regions live in it).
                unsafe {
                    let ctx = cu::primary_ctx::retain(dev)?;
                    cu::ctx::set_current(ctx)?;
                }
                Ok::<_, cudarc::driver::DriverError>(before)
            });
            let before = match ctx {
                Ok(Ok(b)) => b,
                Ok(Err(e)) => {
                    return Err(Error::new(
                        Status::NoGpuDirect,
                        format!(
                        "GPUDirect RDMA: cannot make device {ordinal}'s CUDA context current: {e}"
                    ),
                    ))
                }
                Err(_) => {
                    return Err(Error::new(
                        Status::NoGpuDirect,
                        "GPUDirect RDMA: the CUDA driver library is missing a required symbol",
                    ))
                }
            };
            // SAFETY: forwarded from this function's contract.
            let r = unsafe { self.t.register_gpu(addr, len) };
            // SAFETY: `before` was current on this thread a moment ago (or none was).
            let _ = unsafe { cu::ctx::set_current(before.unwrap_or(std::ptr::null_mut())) };
            r.map(|_| ()).map_err(|e| {
                Error::new(
                    Status::NoGpuDirect,
                    format!("device {ordinal} memory {addr:#x}+{len}: {}", e.detail()),
                )
            })
        }

        /// Without the `cuda` feature device memory cannot be exported to the NIC.
        #[cfg(not(feature = "cuda"))]
        unsafe fn register_device(&self, _addr: u64, _len: u64, _ordinal: u32) -> Result<()> {
            gpu_direct_available()
        }
    }

    /// Whether this build and machine can register GPU memory with a NIC.
    fn gpu_direct_available() -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            // SAFETY: only tries to dlopen libcuda.
            if unsafe { cudarc::driver::sys::is_culib_present() } {
                Ok(())
            } else {
                Err(Error::new(
                    Status::NoGpuDirect,
                    "GPUDirect RDMA unavailable: libcuda could not be loaded (no NVIDIA driver here)",
                ))
            }
        }
        #[cfg(not(feature = "cuda"))]
        Err(Error::new(
            Status::NoGpuDirect,
            "GPUDirect RDMA unavailable: this build of pdxfer has no `cuda` feature",
        ))
    }

    impl NicProvider for VerbsProvider {
        fn describe(&self) -> String {
            let names: Vec<String> = self
                .t
                .rails()
                .iter()
                .map(|r| format!("{}:{}", r.device, r.port))
                .collect();
            format!("verbs {}", names.join(","))
        }

        unsafe fn register(
            &self,
            addr: u64,
            len: u64,
            kind: RegionKind,
        ) -> Result<Vec<LocalRegion>> {
            let mut m = crate::transport::rdma::session::lock(&self.registered);
            if let Some(k) = m.get(&(addr, len)) {
                return Ok(k.clone());
            }
            match kind {
                RegionKind::Host => {
                    // SAFETY: forwarded from this function's contract.
                    unsafe { self.t.register_host(&[(addr, len)]) }?;
                }
                RegionKind::Device { ordinal } => {
                    // SAFETY: forwarded from this function's contract.
                    unsafe { self.register_device(addr, len, ordinal) }?;
                }
            }
            let keys = self.t.local_keys(addr).ok_or_else(|| {
                Error::new(
                    Status::Rdma,
                    format!("region {addr:#x} vanished after registration"),
                )
            })?;
            m.insert((addr, len), keys.clone());
            Ok(keys)
        }

        fn deregister(&self, addr: u64, len: u64) -> Result<bool> {
            let mut m = crate::transport::rdma::session::lock(&self.registered);
            if m.remove(&(addr, len)).is_none() {
                return Ok(false);
            }
            self.t.deregister(addr)?;
            Ok(true)
        }

        /// Answered by a real registration of device memory (made once): a
        /// host whose libcuda loads but where neither dma-buf nor
        /// nvidia-peermem registration works says so here, at creation, not
        /// at the first batch.
        fn gpu_direct(&self) -> Result<()> {
            self.gpu_direct_path().map(|_| ())
        }

        fn endpoint(&self) -> Result<Box<dyn NicEndpoint>> {
            Ok(Box::new(self.t.endpoint()?))
        }
    }

    impl NicEndpoint for RdmaEndpoint {
        fn local(&self) -> &Handshake {
            self.local_handshake()
        }
        fn connect(
            mut self: Box<Self>,
            remote: &Handshake,
        ) -> Result<(Box<dyn DataPath>, Vec<Negotiated>)> {
            let n = RdmaEndpoint::connect(&mut self, remote)?;
            Ok((self, n))
        }
    }

    impl DataPath for RdmaEndpoint {
        fn post_batch(&self, batch: u32, dir: Direction, spans: &[Span]) -> Result<()> {
            RdmaEndpoint::post_batch(self, batch, dir, spans)
        }
        fn wait(&self, batch: u32, timeout: Duration) -> Result<BatchState> {
            RdmaEndpoint::wait(self, batch, timeout)
        }
        fn add_local(&self, per_rail: &[LocalRegion]) {
            self.session_add_local(per_rail)
        }
        fn remove_local(&self, addr: u64, len: u64) {
            self.session_remove_local(addr, len)
        }
        fn tracked(&self) -> usize {
            self.session_tracked()
        }
        fn rails(&self) -> usize {
            self.negotiated().len()
        }
        fn broken(&self) -> Option<String> {
            self.session_broken()
        }
    }
}
