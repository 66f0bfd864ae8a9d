//! Runs the device code path (`relayout::gpu`: context, stream, module load,
//! table uploads, launches, events, sliced gather, the self-check and the
//! benchmark loop) against `cuda/fake_driver.cpp`, a CPU stand-in for
//! libcuda that executes the kernels with the host harness, and NCCL pair
//! transfers (`transport::nccl`, Direct and Staged) against
//! `cuda/fake_nccl.cpp`, two ranks in one process. cudarc loads
//! libcuda once per process and glibc reads LD_LIBRARY_PATH at start-up, so
//! the checks run in a child process (this test binary, `--ignored --exact
//! child_device_path_on_fake_driver`) whose LD_LIBRARY_PATH holds the fake.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::Command;

#[test]
fn device_path_runs_on_fake_driver() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fake-cuda");
    std::fs::create_dir_all(&dir).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    for (lib, src) in [
        ("libcuda.so", "cuda/fake_driver.cpp"),
        ("libnccl.so", "cuda/fake_nccl.cpp"),
    ] {
        let ok = Command::new(&cxx)
            .args([
                "-std=c++17",
                "-O1",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-fno-strict-aliasing",
                "-shared",
                "-fPIC",
                "-o",
            ])
            .arg(dir.join(lib))
            .arg(root.join(src))
            .arg("-lpthread")
            .status()
            .unwrap_or_else(|e| panic!("cannot run {cxx} (a C++ compiler is required): {e}"));
        assert!(ok.success(), "building the fake {lib} failed");
    }
    // Any module image will do: the fake maps function names to the harness.
    std::fs::write(dir.join("module.ptx"), "// fake module\n").unwrap();
    let ld = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", dir.display()),
        _ => dir.display().to_string(),
    };
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_device_path_on_fake_driver",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LD_LIBRARY_PATH", ld)
        .env("PDXFER_KERNEL_MODULE", dir.join("module.ptx"))
        .env("PDXFER_FAKE_CUDA_CHILD", "1")
        .output()
        .expect("spawn the child test");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{text}");
    assert!(
        text.contains("fake-driver child: all checks passed"),
        "child did not run:\n{text}"
    );
    let modes: &[&str] = if cfg!(feature = "nccl") {
        &["Direct", "Staged"]
    } else {
        &[]
    };
    for mode in modes {
        let line = format!("NCCL {mode} transfer matches the CPU relayout");
        assert!(text.contains(&line), "no {mode} transfer:\n{text}");
    }
}

#[test]
#[ignore = "run by device_path_runs_on_fake_driver in a child process with the fake libcuda"]
fn child_device_path_on_fake_driver() {
    use pdxfer::relayout::gpu::check::{bench, self_check, BenchParams};
    use pdxfer::relayout::gpu::{self, GpuRelayout, KernelOrigin};
    use pdxfer::Status;

    assert!(
        std::env::var_os("PDXFER_FAKE_CUDA_CHILD").is_some(),
        "this test only runs as the child of device_path_runs_on_fake_driver"
    );
    assert_eq!(gpu::probe().unwrap().device_count, 1);
    let mut g = GpuRelayout::new(0).expect("open the fake device");
    assert!(
        matches!(g.kernel_origin(), KernelOrigin::File(_)),
        "{:?}",
        g.kernel_origin()
    );
    assert_eq!(g.compute_capability(), (9, 0));
    assert!(g.device_name().unwrap().contains("fake"));

    // Gather, scatter and sliced gather on random plans, byte for byte vs the CPU.
    let failures = self_check(&mut g, 16, 0xfa4e, false);
    assert!(failures.is_empty(), "{failures:#?}");

    // The benchmark loop (timings are meaningless here, the path is not).
    let rows = bench(
        &mut g,
        &BenchParams {
            tokens: 1024,
            layers: 3,
            row_bytes: 1152,
            page_size: 64,
            dcp: vec![4, 16],
            iters: 2,
            spans_per_warp: vec![1, 4],
        },
    )
    .expect("bench");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].bytes, 1024 / 4 * 3 * 1152);
    assert_eq!(rows[0].spans, 256);
    assert_eq!(rows[1].bytes, 1024 / 16 * 3 * 1152);
    assert_eq!(
        rows[0].sweep.iter().map(|x| x.0).collect::<Vec<_>>(),
        vec![1, 4]
    );
    assert!(rows
        .iter()
        .all(|r| r.sweep.iter().any(|x| x.0 == r.spans_per_warp)));
    assert_eq!(g.spans_per_warp(), 4, "the benchmark restores the setting");

    // Driver errors are typed, and bounds are checked before the driver.
    assert_eq!(GpuRelayout::new(1).unwrap_err().status(), Status::Cuda);
    let b = g.alloc(64).unwrap();
    assert_eq!(
        g.upload(&b, 60, &[0u8; 8]).unwrap_err().status(),
        Status::OutOfBounds
    );
    let mut out = [0u8; 8];
    assert_eq!(
        b.read(57, &mut out).unwrap_err().status(),
        Status::OutOfBounds
    );
    g.upload(&b, 8, &[7u8; 8]).unwrap();
    b.read(8, &mut out).unwrap();
    assert_eq!(out, [7u8; 8]);
    // SAFETY: the fake driver checks the ranges and refuses this one (not its memory).
    let e = unsafe { g.memcpy_dtod(b.ptr(), 16, 8) }.unwrap_err();
    assert_eq!(e.status(), Status::Cuda, "{e}");
    #[cfg(feature = "nccl")]
    nccl_transfers();
    println!("fake-driver child: all checks passed");
}

