// GPU tests of the warp-specialised persistent prefill kernel (AttentionCudaConfig::kernel = 6,
// and its variants 7 = the next work item prepared early, 8 = 7 with Q in registers, 9 = 8 with
// the faster V conversion, 10 = 9 with the tile unions built by minimum extraction, the automatic
// choice for prefill batches, 11 = 10 with a 4-stage ring and one Q buffer;
// attention_prefill_ws.cuh) against the CPU twin on identical E4M3
// inputs: chunked prefills from position 0 and after cached prefixes (contexts and chunk lengths
// off the 8-token tile and the 128-token block), mixed batches with several chunks and decode /
// verify rows, sparse and dense, with and without splits, persistent grids of 1 .. 132 CTAs (1 CTA
// walks every work item: ring phases, Q buffer reuse, item boundaries), 16-byte strided pools (TMA)
// and 4-byte ones (the launcher falls back to kernel 4), junk ids and work items without any block,
// page ids past 2^31 bytes, NaN propagation, sparse == dense with <= 16 visible blocks (bit for
// bit), CUDA-graph replay with new inputs == eager (byte for byte).
//
// Tolerance (per (token, head) row of 128 outputs, relative L2 against the twin): kRowRelL2 = 1e-2,
// the bound derived in attention_gpu_test.cu for the wgmma kernels, whose numerics this kernel
// shares exactly (FP8 wgmma logits with Hopper's ~13-bit in-block accumulation: <~ 1.7e-3 per
// logit; P rounded to f16: 4.9e-4; V exact in f16; fp32 accumulation; one BF16 rounding on each
// side: <= 3.9e-3; weights perturbed by eps perturb the weighted average by <~ 2 eps:
// 3.9e-3 + 2 (1.7e-3 + 4.9e-4) ~ 8.3e-3 < 1e-2). NaN must appear exactly where the twin has it,
// +0 rows exactly where the twin has no keys; guard bytes and row padding stay untouched.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/attention/attention.h"
#include "support/batch_builder.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::BatchOptions;
using testing::build_batch;
using testing::DeviceBuffer;
using testing::fresh_seed;
using testing::HostBatch;
using testing::RequestSpec;
using testing::Rng;

constexpr double kRowRelL2 = 1e-2;
constexpr uint8_t kPoison = 0xA5;
constexpr size_t kGuard = 256;
constexpr int kRowPad = 8;       // bf16 elements past each output row that must stay poisoned
constexpr int kWs = 6;           // AttentionCudaConfig::kernel of the warp-specialised kernel
constexpr int kWsLookahead = 7;  // the same, next work item prepared early
constexpr int kWsQRegs = 8;      // as 7 with Q in registers
constexpr int kWsFast = 9;       // as 8 with the faster V conversion
constexpr int kWsUnion = 10;     // as 9 with the tile unions by minimum extraction (automatic)
constexpr int kWsDeep = 11;      // as 10 with a 4-stage ring and one Q buffer

AttentionCudaConfig ws_config(int splits, int ctas, int kernel = kWs) {
  AttentionCudaConfig c;
  c.splits = splits;
  c.kernel = kernel;
  c.persistent_ctas = ctas;
  return c;
}

std::string describe(const AttentionCudaConfig& c) {
  std::ostringstream os;
  os << "kernel " << c.kernel << " splits " << c.splits << " ctas " << c.persistent_ctas;
  return os.str();
}

// Host inputs of one problem.
struct Case {
  HostBatch hb;
  int n_q = 0, n_kv = 0;
  Tensor q;    // e4m3 [T, n_q, 128]
  Tensor ids;  // i32 [T, n_kv, 16]
  int64_t T() const { return hb.num_tokens(); }
  int64_t width() const { return int64_t{n_q} * kHeadDim; }
};

