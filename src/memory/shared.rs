//! Shareable host memory: `memfd` allocations mapped shared into this
//! process, which same-host cma peers map too (through `pidfd_getfd`) and
//! write with plain `memcpy`, or which a same-host prefill engine gathers KV
//! rows into directly (one copy).
//!
//! [`alloc_pool`] hands out such memory for the caller's own use (e.g. a
//! serving engine's KV cache); every registration of host memory that lies
//! inside one ([`Registry::register_host`](super::Registry::register_host))
//! publishes its `memfd` (and the offset in it), so peers find the fast path
//! without any other option. The pages are populated when allocated, so
//! neither side takes page faults on the first transfer.

use crate::error::{Error, Result, Status};
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

/// A `memfd` mapped shared into this process; unmapped when the last holder
/// (the allocation table, registries that registered memory inside it) lets go.
pub(crate) struct SharedMapping {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; the pointer is only used as an address.
unsafe impl Send for SharedMapping {}
// SAFETY: as above; nothing reads or writes through `ptr` here.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// A new `memfd` of `len` zeroed bytes, mapped shared and populated.
    pub(crate) fn create(len: usize) -> Result<SharedMapping> {
        if len == 0 {
            return Err(Error::invalid("region length must be > 0"));
        }
        // SAFETY: the name is a valid NUL-terminated string; flags are valid.
        let fd = unsafe { libc::memfd_create(c"pdxfer-region".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::new(
                Status::Io,
                format!("memfd_create: {}", std::io::Error::last_os_error()),
            ));
        }
        // SAFETY: fd is a fresh descriptor we own from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: valid fd and length.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::new(
                Status::Io,
                format!(
                    "ftruncate memfd to {len}: {}",
                    std::io::Error::last_os_error()
                ),
            ));
        }
        // SAFETY: a new shared mapping of the whole memfd; checked for MAP_FAILED below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::new(
                Status::Io,
                format!("mmap {len} bytes: {}", std::io::Error::last_os_error()),
            ));
        }
        let p = p as *mut u8;
        // huge pages where the system allows them for shared memory, asked
        // for before the first fault; then every page faulted in
        // SAFETY: [p, p + len) is the mapping made above.
        let _ = unsafe { super::prefault::advise_huge_pages(p, len) };
        // SAFETY: as above.
        if unsafe { super::prefault::populate_write(p, len) }.is_err() {
            // older kernels: one write of the zero already there per page
            for i in (0..len).step_by(4096) {
                // SAFETY: i < len, inside the writable mapping.
                unsafe { std::ptr::write_volatile(p.add(i), 0) };
            }
        }
        Ok(SharedMapping { fd, ptr: p, len })
    }

    /// Start address in this process.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The memfd's number in this process (published to peers).
    pub(crate) fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly the mapping created in `create`; nothing else unmaps it.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// The allocations [`alloc_pool`] handed out, by start address.
static POOLS: Mutex<BTreeMap<u64, Arc<SharedMapping>>> = Mutex::new(BTreeMap::new());

fn pools() -> MutexGuard<'static, BTreeMap<u64, Arc<SharedMapping>>> {
    POOLS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Allocates `len` zeroed bytes of shareable host memory (a populated
/// `memfd` mapping) for the caller to use, e.g. as KV pools; returns its
/// address. Register memory inside it (an engine's pools, or any host
/// region) and same-host peers reach it with `memcpy`: a prefill engine
/// gathers KV rows straight into it. Freed with [`free_pool`].
pub fn alloc_pool(len: usize) -> Result<u64> {
    let m = SharedMapping::create(len)?;
    let addr = m.addr();
    pools().insert(addr, Arc::new(m));
    Ok(addr)
}

/// Frees an allocation of [`alloc_pool`] by its start address. Memory still
/// registered (an engine that has not closed) stays mapped until it is
/// unregistered; the caller must not use `addr` afterwards either way.
/// `InvalidArgument` (nothing changes) for an address that is not the start
/// of a live allocation.
pub fn free_pool(addr: u64) -> Result<()> {
    match pools().remove(&addr) {
        Some(_) => Ok(()),
        None => Err(Error::invalid(format!(
            "0x{addr:x} is not the start of a live shared pool allocation (never allocated, or freed already)"
        ))),
    }
}

/// The length of the live allocation of [`alloc_pool`] starting at `addr`.
pub fn pool_len(addr: u64) -> Option<usize> {
    pools().get(&addr).map(|m| m.len())
}

/// The allocation holding all of `[addr, addr + len)` and the offset of
/// `addr` in it, if any.
pub(crate) fn find(addr: u64, len: u64) -> Option<(Arc<SharedMapping>, u64)> {
    let t = pools();
    let (&start, m) = t.range(..=addr).next_back()?;
    let off = addr - start;
    let end = off.checked_add(len)?;
    (end <= m.len() as u64).then(|| (m.clone(), off))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_needs_the_whole_range_inside_one_allocation() {
        let a = alloc_pool(3 * 4096).unwrap();
        assert_eq!(pool_len(a), Some(3 * 4096));
        let (m, off) = find(a + 4096, 4096).unwrap();
        assert_eq!((m.addr(), off), (a, 4096));
        assert!(find(a + 4096, 2 * 4096 + 1).is_none(), "runs past the end");
        assert!(find(a.wrapping_sub(1), 2).is_none());
        // the memory is zeroed, writable, and stays mapped while a holder lives
        // SAFETY: a..a+3*4096 is the live mapping held by `m`.
        let s = unsafe { std::slice::from_raw_parts_mut(a as *mut u8, 3 * 4096) };
        assert!(s.iter().all(|&b| b == 0));
        s[5] = 7;
        free_pool(a).unwrap();
        assert!(find(a, 1).is_none(), "freed allocations are not found");
        assert_eq!(free_pool(a).unwrap_err().status(), Status::InvalidArgument);
        assert_eq!(s[5], 7, "still mapped: `m` holds it");
        drop(m);
        assert!(alloc_pool(0).is_err());
    }
}
