#!/usr/bin/env bash
# Data-plane figures on this machine, side by side, as a markdown table:
#   pdxfer bench (cma with shared and heap target regions, tcp) with a memcpy of
#   the same bytes measured in the same run; iperf3 single stream on loopback;
#   UCX ucx_perftest ucp_put_bw over posix shm and tcp.
# Needs: iperf3 and ucx-utils (Debian packages). Runs ~1 minute; not part of the tests.
# OUT (default target/bench-compare) receives the raw outputs and sweep.png.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-target/bench-compare}
mkdir -p "$OUT"
cargo build --release -q
B=target/release/pdxfer
PORT=${PORT:-$((20000 + RANDOM % 20000))}

bench() { # name args...
  local name=$1; shift
  echo "+ pdxfer bench $* --json" >>"$OUT/commands.txt"
  $B bench "$@" --json | tail -1 >"$OUT/$name.json"
}
bench cma_1m_b1  --transport cma --block-sizes 1M --batch-sizes 1 --depth 8 --max-ms 2000
bench cma_1m_b4  --transport cma --block-sizes 1M --batch-sizes 4 --depth 8 --max-ms 2000
bench cma_1m     --transport cma --block-sizes 1M --batch-sizes 16 --depth 8 --max-ms 2000
bench cma_1m_vm  --transport cma --block-sizes 1M --batch-sizes 16 --depth 8 --max-ms 2000 --heap-target
bench cma_4k     --transport cma --block-sizes 4K --batch-sizes 256 --depth 4 --max-ms 2000
bench cma_4k_vm  --transport cma --block-sizes 4K --batch-sizes 256 --depth 4 --max-ms 2000 --heap-target
bench tcp_1m     --transport tcp --block-sizes 1M --batch-sizes 16 --threads 1 --depth 4 --max-ms 3000
# 8 MiB in flight: the working set fits the L3 cache, as iperf3's reused 128 KiB buffer does
bench tcp_1m_b4  --transport tcp --block-sizes 1M --batch-sizes 4 --threads 1 --depth 2 --max-ms 3000
bench tcp_4k     --transport tcp --block-sizes 4K --batch-sizes 256 --threads 1 --depth 4 --max-ms 2000
echo "+ pdxfer bench --transport cma --block-sizes 4K,16K,64K,256K,1M,4M --batch-sizes 16 --plot $OUT/sweep.png" >>"$OUT/commands.txt"
$B bench --transport cma --block-sizes 4K,16K,64K,256K,1M,4M --batch-sizes 16 --depth 4 --max-ms 500 \
  --plot "$OUT/sweep.png" >"$OUT/sweep.txt"

echo "+ iperf3 -s -1 -p $PORT & iperf3 -c 127.0.0.1 -p $PORT -t 5 -J" >>"$OUT/commands.txt"
iperf3 -s -1 -p "$PORT" >/dev/null 2>&1 &
sleep 0.5
iperf3 -c 127.0.0.1 -p "$PORT" -t 5 -J >"$OUT/iperf3.json"
wait || true

ucx() { # name tls size iters
  local name=$1 tls=$2 size=$3 n=$4 p=$((PORT + 1))
  echo "+ UCX_TLS=$tls ucx_perftest -p $p & UCX_TLS=$tls ucx_perftest 127.0.0.1 -p $p -t ucp_put_bw -s $size -n $n" >>"$OUT/commands.txt"
  UCX_TLS=$tls timeout 120 ucx_perftest -p "$p" >/dev/null 2>&1 &
  sleep 1
  UCX_TLS=$tls timeout 120 ucx_perftest 127.0.0.1 -p "$p" -t ucp_put_bw -s "$size" -n "$n" >"$OUT/$name.txt" 2>&1 || true
  wait || true
}
ucx ucx_shm_1m posix,self 1048576 3000
ucx ucx_shm_4k posix,self 4096 300000
ucx ucx_tcp_1m tcp 1048576 500
ucx ucx_tcp_4k tcp 4096 50000

python3 - "$OUT" <<'PY'
import json, sys, re, pathlib
out = pathlib.Path(sys.argv[1])
def b(name):
    return json.loads((out / f"{name}.json").read_text())
def ucx(name):
    for line in (out / f"{name}.txt").read_text().splitlines():
        if line.startswith("Final:"):
            f = line.split()
            # columns: iters, p50 lat, avg lat, overall lat (us), avg bw, overall bw (MB/s = MiB/s), avg rate, overall rate (msg/s)
            return float(f[6]) * 1048576 / 1e9, float(f[8]), float(f[2])
    return None
ip = json.loads((out / "iperf3.json").read_text())["end"]["sum_received"]["bits_per_second"] / 8e9
rows = []
def row(what, gb, ops=None, lat=None, ref=None, note=""):
    rows.append(f"| {what} | {gb:.2f} | {'' if ops is None else f'{ops/1e6:.2f}'} | {'' if lat is None else f'{lat:.1f}'} | {ref or ''} | {note} |")
for n, what in [("cma_1m_b1", "pdxfer cma, 1 MiB blocks, batch 1 (shared target regions: memcpy)"),
                ("cma_1m_b4", "pdxfer cma, 1 MiB blocks, batch 4 (shared target regions: memcpy)"),
                ("cma_1m", "pdxfer cma, 1 MiB blocks, batch 16 (shared target regions: memcpy)"),
                ("cma_1m_vm", "pdxfer cma, 1 MiB blocks, batch 16 (heap target: process_vm_writev)"),
                ("cma_4k", "pdxfer cma, 4 KiB writes, batch 256 (shared)"),
                ("cma_4k_vm", "pdxfer cma, 4 KiB writes, batch 256 (heap: process_vm_writev)"),
                ("tcp_1m", "pdxfer tcp, 1 stream, 1 MiB blocks, batch 16, depth 4 (64 MiB in flight)"),
                ("tcp_1m_b4", "pdxfer tcp, 1 stream, 1 MiB blocks, batch 4, depth 2 (8 MiB in flight)"),
                ("tcp_4k", "pdxfer tcp, 1 stream, 4 KiB writes, batch 256")]:
    p = b(n)
    ref = f"{p['ratio_vs_memcpy']:.2f}x memcpy ({p['memcpy_gb_per_s']:.2f} GB/s)"
    if n.startswith("tcp_1m"):
        ref += f"; {p['gb_per_s']/ip:.2f}x iperf3"
    row(what, p["gb_per_s"], p["ops_per_s"], p["p50_us"], ref, f"p99 {p['p99_us']:.0f} us")
row("iperf3 single stream, loopback, 5 s", ip)
for n, what in [("ucx_shm_1m", "ucx_perftest ucp_put_bw posix shm, 1 MiB"), ("ucx_shm_4k", "ucx_perftest ucp_put_bw posix shm, 4 KiB"),
                ("ucx_tcp_1m", "ucx_perftest ucp_put_bw tcp, 1 MiB"), ("ucx_tcp_4k", "ucx_perftest ucp_put_bw tcp, 4 KiB")]:
    u = ucx(n)
    if u:
        row(what, u[0], u[1], u[2], note="lat column: average per put")
    else:
        rows.append(f"| {what} | failed, see {out}/{n}.txt | | | | |")
print("| what | GB/s | Mops/s | p50 batch latency (us) | ratio | note |")
print("|---|---|---|---|---|---|")
print("\n".join(rows))
PY
echo
echo "commands:"; cat "$OUT/commands.txt"
rm -f "$OUT/commands.txt.prev"; mv "$OUT/commands.txt" "$OUT/commands.txt.prev"
