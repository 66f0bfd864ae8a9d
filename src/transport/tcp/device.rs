//! Tcp landing into device memory: the payload of a piece bound for a device
//! region is read into a host bounce buffer and copied to the device by the
//! region's [`DeviceWriter`](crate::memory::DeviceWriter), double-buffered.

use super::inbuf::drain;
use crate::error::{Error, Result, Status};
use crate::transport::checksum;
use crate::transport::wire::{self, DataHeader};
use std::io::Read;

/// Bytes of the host bounce buffer a tcp stream lands device-region payloads
/// in before its device writer copies them (one per stream, on first use),
/// used as two halves of 2 MiB: one is read into while the other is copied.
pub(crate) const DEVICE_BOUNCE_BYTES: usize = 4 << 20;

/// Lands one piece in device memory at `dst` (bounds-checked and pinned by
/// the caller), double-buffered: `bounce` is split in two halves, and while
/// the copy of one slice (started with
/// [`write_async`](crate::memory::DeviceWriter::write_async)) runs from one
/// half, the next slice is read from the socket into the other. A half is
/// rewritten only after its previous copy was waited, and every copy is
/// waited before this returns, so the piece counts as received only once all
/// its bytes are in device memory. A failed copy drains the rest of the
/// payload and fails the piece.
pub(super) fn receive_into_device(
    s: &mut impl Read,
    h: &DataHeader,
    dst: u64,
    w: &dyn crate::memory::DeviceWriter,
    bounce: &mut [u8],
    scratch: &mut [u8],
) -> Result<Result<u64>> {
    let mut hasher = (h.flags & wire::DATA_FLAG_CHECKSUM != 0)
        .then(|| checksum::PieceHasher::new(h.region, h.offset));
    if bounce.is_empty() {
        return Err(Error::new(
            Status::InvalidArgument,
            "empty device bounce buffer",
        ));
    }
    // A one-byte bounce buffer is used as one half (the second is empty).
    let (first, second) = bounce.split_at_mut((bounce.len() / 2).max(1));
    let halves = [first, second];
    // Per half: the copy still reading it (fence, piece-relative offset, length).
    // Dropping a fence waits for it, so an early return (a lost socket)
    // never leaves a copy reading a half that is released or rewritten.
    let mut pending: [Option<(crate::memory::Fence, u64, usize)>; 2] = [None, None];
    let mut failed: Option<(Error, u64, usize)> = None;
    let mut done = 0u64;
    let mut k = 0usize;
    while done < h.len {
        if halves[k].is_empty() {
            k = 0;
        }
        // Reusing half k: its previous copy must be done reading it.
        if let Some((f, at, n)) = pending[k].take() {
            if let Err(e) = f.wait() {
                failed = Some((e, at, n));
                break;
            }
        }
        let n = (h.len - done).min(halves[k].len() as u64) as usize;
        let buf = &mut halves[k][..n];
        s.read_exact(buf)?;
        if let Some(x) = hasher.as_mut() {
            x.update(buf);
        }
        // SAFETY: `buf` lies in `bounce`, which outlives this call; half k is
        // rewritten only after this copy's fence was waited (above), and
        // every fence is waited, or dropped (which waits), before this returns.
        match unsafe { w.write_async(dst + done, buf.as_ptr(), n) } {
            Ok(f) => pending[k] = Some((f, done, n)),
            Err(e) => {
                failed = Some((e, done, n));
                done += n as u64;
                break;
            }
        }
        done += n as u64;
        k ^= 1;
    }
    // Every copy still running is waited, the older first (k is the next half
    // to be reused, hence the older copy).
    for i in [k, k ^ 1] {
        if let Some((f, at, n)) = pending[i].take() {
            if let Err(e) = f.wait() {
                if failed.is_none() {
                    failed = Some((e, at, n));
                }
            }
        }
    }
    if let Some((e, at, n)) = failed {
        drain(s, h.len - done, scratch)?;
        return Ok(Err(Error::new(
            e.status(),
            format!(
                "copying {n} bytes into device region {} at offset {}: {}",
                h.region,
                h.offset + at,
                e.detail()
            ),
        )));
    }
    Ok(Ok(hasher.map_or(0, |x| x.finish())))
}
