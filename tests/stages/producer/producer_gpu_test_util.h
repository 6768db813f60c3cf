// Shared helpers of the producer GPU tests (producer_gpu_test.cu: against the CPU twin;
// producer_graph_gpu_test.cu: graph replays and the kernel variants against each other).
//
// Every run starts from poisoned outputs and a pool filled with random bytes; afterwards each byte
// of the pool is classified from the inputs alone (independently of both implementations):
//   untouched          must equal its initial value on the GPU and on the CPU (guards, other
//                      layers, unwritten rows, pages of skipped slots);
//   K / index-K rows   GPU within one E4M3 step of the CPU twin (the twin sums squares in order,
//                      the kernel as a tree and uses rsqrtf and FMA: a value on a rounding
//                      boundary may land one step away; NaN never passes);
//   V rows             byte-identical (no arithmetic before the one rounding).
// Q / index-Q are within one step, and exactly 0x7F for a token whose position is out of range.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "core/rope.h"
#include "m3attn/config.h"
#include "stages/producer/producer.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn::producer_gpu_test {

namespace mt = m3attn::testing;

inline constexpr int64_t kTile = int64_t{kPageSize} * kHeadDim;  // one (page, plane, head) tile
inline constexpr int64_t kPoolGuard = 4096;  // bytes before, between, after caches
inline constexpr int64_t kOutGuard = 256;    // bytes around the compact outputs
inline constexpr uint8_t kOutPoison = 0xA5;
inline constexpr double kTheta = 5e6;

struct Geometry {
  int n_q;
  int n_kv;
};
inline const Geometry kGeometries[] = {{64, 4}, {32, 2}, {16, 1}, {8, 1}};
inline const ProducerMode kModes[] = {ProducerMode::kFused, ProducerMode::kMain,
                                      ProducerMode::kIndex};

// Kernel choices: the bulk-copy pipeline with `stages` (0 = default), `blocks` (0 = a full wave),
// task plans and the interleaved tile order on or off, `tile` tasks per tile (0 = default);
// kKernelChoices are the ones every twin test runs: the default choice (kAuto: per-batch, or from
// 2^17 tasks the bulk-copy kernel with its defaults), the bulk-copy kernel with 3 stages, no
// plans, equal shares; with task plans, the interleaved order, 64-task tiles and 4 stages; with
// task plans, equal shares, 128-task tiles and 2 stages; and with tail blocks (tail_options).
inline ProducerCudaOptions tma_options(int stages = 0, int blocks = 0, bool plan = false,
                                       bool interleave = false, int tile = 0) {
  ProducerCudaOptions o;
  o.kernel = ProducerCudaKernel::kTmaPipeline;
  o.tma_stages = stages;
  o.persistent_blocks = blocks;
  o.tma_task_plan = plan ? 1 : -1;
  o.tma_interleave = interleave ? 1 : -1;
  o.tma_tile_tasks = tile;
  o.tma_tail = -1;  // explicit, whatever the defaults
  return o;
}
// The bulk-copy kernel's defaults (plans, interleaved order, tile and stages by size) with tail
// blocks: the last `rounds` rounds to tail blocks of `tiles` tiles of `tile_tasks` tasks (0: the
// defaults) on a persistent grid of `blocks` (0 = a full wave), with or without the bank-swapped
// shared-memory load order.
inline ProducerCudaOptions tail_options(int rounds = 0, int tiles = 0, int tile_tasks = 0,
                                        int blocks = 0) {
  ProducerCudaOptions o;
  o.kernel = ProducerCudaKernel::kTmaPipeline;
  o.persistent_blocks = blocks;
  o.tma_tail = 1;
  o.tma_tail_rounds = rounds;
  o.tma_tail_tiles = tiles;
  o.tma_tail_tile_tasks = tile_tasks;
  return o;
}
// The same choice launched with programmatic dependent launch (same bytes: the kernels wait for
// the preceding grid before touching memory).
inline ProducerCudaOptions programmatic(ProducerCudaOptions o) {
  o.programmatic_launch = true;
  return o;
}
inline const ProducerCudaOptions kKernelChoices[] = {ProducerCudaOptions{},
                                                     tma_options(3, 0),
                                                     tma_options(4, 0, true, true, 64),
                                                     tma_options(2, 0, true, false, 128),
                                                     tail_options(1, 2, 32, 0),
                                                     programmatic(ProducerCudaOptions{}),
                                                     programmatic(tma_options(3, 0))};
