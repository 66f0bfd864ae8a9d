//! Engines over transport nccl (device pools on both sides) on the fake
//! libcuda and libnccl (`cuda/fake_driver.cpp`, `cuda/fake_nccl.cpp`; see
//! CONTRIBUTING for what they model). cudarc loads libcuda once per process
//! and glibc reads LD_LIBRARY_PATH at start-up, so each scenario runs in a
//! child process of this test binary (`--ignored --exact child_...`) whose
//! LD_LIBRARY_PATH holds the fakes; the killed-decode scenario runs its
//! decode engine in a process of its own, which the prefill's child kills.
//!
//! Scenarios: DCP 1->2 (Direct recvs into the pool rows) and 1->4 (Staged,
//! scattered by the relayout kernel), every byte of the decode's device
//! memory read back and checked; a decode that never posts (the room fails
//! at its deadline, no hang, and the next room to that decode gets a fresh
//! communicator and lands whole); an abort mid-transfer (fenced, the prefill
//! fails `aborted`); a digest mismatch (`nccl_plan_mismatch` on both sides);
//! a killed decode (`peer_unreachable` before the deadline); engines
//! closed mid-transfer (prompt, the peers' rooms fail); and a prefill whose
//! chunks name another live room's decode pages (refused `out_of_bounds`
//! before posting, the other room's bytes unchanged); both ends on one GPU
//! (refused `nccl_same_gpu` when the link is set up, no communicator made).
//! The decodes' pools are on fake device 1, the prefill's on device 0
//! (`PDXFER_FAKE_CUDA_DEVICES=2`).
#![cfg(feature = "nccl")]

use crate::support::cluster::{Cluster, Pools, Spec};
use crate::support::fakes;
use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::cuda::DeviceBuffer;
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, EngineConfig, KvPoll};
use pdxfer::layout::{DcpLayout, Side};
use pdxfer::relayout::gpu::GpuRelayout;
use pdxfer::transport::nccl::{NcclAbort, NcclPair, NcclPlanOptions, NcclRole};
use pdxfer::transport::TransportKind;
use pdxfer::Status;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LAYERS: u32 = 3;
const ROW: u64 = 96;
const PAGE: u64 = 16;
const PAGES: u64 = 48;
const DPAGES: u64 = 24;

/// Builds both fakes once per test process (the tests run in parallel threads).
fn build_fakes() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| fakes::compile_fakes("fake-nccl-engine"))
        .clone()
}

fn child(fakes: &std::path::Path, name: &str, case: &str) -> Command {
    let ld = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", fakes.display()),
        _ => fakes.display().to_string(),
    };
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--ignored",
        "--exact",
        crate::support::test_name(module_path!(), name).as_str(),
        "--nocapture",
        "--test-threads=1",
    ])
    .env("LD_LIBRARY_PATH", ld)
    .env("PDXFER_KERNEL_MODULE", fakes.join("module.ptx"))
    .env("PDXFER_NCCL", fakes.join("libnccl.so.2"))
    .env("PDXFER_FAKE_NCCL_DIR", fakes)
    // two fake GPUs: the prefill's pools on device 0, the decodes' on device 1
    .env("PDXFER_FAKE_CUDA_DEVICES", "2")
    .env("PDXFER_NCCL_ENGINE_CHILD", "1")
    .env("PDXFER_NCCL_ENGINE_CASE", case)
    .env("PDXFER_NCCL_ENGINE_FAKES", fakes)
    .env_remove("PDXFER_FAKE_NCCL_FAULT")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c
}

#[test]
fn engines_over_nccl_on_the_fakes() {
    let fakes = build_fakes();
    let cases = [
        "dcp2",
        "dcp4",
        "faults",
        "mismatch",
        "killed",
        "decode_close",
        "forged",
        "same_gpu",
        "strided",
    ];
    let kids: Vec<_> = cases
        .iter()
        .map(|c| {
            child(&fakes, "child_nccl_engine", c)
                .spawn()
                .expect("spawn a child test")
        })
        .collect();
    for (case, k) in cases.iter().zip(kids) {
        let out = k.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "nccl engine child {case} failed:\n{text}"
        );
        let done = format!("nccl engine child {case}: all checks passed");
        assert!(text.contains(&done), "child {case} did not run:\n{text}");
    }
}

