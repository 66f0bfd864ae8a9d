#!/usr/bin/env bash
# GPU check of pdxfer's vLLM connector (scripts/vllm-gpu-check.py): its worker
# side with torch CUDA tensors in vLLM's MLA cache shape as device pools, a
# prefill and a decode worker in one process over tcp, the prefill's send
# ordered after its KV writes by the CUDA event wait_for_save records (the
# writes queued behind a GPU sleep), then the layer saves of a prefill step
# run before the decode registers, queued with one event per layer and sent
# once it does; every decode byte checked. Needs python3
# with torch (CUDA) and numpy, and libpdxfer.so built with the cuda feature
# (target/libpdxfer.so as scripts/gpu-check.sh builds it, or PDXFER_LIB); vLLM
# need not be installed. scripts/gpu-check.sh runs it; alone:
#
#   bash scripts/gpu-check-vllm.sh [--layers 61 --tokens 2048]
#
# Exit 0 when verified, 3 when this host cannot run it (no python3, torch,
# CUDA or library: the reason is printed), else the check's failure.
set -uo pipefail
cd "$(dirname "$0")/.."
py=$(command -v python3 || true)
lib=${PDXFER_LIB:-}
if [ -z "$lib" ]; then
    for l in target/libpdxfer.so target/release/libpdxfer.so target/debug/libpdxfer.so; do
        if [ -f "$l" ]; then lib=$PWD/$l; break; fi
    done
fi
skip=""
if [ -z "$py" ]; then
    skip="no python3"
elif [ -z "$lib" ] || [ ! -f "$lib" ]; then
    skip="no libpdxfer.so (build it as scripts/gpu-check.sh says, or set PDXFER_LIB)"
elif ! "$py" -c 'import numpy' 2>/dev/null; then
    skip="python3 has no numpy"
elif ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    skip="torch is not importable or torch.cuda is not available"
fi
if [ -n "$skip" ]; then
    echo "gpu-check-vllm: skipped: $skip"
    exit 3
fi
echo "gpu-check-vllm: vLLM connector, torch CUDA tensors as pools, event-ordered sends ($lib)"
# router: one send after wait_for_save's event; sequential: layer saves queued
# with their events before the decode registers, sent after it does
for flow in router sequential; do
    # shellcheck disable=SC2086 # VLLM_CHECK_ARGS is a list of arguments
    PDXFER_LIB=$lib PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" \
        timeout "${VLLM_CHECK_TIMEOUT:-120}" "$py" scripts/vllm-gpu-check.py --memory device --flow "$flow" \
        "$@" ${VLLM_CHECK_ARGS:-} || exit $?
done
