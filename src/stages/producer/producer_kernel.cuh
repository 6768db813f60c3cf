// Device code of the producer (SPEC sections 3-4): one kernel template over the mode.
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
//
// kU (tasks per group) is 3 for large batches (96 B of loads in flight per thread, 64 registers,
// 4 blocks of 256 threads per SM: ~96 KB in flight per SM) and 1 below one full wave of blocks,
// where more and shorter blocks cut the latency of decode-sized calls.
//
// Three kernels share the per-task code (process_task), so they write identical bytes:
//   per-batch  (producer_kernel): one block per batch, load -> position -> RoPE row -> barrier ->
//              compute -> store -> exit. Measured on the H200 at T 4096: 43.5 us (65% of copy).
//              Model: steady state 9.9 ns/token (70%: 165.0 - 43.5 us over 12,288 tokens) plus
//              ~3 us fixed, so the loss is per-SM concurrency, not the tail. Each block's life is
//              two dependent memory latencies (position, then RoPE row) + compute, and its 24.6 KB
//              of packed reads are in flight only during the first latency.
//   persistent (producer_persistent_kernel): SMs x 2 blocks walk the batches with the next
//              batch's packed loads, RoPE rows and the positions two batches ahead in flight
//              during compute. Measured: 43.9 us at T 4096 (64.8%), 158.3 us at 16384 (71.8%):
//              no better. Nsight Compute on both: 116 (persistent) / 64 (per-batch) registers,
//              25% / 50% occupancy, issue slots 54% / 51% busy, IPC 2.4 / 2.3, DRAM 47% / 46% of
//              peak, ALU (integer) the busiest pipe at 35%: neither memory- nor issue-bound, i.e.
//              latency-bound. SM active cycles x IPC / tasks = ~290 warp instructions per 4 tasks
//              (one warp-step): the compute phase is long and, with loads tied to registers, the
//              bytes in flight per SM fall whenever the warps compute.
//   bulk-copy pipeline (producer_tma_kernel, ProducerCudaKernel::kTmaPipeline, end of file; the
//              default from 2^17 tasks): warp-specialized: one copy warp per block streams tiles
//              of 128 tasks (32 KB) into a ring of 2-4 shared-memory stages with cp.async.bulk
//              (TMA) and an mbarrier per stage, 8 compute warps read the heads from shared memory.
//              Bytes in flight no longer depend on registers or on what the compute warps do, and
//              the compute warps lose the global-load address math, the staging loops and the
//              block barrier. Round 2 on the H200 (first version, 8 lanes per head): 2 stages
//              (3 blocks = 24 compute warps per SM) 35.0 us at T 4096 (81.2% of copy), 136.5 us
//              at 16384 (83.2%); 3 stages (2 blocks) 36.5 / 137.4 us; 1 block per SM 43 / 151 us.
//              ncu (3 stages, T 4096): issue slots 57-59% busy, IPC 2.65, DRAM 57-59% of peak,
//              ~262 warp instructions per 4 heads, SM active only 89% of the elapsed cycles (the
//              tile tail: 9.33 tiles per block). So: still partly issue/latency-bound (more
//              compute warps per SM are faster) and losing ~10% to the ramp and the tail. Since:
//              each block takes an equal share of the tasks (no tile tail), the copy warp issues a
//              tile's packed copies before its metadata and prefetches the next tile's positions
//              (stages fill after one latency), and a 4-lane-per-head variant (process_task4: 32
//              channels per lane) is selectable. Round 3 (before the partial-tile fix below):
//              default (2 stages, 8 lanes) 36.5 us at T 4096 (77.8%), 140.3 us at 16384 (81.0%);
//              4 lanes 34.3 us (82.9%, 4 stages, 1 block per SM) and 138.2 us (82.2%, 2 stages):
//              ~20% fewer instructions per head than 8 lanes (ncu: ~213 vs ~266 per 4 heads), but
//              not faster in proportion. With equal shares every block ended on a partial tile
//              whose empty rounds were still computed (~11% of the compute at T 4096, none at
//              16384): now skipped. Left: issue slots 51-66% busy, DRAM ~58% of peak, ~2 eligible
//              warps per scheduler: the compute warps are latency-bound (shared loads, the
//              shuffle reduction, rsqrt, F2FP in one dependent chain per task).
//
// Bytes per token at M3 TP1 (fused): read 9856 * 2 (packed) + 8 (position, slot) + 256 (RoPE row);
// write 64 * 128 (Q) + 4 * 128 (index-Q) + 2 * 4 * 128 (K, V) + 128 (index-K) = 29,832 B. The
// kernel should be bound by HBM bandwidth: ~4.3 TB/s copy gives ~28 us at T = 4096 (~6.9 ns per
// token); 85% of copy is 33.4 us at T 4096 and 134 us at T 16384.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/numeric.h"
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

// Below one full wave of 1-task blocks (132 SMs x 4 blocks x 32 tasks, about 220 tokens at M3
// TP1) 3-task groups would leave SMs idle, so 1-task groups trade nothing for a shorter critical
// path per block. Both variants compute identical bytes; only the grid differs.
constexpr int64_t kAssumedSms = 132;  // H200; only tunes the choice, never correctness
constexpr int64_t kSmallBatchTasks = kAssumedSms * 4 * tasks_per_block(kTasksSmall);
inline bool use_small_variant(int64_t tasks) { return tasks < kSmallBatchTasks; }

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

// The 16 values of one lane: a[4] = channels 4j.., b[4] = 32 + 4j.., c[8] = 64 + 8j...
struct LaneRaw {
  uint2 a, b;
  uint4 c;
};

