// Weight quantization to the layout the FP8 GEMMs consume (SPEC section 2): E4M3 [N, K] with one
// fp32 scale per 128x128 block, x ~= e4m3_to_float(q) * scale. Three checkpoint formats arrive:
//  - BF16 / F32: quantize_blocks_128 (scale = amax / 448, or 1 for an all-zero block);
//  - MXFP8 (E4M3 with one E8M0 scale 2^(v-127) per 1x32 along K): requantize_mxfp8 dequantizes and
//    quantizes again to 128x128 blocks;
//  - FP8 with 128x128 fp32 scales: from_fp8_block validates and copies, as is.
// All functions take CPU views of any strides and reject non-finite values with the position of
// the first offender.
#pragma once

#include <cstdint>

#include "m3attn/tensor.h"

namespace m3attn {

struct QuantizedMatrix {
  Tensor w;       // e4m3 [N, K]
  Tensor scales;  // f32 [N / 128, K / 128]

  int64_t rows() const { return w.shape().empty() ? 0 : w.shape()[0]; }
  int64_t cols() const { return w.shape().size() < 2 ? 0 : w.shape()[1]; }
  QuantizedMatrix clone() const { return {w.clone(), scales.clone()}; }
  // Dtypes and shapes agree (N, K multiples of 128; scales [N/128, K/128]).
  Status validate(const char* what) const;
};

// bf16 or f32 [N, K], N % 128 == 0, K % 128 == 0.
Result<QuantizedMatrix> quantize_blocks_128(const TensorView& w);
// w e4m3 [N, K], scales e8m0 [N, K / 32] (one scale per 32 consecutive elements of a row).
Result<QuantizedMatrix> requantize_mxfp8(const TensorView& w_e4m3, const TensorView& scales_e8m0);
// w e4m3 [N, K], scales f32 [N / 128, K / 128] (finite, >= 0); copied unchanged.
Result<QuantizedMatrix> from_fp8_block(const TensorView& w_e4m3, const TensorView& scales_f32);
// f32 [N, K] = q * scale (tests and the CPU reference).
Result<Tensor> dequantize(const QuantizedMatrix& m);

}  // namespace m3attn
