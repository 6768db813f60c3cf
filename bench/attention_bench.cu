// Paged FP8 attention benchmark (M3 geometry: 64 query heads, 4 KV heads, head dim 128).
//   decode/verify: batch {1, 64, 256} x context {8K, 32K, 128K} x draft_len {0, 3}, sparse (16
//     selected blocks per token and KV head) and dense, CUDA-graph replay with a cold L2: us, bytes
//     of K/V the selection reads (each distinct block of a request's tokens once: 32 KB per block
//     and KV head), GB/s and % of the 4300 GB/s copy bandwidth; two timings: `us` (isolated: one
//     graph replay after an L2 flush, includes ~3 us of launch and event cost) and `b2b_us`
//     (back-to-back: per call of one graph of calls over `copies` page tables that map the
//     requests to disjoint pool regions, so every call's selected K/V is cold; launch latency
//     hidden as inside a captured decode step). The last back-to-back call's output is checked
//     against the twin on its own pages too.
//   prefill: one 8K-token chunk at context 8K and at 64K, sparse and dense, on the cp.async wgmma
//     kernel (kernel 4, "wgmma v2") and the warp-specialised persistent wgmma kernel (kernel 15,
//     "wgmma ws", the automatic choice; kernel 1 on request): us and
//     TFLOP/s counted on the selected work only (4 * 128 FLOP per (query head, visible selected
//     key)); tile_union = blocks walked per 8-token tile and KV head, mma_work/flop = the MMA work
//     of those blocks over the counted work.
// Selections: per (request, KV head) one random block ranking, so a request's draft tokens share
//   their blocks (as real top-k does); prefill tokens of one 64-token group share a ranking.
// Before timing, every configuration is checked once against the CPU twin on a few tokens
//   (rebuilt as one-token requests over copies of only the pages they read): PASS / FAIL.
// Flags: --json (one JSON array per table), --quick (batch {1, 256}, context {8K, 128K}),
//   --prefill (prefill table only), --splits-sweep (decode/verify B64 and B256 at 32K, sparse,
//   under splits auto, 1, 2, 3, 4, 6, 8: tuning of the split plan; no prefill), --kernel=N (0
//   automatic, 1 mma.sync, 4 wgmma, 5 wgmma verify: decode uses it; prefill then runs only that
//   kernel instead of its list), --tokens-per-tile=N, --splits=N,
//   --v-convert=N, --persistent-ctas=N, --verify-variant=N, --decode-kernel=N,
//   --verify-variants=A,B,... (each verify variant on the same case, kernel 5; with --repeat=N
//   the list N times: same-run alternating A/Bs), --repeat=N (also without a variant list),
//   --pdl (programmatic
//   launches; the back-to-back graph then overlaps each call's prologue with the previous call):
//   override the launch plan (AttentionCudaConfig) for tuning; --out-q (every call also writes
//   o_proj's E4M3 input, AttentionParams::out_q / out_scales, in the layer's layout);
//   --read-ceiling (after each sparse decode/verify case a row "... read ceiling": the same
//   selected K/V bytes read by a plain kernel with the same CTA decomposition,
//   read_selected_tiles); --read-delay=NS,... (also a read-ceiling row per NS: the plain kernel
//   waits NS ns after each block landed before it refills the ring, a stand-in for the attention
//   loop's work before its refill: how much the bytes in flight lose to that delay);
//   --timeline (after each decode/verify case: one cold call with AttentionCudaConfig::timeline,
//   per-CTA phase times and the CTAs' ends by SM, CTAs without a tile counted apart; with
//   --read-ceiling also the plain read's timeline in the same form);
//   --no-prefill (decode/verify table only); --case=SUBSTR (only the decode/verify cases whose
//   name contains SUBSTR, e.g. "sparse decode B256 ctx8K draft3"; "A|B": either); --compare-kernels
//   (decode/verify only: sparse draft 0/1/3/7 and dense draft 3 at 8K, each case under the
//   automatic plan, the mma.sync decode kernel, the wgmma verify kernel's variants "v8" (cp.async
//   loads) and "v69" (TMA loads, two-pass NaN test, lazy running max, conflict-free f16 V stores,
//   the early copies, the rows out by bulk copies, K / V copies L2 evict-first: the automatic
//   verify choice beyond one wave),
//   and for draft 7 the wgmma prefill kernel).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/attention/attention.h"
#include "support/bench_util.h"

namespace m3attn {
namespace {

using bench::check_cuda;

constexpr int kNq = 64;
constexpr int kNkv = 4;
constexpr int64_t kTile = int64_t{kPageSize} * kHeadDim;  // bytes of one K or V tile
constexpr int64_t kPageBytes = 2 * kNkv * kTile;          // one page of this layer
constexpr double kSpotTol = 1e-2;                         // row relative L2 (see the GPU test)
bool g_out_q = false;  // --out-q: every call also writes o_proj's E4M3 input (out_q / out_scales)
bool g_timeline = false;  // --timeline: per-CTA timeline of one cold call after each case

// Finite E4M3 values of moderate size: sign, exponent 4..8 (2^-3 .. 2^1), any mantissa.
__global__ void fill_pool(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const uint32_t e = 4 + static_cast<uint32_t>((x >> 8) % 5);
    p[i] = static_cast<uint8_t>((x & 0x87u) | (e << 3));
  }
}

struct Pool {
  uint8_t* data = nullptr;
  int64_t pages = 0;
};

// --read-ceiling: the K and V tiles a sparse decode / verify call selects, read by a plain kernel
// with the attention's CTA decomposition (one CTA of 256 threads per (request, KV head), the
// request's distinct blocks from a host-built list, so without the ids -> page table chain) and
// its ring (3 stages of 32 KB, 2 blocks in flight, cp.async 16-byte copies, 2 CTAs per SM): the
// bytes-only floor of the same call, timed the same way.
constexpr int kReadStages = 3;
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__global__ void __launch_bounds__(256, 2)
    read_selected_tiles(const uint8_t* kv, int64_t page_stride, int64_t plane_stride,
                        const int32_t* list, const int32_t* start, uint32_t* sink, int delay_ns,
                        uint64_t* tl) {
  extern __shared__ __align__(128) uint8_t ring[];
  // tl (--timeline): 8 words per CTA, as the attention kernels write their first 8: entry, list
  // read, first copies issued, first block landed, last block landed, exit, blocks, SM id + 1.
  const auto mark = [&](int slot) {
    if (tl == nullptr || threadIdx.x != 0) return;
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    tl[blockIdx.x * 8 + slot] = t;
  };
  mark(0);
  if (tl != nullptr && threadIdx.x == 0) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    tl[blockIdx.x * 8 + 7] = uint64_t{sm} + 1;
  }
  const int c = blockIdx.x, e0 = start[c], n = start[c + 1] - e0;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  auto issue = [&](int j) {
    if (j < n) {
      const int page = list[2 * (e0 + j)], g = list[2 * (e0 + j) + 1];
      const uint8_t* k = kv + page * page_stride + g * kTile;
      const uint32_t dst = base + (j % kReadStages) * 2 * kTile;
#pragma unroll
      for (int it = 0; it < 4; ++it) {
        const int off = (it * 256 + static_cast<int>(threadIdx.x)) * 16;
        cp16(dst + off, k + off);
        cp16(dst + kTile + off, k + plane_stride + off);
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  if (n > 0) mark(1);  // (it waits for e0 and n)
  for (int j = 0; j < kReadStages - 1; ++j) issue(j);
  mark(2);
  if (tl != nullptr && threadIdx.x == 0) tl[blockIdx.x * 8 + 6] = static_cast<uint64_t>(n);
  for (int j = 0; j < n; ++j) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kReadStages - 2) : "memory");
    __syncthreads();  // block j landed; block j - 1's stage free
    if (j == 0) mark(3);
    if (j == n - 1) mark(4);
    if (delay_ns > 0) {  // --read-delay: a stand-in for the compute before the refill
      uint64_t t0, t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
      do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      } while (t - t0 < static_cast<uint64_t>(delay_ns));
    }
    issue(j + kReadStages - 1);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0 && n > 0 && ring[0] == 0x5Au && ring[1] == 0xA5u) sink[c] = 1u;
  mark(5);
}