// ids: the local block and the best 15 earlier blocks of a ranking, ascending, -1 padded (the
// indexer's contract). per_token: a fresh ranking per token (large tile unions), else one per
// (request, KV head) (neighbouring tokens agree, as real top-k mostly does).
Case make_case(const std::vector<RequestSpec>& reqs, int n_q, int n_kv, bool per_token, Rng& rng,
               BatchOptions o = {}) {
  Case c;
  o.n_kv = n_kv;
  c.hb = build_batch(reqs, o, rng);
  c.n_q = n_q;
  c.n_kv = n_kv;
  c.q = Tensor(DType::kE4M3, {c.T(), n_q, kHeadDim});
  testing::fill_e4m3_normal(c.q, rng);
  c.ids = Tensor(DType::kI32, {c.T(), n_kv, kTopK});
  const int blocks = c.hb.max_pages() + 1;
  std::vector<std::vector<float>> rank(static_cast<size_t>(c.hb.num_requests()) * n_kv,
                                       std::vector<float>(static_cast<size_t>(blocks)));
  for (auto& r : rank)
    for (float& x : r) x = rng.uniform(0.0f, 1.0f);
  std::vector<float> own(static_cast<size_t>(blocks));
  for (int64_t t = 0; t < c.T(); ++t) {
    const int local = c.hb.position_of(t) / kPageSize;
    for (int g = 0; g < n_kv; ++g) {
      if (per_token)
        for (float& x : own) x = rng.uniform(0.0f, 1.0f);
      const std::vector<float>& r =
          per_token ? own : rank[static_cast<size_t>(c.hb.request_of(t)) * n_kv + g];
      std::vector<int> b(static_cast<size_t>(local));
      std::iota(b.begin(), b.end(), 0);
      std::sort(b.begin(), b.end(), [&](int x, int y) { return r[x] > r[y]; });
      if (b.size() > 15) b.resize(15);
      b.push_back(local);
      std::sort(b.begin(), b.end());
      int32_t* row = c.ids.ptr<int32_t>() + (t * n_kv + g) * kTopK;
      for (int k = 0; k < kTopK; ++k) row[k] = k < static_cast<int>(b.size()) ? b[k] : -1;
    }
  }
  return c;
}

AttentionParams host_params(const Case& c, bool sparse, Tensor& out) {
  AttentionParams p;
  p.n_q = c.n_q;
  p.n_kv = c.n_kv;
  p.sparse = sparse;
  p.q = c.q.view();
  p.kv_cache = c.hb.kv_cache();
  p.block_ids = c.ids.view();
  p.batch = c.hb.batch_view();
  p.out = out.view();
  return p;
}

Tensor twin(const Case& c, bool sparse) {
  Tensor ref(DType::kBF16, {c.T(), c.width()});
  ref.fill_bytes(kPoison);
  const Status s = run_attention_cpu(host_params(c, sparse, ref));
  EXPECT_TRUE(s.ok()) << s.to_string();
  return ref;
}

// Device copies; the output rows have kRowPad extra elements and kGuard bytes on both sides.
struct Dev {
  DeviceBuffer q, ids, qs, pos, lens, table, pool, out, ws;
  TensorView kv;
  BatchView batch;
  int64_t out_stride = 0;
  size_t out_bytes = 0;
};

void upload(const Case& c, Dev& d) {
  auto up = [](DeviceBuffer& b, const Tensor& t) {
    b = DeviceBuffer(static_cast<size_t>(std::max<int64_t>(t.nbytes(), 16)));
    b.upload(t.data(), static_cast<size_t>(t.nbytes()));
  };
  up(d.q, c.q);
  up(d.ids, c.ids);
  up(d.qs, c.hb.query_start);
  up(d.pos, c.hb.positions);
  up(d.lens, c.hb.seq_lens);
  up(d.table, c.hb.page_table);
  up(d.pool, c.hb.kv_pool);
  d.kv = c.hb.kv_view_at(d.pool.data(), Device::cuda(0));
  d.batch =
      c.hb.batch_view_at(d.qs.data(), d.pos.data(), d.lens.data(), d.table.data(), Device::cuda(0));
  d.out_stride = c.width() + kRowPad;
  d.out_bytes = static_cast<size_t>(c.T() * d.out_stride * 2);
  d.out = DeviceBuffer(d.out_bytes + 2 * kGuard, kPoison);
}

AttentionParams dev_params(const Case& c, const Dev& d, bool sparse) {
  AttentionParams p;
  p.n_q = c.n_q;
  p.n_kv = c.n_kv;
  p.sparse = sparse;
  p.q = TensorView::contiguous(d.q.data(), DType::kE4M3, {c.T(), c.n_q, kHeadDim}, Device::cuda(0));
  p.kv_cache = d.kv;
  p.block_ids =
      TensorView::contiguous(d.ids.data(), DType::kI32, {c.T(), c.n_kv, kTopK}, Device::cuda(0));
  p.batch = d.batch;
  p.out = TensorView::strided(static_cast<uint8_t*>(d.out.data()) + kGuard, DType::kBF16,
                              {c.T(), c.width()}, {d.out_stride, 1}, Device::cuda(0));
  return p;
}

