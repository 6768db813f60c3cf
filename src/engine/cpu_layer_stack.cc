// The CPU LayerStack: the stages' CPU twins (MsaLayer) for every layer, one host PagePool with the
// layers interleaved in each page slot, and the host reference of the math between layers
// (stack_math.h). Slow by design: it is the oracle and the backend of machines without a GPU.
#include <chrono>
#include <utility>
#include <vector>

#include "cache/page_pool.h"
#include "core/rope.h"
#include "engine/layer_stack.h"
#include "engine/stack_math.h"
#include "layer/msa_layer.h"
#include "weights/packing.h"

namespace m3attn {

namespace {

PackedRankWeights clone_packed(const PackedRankWeights& w) {
  PackedRankWeights c;
  c.geometry = w.geometry;
  c.tp_size = w.tp_size;
  c.tp_rank = w.tp_rank;
  c.sparse = w.sparse;
  c.fused = w.fused.clone();
  c.qkv = w.qkv.clone();
  c.index = w.index.clone();
  c.o = w.o.clone();
  c.q_norm = w.q_norm.clone();
  c.k_norm = w.k_norm.clone();
  c.index_q_norm = w.index_q_norm.clone();
  c.index_k_norm = w.index_k_norm.clone();
  return c;
}

class CpuLayerStack final : public LayerStack {
 public:
  const char* backend() const override { return "cpu"; }
  const LayerStackConfig& config() const override { return config_; }

  void set_fused(bool fused) override {
    if (fused == config_.fuse_qkv_index_projection) return;
    MsaLayerOptions options;
    options.fuse_qkv_index_projection = fused;
    for (MsaLayer& layer : layers_) {
      if (!layer.sparse()) continue;  // dense layers have one path
      // Same packed weights, other projection path (create cannot fail on weights it accepted).
      Result<MsaLayer> other =
          MsaLayer::create(clone_packed(layer.weights()), rope_.view(), options);
      if (other.ok()) layer = std::move(other.value());
    }
    config_.fuse_qkv_index_projection = fused;
  }

  Status step(const StepPlan& plan, StackStepStats* stats) override {
    const auto start = std::chrono::steady_clock::now();
    const int64_t T = plan.num_tokens();
    const int hidden = config_.geometry.hidden;
    M3_CHECK_ARG(T <= config_.max_tokens_per_step, "step of ", T,
                 " tokens exceeds the stack's max_tokens_per_step ", config_.max_tokens_per_step);
    M3_CHECK_ARG(plan.num_requests() <= config_.max_requests_per_step, "step of ",
                 plan.num_requests(), " requests exceeds the stack's max_requests_per_step ",
                 config_.max_requests_per_step);
    M3_CHECK_ARG(plan.max_pages <= config_.max_pages_per_request, "page table width ",
                 plan.max_pages, " exceeds the stack's max_pages_per_request ",
                 config_.max_pages_per_request);
    M3_CHECK_ARG(static_cast<int64_t>(plan.query_start.size()) == plan.num_requests() + 1 &&
                     (plan.num_requests() == 0 || plan.query_start.back() == T),
                 "plan query_start must have R + 1 = ", plan.num_requests() + 1,
                 " entries ending at T = ", T);
    Tensor h(DType::kBF16, {T, hidden});
    Tensor x(DType::kBF16, {T, hidden});
    Tensor a(DType::kBF16, {T, hidden});
    embed_synthetic_tokens(plan, config_.seed, hidden, h.ptr<uint16_t>());
    for (size_t l = 0; l < layers_.size() && T > 0; ++l) {
      rmsnorm_unit_bf16(h.ptr<uint16_t>(), T, hidden, config_.geometry.eps, x.ptr<uint16_t>());
      LayerIO io;
      io.hidden = x.view();
      io.attn_out = a.view();
      Result<TensorView> kv = pool_.kv_cache(static_cast<int>(l));
      M3_RETURN_IF_ERROR(kv.status());
      io.kv_cache = kv.value();
      if (layers_[l].sparse()) {
        Result<TensorView> index = pool_.index_cache(static_cast<int>(l));
        M3_RETURN_IF_ERROR(index.status());
        io.index_cache = index.value();
      }
      M3_RETURN_IF_ERROR(layers_[l].step(plan, io));
      residual_add_bf16(h.ptr<uint16_t>(), a.ptr<uint16_t>(), T * hidden);
    }
    last_ = std::move(h);
    if (stats) {
      stats->step_us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count();
      stats->graph_replay = false;
    }
    return Status::Ok();
  }

  Result<Tensor> last_hidden() const override {
    if (last_.shape().empty()) return Tensor(DType::kBF16, {0, config_.geometry.hidden});
    return last_.clone();
  }

  static Result<std::unique_ptr<LayerStack>> create(const LayerStackConfig& config) {
    M3_RETURN_IF_ERROR(config.validate());
    if (config.tp_size != 1)
      return unsupported("the cpu layer stack runs TP1 only (tp_size ", config.tp_size,
                         "); tensor parallelism needs the cuda backend");
    auto stack = std::unique_ptr<CpuLayerStack>(new CpuLayerStack());
    stack->config_ = config;
    Result<Tensor> rope = make_rope_table(config.max_position, config.geometry.rope_theta);
    M3_RETURN_IF_ERROR(rope.status());
    stack->rope_ = std::move(rope.value());
    MsaLayerOptions options;
    options.fuse_qkv_index_projection = config.fuse_qkv_index_projection;
    for (int l = 0; l < config.num_layers(); ++l) {
      Result<AttentionWeights> w = random_attention_weights(
          config.geometry, layer_seed(config.seed, l), /*sparse=*/l >= config.num_dense);
      M3_RETURN_IF_ERROR(w.status());
      Result<PackedRankWeights> packed = pack_rank(w.value(), 1, 0);
      M3_RETURN_IF_ERROR(packed.status());
      Result<MsaLayer> layer =
          MsaLayer::create(std::move(packed.value()), stack->rope_.view(), options);
      M3_RETURN_IF_ERROR(layer.status());
      stack->layers_.push_back(std::move(layer.value()));
    }
    PagePoolConfig pc;
    pc.num_pages = config.num_pages;
    pc.num_layers = config.num_layers();
    pc.n_kv = config.geometry.n_kv;
    pc.with_index = config.num_sparse > 0;
    Result<PagePool> pool = PagePool::create(pc);
    M3_RETURN_IF_ERROR(pool.status());
    stack->pool_ = std::move(pool.value());
    return std::unique_ptr<LayerStack>(std::move(stack));
  }

 private:
  CpuLayerStack() = default;

  LayerStackConfig config_;
  Tensor rope_;  // f32 [max_position, 2, 32]; the layers point into it
  std::vector<MsaLayer> layers_;
  PagePool pool_;
  Tensor last_;
};

}  // namespace

Result<std::unique_ptr<LayerStack>> create_cpu_layer_stack(const LayerStackConfig& config) {
  return CpuLayerStack::create(config);
}

}  // namespace m3attn
