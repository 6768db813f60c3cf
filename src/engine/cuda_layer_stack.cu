// The CUDA LayerStack (layer_stack.h): CudaMsaLayers for every layer sharing one workspace and one
// persistent step metadata block, a device pool with the layers interleaved in each page slot
// (PoolLayout over a device base), the synthetic embedding and residual + RMSNorm kernels
// (residual_norm.h), and CUDA-graph decode.
//
// A step enqueues on the stack's stream:
//   embed(h) ; for l: residual_rmsnorm(h [+= a_{l-1}], -> x) ; layer_l(x -> a_l) ; h += a_last
// where, with config.fuse_input_quantize (default), the RMSNorm kernel writes layer l's quantized
// input (E4M3 + 1x128 scales) instead of x and the layer skips its own quantize stage.
// Generation-only steps run at a padded bucket shape: Rb = the smallest power of two >= R (capped
// at max_requests_per_step) and Tb = Rb * (1 + draft_len); the first step of each (Rb, draft_len,
// fused) is captured into a graph and every later one replays it after uploading its metadata
// (padding tokens: slot -1, position 0; padding requests empty; see CudaStepMetadata). Steps with
// context chunks (prefill, mixed) and buckets whose Tb exceeds the token capacity run at their own
// shape: each layer's front (quantize, projection, producers: per-token work whose launches depend
// only on T) replays a graph captured at that exact T (capture_mixed_front; the graphs of the last
// kMaxFrontGraphShapes token counts are kept: with chunked prefill most mixed steps fill the token
// budget, so T repeats), and the downstream stages, whose launches depend on the requests, run
// eagerly. Padding T to a bucket would cost more GEMM and producer rows than the launches save.
// step() records CUDA events around the enqueued work and reports their elapsed time.
//
// Tensor parallelism (config.tp_size > 1): every layer holds this rank's pack_rank shard, the pool
// and the workspace have the rank geometry (n_q / P query heads, its KV heads), and after each
// layer the bf16 o_proj partial [Tp, hidden] is summed over the ranks in place (NCCL all-reduce on
// the stack's stream, captured into the decode graphs with the rest of the step), so every rank
// holds the full layer output for the residual add.
#include <cuda_runtime.h>

#include <algorithm>
#include <future>
#include <map>
#include <memory>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cache/page_pool.h"
#include "core/cuda_check.h"
#include "core/rope.h"
#include "dist/communicator.h"
#include "engine/layer_stack.h"
#include "engine/residual_norm.h"
#include "layer/cuda_msa_layer.h"
#include "weights/packing.h"

