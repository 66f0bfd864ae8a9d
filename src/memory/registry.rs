//! The per-process region registry: registration, bounds checks, and
//! in-flight accounting so unregistering never frees memory under a transfer.

use super::device_writer::DeviceWriter;
use super::region::{RegionDesc, RegionKind};
use super::shared::SharedMapping;
use crate::error::{Error, Result, Status};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

struct Entry {
    desc: RegionDesc,
    inflight: u64,
    /// Unregister calls waiting on it (new accesses are refused while > 0).
    closing: u32,
    /// The shared mapping the region lies in (allocated by the registry, or
    /// a shared pool allocation): kept mapped while the region is registered.
    _owned: Option<Arc<SharedMapping>>,
    /// How host-side receivers copy into this device region (`None`: they cannot).
    writer: Option<Arc<dyn DeviceWriter>>,
    /// A pool view ([`Registry::register_host_view`]): may overlap other views.
    view: bool,
}

/// Key under which a shared region publishes its memfd number (in the owner process).
pub const MEMFD_KEY: &str = "memfd";

/// Key under which a shared region publishes its byte offset in that memfd
/// (absent: 0).
pub const MEMFD_OFFSET_KEY: &str = "memfd_offset";

#[derive(Default)]
struct State {
    regions: HashMap<u64, Entry>,
    next_id: u64,
}

/// Called with the descriptor of every unregistered region (see
/// [`Registry::add_unregister_hook`]).
pub type UnregisterHook = Arc<dyn Fn(&RegionDesc) + Send + Sync>;

/// Called when an unregister of a region begins, with the region and the
/// unregister's deadline (see [`Registry::add_revoke_hook`]).
pub type RevokeHook = Arc<dyn Fn(&RegionDesc, Instant) + Send + Sync>;

struct Inner {
    state: Mutex<State>,
    idle: Condvar,
    /// Serialises inserts with the hooks of an unregister, so a new region over
    /// the same addresses is never registered with a transport before the old
    /// one's transport registrations are gone.
    changes: Mutex<()>,
    hooks: Mutex<Vec<(u64, UnregisterHook)>>,
    next_hook: std::sync::atomic::AtomicU64,
    /// Hooks run when an unregister begins, before its drain.
    revokers: Mutex<Vec<RevokeHook>>,
}

/// The registered regions of one process (cheap to clone; clones share state).
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("regions", &self.descriptors().len())
            .finish()
    }
}

/// A pinned access to `[addr, addr + len)` of one region; while it lives the
/// region cannot be unregistered. Dropping it releases the pin.
#[derive(Debug)]
pub struct AccessGuard {
    registry: Registry,
    region: u64,
    addr: u64,
    len: u64,
}

impl AccessGuard {
    /// Absolute start address of the access in this process.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length of the access in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a zero-length access.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region this access pins.
    pub fn region(&self) -> u64 {
        self.region
    }
}

