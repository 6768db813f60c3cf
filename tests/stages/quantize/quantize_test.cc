// CPU twin of the activation quantization (SPEC section 2) and its host validation.
#include "stages/quantize/quantize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "support/rejection.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::fresh_seed;
using testing::Rng;

// Distance between adjacent E4M3 values around |v| (v already within [-448, 448]).
double e4m3_step_at(double v) {
  const double a = std::fabs(v);
  if (a < std::ldexp(1.0, -6)) return std::ldexp(1.0, -9);  // subnormal grid
  int e = 0;
  std::frexp(a, &e);                  // a in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 1 - 3);  // 3 mantissa bits
}

// Buffers of one quantize call, with room around them that must stay untouched.
struct QuantCase {
  int64_t rows, m_pad, k, in_row_stride;
  bool scales_row_fastest;  // scales stored [K/128][M_pad] (stride (1, M_pad)) vs [M_pad][K/128]
  Tensor in;                // bf16 [rows, in_row_stride]
  Tensor out;               // e4m3 [m_pad + 2, k]: row m_pad and m_pad + 1 are guards
  Tensor scales;            // f32, twice the needed elements: every other slot is a guard

  QuantCase(int64_t rows_, int64_t m_pad_, int64_t k_, int64_t pad, bool row_fastest)
      : rows(rows_),
        m_pad(m_pad_),
        k(k_),
        in_row_stride(k_ + pad),
        scales_row_fastest(row_fastest),
        in(DType::kBF16, {rows_, k_ + pad}),
        out(DType::kE4M3, {m_pad_ + 2, k_}),
        scales(DType::kF32, {2 * m_pad_ * (k_ / 128) + 2}) {
    out.fill_bytes(0x5a);
    scales.fill_bytes(0xc3);
  }

  QuantizeParams params() const {
    QuantizeParams p;
    p.rows = rows;
    p.in = TensorView::strided(const_cast<void*>(in.data()), DType::kBF16, {rows, k},
                               {in_row_stride, 1});
    p.out = TensorView::contiguous(const_cast<void*>(out.data()), DType::kE4M3, {m_pad, k});
    const int64_t kb = k / 128;
    // Strides doubled so that the odd float slots between scales are guards.
    p.scales = scales_row_fastest ? TensorView::strided(const_cast<void*>(scales.data()),
                                                        DType::kF32, {m_pad, kb}, {2, 2 * m_pad})
                                  : TensorView::strided(const_cast<void*>(scales.data()),
                                                        DType::kF32, {m_pad, kb}, {2 * kb, 2});
    return p;
  }
  float scale(int64_t m, int64_t kb) const {
    const QuantizeParams p = params();
    return scales.ptr<float>()[m * p.scales.stride[0] + kb * p.scales.stride[1]];
  }
  uint16_t x(int64_t m, int64_t i) const { return in.ptr<uint16_t>()[m * in_row_stride + i]; }
  uint8_t q(int64_t m, int64_t i) const { return out.ptr<uint8_t>()[m * k + i]; }
};

void fill_input(QuantCase& c, Rng& rng) {
  uint16_t* x = c.in.ptr<uint16_t>();
  for (int64_t m = 0; m < c.rows; ++m) {
    for (int64_t kb = 0; kb < c.k / 128; ++kb) {
      // Blocks of very different magnitudes, so that one scale per block matters.
      const float mag = std::ldexp(1.0f, static_cast<int>(rng.integer(-20, 20)));
      for (int i = 0; i < 128; ++i)
        x[m * c.in_row_stride + kb * 128 + i] = float_to_bf16(rng.normal(0.0f, mag));
    }
  }
}

