// GPU tests of the CUDA indexer against the CPU twin (see indexer_gpu_test_util.h for what every
// run checks): generation contexts and draft lengths, mixed batches, strided pools, 64-bit page
// offsets, short contexts, NaN scores, the fused path over many splits.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

// The inputs of a plan test (n_kv 4, no spare page-table column), uploaded into `d`: the batch
// must come out at `max_pages` blocks (callers then assert that nothing failed).
Inputs uploaded_plan_inputs(const std::vector<RequestSpec>& reqs, bool integer, int max_pages,
                            Rng& rng, DeviceSet& d) {
  Inputs in = make_inputs(reqs, 4, rng, integer, 0, 0);
  EXPECT_EQ(in.max_pages(), max_pages);
  if (!::testing::Test::HasFailure()) upload(in, d);
  return in;
}

// The plan tests' verify batch at 8K, uploaded into `d`: R requests of `tokens` query tokens with
// contexts of 1900-2300 tokens, the first at the full 64 blocks, integer-valued.
Inputs verify_batch_at_8k(int R, int tokens, Rng& rng, DeviceSet& d) {
  std::vector<RequestSpec> reqs;
  for (int i = 0; i < R; ++i)
    reqs.push_back({static_cast<int>(rng.integer(1900, 2300 - tokens)), tokens});
  reqs[0] = {8192 - tokens, tokens};  // one request at the full 64 blocks
  return uploaded_plan_inputs(reqs, /*integer=*/true, 64, rng, d);
}

IndexerCudaOptions single_pass_in(int ctas) {
  IndexerCudaOptions o;
  o.single_pass = true;
  o.single_pass_ctas = ctas;
  return o;
}

IndexerCudaOptions two_kernel_in(int k_splits) {
  IndexerCudaOptions o;
  o.unfused_decode = true;
  o.k_splits = k_splits;
  return o;
}

// Forced plans, each with a label saying which plan it is checked against.
using ForcedPlans = std::vector<std::pair<IndexerCudaOptions, std::string>>;

// The ids of the automatic plan against those of each forced plan.
void expect_forced_plans_agree(const Inputs& in, DeviceSet& d, int R, int tokens,
                               const ForcedPlans& plans) {
  const std::string what =
      std::to_string(R) + " requests x " + std::to_string(tokens) + " tokens";
  const GpuResult g = run_gpu(d, IndexerCudaOptions{});
  for (const auto& [o, label] : plans) expect_same_ids(in, run_gpu(d, o), g, label + ", " + what);
}

// The automatic plan of the batch on d.params, printed for the log.
IndexerCudaPlan printed_plan(const DeviceSet& d, int sms, int R, int tokens) {
  const IndexerCudaPlan pl = indexer_cuda_plan(d.params, IndexerCudaOptions{});
  std::printf(
      "[ indexer  ] %d SMs, %d requests x %d tokens, %d blocks: plan single %d fused %d flat %d "
      "k_splits %d c %d\n",
      sms, R, tokens, d.params.batch.max_pages, pl.single ? 1 : 0, pl.fused ? 1 : 0, pl.flat_ctas,
      pl.k_splits, pl.dec_chunk);
  return pl;
}

TEST(IndexerGpu, GenerationContextsAndDraftLengths) {
  M3_REQUIRE_GPU();
  check_generation_contexts({1, 127, 128, 129, 2048, 2049, 2050, 4097, 9000}, "generation");
}

// Contexts of <= 64 blocks (8K), where the single pass (IndexerCudaOptions::single_pass) applies:
// check_all_paths compares it with the two-kernel path for every draft length.
TEST(IndexerGpu, GenerationContextsUpTo8KSinglePass) {
  M3_REQUIRE_GPU();
  check_generation_contexts({1, 127, 128, 129, 2049, 4097, 8192}, "generation 8K");
}

