// GPU tests of the warp-specialised persistent prefill kernel (attention_prefill_ws.cuh:
// AttentionCudaConfig::kernel = 15: a 4-stage ring with one Q buffer, 64 / 216 registers per
// scheduler-converter / consumer thread, the automatic choice for prefill; kernel 11, its 40 / 232
// register split, was removed in session 14)
// and of its fallback, the cp.async wgmma kernel 4, against the CPU twin on identical E4M3 inputs:
// chunked prefills from position 0 and after cached prefixes (contexts and chunk lengths off the
// 8-token tile and the 128-token block), mixed batches with several chunks and decode / verify
// rows, sparse and dense, with and without splits, persistent grids of 1 .. 132 CTAs (1 CTA walks
// every work item: ring phases, Q buffer reuse, item boundaries), 16-byte strided pools (TMA) and
// 4-byte ones (the launcher falls back to kernel 4), junk ids and work items without any block,
// page ids past 2^31 bytes, NaN propagation, sparse == dense with <= 16 visible blocks (bit for
// bit), CUDA-graph replay with new inputs == eager (byte for byte).
//
// Problems, device copies, runs and the comparison with the twin come from
// attention_gpu_test_util.h (shared with attention_gpu_test.cu; its comment derives the tolerance:
// per (token, head) row relative L2 <= 1e-2, NaN exactly where the twin has it, +0 rows exactly
// where the twin has no keys, guard bytes and row padding untouched).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "m3attn/config.h"
#include "stages/attention/attention.h"
#include "stages/attention/attention_gpu_test_util.h"
#include "support/batch_builder.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn::testing::attn {
namespace {

constexpr int kWs = 15;   // AttentionCudaConfig::kernel of the warp-specialised kernel
constexpr int kAuto = 0;  // the automatic plan (kernel 15 on these batches)

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

// per_token: a fresh block ranking per token (large tile unions), else one per (request, KV head)
// (neighbouring tokens agree, as real top-k mostly does).
Problem make_case(const std::vector<RequestSpec>& reqs, int n_q, int n_kv, bool per_token, Rng& rng,
                  BatchOptions o = {}) {
  return make_problem(reqs, n_q, n_kv, per_token ? Pick::kRandom : Pick::kShared, rng, o);
}

// The twin once per mode, then the kernels under every config (kernel 4 as a reference line).
void check_configs(Problem& c, bool sparse, const std::string& what,
                   const std::vector<AttentionCudaConfig>& cfgs) {
  check_against_twin(c, sparse, what, cfgs, describe);
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
          ws_config(2, 6),
          ws_config(0, 0, kAuto)};
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
  const std::vector<RequestSpec> reqs = mixed_requests(ctx, 4, 3, 4500, rng);
  SCOPED_TRACE(describe_requests(reqs));
  for (bool per_token : {false, true}) {
    Problem c = make_case(reqs, 32, 2, per_token, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_configs(c, true, per_token ? "chunks, per-token picks" : "chunks", standard_configs());
  }
  Problem c = make_case(reqs, 32, 2, false, rng);
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
  SCOPED_TRACE(describe_requests(reqs));
  Problem c = make_case(reqs, 64, 4, false, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  check_configs(
      c, true, "M3",
      {ws_config(0, 0), ws_config(1, 0), ws_config(1, 5), ws_config(1, 4), ws_config(0, 0, kAuto)});
  check_configs(c, false, "M3", {ws_config(0, 0), ws_config(1, 2), ws_config(0, 0, kAuto)});
}

TEST(AttentionPrefillWsGpu, StridedPools) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 45}, {1000, 19}, {2049, 1}, {5000, 12}};
  SCOPED_TRACE(describe_requests(reqs));
  const int64_t tile = int64_t{kPageSize} * kHeadDim;
  // Gapped planes and pages: multiples of 16 bytes (TMA), then of 4 only (kernel 4 runs).
  for (int64_t extra : {int64_t{48}, int64_t{20}}) {
    SCOPED_TRACE(::testing::Message() << "stride extra " << extra);
    BatchOptions o;
    o.kv_plane_stride = 3 * tile + extra;
    o.kv_page_stride = 2 * (3 * tile) + 2 * extra;
    o.spare_pages = 5;
    Problem c = make_case(reqs, 48, 3, true, rng, o);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_configs(c, true, "3 KV heads", {ws_config(0, 0), ws_config(2, 3)});
    check_configs(c, false, "3 KV heads", {ws_config(1, 0)});
  }
  // Group 8 on 2 KV heads, gapped 16-byte strides.
  BatchOptions o;
  o.kv_plane_stride = 2 * tile + 32;
  o.kv_page_stride = 2 * (2 * tile + 32) + 16;
  Problem c = make_case(reqs, 16, 2, false, rng, o);
  ASSERT_FALSE(::testing::Test::HasFailure());
  check_configs(c, true, "group 8", {ws_config(0, 0), ws_config(1, 2)});
  check_configs(c, false, "group 8", {ws_config(0, 0), ws_config(2, 3)});
}

