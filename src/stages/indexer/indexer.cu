// CUDA launcher of the indexer: validate_indexer + the CUDA-only rules, then a scoring kernel
// (tensor cores, or CUDA cores for caches that are not 16-byte aligned) writing block scores into
// the caller's workspace, and the top-16 selection kernel; or the single pass alone (one CTA or one
// thread-block cluster per request, rows finished by the scorer). No sync, no allocation, no copy:
// the grid depends only on T, R, max_pages and the SM count, so the launch is CUDA-graph
// capturable.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/cuda_check.h"
#include "core/pdl.cuh"
#include "m3attn/config.h"
#include "stages/indexer/indexer.h"
#include "stages/indexer/indexer_kernel_common.cuh"
#include "stages/indexer/indexer_kernel_mma.cuh"
#include "stages/indexer/indexer_kernel_select.cuh"
#include "stages/indexer/indexer_kernel_simple.cuh"

namespace m3attn {

namespace {

namespace ik = indexer_kernel;

// CTAs the scoring grid aims for per SM (about 2-3 waves of the tensor-core kernel, which keeps
// 3-4 CTAs resident per SM).
constexpr int64_t kTargetCtasPerSm = 8;
// The fused decode path is chosen automatically above this many page-table columns (see
// IndexerCudaOptions::fused_decode_always).
constexpr int kFusedAutoMinPages = 128;
// Blocks per split the automatic plan aims for in decode units (two-kernel path, see make_plan).
constexpr int64_t kDecodeChunk = 16;
// ... and at contexts of <= 64 blocks (8K): session 12 round B, two-kernel path, 3 splits of 24
// blocks vs 4 of 16: 64 x 8K draft 3 27.8 / 26.0 us (isolated / back to back) vs 30.6 / 28.2,
// draft 0 26.0 / 23.6 vs 25.6 / 23.6; 256 x 8K draft 3 77.4 / 75.7 vs 78.5 / 77.0.
constexpr int64_t kDecodeChunkShort = 24;
// ... and for verify batches (2-4 tokens per request) of more than one request per SM at <= 64
// blocks (where the single pass in 4-CTA clusters ran from 1.9 requests per SM, and 3 splits of
// 24 blocks below): the two-kernel path in 12-block splits.
// Session 24 (select_short's strict counts), same-run A/Bs at 8K, back to back: 256 requests draft
// 3, 6 splits of 12 blocks 68.4 / 68.4 / 68.6 us vs 72.1 / 71.9 / 72.1 for the single pass (round
// J; isolated 71.3-71.6 vs 75.5-76.0; 3 of 24 69.3-69.7, 4 of 16 70.4-71.1, flat decode at 1 / 2
// CTAs per SM 80.0-80.9), 69.5 / 69.8 / 69.8 vs 73.1 / 72.6 / 73.2 (round K; 8 of 8 70.2-70.5);
// round L: 256 requests draft 2 68.3 / 68.5 vs 75.3 / 75.2, draft 1 66.9 / 67.1 vs 70.9 / 71.3 (8
// of 8: 69.1-69.2, 67.8-67.9), 192 requests draft 3 54.0 / 54.3 vs 55.7 / 56.0 for 3 of 24 (single
// pass 60.3 / 60.4). At 128 requests (0.97 per SM, the 2-CTA single pass) 3 / 6 splits
// 39.0-39.2 / 39.4 vs 39.8 / 39.9 (round L). Draft 0 at 256 x 8K keeps its single pass: 64.9 /
// 65.4 vs 67.5 / 67.4 for 4 of 16 (J).
// Session 25 round A (8K, back to back, two alternating runs, 6 splits of 12 vs the 3 of 24 that
// ran between 1 and 1.9 requests per SM): 144 requests draft 1 41.5 / 41.4 us vs 43.6 / 43.8,
// draft 3 42.7 / 42.6 vs 47.0 / 47.0; 192 draft 1 52.7 / 53.1 vs 54.1 / 54.7, draft 2 54.3 /
// 54.6 vs 55.8 / 56.2; 240 draft 1 63.2 / 63.3 vs 64.8 / 64.7, draft 3 66.1 / 66.3 vs 67.5 / 67.5:
// hence from just above one request per SM. At and below one request per SM the 2-CTA single pass
// stays: 96 requests draft 3 32.5 / 32.5 vs 32.9 / 32.9 (3 of 24) and 33.0 / 33.1 (6 of 12); 128
// draft 1 37.0 / 37.0 vs 37.9 / 37.7 and 38.4 / 38.4, draft 3 39.8 / 40.0 vs 39.0 / 39.0 and
// 39.6 / 39.5.
constexpr int64_t kManyVerifyChunk = 12;
// Where 24-block chunks give at least one CTA per SM and 12-block ones would still fit one wave
// (kFusedCtasPerSm per SM; at 132 SMs and 64 blocks: 44-66 requests), the two-kernel path runs
// flat decode with one CTA per SM instead (IndexerCudaOptions::flat_decode): every warp a
// contiguous range of one request's blocks, 7-8 blocks per warp at 64 x 8K, every SM within 4
// blocks of the mean. Session 19, same-run A/Bs at 64 x 8K draft 3, two alternating runs each:
// 23.5-23.7 / 23.6-23.7 / 23.5-23.6 / 23.3-23.5 us back to back (rounds A-D) vs 24.1-24.2 /
// 24.1-24.2 / 24.1 / 23.9 for 6 splits of 12 blocks (session 18's rule for this range: k6 c12
// 23.0 vs k3 c24 23.4-23.5), isolated 25.8-26.0 vs 26.2-26.4; flat with 2 / 3 CTAs per SM
// 24.2-24.5 / 25.1 (round A: 7-8 blocks per warp beat 3-4 with three times the warps). Measured
// at 64 requests only.
// Session 20 (64 x 8K, same-round A/Bs, back-to-back us, draft 0 / draft 3 vs the defaults
// 20.8-21.4 (single pass) / 23.2-23.9 (flat)), all lost and deleted:
//  - the rows finished inside the flat scorer, no selection kernel: per-request tickets in a
//    zeroed control area of the workspace, the CTA completing a request's ticket resets it,
//    loads the request's block scores and selects (as the single pass): 24.4-25.9 / 31.3-31.9.
//    Timelines: the ticket was taken ~1.2-1.3 us (p50) after the CTA's last block (a CTA barrier
//    and an L2 atomic), and one CTA's 4 warps then needed up to 2.3-4.3 us (draft 0, 4 rows) and
//    5-11 us (draft 3, 16 rows, one or two requests per CTA) to select, where the selection
//    kernel's 4096 warps finish 2.1 us after their release (0.75 us after the scorer's last
//    warp);
//  - flat decode guessing the request bounds at several tokens per request (positions and query
//    rows loaded with the page-table entries): 23.7-23.9 vs 23.7-23.9 at draft 3 (its warps were
//    ready no earlier: p50 3.6 us); flat at draft 0 with it 22.1 vs the single pass's 21.3-21.4.
//  Where 64 x 8K stands (timelines): every SM streams 32 blocks in both plans (flat: 88 of the
//  132 CTAs hold 32 blocks, the rest 28-31), the single pass's last block lands ~18 us after
//  entry, the cluster barrier and final selection add ~1.8 us; flat's stream ends later (its
//  warps are ready ~1 us later and the SMs end 4-5 us apart, the single pass's 1.7 us), and
//  its selection kernel ends ~2.9 us after the scorer's last warp.
// Session 22 (64 x 8K, same-round A/Bs, back-to-back us, draft 0 / draft 3 vs the defaults),
// all lost and deleted:
//  - dynamic decode (issue #5's "finer work assignment"): one CTA of 4 warps per SM (or two),
//    request-major items (one block of a request's rows, or the selection of one of its rows,
//    lagging behind its blocks) taken from global counters in a zeroed workspace control area
//    (the call's last grab reset it), block maxima stored as u64 (score bits + a per-call tag)
//    so that selection items polled their rows without fences, no selection kernel. Round C (one
//    counter): 32.1-33.6 / 39.1-40.1 vs 21.1-21.2 / 23.1-23.2; round D (8 / 1 / 16 counters on
//    separate lines): 30.7-31.1 / 38.3-39.0 vs 21.1 / 23.2-23.3; round E (two CTAs per SM):
//    29.6-29.7 / 31.7-31.8 vs 21.0-21.1 / 23.3-23.4; round F (overflow tiles kept out of the
//    decode CTAs' slots): 24.4-24.6 / 27.2-27.7 vs 21.0-21.1 / 23.2-23.4; round G (no acquire
//    load, the first item's request resolved before the first tiles: ready 3.9-4.0 us after
//    entry instead of 7.2-8.1): 25.2-25.7 / 27.7-28.3 vs 21.3-21.4 / 23.5-23.7. Timelines and
//    ncu: the stream's end was balanced (round C, one CTA per SM, d3: 90 % of the CTAs ended
//    within 1.3 us, the flat plan's 5 us apart), but each item switches request (query rows,
//    positions, item arithmetic: ~600 instructions beside the block's ~780), and the warps are
//    latency bound at one per scheduler (round D ncu, d3: 5.3 cycles per issued instruction,
//    issue slots 17 % busy, DRAM 33 %), so the stream ran at half speed; two CTAs per SM hid
//    that in the middle of the stream but not at its start and end;
//  - flat_dynamic (a request's blocks shared by its flat warps through a per-request counter,
//    three static blocks per warp first, no request switch): 24.4 vs 23.3-23.4 at d3 (round E;
//    CTA ends still 17.4-21.5 us: the spread lies between SMs, not between a request's warps,
//    and it changes from call to call), flat1 with it at d0 22.6-22.7 vs 21.7-21.8 (flat1) and
//    21.0-21.1 (single pass);
//  - (bench diagnostic, round A) the paged read of the 64 x 8K pages taken from one atomic
//    counter two pages ahead: 26.0 / 23.7-23.8 us isolated / back to back vs 20.0 / 17.7-17.8
//    for the static read; with a fence and a per-request done counter per page 26.2-26.4 /
//    24.2.
//  The lesson: the stream is bound by DRAM and by each warp's instruction latency at once; any
//  work added per block costs the whole stream, so a finer balance needs a mechanism that adds
//  nothing per block.
constexpr int64_t kFlatRuleChunk = 12;
// The automatic single pass (see make_plan) applies up to this many query tokens per request.
constexpr int64_t kSingleMaxTokensPerRequest = 4;
// Largest portable thread-block cluster: CTAs per decode unit of the clustered single pass.
constexpr int64_t kMaxClusterCtas = 8;
// Resident CTAs per SM of the fused scorer (72 KB of shared memory, 148 registers x 128 threads).
constexpr int64_t kFusedCtasPerSm = 3;
// short_select applies up to this many selection rows per SM (4224 on an H200): the decode and
// verify batches where four warps per row shorten the selection (session 17: 64 x 8K draft 3,
// 1024 rows, 23.5 vs 25.2-25.9 us back to back; the two-kernel path at 256 x 8K draft 3, 4096
// rows, 74.1-74.3 vs 75.6 us), not the prefill chunks, where one warp per row is the faster
// (lead's same-run A/B, three alternating runs: 8K chunk at 8K context, 32768 rows, 170.1-172.0
// us with four warps per row vs 159.4-162.5 with one).
constexpr int64_t kShortSelectMaxRowsPerSm = 32;

// Fused decode below one wave (fewer CTAs than SMs at the default chunks: small batches at long
// contexts) with one request and no overflow tile (batch-1 decode and verify): chunks sized for
// about this many CTAs per SM (at least 4 blocks: one per warp) instead of one (the rule for
// every other batch). Session 27, same-round A/Bs, back to back (us; three alternating runs
// unless noted; vs one CTA per SM): round E, 1 x 128K draft 0, 256 splits of 4 blocks 9.6 / 9.6 /
// 9.6 vs 9.9-10.0 for 128 of 8 (64 of 16: 10.0-10.1); round F: 1 x 128K draft 0 9.6 / 9.6 / 9.6 vs
// 9.9 / 9.9 / 10.0, draft 3 10.4 / 10.4 / 10.4 vs 10.4 / 10.5 / 10.4; 1 x 96K draft 0 (192 of 4
// vs 96 of 8) 8.7 / 8.7 / 8.8 vs 9.0 / 8.9 / 8.9; 1 x 80K draft 3 9.1 / 9.1 / 9.1 vs 9.1 / 9.2 /
// 9.2 (contexts up to ~66K: 4-block chunks either way). Not for several requests (round F, two
// runs): 2 x 128K draft 0 14.2 / 14.4 vs 14.1 / 14.2; 8 x 128K draft 0 43.4 / 43.7 vs 42.0 / 42.1;
// 2 x 128K draft 3 18.9 / 18.9 vs 19.0 / 19.2; 4 x 32K draft 0 9.9 / 9.9 vs 9.9 / 10.0; 2 x 64K
// draft 3 12.8 / 12.8 vs 12.9 / 12.9.
constexpr int64_t kFusedSmallCtasPerSm = 2;
// wide_select (automatic): select_wide_kernel with this many warps per row where the call has
// at most kWideSelectMaxRows rows of more than 64 candidates (batch-1 decode: 4 rows at draft 0,
// 16 at draft 3). Session 27 round F (two alternating runs, back to back) at 32 rows: 8 x 128K
// draft 0 37.5 / 37.4 us vs 43.4 / 43.7 for one warp per row (both at 32 splits of 32 blocks),
// 2 x 128K draft 3 14.6 / 14.7 vs 18.9 / 18.9. Measured at 4, 16 and 32 rows (batch-1 numbers:
// IndexerCudaOptions::wide_select); more rows (64 x 32K: 256) keep one warp per row.
// IndexerCudaOptions::pdl_prefetch_blocks: at most this many blocks per decode warp.
constexpr int kPdlPrefetchMaxBlocks = 8;
constexpr int kWideSelectWarps = 8;
constexpr int64_t kWideSelectMaxRows = 32;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool tensor_core_path(const IndexerParams& p, const IndexerCudaOptions& o) {
  const int64_t page_stride_bytes = p.index_cache.stride[0];  // e4m3: 1 byte per element
  return !o.force_cuda_cores && aligned16(p.index_cache.data) &&
         (page_stride_bytes % 16 == 0 || p.index_cache.shape[0] == 1) && aligned16(p.index_q.data);
}

Status check_workspace(const IndexerParams& p, const TensorView& ws, int64_t need) {
  if (need == 0) return Status::Ok();  // nothing is scored or read
  M3_CHECK_ARG(ws.device == p.index_q.device, "indexer workspace is on ", ws.device.to_string(),
               " but the indexer tensors are on ", p.index_q.device.to_string());
  M3_RETURN_IF_ERROR(check_contiguous(ws, "indexer workspace"));
  const int64_t have = ws.numel() * dtype_size(ws.dtype);
  M3_CHECK_ARG(have >= need, "indexer workspace holds ", have, " bytes, needs ", need,
               " (indexer_workspace_bytes(T ", p.batch.num_tokens, ", n_kv ", p.n_kv,
               ", max_pages ", p.batch.max_pages, "))");
  M3_CHECK_ARG(ws.data != nullptr && aligned16(ws.data),
               "indexer workspace must be 16-byte aligned, got address ", ws.data);
  const ByteRange w{reinterpret_cast<uintptr_t>(ws.data),
                    reinterpret_cast<uintptr_t>(ws.data) + static_cast<uintptr_t>(need)};
  const struct {
    const TensorView* t;
    const char* name;
  } others[] = {{&p.index_q, "index_q"},
                {&p.index_cache, "the index cache"},
                {&p.block_ids, "block_ids"},
                {&p.batch.query_start, "query_start"},
                {&p.batch.positions, "positions"},
                {&p.batch.seq_lens, "seq_lens"},
                {&p.batch.page_table, "page_table"}};
  for (const auto& o : others)
    M3_CHECK_ARG(!ranges_overlap(w, byte_range(*o.t)), "indexer workspace overlaps ", o.name);
  return Status::Ok();
}

int64_t pick_k_splits(int64_t units, int max_pages, int min_chunk, int sms) {
  const int64_t target = std::max<int64_t>(1, sms) * kTargetCtasPerSm;
  const int64_t max_useful = std::max<int64_t>(1, (max_pages + min_chunk - 1) / min_chunk);
  const int64_t k = (target + units - 1) / units;
  return std::clamp<int64_t>(k, 1, std::min<int64_t>(max_useful, 65535));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t scores_bytes_aligned(int64_t num_tokens, int n_kv, int max_pages) {
  return ceil_div(num_tokens * n_kv * max_pages * int64_t{sizeof(float)}, 16) * 16;
}

// The launch plan, from host-known values only (shapes, options, the SM count).
struct Plan {
  bool mma = false;
  bool fused = false;
  bool single = false;
  int64_t overflow = 0, units = 0;
  int64_t k_splits = 1;  // grid.y
  int64_t dec_chunk = 1;
  int64_t flat_ctas = 0;  // flat decode: decode CTAs (grid.x = overflow + flat_ctas, grid.y 1)
};

Plan make_plan(const IndexerParams& p, const IndexerCudaOptions& o, int sms) {
  Plan pl;
  pl.mma = tensor_core_path(p, o);
  const int64_t T = p.batch.num_tokens;
  const int max_pages = p.batch.max_pages;
  const int64_t pre_tokens = ik::kPreRows / p.n_kv;
  // No overflow tile where every token belongs to a decode unit (IndexerCudaOptions::
  // overflow_tiles_always): with T <= 32 / n_kv no request has tokens past its decode unit.
  const int64_t dec_tokens = ik::kDecRows / p.n_kv;
  pl.overflow = T <= dec_tokens && !o.overflow_tiles_always ? 0 : ceil_div(T, pre_tokens);
  pl.units = pl.overflow + p.batch.num_requests;
  if (max_pages <= kTopK) return pl;  // nothing is scored: the selection kernel alone
  const int min_chunk = pl.mma ? ik::kMmaWarps : 1;
  int64_t k = o.k_splits > 0 ? o.k_splits : pick_k_splits(pl.units, max_pages, min_chunk, sms);
  const auto round4 = [](int64_t v) { return ceil_div(v, ik::kMmaWarps) * ik::kMmaWarps; };
  const int64_t R = std::max(1, p.batch.num_requests);
  // Decode units of the tensor-core scorer: chunks of a multiple of 4 blocks (one per warp per
  // round) covering max_pages in k pieces. The automatic choice then drops the splits that would
  // start at or past max_pages.
  int64_t chunk = round4(ceil_div(max_pages, k));
  bool flat_rule = false;  // the automatic flat decode's range (see kFlatRuleChunk)
  if (pl.mma && o.k_splits == 0) {
    // Decode units want chunks of 16 blocks (256 KB of index-K per CTA), fewer when that leaves
    // SMs idle (small batches are latency bound); never more splits than the CTA target above
    // gives (grid.y is shared: prefill tiles of a mixed batch take the same, possibly smaller,
    // split count). Session 11 round 2 on the H200, two-kernel path, draft
    // 0: 64 x 8K 26.8 us with 16-block chunks vs 32.5 us with the 4-block chunks of the CTA
    // target alone (8 per SM); 256 x 8K 78.7 us either way (its target gives 16 already).
    int64_t dchunk = std::min<int64_t>(
        max_pages <= ik::kFusedMaxChunk ? kDecodeChunkShort : kDecodeChunk, round4(max_pages));
    // The many-verify range (kManyVerifyChunk): its chunk whatever the CTA target gives.
    const bool many_verify = max_pages <= ik::kFusedMaxChunk && T > R &&
                             T <= kSingleMaxTokensPerRequest * R && R > int64_t{sms};
    if (many_verify)
      dchunk = std::min<int64_t>(kManyVerifyChunk, round4(max_pages));
    else if (R * ceil_div(max_pages, dchunk) < sms)
      dchunk =
          std::clamp<int64_t>(round4(ceil_div(int64_t{max_pages} * R, sms)), ik::kMmaWarps, dchunk);
    else if (dchunk == kDecodeChunkShort &&
             R * ceil_div(max_pages, kFlatRuleChunk) <= kFusedCtasPerSm * sms)
      flat_rule = true;
    chunk = many_verify ? dchunk : std::max(chunk, dchunk);
    k = ceil_div(max_pages, chunk);
  }
  if (pl.mma && !o.unfused_decode && max_pages > kTopK && T > 0 &&
      (max_pages > kFusedAutoMinPages || o.fused_decode_always)) {
    // Fused: at most 64 blocks per split (the shared block-max table).
    int64_t fchunk = 0;
    if (o.k_splits > 0) {
      fchunk = round4(ceil_div(max_pages, k));
    } else {
      // Automatic: chunks of clamp(max_pages / 16, 16, 64) blocks, i.e. 256 KB to 1 MB of index-K
      // per CTA (round 2 on the H200: 16-block chunks were the best or within 1 % at 8K and 32K,
      // 64 at 128K, while 4-block chunks cost 10-25 % in per-CTA overheads); smaller, down to 4,
      // when that leaves fewer CTAs than SMs (small batches are latency bound). 64-block chunks
      // when they alone fill the SMs in one wave (session 11 round 2: 64 x 32K 75.9 us with 4
      // splits of 64 blocks vs 80.6 us with 16 of 16).
      fchunk = round4(std::clamp<int64_t>(ceil_div(max_pages, 16), 16, ik::kFusedMaxChunk));
      const int64_t ctas64 = R * ceil_div(max_pages, ik::kFusedMaxChunk);
      if (ctas64 >= sms && ctas64 <= kFusedCtasPerSm * sms) {
        fchunk = ik::kFusedMaxChunk;
        // Verify batches (2-4 tokens per request: twice to four times the MMA work per index-K
        // byte): the smallest chunk that still runs in one wave of at most kFusedCtasPerSm CTAs
        // per SM, i.e. more warps per SM to hide the longer per-tile chains, where that chunk is
        // >= 40 blocks. Session 15, 64 x 32K draft 3 (rounds C / D, three same-run A/Bs): 6 splits
        // of 44 blocks 80.9-81.2 / 79.0-79.2 us isolated / back to back vs 84.6-84.7 / 82.6-83.3
        // with 4 of 64 (5 of 52: 83.1 / 81.0; 8 of 32, two waves: 91.2 / 89.0); 40 x 32K draft 3
        // (round D): 8 splits of 32 blocks 59.2-59.4 / 57.0-57.1 vs 58.3 / 55.0 with 4 of 64,
        // hence the 40-block floor.
        if (T > R && T <= R * kSingleMaxTokensPerRequest) {
          const int64_t slots = kFusedCtasPerSm * sms;
          int64_t c = round4(ceil_div(int64_t{max_pages} * R, slots));
          while (c < ik::kFusedMaxChunk && R * ceil_div(max_pages, c) > slots) c += ik::kMmaWarps;
          if (c >= 40) fchunk = std::min<int64_t>(c, ik::kFusedMaxChunk);
        }
      }
      if (R * ceil_div(max_pages, fchunk) < sms) {
        // Below one CTA per SM: one CTA per SM, or for one request without overflow tiles about
        // kFusedSmallCtasPerSm (IndexerCudaOptions::fused_small_ctas_per_sm).
        const int64_t per_sm = o.fused_small_ctas_per_sm > 0 ? o.fused_small_ctas_per_sm
                               : R == 1 && pl.overflow == 0  ? kFusedSmallCtasPerSm
                                                             : 1;
        fchunk = std::clamp<int64_t>(round4(ceil_div(int64_t{max_pages} * R, per_sm * sms)),
                                     ik::kMmaWarps, fchunk);
      }
    }
    fchunk = std::min<int64_t>(fchunk, ik::kFusedMaxChunk);
    const int64_t need = ceil_div(max_pages, fchunk);
    if (need <= 65535) {
      pl.fused = true;
      k = need;
      chunk = fchunk;
    }
  }
  // Single pass: forced by the option, or automatic where it measured fastest (isolated / back to
  // back, vs the two-kernel path; <= 64 blocks), with sms / R CTAs per request (about one CTA per
  // SM) as a thread-block cluster where that is > 1:
  //  - one token per request from 1/17 request per SM (8-CTA clusters below 1/8: session 25,
  //    see below; session 13 round B, 8K draft 0: 32 requests
  //    4 CTAs 16.7 / 14.4 us vs 18.1 / 15.4; 64: 2 CTAs 23.8 / 21.8 vs 25.6 / 23.3; 96: 31.7 vs
  //    33.6; 128: 1 CTA 38.0 vs 43.4; 256: 68.1 vs 74.1; batch 1 ties at 8 CTAs: 9.5 us);
  //  - 2-4 tokens per request at 0.7-1 requests per SM (3-4 tokens: to 0.95 since session 25),
  //    2 CTAs per request (round B, draft 3: 96 requests 35.7 / 34.1 vs 40.1 / 38.3; 128: 42.6 /
  //    40.9 vs 45.1 / 43.4; round C: 36.0 vs
  //    40.4, 43.3 vs 46.0), and from 1.9 requests per SM, 4 CTAs (256 requests, rounds B / C: 76.6
  //    / 77.1 vs 77.4 / 78.5 us; since session 24 the two-kernel path in 12-block splits there,
  //    since session 25 above one request per SM: see kManyVerifyChunk); the two-kernel path
  //    stays at 64 requests (27.9 vs 29.3 us with 3 CTAs).
  const int64_t R_all = std::max(1, p.batch.num_requests);
  int64_t rule_ctas = 0;  // CTAs per request of the automatic single pass; 0: not automatic
  if (T <= R_all) {
    if (8 * R_all >= sms) rule_ctas = std::clamp<int64_t>(sms / R_all, 1, kMaxClusterCtas);
    // Below 1/8 request per SM, from 1/17: 8-CTA clusters (since session 25, where the other
    // CTAs no longer meet rank 0 at a final cluster barrier: cluster_async_maxima). Round G, 8K
    // b2b: 8 requests 6.9 / 6.9 us vs 7.2 / 7.2 for the two-kernel path (16 splits of 4 blocks;
    // isolated 9.6 / 9.5 vs 10.0 / 10.0); 16 requests 9.2 / 9.2 vs 9.2 / 9.2 (8 of 8); batch 1
    // stays two-kernel (6.3 vs 5.2-5.3).
    else if (17 * R_all >= sms)
      rule_ctas = kMaxClusterCtas;
  } else if (T <= R_all * kSingleMaxTokensPerRequest) {
    // From 0.95 requests per SM at more than 2 tokens per request: the two-kernel path (3 splits
    // of 24 blocks). Session 25, 8K b2b, vs the 2-CTA single pass: 128 requests draft 3 39.0 /
    // 39.0 us vs 39.8 / 40.0 (round A), 38.5 / 38.3 vs 39.1 / 39.3 (round C), draft 2 38.6 / 38.5
    // vs 39.1 / 39.0 (round B); a tie below: 120 draft 3 37.9 / 37.8 vs 37.8 / 37.5 (C), 112 draft
    // 3 36.5 / 36.2 vs 36.7 / 36.6 (B), draft 2 35.9 / 35.6 vs 36.1 / 35.7 (C); the single pass
    // ahead at 96 draft 3 (32.5 / 32.5 vs 32.9 / 32.9) and 128 draft 1 (37.0 / 37.0 vs 37.9 /
    // 37.7, round A).
    const bool verify_two_kernel = T > 2 * R_all && 20 * R_all >= 19 * int64_t{sms};
    if (10 * R_all >= 7 * int64_t{sms} && R_all <= sms && !verify_two_kernel) rule_ctas = 2;
  }
  const bool auto_single = o.k_splits == 0 && !o.fused_decode_always && rule_ctas > 0;
  if (pl.mma && (o.single_pass || auto_single) && !o.unfused_decode && T > 0 &&
      max_pages <= ik::kFusedMaxChunk) {
    // One split of every block (max_pages > kTopK here), or a cluster of up to
    // single_pass_ctas splits: the scorer finishes the rows.
    pl.fused = pl.single = true;
    const int64_t ctas = o.single_pass_ctas > 0
                             ? std::min<int64_t>(o.single_pass_ctas, kMaxClusterCtas)
                             : std::max<int64_t>(rule_ctas, 1);
    chunk = round4(ceil_div(max_pages, ctas));
    k = ceil_div(max_pages, chunk);
  }
  pl.k_splits = k;
  pl.dec_chunk = chunk;
  // Flat decode (IndexerCudaOptions::flat_decode): the two-kernel path over flat_decode x SMs
  // CTAs of balanced block ranges, where every request gets at least one warp; automatic in the
  // range of kFlatRuleChunk where the plan is still the two-kernel path: two CTAs per SM at more
  // than 3 and up to 4 tokens per request (4: the measured case), else one. Session 23, 64 x 8K
  // draft 3, same-run A/Bs, back to back: two CTAs per SM (and select_short_resident_kernel
  // beside them) 23.0 / 23.1 / 23.1 us vs 23.3 / 23.2 / 23.3 for one (round H; isolated
  // 25.4-25.5 vs 25.5-25.8), three 25.3-25.5; with the 45-register selection (half of its CTAs
  // entering only as scorer CTAs exit) two lost, 24.4-24.6 vs 23.6-23.7 (round G). Timelines:
  // scorer's last warp 20.5 vs 21.2 us, rows written by 23.3 vs 24.1 (rounds H / F). Other token
  // counts not measured at two CTAs per SM.
  // Session 24 (64 x 8K draft 3, same-round A/B, back to back), lost and deleted: every request
  // on the same number of warps, the largest divisor of max_pages within the CTA budget (16 warps
  // of exactly 4 blocks in 256 CTAs instead of 16-17 warps of 3-4 blocks in 264): 22.3 / 22.3 /
  // 22.3 us vs 22.2 / 22.4 / 22.4 (round F). Timelines (b2b): a CTA's warps ended 0.86 us apart
  // at the median instead of 1.44, but the CTAs' last blocks no earlier (CTA ends p50 18.56 /
  // max 20.42 vs 17.39 / 18.70): every SM then holds 32 blocks, the most any SM holds anyway.
  // Session 24 (64 x 8K draft 3), lost and deleted: the flat scorer launched as a cooperative
  // grid (every CTA resident) whose CTAs met at a grid barrier on a caller-zeroed word once every
  // block score was written (the CTAs' adds summing to 2^31, so that each call flips the top bit
  // and leaves the low bits zero), then selected every row themselves (one warp per row, strict
  // counts): no selection kernel. 27.0 / 26.8 / 27.0 us isolated, 24.9 / 24.9 / 24.8 back to back
  // vs 25.3-25.7 / 22.9-23.1 (round B, three alternating runs). Timeline (cold call): scorer's
  // last warp 19.47 us, barrier passed 20.41-21.01 (the last CTA's fence and atomic, then the
  // pollers' loads: ~1 us, more than the selection kernel's dependency release, 0.76-0.82), rows
  // done p50 21.96 / max 22.37; yet the call took 30.5 us vs 28.0-28.7: the cooperative launch
  // costs ~2 us outside the kernel.
  const bool flat_auto =
      o.flat_decode == 0 && flat_rule && !o.unfused_decode && !pl.fused && !pl.single;
  const int64_t flat_auto_per_sm = T > 3 * R && T <= kSingleMaxTokensPerRequest * R ? 2 : 1;
  const int64_t flat_per_sm =
      o.flat_decode > 0 ? o.flat_decode : (flat_auto ? flat_auto_per_sm : 0);
  if (pl.mma && flat_per_sm > 0 && T > 0) {
    const int64_t ctas = flat_per_sm * sms;
    if (ctas * ik::kMmaWarps >= R) {
      pl.fused = pl.single = false;
      pl.flat_ctas = ctas;
      pl.units = pl.overflow + ctas;
      pl.k_splits = 1;
      pl.dec_chunk = max_pages;
    }
  }
  return pl;
}

// Dynamic shared memory to request for a scorer grid of `ctas` CTAs that each need `smem` bytes,
// launched programmatically: at most ceil(ctas / sms) of them fit on one SM. A programmatic grid
// is placed while the previous kernel's CTAs still occupy SMs, and the CTA scheduler then stacks
// CTAs on the SMs it finds emptiest (session 14 round B, indexer_bench --pdl behind a 64-CTA
// stand-in: 64 x 8K 31.1 us programmatic vs 27.7 normal, 256 x 8K 78.1 vs 73.4: the clusters
// sharing SMs while others idle); the extra bytes are never touched. Unchanged when the natural
// occupancy (kFusedCtasPerSm) is the bound anyway.
Status pdl_smem_bytes(size_t smem, int64_t ctas, int sms, int dev, size_t* out) {
  *out = smem;
  const int64_t per_sm = ceil_div(ctas, std::max(sms, 1));
  if (per_sm >= kFusedCtasPerSm) return Status::Ok();
  int sm_bytes = 0, reserved = 0, optin = 0;
  M3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sm_bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  M3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
  M3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  // per_sm + 1 CTAs of `want` (+ the per-CTA reserve) exceed the SM's shared memory.
  const int64_t want = ceil_div(int64_t{sm_bytes} / (per_sm + 1) - reserved + 16, 16) * 16;
  *out = static_cast<size_t>(std::clamp<int64_t>(want, static_cast<int64_t>(smem), optin));
  return Status::Ok();
}

int sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return 1;
  return sms;
}

}  // namespace

size_t indexer_workspace_bytes(int64_t num_tokens, int n_kv, int max_pages) {
  if (num_tokens <= 0 || n_kv <= 0 || max_pages <= 0) return 0;
  return static_cast<size_t>(scores_bytes_aligned(num_tokens, n_kv, max_pages));
}

bool indexer_cuda_uses_tensor_cores(const IndexerParams& p, const IndexerCudaOptions& options) {
  return tensor_core_path(p, options);
}

IndexerCudaPlan indexer_cuda_plan(const IndexerParams& p, const IndexerCudaOptions& options) {
  IndexerCudaPlan info;
  if (p.n_kv <= 0 || p.batch.num_tokens <= 0 || p.batch.max_pages <= 0) return info;
  const Plan pl = make_plan(p, options, sm_count());
  info.tensor_cores = pl.mma;
  info.fused = pl.fused;
  info.k_splits = static_cast<int>(pl.k_splits);
  info.dec_chunk = static_cast<int>(pl.dec_chunk);
  info.single = pl.single;
  info.flat_ctas = static_cast<int>(pl.flat_ctas);
  info.overflow_tiles = static_cast<int>(pl.overflow);
  return info;
}

bool indexer_cuda_uses_fused_decode(const IndexerParams& p, const IndexerCudaOptions& options) {
  return indexer_cuda_plan(p, options).fused;
}

Status run_indexer_cuda(const IndexerParams& p, const TensorView& workspace, cudaStream_t stream,
                        const IndexerCudaOptions& options) {
  M3_RETURN_IF_ERROR(validate_indexer(p));
  // validate_indexer puts every view on one device; it must be the current CUDA device.
  const Device dev = p.index_q.device;
  M3_CHECK_ARG(dev.type == DeviceType::kCUDA, "run_indexer_cuda needs CUDA tensors, got ",
               dev.to_string());
  int current = -1;
  M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  M3_CHECK_ARG(dev.index == current, "run_indexer_cuda: tensors are on ", dev.to_string(),
               " but the current CUDA device is cuda:", current);
  if (p.n_kv > ik::kMaxKv)
    return unsupported("run_indexer_cuda: n_kv ", p.n_kv, " exceeds the kernels' limit of ",
                       ik::kMaxKv, " index heads");
  M3_CHECK_ARG(options.k_splits >= 0 && options.k_splits <= 65535, "run_indexer_cuda: k_splits ",
               options.k_splits, " is outside [0, 65535]");
  M3_CHECK_ARG(options.flat_decode >= -1 && options.flat_decode <= kFusedCtasPerSm,
               "run_indexer_cuda: flat_decode ", options.flat_decode, " is outside [-1, ",
               kFusedCtasPerSm, "]");
  M3_CHECK_ARG(options.short_select_warps == 0 || options.short_select_warps == 2 ||
                   options.short_select_warps == 4,
               "run_indexer_cuda: short_select_warps ", options.short_select_warps,
               " is not 0, 2 or 4");
  M3_CHECK_ARG(options.fused_small_ctas_per_sm >= 0 && options.fused_small_ctas_per_sm <= 3,
               "run_indexer_cuda: fused_small_ctas_per_sm ", options.fused_small_ctas_per_sm,
               " is outside [0, 3]");
  M3_CHECK_ARG(options.wide_select == -1 || options.wide_select == 0 || options.wide_select == 4 ||
                   options.wide_select == 8 || options.wide_select == 16,
               "run_indexer_cuda: wide_select ", options.wide_select, " is not -1, 0, 4, 8 or 16");
  M3_CHECK_ARG(options.single_pass_ctas >= 0 && options.single_pass_ctas <= kMaxClusterCtas,
               "run_indexer_cuda: single_pass_ctas ", options.single_pass_ctas, " is outside [0, ",
               kMaxClusterCtas, "]");
  M3_CHECK_ARG(options.pdl_prefetch_blocks >= -1 &&
                   options.pdl_prefetch_blocks <= kPdlPrefetchMaxBlocks,
               "run_indexer_cuda: pdl_prefetch_blocks ", options.pdl_prefetch_blocks,
               " is outside [-1, ", kPdlPrefetchMaxBlocks, "]");
  M3_CHECK_ARG(options.stream_evict_first >= -1 && options.stream_evict_first <= 1,
               "run_indexer_cuda: stream_evict_first ", options.stream_evict_first,
               " is outside [-1, 1]");

  const int64_t T = p.batch.num_tokens;
  const int64_t R = p.batch.num_requests;
  const int max_pages = p.batch.max_pages;
  // The kernels add up to kPreRows to token indices in 32 bits.
  M3_CHECK_ARG(T <= std::numeric_limits<int32_t>::max() - ik::kPreRows,
               "run_indexer_cuda: token count ", T, " exceeds the kernels' limit of ",
               std::numeric_limits<int32_t>::max() - ik::kPreRows);
  M3_CHECK_ARG(T == 0 || R > 0, "run_indexer_cuda: ", T,
               " query tokens but no request owns them (num_requests 0)");
  const int64_t need = static_cast<int64_t>(indexer_workspace_bytes(T, p.n_kv, max_pages));
  M3_RETURN_IF_ERROR(check_workspace(p, workspace, need));
  if (T == 0) return Status::Ok();

  int sms = 0;
  M3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, current));
  const Plan pl = make_plan(p, options, sms);
  ik::KernelArgs a;
  a.iq = p.index_q.ptr<const uint8_t>();
  a.cache = p.index_cache.ptr<const uint8_t>();
  a.page_stride = p.index_cache.stride[0];
  a.num_pages = p.index_cache.shape[0];
  a.query_start = p.batch.query_start.ptr<const int32_t>();
  a.positions = p.batch.positions.ptr<const int32_t>();
  a.seq_lens = p.batch.seq_lens.ptr<const int32_t>();
  a.page_table = p.batch.page_table.ptr<const int32_t>();
  a.pt_stride = p.batch.page_table.stride[0];
  a.num_tokens = static_cast<int>(T);
  a.num_requests = static_cast<int>(R);
  a.n_kv = p.n_kv;
  a.max_pages = max_pages;
  a.dec_tokens = ik::kDecRows / p.n_kv;
  a.pre_tokens = ik::kPreRows / p.n_kv;
  M3_CHECK_ARG(pl.units <= std::numeric_limits<int32_t>::max(), "run_indexer_cuda: ", pl.units,
               " work units exceed the grid limit");
  a.num_overflow = static_cast<int>(pl.overflow);
  a.flat_warps = static_cast<int>(pl.flat_ctas * ik::kMmaWarps);
  // Flat decode's assignment in 32-bit divisions where (v + 1) R, (r + 1) W and (v - lo + 1)
  // max_pages stay below 2^32 (v < W, R <= W, v - lo < n <= W; decode_path).
  const int64_t flat_bound = std::max<int64_t>({R, int64_t{max_pages}, int64_t{a.flat_warps}});
  a.flat_div32 = int64_t{a.flat_warps} * flat_bound < (int64_t{1} << 32) ? 1 : 0;
  a.min_chunk = pl.mma ? ik::kMmaWarps : 1;
  a.k_splits = static_cast<int>(pl.k_splits);
  a.dec_chunk = static_cast<int>(pl.dec_chunk);
  a.scores = static_cast<float*>(workspace.data);
  a.block_ids = p.block_ids.ptr<int32_t>();
  a.pdl = options.programmatic_launch ? 1 : 0;
  if (options.programmatic_launch && pl.mma && options.pdl_prefetch_blocks >= 0) {
    int prefetch = options.pdl_prefetch_blocks;
    if (prefetch == 0) {
      // Automatic: a quarter of the L2 over every decode warp, whole pages, at most 8 per warp.
      int l2 = 0;
      M3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, current));
      const int64_t warps = (pl.flat_ctas > 0 ? pl.flat_ctas : R * pl.k_splits) * ik::kMmaWarps;
      prefetch = static_cast<int>(
          std::min<int64_t>(kPdlPrefetchMaxBlocks, int64_t{l2} / 4 / (warps * ik::kPageBytes)));
    }
    a.pdl_prefetch = prefetch;
  }
  // The guess only where it measured faster: one token per request (session 14 round B, 64 x 8K
  // draft 0: 23.1 / 22.9 vs 23.7 / 23.6 us without; 256 x 8K draft 3, 4-CTA clusters: 79.0 / 78.9
  // vs 76.8 / 76.5 us without).
  a.guess = options.guess_request_bounds && T <= R ? 1 : 0;
  a.early = options.early_query_loads && !pl.single ? 1 : 0;
  a.fast_select = options.fast_select ? 1 : 0;
  a.timeline = options.timeline;
  a.evict_fraction = options.stream_evict_first >= 0 ? 1.0f : 0.0f;  // automatic: every plan
  a.async_maxima = options.cluster_async_maxima ? 1 : 0;
  const bool pdl = options.programmatic_launch;
  const int64_t rows = T * p.n_kv;
  const int64_t select_blocks = ceil_div(rows, ik::kSelectWarps);
  M3_CHECK_ARG(select_blocks <= std::numeric_limits<int32_t>::max(), "run_indexer_cuda: ", rows,
               " selection rows exceed the grid limit");

  // Tokens see at most max_pages blocks; with <= 16 every visible block is selected and no score
  // is read, so the scoring kernel is skipped.
  if (max_pages > kTopK) {
    const dim3 grid(static_cast<unsigned>(pl.units), static_cast<unsigned>(pl.k_splits));
    const int64_t ctas = pl.units * pl.k_splits;
    // Dynamic shared memory of a tensor-core scorer launch (programmatic: see pdl_smem_bytes).
    // The kernel's opt-in limit (a function attribute, not a stream operation: fine under graph
    // capture) is always the one-CTA-per-SM size, the largest any call requests, so that a graph
    // captured by an earlier call stays launchable whatever a later call sets.
    const auto prepare = [&](auto kernel, size_t need, size_t* launch_bytes) -> Status {
      size_t cap = 0;
      M3_RETURN_IF_ERROR(pdl_smem_bytes(need, 1, sms, current, &cap));
      *launch_bytes = need;
      if (pdl) M3_RETURN_IF_ERROR(pdl_smem_bytes(need, ctas, sms, current, launch_bytes));
      M3_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cap)));
      return Status::Ok();
    };
    if (pl.single && pl.k_splits > 1) {
      // Clustered single pass: clusters of the k_splits (<= 8) CTAs of one grid.x index.
      const auto ckernel = ik::score_fused_cluster_kernel;
      size_t csmem = 0;
      M3_RETURN_IF_ERROR(prepare(ckernel, ik::kClusterSmemBytes, &csmem));
      cudaLaunchConfig_t ccfg = {};
      ccfg.gridDim = grid;
      ccfg.blockDim = dim3(ik::kMmaThreads);
      ccfg.dynamicSmemBytes = csmem;
      ccfg.stream = stream;
      cudaLaunchAttribute cattr[2];
      cattr[0].id = cudaLaunchAttributeClusterDimension;
      cattr[0].val.clusterDim.x = 1;
      cattr[0].val.clusterDim.y = static_cast<unsigned>(pl.k_splits);
      cattr[0].val.clusterDim.z = 1;
      cattr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      cattr[1].val.programmaticStreamSerializationAllowed = 1;
      ccfg.attrs = cattr;
      ccfg.numAttrs = pdl ? 2 : 1;
      M3_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&ccfg, ckernel, a));
      M3_CUDA_CHECK_LAUNCH();
      return Status::Ok();
    }
    if (pl.fused) {
      // 72 KB of dynamic shared memory: opt in.
      const auto kernel = pl.single ? ik::score_fused_single_kernel : ik::score_fused_kernel;
      size_t fsmem = 0;
      M3_RETURN_IF_ERROR(prepare(kernel, ik::kFusedSmemBytes, &fsmem));
      M3_CUDA_RETURN_IF_ERROR(
          launch_pdl(kernel, grid, dim3(ik::kMmaThreads), fsmem, stream, pdl, a));
    } else if (pl.mma) {
      // 64 KB of dynamic shared memory plus the kernel's static bytes pass the default 48 KB
      // limit: opt in.
      size_t msmem = 0;
      M3_RETURN_IF_ERROR(prepare(ik::score_mma_kernel, ik::kMmaSmemBytes, &msmem));
      M3_CUDA_RETURN_IF_ERROR(
          launch_pdl(ik::score_mma_kernel, grid, dim3(ik::kMmaThreads), msmem, stream, pdl, a));
    } else {
      M3_CUDA_RETURN_IF_ERROR(
          launch_pdl(ik::score_simple_kernel, grid, dim3(ik::kSimpleThreads), 0, stream, pdl, a));
    }
    M3_CUDA_CHECK_LAUNCH();
    if (pl.single) return Status::Ok();  // the scorer wrote every row
  }
  // Programmatic dependent launch: the selection grid may be scheduled while the scorer's last
  // CTAs run (saving the launch gap); it executes pdl_wait before touching the scorer's outputs,
  // which waits for the scorer to complete and flush. Graph-capturable (the capture records a
  // programmatic edge). Without a scorer only with programmatic_launch: the selection kernels
  // load the positions before the dependency wait, which is safe only when the preceding grid
  // does not write them.
  const bool select_pdl = max_pages > kTopK || pdl;
  if (options.short_select && max_pages <= ik::kCountRow &&
      rows <= kShortSelectMaxRowsPerSm * sms) {
    // Rows of at most 63 candidates, short_select_warps warps per row.
    const int w = options.short_select_warps > 0 ? options.short_select_warps
                                                 : (rows >= sms ? 2 : 4);
    // Beside flat decode at 2 or more CTAs per SM, the register-capped form.
    const bool resident = pl.flat_ctas > sms;
    const auto kernel = w == 2 ? (resident ? ik::select_short_resident_kernel<2>
                                           : ik::select_short_kernel<2>)
                               : (resident ? ik::select_short_resident_kernel<4>
                                           : ik::select_short_kernel<4>);
    const dim3 short_grid(static_cast<unsigned>(ceil_div(rows, ik::kSelectWarps / w)));
    M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, short_grid, dim3(ik::kSelectThreads), 0, stream,
                                       select_pdl, a));
    M3_CUDA_CHECK_LAUNCH();
    return Status::Ok();
  }
  const int wide = options.wide_select != 0 ? options.wide_select
                                            : (rows <= kWideSelectMaxRows ? kWideSelectWarps : -1);
  if (wide > 0 && max_pages > ik::kCountRow && rows <= std::numeric_limits<int32_t>::max()) {
    // Rows of up to max_pages - 1 candidates, one CTA of `wide` warps per row.
    const auto kernel = wide == 4   ? ik::select_wide_kernel<4>
                        : wide == 8 ? ik::select_wide_kernel<8>
                                    : ik::select_wide_kernel<16>;
    M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, dim3(static_cast<unsigned>(rows)),
                                       dim3(static_cast<unsigned>(wide * 32)), 0, stream,
                                       select_pdl, a));
    M3_CUDA_CHECK_LAUNCH();
    return Status::Ok();
  }
  const dim3 select_grid(static_cast<unsigned>(select_blocks));
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(ik::select_kernel, select_grid, dim3(ik::kSelectThreads), 0,
                                     stream, select_pdl, a));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace m3attn
