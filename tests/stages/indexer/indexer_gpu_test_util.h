// Helpers of the CUDA indexer GPU tests (indexer_gpu_test.cu, indexer_paths_gpu_test.cu): inputs,
// the twin's reference, device buffers with guards, and the comparisons against the CPU twin, on
// identical E4M3 inputs.
//
// Every run checks three things, row by row (token, head):
//   1. Scores: the GPU block scores (read back from the workspace) against the twin's. The
//      CUDA-core scorer accumulates in fp64 and must be bit-identical. The tensor-core scorer
//      converts E4M3 to f16 exactly and accumulates the 16-product chunks of mma.m16n8k16 in fp32:
//      products are exact, each of the 8 chunk sums aligns and rounds 17 terms at fp32 precision,
//      so |gpu - twin| <= 8 * 17 * 2^-23 * L1 < 2^-15 * L1 with L1 = sum_d |q_d| max_p |k_p,d|
//      (a bound of sum_d |q_d k_d| over every visible key). The largest observed error / L1 is
//      printed. Integer-valued inputs make every partial sum exact: bit-identical there too.
//   2. Selection: the GPU ids equal select_blocks_ref applied to the GPU's own scores (the select
//      kernel is exact: ties to the smaller id, NaN never chosen, local block forced).
//   3. Against the twin's ids: identical wherever the scores are exact, and wherever the twin's
//      15th and 16th best non-local blocks (the selection boundary) are further apart than twice
//      the score bound. Closer pairs are near ties: the GPU may pick either side, and the row
//      must pass verify_block_selection with that tolerance. Near ties are counted and printed.
// Outputs are poisoned before each run; guard bytes around the outputs and the workspace must
// stay identical; the index pool (read-only) is checked unchanged.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/indexer/indexer.h"
#include "support/batch_builder.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn::indexer_gpu_test {

namespace mt = m3attn::testing;
using mt::BatchOptions;
using mt::CacheFill;
using mt::HostBatch;
using mt::RequestSpec;
using mt::Rng;

constexpr size_t kGuard = 256;  // bytes before and after the outputs and the workspace
constexpr uint8_t kIdsPoison = 0x5a;
constexpr uint8_t kWsPoison = 0xc3;
constexpr uint8_t kGuardByte = 0x3c;
inline const float kScoreBoundFactor =
    std::ldexp(1.0f, -15);  // per-score error bound / L1 (f16 MMA)

// ---------------------------------------------------------------------------------------------
// Inputs and the twin's reference.

struct Inputs {
  HostBatch hb;  // built with n_kv 1: only its index pool and batch tensors are used
  int n_kv = 0;
  Tensor iq;  // e4m3 [T, n_kv, 128]
  bool integer = false;

  int64_t T() const { return hb.num_tokens(); }
  int max_pages() const { return hb.max_pages(); }
  int64_t rows() const { return T() * n_kv; }
};

inline Inputs make_inputs(const std::vector<RequestSpec>& reqs, int n_kv, Rng& rng,
                          bool integer = false, int64_t index_page_stride = 0, int extra_cols = 1) {
  Inputs in;
  BatchOptions o;
  o.n_kv = 1;  // the main KV pool is not read by the indexer: keep it small
  o.index_page_stride = index_page_stride;
  o.extra_table_cols = extra_cols;
  o.fill = integer ? CacheFill::kIntegers : CacheFill::kNormal;
  o.int_lo = -3;
  o.int_hi = 3;
  in.hb = mt::build_batch(reqs, o, rng);
  in.n_kv = n_kv;
  in.integer = integer;
  in.iq = Tensor(DType::kE4M3, {in.hb.num_tokens(), n_kv, kHeadDim});
  if (integer)
    mt::fill_e4m3_integers(in.iq, rng, -3, 3);
  else
    mt::fill_e4m3_normal(in.iq, rng);
  return in;
}

inline IndexerParams host_params(const Inputs& in, Tensor& ids) {
  IndexerParams p;
  p.n_kv = in.n_kv;
  p.top_k = kTopK;
  p.index_q = in.iq.view();
  p.index_cache = in.hb.index_cache();
  p.batch = in.hb.batch_view();
  ids = Tensor(DType::kI32, {in.T(), in.n_kv, kTopK});
  p.block_ids = ids.view();
  return p;
}

