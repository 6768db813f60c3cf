#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "support/bench_util.h"

namespace m3attn::bench {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

namespace {
constexpr size_t kFlushBytes = size_t{256} << 20;

__global__ void plain_read_kernel(const int4* __restrict__ p, size_t n, int* sink) {
  int acc = 0;
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                   : "l"(p + i + u * stride));
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) acc ^= p[i].x ^ p[i].w;
  if (acc == 0x7fffffff) sink[blockIdx.x] = acc;
}

void* flush_buffer() {
  static void* buf = [] {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, kFlushBytes), "cudaMalloc(flush)");
    return p;
  }();
  return buf;
}

// Reads the flush buffer so L2 ends up holding clean lines of it: a memset alone leaves up to 60 MB
// of dirty lines whose write-back would land inside the timed region of the next kernel.
__global__ void read_sweep(const int4* __restrict__ p, size_t n, int* sink) {
  int acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x)
    acc ^= p[i].x ^ p[i].w;
  if (acc == 0x7fffffff) *sink = acc;  // practically never true; keeps the loads alive
}

void flush_l2(int iteration, cudaStream_t stream) {
  check_cuda(cudaMemsetAsync(flush_buffer(), iteration & 0xff, kFlushBytes, stream), "flush");
  read_sweep<<<528, 256, 0, stream>>>(static_cast<const int4*>(flush_buffer()),
                                      kFlushBytes / sizeof(int4),
                                      static_cast<int*>(flush_buffer()));
  check_cuda(cudaGetLastError(), "flush read sweep");
}

Timing summarize(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  Timing t;
  t.median_us = 1000.0 * ms[ms.size() / 2];
  t.min_us = 1000.0 * ms.front();
  t.p90_us = 1000.0 * ms[std::min(ms.size() - 1, ms.size() * 9 / 10)];
  return t;
}

// M3_BENCH_PROFILE=1 runs every case once, without warmup (for ncu / nsys: one launch per case).
bool profile_mode() {
  static const bool on = [] {
    const char* v = std::getenv("M3_BENCH_PROFILE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  return on;
}

Timing time_loop(const std::function<void(cudaStream_t)>& run, cudaStream_t stream, int warmup,
                 int iters) {
  if (profile_mode()) warmup = 0, iters = 1;
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < warmup; ++i) run(stream);
  check_cuda(cudaStreamSynchronize(stream), "warmup");
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    flush_l2(i, stream);
    check_cuda(cudaEventRecord(start, stream), "record");
    run(stream);
    check_cuda(cudaEventRecord(stop, stream), "record");
    check_cuda(cudaEventSynchronize(stop), "sync");
    float t = 0;
    check_cuda(cudaEventElapsedTime(&t, start, stop), "elapsed");
    ms.push_back(t);
  }
  check_cuda(cudaGetLastError(), "benchmark launch");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return summarize(std::move(ms));
}
}  // namespace

Timing time_cold(const std::function<void(cudaStream_t)>& launch, cudaStream_t stream, int warmup,
                 int iters) {
  return time_loop(launch, stream, warmup, iters);
}

Timing time_graph_cold(const std::function<void(cudaStream_t)>& launch, cudaStream_t stream,
                       int warmup, int iters) {
  return time_graph_back_to_back([&](cudaStream_t s, int) { launch(s); }, 1, stream, 1, warmup,
                                 iters);
}

Timing time_graph_back_to_back(const std::function<void(cudaStream_t, int)>& launch, int copies,
                               cudaStream_t stream, int calls, int warmup, int iters) {
  if (copies < 1) copies = 1;
  if (calls <= 0) calls = std::max(8, 2 * copies);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  for (int i = 0; i < calls; ++i) launch(stream, i % copies);
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  Timing t = time_loop([&](cudaStream_t s) { check_cuda(cudaGraphLaunch(exec, s), "replay"); },
                       stream, warmup, iters);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  t.median_us /= calls;
  t.min_us /= calls;
  t.p90_us /= calls;
  return t;
}

void launch_plain_read(const void* p, size_t n16, int grid, int threads, int* sink,
                       cudaStream_t stream) {
  plain_read_kernel<<<grid, threads, 0, stream>>>(static_cast<const int4*>(p), n16, sink);
}

int back_to_back_copies(size_t input_bytes_per_call) {
  constexpr size_t kSpan = size_t{240} << 20;  // 4 x the H200's 60 MB of L2
  if (input_bytes_per_call == 0) return 64;
  const size_t n = (kSpan + input_bytes_per_call - 1) / input_bytes_per_call;
  return static_cast<int>(std::min<size_t>(64, std::max<size_t>(1, n)));
}