impl Drop for AccessGuard {
    fn drop(&mut self) {
        self.registry.release(self.region);
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    regions: HashMap::new(),
                    next_id: 1,
                }),
                idle: Condvar::new(),
                changes: Mutex::new(()),
                hooks: Mutex::new(Vec::new()),
                next_hook: std::sync::atomic::AtomicU64::new(1),
                revokers: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Installs `hook`, called for every region unregistered from now on:
    /// after its in-flight accesses drained and it left the registry, and
    /// before [`unregister`](Self::unregister) returns. Transports use it to
    /// drop their own registrations of the memory (e.g. an RDMA NIC's memory
    /// region and rkey), so no peer can write into memory about to be freed.
    /// A hook must not register or unregister regions of this registry (it
    /// would deadlock); reading it is fine. Returns an id for
    /// [`remove_unregister_hook`](Self::remove_unregister_hook).
    pub fn add_unregister_hook(&self, hook: UnregisterHook) -> u64 {
        let id = self
            .inner
            .next_hook
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        relock(&self.inner.hooks).push((id, hook));
        id
    }

    /// Installs `hook`, called when an unregister of a region begins: new
    /// accesses are already refused, the in-flight ones not yet drained. A
    /// holder of a standing pin (a grant for a connection's life) releases it
    /// there, within the deadline given, after its own writes in flight
    /// finished; the drain then waits for the rest. Same rules as
    /// [`add_unregister_hook`](Self::add_unregister_hook) otherwise.
    pub fn add_revoke_hook(&self, hook: RevokeHook) {
        relock(&self.inner.revokers).push(hook);
    }

    /// Removes a hook installed by [`add_unregister_hook`](Self::add_unregister_hook);
    /// false when there is none with that id.
    pub fn remove_unregister_hook(&self, id: u64) -> bool {
        let mut h = relock(&self.inner.hooks);
        let before = h.len();
        h.retain(|(i, _)| *i != id);
        h.len() != before
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means another thread panicked while holding it;
        // the map itself is always consistent, so keep going.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `len` bytes of host memory at `ptr`.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid, writable memory of this process and
    /// stay so until [`unregister`](Self::unregister) returns for it: peers
    /// write into it with no further synchronisation.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<RegionDesc> {
        // SAFETY: the caller's contract.
        unsafe { self.register_host_as(ptr, len, false) }
    }

    /// Registers host memory like [`register_host`](Self::register_host) as
    /// a *view*: one strided KV pool of an allocation whose pools interleave
    /// (block-outermost layouts), so it may overlap other views (never a
    /// region registered otherwise).
    ///
    /// # Safety
    /// As [`register_host`](Self::register_host).
    pub unsafe fn register_host_view(&self, ptr: *mut u8, len: usize) -> Result<RegionDesc> {
        // SAFETY: the caller's contract.
        unsafe { self.register_host_as(ptr, len, true) }
    }

    /// # Safety
    /// As [`register_host`](Self::register_host).
    unsafe fn register_host_as(&self, ptr: *mut u8, len: usize, view: bool) -> Result<RegionDesc> {
        if ptr.is_null() {
            return Err(Error::new(Status::NullArgument, "region pointer is NULL"));
        }
        match super::shared::find(ptr as u64, len as u64) {
            Some((mapping, offset)) => self.insert_shared(ptr as u64, len, mapping, offset, view),
            None => self.insert(ptr as u64, len as u64, RegionKind::Host, view),
        }
    }

    /// Registers `[addr, addr + len)`, which lies at `offset` in the shared
    /// `mapping`: the descriptor publishes the memfd and the offset, and the
    /// region holds the mapping until unregistered.
    fn insert_shared(
        &self,
        addr: u64,
        len: usize,
        mapping: Arc<SharedMapping>,
        offset: u64,
        view: bool,
    ) -> Result<RegionDesc> {
        let mut desc = self.insert(addr, len as u64, RegionKind::Host, view)?;
        desc.keys
            .insert(MEMFD_KEY.to_string(), mapping.raw_fd() as u64);
        if offset > 0 {
            desc.keys.insert(MEMFD_OFFSET_KEY.to_string(), offset);
        }
        let mut st = self.lock();
        if let Some(e) = st.regions.get_mut(&desc.id) {
            e.desc = desc.clone();
            e._owned = Some(mapping);
        }
        Ok(desc)
    }

    /// Registers `len` bytes of CUDA device memory at device address `dptr`
    /// on device `ordinal`; the driver is asked whether it really is device
    /// memory. Without a CUDA driver this is `NoCudaDriver`; without the
    /// `cuda` feature, `Unsupported`.
    ///
    /// # Safety
    /// The allocation must stay valid until [`unregister`](Self::unregister)
    /// returns for it.
    pub unsafe fn register_device(
        &self,
        dptr: u64,
        len: usize,
        ordinal: u32,
    ) -> Result<RegionDesc> {
        if dptr == 0 {
            return Err(Error::new(Status::NullArgument, "device pointer is 0"));
        }
        check_device_pointer(dptr, ordinal)?;
        self.insert(dptr, len as u64, RegionKind::Device { ordinal }, false)
    }

    /// Registers device memory like
    /// [`register_device_with`](Self::register_device_with) (`writer`
    /// optional) as a view, as [`register_host_view`](Self::register_host_view).
    ///
    /// # Safety
    /// As [`register_device`](Self::register_device).
    pub unsafe fn register_device_view(
        &self,
        dptr: u64,
        len: usize,
        ordinal: u32,
        writer: Option<Arc<dyn DeviceWriter>>,
    ) -> Result<RegionDesc> {
        if dptr == 0 {
            return Err(Error::new(Status::NullArgument, "device pointer is 0"));
        }
        check_device_pointer(dptr, ordinal)?;
        let desc = self.insert(dptr, len as u64, RegionKind::Device { ordinal }, true)?;
        if let Some(w) = writer {
            self.set_writer(desc.id, w);
        }
        Ok(desc)
    }

    /// Registers device memory like [`register_device`](Self::register_device)
    /// together with the `writer` that copies host bytes into it: receivers
    /// that land bytes on the host first (tcp) hand them to it, so peers can
    /// write the region over tcp. Transports that reach device memory
    /// themselves (GPUDirect RDMA) do not use it.
    ///
    /// # Safety
    /// As [`register_device`](Self::register_device).
    pub unsafe fn register_device_with(
        &self,
        dptr: u64,
        len: usize,
        ordinal: u32,
        writer: Arc<dyn DeviceWriter>,
    ) -> Result<RegionDesc> {
        // SAFETY: the caller's contract is register_device's.
        let desc = unsafe { self.register_device(dptr, len, ordinal)? };
        self.set_writer(desc.id, writer);
        Ok(desc)
    }

    /// Test knob: registers `len` bytes at `addr` as device memory of device
    /// `ordinal` without asking the CUDA driver, so transports that see device
    /// regions only as addresses (the fake NIC fabric) can be tested on hosts
    /// without a GPU. Never use it for real device memory.
    ///
    /// # Safety
    /// As [`register_host`](Self::register_host): `[addr, addr + len)` must be
    /// valid, writable host memory of this process until unregistered (the
    /// fake fabric copies into it).
    #[cfg(test)]
    pub(crate) unsafe fn register_device_unchecked(
        &self,
        addr: u64,
        len: usize,
        ordinal: u32,
    ) -> Result<RegionDesc> {
        if addr == 0 {
            return Err(Error::new(Status::NullArgument, "device pointer is 0"));
        }
        self.insert(addr, len as u64, RegionKind::Device { ordinal }, false)
    }

    /// Test knob: [`register_device_unchecked`](Self::register_device_unchecked)
    /// written through `writer` (e.g. a host-memory stand-in), or by no one.
    ///
    /// # Safety
    /// As `register_device_unchecked`; `writer` must accept every address of
    /// `[addr, addr + len)`.
    #[cfg(test)]
    pub(crate) unsafe fn register_device_unchecked_with(
        &self,
        addr: u64,
        len: usize,
        ordinal: u32,
        writer: Option<Arc<dyn DeviceWriter>>,
    ) -> Result<RegionDesc> {
        // SAFETY: forwarded contract.
        let desc = unsafe { self.register_device_unchecked(addr, len, ordinal)? };
        if let Some(w) = writer {
            self.set_writer(desc.id, w);
        }
        Ok(desc)
    }

    fn set_writer(&self, region: u64, writer: Arc<dyn DeviceWriter>) {
        if let Some(e) = self.lock().regions.get_mut(&region) {
            e.writer = Some(writer);
        }
    }

    /// The device writer of a device region registered with
    /// [`register_device_with`](Self::register_device_with); `None` for
    /// host regions, device regions without one, and unknown ids.
    pub fn device_writer(&self, region: u64) -> Option<Arc<dyn DeviceWriter>> {
        self.lock()
            .regions
            .get(&region)
            .and_then(|e| e.writer.clone())
    }

    fn insert(&self, addr: u64, len: u64, kind: RegionKind, view: bool) -> Result<RegionDesc> {
        if len == 0 {
            return Err(Error::invalid("region length must be > 0"));
        }
        let end = addr
            .checked_add(len)
            .ok_or_else(|| Error::invalid(format!("region 0x{addr:x}+{len} overflows")))?;
        let _changes = relock(&self.inner.changes);
        let mut st = self.lock();
        for e in st.regions.values() {
            let d = &e.desc;
            let same_space = matches!(
                (d.kind, kind),
                (RegionKind::Host, RegionKind::Host)
                    | (RegionKind::Device { .. }, RegionKind::Device { .. })
            );
            if same_space && !(view && e.view) && addr < d.addr + d.len && d.addr < end {
                return Err(Error::new(
                    Status::RegionOverlap,
                    format!(
                        "region 0x{addr:x}+{len} overlaps region {} (0x{:x}+{}); unregister it first or register one region covering both",
                        d.id, d.addr, d.len
                    ),
                ));
            }
        }
        let id = st.next_id;
        st.next_id += 1;
        let desc = RegionDesc {
            id,
            addr,
            len,
            kind,
            keys: BTreeMap::new(),
        };
        st.regions.insert(
            id,
            Entry {
                desc: desc.clone(),
                inflight: 0,
                closing: 0,
                _owned: None,
                writer: None,
                view,
            },
        );
        Ok(desc)
    }

    /// Allocates `len` zeroed bytes of shared host memory (a `memfd` mapped
    /// into this process) and registers it. Besides `process_vm_writev`,
    /// same-host cma peers can map these pages and write them with plain
    /// `memcpy` (the descriptor carries the `memfd` key). Freed on unregister.
    pub fn alloc_shared(&self, len: usize) -> Result<RegionDesc> {
        let m = Arc::new(SharedMapping::create(len)?);
        self.insert_shared(m.addr(), len, m, 0, false)
    }

    /// Sets a per-transport key on a region's descriptor (e.g. an RDMA rkey).
    pub fn set_key(&self, region: u64, transport: &str, key: u64) -> Result<()> {
        let mut st = self.lock();
        let e = st
            .regions
            .get_mut(&region)
            .ok_or_else(|| not_found(region))?;
        e.desc.keys.insert(transport.to_string(), key);
        Ok(())
    }

    /// Unregisters a region, first waiting up to `timeout` for in-flight
    /// accesses to finish. New accesses are refused while it waits. When they
    /// do not finish in time the region stays registered and the call fails
    /// with `RegionBusy`.
    pub fn unregister(&self, region: u64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        let desc = match st.regions.get_mut(&region) {
            None => return Err(not_found(region)),
            Some(e) => {
                e.closing += 1;
                e.desc.clone()
            }
        };
        // standing pins are released first (new accesses are refused now)
        drop(st);
        let revokers: Vec<RevokeHook> = relock(&self.inner.revokers).clone();
        for h in revokers {
            h(&desc, deadline);
        }
        let mut st = self.lock();
        loop {
            let inflight = st.regions.get(&region).map_or(0, |e| e.inflight);
            if inflight == 0 {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                if let Some(e) = st.regions.get_mut(&region) {
                    e.closing -= 1;
                }
                return Err(Error::new(
                    Status::RegionBusy,
                    format!(
                        "region {region} still has {inflight} in-flight access(es) after {timeout:?}; it stays registered (wait for or fail the batches using it, then retry)"
                    ),
                ));
            }
            st = self
                .inner
                .idle
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        // Drained, and `closing` refuses new accesses. Remove it and run the
        // hooks with inserts held off, so no new region over these addresses
        // reaches a transport before the old registrations are gone.
        drop(st);
        let _changes = relock(&self.inner.changes);
        let Some(entry) = self.lock().regions.remove(&region) else {
            return Err(not_found(region));
        };
        let hooks: Vec<UnregisterHook> = relock(&self.inner.hooks)
            .iter()
            .map(|(_, h)| h.clone())
            .collect();
        for h in hooks {
            h(&entry.desc);
        }
        // Registry-owned memory is freed only after the transports let go of it.
        drop(entry);
        Ok(())
    }

    /// The descriptor of one region.
    pub fn get(&self, region: u64) -> Result<RegionDesc> {
        self.lock()
            .regions
            .get(&region)
            .map(|e| e.desc.clone())
            .ok_or_else(|| not_found(region))
    }

    /// The hull of the pool views connected by overlap to `[addr, addr+len)`
    /// in `kind`'s address space (host, or device memory): the range a NIC
    /// registers once for every view of an interleaved allocation. `None`
    /// when no view overlaps that range.
    pub fn view_hull(&self, addr: u64, len: u64, kind: RegionKind) -> Option<(u64, u64)> {
        let device = !matches!(kind, RegionKind::Host);
        let views: Vec<(u64, u64)> = self
            .lock()
            .regions
            .values()
            .filter(|e| e.view && !matches!(e.desc.kind, RegionKind::Host) == device)
            .map(|e| (e.desc.addr, e.desc.len))
            .collect();
        super::view_hull::view_hull(&views, addr, len)
    }

    /// Descriptors of every registered region, by id.
    pub fn descriptors(&self) -> Vec<RegionDesc> {
        let st = self.lock();
        let mut v: Vec<RegionDesc> = st.regions.values().map(|e| e.desc.clone()).collect();
        v.sort_by_key(|d| d.id);
        v
    }

    /// Number of in-flight accesses pinning `region`.
    pub fn inflight(&self, region: u64) -> Result<u64> {
        self.lock()
            .regions
            .get(&region)
            .map(|e| e.inflight)
            .ok_or_else(|| not_found(region))
    }

    /// Checks `[offset, offset + len)` of `region` and returns its absolute
    /// start address; `RegionNotFound` or `OutOfBounds` otherwise.
    pub fn check_access(&self, region: u64, offset: u64, len: u64) -> Result<u64> {
        let st = self.lock();
        let e = st.regions.get(&region).ok_or_else(|| not_found(region))?;
        e.desc.check(offset, len)?;
        Ok(e.desc.addr + offset)
    }

    /// Checks an access like [`check_access`](Self::check_access) and pins
    /// the region until the returned guard drops. Refused with `RegionBusy`
    /// while the region is being unregistered.
    pub fn acquire(&self, region: u64, offset: u64, len: u64) -> Result<AccessGuard> {
        let mut st = self.lock();
        let e = st
            .regions
            .get_mut(&region)
            .ok_or_else(|| not_found(region))?;
        if e.closing > 0 {
            return Err(Error::new(
                Status::RegionBusy,
                format!("region {region} is being unregistered; no new accesses"),
            ));
        }
        e.desc.check(offset, len)?;
        e.inflight += 1;
        let addr = e.desc.addr + offset;
        drop(st);
        Ok(AccessGuard {
            registry: self.clone(),
            region,
            addr,
            len,
        })
    }

    /// The kind of a region.
    pub fn kind(&self, region: u64) -> Result<RegionKind> {
        Ok(self.get(region)?.kind)
    }

    fn release(&self, region: u64) {
        let mut st = self.lock();
        if let Some(e) = st.regions.get_mut(&region) {
            e.inflight = e.inflight.saturating_sub(1);
            if e.inflight == 0 {
                self.inner.idle.notify_all();
            }
        }
    }
}

