// GPU tests of the CUDA LayerStack and its between-layer kernels (src/engine/residual_norm.h):
//  - synthetic embedding: bit-identical to the host (integer hash + one exact multiply);
//  - residual add: bit-identical (one fp32 add of two bf16 values, one rounding);
//  - RMSNorm: within one bf16 ulp of the host (fp32 tree sum vs sequential sum);
//  - the whole stack (1 dense + 2 sparse layers, small geometry) against the CPU stack over a
//    prefill step, a mixed step and generation steps that capture and replay graphs (including a
//    replay with fewer requests than its bucket): last_hidden relative L2 <= 5e-2 per step (a
//    sanity bound: each layer adds one-step E4M3 and bf16 rounding differences, see
//    cuda_msa_layer_gpu_test.cu, and the residual stream carries them forward), finite, and the
//    graph_replay flags as expected;
//  - the fused residual + RMSNorm + quantize kernel: byte-identical to the RMSNorm kernel followed
//  by
//    the quantize kernel (codes, scales, padding rows, the updated h), and a stack using it
//    (fuse_input_quantize) bit-identical to one running them separately, through
//    prefill, mixed and graph decode steps, fused and unfused;
//  - prefill / mixed steps with each layer's front replayed from a graph captured at the step's
//    token count (capture_mixed_front) are bit-identical to fully eager steps, across repeats of
//    one token count with new requests, positions and slots, and across graph eviction.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "cache/page_allocator.h"
#include "cache/step_plan.h"
#include "core/numeric.h"
#include "engine/layer_stack.h"
#include "engine/residual_norm.h"
#include "engine/stack_math.h"
#include "stages/quantize/quantize.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

namespace mt = m3attn::testing;

TEST(CudaStackKernels, EmbedResidualNormMatchHost) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const int hidden = 1000;  // not a multiple of the CTA size
  CacheManager cache(64);
  StepDescription d;
  d.context = {{7, 0, 37}, {9, 0, 5}};
  d.generation = {};
  Result<StepPlan> p = plan_step(cache, d);
  ASSERT_TRUE(p.ok());
  const StepPlan& plan = p.value();
  const int64_t T = plan.num_tokens();
  std::vector<uint16_t> h_host(static_cast<size_t>(T * hidden));
  embed_synthetic_tokens(plan, seed, hidden, h_host.data());

  std::vector<int64_t> req(static_cast<size_t>(T));
  for (int r = 0; r < plan.num_requests(); ++r)
    for (int t = plan.query_start[static_cast<size_t>(r)];
         t < plan.query_start[static_cast<size_t>(r) + 1]; ++t)
      req[static_cast<size_t>(t)] = plan.request_ids[static_cast<size_t>(r)];
  mt::DeviceBuffer d_req(req.size() * 8), d_pos(plan.positions.size() * 4), d_h(h_host.size() * 2),
      d_a(h_host.size() * 2), d_x(h_host.size() * 2);
  d_req.upload(req.data(), req.size() * 8);
  d_pos.upload(plan.positions.data(), plan.positions.size() * 4);
  ASSERT_TRUE(run_synthetic_embed_cuda(seed, static_cast<const int64_t*>(d_req.data()),
                                       static_cast<const int32_t*>(d_pos.data()), T, hidden,
                                       static_cast<uint16_t*>(d_h.data()), nullptr)
                  .ok());
  std::vector<uint16_t> h_dev(h_host.size());
  d_h.download(h_dev.data(), h_dev.size() * 2);
  EXPECT_TRUE(h_dev == h_host) << "synthetic embedding differs from the host";

  std::vector<uint16_t> a(h_host.size());
  for (auto& v : a) v = float_to_bf16(rng.normal(0.0f, 0.5f));
  d_a.upload(a.data(), a.size() * 2);
  ASSERT_TRUE(run_residual_rmsnorm_cuda(
                  static_cast<uint16_t*>(d_h.data()), static_cast<const uint16_t*>(d_a.data()),
                  static_cast<uint16_t*>(d_x.data()), T, hidden, 1e-6f, nullptr)
                  .ok());
  residual_add_bf16(h_host.data(), a.data(), T * hidden);
  std::vector<uint16_t> x_host(h_host.size());
  rmsnorm_unit_bf16(h_host.data(), T, hidden, 1e-6f, x_host.data());
  std::vector<uint16_t> x_dev(h_host.size());
  d_h.download(h_dev.data(), h_dev.size() * 2);
  d_x.download(x_dev.data(), x_dev.size() * 2);
  EXPECT_TRUE(h_dev == h_host) << "residual add differs from the host";
  int64_t bad = 0;
  for (size_t i = 0; i < x_dev.size(); ++i) {
    const int diff = static_cast<int>(x_dev[i]) - static_cast<int>(x_host[i]);
    bad += (diff < -1 || diff > 1 || !std::isfinite(bf16_to_float(x_dev[i])));
  }
  EXPECT_EQ(bad, 0) << "RMSNorm outputs more than one bf16 ulp from the host";
}

