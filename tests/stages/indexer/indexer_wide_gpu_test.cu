// GPU tests of the wide selection (IndexerCudaOptions::wide_select, select_wide_kernel: one CTA of
// 4 / 8 / 16 warps per row of more than 64 candidates) against the CPU twin and against one warp
// per row (select_kernel, wide_select -1): batches of 1-3 generation requests at long contexts,
// draft lengths 0 / 1 / 3 / 7, integer inputs (block maxima full of exact ties, also across the
// warps' shares and the passes), NaN blocks, rows of all-equal scores, rows with fewer than 15
// groups holding a non-NaN candidate (more survivors than the kernel ranks: the sorted-list
// fallback), and CUDA-graph replay; and the grid without overflow tiles at few tokens
// (IndexerCudaOptions::overflow_tiles_always) on every scorer path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

IndexerCudaOptions wide_in(int warps) {
  IndexerCudaOptions o;
  o.wide_select = warps;
  return o;
}

// Generation requests of 1 + draft tokens whose sequences are `contexts` long.
std::vector<RequestSpec> generation(const std::vector<int>& contexts, int draft) {
  std::vector<RequestSpec> reqs;
  for (int ctx : contexts) reqs.push_back({ctx - (1 + draft), 1 + draft});
  return reqs;
}

struct Variant {
  IndexerCudaOptions o;
  std::string name;
};

// Each variant on the uploaded inputs against the twin (exact where the inputs are integers) and
// against `one` (one warp per row), id for id.
void expect_variants(const Inputs& in, const Reference& ref, DeviceSet& d, const GpuResult& one,
                     const std::vector<Variant>& vs, const std::string& label) {
  for (const Variant& v : vs) {
    const GpuResult g = run_gpu(d, v.o);
    compare(in, ref, g, in.integer, label + " [" + v.name + "]");
    expect_same_ids(in, g, one, label + " [" + v.name + " vs one warp per row]");
  }
}

// The default options (automatic: the wide selection at <= 32 rows), the wide selection forced at
// 4, 8 and 16 warps per row, and the fused path with many splits plus 8 warps: each against the
// twin and against one warp per row (expect_variants).
void check_wide(const Inputs& in, const std::string& label) {
  const Reference ref = reference(in);
  DeviceSet d;
  upload(in, d);
  ASSERT_GT(in.max_pages(), 64);
  const GpuResult one = run_gpu(d, wide_in(-1));
  compare(in, ref, one, in.integer, label + " [one warp per row]");
  std::vector<Variant> vs = {{IndexerCudaOptions{}, "default"},
                             {wide_in(4), "wide 4"},
                             {wide_in(8), "wide 8"},
                             {wide_in(16), "wide 16"}};
  IndexerCudaOptions many = wide_in(8);
  many.fused_decode_always = true;
  many.k_splits = 1000;  // chunks of 4 blocks: every split edge inside a warp's share
  vs.push_back({many, "wide 8, fused k_splits 1000"});
  IndexerCudaOptions two = wide_in(16);
  two.unfused_decode = true;
  vs.push_back({two, "wide 16, two-kernel"});
  IndexerCudaOptions ovf = wide_in(8);
  ovf.overflow_tiles_always = true;  // the former grid
  vs.push_back({ovf, "wide 8, overflow tiles"});
  expect_variants(in, ref, d, one, vs, label);
}

// Small (the sanitizers run it): batch 1 at 65 blocks (8K + 1: rows of 64 candidates) and at 12K,
// batch 2, drafts 0 and 3, integer inputs with NaN blocks.
TEST(IndexerGpu, WideSelectionSmall) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int draft : {0, 3}) {
    for (const std::vector<int>& ctx :
         {std::vector<int>{8193}, std::vector<int>{12000}, std::vector<int>{12000, 9000}}) {
      Inputs in = make_inputs(generation(ctx, draft), 4, rng, /*integer=*/true);
      ASSERT_FALSE(::testing::Test::HasFailure());
      for (int b : {3, 40, 63}) in.hb.index_row(0, b * 128 + 11)[7] = 0x7f;  // NaN blocks
      check_wide(in, "wide small draft " + std::to_string(draft) + " " +
                         mt::describe_requests(generation(ctx, draft)));
    }
  }
}

// The sanitizers' case: one request at 12000 tokens, draft 3 (16 rows of 93 candidates), and one
// at 20000 with NaN in every block whose id is >= 14 mod 32 (70 candidates in 14 groups: the
// threshold is 0, all 70 survive, more than the kernel ranks: the sorted-list fallback); integer
// inputs; the default (8 warps), 4 and 16 warps, each against one warp per row and the twin.
TEST(IndexerGpu, WideSelectionSanitizerSmall) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (bool few : {false, true}) {
    Inputs in = make_inputs(generation({few ? 20000 : 12000}, 3), 4, rng, /*integer=*/true);
    ASSERT_FALSE(::testing::Test::HasFailure());
    if (few)
      for (int b = 0; b * 128 < in.hb.seq_len(0); ++b)
        if (b % 32 >= 14) in.hb.index_row(0, b * 128 + 3)[1] = 0x7f;
    const Reference ref = reference(in);
    DeviceSet d;
    upload(in, d);
    const std::string label = few ? "wide sanitizer, 14 groups" : "wide sanitizer";
    const GpuResult one = run_gpu(d, wide_in(-1));
    expect_variants(
        in, ref, d, one,
        {{IndexerCudaOptions{}, "default"}, {wide_in(4), "wide 4"}, {wide_in(16), "wide 16"}},
        label);
  }
}