// One benchmark problem: host copies of the small tensors, device copies, params.
struct Case {
  std::string name;
  bool sparse = true;
  int R = 0;
  int64_t T = 0;
  int max_pages = 0;
  std::vector<int32_t> qs, pos, lens, table, ids;
  std::vector<uint8_t> q;
  void *d_qs = nullptr, *d_pos = nullptr, *d_lens = nullptr, *d_table = nullptr, *d_ids = nullptr,
       *d_q = nullptr, *d_out = nullptr, *d_ws = nullptr, *d_outq = nullptr, *d_scales = nullptr;
  size_t ws_bytes = 0;
  AttentionParams p;
  AttentionCudaConfig cfg;
  double bytes = 0;  // K/V bytes the selection reads
  double flops = 0;  // selected work
  // Back-to-back timing: page tables of the input copies (copy 0 = `table`), copy k mapping
  // request r to the pool region r + k R (copies <= regions / R: no two copies share a page).
  std::vector<std::vector<int32_t>> tables;
  std::vector<void*> d_tables;
};

// Device copy of n host bytes; with h == nullptr, n bytes poisoned with 0xA5 (outputs, workspace).
void* upload(const void* h, size_t n) {
  void* d = nullptr;
  check_cuda(cudaMalloc(&d, std::max<size_t>(n, 16)), "cudaMalloc");
  if (n && h) check_cuda(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), "upload");
  if (n && !h) check_cuda(cudaMemset(d, 0xA5, n), "poison");
  return d;
}

void free_case(Case& c) {
  for (void* d : {c.d_qs, c.d_pos, c.d_lens, c.d_table, c.d_ids, c.d_q, c.d_out, c.d_ws, c.d_outq,
                  c.d_scales})
    if (d) cudaFree(d);
  for (size_t k = 1; k < c.d_tables.size(); ++k) cudaFree(c.d_tables[k]);
}

// Page tables of `copies` input copies for back-to-back timing (see Case::tables); the pool holds
// `regions` regions of `pages_per_req` pages (request r of copy 0 owns region r).
void make_copy_tables(Case& c, int copies, int64_t pages_per_req) {
  c.tables.assign(1, c.table);
  c.d_tables.assign(1, c.d_table);
  for (int k = 1; k < copies; ++k) {
    std::vector<int32_t> t(c.table.size());
    for (int r = 0; r < c.R; ++r) {
      const int64_t region = int64_t{r} + int64_t{k} * c.R;
      for (int j = 0; j < c.max_pages; ++j)
        t[static_cast<size_t>(r) * c.max_pages + j] =
            static_cast<int32_t>(region * pages_per_req + j);
    }
    c.d_tables.push_back(upload(t.data(), t.size() * 4));
    c.tables.push_back(std::move(t));
  }
}

