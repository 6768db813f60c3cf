// Indexer benchmark (SPEC section 5; M3 at TP1: n_kv 4 index heads, one shared index-K head).
//   decode/verify: batch {1, 64, 256} x context {8K, 32K, 128K} x draft_len {0, 3}, CUDA-graph
//     replay with a cold L2 (256 MB flush between replays): us, index-K bytes read (whole pages:
//     16 KB per 128 tokens of every request, read once), GB/s and % of the 4300 GB/s copy
//     bandwidth. Peer: vLLM's Triton indexer on this H200 at batch 256 with E4M3: 175 us at 8K,
//     539 us at 32K.
//   prefill: one 8K-token chunk at context 8K (from scratch) and at 64K (56K cached), eager with a
//     cold L2: us, unique index-K bytes, and TFLOP/s counted on the causal work
//     (2 * 128 FLOP per (token, head, visible key)).
// Data: integer-valued E4M3 in [-3, 3] (index-K and index-Q), so the tensor-core scores are exact
// and the spot check can demand identical ids. Pages of a request are scattered over the pool.
// Before timing, every configuration is checked against the CPU twin on a few requests/tokens
// (rebuilt as small host batches over copies of only their pages): PASS / FAIL.
// Paths: the default (fused decode above 128 pages of context: each CTA keeps its block maxima in
// shared memory and writes them at its end, then the selection kernel; below, the two-kernel
// path), the two-kernel path (IndexerCudaOptions::unfused_decode: every block's scores to the
// workspace when the block is done, then the selection kernel) and, at contexts of <= 64 blocks,
// the single pass (IndexerCudaOptions::single_pass: one split, rows finished by the scorer, no
// second kernel) are all timed and spot-checked (fused_us, 2kernel_us, single_us; us = the one the
// default plan picks); the plan column shows the default's launch plan (f = fused, s = single pass,
// 2 = two-kernel; k = splits per request (with s: CTAs per request, one thread-block cluster), c =
// blocks per split). Two timings per path (bench_util.h): isolated (us: one graph replay after an
// L2 flush, launch cost included) and back to back (b2b_us: calls captured in one graph, call i
// over page-table copy i % copies, each copy mapping the requests onto its own pages of the pool,
// so every call's index-K is cold; `copies` column). One call of the back-to-back sequence is
// spot-checked too. Flags: --json (one JSON array per table), --quick (batch {1, 256}, context {8K,
// 128K}),
//   --unfused (time the two-kernel path only), --sweep (also time the fused and the
//   two-kernel paths (or the flag's path) over k_splits, and the single pass, at batch 64 / 256,
//   context 8K (draft 0 and 3) and 32K (draft 0), plus each path's automatic plan at batch 128 /
//   192, 8K; with --case that case alone; --k K,K,... replaces the k_splits list, 0 = auto),
//   --contiguous (each request's pages consecutive
//   in the pool instead of scattered over it: the TLB / DRAM-locality comparison), --window
//   (each page-table copy's pages those of --contiguous, shuffled within that span), --case
//   BATCH,CONTEXT,DRAFT (that decode case alone, e.g. 256,8192,3, for profilers; batch and
//   context must be in the table's sets; with --variants any batch and context), --clusters (only a table of the single pass with 1, 2, 3,
//   4 and 8 CTAs per request, IndexerCudaOptions::single_pass_ctas, beside the default plan and
//   the two-kernel path, at batch {1, 32, 64, 96, 128, 192, 256} x 8K, draft 0 and 3; with
//   --case that batch and draft alone),
//   --single-ctas N
//   (the single-pass columns and sweep rows use N CTAs per request: single_pass_ctas),
//   --ef N (the default options with stream_evict_first N, e.g. for --timeline), --wide N (every
//   path's options with IndexerCudaOptions::wide_select N: -1 one warp per long row, 4 / 8 / 16
//   warps per row; every table, --timeline and --sweep), --pf N (every path's options with
//   IndexerCudaOptions::pdl_prefetch_blocks N: the L2 prefetch of programmatic launches, e.g.
//   for --pdl and the pdl variant), --no-am (the
//   default options without cluster_async_maxima, e.g. for --timeline),
//   --tl-b2b (--timeline of the last call of a back-to-back sequence, as b2b_us times it, instead
//   of an eager cold call: the front and the end as they are between calls),
//   --pdl (only a table of the indexer behind a stand-in for the layer's producer: a kernel that
//   lets its dependents start at once, spins ~3 us, then rewrites index_q; the pair timed with a
//   normal and with a programmatic launch of the indexer (IndexerCudaOptions::programmatic_launch),
//   beside the stand-in alone, at batch {1, 64, 256} x {8K, 32K}, draft 0 and 3),
//   --no-guess (the decode units do not guess their request bounds: the A/B of the early
//   query-row and position loads, IndexerCudaOptions::guess_request_bounds), --late
//   (!early_query_loads), --sorted (!fast_select): every path and table,
//   --timeline BATCH,CONTEXT,DRAFT (diagnostics: one cold call of the default plan (or
//   --single-ctas N) with IndexerCudaOptions::timeline; per phase of the decode warps (ready to
//   score, scored, barrier passed, done) the spread of %globaltimer over the warps relative to
//   the first warp's entry, and the median / max clock64 duration of each phase; the front (first
//   copies issued, first tile landed); then where the
//   spread of the scored phase lives: within a CTA, between a cluster's CTAs, per SM id),
//   --ceiling (only a table of the default plan beside plain reads of the same index-K bytes,
//   contiguous and through the case's page tables, isolated and back to back, and the same pages
//   with each warp reading a contiguous range of them; batch 64 / 256, or --case),
//   --read-timeline BATCH,CONTEXT,DRAFT (diagnostics: the ceiling's paged read of that case at 1-4
//   CTAs per SM, then at one CTA per SM of 4 / 8 warps each reading a contiguous range of pages
//   (flat decode's assignment), one cold call each with per-CTA %globaltimer marks: entry, first
//   page landed, end, and each SM's last end),
//   --variants (only a table of the default options beside A/B variants, each isolated and
//   back to back in the same run: 2k = IndexerCudaOptions::unfused_decode at the default plan's
//   k_splits, late = !early_query_loads, sorted = !fast_select, q1 = !short_select (one warp per
//   row of <= 63 candidates), flat1 / flat2 / flat3 = IndexerCudaOptions::flat_decode 1 / 2 / 3,
//   flat0 = flat_decode -1 (never: the plan without it), flat1q1 = flat_decode 1 with
//   !short_select, w2 / w4 = short_select_warps 2 / 4, noef = stream_evict_first -1, pdl =
//   programmatic_launch (back to back: each call behind the previous one);
//   --vlist NAME,... keeps base and the named ones; --repeat N: N runs, the variants alternating
//   in each; batch 64 / 256 x 8K / 32K / 128K at draft 3, or --case), --no-short-select
//   (IndexerCudaOptions::short_select false for every path and table), --flat N (the default
//   options with flat_decode N, e.g. for --timeline), --sw N (the default options with
//   short_select_warps N, e.g. for --timeline); 2k3 / 2k4 / 2k6 / 2k8 / 2k16 / sp4 (--variants:
//   the two-kernel path at 3 / 4 / 6 / 8 / 16 splits, the single pass in 4-CTA clusters); sp2 /
//   sp8 (the single pass in 2 / 8-CTA clusters), noam (!IndexerCudaOptions::cluster_async_maxima),
//   wide4 / wide8 / wide16 (IndexerCudaOptions::wide_select 4 / 8 / 16 warps per row, forced),
//   nowide (wide_select -1: one warp per long row), ovf (overflow_tiles_always), one
//   (fused_small_ctas_per_sm 1), main (ovf, nowide and one: main's options before session 27),
//   fkN (any N: the fused path at N splits, fused_decode_always with k_splits N; fkNn: the same
//   with wide_select -1).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "core/pdl.cuh"
#include "m3attn/config.h"
#include "stages/indexer/indexer.h"
#include "support/bench_util.h"

namespace m3attn {
namespace {

using bench::check_cuda;

constexpr int kNkv = 4;
// IndexerCudaOptions::timeline layout (indexer_kernel_common.cuh): words per scorer warp and per
// selection-kernel warp.
constexpr int64_t kStride = 24;
constexpr int64_t kSelWords = 8;
constexpr int64_t kPageBytes = int64_t{kPageSize} * kHeadDim;  // one index-K page (dense stride)

// Bytes drawn from the E4M3 codes of -3 .. 3 (passed packed in `codes`).
__global__ void fill_integers(uint8_t* p, int64_t n, uint64_t seed, uint64_t codes) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    p[i] = static_cast<uint8_t>(codes >> (8 * ((x >> 20) % 7)));
  }
}

// --pdl: a stand-in for the producer before the indexer in the layer's decode step. Every CTA
// lets the next kernel start (pdl_launch_dependents), spins `cycles` clock cycles, then the grid
// copies `bytes` bytes src -> dst (index_q, rewritten with the same content).
__global__ void producer_standin(uint8_t* dst, const uint8_t* src, int64_t bytes, int64_t cycles) {
  pdl_launch_dependents();
  const int64_t t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  for (int64_t i = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) * 16; i < bytes;
       i += int64_t{gridDim.x} * blockDim.x * 16)
    *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
}

// --ceiling: the index-K bytes of a case read without any compute, timed like the indexer: as
// contiguous words (bench::launch_plain_read, bandwidth_bench's plain read) and by read_paged: the
// case's pages through its page table (the indexer's access pattern without the metadata, the
// compute and the selection): warp w of the grid reads entries w, w + warps, ... of the flattened
// [R, max_pages] table, 16 KB per page, 16 loads of 16 bytes per lane in flight.
// kMark (--read-timeline): thread 0 of each CTA records %globaltimer at entry (word 0), its SM
// (word 1), when warp 0's first page has landed (word 2) and, after a CTA barrier, when every warp
// of the CTA is done (word 3): 4 words per CTA in `tl` (three timer reads per CTA, so the marks do
// not serialise an SM's warps the way per-warp reads would).
// kContig (--read-timeline's flat rows): warp w of the W warps reads the contiguous entries
// [w E / W, (w + 1) E / W) instead (flat decode's assignment of blocks to warps, without compute).
template <bool kMark, bool kContig = false>
__global__ void read_paged(const uint8_t* __restrict__ pool, const int32_t* __restrict__ table,
                           int64_t entries, int* sink, uint64_t* tl) {
  const int lane = threadIdx.x & 31;
  if (kMark && threadIdx.x == 0) {
    uint64_t g;
    uint32_t sm;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    tl[blockIdx.x * 4 + 0] = g;
    tl[blockIdx.x * 4 + 1] = sm;
  }
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x >> 5);
  int acc = 0;
  bool first = true;
  const int64_t wi = blockIdx.x * int64_t{blockDim.x >> 5} + (threadIdx.x >> 5);
  int64_t e = kContig ? wi * entries / warps : wi;
  const int64_t e_end = kContig ? (wi + 1) * entries / warps : entries;
  const int64_t step = kContig ? 1 : warps;
  int32_t pg = e < e_end ? __ldg(table + e) : 0;
  for (; e < e_end; e += step) {
    const int32_t next = e + step < e_end ? __ldg(table + e + step) : 0;
    const int4* src = reinterpret_cast<const int4*>(pool + int64_t{pg} * kPageBytes) + lane;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int4 v[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                     : "l"(src + (h * 16 + u) * 32));
      }