__device__ __forceinline__ void widen2(uint32_t w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

// Stores 4 bytes at dst (4-byte aligned).
__device__ __forceinline__ void store4(uint8_t* dst, uint32_t v) {
  *reinterpret_cast<uint32_t*>(dst) = v;
}

// Issues the packed loads of the kU tasks this thread's group owns in the batch starting at
// `first` (tasks first + u * 32 + group); tasks past the end read nothing and stay zero.
template <int kU>
__device__ __forceinline__ void load_batch(const KernelArgs& a, uint32_t first, int group, int lane,
                                           LaneRaw (&raw)[kU]) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const uint32_t task = first + u * kGroupsPerBlock + group;
    raw[u].a = raw[u].b = make_uint2(0, 0);
    raw[u].c = make_uint4(0, 0, 0, 0);
    if (task < a.num_tasks) {
      uint32_t t, h;
      a.heads.divmod(task, t, h);
      const uint16_t* head =
          a.packed + static_cast<int64_t>(t) * a.packed_stride + static_cast<int64_t>(h) * 128;
      raw[u].a = __ldcs(reinterpret_cast<const uint2*>(head + 4 * lane));
      raw[u].b = __ldcs(reinterpret_cast<const uint2*>(head + 32 + 4 * lane));
      raw[u].c = __ldcs(reinterpret_cast<const uint4*>(head + 64 + 8 * lane));
    }
  }
}

// Threads 0..63 stage the four norm weights as fp32 (1 + w) (unused ones are skipped).
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
      s_norm[which][2 * part] = make_float4(1.0f + f[0], 1.0f + f[1], 1.0f + f[2], 1.0f + f[3]);
      s_norm[which][2 * part + 1] = make_float4(1.0f + f[4], 1.0f + f[5], 1.0f + f[6], 1.0f + f[7]);
    }
  }
}

// One task (the lane's 16 values of head h of token t): norm, RoPE, E4M3 and the stores. Both
// kernels call this, so they produce identical bytes. `s_pos`, `s_slot` and `s_rope` are the
// batch's staged rows, indexed by t - t_first. Executed by every lane of the warp (shuffles);
// `valid` false computes on the batch's first task and stores nothing.
template <ProducerMode kMode>
__device__ __forceinline__ void process_task(const KernelArgs& a, const LaneRaw& raw, uint32_t task,
                                             bool valid, uint32_t fallback_task, uint32_t t_first,
                                             int lane, const float4 (*s_norm)[32],
                                             const float4 (*s_rope)[kRopeFloats / 4],
                                             const int32_t* s_pos, const int32_t* s_slot) {
  uint32_t t, h;
  a.heads.divmod(valid ? task : fallback_task, t, h);
  const int k = static_cast<int>(t - t_first);
  int kind, sub;
  classify_head<kMode>(static_cast<int>(h), a.n_q, a.n_kv, kind, sub);
  const int32_t pos = s_pos[k];
  const int32_t slot = s_slot[k];
  const bool pos_ok = static_cast<uint32_t>(pos) < a.max_pos;

  // y[0..3] = A, y[4..7] = B, y[8..15] = C.
  float y[16];
  widen2(raw.a.x, y[0], y[1]);
  widen2(raw.a.y, y[2], y[3]);
  widen2(raw.b.x, y[4], y[5]);
  widen2(raw.b.y, y[6], y[7]);
  widen2(raw.c.x, y[8], y[9]);
  widen2(raw.c.y, y[10], y[11]);
  widen2(raw.c.z, y[12], y[13]);
  widen2(raw.c.w, y[14], y[15]);

  // Gemma RMSNorm. Every lane reduces (V discards the result) so the shuffles stay converged.
  // Two partial sums (even / odd channels) halve the dependent FMA chain.
  float ss0 = 0.0f, ss1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    ss0 = fmaf(y[i], y[i], ss0);
    ss1 = fmaf(y[i + 1], y[i + 1], ss1);
  }
  float ss = ss0 + ss1;
#pragma unroll
  for (int off = kLanesPerHead / 2; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (kind != kV) {
    const float r = rsqrtf(ss * (1.0f / 128.0f) + a.eps);
    const int ws = kind - (kind > kV);       // kQ, kK, kIQ, kIK -> kNormQ, kNormK, kNormIQ, kNormIK
    const float4 wa = s_norm[ws][lane];      // channels 4j ..
    const float4 wb = s_norm[ws][8 + lane];  // channels 32 + 4j ..
    const float4 wc0 = s_norm[ws][16 + 2 * lane];      // channels 64 + 8j ..
    const float4 wc1 = s_norm[ws][16 + 2 * lane + 1];  // channels 68 + 8j ..
    const float w[16] = {wa.x,  wa.y,  wa.z,  wa.w,  wb.x,  wb.y,  wb.z,  wb.w,
                         wc0.x, wc0.y, wc0.z, wc0.w, wc1.x, wc1.y, wc1.z, wc1.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) y[i] = (y[i] * r) * w[i];

    // Partial NeoX RoPE: pair i = 4j + m is (y[m], y[4 + m]).
    if (pos_ok) {
      const float4 c4 = s_rope[k][lane];      // cos[4j .. 4j + 3]
      const float4 s4 = s_rope[k][8 + lane];  // sin[4j .. 4j + 3]
      const float c[4] = {c4.x, c4.y, c4.z, c4.w};
      const float s[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const float lo = y[m], hi = y[4 + m];
        y[m] = lo * c[m] - hi * s[m];
        y[4 + m] = hi * c[m] + lo * s[m];
      }
    }
  }

  uint32_t code_a = pack4_e4m3(y[0], y[1], y[2], y[3]);
  uint32_t code_b = pack4_e4m3(y[4], y[5], y[6], y[7]);
  uint2 code_c =
      make_uint2(pack4_e4m3(y[8], y[9], y[10], y[11]), pack4_e4m3(y[12], y[13], y[14], y[15]));
  if (!valid) return;
  uint8_t* row = nullptr;  // the 128-byte destination row, or null for no write
  if (kind == kQ || kind == kIQ) {
    if (!pos_ok) {
      code_a = code_b = code_c.x = code_c.y = 0x7f7f7f7fu;
    }
    // t * n + sub < T * H <= 2^31 - 1 (checked by the launcher): a 32-bit row index.
    row = kind == kQ ? a.q_out + static_cast<uint64_t>(t * a.n_q + sub) * 128
                     : a.iq_out + static_cast<uint64_t>(t * a.n_kv + sub) * 128;
  } else if (pos_ok && slot >= 0 && (slot >> 7) < a.num_pages) {
    const int64_t page = slot >> 7;
    const int64_t in_page = static_cast<int64_t>(slot & 127) * 128;
    if (kind == kIK) {
      row = a.ic + page * a.ic_page_stride + in_page;
    } else {
      row = a.kv + page * a.kv_page_stride + (kind == kV ? a.kv_plane_stride : 0) +
            static_cast<int64_t>(sub) * kTileBytes + in_page;
    }
  }
  if (row != nullptr) {
    store4(row + 4 * lane, code_a);
    store4(row + 32 + 4 * lane, code_b);
    store8_cache(row + 64 + 8 * lane, code_c);
  }
}

