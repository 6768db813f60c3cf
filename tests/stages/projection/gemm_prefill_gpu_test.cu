// The prefill block-scaled FP8 GEMM kernel (run_gemm_prefill_cuda, gemm_prefill.h) against the CPU
// twin and cuBLASLt. Numerics and bounds: see gemm_gpu_test_util.h (the kernel accumulates each
// 128-wide block in the tensor core and promotes it into fp32 registers, as cuBLASLt does).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "stages/projection/gemm_cublaslt.h"
#include "stages/projection/gemm_gpu_test_util.h"
#include "stages/projection/gemm_prefill.h"
#include "stages/projection/projection.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using namespace gemm_test;  // NOLINT(build/namespaces)
using testing::fresh_seed;
using testing::Rng;

// cluster: 11, 21 or 12 (cluster_m, cluster_n).
GemmPrefillOptions prefill_options(int cluster, int group_m = 16) {
  GemmPrefillOptions o;
  o.cluster_m = cluster / 10;
  o.cluster_n = cluster % 10;
  o.group_m = group_m;
  return o;
}

struct PrefillCase {
  int64_t m, n, k, ld_pad;
  size_t shift;  // 16: operands only 16-byte aligned
  int cluster;  // 11, 21, 12: cluster_m x cluster_n
  int group_m;
};

std::string case_name(const PrefillCase& c) {
  return "M " + std::to_string(c.m) + " N " + std::to_string(c.n) + " K " + std::to_string(c.k) +
         " ld pad " + std::to_string(c.ld_pad) + " shift " + std::to_string(c.shift) +
         " cluster " + std::to_string(c.cluster) + " (m x n) group " + std::to_string(c.group_m);
}

class GemmPrefillExact : public ::testing::TestWithParam<PrefillCase> {};

// Integer-valued inputs: every summation order is exact, so the kernel equals the twin bit for bit;
// nothing outside [M, N] is written (guards, padded row stride).
TEST_P(GemmPrefillExact, IntegerInputsBitIdenticalToTwin) {
  M3_REQUIRE_GPU();
  const PrefillCase c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(case_name(c));
  Rng rng(seed);
  GemmData d = make_integer_data(c.m, c.n, c.k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  DeviceGemm dev(d, c.n + c.ld_pad, c.shift);
  const Status st =
      run_gemm_prefill_cuda(dev.params(), nullptr, prefill_options(c.cluster, c.group_m));
  expect_launch_exact(st, dev, ref);
}

// (ValuesIn over a vector: a long Values(...) list instantiates a huge variadic template.)
std::vector<PrefillCase> exact_cases() {
  return {
      PrefillCase{4, 128, 128, 0, 0, 11, 16},      // one K block, one partial tile
      PrefillCase{4, 128, 128, 0, 0, 12, 16},      // the pair's second tile past N
      PrefillCase{4, 256, 128, 0, 0, 21, 16},      // the pair's second tile past M
      PrefillCase{132, 256, 1024, 8, 16, 11, 16},  // two m tiles, misaligned
      PrefillCase{132, 256, 1024, 8, 16, 21, 16},
      PrefillCase{132, 384, 1024, 8, 16, 12, 16},  // odd n tiles in pairs
      PrefillCase{260, 640, 384, 0, 0, 21, 1},     // odd m tiles, group of 1
      PrefillCase{260, 640, 384, 0, 0, 12, 1},
      PrefillCase{260, 640, 384, 0, 0, 11, 2},
      PrefillCase{384, 384, 640, 24, 0, 12, 16},   // 5 K blocks, odd n tiles
      PrefillCase{512, 1280, 256, 0, 0, 21, 4},    // groups of 4 m tiles
      PrefillCase{512, 1280, 256, 0, 0, 12, 4},
      PrefillCase{1028, 256, 256, 0, 0, 21, 16},   // many m tiles, one row past
      PrefillCase{1028, 256, 256, 0, 0, 12, 3},
      PrefillCase{1028, 256, 256, 0, 0, 11, 3}};
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmPrefillExact, ::testing::ValuesIn(exact_cases()));

struct RandomCase {
  int64_t m, n, k;
  int cluster;
};

class GemmPrefillRandom : public ::testing::TestWithParam<RandomCase> {};

// Full-range random inputs: within the accumulation bound of the twin (2^-10 S).
TEST_P(GemmPrefillRandom, WithinBoundOfTwin) {
  M3_REQUIRE_GPU();
  const RandomCase c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  GemmData d = make_random_data(c.m, c.n, c.k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  DeviceGemm dev(d, c.n);
  const Status st = run_gemm_prefill_cuda(dev.params(), nullptr, prefill_options(c.cluster));
  expect_launch_within_bound("prefill cluster " + std::to_string(c.cluster), st, dev, ref, d,
                             std::ldexp(1.0, -10));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmPrefillRandom,
                         ::testing::Values(RandomCase{136, 256, 6144, 11},
                                           RandomCase{136, 256, 6144, 21},
                                           RandomCase{200, 640, 8192, 12}));

struct LtCase {
  int64_t m, n, k;
  int cluster;
};

class GemmPrefillVsCublasLt : public ::testing::TestWithParam<LtCase> {};

// Runs `ref` and `other` (each enqueues one GEMM on the default stream) on the same inputs into
// two poisoned outputs: both succeed, the outputs are bit-identical, and neither wrote outside its
// [M, N] output.
template <typename Ref, typename Other>
void expect_identical_runs(const GemmData& d, int64_t n, Ref ref, Other other) {
  DeviceGemm x(d, n), y(d, n);
  const Status s1 = ref(x.params());
  const Status s2 = other(y.params());
  ASSERT_TRUE(s1.ok()) << s1.to_string();
  ASSERT_TRUE(s2.ok()) << s2.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  int64_t t1 = 0, t2 = 0;
  const std::vector<uint16_t> want = x.result(&t1), got = y.result(&t2);
  std::string report;
  EXPECT_EQ(count_bit_mismatches(got, want, n, &report), 0) << report;
  EXPECT_EQ(t1 + t2, 0) << "bytes outside the [M, N] output were written";
}

// The projection's shapes at prefill sizes (fused N 9856, the unfused pair 9216 / 640, o_proj N
// 6144 K 8192), M not a multiple of the tile: on integer-valued inputs byte-identical to cuBLASLt.
TEST_P(GemmPrefillVsCublasLt, IntegerInputsIdentical) {
  M3_REQUIRE_GPU();
  const LtCase c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message() << "M " << c.m << " N " << c.n << " K " << c.k << " cluster "
                                    << c.cluster / 10 << "x" << c.cluster % 10);
  Rng rng(seed);
  GemmData d = make_integer_data(c.m, c.n, c.k, rng);
  auto lt = make_gemm(c.m, c.n, c.k, cublaslt_only());
  ASSERT_NE(lt, nullptr);
  expect_identical_runs(
      d, c.n, [&](const GemmParams& p) { return lt->run(p, nullptr); },
      [&](const GemmParams& p) {
        return run_gemm_prefill_cuda(p, nullptr, prefill_options(c.cluster));
      });
}

std::vector<LtCase> lt_cases() {
  return {LtCase{1000, 9856, 6144, 12}, LtCase{1000, 9856, 6144, 21}, LtCase{1000, 9856, 6144, 11},
          LtCase{2052, 9216, 6144, 12}, LtCase{2052, 640, 6144, 21},  LtCase{1100, 6144, 8192, 12},
          LtCase{1100, 6144, 8192, 21}};
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmPrefillVsCublasLt, ::testing::ValuesIn(lt_cases()));

// Fp8BlockGemm with force_prefill runs the kernel from prefill_min_m on (algorithm_for says so):
// byte-identical to a cuBLASLt-only object on integer inputs, below it cuBLASLt as before.
TEST(GemmPrefill, ForcedThroughFp8BlockGemm) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int64_t m = 1028, n = 640, k = 6144;
  GemmData d = make_integer_data(m, n, k, rng);
  const Fp8BlockGemmOptions lt_opt = cublaslt_only();
  Fp8BlockGemmOptions forced = lt_opt;
  forced.prefill_min_m = 1024;
  forced.force_prefill = true;
  auto lt = make_gemm(m, n, k, lt_opt);
  auto pf = make_gemm(m, n, k, forced);
  ASSERT_NE(lt, nullptr);
  ASSERT_NE(pf, nullptr);
  EXPECT_NE(pf->algorithm_for(1028).find("prefill kernel"), std::string::npos);
  EXPECT_EQ(pf->algorithm_for(1020).find("prefill kernel"), std::string::npos);
  EXPECT_EQ(lt->algorithm_for(1028).find("prefill kernel"), std::string::npos);
  expect_identical_runs(
      d, n, [&](const GemmParams& p) { return lt->run(p, nullptr); },
      [&](const GemmParams& p) { return pf->run(p, nullptr); });
}