struct Reference {
  std::vector<float> scores;  // [rows, max_pages]: twin B(t, h, b), -inf beyond n_valid
  std::vector<int32_t> ids;   // [rows, 16]
  std::vector<float> l1;      // [rows]: sum_d |q_d| max_p |k_p,d| over the request's keys
};

inline Reference reference(const Inputs& in) {
  Reference ref;
  const int64_t rows = in.rows();
  const int mp = std::max(1, in.max_pages());
  ref.scores.assign(static_cast<size_t>(rows * mp), 0.0f);
  ref.ids.assign(static_cast<size_t>(rows * kTopK), -1);
  ref.l1.assign(static_cast<size_t>(rows), 0.0f);
  if (rows == 0) return ref;
  Tensor ids;
  const IndexerParams p = host_params(in, ids);
  const TensorView sv =
      TensorView::contiguous(ref.scores.data(), DType::kF32, {in.T(), int64_t{in.n_kv}, mp});
  const Status st = indexer_block_scores_cpu(p, sv);
  EXPECT_TRUE(st.ok()) << st.to_string();
  for (int64_t row = 0; row < rows; ++row) {
    const int n_valid = in.hb.position_of(row / in.n_kv) / kPageSize + 1;
    select_blocks_ref(ref.scores.data() + row * mp, n_valid, ref.ids.data() + row * kTopK);
  }
  // L1 bound per row: per request, the largest |k_d| over its visible keys.
  std::vector<float> kmax(kHeadDim);
  for (int r = 0; r < in.hb.num_requests(); ++r) {
    std::fill(kmax.begin(), kmax.end(), 0.0f);
    for (int pos = 0; pos < in.hb.seq_len(r); ++pos) {
      const uint8_t* k = in.hb.index_row(r, pos);
      for (int d = 0; d < kHeadDim; ++d)
        kmax[d] = std::max(kmax[d], std::fabs(e4m3_to_float(k[d])));
    }
    for (int64_t t = 0; t < in.T(); ++t) {
      if (in.hb.request_of(t) != r) continue;
      for (int h = 0; h < in.n_kv; ++h) {
        const uint8_t* q = in.iq.ptr<uint8_t>() + (t * in.n_kv + h) * kHeadDim;
        double s = 0.0;
        for (int d = 0; d < kHeadDim; ++d) s += std::fabs(e4m3_to_float(q[d])) * kmax[d];
        ref.l1[static_cast<size_t>(t * in.n_kv + h)] = static_cast<float>(s);
      }
    }
  }
  return ref;
}

// ---------------------------------------------------------------------------------------------
// Device copies and runs.

struct DeviceSet {
  mt::DeviceBuffer pool, qs, pos, lens, table, iq, ids, ws;
  int64_t pool_offset = 0;
  size_t ids_bytes = 0, ws_bytes = 0;
  IndexerParams params;
  TensorView workspace;
};

