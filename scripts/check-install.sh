#!/usr/bin/env bash
# The C/C++ install as a consumer sees it: scripts/install.sh into a temporary
# PREFIX, then examples/cpp built against it with CMake (find_package(pdxfer),
# pdxfer::pdxfer) and with pkg-config, and both programs run (a prefill and
# two decode DCP ranks in separate processes, every byte verified).
# PDXFER_INSTALL_PROFILE (default debug here: reuses the test build).
set -euo pipefail
cd "$(dirname "$0")/.."
export PDXFER_INSTALL_PROFILE="${PDXFER_INSTALL_PROFILE:-debug}"
PREFIX="$(mktemp -d "${TMPDIR:-/tmp}/pdxfer-prefix.XXXXXX")"
trap 'rm -rf "$PREFIX"' EXIT

bash scripts/install.sh "$PREFIX/usr"
P="$PREFIX/usr"
MAJOR="$(sed -n 's/^#define PDXFER_ABI_VERSION_MAJOR \([0-9]*\)$/\1/p' include/pdxfer.h)"
for f in "lib/libpdxfer.so.$MAJOR" lib/libpdxfer.so include/pdxfer.h \
         lib/cmake/pdxfer/pdxferConfig.cmake lib/cmake/pdxfer/pdxferConfigVersion.cmake lib/pkgconfig/pdxfer.pc; do
  [ -e "$P/$f" ] || { echo "install: $P/$f missing" >&2; exit 1; }
done
readelf -d "$P/lib/libpdxfer.so" | grep -q "(SONAME).*\[libpdxfer.so.$MAJOR\]" || {
  echo "install: libpdxfer.so has no soname libpdxfer.so.$MAJOR" >&2; exit 1; }

needs_soname() {  # the program must load the library by its soname
  readelf -d "$1" | grep -q "(NEEDED).*\[libpdxfer.so.$MAJOR\]" || {
    echo "$1 does not link libpdxfer.so.$MAJOR" >&2; exit 1; }
}
run_example() {
  local out
  out="$("$1" 2 300 32)"
  echo "$out" | tail -n 2
  [ "$(echo "$out" | grep -c verified)" = 2 ] && echo "$out" | grep -q OK || {
    echo "$1 did not verify both decode ranks" >&2; exit 1; }
}

echo "== examples/cpp with CMake (find_package(pdxfer))"
cmake -S examples/cpp -B "$PREFIX/cmake-build" -DCMAKE_PREFIX_PATH="$P" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$PREFIX/cmake-build" >/dev/null
needs_soname "$PREFIX/cmake-build/pd_dcp"
run_example "$PREFIX/cmake-build/pd_dcp"

echo "== examples/cpp with pkg-config"
export PKG_CONFIG_PATH="$P/lib/pkgconfig"
# shellcheck disable=SC2046 # pkg-config prints several flags
${CXX:-c++} -std=c++17 -O2 -Wall -Wextra -Werror -o "$PREFIX/pd_dcp_pc" examples/cpp/pd_dcp.cpp \
  $(pkg-config --cflags --libs pdxfer) -Wl,-rpath,"$(pkg-config --variable=libdir pdxfer)"
needs_soname "$PREFIX/pd_dcp_pc"
run_example "$PREFIX/pd_dcp_pc"
