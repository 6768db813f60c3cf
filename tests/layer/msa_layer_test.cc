// Layer-level properties of the CPU MsaLayer (SPEC sections 3-7), on small geometries with random
// weights and a random cached prefix:
//  - a prompt prefilled in three chunks (with another request in the middle step) equals the prompt
//    prefilled at once, bit for bit: every stage computes each token from its own hidden row and
//    from cache rows at positions <= its own, and the CPU twins reduce in an order that depends
//    only on the token (GEMM per row and column, attention in ascending key order), never on the
//    batch;
//  - a generation request with draft_len 3 equals four single-token steps, bit for bit (same
//    argument: draft token i sees exactly the cache rows <= its position in both);
//  - fused == unfused: Q/K/index within one E4M3 step (the contract), V exact; the CPU twins share
//    one GEMM per column and one per-head producer routine, so they are in fact byte-identical and
//    so are the outputs;
//  - with <= 16 visible blocks per token the sparse layer equals the dense layer bit for bit (the
//    indexer selects every block and the attention twin visits keys in ascending order either way);
//  - plan/run: a plan replays, rejected plans write nothing, outputs are written exactly in place.
#include "layer/msa_layer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "cache/cache_view.h"
#include "layer_fixture.h"

namespace m3attn {
namespace {

using namespace m3attn::testing;  // NOLINT(build/namespaces)

// Every cached row (K, V per head; index-K) of request `id` in two pools, compared through each
// pool's own page table: the logical cache contents, whatever pages hold them.
void expect_same_cache(const PagePool& a, const CacheManager& ma, const PagePool& b,
                       const CacheManager& mb, int64_t id, bool sparse) {
  ASSERT_EQ(ma.length(id), mb.length(id));
  const TensorView kva = a.kv_cache(0).value(), kvb = b.kv_cache(0).value();
  const int n_kv = a.layout().n_kv();
  int64_t bad = 0;
  for (int64_t j = 0; j < ma.length(id); ++j) {
    const int64_t sa = ma.slot(id, j).value(), sb = mb.slot(id, j).value();
    for (int plane = 0; plane < 2; ++plane)
      for (int h = 0; h < n_kv; ++h)
        bad += !same_bytes(
            kva.ptr<uint8_t>() + kv_cache_offset(kva, sa / kPageSize, plane, h, sa % kPageSize),
            kvb.ptr<uint8_t>() + kv_cache_offset(kvb, sb / kPageSize, plane, h, sb % kPageSize),
            kHeadDim);
    if (sparse) {
      const TensorView ia = a.index_cache(0).value(), ib = b.index_cache(0).value();
      bad += !same_bytes(ia.ptr<uint8_t>() + index_cache_offset(ia, sa / kPageSize, sa % kPageSize),
                         ib.ptr<uint8_t>() + index_cache_offset(ib, sb / kPageSize, sb % kPageSize),
                         kHeadDim);
    }
  }
  EXPECT_EQ(bad, 0) << "cache rows of request " << id << " differ";
}

// Concatenation of per-step traces, row by row in token order.
struct TraceRows {
  Tensor q, k, v, index_q, index_k, block_ids, attn_core;
  void init(int64_t T, const MsaGeometry& g, bool sparse) {
    q = Tensor(DType::kE4M3, {T, g.n_q, kHeadDim});
    k = Tensor(DType::kE4M3, {T, g.n_kv, kHeadDim});
    v = Tensor(DType::kE4M3, {T, g.n_kv, kHeadDim});
    attn_core = Tensor(DType::kBF16, {T, int64_t{g.n_q} * kHeadDim});
    if (sparse) {
      index_q = Tensor(DType::kE4M3, {T, g.n_kv, kHeadDim});
      index_k = Tensor(DType::kE4M3, {T, kHeadDim});
      block_ids = Tensor(DType::kI32, {T, g.n_kv, kTopK});
    }
  }
  // Rows [src_begin, src_begin + n) of a step's trace go to rows [at, at + n).
  void put(const LayerTrace& t, int64_t src_begin, int64_t n, int64_t at, bool sparse) {
    auto put1 = [&](const Tensor& src, Tensor& dst) {
      const int64_t row = src.nbytes() / src.shape()[0];
      std::memcpy(static_cast<uint8_t*>(dst.data()) + at * row,
                  static_cast<const uint8_t*>(src.data()) + src_begin * row,
                  static_cast<size_t>(n * row));
    };
    put1(t.q, q);
    put1(t.k, k);
    put1(t.v, v);
    put1(t.attn_core, attn_core);
    if (sparse) {
      put1(t.index_q, index_q);
      put1(t.index_k, index_k);
      put1(t.block_ids, block_ids);
    }
  }
};

void expect_same_trace(const TraceRows& a, const LayerTrace& b, bool sparse) {
  EXPECT_TRUE(same_tensor(a.q, b.q)) << "q differs";
  EXPECT_TRUE(same_tensor(a.k, b.k)) << "k differs";
  EXPECT_TRUE(same_tensor(a.v, b.v)) << "v differs";
  EXPECT_TRUE(same_tensor(a.attn_core, b.attn_core))
      << "attn_core differs at byte "
      << first_diff(a.attn_core.data(), b.attn_core.data(), a.attn_core.nbytes());
  if (sparse) {
    EXPECT_TRUE(same_tensor(a.index_q, b.index_q)) << "index_q differs";
    EXPECT_TRUE(same_tensor(a.index_k, b.index_k)) << "index_k differs";
    EXPECT_TRUE(same_tensor(a.block_ids, b.block_ids)) << "block_ids differ";
  }
}

// Tokens whose selection dropped at least one visible block (so the sparse path mattered).
int64_t pruned_tokens(const Tensor& block_ids, const std::vector<int32_t>& positions, int n_kv) {
  int64_t pruned = 0;
  for (size_t t = 0; t < positions.size(); ++t) {
    const int64_t visible = positions[t] / kPageSize + 1;
    for (int h = 0; h < n_kv; ++h) {
      int valid = 0;
      for (int i = 0; i < kTopK; ++i)
        valid += block_ids.ptr<int32_t>()[(static_cast<int64_t>(t) * n_kv + h) * kTopK + i] >= 0;
      if (valid < visible) {
        ++pruned;
        break;
      }
    }
  }
  return pruned;
}

struct Variant {
  bool sparse;
  bool fused;
  int64_t cached_lo, cached_hi;  // cached prefix of the prompt before the chunks
};

class ChunkedPrefillTest : public ::testing::TestWithParam<Variant> {};

TEST_P(ChunkedPrefillTest, ThreeChunksEqualOnePrefill) {
  const Variant var = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = small_geometry();
  Result<AttentionWeights> w = random_attention_weights(g, seed, var.sparse);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  const Tensor rope = make_rope();
  const MsaLayer layer = make_layer(w.value(), rope, var.fused);

  const int64_t cached = rng.integer(var.cached_lo, var.cached_hi);
  const int64_t N = rng.integer(200, 300);
  const int64_t other_n = rng.integer(1, 130);
  const int64_t pages = CacheManager::pages_for(cached + N) + CacheManager::pages_for(other_n) + 2;
  const PagePool base = make_random_pool(g.n_kv, pages, var.sparse, rng);
  CacheManager m0(pages);
  ASSERT_TRUE(m0.add_request(7).ok());
  ASSERT_TRUE(m0.reserve(7, cached).ok());
  const Tensor hidden = random_hidden(N, g.hidden, rng);
  const Tensor other_hidden = random_hidden(other_n, g.hidden, rng);
  SCOPED_TRACE(::testing::Message() << "cached " << cached << ", prompt " << N);

  // A: the whole prompt in one step.
  PagePool pa = base.clone();
  CacheManager ma = m0;
  Tensor out_a(DType::kBF16, {N, g.hidden});
  out_a.fill_bytes(0xA5);
  LayerTrace ta;
  Result<StepPlan> plan_a = plan_step(ma, {{{7, cached, N}}, {}, 0});
  ASSERT_TRUE(plan_a.ok()) << plan_a.status().to_string();
  ASSERT_TRUE(
      layer.step(plan_a.value(), layer_io(pa, hidden.view(), out_a.view(), var.sparse), &ta).ok());

  // B: three chunks; the middle step also prefills an unrelated request (it takes pages in between,
  // so request 7's later pages differ from A's).
  PagePool pb = base.clone();
  CacheManager mb = m0;
  Tensor out_b(DType::kBF16, {N, g.hidden});
  out_b.fill_bytes(0x5A);
  TraceRows tb;
  tb.init(N, g, var.sparse);
  const int64_t c1 = rng.integer(1, N - 2);
  const int64_t c2 = rng.integer(1, N - c1 - 1);
  const int64_t chunks[3] = {c1, c2, N - c1 - c2};
  int64_t done = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t c = chunks[i];
    StepDescription d{{{7, cached + done, c}}, {}, 0};
    if (i == 1) d.context.push_back({9, 0, other_n});
    Result<StepPlan> plan = plan_step(mb, d);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    const int64_t T = plan.value().num_tokens();
    Tensor h(DType::kBF16, {T, g.hidden});
    Tensor o(DType::kBF16, {T, g.hidden});
    std::memcpy(h.data(), row_view(hidden, done, c).data, static_cast<size_t>(c * g.hidden * 2));
    if (i == 1)
      std::memcpy(h.ptr<uint16_t>() + c * g.hidden, other_hidden.data(),
                  static_cast<size_t>(other_hidden.nbytes()));
    LayerTrace t;
    ASSERT_TRUE(layer.step(plan.value(), layer_io(pb, h.view(), o.view(), var.sparse), &t).ok());
    std::memcpy(out_b.ptr<uint16_t>() + done * g.hidden, o.data(),
                static_cast<size_t>(c * g.hidden * 2));
    tb.put(t, 0, c, done, var.sparse);
    done += c;
  }
  EXPECT_TRUE(same_tensor(out_a, out_b))
      << "attn_out differs at byte " << first_diff(out_a.data(), out_b.data(), out_a.nbytes());
  expect_same_trace(tb, ta, var.sparse);
  expect_same_cache(pa, ma, pb, mb, 7, var.sparse);
  for (int64_t i = 0; i < out_a.numel(); ++i)
    ASSERT_FALSE(std::isnan(bf16_to_float(out_a.ptr<uint16_t>()[i]))) << "NaN at " << i;
  if (var.sparse && cached + N > 16 * kPageSize + 1) {
    EXPECT_GT(pruned_tokens(ta.block_ids, plan_a.value().positions, g.n_kv), 0)
        << "no token had more than 16 visible blocks pruned: the sparse path was not exercised";
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, ChunkedPrefillTest,
                         ::testing::Values(Variant{true, true, 1900, 2000},
                                           Variant{true, false, 1900, 2000},
                                           Variant{false, false, 0, 400}),
                         [](const ::testing::TestParamInfo<Variant>& i) {
                           return std::string(i.param.sparse ? "Sparse" : "Dense") +
                                  (i.param.fused ? "Fused" : "Unfused");
                         });

TEST(MsaLayerTest, DraftOfThreeEqualsFourSingleTokenSteps) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = small_geometry();
  Result<AttentionWeights> w = random_attention_weights(g, seed, true);
  ASSERT_TRUE(w.ok());
  const Tensor rope = make_rope();
  const MsaLayer layer = make_layer(w.value(), rope, true);
  constexpr int kDraft = 3, kSteps = kDraft + 1;
  // Two generation requests; their drafts cross a page boundary and the 16-block limit sometimes.
  const int64_t L1 = rng.integer(2040, 2200), L2 = rng.integer(1, 300);
  const int64_t pages =
      CacheManager::pages_for(L1 + kSteps) + CacheManager::pages_for(L2 + kSteps) + 1;
  const PagePool base = make_random_pool(g.n_kv, pages, true, rng);
  CacheManager m0(pages);
  for (auto [id, len] : {std::pair<int64_t, int64_t>{1, L1}, {2, L2}}) {
    ASSERT_TRUE(m0.add_request(id).ok());
    ASSERT_TRUE(m0.reserve(id, len).ok());
  }
  SCOPED_TRACE(::testing::Message() << "cached " << L1 << " and " << L2);
  const Tensor hidden = random_hidden(2 * kSteps, g.hidden, rng);  // request 1's 4, then 2's 4