TEST(CudaStackKernels, ResidualNormQuantizeEqualsSeparateKernels) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  struct Shape {
    int64_t rows, m_pad;
    int hidden;
    bool residual;
  };
  for (const Shape& sh : {Shape{37, 40, 6144, true}, Shape{5, 8, 384, false},
                          Shape{64, 64, 8192, true}, Shape{1, 4, 128, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << "rows " << sh.rows << " m_pad " << sh.m_pad << " hidden " << sh.hidden
                 << (sh.residual ? " with" : " without") << " residual");
    const size_t n = static_cast<size_t>(sh.rows) * sh.hidden;
    std::vector<uint16_t> h(n), a(n);
    for (int64_t r = 0; r < sh.rows; ++r) {
      const float scale = std::pow(10.0f, rng.uniform(-3.0f, 3.0f));  // rows of any magnitude
      for (int c = 0; c < sh.hidden; ++c) {
        h[static_cast<size_t>(r * sh.hidden + c)] = float_to_bf16(rng.normal(0.0f, scale));
        a[static_cast<size_t>(r * sh.hidden + c)] = float_to_bf16(rng.normal(0.0f, scale));
      }
    }
    const size_t qbytes = static_cast<size_t>(sh.m_pad) * sh.hidden;
    const size_t sbytes = static_cast<size_t>(sh.m_pad) * (sh.hidden / 128) * 4;
    mt::DeviceBuffer h1(n * 2), h2(n * 2), d_a(n * 2), x(n * 2), q1(qbytes), q2(qbytes), s1(sbytes),
        s2(sbytes);
    h1.upload(h.data(), n * 2);
    h2.upload(h.data(), n * 2);
    d_a.upload(a.data(), n * 2);
    auto params = [&](mt::DeviceBuffer& q, mt::DeviceBuffer& s) {
      QuantizeParams p;
      p.rows = sh.rows;
      p.in = TensorView::contiguous(x.data(), DType::kBF16, {sh.rows, int64_t{sh.hidden}},
                                    Device::cuda(0));
      p.out = TensorView::contiguous(q.data(), DType::kE4M3, {sh.m_pad, int64_t{sh.hidden}},
                                     Device::cuda(0));
      p.scales = TensorView::strided(s.data(), DType::kF32, {sh.m_pad, int64_t{sh.hidden / 128}},
                                     {1, sh.m_pad}, Device::cuda(0));  // token-major, as the GEMM
      return p;
    };
    const uint16_t* res = sh.residual ? static_cast<const uint16_t*>(d_a.data()) : nullptr;
    ASSERT_TRUE(run_residual_rmsnorm_cuda(static_cast<uint16_t*>(h1.data()), res,
                                          static_cast<uint16_t*>(x.data()), sh.rows, sh.hidden,
                                          1e-6f, nullptr)
                    .ok());
    ASSERT_TRUE(run_quantize_cuda(params(q1, s1), nullptr).ok());
    const Status st = run_residual_rmsnorm_quantize_cuda(static_cast<uint16_t*>(h2.data()), res,
                                                         params(q2, s2), 1e-6f, nullptr);
    ASSERT_TRUE(st.ok()) << st.to_string();
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(h1.download_all() == h2.download_all()) << "updated h differs";
    EXPECT_TRUE(q1.download_all() == q2.download_all()) << "E4M3 codes differ";
    EXPECT_TRUE(s1.download_all() == s2.download_all()) << "scales differ";
  }
}

