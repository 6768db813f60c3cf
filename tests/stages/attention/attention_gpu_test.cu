// GPU attention (run_attention_cuda) against the CPU twin (run_attention_cpu) on identical E4M3
// inputs: decode, verify (draft 1/3/7), chunked prefill and mixed batches, sparse and dense, every
// launch shape (tokens per tile 1 / 4 / 8, with and without splits), 16- and 4-byte-aligned strided
// pools, page ids past 2^31 bytes, junk block ids, device-side page guards, NaN propagation,
// sparse == dense (GPU vs GPU, bit for bit) with <= 16 visible blocks, CUDA-graph replay with new
// inputs == eager byte for byte, and rejected calls that write nothing. Every scenario runs the
// launch-config families of `configs` (below): the automatic plan, the mma.sync decode kernel, the
// Hopper wgmma prefill kernel (8-token tiles) and the Hopper wgmma decode / verify kernel (4-token
// tiles x 16 heads on one warpgroup: verify_variant 8, 27, 69 and 70), with and without splits; all
// must meet the same tolerance.
//
// Tolerance: kRowRelL2 = 1e-2 per (token, head) row, derived in attention_gpu_test_util.h (shared
// with the prefill kernel's tests).
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

#include "attention_gpu_test_util.h"
#include "cache/cache_view.h"
#include "core/numeric.h"
#include "core/pdl.cuh"
#include "m3attn/config.h"
#include "stages/attention/attention.h"
#include "stages/attention/attention_kernel.cuh"
#include "stages/quantize/quantize.h"
#include "support/batch_builder.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn::testing::attn {
namespace {

std::string cfg_name(const AttentionCudaConfig& c) {
  std::ostringstream os;
  os << "tokens_per_tile " << c.tokens_per_tile << " splits " << c.splits << " v_convert "
     << c.v_convert << " kernel " << c.kernel;
  if (c.verify_variant != 0) os << " verify_variant " << c.verify_variant;
  if (c.decode_kernel != 0) os << " decode_kernel " << c.decode_kernel;
  if (c.programmatic_launch) os << " programmatic";
  return os.str();
}

// Launch-config families ({tokens_per_tile, splits, v_convert, kernel, persistent_ctas,
// verify_variant, decode_kernel}; 0 = the plan's choice): kAuto the automatic
// plan; kMma the mma.sync decode kernel (1-token tiles of any batch); kPrefill the wgmma prefill
// kernel(s) kPrefillKernels (8-token tiles; the warp-specialised kernel, which the automatic plan
// runs, has its own tests); kVerify the wgmma verify kernel (4-token tiles), variants 8 (cp.async
// loads, the NaN test in every block), 69 (TMA, the two-pass V NaN test, a lazy running max, the
// first copies issued before the union is complete, a token's rows out by one bulk copy per warp,
// out_q too, the K / V copies L2 evict-first; 8 where TMA cannot address the pool; automatic
// beyond one wave), 27 (69's loop on cp.async loads, plain row stores, no cache hint) and 70 (27
// with one early copy, Q loaded for the guessed tile [4 tile, 4 tile + 4) once its ids landed,
// that tile's page-table entries read from a shared-memory copy of request `tile`'s row before the
// tile scan and used where it holds, 69's bulk rows and evict-first copies; automatic for
// one-wave grids); kMma also runs decode_kernel 2 (no early copies) and 11 (one early copy;
// automatic for one-wave grids).
// Every launch config of a family is also run with `splits` CTAs per (tile, KV head) when splits
// > 1.
enum Family : unsigned { kAuto = 1, kMma = 2, kPrefill = 4, kVerify = 8, kAll = 15 };
const std::vector<int> kPrefillKernels = {4};
std::vector<AttentionCudaConfig> configs(unsigned families, int splits) {
  std::vector<AttentionCudaConfig> v;
  auto add = [&](AttentionCudaConfig c) {
    v.push_back(c);
    c.splits = splits;
    if (splits > 1) v.push_back(c);
  };
  if (families & kAuto) v.push_back({});
  if (families & kMma) {
    add({1, 1, 1, 1});            // v_convert 1 (the only V path); the early TMA copies
    add({1, 1, 0, 1, 0, 0, 2});   // decode_kernel 2 (without the early copies)
    add({1, 1, 0, 1, 0, 0, 11});  // decode_kernel 11 (one early copy)
  }
  if (families & kPrefill)
    for (int k : kPrefillKernels) add({8, 1, 0, k});
  if (families & kVerify)
    for (int variant : {8, 27, 69, 70}) add({4, 1, 0, 5, 0, variant});
  return v;
}
const std::vector<AttentionCudaConfig> kAllConfigs = configs(kAll, 3);

// The twin once, then the GPU under every config.
void check_all_configs(Problem& pr, bool sparse, const std::string& what,
                       const std::vector<AttentionCudaConfig>& cfgs = kAllConfigs) {
  check_against_twin(pr, sparse, what, cfgs, cfg_name);
}

// ---- tests
// ---------------------------------------------------------------------------------------

TEST(AttentionGpu, DecodeMatchesTwin) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // Contexts (cached + 1) of 1, 127, 129, 2049, 5000 and 300 tokens.
  const std::vector<RequestSpec> reqs = {{0, 1},    {126, 1},  {128, 1},
                                         {2048, 1}, {4999, 1}, {299, 1}};
  for (Pick pick : {Pick::kShared, Pick::kRandom}) {
    Problem pr = make_problem(reqs, 64, 4, pick, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_all_configs(pr, true, "decode");
  }
  Problem pr = make_problem(reqs, 64, 4, Pick::kShared, rng);
  check_all_configs(pr, false, "decode");
}

TEST(AttentionGpu, LargeVerifyDraftsMatchTwin) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int draft : {1, 3, 7}) {
    SCOPED_TRACE(::testing::Message() << "draft_len " << draft);
    // Drafts that cross a block boundary (126 + 8 > 128) and long contexts.
    const std::vector<RequestSpec> reqs = {{126, 1 + draft},
                                           {0, 1 + draft},
                                           {3000, 1 + draft},
                                           {static_cast<int>(rng.integer(1, 4000)), 1 + draft}};
    for (Pick pick : {Pick::kShared, Pick::kRandom}) {
      Problem pr = make_problem(reqs, 64, 4, pick, rng);
      ASSERT_FALSE(::testing::Test::HasFailure());
      check_all_configs(pr, true, "verify");
    }
    Problem pr = make_problem(reqs, 64, 4, Pick::kShared, rng);
    check_all_configs(pr, false, "verify", configs(kAll, 3));
  }
}

