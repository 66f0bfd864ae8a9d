#!/usr/bin/env bash
# The floor of a same-host write on this machine (benches/cma_floor.c): memcpy into
# a private buffer, memcpy into a MAP_SHARED memfd mapping (what cma does to a peer's
# shared region) and one process_vm_writev per batch into a child process (what cma
# does to a peer's heap region), each on 1 and 2 threads, with the per-batch p50.
# The figures `pdxfer bench --transport cma` reaches are read against these. Builds
# the program into target/cma_floor with the system C compiler. Not part of the tests.
#
#   bash scripts/bench-floor.sh [BLOCK_BYTES=4096] [BATCH=256] [MS_PER_MODE=1500] [--json]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target
"${CC:-cc}" -O2 -Wall -Wextra -Werror -pthread -o target/cma_floor benches/cma_floor.c
exec target/cma_floor "$@"