// One eager run (output poisoned, workspace poisoned with NaN bytes); the whole output buffer.
std::vector<uint8_t> run_gpu(const Case& c, Dev& d, bool sparse, const AttentionCudaConfig& cfg) {
  const AttentionParams p = dev_params(c, d, sparse);
  const size_t ws_bytes = attention_workspace_bytes(p, cfg);
  d.ws = DeviceBuffer(std::max<size_t>(ws_bytes, 16), 0xFF);
  d.out.poison(kPoison);
  const Status s = run_attention_cuda(p, d.ws.data(), ws_bytes, nullptr, cfg);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d.out.download_all();
}

bool bf16_nan(uint16_t v) { return (v & 0x7fffu) > 0x7f80u; }

// Rows within kRowRelL2 of the twin, NaN exactly where the twin has NaN, +0 rows where the twin
// has no keys, guards and row padding untouched. Returns the worst row error.
double expect_matches(const Case& c, const Dev& d, const std::vector<uint8_t>& got,
                      const Tensor& ref, const std::string& what) {
  for (size_t i = 0; i < kGuard; ++i)
    if (got[i] != kPoison || got[kGuard + d.out_bytes + i] != kPoison) {
      ADD_FAILURE() << what << ": guard byte " << i << " written";
      break;
    }
  const int64_t W = c.width();
  double worst = 0.0;
  int reported = 0;
  for (int64_t t = 0; t < c.T(); ++t) {
    const uint16_t* g = reinterpret_cast<const uint16_t*>(got.data() + kGuard) + t * d.out_stride;
    const uint16_t* r = ref.ptr<uint16_t>() + t * W;
    for (int k = 0; k < kRowPad; ++k)
      if (g[W + k] != static_cast<uint16_t>(kPoison * 0x0101) && reported++ < 5)
        ADD_FAILURE() << what << ": padding of token " << t << " written";
    for (int j = 0; j < c.n_q; ++j) {
      double num = 0.0, den = 0.0;
      bool nan_pattern_differs = false, any_nan = false, ref_zero = true, got_zero = true;
      for (int e = 0; e < kHeadDim; ++e) {
        const uint16_t gv = g[j * kHeadDim + e], rv = r[j * kHeadDim + e];
        nan_pattern_differs |= bf16_nan(gv) != bf16_nan(rv);
        any_nan |= bf16_nan(rv);
        ref_zero &= rv == 0;
        got_zero &= gv == 0;
        const double a = bf16_to_float(gv), b = bf16_to_float(rv);
        num += (a - b) * (a - b);
        den += b * b;
      }
      std::string err;
      if (nan_pattern_differs) {
        err = "NaN pattern differs from the twin";
      } else if (any_nan) {
      } else if (ref_zero) {
        if (!got_zero) err = "twin row is +0 (no keys), GPU row is not";
      } else {
        const double rel = std::sqrt(num / den);
        worst = std::max(worst, rel);
        if (!(rel <= kRowRelL2)) {
          std::ostringstream os;
          os << "relative L2 " << rel << " > " << kRowRelL2;
          err = os.str();
        }
      }
      if (!err.empty() && reported++ < 8)
        ADD_FAILURE() << what << ": token " << t << " (request " << c.hb.request_of(t)
                      << ", position " << c.hb.position_of(t) << ") head " << j << ": " << err;
    }
  }
  return worst;
}

// The twin once per mode, then kernel 6 under every config (and kernel 4 as a reference line).
void check_configs(const Case& c, bool sparse, const std::string& what,
                   const std::vector<AttentionCudaConfig>& cfgs) {
  const Tensor ref = twin(c, sparse);
  if (::testing::Test::HasFailure()) return;
  Dev d;
  upload(c, d);
  for (const AttentionCudaConfig& cfg : cfgs) {
    const std::string name = what + (sparse ? " sparse, " : " dense, ") + describe(cfg);
    const std::vector<uint8_t> got = run_gpu(c, d, sparse, cfg);
    const double worst = expect_matches(c, d, got, ref, name);
    std::printf("  %s: worst row relative L2 %.2e\n", name.c_str(), worst);
  }
}