inline std::string choice_name(const ProducerCudaOptions& o) {
  std::ostringstream os;
  os << producer_cuda_kernel_name(o.kernel);
  if (o.kernel == ProducerCudaKernel::kTmaPipeline)
    os << " stages " << o.tma_stages << (o.tma_task_plan > 0 ? " plan" : "")
       << (o.tma_interleave > 0 ? " interleaved" : "") << " tile " << o.tma_tile_tasks;
  if (o.tma_tail > 0)
    os << " tail rounds " << o.tma_tail_rounds << " tiles " << o.tma_tail_tiles << " of "
       << o.tma_tail_tile_tasks;
  if (o.persistent_blocks) os << " blocks " << o.persistent_blocks;
  if (o.programmatic_launch) os << " programmatic";
  return os.str();
}

inline bool uses_main(ProducerMode m) { return m != ProducerMode::kIndex; }
inline bool uses_index(ProducerMode m) { return m != ProducerMode::kMain; }

// ---------------------------------------------------------------------------------------------
// Pool layouts: one byte buffer holding the main cache and the index cache.

struct Layout {
  std::string name;
  int64_t num_pages = 0;
  int64_t bytes = 0;
  int64_t kv_base = 0, kv_page = 0, kv_plane = 0;  // byte offsets / strides
  int64_t ic_base = 0, ic_page = 0;
};

// Main cache then index cache in separate regions; page strides `mult` x the dense page, the
// plane stride padded by `plane_pad` bytes, bases shifted by `skew` bytes (multiples of 4).
inline Layout separate_layout(int n_kv, int64_t pages, int64_t mult, int64_t plane_pad,
                              int64_t skew) {
  Layout l;
  std::ostringstream os;
  os << "separate x" << mult << " plane_pad " << plane_pad << " skew " << skew;
  l.name = os.str();
  l.num_pages = pages;
  l.kv_plane = n_kv * kTile + plane_pad;
  l.kv_page = (l.kv_plane + n_kv * kTile) * mult;
  l.kv_base = kPoolGuard + skew;
  l.ic_page = kTile * mult;
  l.ic_base = l.kv_base + pages * l.kv_page + kPoolGuard;
  l.bytes = l.ic_base + pages * l.ic_page + kPoolGuard;
  return l;
}

// A pool that coalesces `layers` layers in one page slot: per layer [K plane | V plane | index
// tile], this cache pair is layer `layer`.
inline Layout interleaved_layout(int n_kv, int64_t pages, int layers, int layer,
                                 int64_t plane_pad) {
  Layout l;
  std::ostringstream os;
  os << "interleaved " << layers << " layers (layer " << layer << ") plane_pad " << plane_pad;
  l.name = os.str();
  l.num_pages = pages;
  l.kv_plane = n_kv * kTile + plane_pad;
  const int64_t per_layer = 2 * l.kv_plane + kTile;
  l.kv_page = l.ic_page = layers * per_layer;
  l.kv_base = kPoolGuard + layer * per_layer;
  l.ic_base = l.kv_base + 2 * l.kv_plane;
  l.bytes = kPoolGuard + pages * l.kv_page + kPoolGuard;
  return l;
}

// ---------------------------------------------------------------------------------------------
// Inputs (fused packed layout; the per-mode packed rows are column slices of it).

struct Inputs {
  int n_q = 0, n_kv = 0;
  int64_t t = 0;
  int64_t max_pos = 0;
  int64_t fused_stride = 0;
  Tensor fused;  // bf16 [T, fused_stride]
  Tensor positions;
  Tensor slots;  // [T + 3]: the tail is valid but must never be read
  Tensor rope;
  Tensor norms[4];  // q, k, index-q, index-k

  int64_t fused_width() const { return (int64_t{n_q} + 3 * n_kv + 1) * kHeadDim; }
  int32_t pos(int64_t i) const { return positions.ptr<int32_t>()[i]; }
  int32_t slot(int64_t i) const { return slots.ptr<int32_t>()[i]; }
  bool pos_ok(int64_t i) const { return pos(i) >= 0 && pos(i) < max_pos; }
  bool writes_cache(int64_t i, int64_t num_pages) const {
    return pos_ok(i) && slot(i) >= 0 && slot(i) / kPageSize < num_pages;
  }
};