// Checks every block of every valid row against the contract, and the padding rows and guards.
void check_case(const QuantCase& c) {
  const int64_t blocks = c.k / 128;
  int64_t checked = 0;
  for (int64_t m = 0; m < c.rows; ++m) {
    for (int64_t kb = 0; kb < blocks; ++kb) {
      float amax = 0.0f;
      for (int i = 0; i < 128; ++i)
        amax = std::max(amax, std::fabs(bf16_to_float(c.x(m, kb * 128 + i))));
      const float scale = c.scale(m, kb);
      if (amax == 0.0f) {
        ASSERT_EQ(scale, 1.0f) << "zero block row " << m << " block " << kb;
      } else {
        ASSERT_EQ(scale, amax / 448.0f) << "row " << m << " block " << kb;
      }
      for (int i = 0; i < 128; ++i) {
        const int64_t col = kb * 128 + i;
        const double v = static_cast<double>(bf16_to_float(c.x(m, col))) / scale;
        const uint8_t code = c.q(m, col);
        ASSERT_FALSE(e4m3_is_nan(code)) << "row " << m << " col " << col;
        const double deq = e4m3_to_float(code);
        // Rounding to nearest: at most half a step away (448 itself is exact, so the saturation
        // of values a hair above 448 by the fp32 division stays within the bound too).
        ASSERT_LE(std::fabs(deq - v), 0.5 * e4m3_step_at(v) * (1 + 1e-6))
            << "row " << m << " col " << col << " x/scale " << v << " code 0x" << std::hex
            << int{code};
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, c.rows * c.k);
  for (int64_t m = c.rows; m < c.m_pad; ++m) {
    for (int64_t kb = 0; kb < blocks; ++kb) EXPECT_EQ(c.scale(m, kb), 1.0f) << "pad row " << m;
    for (int64_t i = 0; i < c.k; ++i) ASSERT_EQ(c.q(m, i), 0) << "pad row " << m << " col " << i;
  }
  // Guard rows after the output and guard slots between the scales.
  for (int64_t i = c.m_pad * c.k; i < (c.m_pad + 2) * c.k; ++i)
    ASSERT_EQ(c.out.ptr<uint8_t>()[i], 0x5a) << "output guard byte " << i;
  const QuantizeParams p = c.params();
  std::vector<bool> used(static_cast<size_t>(c.scales.numel()), false);
  for (int64_t m = 0; m < c.m_pad; ++m)
    for (int64_t kb = 0; kb < blocks; ++kb)
      used[static_cast<size_t>(m * p.scales.stride[0] + kb * p.scales.stride[1])] = true;
  const uint8_t* sbytes = c.scales.ptr<uint8_t>();
  for (int64_t e = 0; e < c.scales.numel(); ++e) {
    if (used[static_cast<size_t>(e)]) continue;
    for (int b = 0; b < 4; ++b) ASSERT_EQ(sbytes[e * 4 + b], 0xc3) << "scale guard " << e;
  }
}

TEST(Quantize, RandomBlocksBothScaleLayouts) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (bool row_fastest : {false, true}) {
    QuantCase c(/*rows=*/7, /*m_pad=*/8, /*k=*/384, /*pad=*/72, row_fastest);
    fill_input(c, rng);
    ASSERT_TRUE(run_quantize_cpu(c.params()).ok());
    check_case(c);
  }
}

TEST(Quantize, ZeroBlocksTinyAndSaturatingValues) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  QuantCase c(5, 5, 256, 0, false);
  fill_input(c, rng);
  uint16_t* x = c.in.ptr<uint16_t>();
  for (int i = 0; i < 128; ++i) x[1 * c.in_row_stride + 128 + i] = 0;  // an all-zero block
  for (int i = 0; i < 128; ++i)                                        // +-0 mixed
    x[2 * c.in_row_stride + i] = (i % 2) ? 0x8000 : 0x0000;
  x[3 * c.in_row_stride + 5] = 0x0001;                  // one bf16 subnormal
  x[4 * c.in_row_stride + 7] = float_to_bf16(3.0e38f);  // near the bf16 max
  ASSERT_TRUE(run_quantize_cpu(c.params()).ok());
  check_case(c);
  EXPECT_EQ(c.scale(1, 1), 1.0f);
  EXPECT_EQ(c.scale(2, 0), 1.0f);
  // The amax element maps to +-448 exactly.
  EXPECT_EQ(c.q(4, 7), 0x7e);
}

TEST(Quantize, AllRowsPaddingAndNoRows) {
  QuantCase c(0, 4, 128, 0, true);
  ASSERT_TRUE(run_quantize_cpu(c.params()).ok());
  check_case(c);
  QuantCase empty(0, 0, 128, 0, false);
  ASSERT_TRUE(run_quantize_cpu(empty.params()).ok());
  check_case(empty);
}

TEST(Quantize, NanInputGivesNanCodeAndDoesNotPoisonTheBlock) {
  QuantCase c(1, 4, 128, 0, false);
  uint16_t* x = c.in.ptr<uint16_t>();
  for (int i = 0; i < 128; ++i) x[i] = float_to_bf16(static_cast<float>(i - 64));
  x[10] = 0x7fc0;  // NaN
  ASSERT_TRUE(run_quantize_cpu(c.params()).ok());
  EXPECT_EQ(c.scale(0, 0), 64.0f / 448.0f);
  EXPECT_TRUE(e4m3_is_nan(c.q(0, 10)));
  for (int i = 0; i < 128; ++i) {
    if (i == 10) continue;
    EXPECT_FALSE(e4m3_is_nan(c.q(0, i))) << i;
  }
}

