// GPU tests of the producer kernel against the CPU twin (SPEC sections 3-4, 8).
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
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "core/rope.h"
#include "m3attn/config.h"
#include "stages/producer/producer.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

namespace mt = m3attn::testing;

constexpr int64_t kTile = int64_t{kPageSize} * kHeadDim;  // one (page, plane, head) tile
constexpr int64_t kPoolGuard = 4096;                      // bytes before, between, after caches
constexpr int64_t kOutGuard = 256;                        // bytes around the compact outputs
constexpr uint8_t kOutPoison = 0xA5;
constexpr double kTheta = 5e6;

struct Geometry {
  int n_q;
  int n_kv;
};
const Geometry kGeometries[] = {{64, 4}, {32, 2}, {16, 1}, {8, 1}};
const ProducerMode kModes[] = {ProducerMode::kFused, ProducerMode::kMain, ProducerMode::kIndex};

bool uses_main(ProducerMode m) { return m != ProducerMode::kIndex; }
bool uses_index(ProducerMode m) { return m != ProducerMode::kMain; }

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
Layout separate_layout(int n_kv, int64_t pages, int64_t mult, int64_t plane_pad, int64_t skew) {
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
Layout interleaved_layout(int n_kv, int64_t pages, int layers, int layer, int64_t plane_pad) {
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

uint16_t random_bf16_bits(mt::Rng& rng) { return static_cast<uint16_t>(rng.integer(0, 0xffff)); }

// Fills packed rows with per-head scales (tiny, ordinary, large, saturating for V) plus garbage in
// the row padding (any bit pattern, NaN included: the kernel must never read it).
void fill_packed(Tensor& packed, int64_t t, int64_t width, int64_t stride, mt::Rng& rng) {
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
void fill_token_data(Inputs& in, int64_t num_pages, mt::Rng& rng) {
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

Inputs make_inputs(int n_q, int n_kv, int64_t t, int64_t num_pages, mt::Rng& rng) {
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

int64_t packed_col0(const Inputs& in, ProducerMode mode) {
  return mode == ProducerMode::kIndex ? (int64_t{in.n_q} + 2 * in.n_kv) * kHeadDim : 0;
}

// Copies the mode's columns of the fused rows into `p` (padding gets garbage).
void refill_packed(Packed& p, const Inputs& in, ProducerMode mode, mt::Rng& rng) {
  const int64_t col0 = packed_col0(in, mode);
  const uint16_t* src = in.fused.ptr<uint16_t>();
  uint16_t* dst = p.data.ptr<uint16_t>();
  for (int64_t i = 0; i < in.t; ++i) {
    std::memcpy(dst + i * p.stride, src + i * in.fused_stride + col0,
                static_cast<size_t>(p.width) * 2);
    for (int64_t c = p.width; c < p.stride; ++c) dst[i * p.stride + c] = random_bf16_bits(rng);
  }
}

Packed packed_for(const Inputs& in, ProducerMode mode, mt::Rng& rng) {
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

Outputs make_outputs(const Inputs& in, const Layout& lay, mt::Rng& rng) {
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

ProducerParams make_params(ProducerMode mode, const Inputs& in, const Packed& packed, Outputs& out,
                           const Layout& lay) {
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

void mirror_inputs(Mirror& m, const Inputs& in) {
  m.add_all(
      {&in.positions, &in.slots, &in.rope, &in.norms[0], &in.norms[1], &in.norms[2], &in.norms[3]});
}
void mirror_outputs(Mirror& m, const Outputs& out) { m.add_all({&out.q, &out.iq, &out.pool}); }
void download_outputs(Mirror& m, Outputs& out) {
  m.download(out.q);
  m.download(out.iq);
  m.download(out.pool);
}

// Runs `runs` (host params whose views point into `packed`, the inputs and `out`) on the GPU in
// order, starting from the current contents of `out`, and downloads the results into `out`.
void run_on_gpu(const std::vector<ProducerParams>& runs, const Inputs& in,
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
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  download_outputs(m, out);
}

// ---------------------------------------------------------------------------------------------
// Comparison.

enum ByteClass : uint8_t { kUntouched = 0, kRounded = 1, kExact = 2 };

// Which pool bytes the inputs say are written (K / index-K rounded, V exact); from the inputs
// alone, independently of both implementations.
std::vector<uint8_t> classify_pool(const Inputs& in, bool main, bool index, const Layout& lay,
                                   int64_t* rows) {
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

std::string describe(const char* what, int64_t off, uint8_t want, uint8_t got) {
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
void compare_compact(const char* what, const Inputs& in, int heads, const Tensor& init,
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
void expect_match(const Inputs& in, bool main, bool index, const Layout& lay, const Outputs& init,
                  const Outputs& want, const Outputs& got, bool exact, const std::string& what) {
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

int64_t pages_for(int64_t t) { return (t + 3 + kPageSize - 1) / kPageSize + 2; }

// One mode against the CPU twin on a fresh pool of the given layout.
void check_against_twin(ProducerMode mode, const Inputs& in, const Layout& lay, mt::Rng& rng) {
  SCOPED_TRACE(::testing::Message() << producer_mode_name(mode) << " n_q " << in.n_q << " n_kv "
                                    << in.n_kv << " T " << in.t << " " << lay.name);
  const Packed packed = packed_for(in, mode, rng);
  const Outputs init = make_outputs(in, lay, rng);
  Outputs cpu = init.clone();
  const Status s = run_producer_cpu(make_params(mode, in, packed, cpu, lay));
  ASSERT_TRUE(s.ok()) << s.to_string();
  Outputs gpu = init.clone();
  run_on_gpu({make_params(mode, in, packed, gpu, lay)}, in, {&packed}, gpu);
  expect_match(in, uses_main(mode), uses_index(mode), lay, init, cpu, gpu, /*exact=*/false,
               "GPU vs CPU twin");
}

// ---------------------------------------------------------------------------------------------

TEST(ProducerGpu, MatchesCpuTwinEveryModeGeometryAndLength) {
  M3_REQUIRE_GPU();
  for (const Geometry& geo : kGeometries) {
    for (const int64_t t : {0, 1, 16, 129, 4099}) {
      const uint64_t seed = mt::fresh_seed();
      M3_SEED_TRACE(seed);
      mt::Rng rng(seed);
      const Inputs in = make_inputs(geo.n_q, geo.n_kv, t, pages_for(t), rng);
      const Layout lay = separate_layout(geo.n_kv, pages_for(t), 1, 0, 0);
      for (const ProducerMode mode : kModes) check_against_twin(mode, in, lay, rng);
    }
  }
}

TEST(ProducerGpu, StridedPoolsKeepGuardsAndOtherLayers) {
  M3_REQUIRE_GPU();
  for (const Geometry& geo : {Geometry{64, 4}, Geometry{8, 1}}) {
    const int64_t t = 300;
    const int64_t pages = pages_for(t);
    const uint64_t seed = mt::fresh_seed();
    M3_SEED_TRACE(seed);
    mt::Rng rng(seed);
    const Inputs in = make_inputs(geo.n_q, geo.n_kv, t, pages, rng);
    const Layout layouts[] = {
        separate_layout(geo.n_kv, pages, 3, 0, 0),
        // Plane stride padded by 260 bytes and bases 4 bytes off: rows only 4-byte aligned.
        separate_layout(geo.n_kv, pages, 5, 260, 4),
        interleaved_layout(geo.n_kv, pages, 57, 31, 64),
        interleaved_layout(geo.n_kv, pages, 57, 56, 4),
    };
    for (const Layout& lay : layouts)
      for (const ProducerMode mode : kModes) check_against_twin(mode, in, lay, rng);
  }
}

TEST(ProducerGpu, FusedMatchesUnfusedPair) {
  M3_REQUIRE_GPU();
  for (const Geometry& geo : kGeometries) {
    for (const int64_t t : {1, 129, 4099}) {
      const uint64_t seed = mt::fresh_seed();
      M3_SEED_TRACE(seed);
      SCOPED_TRACE(::testing::Message() << "n_q " << geo.n_q << " n_kv " << geo.n_kv << " T " << t);
      mt::Rng rng(seed);
      const Inputs in = make_inputs(geo.n_q, geo.n_kv, t, pages_for(t), rng);
      const Layout lay = separate_layout(geo.n_kv, pages_for(t), 1, 0, 0);
      const Packed fused = packed_for(in, ProducerMode::kFused, rng);
      const Packed main = packed_for(in, ProducerMode::kMain, rng);  // the two GEMM outputs
      const Packed index = packed_for(in, ProducerMode::kIndex, rng);
      const Outputs init = make_outputs(in, lay, rng);

      Outputs one = init.clone();
      run_on_gpu({make_params(ProducerMode::kFused, in, fused, one, lay)}, in, {&fused}, one);
      Outputs two = init.clone();
      run_on_gpu({make_params(ProducerMode::kMain, in, main, two, lay),
                  make_params(ProducerMode::kIndex, in, index, two, lay)},
                 in, {&main, &index}, two);
      expect_match(in, true, true, lay, init, one, two, /*exact=*/false, "fused vs main + index");
    }
  }
}

// Few heads per row and many tokens: the most tokens per batch (index mode with n_kv = 1 has
// H = 2), which the sizes above do not reach. The default choice runs the persistent kernel for
// fused and main (over 528 batches of 96 tasks) and the per-batch kernel for index (188, 282).
TEST(ProducerGpu, LargeBatchFewHeadsPerRow) {
  M3_REQUIRE_GPU();
  for (const Geometry& geo : {Geometry{8, 1}, Geometry{32, 2}}) {
    const int64_t t = 9001;
    const uint64_t seed = mt::fresh_seed();
    M3_SEED_TRACE(seed);
    mt::Rng rng(seed);
    const Inputs in = make_inputs(geo.n_q, geo.n_kv, t, pages_for(t), rng);
    const Layout lay = separate_layout(geo.n_kv, pages_for(t), 1, 0, 0);
    for (const ProducerMode mode : kModes) check_against_twin(mode, in, lay, rng);
  }
}

TEST(ProducerGpu, SkippedSlotsAndBadPositionsWriteNoCache) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const int64_t pages = 3;
  Inputs in = make_inputs(8, 1, 7, pages, rng);
  const int32_t cap = static_cast<int32_t>(pages * kPageSize);
  const int32_t slots[] = {-1, cap, cap + 127, INT32_MAX, 5, 6, -2};
  const int32_t positions[] = {0, 1, 2, 3, -1, static_cast<int32_t>(in.max_pos), 4};
  std::memcpy(in.slots.ptr<int32_t>(), slots, sizeof(slots));
  std::memcpy(in.positions.ptr<int32_t>(), positions, sizeof(positions));
  const Layout lay = separate_layout(1, pages, 1, 0, 0);
  for (const ProducerMode mode : kModes) {
    SCOPED_TRACE(producer_mode_name(mode));
    const Packed packed = packed_for(in, mode, rng);
    const Outputs init = make_outputs(in, lay, rng);
    Outputs gpu = init.clone();
    run_on_gpu({make_params(mode, in, packed, gpu, lay)}, in, {&packed}, gpu);
    EXPECT_EQ(std::memcmp(gpu.pool.data(), init.pool.data(), static_cast<size_t>(lay.bytes)), 0)
        << "no token of this batch may write a cache";
    // Tokens 4 and 5 (bad positions) have NaN Q / index-Q rows; the others are real values.
    const Tensor& out = uses_main(mode) ? gpu.q : gpu.iq;
    const int heads = uses_main(mode) ? in.n_q : in.n_kv;
    for (int64_t i = 0; i < in.t; ++i) {
      const uint8_t* row = out.ptr<uint8_t>() + kOutGuard + i * heads * kHeadDim;
      const int64_t nan = std::count(row, row + heads * kHeadDim, uint8_t{0x7f});
      if (i == 4 || i == 5)
        EXPECT_EQ(nan, heads * kHeadDim) << "token " << i;
      else
        EXPECT_LT(nan, heads * kHeadDim) << "token " << i;
    }
    Outputs cpu = init.clone();
    const Status s = run_producer_cpu(make_params(mode, in, packed, cpu, lay));
    ASSERT_TRUE(s.ok()) << s.to_string();
    expect_match(in, uses_main(mode), uses_index(mode), lay, init, cpu, gpu, false, "vs twin");
  }
}

__global__ void count_bytes_not_equal(const uint4* p, int64_t n16, uint8_t value,
                                      unsigned long long* count) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n16;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = p[i];
    for (const uint32_t w : {v.x, v.y, v.z, v.w})
      for (int k = 0; k < 4; ++k) local += ((w >> (8 * k)) & 0xffu) != value;
  }
  if (local) atomicAdd(count, local);
}

// Page 65536 of a pool whose page stride is 98,304 bytes (two layers interleaved) sits past
// 2^32 bytes: 32-bit address arithmetic would write elsewhere. About 6.4 GB of device memory.
TEST(ProducerGpu, Page65536AddressedIn64Bits) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const int n_q = 8, n_kv = 1;
  const int64_t pages = 65540;
  const Layout big = interleaved_layout(n_kv, pages, 2, 1, 0);
  ASSERT_GT(65536 * big.kv_page, int64_t{1} << 32);
  constexpr uint8_t kPoison = 0x5A;

  Inputs in = make_inputs(n_q, n_kv, 8, 1, rng);
  const int32_t slots[] = {65536 * 128 + 0,
                           65536 * 128 + 5,
                           65536 * 128 + 127,
                           65535 * 128 + 7,
                           65539 * 128 + 127,
                           1,
                           -1,
                           65540 * 128};
  std::memcpy(in.slots.ptr<int32_t>(), slots, sizeof(slots));
  for (int64_t i = 8; i < 11; ++i) in.slots.ptr<int32_t>()[i] = 65537 * 128 + int32_t(i);  // unread
  for (int64_t i = 0; i < 8; ++i)
    in.positions.ptr<int32_t>()[i] = static_cast<int32_t>(rng.integer(0, in.max_pos - 1));
  const Packed packed = packed_for(in, ProducerMode::kFused, rng);

  // CPU twin on a small pool of the same layout: pages 65536, 65535, 65539, 0 -> 0, 1, 2, 3.
  Inputs small_in = make_inputs(n_q, n_kv, 8, 1, rng);
  small_in.fused = in.fused.clone();
  small_in.fused_stride = in.fused_stride;
  small_in.positions = in.positions.clone();
  small_in.rope = in.rope.clone();
  for (int w = 0; w < 4; ++w) small_in.norms[w] = in.norms[w].clone();
  const int32_t small_slots[] = {
      0 * 128 + 0, 0 * 128 + 5, 0 * 128 + 127, 1 * 128 + 7, 2 * 128 + 127, 3 * 128 + 1, -1, -1, -1,
      -1,          -1};
  std::memcpy(small_in.slots.ptr<int32_t>(), small_slots, sizeof(small_slots));
  const Layout small = interleaved_layout(n_kv, 4, 2, 1, 0);
  Outputs cpu = make_outputs(small_in, small, rng);
  std::memset(cpu.pool.data(), kPoison, static_cast<size_t>(small.bytes));
  ASSERT_TRUE(
      run_producer_cpu(make_params(ProducerMode::kFused, small_in, packed, cpu, small)).ok());

  // GPU on the big pool.
  mt::DeviceBuffer pool(static_cast<size_t>(big.bytes), kPoison);
  Mirror m;
  mirror_inputs(m, in);
  m.add(packed.data);
  Outputs gpu = make_outputs(in, small, rng);  // q / iq only; the pool view is replaced below
  mirror_outputs(m, gpu);
  ProducerParams dp = m.device_params(make_params(ProducerMode::kFused, in, packed, gpu, small));
  auto* base = static_cast<uint8_t*>(pool.data());
  dp.kv_cache = make_kv_cache_view(base + big.kv_base, pages, n_kv, big.kv_page, big.kv_plane,
                                   Device::cuda(0));
  dp.index_cache = make_index_cache_view(base + big.ic_base, pages, big.ic_page, Device::cuda(0));
  const Status s = run_producer_cuda(dp, nullptr);
  ASSERT_TRUE(s.ok()) << s.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  m.download(gpu.q);
  m.download(gpu.iq);

  // Q / index-Q, and every written row against the twin's row on the mapped page.
  Mismatches mm;
  compare_compact("q_out", in, n_q, cpu.q, cpu.q, gpu.q, true, false, mm);
  compare_compact("iq_out", in, n_kv, cpu.iq, cpu.iq, gpu.iq, true, false, mm);
  const int64_t big_pages[] = {65536, 65535, 65539, 0};
  int64_t differing = 0;  // bytes of the written rows that differ from the poison
  for (int64_t i = 0; i < 6; ++i) {
    const int64_t page = slots[i] / 128, row = slots[i] % 128;
    const int64_t small_page = small_slots[i] / 128;
    ASSERT_EQ(page, big_pages[small_page]);
    struct RowAt {
      const char* name;
      int64_t big_off, small_off;
      bool exact;
    };
    const RowAt rows[] = {
        {"K", big.kv_base + page * big.kv_page, small.kv_base + small_page * small.kv_page, false},
        {"V", big.kv_base + page * big.kv_page + big.kv_plane,
         small.kv_base + small_page * small.kv_page + small.kv_plane, true},
        {"index-K", big.ic_base + page * big.ic_page, small.ic_base + small_page * small.ic_page,
         false}};
    for (const RowAt& r : rows) {
      uint8_t got[kHeadDim];
      pool.download(got, kHeadDim, static_cast<size_t>(r.big_off + row * kHeadDim));
      const uint8_t* want = cpu.pool.ptr<uint8_t>() + r.small_off + row * kHeadDim;
      for (int d = 0; d < kHeadDim; ++d) {
        differing += got[d] != kPoison;
        if (r.exact ? got[d] != want[d] : !e4m3_within_one_step(want[d], got[d]))
          mm.add(describe(r.name, page * 1000 + row, want[d], got[d]));
      }
    }
  }
  EXPECT_EQ(mm.count, 0) << mm.report;
  EXPECT_GT(differing, 0);
  // Nothing else in the 6.4 GB changed: the poison count equals the written rows' count.
  unsigned long long* count = nullptr;
  M3_CUDA_TEST_CHECK(cudaMalloc(&count, sizeof(*count)));
  M3_CUDA_TEST_CHECK(cudaMemset(count, 0, sizeof(*count)));
  count_bytes_not_equal<<<1024, 256>>>(static_cast<const uint4*>(pool.data()), big.bytes / 16,
                                       kPoison, count);
  M3_CUDA_TEST_CHECK(cudaGetLastError());
  unsigned long long total = 0;
  M3_CUDA_TEST_CHECK(cudaMemcpy(&total, count, sizeof(total), cudaMemcpyDeviceToHost));
  cudaFree(count);
  ASSERT_EQ(big.bytes % 16, 0);
  EXPECT_EQ(static_cast<int64_t>(total), differing)
      << "bytes outside the six written token rows changed";
}

// Capture once (fused, and the unfused pair as two nodes), replay with new packed rows, new
// positions and new slots (a -1 among them) written into the same buffers: byte-identical to
// an eager run from the same state, and within tolerance of the twin.
void graph_replay_case(int64_t t, const ProducerCudaOptions& opt = {}) {
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message()
               << "T " << t << " kernel " << producer_cuda_kernel_name(opt.kernel)
               << " persistent_blocks " << opt.persistent_blocks);
  mt::Rng rng(seed);
  const int64_t pages = pages_for(t) + 4;
  Inputs in = make_inputs(64, 4, t, pages, rng);
  const Layout lay = separate_layout(4, pages, 3, 0, 0);
  Packed fused = packed_for(in, ProducerMode::kFused, rng);
  Packed main = packed_for(in, ProducerMode::kMain, rng);
  Packed index = packed_for(in, ProducerMode::kIndex, rng);
  const Outputs init = make_outputs(in, lay, rng);
  Outputs state = init.clone();  // the host side of the device outputs

  Mirror m;
  mirror_inputs(m, in);
  m.add_all({&fused.data, &main.data, &index.data});
  mirror_outputs(m, state);
  const ProducerParams p_fused =
      m.device_params(make_params(ProducerMode::kFused, in, fused, state, lay));
  const ProducerParams p_main =
      m.device_params(make_params(ProducerMode::kMain, in, main, state, lay));
  const ProducerParams p_index =
      m.device_params(make_params(ProducerMode::kIndex, in, index, state, lay));

  cudaStream_t stream;
  M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Variant {
    const char* name;
    std::vector<const ProducerParams*> runs;
    cudaGraphExec_t exec = nullptr;
  };
  Variant variants[] = {{"fused", {&p_fused}}, {"main + index", {&p_main, &p_index}}};
  for (Variant& v : variants) {
    cudaGraph_t graph;
    M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (const ProducerParams* p : v.runs) {
      const Status s = run_producer_cuda(*p, stream, opt);
      EXPECT_TRUE(s.ok()) << s.to_string();
    }
    M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
    size_t nodes = 0;
    M3_CUDA_TEST_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    EXPECT_EQ(nodes, v.runs.size()) << v.name << ": one kernel node per call";
    M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&v.exec, graph, 0));
    M3_CUDA_TEST_CHECK(cudaGraphDestroy(graph));
  }

  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(::testing::Message() << "replay round " << round);
    fill_token_data(in, pages, rng);
    int32_t* slot = in.slots.ptr<int32_t>();
    slot[round] = -1;  // a padding row
    if (round == 2) {  // padded tail
      // (through a vector: GCC 12 otherwise believes the tensor is one 64-byte chunk)
      std::vector<int32_t> all(slot, slot + t + 3);
      std::fill(all.end() - 11, all.end(), -1);
      std::memcpy(in.slots.data(), all.data(), all.size() * sizeof(int32_t));
    }
    refill_packed(fused, in, ProducerMode::kFused, rng);
    refill_packed(main, in, ProducerMode::kMain, rng);
    refill_packed(index, in, ProducerMode::kIndex, rng);
    for (const Tensor* h : {&in.positions, &in.slots, &fused.data, &main.data, &index.data})
      m.upload(*h);

    Outputs cpu = init.clone();
    ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kFused, in, fused, cpu, lay)).ok());

    for (Variant& v : variants) {
      SCOPED_TRACE(v.name);
      Outputs results[2];  // replay, eager
      for (int eager = 0; eager < 2; ++eager) {
        std::memcpy(state.q.data(), init.q.data(), static_cast<size_t>(init.q.nbytes()));
        std::memcpy(state.iq.data(), init.iq.data(), static_cast<size_t>(init.iq.nbytes()));
        std::memcpy(state.pool.data(), init.pool.data(), static_cast<size_t>(lay.bytes));
        m.upload(state.q);
        m.upload(state.iq);
        m.upload(state.pool);
        // Uploads run on the legacy stream; `stream` is non-blocking: order them explicitly.
        M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
        if (eager) {
          for (const ProducerParams* p : v.runs) {
            const Status s = run_producer_cuda(*p, stream, opt);
            ASSERT_TRUE(s.ok()) << s.to_string();
          }
        } else {
          M3_CUDA_TEST_CHECK(cudaGraphLaunch(v.exec, stream));
        }
        M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
        download_outputs(m, state);
        results[eager] = state.clone();
      }
      EXPECT_EQ(std::memcmp(results[0].q.data(), results[1].q.data(),
                            static_cast<size_t>(init.q.nbytes())),
                0);
      EXPECT_EQ(std::memcmp(results[0].iq.data(), results[1].iq.data(),
                            static_cast<size_t>(init.iq.nbytes())),
                0);
      EXPECT_EQ(std::memcmp(results[0].pool.data(), results[1].pool.data(),
                            static_cast<size_t>(lay.bytes)),
                0);
      expect_match(in, true, true, lay, init, cpu, results[0], false, "replay vs CPU twin");
    }
  }
  for (Variant& v : variants) cudaGraphExecDestroy(v.exec);
  cudaStreamDestroy(stream);
}

// T = 37 runs the 1-task-per-group kernel, T = 300 (23,100 tasks) the 3-task one; then the
// persistent kernel on 5 blocks (241 batches of 96 tasks: ~48 loop iterations per block).
TEST(ProducerGpu, GraphReplayWithNewInputsMatchesEager) {
  M3_REQUIRE_GPU();
  for (const int64_t t : {37, 300}) graph_replay_case(t);
  ProducerCudaOptions persistent;
  persistent.kernel = ProducerCudaKernel::kPersistent;
  persistent.persistent_blocks = 5;
  graph_replay_case(300, persistent);
}

// The persistent kernel (grid-stride loop over batches, next batch's loads, RoPE rows and
// positions in flight while the current one is computed) against the per-batch kernel: byte for
// byte (same per-task code), and against the CPU twin. Grids of 1, 3 and 7 blocks run many loop
// iterations per block (every pipeline stage reused many times), with a partial last batch
// (T 129 x 77 heads = 9933 tasks = 103 full batches + 45 tasks; index mode with n_kv 1 has 2
// heads per row: 49 tokens per batch, the staging maximum); the default grid (SMs x 2) at T 4099
// with the M3 geometry runs ~12 iterations per block; T 1 is a single partial batch.
TEST(ProducerGpu, PersistentMatchesPerBatchByteForByte) {
  M3_REQUIRE_GPU();
  struct Case {
    Geometry geo;
    int64_t t;
    int blocks;
  };
  const Case cases[] = {{{64, 4}, 1, 0},  {{64, 4}, 129, 1}, {{64, 4}, 129, 3}, {{64, 4}, 4099, 0},
                        {{8, 1}, 129, 1}, {{8, 1}, 1001, 7}, {{32, 2}, 517, 3}};
  for (const Case& c : cases) {
    const uint64_t seed = mt::fresh_seed();
    M3_SEED_TRACE(seed);
    mt::Rng rng(seed);
    const int64_t pages = pages_for(c.t);
    const Inputs in = make_inputs(c.geo.n_q, c.geo.n_kv, c.t, pages, rng);
    const Layout lay = separate_layout(c.geo.n_kv, pages, 3, 260, 4);
    for (const ProducerMode mode : kModes) {
      SCOPED_TRACE(::testing::Message()
                   << producer_mode_name(mode) << " n_q " << c.geo.n_q << " n_kv " << c.geo.n_kv
                   << " T " << c.t << " persistent_blocks " << c.blocks);
      const Packed packed = packed_for(in, mode, rng);
      const Outputs init = make_outputs(in, lay, rng);
      ProducerCudaOptions per_batch, persistent;
      per_batch.kernel = ProducerCudaKernel::kPerBatch;
      persistent.kernel = ProducerCudaKernel::kPersistent;
      persistent.persistent_blocks = c.blocks;
      Outputs a = init.clone(), b = init.clone(), cpu = init.clone();
      run_on_gpu({make_params(mode, in, packed, a, lay)}, in, {&packed}, a, per_batch);
      run_on_gpu({make_params(mode, in, packed, b, lay)}, in, {&packed}, b, persistent);
      expect_match(in, uses_main(mode), uses_index(mode), lay, init, a, b, /*exact=*/true,
                   "persistent vs per-batch (exact)");
      const Status s = run_producer_cpu(make_params(mode, in, packed, cpu, lay));
      ASSERT_TRUE(s.ok()) << s.to_string();
      expect_match(in, uses_main(mode), uses_index(mode), lay, init, cpu, b, /*exact=*/false,
                   "persistent vs CPU twin");
    }
  }
}

// A negative persistent grid or an unknown kernel choice is rejected before any launch.
TEST(ProducerGpu, BadKernelOptionsRejected) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const int64_t t = 16, pages = pages_for(t);
  const Inputs in = make_inputs(8, 1, t, pages, rng);
  const Layout lay = separate_layout(1, pages, 1, 0, 0);
  Packed packed = packed_for(in, ProducerMode::kFused, rng);
  const Outputs init = make_outputs(in, lay, rng);
  Outputs state = init.clone();
  Mirror m;
  mirror_inputs(m, in);
  m.add(packed.data);
  mirror_outputs(m, state);
  const ProducerParams good =
      m.device_params(make_params(ProducerMode::kFused, in, packed, state, lay));
  ProducerCudaOptions neg;
  neg.kernel = ProducerCudaKernel::kPersistent;
  neg.persistent_blocks = -1;
  ProducerCudaOptions unknown;
  unknown.kernel = static_cast<ProducerCudaKernel>(7);
  for (const ProducerCudaOptions& o : {neg, unknown}) {
    const Status s = run_producer_cuda(good, nullptr, o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_FALSE(s.message().empty());
  }
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  download_outputs(m, state);
  EXPECT_EQ(std::memcmp(state.q.data(), init.q.data(), static_cast<size_t>(init.q.nbytes())), 0);
  EXPECT_EQ(std::memcmp(state.pool.data(), init.pool.data(), static_cast<size_t>(lay.bytes)), 0);
}

// A few rejected calls (the CPU suite covers every rule): a Status, no launch, no byte written.
TEST(ProducerGpu, RejectedCallsTouchNothing) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const int64_t t = 16, pages = pages_for(t);
  const Inputs in = make_inputs(8, 1, t, pages, rng);
  const Layout lay = separate_layout(1, pages, 1, 0, 0);
  Packed packed = packed_for(in, ProducerMode::kFused, rng);
  const Outputs init = make_outputs(in, lay, rng);
  Outputs state = init.clone();
  Mirror m;
  mirror_inputs(m, in);
  m.add(packed.data);
  mirror_outputs(m, state);
  const ProducerParams host = make_params(ProducerMode::kFused, in, packed, state, lay);
  const ProducerParams good = m.device_params(host);

  struct Bad {
    const char* name;
    ProducerParams p;
  };
  std::vector<Bad> bad;
  bad.push_back({"CPU tensors", host});
  bad.push_back({"one view on the CPU", good});
  bad.back().p.rope = host.rope;
  bad.push_back({"packed base 2 bytes off", good});
  bad.back().p.packed.data = static_cast<char*>(good.packed.data) + 2;
  bad.push_back({"slots shorter than T", good});
  bad.back().p.slots.shape[0] = t - 1;
  bad.push_back({"index cache page count differs", good});
  bad.back().p.index_cache.shape[0] = pages - 1;
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.name);
    const Status s = run_producer_cuda(b.p, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_FALSE(s.message().empty());
  }
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  download_outputs(m, state);
  EXPECT_EQ(std::memcmp(state.q.data(), init.q.data(), static_cast<size_t>(init.q.nbytes())), 0);
  EXPECT_EQ(std::memcmp(state.iq.data(), init.iq.data(), static_cast<size_t>(init.iq.nbytes())), 0);
  EXPECT_EQ(std::memcmp(state.pool.data(), init.pool.data(), static_cast<size_t>(lay.bytes)), 0);

  // The good call then runs (so the rejections above were not the environment failing).
  ASSERT_TRUE(run_producer_cuda(good, nullptr).ok());
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
}