inline uint16_t random_bf16_bits(mt::Rng& rng) {
  return static_cast<uint16_t>(rng.integer(0, 0xffff));
}

// Fills packed rows with per-head scales (tiny, ordinary, large, saturating for V) plus garbage in
// the row padding (any bit pattern, NaN included: the kernel must never read it).
inline void fill_packed(Tensor& packed, int64_t t, int64_t width, int64_t stride, mt::Rng& rng) {
  static const float kScales[] = {1.0f, 1.0f, 1.0f, 1e-3f, 8.0f, 300.0f};
  uint16_t* p = packed.ptr<uint16_t>();
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t h = 0; h < width / kHeadDim; ++h) {
      const float scale = kScales[rng.integer(0, 5)];
      for (int64_t d = 0; d < kHeadDim; ++d)
        p[i * stride + h * kHeadDim + d] = float_to_bf16(scale * rng.normal());
    }
    for (int64_t c = width; c < stride; ++c) p[i * stride + c] = random_bf16_bits(rng);
  }
  if (t > 2) {  // one all-zero head: ss = 0, y = 0
    for (int64_t d = 0; d < kHeadDim; ++d) p[(t / 2) * stride + d] = 0;
  }
}

// (Re)fills the per-token data of `in` (packed rows, positions, slots) in place; shapes and
// strides stay, so device copies can be refreshed for CUDA-graph replays.
inline void fill_token_data(Inputs& in, int64_t num_pages, mt::Rng& rng) {
  const int64_t t = in.t;
  fill_packed(in.fused, t, in.fused_width(), in.fused_stride, rng);

  int32_t* pos = in.positions.ptr<int32_t>();
  const int32_t max_pos = static_cast<int32_t>(in.max_pos);
  const int32_t bad_pos[] = {-1, max_pos, max_pos + 7, INT32_MIN, INT32_MAX};
  for (int64_t i = 0; i < t; ++i) {
    pos[i] = static_cast<int32_t>(rng.integer(0, in.max_pos - 1));
    if (rng.integer(0, 49) == 0) pos[i] = bad_pos[rng.integer(0, 4)];
  }

  // Distinct valid slots, then some -1 and some past the last page.
  const int64_t capacity = num_pages * kPageSize;
  ASSERT_GE(capacity, t + 3);
  std::vector<int32_t> perm(static_cast<size_t>(capacity));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.engine());
  int32_t* slot = in.slots.ptr<int32_t>();
  const int32_t bad_slot[] = {-1, -7, static_cast<int32_t>(capacity),
                              static_cast<int32_t>(capacity) + 77, INT32_MAX};
  for (int64_t i = 0; i < t + 3; ++i) {
    slot[i] = perm[static_cast<size_t>(i)];
    if (i < t && rng.integer(0, 15) == 0) slot[i] = bad_slot[rng.integer(0, 4)];
  }
  if (t >= 16) {  // every special case at least once
    slot[3] = -1;
    slot[5] = static_cast<int32_t>(capacity);
    pos[7] = -1;
    pos[9] = max_pos;
    pos[11] = max_pos - 1;
    pos[12] = 0;
  }
}

inline Inputs make_inputs(int n_q, int n_kv, int64_t t, int64_t num_pages, mt::Rng& rng) {
  Inputs in;
  in.n_q = n_q;
  in.n_kv = n_kv;
  in.t = t;
  in.max_pos = 5000;
  in.fused_stride = in.fused_width() + 8 * rng.integer(0, 3);
  in.fused = Tensor(DType::kBF16, {t, in.fused_stride});
  in.positions = Tensor(DType::kI32, {t});
  in.slots = Tensor(DType::kI32, {t + 3});
  fill_token_data(in, num_pages, rng);

  Result<Tensor> rope = make_rope_table(in.max_pos, kTheta);
  EXPECT_TRUE(rope.ok()) << rope.status().to_string();
  in.rope = std::move(rope).value();
  for (Tensor& w : in.norms) {
    w = Tensor(DType::kBF16, {kHeadDim});
    mt::fill_bf16_normal(w, rng, 0.5f);
  }
  return in;
}

// Packed rows of one mode: columns [col0, col0 + width) of the fused rows, own row stride.
struct Packed {
  Tensor data;
  int64_t stride = 0;
  int64_t width = 0;
};

