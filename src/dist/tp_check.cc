#include "dist/tp_check.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "core/numeric.h"
#include "dist/communicator.h"
#include "stages/quantize/quantize.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "cache/page_allocator.h"
#include "cache/page_pool.h"
#include "cache/step_plan.h"
#include "core/cuda_check.h"
#include "core/rope.h"
#include "layer/cuda_msa_layer.h"
#include "layer/tensor_parallel.h"
#include "weights/packing.h"
#endif

namespace m3attn {

namespace {

Status check_bf16_2d(const Tensor& t, int64_t rows, int64_t cols, const char* what) {
  M3_CHECK_ARG(t.dtype() == DType::kBF16 && t.shape().size() == 2 && t.shape()[0] == rows &&
                   t.shape()[1] == cols,
               what, " must be bf16 [", rows, ", ", cols, "]");
  return Status::Ok();
}

// The core quantized as the o_proj GEMM sees it (1x128 E4M3 + fp32 scales), decoded to floats:
// a [T, K] (E4M3 values) and s [T, K/128].
Status quantized_core(const Tensor& core, std::vector<float>* a, std::vector<float>* s) {
  const int64_t T = core.shape()[0], K = core.shape()[1];
  Tensor q(DType::kE4M3, {T, K}), sc(DType::kF32, {T, K / kQuantBlock});
  QuantizeParams p;
  p.rows = T;
  p.in = core.view();
  p.out = q.view();
  p.scales = sc.view();
  M3_RETURN_IF_ERROR(run_quantize_cpu(p));
  a->resize(static_cast<size_t>(T * K));
  for (int64_t i = 0; i < T * K; ++i)
    (*a)[static_cast<size_t>(i)] = e4m3_to_float(q.ptr<uint8_t>()[i]);
  s->assign(sc.ptr<float>(), sc.ptr<float>() + T * (K / kQuantBlock));
  return Status::Ok();
}

void parallel_for(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& body) {
  int nt = threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
  nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nt, n)));
  if (nt == 1) {
    body(0, n);
    return;
  }
  std::vector<std::thread> pool;
  for (int i = 0; i < nt; ++i) pool.emplace_back(body, n * i / nt, n * (i + 1) / nt);
  for (std::thread& t : pool) t.join();
}

}  // namespace

std::string TpComparison::to_text() const {
  std::ostringstream os;
  os << "TP" << tp_size << " vs TP1, " << tokens << " tokens: max |diff| " << std::scientific
     << std::setprecision(3) << max_abs << " (max |ref| " << max_ref << "), rel L2 " << rel_l2
     << ", worst err/bound " << std::fixed << std::setprecision(4) << worst_ratio
     << " (without the in-block accumulation term " << worst_tight_ratio << "), " << identical
     << "/" << elements << " bit-identical, " << core_differ << " core elements differ, "
     << violations << " past the bound: " << (pass() ? "PASS" : "FAIL");
  return os.str();
}

