// Device code of the producer (SPEC sections 3-4): one kernel template over the mode.
//
// Work decomposition. A "task" is one 128-wide head of one token: task = t * H + h, with H heads
// per packed row (kFused n_q + 3 n_kv + 1, kMain n_q + 2 n_kv, kIndex n_kv + 1). Sixteen lanes
// (half a warp) own a task; lane j holds channels [8j, 8j + 8) after one 16-byte load of 8 BF16
// values. A block of 256 threads is 16 such groups and owns 64 consecutive tasks: group g takes
// tasks base + u * 16 + g for u < 4, so every step of u reads 16 consecutive heads (4 KB, fully
// coalesced). Three phases:
//   1. every thread issues its 4 packed loads (streaming, 64 B per thread in flight);
//   2. while they fly, the block stages into shared memory the norm weights as fp32 (1 + w), and
//      for the tokens its tasks touch (at most 64 / H + 2 <= 33, H >= 2) the position, the slot
//      and the fp32 RoPE row rope[pos][0|1][0..31];
//   3. per task: widen to fp32, sum of squares reduced by shuffles inside the 16-lane group,
//      y = (y * rsqrt(ss / 128 + eps)) * (1 + w) (V skips the norm), partial NeoX RoPE where lanes
//      0-3 hold channels 0-31 and lanes 4-7 channels 32-63 (the partner is lane ^ 4), one E4M3
//      rounding (cvt.rn.satfinite.e4m3x2, the instruction behind float_to_e4m3) and one 8-byte
//      store per lane: Q / index-Q to the compact outputs, K / V / index-K to their cache row when
//      the slot is valid. Every lane of a warp runs every shuffle (no shuffle under a branch that
//      depends on the head type), so the full-warp mask is always right.
// A token whose position is outside [0, max_pos) writes no cache and NaN (0x7F) Q / index-Q rows.
//
// Bytes per token at M3 TP1 (fused): read 9856 * 2 (packed) + 8 (position, slot) + 256 (RoPE row);
// write 64 * 128 (Q) + 4 * 128 (index-Q) + 2 * 4 * 128 (K, V) + 128 (index-K) = 29,832 B. The
// kernel is bound by HBM bandwidth: ~4.3 TB/s copy gives ~28 us at T = 4096. Instruction issue is
// about half of that budget (about 100 instructions per lane and head), so it stays memory bound.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/numeric.h"
#include "stages/producer/producer.h"

namespace m3attn::producer_kernel {

constexpr int kThreads = 256;
constexpr int kLanesPerHead = 16;
constexpr int kValuesPerLane = 8;                                 // 8 bf16 = one 16-byte load
constexpr int kGroupsPerBlock = kThreads / kLanesPerHead;         // 16
constexpr int kTasksPerGroup = 4;                                 // loads in flight per thread
constexpr int kTasksPerBlock = kGroupsPerBlock * kTasksPerGroup;  // 64
constexpr int kMinHeadsPerRow = 2;                                // kIndex with n_kv = 1
constexpr int kMaxTokensPerBlock = (kTasksPerBlock - 1) / kMinHeadsPerRow + 2;  // 33
constexpr int kRopeFloats = 64;        // [2][32] per position
constexpr int kTileBytes = 128 * 128;  // one (page, plane, head) tile

// Head kinds inside a packed row, and their norm-weight slots (V has none).
enum HeadKind : int { kQ = 0, kK = 1, kV = 2, kIQ = 3, kIK = 4 };
enum NormSlot : int { kNormQ = 0, kNormK = 1, kNormIQ = 2, kNormIK = 3, kNumNorms = 4 };

// Unsigned 32-bit division by a run-time invariant divisor d in [1, 2^31]: with l = ceil(log2 d)
// and m = floor(2^32 (2^l - d) / d) + 1, n / d = (mulhi(n, m) + n) >> l for every 32-bit n (the
// sum is taken in 64 bits). Saves the ~20-instruction integer division per task.
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;
  uint32_t shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    multiplier =
        static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }
  __host__ __device__ __forceinline__ uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, multiplier);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32);
#endif
    return static_cast<uint32_t>((uint64_t{hi} + n) >> shift);
  }
  __host__ __device__ __forceinline__ void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * divisor;
  }
};

// Everything the kernel needs, flattened from ProducerParams by the launcher (validated there).
struct KernelArgs {
  const uint16_t* packed = nullptr;  // bf16 [T, >= W], row stride in elements (multiple of 8)
  int64_t packed_stride = 0;
  const int32_t* positions = nullptr;    // [T]
  const int32_t* slots = nullptr;        // [>= T]
  const float* rope = nullptr;           // [max_pos, 2, 32]
  uint32_t max_pos = 0;                  // clamped to 2^31 (positions are int32)
  const uint16_t* norm[kNumNorms] = {};  // bf16 [128] each, 16-byte aligned; null when unused
  float eps = 1e-6f;

