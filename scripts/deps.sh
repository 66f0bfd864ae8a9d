#!/usr/bin/env bash
# Installs what pdxfer needs to build and test on a fresh Debian machine of our
# kind (Rust toolchain already present). Idempotent: skips what is installed.
set -euo pipefail

APT_PACKAGES=(
  cmake pkg-config                      # scripts/check-install.sh (CMake and pkg-config consumers)
  libibverbs-dev ibverbs-providers      # verbs.h for the layout check of our verbs binding; libibverbs.so.1 at run time
  valgrind                              # C tests under memcheck
  python3-venv
  etcd-server                           # bootstrap tests start a private etcd (/usr/bin/etcd)
  iproute2                              # two-namespace tcp test (ip netns, veth)
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY_PACKAGES=(numpy pytest)
for p in "${PY_PACKAGES[@]}"; do
  python3 -c "import $p" 2>/dev/null || { echo "deps: pip install $p"; python3 -m pip install -q "$p"; }
done

# SGLang 0.5.23 without its dependencies (no torch): the SGLang adapter tests
# load its connector, plugin and scheduler-facing modules from here
# (python/tests/sglang_env.py; PDXFER_SGLANG_TARGET moves it).
SGLANG_TARGET="${PDXFER_SGLANG_TARGET:-$(cd "$(dirname "$0")/.." && pwd)/.cache/sglang-0.5.23}"
if [ ! -d "$SGLANG_TARGET/sglang-0.5.23.dist-info" ]; then
  echo "deps: pip install --no-deps sglang==0.5.23 into $SGLANG_TARGET"
  python3 -m pip install -q --no-deps --target "$SGLANG_TARGET" "sglang==0.5.23"
fi