  PagePool pa = base.clone();
  CacheManager ma = m0;
  Tensor out_a(DType::kBF16, {2 * kSteps, g.hidden});
  LayerTrace ta;
  Result<StepPlan> plan_a = plan_step(ma, {{}, {{1, L1}, {2, L2}}, kDraft});
  ASSERT_TRUE(plan_a.ok()) << plan_a.status().to_string();
  ASSERT_EQ(plan_a.value().num_tokens(), 2 * kSteps);
  ASSERT_TRUE(
      layer.step(plan_a.value(), layer_io(pa, hidden.view(), out_a.view(), true), &ta).ok());

  PagePool pb = base.clone();
  CacheManager mb = m0;
  Tensor out_b(DType::kBF16, {2 * kSteps, g.hidden});
  TraceRows tb;
  tb.init(2 * kSteps, g, true);
  for (int i = 0; i < kSteps; ++i) {
    Result<StepPlan> plan = plan_step(mb, {{}, {{1, L1 + i}, {2, L2 + i}}, 0});
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    Tensor h(DType::kBF16, {2, g.hidden});
    Tensor o(DType::kBF16, {2, g.hidden});
    std::memcpy(h.ptr<uint16_t>(), hidden.ptr<uint16_t>() + i * g.hidden, g.hidden * 2);
    std::memcpy(h.ptr<uint16_t>() + g.hidden, hidden.ptr<uint16_t>() + (kSteps + i) * g.hidden,
                g.hidden * 2);
    LayerTrace t;
    ASSERT_TRUE(layer.step(plan.value(), layer_io(pb, h.view(), o.view(), true), &t).ok());
    std::memcpy(out_b.ptr<uint16_t>() + i * g.hidden, o.ptr<uint16_t>(), g.hidden * 2);
    std::memcpy(out_b.ptr<uint16_t>() + (kSteps + i) * g.hidden, o.ptr<uint16_t>() + g.hidden,
                g.hidden * 2);
    tb.put(t, 0, 1, i, true);
    tb.put(t, 1, 1, kSteps + i, true);
  }
  EXPECT_TRUE(same_tensor(out_a, out_b))
      << "attn_out differs at byte " << first_diff(out_a.data(), out_b.data(), out_a.nbytes());
  expect_same_trace(tb, ta, true);
  expect_same_cache(pa, ma, pb, mb, 1, true);
  expect_same_cache(pa, ma, pb, mb, 2, true);
}

TEST(MsaLayerTest, InterleavedMultiLayerPoolEqualsSeparatePools) {
  // Three layers (one dense, two sparse) sharing one pool whose page slot holds all three layers'
  // pages (page stride = 3 layer pages, planes with a gap): each layer's outputs and cache rows
  // equal those of a layer with a pool of its own, and no layer writes another layer's bytes.
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = small_geometry(256, 4, 2);
  const Tensor rope = make_rope();
  std::vector<MsaLayer> layers;
  for (int l = 0; l < 3; ++l) {
    Result<AttentionWeights> w = random_attention_weights(g, seed + l, l != 0);
    ASSERT_TRUE(w.ok());
    layers.push_back(make_layer(w.value(), rope, l != 2));
  }
  CacheManager cache(16);
  Result<StepPlan> step = plan_step(cache, {{{1, 0, rng.integer(130, 400)}, {2, 0, 3}}, {}, 0});
  ASSERT_TRUE(step.ok());
  const int64_t T = step.value().num_tokens();

  PagePoolConfig cfg;
  cfg.num_pages = 16;
  cfg.num_layers = 3;
  cfg.n_kv = g.n_kv;
  cfg.plane_stride = int64_t{g.n_kv} * kPageSize * kHeadDim + 64;
  Result<PagePool> shared = PagePool::create(cfg);
  ASSERT_TRUE(shared.ok());
  shared.value().fill(0x7f);  // NaN everywhere nothing writes
  for (int l = 0; l < 3; ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    const bool sparse = layers[static_cast<size_t>(l)].sparse();
    const Tensor hidden = random_hidden(T, g.hidden, rng);
    PagePool own = make_random_pool(g.n_kv, 16, sparse, rng);
    Tensor out_own(DType::kBF16, {T, g.hidden}), out_shared(DType::kBF16, {T, g.hidden});
    LayerTrace t_own, t_shared;
    ASSERT_TRUE(
        layers[static_cast<size_t>(l)]
            .step(step.value(), layer_io(own, hidden.view(), out_own.view(), sparse), &t_own)
            .ok());
    const PagePool before = shared.value().clone();
    LayerIO io;
    io.hidden = hidden.view();
    io.attn_out = out_shared.view();
    io.kv_cache = shared.value().kv_cache(l).value();
    if (sparse) io.index_cache = shared.value().index_cache(l).value();
    ASSERT_TRUE(layers[static_cast<size_t>(l)].step(step.value(), io, &t_shared).ok());
    EXPECT_TRUE(same_tensor(out_own, out_shared));
    EXPECT_TRUE(same_tensor(t_own.k, t_shared.k));
    EXPECT_TRUE(same_tensor(t_own.v, t_shared.v));
    EXPECT_TRUE(same_tensor(t_own.index_k, t_shared.index_k));
    // Bytes outside this layer's share of each page slot are untouched.
    const int64_t lb = shared.value().layout().layer_bytes();
    const int64_t ps = shared.value().layout().page_stride();
    int64_t foreign = 0;
    for (int64_t i = 0; i < shared.value().bytes(); ++i) {
      const int64_t layer_of_byte = (i % ps) / lb;
      if (layer_of_byte != l) foreign += shared.value().data()[i] != before.data()[i];
    }
    EXPECT_EQ(foreign, 0) << "layer " << l << " wrote another layer's bytes";
  }
}

// A mixed step used by the next tests: one context chunk, then two generation requests with a
// draft; all over a random cached prefix.
struct MixedStep {
  PagePool pool;
  CacheManager cache;
  StepDescription desc;
  Tensor hidden;
};

MixedStep make_mixed(const MsaGeometry& g, Rng& rng, int64_t ctx_cached, int64_t ctx_new,
                     int64_t g1, int64_t g2, int draft, bool with_index) {
  MixedStep s;
  const int64_t pages = CacheManager::pages_for(ctx_cached + ctx_new) +
                        CacheManager::pages_for(g1 + 1 + draft) +
                        CacheManager::pages_for(g2 + 1 + draft) + 1;
  s.pool = make_random_pool(g.n_kv, pages, with_index, rng, /*plane_gap=*/256);
  s.cache = CacheManager(pages);
  for (auto [id, len] : {std::pair<int64_t, int64_t>{3, ctx_cached}, {4, g1}, {5, g2}}) {
    EXPECT_TRUE(s.cache.add_request(id).ok());
    EXPECT_TRUE(s.cache.reserve(id, len).ok());
  }
  s.desc = {{{3, ctx_cached, ctx_new}}, {{4, g1}, {5, g2}}, draft};
  s.hidden = random_hidden(ctx_new + 2 * (1 + draft), g.hidden, rng);
  return s;
}

// Two layers run the same mixed step, each from its own copy of the step's pool and cache manager.
struct TwoLayerRuns {
  PagePool pool_a, pool_b;
  std::vector<int32_t> positions;  // of the step's tokens
  Tensor out_a, out_b;
  LayerTrace ta, tb;
};

// Layer a (reading the index caches when `a_sparse`) and layer b (`b_sparse`) on the step `s`.
void run_both_layers(const MsaLayer& a, bool a_sparse, const MsaLayer& b, bool b_sparse,
                     const MixedStep& s, int hidden, TwoLayerRuns* r) {
  r->pool_a = s.pool.clone();
  r->pool_b = s.pool.clone();
  CacheManager ma = s.cache, mb = s.cache;
  Result<StepPlan> plan_a = plan_step(ma, s.desc);
  Result<StepPlan> plan_b = plan_step(mb, s.desc);
  ASSERT_TRUE(plan_a.ok() && plan_b.ok());
  const int64_t T = plan_a.value().num_tokens();
  r->positions = plan_a.value().positions;
  r->out_a = Tensor(DType::kBF16, {T, hidden});
  r->out_b = Tensor(DType::kBF16, {T, hidden});
  ASSERT_TRUE(a.step(plan_a.value(),
                     layer_io(r->pool_a, s.hidden.view(), r->out_a.view(), a_sparse), &r->ta)
                  .ok());
  ASSERT_TRUE(b.step(plan_b.value(),
                     layer_io(r->pool_b, s.hidden.view(), r->out_b.view(), b_sparse), &r->tb)
                  .ok());
}

TEST(MsaLayerTest, FusedEqualsUnfused) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = small_geometry(384, 8, 2);
  Result<AttentionWeights> w = random_attention_weights(g, seed, true);
  ASSERT_TRUE(w.ok());
  const Tensor rope = make_rope();
  const MsaLayer fused = make_layer(w.value(), rope, true);
  const MsaLayer unfused = make_layer(w.value(), rope, false);
  ASSERT_TRUE(fused.fused());
  ASSERT_FALSE(unfused.fused());
  MixedStep s = make_mixed(g, rng, rng.integer(1800, 2000), rng.integer(100, 200),
                           rng.integer(2049, 2500), rng.integer(1, 500), 2, true);
  TwoLayerRuns r;
  ASSERT_NO_FATAL_FAILURE(run_both_layers(fused, true, unfused, true, s, g.hidden, &r));
  const LayerTrace &ta = r.ta, &tb = r.tb;