// Requests of `new_tokens` tokens ending at seq_len `ctx`; request r owns pool pages
// [first_page + r * pages_per_req, ...). Selections: a ranking per (request, head, group of
// `group_tokens` tokens).
Case make_case(const std::string& name, bool sparse, int R, int ctx, int new_tokens,
               int64_t first_page, int64_t pages_per_req, int group_tokens, const Pool& pool,
               const AttentionCudaConfig& cfg, std::mt19937_64& rng) {
  Case c;
  c.cfg = cfg;
  c.name = name;
  c.sparse = sparse;
  c.R = R;
  c.T = int64_t{R} * new_tokens;
  c.max_pages = (ctx + kPageSize - 1) / kPageSize;
  c.qs.resize(R + 1);
  c.lens.assign(R, ctx);
  c.pos.resize(c.T);
  c.table.resize(static_cast<size_t>(R) * c.max_pages);
  for (int r = 0; r <= R; ++r) c.qs[r] = r * new_tokens;
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < new_tokens; ++i) c.pos[r * new_tokens + i] = ctx - new_tokens + i;
    for (int j = 0; j < c.max_pages; ++j)
      c.table[static_cast<size_t>(r) * c.max_pages + j] =
          static_cast<int32_t>(first_page + r * pages_per_req + j);
  }
  if (first_page + int64_t{R} * pages_per_req > pool.pages) {
    std::fprintf(stderr, "pool too small\n");
    std::exit(1);
  }
  // Queries: E4M3 of N(0, 1), drawn from a table of 4096 samples with a cheap generator (an 8K
  // chunk has 67 M query bytes: per-byte normal draws would take seconds).
  c.q.resize(static_cast<size_t>(c.T) * kNq * kHeadDim);
  {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    uint8_t table[4096];
    for (uint8_t& v : table) v = float_to_e4m3(normal(rng));
    uint64_t x = rng() | 1;
    for (uint8_t& v : c.q) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      v = table[(x >> 20) & 4095];
    }
  }
  c.ids.assign(static_cast<size_t>(c.T) * kNkv * kTopK, -1);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  std::vector<double> rank(static_cast<size_t>(c.max_pages));
  std::vector<int> order;
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < kNkv; ++g) {
      std::set<int> uni_blocks;
      for (int i = 0; i < new_tokens; ++i) {
        if (i % group_tokens == 0)
          for (double& x : rank) x = uni(rng);
        const int64_t t = int64_t{r} * new_tokens + i;
        const int pos = c.pos[t];
        const int local = pos / kPageSize;
        order.resize(local);
        std::iota(order.begin(), order.end(), 0);
        if (local > 15) {
          std::partial_sort(order.begin(), order.begin() + 15, order.end(),
                            [&](int a, int b) { return rank[a] > rank[b]; });
          order.resize(15);
        }
        order.push_back(local);
        std::sort(order.begin(), order.end());
        int32_t* row = c.ids.data() + (t * kNkv + g) * kTopK;
        int64_t keys = 0;
        for (size_t k = 0; k < order.size(); ++k) {
          row[k] = order[k];
          keys += std::min(kPageSize, pos - order[k] * kPageSize + 1);
        }
        if (!sparse) keys = pos + 1;
        c.flops += 4.0 * kHeadDim * (kNq / kNkv) * static_cast<double>(keys);
        if (sparse) uni_blocks.insert(order.begin(), order.end());
      }
      const int64_t blocks = sparse ? static_cast<int64_t>(uni_blocks.size()) : c.max_pages;
      c.bytes += static_cast<double>(blocks) * 2 * kTile;
    }
  }
  c.d_qs = upload(c.qs.data(), c.qs.size() * 4);
  c.d_pos = upload(c.pos.data(), c.pos.size() * 4);
  c.d_lens = upload(c.lens.data(), c.lens.size() * 4);
  c.d_table = upload(c.table.data(), c.table.size() * 4);
  c.d_ids = upload(c.ids.data(), c.ids.size() * 4);
  c.d_q = upload(c.q.data(), c.q.size());
  const int64_t width = int64_t{kNq} * kHeadDim;
  c.d_out = upload(nullptr, static_cast<size_t>(c.T * width * 2));
  const Device dev = Device::cuda(0);
  AttentionParams& p = c.p;
  p.n_q = kNq;
  p.n_kv = kNkv;
  p.sparse = sparse;
  p.q = TensorView::contiguous(c.d_q, DType::kE4M3, {c.T, kNq, kHeadDim}, dev);
  p.kv_cache = make_kv_cache_view(pool.data, pool.pages, kNkv, kPageBytes, kNkv * kTile, dev);
  p.block_ids = TensorView::contiguous(c.d_ids, DType::kI32, {c.T, kNkv, kTopK}, dev);
  p.batch.num_tokens = c.T;
  p.batch.num_requests = R;
  p.batch.max_pages = c.max_pages;
  p.batch.query_start = TensorView::contiguous(c.d_qs, DType::kI32, {R + 1}, dev);
  p.batch.positions = TensorView::contiguous(c.d_pos, DType::kI32, {c.T}, dev);
  p.batch.seq_lens = TensorView::contiguous(c.d_lens, DType::kI32, {R}, dev);
  p.batch.page_table =
      TensorView::contiguous(c.d_table, DType::kI32, {R, int64_t{c.max_pages}}, dev);
  p.out = TensorView::contiguous(c.d_out, DType::kBF16, {c.T, width}, dev);
  if (g_out_q) {  // the layer's layout: M_pad = T rounded up to 4, scales with strides (1, M_pad)
    const int64_t m_pad = (c.T + 3) / 4 * 4;
    c.d_outq = upload(nullptr, static_cast<size_t>(m_pad * width));
    c.d_scales = upload(nullptr, static_cast<size_t>(m_pad * kNq * 4));
    p.out_q = TensorView::contiguous(c.d_outq, DType::kE4M3, {m_pad, width}, dev);
    p.out_scales = TensorView::strided(c.d_scales, DType::kF32, {m_pad, kNq}, {1, m_pad}, dev);
  }
  c.ws_bytes = attention_workspace_bytes(p, cfg);
  c.d_ws = upload(nullptr, c.ws_bytes);
  return c;
}

// Blocks per (8-token tile, KV head) that the wgmma kernels walk (the union of the tile's
// selections, sparse; blocks 0 .. max position / 128, dense), averaged, and the MMA work they do
// (every walked block costs 8 tokens x 16 heads x 128 keys, masked or not) over the counted work.
void tile_unions(const Case& c, double* avg_union, double* work_ratio) {
  constexpr int kTileTokens = 8;
  double unions = 0, tiles = 0;
  for (int r = 0; r < c.R; ++r) {
    for (int64_t t0 = c.qs[r]; t0 < c.qs[r + 1]; t0 += kTileTokens) {
      const int64_t t1 = std::min<int64_t>(t0 + kTileTokens, c.qs[r + 1]);
      for (int g = 0; g < kNkv; ++g) {
        std::set<int> u;
        int maxpos = 0;
        for (int64_t t = t0; t < t1; ++t) {
          maxpos = std::max(maxpos, c.pos[t]);
          for (int k = 0; k < kTopK && c.sparse; ++k) {
            const int b = c.ids[(t * kNkv + g) * kTopK + k];
            if (b >= 0 && b <= c.pos[t] / kPageSize) u.insert(b);
          }
        }
        unions += c.sparse ? static_cast<double>(u.size()) : maxpos / kPageSize + 1;
        tiles += 1;
      }
    }
  }
  *avg_union = tiles > 0 ? unions / tiles : 0;
  const double per_block = 4.0 * kHeadDim * kPageSize * kTileTokens * (kNq / kNkv);
  *work_ratio = c.flops > 0 ? unions * per_block / c.flops : 0;
}

// One row of the decode/verify table: isolated and back-to-back times of `bytes` K/V bytes.
bench::Row timing_row(const std::string& name, const std::string& verdict, double worst,
                      const bench::Timing& tm, const bench::Timing& tb, int copies, double bytes,
                      double flops) {
  bench::Row row;
  row.add("case", name);
  row.add("check", verdict);
  row.add("max_rel", worst, 4);
  row.add("us", tm.median_us, 1);
  row.add("min_us", tm.min_us, 1);
  row.add("b2b_us", tb.median_us, 1);
  row.add("copies", std::to_string(copies));
  row.add("MB_kv", bytes / 1e6, 1);
  const double gbs = bytes / (tm.median_us * 1e3);
  row.add("GB/s", gbs, 0);
  row.add("pct_bw", 100.0 * gbs / bench::kCopyBandwidthGBs, 1);
  row.add("b2b_pct_bw", 100.0 * bytes / (tb.median_us * 1e3) / bench::kCopyBandwidthGBs, 1);
  row.add("TFLOP/s", flops / (tm.median_us * 1e6), 1);
  return row;
}

