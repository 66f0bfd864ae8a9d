//! Runs the CUDA kernel source (`cuda/relayout.cu`) on the CPU through the
//! host harness (`cuda/host_harness.h`, which emulates the grid) and compares
//! its output byte for byte with the Rust CPU relayout on random plans.
//!
//! The harness is built with `g++` (or `$CXX`) into a shared library in the
//! test's temp dir and loaded with `dlopen`.

use pdxfer::layout::{DcpLayout, PackLayout, PairRequest, Run, SglangChunk, Side};
use pdxfer::relayout::{self, cpu, CopyEntry};
use pdxfer::rng::SplitMix64;
use std::ffi::CString;
use std::path::PathBuf;
use std::process::Command;

type LaunchFn = unsafe extern "C" fn(
    which: i32,
    entries: *const CopyEntry,
    num_entries: u32,
    spans: *const Run,
    num_spans: u64,
    grid_x: u32,
    grid_y: u32,
    block_x: u32,
) -> i32;

struct Harness {
    launch: LaunchFn,
}

fn build_harness() -> Harness {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // one file per build: tests run in parallel, and dlopen of a file another
    // test is still writing fails
    static BUILDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("libpdx_host_harness_{}_{n}.so", std::process::id()));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let status = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fno-strict-aliasing",
            "-shared",
            "-fPIC",
            "-o",
        ])
        .arg(&out)
        .arg(root.join("cuda/host_harness.cpp"))
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cxx} (a C++ compiler is required): {e}"));
    assert!(status.success(), "{cxx} failed to build the host harness");
    let path = CString::new(out.to_str().unwrap()).unwrap();
    // SAFETY: dlopen of a library we just built; the handle is leaked on purpose.
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "dlopen of the host harness failed");
    // SAFETY: h is a valid handle and the name is NUL-terminated.
    let sym = unsafe { libc::dlsym(h, c"pdx_harness_launch".as_ptr()) };
    assert!(!sym.is_null(), "pdx_harness_launch not found");
    Harness {
        // SAFETY: the symbol is the function defined in cuda/host_harness.cpp with this signature.
        launch: unsafe { std::mem::transmute::<*mut libc::c_void, LaunchFn>(sym) },
    }
}

/// A buffer whose usable part starts `offset` bytes past a 16-byte boundary.
struct Buf {
    mem: Vec<u128>,
    offset: usize,
    len: usize,
}
impl Buf {
    fn new(data: &[u8], offset: usize) -> Buf {
        let mut mem = vec![0u128; (data.len() + offset).div_ceil(16) + 1];
        let mut b = Buf {
            mem: Vec::new(),
            offset,
            len: data.len(),
        };
        // SAFETY: mem has at least offset + len bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (mem.as_mut_ptr() as *mut u8).add(offset),
                data.len(),
            )
        };
        b.mem = std::mem::take(&mut mem);
        b
    }
    fn addr(&mut self) -> u64 {
        // SAFETY: offset is inside the allocation.
        unsafe { (self.mem.as_mut_ptr() as *mut u8).add(self.offset) as u64 }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: offset + len is inside the allocation and initialised.
        unsafe {
            std::slice::from_raw_parts((self.mem.as_ptr() as *const u8).add(self.offset), self.len)
        }
    }
}

struct Case {
    row_bytes: Vec<u64>,
    pools: Vec<Vec<u8>>,
    gather: Vec<Run>,
    scatter: Vec<Run>,
    dst_pool_bytes: Vec<usize>,
    tokens: u64,
}

fn random_case(rng: &mut SplitMix64) -> Case {
    if rng.below(3) == 0 {
        return random_general_case(rng);
    }
    let p = rng.pick(&[1u64, 2, 4, 16, 64]);
    let d = rng.pick(&[1u64, 2, 3, 4, 8]);
    let r = rng.below(d);
    let src_n_pages = 1 + rng.below(6) as usize;
    let n = 1 + rng.below(src_n_pages as u64 * p);
    let src_pool_pages = src_n_pages as u64 + rng.below(4);
    let src_pages = rng.pages(src_n_pages, src_pool_pages);
    let need = n.div_ceil(p * d) as usize;
    let dst_pool_pages = need as u64 + rng.below(4);
    let dst_pages = rng.pages(need, dst_pool_pages);
    let chunk = SglangChunk {
        src_pages: &src_pages,
        dst_pages: &dst_pages,
        page_size: p,
        dcp_size: d,
        dcp_rank: r,
        src_page_offset: 0,
        decode_prefix_len: 0,
        num_tokens: Some(n),
    };
    let req = chunk.to_pair().unwrap();
    finish_case(rng, &req, src_pool_pages * p, dst_pool_pages * p)
}

