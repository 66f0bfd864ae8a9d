#!/usr/bin/env bash
# The Python package as a user installs it: `pip wheel .` (setuptools-rust,
# pyproject.toml), the wheel installed into a fresh venv with numpy and
# pytest, and python tests run against the installed package: from outside
# the source tree, with no PDXFER_LIB, PDXFER_EXPECT_INSTALLED=1 (the tests
# then assert that pdxfer and its library come from the venv).
# Which tests: PDXFER_WHEEL_TESTS, file names under python/tests, or `all`.
# The default is the tests of what installing changes (the installed package,
# its library and command, the examples and the SGLang entry point from the
# venv, transfers through the installed library): scripts/test.sh runs the
# whole suite against the source tree just before, so the rest would run twice.
# The wheel is built with cargo's dev profile to reuse the test build;
# PDXFER_WHEEL_PROFILE=release builds what `pip wheel .` ships by default.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT="$(mktemp -d "${TMPDIR:-/tmp}/pdxfer-wheel.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT

profile="${PDXFER_WHEEL_PROFILE:-dev}"
if [ "$profile" = release ]; then unset SETUPTOOLS_RUST_CARGO_PROFILE; else export SETUPTOOLS_RUST_CARGO_PROFILE="$profile"; fi
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}" python3 -m pip wheel -q --no-deps -w "$OUT/wheels" .
wheel="$(ls "$OUT"/wheels/pdxfer-*.whl)"
echo "built $(basename "$wheel")"
listing="$(python3 -m zipfile -l "$wheel")"
for f in 'pdxfer/libpdxfer[^ ]*\.so' 'pdxfer-[^ ]*\.data/scripts/pdxfer'; do
  grep -q "$f" <<<"$listing" || { echo "the wheel has no $f" >&2; exit 1; }
done

python3 -m venv "$OUT/venv"
"$OUT/venv/bin/python" -m pip install -q numpy pytest "$wheel"
# shellcheck disable=SC2206 # a list of names, split on spaces
tests=(${PDXFER_WHEEL_TESTS:-test_installed.py test_examples.py test_sglang_gpu_check.py test_transfer.py})
if [ "${tests[*]}" = all ]; then
  paths=("$REPO/python/tests")
else
  paths=("${tests[@]/#/$REPO/python/tests/}")
fi
cd "$OUT"
env -u PDXFER_LIB -u PYTHONPATH PDXFER_EXPECT_INSTALLED=1 \
  "$OUT/venv/bin/python" -m pytest -q -rs -p no:cacheprovider --rootdir "$REPO/python/tests" "${paths[@]}" \
  2>&1 | tee "$OUT/pytest.log"
# skips of the installed run are recorded like the source run's (scripts/test.sh reports them)
if [ -n "${PDXFER_SKIP_LOG:-}" ]; then
  grep '^SKIPPED' "$OUT/pytest.log" | sed 's/^/python\twheel-pytest\t/' >>"$PDXFER_SKIP_LOG" || true
fi
