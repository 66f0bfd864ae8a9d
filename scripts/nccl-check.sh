#!/usr/bin/env bash
# NCCL pair check for a host with two GPUs (one rank per GPU: NCCL refuses two
# ranks of one communicator on one GPU). Runs the pdxfer NCCL pair (the
# receiver on GPU 1, the sender on GPU 0, separate processes) on one DCP pair
# request, every byte verified on the receiver against the CPU relayout, then
# the engine over transport nccl (`pdxfer bench --transport nccl`: a prefill
# engine with device pools on GPU 0 and a decode engine on GPU 1, rooms timed
# whole from `sender` to the decode's Success, the last room of each size
# read back and checked), then nccl-tests' sendrecv_perf over the same two
# GPUs when it is present, and prints the GB/s side by side. Builds nothing;
# bash, coreutils and the binaries:
#
#   # on the build machine
#   cargo build --release --example nccl_check --no-default-features --features nccl
#   strip -o target/nccl-check target/release/examples/nccl_check
#   cargo build --release --bin pdxfer --no-default-features --features nccl
#   strip -o target/pdxfer-nccl target/release/pdxfer
#   # then on the GPU host, with target/nccl-check and target/pdxfer-nccl carried along
#   scripts/nccl-check.sh
#
# NCCL is found as libnccl.so.2 on the loader path, in a Python's
# site-packages (the nvidia-nccl-cu12/-cu13 wheel, e.g. PyTorch's), or at
# $PDXFER_NCCL. Environment: PDXFER_NCCL_CHECK_BIN (binary), NCCL_CHECK_ARGS
# (extra pair arguments, e.g. "--tokens 32768 --staged"), PDXFER_BIN (the
# pdxfer binary of the engine step; default target/pdxfer-nccl, then
# target/release/pdxfer; the step is reported as not run without one),
# NCCL_ENGINE_ARGS (its bench arguments, default "--block-sizes
# 64M,256M,1G --iters 10 --max-ms 3000"), NCCL_ENGINE_GPUS (the prefill's
# and the decode's GPU, default 0,1), SENDRECV_PERF
# (path of nccl-tests' sendrecv_perf; else looked up on PATH and in
# $NCCL_TESTS_DIR/build), NCCL_CHECK_BUDGET (seconds for the whole script,
# default 300). Output: the log on stdout, and $OUT/nccl-check.log when $OUT
# is set. Exit: 0 passed, 1 a failure, 2 usage, 3 fewer than two GPUs or no NCCL.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${PDXFER_NCCL_CHECK_BIN:-}
if [ -z "$bin" ]; then
    for b in target/nccl-check target/release/examples/nccl_check; do
        if [ -x "$b" ]; then bin=$b; break; fi
    done
fi
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    echo "nccl-check: no binary (build it as described at the top of $0)" >&2
    exit 2
