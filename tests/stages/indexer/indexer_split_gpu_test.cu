// GPU tests of the clustered single pass's split final selection (IndexerCudaOptions::
// split_selection, select_rows_half in indexer_kernel_fused.cuh), its dynamic tail
// (dyn_tail_blocks, decode_unit_dyn: blocks taken from a counter) and of the L2 evict_first policy
// of the decode units' index-K copies (stream_evict_first): two CTAs write the parts of each row
// of block_ids, so the ids must equal the two-kernel path's (itself checked against the twin) for
// every cluster size and context, with NaN keys, integer inputs (many exact ties among the block
// maxima: the tie counting across and inside the halves) and pages outside the pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

// One-token requests (4 rows at n_kv 4, 2 at n_kv 2: the split applies; n_kv 8 and two tokens per
// request: more rows than a CTA has warps, the plain path) at contexts that fill both halves, one
// half, part of one, or leave every row trivial; 64 page-table columns (the single pass's most).
TEST(IndexerGpu, SplitSelectionSmall) {
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
    for (int ctx : {8192, 8000, 5000, 4097, 4096, 2049, 2100, 129, 1})
      reqs.push_back({std::max(ctx - set.tokens, 0), set.tokens});
    Inputs in = make_inputs(reqs, set.n_kv, rng, /*integer=*/true, 0, /*extra_cols=*/0);
    ASSERT_FALSE(::testing::Test::HasFailure());
    // NaN keys: request 0's blocks 31 and 62 (the last of half 0, the last candidate), request
    // 1's block 3.
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
      for (int mode = 0; mode < 3; ++mode) {  // split; evict_first; both
        for (int dyn : {0, 4, 12, 20}) {  // 20: too many for 24- and 32-block chunks (plain)
          IndexerCudaOptions so;
          so.single_pass = true;
          so.single_pass_ctas = ctas;
          so.split_selection = mode != 1;
          so.stream_evict_first = mode != 0;
          so.dyn_tail_blocks = dyn;
          ASSERT_TRUE(indexer_cuda_plan(d.params, so).single);
          const char* names[] = {"split", "evict_first", "split, evict_first"};
          expect_same_ids(in, run_gpu(d, so), g,
                          label + " [single pass, " + std::to_string(ctas) + " CTAs, " +
                              names[mode] + ", dynamic tail " + std::to_string(dyn) + "]");
        }
      }
    }
  }
}

// Pages outside the pool (negative, past the pool) in either half and in the local block: those
// blocks score NaN on every path.
TEST(IndexerGpu, SplitSelectionBadPages) {
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
  table[static_cast<size_t>(0 * stride + 30)] = -3;                     // half 0
  table[static_cast<size_t>(0 * stride + 63)] = 1 << 30;                // the local block
  table[static_cast<size_t>(1 * stride + 40)] = -1;                     // half 1
  table[static_cast<size_t>(2 * stride + 22)] = in.hb.num_pages() + 2;  // half 0, short row
  d.table.upload(table.data(), table.size() * 4);
  IndexerCudaOptions two;
  two.unfused_decode = true;
  const GpuResult g = run_gpu(d, two);
  for (int ctas : {2, 4}) {
    for (int dyn : {0, 8}) {
      IndexerCudaOptions so;
      so.single_pass = true;
      so.single_pass_ctas = ctas;
      so.split_selection = true;
      so.dyn_tail_blocks = dyn;
      expect_same_ids(in, run_gpu(d, so), g,
                      "bad pages [split, " + std::to_string(ctas) + " CTAs, dynamic tail " +
                          std::to_string(dyn) + "]");
    }
  }
}

}  // namespace
}  // namespace m3attn::indexer_gpu_test