TEST(AttentionGpu, LargePrefillAndMixedBatchesMatchTwin) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // A fresh prefill (from position 0: every causal mask matters), a chunk after a cached prefix
  // that is not a block multiple, a one-token chunk, then generation requests with draft 3.
  std::vector<RequestSpec> ctx = {{0, 261}, {2900, 97}, {129, 1}};
  const std::vector<RequestSpec> reqs = mixed_requests(ctx, 5, 3, 4500, rng);
  for (Pick pick : {Pick::kShared, Pick::kRandom}) {
    Problem pr = make_problem(reqs, 32, 2, pick, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_all_configs(pr, true, "mixed " + describe_requests(reqs), configs(kAll, 4));
  }
  Problem pr = make_problem(reqs, 32, 2, Pick::kShared, rng);
  check_all_configs(pr, false, "mixed", configs(kAll, 5));
}

// The wgmma prefill kernel on longer chunks: a chunk from position 0 (every causal mask), chunks
// after cached prefixes that are neither block nor tile multiples, chunk lengths off multiples of
// the 8-token tile, contexts past 16 blocks (sparse != dense), and decode rows in the same batch.
TEST(AttentionGpu, WgmmaLongChunksMatchTwin) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 333}, {1917, 120}, {4100, 41}, {3, 9}, {2500, 1}};
  for (Pick pick : {Pick::kShared, Pick::kRandom}) {
    Problem pr = make_problem(reqs, 32, 2, pick, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_all_configs(pr, true, "long chunks " + describe_requests(reqs),
                      configs(kAuto | kPrefill, 3));
  }
  Problem pr = make_problem(reqs, 16, 1, Pick::kShared, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  check_all_configs(pr, false, "long chunks", configs(kPrefill | kVerify, 2));
}

// Prints dims [0, 16) and [64, 72) of (token t, head j), GPU vs twin (failure diagnostics).
void dump_row(const Problem& pr, const DeviceProblem& d, const std::vector<uint8_t>& got, int64_t t,
              int j) {
  const uint16_t* g =
      reinterpret_cast<const uint16_t*>(got.data() + kGuard) + t * d.out_stride + j * kHeadDim;
  const uint16_t* c = pr.ref.ptr<uint16_t>() + t * pr.width() + j * kHeadDim;
  std::printf("    token %lld head %d:\n      gpu ", static_cast<long long>(t), j);
  for (int e :
       {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 64, 65, 66, 67, 68, 69, 70, 71})
    std::printf(" %.4g", bf16_to_float(g[e]));
  std::printf("\n      twin");
  for (int e :
       {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 64, 65, 66, 67, 68, 69, 70, 71})
    std::printf(" %.4g", bf16_to_float(c[e]));
  std::printf("\n");
}

// Structured inputs for the wgmma kernel, so that a failure points at one operand:
//   - zero queries: every logit is 0 and each output is the plain average of the visible V rows,
//     which checks the f16 V tile (conversion, MN-major descriptor, zeroed rows) and P V alone;
//   - one-hot queries (head j of token t reads dim (5 j + 3 t) % 128 with value 8): the logits are
//     single K entries, which checks the Q and K descriptors (a wrong row, dim or swizzle picks
//     another K entry).
// Random data then checks both together (the other tests).
TEST(AttentionGpu, WgmmaLayoutProbes) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 21}, {130, 11}, {2999, 3}};
  for (int probe = 0; probe < 2; ++probe) {
    Problem pr = make_problem(reqs, 16, 1, Pick::kShared, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    uint8_t* q = pr.q.ptr<uint8_t>();
    std::memset(q, 0, static_cast<size_t>(pr.q.nbytes()));
    if (probe == 1)
      for (int64_t t = 0; t < pr.T(); ++t)
        for (int j = 0; j < 16; ++j)
          q[(t * 16 + j) * kHeadDim + (5 * j + 3 * t) % kHeadDim] = float_to_e4m3(8.0f);
    const std::string what = probe == 0 ? "probe zero queries" : "probe one-hot queries";
    run_reference(pr, true);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    DeviceProblem d;
    upload(pr, d);
    for (const AttentionCudaConfig& cfg : configs(kPrefill | kVerify, 2)) {
      const std::vector<uint8_t> got = run_gpu(pr, d, true, cfg);
      const int failures = ::testing::Test::HasFailure() ? 1 : 0;
      const double worst = expect_matches(pr, d, got, what + ", " + cfg_name(cfg));
      std::printf("  %s %s: worst row relative L2 %.2e\n", what.c_str(), cfg_name(cfg).c_str(),
                  worst);
      if (!failures && ::testing::Test::HasFailure()) {
        dump_row(pr, d, got, 0, 0);
        dump_row(pr, d, got, 0, 9);
        dump_row(pr, d, got, 5, 3);
        dump_row(pr, d, got, pr.T() - 1, 15);
      }
    }
  }
}