// The automatic plan of decode batches at <= 8K: the single pass in clusters of sms / R CTAs per
// request at one token per request (R = sms / 3: 3 CTAs; R = sms / 16, below 1/8 request per SM:
// 8 CTAs, session 25), and of 2 CTAs at 4 tokens per request (R = 0.8 sms); ids against the
// two-kernel path (same block maxima) and the twin.
TEST(IndexerGpu, AutomaticClusteredSinglePass) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int sms = mt::current_device_sms();
  for (int tokens : {1, 4, 0}) {  // 0: one token per request, R = sms / 16
    const int R = tokens == 1   ? std::max(1, sms / 3)
                  : tokens == 4 ? std::max(1, sms * 4 / 5)
                                : std::max(1, sms / 16);
    if (tokens == 0) tokens = 1;
    std::vector<RequestSpec> reqs;
    for (int i = 0; i < R; ++i)
      reqs.push_back({static_cast<int>(rng.integer(0, 8192 - tokens)), tokens});
    reqs[0] = {8192 - tokens, tokens};  // one request at the full 64 blocks
    // No spare page-table column: max_pages 64, where the single pass applies.
    DeviceSet d;
    const Inputs in = uploaded_plan_inputs(reqs, false, 64, rng, d);
    ASSERT_FALSE(::testing::Test::HasFailure());
    const IndexerCudaPlan pl = printed_plan(d, sms, R, tokens);
    const int ctas = tokens == 1 ? std::clamp(sms / R, 1, 8) : 2;  // sms / 16 requests: 8
    const int chunk = ((64 + ctas - 1) / ctas + 3) / 4 * 4;
    EXPECT_TRUE(pl.single);
    EXPECT_EQ(pl.k_splits, (64 + chunk - 1) / chunk);
    const GpuResult g = run_gpu(d, two_kernel_in(0));
    const std::string what = std::to_string(R) + " requests x " + std::to_string(tokens);
    compare(in, reference(in), g, false, "automatic plan, two-kernel, " + what);
    expect_same_ids(in, run_gpu(d, IndexerCudaOptions{}), g,
                    "automatic clustered single pass, " + what);
  }
}

// Verify batches of more than one request per SM at <= 64 blocks: the automatic plan is the
// two-kernel path in 12-block splits (session 24 from 1.9 requests per SM, at 2 and 4 tokens per
// request; before, the single pass in 4-CTA clusters; session 25 from just above one request per
// SM, 3 tokens per request at ~1.13 here; before, 3 splits of 24 blocks). Ids against the single
// pass in 4-CTA clusters and against the two-kernel path in 3 splits (both checked against the
// twin elsewhere; the twin of 2 x SMs requests would take this test ~30 s).
TEST(IndexerGpu, AutomaticSplitsForManyVerifyRequestsAt8K) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int sms = mt::current_device_sms();
  const struct {
    int R, tokens;
  } cases[] = {{2 * sms, 2}, {2 * sms, 4}, {sms + sms / 8 + 1, 3}};
  for (const auto& cs : cases) {
    const int R = cs.R, tokens = cs.tokens;
    DeviceSet d;
    const Inputs in = verify_batch_at_8k(R, tokens, rng, d);
    ASSERT_FALSE(::testing::Test::HasFailure());
    const IndexerCudaPlan pl = printed_plan(d, sms, R, tokens);
    EXPECT_FALSE(pl.single);
    EXPECT_FALSE(pl.fused);
    EXPECT_EQ(pl.flat_ctas, 0);
    EXPECT_EQ(pl.dec_chunk, 12);
    EXPECT_EQ(pl.k_splits, 6);
    expect_forced_plans_agree(
        in, d, R, tokens,
        {{single_pass_in(4), "single pass in 4-CTA clusters vs 12-block splits"},
         {two_kernel_in(3), "3 splits vs 12-block splits"}});
  }
}

