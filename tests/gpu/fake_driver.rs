//! Runs the device code path (`cuda` and `relayout::gpu`: context, stream, module load,
//! table uploads, launches, events, sliced gather, the self-check and the
//! benchmark loop) against `cuda/fake_driver.cpp`, a CPU stand-in for
//! libcuda that executes the kernels with the host harness, and NCCL pair
//! transfers (`transport::nccl`, Direct and Staged) against
//! `cuda/fake_nccl.cpp`, two ranks in one process (`nccl_fake` runs
//! them in separate processes). cudarc loads
//! libcuda once per process and glibc reads LD_LIBRARY_PATH at start-up, so
//! the checks run in child processes (this test binary, `--ignored --exact
//! child_...`) whose LD_LIBRARY_PATH holds the fake. A second child runs the
//! engine end to end with prefill KV pools in (fake) device memory.
#![cfg(feature = "cuda")]

use crate::support::{cluster, fakes};
use std::process::Command;

#[test]
fn device_path_runs_on_fake_driver() {
    let dir = fakes::compile_fakes("fake-cuda");
    let ld = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", dir.display()),
        _ => dir.display().to_string(),
    };
    // both children at once: the device path checks and the engine with device pools
    let child = |name: &str| {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.args([
            "--ignored",
            "--exact",
            crate::support::test_name(module_path!(), name).as_str(),
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LD_LIBRARY_PATH", &ld)
        .env("PDXFER_KERNEL_MODULE", dir.join("module.ptx"))
        .env("PDXFER_NCCL", dir.join("libnccl.so.2"))
        .env("PDXFER_FAKE_NCCL_DIR", &dir)
        .env("PDXFER_FAKE_CUDA_CHILD", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        c
    };
    let spawn = |name: &str| child(name).spawn().expect("spawn the child test");
    // the engine with device pools from a VMM-style allocator (4 KiB chunks)
    let engine_child = child("child_engine_device_pools_on_fake_driver")
        .env("PDXFER_FAKE_CUDA_VMM_CHUNK", "4096")
        .spawn()
        .expect("spawn the child test");
    let decode_child = spawn("child_engine_decode_device_pools_on_fake_driver");
    let strided_child = spawn("child_engine_strided_device_pools_on_fake_driver");
    let flush_child = spawn("child_engine_gpudirect_flush_on_fake_driver");
    let layerwise_child = spawn("child_gpu_layerwise_bench_on_fake_driver");
    // two fake GPUs: the NCCL pairs' ranks on devices 0 and 1 (NCCL refuses one)
    let out = child("child_device_path_on_fake_driver")
        .env("PDXFER_FAKE_CUDA_DEVICES", "2")
        .spawn()
        .expect("spawn the child test")
        .wait_with_output()
        .unwrap();
    let engine_out = engine_child.wait_with_output().unwrap();
    let decode_out = decode_child.wait_with_output().unwrap();
    let flush_out = flush_child.wait_with_output().unwrap();
    let layerwise_out = layerwise_child.wait_with_output().unwrap();
    let layerwise_text = String::from_utf8_lossy(&layerwise_out.stdout).into_owned()
        + &String::from_utf8_lossy(&layerwise_out.stderr);
    assert!(
        layerwise_out.status.success()
            && layerwise_text.contains("fake-driver layerwise child: all checks passed"),
        "GPU layer-wise benchmark child failed:\n{layerwise_text}"
    );
    // VMM pools with and without gpuDirectRDMACapable
    let vmm_out = child("child_vmm_gpudirect_on_fake_driver")
        .output()
        .unwrap();
    let vmm_text = String::from_utf8_lossy(&vmm_out.stdout).into_owned()
        + &String::from_utf8_lossy(&vmm_out.stderr);
    assert!(
        vmm_out.status.success()
            && vmm_text.contains("fake-driver vmm-gpudirect child: all checks passed"),
        "VMM GPUDirect child failed:
{vmm_text}"
    );
    // the kernel images the driver version picks: no module file given
    let images_out = child("child_kernel_images_on_fake_driver")
        .env_remove("PDXFER_KERNEL_MODULE")
        .output()
        .unwrap();
    let images_text = String::from_utf8_lossy(&images_out.stdout).into_owned()
        + &String::from_utf8_lossy(&images_out.stderr);
    assert!(
        images_out.status.success()
            && images_text.contains("fake-driver images child: all checks passed"),
        "kernel images child failed:\n{images_text}"
    );
    // `pdxfer info --json` names the image each driver line loads
    for (driver, want) in [("12040", "CUDA 12."), ("13050", "CUDA 13.")] {
        let out = Command::new(env!("CARGO_BIN_EXE_pdxfer"))
            .args(["info", "--json"])
            .env("LD_LIBRARY_PATH", &ld)
            .env("PDXFER_FAKE_CUDA_DRIVER_VERSION", driver)
            .env_remove("PDXFER_KERNEL_MODULE")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let k = &v["kernels"];
        assert_eq!(k["available"], true, "driver {driver}: {v}");
        let detail = k["detail"].as_str().unwrap();
        let on = format!("on driver CUDA {}.{}", &driver[..2], &driver[3..4]);
        assert!(detail.contains(on.as_str()), "{detail}");
        if has_images_for_both_lines() {
            assert!(
                detail.contains("cubin") && detail.contains(want),
                "driver {driver}: {detail}"
            );
        }
        let cuda = v["cuda"]["detail"].as_str().unwrap();
        assert!(cuda.contains(&on[10..]), "{cuda}");
    }
    let strided_out = strided_child.wait_with_output().unwrap();
    let strided_text = String::from_utf8_lossy(&strided_out.stdout).into_owned()
        + &String::from_utf8_lossy(&strided_out.stderr);
    assert!(
        strided_out.status.success()
            && strided_text.contains("fake-driver strided child: all checks passed"),
        "strided device-pool child failed:\n{strided_text}"
    );
    let decode_text = String::from_utf8_lossy(&decode_out.stdout).into_owned()
        + &String::from_utf8_lossy(&decode_out.stderr);
    assert!(
        decode_out.status.success(),
        "decode device-pool child failed:\n{decode_text}"
    );
    assert!(
        decode_text.contains("fake-driver decode child: all checks passed"),
        "decode device-pool child did not run:\n{decode_text}"
    );
    let flush_text = String::from_utf8_lossy(&flush_out.stdout).into_owned()
        + &String::from_utf8_lossy(&flush_out.stderr);
    assert!(
        flush_out.status.success()
            && flush_text.contains("fake-driver gpudirect-flush child: all checks passed"),
        "GPUDirect flush child failed:\n{flush_text}"
    );
    let engine_text = String::from_utf8_lossy(&engine_out.stdout).into_owned()
        + &String::from_utf8_lossy(&engine_out.stderr);
    assert!(
        engine_out.status.success(),
        "engine child failed:\n{engine_text}"
    );
    assert!(
        engine_text.contains("fake-driver engine child: all checks passed"),
        "engine child did not run:\n{engine_text}"
    );
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

/// True when the build embedded a cubin and PTX of CUDA 12 and of CUDA 13
/// (`scripts/cuda-deps.sh`); `PDXFER_REQUIRE_CUDA_TOOLS` makes it required.
fn has_images_for_both_lines() -> bool {
    use pdxfer::relayout::gpu::kernels::{ImageKind, IMAGES};
    let all = [12u32, 13].iter().all(|&m| {
        [ImageKind::Cubin, ImageKind::Ptx]
            .iter()
            .all(|&k| IMAGES.iter().any(|i| i.kind == k && i.toolkit.0 == m))
    });
    assert!(
        all || std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
        "PDXFER_REQUIRE_CUDA_TOOLS is set but the build embedded {:?}",
        IMAGES.iter().map(|i| i.describe()).collect::<Vec<_>>()
    );
    all
}

/// A knob of the fake libcuda this process loaded (`pdx_fake_set_*`, whose
/// argument is `T`: `int` as i32, `unsigned long long` as u64).
fn fake_set<T>(name: &std::ffi::CStr, v: T) {
    // SAFETY: dlopen of the already-loaded library (RTLD_NOLOAD) and a symbol
    // of the signature `void (T)` the caller names.
    unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "the fake libcuda is not loaded");
        let f = libc::dlsym(h, name.as_ptr());
        assert!(!f.is_null(), "not the fake libcuda");
        let f: extern "C" fn(T) = std::mem::transmute(f);
        f(v)
    }
}

/// Which embedded kernel image each driver version loads, and the typed
/// error naming the versions when none fits; then what the fake models of
/// the hard half: stream work deferred until waited, NOT_READY events, VMM
/// chunks walked by the pool check, and the GPUDirect RDMA flush.
#[test]
#[ignore = "run by device_path_runs_on_fake_driver in a child process with the fake libcuda"]
fn child_kernel_images_on_fake_driver() {
    use pdxfer::cuda::{probe_gpudirect, GpuDirectRoute, RdmaWriteFlush, RdmaWritesOrdering};
    use pdxfer::relayout::gpu::kernels::{ImageKind, IMAGES};
    use pdxfer::relayout::gpu::{check::self_check, GpuRelayout, KernelOrigin};
    use pdxfer::Status;

    assert!(
        std::env::var_os("PDXFER_FAKE_CUDA_CHILD").is_some(),
        "this test only runs as the child of device_path_runs_on_fake_driver"
    );
    assert!(std::env::var_os("PDXFER_KERNEL_MODULE").is_none());
    pdxfer::cuda::probe().expect("load the fake libcuda");
    let both = has_images_for_both_lines();
    let set_driver = |v: i32| fake_set(c"pdx_fake_set_driver_version", v);
    let origin = |driver: i32| {
        set_driver(driver);
        let mut g = GpuRelayout::new(0).unwrap_or_else(|e| panic!("driver {driver}: {e}"));
        assert_eq!(g.driver_version(), driver);
        let failures = self_check(&mut g, 2, driver as u64, false);
        assert!(failures.is_empty(), "{failures:#?}");
        g.kernel_origin().clone()
    };
    let cubin_of = |o: &KernelOrigin| match o {
        KernelOrigin::Embedded {
            kind: ImageKind::Cubin,
            toolkit,
            ..
        } => Some(toolkit.0),
        _ => None,
    };
    if both {
        // CUDA 12.x drivers load the 12.x cubin, 13.x drivers the 13.x one
        for (driver, major) in [
            (12040, 12),
            (12020, 12),
            (12080, 12),
            (13000, 13),
            (13050, 13),
        ] {
            let o = origin(driver);
            assert_eq!(cubin_of(&o), Some(major), "driver {driver}: {o}");
        }
        println!(
            "fake-driver images child: 12.x drivers load the CUDA 12 cubin, 13.x the CUDA 13 one"
        );
    } else {
        eprintln!("images child: the build embedded no images of both lines; NVRTC only");
        let o = origin(13050);
        assert!(
            matches!(
                o,
                KernelOrigin::Nvrtc { .. } | KernelOrigin::Embedded { .. }
            ),
            "{o}"
        );
    }
    // The fake itself refuses a too-new image: the CUDA 13 PTX and cubin on a
    // 12.4 driver, through PDXFER_KERNEL_MODULE (tried before the embedded ones).
    let dir = std::env::temp_dir().join(format!("pdxfer-images-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for img in IMAGES.iter().filter(|i| i.toolkit.0 == 13) {
        let f = dir.join(match img.kind {
            ImageKind::Cubin => "new.cubin",
            ImageKind::Ptx => "new.ptx",
        });
        std::fs::write(&f, img.bytes).unwrap();
        std::env::set_var("PDXFER_KERNEL_MODULE", &f);
        set_driver(12040);
        let g = GpuRelayout::new(0).unwrap();
        // refused, so an embedded 12.x image loaded instead
        assert!(
            !matches!(g.kernel_origin(), KernelOrigin::File(_)),
            "{:?} loaded on driver 12.4: {}",
            img.kind,
            g.kernel_origin()
        );
        // and with a driver too old for everything, the error lists why
        set_driver(11080);
        let e = GpuRelayout::new(0).unwrap_err();
        assert_eq!(e.status(), Status::Cuda, "{e}");
        let d = e.detail();
        let want = match img.kind {
            ImageKind::Cubin => "CUDA_ERROR_NO_BINARY_FOR_GPU",
            ImageKind::Ptx => "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        };
        assert!(
            d.contains("PDXFER_KERNEL_MODULE") && d.contains(want),
            "{d}"
        );
        assert!(d.contains("on driver CUDA 11.8"), "{d}");
        assert!(
            d.contains("needs driver CUDA >= 12.0, the driver is CUDA 11.8"),
            "{d}"
        );
        assert!(d.contains("needs driver CUDA >= 13.0"), "{d}");
        // NVRTC cannot help either: every one found is newer than 11.8
        assert!(d.contains("NVRTC"), "{d}");
        std::env::remove_var("PDXFER_KERNEL_MODULE");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    if both {
        println!(
            "fake-driver images child: too-new images are refused, the error names the versions"
        );
    }
    set_driver(12080);
    let mut g = GpuRelayout::new(0).unwrap();

    // Stream work runs only when waited: an upload is not visible to a
    // plain read until an event after it is waited; a query before that
    // answers not-ready (once: the device then makes progress).
    let b = g.stream().alloc(4096).unwrap();
    g.stream().memset(&b, 0).unwrap();
    g.stream().record(false).unwrap().wait().unwrap();
    g.stream().upload(&b, 0, &[9u8; 64]).unwrap();
    let mut out = [1u8; 64];
    b.read(0, &mut out).unwrap();
    assert_eq!(
        out, [0u8; 64],
        "the upload ran before anything waited for it"
    );
    let ev = g.stream().record(false).unwrap();
    let not_ready = fake_counter(c"pdx_fake_not_ready_queries");
    assert!(!ev.is_complete().unwrap(), "complete before the work ran");
    assert_eq!(fake_counter(c"pdx_fake_not_ready_queries"), not_ready + 1);
    assert!(ev.is_complete().unwrap());
    b.read(0, &mut out).unwrap();
    assert_eq!(out, [9u8; 64]);
    // a device-to-host copy into pinned memory lands at its event, not before
    let pinned = g.stream().alloc_pinned(64).unwrap();
    // SAFETY: both ranges are 64 bytes of this context's memory; the pinned
    // buffer is read only after the event, and outlives it.
    let ev = unsafe { g.stream().copy_to_host(pinned.as_ptr(), b.ptr(), 64) }.unwrap();
    // SAFETY: 64 bytes of the pinned buffer; the fake runs the copy only at its
    // event, so this write comes before it (on a GPU it would race the copy).
    unsafe { std::ptr::write_bytes(pinned.as_ptr(), 5, 64) };
    ev.wait().unwrap();
    // SAFETY: the copy's event completed; the buffer holds 64 bytes.
    let got = unsafe { std::slice::from_raw_parts(pinned.as_ptr(), 64) };
    assert_eq!(got, &[9u8; 64][..], "the copy did not run at its event");
    // Gathers enqueued back to back without a wait: each uploads its tables
    // through a pinned staging buffer the next-but-one reuses, which must not
    // be rewritten before its copy ran (the fake reads a pinned source only
    // when the copy runs). Each destination must hold its own gather.
    {
        use pdxfer::layout::Run;
        use pdxfer::relayout::CopyEntry;
        let rows = 16u64;
        let src_bytes: Vec<u8> = (0..rows * 32).map(|i| (i * 7 + 1) as u8).collect();
        let src = g.stream().alloc(src_bytes.len()).unwrap();
        g.stream().upload(&src, 0, &src_bytes).unwrap();
        let dsts: Vec<_> = (0..3).map(|_| g.stream().alloc(4 * 32).unwrap()).collect();
        let mut last = None;
        for (k, d) in dsts.iter().enumerate() {
            let e = [CopyEntry {
                src: src.ptr(),
                dst: d.ptr(),
                row_bytes: 32,
                reserved: 0,
            }];
            let spans = [Run {
                src: 3 * k as u64 + 1,
                dst: 0,
                len: 4,
            }];
            // SAFETY: rows 1..11 of a 16-row source, 4 rows into a 4-row destination.
            last = Some(unsafe { g.gather(&e, &spans) }.unwrap());
        }
        last.unwrap().wait().unwrap();
        for (k, d) in dsts.iter().enumerate() {
            let mut got = vec![0u8; 4 * 32];
            d.read(0, &mut got).unwrap();
            let at = (3 * k + 1) * 32;
            assert_eq!(
                got,
                src_bytes[at..at + 4 * 32],
                "gather {k} ran another's tables"
            );
        }
    }
    println!("fake-driver images child: stream work waits for its event");

    // VMM: one VA range of 4 KiB chunks; RANGE_SIZE covers one chunk, the
    // pool check walks them all.
    fake_set(c"pdx_fake_set_vmm_chunk", 4096u64);
    let v = g.stream().alloc(64 << 10).unwrap();
    fake_set(c"pdx_fake_set_vmm_chunk", 0u64);
    let mut size: usize = 0;
    // SAFETY: out-pointer to a local usize, the attribute's type.
    let rc = unsafe {
        cudarc::driver::sys::cuPointerGetAttribute(
            &mut size as *mut usize as *mut std::ffi::c_void,
            cudarc::driver::sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            v.ptr() + 5000,
        )
    };
    assert_eq!(rc, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    assert_eq!(size, 4096, "the fake maps 4 KiB chunks");
    g.stream().check_device_range(v.ptr(), 64 << 10).unwrap();
    g.stream()
        .check_device_range(v.ptr() + 100, (64 << 10) - 100)
        .unwrap();
    g.stream().check_device_range(v.ptr() + 8192, 4096).unwrap();
    let e = g
        .stream()
        .check_device_range(v.ptr(), (64 << 10) + 1)
        .unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    assert!(e.detail().contains("16 mapping(s)"), "{e}");
    println!("fake-driver images child: a pool over 16 VMM chunks passes the check");

    // GPUDirect RDMA writes: no flush where the device orders them (owner),
    // a flush before each delivery where it says none.
    let f = RdmaWriteFlush::new(0).unwrap();
    assert_eq!(f.info().writes_ordering, RdmaWritesOrdering::Owner);
    assert!(!f.needed());
    assert!(!f.before_delivery().unwrap());
    assert_eq!(fake_counter(c"pdx_fake_rdma_flushes"), 0);
    fake_set(c"pdx_fake_set_rdma_ordering", 0i32);
    let f = RdmaWriteFlush::new(0).unwrap();
    assert_eq!(f.info().writes_ordering, RdmaWritesOrdering::None);
    assert!(f.needed());
    assert!(f.before_delivery().unwrap());
    assert!(f.before_delivery().unwrap());
    assert_eq!(
        (f.flushes(), fake_counter(c"pdx_fake_rdma_flushes")),
        (2, 2)
    );
    fake_set(c"pdx_fake_set_rdma_ordering", 100i32);
    // without an RDMA device the route comes from the attributes, untested
    if !std::path::Path::new("/sys/class/infiniband").exists() {
        let p = probe_gpudirect(0);
        assert_eq!((p.route, p.tested), (GpuDirectRoute::DmaBuf, false), "{p}");
        assert!(
            p.to_string().contains("not tested by a registration"),
            "{p}"
        );
    }
    println!("fake-driver images child: all checks passed");
}

#[test]
#[ignore = "run by device_path_runs_on_fake_driver in a child process with the fake libcuda"]
fn child_device_path_on_fake_driver() {
    use pdxfer::relayout::gpu::check::{bench, self_check, BenchParams};
    use pdxfer::relayout::gpu::{GpuRelayout, KernelOrigin};
    use pdxfer::Status;

    assert!(
        std::env::var_os("PDXFER_FAKE_CUDA_CHILD").is_some(),
        "this test only runs as the child of device_path_runs_on_fake_driver"
    );
    assert_eq!(pdxfer::cuda::probe().unwrap().device_count, 2);
    let mut g = GpuRelayout::new(0).expect("open the fake device");
    assert!(
        matches!(g.kernel_origin(), KernelOrigin::File(_)),
        "{:?}",
        g.kernel_origin()
    );
    assert_eq!(g.compute_capability(), (9, 0));
    assert!(g.stream().device_name().unwrap().contains("fake"));

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
    // (This child has two fake devices, with their own PCI bus ids.)
    assert_eq!(GpuRelayout::new(2).unwrap_err().status(), Status::Cuda);
    assert_eq!(pdxfer::cuda::pci_bus_id(0).unwrap(), "0000:c1:00.0");
    assert_eq!(pdxfer::cuda::pci_bus_id(1).unwrap(), "0000:c2:00.0");
    let b = g.stream().alloc(64).unwrap();
    assert_eq!(
        g.stream().upload(&b, 60, &[0u8; 8]).unwrap_err().status(),
        Status::OutOfBounds
    );
    let mut out = [0u8; 8];
    assert_eq!(
        b.read(57, &mut out).unwrap_err().status(),
        Status::OutOfBounds
    );
    g.stream().upload(&b, 8, &[7u8; 8]).unwrap();
    // the upload is ordered on the relayout stream; read() is not: wait first
    g.stream().record(false).unwrap().wait().unwrap();
    b.read(8, &mut out).unwrap();
    assert_eq!(out, [7u8; 8]);
    // SAFETY: the fake driver checks the ranges and refuses this one (not its memory).
    let e = unsafe { g.stream().memcpy_dtod(b.ptr(), 16, 8) }.unwrap_err();
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
        check_mirror, NcclAbort, NcclId, NcclMode, NcclPair, NcclPlan, NcclPlanOptions, NcclRole,
    };
    use pdxfer::Status;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

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

    let direct = NcclPlanOptions {
        min_direct_op_bytes: 0,
        ..Default::default()
    };
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
                    let b = g.stream().alloc(v.len())?;
                    g.stream().upload(&b, 0, v)?;
                    bufs.push(b);
                }
                let staging = g.stream().alloc(pack.total_bytes as usize)?;
                let bases: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
                let ents = relayout::gather_entries(&bases, rows, staging.ptr(), pack)?;
                // SAFETY: spans checked by the CPU gather above on the same shapes.
                unsafe { g.gather(&ents, &relayout::gather_spans(&req)?)? }.wait()?;
                let tx = NcclPlan::build(&req, rows, NcclRole::Sender, &opts)?;
                assert_eq!(tx.mode, mode);
                to_rx.send(tx.digest).unwrap();
                check_mirror(&tx, from_rx.recv().unwrap())?;
                let deadline = Instant::now() + Duration::from_secs(20);
                let mut pair = NcclPair::connect(
                    id,
                    NcclRole::Sender,
                    0,
                    g.stream().raw(),
                    "decode",
                    deadline,
                    &mut || true,
                    NcclAbort::new(),
                )?;
                // SAFETY: staging holds the whole pack; the peer posts the mirrored plan.
                unsafe { pair.post(&tx, staging.ptr(), &[], deadline, &mut || true)? };
                pair.wait(deadline, &mut || true)?;
                pair.close()
            });
            let receiver = s.spawn(move || -> pdxfer::Result<Vec<Vec<u8>>> {
                let mut g = GpuRelayout::new(1)?;
                let rx = NcclPlan::build(&req, rx_rows, NcclRole::Receiver, &opts)?;
                to_tx.send(rx.digest).unwrap();
                check_mirror(&rx, from_tx.recv().unwrap())?;
                let mut bufs = Vec::new();
                for &rb in rx_rows {
                    let b = g.stream().alloc((dst_rows * rb) as usize)?;
                    g.stream().memset(&b, 0)?;
                    bufs.push(b);
                }
                let staging = g.stream().alloc(rx.pack.total_bytes as usize)?;
                let bases: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
                let deadline = Instant::now() + Duration::from_secs(20);
                let mut pair = NcclPair::connect(
                    id,
                    NcclRole::Receiver,
                    1,
                    g.stream().raw(),
                    "prefill",
                    deadline,
                    &mut || true,
                    NcclAbort::new(),
                )?;
                // SAFETY: every op lands in the staging buffer or a destination pool
                // sized for the plan (checked by the CPU scatter above).
                unsafe { pair.post(&rx, staging.ptr(), &bases, deadline, &mut || true)? };
                pair.wait(deadline, &mut || true)?;
                pair.close()?;
                if rx.needs_scatter() {
                    let ents = relayout::scatter_entries(&bases, rx_rows, staging.ptr(), &rx.pack)?;
                    // SAFETY: as above.
                    unsafe { g.scatter(&ents, &relayout::scatter_spans(&req)?)? }.wait()?;
                }
                let mut out = Vec::new();
                for b in &bufs {
                    let mut v = vec![0u8; b.len()];
                    g.stream().download(b, 0, &mut v)?;
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

/// A counter of the fake libcuda this process loaded
/// (`pdx_fake_pinned_dtoh_copies`, `pdx_fake_launches`).
fn fake_counter(name: &std::ffi::CStr) -> u64 {
    // SAFETY: dlopen of the already-loaded library (RTLD_NOLOAD) and a symbol
    // of known signature `unsigned long long (void)`.
    unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "the fake libcuda is not loaded");
        let f = libc::dlsym(h, name.as_ptr());
        assert!(!f.is_null(), "not the fake libcuda");
        let f: extern "C" fn() -> u64 = std::mem::transmute(f);
        f()
    }
}

fn fake_pinned_copies() -> u64 {
    fake_counter(c"pdx_fake_pinned_dtoh_copies")
}

fn fake_htod_copies() -> u64 {
    fake_counter(c"pdx_fake_htod_copies")
}

fn fake_pinned_htod_copies() -> u64 {
    fake_counter(c"pdx_fake_pinned_htod_copies")
}

/// `GpuRelayout::gather_to_host` on its own: slice `i+1` is gathered and
/// copied before slice `i` is handed to the sender (the overlap), the host
/// halves hold the CPU gather of each slice, and an error from the sender
/// stops the loop and is returned.
fn gather_to_host_pipeline() {
    use pdxfer::layout::{PackLayout, Run};
    use pdxfer::relayout::cpu;
    use pdxfer::relayout::gpu::GpuRelayout;

    let mut g = GpuRelayout::new(0).unwrap();
    let rows = [48u64, 80];
    let pool_rows = 64u64;
    let host_pools: Vec<Vec<u8>> = rows
        .iter()
        .enumerate()
        .map(|(e, &rb)| {
            (0..pool_rows * rb)
                .map(|i| (i * 13 + e as u64) as u8)
                .collect()
        })
        .collect();
    let dev: Vec<_> = host_pools
        .iter()
        .map(|v| {
            let b = g.stream().alloc(v.len()).unwrap();
            g.stream().upload(&b, 0, v).unwrap();
            b
        })
        .collect();
    let bases: Vec<u64> = dev.iter().map(|b| b.ptr()).collect();
    // four slices of 5, 5, 5 and 2 tokens from scattered pool rows
    let slices: Vec<Vec<Run>> = [
        &[(40u64, 0u64, 3u64), (7, 3, 2)][..],
        &[(1, 0, 5)],
        &[(60, 0, 4), (20, 4, 1)],
        &[(33, 0, 2)],
    ]
    .iter()
    .map(|s| {
        s.iter()
            .map(|&(src, dst, len)| Run { src, dst, len })
            .collect()
    })
    .collect();
    let half = 5 * (48 + 80);
    let device = g.stream().alloc(2 * half).unwrap();
    let host = g.stream().alloc_pinned(2 * half + 3).unwrap();
    let refs: Vec<&[u8]> = host_pools.iter().map(|v| v.as_slice()).collect();
    let launches = || fake_counter(c"pdx_fake_launches");
    let mut seen = Vec::new();
    // SAFETY: every span names rows inside the device pools.
    unsafe {
        g.gather_to_host(&bases, &rows, &slices, &device, Some(&host), |s| {
            let pack = PackLayout::new(slices[s.index].iter().map(|r| r.len).sum(), &rows)?;
            assert_eq!(s.pack, pack);
            assert_eq!(s.host_offset, s.index % 2 * half);
            let mut want = vec![0u8; pack.total_bytes as usize];
            cpu::gather(&refs, &rows, &slices[s.index], &pack, &mut want)?;
            // SAFETY: the slice's half of the pinned buffer is ready (its event completed).
            let got = std::slice::from_raw_parts(host.as_ptr().add(s.host_offset), want.len());
            assert_eq!(got, &want[..], "slice {}", s.index);
            seen.push((s.index, launches()));
            Ok(())
        })
    }
    .unwrap();
    let l0 = seen[0].1;
    assert_eq!(
        seen.iter().map(|&(i, l)| (i, l - l0)).collect::<Vec<_>>(),
        vec![(0, 0), (1, 1), (2, 2), (3, 2)],
        "slice i+1 is gathered before slice i is sent; nothing past the last"
    );
    // a failing sender stops the loop with its error
    let mut calls = 0;
    // SAFETY: as above.
    let e = unsafe {
        g.gather_to_host(&bases, &rows, &slices, &device, Some(&host), |s| {
            calls += 1;
            if s.index == 1 {
                Err(pdxfer::Error::new(
                    pdxfer::Status::PeerUnreachable,
                    "wire down",
                ))
            } else {
                Ok(())
            }
        })
    }
    .unwrap_err();
    assert_eq!((e.status(), calls), (pdxfer::Status::PeerUnreachable, 2));
    // a slice larger than a half is refused before anything is enqueued
    let small = g.stream().alloc(half).unwrap();
    // SAFETY: as above.
    let e =
        unsafe { g.gather_to_host(&bases, &rows, &slices, &small, None, |_| Ok(())) }.unwrap_err();
    assert_eq!(e.status(), pdxfer::Status::Relayout, "{e}");
    println!("fake-driver engine child: gather_to_host pipelines slices");
}

/// A prefill engine with its KV pools in (fake) device memory, a host-memory
/// decode of DCP 2 and of DCP 4 over cma, staging small enough for many
/// slices per pair; every byte of every decode rank is checked against the
/// pattern. Then the configurations that must be refused, with their types.
#[test]
#[ignore = "run by device_path_runs_on_fake_driver in a child process with the fake libcuda"]
fn child_engine_device_pools_on_fake_driver() {
    use cluster::{Cluster, Pools, AUX_ITEM};
    use pdxfer::bootstrap::schema::Role;
    use pdxfer::engine::{Engine, EngineConfig, KvPool};
    use pdxfer::relayout::gpu::GpuRelayout;
    use pdxfer::transport::TransportKind;
    use pdxfer::Status;
    use std::time::Duration;

    assert!(
        std::env::var_os("PDXFER_FAKE_CUDA_CHILD").is_some(),
        "this test only runs as the child of device_path_runs_on_fake_driver"
    );
    gather_to_host_pipeline();
    const LAYERS: u32 = 3;
    const ROW: u64 = 96;
    let token = LAYERS as u64 * ROW;
    let mut last = None;
    for (dcp, staging) in [(2u32, 2 * 5 * token), (4, 2 * 3 * token + 17)] {
        let mut c = Cluster::build(&format!("fake-dev-{dcp}"), (1, dcp), TransportKind::Cma)
            .layers(LAYERS)
            .row_bytes(ROW)
            .prefill_pools(Pools::Device)
            .staging(staging)
            .room_timeout(Duration::from_secs(20))
            .receiver_timeout(Duration::from_secs(20))
            .start();
        let copies_before = fake_pinned_copies();
        let v = cluster::P * dcp as u64;
        for (room, total, prefix, chunk_pages) in
            [(1u64, 300u64, 0u64, 4usize), (2, 517, v * 2, 100)]
        {
            let req = c.open_room(room, total, prefix, true);
            c.send_all(&req, chunk_pages);
            let verified = c.finish(&req);
            assert_eq!(verified, req.n() * token + dcp as u64 * 32, "room {room}");
        }
        // Layer-wise sends ordered after CUDA events: a "model" stream of its
        // own writes each layer's rows into the device pools and records an
        // event per layer; every send names its event and nothing is
        // synchronised. The fake runs the model's copies only when something
        // waits for them, so a send whose stream did not wait on the event
        // would gather the previous room's rows and fail the byte check.
        {
            let model = GpuRelayout::new(0).unwrap();
            let (room, total, prefix) = (3u64, 400u64, 0u64);
            let req = c.plan(room, total, prefix);
            // the host mirror only: the model's stream uploads it below
            c.fill_host(&req);
            c.post_metadata(&req);
            c.senders(room);
            c.wait_bootstrapped(room);
            let mut events = Vec::new();
            for (l, d) in c.prefill_dev[0].iter().enumerate() {
                model
                    .stream()
                    .upload(d, 0, c.prefill[0].1.layer_bytes(l))
                    .unwrap();
                let ev = model.stream().record(false).unwrap();
                let o = pdxfer::engine::SendOptions {
                    cuda_event: Some(ev.raw()),
                    layers: Some(l as u32..l as u32 + 1),
                    ..Default::default()
                };
                c.prefill()
                    .send_with(room, &req.src[0], total, true, AUX_ITEM, &o)
                    .unwrap();
                events.push(ev);
            }
            // every rank's Success (with the room's failure if not) and every byte
            let verified = c.finish(&req);
            assert_eq!(verified, total * token + dcp as u64 * 32);
            drop(events);
            println!("fake-driver engine child: DCP 1->{dcp} layer-wise sends ordered after per-layer CUDA events, every byte checked");
        }
        // every slice went through pinned memory: more copies than pairs
        let copies = fake_pinned_copies() - copies_before;
        let min_slices = 2 * dcp as u64;
        assert!(copies > min_slices, "only {copies} pinned copies");
        println!("fake-driver engine child: DCP 1->{dcp} over {copies} staged slices, every byte checked");
        c.close();
        last = Some(c);
    }

    // Refused configurations, over the last cluster's prefill pools.
    let c = last.unwrap();
    let url = c.server.url();
    let (host, dev) = (&c.prefill[0].1, &c.prefill_dev[0]);
    let prefill_cfg = |staging: u64| {
        let mut cfg = cluster::config(Role::Prefill, "bad", &url, host, (1, 0), TransportKind::Cma);
        cfg.pools = host
            .kv_pools()
            .into_iter()
            .zip(dev)
            .map(|(p, d)| KvPool { base: d.ptr(), ..p })
            .collect();
        cfg.pool_device = Some(0);
        cfg.staging_bytes = staging;
        cfg.room_timeout = Duration::from_secs(20);
        cfg
    };
    let create = |cfg: EngineConfig| {
        // SAFETY: creation fails before any pool memory is touched.
        unsafe { Engine::new(cfg) }.unwrap_err()
    };
    let mut cfg = prefill_cfg(1 << 16);
    cfg.pools[1].base = host.kv_pools()[1].base; // host memory, not a CUDA allocation
    let e = create(cfg);
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert!(e.detail().contains("KV pool 1"), "{e}");
    let mut cfg = prefill_cfg(1 << 16);
    cfg.pools[2].num_pages += 1; // one page past the allocation
    let e = create(cfg);
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    // the pools are VMM-style mappings of 4 KiB chunks (the parent sets the
    // fake's knob): each spans many, and the check walked them all
    if std::env::var("PDXFER_FAKE_CUDA_VMM_CHUNK").as_deref() == Ok("4096") {
        assert!(dev.iter().all(|d| d.len() > 4 * 4096), "pools of one chunk");
        assert!(e.detail().contains("mapping(s)"), "{e}");
    }
    let mut cfg = prefill_cfg(1 << 16);
    cfg.pool_device = Some(1);
    assert_eq!(create(cfg).status(), Status::Cuda);
    let e = create(prefill_cfg(token));
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert!(e.detail().contains("staging_bytes"), "{e}");
    // A decode with device pools over cma: refused with the reason.
    let mut cfg = prefill_cfg(1 << 16);
    cfg.role = Role::Decode;
    let e = create(cfg);
    assert_eq!(e.status(), Status::Unsupported, "{e}");
    assert!(e.detail().contains("process_vm_writev"), "{e}");
    // ... and with a pool that is not device memory.
    let mut cfg = prefill_cfg(1 << 16);
    cfg.role = Role::Decode;
    cfg.transport = TransportKind::Tcp;
    cfg.pools[0].base = host.kv_pools()[0].base;
    let e = create(cfg);
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert!(e.detail().contains("KV pool 0"), "{e}");
    println!("fake-driver engine child: all checks passed");
}

/// Device pools with a page stride (padded: pages two apart, one allocation
/// per layer) on both sides, over tcp: the prefill gathers its pitch rows on
/// the device (the relayout kernel, DCP 1 -> 2) or sends whole pages (DCP 1
/// -> 1), the decode's receiver lands them through the host-to-device
/// writer. Every KV byte is read back and checked, and the gap bytes (the
/// mirror's, uploaded with it) are read back unchanged.
#[test]
#[ignore = "run by device_path_runs_on_fake_driver in a child process with the fake libcuda"]
fn child_engine_strided_device_pools_on_fake_driver() {
    use cluster::{Cluster, Pools};
    use pdxfer::transport::TransportKind;
    use std::time::Duration;

    assert!(
        std::env::var_os("PDXFER_FAKE_CUDA_CHILD").is_some(),
        "this test only runs as the child of device_path_runs_on_fake_driver"
    );
    const LAYERS: u32 = 3;
    const ROW: u64 = 96;
    for dcp in [1u32, 2] {
        let token = LAYERS as u64 * ROW;
        let mut c = Cluster::build(&format!("fake-strided-{dcp}"), (1, dcp), TransportKind::Tcp)
            .layers(LAYERS)
            .row_bytes(ROW)
            .prefill_pools(Pools::Device)
            .decode_pools(Pools::Device)
            .device_page_step(2)
            .staging(2 * 7 * token)
            .room_timeout(Duration::from_secs(20))
            .receiver_timeout(Duration::from_secs(20))
            .start();
        let aux = u64::from(dcp) * 32;
        assert_eq!(c.request(1, 300, 0, 4), 300 * token + aux, "dcp {dcp}");
        let v = cluster::P * u64::from(dcp);
        assert_eq!(
            c.request(2, 517, 2 * v, 100),
            (517 - 2 * v) * token + aux,
            "dcp {dcp}"
        );
        for (_, pools) in &c.decode {
            assert!(
                pools.check_gaps().unwrap() > 0,
                "gaps read back and checked"
            );
        }
    }
    println!("fake-driver strided child: all checks passed");
}

/// Decode engines whose KV pools are (fake) device memory, DCP 1 -> 2 over
/// tcp: first from a prefill with host pools (explicit tcp), then from a
/// prefill with device pools (both sides `auto`, which must not pick cma).
/// Then device pools to device pools over rdma on the fake NIC fabric: with
/// GPUDirect RDMA on the prefill's NIC the slices go from its device staging
/// straight to the decode's pools (no device-to-host copy at all); without
/// (the NIC says so up front, or refuses the device staging at the first
/// batch) the same bytes go through pinned host staging.
/// The decode's tcp receiver lands each piece through the host-to-device
/// writer; the fake defers stream copies until they are waited on, so the
/// bytes read back from device memory after the completion (every KV byte
/// and the aux rows) prove the completion came after the copies.
#[test]
#[ignore = "run by device_path_runs_on_fake_driver in a child process with the fake libcuda"]
fn child_engine_decode_device_pools_on_fake_driver() {
    use cluster::{Cluster, Pools};
    use pdxfer::bootstrap::schema::Role;
    use pdxfer::engine::{Engine, KvPoll};
    use pdxfer::memory::RegionKind;
    use pdxfer::transport::rdma::fake::FakeNic;
    use pdxfer::transport::rdma::handshake::Mtu;
    use pdxfer::transport::rdma::nic::NicProvider;
    use pdxfer::transport::TransportKind;
    use std::sync::Arc;
    use std::time::Duration;

    assert!(
        std::env::var_os("PDXFER_FAKE_CUDA_CHILD").is_some(),
        "this test only runs as the child of device_path_runs_on_fake_driver"
    );
    const LAYERS: u32 = 3;
    const ROW: u64 = 96;
    let dcp = 2u32;
    let token = LAYERS as u64 * ROW;
    // decode ranks with device pools, of this geometry
    let spec = |name: &str, dcp: u32, transport: TransportKind| {
        Cluster::build(name, (1, dcp), transport)
            .layers(LAYERS)
            .row_bytes(ROW)
            .decode_pools(Pools::Device)
    };

    // rdma runs on the fake NIC fabric; the prefill's NIC has GPUDirect RDMA,
    // has no GPU path, has one whose registrations fail (the probe finds it
    // out up front), or passes the probe and refuses the staging buffer at
    // the first batch (the link then falls back to host staging)
    for (case, prefill_device, transport, nic) in [
        ("host-to-device", false, TransportKind::Tcp, ""),
        ("device-to-device", true, TransportKind::Auto, ""),
        ("rdma-gpudirect", true, TransportKind::Rdma, "gpudirect"),
        ("rdma-no-gpudirect", true, TransportKind::Rdma, "none"),
        ("rdma-refused", true, TransportKind::Rdma, "refuses"),
        (
            "rdma-refused-late",
            true,
            TransportKind::Rdma,
            "refuses-late",
        ),
    ] {
        let rdma = transport == TransportKind::Rdma;
        let prefill_nic = rdma.then(|| FakeNic::new(&format!("{case}-p"), 2, Mtu::Mtu4096));
        let mut spec = spec(&format!("fake-decode-dev-{case}"), dcp, transport)
            .room_timeout(Duration::from_secs(20))
            .receiver_timeout(Duration::from_secs(20));
        if let Some(n) = &prefill_nic {
            n.set_gpu_direct(nic != "none");
            n.refuse_device_registrations(nic == "refuses");
            n.refuse_device_registrations_after_probe(nic == "refuses-late");
            spec = spec.prefill_nic(n.clone());
        }
        if prefill_device {
            spec = spec.prefill_pools(Pools::Device).staging(2 * 7 * token);
        }
        let mut c = spec.start();
        let (mut htod, mut pinned, mut dtoh) = (0u64, 0u64, 0u64);
        let v = cluster::P * dcp as u64;
        for (room, total, prefix, chunk_pages) in
            [(1u64, 300u64, 0u64, 4usize), (2, 517, v * 2, 100)]
        {
            let req = c.plan(room, total, prefix);
            c.fill(&req);
            // the transfer's copies only (not the uploads of the fill)
            let (htod_before, pinned_before) = (fake_htod_copies(), fake_pinned_htod_copies());
            let dtoh_before = fake_pinned_copies();
            c.post_metadata(&req);
            c.senders(room);
            c.wait_bootstrapped(room);
            c.send_all(&req, chunk_pages);
            c.wait_prefill_success(room);
            // the prefill's device-to-host staging copies (before the read-back below)
            dtoh += fake_pinned_copies() - dtoh_before;
            // every decode rank's Success, its device memory read back (a
            // plain synchronous copy: it does not wait for any stream) and
            // every byte checked
            let verified = c.finish(&req);
            assert_eq!(
                verified,
                req.n() * token + dcp as u64 * 32,
                "{case} room {room}"
            );
            htod += fake_htod_copies() - htod_before;
            pinned += fake_pinned_htod_copies() - pinned_before;
        }
        // the prefill NIC's device registrations: its device staging buffers
        let device_regions = prefill_nic.as_ref().map_or(0, |n| {
            n.regions()
                .iter()
                .filter(|r| matches!(r.kind, RegionKind::Device { .. }))
                .count()
        });
        if rdma {
            // the prefill sends only from staging: its device pools are not
            // registered with its NIC
            if let Some(n) = &prefill_nic {
                assert!(
                    n.regions()
                        .iter()
                        .all(|r| c.prefill_dev[0].iter().all(|d| d.ptr() != r.addr)),
                    "{case}: a prefill pool was registered with the NIC"
                );
            }
            // every slice crossed from device memory to device memory, or
            // every slice was copied to pinned host staging first
            if nic == "gpudirect" {
                assert_eq!(
                    dtoh, 0,
                    "{case}: device-to-host copies on the zero-copy path"
                );
                assert!(device_regions >= 1, "{case}: no device staging registered");
            } else {
                assert!(dtoh > 2 * dcp as u64, "{case}: only {dtoh} staged copies");
                assert_eq!(device_regions, 0, "{case}: device memory registered");
            }
            println!(
                "fake-driver decode child: {case} DCP 1->{dcp} with {dtoh} device-to-host staging copies, every byte checked"
            );
            c.close();
            continue;
        }
        if prefill_device {
            assert!(dtoh > 2 * dcp as u64, "{case}: only {dtoh} staged copies");
        }
        assert!(
            htod >= 2 * dcp as u64,
            "{case}: only {htod} waited host-to-device copies"
        );
        // the tcp streams' bounce buffers are page-locked, and so are a device
        // prefill's table staging buffers: no copy is from pageable memory
        assert_eq!(
            pinned, htod,
            "{case}: a host-to-device copy from pageable memory"
        );
        println!(
            "fake-driver decode child: {case} DCP 1->{dcp} over {htod} host-to-device copies, every byte checked"
        );
        c.close();
    }

    // A prefill told to use cma refuses a decode whose pools are device
    // memory at the handshake, naming why; nothing is written.
    let c = spec("fake-decode-dev-cma", 1, TransportKind::Cma)
        .decode_transport(TransportKind::Tcp)
        .start();
    let decode = &c.decode[0].0;
    let err = match decode.receiver(9, 0, Some(Duration::from_secs(10))) {
        Err(e) => e,
        Ok(()) => {
            assert_eq!(decode.wait(9, Duration::from_secs(20)), KvPoll::Failed);
            decode.failure(9).expect("a failed room has its reason")
        }
    };
    assert_eq!(err.status(), pdxfer::Status::Unsupported, "{err}");
    assert!(err.detail().contains("cma"), "{err}");
    decode.close();
    // A decode with device pools over rdma needs GPUDirect: refused at
    // creation without it, whether libcuda is missing or loads but the
    // registration fails (found by the NIC's probe registration).
    let (url, mirror) = (c.server.url(), &c.decode[0].1);
    let (bufs2, kv2) = cluster::device_pools(c.gpu.as_ref().unwrap(), mirror);
    for no_gdr in ["no-libcuda", "registration-fails"] {
        let nic = FakeNic::new(&format!("decode-{no_gdr}"), 1, Mtu::Mtu4096);
        if no_gdr == "no-libcuda" {
            nic.set_gpu_direct(false);
        } else {
            nic.refuse_device_registrations(true);
        }
        let mut cfg = cluster::config(
            Role::Decode,
            "fake-decode-dev-nogdr",
            &url,
            mirror,
            (1, 0),
            TransportKind::Rdma,
        );
        cfg.pools = kv2.clone();
        cfg.pool_device = Some(0);
        cfg.testing.nic = Some(nic as Arc<dyn NicProvider>);
        // SAFETY: creation fails (no engine is made); the device pools outlive it.
        let e = unsafe { Engine::new(cfg) }.unwrap_err();
        assert_eq!(e.status(), pdxfer::Status::NoGpuDirect, "{no_gdr}: {e}");
        assert!(e.detail().contains("use transport tcp"), "{no_gdr}: {e}");
    }
    c.prefill().close();
    drop(bufs2);
    println!("fake-driver decode child: all checks passed");
}

/// GPUDirect RDMA write ordering on a decode whose KV pools are (fake)
/// device memory, over rdma on the fake NIC fabric, DCP 1 -> 1 from a
/// prefill with host pools: where the device reports
/// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` NONE, the decode
/// flushes (`cuFlushGPUDirectRDMAWrites`) once per delivered batch that
/// wrote its device pools (with room grants: once per room, before the
/// room's one completion record), and a flush that fails delivers nothing
/// (the room fails); where it reports OWNER, nothing is flushed; where it can
/// neither order nor flush, an explicit rdma decode is refused at creation
/// naming the attribute and an `auto` one is written over tcp.
#[test]
#[ignore = "run by device_path_runs_on_fake_driver in a child process with the fake libcuda"]
fn child_engine_gpudirect_flush_on_fake_driver() {
    use cluster::{Cluster, Pools, AUX_ITEM};
    use pdxfer::bootstrap::schema::Role;
    use pdxfer::engine::{Engine, KvPoll, KvPool};
    use pdxfer::transport::rdma::fake::FakeNic;
    use pdxfer::transport::rdma::handshake::Mtu;
    use pdxfer::transport::TransportKind;
    use std::time::{Duration, Instant};

    assert!(
        std::env::var_os("PDXFER_FAKE_CUDA_CHILD").is_some(),
        "this test only runs as the child of device_path_runs_on_fake_driver"
    );
    pdxfer::cuda::probe().expect("load the fake libcuda");
    const LAYERS: u32 = 2;
    let token = LAYERS as u64 * cluster::ROW;
    let flushes = || fake_counter(c"pdx_fake_rdma_flushes");
    // the decode's completion records so far (drained by its deadline thread)
    let received = |e: &Engine| e.metrics_snapshot().received_batches;

    // (case, ordering, flush options, decode transport), each with
    // per-batch grants and with room grants
    let cases = [
        ("none", 0i32, 1i32, TransportKind::Rdma),
        ("owner", 100, 1, TransportKind::Rdma),
        ("unflushable-auto", 0, 0, TransportKind::Auto),
    ];
    for (room_grants, (case, ordering, flush_options, transport)) in [false, true]
        .into_iter()
        .flat_map(|g| cases.into_iter().map(move |c| (g, c)))
    {
        fake_set(c"pdx_fake_set_rdma_ordering", ordering);
        fake_set(c"pdx_fake_set_rdma_flush_options", flush_options);
        let name = format!("fake-gdr-flush-{case}-{room_grants}");
        // a prefill with host pools, a decode with device pools, one rail
        // each (also over auto)
        let mut c = Cluster::build(&name, (1, 1), transport)
            .layers(LAYERS)
            .decode_pools(Pools::Device)
            .room_grants(room_grants)
            .rails(1)
            .prefill_nic(FakeNic::new(
                &format!("{case}-{room_grants}-p"),
                1,
                Mtu::Mtu4096,
            ))
            .room_timeout(Duration::from_secs(20))
            .receiver_timeout(Duration::from_secs(20))
            .start();
        if flush_options == 0 {
            // explicit rdma: refused at creation, naming the attribute
            let mirror = &c.decode[0].1;
            let mut cfg = cluster::config(
                Role::Decode,
                &name,
                &c.server.url(),
                mirror,
                (1, 0),
                TransportKind::Rdma,
            );
            cfg.pools = mirror
                .kv_pools()
                .into_iter()
                .zip(&c.decode_dev[0])
                .map(|(p, d)| KvPool { base: d.ptr(), ..p })
                .collect();
            cfg.pool_device = Some(0);
            cfg.testing.nic =
                Some(FakeNic::new(&format!("{case}-{room_grants}-d"), 1, Mtu::Mtu4096) as _);
            cfg.room_grants = room_grants;
            // SAFETY: the device pools and the aux outlive the attempt.
            let e = unsafe { Engine::new(cfg) }.unwrap_err();
            assert_eq!(e.status(), pdxfer::Status::NoGpuDirect, "{case}: {e}");
            assert!(
                e.detail()
                    .contains("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING"),
                "{case}: {e}"
            );
        }
        let flushes_before = flushes();
        let htod_before = fake_htod_copies();
        let rooms = [(1u64, 300u64, 4usize), (2, 181, 100)];
        for &(room, n, chunk_pages) in &rooms {
            // every rank's Success, the decode's device memory read back,
            // every byte checked, the room cleared
            let verified = c.request(room, n, 0, chunk_pages);
            assert_eq!(verified, n * token + 32, "{case} room {room}");
        }
        let (prefill, decode) = (c.prefill(), &c.decode[0].0);
        // per-batch grants: the KV batches of the rooms are every record but
        // one aux batch per room; room grants: one record per room
        let aux_batches = rooms.len() as u64;
        let want = if room_grants {
            aux_batches
        } else {
            aux_batches + 2
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while received(decode) < want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(200)); // the last drain
        let kv_batches = received(decode).saturating_sub(aux_batches);
        let flushed = flushes() - flushes_before;
        let peers = prefill.metrics_snapshot().peers;
        let used: Vec<&str> = peers.iter().map(|p| p.transport.as_str()).collect();
        let case = format!("{case} (room grants: {room_grants})");
        let case = case.as_str();
        match (case.split(' ').next().unwrap_or_default(), room_grants) {
            ("none", true) => {
                assert_eq!(used, ["rdma"], "{case}");
                assert_eq!(received(decode), aux_batches, "{case}: one record per room");
                assert_eq!(flushed, aux_batches, "{case}: one flush per GPUDirect room");
                assert_eq!(fake_htod_copies(), htod_before, "{case}: not GPUDirect");
            }
            ("none", false) => {
                assert_eq!(used, ["rdma"], "{case}");
                assert!(kv_batches >= 2, "{case}: {kv_batches} KV batches");
                assert_eq!(flushed, kv_batches, "{case}: one flush per GPUDirect batch");
                assert_eq!(fake_htod_copies(), htod_before, "{case}: not GPUDirect");
            }
            ("owner", _) => {
                assert_eq!(used, ["rdma"], "{case}");
                if room_grants {
                    assert_eq!(received(decode), aux_batches, "{case}: one record per room");
                } else {
                    assert!(kv_batches >= 2, "{case}: {kv_batches} KV batches");
                }
                assert_eq!(
                    flushed, 0,
                    "{case}: flushed although the device orders writes"
                );
            }
            _ => {
                // auto: the decode does not offer GPUDirect, the prefill picks tcp
                assert_eq!(used, ["tcp"], "{case}");
                assert!(
                    fake_htod_copies() > htod_before,
                    "{case}: no host-to-device copies"
                );
                assert_eq!(flushed, 0, "{case}");
            }
        }
        println!(
            "fake-driver gpudirect-flush child: {case}: {kv_batches} KV batches over {used:?}, {flushed} flushes, every byte checked"
        );
        if case.starts_with("none") {
            // a flush that fails delivers nothing: the room fails and no
            // record of its KV batches reaches the decode
            fake_set(c"pdx_fake_set_rdma_flush_options", 0i32);
            let before = received(decode);
            let room = 9u64;
            let pages: Vec<u64> = (0..4).collect();
            cluster::open_decode([decode], room, &pages, 0, Some(Duration::from_secs(20)));
            c.senders(room);
            c.wait_bootstrapped(room);
            prefill
                .send(room, &pages, 4 * cluster::P, true, AUX_ITEM)
                .unwrap();
            assert_eq!(prefill.wait(room, Duration::from_secs(20)), KvPoll::Failed);
            let e = prefill.failure(room).expect("a failed room has its reason");
            assert!(e.to_string().contains("cuFlushGPUDirectRDMAWrites"), "{e}");
            assert_eq!(decode.wait(room, Duration::from_secs(20)), KvPoll::Failed);
            std::thread::sleep(Duration::from_millis(200));
            // at most the aux batch (host memory: never flushed), in flight
            // beside the KV batch, was delivered
            let got = received(decode) - before;
            assert!(
                got <= 1,
                "{got} records delivered, a KV batch's without its flush"
            );
            println!("fake-driver gpudirect-flush child: a failed flush delivers nothing");
        }
        c.close();
    }
    fake_set(c"pdx_fake_set_rdma_ordering", 100i32);
    fake_set(c"pdx_fake_set_rdma_flush_options", 1i32);
    println!("fake-driver gpudirect-flush child: all checks passed");
}

/// The GPU layer-wise benchmark (`examples/gpu_check.rs --layerwise`) at small
/// sizes: kernels write each layer's rows and spin on a model stream, sends
/// are ordered by the layers' events; every decode byte is verified and both
/// modes report an exposed time.
#[test]
#[ignore = "child of device_path_runs_on_fake_driver (needs the fake libcuda)"]
fn child_gpu_layerwise_bench_on_fake_driver() {
    use pdxfer::engine::gpu_layerwise_bench::{run, GpuLayerwiseParams};
    use pdxfer::relayout::gpu::GpuRelayout;
    assert!(
        std::env::var_os("PDXFER_FAKE_CUDA_CHILD").is_some(),
        "this test only runs as the child of device_path_runs_on_fake_driver"
    );
    let model = GpuRelayout::new(0).unwrap();
    let p = GpuLayerwiseParams {
        device: 0,
        layers: 5,
        row_bytes: 96,
        tokens: vec![256, 700],
        dcp: 4,
        page_size: 16,
        layer_us: 200,
        reps: 2,
        staging_bytes: 1 << 20,
    };
    let launches = fake_counter(c"pdx_fake_launches");
    let points = run(&model, &p).unwrap();
    assert_eq!(points.len(), 2);
    // per request: one gather and one spin per layer (no spin in the two bare rounds)
    let requests = (1 + 3 * p.reps as u64) * points.len() as u64;
    assert!(
        fake_counter(c"pdx_fake_launches") - launches >= requests * u64::from(p.layers),
        "the layers' kernels were not launched"
    );
    for (q, &tokens) in points.iter().zip(&p.tokens) {
        let per_request = tokens * u64::from(p.layers) * p.row_bytes + u64::from(p.dcp) * 64;
        assert_eq!(q.tokens, tokens);
        assert_eq!(q.bytes, tokens * u64::from(p.layers) * p.row_bytes);
        assert_eq!(
            q.verified_bytes,
            per_request * (1 + 3 * p.reps as u64),
            "{q:?}"
        );
        assert!((q.layer_ms - 0.2).abs() < 1e-9, "{q:?}");
        assert!(
            q.whole_exposed_ms.is_finite() && q.layerwise_exposed_ms.is_finite(),
            "{q:?}"
        );
        assert!(
            q.whole_exposed_ms > 0.0 && q.layerwise_exposed_ms > 0.0,
            "{q:?}"
        );
    }
    println!("fake-driver layerwise child: all checks passed ({points:?})");
}

/// The fake libcuda's `cuMemCreate` memory against
/// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`, and decodes whose device
/// pools cannot be written by GPUDirect RDMA: a mapping made without
/// `gpuDirectRDMACapable` is found (with its range), one made with it and
/// `cuMemAlloc` memory pass; over rdma such a decode is refused at creation
/// (`no_gpudirect`, naming the pool and the flag), over auto it starts, does
/// not offer GPUDirect, and its rooms go over tcp whole.
#[test]
#[ignore = "run by device_path_runs_on_fake_driver in a child process with the fake libcuda"]
fn child_vmm_gpudirect_on_fake_driver() {
    use cluster::{Cluster, Pools};
    use pdxfer::bootstrap::schema::Role;
    use pdxfer::engine::{Engine, KvPool};
    use pdxfer::relayout::gpu::GpuRelayout;
    use pdxfer::transport::rdma::fake::FakeNic;
    use pdxfer::transport::rdma::handshake::Mtu;
    use pdxfer::transport::TransportKind;
    use std::time::Duration;

    assert!(
        std::env::var_os("PDXFER_FAKE_CUDA_CHILD").is_some(),
        "this test only runs as the child of device_path_runs_on_fake_driver"
    );
    pdxfer::cuda::probe().expect("load the fake libcuda");
    let g = GpuRelayout::new(0).unwrap();
    let w = pdxfer::cuda::HostToDevice::new(0).unwrap();

    // CUmemAllocationProp and CUmemAccessDesc as C lays them out
    #[repr(C)]
    struct Prop {
        type_: i32,
        handle_types: i32,
        loc_type: i32,
        loc_id: i32,
        win32: u64,
        compression: u8,
        gpu_direct_rdma_capable: u8,
        usage: u16,
        reserved: [u8; 4],
    }
    #[repr(C)]
    struct Access {
        loc_type: i32,
        loc_id: i32,
        flags: i32,
    }
    fn sym<T>(name: &std::ffi::CStr) -> T {
        // SAFETY: the already-loaded fake libcuda (RTLD_NOLOAD); the caller
        // names the symbol's C signature as T (a function pointer).
        unsafe {
            let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            assert!(!h.is_null(), "the fake libcuda is not loaded");
            let f = libc::dlsym(h, name.as_ptr());
            assert!(!f.is_null(), "{name:?} missing");
            std::mem::transmute_copy(&f)
        }
    }
    let create: extern "C" fn(*mut u64, usize, *const Prop, u64) -> i32 = sym(c"cuMemCreate");
    let reserve: extern "C" fn(*mut u64, usize, usize, u64, u64) -> i32 =
        sym(c"cuMemAddressReserve");
    let map: extern "C" fn(u64, usize, usize, u64, u64) -> i32 = sym(c"cuMemMap");
    let access: extern "C" fn(u64, usize, *const Access, usize) -> i32 = sym(c"cuMemSetAccess");
    let unmap: extern "C" fn(u64, usize) -> i32 = sym(c"cuMemUnmap");
    let release: extern "C" fn(u64) -> i32 = sym(c"cuMemRelease");
    let free_va: extern "C" fn(u64, usize) -> i32 = sym(c"cuMemAddressFree");
    const SIZE: usize = 2 << 20;
    for capable in [0u8, 1] {
        let prop = Prop {
            type_: 1, // CU_MEM_ALLOCATION_TYPE_PINNED
            handle_types: 0,
            loc_type: 1, // CU_MEM_LOCATION_TYPE_DEVICE
            loc_id: 0,
            win32: 0,
            compression: 0,
            gpu_direct_rdma_capable: capable,
            usage: 0,
            reserved: [0; 4],
        };
        let (mut handle, mut va) = (0u64, 0u64);
        assert_eq!(create(&mut handle, SIZE, &prop, 0), 0);
        assert_eq!(reserve(&mut va, SIZE, 0, 0, 0), 0);
        assert_eq!(map(va, SIZE, 0, handle, 0), 0);
        let rw = Access {
            loc_type: 1,
            loc_id: 0,
            flags: 3,
        };
        assert_eq!(access(va, SIZE, &rw, 1), 0);
        w.check_device_range(va, SIZE as u64).unwrap();
        let gap = w.mapping_without_gpu_direct(va, SIZE as u64).unwrap();
        if capable == 0 {
            assert_eq!(
                gap,
                Some((va, va + SIZE as u64)),
                "cuMemCreate without the flag"
            );
        } else {
            assert_eq!(gap, None, "cuMemCreate with gpuDirectRDMACapable");
        }
        assert_eq!(unmap(va, SIZE), 0);
        assert_eq!(release(handle), 0);
        assert_eq!(free_va(va, SIZE), 0);
    }
    let plain = g.stream().alloc(SIZE).unwrap();
    assert_eq!(
        w.mapping_without_gpu_direct(plain.ptr(), SIZE as u64)
            .unwrap(),
        None,
        "cuMemAlloc memory"
    );
    drop(plain);
    // the probe gpu-check prints asks the same three kinds of memory
    let p = pdxfer::cuda::probe_vmm_gpudirect(0).unwrap();
    assert_eq!(
        (p.vmm, p.mem_alloc, p.vmm_flagged, p.vmm_unflagged),
        (true, Some(true), Some(true), Some(false)),
        "{p:?}"
    );
    assert!(p
        .describe()
        .contains("cuMemCreate(gpuDirectRDMACapable=0) NOT capable"));
    println!("fake-driver vmm-gpudirect child: cuMemAlloc and cuMemCreate(gpuDirectRDMACapable=0/1) told apart: {}", p.describe());

    // decodes whose device pools are VMM chunks without the flag
    fake_set(c"pdx_fake_set_vmm_chunk", 4096u64);
    fake_set(c"pdx_fake_set_vmm_gdr", 0i32);
    let name = "fake-vmm-gdr";
    let mut c = Cluster::build(name, (1, 1), TransportKind::Auto)
        .layers(2)
        .decode_pools(Pools::Device)
        .rails(1)
        .prefill_nic(FakeNic::new("vmm-gdr-p", 1, Mtu::Mtu4096))
        .room_timeout(Duration::from_secs(20))
        .receiver_timeout(Duration::from_secs(20))
        .start();
    let rdma_decode = |c: &Cluster, nic: &str| {
        let mirror = &c.decode[0].1;
        let mut cfg = cluster::config(
            Role::Decode,
            name,
            &c.server.url(),
            mirror,
            (1, 0),
            TransportKind::Rdma,
        );
        cfg.pools = mirror
            .kv_pools()
            .into_iter()
            .zip(&c.decode_dev[0])
            .map(|(p, d)| KvPool { base: d.ptr(), ..p })
            .collect();
        cfg.pool_device = Some(0);
        cfg.testing.nic = Some(FakeNic::new(nic, 1, Mtu::Mtu4096) as _);
        // SAFETY: the device pools and the aux outlive the engine (dropped below).
        unsafe { Engine::new(cfg) }
    };
    let e = rdma_decode(&c, "vmm-gdr-d1").map(|_| ()).unwrap_err();
    assert_eq!(e.status(), pdxfer::Status::NoGpuDirect, "{e}");
    for want in ["KV pool 0", "gpuDirectRDMACapable", "transport tcp or auto"] {
        assert!(e.detail().contains(want), "{want}: {e}");
    }
    // over auto: rooms whole, over tcp
    let token = 2 * cluster::ROW;
    let verified = c.request(1, 300, 0, 4);
    assert_eq!(verified, 300 * token + 32);
    let used: Vec<String> = c
        .prefill()
        .metrics_snapshot()
        .peers
        .iter()
        .map(|p| p.transport.clone())
        .collect();
    assert_eq!(used, ["tcp"], "auto with pools GPUDirect cannot write");
    c.close();
    println!("fake-driver vmm-gpudirect child: rdma refused at creation ({e}); auto went over tcp");
    // the same pools made with the flag: an rdma decode starts
    fake_set(c"pdx_fake_set_vmm_gdr", 1i32);
    let c = Cluster::build("fake-vmm-gdr-ok", (1, 1), TransportKind::Auto)
        .layers(2)
        .decode_pools(Pools::Device)
        .rails(1)
        .prefill_nic(FakeNic::new("vmm-gdr-ok-p", 1, Mtu::Mtu4096))
        .start();
    let d = rdma_decode(&c, "vmm-gdr-d2").unwrap_or_else(|e| panic!("capable VMM pools: {e}"));
    d.close();
    c.close();
    fake_set(c"pdx_fake_set_vmm_chunk", 0u64);
    println!("fake-driver vmm-gpudirect child: all checks passed");
}