/// `pdxfer bench --transport nccl`: on the fakes (one "GPU", named twice)
/// every point verifies its last room; with one GPU and no `--nccl-gpus`
/// it is `unsupported` saying why; without NCCL `no_nccl` with the paths.
#[test]
fn bench_over_nccl_on_the_fakes() {
    let fakes = build_fakes();
    let bench = |args: &[&str], nccl: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_pdxfer"))
            .args(["bench", "--transport", "nccl"])
            .args(args)
            .env("LD_LIBRARY_PATH", &fakes)
            // one fake GPU unless the arguments name two
            .env(
                "PDXFER_FAKE_CUDA_DEVICES",
                if args.contains(&"--nccl-gpus") {
                    "2"
                } else {
                    "1"
                },
            )
            .env("PDXFER_KERNEL_MODULE", fakes.join("module.ptx"))
            .env("PDXFER_NCCL", nccl)
            .env("PDXFER_FAKE_NCCL_DIR", &fakes)
            .env_remove("PYTHONPATH")
            .env_remove("VIRTUAL_ENV")
            .env_remove("CONDA_PREFIX")
            .output()
            .unwrap()
    };
    let lib = fakes.join("libnccl.so.2");
    let out = bench(
        &[
            "--nccl-gpus",
            "0,1",
            "--block-sizes",
            "64K,1M",
            "--iters",
            "3",
            "--json",
        ],
        &lib,
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 2, "{v}");
    for p in points {
        assert_eq!(p["verified"], true, "{v}");
        assert!(p["gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
    }
    // both ranks on one GPU: refused when the link is set up, naming cma and tcp
    let out = bench(
        &["--nccl-gpus", "1,1", "--block-sizes", "64K", "--iters", "1"],
        &lib,
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("nccl_same_gpu") && err.contains("0000:c2:00.0") && err.contains("cma or tcp"),
        "{err}"
    );
    let out = bench(&[], &lib);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success());
    assert!(
        err.contains("unsupported") && err.contains("one GPU per rank"),
        "{err}"
    );
    let out = bench(
        &[],
        std::path::Path::new("/nonexistent/pdxfer/libnccl.so.2"),
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success());
    if !err.contains("no_nccl") {
        // a system NCCL answered after the missing file: then no driver or one GPU
        assert!(
            err.contains("unsupported") || err.contains("no_cuda_driver"),
            "{err}"
        );
    } else {
        assert!(err.contains("/nonexistent/pdxfer/libnccl.so.2"), "{err}");
    }
}

// ---- children ------------------------------------------------------------

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

fn require_child() {
    assert!(
        std::env::var_os("PDXFER_NCCL_ENGINE_CHILD").is_some(),
        "this test only runs as a child of engines_over_nccl_on_the_fakes"
    );
}

/// Device copies of a synthetic pool set, and the pools pointing at them.
use crate::support::cluster::device_pools as on_device;

/// A shared test cluster of this file's geometry over nccl: one prefill and
/// `dcp` decode ranks, device pools on both sides, the prefill's staging
/// as [`prefill_engine_with`] sets it, 20 s room and receiver deadlines.
fn device_cluster(name: &str, dcp: u32) -> Spec {
    Cluster::build(name, (1, dcp), TransportKind::Nccl)
        .layers(LAYERS)
        .row_bytes(ROW)
        .prefill_pools(Pools::Device)
        .decode_pools(Pools::Device)
        .decode_device(1)
        .staging(2 * 7 * LAYERS as u64 * ROW)
        .room_timeout(Duration::from_secs(20))
        .receiver_timeout(Duration::from_secs(20))
}

/// One decode engine with its mirror (aux and expected bytes) and device pools.
struct Decode {
    engine: Engine,
    mirror: SyntheticPools,
    bufs: Vec<DeviceBuffer>,
}

/// Direct recvs into the pool rows, although this geometry's ops are small.
fn direct_options() -> NcclPlanOptions {
    NcclPlanOptions {
        min_direct_op_bytes: 0,
        ..Default::default()
    }
}

fn staged_options() -> NcclPlanOptions {
    NcclPlanOptions {
        max_direct_ops: 0,
        chunk_bytes: 4000,
        max_group_ops: 3,
        ..Default::default()
    }
}

/// Its pools are on device 1 (the prefill's on device 0).
fn decode_engine(
    cluster: &str,
    url: &str,
    dcp: u32,
    r: u32,
    plan: Option<NcclPlanOptions>,
    never_post: Vec<u64>,
) -> Decode {
    let g = GpuRelayout::new(1).expect("device 1 (PDXFER_FAKE_CUDA_DEVICES=2)");
    let mirror = SyntheticPools::new(LAYERS, ROW, PAGE, DPAGES, 8, 32).unwrap();
    let (bufs, kv) = on_device(&g, &mirror);
    for b in &bufs {
        g.stream().memset(b, 0).unwrap();
    }
    g.stream().record(false).unwrap().wait().unwrap();
    let mut cfg = EngineConfig::new(Role::Decode, cluster, url, mirror.topology(dcp, r), kv);
    cfg.pool_device = Some(1);
    cfg.aux = mirror.aux_buffers();
    cfg.transport = TransportKind::Nccl;
    cfg.testing.nccl_plan = plan;
    cfg.testing.nccl_never_post_rooms = never_post;
    // SAFETY: the device pools and the mirror's aux live in `Decode` beside the engine.
    let engine = unsafe { Engine::new(cfg) }.unwrap();
    Decode {
        engine,
        mirror,
        bufs,
    }
}

