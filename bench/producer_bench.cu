// Producer benchmark (SPEC section 3) at the M3 TP1 geometry (n_q 64, n_kv 4): the fused producer
// against the unfused pair (main + index, timed together as they run in a layer), cold L2, T <= 256
// as CUDA-graph replays. Before timing, each T is spot-checked against the CPU twin (first and last
// tokens: Q, index-Q, K, V and index-K rows) and prints PASS / FAIL. Every fused kernel variant is
// also run, spot-checked and timed at every T (<name>_us, <name>_pct of copy: per_batch, one block
// per batch of 96 tasks; persistent, the register-pipelined grid-stride kernel; tma, the bulk-copy
// shared-memory pipeline with its defaults, tma_s3 with 3 stages; _plan: task plans made by the
// copy warp; _il: interleaved tile order; _share: equal shares, no plans (the round-1 default);
// _t64: 64-task tiles), and the unfused pair on the bulk-copy kernel (unfused_tma_us); fused_us /
// unfused_us are the default choice (ProducerCudaKernel::kAuto). --only also knows tail-block
// variants (tail_*) and the other bulk-copy knobs (see extra below).
//   producer_bench [--json] [--quick] [--only VARIANT[,VARIANT...]] [--t T[,T...]]
// --only runs the listed fused variants (auto or names above) and --t the listed T, e.g. for a
// profiler or an A/B of variants (each case is built once; the variants are timed in turn).
// Bytes moved are counted, not estimated: packed rows read, positions and slots read, one RoPE row
// per distinct position, the norm weights, Q and index-Q written, K / V / index-K rows written for
// tokens with a valid slot. The unfused pair reads positions, slots and RoPE rows twice.
// Timing: cold L2 made clean (memset flush, then a read sweep, both outside the timed region; see
// CleanColdTimer); bench_util's plain memset flush is printed beside it for the fused call. Also
// back-to-back (bench::time_graph_back_to_back: calls captured in one graph, call i reading input
// copy i % copies of the packed rows, so inputs are cold but launch latency is hidden): *_b2b_us
// for the fused call and the unfused pair, b2b_us per --only variant; the last call of each
// sequence is spot-checked too. Under M3_BENCH_PROFILE the back-to-back timings are skipped.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "core/rope.h"
#include "m3attn/config.h"
#include "stages/producer/producer.h"
#include "support/bench_util.h"

