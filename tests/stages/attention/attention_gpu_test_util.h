// Helpers shared by the GPU attention tests (attention_gpu_test.cu: every kernel; and
// attention_prefill_gpu_test.cu: the warp-specialised prefill kernel): one problem (a batch, E4M3
// queries, ranked block ids) on the host, its device copies with a guarded, row-padded output, one
// eager GPU run with poisoned output and workspace, and the comparison with the CPU twin; the
// checks both files run: every config against the twin, sparse == dense, page ids past 2^31 bytes
// and CUDA-graph replay with new inputs.
//
// Tolerance (per (token, head) row of 128 outputs, relative L2 against the twin): kRowRelL2 = 1e-2.
//   - Both sides round once to BF16 (8 significant bits): each is within 2^-9 of its exact value,
//     so rounding alone allows up to 2^-8 ~ 3.9e-3 relative per element.
//   - The GPU's logits come from FP8 tensor-core MMAs whose accumulation keeps ~13 mantissa bits
//     relative to the largest addend: for N(0,1) E4M3 data (|partial sums| <~ 40 over 4 k-steps of
//     32) the logit error is <~ 4 * 40 * 2^-13 * (1/sqrt(128)) ~ 1.7e-3, a relative error of the
//     same size in each softmax weight (the twin's dots are exact in double).
//   - P is rounded to f16 before P.V: 2^-11 ~ 4.9e-4 relative per weight; fp32 accumulation over
//     <= a few thousand keys adds ~1e-6.
//   A weighted average with weights perturbed by eps relative is perturbed by <~ 2 eps relative
//   (numerator and denominator), so the sum is <~ 3.9e-3 + 2 * (1.7e-3 + 4.9e-4) ~ 8.3e-3 < 1e-2.
//   Every kernel (mma.sync, the wgmma prefill / verify / warp-specialised ones) has these numerics:
//   S from FP8 MMAs (same reduced-precision accumulation per k-step of 32), P rounded to f16, P V
//   on f16 MMAs with fp32 accumulators, V exact in f16. A wrong mask, layout or block costs O(1).
//   NaN must appear exactly where the twin has it, +0 rows exactly where the twin has no keys.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/attention/attention.h"
#include "support/batch_builder.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn::testing::attn {

constexpr double kRowRelL2 = 1e-2;
constexpr uint8_t kPoison = 0xA5;
constexpr size_t kGuard = 256;  // poisoned bytes on both sides of the output
constexpr int kPad = 8;         // extra bf16 per output row (must stay poisoned)

enum class Pick {
  kShared,  // per (request, head) one random block ranking: tokens of a request mostly agree
  kRandom,  // an independent ranking per token (large unions in verify/prefill tiles)
  kJunk,    // kShared plus junk the twin ignores: ids >= n_valid, huge, negative, repeats, unsorted
};

