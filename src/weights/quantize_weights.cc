#include "weights/quantize_weights.h"

#include <cmath>
#include <cstring>

#include "core/numeric.h"
#include "m3attn/config.h"

namespace m3attn {

Status QuantizedMatrix::validate(const char* what) const {
  M3_CHECK_ARG(w.dtype() == DType::kE4M3 && w.shape().size() == 2, what,
               " weights must be e4m3 [N, K], got ", dtype_name(w.dtype()), " ",
               w.view().shape_string());
  const int64_t n = rows(), k = cols();
  M3_CHECK_ARG(n > 0 && k > 0 && n % kQuantBlock == 0 && k % kQuantBlock == 0, what, " weights [",
               n, ", ", k, "] must have positive multiples of ", kQuantBlock, " rows and columns");
  const std::vector<int64_t> want{n / kQuantBlock, k / kQuantBlock};
  M3_CHECK_ARG(scales.dtype() == DType::kF32 && scales.shape() == want, what,
               " scales must be f32 [", want[0], ", ", want[1], "], got ",
               dtype_name(scales.dtype()), " ", scales.view().shape_string());
  return Status::Ok();
}

namespace {

Status check_matrix(const TensorView& t, const char* what) {
  M3_CHECK_ARG(t.device.type == DeviceType::kCPU, what, " must be a host tensor, got ",
               t.device.to_string());
  M3_RETURN_IF_ERROR(check_ndim(t, 2, what));
  M3_CHECK_ARG(t.data != nullptr, what, " has no data");
  return Status::Ok();
}

Status check_block_shape(const TensorView& t, const char* what) {
  const int64_t n = t.shape[0], k = t.shape[1];
  M3_CHECK_ARG(n > 0 && k > 0 && n % kQuantBlock == 0 && k % kQuantBlock == 0, what, " shape ",
               t.shape_string(), " must have positive multiples of ", kQuantBlock,
               " rows and columns");
  return Status::Ok();
}

template <typename T>
const T& at(const TensorView& t, int64_t r, int64_t c) {
  return static_cast<const T*>(t.data)[r * t.stride[0] + c * t.stride[1]];
}

// Block quantization of the N x K matrix whose elements `value(r, c)` yields as fp32 (all finite).
template <typename Get>
QuantizedMatrix quantize_with(int64_t n, int64_t k, Get value) {
  QuantizedMatrix q{Tensor(DType::kE4M3, {n, k}),
                    Tensor(DType::kF32, {n / kQuantBlock, k / kQuantBlock})};
  uint8_t* out = q.w.ptr<uint8_t>();
  float* sc = q.scales.ptr<float>();
  const int64_t kb_count = k / kQuantBlock;
  for (int64_t nb = 0; nb < n / kQuantBlock; ++nb) {
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      float amax = 0.0f;
      for (int64_t r = nb * kQuantBlock; r < (nb + 1) * kQuantBlock; ++r)
        for (int64_t c = kb * kQuantBlock; c < (kb + 1) * kQuantBlock; ++c)
          amax = std::fmax(amax, std::fabs(value(r, c)));
      float scale = amax / kE4M3Max;
      // An all-zero block (or one so small that the scale underflows to 0) takes scale 1: its
      // values then round to 0 or to E4M3 subnormals, an error below 2^-10 in absolute terms.
      if (!(scale > 0.0f)) scale = 1.0f;
      sc[nb * kb_count + kb] = scale;
      for (int64_t r = nb * kQuantBlock; r < (nb + 1) * kQuantBlock; ++r)
        for (int64_t c = kb * kQuantBlock; c < (kb + 1) * kQuantBlock; ++c)
          out[r * k + c] = float_to_e4m3(value(r, c) / scale);
    }
  }
  return q;
}

}  // namespace

Result<QuantizedMatrix> quantize_blocks_128(const TensorView& w) {
  M3_RETURN_IF_ERROR(check_matrix(w, "weight"));
  M3_CHECK_ARG(w.dtype == DType::kBF16 || w.dtype == DType::kF32,
               "weight to quantize must be bf16 or f32, got ", dtype_name(w.dtype));
  M3_RETURN_IF_ERROR(check_block_shape(w, "weight"));
  const int64_t n = w.shape[0], k = w.shape[1];
  if (w.dtype == DType::kBF16) {
    auto get = [&](int64_t r, int64_t c) { return bf16_to_float(at<uint16_t>(w, r, c)); };
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c)
        M3_CHECK_ARG(std::isfinite(get(r, c)), "weight [", r, ", ", c, "] is not finite (",
                     get(r, c), ")");
    return quantize_with(n, k, get);
  }
  auto get = [&](int64_t r, int64_t c) { return at<float>(w, r, c); };
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c)
      M3_CHECK_ARG(std::isfinite(get(r, c)), "weight [", r, ", ", c, "] is not finite (", get(r, c),
                   ")");
  return quantize_with(n, k, get);
}