/// The prefill with its host mirror and device pools.
struct Prefill {
    engine: Engine,
    host: SyntheticPools,
    bufs: Vec<DeviceBuffer>,
}

fn prefill_engine(
    g: &GpuRelayout,
    cluster: &str,
    url: &str,
    plan: Option<NcclPlanOptions>,
    room_timeout: Duration,
    never_send: Vec<u64>,
) -> Prefill {
    prefill_engine_with(g, cluster, url, room_timeout, |cfg| {
        cfg.testing.nccl_plan = plan;
        cfg.testing.nccl_never_send_rooms = never_send;
    })
}

/// The prefill, with test knobs set by `knobs`.
fn prefill_engine_with(
    g: &GpuRelayout,
    cluster: &str,
    url: &str,
    room_timeout: Duration,
    knobs: impl FnOnce(&mut EngineConfig),
) -> Prefill {
    let host = SyntheticPools::new(LAYERS, ROW, PAGE, PAGES, 8, 32).unwrap();
    let (bufs, kv) = on_device(g, &host);
    let mut cfg = EngineConfig::new(Role::Prefill, cluster, url, host.topology(1, 0), kv);
    cfg.pool_device = Some(0);
    cfg.staging_bytes = 2 * 7 * LAYERS as u64 * ROW;
    cfg.aux = host.aux_buffers();
    cfg.transport = TransportKind::Nccl;
    cfg.room_timeout = room_timeout;
    knobs(&mut cfg);
    // SAFETY: the device pools and aux live in `Prefill` beside the engine.
    let engine = unsafe { Engine::new(cfg) }.unwrap();
    Prefill { engine, host, bufs }
}

/// A room's pages: (source pages, decode pages, tokens after the prefix).
fn room_pages(room: u64, dcp: u32, prefix: u64, total: u64) -> (Vec<u64>, Vec<u64>, u64) {
    let v = PAGE * dcp as u64;
    let n = total - prefix;
    let src: Vec<u64> = (0..n.div_ceil(PAGE))
        .map(|i| (i * 7 + room) % PAGES)
        .collect();
    let dst: Vec<u64> = (0..n.div_ceil(v))
        .map(|i| (i * 5 + room) % DPAGES)
        .collect();
    (src, dst, n)
}

/// Fills the prefill's pools for the room and uploads them to its device.
fn fill(g: &GpuRelayout, p: &mut Prefill, room: u64, src: &[u64], prefix: u64, total: u64) {
    let side = Side {
        layout: DcpLayout::sglang(PAGE, 1).unwrap(),
        rank: 0,
        pages: src,
        origin: prefix,
    };
    p.host.fill(room, &side, total);
    p.host.fill_aux(room, 3);
    for (l, d) in p.bufs.iter().enumerate() {
        g.stream().upload(d, 0, p.host.layer_bytes(l)).unwrap();
    }
    g.stream().record(false).unwrap().wait().unwrap();
}

/// Opens the room on every decode and sends its metadata.
fn open_decodes(decodes: &[&Decode], room: u64, dst: &[u64], prefix: u64, timeout: Duration) {
    for d in decodes {
        d.engine.receiver(room, 0, Some(timeout)).unwrap();
        d.engine.send_metadata(room, dst, prefix, 5).unwrap();
    }
}

/// Opens the prefill's room once the decodes' metadata arrived and queues
/// the source pages in chunks of `chunk_pages`.
fn send_room(p: &Engine, room: u64, src: &[u64], chunk_pages: usize, n: u64) {
    p.sender(room).unwrap();
    let t0 = Instant::now();
    while p.poll(room) == KvPoll::Bootstrapping {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "room {room}: no metadata"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut sent = 0;
    for (i, chunk) in src.chunks(chunk_pages).enumerate() {
        let last = (i + 1) * chunk_pages >= src.len();
        let t = if last {
            n - sent
        } else {
            chunk.len() as u64 * PAGE
        };
        p.send(room, chunk, t, last, 3).unwrap();
        sent += t;
    }
}

/// Reads decode `r`'s device pools back and checks every byte of the room.
fn verify(
    d: &mut Decode,
    room: u64,
    dcp: u32,
    r: u32,
    dst: &[u64],
    prefix: u64,
    total: u64,
) -> u64 {
    for (l, b) in d.bufs.iter().enumerate() {
        b.read(0, d.mirror.layer_bytes_mut(l)).unwrap();
    }
    let side = Side {
        layout: DcpLayout::sglang(PAGE, dcp as u64).unwrap(),
        rank: r as u64,
        pages: dst,
        origin: prefix,
    };
    d.mirror
        .verify(room, &side, total, Some(5))
        .unwrap_or_else(|e| panic!("decode {r} room {room}: {e}"))
}

/// Waits for `e`'s room to fail and returns its failure.
fn failed(e: &Engine, room: u64, within: Duration, what: &str) -> pdxfer::Error {
    let t0 = Instant::now();
    let p = e.wait(room, within);
    assert_eq!(
        p,
        KvPoll::Failed,
        "{what}: room {room} is {p:?} after {:?}",
        t0.elapsed()
    );
    e.failure(room).unwrap()
}

/// A function of the fake libnccl loaded in this process.
fn fake_nccl_symbol(name: &std::ffi::CStr) -> *mut libc::c_void {
    let path = std::ffi::CString::new(env("PDXFER_NCCL")).unwrap();
    // SAFETY: dlopen with RTLD_NOLOAD only finds the already-loaded fake;
    // dlsym looks a name up in it. Both take valid C strings.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "the fake libnccl is not loaded");
        let f = libc::dlsym(h, name.as_ptr());
        assert!(!f.is_null(), "not the fake libnccl");
        f
    }
}

