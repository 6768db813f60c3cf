// Shared device code of the producer kernels (SPEC sections 3-4): the kernel arguments, the head
// classification, the helpers and the 8-lane per-task code (process_task) that every 8-lane kernel
// runs, so all of them write identical bytes. producer_kernel.cuh lists the kernels.
//
// Work decomposition. A "task" is one 128-wide head of one token: task = t * H + h, with H heads
// per packed row (kFused n_q + 3 n_kv + 1, kMain n_q + 2 n_kv, kIndex n_kv + 1). Eight lanes own a
// task and each lane holds 16 channels chosen so that RoPE needs no shuffle: lane j holds
//   A = channels [4j, 4j + 4)        (rotary, first halves of pairs i = 4j .. 4j + 3)
//   B = channels [32 + 4j, 36 + 4j)  (rotary, their partners i + 32)
//   C = channels [64 + 8j, 72 + 8j)  (pass-through)
// loaded as 8 + 8 + 16 bytes (every 32-byte sector of the head is read whole by one instruction)
// and stored the same way as 4 + 4 + 8 E4M3 bytes. A block of 256 threads is 32 groups of 8 lanes
// and owns 32 kU consecutive tasks: group g takes tasks base + u * 32 + g, so each step u
// reads 32 consecutive heads. Three phases:
//   1. every thread issues the loads of its kU tasks (streaming; 32 B per task);
//   2. while they fly, the block stages into shared memory the norm weights as fp32 (1 + w) and,
//      for the tokens its tasks touch (H >= 2), the position, the slot and the fp32 RoPE row
//      rope[pos][0|1][0..31];
//   3. per task: widen to fp32, sum of squares (3 xor-shuffles inside the 8-lane group, executed
//      by every lane of the warp, never under a branch), y = (y * rsqrt(ss / 128 + eps)) * (1 + w)
//      (V skips the norm), RoPE on the lane's own four pairs, one E4M3 rounding
//      (cvt.rn.satfinite.e4m3x2, the instruction behind float_to_e4m3) and the stores: Q / index-Q
//      to the compact outputs, K / V / index-K to their cache row when the slot is valid.
// A token whose position is outside [0, max_pos) writes no cache and NaN (0x7F) Q / index-Q rows.
//
// Why 8 lanes x 16 channels rather than 16 x 8: the per-task overhead (index math, metadata,
// rsqrt, addresses) is shared by twice the values, the norm reduction needs 3 shuffles instead of
// 4 and RoPE needs none instead of 8 per lane: about 175 instructions per lane and head instead of
// ~2 x 150, so issue stays near half of the SM's slots at full HBM bandwidth (a 16-lane version
// would need ~85% of them and could not stay memory bound).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/numeric.h"
#include "core/ptx.cuh"
#include "stages/producer/producer.h"

namespace m3attn::producer_kernel {

constexpr int kThreads = 256;
constexpr int kLanesPerHead = 8;
constexpr int kGroupsPerBlock = kThreads / kLanesPerHead;  // 32
constexpr int kMinHeadsPerRow = 2;                         // kIndex with n_kv = 1
// Tasks per group (loads in flight per thread) is a template parameter kU: 3 for throughput,
// 1 for small batches (more, shorter blocks: lower latency when most SMs would idle anyway).
constexpr int kTasksSmall = 1;
constexpr int kTasksLarge = 3;
constexpr int tasks_per_block(int u) { return kGroupsPerBlock * u; }
// Tokens a block's tasks can touch: its tasks are consecutive and every token has >= 2 heads.
constexpr int max_tokens_per_block(int u) { return (tasks_per_block(u) - 1) / kMinHeadsPerRow + 2; }
constexpr int kRopeFloats = 64;        // [2][32] per position
constexpr int kTileBytes = 128 * 128;  // one (page, plane, head) tile

// Head kinds inside a packed row, and their norm-weight slots (V has none).
enum HeadKind : int { kQ = 0, kK = 1, kV = 2, kIQ = 3, kIK = 4 };
enum NormSlot : int { kNormQ = 0, kNormK = 1, kNormIQ = 2, kNormIK = 3, kNumNorms = 4 };
static_assert(int{kNormQ} == int{kQ} && int{kNormK} == int{kK} && int{kNormIQ} == int{kIQ} - 1 &&
                  int{kNormIK} == int{kIK} - 1,
              "process_task maps a head kind to its norm slot as kind - (kind > kV)");

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
  // Launched with programmatic dependent launch (ProducerCudaOptions::programmatic_launch): the
  // per-batch kernel then stages what no preceding kernel writes (norm weights, positions, slots,
  // RoPE rows) before its griddepcontrol.wait and issues the packed loads after it; launched
  // normally it issues the packed loads first (they overlap the staging). Same bytes either way.
  bool programmatic = false;
};