std::vector<AttentionCudaConfig> standard_configs() {
  AttentionCudaConfig k4;
  k4.kernel = 4;
  return {k4,
          ws_config(0, 0),
          ws_config(1, 0),
          ws_config(3, 0),
          ws_config(1, 1),
          ws_config(2, 1),
          ws_config(1, 3),
          ws_config(0, 7),
          ws_config(0, 0, kWsLookahead),
          ws_config(3, 0, kWsLookahead),
          ws_config(1, 1, kWsLookahead),
          ws_config(2, 5, kWsLookahead),
          ws_config(0, 0, kWsQRegs),
          ws_config(3, 0, kWsQRegs),
          ws_config(1, 2, kWsQRegs),
          ws_config(0, 0, kWsFast),
          ws_config(3, 0, kWsFast),
          ws_config(1, 1, kWsFast),
          ws_config(2, 6, kWsFast),
          ws_config(0, 0, kWsUnion),
          ws_config(3, 0, kWsUnion),
          ws_config(1, 1, kWsUnion),
          ws_config(2, 6, kWsUnion),
          ws_config(0, 0, kWsDeep),
          ws_config(3, 0, kWsDeep),
          ws_config(1, 1, kWsDeep),
          ws_config(2, 6, kWsDeep)};
}

// ---- tests ------------------------------------------------------------------------------------

TEST(AttentionPrefillWsGpu, ChunksAndMixedBatchesMatchTwin) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // A chunk from position 0 (every causal mask), chunks after cached prefixes that are neither
  // block nor tile multiples, chunk lengths off the 8-token tile, one-token and short chunks,
  // contexts past 16 blocks (sparse != dense), then generation requests with draft 3.
  const std::vector<RequestSpec> ctx = {{0, 333}, {1917, 120}, {4100, 41}, {3, 9}, {2500, 1}};
  const std::vector<RequestSpec> reqs = testing::mixed_requests(ctx, 4, 3, 4500, rng);
  SCOPED_TRACE(testing::describe_requests(reqs));
  for (bool per_token : {false, true}) {
    const Case c = make_case(reqs, 32, 2, per_token, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_configs(c, true, per_token ? "chunks, per-token picks" : "chunks", standard_configs());
  }
  const Case c = make_case(reqs, 32, 2, false, rng);
  check_configs(c, false, "chunks", standard_configs());
}

// M3 geometry (64 query heads, 4 KV heads) on a prefill that starts at position 0 plus a chunk
// on a long cached prefix: more work items than SMs on the automatic grid.
TEST(AttentionPrefillWsGpu, M3GeometryMatchesTwin) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 291}, {6001, 77}};
  SCOPED_TRACE(testing::describe_requests(reqs));
  const Case c = make_case(reqs, 64, 4, false, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  check_configs(c, true, "M3",
                {ws_config(0, 0), ws_config(1, 0), ws_config(1, 5), ws_config(0, 0, kWsLookahead),
                 ws_config(1, 3, kWsLookahead), ws_config(0, 0, kWsQRegs), ws_config(0, 0, kWsFast),
                 ws_config(1, 4, kWsFast), ws_config(0, 0, kWsUnion), ws_config(1, 4, kWsUnion),
                 ws_config(0, 0, kWsDeep), ws_config(1, 4, kWsDeep)});
  check_configs(
      c, false, "M3",
      {ws_config(0, 0), ws_config(1, 2), ws_config(0, 0, kWsFast), ws_config(0, 0, kWsUnion)});
}