namespace m3attn {
namespace {

using bench::check_cuda;

constexpr int kNq = 64;
constexpr int kNkv = 4;
constexpr int64_t kMaxPos = 32768;
constexpr int64_t kTile = int64_t{kPageSize} * kHeadDim;

class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t bytes) : bytes_(bytes) {
    if (bytes) check_cuda(cudaMalloc(&ptr_, bytes), "cudaMalloc");
  }
  DevBuf(DevBuf&& o) noexcept { *this = std::move(o); }
  ~DevBuf() {
    if (ptr_) cudaFree(ptr_);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  void* get() const { return ptr_; }
  uint8_t* bytes() const { return static_cast<uint8_t*>(ptr_); }
  void upload(const void* h, size_t n) {
    if (n) check_cuda(cudaMemcpy(ptr_, h, n, cudaMemcpyHostToDevice), "upload");
  }
  void download(void* h, size_t n, size_t off = 0) const {
    if (n) check_cuda(cudaMemcpy(h, bytes() + off, n, cudaMemcpyDeviceToHost), "download");
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Cheap reproducible BF16 values, roughly N(0, 1) (sum of three uniforms), for large inputs.
uint16_t value_at(uint64_t i) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  const float u = (static_cast<float>(x & 0xffff) + static_cast<float>((x >> 16) & 0xffff) +
                   static_cast<float>((x >> 32) & 0xffff)) /
                      65536.0f -
                  1.5f;
  return float_to_bf16(2.0f * u);
}

// One benchmark case: host inputs, device buffers, params for the three modes.
struct Case {
  int64_t t = 0;
  int64_t num_pages = 0;
  int64_t width[3] = {};  // fused, main, index widths (columns)
  std::vector<uint16_t> packed[3];
  std::vector<int32_t> positions, slots;
  Tensor rope;
  std::vector<uint16_t> norms[4];

  DevBuf d_packed[3], d_pos, d_slots, d_rope, d_norms[4], d_q, d_iq, d_pool;
  std::vector<DevBuf> packed_copies[3];  // back-to-back input copies 1.. of d_packed[m]
  int64_t kv_page = 0, kv_plane = 0, ic_base = 0, ic_page = 0, pool_bytes = 0;
  ProducerParams params[3];  // fused, main, index (device views)
};

// Decode-sized batches (T <= 256) get scattered positions and one token per page; prefill-sized
// ones consecutive positions in consecutive rows of shuffled pages.
void build(Case& c, int64_t t) {
  c.t = t;
  const bool decode = t <= 256;
  c.num_pages = decode ? t + 1 : (t + kPageSize - 1) / kPageSize + 1;
  const int64_t w_main = (kNq + 2 * kNkv) * kHeadDim, w_idx = (kNkv + 1) * kHeadDim;
  c.width[0] = w_main + w_idx;
  c.width[1] = w_main;
  c.width[2] = w_idx;
  c.packed[0].resize(static_cast<size_t>(t * c.width[0]));
  for (size_t i = 0; i < c.packed[0].size(); ++i) c.packed[0][i] = value_at(i);
  for (int m = 1; m < 3; ++m) {
    const int64_t col0 = m == 1 ? 0 : w_main;
    c.packed[m].resize(static_cast<size_t>(t * c.width[m]));
    for (int64_t r = 0; r < t; ++r)
      std::memcpy(&c.packed[m][r * c.width[m]], &c.packed[0][r * c.width[0] + col0],
                  static_cast<size_t>(c.width[m]) * 2);
  }
  std::mt19937_64 rng(1234 + t);
  std::vector<int32_t> pages(static_cast<size_t>(c.num_pages));
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  c.positions.resize(t);
  c.slots.resize(t);
  for (int64_t i = 0; i < t; ++i) {
    if (decode) {
      c.positions[i] = static_cast<int32_t>(rng() % kMaxPos);
      c.slots[i] = pages[i] * kPageSize + c.positions[i] % kPageSize;
    } else {
      c.positions[i] = static_cast<int32_t>(i);
      c.slots[i] = pages[i / kPageSize] * kPageSize + static_cast<int32_t>(i % kPageSize);
    }
  }
  c.rope = std::move(make_rope_table(kMaxPos, 5e6)).value();
  for (int w = 0; w < 4; ++w) {
    c.norms[w].resize(kHeadDim);
    for (int d = 0; d < kHeadDim; ++d)
      c.norms[w][d] = float_to_bf16(0.25f * bf16_to_float(value_at(1000003ull * (w + 1) + d)));
  }

  // Device side. Pool: main cache pages then index cache pages.
  c.kv_plane = kNkv * kTile;
  c.kv_page = 2 * c.kv_plane;
  c.ic_page = kTile;
  c.ic_base = c.num_pages * c.kv_page;
  c.pool_bytes = c.ic_base + c.num_pages * c.ic_page;
  for (int m = 0; m < 3; ++m) {
    c.d_packed[m] = DevBuf(c.packed[m].size() * 2);
    c.d_packed[m].upload(c.packed[m].data(), c.packed[m].size() * 2);
  }
  c.d_pos = DevBuf(static_cast<size_t>(t) * 4);
  c.d_pos.upload(c.positions.data(), static_cast<size_t>(t) * 4);
  c.d_slots = DevBuf(static_cast<size_t>(t) * 4);
  c.d_slots.upload(c.slots.data(), static_cast<size_t>(t) * 4);
  c.d_rope = DevBuf(static_cast<size_t>(c.rope.nbytes()));
  c.d_rope.upload(c.rope.data(), static_cast<size_t>(c.rope.nbytes()));
  for (int w = 0; w < 4; ++w) {
    c.d_norms[w] = DevBuf(kHeadDim * 2);
    c.d_norms[w].upload(c.norms[w].data(), kHeadDim * 2);
  }
  c.d_q = DevBuf(static_cast<size_t>(t) * kNq * kHeadDim);
  c.d_iq = DevBuf(static_cast<size_t>(t) * kNkv * kHeadDim);
  c.d_pool = DevBuf(static_cast<size_t>(c.pool_bytes));
  check_cuda(cudaMemset(c.d_pool.get(), 0, static_cast<size_t>(c.pool_bytes)), "memset pool");
  check_cuda(cudaDeviceSynchronize(), "build");  // the runs below use a non-blocking stream

  const Device dev = Device::cuda(0);
  const ProducerMode modes[3] = {ProducerMode::kFused, ProducerMode::kMain, ProducerMode::kIndex};
  for (int m = 0; m < 3; ++m) {
    ProducerParams& p = c.params[m];
    p.mode = modes[m];
    p.n_q = kNq;
    p.n_kv = kNkv;
    p.num_tokens = t;
    p.packed = TensorView::contiguous(c.d_packed[m].get(), DType::kBF16, {t, c.width[m]}, dev);
    p.positions = TensorView::contiguous(c.d_pos.get(), DType::kI32, {t}, dev);
    p.slots = TensorView::contiguous(c.d_slots.get(), DType::kI32, {t}, dev);
    p.rope = TensorView::contiguous(c.d_rope.get(), DType::kF32, {kMaxPos, 2, kRotaryHalf}, dev);
    if (m != 2) {
      p.q_norm = TensorView::contiguous(c.d_norms[0].get(), DType::kBF16, {kHeadDim}, dev);
      p.k_norm = TensorView::contiguous(c.d_norms[1].get(), DType::kBF16, {kHeadDim}, dev);
      p.q_out = TensorView::contiguous(c.d_q.get(), DType::kE4M3, {t, kNq, kHeadDim}, dev);
      p.kv_cache =
          make_kv_cache_view(c.d_pool.get(), c.num_pages, kNkv, c.kv_page, c.kv_plane, dev);
    }
    if (m != 1) {
      p.iq_norm = TensorView::contiguous(c.d_norms[2].get(), DType::kBF16, {kHeadDim}, dev);
      p.ik_norm = TensorView::contiguous(c.d_norms[3].get(), DType::kBF16, {kHeadDim}, dev);
      p.iq_out = TensorView::contiguous(c.d_iq.get(), DType::kE4M3, {t, kNkv, kHeadDim}, dev);
      p.index_cache =
          make_index_cache_view(c.d_pool.bytes() + c.ic_base, c.num_pages, c.ic_page, dev);
    }
  }
}

void run_or_die(const ProducerParams& p, cudaStream_t s, const ProducerCudaOptions& opt = {}) {
  const Status st = run_producer_cuda(p, s, opt);
  if (!st.ok()) {
    std::fprintf(stderr, "run_producer_cuda (%s): %s\n", producer_mode_name(p.mode),
                 st.to_string().c_str());
    std::exit(1);
  }
}

// Waits for `s` at most 20 s: a kernel that never finishes (a pipeline deadlock) ends the
// benchmark with a message instead of hanging the GPU round.
void sync_or_die(cudaStream_t s, const char* what) {
  for (int i = 0; i < 20000; ++i) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) check_cuda(e, what);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::fprintf(stderr, "%s: TIMEOUT (kernel still running after 20 s): FAIL\n", what);
  std::fflush(stdout);
  std::_Exit(3);
}

// Spot check of the device outputs against the CPU twin on the first 32 and the last token.
bool spot_check(const Case& c, const char* what, FILE* log) {
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < std::min<int64_t>(c.t, 32); ++i) rows.push_back(i);
  if (c.t > 32) rows.push_back(c.t - 1);
  const auto n = static_cast<int64_t>(rows.size());

