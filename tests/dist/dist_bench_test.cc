// The multi-rank serving loop on the CPU backend, ranks as threads (thread host collectives):
// attention-DP deals the requests, keeps the ranks in lock-step, runs dummy generation steps on
// idle ranks and rolls their pages back; the real work of a rank is unchanged by it.
#include "engine/dist_bench.h"

#include <gtest/gtest.h>

#include <thread>

#include "dist/communicator.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

DistBenchOptions small_options(ParallelMode mode, int requests, int concurrency, int draft) {
  DistBenchOptions o;
  o.backend = "cpu";
  o.geometry.hidden = 256;
  o.geometry.n_q = 8;
  o.geometry.n_kv = 2;
  o.num_dense = 1;
  o.num_sparse = 1;
  o.workload.input_len = 40;
  o.workload.output_len = 3;
  o.workload.num_requests = requests;
  o.workload.concurrency = concurrency;
  o.workload.draft_len = draft;
  o.workload.seed = 5;
  o.max_tokens_per_step = 32;
  o.mode = mode;
  return o;
}

// Runs every rank in its own thread; returns the reports by rank (statuses in *statuses).
std::vector<Result<DistBenchReport>> run_ranks(const DistBenchOptions& o, int ranks) {
  std::vector<std::unique_ptr<HostCollective>> group = make_thread_host_collectives(ranks);
  std::vector<Result<DistBenchReport>> out(static_cast<size_t>(ranks),
                                           Result<DistBenchReport>(internal_error("not run")));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r]() {
      out[static_cast<size_t>(r)] = run_dist_bench_rank(o, *group[static_cast<size_t>(r)], nullptr);
    });
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(DistBenchTest, DataParallelDealsRequestsAndRunsDummies) {
  // 3 requests over 2 ranks: rank 0 serves 2 (one at a time), rank 1 serves 1 and then idles,
  // running dummy generation steps (draft 1: 2 tokens each) until rank 0 is done.
  const DistBenchOptions o = small_options(ParallelMode::kData, 3, 2, 1);
  std::vector<Result<DistBenchReport>> reps = run_ranks(o, 2);
  for (const auto& r : reps) ASSERT_TRUE(r.ok()) << r.status().to_string();
  const DistBenchReport& a = reps[0].value();
  const DistBenchReport& b = reps[1].value();
  EXPECT_EQ(a.ranks, 2);
  EXPECT_EQ(a.rank_requests, (std::vector<int>{2, 1}));
  EXPECT_EQ(a.requests, 3);
  EXPECT_EQ(a.input_tokens, 3 * 40);
  EXPECT_EQ(a.output_tokens, 3 * 3);
  EXPECT_EQ(a.steps, b.steps) << "lock-step";
  EXPECT_EQ(a.duration_us, b.duration_us);
  ASSERT_EQ(a.dummy_steps.size(), 2u);
  EXPECT_EQ(a.dummy_steps[0], 0);
  EXPECT_GT(a.dummy_steps[1], 0);
  EXPECT_EQ(a.dummy_steps[1] + b.rank0.steps, a.steps)
      << "rank 1 runs a dummy in every lock-step step after its own work";
  EXPECT_TRUE(a.rollbacks_verified);
  EXPECT_TRUE(a.finite);
  EXPECT_GT(a.output_tokens_per_s, 0);
  EXPECT_DOUBLE_EQ(a.output_tokens_per_s_per_gpu, a.output_tokens_per_s / 2);
  EXPECT_FALSE(a.to_text().empty());
  EXPECT_NE(a.to_json().find("\"dummy_steps\""), std::string::npos);

  // Rank 0's own work alone (DP1 over its share) gives the same final hidden states and steps.
  DistBenchOptions alone = o;
  alone.workload.num_requests = 2;
  alone.workload.concurrency = 1;
  std::vector<Result<DistBenchReport>> one = run_ranks(alone, 1);
  ASSERT_TRUE(one[0].ok()) << one[0].status().to_string();
  EXPECT_EQ(one[0].value().final_rms, a.final_rms);
  EXPECT_EQ(one[0].value().rank0.steps, a.rank0.steps);
  EXPECT_EQ(one[0].value().dummy_steps[0], 0);
}

TEST(DistBenchTest, RankWithoutRequestsRunsDummiesThroughout) {
  const DistBenchOptions o = small_options(ParallelMode::kData, 1, 1, 0);
  std::vector<Result<DistBenchReport>> reps = run_ranks(o, 2);
  for (const auto& r : reps) ASSERT_TRUE(r.ok()) << r.status().to_string();
  const DistBenchReport& a = reps[0].value();
  EXPECT_EQ(a.rank_requests, (std::vector<int>{1, 0}));
  EXPECT_EQ(a.dummy_steps[1], a.steps);
  EXPECT_EQ(a.requests, 1);
  EXPECT_TRUE(a.rollbacks_verified);
}

TEST(DistBenchTest, TensorParallelNeedsCudaAndACommunicator) {
  const DistBenchOptions o = small_options(ParallelMode::kTensor, 2, 2, 0);
  std::vector<Result<DistBenchReport>> reps = run_ranks(o, 2);
  for (const auto& r : reps) EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  // TP1 on the CPU is the plain serving loop.
  std::vector<Result<DistBenchReport>> one = run_ranks(o, 1);
  ASSERT_TRUE(one[0].ok()) << one[0].status().to_string();
  EXPECT_EQ(one[0].value().requests, 2);
  EXPECT_EQ(one[0].value().output_tokens, 2 * 3);
  EXPECT_TRUE(one[0].value().dummy_steps == std::vector<int64_t>{0});
}

}  // namespace
}  // namespace m3attn
