//! The relayout on the CPU, for host pools and as the reference the CUDA
//! kernels are checked against (byte for byte, `tests/gpu/kernel_harness.rs`).
//!
//! [`gather`] packs one pair's rows from pool entries into an entry-major pack
//! buffer ([`PackLayout`]); [`scatter`] unpacks them into destination rows.
//! Both check every span against the slices first and copy nothing when one is
//! out of bounds. [`copy_spans_raw`] is the unchecked form over addresses, the
//! same contract as the kernels.

use super::CopyEntry;
use crate::error::{Error, Result, Status};
use crate::layout::{PackLayout, Run};

/// Byte range of `rows` rows from `row` with `row_bytes`, checked against `len`.
fn rows_range(
    row: u64,
    rows: u64,
    row_bytes: u64,
    len: usize,
    what: &str,
    entry: usize,
) -> Result<std::ops::Range<usize>> {
    let start = row.checked_mul(row_bytes);
    let end = row.checked_add(rows).and_then(|r| r.checked_mul(row_bytes));
    match (start, end) {
        (Some(s), Some(e)) if e <= len as u64 => Ok(s as usize..e as usize),
        _ => Err(Error::new(
            Status::OutOfBounds,
            format!(
                "relayout span out of bounds: {what} entry {entry}, rows {row}..{} of {row_bytes} B exceed its {len} B",
                row.saturating_add(rows)
            ),
        )),
    }
}

fn check_shapes(entries: usize, row_bytes: &[u64], pack: &PackLayout, buf: usize) -> Result<()> {
    if entries != row_bytes.len() || pack.entry_offsets.len() != row_bytes.len() {
        return Err(Error::invalid(format!(
            "relayout entries disagree: {entries} pools, {} row sizes, {} pack entries",
            row_bytes.len(),
            pack.entry_offsets.len()
        )));
    }
    if pack.total_bytes > buf as u64 {
        return Err(Error::new(
            Status::BufferTooSmall,
            format!(
                "pack buffer holds {buf} B, the layout needs {} B",
                pack.total_bytes
            ),
        ));
    }
    Ok(())
}

/// Packed byte range of entry `e` rows `idx..idx+rows`, within the entry's block.
fn pack_range(
    pack: &PackLayout,
    e: usize,
    idx: u64,
    rows: u64,
    rb: u64,
) -> Result<std::ops::Range<usize>> {
    if idx.saturating_add(rows) > pack.tokens {
        return Err(Error::new(
            Status::OutOfBounds,
            format!(
                "relayout span out of bounds: packed rows {idx}..{} of entry {e} exceed the {} packed tokens",
                idx.saturating_add(rows),
                pack.tokens
            ),
        ));
    }
    let base = pack.entry_offsets[e] as usize;
    Ok(base + (idx * rb) as usize..base + ((idx + rows) * rb) as usize)
}

/// Copies `spans` (pool row -> packed index) of every entry from `pools` into
/// `out`, laid out as `pack`.
pub fn gather(
    pools: &[&[u8]],
    row_bytes: &[u64],
    spans: &[Run],
    pack: &PackLayout,
    out: &mut [u8],
) -> Result<()> {
    check_shapes(pools.len(), row_bytes, pack, out.len())?;
    let mut ops = Vec::with_capacity(spans.len() * pools.len());
    for (e, (pool, &rb)) in pools.iter().zip(row_bytes).enumerate() {
        for s in spans {
            let src = rows_range(s.src, s.len, rb, pool.len(), "source pool", e)?;
            let dst = pack_range(pack, e, s.dst, s.len, rb)?;
            ops.push((e, src, dst));
        }
    }
    for (e, src, dst) in ops {
        out[dst].copy_from_slice(&pools[e][src]);
    }
    Ok(())
}

/// Copies `spans` (packed index -> pool row) of every entry from `packed`,
/// laid out as `pack`, into `pools`.
pub fn scatter(
    packed: &[u8],
    pack: &PackLayout,
    row_bytes: &[u64],
    spans: &[Run],
    pools: &mut [&mut [u8]],
) -> Result<()> {
    check_shapes(pools.len(), row_bytes, pack, packed.len())?;
    let mut ops = Vec::with_capacity(spans.len() * pools.len());
    for (e, (pool, &rb)) in pools.iter().zip(row_bytes).enumerate() {
        for s in spans {
            let src = pack_range(pack, e, s.src, s.len, rb)?;
            let dst = rows_range(s.dst, s.len, rb, pool.len(), "destination pool", e)?;
            ops.push((e, src, dst));
        }
    }
    for (e, src, dst) in ops {
        pools[e][dst].copy_from_slice(&packed[src]);
    }
    Ok(())
}