fn relock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn not_found(region: u64) -> Error {
    Error::new(
        Status::RegionNotFound,
        format!("region {region} is not registered here (unregistered, or a descriptor from another process)"),
    )
}

#[cfg(feature = "cuda")]
fn check_device_pointer(dptr: u64, ordinal: u32) -> Result<()> {
    use cudarc::driver::sys;
    // SAFETY: is_culib_present only tries to dlopen the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::new(
            Status::NoCudaDriver,
            "cannot register device memory: libcuda could not be loaded (no NVIDIA driver here)",
        ));
    }
    let r = std::panic::catch_unwind(|| {
        cudarc::driver::result::init()?;
        let mut mem_type: u32 = 0;
        let mut dev: i32 = -1;
        // SAFETY: the out-pointers are valid u32/i32 locals; the attribute sizes match (CUmemorytype is a 4-byte enum, the ordinal an int).
        unsafe {
            sys::cuPointerGetAttribute(
                &mut mem_type as *mut u32 as *mut std::ffi::c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                dptr,
            )
            .result()?;
            sys::cuPointerGetAttribute(
                &mut dev as *mut i32 as *mut std::ffi::c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                dptr,
            )
            .result()?;
        }
        Ok::<(u32, i32), cudarc::driver::DriverError>((mem_type, dev))
    });
    match r {
        Ok(Ok((t, dev))) => {
            if t != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
                return Err(Error::invalid(format!(
                    "0x{dptr:x} is not device memory (CUmemorytype {t})"
                )));
            }
            if dev != ordinal as i32 {
                return Err(Error::invalid(format!(
                    "0x{dptr:x} lives on device {dev}, not on device {ordinal}"
                )));
            }
            Ok(())
        }
        Ok(Err(e)) => Err(Error::new(
            Status::Cuda,
            format!("cuPointerGetAttribute(0x{dptr:x}) failed: {e} (not a CUDA allocation?)"),
        )),
        Err(_) => Err(Error::new(
            Status::NoCudaDriver,
            "the CUDA driver library is missing a required symbol",
        )),
    }
}