  // The contract: Q, K, index-Q, index-K within one E4M3 step, V byte-identical.
  const struct {
    const char* name;
    const Tensor &a, &b;
  } e4m3_pairs[] = {{"q", ta.q, tb.q},
                    {"k", ta.k, tb.k},
                    {"index_q", ta.index_q, tb.index_q},
                    {"index_k", ta.index_k, tb.index_k}};
  for (const auto& e : e4m3_pairs) {
    std::string report;
    EXPECT_EQ(count_e4m3_mismatches(e.a.ptr<uint8_t>(), e.b.ptr<uint8_t>(), e.a.numel(), &report),
              0)
        << e.name << ": " << report;
  }
  EXPECT_TRUE(same_tensor(ta.v, tb.v)) << "V must be byte-identical";
  // The CPU twins are byte-identical (see the top of the file), hence so is everything after.
  EXPECT_TRUE(same_tensor(ta.q, tb.q) && same_tensor(ta.k, tb.k) &&
              same_tensor(ta.index_q, tb.index_q) && same_tensor(ta.index_k, tb.index_k))
      << "the CPU twins of the fused and unfused paths are expected to be byte-identical";
  EXPECT_TRUE(same_tensor(ta.block_ids, tb.block_ids));
  EXPECT_TRUE(same_tensor(ta.attn_core, tb.attn_core));
  EXPECT_TRUE(same_tensor(r.out_a, r.out_b));
  EXPECT_TRUE(same_bytes(r.pool_a.data(), r.pool_b.data(), r.pool_a.bytes())) << "the pools differ";
}