inline int64_t packed_col0(const Inputs& in, ProducerMode mode) {
  return mode == ProducerMode::kIndex ? (int64_t{in.n_q} + 2 * in.n_kv) * kHeadDim : 0;
}

// Copies the mode's columns of the fused rows into `p` (padding gets garbage).
inline void refill_packed(Packed& p, const Inputs& in, ProducerMode mode, mt::Rng& rng) {
  const int64_t col0 = packed_col0(in, mode);
  const uint16_t* src = in.fused.ptr<uint16_t>();
  uint16_t* dst = p.data.ptr<uint16_t>();
  for (int64_t i = 0; i < in.t; ++i) {
    std::memcpy(dst + i * p.stride, src + i * in.fused_stride + col0,
                static_cast<size_t>(p.width) * 2);
    for (int64_t c = p.width; c < p.stride; ++c) dst[i * p.stride + c] = random_bf16_bits(rng);
  }
}

inline Packed packed_for(const Inputs& in, ProducerMode mode, mt::Rng& rng) {
  Packed p;
  p.width = producer_packed_width(mode, in.n_q, in.n_kv);
  p.stride = p.width + 8 * rng.integer(0, 2);
  p.data = Tensor(DType::kBF16, {in.t, p.stride});
  refill_packed(p, in, mode, rng);
  return p;
}

// ---------------------------------------------------------------------------------------------
// Outputs: compact Q / index-Q with guards, and the pool.

struct Outputs {
  Tensor q, iq, pool;  // flat bytes
  Outputs clone() const { return {q.clone(), iq.clone(), pool.clone()}; }
};

inline Outputs make_outputs(const Inputs& in, const Layout& lay, mt::Rng& rng) {
  Outputs o;
  o.q = Tensor(DType::kE4M3, {in.t * in.n_q * kHeadDim + 2 * kOutGuard});
  o.iq = Tensor(DType::kE4M3, {in.t * in.n_kv * kHeadDim + 2 * kOutGuard});
  o.q.fill_bytes(kOutPoison);
  o.iq.fill_bytes(kOutPoison);
  o.pool = Tensor(DType::kE4M3, {lay.bytes});
  uint8_t* p = o.pool.ptr<uint8_t>();
  uint64_t x = rng.engine()();
  for (int64_t i = 0; i < lay.bytes; ++i) {  // cheap random bytes (xorshift)
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<uint8_t>(x >> 24);
  }
  return o;
}

inline ProducerParams make_params(ProducerMode mode, const Inputs& in, const Packed& packed,
                                  Outputs& out, const Layout& lay) {
  ProducerParams p;
  p.mode = mode;
  p.n_q = uses_main(mode) ? in.n_q : 0;
  p.n_kv = in.n_kv;
  p.eps = 1e-6f;
  p.num_tokens = in.t;
  p.packed = TensorView::strided(const_cast<void*>(packed.data.data()), DType::kBF16,
                                 {in.t, packed.width}, {packed.stride, 1});
  p.positions = in.positions.view();
  p.slots = in.slots.view();
  p.rope = in.rope.view();
  uint8_t* pool = out.pool.ptr<uint8_t>();
  if (uses_main(mode)) {
    p.q_norm = in.norms[0].view();
    p.k_norm = in.norms[1].view();
    p.q_out = TensorView::contiguous(out.q.ptr<uint8_t>() + kOutGuard, DType::kE4M3,
                                     {in.t, in.n_q, kHeadDim});
    p.kv_cache =
        make_kv_cache_view(pool + lay.kv_base, lay.num_pages, in.n_kv, lay.kv_page, lay.kv_plane);
  }
  if (uses_index(mode)) {
    p.iq_norm = in.norms[2].view();
    p.ik_norm = in.norms[3].view();
    p.iq_out = TensorView::contiguous(out.iq.ptr<uint8_t>() + kOutGuard, DType::kE4M3,
                                      {in.t, in.n_kv, kHeadDim});
    p.index_cache = make_index_cache_view(pool + lay.ic_base, lay.num_pages, lay.ic_page);
  }
  return p;
}
// ---------------------------------------------------------------------------------------------
// Device mirrors: every host tensor a params struct points into gets a device copy; host views are
// rebased onto the copies by address, so one ProducerParams builder serves the CPU and the GPU.

