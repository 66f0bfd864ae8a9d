//! Sends ordered after the caller's compute, and layer-wise sends.
//!
//! - [`SendOptions`]: what `Engine::send_with` takes beyond a chunk: a CUDA
//!   event the worker's stream waits on before gathering device pools, a
//!   [`ReadyFlag`] the worker waits on before reading host pools, and a range
//!   of layers (topology entries) when a chunk is sent layer by layer.
//! - [`LayerChunk`]: a chunk whose layers are still arriving, on its room;
//!   the checks that make out-of-order, repeated and missing layers typed
//!   `layer_order` errors before any of them is queued.
//! - [`LayerPlan`]: a chunk's token plan toward every decode rank, made once
//!   by the worker at the chunk's first layers and reused for the others; each
//!   layer group is packed on its own (entry-major), so its writes stay long.

use super::device::DeviceStage;
use super::path::PairPlan;
use super::ready_bell::{FlagWatcher, ReadyBell};
use super::room::KvPoll;
use super::state::{lock, Shared};
use crate::error::{Error, Result, Status};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A host-memory completion flag: a `u64` the caller sets non-zero (with
/// release ordering) once the rows of a send are written. The transfer
/// worker waits for it before it reads the host pools; the caller never
/// blocks. For host pools, what a CUDA event is for device pools.
///
/// [`set`](Self::set) also wakes the queue of the send waiting for the flag
/// at once; a flag written by a plain store is seen within the queue's poll
/// of its flags (some tens of microseconds).
#[derive(Clone)]
pub struct ReadyFlag {
    addr: *const AtomicU64,
    _keep: Option<Arc<AtomicU64>>,
    /// Whom [`set`](Self::set) wakes (shared by the clones).
    bell: Arc<ReadyBell>,
}

// SAFETY: the flag is only accessed atomically; `from_raw`'s caller keeps the
// address valid, `new` keeps its Arc; the bell is Send + Sync.
unsafe impl Send for ReadyFlag {}
// SAFETY: as above (atomic accesses only).
unsafe impl Sync for ReadyFlag {}

impl std::fmt::Debug for ReadyFlag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReadyFlag({:p}, set: {})", self.addr, self.is_set())
    }
}

impl ReadyFlag {
    /// A flag shared with the caller.
    pub fn new(flag: Arc<AtomicU64>) -> ReadyFlag {
        ReadyFlag {
            addr: Arc::as_ptr(&flag),
            _keep: Some(flag),
            bell: Arc::default(),
        }
    }

    /// A flag at a caller's address (the C ABI's `ready_flag`).
    ///
    /// # Safety
    /// `addr` must be an aligned `u64` that stays valid until the room is
    /// terminal (or cleared), written by the caller only atomically.
    pub unsafe fn from_raw(addr: *const AtomicU64) -> ReadyFlag {
        ReadyFlag {
            addr,
            _keep: None,
            bell: Arc::default(),
        }
    }

    /// Sets the flag (1, release ordering) and wakes the queues holding a
    /// send that waits for it (of this flag or one of its clones).
    pub fn set(&self) {
        // SAFETY: as in `is_set`; the flag is written only atomically.
        unsafe { &*self.addr }.store(1, Ordering::Release);
        self.bell.ring();
    }

    /// The live watchers of the flag (the queues it wakes).
    #[cfg(test)]
    pub(super) fn watchers(&self) -> usize {
        self.bell.watchers()
    }

    /// `w` is told when [`set`](Self::set) sets the flag.
    pub(super) fn watch(&self, w: std::sync::Weak<dyn FlagWatcher>) {
        self.bell.watch(w);
    }

    /// True once the caller set the flag non-zero.
    pub fn is_set(&self) -> bool {
        // SAFETY: `new` keeps the Arc alive; `from_raw`'s caller keeps the address valid.
        unsafe { &*self.addr }.load(Ordering::Acquire) != 0
    }
}

