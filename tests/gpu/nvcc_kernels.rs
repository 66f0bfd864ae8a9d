//! Compiles `cuda/relayout.cu` with nvcc for sm_90 (PTX and cubin) and fails
//! when ptxas reports register spills. nvcc comes from `$PDXFER_NVCC`,
//! `$CUDA_HOME/bin/nvcc` or `PATH` (`scripts/cuda-deps.sh` installs it from
//! PyPI). Without nvcc the test records a skip (kind `cuda-tools`), or fails
//! when `PDXFER_REQUIRE_CUDA_TOOLS` is set (the CI test command sets it).

use crate::support as common;

use std::path::PathBuf;
use std::process::Command;

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PDXFER_NVCC") {
        return Some(PathBuf::from(p));
    }
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        let p = PathBuf::from(h).join("bin/nvcc");
        if p.is_file() {
            return Some(p);
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}

/// Per-kernel `(name, registers, spill stores, spill loads, stack bytes)` from
/// `ptxas -v` output.
fn parse_ptxas(log: &str) -> Vec<(String, u32, u32, u32, u32)> {
    let mut out = Vec::new();
    let mut name = String::new();
    let mut cur: Option<(u32, u32, u32)> = None;
    let num_before = |line: &str, key: &str| -> Option<u32> {
        let i = line.find(key)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(i) = line.find("Function properties for ") {
            name = line[i + "Function properties for ".len()..]
                .trim()
                .to_string();
        } else if line.contains("spill stores") {
            cur = Some((
                num_before(line, "bytes spill stores").unwrap_or(u32::MAX),
                num_before(line, "bytes spill loads").unwrap_or(u32::MAX),
                num_before(line, "bytes stack frame").unwrap_or(u32::MAX),
            ));
        } else if line.contains("Used ") && line.contains(" registers") {
            let regs = line
                .split("Used ")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .and_then(|s| s.parse().ok())
                .unwrap_or(u32::MAX);
            if let Some((st, ld, stack)) = cur.take() {
                out.push((name.clone(), regs, st, ld, stack));
            }
        }
    }
    out
}

#[test]
fn parser_reads_spills() {
    // ptxas 13.5 output for this kernel under __launch_bounds__(256, 8) (32 registers).
    let log = "ptxas info    : Compiling entry function 'pdx_gather' for 'sm_90'
ptxas info    : Function properties for pdx_gather
    104 bytes stack frame, 116 bytes spill stores, 268 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 104 bytes cumulative stack size
ptxas info    : Function properties for pdx_scatter
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 62 registers, used 0 barriers";
    assert_eq!(
        parse_ptxas(log),
        vec![
            ("pdx_gather".to_string(), 32, 116, 268, 104),
            ("pdx_scatter".to_string(), 62, 0, 0, 0)
        ]
    );
}

#[test]
fn kernels_compile_for_sm90_without_spills() {
    let Some(nvcc) = find_nvcc() else {
        assert!(
            std::env::var_os("PDXFER_REQUIRE_CUDA_TOOLS").is_none(),
            "PDXFER_REQUIRE_CUDA_TOOLS is set but no nvcc was found (run scripts/cuda-deps.sh)"
        );
        common::skip(
            "cuda-tools",
            "no nvcc ($PDXFER_NVCC, $CUDA_HOME/bin or PATH); run scripts/cuda-deps.sh",
        );
        return;
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("cuda/relayout.cu");
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let cubin = tmp.join("relayout_sm90.cubin");
    let ptx = tmp.join("relayout_sm90.ptx");
    let out = Command::new(&nvcc)
        .args(["-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o"])
        .arg(&cubin)
        .arg(&src)
        .output()
        .expect("run nvcc");
    let log =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "nvcc -cubin failed:\n{log}");
    let kernels = parse_ptxas(&log);
    let names: Vec<&str> = kernels.iter().map(|k| k.0.as_str()).collect();
    assert!(
        names.contains(&"pdx_gather") && names.contains(&"pdx_scatter"),
        "ptxas -v did not report both kernels:\n{log}"
    );
    for (name, regs, st, ld, stack) in &kernels {
        eprintln!(
            "{name}: {regs} registers, {st} B spill stores, {ld} B spill loads, {stack} B stack"
        );
        assert_eq!((*st, *ld), (0, 0), "{name} spills registers:\n{log}");
        assert!(*regs <= 255, "{name}: {regs} registers");
    }
    let bin = std::fs::read(&cubin).expect("read cubin");
    assert_eq!(&bin[..4], b"\x7fELF");
    let out = Command::new(&nvcc)
        .args(["-arch=sm_90", "-ptx", "-o"])
        .arg(&ptx)
        .arg(&src)
        .output()
        .expect("run nvcc");
    assert!(out.status.success(), "nvcc -ptx failed");
    let text = std::fs::read_to_string(&ptx).expect("read ptx");
    assert!(text.contains(".target sm_90"));
    assert!(text.contains(".entry pdx_gather") && text.contains(".entry pdx_scatter"));
}
