// The bulk-copy (TMA) pipeline producer kernel (ProducerCudaKernel::kTmaPipeline, the default from
// 2^17 tasks): a warp-specialized persistent grid; the design is below, before the constants.
//
// Measured (kept for the record):
//   bulk-copy pipeline (producer_tma_kernel, ProducerCudaKernel::kTmaPipeline; the
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
//   Session 11. Round-1 ncu (default, T 4096, 33 us): 22.1M warp instructions (~280 per 4 heads),
//              issue 64%, 2.1 eligible warps, stalls: not-selected 22%, wait 16%, long scoreboard
//              13%, short scoreboard 12%, the start barrier 9% (compute warps idle until the
//              first tile: positions -> RoPE rows -> data); shared loads 48 wavefronts per warp
//              round (ideal ~36: the C norm-weight loads and the A / B head loads 2-way
//              conflicted), with the stores and the bulk writes the L1 data path ~75% busy; DRAM
//              61% of peak over the kernel (at T 4096 some 25 MB of the 40 MB written are still in
//              L2 when it ends). A plain copy of the same size reaches 93.6% of 4300 GB/s
//              (bandwidth_bench), so the ceiling is not the DRAM alone. Changes: norm weights
//              staged in slice order (C loads conflict-free); the 4-lane path reduced in the 8-lane
//              order (same bytes; still slower: 37 us); task plans (the copy warp does each task's
//              division, classification, metadata and row address once: -22% instructions, issue
//              50%, but not faster at T 4096, so the compute warps are not issue-bound: they wait
//              for data, 13% at the start barrier and 12% on the stage barrier); the interleaved
//              tile order (one moving front of tiles). Round 2 (T 4096 / 16384): equal shares
//              34.98 / 140.29 us, interleaved 34.08 / 137.50, plans 34.88 / 136.58, both 34.66 /
//              135.49 (83.9%); 4 lanes 37.1-40.8 / 144.5-148.5. Then: 64-task tiles (twice the
//              stages in the same shared memory: a shorter fill, more tiles in flight). Round 3
//              (two runs): plans + interleaved + 64-task tiles in 4 stages 33.66-33.76 us at
//              T 4096 (84.3%), 137.4-137.8 at 16384; with 128-task tiles in 2 stages 35.4-35.6 /
//              135.7-136.1 (83.7%): the default takes the first below 2^19 tasks, the second
//              from there. Still short of 85% (33.4 / 133.7 us); a plain copy of the same bytes
//              reaches 93.6%.
//   Session 12. Tail blocks (set_tma_tail): the persistent blocks stop one round early and the
//              rest goes to extra blocks of the same grid, started by the hardware on whichever SM
//              frees a slot first (no atomics). Round A (two runs each, isolated / back-to-back):
//              T 16384 default 135.68-136.38 us, tails 131.5-133.9 (last round in blocks of 4 x
//              32 tasks 131.52-131.58 = 86.4%, back-to-back 133.8); T 4096 default 34.24-34.30
//              (83.0%), every tail variant slower (34.4-37.8); ncu at T 4096 with tail blocks: SM
//              active 91.8% of the cycles (no better), compute warps 26% of their samples on the
//              stage's full barrier, L2 78% busy, DRAM 58%. A bank-swapped shared-load order (A/B
//              halves of odd groups) and 2 blocks per SM measured no better / slower and were
//              removed. racecheck reported 40 hazards with one stage release per warp
//              (__syncwarp, then lane 0 arrives): every compute thread now arrives on the empty
//              barrier (racecheck 0 hazards in round B; no slower: the old release measured
//              34.24-34.30 / 130.91 us against 34.11-34.14 / 130.56-130.72). Round B (two runs):
//              4 blocks per SM with 3 stages of 64-task tiles (32 compute warps per SM, registers
//              capped at 56, no spills) 33.09-33.34 us at T 4096 (85.2-85.9%; 2 stages 34.2-34.3,
//              3 blocks x 4 stages 34.11-34.14), at T 16384 137.3 (worse than 128-task tiles);
//              tail blocks of one 64-task tile 129.86-129.89 us at T 16384 (87.5%; 4 x 32 tasks
//              130.56-130.72); whole-row stores (4 shuffles per row, one 16-byte store per lane
//              instead of three partial ones) 41 us at T 4096 / 136.8 at 16384: removed. Defaults
//              since: below 2^19 tasks 64-task tiles, 3 stages, 4 blocks per SM; from there
//              128-task tiles, 2 stages, 3 blocks per SM and tail blocks of one 64-task tile.
//              Round C: T 4096 33.22 / 33.22 us (85.6%), T 16384 129.44 / 129.44 (87.8%); tail
//              blocks of two 64-task tiles at T 4096 32.99 / 33.09 (back-to-back 34.9 vs 36.1):
//              since then the default there too (tma_default_tail below).
#pragma once