class Mirror {
 public:
  void add(const Tensor& host) {
    Entry e{&host, mt::DeviceBuffer(static_cast<size_t>(host.nbytes()))};
    e.dev.upload(host.data(), static_cast<size_t>(host.nbytes()));
    entries_.push_back(std::move(e));
  }
  void add_all(std::initializer_list<const Tensor*> hosts) {
    for (const Tensor* t : hosts) add(*t);
  }
  // Host -> device (after the host tensor changed) and device -> the same host tensor.
  void upload(const Tensor& host) {
    find(host).dev.upload(host.data(), static_cast<size_t>(host.nbytes()));
  }
  void download(Tensor& host) {
    find(host).dev.download(host.data(), static_cast<size_t>(host.nbytes()));
  }
  TensorView device_view(const TensorView& v) const {
    if (v.data == nullptr) {  // an empty tensor (T == 0) or an unused view
      TensorView d = v;
      if (v.ndim > 0) d.device = Device::cuda(0);
      return d;
    }
    const auto addr = reinterpret_cast<uintptr_t>(v.data);
    for (const Entry& e : entries_) {
      const auto lo = reinterpret_cast<uintptr_t>(e.host->data());
      if (e.host->nbytes() > 0 && addr >= lo &&
          addr < lo + static_cast<uintptr_t>(e.host->nbytes()))
        return mt::device_view_like(v, static_cast<char*>(e.dev.data()) + (addr - lo));
    }
    ADD_FAILURE() << "a view is not backed by a mirrored tensor";
    return v;
  }
  ProducerParams device_params(const ProducerParams& h) const {
    ProducerParams d = h;
    for (TensorView* v : {&d.packed, &d.positions, &d.slots, &d.rope, &d.q_norm, &d.k_norm,
                          &d.iq_norm, &d.ik_norm, &d.q_out, &d.iq_out, &d.kv_cache, &d.index_cache})
      *v = device_view(*v);
    return d;
  }

 private:
  struct Entry {
    const Tensor* host;
    mt::DeviceBuffer dev;
  };
  Entry& find(const Tensor& host) {
    for (Entry& e : entries_)
      if (e.host == &host) return e;
    ADD_FAILURE() << "tensor not mirrored";
    return entries_.front();
  }
  std::vector<Entry> entries_;
};

inline void mirror_inputs(Mirror& m, const Inputs& in) {
  m.add_all(
      {&in.positions, &in.slots, &in.rope, &in.norms[0], &in.norms[1], &in.norms[2], &in.norms[3]});
}
inline void mirror_outputs(Mirror& m, const Outputs& out) {
  m.add_all({&out.q, &out.iq, &out.pool});
}
inline void download_outputs(Mirror& m, Outputs& out) {
  m.download(out.q);
  m.download(out.iq);
  m.download(out.pool);
}