  // The twin over those tokens, on a host pool of the same layout.
  Tensor packed(DType::kBF16, {n, c.width[0]}), pos(DType::kI32, {n}), slots(DType::kI32, {n});
  for (int64_t j = 0; j < n; ++j) {
    std::memcpy(packed.ptr<uint16_t>() + j * c.width[0], &c.packed[0][rows[j] * c.width[0]],
                static_cast<size_t>(c.width[0]) * 2);
    pos.ptr<int32_t>()[j] = c.positions[rows[j]];
    slots.ptr<int32_t>()[j] = c.slots[rows[j]];
  }
  Tensor norms[4];
  for (int w = 0; w < 4; ++w) {
    norms[w] = Tensor(DType::kBF16, {kHeadDim});
    std::memcpy(norms[w].data(), c.norms[w].data(), kHeadDim * 2);
  }
  Tensor q(DType::kE4M3, {n, kNq, kHeadDim}), iq(DType::kE4M3, {n, kNkv, kHeadDim});
  std::vector<uint8_t> pool(static_cast<size_t>(c.pool_bytes), 0);
  ProducerParams p;
  p.mode = ProducerMode::kFused;
  p.n_q = kNq;
  p.n_kv = kNkv;
  p.num_tokens = n;
  p.packed = packed.view();
  p.positions = pos.view();
  p.slots = slots.view();
  p.rope = c.rope.view();
  p.q_norm = norms[0].view();
  p.k_norm = norms[1].view();
  p.iq_norm = norms[2].view();
  p.ik_norm = norms[3].view();
  p.q_out = q.view();
  p.iq_out = iq.view();
  p.kv_cache = make_kv_cache_view(pool.data(), c.num_pages, kNkv, c.kv_page, c.kv_plane);
  p.index_cache = make_index_cache_view(pool.data() + c.ic_base, c.num_pages, c.ic_page);
  const Status st = run_producer_cpu(p);
  if (!st.ok()) {
    std::fprintf(log, "spot check (%s): CPU twin failed: %s\n", what, st.to_string().c_str());
    return false;
  }

