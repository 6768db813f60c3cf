#include "weights/quantize_weights.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "core/numeric.h"
#include "support/test_util.h"
#include "weights/weights_test_util.h"

namespace m3attn {
namespace {

using testing::fresh_seed;
using testing::Rng;
using weights_test::poke;

// Distance between adjacent E4M3 values around magnitude a (a finite, |a| <= 448).
float e4m3_step(float a) {
  a = std::fabs(a);
  if (a < 0.015625f) return std::ldexp(1.0f, -9);
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  return std::ldexp(1.0f, e - 1 - 3);
}

// A bf16 [rows, cols] matrix whose 128x128 blocks have very different magnitudes.
Tensor varied_bf16(int64_t rows, int64_t cols, Rng& rng) {
  Tensor t(DType::kBF16, {rows, cols});
  uint16_t* p = t.ptr<uint16_t>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t block = (r / 128) * (cols / 128) + c / 128;
      const float mag = std::ldexp(1.0f, static_cast<int>(block % 7) * 5 - 15);
      p[r * cols + c] = float_to_bf16(rng.normal(0.0f, mag));
    }
  }
  return t;
}

void expect_within_half_step(const TensorView& x, const QuantizedMatrix& q) {
  const int64_t n = q.rows(), k = q.cols();
  int64_t bad = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const float xv = x.dtype == DType::kBF16
                           ? bf16_to_float(x.ptr<uint16_t>()[r * x.stride[0] + c * x.stride[1]])
                           : x.ptr<float>()[r * x.stride[0] + c * x.stride[1]];
      const float s = q.scales.ptr<float>()[(r / 128) * (k / 128) + c / 128];
      const uint8_t code = q.w.ptr<uint8_t>()[r * k + c];
      ASSERT_FALSE(e4m3_is_nan(code)) << r << ", " << c;
      const float qv = e4m3_to_float(code);
      // Half a step at the smaller of the two magnitudes (the step halves below a power of 2),
      // plus the fp32 rounding of x / s.
      const float half = 0.5f * e4m3_step(std::fmin(std::fabs(xv / s), std::fabs(qv)));
      const double err = std::fabs(static_cast<double>(xv) - static_cast<double>(qv) * s);
      if (err > (half * 1.0001 + 1e-7 * std::fabs(xv / s)) * s) {
        if (++bad < 5)
          ADD_FAILURE() << "[" << r << ", " << c << "] x " << xv << " q " << qv << " s " << s
                        << " err " << err << " > half step " << half * s;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(QuantizeBlocks, RoundTripWithinHalfAStep) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const Tensor x = varied_bf16(256, 384, rng);
  auto q = quantize_blocks_128(x.view());
  ASSERT_TRUE(q.ok()) << q.status().to_string();
  ASSERT_TRUE(q.value().validate("q").ok());
  EXPECT_EQ(q.value().scales.shape(), (std::vector<int64_t>{2, 3}));
  expect_within_half_step(x.view(), q.value());
  // scale == amax / 448 and the largest element lands on +-448.
  for (int nb = 0; nb < 2; ++nb) {
    for (int kb = 0; kb < 3; ++kb) {
      float amax = 0;
      int64_t at = 0;
      for (int r = nb * 128; r < nb * 128 + 128; ++r)
        for (int c = kb * 128; c < kb * 128 + 128; ++c) {
          const float v = std::fabs(bf16_to_float(x.ptr<uint16_t>()[r * 384 + c]));
          if (v > amax) amax = v, at = r * 384 + c;
        }
      EXPECT_EQ(q.value().scales.ptr<float>()[nb * 3 + kb], amax / 448.0f);
      EXPECT_EQ(q.value().w.ptr<uint8_t>()[at] & 0x7f, 0x7e);
    }
  }
}

TEST(QuantizeBlocks, F32AndStridedInputs) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Tensor x(DType::kF32, {128, 256});
  for (int64_t i = 0; i < x.numel(); ++i) x.ptr<float>()[i] = rng.normal(0.0f, 3.0f);
  auto q = quantize_blocks_128(x.view());
  ASSERT_TRUE(q.ok());
  expect_within_half_step(x.view(), q.value());
  // The same matrix stored transposed and viewed with swapped strides quantizes identically.
  Tensor xt(DType::kF32, {256, 128});
  for (int r = 0; r < 128; ++r)
    for (int c = 0; c < 256; ++c) xt.ptr<float>()[c * 128 + r] = x.ptr<float>()[r * 256 + c];
  auto qt = quantize_blocks_128(TensorView::strided(xt.data(), DType::kF32, {128, 256}, {1, 128}));
  ASSERT_TRUE(qt.ok());
  EXPECT_EQ(std::memcmp(qt.value().w.data(), q.value().w.data(), q.value().w.nbytes()), 0);
  EXPECT_EQ(
      std::memcmp(qt.value().scales.data(), q.value().scales.data(), q.value().scales.nbytes()), 0);
  auto back = dequantize(q.value());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back.value().shape(), x.shape());
}