TEST(AttentionGpu, SmallGroupsAndStridedPools) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 5}, {1000, 3}, {2049, 1}, {5000, 2}};
  // Group 8 (TP8: 8 query heads on one KV head) with gapped planes and pages that are multiples of
  // 16 bytes (16-byte copies), then multiples of 4 only (4-byte copies).
  const int64_t tile = int64_t{kPageSize} * kHeadDim;
  for (int64_t extra : {int64_t{64}, int64_t{20}}) {
    SCOPED_TRACE(::testing::Message() << "stride extra " << extra);
    BatchOptions o;
    o.kv_plane_stride = 1 * tile + extra;
    o.kv_page_stride = 3 * (2 * tile) + extra;
    o.spare_pages = 5;
    Problem pr = make_problem(reqs, 8, 1, Pick::kShared, rng, o);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_all_configs(pr, true, "group 8", configs(kAll, 4));
    check_all_configs(pr, false, "group 8", configs(kAll, 1));
  }
  // Group 16 on 3 KV heads, 4-byte strides.
  BatchOptions o;
  o.kv_plane_stride = 3 * tile + 4;
  o.kv_page_stride = 2 * (3 * tile) + 12;
  Problem pr = make_problem(reqs, 48, 3, Pick::kRandom, rng, o);
  ASSERT_FALSE(::testing::Test::HasFailure());
  check_all_configs(pr, true, "3 KV heads", configs(kAll, 2));
}

TEST(AttentionGpu, JunkIdsAndEmptySelectionsFollowTheTwin) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 3}, {300, 4}, {2500, 4}, {4000, 1}};
  Problem pr = make_problem(reqs, 32, 2, Pick::kJunk, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  // One (token, head) selects nothing at all: +0 outputs.
  std::fill_n(pr.ids.ptr<int32_t>() + (4 * 2 + 1) * kTopK, kTopK, -1);
  check_all_configs(pr, true, "junk ids", configs(kAll, 2));
}

TEST(AttentionGpu, SparseEqualsDenseWithAtMost16Blocks) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // Every position < 2048: at most 16 visible blocks, all of them selected.
  const std::vector<RequestSpec> reqs = {{0, 130}, {1000, 5}, {2040, 8}, {1, 1}, {1919, 4}};
  Problem pr = make_problem(reqs, 64, 4, Pick::kRandom, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  run_reference(pr, true);
  Tensor dense_ref(DType::kBF16, {pr.T(), pr.width()});
  ASSERT_TRUE(run_attention_cpu(pr.host_params(false, dense_ref)).ok());
  ASSERT_EQ(std::memcmp(dense_ref.data(), pr.ref.data(), static_cast<size_t>(pr.ref.nbytes())), 0)
      << "the twin itself breaks MSA == dense";
  DeviceProblem d;
  upload(pr, d);
  // Explicit launch shapes only: the automatic plan may legitimately split sparse and dense
  // differently (different block bounds), which changes fp32 rounding.
  for (const AttentionCudaConfig& cfg : kAllConfigs)
    if (cfg.tokens_per_tile != 0) expect_sparse_equals_dense(pr, d, cfg, cfg_name(cfg));
}

TEST(AttentionGpu, LargePoolPageIdsPast2To31Bytes) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{3000, 1}, {0, 40}, {700, 4}};
  Problem pr = make_problem(reqs, 16, 1, Pick::kShared, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  run_reference(pr, true);
  DeviceProblem d;
  upload(pr, d);
  // The same pages, shifted up by 65536 pages of 32 KB (2^31 bytes) in a larger device pool.
  DeviceBuffer big;
  ASSERT_NO_FATAL_FAILURE(move_pool_past_2_31_bytes(pr, d, &big));
  expect_configs_match(pr, d, true, configs(kAll, 3), "pages past 2^31 bytes, ", cfg_name);
}

TEST(AttentionGpu, OutOfPoolPageIdsAreSkippedOnDevice) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // Second set: 4-token requests, where verify 70 reads request 1's page-table entries before the
  // tile scan (its guessed tile holds) and drops the corrupt entries after it.
  for (const std::vector<RequestSpec>& reqs : {std::vector<RequestSpec>{{2600, 1}, {3100, 4}},
                                               std::vector<RequestSpec>{{2600, 4}, {3100, 4}}}) {
    Problem pr = make_problem(reqs, 16, 1, Pick::kShared, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    DeviceProblem d;
    upload(pr, d);
    // Corrupt two page-table entries of blocks that request 1 selects (not its local block): the
    // GPU must skip them, i.e. equal the twin on ids without those blocks.
    const int r = 1;
    const int64_t t0 = pr.hb.batch_view().query_start.ptr<int32_t>()[r];
    const int32_t* sel = pr.ids.ptr<int32_t>() + t0 * kTopK;
    const int32_t bad0 = sel[0], bad1 = sel[3];
    Tensor table = pr.hb.page_table.clone();
    table.ptr<int32_t>()[int64_t{r} * pr.hb.max_pages() + bad0] = -3;
    table.ptr<int32_t>()[int64_t{r} * pr.hb.max_pages() + bad1] =
        static_cast<int32_t>(pr.hb.num_pages() + 1000);
    d.table.upload(table.data(), static_cast<size_t>(table.nbytes()));
    for (int64_t t = t0; t < pr.T(); ++t)
      for (int k = 0; k < kTopK; ++k) {
        int32_t& id = pr.ids.ptr<int32_t>()[t * kTopK + k];
        if (id == bad0 || id == bad1) id = -1;
      }
    run_reference(pr, true);
    // d.ids still has bad0, bad1.
    expect_configs_match(pr, d, true, configs(kAll, 4), "corrupt page table, ", cfg_name);
  }
}

