// bandwidth_bench: the memory ceilings the stage benchmarks are measured against, timed the same
// way (CUDA-graph replay, cold L2 before every replay, CUDA events around the replay).
//
// For each size it times two plain streaming kernels and keeps the fastest launch shape of each:
//   read   every byte of a buffer is loaded once (16-byte non-caching loads; nothing is written
//          except one word per CTA that never fires), bytes = the buffer;
//   copy   a buffer is copied into another one, bytes = read + written (what "copy bandwidth"
//          means in docs/PERF.md and bench_util.h's kCopyBandwidthGBs).
// Sizes include the decode weight stream of the fused projection (9856 x 6144 E4M3 bytes) and the
// index-K stream of a 256 x 8K indexer call, so a stage's "% of copy" can be read beside what a
// kernel doing nothing but streaming the same bytes reaches, fixed launch costs included.
// Each is timed isolated (one replay after a flush) and back-to-back (calls in one graph over
// rotating source copies; bench_util.h); an empty kernel shows the fixed cost of each timing.
//
// usage: bandwidth_bench [--json] [--quick]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "support/bench_util.h"

namespace m3attn {
namespace {

__global__ void read_kernel(const int4* __restrict__ p, size_t n, int* sink) {
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
  if (acc == 0x7fffffff) sink[blockIdx.x] = acc;  // practically never: keeps the loads alive
}

__global__ void copy_kernel(const int4* __restrict__ src, int4* __restrict__ dst, size_t n) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < 4; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

__global__ void empty_kernel() {}

struct Size {
  const char* name;
  size_t bytes;
};

}  // namespace
}  // namespace m3attn