TEST(MsaLayerTest, SparseEqualsDenseWithAtMost16VisibleBlocks) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = small_geometry(256, 4, 2);
  Result<AttentionWeights> w = random_attention_weights(g, seed, true);
  ASSERT_TRUE(w.ok());
  const AttentionWeights dw = dense_copy(w.value());
  const Tensor rope = make_rope();
  const MsaLayer sparse = make_layer(w.value(), rope, true);
  const MsaLayer dense = make_layer(dw, rope);
  ASSERT_FALSE(dense.sparse());
  const int draft = static_cast<int>(rng.integer(0, 2));
  // Every position stays < 2048: at most 16 visible blocks.
  const int64_t ctx_new = rng.integer(100, 200);
  MixedStep s = make_mixed(g, rng, rng.integer(0, 2047 - ctx_new), ctx_new,
                           rng.integer(1900, 2047 - draft), rng.integer(1, 300), draft, true);
  TwoLayerRuns r;
  ASSERT_NO_FATAL_FAILURE(run_both_layers(sparse, true, dense, false, s, g.hidden, &r));
  const LayerTrace &ta = r.ta, &tb = r.tb;
  EXPECT_EQ(pruned_tokens(ta.block_ids, r.positions, g.n_kv), 0);
  EXPECT_TRUE(same_tensor(ta.q, tb.q));
  EXPECT_TRUE(same_tensor(ta.k, tb.k));
  EXPECT_TRUE(same_tensor(ta.v, tb.v));
  EXPECT_TRUE(same_tensor(ta.attn_core, tb.attn_core))
      << "attn_core differs at byte "
      << first_diff(ta.attn_core.data(), tb.attn_core.data(), ta.attn_core.nbytes());
  EXPECT_TRUE(same_tensor(r.out_a, r.out_b));
  EXPECT_TRUE(tb.block_ids.shape().empty()) << "dense layers select no blocks";
}

