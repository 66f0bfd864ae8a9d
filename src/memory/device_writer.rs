//! The device-copy hook of device regions: how a transport that receives
//! bytes on the host (tcp) lands them in CUDA device memory, without the
//! memory and transport layers depending on a CUDA library.

use crate::error::Result;

/// Copies host bytes into the device memory of registered device regions.
///
/// Registered with a region through
/// [`Registry::register_device_with`](super::Registry::register_device_with)
/// and implemented above this layer (`cuda::HostToDevice`, which the engine opens,
/// or a host-memory stand-in in tests).
pub trait DeviceWriter: Send + Sync {
    /// Copies `src` to device address `dst` (already bounds-checked against a
    /// registered region by the caller) and returns only once every byte is
    /// in device memory (a synchronous copy, or an asynchronous one followed
    /// by a wait): the caller reuses `src` and may report the bytes as
    /// delivered as soon as this returns.
    fn write(&self, dst: u64, src: &[u8]) -> Result<()>;

    /// Starts copying `len` bytes at `src` to device address `dst`
    /// (bounds-checked as for [`write`](Self::write)) and returns a [`Fence`]
    /// that is complete once every byte is in device memory. The default
    /// copies synchronously through [`write`](Self::write) and returns a
    /// completed fence; a writer with asynchronous copies (a CUDA stream)
    /// overrides it so a receiver can read the next bytes meanwhile.
    ///
    /// # Safety
    /// `[src, src + len)` must be valid host memory that stays allocated and
    /// unmodified until the returned fence is waited or dropped.
    unsafe fn write_async(&self, dst: u64, src: *const u8, len: usize) -> Result<Fence> {
        // SAFETY: the caller's contract: `[src, src + len)` is valid host memory.
        let bytes = unsafe { std::slice::from_raw_parts(src, len) };
        self.write(dst, bytes).map(|()| Fence::done())
    }

    /// A host buffer of `len` bytes for a receiver to land bytes in before
    /// [`write`](Self::write)ing them: page-locked memory where the writer
    /// can allocate it (the copy then runs as DMA straight from it), else
    /// ordinary heap memory (the default).
    fn bounce(&self, len: usize) -> BounceBuffer {
        BounceBuffer::heap(len)
    }
}

/// The completion of a copy started by
/// [`DeviceWriter::write_async`]: [`wait`](Fence::wait) blocks until the
/// copy's bytes are in device memory and reports its failure. A fence dropped
/// unwaited waits too (its error is lost), so the copy's source is never
/// released or rewritten while the copy may still read it.
#[must_use = "a copy counts as landed only once its fence is waited"]
pub struct Fence {
    wait: Option<Box<dyn FnOnce() -> Result<()> + Send>>,
}

impl Fence {
    /// A fence that is already complete (a synchronous copy).
    pub fn done() -> Fence {
        Fence { wait: None }
    }

    /// A fence completed by `wait`, which blocks until the copy is done
    /// (it must not panic: it also runs when the fence drops).
    pub fn new(wait: impl FnOnce() -> Result<()> + Send + 'static) -> Fence {
        Fence {
            wait: Some(Box::new(wait)),
        }
    }

    /// Blocks until the copy is in device memory; its error if it failed.
    pub fn wait(mut self) -> Result<()> {
        match self.wait.take() {
            Some(w) => w(),
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = if self.wait.is_some() {
            "pending"
        } else {
            "complete"
        };
        write!(f, "Fence({state})")
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        if let Some(w) = self.wait.take() {
            // Errors cannot be reported from a drop: the copy is only waited for.
            let _ = w();
        }
    }
}

/// Host memory a receiver lands bytes in before a [`DeviceWriter`] copies
/// them to the device: heap memory, or memory the writer allocated (e.g.
/// page-locked) and releases when the buffer drops.
pub struct BounceBuffer {
    mem: Bounce,
}

enum Bounce {
    Heap(Vec<u8>),
    Raw {
        ptr: *mut u8,
        len: usize,
        release: Option<Box<dyn FnOnce(*mut u8) + Send>>,
    },
}

// SAFETY: the buffer exclusively owns its memory (heap or handed over by
// `from_raw`); it is only accessed through `&mut self`.
unsafe impl Send for BounceBuffer {}

impl BounceBuffer {
    /// `len` zeroed bytes of heap memory.
    pub fn heap(len: usize) -> BounceBuffer {
        BounceBuffer {
            mem: Bounce::Heap(vec![0u8; len]),
        }
    }

    /// Takes `[ptr, ptr + len)`, handed back to `release` when the buffer drops.
    ///
    /// # Safety
    /// The range must be valid, writable host memory used by nothing else
    /// until `release` is called; `release` must not panic.
    pub unsafe fn from_raw(
        ptr: *mut u8,
        len: usize,
        release: Box<dyn FnOnce(*mut u8) + Send>,
    ) -> BounceBuffer {
        BounceBuffer {
            mem: Bounce::Raw {
                ptr,
                len,
                release: Some(release),
            },
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.mem {
            Bounce::Heap(v) => v.len(),
            Bounce::Raw { len, .. } => *len,
        }
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Bounce::Heap(v) => v,
            // SAFETY: from_raw's contract: valid, writable and exclusively ours.
            Bounce::Raw { ptr, len, .. } => unsafe { std::slice::from_raw_parts_mut(*ptr, *len) },
        }
    }
}

impl std::fmt::Debug for BounceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.mem {
            Bounce::Heap(_) => "heap",
            Bounce::Raw { .. } => "writer-allocated",
        };
        write!(f, "BounceBuffer({kind}, {} B)", self.len())
    }
}

impl Drop for BounceBuffer {
    fn drop(&mut self) {
        if let Bounce::Raw { ptr, release, .. } = &mut self.mem {
            if let Some(r) = release.take() {
                r(*ptr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn raw_bounce_buffers_are_released_once_on_drop() {
        let mut b = BounceBuffer::heap(16);
        assert_eq!(b.len(), 16);
        b.as_mut_slice()[15] = 1;
        let released = Arc::new(AtomicUsize::new(0));
        let mem = Box::into_raw(vec![0u8; 32].into_boxed_slice()) as *mut u8;
        let r = released.clone();
        let release: Box<dyn FnOnce(*mut u8) + Send> = Box::new(move |p| {
            r.fetch_add(1, Ordering::SeqCst);
            // SAFETY: p is the pointer from Box::into_raw above, 32 bytes.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, 32)) });
        });
        // SAFETY: mem is a leaked 32-byte box, given back to a Box in the release.
        let mut b = unsafe { BounceBuffer::from_raw(mem, 32, release) };
        b.as_mut_slice()[31] = 7;
        assert_eq!(b.as_mut_slice()[31], 7);
        assert_eq!(released.load(Ordering::SeqCst), 0);
        drop(b);
        assert_eq!(released.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn fences_wait_once_whether_waited_or_dropped() {
        assert!(Fence::done().wait().is_ok());
        let waits = Arc::new(AtomicUsize::new(0));
        let w = waits.clone();
        let f = Fence::new(move || {
            w.fetch_add(1, Ordering::SeqCst);
            Err(crate::error::Error::new(
                crate::error::Status::Io,
                "copy failed",
            ))
        });
        assert!(f.wait().is_err());
        assert_eq!(waits.load(Ordering::SeqCst), 1);
        let w = waits.clone();
        let f = Fence::new(move || {
            w.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        drop(f);
        assert_eq!(waits.load(Ordering::SeqCst), 2);
    }
}