double rel_l2(const Tensor& a, const Tensor& b, bool* finite) {
  double num = 0, den = 0;
  *finite = true;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = bf16_to_float(a.ptr<uint16_t>()[i]), y = bf16_to_float(b.ptr<uint16_t>()[i]);
    *finite &= std::isfinite(x) && std::isfinite(y);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Both stacks' last hidden states must be the same bytes.
void expect_same_last_hidden(LayerStack& a, LayerStack& b, const char* what) {
  Result<Tensor> ha = a.last_hidden();
  Result<Tensor> hb = b.last_hidden();
  ASSERT_TRUE(ha.ok() && hb.ok());
  ASSERT_EQ(ha.value().nbytes(), hb.value().nbytes());
  EXPECT_EQ(
      std::memcmp(ha.value().data(), hb.value().data(), static_cast<size_t>(ha.value().nbytes())),
      0)
      << what;
}

// 1 dense + 2 sparse layers of a small geometry (hidden 384, 8 q / 2 kv heads); capacities unset.
LayerStackConfig small_stack_config(uint64_t seed) {
  LayerStackConfig cfg;
  cfg.geometry.hidden = 384;
  cfg.geometry.n_q = 8;
  cfg.geometry.n_kv = 2;
  cfg.num_dense = 1;
  cfg.num_sparse = 2;
  cfg.seed = seed;
  return cfg;
}

TEST(CudaLayerStack, MatchesCpuStackThroughPrefillMixedAndGraphDecode) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  LayerStackConfig cfg = small_stack_config(seed);
  cfg.num_pages = 160;
  cfg.max_tokens_per_step = 2600;
  cfg.max_requests_per_step = 8;
  cfg.max_pages_per_request = 24;
  cfg.max_position = 3072;
  Result<std::unique_ptr<LayerStack>> cpu = create_cpu_layer_stack(cfg);
  Result<std::unique_ptr<LayerStack>> gpu = create_cuda_layer_stack(cfg);
  ASSERT_TRUE(cpu.ok()) << cpu.status().to_string();
  ASSERT_TRUE(gpu.ok()) << gpu.status().to_string();
  EXPECT_STREQ(gpu.value()->backend(), "cuda");

  CacheManager cache(cfg.num_pages);
  PlanOptions po;
  po.page_table_width = cfg.max_pages_per_request;
  auto run_step = [&](const StepDescription& d, bool expect_replay, const char* what) {
    SCOPED_TRACE(what);
    Result<StepPlan> p = plan_step(cache, d, po);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    StackStepStats sc, sg;
    ASSERT_TRUE(cpu.value()->step(p.value(), &sc).ok());
    const Status st = gpu.value()->step(p.value(), &sg);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_EQ(sg.graph_replay, expect_replay);
    EXPECT_GT(sg.step_us, 0.0);
    Result<Tensor> hc = cpu.value()->last_hidden();
    Result<Tensor> hg = gpu.value()->last_hidden();
    ASSERT_TRUE(hc.ok() && hg.ok());
    ASSERT_EQ(hc.value().shape(), hg.value().shape());
    bool finite = true;
    const double e = rel_l2(hg.value(), hc.value(), &finite);
    EXPECT_TRUE(finite);
    EXPECT_LE(e, 5e-2) << "last_hidden relative L2 vs the CPU stack";
    std::printf("  [stack] %s: %lld tokens, relative L2 %.2e, %.1f us%s\n", what,
                static_cast<long long>(p.value().num_tokens()), e, sg.step_us,
                sg.graph_replay ? " (replay)" : "");
  };

  // Prefill: request 0 with 2200 tokens (> 16 blocks), request 1 with 300.
  StepDescription s1;
  s1.context = {{0, 0, 2200}, {1, 0, 300}};
  run_step(s1, false, "prefill");
  // Mixed: request 2 chunk + requests 0, 1 generating.
  StepDescription s2;
  s2.context = {{2, 0, 140}};
  s2.generation = {{0, 2200}, {1, 300}};
  run_step(s2, false, "mixed");
  // (The mixed step grew requests 0 and 1 by one token each.) Generation with draft 1: 3 requests
  // -> bucket 4 (capture), then again (replay).
  StepDescription s3;
  s3.generation = {{0, 2201}, {1, 301}, {2, 140}};
  s3.draft_len = 1;
  run_step(s3, false, "decode x3 (capture bucket 4)");
  StepDescription s4;
  s4.generation = {{0, 2203}, {1, 303}, {2, 142}};
  s4.draft_len = 1;
  run_step(s4, true, "decode x3 (replay)");
  // Fewer requests than the bucket's captured step: request 2 leaves; 2 requests -> bucket 2
  // (capture), then a 1-request step of a new sequence... bucket 1; then back to 3 in bucket 4.
  ASSERT_TRUE(cache.release(2).ok());
  StepDescription s5;
  s5.generation = {{0, 2205}, {1, 305}};
  s5.draft_len = 1;
  run_step(s5, false, "decode x2 (capture bucket 2)");
  StepDescription s6;
  s6.context = {{3, 0, 50}};
  run_step(s6, false, "prefill request 3");
  StepDescription s7;
  s7.generation = {{0, 2207}, {1, 307}, {3, 50}};
  s7.draft_len = 1;
  run_step(s7, true, "decode x3 (replay bucket 4, other requests)");
  // Unfused: its own graphs.
  gpu.value()->set_fused(false);
  cpu.value()->set_fused(false);
  StepDescription s8;
  s8.generation = {{0, 2209}, {1, 309}, {3, 52}};
  s8.draft_len = 1;
  run_step(s8, false, "decode x3 unfused (capture)");
  StepDescription s9;
  s9.generation = {{0, 2211}, {1, 311}, {3, 54}};
  s9.draft_len = 1;
  run_step(s9, true, "decode x3 unfused (replay)");
}