TEST(MsaLayerTest, PlanReplaysAndWritesOnlyItsOutputRows) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = small_geometry();
  Result<AttentionWeights> w = random_attention_weights(g, seed, true);
  ASSERT_TRUE(w.ok());
  const Tensor rope = make_rope();
  const MsaLayer layer = make_layer(w.value(), rope, true);
  MixedStep s = make_mixed(g, rng, rng.integer(0, 300), rng.integer(1, 130), rng.integer(1, 400),
                           rng.integer(1, 400), 1, true);
  Result<StepPlan> step = plan_step(s.cache, s.desc);
  ASSERT_TRUE(step.ok());
  const int64_t T = step.value().num_tokens();
  // attn_out lives in rows [1, T + 1) of a guarded buffer; hidden is a buffer we can rewrite.
  Tensor guarded(DType::kBF16, {T + 2, g.hidden});
  guarded.fill_bytes(0xA5);
  const Tensor guard_copy = guarded.clone();
  const TensorView out = row_view(guarded, 1, T);
  Tensor hidden = s.hidden.clone();
  Result<LayerPlan> plan = layer.plan(step.value(), layer_io(s.pool, hidden.view(), out, true));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_GT(plan.value().workspace_bytes(), 0);
  LayerTimes times;
  ASSERT_TRUE(layer.run(plan.value(), nullptr, &times).ok());
  EXPECT_GT(times.total(), 0.0);
  const int64_t row = int64_t{g.hidden} * 2;
  EXPECT_TRUE(same_bytes(guarded.data(), guard_copy.data(), row)) << "guard row 0 written";
  EXPECT_TRUE(same_bytes(guarded.ptr<uint8_t>() + (T + 1) * row,
                         guard_copy.ptr<uint8_t>() + (T + 1) * row, row))
      << "guard row T+1 written";
  int64_t untouched = 0;
  for (int64_t i = g.hidden; i < (T + 1) * g.hidden; ++i)
    untouched += guarded.ptr<uint16_t>()[i] == 0xA5A5;
  EXPECT_LT(untouched, 4) << "attn_out rows were not written";
  Tensor first = Tensor(DType::kBF16, {T, g.hidden});
  std::memcpy(first.data(), out.data, static_cast<size_t>(T * row));

  // Replay: same inputs, same output.
  ASSERT_TRUE(layer.run(plan.value()).ok());
  EXPECT_TRUE(same_bytes(first.data(), out.data, T * row));

  // Replay with new hidden values written into the same buffer == a fresh step with them.
  fill_bf16_normal(hidden, rng);
  PagePool fresh_pool = s.pool.clone();
  ASSERT_TRUE(layer.run(plan.value()).ok());
  Tensor fresh_out(DType::kBF16, {T, g.hidden});
  ASSERT_TRUE(
      layer.step(step.value(), layer_io(fresh_pool, hidden.view(), fresh_out.view(), true)).ok());
  EXPECT_TRUE(same_bytes(fresh_out.data(), out.data, T * row));
  EXPECT_FALSE(same_bytes(first.data(), out.data, T * row)) << "new inputs gave the old output";

  // An empty step runs and writes nothing.
  CacheManager empty_cache(4);
  Result<StepPlan> empty = plan_step(empty_cache, StepDescription{});
  ASSERT_TRUE(empty.ok());
  Tensor none(DType::kBF16, {0, g.hidden});
  ASSERT_TRUE(layer.step(empty.value(), layer_io(s.pool, none.view(), none.view(), true)).ok());
}

