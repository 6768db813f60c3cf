// Task plans of the bulk-copy kernel (ProducerCudaOptions::tma_task_plan): the copy warp, idle
// most of the time, works out per tile what every task needs besides its values (token slot in
// the stage, head kind, norm slot, position check, the destination row) and leaves it in the
// stage as one 16-byte TaskPlan per task; the compute warps then read one broadcast word per task
// instead of redoing the division, the classification, the metadata loads and the 64-bit row
// address in every lane (about 60 of the ~265 instructions a compute warp spent per round). The
// arithmetic on the values is the shared code of producer_kernel_common.cuh, so the bytes are
// those of every other kernel.
#pragma once

#include "stages/producer/producer_kernel_common.cuh"

namespace m3attn::producer_kernel {

// One task of a tile. info: k (token in the tile) | kind << 8 | norm slot << 12 | pos_ok << 16 |
// nan << 17; head: byte offset of the task's BF16 head in the stage (0, the first task's, for a
// slot past the tile's end); row: the destination row (null: no write).
struct alignas(16) TaskPlan {
  uint32_t info;
  uint32_t head;
  uint8_t* row;
};
static_assert(sizeof(TaskPlan) == 16, "one 16-byte shared load per task");
constexpr uint32_t kPlanPosOk = 1u << 16;
constexpr uint32_t kPlanNan = 1u << 17;

// The plan of slot i of a tile whose tasks are [first, last] (tokens from t_first; s_pos and
// s_slot hold their positions and slots, written and visible to this lane).
template <ProducerMode kMode>
__device__ __forceinline__ TaskPlan make_task_plan(const KernelArgs& a, uint32_t first,
                                                   uint32_t last, uint32_t t_first, uint32_t i,
                                                   const int32_t* s_pos, const int32_t* s_slot) {
  TaskPlan p;
  if (first + i > last) {
    p.info = static_cast<uint32_t>(kV) << 8;  // V: no norm work; nothing stored
    p.head = 0;
    p.row = nullptr;
    return p;
  }
  const TaskInfo ti = task_info<kMode>(a, first + i, t_first, s_pos, s_slot);
  const int ws = ti.kind == kV ? 0 : norm_slot(ti.kind);
  p.info = static_cast<uint32_t>(ti.k) | static_cast<uint32_t>(ti.kind) << 8 |
           static_cast<uint32_t>(ws) << 12 | (ti.pos_ok ? kPlanPosOk : 0u) |
           (nan_row(ti) ? kPlanNan : 0u);
  p.head = i * 256u;
  p.row = task_row(a, ti);
  return p;
}

// One planned task on 8 lanes. `st` is the stage, `plan` the task's plan, `rope` the stage's RoPE
// rows. Executed by every lane of the warp (shuffles).
__device__ __forceinline__ void process_planned(const KernelArgs& a, const uint8_t* st,
                                                const TaskPlan& plan, int lane,
                                                const float4 (*s_norm)[32],
                                                const float4 (*rope)[kRopeFloats / 4]) {
  const uint8_t* head = st + plan.head;
  const int kind = static_cast<int>((plan.info >> 8) & 0xfu);
  const float4* w = s_norm[(plan.info >> 12) & 0xfu];
  const float4* rope_row = rope[plan.info & 0xffu];
  const bool pos_ok = (plan.info & kPlanPosOk) != 0;
  const LaneRaw raw = load_slice8(head, lane);
  SliceCode code = compute_slice8(raw, kind, w, rope_row, pos_ok, a.eps, lane);
  if (plan.info & kPlanNan) set_nan(code);
  if (plan.row != nullptr) store_slice8(plan.row, lane, code);
}

}  // namespace m3attn::producer_kernel