#[cfg(feature = "nccl")]
/// A prefill thread gathers one decode rank's tokens on its device and sends
/// them over an NCCL pair; a decode thread receives them into its pool rows
/// (Direct) or its staging buffer and scatters (Staged). The decode pools
/// must equal the CPU relayout of the same plan; mismatched plans are refused
/// on both sides before anything is posted.
fn nccl_transfers() {
    use pdxfer::layout::{PackLayout, SglangChunk};
    use pdxfer::relayout::gpu::GpuRelayout;
    use pdxfer::relayout::{self, cpu};
    use pdxfer::transport::nccl::{
        check_mirror, NcclId, NcclMode, NcclPair, NcclPlan, NcclPlanOptions, NcclRole,
    };
    use pdxfer::Status;
    use std::sync::mpsc;

    let (p, d, n) = (16u64, 4u64, 300u64);
    let src_pages: Vec<u64> = vec![
        9, 2, 14, 0, 7, 11, 3, 5, 12, 1, 8, 13, 4, 6, 10, 15, 16, 17, 18,
    ];
    let dst_pages: Vec<u64> = vec![3, 0, 4, 1, 2];
    let req = SglangChunk {
        src_pages: &src_pages,
        dst_pages: &dst_pages,
        page_size: p,
        dcp_size: d,
        dcp_rank: 1,
        src_page_offset: 0,
        decode_prefix_len: 0,
        num_tokens: Some(n),
    }
    .to_pair()
    .unwrap();
    let rows = vec![48u64, 100, 1152];
    let src_rows = 19 * p;
    let dst_rows = 5 * p;
    let pools: Vec<Vec<u8>> = rows
        .iter()
        .enumerate()
        .map(|(e, &rb)| {
            (0..src_rows * rb)
                .map(|i| (i * 31 + e as u64 * 7) as u8)
                .collect()
        })
        .collect();
    // CPU reference: gather then scatter into zeroed destination pools.
    let pack = PackLayout::new(req.token_count(), &rows).unwrap();
    let mut packed = vec![0u8; pack.total_bytes as usize];
    let refs: Vec<&[u8]> = pools.iter().map(|v| v.as_slice()).collect();
    cpu::gather(
        &refs,
        &rows,
        &relayout::gather_spans(&req).unwrap(),
        &pack,
        &mut packed,
    )
    .unwrap();
    let mut want: Vec<Vec<u8>> = rows
        .iter()
        .map(|&rb| vec![0u8; (dst_rows * rb) as usize])
        .collect();
    {
        let mut w: Vec<&mut [u8]> = want.iter_mut().map(|v| v.as_mut_slice()).collect();
        cpu::scatter(
            &packed,
            &pack,
            &rows,
            &relayout::scatter_spans(&req).unwrap(),
            &mut w,
        )
        .unwrap();
    }

    let direct = NcclPlanOptions::default();
    let staged = NcclPlanOptions {
        max_direct_ops: 0,
        chunk_bytes: 4000,
        max_group_ops: 3,
        ..Default::default()
    };
    for (opts, mode, rx_rows) in [
        (direct, NcclMode::Direct, rows.clone()),
        (staged, NcclMode::Staged, rows.clone()),
        (direct, NcclMode::Direct, vec![48u64, 100, 576]),
    ] {
        let mismatch = rx_rows != rows;
        let id = NcclId::new().unwrap();
        let (to_rx, from_tx) = mpsc::channel::<u64>();
        let (to_tx, from_rx) = mpsc::channel::<u64>();
        let (pools, rows, pack, id, rx_rows) = (&pools, &rows, &pack, &id, &rx_rows);
        let (sent, got) = std::thread::scope(|s| {
            let sender = s.spawn(move || -> pdxfer::Result<()> {
                let mut g = GpuRelayout::new(0)?;
                let mut bufs = Vec::new();
                for v in pools {
                    let b = g.alloc(v.len())?;
                    g.upload(&b, 0, v)?;
                    bufs.push(b);
                }
                let staging = g.alloc(pack.total_bytes as usize)?;
                let bases: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
                let ents = relayout::gather_entries(&bases, rows, staging.ptr(), pack)?;
                // SAFETY: spans checked by the CPU gather above on the same shapes.
                unsafe { g.gather(&ents, &relayout::gather_spans(&req)?)? }.wait()?;
                let tx = NcclPlan::build(&req, rows, NcclRole::Sender, &opts)?;
                assert_eq!(tx.mode, mode);
                to_rx.send(tx.digest).unwrap();
                check_mirror(&tx, from_rx.recv().unwrap())?;
                let mut pair = NcclPair::connect(id, NcclRole::Sender, 0, g.stream_handle())?;
                // SAFETY: staging holds the whole pack; the peer posts the mirrored plan.
                unsafe { pair.post(&tx, staging.ptr(), &[]) }
            });
            let receiver = s.spawn(move || -> pdxfer::Result<Vec<Vec<u8>>> {
                let mut g = GpuRelayout::new(0)?;
                let rx = NcclPlan::build(&req, rx_rows, NcclRole::Receiver, &opts)?;
                to_tx.send(rx.digest).unwrap();
                check_mirror(&rx, from_tx.recv().unwrap())?;
                let mut bufs = Vec::new();
                for &rb in rx_rows {
                    let b = g.alloc((dst_rows * rb) as usize)?;
                    g.memset(&b, 0)?;
                    bufs.push(b);
                }
                let staging = g.alloc(rx.pack.total_bytes as usize)?;
                let bases: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
                let mut pair = NcclPair::connect(id, NcclRole::Receiver, 0, g.stream_handle())?;
                // SAFETY: every op lands in the staging buffer or a destination pool
                // sized for the plan (checked by the CPU scatter above).
                unsafe { pair.post(&rx, staging.ptr(), &bases)? };
                if rx.needs_scatter() {
                    let ents = relayout::scatter_entries(&bases, rx_rows, staging.ptr(), &rx.pack)?;
                    // SAFETY: as above.
                    unsafe { g.scatter(&ents, &relayout::scatter_spans(&req)?)? }.wait()?;
                }
                let mut out = Vec::new();
                for b in &bufs {
                    let mut v = vec![0u8; b.len()];
                    g.download(b, 0, &mut v)?;
                    out.push(v);
                }
                Ok(out)
            });
            (sender.join().unwrap(), receiver.join().unwrap())
        });
        if mismatch {
            assert_eq!(sent.unwrap_err().status(), Status::NcclPlanMismatch);
            assert_eq!(got.unwrap_err().status(), Status::NcclPlanMismatch);
            continue;
        }
        sent.unwrap_or_else(|e| panic!("{mode:?} sender: {e}"));
        let got = got.unwrap_or_else(|e| panic!("{mode:?} receiver: {e}"));
        for (e, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g == w,
                "{mode:?}: decode pool entry {e} differs from the CPU relayout"
            );
        }
        println!("fake-driver child: NCCL {mode:?} transfer matches the CPU relayout");
    }
}
