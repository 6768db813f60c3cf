// Scalar conversions shared by the CPU twin and the CUDA kernels: BF16 (round to nearest even),
// E4M3 "fn" (bias 7, no infinities, 0x7F/0xFF are NaN, round to nearest even with saturation to
// +-448, NaN stays NaN) and E8M0 (2^(v-127), 0xFF is NaN). Storage types are plain integers:
// uint16_t for BF16 and uint8_t for E4M3/E8M0, so host code needs no CUDA headers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#define M3_HD __host__ __device__ __forceinline__
#else
#define M3_HD inline
#endif

namespace m3attn {

constexpr float kE4M3Max = 448.0f;

M3_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

M3_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// ---- BF16 ----
M3_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

M3_HD uint16_t float_to_bf16(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // qNaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// ---- E4M3 ----
M3_HD bool e4m3_is_nan(uint8_t c) { return (c & 0x7f) == 0x7f; }

M3_HD float e4m3_to_float(uint8_t c) {
  const int sign = c & 0x80;
  const int e = (c >> 3) & 0xf;
  const int m = c & 0x7;
  float v;
  if (e == 0xf && m == 0x7) {
    v = bits_float(0x7fc00000u);
  } else if (e == 0) {
    v = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  } else {
    v = ldexpf(1.0f + static_cast<float>(m) * 0.125f, e - 7);
  }
  return sign ? -v : v;
}

// Round to nearest even, saturate to +-448 (infinities too), NaN -> 0x7F with the sign kept.
M3_HD uint8_t float_to_e4m3(float x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
#else
  const uint8_t sign = (float_bits(x) >> 31) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | 0x7f;
  const float a = std::fabs(x);
  if (a >= kE4M3Max) return sign | 0x7e;
  if (a < 0.015625f) {  // below 2^-6: subnormal grid of 2^-9 (q == 8 is the smallest normal)
    const float q = std::nearbyint(a * 512.0f);
    return sign | static_cast<uint8_t>(q);
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp = e - 1;                    // a = (2m) * 2^exp, 2m in [1, 2)
  int q = static_cast<int>(std::nearbyint((2.0f * m - 1.0f) * 8.0f));
  if (q == 8) {
    q = 0;
    ++exp;
  }
  int code = ((exp + 7) << 3) | q;
  if (code > 0x7e) code = 0x7e;
  return sign | static_cast<uint8_t>(code);
#endif
}

// Position of a code on the number line as an integer: adjacent representable values differ by
// one, +0 and -0 are both 0. NaN codes must be excluded by the caller.
M3_HD int e4m3_ordinal(uint8_t c) { return (c & 0x80) ? -static_cast<int>(c & 0x7f) : (c & 0x7f); }

// True when a and b are the same value or adjacent E4M3 values; NaN never passes.
M3_HD bool e4m3_within_one_step(uint8_t a, uint8_t b) {
  if (e4m3_is_nan(a) || e4m3_is_nan(b)) return false;
  const int d = e4m3_ordinal(a) - e4m3_ordinal(b);
  return d >= -1 && d <= 1;
}

// ---- E8M0 ----
M3_HD float e8m0_to_float(uint8_t v) {
  if (v == 0xff) return bits_float(0x7fc00000u);
  return ldexpf(1.0f, static_cast<int>(v) - 127);
}

}  // namespace m3attn
