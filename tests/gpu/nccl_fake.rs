//! NCCL pair transfers between separate processes, one "GPU" per rank, over
//! `cuda/fake_nccl.cpp` and `cuda/fake_driver.cpp` (see their headers for
//! what they model). The parent builds both fakes and runs each scenario as
//! child processes of this test binary (`--ignored --exact child_...`): one
//! prefill (sender) process holding one pair per decode rank, and one process
//! per decode rank. The two sides meet through files in a scenario directory
//! (the unique id and both plans' digests, as the control handshake carries
//! them) and through the fake's shared-memory rendezvous.
//!
//! Scenarios: DCP 1->2 (Direct, straight into the pool rows) and 1->4
//! (Staged, scattered by the relayout kernel), every byte read back from the
//! decode's device memory and compared with the CPU relayout; a decode that
//! never posts (the sender's deadline, typed, no hang, and the next room over
//! a fresh communicator); one decode of two failing while the other pair
//! delivers; a killed decode (the
//! sender's liveness check); an abort mid-transfer; an injected NCCL fault; a
//! digest mismatch (refused before anything is posted); and a pair dropped
//! mid-transfer whose buffers are freed right after (the fake libcuda stops
//! the process if NCCL still used them).
#![cfg(feature = "nccl")]

use crate::support::fakes;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PAGE: u64 = 16;
const TOKENS: u64 = 300;
const SRC_PAGES: u64 = 19;
const ROWS: [u64; 3] = [48, 100, 1152];

/// Builds both fakes once per test process (the tests run in parallel threads).
fn build_fakes() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| fakes::compile_fakes("fake-nccl"))
        .clone()
}

struct Scenario {
    name: &'static str,
    ranks: u64,
    staged: bool,
}

fn child(fakes: &Path, dir: &Path, name: &str, envs: &[(&str, String)]) -> Child {
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
    .env("PDXFER_FAKE_NCCL_DIR", dir)
    .env("PDXFER_NCCL_TEST_DIR", dir)
    .env("PDXFER_NCCL_TEST_CHILD", "1")
    // two fake GPUs: the prefill rank on device 0, the decode ranks on device 1
    .env("PDXFER_FAKE_CUDA_DEVICES", "2")
    .env_remove("PDXFER_FAKE_NCCL_FAULT")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in envs {
        c.env(k, v);
    }
    c.spawn().expect("spawn a child test")
}

fn text(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// Runs one scenario: the sender and `ranks` receivers; returns their outputs
/// after checking each exited cleanly (a killed receiver is not checked).
fn run(
    fakes: &Path,
    case: &str,
    s: &Scenario,
    sender_env: &[(&str, String)],
) -> (String, Vec<String>) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("nccl-{}", s.name));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let common = vec![
        ("PDXFER_NCCL_TEST_CASE", case.to_string()),
        ("PDXFER_NCCL_TEST_RANKS", s.ranks.to_string()),
        ("PDXFER_NCCL_TEST_STAGED", u8::from(s.staged).to_string()),
    ];
    let mut senv = common.clone();
    senv.extend(sender_env.iter().cloned());
    let sender = child(fakes, &dir, "child_prefill_rank", &senv);
    let mut receivers: Vec<Child> = (0..s.ranks)
        .map(|r| {
            let mut e = common.clone();
            e.push(("PDXFER_NCCL_TEST_RANK", r.to_string()));
            child(fakes, &dir, "child_decode_rank", &e)
        })
        .collect();
    let killed = case == "killed";
    if killed {
        // kill decode rank 0 once it joined the communicator, and reap it
        let t0 = Instant::now();
        while !dir.join("connected.0").exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "decode 0 never connected"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        receivers[0].kill().unwrap();
        receivers[0].wait().unwrap();
    }
    let sout = sender.wait_with_output().unwrap();
    std::fs::write(dir.join("done"), b"\n").unwrap();
    let mut routs = Vec::new();
    for (r, c) in receivers.into_iter().enumerate() {
        if killed && r == 0 {
            continue;
        }
        let o = c.wait_with_output().unwrap();
        let t = text(&o);
        assert!(o.status.success(), "{}: decode {r} failed:\n{t}", s.name);
        routs.push(t);
    }
    let st = text(&sout);
    assert!(
        sout.status.success(),
        "{}: the prefill failed:\n{st}",
        s.name
    );
    std::fs::remove_dir_all(&dir).unwrap();
    (st, routs)
}

