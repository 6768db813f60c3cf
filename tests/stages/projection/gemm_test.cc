// CPU twin of the FP8 block-scaled GEMM (SPEC section 2) and its host validation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/projection/projection.h"
#include "support/rejection.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::fresh_seed;
using testing::Rng;

constexpr uint8_t kOutGuard = 0xa7;

// Buffers of one GEMM call: strided A rows, column-major A scales, transposed B scales, and an
// output whose row stride leaves guard columns that must stay untouched.
struct GemmCase {
  int64_t m, n, k, a_stride, out_stride;
  Tensor a, b, a_scales, b_scales, out;

  GemmCase(int64_t m_, int64_t n_, int64_t k_, int64_t a_pad, int64_t out_pad)
      : m(m_),
        n(n_),
        k(k_),
        a_stride(k_ + a_pad),
        out_stride(n_ + out_pad),
        a(DType::kE4M3, {m_, k_ + a_pad}),
        b(DType::kE4M3, {n_, k_}),
        a_scales(DType::kF32, {k_ / 128, m_}),        // stored [kb][m]: strides (1, M)
        b_scales(DType::kF32, {k_ / 128, n_ / 128}),  // stored [kb][nb]: strides (1, N/128)
        out(DType::kBF16, {m_, n_ + out_pad}) {
    a.fill_bytes(0x7f);  // NaN in the padding of A: a read of it would show
    out.fill_bytes(kOutGuard);
  }

  GemmParams params() const {
    GemmParams p;
    p.a = TensorView::strided(const_cast<void*>(a.data()), DType::kE4M3, {m, k}, {a_stride, 1});
    p.a_scales = TensorView::strided(const_cast<void*>(a_scales.data()), DType::kF32, {m, k / 128},
                                     {1, m > 0 ? m : 1});
    p.b = TensorView::contiguous(const_cast<void*>(b.data()), DType::kE4M3, {n, k});
    p.b_scales = TensorView::strided(const_cast<void*>(b_scales.data()), DType::kF32,
                                     {n / 128, k / 128}, {1, n / 128});
    p.out =
        TensorView::strided(const_cast<void*>(out.data()), DType::kBF16, {m, n}, {out_stride, 1});
    return p;
  }
  uint8_t& a_at(int64_t r, int64_t i) { return a.ptr<uint8_t>()[r * a_stride + i]; }
  uint8_t& b_at(int64_t r, int64_t i) { return b.ptr<uint8_t>()[r * k + i]; }
  float& sa(int64_t r, int64_t kb) { return a_scales.ptr<float>()[kb * m + r]; }
  float& sb(int64_t nb, int64_t kb) { return b_scales.ptr<float>()[kb * (n / 128) + nb]; }
  uint16_t out_at(int64_t r, int64_t c) const { return out.ptr<uint16_t>()[r * out_stride + c]; }

  void check_guards() const {
    const uint8_t* bytes = out.ptr<uint8_t>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = n * 2; c < out_stride * 2; ++c)
        ASSERT_EQ(bytes[r * out_stride * 2 + c], kOutGuard) << "row " << r << " byte " << c;
  }
};

TEST(Gemm, ExactOnIntegerInputsWithPowerOfTwoScales) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // M off a multiple of 4, three K blocks, two N blocks.
  GemmCase c(7, 256, 384, 128, 24);
  for (int64_t r = 0; r < c.m; ++r)
    for (int64_t i = 0; i < c.k; ++i) c.a_at(r, i) = float_to_e4m3(float(rng.integer(-8, 8)));
  for (int64_t r = 0; r < c.n; ++r)
    for (int64_t i = 0; i < c.k; ++i) c.b_at(r, i) = float_to_e4m3(float(rng.integer(-8, 8)));
  // Scales 2^[-2, 2]: every partial sum is a multiple of 2^-4 below 2^19, exact in fp32.
  for (int64_t kb = 0; kb < c.k / 128; ++kb) {
    for (int64_t r = 0; r < c.m; ++r) c.sa(r, kb) = std::ldexp(1.0f, int(rng.integer(-2, 2)));
    for (int64_t nb = 0; nb < c.n / 128; ++nb)
      c.sb(nb, kb) = std::ldexp(1.0f, int(rng.integer(-2, 2)));
  }
  ASSERT_TRUE(run_gemm_cpu(c.params()).ok());
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t col = 0; col < c.n; ++col) {
      double exact = 0.0;
      for (int64_t kb = 0; kb < c.k / 128; ++kb) {
        int64_t dot = 0;
        for (int64_t i = kb * 128; i < kb * 128 + 128; ++i)
          dot += int64_t(e4m3_to_float(c.a_at(r, i))) * int64_t(e4m3_to_float(c.b_at(col, i)));
        exact += double(dot) * c.sa(r, kb) * c.sb(col / 128, kb);
      }
      ASSERT_EQ(c.out_at(r, col), float_to_bf16(float(exact)))
          << "row " << r << " col " << col << " exact " << exact << " got "
          << bf16_to_float(c.out_at(r, col));
    }
  }
  c.check_guards();
}