TEST(AttentionGpu, NaNInAVisibleValuePropagates) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{200, 2}, {40, 1}};
  Problem pr = make_problem(reqs, 16, 1, Pick::kShared, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  pr.hb.kv_row(0, 150, 1, 0)[17] = 0x7F;  // V of position 150 of request 0: NaN
  check_all_configs(pr, true, "NaN value", configs(kAll, 2));
}

// A NaN V element that some tokens of a tile see and others do not (a draft token's own key in
// the local block, future for the earlier drafts; blocks that only some tokens select): the twin
// puts NaN exactly in that dim of the tokens that see the key, nothing in the others. A NaN K
// element makes the whole rows of the tokens that see it NaN. Every kernel that shares a block
// between tokens must keep those apart (P = 0 and 0 * NaN must never meet), the wgmma prefill
// kernels 2-4 included (they keep a V NaN in the rows that see it since session 12).
TEST(AttentionGpu, NaNStaysInTheRowsThatSeeIt) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // Request 0: positions 148 .. 151; request 1: 126 .. 129 (crosses a block); request 2: long
  // context with per-token selections; request 3: decode.
  const std::vector<RequestSpec> reqs = {{148, 4}, {126, 4}, {4000, 4}, {2500, 1}};
  for (Pick pick : {Pick::kShared, Pick::kRandom}) {
    Problem pr = make_problem(reqs, 32, 2, pick, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    pr.hb.kv_row(0, 150, 1, 0)[17] = 0x7F;   // seen by positions 150, 151 only
    pr.hb.kv_row(0, 151, 1, 1)[100] = 0xFF;  // by 151 only (head 1)
    pr.hb.kv_row(1, 127, 1, 0)[3] = 0x7F;    // by 127, 128, 129
    pr.hb.kv_row(1, 128, 1, 1)[64] = 0x7F;   // by 128, 129 (other block)
    for (int k = 0; k < 6; ++k) {            // in blocks some tokens of request 2 select
      const int pos = static_cast<int>(rng.integer(0, 3999));
      pr.hb.kv_row(2, pos, 1, k & 1)[rng.integer(0, 127)] = 0xFF;
    }
    pr.hb.kv_row(2, static_cast<int>(rng.integer(0, 3999)), 0, 1)[9] = 0x7F;  // a K NaN
    pr.hb.kv_row(0, 151, 0, 0)[40] = 0x7F;  // K NaN seen only by position 151
    check_all_configs(pr, true, "NaN in some tokens' keys", configs(kAll, 3));
    check_all_configs(pr, false, "NaN in some tokens' keys", configs(kAll, 2));
  }
}

// A small problem for the sanitizers (memcheck, racecheck): the wgmma verify kernel with and
// without splits, its NaN path, and the mma.sync decode kernel (both variants). The guessed tile
// [4 tile, 4 tile + 4) (verify 70: Q loaded early and the page-table reads of request `tile`'s
// row before the tile scan) is right for tiles 0-3 and wrong for tiles 4-6 (Q and ids loaded
// again); tiles 1-3 are not request `tile`'s (70 reads the pages again), tile 0 is; tiles 7 and 8
// are absent.
TEST(AttentionGpu, SanitizerSmallVerify) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{300, 8}, {148, 4}, {2100, 7}, {700, 3}, {40, 1}};
  Problem pr = make_problem(reqs, 32, 2, Pick::kRandom, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  pr.hb.kv_row(1, 150, 1, 0)[17] = 0x7F;
  check_all_configs(pr, true, "sanitizer", configs(kMma | kVerify, 3));
}

TEST(AttentionGpu, GraphReplayWithNewInputsEqualsEager) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{0, 37}, {1500, 4}, {4000, 4}, {90, 4}};
  for (bool sparse : {true, false}) {
    for (const AttentionCudaConfig& cfg : configs(kAll, 3)) {
      SCOPED_TRACE(::testing::Message() << (sparse ? "sparse " : "dense ") << cfg_name(cfg));
      const Problem a = make_problem(reqs, 64, 4, Pick::kShared, rng);
      Problem b = make_problem(reqs, 64, 4, Pick::kRandom, rng);  // same shapes, new contents
      ASSERT_FALSE(::testing::Test::HasFailure());
      expect_graph_replay_equals_eager(a, b, sparse, cfg);
    }
  }
}

// A slow byte copy (one CTA) that lets its dependents launch at once: a programmatically launched
// kernel behind it runs concurrently and sees the copied bytes only through its
// griddepcontrol.wait. Its own wait (after its copy: it writes nothing the kernel before it reads)
// keeps the chain: its completion implies that of the kernel before it.
__global__ void early_trigger_copy(const uint8_t* src, uint8_t* dst, size_t n) {
  pdl_launch_dependents();
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  pdl_wait();
}