/// `pdxfer info` names the NCCL file it loaded (here the fake, by full path
/// through `$PDXFER_NCCL`), and without one is `no_nccl` listing what it tried.
#[test]
fn info_names_the_nccl_library_or_every_path_tried() {
    let fakes = build_fakes();
    let info = |nccl: &Path| -> serde_json::Value {
        let out = Command::new(env!("CARGO_BIN_EXE_pdxfer"))
            .args(["info", "--json"])
            .env("PDXFER_NCCL", nccl)
            .env("LD_LIBRARY_PATH", "")
            .env_remove("PYTHONPATH")
            .env_remove("VIRTUAL_ENV")
            .env_remove("CONDA_PREFIX")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["nccl"].clone()
    };
    let fake = fakes.join("libnccl.so.2");
    let v = info(&fake);
    assert_eq!(v["available"], true, "{v}");
    let d = v["detail"].as_str().unwrap();
    assert!(
        d.contains("version 2.29.99") && d.contains(&*fake.to_string_lossy()),
        "{d}"
    );
    let missing = Path::new("/nonexistent/pdxfer/libnccl.so.2");
    let v = info(missing);
    if v["available"] == true {
        // a system NCCL (loader path or site-packages) answered after the missing file
        eprintln!("note: a system NCCL is installed: {v}");
    } else {
        assert_eq!(v["kind"], "no_nccl", "{v}");
        let d = v["detail"].as_str().unwrap();
        assert!(
            d.contains("/nonexistent/pdxfer/libnccl.so.2") && d.contains("libnccl.so.2:"),
            "{d}"
        );
    }
}

#[test]
fn nccl_pairs_between_processes_on_the_fakes() {
    let fakes = build_fakes();
    // DCP 1->2 Direct and 1->4 Staged: every byte read back
    for s in [
        Scenario {
            name: "dcp2",
            ranks: 2,
            staged: false,
        },
        Scenario {
            name: "dcp4",
            ranks: 4,
            staged: true,
        },
    ] {
        let (st, routs) = run(&fakes, "transfer", &s, &[]);
        assert!(
            st.contains(&format!("prefill: {} pairs sent and closed", s.ranks)),
            "{st}"
        );
        for (r, t) in routs.iter().enumerate() {
            let mode = if s.staged { "Staged" } else { "Direct" };
            let want = format!("decode {r}: {mode} transfer, every byte matches the CPU relayout");
            assert!(t.contains(&want), "{}: decode {r}:\n{t}", s.name);
        }
    }
    // failures: each typed, naming the peer, in bounded time
    let one = |name| Scenario {
        name,
        ranks: 1,
        staged: false,
    };
    for (case, env, want) in [
        ("never_posts", vec![], "prefill: timeout naming the peer"),
        (
            "killed",
            vec![],
            "prefill: peer_unreachable naming the peer",
        ),
        ("abort", vec![], "prefill: aborted naming the peer"),
        (
            "fault",
            vec![("PDXFER_FAKE_NCCL_FAULT", "2".to_string())],
            "prefill: nccl error ncclSystemError naming the peer",
        ),
        (
            "drop",
            vec![],
            "prefill: dropped in flight, aborted, buffers freed",
        ),
    ] {
        let (st, routs) = run(&fakes, case, &one(case), &env);
        assert!(st.contains(want), "{case}:\n{st}");
        if case == "never_posts" {
            // the next room got a fresh communicator and arrived whole
            let t = &routs[0];
            let want = "decode 0: Direct transfer, every byte matches the CPU relayout";
            assert!(t.contains(want), "{case}: decode 0:\n{t}");
        }
    }
    // one pair failing leaves the other pairs of the prefill alone
    let s = Scenario {
        name: "partial",
        ranks: 2,
        staged: false,
    };
    let (st, routs) = run(&fakes, "partial", &s, &[]);
    assert!(
        st.contains("prefill: pair 0 delivered while pair 1 timed out"),
        "{st}"
    );
    let want = "decode 0: Direct transfer, every byte matches the CPU relayout";
    assert!(routs[0].contains(want), "partial: decode 0:\n{}", routs[0]);
    assert!(routs[1].contains("decode 1: never posted"), "{}", routs[1]);
    // a digest mismatch: both sides refuse before any communicator exists
    let (st, routs) = run(&fakes, "mismatch", &one("mismatch"), &[]);
    assert!(
        st.contains("prefill: nccl_plan_mismatch before posting"),
        "{st}"
    );
    assert!(
        routs[0].contains("decode 0: nccl_plan_mismatch before posting"),
        "{}",
        routs[0]
    );
}