// ------------------------------------------------------------------------------------------------
// The per-batch kernel: one block = one batch of 32 kU tasks, then exit.

template <ProducerMode kMode, int kU>
__global__ void __launch_bounds__(kThreads, 4) producer_kernel(const KernelArgs a) {
  constexpr int kTasksPerBlock = tasks_per_block(kU);
  constexpr int kMaxTokensPerBlock = max_tokens_per_block(kU);
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
  LaneRaw raw[kU];
  load_batch<kU>(a, block_first, group, lane, raw);

  // ---- phase 2: norm weights, positions, slots and RoPE rows into shared memory ----
  stage_norms(a, s_norm);
  const int n_tok = static_cast<int>(t_last - t_first) + 1;
  for (int e = threadIdx.x; e < n_tok * 16; e += kThreads) {
    const int k = e / 16;
    const int part = e % 16;
    const uint32_t t = t_first + k;
    const int32_t pos = __ldg(a.positions + t);
    if (part == 0) {
      s_pos[k] = pos;
      s_slot[k] = __ldg(a.slots + t);
    }
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (static_cast<uint32_t>(pos) < a.max_pos)
      r = __ldg(reinterpret_cast<const float4*>(a.rope + static_cast<int64_t>(pos) * kRopeFloats) +
                part);
    s_rope[k][part] = r;
  }
  __syncthreads();

  // ---- phase 3: norm, RoPE, E4M3, store ----
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const uint32_t task = block_first + u * kGroupsPerBlock + group;
    process_task<kMode>(a, raw[u], task, task < a.num_tasks, block_first, t_first, lane, s_norm,
                        s_rope, s_pos, s_slot);
  }
}

// ------------------------------------------------------------------------------------------------
// The persistent kernel: a grid of about (SMs x kPersistentBlocksPerSm) blocks walks the batches
// b = blockIdx.x, + gridDim.x, ... and software-pipelines them. While batch b is computed, the
// block already has in flight: the packed loads of batch b + G (registers), the RoPE rows of
// b + G (cp.async into shared memory, from positions staged one iteration earlier) and the
// positions / slots of b + 2G (cp.async). Per iteration the critical path is
// max(one memory latency, compute) instead of the per-batch kernel's two dependent latencies
// (position -> RoPE row) + compute + launch; each SM keeps ~2 x 24.6 KB of packed reads in
// flight nearly all the time. Shared memory: positions / slots in 3 stages (b, b + G, b + 2G),
// RoPE rows in 2 (b, b + G); one cp.async wait + barrier per iteration orders every reuse (a
// stage is refilled only in the iteration after its last reader, past that barrier).