TEST(CudaLayerStack, MixedFrontGraphsEqualEagerAcrossRepeatsAndEviction) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  LayerStackConfig cfg = small_stack_config(seed);
  cfg.num_pages = 64;
  cfg.max_tokens_per_step = 256;
  cfg.max_requests_per_step = 16;
  cfg.max_pages_per_request = 4;
  cfg.max_position = 512;
  LayerStackConfig eager_cfg = cfg;
  cfg.capture_mixed_front = true;
  eager_cfg.capture_mixed_front = false;
  Result<std::unique_ptr<LayerStack>> graphs = create_cuda_layer_stack(cfg);
  Result<std::unique_ptr<LayerStack>> eager = create_cuda_layer_stack(eager_cfg);
  ASSERT_TRUE(graphs.ok()) << graphs.status().to_string();
  ASSERT_TRUE(eager.ok()) << eager.status().to_string();

  CacheManager cache(cfg.num_pages);
  PlanOptions po;
  po.page_table_width = cfg.max_pages_per_request;
  std::map<int, int> len;  // cached tokens per request
  // One step: a new request's `chunk` prompt tokens plus one generated token of every request
  // seen so far. Both stacks run it; their hidden states must be bit-identical.
  auto run_step = [&](int new_request, int chunk, int64_t expect_tokens) {
    StepDescription d;
    for (const auto& [r, n] : len) d.generation.push_back({r, n});
    d.context = {{new_request, 0, chunk}};
    Result<StepPlan> p = plan_step(cache, d, po);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    ASSERT_EQ(p.value().num_tokens(), expect_tokens);
    SCOPED_TRACE(::testing::Message()
                 << "step of " << expect_tokens << " tokens, request " << new_request);
    StackStepStats sg, se;
    ASSERT_TRUE(graphs.value()->step(p.value(), &sg).ok());
    ASSERT_TRUE(eager.value()->step(p.value(), &se).ok());
    EXPECT_FALSE(sg.graph_replay);
    expect_same_last_hidden(*graphs.value(), *eager.value(),
                            "front graphs differ from the eager step");
    for (auto& [r, n] : len) ++n;
    len[new_request] = chunk;
  };
  // T = 100 three times (capture, then two replays with other requests, positions and slots).
  run_step(0, 100, 100);
  run_step(1, 99, 100);
  run_step(2, 98, 100);
  // Five new token counts (8, 10, ..., 16): the graphs of T = 100 are evicted on the fourth.
  for (int k = 0; k < 5; ++k) run_step(3 + k, 5 + k, 8 + 2 * k);
  // T = 100 again: captured anew.
  run_step(8, 92, 100);
  // Unfused: its own graphs, same token count.
  graphs.value()->set_fused(false);
  eager.value()->set_fused(false);
  run_step(9, 91, 100);
}