#pragma unroll
      for (int u = 0; u < 16; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (kMark && first && threadIdx.x == 0) {
      uint64_t g;
      // The timer read depends on acc: it waits for the first page's data.
      asm volatile("{\n .reg .b32 t;\n mov.b32 t, %1;\n mov.u64 %0, %%globaltimer;\n}"
                   : "=l"(g)
                   : "r"(acc));
      tl[blockIdx.x * 4 + 2] = g;
    }
    first = false;
    pg = next;
  }
  if (acc == 0x7fffffff) sink[blockIdx.x] = acc;
  if (kMark) {
    __syncthreads();
    if (threadIdx.x == 0) {
      uint64_t g;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
      tl[blockIdx.x * 4 + 3] = g;
    }
  }
}

uint64_t integer_codes() {
  uint64_t codes = 0;
  for (int v = -3; v <= 3; ++v)
    codes |= uint64_t{float_to_e4m3(static_cast<float>(v))} << (8 * (v + 3));
  return codes;
}

void fill_device(uint8_t* p, int64_t n, uint64_t seed) {
  fill_integers<<<1024, 256>>>(p, n, seed, integer_codes());
  check_cuda(cudaGetLastError(), "fill");
}

void* device_alloc(size_t n) {
  void* d = nullptr;
  check_cuda(cudaMalloc(&d, std::max<size_t>(n, 16)), "cudaMalloc");
  return d;
}

void* upload(const void* h, size_t n) {
  void* d = device_alloc(n);
  if (n) check_cuda(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), "upload");
  return d;
}

struct Pool {
  uint8_t* data = nullptr;
  int64_t pages = 0;
};

// One problem: R requests of `new_tokens` tokens ending at seq_len ctx, pages drawn at random
// (without repetition) from the pool.
struct Case {
  int R = 0, ctx = 0, new_tokens = 0, max_pages = 0;
  int64_t T = 0;
  std::vector<int32_t> qs, pos, lens;
  // Page tables of the back-to-back input copies: copy i maps the requests onto its own pages
  // (disjoint from the other copies' where the pool allows), so every call of a back-to-back
  // sequence reads cold index-K; copy 0 is the one the isolated timing uses.
  int copies = 1;
  std::vector<std::vector<int32_t>> tables;
  std::vector<void*> d_tables;
  void *d_qs = nullptr, *d_pos = nullptr, *d_lens = nullptr, *d_iq = nullptr, *d_ids = nullptr,
       *d_ws = nullptr;
  size_t ws_bytes = 0;
  IndexerParams p;
  TensorView ws;
  double index_bytes = 0;  // unique index-K bytes (whole pages)
  double flops = 0;        // causal scoring work
};

bool g_contiguous = false;  // --contiguous: request r's pages are r * max_pages + j (no scatter)
// --window: each copy's pages are those of --contiguous (one span of the pool per copy), shuffled
// within it (the scatter's DRAM pattern over ~1 / copies of the address translations).
bool g_window = false;

Case make_case(int R, int ctx, int new_tokens, const Pool& pool, std::mt19937_64& rng,
               uint64_t seed) {
  Case c;
  c.R = R;
  c.ctx = ctx;
  c.new_tokens = new_tokens;
  c.T = int64_t{R} * new_tokens;
  c.max_pages = (ctx + kPageSize - 1) / kPageSize;
  const int64_t need = int64_t{R} * c.max_pages;
  if (need > pool.pages) {
    std::fprintf(stderr, "pool of %lld pages is too small (%lld needed)\n",
                 static_cast<long long>(pool.pages), static_cast<long long>(need));
    std::exit(1);
  }
  std::vector<int32_t> perm(static_cast<size_t>(pool.pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.qs.resize(R + 1);
  c.lens.assign(R, ctx);
  c.pos.resize(c.T);
  c.copies = static_cast<int>(std::min<int64_t>(
      bench::back_to_back_copies(static_cast<size_t>(need * kPageBytes)), pool.pages / need));
  for (int i = 0; i < c.copies; ++i) {
    std::vector<int32_t> t(perm.begin() + i * need, perm.begin() + (i + 1) * need);
    if (g_contiguous || g_window) std::iota(t.begin(), t.end(), static_cast<int32_t>(i * need));
    if (g_window) std::shuffle(t.begin(), t.end(), rng);
    c.tables.push_back(std::move(t));
  }
  for (int r = 0; r <= R; ++r) c.qs[r] = r * new_tokens;
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < new_tokens; ++i) c.pos[int64_t{r} * new_tokens + i] = ctx - new_tokens + i;
  c.index_bytes = static_cast<double>(need) * kPageBytes;
  for (int64_t t = 0; t < c.T; ++t) c.flops += 2.0 * kHeadDim * kNkv * (c.pos[t] + 1.0);

  const Device dev = Device::cuda(0);
  c.d_qs = upload(c.qs.data(), c.qs.size() * 4);
  c.d_pos = upload(c.pos.data(), c.pos.size() * 4);
  c.d_lens = upload(c.lens.data(), c.lens.size() * 4);
  for (const auto& t : c.tables) c.d_tables.push_back(upload(t.data(), t.size() * 4));
  c.d_iq = device_alloc(static_cast<size_t>(c.T) * kNkv * kHeadDim);
  fill_device(static_cast<uint8_t*>(c.d_iq), c.T * kNkv * kHeadDim, seed ^ 0x1234);
  c.d_ids = device_alloc(static_cast<size_t>(c.T) * kNkv * kTopK * 4);
  c.ws_bytes = indexer_workspace_bytes(c.T, kNkv, c.max_pages);
  c.d_ws = device_alloc(c.ws_bytes);

  c.p.n_kv = kNkv;
  c.p.top_k = kTopK;
  c.p.index_q = TensorView::contiguous(c.d_iq, DType::kE4M3, {c.T, kNkv, kHeadDim}, dev);
  c.p.index_cache = make_index_cache_view(pool.data, pool.pages, kPageBytes, dev);
  c.p.batch.num_tokens = c.T;
  c.p.batch.num_requests = R;
  c.p.batch.max_pages = c.max_pages;
  c.p.batch.query_start = TensorView::contiguous(c.d_qs, DType::kI32, {R + 1}, dev);
  c.p.batch.positions = TensorView::contiguous(c.d_pos, DType::kI32, {c.T}, dev);
  c.p.batch.seq_lens = TensorView::contiguous(c.d_lens, DType::kI32, {R}, dev);
  c.p.batch.page_table =
      TensorView::contiguous(c.d_tables[0], DType::kI32, {R, int64_t{c.max_pages}}, dev);
  c.p.block_ids = TensorView::contiguous(c.d_ids, DType::kI32, {c.T, kNkv, kTopK}, dev);
  c.ws = TensorView::contiguous(c.d_ws, DType::kF32, {static_cast<int64_t>(c.ws_bytes / 4)}, dev);
  return c;
}

void free_case(Case& c) {
  for (void* d : {c.d_qs, c.d_pos, c.d_lens, c.d_iq, c.d_ids, c.d_ws})
    if (d) cudaFree(d);
  for (void* d : c.d_tables) cudaFree(d);
}

// A slice to verify: tokens [first, first + count) of request r.
struct Slice {
  int r, first, count;
};

// Rebuilds the slices as a host batch (one request each, over copies of their pages in page table
// copy `copy`) and checks the GPU ids of those tokens against the twin: exact equality (integer
// inputs).
bool spot_check(const Case& c, const Pool& pool, const std::vector<Slice>& slices, int copy,
                std::string* why) {
  std::vector<uint8_t> ids_gpu(static_cast<size_t>(c.T) * kNkv * kTopK * 4);
  check_cuda(cudaMemcpy(ids_gpu.data(), c.d_ids, ids_gpu.size(), cudaMemcpyDeviceToHost), "ids");
  const int R = static_cast<int>(slices.size());
  int max_pages = 0;
  int64_t T = 0, pages = 0;
  for (const Slice& s : slices) {
    const int len = c.pos[c.qs[s.r] + s.first + s.count - 1] + 1;
    const int np = (len + kPageSize - 1) / kPageSize;
    max_pages = std::max(max_pages, np);
    pages += np;
    T += s.count;
  }
  Tensor pool_h(DType::kE4M3, {pages * kPageBytes});
  Tensor qs(DType::kI32, {R + 1}), pos(DType::kI32, {T}), lens(DType::kI32, {R});
  Tensor table(DType::kI32, {R, max_pages});
  Tensor iq(DType::kE4M3, {T, kNkv, kHeadDim});
  Tensor ids(DType::kI32, {T, kNkv, kTopK});
  std::fill(table.ptr<int32_t>(), table.ptr<int32_t>() + table.numel(), -1);
  int64_t t = 0, page = 0;
  qs.ptr<int32_t>()[0] = 0;
  for (int i = 0; i < R; ++i) {
    const Slice& s = slices[i];
    const int64_t t0 = c.qs[s.r] + s.first;
    const int len = c.pos[t0 + s.count - 1] + 1;
    lens.ptr<int32_t>()[i] = len;
    for (int j = 0; j < (len + kPageSize - 1) / kPageSize; ++j, ++page) {
      const int32_t src = c.tables[copy][static_cast<size_t>(s.r) * c.max_pages + j];
      check_cuda(
          cudaMemcpy(pool_h.ptr<uint8_t>() + page * kPageBytes,
                     pool.data + int64_t{src} * kPageBytes, kPageBytes, cudaMemcpyDeviceToHost),
          "page");
      table.ptr<int32_t>()[int64_t{i} * max_pages + j] = static_cast<int32_t>(page);
    }
    check_cuda(cudaMemcpy(iq.ptr<uint8_t>() + t * kNkv * kHeadDim,
                          static_cast<const uint8_t*>(c.d_iq) + t0 * kNkv * kHeadDim,
                          static_cast<size_t>(s.count) * kNkv * kHeadDim, cudaMemcpyDeviceToHost),
               "iq");
    for (int k = 0; k < s.count; ++k) pos.ptr<int32_t>()[t + k] = c.pos[t0 + k];
    t += s.count;
    qs.ptr<int32_t>()[i + 1] = static_cast<int32_t>(t);
  }
  IndexerParams hp;
  hp.n_kv = kNkv;
  hp.top_k = kTopK;
  hp.index_q = iq.view();
  hp.index_cache = make_index_cache_view(pool_h.data(), pages, kPageBytes);
  hp.batch.num_tokens = T;
  hp.batch.num_requests = R;
  hp.batch.max_pages = max_pages;
  hp.batch.query_start = qs.view();
  hp.batch.positions = pos.view();
  hp.batch.seq_lens = lens.view();
  hp.batch.page_table = table.view();
  hp.block_ids = ids.view();
  const Status st = run_indexer_cpu(hp);
  if (!st.ok()) {
    *why = st.to_string();
    return false;
  }
  t = 0;
  for (const Slice& s : slices) {
    const int64_t t0 = c.qs[s.r] + s.first;
    const size_t n = static_cast<size_t>(s.count) * kNkv * kTopK * 4;
    if (std::memcmp(ids.ptr<uint8_t>() + t * kNkv * kTopK * 4,
                    ids_gpu.data() + t0 * kNkv * kTopK * 4, n) != 0) {
      *why = "request " + std::to_string(s.r) + " tokens " + std::to_string(s.first) + ".." +
             std::to_string(s.first + s.count - 1) + " differ from the twin";
      return false;
    }
    t += s.count;
  }
  return true;
}

// The spot-checked slices of a decode case: every token of the first and of the last request.
std::vector<Slice> decode_slices(int batch, int draft) {
  std::vector<Slice> s = {{0, 0, 1 + draft}};
  if (batch > 1) s.push_back({batch - 1, 0, 1 + draft});
  return s;
}

struct Times {
  bench::Timing iso;  // isolated: one graph replay (or eager call) after an L2 flush
  bench::Timing b2b;  // back-to-back over the case's page-table copies (graph timing only)
};

// Runs `o` once, spot-checks the slices against the twin (FAIL printed to stderr, *pass cleared),
// then times it: CUDA-graph replays (graph) or eager launches, cold L2 either way; with graph,
// also back to back (call i over page-table copy i % copies), followed by a spot check of the
// ids the sequence's last call wrote.
Times check_and_time(const Case& c, const Pool& pool, const std::vector<Slice>& slices,
                     const IndexerCudaOptions& o, cudaStream_t stream, bool graph,
                     const std::string& what, bool* pass,
                     const std::function<void(cudaStream_t)>& before = {}) {
  const auto launch_copy = [&](cudaStream_t s, int copy) {
    if (before) before(s);
    IndexerParams p = c.p;
    p.batch.page_table.data = c.d_tables[copy];
    const Status st = run_indexer_cuda(p, c.ws, s, o);
    if (!st.ok()) {
      std::fprintf(stderr, "run_indexer_cuda: %s\n", st.to_string().c_str());
      std::exit(1);
    }
  };
  const auto launch = [&](cudaStream_t s) { launch_copy(s, 0); };
  // Checks the ids of a call over page-table copy `copy`: a fresh call on poisoned ids (run), or
  // what the last call of the back-to-back sequence left.
  const auto check = [&](int copy, bool run, const char* how) {
    if (run) {
      check_cuda(
          cudaMemsetAsync(c.d_ids, 0xa5, static_cast<size_t>(c.T) * kNkv * kTopK * 4, stream),
          "poison");
      launch_copy(stream, copy);
    }
    check_cuda(cudaStreamSynchronize(stream), "check run");
    std::string why;
    if (!spot_check(c, pool, slices, copy, &why)) {
      *pass = false;
      std::fprintf(stderr, "FAIL %s (%s, %s): %s\n", what.c_str(),
                   o.unfused_decode ? "two-kernel"
                   : o.single_pass  ? "single pass"
                                    : "default",
                   how, why.c_str());
    }
  };
  check(0, true, "isolated");
  Times t;
  if (!graph) {
    t.iso = bench::time_cold(launch, stream, 2, 10);
    return t;
  }
  t.iso = bench::time_graph_cold(launch, stream);
  // The sequence's default length (bench_util.h): max(8, 2 x copies) calls; the last one read
  // copy (calls - 1) % copies (!= 0 whenever copies > 1, so stale ids of copy 0 would fail).
  const int calls = std::max(8, 2 * c.copies);
  t.b2b = bench::time_graph_back_to_back(launch_copy, c.copies, stream, calls);
  check((calls - 1) % c.copies, false, "last call of the back-to-back sequence");
  return t;
}

std::string plan_str(const Case& c, const IndexerCudaOptions& o) {
  const IndexerCudaPlan pl = indexer_cuda_plan(c.p, o);
  if (pl.flat_ctas > 0) return "2 flat " + std::to_string(pl.flat_ctas);
  return std::string(pl.single ? "s" : (pl.fused ? "f" : "2")) + " k" +
         std::to_string(pl.k_splits) + " c" + std::to_string(pl.dec_chunk);
}

double pct_copy(const Case& c, double us) {
  return 100.0 * c.index_bytes / (us * 1e3) / bench::kCopyBandwidthGBs;
}

std::string fixed1(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

std::string kilo(int v) {
  return v % 1024 == 0 ? std::to_string(v / 1024) + "K" : std::to_string(v);
}

// The first columns of a decode case's row: batch, context, draft, plan, spot check.
bench::Row case_row(const Case& c, int draft, const std::string& plan, bool pass) {
  bench::Row row;
  row.add("batch", std::to_string(c.R));
  row.add("context", kilo(c.ctx));
  row.add("draft", std::to_string(draft));
  row.add("plan", plan);
  row.add("check", pass ? "PASS" : "FAIL");
  return row;
}

// One time base for a timeline of `warps` scorer warps (kStride words each): per SM the
// (globaltimer, clock64) pairs of its warps (warp 0's at entry, every warp's at its end); the clock
// rate from the median over SMs of the slope between an SM's entry pair and its latest end pair
// (nominal `khz` where no SM spans 5 us), and per SM the offset of its latest-read pair
// (ns = offset + clock / GHz).
struct TimelineClock {
  double ghz = 0;
  // Times relative to one pair (gbase, cbase), as doubles of small magnitude (a raw globaltimer
  // value in a double keeps only 256 ns).
  uint64_t gbase = 0, cbase = 0;
  std::map<int, double> offset;  // SM -> ns (after gbase) at clock cbase
  double first_entry = 1e300;    // ns of the earliest warp entry

  TimelineClock(const std::vector<uint64_t>& tl, int64_t warps, int khz) {
    std::map<int, std::vector<std::pair<uint64_t, uint64_t>>> pairs;  // SM -> (ns, clock)
    for (int64_t w = 0; w < warps; ++w) {
      const uint64_t* e = tl.data() + w * kStride;
      if (!e[0]) continue;
      const int sm = static_cast<int>(e[7]);
      if (e[13]) pairs[sm].emplace_back(e[13], e[14]);
      if (e[5]) pairs[sm].emplace_back(e[5], e[6]);
    }
    std::vector<double> slopes;
    for (auto& kv : pairs) {
      auto& v = kv.second;
      std::sort(v.begin(), v.end());
      if (v.size() >= 2 && v.back().first - v.front().first > 5000)
        slopes.push_back(static_cast<double>(v.back().second - v.front().second) /
                         static_cast<double>(v.back().first - v.front().first));
    }
    std::sort(slopes.begin(), slopes.end());
    ghz =
        slopes.empty() ? khz * 1e-6 : slopes[static_cast<size_t>(0.5 * (slopes.size() - 1) + 0.5)];
    if (!pairs.empty()) {
      gbase = pairs.begin()->second.front().first;
      cbase = pairs.begin()->second.front().second;
    }
    for (auto& kv : pairs) {
      const auto& p = kv.second.back();
      offset[kv.first] =
          static_cast<double>(static_cast<int64_t>(p.first - gbase)) - rel_clk(p.second);
    }
    for (int64_t w = 0; w < warps; ++w) {
      const uint64_t* e = tl.data() + w * kStride;
      double ns = 0;
      if (e[0] && ns_of(static_cast<int>(e[7]), e[8], &ns)) first_entry = std::min(first_entry, ns);
    }
  }

  double rel_clk(uint64_t c) const {
    return static_cast<double>(static_cast<int64_t>(c - cbase)) / ghz;
  }

  // The ns (after gbase) of clock value `clk` read on SM `sm`; false where the SM has no pair.
  bool ns_of(int sm, uint64_t clk, double* out) const {
    const auto it = offset.find(sm);
    if (it == offset.end()) return false;
    *out = it->second + rel_clk(clk);
    return true;
  }
};

}  // namespace
}  // namespace m3attn

