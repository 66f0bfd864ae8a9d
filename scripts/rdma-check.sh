#!/usr/bin/env bash
# rdma-check.sh: on a host with RDMA NICs, measure RDMA WRITE bandwidth with
# perftest's ib_write_bw (Debian package `perftest`) and with pdxfer's RDMA bench,
# and print both side by side. Builds nothing: it uses a prebuilt `pdxfer`.
#
# Loopback on one host (server and client on the same NIC, or two NICs):
#   scripts/rdma-check.sh [--pdxfer PATH] [--device mlx5_0] [--client-device mlx5_1]
#                         [--gid-index 3] [--size 1048576] [--iters 2000] [--gpu 0]
# Two hosts: start the server side first, then the client side.
#   hostB$ scripts/rdma-check.sh --serve [--device mlx5_0] ...
#   hostA$ scripts/rdma-check.sh --peer hostB [--device mlx5_0] ...
#
# It prints first, for GPU --gpu N (default 0): the NICs found, which are
# chosen for that GPU and why, and whether GPUDirect RDMA works (a real
# registration: dma-buf, nvidia-peermem or none), from `pdxfer info --gpu N`.
#
# The pdxfer half runs `pdxfer bench --transport rdma` (the data-plane bench
# through the Transport trait: agent handshake, receiver grants, RDMA WRITEs,
# commit; the same message size, batches of 64 messages, 4 batches in flight;
# extra arguments go in --bench-args "..."), or `pdxfer rdma-bench` (the RDMA
# transport's own bench) with an older binary. Two hosts: the server side runs
# `ib_write_bw` and then `pdxfer target --listen 0.0.0.0:PDX_PORT` (older
# binaries: `pdxfer rdma-bench --serve 0.0.0.0:PDX_PORT`).
set -euo pipefail

PDXFER=""
DEVICE=""
CLIENT_DEVICE=""
GID_INDEX=""
SIZE=1048576
ITERS=2000
PEER=""
SERVE=0
GPU=""
PORT=18515
PDX_PORT=18600
BENCH_ARGS=""
TIMEOUT=120

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --pdxfer) PDXFER="$2"; shift 2 ;;
        --device) DEVICE="$2"; shift 2 ;;
        --client-device) CLIENT_DEVICE="$2"; shift 2 ;;
        --gid-index) GID_INDEX="$2"; shift 2 ;;
        --size) SIZE="$2"; shift 2 ;;
        --iters) ITERS="$2"; shift 2 ;;
        --peer) PEER="$2"; shift 2 ;;
        --serve) SERVE=1; shift ;;
        --gpu) GPU="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --pdx-port) PDX_PORT="$2"; shift 2 ;;
        --bench-args) BENCH_ARGS="$2"; shift 2 ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        -h|--help) usage 0 ;;
        *) echo "rdma-check: unknown argument $1" >&2; usage 2 ;;
    esac
done

if [ -z "$PDXFER" ]; then
    PDXFER="$(command -v pdxfer || true)"
fi
if [ -z "$PDXFER" ] || [ ! -x "$PDXFER" ]; then
    echo "rdma-check: no pdxfer binary (pass --pdxfer PATH or put it on PATH; e.g. target/release/pdxfer)" >&2
    exit 2
fi
# First, what holds for the GPU: the NICs found, which are chosen for it and
# why (PCIe distance, NUMA), and GPUDirect RDMA tested by a real registration
# of device memory (dma-buf, nvidia-peermem, or none with the reason). Shown
# for the default NIC choice (PDXFER_RDMA_DEVICES unset).
echo "== RDMA for GPU ${GPU:-0}: NICs found, chosen for the GPU and why, GPUDirect RDMA"
if "$PDXFER" info --help 2>/dev/null | grep -q -- '--gpu'; then
    PDXFER_RDMA_DEVICES='' "$PDXFER" info --gpu "${GPU:-0}" | sed -n '/^RDMA for GPU/,$p' || true
    if [ -n "$DEVICE" ]; then
        echo "   (the runs below use --device $DEVICE instead: PDXFER_RDMA_DEVICES=$DEVICE)"
    fi
else
    echo "rdma-check: this pdxfer has no 'info --gpu' (older binary): no NIC choice or GPUDirect report" >&2
fi

if ! command -v ib_write_bw >/dev/null 2>&1; then
    echo "rdma-check: ib_write_bw not found: apt-get install -y perftest" >&2
    exit 2
fi

echo "== pdxfer info"
"$PDXFER" info || true
if ! "$PDXFER" info --json | grep -q '"rdma":{"available":true'; then
    echo "rdma-check: pdxfer sees no usable RDMA device (see above); ib_write_bw will most likely fail too" >&2
fi

perf_args=(-s "$SIZE" -n "$ITERS" -p "$PORT" -F --report_gbits)
[ -n "$GID_INDEX" ] && perf_args+=(-x "$GID_INDEX")
[ -n "$GPU" ] && perf_args+=(--use_cuda="$GPU")
server_args=("${perf_args[@]}")
client_args=("${perf_args[@]}")
[ -n "$DEVICE" ] && server_args+=(-d "$DEVICE")
if [ -n "$CLIENT_DEVICE" ]; then
    client_args+=(-d "$CLIENT_DEVICE")