  int64_t bad = 0, checked = 0;
  auto cmp = [&](const uint8_t* want, const uint8_t* got, int64_t len, bool exact) {
    for (int64_t i = 0; i < len; ++i) {
      ++checked;
      if (exact ? want[i] != got[i] : !e4m3_within_one_step(want[i], got[i])) ++bad;
    }
  };
  std::vector<uint8_t> got(static_cast<size_t>(kNq) * kHeadDim);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = rows[j];
    c.d_q.download(got.data(), kNq * kHeadDim, static_cast<size_t>(r * kNq * kHeadDim));
    cmp(q.ptr<uint8_t>() + j * kNq * kHeadDim, got.data(), kNq * kHeadDim, false);
    c.d_iq.download(got.data(), kNkv * kHeadDim, static_cast<size_t>(r * kNkv * kHeadDim));
    cmp(iq.ptr<uint8_t>() + j * kNkv * kHeadDim, got.data(), kNkv * kHeadDim, false);
    const int64_t page = c.slots[r] / kPageSize, row = c.slots[r] % kPageSize;
    for (int h = 0; h < kNkv; ++h) {
      for (int plane = 0; plane < 2; ++plane) {
        const int64_t off = page * c.kv_page + plane * c.kv_plane + h * kTile + row * kHeadDim;
        c.d_pool.download(got.data(), kHeadDim, static_cast<size_t>(off));
        cmp(pool.data() + off, got.data(), kHeadDim, plane == 1);
      }
    }
    const int64_t off = c.ic_base + page * c.ic_page + row * kHeadDim;
    c.d_pool.download(got.data(), kHeadDim, static_cast<size_t>(off));
    cmp(pool.data() + off, got.data(), kHeadDim, false);
  }
  const bool pass = bad == 0 && checked > 0;
  std::fprintf(log, "spot check T=%lld %s vs CPU twin (%lld tokens, %lld bytes): %s (%lld bad)\n",
               static_cast<long long>(c.t), what, static_cast<long long>(n),
               static_cast<long long>(checked), pass ? "PASS" : "FAIL",
               static_cast<long long>(bad));
  return pass;
}

// Cold-L2 timing with a clean L2: bench_util's flush is a 256 MB memset, which leaves up to the
// whole L2 (60 MB) dirty; those lines are written back while the timed kernel evicts them, which
// charges a memory-bound kernel for traffic that is not its own. Here a 256 MB read sweep follows
// the memset (outside the timed region), so the timed call starts with an L2 of clean, unrelated
// lines. Both numbers are printed; the clean one is the kernel's own cost.
__global__ void sweep_read(const uint4* p, size_t n, unsigned* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // keeps the loads alive, practically never stores
}

// M3_BENCH_PROFILE=1 (as bench_util): every timed case runs once, without warmup (ncu / nsys).
bool profile_mode() {
  const char* v = std::getenv("M3_BENCH_PROFILE");
  return v != nullptr && *v != '\0' && *v != '0';
}

class CleanColdTimer {
 public:
  CleanColdTimer() : flush_(kFlushBytes), sink_(4) {
    check_cuda(cudaMemset(flush_.get(), 1, kFlushBytes), "memset flush");
    check_cuda(cudaDeviceSynchronize(), "memset flush");
  }
  bench::Timing time(const std::function<void(cudaStream_t)>& launch, cudaStream_t stream,
                     bool graph, int warmup = 3, int iters = 30) {
    if (profile_mode()) warmup = 0, iters = 1;
    cudaGraphExec_t exec = nullptr;
    if (graph) {
      cudaGraph_t g;
      check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
      launch(stream);
      check_cuda(cudaStreamEndCapture(stream, &g), "end capture");
      check_cuda(cudaGraphInstantiate(&exec, g, 0), "instantiate");
      check_cuda(cudaGraphDestroy(g), "graph destroy");
    }
    const auto run = [&] {
      if (graph) {
        check_cuda(cudaGraphLaunch(exec, stream), "graph launch");
      } else {
        launch(stream);
      }
    };
    cudaEvent_t start, stop;
    check_cuda(cudaEventCreate(&start), "event");
    check_cuda(cudaEventCreate(&stop), "event");
    for (int i = 0; i < warmup; ++i) run();
    std::vector<float> ms;
    for (int i = 0; i < iters; ++i) {
      check_cuda(cudaMemsetAsync(flush_.get(), i & 0xff, kFlushBytes, stream), "flush");
      sweep_read<<<132 * 8, 256, 0, stream>>>(static_cast<const uint4*>(flush_.get()),
                                              kFlushBytes / 16,
                                              static_cast<unsigned*>(sink_.get()));
      check_cuda(cudaEventRecord(start, stream), "record");
      run();
      check_cuda(cudaEventRecord(stop, stream), "record");
      check_cuda(cudaEventSynchronize(stop), "sync");
      float t = 0;
      check_cuda(cudaEventElapsedTime(&t, start, stop), "elapsed");
      ms.push_back(t);
    }
    check_cuda(cudaGetLastError(), "timing loop");
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (exec) cudaGraphExecDestroy(exec);
    std::sort(ms.begin(), ms.end());
    bench::Timing t;
    t.median_us = 1000.0 * ms[ms.size() / 2];
    t.min_us = 1000.0 * ms.front();
    t.p90_us = 1000.0 * ms[std::min(ms.size() - 1, ms.size() * 9 / 10)];
    return t;
  }

