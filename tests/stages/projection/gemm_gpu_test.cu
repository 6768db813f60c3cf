// The cuBLASLt block-scaled FP8 GEMM (Fp8BlockGemm) against the CPU twin run_gemm_cpu. The
// numerics and the tolerances are explained in gemm_gpu_test_util.h.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "stages/projection/gemm_cublaslt.h"
#include "stages/projection/gemm_gpu_test_util.h"
#include "stages/projection/projection.h"
#include "stages/quantize/quantize.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using namespace gemm_test;  // NOLINT(build/namespaces)
using testing::DeviceBuffer;
using testing::fresh_seed;
using testing::Rng;

// ---------------------------------------------------------------------------------------------
struct ExactCase {
  int64_t m, n, k, ld_pad;
  size_t shift;  // 0: 256-byte aligned operands; 16: the 16-byte algorithm
};

class GemmGpuExact : public ::testing::TestWithParam<ExactCase> {};

TEST_P(GemmGpuExact, IntegerInputsBitIdenticalToTwin) {
  M3_REQUIRE_GPU();
  const ExactCase c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message() << "M " << c.m << " N " << c.n << " K " << c.k << " ld pad "
                                    << c.ld_pad << " shift " << c.shift);
  Rng rng(seed);
  GemmData d = make_integer_data(c.m, c.n, c.k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);

  // max_m above M, so that M is not always the end of its bucket.
  auto gemm = make_gemm(2 * c.m + 8, c.n, c.k);
  ASSERT_NE(gemm, nullptr);
  DeviceGemm dev(d, c.n + c.ld_pad, c.shift);
  const Status st = gemm->run(dev.params(), nullptr);
  expect_launch_exact(st, dev, ref);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmGpuExact,
    ::testing::Values(ExactCase{4, 256, 512, 0, 0}, ExactCase{12, 256, 512, 0, 0},
                      ExactCase{8, 384, 1024, 64, 0}, ExactCase{12, 256, 512, 0, 16},
                      ExactCase{64, 640, 6144, 0, 0}, ExactCase{4, 9856, 6144, 0, 0},
                      ExactCase{20, 640, 6144, 8, 16}, ExactCase{260, 128, 2048, 8, 0},
                      ExactCase{8, 256, 384, 0, 0},     // 3 scale blocks: padded rows
                      ExactCase{4, 128, 640, 0, 16}));  // 5 scale blocks, N = 128

// ---------------------------------------------------------------------------------------------
struct RandomCase {
  int64_t m, n, k;
};

class GemmGpuRandom : public ::testing::TestWithParam<RandomCase> {};

TEST_P(GemmGpuRandom, WithinAccumulationBoundOfTwin) {
  M3_REQUIRE_GPU();
  const RandomCase c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message() << "M " << c.m << " N " << c.n << " K " << c.k);
  Rng rng(seed);
  GemmData d = make_random_data(c.m, c.n, c.k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);

  auto gemm = make_gemm(c.m, c.n, c.k);
  ASSERT_NE(gemm, nullptr);
  DeviceGemm dev(d, c.n);
  const Status st = gemm->run(dev.params(), nullptr);
  expect_launch_within_bound("cuBLASLt vs twin", st, dev, ref, d, std::ldexp(1.0, -10));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmGpuRandom,
                         ::testing::Values(RandomCase{4, 640, 6144}, RandomCase{16, 256, 6144},
                                           RandomCase{68, 640, 6144}, RandomCase{1024, 256, 1024},
                                           RandomCase{4, 128, 8192}));

// ---------------------------------------------------------------------------------------------
class GemmGpuFused : public ::testing::TestWithParam<int64_t> {};

TEST_P(GemmGpuFused, IntegerInputsFusedEqualsUnfusedBitForBit) {
  M3_REQUIRE_GPU();
  const int64_t m = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const GemmData d = make_integer_data(m, kNF, kHidden, rng);
  const FusedRun r = run_fused_and_unfused(d);
  ASSERT_EQ(r.fused.size(), static_cast<size_t>(m * kNF));
  std::string report;
  EXPECT_EQ(count_bit_mismatches(r.fused, r.unfused, kNF, &report), 0) << report;
  EXPECT_EQ(r.touched, 0);
}