// ---- children ------------------------------------------------------------

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

fn scenario_dir() -> PathBuf {
    assert!(
        std::env::var_os("PDXFER_NCCL_TEST_CHILD").is_some(),
        "this test only runs as a child of nccl_pairs_between_processes_on_the_fakes"
    );
    PathBuf::from(env("PDXFER_NCCL_TEST_DIR"))
}

/// Waits for a file the other side writes (the handshake stand-in).
fn read_file(dir: &Path, name: &str) -> String {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(dir.join(name)) {
            if s.ends_with('\n') {
                return s.trim().to_string();
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no {name} after 30 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn write_file(dir: &Path, name: &str, v: &str) {
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, format!("{v}\n")).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

fn dst_pages(ranks: u64) -> Vec<u64> {
    let k = TOKENS.div_ceil(PAGE * ranks);
    (0..k).rev().map(|i| i + 1).collect()
}

fn src_pages() -> Vec<u64> {
    vec![
        9, 2, 14, 0, 7, 11, 3, 5, 12, 1, 8, 13, 4, 6, 10, 15, 16, 17, 18,
    ]
}

fn pair_request<'a>(
    src: &'a [u64],
    dst: &'a [u64],
    ranks: u64,
    rank: u64,
) -> pdxfer::layout::PairRequest<'a> {
    pdxfer::layout::SglangChunk {
        src_pages: src,
        dst_pages: dst,
        page_size: PAGE,
        dcp_size: ranks,
        dcp_rank: rank,
        src_page_offset: 0,
        decode_prefix_len: 0,
        num_tokens: Some(TOKENS),
    }
    .to_pair()
    .unwrap()
}

fn src_pools() -> Vec<Vec<u8>> {
    ROWS.iter()
        .enumerate()
        .map(|(e, &rb)| {
            (0..SRC_PAGES * PAGE * rb)
                .map(|i| (i * 31 + e as u64 * 7 + i / 251) as u8)
                .collect()
        })
        .collect()
}

fn options(staged: bool) -> pdxfer::transport::nccl::NcclPlanOptions {
    let mut o = pdxfer::transport::nccl::NcclPlanOptions {
        min_direct_op_bytes: 0, // rows of a few hundred bytes, Direct all the same
        ..Default::default()
    };
    if staged {
        o.max_direct_ops = 0;
        o.chunk_bytes = 4000;
        o.max_group_ops = 3;
    }
    o
}

#[test]
#[ignore = "run by nccl_pairs_between_processes_on_the_fakes as a child process"]
fn child_prefill_rank() {
    use pdxfer::relayout::{self, gpu::GpuRelayout};
    use pdxfer::transport::nccl::{check_mirror, NcclAbort, NcclId, NcclPair, NcclPlan, NcclRole};
    use pdxfer::Status;

    let dir = scenario_dir();
    let case = env("PDXFER_NCCL_TEST_CASE");
    let ranks: u64 = env("PDXFER_NCCL_TEST_RANKS").parse().unwrap();
    let staged = env("PDXFER_NCCL_TEST_STAGED") == "1";
    let (version, path) = pdxfer::transport::nccl::probe().unwrap();
    assert_eq!(version, 22999, "not the fake NCCL: {path}");
    let ids: Vec<NcclId> = (0..ranks).map(|_| NcclId::new().unwrap()).collect();
    for (r, id) in ids.iter().enumerate() {
        write_file(&dir, &format!("id.{r}"), &id.to_hex());
    }
    let pools = src_pools();
    let src = src_pages();
    let dst = dst_pages(ranks);
    let opts = options(staged);
    // fields drop in this order: the pair before the buffers and the stream
    struct Live {
        pair: NcclPair,
        tx: NcclPlan,
        staging: pdxfer::cuda::DeviceBuffer,
        _pools: Vec<pdxfer::cuda::DeviceBuffer>,
        g: GpuRelayout,
    }
    let mut live = Vec::new();
    for r in 0..ranks {
        let req = pair_request(&src, &dst, ranks, r);
        let tx = NcclPlan::build(&req, &ROWS, NcclRole::Sender, &opts).unwrap();
        write_file(&dir, &format!("tx.{r}"), &tx.digest.to_string());
        let rx_digest: u64 = read_file(&dir, &format!("rx.{r}")).parse().unwrap();
        if let Err(e) = check_mirror(&tx, rx_digest) {
            assert_eq!(e.status(), Status::NcclPlanMismatch, "{e}");
            let leftovers = std::fs::read_dir(&dir)
                .unwrap()
                .flatten()
                .filter(|f| {
                    f.file_name()
                        .to_string_lossy()
                        .starts_with("pdxfer-fake-nccl")
                })
                .count();
            assert_eq!(leftovers, 0, "a communicator was created");
            println!("prefill: nccl_plan_mismatch before posting: {e}");
            return;
        }
        let mut g = GpuRelayout::new(0).unwrap();
        let bufs: Vec<_> = pools
            .iter()
            .map(|v| {
                let b = g.stream().alloc(v.len()).unwrap();
                g.stream().upload(&b, 0, v).unwrap();
                b
            })
            .collect();
        let staging = g.stream().alloc(tx.pack.total_bytes as usize).unwrap();
        let bases: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
        let ents = relayout::gather_entries(&bases, &ROWS, staging.ptr(), &tx.pack).unwrap();
        // SAFETY: the entries address the pools and staging allocated above, sized by the plan.
        // The gather is not waited: the sends are ordered after it on the stream.
        let _gathered = unsafe { g.gather(&ents, &relayout::gather_spans(&req).unwrap()) }.unwrap();
        let peer = format!("decode rank {r}");
        let deadline = Instant::now() + Duration::from_secs(20);
        let pair = NcclPair::connect(
            &ids[r as usize],
            NcclRole::Sender,
            0,
            g.stream().raw(),
            &peer,
            deadline,
            &mut || true,
            NcclAbort::new(),
        )
        .unwrap_or_else(|e| panic!("connect to {peer}: {e}"));
        let mut l = Live {
            pair,
            tx,
            staging,
            _pools: bufs,
            g,
        };
        // SAFETY: staging holds the whole pack until the pair's work completed or was aborted.
        let posted = unsafe {
            l.pair
                .post(&l.tx, l.staging.ptr(), &[], deadline, &mut || true)
        };
        match posted {
            // the injected fault is in force from the first group on, so the
            // poll of the group launch (ncclGroupEnd answers ncclInProgress)
            // may see it before the wait does
            Err(e) if case == "fault" => {
                assert_eq!(e.status(), Status::Nccl, "{e}");
                assert!(e.detail().contains("decode rank 0"), "{e}");
                assert!(e.detail().contains("ncclSystemError"), "{e}");
                assert!(!l.pair.in_flight());
                println!("prefill: nccl error ncclSystemError naming the peer: {e}");
                return;
            }
            r => r.unwrap(),
        }
        live.push(l);
    }
    let peer_pid = || -> i32 { read_file(&dir, "connected.0").parse().unwrap() };
    let t0 = Instant::now();
    match case.as_str() {
        "transfer" => {
            for l in &mut live {
                l.pair
                    .wait(Instant::now() + Duration::from_secs(20), &mut || true)
                    .unwrap();
            }
            for l in live {
                l.pair.close().unwrap();
                drop((l.staging, l.g));
            }
            println!("prefill: {ranks} pairs sent and closed");
        }
        "partial" => {
            // decode rank 1 never posts: its pair fails alone, pair 0 delivers
            let mut it = live.into_iter();
            let mut first = it.next().unwrap();
            let mut second = it.next().unwrap();
            let e = second.pair.wait(deadline_in(1), &mut || true).unwrap_err();
            assert_eq!(e.status(), Status::Timeout, "{e}");
            assert!(e.detail().contains("decode rank 1"), "{e}");
            first.pair.wait(deadline_in(20), &mut || true).unwrap();
            first.pair.close().unwrap();
            drop((first.staging, first.g, second));
            println!("prefill: pair 0 delivered while pair 1 timed out: {e}");
        }
        "never_posts" => {
            let l = &mut live[0];
            let e = l
                .pair
                .wait(Instant::now() + Duration::from_millis(1500), &mut || true)
                .unwrap_err();
            assert_eq!(e.status(), Status::Timeout, "{e}");
            assert!(
                e.detail().contains("decode rank 0") && e.detail().contains("deadline"),
                "{e}"
            );
            assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
            assert!(!l.pair.in_flight());
            // the spent communicator refuses work; the next room to the same
            // peer gets a fresh one (a new unique id through the handshake)
            // SAFETY: nothing is posted: the aborted pair refuses first.
            let again = unsafe {
                l.pair
                    .post(&l.tx, l.staging.ptr(), &[], deadline_in(5), &mut || true)
            };
            assert!(again.unwrap_err().detail().contains("aborted"));
            let id2 = NcclId::new().unwrap();
            write_file(&dir, "id2.0", &id2.to_hex());
            let mut fresh = NcclPair::connect(
                &id2,
                NcclRole::Sender,
                0,
                l.g.stream().raw(),
                "decode rank 0",
                deadline_in(20),
                &mut || true,
                NcclAbort::new(),
            )
            .unwrap();
            // SAFETY: staging still holds the gathered pack (the stream was waited at the abort).
            unsafe { fresh.post(&l.tx, l.staging.ptr(), &[], deadline_in(20), &mut || true) }
                .unwrap();
            fresh.wait(deadline_in(20), &mut || true).unwrap();
            fresh.close().unwrap();
            println!("prefill: timeout naming the peer: {e}");
        }
        "killed" => {
            let pid = peer_pid();
            let l = &mut live[0];
            let mut alive = || {
                // SAFETY: signal 0 only checks that the process exists.
                unsafe { libc::kill(pid, 0) == 0 }
            };
            let e = l
                .pair
                .wait(Instant::now() + Duration::from_secs(20), &mut alive)
                .unwrap_err();
            assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
            assert!(e.detail().contains("decode rank 0"), "{e}");
            assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
            println!("prefill: peer_unreachable naming the peer: {e}");
        }
        "abort" => {
            let l = &mut live[0];
            let flag = l.pair.abort_handle();
            let t = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                flag.abort();
            });
            let e = l
                .pair
                .wait(Instant::now() + Duration::from_secs(20), &mut || true)
                .unwrap_err();
            t.join().unwrap();
            assert_eq!(e.status(), Status::Aborted, "{e}");
            assert!(e.detail().contains("decode rank 0"), "{e}");
            // the pair is spent: a new room needs a new communicator
            assert!(!l.pair.in_flight());
            println!("prefill: aborted naming the peer: {e}");
        }
        "fault" => {
            let l = &mut live[0];
            let e = l
                .pair
                .wait(Instant::now() + Duration::from_secs(20), &mut || true)
                .unwrap_err();
            assert_eq!(e.status(), Status::Nccl, "{e}");
            assert!(e.detail().contains("decode rank 0"), "{e}");
            assert!(e.detail().contains("ncclSystemError"), "{e}");
            println!("prefill: nccl error ncclSystemError naming the peer: {e}");
        }
        "drop" => {
            let l = live.pop().unwrap();
            assert!(l.pair.in_flight());
            // the pair goes first, then its buffers: the fake libcuda stops the
            // process if a pending NCCL op still used them
            drop(l.pair);
            drop(l.staging);
            drop(l._pools);
            drop(l.g);
            let (aborts, destroys, left) = fake_nccl_counts();
            assert_eq!((aborts, destroys, left), (1, 0, 0));
            println!("prefill: dropped in flight, aborted, buffers freed");
        }
        other => panic!("unknown case {other}"),
    }
}