#include <cstddef>

#include "core/mbarrier.cuh"
#include "core/pdl.cuh"
#include "stages/producer/producer_kernel_common.cuh"
#include "stages/producer/producer_kernel_tma_plan.cuh"

namespace m3attn::producer_kernel {

// ------------------------------------------------------------------------------------------------
// The bulk-copy pipeline kernel (ProducerCudaKernel::kTmaPipeline). Warp-specialized persistent
// blocks of 8 compute warps + 1 copy warp; the packed rows never pass through the compute warps'
// registers on their way from HBM: the copy warp moves them into a ring of kTmaStages shared-memory
// stages with cp.async.bulk (the Hopper TMA unit's 1-D copy, completion counted in bytes on an
// mbarrier), and the compute warps read them from shared memory.
//
// Work: tiles of 128 (or 64) consecutive tasks (32 KB of packed BF16, 1.66 tokens at M3 TP1), the
// same (token, head) numbering as the other kernels; block b of G runs the tiles BlockTiles gives
// it: with the interleaved order rounds of tiles k G + b (one moving front), then an equal share
// of the rest; otherwise the equal share [b N / G, (b + 1) N / G) of all N tasks (no tile tail;
// the last tile of a block partial); with tail blocks (set_tma_tail) the last rounds go to extra
// blocks instead. Group g (0..31, 8 lanes) of the compute warps takes tasks first + 32 r + g,
// r = 0..3 (64-task tiles: 0..1), and runs process_task on them, so this kernel writes the same
// bytes as the other two. Per stage the copy warp also stages the tile's positions and slots
// (loaded into registers one tile ahead, stored with st.shared by the copy lanes, each lane
// arriving on the stage's "full" barrier after its own writes) and the RoPE rows of the positions
// inside the table (bulk copies, 256 B each). Per token of a tile one bulk copy moves the token's
// heads inside the tile (rows are contiguous from head h0 to h1 whatever the row stride), so a tile
// costs 2-3 copies at M3 TP1. With task plans the copy warp also writes a 16-byte TaskPlan per task
// (producer_kernel_tma_plan.cuh) and the compute warps run process_planned instead of
// process_task.
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
//   empty[s] (256 arrivals: every compute thread after its last shared read of the stage): the
//            copy warp waits parity (u - 1)&1 before refilling the stage (it >= kTmaStages).
//            Every thread arrives so that each thread's reads are ordered before the refill by its
//            own release (compute-sanitizer racecheck does not carry the ordering through
//            __syncwarp to another lane's arrival: 40 hazards with one arrival per warp).

constexpr int kTmaComputeWarps = 8;
constexpr int kTmaThreads = (kTmaComputeWarps + 1) * 32;
// Tasks per tile: kTmaTileTasks (128: 4 rounds of the 32 8-lane groups) or kTmaTileTasksSmall (64,
// twice the stages in the same shared memory: ProducerCudaOptions::tma_tile_tasks).
constexpr int kTmaTileTasks = kTmaComputeWarps * 32 / kLanesPerHead * 4;  // 128: 4 rounds
constexpr int kTmaTileTasksSmall = kTmaTileTasks / 2;
// 2, 3 and 4 stages are built (the default follows the tile size, below). A 4-lane-per-head
// variant (32 channels per lane) measured slower than 8 lanes in every round of session 11 and was
// removed in session 12.
constexpr int kTmaStagesMax = 4;
// Defaults of ProducerCudaOptions' tma_interleave / tma_task_plan / tma_tile_tasks / tma_stages
// (session 11 on the H200, two runs each, T 4096 / 16384 at M3 TP1): task plans + interleaved
// order, with 64-task tiles in 4 stages below kTmaSmallTileMaxTasks (T 4096: 33.66-33.76 us, the
// 128-task tiles 35.2-35.6) and 128-task tiles in 2 stages from there (T 16384: 135.7-136.1 us,
// the 64-task tiles 137.4-137.8); the round-1 path (equal shares, no plans, 128 / 2) measured
// 34.5-35.0 / 139.4-140.3 us. The crossover between 315K and 1.26M tasks was not measured.
constexpr bool kTmaInterleaveDefault = true;
constexpr bool kTmaTaskPlanDefault = true;
constexpr int64_t kTmaSmallTileMaxTasks = int64_t{1} << 19;  // about 6800 tokens at M3 TP1
inline int tma_default_tile_tasks(int64_t tasks) {
  return tasks < kTmaSmallTileMaxTasks ? kTmaTileTasksSmall : kTmaTileTasks;
}
// Session 12 round B: with 64-task tiles 3 stages in 4 blocks per SM (33.09-33.34 us at T 4096)
// beat 4 stages in 3 blocks (34.11-34.14); 4 blocks per SM are built with task plans and 2 or 3
// stages only.
inline int tma_default_stages(int tile_tasks) { return tile_tasks == kTmaTileTasksSmall ? 3 : 2; }
inline int tma_default_blocks_per_sm(int tile_tasks, int stages, bool plan) {
  return tile_tasks == kTmaTileTasksSmall && stages <= 3 && plan ? 4 : 3;
}
// Tail blocks (ProducerCudaOptions::tma_tail), session 12 on the H200 (two runs per round, T 4096
// / 16384). Round A (3 blocks per SM everywhere): with 128-task tiles every tail variant beat the
// plain grid (T 16384 131.5-133.9 us vs 135.68-136.38), with 64-task tiles every one lost
// (34.43-37.8 vs 34.24-34.30). Round B: 128-task tiles, one 64-task tile per tail block
// 129.86-129.89 us (87.5%; 4 x 32 tasks 130.56-130.72). Round C (64-task tiles now in 4 blocks per
// SM): two 64-task tiles per tail block 32.99 / 33.09 us at T 4096 (back-to-back 34.90 / 34.91)
// vs 33.22 / 33.22 (36.08) without tail blocks; at T 16384 one tile per tail block stays best
// (129.44 vs 130.50-130.94 for two). Defaults since: on, last round, one 64-task tile per tail
// block with 128-task tiles, two with 64-task tiles. kTmaTailMax bounds rounds and tiles,
// kTmaTailTileMin the tail tile.
inline bool tma_default_tail(int /*tile_tasks*/) { return true; }
inline int tma_default_tail_tiles(int tile_tasks) { return tile_tasks == kTmaTileTasks ? 1 : 2; }
constexpr int kTmaTailRoundsDefault = 1;
constexpr int kTmaTailTileDefault = 64;
constexpr int kTmaTailMax = 8;
constexpr int kTmaTailTileMin = 16;
// kAuto runs the bulk-copy kernel from 2^17 tasks on (about 1700 tokens at M3 TP1, ~1000 tiles:
// ~4 per block): measured faster than the per-batch kernel at T 4096 and 16384 and slower at
// T <= 1024, where a call is a few tiles per block and the pipeline's fill dominates.
constexpr int64_t kTmaMinTasks = int64_t{1} << 17;
inline bool use_tma_variant(int64_t tasks) { return tasks >= kTmaMinTasks; }
constexpr int kHeadBytes = 128 * 2;  // one BF16 head
static_assert(kTmaComputeWarps * 32 == kThreads, "compute warps are the 256-thread group layout");

// Shared-memory layout of one stage (bytes), from the heads per row (host and device agree).
struct TmaGeometry {
  uint32_t tile_tasks = kTmaTileTasks;  // 128 or 64
  uint32_t num_tiles = 0;
  uint32_t max_tok = 0;      // tokens a tile can touch: (tile_tasks - 1) / H + 2
  uint32_t rope_off = 0;     // [max_tok][64] f32
  uint32_t pos_off = 0;      // [max_tok] i32
  uint32_t slot_off = 0;     // [max_tok] i32
  uint32_t plan_off = 0;     // [tile_tasks] TaskPlan (task-plan kernels only)
  uint32_t stage_bytes = 0;  // multiple of 16
  // Tile order (BlockTiles): false = each block walks its equal share of the tasks; true = full
  // rounds of one tile per block over consecutive tiles first (one moving front), then the equal
  // shares of the rest.
  bool interleave = false;
  // Tail blocks (tail_block_tasks > 0, set by set_tma_tail): blocks [0, main_blocks) run `rounds`
  // full interleaved rounds of tiles (nothing else); block main_blocks + j takes the tasks
  // [tail_first + j tail_block_tasks, + tail_block_tasks) in tiles of tail_tile_tasks.
  uint32_t main_blocks = 0;
  uint32_t rounds = 0;
  uint32_t tail_first = 0;
  uint32_t tail_block_tasks = 0;
  uint32_t tail_tile_tasks = 0;
};

__host__ __device__ constexpr uint32_t round_up16(uint32_t x) { return (x + 15u) & ~15u; }

inline TmaGeometry make_tma_geometry(int64_t tasks, int heads, bool plan, int tile_tasks) {
  TmaGeometry g;
  g.tile_tasks = static_cast<uint32_t>(tile_tasks);
  g.num_tiles = static_cast<uint32_t>((tasks + tile_tasks - 1) / tile_tasks);
  g.max_tok = static_cast<uint32_t>((tile_tasks - 1) / heads + 2);
  g.rope_off = g.tile_tasks * kHeadBytes;
  g.pos_off = g.rope_off + g.max_tok * kRopeFloats * 4;
  g.slot_off = g.pos_off + round_up16(g.max_tok * 4);
  g.plan_off = g.slot_off + round_up16(g.max_tok * 4);
  g.stage_bytes = g.plan_off + (plan ? g.tile_tasks * static_cast<uint32_t>(sizeof(TaskPlan)) : 0u);
  return g;
}
inline size_t tma_smem_bytes(const TmaGeometry& g, int stages) {
  return static_cast<size_t>(stages) * g.stage_bytes;
}

// Tail blocks over a persistent grid of `blocks` (one full wave): the persistent blocks keep
// floor(tiles / blocks) - tail_rounds full rounds (none if that is not positive: then the whole
// grid is tail blocks), the rest goes to tail blocks of tail_tiles tiles of tail_tile_tasks tasks.
// Returns the grid (persistent + tail blocks).
inline uint32_t set_tma_tail(TmaGeometry& g, int64_t tasks, uint32_t blocks, int tail_rounds,
                             int tail_tiles, int tail_tile_tasks) {
  const uint32_t full_rounds = g.num_tiles / blocks;
  g.interleave = true;
  g.rounds = full_rounds > static_cast<uint32_t>(tail_rounds) ? full_rounds - tail_rounds : 0u;
  g.main_blocks = g.rounds > 0 ? blocks : 0u;
  g.tail_first = g.rounds * g.main_blocks * g.tile_tasks;
  g.tail_tile_tasks = static_cast<uint32_t>(tail_tile_tasks);
  g.tail_block_tasks = static_cast<uint32_t>(tail_tiles * tail_tile_tasks);
  const int64_t rest = tasks - g.tail_first;
  return g.main_blocks +
         static_cast<uint32_t>((rest + g.tail_block_tasks - 1) / g.tail_block_tasks);
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  sm90::mbar_init(smem_addr(bar), count);
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { sm90::mbar_arrive(smem_addr(bar)); }
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!sm90::mbar_try_wait(smem_addr(bar), parity)) {
  }
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

// Tasks [first, last] of a tile ([first, end), at most a tile) and the tokens t_first .. t_first +
// n_tok - 1 they touch.
struct TileSpan {
  uint32_t first = 0, last = 0, t_first = 0;
  int n_tok = 0;
};
__device__ __forceinline__ TileSpan tile_span(const KernelArgs& a, uint32_t first, uint32_t end) {
  TileSpan sp;
  sp.first = first;
  sp.last = end - 1;
  sp.t_first = a.heads.div(sp.first);
  sp.n_tok = static_cast<int>(a.heads.div(sp.last) - sp.t_first) + 1;
  return sp;
}

// A tile touches at most (128 - 1) / 2 + 2 = 65 tokens: 3 per copy lane (64-task tiles: 2).
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
// the table only); the caller then arrives on `full` (after the lane's own writes and expect_tx).
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
}

