// Shared setup of the producer CPU tests: inputs in the fused packed layout (the unfused modes view
// column ranges of the same rows), a byte pool that holds the main and index caches with guard
// bytes around and between their pages, and an independent fp64 reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "core/rope.h"
#include "m3attn/config.h"
#include "stages/producer/producer.h"
#include "support/test_util.h"

namespace m3attn::producer_test {

using testing::Rng;

constexpr int64_t kTile = int64_t{kPageSize} * kHeadDim;  // bytes of one (page, plane, head)
constexpr double kTheta = 5e6;
constexpr float kEps = 1e-6f;

// ---- inputs ----

struct Inputs {
  int n_q = 0, n_kv = 0;
  int64_t tokens = 0, max_pos = 0, row_stride = 0;
  Tensor packed;  // bf16 [T, row_stride], fused layout [Q | K | V | iQ | iK | padding]
  Tensor positions, slots, rope, q_norm, k_norm, iq_norm, ik_norm;

  int64_t fused_width() const { return producer_packed_width(ProducerMode::kFused, n_q, n_kv); }
  int64_t q_col() const { return 0; }
  int64_t k_col() const { return int64_t{n_q} * kHeadDim; }
  int64_t v_col() const { return int64_t{n_q + n_kv} * kHeadDim; }
  int64_t iq_col() const { return int64_t{n_q + 2 * n_kv} * kHeadDim; }
  int64_t ik_col() const { return int64_t{n_q + 3 * n_kv} * kHeadDim; }
  const uint16_t* head(int64_t t, int64_t col, int h) const {
    return packed.ptr<uint16_t>() + t * row_stride + col + int64_t{h} * kHeadDim;
  }
  int32_t* pos() { return positions.ptr<int32_t>(); }
  int32_t* slot() { return slots.ptr<int32_t>(); }
};

inline void fill_norm_weight(Tensor& w, Rng& rng) {
  // 1 + w spans about [0, 2], with a few exact zeros of 1 + w.
  uint16_t* p = w.ptr<uint16_t>();
  for (int i = 0; i < kHeadDim; ++i) p[i] = float_to_bf16(rng.normal(0.0f, 0.5f));
  p[rng.integer(0, kHeadDim - 1)] = float_to_bf16(-1.0f);
}

// Random packed rows (each head with its own magnitude, some heads all zero), random positions in
// [0, max_pos), slots all -1 (the tests assign them), row stride = fused width + row_pad.
inline Inputs make_inputs(Rng& rng, int n_q, int n_kv, int64_t tokens, int64_t max_pos,
                          int64_t row_pad = 64) {
  Inputs in;
  in.n_q = n_q;
  in.n_kv = n_kv;
  in.tokens = tokens;
  in.max_pos = max_pos;
  in.row_stride = in.fused_width() + row_pad;
  in.packed = Tensor(DType::kBF16, {tokens, in.row_stride});
  uint16_t* x = in.packed.ptr<uint16_t>();
  const int heads = static_cast<int>(in.fused_width() / kHeadDim);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < heads; ++h) {
      const bool zero = rng.integer(0, 40) == 0;
      const float mag = std::ldexp(1.0f, static_cast<int>(rng.integer(-6, 6)));
      for (int i = 0; i < kHeadDim; ++i)
        x[t * in.row_stride + h * kHeadDim + i] = zero ? 0 : float_to_bf16(rng.normal(0.0f, mag));
    }
    // Padding columns hold NaN: a read past the width would show in the outputs.
    for (int64_t c = in.fused_width(); c < in.row_stride; ++c) x[t * in.row_stride + c] = 0x7fc0;
  }
  in.positions = Tensor(DType::kI32, {tokens});
  in.slots = Tensor(DType::kI32, {tokens});
  for (int64_t t = 0; t < tokens; ++t) {
    in.pos()[t] = static_cast<int32_t>(rng.integer(0, max_pos - 1));
    in.slot()[t] = -1;
  }
  in.rope = make_rope_table(max_pos, kTheta).value();
  for (Tensor* w : {&in.q_norm, &in.k_norm, &in.iq_norm, &in.ik_norm}) {
    *w = Tensor(DType::kBF16, {kHeadDim});
    fill_norm_weight(*w, rng);
  }
  return in;
}

