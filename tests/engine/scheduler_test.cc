// The scheduler: a hand-traced schedule, then invariants over random workloads (budget, batch
// order, generation first, exact token counts, page accounting and admission against the pool).
#include "engine/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <vector>

#include "support/test_util.h"

namespace m3attn {
namespace {

Workload make_workload(int64_t in, int64_t out, int conc, int n, int draft) {
  Workload w;
  w.input_len = in;
  w.output_len = out;
  w.concurrency = conc;
  w.num_requests = n;
  w.draft_len = draft;
  return w;
}

// Step time used by the tests: 1000 us per step plus 1 us per token.
double fake_time(const StepPlan& p) { return 1000.0 + static_cast<double>(p.num_tokens()); }

struct Traced {
  std::vector<StepPlan> plans;
};

Traced run_all(Scheduler& s) {
  Traced t;
  while (!s.done()) {
    Result<StepPlan> p = s.next_step();
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    if (!p.ok()) break;
    EXPECT_TRUE(s.finish_step(p.value(), fake_time(p.value())).ok());
    t.plans.push_back(std::move(p.value()));
    if (t.plans.size() > 100000) {
      ADD_FAILURE() << "runaway schedule";
      break;
    }
  }
  return t;
}

TEST(Scheduler, HandTracedChunkedSchedule) {
  // input 40, output 4, concurrency 2, 3 requests, 32 tokens per step:
  //  1 prefill [r0 32]          2 prefill [r0 8, r1 24] (r0 token 1)
  //  3 mixed   [r1 16 | r0]     (r0 2, r1 1)           4 decode [r0, r1] (3, 2)
  //  5 decode  [r0, r1] (r0 done 4, r1 3)            6 mixed [r2 31 | r1] (r1 done; r2 admitted)
  //  7 prefill [r2 9] (r2 1)   8-10 decode [r2] (r2 done at 4)
  SchedulerOptions o;
  o.max_tokens_per_step = 32;
  Result<Scheduler> s = Scheduler::create(make_workload(40, 4, 2, 3, 0), o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const Traced t = run_all(s.value());
  ASSERT_EQ(t.plans.size(), 10u);
  const std::vector<StepPhase> phases = {
      StepPhase::kPrefill, StepPhase::kPrefill, StepPhase::kMixed,   StepPhase::kDecode,
      StepPhase::kDecode,  StepPhase::kMixed,   StepPhase::kPrefill, StepPhase::kDecode,
      StepPhase::kDecode,  StepPhase::kDecode};
  const std::vector<std::vector<int64_t>> ids = {{0},    {0, 1}, {1, 0}, {0, 1}, {0, 1},
                                                 {2, 1}, {2},    {2},    {2},    {2}};
  const std::vector<std::vector<int32_t>> qs = {{0, 32},   {0, 8, 32},  {0, 16, 17}, {0, 1, 2},
                                                {0, 1, 2}, {0, 31, 32}, {0, 9},      {0, 1},
                                                {0, 1},    {0, 1}};
  for (size_t i = 0; i < t.plans.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "step " << i + 1);
    EXPECT_EQ(s.value().steps()[i].phase, phases[i]);
    EXPECT_EQ(t.plans[i].request_ids, ids[i]);
    EXPECT_EQ(t.plans[i].query_start, qs[i]);
  }
  // Positions continue from the cache: step 3 holds r1 at 24..39 then r0 at 40.
  EXPECT_EQ(t.plans[2].positions.front(), 24);
  EXPECT_EQ(t.plans[2].positions.back(), 40);
  const auto& rq = s.value().requests();
  double clock = 0;
  std::vector<double> end;
  for (const StepPlan& p : t.plans) end.push_back(clock += fake_time(p));
  EXPECT_EQ(rq[0].admit_us, 0);
  EXPECT_EQ(rq[0].first_token_us, end[1]);
  EXPECT_EQ(rq[0].finish_us, end[4]);
  EXPECT_EQ(rq[1].first_token_us, end[2]);
  EXPECT_EQ(rq[1].finish_us, end[5]);
  EXPECT_EQ(rq[2].admit_us, end[4]);  // admitted when r0 finished
  EXPECT_EQ(rq[2].first_token_us, end[6]);
  EXPECT_EQ(rq[2].finish_us, end[9]);
  EXPECT_EQ(rq[2].prefill_chunks, 2);
  EXPECT_EQ(s.value().cache().num_requests(), 0u);
  EXPECT_EQ(s.value().cache().num_free_pages(), s.value().cache().num_pages());
}

TEST(Scheduler, DraftsCountAsAcceptedAndCapAtOutputLength) {
  // output 5, draft 2: token 1 at prefill, then 3 per step, the last step counts 1.
  Result<Scheduler> s = Scheduler::create(make_workload(130, 5, 1, 1, 2), {});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s.value().options().num_pages, 2);  // ceil((130 + 5 + 2) / 128)
  const Traced t = run_all(s.value());
  ASSERT_EQ(t.plans.size(), 3u);
  EXPECT_EQ(t.plans[1].num_generation_tokens, 3);
  EXPECT_EQ(t.plans[1].positions, (std::vector<int32_t>{130, 131, 132}));
  EXPECT_EQ(t.plans[2].positions, (std::vector<int32_t>{133, 134, 135}));
  EXPECT_EQ(s.value().steps()[1].output_tokens, 3);
  EXPECT_EQ(s.value().steps()[2].output_tokens, 1);
  EXPECT_EQ(s.value().requests()[0].generated, 5);
}

TEST(Scheduler, OutputLengthOneFinishesAtPrefill) {
  Result<Scheduler> s = Scheduler::create(make_workload(10, 1, 2, 5, 0), {});
  ASSERT_TRUE(s.ok());
  const Traced t = run_all(s.value());
  ASSERT_EQ(t.plans.size(), 3u);  // 2 + 2 + 1 requests, all prefill-only
  for (const StepRecord& r : s.value().steps()) EXPECT_EQ(r.phase, StepPhase::kPrefill);
  for (const RequestRecord& r : s.value().requests()) EXPECT_EQ(r.first_token_us, r.finish_us);
}

TEST(Scheduler, InvariantsOverRandomWorkloads) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  testing::Rng rng(seed);
  for (int iter = 0; iter < 60; ++iter) {
    const Workload w =
        make_workload(rng.integer(1, 700), rng.integer(1, 20), static_cast<int>(rng.integer(1, 6)),
                      static_cast<int>(rng.integer(1, 12)), static_cast<int>(rng.integer(0, 3)));
    SchedulerOptions o;
    o.max_tokens_per_step = rng.integer(1 + w.draft_len, 600);
    // Sometimes a pool that holds fewer requests than the concurrency allows.
    const int64_t ppr = w.pages_per_request();
    const int64_t fit = rng.integer(1, w.concurrency);
    if (rng.integer(0, 1)) o.num_pages = fit * ppr + rng.integer(0, ppr - 1);
    const int64_t cap = o.num_pages ? std::min<int64_t>(fit, w.concurrency) : w.concurrency;
    SCOPED_TRACE(::testing::Message()
                 << "iter " << iter << ": in " << w.input_len << " out " << w.output_len << " conc "
                 << w.concurrency << " n " << w.num_requests << " draft " << w.draft_len
                 << " budget " << o.max_tokens_per_step << " pages " << o.num_pages);
    Result<Scheduler> sr = Scheduler::create(w, o);
    ASSERT_TRUE(sr.ok()) << sr.status().to_string();
    Scheduler& s = sr.value();
    std::map<int64_t, int64_t> chunk_sum;
    int64_t peak = 0;
    while (!s.done()) {
      // Requests decoding before the step (prompt complete, not finished).
      std::vector<int64_t> decoding;
      for (const RequestRecord& r : s.requests())
        if (r.admitted() && !r.finished() && r.prefilled == w.input_len) decoding.push_back(r.id);
      std::map<int64_t, int64_t> len_before;
      for (int64_t id : s.cache().request_ids()) len_before[id] = s.cache().length(id);
      Result<StepPlan> pr = s.next_step();
      ASSERT_TRUE(pr.ok()) << pr.status().to_string();
      const StepPlan& p = pr.value();
      ASSERT_GE(p.num_tokens(), 1);
      ASSERT_LE(p.num_tokens(), o.max_tokens_per_step) << "budget exceeded";
      ASSERT_LE(s.in_flight(), cap) << "admission ignored the pool or the concurrency";
      ASSERT_LE(s.committed_pages(), s.options().num_pages);
      ASSERT_LE(s.cache().allocator().num_used(), s.options().num_pages);
      peak = std::max<int64_t>(peak, s.in_flight());
      ASSERT_EQ(p.max_pages, ppr);
      for (int i = 0; i < p.num_requests(); ++i) {
        const int64_t id = p.request_ids[static_cast<size_t>(i)];
        const RequestRecord& r = s.requests()[static_cast<size_t>(id)];
        const int32_t n =
            p.query_start[static_cast<size_t>(i) + 1] - p.query_start[static_cast<size_t>(i)];
        const int64_t before = len_before.count(id) ? len_before[id] : 0;
        ASSERT_EQ(p.positions[static_cast<size_t>(p.query_start[static_cast<size_t>(i)])], before)
            << "positions do not continue from the cache";
        if (i < p.num_context_requests) {
          ASSERT_LT(r.prefilled, w.input_len) << "context chunk of a prefilled request";
          ASSERT_EQ(before, r.prefilled);
          ASSERT_LE(r.prefilled + n, w.input_len) << "chunk past the prompt";
          chunk_sum[id] += n;
        } else {
          ASSERT_EQ(r.prefilled, w.input_len) << "generation before the prompt completed";
          ASSERT_EQ(n, 1 + w.draft_len);
        }
      }
      // Generation first: a step that carries prompt tokens serves every decoding request.
      if (p.num_context_tokens > 0) {
        ASSERT_EQ(p.num_generation_requests, static_cast<int>(decoding.size()));
      }
      ASSERT_TRUE(s.finish_step(p, fake_time(p)).ok());
    }
    for (const RequestRecord& r : s.requests()) {
      ASSERT_EQ(r.generated, w.output_len) << "request " << r.id;
      ASSERT_EQ(chunk_sum[r.id], w.input_len);
      ASSERT_TRUE(r.finished());
      ASSERT_LE(r.admit_us, r.first_token_us);
      ASSERT_LE(r.first_token_us, r.finish_us);
    }
    int64_t out = 0;
    for (const StepRecord& r : s.steps()) out += r.output_tokens;
    EXPECT_EQ(out, int64_t{w.num_requests} * w.output_len);
    // No page leak, no request left behind.
    EXPECT_EQ(s.cache().num_requests(), 0u);
    EXPECT_EQ(s.cache().num_free_pages(), s.options().num_pages);
    EXPECT_EQ(s.committed_pages(), 0);
    EXPECT_EQ(peak, std::min<int64_t>(cap, w.num_requests)) << "the pool was never filled";
  }
}