// ids [T, n_kv, 16]: the local block, then the best 15 of the ranking among blocks < local,
// ascending, -1 padded (the indexer's contract), unless kJunk scrambles it.
inline Tensor make_block_ids(const HostBatch& hb, int n_kv, Pick pick, Rng& rng) {
  const int64_t T = hb.num_tokens();
  Tensor ids(DType::kI32, {T, n_kv, kTopK});
  int32_t* out = ids.ptr<int32_t>();
  std::vector<std::vector<double>> rank;  // per (request, head) priority of each block
  auto fresh_rank = [&](int n) {
    std::vector<double> v(static_cast<size_t>(n));
    for (double& x : v) x = rng.uniform(0.0f, 1.0f);
    return v;
  };
  const int max_blocks = hb.max_pages() + 1;
  for (int r = 0; r < hb.num_requests(); ++r)
    for (int g = 0; g < n_kv; ++g) rank.push_back(fresh_rank(max_blocks));
  for (int64_t t = 0; t < T; ++t) {
    const int r = hb.request_of(t);
    const int local = hb.position_of(t) / kPageSize;
    for (int g = 0; g < n_kv; ++g) {
      const std::vector<double> mine =
          pick == Pick::kRandom ? fresh_rank(max_blocks) : rank[static_cast<size_t>(r) * n_kv + g];
      std::vector<int> others(static_cast<size_t>(local));
      std::iota(others.begin(), others.end(), 0);
      std::sort(others.begin(), others.end(), [&](int a, int b) { return mine[a] > mine[b]; });
      if (others.size() > 15) others.resize(15);
      others.push_back(local);
      std::sort(others.begin(), others.end());
      int32_t* row = out + (t * n_kv + g) * kTopK;
      for (int k = 0; k < kTopK; ++k) row[k] = k < static_cast<int>(others.size()) ? others[k] : -1;
      if (pick == Pick::kJunk) {
        // Replace the -1 padding (if any) and shuffle: the key set is unchanged for the twin.
        const int n = static_cast<int>(others.size());
        for (int k = n; k < kTopK; ++k) {
          switch (rng.integer(0, 4)) {
            case 0:
              row[k] = local + 1 + static_cast<int32_t>(rng.integer(0, 3));
              break;  // future
            case 1:
              row[k] = 1 << 30;
              break;
            case 2:
              row[k] = -static_cast<int32_t>(rng.integer(1, 1000));
              break;
            case 3:
              row[k] = others[static_cast<size_t>(rng.integer(0, n - 1))];
              break;  // repeat
            default:
              row[k] = hb.max_pages() + 7;
              break;  // past the page table
          }
        }
        std::shuffle(row, row + kTopK, rng.engine());
      }
    }
  }
  return ids;
}

// One problem: host inputs and the twin's output.
struct Problem {
  HostBatch hb;
  int n_q = 0, n_kv = 0;
  bool sparse = true;
  Tensor q;    // e4m3 [T, n_q, 128]
  Tensor ids;  // i32 [T, n_kv, 16]
  Tensor ref;  // bf16 [T, n_q * 128] (run_reference)

  int64_t T() const { return hb.num_tokens(); }
  int64_t width() const { return int64_t{n_q} * kHeadDim; }

  AttentionParams host_params(bool sparse_, Tensor& out) const {
    AttentionParams p;
    p.n_q = n_q;
    p.n_kv = n_kv;
    p.sparse = sparse_;
    p.q = q.view();
    p.kv_cache = hb.kv_cache();
    p.block_ids = ids.view();
    p.batch = hb.batch_view();
    p.out = out.view();
    return p;
  }
};

inline Problem make_problem(const std::vector<RequestSpec>& reqs, int n_q, int n_kv, Pick pick,
                            Rng& rng, BatchOptions o = {}) {
  Problem pr;
  o.n_kv = n_kv;
  pr.hb = build_batch(reqs, o, rng);
  pr.n_q = n_q;
  pr.n_kv = n_kv;
  pr.q = Tensor(DType::kE4M3, {pr.T(), n_q, kHeadDim});
  fill_e4m3_normal(pr.q, rng);
  pr.ids = make_block_ids(pr.hb, n_kv, pick, rng);
  return pr;
}

// Runs the twin into pr.ref (a rejected call is a fatal failure: check HasFatalFailure()).
inline void run_reference(Problem& pr, bool sparse) {
  pr.sparse = sparse;
  pr.ref = Tensor(DType::kBF16, {pr.T(), pr.width()});
  pr.ref.fill_bytes(kPoison);
  const Status s = run_attention_cpu(pr.host_params(sparse, pr.ref));
  ASSERT_TRUE(s.ok()) << s.to_string();
}

struct DeviceProblem {
  DeviceBuffer q, ids, qs, pos, lens, table, pool, out, ws;
  int64_t out_stride = 0;
  size_t out_bytes = 0;  // of the region between the guards
  TensorView kv;
  BatchView batch;
};

