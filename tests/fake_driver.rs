//! Runs the device code path (`relayout::gpu`: context, stream, module load,
//! table uploads, launches, events, sliced gather, the self-check and the
//! benchmark loop) against `cuda/fake_driver.cpp`, a CPU stand-in for
//! libcuda that executes the kernels with the host harness. cudarc loads
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
    let ok = Command::new(&cxx)
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
        .arg(dir.join("libcuda.so"))
        .arg(root.join("cuda/fake_driver.cpp"))
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cxx} (a C++ compiler is required): {e}"));
    assert!(ok.success(), "building the fake libcuda failed");
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
    println!("fake-driver child: all checks passed");
}