// Batches of 1-3 generation requests at 8K + 1, 32K, 65537 and 100000 tokens (rows of 64 to 781
// candidates: one pass, and two passes of the 4-warp CTA at 100000), drafts 0 / 1 / 3 / 7 (4 to
// 96 rows), integer inputs (exact ties) and, at draft 1, normal ones.
TEST(IndexerGpu, WideSelectionBatchOneLongContexts) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<std::vector<int>> batches = {{65537}, {100000},      {32768},
                                                 {8193},  {32768, 8193}, {65537, 20000, 8193}};
  for (int draft : {0, 1, 3, 7}) {
    for (const std::vector<int>& ctx : batches) {
      const bool integer = draft != 1;
      const Inputs in = make_inputs(generation(ctx, draft), 4, rng, integer);
      ASSERT_FALSE(::testing::Test::HasFailure());
      check_wide(in, std::string("wide ") + (integer ? "integer" : "normal") + " draft " +
                         std::to_string(draft) + " " +
                         mt::describe_requests(generation(ctx, draft)));
    }
  }
}

// Rows built against the threshold: every index-K value of request 0 zero (every block max 0: a
// 15-way tie decided by ids alone), request 1 NaN in every block whose id is >= 10 mod 32 (10
// groups hold candidates, so the threshold is 0 and ~160 keys survive: the sorted-list
// fallback), request 2 NaN in all but 7 blocks (fewer than 15 candidates).
TEST(IndexerGpu, WideSelectionTiesAndFewGroups) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int draft : {0, 3}) {
    const std::vector<RequestSpec> reqs = generation({65537, 65537, 40000}, draft);
    Inputs in = make_inputs(reqs, 4, rng, /*integer=*/true);
    ASSERT_FALSE(::testing::Test::HasFailure());
    for (int pos = 0; pos < in.hb.seq_len(0); ++pos)
      std::memset(in.hb.index_row(0, pos), 0, kHeadDim);
    for (int b = 0; b * 128 < in.hb.seq_len(1); ++b)
      if (b % 32 >= 10) in.hb.index_row(1, b * 128)[9] = 0x7f;
    for (int b = 0; b * 128 < in.hb.seq_len(2); ++b)
      if (b % 40 != 5) in.hb.index_row(2, b * 128 + 1)[2] = 0x7f;
    check_wide(in, "wide ties and few groups draft " + std::to_string(draft));
  }
}

// CUDA-graph replay of the default plan at batch 1 (65537 tokens, draft 3: fused scorer, then the
// wide selection) with new inputs equals an eager call and one warp per row.
TEST(IndexerGpu, WideSelectionGraphReplayEqualsEager) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const std::vector<RequestSpec> reqs = generation({65537}, 3);
  const Inputs first = make_inputs(reqs, 4, rng, /*integer=*/true);
  const Inputs second = make_inputs(reqs, 4, rng, /*integer=*/true);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceSet d;
  upload(first, d);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const Status st = run_indexer_cuda(d.params, d.workspace, stream, IndexerCudaOptions{});
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (const Inputs* in : {&first, &second}) {
    reupload(*in, d);
    poison_outputs(d);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const GpuResult replay = download(d);
    const GpuResult eager = run_gpu(d, IndexerCudaOptions{});
    EXPECT_TRUE(replay.ids == eager.ids) << "graph replay and eager ids differ";
    const GpuResult one = run_gpu(d, wide_in(-1));
    expect_same_ids(*in, replay, one, "wide graph replay vs one warp per row");
    compare(*in, reference(*in), replay, /*exact_scores=*/true, "wide graph replay");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Calls of at most 32 / n_kv tokens launch no overflow tiles (IndexerCudaOptions::
// overflow_tiles_always): at n_kv 4 (8 tokens: one request of 8, two of 4, four of 2), n_kv 8 (4
// tokens) and n_kv 1 (32 tokens: two requests of 16), every scorer path (default, two-kernel,
// CUDA cores, single pass in one CTA and in 4-CTA clusters, flat decode) gives the ids of the
// former grid, and the default path the twin's.
TEST(IndexerGpu, NoOverflowTilesAtFewTokens) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  struct Case {
    int n_kv;
    std::vector<RequestSpec> reqs;
  };
  const std::vector<Case> cases = {{4, {{9000 - 8, 8}}},
                                   {4, {{5000, 4}, {2000, 4}}},
                                   {4, {{7000, 2}, {100, 2}, {3000, 2}, {20000, 2}}},
                                   {8, {{6000, 4}}},
                                   {1, {{4000, 16}, {8100, 16}}}};
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c.reqs, c.n_kv, rng, /*integer=*/true);
    ASSERT_FALSE(::testing::Test::HasFailure());
    ASSERT_LE(in.T(), 32 / c.n_kv);
    const Reference ref = reference(in);
    DeviceSet d;
    upload(in, d);
    const std::string label =
        "n_kv " + std::to_string(c.n_kv) + " " + mt::describe_requests(c.reqs);
    IndexerCudaOptions ovf;
    ovf.overflow_tiles_always = true;
    EXPECT_EQ(indexer_cuda_plan(d.params, IndexerCudaOptions{}).overflow_tiles, 0) << label;
    EXPECT_EQ(indexer_cuda_plan(d.params, ovf).overflow_tiles, 1) << label;
    std::vector<std::pair<IndexerCudaOptions, std::string>> paths = {{{}, "default"}};
    IndexerCudaOptions o;
    o.unfused_decode = true;
    paths.push_back({o, "two-kernel"});
    o = IndexerCudaOptions{};
    o.force_cuda_cores = true;
    paths.push_back({o, "cuda cores"});
    o = IndexerCudaOptions{};
    o.single_pass = true;
    paths.push_back({o, "single pass"});
    o.single_pass_ctas = 4;
    paths.push_back({o, "single pass, 4-CTA clusters"});
    o = IndexerCudaOptions{};
    o.flat_decode = 1;
    paths.push_back({o, "flat 1"});
    for (const auto& [po, name] : paths) {
      if (po.single_pass && !indexer_cuda_plan(d.params, po).single) continue;  // > 64 blocks
      const GpuResult g = run_gpu(d, po);
      if (name == "default") compare(in, ref, g, /*exact_scores=*/true, label + " [default]");
      IndexerCudaOptions former = po;
      former.overflow_tiles_always = true;
      expect_same_ids(in, g, run_gpu(d, former), label + " [" + name + " vs overflow tiles]");
    }
  }
}