// Uploads everything; the index pool lands `pool_offset` bytes into its buffer (a multiple of 4;
// not 16 makes the cache base unaligned).
inline void upload(const Inputs& in, DeviceSet& d, int64_t pool_offset = 0) {
  const HostBatch& hb = in.hb;
  d.pool_offset = pool_offset;
  d.pool = mt::DeviceBuffer(static_cast<size_t>(hb.index_pool.nbytes() + pool_offset), 0x7f);
  d.pool.upload(hb.index_pool.data(), static_cast<size_t>(hb.index_pool.nbytes()),
                static_cast<size_t>(pool_offset));
  d.qs = mt::DeviceBuffer(static_cast<size_t>(hb.query_start.nbytes()));
  d.qs.upload(hb.query_start.data(), d.qs.bytes());
  d.pos = mt::DeviceBuffer(static_cast<size_t>(std::max<int64_t>(4, hb.positions.nbytes())));
  d.pos.upload(hb.positions.data(), static_cast<size_t>(hb.positions.nbytes()));
  d.lens = mt::DeviceBuffer(static_cast<size_t>(std::max<int64_t>(4, hb.seq_lens.nbytes())));
  d.lens.upload(hb.seq_lens.data(), static_cast<size_t>(hb.seq_lens.nbytes()));
  d.table = mt::DeviceBuffer(static_cast<size_t>(std::max<int64_t>(4, hb.page_table.nbytes())));
  d.table.upload(hb.page_table.data(), static_cast<size_t>(hb.page_table.nbytes()));
  d.iq = mt::DeviceBuffer(static_cast<size_t>(std::max<int64_t>(16, in.iq.nbytes())));
  d.iq.upload(in.iq.data(), static_cast<size_t>(in.iq.nbytes()));
  d.ids_bytes = static_cast<size_t>(in.rows() * kTopK * 4);
  d.ids = mt::DeviceBuffer(d.ids_bytes + 2 * kGuard, kGuardByte);
  d.ws_bytes = indexer_workspace_bytes(in.T(), in.n_kv, in.max_pages());
  d.ws = mt::DeviceBuffer(d.ws_bytes + 2 * kGuard, kGuardByte);

  const Device cuda = Device::cuda(0);
  IndexerParams& p = d.params;
  p.n_kv = in.n_kv;
  p.top_k = kTopK;
  p.index_q = mt::device_view_like(in.iq.view(), d.iq.data());
  p.index_cache = hb.index_view_at(static_cast<uint8_t*>(d.pool.data()) + pool_offset, cuda);
  p.batch = hb.batch_view_at(d.qs.data(), d.pos.data(), d.lens.data(), d.table.data(), cuda);
  p.block_ids = TensorView::contiguous(static_cast<uint8_t*>(d.ids.data()) + kGuard, DType::kI32,
                                       {in.T(), int64_t{in.n_kv}, int64_t{kTopK}}, cuda);
  d.workspace = TensorView::contiguous(static_cast<uint8_t*>(d.ws.data()) + kGuard, DType::kF32,
                                       {static_cast<int64_t>(d.ws_bytes / 4)}, cuda);
}

// Overwrites the inputs of `d` in place with those of `in` (same shapes: CUDA-graph replays).
inline void reupload(const Inputs& in, DeviceSet& d) {
  const HostBatch& hb = in.hb;
  ASSERT_EQ(static_cast<size_t>(hb.index_pool.nbytes() + d.pool_offset), d.pool.bytes());
  d.pool.upload(hb.index_pool.data(), static_cast<size_t>(hb.index_pool.nbytes()),
                static_cast<size_t>(d.pool_offset));
  d.qs.upload(hb.query_start.data(), static_cast<size_t>(hb.query_start.nbytes()));
  d.pos.upload(hb.positions.data(), static_cast<size_t>(hb.positions.nbytes()));
  d.lens.upload(hb.seq_lens.data(), static_cast<size_t>(hb.seq_lens.nbytes()));
  d.table.upload(hb.page_table.data(), static_cast<size_t>(hb.page_table.nbytes()));
  d.iq.upload(in.iq.data(), static_cast<size_t>(in.iq.nbytes()));
}

inline void poison_outputs(DeviceSet& d) {
  std::vector<uint8_t> ids(d.ids_bytes + 2 * kGuard, kGuardByte);
  std::fill(ids.begin() + kGuard, ids.begin() + kGuard + static_cast<long>(d.ids_bytes),
            kIdsPoison);
  d.ids.upload(ids.data(), ids.size());
  std::vector<uint8_t> ws(d.ws_bytes + 2 * kGuard, kGuardByte);
  std::fill(ws.begin() + kGuard, ws.begin() + kGuard + static_cast<long>(d.ws_bytes), kWsPoison);
  d.ws.upload(ws.data(), ws.size());
}

struct GpuResult {
  std::vector<int32_t> ids;
  std::vector<float> scores;
};

inline bool guards_intact(const std::vector<uint8_t>& all, size_t body) {
  for (size_t i = 0; i < kGuard; ++i)
    if (all[i] != kGuardByte || all[kGuard + body + i] != kGuardByte) return false;
  return true;
}

inline GpuResult download(const DeviceSet& d) {
  GpuResult g;
  const std::vector<uint8_t> ids = d.ids.download_all();
  EXPECT_TRUE(guards_intact(ids, d.ids_bytes)) << "block_ids guard bytes changed";
  g.ids.resize(d.ids_bytes / 4);
  std::memcpy(g.ids.data(), ids.data() + kGuard, d.ids_bytes);
  const std::vector<uint8_t> ws = d.ws.download_all();
  EXPECT_TRUE(guards_intact(ws, d.ws_bytes)) << "workspace guard bytes changed";
  g.scores.resize(d.ws_bytes / 4);
  std::memcpy(g.scores.data(), ws.data() + kGuard, d.ws_bytes);
  return g;
}

