//! Token plans, runs and pack sizing over the C ABI. Every function fills
//! caller-provided arrays; call it with NULL arrays and capacity 0 first to
//! learn the length (written to `out_len`).

use super::ptr::{self, Versioned};
use super::{boundary, non_negative, PdxStatus};
use crate::error::{Error, Result, Status};
use crate::layout::runs::RunMerger;
use crate::layout::{self, DcpLayout, PairRequest, Run, SglangChunk, Side};

/// Inputs of SGLang's per-chunk DCP plan (`pdxfer_dcp_token_plan`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxDcpPlanArgs {
    /// `sizeof(PdxDcpPlanArgs)`, set by the caller.
    pub struct_size: u64,
    /// Prefill physical page ids of this chunk.
    pub src_pages: *const i64,
    /// Number of entries in `src_pages`.
    pub num_src_pages: usize,
    /// The whole virtual page list the decode rank sent.
    pub dst_pages: *const i64,
    /// Number of entries in `dst_pages`.
    pub num_dst_pages: usize,
    /// Physical page size P.
    pub page_size: u64,
    /// Decode DCP size D.
    pub dcp_size: u64,
    /// Decode DCP rank r.
    pub dcp_rank: u64,
    /// Index of the chunk's first page after the decode prefix.
    pub src_page_offset: u64,
    /// Tokens the decode side already holds (multiple of P*D).
    pub decode_prefix_len: u64,
    /// Valid tokens in the chunk; -1 means every slot of `src_pages`.
    pub num_tokens: i64,
}

// SAFETY: repr(C), starts with u64 struct_size, integers and raw pointers only (zero is valid).
unsafe impl Versioned for PdxDcpPlanArgs {
    const MIN_SIZE: usize = std::mem::size_of::<PdxDcpPlanArgs>();
    const NAME: &'static str = "PdxDcpPlanArgs";
}

/// One side's DCP layout: page size, DCP size, interleave size.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxLayout {
    /// Tokens per physical page.
    pub page_size: u64,
    /// DCP ranks on this side (1 = none).
    pub dcp_size: u64,
    /// Consecutive tokens kept on one rank (SGLang: 1).
    pub interleave: u64,
}

/// Plan only the packed layout: source rows are indices into a staging buffer.
pub const PDXFER_PLAN_PACKED: u32 = 1;

/// Inputs of the general pair planner (`pdxfer_pair_token_plan`, `pdxfer_pair_runs`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxPairPlanArgs {
    /// `sizeof(PdxPairPlanArgs)`, set by the caller.
    pub struct_size: u64,
    /// Prefill layout.
    pub src_layout: PdxLayout,
    /// Prefill DCP rank.
    pub src_rank: u64,
    /// Prefill rank's page table, starting at `src_origin`.
    pub src_pages: *const i64,
    /// Entries in `src_pages`.
    pub num_src_pages: usize,
    /// Sequence position of the first token `src_pages` covers (aligned to P*W).
    pub src_origin: u64,
    /// Decode layout.
    pub dst_layout: PdxLayout,
    /// Decode DCP rank.
    pub dst_rank: u64,
    /// Decode rank's page table, starting at `dst_origin`.
    pub dst_pages: *const i64,
    /// Entries in `dst_pages`.
    pub num_dst_pages: usize,
    /// Decode prefix length: position of the first token `dst_pages` covers.
    pub dst_origin: u64,
    /// Absolute position of the chunk's first token.
    pub start: u64,
    /// Tokens in the chunk.
    pub num_tokens: u64,
    /// `PDXFER_PLAN_*` flags.
    pub flags: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

// SAFETY: repr(C), starts with u64 struct_size, integers and raw pointers only (zero is valid).
unsafe impl Versioned for PdxPairPlanArgs {
    const MIN_SIZE: usize = std::mem::size_of::<PdxPairPlanArgs>();
    const NAME: &'static str = "PdxPairPlanArgs";
}

/// A run: `len` rows from `src` go to `len` rows from `dst`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PdxRun {
    /// First source row (or packed index).
    pub src: i64,
    /// First destination row.
    pub dst: i64,
    /// Rows in the run.
    pub len: i64,
}

