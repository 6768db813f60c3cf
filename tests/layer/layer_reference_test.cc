// The layer against an independent fp64 reference written from SPEC sections 2-6, so that the
// plumbing (which weight rows feed which head, which norm weight each head uses, RoPE positions,
// cache slots, block ids, GQA mapping, o_proj columns) is checked and not only self-consistency.
// Each stage is checked on the layer's own inputs to that stage, with the tolerance its rounding
// allows:
//  - Q, K, V, index-Q, index-K: projection of the dequantized activations and weights in fp64,
//    one bf16 rounding, norm and RoPE in fp64, one E4M3 rounding. The twin sums fp32 per-block
//    terms, so its bf16 projection may sit one bf16 ulp (2^-8 relative) away; that moves the
//    result across at most one E4M3 rounding boundary: within one E4M3 step.
//  - block ids: fp64 scores of the layer's index-Q against the index cache, SPEC section 5 rules,
//    compared exactly (random data: no ties).
//  - attention core: fp64 softmax over the selected keys; the twin rounds once to bf16, so
//    |core - ref| <= 2^-8 |ref| (plus a tiny absolute term for values near zero).
//  - attn_out: fp64 GEMM of the quantized core with the dequantized o_proj; the twin's fp32
//    rounding of nb per-block terms and their sum adds at most (nb + 1) 2^-24 sum|terms| to the
//    bf16 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cache/cache_view.h"
#include "layer_fixture.h"
#include "stages/quantize/quantize.h"

namespace m3attn {
namespace {

using namespace m3attn::testing;  // NOLINT(build/namespaces)

struct Quantized {
  Tensor q, s;  // e4m3 [T, K], f32 [T, K / 128]
};
Quantized quantize_rows(const TensorView& x) {
  const int64_t T = x.shape[0], K = x.shape[1];
  Quantized r{Tensor(DType::kE4M3, {T, K}), Tensor(DType::kF32, {T, K / 128})};
  QuantizeParams p;
  p.rows = T;
  p.in = x;
  p.out = r.q.view();
  p.scales = r.s.view();
  EXPECT_TRUE(run_quantize_cpu(p).ok());
  return r;
}
double deq_act(const Quantized& a, int64_t t, int64_t k) {
  const int64_t K = a.q.shape()[1];
  return double{e4m3_to_float(a.q.ptr<uint8_t>()[t * K + k])} *
         a.s.ptr<float>()[t * (K / 128) + k / 128];
}
double deq_w(const QuantizedMatrix& m, int64_t n, int64_t k) {
  const int64_t K = m.cols();
  return double{e4m3_to_float(m.w.ptr<uint8_t>()[n * K + k])} *
         m.scales.ptr<float>()[(n / 128) * (K / 128) + k / 128];
}

// One head of the producer in fp64: bf16 projection -> Gemma RMSNorm -> partial NeoX RoPE -> E4M3.
void reference_head(const Quantized& x, const QuantizedMatrix& w, int head, int64_t t, int64_t pos,
                    const Tensor* norm, double eps, double theta, uint8_t* out) {
  const int64_t K = w.cols();
  double y[kHeadDim];
  for (int i = 0; i < kHeadDim; ++i) {
    double acc = 0;
    for (int64_t k = 0; k < K; ++k) acc += deq_act(x, t, k) * deq_w(w, head * 128 + i, k);
    y[i] = bf16_to_float(float_to_bf16(static_cast<float>(acc)));
  }
  if (norm) {
    double ss = 0;
    for (double v : y) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / kHeadDim + eps);
    for (int i = 0; i < kHeadDim; ++i)
      y[i] = y[i] * r * (1.0 + bf16_to_float(norm->ptr<uint16_t>()[i]));
    for (int i = 0; i < kRotaryHalf; ++i) {
      const double a = static_cast<double>(pos) * std::pow(theta, -i / 32.0);
      const double u = y[i], v = y[i + 32];
      y[i] = u * std::cos(a) - v * std::sin(a);
      y[i + 32] = v * std::cos(a) + u * std::sin(a);
    }
  }
  for (int i = 0; i < kHeadDim; ++i) out[i] = float_to_e4m3(static_cast<float>(y[i]));
}

TEST(LayerReferenceTest, EveryStageMatchesAnFp64Reference) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = small_geometry(256, 4, 2);
  Result<AttentionWeights> wr = random_attention_weights(g, seed, true);
  ASSERT_TRUE(wr.ok());
  const AttentionWeights& w = wr.value();
  const Tensor rope = make_rope();
  const MsaLayer layer = make_layer(w, rope, rng.integer(0, 1) == 1);

