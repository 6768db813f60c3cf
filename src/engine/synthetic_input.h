// Synthetic token inputs of the serving engine: the hidden state entering layer 0 for token
// (request, position) is generated from a counter-based hash, so the CPU and CUDA backends (and
// every re-run) see exactly the same bf16 numbers without copying activations to the device.
//
//   h = splitmix64 chain over (seed, request id, position, channel)     64 random bits
//   S = sum of the four 16-bit fields of h                              Irwin-Hall(4), integer
//   x = (S - 2 * 65535) * (1 / sigma)  with sigma = sqrt(4 * (65536^2 - 1) / 12)
//   value = bf16(x)
//
// x has mean 0, variance 1, range +-3.46 and a bell shape (sum of four uniforms, kurtosis -0.3):
// "approximately N(0, 1)". Every operation before the bf16 rounding is integer arithmetic or one
// fp32 multiply of exactly representable operands, so host and device give identical bits.
#pragma once

#include <cstdint>

#include "core/numeric.h"

namespace m3attn {

M3_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// 64 well-mixed bits for one (seed, request, position, channel).
M3_HD uint64_t synthetic_hash(uint64_t seed, int64_t request_id, int64_t position,
                              int64_t channel) {
  uint64_t h = splitmix64(seed ^ 0x6d3a5f1c2b4e8a97ull);
  h = splitmix64(h ^ static_cast<uint64_t>(request_id));
  h = splitmix64(h ^ static_cast<uint64_t>(position));
  return splitmix64(h ^ static_cast<uint64_t>(channel));
}

// The bf16 bits of the input value (see the header comment).
M3_HD uint16_t synthetic_hidden_bf16(uint64_t seed, int64_t request_id, int64_t position,
                                     int64_t channel) {
  const uint64_t h = synthetic_hash(seed, request_id, position, channel);
  const int32_t s = static_cast<int32_t>(h & 0xffffu) + static_cast<int32_t>((h >> 16) & 0xffffu) +
                    static_cast<int32_t>((h >> 32) & 0xffffu) + static_cast<int32_t>(h >> 48);
  // 1 / sqrt((65536^2 - 1) / 3) rounded to fp32; |s - 131070| < 2^18 is exact in fp32.
  const float inv_sigma = 2.6428997e-05f;
  return float_to_bf16(static_cast<float>(s - 131070) * inv_sigma);
}

// Deterministic synthetic input hidden state for token (request, position), as a float holding a
// bf16 value ~N(0, 1); identical on host and device.
M3_HD float synthetic_hidden_value(uint64_t seed, int64_t request_id, int64_t position,
                                   int64_t channel) {
  return bf16_to_float(synthetic_hidden_bf16(seed, request_id, position, channel));
}

}  // namespace m3attn