/// A caller page table as u64, refusing negative ids and ids whose rows
/// (`page * page_size + slot`) would not fit int64.
fn pages(p: *const i64, n: usize, page_size: u64, what: &str) -> Result<Vec<u64>> {
    let limit = (i64::MAX as u64) / page_size.max(1);
    ptr::slice(p, n, what)?
        .iter()
        .enumerate()
        .map(|(i, &v)| match u64::try_from(v) {
            Ok(u) if u < limit => Ok(u),
            Ok(_) => Err(Error::invalid(format!(
                "{what}[{i}] = {v} is too large for page_size {page_size}"
            ))),
            Err(_) => Err(Error::invalid(format!("{what}[{i}] = {v} is negative"))),
        })
        .collect()
}

/// Writes the pair's rows straight into the caller's arrays (no intermediate copy).
fn plan_into(
    req: &PairRequest<'_>,
    src: *mut i64,
    dst: *mut i64,
    cap: usize,
    out_len: *mut usize,
) -> Result<Status> {
    req.validate()?;
    let n = req.token_count() as usize;
    ptr::write_out(out_len, n, "out_len")?;
    if src.is_null() && dst.is_null() && cap == 0 {
        return Ok(Status::Ok);
    }
    if cap < n {
        return Err(Error::new(
            Status::BufferTooSmall,
            format!("row arrays hold {cap} items but {n} are needed (written to out_len)"),
        ));
    }
    let s = ptr::slice_mut(src, n, "src_rows")?;
    let d = ptr::slice_mut(dst, n, "dst_rows")?;
    let mut i = 0usize;
    // Rows fit int64: `pages` bounded every page id by i64::MAX / page_size.
    req.for_each_segment(|seg| {
        for k in 0..seg.len {
            s[i] = (seg.src_row + k) as i64;
            d[i] = (seg.dst_row + k) as i64;
            i += 1;
        }
    })?;
    Ok(Status::Ok)
}

/// Counts runs and writes those that fit into the caller's array.
struct RunSink<'a> {
    out: &'a mut [PdxRun],
    count: usize,
}

impl RunSink<'_> {
    fn put(&mut self, r: Run) {
        if let Some(slot) = self.out.get_mut(self.count) {
            // Rows fit int64 (page ids bounded in `pages`, rows checked in coalesce).
            *slot = PdxRun {
                src: r.src as i64,
                dst: r.dst as i64,
                len: r.len as i64,
            };
        }
        self.count += 1;
    }

    fn finish(self, out_len: *mut usize) -> Result<Status> {
        ptr::write_out(out_len, self.count, "out_len")?;
        if self.count > self.out.len() && !self.out.is_empty() {
            return Err(Error::new(
                Status::BufferTooSmall,
                format!(
                    "runs holds {} items but {} are needed (written to out_len)",
                    self.out.len(),
                    self.count
                ),
            ));
        }
        Ok(Status::Ok)
    }
}

fn run_sink<'a>(out: *mut PdxRun, cap: usize, out_len: *mut usize) -> Result<RunSink<'a>> {
    if out_len.is_null() {
        return Err(Error::new(Status::NullArgument, "out_len is NULL"));
    }
    Ok(RunSink {
        out: ptr::slice_mut(out, cap, "runs")?,
        count: 0,
    })
}

