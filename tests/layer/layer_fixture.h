// Shared helpers of the layer tests: small geometries, random weights, pools with a random cached
// prefix, row views and byte comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cache/page_pool.h"
#include "cache/step_plan.h"
#include "core/rope.h"
#include "layer/msa_layer.h"
#include "support/test_util.h"
#include "weights/packing.h"

namespace m3attn::testing {

inline MsaGeometry small_geometry(int hidden = 256, int n_q = 8, int n_kv = 2) {
  MsaGeometry g;
  g.hidden = hidden;
  g.n_q = n_q;
  g.n_kv = n_kv;
  return g;
}

// The same projections as `w`, as a dense layer (no index branch).
inline AttentionWeights dense_copy(const AttentionWeights& w) {
  AttentionWeights d;
  d.geometry = w.geometry;
  d.sparse = false;
  d.q = w.q.clone();
  d.k = w.k.clone();
  d.v = w.v.clone();
  d.o = w.o.clone();
  d.q_norm = w.q_norm.clone();
  d.k_norm = w.k_norm.clone();
  return d;
}

inline MsaLayer make_layer(const AttentionWeights& w, const Tensor& rope, bool fused = true,
                           int tp_size = 1, int tp_rank = 0) {
  Result<PackedRankWeights> packed = pack_rank(w, tp_size, tp_rank);
  EXPECT_TRUE(packed.ok()) << packed.status().to_string();
  MsaLayerOptions opt;
  opt.fuse_qkv_index_projection = fused;
  Result<MsaLayer> layer = MsaLayer::create(std::move(packed.value()), rope.view(), opt);
  EXPECT_TRUE(layer.ok()) << layer.status().to_string();
  return std::move(layer.value());
}

// A one-layer pool whose every byte is a random E4M3 value (so a cached prefix holds random K, V
// and index-K; rows the step writes are overwritten).
inline PagePool make_random_pool(int n_kv, int64_t num_pages, bool with_index, Rng& rng,
                                 int64_t plane_gap = 0) {
  PagePoolConfig cfg;
  cfg.num_pages = num_pages;
  cfg.n_kv = n_kv;
  cfg.with_index = with_index;
  if (plane_gap) cfg.plane_stride = int64_t{n_kv} * kPageSize * kHeadDim + plane_gap;
  Result<PagePool> pool = PagePool::create(cfg);
  EXPECT_TRUE(pool.ok()) << pool.status().to_string();
  uint8_t* p = pool.value().data();
  for (int64_t i = 0; i < pool.value().bytes(); ++i) p[i] = float_to_e4m3(rng.normal());
  return std::move(pool.value());
}

inline Tensor random_hidden(int64_t tokens, int hidden, Rng& rng) {
  Tensor t(DType::kBF16, {tokens, hidden});
  fill_bf16_normal(t, rng);
  return t;
}

// Rows [begin, begin + count) of a 2-D tensor.
inline TensorView row_view(const Tensor& t, int64_t begin, int64_t count) {
  TensorView v = t.view();
  v.data = static_cast<uint8_t*>(v.data) + begin * v.stride[0] * dtype_size(v.dtype);
  v.shape[0] = count;
  return v;
}

inline LayerIO layer_io(const PagePool& pool, const TensorView& hidden, const TensorView& out,
                        bool sparse) {
  LayerIO io;
  io.hidden = hidden;
  io.attn_out = out;
  io.kv_cache = pool.kv_cache(0).value();
  if (sparse) io.index_cache = pool.index_cache(0).value();
  return io;
}

inline bool same_bytes(const void* a, const void* b, int64_t n) {
  return n == 0 || std::memcmp(a, b, static_cast<size_t>(n)) == 0;
}
inline bool same_tensor(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  if (a.data() == nullptr || b.data() == nullptr) return a.data() == b.data();
  return same_bytes(a.data(), b.data(), a.nbytes());
}

// Index of the first differing byte (or -1).
inline int64_t first_diff(const void* a, const void* b, int64_t n) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  for (int64_t i = 0; i < n; ++i)
    if (x[i] != y[i]) return i;
  return -1;
}

// Appends rows [0, rows) of `src` (a trace tensor) to `dst` at row offset `at`.
inline void copy_rows(const Tensor& src, Tensor& dst, int64_t at) {
  const int64_t row_bytes = src.shape()[0] == 0 ? 0 : src.nbytes() / src.shape()[0];
  std::memcpy(static_cast<uint8_t*>(dst.data()) + at * row_bytes, src.data(),
              static_cast<size_t>(src.nbytes()));
}

inline Tensor make_rope(int64_t max_pos = 4096, double theta = 5e6) {
  Result<Tensor> r = make_rope_table(max_pos, theta);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(r.value());
}

}  // namespace m3attn::testing