constexpr int kPersistentTasks = kTasksLarge;  // tasks per group and batch (96 per batch)
constexpr int kPersistentBlocksPerSm = 2;      // ~100 registers per thread fit twice per SM

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
// Copies 16 bytes, or writes 16 zero bytes and reads nothing when `copy` is false.
__device__ __forceinline__ void cp_async16_or_zero(void* dst, const void* src, bool copy) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(copy ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// First task and token of a batch, and its token count.
template <int kU>
__device__ __forceinline__ void batch_tokens(const KernelArgs& a, uint32_t batch, uint32_t& first,
                                             uint32_t& t_first, int& n_tok) {
  first = batch * static_cast<uint32_t>(tasks_per_block(kU));
  const uint32_t last = min(first + tasks_per_block(kU), a.num_tasks) - 1;
  t_first = a.heads.div(first);
  n_tok = static_cast<int>(a.heads.div(last) - t_first) + 1;
}

template <int kU>
__device__ __forceinline__ void stage_pos_slot(const KernelArgs& a, uint32_t batch, int32_t* s_pos,
                                               int32_t* s_slot) {
  uint32_t first, t_first;
  int n_tok;
  batch_tokens<kU>(a, batch, first, t_first, n_tok);
  for (int k = threadIdx.x; k < n_tok; k += kThreads) {
    cp_async4(s_pos + k, a.positions + t_first + k);
    cp_async4(s_slot + k, a.slots + t_first + k);
  }
}

// RoPE rows of the batch's tokens from their staged positions (complete and visible: staged in an
// earlier iteration, before a wait + barrier); zeros for a position outside the table.
template <int kU>
__device__ __forceinline__ void stage_rope(const KernelArgs& a, uint32_t batch,
                                           const int32_t* s_pos,
                                           float4 (*s_rope)[kRopeFloats / 4]) {
  uint32_t first, t_first;
  int n_tok;
  batch_tokens<kU>(a, batch, first, t_first, n_tok);
  for (int e = threadIdx.x; e < n_tok * 16; e += kThreads) {
    const int k = e / 16;
    const int part = e % 16;
    const int32_t pos = s_pos[k];
    const bool ok = static_cast<uint32_t>(pos) < a.max_pos;
    const float* src = a.rope + (ok ? static_cast<int64_t>(pos) * kRopeFloats + part * 4 : 0);
    cp_async16_or_zero(&s_rope[k][part], src, ok);
  }
}

template <ProducerMode kMode>
__global__ void __launch_bounds__(kThreads, kPersistentBlocksPerSm)
    producer_persistent_kernel(const KernelArgs a, uint32_t num_batches) {
  constexpr int kU = kPersistentTasks;
  constexpr int kMaxTok = max_tokens_per_block(kU);
  __shared__ float4 s_norm[kNumNorms][32];
  __shared__ float4 s_rope[2][kMaxTok][kRopeFloats / 4];
  __shared__ int32_t s_pos[3][kMaxTok];
  __shared__ int32_t s_slot[3][kMaxTok];

  const uint32_t stride = gridDim.x;
  uint32_t b = blockIdx.x;
  if (b >= num_batches) return;  // the launcher never makes such blocks; uniform per block
  const int lane = threadIdx.x & (kLanesPerHead - 1);
  const int group = threadIdx.x / kLanesPerHead;

  // Prologue: positions / slots of b and b + G, the packed loads of b, then b's RoPE rows.
  LaneRaw raw[kU];
  load_batch<kU>(a, b * static_cast<uint32_t>(tasks_per_block(kU)), group, lane, raw);
  stage_pos_slot<kU>(a, b, s_pos[0], s_slot[0]);
  if (b + stride < num_batches) stage_pos_slot<kU>(a, b + stride, s_pos[1], s_slot[1]);
  stage_norms(a, s_norm);
  cp_async_wait_all();
  __syncthreads();
  stage_rope<kU>(a, b, s_pos[0], s_rope[0]);
  cp_async_wait_all();
  __syncthreads();

  int ps = 0;  // positions / slots stage of batch b (of 3)
  int rs = 0;  // RoPE stage of batch b (of 2)
#pragma unroll 1
  for (;;) {
    const uint32_t bn = b + stride;
    const bool has_next = bn < num_batches;
    const int ps1 = ps == 2 ? 0 : ps + 1;
    const int ps2 = ps1 == 2 ? 0 : ps1 + 1;
    LaneRaw next[kU];
    if (has_next) {
      load_batch<kU>(a, bn * static_cast<uint32_t>(tasks_per_block(kU)), group, lane, next);
      stage_rope<kU>(a, bn, s_pos[ps1], s_rope[rs ^ 1]);
      if (bn + stride < num_batches) stage_pos_slot<kU>(a, bn + stride, s_pos[ps2], s_slot[ps2]);
    }

    uint32_t first, t_first;
    int n_tok;
    batch_tokens<kU>(a, b, first, t_first, n_tok);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t task = first + u * kGroupsPerBlock + group;
      process_task<kMode>(a, raw[u], task, task < a.num_tasks, first, t_first, lane, s_norm,
                          s_rope[rs], s_pos[ps], s_slot[ps]);
    }
    if (!has_next) break;
    cp_async_wait_all();
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kU; ++u) raw[u] = next[u];
    b = bn;
    ps = ps1;
    rs ^= 1;
  }
}

// Number of batches (32 kU tasks each) of a call.
constexpr int64_t num_batches(int64_t tasks, int u) {
  return (tasks + tasks_per_block(u) - 1) / tasks_per_block(u);
}

// ------------------------------------------------------------------------------------------------
// The bulk-copy pipeline kernel (ProducerCudaKernel::kTmaPipeline). Warp-specialized persistent
// blocks of 8 compute warps + 1 copy warp; the packed rows never pass through the compute warps'
// registers on their way from HBM: the copy warp moves them into a ring of kTmaStages shared-memory
// stages with cp.async.bulk (the Hopper TMA unit's 1-D copy, completion counted in bytes on an
// mbarrier), and the compute warps read them from shared memory.
//
// Work: block b owns the tasks [b N / G, (b + 1) N / G) of the N tasks (G blocks: equal shares,
// no tile tail), walked in tiles of kTmaTileTasks = 128 consecutive tasks (32 KB of packed BF16,
// 1.66 tokens at M3 TP1; the last one of a block partial), the same (token, head) numbering as
// above. With 8 lanes per head, group g (0..31) of the compute warps takes tasks first + 32 r + g,
// r = 0..3, and runs process_task on them, so this kernel writes the same bytes as the other two;
// with 4 lanes, group g (0..63) takes first + 64 r + g, r = 0..1 (process_task4). Per stage the
// copy warp also stages the tile's positions and slots (loaded into registers one tile ahead,
// stored with st.shared by the copy lanes, each lane arriving on the stage's "full" barrier after
// its own writes) and the RoPE rows of the positions inside the table (bulk copies, 256 B each).
// Per token of a tile one bulk copy moves the token's heads inside the tile (rows are contiguous
// from head h0 to h1 whatever the row stride), so a tile costs 2-3 copies at M3 TP1.
//
// Why: the per-batch and persistent kernels keep their loads in registers (96 B per thread), so
// bytes in flight are tied to registers and occupancy (116 registers: 25% occupancy, 47% of DRAM
// peak measured), and each block's life is a chain of dependent latencies. Here the bytes in
// flight per SM are the stages being filled: with 2 stages of 33.6 KB and 3 blocks per SM (3 x
// 69 KB of shared memory at M3 TP1, 70 registers), up to 3 stages = 100 KB per SM can be in
// flight while 3 are computed; 85% of 4.3 TB/s with ~1.5 us loaded latency needs ~28 KB of reads
// in flight per SM.
// The compute warps then only issue: shared loads (3 per task and lane instead of 3 global loads
// plus their address math), the per-task math and the stores; no barrier of the whole block per
// batch and no dependent position -> RoPE load in their path (the copy warp, running up to 2
// tiles ahead, absorbs it).
// Synchronisation per stage s (use u = it / kTmaStages of iteration it):
//   full[s]  (32 arrivals: every copy lane after its st.shared and its expect_tx; + the bytes of
//            the copies): the compute warps wait parity u&1;
//   empty[s] (8 arrivals: one per compute warp after its last shared read of the stage): the copy
//            warp waits parity (u - 1)&1 before refilling the stage (it >= kTmaStages).

