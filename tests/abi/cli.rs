//! The `pdxfer` binary: `plan` (table and --json) and `info` on a machine
//! without GPU or RDMA NIC (typed "absent" entries, exit 0, no panic).

use std::process::Command;

fn pdxfer(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pdxfer"))
        .args(args)
        .output()
        .expect("run pdxfer");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn plan_worked_example_json() {
    let (code, out, err) = pdxfer(&["plan", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let pairs = v["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 4);
    for p in pairs {
        assert_eq!(p["tokens"], 75);
        assert_eq!(p["runs_unpacked"], 75);
        assert_eq!(p["runs_packed"], 2);
        assert_eq!(p["writes_unpacked"], 75 * 61);
        assert_eq!(p["writes_packed"], 2 * 61);
        assert_eq!(p["pack_bytes"], 5_270_400);
    }
    assert_eq!(v["total_tokens"], 300);
    assert_eq!(v["writes_unpacked"], 18_300);
}

#[test]
fn plan_rows_and_general_layouts() {
    let (code, out, _) = pdxfer(&["plan", "--rank", "1", "--show-rows", "2"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("position      1: source row      449 -> destination row     2560"),
        "{out}"
    );
    // prefill DCP 2 -> decode DCP 4: each decode rank has exactly one prefill peer
    let (code, out, _) = pdxfer(&[
        "plan",
        "--tokens",
        "4096",
        "--src-dcp-size",
        "2",
        "--dcp-size",
        "4",
        "--json",
    ]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let pairs = v["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 4);
    assert_eq!(v["total_tokens"], 4096);
    for p in pairs {
        assert_eq!(
            p["prefill_rank"].as_u64().unwrap(),
            p["decode_rank"].as_u64().unwrap() % 2
        );
    }
}

/// Prefill attention CP 2 -> decode DCP 4 over the worked example (5 pages):
/// all-CP-ranks mode splits the pages 3 + 2 with each share's token count
/// recomputed (192 + 108 tokens); rank-0 mode sends everything from CP rank 0.
#[test]
fn plan_prefill_cp_shares() {
    let tokens_by_cp = |mode: &str| {
        let (code, out, err) = pdxfer(&["plan", "--src-cp-size", "2", "--cp-mode", mode, "--json"]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["total_tokens"], 300);
        let mut by = [0u64; 2];
        for p in v["pairs"].as_array().unwrap() {
            by[p["cp_rank"].as_u64().unwrap() as usize] += p["tokens"].as_u64().unwrap();
        }
        by
    };
    assert_eq!(tokens_by_cp("all-cp"), [192, 108]);
    assert_eq!(tokens_by_cp("rank0"), [300, 0]);
    // one CP rank, a chunk boundary inside its share
    let (code, out, err) = pdxfer(&[
        "plan",
        "--src-cp-size",
        "2",
        "--src-cp-rank",
        "1",
        "--cp-mode",
        "all-cp",
        "--chunk-ends",
        "256",
        "--rank",
        "0",
        "--show-rows",
        "1",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("from CP rank 1, chunk 0:"), "{out}");
    assert!(out.contains("from CP rank 1, chunk 1:"), "{out}");
    // page 3 (id 5) holds positions 192..256: position 192 is row 5 * 64
    assert!(
        out.contains("position    192: source row      320 -> destination row     "),
        "{out}"
    );
    let (code, _, err) = pdxfer(&["plan", "--src-cp-size", "2", "--cp-mode", "every"]);
    assert_eq!(code, 2);
    assert!(err.contains("use rank0 or all-cp"), "{err}");
    let (code, _, err) = pdxfer(&["plan", "--src-cp-size", "2", "--chunk-ends", "100"]);
    assert_eq!(code, 2);
    assert!(err.contains("--chunk-ends"), "{err}");
}

#[test]
fn plan_bad_input_is_a_clear_error() {
    let (code, _, err) = pdxfer(&["plan", "--tokens", "300", "--prefix", "64"]);
    assert_eq!(code, 2);
    assert!(err.contains("prefix_misaligned"), "{err}");
    let (code, _, err) = pdxfer(&["plan", "--interleave", "3"]);
    assert_eq!(code, 2);
    assert!(err.contains("invalid_layout"), "{err}");
}

#[test]
fn info_reports_absent_hardware_as_typed_entries() {
    let (code, out, err) = pdxfer(&["info", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    for k in ["cuda", "kernels", "nvrtc", "nccl", "rdma"] {
        let e = v
            .get(k)
            .unwrap_or_else(|| panic!("info --json has no {k:?} entry: {v}"));
        let available = e["available"]
            .as_bool()
            .unwrap_or_else(|| panic!("{k}: \"available\" is not a boolean: {e}"));
        assert!(e["detail"].is_string(), "{k}: no detail: {e}");
        if available {
            assert!(
                e.get("kind").is_none() && e.get("code").is_none(),
                "{k}: {e}"
            );
        } else {
            let kind = e["kind"]
                .as_str()
                .unwrap_or_else(|| panic!("{k}: no kind: {e}"));
            let code = e["code"]
                .as_i64()
                .unwrap_or_else(|| panic!("{k}: no numeric code: {e}"));
            let status = pdxfer::Status::from_code(code as i32)
                .unwrap_or_else(|| panic!("{k}: {code} is no status code: {e}"));
            assert!(code < 0, "{k}: {e}");
            assert_eq!(status.kind(), kind, "{k}: code and kind disagree: {e}");
        }
    }
    assert!(
        v["version"].is_string() && v["abi_version"].is_string(),
        "{v}"
    );
    assert!(v["rdma"]["devices"].is_array(), "{v}");
    if !std::path::Path::new("/sys/class/infiniband").exists() {
        assert_eq!(v["rdma"]["kind"], "no_rdma_device");
    }
}

/// `libraries` says, for each library opened at run time, whether it was
/// found (with its file and version) or why not; `kernel_images` lists each
/// embedded image's kind, architecture and CUDA version.
#[test]
fn info_names_each_run_time_library_and_the_embedded_images() {
    let (code, out, err) = pdxfer(&["info", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    for k in ["libibverbs", "libcuda", "nvrtc", "libnccl"] {
        let l = &v["libraries"][k];
        let found = l["found"]
            .as_bool()
            .unwrap_or_else(|| panic!("{k}: \"found\" is not a boolean: {v}"));
        if found {
            assert!(
                l["path"].is_string() && l["version"].is_string(),
                "{k}: {l}"
            );
        } else {
            assert!(l["detail"].is_string(), "{k}: {l}");
        }
    }
    for i in v["kernel_images"]
        .as_array()
        .expect("kernel_images is a list")
    {
        assert!(matches!(i["kind"].as_str(), Some("cubin" | "ptx")), "{i}");
        assert_eq!(i["arch"], "sm_90", "{i}");
        assert!(i["cuda"].as_str().unwrap().contains('.'), "{i}");
        assert!(i["bytes"].as_u64().unwrap() > 0, "{i}");
    }
    if !cfg!(feature = "rdma") {
        assert_eq!(v["libraries"]["libibverbs"]["found"], false, "{v}");
        return;
    }
    // rdma-core is installed on the test machines (scripts/deps.sh)
    let ib = &v["libraries"]["libibverbs"];
    assert_eq!(ib["found"], true, "{ib}");
    assert!(
        ib["path"].as_str().unwrap().contains("libibverbs.so.1"),
        "{ib}"
    );
    assert!(
        ib["version"].as_str().unwrap().starts_with("rdma-core "),
        "{ib}"
    );

    // libibverbs that does not load: a typed entry naming what was tried; the
    // command still answers.
    let out = Command::new(env!("CARGO_BIN_EXE_pdxfer"))
        .args(["info", "--json"])
        .env("PDXFER_IBVERBS", "/nonexistent/libibverbs.so.1")
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ib = &v["libraries"]["libibverbs"];
    assert_eq!(
        (&ib["found"], &ib["kind"]),
        (&false.into(), &"no_rdma_device".into()),
        "{ib}"
    );
    assert!(
        ib["detail"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/libibverbs.so.1"),
        "{ib}"
    );
}

#[test]
fn demo_moves_verified_bytes_over_cma_and_tcp() {
    for transport in ["cma", "tcp"] {
        let (code, out, err) = pdxfer(&[
            "demo",
            "--requests",
            "6",
            "--layers",
            "4",
            "--max-tokens",
            "700",
            "--dcp-size",
            "4",
            "--transport",
            transport,
            "--json",
        ]);
        assert_eq!(code, 0, "{transport}: {err}\n{out}");
        let last = out.lines().last().unwrap();
        let v: serde_json::Value = serde_json::from_str(last).unwrap();
        assert_eq!(v["verified"], true, "{last}");
        assert_eq!(v["requests"], 6);
        assert_eq!(v["transport"], transport);
        // 4 layers x 1152 B per token plus 64 B of aux per decode rank and request
        let tokens = v["tokens"].as_u64().unwrap();
        assert_eq!(v["bytes"].as_u64().unwrap(), tokens * 4 * 1152 + 6 * 4 * 64);
        assert!(v["gb_per_s"].as_f64().unwrap() > 0.0);
        assert!(v["p99_ms"].as_f64().unwrap() >= v["p50_ms"].as_f64().unwrap());
        // the prefill engine's histogram counted every request, on the transport used
        let h = &v["latency_histogram"][transport];
        assert_eq!(h["count"], 6, "{last}");
        let q = |k: &str| h[k].as_f64().unwrap();
        assert!(q("p50_ms") > 0.0 && q("p50_ms") <= q("p90_ms") && q("p90_ms") <= q("p99_ms"));
    }
}

#[test]
fn demo_bad_arguments() {
    let (code, _, err) = pdxfer(&["demo", "--transport", "carrier-pigeon"]);
    assert_eq!(code, 2);
    assert!(err.contains("carrier-pigeon"), "{err}");
}

/// `pdxfer bench-cp` runs both CP send modes between real processes (each
/// request verified on every decode rank) and reports what each sender moved.
#[test]
fn bench_cp_runs_both_modes() {
    let (code, out, err) = pdxfer(&[
        "bench-cp",
        "--tokens",
        "1000",
        "--layers",
        "2",
        "--requests",
        "2",
        "--src-cp-size",
        "3",
        "--dcp-size",
        "2",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let r = v["results"].as_array().unwrap();
    assert_eq!(r[0]["cp_mode"], "rank0");
    assert_eq!(r[0]["bytes_per_sender"], serde_json::json!([1000 * 2304]));
    // 16 pages over 3 CP ranks: 6, 5 and 5 pages, the last with 296 tokens
    assert_eq!(r[1]["cp_mode"], "all-cp");
    assert_eq!(
        r[1]["bytes_per_sender"],
        serde_json::json!([384 * 2304, 320 * 2304, 296 * 2304])
    );
    for m in r {
        assert_eq!(m["transfer_ms"].as_array().unwrap().len(), 2);
    }
    let (code, _, err) = pdxfer(&["bench-cp", "--src-cp-size", "1"]);
    assert_eq!(code, 2);
    assert!(err.contains("src-cp-size >= 2"), "{err}");
}
