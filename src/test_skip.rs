//! Loud skips for the library's own unit tests (`tests/common::skip` is the
//! integration tests' twin): a test that cannot run on this machine records
//! `kind<TAB>test<TAB>reason` in `$PDXFER_SKIP_LOG` (default
//! `target/skips.txt`), and `scripts/test.sh` fails on any kind it does not allow.

use std::io::Write;

/// Records that the running test skips its body (`kind`: `gpu` where no CUDA
/// driver exists, `gpu-present` for a test of the no-driver path on a GPU host,
/// `cuda-tools` for a missing nvcc/NVRTC/NCCL). The caller returns right after.
pub(crate) fn skip(kind: &str, reason: &str) {
    let thread = std::thread::current();
    let test = format!("pdxfer::{}", thread.name().unwrap_or("?"));
    eprintln!("SKIPPED [{kind}] {test}: {reason}");
    let path = match std::env::var_os("PDXFER_SKIP_LOG") {
        Some(p) => std::path::PathBuf::from(p),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/skips.txt"),
    };
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let line = format!("{kind}\t{test}\t{}\n", reason.replace(['\t', '\n'], " "));
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()))
        .unwrap_or_else(|e| panic!("cannot record the skip in {}: {e}", path.display()));
}
