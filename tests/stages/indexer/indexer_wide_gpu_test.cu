// GPU tests of the wide selection (IndexerCudaOptions::wide_select, select_wide_kernel: one CTA of
// 4 / 8 / 16 warps per row of more than 64 candidates) against the CPU twin and against one warp
// per row (select_kernel, wide_select -1): batches of 1-3 generation requests at long contexts,
// draft lengths 0 / 1 / 3 / 7, integer inputs (block maxima full of exact ties, also across the
// warps' shares and the passes), NaN blocks, rows of all-equal scores, rows with fewer than 15
// groups holding a non-NaN candidate (more survivors than the kernel ranks: the sorted-list
// fallback), and CUDA-graph replay.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
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

// The default options (automatic: the wide selection at <= 16 rows), the wide selection forced at
// 4, 8 and 16 warps per row, and the fused path with many splits plus 8 warps: each against the
// twin (exact where the inputs are integers) and against one warp per row, id for id.
void check_wide(const Inputs& in, const std::string& label) {
  const Reference ref = reference(in);
  DeviceSet d;
  upload(in, d);
  ASSERT_GT(in.max_pages(), 64);
  const GpuResult one = run_gpu(d, wide_in(-1));
  compare(in, ref, one, in.integer, label + " [one warp per row]");
  struct Variant {
    IndexerCudaOptions o;
    std::string name;
  };
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
  for (const Variant& v : vs) {
    const GpuResult g = run_gpu(d, v.o);
    compare(in, ref, g, in.integer, label + " [" + v.name + "]");
    expect_same_ids(in, g, one, label + " [" + v.name + " vs one warp per row]");
  }
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