TEST(AttentionPrefillWsGpu, StridedPools) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 45}, {1000, 19}, {2049, 1}, {5000, 12}};
  SCOPED_TRACE(testing::describe_requests(reqs));
  const int64_t tile = int64_t{kPageSize} * kHeadDim;
  // Gapped planes and pages: multiples of 16 bytes (TMA), then of 4 only (kernel 4 runs).
  for (int64_t extra : {int64_t{48}, int64_t{20}}) {
    SCOPED_TRACE(::testing::Message() << "stride extra " << extra);
    BatchOptions o;
    o.kv_plane_stride = 3 * tile + extra;
    o.kv_page_stride = 2 * (3 * tile) + 2 * extra;
    o.spare_pages = 5;
    const Case c = make_case(reqs, 48, 3, true, rng, o);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_configs(
        c, true, "3 KV heads",
        {ws_config(0, 0), ws_config(2, 3), ws_config(1, 2, kWsLookahead), ws_config(2, 2, kWsQRegs),
         ws_config(0, 0, kWsFast), ws_config(0, 0, kWsUnion), ws_config(0, 0, kWsDeep)});
    check_configs(c, false, "3 KV heads", {ws_config(1, 0)});
  }
  // Group 8 on 2 KV heads, gapped 16-byte strides.
  BatchOptions o;
  o.kv_plane_stride = 2 * tile + 32;
  o.kv_page_stride = 2 * (2 * tile + 32) + 16;
  const Case c = make_case(reqs, 16, 2, false, rng, o);
  ASSERT_FALSE(::testing::Test::HasFailure());
  check_configs(c, true, "group 8",
                {ws_config(0, 0), ws_config(1, 2), ws_config(0, 0, kWsQRegs),
                 ws_config(0, 0, kWsFast), ws_config(2, 3, kWsFast), ws_config(2, 3, kWsUnion)});
  check_configs(c, false, "group 8", {ws_config(0, 0, kWsFast), ws_config(0, 0, kWsUnion)});
}

TEST(AttentionPrefillWsGpu, JunkIdsAndItemsWithoutBlocks) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 20}, {300, 17}, {2500, 9}, {4000, 1}};
  SCOPED_TRACE(testing::describe_requests(reqs));
  Case c = make_case(reqs, 32, 2, true, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  int32_t* ids = c.ids.ptr<int32_t>();
  const int64_t T = c.T();
  // Junk the twin ignores: future, huge, negative, repeated ids, shuffled rows.
  for (int64_t t = 0; t < T; ++t)
    for (int g = 0; g < 2; ++g) {
      int32_t* row = ids + (t * 2 + g) * kTopK;
      const int n =
          static_cast<int>(std::count_if(row, row + kTopK, [](int32_t x) { return x >= 0; }));
      for (int k = n; k < kTopK; ++k) {
        switch (rng.integer(0, 3)) {
          case 0:
            row[k] = c.hb.position_of(t) / kPageSize + 1;
            break;
          case 1:
            row[k] = 1 << 30;
            break;
          case 2:
            row[k] = -static_cast<int32_t>(rng.integer(1, 1000));
            break;
          default:
            row[k] = row[rng.integer(0, n - 1)];
            break;
        }
      }
      std::shuffle(row, row + kTopK, rng.engine());
    }
  // Tokens 28 .. 35 (the second 8-token tile of request 1, tokens 20 .. 36) select nothing on KV
  // head 1: that work item has no block (+0 rows, or an empty split partial); token 3 selects
  // nothing on head 0.
  for (int64_t t = 28; t < 36; ++t) std::fill_n(ids + (t * 2 + 1) * kTopK, kTopK, -1);
  std::fill_n(ids + (3 * 2 + 0) * kTopK, kTopK, -1);
  check_configs(c, true, "junk ids", standard_configs());
}

TEST(AttentionPrefillWsGpu, SparseEqualsDenseWithAtMost16Blocks) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 130}, {1000, 5}, {2040, 8}, {1, 1}, {1919, 21}};
  const Case c = make_case(reqs, 64, 4, true, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const Tensor ref = twin(c, true);
  Dev d;
  upload(c, d);
  for (const AttentionCudaConfig& cfg :
       {ws_config(1, 0), ws_config(3, 0), ws_config(2, 4), ws_config(1, 3, kWsLookahead),
        ws_config(1, 3, kWsQRegs), ws_config(1, 0, kWsFast), ws_config(2, 5, kWsFast),
        ws_config(1, 0, kWsUnion), ws_config(2, 5, kWsUnion), ws_config(1, 0, kWsDeep),
        ws_config(2, 5, kWsDeep)}) {
    const std::vector<uint8_t> s = run_gpu(c, d, true, cfg);
    const std::vector<uint8_t> dn = run_gpu(c, d, false, cfg);
    EXPECT_TRUE(s == dn) << "sparse and dense GPU outputs differ under " << describe(cfg);
    expect_matches(c, d, s, ref, "sparse == dense, " + describe(cfg));
  }
}