#[cfg(not(feature = "cuda"))]
fn check_device_pointer(_dptr: u64, _ordinal: u32) -> Result<()> {
    Err(Error::new(
        Status::Unsupported,
        "device regions need the `cuda` feature",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg_buf(r: &Registry, b: &mut [u8]) -> RegionDesc {
        // SAFETY: the test buffers outlive the registry use in each test.
        unsafe { r.register_host(b.as_mut_ptr(), b.len()) }.unwrap()
    }

    #[test]
    fn bounds_and_not_found_are_typed() {
        let r = Registry::new();
        let mut buf = vec![0u8; 4096];
        let d = reg_buf(&r, &mut buf);
        assert_eq!(r.check_access(d.id, 0, 4096).unwrap(), d.addr);
        assert_eq!(r.check_access(d.id, 4000, 96).unwrap(), d.addr + 4000);
        let e = r.check_access(d.id, 4000, 97).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds);
        assert_eq!(e.status() as i32, -301);
        let e = r.check_access(d.id, u64::MAX, 1).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds);
        let e = r.check_access(d.id + 1, 0, 1).unwrap_err();
        assert_eq!(e.status(), Status::RegionNotFound);
        assert_eq!(e.status() as i32, -300);
    }

    #[test]
    fn overlap_refused_and_null_refused() {
        let r = Registry::new();
        let mut buf = vec![0u8; 4096];
        let _ = reg_buf(&r, &mut buf[..2048]);
        // SAFETY: inside the live test buffer.
        let e = unsafe { r.register_host(buf.as_mut_ptr().add(2047), 10) }.unwrap_err();
        assert_eq!(e.status(), Status::RegionOverlap);
        // SAFETY: inside the live test buffer, adjacent, no overlap.
        let d2 = unsafe { r.register_host(buf.as_mut_ptr().add(2048), 2048) }.unwrap();
        assert_eq!(d2.len, 2048);
        // SAFETY: NULL is refused before any use.
        let e = unsafe { r.register_host(std::ptr::null_mut(), 8) }.unwrap_err();
        assert_eq!(e.status(), Status::NullArgument);
        assert_eq!(r.descriptors().len(), 2);
    }

    #[test]
    fn pool_views_overlap_only_each_other() {
        let r = Registry::new();
        let mut buf = vec![0u8; 4096];
        let p = buf.as_mut_ptr();
        // SAFETY: inside the live test buffer (two interleaved pool views).
        let a = unsafe { r.register_host_view(p, 3072) }.unwrap();
        // SAFETY: as above.
        let b = unsafe { r.register_host_view(p.wrapping_add(1024), 3072) }.unwrap();
        assert_ne!(a.id, b.id);
        // a plain region over a view, and a view over a plain region, are refused
        // SAFETY: as above.
        let e = unsafe { r.register_host(p.wrapping_add(2048), 8) }.unwrap_err();
        assert_eq!(e.status(), Status::RegionOverlap);
        let mut other = vec![0u8; 64];
        let _ = reg_buf(&r, &mut other);
        // SAFETY: inside the live second buffer.
        let e = unsafe { r.register_host_view(other.as_mut_ptr(), 64) }.unwrap_err();
        assert_eq!(e.status(), Status::RegionOverlap);
        assert_eq!(r.descriptors().len(), 3);
    }

    #[test]
    fn unregister_waits_for_inflight_then_succeeds() {
        let r = Registry::new();
        let mut buf = vec![0u8; 64];
        let d = reg_buf(&r, &mut buf);
        let g = r.acquire(d.id, 0, 64).unwrap();
        assert_eq!(r.inflight(d.id).unwrap(), 1);
        // Times out while the guard lives; region stays usable afterwards.
        let e = r.unregister(d.id, Duration::from_millis(20)).unwrap_err();
        assert_eq!(e.status(), Status::RegionBusy);
        assert!(r.acquire(d.id, 0, 1).is_ok());
        let r2 = r.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            drop(g);
        });
        let t0 = Instant::now();
        r2.unregister(d.id, Duration::from_secs(5)).unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(20));
        t.join().unwrap();
        assert_eq!(r.get(d.id).unwrap_err().status(), Status::RegionNotFound);
    }

    #[test]
    fn unregister_hooks_run_after_the_drain_and_before_unregister_returns() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let r = Registry::new();
        let mut buf = vec![0u8; 256];
        let d = reg_buf(&r, &mut buf[..128]);
        type Seen = Vec<(u64, u64, u64, u64)>;
        let seen: Arc<Mutex<Seen>> = Arc::default();
        let pinned = Arc::new(AtomicU64::new(u64::MAX));
        let (s, p, r2) = (seen.clone(), pinned.clone(), r.clone());
        let id = r.add_unregister_hook(Arc::new(move |d: &RegionDesc| {
            // The region already left the registry when the hook runs.
            assert_eq!(r2.get(d.id).unwrap_err().status(), Status::RegionNotFound);
            relock(&s).push((d.id, d.addr, d.len, p.load(Ordering::SeqCst)));
        }));
        let g = r.acquire(d.id, 0, 8).unwrap();
        // Busy: the hook does not run for a region that stays registered.
        assert_eq!(
            r.unregister(d.id, Duration::from_millis(10))
                .unwrap_err()
                .status(),
            Status::RegionBusy
        );
        assert!(relock(&seen).is_empty());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            pinned.store(0, Ordering::SeqCst);
            drop(g);
        });
        r.unregister(d.id, Duration::from_secs(5)).unwrap();
        t.join().unwrap();
        // Ran once, after the guard dropped, before unregister returned.
        assert_eq!(
            *relock(&seen),
            vec![(d.id, buf.as_ptr() as u64, 128, 0)],
            "hook calls"
        );
        // The same addresses register again; a removed hook no longer runs.
        let d2 = reg_buf(&r, &mut buf);
        assert_ne!(d2.id, d.id);
        assert!(r.remove_unregister_hook(id));
        assert!(!r.remove_unregister_hook(id));
        r.unregister(d2.id, Duration::from_secs(1)).unwrap();
        assert_eq!(relock(&seen).len(), 1);
    }

    #[test]
    fn device_registration_without_driver_is_typed() {
        let r = Registry::new();
        // SAFETY: the address is only passed to the driver query, never dereferenced.
        match unsafe { r.register_device(0x7000_0000, 1024, 0) } {
            Ok(_) => panic!("0x70000000 cannot be a device allocation"),
            Err(e) => assert!(
                matches!(
                    e.status(),
                    Status::NoCudaDriver
                        | Status::Unsupported
                        | Status::Cuda
                        | Status::InvalidArgument
                ),
                "{e}"
            ),
        }
    }
}