/// The fake libnccl's (aborts, destroys, live communicators) in this process.
fn fake_nccl_counts() -> (u64, u64, u64) {
    let f = fake_nccl_symbol(c"pdx_fake_nccl_counts");
    // SAFETY: the fake's counter function is
    // `void (unsigned long long*, unsigned long long*, unsigned long long*)`.
    let f: extern "C" fn(*mut u64, *mut u64, *mut u64) = unsafe { std::mem::transmute(f) };
    let (mut a, mut d, mut l) = (0, 0, 0);
    f(&mut a, &mut d, &mut l);
    (a, d, l)
}

/// The fake libcuda's `cuMemFree` calls that freed memory, in this process.
fn fake_device_frees() -> u64 {
    // SAFETY: dlopen of the already-loaded fake libcuda (RTLD_NOLOAD) and its
    // counter `unsigned long long (void)`.
    unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "the fake libcuda is not loaded");
        let f = libc::dlsym(h, c"pdx_fake_device_frees".as_ptr());
        assert!(!f.is_null(), "not the fake libcuda");
        let f: extern "C" fn() -> u64 = std::mem::transmute(f);
        f()
    }
}

/// The fake libnccl's aborts of rank 0 (prefill) and rank 1 (decode)
/// communicators in this process.
fn fake_nccl_rank_aborts() -> (u64, u64) {
    let f = fake_nccl_symbol(c"pdx_fake_nccl_rank_aborts");
    // SAFETY: the fake's function is `void (unsigned long long*, unsigned long long*)`.
    let f: extern "C" fn(*mut u64, *mut u64) = unsafe { std::mem::transmute(f) };
    let (mut p, mut d) = (0, 0);
    f(&mut p, &mut d);
    (p, d)
}