// The tile's task plans (after tma_stage_meta: the warp's positions and slots are read back).
template <ProducerMode kMode>
__device__ __forceinline__ void tma_stage_plan(const KernelArgs& a, const TmaGeometry& g,
                                               const TileSpan& sp, uint8_t* st, int lane) {
  __syncwarp();  // every lane's st.shared of the positions and slots is visible to the warp
  const auto* s_pos = reinterpret_cast<const int32_t*>(st + g.pos_off);
  const auto* s_slot = reinterpret_cast<const int32_t*>(st + g.slot_off);
  auto* plans = reinterpret_cast<TaskPlan*>(st + g.plan_off);
  for (uint32_t i = lane; i < g.tile_tasks; i += 32)
    plans[i] = make_task_plan<kMode>(a, sp.first, sp.last, sp.t_first, i, s_pos, s_slot);
}

// The tiles of block b of G, in the order it runs them (S tasks per tile): `rounds` full rounds in
// which block b takes tile k G + b (tasks [(k G + b) S, + S): all blocks stream one moving front of
// consecutive tiles), then an equal share [share_begin, share_end) of the remaining tasks
// (balanced to one task) in tiles of up to S, the last one partial. rounds = 0 (geometry
// interleave false) is the plain equal share of all tasks.
// With tail blocks (g.tail_block_tasks > 0) the rounds run over the g.main_blocks persistent
// blocks only; a tail block has no rounds and a share of g.tail_block_tasks tasks in tiles of
// g.tail_tile_tasks (at most a stage's tile_tasks).
struct BlockTiles {
  uint32_t size = kTmaTileTasks, grid = 1, rounds = 0, share_begin = 0, share_end = 0, count = 0;