// Host side, used by the launcher: the kernel's arguments from validated params (T > 0).
inline KernelArgs make_kernel_args(const ProducerParams& p, int heads) {
  const bool uses_main = p.mode != ProducerMode::kIndex;
  const bool uses_index = p.mode != ProducerMode::kMain;
  KernelArgs a;
  a.packed = p.packed.ptr<const uint16_t>();
  a.packed_stride = p.packed.stride[0];
  a.positions = p.positions.ptr<const int32_t>();
  a.slots = p.slots.ptr<const int32_t>();
  a.rope = p.rope.ptr<const float>();
  const int64_t max_pos = p.rope.shape[0];
  a.max_pos = static_cast<uint32_t>(max_pos < (int64_t{1} << 31) ? max_pos : (int64_t{1} << 31));
  a.eps = p.eps;
  a.n_q = p.n_q;
  a.n_kv = p.n_kv;
  a.num_tasks = static_cast<uint32_t>(p.num_tokens * heads);
  a.heads = FastDivmod(static_cast<uint32_t>(heads));
  if (uses_main) {
    a.norm[kNormQ] = p.q_norm.ptr<const uint16_t>();
    a.norm[kNormK] = p.k_norm.ptr<const uint16_t>();
    a.q_out = p.q_out.ptr<uint8_t>();
    a.kv = p.kv_cache.ptr<uint8_t>();
    a.kv_page_stride = p.kv_cache.stride[0];
    a.kv_plane_stride = p.kv_cache.stride[1];
    a.num_pages = p.kv_cache.shape[0];
  }
  if (uses_index) {
    a.norm[kNormIQ] = p.iq_norm.ptr<const uint16_t>();
    a.norm[kNormIK] = p.ik_norm.ptr<const uint16_t>();
    a.iq_out = p.iq_out.ptr<uint8_t>();
    a.ic = p.index_cache.ptr<uint8_t>();
    a.ic_page_stride = p.index_cache.stride[0];
    a.num_pages = p.index_cache.shape[0];  // equal to the main cache's when fused (validated)
  }
  return a;
}

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

// Global stores of 4, 8 and 16 bytes (st.global: the destination rows are global memory even
// when their address comes from shared memory, as in the task plans, where a plain store through
// the pointer would compile to a generic one).
__device__ __forceinline__ void stg4(uint8_t* dst, uint32_t v) {
  __stwb(reinterpret_cast<unsigned int*>(dst), v);
}
__device__ __forceinline__ void stg8(uint8_t* dst, uint2 v) {
  __stwb(reinterpret_cast<uint2*>(dst), v);
}
__device__ __forceinline__ void stg16(uint8_t* dst, uint4 v) {
  __stwb(reinterpret_cast<uint4*>(dst), v);
}

// Cache rows are only 4-byte aligned in general (base and strides are multiples of 4).
__device__ __forceinline__ void store8_cache(uint8_t* dst, uint2 v) {
  if ((reinterpret_cast<uintptr_t>(dst) & 7u) == 0) {
    stg8(dst, v);
  } else {
    stg4(dst, v.x);
    stg4(dst + 4, v.y);
  }
}
__device__ __forceinline__ void store16_cache(uint8_t* dst, uint4 v) {
  const auto addr = reinterpret_cast<uintptr_t>(dst);
  if ((addr & 15u) == 0) {
    stg16(dst, v);
  } else if ((addr & 7u) == 0) {
    stg8(dst, make_uint2(v.x, v.y));
    stg8(dst + 8, make_uint2(v.z, v.w));
  } else {
    stg4(dst, v.x);
    stg4(dst + 4, v.y);
    stg4(dst + 8, v.z);
    stg4(dst + 12, v.w);
  }
}

