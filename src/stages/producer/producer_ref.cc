// CPU twin of the producer (SPEC section 3): the oracle the CUDA kernel is tested against.
//
// Per token t and per head, all in fp32 from the BF16 load to the single E4M3 rounding:
//   y      = bf16 head values widened to fp32
//   Q, K, index-Q, index-K:
//     ss   = sum of y[i]^2 in fp32, sequentially for i = 0, 1, ..., 127 (the kernel reduces as a
//            tree; the tests allow the resulting one-E4M3-step difference)
//     r    = 1 / sqrt(ss / 128 + eps)
//     y[i] = (y[i] * r) * (1 + w[i])                  w = the tensor's bf16 norm weight
//     for i in [0, 32), with c = rope[pos][0][i], s = rope[pos][1][i]:
//       y[i], y[i + 32] = y[i] * c - y[i + 32] * s,  y[i + 32] * c + y[i] * s
//   V: y unchanged
//   code = e4m3(y) (round to nearest even, saturate to +-448)
// Fused and unfused modes call the same per-head routine, so their outputs are byte-identical here.
// Limits shared with the kernel: ss overflows fp32 for |y| above ~1.6e18 (the head then normalizes
// to zeros), and RoPE may turn an exact -0 into +0 (y - 0 * s); both are far from real activations
// and the sign of a zero is not a difference the tests count.
// Tokens: position outside [0, max_pos) -> Q / index-Q rows 0x7F (NaN), no cache write; slot < 0
// or page >= num_pages -> Q / index-Q produced, no cache write. Duplicate valid slots within one
// call are a caller bug: here the later token wins, on the device the order is unspecified.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/producer/producer.h"

namespace m3attn {

namespace {

constexpr uint8_t kE4M3NaN = 0x7f;

// The RoPE row of one position: cos[i] = rope[pos][0][i], sin[i] = rope[pos][1][i].
struct RopeRow {
  const float* cos;
  const float* sin;
};

// One 128-wide head: Gemma RMSNorm with weight `norm` (when given), partial NeoX RoPE (when given),
// one rounding to E4M3 into dst[0, 128).
void produce_head(const uint16_t* src, const uint16_t* norm, float eps, const RopeRow* rope,
                  uint8_t* dst) {
  float y[kHeadDim];
  for (int i = 0; i < kHeadDim; ++i) y[i] = bf16_to_float(src[i]);
  if (norm != nullptr) {
    float ss = 0.0f;
    for (int i = 0; i < kHeadDim; ++i) ss += y[i] * y[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(kHeadDim) + eps);
    for (int i = 0; i < kHeadDim; ++i) y[i] = (y[i] * r) * (1.0f + bf16_to_float(norm[i]));
  }
  if (rope != nullptr) {
    for (int i = 0; i < kRotaryHalf; ++i) {
      const float a = y[i], b = y[i + kRotaryHalf];
      const float c = rope->cos[i], s = rope->sin[i];
      y[i] = a * c - b * s;
      y[i + kRotaryHalf] = b * c + a * s;
    }
  }
  for (int i = 0; i < kHeadDim; ++i) dst[i] = float_to_e4m3(y[i]);
}

}  // namespace

Status run_producer_cpu(const ProducerParams& p) {
  M3_RETURN_IF_ERROR(validate_producer(p));
  M3_CHECK_ARG(p.packed.device.type == DeviceType::kCPU, "run_producer_cpu needs CPU tensors, got ",
               p.packed.device.to_string());
  const bool uses_main = p.mode != ProducerMode::kIndex;
  const bool uses_index = p.mode != ProducerMode::kMain;

  // Column offsets of the segments inside a packed row, per mode.
  const int64_t q_col = 0;
  const int64_t k_col = q_col + int64_t{p.n_q} * kHeadDim;
  const int64_t v_col = k_col + int64_t{p.n_kv} * kHeadDim;
  const int64_t iq_col = uses_main ? v_col + int64_t{p.n_kv} * kHeadDim : 0;
  const int64_t ik_col = iq_col + int64_t{p.n_kv} * kHeadDim;

  const int64_t max_pos = p.rope.shape[0];
  const float* rope = p.rope.ptr<const float>();
  const int32_t* positions = p.positions.ptr<const int32_t>();
  const int32_t* slots = p.slots.ptr<const int32_t>();
  const int64_t num_pages = uses_main ? p.kv_cache.shape[0] : p.index_cache.shape[0];
  uint8_t* kv = p.kv_cache.ptr<uint8_t>();
  uint8_t* ic = p.index_cache.ptr<uint8_t>();

  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const uint16_t* row = p.packed.ptr<const uint16_t>() + t * p.packed.stride[0];
    uint8_t* q_out = uses_main ? p.q_out.ptr<uint8_t>() + t * p.n_q * kHeadDim : nullptr;
    uint8_t* iq_out = uses_index ? p.iq_out.ptr<uint8_t>() + t * p.n_kv * kHeadDim : nullptr;

    const int64_t pos = positions[t];
    if (pos < 0 || pos >= max_pos) {  // caller bug: loud NaN rows, no cache write
      if (uses_main) std::memset(q_out, kE4M3NaN, static_cast<size_t>(p.n_q) * kHeadDim);
      if (uses_index) std::memset(iq_out, kE4M3NaN, static_cast<size_t>(p.n_kv) * kHeadDim);
      continue;
    }
    const RopeRow rot{rope + pos * 2 * kRotaryHalf, rope + (pos * 2 + 1) * kRotaryHalf};

    const int64_t slot = slots[t];
    const int64_t page = slot >= 0 ? slot / kPageSize : -1;
    const int row_in_page = slot >= 0 ? static_cast<int>(slot % kPageSize) : 0;
    const bool write_cache = slot >= 0 && page < num_pages;

    if (uses_main) {
      for (int h = 0; h < p.n_q; ++h)
        produce_head(row + q_col + h * kHeadDim, p.q_norm.ptr<const uint16_t>(), p.eps, &rot,
                     q_out + h * kHeadDim);
      if (write_cache) {
        for (int h = 0; h < p.n_kv; ++h) {
          produce_head(row + k_col + h * kHeadDim, p.k_norm.ptr<const uint16_t>(), p.eps, &rot,
                       kv + kv_cache_offset(p.kv_cache, page, 0, h, row_in_page));
          produce_head(row + v_col + h * kHeadDim, nullptr, p.eps, nullptr,
                       kv + kv_cache_offset(p.kv_cache, page, 1, h, row_in_page));
        }
      }
    }
    if (uses_index) {
      for (int h = 0; h < p.n_kv; ++h)
        produce_head(row + iq_col + h * kHeadDim, p.iq_norm.ptr<const uint16_t>(), p.eps, &rot,
                     iq_out + h * kHeadDim);
      if (write_cache)
        produce_head(row + ik_col, p.ik_norm.ptr<const uint16_t>(), p.eps, &rot,
                     ic + index_cache_offset(p.index_cache, page, row_in_page));
    }
  }
  return Status::Ok();
}

}  // namespace m3attn