/// SGLang's per-chunk DCP token plan for one decode rank.
///
/// Writes `*out_len` rows to `src_rows`/`dst_rows` (each of `capacity`).
/// Errors: `PDX_STATUS_PREFIX_MISALIGNED`, `PDX_STATUS_TOKENS_EXCEED_SOURCE`,
/// `PDX_STATUS_INSUFFICIENT_DESTINATION`, `PDX_STATUS_BUFFER_TOO_SMALL`.
#[no_mangle]
pub extern "C" fn pdxfer_dcp_token_plan(
    args: *const PdxDcpPlanArgs,
    src_rows: *mut i64,
    dst_rows: *mut i64,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::read_versioned(args)?;
        let src = pages(a.src_pages, a.num_src_pages, a.page_size, "src_pages")?;
        let dst = pages(a.dst_pages, a.num_dst_pages, a.page_size, "dst_pages")?;
        let n = if a.num_tokens == -1 {
            None
        } else {
            Some(non_negative(a.num_tokens, "num_tokens")?)
        };
        let chunk = SglangChunk {
            src_pages: &src,
            dst_pages: &dst,
            page_size: a.page_size,
            dcp_size: a.dcp_size,
            dcp_rank: a.dcp_rank,
            src_page_offset: a.src_page_offset,
            decode_prefix_len: a.decode_prefix_len,
            num_tokens: n,
        };
        plan_into(&chunk.to_pair()?, src_rows, dst_rows, capacity, out_len)
    })
}

fn pair_request<'a>(
    a: &PdxPairPlanArgs,
    src: &'a [u64],
    dst: &'a [u64],
) -> Result<PairRequest<'a>> {
    let layout = |l: &PdxLayout| DcpLayout::new(l.page_size, l.dcp_size, l.interleave);
    Ok(PairRequest {
        src: Side {
            layout: layout(&a.src_layout)?,
            rank: a.src_rank,
            pages: src,
            origin: a.src_origin,
        },
        dst: Side {
            layout: layout(&a.dst_layout)?,
            rank: a.dst_rank,
            pages: dst,
            origin: a.dst_origin,
        },
        start: a.start,
        num_tokens: a.num_tokens,
    })
}

/// The pair request's two page tables, checked (see [`pages`]).
fn pair_pages(a: &PdxPairPlanArgs) -> Result<(Vec<u64>, Vec<u64>)> {
    let src = pages(
        a.src_pages,
        a.num_src_pages,
        a.src_layout.page_size,
        "src_pages",
    )?;
    let dst = pages(
        a.dst_pages,
        a.num_dst_pages,
        a.dst_layout.page_size,
        "dst_pages",
    )?;
    Ok((src, dst))
}

/// General per-token plan for one (prefill rank, decode rank) pair and one chunk.
#[no_mangle]
pub extern "C" fn pdxfer_pair_token_plan(
    args: *const PdxPairPlanArgs,
    src_rows: *mut i64,
    dst_rows: *mut i64,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::read_versioned(args)?;
        let (src, dst) = pair_pages(&a)?;
        plan_into(
            &pair_request(&a, &src, &dst)?,
            src_rows,
            dst_rows,
            capacity,
            out_len,
        )
    })
}

/// Runs for one pair and one chunk; with `PDXFER_PLAN_PACKED` in `flags`, the
/// source side is the pair's packed staging buffer (indices `0..n`).
#[no_mangle]
pub extern "C" fn pdxfer_pair_runs(
    args: *const PdxPairPlanArgs,
    runs: *mut PdxRun,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::read_versioned(args)?;
        if a.flags & !PDXFER_PLAN_PACKED != 0 {
            return Err(Error::invalid(format!("unknown flags 0x{:x}", a.flags)));
        }
        let (src, dst) = pair_pages(&a)?;
        let req = pair_request(&a, &src, &dst)?;
        let mut sink = run_sink(runs, capacity, out_len)?;
        req.for_each_run(a.flags & PDXFER_PLAN_PACKED != 0, |r| sink.put(r))?;
        sink.finish(out_len)
    })
}

/// Groups row pairs into runs (breaks wherever either side does not advance by 1).
#[no_mangle]
pub extern "C" fn pdxfer_coalesce_runs(
    src_rows: *const i64,
    dst_rows: *const i64,
    num_rows: usize,
    runs: *mut PdxRun,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let s = ptr::slice(src_rows, num_rows, "src_rows")?;
        let d = ptr::slice(dst_rows, num_rows, "dst_rows")?;
        let mut sink = run_sink(runs, capacity, out_len)?;
        let mut m = RunMerger::default();
        let mut put = |r: Run| sink.put(r);
        for (i, (&a, &b)) in s.iter().zip(d).enumerate() {
            if a < 0 || b < 0 {
                return Err(Error::invalid(format!(
                    "row {i} is negative: src={a}, dst={b}"
                )));
            }
            m.push(a as u64, b as u64, 1, &mut put);
        }
        m.finish(&mut put);
        sink.finish(out_len)
    })
}