// Programmatic launches (AttentionCudaConfig::programmatic_launch) write the same bytes as plain
// ones: eager, and captured in a graph behind kernels that write the inputs (copies of the block
// ids and Q into the buffers the attention reads), so the wait before those reads matters.
TEST(AttentionGpu, ProgrammaticLaunchEqualsPlain) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> decode = {{0, 1}, {1500, 1}, {4000, 1}, {129, 1}, {700, 1}};
  const std::vector<RequestSpec> verify = {{0, 4}, {1500, 4}, {4000, 4}, {90, 4}};
  for (const std::vector<RequestSpec>* reqs : {&decode, &verify}) {
    for (AttentionCudaConfig cfg : configs(kAuto | kMma | kVerify, 3)) {
      if (cfg.tokens_per_tile > 1 && reqs == &decode) continue;
      SCOPED_TRACE(::testing::Message() << describe_requests(*reqs) << " " << cfg_name(cfg));
      Problem pr = make_problem(*reqs, 64, 4, Pick::kRandom, rng);
      ASSERT_FALSE(::testing::Test::HasFailure());
      DeviceProblem d;
      upload(pr, d);
      AttentionParams p = device_params(pr, d, true);
      const size_t ws_bytes = make_workspace(d, p, cfg);
      cudaStream_t stream;
      M3_CUDA_TEST_CHECK(cudaStreamCreate(&stream));
      cfg.programmatic_launch = false;
      d.out.poison(kPoison);
      ASSERT_TRUE(run_attention_cuda(p, d.ws.data(), ws_bytes, stream, cfg).ok());
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      const std::vector<uint8_t> plain = d.out.download_all();
      cfg.programmatic_launch = true;
      d.out.poison(kPoison);
      d.ws.poison(0xFF);
      ASSERT_TRUE(run_attention_cuda(p, d.ws.data(), ws_bytes, stream, cfg).ok());
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      EXPECT_TRUE(d.out.download_all() == plain) << "programmatic eager differs from plain";
      // Graph: copies that (re)write the ids and Q from staging copies, then the attention.
      DeviceBuffer ids_src(static_cast<size_t>(pr.ids.nbytes()), 0);
      DeviceBuffer q_src(static_cast<size_t>(pr.q.nbytes()), 0);
      ids_src.upload(pr.ids.data(), static_cast<size_t>(pr.ids.nbytes()));
      q_src.upload(pr.q.data(), static_cast<size_t>(pr.q.nbytes()));
      d.ids.poison(0xFF);  // ids -1 and Q NaN until the copies in the graph run
      d.q.poison(0x7F);
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      M3_CUDA_TEST_CHECK(launch_pdl(early_trigger_copy, dim3(1), dim3(128), 0, stream, true,
                                    static_cast<const uint8_t*>(q_src.data()),
                                    static_cast<uint8_t*>(d.q.data()), q_src.bytes()));
      M3_CUDA_TEST_CHECK(launch_pdl(early_trigger_copy, dim3(1), dim3(128), 0, stream, true,
                                    static_cast<const uint8_t*>(ids_src.data()),
                                    static_cast<uint8_t*>(d.ids.data()), ids_src.bytes()));
      const Status s = run_attention_cuda(p, d.ws.data(), ws_bytes, stream, cfg);
      M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
      ASSERT_TRUE(s.ok()) << s.to_string();
      M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      d.out.poison(kPoison);
      d.ws.poison(0xFF);
      M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      EXPECT_TRUE(d.out.download_all() == plain) << "programmatic graph replay differs from plain";
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(stream);
    }
  }
}

// o_proj's E4M3 input written by the attention (AttentionParams::out_q / out_scales) equals the
// quantize stage run on the attention's own BF16 output, byte for byte, for every kernel (fused
// epilogues: the 8-warp decode kernel, the wgmma verify kernel, the split merge; the others run
// the quantize stage behind them), with T % 4 != 0 and spare rows past M_pad's round-up (padding
// rows must become q = 0, scale 1 even when they held data), scales with strides (1, M_pad), and
// NaN outputs (a NaN V) kept as NaN codes. The BF16 output is the same with and without out_q.
TEST(AttentionGpu, QuantizedOutputEqualsQuantizeStage) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  std::vector<RequestSpec> decode;  // 61 tokens
  for (int i = 0; i < 61; ++i) decode.push_back({static_cast<int>(rng.integer(0, 5000)), 1});
  const std::vector<RequestSpec> verify = {{0, 4}, {1500, 4}, {4000, 4}, {90, 4}, {77, 1}};
  const std::vector<RequestSpec> mixed = {{0, 37}, {1500, 4}};
  struct Scenario {
    const std::vector<RequestSpec>* reqs;
    std::vector<AttentionCudaConfig> cfgs;
    bool nan;
  };
  const std::vector<Scenario> scenarios = {
      {&decode, configs(kAuto | kMma, 3), false},           {&decode, configs(kMma, 2), true},
      {&verify, configs(kAuto | kVerify | kMma, 2), false}, {&verify, configs(kVerify, 3), true},
      {&mixed, configs(kAuto | kPrefill, 2), false},
  };
  const Device dev = Device::cuda(0);
  for (const Scenario& sc : scenarios) {
    Problem pr = make_problem(*sc.reqs, 64, 4, Pick::kShared, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    if (sc.nan) {  // a NaN in a V row the first token sees (its own position: the local block)
      pr.hb.kv_row(0, pr.hb.positions.ptr<int32_t>()[0], 1, 2)[5] = 0x7F;  // V, KV head 2
    }
    DeviceProblem d;
    upload(pr, d);
    const int64_t T = pr.T(), heads = pr.n_q, m_pad = (T + 3) / 4 * 4 + 4;
    const int64_t width = heads * kHeadDim;
    for (const AttentionCudaConfig& cfg : sc.cfgs) {
      SCOPED_TRACE(::testing::Message() << describe_requests(*sc.reqs) << " " << cfg_name(cfg)
                                        << (sc.nan ? " NaN" : ""));
      const std::vector<uint8_t> plain = run_gpu(pr, d, true, cfg);
      AttentionParams p = device_params(pr, d, true);
      DeviceBuffer q8(static_cast<size_t>(m_pad * width), 0x5A);
      DeviceBuffer scales(static_cast<size_t>(m_pad * heads * 4), 0x5A);
      p.out_q = TensorView::contiguous(q8.data(), DType::kE4M3, {m_pad, width}, dev);
      p.out_scales =
          TensorView::strided(scales.data(), DType::kF32, {m_pad, heads}, {1, m_pad}, dev);
      const size_t ws_bytes = make_workspace(d, p, cfg);
      d.out.poison(kPoison);
      const Status st = run_attention_cuda(p, d.ws.data(), ws_bytes, nullptr, cfg);
      ASSERT_TRUE(st.ok()) << st.to_string();
      M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(d.out.download_all() == plain) << "BF16 output changed by out_q";
      // The quantize stage on the same BF16 output.
      DeviceBuffer rq(static_cast<size_t>(m_pad * width), 0x33);
      DeviceBuffer rs(static_cast<size_t>(m_pad * heads * 4), 0x33);
      QuantizeParams qp;
      qp.rows = T;
      qp.in = p.out;
      qp.out = TensorView::contiguous(rq.data(), DType::kE4M3, {m_pad, width}, dev);
      qp.scales = TensorView::strided(rs.data(), DType::kF32, {m_pad, heads}, {1, m_pad}, dev);
      ASSERT_TRUE(run_quantize_cuda(qp, nullptr).ok());
      M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
      const std::vector<uint8_t> got_q = q8.download_all(), ref_q = rq.download_all();
      const std::vector<uint8_t> got_s = scales.download_all(), ref_s = rs.download_all();
      int64_t bad = 0, first = -1;
      for (size_t i = 0; i < got_q.size(); ++i)
        if (got_q[i] != ref_q[i] && bad++ == 0) first = static_cast<int64_t>(i);
      EXPECT_EQ(bad, 0) << "out_q bytes differ, first at row " << first / width << " column "
                        << first % width;
      EXPECT_TRUE(got_s == ref_s) << "out_scales differ";
      if (sc.nan) {
        bool any_nan = false;
        for (size_t i = 0; i < static_cast<size_t>(width); ++i)
          any_nan |= (got_q[i] & 0x7F) == 0x7F;
        EXPECT_TRUE(any_nan) << "the NaN output of token 0 is not a NaN code";
      }
    }
  }
}

