// The cuBLASLt block-scaled FP8 GEMM (Fp8BlockGemm) against the CPU twin run_gemm_cpu.
//
// Numerics and tolerances:
//  - Integer-valued E4M3 inputs in [-3, 3] with power-of-two scales in {1/2, 1, 2}: every 128-wide
//    partial dot product is an integer of magnitude <= 128 * 9 = 1152 < 2^11, exact even in the
//    Hopper tensor core's reduced-precision accumulator (~14 significant bits); every scaled term
//    is a multiple of 1/4 and the whole sum stays below K / 128 * 1152 * 4 <= 2^18 (K <= 6144), so
//    the fp32 accumulation is exact in any order and both sides round the same exact value to bf16:
//    the outputs must be bit-identical.
//  - Random inputs: the twin forms exact per-block dot products and accumulates in fp32; the
//    device accumulates each 128-wide block in the tensor core (about 14 significant bits kept per
//    addition, so per block at most ~4 * 2^-13 of the block's sum of |products| across its four
//    k = 32 steps) and then in fp32. With S(m, n) = sum_k |a b| sa sb:
//      |G_acc - E| <= 2^-11 S,  |C_acc - E| <= K 2^-24 S <= 2^-11.4 S (K <= 6144),
//    and each side then rounds to bf16 (relative error <= 2^-8). Test bound:
//      |gpu - cpu| <= 2^-7 |cpu| + 2^-10 S,
//    which a wrong scale layout, a transposed operand or a missing block violates by orders of
//    magnitude (with random data S / |E| is ~ sqrt(K) ~ 80, so the bound is ~1-2 % of |E|).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "stages/projection/gemm_cublaslt.h"
#include "stages/projection/projection.h"
#include "stages/quantize/quantize.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::DeviceBuffer;
using testing::fresh_seed;
using testing::Rng;

constexpr uint8_t kPoison = 0xA5;
constexpr size_t kGuard = 256;

// Host operands of one GEMM: A [m, k] with token-major scales (m, kb) at m + kb * m, B [n, k] with
// row-major scales [n / 128, kb].
struct GemmData {
  int64_t m = 0, n = 0, k = 0, kb = 0;
  std::vector<uint8_t> a, b;
  std::vector<float> sa, sb;
};

GemmData make_integer_data(int64_t m, int64_t n, int64_t k, Rng& rng) {
  GemmData d;
  d.m = m, d.n = n, d.k = k, d.kb = k / 128;
  d.a.resize(static_cast<size_t>(m * k));
  d.b.resize(static_cast<size_t>(n * k));
  d.sa.resize(static_cast<size_t>(m * d.kb));
  d.sb.resize(static_cast<size_t>(n / 128 * d.kb));
  for (auto& v : d.a) v = float_to_e4m3(static_cast<float>(rng.integer(-3, 3)));
  for (auto& v : d.b) v = float_to_e4m3(static_cast<float>(rng.integer(-3, 3)));
  // Distinct per-block scales, so a transposed or shifted scale layout cannot pass.
  for (auto& v : d.sa) v = std::ldexp(1.0f, static_cast<int>(rng.integer(-1, 1)));
  for (auto& v : d.sb) v = std::ldexp(1.0f, static_cast<int>(rng.integer(-1, 1)));
  return d;
}

GemmData make_random_data(int64_t m, int64_t n, int64_t k, Rng& rng) {
  GemmData d;
  d.m = m, d.n = n, d.k = k, d.kb = k / 128;
  d.a.resize(static_cast<size_t>(m * k));
  d.b.resize(static_cast<size_t>(n * k));
  d.sa.resize(static_cast<size_t>(m * d.kb));
  d.sb.resize(static_cast<size_t>(n / 128 * d.kb));
  // Quantizer-like codes spanning the whole E4M3 range (saturating at 448).
  for (auto& v : d.a) v = float_to_e4m3(rng.normal(0.0f, 120.0f));
  for (auto& v : d.b) v = float_to_e4m3(rng.normal(0.0f, 120.0f));
  for (auto& v : d.sa) v = std::pow(10.0f, rng.uniform(-4.0f, -1.0f));
  for (auto& v : d.sb) v = std::pow(10.0f, rng.uniform(-4.0f, -2.0f));
  return d;
}