TEST(QuantizeBlocks, AllZeroBlockHasScaleOne) {
  Tensor x(DType::kBF16, {128, 256});
  x.fill_bytes(0);
  poke<uint16_t>(x, 5 * 256 + 200, float_to_bf16(-3.5f));  // only block (0, 1) is non-zero
  auto q = quantize_blocks_128(x.view());
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q.value().scales.ptr<float>()[0], 1.0f);
  EXPECT_EQ(q.value().scales.ptr<float>()[1], 3.5f / 448.0f);
  for (int r = 0; r < 128; ++r)
    for (int c = 0; c < 256; ++c) {
      const uint8_t code = q.value().w.ptr<uint8_t>()[r * 256 + c];
      if (r == 5 && c == 200)
        EXPECT_EQ(code, 0xfe);
      else
        EXPECT_EQ(code & 0x7f, 0) << r << ", " << c;
    }
}

TEST(QuantizeBlocks, RejectsBadInput) {
  auto expect = [](Result<QuantizedMatrix> r, const char* needle) {
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
  };
  Tensor e4(DType::kE4M3, {128, 128});
  e4.fill_bytes(0);
  expect(quantize_blocks_128(e4.view()), "must be bf16 or f32, got e4m3");
  Tensor odd(DType::kF32, {128, 200});
  odd.fill_bytes(0);
  expect(quantize_blocks_128(odd.view()), "[128, 200] must have positive multiples of 128");
  Tensor one_d(DType::kF32, {128});
  one_d.fill_bytes(0);
  expect(quantize_blocks_128(one_d.view()), "must have 2 dimensions");
  Tensor f(DType::kF32, {128, 128});
  f.fill_bytes(0);
  poke<float>(f, 3 * 128 + 7, NAN);
  expect(quantize_blocks_128(f.view()), "weight [3, 7] is not finite");
  poke<float>(f, 3 * 128 + 7, INFINITY);
  expect(quantize_blocks_128(f.view()), "weight [3, 7] is not finite");
  poke<float>(f, 3 * 128 + 7, 0.0f);
  TensorView dev = f.view();
  dev.device = Device::cuda(0);
  expect(quantize_blocks_128(dev), "must be a host tensor");
}

TEST(RequantizeMxfp8, ExactlyRepresentableValuesSurvive) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int64_t n = 256, k = 256;
  Tensor w(DType::kE4M3, {n, k});
  Tensor s(DType::kE8M0, {n, k / 32});
  Tensor target(DType::kF32, {n, k});
  int block_exp[2][2];
  for (auto& row : block_exp)
    for (int& e : row) e = static_cast<int>(rng.integer(-12, 6));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t g = 0; g < k / 32; ++g) {
      const int be = block_exp[r / 128][(g * 32) / 128];
      const int j = static_cast<int>(rng.integer(0, 2));  // group scale 2^(be + j)
      s.ptr<uint8_t>()[r * (k / 32) + g] = static_cast<uint8_t>(127 + be + j);
      for (int64_t c = g * 32; c < g * 32 + 32; ++c) {
        uint8_t code;
        do {
          code = static_cast<uint8_t>(rng.integer(0, 255));
        } while (e4m3_is_nan(code) || std::fabs(e4m3_to_float(code)) > 448.0f / 4);
        w.ptr<uint8_t>()[r * k + c] = code;
        target.ptr<float>()[r * k + c] = std::ldexp(e4m3_to_float(code), be + j);
      }
    }
  }
  // One element per 128x128 block reaches 448 * 2^be, so the new scale is exactly 2^be.
  for (int nb = 0; nb < 2; ++nb)
    for (int kb = 0; kb < 2; ++kb) {
      const int64_t r = nb * 128 + rng.integer(0, 127), c = kb * 128 + rng.integer(0, 127);
      const int be = block_exp[nb][kb];
      const int j = s.ptr<uint8_t>()[r * (k / 32) + c / 32] - 127 - be;
      w.ptr<uint8_t>()[r * k + c] = float_to_e4m3(std::ldexp(448.0f, -j));
      target.ptr<float>()[r * k + c] = std::ldexp(448.0f, be);
    }
  auto q = requantize_mxfp8(w.view(), s.view());
  ASSERT_TRUE(q.ok()) << q.status().to_string();
  for (int nb = 0; nb < 2; ++nb)
    for (int kb = 0; kb < 2; ++kb)
      EXPECT_EQ(q.value().scales.ptr<float>()[nb * 2 + kb], std::ldexp(1.0f, block_exp[nb][kb]));
  auto back = dequantize(q.value());
  ASSERT_TRUE(back.ok());
  int64_t bad = 0;
  for (int64_t i = 0; i < n * k; ++i)
    if (back.value().ptr<float>()[i] != target.ptr<float>()[i] && ++bad < 5)
      ADD_FAILURE() << "element " << i << ": " << back.value().ptr<float>()[i] << " vs "
                    << target.ptr<float>()[i];
  EXPECT_EQ(bad, 0);
}