constexpr int kTmaComputeWarps = 8;
constexpr int kTmaThreads = (kTmaComputeWarps + 1) * 32;
constexpr int kTmaTileTasks = kTmaComputeWarps * 32 / kLanesPerHead * 4;  // 128: 4 rounds
// Defaults of ProducerCudaOptions' tma_stages / tma_lanes_per_head (2, 3, 4 stages and 4 or 8
// lanes are all built): measured best on the H200 (round 2: 2 stages = 3 blocks per SM).
constexpr int kTmaStagesDefault = 2;
constexpr int kTmaLanesDefault = 8;
constexpr int kTmaStagesMax = 4;
// kAuto runs the bulk-copy kernel from 2^17 tasks on (about 1700 tokens at M3 TP1, ~1000 tiles:
// ~4 per block): measured faster than the per-batch kernel at T 4096 and 16384 and slower at
// T <= 1024, where a call is a few tiles per block and the pipeline's fill dominates.
constexpr int64_t kTmaMinTasks = int64_t{1} << 17;
inline bool use_tma_variant(int64_t tasks) { return tasks >= kTmaMinTasks; }
constexpr int kHeadBytes = 128 * 2;  // one BF16 head
static_assert(kTmaComputeWarps * 32 == kThreads, "compute warps are the 256-thread group layout");

// Shared-memory layout of one stage (bytes), from the heads per row (host and device agree).
struct TmaGeometry {
  uint32_t num_tiles = 0;
  uint32_t max_tok = 0;      // tokens a tile can touch: (128 - 1) / H + 2
  uint32_t rope_off = 0;     // [max_tok][64] f32
  uint32_t pos_off = 0;      // [max_tok] i32
  uint32_t slot_off = 0;     // [max_tok] i32
  uint32_t stage_bytes = 0;  // multiple of 16
};

__host__ __device__ constexpr uint32_t round_up16(uint32_t x) { return (x + 15u) & ~15u; }

inline TmaGeometry make_tma_geometry(int64_t tasks, int heads) {
  TmaGeometry g;
  g.num_tiles = static_cast<uint32_t>((tasks + kTmaTileTasks - 1) / kTmaTileTasks);
  g.max_tok = static_cast<uint32_t>((kTmaTileTasks - 1) / heads + 2);
  g.rope_off = kTmaTileTasks * kHeadBytes;
  g.pos_off = g.rope_off + g.max_tok * kRopeFloats * 4;
  g.slot_off = g.pos_off + round_up16(g.max_tok * 4);
  g.stage_bytes = g.slot_off + round_up16(g.max_tok * 4);
  return g;
}
inline size_t tma_smem_bytes(const TmaGeometry& g, int stages) {
  return static_cast<size_t>(stages) * g.stage_bytes;
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.b32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// 1-D bulk copy global -> shared, completion (bytes) counted on `bar`. 16-byte aligned addresses,
// size a multiple of 16.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes,
                                              uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;\n" ::"r"(smem_addr(dst)),
      "l"(static_cast<uint64_t>(__cvta_generic_to_global(src))), "r"(bytes), "r"(smem_addr(bar)),
      "l"(policy)
      : "memory");
}
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Tasks [first, last] of a tile and the tokens t_first .. t_first + n_tok - 1 they touch.
struct TileSpan {
  uint32_t first = 0, last = 0, t_first = 0;
  int n_tok = 0;
};
__device__ __forceinline__ TileSpan tile_span(const KernelArgs& a, uint32_t first, uint32_t end) {
  TileSpan sp;
  sp.first = first;
  sp.last = min(first + kTmaTileTasks, end) - 1;
  sp.t_first = a.heads.div(sp.first);
  sp.n_tok = static_cast<int>(a.heads.div(sp.last) - sp.t_first) + 1;
  return sp;
}

// A tile touches at most (128 - 1) / 2 + 2 = 65 tokens: 3 per copy lane.
constexpr int kMaxTokPerLane = 3;
static_assert((kTmaTileTasks - 1) / kMinHeadsPerRow + 2 <= 32 * kMaxTokPerLane,
              "tokens of a tile per copy lane");