int main(int argc, char** argv) {
  using namespace m3attn;
  bool json = false, quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) {
      json = true;
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--json] [--quick]\n", argv[0]);
      return 2;
    }
  }
  std::vector<Size> sizes = {{"8 MB", size_t{8} << 20},
                             {"32 MB", size_t{32} << 20},
                             {"proj weights 9856x6144", size_t{9856} * 6144},
                             {"128 MB", size_t{128} << 20},
                             {"index-K 256 x 8K", size_t{256} * 8192 * 128},
                             {"1 GB", size_t{1} << 30}};
  if (quick) sizes = {sizes[2], sizes[4], sizes[5]};
  size_t max_bytes = 0, max_src_bytes = 0;
  for (const Size& s : sizes) {
    max_bytes = std::max(max_bytes, s.bytes);
    max_src_bytes = std::max(max_src_bytes, s.bytes * bench::back_to_back_copies(s.bytes));
  }

  int device = 0, sms = 0;
  bench::check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  bench::check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "attr");
  void *src = nullptr, *dst = nullptr, *sink = nullptr;
  bench::check_cuda(cudaMalloc(&src, max_src_bytes), "cudaMalloc(src)");
  bench::check_cuda(cudaMalloc(&dst, max_bytes), "cudaMalloc(dst)");
  bench::check_cuda(cudaMalloc(&sink, sizeof(int) * 64 * sms), "cudaMalloc(sink)");
  bench::check_cuda(cudaMemset(src, 0x3c, max_src_bytes), "cudaMemset(src)");
  cudaStream_t stream;
  bench::check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");

  // Launch shapes tried per size: CTAs per SM x threads per CTA.
  const int per_sm[] = {2, 4, 8, 16};
  const int threads = 512;
  std::vector<bench::Row> rows;
  {
    const bench::Timing te = bench::time_graph_cold(
        [&](cudaStream_t st) { empty_kernel<<<sms, 32, 0, st>>>(); }, stream);
    const bench::Timing tb = bench::time_graph_back_to_back(
        [&](cudaStream_t st, int) { empty_kernel<<<sms, 32, 0, st>>>(); }, 1, stream, 32);
    bench::Row r;
    r.add("size", "empty kernel");
    r.add("MB", 0.0, 1);
    r.add("read_us", te.median_us, 2);
    r.add("read_GB/s", "n/a");
    r.add("read_grid", std::to_string(sms));
    r.add("read_b2b_us", tb.median_us, 2);
    r.add("read_b2b_GB/s", "n/a");
    r.add("copy_us", "n/a");
    r.add("copy_GB/s", "n/a");
    r.add("copy_grid", "n/a");
    r.add("copy_b2b_us", "n/a");
    r.add("copy_b2b_GB/s", "n/a");
    r.add("check", "n/a");
    rows.push_back(r);
  }
  for (const Size& s : sizes) {
    const size_t n = s.bytes / sizeof(int4);
    double best_read = 1e30, best_copy = 1e30;
    int best_read_shape = 0, best_copy_shape = 0;
    for (int k : per_sm) {
      const int grid = k * sms;
      const bench::Timing tr = bench::time_graph_cold(
          [&](cudaStream_t st) {
            read_kernel<<<grid, threads, 0, st>>>(static_cast<const int4*>(src), n,
                                                  static_cast<int*>(sink));
          },
          stream);
      const bench::Timing tc = bench::time_graph_cold(
          [&](cudaStream_t st) {
            copy_kernel<<<grid, threads, 0, st>>>(static_cast<const int4*>(src),
                                                  static_cast<int4*>(dst), n);
          },
          stream);
      if (tr.median_us < best_read) best_read = tr.median_us, best_read_shape = grid;
      if (tc.median_us < best_copy) best_copy = tc.median_us, best_copy_shape = grid;
    }
    // Back-to-back at the best isolated shape, each call reading its own source copy.
    const int copies = bench::back_to_back_copies(s.bytes);
    const auto src_copy = [&](int c) {
      return reinterpret_cast<const int4*>(static_cast<const char*>(src) + c * s.bytes);
    };
    const bench::Timing br = bench::time_graph_back_to_back(
        [&](cudaStream_t st, int c) {
          read_kernel<<<best_read_shape, threads, 0, st>>>(src_copy(c), n, static_cast<int*>(sink));
        },
        copies, stream);
    const bench::Timing bc = bench::time_graph_back_to_back(
        [&](cudaStream_t st, int c) {
          copy_kernel<<<best_copy_shape, threads, 0, st>>>(src_copy(c), static_cast<int4*>(dst), n);
        },
        copies, stream);
    bench::check_cuda(cudaStreamSynchronize(stream), "sync");
    // A cheap self-check: the copy must have reproduced the source bytes.
    unsigned char probe[2] = {0, 0};
    bench::check_cuda(cudaMemcpy(probe, static_cast<unsigned char*>(dst) + s.bytes - 1, 1,
                                 cudaMemcpyDeviceToHost),
                      "probe");
    bench::Row r;
    r.add("size", s.name);
    r.add("MB", s.bytes / 1e6, 1);
    r.add("read_us", best_read, 2);
    r.add("read_GB/s", s.bytes / best_read / 1e3, 0);
    r.add("read_grid", std::to_string(best_read_shape));
    r.add("read_b2b_us", br.median_us, 2);
    r.add("read_b2b_GB/s", s.bytes / br.median_us / 1e3, 0);
    r.add("copy_us", best_copy, 2);
    r.add("copy_GB/s", 2.0 * s.bytes / best_copy / 1e3, 0);
    r.add("copy_grid", std::to_string(best_copy_shape));
    r.add("copy_b2b_us", bc.median_us, 2);
    r.add("copy_b2b_GB/s", 2.0 * s.bytes / bc.median_us / 1e3, 0);
    r.add("check", probe[0] == 0x3c ? "PASS" : "FAIL");
    rows.push_back(r);
  }
  bench::print_rows(
      "streaming ceilings (cold L2; isolated graph replay and back-to-back; copy GB/s counts read "
      "+ "
      "written bytes)",
      rows, json);
  cudaFree(src);
  cudaFree(dst);
  cudaFree(sink);
  cudaStreamDestroy(stream);
  return 0;
}
