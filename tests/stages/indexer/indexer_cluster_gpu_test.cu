// GPU tests of the clustered single pass's opt-in single_pass_tail_prefetch (session 24: each
// decode warp publishes the block it is at; the finished warps of the cluster's other CTAs
// prefetch into L2 the blocks its unfinished warps have not started). A cache hint only: ids
// must equal those of the two-kernel path (itself checked against the twin) for clusters of 2, 4
// and 8 CTAs, at one token per request and four (rows shared by the cluster's CTAs), on integer
// inputs, with NaN keys, requests whose rows are trivial (<= 16 visible blocks), CTAs without
// blocks, a batch of as many tokens as requests whose guessed bounds are wrong, and two index
// heads at two tokens per request.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

void check_tail_prefetch(const std::vector<RequestSpec>& reqs, Rng& rng, const std::string& label,
                      int n_kv = 4) {
  Inputs in = make_inputs(reqs, n_kv, rng, /*integer=*/true, 0, /*extra_cols=*/0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  in.hb.index_row(0, 31 * 128 + 7)[9] = 0x7f;  // NaN keys in request 0's blocks 31 and 62
  in.hb.index_row(0, 62 * 128 + 100)[40] = 0x7f;
  DeviceSet d;
  upload(in, d);
  IndexerCudaOptions two;
  two.unfused_decode = true;
  const GpuResult g = run_gpu(d, two);
  compare(in, reference(in), g, /*exact_scores=*/true, label + " [two-kernel]");
  for (int ctas : {2, 4, 8}) {
    IndexerCudaOptions o;
    o.single_pass = true;
    o.single_pass_ctas = ctas;
    o.single_pass_tail_prefetch = true;
    expect_same_ids(in, run_gpu(d, o), g,
                    label + " [cluster " + std::to_string(ctas) + ", tail prefetch]");
  }
}

TEST(IndexerGpu, TailPrefetchSameIds) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int tokens : {1, 4}) {
    std::vector<RequestSpec> reqs;
    for (int ctx : {8192, 8000, 5000, 4097, 2049, 1000, 129})
      reqs.push_back({ctx - tokens, tokens});
    check_tail_prefetch(reqs, rng, std::to_string(tokens) + " token(s) per request");
  }
  // As many tokens as requests but not one each (a request without tokens, one with two): the
  // guessed bounds (request r's token r) are wrong from request 1 on and reloaded.
  check_tail_prefetch({{8191, 1}, {5000, 0}, {6000, 2}, {4095, 1}}, rng,
                   "unequal tokens per request");
  // Two index heads, two tokens per request: 4 rows of two tokens (row j is token j / 2's).
  std::vector<RequestSpec> two;
  for (int ctx : {8192, 7000, 3000, 200}) two.push_back({ctx - 2, 2});
  check_tail_prefetch(two, rng, "n_kv 2, 2 tokens per request", 2);
}

// A small case for compute-sanitizer (memcheck / racecheck): two requests of one token, 2-CTA
// clusters, against the two-kernel path.
TEST(IndexerGpu, TailPrefetchSmall) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Inputs in = make_inputs({{8191, 1}, {3000, 1}}, 4, rng, /*integer=*/true, 0, /*extra_cols=*/0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceSet d;
  upload(in, d);
  IndexerCudaOptions two;
  two.unfused_decode = true;
  const GpuResult g = run_gpu(d, two);
  compare(in, reference(in), g, /*exact_scores=*/true, "small [two-kernel]");
  IndexerCudaOptions o;
  o.single_pass = true;
  o.single_pass_ctas = 2;
  o.single_pass_tail_prefetch = true;
  expect_same_ids(in, run_gpu(d, o), g, "small [tail prefetch]");
}

}  // namespace
}  // namespace m3attn::indexer_gpu_test
