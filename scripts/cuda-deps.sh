#!/usr/bin/env bash
# Installs the CUDA tool wheels the no-GPU tests need from PyPI into a cache
# directory, adds the loader names cudarc looks for, and prints the exports.
#
#   eval "$(scripts/cuda-deps.sh)"            # nvcc + NVRTC (CUDA 13 and 12.4) and NCCL
#   PDXFER_CUDA_DEPS_NO_NCCL=1 eval "$(...)"  # skip the 350 MB NCCL wheel
#
# What it installs (`pip install --no-deps --target`, which keeps the exec bits
# on nvcc/ptxas; see shared/reference/dependencies.md sections 4, 7, 9):
#   nvidia-cuda-nvcc nvidia-cuda-crt nvidia-nvvm nvidia-cuda-runtime  -> nvcc 13 (sm_90 PTX + cubin, ptxas -v)
#   nvidia-cuda-nvrtc                                                 -> libnvrtc.so.13
#   nvidia-cuda-nvrtc-cu12==12.4.127                                  -> libnvrtc.so.12 (CUDA 12.4)
#   nvidia-nccl-cu12                                                  -> libnccl.so.2
# build.rs embeds an sm_90 cubin and PTX from nvcc 13 and from NVRTC 12.4
# ($PDXFER_KERNEL_NVRTC), so kernels load on CUDA 12.x drivers (12.4 PTX ISA
# 8.4; the 12.x cubin on any 12.x driver) as well as 13.x ones. The cu12 nvcc
# wheels have ptxas but no nvcc, hence NVRTC for the 12.x images.
# pdxfer finds libnvrtc.so.12/.13 and libnccl.so.2 itself (sonames and
# site-packages): the NCCL wheel's --target directory goes on PYTHONPATH, where
# pdxfer's site-packages search finds nvidia/nccl/lib/libnccl.so.2 (no link, no
# loader path). $DIR/lib holds a libnvrtc.so link for other tools.
#
# Cache: $PDXFER_CUDA_DEPS (default: <repo>/.cache/cuda, ignored by git). A
# second run is a no-op. Progress goes to stderr; only the exports go to stdout.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${PDXFER_CUDA_DEPS:-$repo/.cache/cuda}
mkdir -p "$dir"
pip=(python3 -m pip install --no-deps --disable-pip-version-check --root-user-action=ignore --quiet)

install_set() { # name, packages...
    local name=$1
    shift
    if [ ! -f "$dir/$name.done" ]; then
        echo "cuda-deps: installing $* into $dir/$name" >&2
        rm -rf "$dir/$name"
        local t0=$SECONDS
        "${pip[@]}" --target "$dir/$name" "$@" >&2
        echo "cuda-deps: $name done in $((SECONDS - t0)) s" >&2
        touch "$dir/$name.done"
    fi
}

install_set cu13 nvidia-cuda-nvcc==13.5.37 nvidia-cuda-crt==13.5.37 nvidia-nvvm==13.5.37 \
    nvidia-cuda-runtime==13.5.37 nvidia-cuda-nvrtc==13.5.37
install_set cu124 nvidia-cuda-nvrtc-cu12==12.4.127
if [ -z "${PDXFER_CUDA_DEPS_NO_NCCL:-}" ]; then
    install_set nccl nvidia-nccl-cu12==2.32.3
fi

cu13=$dir/cu13/nvidia/cu13
mkdir -p "$dir/lib"
ln -sfn "$cu13/lib/libnvrtc.so.13" "$dir/lib/libnvrtc.so"
if [ -f "$dir/nccl.done" ]; then
    echo "export PYTHONPATH=\"$dir/nccl\${PYTHONPATH:+:\$PYTHONPATH}\""
fi
echo "export PATH=\"$cu13/bin:\$PATH\""
echo "export LD_LIBRARY_PATH=\"$dir/lib:$cu13/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
echo "export PDXFER_NVCC=\"$cu13/bin/nvcc\""
echo "export PDXFER_KERNEL_NVRTC=\"$dir/cu124/nvidia/cuda_nvrtc/lib/libnvrtc.so.12\""
