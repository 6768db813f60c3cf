// Shared definitions of the warp-specialised prefill kernel (attention_prefill_ws.cuh, whose
// design comment describes the roles): tile and shared-memory constants, the ring entry header,
// the work item, the CTA's shared state and the PTX wrappers that more than one role uses.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "core/mbarrier.cuh"
#include "stages/attention/attention_kernel.cuh"
#include "stages/attention/attention_prefill_wgmma.cuh"

namespace m3attn {
namespace attention_prefill_ws {

namespace ak = attention_kernel;
namespace ap = attention_prefill;
using ak::AttnArgs;

constexpr int kThreads = 384;  // warpgroup 0: scheduler + converters; 1, 2: consumers
constexpr int kConvWarps = 3;
constexpr int kConsumerWarps = 8;
constexpr int kQT = 8;                      // query tokens per tile
constexpr int kTileBytes = ak::kTileBytes;  // raw K or V: 128 keys x 128 bytes
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kVhBytes = 2 * kTileBytes;        // f16 V
constexpr int kQBytes = kQT * ak::kRows * 128;  // 8 tokens x 16 heads x 128 bytes
// Dynamic shared memory: a 4-stage raw ring (K | V per stage), 2 f16 V buffers, one Q buffer
// (Q is copied into registers when an item starts; the buffer is released then).
constexpr int kStages = 4;
constexpr int kVhOff = kStages * kStageBytes;
constexpr int kQOff = kVhOff + 2 * kVhBytes;
constexpr int kSmemBytes = kQOff + kQBytes + 1024;  // + slack to align the base to 1024 bytes
// setmaxnreg moves registers within the CTA's launch allocation (168 per thread: 65536 / 384
// rounded down to a multiple of 8), so 128 x low + 256 x high must not exceed 168 x 384.
constexpr int kLaunchRegs = 168;
// 64 / 216 (kernel 15; ptxas: 182 bytes of spills in the scheduler / converter warps at 40, none at
// 64; the consumers fit in 216 without spills).
constexpr int kLowRegs = 64;
constexpr int kHighRegs = 216;
constexpr int kCand = kQT * ak::kTopKIds;  // 128 candidate ids per tile
static_assert(kSmemBytes + 8192 <= 227 * 1024, "dynamic + static shared memory");
static_assert(kLowRegs * 128 + kHighRegs * 256 <= kLaunchRegs * kThreads, "register budget");
static_assert(kLaunchRegs * kThreads <= 65536, "register file");
static_assert(ap::kQT == kQT, "same tile as the wgmma kernel (shared helpers)");

// Entry flags.
constexpr int kFirst = 1;  // first entry of its work item (Q tile loaded with it)
constexpr int kLast = 2;   // last entry of its work item (epilogue after its P V)
constexpr int kEnd = 4;    // no more entries

// Header of one ring stage, written by the scheduler lane before the stage's full arrival.
struct Entry {
  int info;      // flags | tokens of the tile << 4 | split << 8 | KV head << 16
  int t0;        // first token of the tile
  int vlim;      // V rows past it are zeroed
  int klo;       // keys klo + 1 .. of the block are missed by some present token (NaN test there)
  int lim[kQT];  // keys [0, lim] of the block visible to token w (< 0: none)
};
__host__ __device__ constexpr int pack_info(int flags, int nt, int split, int g) {
  return flags | nt << 4 | split << 8 | g << 16;
}
__device__ __forceinline__ int info_flags(int info) { return info & 7; }
__device__ __forceinline__ int info_nt(int info) { return (info >> 4) & 15; }
__device__ __forceinline__ int info_split(int info) { return (info >> 8) & 255; }
__device__ __forceinline__ int info_g(int info) { return info >> 16; }
static_assert(ak::kMaxSplits <= 256, "split index in 8 bits");

// ---------------------------------------------------------------------------------------------
// PTX wrappers (mbarrier, TMA, named barriers, register reallocation).

using sm90::mbar_arrive;
using sm90::mbar_arrive_expect_tx;
using sm90::mbar_init;
using sm90::mbar_try_wait;
using sm90::mbar_wait;

using ak::tma_load_4d;  // K / V tiles (attention_kernel.cuh)
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Named barriers 1 and 2 over the 256 consumer threads: warpgroup w waits on 1 + w, the other
// warpgroup arrives on it.
__device__ __forceinline__ void turn_wait(int wg) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
}
__device__ __forceinline__ void turn_pass(int wg) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Shared state.

// A work item as the scheduler warp prepared it (two buffers: the current and the next item).
struct Item {
  int t0, nt, g, split, lo, hi;  // tile, KV head, split, entry range [lo, hi) of the list
  int64_t pt_row;                // page-table row offset of the request
  int pos[kQT];                  // positions of the tile's tokens (-1: absent)
  int list_b[kCand], list_page[kCand], list_mask[kCand];  // sparse: the union
};

struct Shared {
  Entry entry[kStages];
  uint64_t full[kStages], empty[kStages], vfull[2], vempty[2], qempty;
  // NaN V bytes in keys that some present token of the tile misses, per f16 buffer v: vnan_gen[v]
  // = (entry + 1) of the last entry converted into v that had one, vnan_key[v][d] = (entry + 1) <<
  // 8 | (255 - its smallest such key in dim d) (attention_prefill_ws.cuh, converter_warps).
  uint32_t vnan_gen[2];
  uint32_t vnan_key[2][ak::kDim];
  // Scheduler warp only.
  Item item[2];
};

__device__ __forceinline__ uint32_t bar_addr(const uint64_t& b) { return ak::smem_u32(&b); }

// One thread's arrival counting for `count` arrivals.
__device__ __forceinline__ void mbar_arrive_count(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// A shared word read by lane 0 alone (volatile: never speculated into the other lanes), for data
// whose release is lane 0's mbarrier arrival.
template <typename T>
__device__ __forceinline__ T ld_lane0(const T& x) {
  return *static_cast<const volatile T*>(&x);
}

}  // namespace attention_prefill_ws
}  // namespace m3attn