Result<TpComparison> compare_tp_output(const Tensor& out_tp, const Tensor& out_1,
                                       const std::vector<Tensor>& partials, const Tensor& core_tp,
                                       const Tensor& core_1, const QuantizedMatrix& o,
                                       const TpBoundModel& model) {
  M3_RETURN_IF_ERROR(o.validate("o_proj"));
  M3_CHECK_ARG(!partials.empty(), "compare_tp_output needs the rank partials");
  M3_CHECK_ARG(out_1.shape().size() == 2, "TP1 output must be 2-d");
  const int64_t T = out_1.shape()[0], N = o.rows(), K = o.cols();
  M3_RETURN_IF_ERROR(check_bf16_2d(out_1, T, N, "TP1 output"));
  M3_RETURN_IF_ERROR(check_bf16_2d(out_tp, T, N, "TP output"));
  M3_RETURN_IF_ERROR(check_bf16_2d(core_1, T, K, "TP1 attention core"));
  M3_RETURN_IF_ERROR(check_bf16_2d(core_tp, T, K, "TP attention core"));
  for (const Tensor& p : partials) M3_RETURN_IF_ERROR(check_bf16_2d(p, T, N, "rank partial"));
  M3_CHECK_ARG(model.block_accum_eps >= 0, "block_accum_eps must be >= 0");
  const int P = static_cast<int>(partials.size());
  const int64_t nb = K / kQuantBlock;

  TpComparison c;
  c.tp_size = P;
  c.tokens = T;
  c.elements = T * N;
  for (int64_t i = 0; i < T * K; ++i)
    c.core_differ += core_tp.ptr<uint16_t>()[i] != core_1.ptr<uint16_t>()[i];

  std::vector<float> a1, s1, ap, sp;
  M3_RETURN_IF_ERROR(quantized_core(core_1, &a1, &s1));
  const bool two = c.core_differ > 0;
  if (two) M3_RETURN_IF_ERROR(quantized_core(core_tp, &ap, &sp));
  // Exact sums E (double) and absolute sums sum A, [T, N] each.
  std::vector<double> e1(static_cast<size_t>(T * N)), ep, abs_sum(static_cast<size_t>(T * N));
  if (two) ep.resize(static_cast<size_t>(T * N));
  const uint8_t* w = o.w.ptr<uint8_t>();
  const float* ws = o.scales.ptr<float>();
  parallel_for(N, model.threads, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t k = 0; k < K; ++k) row[static_cast<size_t>(k)] = e4m3_to_float(w[n * K + k]);
      const float* wsc = ws + (n / kQuantBlock) * nb;
      for (int64_t t = 0; t < T; ++t) {
        for (int side = 0; side < (two ? 2 : 1); ++side) {
          const float* a = (side == 0 ? a1 : ap).data() + t * K;
          const float* s = (side == 0 ? s1 : sp).data() + t * nb;
          double exact = 0, absum = 0;
          for (int64_t kb = 0; kb < nb; ++kb) {
            double dot = 0, adot = 0;
            for (int64_t i = kb * kQuantBlock; i < (kb + 1) * kQuantBlock; ++i) {
              const double prod = double{a[i]} * row[static_cast<size_t>(i)];
              dot += prod;
              adot += std::fabs(prod);
            }
            const double scale = double{s[kb]} * wsc[kb];
            exact += dot * scale;
            absum += adot * std::fabs(scale);
          }
          const size_t at = static_cast<size_t>(t * N + n);
          (side == 0 ? e1 : ep)[at] = exact;
          abs_sum[at] += absum;
        }
      }
    }
  });

  const double u = std::ldexp(1.0, -8), e32 = std::ldexp(1.0, -24);
  const double reduce_u = u + (P - 1) * u * std::pow(1 + u, P);
  double num = 0, den = 0;
  for (int64_t i = 0; i < T * N; ++i) {
    const size_t at = static_cast<size_t>(i);
    const double x = bf16_to_float(out_tp.ptr<uint16_t>()[i]);
    const double y = bf16_to_float(out_1.ptr<uint16_t>()[i]);
    double sum_p = 0;
    for (const Tensor& p : partials) sum_p += std::fabs(bf16_to_float(p.ptr<uint16_t>()[i]));
    const double sa = two ? abs_sum[at] : 2 * abs_sum[at];  // sum A of both sides
    const double shift = two ? std::fabs(ep[at] - e1[at]) : 0.0;
    const double tight = u * (std::fabs(x) + std::fabs(y)) + reduce_u * sum_p +
                         (nb + kQuantBlock) * e32 * (1 + u) * sa + shift;
    const double bound = tight + model.block_accum_eps * sa;
    const double err = std::fabs(x - y);
    if (!(err <= bound)) ++c.violations;  // NaN fails
    c.identical += out_tp.ptr<uint16_t>()[i] == out_1.ptr<uint16_t>()[i];
    c.max_abs = std::max(c.max_abs, std::isfinite(err) ? err : INFINITY);
    c.max_ref = std::max(c.max_ref, std::fabs(y));
    if (bound > 0) c.worst_ratio = std::max(c.worst_ratio, err / bound);
    if (tight > 0) c.worst_tight_ratio = std::max(c.worst_tight_ratio, err / tight);
    num += (x - y) * (x - y);
    den += y * y;
  }
  c.rel_l2 = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
  if (!std::isfinite(num)) c.violations = std::max<int64_t>(c.violations, 1);
  return c;
}