// An autotuned object (default options: from M 1024 on the tuner also times the prefill kernel
// and may choose it) equals a cuBLASLt-only object on integer inputs, whatever it chose; its
// describe() says what that was.
TEST(GemmPrefill, TunedObjectMatchesCublasLt) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int64_t m = 2048, n = 640, k = 6144;
  GemmData d = make_integer_data(m, n, k, rng);
  auto lt = make_gemm(m, n, k, cublaslt_only());
  auto tuned = make_gemm(m, n, k, Fp8BlockGemmOptions{});
  ASSERT_NE(lt, nullptr);
  ASSERT_NE(tuned, nullptr);
  std::printf("[ INFO     ] %s", tuned->describe().c_str());
  std::printf("[ INFO     ] M 2048: %s\n", tuned->algorithm_for(2048).c_str());
  expect_identical_runs(
      d, n, [&](const GemmParams& p) { return lt->run(p, nullptr); },
      [&](const GemmParams& p) { return tuned->run(p, nullptr); });
}

// Row-major activation scales are not the kernel's layout: unsupported, nothing launched.
TEST(GemmPrefill, RejectsRowMajorActivationScales) {
  M3_REQUIRE_GPU();
  Rng rng(1);
  GemmData d = make_integer_data(8, 128, 512, rng);
  DeviceGemm dev(d, d.n, 0, /*sa_row_major=*/true);
  const Status st = run_gemm_prefill_cuda(dev.params(), nullptr);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  expect_output_unwritten(dev);
}

// Small cases for compute-sanitizer (memcheck / racecheck), one per cluster size: more tiles than
// CTAs (some CTAs take two: the ring wraps across tiles, the epilogue buffer is reused), a partial
// last m tile.
void sanitizer_case(int cluster) {
  Rng rng(7);
  GemmData d = make_integer_data(1028, 2048, 256, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  DeviceGemm dev(d, d.n);
  const Status st = run_gemm_prefill_cuda(dev.params(), nullptr, prefill_options(cluster, 2));
  expect_launch_exact(st, dev, ref);
}

TEST(GemmPrefill, SanitizerSmallCluster1x1) {
  M3_REQUIRE_GPU();
  sanitizer_case(11);
}

TEST(GemmPrefill, SanitizerSmallCluster2x1) {
  M3_REQUIRE_GPU();
  sanitizer_case(21);
}

TEST(GemmPrefill, SanitizerSmallCluster1x2) {
  M3_REQUIRE_GPU();
  sanitizer_case(12);
}

}  // namespace
}  // namespace m3attn