Result<QuantizedMatrix> requantize_mxfp8(const TensorView& w, const TensorView& s) {
  M3_RETURN_IF_ERROR(check_matrix(w, "MXFP8 weight"));
  M3_RETURN_IF_ERROR(check_matrix(s, "MXFP8 scales"));
  M3_RETURN_IF_ERROR(check_dtype(w, DType::kE4M3, "MXFP8 weight"));
  M3_RETURN_IF_ERROR(check_dtype(s, DType::kE8M0, "MXFP8 scales"));
  M3_RETURN_IF_ERROR(check_block_shape(w, "MXFP8 weight"));
  const int64_t n = w.shape[0], k = w.shape[1];
  M3_RETURN_IF_ERROR(check_shape(s, {n, k / 32}, "MXFP8 scales (one per 1x32 along K)"));
  auto get = [&](int64_t r, int64_t c) {
    return std::ldexp(e4m3_to_float(at<uint8_t>(w, r, c)),
                      static_cast<int>(at<uint8_t>(s, r, c / 32)) - 127);
  };
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const uint8_t q = at<uint8_t>(w, r, c);
      M3_CHECK_ARG(!e4m3_is_nan(q), "MXFP8 weight [", r, ", ", c, "] is NaN");
      M3_CHECK_ARG(at<uint8_t>(s, r, c / 32) != 0xff, "MXFP8 scale [", r, ", ", c / 32,
                   "] is the E8M0 NaN code 0xff");
      M3_CHECK_ARG(std::isfinite(get(r, c)), "MXFP8 weight [", r, ", ", c,
                   "] overflows fp32 after scaling (code ", int{q}, ", scale exponent ",
                   int{at<uint8_t>(s, r, c / 32)} - 127, ")");
    }
  }
  return quantize_with(n, k, get);
}

Result<QuantizedMatrix> from_fp8_block(const TensorView& w, const TensorView& s) {
  M3_RETURN_IF_ERROR(check_matrix(w, "FP8 weight"));
  M3_RETURN_IF_ERROR(check_matrix(s, "FP8 block scales"));
  M3_RETURN_IF_ERROR(check_dtype(w, DType::kE4M3, "FP8 weight"));
  M3_RETURN_IF_ERROR(check_dtype(s, DType::kF32, "FP8 block scales"));
  M3_RETURN_IF_ERROR(check_block_shape(w, "FP8 weight"));
  const int64_t n = w.shape[0], k = w.shape[1];
  M3_RETURN_IF_ERROR(
      check_shape(s, {n / kQuantBlock, k / kQuantBlock}, "FP8 block scales (one per 128x128)"));
  QuantizedMatrix q{Tensor(DType::kE4M3, {n, k}),
                    Tensor(DType::kF32, {n / kQuantBlock, k / kQuantBlock})};
  for (int64_t r = 0; r < n / kQuantBlock; ++r) {
    for (int64_t c = 0; c < k / kQuantBlock; ++c) {
      const float v = at<float>(s, r, c);
      M3_CHECK_ARG(std::isfinite(v) && v >= 0.0f, "FP8 block scale [", r, ", ", c, "] = ", v,
                   " must be finite and >= 0");
      q.scales.ptr<float>()[r * (k / kQuantBlock) + c] = v;
    }
  }
  uint8_t* out = q.w.ptr<uint8_t>();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const uint8_t b = at<uint8_t>(w, r, c);
      M3_CHECK_ARG(!e4m3_is_nan(b), "FP8 weight [", r, ", ", c, "] is NaN");
      out[r * k + c] = b;
    }
  }
  return q;
}

Result<Tensor> dequantize(const QuantizedMatrix& m) {
  M3_RETURN_IF_ERROR(m.validate("quantized matrix"));
  const int64_t n = m.rows(), k = m.cols();
  Tensor out(DType::kF32, {n, k});
  const uint8_t* q = m.w.ptr<uint8_t>();
  const float* s = m.scales.ptr<float>();
  float* o = out.ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c)
      o[r * k + c] =
          e4m3_to_float(q[r * k + c]) * s[(r / kQuantBlock) * (k / kQuantBlock) + c / kQuantBlock];
  return out;
}

}  // namespace m3attn
