// The row split with the activations in registers (GemmWgmmaOptions::row_areg, session 25)
// against the CPU twin: integer-valued inputs bit-identical (see gemm_gpu_test_util.h), nothing
// outside the output written, a second launch identical; every M 1 ... 64 (tokens past M load
// zeros and are not stored), K not a multiple of the ring stage or of the K blocks held ahead,
// rings reused, CTAs of 37 / 38 rows straddling 128-row scale blocks and CTAs of 2-3 rows,
// padded (odd-start) output rows, 16-byte aligned operands, row-major activation scales,
// programmatic launch.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
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

struct AregCase {
  int64_t m, n, k, ld_pad = 0;
  size_t shift = 0;           // 16: operands only 16-byte aligned
  bool sa_row_major = false;  // activation scales [M, K / 128] row-major
  bool pdl = false;           // programmatic_launch + trigger_dependents
  int stages = 0;             // GemmWgmmaOptions::row_areg_stages
  int form = 0;               // GemmWgmmaOptions::row_areg_form
};

std::string describe(const AregCase& c) {
  return "M " + std::to_string(c.m) + " N " + std::to_string(c.n) + " K " + std::to_string(c.k) +
         " ld pad " + std::to_string(c.ld_pad) + " shift " + std::to_string(c.shift) +
         " sa row-major " + std::to_string(c.sa_row_major) + " PDL " + std::to_string(c.pdl) +
         " stages " + std::to_string(c.stages) + " form " + std::to_string(c.form);
}

void PrintTo(const AregCase& c, std::ostream* os) { *os << describe(c); }

// Packs the row split's image from the device weights (then poisoned: the kernel must read only
// the image), runs the kernel twice (output re-poisoned in between) and returns the first result;
// both must be identical and nothing outside [M, N] written.
std::vector<uint16_t> run_areg_twice(DeviceGemm& dev, const AregCase& c) {
  GemmWgmmaOptions o;
  o.row_areg = true;
  o.programmatic_launch = o.trigger_dependents = c.pdl;
  o.row_areg_stages = c.stages;
  o.row_areg_form = c.form;
  Result<int> ctas = gemm_wgmma_rows_ctas(c.n);
  EXPECT_TRUE(ctas.ok()) << ctas.status().to_string();
  o.row_packed_ctas = ctas.ok() ? ctas.value() : 1;
  Result<size_t> bytes = gemm_wgmma_rows_packed_bytes(c.n, c.k);
  EXPECT_TRUE(bytes.ok()) << bytes.status().to_string();
  DeviceBuffer image(bytes.ok() ? bytes.value() : 16, 0);
  const Status pk = gemm_wgmma_pack_weights_rows(dev.params().b, o.row_packed_ctas, image.data(),
                                                 image.bytes(), nullptr);
  EXPECT_TRUE(pk.ok()) << pk.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dev.b.poison(0x7F);  // E4M3 NaN: any read of b would show
  o.row_packed_weights = image.data();
  const Status st = run_gemm_wgmma_cuda(dev.params(), nullptr, 0, nullptr, o);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int64_t touched = 0;
  const std::vector<uint16_t> first = dev.result(&touched);
  EXPECT_EQ(touched, 0) << "bytes outside the [M, N] output were written";
  dev.out.poison(kPoison);
  const Status st2 = run_gemm_wgmma_cuda(dev.params(), nullptr, 0, nullptr, o);
  EXPECT_TRUE(st2.ok()) << st2.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> second = dev.result(&touched);
  EXPECT_EQ(touched, 0);
  EXPECT_EQ(first, second) << "a second launch differs";
  return first;
}

void expect_exact(const AregCase& c) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(describe(c));
  Rng rng(seed);
  GemmData d = make_integer_data(c.m, c.n, c.k, rng);
  DeviceGemm dev(d, c.n + c.ld_pad, c.shift, c.sa_row_major);
  const std::vector<uint16_t> got = run_areg_twice(dev, c);
  std::string report;
  EXPECT_EQ(count_bit_mismatches(got, cpu_gemm(d), c.n, &report), 0) << report;
}