TEST(MsaLayerTest, RejectedPlansWriteNothing) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = small_geometry();
  Result<AttentionWeights> w = random_attention_weights(g, seed, true);
  ASSERT_TRUE(w.ok());
  const Tensor rope = make_rope(1024);
  const MsaLayer layer = make_layer(w.value(), rope, true);
  MixedStep s = make_mixed(g, rng, 100, 50, 200, 300, 0, true);
  Result<StepPlan> good = plan_step(s.cache, s.desc);
  ASSERT_TRUE(good.ok());
  const int64_t T = good.value().num_tokens();
  Tensor out(DType::kBF16, {T, g.hidden});
  out.fill_bytes(0xA5);
  const Tensor out_copy = out.clone();
  const PagePool pool_copy = s.pool.clone();
  const LayerIO io = layer_io(s.pool, s.hidden.view(), out.view(), true);

  auto rejected = [&](const StepPlan& plan, const LayerIO& bad_io, const char* what) {
    Status st = layer.step(plan, bad_io);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what << ": " << st.to_string();
    EXPECT_FALSE(st.message().empty());
    EXPECT_TRUE(same_bytes(out.data(), out_copy.data(), out.nbytes())) << what << " wrote attn_out";
    EXPECT_TRUE(same_bytes(s.pool.data(), pool_copy.data(), s.pool.bytes()))
        << what << " wrote the cache";
  };
  LayerIO bad = io;
  bad.hidden = row_view(s.hidden, 0, T - 1);
  rejected(good.value(), bad, "hidden with too few rows");
  Tensor f32_hidden(DType::kF32, {T, g.hidden});
  bad = io;
  bad.hidden = f32_hidden.view();
  rejected(good.value(), bad, "f32 hidden");
  bad = io;
  bad.attn_out = row_view(out, 0, T - 1);
  rejected(good.value(), bad, "short attn_out");
  bad = io;
  bad.index_cache = TensorView();
  rejected(good.value(), bad, "sparse layer without an index cache");
  const PagePool other = make_random_pool(g.n_kv + 1, s.pool.num_pages(), true, rng);
  bad = io;
  bad.kv_cache = other.kv_cache(0).value();
  rejected(good.value(), bad, "cache with another head count");
  const PagePool small = make_random_pool(g.n_kv, 2, true, rng);
  bad = io;
  bad.kv_cache = small.kv_cache(0).value();
  bad.index_cache = small.index_cache(0).value();
  rejected(good.value(), bad, "pages outside the pool");

  StepPlan tampered = good.value();
  tampered.slots[3] += 1;
  rejected(tampered, io, "slot disagreeing with the page table");
  tampered = good.value();
  tampered.slots[0] = -1;
  rejected(tampered, io, "negative slot");

  // Positions beyond the RoPE table (1024 rows).
  CacheManager long_cache(20);
  ASSERT_TRUE(long_cache.add_request(1).ok());
  ASSERT_TRUE(long_cache.reserve(1, 1020).ok());
  Result<StepPlan> far = plan_step(long_cache, {{{1, 1020, 10}}, {}, 0});
  ASSERT_TRUE(far.ok());
  const PagePool big = make_random_pool(g.n_kv, 20, true, rng);
  const PagePool big_copy = big.clone();
  Tensor h10 = random_hidden(10, g.hidden, rng);
  Tensor o10(DType::kBF16, {10, g.hidden});
  Status st = layer.step(far.value(), layer_io(big, h10.view(), o10.view(), true));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_TRUE(same_bytes(big.data(), big_copy.data(), big.bytes()));

  // Bad construction: RoPE table of the wrong shape, weights of a mismatched geometry.
  Tensor bad_rope(DType::kF32, {16, 2, 16});
  Result<PackedRankWeights> packed = pack_rank(w.value(), 1, 0);
  ASSERT_TRUE(packed.ok());
  EXPECT_FALSE(MsaLayer::create(std::move(packed.value()), bad_rope.view()).ok());
  Result<PackedRankWeights> packed2 = pack_rank(w.value(), 1, 0);
  packed2.value().geometry.n_q = 4;
  EXPECT_FALSE(MsaLayer::create(std::move(packed2.value()), rope.view()).ok());
}

}  // namespace
}  // namespace m3attn