/// Copies every span of every entry between raw host addresses: the contract
/// of the CUDA kernels (`pdx_gather` / `pdx_scatter`), on the CPU.
///
/// # Safety
/// For every entry and span, `src + src_row * row_bytes` must be readable and
/// `dst + dst_row * row_bytes` writable for `len * row_bytes` bytes, and no
/// destination byte may overlap a source byte or another destination byte.
pub unsafe fn copy_spans_raw(entries: &[CopyEntry], spans: &[Run]) {
    for e in entries {
        for s in spans {
            let (src, dst, n) = span_bytes(e, s);
            // SAFETY: the caller guarantees both ranges are valid and disjoint.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        }
    }
}

/// The source, destination and length in bytes of span `s` of entry `e`.
fn span_bytes(e: &CopyEntry, s: &Run) -> (*const u8, *mut u8, usize) {
    let n = (s.len * e.row_bytes) as usize;
    let src = (e.src + s.src * e.row_bytes) as usize as *const u8;
    let dst = (e.dst + s.dst * e.row_bytes) as usize as *mut u8;
    (src, dst, n)
}

/// Span `s` of entry `e` for a streaming kernel: its bytes when the
/// destination is `align`-byte aligned and the length a multiple of 64;
/// otherwise the span is copied here, plainly, and `None` is returned.
///
/// # Safety
/// The contract of [`copy_spans_raw`] for this span.
unsafe fn streamable(e: &CopyEntry, s: &Run, align: usize) -> Option<(*const u8, *mut u8, usize)> {
    let (src, dst, n) = span_bytes(e, s);
    if (dst as usize).is_multiple_of(align) && n.is_multiple_of(64) {
        return Some((src, dst, n));
    }
    // SAFETY: the caller guarantees both ranges are valid and disjoint.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
    None
}

/// [`copy_spans_raw`] with non-temporal (streaming) stores where the CPU
/// and the destination allow it (x86_64 with AVX-512F: rows 64-byte aligned
/// and a multiple of 64 bytes; else with AVX2: 32-byte aligned, a multiple
/// of 64 bytes): a destination written once and not read back here skips
/// the read-for-ownership of every cache line, as a large `memcpy` does
/// (glibc streams only copies larger than a fraction of the last-level
/// cache, and each row here is far smaller). Other rows, and other CPUs, are
/// copied as in `copy_spans_raw`. Ends with a store fence, so the bytes are
/// ordered before whatever the caller publishes next.
///
/// # Safety
/// As [`copy_spans_raw`].
pub unsafe fn copy_spans_streaming(entries: &[CopyEntry], spans: &[Run]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F is present (checked just above); the caller's contract.
            unsafe { streaming_avx512(entries, spans) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked just above); the caller's contract.
            unsafe { streaming_avx2(entries, spans) };
            return;
        }
    }
    // SAFETY: the caller's contract.
    unsafe { copy_spans_raw(entries, spans) }
}

/// The AVX-512 body of [`copy_spans_streaming`]: 256 bytes (four 64-byte
/// stores, one cache line each) per step, and the next span's first lines
/// asked for while this one is copied (a span of the one-copy path is
/// often one row, far from the previous one in the source: the hardware
/// prefetcher does not follow). A third faster than the AVX2 body on
/// 1152-byte rows of a DCP split here (two threads, 575.7 MB: 40 against
/// 56 ms).
///
/// # Safety
/// AVX-512F is available; the contract of [`copy_spans_raw`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn streaming_avx512(entries: &[CopyEntry], spans: &[Run]) {
    use std::arch::x86_64::{
        __m512i, _mm512_loadu_si512, _mm512_stream_si512, _mm_prefetch, _mm_sfence, _MM_HINT_T0,
    };
    for e in entries {
        for (k, s) in spans.iter().enumerate() {
            if let Some(next) = spans.get(k + 1) {
                let p = (e.src + next.src * e.row_bytes) as usize as *const i8;
                let len = next.len * e.row_bytes;
                for off in [0u64, 512, 1024] {
                    if off < len {
                        // a hint: it reads nothing the program sees and never faults
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off as usize));
                    }
                }
            }
            // SAFETY: the caller guarantees both ranges are valid and disjoint.
            let Some((src, dst, n)) = (unsafe { streamable(e, s, 64) }) else {
                continue;
            };
            let (sp, dp) = (src as *const __m512i, dst as *mut __m512i);
            let lines = n / 64;
            let mut i = 0;
            while i + 4 <= lines {
                // SAFETY: lines i..i + 4 lie in the caller's ranges (i + 4 <=
                // n / 64); dst is 64-byte aligned (checked above); the loads
                // may be unaligned.
                unsafe {
                    let a = _mm512_loadu_si512(sp.add(i));
                    let b = _mm512_loadu_si512(sp.add(i + 1));
                    let c = _mm512_loadu_si512(sp.add(i + 2));
                    let d = _mm512_loadu_si512(sp.add(i + 3));
                    _mm512_stream_si512(dp.add(i), a);
                    _mm512_stream_si512(dp.add(i + 1), b);
                    _mm512_stream_si512(dp.add(i + 2), c);
                    _mm512_stream_si512(dp.add(i + 3), d);
                }
                i += 4;
            }
            while i < lines {
                // SAFETY: as above, for line i < n / 64.
                unsafe { _mm512_stream_si512(dp.add(i), _mm512_loadu_si512(sp.add(i))) };
                i += 1;
            }
        }
    }
    _mm_sfence();
}