// ak::quant_code (x * fl(1 / scale), the IEEE division only near an E4M3 rounding midpoint, below
// 2^-6 or for non-finite values) against the quantize stage's e4m3(x / scale): every BF16 x (the
// epilogues quantize BF16 outputs) under the scales of every 16th positive finite BF16 amax, of
// amax values right at those, and of random fp32 scales; counts of the disagreements (must be 0)
// and, among the values of E4M3's normal range (2^-6 <= |x / scale| <= 448: an attention output
// row away from its tiny entries), of those that took the division (must be rare).
__global__ void quant_code_vs_division(const float* scales, int n_scales, unsigned long long* cnt) {
  const int si = blockIdx.y;
  if (si >= n_scales) return;
  const float sc = scales[si], rcp = attention_kernel::quant_rcp(sc);
  unsigned long long nb = 0, nn = 0, ns = 0;
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < 65536; b += gridDim.x * blockDim.x) {
    const float x = __uint_as_float(static_cast<uint32_t>(b) << 16);
    const uint32_t want = float_to_e4m3(__fdiv_rn(x, sc));
    const uint32_t got = attention_kernel::quant_code(x, sc, rcp);
    const bool x_nan = x != x;  // NaN codes may differ in sign only (canonical NaN both ways)
    nb += (got != want && !(x_nan && (got & 0x7f) == 0x7f && (want & 0x7f) == 0x7f)) ? 1 : 0;
    const float r = fabsf(__fdiv_rn(x, sc));
    if (r >= 0.015625f && r <= 448.0f) {
      const uint32_t u = __float_as_uint(__fmul_rn(x, rcp)) & 0x7fffffffu;
      ++nn;
      ns += (u < 0x3c800000u || (u & 0xfffffu) - 0x7fff8u <= 16u) ? 1 : 0;
    }
  }
  atomicAdd(&cnt[0], nb);
  atomicAdd(&cnt[1], nn);
  atomicAdd(&cnt[2], ns);
}

TEST(AttentionGpu, QuantCodeWithoutDivisionEqualsDivision) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  std::vector<float> sc;
  for (uint32_t b = 1; b < 0x7f80u; b += 16) {  // positive finite BF16 amax, scale = amax / 448
    const float amax = bf16_to_float(static_cast<uint16_t>(b));
    sc.push_back(amax / 448.0f);
    sc.push_back(std::nextafter(amax / 448.0f, 1.0f));
  }
  for (int i = 0; i < 512; ++i)
    sc.push_back(std::ldexp(rng.uniform(1.0f, 2.0f), static_cast<int>(rng.integer(0, 80)) - 40));
  sc.push_back(1.0f);
  DeviceBuffer d_sc(sc.size() * sizeof(float), 0);
  M3_CUDA_TEST_CHECK(
      cudaMemcpy(d_sc.data(), sc.data(), sc.size() * sizeof(float), cudaMemcpyHostToDevice));
  DeviceBuffer d_cnt(3 * sizeof(unsigned long long), 0);
  auto* cnt = static_cast<unsigned long long*>(d_cnt.data());
  quant_code_vs_division<<<dim3(64, static_cast<unsigned>(sc.size())), 256>>>(
      static_cast<const float*>(d_sc.data()), static_cast<int>(sc.size()), cnt);
  M3_CUDA_TEST_CHECK(cudaGetLastError());
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  unsigned long long h[3] = {0, 0, 0};
  M3_CUDA_TEST_CHECK(cudaMemcpy(h, cnt, sizeof(h), cudaMemcpyDeviceToHost));
  std::printf(
      "  quant_code: %zu scales x 65536 BF16 values: %llu disagreements; %llu of %llu values of "
      "E4M3's normal range took the division\n",
      sc.size(), h[0], h[2], h[1]);
  EXPECT_EQ(h[0], 0ull);
  EXPECT_GT(h[1], 0ull);
  // (exact E4M3 midpoints are common among quotients of BF16 values: 0.44 % over every BF16 amax on
  // the host; the division decides those ties)
  EXPECT_LT(static_cast<double>(h[2]), 0.02 * static_cast<double>(h[1]));
}