#[cfg(test)]
mod shared_tests {
    use super::*;

    #[test]
    fn shared_region_is_usable_and_freed_on_unregister() {
        let r = Registry::new();
        let d = r.alloc_shared(1 << 16).unwrap();
        assert!(d.keys.contains_key(MEMFD_KEY));
        let a = r.check_access(d.id, 0, 1 << 16).unwrap();
        // SAFETY: inside the mapping just registered.
        unsafe {
            assert_eq!(*(a as *const u8).add(100), 0);
            *(a as *mut u8).add(100) = 7;
            assert_eq!(*(a as *const u8).add(100), 7);
        }
        r.unregister(d.id, Duration::from_secs(1)).unwrap();
        assert_eq!(
            r.alloc_shared(0).unwrap_err().status(),
            Status::InvalidArgument
        );
    }

    #[test]
    fn registering_inside_a_shared_pool_publishes_its_memfd_and_keeps_it_mapped() {
        let r = Registry::new();
        let base = crate::memory::shared::alloc_pool(4 << 12).unwrap();
        // SAFETY: the second page of the live allocation.
        let d = unsafe { r.register_host((base + 4096 + 8) as *mut u8, 4096) }.unwrap();
        assert!(d.keys.contains_key(MEMFD_KEY), "{d:?}");
        assert_eq!(d.keys.get(MEMFD_OFFSET_KEY), Some(&(4096 + 8)));
        assert_eq!(r.get(d.id).unwrap(), d);
        // heap memory is registered as before: no memfd
        let mut heap = vec![0u8; 64];
        // SAFETY: heap outlives the registration (unregistered below).
        let h = unsafe { r.register_host(heap.as_mut_ptr(), heap.len()) }.unwrap();
        assert!(h.keys.is_empty());
        // freed by its owner while registered: still mapped until unregistered
        crate::memory::shared::free_pool(base).unwrap();
        // SAFETY: the registry holds the mapping of the registered range.
        unsafe { *((base + 4096 + 8) as *mut u8) = 3 };
        r.unregister(d.id, Duration::from_secs(1)).unwrap();
        r.unregister(h.id, Duration::from_secs(1)).unwrap();
    }
}

