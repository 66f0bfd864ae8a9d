#!/usr/bin/env bash
# The main job: installs what is needed, builds pdxfer in release mode and runs
# `pdxfer demo` (bootstrap + 1 prefill + 4 decode DCP processes, every byte
# verified). Extra arguments go to `pdxfer demo` (--transport, --dcp-size,
# --requests, --json, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo build --release --quiet
./target/release/pdxfer demo "$@"