// ---- validation: every rule rejected, nothing written ----

struct Mutation {
  const char* name;
  std::vector<std::string> keywords;
  void (*apply)(QuantizeParams&);
};

TEST(QuantizeValidate, EveryRuleRejectsAndTouchesNothing) {
  const Mutation mutations[] = {
      {"negative rows", {"rows"}, [](QuantizeParams& p) { p.rows = -1; }},
      {"rows vs input", {"rows", "7"}, [](QuantizeParams& p) { p.rows = 6; }},
      {"input dtype", {"input", "bf16"}, [](QuantizeParams& p) { p.in.dtype = DType::kF32; }},
      {"input rank", {"input", "dimensions"}, [](QuantizeParams& p) { p.in.ndim = 3; }},
      {"K not multiple of 128",
       {"K", "multiple of 128"},
       [](QuantizeParams& p) { p.in.shape[1] = 200; }},
      {"input last stride", {"last stride"}, [](QuantizeParams& p) { p.in.stride[1] = 2; }},
      {"input row stride small",
       {"row stride", "smaller"},
       [](QuantizeParams& p) { p.in.stride[0] = 256; }},
      {"input row stride not 16 B",
       {"row stride", "multiple of 8"},
       [](QuantizeParams& p) { p.in.stride[0] = 388; }},
      {"input misaligned",
       {"input", "aligned"},
       [](QuantizeParams& p) { p.in.data = static_cast<uint8_t*>(p.in.data) + 2; }},
      {"output dtype", {"output", "e4m3"}, [](QuantizeParams& p) { p.out.dtype = DType::kBF16; }},
      {"output too few rows", {"output", "fewer"}, [](QuantizeParams& p) { p.out.shape[0] = 6; }},
      {"output width", {"output width"}, [](QuantizeParams& p) { p.out.shape[1] = 256; }},
      {"output not contiguous",
       {"output", "contiguous"},
       [](QuantizeParams& p) { p.out.stride[0] = 512; }},
      {"scales dtype", {"scales", "f32"}, [](QuantizeParams& p) { p.scales.dtype = DType::kBF16; }},
      {"scales shape", {"scales", "shape"}, [](QuantizeParams& p) { p.scales.shape[1] = 2; }},
      {"scales alias",
       {"scales", "alias"},
       [](QuantizeParams& p) {
         p.scales.stride[0] = 1;
         p.scales.stride[1] = 1;
       }},
      {"scales zero stride",
       {"scales", "positive"},
       [](QuantizeParams& p) { p.scales.stride[1] = 0; }},
      {"device mismatch",
       {"one device", "cuda:0"},
       [](QuantizeParams& p) { p.scales.device = Device::cuda(0); }},
      {"output overlaps input",
       {"output", "overlaps"},
       [](QuantizeParams& p) { p.out.data = p.in.data; }},
  };
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  QuantCase c(7, 8, 384, 8, false);
  fill_input(c, rng);
  ASSERT_TRUE(validate_quantize(c.params()).ok());
  const Tensor out_before = c.out.clone();
  const Tensor scales_before = c.scales.clone();
  const Tensor in_before = c.in.clone();
  for (const Mutation& m : mutations) {
    SCOPED_TRACE(m.name);
    QuantizeParams p = c.params();
    m.apply(p);
    for (const Status& st : {validate_quantize(p), run_quantize_cpu(p)})
      ASSERT_NO_FATAL_FAILURE(testing::expect_invalid_naming(st, m.keywords));
    ASSERT_EQ(std::memcmp(c.out.data(), out_before.data(), c.out.nbytes()), 0);
    ASSERT_EQ(std::memcmp(c.scales.data(), scales_before.data(), c.scales.nbytes()), 0);
    ASSERT_EQ(std::memcmp(c.in.data(), in_before.data(), c.in.nbytes()), 0);
  }
}

TEST(QuantizeValidate, CudaViewsAreRejectedByTheCpuTwin) {
  QuantCase c(1, 4, 128, 0, false);
  QuantizeParams p = c.params();
  p.in.device = p.out.device = p.scales.device = Device::cuda(0);
  EXPECT_TRUE(validate_quantize(p).ok());
  const Status st = run_quantize_cpu(p);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("CPU"), std::string::npos) << st.message();
  for (int64_t i = 0; i < c.out.nbytes(); ++i) ASSERT_EQ(c.out.ptr<uint8_t>()[i], 0x5a);
}

}  // namespace
}  // namespace m3attn