// fp64 reference of one output element and the bound of the twin's error.
struct RefValue {
  double value;
  double bound;
};

// a_row / b_row: row r of A and row col of B, decoded to double.
RefValue reference(GemmCase& c, int64_t r, int64_t col, const double* a_row, const double* b_row) {
  const int64_t blocks = c.k / 128;
  double sum = 0.0, abs_terms = 0.0;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    double dot = 0.0;
    for (int64_t i = kb * 128; i < kb * 128 + 128; ++i) dot += a_row[i] * b_row[i];
    const double term = dot * c.sa(r, kb) * c.sb(col / 128, kb);
    sum += term;
    abs_terms += std::fabs(term);
  }
  // The block dots are exact. Each term is rounded to fp32 once (relative 2^-24) and the fp32 sum
  // of `blocks` terms adds at most (blocks - 1) roundings, each bounded by 2^-24 of a partial sum
  // <= abs_terms: |acc - sum| <= blocks * 2^-24 * abs_terms (first order). The bf16 rounding of
  // acc adds at most 2^-8 * |acc| (8-bit significand, round to nearest: half an ulp is 2^-8
  // relative at most). Doubled for the second-order terms and the slack of |acc| vs |sum|.
  const double acc_err = double(blocks) * std::ldexp(1.0, -24) * abs_terms;
  return {sum, std::ldexp(1.0, -8) * (std::fabs(sum) + acc_err) + 2.0 * acc_err};
}

void fill_random(GemmCase& c, Rng& rng, bool fill_b = true) {
  for (int64_t r = 0; r < c.m; ++r)
    for (int64_t i = 0; i < c.k; ++i) c.a_at(r, i) = float_to_e4m3(rng.normal(0.0f, 40.0f));
  for (int64_t r = 0; fill_b && r < c.n; ++r)
    for (int64_t i = 0; i < c.k; ++i) c.b_at(r, i) = float_to_e4m3(rng.normal(0.0f, 2.0f));
  for (int64_t kb = 0; kb < c.k / 128; ++kb) {
    for (int64_t r = 0; r < c.m; ++r) c.sa(r, kb) = rng.uniform(1e-3f, 1e-1f);
    for (int64_t nb = 0; nb < c.n / 128; ++nb) c.sb(nb, kb) = rng.uniform(1e-4f, 1e-2f);
  }
}

void check_random(GemmCase& c) {
  double decode[256];
  for (int i = 0; i < 256; ++i) decode[i] = e4m3_to_float(static_cast<uint8_t>(i));
  std::vector<double> a_rows(c.m * c.k), b_row(c.k);
  for (int64_t r = 0; r < c.m; ++r)
    for (int64_t i = 0; i < c.k; ++i) a_rows[r * c.k + i] = decode[c.a_at(r, i)];
  for (int64_t col = 0; col < c.n; ++col) {
    for (int64_t i = 0; i < c.k; ++i) b_row[i] = decode[c.b_at(col, i)];
    for (int64_t r = 0; r < c.m; ++r) {
      const RefValue ref = reference(c, r, col, &a_rows[r * c.k], b_row.data());
      const uint16_t got = c.out_at(r, col);
      const double v = bf16_to_float(got);
      ASSERT_FALSE(std::isnan(v)) << "row " << r << " col " << col;
      ASSERT_LE(std::fabs(v - ref.value), ref.bound)
          << "row " << r << " col " << col << " ref " << ref.value << " got " << v;
    }
  }
  c.check_guards();
}

