#!/usr/bin/env bash
# Runs every test of pdxfer (Rust, C, Python) after installing what they need.
# This is the README's test command and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

# Every stage prints its wall-clock and CPU seconds (user+sys of the commands
# it ran) when it ends, and a table of all of them closes the run, pass or
# fail: where the time of the test command goes.
STAGES=()
stage="" stage_t0=$SECONDS stage_c0=0
times_file=$(mktemp)
cpu_mark() { times >"$times_file"; } # in this shell: a subshell's `times` counts only its own
cpu_seconds() { # user+sys of this shell's finished children at the last cpu_mark (`times`, 2nd line)
  awk 'NR == 2 { split($1, u, /[ms]/); split($2, s, /[ms]/); printf "%.1f", u[1] * 60 + u[2] + s[1] * 60 + s[2] }' "$times_file"
}
end_stage() {
  [ -n "$stage" ] || return 0
  local cpu
  cpu_mark
  cpu=$(awk -v a="$(cpu_seconds)" -v b="$stage_c0" 'BEGIN { printf "%.1f", a - b }')
  STAGES+=("$(printf '%6d s %8s CPU-s  %s' $((SECONDS - stage_t0)) "$cpu" "$stage")")
  echo "--- $stage: $((SECONDS - stage_t0)) s, $cpu CPU-s"
  stage=""
}
step() {
  end_stage
  echo; echo "=== $*"
  cpu_mark
  stage="$*" stage_t0=$SECONDS stage_c0=$(cpu_seconds)
}
summary() {
  local rc=$?
  end_stage
  echo; echo "=== time by stage (wall, user+sys CPU)"
  printf '%s\n' "${STAGES[@]}"
  echo "$SECONDS s in all"
  rm -f "$times_file"
  exit "$rc"
}
trap summary EXIT

# Every skipped test is recorded here (src/test_skip.rs, which the integration tests include; pytest -rs); the run
# fails at the end on any skip whose kind PDXFER_ALLOW_SKIP (comma-separated,
# e.g. netns,etcd) does not name.
mkdir -p target
export PDXFER_SKIP_LOG="$PWD/target/skips.txt"
: >"$PDXFER_SKIP_LOG"
# The hardware half that this machine has not: a test of a GPU-only path skips
# (kind gpu) where no NVIDIA device exists, a test of the no-driver path skips
# (kind gpu-present) where one does. Those two are allowed by what the machine
# is; every other kind only by PDXFER_ALLOW_SKIP.
if [ -e /dev/nvidiactl ]; then hw_skip=gpu-present; else hw_skip=gpu; fi
# The fault-injection fixture and its tests are behind the testing feature.
FEATURES=(--features testing)

step "dependencies"
bash scripts/deps.sh
# nvcc/NVRTC (CUDA 13) and NCCL from PyPI for the no-GPU kernel and NCCL tests;
# with PDXFER_REQUIRE_CUDA_TOOLS a missing tool fails those tests instead of skipping.
eval "$(bash scripts/cuda-deps.sh)"
export PDXFER_REQUIRE_CUDA_TOOLS=1

step "cargo fmt --check"
cargo fmt --all -- --check

# Three feature sets, each checked once (clippy is cargo check plus lints);
# the builds below compile each set once more at most.
step "clippy, all targets (testing)"
cargo clippy "${FEATURES[@]}" --all-targets -- -D warnings

step "clippy, all targets (product: default features, no testing)"
# The test knobs and fakes are cfg-gated: the product build must be clean without them.
cargo clippy --all-targets -- -D warnings

step "clippy, all targets (host-only: --no-default-features)"
cargo clippy --no-default-features "${FEATURES[@]}" --all-targets -- -D warnings

# The library target is a cdylib: its outputs carry no feature hash, so every
# change of feature set rebuilds it. The order is: the product build (default
# features) and everything that uses only it (C and Python tests, the install,
# the wheel), then the testing build once, for cargo test.
step "product build: libpdxfer.so and pdxfer (regenerates include/pdxfer.h)"
cargo build --lib --bin pdxfer
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  if ! git diff --exit-code -- include/pdxfer.h; then
    echo "include/pdxfer.h is stale: commit the regenerated header" >&2
    exit 1
  fi