elif [ -n "$DEVICE" ]; then
    client_args+=(-d "$DEVICE")
fi

# The result row of ib_write_bw: "#bytes #iterations BW peak BW average MsgRate".
perf_row() { awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+/ {row=$0} END {print row}'; }

[ -n "$DEVICE" ] && export PDXFER_RDMA_DEVICES="$DEVICE"
[ -n "$GID_INDEX" ] && export PDXFER_RDMA_GID_INDEX="$GID_INDEX"
BATCH=64
PDX_ITERS=$(( ITERS / BATCH > 0 ? ITERS / BATCH : 1 ))
pdx_bench=("$PDXFER" rdma-bench --block-size "$SIZE" --batch-size "$BATCH" --iters "$PDX_ITERS" --depth 4)

# Does this binary's data-plane bench speak rdma?
HAS_BENCH_RDMA=0
if "$PDXFER" bench --help 2>/dev/null | grep -q 'rdma'; then
    HAS_BENCH_RDMA=1
fi

if [ "$SERVE" = 1 ]; then
    echo "== ib_write_bw server (waiting for the client)"
    timeout "$TIMEOUT" ib_write_bw "${server_args[@]}" || echo "rdma-check: ib_write_bw server failed" >&2
    if [ "$HAS_BENCH_RDMA" = 1 ]; then
        echo "== pdxfer target on 0.0.0.0:$PDX_PORT (waiting for the client's bench --transport rdma)"
        # The target quits at the end of stdin: keep it open for the timeout.
        exec timeout "$TIMEOUT" "$PDXFER" target --listen "0.0.0.0:$PDX_PORT" \
            --size "$(( SIZE * BATCH ))" --quiet < <(sleep "$TIMEOUT")
    fi
    echo "== pdxfer rdma-bench server on 0.0.0.0:$PDX_PORT (waiting for the client)"
    exec timeout "$TIMEOUT" "${pdx_bench[@]}" --serve "0.0.0.0:$PDX_PORT"
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"; [ -n "${srv_pid:-}" ] && kill "$srv_pid" 2>/dev/null || true' EXIT

echo "== ib_write_bw (${SIZE} B messages, ${ITERS} iterations)"
if [ -z "$PEER" ]; then
    timeout "$TIMEOUT" ib_write_bw "${server_args[@]}" >"$tmp/server.log" 2>&1 &
    srv_pid=$!
    sleep 1
    target=127.0.0.1
else
    target="$PEER"
fi
status=0
if timeout "$TIMEOUT" ib_write_bw "${client_args[@]}" "$target" >"$tmp/client.log" 2>&1; then
    perf="$(perf_row <"$tmp/client.log")"
    cat "$tmp/client.log"
else
    status=1
    echo "rdma-check: ib_write_bw failed:" >&2
    cat "$tmp/client.log" >&2
    [ -f "$tmp/server.log" ] && cat "$tmp/server.log" >&2
    perf=""
fi
if [ -n "${srv_pid:-}" ]; then wait "$srv_pid" 2>/dev/null || true; srv_pid=""; fi

pdx=""
if [ "$HAS_BENCH_RDMA" = 1 ]; then
    bench=("$PDXFER" bench --transport rdma --block-sizes "$SIZE" --batch-sizes "$BATCH"
        --depth 4 --iters "$PDX_ITERS" --max-ms 60000)
    # shellcheck disable=SC2206 # word splitting of user-supplied bench args is intended
    [ -n "$BENCH_ARGS" ] && bench+=($BENCH_ARGS)
    [ -n "$PEER" ] && bench+=(--connect "$PEER:$PDX_PORT")
else
    bench=("${pdx_bench[@]}")
    [ -n "$PEER" ] && bench+=(--connect "$PEER:$PDX_PORT")
fi
echo "== ${bench[*]}"
ok=0
for attempt in 1 2 3 4 5 6 7 8 9 10; do
    if timeout "$TIMEOUT" "${bench[@]}" >"$tmp/pdx.log" 2>&1; then
        ok=1
        break
    fi
    # Two hosts: the server may still be finishing ib_write_bw; retry a refused connect.
    if [ -n "$PEER" ] && grep -q 'peer_unreachable' "$tmp/pdx.log" && [ "$attempt" -lt 10 ]; then
        sleep 1
        continue
    fi
    break
done
cat "$tmp/pdx.log"
if [ "$ok" = 1 ]; then
    pdx="$(tail -n 1 "$tmp/pdx.log")"
else
    pdx="FAILED (see log above)"
    status=1
fi

echo
echo "== summary"
printf '%-14s %s\n' "ib_write_bw" "${perf:-FAILED} (bytes iters peak_Gb/s avg_Gb/s Mpps)"
printf '%-14s %s\n' "pdxfer rdma" "$pdx"
exit "$status"
