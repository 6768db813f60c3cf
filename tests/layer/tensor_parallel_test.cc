// Tensor parallelism simulated in one process: for P in {1, 2, 4, 8} (n_q 8, n_kv 2, so P = 4 and 8
// replicate KV heads) every rank's intermediates equal the TP1 layer's slices exactly, and the sum
// of the rank partials equals the TP1 output within a bound derived from the rounding:
//
// The o_proj GEMM twin forms one fp32 term t_kb per 128-column block (one Q head) of the attention
// core and sums the terms in fp32 in ascending kb, then rounds once to bf16. Each rank owns a
// contiguous range of kb, and its terms are bit-identical to TP1's (same quantized activations:
// the 1x128 activation scales are per head; same weights). So, with u = 2^-8 the bf16 unit
// roundoff and nb = n_q blocks:
//   TP1 out  ref = bf16(S1),  |S1 - E| <= nb * 2^-24 * sum|t|                (E: the exact sum)
//   rank r   p_r = bf16(S_r), |p_r - S_r| <= u |p_r|,  |S_r - E_r| <= nb * 2^-24 * sum_r |t|
//   reduced  out = bf16(s),   s = fp32 sum of p_r, |s - sum p_r| <= P * 2^-24 * sum |p_r|
// hence |out - ref| <= u |out| + u |ref| + (u + P 2^-24) sum|p_r| + 2 nb 2^-24 sum|t| (per element,
// with |out| standing in for |s| up to a factor 1 + u). P = 1 must be bit-identical.
#include "layer/tensor_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>

#include "layer_fixture.h"
#include "stages/quantize/quantize.h"