// Verify batches of 3-4 tokens per request at 0.95-1 requests per SM at <= 64 blocks: the
// automatic plan is the two-kernel path in 3 splits of 24 blocks (session 25; before, the single
// pass in 2-CTA clusters, which stays at 2 tokens and below 0.95). Ids against that single pass
// and the 12-block splits (both checked against the twin elsewhere).
TEST(IndexerGpu, AutomaticTwoKernelForVerifyBatchesNearOneRequestPerSm) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int sms = mt::current_device_sms();
  const struct {
    int R, tokens;
    bool single;
  } cases[] = {{sms * 19 / 20 + 1, 3, false}, {sms, 4, false}, {sms * 19 / 20 + 1, 2, true},
               {sms * 9 / 10, 4, true}};
  for (const auto& cs : cases) {
    const int R = cs.R, tokens = cs.tokens;
    DeviceSet d;
    const Inputs in = verify_batch_at_8k(R, tokens, rng, d);
    ASSERT_FALSE(::testing::Test::HasFailure());
    const IndexerCudaPlan pl = printed_plan(d, sms, R, tokens);
    EXPECT_EQ(pl.single, cs.single);
    if (!cs.single) {
      EXPECT_FALSE(pl.fused);
      EXPECT_EQ(pl.flat_ctas, 0);
      EXPECT_EQ(pl.dec_chunk, 24);
      EXPECT_EQ(pl.k_splits, 3);
    }
    expect_forced_plans_agree(in, d, R, tokens,
                              {{single_pass_in(2), "2-CTA single pass vs automatic"},
                               {two_kernel_in(6), "12-block splits vs automatic"}});
  }
}

// The automatic two-kernel plan of verify batches at 8K (4 tokens per request, about 0.48
// requests per SM: 64 on an H200) runs flat decode with two CTAs per SM (session 23; one in
// sessions 19-22) where 12-block splits would still fit one wave (session 19; session 18 used
// those splits); ids and block scores against the twin, ids against the split plan
// (flat_decode -1).
TEST(IndexerGpu, AutomaticFlatDecodeForVerifyBatchesAt8K) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int sms = mt::current_device_sms();
  const int R = std::max(1, sms * 16 / 33);  // in [sms / 3, sms / 2]
  std::vector<RequestSpec> reqs;
  for (int i = 0; i < R; ++i) reqs.push_back({static_cast<int>(rng.integer(2000, 8188)), 4});
  reqs[0] = {8188, 4};  // one request at the full 64 blocks
  DeviceSet d;
  const Inputs in = uploaded_plan_inputs(reqs, false, 64, rng, d);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const IndexerCudaPlan pl = printed_plan(d, sms, R, 4);
  if (R * 3 >= sms && R * 6 <= 3 * sms) {
    EXPECT_FALSE(pl.single);
    EXPECT_FALSE(pl.fused);
    EXPECT_EQ(pl.flat_ctas, 2 * sms);
    EXPECT_EQ(pl.k_splits, 1);
  }
  const GpuResult g = run_gpu(d, IndexerCudaOptions{});
  const std::string what = std::to_string(R) + " requests x 4";
  compare(in, reference(in), g, false, "automatic flat decode, " + what);
  IndexerCudaOptions split;
  split.flat_decode = -1;
  EXPECT_EQ(indexer_cuda_plan(d.params, split).flat_ctas, 0);
  expect_same_ids(in, g, run_gpu(d, split), "automatic flat decode vs splits, " + what);
}