// Positions and slots of a tile's tokens k = lane + 32 i, into registers (prefetched one tile
// ahead by the copy warp, so the RoPE copies of a tile never wait for a fresh global load).
struct TileMeta {
  int32_t pos[kMaxTokPerLane];
  int32_t slot[kMaxTokPerLane];
};
__device__ __forceinline__ void load_meta(const KernelArgs& a, const TileSpan& sp, int lane,
                                          TileMeta& m) {
#pragma unroll
  for (int i = 0; i < kMaxTokPerLane; ++i) {
    const int k = lane + 32 * i;
    m.pos[i] = -1;
    m.slot[i] = -1;
    if (k < sp.n_tok) {
      m.pos[i] = __ldg(a.positions + sp.t_first + k);
      m.slot[i] = __ldg(a.slots + sp.t_first + k);
    }
  }
}

// The copy warp's bulk copies of a tile's packed heads into stage `st`: one per token (the
// token's heads inside the tile are contiguous whatever the row stride). Each lane announces the
// bytes of its own copies on `full` (expect_tx) before issuing them.
__device__ __forceinline__ void tma_copy_packed(const KernelArgs& a, const TileSpan& sp,
                                                uint8_t* st, uint64_t* full, int lane,
                                                uint64_t policy) {
  const uint32_t heads = a.heads.divisor;
  for (int k = lane; k < sp.n_tok; k += 32) {
    const uint32_t t = sp.t_first + k;
    const uint32_t h0 = k == 0 ? sp.first - t * heads : 0;
    const uint32_t h1 = k == sp.n_tok - 1 ? sp.last - t * heads : heads - 1;
    const uint32_t bytes = (h1 - h0 + 1) * kHeadBytes;
    const uint16_t* src =
        a.packed + static_cast<int64_t>(t) * a.packed_stride + static_cast<int64_t>(h0) * 128;
    mbar_expect_tx(full, bytes);
    bulk_copy_g2s(st + (t * heads + h0 - sp.first) * kHeadBytes, src, bytes, full, policy);
  }
}

// The tile's positions and slots (st.shared) and RoPE rows (bulk copies, 256 B, positions inside
// the table only), then this lane's arrival on `full` (after its own writes and expect_tx).
__device__ __forceinline__ void tma_stage_meta(const KernelArgs& a, const TmaGeometry& g,
                                               const TileSpan& sp, const TileMeta& m, uint8_t* st,
                                               uint64_t* full, int lane, uint64_t policy) {
  auto* s_pos = reinterpret_cast<int32_t*>(st + g.pos_off);
  auto* s_slot = reinterpret_cast<int32_t*>(st + g.slot_off);
#pragma unroll
  for (int i = 0; i < kMaxTokPerLane; ++i) {
    const int k = lane + 32 * i;
    if (k < sp.n_tok) {
      s_pos[k] = m.pos[i];
      s_slot[k] = m.slot[i];
      if (static_cast<uint32_t>(m.pos[i]) < a.max_pos) {
        mbar_expect_tx(full, kRopeFloats * 4);
        bulk_copy_g2s(st + g.rope_off + k * kRopeFloats * 4,
                      a.rope + static_cast<int64_t>(m.pos[i]) * kRopeFloats, kRopeFloats * 4, full,
                      policy);
      }
    }
  }
  mbar_arrive(full);
}

// ------------------------------------------------------------------------------------------------
// Four lanes per head (bulk-copy kernel only, ProducerCudaOptions::tma_lanes_per_head = 4): lane j
// of a 4-lane group holds 32 channels, again chosen so that RoPE needs no shuffle:
//   A = channels [8j, 8j + 8)          B = channels [32 + 8j, 40 + 8j)
//   C = channels [64 + 16j, 80 + 16j)
// read from the shared-memory stage as 16 + 16 + 32 bytes and stored as 8 + 8 + 16 E4M3 bytes.
// The per-task overhead (index math, classification, metadata, rsqrt, addresses, branches) is
// shared by twice the values and the reduction needs 2 shuffles instead of 3: ~125 instead of
// ~175 warp instructions per 4 heads (estimate). The same arithmetic per value as process_task,
// but the sum of squares is reduced in another order (per lane 2 x 16 products, then 4 lanes), so
// its bytes may differ from the 8-lane kernels by one E4M3 step where the rounding of rsqrt's
// argument moves a value across a rounding boundary; V is byte-identical (no arithmetic).

// Cache rows are only 4-byte aligned in general.
__device__ __forceinline__ void store16_cache(uint8_t* dst, uint4 v) {
  const auto addr = reinterpret_cast<uintptr_t>(dst);
  if ((addr & 15u) == 0) {
    *reinterpret_cast<uint4*>(dst) = v;
  } else if ((addr & 7u) == 0) {
    reinterpret_cast<uint2*>(dst)[0] = make_uint2(v.x, v.y);
    reinterpret_cast<uint2*>(dst)[1] = make_uint2(v.z, v.w);
  } else {
    reinterpret_cast<uint32_t*>(dst)[0] = v.x;
    reinterpret_cast<uint32_t*>(dst)[1] = v.y;
    reinterpret_cast<uint32_t*>(dst)[2] = v.z;
    reinterpret_cast<uint32_t*>(dst)[3] = v.w;
  }
}

__device__ __forceinline__ void widen8(uint4 w, float* y) {
  widen2(w.x, y[0], y[1]);
  widen2(w.y, y[2], y[3]);
  widen2(w.z, y[4], y[5]);
  widen2(w.w, y[6], y[7]);
}

