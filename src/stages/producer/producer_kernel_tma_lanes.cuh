// Per-task code of the bulk-copy kernel with 4 lanes per head (process_task4): the arithmetic of
// process_task (the same bytes) on twice the channels per lane.
#pragma once

#include "stages/producer/producer_kernel_common.cuh"

namespace m3attn::producer_kernel {

// ------------------------------------------------------------------------------------------------
// Four lanes per head (bulk-copy kernel, ProducerCudaOptions::tma_lanes_per_head = 4): lane l of a
// 4-lane group holds the slices 2l and 2l + 1 of the 8-lane layout (producer_kernel_common.cuh),
// i.e. 32 channels, again chosen so that RoPE needs no shuffle:
//   A = channels [8l, 8l + 8)          B = channels [32 + 8l, 40 + 8l)
//   C = channels [64 + 16l, 80 + 16l)
// read from the shared-memory stage as 16 + 16 + 32 bytes and stored as 8 + 8 + 16 E4M3 bytes
// (half the store instructions of 8 lanes per head). The per-task overhead (index math,
// classification, metadata, rsqrt, addresses, branches) is shared by twice the values. The sum of
// squares is reduced in the 8-lane order (per slice, then the xor tree 4, 2, 1 over the slices:
// 4 shuffles, two per step, the last step in the lane), and every value goes through the same
// operations, so the bytes equal the 8-lane kernels' (V trivially: no arithmetic).

// The bytes of the two slices of a lane (A 8, B 8, C 16 bytes).
struct PairCode {
  uint2 a, b;
  uint4 c;
};

// The E4M3 bytes of slices 2l and 2l + 1 (l = lane) of the head at `head` (BF16 in shared
// memory): compute_slice8's arithmetic and reduction order on two slices. Executed by every lane
// of the warp (shuffles).
__device__ __forceinline__ PairCode compute_slices4(const uint8_t* head, int kind, const float4* w,
                                                    const float4* rope, bool pos_ok, float eps,
                                                    int lane) {
  const uint4 ra = *reinterpret_cast<const uint4*>(head + 16 * lane);
  const uint4 rb = *reinterpret_cast<const uint4*>(head + 64 + 16 * lane);
  LaneRaw raw0, raw1;  // slices 2l and 2l + 1
  raw0.a = make_uint2(ra.x, ra.y);
  raw1.a = make_uint2(ra.z, ra.w);
  raw0.b = make_uint2(rb.x, rb.y);
  raw1.b = make_uint2(rb.z, rb.w);
  raw0.c = *reinterpret_cast<const uint4*>(head + 128 + 32 * lane);
  raw1.c = *reinterpret_cast<const uint4*>(head + 144 + 32 * lane);
  float y0[16], y1[16];
  widen_slice(raw0, y0);
  widen_slice(raw1, y1);

  // The 8-lane tree: slice j + slice j ^ 4 (lane l ^ 2), then + j ^ 2 (lane l ^ 1), then + j ^ 1
  // (the other slice of this lane; a + b == b + a, so both slices get the same float).
  float s0 = slice_sum_squares(y0), s1 = slice_sum_squares(y1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  if (kind != kV) {
    const float r = rms_scale(s0 + s1, eps);
    norm_rope_slice(y0, r, w, rope, pos_ok, 2 * lane);
    norm_rope_slice(y1, r, w, rope, pos_ok, 2 * lane + 1);
  }
  const SliceCode c0 = encode_slice(y0), c1 = encode_slice(y1);
  PairCode code;
  code.a = make_uint2(c0.a, c1.a);
  code.b = make_uint2(c0.b, c1.b);
  code.c = make_uint4(c0.c.x, c0.c.y, c1.c.x, c1.c.y);
  return code;
}

__device__ __forceinline__ void store_slices4(uint8_t* row, int lane, const PairCode& code) {
  store8_cache(row + 8 * lane, code.a);
  store8_cache(row + 32 + 8 * lane, code.b);
  store16_cache(row + 64 + 16 * lane, code.c);
}
__device__ __forceinline__ void set_nan(PairCode& code) {
  code.a = code.b = make_uint2(kNanE4m3x4, kNanE4m3x4);
  code.c = make_uint4(kNanE4m3x4, kNanE4m3x4, kNanE4m3x4, kNanE4m3x4);
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
  const TaskInfo ti = task_info<kMode>(a, valid ? task : fallback_task, t_first, s_pos, s_slot);
  PairCode code = compute_slices4(head, ti.kind, s_norm[norm_slot(ti.kind)], s_rope[ti.k],
                                  ti.pos_ok, a.eps, lane);
  if (!valid) return;
  if (nan_row(ti)) set_nan(code);
  uint8_t* row = task_row(a, ti);
  if (row != nullptr) store_slices4(row, lane, code);
}

}  // namespace m3attn::producer_kernel
