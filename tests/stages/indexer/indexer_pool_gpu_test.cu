// GPU tests of the clustered single pass's tail pool (IndexerCudaOptions::tail_pool_blocks, see
// decode_unit_pooled in indexer_kernel_mma.cuh): the pooled blocks' tiles are scored by whichever
// warp of the CTA takes them, so the ids must equal the two-kernel path's (itself checked against
// the twin) for every pool size, cluster size and context, with NaN keys and pages outside the
// pool in pooled blocks, and across CUDA-graph replays (the counter is reset by every launch).
// Integer inputs: many exact ties among the block maxima.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

// One-token requests (4 rows at n_kv 4: the pool applies; 64 page-table columns, the single pass's
// largest) at contexts that leave the clusters'
// chunks full, partial, empty or too short for a whole pool, plus n_kv 2 and, where the pool does
// not apply (rows > 4: n_kv 8, several tokens per request), the plain clustered pass.
TEST(IndexerGpu, TailPoolSmall) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  struct Set {
    int n_kv;
    int tokens;
  };
  for (const Set& set : {Set{4, 1}, Set{2, 1}, Set{8, 1}, Set{4, 2}}) {
    std::vector<RequestSpec> reqs;
    for (int ctx : {8192, 8000, 5000, 4097, 2049, 2048, 2100, 129, 1})
      reqs.push_back({std::max(ctx - set.tokens, 0), set.tokens});
    Inputs in = make_inputs(reqs, set.n_kv, rng, /*integer=*/true, 0, /*extra_cols=*/0);
    ASSERT_FALSE(::testing::Test::HasFailure());
    // NaN keys in blocks that some pool takes: request 0's blocks 31 and 62 (last of a 2-CTA
    // chunk, last candidate), request 1's block 3.
    in.hb.index_row(0, 31 * 128 + 7)[9] = 0x7f;
    in.hb.index_row(0, 62 * 128 + 100)[40] = 0x7f;
    in.hb.index_row(1, 3 * 128)[0] = 0x7f;
    const Reference ref = reference(in);
    DeviceSet d;
    upload(in, d);
    const std::string label = "n_kv " + std::to_string(set.n_kv) + ", " +
                              std::to_string(set.tokens) + " token(s) per request";
    IndexerCudaOptions two;
    two.unfused_decode = true;
    const GpuResult g = run_gpu(d, two);
    compare(in, ref, g, /*exact_scores=*/true, label + " [two-kernel]");
    for (int ctas : {2, 3, 4, 8}) {
      for (int pool : {1, 2, 4, 8, 16}) {
        IndexerCudaOptions so;
        so.single_pass = true;
        so.single_pass_ctas = ctas;
        so.tail_pool_blocks = pool;
        ASSERT_TRUE(indexer_cuda_plan(d.params, so).single);
        expect_same_ids(in, run_gpu(d, so), g,
                        label + " [single pass, " + std::to_string(ctas) + " CTAs, pool " +
                            std::to_string(pool) + "]");
      }
    }
  }
}

// Pages outside the pool (negative, past the pool) in pooled and in static blocks: those blocks
// score NaN on every path.
TEST(IndexerGpu, TailPoolBadPages) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Inputs in =
      make_inputs({{8191, 1}, {6000, 1}, {3000, 1}}, 4, rng, /*integer=*/true, 0, /*extra_cols=*/0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceSet d;
  upload(in, d);
  std::vector<int32_t> table(static_cast<size_t>(in.hb.page_table.numel()));
  std::memcpy(table.data(), in.hb.page_table.data(), table.size() * 4);
  const int64_t stride = in.hb.page_table.shape()[1];
  table[static_cast<size_t>(0 * stride + 30)] = -3;                     // pooled (2 CTAs, pool 4)
  table[static_cast<size_t>(0 * stride + 63)] = 1 << 30;                // the local block
  table[static_cast<size_t>(1 * stride + 5)] = -1;                      // static
  table[static_cast<size_t>(2 * stride + 22)] = in.hb.num_pages() + 2;  // pooled (chunk end)
  d.table.upload(table.data(), table.size() * 4);
  IndexerCudaOptions two;
  two.unfused_decode = true;
  const GpuResult g = run_gpu(d, two);
  for (int pool : {2, 4, 8}) {
    IndexerCudaOptions so;
    so.single_pass = true;
    so.single_pass_ctas = 2;
    so.tail_pool_blocks = pool;
    expect_same_ids(in, run_gpu(d, so), g, "bad pages [pool " + std::to_string(pool) + "]");
  }
}

// A captured launch replayed twice (no reset between: each launch zeroes its own counter) equals
// the eager call.
TEST(IndexerGpu, TailPoolGraphReplay) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const std::vector<RequestSpec> reqs = {{8191, 1}, {7000, 1}, {2100, 1}, {5555, 1}};
  const Inputs in = make_inputs(reqs, 4, rng, false, 0, /*extra_cols=*/0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceSet d;
  upload(in, d);
  IndexerCudaOptions o;
  o.single_pass = true;
  o.single_pass_ctas = 2;
  o.tail_pool_blocks = 4;
  const GpuResult eager = run_gpu(d, o);
  IndexerCudaOptions two;
  two.unfused_decode = true;
  expect_same_ids(in, eager, run_gpu(d, two), "pool 4 eager vs two-kernel");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const Status st = run_indexer_cuda(d.params, d.workspace, stream, o);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 3; ++i) {
    poison_outputs(d);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(download(d).ids == eager.ids) << "graph replay " << i << " differs from eager";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace m3attn::indexer_gpu_test