// The automatic fused plan of verify batches (4 tokens per request) whose 64-block splits would
// fill the SMs in one wave: the smallest chunk that still runs in one wave of <= 3 CTAs per SM
// where that is >= 40 blocks (session 15), else 64; ids against the two-kernel path (same block
// maxima) and the twin. 256 blocks (one request at 32K, the others 2-6K tokens) and R = sms / 2
// requests: 6 splits of 44 blocks on 132 SMs.
TEST(IndexerGpu, AutomaticFusedPlanForVerifyBatches) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int sms = mt::current_device_sms();
  constexpr int kBlocks = 256;
  const int R = std::max(1, sms / 2);
  std::vector<RequestSpec> reqs;
  for (int i = 0; i < R; ++i) reqs.push_back({static_cast<int>(rng.integer(2100, 6000)), 4});
  reqs[0] = {kBlocks * 128 - 4, 4};
  DeviceSet d;
  const Inputs in = uploaded_plan_inputs(reqs, false, kBlocks, rng, d);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const IndexerCudaPlan pl = printed_plan(d, sms, R, 4);
  const int ctas64 = R * (kBlocks / 64);
  if (ctas64 >= sms && ctas64 <= 3 * sms) {  // the rule's domain
    const int slots = 3 * sms;
    int c = ((kBlocks * R + slots - 1) / slots + 3) / 4 * 4;
    while (c < 64 && R * ((kBlocks + c - 1) / c) > slots) c += 4;
    if (c < 40) c = 64;
    EXPECT_TRUE(pl.fused);
    EXPECT_FALSE(pl.single);
    EXPECT_EQ(pl.dec_chunk, c);
    EXPECT_EQ(pl.k_splits, (kBlocks + c - 1) / c);
    EXPECT_LE(R * pl.k_splits, slots);
  }
  const GpuResult g = run_gpu(d, two_kernel_in(0));
  compare(in, reference(in), g, false, "verify plan, two-kernel");
  expect_same_ids(in, run_gpu(d, IndexerCudaOptions{}), g, "automatic fused plan for verify");
}

// Flat decode (IndexerCudaOptions::flat_decode) where a request owns one or two warps: R just
// below the flat grid's warp count (1 CTA per SM) at draft 0 and about half of it at draft 1,
// contexts of 17-20 blocks (short, so the twin stays quick at ~500 requests); ids and block
// scores against the twin and ids against the two-kernel path.
TEST(IndexerGpu, FlatDecodeWithFewWarpsPerRequest) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int sms = mt::current_device_sms();
  const int warps = 4 * sms;
  struct Case {
    int R, draft;
  };
  for (const Case& c : {Case{warps - 3, 0}, Case{warps / 2 + 1, 1}}) {
    const int R = c.R, draft = c.draft;
    {
      std::vector<RequestSpec> reqs;
      for (int i = 0; i < R; ++i)
        reqs.push_back({static_cast<int>(rng.integer(2100, 2600 - 1 - draft)), 1 + draft});
      const Inputs in = make_inputs(reqs, 4, rng, /*integer=*/true);
      ASSERT_FALSE(::testing::Test::HasFailure());
      DeviceSet d;
      upload(in, d);
      IndexerCudaOptions fl;
      fl.flat_decode = 1;
      const IndexerCudaPlan pl = indexer_cuda_plan(d.params, fl);
      EXPECT_EQ(pl.flat_ctas, sms);
      EXPECT_FALSE(pl.fused);
      EXPECT_FALSE(pl.single);
      const std::string what =
          "flat 1, " + std::to_string(R) + " requests x " + std::to_string(1 + draft);
      const GpuResult f = run_gpu(d, fl);
      compare(in, reference(in), f, /*exact_scores=*/true, what);
      expect_same_ids(in, f, run_gpu(d, two_kernel_in(0)), what + " vs two-kernel");
    }
  }
}

// The 128K-class context (513 blocks); named Large so the quick sanitizer pass skips it.
TEST(IndexerGpu, GenerationContext65537Large) {
  M3_REQUIRE_GPU();
  check_generation_contexts({65537, 2049}, "generation 65537");
}

TEST(IndexerGpu, IntegerInputsAreExactEverywhere) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int draft : {0, 3, 7}) {
    const std::vector<RequestSpec> reqs = {
        {2049 - 1 - draft, 1 + draft}, {5000, 1 + draft}, {129 * 128 + 5, 1 + draft}, {3000, 150}};
    const Inputs in = make_inputs(reqs, 4, rng, /*integer=*/true);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_all_paths(in, "integer draft " + std::to_string(draft));
  }
}