// Uploads everything; the output has kPad extra elements per row and kGuard bytes on both sides.
inline void upload(const Problem& pr, DeviceProblem& d) {
  auto up = [](DeviceBuffer& b, const Tensor& t) {
    b = DeviceBuffer(static_cast<size_t>(std::max<int64_t>(t.nbytes(), 16)));
    b.upload(t.data(), static_cast<size_t>(t.nbytes()));
  };
  up(d.q, pr.q);
  up(d.ids, pr.ids);
  up(d.qs, pr.hb.query_start);
  up(d.pos, pr.hb.positions);
  up(d.lens, pr.hb.seq_lens);
  up(d.table, pr.hb.page_table);
  up(d.pool, pr.hb.kv_pool);
  d.kv = pr.hb.kv_view_at(d.pool.data(), Device::cuda(0));
  d.batch = pr.hb.batch_view_at(d.qs.data(), d.pos.data(), d.lens.data(), d.table.data(),
                                Device::cuda(0));
  d.out_stride = pr.width() + kPad;
  d.out_bytes = static_cast<size_t>(pr.T() * d.out_stride * 2);
  d.out = DeviceBuffer(d.out_bytes + 2 * kGuard, kPoison);
}

inline AttentionParams device_params(const Problem& pr, const DeviceProblem& d, bool sparse) {
  AttentionParams p;
  p.n_q = pr.n_q;
  p.n_kv = pr.n_kv;
  p.sparse = sparse;
  p.q =
      TensorView::contiguous(d.q.data(), DType::kE4M3, {pr.T(), pr.n_q, kHeadDim}, Device::cuda(0));
  p.kv_cache = d.kv;
  p.block_ids =
      TensorView::contiguous(d.ids.data(), DType::kI32, {pr.T(), pr.n_kv, kTopK}, Device::cuda(0));
  p.batch = d.batch;
  p.out = TensorView::strided(static_cast<uint8_t*>(d.out.data()) + kGuard, DType::kBF16,
                              {pr.T(), pr.width()}, {d.out_stride, 1}, Device::cuda(0));
  return p;
}

// Allocates d.ws for (p, cfg), poisoned with 0xFF (NaN floats); returns the workspace bytes that
// run_attention_cuda takes.
inline size_t make_workspace(DeviceProblem& d, const AttentionParams& p,
                             const AttentionCudaConfig& cfg) {
  const size_t ws_bytes = attention_workspace_bytes(p, cfg);
  d.ws = DeviceBuffer(std::max<size_t>(ws_bytes, 16), 0xFF);
  return ws_bytes;
}

// Runs the GPU with `cfg` (output poisoned, workspace poisoned with 0xFF: NaN floats) and returns
// the output bytes (guards included). With `status`, a rejected call is reported there instead of
// failing the test.
inline std::vector<uint8_t> run_gpu(const Problem& pr, DeviceProblem& d, bool sparse,
                                    const AttentionCudaConfig& cfg, Status* status = nullptr) {
  const AttentionParams p = device_params(pr, d, sparse);
  const size_t ws_bytes = make_workspace(d, p, cfg);
  d.out.poison(kPoison);
  const Status s = run_attention_cuda(p, d.ws.data(), ws_bytes, nullptr, cfg);
  if (status) *status = s;
  EXPECT_TRUE(s.ok() || status) << s.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d.out.download_all();
}

inline bool bf16_is_nan(uint16_t v) { return (v & 0x7fffu) > 0x7f80u; }

