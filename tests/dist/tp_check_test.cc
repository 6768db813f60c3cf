// compare_tp_output (the bound `m3attn tp check` gates on) on the one-process TP simulation: for
// P in {2, 4, 8} the reduced rank partials of TensorParallelLayer stay within the bound of the TP1
// MsaLayer output, and a missing partial, a NaN or a shifted element is caught.
#include "dist/tp_check.h"

#include <gtest/gtest.h>

#include <cmath>
#include <iostream>

#include "cache/page_allocator.h"
#include "cache/step_plan.h"
#include "layer/layer_fixture.h"
#include "layer/tensor_parallel.h"

namespace m3attn {
namespace {

using namespace m3attn::testing;  // NOLINT(build/namespaces)

// Rank cores [T, n_q_r*128] side by side -> [T, n_q*128].
Tensor concat_cores(const std::vector<LayerTrace>& traces) {
  const int64_t T = traces[0].attn_core.shape()[0], w = traces[0].attn_core.shape()[1];
  const int64_t P = static_cast<int64_t>(traces.size());
  Tensor out(DType::kBF16, {T, P * w});
  for (int64_t r = 0; r < P; ++r)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < w; ++i)
        out.ptr<uint16_t>()[t * P * w + r * w + i] =
            traces[static_cast<size_t>(r)].attn_core.ptr<uint16_t>()[t * w + i];
  return out;
}

TEST(TpCheckTest, SimulatedRanksPassAndCorruptionsFail) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = small_geometry(256, 8, 2);
  Result<AttentionWeights> w = random_attention_weights(g, seed, true);
  ASSERT_TRUE(w.ok());
  const Tensor rope = make_rope();
  const MsaLayer ref = make_layer(w.value(), rope, true);
  constexpr int64_t kPages = 8;
  PagePool ref_pool = make_random_pool(g.n_kv, kPages, true, rng);
  std::vector<TensorParallelLayer> tps;
  for (int P : {2, 4, 8}) {
    Result<TensorParallelLayer> tp = TensorParallelLayer::create(w.value(), P, rope.view(), kPages);
    ASSERT_TRUE(tp.ok()) << tp.status().to_string();
    tps.push_back(std::move(tp.value()));
  }
  const int64_t n1 = rng.integer(100, 260), n2 = rng.integer(1, 150), c = rng.integer(1, 60);
  CacheManager cache(kPages);
  const StepDescription steps[2] = {{{{1, 0, n1}, {2, 0, n2}}, {}, 0},
                                    {{{1, n1, c}}, {{2, n2}}, 2}};
  TpBoundModel model;
  model.threads = 2;
  for (const StepDescription& d : steps) {
    Result<StepPlan> plan = plan_step(cache, d);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    const int64_t T = plan.value().num_tokens();
    const Tensor hidden = random_hidden(T, g.hidden, rng);
    Tensor ref_out(DType::kBF16, {T, g.hidden});
    LayerTrace rt;
    ASSERT_TRUE(
        ref.step(plan.value(), layer_io(ref_pool, hidden.view(), ref_out.view(), true), &rt).ok());
    for (TensorParallelLayer& tp : tps) {
      const int P = tp.tp_size();
      SCOPED_TRACE(::testing::Message() << "TP" << P << ", " << T << " tokens");
      Tensor out(DType::kBF16, {T, g.hidden});
      std::vector<Tensor> partials;
      std::vector<LayerTrace> traces;
      ASSERT_TRUE(tp.step(plan.value(), hidden.view(), out.view(), &partials, &traces).ok());
      const Tensor core_tp = concat_cores(traces);
      Result<TpComparison> cmp =
          compare_tp_output(out, ref_out, partials, core_tp, rt.attn_core, w.value().o, model);
      ASSERT_TRUE(cmp.ok()) << cmp.status().to_string();
      const TpComparison& r = cmp.value();
      std::cout << r.to_text() << "\n";
      EXPECT_TRUE(r.pass());
      EXPECT_EQ(r.core_differ, 0) << "the simulation's rank cores are TP1's columns";
      EXPECT_EQ(r.elements, T * g.hidden);
      EXPECT_LE(r.worst_tight_ratio, 1.0) << "the CPU twin accumulates in fp32";
      EXPECT_GT(r.identical, 0);

      // A missing partial (rank 0's alone) is far outside the bound.
      Result<TpComparison> lost = compare_tp_output(partials[0], ref_out, partials, core_tp,
                                                    rt.attn_core, w.value().o, model);
      ASSERT_TRUE(lost.ok());
      EXPECT_FALSE(lost.value().pass());
      EXPECT_GT(lost.value().violations, T * g.hidden / 4);
      // One NaN, one element moved by 1.
      Tensor bad = out.clone();
      const int64_t i = rng.integer(0, T * g.hidden - 1);
      bad.ptr<uint16_t>()[i] = 0x7fc0;
      Result<TpComparison> nan =
          compare_tp_output(bad, ref_out, partials, core_tp, rt.attn_core, w.value().o, model);
      ASSERT_TRUE(nan.ok());
      EXPECT_EQ(nan.value().violations, 1);
      bad.ptr<uint16_t>()[i] = float_to_bf16(bf16_to_float(out.ptr<uint16_t>()[i]) + 1.0f);
      Result<TpComparison> moved =
          compare_tp_output(bad, ref_out, partials, core_tp, rt.attn_core, w.value().o, model);
      ASSERT_TRUE(moved.ok());
      EXPECT_EQ(moved.value().violations, 1);
    }
  }
}

TEST(TpCheckTest, DifferingCoresAreAccountedAndShapesChecked) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = small_geometry(256, 2, 2);
  Result<AttentionWeights> w = random_attention_weights(g, seed, true);
  ASSERT_TRUE(w.ok());
  const int64_t T = 5, K = 256;
  Tensor core(DType::kBF16, {T, K});
  for (int64_t i = 0; i < T * K; ++i) core.ptr<uint16_t>()[i] = float_to_bf16(rng.normal());
  Tensor core2 = core.clone();
  core2.ptr<uint16_t>()[3] = float_to_bf16(bf16_to_float(core.ptr<uint16_t>()[3]) * 1.5f + 0.5f);
  // The "outputs": zeros everywhere, so every difference must come from the exact-sum shift.
  Tensor zero(DType::kBF16, {T, g.hidden});
  zero.fill_bytes(0);
  std::vector<Tensor> partials;
  partials.push_back(zero.clone());
  partials.push_back(zero.clone());
  Result<TpComparison> r = compare_tp_output(zero, zero, partials, core2, core, w.value().o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r.value().core_differ, 1);
  EXPECT_TRUE(r.value().pass());
  // Wrong shapes and an empty partial list are rejected.
  Tensor small(DType::kBF16, {T, 128});
  EXPECT_FALSE(compare_tp_output(small, zero, partials, core2, core, w.value().o).ok());
  EXPECT_FALSE(compare_tp_output(zero, zero, {}, core2, core, w.value().o).ok());
  EXPECT_FALSE(compare_tp_output(zero, zero, partials, small, core, w.value().o).ok());
}

}  // namespace
}  // namespace m3attn