/// The AVX2 body of [`copy_spans_streaming`].
///
/// # Safety
/// AVX2 is available; the contract of [`copy_spans_raw`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn streaming_avx2(entries: &[CopyEntry], spans: &[Run]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    for e in entries {
        for s in spans {
            // SAFETY: the caller guarantees both ranges are valid and disjoint.
            let Some((src, dst, n)) = (unsafe { streamable(e, s, 32) }) else {
                continue;
            };
            let (sp, dp) = (src as *const __m256i, dst as *mut __m256i);
            for i in (0..n / 32).step_by(2) {
                // SAFETY: i + 1 < n / 32 (n is a multiple of 64): both 32-byte
                // words lie in the caller's ranges; dst is 32-byte aligned
                // (checked above); the loads may be unaligned.
                unsafe {
                    let a = _mm256_loadu_si256(sp.add(i));
                    let b = _mm256_loadu_si256(sp.add(i + 1));
                    _mm256_stream_si256(dp.add(i), a);
                    _mm256_stream_si256(dp.add(i + 1), b);
                }
            }
        }
    }
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(entry: u8, rows: usize, rb: usize) -> Vec<u8> {
        (0..rows * rb)
            .map(|i| (i as u8).wrapping_mul(7) ^ entry)
            .collect()
    }

    /// The streaming kernels this CPU can run, by name.
    #[allow(clippy::type_complexity)]
    fn streaming_kernels() -> Vec<(&'static str, unsafe fn(&[CopyEntry], &[Run]))> {
        let mut k: Vec<(&'static str, unsafe fn(&[CopyEntry], &[Run]))> =
            vec![("dispatch", copy_spans_streaming)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F is present; the caller's contract is the kernel's.
                k.push(("avx512", |e, s| unsafe { streaming_avx512(e, s) }));
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 is present; the caller's contract is the kernel's.
                k.push(("avx2", |e, s| unsafe { streaming_avx2(e, s) }));
            }
        }
        k
    }

    #[test]
    fn streaming_copy_matches_the_plain_one_on_aligned_and_unaligned_rows() {
        for (name, kernel) in streaming_kernels() {
            streaming_matches_plain(name, kernel);
        }
    }

    fn streaming_matches_plain(name: &str, kernel: unsafe fn(&[CopyEntry], &[Run])) {
        // row sizes: streamed (1152 = 18 x 64: four 256-byte steps and two
        // lines; 320: one step and one line; 64), and copied plainly (100,
        // not a multiple of 64)
        for rb in [1152u64, 320, 64, 100] {
            let rows = 64usize;
            let src: Vec<u8> = (0..rows * rb as usize)
                .map(|i| (i * 31 % 251) as u8)
                .collect();
            // a 64-byte aligned destination, one 32-byte but not 64-byte
            // aligned, and one at offset 8 (not 32-byte aligned)
            for skew in [0usize, 32, 8] {
                let mut a = vec![0u8; rows * rb as usize + 128];
                let mut b = a.clone();
                let base = |v: &mut Vec<u8>| {
                    let p = v.as_mut_ptr() as usize;
                    (p.next_multiple_of(64) + skew) as u64
                };
                let spans = [
                    Run {
                        src: 3,
                        dst: 0,
                        len: 1,
                    },
                    Run {
                        src: 7,
                        dst: 1,
                        len: 4,
                    },
                    Run {
                        src: 40,
                        dst: 9,
                        len: 20,
                    },
                ];
                let entry = |dst| CopyEntry {
                    src: src.as_ptr() as u64,
                    dst,
                    row_bytes: rb,
                    reserved: 0,
                };
                let (ea, eb) = (entry(base(&mut a)), entry(base(&mut b)));
                // SAFETY: every span lies in `src` and in the destinations (64 rows + 128 B of slack).
                unsafe {
                    copy_spans_raw(&[ea], &spans);
                    kernel(&[eb], &spans);
                }
                let len = rows * rb as usize;
                let oa = (ea.dst - a.as_ptr() as u64) as usize;
                let ob = (eb.dst - b.as_ptr() as u64) as usize;
                assert_eq!(
                    a[oa..oa + len],
                    b[ob..ob + len],
                    "{name}: row {rb} B, skew {skew}"
                );
                assert!(a[oa..oa + len].iter().any(|&x| x != 0));
            }
        }
    }

    #[test]
    fn gather_packs_entry_major() {
        let rb = [4u64, 3];
        let (p0, p1) = (pool(1, 10, 4), pool(2, 10, 3));
        let spans = [
            Run {
                src: 2,
                dst: 0,
                len: 2,
            },
            Run {
                src: 7,
                dst: 2,
                len: 1,
            },
        ];
        let pack = PackLayout::new(3, &rb).unwrap();
        let mut out = vec![0u8; pack.total_bytes as usize];
        gather(&[&p0, &p1], &rb, &spans, &pack, &mut out).unwrap();
        // entry 0: rows 2,3,7 of 4 B; entry 1 at 12: rows 2,3,7 of 3 B
        let mut want = Vec::new();
        want.extend_from_slice(&p0[8..16]);
        want.extend_from_slice(&p0[28..32]);
        want.extend_from_slice(&p1[6..12]);
        want.extend_from_slice(&p1[21..24]);
        assert_eq!(out, want);

        // scatter it back into fresh pools at other rows
        let (mut d0, mut d1) = (vec![0u8; 40], vec![0u8; 30]);
        let back = [Run {
            src: 0,
            dst: 5,
            len: 3,
        }];
        scatter(&out, &pack, &rb, &back, &mut [&mut d0, &mut d1]).unwrap();
        assert_eq!(&d0[20..28], &p0[8..16]);
        assert_eq!(&d0[28..32], &p0[28..32]);
        assert_eq!(&d1[15..24], &want[12..21]);
        assert!(d0[..20].iter().all(|&b| b == 0));
    }

    #[test]
    fn out_of_bounds_copies_nothing() {
        let rb = [4u64];
        let p0 = pool(1, 4, 4);
        let pack = PackLayout::new(2, &rb).unwrap();
        let mut out = vec![0u8; 8];
        let spans = [
            Run {
                src: 0,
                dst: 0,
                len: 1,
            },
            Run {
                src: 4,
                dst: 1,
                len: 1,
            },
        ];
        let e = gather(&[&p0], &rb, &spans, &pack, &mut out).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds);
        assert!(e.detail().contains("rows 4..5"), "{e}");
        assert!(
            out.iter().all(|&b| b == 0),
            "nothing copied before the check"
        );
        let too_many = [Run {
            src: 0,
            dst: 1,
            len: 2,
        }];
        let e = gather(&[&p0], &rb, &too_many, &pack, &mut out).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds);
        let e = gather(&[&p0], &rb, &spans, &pack, &mut out[..4]).unwrap_err();
        assert_eq!(e.status(), Status::BufferTooSmall);
        let e = gather(&[&p0, &p0], &rb, &spans, &pack, &mut out).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        let huge = [Run {
            src: u64::MAX / 2,
            dst: 0,
            len: 1,
        }];
        let e = gather(&[&p0], &rb, &huge, &pack, &mut out).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds);
    }

    #[test]
    fn raw_copy_matches_gather() {
        let rb = [5u64, 16];
        let (p0, p1) = (pool(3, 8, 5), pool(4, 8, 16));
        let spans = [
            Run {
                src: 1,
                dst: 0,
                len: 3,
            },
            Run {
                src: 6,
                dst: 3,
                len: 2,
            },
        ];
        let pack = PackLayout::new(5, &rb).unwrap();
        let mut a = vec![0u8; pack.total_bytes as usize];
        gather(&[&p0, &p1], &rb, &spans, &pack, &mut a).unwrap();
        let mut b = vec![0u8; pack.total_bytes as usize];
        let entries = super::super::gather_entries(
            &[p0.as_ptr() as u64, p1.as_ptr() as u64],
            &rb,
            b.as_mut_ptr() as u64,
            &pack,
        )
        .unwrap();
        // SAFETY: the spans were bounds-checked by `gather` above on the same shapes.
        unsafe { copy_spans_raw(&entries, &spans) };
        assert_eq!(a, b);
    }
}
