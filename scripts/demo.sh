#!/usr/bin/env bash
# The main job: installs what is needed, builds pdxfer in release mode and runs
# the worked example plan (until `pdxfer demo` exists). Extra arguments go to `pdxfer plan`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo build --release --quiet
./target/release/pdxfer plan "$@"