INSTANTIATE_TEST_SUITE_P(M, GemmGpuFused, ::testing::Values(4, 12, 64, 260));

// Random inputs: both within the accumulation bound of each other (two device accumulations:
// 2 * 2^-11 S, doubled for margin), and the bit-identical fraction is reported.
TEST(GemmGpuFusedRandom, FusedWithinBoundOfUnfusedAndReportsBitIdentity) {
  M3_REQUIRE_GPU();
  for (int64_t m : {4, 12}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    Rng rng(seed);
    const GemmData d = make_random_data(m, kNF, kHidden, rng);
    const std::vector<double> s = abs_sums(d);
    const FusedRun r = run_fused_and_unfused(d);
    ASSERT_EQ(r.fused.size(), static_cast<size_t>(m * kNF));
    const BoundReport b = check_bound(r.fused, r.unfused, s, kNF, std::ldexp(1.0, -9));
    int64_t same_qkv = 0, same_index = 0;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < kNF; ++j) {
        const bool same = r.fused[i * kNF + j] == r.unfused[i * kNF + j];
        (j < kN1 ? same_qkv : same_index) += same;
      }
    }
    std::printf(
        "[ INFO     ] fused vs unfused, M %lld: bit-identical %lld / %lld in [Q|K|V], "
        "%lld / %lld in [iQ|iK]; worst |f-u| / S %.3g\n",
        static_cast<long long>(m), static_cast<long long>(same_qkv),
        static_cast<long long>(m * kN1), static_cast<long long>(same_index),
        static_cast<long long>(m * kN2), b.worst_rel_s);
    EXPECT_EQ(b.non_finite, 0);
    EXPECT_EQ(b.violations, 0) << b.text;
    EXPECT_EQ(r.touched, 0);
  }
}

// ---------------------------------------------------------------------------------------------
// The projection as the layer runs it: bf16 x -> quantize (M padded to 4) -> GEMM, against the
// same two steps of the CPU twin (the quantized operands are byte-identical, see the quantizer
// tests, so the GEMM bound applies).
TEST(GemmGpuPipeline, QuantizeThenGemmMatchesTwin) {
  M3_REQUIRE_GPU();
  const int64_t n = 640, k = kHidden;
  for (int64_t rows : {1, 7}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    Rng rng(seed);
    const int64_t m_pad = gemm_padded_rows(rows);
    std::vector<uint16_t> x(static_cast<size_t>(rows * k));
    for (auto& v : x) v = float_to_bf16(rng.normal(0.0f, 2.0f));
    GemmData d = make_random_data(m_pad, n, k, rng);  // B and its scales are used; A is replaced

    // Twin: quantize into d.a / d.sa (token-major), then GEMM.
    QuantizeParams qh;
    qh.rows = rows;
    qh.in = TensorView::contiguous(x.data(), DType::kBF16, {rows, k});
    qh.out = TensorView::contiguous(d.a.data(), DType::kE4M3, {m_pad, k});
    qh.scales = TensorView::strided(d.sa.data(), DType::kF32, {m_pad, k / 128}, {1, m_pad});
    ASSERT_TRUE(run_quantize_cpu(qh).ok());
    const std::vector<uint16_t> ref = cpu_gemm(d);
    const std::vector<double> s = abs_sums(d);

    DeviceGemm dev(d, n);
    dev.a.poison(kPoison);
    dev.sa.poison(kPoison);
    DeviceBuffer d_x(x.size() * 2);
    d_x.upload(x.data(), x.size() * 2);
    const GemmParams gp = dev.params();
    QuantizeParams qd;
    qd.rows = rows;
    qd.in = TensorView::contiguous(d_x.data(), DType::kBF16, {rows, k}, Device::cuda(0));
    qd.out = gp.a;
    qd.scales = gp.a_scales;
    auto gemm = make_gemm(m_pad, n, k);
    ASSERT_NE(gemm, nullptr);
    const Status sq = run_quantize_cuda(qd, nullptr);
    ASSERT_TRUE(sq.ok()) << sq.to_string();
    const Status sg = gemm->run(gp, nullptr);
    ASSERT_TRUE(sg.ok()) << sg.to_string();
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    int64_t touched = 0;
    const std::vector<uint16_t> got = dev.result(&touched);
    const BoundReport r = check_bound(got, ref, s, n, std::ldexp(1.0, -10));
    EXPECT_EQ(r.non_finite, 0);
    EXPECT_EQ(r.violations, 0) << r.text;
    EXPECT_EQ(touched, 0);
    // Padding rows produce exact zeros.
    for (int64_t i = rows * n; i < m_pad * n; ++i) ASSERT_EQ(got[i] & 0x7fff, 0) << i;
  }
}

