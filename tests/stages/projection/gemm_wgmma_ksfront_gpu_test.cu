// The K split's front option (GemmWgmmaOptions::row_ks_l2_lines, session 25)
// against the CPU twin: integer-valued inputs bit-identical (see gemm_gpu_test_util.h), nothing
// outside the output written, a second launch identical; plain and programmatic launches, more
// prefetched stages than the half has, odd M, padded outputs; the option without row_k_split is
// rejected.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "stages/projection/gemm_gpu_test_util.h"
#include "stages/projection/gemm_wgmma.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using namespace gemm_test;  // NOLINT(build/namespaces)
using testing::DeviceBuffer;
using testing::fresh_seed;
using testing::Rng;

#define M3_REQUIRE_WGMMA()                                                         \
  do {                                                                             \
    M3_REQUIRE_GPU();                                                              \
    if (!gemm_wgmma_device_supported())                                            \
      GTEST_SKIP() << "the wgmma GEMM needs an sm_90 device (this is not a pass)"; \
  } while (0)

// The K split on its own image (one image CTA per SM) with `l2_stages`, run twice; exact.
void expect_ksplit_exact(int64_t m, int64_t n, int64_t k, int64_t ld_pad, bool pdl, int l2_stages) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message() << "M " << m << " N " << n << " K " << k << " ld pad " << ld_pad
                                    << " PDL " << pdl << " L2 stages " << l2_stages);
  Rng rng(seed);
  GemmData d = make_integer_data(m, n, k, rng);
  DeviceGemm dev(d, n + ld_pad);
  GemmWgmmaOptions o;
  o.row_k_split = true;
  o.row_ks_l2_lines = l2_stages;
  o.programmatic_launch = o.trigger_dependents = pdl;
  Result<int> ctas = gemm_wgmma_rows_ctas(n, true);
  ASSERT_TRUE(ctas.ok()) << ctas.status().to_string();
  o.row_packed_ctas = ctas.value();
  Result<size_t> bytes = gemm_wgmma_rows_packed_bytes(n, k);
  ASSERT_TRUE(bytes.ok()) << bytes.status().to_string();
  DeviceBuffer image(bytes.value(), 0);
  const Status pk = gemm_wgmma_pack_weights_rows(dev.params().b, o.row_packed_ctas, image.data(),
                                                 image.bytes(), nullptr);
  ASSERT_TRUE(pk.ok()) << pk.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dev.b.poison(0x7F);  // E4M3 NaN: any read of b would show
  o.row_packed_weights = image.data();
  std::vector<uint16_t> results[2];
  for (auto& r : results) {
    dev.out.poison(kPoison);
    const Status st = run_gemm_wgmma_cuda(dev.params(), nullptr, 0, nullptr, o);
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    int64_t touched = 0;
    r = dev.result(&touched);
    EXPECT_EQ(touched, 0) << "bytes outside the [M, N] output were written";
  }
  EXPECT_EQ(results[0], results[1]) << "a second launch differs";
  std::string report;
  EXPECT_EQ(count_bit_mismatches(results[0], cpu_gemm(d), n, &report), 0) << report;
}

TEST(GemmWgmmaKSplitFront, L2PrefetchStagesBitIdenticalToTwin) {
  M3_REQUIRE_WGMMA();
  expect_ksplit_exact(64, 9856, 6144, 0, true, 4);
  expect_ksplit_exact(41, 9856, 6144, 8, false, 2);
  expect_ksplit_exact(64, 9856, 1152, 0, true, 100);  // more stages than each half has
  expect_ksplit_exact(33, 9856, 2048, 8, false, 4);
}

// Small shapes for compute-sanitizer (memcheck / racecheck).
TEST(GemmWgmmaKSplitFront, SanitizerSmall) {
  M3_REQUIRE_WGMMA();
  for (bool pdl : {false, true}) expect_ksplit_exact(40, 640, 4096, 8, pdl, 4);
}

TEST(GemmWgmmaKSplitFront, L2PrefetchWithoutKSplitRejected) {
  M3_REQUIRE_WGMMA();
  Rng rng(fresh_seed());
  GemmData d = make_integer_data(40, 640, 1024, rng);
  DeviceGemm dev(d, 640);
  DeviceBuffer image(static_cast<size_t>(640 * 1024), 0);
  Result<int> ctas = gemm_wgmma_rows_ctas(640);
  ASSERT_TRUE(ctas.ok());
  GemmWgmmaOptions o;
  o.row_packed_weights = image.data();
  o.row_packed_ctas = ctas.value();
  o.row_ks_l2_lines = 2;
  EXPECT_EQ(run_gemm_wgmma_cuda(dev.params(), nullptr, 0, nullptr, o).code(),
            StatusCode::kInvalidArgument);
  o.row_k_split = true;
  o.row_ks_l2_lines = -1;
  EXPECT_EQ(run_gemm_wgmma_cuda(dev.params(), nullptr, 0, nullptr, o).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int64_t touched = 0;
  const std::vector<uint16_t> out = dev.result(&touched);
  EXPECT_EQ(touched, 0);
  for (uint16_t v : out) ASSERT_EQ(v, static_cast<uint16_t>(kPoison | (kPoison << 8)));
}

}  // namespace
}  // namespace m3attn