fi
log=${OUT:+$OUT/nccl-check.log}
log=${log:-/dev/null}
budget=${NCCL_CHECK_BUDGET:-300}
within() { # seconds wanted -> seconds allowed now (at least 1)
    local left=$((budget - SECONDS))
    [ "$left" -lt 1 ] && left=1
    [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
say() { echo "$@" | tee -a "$log"; }

say "nccl-check: $(date -u +%FT%TZ) binary $bin"
gpus=0
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv,noheader 2>&1 | tee -a "$log"
    gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
    nvidia-smi topo -m 2>&1 | head -8 | tee -a "$log"
fi
if [ "$gpus" -lt 2 ]; then
    say "nccl-check: needs two GPUs (found $gpus); scripts/gpu-check.sh checks what one GPU can"
    exit 3
fi

rc=0
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
t=$(within 180)
# shellcheck disable=SC2086 # NCCL_CHECK_ARGS is a list of arguments
timeout "$t" "$bin" --role recv --dir "$dir" --device 1 ${NCCL_CHECK_ARGS:-} >"$dir/recv.log" 2>&1 &
recv_pid=$!
# shellcheck disable=SC2086
timeout "$t" "$bin" --role send --dir "$dir" --device 0 ${NCCL_CHECK_ARGS:-} 2>&1 | tee -a "$log"
src=${PIPESTATUS[0]}
wait "$recv_pid"
rrc=$?
tee -a "$log" <"$dir/recv.log"
[ "$src" -ne 0 ] && say "nccl-check: sender exit $src" && rc=$src
[ "$rrc" -ne 0 ] && say "nccl-check: receiver exit $rrc" && [ "$rc" -eq 0 ] && rc=$rrc
if ! grep -q "recv verified every byte" "$dir/recv.log"; then
    say "nccl-check: the receiver did not verify its bytes"
    [ "$rc" -eq 0 ] && rc=1
fi
ours=$(grep -o "recv [A-Za-z]* .*GB/s over" "$dir/recv.log" | head -1)

# the engine over transport nccl: prefill on GPU 0, decode on GPU 1
pdx=${PDXFER_BIN:-}
if [ -z "$pdx" ]; then
    for b in target/pdxfer-nccl target/release/pdxfer; do
        if [ -x "$b" ]; then pdx=$b; break; fi
    done
fi
engine="(not run: no pdxfer binary; build line at the top of $0)"
if [ -n "$pdx" ] && [ -x "$pdx" ]; then
    egpus=${NCCL_ENGINE_GPUS:-0,1}
    say "nccl-check: $pdx bench --transport nccl --nccl-gpus $egpus ${NCCL_ENGINE_ARGS:---block-sizes 64M,256M,1G --iters 10 --max-ms 3000}"
    # shellcheck disable=SC2086 # NCCL_ENGINE_ARGS is a list of arguments
    timeout "$(within 150)" "$pdx" bench --transport nccl --nccl-gpus "$egpus" \
        ${NCCL_ENGINE_ARGS:---block-sizes 64M,256M,1G --iters 10 --max-ms 3000} 2>&1 |
        tee -a "$log" "$dir/engine.log" >/dev/null
    erc=${PIPESTATUS[0]}
    if [ "$erc" -ne 0 ]; then
        say "nccl-check: the engine over nccl failed (exit $erc)"
        tail -20 "$dir/engine.log"
        [ "$rc" -eq 0 ] && rc=$erc
    elif ! grep -q "every byte of the last room checked" "$dir/engine.log"; then
        say "nccl-check: the engine over nccl verified no room"
        [ "$rc" -eq 0 ] && rc=1
    fi
    # the largest room's line: "nccl  room <bytes> B ... <GB/s> GB/s"
    engine=$(grep "^nccl  room" "$dir/engine.log" | tail -1 | sed 's/  */ /g; s/ (every.*//')
fi

perf=${SENDRECV_PERF:-}
if [ -z "$perf" ]; then
    perf=$(command -v sendrecv_perf || true)
    [ -z "$perf" ] && [ -n "${NCCL_TESTS_DIR:-}" ] && [ -x "$NCCL_TESTS_DIR/build/sendrecv_perf" ] &&
        perf=$NCCL_TESTS_DIR/build/sendrecv_perf
fi
theirs="(nccl-tests sendrecv_perf not found: set SENDRECV_PERF or NCCL_TESTS_DIR)"
if [ -n "$perf" ]; then
    say "nccl-check: $perf -b 64M -e 1G -f 2 -g 2"
    timeout "$(within 90)" "$perf" -b 64M -e 1G -f 2 -g 2 2>&1 | tee -a "$log" "$dir/perf.log" >/dev/null
    # the out-of-place busbw of the largest size (column 8 of its row)
    theirs=$(awk '$1 ~ /^[0-9]+$/ && NF >= 8 { last = $0 } END { n = split(last, f); if (n) print f[1] " B: " f[8] " GB/s busbw" }' "$dir/perf.log")
fi
say "nccl-check: pdxfer pair   : ${ours:-no result}"
say "nccl-check: engine (nccl) : ${engine:-no result}"
say "nccl-check: sendrecv_perf : ${theirs:-no result}"
say "nccl-check: exit $rc"
exit "$rc"
