#!/usr/bin/env bash
# The data plane's and the engine's speed targets in one run, as a markdown table
# (figure / value / target / PASS or FAIL / command): 4 KiB writes over cma with and
# without a room grant and over tcp, one PD request against memcpy and iperf3, and
# the layer-wise exposure at 8K and 32K tokens over cma and tcp
# (scripts/bench_targets.py says how each is measured). Release build; needs
# iperf3 for the tcp request row. Runs about 2 minutes a round on an idle machine (plus the
# release build); exits 1 when a target fails. With a C compiler it also prints the
# machine's floor (benches/cma_floor.c, see scripts/bench-floor.sh) and the cma figures
# as a ratio of it. Not part of the tests.
#
#   bash scripts/bench-targets.sh [--requests N] [--rounds N] [--json]
#
# --rounds N measures everything N times (30 s apart) and checks each figure's
# median, printing every round's value and how many rounds met the target.
set -euo pipefail
cd "$(dirname "$0")/.."
PDXFER=${PDXFER:-target/release/pdxfer}
[ -n "${PDXFER_NO_BUILD:-}" ] || nice cargo build --release -q
floor=()
if command -v "${CC:-cc}" >/dev/null; then
    mkdir -p target
    "${CC:-cc}" -O2 -Wall -Wextra -Werror -pthread -o target/cma_floor benches/cma_floor.c
    floor=(--floor target/cma_floor)
fi
exec python3 scripts/bench_targets.py --pdxfer "$PDXFER" "${floor[@]}" "$@"
