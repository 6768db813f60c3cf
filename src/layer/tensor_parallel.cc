#include "layer/tensor_parallel.h"

#include <cstring>

#include "core/numeric.h"

namespace m3attn {

Status sum_rank_partials(const std::vector<TensorView>& partials, const TensorView& out) {
  M3_CHECK_ARG(!partials.empty(), "sum_rank_partials needs at least one partial");
  M3_RETURN_IF_ERROR(check_dtype(out, DType::kBF16, "reduced output"));
  M3_RETURN_IF_ERROR(check_ndim(out, 2, "reduced output"));
  M3_CHECK_ARG(out.device.type == DeviceType::kCPU, "sum_rank_partials needs CPU tensors");
  M3_CHECK_ARG(out.stride[1] == 1, "reduced output last stride must be 1, got ", out.stride[1]);
  const int64_t rows = out.shape[0], cols = out.shape[1];
  const auto out_lo = reinterpret_cast<uintptr_t>(out.data);
  const auto out_hi =
      out_lo + static_cast<uintptr_t>(rows > 0 ? ((rows - 1) * out.stride[0] + cols) * 2 : 0);
  for (const TensorView& p : partials) {
    M3_RETURN_IF_ERROR(check_dtype(p, DType::kBF16, "rank partial"));
    M3_RETURN_IF_ERROR(check_shape(p, {rows, cols}, "rank partial"));
    M3_CHECK_ARG(p.device.type == DeviceType::kCPU, "sum_rank_partials needs CPU tensors");
    M3_CHECK_ARG(p.stride[1] == 1, "rank partial last stride must be 1, got ", p.stride[1]);
    const auto lo = reinterpret_cast<uintptr_t>(p.data);
    const auto hi =
        lo + static_cast<uintptr_t>(rows > 0 ? ((rows - 1) * p.stride[0] + cols) * 2 : 0);
    M3_CHECK_ARG(rows == 0 || hi <= out_lo || out_hi <= lo, "reduced output overlaps a partial");
  }
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* o = out.ptr<uint16_t>() + m * out.stride[0];
    for (int64_t n = 0; n < cols; ++n) {
      float acc = 0.0f;
      for (const TensorView& p : partials)
        acc += bf16_to_float(p.ptr<const uint16_t>()[m * p.stride[0] + n]);
      o[n] = float_to_bf16(acc);
    }
  }
  return Status::Ok();
}

Result<TensorParallelLayer> TensorParallelLayer::create(const AttentionWeights& weights,
                                                        int tp_size, const TensorView& rope,
                                                        int64_t num_pages,
                                                        const MsaLayerOptions& options) {
  M3_CHECK_ARG(tp_size >= 1, "tensor-parallel size must be >= 1, got ", tp_size);
  TensorParallelLayer tp;
  for (int r = 0; r < tp_size; ++r) {
    Result<PackedRankWeights> packed = pack_rank(weights, tp_size, r);
    M3_RETURN_IF_ERROR(packed.status());
    PagePoolConfig cfg;
    cfg.num_pages = num_pages;
    cfg.n_kv = packed.value().geometry.n_kv;
    cfg.with_index = packed.value().sparse;
    Result<PagePool> pool = PagePool::create(cfg);
    M3_RETURN_IF_ERROR(pool.status());
    Result<MsaLayer> layer = MsaLayer::create(std::move(packed.value()), rope, options);
    M3_RETURN_IF_ERROR(layer.status());
    tp.ranks_.push_back(std::move(layer.value()));
    tp.pools_.push_back(std::move(pool.value()));
  }
  return tp;
}

Status TensorParallelLayer::step(const StepPlan& step, const TensorView& hidden,
                                 const TensorView& attn_out, std::vector<Tensor>* partials,
                                 std::vector<LayerTrace>* traces) {
  M3_CHECK_ARG(!ranks_.empty(), "tensor-parallel layer has no ranks");
  const int64_t T = step.num_tokens();
  const int64_t H = ranks_[0].geometry().hidden;
  // Plan every rank first, so that a rejected step writes no cache of any rank.
  std::vector<Tensor> outs;
  std::vector<LayerPlan> plans;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    outs.emplace_back(DType::kBF16, std::vector<int64_t>{T, H});
    LayerIO io;
    io.hidden = hidden;
    io.attn_out = outs.back().view();
    Result<TensorView> kv = pools_[r].kv_cache(0);
    M3_RETURN_IF_ERROR(kv.status());
    io.kv_cache = kv.value();
    if (ranks_[r].sparse()) {
      Result<TensorView> ic = pools_[r].index_cache(0);
      M3_RETURN_IF_ERROR(ic.status());
      io.index_cache = ic.value();
    }
    Result<LayerPlan> plan = ranks_[r].plan(step, io);
    M3_RETURN_IF_ERROR(plan.status());
    plans.push_back(std::move(plan.value()));
  }
  // Validate the reduction before any rank runs.
  std::vector<TensorView> views;
  for (const Tensor& t : outs) views.push_back(t.view());
  M3_RETURN_IF_ERROR(check_dtype(attn_out, DType::kBF16, "tensor-parallel attn_out"));
  M3_RETURN_IF_ERROR(check_shape(attn_out, {T, H}, "tensor-parallel attn_out"));
  if (traces) {
    traces->clear();
    traces->resize(ranks_.size());
  }
  for (size_t r = 0; r < ranks_.size(); ++r)
    M3_RETURN_IF_ERROR(ranks_[r].run(plans[r], traces ? &(*traces)[r] : nullptr));
  M3_RETURN_IF_ERROR(sum_rank_partials(views, attn_out));
  if (partials) *partials = std::move(outs);
  return Status::Ok();
}

}  // namespace m3attn