/// Options of one send beyond the chunk (`Engine::send_with`).
#[derive(Debug, Clone, Default)]
pub struct SendOptions {
    /// Device pools: a `CUevent` (raw handle) recorded after the kernels that
    /// wrote the rows; the worker's stream waits on it (`cuStreamWaitEvent`)
    /// before gathering, so the caller never synchronises. The event must not
    /// be destroyed before the room is terminal; re-recording it before the
    /// worker reached the send makes the send wait for the newer work.
    pub cuda_event: Option<u64>,
    /// Host pools (or either): the rows of the send are read only once this
    /// flag is set (abort and deadlines still end the wait). Until then the
    /// send holds no worker and no decode rank: the workers take the sends
    /// that are ready, other rooms first; only the room's own later sends
    /// wait behind it.
    pub ready_flag: Option<ReadyFlag>,
    /// Layer-wise: the layers (topology entries, by position) whose rows this
    /// call sends. A chunk's layers come in order over many calls with the
    /// same `pages`, `num_tokens`, `last` and `aux_index`; the aux and state
    /// rows follow the last chunk's last layers. `None`: every layer at once.
    pub layers: Option<Range<u32>>,
}

impl SendOptions {
    /// The layers of the send among `entries` topology entries (every one
    /// when `layers` is `None`); an empty range or one past the entries is refused.
    pub(super) fn layer_range(&self, entries: usize) -> Result<Range<usize>> {
        let Some(l) = &self.layers else {
            return Ok(0..entries);
        };
        let (s, e) = (l.start as usize, l.end as usize);
        if s >= e || e > entries {
            return Err(Error::invalid(format!(
                "layers {}..{} are not a non-empty range inside the {entries} layers (topology entries)",
                l.start, l.end
            )));
        }
        Ok(s..e)
    }
}

/// What the worker waits for before it reads a send's rows.
#[derive(Debug, Clone, Default)]
pub(super) struct Ready {
    pub(super) cuda_event: Option<u64>,
    pub(super) flag: Option<ReadyFlag>,
}

/// A chunk sent layer by layer whose layers are still arriving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LayerChunk {
    pub(super) pages: Vec<u64>,
    pub(super) num_tokens: u64,
    pub(super) last: bool,
    pub(super) aux_index: u64,
    /// First sequence position of the chunk.
    pub(super) start: u64,
    /// The next layer expected.
    pub(super) next: usize,
}

fn layer_error(detail: String) -> Error {
    Error::new(Status::LayerOrder, detail)
}

/// Checks a send against the room's pending layer-wise chunk (before anything
/// changes): a whole-chunk send or another chunk while layers of one are
/// missing, a repeated layer and a skipped one are `layer_order` errors.
pub(super) fn check_next(
    room: u64,
    pending: &LayerChunk,
    layers: Option<&Range<usize>>,
    chunk: (&[u64], u64, bool, u64),
    entries: usize,
) -> Result<()> {
    let missing = format!(
        "layers {}..{entries} of the chunk at position {}",
        pending.next, pending.start
    );
    let Some(l) = layers else {
        return Err(layer_error(format!(
            "room {room}: {missing} were never sent; a whole-chunk send cannot follow"
        )));
    };
    let (pages, num_tokens, last, aux_index) = chunk;
    if pending.pages != pages
        || pending.num_tokens != num_tokens
        || pending.last != last
        || pending.aux_index != aux_index
    {
        return Err(layer_error(format!(
            "room {room}: {missing} were never sent before a send of other pages, num_tokens, last or aux_index (layers {}..{})",
            l.start, l.end
        )));
    }
    if l.start < pending.next {
        return Err(layer_error(format!(
            "room {room}: layers {}..{} repeat layer {} of the chunk at position {} (next expected: {})",
            l.start, l.end, l.start, pending.start, pending.next
        )));
    }
    if l.start > pending.next {
        return Err(layer_error(format!(
            "room {room}: layers {}..{} skip layers {}..{} of the chunk at position {}",
            l.start, l.end, pending.next, l.start, pending.start
        )));
    }
    Ok(())
}