  __device__ __forceinline__ BlockTiles(const KernelArgs& a, const TmaGeometry& g)
      : size(g.tile_tasks), grid(gridDim.x) {
    const uint32_t b = blockIdx.x;
    if (g.tail_block_tasks > 0) {
      if (b < g.main_blocks) {
        grid = g.main_blocks;
        rounds = g.rounds;
      } else {
        size = g.tail_tile_tasks;
        share_begin = g.tail_first + (b - g.main_blocks) * g.tail_block_tasks;
        share_end = min(share_begin + g.tail_block_tasks, a.num_tasks);
      }
    } else {
      rounds = g.interleave ? static_cast<uint32_t>(a.num_tasks / (uint64_t{grid} * size)) : 0u;
      const uint64_t base = uint64_t{rounds} * grid * size;
      const uint64_t rest = a.num_tasks - base;
      share_begin = static_cast<uint32_t>(base + b * rest / grid);
      share_end = static_cast<uint32_t>(base + (b + 1) * rest / grid);
    }
    count = rounds + (share_end - share_begin + size - 1) / size;
  }
  // Tile k < count: tasks [first, end).
  __device__ __forceinline__ void tile(uint32_t k, uint32_t& first, uint32_t& end) const {
    if (k < rounds) {
      first = (k * grid + blockIdx.x) * size;
      end = first + size;
    } else {
      first = share_begin + (k - rounds) * size;
      end = min(first + size, share_end);
    }
  }
};