TEST(Gemm, RandomAgainstFp64Reference) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  GemmCase c(5, 384, 640, 0, 8);
  fill_random(c, rng);
  ASSERT_TRUE(run_gemm_cpu(c.params()).ok());
  check_random(c);
}

TEST(Gemm, ScaleIndexingPerBlock) {
  // A single non-zero product per block, one distinct scale per (row, block) and (column block,
  // block): any mix-up of the scale indices changes the result.
  GemmCase c(3, 256, 384, 0, 0);
  std::memset(c.a.data(), 0, c.a.nbytes());
  std::memset(c.b.data(), 0, c.b.nbytes());
  for (int64_t r = 0; r < c.m; ++r)
    for (int64_t kb = 0; kb < 3; ++kb) {
      c.a_at(r, kb * 128 + 5) = float_to_e4m3(1.0f);
      c.sa(r, kb) = std::ldexp(1.0f, int(r * 3 + kb));
    }
  for (int64_t col = 0; col < c.n; ++col)
    for (int64_t kb = 0; kb < 3; ++kb) c.b_at(col, kb * 128 + 5) = float_to_e4m3(1.0f);
  for (int64_t nb = 0; nb < 2; ++nb)
    for (int64_t kb = 0; kb < 3; ++kb) c.sb(nb, kb) = std::ldexp(1.0f, int(10 + nb * 3 + kb));
  ASSERT_TRUE(run_gemm_cpu(c.params()).ok());
  for (int64_t r = 0; r < c.m; ++r)
    for (int64_t col = 0; col < c.n; ++col) {
      double want = 0;
      for (int64_t kb = 0; kb < 3; ++kb)
        want += std::ldexp(1.0, int(r * 3 + kb)) * std::ldexp(1.0, int(10 + (col / 128) * 3 + kb));
      ASSERT_EQ(c.out_at(r, col), float_to_bf16(float(want))) << r << " " << col;
    }
}

TEST(Gemm, NanOperandPropagates) {
  GemmCase c(1, 128, 128, 0, 0);
  std::memset(c.a.data(), 0, c.a.nbytes());
  std::memset(c.b.data(), 0x38, c.b.nbytes());  // 1.0
  c.sa(0, 0) = 1.0f;
  c.sb(0, 0) = 1.0f;
  c.a_at(0, 17) = 0x7f;
  ASSERT_TRUE(run_gemm_cpu(c.params()).ok());
  for (int64_t col = 0; col < c.n; ++col) EXPECT_TRUE(std::isnan(bf16_to_float(c.out_at(0, col))));
}

TEST(Gemm, ZeroRowsDoNothing) {
  GemmCase c(0, 128, 256, 0, 0);
  GemmParams p = c.params();
  ASSERT_TRUE(run_gemm_cpu(p).ok());
}

TEST(Gemm, M3ProjectionGeometrySmoke) {
  // The fused TP1 projection: N = 77 heads x 128 = 9856, K = 6144, M = 2.
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = MsaGeometry::m3();
  GemmCase c(2, g.packed_width(), g.hidden, 0, 0);
  fill_random(c, rng, /*fill_b=*/false);
  // B is 60 M elements: fill it with random non-NaN codes (8 per draw) instead of normal samples.
  uint8_t* b = c.b.ptr<uint8_t>();
  const int64_t b_bytes = c.b.nbytes();
  for (int64_t i = 0; i < b_bytes; i += 8) {
    uint64_t bits = rng.engine()();
    for (int j = 0; j < 8 && i + j < b_bytes; ++j, bits >>= 8) {
      const uint8_t code = static_cast<uint8_t>(bits);
      b[i + j] = e4m3_is_nan(code) ? code ^ 1 : code;
    }
  }
  ASSERT_TRUE(run_gemm_cpu(c.params()).ok());
  check_random(c);
}

// ---- validation ----

struct Mutation {
  const char* name;
  std::vector<std::string> keywords;
  void (*apply)(GemmParams&);
};