class GemmWgmmaAreg : public ::testing::TestWithParam<AregCase> {};

TEST_P(GemmWgmmaAreg, IntegerInputsBitIdenticalToTwin) {
  M3_REQUIRE_WGMMA();
  expect_exact(GetParam());
}

std::vector<AregCase> areg_cases() {
  return {
      AregCase{64, 9856, 6144},                            // the fused decode shape, M 64
      AregCase{64, 9856, 6144, 0, 0, false, true},         // chained
      AregCase{33, 9856, 6144, 8, 0, false, false},        // odd M, odd-start output rows
      AregCase{48, 9856, 6144, 0, 16, true, true},         // unaligned, row-major scales, chained
      AregCase{32, 9856, 6144},                            // half the token rows
      AregCase{1, 9856, 6144, 0, 0, false, true},          // one token
      AregCase{17, 9856, 1152},                            // K 9 blocks: a last stage of one
      AregCase{63, 9856, 384, 8},                          // 3 K blocks: fewer than held ahead
      AregCase{37, 9856, 128},                             // one K block
      AregCase{64, 640, 1664, 0, 16},                      // 2-3 rows per CTA, 13 K blocks
      AregCase{50, 384, 6144, 24, 0, true},                // 1-2 rows per CTA, padded outputs
      AregCase{9, 6144, 8192, 0, 0, false, true},          // o_proj's shape: K 8192
      AregCase{64, 9856, 6144, 0, 0, false, true, 6},      // a ring of 6 stages
      AregCase{41, 9856, 1152, 8, 0, false, false, 6, 2},  // forms 1-3
      AregCase{64, 9856, 2048, 0, 0, false, true, 0, 1},
      AregCase{35, 9856, 6144, 0, 16, false, false, 6, 3},
      AregCase{64, 9856, 6144, 0, 0, false, true, 3},  // a ring of 3 stages
  };
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmWgmmaAreg, ::testing::ValuesIn(areg_cases()));

// Small shapes for compute-sanitizer (memcheck / racecheck): rings reused (K 4096: 16 stages
// through rings of 11 and 6), padded outputs, plain and chained, exact against the twin.
TEST(GemmWgmmaAregSanitizer, SanitizerSmall) {
  M3_REQUIRE_WGMMA();
  for (int64_t m : {1, 33, 64})
    for (bool pdl : {false, true})
      for (int stages : {0, 6})
        expect_exact(AregCase{m, 640, 4096, 8, 0, false, pdl, stages, stages == 6 ? 2 : 0});
}

// Calls the A-register form does not serve are rejected before anything is written.
TEST(GemmWgmmaAregRules, RejectedCallsWriteNothing) {
  M3_REQUIRE_WGMMA();
  Rng rng(fresh_seed());
  GemmData d = make_integer_data(40, 640, 1024, rng);
  DeviceGemm dev(d, 640);
  DeviceBuffer image(static_cast<size_t>(640 * 1024), 0);
  Result<int> ctas = gemm_wgmma_rows_ctas(640);
  ASSERT_TRUE(ctas.ok());
  for (int bad = 0; bad < 6; ++bad) {
    GemmWgmmaOptions o;
    o.row_areg = true;
    o.row_packed_weights = image.data();
    o.row_packed_ctas = ctas.value();
    if (bad == 0) o.row_k_split = true;
    if (bad == 1) o.ctas_per_sm = 1;
    if (bad == 2) o.burst = 2;
    if (bad == 3) o.debug_rows_diag = 5;
    if (bad == 4) o.row_areg_stages = 8;  // (0, 3 or 6)
    if (bad == 5) o.row_areg_form = 4;
    const Status st = run_gemm_wgmma_cuda(dev.params(), nullptr, 0, nullptr, o);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << "case " << bad << ": " << st.to_string();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    int64_t touched = 0;
    const std::vector<uint16_t> out = dev.result(&touched);
    EXPECT_EQ(touched, 0);
    for (uint16_t v : out) ASSERT_EQ(v, static_cast<uint16_t>(kPoison | (kPoison << 8)));
  }
}

}  // namespace
}  // namespace m3attn