// Distinct random slots over pages [0, num_pages): each token gets its own slot.
inline void assign_distinct_slots(Inputs& in, Rng& rng, int64_t num_pages) {
  const int64_t capacity = num_pages * kPageSize;
  std::vector<int32_t> taken;
  for (int64_t t = 0; t < in.tokens; ++t) {
    int32_t s;
    do {
      s = static_cast<int32_t>(rng.integer(0, capacity - 1));
    } while (std::find(taken.begin(), taken.end(), s) != taken.end());
    taken.push_back(s);
    in.slot()[t] = s;
  }
}

// ---- caches in one byte pool ----

struct CacheLayout {
  int64_t num_pages = 0;
  int n_kv = 0;
  int64_t page_stride = 0;   // main cache, elements (= bytes)
  int64_t plane_stride = 0;  // main cache
  int64_t main_offset = 0;   // bytes from the pool base
  int64_t index_page_stride = 0;
  int64_t index_offset = 0;

  // Separate regions, minimal strides scaled by `stride_factor`, 256 guard bytes around each.
  static CacheLayout separate(int64_t num_pages, int n_kv, int64_t stride_factor = 1,
                              int64_t plane_pad = 0) {
    CacheLayout l;
    l.num_pages = num_pages;
    l.n_kv = n_kv;
    l.plane_stride = n_kv * kTile + plane_pad;
    l.page_stride = (l.plane_stride + n_kv * kTile) * stride_factor;
    l.main_offset = 256;
    l.index_page_stride = kTile * stride_factor;
    l.index_offset =
        l.main_offset + (num_pages - 1) * l.page_stride + l.plane_stride + n_kv * kTile + 256;
    return l;
  }
  // A pool interleaving `layers` layers in each page slot, [K | V | iK] per layer, this being
  // layer `layer`; main and index caches share the page stride. `base_skew` (a multiple of 4)
  // moves the whole layer off 16-byte alignment.
  static CacheLayout interleaved(int64_t num_pages, int n_kv, int layers, int layer,
                                 int64_t base_skew = 0) {
    CacheLayout l;
    l.num_pages = num_pages;
    l.n_kv = n_kv;
    const int64_t per_layer = (2 * n_kv + 1) * kTile + 64;  // 64 guard bytes per layer
    l.plane_stride = n_kv * kTile;
    l.page_stride = layers * per_layer;
    l.main_offset = 256 + base_skew + layer * per_layer;
    l.index_page_stride = l.page_stride;
    l.index_offset = l.main_offset + 2 * n_kv * kTile;
    return l;
  }
  int64_t pool_bytes() const {
    const int64_t main_end =
        main_offset + (num_pages - 1) * page_stride + plane_stride + n_kv * kTile;
    const int64_t index_end = index_offset + (num_pages - 1) * index_page_stride + kTile;
    return std::max(main_end, index_end) + 256;
  }
};

// A pool filled with a position-dependent byte pattern (NaN codes included) so that any stray
// write shows up in a byte comparison with the snapshot.
struct CachePool {
  CacheLayout layout;
  Tensor bytes;
  Tensor snapshot;

