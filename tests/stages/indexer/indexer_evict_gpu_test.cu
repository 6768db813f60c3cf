// GPU tests of the L2 evict_first policy of the decode units' index-K tile copies
// (IndexerCudaOptions::stream_evict_first; automatic: on for every plan): a cache hint only, so
// the ids must equal those of the two-kernel path without it (checked against the twin before a
// page-table entry is moved outside the pool) with the policy forced on, off and automatic, on
// every decode path that copies index-K tiles (the clustered and one-CTA single pass, flat decode,
// the fused and two-kernel paths), with NaN keys and a page outside the pool.
#include <gtest/gtest.h>

#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

// Integer-valued inputs of one request per context (ctx - tokens cached tokens, `tokens` query
// tokens each) with NaN keys in request 0's blocks 31 and 62.
Inputs inputs_with_nan_keys(std::initializer_list<int> contexts, int tokens, Rng& rng) {
  std::vector<RequestSpec> reqs;
  for (int ctx : contexts) reqs.push_back({ctx - tokens, tokens});
  Inputs in = make_inputs(reqs, 4, rng, /*integer=*/true, 0, /*extra_cols=*/0);
  if (::testing::Test::HasFailure()) return in;  // the caller's check stops the test
  in.hb.index_row(0, 31 * 128 + 7)[9] = 0x7f;
  in.hb.index_row(0, 62 * 128 + 100)[40] = 0x7f;
  return in;
}

// Points the device page table's entry (request, block) outside the pool (-2); the host batch
// keeps the page, so the twin no longer describes the device inputs.
void move_page_outside_pool(const Inputs& in, DeviceSet& d, int request, int block) {
  std::vector<int32_t> table(static_cast<size_t>(in.hb.page_table.numel()));
  std::memcpy(table.data(), in.hb.page_table.data(), table.size() * 4);
  table[static_cast<size_t>(request * in.hb.page_table.shape()[1] + block)] = -2;
  d.table.upload(table.data(), table.size() * 4);
}

TEST(IndexerGpu, EvictFirstSameIds) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int tokens : {1, 4}) {
    const Inputs in = inputs_with_nan_keys({8192, 8000, 5000, 4097, 2049, 129}, tokens, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    DeviceSet d;
    upload(in, d);
    IndexerCudaOptions two;
    two.unfused_decode = true;
    two.stream_evict_first = -1;
    const std::string label = std::to_string(tokens) + " token(s) per request";
    compare(in, reference(in), run_gpu(d, two), /*exact_scores=*/true, label + " [two-kernel]");
    // A page outside the pool in request 1 (block 40): NaN on every path (the twin's host batch
    // keeps the page: ids against the two-kernel path from here on).
    move_page_outside_pool(in, d, /*request=*/1, /*block=*/40);
    const GpuResult g = run_gpu(d, two);
    for (int ef : {1, 0, -1}) {
      struct Path {
        const char* name;
        IndexerCudaOptions o;
      };
      std::vector<Path> paths;
      for (int ctas : {1, 2, 4}) {
        IndexerCudaOptions o;
        o.single_pass = true;
        o.single_pass_ctas = ctas;
        paths.push_back({ctas == 1 ? "single pass" : ctas == 2 ? "cluster 2" : "cluster 4", o});
      }
      IndexerCudaOptions o;
      o.flat_decode = 1;
      paths.push_back({"flat 1", o});
      o = IndexerCudaOptions{};
      o.fused_decode_always = true;
      paths.push_back({"fused", o});
      o = IndexerCudaOptions{};
      o.unfused_decode = true;
      paths.push_back({"two-kernel", o});
      for (Path& path : paths) {
        path.o.stream_evict_first = ef;
        expect_same_ids(in, run_gpu(d, path.o), g,
                        label + " [" + path.name + ", evict_first " + std::to_string(ef) + "]");
      }
    }
  }
}

// IndexerCudaOptions::cluster_async_maxima (the clustered single pass's other ranks send their
// block maxima to rank 0 by st.async on rank 0's table mbarrier; no final cluster barrier): the
// same ids as the two-kernel path in 2-, 3-, 4- and 8-CTA clusters, with a page outside the pool,
// NaN keys, trivial rows (<= 16 visible blocks) and, at 4 tokens per request (16 rows: the
// cluster barrier path), the fallback.
TEST(IndexerGpu, ClusterAsyncMaximaSameIds) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int tokens : {1, 4}) {
    const Inputs in =
        inputs_with_nan_keys({8192, 8000, 5000, 4097, 2049, 129, 8191, 3000}, tokens, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    DeviceSet d;
    upload(in, d);
    move_page_outside_pool(in, d, /*request=*/1, /*block=*/40);
    IndexerCudaOptions two;
    two.unfused_decode = true;
    const GpuResult g = run_gpu(d, two);
    const std::string label = std::to_string(tokens) + " token(s) per request";
    for (int ctas : {2, 3, 4, 8})
      for (int rep = 0; rep < 3; ++rep) {  // the mbarrier is set up afresh every launch
        IndexerCudaOptions o;
        o.single_pass = true;
        o.single_pass_ctas = ctas;
        o.cluster_async_maxima = rep < 2;  // the last: the cluster barrier
        expect_same_ids(in, run_gpu(d, o), g,
                        label + " [cluster " + std::to_string(ctas) +
                            (rep < 2 ? ", async maxima]" : ", cluster barrier]"));
      }
  }
}

}  // namespace
}  // namespace m3attn::indexer_gpu_test