GemmParams host_params(GemmData& d, std::vector<uint16_t>& out) {
  out.assign(static_cast<size_t>(d.m * d.n), 0xffff);
  GemmParams p;
  p.a = TensorView::contiguous(d.a.data(), DType::kE4M3, {d.m, d.k});
  p.a_scales = TensorView::strided(d.sa.data(), DType::kF32, {d.m, d.kb}, {1, d.m});
  p.b = TensorView::contiguous(d.b.data(), DType::kE4M3, {d.n, d.k});
  p.b_scales = TensorView::contiguous(d.sb.data(), DType::kF32, {d.n / 128, d.kb});
  p.out = TensorView::contiguous(out.data(), DType::kBF16, {d.m, d.n});
  return p;
}

std::vector<uint16_t> cpu_gemm(GemmData& d) {
  std::vector<uint16_t> out;
  const Status st = run_gemm_cpu(host_params(d, out));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return out;
}

// S(m, n) = sum_k |a b| sa sb, in double.
std::vector<double> abs_sums(const GemmData& d) {
  std::vector<double> dec(256);
  for (int c = 0; c < 256; ++c) dec[c] = std::fabs(e4m3_to_float(static_cast<uint8_t>(c)));
  std::vector<double> s(static_cast<size_t>(d.m * d.n), 0.0);
  std::vector<double> arow(static_cast<size_t>(d.k));
  for (int64_t m = 0; m < d.m; ++m) {
    for (int64_t i = 0; i < d.k; ++i) arow[i] = dec[d.a[m * d.k + i]];
    for (int64_t n = 0; n < d.n; ++n) {
      const uint8_t* brow = &d.b[n * d.k];
      double total = 0.0;
      for (int64_t kb = 0; kb < d.kb; ++kb) {
        double part = 0.0;
        for (int64_t i = kb * 128; i < (kb + 1) * 128; ++i) part += arow[i] * dec[brow[i]];
        total += part * d.sa[m + kb * d.m] * d.sb[(n / 128) * d.kb + kb];
      }
      s[m * d.n + n] = total;
    }
  }
  return s;
}

// Device copies, with guards around the output and optional misalignment of every operand. The
// weight scales are stored with rows round_up(K / 128, 4) apart, padding slots poisoned.
struct DeviceGemm {
  int64_t m, n, k, kb, kb_row, ld_out;
  size_t shift;  // bytes added to the 256-byte aligned base of A, B and out
  DeviceBuffer a, sa, b, sb, out;

  DeviceGemm(const GemmData& d, int64_t ld_out_, size_t shift_ = 0)
      : m(d.m),
        n(d.n),
        k(d.k),
        kb(d.kb),
        kb_row(gemm_weight_scales_row_stride(d.k)),
        ld_out(ld_out_),
        shift(shift_),
        a(d.a.size() + 256),
        sa(d.sa.size() * 4 + 16),
        b(d.b.size() + 256),
        sb(static_cast<size_t>(d.n / 128 * gemm_weight_scales_row_stride(d.k)) * 4 + 16),
        out(2 * kGuard + shift_ + static_cast<size_t>(d.m * ld_out_) * 2, kPoison) {
    a.upload(d.a.data(), d.a.size(), shift);
    sa.upload(d.sa.data(), d.sa.size() * 4);
    b.upload(d.b.data(), d.b.size(), shift);
    for (int64_t r = 0; r < n / 128; ++r) sb.upload(&d.sb[r * kb], kb * 4, r * kb_row * 4);
  }

  GemmParams params() const {
    const Device dev = Device::cuda(0);
    GemmParams p;
    p.a =
        TensorView::contiguous(static_cast<uint8_t*>(a.data()) + shift, DType::kE4M3, {m, k}, dev);
    p.a_scales = gemm_activation_scales_view(static_cast<float*>(sa.data()), m, k, dev);
    p.b =
        TensorView::contiguous(static_cast<uint8_t*>(b.data()) + shift, DType::kE4M3, {n, k}, dev);
    p.b_scales = TensorView::strided(sb.data(), DType::kF32, {n / 128, kb}, {kb_row, 1}, dev);
    p.out = TensorView::strided(static_cast<uint8_t*>(out.data()) + kGuard + shift, DType::kBF16,
                                {m, n}, {ld_out, 1}, dev);
    return p;
  }

  // The [m, n] result; counts bytes outside it that are no longer poisoned.
  std::vector<uint16_t> result(int64_t* touched_outside) const {
    const std::vector<uint8_t> raw = out.download_all();
    std::vector<uint8_t> inside(raw.size(), 0);
    std::vector<uint16_t> r(static_cast<size_t>(m * n));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const size_t off = kGuard + shift + static_cast<size_t>(i * ld_out + j) * 2;
        std::memcpy(&r[i * n + j], &raw[off], 2);
        inside[off] = inside[off + 1] = 1;
      }
    }
    int64_t touched = 0;
    for (size_t i = 0; i < raw.size(); ++i) touched += !inside[i] && raw[i] != kPoison;
    *touched_outside = touched;
    return r;
  }
};

