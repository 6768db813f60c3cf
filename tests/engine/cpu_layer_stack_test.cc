// The CPU LayerStack: fused and unfused stacks give bit-identical hidden states over a whole
// scheduled run (chunked prefill, mixed and decode steps with drafts), set_fused switches paths,
// chunking does not change a token's result, the host stack math against fp64, rejections.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/numeric.h"
#include "engine/layer_stack.h"
#include "engine/scheduler.h"
#include "engine/stack_math.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

LayerStackConfig small_config(uint64_t seed, bool fused, const Workload& w, int64_t budget) {
  LayerStackConfig c;
  c.geometry.hidden = 256;
  c.geometry.n_q = 4;
  c.geometry.n_kv = 2;
  c.num_dense = 1;
  c.num_sparse = 1;
  c.num_pages = int64_t{w.concurrency} * w.pages_per_request();
  c.max_tokens_per_step = budget;
  c.max_requests_per_step = w.concurrency;
  c.max_pages_per_request = static_cast<int>(w.pages_per_request());
  c.max_position = static_cast<int>(w.max_position());
  c.fuse_qkv_index_projection = fused;
  c.seed = seed;
  return c;
}

std::unique_ptr<LayerStack> make_stack(const LayerStackConfig& c) {
  Result<std::unique_ptr<LayerStack>> s = create_cpu_layer_stack(c);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? std::move(s.value()) : nullptr;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

TEST(CpuLayerStack, FusedAndUnfusedAreBitIdenticalOverAScheduledRun) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Workload w;
  w.input_len = 131;  // two pages of prompt, chunked
  w.output_len = 3;
  w.concurrency = 2;
  w.num_requests = 3;
  w.draft_len = 1;
  w.seed = seed;
  SchedulerOptions so;
  so.max_tokens_per_step = 97;
  Result<Scheduler> sched = Scheduler::create(w, so);
  ASSERT_TRUE(sched.ok());
  auto fused = make_stack(small_config(seed, true, w, so.max_tokens_per_step));
  auto unfused = make_stack(small_config(seed, false, w, so.max_tokens_per_step));
  // A third stack starts fused and is switched: it must follow the unfused one exactly, and
  // switching back must follow the fused one.
  auto switched = make_stack(small_config(seed, true, w, so.max_tokens_per_step));
  ASSERT_TRUE(fused && unfused && switched);
  EXPECT_STREQ(fused->backend(), "cpu");
  int steps = 0;
  bool saw_mixed = false, saw_decode = false;
  while (!sched.value().done()) {
    Result<StepPlan> p = sched.value().next_step();
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    switched->set_fused(steps % 2 == 1);
    StackStepStats st_f, st_u, st_s;
    ASSERT_TRUE(fused->step(p.value(), &st_f).ok());
    ASSERT_TRUE(unfused->step(p.value(), &st_u).ok());
    ASSERT_TRUE(switched->step(p.value(), &st_s).ok());
    EXPECT_GT(st_f.step_us, 0.0);
    EXPECT_FALSE(st_f.graph_replay);
    Result<Tensor> hf = fused->last_hidden(), hu = unfused->last_hidden(),
                   hs = switched->last_hidden();
    ASSERT_TRUE(hf.ok() && hu.ok() && hs.ok());
    ASSERT_EQ(hf.value().shape(), (std::vector<int64_t>{p.value().num_tokens(), 256}));
    EXPECT_TRUE(same_bytes(hf.value(), hu.value())) << "step " << steps;
    EXPECT_TRUE(same_bytes(hf.value(), hs.value())) << "step " << steps;
    // The residual stream moved away from the input and stayed finite.
    double ss = 0;
    int64_t changed = 0;
    const uint16_t* h = hf.value().ptr<uint16_t>();
    for (int64_t t = 0; t < p.value().num_tokens(); ++t) {
      for (int c = 0; c < 256; ++c) {
        const float v = bf16_to_float(h[t * 256 + c]);
        ASSERT_TRUE(std::isfinite(v));
        ss += static_cast<double>(v) * v;
      }
    }
    for (int r = 0; r < p.value().num_requests(); ++r) {
      const int32_t t = p.value().query_start[static_cast<size_t>(r)];
      for (int c = 0; c < 256; ++c)
        changed += h[t * 256 + c] !=
                   synthetic_hidden_bf16(seed, p.value().request_ids[static_cast<size_t>(r)],
                                         p.value().positions[static_cast<size_t>(t)], c);
    }
    EXPECT_GT(changed, 0) << "the layers did not change the residual stream";
    EXPECT_GT(ss, 0.0);
    const StepPhase phase = p.value().num_context_requests == 0      ? StepPhase::kDecode
                            : p.value().num_generation_requests == 0 ? StepPhase::kPrefill
                                                                     : StepPhase::kMixed;
    saw_mixed |= phase == StepPhase::kMixed;
    saw_decode |= phase == StepPhase::kDecode;
    ASSERT_TRUE(sched.value().finish_step(p.value(), st_f.step_us).ok());
    ++steps;
  }
  EXPECT_TRUE(saw_mixed);
  EXPECT_TRUE(saw_decode);
}