// Two stacks of the same small model (configs a and b differ only in launch choices that must
// not change a byte) through prefill, mixed, decode capture and replay, and an unfused draft-1
// decode capture: the last hidden states are the same bytes after every step.
void expect_stacks_identical(const LayerStackConfig& a_cfg, const LayerStackConfig& b_cfg,
                             const char* what) {
  Result<std::unique_ptr<LayerStack>> a = create_cuda_layer_stack(a_cfg);
  Result<std::unique_ptr<LayerStack>> b = create_cuda_layer_stack(b_cfg);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  CacheManager cache(a_cfg.num_pages);
  PlanOptions po;
  po.page_table_width = a_cfg.max_pages_per_request;
  auto run_step = [&](const StepDescription& d, bool expect_replay, const char* step) {
    SCOPED_TRACE(step);
    Result<StepPlan> p = plan_step(cache, d, po);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    StackStepStats sa, sb;
    const Status st = a.value()->step(p.value(), &sa);
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_TRUE(b.value()->step(p.value(), &sb).ok());
    EXPECT_EQ(sa.graph_replay, expect_replay);
    expect_same_last_hidden(*a.value(), *b.value(), what);
  };
  StepDescription s1;
  s1.context = {{0, 0, 600}, {1, 0, 3}};
  run_step(s1, false, "prefill");
  StepDescription s2;
  s2.context = {{2, 0, 90}};
  s2.generation = {{0, 600}, {1, 3}};
  run_step(s2, false, "mixed");
  StepDescription s3;
  s3.generation = {{0, 601}, {1, 4}, {2, 90}};
  run_step(s3, false, "decode x3 (capture bucket 4)");
  StepDescription s4;
  s4.generation = {{0, 602}, {1, 5}, {2, 91}};
  run_step(s4, true, "decode x3 (replay)");
  a.value()->set_fused(false);
  b.value()->set_fused(false);
  StepDescription s5;
  s5.generation = {{0, 603}, {1, 6}, {2, 92}};
  s5.draft_len = 1;
  run_step(s5, false, "decode x3 draft 1 unfused (capture)");
}

LayerStackConfig identity_test_config(uint64_t seed) {
  LayerStackConfig cfg = small_stack_config(seed);
  cfg.num_pages = 96;
  cfg.max_tokens_per_step = 640;
  cfg.max_requests_per_step = 8;
  cfg.max_pages_per_request = 8;
  cfg.max_position = 1024;
  return cfg;
}

// fuse_input_quantize against separate RMSNorm and quantize kernels: the same bytes.
TEST(CudaLayerStack, FusedInputQuantizeBitIdenticalToSeparateKernels) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  LayerStackConfig cfg = identity_test_config(seed);
  LayerStackConfig sep_cfg = cfg;
  cfg.fuse_input_quantize = true;
  sep_cfg.fuse_input_quantize = false;
  expect_stacks_identical(
      cfg, sep_cfg,
      "the fused residual + RMSNorm + quantize stack differs from the separate kernels");
}

// Programmatic dependent launch and the attention's own quantized output (both on, with the fused
// and the separate input quantize) against plain launches with the separate output quantize: the
// same bytes.
TEST(CudaLayerStack, ProgrammaticLaunchAndAttentionQuantizeBitIdentical) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  for (const bool fuse_input : {true, false}) {
    SCOPED_TRACE(fuse_input ? "fused input quantize" : "separate input quantize");
    LayerStackConfig base = identity_test_config(seed);
    base.fuse_input_quantize = fuse_input;
    base.programmatic_launch = false;
    base.attention_quantize = false;
    LayerStackConfig on = base;
    on.programmatic_launch = true;
    on.attention_quantize = true;
    expect_stacks_identical(on, base,
                            "PDL + attention-quantized stack differs from plain launches");
  }
}

}  // namespace
}  // namespace m3attn
