#include "core/rope.h"

#include <cmath>

#include "m3attn/config.h"

namespace m3attn {

Result<Tensor> make_rope_table(int64_t max_pos, double theta) {
  M3_CHECK_ARG(max_pos > 0, "rope table needs max_pos > 0, got ", max_pos);
  M3_CHECK_ARG(std::isfinite(theta) && theta > 0, "rope theta must be finite and > 0, got ", theta);
  Tensor table(DType::kF32, {max_pos, 2, kRotaryHalf});
  float* t = table.ptr<float>();
  double freq[kRotaryHalf];
  for (int i = 0; i < kRotaryHalf; ++i) freq[i] = std::pow(theta, -static_cast<double>(i) / 32.0);
  for (int64_t p = 0; p < max_pos; ++p) {
    for (int i = 0; i < kRotaryHalf; ++i) {
      const double a = static_cast<double>(p) * freq[i];
      t[(p * 2 + 0) * kRotaryHalf + i] = static_cast<float>(std::cos(a));
      t[(p * 2 + 1) * kRotaryHalf + i] = static_cast<float>(std::sin(a));
    }
  }
  return table;
}

Status validate_rope_table(const TensorView& rope) {
  M3_CHECK_ARG(rope.device.type == DeviceType::kCPU, "the RoPE table must be a host view, got ",
               rope.device.to_string());
  M3_RETURN_IF_ERROR(check_dtype(rope, DType::kF32, "RoPE table"));
  M3_RETURN_IF_ERROR(check_ndim(rope, 3, "RoPE table"));
  M3_CHECK_ARG(rope.shape[0] > 0 && rope.shape[1] == 2 && rope.shape[2] == kRotaryHalf,
               "RoPE table must be [max_pos, 2, ", kRotaryHalf, "], got ", rope.shape_string());
  M3_RETURN_IF_ERROR(check_contiguous(rope, "RoPE table"));
  return Status::Ok();
}

}  // namespace m3attn
