// run_bench end to end on the CPU: a short fused + unfused run with the expected counts, identical
// outputs, and a JSON report with every field; single-variant runs and rejected options.
#include "engine/bench.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "support/test_util.h"

namespace m3attn {
namespace {

BenchOptions tiny_options(uint64_t seed) {
  BenchOptions o;
  o.backend = "cpu";
  o.geometry.hidden = 256;
  o.geometry.n_q = 2;
  o.geometry.n_kv = 1;
  o.num_dense = 1;
  o.num_sparse = 1;
  o.workload.input_len = 21;
  o.workload.output_len = 4;
  o.workload.concurrency = 2;
  o.workload.num_requests = 3;
  o.workload.draft_len = 1;
  o.workload.seed = seed;
  o.max_tokens_per_step = 16;
  o.digest_every_step = true;
  return o;
}

TEST(Bench, FusedAndUnfusedCpuRun) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  int calls = 0, last_finished = -1;
  Result<BenchReport> rep = run_bench(tiny_options(seed), [&](const BenchProgress& p) {
    ++calls;
    EXPECT_EQ(p.runs, 2);
    EXPECT_EQ(p.total, 3);
    EXPECT_FALSE(p.warmup);
    last_finished = p.finished;
  });
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  const BenchReport& r = rep.value();
  EXPECT_EQ(r.backend, "cpu");
  ASSERT_EQ(r.runs.size(), 2u);
  EXPECT_EQ(last_finished, 3);
  EXPECT_EQ(r.pages_per_request, 1);
  EXPECT_EQ(r.options.num_pages, 2);
  EXPECT_GT(r.pool_bytes, 0);
  for (const BenchRun& run : r.runs) {
    const ServingMetrics& m = run.metrics;
    EXPECT_EQ(m.requests, 3);
    EXPECT_EQ(m.input_tokens, 3 * 21);
    EXPECT_EQ(m.output_tokens, 3 * 4);
    EXPECT_EQ(m.prefill.steps + m.mixed.steps + m.decode.steps, m.steps);
    EXPECT_GT(m.mixed.steps, 0);
    EXPECT_GT(m.decode.steps, 0);
    EXPECT_GT(m.duration_us, 0);
    EXPECT_GT(m.ttft_median_us, 0);
    EXPECT_GT(m.tpot_median_us, 0);
    EXPECT_LE(m.ttft_median_us, m.ttft_p90_us);
    EXPECT_LE(m.tpot_median_us, m.tpot_p90_us);
    EXPECT_TRUE(run.finite);
    EXPECT_GT(run.final_rms, 0);
    EXPECT_EQ(run.graph_replays, 0);
  }
  EXPECT_EQ(calls, 2 * static_cast<int>(r.runs[0].metrics.steps));
  EXPECT_EQ(r.runs[0].metrics.steps, r.runs[1].metrics.steps);  // one schedule for both
  EXPECT_TRUE(r.run(true) && r.run(false));
  EXPECT_TRUE(r.compared);
  EXPECT_TRUE(r.digests_equal) << "the CPU twins must agree bit for bit";
  EXPECT_EQ(r.final_rel_l2, 0.0);

  const nlohmann::json j = nlohmann::json::parse(r.to_json());
  EXPECT_EQ(j["backend"], "cpu");
  EXPECT_EQ(j["workload"]["requests"], 3);
  EXPECT_EQ(j["runs"]["fused"]["tokens"]["output"], 12);
  EXPECT_EQ(j["runs"]["unfused"]["requests"], 3);
  EXPECT_TRUE(j["runs"]["fused"]["phases"].contains("mixed"));
  EXPECT_TRUE(j["fused_over_unfused"].contains("tpot_median"));
  EXPECT_EQ(j["outputs"]["bit_identical"], true);
  EXPECT_EQ(j["attention_only"], true);
  const std::string text = r.to_text();
  EXPECT_NE(text.find("fused/unfused"), std::string::npos) << text;
  EXPECT_NE(text.find("TPOT median"), std::string::npos) << text;
  EXPECT_NE(text.find("every step bit-identical"), std::string::npos) << text;
}

TEST(Bench, SingleVariant) {
  BenchOptions o = tiny_options(7);
  o.run_unfused = false;
  o.workload.num_requests = 1;
  o.workload.output_len = 1;
  Result<BenchReport> rep = run_bench(o);
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  ASSERT_EQ(rep.value().runs.size(), 1u);
  EXPECT_TRUE(rep.value().runs[0].fused);
  EXPECT_FALSE(rep.value().compared);
  EXPECT_EQ(rep.value().runs[0].metrics.output_tokens, 1);
  EXPECT_EQ(rep.value().to_text().find("fused/unfused"), std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(rep.value().to_json());
  EXPECT_FALSE(j.contains("fused_over_unfused"));
  EXPECT_TRUE(j["runs"].contains("fused"));
}

TEST(Bench, WarmupIsNotMeasured) {
  BenchOptions o = tiny_options(3);
  o.warmup = true;
  o.run_unfused = false;
  o.workload.input_len = 126;  // warm-up requests must not need more pages than real ones
  o.workload.output_len = 1;
  o.workload.draft_len = 0;
  o.max_tokens_per_step = 200;
  int warm = 0, measured = 0;
  Result<BenchReport> rep =
      run_bench(o, [&](const BenchProgress& p) { (p.warmup ? warm : measured) += 1; });
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  EXPECT_GT(warm, 0);
  EXPECT_EQ(measured, rep.value().runs[0].metrics.steps);
  EXPECT_EQ(rep.value().runs[0].metrics.input_tokens, 3 * 126);  // warm-up tokens not counted
  EXPECT_EQ(rep.value().runs[0].metrics.output_tokens, 3);
}

TEST(Bench, RejectedOptions) {
  BenchOptions o = tiny_options(1);
  o.backend = "tpu";
  EXPECT_EQ(run_bench(o).status().code(), StatusCode::kInvalidArgument);
  o = tiny_options(1);
  o.run_fused = o.run_unfused = false;
  EXPECT_EQ(run_bench(o).status().code(), StatusCode::kInvalidArgument);
  o = tiny_options(1);
  o.max_tokens_per_step = 1;  // draft 1 needs 2
  EXPECT_EQ(run_bench(o).status().code(), StatusCode::kInvalidArgument);
  o = tiny_options(1);
  o.num_dense = o.num_sparse = 0;
  EXPECT_EQ(run_bench(o).status().code(), StatusCode::kInvalidArgument);
#if !defined(M3ATTN_WITH_CUDA)
  o = tiny_options(1);
  o.backend = "cuda";
  EXPECT_EQ(run_bench(o).status().code(), StatusCode::kUnsupported);
  EXPECT_FALSE(cuda_backend_available());
#endif
}

}  // namespace
}  // namespace m3attn