inline GpuResult run_gpu(DeviceSet& d, const IndexerCudaOptions& o) {
  poison_outputs(d);
  const Status st = run_indexer_cuda(d.params, d.workspace, nullptr, o);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return download(d);
}

// ---------------------------------------------------------------------------------------------
// Comparison.

inline std::string row_str(const int32_t* row) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < kTopK; ++i) os << (i ? " " : "") << row[i];
  os << "]";
  return os.str();
}

struct CompareStats {
  int64_t rows = 0, scored_rows = 0, near_ties = 0;
  double max_err_ratio = 0.0;  // max |gpu - twin| / L1 over scored entries
};

// exact_scores: the GPU scores must equal the twin's bit for bit (CUDA cores, integer inputs).
inline CompareStats compare(const Inputs& in, const Reference& ref, const GpuResult& gpu,
                            bool exact_scores, const std::string& label) {
  SCOPED_TRACE(label);
  CompareStats st;
  const int mp = in.max_pages();
  int failures = 0;
  auto fail = [&](int64_t row, const std::string& what) {
    if (++failures <= 8)
      ADD_FAILURE() << "row " << row << " (token " << row / in.n_kv << ", head " << row % in.n_kv
                    << ", position " << in.hb.position_of(row / in.n_kv) << "): " << what;
  };
  std::vector<int32_t> want(kTopK);
  std::vector<float> others;
  for (int64_t row = 0; row < in.rows(); ++row) {
    ++st.rows;
    const int pos = in.hb.position_of(row / in.n_kv);
    const int n_valid = pos / kPageSize + 1;
    const int32_t* g = gpu.ids.data() + row * kTopK;
    const int32_t* e = ref.ids.data() + row * kTopK;
    const bool same = std::equal(g, g + kTopK, e);
    if (n_valid <= kTopK) {
      if (!same) fail(row, "gpu " + row_str(g) + " twin " + row_str(e));
      continue;
    }
    ++st.scored_rows;
    const float* gs = gpu.scores.data() + row * mp;
    const float* ts = ref.scores.data() + row * mp;
    // 1. scores
    const float bound = kScoreBoundFactor * ref.l1[static_cast<size_t>(row)];
    for (int b = 0; b < n_valid; ++b) {
      if (std::isnan(ts[b]) || std::isnan(gs[b])) {
        if (std::isnan(ts[b]) != std::isnan(gs[b]))
          fail(row, "block " + std::to_string(b) + ": gpu score " + std::to_string(gs[b]) +
                        " twin " + std::to_string(ts[b]) + " (NaN on one side only)");
        continue;
      }
      const double err = std::fabs(double{gs[b]} - double{ts[b]});
      if (ref.l1[static_cast<size_t>(row)] > 0)
        st.max_err_ratio = std::max(st.max_err_ratio, err / ref.l1[static_cast<size_t>(row)]);
      if (exact_scores ? !(gs[b] == ts[b]) : !(err <= bound))
        fail(row, "block " + std::to_string(b) + ": gpu score " + std::to_string(gs[b]) + " twin " +
                      std::to_string(ts[b]) + " bound " + std::to_string(bound));
    }
    // 2. the selection from the GPU's own scores
    select_blocks_ref(gs, n_valid, want.data());
    if (!std::equal(g, g + kTopK, want.data()))
      fail(row, "gpu ids " + row_str(g) + " but its own scores select " + row_str(want.data()));
    // 3. against the twin
    if (same) continue;
    if (exact_scores) {
      fail(row, "gpu " + row_str(g) + " twin " + row_str(e) + " (exact scores)");
      continue;
    }
    others.clear();
    for (int b = 0; b + 1 < n_valid; ++b)
      if (!std::isnan(ts[b])) others.push_back(ts[b]);
    std::sort(others.begin(), others.end(), std::greater<float>());
    const float tol = 2.0f * bound;
    const bool near = others.size() > static_cast<size_t>(kTopK - 1) &&
                      others[kTopK - 2] - others[kTopK - 1] <= tol;
    if (!near) {
      fail(row, "gpu " + row_str(g) + " twin " + row_str(e) + " (no near tie at the boundary)");
      continue;
    }
    ++st.near_ties;
    const Status v = verify_block_selection(ts, n_valid, g, tol);
    if (!v.ok()) fail(row, "near tie, but " + v.to_string());
  }
  if (failures > 8) ADD_FAILURE() << failures << " failing rows in total";
  std::printf("[ indexer  ] %s: %lld rows, %lld scored, %lld near ties, max |gpu-twin|/L1 %.3g\n",
              label.c_str(), static_cast<long long>(st.rows),
              static_cast<long long>(st.scored_rows), static_cast<long long>(st.near_ties),
              st.max_err_ratio);
  return st;
}