TEST(AttentionPrefillWsGpu, LargePoolPageIdsPast2To31Bytes) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{3000, 17}, {0, 40}, {700, 4}};
  const Case c = make_case(reqs, 16, 1, false, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const Tensor ref = twin(c, true);
  Dev d;
  upload(c, d);
  constexpr int64_t kShift = 65536;  // pages of 32 KB: 2^31 bytes
  const int64_t page_stride = c.hb.kv_page_stride();
  ASSERT_EQ(page_stride, 2 * int64_t{kPageSize} * kHeadDim);
  const int64_t pages = kShift + c.hb.num_pages();
  DeviceBuffer big(static_cast<size_t>(pages * page_stride), 0x7F);
  M3_CUDA_TEST_CHECK(cudaMemcpy(static_cast<uint8_t*>(big.data()) + kShift * page_stride,
                                c.hb.kv_pool.data(), static_cast<size_t>(c.hb.kv_pool.nbytes()),
                                cudaMemcpyHostToDevice));
  Tensor table = c.hb.page_table.clone();
  for (int64_t i = 0; i < table.numel(); ++i)
    if (table.ptr<int32_t>()[i] >= 0) table.ptr<int32_t>()[i] += static_cast<int32_t>(kShift);
  d.table.upload(table.data(), static_cast<size_t>(table.nbytes()));
  d.kv = make_kv_cache_view(big.data(), pages, 1, page_stride, c.hb.kv_plane_stride(),
                            Device::cuda(0));
  for (const AttentionCudaConfig& cfg :
       {ws_config(0, 0), ws_config(3, 2), ws_config(0, 0, kWsQRegs), ws_config(0, 0, kWsFast),
        ws_config(0, 0, kWsUnion), ws_config(0, 0, kWsDeep)}) {
    const std::vector<uint8_t> got = run_gpu(c, d, true, cfg);
    expect_matches(c, d, got, ref, "pages past 2^31 bytes, " + describe(cfg));
  }
}

TEST(AttentionPrefillWsGpu, NaNInAVisibleValuePropagates) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // Positions 200 .. 207 and 40 all see position 150 of request 0 only through request 0.
  const std::vector<RequestSpec> reqs = {{200, 8}, {40, 1}};
  Case c = make_case(reqs, 16, 1, false, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  c.hb.kv_row(0, 150, 1, 0)[17] = 0x7F;
  check_configs(c, true, "NaN value",
                {ws_config(0, 0), ws_config(2, 1), ws_config(0, 0, kWsQRegs),
                 ws_config(0, 0, kWsFast), ws_config(2, 1, kWsFast), ws_config(0, 0, kWsUnion),
                 ws_config(2, 1, kWsUnion), ws_config(0, 0, kWsDeep), ws_config(2, 1, kWsDeep)});
}

// A NaN V element that some tokens of a tile see and others do not (a key of the local block that
// is in the future of the tile's earlier tokens, blocks only some tokens select): the twin puts
// NaN in that dim of the tokens that see the key only; a NaN K element makes the rows of the
// tokens that see it NaN. A shared wgmma row with P = 0 must never meet the NaN (0 * NaN). The
// ws kernels and the wgmma kernels 2-4.
TEST(AttentionPrefillWsGpu, NaNStaysInTheRowsThatSeeIt) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // Request 0: positions 148 .. 155 (one tile); request 1: 126 .. 133 (crosses a block);
  // request 2: a long context with per-token selections (blocks only some tokens select).
  const std::vector<RequestSpec> reqs = {{148, 8}, {126, 8}, {4000, 16}};
  Case c = make_case(reqs, 32, 2, true, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  c.hb.kv_row(0, 151, 1, 0)[17] = 0x7F;   // V: seen by positions 151 .. 155 only
  c.hb.kv_row(0, 154, 1, 1)[100] = 0xFF;  // by 154, 155 (head 1)
  c.hb.kv_row(1, 127, 1, 0)[3] = 0x7F;    // by 127 .. 133
  c.hb.kv_row(1, 129, 1, 1)[64] = 0x7F;   // by 129 .. 133 (other block)
  for (int k = 0; k < 6; ++k)
    c.hb.kv_row(2, static_cast<int>(rng.integer(0, 3999)), 1, k & 1)[rng.integer(0, 127)] = 0xFF;
  c.hb.kv_row(0, 153, 0, 0)[40] = 0x7F;  // K: rows of positions 153 .. 155 NaN
  std::vector<AttentionCudaConfig> cfgs = {ws_config(0, 0),           ws_config(2, 1),
                                           ws_config(0, 0, kWsFast),  ws_config(2, 1, kWsFast),
                                           ws_config(0, 0, kWsUnion), ws_config(2, 1, kWsDeep)};
  for (int kernel : {2, 3, 4}) {  // the wgmma kernel and its variants (kernel 4: TMA fallback)
    AttentionCudaConfig k;
    k.kernel = kernel;
    cfgs.push_back(k);
    k.splits = 2;
    cfgs.push_back(k);
  }
  check_configs(c, true, "NaN seen by some tokens", cfgs);
  check_configs(c, false, "NaN seen by some tokens", cfgs);
}