TEST(GemmValidate, EveryRuleRejectsAndTouchesNothing) {
  static Tensor other_out(DType::kBF16, {8, 256});
  const Mutation mutations[] = {
      {"A dtype", {"gemm A", "e4m3"}, [](GemmParams& p) { p.a.dtype = DType::kBF16; }},
      {"B dtype", {"gemm B", "e4m3"}, [](GemmParams& p) { p.b.dtype = DType::kF32; }},
      {"out dtype", {"output", "bf16"}, [](GemmParams& p) { p.out.dtype = DType::kF32; }},
      {"A rank", {"gemm A", "dimensions"}, [](GemmParams& p) { p.a.ndim = 1; }},
      {"K not multiple of 128",
       {"K = 320", "multiple of 128"},
       [](GemmParams& p) {
         p.a.shape[1] = 320;
         p.b.shape[1] = 320;
       }},
      {"N not multiple of 128",
       {"N = 200", "multiple of 128"},
       [](GemmParams& p) {
         p.b.shape[0] = 200;
         p.out.shape[1] = 200;
       }},
      {"K mismatch", {"gemm B has K = 256"}, [](GemmParams& p) { p.b.shape[1] = 256; }},
      {"out shape", {"output", "shape"}, [](GemmParams& p) { p.out.shape[0] = 5; }},
      {"A scales shape", {"A scales", "shape"}, [](GemmParams& p) { p.a_scales.shape[1] = 2; }},
      {"B scales shape", {"B scales", "shape"}, [](GemmParams& p) { p.b_scales.shape[0] = 1; }},
      {"A scales dtype",
       {"A scales", "f32"},
       [](GemmParams& p) { p.a_scales.dtype = DType::kI32; }},
      {"B scales alias",
       {"B scales", "alias"},
       [](GemmParams& p) {
         p.b_scales.stride[0] = 1;
         p.b_scales.stride[1] = 1;
       }},
      {"A last stride", {"gemm A", "last stride"}, [](GemmParams& p) { p.a.stride[1] = 2; }},
      {"A row stride small",
       {"gemm A", "row stride", "smaller"},
       [](GemmParams& p) { p.a.stride[0] = 256; }},
      {"A row stride not 16 B",
       {"gemm A", "row stride", "16 bytes"},
       [](GemmParams& p) { p.a.stride[0] = 392; }},
      {"out row stride not 16 B",
       {"output", "row stride", "16 bytes"},
       [](GemmParams& p) { p.out.stride[0] = 260; }},
      {"B misaligned",
       {"gemm B", "aligned"},
       [](GemmParams& p) { p.b.data = static_cast<uint8_t*>(p.b.data) + 8; }},
      {"device mismatch",
       {"one device", "cuda:1"},
       [](GemmParams& p) { p.b.device = Device::cuda(1); }},
      {"out overlaps A",
       {"output overlaps"},
       [](GemmParams& p) {
         p.out.data = other_out.data();
         p.a.data = other_out.data();
       }},
  };
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  GemmCase c(6, 256, 384, 0, 8);
  fill_random(c, rng);
  ASSERT_TRUE(validate_gemm(c.params()).ok());
  other_out.fill_bytes(0x11);
  const Tensor out_before = c.out.clone();
  const Tensor other_before = other_out.clone();
  for (const Mutation& m : mutations) {
    SCOPED_TRACE(m.name);
    GemmParams p = c.params();
    m.apply(p);
    for (const Status& st : {validate_gemm(p), run_gemm_cpu(p)})
      ASSERT_NO_FATAL_FAILURE(testing::expect_invalid_naming(st, m.keywords));
    ASSERT_EQ(std::memcmp(c.out.data(), out_before.data(), c.out.nbytes()), 0);
    ASSERT_EQ(std::memcmp(other_out.data(), other_before.data(), other_out.nbytes()), 0);
  }
}

TEST(GemmValidate, CudaViewsAreRejectedByTheCpuTwin) {
  GemmCase c(4, 128, 128, 0, 0);
  GemmParams p = c.params();
  for (TensorView* v : {&p.a, &p.a_scales, &p.b, &p.b_scales, &p.out}) v->device = Device::cuda();
  EXPECT_TRUE(validate_gemm(p).ok());
  const Status st = run_gemm_cpu(p);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("CPU"), std::string::npos) << st.message();
  for (int64_t i = 0; i < c.out.nbytes(); ++i) ASSERT_EQ(c.out.ptr<uint8_t>()[i], kOutGuard);
}

}  // namespace
}  // namespace m3attn
