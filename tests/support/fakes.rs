//! Builds the CPU stand-ins for the CUDA driver and NCCL (`cuda/fake_driver.cpp`
//! as `libcuda.so`, `cuda/fake_nccl.cpp` as `libnccl.so.2`) into a folder of the
//! test target dir, with a placeholder module image; tests put that folder on
//! the LD_LIBRARY_PATH of the child processes they start.

use std::path::PathBuf;
use std::process::Command;

/// Compiles both fakes into `$CARGO_TARGET_TMPDIR/<name>` and returns it; a
/// missing C++ compiler or a failed build fails the test (never a skip).
/// Rendezvous files of communicators an earlier run aborted are removed.
pub fn compile_fakes(name: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    for (lib, src) in [
        ("libcuda.so", "cuda/fake_driver.cpp"),
        ("libnccl.so.2", "cuda/fake_nccl.cpp"),
    ] {
        let ok = Command::new(&cxx)
            .args(["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror"])
            .args(["-fno-strict-aliasing", "-shared", "-fPIC", "-o"])
            .arg(dir.join(lib))
            .arg(root.join(src))
            .arg("-lpthread")
            .status()
            .unwrap_or_else(|e| panic!("cannot run {cxx} (a C++ compiler is required): {e}"));
        assert!(ok.success(), "building the fake {lib} failed");
    }
    // Any module image will do: the fake maps function names to the harness.
    std::fs::write(dir.join("module.ptx"), "// fake module\n").unwrap();
    for f in std::fs::read_dir(&dir).unwrap().flatten() {
        if f.file_name()
            .to_string_lossy()
            .starts_with("pdxfer-fake-nccl")
        {
            let _ = std::fs::remove_file(f.path());
        }
    }
    dir
}
