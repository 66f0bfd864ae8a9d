#!/usr/bin/env bash
# Soak run: thousands of small requests through real engine processes
# (a `pdxfer bootstrap` server, one prefill and three decode
# `pdxfer-fault-peer` ranks over guard-paged, canaried pools; every byte
# verified) with faults at fixed points: kill -9 of a decode mid-transfer, a
# bootstrap server kill -9 and restart, kill -9 of the prefill mid-transfer,
# kill -9 of a decode again. Resident memory and open descriptors of every
# process are sampled every 2 s; a summary table ends the run.
#
#   scripts/soak.sh [SECONDS] [extra soak options: --transport cma|tcp|auto --seed N --faults LIST]
#
# SECONDS defaults to 180. PDXFER_SOAK_PROFILE=release builds optimized
# (default: the debug build the tests already made). Exit status 0 only if no
# request failed unexpectedly, no byte was lost and no canary changed.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-180}
shift || true
PROFILE=${PDXFER_SOAK_PROFILE:-debug}
flag=()
[ "$PROFILE" = release ] && flag=(--release)
cargo build -q "${flag[@]}" --features testing --bin pdxfer --bin pdxfer-fault-peer --example soak
exec "target/$PROFILE/examples/soak" --peer "target/$PROFILE/pdxfer-fault-peer" --secs "$SECS" "$@"
