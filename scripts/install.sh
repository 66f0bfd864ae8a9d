#!/usr/bin/env bash
# Installs the C/C++ SDK of pdxfer under PREFIX:
#   PREFIX/lib/libpdxfer.so.MAJOR.MINOR   (soname libpdxfer.so.MAJOR, the ABI major)
#   PREFIX/lib/libpdxfer.so.MAJOR, PREFIX/lib/libpdxfer.so   (symlinks)
#   PREFIX/include/pdxfer.h
#   PREFIX/lib/cmake/pdxfer/pdxferConfig.cmake + pdxferConfigVersion.cmake
#                                          (find_package(pdxfer) -> pdxfer::pdxfer)
#   PREFIX/lib/pkgconfig/pdxfer.pc
# Usage: scripts/install.sh PREFIX
# Builds the library with cargo first (release; PDXFER_INSTALL_PROFILE=debug
# installs the debug build; CARGO_TARGET_DIR is honoured). The CMake and
# pkg-config files locate PREFIX relative to themselves, so the tree may move.
# A release build embeds a CUDA 12 cubin of the kernels or stops saying how to
# get one (`eval "$(bash scripts/cuda-deps.sh)"` first, or
# PDXFER_KERNELS_WITHOUT_CUDA12=1; see docs/gpu.md).
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 PREFIX" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
mkdir -p "$1"
PREFIX="$(cd "$1" && pwd)"
PROFILE="${PDXFER_INSTALL_PROFILE:-release}"
TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

case "$PROFILE" in
  release) cargo build --release --lib ;;
  debug) cargo build --lib ;;
  *) echo "PDXFER_INSTALL_PROFILE must be release or debug, got $PROFILE" >&2; exit 2 ;;
esac
LIB="$TARGET_DIR/$PROFILE/libpdxfer.so"

header_define() { sed -n "s/^#define $1 \\([0-9]*\\)\$/\\1/p" include/pdxfer.h; }
ABI_MAJOR="$(header_define PDXFER_ABI_VERSION_MAJOR)"
ABI_MINOR="$(header_define PDXFER_ABI_VERSION_MINOR)"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)"
[ -n "$ABI_MAJOR" ] && [ -n "$ABI_MINOR" ] && [ -n "$VERSION" ] || {
  echo "cannot read the ABI version from include/pdxfer.h or the version from Cargo.toml" >&2
  exit 1
}
SONAME="libpdxfer.so.$ABI_MAJOR"
REAL="libpdxfer.so.$ABI_MAJOR.$ABI_MINOR"
if command -v readelf >/dev/null; then
  got="$(readelf -d "$LIB" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')"
  if [ "$got" != "$SONAME" ]; then
    echo "$LIB has soname '$got', expected $SONAME (build.rs sets it)" >&2
    exit 1
  fi
fi

install -d "$PREFIX/lib/cmake/pdxfer" "$PREFIX/lib/pkgconfig" "$PREFIX/include"
install -m 755 "$LIB" "$PREFIX/lib/$REAL"
ln -sfn "$REAL" "$PREFIX/lib/$SONAME"
ln -sfn "$SONAME" "$PREFIX/lib/libpdxfer.so"
install -m 644 include/pdxfer.h "$PREFIX/include/pdxfer.h"
fill() {
  sed -e "s/@ABI_MAJOR@/$ABI_MAJOR/g" -e "s/@ABI_MINOR@/$ABI_MINOR/g" \
      -e "s/@VERSION@/$VERSION/g" -e "s/@VERSION_MAJOR@/${VERSION%%.*}/g" "$1" > "$2"
  chmod 644 "$2"
}
fill cmake/pdxferConfig.cmake.in "$PREFIX/lib/cmake/pdxfer/pdxferConfig.cmake"
fill cmake/pdxferConfigVersion.cmake.in "$PREFIX/lib/cmake/pdxfer/pdxferConfigVersion.cmake"
fill cmake/pdxfer.pc.in "$PREFIX/lib/pkgconfig/pdxfer.pc"
echo "installed pdxfer $VERSION (ABI $ABI_MAJOR.$ABI_MINOR) under $PREFIX"