std::unique_ptr<Fp8BlockGemm> make_gemm(int64_t max_m, int64_t n, int64_t k,
                                        const Fp8BlockGemmOptions& opt = {}) {
  auto r = Fp8BlockGemm::create(max_m, n, k, opt);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (!r.ok()) return nullptr;
  return std::move(r).value();
}

int64_t count_bit_mismatches(const std::vector<uint16_t>& x, const std::vector<uint16_t>& y,
                             int64_t n, std::string* report) {
  int64_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] == y[i]) continue;
    if (bad < 6 && report)
      *report += "  [" + std::to_string(i / n) + ", " + std::to_string(i % n) + "] " +
                 std::to_string(bf16_to_float(x[i])) + " vs " +
                 std::to_string(bf16_to_float(y[i])) + "\n";
    ++bad;
  }
  return bad;
}

struct BoundReport {
  int64_t violations = 0;
  int64_t non_finite = 0;
  double worst_ratio = 0;  // max |g - c| / bound
  double worst_rel_s = 0;  // max |g - c| / S
  std::string text;
};

// |g - c| <= 2^-7 |c| + s_factor * S; g must be finite.
BoundReport check_bound(const std::vector<uint16_t>& g, const std::vector<uint16_t>& c,
                        const std::vector<double>& s, int64_t n, double s_factor) {
  BoundReport r;
  for (size_t i = 0; i < g.size(); ++i) {
    const double gv = bf16_to_float(g[i]), cv = bf16_to_float(c[i]);
    if (!std::isfinite(gv) || !std::isfinite(cv)) {
      ++r.non_finite;
      continue;
    }
    const double err = std::fabs(gv - cv);
    const double bound = std::ldexp(std::fabs(cv), -7) + s_factor * s[i];
    r.worst_ratio = std::max(r.worst_ratio, bound > 0 ? err / bound : (err > 0 ? 1e30 : 0.0));
    if (s[i] > 0) r.worst_rel_s = std::max(r.worst_rel_s, err / s[i]);
    if (err > bound || (bound == 0 && err != 0)) {
      if (r.violations < 6)
        r.text += "  [" + std::to_string(i / n) + ", " + std::to_string(i % n) + "] gpu " +
                  std::to_string(gv) + " cpu " + std::to_string(cv) + " S " + std::to_string(s[i]) +
                  "\n";
      ++r.violations;
    }
  }
  return r;
}

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
  ASSERT_TRUE(st.ok()) << st.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  int64_t touched = 0;
  const std::vector<uint16_t> got = dev.result(&touched);
  std::string report;
  EXPECT_EQ(count_bit_mismatches(got, ref, c.n, &report), 0) << report;
  EXPECT_EQ(touched, 0) << "bytes outside the [M, N] output were written";
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
  const std::vector<double> s = abs_sums(d);

  auto gemm = make_gemm(c.m, c.n, c.k);
  ASSERT_NE(gemm, nullptr);
  DeviceGemm dev(d, c.n);
  const Status st = gemm->run(dev.params(), nullptr);
  ASSERT_TRUE(st.ok()) << st.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  int64_t touched = 0;
  const std::vector<uint16_t> got = dev.result(&touched);
  const BoundReport r = check_bound(got, ref, s, c.n, std::ldexp(1.0, -10));
  int64_t identical = 0;
  for (size_t i = 0; i < got.size(); ++i) identical += got[i] == ref[i];
  std::printf(
      "[ INFO     ] M %lld N %lld K %lld: %lld of %zu outputs bit-identical to the twin, "
      "worst |gpu-cpu| / bound %.3g, worst |gpu-cpu| / S %.3g\n",
      static_cast<long long>(c.m), static_cast<long long>(c.n), static_cast<long long>(c.k),
      static_cast<long long>(identical), got.size(), r.worst_ratio, r.worst_rel_s);
  EXPECT_EQ(r.non_finite, 0);
  EXPECT_EQ(r.violations, 0) << r.text;
  EXPECT_EQ(touched, 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmGpuRandom,
                         ::testing::Values(RandomCase{4, 640, 6144}, RandomCase{16, 256, 6144},
                                           RandomCase{68, 640, 6144}, RandomCase{1024, 256, 1024},
                                           RandomCase{4, 128, 8192}));

