//! Loud skips, the one recorder for every test of the package: the library's
//! unit tests compile this file as `crate::test_skip`, the integration-test
//! binaries include it (`tests/support/mod.rs`, `#[path]`). A test that cannot
//! run on this machine records `kind<TAB>test<TAB>reason` in [`skip_log`], and
//! `scripts/test.sh` fails on any kind it does not allow.

#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;

/// Where [`skip`] records skips: `$PDXFER_SKIP_LOG`, else `skips.txt` in the
/// cargo target directory of the running test binary (`<target>/skips.txt`
/// for `<target>/<profile>/deps/<test>`, whatever `CARGO_TARGET_DIR` is).
/// `scripts/test.sh` sets the variable, clears the file first, prints it at
/// the end and fails on any skip `PDXFER_ALLOW_SKIP` does not name.
pub(crate) fn skip_log() -> PathBuf {
    if let Some(p) = std::env::var_os("PDXFER_SKIP_LOG") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    // <target>/<profile>/deps/<binary>
    match exe.ancestors().nth(3) {
        Some(target) => target.join("skips.txt"),
        None => PathBuf::from("skips.txt"),
    }
}

/// Records that the running test skips its body because the machine lacks
/// `kind`: `gpu` where no CUDA driver exists, `gpu-present` for a test of the
/// no-driver path on a GPU host, `cuda-tools` for a missing nvcc/NVRTC/NCCL,
/// `netns`, `etcd`, `root`, `rdma-nic`... One line appended to [`skip_log`],
/// and printed. The caller returns right after.
pub(crate) fn skip(kind: &str, reason: &str) {
    let thread = std::thread::current();
    let test = format!(
        "{}::{}",
        env!("CARGO_CRATE_NAME"),
        thread.name().unwrap_or("?")
    );
    eprintln!("SKIPPED [{kind}] {test}: {reason}");
    let path = skip_log();
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
