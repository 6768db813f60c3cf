#include "weights/packing.h"

#include <cmath>
#include <cstring>
#include <random>

#include "core/numeric.h"

namespace m3attn {

namespace {

Status check_matrix_shape(const QuantizedMatrix& m, int64_t rows, int64_t cols, const char* what) {
  M3_RETURN_IF_ERROR(m.validate(what));
  M3_CHECK_ARG(m.rows() == rows && m.cols() == cols, what, " must be [", rows, ", ", cols,
               "], got [", m.rows(), ", ", m.cols(), "]");
  return Status::Ok();
}

Status check_norm(const Tensor& t, const char* what) {
  M3_CHECK_ARG(t.dtype() == DType::kBF16 && t.shape() == std::vector<int64_t>{kHeadDim}, what,
               " must be bf16 [", kHeadDim, "], got ", dtype_name(t.dtype()), " ",
               t.view().shape_string());
  return Status::Ok();
}

bool is_empty(const QuantizedMatrix& m) { return m.w.shape().empty() && m.scales.shape().empty(); }

}  // namespace

Status AttentionWeights::validate() const {
  M3_RETURN_IF_ERROR(geometry.validate());
  const int64_t h = geometry.hidden, d = kHeadDim;
  M3_RETURN_IF_ERROR(check_matrix_shape(q, geometry.n_q * d, h, "q_proj"));
  M3_RETURN_IF_ERROR(check_matrix_shape(k, geometry.n_kv * d, h, "k_proj"));
  M3_RETURN_IF_ERROR(check_matrix_shape(v, geometry.n_kv * d, h, "v_proj"));
  M3_RETURN_IF_ERROR(check_matrix_shape(o, h, geometry.n_q * d, "o_proj"));
  M3_RETURN_IF_ERROR(check_norm(q_norm, "q_norm"));
  M3_RETURN_IF_ERROR(check_norm(k_norm, "k_norm"));
  if (sparse) {
    M3_RETURN_IF_ERROR(check_matrix_shape(index_q, geometry.n_idx() * d, h, "index_q_proj"));
    M3_RETURN_IF_ERROR(check_matrix_shape(index_k, d, h, "index_k_proj"));
    M3_RETURN_IF_ERROR(check_norm(index_q_norm, "index_q_norm"));
    M3_RETURN_IF_ERROR(check_norm(index_k_norm, "index_k_norm"));
  } else {
    M3_CHECK_ARG(is_empty(index_q) && is_empty(index_k), "a dense layer has no index projections");
  }
  return Status::Ok();
}

Status PackedRankWeights::validate() const {
  M3_RETURN_IF_ERROR(geometry.validate());
  const int64_t h = geometry.hidden, d = kHeadDim;
  M3_RETURN_IF_ERROR(check_matrix_shape(qkv, int64_t{geometry.n_q + 2 * geometry.n_kv} * d, h,
                                        "layer qkv weights"));
  M3_RETURN_IF_ERROR(check_matrix_shape(o, h, int64_t{geometry.n_q} * d, "layer o_proj weights"));
  M3_RETURN_IF_ERROR(check_norm(q_norm, "layer q_norm"));
  M3_RETURN_IF_ERROR(check_norm(k_norm, "layer k_norm"));
  if (sparse) {
    M3_RETURN_IF_ERROR(
        check_matrix_shape(fused, geometry.packed_width(), h, "layer fused weights"));
    M3_RETURN_IF_ERROR(
        check_matrix_shape(index, int64_t{geometry.n_kv + 1} * d, h, "layer index weights"));
    M3_RETURN_IF_ERROR(check_norm(index_q_norm, "layer index_q_norm"));
    M3_RETURN_IF_ERROR(check_norm(index_k_norm, "layer index_k_norm"));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Random weights

namespace {

Tensor random_bf16(std::vector<int64_t> shape, float stddev, std::mt19937_64& gen) {
  Tensor t(DType::kBF16, std::move(shape));
  std::normal_distribution<float> dist(0.0f, stddev);
  uint16_t* p = t.ptr<uint16_t>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = float_to_bf16(dist(gen));
  return t;
}

Result<QuantizedMatrix> random_matrix(int64_t rows, int64_t cols, std::mt19937_64& gen) {
  const Tensor w = random_bf16({rows, cols}, 1.0f / std::sqrt(static_cast<float>(cols)), gen);
  return quantize_blocks_128(w.view());
}

}  // namespace

Result<AttentionWeights> random_attention_weights(const MsaGeometry& g, uint64_t seed,
                                                  bool sparse) {
  M3_RETURN_IF_ERROR(g.validate());
  std::mt19937_64 gen(seed);
  AttentionWeights w;
  w.geometry = g;
  w.sparse = sparse;
  const int64_t d = kHeadDim;
  struct Slot {
    QuantizedMatrix* m;
    int64_t rows, cols;
  };
  std::vector<Slot> slots = {{&w.q, g.n_q * d, g.hidden},
                             {&w.k, g.n_kv * d, g.hidden},
                             {&w.v, g.n_kv * d, g.hidden},
                             {&w.o, g.hidden, g.n_q * d}};
  if (sparse) {
    slots.push_back({&w.index_q, g.n_idx() * d, g.hidden});
    slots.push_back({&w.index_k, d, g.hidden});
  }
  for (const Slot& s : slots) {
    auto m = random_matrix(s.rows, s.cols, gen);
    M3_RETURN_IF_ERROR(m.status());
    *s.m = std::move(m).value();
  }
  w.q_norm = random_bf16({d}, 0.1f, gen);
  w.k_norm = random_bf16({d}, 0.1f, gen);
  if (sparse) {
    w.index_q_norm = random_bf16({d}, 0.1f, gen);
    w.index_k_norm = random_bf16({d}, 0.1f, gen);
  }
  return w;
}

std::vector<NamedTensor> attention_weight_tensors(const AttentionWeights& w, int layer,
                                                  const std::string& prefix) {
  const std::string base = prefix + "layers." + std::to_string(layer) + ".self_attn.";
  std::vector<NamedTensor> out;
  auto add = [&](const char* name, const QuantizedMatrix& m) {
    out.emplace_back(base + name + ".weight", m.w.view());
    out.emplace_back(base + name + ".weight_scale_inv", m.scales.view());
  };
  add("q_proj", w.q);
  add("k_proj", w.k);
  add("v_proj", w.v);
  add("o_proj", w.o);
  out.emplace_back(base + "q_norm.weight", w.q_norm.view());
  out.emplace_back(base + "k_norm.weight", w.k_norm.view());
  if (w.sparse) {
    add("index_q_proj", w.index_q);
    add("index_k_proj", w.index_k);
    out.emplace_back(base + "index_q_norm.weight", w.index_q_norm.view());
    out.emplace_back(base + "index_k_norm.weight", w.index_k_norm.view());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Tensor-parallel packing

Result<RankHeads> rank_heads(const MsaGeometry& g, int tp_size, int tp_rank) {
  M3_RETURN_IF_ERROR(g.validate());
  if (tp_size != 1 && tp_size != 2 && tp_size != 4 && tp_size != 8)
    return unsupported("tensor-parallel size ", tp_size, " is not one of 1, 2, 4, 8");
  M3_CHECK_ARG(tp_rank >= 0 && tp_rank < tp_size, "tensor-parallel rank ", tp_rank,
               " is outside [0, ", tp_size, ")");
  M3_CHECK_ARG(g.n_q % tp_size == 0, "query heads ", g.n_q, " do not split over ", tp_size,
               " ranks");
  RankHeads h;
  const int q_per = g.n_q / tp_size;
  h.q_begin = tp_rank * q_per;
  h.q_end = h.q_begin + q_per;
  if (tp_size <= g.n_kv) {
    M3_CHECK_ARG(g.n_kv % tp_size == 0, "KV heads ", g.n_kv, " do not split over ", tp_size,
                 " ranks");
    const int kv_per = g.n_kv / tp_size;
    h.kv_begin = tp_rank * kv_per;
    h.kv_end = h.kv_begin + kv_per;
  } else {
    M3_CHECK_ARG(tp_size % g.n_kv == 0, "tensor-parallel size ", tp_size,
                 " is not a multiple of the KV heads ", g.n_kv, " it replicates");
    h.kv_begin = tp_rank / (tp_size / g.n_kv);
    h.kv_end = h.kv_begin + 1;
  }
  // The rank's query heads must all read its KV heads (GQA groups never straddle ranks).
  const int group = g.group_size();
  M3_CHECK_ARG(h.q_begin / group >= h.kv_begin && (h.q_end - 1) / group < h.kv_end, "query heads [",
               h.q_begin, ", ", h.q_end, ") of rank ", tp_rank, " do not belong to its KV heads [",
               h.kv_begin, ", ", h.kv_end, ")");
  return h;
}

Result<MsaGeometry> rank_geometry(const MsaGeometry& g, int tp_size) {
  auto h = rank_heads(g, tp_size, 0);
  M3_RETURN_IF_ERROR(h.status());
  MsaGeometry r = g;
  r.n_q = h.value().q_end - h.value().q_begin;
  r.n_kv = h.value().kv_end - h.value().kv_begin;
  return r;
}

namespace {

// Rows [head_begin*128, head_end*128) of a quantized matrix.
struct Slab {
  const QuantizedMatrix* m;
  int head_begin, head_end;
};

QuantizedMatrix concat_rows(const std::vector<Slab>& slabs) {
  int64_t heads = 0;
  for (const Slab& s : slabs) heads += s.head_end - s.head_begin;
  const int64_t k = slabs.front().m->cols();
  const int64_t kb = k / kQuantBlock;
  QuantizedMatrix out{Tensor(DType::kE4M3, {heads * kHeadDim, k}),
                      Tensor(DType::kF32, {heads, kb})};
  int64_t at = 0;
  for (const Slab& s : slabs) {
    const int64_t n = s.head_end - s.head_begin;
    std::memcpy(out.w.ptr<uint8_t>() + at * kHeadDim * k,
                s.m->w.ptr<uint8_t>() + int64_t{s.head_begin} * kHeadDim * k,
                static_cast<size_t>(n * kHeadDim * k));
    std::memcpy(out.scales.ptr<float>() + at * kb, s.m->scales.ptr<float>() + s.head_begin * kb,
                static_cast<size_t>(n * kb) * sizeof(float));
    at += n;
  }
  return out;
}

// Columns [head_begin*128, head_end*128) of a quantized matrix.
QuantizedMatrix slice_cols(const QuantizedMatrix& m, int head_begin, int head_end) {
  const int64_t n = m.rows(), k = m.cols(), kb = k / kQuantBlock;
  const int64_t heads = head_end - head_begin, cols = heads * kHeadDim;
  QuantizedMatrix out{Tensor(DType::kE4M3, {n, cols}),
                      Tensor(DType::kF32, {n / kQuantBlock, heads})};
  for (int64_t r = 0; r < n; ++r)
    std::memcpy(out.w.ptr<uint8_t>() + r * cols,
                m.w.ptr<uint8_t>() + r * k + int64_t{head_begin} * kHeadDim,
                static_cast<size_t>(cols));
  for (int64_t r = 0; r < n / kQuantBlock; ++r)
    std::memcpy(out.scales.ptr<float>() + r * heads, m.scales.ptr<float>() + r * kb + head_begin,
                static_cast<size_t>(heads) * sizeof(float));
  return out;
}

}  // namespace

Result<PackedRankWeights> pack_rank(const AttentionWeights& w, int tp_size, int tp_rank) {
  M3_RETURN_IF_ERROR(w.validate());
  auto heads = rank_heads(w.geometry, tp_size, tp_rank);
  M3_RETURN_IF_ERROR(heads.status());
  const RankHeads h = heads.value();
  auto geom = rank_geometry(w.geometry, tp_size);
  M3_RETURN_IF_ERROR(geom.status());

  PackedRankWeights p;
  p.geometry = geom.value();
  p.tp_size = tp_size;
  p.tp_rank = tp_rank;
  p.sparse = w.sparse;
  const Slab q{&w.q, h.q_begin, h.q_end};
  const Slab k{&w.k, h.kv_begin, h.kv_end};
  const Slab v{&w.v, h.kv_begin, h.kv_end};
  p.qkv = concat_rows({q, k, v});
  if (w.sparse) {
    const Slab iq{&w.index_q, h.kv_begin, h.kv_end};
    const Slab ik{&w.index_k, 0, 1};
    p.fused = concat_rows({q, k, v, iq, ik});
    p.index = concat_rows({iq, ik});
    p.index_q_norm = w.index_q_norm.clone();
    p.index_k_norm = w.index_k_norm.clone();
  }
  p.o = slice_cols(w.o, h.q_begin, h.q_end);
  p.q_norm = w.q_norm.clone();
  p.k_norm = w.k_norm.clone();
  if (w.sparse && p.fused.rows() != p.geometry.packed_width())
    return internal_error("packed rows ", p.fused.rows(), " != packed width ",
                          p.geometry.packed_width());
  return p;
}

}  // namespace m3attn