// One task on 4 lanes; `head` is the task's 256 bytes in shared memory (the batch's first task
// when `valid` is false: computed, not stored). Executed by every lane of the warp (shuffles).
template <ProducerMode kMode>
__device__ __forceinline__ void process_task4(const KernelArgs& a, const uint8_t* head,
                                              uint32_t task, bool valid, uint32_t fallback_task,
                                              uint32_t t_first, int lane,
                                              const float4 (*s_norm)[32],
                                              const float4 (*s_rope)[kRopeFloats / 4],
                                              const int32_t* s_pos, const int32_t* s_slot) {
  uint32_t t, h;
  a.heads.divmod(valid ? task : fallback_task, t, h);
  const int k = static_cast<int>(t - t_first);
  int kind, sub;
  classify_head<kMode>(static_cast<int>(h), a.n_q, a.n_kv, kind, sub);
  const int32_t pos = s_pos[k];
  const int32_t slot = s_slot[k];
  const bool pos_ok = static_cast<uint32_t>(pos) < a.max_pos;

  // y[0..7] = A, y[8..15] = B, y[16..31] = C.
  float y[32];
  widen8(*reinterpret_cast<const uint4*>(head + 16 * lane), y);
  widen8(*reinterpret_cast<const uint4*>(head + 64 + 16 * lane), y + 8);
  widen8(*reinterpret_cast<const uint4*>(head + 128 + 32 * lane), y + 16);
  widen8(*reinterpret_cast<const uint4*>(head + 144 + 32 * lane), y + 24);

  float ss0 = 0.0f, ss1 = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    ss0 = fmaf(y[i], y[i], ss0);
    ss1 = fmaf(y[i + 1], y[i + 1], ss1);
  }
  float ss = ss0 + ss1;
  ss += __shfl_xor_sync(0xffffffffu, ss, 2);
  ss += __shfl_xor_sync(0xffffffffu, ss, 1);
  if (kind != kV) {
    const float r = rsqrtf(ss * (1.0f / 128.0f) + a.eps);
    const float4* w = s_norm[kind - (kind > kV)];
    const float4 wq[8] = {w[2 * lane],      w[2 * lane + 1],  w[8 + 2 * lane],  w[9 + 2 * lane],
                          w[16 + 4 * lane], w[17 + 4 * lane], w[18 + 4 * lane], w[19 + 4 * lane]};
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      y[4 * q] = (y[4 * q] * r) * wq[q].x;
      y[4 * q + 1] = (y[4 * q + 1] * r) * wq[q].y;
      y[4 * q + 2] = (y[4 * q + 2] * r) * wq[q].z;
      y[4 * q + 3] = (y[4 * q + 3] * r) * wq[q].w;
    }
    // Partial NeoX RoPE: pair i = 8j + m is (y[m], y[8 + m]).
    if (pos_ok) {
      const float4 c0 = s_rope[k][2 * lane], c1 = s_rope[k][2 * lane + 1];
      const float4 s0 = s_rope[k][8 + 2 * lane], s1 = s_rope[k][9 + 2 * lane];
      const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
      const float sn[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const float lo = y[m], hi = y[8 + m];
        y[m] = lo * c[m] - hi * sn[m];
        y[8 + m] = hi * c[m] + lo * sn[m];
      }
    }
  }

  uint2 code_a = make_uint2(pack4_e4m3(y[0], y[1], y[2], y[3]), pack4_e4m3(y[4], y[5], y[6], y[7]));
  uint2 code_b =
      make_uint2(pack4_e4m3(y[8], y[9], y[10], y[11]), pack4_e4m3(y[12], y[13], y[14], y[15]));
  uint4 code_c =
      make_uint4(pack4_e4m3(y[16], y[17], y[18], y[19]), pack4_e4m3(y[20], y[21], y[22], y[23]),
                 pack4_e4m3(y[24], y[25], y[26], y[27]), pack4_e4m3(y[28], y[29], y[30], y[31]));
  if (!valid) return;
  if (kind == kQ || kind == kIQ) {
    if (!pos_ok) {
      code_a = code_b = make_uint2(0x7f7f7f7fu, 0x7f7f7f7fu);
      code_c = make_uint4(0x7f7f7f7fu, 0x7f7f7f7fu, 0x7f7f7f7fu, 0x7f7f7f7fu);
    }
    // 16-byte aligned rows (validated base, 128-byte rows); t * n + sub < T * H < 2^31.
    uint8_t* row = kind == kQ ? a.q_out + static_cast<uint64_t>(t * a.n_q + sub) * 128
                              : a.iq_out + static_cast<uint64_t>(t * a.n_kv + sub) * 128;
    *reinterpret_cast<uint2*>(row + 8 * lane) = code_a;
    *reinterpret_cast<uint2*>(row + 32 + 8 * lane) = code_b;
    *reinterpret_cast<uint4*>(row + 64 + 16 * lane) = code_c;
  } else if (pos_ok && slot >= 0 && (slot >> 7) < a.num_pages) {
    const int64_t page = slot >> 7;
    const int64_t in_page = static_cast<int64_t>(slot & 127) * 128;
    uint8_t* row;
    if (kind == kIK) {
      row = a.ic + page * a.ic_page_stride + in_page;
    } else {
      row = a.kv + page * a.kv_page_stride + (kind == kV ? a.kv_plane_stride : 0) +
            static_cast<int64_t>(sub) * kTileBytes + in_page;
    }
    store8_cache(row + 8 * lane, code_a);
    store8_cache(row + 32 + 8 * lane, code_b);
    store16_cache(row + 64 + 16 * lane, code_c);
  }
}

// kLanes: lanes per head in the compute warps, 8 (process_task: the bytes of the other kernels)
// or 4 (process_task4).
// Blocks per SM the register budget is cut for: 3 with 8 lanes (62-64 registers, no spills) and
// with 4 lanes and 2 stages (3 x 67 KB of shared memory fit; 72 registers, 8 bytes of spills in
// the fused and main modes), else 2 (4 lanes: 91-92 registers).
constexpr int tma_min_blocks(int stages, int lanes) { return lanes == 8 || stages == 2 ? 3 : 2; }

