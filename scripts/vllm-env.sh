#!/usr/bin/env bash
# Builds (once) the Python environment the vLLM connector tests run in, and
# prints its interpreter's path on stdout.
#
#   py=$(bash scripts/vllm-env.sh)      # then: "$py" -m pytest python/vllm_tests
#
# Where: ${PDXFER_VLLM_ENV:-$HOME/.cache/pdxfer/vllm-0.33.0}, outside the
# repository, so fresh clones on one machine share it. A second run only checks
# that the environment imports (a no-op when the stamp file is there).
#
# What: torch 2.14.0 (the version vLLM pins) with its own dependencies: PyPI's
# torch is the CUDA build, and its libraries (libtorch, _C) name every CUDA
# library they link (cudart, cublas, cudnn, nccl, nvshmem ...) as DT_NEEDED, so
# `import torch` fails without the nvidia-* wheels even on a machine without a
# GPU (they run CPU tensors there; no driver is needed). Then vLLM 0.33.0 with
# --no-deps, and only the small pure-Python packages that vLLM's config,
# scheduler, connector factory and parallel state import (found by importing
# them; listed in DEPS below), not the rest of vLLM's serving stack (kernels,
# FlashInfer, Triton extensions, multimodal codecs ...). About 6.6 GB, a few
# minutes from PyPI. VLLM_TARGET_DEVICE=cpu at run time selects vLLM's CPU platform.
#
# A failure exits non-zero with the pip or import error: the test stage that
# calls this fails loudly rather than skipping.
set -euo pipefail
env_dir=${PDXFER_VLLM_ENV:-$HOME/.cache/pdxfer/vllm-0.33.0}
stamp=$env_dir/.pdxfer-ready
VLLM=vllm==0.33.0
TORCH=torch==2.14.0
# Import-time dependencies of vllm.config, vllm.v1.core.sched.scheduler,
# vllm.distributed (parallel state on gloo) and the KV connector factory.
DEPS=(
  packaging pydantic msgspec pyzmq cachetools psutil regex cloudpickle
  prometheus_client blake3 cbor2 pybase64 tqdm requests "transformers>=5.16.1,<5.21"
  huggingface_hub tokenizers safetensors pyyaml einops typing_extensions
  filelock sympy networkx jinja2 fsspec numpy pytest
  py-cpuinfo pillow openai-harmony partial_json_parser aiohttp openai uvloop xgrammar
  fastapi llguidance
)
CHECK='import os; os.environ.setdefault("VLLM_TARGET_DEVICE","cpu"); import torch, vllm.config, vllm.v1.core.sched.scheduler, vllm.distributed.kv_transfer.kv_connector.factory, vllm.distributed.parallel_state, vllm.distributed.kv_transfer.kv_connector.v1.base'

if [ -f "$stamp" ] && [ -x "$env_dir/bin/python" ]; then
  echo "$env_dir/bin/python"
  exit 0
fi
t0=$SECONDS
echo "vllm-env: building $env_dir (vLLM 0.33.0 without its dependencies, torch 2.14.0 with its own)" >&2
mkdir -p "$(dirname "$env_dir")"
[ -x "$env_dir/bin/python" ] || python3 -m venv "$env_dir"
pip=("$env_dir/bin/python" -m pip install --disable-pip-version-check --no-warn-conflicts --quiet)
"${pip[@]}" "setuptools>=77" "$TORCH" >&2
"${pip[@]}" --no-deps "$VLLM" >&2
"${pip[@]}" "${DEPS[@]}" >&2
if ! VLLM_TARGET_DEVICE=cpu "$env_dir/bin/python" -c "$CHECK" >&2; then
  echo "vllm-env: $env_dir does not import vLLM's scheduler/connector modules (see the error above)" >&2
  exit 1
fi
touch "$stamp"
echo "vllm-env: ready in $((SECONDS - t0)) s, $(du -sh "$env_dir" | cut -f1)" >&2
echo "$env_dir/bin/python"
