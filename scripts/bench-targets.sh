#!/usr/bin/env bash
# The data plane's and the engine's speed targets in one run, as a markdown table
# (figure / value / target / met / command): per-batch fixed cost on cma, 4 KiB
# writes over cma and tcp, and one PD request against memcpy and iperf3
# (scripts/bench_targets.py says how each is measured). Release build; needs
# iperf3 for the tcp request row. Runs about 2 minutes; not part of the tests.
#
#   bash scripts/bench-targets.sh [--requests N] [--json]
set -euo pipefail
cd "$(dirname "$0")/.."
PDXFER=${PDXFER:-target/release/pdxfer}
[ -n "${PDXFER_NO_BUILD:-}" ] || nice cargo build --release -q
exec python3 scripts/bench_targets.py --pdxfer "$PDXFER" "$@"