// The per-CTA timeline words (see AttentionCudaConfig::timeline) of one cold call:
// per phase the times of the CTAs that own a tile (us after the first CTA's entry), their phase
// lengths, the CTAs without a tile (the grid is sized for the worst token distribution), and the
// CTAs' ends by SM.
// kWords: words per CTA (the attention kernels' 16, the plain read's 8); words 8-15 (the sparse
// verify front's and epilogue's stamps) are printed where a CTA recorded them.
void analyze_timeline(const std::string& name, double cold_us, const std::vector<uint64_t>& tl,
                      int kWords) {
  const int64_t max_ctas = static_cast<int64_t>(tl.size()) / kWords;
  uint64_t g0 = ~uint64_t{0};
  for (int64_t x = 0; x < max_ctas; ++x)
    if (tl[x * kWords]) g0 = std::min(g0, tl[x * kWords]);
  const auto pct = [](std::vector<double> v, double q) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
  };
  const auto us = [&](uint64_t ns) { return static_cast<double>(ns - g0) * 1e-3; };
  std::vector<double> at[6], len[5], per_block, ph_entry, ph_exit, blocks;
  std::vector<std::pair<int, double>> by_sm;  // (SM, a real CTA's exit)
  for (int64_t x = 0; x < max_ctas; ++x) {
    const uint64_t* w = tl.data() + x * kWords;
    if (!w[0]) continue;
    if (!w[1]) {  // no tile
      ph_entry.push_back(us(w[0]));
      if (w[5]) ph_exit.push_back(us(w[5]));
      continue;
    }
    for (int sl = 0; sl < 6; ++sl)
      if (w[sl]) at[sl].push_back(us(w[sl]));
    for (int sl = 0; sl < 5; ++sl)
      if (w[sl] && w[sl + 1]) len[sl].push_back(static_cast<double>(w[sl + 1] - w[sl]) * 1e-3);
    blocks.push_back(static_cast<double>(w[6]));
    if (w[6] > 1 && w[3] && w[4])
      per_block.push_back(static_cast<double>(w[4] - w[3]) * 1e-3 / static_cast<double>(w[6] - 1));
    if (w[5]) by_sm.emplace_back(static_cast<int>(w[7]) - 1, us(w[5]));
  }
  std::printf(
      "timeline %s: cold call %.1f us (median of 3, incl. a memset), %zu CTAs with a tile "
      "(blocks p50 %.0f max %.0f), %zu without\n",
      name.c_str(), cold_us, at[0].size(), pct(blocks, 0.5), pct(blocks, 1), ph_entry.size());
  const char* names[] = {"entry", "inputs", "list", "first", "attended", "exit"};
  for (int sl = 0; sl < 6; ++sl) {
    std::printf("  %-8s at us: min %6.2f p10 %6.2f p50 %6.2f p90 %6.2f max %6.2f", names[sl],
                pct(at[sl], 0), pct(at[sl], 0.1), pct(at[sl], 0.5), pct(at[sl], 0.9),
                pct(at[sl], 1));
    if (sl > 0)
      std::printf("   phase us: p10 %6.2f p50 %6.2f p90 %6.2f max %6.2f", pct(len[sl - 1], 0.1),
                  pct(len[sl - 1], 0.5), pct(len[sl - 1], 0.9), pct(len[sl - 1], 1));
    std::printf("\n");
  }
  // The front's and the bulk epilogue's stamps (words 8-15 where recorded): at us after the
  // first entry.
  const char* front[] = {"ids", "ranked", "page0", "copy0", "staged", "bulk", "ep_in", "ep_st"};
  for (int sl = 8; sl < std::min(kWords, 16); ++sl) {
    std::vector<double> v;
    for (int64_t x = 0; x < max_ctas; ++x) {
      const uint64_t* w = tl.data() + x * kWords;
      if (w[0] && w[1] && w[sl]) v.push_back(us(w[sl]));
    }
    if (v.empty()) continue;
    std::printf("  %-8s at us: min %6.2f p10 %6.2f p50 %6.2f p90 %6.2f max %6.2f  (%zu CTAs)\n",
                front[sl - 8], pct(v, 0), pct(v, 0.1), pct(v, 0.5), pct(v, 0.9), pct(v, 1),
                v.size());
  }
  std::printf(
      "  per block (first landed .. last attended) us: p10 %.3f p50 %.3f p90 %.3f max %.3f\n",
      pct(per_block, 0.1), pct(per_block, 0.5), pct(per_block, 0.9), pct(per_block, 1));
  if (!ph_entry.empty())
    std::printf(
        "  without a tile: entry us p10 %.2f p50 %.2f max %.2f, exit us p50 %.2f max %.2f\n",
        pct(ph_entry, 0.1), pct(ph_entry, 0.5), pct(ph_entry, 1), pct(ph_exit, 0.5),
        pct(ph_exit, 1));
  // The last exit per SM, and how many CTAs with a tile each SM ran.
  std::map<int, std::pair<int, double>> sm;  // SM -> (CTAs, last exit)
  for (const auto& [id, e] : by_sm) {
    auto& v = sm[id];
    v.first += 1;
    v.second = std::max(v.second, e);
  }
  std::vector<std::pair<double, int>> ends;
  std::map<int, int> ctas_hist;
  for (const auto& [id, v] : sm) {
    ends.emplace_back(v.second, id);
    ctas_hist[v.first] += 1;
  }
  std::sort(ends.begin(), ends.end());
  std::vector<double> e_only;
  for (const auto& e : ends) e_only.push_back(e.first);
  std::printf("  SMs %zu, CTAs per SM:", ends.size());
  for (const auto& [n, k] : ctas_hist) std::printf(" %d x %d", k, n);
  std::printf("; last exit per SM us: min %.2f p10 %.2f p50 %.2f p90 %.2f max %.2f\n",
              pct(e_only, 0), pct(e_only, 0.1), pct(e_only, 0.5), pct(e_only, 0.9), pct(e_only, 1));
  // Do the late CTAs start late? Correlation of "first block landed" with "exit", and the last 8.
  {
    std::vector<std::array<double, 4>> cta;  // first, attended, exit, SM
    for (int64_t x = 0; x < max_ctas; ++x) {
      const uint64_t* w = tl.data() + x * kWords;
      if (w[0] && w[1] && w[3] && w[4] && w[5])
        cta.push_back({us(w[3]), us(w[4]), us(w[5]), static_cast<double>(w[7]) - 1});
    }
    double mf = 0, me = 0, sff = 0, see = 0, sfe = 0;
    for (const auto& c : cta) {
      mf += c[0];
      me += c[2];
    }
    const double n = static_cast<double>(std::max<size_t>(cta.size(), 1));
    mf /= n;
    me /= n;
    for (const auto& c : cta) {
      sff += (c[0] - mf) * (c[0] - mf);
      see += (c[2] - me) * (c[2] - me);
      sfe += (c[0] - mf) * (c[2] - me);
    }
    std::sort(
        cta.begin(), cta.end(),
        [](const std::array<double, 4>& x, const std::array<double, 4>& y) { return x[2] < y[2]; });
    std::printf("  corr(first landed, exit) %.2f; the last 8 CTAs (SM first attended exit):",
                sff > 0 && see > 0 ? sfe / std::sqrt(sff * see) : 0.0);
    for (size_t i = cta.size() >= 8 ? cta.size() - 8 : 0; i < cta.size(); ++i)
      std::printf("%s%.0f %.1f %.1f %.1f", i % 4 == 0 ? "\n    " : " | ", cta[i][3], cta[i][0],
                  cta[i][1], cta[i][2]);
    std::printf("\n");
  }
  std::printf("  SMs by last exit (smid:us), first 12 and last 12:");
  for (size_t i = 0; i < ends.size(); ++i)
    if (i < 12 || i + 12 >= ends.size())
      std::printf("%s%d:%.1f", i == 0 || i == 12 ? "\n    " : " ", ends[i].second, ends[i].first);
  std::printf("\n");
}