#[test]
#[ignore = "run by engines_over_nccl_on_the_fakes as a child process"]
fn child_nccl_engine() {
    require_child();
    let case = env("PDXFER_NCCL_ENGINE_CASE");
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let g = GpuRelayout::new(0).unwrap();
    let cluster = format!("nccl-engine-{case}");
    let token = LAYERS as u64 * ROW;
    match case.as_str() {
        "dcp2" | "dcp4" => {
            let (dcp, plan) = if case == "dcp2" {
                (2u32, Some(direct_options()))
            } else {
                (4, Some(staged_options()))
            };
            let mut c = device_cluster(&cluster, dcp)
                .knobs(move |_, _, cfg| cfg.testing.nccl_plan = plan)
                .start();
            let v = PAGE * dcp as u64;
            let mut kv_sent = 0;
            for (room, total, prefix, chunk_pages) in
                [(1u64, 300u64, 0u64, 4usize), (2, 517, v * 2, 100)]
            {
                let req = c.open_room(room, total, prefix, true);
                if room == 1 {
                    // every link's communicator opens after its hello, before
                    // any chunk is sent; both ends count the init and its time
                    let t0 = Instant::now();
                    let opened = |e: &Engine| e.metrics_snapshot().nccl_comm_inits;
                    while (opened(c.prefill()) < dcp as u64
                        || c.decode.iter().any(|(d, _)| opened(d) < 1))
                        && t0.elapsed() < Duration::from_secs(10)
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    let m = c.prefill().metrics_snapshot();
                    assert_eq!(
                        m.nccl_comm_inits, dcp as u64,
                        "{case}: opened before the room"
                    );
                    assert_eq!(m.nccl_comm_init_failures, 0);
                    assert!(m.nccl_comm_init_seconds > 0.0);
                    for (d, _) in &c.decode {
                        assert_eq!(d.metrics_snapshot().nccl_comm_inits, 1, "{case} decode");
                    }
                    let text = c.prefill().metrics();
                    assert!(
                        text.contains(&format!(
                            "pdxfer_engine_nccl_comm_inits_total{{outcome=\"ok\"}} {dcp}"
                        )) && text.contains("pdxfer_engine_nccl_comm_init_seconds_total "),
                        "{text}"
                    );
                }
                let frees = fake_device_frees();
                c.send_all(&req, chunk_pages);
                c.wait_prefill_success(room);
                // the links' staging was allocated when they opened (and
                // grown, not freed, for the larger chunks): no cuMemFree,
                // which would wait for every other link's spinning kernels
                assert_eq!(
                    fake_device_frees(),
                    frees,
                    "{case} room {room}: a device free"
                );
                let mut verified = 0;
                for r in 0..dcp as usize {
                    c.wait_decode_success(room, r);
                    verified += c.verify_rank(&req, r);
                    c.decode[r].0.clear(room).unwrap();
                }
                let n = req.n();
                assert_eq!(verified, n * token + dcp as u64 * 32, "{case} room {room}");
                kv_sent += n * token;
                // the bytes went over NCCL: one live communicator per link on
                // each side (both ends live in this process), none aborted
                assert_eq!(
                    fake_nccl_counts(),
                    (0, 0, 2 * dcp as u64),
                    "{case} room {room}"
                );
                c.prefill().clear(room).unwrap();
                println!(
                    "{case}: room {room} DCP 1->{dcp} over nccl, every byte checked ({verified} B)"
                );
            }
            // the prefill counted the NCCL pairs' KV bytes per decode rank
            let kv: u64 = c
                .prefill()
                .metrics_snapshot()
                .peers
                .iter()
                .map(|x| x.bytes)
                .sum();
            assert!(kv >= kv_sent, "{case}: prefill counted {kv} B of {kv_sent}");
            c.close();
            // closing finalized and destroyed every communicator
            assert_eq!(fake_nccl_counts(), (0, 2 * dcp as u64, 0), "{case} closed");
            // the non-blocking communicators' ncclGroupEnd answered ncclInProgress
            // (as a real NCCL may) and the pairs polled through it
            let in_progress = fake_nccl_symbol(c"pdx_fake_nccl_groups_in_progress");
            // SAFETY: the fake's `unsigned long long (void)` counter.
            let in_progress: extern "C" fn() -> u64 = unsafe { std::mem::transmute(in_progress) };
            assert!(in_progress() > 0, "{case}: no group launch was in progress");
        }
        "faults" => faults(&g, &cluster, &url),
        "mismatch" => {
            let mut c = device_cluster(&cluster, 1)
                .knobs(|role, _, cfg| {
                    if role == Role::Decode {
                        cfg.testing.nccl_plan = Some(staged_options());
                    }
                })
                .start();
            let req = c.open_room(1, 200, 0, true);
            c.send_all(&req, 100);
            let e = failed(c.prefill(), 1, Duration::from_secs(10), "mismatch prefill");
            assert_eq!(e.status(), Status::NcclPlanMismatch, "{e}");
            assert!(e.detail().contains("decode rank instance"), "{e}");
            let e = failed(
                &c.decode[0].0,
                1,
                Duration::from_secs(10),
                "mismatch decode",
            );
            assert_eq!(e.status(), Status::NcclPlanMismatch, "{e}");
            assert!(e.detail().contains("nothing was posted"), "{e}");
            // nothing landed
            let pool = &c.decode_dev[0][0];
            let mut got = vec![1u8; pool.len()];
            pool.read(0, &mut got).unwrap();
            assert!(
                got.iter().all(|&b| b == 0),
                "bytes landed despite the mismatch"
            );
            println!("mismatch: nccl_plan_mismatch on both sides before posting: {e}");
            c.close();
        }
        "strided" => {
            // padded device pools on both sides (pages two apart): direct recvs
            // into the decode's pitch pages at DCP 1 -> 1, staged chunks and
            // the scatter at DCP 1 -> 2; every KV byte checked, the gaps untouched
            for (dcp, plan) in [(1u32, direct_options()), (2, staged_options())] {
                let mut c = device_cluster(&format!("{cluster}-{dcp}"), dcp)
                    .device_page_step(2)
                    .knobs(move |_, _, cfg| cfg.testing.nccl_plan = Some(plan))
                    .start();
                let aux = u64::from(dcp) * 32;
                assert_eq!(c.request(1, 300, 0, 4), 300 * token + aux, "dcp {dcp}");
                let v = PAGE * u64::from(dcp);
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
                for (d, _) in &c.decode {
                    assert_eq!(d.metrics_snapshot().nccl_comm_inits, 1, "dcp {dcp} decode");
                }
                c.close();
                println!("strided: DCP 1->{dcp} over nccl with page stride 2, every byte checked");
            }
        }
        "same_gpu" => {
            // both ends' pools on device 0: the link is refused when the decode
            // connects (its receiver() fails), before any room or communicator
            let c = device_cluster(&cluster, 1).decode_device(0).start();
            let e = c.decode[0]
                .0
                .receiver(1, 0, Some(Duration::from_secs(10)))
                .unwrap_err();
            assert_eq!(e.status(), Status::NcclSameGpu, "{e}");
            for want in ["0000:c1:00.0", "cma or tcp", "decode instance"] {
                assert!(e.detail().contains(want), "{want}: {e}");
            }
            assert_eq!(fake_nccl_counts(), (0, 0, 0), "no communicator was made");
            println!("same_gpu: refused at link set-up: {e}");
            c.close();
            // what the check spares: the (fake) NCCL itself refuses two ranks on
            // one GPU, at init, as NCCL's "Duplicate GPU detected"
            let id = pdxfer::transport::nccl::NcclId::new().unwrap();
            let errs: Vec<pdxfer::Error> = std::thread::scope(|s| {
                let id = &id;
                let ends: Vec<_> = [NcclRole::Sender, NcclRole::Receiver]
                    .into_iter()
                    .map(|role| {
                        s.spawn(move || {
                            let g = GpuRelayout::new(0).unwrap();
                            NcclPair::connect(
                                id,
                                role,
                                0,
                                g.stream().raw(),
                                "the other rank",
                                Instant::now() + Duration::from_secs(10),
                                &mut || true,
                                NcclAbort::new(),
                            )
                            .map(|_| ())
                            .unwrap_err()
                        })
                    })
                    .collect();
                ends.into_iter().map(|h| h.join().unwrap()).collect()
            });
            // ...and the pair's error carries NCCL's own words (ncclGetLastError)
            for e in &errs {
                assert_eq!(e.status(), Status::Nccl, "{e}");
                assert!(e.detail().contains("ncclInvalidUsage"), "{e}");
                assert!(e.detail().contains("Duplicate GPU detected"), "{e}");
            }
            println!("same_gpu: the fake NCCL refuses one GPU twice: {}", errs[0]);
        }
        "killed" => killed(&g, &cluster, &url),
        "decode_close" => decode_close(&g, &cluster, &url),
        "forged" => forged(&g, &cluster, &url),
        other => panic!("unknown case {other}"),
    }
    println!("nccl engine child {case}: all checks passed");
}