int main(int argc, char** argv) {
  using namespace m3attn;
  bool json = false, quick = false, unfused_only = false, sweep = false, only = false,
       clusters = false, pdl = false, no_guess = false, timeline = false, ceiling = false,
       variants = false, late = false, sorted = false, read_timeline = false;
  int only_batch = 0, only_ctx = 0, only_draft = 0, single_ctas = 0, repeat = 1, flat = 0;
  bool no_short_select = false;    // --no-short-select: IndexerCudaOptions::short_select false
  int select_warps = 0;  // --sw N: IndexerCudaOptions::short_select_warps of the default options
  std::vector<std::string> vlist;  // --vlist: the --variants columns (default: all)
  std::vector<int> sweep_k = {0, 2, 3, 4, 6, 8, 12, 16, 32};  // --sweep's k_splits (0: auto)
  int evict_first = 0;  // --ef N: IndexerCudaOptions::stream_evict_first of the default options
  int wide = 0;         // --wide N: IndexerCudaOptions::wide_select of every path's options
  int prefetch = 0;     // --pf N: IndexerCudaOptions::pdl_prefetch_blocks of every path's options
  bool tl_b2b = false;  // --tl-b2b: --timeline of the last call of a back-to-back sequence
  int tl_calls = 0;     // --tl-calls N: the last N calls of the sequence (implies --tl-b2b)
  bool async_maxima = true;  // --no-am: the default options without cluster_async_maxima
  // Flags without a value, each setting its variable to true.
  const std::map<std::string, bool*> switches = {{"--json", &json},
                                                 {"--quick", &quick},
                                                 {"--unfused", &unfused_only},
                                                 {"--sweep", &sweep},
                                                 {"--clusters", &clusters},
                                                 {"--pdl", &pdl},
                                                 {"--no-guess", &no_guess},
                                                 {"--ceiling", &ceiling},
                                                 {"--variants", &variants},
                                                 {"--late", &late},
                                                 {"--sorted", &sorted},
                                                 {"--no-short-select", &no_short_select},
                                                 {"--tl-b2b", &tl_b2b},
                                                 {"--contiguous", &g_contiguous},
                                                 {"--window", &g_window}};
  // Flags with an integer value.
  const std::map<std::string, int*> numbers = {{"--flat", &flat},
                                               {"--single-ctas", &single_ctas},
                                               {"--sw", &select_warps},
                                               {"--ef", &evict_first},
                                               {"--wide", &wide},
                                               {"--pf", &prefetch}};
  // Flags with a BATCH,CONTEXT,DRAFT value (only_batch, only_ctx, only_draft), each setting its
  // mode to true.
  const std::map<std::string, bool*> case_modes = {
      {"--timeline", &timeline}, {"--read-timeline", &read_timeline}, {"--case", &only}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (const auto sw = switches.find(a); sw != switches.end()) {
      *sw->second = true;
    } else if (const auto nb = numbers.find(a); nb != numbers.end() && has_value) {
      *nb->second = std::atoi(argv[++i]);
    } else if (const auto cm = case_modes.find(a);
               cm != case_modes.end() && has_value &&
               std::sscanf(argv[++i], "%d,%d,%d", &only_batch, &only_ctx, &only_draft) == 3) {
      *cm->second = true;
    } else if (a == "--no-am") {
      async_maxima = false;
    } else if (a == "--repeat" && has_value) {
      repeat = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--tl-calls" && has_value) {
      tl_calls = std::max(2, std::atoi(argv[++i]));
      tl_b2b = true;
    } else if (a == "--k" && has_value) {
      sweep_k.clear();
      const char* q = argv[++i];
      while (*q) {
        char* end = nullptr;
        const long v = std::strtol(q, &end, 10);
        if (end == q) break;
        sweep_k.push_back(static_cast<int>(v));
        q = *end == ',' ? end + 1 : end;
      }
    } else if (a == "--vlist" && has_value) {
      std::string l = argv[++i];
      size_t at = 0;
      while (at <= l.size()) {
        const size_t e = std::min(l.find(',', at), l.size());
        if (e > at) vlist.push_back(l.substr(at, e - at));
        at = e + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--json] [--quick] [--unfused] [--sweep] [--contiguous] [--window] "
                   "[--case BATCH,CONTEXT,DRAFT] [--clusters] [--single-ctas N] [--pdl] "
                   "[--no-guess] [--late] [--sorted] [--timeline BATCH,CONTEXT,DRAFT] "
                   "[--ceiling] [--read-timeline BATCH,CONTEXT,DRAFT] "
                   "[--variants] [--vlist NAME,...] [--repeat N] [--flat N] [--sw N] "
                   "[--no-short-select] "
                   "[--ef N] [--wide N] [--pf N] [--tl-b2b] [--tl-calls N] [--no-am] "
                   "[--k K,K,...]\n",
                   argv[0]);
      return 2;
    }
  }
  IndexerCudaOptions default_o, fused_o, two_o, single_o;
  for (IndexerCudaOptions* o : {&default_o, &fused_o, &two_o, &single_o}) {
    o->guess_request_bounds = !no_guess;
    o->early_query_loads = !late;
    o->fast_select = !sorted;
    o->short_select = !no_short_select;
    o->wide_select = wide;
    o->pdl_prefetch_blocks = prefetch;
  }
  default_o.flat_decode = flat;
  default_o.short_select_warps = select_warps;
  fused_o.fused_decode_always = true;
  two_o.unfused_decode = true;
  single_o.single_pass = true;
  single_o.single_pass_ctas = single_ctas;
  default_o.stream_evict_first = evict_first;
  default_o.cluster_async_maxima = async_maxima;
  const IndexerCudaOptions main_o = unfused_only ? two_o : default_o;
  // The sweep times the fused path (or the flag's path) whatever the automatic choice.
  const IndexerCudaOptions sweep_o = unfused_only ? two_o : fused_o;
  const bool compare_paths = !unfused_only;
  const std::vector<int> batches = quick ? std::vector<int>{1, 256} : std::vector<int>{1, 64, 256};
  const std::vector<int> contexts =
      quick ? std::vector<int>{8192, 131072} : std::vector<int>{8192, 32768, 131072};
  int64_t pool_pages = 0;
  for (int b : batches)
    for (int ctx : contexts)
      pool_pages = std::max<int64_t>(pool_pages, int64_t{b} * ctx / kPageSize);
  if (only) pool_pages = std::max<int64_t>(pool_pages, int64_t{only_batch} * only_ctx / kPageSize);
  pool_pages = std::max<int64_t>(pool_pages, 65536 / kPageSize) + 64;
  Pool pool;
  pool.pages = pool_pages;
  pool.data = static_cast<uint8_t*>(device_alloc(static_cast<size_t>(pool_pages * kPageBytes)));
  fill_device(pool.data, pool_pages * kPageBytes, 0xC0FFEE);
  check_cuda(cudaDeviceSynchronize(), "fill pool");
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  std::mt19937_64 rng(20250706);
  bool all_pass = true;

  // Frees the pool and the stream, prints the verdict of the spot checks; main's exit code.
  const auto finish = [&]() {
    cudaStreamDestroy(stream);
    cudaFree(pool.data);
    std::printf("%s\n", all_pass ? "indexer_bench: all spot checks PASS"
                                 : "indexer_bench: some spot checks FAIL");
    return all_pass ? 0 : 1;
  };
  std::vector<bench::Row> rows;
  if (timeline) {
    Case c = make_case(only_batch, only_ctx, 1 + only_draft, pool, rng, rng());
    IndexerCudaOptions o = single_ctas > 0 ? single_o : default_o;
    const IndexerCudaPlan pl = indexer_cuda_plan(c.p, o);
    // Overflow tiles (32 tokens at n_kv 4; none at <= 8 tokens), then the decode units (or the
    // flat decode CTAs).
    const int64_t units = pl.overflow_tiles + (pl.flat_ctas > 0 ? pl.flat_ctas : c.R);
    const int64_t warps = units * pl.k_splits * 4;
    // + 16 spare words, then kSelWords words per selection warp (indexer_kernel_common.cuh,
    // select_timeline_mark; at most 16 warps per row: select_wide_kernel).
    const int64_t sel_warps = c.T * kNkv * 16 + 64;
    const size_t words = static_cast<size_t>(warps * kStride + 16 + sel_warps * kSelWords);
    const size_t bytes = words * 8;
    uint64_t* d_tl = static_cast<uint64_t*>(device_alloc(bytes));
    o.timeline = d_tl;
    // --tl-calls N: the last N calls of the back-to-back sequence each record into their own
    // buffer (the last call's is d_tl, which the single-call analysis below reads).
    std::vector<uint64_t*> d_calls;
    for (int i = 0; i + 1 < tl_calls; ++i)
      d_calls.push_back(static_cast<uint64_t*>(device_alloc(bytes)));
    if (tl_calls > 0) d_calls.push_back(d_tl);
    const auto launch = [&](cudaStream_t s) {
      check_cuda(cudaMemsetAsync(d_tl, 0, bytes, s), "timeline clear");
      const Status st = run_indexer_cuda(c.p, c.ws, s, o);
      if (!st.ok()) std::exit(1);
    };
    bench::Timing t;
    std::vector<int> call_copy(static_cast<size_t>(std::max(tl_calls, 0)), -1);
    if (tl_b2b) {
      // --tl-b2b: the calls of a back-to-back sequence (one graph, call i over page-table copy
      // i % copies, as the b2b timing), only the last one recording (every replay rewrites the
      // same words); t = the sequence's per-call time.
      check_cuda(cudaMemsetAsync(d_tl, 0, bytes, stream), "timeline clear");
      for (uint64_t* d : d_calls) check_cuda(cudaMemsetAsync(d, 0, bytes, stream), "clear");
      const int calls = std::max({8, 2 * c.copies, tl_calls});
      int captured = 0;
      t = bench::time_graph_back_to_back(
          [&](cudaStream_t s, int copy) {
            IndexerParams p = c.p;
            p.batch.page_table.data = c.d_tables[copy];
            IndexerCudaOptions oi = o;
            const int k = ++captured - (calls - tl_calls) - 1;  // buffer of this call
            if (k >= 0 && tl_calls > 0) call_copy[static_cast<size_t>(k)] = copy;
            if (tl_calls > 0)
              oi.timeline = k >= 0 ? d_calls[static_cast<size_t>(k)] : nullptr;
            else if (captured < calls)
              oi.timeline = nullptr;
            const Status st = run_indexer_cuda(p, c.ws, s, oi);
            if (!st.ok()) std::exit(1);
          },
          c.copies, stream, calls);
      check_cuda(cudaStreamSynchronize(stream), "b2b timeline");
    } else {
      t = bench::time_cold(launch, stream, 1, 5);
    }
    std::vector<uint64_t> tl(words);
    check_cuda(cudaMemcpy(tl.data(), d_tl, bytes, cudaMemcpyDeviceToHost), "timeline");
    int dev = 0, khz = 0;
    check_cuda(cudaGetDevice(&dev), "device");
    check_cuda(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev), "clock rate");
    const auto pct = [](std::vector<double> v, double q) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)];
    };
    TimelineClock clock(tl, warps, khz);  // one time base (see TimelineClock)
    {
      // SMs that ran selection warps but no scorer warp: their offset from the selection warps'
      // own (globaltimer, clock64) pair at entry (words 6 / 7).
      const uint64_t* sel = tl.data() + warps * kStride + 16;
      for (int64_t w = 0; w < sel_warps; ++w) {
        const uint64_t* e = sel + w * kSelWords;
        const int sm = static_cast<int>(e[0]) - 1;
        if (!e[0] || !e[6] || clock.offset.count(sm)) continue;
        clock.offset[sm] = static_cast<double>(static_cast<int64_t>(e[6] - clock.gbase)) -
                           clock.rel_clk(e[7]);
      }
    }
    const double ghz = clock.ghz, g0 = clock.first_entry;
    const auto ns_of = [&](int sm, uint64_t clk, double* out) { return clock.ns_of(sm, clk, out); };
    // at(w, slot): us after the first warp's entry, or kNone when not recorded.
    constexpr double kNone = -1e30;
    const auto at = [&](int64_t w, int slot) {
      const uint64_t* e = tl.data() + w * kStride;
      double ns = 0;
      if (!e[0] || !e[slot] || !ns_of(static_cast<int>(e[7]), e[8 + slot], &ns)) return kNone;
      return (ns - g0) * 1e-3;
    };
    std::printf(
        "timeline b%d ctx %d draft %d, plan %s, %lld warps, %s %.1f us; clock64 at %.3f GHz "
        "(measured; nominal %.3f)\n",
        only_batch, only_ctx, only_draft, plan_str(c, o).c_str(), static_cast<long long>(warps),
        tl_b2b ? "last call of a back-to-back sequence, per call"
               : "eager cold call (median of 5 incl. memset)",
        t.median_us, ghz, khz * 1e-6);
    const char* names[] = {"entry", "ready", "scored", "barrier", "done"};
    for (int sl = 0; sl < 5; ++sl) {
      std::vector<double> ts, dur;
      for (int64_t w = 0; w < warps; ++w) {
        const double x = at(w, sl);
        if (x == kNone) continue;
        ts.push_back(x);
        const double y = sl > 0 ? at(w, sl - 1) : kNone;
        if (y != kNone) dur.push_back(x - y);
      }
      std::printf("  %-8s warps %5zu  at us: min %6.2f p10 %6.2f p50 %6.2f p90 %6.2f max %6.2f",
                  names[sl], ts.size(), pct(ts, 0), pct(ts, 0.1), pct(ts, 0.5), pct(ts, 0.9),
                  pct(ts, 1));
      if (sl > 0)
        std::printf("   phase us: p50 %6.2f p90 %6.2f max %6.2f", pct(dur, 0.5), pct(dur, 0.9),
                    pct(dur, 1));
      std::printf("\n");
    }
    {
      // The decode warps' front: first page-table entry and seq_lens value in registers (words
      // 22 / 23), first index-K copies issued (18), first tile landed (19).
      std::vector<double> iss, lan, ent, sql;
      for (int64_t w = 0; w < warps; ++w) {
        const uint64_t* e = tl.data() + w * kStride;
        if (!e[0]) continue;
        // Word `word` (a clock64 stamp, 0 = none) of warp w in us after the first entry.
        const auto add = [&](int word, std::vector<double>& out) {
          double ns = 0;
          if (e[word] && ns_of(static_cast<int>(e[7]), e[word], &ns))
            out.push_back((ns - g0) * 1e-3);
        };
        add(18, iss);
        add(19, lan);
        add(22, ent);
        add(23, sql);
      }
      if (!ent.empty())
        std::printf(
            "  front, us after the first entry: page-table entry in (%zu warps) p10 %6.2f p50 "
            "%6.2f max %6.2f; seq_lens in p10 %6.2f p50 %6.2f max %6.2f\n",
            ent.size(), pct(ent, 0.1), pct(ent, 0.5), pct(ent, 1), pct(sql, 0.1), pct(sql, 0.5),
            pct(sql, 1));
      if (!lan.empty())
        std::printf(
            "  front, us after the first entry: first copies issued (%zu warps) p10 %6.2f p50 "
            "%6.2f max %6.2f; first tile landed (%zu) p10 %6.2f p50 %6.2f max %6.2f\n",
            iss.size(), pct(iss, 0.1), pct(iss, 0.5), pct(iss, 1), lan.size(), pct(lan, 0.1),
            pct(lan, 0.5), pct(lan, 1));
    }
    {
      // The clustered single pass's end: the release arrive returned (word 21), us after the
      // warp's blocks were scored (slot 2), and for the cluster's last warp to score, the arrive
      // and the barrier (slot 3) after its last block.
      std::vector<double> arr;
      double last = kNone, last_arr = kNone, last_bar = kNone;
      for (int64_t w = 0; w < warps; ++w) {
        const uint64_t* e = tl.data() + w * kStride;
        double ns = 0;
        const double s2 = at(w, 2);
        if (!e[0] || !e[21] || s2 == kNone || !ns_of(static_cast<int>(e[7]), e[21], &ns)) continue;
        arr.push_back((ns - g0) * 1e-3 - s2);
        if (s2 > last) last = s2, last_arr = (ns - g0) * 1e-3 - s2, last_bar = at(w, 3) - s2;
      }
      if (!arr.empty())
        std::printf(
            "  release arrive returned (%zu warps), us after the warp's last block: p50 %.2f p90 "
            "%.2f max %.2f; the last warp to score (%.2f): arrive +%.2f, barrier passed +%.2f\n",
            arr.size(), pct(arr, 0.5), pct(arr, 0.9), pct(arr, 1), last, last_arr, last_bar);
    }
    {
      // The single pass's final selection: per selecting warp, its first row in
      // registers (word 16) and ranked (17), after the barrier (slot 3).
      std::vector<double> ld, rk;
      for (int64_t w = 0; w < warps; ++w) {
        const uint64_t* e = tl.data() + w * kStride;
        double ns = 0, b = at(w, 3);
        if (!e[0] || !e[16] || b == kNone) continue;
        if (ns_of(static_cast<int>(e[7]), e[16], &ns)) ld.push_back((ns - g0) * 1e-3 - b);
        if (e[17] && ns_of(static_cast<int>(e[7]), e[17], &ns)) rk.push_back((ns - g0) * 1e-3 - b);
      }
      if (!ld.empty())
        std::printf(
            "  final selection (%zu warps), us after the barrier: first row loaded p50 %6.2f "
            "p90 %6.2f max %6.2f; ranked p50 %6.2f p90 %6.2f max %6.2f\n",
            ld.size(), pct(ld, 0.5), pct(ld, 0.9), pct(ld, 1), pct(rk, 0.5), pct(rk, 0.9),
            pct(rk, 1));
    }
    {
      // The selection kernel (when one runs): its warps' entry, release from the dependency
      // wait and row written, beside the scorer's last warp done.
      double last_done = kNone;
      for (int64_t w = 0; w < warps; ++w) last_done = std::max(last_done, at(w, 4));
      std::vector<double> ent, rel, don, ld, rk;
      const uint64_t* sel = tl.data() + warps * kStride + 16;
      for (int64_t w = 0; w < sel_warps; ++w) {
        const uint64_t* e = sel + w * kSelWords;
        if (!e[0]) continue;
        const int sm = static_cast<int>(e[0] - 1);
        double ns = 0;
        if (e[1] && ns_of(sm, e[1], &ns)) ent.push_back((ns - g0) * 1e-3);
        if (e[2] && ns_of(sm, e[2], &ns)) rel.push_back((ns - g0) * 1e-3);
        if (e[3] && ns_of(sm, e[3], &ns)) don.push_back((ns - g0) * 1e-3);
        if (e[4] && ns_of(sm, e[4], &ns)) ld.push_back((ns - g0) * 1e-3);
        if (e[5] && ns_of(sm, e[5], &ns)) rk.push_back((ns - g0) * 1e-3);
      }
      if (!rel.empty())
        std::printf(
            "  select kernel (%zu warps) at us: entry min %6.2f p50 %6.2f; released min %6.2f "
            "p50 %6.2f max %6.2f; row written (%zu) p50 %6.2f p90 %6.2f max %6.2f; scorer's "
            "last warp done %6.2f\n",
            ent.size(), pct(ent, 0), pct(ent, 0.5), pct(rel, 0), pct(rel, 0.5), pct(rel, 1),
            don.size(), pct(don, 0.5), pct(don, 0.9), pct(don, 1), last_done);
      if (!ld.empty())
        std::printf(
            "  select kernel (short / wide) at us: scores loaded (%zu) p50 %6.2f p90 %6.2f max "
            "%6.2f; ranked p50 %6.2f p90 %6.2f max %6.2f\n",
            ld.size(), pct(ld, 0.5), pct(ld, 0.9), pct(ld, 1), pct(rk, 0.5), pct(rk, 0.9),
            pct(rk, 1));
      if (rel.empty())
        std::printf("  no selection kernel (scorer's last warp done %6.2f us)\n", last_done);
    }
    // Where the spread of "scored" lives: between the warps of a CTA, between the CTAs of a
    // cluster (grid.y), or between SMs (word 7: the warp's SM id).
    std::vector<double> within_cta, cta_last, within_cluster;
    std::vector<std::pair<int, double>> by_sm;  // (SM id, the CTA's last warp scored)
    for (int64_t x = 0; x < units; ++x) {
      double cl_lo = 1e30, cl_hi = kNone;
      for (int64_t y = 0; y < pl.k_splits; ++y) {
        double lo = 1e30, hi = kNone;
        int sm = -1;
        for (int w = 0; w < 4; ++w) {
          const uint64_t* e = tl.data() + ((x * pl.k_splits + y) * 4 + w) * kStride;
          const double t2 = at((x * pl.k_splits + y) * 4 + w, 2);
          if (t2 == kNone) continue;
          lo = std::min(lo, t2);
          hi = std::max(hi, t2);
          sm = static_cast<int>(e[7]);
        }
        if (sm < 0) continue;
        within_cta.push_back(hi - lo);
        cta_last.push_back(hi);
        by_sm.emplace_back(sm, hi);
        cl_lo = std::min(cl_lo, hi);
        cl_hi = std::max(cl_hi, hi);
      }
      if (cl_hi != kNone && pl.k_splits > 1) within_cluster.push_back(cl_hi - cl_lo);
    }
    std::printf(
        "  scored spread within a CTA (last - first warp) us: p50 %.2f p90 %.2f max %.2f; "
        "between the CTAs of a cluster: p50 %.2f p90 %.2f max %.2f\n",
        pct(within_cta, 0.5), pct(within_cta, 0.9), pct(within_cta, 1), pct(within_cluster, 0.5),
        pct(within_cluster, 0.9), pct(within_cluster, 1));
    std::printf("  CTA last scored us: min %.2f p10 %.2f p50 %.2f p90 %.2f max %.2f (%zu CTAs)\n",
                pct(cta_last, 0), pct(cta_last, 0.1), pct(cta_last, 0.5), pct(cta_last, 0.9),
                pct(cta_last, 1), cta_last.size());
    std::sort(by_sm.begin(), by_sm.end());
    std::printf("  by SM (smid:last scored us, a CTA per entry):");
    for (size_t i = 0; i < by_sm.size(); ++i)
      std::printf("%s%d:%.1f", i % 12 == 0 ? "\n    " : " ", by_sm[i].first, by_sm[i].second);
    std::printf("\n");
    if (tl_calls > 0) {
      // --tl-calls: is the spread of the CTAs' ends the same from call to call (the same SMs,
      // or the same CTAs, late every time) or does it move? Per recorded call, per CTA: its SM,
      // its last warp scored and its first tile landed (earliest warp), on that call's own time
      // base (as above); then per SM the deviation of its CTAs' last scored from the call's
      // median, and the correlation of those deviations between calls (pairwise; calls of the
      // same page-table copy read the same pages).
      struct CtaRec {
        int sm = -1;
        int blocks = 0;  // blocks its warps scored (word 20)
        double scored = 0, landed = 0;
      };
      const auto per_cta = [&](const std::vector<uint64_t>& v) {
        const TimelineClock clock(v, warps, khz);  // this call's own time base
        const auto ns = [&](int sm, uint64_t x) {
          double t = 0.0;  // 0 where the SM has no pair
          clock.ns_of(sm, x, &t);
          return t;
        };
        const double first = clock.first_entry;
        std::vector<CtaRec> out(static_cast<size_t>(units * pl.k_splits));
        for (int64_t cta = 0; cta < units * pl.k_splits; ++cta) {
          CtaRec& r = out[static_cast<size_t>(cta)];
          double hi = kNone, lo = 1e30;
          for (int w = 0; w < 4; ++w) {
            const uint64_t* e = v.data() + (cta * 4 + w) * kStride;
            const int sm = static_cast<int>(e[7]);
            if (!e[0] || !e[2] || !clock.offset.count(sm)) continue;
            r.sm = sm;
            r.blocks += static_cast<int>(e[20]);
            hi = std::max(hi, (ns(sm, e[10]) - first) * 1e-3);
            if (e[19]) lo = std::min(lo, (ns(sm, e[19]) - first) * 1e-3);
          }
          r.scored = hi;
          r.landed = lo < 1e29 ? lo : 0.0;
          if (hi == kNone) r.sm = -1;
        }
        return out;
      };
      std::vector<std::vector<CtaRec>> recs;
      std::vector<std::map<int, double>> dev;  // per call: SM -> last scored - the call's median
      std::vector<std::map<int, double>> sm_blocks;  // per call: SM -> blocks of its CTAs
      for (size_t k = 0; k < d_calls.size(); ++k) {
        std::vector<uint64_t> v(words);
        check_cuda(cudaMemcpy(v.data(), d_calls[k], bytes, cudaMemcpyDeviceToHost), "timeline");
        recs.push_back(per_cta(v));
        std::vector<double> ends, land;
        for (const CtaRec& r : recs.back())
          if (r.sm >= 0) ends.push_back(r.scored), land.push_back(r.landed);
        const double med = pct(ends, 0.5);
        std::map<int, double> d;
        for (const CtaRec& r : recs.back())
          if (r.sm >= 0) d[r.sm] = std::max(d.count(r.sm) ? d[r.sm] : -1e30, r.scored - med);
        dev.push_back(d);
        std::map<int, double> nb;
        for (const CtaRec& r : recs.back())
          if (r.sm >= 0) nb[r.sm] += r.blocks;
        sm_blocks.push_back(nb);
        // Within the call: does a CTA that ends late start late (first tile landed)?
        double ma = 0, mb = 0, sab = 0, saa = 0, sbb = 0;
        for (size_t i = 0; i < ends.size(); ++i) ma += ends[i], mb += land[i];
        ma /= std::max<size_t>(ends.size(), 1);
        mb /= std::max<size_t>(ends.size(), 1);
        for (size_t i = 0; i < ends.size(); ++i)
          sab += (ends[i] - ma) * (land[i] - mb), saa += (ends[i] - ma) * (ends[i] - ma),
              sbb += (land[i] - mb) * (land[i] - mb);
        std::printf(
            "  call %zu (page-table copy %d): CTA last scored p10 %.2f p50 %.2f p90 %.2f max %.2f; "
            "first tile landed p50 %.2f max %.2f; corr(end, first tile) %.2f\n",
            k, call_copy[k], pct(ends, 0.1), med, pct(ends, 0.9), pct(ends, 1), pct(land, 0.5),
            pct(land, 1), saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : 0.0);
      }
      // Between consecutive calls (globaltimer: every CTA's warp 0 at entry, every warp at its
      // end): the kernel's span (first entry -> last end) and the gap from the last warp's end to
      // the next call's first entry (the launch of the next call; with a selection kernel after
      // the scorer, the scorer's end).
      {
        std::vector<std::pair<uint64_t, uint64_t>> span;  // (first entry, last end) ns
        for (uint64_t* dbuf : d_calls) {
          std::vector<uint64_t> v(words);
          check_cuda(cudaMemcpy(v.data(), dbuf, bytes, cudaMemcpyDeviceToHost), "timeline");
          uint64_t lo = ~0ull, hi = 0;
          for (int64_t w = 0; w < warps; ++w) {
            const uint64_t* e = v.data() + w * kStride;
            if (!e[0]) continue;
            if (e[13]) lo = std::min(lo, e[13]);
            if (e[5]) hi = std::max(hi, e[5]);
          }
          span.emplace_back(lo, hi);
        }
        std::printf(
            "  calls (globaltimer us): span first entry -> last warp end [gap to the next call's "
            "first entry]:");
        for (size_t k = 0; k < span.size(); ++k) {
          std::printf(" %.2f", (static_cast<double>(span[k].second) - span[k].first) * 1e-3);
          if (k + 1 < span.size())
            std::printf(" [%+.2f]",
                        (static_cast<double>(span[k + 1].first) - span[k].second) * 1e-3);
        }
        std::printf("\n");
      }
      // The CTA -> SM placement from call to call.
      int same = 0, total = 0;
      for (size_t k = 1; k < recs.size(); ++k)
        for (size_t i = 0; i < recs[k].size(); ++i)
          if (recs[k][i].sm >= 0 && recs[0][i].sm >= 0) {
            ++total;
            same += recs[k][i].sm == recs[0][i].sm;
          }
      std::printf("  CTA -> SM placement as in call 0: %d of %d (CTA, call) pairs\n", same, total);
      const auto corr = [](const std::map<int, double>& x, const std::map<int, double>& y) {
        std::vector<std::pair<double, double>> v;
        for (const auto& kv : x)
          if (y.count(kv.first)) v.emplace_back(kv.second, y.at(kv.first));
        double ma = 0, mb = 0;
        for (auto& q : v) ma += q.first, mb += q.second;
        ma /= std::max<size_t>(v.size(), 1);
        mb /= std::max<size_t>(v.size(), 1);
        double ab = 0, aa = 0, bb = 0;
        for (auto& q : v)
          ab += (q.first - ma) * (q.second - mb), aa += (q.first - ma) * (q.first - ma),
              bb += (q.second - mb) * (q.second - mb);
        return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 0.0;
      };
      // Per CTA (grid index) deviations, to tell "the same SM" from "the same CTA / pages".
      std::vector<std::map<int, double>> cdev;
      for (const auto& rc : recs) {
        std::vector<double> ends;
        for (const CtaRec& r : rc)
          if (r.sm >= 0) ends.push_back(r.scored);
        const double med = pct(ends, 0.5);
        std::map<int, double> d;
        for (size_t i = 0; i < rc.size(); ++i)
          if (rc[i].sm >= 0) d[static_cast<int>(i)] = rc[i].scored - med;
        cdev.push_back(d);
      }
      std::printf("  correlation of per-SM end deviations between calls (row/col = call):\n");
      double same_copy = 0, other_copy = 0;
      int n_same = 0, n_other = 0;
      for (size_t i = 0; i < dev.size(); ++i) {
        std::printf("    %zu:", i);
        for (size_t j = 0; j < dev.size(); ++j) {
          const double r = corr(dev[i], dev[j]);
          std::printf(" %5.2f", r);
          if (j > i) {
            if (call_copy[i] == call_copy[j])
              same_copy += r, ++n_same;
            else
              other_copy += r, ++n_other;
          }
        }
        std::printf("\n");
      }
      double cta_same = 0, cta_other = 0;
      int m_same = 0, m_other = 0;
      for (size_t i = 0; i < cdev.size(); ++i)
        for (size_t j = i + 1; j < cdev.size(); ++j) {
          const double r = corr(cdev[i], cdev[j]);
          if (call_copy[i] == call_copy[j])
            cta_same += r, ++m_same;
          else
            cta_other += r, ++m_other;
        }
      {
        double cb = 0;
        for (size_t k = 0; k < dev.size(); ++k) cb += corr(dev[k], sm_blocks[k]);
        std::printf("  mean correlation per SM of end deviation with the SM's blocks: %.2f\n",
                    dev.empty() ? 0.0 : cb / static_cast<double>(dev.size()));
      }
      std::printf(
          "  mean correlation per SM: same page copy %.2f (%d pairs), other copies %.2f (%d); "
          "per CTA (grid index): same copy %.2f, other copies %.2f\n",
          n_same ? same_copy / n_same : 0.0, n_same, n_other ? other_copy / n_other : 0.0, n_other,
          m_same ? cta_same / m_same : 0.0, m_other ? cta_other / m_other : 0.0);
      // SMs by their mean deviation over the calls: the slowest and fastest 16, per call.
      std::map<int, std::vector<double>> by;
      for (const auto& d : dev)
        for (const auto& kv : d) by[kv.first].push_back(kv.second);
      std::vector<std::pair<double, int>> order;
      for (const auto& kv : by)
        order.emplace_back(std::accumulate(kv.second.begin(), kv.second.end(), 0.0) /
                               static_cast<double>(kv.second.size()),
                           kv.first);
      std::sort(order.begin(), order.end());
      std::printf(
          "  per SM (mean deviation us: deviation in each call), all SMs, fastest first:\n");
      for (const auto& q : order) {
        std::printf("    sm %3d blocks %3.0f mean %+5.2f:", q.second,
                    sm_blocks.back().count(q.second) ? sm_blocks.back().at(q.second) : 0.0,
                    q.first);
        for (size_t k = 0; k < dev.size(); ++k)
          std::printf(" %+5.2f", dev[k].count(q.second) ? dev[k].at(q.second) : 0.0);
        std::printf("\n");
      }
    }
    for (uint64_t* d : d_calls)
      if (d != d_tl) cudaFree(d);
    cudaFree(d_tl);
    free_case(c);
    return finish();
  }
  if (read_timeline) {
    // The ceiling's paged read of the case's pages (read_paged, 8-warp CTAs) at grids of 1-4 CTAs
    // per SM, one cold call each with per-CTA %globaltimer marks: when CTAs start, when their
    // first page lands, when they end, and when each SM's last CTA ends (the read's front and
    // tail, to set beside the indexer's --timeline).
    int dev = 0, sms = 0;
    check_cuda(cudaGetDevice(&dev), "device");
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "sm count");
    Case c = make_case(only_batch, only_ctx, 1 + only_draft, pool, rng, rng());
    const int64_t entries = int64_t{c.R} * c.max_pages;
    int* sink = static_cast<int*>(device_alloc(size_t{64} * 1024 * 4));
    const auto pct = [](std::vector<double> v, double q) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)];
    };
    // k 1-4: CTAs per SM of 8 warps, pages dealt round-robin over the warps; k 5 / 6: one CTA
    // per SM of 4 / 8 warps, each warp a contiguous range of pages (flat decode's assignment).
    for (int k : {1, 2, 3, 4, 5, 6}) {
      const bool contig = k >= 5;
      const int grid = contig ? sms : k * sms;
      const int threads = k == 5 ? 128 : 256;
      const size_t bytes = size_t{4} * grid * 8;
      uint64_t* d_tl = static_cast<uint64_t*>(device_alloc(bytes));
      const bench::Timing t = bench::time_cold(
          [&](cudaStream_t st) {
            check_cuda(cudaMemsetAsync(d_tl, 0, bytes, st), "timeline clear");
            const int32_t* table = static_cast<const int32_t*>(c.d_tables[0]);
            if (contig)
              read_paged<true, true><<<grid, threads, 0, st>>>(pool.data, table, entries, sink,
                                                                d_tl);
            else
              read_paged<true><<<grid, threads, 0, st>>>(pool.data, table, entries, sink, d_tl);
          },
          stream, 1, 5);
      std::vector<uint64_t> tl(bytes / 8);
      check_cuda(cudaMemcpy(tl.data(), d_tl, bytes, cudaMemcpyDeviceToHost), "timeline");
      uint64_t g0 = ~uint64_t{0};
      for (int b = 0; b < grid; ++b)
        if (tl[b * 4]) g0 = std::min(g0, tl[b * 4]);
      std::vector<double> entry, land, end;
      std::map<int, double> sm_end;
      for (int b = 0; b < grid; ++b) {
        const uint64_t* e = tl.data() + b * 4;
        if (!e[0]) continue;
        entry.push_back((e[0] - g0) * 1e-3);
        if (e[2]) land.push_back((e[2] - g0) * 1e-3);
        if (e[3]) {
          const double x = (e[3] - g0) * 1e-3;
          end.push_back(x);
          double& m = sm_end[static_cast<int>(e[1])];
          m = std::max(m, x);
        }
      }
      std::vector<double> sme;
      for (const auto& kv : sm_end) sme.push_back(kv.second);
      std::printf(
          "read timeline b%d ctx %d draft %d, %d CTAs (%d per SM) x %d warps%s, cold call %.1f "
          "us (median of 5 incl. memset)\n"
          "  entry  us: p50 %6.2f max %6.2f\n"
          "  landed us: min %6.2f p50 %6.2f p90 %6.2f max %6.2f (warp 0's first page)\n"
          "  end    us: min %6.2f p10 %6.2f p50 %6.2f p90 %6.2f max %6.2f\n"
          "  SM end us: min %6.2f p10 %6.2f p50 %6.2f p90 %6.2f max %6.2f (%zu SMs)\n",
          only_batch, only_ctx, only_draft, grid, contig ? 1 : k, threads / 32,
          contig ? ", contiguous pages per warp" : "", t.median_us, pct(entry, 0.5), pct(entry, 1),
          pct(land, 0), pct(land, 0.5), pct(land, 0.9), pct(land, 1), pct(end, 0), pct(end, 0.1),
          pct(end, 0.5), pct(end, 0.9), pct(end, 1), pct(sme, 0), pct(sme, 0.1), pct(sme, 0.5),
          pct(sme, 0.9), pct(sme, 1), sme.size());
      cudaFree(d_tl);
    }
    cudaFree(sink);
    free_case(c);
    return finish();
  }
  if (pdl) {
    // The indexer behind the producer stand-in (~3 us of spinning, then index_q rewritten), with a
    // normal and a programmatic launch, beside the stand-in alone; default plan.
    int dev = 0, khz = 0;
    check_cuda(cudaGetDevice(&dev), "device");
    check_cuda(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev), "clock rate");
    const int64_t cycles = int64_t{khz} * 3 / 1000;  // ~3 us at the nominal clock
    for (int draft : {0, 3}) {
      for (int ctx : {8192, 32768}) {
        for (int batch : {1, 64, 256}) {
          if (only && (batch != only_batch || ctx != only_ctx || draft != only_draft)) continue;
          Case c = make_case(batch, ctx, 1 + draft, pool, rng, rng());
          const std::vector<Slice> slices = decode_slices(batch, draft);
          const int64_t iq_bytes = c.T * kNkv * kHeadDim;
          void* src = device_alloc(static_cast<size_t>(iq_bytes));
          check_cuda(
              cudaMemcpy(src, c.d_iq, static_cast<size_t>(iq_bytes), cudaMemcpyDeviceToDevice),
              "iq copy");
          const auto standin = [&](cudaStream_t s) {
            producer_standin<<<64, 256, 0, s>>>(static_cast<uint8_t*>(c.d_iq),
                                                static_cast<const uint8_t*>(src), iq_bytes, cycles);
            check_cuda(cudaGetLastError(), "stand-in");
          };
          const bench::Timing alone = bench::time_graph_cold(standin, stream);
          const bench::Timing alone_b2b = bench::time_graph_back_to_back(
              [&](cudaStream_t s, int) { standin(s); }, 1, stream, std::max(8, 2 * c.copies));
          const std::string what = "pdl b" + std::to_string(batch) + " ctx " + std::to_string(ctx) +
                                   " draft " + std::to_string(draft);
          bool pass = true;
          IndexerCudaOptions po = default_o;
          const Times seq = check_and_time(c, pool, slices, po, stream, true, what, &pass, standin);
          po.programmatic_launch = true;
          const Times pro = check_and_time(c, pool, slices, po, stream, true, what, &pass, standin);
          all_pass = all_pass && pass;
          bench::Row row = case_row(c, draft, plan_str(c, default_o), pass);
          row.add("standin_us", alone.median_us, 1);
          row.add("pair_us", seq.iso.median_us, 1);
          row.add("pdl_pair_us", pro.iso.median_us, 1);
          row.add("saved_us", seq.iso.median_us - pro.iso.median_us, 1);
          row.add("pair_b2b_us", seq.b2b.median_us, 1);
          row.add("pdl_b2b_us", pro.b2b.median_us, 1);
          row.add("saved_b2b_us", seq.b2b.median_us - pro.b2b.median_us, 1);
          // The indexer's share of a back-to-back chain: pair minus the stand-in alone, and its
          // index-K bytes over that share (% of the copy bandwidth).
          row.add("standin_b2b_us", alone_b2b.median_us, 1);
          row.add("idx_b2b_us", seq.b2b.median_us - alone_b2b.median_us, 1);
          row.add("idx_pdl_b2b_us", pro.b2b.median_us - alone_b2b.median_us, 1);
          row.add("pdl_b2b_%", pct_copy(c, pro.b2b.median_us - alone_b2b.median_us), 1);
          rows.push_back(row);
          cudaFree(src);
          free_case(c);
        }
      }
    }
    bench::print_rows(
        "indexer behind a producer stand-in (graph replay, cold L2; pair = stand-in + indexer, "
        "normal vs programmatic launch of the indexer; isolated and back to back; idx_*: pair "
        "minus the stand-in alone, back to back; pdl_b2b_%: index-K bytes over idx_pdl_b2b_us, "
        "% of copy bandwidth)",
        rows, json);
    return finish();
  }
  if (ceiling) {
    // The default plan beside plain reads of the same index-K bytes, timed the same way
    // (isolated: one graph replay after an L2 flush; back to back over the case's copies): a
    // contiguous read (bench::launch_plain_read; copy i = the i-th run of pool pages) and the
    // case's own pages through its page tables (read_paged; copy i = page table i), each at its
    // fastest grid.
    int dev = 0, sms = 0;
    check_cuda(cudaGetDevice(&dev), "device");
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "sm count");
    int* sink = static_cast<int*>(device_alloc(size_t{64} * 1024 * 4));
    for (int draft : {0, 3}) {
      for (int ctx : contexts) {
        for (int batch : batches) {
          if (only && (batch != only_batch || ctx != only_ctx || draft != only_draft)) continue;
          if (!only && batch == 1) continue;  // latency-bound: see the main table
          Case c = make_case(batch, ctx, 1 + draft, pool, rng, rng());
          const std::vector<Slice> slices = decode_slices(batch, draft);
          const std::string what = "ceiling b" + std::to_string(batch) + " ctx " +
                                   std::to_string(ctx) + " draft " + std::to_string(draft);
          bool pass = true;
          const Times tm = check_and_time(c, pool, slices, default_o, stream, true, what, &pass);
          all_pass = all_pass && pass;
          const int64_t entries = int64_t{c.R} * c.max_pages;
          const size_t n16 = static_cast<size_t>(entries * kPageBytes / 16);
          const auto flat_src = [&](int copy) {
            return reinterpret_cast<const int4*>(pool.data + int64_t{copy} * entries * kPageBytes);
          };
          double flat_best = 1e30, paged_best = 1e30;
          int flat_grid = 0, paged_grid = 0;
          for (int k : {1, 2, 4, 8, 16}) {
            const bench::Timing tf = bench::time_graph_cold(
                [&](cudaStream_t st) {
                  bench::launch_plain_read(flat_src(0), n16, k * sms, 512, sink, st);
                },
                stream);
            if (tf.median_us < flat_best) flat_best = tf.median_us, flat_grid = k * sms;
            const bench::Timing tp = bench::time_graph_cold(
                [&](cudaStream_t st) {
                  read_paged<false><<<k * sms, 256, 0, st>>>(
                      pool.data, static_cast<const int32_t*>(c.d_tables[0]), entries, sink,
                      nullptr);
                },
                stream);
            if (tp.median_us < paged_best) paged_best = tp.median_us, paged_grid = k * sms;
          }
          const int calls = std::max(8, 2 * c.copies);
          const bench::Timing fb = bench::time_graph_back_to_back(
              [&](cudaStream_t st, int copy) {
                bench::launch_plain_read(flat_src(copy), n16, flat_grid, 512, sink, st);
              },
              c.copies, stream, calls);
          const bench::Timing pb = bench::time_graph_back_to_back(
              [&](cudaStream_t st, int copy) {
                read_paged<false><<<paged_grid, 256, 0, st>>>(
                    pool.data, static_cast<const int32_t*>(c.d_tables[copy]), entries, sink,
                    nullptr);
              },
              c.copies, stream, calls);
          // Flat decode's assignment without compute: one CTA per SM of 8 warps, each warp a
          // contiguous range of pages (read_paged's kContig).
          const bench::Timing cb = bench::time_graph_back_to_back(
              [&](cudaStream_t st, int copy) {
                read_paged<false, true><<<sms, 256, 0, st>>>(
                    pool.data, static_cast<const int32_t*>(c.d_tables[copy]), entries, sink,
                    nullptr);
              },
              c.copies, stream, calls);
          check_cuda(cudaStreamSynchronize(stream), "ceiling");
          bench::Row row = case_row(c, draft, plan_str(c, default_o), pass);
          row.add("index_MB", c.index_bytes / 1e6, 1);
          row.add("idx_us", tm.iso.median_us, 1);
          row.add("idx_b2b", tm.b2b.median_us, 1);
          row.add("read_us", flat_best, 1);
          row.add("read_b2b", fb.median_us, 1);
          row.add("paged_us", paged_best, 1);
          row.add("paged_b2b", pb.median_us, 1);
          row.add("contig_b2b", cb.median_us, 1);
          row.add("read_%copy", pct_copy(c, flat_best), 1);
          row.add("read_b2b_%", pct_copy(c, fb.median_us), 1);
          row.add("paged_%copy", pct_copy(c, paged_best), 1);
          row.add("paged_b2b_%", pct_copy(c, pb.median_us), 1);
          row.add("idx/read", 100.0 * flat_best / tm.iso.median_us, 1);
          row.add("idx/read_b2b", 100.0 * fb.median_us / tm.b2b.median_us, 1);
          row.add("grids", std::to_string(flat_grid) + "/" + std::to_string(paged_grid));
          row.add("copies", std::to_string(c.copies));
          rows.push_back(row);
          free_case(c);
        }
      }
    }
    cudaFree(sink);
    bench::print_rows(
        "indexer vs plain reads of the same index-K bytes (graph replay, cold L2; isolated and "
        "back to back; read = contiguous, paged = the case's pages via its page table, contig = "
        "the same pages, each warp a contiguous range of them, one CTA per SM of 8 warps; "
        "idx/read "
        "= read time / indexer time, %)",
        rows, json);
    return finish();
  }
  if (variants) {
    // The default options beside opt-in variants of the same plan, same run, same case.
    struct Variant {
      const char* name;
      IndexerCudaOptions o;
    };
    // 2k: the two-kernel path at the default plan's k_splits (set per case below).
    std::vector<Variant> all = {{"base", default_o},    {"2k", default_o},    {"late", default_o},
                                {"sorted", default_o},  {"q1", default_o},    {"flat0", default_o},
                                {"flat1", default_o},   {"flat2", default_o}, {"flat3", default_o},
                                {"flat1q1", default_o}, {"w2", default_o},    {"w4", default_o}};
    all[1].o.unfused_decode = true;
    all[2].o.early_query_loads = false;
    all[3].o.fast_select = false;
    all[4].o.short_select = false;
    all[5].o.flat_decode = -1;
    all[6].o.flat_decode = 1;
    all[7].o.flat_decode = 2;
    all[8].o.flat_decode = 3;
    all[9].o.flat_decode = 1;
    all[9].o.short_select = false;
    all[10].o.short_select_warps = 2;
    all[11].o.short_select_warps = 4;
    // 2k3 / 2k4 / 2k6 / 2k8 = the two-kernel path at 3 / 4 / 6 / 8 splits (unfused_decode,
    // k_splits); sp4 = the single pass in 4-CTA clusters.
    for (int k : {3, 4, 6, 8, 16}) {
      all.push_back({k == 3   ? "2k3"
                     : k == 4 ? "2k4"
                     : k == 6 ? "2k6"
                     : k == 8 ? "2k8"
                              : "2k16",
                     default_o});
      all.back().o.unfused_decode = true;
      all.back().o.k_splits = k;
    }
    all.push_back({"sp4", default_o});
    all.back().o.single_pass = true;
    all.back().o.single_pass_ctas = 4;
    all.push_back({"sp2", default_o});  // the single pass in 2-CTA clusters
    all.back().o.single_pass = true;
    all.back().o.single_pass_ctas = 2;
    all.push_back({"sp8", default_o});  // the single pass in 8-CTA clusters
    all.back().o.single_pass = true;
    all.back().o.single_pass_ctas = 8;
    all.push_back({"noam", default_o});  // !IndexerCudaOptions::cluster_async_maxima
    all.back().o.cluster_async_maxima = false;
    // noef = IndexerCudaOptions::stream_evict_first -1 (never; the default: every plan).
    all.push_back({"noef", default_o});
    all.back().o.stream_evict_first = -1;
    // pdl = IndexerCudaOptions::programmatic_launch (a measurement, not a default: back to back
    // each call is then launched programmatically behind the previous one, whose tail its front
    // overlaps; the layer's decode step measured no gain from it in session 23).
    all.push_back({"pdl", default_o});
    all.back().o.programmatic_launch = true;
    // wide4 / wide8 / wide16 = IndexerCudaOptions::wide_select 4 / 8 / 16 (forced), nowide =
    // wide_select -1 (select_kernel: one warp per row).
    for (int w : {4, 8, 16}) {
      all.push_back({w == 4 ? "wide4" : w == 8 ? "wide8" : "wide16", default_o});
      all.back().o.wide_select = w;
    }
    all.push_back({"nowide", default_o});
    all.back().o.wide_select = -1;
    // ovf = overflow_tiles_always (the former grid: overflow tiles at any token count); main =
    // the options of main before session 27 (ovf, wide_select -1, fused_small_ctas_per_sm 1).
    all.push_back({"ovf", default_o});
    all.back().o.overflow_tiles_always = true;
    all.push_back({"main", default_o});
    all.back().o.overflow_tiles_always = true;
    all.back().o.wide_select = -1;
    all.back().o.fused_small_ctas_per_sm = 1;
    // one = IndexerCudaOptions::fused_small_ctas_per_sm 1 (the former fused plan below one wave:
    // one CTA per SM).
    all.push_back({"one", default_o});
    all.back().o.fused_small_ctas_per_sm = 1;
    // fkN (any N in --vlist): the fused path at N splits (fused_decode_always, k_splits N);
    // fkNn: the same with wide_select -1.
    std::vector<std::string> fk_names;
    for (const std::string& n : vlist)
      if (n.size() > 2 && n.compare(0, 2, "fk") == 0) fk_names.push_back(n);
    for (const std::string& n : fk_names) {
      all.push_back({n.c_str(), default_o});
      all.back().o.fused_decode_always = true;
      all.back().o.k_splits = std::atoi(n.c_str() + 2);
      if (n.back() == 'n') all.back().o.wide_select = -1;
    }
    std::vector<Variant> vs;
    for (const Variant& v : all)
      if (vlist.empty() || v.name == std::string("base") ||
          std::find(vlist.begin(), vlist.end(), v.name) != vlist.end())
        vs.push_back(v);
    // --case: any batch size and context (the table's otherwise).
    const std::vector<int> vbatches = only ? std::vector<int>{only_batch} : batches;
    const std::vector<int> vcontexts = only ? std::vector<int>{only_ctx} : contexts;
    for (int run = 0; run < repeat; ++run)
      for (int ctx : vcontexts) {
        for (int batch : vbatches) {
          const int draft = only ? only_draft : 3;
          if (only && (batch != only_batch || ctx != only_ctx)) continue;
          if (!only && batch == 1) continue;
          Case c = make_case(batch, ctx, 1 + draft, pool, rng, rng());
          const std::vector<Slice> slices = decode_slices(batch, draft);
          bool pass = true;
          std::vector<Times> tms;
          for (Variant& v : vs)
            if (v.name == std::string("2k"))
              v.o.k_splits = indexer_cuda_plan(c.p, default_o).k_splits;
          for (const Variant& v : vs) {
            const std::string what = std::string("variant ") + v.name + " b" +
                                     std::to_string(batch) + " ctx " + std::to_string(ctx) +
                                     " draft " + std::to_string(draft);
            tms.push_back(check_and_time(c, pool, slices, v.o, stream, true, what, &pass));
          }
          all_pass = all_pass && pass;
          bench::Row row = case_row(c, draft, plan_str(c, default_o), pass);
          row.add("run", std::to_string(run + 1));
          for (size_t i = 0; i < vs.size(); ++i) {
            if (i > 0) row.add(std::string(vs[i].name) + "_plan", plan_str(c, vs[i].o));
            row.add(std::string(vs[i].name) + "_us", tms[i].iso.median_us, 1);
            row.add(std::string(vs[i].name) + "_b2b", tms[i].b2b.median_us, 1);
          }
          rows.push_back(row);
          free_case(c);
        }
      }
    bench::print_rows(
        "indexer decode: default options vs opt-in variants, same plan (graph replay, cold L2; "
        "isolated and back to back, us; 2k = unfused_decode at the default k_splits, late = "
        "!early_query_loads, sorted = !fast_select, q1 = !short_select, flatN = flat_decode N, "
        "2kK = unfused_decode at K splits, sp4 / sp2 / sp8 = single pass in 4 / 2 / 8-CTA "
        "clusters, "
        "noam = !cluster_async_maxima, "
        "flat0 = flat_decode -1 (never), flat1q1 = flat1 and q1, "
        "w2 / w4 = short_select_warps 2 / 4, noef = stream_evict_first -1, pdl = "
        "programmatic_launch; "
        "--repeat N: the variants alternate, N runs)",
        rows, json);
    return finish();
  }
  if (clusters) {
    // The single pass with 1, 2, 3, 4 and 8 CTAs per request (thread-block clusters) beside the
    // default plan and the two-kernel path, at 8K (<= 64 blocks, where the single pass applies).
    for (int draft : {0, 3}) {
      for (int batch : {1, 32, 64, 96, 128, 192, 256}) {
        if (only && (batch != only_batch || draft != only_draft)) continue;  // --case
        Case c = make_case(batch, 8192, 1 + draft, pool, rng, rng());
        const std::vector<Slice> slices = decode_slices(batch, draft);
        // -1: default plan, 0: two-kernel, 1..8: single pass with that many CTAs per request.
        for (int ctas : {-1, 0, 1, 2, 3, 4, 8}) {
          IndexerCudaOptions o;
          o.unfused_decode = ctas == 0;
          o.single_pass = ctas > 0;
          o.single_pass_ctas = std::max(ctas, 0);
          const std::string label = ctas < 0    ? "default"
                                    : ctas == 0 ? "two-kernel"
                                                : "single " + std::to_string(ctas);
          const std::string what = "clusters b" + std::to_string(batch) + " draft " +
                                   std::to_string(draft) + " " + label;
          bool pass = true;
          const Times tm = check_and_time(c, pool, slices, o, stream, true, what, &pass);
          all_pass = all_pass && pass;
          bench::Row row;
          row.add("batch", std::to_string(batch));
          row.add("draft", std::to_string(draft));
          row.add("path", label);
          row.add("plan", plan_str(c, o));
          row.add("check", pass ? "PASS" : "FAIL");
          row.add("us", tm.iso.median_us, 1);
          row.add("min_us", tm.iso.min_us, 1);
          row.add("%copy", pct_copy(c, tm.iso.median_us), 1);
          row.add("b2b_us", tm.b2b.median_us, 1);
          row.add("b2b_%copy", pct_copy(c, tm.b2b.median_us), 1);
          rows.push_back(row);
        }
        free_case(c);
      }
    }
    bench::print_rows(
        "indexer decode 8K: single pass in clusters of 1-8 CTAs per request (graph replay, cold "
        "L2; isolated and back to back)",
        rows, json);
    return finish();
  }
  for (int draft : {0, 3}) {
    for (int ctx : contexts) {
      for (int batch : batches) {
        if (only && (batch != only_batch || ctx != only_ctx || draft != only_draft)) continue;
        Case c = make_case(batch, ctx, 1 + draft, pool, rng, rng());
        const std::vector<Slice> slices = decode_slices(batch, draft);
        const std::string what = "decode b" + std::to_string(batch) + " ctx " +
                                 std::to_string(ctx) + " draft " + std::to_string(draft);
        bool pass = true;
        // Default flags: every path explicitly (fused always, two-kernel, single pass where it
        // applies); the default path's times are those of the path its plan picks.
        Times tm, tmf, tm2, tms;
        const IndexerCudaPlan dplan = indexer_cuda_plan(c.p, default_o);
        const bool has_single = compare_paths && indexer_cuda_plan(c.p, single_o).single;
        if (compare_paths) {
          tmf = check_and_time(c, pool, slices, fused_o, stream, true, what, &pass);
          tm2 = check_and_time(c, pool, slices, two_o, stream, true, what, &pass);
          if (has_single)
            tms = check_and_time(c, pool, slices, single_o, stream, true, what, &pass);
          tm = dplan.single ? tms : (dplan.fused ? tmf : tm2);
        } else {
          tm = check_and_time(c, pool, slices, main_o, stream, true, what, &pass);
        }
        all_pass = all_pass && pass;
        const double gbs = c.index_bytes / (tm.iso.median_us * 1e3);
        bench::Row row;
        row.add("batch", std::to_string(batch));
        row.add("context", kilo(ctx));
        row.add("draft", std::to_string(draft));
        row.add("check", pass ? "PASS" : "FAIL");
        row.add("us", tm.iso.median_us, 1);
        row.add("b2b_us", tm.b2b.median_us, 1);
        row.add("min_us", tm.iso.min_us, 1);
        row.add("index_MB", c.index_bytes / 1e6, 1);
        row.add("GB/s", gbs, 0);
        row.add("%copy", pct_copy(c, tm.iso.median_us), 1);
        row.add("b2b_%copy", pct_copy(c, tm.b2b.median_us), 1);
        if (compare_paths) {
          row.add("fused_us", tmf.iso.median_us, 1);
          row.add("f_b2b_us", tmf.b2b.median_us, 1);
          row.add("2kernel_us", tm2.iso.median_us, 1);
          row.add("2k_b2b_us", tm2.b2b.median_us, 1);
          row.add("single_us", has_single ? fixed1(tms.iso.median_us) : "-");
          row.add("s_b2b_us", has_single ? fixed1(tms.b2b.median_us) : "-");
        }
        row.add("plan", plan_str(c, main_o));
        row.add("copies", std::to_string(c.copies));
        std::string peer = "-";
        if (batch == 256 && ctx == 8192) peer = "175";
        if (batch == 256 && ctx == 32768) peer = "539";
        row.add("peer_us", peer);
        rows.push_back(row);
        free_case(c);
      }
    }
  }
  bench::print_rows(
      unfused_only ? "indexer decode, two-kernel path (graph replay, cold L2, n_kv 4)"
                   : "indexer decode (graph replay, cold L2, n_kv 4; us / b2b_us = default path "
                     "(plan) isolated / back to back, fused = fused_decode_always, 2kernel = "
                     "unfused_decode, single = single_pass where it applies)",
      rows, json);

  if (sweep) {
    // Draft 0 and 3 at 8K, draft 0 at 32K (or the --case alone); the single pass once per 8K case.
    rows.clear();
    const std::vector<int> sweep_ctx =
        only ? std::vector<int>{only_ctx} : std::vector<int>{8192, 32768};
    const std::vector<int> sweep_draft =
        only ? std::vector<int>{only_draft} : std::vector<int>{0, 3};
    const std::vector<int> sweep_batch =
        only ? std::vector<int>{only_batch} : std::vector<int>{64, 128, 192, 256};
    for (int ctx : sweep_ctx) {
      for (int draft : sweep_draft) {
        if (!only && ctx > 8192 && draft > 0) continue;
        for (int batch : sweep_batch) {
          // Batches 128 and 192 (8K only): the automatic plan of each path alone, for the batch
          // threshold of the single pass.
          const bool auto_only = !only && (batch == 128 || batch == 192);
          if (auto_only && ctx > 8192) continue;
          Case c = make_case(batch, ctx, 1 + draft, pool, rng, rng());
          const std::vector<Slice> slices = {{0, 0, 1 + draft}, {batch - 1, 0, 1 + draft}};
          for (int path = 0; path < (compare_paths ? 3 : 1); ++path)
            for (int k : sweep_k) {
              IndexerCudaOptions o = path == 0 ? sweep_o : (path == 1 ? two_o : single_o);
              o.k_splits = k;
              if (k > 0 && (auto_only || int64_t{k} * 4 > c.max_pages)) continue;
              if (path == 2 && (k > 0 || !indexer_cuda_plan(c.p, o).single)) continue;
              const std::string what = "sweep b" + std::to_string(batch) + " ctx " +
                                       std::to_string(ctx) + " draft " + std::to_string(draft) +
                                       " k " + std::to_string(k);
              bool pass = true;
              const Times tm = check_and_time(c, pool, slices, o, stream, true, what, &pass);
              all_pass = all_pass && pass;
              bench::Row row;
              row.add("batch", std::to_string(batch));
              row.add("context", kilo(ctx));
              row.add("draft", std::to_string(draft));
              row.add("k_splits", k == 0 ? std::string("auto") : std::to_string(k));
              row.add("plan", plan_str(c, o));
              row.add("check", pass ? "PASS" : "FAIL");
              row.add("us", tm.iso.median_us, 1);
              row.add("%copy", pct_copy(c, tm.iso.median_us), 1);
              row.add("b2b_us", tm.b2b.median_us, 1);
              row.add("b2b_%copy", pct_copy(c, tm.b2b.median_us), 1);
              rows.push_back(row);
            }
          free_case(c);
        }
      }
    }
    bench::print_rows(
        std::string("indexer decode split sweep (") +
            (unfused_only ? "two-kernel" : "fused rows, two-kernel rows, single pass") +
            ", graph replay, cold L2; isolated and back to back)",
        rows, json);
  }

  rows.clear();
  for (int ctx : {8192, 65536}) {
    if (only) break;  // --case: that decode case alone
    Case c = make_case(1, ctx, 8192, pool, rng, rng());
    const std::vector<Slice> slices = {{0, 0, 3}, {0, 2047, 3}, {0, 8189, 3}};
    const std::string what = "prefill ctx " + std::to_string(ctx);
    bool pass = true;
    const bench::Timing tm =
        check_and_time(c, pool, slices, main_o, stream, false, what, &pass).iso;
    all_pass = all_pass && pass;
    bench::Row row;
    row.add("chunk", "8K");
    row.add("context", kilo(ctx));
    row.add("check", pass ? "PASS" : "FAIL");
    row.add("us", tm.median_us, 1);
    row.add("index_MB", c.index_bytes / 1e6, 1);
    row.add("TFLOP/s", c.flops / (tm.median_us * 1e6), 1);
    rows.push_back(row);
    free_case(c);
  }
  bench::print_rows("indexer prefill (eager, cold L2, n_kv 4)", rows, json);
  return finish();
}