bool TpCheckReport::pass() const {
  if (steps.empty()) return false;
  for (const TpComparison& c : steps)
    if (!c.pass()) return false;
  return !graph_checked || graph_identical;
}

std::string TpCheckReport::to_text() const {
  std::ostringstream os;
  for (size_t i = 0; i < steps.size(); ++i)
    os << "step " << i << ": " << steps[i].to_text() << "\n";
  if (graph_checked)
    os << "CUDA graph replay of the last step (layer + all-reduce captured): "
       << (graph_identical ? "byte-identical to eager" : "DIFFERS from eager") << "\n";
  os << (pass() ? "PASS" : "FAIL") << "\n";
  return os.str();
}

std::string TpCheckReport::to_json() const {
  nlohmann::json j;
  nlohmann::json arr = nlohmann::json::array();
  for (const TpComparison& c : steps)
    arr.push_back({{"tp", c.tp_size},
                   {"tokens", c.tokens},
                   {"elements", c.elements},
                   {"identical", c.identical},
                   {"core_differ", c.core_differ},
                   {"violations", c.violations},
                   {"max_abs", c.max_abs},
                   {"max_ref", c.max_ref},
                   {"rel_l2", c.rel_l2},
                   {"worst_err_over_bound", c.worst_ratio},
                   {"worst_err_over_tight_bound", c.worst_tight_ratio},
                   {"pass", c.pass()}});
  j["steps"] = arr;
  j["graph_checked"] = graph_checked;
  j["graph_identical"] = graph_identical;
  j["pass"] = pass();
  return j.dump();
}

#if defined(M3ATTN_WITH_CUDA)

namespace {

// Deterministic bf16 hidden rows for step `step` (the same on every rank).
Tensor step_hidden(uint64_t seed, int step, int64_t T, int64_t hidden) {
  std::mt19937_64 gen(seed * 7919ull + 104729ull * static_cast<uint64_t>(step + 1));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Tensor h(DType::kBF16, {T, hidden});
  for (int64_t i = 0; i < T * hidden; ++i) h.ptr<uint16_t>()[i] = float_to_bf16(nd(gen));
  return h;
}

Status download(const void* src, int64_t bytes, Tensor* dst) {
  M3_CHECK_ARG(dst->nbytes() == bytes, "download of ", bytes, " bytes into ", dst->nbytes());
  if (bytes > 0)
    M3_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(dst->data(), src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost));
  return Status::Ok();
}

struct DevicePool {
  PoolLayout layout;
  CudaBuffer buf;
  CudaLayerCaches caches;
};

Status make_pool(int64_t pages, int n_kv, bool sparse, Device dev, DevicePool* p) {
  PagePoolConfig pc;
  pc.num_pages = pages;
  pc.num_layers = 1;
  pc.n_kv = n_kv;
  pc.with_index = sparse;
  Result<PoolLayout> l = PoolLayout::create(pc);
  M3_RETURN_IF_ERROR(l.status());
  p->layout = l.value();
  Result<CudaBuffer> b = CudaBuffer::create(static_cast<size_t>(p->layout.total_bytes()));
  M3_RETURN_IF_ERROR(b.status());
  p->buf = std::move(b.value());
  M3_CUDA_RETURN_IF_ERROR(cudaMemset(p->buf.data(), 0, p->buf.bytes()));
  p->caches.kv_cache = p->layout.kv_cache_view(p->buf.data(), 0, dev);
  if (sparse) p->caches.index_cache = p->layout.index_cache_view(p->buf.data(), 0, dev);
  return Status::Ok();
}

// Owns a stream and graph objects; releases them on every path.
struct CudaScope {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~CudaScope() {
    if (stream) cudaStreamSynchronize(stream);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (stream) cudaStreamDestroy(stream);
  }
};

// Host side of a check, identical on every rank: weights, the three steps, the RoPE table and the
// layer capacity.
struct CheckSetup {
  AttentionWeights weights;
  std::vector<StepPlan> plans;
  int64_t num_pages = 0, max_position = 0, max_tokens = 0;
  int width = 0;
  Tensor rope;
  CudaLayerCapacity cap;
  MsaLayerOptions layer_options;
};

