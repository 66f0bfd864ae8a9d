//! Token plans, runs and pack sizing over the C ABI. Every function fills
//! caller-provided arrays; call it with NULL arrays and capacity 0 first to
//! learn the length (written to `out_len`).

use super::ptr::{self, Versioned};
use super::{boundary, non_negative, PdxStatus};
use crate::error::{Error, Result, Status};
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

fn pages(p: *const i64, n: usize, what: &str) -> Result<Vec<u64>> {
    ptr::slice(p, n, what)?
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            u64::try_from(v).map_err(|_| Error::invalid(format!("{what}[{i}] = {v} is negative")))
        })
        .collect()
}

fn to_i64(v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::invalid(format!("row {v} does not fit int64")))
}

fn fill_rows(
    plan: &layout::TokenPlan,
    src: *mut i64,
    dst: *mut i64,
    cap: usize,
    out_len: *mut usize,
) -> Result<Status> {
    ptr::write_out(out_len, plan.len(), "out_len")?;
    if src.is_null() && dst.is_null() && cap == 0 {
        return Ok(Status::Ok);
    }
    if cap < plan.len() {
        return Err(Error::new(
            Status::BufferTooSmall,
            format!(
                "row arrays hold {cap} items but {} are needed (written to out_len)",
                plan.len()
            ),
        ));
    }
    let s = ptr::slice_mut(src, plan.len(), "src_rows")?;
    let d = ptr::slice_mut(dst, plan.len(), "dst_rows")?;
    for (o, &v) in s.iter_mut().zip(&plan.src_rows) {
        *o = to_i64(v)?;
    }
    for (o, &v) in d.iter_mut().zip(&plan.dst_rows) {
        *o = to_i64(v)?;
    }
    Ok(Status::Ok)
}

fn fill_runs(runs: &[Run], out: *mut PdxRun, cap: usize, out_len: *mut usize) -> Result<Status> {
    let conv: Result<Vec<PdxRun>> = runs
        .iter()
        .map(|r| {
            Ok(PdxRun {
                src: to_i64(r.src)?,
                dst: to_i64(r.dst)?,
                len: to_i64(r.len)?,
            })
        })
        .collect();
    ptr::fill(&conv?, out, cap, out_len, "runs")
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
        let src = pages(a.src_pages, a.num_src_pages, "src_pages")?;
        let dst = pages(a.dst_pages, a.num_dst_pages, "dst_pages")?;
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
        let req = chunk.to_pair()?;
        req.validate()?;
        if src_rows.is_null() && dst_rows.is_null() && capacity == 0 {
            ptr::write_out(out_len, req.token_count() as usize, "out_len")?;
            return Ok(Status::Ok);
        }
        fill_rows(&req.plan()?, src_rows, dst_rows, capacity, out_len)
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
        let src = pages(a.src_pages, a.num_src_pages, "src_pages")?;
        let dst = pages(a.dst_pages, a.num_dst_pages, "dst_pages")?;
        let req = pair_request(&a, &src, &dst)?;
        req.validate()?;
        if src_rows.is_null() && dst_rows.is_null() && capacity == 0 {
            ptr::write_out(out_len, req.token_count() as usize, "out_len")?;
            return Ok(Status::Ok);
        }
        fill_rows(&req.plan()?, src_rows, dst_rows, capacity, out_len)
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
        let src = pages(a.src_pages, a.num_src_pages, "src_pages")?;
        let dst = pages(a.dst_pages, a.num_dst_pages, "dst_pages")?;
        let req = pair_request(&a, &src, &dst)?;
        fill_runs(
            &req.runs(a.flags & PDXFER_PLAN_PACKED != 0)?,
            runs,
            capacity,
            out_len,
        )
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
        let s = pages(src_rows, num_rows, "src_rows")?;
        let d = pages(dst_rows, num_rows, "dst_rows")?;
        fill_runs(&layout::coalesce_runs(&s, &d)?, runs, capacity, out_len)
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