  explicit CachePool(const CacheLayout& l) : layout(l), bytes(DType::kE4M3, {l.pool_bytes()}) {
    // The pattern repeats every 256 bytes: write one period, then double the filled prefix.
    uint8_t* b = bytes.ptr<uint8_t>();
    const int64_t n = bytes.nbytes();
    for (int64_t i = 0; i < std::min<int64_t>(n, 256); ++i)
      b[i] = static_cast<uint8_t>(i * 131 + 17);
    for (int64_t done = 256; done < n; done *= 2)
      std::memcpy(b + done, b, static_cast<size_t>(std::min(done, n - done)));
    snapshot = bytes.clone();
  }
  TensorView kv() const {
    return make_kv_cache_view(const_cast<uint8_t*>(bytes.ptr<uint8_t>()) + layout.main_offset,
                              layout.num_pages, layout.n_kv, layout.page_stride,
                              layout.plane_stride);
  }
  TensorView index() const {
    return make_index_cache_view(const_cast<uint8_t*>(bytes.ptr<uint8_t>()) + layout.index_offset,
                                 layout.num_pages, layout.index_page_stride);
  }
  const uint8_t* kv_row(int64_t page, int plane, int head, int row) const {
    return bytes.ptr<uint8_t>() + layout.main_offset +
           kv_cache_offset(kv(), page, plane, head, row);
  }
  const uint8_t* index_row(int64_t page, int row) const {
    return bytes.ptr<uint8_t>() + layout.index_offset + index_cache_offset(index(), page, row);
  }
};

// ---- params ----

// Outputs poisoned with 0xC9 (a finite code no valid output is compared against blindly).
struct Outputs {
  Tensor q, iq;
  Outputs(const Inputs& in)
      : q(DType::kE4M3, {in.tokens, in.n_q, kHeadDim}),
        iq(DType::kE4M3, {in.tokens, in.n_kv, kHeadDim}) {
    q.fill_bytes(0xc9);
    iq.fill_bytes(0xc9);
  }
};

inline ProducerParams make_params(ProducerMode mode, const Inputs& in, const Outputs& out,
                                  const CachePool& main_pool, const CachePool& index_pool) {
  ProducerParams p;
  p.mode = mode;
  p.n_q = in.n_q;
  p.n_kv = in.n_kv;
  p.eps = kEps;
  p.num_tokens = in.tokens;
  const int64_t first_col = mode == ProducerMode::kIndex ? in.iq_col() : 0;
  p.packed = TensorView::strided(
      const_cast<uint16_t*>(in.packed.ptr<uint16_t>()) + first_col, DType::kBF16,
      {in.tokens, producer_packed_width(mode, in.n_q, in.n_kv)}, {in.row_stride, 1});
  p.positions = in.positions.view();
  p.slots = in.slots.view();
  p.rope = in.rope.view();
  if (mode != ProducerMode::kIndex) {
    p.q_norm = in.q_norm.view();
    p.k_norm = in.k_norm.view();
    p.q_out = out.q.view();
    p.kv_cache = main_pool.kv();
  }
  if (mode != ProducerMode::kMain) {
    p.iq_norm = in.iq_norm.view();
    p.ik_norm = in.ik_norm.view();
    p.iq_out = out.iq.view();
    p.index_cache = index_pool.index();
  }
  return p;
}

// ---- the fp64 reference ----

// Gemma RMSNorm (when `norm` is given) and partial NeoX RoPE (when pos >= 0) in double, with the
// angles computed here from theta (not read from the table), rounded to fp32 and then to E4M3.
inline void reference_head(const uint16_t* src, const uint16_t* norm, double eps, int64_t pos,
                           uint8_t* dst) {
  double y[kHeadDim];
  for (int i = 0; i < kHeadDim; ++i) y[i] = bf16_to_float(src[i]);
  if (norm != nullptr) {
    double ss = 0.0;
    for (int i = 0; i < kHeadDim; ++i) ss += y[i] * y[i];
    const double r = 1.0 / std::sqrt(ss / kHeadDim + eps);
    for (int i = 0; i < kHeadDim; ++i) y[i] = y[i] * r * (1.0 + bf16_to_float(norm[i]));
  }
  if (pos >= 0) {
    for (int i = 0; i < kRotaryHalf; ++i) {
      const double a = static_cast<double>(pos) * std::pow(kTheta, -i / 32.0);
      const double c = std::cos(a), s = std::sin(a);
      const double lo = y[i], hi = y[i + kRotaryHalf];
      y[i] = lo * c - hi * s;
      y[i + kRotaryHalf] = hi * c + lo * s;
    }
  }
  for (int i = 0; i < kHeadDim; ++i) dst[i] = float_to_e4m3(static_cast<float>(y[i]));
}