Status make_setup(const TpCheckOptions& o, int tp_size, CheckSetup* s) {
  const MsaGeometry& g = o.geometry;
  M3_RETURN_IF_ERROR(g.validate());
  M3_RETURN_IF_ERROR(rank_geometry(g, tp_size).status());
  M3_CHECK_ARG(o.prompt1 >= 1 && o.prompt2 >= 1 && o.chunk >= 1 && o.draft_len >= 0,
               "tp check: prompts and chunk must be >= 1 and draft >= 0, got ", o.prompt1, ", ",
               o.prompt2, ", ", o.chunk, ", ", o.draft_len);
  Result<AttentionWeights> w = random_attention_weights(g, o.seed, o.sparse);
  M3_RETURN_IF_ERROR(w.status());
  s->weights = std::move(w.value());
  const int64_t gen = 1 + o.draft_len;
  const int64_t len1 = o.prompt1 + o.chunk + gen, len2 = o.prompt2 + 2 * gen;
  s->width = static_cast<int>(CacheManager::pages_for(std::max(len1, len2)));
  s->num_pages = CacheManager::pages_for(len1) + CacheManager::pages_for(len2) + 2;
  s->max_position = std::max(len1, len2) + 1;
  CacheManager cache(s->num_pages);
  const StepDescription descs[3] = {
      {{{1, 0, o.prompt1}, {2, 0, o.prompt2}}, {}, 0},
      {{{1, o.prompt1, o.chunk}}, {{2, o.prompt2}}, o.draft_len},
      {{}, {{1, o.prompt1 + o.chunk}, {2, o.prompt2 + gen}}, o.draft_len}};
  PlanOptions po;
  po.page_table_width = s->width;
  for (const StepDescription& d : descs) {
    Result<StepPlan> p = plan_step(cache, d, po);
    M3_RETURN_IF_ERROR(p.status());
    s->max_tokens = std::max(s->max_tokens, p.value().num_tokens());
    s->plans.push_back(std::move(p.value()));
  }
  Result<Tensor> rope = make_rope_table(s->max_position, g.rope_theta);
  M3_RETURN_IF_ERROR(rope.status());
  s->rope = std::move(rope.value());
  s->cap.max_tokens = s->max_tokens;
  s->cap.max_requests = 2;
  s->cap.max_pages = s->width;
  s->layer_options.fuse_qkv_index_projection = o.fused;
  return Status::Ok();
}

// One rank's (or TP1's) layer with its pool; its workspace (activations and GEMM objects) is
// *workspace when set, otherwise a new one stored there for the next layer of the same geometry.
// Sharing is what makes P = 1 bit-identical to TP1 by construction: each Fp8BlockGemm object
// autotunes on measured times, so two objects of one shape may pick different kernels (equal only
// up to fp32 summation order); the layers of one geometry share them, as the layers of a stack do.
struct RankLayer {
  std::unique_ptr<CudaMsaLayer> layer;
  DevicePool pool;
};

Status make_rank_layer(const CheckSetup& s, bool sparse, int tp_size, int rank, Device dev,
                       std::shared_ptr<CudaLayerWorkspace>* workspace, RankLayer* out) {
  Result<PackedRankWeights> w = pack_rank(s.weights, tp_size, rank);
  M3_RETURN_IF_ERROR(w.status());
  Result<std::unique_ptr<CudaMsaLayer>> l =
      CudaMsaLayer::create(w.value(), s.rope.view(), s.cap, s.layer_options, *workspace);
  M3_RETURN_IF_ERROR(l.status());
  out->layer = std::move(l.value());
  *workspace = out->layer->workspace();
  return make_pool(s.num_pages, w.value().geometry.n_kv, sparse, dev, &out->pool);
}

// Uploads step s's hidden rows (bf16 [T, hidden]) and metadata.
Status upload_step(const TpCheckOptions& o, const CheckSetup& setup, size_t s, CudaBuffer& hidden,
                   CudaStepMetadata& meta, Device dev, cudaStream_t stream, TensorView* hv) {
  const StepPlan& plan = setup.plans[s];
  const int64_t T = plan.num_tokens(), H = o.geometry.hidden;
  const Tensor h = step_hidden(o.seed, static_cast<int>(s), T, H);
  M3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(hidden.data(), h.data(), static_cast<size_t>(h.nbytes()),
                                          cudaMemcpyHostToDevice, stream));
  M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));  // h is a temporary
  *hv = TensorView::contiguous(hidden.data(), DType::kBF16, {T, H}, dev);
  return meta.upload(plan, setup.num_pages, setup.max_position, {}, stream);
}

