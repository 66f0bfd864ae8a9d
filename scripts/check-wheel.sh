#!/usr/bin/env bash
# The Python package as a user installs it: the manylinux wheel of
# scripts/build-wheel.sh (`pip wheel .` linked by zig against glibc 2.28,
# `auditwheel repair`), checked and installed into a fresh venv with numpy and
# pytest, and python tests run against the installed package: from outside
# the source tree, with no PDXFER_LIB, no PYTHONPATH and no LD_LIBRARY_PATH,
# PDXFER_EXPECT_INSTALLED=1 (the tests then assert that pdxfer and its
# library come from the venv).
#
# Checks, in order:
# 1. the wheel holds the library, the `pdxfer` command and the SGLang entry
#    point; `auditwheel show` places it at manylinux_2_28 or older and lists
#    no external library; the library's NEEDED entries are glibc's, libgcc_s
#    and ld-linux only;
# 2. its embedded kernel images include a CUDA 12 cubin, built with
#    PDXFER_KERNEL_NVRTC unset: the NVRTC is the build requirement of
#    pyproject.toml, found in pip's isolated build environment as
#    `pip install .` finds it;
# 3. the python tests (below) against the installed package;
# 4. without libibverbs: in a private mount namespace (`unshare -m`, as root,
#    or `unshare -rm` through a user namespace) every libibverbs file the
#    loader knows (`ldconfig -p`, symlinks resolved) is covered by a bind
#    mount of /dev/null, so no process inside can load it (checked first: a
#    dlopen of libibverbs.so.1 must fail). There `import pdxfer` works, bytes
#    move over tcp and cma (test_transfer.py), and `pdxfer info` says
#    libibverbs was not found, naming it. This hides the real system library
#    rather than pointing pdxfer elsewhere ($PDXFER_IBVERBS), so what runs is
#    what a host without rdma-core runs. Without root or user namespaces this
#    step is a skip of kind `root`.
#
# Which tests in step 3: PDXFER_WHEEL_TESTS, file names under python/tests,
# or `all`. The default is the tests of what installing changes (the
# installed package, its library and command, the examples and the SGLang
# entry point from the venv, transfers through the installed library):
# scripts/test.sh runs the whole suite against the source tree just before,
# so the rest would run twice.
# The wheel is built with cargo's dev profile in target/manylinux (its own
# target directory: see scripts/build-wheel.sh); PDXFER_WHEEL_PROFILE=release
# builds what a release ships. Time on 2 cores: about 4 minutes from a cold
# target/manylinux, 1-2 minutes when only pdxfer changed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT="$(mktemp -d "${TMPDIR:-/tmp}/pdxfer-wheel.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT
t0=$SECONDS

env -u PDXFER_KERNEL_NVRTC PDXFER_WHEEL_PROFILE="${PDXFER_WHEEL_PROFILE:-dev}" \
  bash scripts/build-wheel.sh "$OUT/wheels" | tee "$OUT/build.log"
wheel="$(ls "$OUT"/wheels/pdxfer-*.whl)"
echo "built $(basename "$wheel") in $((SECONDS - t0)) s"
fail() { echo "check-wheel: $*" >&2; exit 1; }

# 1. contents, platform tag, external libraries
case "$(basename "$wheel")" in
  *-manylinux_2_28_x86_64.whl) ;;
  *) fail "the wheel is not tagged manylinux_2_28_x86_64: $(basename "$wheel")" ;;
esac
listing="$(python3 -m zipfile -l "$wheel")"
for f in 'pdxfer/libpdxfer[^ ]*\.so' 'pdxfer-[^ ]*\.data/scripts/pdxfer' 'pdxfer/sglang/plugin\.py'; do
  grep -q "$f" <<<"$listing" || fail "the wheel has no $f"
done
show="$(PATH="$REPO/.cache/wheel-tools/bin:$PATH" auditwheel show "$wheel")"
tag="$(grep -oE 'platform tag: "manylinux_2_[0-9]+_x86_64"' <<<"$show" | head -n1 | grep -oE '2_[0-9]+')" ||
  fail "auditwheel show names no manylinux tag: $show"
[ "${tag#2_}" -le 28 ] || fail "auditwheel places the wheel at manylinux_$tag, newer than 2_28: $show"
if grep -qi 'external shared librar' <<<"$show"; then
  fail "the wheel needs external libraries: $show"
fi
mkdir -p "$OUT/unpacked"
python3 -m zipfile -e "$wheel" "$OUT/unpacked"
needed="$(readelf -d "$OUT"/unpacked/pdxfer/libpdxfer*.so | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')"
for n in $needed; do
  case "$n" in
    libc.so.6 | libm.so.6 | libdl.so.2 | libpthread.so.0 | librt.so.1 | libgcc_s.so.1 | ld-linux-x86-64.so.2) ;;
    *) fail "libpdxfer.so needs $n at load time (only glibc, libgcc_s and ld-linux are allowed)" ;;
  esac