  // A context chunk past 2048 (selection prunes) and a generation request with a draft.
  const int64_t c_cached = rng.integer(2050, 2200), c_new = rng.integer(5, 20);
  const int64_t g_cached = rng.integer(100, 400);
  const int64_t pages =
      CacheManager::pages_for(c_cached + c_new) + CacheManager::pages_for(g_cached + 2) + 1;
  PagePool pool = make_random_pool(g.n_kv, pages, true, rng, /*plane_gap=*/128);
  CacheManager cache(pages);
  for (auto [id, len] : {std::pair<int64_t, int64_t>{1, c_cached}, {2, g_cached}}) {
    ASSERT_TRUE(cache.add_request(id).ok());
    ASSERT_TRUE(cache.reserve(id, len).ok());
  }
  Result<StepPlan> plan = plan_step(cache, {{{1, c_cached, c_new}}, {{2, g_cached}}, 1});
  ASSERT_TRUE(plan.ok());
  const StepPlan& step = plan.value();
  const int64_t T = step.num_tokens();
  const Tensor hidden = random_hidden(T, g.hidden, rng);
  Tensor out(DType::kBF16, {T, g.hidden});
  LayerTrace tr;
  ASSERT_TRUE(layer.step(step, layer_io(pool, hidden.view(), out.view(), true), &tr).ok());

