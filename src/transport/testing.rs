//! Test fakes shared by the transport's tests: device writers that are host
//! memory ([`HostAsDevice`] copies at once, [`DeferredDevice`] only when a
//! fence is waited, as a DMA does) and a socket ([`WatchedSocket`]) that
//! notices reads into memory a pending copy still reads. Built for unit tests
//! only (`cfg(test)`, not the `testing` feature).
//!
//! What they model:
//! - "device" memory as one host range `[base, base + len)`: a write outside
//!   it panics the test;
//! - [`DeferredDevice`]: `write_async` returns a fence and copies nothing; the
//!   bytes land when the fence is waited or dropped, read from the source at
//!   that moment (a source overwritten in between is counted in
//!   `overwritten`), so a receiver that reuses a buffer before its copy
//!   completed is caught; the plain `write` panics (the receiver must use the
//!   asynchronous one); a chosen fence can fail its wait (`fail_wait_of`);
//! - [`HostAsDevice`]: synchronous copies, counted, the largest one recorded,
//!   the n-th one failed on request (`fail_at`);
//! - [`WatchedSocket`]: at most 7 bytes per `read`, and a count of reads into
//!   memory a pending [`DeferredDevice`] copy still reads.
//!
//! What they do not model: CUDA itself (streams, events, pinned memory, the
//! driver's errors: see `cuda/fake_driver.cpp`), copies that complete on
//! their own without a wait, concurrency between the copies and the host,
//! and a socket's errors, timeouts or end of stream mid-piece.

use crate::error::{Error, Result, Status};
use crate::transport::agent::lock;
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A host-memory stand-in for a CUDA device writer: "device" addresses
/// are host addresses of `[base, base + len)`; counts its copies.
pub(crate) struct HostAsDevice {
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) writes: AtomicU64,
    pub(crate) largest: AtomicU64,
    pub(crate) fail_at: Option<u64>,
}

impl HostAsDevice {
    pub(crate) fn new(buf: &mut [u8], fail_at: Option<u64>) -> Arc<HostAsDevice> {
        Arc::new(HostAsDevice {
            base: buf.as_mut_ptr() as u64,
            len: buf.len() as u64,
            writes: AtomicU64::new(0),
            largest: AtomicU64::new(0),
            fail_at,
        })
    }
}

impl crate::memory::DeviceWriter for HostAsDevice {
    fn write(&self, dst: u64, src: &[u8]) -> Result<()> {
        let n = self.writes.fetch_add(1, Ordering::SeqCst);
        if Some(n) == self.fail_at {
            return Err(Error::new(Status::Cuda, "injected copy failure"));
        }
        assert!(
            dst >= self.base && dst + src.len() as u64 <= self.base + self.len,
            "write outside the fake device memory"
        );
        self.largest.fetch_max(src.len() as u64, Ordering::SeqCst);
        // SAFETY: checked above to lie inside the live test buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
}

/// One copy started by [`DeferredDevice`] and not yet waited.
pub(crate) struct PendingCopy {
    pub(crate) id: u64,
    pub(crate) dst: u64,
    pub(crate) src: usize,
    pub(crate) len: usize,
    /// The source bytes when the copy was started.
    pub(crate) snapshot: Vec<u8>,
}

#[derive(Default)]
pub(crate) struct DeferredState {
    pub(crate) pending: Vec<PendingCopy>,
    pub(crate) next: u64,
    pub(crate) started: u64,
    pub(crate) landed: u64,
    pub(crate) most_pending: usize,
    /// Copies whose source changed between their start and their wait.
    pub(crate) overwritten: u64,
    /// Socket reads into memory a pending copy still reads.
    pub(crate) reads_into_pending: u64,
    pub(crate) fail_wait_of: Option<u64>,
}

/// A host-memory "device" whose asynchronous copies land only when their
/// fence is waited (or dropped), reading the source at that moment as a
/// DMA from pinned memory does.
pub(crate) struct DeferredDevice {
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) st: Arc<Mutex<DeferredState>>,
}

impl DeferredDevice {
    fn land(st: &Mutex<DeferredState>, id: u64) -> Result<()> {
        let mut g = lock(st);
        let i = g.pending.iter().position(|c| c.id == id).unwrap();
        let c = g.pending.remove(i);
        if g.fail_wait_of == Some(id) {
            return Err(Error::new(Status::Cuda, "injected copy failure"));
        }
        // SAFETY: the receiver keeps the source alive until the fence is waited.
        let now = unsafe { std::slice::from_raw_parts(c.src as *const u8, c.len) };
        if now != &c.snapshot[..] {
            g.overwritten += 1;
        }
        // SAFETY: dst was checked against the fake device memory at the start.
        unsafe { std::ptr::copy_nonoverlapping(now.as_ptr(), c.dst as *mut u8, c.len) };
        g.landed += 1;
        Ok(())
    }
}

impl crate::memory::DeviceWriter for DeferredDevice {
    fn write(&self, _dst: u64, _src: &[u8]) -> Result<()> {
        panic!("the receiver must use write_async");
    }

    unsafe fn write_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<crate::memory::Fence> {
        assert!(dst >= self.base && dst + len as u64 <= self.base + self.len);
        let mut g = lock(&self.st);
        let id = g.next;
        g.next += 1;
        g.started += 1;
        // SAFETY: the caller's contract: the source is valid host memory.
        let snapshot = unsafe { std::slice::from_raw_parts(src, len) }.to_vec();
        g.pending.push(PendingCopy {
            id,
            dst,
            src: src as usize,
            len,
            snapshot,
        });
        g.most_pending = g.most_pending.max(g.pending.len());
        let st = self.st.clone();
        Ok(crate::memory::Fence::new(move || {
            DeferredDevice::land(&st, id)
        }))
    }
}

/// A socket stand-in returning a few bytes per read, which counts reads
/// into memory a pending copy of `st` still reads.
pub(crate) struct WatchedSocket {
    pub(crate) data: Vec<u8>,
    pub(crate) pos: usize,
    pub(crate) st: Arc<Mutex<DeferredState>>,
}

impl Read for WatchedSocket {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(7).min(self.data.len() - self.pos);
        let (lo, hi) = (buf.as_ptr() as usize, buf.as_ptr() as usize + n);
        let mut g = lock(&self.st);
        let clash = g.pending.iter().any(|c| lo < c.src + c.len && c.src < hi);
        if clash {
            g.reads_into_pending += 1;
        }
        drop(g);
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}