/// A chunk's plans toward every decode rank of its room (in `infos` order).
#[derive(Debug)]
pub(super) struct LayerPlan {
    /// First sequence position of the chunk (which chunk it plans).
    pub(super) start: u64,
    pub(super) pairs: Vec<PairPlan>,
}

/// Waits for what a send's rows depend on: the device stream on the caller's
/// CUDA event (enqueued, not waited), the worker thread on the ready flag
/// (polled; ends when the room fails, is aborted or the engine closes).
pub(super) fn wait_ready(
    inner: &Shared,
    room: u64,
    attempt: u64,
    ready: &Ready,
    stage: Option<&mut DeviceStage>,
) -> Result<()> {
    if let Some(ev) = ready.cuda_event {
        let st = stage.ok_or_else(|| {
            Error::invalid(
                "a CUDA event orders sends from device pools; host pools take a ready flag",
            )
        })?;
        // SAFETY: the caller keeps the event alive until the room is terminal
        // (the contract of `SendOptions::cuda_event`), in the pools' context.
        unsafe { st.wait_event(ev) }?;
    }
    let Some(flag) = &ready.flag else {
        return Ok(());
    };
    let mut turns = 0u32;
    while !flag.is_set() {
        turns += 1;
        if turns.is_multiple_of(64) {
            if inner.closed.load(Ordering::Acquire) {
                return Err(Error::new(Status::EngineClosed, "engine is closed"));
            }
            let rooms = lock(&inner.rooms);
            let live = rooms
                .get(room)
                .is_ok_and(|r| r.attempt == attempt && r.poll != KvPoll::Failed && !r.aborted);
            if !live {
                return Err(Error::new(
                    Status::RoomFailed,
                    format!("room {room} ended while its send waited for the ready flag"),
                ));
            }
        }
        if turns < 256 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk() -> LayerChunk {
        LayerChunk {
            pages: vec![3, 4],
            num_tokens: 32,
            last: false,
            aux_index: 0,
            start: 64,
            next: 2,
        }
    }

    #[test]
    fn layer_order_errors() {
        let c = chunk();
        let same = (&[3u64, 4][..], 32, false, 0);
        assert!(check_next(1, &c, Some(&(2..4)), same, 4).is_ok());
        for (layers, what) in [
            (Some(1..3), "repeat layer 1"),
            (Some(3..4), "skip layers 2..3"),
            (None, "whole-chunk send"),
        ] {
            let e = check_next(1, &c, layers.as_ref(), same, 4).unwrap_err();
            assert_eq!(e.status(), Status::LayerOrder, "{e}");
            assert!(e.detail().contains(what), "{e}");
        }
        let other = (&[5u64, 6][..], 32, false, 0);
        let e = check_next(1, &c, Some(&(0..2)), other, 4).unwrap_err();
        assert_eq!(e.status(), Status::LayerOrder);
        assert!(e.detail().contains("layers 2..4"), "{e}");
        let o = SendOptions {
            layers: Some(3..3),
            ..Default::default()
        };
        assert_eq!(
            o.layer_range(4).unwrap_err().status(),
            Status::InvalidArgument
        );
        let o = SendOptions {
            layers: Some(2..5),
            ..Default::default()
        };
        assert!(o.layer_range(4).is_err());
        assert_eq!(SendOptions::default().layer_range(4).unwrap(), 0..4);
    }

    #[test]
    fn ready_flag_reads_the_shared_word() {
        let w = Arc::new(AtomicU64::new(0));
        let f = ReadyFlag::new(w.clone());
        assert!(!f.is_set());
        w.store(7, Ordering::Release);
        assert!(f.is_set());
    }

    #[test]
    fn set_sets_the_word_for_every_clone() {
        let w = Arc::new(AtomicU64::new(0));
        let f = ReadyFlag::new(w.clone());
        let g = f.clone();
        g.set();
        assert_eq!(w.load(Ordering::Acquire), 1);
        assert!(f.is_set());
    }
}
