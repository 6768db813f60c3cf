#!/usr/bin/env bash
# Profiles one benchmark's kernels with Nsight Compute, each case launched once (M3_BENCH_PROFILE=1),
# clocks left as they are. Writes $OUT/ncu_<bench>.txt (details) and prints a one-line-per-kernel digest.
#   scripts/profile.sh BUILD_DIR BENCH KERNEL_REGEX [bench args...]
# e.g. scripts/profile.sh build producer_bench 'producer' --quick
set -uo pipefail
(($# >= 3)) || { sed -n 2,5p "$0"; exit 2; }
bdir=$1 bench=$2 regex=$3
shift 3
out=${OUT:-gpu-out}
mkdir -p "$out"
log="$out/ncu_${bench}.txt"
M3_BENCH_PROFILE=1 ncu --clock-control none -k "regex:${regex}" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  "$bdir/bench/$bench" "$@" >"$log" 2>&1
rc=$?
echo "ncu $bench: rc=$rc, $(grep -c 'Section: GPU Speed Of Light' "$log") kernels profiled -> $log"
# Digest: kernel name, grid, duration, DRAM throughput, memory throughput, achieved occupancy.
awk '/^  [A-Za-z_].*\(/ {name=$1; grid=$0}
     /^    Duration/ {dur=$NF" "$(NF-1)}
     /^    DRAM Throughput/ {dram=$NF}
     /^    Memory Throughput/ && $3=="%" {mem=$NF}
     /^    Achieved Occupancy/ {occ=$NF; printf "%-40s dur=%s dram%%=%s mem%%=%s occ%%=%s\n", substr(name,1,40), dur, dram, mem, occ}' "$log"
exit $rc
