#!/usr/bin/env bash
# A real `vllm serve` PD run on this machine's CPU: a plain server (the
# reference), then per transport (tcp, cma) a prefill and a decode server with
# pdxfer's connector behind `python -m pdxfer.vllm.proxy`; the same greedy
# requests, the decode's metrics and the connector's logs, a clean shutdown.
# The checks and the environment variables: scripts/vllm_serve_check.py. The
# environment (vLLM 0.33.0 with vLLM's CPU kernels): scripts/vllm-serve-env.sh.
#
#   bash scripts/vllm-serve-check.sh     # prints each step, then a JSON summary; exit 1 on any failure
set -euo pipefail
cd "$(dirname "$0")/.."
echo "=== build libpdxfer (dev profile)"
cargo build --lib
echo "=== the vllm serve environment"
py=$(bash scripts/vllm-serve-env.sh)
echo "=== the check"
PDXFER_LIB="${PDXFER_LIB:-$PWD/target/debug/libpdxfer.so}" exec "$py" scripts/vllm_serve_check.py
