// The wgmma decode GEMM (run_gemm_wgmma_cuda, and Fp8BlockGemm with wgmma_max_m) against the CPU
// twin. Numerics and bounds: see gemm_gpu_test_util.h. The kernel accumulates each 128-wide K
// block in the tensor core (reduced-precision FP8 accumulator, exact for the integer inputs) and
// folds it into fp32 registers with sa * sb; split-K partials are summed in fp32 in CTA order.
// So: integer-valued inputs must be bit-identical to the twin, random inputs within
// |gpu - cpu| <= 2^-7 |cpu| + 2^-10 S. Every case also checks that nothing outside the output
// was written, that a second launch on the same workspace gives the same bytes (the kernel resets
// its arrival counters) and that the counters are zero afterwards.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "stages/projection/gemm_cublaslt.h"
#include "stages/projection/gemm_gpu_test_util.h"
#include "stages/projection/gemm_wgmma.h"
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

#define M3_REQUIRE_WGMMA()                                                         \
  do {                                                                             \
    M3_REQUIRE_GPU();                                                              \
    if (!gemm_wgmma_device_supported())                                            \
      GTEST_SKIP() << "the wgmma GEMM needs an sm_90 device (this is not a pass)"; \
  } while (0)

Fp8BlockGemmOptions wgmma_options() {
  Fp8BlockGemmOptions o;
  o.wgmma_max_m = 64;
  o.autotune = false;
  return o;
}

// A zeroed workspace for run_gemm_wgmma_cuda, sized for (n, m, waves, CTAs per SM).
DeviceBuffer make_workspace(int64_t n, int64_t m, int waves = 1, int ctas_per_sm = 0) {
  Result<size_t> bytes = gemm_wgmma_workspace_bytes(n, m, waves, ctas_per_sm);
  EXPECT_TRUE(bytes.ok()) << bytes.status().to_string();
  return DeviceBuffer(bytes.ok() ? bytes.value() : 256, 0);
}

int64_t nonzero_counters(const DeviceBuffer& ws, int64_t n) {
  std::vector<unsigned> c(static_cast<size_t>(n / 128));
  ws.download(c.data(), c.size() * sizeof(unsigned));
  int64_t bad = 0;
  for (unsigned v : c) bad += v != 0;
  return bad;
}

struct Case {
  int64_t m, n, k, ld_pad;
  size_t shift;       // 16: operands only 16-byte aligned
  bool sa_row_major;  // activation scales [M, K / 128] row-major instead of token-major
  int ctas_per_sm;    // GemmWgmmaOptions
  int min_units;
  int burst = 0;
  bool evict_first = true;  // GemmWgmmaOptions::weight_evict_first
  int promotion = 256;      // GemmWgmmaOptions::weight_l2_promotion
  bool pdl = false;         // GemmWgmmaOptions::programmatic_launch
  int waves = 1;            // GemmWgmmaOptions::max_waves
  bool owner = false;       // GemmWgmmaOptions::owner_fixup
  int cluster = 0;          // GemmWgmmaOptions::cluster_split
  bool packed = false;      // GemmWgmmaOptions::packed_weights (gemm_wgmma_pack_weights)
  bool rows = false;        // GemmWgmmaOptions::row_packed_weights (gemm_wgmma_pack_weights_rows)
  int row_ctas = 0;         // its CTA count (GemmWgmmaOptions::row_packed_ctas; 0: this device's)
  bool k_split = false;     // GemmWgmmaOptions::row_k_split (with rows)
  int early = 0;            // GemmWgmmaOptions::row_early_stages (with rows and pdl)
  // The K split's partition (session 26): the image's row_align and
  // GemmWgmmaOptions::row_k_split_align, 4 (the default, aligned) or 1 (plain).
  int ks_align = 4;
};

std::string describe(const Case& c) {
  return "M " + std::to_string(c.m) + " N " + std::to_string(c.n) + " K " + std::to_string(c.k) +
         " ld pad " + std::to_string(c.ld_pad) + " shift " + std::to_string(c.shift) +
         " sa row-major " + std::to_string(c.sa_row_major) + " ctas/SM " +
         std::to_string(c.ctas_per_sm) + " min units " + std::to_string(c.min_units) + " burst " +
         std::to_string(c.burst) + " evict-first " + std::to_string(c.evict_first) +
         " L2 promotion " + std::to_string(c.promotion) + " PDL " + std::to_string(c.pdl) +
         " waves " + std::to_string(c.waves) + " owner fixup " + std::to_string(c.owner) +
         " cluster split " + std::to_string(c.cluster) + " packed " + std::to_string(c.packed) +
         " row split " + std::to_string(c.rows) + " row CTAs " + std::to_string(c.row_ctas) +
         " row K split " + std::to_string(c.k_split) + " early stages " + std::to_string(c.early) +
         " K split align " + std::to_string(c.ks_align);
}

void PrintTo(const Case& c, std::ostream* os) { *os << describe(c); }

GemmWgmmaOptions options_of(const Case& c) {
  GemmWgmmaOptions o;
  o.ctas_per_sm = c.ctas_per_sm;
  o.min_units_per_cta = c.min_units;
  o.burst = c.burst;
  o.weight_evict_first = c.evict_first;
  o.weight_l2_promotion = c.promotion;
  o.programmatic_launch = c.pdl;
  o.max_waves = c.waves;
  o.owner_fixup = c.owner;
  o.cluster_split = c.cluster;
  return o;
}

// Runs the kernel twice on the same workspace (output re-poisoned in between): both results must
// be identical, nothing outside [M, N] written, the counters zero afterwards.
std::vector<uint16_t> run_twice(DeviceGemm& dev, const Case& c) {
  DeviceBuffer ws = make_workspace(c.n, c.m, c.waves, c.ctas_per_sm);
  GemmWgmmaOptions o = options_of(c);
  // Packed weights: packed from the device weights, which are then poisoned (the kernel must read
  // only the packed image).
  Result<size_t> packed_bytes = gemm_wgmma_packed_bytes(c.n, c.k, o);
  DeviceBuffer packed(c.packed && packed_bytes.ok() ? packed_bytes.value() : 16, 0);
  if (c.packed) {
    EXPECT_TRUE(packed_bytes.ok()) << packed_bytes.status().to_string();
    const Status st =
        gemm_wgmma_pack_weights(dev.params().b, packed.data(), packed.bytes(), o, nullptr);
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dev.b.poison(0x7F);  // E4M3 NaN: any read of b would show
    o.packed_weights = packed.data();
  }
  // Row split: its image, likewise packed from the device weights, which are then poisoned.
  Result<size_t> rows_bytes = gemm_wgmma_rows_packed_bytes(c.n, c.k);
  DeviceBuffer rows_image(c.rows && rows_bytes.ok() ? rows_bytes.value() : 16, 0);
  if (c.rows) {
    EXPECT_TRUE(rows_bytes.ok()) << rows_bytes.status().to_string();
    Result<int> ctas = gemm_wgmma_rows_ctas(c.n, c.k_split);
    EXPECT_TRUE(ctas.ok()) << ctas.status().to_string();
    o.row_packed_ctas = c.row_ctas > 0 ? c.row_ctas : ctas.ok() ? ctas.value() : 1;
    o.row_k_split = c.k_split;
    o.row_early_stages = c.early;
    o.row_k_split_align = c.ks_align;
    const Status st =
        gemm_wgmma_pack_weights_rows(dev.params().b, o.row_packed_ctas, rows_image.data(),
                                     rows_image.bytes(), nullptr, c.k_split ? c.ks_align : 1);
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dev.b.poison(0x7F);
    o.row_packed_weights = rows_image.data();
  }
  const Status st = run_gemm_wgmma_cuda(dev.params(), ws.data(), ws.bytes(), nullptr, o);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int64_t touched = 0;
  const std::vector<uint16_t> first = dev.result(&touched);
  EXPECT_EQ(touched, 0) << "bytes outside the [M, N] output were written";
  EXPECT_EQ(nonzero_counters(ws, c.n), 0) << "arrival counters not reset by the kernel";
  dev.out.poison(kPoison);
  const Status st2 = run_gemm_wgmma_cuda(dev.params(), ws.data(), ws.bytes(), nullptr, o);
  EXPECT_TRUE(st2.ok()) << st2.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> second = dev.result(&touched);
  EXPECT_EQ(touched, 0);
  EXPECT_EQ(first, second) << "a second launch on the same workspace differs";
  return first;
}

// Runs case c twice on integer-valued data drawn from rng (outputs padded by c.ld_pad) and expects
// both runs bit-exact against the CPU twin.
void expect_exact_vs_twin(const Case& c, Rng& rng) {
  GemmData d = make_integer_data(c.m, c.n, c.k, rng);
  DeviceGemm dev(d, c.n + c.ld_pad);
  const std::vector<uint16_t> got = run_twice(dev, c);
  std::string report;
  EXPECT_EQ(count_bit_mismatches(got, cpu_gemm(d), c.n, &report), 0) << report;
}

class GemmWgmmaExact : public ::testing::TestWithParam<Case> {};