/// Bytes of one DCP pack buffer: `D * ceil(max_tokens/D) * sum(kv_item_lens[i]/P)`.
#[no_mangle]
pub extern "C" fn pdxfer_dcp_pack_buffer_bytes(
    kv_item_lens: *const u64,
    num_entries: usize,
    page_size: u64,
    max_tokens: u64,
    dcp_size: u64,
    out_bytes: *mut u64,
) -> PdxStatus {
    boundary(|| {
        let lens = ptr::slice(kv_item_lens, num_entries, "kv_item_lens")?;
        let b = layout::dcp_pack_buffer_bytes(lens, page_size, max_tokens, dcp_size)?;
        ptr::write_out(out_bytes, b, "out_bytes")?;
        super::ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(src: &[i64], dst: &[i64], p: u64, d: u64, r: u64, n: i64) -> PdxDcpPlanArgs {
        PdxDcpPlanArgs {
            struct_size: std::mem::size_of::<PdxDcpPlanArgs>() as u64,
            src_pages: src.as_ptr(),
            num_src_pages: src.len(),
            dst_pages: dst.as_ptr(),
            num_dst_pages: dst.len(),
            page_size: p,
            dcp_size: d,
            dcp_rank: r,
            src_page_offset: 0,
            decode_prefix_len: 0,
            num_tokens: n,
        }
    }

    #[test]
    fn size_query_then_fill() {
        let src = [7i64, 3, 12, 5, 20];
        let dst = [40i64, 9];
        let a = args(&src, &dst, 64, 4, 1, 300);
        let mut n = 0usize;
        assert_eq!(
            pdxfer_dcp_token_plan(&a, std::ptr::null_mut(), std::ptr::null_mut(), 0, &mut n),
            PdxStatus::Ok
        );
        assert_eq!(n, 75);
        let (mut s, mut d) = (vec![0i64; 10], vec![0i64; 10]);
        assert_eq!(
            pdxfer_dcp_token_plan(&a, s.as_mut_ptr(), d.as_mut_ptr(), 10, &mut n),
            PdxStatus::BufferTooSmall
        );
        let (mut s, mut d) = (vec![0i64; 75], vec![0i64; 75]);
        assert_eq!(
            pdxfer_dcp_token_plan(&a, s.as_mut_ptr(), d.as_mut_ptr(), 75, &mut n),
            PdxStatus::Ok
        );
        assert_eq!((s[0], d[0], s[74], d[74]), (449, 2560, 1321, 586));
    }

    #[test]
    fn bad_inputs_are_errors_not_crashes() {
        let mut n = 0usize;
        assert_eq!(
            pdxfer_dcp_token_plan(
                std::ptr::null(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                &mut n
            ),
            PdxStatus::NullArgument
        );
        let src = [-1i64];
        let a = args(&src, &[], 4, 2, 0, 1);
        assert_eq!(
            pdxfer_dcp_token_plan(&a, std::ptr::null_mut(), std::ptr::null_mut(), 0, &mut n),
            PdxStatus::InvalidArgument
        );
        let mut small = args(&[1], &[2], 4, 2, 0, 1);
        small.struct_size = 8;
        assert_eq!(
            pdxfer_dcp_token_plan(
                &small,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                &mut n
            ),
            PdxStatus::AbiMismatch
        );
        let mut nullpages = args(&[1], &[2], 4, 2, 0, 1);
        nullpages.src_pages = std::ptr::null();
        assert_eq!(
            pdxfer_dcp_token_plan(
                &nullpages,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                &mut n
            ),
            PdxStatus::NullArgument
        );
        let a = args(&[1], &[2], 4, 2, 0, 1);
        assert_eq!(
            pdxfer_dcp_token_plan(
                &a,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut()
            ),
            PdxStatus::NullArgument
        );
    }
}
