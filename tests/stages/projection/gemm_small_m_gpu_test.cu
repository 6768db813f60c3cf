// The small-M block-scaled FP8 GEMM kernel (run_gemm_small_m_cuda, and Fp8BlockGemm with
// small_m_max = 16) against the CPU twin. Numerics and bounds: see gemm_gpu_test_util.h (the kernel
// accumulates each 128-wide block in the tensor core like cuBLASLt does).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
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

Fp8BlockGemmOptions small_m_options() {
  Fp8BlockGemmOptions o;
  o.small_m_max = 16;
  o.autotune = false;
  return o;
}

struct SmallCase {
  int64_t m, n, k, ld_pad;
  size_t shift;       // 16: operands only 16-byte aligned
  bool sa_row_major;  // activation scales [M, K / 128] row-major (any strides are accepted)
};

class GemmSmallMExact : public ::testing::TestWithParam<SmallCase> {};

TEST_P(GemmSmallMExact, IntegerInputsBitIdenticalToTwin) {
  M3_REQUIRE_GPU();
  const SmallCase c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message()
               << "M " << c.m << " N " << c.n << " K " << c.k << " ld pad " << c.ld_pad << " shift "
               << c.shift << " sa row-major " << c.sa_row_major);
  Rng rng(seed);
  GemmData d = make_integer_data(c.m, c.n, c.k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  DeviceGemm dev(d, c.n + c.ld_pad, c.shift, c.sa_row_major);
  const Status st = run_gemm_small_m_cuda(dev.params(), nullptr);
  expect_launch_exact(st, dev, ref);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmSmallMExact,
    ::testing::Values(SmallCase{1, 128, 128, 0, 0, false},  // one K block: 7 of 8 warps idle
                      SmallCase{3, 256, 384, 8, 16, true},
                      SmallCase{4, 640, 6144, 0, 0, false},   // N = 640: 8 warps per CTA
                      SmallCase{8, 9856, 6144, 0, 0, false},  // fused width: 4 warps per CTA
                      SmallCase{9, 256, 1024, 0, 16, false},  // first two-half row count
                      SmallCase{13, 384, 640, 24, 0, true}, SmallCase{16, 640, 8192, 0, 0, false},
                      SmallCase{16, 6144, 1152, 0, 0, true}));

struct SmallRandomCase {
  int64_t m, n, k;
};

class GemmSmallMRandom : public ::testing::TestWithParam<SmallRandomCase> {};

TEST_P(GemmSmallMRandom, WithinAccumulationBoundOfTwin) {
  M3_REQUIRE_GPU();
  const SmallRandomCase c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message() << "M " << c.m << " N " << c.n << " K " << c.k);
  Rng rng(seed);
  GemmData d = make_random_data(c.m, c.n, c.k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  DeviceGemm dev(d, c.n);
  const Status st = run_gemm_small_m_cuda(dev.params(), nullptr);
  expect_launch_within_bound("small-M kernel vs twin", st, dev, ref, d, std::ldexp(1.0, -10));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmSmallMRandom,
                         ::testing::Values(SmallRandomCase{1, 9856, 6144},
                                           SmallRandomCase{8, 640, 6144},
                                           SmallRandomCase{11, 256, 6144},
                                           SmallRandomCase{16, 128, 8192}));

// Through Fp8BlockGemm (small_m_max = 16): the fused projection equals the unfused pair bit for bit
// on integer inputs although N = 640 splits K over 8 warps and N = 9856 over 4.
TEST(GemmSmallMFused, IntegerInputsFusedEqualsUnfusedBitForBit) {
  M3_REQUIRE_GPU();
  for (int64_t m : {4, 12}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    Rng rng(seed);
    const GemmData d = make_integer_data(m, kNF, kHidden, rng);
    const FusedRun r = run_fused_and_unfused(d, small_m_options());
    ASSERT_EQ(r.fused.size(), static_cast<size_t>(m * kNF));
    std::string report;
    EXPECT_EQ(count_bit_mismatches(r.fused, r.unfused, kNF, &report), 0) << report;
    EXPECT_EQ(r.touched, 0);
  }
}

// The small-M kernel and cuBLASLt on the same random operands: both within the accumulation bound
// of each other (two device accumulations: 2^-9 S), bit-identical fraction reported.
TEST(GemmSmallMFused, AgreesWithCublasLt) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  expect_agrees_with_cublaslt("small-M kernel", 8, 16, small_m_options(), rng);
}

// Quantize (rows = 1 padded to 4) + small-M GEMM captured once, replayed with a new x: equals
// eager runs byte for byte.
TEST(GemmSmallMGraph, ReplayWithNewInputEqualsEager) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  expect_graph_replay_equals_eager(1, 16, small_m_options(), rng);
}

TEST(GemmSmallMRules, RejectedCallsWriteNothing) {
  M3_REQUIRE_GPU();
  Rng rng(fresh_seed());
  GemmData d = make_integer_data(17, 256, 512, rng);  // one row too many
  DeviceGemm dev(d, 256);
  EXPECT_EQ(run_gemm_small_m_cuda(dev.params(), nullptr).code(), StatusCode::kUnsupported);
  GemmParams p = dev.params();
  p.a.device = p.a_scales.device = p.b.device = p.b_scales.device = p.out.device = Device::cpu();
  EXPECT_EQ(run_gemm_small_m_cuda(p, nullptr).code(), StatusCode::kInvalidArgument);
  p = dev.params();
  p.a.shape[0] = 16;
  p.a_scales.shape[0] = 16;  // out still has 17 rows: shapes disagree
  EXPECT_EQ(run_gemm_small_m_cuda(p, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Fp8BlockGemm::create(16, 256, 512,
                                 [] {
                                   Fp8BlockGemmOptions o;
                                   o.small_m_max = 17;
                                   return o;
                                 }())
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  expect_output_unwritten(dev);
}

}  // namespace
}  // namespace m3attn
