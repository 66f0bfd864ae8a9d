//! The tcp receiver landing pieces in device regions through their writer
//! ([`receive_piece`] into `device.rs`'s device path): slices, refusals,
//! failed copies, deferred copies.

use super::recv::receive_piece;
use crate::error::Status;
use crate::memory::{RegionKind, Registry};
use crate::transport::agent::lock;
use crate::transport::checksum;
use crate::transport::testing::{DeferredDevice, DeferredState, HostAsDevice, WatchedSocket};
use crate::transport::wire::{self, DataHeader};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

#[test]
fn tcp_receiver_lands_device_pieces_through_the_writer_in_slices() {
    let mut mem = vec![0u8; 4096];
    let w = HostAsDevice::new(&mut mem, None);
    let reg = Registry::new();
    // SAFETY: the writer accepts exactly the buffer's addresses.
    let d =
        unsafe { reg.register_device_unchecked_with(w.base, 4096, 0, Some(w.clone())) }.unwrap();
    assert!(matches!(d.kind, RegionKind::Device { ordinal: 0 }));
    let payload: Vec<u8> = (0..1000u32).map(|i| (i * 13 + 1) as u8).collect();
    let h = DataHeader {
        flags: wire::DATA_FLAG_CHECKSUM,
        batch: 1,
        region: d.id,
        offset: 100,
        len: 1000,
    };
    let mut scratch = vec![0u8; 100];
    let mut bounce = Some(crate::memory::BounceBuffer::heap(64));
    let mut s = std::io::Cursor::new(payload.clone());
    let sum = receive_piece(&reg, &mut s, &h, &mut scratch, &mut bounce)
        .unwrap()
        .unwrap();
    assert_eq!(sum, checksum::piece(d.id, 100, &payload));
    assert_eq!(&mem[100..1100], &payload[..]);
    assert!(mem[..100].iter().chain(&mem[1100..]).all(|&b| b == 0));
    // two 32-byte halves of the 64-byte bounce buffer
    assert_eq!(w.writes.load(Ordering::SeqCst), 1000u64.div_ceil(32));
    assert_eq!(w.largest.load(Ordering::SeqCst), 32);
    assert_eq!(reg.inflight(d.id).unwrap(), 0);

    // Out of bounds: refused, nothing written, the payload drained.
    let before = mem.clone();
    let bad = DataHeader {
        offset: 4000,
        len: 200,
        ..h
    };
    let mut s = std::io::Cursor::new(vec![0xabu8; 200 + 7]);
    let e = receive_piece(&reg, &mut s, &bad, &mut scratch, &mut bounce)
        .unwrap()
        .unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    assert_eq!(s.position(), 200);
    assert_eq!(mem, before);
    assert_eq!(w.writes.load(Ordering::SeqCst), 1000u64.div_ceil(32));

    // A failed copy fails the piece and drains the rest of it.
    let mut mem2 = vec![0u8; 4096];
    let w2 = HostAsDevice::new(&mut mem2, Some(1));
    // SAFETY: as above.
    let d2 =
        unsafe { reg.register_device_unchecked_with(w2.base, 4096, 0, Some(w2.clone())) }.unwrap();
    let mut s = std::io::Cursor::new(payload.clone());
    let h2 = DataHeader { region: d2.id, ..h };
    let e = receive_piece(&reg, &mut s, &h2, &mut scratch, &mut bounce)
        .unwrap()
        .unwrap_err();
    assert_eq!(e.status(), Status::Cuda, "{e}");
    assert_eq!(s.position(), 1000);

    // A device region without a writer: refused as unsupported, drained.
    let mut mem3 = vec![0u8; 64];
    // SAFETY: no writer: nothing may write it.
    let d3 = unsafe { reg.register_device_unchecked_with(mem3.as_mut_ptr() as u64, 64, 0, None) }
        .unwrap();
    let mut s = std::io::Cursor::new(vec![1u8; 8]);
    let h3 = DataHeader {
        region: d3.id,
        offset: 0,
        len: 8,
        ..h
    };
    let e = receive_piece(&reg, &mut s, &h3, &mut scratch, &mut bounce)
        .unwrap()
        .unwrap_err();
    assert_eq!(e.status(), Status::Unsupported, "{e}");
    assert!(mem3.iter().all(|&b| b == 0));
    assert_eq!(s.position(), 8);
}

#[test]
fn tcp_receiver_double_buffers_device_copies_and_waits_for_each() {
    let mut mem = vec![0u8; 4096];
    let st = Arc::new(Mutex::new(DeferredState::default()));
    let w = Arc::new(DeferredDevice {
        base: mem.as_mut_ptr() as u64,
        len: mem.len() as u64,
        st: st.clone(),
    });
    let reg = Registry::new();
    // SAFETY: the writer accepts exactly the buffer's addresses.
    let d =
        unsafe { reg.register_device_unchecked_with(w.base, 4096, 0, Some(w.clone())) }.unwrap();
    let payload: Vec<u8> = (0..1000u32).map(|i| (i * 29 + 5) as u8).collect();
    let h = DataHeader {
        flags: wire::DATA_FLAG_CHECKSUM,
        batch: 1,
        region: d.id,
        offset: 300,
        len: 1000,
    };
    let mut scratch = vec![0u8; 100];
    let mut bounce = Some(crate::memory::BounceBuffer::heap(64));
    let mut s = WatchedSocket {
        data: payload.clone(),
        pos: 0,
        st: st.clone(),
    };
    let sum = receive_piece(&reg, &mut s, &h, &mut scratch, &mut bounce)
        .unwrap()
        .unwrap();
    assert_eq!(sum, checksum::piece(d.id, 300, &payload));
    assert_eq!(&mem[300..1300], &payload[..]);
    assert!(mem[..300].iter().chain(&mem[1300..]).all(|&b| b == 0));
    {
        let g = lock(&st);
        assert!(
            g.pending.is_empty(),
            "a copy was not waited before the piece counted"
        );
        assert_eq!(g.started, 1000u64.div_ceil(32));
        assert_eq!(g.landed, g.started);
        assert_eq!(g.most_pending, 2, "the copies did not overlap the reads");
        assert_eq!(g.overwritten, 0);
        assert_eq!(g.reads_into_pending, 0);
    }

    // A copy failing at its wait fails the piece with its reason, after
    // every other copy was waited, and the payload is drained.
    {
        let mut g = lock(&st);
        g.fail_wait_of = Some(g.next + 4);
    }
    mem[300..1300].fill(0);
    let mut s = WatchedSocket {
        data: [payload.clone(), vec![9u8; 5]].concat(),
        pos: 0,
        st: st.clone(),
    };
    let e = receive_piece(&reg, &mut s, &h, &mut scratch, &mut bounce)
        .unwrap()
        .unwrap_err();
    assert_eq!(e.status(), Status::Cuda, "{e}");
    assert!(e.detail().contains("at offset 428"), "{e}");
    assert_eq!(s.pos, 1000);
    let g = lock(&st);
    assert!(g.pending.is_empty());
    assert_eq!(g.overwritten, 0);
    assert_eq!(g.reads_into_pending, 0);
    // Slices 0-3 landed, 4 failed (waited before half 0 was reused for
    // slice 6, so 6 was never read), and 5, already started, was waited.
    assert_eq!(&mem[300..428], &payload[..128]);
    assert!(mem[428..460].iter().all(|&b| b == 0));
    assert_eq!(&mem[460..492], &payload[160..192]);
    assert!(mem[492..].iter().all(|&b| b == 0));
}