fn faults(g: &GpuRelayout, cluster: &str, url: &str) {
    // decode 0 never posts rooms 10, 12 and 13
    let mut p = prefill_engine(g, cluster, url, None, Duration::from_secs(2), vec![]);
    let mut decodes = [
        decode_engine(cluster, url, 2, 0, None, vec![10, 12, 13]),
        decode_engine(cluster, url, 2, 1, None, vec![]),
    ];
    let total = 300;
    // 10: a decode that never posts: the room fails at its deadline, typed,
    // naming the peer; nothing hangs
    let (src, dst, n) = room_pages(10, 2, 0, total);
    fill(g, &mut p, 10, &src, 0, total);
    open_decodes(
        &[&decodes[0], &decodes[1]],
        10,
        &dst,
        0,
        Duration::from_secs(2),
    );
    let t0 = Instant::now();
    send_room(&p.engine, 10, &src, 100, n);
    let e = failed(&p.engine, 10, Duration::from_secs(10), "never posts");
    assert_eq!(e.status(), Status::Timeout, "{e}");
    assert!(e.detail().contains("decode rank instance"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    for d in &decodes {
        failed(
            &d.engine,
            10,
            Duration::from_secs(10),
            "never posts, decode",
        );
    }
    // the other pair of the chunk was on the wire at the same time and
    // delivered: decode 1 holds every byte of its share
    let got = verify(&mut decodes[1], 10, 2, 1, &dst, 0, total);
    assert!(got > 32, "decode 1 checked only {got} B of room 10");
    let (aborts, _, _) = fake_nccl_counts();
    assert!(aborts >= 1, "the spent communicator was not aborted");
    println!("faults: a decode that never posts fails at the deadline: {e}");
    // 11: the next room to that decode gets a fresh communicator and lands whole
    let (src, dst, n) = room_pages(11, 2, 0, total);
    fill(g, &mut p, 11, &src, 0, total);
    open_decodes(
        &[&decodes[0], &decodes[1]],
        11,
        &dst,
        0,
        Duration::from_secs(20),
    );
    send_room(&p.engine, 11, &src, 100, n);
    assert_eq!(
        p.engine.wait(11, Duration::from_secs(20)),
        KvPoll::Success,
        "room 11: {:?}",
        p.engine.failure(11)
    );
    let mut verified = 0;
    for (r, d) in decodes.iter_mut().enumerate() {
        assert_eq!(d.engine.wait(11, Duration::from_secs(20)), KvPoll::Success);
        verified += verify(d, 11, 2, r as u32, &dst, 0, total);
    }
    assert_eq!(verified, n * LAYERS as u64 * ROW + 2 * 32);
    println!("faults: the next room over a fresh communicator, every byte checked");
    // 12: an abort mid-transfer: the decode's abort is fenced, the prefill
    // fails `aborted` long before the deadline
    let (src, dst, n) = room_pages(12, 2, 0, total);
    fill(g, &mut p, 12, &src, 0, total);
    open_decodes(
        &[&decodes[0], &decodes[1]],
        12,
        &dst,
        0,
        Duration::from_secs(30),
    );
    p.engine.sender(12).unwrap();
    let t0 = Instant::now();
    while p.engine.poll(12) == KvPoll::Bootstrapping {
        std::thread::sleep(Duration::from_millis(5));
    }
    // a long room on the prefill: only the abort ends it early
    p.engine.send(12, &src, n, true, 3).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    decodes[0].engine.abort(12).unwrap();
    while !decodes[0].engine.is_fenced(12) {
        assert!(t0.elapsed() < Duration::from_secs(5), "abort not fenced");
        std::thread::sleep(Duration::from_millis(5));
    }
    let e = failed(&p.engine, 12, Duration::from_secs(5), "abort");
    assert_eq!(e.status(), Status::Aborted, "{e}");
    println!("faults: an abort mid-transfer is fenced, the prefill failed: {e}");
    // 13: the prefill engine closed mid-transfer: close returns promptly and
    // the decode ranks' rooms fail (the control connections close)
    let (src, dst, n) = room_pages(13, 2, 0, total);
    fill(g, &mut p, 13, &src, 0, total);
    open_decodes(
        &[&decodes[0], &decodes[1]],
        13,
        &dst,
        0,
        Duration::from_secs(30),
    );
    send_room(&p.engine, 13, &src, 100, n);
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    p.engine.close();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "close took {:?}",
        t0.elapsed()
    );
    let e = failed(
        &decodes[0].engine,
        13,
        Duration::from_secs(10),
        "prefill closed",
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{e}");
    println!("faults: the prefill closed mid-transfer, decode room failed: {e}");
    // a decode engine closed while its communicator is up: prompt
    let t0 = Instant::now();
    for d in &decodes {
        d.engine.close();
    }
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "decode close took {:?}",
        t0.elapsed()
    );
    drop(p);
}

/// A decode engine closed while its recvs are posted (the prefill never
/// sends): close aborts the communicator and waits for its stream, so the
/// pools are freed right after (the fake libcuda stops the process if an
/// NCCL op still used them); the prefill's room fails naming the decode.
fn decode_close(g: &GpuRelayout, cluster: &str, url: &str) {
    let mut p = prefill_engine(g, cluster, url, None, Duration::from_secs(30), vec![30]);
    let d = decode_engine(cluster, url, 1, 0, None, vec![]);
    let (src, dst, n) = room_pages(30, 1, 0, 300);
    fill(g, &mut p, 30, &src, 0, 300);
    open_decodes(&[&d], 30, &dst, 0, Duration::from_secs(30));
    send_room(&p.engine, 30, &src, 100, n);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(d.engine.poll(30), KvPoll::WaitingForInput);
    let (_, _, live) = fake_nccl_counts();
    assert_eq!(live, 2, "both ends of the link's communicator");
    let (_, decode_aborts) = fake_nccl_rank_aborts();
    let t0 = Instant::now();
    d.engine.close();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "close took {:?}",
        t0.elapsed()
    );
    // counted by rank: the prefill may abort its end at the same time, as
    // it sees the control connection close
    assert_eq!(
        fake_nccl_rank_aborts().1,
        decode_aborts + 1,
        "the decode's communicator was not aborted"
    );
    // the pools and the engine go now: no NCCL op may still use them
    drop(d);
    let e = failed(&p.engine, 30, Duration::from_secs(10), "decode closed");
    assert!(t0.elapsed() < Duration::from_secs(10), "{e}");
    assert!(e.detail().contains("decode rank instance"), "{e}");
    println!("decode_close: closed with recvs in flight, pools freed, prefill failed: {e}");
    p.engine.close();
}