/// General planner: DCP and interleave on both sides, different page sizes.
fn random_general_case(rng: &mut SplitMix64) -> Case {
    let (ps, pd) = (rng.pick(&[2u64, 4, 8]), rng.pick(&[1u64, 2, 4, 8]));
    let (ws, wd) = (1 + rng.below(3), 1 + rng.below(4));
    let is = rng.pick(&[1u64, 2]).min(ps);
    let id = if pd % 2 == 0 { rng.pick(&[1u64, 2]) } else { 1 };
    let src = DcpLayout::new(ps, ws, is).unwrap();
    let dst = DcpLayout::new(pd, wd, id).unwrap();
    let n = 1 + rng.below(150);
    let sn = n.div_ceil(ps * ws) as usize + 1;
    let dn = n.div_ceil(pd * wd) as usize + 1;
    let (spool, dpool) = (sn as u64 + rng.below(3), dn as u64 + rng.below(3));
    let spages = rng.pages(sn, spool);
    let dpages = rng.pages(dn, dpool);
    let req = PairRequest {
        src: Side {
            layout: src,
            rank: rng.below(ws),
            pages: &spages,
            origin: 0,
        },
        dst: Side {
            layout: dst,
            rank: rng.below(wd),
            pages: &dpages,
            origin: 0,
        },
        start: 0,
        num_tokens: n,
    };
    finish_case(rng, &req, spool * ps, dpool * pd)
}

fn finish_case(rng: &mut SplitMix64, req: &PairRequest<'_>, src_rows: u64, dst_rows: u64) -> Case {
    let gather = relayout::gather_spans(req).unwrap();
    let scatter = relayout::scatter_spans(req).unwrap();
    let tokens = req.token_count();
    let entries = 1 + rng.below(5) as usize;
    let row_bytes: Vec<u64> = (0..entries)
        .map(|_| rng.pick(&[1u64, 3, 16, 48, 100, 576, 1152, 1168]))
        .collect();
    let pools = row_bytes
        .iter()
        .map(|&rb| rng.bytes((src_rows * rb) as usize))
        .collect();
    let dst_pool_bytes = row_bytes
        .iter()
        .map(|&rb| (dst_rows * rb) as usize)
        .collect();
    Case {
        row_bytes,
        pools,
        gather,
        scatter,
        dst_pool_bytes,
        tokens,
    }
}