// ---------------------------------------------------------------------------------------------
// Fused [Q|K|V|iQ|iK] (N = 9856) against the unfused pair [Q|K|V] (9216) + [iQ|iK] (640) from the
// same packed weights and scales: the halves are sub-views of the packed buffers, and the pair
// writes into the column ranges of one packed output (row stride 9856).
constexpr int64_t kN1 = 9216, kN2 = 640, kNF = kN1 + kN2, kHidden = 6144;

struct FusedRun {
  std::vector<uint16_t> fused, unfused;
  int64_t touched = 0;
};

FusedRun run_fused_and_unfused(const GemmData& d) {
  FusedRun r;
  auto fused = make_gemm(d.m, kNF, kHidden);
  auto first = make_gemm(d.m, kN1, kHidden);
  auto second = make_gemm(d.m, kN2, kHidden);
  if (!fused || !first || !second) return r;
  DeviceGemm f(d, kNF);
  DeviceGemm u(d, kNF);  // same operands; its output buffer receives the pair
  EXPECT_TRUE(fused->run(f.params(), nullptr).ok());

  GemmParams p1 = u.params(), p2 = u.params();
  p1.b.shape[0] = kN1;
  p1.b_scales.shape[0] = kN1 / 128;
  p1.out.shape[1] = kN1;
  p2.b.data = static_cast<uint8_t*>(p2.b.data) + kN1 * kHidden;
  p2.b.shape[0] = kN2;
  p2.b_scales.data =
      static_cast<float*>(p2.b_scales.data) + kN1 / 128 * gemm_weight_scales_row_stride(kHidden);
  p2.b_scales.shape[0] = kN2 / 128;
  p2.out.data = static_cast<uint16_t*>(p2.out.data) + kN1;
  p2.out.shape[1] = kN2;
  const Status s1 = first->run(p1, nullptr);
  const Status s2 = second->run(p2, nullptr);
  EXPECT_TRUE(s1.ok()) << s1.to_string();
  EXPECT_TRUE(s2.ok()) << s2.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int64_t t1 = 0, t2 = 0;
  r.fused = f.result(&t1);
  r.unfused = u.result(&t2);
  r.touched = t1 + t2;
  return r;
}

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
  const int64_t rows = 3, m_pad = 4, n = kNF, k = kHidden;
  GemmData d = make_random_data(m_pad, n, k, rng);
  DeviceGemm dev(d, n);
  DeviceBuffer d_x(static_cast<size_t>(rows * k) * 2);
  std::vector<uint16_t> x(static_cast<size_t>(rows * k));
  auto new_x = [&] {
    for (auto& v : x) v = float_to_bf16(rng.normal(0.0f, 1.0f));
    d_x.upload(x.data(), x.size() * 2);
  };
  new_x();
  const GemmParams gp = dev.params();
  QuantizeParams qd;
  qd.rows = rows;
  qd.in = TensorView::contiguous(d_x.data(), DType::kBF16, {rows, k}, Device::cuda(0));
  qd.out = gp.a;
  qd.scales = gp.a_scales;
  auto gemm = make_gemm(64, n, k);
  ASSERT_NE(gemm, nullptr);

  cudaStream_t stream;
  M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto launch = [&]() -> Status {
    M3_RETURN_IF_ERROR(run_quantize_cuda(qd, stream));
    return gemm->run(gp, stream);
  };
  // Warm-up eager call (cuBLASLt may load its kernels lazily), outside the capture.
  ASSERT_TRUE(launch().ok());
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status cap = launch();
  M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(cap.ok()) << cap.to_string();
  M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  int64_t touched = 0;
  const std::vector<uint16_t> first = dev.result(&touched);

  new_x();
  dev.out.poison(kPoison);
  M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> replay = dev.out.download_all();
  int64_t t2 = 0;
  EXPECT_NE(first, dev.result(&t2)) << "the replay did not see the new input";

  for (int rep = 0; rep < 2; ++rep) {
    dev.out.poison(kPoison);
    ASSERT_TRUE(launch().ok());
    M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(replay, dev.out.download_all()) << "eager run " << rep << " differs from the replay";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
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
    int64_t touched = 0;
    for (uint16_t v : dev.result(&touched)) ASSERT_EQ(v, 0xA5A5);
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
    int64_t touched3 = 0;
    for (uint16_t v : dev3.result(&touched3)) ASSERT_EQ(v, 0xA5A5);
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
  int64_t touched = 0;
  for (uint16_t v : dev.result(&touched)) ASSERT_EQ(v, 0xA5A5);
  EXPECT_EQ(touched, 0);
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