// The fused decode path against the two-kernel path: identical ids (the block maxima are computed
// by the same code; the selection applies the same exact rule).
inline void expect_same_ids(const Inputs& in, const GpuResult& fused, const GpuResult& two,
                            const std::string& label) {
  SCOPED_TRACE(label);
  ASSERT_EQ(fused.ids.size(), two.ids.size());
  int failures = 0;
  for (int64_t row = 0; row < in.rows(); ++row) {
    const int32_t* f = fused.ids.data() + row * kTopK;
    const int32_t* g = two.ids.data() + row * kTopK;
    if (!std::equal(f, f + kTopK, g) && ++failures <= 8)
      ADD_FAILURE() << "row " << row << " (token " << row / in.n_kv << ", position "
                    << in.hb.position_of(row / in.n_kv) << "): fused " << row_str(f)
                    << " two-kernel " << row_str(g);
  }
  if (failures > 8) ADD_FAILURE() << failures << " differing rows in total";
  std::printf("[ indexer  ] %s: %lld rows, %d differ\n", label.c_str(),
              static_cast<long long>(in.rows()), failures);
}

// Runs every scorer variant on one input set and compares each with the twin (two-kernel path),
// and the fused path and the single pass (one CTA or a cluster per unit) with the two-kernel path.
inline void check_all_paths(const Inputs& in, const std::string& label, int64_t pool_offset = 0) {
  const Reference ref = reference(in);
  DeviceSet d;
  upload(in, d, pool_offset);
  const std::vector<uint8_t> pool_before = d.pool.download_all();
  struct Variant {
    const char* name;
    IndexerCudaOptions o;
  };
  std::vector<Variant> variants = {{"auto", {}}};
  {
    IndexerCudaOptions o;
    o.k_splits = 1;
    variants.push_back({"k_splits 1", o});
    o.k_splits = 3;
    variants.push_back({"k_splits 3", o});
    o.k_splits = 1000;
    variants.push_back({"k_splits 1000", o});
    o = IndexerCudaOptions{};
    o.early_query_loads = false;  // the former order: positions and query rows after the tiles
    o.fast_select = false;        // long rows by the per-lane sorted lists
    o.wide_select = -1;           // ... on one warp per row, also in calls of few rows
    variants.push_back({"late loads, sorted lists", o});
    o = IndexerCudaOptions{};
    o.guess_request_bounds = false;  // the early loads also at one token per request
    variants.push_back({"no guess", o});
    o = IndexerCudaOptions{};
    o.short_select = false;  // rows of <= 63 candidates by one warp each (the former kernel)
    variants.push_back({"one warp per short row", o});
    for (int w : {2, 4}) {
      o = IndexerCudaOptions{};
      o.short_select_warps = w;  // select_short_kernel with 2 / 4 warps per row (default: auto)
      variants.push_back({w == 2 ? "2 warps per short row" : "4 warps per short row", o});
    }
    o = IndexerCudaOptions{};
    o.force_cuda_cores = true;
    variants.push_back({"cuda cores", o});
    o.k_splits = 2;
    variants.push_back({"cuda cores, k_splits 2", o});
  }
  for (const Variant& v : variants) {
    const bool tc = indexer_cuda_uses_tensor_cores(d.params, v.o);
    // The two-kernel path leaves every block score in the workspace: checked against the twin.
    IndexerCudaOptions two = v.o;
    two.unfused_decode = true;
    ASSERT_FALSE(indexer_cuda_uses_fused_decode(d.params, two));
    const GpuResult g = run_gpu(d, two);
    const std::string name = label + " [" + v.name + (tc ? ", tensor cores" : ", cuda cores");
    compare(in, ref, g, /*exact_scores=*/!tc || in.integer, name + "]");
    // The fused path computes the same block maxima and must select the same ids, byte for byte.
    IndexerCudaOptions fo = v.o;
    fo.fused_decode_always = true;
    if (indexer_cuda_uses_fused_decode(d.params, fo)) {
      const GpuResult f = run_gpu(d, fo);
      expect_same_ids(in, f, g, name + ", fused vs two-kernel]");
    }
    // Flat decode (the two-kernel scorer over balanced warp ranges, flat_decode CTAs per SM):
    // the same block scores, checked against the twin like the two-kernel path.
    for (int flat : {1, 3}) {
      IndexerCudaOptions fl = v.o;
      fl.flat_decode = flat;
      if (indexer_cuda_plan(d.params, fl).flat_ctas == 0) continue;
      const GpuResult f = run_gpu(d, fl);
      const std::string fname = name + ", flat " + std::to_string(flat);
      compare(in, ref, f, /*exact_scores=*/in.integer, fname + "]");
      expect_same_ids(in, f, g, fname + " vs two-kernel]");
    }
    // The single-pass variant (one split, no selection kernel) where its plan applies (<= 64
    // blocks), with one CTA per unit and as clusters of 2, 3 and 8 CTAs (single_pass_ctas).
    for (int ctas : {1, 2, 3, 8}) {
      IndexerCudaOptions so = v.o;
      so.single_pass = true;
      so.single_pass_ctas = ctas;
      if (!indexer_cuda_plan(d.params, so).single) continue;
      const GpuResult c = run_gpu(d, so);
      expect_same_ids(in, c, g,
                      name + ", single pass" +
                          (ctas > 1 ? " cluster " + std::to_string(ctas) : std::string()) +
                          " vs two-kernel]");
    }
  }
  EXPECT_TRUE(d.pool.download_all() == pool_before) << "the index pool was modified";
}

