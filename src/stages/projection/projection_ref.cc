// FP8 block-scaled GEMM: host validation and the CPU twin (SPEC section 2).
//
// out[m, n] = bf16( sum over kb of  float( dot_kb(m, n) * sa[m, kb] * sb[n / 128, kb] ) )
// where dot_kb is the dot product of the 128 E4M3 values of block kb of row m of a and row n of b.
// Numerics of the twin, chosen so that integer-valued inputs give exact results:
//  - dot_kb is computed in double and is exact: every E4M3 product has at most 8 significant bits
//    and lies in [2^-18, 2^17.8], so 128 of them sum without rounding within 53 bits.
//  - dot_kb * sa * sb is formed in double (exact for power-of-two scales, otherwise within 2^-52
//    relative) and then rounded to fp32.
//  - the per-block terms are accumulated in fp32, in increasing kb order (the device accumulates in
//    fp32 too, in its own order: the only source of GPU-vs-CPU difference besides the bf16 tie).
//  - the fp32 sum is rounded once to bf16 (nearest even).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/projection/projection.h"

namespace m3attn {

namespace {

// Row-major operand [rows, cols] with last stride 1: row stride >= cols, a multiple of 16 bytes and
// a 16-byte aligned base (what cuBLASLt needs for its leading dimensions).
Status check_matrix(const TensorView& t, DType dtype, const char* what) {
  M3_RETURN_IF_ERROR(check_dtype(t, dtype, what));
  M3_RETURN_IF_ERROR(check_ndim(t, 2, what));
  M3_CHECK_ARG(t.shape[0] >= 0 && t.shape[1] >= 0, what, " has a negative extent ",
               t.shape_string());
  M3_CHECK_ARG(t.stride[1] == 1, what, " last stride must be 1, got ", t.stride[1]);
  M3_CHECK_ARG(t.shape[0] <= 1 || t.stride[0] >= t.shape[1], what, " row stride ", t.stride[0],
               " is smaller than its width ", t.shape[1]);
  const int64_t row_bytes = t.stride[0] * dtype_size(t.dtype);
  M3_CHECK_ARG(t.shape[0] <= 1 || row_bytes % 16 == 0, what, " row stride ", t.stride[0],
               " elements (", row_bytes, " bytes) is not a multiple of 16 bytes");
  M3_CHECK_ARG(t.numel() == 0 || t.data != nullptr, what, " is null");
  return check_alignment(t, 16, what);
}

Status check_scales(const TensorView& s, int64_t rows, int64_t cols, const char* what) {
  M3_RETURN_IF_ERROR(check_dtype(s, DType::kF32, what));
  M3_RETURN_IF_ERROR(check_shape(s, {rows, cols}, what));
  M3_CHECK_ARG(s.stride[0] > 0 && s.stride[1] > 0, what, " strides must be positive, got (",
               s.stride[0], ", ", s.stride[1], ")");
  const int small = s.stride[0] <= s.stride[1] ? 0 : 1;
  const int big = 1 - small;
  M3_CHECK_ARG(
      s.shape[big] <= 1 || s.shape[small] <= 1 || s.stride[big] >= s.stride[small] * s.shape[small],
      what, " strides (", s.stride[0], ", ", s.stride[1], ") make elements of shape ",
      s.shape_string(), " alias each other");
  M3_CHECK_ARG(s.numel() == 0 || s.data != nullptr, what, " is null");
  return check_alignment(s, 4, what);
}

}  // namespace

Status validate_gemm(const GemmParams& p) {
  M3_RETURN_IF_ERROR(check_matrix(p.a, DType::kE4M3, "gemm A"));
  M3_RETURN_IF_ERROR(check_matrix(p.b, DType::kE4M3, "gemm B"));
  M3_RETURN_IF_ERROR(check_matrix(p.out, DType::kBF16, "gemm output"));
  const int64_t m = p.a.shape[0], k = p.a.shape[1], n = p.b.shape[0];
  M3_CHECK_ARG(m < (int64_t{1} << 31), "gemm M = ", m, " must be < 2^31");
  M3_CHECK_ARG(k > 0 && k % kQuantBlock == 0, "gemm K = ", k, " must be a positive multiple of ",
               kQuantBlock);
  M3_CHECK_ARG(n > 0 && n % kQuantBlock == 0, "gemm N = ", n, " must be a positive multiple of ",
               kQuantBlock);
  M3_CHECK_ARG(p.b.shape[1] == k, "gemm B has K = ", p.b.shape[1], " but A has K = ", k);
  M3_CHECK_ARG(p.out.shape[0] == m && p.out.shape[1] == n, "gemm output must have shape [", m, ", ",
               n, "], got ", p.out.shape_string());
  M3_RETURN_IF_ERROR(check_scales(p.a_scales, m, k / kQuantBlock, "gemm A scales"));
  M3_RETURN_IF_ERROR(check_scales(p.b_scales, n / kQuantBlock, k / kQuantBlock, "gemm B scales"));
  M3_RETURN_IF_ERROR(check_same_device({&p.a, &p.a_scales, &p.b, &p.b_scales, &p.out}, "gemm"));
  const ByteRange out = byte_range(p.out);
  for (const TensorView* in : {&p.a, &p.a_scales, &p.b, &p.b_scales})
    M3_CHECK_ARG(!ranges_overlap(out, byte_range(*in)), "gemm output overlaps an input");
  return Status::Ok();
}

Status run_gemm_cpu(const GemmParams& p) {
  M3_RETURN_IF_ERROR(validate_gemm(p));
  M3_CHECK_ARG(p.a.device.type == DeviceType::kCPU, "run_gemm_cpu needs CPU tensors, got ",
               p.a.device.to_string());

  const int64_t m_rows = p.a.shape[0], k = p.a.shape[1], n_cols = p.b.shape[0];
  const int64_t blocks = k / kQuantBlock;
  // E4M3 code -> value. Every E4M3 value is exact in fp32, and the product of two fp32 values is
  // exact in double.
  float decode[256];
  for (int c = 0; c < 256; ++c) decode[c] = e4m3_to_float(static_cast<uint8_t>(c));

  const uint8_t* a = p.a.ptr<const uint8_t>();
  const uint8_t* b = p.b.ptr<const uint8_t>();
  const float* sa = p.a_scales.ptr<const float>();
  const float* sb = p.b_scales.ptr<const float>();
  uint16_t* out = p.out.ptr<uint16_t>();

  // Rows of A are decoded a chunk at a time so that each row of B is decoded once per chunk.
  constexpr int64_t kChunk = 64;
  std::vector<float> a_dec(static_cast<size_t>(kChunk * k)), b_row(static_cast<size_t>(k));
  for (int64_t m0 = 0; m0 < m_rows; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, m_rows - m0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < k; ++i) a_dec[r * k + i] = decode[a[(m0 + r) * p.a.stride[0] + i]];
    for (int64_t n = 0; n < n_cols; ++n) {
      for (int64_t i = 0; i < k; ++i) b_row[i] = decode[b[n * p.b.stride[0] + i]];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        const float* a_row = &a_dec[r * k];
        float acc = 0.0f;
        for (int64_t kb = 0; kb < blocks; ++kb) {
          double dot = 0.0;  // exact, see the top of the file
          for (int64_t i = kb * kQuantBlock; i < (kb + 1) * kQuantBlock; ++i)
            dot += static_cast<double>(a_row[i]) * b_row[i];
          const double scale_a = sa[m * p.a_scales.stride[0] + kb * p.a_scales.stride[1]];
          const double scale_b =
              sb[(n / kQuantBlock) * p.b_scales.stride[0] + kb * p.b_scales.stride[1]];
          acc += static_cast<float>(dot * scale_a * scale_b);
        }
        out[m * p.out.stride[0] + n] = float_to_bf16(acc);
      }
    }
  }
  return Status::Ok();
}

}  // namespace m3attn