TEST_P(GemmWgmmaExact, IntegerInputsBitIdenticalToTwin) {
  M3_REQUIRE_WGMMA();
  const Case c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(describe(c));
  Rng rng(seed);
  GemmData d = make_integer_data(c.m, c.n, c.k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  DeviceGemm dev(d, c.n + c.ld_pad, c.shift, c.sa_row_major);
  const std::vector<uint16_t> got = run_twice(dev, c);
  std::string report;
  EXPECT_EQ(count_bit_mismatches(got, ref, c.n, &report), 0) << report;
}

// The exact cases, as a vector (::testing::ValuesIn): a ::testing::Values list of ~110 cases
// instantiates a variadic tuple of that size, which took one host compiler ~270 s (session 20).
std::vector<Case> exact_cases() {
  std::vector<Case> cases = {
      Case{1, 9856, 6144, 0, 0, false, 0, 4},      // decode, fused width
      Case{3, 640, 6144, 8, 16, true, 0, 4},       // odd M, unaligned, row-major sa
      Case{4, 9856, 256, 0, 0, false, 0, 4},       // two K blocks: whole tiles
      Case{16, 640, 256, 0, 16, false, 1, 4},      // n = 16, one CTA per SM
      Case{33, 384, 6144, 24, 0, true, 0, 4},      // n = 64, padded output rows
      Case{64, 640, 6144, 0, 0, false, 0, 4},      // largest M
      Case{64, 9856, 256, 0, 0, false, 0, 4},      // largest M, fused width
      Case{16, 9856, 6144, 0, 0, false, 2, 4},     // n = 16, two CTAs per SM
      Case{8, 640, 6144, 0, 0, false, 2, 1},       // ~50 CTAs per tile: fixup
      Case{33, 128, 6144, 0, 0, false, 0, 1},      // one tile, every CTA on it
      Case{5, 256, 128, 0, 0, false, 0, 4},        // one K block, one CTA
      Case{32, 640, 1024, 0, 16, false, 2, 1},     // n = 32, two CTAs per SM
      Case{24, 1280, 2048, 16, 0, true, 1, 3},     // n = 32, one CTA per SM
      Case{2, 9856, 1024, 0, 0, false, 2, 4, 1},   // bursts of one unit
      Case{12, 640, 6144, 0, 0, false, 1, 4, 5},   // odd burst, 12-stage ring
      Case{40, 384, 2048, 8, 0, false, 0, 2, 99},  // burst clamped to the ring
      Case{7, 256, 1152, 0, 16, true, 2, 1, 6},    // burst = ring (6 stages)
      // Weights loaded without the evict-first policy.
      Case{1, 9856, 6144, 0, 0, false, 2, 16, 0, false},
      Case{16, 640, 6144, 8, 16, true, 1, 4, 0, false},
      Case{33, 384, 2048, 0, 0, false, 0, 1, 0, false},
      Case{64, 256, 640, 0, 0, true, 0, 4, 3, false},
      // Every M from 57 to 64 shares the n = 64 kernel: the last rows' scales.
      Case{57, 640, 1152, 0, 0, false, 0, 4}, Case{63, 384, 6144, 8, 0, true, 0, 2, 4},
      // Other L2 promotions of the weight loads.
      Case{1, 9856, 6144, 0, 0, false, 0, 4, 0, true, 0},
      Case{16, 640, 2048, 0, 16, true, 0, 4, 0, true, 128},
      // Programmatic launch (weights of the first ring before the wait).
      Case{1, 9856, 6144, 0, 0, false, 0, 4, 0, true, 256, true},
      Case{64, 640, 1024, 0, 16, true, 0, 1, 0, true, 256, true},
      Case{5, 256, 128, 0, 0, false, 0, 4, 0, true, 256, true},
      // Grids over several waves of resident CTAs (max_waves).
      Case{1, 9856, 6144, 0, 0, false, 0, 4, 0, true, 0, false, 16},
      Case{8, 640, 6144, 0, 0, false, 2, 1, 0, true, 256, false, 16},
      Case{33, 1280, 2048, 8, 16, true, 0, 2, 0, true, 0, false, 8},
      Case{16, 9856, 1152, 0, 0, false, 1, 3, 0, true, 256, true, 4},
      Case{64, 640, 6144, 0, 0, false, 0, 1, 0, true, 0, false, 4},
      // Two CTAs per SM at n = 64 (4-stage rings).
      Case{64, 1536, 8192, 0, 0, false, 2, 4}, Case{41, 640, 1152, 8, 16, true, 2, 1, 0, true, 0},
      // owner_fixup: ~50 CTAs per tile (middle CTAs), one tile, every n, one and
      // two CTAs per SM, PDL; with several waves it is ignored.
      Case{8, 640, 6144, 0, 0, false, 2, 1, 0, true, 0, false, 1, true},
      Case{33, 128, 6144, 0, 0, false, 0, 1, 0, true, 0, false, 1, true},
      Case{1, 9856, 6144, 0, 0, false, 0, 16, 0, true, 0, false, 1, true},
      Case{16, 640, 1152, 8, 16, true, 1, 3, 0, true, 0, false, 1, true},
      Case{64, 1536, 8192, 0, 0, false, 0, 4, 0, true, 0, false, 1, true},
      Case{40, 1280, 2048, 0, 0, true, 2, 1, 3, true, 0, true, 1, true},
      Case{57, 640, 1152, 0, 16, true, 0, 1, 0, true, 0, false, 1, true},
      Case{24, 384, 6144, 16, 0, true, 0, 1, 0, true, 0, false, 4, true},
      // cluster_split: C CTAs per tile reduce through distributed shared memory;
      // every n, uneven K shares (9 blocks over 4 ranks, 5 over 5), whole tiles
      // (C = 1), C = 8 on one tile, two CTAs per SM, PDL, owner_fixup ignored.
      Case{1, 9856, 6144, 0, 0, false, 0, 4, 0, true, 0, false, 1, false, 3},
      Case{3, 640, 6144, 8, 16, true, 0, 4, 0, true, 256, false, 1, false, 2},
      Case{16, 9856, 1152, 0, 0, false, 2, 4, 0, true, 0, false, 1, false, 4},
      Case{33, 384, 6144, 24, 0, true, 0, 4, 0, true, 0, false, 1, false, 1},
      Case{64, 640, 2048, 0, 0, false, 0, 4, 0, true, 0, false, 1, false, 2},
      Case{40, 1280, 2048, 0, 0, true, 2, 1, 3, true, 0, true, 1, false, 3},
      Case{8, 256, 640, 0, 0, false, 0, 4, 0, true, 0, false, 1, false, 5},
      Case{24, 128, 8192, 0, 0, false, 1, 4, 0, true, 0, false, 1, false, 8},
      Case{16, 640, 6144, 0, 0, false, 0, 4, 0, true, 0, false, 1, true, 3},
      // packed_weights: fused width, every n, uneven CTA counts (holes in the image),
      // one K block, one tile, one and two CTAs per SM, PDL, bursts, several waves,
      // padded and 16-byte aligned operands.
      Case{1, 9856, 6144, 0, 0, false, 0, 16, 0, true, 0, false, 1, false, 0, true},
      Case{3, 640, 6144, 8, 16, true, 0, 4, 0, true, 256, false, 1, false, 0, true},
      Case{16, 9856, 1152, 0, 0, false, 2, 4, 1, true, 0, false, 1, false, 0, true},
      Case{33, 384, 6144, 24, 0, true, 0, 4, 0, true, 0, false, 1, false, 0, true},
      Case{64, 1536, 8192, 0, 0, false, 1, 4, 0, true, 0, true, 1, false, 0, true},
      Case{8, 128, 6144, 0, 0, false, 0, 1, 3, true, 0, false, 1, false, 0, true},
      Case{5, 256, 128, 0, 0, false, 0, 4, 0, true, 0, true, 1, false, 0, true},
      Case{40, 1280, 2048, 0, 0, true, 2, 1, 0, true, 0, false, 4, false, 0, true},
      // row_packed_weights (session 18): fused width (37-38 rows per CTA, CTAs straddling a
      // weight-scale block), every n, partial image steps and ring stages (K blocks 9, 5, 1),
      // K 8192, fewer rows than two CTAs per SM (one row per CTA), padded / 16-byte aligned
      // operands, row-major activation scales, PDL, no evict-first hint.
      Case{1, 9856, 6144, 0, 0, false, 0, 16, 0, true, 0, false, 1, false, 0, false, true},
      Case{3, 640, 6144, 8, 16, true, 0, 4, 0, true, 0, false, 1, false, 0, false, true},
      Case{16, 9856, 1152, 0, 0, false, 0, 4, 0, true, 0, true, 1, false, 0, false, true},
      Case{13, 9856, 6144, 0, 0, false, 0, 4, 0, false, 0, false, 1, false, 0, false, true},
      Case{32, 9856, 640, 0, 16, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true},
      Case{33, 384, 6144, 24, 0, true, 0, 4, 0, true, 0, false, 1, false, 0, false, true},
      Case{64, 6144, 8192, 0, 0, false, 0, 4, 0, true, 0, true, 1, false, 0, false, true},
      Case{64, 9856, 6144, 0, 0, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true},
      Case{8, 128, 6144, 0, 0, false, 0, 1, 0, true, 0, false, 1, false, 0, false, true},
      Case{5, 256, 128, 0, 0, false, 0, 4, 0, true, 0, true, 1, false, 0, false, true},
      Case{57, 640, 1152, 0, 16, true, 0, 1, 0, true, 0, false, 1, false, 0, false, true},
      Case{24, 1280, 2048, 8, 0, true, 0, 4, 0, true, 0, false, 1, false, 0, false, true},
      // Row split with 1, 2, 4 K blocks per ring stage (burst).
      Case{1, 9856, 2048, 0, 0, false, 0, 4, 2, true, 0, false, 1, false, 0, false, true},
      Case{5, 640, 1152, 0, 16, false, 0, 4, 1, true, 0, false, 1, false, 0, false, true},
      Case{16, 9856, 640, 0, 0, false, 0, 4, 2, true, 0, true, 1, false, 0, false, true},
      Case{24, 9856, 2048, 0, 0, true, 0, 4, 4, true, 0, false, 1, false, 0, false, true},
      Case{64, 9856, 1152, 0, 0, false, 0, 4, 1, true, 0, false, 1, false, 0, false, true},
      // Row split with two consumer warpgroups per CTA, one CTA per SM (ctas_per_sm 1): every n,
      // K 8192, partial stages, PDL, one row per warpgroup.
      Case{1, 9856, 6144, 0, 0, false, 1, 4, 0, true, 0, false, 1, false, 0, false, true},
      Case{16, 9856, 1152, 0, 16, true, 1, 4, 0, true, 0, true, 1, false, 0, false, true},
      Case{33, 640, 2048, 8, 0, false, 1, 4, 0, true, 0, false, 1, false, 0, false, true},
      Case{64, 6144, 8192, 0, 0, false, 1, 4, 0, false, 0, false, 1, false, 0, false, true},
      Case{8, 128, 640, 0, 0, false, 1, 4, 0, true, 0, false, 1, false, 0, false, true},
      // An image packed for another CTA count than this device's one wave (an odd count below
      // it; 400 CTAs, more than two per SM on an H200: a second wave) stays exact; one and two
      // warpgroups per CTA (an odd count keeps one).
      Case{1, 9856, 6144, 0, 0, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true, 251},
      Case{16, 9856, 1152, 0, 0, false, 1, 4, 0, true, 0, true, 1, false, 0, false, true, 251},
      Case{8, 9856, 2048, 0, 0, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true, 400},
      Case{40, 9856, 2048, 0, 0, false, 1, 4, 0, true, 0, false, 1, false, 0, false, true, 400},
      // Row split at M > 32 (its token-major form since session 19): fused width (37-38 rows
      // per CTA, straddling weight-scale blocks), padded tokens (M 33, 57), one or two rows per
      // CTA, K 8192, 1 K block per stage, a partial stage (K blocks 9), no evict-first, PDL, two
      // warpgroups per CTA, an image for 251 CTAs.
      Case{33, 384, 6144, 24, 0, true, 0, 4, 0, true, 0, false, 1, false, 0, false, true},
      Case{57, 6144, 8192, 0, 16, false, 0, 4, 0, false, 0, false, 1, false, 0, false, true},
      Case{64, 9856, 1152, 0, 0, false, 0, 4, 1, true, 0, true, 1, false, 0, false, true},
      Case{48, 640, 2048, 8, 0, true, 1, 4, 0, true, 0, false, 1, false, 0, false, true},
      Case{64, 9856, 6144, 0, 0, false, 1, 4, 0, true, 0, true, 1, false, 0, false, true},
      Case{40, 9856, 2048, 0, 0, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true, 251},
      // clang-format off
        // More token-major cases (M > 32; session 20, for its fold by bit masks): fused width
        // (CTAs straddling weight-scale blocks), padded tokens, K 2048 / 8192, 1 K block per
        // stage, PDL, an image for 251 CTAs.
        Case{64, 9856, 6144, 0, 0, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true, 0},
        Case{33, 384, 6144, 24, 0, true, 0, 4, 0, true, 0, true, 1, false, 0, false, true, 0},
        Case{57, 6144, 8192, 0, 16, false, 0, 4, 1, true, 0, false, 1, false, 0, false, true, 0},
        Case{64, 9856, 2048, 0, 0, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true, 0},
        Case{48, 9856, 1152, 8, 0, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true, 251},
        // Token-major outputs as bf16 pairs (session 22): CTAs starting on odd rows, padded and
        // 16-byte aligned outputs, one to three rows per CTA, two warpgroups per CTA, PDL.
        Case{57, 9856, 2048, 8, 16, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true, 0},
        Case{33, 640, 1152, 16, 0, true, 1, 4, 0, true, 0, true, 1, false, 0, false, true, 0},
        Case{64, 9856, 640, 8, 0, false, 1, 4, 0, true, 0, false, 1, false, 0, false, true, 0},
        // n 8 reads each K block's scales before its wgmma wait (session 22): M 1-8, fused and
        // o_proj widths, partial stages (K blocks 9), K 8192, padded outputs, PDL, 251 CTAs.
        Case{8, 9856, 1152, 8, 16, true, 0, 4, 0, true, 0, true, 1, false, 0, false, true, 0},
        Case{1, 6144, 8192, 0, 0, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true, 251},
        Case{5, 9856, 6144, 16, 0, false, 1, 4, 0, true, 0, true, 1, false, 0, false, true, 0},
        // The row split's K split (session 23; one CTA of two halves per SM, whatever
        // ctas_per_sm; M 33-64): fused width (74-75 rows per pair, pairs straddling
        // weight-scale blocks and starting on odd rows), padded tokens, K blocks 9 / 13 / 5 / 3
        // / 1 (halves of unequal length, half 1 idle at 3 and 1), the largest K (50 K blocks:
        // 26 in half 0), images for 100 / 200 pairs (61-62 and 30-31 rows; 200 pairs: a second
        // wave), 2 to 5 rows per pair (half 1 without columns), padded / 16-byte aligned
        // operands, row-major activation scales, PDL, no evict-first.
        Case{64, 9856, 6144, 0, 0, false, 0, 4, 0,
             true, 0, false, 1, false, 0, false, true, 0, true},
        Case{64, 9856, 6144, 0, 0, false, 1, 4, 0,
             true, 0, false, 1, false, 0, false, true, 0, true},
        Case{40, 9856, 6144, 8, 16, true, 0, 4, 0,
             true, 0, true, 1, false, 0, false, true, 0, true},
        Case{48, 9856, 6144, 0, 0, false, 1, 4, 0,
             true, 0, false, 1, false, 0, false, true, 0, true},
        Case{36, 9856, 1152, 0, 0, false, 1, 4, 0,
             true, 0, false, 1, false, 0, false, true, 0, true},
        Case{57, 9856, 1664, 8, 0, false, 0, 4, 0,
             false, 0, false, 1, false, 0, false, true, 0, true},
        Case{33, 640, 384, 0, 16, true, 0, 4, 0, true, 0, true, 1, false, 0, false, true, 0, true},
        Case{50, 384, 128, 16, 0, false, 1, 4, 0,
             true, 0, false, 1, false, 0, false, true, 0, true},
        Case{64, 6144, 6400, 0, 0, false, 0, 4, 0,
             true, 0, false, 1, false, 0, false, true, 100, true},
        Case{48, 6144, 2048, 0, 0, true, 1, 4, 0,
             true, 0, true, 1, false, 0, false, true, 200, true},
        Case{40, 6144, 1152, 0, 0, false, 0, 4, 0,
             true, 0, false, 1, false, 0, false, true, 200, true},
        Case{37, 9856, 6144, 8, 0, false, 0, 4, 0,
             true, 0, false, 1, false, 0, false, true, 0, true},
        Case{63, 9856, 6144, 0, 0, false, 1, 4, 0,
             true, 0, true, 1, false, 0, false, true, 0, true},
        Case{64, 9856, 640, 0, 16, false, 0, 4, 0,
             true, 0, true, 1, false, 0, false, true, 0, true}};
  // clang-format on
  // Programmatic launch with the weights of 1-3 early stages (session 24; the default is covered
  // by every PDL case above): every n, two warpgroups per CTA, the K split, more early stages than
  // the ring (clamped), a single stage.
  auto early = [](int64_t m, int64_t n, int64_t k, int ctas_per_sm, int stages, bool k_split) {
    Case c{m, n, k, 0, 0, false, ctas_per_sm, 4, 0, true, 0, true};
    c.rows = true;
    c.early = stages;
    c.k_split = k_split;
    return c;
  };
  for (const Case& c : {early(1, 9856, 6144, 0, 1, false), early(32, 9856, 6144, 0, 2, false),
                        early(16, 9856, 2048, 0, 3, false), early(64, 9856, 6144, 0, 1, false),
                        early(20, 9856, 1152, 1, 2, false), early(32, 640, 1024, 0, 9, false),
                        early(8, 384, 128, 0, 1, false), early(64, 9856, 6144, 0, 1, true),
                        early(40, 9856, 1152, 0, 2, true)})
    cases.push_back(c);
  // Activation slots loaded as two boxes of half the slot (session 24; tokens [0, n / 2) and
  // [M - n / 2, M), the overlap stored once): the first M above each half slot (9, 17, 33), odd M
  // just below a full slot (15, 31, 63), fused width, padded outputs, PDL, two warpgroups per CTA,
  // the K split.
  auto slot = [](int64_t m, int64_t ld_pad, int ctas_per_sm, bool pdl, bool k_split) {
    Case c{m, 9856, 2048, ld_pad, 0, false, ctas_per_sm, 4, 0, true, 0, pdl};
    c.rows = true;
    c.k_split = k_split;
    return c;
  };
  for (const Case& c :
       {slot(9, 0, 0, false, false), slot(15, 8, 0, true, false), slot(17, 0, 1, false, false),
        slot(31, 0, 0, true, false), slot(33, 16, 0, false, false), slot(63, 0, 1, true, false),
        slot(33, 0, 0, true, true), slot(47, 8, 0, false, true)})
    cases.push_back(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmWgmmaExact, ::testing::ValuesIn(exact_cases()));

// Layout probe (diagnostics for the operand descriptors and the swizzle): A has one 1 per row, at
// k = k0 + m, so out[m, n] = B[n, k0 + m] with unit scales; B[n, k] = (n + 3 k) % 17 - 8 is an
// exact small integer. On failure the test prints a corner of the output next to the expectation.
TEST(GemmWgmmaProbe, IdentityActivationsSelectWeightColumns) {
  M3_REQUIRE_WGMMA();
  for (int64_t k : {128, 512}) {
    const int64_t m = 8, n = 256, k0 = k - 128 + 40;  // inside the last K block
    SCOPED_TRACE(::testing::Message() << "K " << k);
    GemmData d;
    d.m = m, d.n = n, d.k = k, d.kb = k / 128;
    d.a.assign(static_cast<size_t>(m * k), 0);
    d.b.resize(static_cast<size_t>(n * k));
    d.sa.assign(static_cast<size_t>(m * d.kb), 1.0f);
    d.sb.assign(static_cast<size_t>(n / 128 * d.kb), 1.0f);
    for (int64_t i = 0; i < m; ++i) d.a[i * k + k0 + i] = float_to_e4m3(1.0f);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c)
        d.b[r * k + c] = float_to_e4m3(static_cast<float>((r + 3 * c) % 17 - 8));
    DeviceGemm dev(d, n);
    const Case c{m, n, k, 0, 0, false, 0, 4};
    const std::vector<uint16_t> got = run_twice(dev, c);
    int64_t bad = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        bad += bf16_to_float(got[i * n + j]) != static_cast<float>((j + 3 * (k0 + i)) % 17 - 8);
    EXPECT_EQ(bad, 0);
    if (bad != 0) {
      std::string text = "got (expected) for m < 8, n < 12:\n";
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < 12; ++j)
          text += std::to_string(static_cast<int>(bf16_to_float(got[i * n + j]))) + "(" +
                  std::to_string((j + 3 * (k0 + i)) % 17 - 8) + ") ";
        text += "\n";
      }
      std::printf("%s", text.c_str());
    }
  }
}