// The --read-ceiling row of a sparse case (read_selected_tiles on the blocks of every copy).
bench::Row read_ceiling_row(const Case& c, const Pool& pool, int copies, int calls,
                            cudaStream_t stream, int delay_ns) {
  std::vector<void*> d_lists;
  std::vector<int32_t> start;
  for (int k = 0; k < copies; ++k) {
    const std::vector<int32_t>& table = c.tables[static_cast<size_t>(k)];
    std::vector<int32_t> list;
    start.clear();
    for (int r = 0; r < c.R; ++r) {
      for (int g = 0; g < kNkv; ++g) {
        start.push_back(static_cast<int32_t>(list.size() / 2));
        std::set<int> u;
        for (int64_t t = c.qs[r]; t < c.qs[r + 1]; ++t)
          for (int j = 0; j < kTopK; ++j) {
            const int b = c.ids[(t * kNkv + g) * kTopK + j];
            if (b >= 0 && b <= c.pos[t] / kPageSize) u.insert(b);
          }
        for (int b : u) {
          list.push_back(table[static_cast<size_t>(r) * c.max_pages + b]);
          list.push_back(g);
        }
      }
    }
    start.push_back(static_cast<int32_t>(list.size() / 2));
    d_lists.push_back(upload(list.data(), list.size() * 4));
  }
  void* d_start = upload(start.data(), start.size() * 4);  // the same for every copy
  void* d_sink = upload(nullptr, start.size() * 4);
  const int ctas = c.R * kNkv;
  check_cuda(cudaFuncSetAttribute(read_selected_tiles, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kReadStages * 2 * kTile),
             "read ceiling smem");
  auto launch = [&](cudaStream_t s, int copy, uint64_t* tl = nullptr) {
    read_selected_tiles<<<ctas, 256, kReadStages * 2 * kTile, s>>>(
        pool.data, kPageBytes, kNkv * kTile, static_cast<const int32_t*>(d_lists[copy]),
        static_cast<const int32_t*>(d_start), static_cast<uint32_t*>(d_sink), delay_ns, tl);
  };
  const bench::Timing tm = bench::time_graph_cold([&](cudaStream_t s) { launch(s, 0); }, stream);
  const bench::Timing tb = bench::time_graph_back_to_back(
      [&](cudaStream_t s, int copy) { launch(s, copy); }, copies, stream, calls);
  check_cuda(cudaStreamSynchronize(stream), "read ceiling");
  std::string name = c.name.substr(0, c.name.find(" draft") + 7) + " read ceiling";
  if (delay_ns > 0) name += " delay" + std::to_string(delay_ns);
  if (g_timeline && delay_ns == 0) {  // the plain read's own timeline, as print_timeline's
    const size_t tl_bytes = static_cast<size_t>(ctas) * 8 * sizeof(uint64_t);
    uint64_t* d_tl = static_cast<uint64_t*>(upload(nullptr, tl_bytes));
    const bench::Timing tt = bench::time_cold(
        [&](cudaStream_t s) {
          check_cuda(cudaMemsetAsync(d_tl, 0, tl_bytes, s), "timeline clear");
          launch(s, 0, d_tl);
        },
        stream, 1, 3);
    std::vector<uint64_t> tl(static_cast<size_t>(ctas) * 8);
    check_cuda(cudaMemcpy(tl.data(), d_tl, tl_bytes, cudaMemcpyDeviceToHost), "timeline");
    cudaFree(d_tl);
    analyze_timeline(name + " (phases: list read, copies issued, first landed, last landed)",
                     tt.median_us, tl, 8);
  }
  for (void* d : d_lists) cudaFree(d);
  cudaFree(d_start);
  cudaFree(d_sink);
  return timing_row(name, "n/a", 0.0, tm, tb, copies, c.bytes, 0.0);
}

// One call on input copy `copy` (its page table; everything else is shared).
void run_once(const Case& c, cudaStream_t s, int copy = 0) {
  AttentionParams p = c.p;
  if (copy > 0)
    p.batch.page_table = TensorView::contiguous(c.d_tables[copy], DType::kI32,
                                                {c.R, int64_t{c.max_pages}}, Device::cuda(0));
  const Status st = run_attention_cuda(p, c.d_ws, c.ws_bytes, s, c.cfg);
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", c.name.c_str(), st.to_string().c_str());
    std::exit(1);
  }
}

// --timeline: one cold call (L2 flushed) with AttentionCudaConfig::timeline, then per phase the
// times of the CTAs that own a tile (us after the first CTA's entry), their phase lengths, the CTAs
// without a tile (the grid is sized for the worst token distribution), and the CTAs' ends by SM.
void print_timeline(Case& c, cudaStream_t stream) {
  constexpr int kWords = 16;                  // attention_kernel.cuh kTimelineWords
  const int64_t max_ctas = c.T * kNkv * 128;  // T x n_kv x splits (<= 128)
  const size_t bytes = static_cast<size_t>(max_ctas) * kWords * 8;
  uint64_t* d_tl = static_cast<uint64_t*>(upload(nullptr, bytes));
  const AttentionCudaConfig saved = c.cfg;
  c.cfg.timeline = d_tl;
  const bench::Timing t = bench::time_cold(
      [&](cudaStream_t s) {
        check_cuda(cudaMemsetAsync(d_tl, 0, bytes, s), "timeline clear");
        run_once(c, s);
      },
      stream, 1, 3);
  c.cfg = saved;
  std::vector<uint64_t> tl(static_cast<size_t>(max_ctas) * kWords);
  check_cuda(cudaMemcpy(tl.data(), d_tl, bytes, cudaMemcpyDeviceToHost), "timeline");
  cudaFree(d_tl);
  analyze_timeline(c.name, t.median_us, tl, kWords);
}

