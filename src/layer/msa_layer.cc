#include "layer/msa_layer.h"

#include <chrono>
#include <cstring>

#include "cache/batch.h"
#include "cache/cache_view.h"
#include "core/rope.h"

namespace m3attn {

const char* layer_stage_name(LayerStage stage) {
  switch (stage) {
    case LayerStage::kQuantize:
      return "quantize";
    case LayerStage::kProjection:
      return "projection";
    case LayerStage::kProducer:
      return "producer";
    case LayerStage::kIndexer:
      return "indexer";
    case LayerStage::kAttention:
      return "attention";
    case LayerStage::kOutQuantize:
      return "o_quantize";
    case LayerStage::kOutProjection:
      return "o_proj";
    case LayerStage::kCount:
      break;
  }
  return "?";
}

double LayerTimes::total() const {
  double s = 0;
  for (double x : seconds) s += x;
  return s;
}

int64_t LayerPlan::workspace_bytes() const {
  int64_t b = 0;
  for (const Tensor* t : {&x_q_, &x_s_, &packed_, &packed_index_, &q_, &index_q_, &block_ids_,
                          &core_, &core_q_, &core_s_})
    b += t->nbytes();
  return b;
}

namespace {

Status check_cpu(const TensorView& t, const char* what) {
  M3_CHECK_ARG(t.device.type == DeviceType::kCPU, "the CPU layer needs ", what, " on the CPU, got ",
               t.device.to_string());
  return Status::Ok();
}

Status check_activation(const TensorView& t, int64_t rows, int64_t cols, const char* what) {
  M3_RETURN_IF_ERROR(check_cpu(t, what));
  M3_RETURN_IF_ERROR(check_dtype(t, DType::kBF16, what));
  M3_RETURN_IF_ERROR(check_shape(t, {rows, cols}, what));
  M3_CHECK_ARG(t.stride[1] == 1, what, " last stride must be 1, got ", t.stride[1]);
  M3_CHECK_ARG(rows == 0 || t.data != nullptr, what, " is null");
  return Status::Ok();
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

Result<MsaLayer> MsaLayer::create(PackedRankWeights weights, const TensorView& rope,
                                  const MsaLayerOptions& options) {
  M3_RETURN_IF_ERROR(weights.validate());
  M3_RETURN_IF_ERROR(validate_rope_table(rope));
  MsaLayer layer;
  layer.weights_ = std::move(weights);
  layer.rope_ = rope;
  layer.options_ = options;
  return layer;
}

Result<LayerPlan> MsaLayer::plan(const StepPlan& step, const LayerIO& io) const {
  const MsaGeometry& g = geometry();
  const int64_t T = step.num_tokens();
  const int64_t hidden = g.hidden;
  const int64_t q_width = int64_t{g.n_q} * kHeadDim;
  const bool sparse_layer = sparse();

  // ---- the batch, the caches and the I/O tensors ----
  M3_RETURN_IF_ERROR(check_activation(io.hidden, T, hidden, "layer hidden"));
  M3_RETURN_IF_ERROR(check_activation(io.attn_out, T, hidden, "layer attn_out"));
  M3_RETURN_IF_ERROR(check_cpu(io.kv_cache, "the KV cache"));
  M3_RETURN_IF_ERROR(validate_kv_cache(io.kv_cache, g.n_kv, "layer KV cache"));
  const int64_t num_pages = io.kv_cache.shape[0];
  if (sparse_layer) {
    M3_RETURN_IF_ERROR(check_cpu(io.index_cache, "the index cache"));
    M3_RETURN_IF_ERROR(validate_index_cache(io.index_cache, "layer index cache"));
    M3_CHECK_ARG(io.index_cache.shape[0] == num_pages, "layer index cache has ",
                 io.index_cache.shape[0], " pages but the KV cache has ", num_pages,
                 " (one page id names both)");
  }
  const BatchView batch = step.batch();
  M3_RETURN_IF_ERROR(validate_batch_contents(batch, num_pages, "layer"));
  M3_CHECK_ARG(static_cast<int64_t>(step.slots.size()) == T, "layer: plan has ", step.slots.size(),
               " slots for ", T, " tokens");
  for (int r = 0; r < step.num_requests(); ++r) {
    for (int32_t t = step.query_start[static_cast<size_t>(r)];
         t < step.query_start[static_cast<size_t>(r) + 1]; ++t) {
      const int32_t pos = step.positions[static_cast<size_t>(t)];
      M3_CHECK_ARG(pos < max_position(), "layer: token ", t, " position ", pos,
                   " is outside the RoPE table of ", max_position(), " positions");
      const int32_t page =
          step.page_table[static_cast<size_t>(r) * static_cast<size_t>(step.max_pages) +
                          static_cast<size_t>(pos / kPageSize)];
      const int64_t want = int64_t{page} * kPageSize + pos % kPageSize;
      M3_CHECK_ARG(step.slots[static_cast<size_t>(t)] == want, "layer: token ", t, " slot ",
                   step.slots[static_cast<size_t>(t)], " disagrees with the page table (page ",
                   page, " row ", pos % kPageSize, " = slot ", want, ")");
    }
  }

  LayerPlan p;
  p.tokens_ = T;
  p.sparse_ = sparse_layer;
  p.fused_ = fused();
  p.n_q_ = g.n_q;
  p.n_kv_ = g.n_kv;
  p.slots_ = step.slots_view();
  p.kv_cache_ = io.kv_cache;
  p.index_cache_ = io.index_cache;
  if (T == 0) return p;  // nothing to run

  // ---- workspaces ----
  const int64_t main_width = p.fused_ ? g.packed_width() : int64_t{g.n_q + 2 * g.n_kv} * kHeadDim;
  const int64_t index_width = int64_t{g.n_kv + 1} * kHeadDim;
  p.x_q_ = Tensor(DType::kE4M3, {T, hidden});
  p.x_s_ = Tensor(DType::kF32, {T, hidden / kQuantBlock});
  p.packed_ = Tensor(DType::kBF16, {T, main_width});
  if (sparse_layer && !p.fused_) p.packed_index_ = Tensor(DType::kBF16, {T, index_width});
  p.q_ = Tensor(DType::kE4M3, {T, g.n_q, kHeadDim});
  if (sparse_layer) {
    p.index_q_ = Tensor(DType::kE4M3, {T, g.n_kv, kHeadDim});
    p.block_ids_ = Tensor(DType::kI32, {T, g.n_kv, kTopK});
  }
  p.core_ = Tensor(DType::kBF16, {T, q_width});
  p.core_q_ = Tensor(DType::kE4M3, {T, q_width});
  p.core_s_ = Tensor(DType::kF32, {T, q_width / kQuantBlock});

  // ---- stage parameters ----
  p.quantize_in_.rows = T;
  p.quantize_in_.in = io.hidden;
  p.quantize_in_.out = p.x_q_.view();
  p.quantize_in_.scales = p.x_s_.view();
  M3_RETURN_IF_ERROR(validate_quantize(p.quantize_in_));

  const QuantizedMatrix& main_w = p.fused_ ? weights_.fused : weights_.qkv;
  p.gemm_main_ = {p.x_q_.view(), p.x_s_.view(), main_w.w.view(), main_w.scales.view(),
                  p.packed_.view()};
  M3_RETURN_IF_ERROR(validate_gemm(p.gemm_main_));
  if (sparse_layer && !p.fused_) {
    p.gemm_index_ = {p.x_q_.view(), p.x_s_.view(), weights_.index.w.view(),
                     weights_.index.scales.view(), p.packed_index_.view()};
    M3_RETURN_IF_ERROR(validate_gemm(p.gemm_index_));
  }

  ProducerParams common;
  common.n_q = g.n_q;
  common.n_kv = g.n_kv;
  common.eps = g.eps;
  common.num_tokens = T;
  common.positions = step.positions_view();
  common.slots = step.slots_view();
  common.rope = rope_;
  p.producer_main_ = common;
  p.producer_main_.mode = p.fused_ ? ProducerMode::kFused : ProducerMode::kMain;
  p.producer_main_.packed = p.packed_.view();
  p.producer_main_.q_norm = weights_.q_norm.view();
  p.producer_main_.k_norm = weights_.k_norm.view();
  p.producer_main_.q_out = p.q_.view();
  p.producer_main_.kv_cache = io.kv_cache;
  if (p.fused_) {
    p.producer_main_.iq_norm = weights_.index_q_norm.view();
    p.producer_main_.ik_norm = weights_.index_k_norm.view();
    p.producer_main_.iq_out = p.index_q_.view();
    p.producer_main_.index_cache = io.index_cache;
  }
  M3_RETURN_IF_ERROR(validate_producer(p.producer_main_));
  if (sparse_layer && !p.fused_) {
    p.producer_index_ = common;
    p.producer_index_.mode = ProducerMode::kIndex;
    p.producer_index_.packed = p.packed_index_.view();
    p.producer_index_.iq_norm = weights_.index_q_norm.view();
    p.producer_index_.ik_norm = weights_.index_k_norm.view();
    p.producer_index_.iq_out = p.index_q_.view();
    p.producer_index_.index_cache = io.index_cache;
    M3_RETURN_IF_ERROR(validate_producer(p.producer_index_));
  }

  if (sparse_layer) {
    p.indexer_.n_kv = g.n_kv;
    p.indexer_.top_k = kTopK;
    p.indexer_.index_q = p.index_q_.view();
    p.indexer_.index_cache = io.index_cache;
    p.indexer_.batch = batch;
    p.indexer_.block_ids = p.block_ids_.view();
    M3_RETURN_IF_ERROR(validate_indexer(p.indexer_));
  }

  p.attention_.n_q = g.n_q;
  p.attention_.n_kv = g.n_kv;
  p.attention_.sparse = sparse_layer;
  p.attention_.q = p.q_.view();
  p.attention_.kv_cache = io.kv_cache;
  if (sparse_layer) p.attention_.block_ids = p.block_ids_.view();
  p.attention_.batch = batch;
  p.attention_.out = p.core_.view();
  M3_RETURN_IF_ERROR(validate_attention(p.attention_));

  p.quantize_core_.rows = T;
  p.quantize_core_.in = p.core_.view();
  p.quantize_core_.out = p.core_q_.view();
  p.quantize_core_.scales = p.core_s_.view();
  M3_RETURN_IF_ERROR(validate_quantize(p.quantize_core_));

  p.gemm_o_ = {p.core_q_.view(), p.core_s_.view(), weights_.o.w.view(), weights_.o.scales.view(),
               io.attn_out};
  M3_RETURN_IF_ERROR(validate_gemm(p.gemm_o_));
  return p;
}

namespace {

// Copies each token's stored K / V / index-K rows back out of the paged caches.
void gather_cache_rows(int64_t T, int n_kv, const int32_t* slots, const TensorView& kv,
                       const TensorView& ic, LayerTrace* trace) {
  trace->k = Tensor(DType::kE4M3, {T, n_kv, kHeadDim});
  trace->v = Tensor(DType::kE4M3, {T, n_kv, kHeadDim});
  const auto* kv_base = kv.ptr<const uint8_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t page = slots[t] / kPageSize;
    const int row = static_cast<int>(slots[t] % kPageSize);
    for (int h = 0; h < n_kv; ++h) {
      std::memcpy(trace->k.ptr<uint8_t>() + (t * n_kv + h) * kHeadDim,
                  kv_base + kv_cache_offset(kv, page, 0, h, row), kHeadDim);
      std::memcpy(trace->v.ptr<uint8_t>() + (t * n_kv + h) * kHeadDim,
                  kv_base + kv_cache_offset(kv, page, 1, h, row), kHeadDim);
    }
  }
  if (!ic.defined() || ic.data == nullptr) return;
  trace->index_k = Tensor(DType::kE4M3, {T, kHeadDim});
  const auto* ic_base = ic.ptr<const uint8_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t page = slots[t] / kPageSize;
    const int row = static_cast<int>(slots[t] % kPageSize);
    std::memcpy(trace->index_k.ptr<uint8_t>() + t * kHeadDim,
                ic_base + index_cache_offset(ic, page, row), kHeadDim);
  }
}

}  // namespace

Status MsaLayer::run(const LayerPlan& p, LayerTrace* trace, LayerTimes* times) const {
  M3_CHECK_ARG(p.n_q_ == geometry().n_q && p.n_kv_ == geometry().n_kv && p.sparse_ == sparse() &&
                   p.fused_ == fused(),
               "layer: the plan was built for another layer");
  LayerTimes local;
  const int64_t T = p.tokens_;
  if (T > 0) {
    auto timed = [&](LayerStage stage, auto&& fn) -> Status {
      const Clock::time_point t0 = Clock::now();
      Status s = fn();
      local.seconds[static_cast<size_t>(stage)] += seconds_since(t0);
      return s;
    };
    M3_RETURN_IF_ERROR(
        timed(LayerStage::kQuantize, [&] { return run_quantize_cpu(p.quantize_in_); }));
    M3_RETURN_IF_ERROR(timed(LayerStage::kProjection, [&] {
      M3_RETURN_IF_ERROR(run_gemm_cpu(p.gemm_main_));
      if (p.sparse_ && !p.fused_) M3_RETURN_IF_ERROR(run_gemm_cpu(p.gemm_index_));
      return Status::Ok();
    }));
    M3_RETURN_IF_ERROR(timed(LayerStage::kProducer, [&] {
      M3_RETURN_IF_ERROR(run_producer_cpu(p.producer_main_));
      if (p.sparse_ && !p.fused_) M3_RETURN_IF_ERROR(run_producer_cpu(p.producer_index_));
      return Status::Ok();
    }));
    if (p.sparse_)
      M3_RETURN_IF_ERROR(timed(LayerStage::kIndexer, [&] { return run_indexer_cpu(p.indexer_); }));
    M3_RETURN_IF_ERROR(
        timed(LayerStage::kAttention, [&] { return run_attention_cpu(p.attention_); }));
    M3_RETURN_IF_ERROR(
        timed(LayerStage::kOutQuantize, [&] { return run_quantize_cpu(p.quantize_core_); }));
    M3_RETURN_IF_ERROR(timed(LayerStage::kOutProjection, [&] { return run_gemm_cpu(p.gemm_o_); }));
  }
  if (times) *times = local;
  if (trace) {
    trace->times = local;
    trace->q = T > 0 ? p.q_.clone() : Tensor(DType::kE4M3, {0, p.n_q_, kHeadDim});
    trace->attn_core = T > 0 ? p.core_.clone() : Tensor(DType::kBF16, {0, int64_t{p.n_q_} * 128});
    if (p.sparse_) {
      trace->index_q = T > 0 ? p.index_q_.clone() : Tensor(DType::kE4M3, {0, p.n_kv_, kHeadDim});
      trace->block_ids = T > 0 ? p.block_ids_.clone() : Tensor(DType::kI32, {0, p.n_kv_, kTopK});
    } else {
      trace->index_q = Tensor();
      trace->block_ids = Tensor();
    }
    gather_cache_rows(T, p.n_kv_, p.slots_.ptr<const int32_t>(), p.kv_cache_,
                      p.sparse_ ? p.index_cache_ : TensorView(), trace);
    if (!p.sparse_) trace->index_k = Tensor();
  }
  return Status::Ok();
}

Status MsaLayer::step(const StepPlan& step, const LayerIO& io, LayerTrace* trace,
                      LayerTimes* times) const {
  Result<LayerPlan> p = plan(step, io);
  M3_RETURN_IF_ERROR(p.status());
  return run(p.value(), trace, times);
}

}  // namespace m3attn