// Compares GPU bytes (with guards and padded rows) to the twin (pr.ref): rows within kRowRelL2,
// NaN exactly where the twin has NaN, +0 rows exactly where the twin has an all-zero row, every
// guard and pad byte untouched. Returns the worst row error.
inline double expect_matches(const Problem& pr, const DeviceProblem& d,
                             const std::vector<uint8_t>& got, const std::string& what) {
  const int64_t T = pr.T(), W = pr.width();
  for (size_t i = 0; i < kGuard; ++i) {
    if (got[i] != kPoison || got[kGuard + d.out_bytes + i] != kPoison) {
      ADD_FAILURE() << what << ": guard byte " << i << " was written";
      break;
    }
  }
  double worst = 0.0;
  int reported = 0;
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* g = reinterpret_cast<const uint16_t*>(got.data() + kGuard) + t * d.out_stride;
    const uint16_t* c = pr.ref.ptr<uint16_t>() + t * W;
    for (int k = 0; k < kPad; ++k) {
      if (g[W + k] != static_cast<uint16_t>(kPoison * 0x0101)) {
        if (reported++ < 5) ADD_FAILURE() << what << ": row padding of token " << t << " written";
      }
    }
    for (int j = 0; j < pr.n_q; ++j) {
      double num = 0.0, den = 0.0;
      bool ref_nan = false, got_nan = false, ref_zero = true;
      for (int e = 0; e < kHeadDim; ++e) {
        const uint16_t gv = g[j * kHeadDim + e], cv = c[j * kHeadDim + e];
        ref_nan |= bf16_is_nan(cv);
        got_nan |= bf16_is_nan(gv);
        ref_zero &= cv == 0;
        const double a = bf16_to_float(gv), b = bf16_to_float(cv);
        num += (a - b) * (a - b);
        den += b * b;
      }
      std::string err;
      if (ref_nan || got_nan) {
        if (ref_nan != got_nan) err = ref_nan ? "twin NaN, GPU not" : "GPU NaN, twin not";
        // Both NaN somewhere: the NaN pattern must agree element by element.
        for (int e = 0; e < kHeadDim && err.empty(); ++e)
          if (bf16_is_nan(g[j * kHeadDim + e]) != bf16_is_nan(c[j * kHeadDim + e]))
            err = "NaN pattern differs";
      } else if (ref_zero) {
        for (int e = 0; e < kHeadDim && err.empty(); ++e)
          if (g[j * kHeadDim + e] != 0) err = "twin row is +0 (no keys), GPU is not";
      } else {
        const double rel = std::sqrt(num / den);
        worst = std::max(worst, rel);
        if (!(rel <= kRowRelL2)) {
          std::ostringstream os;
          os << "relative L2 " << rel << " > " << kRowRelL2 << " (first: GPU "
             << bf16_to_float(g[j * kHeadDim]) << ", twin " << bf16_to_float(c[j * kHeadDim])
             << ")";
          err = os.str();
        }
      }
      if (!err.empty() && reported++ < 8) {
        ADD_FAILURE() << what << ": token " << t << " (request " << pr.hb.request_of(t)
                      << ", position " << pr.hb.position_of(t) << ") head " << j << ": " << err;
      }
    }
  }
  return worst;
}

// The GPU on `d` under every config of `cfgs`, each compared with the twin already in pr.ref
// (expect_matches) under the label `prefix` + name(cfg); prints each config's worst row error.
inline void expect_configs_match(const Problem& pr, DeviceProblem& d, bool sparse,
                                 const std::vector<AttentionCudaConfig>& cfgs,
                                 const std::string& prefix,
                                 std::string (*name)(const AttentionCudaConfig&)) {
  for (const AttentionCudaConfig& cfg : cfgs) {
    const std::string label = prefix + name(cfg);
    const std::vector<uint8_t> got = run_gpu(pr, d, sparse, cfg);
    const double worst = expect_matches(pr, d, got, label);
    std::printf("  %s: worst row relative L2 %.2e\n", label.c_str(), worst);
  }
}

// The twin once (pr.ref), then expect_configs_match on a fresh upload under the label `what` +
// " sparse, " / " dense, " + name(cfg).
inline void check_against_twin(Problem& pr, bool sparse, const std::string& what,
                               const std::vector<AttentionCudaConfig>& cfgs,
                               std::string (*name)(const AttentionCudaConfig&)) {
  run_reference(pr, sparse);
  if (::testing::Test::HasFatalFailure()) return;
  DeviceProblem d;
  upload(pr, d);
  expect_configs_match(pr, d, sparse, cfgs, what + (sparse ? " sparse, " : " dense, "), name);
}