// A token's final hidden state does not depend on how its prompt was chunked (every stage of the
// CPU layer is per token given the cache), so one-shot and chunked prefill agree bit for bit.
TEST(CpuLayerStack, ChunkedPrefillEqualsOneShot) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  testing::Rng rng(seed);
  const int64_t len = rng.integer(140, 300), split = rng.integer(1, len - 1);
  Workload w;
  w.input_len = len;
  w.output_len = 1;
  w.concurrency = 1;
  w.num_requests = 1;
  LayerStackConfig c = small_config(seed, true, w, len);
  c.num_dense = 0;
  c.num_sparse = 2;
  auto one = make_stack(c);
  auto two = make_stack(c);
  ASSERT_TRUE(one && two);
  CacheManager cm1(c.num_pages), cm2(c.num_pages);
  Result<StepPlan> p1 = plan_step(cm1, {{{5, 0, len}}, {}, 0});
  ASSERT_TRUE(p1.ok());
  ASSERT_TRUE(one->step(p1.value(), nullptr).ok());
  Result<StepPlan> a = plan_step(cm2, {{{5, 0, split}}, {}, 0});
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(two->step(a.value(), nullptr).ok());
  Result<StepPlan> b = plan_step(cm2, {{{5, split, len - split}}, {}, 0});
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(two->step(b.value(), nullptr).ok());
  Result<Tensor> h1 = one->last_hidden(), h2 = two->last_hidden();
  ASSERT_TRUE(h1.ok() && h2.ok());
  const size_t row = 256 * sizeof(uint16_t);
  EXPECT_EQ(std::memcmp(h1.value().ptr<uint16_t>() + split * 256, h2.value().data(),
                        static_cast<size_t>(len - split) * row),
            0)
      << "split at " << split << " of " << len;
}

TEST(CpuLayerStack, StackMathAgainstFp64) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  testing::Rng rng(seed);
  const int hidden = 300;
  const int64_t T = 5;
  std::vector<uint16_t> h(T * hidden), x(T * hidden), a(T * hidden);
  for (size_t i = 0; i < h.size(); ++i) {
    h[i] = float_to_bf16(rng.normal(0.0f, i % 7 == 0 ? 30.0f : 1.0f));
    a[i] = float_to_bf16(rng.normal());
  }
  const float eps = 1e-6f;
  rmsnorm_unit_bf16(h.data(), T, hidden, eps, x.data());
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int c = 0; c < hidden; ++c) {
      const double v = bf16_to_float(h[static_cast<size_t>(t * hidden + c)]);
      ss += v * v;
    }
    const double inv = 1.0 / std::sqrt(ss / hidden + eps);
    double out_ss = 0;
    for (int c = 0; c < hidden; ++c) {
      const size_t i = static_cast<size_t>(t * hidden + c);
      const double expect = bf16_to_float(h[i]) * inv;
      const double got = bf16_to_float(x[i]);
      // One bf16 rounding (2^-8 relative) plus fp32 sum-order effects (< 1e-5 relative).
      ASSERT_LE(std::fabs(got - expect), std::fabs(expect) * (1.0 / 256 + 1e-5) + 1e-30);
      out_ss += got * got;
    }
    EXPECT_NEAR(out_ss / hidden, 1.0, 0.01);  // unit RMS after the norm
  }
  std::vector<uint16_t> r = h;
  residual_add_bf16(r.data(), a.data(), T * hidden);
  for (size_t i = 0; i < r.size(); ++i) {
    const float expect = bf16_to_float(h[i]) + bf16_to_float(a[i]);  // exact in fp32 here
    ASSERT_EQ(r[i], float_to_bf16(expect));
  }
}

TEST(CpuLayerStack, Rejections) {
  Workload w;
  w.input_len = 10;
  w.output_len = 2;
  LayerStackConfig good = small_config(1, true, w, 16);
  LayerStackConfig c = good;
  c.num_dense = 0;
  c.num_sparse = 0;
  EXPECT_EQ(create_cpu_layer_stack(c).status().code(), StatusCode::kInvalidArgument);
  c = good;
  c.num_pages = 0;
  EXPECT_EQ(create_cpu_layer_stack(c).status().code(), StatusCode::kInvalidArgument);
  c = good;
  c.max_tokens_per_step = 0;
  EXPECT_EQ(create_cpu_layer_stack(c).status().code(), StatusCode::kInvalidArgument);
  c = good;
  c.geometry.n_q = 3;  // not a multiple of n_kv
  EXPECT_FALSE(create_cpu_layer_stack(c).ok());
  auto stack = make_stack(good);
  ASSERT_TRUE(stack);
  CacheManager cm(good.num_pages);
  Result<StepPlan> big = plan_step(cm, {{{0, 0, 17}}, {}, 0});  // over 16 tokens per step
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(stack->step(big.value(), nullptr).code(), StatusCode::kInvalidArgument);
  Result<Tensor> h = stack->last_hidden();  // nothing ran
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h.value().numel(), 0);
}

}  // namespace
}  // namespace m3attn