done
echo "auditwheel: manylinux_$tag, no external library; NEEDED: $(echo $needed)"

python3 -m venv "$OUT/venv"
"$OUT/venv/bin/python" -m pip install -q numpy pytest "$wheel"
clean_env=(env -u PDXFER_LIB -u PYTHONPATH -u LD_LIBRARY_PATH -u PDXFER_IBVERBS PDXFER_EXPECT_INSTALLED=1)

# 2. the CUDA 12 cubin came from the build requirement
info="$("${clean_env[@]}" "$OUT/venv/bin/pdxfer" info --json)"
python3 - "$info" <<'EOF' || fail "no CUDA 12 cubin embedded (the build requirement nvidia-cuda-nvrtc-cu12 was not found by build.rs)"
import json, sys
images = json.loads(sys.argv[1])["kernel_images"]
print("kernel images:", ", ".join(f"{i['arch']} {i['kind']} CUDA {i['cuda']}" for i in images))
sys.exit(0 if any(i["kind"] == "cubin" and i["cuda"].startswith("12.") for i in images) else 1)
EOF

# 3. the tests against the installed package
# shellcheck disable=SC2206 # a list of names, split on spaces
tests=(${PDXFER_WHEEL_TESTS:-test_installed.py test_examples.py test_sglang_gpu_check.py test_transfer.py})
if [ "${tests[*]}" = all ]; then
  paths=("$REPO/python/tests")
else
  paths=("${tests[@]/#/$REPO/python/tests/}")
fi
pytest=("$OUT/venv/bin/python" -m pytest -q -rs -p no:cacheprovider --rootdir "$REPO/python/tests")
cd "$OUT"
"${clean_env[@]}" "${pytest[@]}" "${paths[@]}" 2>&1 | tee "$OUT/pytest.log"
# skips of the installed run are recorded like the source run's (scripts/test.sh reports them)
record_skips() {
  if [ -n "${PDXFER_SKIP_LOG:-}" ]; then
    grep '^SKIPPED' "$1" | sed "s/^/python\t$2\t/" >>"$PDXFER_SKIP_LOG" || true
  fi
}
record_skips "$OUT/pytest.log" wheel-pytest

# 4. on a host without libibverbs
if [ "$(id -u)" = 0 ]; then ns=(unshare -m --propagation private); else ns=(unshare -rm --propagation private); fi
if ! "${ns[@]}" true 2>/dev/null; then
  echo "SKIPPED [root] check-wheel: no mount namespace (needs root or user namespaces): the wheel was not run without libibverbs"
  if [ -n "${PDXFER_SKIP_LOG:-}" ]; then
    printf 'root\tcheck-wheel-no-libibverbs\tno mount namespace (needs root or user namespaces)\n' >>"$PDXFER_SKIP_LOG"
  fi
else
  verbs_files="$( (ldconfig -p | awk '/libibverbs\.so/ {print $NF}'; ls /usr/lib/*/libibverbs.so* /lib/*/libibverbs.so* 2>/dev/null) |
    xargs -r readlink -f | sort -u)"
  cat >"$OUT/no-verbs.sh" <<'EOF'
set -euo pipefail
for f in $VERBS_FILES; do mount --bind /dev/null "$f"; done
# the hiding works: nothing in here can load libibverbs
if python3 -c 'import ctypes; ctypes.CDLL("libibverbs.so.1")' 2>/dev/null; then
  echo "check-wheel: libibverbs.so.1 still loads inside the namespace" >&2
  exit 1
fi
"$@"
EOF
  verbs_check=("$OUT/venv/bin/python" - "$OUT/venv/bin/pdxfer")
  cat >"$OUT/no-verbs.py" <<'EOF'
import json, subprocess, sys
import pdxfer  # the library loads without libibverbs
info = json.loads(subprocess.run([sys.argv[1], "info", "--json"], check=True, capture_output=True, text=True).stdout)
ib = info["libraries"]["libibverbs"]
assert ib["found"] is False and "libibverbs.so.1" in ib["detail"], ib
print("without libibverbs: pdxfer", pdxfer.abi_version(), "loads;", ib["detail"][:100])
EOF
  VERBS_FILES="$verbs_files" "${clean_env[@]}" "${ns[@]}" bash "$OUT/no-verbs.sh" \
    "${verbs_check[@]}" <"$OUT/no-verbs.py"
  VERBS_FILES="$verbs_files" "${clean_env[@]}" "${ns[@]}" bash "$OUT/no-verbs.sh" \
    "${pytest[@]}" "$REPO/python/tests/test_transfer.py" 2>&1 | tee "$OUT/pytest-no-verbs.log"
  record_skips "$OUT/pytest-no-verbs.log" wheel-no-libibverbs
  echo "hidden: $(echo $verbs_files)"
fi
echo "check-wheel: done in $((SECONDS - t0)) s"
