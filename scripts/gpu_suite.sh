#!/usr/bin/env bash
# The GPU suite, for a machine with an H100/H200: build (unless --no-build), run the GPU tests, run them
# again under compute-sanitizer memcheck and racecheck, run every benchmark, and write logs to $OUT
# (default ./gpu-out). Prints a short summary last.
#   scripts/gpu_suite.sh [--no-build] [--no-tests] [--no-bench] [--quick] [--filter GTEST_FILTER] [--bench-only] [--no-sanitizer]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
bdir=${M3_BUILD_DIR:-build-gpu}
build=1 quick=0 filter='*' tests=1 sanitizer=1 benches=1
# Per-step time limits in seconds (override through the environment).
t_tests=${M3_T_TESTS:-400} t_san=${M3_T_SANITIZER:-300} t_bench=${M3_T_BENCH:-120}
tools=${M3_SANITIZERS:-memcheck racecheck}
while (($#)); do
  case "$1" in
    --no-build) build=0 ;;
    --quick) quick=1 ;;
    --filter) filter=$2; shift ;;
    --bench-only) tests=0; sanitizer=0 ;;
    --no-bench) benches=0 ;;
    --no-tests) tests=0 ;;
    --no-sanitizer) sanitizer=0 ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
  shift
done
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  >"$out/device.txt" 2>&1
if ((build)); then
  { cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DM3ATTN_CUDA=ON -DM3ATTN_PTXAS_VERBOSE=ON &&
    cmake --build "$bdir" -j "$(nproc)" ${M3_TARGETS:-}; } >"$out/build.log" 2>&1
  rc=$?
  summary+=("build: rc=$rc")
  ((rc == 0)) || { tail -50 "$out/build.log"; printf '%s\n' "${summary[@]}"; exit 1; }
fi
bin=$bdir
if ((tests)); then
  timeout "$t_tests" "$bin/tests/m3attn_gpu_tests" --gtest_filter="$filter" >"$out/gpu_tests.log" 2>&1
  summary+=("gpu tests: rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/gpu_tests.log" | tr '\n' ' ')")
fi
if ((sanitizer)); then
  sfilter=$filter
  ((quick)) && sfilter="${filter}:-*Large*:*65536*"
  for tool in $tools; do
    timeout "$t_san" compute-sanitizer --tool "$tool" --error-exitcode 99 \
      "$bin/tests/m3attn_gpu_tests" --gtest_filter="$sfilter" >"$out/sanitizer_$tool.log" 2>&1
    summary+=("sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$out/sanitizer_$tool.log" | tr '\n' ' ')")
  done
fi
if ((benches)); then
  : >"$out/bench.log"
  for b in "$bin"/bench/*_bench; do
    [ -x "$b" ] || continue
    echo "### $(basename "$b")" >>"$out/bench.log"
    timeout "$t_bench" "$b" >>"$out/bench.log" 2>&1
    summary+=("$(basename "$b"): rc=$?")
  done
fi
echo "== summary =="
printf '%s\n' "${summary[@]}"