 private:
  static constexpr size_t kFlushBytes = size_t{256} << 20;
  DevBuf flush_, sink_;
};

// Pool zeroed (as the twin's), compact outputs poisoned: a row not written fails the spot check.
void reset_outputs(const Case& c, cudaStream_t stream) {
  check_cuda(cudaMemsetAsync(c.d_pool.get(), 0, static_cast<size_t>(c.pool_bytes), stream),
             "reset");
  check_cuda(cudaMemsetAsync(c.d_q.get(), 0xA5, static_cast<size_t>(c.t) * kNq * kHeadDim, stream),
             "poison");
  check_cuda(
      cudaMemsetAsync(c.d_iq.get(), 0xA5, static_cast<size_t>(c.t) * kNkv * kHeadDim, stream),
      "poison");
}

// Back-to-back per-call time (bench::time_graph_back_to_back) of one call of the fused producer
// (modes {0}) or of the unfused pair (modes {1, 2}) with `opt`: call i reads input copy
// i % copies of the packed rows (copy 0 is the case's own, the others device-to-device copies
// made once per case; positions, slots, outputs shared). The outputs of the last call are then
// spot-checked against the CPU twin (every copy holds the same bytes).
double time_back_to_back(Case& c, const std::vector<int>& modes, const ProducerCudaOptions& opt,
                         cudaStream_t stream, const std::string& what, FILE* log, bool& pass) {
  size_t bytes = 0;
  for (const int m : modes) bytes += c.packed[m].size() * 2;
  const int copies = bench::back_to_back_copies(bytes);
  for (const int m : modes) {
    while (static_cast<int>(c.packed_copies[m].size()) + 1 < copies) {
      DevBuf b(c.packed[m].size() * 2);
      check_cuda(cudaMemcpy(b.get(), c.d_packed[m].get(), c.packed[m].size() * 2,
                            cudaMemcpyDeviceToDevice),
                 "input copy");
      c.packed_copies[m].push_back(std::move(b));
    }
  }
  reset_outputs(c, stream);
  const bench::Timing t = bench::time_graph_back_to_back(
      [&](cudaStream_t s, int k) {
        for (const int m : modes) {
          ProducerParams p = c.params[m];
          if (k > 0) p.packed.data = c.packed_copies[m][k - 1].get();
          run_or_die(p, s, opt);
        }
      },
      copies, stream);
  sync_or_die(stream, what.c_str());
  pass &= spot_check(c, (what + " (back-to-back, last call)").c_str(), log);
  return t.median_us;
}

// Bytes one call of the mode moves (see the file comment).
double bytes_moved(const Case& c, int m) {
  std::set<int32_t> distinct(c.positions.begin(), c.positions.end());
  const double t = static_cast<double>(c.t);
  double b = t * static_cast<double>(c.width[m]) * 2 + t * 8 +
             static_cast<double>(distinct.size()) * 2 * kRotaryHalf * 4;
  const bool main = m != 2, index = m != 1;
  b += (main ? 2 : 0) * kHeadDim * 2 + (index ? 2 : 0) * kHeadDim * 2;  // norm weights
  if (main) b += t * (kNq * kHeadDim + 2 * kNkv * kHeadDim);            // Q, K, V
  if (index) b += t * (kNkv * kHeadDim + kHeadDim);                     // index-Q, index-K
  return b;
}

// Percent of the copy bandwidth for `bytes` in `us`.
double pct_copy(double bytes, double us) {
  return 100.0 * bytes / (us * 1e3) / bench::kCopyBandwidthGBs;
}