TEST(Scheduler, Rejections) {
  EXPECT_EQ(Scheduler::create(make_workload(0, 4, 1, 1, 0), {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Scheduler::create(make_workload(4, 0, 1, 1, 0), {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Scheduler::create(make_workload(4, 4, 0, 1, 0), {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Scheduler::create(make_workload(4, 4, 1, 0, 0), {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Scheduler::create(make_workload(4, 4, 1, 1, -1), {}).status().code(),
            StatusCode::kInvalidArgument);
  SchedulerOptions o;
  o.max_tokens_per_step = 2;  // cannot hold 1 + 2 drafts
  EXPECT_EQ(Scheduler::create(make_workload(4, 4, 1, 1, 2), o).status().code(),
            StatusCode::kInvalidArgument);
  o = {};
  o.num_pages = 1;  // one request needs 2 pages
  Result<Scheduler> small = Scheduler::create(make_workload(200, 4, 1, 1, 0), o);
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("cannot hold one request"), std::string::npos)
      << small.status().to_string();
  // Out-of-order calls.
  Result<Scheduler> s = Scheduler::create(make_workload(4, 2, 1, 1, 0), {});
  ASSERT_TRUE(s.ok());
  StepPlan empty;
  EXPECT_FALSE(s.value().finish_step(empty, 1.0).ok());
  Result<StepPlan> p = s.value().next_step();
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(s.value().next_step().ok());
  EXPECT_FALSE(s.value().finish_step(p.value(), -1.0).ok());
}

}  // namespace
}  // namespace m3attn
