#!/usr/bin/env bash
# GPU check. First, before anything long: the driver version, the kernel
# images the binary embeds and which one this driver loaded, GPUDirect
# RDMA (dma-buf / peermem / none: tested by a real registration of device
# memory where an RDMA device exists, else from the dma-buf attribute and
# /sys/module/nvidia_peermem), and CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE
# of cuMemAlloc memory and of cuMemCreate mappings made with and without
# gpuDirectRDMACapable (a flagged mapping reported not capable is flagged
# here: the engine would refuse such pools for rdma). Then kernel correctness against the CPU relayout, then the gather
# kernel against a device-to-device memcpy of the same bytes (131,072 tokens,
# 61 layers, 576 bf16 per row, DCP 4 and 16), then the engine with KV pools in
# device memory (`--engine-only`: 16,384 tokens x 61 layers to 4 decode ranks
# in one process: prefill device pools to host decode pools over cma, the same
# from host-memory pools, and device pools on both sides over tcp, the decode
# copying each piece into its device pools; every byte verified, device pools
# read back; GB/s of each), then the layer-wise benchmark (`--layerwise`:
# device prefill pools written layer by layer by kernels that spin on a model
# stream, each layer sent ordered after its event, against one send after the
# last layer; 8K and 32K tokens x 61 layers x 1152 B, 1 -> 4 decode ranks over
# cma; the exposed transfer time of both, every decode byte verified), then pdxfer's SGLang adapter with torch CUDA
# tensors as KV pools (scripts/sglang-gpu-check.py: one prefill and two decode
# DCP ranks as processes on the GPU, SGLang's scheduler call sequence, every
# decode row read back and checked; needs python3 with numpy and torch with
# CUDA, and the carried libpdxfer.so; skipped with the reason printed when
# those are missing), then pdxfer's vLLM connector on torch CUDA tensors with an
# event-ordered send (scripts/gpu-check-vllm.sh, same needs). Runs on a machine with an NVIDIA
# GPU and no Rust toolchain and no network, from a binary built on a build
# machine; it builds nothing (bash, coreutils and the binary; nvidia-smi and
# nvcc are used when present):
#
#   # on the build machine (scripts/cuda-deps.sh: nvcc 13 and NVRTC 12.4, so the
#   # binary embeds an sm_90 cubin + PTX of CUDA 13 and of CUDA 12.4)
#   eval "$(scripts/cuda-deps.sh)"
#   cargo build --release --example gpu_check --no-default-features --features cuda
#   strip -o target/gpu-check target/release/examples/gpu_check     # ~2 MB
#   cargo build --release --lib --no-default-features --features cuda
#   strip -o target/libpdxfer.so target/release/libpdxfer.so       # the SGLang step
#   # and, for the NCCL steps, target/nccl-check and target/pdxfer-nccl (build
#   # lines in scripts/nccl-check.sh)
#   # then run this script on the GPU host with them carried along (device tool:
#   # carry=["target/gpu-check", "target/libpdxfer.so", "target/nccl-check",
#   #        "target/pdxfer-nccl"], command="scripts/gpu-check.sh")
#
# The binary loads its kernels from, in order: $PDXFER_KERNEL_MODULE, the
# embedded images this driver can load (a cubin of the driver's CUDA major,
# newest first; then PTX no newer than the driver), NVRTC (libnvrtc.so.13 or
# .12 on the loader path or in a Python's site-packages, e.g. PyTorch's
# nvidia-cuda-nvrtc wheel; the newest no newer than the driver). If it cannot
# load any (exit 3), and the host has nvcc, this script compiles
# cuda/relayout.cu there (checking ptxas for spills), points
# PDXFER_KERNEL_MODULE at the cubin, and runs again.
#
# Environment: PDXFER_GPU_CHECK_BIN (binary), GPU_CHECK_ARGS (extra arguments,
# e.g. "--min-ratio 0.85" to fail below the target), GPU_CHECK_TIMEOUT
# (seconds, default 360), ENGINE_CHECK_ARGS (extra arguments of the engine
# step, e.g. "--engine-tokens 32768"), ENGINE_CHECK_TIMEOUT (seconds, default
# 120); LAYERWISE_CHECK_ARGS (extra arguments of the layer-wise step, e.g.
# "--layerwise-layer-us 2000"), LAYERWISE_CHECK_TIMEOUT (seconds, default 90);
# SGLANG_CHECK_ARGS (arguments of the SGLang step, default "--layers 61
# --tokens 2048"), SGLANG_CHECK_TIMEOUT (seconds, default 90), PDXFER_LIB
# (default target/libpdxfer.so, else target/release/libpdxfer.so);
# GPU_CHECK_BUDGET caps the whole script (seconds, default 470).
# GPU_CHECK_DRY_RUN=1 runs nothing: it prints each step it would run, with
# its timeout, and exits 0 (no binary or GPU needed; tests/abi/scripts.rs).
# Output: the log on stdout, and $OUT/gpu-check.log when $OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=${GPU_CHECK_DRY_RUN:-}
[ "$dry" = 0 ] && dry=""
if [ -n "$dry" ]; then
    # every step prints what it would run instead (its timeout first)
    timeout() { echo "gpu-check: [dry-run] timeout $*"; return 0; }
    : "${PDXFER_GPU_CHECK_BIN:=target/gpu-check}"
