//! `pdxfer bench-request` end to end at a small size: real rank processes,
//! every decode byte verified, the figures present and consistent (no speed
//! is asserted: those are benchmarks), and its refusals.

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
fn bench_request_times_verified_requests_over_cma_and_tcp() {
    // cma-shared: every rank's pools shareable, the prefill's one-copy path
    let (code, out, err) = pdxfer(&[
        "bench-request",
        "--modes",
        "cma-heap,cma-shared,tcp",
        "--tokens",
        "512",
        "--layers",
        "3",
        "--dcp-size",
        "2",
        "--requests",
        "3",
        "--iperf3-secs",
        "0",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(v["request_bytes"], 512 * 3 * 1152);
    assert_eq!(v["errors"].as_array().unwrap().len(), 0);
    let results = v["results"].as_array().unwrap();
    let modes: Vec<&str> = results
        .iter()
        .map(|r| r["mode"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["cma-heap", "cma-shared", "tcp-heap"]);
    for r in results {
        let ms: Vec<f64> = r["transfer_ms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(ms.len(), 3);
        assert!(ms.iter().all(|&m| m > 0.0), "{ms:?}");
        assert_eq!(r["first_ms"].as_f64().unwrap(), ms[0]);
        let mut warm = ms[1..].to_vec();
        warm.sort_by(|a, b| a.total_cmp(b));
        let median = (warm[0] + warm[1]) / 2.0;
        assert!((r["warm_median_ms"].as_f64().unwrap() - median).abs() < 1e-9);
        let memcpy = r["memcpy_ms"].as_f64().unwrap();
        assert!(memcpy > 0.0);
        let ratio = r["ratio_vs_memcpy"].as_f64().unwrap();
        assert!((ratio - memcpy / median).abs() < 1e-9);
        // shared pools take the one-copy path for every KV byte; the others never
        let one_copy = r["one_copy_bytes_per_request"].as_f64().unwrap();
        let want = if r["mode"] == "cma-shared" {
            512.0 * 3.0 * 1152.0
        } else {
            0.0
        };
        assert_eq!(one_copy, want, "{}", r["mode"]);
        // iperf3 was switched off: no figure, and no note either
        assert!(r["iperf3_gb_per_s"].is_null() && r["iperf3_note"].is_null());
    }
}

#[test]
fn bench_request_refuses_bad_arguments() {
    let (code, _, err) = pdxfer(&["bench-request", "--modes", "carrier-pigeon"]);
    assert_ne!(code, 0);
    assert!(err.contains("carrier-pigeon"), "{err}");
    let (code, _, err) = pdxfer(&["bench-request", "--requests", "1"]);
    assert_ne!(code, 0);
    assert!(err.contains("requests must be >= 2"), "{err}");
}