namespace m3attn {
namespace {

using namespace m3attn::testing;  // NOLINT(build/namespaces)

// Columns [c0, c1) of each row of a [T, ...] tensor whose rows are `row` elements of `elem` bytes.
bool same_columns(const Tensor& full, const Tensor& part, int64_t T, int64_t full_row,
                  int64_t part_row, int64_t c0, int elem) {
  for (int64_t t = 0; t < T; ++t)
    if (!same_bytes(static_cast<const uint8_t*>(full.data()) + (t * full_row + c0) * elem,
                    static_cast<const uint8_t*>(part.data()) + t * part_row * elem,
                    part_row * elem))
      return false;
  return true;
}

// sum over kb of |t_kb| for every (token, output column): the magnitude the fp32 accumulation
// order acts on.
Tensor abs_term_sums(const Tensor& attn_core, const QuantizedMatrix& o) {
  const int64_t T = attn_core.shape()[0], K = attn_core.shape()[1], N = o.rows();
  Tensor aq(DType::kE4M3, {T, K}), as(DType::kF32, {T, K / kQuantBlock});
  QuantizeParams qp;
  qp.rows = T;
  qp.in = attn_core.view();
  qp.out = aq.view();
  qp.scales = as.view();
  EXPECT_TRUE(run_quantize_cpu(qp).ok());
  Tensor sums(DType::kF32, {T, N});
  const int64_t nb = K / kQuantBlock;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double total = 0;
      for (int64_t kb = 0; kb < nb; ++kb) {
        double dot = 0;
        for (int64_t i = kb * kQuantBlock; i < (kb + 1) * kQuantBlock; ++i)
          dot += double{e4m3_to_float(aq.ptr<uint8_t>()[t * K + i])} *
                 e4m3_to_float(o.w.ptr<uint8_t>()[n * K + i]);
        total += std::fabs(dot * as.ptr<float>()[t * nb + kb] *
                           o.scales.ptr<float>()[(n / kQuantBlock) * nb + kb]);
      }
      sums.ptr<float>()[t * N + n] = static_cast<float>(total);
    }
  return sums;
}

TEST(TensorParallelTest, RankPartialsSumToTp1) {
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
  for (int P : {1, 2, 4, 8}) {
    Result<TensorParallelLayer> tp =
        TensorParallelLayer::create(w.value(), P, rope.view(), kPages, MsaLayerOptions{P % 4 != 0});
    ASSERT_TRUE(tp.ok()) << tp.status().to_string();
    tps.push_back(std::move(tp.value()));
  }
  // Two steps: prefill two prompts from position 0, then a chunk of the first with a generation
  // step (draft 1) of the second: every KV row any token reads was written by the layers.
  const int64_t n1 = rng.integer(100, 300), n2 = rng.integer(1, 200), c = rng.integer(1, 100);
  CacheManager cache(kPages);
  const StepDescription steps[2] = {{{{1, 0, n1}, {2, 0, n2}}, {}, 0},
                                    {{{1, n1, c}}, {{2, n2}}, 1}};
  for (const StepDescription& d : steps) {
    Result<StepPlan> plan = plan_step(cache, d);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    const int64_t T = plan.value().num_tokens();
    const Tensor hidden = random_hidden(T, g.hidden, rng);
    Tensor ref_out(DType::kBF16, {T, g.hidden});
    LayerTrace rt;
    ASSERT_TRUE(
        ref.step(plan.value(), layer_io(ref_pool, hidden.view(), ref_out.view(), true), &rt).ok());
    const Tensor term_sums = abs_term_sums(rt.attn_core, w.value().o);

    for (TensorParallelLayer& tp : tps) {
      const int P = tp.tp_size();
      SCOPED_TRACE(::testing::Message() << "TP" << P << ", step of " << T << " tokens");
      Tensor out(DType::kBF16, {T, g.hidden});
      out.fill_bytes(0xA5);
      std::vector<Tensor> partials;
      std::vector<LayerTrace> traces;
      ASSERT_TRUE(tp.step(plan.value(), hidden.view(), out.view(), &partials, &traces).ok());
      ASSERT_EQ(partials.size(), static_cast<size_t>(P));
      for (int r = 0; r < P; ++r) {
        SCOPED_TRACE(::testing::Message() << "rank " << r);
        const RankHeads h = rank_heads(g, P, r).value();
        const int nq = h.q_end - h.q_begin, nkv = h.kv_end - h.kv_begin;
        const LayerTrace& t = traces[static_cast<size_t>(r)];
        EXPECT_TRUE(same_columns(rt.q, t.q, T, g.n_q * 128, nq * 128, h.q_begin * 128, 1));
        EXPECT_TRUE(same_columns(rt.k, t.k, T, g.n_kv * 128, nkv * 128, h.kv_begin * 128, 1));
        EXPECT_TRUE(same_columns(rt.v, t.v, T, g.n_kv * 128, nkv * 128, h.kv_begin * 128, 1));
        EXPECT_TRUE(
            same_columns(rt.index_q, t.index_q, T, g.n_kv * 128, nkv * 128, h.kv_begin * 128, 1));
        EXPECT_TRUE(same_tensor(rt.index_k, t.index_k));
        EXPECT_TRUE(same_columns(rt.block_ids, t.block_ids, T, g.n_kv * kTopK, nkv * kTopK,
                                 h.kv_begin * kTopK, 4));
        EXPECT_TRUE(
            same_columns(rt.attn_core, t.attn_core, T, g.n_q * 128, nq * 128, h.q_begin * 128, 2));
      }
      if (P == 1) {
        EXPECT_TRUE(same_tensor(out, ref_out)) << "TP1 through the helper must be bit-identical";
        continue;
      }
      const double u = std::ldexp(1.0, -8), e32 = std::ldexp(1.0, -24);
      const int nb = g.n_q;
      int64_t bad = 0, differ = 0;
      double worst = 0;
      for (int64_t i = 0; i < T * g.hidden; ++i) {
        const double o = bf16_to_float(out.ptr<uint16_t>()[i]);
        const double e = bf16_to_float(ref_out.ptr<uint16_t>()[i]);
        double sum_p = 0;
        for (const Tensor& p : partials) sum_p += std::fabs(bf16_to_float(p.ptr<uint16_t>()[i]));
        const double bound = u * (1 + u) * std::fabs(o) + u * std::fabs(e) + (u + P * e32) * sum_p +
                             2 * nb * e32 * term_sums.ptr<float>()[i];
        const double err = std::fabs(o - e);
        if (!(err <= bound)) {  // NaN fails
          if (bad < 5)
            ADD_FAILURE() << "element " << i << ": TP" << P << " " << o << " vs TP1 " << e
                          << ", bound " << bound;
          ++bad;
        }
        differ += o != e;
        if (bound > 0) worst = std::max(worst, err / bound);
      }
      EXPECT_EQ(bad, 0);
      std::cout << "TP" << P << ": " << differ << " of " << T * g.hidden
                << " elements differ from TP1, worst error / bound = " << worst << "\n";
    }
  }
}

TEST(TensorParallelTest, SumRankPartialsRejectsBadShapes) {
  Tensor a(DType::kBF16, {2, 128}), b(DType::kBF16, {2, 128}), out(DType::kBF16, {2, 128});
  Tensor wrong(DType::kBF16, {3, 128}), f32(DType::kF32, {2, 128});
  for (int i = 0; i < 256; ++i) {
    a.ptr<uint16_t>()[i] = float_to_bf16(1.0f + i);
    b.ptr<uint16_t>()[i] = float_to_bf16(0.5f);
  }
  ASSERT_TRUE(sum_rank_partials({a.view(), b.view()}, out.view()).ok());
  EXPECT_EQ(bf16_to_float(out.ptr<uint16_t>()[3]), 4.5f);
  EXPECT_EQ(bf16_to_float(out.ptr<uint16_t>()[255]), 256.0f) << "256.5 rounds to even in bf16";
  EXPECT_FALSE(sum_rank_partials({}, out.view()).ok());
  EXPECT_FALSE(sum_rank_partials({a.view(), wrong.view()}, out.view()).ok());
  EXPECT_FALSE(sum_rank_partials({a.view(), f32.view()}, out.view()).ok());
  EXPECT_FALSE(sum_rank_partials({a.view(), out.view()}, out.view()).ok()) << "aliasing";
}

}  // namespace
}  // namespace m3attn