// Waits for the work on `stream` (nullptr: the legacy stream, then the whole device) for at most
// 60 s: a kernel that never finishes (a pipeline deadlock) ends the test binary with a message
// instead of hanging the GPU round.
inline void wait_or_exit(const char* what, cudaStream_t stream = nullptr) {
  cudaEvent_t done;
  M3_CUDA_TEST_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  M3_CUDA_TEST_CHECK(cudaEventRecord(done, stream));
  for (int i = 0; i < 60000; ++i) {
    const cudaError_t e = cudaEventQuery(done);
    if (e == cudaSuccess) {
      cudaEventDestroy(done);
      M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
      return;
    }
    if (e != cudaErrorNotReady) {
      ADD_FAILURE() << what << ": " << cudaGetErrorString(e);
      cudaEventDestroy(done);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::fprintf(stderr, "%s: device work still running after 60 s (deadlock?): FAIL\n", what);
  std::fflush(stderr);
  std::_Exit(3);
}

// Runs `runs` (host params whose views point into `packed`, the inputs and `out`) on the GPU in
// order, starting from the current contents of `out`, and downloads the results into `out`.
inline void run_on_gpu(const std::vector<ProducerParams>& runs, const Inputs& in,
                       std::initializer_list<const Packed*> packed, Outputs& out,
                       const ProducerCudaOptions& options = {}) {
  Mirror m;
  mirror_inputs(m, in);
  for (const Packed* p : packed) m.add(p->data);
  mirror_outputs(m, out);
  for (const ProducerParams& r : runs) {
    const Status s = run_producer_cuda(m.device_params(r), nullptr, options);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  wait_or_exit("run_on_gpu");
  download_outputs(m, out);
}

// ---------------------------------------------------------------------------------------------
// Comparison.

enum ByteClass : uint8_t { kUntouched = 0, kRounded = 1, kExact = 2 };

// Which pool bytes the inputs say are written (K / index-K rounded, V exact); from the inputs
// alone, independently of both implementations.
inline std::vector<uint8_t> classify_pool(const Inputs& in, bool main, bool index,
                                          const Layout& lay, int64_t* rows) {
  std::vector<uint8_t> cls(static_cast<size_t>(lay.bytes), kUntouched);
  *rows = 0;
  auto mark = [&](int64_t off, ByteClass c) {
    std::fill(cls.begin() + off, cls.begin() + off + kHeadDim, c);
    ++*rows;
  };
  for (int64_t i = 0; i < in.t; ++i) {
    if (!in.writes_cache(i, lay.num_pages)) continue;
    const int64_t page = in.slot(i) / kPageSize, row = in.slot(i) % kPageSize;
    if (main) {
      for (int h = 0; h < in.n_kv; ++h) {
        const int64_t k = lay.kv_base + page * lay.kv_page + h * kTile + row * kHeadDim;
        mark(k, kRounded);
        mark(k + lay.kv_plane, kExact);
      }
    }
    if (index) mark(lay.ic_base + page * lay.ic_page + row * kHeadDim, kRounded);
  }
  return cls;
}

inline std::string describe(const char* what, int64_t off, uint8_t want, uint8_t got) {
  std::ostringstream os;
  os << "  " << what << " byte " << off << ": want 0x" << std::hex << int{want} << " ("
     << e4m3_to_float(want) << ") got 0x" << int{got} << " (" << e4m3_to_float(got) << ")"
     << std::dec << "\n";
  return os.str();
}

struct Mismatches {
  int64_t count = 0;
  std::string report;
  void add(const std::string& line) {
    if (count++ < 10) report += line;
  }
};

// Compact output [T, heads, 128] inside guards: guards keep the poison, rows of out-of-range
// positions are all 0x7F in both, other bytes within one step (or equal when `exact`).
inline void compare_compact(const char* what, const Inputs& in, int heads, const Tensor& init,
                            const Tensor& want, const Tensor& got, bool written, bool exact,
                            Mismatches& mm) {
  const uint8_t* i0 = init.ptr<uint8_t>();
  const uint8_t* w = want.ptr<uint8_t>();
  const uint8_t* g = got.ptr<uint8_t>();
  const int64_t body = in.t * heads * kHeadDim;
  for (int64_t b = 0; b < body + 2 * kOutGuard; ++b) {
    const int64_t e = b - kOutGuard;  // element index inside the body
    if (e < 0 || e >= body || !written) {
      if (g[b] != i0[b]) mm.add(describe(what, e, i0[b], g[b]));
      if (w[b] != i0[b]) mm.add(describe(what, e, i0[b], w[b]));
      continue;
    }
    const int64_t token = e / (int64_t{heads} * kHeadDim);
    if (!in.pos_ok(token)) {
      if (g[b] != 0x7f || w[b] != 0x7f) mm.add(describe(what, e, 0x7f, g[b] != 0x7f ? g[b] : w[b]));
    } else if (exact ? g[b] != w[b] : !e4m3_within_one_step(w[b], g[b])) {
      mm.add(describe(what, e, w[b], g[b]));
    }
  }
}

// Expects `got` to match `want` (both run from `init`) for a run that wrote the main outputs
// (`main`) and / or the index outputs (`index`).
inline void expect_match(const Inputs& in, bool main, bool index, const Layout& lay,
                         const Outputs& init, const Outputs& want, const Outputs& got, bool exact,
                         const std::string& what) {
  SCOPED_TRACE(what);
  Mismatches q, iq, pool;
  compare_compact("q_out", in, in.n_q, init.q, want.q, got.q, main, exact, q);
  compare_compact("iq_out", in, in.n_kv, init.iq, want.iq, got.iq, index, exact, iq);

  int64_t rows = 0;
  const std::vector<uint8_t> cls = classify_pool(in, main, index, lay, &rows);
  const uint8_t* i0 = init.pool.ptr<uint8_t>();
  const uint8_t* w = want.pool.ptr<uint8_t>();
  const uint8_t* g = got.pool.ptr<uint8_t>();
  int64_t unchanged_rows = 0;
  for (int64_t b = 0; b < lay.bytes; ++b) {
    switch (cls[static_cast<size_t>(b)]) {
      case kUntouched:
        if (g[b] != i0[b]) pool.add(describe("untouched pool (got)", b, i0[b], g[b]));
        if (w[b] != i0[b]) pool.add(describe("untouched pool (want)", b, i0[b], w[b]));
        break;
      case kRounded:
        if (exact ? g[b] != w[b] : !e4m3_within_one_step(w[b], g[b]))
          pool.add(describe("K / index-K row", b, w[b], g[b]));
        break;
      case kExact:
        if (g[b] != w[b]) pool.add(describe("V row", b, w[b], g[b]));
        break;
    }
    // A written row that still holds its random initial bytes was not written.
    if (cls[static_cast<size_t>(b)] != kUntouched && b % kHeadDim == 0 &&
        std::memcmp(g + b, i0 + b, kHeadDim) == 0)
      ++unchanged_rows;
  }
  EXPECT_EQ(q.count, 0) << q.report;
  EXPECT_EQ(iq.count, 0) << iq.report;
  EXPECT_EQ(pool.count, 0) << pool.report;
  EXPECT_EQ(unchanged_rows, 0) << "cache rows the kernel should have written (of " << rows << ")";
}

// Calls fn(opt, mode, packed, init) for every kernel choice and mode, with the mode's packed
// rows and fresh outputs on `lay`.
template <typename Fn>
void for_each_choice_and_mode(const Inputs& in, const Layout& lay, mt::Rng& rng, Fn&& fn) {
  for (const ProducerCudaOptions& opt : kKernelChoices) {
    for (const ProducerMode mode : kModes) {
      SCOPED_TRACE(::testing::Message() << producer_mode_name(mode) << " " << choice_name(opt));
      const Packed packed = packed_for(in, mode, rng);
      const Outputs init = make_outputs(in, lay, rng);
      fn(opt, mode, packed, init);
    }
  }
}

inline int64_t pages_for(int64_t t) { return (t + 3 + kPageSize - 1) / kPageSize + 2; }

// The per-batch kernel's outputs for `mode` from `init`, checked against the CPU twin: the
// reference the other kernels must match byte for byte.
inline Outputs per_batch_reference(ProducerMode mode, const Inputs& in, const Layout& lay,
                                   const Packed& packed, const Outputs& init) {
  ProducerCudaOptions per_batch;
  per_batch.kernel = ProducerCudaKernel::kPerBatch;
  Outputs ref = init.clone(), cpu = init.clone();
  run_on_gpu({make_params(mode, in, packed, ref, lay)}, in, {&packed}, ref, per_batch);
  const Status s = run_producer_cpu(make_params(mode, in, packed, cpu, lay));
  EXPECT_TRUE(s.ok()) << s.to_string();
  expect_match(in, uses_main(mode), uses_index(mode), lay, init, cpu, ref, /*exact=*/false,
               "per-batch vs CPU twin");
  return ref;
}

// One mode against the CPU twin on a fresh pool of the given layout, for every kernel choice (the
// twin runs once).
inline void check_against_twin(ProducerMode mode, const Inputs& in, const Layout& lay,
                               mt::Rng& rng) {
  SCOPED_TRACE(::testing::Message() << producer_mode_name(mode) << " n_q " << in.n_q << " n_kv "
                                    << in.n_kv << " T " << in.t << " " << lay.name);
  const Packed packed = packed_for(in, mode, rng);
  const Outputs init = make_outputs(in, lay, rng);
  Outputs cpu = init.clone();
  const Status s = run_producer_cpu(make_params(mode, in, packed, cpu, lay));
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (const ProducerCudaOptions& opt : kKernelChoices) {
    SCOPED_TRACE(choice_name(opt));
    Outputs gpu = init.clone();
    run_on_gpu({make_params(mode, in, packed, gpu, lay)}, in, {&packed}, gpu, opt);
    expect_match(in, uses_main(mode), uses_index(mode), lay, init, cpu, gpu, /*exact=*/false,
                 "GPU vs CPU twin");
  }
}

}  // namespace m3attn::producer_gpu_test