/// Runs only where a CUDA device is usable (skips with a printed reason elsewhere).
#[cfg(all(test, feature = "cuda"))]
mod device_tests {
    use super::*;
    use cudarc::driver::result;

    #[test]
    fn device_region_registers_and_host_transports_refuse_it() {
        // SAFETY: only dlopens the library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            crate::test_skip::skip("gpu", "no CUDA driver");
            return;
        }
        let setup = std::panic::catch_unwind(|| -> std::result::Result<u64, String> {
            result::init().map_err(|e| e.to_string())?;
            let dev = result::device::get(0).map_err(|e| e.to_string())?;
            // SAFETY: dev comes from device::get; the context is made current before allocating.
            unsafe {
                let ctx = result::primary_ctx::retain(dev).map_err(|e| e.to_string())?;
                result::ctx::set_current(ctx).map_err(|e| e.to_string())?;
                result::malloc_sync(1 << 20).map_err(|e| e.to_string())
            }
        });
        let dptr = match setup {
            Ok(Ok(p)) => p,
            other => {
                crate::test_skip::skip("gpu", &format!("no usable CUDA device ({other:?})"));
                return;
            }
        };
        let r = Registry::new();
        // SAFETY: dptr is a live 1 MiB device allocation, freed below after unregistering.
        let d = unsafe { r.register_device(dptr, 1 << 20, 0) }.unwrap();
        assert_eq!(d.kind, RegionKind::Device { ordinal: 0 });
        assert_eq!(r.check_access(d.id, 0, 1 << 20).unwrap(), dptr);
        // SAFETY: as above.
        let e = unsafe { r.register_device(dptr, 1 << 20, 1) }.unwrap_err();
        assert!(
            matches!(e.status(), Status::RegionOverlap | Status::InvalidArgument),
            "{e}"
        );
        // Host memory is not device memory.
        let host = [0u8; 64];
        // SAFETY: the address is only queried, never dereferenced.
        let e =
            unsafe { Registry::new().register_device(host.as_ptr() as u64, 64, 0) }.unwrap_err();
        assert!(
            matches!(e.status(), Status::Cuda | Status::InvalidArgument),
            "{e}"
        );
        r.unregister(d.id, Duration::from_secs(1)).unwrap();
        // SAFETY: dptr came from malloc_sync and is no longer registered.
        let _ = unsafe { result::free_sync(dptr) };
    }
}