/// The prefill here, the decode in a process of its own, killed once its
/// recvs were accepted: the prefill's room fails `peer_unreachable` naming
/// it, long before the room's deadline.
fn killed(g: &GpuRelayout, cluster: &str, url: &str) {
    let mut p = prefill_engine(g, cluster, url, None, Duration::from_secs(60), vec![]);
    let fakes = PathBuf::from(env("PDXFER_NCCL_ENGINE_FAKES"));
    let mut d = child(&fakes, "child_nccl_decode_process", "killed-decode")
        .env("PDXFER_NCCL_ENGINE_URL", url)
        .env("PDXFER_NCCL_ENGINE_CLUSTER", cluster)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let (src, _dst, n) = room_pages(20, 1, 0, 300);
    fill(g, &mut p, 20, &src, 0, 300);
    // the decode process opens room 20 and sends its metadata
    send_room(&p.engine, 20, &src, 100, n);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(p.engine.poll(20), KvPoll::Transferring);
    let t0 = Instant::now();
    d.kill().unwrap();
    d.wait().unwrap();
    let e = failed(&p.engine, 20, Duration::from_secs(20), "killed decode");
    assert!(matches!(e.status(), Status::PeerUnreachable), "{e}");
    assert!(e.detail().contains("decode rank instance"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    println!("killed: peer_unreachable naming the decode: {e}");
    p.engine.close();
}

#[test]
#[ignore = "run by the killed case of child_nccl_engine as a process of its own"]
fn child_nccl_decode_process() {
    require_child();
    let url = env("PDXFER_NCCL_ENGINE_URL");
    let cluster = env("PDXFER_NCCL_ENGINE_CLUSTER");
    let d = decode_engine(&cluster, &url, 1, 0, None, vec![20]);
    let (_src, dst, _n) = room_pages(20, 1, 0, 300);
    open_decodes(&[&d], 20, &dst, 0, Duration::from_secs(60));
    // the parent kills this process
    std::thread::sleep(Duration::from_secs(60));
    panic!("the decode process was not killed");
}

/// Lands a room of `total` tokens into decode pages `dst` (DCP 1, no
/// prefix) and checks every byte of it on the decode.
fn land(g: &GpuRelayout, p: &mut Prefill, d: &mut Decode, room: u64, dst: &[u64], total: u64) {
    let (src, _, n) = room_pages(room, 1, 0, total);
    fill(g, p, room, &src, 0, total);
    open_decodes(&[d], room, dst, 0, Duration::from_secs(20));
    send_room(&p.engine, room, &src, 100, n);
    for e in [&p.engine, &d.engine] {
        assert_eq!(
            e.wait(room, Duration::from_secs(20)),
            KvPoll::Success,
            "room {room}: {:?}",
            e.failure(room)
        );
    }
    let got = verify(d, room, 1, 0, dst, 0, total);
    assert_eq!(got, n * LAYERS as u64 * ROW + 32, "room {room}");
}

/// Every byte of the decode's device pools.
fn pool_bytes(d: &Decode) -> Vec<Vec<u8>> {
    d.bufs
        .iter()
        .map(|b| {
            let mut v = vec![0u8; b.len()];
            b.read(0, &mut v).unwrap();
            v
        })
        .collect()
}

/// A prefill whose chunks of room 41 name the decode pages of room 40, a
/// room the decode holds (the test knob forges the pages the prefill plans,
/// gathers and names): the decode refuses the chunk before posting, both
/// sides fail room 41 `out_of_bounds` naming the prefill and the room, no
/// byte of the decode's pools changes (room 40 reads back whole), and the
/// next honest room lands.
fn forged(g: &GpuRelayout, cluster: &str, url: &str) {
    // 100 tokens: 7 pages of 16 per room, disjoint on the decode
    let total = 100;
    let pages = |first: u64| (first..first + 7).collect::<Vec<u64>>();
    let (dst40, dst41, dst42) = (pages(0), pages(8), pages(16));
    let forged_pages = dst40.clone();
    let mut p = prefill_engine_with(g, cluster, url, Duration::from_secs(20), |cfg| {
        cfg.testing.nccl_forge_dst_pages = vec![(41, forged_pages)];
    });
    let mut d = decode_engine(cluster, url, 1, 0, None, vec![]);
    land(g, &mut p, &mut d, 40, &dst40, total);
    let before = pool_bytes(&d);
    let (src, _, n) = room_pages(41, 1, 0, total);
    fill(g, &mut p, 41, &src, 0, total);
    open_decodes(&[&d], 41, &dst41, 0, Duration::from_secs(20));
    send_room(&p.engine, 41, &src, 100, n);
    let e = failed(&d.engine, 41, Duration::from_secs(10), "forged, decode");
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    for want in ["from prefill", "room 41", "nothing was posted"] {
        assert!(e.detail().contains(want), "{want:?} not in: {e}");
    }
    let pe = failed(&p.engine, 41, Duration::from_secs(10), "forged, prefill");
    assert_eq!(pe.status(), Status::OutOfBounds, "{pe}");
    assert!(pe.detail().contains("decode rank instance"), "{pe}");
    assert!(
        pool_bytes(&d) == before,
        "bytes landed in the decode's pools despite the refusal"
    );
    assert_eq!(d.engine.poll(40), KvPoll::Success);
    let got = verify(&mut d, 40, 1, 0, &dst40, 0, total);
    assert_eq!(got, (total * LAYERS as u64 * ROW) + 32, "room 40");
    println!("forged: a chunk naming room 40's pages for room 41 was refused: {e}");
    land(g, &mut p, &mut d, 42, &dst42, total);
    println!("forged: the next honest room landed, every byte checked");
    p.engine.close();
    d.engine.close();
}