// kPlan: task plans (process_planned), else process_task; the same bytes. kMinBlocks: the blocks
// per SM the register budget is cut for: 3 (59-64 registers, no spills) or 4 (53-55 registers, no
// spills; ProducerCudaOptions::tma_blocks_per_sm, the default with 64-task tiles: 3 stages of
// them fit 4 blocks in shared memory).
constexpr int kTmaMinBlocks = 3;

template <ProducerMode kMode, int kTmaStages, bool kPlan, int kMinBlocks = kTmaMinBlocks>
__global__ void __launch_bounds__(kTmaThreads, kMinBlocks)
    producer_tma_kernel(const KernelArgs a, const TmaGeometry g) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float4 s_norm[kNumNorms][32];
  __shared__ __align__(8) uint64_t full[kTmaStages];
  __shared__ __align__(8) uint64_t empty[kTmaStages];

  // Programmatic dependent launch: no global access before the preceding grid completes.
  pdl_launch_dependents();
  pdl_wait();
  const int warp = threadIdx.x / 32;
  const int lane32 = threadIdx.x % 32;
  const bool copy_warp = warp == kTmaComputeWarps;
  const BlockTiles tiles(a, g);

  // ---- copy warp ----
  // Per tile: the packed copies first (no dependency), then the loads of the next tile's
  // positions and slots, then this tile's metadata and RoPE copies from the registers loaded one
  // tile earlier. The copy warp initializes the barriers and fills the first kTmaStages stages
  // (no empty wait) before the block barrier, so their loads overlap the norm-weight staging.
  uint64_t stream_policy = 0, keep_policy = 0;
  TileSpan cur;
  TileMeta meta{};
  uint32_t it = 0;  // tiles issued (copy warp) / consumed (compute warps)
  const auto span_of = [&](uint32_t k) {
    uint32_t first, end;
    tiles.tile(k, first, end);
    return tile_span(a, first, end);
  };
  const auto fill_next = [&] {
    const uint32_t s = it % kTmaStages;
    uint8_t* st = smem + s * g.stage_bytes;
    tma_copy_packed(a, cur, st, &full[s], lane32, stream_policy);
    TileSpan next;
    TileMeta next_meta{};
    if (it + 1 < tiles.count) {
      next = span_of(it + 1);
      load_meta(a, next, lane32, next_meta);
    }
    tma_stage_meta(a, g, cur, meta, st, &full[s], lane32, keep_policy);
    if constexpr (kPlan) tma_stage_plan<kMode>(a, g, cur, st, lane32);
    mbar_arrive(&full[s]);
    cur = next;
    meta = next_meta;
    ++it;
  };
  if (copy_warp) {
    if (lane32 == 0) {
      for (int s = 0; s < kTmaStages; ++s) {
        mbar_init(&full[s], 32);
        mbar_init(&empty[s], kTmaComputeWarps * 32);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
    stream_policy = l2_policy_evict_first();
    keep_policy = l2_policy_evict_last();
    if (tiles.count > 0) {
      cur = span_of(0);
      load_meta(a, cur, lane32, meta);
    }
    while (it < tiles.count && it < static_cast<uint32_t>(kTmaStages)) fill_next();
  }
  stage_norms(a, s_norm);  // threads 0..63: compute warps 0 and 1
  __syncthreads();         // barriers initialized, norms staged
  if (copy_warp) {
    while (it < tiles.count) {
      mbar_wait(&empty[it % kTmaStages], (it / kTmaStages - 1) & 1u);
      fill_next();
    }
    return;
  }

  // ---- compute warps ----
  constexpr int kGroups = kTmaComputeWarps * 32 / kLanesPerHead;  // 32
  const int rounds = static_cast<int>(g.tile_tasks) / kGroups;    // 128 tasks: 4; 64: 2
  const int lane = threadIdx.x & (kLanesPerHead - 1);
  const int group = threadIdx.x / kLanesPerHead;
#pragma unroll 1
  for (; it < tiles.count; ++it) {
    const uint32_t s = it % kTmaStages;
    const uint8_t* st = smem + s * g.stage_bytes;
    uint32_t first, tile_end;
    tiles.tile(it, first, tile_end);
    const uint32_t t_first = a.heads.div(first);
    mbar_wait(&full[s], (it / kTmaStages) & 1u);
    const auto* s_rope = reinterpret_cast<const float4(*)[kRopeFloats / 4]>(st + g.rope_off);
    const auto* s_pos = reinterpret_cast<const int32_t*>(st + g.pos_off);
    const auto* s_slot = reinterpret_cast<const int32_t*>(st + g.slot_off);
#pragma unroll 1
    for (int r = 0; r < rounds; ++r) {
      // The last tile of a block is partial: rounds past its end are skipped (uniform per block,
      // so the shuffles stay converged); inside a round, groups past the end compute on the
      // tile's first task and store nothing.
      if (first + r * kGroups >= tile_end) break;
      if constexpr (kPlan) {
        const auto* plans = reinterpret_cast<const TaskPlan*>(st + g.plan_off);
        process_planned(a, st, plans[r * kGroups + group], lane, s_norm, s_rope);
        continue;
      }
      const uint32_t task = first + r * kGroups + group;
      const bool valid = task < tile_end;
      const uint8_t* head = st + (valid ? task - first : 0u) * kHeadBytes;
      const LaneRaw raw = load_slice8(head, lane);
      process_task<kMode>(a, raw, task, valid, first, t_first, lane, s_norm, s_rope, s_pos, s_slot);
    }
    mbar_arrive(&empty[s]);
  }
}

}  // namespace m3attn::producer_kernel