// Capture quantize + GEMM once; replay with a new x written into the same buffer; the replay must
// equal an eager run byte for byte (and a second eager run: deterministic algorithms).
TEST(GemmGpuGraph, ReplayWithNewInputEqualsEager) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  expect_graph_replay_equals_eager(3, 64, untuned_options(), rng);
}

// ---------------------------------------------------------------------------------------------
TEST(GemmGpuRules, RejectedCallsWriteNothing) {
  M3_REQUIRE_GPU();
  Rng rng(fresh_seed());
  const int64_t n = 256, k = 512;
  EXPECT_EQ(Fp8BlockGemm::create(8, n, 200).status().code(), StatusCode::kInvalidArgument)
      << "K = 200 is not a multiple of 128";
  EXPECT_EQ(Fp8BlockGemm::create(8, 200, k).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Fp8BlockGemm::create(0, n, k).status().code(), StatusCode::kInvalidArgument);

  auto gemm = make_gemm(16, n, k);
  ASSERT_NE(gemm, nullptr);
  {
    GemmData d = make_integer_data(6, n, k, rng);  // M % 4 != 0
    DeviceGemm dev(d, n);
    const Status st = gemm->run(dev.params(), nullptr);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
    expect_output_unwritten(dev);
  }
  GemmData d = make_integer_data(8, n, k, rng);
  DeviceGemm dev(d, n);
  {
    GemmParams p = dev.params();  // activation scales row-major instead of token-major
    p.a_scales =
        TensorView::contiguous(p.a_scales.data, DType::kF32, {8, k / 128}, Device::cuda(0));
    EXPECT_EQ(gemm->run(p, nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    GemmParams p = dev.params();  // weight scales token-major instead of row-major
    p.b_scales = TensorView::strided(p.b_scales.data, DType::kF32, {n / 128, k / 128}, {1, n / 128},
                                     Device::cuda(0));
    EXPECT_EQ(gemm->run(p, nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    // K = 384: weight-scale rows must be 4 apart, a contiguous [N / 128, 3] view is refused.
    auto k384 = make_gemm(16, n, 384);
    ASSERT_NE(k384, nullptr);
    GemmData d3 = make_integer_data(8, n, 384, rng);
    DeviceGemm dev3(d3, n);
    GemmParams p = dev3.params();
    p.b_scales =
        TensorView::contiguous(p.b_scales.data, DType::kF32, {n / 128, 3}, Device::cuda(0));
    EXPECT_EQ(k384->run(p, nullptr).code(), StatusCode::kInvalidArgument);
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    expect_output_unwritten(dev3);
  }
  {
    auto other = make_gemm(16, 2 * n, k);  // N differs from the object's
    ASSERT_NE(other, nullptr);
    EXPECT_EQ(other->run(dev.params(), nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    auto small = make_gemm(4, n, k);  // M = 8 > max_m = 4
    ASSERT_NE(small, nullptr);
    EXPECT_EQ(small->run(dev.params(), nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    GemmParams p = dev.params();
    p.a.device = p.a_scales.device = p.b.device = p.b_scales.device = p.out.device = Device::cpu();
    EXPECT_EQ(gemm->run(p, nullptr).code(), StatusCode::kInvalidArgument);
  }
  {
    GemmParams p = dev.params();  // output overlapping A
    p.out.data = p.a.data;
    EXPECT_FALSE(gemm->run(p, nullptr).ok());
  }
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  expect_output_unwritten(dev);
}

TEST(GemmGpuRules, EmptyCallLaunchesNothing) {
  M3_REQUIRE_GPU();
  auto gemm = make_gemm(8, 256, 512);
  ASSERT_NE(gemm, nullptr);
  DeviceBuffer a(64), sa(64), b(256 * 512), sb(64), out(64, kPoison);
  GemmParams p;
  const Device dev = Device::cuda(0);
  p.a = TensorView::contiguous(a.data(), DType::kE4M3, {0, 512}, dev);
  p.a_scales = TensorView::strided(sa.data(), DType::kF32, {0, 4}, {1, 1}, dev);
  p.b = TensorView::contiguous(b.data(), DType::kE4M3, {256, 512}, dev);
  p.b_scales = TensorView::contiguous(sb.data(), DType::kF32, {2, 4}, dev);
  p.out = TensorView::contiguous(out.data(), DType::kBF16, {0, 256}, dev);
  const Status st = gemm->run(p, nullptr);
  EXPECT_TRUE(st.ok()) << st.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  for (uint8_t v : out.download_all()) ASSERT_EQ(v, kPoison);
}

// ---------------------------------------------------------------------------------------------
// Autotuning on: the tuned algorithms (whatever was chosen) against the CPU twin at M = 4 and
// M = 64 (bucket ends), integer inputs bit for bit and random inputs within the accumulation
// bound, and the fused projection equal to the unfused pair (both tuned) on integer inputs.
TEST(GemmGpuAutotune, TunedAlgorithmsMatchTwin) {
  M3_REQUIRE_GPU();
  Fp8BlockGemmOptions opt;  // autotune on by default
  ASSERT_TRUE(opt.autotune);
  opt.autotune_budget_ms = 3000;
  for (int64_t n : {int64_t{640}, int64_t{2048}}) {
    const auto t0 = std::chrono::steady_clock::now();
    auto gemm = make_gemm(64, n, kHidden, opt);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_NE(gemm, nullptr);
    const std::string text = gemm->describe();
    std::printf("[ INFO     ] N %lld: creation with autotuning %.0f ms\n%s",
                static_cast<long long>(n), ms, text.c_str());
    EXPECT_NE(text.find("autotuned"), std::string::npos) << text;
    EXPECT_NE(text.find("tuned at M = 64"), std::string::npos) << text;
    EXPECT_LT(ms, opt.autotune_budget_ms + 5000) << "tuning exceeded its time bound";
    for (int64_t m : {int64_t{4}, int64_t{64}}) {
      SCOPED_TRACE(::testing::Message() << "M " << m << " N " << n);
      expect_object_exact(*gemm, m, n, kHidden);
      const uint64_t seed = fresh_seed();
      M3_SEED_TRACE(seed);
      Rng rng(seed);
      GemmData d = make_random_data(m, n, kHidden, rng);
      const std::vector<uint16_t> ref = cpu_gemm(d);
      int64_t touched = 0;
      const std::vector<uint16_t> got = run_object(*gemm, d, &touched);
      ASSERT_EQ(got.size(), ref.size());
      expect_within_bound("tuned", got, ref, abs_sums(d), d, std::ldexp(1.0, -10), touched);
    }
  }
  // Fused vs unfused, both tuned (possibly different algorithms): exact on integer inputs.
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const GemmData d = make_integer_data(12, kNF, kHidden, rng);
  Fp8BlockGemmOptions fast = opt;
  fast.autotune_max_m = 16;
  const FusedRun r = run_fused_and_unfused(d, fast);
  ASSERT_EQ(r.fused.size(), static_cast<size_t>(12 * kNF));
  std::string report;
  EXPECT_EQ(count_bit_mismatches(r.fused, r.unfused, kNF, &report), 0) << report;
  EXPECT_EQ(r.touched, 0);
}

// Prefill-size buckets (m_hi >= kTuneRandomMinM = 1024) are timed on random operands (their
// outputs still compared on the integer ones): whatever was chosen for the bucket [1028, 2048]
// matches the CPU twin bit for bit on integer inputs and within the bound on random inputs, at a
// bucket end and inside the bucket. Also prints whether the tuned and the heuristic's algorithms
// write the same bits on the random inputs (different summation orders are allowed by the
// contract).
TEST(GemmGpuAutotune, PrefillBucketsMatchTwin) {
  M3_REQUIRE_GPU();
  constexpr int64_t kN = 1024, kKsmall = 1024;
  Fp8BlockGemmOptions opt;
  opt.prefill_min_m = 0;  // cuBLASLt only
  opt.wgmma_max_m = 0;
  auto gemm = make_gemm(2048, kN, kKsmall, opt);
  ASSERT_NE(gemm, nullptr);
  Fp8BlockGemmOptions ho = opt;
  ho.autotune = false;
  auto heur = make_gemm(2048, kN, kKsmall, ho);
  ASSERT_NE(heur, nullptr);
  const std::string text = gemm->describe();
  std::printf("[ INFO     ] %s", text.c_str());
  EXPECT_NE(text.find("tuned at M = 2048"), std::string::npos) << text;
  for (int64_t m : {int64_t{1100}, int64_t{2048}}) {
    SCOPED_TRACE(::testing::Message() << "M " << m);
    expect_object_exact(*gemm, m, kN, kKsmall);
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    Rng rng(seed);
    GemmData d = make_random_data(m, kN, kKsmall, rng);
    const std::vector<uint16_t> ref = cpu_gemm(d);
    int64_t touched = 0, touched_h = 0;
    const std::vector<uint16_t> got = run_object(*gemm, d, &touched);
    const std::vector<uint16_t> got_h = run_object(*heur, d, &touched_h);
    ASSERT_EQ(got.size(), ref.size());
    ASSERT_EQ(got_h.size(), ref.size());
    expect_within_bound("tuned, random", got, ref, abs_sums(d), d, std::ldexp(1.0, -10), touched);
    const int64_t differ = count_bit_mismatches(got, got_h, kN, nullptr);
    std::printf("[ INFO     ] M %lld random: tuned (%s) vs heuristic (%s): %lld outputs differ\n",
                static_cast<long long>(m), gemm->algorithm_for(m).c_str(),
                heur->algorithm_for(m).c_str(), static_cast<long long>(differ));
  }
}

// A zero budget tunes nothing and says so; the heuristic's algorithms still work.
TEST(GemmGpuAutotune, ZeroBudgetKeepsHeuristic) {
  M3_REQUIRE_GPU();
  Fp8BlockGemmOptions opt;
  opt.autotune_budget_ms = 0;
  auto gemm = make_gemm(16, 256, 512, opt);
  ASSERT_NE(gemm, nullptr);
  const std::string text = gemm->describe();
  EXPECT_NE(text.find("not tuned"), std::string::npos) << text;
  EXPECT_EQ(text.find("(autotuned;"), std::string::npos) << text;
  expect_object_exact(*gemm, 16, 256, 512);
}

// Prints the algorithms cuBLASLt chose for the projection shapes (for the performance log).
TEST(GemmGpuRules, DescribeProjectionAlgorithms) {
  M3_REQUIRE_GPU();
  for (int64_t n : {kNF, kN1, kN2}) {
    auto gemm = make_gemm(16384, n, kHidden);
    ASSERT_NE(gemm, nullptr);
    const std::string text = gemm->describe();
    EXPECT_NE(text.find("M in [4, 4]"), std::string::npos) << text;
    std::printf("%s", text.c_str());
  }
}

}  // namespace
}  // namespace m3attn