// ---------------------------------------------------------------------------------------------
// Checks shared by the tests.

// Generation requests whose sequence (cached + 1 + draft_len tokens) is `ctx` long.
inline void check_generation_contexts(const std::vector<int>& contexts, const std::string& name) {
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int draft : {0, 1, 3, 7}) {
    std::vector<RequestSpec> reqs;
    for (int ctx : contexts) {
      const int n = std::min(ctx, 1 + draft);
      reqs.push_back({ctx - n, n});
    }
    const Inputs in = make_inputs(reqs, 4, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_all_paths(in,
                    name + " draft " + std::to_string(draft) + " " + mt::describe_requests(reqs));
  }
}

inline void check_mixed(const std::vector<int>& head_counts) {
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int n_kv : head_counts) {
    // Context chunks with cached prefixes (one from scratch), then generation requests.
    const std::vector<RequestSpec> contexts = {{2100, 301}, {0, 2100}, {4000, 150}, {130, 1}};
    const std::vector<RequestSpec> reqs = mt::mixed_requests(contexts, 13, 3, 6000, rng);
    const Inputs in = make_inputs(reqs, n_kv, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_all_paths(in, "mixed n_kv " + std::to_string(n_kv));
  }
}

inline void check_strided_pools() {
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{3000, 4}, {2500, 200}, {6000, 1}};
  const int64_t page = int64_t{kPageSize} * kHeadDim;
  struct Case {
    int64_t stride;
    int64_t offset;
    const char* name;
  };
  for (const Case& c : {Case{3 * page + 16, 0, "stride 3 pages + 16 (tensor cores)"},
                        Case{page + 4, 0, "stride 1 page + 4 (cuda cores)"},
                        Case{2 * page, 4, "base + 4 (cuda cores)"},
                        Case{2 * page, 48, "base + 48 (tensor cores)"}}) {
    const Inputs in = make_inputs(reqs, 4, rng, false, c.stride);
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_all_paths(in, c.name, c.offset);
  }
}

inline void check_nan() {
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Inputs in = make_inputs({{4000, 4}, {3000, 1}, {2600, 1}}, 4, rng, /*integer=*/true);
  ASSERT_FALSE(::testing::Test::HasFailure());
  // Request 0: a NaN key in blocks 3, 7 and in the local block 31 (position 4001 <= 4003).
  for (int pos : {3 * 128 + 5, 7 * 128 + 127, 31 * 128 + 33}) in.hb.index_row(0, pos)[17] = 0x7f;
  // Request 1, head 2: a NaN index-Q value: every block scores NaN, only the local one is chosen.
  const int64_t t1 = 4;
  in.iq.ptr<uint8_t>()[(t1 * 4 + 2) * kHeadDim + 99] = 0xff;
  // Request 2: NaN in 20 of its 21 blocks: fewer than 15 candidates remain.
  for (int b = 0; b < 20; ++b) in.hb.index_row(2, b * 128 + 64)[3] = 0x7f;
  check_all_paths(in, "NaN");
}