TEST(IndexerGpu, MixedBatchesOverHeadCounts) {
  M3_REQUIRE_GPU();
  check_mixed({4, 3});
}

TEST(IndexerGpu, MixedBatchesOverHeadCountsLarge) {
  M3_REQUIRE_GPU();
  check_mixed({1, 8});
}

TEST(IndexerGpu, LongGenerationRequestsSpillIntoOverflowTiles) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // n_kv 8: a decode unit holds 4 tokens, so 8-token verify requests also use overflow tiles;
  // many short requests make overflow tiles straddle request boundaries.
  std::vector<RequestSpec> reqs;
  for (int i = 0; i < 24; ++i) reqs.push_back({static_cast<int>(rng.integer(2000, 6000)), 8});
  const Inputs in = make_inputs(reqs, 8, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  check_all_paths(in, "verify n_kv 8");
}

TEST(IndexerGpu, StridedAndUnalignedPools) {
  M3_REQUIRE_GPU();
  check_strided_pools();
}

// Page ids past 2^31 bytes: a 2 MiB page stride and ids above 1024.
TEST(IndexerGpu, SixtyFourBitPageOffsetsLarge) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const Inputs in = make_inputs({{4000, 4}, {2200, 1}}, 4, rng, /*integer=*/true);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const Reference ref = reference(in);
  constexpr int64_t kStride = int64_t{2} << 20;
  constexpr int32_t kShift = 1100;  // 1100 * 2 MiB > 2^31
  const HostBatch& hb = in.hb;
  const int64_t pages = hb.num_pages() + kShift;
  size_t free_b = 0, total_b = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  if (static_cast<int64_t>(free_b) < pages * kStride + (int64_t{1} << 30))
    GTEST_SKIP() << "not enough device memory for a " << pages * kStride << "-byte pool";
  DeviceSet d;
  upload(in, d);
  mt::DeviceBuffer big(static_cast<size_t>((pages - 1) * kStride + int64_t{kPageSize} * kHeadDim),
                       0x7f);
  for (int64_t pg = 0; pg < hb.num_pages(); ++pg)
    big.upload(hb.index_pool.ptr<uint8_t>() + pg * hb.index_page_stride(),
               static_cast<size_t>(kPageSize * kHeadDim),
               static_cast<size_t>((pg + kShift) * kStride));
  Tensor table = hb.page_table.clone();
  for (int64_t i = 0; i < table.numel(); ++i)
    if (table.ptr<int32_t>()[i] >= 0) table.ptr<int32_t>()[i] += kShift;
  d.table.upload(table.data(), static_cast<size_t>(table.nbytes()));
  d.params.index_cache = make_index_cache_view(big.data(), pages, kStride, Device::cuda(0));
  for (bool cores : {false, true}) {
    IndexerCudaOptions o;
    o.force_cuda_cores = cores;
    o.unfused_decode = true;  // block scores in the workspace
    const GpuResult g = run_gpu(d, o);
    compare(in, ref, g, true,
            cores ? "64-bit offsets [cuda cores]" : "64-bit offsets [tensor cores]");
    if (!cores) {
      IndexerCudaOptions f;
      f.fused_decode_always = true;
      ASSERT_TRUE(indexer_cuda_uses_fused_decode(d.params, f));
      expect_same_ids(in, run_gpu(d, f), g, "64-bit offsets [fused vs two-kernel]");
    }
  }
}

TEST(IndexerGpu, ShortContextsSkipScoring) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // max_pages 16: every token sees <= 16 blocks, so only the select kernel runs.
  const Inputs in = make_inputs({{2040, 8}, {0, 300}, {100, 1}}, 4, rng, false, 0, 0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  ASSERT_EQ(in.max_pages(), 16);
  check_all_paths(in, "max_pages 16");
}