fn deadline_in(secs: u64) -> Instant {
    Instant::now() + Duration::from_secs(secs)
}

/// The fake libnccl's (aborts, destroys, live communicators).
fn fake_nccl_counts() -> (u64, u64, u64) {
    let path = std::ffi::CString::new(env("PDXFER_NCCL")).unwrap();
    // SAFETY: the already-loaded fake (RTLD_NOLOAD) and its counter function
    // `void (unsigned long long*, unsigned long long*, unsigned long long*)`.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "the fake libnccl is not loaded");
        let f = libc::dlsym(h, c"pdx_fake_nccl_counts".as_ptr());
        assert!(!f.is_null(), "not the fake libnccl");
        let f: extern "C" fn(*mut u64, *mut u64, *mut u64) = std::mem::transmute(f);
        let (mut a, mut d, mut l) = (0, 0, 0);
        f(&mut a, &mut d, &mut l);
        (a, d, l)
    }
}

#[test]
#[ignore = "run by nccl_pairs_between_processes_on_the_fakes as a child process"]
fn child_decode_rank() {
    use pdxfer::layout::PackLayout;
    use pdxfer::relayout::{self, cpu, gpu::GpuRelayout};
    use pdxfer::transport::nccl::{check_mirror, NcclAbort, NcclId, NcclPair, NcclPlan, NcclRole};
    use pdxfer::Status;

    let dir = scenario_dir();
    let case = env("PDXFER_NCCL_TEST_CASE");
    let ranks: u64 = env("PDXFER_NCCL_TEST_RANKS").parse().unwrap();
    let rank: u64 = env("PDXFER_NCCL_TEST_RANK").parse().unwrap();
    let staged = env("PDXFER_NCCL_TEST_STAGED") == "1";
    let src = src_pages();
    let dst = dst_pages(ranks);
    let req = pair_request(&src, &dst, ranks, rank);
    // the mismatch case: other KV geometry on this side
    let rows: Vec<u64> = if case == "mismatch" {
        vec![48, 100, 576]
    } else {
        ROWS.to_vec()
    };
    let rx = NcclPlan::build(&req, &rows, NcclRole::Receiver, &options(staged)).unwrap();
    write_file(&dir, &format!("rx.{rank}"), &rx.digest.to_string());
    let tx_digest: u64 = read_file(&dir, &format!("tx.{rank}")).parse().unwrap();
    if let Err(e) = check_mirror(&rx, tx_digest) {
        assert_eq!(e.status(), Status::NcclPlanMismatch, "{e}");
        println!("decode {rank}: nccl_plan_mismatch before posting: {e}");
        return;
    }
    let id = NcclId::from_hex(&read_file(&dir, &format!("id.{rank}"))).unwrap();
    let mut g = GpuRelayout::new(1).unwrap();
    let dst_rows = dst.iter().max().unwrap() + 1;
    let bufs: Vec<_> = rows
        .iter()
        .map(|&rb| {
            let b = g.stream().alloc((dst_rows * PAGE * rb) as usize).unwrap();
            g.stream().memset(&b, 0).unwrap();
            b
        })
        .collect();
    g.stream().record(false).unwrap().wait().unwrap();
    let staging = g.stream().alloc(rx.pack.total_bytes as usize).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let joined = NcclPair::connect(
        &id,
        NcclRole::Receiver,
        1,
        g.stream().raw(),
        "prefill rank 0",
        deadline,
        &mut || true,
        NcclAbort::new(),
    );
    let mut pair = match joined {
        // the fault case: the prefill's injected fault may abort its end
        // before this init finished polling; it then reports the remote error
        Err(e) if case == "fault" && e.detail().contains("ncclRemoteError") => {
            println!("decode {rank}: the prefill's fault reached this init: {e}");
            read_file(&dir, "done");
            return;
        }
        r => r.unwrap(),
    };
    write_file(
        &dir,
        &format!("connected.{rank}"),
        &std::process::id().to_string(),
    );
    if case == "never_posts" {
        // the prefill gave up on this communicator: it comes back with a fresh
        // one for the next room, which this side joins and receives
        let id2 = NcclId::from_hex(&read_file(&dir, &format!("id2.{rank}"))).unwrap();
        drop(pair);
        pair = NcclPair::connect(
            &id2,
            NcclRole::Receiver,
            1,
            g.stream().raw(),
            "prefill rank 0",
            Instant::now() + Duration::from_secs(20),
            &mut || true,
            NcclAbort::new(),
        )
        .unwrap();
    } else if case != "transfer" && !(case == "partial" && rank == 0) {
        // the decode that never posts: hold the communicator until told
        read_file(&dir, "done");
        drop(pair);
        println!("decode {rank}: never posted, closed");
        return;
    }
    let bases: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
    // SAFETY: every op lands in the staging buffer or a destination pool sized
    // for the plan; both outlive the pair's work (waited below).
    unsafe { pair.post(&rx, staging.ptr(), &bases, deadline, &mut || true) }.unwrap();
    pair.wait(deadline, &mut || true).unwrap();
    if rx.needs_scatter() {
        let ents = relayout::scatter_entries(&bases, &rows, staging.ptr(), &rx.pack).unwrap();
        // SAFETY: entries address the pools and staging above, sized by the plan.
        unsafe { g.scatter(&ents, &relayout::scatter_spans(&req).unwrap()) }
            .unwrap()
            .wait()
            .unwrap();
    }
    pair.close().unwrap();
    // the CPU reference: gather the prefill's pools, scatter into zeroed pools
    let pools = src_pools();
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
    let mut want: Vec<Vec<u8>> = bufs.iter().map(|b| vec![0u8; b.len()]).collect();
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
    let mut checked = 0;
    for (e, (b, w)) in bufs.iter().zip(&want).enumerate() {
        let mut got = vec![1u8; b.len()];
        b.read(0, &mut got).unwrap();
        assert!(
            &got == w,
            "decode {rank}: pool entry {e} differs from the CPU relayout"
        );
        checked += got.len();
    }
    assert!(checked > 0);
    let mode = if staged { "Staged" } else { "Direct" };
    println!("decode {rank}: {mode} transfer, every byte matches the CPU relayout ({checked} B)");
}