// Rank cores [P][T, qw] (one tensor each) side by side: [T, P * qw].
Tensor concat_cores(const std::vector<Tensor>& cores) {
  const int64_t P = static_cast<int64_t>(cores.size());
  const int64_t T = cores[0].shape()[0], qw = cores[0].shape()[1];
  Tensor out(DType::kBF16, {T, P * qw});
  for (int64_t r = 0; r < P; ++r)
    for (int64_t t = 0; t < T; ++t)
      std::copy(cores[static_cast<size_t>(r)].ptr<uint16_t>() + t * qw,
                cores[static_cast<size_t>(r)].ptr<uint16_t>() + (t + 1) * qw,
                out.ptr<uint16_t>() + t * P * qw + r * qw);
  return out;
}

}  // namespace

Status run_tp_check_simulated(const TpCheckOptions& o, const std::vector<int>& tp_sizes, int device,
                              std::vector<TpCheckReport>* reports) {
  M3_CHECK_ARG(!tp_sizes.empty(), "tp check: no tensor-parallel size to simulate");
  for (int p : tp_sizes) {
    M3_CHECK_ARG(p >= 1 && p <= kMaxRanks, "tp check: ranks must be in [1, ", kMaxRanks, "], got ",
                 p);
    M3_RETURN_IF_ERROR(rank_geometry(o.geometry, p).status());
  }
  M3_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  const Device dev = Device::cuda(device);
  CheckSetup setup;
  M3_RETURN_IF_ERROR(make_setup(o, 1, &setup));
  Result<std::unique_ptr<CudaStepMetadata>> meta = CudaStepMetadata::create(setup.cap);
  M3_RETURN_IF_ERROR(meta.status());
  const int64_t H = o.geometry.hidden;
  Result<CudaBuffer> hidden_d = CudaBuffer::create(static_cast<size_t>(setup.max_tokens * H * 2));
  M3_RETURN_IF_ERROR(hidden_d.status());
  CudaScope cs;
  M3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&cs.stream, cudaStreamNonBlocking));

  // Every step through one set of layers (each with its own pool, so steps build their caches);
  // per step: the bf16 outputs [T, hidden] and attention cores [T, n_q_r * 128] of every layer.
  auto run_steps = [&](std::vector<RankLayer>& layers, std::vector<std::vector<Tensor>>* outs,
                       std::vector<std::vector<Tensor>>* cores) -> Status {
    outs->clear();
    cores->clear();
    outs->resize(setup.plans.size());
    cores->resize(setup.plans.size());
    for (size_t s = 0; s < setup.plans.size(); ++s) {
      const int64_t T = setup.plans[s].num_tokens();
      TensorView hv;
      M3_RETURN_IF_ERROR(
          upload_step(o, setup, s, hidden_d.value(), *meta.value(), dev, cs.stream, &hv));
      for (RankLayer& rl : layers) {
        M3_RETURN_IF_ERROR(rl.layer->plan(*meta.value(), hv, rl.pool.caches));
        M3_RETURN_IF_ERROR(rl.layer->run(cs.stream));
        M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cs.stream));
        (*outs)[s].emplace_back(DType::kBF16, std::vector<int64_t>{T, H});
        M3_RETURN_IF_ERROR(download(rl.layer->attn_out().data, T * H * 2, &(*outs)[s].back()));
        const int64_t qw = int64_t{rl.layer->geometry().n_q} * kHeadDim;
        (*cores)[s].emplace_back(DType::kBF16, std::vector<int64_t>{T, qw});
        M3_RETURN_IF_ERROR(download(rl.layer->attn_core().data, T * qw * 2, &(*cores)[s].back()));
      }
    }
    return Status::Ok();
  };

  std::vector<std::vector<Tensor>> ref_out, ref_core;
  std::shared_ptr<CudaLayerWorkspace> tp1_workspace;
  {
    std::vector<RankLayer> ref(1);
    M3_RETURN_IF_ERROR(make_rank_layer(setup, o.sparse, 1, 0, dev, &tp1_workspace, &ref[0]));
    M3_RETURN_IF_ERROR(run_steps(ref, &ref_out, &ref_core));
  }
  if (reports) reports->clear();
  for (int P : tp_sizes) {
    std::vector<RankLayer> ranks(static_cast<size_t>(P));
    std::shared_ptr<CudaLayerWorkspace> workspace = P == 1 ? tp1_workspace : nullptr;
    for (int r = 0; r < P; ++r)
      M3_RETURN_IF_ERROR(
          make_rank_layer(setup, o.sparse, P, r, dev, &workspace, &ranks[static_cast<size_t>(r)]));
    std::vector<std::vector<Tensor>> partials, cores;
    M3_RETURN_IF_ERROR(run_steps(ranks, &partials, &cores));
    TpCheckReport rep;
    for (size_t s = 0; s < setup.plans.size(); ++s) {
      const int64_t T = setup.plans[s].num_tokens();
      // The reduction an all-reduce performs, as the CPU simulation does it (fp32, one rounding).
      Tensor out_tp(DType::kBF16, {T, H});
      std::vector<TensorView> views;
      for (const Tensor& p : partials[s]) views.push_back(p.view());
      M3_RETURN_IF_ERROR(sum_rank_partials(views, out_tp.view()));
      Result<TpComparison> c =
          compare_tp_output(out_tp, ref_out[s][0], partials[s], concat_cores(cores[s]),
                            ref_core[s][0], setup.weights.o, o.model);
      M3_RETURN_IF_ERROR(c.status());
      rep.steps.push_back(c.value());
    }
    if (reports) reports->push_back(std::move(rep));
  }
  return Status::Ok();
}