// The 16 values of one lane: a[4] = channels 4j.., b[4] = 32 + 4j.., c[8] = 64 + 8j...
struct LaneRaw {
  uint2 a, b;
  uint4 c;
};

__device__ __forceinline__ void widen2(uint32_t w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

// Threads 0..63 stage the four norm weights as fp32 (1 + w) (unused ones are skipped), 32 float4
// per weight in the order the slices read them (norm_rope_slice): [0, 8) channels 4q .. 4q + 3
// (A of slice q), [8, 16) the same for B, then the C halves: [16, 24) channels 64 + 8j .. + 3 and
// [24, 32) channels 68 + 8j .. + 3 of slice j = q - 16 / q - 24. So the 8 lanes of a slice
// group read 128 contiguous bytes per load (one C load spanning 256 bytes cost twice the
// shared-memory wavefronts).
__device__ __forceinline__ void stage_norms(const KernelArgs& a, float4 (*s_norm)[32]) {
  if (threadIdx.x < kNumNorms * 16) {
    const int which = threadIdx.x / 16;
    const int part = threadIdx.x % 16;
    const uint16_t* w = a.norm[which];
    if (w != nullptr) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(w) + part);
      float f[8];
      widen2(v.x, f[0], f[1]);
      widen2(v.y, f[2], f[3]);
      widen2(v.z, f[4], f[5]);
      widen2(v.w, f[6], f[7]);
      // Channels 8 part .. 8 part + 7: A / B halves in place, C of slice part - 8 split.
      const int q0 = part < 8 ? 2 * part : 8 + part;
      const int q1 = part < 8 ? 2 * part + 1 : 16 + part;
      s_norm[which][q0] = make_float4(1.0f + f[0], 1.0f + f[1], 1.0f + f[2], 1.0f + f[3]);
      s_norm[which][q1] = make_float4(1.0f + f[4], 1.0f + f[5], 1.0f + f[6], 1.0f + f[7]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The per-task arithmetic, shared by every kernel so that all of them produce the same bytes. A
// head's 128 channels are 8 slices j = 0..7 of 16 values (lane j of a group holds slice j):
//   A = channels [4j, 4j + 4)   B = [32 + 4j, 36 + 4j)   C = [64 + 8j, 72 + 8j)
// The sum of squares is taken per slice (two chains), then over the slices by an xor tree of
// distance 4, 2, 1; then y = (y * rsqrt(ss / 128 + eps)) * (1 + w), RoPE on the slice's own pairs
// (i, i + 32), one E4M3 rounding.

// Where a task writes and what it needs: token t (k = t - t_first in the staged rows), head kind,
// index inside its segment, position check and slot.
struct TaskInfo {
  uint32_t t;
  int k, kind, sub;
  int32_t slot;
  bool pos_ok;
};
template <ProducerMode kMode>
__device__ __forceinline__ TaskInfo task_info(const KernelArgs& a, uint32_t task, uint32_t t_first,
                                              const int32_t* s_pos, const int32_t* s_slot) {
  TaskInfo ti;
  uint32_t h;
  a.heads.divmod(task, ti.t, h);
  ti.k = static_cast<int>(ti.t - t_first);
  classify_head<kMode>(static_cast<int>(h), a.n_q, a.n_kv, ti.kind, ti.sub);
  const int32_t pos = s_pos[ti.k];
  ti.slot = s_slot[ti.k];
  ti.pos_ok = static_cast<uint32_t>(pos) < a.max_pos;
  return ti;
}

// y[0..3] = A, y[4..7] = B, y[8..15] = C of one slice, from its raw BF16 words.
__device__ __forceinline__ void widen_slice(const LaneRaw& raw, float (&y)[16]) {
  widen2(raw.a.x, y[0], y[1]);
  widen2(raw.a.y, y[2], y[3]);
  widen2(raw.b.x, y[4], y[5]);
  widen2(raw.b.y, y[6], y[7]);
  widen2(raw.c.x, y[8], y[9]);
  widen2(raw.c.y, y[10], y[11]);
  widen2(raw.c.z, y[12], y[13]);
  widen2(raw.c.w, y[14], y[15]);
}

// Sum of squares of a slice: two partial sums (even / odd values) halve the dependent FMA chain.
__device__ __forceinline__ float slice_sum_squares(const float (&y)[16]) {
  float ss0 = 0.0f, ss1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    ss0 = fmaf(y[i], y[i], ss0);
    ss1 = fmaf(y[i + 1], y[i + 1], ss1);
  }
  return ss0 + ss1;
}

// The RMSNorm scale of a head from its sum of squares.
__device__ __forceinline__ float rms_scale(float ss, float eps) {
  return rsqrtf(ss * (1.0f / 128.0f) + eps);
}

// Gemma RMSNorm of slice j with the scale r and the head's (1 + w) row `w` (fp32, 32 float4),
// then (when the position is inside the table) partial NeoX RoPE with the token's row: pair
// i = 4j + m is (y[m], y[4 + m]).
__device__ __forceinline__ void norm_rope_slice(float (&y)[16], float r, const float4* w,
                                                const float4* rope, bool pos_ok, int j) {
  const float4 wa = w[j];        // channels 4j ..
  const float4 wb = w[8 + j];    // channels 32 + 4j ..
  const float4 wc0 = w[16 + j];  // channels 64 + 8j .. (stage_norms' order)
  const float4 wc1 = w[24 + j];  // channels 68 + 8j ..
  const float wv[16] = {wa.x,  wa.y,  wa.z,  wa.w,  wb.x,  wb.y,  wb.z,  wb.w,
                        wc0.x, wc0.y, wc0.z, wc0.w, wc1.x, wc1.y, wc1.z, wc1.w};
#pragma unroll
  for (int i = 0; i < 16; ++i) y[i] = (y[i] * r) * wv[i];
  if (pos_ok) {
    const float4 c4 = rope[j];      // cos[4j .. 4j + 3]
    const float4 s4 = rope[8 + j];  // sin[4j .. 4j + 3]
    const float c[4] = {c4.x, c4.y, c4.z, c4.w};
    const float s[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      // Written as the FMAs the compiler formed from lo c - hi s and hi c + lo s, so that no
      // layout's contraction can differ.
      const float lo = y[m], hi = y[4 + m];
      y[m] = fmaf(lo, c[m], -(hi * s[m]));
      y[4 + m] = fmaf(lo, s[m], hi * c[m]);
    }
  }
}

// The E4M3 bytes of a slice: A and B 4 bytes each, C 8.
struct SliceCode {
  uint32_t a, b;
  uint2 c;
};
__device__ __forceinline__ SliceCode encode_slice(const float (&y)[16]) {
  SliceCode code;
  code.a = pack4_e4m3(y[0], y[1], y[2], y[3]);
  code.b = pack4_e4m3(y[4], y[5], y[6], y[7]);
  code.c = make_uint2(pack4_e4m3(y[8], y[9], y[10], y[11]), pack4_e4m3(y[12], y[13], y[14], y[15]));
  return code;
}
constexpr uint32_t kNanE4m3x4 = 0x7f7f7f7fu;

// The task's 128-byte destination row, or null for no write: Q / index-Q rows always (filled
// with 0x7F when the position is outside the table: see nan_row), K / V / index-K rows when the
// position and the slot are valid.
__device__ __forceinline__ bool is_compact(int kind) { return kind == kQ || kind == kIQ; }
__device__ __forceinline__ bool nan_row(const TaskInfo& ti) {
  return is_compact(ti.kind) && !ti.pos_ok;
}
__device__ __forceinline__ uint8_t* task_row(const KernelArgs& a, const TaskInfo& ti) {
  if (is_compact(ti.kind)) {
    // t * n + sub < T * H <= 2^31 - 1 (checked by the launcher): a 32-bit row index.
    return ti.kind == kQ ? a.q_out + static_cast<uint64_t>(ti.t * a.n_q + ti.sub) * 128
                         : a.iq_out + static_cast<uint64_t>(ti.t * a.n_kv + ti.sub) * 128;
  }
  if (ti.pos_ok && ti.slot >= 0 && (ti.slot >> 7) < a.num_pages) {
    const int64_t page = ti.slot >> 7;
    const int64_t in_page = static_cast<int64_t>(ti.slot & 127) * 128;
    if (ti.kind == kIK) return a.ic + page * a.ic_page_stride + in_page;
    return a.kv + page * a.kv_page_stride + (ti.kind == kV ? a.kv_plane_stride : 0) +
           static_cast<int64_t>(ti.sub) * kTileBytes + in_page;
  }
  return nullptr;
}

// Slice `lane` of a BF16 head in shared memory (8 lanes per head).
__device__ __forceinline__ LaneRaw load_slice8(const uint8_t* head, int lane) {
  LaneRaw raw;
  raw.a = *reinterpret_cast<const uint2*>(head + 8 * lane);
  raw.b = *reinterpret_cast<const uint2*>(head + 64 + 8 * lane);
  raw.c = *reinterpret_cast<const uint4*>(head + 128 + 16 * lane);
  return raw;
}

// The E4M3 bytes of slice `lane` of a head on 8 lanes (one slice per lane) from its raw words:
// norm (not for V: kind == kV), RoPE when pos_ok, one rounding. `w` is the head's (1 + w) row,
// `rope` the token's RoPE row. Executed by every lane of the warp (the shuffles stay converged;
// V computes the sum and discards it).
__device__ __forceinline__ SliceCode compute_slice8(const LaneRaw& raw, int kind, const float4* w,
                                                    const float4* rope, bool pos_ok, float eps,
                                                    int lane) {
  float y[16];
  widen_slice(raw, y);
  float ss = slice_sum_squares(y);
#pragma unroll
  for (int off = kLanesPerHead / 2; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (kind != kV) norm_rope_slice(y, rms_scale(ss, eps), w, rope, pos_ok, lane);
  return encode_slice(y);
}

// Stores slice `lane`'s bytes into its 128-byte row (Q / index-Q rows 16-byte aligned, cache rows
// 4-byte aligned).
__device__ __forceinline__ void store_slice8(uint8_t* row, int lane, const SliceCode& code) {
  stg4(row + 4 * lane, code.a);
  stg4(row + 32 + 4 * lane, code.b);
  store8_cache(row + 64 + 8 * lane, code.c);
}
__device__ __forceinline__ void set_nan(SliceCode& code) {
  code.a = code.b = code.c.x = code.c.y = kNanE4m3x4;
}
// kQ, kK, kIQ, kIK -> kNormQ, kNormK, kNormIQ, kNormIK (V: any; unused).
__device__ __forceinline__ int norm_slot(int kind) { return kind - (kind > kV); }

// One task (the lane's slice j = lane of head h of token t): norm, RoPE, E4M3 and the stores.
// Every 8-lane kernel calls this, so they produce identical bytes. `s_pos`, `s_slot` and `s_rope`
// are the batch's staged rows, indexed by t - t_first. Executed by every lane of the warp
// (shuffles); `valid` false computes on the batch's first task and stores nothing.
template <ProducerMode kMode>
__device__ __forceinline__ void process_task(const KernelArgs& a, const LaneRaw& raw, uint32_t task,
                                             bool valid, uint32_t fallback_task, uint32_t t_first,
                                             int lane, const float4 (*s_norm)[32],
                                             const float4 (*s_rope)[kRopeFloats / 4],
                                             const int32_t* s_pos, const int32_t* s_slot) {
  const TaskInfo ti = task_info<kMode>(a, valid ? task : fallback_task, t_first, s_pos, s_slot);
  SliceCode code = compute_slice8(raw, ti.kind, s_norm[norm_slot(ti.kind)], s_rope[ti.k], ti.pos_ok,
                                  a.eps, lane);
  if (!valid) return;
  if (nan_row(ti)) set_nan(code);
  uint8_t* row = task_row(a, ti);
  if (row != nullptr) store_slice8(row, lane, code);
}

// Shared-memory address of a generic pointer (cp.async, mbarrier and bulk-copy operands).
using sm90::smem_addr;

}  // namespace m3attn::producer_kernel