struct RandomCase {
  int64_t m, n, k;
};

void PrintTo(const RandomCase& c, std::ostream* os) {
  *os << "M " << c.m << " N " << c.n << " K " << c.k;
}

class GemmWgmmaRandom : public ::testing::TestWithParam<RandomCase> {};

TEST_P(GemmWgmmaRandom, WithinAccumulationBoundOfTwin) {
  M3_REQUIRE_WGMMA();
  const RandomCase rc = GetParam();
  const Case c{rc.m, rc.n, rc.k, 0, 0, false, 0, 4};
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(describe(c));
  Rng rng(seed);
  GemmData d = make_random_data(c.m, c.n, c.k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  const std::vector<double> s = abs_sums(d);
  DeviceGemm dev(d, c.n);
  const std::vector<uint16_t> got = run_twice(dev, c);
  expect_within_bound("wgmma kernel vs twin", got, ref, s, d, std::ldexp(1.0, -10), 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmWgmmaRandom,
                         ::testing::ValuesIn(std::vector<RandomCase>{
                             RandomCase{1, 9856, 6144}, RandomCase{8, 640, 6144},
                             RandomCase{33, 256, 6144}, RandomCase{64, 640, 6144},
                             RandomCase{16, 128, 8192}}));

// Through Fp8BlockGemm (wgmma_max_m = 64): the fused projection equals the unfused pair bit for
// bit on integer inputs although the three GEMMs split K differently.
TEST(GemmWgmmaFused, IntegerInputsFusedEqualsUnfusedBitForBit) {
  M3_REQUIRE_WGMMA();
  for (int64_t m : {4, 16, 36, 64}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    SCOPED_TRACE(::testing::Message() << "M " << m);
    Rng rng(seed);
    const GemmData d = make_integer_data(m, kNF, kHidden, rng);
    const FusedRun r = run_fused_and_unfused(d, wgmma_options());
    ASSERT_EQ(r.fused.size(), static_cast<size_t>(m * kNF));
    std::string report;
    EXPECT_EQ(count_bit_mismatches(r.fused, r.unfused, kNF, &report), 0) << report;
    EXPECT_EQ(r.touched, 0);
  }
}

// The wgmma kernel and cuBLASLt on the same random operands, through Fp8BlockGemm: within the
// accumulation bound of each other (two device accumulations: 2^-9 S), identical fraction
// reported.
TEST(GemmWgmmaFused, AgreesWithCublasLt) {
  M3_REQUIRE_WGMMA();
  for (int64_t m : {1, 16, 64}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    Rng rng(seed);
    expect_agrees_with_cublaslt("wgmma kernel", gemm_padded_rows(m), 64, wgmma_options(), rng);
  }
}

// Quantize (rows padded to a multiple of 4) + wgmma GEMM through Fp8BlockGemm, captured once and
// replayed with a new x: equals eager runs byte for byte.
TEST(GemmWgmmaGraph, ReplayWithNewInputEqualsEager) {
  M3_REQUIRE_WGMMA();
  for (int64_t rows : {1, 16, 33, 64}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    SCOPED_TRACE(::testing::Message() << "rows " << rows);
    Rng rng(seed);
    expect_graph_replay_equals_eager(rows, 64, wgmma_options(), rng);
  }
}

// The same with programmatic dependent launch (GemmWgmmaOptions::programmatic_launch): the GEMM
// may start while the quantizer finishes, requesting weights early; the graph records a
// programmatic edge. Replay and eager runs must equal a plain launch after a full synchronization.
TEST(GemmWgmmaGraph, ProgrammaticLaunchEqualsPlainLaunch) {
  M3_REQUIRE_WGMMA();
  for (int64_t rows : {1, 33}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    SCOPED_TRACE(::testing::Message() << "rows " << rows);
    Rng rng(seed);
    Fp8BlockGemmOptions pdl = wgmma_options();
    pdl.wgmma.programmatic_launch = true;
    const Fp8BlockGemmOptions plain = wgmma_options();
    expect_graph_replay_equals_eager(rows, 64, pdl, rng, &plain);
  }
}

// Two GEMMs back to back, both with programmatic launch and trigger_dependents, writing the same
// output from different activations, on one workspace: the second may start while the first
// finishes but writes only after it, so the output is the second's, bit for bit (eager and as a
// graph replay), and the shared arrival counters end at zero.
TEST(GemmWgmmaGraph, TriggeredChainWritesTheLastGemm) {
  M3_REQUIRE_WGMMA();
  for (int64_t rows : {1, 16, 40}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    SCOPED_TRACE(::testing::Message() << "rows " << rows);
    Rng rng(seed);
    const int64_t n = 1280, k = 2048;
    GemmData d1 = make_integer_data(rows, n, k, rng);
    GemmData d2 = make_integer_data(rows, n, k, rng);
    GemmData mixed = d1;  // the second call: d2's activations, d1's weights
    mixed.a = d2.a;
    mixed.sa = d2.sa;
    const std::vector<uint16_t> ref = cpu_gemm(mixed);
    DeviceGemm g1(d1, n), g2(d2, n);
    GemmParams p1 = g1.params(), p2 = g1.params();
    p2.a = g2.params().a;
    p2.a_scales = g2.params().a_scales;
    GemmWgmmaOptions o;
    o.programmatic_launch = true;
    o.trigger_dependents = true;
    o.min_units_per_cta = 2;
    DeviceBuffer ws = make_workspace(n, rows);
    cudaStream_t stream;
    M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto chain = [&] {
      EXPECT_TRUE(run_gemm_wgmma_cuda(p1, ws.data(), ws.bytes(), stream, o).ok());
      EXPECT_TRUE(run_gemm_wgmma_cuda(p2, ws.data(), ws.bytes(), stream, o).ok());
    };
    for (int pass = 0; pass < 2; ++pass) {
      g1.out.poison(kPoison);
      if (pass == 0) {
        chain();
      } else {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        chain();
        M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
        M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
        M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      int64_t touched = 0;
      const std::vector<uint16_t> got = g1.result(&touched);
      std::string report;
      EXPECT_EQ(count_bit_mismatches(got, ref, n, &report), 0)
          << (pass ? "graph: " : "eager: ") << report;
      EXPECT_EQ(touched, 0);
      EXPECT_EQ(nonzero_counters(ws, n), 0);
    }
    M3_CUDA_TEST_CHECK(cudaStreamDestroy(stream));
  }
}

// The benchmark's timeline (GemmWgmmaOptions::debug_trace) changes no output bit, and every CTA
// of the grid records an ordered timeline (start <= first unit <= last unit <= end).
TEST(GemmWgmmaDiagnostics, TraceKeepsTheOutput) {
  M3_REQUIRE_WGMMA();
  for (int64_t m : {3, 40}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    SCOPED_TRACE(::testing::Message() << "M " << m);
    Rng rng(seed);
    const Case c{m, 1280, 2048, 0, 0, false, 0, 4};
    GemmData d = make_integer_data(c.m, c.n, c.k, rng);
    const std::vector<uint16_t> ref = cpu_gemm(d);
    DeviceGemm dev(d, c.n);
    DeviceBuffer ws = make_workspace(c.n, c.m);
    const int sms = testing::current_device_sms();
    const int words = gemm_wgmma_trace_words();
    DeviceBuffer trace(static_cast<size_t>(2 * sms * words) * 8, 0);
    GemmWgmmaOptions o = options_of(c);
    o.debug_trace = static_cast<unsigned long long*>(trace.data());
    ASSERT_TRUE(run_gemm_wgmma_cuda(dev.params(), ws.data(), ws.bytes(), nullptr, o).ok());
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    int64_t touched = 0;
    std::string report;
    EXPECT_EQ(count_bit_mismatches(dev.result(&touched), ref, c.n, &report), 0) << report;
    EXPECT_EQ(touched, 0);
    EXPECT_EQ(nonzero_counters(ws, c.n), 0);
    // 10 x 16 units of 4 per CTA: 40 CTAs.
    std::vector<unsigned long long> t(static_cast<size_t>(2 * sms * words));
    trace.download(t.data(), t.size() * 8);
    for (int cta = 0; cta < 40; ++cta) {
      const unsigned long long* w = &t[static_cast<size_t>(cta * words)];
      EXPECT_NE(w[0], 0u) << "CTA " << cta;
      EXPECT_LE(w[0], w[1]) << "CTA " << cta;
      EXPECT_LE(w[1], w[2]) << "CTA " << cta;
      EXPECT_LE(w[2], w[3]) << "CTA " << cta;
      EXPECT_LE(w[4], w[5]) << "CTA " << cta;
      EXPECT_LE(w[5], w[6]) << "CTA " << cta;
      EXPECT_LE(w[7], w[6]) << "CTA " << cta;
    }
    EXPECT_EQ(t[static_cast<size_t>(40 * words)], 0u) << "a CTA beyond the grid wrote a trace";
  }
}

TEST(GemmWgmmaRules, RejectedCallsWriteNothing) {
  M3_REQUIRE_WGMMA();
  Rng rng(fresh_seed());
  {
    GemmData d = make_integer_data(65, 256, 512, rng);  // one row too many
    DeviceGemm dev(d, 256);
    DeviceBuffer ws = make_workspace(256, 64);
    EXPECT_EQ(run_gemm_wgmma_cuda(dev.params(), ws.data(), ws.bytes(), nullptr).code(),
              StatusCode::kUnsupported);
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    int64_t touched = 0;
    for (uint16_t v : dev.result(&touched)) ASSERT_EQ(v, 0xA5A5);
    EXPECT_EQ(touched, 0);
  }
  GemmData d = make_integer_data(8, 256, 512, rng);
  DeviceGemm dev(d, 256);
  DeviceBuffer ws = make_workspace(256, 8);
  GemmParams p = dev.params();
  // Workspace too small, null, or misaligned.
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), 64, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(run_gemm_wgmma_cuda(p, nullptr, ws.bytes(), nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(run_gemm_wgmma_cuda(p, static_cast<uint8_t*>(ws.data()) + 16, ws.bytes() - 16, nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  // N not a multiple of 128 (N = 200): validate_gemm refuses it.
  p.b.shape[0] = 200;
  p.out.shape[1] = 200;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr).code(),
            StatusCode::kInvalidArgument);
  // CPU tensors; bad options.
  p = dev.params();
  GemmParams cpu = p;
  cpu.a.device = cpu.a_scales.device = cpu.b.device = cpu.b_scales.device = cpu.out.device =
      Device::cpu();
  EXPECT_EQ(run_gemm_wgmma_cuda(cpu, ws.data(), ws.bytes(), nullptr).code(),
            StatusCode::kInvalidArgument);
  GemmWgmmaOptions bad;
  bad.ctas_per_sm = 3;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  bad = {};
  bad.burst = -1;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  bad = {};
  bad.weight_l2_promotion = 100;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  for (int waves : {0, 65}) {
    bad = {};
    bad.max_waves = waves;
    EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(gemm_wgmma_workspace_bytes(256, 8, waves).status().code(),
              StatusCode::kInvalidArgument);
  }

  EXPECT_EQ(gemm_wgmma_workspace_bytes(256, 8, 1, 3).status().code(), StatusCode::kInvalidArgument);
  for (int split : {-1, 9, 5}) {  // K = 512: 4 K blocks, so at most 4
    bad = {};
    bad.cluster_split = split;
    EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
              StatusCode::kInvalidArgument)
        << split;
  }
  bad = {};
  bad.packed_weights = ws.data();  // (any 16-byte aligned pointer: rejected before any read)
  bad.cluster_split = 2;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  bad = {};
  bad.packed_weights = static_cast<uint8_t*>(ws.data()) + 8;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(gemm_wgmma_pack_weights(p.b, ws.data(), 64, GemmWgmmaOptions{}, nullptr).code(),
            StatusCode::kInvalidArgument);  // too small
  EXPECT_EQ(gemm_wgmma_packed_bytes(200, 512, GemmWgmmaOptions{}).status().code(),
            StatusCode::kInvalidArgument);
  bad = {};
  bad.min_units_per_cta = 0;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  Fp8BlockGemmOptions o = wgmma_options();
  o.wgmma_max_m = 65;
  EXPECT_EQ(Fp8BlockGemm::create(64, 256, 512, o).status().code(), StatusCode::kInvalidArgument);
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  int64_t touched = 0;
  for (uint16_t v : dev.result(&touched)) ASSERT_EQ(v, 0xA5A5);
  EXPECT_EQ(touched, 0);
  // M == 0 launches nothing and succeeds.
  GemmData e = make_integer_data(0, 256, 512, rng);
  DeviceGemm empty(e, 256, 0, true);  // row-major scales: positive strides at M = 0
  EXPECT_TRUE(run_gemm_wgmma_cuda(empty.params(), ws.data(), ws.bytes(), nullptr).ok());
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(empty.out.download_all(), std::vector<uint8_t>(empty.out.bytes(), kPoison));
}

// Row split (row_packed_weights) and its K split (row_k_split): captured once in a CUDA graph,
// replayed with new activations and activation scales written into the same buffers (the weights
// and their image unchanged): equals the twin exactly and an eager run byte for byte; a plain and a
// programmatic launch agree.
TEST(GemmWgmmaRowSplit, GraphReplayWithNewInputsEqualsEager) {
  M3_REQUIRE_WGMMA();
  for (int64_t m : {1, 16, 40}) {
    for (int form = 0; form < 4; ++form) {  // the row split / its K split (M > 32), plain / chained
      const bool ks = form >= 2, pdl = form % 2 == 1;
      if (ks && m <= 32) continue;
      const uint64_t seed = fresh_seed();
      M3_SEED_TRACE(seed);
      SCOPED_TRACE(::testing::Message() << "M " << m << " PDL " << pdl << " K split " << ks);
      Rng rng(seed);
      const int64_t n = 9856, k = 2048;
      const GemmData d1 = make_integer_data(m, n, k, rng);
      GemmData d2 = make_integer_data(m, n, k, rng);
      d2.b = d1.b;
      d2.sb = d1.sb;
      DeviceGemm dev(d1, n);
      DeviceBuffer ws = make_workspace(n, m);
      Result<size_t> bytes = gemm_wgmma_rows_packed_bytes(n, k);
      ASSERT_TRUE(bytes.ok()) << bytes.status().to_string();
      DeviceBuffer image(bytes.value(), 0);
      Result<int> ctas = gemm_wgmma_rows_ctas(n, ks);
      ASSERT_TRUE(ctas.ok()) << ctas.status().to_string();
      // (The K split's image: its default partition, row_align 4.)
      ASSERT_TRUE(gemm_wgmma_pack_weights_rows(dev.params().b, ctas.value(), image.data(),
                                               image.bytes(), nullptr, ks ? 4 : 1)
                      .ok());
      GemmWgmmaOptions o;
      o.row_packed_weights = image.data();
      o.row_packed_ctas = ctas.value();
      o.row_k_split = ks;
      o.programmatic_launch = pdl;
      cudaStream_t stream;
      M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const Status st = run_gemm_wgmma_cuda(dev.params(), ws.data(), ws.bytes(), stream, o);
      M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
      ASSERT_TRUE(st.ok()) << st.to_string();
      M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      // New inputs into the same buffers, then the replay.
      dev.a.upload(d2.a.data(), d2.a.size(), dev.shift);
      dev.sa.upload(d2.sa.data(), d2.sa.size() * 4);
      M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      int64_t touched = 0;
      const std::vector<uint16_t> replayed = dev.result(&touched);
      EXPECT_EQ(touched, 0);
      std::string report;
      EXPECT_EQ(count_bit_mismatches(replayed, cpu_gemm(d2), n, &report), 0) << report;
      dev.out.poison(kPoison);
      ASSERT_TRUE(run_gemm_wgmma_cuda(dev.params(), ws.data(), ws.bytes(), stream, o).ok());
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      EXPECT_EQ(dev.result(&touched), replayed) << "eager run differs from the replay";
      M3_CUDA_TEST_CHECK(cudaGraphExecDestroy(exec));
      M3_CUDA_TEST_CHECK(cudaGraphDestroy(graph));
      M3_CUDA_TEST_CHECK(cudaStreamDestroy(stream));
    }
  }
}

// Fp8BlockGemm::pack_weights_rows: calls with the packed weight and M <= row_split_max_m run the
// row split (the weight is poisoned after packing, so only the image can give the twin's bits);
// a larger M takes the usual path (weight intact), exact too; describe() names the row split.
TEST(GemmWgmmaRowSplit, Fp8BlockGemmRunsThePackedWeight) {
  M3_REQUIRE_WGMMA();
  for (int64_t m : {4, 16, 32, 36}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    SCOPED_TRACE(::testing::Message() << "M " << m);
    Rng rng(seed);
    const int64_t n = 9856, k = 2048;
    GemmData d = make_integer_data(m, n, k, rng);
    DeviceGemm dev(d, n);
    Fp8BlockGemmOptions o;
    o.autotune = false;
    auto r = Fp8BlockGemm::create(64, n, k, o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    std::unique_ptr<Fp8BlockGemm> gemm = std::move(r).value();
    const Status packed = gemm->pack_weights_rows(dev.params().b, nullptr);
    ASSERT_TRUE(packed.ok()) << packed.to_string();
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    EXPECT_NE(gemm->describe().find("row split"), std::string::npos) << gemm->describe();
    const bool row_split = m <= o.row_split_max_m;
    if (row_split) dev.b.poison(0x7F);  // E4M3 NaN: any read of b would show
    expect_launch_exact(gemm->run(dev.params(), nullptr), dev, cpu_gemm(d));
  }
  // Shapes the row split cannot serve are refused and change nothing.
  Fp8BlockGemmOptions o;
  o.autotune = false;
  auto r = Fp8BlockGemm::create(16, 256, 8320, o);  // K 8320 > 8192
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  DeviceBuffer wide(256 * 8320, 0);
  const TensorView b =
      TensorView::contiguous(wide.data(), DType::kE4M3, {256, 8320}, Device::cuda(0));
  EXPECT_EQ(r.value()->pack_weights_rows(b, nullptr).code(), StatusCode::kUnsupported);
  EXPECT_EQ(r.value()->describe().find("row split"), std::string::npos);
}

// Fp8BlockGemm::run_row_split with a K-split image (session 25, GemmRowImage::ks_data,
// Fp8BlockGemmOptions::row_k_split_min_m 33; Fp8BlockGemm takes M % 4 == 0): M 36 / 48 / 64 run
// the K split over it, M 32 the row split, and where the K split cannot serve the shape (K 8192 >
// 6400) the row split too; exact against the twin with the weight itself poisoned, plain and with
// PDL.
// Session 26: K-split images of the aligned partition (GemmRowImage::ks_row_align 4, the default)
// and of the plain one.
TEST(GemmWgmmaRowSplit, Fp8BlockGemmRowSplitWithKSplitImage) {
  M3_REQUIRE_WGMMA();
  for (const int align : {1, 4}) {
    for (const int64_t k : {2048, 8192}) {
      const int64_t n = k == 2048 ? 9856 : 640;
      Fp8BlockGemmOptions o;
      o.autotune = false;
      o.row_split_max_m = 64;
      o.row_k_split_min_m = 33;
      auto r = Fp8BlockGemm::create(64, n, k, o);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      std::unique_ptr<Fp8BlockGemm> gemm = std::move(r).value();
      for (int64_t m : {32, 36, 48, 64}) {
        const uint64_t seed = fresh_seed();
        M3_SEED_TRACE(seed);
        SCOPED_TRACE(::testing::Message() << "M " << m << " K " << k << " K-split align " << align);
        Rng rng(seed);
        GemmData d = make_integer_data(m, n, k, rng);
        DeviceGemm dev(d, n);
        Result<size_t> bytes = gemm_wgmma_rows_packed_bytes(n, k);
        ASSERT_TRUE(bytes.ok());
        Result<int> ctas = gemm_wgmma_rows_ctas(n), ks_ctas = gemm_wgmma_rows_ctas(n, true);
        ASSERT_TRUE(ctas.ok() && ks_ctas.ok());
        DeviceBuffer image(bytes.value(), 0), ks_image(bytes.value(), 0);
        ASSERT_TRUE(gemm_wgmma_pack_weights_rows(dev.params().b, ctas.value(), image.data(),
                                                 image.bytes(), nullptr, 1)
                        .ok());
        ASSERT_TRUE(gemm_wgmma_pack_weights_rows(dev.params().b, ks_ctas.value(), ks_image.data(),
                                                 ks_image.bytes(), nullptr, align)
                        .ok());
        M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
        dev.b.poison(0x7F);  // E4M3 NaN: any read of b would show
        const GemmRowImage img{image.data(), ctas.value(), ks_image.data(), ks_ctas.value(), align};
        for (bool pdl : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "PDL " << pdl);
          dev.out.poison(kPoison);
          expect_launch_exact(gemm->run_row_split(dev.params(), img, pdl, nullptr), dev,
                              cpu_gemm(d));
        }
      }
    }
  }
}

// Row split: small shapes for compute-sanitizer (memcheck / racecheck), both CTA shapes, every n,
// ring stages reused (K 4096: 32 K blocks, 8-32 stages' worth through rings of 3-11), exact
// against the twin.
TEST(GemmWgmmaRowSplit, SanitizerSmall) {
  M3_REQUIRE_WGMMA();
  for (int ctas : {0, 1}) {  // two CTAs of one consumer warpgroup per SM, one CTA of two
    for (int64_t m : {1, 9, 17, 64}) {
      const uint64_t seed = fresh_seed();
      M3_SEED_TRACE(seed);
      SCOPED_TRACE(::testing::Message() << "M " << m << " ctas/SM " << ctas);
      Rng rng(seed);
      const Case c{m, 640, 4096, 0, 0, false, ctas, 4, 0, true, 0, false, 1, false, 0, false, true};
      GemmData d = make_integer_data(c.m, c.n, c.k, rng);
      DeviceGemm dev(d, c.n);
      const std::vector<uint16_t> got = run_twice(dev, c);
      std::string report;
      EXPECT_EQ(count_bit_mismatches(got, cpu_gemm(d), c.n, &report), 0) << report;
    }
  }
}

// Row split at M > 32 (token-major form): small shapes for compute-sanitizer (memcheck /
// racecheck), both CTA shapes, 1 and 2 K blocks per stage, rings reused (K 4096), exact against
// the twin.
TEST(GemmWgmmaRowSplit, SanitizerSmallManyTokens) {
  M3_REQUIRE_WGMMA();
  for (int ctas : {0, 1}) {
    for (int burst : {0, 1}) {
      if (ctas == 1 && burst != 0) continue;  // (two warpgroups: the default only)
      for (int64_t m : {33, 64}) {
        const uint64_t seed = fresh_seed();
        M3_SEED_TRACE(seed);
        SCOPED_TRACE(::testing::Message()
                     << "M " << m << " ctas/SM " << ctas << " burst " << burst);
        Rng rng(seed);
        const Case c{m,    640, 4096,  0, 0,     false, ctas,  4,   burst,
                     true, 0,   false, 1, false, 0,     false, true};
        GemmData d = make_integer_data(c.m, c.n, c.k, rng);
        DeviceGemm dev(d, c.n);
        const std::vector<uint16_t> got = run_twice(dev, c);
        std::string report;
        EXPECT_EQ(count_bit_mismatches(got, cpu_gemm(d), c.n, &report), 0) << report;
      }
    }
  }
}

// Row split, token-major outputs as bf16 pairs (session 22): small shapes for
// compute-sanitizer (memcheck / racecheck), both CTA shapes, padded outputs, rings reused (K
// 4096), exact against the twin.
TEST(GemmWgmmaRowSplit, SanitizerSmallPairs) {
  M3_REQUIRE_WGMMA();
  for (int ctas : {0, 1}) {  // two CTAs of one warpgroup per SM, one CTA of two
    for (int64_t m : {1, 17, 33, 64}) {
      const uint64_t seed = fresh_seed();
      M3_SEED_TRACE(seed);
      SCOPED_TRACE(::testing::Message() << "M " << m << " ctas/SM " << ctas);
      Rng rng(seed);
      Case c{m, 640, 4096, 8, 0, false, ctas, 4, 0, true, 0, false, 1, false, 0, false, true};
      expect_exact_vs_twin(c, rng);
    }
  }
}

// Row K split (session 23): small shapes for compute-sanitizer (memcheck / racecheck), padded
// tokens and outputs, rings reused (K 4096: 16 K blocks per half), exact against the twin.
// Session 26: both partitions (the aligned one: at N 640 pairs of 4 / 8 rows, half 1 without
// columns; the plain one).
TEST(GemmWgmmaRowSplit, SanitizerSmallKSplit) {
  M3_REQUIRE_WGMMA();
  for (int align : {4, 1}) {
    for (int64_t m : {33, 50, 64}) {
      const uint64_t seed = fresh_seed();
      M3_SEED_TRACE(seed);
      SCOPED_TRACE(::testing::Message() << "M " << m << " K split align " << align);
      Rng rng(seed);
      Case c{m, 640, 4096, 8, 0, false, 0, 4, 0, true, 0, false, 1, false, 0, false, true};
      c.k_split = true;
      c.ks_align = align;
      expect_exact_vs_twin(c, rng);
    }
  }
}

// The K split's edges (session 25: the fold by predicate and the epilogue's bf16 pairs by
// cvt.rn.bf16x2): exact against the twin on fused width (pairs of 74-75 rows starting on odd and
// even rows, straddling weight-scale blocks), padded outputs, padded tokens and two activation
// boxes (M 33 / 47 / 57 / 63), 2 to 5 rows per pair (half 1 without columns), images for 100 /
// 200 pairs (61-62 and 30-31 rows), K blocks 1 / 3 / 9 / 13 (partial stages, half 1 idle), PDL.
// Session 26: every case over both partitions (the aligned one, the default: pairs of 72 / 76 rows
// at N 9856, 60 / 64 and 28 / 32 rows over 100 / 200 pairs, 4 / 8 at N 640, the plain partition
// at N 384 (96 runs of 4 rows, fewer than the pairs); the plain one).
TEST(GemmWgmmaRowSplit, KSplitEdges) {
  M3_REQUIRE_WGMMA();
  auto ks = [](int64_t m, int64_t n, int64_t k, int64_t ld_pad, bool pdl, int row_ctas) {
    Case c{m, n, k, ld_pad, 0, false, 0, 4, 0, true, 0, pdl};
    c.rows = true;
    c.k_split = true;
    c.row_ctas = row_ctas;
    return c;
  };
  for (int align : {4, 1}) {
    for (Case c : {ks(64, 9856, 6144, 0, false, 0), ks(64, 9856, 2048, 8, true, 0),
                   ks(33, 9856, 1152, 16, false, 0), ks(47, 9856, 2048, 8, true, 0),
                   ks(57, 6144, 1664, 0, false, 100), ks(63, 6144, 1152, 16, true, 200),
                   ks(50, 384, 128, 16, false, 0), ks(40, 640, 384, 8, false, 0)}) {
      c.ks_align = align;
      const uint64_t seed = fresh_seed();
      M3_SEED_TRACE(seed);
      SCOPED_TRACE(describe(c));
      Rng rng(seed);
      expect_exact_vs_twin(c, rng);
    }
  }
}

// The K split with programmatic launch (session 25's fold and epilogue): small shapes for
// compute-sanitizer (memcheck / racecheck), rings reused (K 4096), padded tokens and outputs, the
// fused width at K 1152 (pairs of 74-75 rows), exact against the twin.
// Session 26: both partitions (see SanitizerSmallKSplit).
TEST(GemmWgmmaRowSplit, SanitizerSmallKSplitPdl) {
  M3_REQUIRE_WGMMA();
  for (int align : {4, 1}) {
    for (const int64_t n : {640, 9856}) {
      for (int64_t m : {33, 64}) {
        const uint64_t seed = fresh_seed();
        M3_SEED_TRACE(seed);
        SCOPED_TRACE(::testing::Message() << "M " << m << " N " << n << " K split align " << align);
        Rng rng(seed);
        Case c{m,    n, n == 640 ? 4096 : 1152, 8, 0, false, 0, 4, 0, true, 0, true, 1, false, 0,
               false, true};
        c.k_split = true;
        c.ks_align = align;
        expect_exact_vs_twin(c, rng);
      }
    }
  }
}

// Row split and its K split with programmatic launch and early stages (session 24): small shapes
// for compute-sanitizer (memcheck / racecheck), every n, the default and one early stage, rings
// reused (K 4096), padded outputs, exact against the twin.
TEST(GemmWgmmaRowSplit, SanitizerSmallEarlyStages) {
  M3_REQUIRE_WGMMA();
  for (int64_t m : {1, 9, 17, 33, 64}) {
    for (int early : {0, 1}) {
      const uint64_t seed = fresh_seed();
      M3_SEED_TRACE(seed);
      SCOPED_TRACE(::testing::Message() << "M " << m << " early stages " << early);
      Rng rng(seed);
      Case c{m, 640, 4096, 8, 0, false, 0, 4, 0, true, 0, true, 1, false, 0, false, true};
      c.early = early;
      c.k_split = m == 64 && early == 1;
      expect_exact_vs_twin(c, rng);
    }
  }
}

// Row split rejections: with cluster_split or packed_weights, a misaligned image, a CTA count
// missing, above N or with more than 40 rows per CTA, N beyond 40 rows per CTA, K beyond 8192, bad
// pack calls; nothing written.
TEST(GemmWgmmaRowSplit, RejectedCallsWriteNothing) {
  M3_REQUIRE_WGMMA();
  Rng rng(fresh_seed());
  GemmData d = make_integer_data(8, 256, 512, rng);
  DeviceGemm dev(d, 256);
  DeviceBuffer ws = make_workspace(256, 8);
  DeviceBuffer image(256 * 512, 0);
  const GemmParams p = dev.params();
  Result<int> rc = gemm_wgmma_rows_ctas(256);
  ASSERT_TRUE(rc.ok()) << rc.status().to_string();
  const int ctas = rc.value();
  GemmWgmmaOptions bad;
  bad.row_packed_weights = image.data();
  bad.row_packed_ctas = ctas;
  bad.cluster_split = 2;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  bad = {};
  bad.row_packed_weights = image.data();
  bad.row_packed_ctas = ctas;
  bad.packed_weights = image.data();
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  bad = {};
  bad.row_packed_weights = static_cast<uint8_t*>(image.data()) + 8;
  bad.row_packed_ctas = ctas;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  // The CTA count: required, at most N, at most 40 rows per CTA (6 CTAs: 43 rows).
  for (int n_ctas : {0, -1, 257}) {
    bad = {};
    bad.row_packed_weights = image.data();
    bad.row_packed_ctas = n_ctas;
    EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
              StatusCode::kInvalidArgument)
        << n_ctas;
    EXPECT_EQ(
        gemm_wgmma_pack_weights_rows(p.b, n_ctas, image.data(), image.bytes(), nullptr, 1).code(),
        StatusCode::kInvalidArgument)
        << n_ctas;
  }
  bad = {};
  bad.row_packed_weights = image.data();
  bad.row_packed_ctas = 6;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kUnsupported);
  // The image itself serves up to 76 rows per CTA (the K split's pairs): 3 CTAs (86 rows) no;
  // the K split over 3 pairs neither, over 6 (43 rows) it runs (below, with the K split's own
  // rejections).
  EXPECT_EQ(gemm_wgmma_pack_weights_rows(p.b, 3, image.data(), image.bytes(), nullptr, 1).code(),
            StatusCode::kUnsupported);
  bad.row_k_split = true;
  bad.row_packed_ctas = 3;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kUnsupported);
  bad.row_packed_ctas = 6;
  bad.burst = 4;  // (the K split: 2 K blocks per stage)
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  bad.burst = 0;  // (M 8: the K split serves M 33-64)
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kUnsupported);
  bad.burst = 1;  // (the K split: 2 K blocks per stage)
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  bad.burst = 0;
  bad.row_k_split_align = 2;  // (the K split's partitions: 1 or 4)
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  bad.row_k_split_align = 4;
  EXPECT_EQ(gemm_wgmma_pack_weights_rows(p.b, 6, image.data(), image.bytes(), nullptr, 2).code(),
            StatusCode::kInvalidArgument);
  {
    // K 6528 (51 K blocks: 27 in half 0): beyond what a half stages.
    GemmData wide = make_integer_data(40, 256, 6528, rng);
    DeviceGemm dwide(wide, 256);
    DeviceBuffer iwide(static_cast<size_t>(256 * 6528), 0);
    GemmWgmmaOptions o;
    o.row_packed_weights = iwide.data();
    o.row_packed_ctas = 6;
    o.row_k_split = true;
    EXPECT_EQ(run_gemm_wgmma_cuda(dwide.params(), ws.data(), ws.bytes(), nullptr, o).code(),
              StatusCode::kUnsupported);
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    int64_t touched = 0;
    for (uint16_t v : dwide.result(&touched)) ASSERT_EQ(v, 0xA5A5);
  }
  EXPECT_EQ(gemm_wgmma_rows_supported(256, 6528, true).code(), StatusCode::kUnsupported);
  EXPECT_TRUE(gemm_wgmma_rows_supported(256, 6400, true).ok());
  EXPECT_EQ(gemm_wgmma_rows_ctas(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(gemm_wgmma_pack_weights_rows(p.b, ctas, image.data(), 64, nullptr, 1).code(),
            StatusCode::kInvalidArgument);  // too small
  EXPECT_EQ(gemm_wgmma_pack_weights_rows(p.b, ctas, static_cast<uint8_t*>(image.data()) + 8,
                                         image.bytes() - 8, nullptr, 1)
                .code(),
            StatusCode::kInvalidArgument);  // misaligned
  EXPECT_EQ(gemm_wgmma_rows_packed_bytes(200, 512).status().code(), StatusCode::kInvalidArgument);
  bad = {};
  bad.row_packed_weights = image.data();
  bad.row_packed_ctas = ctas;
  bad.burst = 3;  // K blocks per stage: 1, 2 or 4
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  {
    // Four K blocks per stage at n = 64: two stages do not fit.
    GemmData d64 = make_integer_data(64, 256, 512, rng);
    DeviceGemm dev64(d64, 256);
    DeviceBuffer ws64 = make_workspace(256, 64);
    GemmWgmmaOptions o;
    o.row_packed_weights = image.data();
    o.row_packed_ctas = ctas;
    o.burst = 4;
    EXPECT_EQ(run_gemm_wgmma_cuda(dev64.params(), ws64.data(), ws64.bytes(), nullptr, o).code(),
              StatusCode::kUnsupported);
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    int64_t touched = 0;
    for (uint16_t v : dev64.result(&touched)) ASSERT_EQ(v, 0xA5A5);
  }
  const int sms = testing::current_device_sms();
  {
    // N = 41 rows per CTA (rounded up to 128): unsupported, nothing written.
    const int64_t n = (41 * 2 * sms + 127) / 128 * 128;
    GemmData big = make_integer_data(1, n, 128, rng);
    DeviceGemm dbig(big, n);
    DeviceBuffer wbig = make_workspace(n, 1);
    DeviceBuffer ibig(static_cast<size_t>(n * 128), 0);
    GemmWgmmaOptions o;
    o.row_packed_weights = ibig.data();
    o.row_packed_ctas = 2 * sms;
    EXPECT_EQ(run_gemm_wgmma_cuda(dbig.params(), wbig.data(), wbig.bytes(), nullptr, o).code(),
              StatusCode::kUnsupported);
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    int64_t touched = 0;
    for (uint16_t v : dbig.result(&touched)) ASSERT_EQ(v, 0xA5A5);
  }
  {
    GemmData wide = make_integer_data(1, 256, 8320, rng);  // K 8320: 65 K blocks
    DeviceGemm dwide(wide, 256);
    DeviceBuffer iwide(static_cast<size_t>(256 * 8320), 0);
    GemmWgmmaOptions o;
    o.row_packed_weights = iwide.data();
    o.row_packed_ctas = ctas;
    EXPECT_EQ(run_gemm_wgmma_cuda(dwide.params(), ws.data(), ws.bytes(), nullptr, o).code(),
              StatusCode::kUnsupported);
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    int64_t touched = 0;
    for (uint16_t v : dwide.result(&touched)) ASSERT_EQ(v, 0xA5A5);
  }
  // Early stages (session 24): not negative.
  bad = {};
  bad.row_packed_weights = image.data();
  bad.row_packed_ctas = ctas;
  bad.programmatic_launch = true;
  bad.row_early_stages = -1;
  EXPECT_EQ(run_gemm_wgmma_cuda(p, ws.data(), ws.bytes(), nullptr, bad).code(),
            StatusCode::kInvalidArgument);
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  int64_t touched = 0;
  for (uint16_t v : dev.result(&touched)) ASSERT_EQ(v, 0xA5A5);
  EXPECT_EQ(touched, 0);
}

// The autotuner's per-bucket rule (pure host code: runs without a GPU).
TEST(GemmWgmmaAutoRule, PrefersWgmmaOnlyInRangeAndTwoPercentFaster) {
  EXPECT_TRUE(gemm_prefer_wgmma(24.0, 23.0, 4, 64));
  EXPECT_TRUE(gemm_prefer_wgmma(24.0, 23.0, 64, 64));
  EXPECT_FALSE(gemm_prefer_wgmma(24.0, 23.0, 128, 64));  // bucket above the auto range
  EXPECT_FALSE(gemm_prefer_wgmma(24.0, 23.0, 8, 4));
  EXPECT_FALSE(gemm_prefer_wgmma(24.0, 23.0, 4, 0));    // auto off
  EXPECT_FALSE(gemm_prefer_wgmma(24.0, 23.6, 32, 64));  // 1.7 % faster: below the margin
  EXPECT_TRUE(gemm_prefer_wgmma(24.0, 23.5, 32, 64));   // 2.1 % faster
  EXPECT_FALSE(gemm_prefer_wgmma(24.0, 24.0, 32, 64));
  EXPECT_FALSE(gemm_prefer_wgmma(23.0, 24.0, 32, 64));
  EXPECT_FALSE(gemm_prefer_wgmma(24.0, -1.0, 4, 64));  // wgmma not measured
  EXPECT_FALSE(gemm_prefer_wgmma(-1.0, 10.0, 4, 64));  // cuBLASLt not measured
  EXPECT_FALSE(gemm_prefer_wgmma(24.0, 0.0, 4, 64));
  EXPECT_FALSE(gemm_prefer_wgmma(-1.0, 10.0, 16, 64));
  EXPECT_GE(kGemmWgmmaAutoMaxM, 0);
  EXPECT_LE(kGemmWgmmaAutoMaxM, kGemmWgmmaMaxM);
}

// Up to kGemmWgmmaTieMaxM the rule is reversed: the wgmma kernel unless cuBLASLt is at least
// kGemmWgmmaTieMargin (5 %) faster.
TEST(GemmWgmmaAutoRule, SmallBucketsPreferWgmmaUnlessCublasLtFivePercentFaster) {
  EXPECT_EQ(kGemmWgmmaTieMaxM, 16);
  EXPECT_TRUE(gemm_prefer_wgmma(24.0, 24.0, 4, 64));    // tie
  EXPECT_TRUE(gemm_prefer_wgmma(24.0, 23.6, 16, 64));   // wgmma faster
  EXPECT_TRUE(gemm_prefer_wgmma(23.0, 24.0, 4, 64));    // cuBLASLt 4.2 % faster: within the margin
  EXPECT_FALSE(gemm_prefer_wgmma(22.7, 24.0, 8, 64));   // cuBLASLt 5.4 % faster
  EXPECT_FALSE(gemm_prefer_wgmma(24.0, 24.0, 16, 8));   // outside the auto range
  EXPECT_FALSE(gemm_prefer_wgmma(24.0, 24.0, 32, 64));  // above the tie range: 2 % rule
}

// Auto mode (wgmma_auto_max_m = 64, M3ATTN_GEMM_PATH unset): the autotuner times the wgmma kernel
// per M bucket and keeps it where faster; whatever it chose must match the twin bit for bit on
// integer inputs.
TEST(GemmWgmmaAuto, AutotunerChoiceMatchesTwin) {
  M3_REQUIRE_WGMMA();
  const char* old = std::getenv("M3ATTN_GEMM_PATH");
  const std::string saved = old ? old : "";
  unsetenv("M3ATTN_GEMM_PATH");
  Fp8BlockGemmOptions o;  // defaults: autotune on, wgmma_max_m = -1
  o.autotune_budget_ms = 1500;
  o.wgmma_auto_max_m = 64;
  auto gemm = make_gemm(64, kN2, kHidden, o);
  if (old) setenv("M3ATTN_GEMM_PATH", saved.c_str(), 1);
  ASSERT_NE(gemm, nullptr);
  EXPECT_EQ(gemm->wgmma_max_m(), kGemmWgmmaDefaultMaxM);
  EXPECT_EQ(gemm->wgmma_auto_max_m(), 64);
  const std::string text = gemm->describe();
  std::printf("[ INFO     ] auto mode:\n%s", text.c_str());
  EXPECT_NE(text.find("autotuned candidate for M <= 64"), std::string::npos) << text;
  EXPECT_NE(text.find("replayed: cuBLASLt"), std::string::npos) << text;
  for (int64_t m : {4, 16, 64}) {
    SCOPED_TRACE(::testing::Message() << "M " << m << ": " << gemm->algorithm_for(m));
    std::printf("[ INFO     ] auto mode M %lld: %s\n", static_cast<long long>(m),
                gemm->algorithm_for(m).c_str());
    expect_object_exact(*gemm, m, kN2, kHidden);
  }
}

// M3ATTN_GEMM_PATH resolves wgmma_max_m = -1 (the default) at creation; explicit values win.
TEST(GemmWgmmaRules, EnvironmentSelectsThePath) {
  M3_REQUIRE_WGMMA();
  const char* old = std::getenv("M3ATTN_GEMM_PATH");
  const std::string saved = old ? old : "";
  Fp8BlockGemmOptions dflt;
  dflt.autotune = false;
  auto max_m_with = [&](const char* env, const Fp8BlockGemmOptions& o, int64_t max_m) -> int64_t {
    setenv("M3ATTN_GEMM_PATH", env, 1);
    auto r = Fp8BlockGemm::create(max_m, 256, 512, o);
    if (!r.ok()) return -100 - static_cast<int>(r.status().code());
    return r.value()->wgmma_max_m();
  };
  EXPECT_EQ(max_m_with("wgmma", dflt, 256), 64);
  EXPECT_EQ(max_m_with("wgmma", dflt, 5), 8);  // capped at the padded max_m
  EXPECT_EQ(max_m_with("cublaslt", dflt, 256), 0);
  EXPECT_EQ(max_m_with("", dflt, 256), kGemmWgmmaDefaultMaxM);
  EXPECT_EQ(max_m_with("bogus", dflt, 256), -100 - static_cast<int>(StatusCode::kInvalidArgument));
  EXPECT_EQ(max_m_with("cublaslt", wgmma_options(), 256), 64);  // explicit option wins
  EXPECT_EQ(max_m_with("auto", dflt, 256), kGemmWgmmaDefaultMaxM);
  // The auto range: "auto" opens it to 64 when autotuning is on; explicit values win; no autotune,
  // no auto choice.
  auto auto_with = [&](const char* env, const Fp8BlockGemmOptions& o) -> int64_t {
    setenv("M3ATTN_GEMM_PATH", env, 1);
    auto r = Fp8BlockGemm::create(256, 256, 512, o);
    if (!r.ok()) return -100 - static_cast<int>(r.status().code());
    return r.value()->wgmma_auto_max_m();
  };
  Fp8BlockGemmOptions tuned;
  tuned.autotune_budget_ms = 50;
  EXPECT_EQ(auto_with("auto", dflt), 0);
  EXPECT_EQ(auto_with("auto", tuned), 64);
  EXPECT_EQ(auto_with("", tuned), kGemmWgmmaAutoMaxM);
  EXPECT_EQ(auto_with("wgmma", tuned), 0);
  Fp8BlockGemmOptions tuned8 = tuned;
  tuned8.wgmma_auto_max_m = 8;
  EXPECT_EQ(auto_with("", tuned8), 8);
  EXPECT_EQ(auto_with("auto", tuned8), 8);
  tuned8.wgmma_auto_max_m = 65;
  EXPECT_EQ(auto_with("", tuned8), -100 - static_cast<int>(StatusCode::kInvalidArgument));
  if (old) {
    setenv("M3ATTN_GEMM_PATH", saved.c_str(), 1);
  } else {
    unsetenv("M3ATTN_GEMM_PATH");
  }
}

}  // namespace
}  // namespace m3attn