// paths: 0 tensor cores fused, 1 two-kernel, 2 CUDA cores, 3 single pass, 4 single pass in
// clusters of 4 CTAs (the cluster shares the rows: 4 and 2 tokens per request).
inline void check_guards(const std::vector<int>& paths) {
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const Inputs in = make_inputs({{5000, 4}, {3000, 2}, {2500, 1}}, 4, rng, /*integer=*/true);
  ASSERT_FALSE(::testing::Test::HasFailure());
  Reference ref = reference(in);
  const HostBatch& hb = in.hb;
  const int mp = in.max_pages();
  // Corrupt device copies only: request 0's blocks 5 and 9 point outside the pool (-7 and
  // num_pages + 3), request 1's local block too (token 4 still selects it); token 5 (request 1)
  // gets position -1 and token 6 (request 2) a position past its page table.
  Tensor table = hb.page_table.clone();
  int32_t* tb = table.ptr<int32_t>();
  tb[0 * mp + 5] = -7;
  tb[0 * mp + 9] = static_cast<int32_t>(hb.num_pages()) + 3;
  const int local1 = hb.position_of(4) / kPageSize;
  tb[1 * mp + local1] = std::numeric_limits<int32_t>::max();
  Tensor pos = hb.positions.clone();
  pos.ptr<int32_t>()[5] = -1;
  pos.ptr<int32_t>()[6] = mp * kPageSize + 3;
  // Expected: those blocks score NaN (never chosen unless local), bad positions give -1 rows.
  for (int64_t t = 0; t < in.T(); ++t) {
    for (int h = 0; h < in.n_kv; ++h) {
      const int64_t row = t * in.n_kv + h;
      float* s = ref.scores.data() + row * mp;
      int32_t* ids = ref.ids.data() + row * kTopK;
      if (t == 5 || t == 6) {
        std::fill(ids, ids + kTopK, -1);
        continue;
      }
      const int r = hb.request_of(t);
      if (r == 0) s[5] = s[9] = std::numeric_limits<float>::quiet_NaN();
      if (r == 1) s[local1] = std::numeric_limits<float>::quiet_NaN();
      select_blocks_ref(s, hb.position_of(t) / kPageSize + 1, ids);
    }
  }
  DeviceSet d;
  upload(in, d);
  d.table.upload(table.data(), static_cast<size_t>(table.nbytes()));
  d.pos.upload(pos.data(), static_cast<size_t>(pos.nbytes()));
  for (int path : paths) {
    IndexerCudaOptions o;
    o.force_cuda_cores = path == 2;
    o.unfused_decode = path == 1;
    o.single_pass = path == 3 || path == 4;
    o.single_pass_ctas = path == 4 ? 4 : 0;
    o.fused_decode_always = path == 0 || path == 3 || path == 4;
    const char* names[] = {"[fused] ", "[two-kernel] ", "[cuda cores] ", "[single pass] ",
                           "[single pass cluster 4] "};
    const char* name = names[path];
    if (path == 3) EXPECT_TRUE(indexer_cuda_plan(d.params, o).single);
    if (path == 4) {
      EXPECT_TRUE(indexer_cuda_plan(d.params, o).single);
      EXPECT_EQ(indexer_cuda_plan(d.params, o).k_splits, 4);
    }
    if (o.fused_decode_always) EXPECT_TRUE(indexer_cuda_uses_fused_decode(d.params, o));
    const GpuResult g = run_gpu(d, o);
    for (int64_t row = 0; row < in.rows(); ++row) {
      const int32_t* got = g.ids.data() + row * kTopK;
      const int32_t* want = ref.ids.data() + row * kTopK;
      EXPECT_TRUE(std::equal(got, got + kTopK, want))
          << name << "row " << row << ": gpu " << row_str(got) << " expected " << row_str(want);
    }
  }
}

}  // namespace m3attn::indexer_gpu_test