Status run_tp_check_rank(Communicator& comm, const TpCheckOptions& o, TpCheckReport* report) {
  const int P = comm.size(), rank = comm.rank();
  const MsaGeometry& g = o.geometry;
  M3_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm.device()));
  const Device dev = Device::cuda(comm.device());
  CheckSetup setup;
  M3_RETURN_IF_ERROR(make_setup(o, P, &setup));
  RankLayer mine, ref;
  std::shared_ptr<CudaLayerWorkspace> rank_workspace, tp1_workspace;
  M3_RETURN_IF_ERROR(make_rank_layer(setup, o.sparse, P, rank, dev, &rank_workspace, &mine));
  if (rank == 0)
    M3_RETURN_IF_ERROR(make_rank_layer(setup, o.sparse, 1, 0, dev, &tp1_workspace, &ref));
  Result<std::unique_ptr<CudaStepMetadata>> meta = CudaStepMetadata::create(setup.cap);
  M3_RETURN_IF_ERROR(meta.status());
  const std::vector<StepPlan>& plans = setup.plans;
  const int64_t max_t = setup.max_tokens;
  const int64_t H = g.hidden, qw = int64_t{mine.layer->geometry().n_q} * kHeadDim;
  auto buffer = [](int64_t bytes) { return CudaBuffer::create(static_cast<size_t>(bytes)); };
  Result<CudaBuffer> hidden_d = buffer(max_t * H * 2), partial_d = buffer(max_t * H * 2),
                     partials_all = buffer(P * max_t * H * 2),
                     cores_all = buffer(P * max_t * qw * 2);
  for (const auto* b : {&hidden_d, &partial_d, &partials_all, &cores_all})
    M3_RETURN_IF_ERROR(b->status());
  CudaScope cs;
  M3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&cs.stream, cudaStreamNonBlocking));
  cudaStream_t stream = cs.stream;
  auto* layer = &mine.layer;

  if (report) *report = TpCheckReport{};
  Tensor last_eager;
  for (size_t s = 0; s < plans.size(); ++s) {
    const int64_t T = plans[s].num_tokens();
    TensorView hv;
    M3_RETURN_IF_ERROR(upload_step(o, setup, s, hidden_d.value(), *meta.value(), dev, stream, &hv));
    M3_RETURN_IF_ERROR((*layer)->plan(*meta.value(), hv, mine.pool.caches));
    M3_RETURN_IF_ERROR((*layer)->run(stream));
    void* out = (*layer)->attn_out().data;
    M3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(partial_d.value().data(), out,
                                            static_cast<size_t>(T * H * 2),
                                            cudaMemcpyDeviceToDevice, stream));
    M3_RETURN_IF_ERROR(comm.all_reduce_bf16_sum(out, T * H, stream));
    M3_RETURN_IF_ERROR(
        comm.all_gather(partial_d.value().data(), partials_all.value().data(), T * H * 2, stream));
    M3_RETURN_IF_ERROR(
        comm.all_gather((*layer)->attn_core().data, cores_all.value().data(), T * qw * 2, stream));
    M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    M3_RETURN_IF_ERROR(comm.check_async_error());
    if (rank != 0) continue;

    Tensor out_tp(DType::kBF16, {T, H}), out_1(DType::kBF16, {T, H});
    M3_RETURN_IF_ERROR(download(out, T * H * 2, &out_tp));
    std::vector<Tensor> partials, cores;
    for (int r = 0; r < P; ++r) {
      partials.emplace_back(DType::kBF16, std::vector<int64_t>{T, H});
      M3_RETURN_IF_ERROR(download(partials_all.value().ptr<uint8_t>() + r * T * H * 2, T * H * 2,
                                  &partials.back()));
      // Rank r's heads are TP1 heads [r*n_q/P, (r+1)*n_q/P).
      cores.emplace_back(DType::kBF16, std::vector<int64_t>{T, qw});
      M3_RETURN_IF_ERROR(
          download(cores_all.value().ptr<uint8_t>() + r * T * qw * 2, T * qw * 2, &cores.back()));
    }
    M3_RETURN_IF_ERROR(ref.layer->plan(*meta.value(), hv, ref.pool.caches));
    M3_RETURN_IF_ERROR(ref.layer->run(stream));
    M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    Tensor core_1(DType::kBF16, {T, int64_t{g.n_q} * kHeadDim});
    M3_RETURN_IF_ERROR(download(ref.layer->attn_out().data, T * H * 2, &out_1));
    M3_RETURN_IF_ERROR(download(ref.layer->attn_core().data, core_1.nbytes(), &core_1));
    Result<TpComparison> c = compare_tp_output(out_tp, out_1, partials, concat_cores(cores), core_1,
                                               setup.weights.o, o.model);
    M3_RETURN_IF_ERROR(c.status());
    if (report) report->steps.push_back(c.value());
    if (s + 1 == plans.size()) last_eager = std::move(out_tp);
  }

  if (o.graph) {
    // The last step again, captured: the layer's launches and the all-reduce in one graph. The
    // caches already hold this step's K/V (rewritten with the same values), so the replay must
    // reproduce the eager output byte for byte.
    const int64_t T = plans.back().num_tokens();
    void* out = (*layer)->attn_out().data;
    M3_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    Status st = (*layer)->run(stream);
    if (st.ok()) st = comm.all_reduce_bf16_sum(out, T * H, stream);
    const cudaError_t end = cudaStreamEndCapture(stream, &cs.graph);
    M3_RETURN_IF_ERROR(st);
    M3_CUDA_RETURN_IF_ERROR(end);
    M3_CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&cs.exec, cs.graph, 0));
    M3_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out, 0xA5, static_cast<size_t>(T * H * 2), stream));
    M3_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(cs.exec, stream));
    M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    M3_RETURN_IF_ERROR(comm.check_async_error());
    if (rank == 0 && report) {
      Tensor replay(DType::kBF16, {T, H});
      M3_RETURN_IF_ERROR(download(out, T * H * 2, &replay));
      report->graph_checked = true;
      report->graph_identical =
          last_eager.nbytes() == replay.nbytes() &&
          std::equal(replay.ptr<uint8_t>(), replay.ptr<uint8_t>() + replay.nbytes(),
                     last_eager.ptr<uint8_t>());
    }
  }
  return Status::Ok();
}

#else  // no CUDA

Status run_tp_check_rank(Communicator&, const TpCheckOptions&, TpCheckReport*) {
  return unsupported("the tensor-parallel check needs the CUDA backend (this m3attn has none)");
}
Status run_tp_check_simulated(const TpCheckOptions&, const std::vector<int>&, int,
                              std::vector<TpCheckReport>*) {
  return unsupported("the tensor-parallel check needs the CUDA backend (this m3attn has none)");
}

#endif

}  // namespace m3attn