  uint8_t* q_out = nullptr;     // e4m3 [T, n_q, 128]
  uint8_t* iq_out = nullptr;    // e4m3 [T, n_kv, 128]
  uint8_t* kv = nullptr;        // e4m3 main cache base
  int64_t kv_page_stride = 0;   // elements (= bytes)
  int64_t kv_plane_stride = 0;  // elements (= bytes)
  uint8_t* ic = nullptr;        // e4m3 index cache base
  int64_t ic_page_stride = 0;
  int64_t num_pages = 0;  // pages of the cache(s) the mode writes (equal when fused)

  int n_q = 0;
  int n_kv = 0;
  uint32_t num_tasks = 0;  // T * H
  FastDivmod heads;        // H
};

// Kind of head h of a packed row and its index inside its segment.
template <ProducerMode kMode>
__device__ __forceinline__ void classify_head(int h, int n_q, int n_kv, int& kind, int& sub) {
  if constexpr (kMode == ProducerMode::kIndex) {
    kind = h < n_kv ? kIQ : kIK;
    sub = h < n_kv ? h : 0;
  } else {
    if (h < n_q) {
      kind = kQ;
      sub = h;
    } else {
      // Segments after Q: K, V, then (fused) index-Q and index-K; comparisons, not a division.
      const int r = h - n_q;
      const int seg = (r >= n_kv) + (r >= 2 * n_kv) + (r >= 3 * n_kv);
      kind = kK + seg;
      sub = r - seg * n_kv;
    }
  }
}

__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// Cache rows are only 4-byte aligned in general (base and strides are multiples of 4).
__device__ __forceinline__ void store8_cache(uint8_t* dst, uint2 v) {
  if ((reinterpret_cast<uintptr_t>(dst) & 7u) == 0) {
    *reinterpret_cast<uint2*>(dst) = v;
  } else {
    reinterpret_cast<uint32_t*>(dst)[0] = v.x;
    reinterpret_cast<uint32_t*>(dst)[1] = v.y;
  }
}