  // ---- producer outputs ----
  const Quantized x = quantize_rows(hidden.view());
  std::vector<uint8_t> ref(kHeadDim);
  int64_t bad = 0;
  auto check = [&](const uint8_t* got, const char* what, int64_t t, int h) {
    for (int i = 0; i < kHeadDim; ++i)
      if (!e4m3_within_one_step(got[i], ref[static_cast<size_t>(i)])) {
        if (bad++ < 5)
          ADD_FAILURE() << what << " token " << t << " head " << h << " dim " << i << ": "
                        << e4m3_to_float(got[i]) << " vs fp64 reference "
                        << e4m3_to_float(ref[static_cast<size_t>(i)]);
      }
  };
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = step.positions[static_cast<size_t>(t)];
    for (int h = 0; h < g.n_q; ++h) {
      reference_head(x, w.q, h, t, pos, &w.q_norm, g.eps, g.rope_theta, ref.data());
      check(tr.q.ptr<uint8_t>() + (t * g.n_q + h) * kHeadDim, "q", t, h);
    }
    for (int h = 0; h < g.n_kv; ++h) {
      reference_head(x, w.k, h, t, pos, &w.k_norm, g.eps, g.rope_theta, ref.data());
      check(tr.k.ptr<uint8_t>() + (t * g.n_kv + h) * kHeadDim, "k", t, h);
      reference_head(x, w.v, h, t, pos, nullptr, g.eps, g.rope_theta, ref.data());
      check(tr.v.ptr<uint8_t>() + (t * g.n_kv + h) * kHeadDim, "v", t, h);
      reference_head(x, w.index_q, h, t, pos, &w.index_q_norm, g.eps, g.rope_theta, ref.data());
      check(tr.index_q.ptr<uint8_t>() + (t * g.n_kv + h) * kHeadDim, "index_q", t, h);
    }
    reference_head(x, w.index_k, 0, t, pos, &w.index_k_norm, g.eps, g.rope_theta, ref.data());
    check(tr.index_k.ptr<uint8_t>() + t * kHeadDim, "index_k", t, 0);
  }
  EXPECT_EQ(bad, 0);

  // ---- block ids and attention, request by request, through the page tables ----
  const TensorView kv = pool.kv_cache(0).value(), ic = pool.index_cache(0).value();
  const int64_t W = int64_t{g.n_q} * kHeadDim;
  int64_t pruned = 0;
  for (int r = 0; r < step.num_requests(); ++r) {
    const std::vector<int32_t>& pages_r = cache.pages(step.request_ids[static_cast<size_t>(r)]);
    auto kv_row = [&](int64_t p, int plane, int h) {
      return kv.ptr<uint8_t>() + kv_cache_offset(kv, pages_r[static_cast<size_t>(p / 128)], plane,
                                                 h, static_cast<int>(p % 128));
    };
    for (int32_t t = step.query_start[static_cast<size_t>(r)];
         t < step.query_start[static_cast<size_t>(r) + 1]; ++t) {
      const int64_t pos = step.positions[static_cast<size_t>(t)];
      const int64_t nb = pos / 128 + 1;
      for (int h = 0; h < g.n_kv; ++h) {
        // Block scores (fp64) and the selection rule.
        std::vector<double> best(static_cast<size_t>(nb), -INFINITY);
        const uint8_t* iq = tr.index_q.ptr<uint8_t>() + (int64_t{t} * g.n_kv + h) * kHeadDim;
        for (int64_t p = 0; p <= pos; ++p) {
          const uint8_t* ik =
              ic.ptr<uint8_t>() + index_cache_offset(ic, pages_r[static_cast<size_t>(p / 128)],
                                                     static_cast<int>(p % 128));
          double s = 0;
          for (int d = 0; d < kHeadDim; ++d)
            s += double{e4m3_to_float(iq[d])} * e4m3_to_float(ik[d]);
          best[static_cast<size_t>(p / 128)] = std::max(best[static_cast<size_t>(p / 128)], s);
        }
        std::vector<int32_t> order(static_cast<size_t>(nb));
        for (int32_t b = 0; b < nb; ++b) order[static_cast<size_t>(b)] = b;
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
          if (a == nb - 1 || b == nb - 1) return a == nb - 1 && b != nb - 1;  // forced local
          return best[static_cast<size_t>(a)] > best[static_cast<size_t>(b)];
        });
        order.resize(std::min<size_t>(order.size(), kTopK));
        std::sort(order.begin(), order.end());
        std::vector<int32_t> want(kTopK, -1);
        std::copy(order.begin(), order.end(), want.begin());
        const int32_t* got = tr.block_ids.ptr<int32_t>() + (int64_t{t} * g.n_kv + h) * kTopK;
        EXPECT_EQ(std::vector<int32_t>(got, got + kTopK), want) << "token " << t << " head " << h;
        pruned += nb > kTopK;

        // Attention of the query heads of this KV head over the selected keys.
        for (int j = h * (g.n_q / g.n_kv); j < (h + 1) * (g.n_q / g.n_kv); ++j) {
          const uint8_t* q = tr.q.ptr<uint8_t>() + (int64_t{t} * g.n_q + j) * kHeadDim;
          std::vector<double> logits;
          std::vector<int64_t> keys;
          for (int32_t b : order)
            for (int64_t p = int64_t{b} * 128; p < std::min<int64_t>((b + 1) * 128, pos + 1); ++p) {
              const uint8_t* k = kv_row(p, 0, h);
              double s = 0;
              for (int d = 0; d < kHeadDim; ++d)
                s += double{e4m3_to_float(q[d])} * e4m3_to_float(k[d]);
              logits.push_back(s / std::sqrt(128.0));
              keys.push_back(p);
            }
          const double mx = *std::max_element(logits.begin(), logits.end());
          double den = 0;
          for (double& l : logits) den += (l = std::exp(l - mx));
          for (int d = 0; d < kHeadDim; ++d) {
            double o = 0;
            for (size_t i = 0; i < keys.size(); ++i)
              o += logits[i] * e4m3_to_float(kv_row(keys[i], 1, h)[d]);
            o /= den;
            const double gotv = bf16_to_float(tr.attn_core.ptr<uint16_t>()[t * W + j * 128 + d]);
            // 1e-12: fp64 summation order (ours vs the twin's) near a bf16 rounding tie.
            EXPECT_LE(std::fabs(gotv - o), std::ldexp(std::fabs(o), -8) + 1e-12)
                << "attn core token " << t << " head " << j << " dim " << d;
          }
        }
      }
    }
  }
  EXPECT_GT(pruned, 0) << "no token had more than 16 visible blocks";

  // ---- o_proj ----
  const Quantized core = quantize_rows(tr.attn_core.view());
  const int64_t nbk = W / 128;
  int64_t bad_out = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < g.hidden; ++n) {
      double acc = 0, mag = 0;
      for (int64_t kb = 0; kb < nbk; ++kb) {
        double term = 0;
        for (int64_t k = kb * 128; k < (kb + 1) * 128; ++k)
          term += deq_act(core, t, k) * deq_w(w.o, n, k);
        acc += term;
        mag += std::fabs(term);
      }
      const double gotv = bf16_to_float(out.ptr<uint16_t>()[t * g.hidden + n]);
      // fp32 rounding of each term and of each of the nbk additions, then one bf16 rounding.
      const double e32 = (nbk + 1) * std::ldexp(mag, -24);
      const double bound = std::ldexp(std::fabs(acc) + e32, -8) + e32 + 1e-30;
      if (!(std::fabs(gotv - acc) <= bound) && bad_out++ < 5)
        ADD_FAILURE() << "attn_out token " << t << " column " << n << ": " << gotv << " vs fp64 "
                      << acc << " (bound " << bound << ")";
    }
  EXPECT_EQ(bad_out, 0);
}

}  // namespace
}  // namespace m3attn