// Twin rows of tokens `toks` ([toks.size(), n_q * 128] bf16), each rebuilt as a one-token request
// over host copies of the pages it reads (unread visible blocks map to one shared page that no
// selection touches). Empty on failure.
std::vector<uint16_t> twin_rows(const Case& c, const Pool& pool, const std::vector<int64_t>& toks,
                                int copy = 0) {
  const std::vector<int32_t>& c_table = copy == 0 ? c.table : c.tables[copy];
  const int n = static_cast<int>(toks.size());
  const int64_t width = int64_t{kNq} * kHeadDim;
  int max_pages = 1;
  for (int64_t t : toks) max_pages = std::max(max_pages, c.pos[t] / kPageSize + 1);
  std::vector<int32_t> table(static_cast<size_t>(n) * max_pages, 0);
  std::vector<int64_t> src_pages = {-1};  // compact page 0: zeros, never selected
  Tensor q(DType::kE4M3, {n, kNq, kHeadDim});
  Tensor ids(DType::kI32, {n, kNkv, kTopK});
  Tensor qs(DType::kI32, {n + 1}), pos(DType::kI32, {n}), lens(DType::kI32, {n});
  for (int i = 0; i < n; ++i) {
    const int64_t t = toks[i];
    const int r =
        static_cast<int>(std::upper_bound(c.qs.begin(), c.qs.end(), t) - c.qs.begin()) - 1;
    std::memcpy(q.ptr<uint8_t>() + int64_t{i} * kNq * kHeadDim, c.q.data() + t * kNq * kHeadDim,
                kNq * kHeadDim);
    std::memcpy(ids.ptr<int32_t>() + int64_t{i} * kNkv * kTopK, c.ids.data() + t * kNkv * kTopK,
                kNkv * kTopK * 4);
    qs.ptr<int32_t>()[i] = i;
    pos.ptr<int32_t>()[i] = c.pos[t];
    lens.ptr<int32_t>()[i] = c.pos[t] + 1;
    const int visible = c.pos[t] / kPageSize + 1;
    std::vector<char> used(static_cast<size_t>(visible), c.sparse ? 0 : 1);
    if (c.sparse)
      for (int k = 0; k < kNkv * kTopK; ++k) {
        const int b = c.ids[t * kNkv * kTopK + k];
        if (b >= 0 && b < visible) used[b] = 1;
      }
    for (int b = 0; b < visible; ++b) {
      if (!used[b]) continue;
      table[static_cast<size_t>(i) * max_pages + b] = static_cast<int32_t>(src_pages.size());
      src_pages.push_back(c_table[static_cast<size_t>(r) * c.max_pages + b]);
    }
  }
  qs.ptr<int32_t>()[n] = n;
  Tensor kv(DType::kE4M3, {static_cast<int64_t>(src_pages.size()) * kPageBytes});
  std::memset(kv.data(), 0, static_cast<size_t>(kv.nbytes()));
  for (size_t j = 1; j < src_pages.size(); ++j)
    check_cuda(cudaMemcpy(kv.ptr<uint8_t>() + j * kPageBytes, pool.data + src_pages[j] * kPageBytes,
                          kPageBytes, cudaMemcpyDeviceToHost),
               "download page");
  Tensor tab(DType::kI32, {n, max_pages});
  std::memcpy(tab.data(), table.data(), table.size() * 4);
  Tensor out(DType::kBF16, {n, width});
  AttentionParams p;
  p.n_q = kNq;
  p.n_kv = kNkv;
  p.sparse = c.sparse;
  p.q = q.view();
  p.kv_cache = make_kv_cache_view(kv.data(), static_cast<int64_t>(src_pages.size()), kNkv,
                                  kPageBytes, kNkv * kTile);
  p.block_ids = ids.view();
  p.batch.num_tokens = n;
  p.batch.num_requests = n;
  p.batch.max_pages = max_pages;
  p.batch.query_start = qs.view();
  p.batch.positions = pos.view();
  p.batch.seq_lens = lens.view();
  p.batch.page_table = tab.view();
  p.out = out.view();
  const Status st = run_attention_cpu(p);
  if (!st.ok()) {
    std::fprintf(stderr, "spot check twin: %s\n", st.to_string().c_str());
    return {};
  }
  return std::vector<uint16_t>(out.ptr<uint16_t>(), out.ptr<uint16_t>() + n * width);
}

// Compares the GPU rows of `toks` with the twin's: row relative L2 <= kSpotTol.
bool compare_rows(const Case& c, const std::vector<int64_t>& toks,
                  const std::vector<uint16_t>& twin, double* worst) {
  const int n = static_cast<int>(toks.size());
  const int64_t width = int64_t{kNq} * kHeadDim;
  *worst = 1e30;
  if (twin.size() != static_cast<size_t>(n * width)) return false;
  std::vector<uint16_t> gpu(static_cast<size_t>(c.T * width));
  check_cuda(cudaMemcpy(gpu.data(), c.d_out, gpu.size() * 2, cudaMemcpyDeviceToHost), "download");
  bool ok = true;
  *worst = 0;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < kNq; ++j) {
      double num = 0, den = 0;
      for (int d = 0; d < kHeadDim; ++d) {
        const double a = bf16_to_float(gpu[toks[i] * width + j * kHeadDim + d]);
        const double b = bf16_to_float(twin[i * width + j * kHeadDim + d]);
        num += (a - b) * (a - b);
        den += b * b;
      }
      const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
      if (!(rel <= kSpotTol)) ok = false;
      *worst = std::max(*worst, std::isnan(rel) ? 1e30 : rel);
    }
  return ok;
}

}  // namespace
}  // namespace m3attn

// --case=SUBSTR: true when `name` contains one of the '|'-separated alternatives of `only`.
bool name_matches(const std::string& name, const std::string& only) {
  size_t from = 0;
  while (true) {
    const size_t bar = only.find('|', from);
    if (name.find(only.substr(from, bar == std::string::npos ? std::string::npos : bar - from)) !=
        std::string::npos)
      return true;
    if (bar == std::string::npos) return false;
    from = bar + 1;
  }
}