TEST(IndexerGpu, NaNScoresAreNeverChosenButTheLocalBlockIs) {
  M3_REQUIRE_GPU();
  check_nan();
}

// The default fused path (block-max tables to the workspace) and the selection kernel's threshold
// selection on rows of 65-156 candidate blocks (contexts 9K-20K, more than 128 blocks: fused by
// default), against the twin and against the two-kernel path with the per-lane sorted lists.
// Small on purpose: the sanitizers run it.
TEST(IndexerGpu, ThresholdSelectionOfLongRows) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (bool integer : {true, false}) {
    const std::vector<RequestSpec> reqs = {{20000 - 4, 4}, {17000, 1}, {9000 - 2, 2}};
    const Inputs in = make_inputs(reqs, 4, rng, integer);
    ASSERT_FALSE(::testing::Test::HasFailure());
    ASSERT_GT(in.max_pages(), 128);
    const Reference ref = reference(in);
    DeviceSet d;
    upload(in, d);
    const std::string name = std::string("long rows ") + (integer ? "integer" : "normal");
    ASSERT_TRUE(indexer_cuda_uses_fused_decode(d.params, IndexerCudaOptions{}));
    const GpuResult g = run_gpu(d, IndexerCudaOptions{});
    compare(in, ref, g, integer, name + " [default]");
    IndexerCudaOptions sorted;
    sorted.unfused_decode = true;
    sorted.fast_select = false;
    const GpuResult s = run_gpu(d, sorted);
    expect_same_ids(in, g, s, name + " [default vs two-kernel, sorted lists]");
  }
}

// The fused path with many splits per row: chunks of 4 or 8 blocks (k_splits 1000), 16 (auto) and
// 48 (k_splits 7), each CTA writing its block-max table at its end, beside a prefill chunk whose
// overflow rows write their block scores as they go; the selection kernel finishes every row.
// Integer inputs (many exact ties, also across split edges) and normal ones, n_kv 4 and 1.
TEST(IndexerGpu, FusedPathOverManySplits) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int n_kv : {4, 1}) {
    for (bool integer : {true, false}) {
      const std::vector<RequestSpec> reqs = {{40000 - 4, 4}, {2600, 300}, {30000, 1},
                                             {5000 - 3, 3},  {100, 1},    {2047, 1}};
      const Inputs in = make_inputs(reqs, n_kv, rng, integer);
      ASSERT_FALSE(::testing::Test::HasFailure());
      const Reference ref = reference(in);
      DeviceSet d;
      upload(in, d);
      for (int k : {0, 1000, 7}) {
        IndexerCudaOptions o;
        o.k_splits = k;
        o.fused_decode_always = true;
        ASSERT_TRUE(indexer_cuda_uses_fused_decode(d.params, o)) << "k_splits " << k;
        IndexerCudaOptions two = o;
        two.unfused_decode = true;
        const std::string name = "fused n_kv " + std::to_string(n_kv) +
                                 (integer ? " integer" : " normal") + " k_splits " +
                                 std::to_string(k);
        const GpuResult g = run_gpu(d, two);
        compare(in, ref, g, integer, name + " [two-kernel]");
        const GpuResult f = run_gpu(d, o);
        expect_same_ids(in, f, g, name + " [fused vs two-kernel]");
        o.single_pass = true;
        if (indexer_cuda_plan(d.params, o).single) {
          const GpuResult c = run_gpu(d, o);
          expect_same_ids(in, c, g, name + " [single pass vs two-kernel]");
        }
      }
    }
  }
}