TEST(AttentionPrefillWsGpu, JunkIdsAndItemsWithoutBlocks) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 20}, {300, 17}, {2500, 9}, {4000, 1}};
  SCOPED_TRACE(describe_requests(reqs));
  Problem c = make_case(reqs, 32, 2, true, rng);
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
  Problem c = make_case(reqs, 64, 4, true, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  run_reference(c, true);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceProblem d;
  upload(c, d);
  for (const AttentionCudaConfig& cfg :
       {ws_config(1, 0), ws_config(3, 0), ws_config(2, 4), ws_config(2, 5)})
    expect_sparse_equals_dense(c, d, cfg, describe(cfg));
}

TEST(AttentionPrefillWsGpu, LargePoolPageIdsPast2To31Bytes) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{3000, 17}, {0, 40}, {700, 4}};
  Problem c = make_case(reqs, 16, 1, false, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  run_reference(c, true);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceProblem d;
  upload(c, d);
  DeviceBuffer big;
  ASSERT_NO_FATAL_FAILURE(move_pool_past_2_31_bytes(c, d, &big));
  expect_configs_match(c, d, true, {ws_config(0, 0), ws_config(3, 2), ws_config(0, 0, kAuto)},
                       "pages past 2^31 bytes, ", describe);
}

TEST(AttentionPrefillWsGpu, NaNInAVisibleValuePropagates) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // Positions 200 .. 207 and 40 all see position 150 of request 0 only through request 0.
  const std::vector<RequestSpec> reqs = {{200, 8}, {40, 1}};
  Problem c = make_case(reqs, 16, 1, false, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  c.hb.kv_row(0, 150, 1, 0)[17] = 0x7F;
  check_configs(c, true, "NaN value", {ws_config(0, 0), ws_config(2, 1), ws_config(1, 3)});
}

// A NaN V element that some tokens of a tile see and others do not (a key of the local block that
// is in the future of the tile's earlier tokens, blocks only some tokens select): the twin puts
// NaN in that dim of the tokens that see the key only; a NaN K element makes the rows of the
// tokens that see it NaN. A shared wgmma row with P = 0 must never meet the NaN (0 * NaN). The
// ws kernels and the cp.async wgmma kernel 4.
TEST(AttentionPrefillWsGpu, NaNStaysInTheRowsThatSeeIt) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // Request 0: positions 148 .. 155 (one tile); request 1: 126 .. 133 (crosses a block);
  // request 2: a long context with per-token selections (blocks only some tokens select).
  const std::vector<RequestSpec> reqs = {{148, 8}, {126, 8}, {4000, 16}};
  Problem c = make_case(reqs, 32, 2, true, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  c.hb.kv_row(0, 151, 1, 0)[17] = 0x7F;   // V: seen by positions 151 .. 155 only
  c.hb.kv_row(0, 154, 1, 1)[100] = 0xFF;  // by 154, 155 (head 1)
  c.hb.kv_row(1, 127, 1, 0)[3] = 0x7F;    // by 127 .. 133
  c.hb.kv_row(1, 129, 1, 1)[64] = 0x7F;   // by 129 .. 133 (other block)
  for (int k = 0; k < 6; ++k)
    c.hb.kv_row(2, static_cast<int>(rng.integer(0, 3999)), 1, k & 1)[rng.integer(0, 127)] = 0xFF;
  c.hb.kv_row(0, 153, 0, 0)[40] = 0x7F;  // K: rows of positions 153 .. 155 NaN
  std::vector<AttentionCudaConfig> cfgs = {ws_config(0, 0), ws_config(2, 1), ws_config(1, 3),
                                           ws_config(0, 0, kAuto)};
  for (int kernel : {4}) {  // the cp.async wgmma kernel (the fallback where TMA cannot run)
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
         {ws_config(0, 0), ws_config(3, 0), ws_config(1, 3), ws_config(0, 0, kAuto)}) {
      SCOPED_TRACE(::testing::Message() << (sparse ? "sparse " : "dense ") << describe(cfg));
      const Problem a = make_case(reqs, 64, 4, false, rng);
      Problem b = make_case(reqs, 64, 4, true, rng);  // same shapes, new contents
      ASSERT_FALSE(::testing::Test::HasFailure());
      expect_graph_replay_equals_eager(a, b, sparse, cfg);
    }
  }
}

TEST(AttentionPrefillWsGpu, NegativePersistentCtasIsRejected) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const Problem c = make_case({{0, 9}}, 16, 1, false, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceProblem d;
  upload(c, d);
  const std::vector<uint8_t> before = d.out.download_all();
  const Status s =
      run_attention_cuda(device_params(c, d, true), nullptr, 0, nullptr, ws_config(1, -1));
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(d.out.download_all() == before) << "a rejected call wrote its output";
}

}  // namespace
}  // namespace m3attn::testing::attn
