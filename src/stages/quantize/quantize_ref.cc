// Activation quantization: host validation and the CPU twin (SPEC section 2).
//
// Per row m < rows and 128-channel block kb:
//   amax  = max |x| over the block (bf16 values widened to fp32; fmax, so a NaN input does not
//           become the amax: it surfaces as a NaN code of its own element instead)
//   scale = amax / 448 in fp32, or 1 when amax == 0 (an all-zero block)
//   q     = e4m3(x / scale) in fp32, round to nearest even, saturating to +-448
// Padding rows [rows, M_pad) get q = 0 and scale = 1, so they contribute nothing to a GEMM.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/quantize/quantize.h"

namespace m3attn {

namespace {

// The scales may use any layout, but two indices must not share an element: sorted by stride, each
// stride must step over the whole span of the smaller one.
Status check_scales_layout(const TensorView& s, const char* what) {
  M3_CHECK_ARG(s.stride[0] > 0 && s.stride[1] > 0, what, " strides must be positive, got (",
               s.stride[0], ", ", s.stride[1], ")");
  const int small = s.stride[0] <= s.stride[1] ? 0 : 1;
  const int big = 1 - small;
  M3_CHECK_ARG(
      s.shape[big] <= 1 || s.shape[small] <= 1 || s.stride[big] >= s.stride[small] * s.shape[small],
      what, " strides (", s.stride[0], ", ", s.stride[1], ") make elements of shape ",
      s.shape_string(), " alias each other");
  return Status::Ok();
}

}  // namespace

Status validate_quantize(const QuantizeParams& p) {
  M3_CHECK_ARG(p.rows >= 0 && p.rows < (int64_t{1} << 31),
               "quantize rows must be in [0, 2^31), got ", p.rows);

  // Input: bf16 [rows, K], last stride 1, K a positive multiple of 128.
  M3_RETURN_IF_ERROR(check_dtype(p.in, DType::kBF16, "quantize input"));
  M3_RETURN_IF_ERROR(check_ndim(p.in, 2, "quantize input"));
  const int64_t k = p.in.shape[1];
  M3_CHECK_ARG(k > 0 && k % kQuantBlock == 0, "quantize input width K = ", k,
               " must be a positive multiple of ", kQuantBlock);
  M3_CHECK_ARG(p.in.shape[0] == p.rows, "quantize input has ", p.in.shape[0],
               " rows but rows = ", p.rows);
  M3_CHECK_ARG(p.in.stride[1] == 1, "quantize input last stride must be 1, got ", p.in.stride[1]);
  M3_CHECK_ARG(p.rows <= 1 || p.in.stride[0] >= k, "quantize input row stride ", p.in.stride[0],
               " is smaller than K = ", k);
  // 16-byte vector loads on the device: aligned base, rows a multiple of 8 bf16 apart.
  M3_CHECK_ARG(p.rows <= 1 || p.in.stride[0] % 8 == 0, "quantize input row stride ", p.in.stride[0],
               " is not a multiple of 8 elements (16 bytes)");
  M3_CHECK_ARG(p.rows == 0 || p.in.data != nullptr, "quantize input is null");
  M3_RETURN_IF_ERROR(check_alignment(p.in, 16, "quantize input"));

  // Output: e4m3 [M_pad, K] contiguous, M_pad >= rows.
  M3_RETURN_IF_ERROR(check_dtype(p.out, DType::kE4M3, "quantize output"));
  M3_RETURN_IF_ERROR(check_ndim(p.out, 2, "quantize output"));
  const int64_t m_pad = p.out.shape[0];
  M3_CHECK_ARG(m_pad >= p.rows, "quantize output has ", m_pad, " rows, fewer than rows = ", p.rows);
  M3_CHECK_ARG(p.out.shape[1] == k, "quantize output width ", p.out.shape[1],
               " differs from input width ", k);
  M3_RETURN_IF_ERROR(check_contiguous(p.out, "quantize output"));
  M3_CHECK_ARG(m_pad == 0 || p.out.data != nullptr, "quantize output is null");
  M3_RETURN_IF_ERROR(check_alignment(p.out, 16, "quantize output"));

  // Scales: f32 [M_pad, K / 128], any non-aliasing positive strides.
  M3_RETURN_IF_ERROR(check_dtype(p.scales, DType::kF32, "quantize scales"));
  M3_RETURN_IF_ERROR(check_ndim(p.scales, 2, "quantize scales"));
  M3_CHECK_ARG(p.scales.shape[0] == m_pad && p.scales.shape[1] == k / kQuantBlock,
               "quantize scales must have shape [", m_pad, ", ", k / kQuantBlock, "], got ",
               p.scales.shape_string());
  M3_RETURN_IF_ERROR(check_scales_layout(p.scales, "quantize scales"));
  M3_CHECK_ARG(m_pad == 0 || p.scales.data != nullptr, "quantize scales are null");
  M3_RETURN_IF_ERROR(check_alignment(p.scales, 4, "quantize scales"));

  M3_RETURN_IF_ERROR(check_same_device({&p.in, &p.out, &p.scales}, "quantize"));
  const ByteRange in = byte_range(p.in), out = byte_range(p.out), sc = byte_range(p.scales);
  M3_CHECK_ARG(!ranges_overlap(out, in), "quantize output overlaps its input");
  M3_CHECK_ARG(!ranges_overlap(sc, in), "quantize scales overlap the input");
  M3_CHECK_ARG(!ranges_overlap(sc, out), "quantize scales overlap the output");
  return Status::Ok();
}

Status run_quantize_cpu(const QuantizeParams& p) {
  M3_RETURN_IF_ERROR(validate_quantize(p));
  M3_CHECK_ARG(p.in.device.type == DeviceType::kCPU, "run_quantize_cpu needs CPU tensors, got ",
               p.in.device.to_string());

  const int64_t k = p.in.shape[1];
  const int64_t m_pad = p.out.shape[0];
  const int64_t blocks = k / kQuantBlock;
  const uint16_t* in = p.in.ptr<const uint16_t>();
  uint8_t* out = p.out.ptr<uint8_t>();
  float* scales = p.scales.ptr<float>();

  for (int64_t m = 0; m < m_pad; ++m) {
    for (int64_t kb = 0; kb < blocks; ++kb) {
      float* scale_out = scales + m * p.scales.stride[0] + kb * p.scales.stride[1];
      uint8_t* q = out + m * k + kb * kQuantBlock;
      if (m >= p.rows) {  // padding row
        std::memset(q, 0, kQuantBlock);
        *scale_out = 1.0f;
        continue;
      }
      const uint16_t* x = in + m * p.in.stride[0] + kb * kQuantBlock;
      float amax = 0.0f;
      for (int i = 0; i < kQuantBlock; ++i) amax = std::fmax(amax, std::fabs(bf16_to_float(x[i])));
      const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
      for (int i = 0; i < kQuantBlock; ++i) q[i] = float_to_e4m3(bf16_to_float(x[i]) / scale);
      *scale_out = scale;
    }
  }
  return Status::Ok();
}

}  // namespace m3attn