int main(int argc, char** argv) {
  using namespace m3attn;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // tables appear as they finish, also in a log file
  bool json = false, quick = false, prefill_only = false, sweep = false, no_prefill = false,
       compare = false, read_ceiling = false;
  std::string only;  // --case=SUBSTR: only cases whose name contains it
  AttentionCudaConfig cfg;
  std::vector<int> prefill_kernels;  // --kernels=A,B,...: these prefill kernels on the same cases
  std::vector<int> read_delays;      // --read-delay=NS,...: extra read-ceiling rows
  std::vector<int> verify_variants;  // --verify-variants=A,B,...: each on the same case
  int repeat = 1;                    // --repeat=N: the variant list N times (alternating runs)
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--prefill") == 0) {
      prefill_only = true;
    } else if (std::strcmp(argv[i], "--no-prefill") == 0) {
      no_prefill = true;
    } else if (std::strncmp(argv[i], "--case=", 7) == 0) {
      only = argv[i] + 7;
    } else if (std::strcmp(argv[i], "--compare-kernels") == 0) {
      compare = true;
      no_prefill = true;
    } else if (std::strncmp(argv[i], "--persistent-ctas=", 18) == 0) {
      cfg.persistent_ctas = std::atoi(argv[i] + 18);
    } else if (std::strcmp(argv[i], "--splits-sweep") == 0) {
      sweep = true;
    } else if (std::strncmp(argv[i], "--kernels=", 10) == 0) {
      for (const char* k = argv[i] + 10; *k != '\0';) {
        prefill_kernels.push_back(std::atoi(k));
        while (*k != '\0' && *k != ',') ++k;
        if (*k == ',') ++k;
      }
    } else if (std::strncmp(argv[i], "--kernel=", 9) == 0) {
      cfg.kernel = std::atoi(argv[i] + 9);
    } else if (std::strncmp(argv[i], "--tokens-per-tile=", 18) == 0) {
      cfg.tokens_per_tile = std::atoi(argv[i] + 18);
    } else if (std::strncmp(argv[i], "--splits=", 9) == 0) {
      cfg.splits = std::atoi(argv[i] + 9);
    } else if (std::strncmp(argv[i], "--v-convert=", 12) == 0) {
      cfg.v_convert = std::atoi(argv[i] + 12);
    } else if (std::strncmp(argv[i], "--verify-variants=", 18) == 0) {
      for (const char* k = argv[i] + 18; *k != '\0';) {
        verify_variants.push_back(std::atoi(k));
        while (*k != '\0' && *k != ',') ++k;
        if (*k == ',') ++k;
      }
    } else if (std::strncmp(argv[i], "--repeat=", 9) == 0) {
      repeat = std::max(1, std::atoi(argv[i] + 9));
    } else if (std::strncmp(argv[i], "--verify-variant=", 17) == 0) {
      cfg.verify_variant = std::atoi(argv[i] + 17);
    } else if (std::strncmp(argv[i], "--decode-kernel=", 16) == 0) {
      cfg.decode_kernel = std::atoi(argv[i] + 16);
    } else if (std::strcmp(argv[i], "--pdl") == 0) {
      cfg.programmatic_launch = true;
    } else if (std::strcmp(argv[i], "--out-q") == 0) {
      g_out_q = true;
    } else if (std::strcmp(argv[i], "--read-ceiling") == 0) {
      read_ceiling = true;
    } else if (std::strncmp(argv[i], "--read-delay=", 13) == 0) {
      read_ceiling = true;
      for (const char* k = argv[i] + 13; *k != '\0';) {
        read_delays.push_back(std::atoi(k));
        while (*k != '\0' && *k != ',') ++k;
        if (*k == ',') ++k;
      }
    } else if (std::strcmp(argv[i], "--timeline") == 0) {
      g_timeline = true;
    } else {
      std::fprintf(stderr,
                   "usage: attention_bench [--json] [--quick] [--prefill] [--splits-sweep] "
                   "[--kernel=N] "
                   "[--tokens-per-tile=N] [--splits=N] [--v-convert=N] "
                   "[--verify-variant=N] [--verify-variants=A,B,...] [--repeat=N] "
                   "[--decode-kernel=N] [--pdl] [--out-q] [--read-ceiling] "
                   "[--read-delay=NS,...] [--timeline] "
                   "[--no-prefill] "
                   "[--compare-kernels] "
                   "[--persistent-ctas=N] "
                   "[--case=SUBSTR] [--kernels=A,B,... (prefill)]\n");
      return 2;
    }
  }
  const std::vector<int> batches = sweep   ? std::vector<int>{64, 256}
                                   : quick ? std::vector<int>{1, 256}
                                           : std::vector<int>{1, 64, 256};
  const std::vector<int> contexts = sweep   ? std::vector<int>{32768}
                                    : quick ? std::vector<int>{8192, 131072}
                                            : std::vector<int>{8192, 32768, 131072};
  const int max_ctx_pages = *std::max_element(contexts.begin(), contexts.end()) / kPageSize;

  // One pool for everything: 256 requests x the longest context (decode), then 512 pages (64K
  // prefill).
  const int64_t decode_pages = prefill_only ? 0 : int64_t{256} * max_ctx_pages;
  const int64_t prefill_pages = sweep || no_prefill ? 0 : 65536 / kPageSize;
  Pool pool;
  pool.pages = decode_pages + prefill_pages;
  const size_t pool_bytes = static_cast<size_t>(pool.pages * kPageBytes);
  check_cuda(cudaMalloc(&pool.data, pool_bytes), "cudaMalloc(pool)");
  fill_pool<<<4096, 256>>>(pool.data, static_cast<int64_t>(pool_bytes), 12345);
  check_cuda(cudaDeviceSynchronize(), "fill pool");
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "stream");
  std::mt19937_64 rng(2024);
  bool all_pass = true;

  std::vector<bench::Row> rows;
  // Launch variants timed on each decode/verify case (same inputs, selections and twin rows).
  using Variant = std::pair<std::string, AttentionCudaConfig>;
  auto variants_for = [&](int draft) {
    std::vector<Variant> v;
    if (sweep) {
      for (int splits : {0, 1, 2, 3, 4, 6, 8}) {
        AttentionCudaConfig x = cfg;
        x.splits = splits;
        v.emplace_back(" splits " + (splits == 0 ? std::string("auto") : std::to_string(splits)),
                       x);
      }
    } else if (compare) {
      // {kernel, verify kernel variant}
      const std::vector<std::array<int, 2>> kp = {{0, 0}, {1, 0}, {5, 8}, {5, 69}};
      for (const auto& [kernel, variant] : kp) {
        AttentionCudaConfig x = cfg;
        x.kernel = kernel;
        x.verify_variant = variant;
        const std::string k = kernel == 0 ? "auto" : kernel == 1 ? "mma.sync" : "wgmma verify";
        v.emplace_back(" " + k + (variant ? " v" + std::to_string(variant) : std::string()), x);
      }
      if (draft >= 7) {
        AttentionCudaConfig x = cfg;
        x.kernel = 4;
        v.emplace_back(" wgmma prefill", x);
      }
    } else if (!verify_variants.empty()) {
      for (int rep = 0; rep < repeat; ++rep)
        for (int variant : verify_variants) {
          AttentionCudaConfig x = cfg;
          x.kernel = 5;
          x.verify_variant = variant;
          v.emplace_back(" v" + std::to_string(variant), x);
        }
    } else {
      for (int rep = 0; rep < repeat; ++rep) v.emplace_back("", cfg);
    }
    return v;
  };
  const std::vector<int> drafts = compare ? std::vector<int>{0, 1, 3, 7} : std::vector<int>{0, 3};
  for (bool sparse : {true, false}) {
    if (prefill_only || (sweep && !sparse)) break;
    for (int draft : drafts) {
      if (!sparse && compare && draft != 3) continue;
      for (int B : batches) {
        for (int ctx : contexts) {
          if (!sparse && compare && ctx != 8192) continue;
          const std::vector<Variant> variants = variants_for(draft);
          const std::string base = std::string(sparse ? "sparse" : "dense") + " decode B" +
                                   std::to_string(B) + " ctx" + std::to_string(ctx / 1024) +
                                   "K draft" + std::to_string(draft);
          if (!name_matches(base, only)) continue;
          Case c = make_case(base, sparse, B, ctx, 1 + draft, 0, max_ctx_pages, 1 + draft, pool,
                             variants[0].second, rng);
          // Spot check: the first and the last token (dense: the last token of batch 1 only,
          // the twin is slow on long contexts).
          const bool check = sparse || B == 1;
          const std::vector<int64_t> toks =
              sparse ? std::vector<int64_t>{0, c.T - 1} : std::vector<int64_t>{c.T - 1};
          const std::vector<uint16_t> twin =
              check ? twin_rows(c, pool, toks) : std::vector<uint16_t>{};
          // Back-to-back: enough page-table copies (distinct pool regions) that every call's
          // selected K/V is cold; the output of the sequence's last call (copy `last`) is checked
          // against the twin on that copy's pages.
          const int regions = static_cast<int>(decode_pages / max_ctx_pages);
          const int copies = std::max(
              1, std::min(bench::back_to_back_copies(static_cast<size_t>(c.bytes)), regions / B));
          make_copy_tables(c, copies, max_ctx_pages);
          const int calls = std::max(8, 2 * copies);
          const int last = (calls - 1) % copies;
          const std::vector<uint16_t> twin_last = !check      ? std::vector<uint16_t>{}
                                                  : last == 0 ? twin
                                                              : twin_rows(c, pool, toks, last);
          for (const Variant& var : variants) {
            c.cfg = var.second;
            c.name = base + var.first;
            const size_t ws = attention_workspace_bytes(c.p, c.cfg);
            if (ws > c.ws_bytes) {
              cudaFree(c.d_ws);
              c.d_ws = upload(nullptr, ws);
              c.ws_bytes = ws;
            }
            check_cuda(cudaMemset(c.d_out, 0xA5, static_cast<size_t>(c.T) * kNq * kHeadDim * 2),
                       "poison");
            run_once(c, stream);
            check_cuda(cudaStreamSynchronize(stream), "run");
            double worst = 0;
            std::string verdict = "skip";
            if (check) {
              const bool ok = compare_rows(c, toks, twin, &worst);
              verdict = ok ? "PASS" : "FAIL";
              all_pass &= ok;
            }
            const bench::Timing tm =
                bench::time_graph_cold([&](cudaStream_t s) { run_once(c, s); }, stream);
            check_cuda(cudaMemset(c.d_out, 0xA5, static_cast<size_t>(c.T) * kNq * kHeadDim * 2),
                       "poison");
            const bench::Timing tb = bench::time_graph_back_to_back(
                [&](cudaStream_t s, int copy) { run_once(c, s, copy); }, copies, stream, calls);
            check_cuda(cudaStreamSynchronize(stream), "back-to-back");
            if (check) {
              double worst_b2b = 0;
              const bool ok = compare_rows(c, toks, twin_last, &worst_b2b);
              if (!ok) verdict = "FAIL";
              all_pass &= ok;
              worst = std::max(worst, worst_b2b);
            }
            rows.push_back(timing_row(c.name, verdict, worst, tm, tb, copies, c.bytes, c.flops));
            if (g_timeline) print_timeline(c, stream);
          }
          if (read_ceiling && sparse) {
            rows.push_back(read_ceiling_row(c, pool, copies, calls, stream, 0));
            for (int d : read_delays)
              rows.push_back(read_ceiling_row(c, pool, copies, calls, stream, d));
          }
          free_case(c);
        }
      }
    }
  }
  if (!prefill_only)
    bench::print_rows(
        "attention decode/verify (us: one graph replay after an L2 flush; b2b_us: per call of "
        "a graph of back-to-back calls over `copies` page-table copies, every call's K/V cold; "
        "peer vLLM Triton E4M3: B256 317 us, B256 x 4 tokens 1181 us)",
        rows, json);

  rows.clear();
  // Both kernels unless --kernel picks one, on the same case (inputs, selections, twin rows); the
  // other launch overrides apply to the wgmma kernel only where they are valid for it (tokens per
  // tile 8 or automatic, no v_convert).
  const std::vector<int> kernels = !prefill_kernels.empty() ? prefill_kernels
                                   : cfg.kernel != 0        ? std::vector<int>{cfg.kernel}
                                                            : std::vector<int>{4, 15};
  for (bool sparse : {true, false}) {
    if (sweep || no_prefill) break;
    // Contexts 8K and 64K; sparse also "lowoverlap" at 8K: a fresh ranking per token instead of
    // per 64 tokens (large tile unions of blocks most tokens miss, as the real indexer gives on
    // random weights in layer_bench).
    for (int variant = 0; variant < (sparse ? 3 : 2); ++variant) {
      const int ctx = variant == 1 ? 65536 : 8192;
      const int group_tokens = variant == 2 ? 1 : 64;
      const std::string base = std::string(sparse ? "sparse" : "dense") + " prefill 8K chunk ctx" +
                               std::to_string(ctx / 1024) + "K " +
                               (variant == 2 ? "lowoverlap " : "");
      AttentionCudaConfig kcfg = cfg;
      kcfg.kernel = kernels[0];
      Case c = make_case(base, sparse, 1, ctx, 8192, decode_pages, 65536 / kPageSize, group_tokens,
                         pool, kcfg, rng);
      // Tile edges (8-token tiles), a middle and the last token; dense at 64K (60K keys per token
      // on the twin) only two of them.
      const std::vector<int64_t> toks = (!sparse && ctx > 8192)
                                            ? std::vector<int64_t>{8, c.T - 1}
                                            : std::vector<int64_t>{0, 7, 8, 4095, 4103, c.T - 1};
      const std::vector<uint16_t> twin = twin_rows(c, pool, toks);
      for (int kernel : kernels) {
        kcfg = cfg;
        kcfg.kernel = kernel;
        if (kernel >= 2) {
          if (kcfg.tokens_per_tile != 8) kcfg.tokens_per_tile = 0;
          kcfg.v_convert = 0;
        }
        c.cfg = kcfg;
        c.name = base + (kernel == 0    ? std::string("auto")
                         : kernel == 1  ? std::string("mma.sync")
                         : kernel == 5  ? std::string("wgmma verify")
                         : kernel == 15 ? std::string("wgmma ws")
                                        : "wgmma v" + std::to_string(kernel - 2));
        const size_t ws = attention_workspace_bytes(c.p, kcfg);
        if (ws > c.ws_bytes) {
          cudaFree(c.d_ws);
          c.d_ws = upload(nullptr, ws);
        }
        c.ws_bytes = std::max(c.ws_bytes, ws);
        check_cuda(cudaMemset(c.d_out, 0xA5, static_cast<size_t>(c.T) * kNq * kHeadDim * 2),
                   "poison");
        run_once(c, stream);
        check_cuda(cudaStreamSynchronize(stream), "run");
        double worst = 0;
        const bool ok = compare_rows(c, toks, twin, &worst);
        all_pass &= ok;
        const int iters = sparse ? 10 : 4;
        const bench::Timing tm =
            bench::time_cold([&](cudaStream_t s) { run_once(c, s); }, stream, 1, iters);
        bench::Row row;
        row.add("case", c.name);
        row.add("check", ok ? "PASS" : "FAIL");
        row.add("max_rel", worst, 4);
        row.add("us", tm.median_us, 1);
        row.add("TFLOP", c.flops / 1e12, 3);
        row.add("TFLOP/s", c.flops / (tm.median_us * 1e6), 1);
        row.add("MB_kv", c.bytes / 1e6, 1);
        double avg_union = 0, work_ratio = 0;
        tile_unions(c, &avg_union, &work_ratio);
        row.add("tile_union", avg_union, 2);
        row.add("mma_work/flop", work_ratio, 3);
        rows.push_back(row);
      }
      free_case(c);
    }
  }
  if (!sweep && !no_prefill)
    bench::print_rows("attention prefill (cold L2; peer vLLM Triton E4M3: 8K chunk 8.3 ms)", rows,
                      json);
  std::printf("spot checks: %s\n", all_pass ? "PASS" : "FAIL");
  cudaStreamDestroy(stream);
  cudaFree(pool.data);
  return all_pass ? 0 : 1;
}
