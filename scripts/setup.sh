#!/usr/bin/env bash
# Fresh machine to first result: installs what is missing, builds, runs the main job: the serving
# benchmark `m3attn bench` (fused vs unfused; arguments are passed through, e.g. --json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
./build/m3attn bench "$@"