TEST(AttentionGpu, WorkspaceBoundCoversEveryAutomaticPlan) {
  M3_REQUIRE_GPU();
  const size_t bound = attention_workspace_bound();
  size_t worst = 0;
  for (int n_kv : {1, 2, 4, 8}) {
    for (bool sparse : {true, false}) {
      for (int max_pages : {1, 16, 17, 1024}) {
        for (int64_t T = 1; T <= 4096; T += (T < 300 ? 1 : 97)) {
          for (int64_t R : {int64_t{1}, int64_t{2}, int64_t{3}, T / 4 + 1, T / 2 + 1, T}) {
            if (R > T) continue;
            AttentionParams p;
            p.n_q = 16 * n_kv;
            p.n_kv = n_kv;
            p.sparse = sparse;
            p.batch.num_tokens = T;
            p.batch.num_requests = static_cast<int>(R);
            p.batch.max_pages = max_pages;
            for (int kernel : {0, 1, 4, 5}) {
              AttentionCudaConfig cfg;
              cfg.kernel = kernel;
              const size_t need = attention_workspace_bytes(p, cfg);
              worst = std::max(worst, need);
              ASSERT_LE(need, bound)
                  << "T " << T << " R " << R << " n_kv " << n_kv << " max_pages " << max_pages
                  << (sparse ? " sparse" : " dense") << " kernel " << kernel;
            }
          }
        }
      }
    }
  }
  std::printf("  workspace bound %zu bytes, largest automatic plan %zu bytes\n", bound, worst);
}

