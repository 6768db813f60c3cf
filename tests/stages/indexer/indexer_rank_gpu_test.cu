// GPU test of IndexerCudaOptions::rank_hoisted (session 24: the single pass's final count with
// the row's scores loaded into registers first and eight accumulators per candidate): the same
// counts, so the ids must equal those of the two-kernel path (itself checked against the twin),
// for the one-CTA single pass and clusters of 2 and 4 CTAs, at one and four tokens per request,
// on integer inputs (scores tie often), with NaN keys and rows of <= 16 visible blocks.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

TEST(IndexerGpu, RankHoistedSameIds) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int tokens : {1, 4}) {
    std::vector<RequestSpec> reqs;
    for (int ctx : {8192, 8000, 5000, 4097, 2049, 1000, 129})
      reqs.push_back({ctx - tokens, tokens});
    Inputs in = make_inputs(reqs, 4, rng, /*integer=*/true, 0, /*extra_cols=*/0);
    ASSERT_FALSE(::testing::Test::HasFailure());
    in.hb.index_row(0, 31 * 128 + 7)[9] = 0x7f;  // NaN keys in request 0's blocks 31 and 62
    in.hb.index_row(0, 62 * 128 + 100)[40] = 0x7f;
    DeviceSet d;
    upload(in, d);
    IndexerCudaOptions two;
    two.unfused_decode = true;
    const std::string label = std::to_string(tokens) + " token(s) per request";
    const GpuResult g = run_gpu(d, two);
    compare(in, reference(in), g, /*exact_scores=*/true, label + " [two-kernel]");
    for (int ctas : {1, 2, 4}) {
      IndexerCudaOptions o;
      o.single_pass = true;
      o.single_pass_ctas = ctas;
      o.rank_hoisted = true;
      expect_same_ids(in, run_gpu(d, o), g,
                      label + " [single pass, " + std::to_string(ctas) + " CTA(s), hoisted]");
    }
  }
}

}  // namespace
}  // namespace m3attn::indexer_gpu_test
