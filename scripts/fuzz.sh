#!/usr/bin/env bash
# Longer fuzzing of pdxfer's decoders and C ABI.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# With cargo-fuzz installed (`cargo install cargo-fuzz`), runs each libFuzzer
# target in fuzz/fuzz_targets/ (AddressSanitizer on) for SECONDS_PER_TARGET
# (default 60). cargo-fuzz needs nightly rustc features; on a stable toolchain
# RUSTC_BOOTSTRAP=1 unlocks them. Crashes land in fuzz/artifacts/<target>/,
# the corpus grows in fuzz/corpus/<target>/ (seeded from the test seeds).
#
# Without cargo-fuzz (or with PDXFER_FUZZ_MODE=stable), runs the same targets
# as the seeded stable property test (tests/abi/fuzz_smoke.rs) with many more
# iterations instead: PDXFER_FUZZ_ITERS (default 200000) per target.
#
# At the end prints one line per target: inputs run, seconds, result.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(wire transport_handshake rdma_handshake control control_stream bootstrap_json c_abi)
fi
mode=${PDXFER_FUZZ_MODE:-}
if [ -z "$mode" ]; then
  if cargo fuzz --version >/dev/null 2>&1; then mode=libfuzzer; else mode=stable; fi
fi
summary=()
if [ "$mode" = libfuzzer ]; then
  export RUSTC_BOOTSTRAP=1
  cargo fuzz build -O 2>&1 | tail -3 || true
  for t in "${TARGETS[@]}"; do
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
    log="fuzz/artifacts/$t/last-run.log"
    start=$(date +%s)
    rc=0
    cargo fuzz run -O "$t" "fuzz/corpus/$t" -- -max_total_time="$SECS" -rss_limit_mb=4096 \
      -timeout=10 -print_final_stats=1 >"$log" 2>&1 || rc=$?
    secs=$(( $(date +%s) - start ))
    runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' || echo '?')
    cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -1 | grep -Eo '[0-9]+' || echo '?')
    res=ok; [ "$rc" = 0 ] || res="FAILED (rc $rc, see $log and fuzz/artifacts/$t/)"
    summary+=("$(printf '%-22s %12s runs %6s s  cov %6s  %s' "$t" "$runs" "$secs" "$cov" "$res")")
  done
else
  export PDXFER_FUZZ_ITERS=${PDXFER_FUZZ_ITERS:-200000}
  export PDXFER_FUZZ_SEED=${PDXFER_FUZZ_SEED:-$(date +%s)}
  echo "stable mode: seed $PDXFER_FUZZ_SEED, $PDXFER_FUZZ_ITERS iterations per target"
  log=target/fuzz-stable.log
  rc=0
  cargo test --release --test abi fuzz_smoke -- --nocapture --test-threads=1 >"$log" 2>&1 || rc=$?
  while read -r line; do summary+=("$line"); done < <(grep -E '^fuzz ' "$log")
  [ "$rc" = 0 ] || summary+=("FAILED: see $log")
fi
echo
echo "== fuzz summary ($mode)"
printf '%s\n' "${summary[@]}"
for s in "${summary[@]}"; do case "$s" in *FAILED*) exit 1;; esac; done