// Under `cfg`, the GPU's sparse and dense outputs are the same bytes (<= 16 visible blocks), and
// the sparse one matches the twin (pr.ref, sparse).
inline void expect_sparse_equals_dense(const Problem& pr, DeviceProblem& d,
                                       const AttentionCudaConfig& cfg, const std::string& name) {
  const std::vector<uint8_t> s = run_gpu(pr, d, true, cfg);
  const std::vector<uint8_t> dn = run_gpu(pr, d, false, cfg);
  EXPECT_TRUE(s == dn) << "sparse and dense GPU outputs differ under " << name;
  expect_matches(pr, d, s, "sparse == dense, " + name);
}

// Page ids past 2^31 bytes (one KV head: pages of 32 KB): copies pr's pages into the top of a
// device pool `*big` 65536 pages (2^31 bytes) larger, and points d's page table (every id
// shifted) and KV view at it. Keep `*big` alive while `d` is used.
inline void move_pool_past_2_31_bytes(const Problem& pr, DeviceProblem& d, DeviceBuffer* big) {
  constexpr int64_t kShift = 65536;
  const int64_t page_stride = pr.hb.kv_page_stride();
  ASSERT_EQ(page_stride, 2 * int64_t{kPageSize} * kHeadDim);
  const int64_t pages = kShift + pr.hb.num_pages();
  *big = DeviceBuffer(static_cast<size_t>(pages * page_stride), 0x7F);
  M3_CUDA_TEST_CHECK(cudaMemcpy(static_cast<uint8_t*>(big->data()) + kShift * page_stride,
                                pr.hb.kv_pool.data(), static_cast<size_t>(pr.hb.kv_pool.nbytes()),
                                cudaMemcpyHostToDevice));
  Tensor table = pr.hb.page_table.clone();
  for (int64_t i = 0; i < table.numel(); ++i)
    if (table.ptr<int32_t>()[i] >= 0) table.ptr<int32_t>()[i] += static_cast<int32_t>(kShift);
  d.table.upload(table.data(), static_cast<size_t>(table.nbytes()));
  d.kv = make_kv_cache_view(big->data(), pages, 1, page_stride, pr.hb.kv_plane_stride(),
                            Device::cuda(0));
}

// CUDA-graph replay with new inputs: captures the GPU run on `a`'s device buffers, writes `b`'s
// inputs (same shapes, new contents) into them and replays. The replay equals an eager run on the
// same buffers byte for byte and matches b's twin.
inline void expect_graph_replay_equals_eager(const Problem& a, Problem& b, bool sparse,
                                             const AttentionCudaConfig& cfg) {
  ASSERT_EQ(a.hb.kv_pool.nbytes(), b.hb.kv_pool.nbytes());
  DeviceProblem d;
  upload(a, d);
  const AttentionParams p = device_params(a, d, sparse);
  const size_t ws_bytes = make_workspace(d, p, cfg);
  cudaStream_t stream;
  M3_CUDA_TEST_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status s = run_attention_cuda(p, d.ws.data(), ws_bytes, stream, cfg);
  M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(s.ok()) << s.to_string();
  M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // New inputs into the same buffers, then replay.
  d.q.upload(b.q.data(), static_cast<size_t>(b.q.nbytes()));
  d.ids.upload(b.ids.data(), static_cast<size_t>(b.ids.nbytes()));
  d.pool.upload(b.hb.kv_pool.data(), static_cast<size_t>(b.hb.kv_pool.nbytes()));
  d.table.upload(b.hb.page_table.data(), static_cast<size_t>(b.hb.page_table.nbytes()));
  d.out.poison(kPoison);
  M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> replay = d.out.download_all();
  d.out.poison(kPoison);
  d.ws.poison(0xFF);
  const Status e = run_attention_cuda(p, d.ws.data(), ws_bytes, stream, cfg);
  ASSERT_TRUE(e.ok()) << e.to_string();
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> eager = d.out.download_all();
  EXPECT_TRUE(replay == eager) << "graph replay differs from eager";
  run_reference(b, sparse);
  expect_matches(b, d, replay, "graph replay");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace m3attn::testing::attn