// The automatic fused plan below one wave (IndexerCudaOptions::fused_small_ctas_per_sm): one
// request at 128K (1024 blocks, no spare page-table column) splits into chunks for about two CTAs
// per SM (4 blocks on 132 SMs) instead of one; two requests at 64K + 100 (draft 3) keep one CTA per
// SM; the ids equal the former plan's (one CTA per SM) and the twin's.
TEST(IndexerGpu, SmallBatchFusedPlanTwoCtasPerSm) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int sms = mt::current_device_sms();
  for (const std::vector<int>& ctx : {std::vector<int>{131072}, std::vector<int>{65636, 65636}}) {
    const int draft = ctx.size() == 1 ? 0 : 3;
    const int R = static_cast<int>(ctx.size());
    const Inputs in = make_inputs(generation(ctx, draft), 4, rng, /*integer=*/true, 0, 0);
    ASSERT_FALSE(::testing::Test::HasFailure());
    const int mp = in.max_pages();
    DeviceSet d;
    upload(in, d);
    const std::string label = mt::describe_requests(generation(ctx, draft));
    IndexerCudaOptions one;
    one.fused_small_ctas_per_sm = 1;
    const auto chunk_for = [&](int per_sm) {  // the rule below one wave (64-block chunks cap)
      const int c = (mp * R + per_sm * sms - 1) / (per_sm * sms);
      return std::min(64, std::max(4, (c + 3) / 4 * 4));
    };
    if (R * ((mp + 63) / 64) < sms) {  // below one wave at the default 64-block chunks
      const IndexerCudaPlan pl = indexer_cuda_plan(d.params, IndexerCudaOptions{});
      const IndexerCudaPlan pl1 = indexer_cuda_plan(d.params, one);
      EXPECT_TRUE(pl.fused && pl1.fused) << label;
      EXPECT_EQ(pl.dec_chunk, chunk_for(R == 1 ? 2 : 1)) << label;
      EXPECT_EQ(pl.k_splits, (mp + pl.dec_chunk - 1) / pl.dec_chunk) << label;
      EXPECT_EQ(pl1.dec_chunk, chunk_for(1)) << label;
      std::printf("[ indexer  ] %s on %d SMs: k%d c%d (one CTA per SM: k%d c%d)\n", label.c_str(),
                  sms, pl.k_splits, pl.dec_chunk, pl1.k_splits, pl1.dec_chunk);
    }
    const GpuResult g = run_gpu(d, IndexerCudaOptions{});
    compare(in, reference(in), g, /*exact_scores=*/true, label + " [default]");
    expect_same_ids(in, g, run_gpu(d, one), label + " [default vs one CTA per SM]");
  }
}

// Rejected values of wide_select touch nothing.
TEST(IndexerGpu, WideSelectRejectsOtherWarpCounts) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const Inputs in = make_inputs(generation({9000}, 0), 4, rng, /*integer=*/true);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceSet d;
  upload(in, d);
  for (int w : {-2, 1, 2, 3, 5, 32}) {
    const Status st = run_indexer_cuda(d.params, d.workspace, nullptr, wide_in(w));
    EXPECT_FALSE(st.ok()) << "wide_select " << w;
  }
}

}  // namespace
}  // namespace m3attn::indexer_gpu_test
