#!/usr/bin/env bash
# Builds everything (the CUDA backend too when nvcc is present) and runs the CPU test suite.
# The GPU suite needs a device: scripts/gpu_suite.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
ctest --preset default -j "$(nproc)"
