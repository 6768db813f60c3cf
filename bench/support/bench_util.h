// Benchmark helpers shared by bench/*_bench.cu: CUDA-event timing with a cold L2 (a 256 MB buffer
// is overwritten between iterations so no input stays cached), CUDA-graph replay timing for
// decode-sized calls (the flush is a memset followed by a read sweep, so no dirty line is written
// back inside the timed region), back-to-back timing over rotating input copies, the measured
// ceilings, and a table / JSON printer.
//
// Two timings of one call, both with cold inputs:
//   isolated     one call (or one graph replay) after an L2 flush, CUDA events around it: includes
//                the launch and the event overhead (~3 us on the H200, see bandwidth_bench's
//                "empty kernel" row), i.e. what a lone call costs;
//   back-to-back `calls` calls captured in one graph and replayed after a flush, call i reading
//                input copy i % copies (enough copies that no call finds its inputs in L2): graph
//                time / calls, i.e. what a call costs inside a captured decode step where launches
//                follow each other. Launch latency is hidden; each call's ramp-up and tail are not.
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

// Back-to-back per-call time (see the top of this file). launch(stream, copy) enqueues one call
// that reads input copy `copy` (0 <= copy < copies); calls = 0 means max(8, 2 * copies).
Timing time_graph_back_to_back(const std::function<void(cudaStream_t, int)>& launch, int copies,
                               cudaStream_t stream, int calls = 0, int warmup = 2, int iters = 15);
// Input copies a back-to-back sequence needs so that no call finds its inputs in L2: the copies
// together span at least 4 x 60 MB (1 for calls of 240 MB or more, at most 64).
int back_to_back_copies(size_t input_bytes_per_call);

struct Row {
  std::vector<std::pair<std::string, std::string>> cells;  // column name -> formatted value
  void add(const std::string& name, const std::string& value) { cells.emplace_back(name, value); }
  void add(const std::string& name, double value, int precision = 2);
};

// Prints rows as an aligned text table (stdout); with json=true, one JSON array instead.
void print_rows(const std::string& title, const std::vector<Row>& rows, bool json);

// The plain read the copy-bandwidth ceilings are measured with: `n16` contiguous 16-byte words
// from `p`, each loaded once (non-caching, 4 per lane in flight), by `grid` x `threads` threads on
// `stream`; the XOR of the words goes to sink[block] only if it equals 0x7fffffff (practically
// never: it keeps the loads alive), so `sink` needs one int per block.
void launch_plain_read(const void* p, size_t n16, int grid, int threads, int* sink,
                       cudaStream_t stream);

// The row split's per-CTA trace (8 words per CTA, gemm_wgmma_rows_kernel.cuh kRowsTraceWords:
// globaltimer ns and clock64 at entry, clock64 when the first / middle / last stage was full, at
// the last fold and after the epilogue, globaltimer ns at the end; CTAs with word 0 == 0 absent)
// summarized: each CTA's clock64 marks put on the globaltimer base at the CTA's own clock rate,
// then over the CTAs min / median / max of every mark in us after the first CTA's entry, the
// median per-CTA phases (entry -> first full, first -> last full, last full -> end), the kernel's
// span and the SMs' clock. t0_ns (a %globaltimer value; 0: the first CTA's entry) is the time base
// of the marks and of the span (a second launch summarized on the first one's base).
std::string rows_trace_summary(const std::vector<unsigned long long>& words, int ctas,
                               unsigned long long t0_ns = 0);
// The first CTA's entry (%globaltimer ns) in such a trace; 0 if none.
unsigned long long rows_trace_first_entry(const std::vector<unsigned long long>& words, int ctas);

}  // namespace m3attn::bench
