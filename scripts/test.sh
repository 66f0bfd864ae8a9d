#!/usr/bin/env bash
# Runs every test of pdxfer (Rust, C, Python) after installing what they need.
# This is the README's test command and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

step() { echo; echo "=== $*"; }

step "dependencies"
bash scripts/deps.sh
# nvcc/NVRTC (CUDA 13) and NCCL from PyPI for the no-GPU kernel and NCCL tests;
# with PDXFER_REQUIRE_CUDA_TOOLS a missing tool fails those tests instead of skipping.
eval "$(bash scripts/cuda-deps.sh)"
export PDXFER_REQUIRE_CUDA_TOOLS=1

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets -- -D warnings

step "host-only build, clippy (--no-default-features)"
cargo clippy --no-default-features --all-targets -- -D warnings

step "cargo build (regenerates include/pdxfer.h)"
cargo build --all-targets
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  if ! git diff --exit-code -- include/pdxfer.h; then
    echo "include/pdxfer.h is stale: commit the regenerated header" >&2
    exit 1
  fi
fi

step "cargo test"
cargo test --all-targets 2>&1 | tee target/cargo-test.log
grep -q "test result:" target/cargo-test.log

step "C tests (-Wall -Werror, valgrind)"
make -s -C c_tests valgrind LIBDIR="$PWD/target/debug"
echo "== c_tests/build/test_engine with DCP 1->4 and 4->4 (no valgrind)"
PDXFER_C_TESTS_DCP4=1 c_tests/build/test_engine

step "C tests under AddressSanitizer + UBSan"
make -s -C c_tests asan LIBDIR="$PWD/target/debug"

step "Python tests"
PDXFER_LIB="$PWD/target/debug/libpdxfer.so" python3 -m pytest -q python/tests

step "C/C++ install: scripts/install.sh, examples/cpp with CMake and pkg-config"
bash scripts/check-install.sh

step "Python wheel: pip wheel ., installed into a fresh venv, python/tests against it"
bash scripts/check-wheel.sh

echo
echo "all tests passed"