TEST(AttentionPrefillWsGpu, GraphReplayWithNewInputsEqualsEager) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 37}, {1500, 40}, {4000, 4}, {90, 4}};
  for (bool sparse : {true, false}) {
    for (const AttentionCudaConfig& cfg :
         {ws_config(0, 0), ws_config(3, 0), ws_config(1, 3), ws_config(0, 0, kWsLookahead),
          ws_config(0, 0, kWsQRegs), ws_config(0, 0, kWsFast), ws_config(3, 0, kWsFast),
          ws_config(0, 0, kWsUnion), ws_config(3, 0, kWsUnion), ws_config(0, 0, kWsDeep),
          ws_config(3, 0, kWsDeep)}) {
      SCOPED_TRACE(::testing::Message() << (sparse ? "sparse " : "dense ") << describe(cfg));
      const Case a = make_case(reqs, 64, 4, false, rng);
      const Case b = make_case(reqs, 64, 4, true, rng);  // same shapes, new contents
      ASSERT_FALSE(::testing::Test::HasFailure());
      ASSERT_EQ(a.hb.kv_pool.nbytes(), b.hb.kv_pool.nbytes());
      Dev d;
      upload(a, d);
      const AttentionParams p = dev_params(a, d, sparse);
      const size_t ws_bytes = attention_workspace_bytes(p, cfg);
      d.ws = DeviceBuffer(std::max<size_t>(ws_bytes, 16), 0xFF);
      cudaStream_t stream;
      M3_CUDA_TEST_CHECK(cudaStreamCreate(&stream));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      const Status s = run_attention_cuda(p, d.ws.data(), ws_bytes, stream, cfg);
      M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
      ASSERT_TRUE(s.ok()) << s.to_string();
      M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      d.q.upload(b.q.data(), static_cast<size_t>(b.q.nbytes()));
      d.ids.upload(b.ids.data(), static_cast<size_t>(b.ids.nbytes()));
      d.pool.upload(b.hb.kv_pool.data(), static_cast<size_t>(b.hb.kv_pool.nbytes()));
      d.table.upload(b.hb.page_table.data(), static_cast<size_t>(b.hb.page_table.nbytes()));
      d.out.poison(kPoison);
      M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      const std::vector<uint8_t> replay = d.out.download_all();
      d.out.poison(kPoison);
      d.ws.poison(0xFF);
      const Status e = run_attention_cuda(p, d.ws.data(), ws_bytes, stream, cfg);
      ASSERT_TRUE(e.ok()) << e.to_string();
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      const std::vector<uint8_t> eager = d.out.download_all();
      EXPECT_TRUE(replay == eager) << "graph replay differs from eager";
      expect_matches(b, d, replay, twin(b, sparse), "graph replay");
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(stream);
    }
  }
}

TEST(AttentionPrefillWsGpu, NegativePersistentCtasIsRejected) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const Case c = make_case({{0, 9}}, 16, 1, false, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  Dev d;
  upload(c, d);
  const std::vector<uint8_t> before = d.out.download_all();
  const Status s =
      run_attention_cuda(dev_params(c, d, true), nullptr, 0, nullptr, ws_config(1, -1));
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(d.out.download_all() == before) << "a rejected call wrote its output";
}

}  // namespace
}  // namespace m3attn
