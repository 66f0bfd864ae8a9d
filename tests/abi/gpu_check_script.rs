//! `scripts/gpu-check.sh` without a GPU: it parses (`bash -n`), and its dry
//! run (`GPU_CHECK_DRY_RUN=1`) names every step in order, the first one the
//! summary (driver, kernel image, GPUDirect route, VMM GPUDirect attribute),
//! with the NCCL same-GPU refusal among them, each step's timeout cut to
//! what is left of `GPU_CHECK_BUDGET`, whose default fits one call of the
//! device tool (10 minutes) and its 15 minutes of device time.

use std::process::Command;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gpu-check.sh");

fn dry_run(budget: Option<&str>) -> String {
    let mut c = Command::new("bash");
    c.arg(SCRIPT)
        .env("GPU_CHECK_DRY_RUN", "1")
        .env_remove("OUT")
        .env_remove("PDXFER_GPU_CHECK_BIN")
        .env_remove("PDXFER_NCCL_CHECK_BIN");
    if let Some(b) = budget {
        c.env("GPU_CHECK_BUDGET", b);
    }
    let out = c.output().expect("run bash");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "dry run failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The timeouts of the steps a dry run printed, in order.
fn timeouts(text: &str) -> Vec<u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("gpu-check: [dry-run] timeout "))
        .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
        .collect()
}

#[test]
fn gpu_check_parses_and_its_dry_run_lists_every_step() {
    let st = Command::new("bash").args(["-n", SCRIPT]).status().unwrap();
    assert!(st.success(), "bash -n {SCRIPT}");
    let text = dry_run(None);
    let steps: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("gpu-check: [dry-run] "))
        .collect();
    let want = [
        "target/gpu-check --summary",
        "target/gpu-check",
        "--engine-only",
        "--layerwise",
        "scripts/sglang-gpu-check.py --memory device",
        "target/nccl-check --solo",
        "target/pdxfer-nccl bench --transport nccl",
        "--nccl-gpus 0,0",
    ];
    assert_eq!(steps.len(), want.len(), "{text}");
    for (s, w) in steps.iter().zip(want) {
        assert!(s.contains(w), "{w:?} expected in {s:?}:\n{text}");
    }
    assert!(
        text.contains("refused at link set-up (nccl_same_gpu)"),
        "{text}"
    );
    let script = std::fs::read_to_string(SCRIPT).unwrap();
    let budget: u64 = script
        .split("GPU_CHECK_BUDGET:-")
        .nth(1)
        .and_then(|s| s.split('}').next())
        .and_then(|s| s.parse().ok())
        .expect("a default GPU_CHECK_BUDGET");
    assert!(
        budget <= 600,
        "the default budget {budget} s exceeds one 10-minute call"
    );
    assert!(timeouts(&text).iter().all(|&t| t <= budget), "{text}");
    // a smaller budget cuts every step's timeout to it
    let text = dry_run(Some("40"));
    let t = timeouts(&text);
    assert_eq!(t.len(), want.len(), "{text}");
    assert!(t.iter().all(|&t| t <= 40), "{t:?}");
    assert!(t.contains(&40), "the 360 s kernel step is cut to 40: {t:?}");
}