TEST(RequantizeMxfp8, RejectsBadInput) {
  Tensor w(DType::kE4M3, {128, 128});
  Tensor s(DType::kE8M0, {128, 4});
  w.fill_bytes(0x38);
  s.fill_bytes(127);
  ASSERT_TRUE(requantize_mxfp8(w.view(), s.view()).ok());
  auto expect = [&](const char* needle) {
    auto r = requantize_mxfp8(w.view(), s.view());
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
  };
  Tensor s_bad(DType::kE8M0, {128, 2});
  s_bad.fill_bytes(127);
  auto shape = requantize_mxfp8(w.view(), s_bad.view());
  ASSERT_FALSE(shape.ok());
  EXPECT_NE(shape.status().message().find("must have shape [128, 4]"), std::string::npos);
  auto dtype = requantize_mxfp8(w.view(), w.view());
  ASSERT_FALSE(dtype.ok());
  EXPECT_NE(dtype.status().message().find("must be e8m0"), std::string::npos);
  poke<uint8_t>(w, 9, 0x7f);
  expect("MXFP8 weight [0, 9] is NaN");
  poke<uint8_t>(w, 9, 0x38);
  poke<uint8_t>(s, 4 * 1 + 2, 0xff);
  expect("MXFP8 scale [1, 2] is the E8M0 NaN code");
  poke<uint8_t>(s, 4 * 1 + 2, 254);
  poke<uint8_t>(w, 128 + 70, 0x7e);
  expect("MXFP8 weight [1, 70] overflows fp32");
}

TEST(FromFp8Block, CopiesAsIsAndValidates) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Tensor w(DType::kE4M3, {256, 128});
  testing::fill_e4m3_normal(w, rng, 10.0f);
  Tensor s(DType::kF32, {2, 1});
  s.ptr<float>()[0] = 0.25f;
  s.ptr<float>()[1] = 0.0f;  // an all-zero block may carry scale 0
  auto q = from_fp8_block(w.view(), s.view());
  ASSERT_TRUE(q.ok()) << q.status().to_string();
  EXPECT_EQ(std::memcmp(q.value().w.data(), w.data(), w.nbytes()), 0);
  EXPECT_EQ(q.value().scales.ptr<float>()[0], 0.25f);
  auto expect = [&](const char* needle) {
    auto r = from_fp8_block(w.view(), s.view());
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
  };
  s.ptr<float>()[1] = -1.0f;
  expect("FP8 block scale [1, 0] = -1 must be finite and >= 0");
  s.ptr<float>()[1] = NAN;
  expect("FP8 block scale [1, 0]");
  s.ptr<float>()[1] = 1.0f;
  poke<uint8_t>(w, 130, 0xff);
  expect("FP8 weight [1, 2] is NaN");
  Tensor s_bad(DType::kF32, {1, 1});
  s_bad.fill_bytes(0);
  auto shape = from_fp8_block(w.view(), s_bad.view());
  ASSERT_FALSE(shape.ok());
  EXPECT_NE(shape.status().message().find("must have shape [2, 1]"), std::string::npos);
}

TEST(QuantizedMatrix, ValidateAndDequantizeReject) {
  QuantizedMatrix m{Tensor(DType::kE4M3, {128, 256}), Tensor(DType::kF32, {1, 1})};
  auto st = m.validate("w");
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("w scales must be f32 [1, 2], got f32 [1, 1]"), std::string::npos)
      << st.to_string();
  EXPECT_FALSE(dequantize(m).ok());
  QuantizedMatrix empty;
  EXPECT_FALSE(empty.validate("e").ok());
}

}  // namespace
}  // namespace m3attn