#[test]
fn kernel_source_matches_cpu_relayout_on_random_plans() {
    let h = build_harness();
    let mut rng = SplitMix64::new(0x5eed_0f9d_7fe2);
    for case_no in 0..90 {
        let c = random_case(&mut rng);
        let pack = PackLayout::new(c.tokens, &c.row_bytes).unwrap();
        let junk = rng.bytes(pack.total_bytes as usize);

        // CPU reference gather into a pre-filled buffer.
        let pools: Vec<&[u8]> = c.pools.iter().map(|v| v.as_slice()).collect();
        let mut want = junk.clone();
        cpu::gather(&pools, &c.row_bytes, &c.gather, &pack, &mut want).unwrap();

        // Kernel gather: random misalignment, random span splitting and grid.
        let same_align = rng.below(2) == 0;
        let pack_off = rng.below(16) as usize;
        let mut src_bufs: Vec<Buf> = c
            .pools
            .iter()
            .map(|v| {
                let off = if same_align {
                    pack_off
                } else {
                    rng.below(16) as usize
                };
                Buf::new(v, off)
            })
            .collect();
        let mut pack_buf = Buf::new(&junk, pack_off);
        let bases: Vec<u64> = src_bufs.iter_mut().map(|b| b.addr()).collect();
        let entries =
            relayout::gather_entries(&bases, &c.row_bytes, pack_buf.addr(), &pack).unwrap();
        let spans = relayout::split_spans(&c.gather, 1 + rng.below(8));
        let spw = 1 + rng.below(8) as u32;
        let (mut gx, mut gy, bx) =
            relayout::launch_dims(spans.len() as u64, entries.len() as u32, spw);
        if rng.below(2) == 0 {
            // small grids exercise the grid-stride loops
            gx = 1 + rng.below(2) as u32;
            gy = 1 + rng.below(2) as u32;
        }
        // SAFETY: all addresses are live buffers sized by the same plan the CPU gather checked.
        let rc = unsafe {
            (h.launch)(
                0,
                entries.as_ptr(),
                entries.len() as u32,
                spans.as_ptr(),
                spans.len() as u64,
                gx,
                gy,
                bx,
            )
        };
        assert_eq!(rc, 0);
        assert!(
            pack_buf.bytes() == want.as_slice(),
            "case {case_no}: gather differs (rows {:?}, grid {gx}x{gy})",
            c.row_bytes
        );

        // Scatter the packed tokens into destination pools, both ways.
        let dst_init: Vec<Vec<u8>> = c.dst_pool_bytes.iter().map(|&n| rng.bytes(n)).collect();
        let mut cpu_dst = dst_init.clone();
        {
            let mut refs: Vec<&mut [u8]> = cpu_dst.iter_mut().map(|v| v.as_mut_slice()).collect();
            cpu::scatter(&want, &pack, &c.row_bytes, &c.scatter, &mut refs).unwrap();
        }
        let mut dst_bufs: Vec<Buf> = dst_init
            .iter()
            .map(|v| Buf::new(v, rng.below(16) as usize))
            .collect();
        let dbases: Vec<u64> = dst_bufs.iter_mut().map(|b| b.addr()).collect();
        let entries =
            relayout::scatter_entries(&dbases, &c.row_bytes, pack_buf.addr(), &pack).unwrap();
        let spans = relayout::split_spans(&c.scatter, 1 + rng.below(100));
        let (gx, gy, bx) = relayout::launch_dims(
            spans.len() as u64,
            entries.len() as u32,
            relayout::DEFAULT_SPANS_PER_WARP,
        );
        // SAFETY: as above, for the scatter plan.
        let rc = unsafe {
            (h.launch)(
                1,
                entries.as_ptr(),
                entries.len() as u32,
                spans.as_ptr(),
                spans.len() as u64,
                gx,
                gy,
                bx,
            )
        };
        assert_eq!(rc, 0);
        for (e, (b, w)) in dst_bufs.iter().zip(&cpu_dst).enumerate() {
            assert!(
                b.bytes() == w.as_slice(),
                "case {case_no}: scatter differs at entry {e}"
            );
        }
    }
}

#[test]
fn vector_path_head_and_tail_and_long_spans() {
    // Long spans with equal misalignment take the 16-byte path with byte head and
    // tail; unequal misalignment takes the byte path. Both must be exact.
    let h = build_harness();
    let mut rng = SplitMix64::new(42);
    for (soff, doff, rb, rows) in [
        (0, 0, 1152u64, 300u64),
        (5, 5, 1152, 77),
        (3, 11, 1152, 50),
        (7, 7, 33, 1000),
        (0, 0, 16, 1),
    ] {
        let src: Vec<u8> = rng.bytes((rb * rows * 2) as usize);
        let dst0 = rng.bytes((rb * rows) as usize);
        let mut sb = Buf::new(&src, soff);
        let mut db = Buf::new(&dst0, doff);
        let e = [CopyEntry {
            src: sb.addr(),
            dst: db.addr(),
            row_bytes: rb,
            reserved: 0,
        }];
        let spans = [Run {
            src: rows,
            dst: 0,
            len: rows,
        }];
        // SAFETY: the span is inside both buffers.
        let rc = unsafe { (h.launch)(0, e.as_ptr(), 1, spans.as_ptr(), 1, 1, 1, 32) };
        assert_eq!(rc, 0);
        assert!(
            db.bytes() == &src[(rb * rows) as usize..],
            "offsets {soff}/{doff}, row {rb}"
        );
    }
    // an unknown kernel id is refused
    // SAFETY: no memory is touched for an unknown kernel.
    let rc = unsafe { (h.launch)(7, std::ptr::null(), 0, std::ptr::null(), 0, 1, 1, 32) };
    assert_eq!(rc, -1);
}