TEST(AttentionGpu, RejectedCallsWriteNothing) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{10, 2}, {300, 1}};
  Problem pr = make_problem(reqs, 64, 4, Pick::kShared, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceProblem d;
  upload(pr, d);
  const std::vector<uint8_t> pristine(d.out_bytes + 2 * kGuard, kPoison);
  auto expect_rejected = [&](const AttentionParams& p, void* ws, size_t ws_bytes,
                             const AttentionCudaConfig& cfg, StatusCode code, const char* what) {
    d.out.poison(kPoison);
    const Status s = run_attention_cuda(p, ws, ws_bytes, nullptr, cfg);
    EXPECT_EQ(s.code(), code) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty()) << what;
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(d.out.download_all() == pristine) << what << ": output written";
  };
  const AttentionParams good = device_params(pr, d, true);
  DeviceBuffer ws(1 << 20, 0xFF);

  AttentionParams p = good;
  p.q.device = Device::cpu();
  p.kv_cache.device = Device::cpu();
  p.block_ids.device = Device::cpu();
  p.out.device = Device::cpu();
  p.batch.query_start.device = p.batch.positions.device = p.batch.seq_lens.device =
      p.batch.page_table.device = Device::cpu();
  expect_rejected(p, ws.data(), ws.bytes(), {}, StatusCode::kInvalidArgument, "host views");

  p = good;
  p.q.device = Device::cpu();
  expect_rejected(p, ws.data(), ws.bytes(), {}, StatusCode::kInvalidArgument, "mixed devices");

  expect_rejected(good, ws.data(), 64, {1, 4}, StatusCode::kInvalidArgument, "small workspace");
  expect_rejected(good, nullptr, 0, {1, 4}, StatusCode::kInvalidArgument, "no workspace");
  expect_rejected(good, static_cast<uint8_t*>(ws.data()) + 4, ws.bytes() - 4, {1, 4},
                  StatusCode::kInvalidArgument, "misaligned workspace");
  expect_rejected(good, ws.data(), ws.bytes(), {3, 1}, StatusCode::kUnsupported,
                  "3 tokens per tile");
  expect_rejected(good, ws.data(), ws.bytes(), {1, 129}, StatusCode::kUnsupported, "129 splits");
  expect_rejected(good, ws.data(), ws.bytes(), {2, 1, 2}, StatusCode::kUnsupported,
                  "f16 V tile with 2 tokens per tile");
  expect_rejected(good, ws.data(), ws.bytes(), {4, 1, 3}, StatusCode::kUnsupported, "v_convert 3");
  expect_rejected(good, ws.data(), ws.bytes(), {8, 1, 0, 1}, StatusCode::kUnsupported,
                  "8 tokens per tile on the mma.sync kernel");
  expect_rejected(good, ws.data(), ws.bytes(), {4, 1, 0, 4}, StatusCode::kUnsupported,
                  "4 tokens per tile on the wgmma kernel");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 1, 4}, StatusCode::kUnsupported,
                  "v_convert on the wgmma kernel");
  expect_rejected(good, ws.data(), ws.bytes(), {4, 1, 2}, StatusCode::kUnsupported,
                  "v_convert 2 (the removed f16 V tile)");
  expect_rejected(good, ws.data(), ws.bytes(), {8, 1, 0, 5}, StatusCode::kUnsupported,
                  "8 tokens per tile on the wgmma verify kernel");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 2, 5}, StatusCode::kUnsupported,
                  "v_convert on the wgmma verify kernel");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 99}, StatusCode::kUnsupported,
                  "kernel 99");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 11}, StatusCode::kUnsupported,
                  "kernel 11 (removed in session 14)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, -1}, StatusCode::kUnsupported,
                  "kernel -1");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 10}, StatusCode::kUnsupported,
                  "verify_variant 10 (part of 9 since session 14)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 3}, StatusCode::kUnsupported,
                  "verify_variant 3 (deleted)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 11}, StatusCode::kUnsupported,
                  "verify_variant 11 (two warpgroups, removed in session 15)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 9}, StatusCode::kUnsupported,
                  "verify_variant 9 (13 without the lazy max, removed in session 15)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 14}, StatusCode::kUnsupported,
                  "verify_variant 14 (the early refill, removed in session 15)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 15}, StatusCode::kUnsupported,
                  "verify_variant 15 (the staged epilogue, removed in session 15)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 13}, StatusCode::kUnsupported,
                  "verify_variant 13 (17 without the session-16 changes, removed in session 16)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 18}, StatusCode::kUnsupported,
                  "verify_variant 18 (the speculative row max, removed in session 16)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 17}, StatusCode::kUnsupported,
                  "verify_variant 17 (21 without the early copies, removed in session 17)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 26}, StatusCode::kUnsupported,
                  "verify_variant 26 (27 without the early copies, removed in session 17)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 24}, StatusCode::kUnsupported,
                  "verify_variant 24 (the tail's L2 prefetch, removed in session 17)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 22}, StatusCode::kUnsupported,
                  "verify_variant 22 (S waited for at once, removed in session 17)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 23}, StatusCode::kUnsupported,
                  "verify_variant 23 (the refill before the block wait, removed in session 17)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 28}, StatusCode::kUnsupported,
                  "verify_variant 28 (the lean block, removed in session 18)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 31}, StatusCode::kUnsupported,
                  "verify_variant 31 (three early copies, removed in session 18)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 36}, StatusCode::kUnsupported,
                  "verify_variant 36 (21 with one early copy, removed in session 18)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 34}, StatusCode::kUnsupported,
                  "verify_variant 34 (42 without the early Q, removed in session 19)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 42}, StatusCode::kUnsupported,
                  "verify_variant 42 (52 without the bulk-copied rows, removed in session 20)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 21}, StatusCode::kUnsupported,
                  "verify_variant 21 (53 without the bulk-copied rows, removed in session 20)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 54}, StatusCode::kUnsupported,
                  "verify_variant 54 (the quarter ring, removed in session 20)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 52}, StatusCode::kUnsupported,
                  "verify_variant 52 (70 before session 21's front and epilogue, removed)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 53}, StatusCode::kUnsupported,
                  "verify_variant 53 (69 before session 21's epilogue, removed in session 21)");
  expect_rejected(good, ws.data(), ws.bytes(), {0, 1, 0, 5, 0, 67}, StatusCode::kUnsupported,
                  "verify_variant 67 (70 without the row copy, removed in session 21)");
  expect_rejected(good, ws.data(), ws.bytes(), {1, 1, 0, 1, 0, 0, 8}, StatusCode::kUnsupported,
                  "decode_kernel 8 (the page-table prefetch, removed in session 17)");
  expect_rejected(
      good, ws.data(), ws.bytes(), {1, 1, 0, 1, 0, 0, 9}, StatusCode::kUnsupported,
      "decode_kernel 9 (the refill at the end of the iteration, removed in session 17)");
  expect_rejected(good, ws.data(), ws.bytes(), {1, 1, 0, 1, 0, 0, 5}, StatusCode::kUnsupported,
                  "decode_kernel 5 (Q converted before the block list, removed in session 16)");
  expect_rejected(good, ws.data(), ws.bytes(), {1, 1, 0, 1, 0, 0, 4}, StatusCode::kUnsupported,
                  "decode_kernel 4 (TMA loads, removed in session 15)");
  expect_rejected(good, ws.data(), ws.bytes(), {1, 1, 0, 1, 0, 0, 3}, StatusCode::kUnsupported,
                  "decode_kernel 3 (two barriers per block, removed in session 14)");
  expect_rejected(good, ws.data(), ws.bytes(), {1, 1, 0, 1, 0, 0, 1}, StatusCode::kUnsupported,
                  "decode_kernel 1 (the 4-warp tile kernel, removed in session 14)");
  expect_rejected(good, ws.data(), ws.bytes(), {2, 1, 0, 1}, StatusCode::kUnsupported,
                  "2 tokens per tile on the mma.sync kernel (removed in session 14)");
  expect_rejected(good, ws.data(), ws.bytes(), {4, 1, 1, 1}, StatusCode::kUnsupported,
                  "4 tokens per tile on the mma.sync kernel (removed in session 14)");

  p = good;  // group 32 (n_q 64 on 2 KV heads): more rows than one MMA tile
  p.n_kv = 2;
  p.kv_cache = make_kv_cache_view(d.pool.data(), pr.hb.num_pages(), 2, pr.hb.kv_page_stride(),
                                  pr.hb.kv_plane_stride(), Device::cuda(0));
  p.block_ids =
      TensorView::contiguous(d.ids.data(), DType::kI32, {pr.T(), 2, kTopK}, Device::cuda(0));
  expect_rejected(p, ws.data(), ws.bytes(), {}, StatusCode::kUnsupported, "group 32");

  p = good;
  p.q.data = static_cast<uint8_t*>(p.q.data) + 4;
  expect_rejected(p, ws.data(), ws.bytes(), {}, StatusCode::kInvalidArgument, "misaligned q");

  p = good;
  p.kv_cache.stride[0] = 6;
  expect_rejected(p, ws.data(), ws.bytes(), {}, StatusCode::kInvalidArgument, "bad page stride");

  p = good;
  p.block_ids.dtype = DType::kF32;
  expect_rejected(p, ws.data(), ws.bytes(), {}, StatusCode::kInvalidArgument, "f32 block ids");

  // Zero tokens: nothing launched, nothing written, OK.
  p = good;
  p.batch.num_tokens = 0;
  p.batch.positions.shape[0] = 0;
  p.q.shape[0] = 0;
  p.block_ids.shape[0] = 0;
  p.out.shape[0] = 0;
  d.out.poison(kPoison);
  EXPECT_TRUE(run_attention_cuda(p, nullptr, 0, nullptr, {}).ok());
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(d.out.download_all() == pristine);
}

}  // namespace
}  // namespace m3attn::testing::attn
