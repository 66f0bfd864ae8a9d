#!/usr/bin/env bash
# One PD request (8,192 tokens x 61 layers x 1152 B = 575.7 MB, 4 decode DCP
# ranks) through pdxfer (`pdxfer bench-request`, cma and tcp), Mooncake TE
# over tcp on loopback (rows pre-packed) and NIXL with UCX pinned to loopback
# (tcp, and shared memory), in one run; prints a markdown table with each
# peer's time over pdxfer's on the same transport. A peer that cannot be
# installed or run is reported with the reason and the rest go on.
#
#   bash scripts/compare-peers.sh [--requests N] [--tokens N] [--json]
#
# The venv (PyPI: mooncake-transfer-engine-non-cuda, nixl-cu12 without its
# torch dependency, numpy) lives in ${PEERS_VENV:-target/peers-venv}; pdxfer is
# ${PDXFER:-target/release/pdxfer} (built here when missing). Not part of the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${PEERS_VENV:-target/peers-venv}
PDXFER=${PDXFER:-target/release/pdxfer}
[ -x "$PDXFER" ] || nice cargo build --release -q || { echo "compare-peers: cargo build --release failed" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" || { echo "compare-peers: cannot create the venv $VENV" >&2; exit 1; }
fi
pipq() { "$VENV/bin/pip" install -q --disable-pip-version-check "$@"; }
# --no-deps: nixl-cu12 requires torch (a CUDA wheel of several GB) that its host-memory
# API does not use; numpy is what it really imports. Mooncake's aiohttp/requests/msgpack
# serve its store and HTTP metadata server, not the P2P transfer engine used here.
for pkg in numpy mooncake-transfer-engine-non-cuda nixl-cu12; do
  "$VENV/bin/pip" show -q "$pkg" >/dev/null 2>&1 && continue
  extra=(); [ "$pkg" = numpy ] || extra=(--no-deps)
  pipq "${extra[@]}" "$pkg" || echo "compare-peers: pip install $pkg failed: its rows will say why" >&2
done
exec "$VENV/bin/python" scripts/compare_peers.py --pdxfer "$PDXFER" "$@"