template <ProducerMode kMode>
__global__ void __launch_bounds__(kThreads, 4) producer_kernel(const KernelArgs a) {
  __shared__ float4 s_norm[kNumNorms][32];  // (1 + w) as fp32, 128 per tensor
  __shared__ float4 s_rope[kMaxTokensPerBlock][kRopeFloats / 4];
  __shared__ int32_t s_pos[kMaxTokensPerBlock];
  __shared__ int32_t s_slot[kMaxTokensPerBlock];

  const int lane = threadIdx.x & (kLanesPerHead - 1);
  const int group = threadIdx.x / kLanesPerHead;
  const uint32_t block_first = blockIdx.x * static_cast<uint32_t>(kTasksPerBlock);
  const uint32_t block_last = min(block_first + kTasksPerBlock, a.num_tasks) - 1;
  const uint32_t t_first = a.heads.div(block_first);
  const uint32_t t_last = a.heads.div(block_last);

  // ---- phase 1: issue the packed loads ----
  uint4 raw[kTasksPerGroup];
#pragma unroll
  for (int u = 0; u < kTasksPerGroup; ++u) {
    const uint32_t task = block_first + u * kGroupsPerBlock + group;
    raw[u] = make_uint4(0, 0, 0, 0);
    if (task < a.num_tasks) {
      uint32_t t, h;
      a.heads.divmod(task, t, h);
      const uint16_t* src = a.packed + static_cast<int64_t>(t) * a.packed_stride +
                            static_cast<int64_t>(h) * 128 + lane * kValuesPerLane;
      raw[u] = __ldcs(reinterpret_cast<const uint4*>(src));
    }
  }

  // ---- phase 2: norm weights, positions, slots and RoPE rows into shared memory ----
  if (threadIdx.x < kNumNorms * 16) {
    const int which = threadIdx.x / 16;
    const int part = threadIdx.x % 16;
    const uint16_t* w = a.norm[which];
    if (w != nullptr) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(w) + part);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
      float f[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = 1.0f + __uint_as_float(words[i] << 16);
        f[2 * i + 1] = 1.0f + __uint_as_float(words[i] & 0xffff0000u);
      }
      s_norm[which][2 * part] = make_float4(f[0], f[1], f[2], f[3]);
      s_norm[which][2 * part + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
  }
  const int n_tok = static_cast<int>(t_last - t_first) + 1;
  for (int e = threadIdx.x; e < n_tok * 16; e += kThreads) {
    const int k = e / 16;
    const int part = e % 16;
    const uint32_t t = t_first + k;
    const int32_t pos = __ldg(a.positions + t);
    const bool pos_ok = static_cast<uint32_t>(pos) < a.max_pos;
    if (part == 0) {
      s_pos[k] = pos;
      s_slot[k] = __ldg(a.slots + t);
    }
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (pos_ok)
      r = __ldg(reinterpret_cast<const float4*>(a.rope + static_cast<int64_t>(pos) * kRopeFloats) +
                part);
    s_rope[k][part] = r;
  }
  __syncthreads();

  // ---- phase 3: norm, RoPE, E4M3, store ----
#pragma unroll
  for (int u = 0; u < kTasksPerGroup; ++u) {
    const uint32_t task = block_first + u * kGroupsPerBlock + group;
    const bool valid = task < a.num_tasks;
    uint32_t t, h;
    a.heads.divmod(valid ? task : block_first, t, h);
    const int k = static_cast<int>(t - t_first);
    int kind, sub;
    classify_head<kMode>(static_cast<int>(h), a.n_q, a.n_kv, kind, sub);
    const int32_t pos = s_pos[k];
    const int32_t slot = s_slot[k];
    const bool pos_ok = static_cast<uint32_t>(pos) < a.max_pos;

    float y[kValuesPerLane];
    {
      const uint32_t words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        y[2 * i] = __uint_as_float(words[i] << 16);
        y[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
      }
    }

    // Gemma RMSNorm (all lanes reduce; V discards the result).
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) ss = fmaf(y[i], y[i], ss);
#pragma unroll
    for (int off = kLanesPerHead / 2; off > 0; off /= 2)
      ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const bool normed = kind != kV;
    if (normed) {
      const float r = rsqrtf(ss * (1.0f / 128.0f) + a.eps);
      const int slot_w = kind == kQ    ? kNormQ
                         : kind == kK  ? kNormK
                         : kind == kIQ ? kNormIQ
                                       : kNormIK;
      const float4 w0 = s_norm[slot_w][2 * lane];
      const float4 w1 = s_norm[slot_w][2 * lane + 1];
      const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
      for (int i = 0; i < kValuesPerLane; ++i) y[i] = (y[i] * r) * w[i];
    }

    // Partial NeoX RoPE on channels [0, 64): lane j < 4 holds y[i], lane j + 4 holds y[i + 32].
    float partner[kValuesPerLane];
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) partner[i] = __shfl_xor_sync(0xffffffffu, y[i], 4);
    if (normed && pos_ok && lane < 8) {
      const int q = (lane & 3) * 2;  // float4 index of this lane's 8 pair indices
      const float4 c0 = s_rope[k][q], c1 = s_rope[k][q + 1];
      const float4 s0 = s_rope[k][8 + q], s1 = s_rope[k][8 + q + 1];
      const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
      const float s[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
      if (lane < 4) {
#pragma unroll
        for (int i = 0; i < kValuesPerLane; ++i) y[i] = y[i] * c[i] - partner[i] * s[i];
      } else {
#pragma unroll
        for (int i = 0; i < kValuesPerLane; ++i) y[i] = y[i] * c[i] + partner[i] * s[i];
      }
    }

    uint2 code = make_uint2(pack4_e4m3(y[0], y[1], y[2], y[3]), pack4_e4m3(y[4], y[5], y[6], y[7]));
    if (!valid) continue;
    if (kind == kQ || kind == kIQ) {
      if (!pos_ok) code = make_uint2(0x7f7f7f7fu, 0x7f7f7f7fu);
      uint8_t* dst = kind == kQ ? a.q_out + (static_cast<int64_t>(t) * a.n_q + sub) * 128
                                : a.iq_out + (static_cast<int64_t>(t) * a.n_kv + sub) * 128;
      *reinterpret_cast<uint2*>(dst + lane * kValuesPerLane) = code;
    } else if (pos_ok && slot >= 0 && (slot >> 7) < a.num_pages) {
      const int64_t page = slot >> 7;
      const int row = slot & 127;
      uint8_t* dst;
      if (kind == kIK) {
        dst = a.ic + page * a.ic_page_stride;
      } else {
        dst = a.kv + page * a.kv_page_stride + (kind == kV ? a.kv_plane_stride : 0) +
              static_cast<int64_t>(sub) * kTileBytes;
      }
      store8_cache(dst + row * 128 + lane * kValuesPerLane, code);
    }
  }
}

}  // namespace m3attn::producer_kernel