void Row::add(const std::string& name, double value, int precision) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << value;
  cells.emplace_back(name, os.str());
}

void print_rows(const std::string& title, const std::vector<Row>& rows, bool json) {
  if (json) {
    std::cout << "[";
    for (size_t r = 0; r < rows.size(); ++r) {
      std::cout << (r ? ",\n " : "") << "{\"bench\":\"" << title << "\"";
      for (const auto& [k, v] : rows[r].cells) {
        const bool numeric =
            !v.empty() && v.find_first_not_of("0123456789.-e+") == std::string::npos;
        std::cout << ",\"" << k << "\":" << (numeric ? v : "\"" + v + "\"");
      }
      std::cout << "}";
    }
    std::cout << "]\n";
    return;
  }
  if (rows.empty()) return;
  std::vector<size_t> width;
  for (const auto& [k, v] : rows[0].cells) width.push_back(k.size());
  for (const auto& row : rows)
    for (size_t c = 0; c < row.cells.size() && c < width.size(); ++c)
      width[c] = std::max(width[c], row.cells[c].second.size());
  std::cout << "== " << title << " ==\n";
  for (size_t c = 0; c < width.size(); ++c)
    std::cout << std::setw(static_cast<int>(width[c]) + 2) << rows[0].cells[c].first;
  std::cout << "\n";
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.cells.size() && c < width.size(); ++c)
      std::cout << std::setw(static_cast<int>(width[c]) + 2) << row.cells[c].second;
    std::cout << "\n";
  }
}

unsigned long long rows_trace_first_entry(const std::vector<unsigned long long>& words, int ctas) {
  constexpr int kWords = 8;
  const size_t n = std::min(static_cast<size_t>(ctas), words.size() / kWords);
  unsigned long long t0 = 0;
  for (size_t c = 0; c < n; ++c) {
    const unsigned long long e = words[c * kWords];
    if (e != 0 && (t0 == 0 || e < t0)) t0 = e;
  }
  return t0;
}

std::string rows_trace_summary(const std::vector<unsigned long long>& words, int ctas,
                               unsigned long long t0_ns) {
  constexpr int kWords = 8;
  const size_t n = std::min(static_cast<size_t>(ctas), words.size() / kWords);
  if (rows_trace_first_entry(words, ctas) == 0) return "no trace";
  const unsigned long long t0 = t0_ns != 0 ? t0_ns : rows_trace_first_entry(words, ctas);
  // (Differences in integers first: a double holds a raw %globaltimer value to ~100 ns only.)
  auto since_t0 = [&](unsigned long long ns) {
    return static_cast<double>(static_cast<long long>(ns - t0));
  };
  // Marks: entry, first full, middle full, last full, folded, epilogue done (us after t0).
  constexpr int kMarks = 6;
  std::vector<double> mark[kMarks], ghz, to_first, stream, tail;
  for (size_t c = 0; c < n; ++c) {
    const unsigned long long* w = &words[c * kWords];
    if (w[0] == 0 || w[7] <= w[0] || w[6] <= w[1]) continue;
    const double cyc_per_ns = static_cast<double>(w[6] - w[1]) / static_cast<double>(w[7] - w[0]);
    auto at = [&](int word) {
      return (since_t0(w[0]) +
              static_cast<double>(static_cast<long long>(w[word] - w[1])) / cyc_per_ns) /
             1e3;
    };
    mark[0].push_back(since_t0(w[0]) / 1e3);
    for (int k = 1; k < kMarks; ++k) mark[k].push_back(at(k + 1));
    ghz.push_back(cyc_per_ns);
    to_first.push_back(at(2) - mark[0].back());
    stream.push_back(at(4) - at(2));
    tail.push_back(at(6) - at(4));
  }
  if (ghz.empty()) return "no complete trace";
  auto stat = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.2f/%.2f/%.2f", v.front(), v[v.size() / 2], v.back());
    return std::string(buf);
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const char* names[kMarks] = {"entry", "first full", "mid full", "last full", "folded", "done"};
  std::string out = std::to_string(ghz.size()) + " CTAs, us min/median/max after " +
                    (t0_ns != 0 ? "the time base:" : "the first entry:");
  for (int k = 0; k < kMarks; ++k) out += std::string(" ") + names[k] + " " + stat(mark[k]) + ";";
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                " per CTA (median): entry -> first full %.2f, first -> last full %.2f, last full "
                "-> done %.2f (max %.2f); span %.2f us; SM clock %.3f GHz",
                median(to_first), median(stream), median(tail),
                *std::max_element(tail.begin(), tail.end()),
                *std::max_element(mark[5].begin(), mark[5].end()), median(ghz));
  return out + buf;
}

}  // namespace m3attn::bench