namespace m3attn {

namespace {

class CudaLayerStack final : public LayerStack {
 public:
  ~CudaLayerStack() override {
    if (stream_) cudaStreamSynchronize(stream_);
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    for (auto& [key, exec] : front_graphs_) cudaGraphExecDestroy(exec);
    if (copied_) cudaEventDestroy(copied_);
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
    if (staging_) cudaFreeHost(staging_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  const char* backend() const override { return "cuda"; }
  const LayerStackConfig& config() const override { return config_; }

  void set_fused(bool fused) override {
    config_.fuse_qkv_index_projection = fused;
    for (auto& l : layers_) l->set_fused(fused);
    // Graphs are keyed by the fused flag too, so the other variant's graphs stay valid.
  }

  Status step(const StepPlan& plan, StackStepStats* stats) override {
    const int64_t T = plan.num_tokens();
    const int R = plan.num_requests();
    M3_CHECK_ARG(T <= config_.max_tokens_per_step, "step of ", T,
                 " tokens exceeds the stack's max_tokens_per_step ", config_.max_tokens_per_step);
    M3_CHECK_ARG(R <= config_.max_requests_per_step, "step of ", R,
                 " requests exceeds the stack's max_requests_per_step ",
                 config_.max_requests_per_step);
    M3_CHECK_ARG(plan.max_pages <= config_.max_pages_per_request, "page table width ",
                 plan.max_pages, " exceeds the stack's max_pages_per_request ",
                 config_.max_pages_per_request);
    M3_CHECK_ARG(static_cast<int64_t>(plan.query_start.size()) == R + 1 &&
                     (R == 0 || plan.query_start.back() == T),
                 "plan query_start must have R + 1 = ", R + 1, " entries ending at T = ", T);

    // Shape: a graph bucket for generation-only steps, the step's own otherwise.
    CudaStepShape shape{T, R};
    bool use_graph = false;
    if (R > 0 && plan.num_context_requests == 0 && T > 0) {
      int rb = 1;
      while (rb < R) rb *= 2;
      rb = std::min(rb, config_.max_requests_per_step);
      const int64_t tb = int64_t{rb} * (1 + plan.draft_len);
      if (tb <= config_.max_tokens_per_step && T == int64_t{R} * (1 + plan.draft_len)) {
        shape = {tb, rb};
        use_graph = true;
      }
    }
    M3_RETURN_IF_ERROR(
        meta_->upload(plan, config_.num_pages, config_.max_position, shape, stream_));
    // Token -> request id (padding tokens: -1), through the same kind of pinned staging.
    M3_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(copied_));
    for (int r = 0; r < R; ++r)
      for (int32_t t = plan.query_start[static_cast<size_t>(r)];
           t < plan.query_start[static_cast<size_t>(r) + 1]; ++t)
        staging_[t] = plan.request_ids[static_cast<size_t>(r)];
    std::fill(staging_ + T, staging_ + shape.tokens, int64_t{-1});
    if (shape.tokens > 0)
      M3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(token_request_.data(), staging_,
                                              static_cast<size_t>(shape.tokens) * sizeof(int64_t),
                                              cudaMemcpyHostToDevice, stream_));
    M3_CUDA_RETURN_IF_ERROR(cudaEventRecord(copied_, stream_));

    M3_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_, stream_));
    bool replayed = false;
    if (use_graph) {
      const auto key =
          std::make_tuple(shape.requests, plan.draft_len, config_.fuse_qkv_index_projection);
      auto it = graphs_.find(key);
      if (it == graphs_.end()) {
        M3_RETURN_IF_ERROR(plan_layers(shape.tokens));
        cudaGraph_t graph = nullptr;
        M3_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
        const Status st = forward(shape.tokens);
        const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
        if (!st.ok()) {
          if (graph) cudaGraphDestroy(graph);
          return st;
        }
        M3_CUDA_RETURN_IF_ERROR(end);
        cudaGraphExec_t exec = nullptr;
        const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
        cudaGraphDestroy(graph);
        M3_CUDA_RETURN_IF_ERROR(inst);
        it = graphs_.emplace(key, exec).first;
      } else {
        replayed = true;
      }
      M3_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second, stream_));
    } else {
      M3_RETURN_IF_ERROR(plan_layers(shape.tokens));
      M3_RETURN_IF_ERROR(forward(shape.tokens, config_.capture_mixed_front));
    }
    M3_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop_, stream_));
    M3_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop_));
    float ms = 0;
    M3_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start_, stop_));
    last_tokens_ = T;
    if (stats) {
      stats->step_us = ms * 1e3;
      stats->graph_replay = replayed;
    }
    return Status::Ok();
  }

  Result<Tensor> last_hidden() const override {
    Tensor h(DType::kBF16, {last_tokens_, config_.geometry.hidden});
    if (h.nbytes() > 0) {
      M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      M3_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(h.data(), h_.data(), static_cast<size_t>(h.nbytes()), cudaMemcpyDeviceToHost));
    }
    return Result<Tensor>(std::move(h));
  }

  static Result<std::unique_ptr<LayerStack>> create(const LayerStackConfig& config) {
    M3_RETURN_IF_ERROR(config.validate());
    int count = 0;
    M3_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
    M3_CHECK_ARG(count > 0, "the cuda layer stack needs a CUDA device");

    std::unique_ptr<CudaLayerStack> s(new CudaLayerStack());
    s->config_ = config;
    CudaLayerCapacity cap;
    cap.max_tokens = config.max_tokens_per_step;
    cap.max_requests = config.max_requests_per_step;
    cap.max_pages = config.max_pages_per_request;
    M3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s->stream_, cudaStreamNonBlocking));
    M3_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s->copied_, cudaEventDisableTiming));
    M3_CUDA_RETURN_IF_ERROR(cudaEventCreate(&s->start_));
    M3_CUDA_RETURN_IF_ERROR(cudaEventCreate(&s->stop_));
    M3_CUDA_RETURN_IF_ERROR(cudaEventRecord(s->copied_, s->stream_));
    void* staging = nullptr;
    M3_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(&staging, static_cast<size_t>(cap.max_tokens) * sizeof(int64_t)));
    s->staging_ = static_cast<int64_t*>(staging);

    Result<std::unique_ptr<CudaStepMetadata>> meta = CudaStepMetadata::create(cap);
    M3_RETURN_IF_ERROR(meta.status());
    s->meta_ = std::move(meta.value());
    Result<MsaGeometry> rank_geom = rank_geometry(config.geometry, config.tp_size);
    M3_RETURN_IF_ERROR(rank_geom.status());
    Result<std::shared_ptr<CudaLayerWorkspace>> ws =
        CudaLayerWorkspace::create(rank_geom.value(), cap);
    M3_RETURN_IF_ERROR(ws.status());

    Result<Tensor> rope = make_rope_table(config.max_position, config.geometry.rope_theta);
    M3_RETURN_IF_ERROR(rope.status());
    MsaLayerOptions options;
    options.fuse_qkv_index_projection = config.fuse_qkv_index_projection;
    // Random weights are made on the host, several layers at a time (about 4 s per M3 layer on
    // one core); each layer's numbers depend only on its own seed.
    auto make_weights = [&config](int l) -> Result<PackedRankWeights> {
      Result<AttentionWeights> w = random_attention_weights(
          config.geometry, layer_seed(config.seed, l), /*sparse=*/l >= config.num_dense);
      M3_RETURN_IF_ERROR(w.status());
      return pack_rank(w.value(), config.tp_size, config.tp_rank);
    };
    const int batch =
        static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency() / 2, 1u, 8u));
    for (int l0 = 0; l0 < config.num_layers(); l0 += batch) {
      const int l1 = std::min(config.num_layers(), l0 + batch);
      std::vector<std::future<Result<PackedRankWeights>>> weights;
      for (int l = l0; l < l1; ++l)
        weights.push_back(std::async(std::launch::async, make_weights, l));
      for (auto& f : weights) {
        Result<PackedRankWeights> packed = f.get();
        M3_RETURN_IF_ERROR(packed.status());
        Result<std::unique_ptr<CudaMsaLayer>> layer =
            CudaMsaLayer::create(packed.value(), rope.value().view(), cap, options, ws.value());
        M3_RETURN_IF_ERROR(layer.status());
        layer.value()->set_external_input_quantize(config.fuse_input_quantize);
        layer.value()->set_programmatic_launch(config.programmatic_launch);
        layer.value()->set_attention_quantize(config.attention_quantize);
        s->layers_.push_back(std::move(layer.value()));
      }
    }

    PagePoolConfig pc;
    pc.num_pages = config.num_pages;
    pc.num_layers = config.num_layers();
    pc.n_kv = rank_geom.value().n_kv;
    pc.with_index = config.num_sparse > 0;
    Result<PoolLayout> layout = PoolLayout::create(pc);
    M3_RETURN_IF_ERROR(layout.status());
    s->layout_ = layout.value();
    const size_t pool_bytes = static_cast<size_t>(s->layout_.total_bytes());
    Result<CudaBuffer> pool = CudaBuffer::create(pool_bytes);
    M3_RETURN_IF_ERROR(pool.status());
    s->pool_ = std::move(pool.value());
    M3_CUDA_RETURN_IF_ERROR(cudaMemset(s->pool_.data(), 0, pool_bytes));

    const size_t rows = static_cast<size_t>(cap.padded_rows());
    const size_t row_bytes = static_cast<size_t>(config.geometry.hidden) * 2;
    for (CudaBuffer* b : {&s->h_, &s->x_}) {
      Result<CudaBuffer> r = CudaBuffer::create(rows * row_bytes);
      M3_RETURN_IF_ERROR(r.status());
      *b = std::move(r.value());
      M3_CUDA_RETURN_IF_ERROR(cudaMemset(b->data(), 0, b->bytes()));
    }
    Result<CudaBuffer> tr = CudaBuffer::create(static_cast<size_t>(cap.max_tokens) * 8);
    M3_RETURN_IF_ERROR(tr.status());
    s->token_request_ = std::move(tr.value());
    M3_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    return std::unique_ptr<LayerStack>(std::move(s));
  }

 private:
  CudaLayerStack() = default;

  Status plan_layers(int64_t tokens) {
    int dev = 0;
    M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
    const Device d = Device::cuda(dev);
    const TensorView x = TensorView::contiguous(x_.data(), DType::kBF16,
                                                {tokens, int64_t{config_.geometry.hidden}}, d);
    for (size_t l = 0; l < layers_.size(); ++l) {
      CudaLayerCaches c;
      c.kv_cache = layout_.kv_cache_view(pool_.data(), static_cast<int>(l), d);
      if (layers_[l]->sparse())
        c.index_cache = layout_.index_cache_view(pool_.data(), static_cast<int>(l), d);
      M3_RETURN_IF_ERROR(layers_[l]->plan(*meta_, x, c));
    }
    return Status::Ok();
  }

  // Launches layer l's front half: replays the graph captured at `tokens` (capturing it first
  // when missing; the graphs of the oldest token count go when a new count would exceed
  // kMaxFrontGraphShapes). The layer's plan must be at `tokens` rows.
  Status run_front_graph(size_t l, int64_t tokens) {
    const bool fused = config_.fuse_qkv_index_projection;
    const auto key = std::make_tuple(static_cast<int>(l), tokens, fused);
    auto it = front_graphs_.find(key);
    if (it == front_graphs_.end()) {
      if (std::find(front_shapes_.begin(), front_shapes_.end(), tokens) == front_shapes_.end()) {
        if (front_shapes_.size() == kMaxFrontGraphShapes) {
          const int64_t oldest = front_shapes_.front();
          front_shapes_.erase(front_shapes_.begin());
          for (auto g = front_graphs_.begin(); g != front_graphs_.end();) {
            if (std::get<1>(g->first) == oldest) {
              cudaGraphExecDestroy(g->second);
              g = front_graphs_.erase(g);
            } else {
              ++g;
            }
          }
        }
        front_shapes_.push_back(tokens);
      }
      cudaGraph_t graph = nullptr;
      M3_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      const Status st = layers_[l]->run_front(stream_);
      const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
      if (!st.ok()) {
        if (graph) cudaGraphDestroy(graph);
        return st;
      }
      M3_CUDA_RETURN_IF_ERROR(end);
      cudaGraphExec_t exec = nullptr;
      const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      M3_CUDA_RETURN_IF_ERROR(inst);
      it = front_graphs_.emplace(key, exec).first;
    }
    M3_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second, stream_));
    return Status::Ok();
  }

  // Enqueues the whole step at `tokens` rows on stream_ (plans must match); with front_graphs,
  // each layer's front half runs as a graph (run_front_graph) and the rest eagerly.
  Status forward(int64_t tokens, bool front_graphs = false) {
    const int hidden = config_.geometry.hidden;
    const float eps = config_.geometry.eps;
    uint16_t* h = h_.ptr<uint16_t>();
    uint16_t* x = x_.ptr<uint16_t>();
    M3_RETURN_IF_ERROR(run_synthetic_embed_cuda(config_.seed, token_request_.ptr<int64_t>(),
                                                meta_->positions().ptr<int32_t>(), tokens, hidden,
                                                h, stream_));
    const uint16_t* a = nullptr;
    const bool pdl = config_.programmatic_launch;
    for (size_t l = 0; l < layers_.size(); ++l) {
      CudaMsaLayer* layer = layers_[l].get();
      if (config_.fuse_input_quantize) {
        // Writes the layer's quantized input directly (the layer skips its quantize stage).
        if (tokens > 0)
          M3_RETURN_IF_ERROR(
              run_residual_rmsnorm_quantize_cuda(h, a, layer->input_quantize(), eps, stream_, pdl));
      } else {
        M3_RETURN_IF_ERROR(run_residual_rmsnorm_cuda(h, a, x, tokens, hidden, eps, stream_, pdl));
      }
      if (front_graphs && tokens > 0) {
        M3_RETURN_IF_ERROR(run_front_graph(l, tokens));
        M3_RETURN_IF_ERROR(layer->run_back(stream_));
      } else {
        M3_RETURN_IF_ERROR(layer->run(stream_));
      }
      if (config_.tp_size > 1)
        M3_RETURN_IF_ERROR(
            config_.tp_comm->all_reduce_bf16_sum(layer->attn_out().data, tokens * hidden, stream_));
      a = layer->attn_out().ptr<const uint16_t>();
    }
    return run_residual_rmsnorm_cuda(h, a, nullptr, tokens, hidden, eps, stream_, pdl);
  }

  LayerStackConfig config_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t copied_ = nullptr, start_ = nullptr, stop_ = nullptr;
  int64_t* staging_ = nullptr;
  std::unique_ptr<CudaStepMetadata> meta_;
  std::vector<std::unique_ptr<CudaMsaLayer>> layers_;
  PoolLayout layout_;
  CudaBuffer pool_, h_, x_, token_request_;
  std::map<std::tuple<int, int, bool>, cudaGraphExec_t> graphs_;
  static constexpr size_t kMaxFrontGraphShapes = 4;
  std::map<std::tuple<int, int64_t, bool>, cudaGraphExec_t> front_graphs_;  // (layer, T, fused)
  std::vector<int64_t> front_shapes_;  // token counts with front graphs, oldest first
  int64_t last_tokens_ = 0;
};

}  // namespace

Result<std::unique_ptr<LayerStack>> create_cuda_layer_stack(const LayerStackConfig& config) {
  return CudaLayerStack::create(config);
}

}  // namespace m3attn