// Flat decode at two CTAs per SM with rows of <= 63 candidates (no spare page-table column,
// contexts of 17-21 blocks): the selection runs select_short_resident_kernel (the 40-register
// form) at 2 and 4 warps per row; ids and block scores against the twin, ids against the
// two-kernel path. Small, for the sanitizers.
TEST(IndexerGpu, FlatDecodeTwoCtasPerSmSmall) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  std::vector<RequestSpec> reqs;
  for (int i = 0; i < 40; ++i) {
    const int n = 1 + static_cast<int>(rng.integer(0, 3));
    reqs.push_back({static_cast<int>(rng.integer(2100, 2680 - n)), n});
  }
  const Inputs in = make_inputs(reqs, 4, rng, /*integer=*/true, 0, 0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  ASSERT_LE(in.max_pages(), 64);
  DeviceSet d;
  upload(in, d);
  const Reference ref = reference(in);
  IndexerCudaOptions two = two_kernel_in(0);
  two.flat_decode = -1;
  const GpuResult g = run_gpu(d, two);
  compare(in, ref, g, /*exact_scores=*/true, "flat 2 small [two-kernel]");
  for (int w : {2, 4}) {
    IndexerCudaOptions o;
    o.flat_decode = 2;
    o.short_select_warps = w;
    const IndexerCudaPlan pl = indexer_cuda_plan(d.params, o);
    EXPECT_EQ(pl.flat_ctas, 2 * mt::current_device_sms());
    const std::string name = "flat 2 small, " + std::to_string(w) + " warps per row";
    const GpuResult f = run_gpu(d, o);
    compare(in, ref, f, /*exact_scores=*/true, name);
    expect_same_ids(in, f, g, name + " vs two-kernel");
  }
}

// select_short's strict counts (gt_counts + take_by_counts) on rows full of exact ties (integer
// inputs: block maxima are small integers, so tie groups straddle the 15th place in most rows)
// and with NaN blocks, at 2 / 4 warps per row, in both kernel forms (flat 2 runs the 40-register
// one): ids equal to the twin's and to those of one warp per row (select_kernel: the
// per-candidate tie rule, rank_by_counting). Flat 1 / 2 / 3 take their warp assignment in 32-bit
// divisions. Small, for the sanitizers.
TEST(IndexerGpu, StrictCountSelectionSmall) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  std::vector<RequestSpec> reqs;
  for (int i = 0; i < 24; ++i) {
    const int n = 1 + static_cast<int>(rng.integer(0, 3));
    // Request 1 is long enough for its 50 NaN blocks.
    reqs.push_back({static_cast<int>(rng.integer(i == 1 ? 7000 : 1900, 8192 - n)), n});
  }
  Inputs in = make_inputs(reqs, 4, rng, /*integer=*/true, 0, /*extra_cols=*/0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  // NaN keys: request 0 in blocks 2 and 9, request 1 in 50 of its blocks (fewer than 15
  // candidates remain).
  for (int b : {2, 9}) in.hb.index_row(0, b * 128 + 7)[5] = 0x7f;
  for (int b = 0; b < 50; ++b) in.hb.index_row(1, b * 128 + 64)[3] = 0x7f;
  ASSERT_LE(in.max_pages(), 64);
  DeviceSet d;
  upload(in, d);
  const Reference ref = reference(in);
  IndexerCudaOptions one = two_kernel_in(0);
  one.flat_decode = -1;
  one.short_select = false;
  const GpuResult g = run_gpu(d, one);
  compare(in, ref, g, /*exact_scores=*/true, "strict counts small [one warp per row]");
  for (int flat : {-1, 1, 2, 3}) {
    for (int w : {2, 4}) {
      IndexerCudaOptions o;
      o.unfused_decode = flat < 0;
      o.flat_decode = flat;
      o.short_select_warps = w;
      const std::string name = "strict counts small, flat " + std::to_string(flat) + ", " +
                               std::to_string(w) + " warps per row";
      const GpuResult f = run_gpu(d, o);
      compare(in, ref, f, /*exact_scores=*/true, name);
      expect_same_ids(in, f, g, name + " vs one warp per row");
    }
  }
}

}  // namespace
}  // namespace m3attn::indexer_gpu_test