template <ProducerMode kMode, int kTmaStages, int kLanes>
__global__ void __launch_bounds__(kTmaThreads, tma_min_blocks(kTmaStages, kLanes))
    producer_tma_kernel(const KernelArgs a, const TmaGeometry g) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float4 s_norm[kNumNorms][32];
  __shared__ __align__(8) uint64_t full[kTmaStages];
  __shared__ __align__(8) uint64_t empty[kTmaStages];

  const int warp = threadIdx.x / 32;
  const int lane32 = threadIdx.x % 32;
  const bool copy_warp = warp == kTmaComputeWarps;
  // This block's tasks: an equal share [begin, end) of all tasks (balanced to one task, so no
  // block runs a tile more than another), walked in tiles of up to 128 tasks.
  const uint32_t begin = static_cast<uint32_t>(uint64_t{blockIdx.x} * a.num_tasks / gridDim.x);
  const uint32_t end = static_cast<uint32_t>((uint64_t{blockIdx.x} + 1) * a.num_tasks / gridDim.x);

  // ---- copy warp ----
  // Per tile: the packed copies first (no dependency), then the loads of the next tile's
  // positions and slots, then this tile's metadata and RoPE copies from the registers loaded one
  // tile earlier. The copy warp initializes the barriers and fills the first kTmaStages stages
  // (no empty wait) before the block barrier, so their loads overlap the norm-weight staging.
  uint64_t stream_policy = 0, keep_policy = 0;
  TileSpan cur;
  TileMeta meta{};
  uint32_t first = begin, it = 0;
  const auto fill_next = [&] {
    const uint32_t s = it % kTmaStages;
    uint8_t* st = smem + s * g.stage_bytes;
    tma_copy_packed(a, cur, st, &full[s], lane32, stream_policy);
    TileSpan next;
    TileMeta next_meta{};
    if (end - first > static_cast<uint32_t>(kTmaTileTasks)) {
      next = tile_span(a, first + kTmaTileTasks, end);
      load_meta(a, next, lane32, next_meta);
    }
    tma_stage_meta(a, g, cur, meta, st, &full[s], lane32, keep_policy);
    cur = next;
    meta = next_meta;
    first += kTmaTileTasks;
    ++it;
  };
  if (copy_warp) {
    if (lane32 == 0) {
      for (int s = 0; s < kTmaStages; ++s) {
        mbar_init(&full[s], 32);
        mbar_init(&empty[s], kTmaComputeWarps);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
    stream_policy = l2_policy_evict_first();
    keep_policy = l2_policy_evict_last();
    cur = tile_span(a, begin, end);
    load_meta(a, cur, lane32, meta);
    while (first < end && it < static_cast<uint32_t>(kTmaStages)) fill_next();
  }
  stage_norms(a, s_norm);  // threads 0..63: compute warps 0 and 1
  __syncthreads();         // barriers initialized, norms staged
  if (copy_warp) {
    while (first < end) {
      mbar_wait(&empty[it % kTmaStages], (it / kTmaStages - 1) & 1u);
      fill_next();
    }
    return;
  }

  // ---- compute warps ----
  static_assert(kLanes == 8 || kLanes == 4, "8 or 4 lanes per head");
  constexpr int kGroups = kTmaComputeWarps * 32 / kLanes;  // 32 or 64
  constexpr int kRounds = kTmaTileTasks / kGroups;         // 4 or 2
  const int lane = threadIdx.x & (kLanes - 1);
  const int group = threadIdx.x / kLanes;
#pragma unroll 1
  for (; first < end; first += kTmaTileTasks, ++it) {
    const uint32_t s = it % kTmaStages;
    const uint8_t* st = smem + s * g.stage_bytes;
    const uint32_t tile_end = min(first + kTmaTileTasks, end);
    const uint32_t t_first = a.heads.div(first);
    mbar_wait(&full[s], (it / kTmaStages) & 1u);
    const auto* s_rope = reinterpret_cast<const float4(*)[kRopeFloats / 4]>(st + g.rope_off);
    const auto* s_pos = reinterpret_cast<const int32_t*>(st + g.pos_off);
    const auto* s_slot = reinterpret_cast<const int32_t*>(st + g.slot_off);
#pragma unroll 1
    for (int r = 0; r < kRounds; ++r) {
      // The last tile of a block is partial: rounds past its end are skipped (uniform per block,
      // so the shuffles stay converged); inside a round, groups past the end compute on the
      // tile's first task and store nothing.
      if (first + r * kGroups >= tile_end) break;
      const uint32_t task = first + r * kGroups + group;
      const bool valid = task < tile_end;
      const uint8_t* head = st + (valid ? task - first : 0u) * kHeadBytes;
      if constexpr (kLanes == 8) {
        LaneRaw raw;
        raw.a = *reinterpret_cast<const uint2*>(head + 8 * lane);
        raw.b = *reinterpret_cast<const uint2*>(head + 64 + 8 * lane);
        raw.c = *reinterpret_cast<const uint4*>(head + 128 + 16 * lane);
        process_task<kMode>(a, raw, task, valid, first, t_first, lane, s_norm, s_rope, s_pos,
                            s_slot);
      } else {
        process_task4<kMode>(a, head, task, valid, first, t_first, lane, s_norm, s_rope, s_pos,
                             s_slot);
      }
    }
    __syncwarp();
    if (lane32 == 0) mbar_arrive(&empty[s]);
  }
}

}  // namespace m3attn::producer_kernel