fi
# The CLI's crates live in the pdxfer binary; their names (symbols, debug info,
# panic locations) must not appear in the shared library C++ engines load.
# Codegen-unit names (25 random letters and digits, alone or after `/@/`) are
# left out: one may hold "clap" by chance; a crate name is never inside a word.
lib_strings() {
  strings target/debug/libpdxfer.so | grep -vE '^[a-z0-9]{25}$|/@/[a-z0-9]{25}$'
}
if lib_strings | grep -E -m 5 '(^|[^a-zA-Z])(clap|plotters|indicatif)([^a-zA-Z]|$)'; then
  echo "libpdxfer.so links CLI crates (lines above)" >&2
  exit 1
fi
# Built without the testing feature, the library has no software NIC fabric
# (transport::rdma::fake) and no TestKnobs; the names of both would show in its
# symbols and debug info.
if lib_strings | grep -E -m 5 'FakeNic|TestKnobs|4rdma4fake|rdma/fake\.rs'; then
  echo "the product libpdxfer.so holds test-only code (lines above)" >&2
  exit 1
fi
# The fault-injection fixture is not a product binary: plain builds skip it.
cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
t = {t["name"]: t for p in json.load(sys.stdin)["packages"] for t in p["targets"]}
need = t["pdxfer-fault-peer"].get("required-features") or []
sys.exit(0 if "testing" in need else "pdxfer-fault-peer must require the testing feature")'

step "C tests (-Wall -Werror, valgrind)"
make -s -C c_tests valgrind LIBDIR="$PWD/target/debug"
echo "== c_tests/build/test_engine with DCP 1->4 and 4->4 (no valgrind)"
PDXFER_C_TESTS_DCP4=1 c_tests/build/test_engine

step "C tests under AddressSanitizer + UBSan"
make -s -C c_tests asan LIBDIR="$PWD/target/debug"

step "Python tests"
PDXFER_LIB="$PWD/target/debug/libpdxfer.so" python3 -m pytest -q -rs python/tests \
  2>&1 | tee target/pytest.log
# -rs lists the skips as "SKIPPED [count] file:line: reason", one line per reason
grep '^SKIPPED' target/pytest.log | sed 's/^/python\tpytest\t/' >>"$PDXFER_SKIP_LOG" || true
echo "pytest: $(grep -oE '[0-9]+ skipped' target/pytest.log | tail -n 1 || echo '0 skipped')"

step "vLLM connector tests (vLLM 0.33.0 and torch on the CPU)"
# The environment is built once per machine outside the repository (about 6.6
# GB); a failure to build it fails this stage rather than skipping it.
vllm_py=$(bash scripts/vllm-env.sh)
PDXFER_LIB="$PWD/target/debug/libpdxfer.so" VLLM_TARGET_DEVICE=cpu "$vllm_py" -m pytest -q -rs -p no:cacheprovider \
  python/vllm_tests 2>&1 | tee target/pytest-vllm.log
grep '^SKIPPED' target/pytest-vllm.log | sed 's/^/python\tpytest-vllm\t/' >>"$PDXFER_SKIP_LOG" || true

step "C/C++ install: scripts/install.sh, examples/cpp with CMake and pkg-config"
bash scripts/check-install.sh

step "Python wheel: the manylinux_2_28 wheel (scripts/build-wheel.sh), auditwheel, a fresh venv, its tests, and a run without libibverbs"
# The full suite ran against the source tree above: the installed package
# runs the tests of what installing changes (PDXFER_WHEEL_TESTS, see the script).
bash scripts/check-wheel.sh

step "cargo test (testing: unit and integration tests, examples, benches)"
cargo test "${FEATURES[@]}" --all-targets 2>&1 | tee target/cargo-test.log
grep -q "test result:" target/cargo-test.log

step "skipped tests"
skips=$(wc -l <"$PDXFER_SKIP_LOG")
if [ "$skips" -gt 0 ]; then
  cat "$PDXFER_SKIP_LOG"
fi
refused=0
while IFS=$'\t' read -r kind test reason; do
  case ",${PDXFER_ALLOW_SKIP:-},$hw_skip," in
    *",$kind,"*) ;;
    *) echo "not allowed: $test skipped ($kind: $reason)" >&2; refused=$((refused + 1)) ;;
  esac
done <"$PDXFER_SKIP_LOG"
echo "$skips skipped, $refused not allowed (PDXFER_ALLOW_SKIP=${PDXFER_ALLOW_SKIP:-}; $hw_skip: by this machine's hardware)"
if [ "$refused" -gt 0 ]; then
  echo "skips are allowed only by kind: PDXFER_ALLOW_SKIP=netns,etcd,cuda-tools,rdma-nic,python" >&2
  exit 1
fi

echo
echo "all tests passed"