// Reference outputs of every token: [T, heads, 128] for Q, K, V, iQ; [T, 128] for iK.
struct Reference {
  std::vector<uint8_t> q, k, v, iq, ik;
};

inline Reference compute_reference(const Inputs& in) {
  Reference r;
  const int64_t t_n = in.tokens;
  r.q.resize(t_n * in.n_q * kHeadDim);
  r.k.resize(t_n * in.n_kv * kHeadDim);
  r.v.resize(t_n * in.n_kv * kHeadDim);
  r.iq.resize(t_n * in.n_kv * kHeadDim);
  r.ik.resize(t_n * kHeadDim);
  const auto* qn = in.q_norm.ptr<uint16_t>();
  const auto* kn = in.k_norm.ptr<uint16_t>();
  const auto* iqn = in.iq_norm.ptr<uint16_t>();
  const auto* ikn = in.ik_norm.ptr<uint16_t>();
  for (int64_t t = 0; t < t_n; ++t) {
    const int64_t pos = in.positions.ptr<int32_t>()[t];
    for (int h = 0; h < in.n_q; ++h)
      reference_head(in.head(t, in.q_col(), h), qn, kEps, pos, &r.q[(t * in.n_q + h) * kHeadDim]);
    for (int h = 0; h < in.n_kv; ++h) {
      const int64_t o = (t * in.n_kv + h) * kHeadDim;
      reference_head(in.head(t, in.k_col(), h), kn, kEps, pos, &r.k[o]);
      reference_head(in.head(t, in.v_col(), h), nullptr, kEps, -1, &r.v[o]);
      reference_head(in.head(t, in.iq_col(), h), iqn, kEps, pos, &r.iq[o]);
    }
    reference_head(in.head(t, in.ik_col(), 0), ikn, kEps, pos, &r.ik[t * kHeadDim]);
  }
  return r;
}

// Whether token t's slot addresses a page of a cache with num_pages pages.
inline bool slot_writes(int32_t slot, int64_t num_pages) {
  return slot >= 0 && slot / kPageSize < num_pages;
}

// Expects every byte of the pool outside the rows written by valid slots to equal the snapshot.
// `main` / `index`: whether the call writes the main / index cache of this pool.
inline void expect_only_slot_rows_written(const CachePool& pool, const Inputs& in, bool main,
                                          bool index) {
  Tensor expected = pool.snapshot.clone();
  uint8_t* e = expected.ptr<uint8_t>();
  const uint8_t* base = pool.bytes.ptr<uint8_t>();
  for (int64_t t = 0; t < in.tokens; ++t) {
    const int32_t s = in.slots.ptr<int32_t>()[t];
    const int32_t pos = in.positions.ptr<int32_t>()[t];
    if (!slot_writes(s, pool.layout.num_pages) || pos < 0 || pos >= in.max_pos) continue;
    const int64_t page = s / kPageSize;
    const int row = s % kPageSize;
    if (main) {
      for (int plane = 0; plane < 2; ++plane)
        for (int h = 0; h < in.n_kv; ++h) {
          const int64_t off = pool.kv_row(page, plane, h, row) - base;
          std::memcpy(e + off, base + off, kHeadDim);
        }
    }
    if (index) {
      const int64_t off = pool.index_row(page, row) - base;
      std::memcpy(e + off, base + off, kHeadDim);
    }
  }
  if (std::memcmp(e, base, static_cast<size_t>(expected.nbytes())) == 0) return;
  int64_t first_diff = -1, diffs = 0;
  for (int64_t i = 0; i < expected.nbytes(); ++i)
    if (e[i] != base[i]) {
      if (first_diff < 0) first_diff = i;
      ++diffs;
    }
  EXPECT_EQ(diffs, 0) << "bytes outside the written rows changed, first at pool byte "
                      << first_diff;
}

}  // namespace m3attn::producer_test
