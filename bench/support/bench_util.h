// Benchmark helpers shared by bench/*_bench.cu: CUDA-event timing with a cold L2 (a 256 MB buffer
// is overwritten between iterations so no input stays cached), CUDA-graph replay timing for
// decode-sized calls (the flush is a memset followed by a read sweep, so no dirty line is written
// back inside the timed region), the measured ceilings, and a table / JSON printer.
// M3_BENCH_PROFILE=1 in the environment runs each timed case once (no warmup) for profilers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace m3attn::bench {

constexpr double kCopyBandwidthGBs = 4300.0;  // measured H200 device-to-device copy (read + write)
constexpr double kFp8DenseTflops = 1979.0;    // H200 FP8 dense tensor rate (datasheet; lead only)

void check_cuda(cudaError_t e, const char* what);  // aborts with a message on error

struct Timing {
  double median_us = 0;
  double min_us = 0;
  double p90_us = 0;
};

// Times `launch` (which enqueues work on `stream`) with CUDA events, flushing L2 before each timed
// iteration (the flush itself is outside the timed region).
Timing time_cold(const std::function<void(cudaStream_t)>& launch, cudaStream_t stream,
                 int warmup = 3, int iters = 20);
// Captures `launch` once in a CUDA graph, then times replays (cold L2 each time).
Timing time_graph_cold(const std::function<void(cudaStream_t)>& launch, cudaStream_t stream,
                       int warmup = 3, int iters = 50);

struct Row {
  std::vector<std::pair<std::string, std::string>> cells;  // column name -> formatted value
  void add(const std::string& name, const std::string& value) { cells.emplace_back(name, value); }
  void add(const std::string& name, double value, int precision = 2);
};

// Prints rows as an aligned text table (stdout); with json=true, one JSON array instead.
void print_rows(const std::string& title, const std::vector<Row>& rows, bool json);

}  // namespace m3attn::bench