// T == 0 launches nothing: the captured graph is empty and every output keeps its bytes.
TEST(ProducerGpu, ZeroTokensLaunchesNothing) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const Inputs in = make_inputs(16, 1, 0, 2, rng);
  const Layout lay = separate_layout(1, 2, 1, 0, 0);
  cudaStream_t stream;
  M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const ProducerMode mode : kModes) {
    SCOPED_TRACE(producer_mode_name(mode));
    const Packed packed = packed_for(in, mode, rng);
    const Outputs init = make_outputs(in, lay, rng);
    Outputs state = init.clone();
    Mirror m;
    mirror_inputs(m, in);
    mirror_outputs(m, state);
    const ProducerParams p = m.device_params(make_params(mode, in, packed, state, lay));
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());  // uploads (legacy stream) before `stream`
    cudaGraph_t graph;
    M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const Status s = run_producer_cuda(p, stream);
    M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
    EXPECT_TRUE(s.ok()) << s.to_string();
    size_t nodes = 1;
    M3_CUDA_TEST_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    EXPECT_EQ(nodes, 0u);
    M3_CUDA_TEST_CHECK(cudaGraphDestroy(graph));
    ASSERT_TRUE(run_producer_cuda(p, stream).ok());
    M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
    download_outputs(m, state);
    EXPECT_EQ(std::memcmp(state.pool.data(), init.pool.data(), static_cast<size_t>(lay.bytes)), 0);
    EXPECT_EQ(std::memcmp(state.q.data(), init.q.data(), static_cast<size_t>(init.q.nbytes())), 0);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace m3attn