fi
# A carried binary (or, in a dry run, any name).
have() { [ -n "$dry" ] || [ -x "$1" ]; }
bin=${PDXFER_GPU_CHECK_BIN:-}
if [ -z "$bin" ]; then
    for b in target/gpu-check target/release/examples/gpu_check; do
        if [ -x "$b" ]; then bin=$b; break; fi
    done
fi
if [ -z "$bin" ] || ! have "$bin"; then
    echo "gpu-check: no binary (build it as described at the top of $0)" >&2
    exit 2
fi
log=${OUT:+$OUT/gpu-check.log}
log=${log:-/dev/null}
limit=${GPU_CHECK_TIMEOUT:-360}
# The whole script stays within GPU_CHECK_BUDGET seconds (default 470, under 8 minutes):
# every step's timeout is cut to what is left of it.
budget=${GPU_CHECK_BUDGET:-470}
within() { # seconds wanted -> seconds allowed now (at least 1)
    local left=$((budget - SECONDS))
    [ "$left" -lt 1 ] && left=1
    [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
say() { echo "$@" | tee -a "$log"; }

# NVRTC fallback: the binary finds libnvrtc.so.13/.12 on the loader path and in
# Python site-packages itself; a toolkit's lib64 is added in case it is not on
# the loader path.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    if [ -e "$d/libnvrtc.so.13" ] || [ -e "$d/libnvrtc.so.12" ] || [ -e "$d/libnvrtc.so" ]; then
        export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
        break
    fi
done

say "gpu-check: $(date -u +%FT%TZ) binary $bin"
# First: driver, kernel image, GPUDirect (the binary's --summary; its exit 3
# means no embedded image or NVRTC loads, which the nvcc step below may fix).
summary_out=$(timeout "$(within 90)" "$bin" --summary 2>&1)
src=$?
echo "$summary_out" | tee -a "$log"
[ "$src" -ne 0 ] && say "gpu-check: summary exit $src"
if echo "$summary_out" | grep -q "cuMemCreate(gpuDirectRDMACapable=1) NOT capable"; then
    say "gpu-check: WARNING: a cuMemCreate mapping made with gpuDirectRDMACapable is not GPUDirect RDMA capable: decode device pools from VMM allocators go over tcp (auto) or are refused (rdma) on this host"
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader 2>&1 | tee -a "$log"
fi

nvcc_bin=$(command -v nvcc || true)
[ -z "$nvcc_bin" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc_bin=/usr/local/cuda/bin/nvcc
local_module() {
    # Builds the kernels with the host's nvcc for the host's GPU; sets PDXFER_KERNEL_MODULE.
    [ -n "$nvcc_bin" ] || return 1
    local cc tmp
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    cc=${cc:-90}
    tmp=$(mktemp -d)
    say "gpu-check: building cuda/relayout.cu with $nvcc_bin for sm_$cc"
    if ! "$nvcc_bin" -arch="sm_$cc" -cubin -Xptxas -v -o "$tmp/relayout.cubin" cuda/relayout.cu 2>&1 | tee -a "$log"; then
        return 1
    fi
    export PDXFER_KERNEL_MODULE=$tmp/relayout.cubin
}

# shellcheck disable=SC2086 # GPU_CHECK_ARGS is a list of arguments
timeout "$(within "$limit")" "$bin" ${GPU_CHECK_ARGS:-} 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 3 ] && local_module; then
    say "gpu-check: retrying with PDXFER_KERNEL_MODULE=$PDXFER_KERNEL_MODULE"
    # shellcheck disable=SC2086
    timeout "$(within "$limit")" "$bin" ${GPU_CHECK_ARGS:-} 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
fi

# The engine with device-memory KV pools (skipped when no kernels load).
if [ "$rc" -ne 3 ]; then
    say "gpu-check: engine with KV pools in device memory (prefill; then prefill and decode)"
    # shellcheck disable=SC2086 # ENGINE_CHECK_ARGS is a list of arguments
    timeout "$(within "${ENGINE_CHECK_TIMEOUT:-120}")" "$bin" --engine-only ${ENGINE_CHECK_ARGS:-} 2>&1 | tee -a "$log"
    erc=${PIPESTATUS[0]}
    [ "$erc" -ne 0 ] && say "gpu-check: engine step failed (exit $erc)" && [ "$rc" -eq 0 ] && rc=$erc
fi

# Layer-wise sends from device pools against whole-request (skipped when no kernels load).
if [ "$rc" -ne 3 ]; then
    say "gpu-check: layer-wise sends ordered by per-layer events vs whole-request (device pools)"
    # shellcheck disable=SC2086 # LAYERWISE_CHECK_ARGS is a list of arguments
    timeout "$(within "${LAYERWISE_CHECK_TIMEOUT:-90}")" "$bin" --layerwise ${LAYERWISE_CHECK_ARGS:-} 2>&1 | tee -a "$log"
    lrc=${PIPESTATUS[0]}
    [ "$lrc" -ne 0 ] && say "gpu-check: layer-wise step failed (exit $lrc)" && [ "$rc" -eq 0 ] && rc=$lrc
fi

# pdxfer's SGLang adapter with torch CUDA tensors as pools, 1 -> 2 DCP ranks.
sglang_skip=""
py=$(command -v python3 || true)
lib=${PDXFER_LIB:-}
if [ -z "$lib" ]; then
    for l in target/libpdxfer.so target/release/libpdxfer.so; do
        if [ -f "$l" ]; then lib=$PWD/$l; break; fi
    done
fi
if [ -n "$dry" ]; then
    py=${py:-python3}
    lib=${lib:-$PWD/target/libpdxfer.so}
elif [ "$rc" -eq 3 ]; then
    sglang_skip="no kernel image loads"
elif [ -z "$py" ]; then
    sglang_skip="no python3"
elif [ -z "$lib" ] || [ ! -f "$lib" ]; then
    sglang_skip="no libpdxfer.so (build it as described at the top of $0, or set PDXFER_LIB)"
elif ! "$py" -c 'import numpy' 2>/dev/null; then
    sglang_skip="python3 has no numpy"
elif ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    sglang_skip="torch is not importable or torch.cuda is not available"
elif [ $((budget - SECONDS)) -lt 30 ]; then
    sglang_skip="under 30 s of GPU_CHECK_BUDGET left"
fi
if [ -n "$sglang_skip" ]; then
    say "gpu-check: SGLang adapter step skipped: $sglang_skip"
else
    say "gpu-check: SGLang adapter, torch CUDA tensors as pools, 1 prefill -> 2 decode DCP ranks ($lib)"
    stimeout=$(within "${SGLANG_CHECK_TIMEOUT:-90}")
    # shellcheck disable=SC2086 # SGLANG_CHECK_ARGS is a list of arguments
    PDXFER_LIB=$lib PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PDXFER_SGLANG_POOL_MEMORY=device \
        timeout "$stimeout" "$py" scripts/sglang-gpu-check.py --memory device \
        --timeout "$((stimeout > 10 ? stimeout - 5 : stimeout))" ${SGLANG_CHECK_ARGS:---layers 61 --tokens 2048} \
        2>&1 | tee -a "$log"
    src=${PIPESTATUS[0]}
    [ "$src" -ne 0 ] && say "gpu-check: SGLang adapter step failed (exit $src)" && [ "$rc" -eq 0 ] && rc=$src
fi

# pdxfer's vLLM connector on torch CUDA tensors (scripts/gpu-check-vllm.sh; exit 3: cannot run here).
if [ "$rc" -eq 3 ]; then
    say "gpu-check: vLLM connector step skipped: no kernel image loads"
elif [ $((budget - SECONDS)) -lt 30 ]; then
    say "gpu-check: vLLM connector step skipped: under 30 s of GPU_CHECK_BUDGET left"
else
    PDXFER_LIB=${lib:-} VLLM_CHECK_TIMEOUT=$(within "${VLLM_CHECK_TIMEOUT:-90}") bash scripts/gpu-check-vllm.sh 2>&1 | tee -a "$log"
    vrc=${PIPESTATUS[0]}
    if [ "$vrc" -ne 0 ] && [ "$vrc" -ne 3 ]; then
        say "gpu-check: vLLM connector step failed (exit $vrc)"
        [ "$rc" -eq 0 ] && rc=$vrc
    fi
fi

# NCCL on one GPU (target/nccl-check, built as scripts/nccl-check.sh says):
# the library loads, a unique id, and an init whose peer never joins fails
# at its 3 s deadline. Exit 3 there means no NCCL on this host (reported).
nccl_bin=${PDXFER_NCCL_CHECK_BIN:-}
[ -z "$nccl_bin" ] && have target/nccl-check && nccl_bin=target/nccl-check
if [ -n "$nccl_bin" ]; then
    say "gpu-check: NCCL: library, unique id, init with a peer that never joins"
    timeout "$(within 30)" "$nccl_bin" --solo --deadline-ms 3000 2>&1 | tee -a "$log"
    nrc=${PIPESTATUS[0]}
    if [ "$nrc" -eq 3 ]; then
        say "gpu-check: NCCL step: no NCCL library or device here (exit 3)"
    elif [ "$nrc" -ne 0 ]; then
        say "gpu-check: NCCL step failed (exit $nrc)"
        [ "$rc" -eq 0 ] && rc=$nrc
    fi
else
    say "gpu-check: NCCL step not run: no target/nccl-check (build line in scripts/nccl-check.sh)"
fi
# The engine over transport nccl needs two GPUs (scripts/nccl-check.sh); on
# one, `pdxfer bench --transport nccl` (target/pdxfer-nccl, built as
# scripts/nccl-check.sh says) must refuse at once, saying why.
if have target/pdxfer-nccl; then
    gcount=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
    [ -n "$dry" ] && gcount=1
    if [ "$gcount" -eq 1 ]; then
        say "gpu-check: engine over nccl on one GPU: a typed refusal"
        out=$(timeout "$(within 30)" target/pdxfer-nccl bench --transport nccl 2>&1)
        erc=$?
        echo "$out" | tee -a "$log"
        if [ -z "$dry" ] && { [ "$erc" -eq 0 ] || ! echo "$out" | grep -Eq "one GPU per rank|no_nccl"; }; then
            say "gpu-check: engine over nccl on one GPU: no typed refusal (exit $erc)"
            [ "$rc" -eq 0 ] && rc=1
        fi
    fi
    # Both ranks named on one GPU: each end's GPU is in the control hello, so
    # the link is refused when it is set up (nccl_same_gpu, naming cma/tcp),
    # not by NCCL's "Duplicate GPU detected" at the first chunk.
    say "gpu-check: engine over nccl with both ranks on GPU 0: refused at link set-up (nccl_same_gpu)"
    out=$(timeout "$(within 30)" target/pdxfer-nccl bench --transport nccl --nccl-gpus 0,0 \
        --block-sizes 64K --iters 1 2>&1)
    erc=$?
    echo "$out" | tee -a "$log"
    if [ -z "$dry" ] && { [ "$erc" -eq 0 ] || ! echo "$out" | grep -Eq "nccl_same_gpu|no_nccl"; }; then
        say "gpu-check: engine over nccl on one GPU named twice: no nccl_same_gpu refusal (exit $erc)"
        [ "$rc" -eq 0 ] && rc=1
    fi
fi
say "gpu-check: exit $rc"
exit "$rc"