// Splits "a,b,c" into its items.
std::vector<std::string> split_list(const char* s) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* c = s; *c; ++c) {
    if (*c == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += *c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

}  // namespace
}  // namespace m3attn

int main(int argc, char** argv) {
  using namespace m3attn;
  bool json = false, quick = false;
  std::vector<std::string> only;  // fused variants (names below), spot-checked and timed alone
  std::vector<int64_t> only_t;    // T values
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) {
      json = true;
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      only = split_list(argv[++i]);
    } else if (!std::strcmp(argv[i], "--t") && i + 1 < argc) {
      for (const std::string& t : split_list(argv[++i])) only_t.push_back(std::atoll(t.c_str()));
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--json] [--quick] [--only VARIANT[,VARIANT...]] [--t T[,T...]]\n"
          "  VARIANT: auto per_batch persistent tma tma_s3 tma_il tma_plan tma_plan_il\n"
          "           tma_plan_s3 tma_share tma_t64_s4 tma_il_t64_s4 tma_plan_il_t64_s4\n"
          "           tma_plan_il_t64_s3 tma_plan_t64_s4 tail_r1_x1 tail_r1_x2 tail_r1_x4\n"
          "           tail_r2_x2 tail_r1_x2_t32 tail_r1_x4_t32 tail_r2_x4_t32 tail_r1_x2_t64\n"
          "           tail_r1_x1_t64 tail_r1_x2_t64 tail_r2_x2_t64 tail_r1_x4_t32 tma_notail\n"
          "           tma_m4_s3 tma_m4_s2 tma_m3_s4\n",
          argv[0]);
      return 2;
    }
  }
  FILE* log = json ? stderr : stdout;  // keep stdout pure JSON with --json
  std::vector<int64_t> sizes = {1, 8, 64, 256, 1024, 4096, 16384};
  if (quick) sizes = {1, 64, 4096};
  if (!only_t.empty()) sizes = only_t;
  // Every fused kernel variant, spot-checked and timed at every T (the default choice, kAuto, is
  // fused_us / unfused_us). tma = the bulk-copy pipeline with its defaults; sN N stages; plan task
  // plans; il interleaved tile order; t64 64-task tiles.
  struct Variant {
    const char* name;
    ProducerCudaOptions opt;
  };
  const auto tma_variant = [](const char* name, int stages, bool plan = false,
                              bool interleave = false, int tile = 0) {
    Variant v;
    v.name = name;
    v.opt.kernel = ProducerCudaKernel::kTmaPipeline;
    v.opt.tma_stages = stages;
    v.opt.tma_task_plan = plan ? 1 : -1;
    v.opt.tma_interleave = interleave ? 1 : -1;
    v.opt.tma_tile_tasks = tile;
    v.opt.tma_tail = -1;  // explicit, whatever the defaults
    return v;
  };
  std::vector<Variant> variants(2);
  variants[0].name = "per_batch";
  variants[0].opt.kernel = ProducerCudaKernel::kPerBatch;
  variants[1].name = "persistent";
  variants[1].opt.kernel = ProducerCudaKernel::kPersistent;
  Variant defaults;  // what kAuto runs from 2^17 tasks on
  defaults.name = "tma";
  defaults.opt.kernel = ProducerCudaKernel::kTmaPipeline;
  variants.push_back(defaults);
  variants.push_back(tma_variant("tma_s3", 3));
  variants.push_back(tma_variant("tma_share", 2));
  variants.push_back(tma_variant("tma_il", 2, false, true));
  variants.push_back(tma_variant("tma_plan", 2, true));
  variants.push_back(tma_variant("tma_plan_il", 2, true, true));
  // Selectable with --only (not in the full table):
  std::vector<Variant> extra;
  extra.push_back(tma_variant("tma_plan_s3", 3, true));
  extra.push_back(tma_variant("tma_t64_s4", 4, false, false, 64));
  extra.push_back(tma_variant("tma_il_t64_s4", 4, false, true, 64));
  extra.push_back(tma_variant("tma_plan_il_t64_s4", 4, true, true, 64));
  extra.push_back(tma_variant("tma_plan_il_t64_s3", 3, true, true, 64));
  extra.push_back(tma_variant("tma_plan_t64_s4", 4, true, false, 64));
  // The defaults with other tail blocks (ProducerCudaOptions::tma_tail; by default the last
  // round, one 64-task tile per tail block with 128-task tiles, two with 64): tail_rR_xN_tS = the
  // last R rounds to tail blocks of N tiles of S tasks, at every tile size; tma_notail: no tail
  // blocks; tma_mB_sN: B blocks per SM (tma_blocks_per_sm), N stages, 64-task tiles (the default
  // below 2^19 tasks: 4 blocks, 3 stages; tma_m3_s4 the session-11 default).
  const auto tail_variant = [](const char* name, int rounds, int tiles, int tile_tasks) {
    Variant v;
    v.name = name;
    v.opt.kernel = ProducerCudaKernel::kTmaPipeline;
    v.opt.tma_tail = 1;
    v.opt.tma_tail_rounds = rounds;
    v.opt.tma_tail_tiles = tiles;
    v.opt.tma_tail_tile_tasks = tile_tasks;
    return v;
  };
  extra.push_back(tail_variant("tail_r1_x1_t64", 1, 1, 64));
  extra.push_back(tail_variant("tail_r1_x2_t64", 1, 2, 64));
  extra.push_back(tail_variant("tail_r2_x2_t64", 2, 2, 64));
  extra.push_back(tail_variant("tail_r1_x4_t32", 1, 4, 32));
  const auto knob_variant = [&](const char* name, int tail, int per_sm, int stages) {
    Variant v = defaults;
    v.name = name;
    v.opt.tma_tail = tail;
    v.opt.tma_blocks_per_sm = per_sm;
    v.opt.tma_stages = stages;
    if (per_sm != 0) v.opt.tma_tile_tasks = 64;
    return v;
  };
  extra.push_back(knob_variant("tma_notail", -1, 0, 0));
  extra.push_back(knob_variant("tma_m4_s3", 0, 4, 3));
  extra.push_back(knob_variant("tma_m4_s2", 0, 4, 2));
  extra.push_back(knob_variant("tma_m3_s4", 0, 3, 4));
  const ProducerCudaOptions tma = variants[2].opt;
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  if (!only.empty()) {  // listed variants: profiling (M3_BENCH_PROFILE=1: one launch each) or A/B
    std::vector<Variant> chosen;
    for (const std::string& name : only) {
      bool found = false;
      if (name == "auto") {
        Variant v;
        v.name = "auto";
        chosen.push_back(v);
        found = true;
      }
      for (const std::vector<Variant>* list : {&variants, &extra}) {
        for (const Variant& v : *list) {
          if (name == v.name) {
            chosen.push_back(v);
            found = true;
          }
        }
      }
      if (!found) {
        std::fprintf(stderr, "unknown variant %s\n", name.c_str());
        return 2;
      }
    }
    bool pass = true;
    CleanColdTimer timer;
    std::vector<bench::Row> rows;
    for (const int64_t t : sizes) {
      Case c;
      build(c, t);
      for (const Variant& v : chosen) {
        reset_outputs(c, stream);
        run_or_die(c.params[0], stream, v.opt);
        sync_or_die(stream, v.name);
        pass &= spot_check(c, v.name, log);
      }
      const double bf = bytes_moved(c, 0);
      for (const Variant& v : chosen) {
        const double us =
            timer.time([&](cudaStream_t s) { run_or_die(c.params[0], s, v.opt); }, stream, t <= 256)
                .median_us;
        bench::Row r;
        r.add("T", std::to_string(t));
        r.add("variant", v.name);
        r.add("fused_us", us, 2);
        r.add("fused_pct_copy", pct_copy(bf, us), 1);
        if (!profile_mode()) {  // one launch per variant under a profiler
          const double b2b = time_back_to_back(c, {0}, v.opt, stream, v.name, log, pass);
          r.add("b2b_us", b2b, 2);
          r.add("b2b_pct_copy", pct_copy(bf, b2b), 1);
        }
        rows.push_back(r);
      }
    }
    bench::print_rows("producer, listed variants (TP1: n_q 64, n_kv 4; cold L2)", rows, json);
    std::fprintf(log, "spot checks: %s\n", pass ? "PASS" : "FAIL");
    cudaStreamDestroy(stream);
    return pass ? 0 : 1;
  }

  std::vector<bench::Row> rows;
  bool all_pass = true;
  CleanColdTimer timer;
  for (const int64_t t : sizes) {
    Case c;
    build(c, t);
    const auto reset = [&] {
      check_cuda(cudaMemsetAsync(c.d_pool.get(), 0, static_cast<size_t>(c.pool_bytes), stream),
                 "reset");
      check_cuda(cudaMemsetAsync(c.d_q.get(), 0, static_cast<size_t>(t) * kNq * kHeadDim, stream),
                 "reset");
      check_cuda(cudaMemsetAsync(c.d_iq.get(), 0, static_cast<size_t>(t) * kNkv * kHeadDim, stream),
                 "reset");
    };
    // Spot checks: fused, then the unfused pair over the same (reset) outputs, on the default
    // choice and on the bulk-copy kernel; then every fused variant.
    run_or_die(c.params[0], stream);
    sync_or_die(stream, "fused run");
    all_pass &= spot_check(c, "fused", log);
    for (const ProducerCudaOptions* o : {static_cast<const ProducerCudaOptions*>(nullptr), &tma}) {
      reset();
      run_or_die(c.params[1], stream, o ? *o : ProducerCudaOptions{});
      run_or_die(c.params[2], stream, o ? *o : ProducerCudaOptions{});
      sync_or_die(stream, "unfused run");
      all_pass &= spot_check(c, o ? "main + index (tma)" : "main + index", log);
    }
    for (const Variant& v : variants) {
      reset();
      run_or_die(c.params[0], stream, v.opt);
      sync_or_die(stream, v.name);
      all_pass &= spot_check(c, (std::string("fused ") + v.name).c_str(), log);
    }

    const auto fused = [&](cudaStream_t s) { run_or_die(c.params[0], s); };
    const auto unfused = [&](cudaStream_t s) {
      run_or_die(c.params[1], s);
      run_or_die(c.params[2], s);
    };
    const bool graph = t <= 256;
    const bench::Timing tf = timer.time(fused, stream, graph);
    const bench::Timing tu = timer.time(unfused, stream, graph);
    const bench::Timing tf_memset =
        graph ? bench::time_graph_cold(fused, stream) : bench::time_cold(fused, stream);
    std::vector<double> tv;
    for (const Variant& v : variants)
      tv.push_back(
          timer.time([&](cudaStream_t s) { run_or_die(c.params[0], s, v.opt); }, stream, graph)
              .median_us);
    const double tu_tma = timer
                              .time(
                                  [&](cudaStream_t s) {
                                    run_or_die(c.params[1], s, tma);
                                    run_or_die(c.params[2], s, tma);
                                  },
                                  stream, graph)
                              .median_us;
    const double bf = bytes_moved(c, 0), bu = bytes_moved(c, 1) + bytes_moved(c, 2);
    const double gbs_f = bf / (tf.median_us * 1e3), gbs_u = bu / (tu.median_us * 1e3);
    bench::Row r;
    r.add("T", std::to_string(t));
    r.add("timing", graph ? "graph" : "eager");
    r.add("fused_us", tf.median_us, 2);
    r.add("unfused_us", tu.median_us, 2);
    r.add("fused_MB", bf / 1e6, 3);
    r.add("fused_GBs", gbs_f, 0);
    r.add("fused_pct_copy", 100.0 * gbs_f / bench::kCopyBandwidthGBs, 1);
    r.add("unfused_GBs", gbs_u, 0);
    r.add("unfused_pct_copy", 100.0 * gbs_u / bench::kCopyBandwidthGBs, 1);
    r.add("unfused_over_fused", tu.median_us / tf.median_us, 3);
    if (!profile_mode()) {
      const double b2b_f = time_back_to_back(c, {0}, {}, stream, "fused", log, all_pass);
      const double b2b_u = time_back_to_back(c, {1, 2}, {}, stream, "main + index", log, all_pass);
      r.add("fused_b2b_us", b2b_f, 2);
      r.add("unfused_b2b_us", b2b_u, 2);
      r.add("fused_b2b_pct_copy", pct_copy(bf, b2b_f), 1);
      r.add("unfused_b2b_pct_copy", pct_copy(bu, b2b_u), 1);
      r.add("unfused_over_fused_b2b", b2b_u / b2b_f, 3);
    }
    r.add("fused_min_us", tf.min_us, 2);
    r.add("fused_p90_us", tf.p90_us, 2);
    r.add("fused_us_memset_flush", tf_memset.median_us, 2);
    for (size_t i = 0; i < variants.size(); ++i) {
      r.add(std::string(variants[i].name) + "_us", tv[i], 2);
      r.add(std::string(variants[i].name) + "_pct", pct_copy(bf, tv[i]), 1);
    }
    r.add("unfused_tma_us", tu_tma, 2);
    r.add("unfused_tma_pct", pct_copy(bu, tu_tma), 1);
    r.add("unfused_tma_over_tma", tu_tma / tv[2], 3);
    rows.push_back(r);
  }
  bench::print_rows("producer (TP1: n_q 64, n_kv 4; cold L2)", rows, json);
  std::fprintf(log, "spot checks: %s\n", all_pass ? "PASS" : "FAIL");
  cudaStreamDestroy(stream);
  return all_pass ? 0 : 1;
}
